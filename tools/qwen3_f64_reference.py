#!/usr/bin/env python3
"""An independent f64 forward pass of an f32 `qwen3` / `qwen3moe` GGUF (numpy only), to judge
disagreements between Tessera and llama.cpp.

    python3 tools/qwen3_f64_reference.py F.gguf N OUT.npy

feeds ids 1..N as one prompt (as `llama-anchor cpu-logits F N` does), writes every position's
logits (f64 [N, n_vocab]) to OUT.npy and prints the five smallest router margins (probability of
the k-th expert minus the (k+1)-th: a near-tie that f32 rounding may flip) with their layer and
position. Dense files print none. Plain NEOX rope over the whole head, q/k RMS norms, GQA,
renormalised top-k (llama.cpp's qwen3 / qwen3moe graphs).
"""
import struct, sys, numpy as np
f = open(sys.argv[1], 'rb').read(); p = 0
def rd(fmt):
    global p; v = struct.unpack_from(fmt, f, p); p += struct.calcsize(fmt); return v
def rstr():
    (n,) = rd('<Q'); global p; s = f[p:p+n].decode(); p += n; return s
SZ = {0:'<B',1:'<b',2:'<H',3:'<h',4:'<I',5:'<i',6:'<f',7:'<?',10:'<Q',11:'<q',12:'<d'}
def rval(t):
    if t == 8: return rstr()
    if t == 9:
        (et, n) = rd('<IQ'); return [rval(et) for _ in range(n)]
    return rd(SZ[t])[0]
magic, ver, nt, nkv = rd('<4sIQQ')
meta = {}
for _ in range(nkv):
    k = rstr(); (t,) = rd('<I'); meta[k] = rval(t)
infos = []
for _ in range(nt):
    name = rstr(); (nd,) = rd('<I'); dims = rd('<%dQ' % nd); (t, off) = rd('<IQ'); infos.append((name, dims, t, off))
al = meta.get('general.alignment', 32); data = (p + al - 1) // al * al
W = {}
for name, dims, t, off in infos:
    if t != 0:
        sys.exit(f'{name}: only f32 tensors are read (type {t})')
    n = int(np.prod(dims)); a = np.frombuffer(f, np.float32, n, data + off).astype(np.float64)
    W[name] = a.reshape(tuple(reversed(dims)))  # numpy order: [ne3.., ne1, ne0]
A = meta['general.architecture']; g = lambda k: meta[A + '.' + k]
L, E, H, HKV, D = g('block_count'), g('embedding_length'), g('attention.head_count'), g('attention.head_count_kv'), g('attention.key_length')
eps, base, K = g('attention.layer_norm_rms_epsilon'), g('rope.freq_base'), meta.get(A + '.expert_used_count', 0)
N = int(sys.argv[2]); ids = np.arange(1, N + 1)
def rms(x, w): return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w
def rope(x):  # x [N, h, D], NEOX
    half = D // 2; inv = base ** (-np.arange(half) * 2.0 / D); ang = np.arange(N)[:, None] * inv[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * c - b * s, a * s + b * c], -1)
x = W['token_embd.weight'][ids]
margins = []
for il in range(L):
    P = lambda n: W[f'blk.{il}.{n}']
    h = rms(x, P('attn_norm.weight'))
    q = (h @ P('attn_q.weight').T).reshape(N, H, D); k = (h @ P('attn_k.weight').T).reshape(N, HKV, D); v = (h @ P('attn_v.weight').T).reshape(N, HKV, D)
    q = rope(rms(q, P('attn_q_norm.weight'))); k = rope(rms(k, P('attn_k_norm.weight')))
    o = np.zeros((N, H, D))
    for hh in range(H):
        kv = hh // (H // HKV); sc = q[:, hh] @ k[:, kv].T / np.sqrt(D)
        sc = np.where(np.tril(np.ones((N, N))) > 0, sc, -np.inf); sc = np.exp(sc - sc.max(-1, keepdims=True)); sc /= sc.sum(-1, keepdims=True)
        o[:, hh] = sc @ v[:, kv]
    x = x + o.reshape(N, H * D) @ P('attn_output.weight').T
    h = rms(x, P('ffn_norm.weight'))
    if f'blk.{il}.ffn_gate_inp.weight' not in W:  # dense
        gt, up = h @ P('ffn_gate.weight').T, h @ P('ffn_up.weight').T
        x = x + (gt / (1 + np.exp(-gt)) * up) @ P('ffn_down.weight').T
        continue
    logits = h @ P('ffn_gate_inp.weight').T; pr = np.exp(logits - logits.max(-1, keepdims=True)); pr /= pr.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for t in range(N):
        order = np.argsort(-pr[t], kind='stable'); sel = order[:K]; w = pr[t, sel] / pr[t, sel].sum()
        margins.append((il, t, pr[t, order[K - 1]] - pr[t, order[K]], order[:K + 1]))
        for e, we in zip(sel, w):
            gt = P('ffn_gate_exps.weight')[e] @ h[t]; up = P('ffn_up_exps.weight')[e] @ h[t]
            out[t] += we * (P('ffn_down_exps.weight')[e] @ (gt / (1 + np.exp(-gt)) * up))
    x = x + out
x = rms(x, W['output_norm.weight'])
head = W['output.weight'] if 'output.weight' in W else W['token_embd.weight']
logits = x @ head.T
np.save(sys.argv[3], logits)
for m in sorted(margins, key=lambda m: m[2])[:5]: print('layer %d pos %d margin %.3e order %s' % m)
