//! flash_attn_ext properties, on the CPU backend and on the f64 reference backend:
//!
//! 1. Paged attention over a shared cache whose blocks sit at randomly shuffled places equals
//!    attention over the contiguous K/V, bit for bit (cells nobody points at hold NaN, so reading
//!    one would show).
//! 2. Grouped-query broadcast (query head `h` reads kv head `h / (n_head / n_head_kv)`) equals
//!    attention over K/V whose kv heads were repeated explicitly, bit for bit.
//! 3. A causal mask equals a hand-written f64 loop over the visible positions; a fully masked row
//!    is zeros; softcapping follows `softcap * tanh(scale * q.k / softcap)`.
//! 4. Bad shapes and dtypes are build errors; an out-of-range block-table entry is a kernel error
//!    at run time, the same on both backends.
//! 5. A ragged (varlen) batch gives exactly the outputs of running each of its sequences alone
//!    through the dense op with a causal mask, bit for bit on both backends; padding tokens are
//!    zeros; K/V past a sequence's kv length and the table rows of empty sequences are never read
//!    (NaN and garbage there change nothing); bad offsets and kv lengths are kernel errors.

use tessera_cpu::{CpuBackend, ReferenceBackend};
use tessera_graph::{Backend, BackendError, ExecError, Graph, GraphError, Session, Tensor};
use tessera_ops::{DType, KernelError, OpError};

const F32: DType = DType::F32;
const F16: DType = DType::F16;
const BF16: DType = DType::BF16;
const I32: DType = DType::I32;

/// xorshift64*: deterministic test data.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn uniform(&mut self) -> f64 {
        2.0 * (self.next() >> 11) as f64 / (1u64 << 53) as f64 - 1.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    /// `n` values uniform in `[-1, 1)`, rounded to `dtype` (so every backend sees exactly them).
    fn values(&mut self, n: usize, dtype: DType) -> Vec<f64> {
        (0..n).map(|_| dtype.round(self.uniform())).collect()
    }
    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i + 1));
        }
    }
}

/// A graph, the values of its leaves and the tensors to read.
struct Case {
    graph: Graph,
    fills: Vec<(Tensor, Vec<f64>)>,
    outputs: Vec<Tensor>,
}

impl Case {
    fn new() -> Self {
        Case { graph: Graph::new(), fills: Vec::new(), outputs: Vec::new() }
    }

    fn leaf(&mut self, name: &str, dtype: DType, ne: [usize; 4], values: Vec<f64>) -> Tensor {
        let t = self.graph.input(name, dtype, ne).expect("leaf");
        assert_eq!(values.len(), ne.iter().product::<usize>(), "{name}: fill size");
        self.fills.push((t, values));
        t
    }

    fn output(&mut self, t: Tensor) {
        self.graph.mark_output(t).expect("output");
        self.outputs.push(t);
    }

    fn run(&self, backend: &mut dyn Backend) -> Result<Vec<Vec<f64>>, ExecError> {
        let mut s = Session::new(&self.graph, backend)?;
        for (t, v) in &self.fills {
            s.set_f64(*t, v)?;
        }
        s.run()?;
        self.outputs.iter().map(|&t| s.get_f64(t)).collect()
    }

    /// The outputs on the CPU backend and on the reference backend, in that order.
    fn run_both(&self) -> [Vec<Vec<f64>>; 2] {
        [
            self.run(&mut CpuBackend::new()).expect("cpu run"),
            self.run(&mut ReferenceBackend::new()).expect("reference run"),
        ]
    }
}

const BACKENDS: [&str; 2] = ["cpu", "ref"];

fn nmse(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let err: f64 = got.iter().zip(want).map(|(g, w)| (g - w) * (g - w)).sum();
    let norm: f64 = want.iter().map(|w| w * w).sum();
    if norm == 0.0 { err } else { err / norm }
}

fn assert_bitwise(a: &[f64], b: &[f64], what: &str) {
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(x.to_bits() == y.to_bits(), "{what}: element {i} differs: {x} vs {y}");
    }
}

/// Sizes of one attention problem.
#[derive(Clone, Copy, Debug)]
struct Dims {
    d_k: usize,
    d_v: usize,
    n_tokens: usize,
    n_head: usize,
    n_head_kv: usize,
    n_kv: usize,
    n_seq: usize,
}

// ---- 1. paged == contiguous ----

/// Scatters each sequence's K/V rows, in blocks of `block` cells, to shuffled block positions of a
/// cache with `spare` unused blocks, and checks paged attention over it equals contiguous
/// attention bit for bit on both backends.
fn paged_equals_contiguous(seed: u64, dims: Dims, kv: DType, block: usize, with_mask: bool) {
    let Dims { d_k, d_v, n_tokens, n_head, n_head_kv, n_kv, n_seq } = dims;
    let mut rng = Rng::new(seed);
    let k = rng.values(d_k * n_kv * n_head_kv * n_seq, kv);
    let v = rng.values(d_v * n_kv * n_head_kv * n_seq, kv);
    let blocks_per_seq = n_kv.div_ceil(block);
    let n_blocks = blocks_per_seq * n_seq + 3;
    let n_cells = n_blocks * block;
    let mut places: Vec<usize> = (0..n_blocks).collect();
    rng.shuffle(&mut places);
    // Unused cells hold NaN: reading any of them would poison the result.
    let mut kc = vec![f64::NAN; d_k * n_cells * n_head_kv];
    let mut vc = vec![f64::NAN; d_v * n_cells * n_head_kv];
    let mut table = vec![0.0; n_kv * n_seq];
    for s in 0..n_seq {
        for j in 0..n_kv {
            let cell = places[s * blocks_per_seq + j / block] * block + j % block;
            table[j + n_kv * s] = cell as f64;
            for hk in 0..n_head_kv {
                let (src, dst) = ((j + n_kv * (hk + n_head_kv * s)), cell + n_cells * hk);
                kc[d_k * dst..d_k * (dst + 1)].copy_from_slice(&k[d_k * src..d_k * (src + 1)]);
                vc[d_v * dst..d_v * (dst + 1)].copy_from_slice(&v[d_v * src..d_v * (src + 1)]);
            }
        }
    }
    let mut c = Case::new();
    let q = c.leaf("q", F32, [d_k, n_tokens, n_head, n_seq], rng.values(d_k * n_tokens * n_head * n_seq, F32));
    let mask = with_mask.then(|| {
        // causal over the last n_tokens positions, plus a few random holes
        let mut m = vec![0.0; n_kv * n_tokens * n_seq];
        for s in 0..n_seq {
            for t in 0..n_tokens {
                for j in 0..n_kv {
                    let hidden = j > n_kv - n_tokens + t || (j % 11 == 5 && rng.below(2) == 0);
                    m[j + n_kv * (t + n_tokens * s)] = if hidden { f64::NEG_INFINITY } else { 0.0 };
                }
            }
        }
        c.leaf("mask", F16, [n_kv, n_tokens, 1, n_seq], m)
    });
    let k = c.leaf("k", kv, [d_k, n_kv, n_head_kv, n_seq], k);
    let v = c.leaf("v", kv, [d_v, n_kv, n_head_kv, n_seq], v);
    let kc = c.leaf("k_cache", kv, [d_k, n_cells, n_head_kv, 1], kc);
    let vc = c.leaf("v_cache", kv, [d_v, n_cells, n_head_kv, 1], vc);
    let t = c.leaf("table", I32, [n_kv, n_seq, 1, 1], table);
    let scale = 1.0 / (d_k as f32).sqrt();
    let contiguous = c.graph.flash_attn_ext(q, k, v, mask, None, scale, 0.0).unwrap();
    let paged = c.graph.flash_attn_ext(q, kc, vc, mask, Some(t), scale, 0.0).unwrap();
    c.output(contiguous);
    c.output(paged);
    let outs = c.run_both();
    for (name, out) in BACKENDS.iter().zip(&outs) {
        assert!(out[0].iter().all(|x| x.is_finite()), "{name}: non-finite output");
        assert_bitwise(&out[1], &out[0], &format!("{name}: paged vs contiguous, {dims:?} {kv}"));
    }
    let e = nmse(&outs[0][0], &outs[1][0]);
    assert!(e < 1e-10, "cpu vs reference NMSE {e:e}");
}

#[test]
fn paged_decode_with_shuffled_blocks_is_exact() {
    // Qwen3.6 27B attention heads: 24 query heads over 4 kv heads of dim 256.
    let dims = Dims { d_k: 256, d_v: 256, n_tokens: 1, n_head: 24, n_head_kv: 4, n_kv: 300, n_seq: 3 };
    paged_equals_contiguous(1, dims, F16, 16, true);
    // MoE model: 16 over 2, a cache length that is not a multiple of the block.
    let dims = Dims { d_k: 256, d_v: 256, n_tokens: 1, n_head: 16, n_head_kv: 2, n_kv: 77, n_seq: 2 };
    paged_equals_contiguous(2, dims, BF16, 16, false);
}

#[test]
fn paged_prefill_with_shuffled_blocks_is_exact() {
    let dims = Dims { d_k: 128, d_v: 128, n_tokens: 7, n_head: 8, n_head_kv: 2, n_kv: 64 + 7, n_seq: 2 };
    paged_equals_contiguous(3, dims, F16, 16, true);
    let dims = Dims { d_k: 40, d_v: 24, n_tokens: 3, n_head: 3, n_head_kv: 3, n_kv: 80, n_seq: 1 };
    paged_equals_contiguous(4, dims, F32, 16, false);
    // blocks of 1 cell: every position placed independently
    let dims = Dims { d_k: 32, d_v: 32, n_tokens: 2, n_head: 4, n_head_kv: 1, n_kv: 45, n_seq: 3 };
    paged_equals_contiguous(5, dims, F32, 1, true);
}

// ---- 2. GQA broadcast == repeated kv heads ----

fn gqa_equals_repeat(seed: u64, dims: Dims, kv: DType, softcap: f32) {
    let Dims { d_k, d_v, n_tokens, n_head, n_head_kv, n_kv, n_seq } = dims;
    let group = n_head / n_head_kv;
    let mut rng = Rng::new(seed);
    let k = rng.values(d_k * n_kv * n_head_kv * n_seq, kv);
    let v = rng.values(d_v * n_kv * n_head_kv * n_seq, kv);
    // repeat each kv head `group` times, grouped: head h of the copy is kv head h / group
    let repeat = |x: &[f64], d: usize| {
        let mut out = Vec::with_capacity(x.len() * group);
        for s in 0..n_seq {
            for h in 0..n_head {
                let at = d * n_kv * (h / group + n_head_kv * s);
                out.extend_from_slice(&x[at..at + d * n_kv]);
            }
        }
        out
    };
    let (kr, vr) = (repeat(&k, d_k), repeat(&v, d_v));
    let mut c = Case::new();
    let q = c.leaf("q", F32, [d_k, n_tokens, n_head, n_seq], rng.values(d_k * n_tokens * n_head * n_seq, F32));
    let m = (0..n_kv * n_tokens).map(|i| if i % 7 == 3 { f64::NEG_INFINITY } else { 0.25 * rng.uniform() }).collect();
    let mask = c.leaf("mask", F32, [n_kv, n_tokens, 1, 1], m);
    let k = c.leaf("k", kv, [d_k, n_kv, n_head_kv, n_seq], k);
    let v = c.leaf("v", kv, [d_v, n_kv, n_head_kv, n_seq], v);
    let kr = c.leaf("k_rep", kv, [d_k, n_kv, n_head, n_seq], kr);
    let vr = c.leaf("v_rep", kv, [d_v, n_kv, n_head, n_seq], vr);
    let shared = c.graph.flash_attn_ext(q, k, v, Some(mask), None, 0.1, softcap).unwrap();
    let repeated = c.graph.flash_attn_ext(q, kr, vr, Some(mask), None, 0.1, softcap).unwrap();
    c.output(shared);
    c.output(repeated);
    let outs = c.run_both();
    for (name, out) in BACKENDS.iter().zip(&outs) {
        assert_bitwise(&out[0], &out[1], &format!("{name}: gqa vs repeated, {dims:?}"));
    }
    let e = nmse(&outs[0][0], &outs[1][0]);
    assert!(e < 1e-10, "cpu vs reference NMSE {e:e}");
}

#[test]
fn gqa_broadcast_equals_repeated_kv_heads() {
    let dims = Dims { d_k: 256, d_v: 256, n_tokens: 1, n_head: 24, n_head_kv: 4, n_kv: 130, n_seq: 1 };
    gqa_equals_repeat(10, dims, F16, 0.0);
    let dims = Dims { d_k: 128, d_v: 64, n_tokens: 5, n_head: 16, n_head_kv: 2, n_kv: 67, n_seq: 2 };
    gqa_equals_repeat(11, dims, BF16, 0.0);
    let dims = Dims { d_k: 33, d_v: 17, n_tokens: 9, n_head: 6, n_head_kv: 3, n_kv: 70, n_seq: 3 };
    gqa_equals_repeat(12, dims, F32, 5.0);
}

// ---- 3. hand loops: causal mask, fully masked rows, softcap ----

/// Attention by hand in f64: query `(t, h, s)` sees positions `0 .. visible(t)` (all others are
/// masked), logits `scale * q.k` (softcapped when `softcap > 0`). Output `[d_v, n_head, n_tokens,
/// n_seq]`; rows with nothing visible are zeros.
#[allow(clippy::too_many_arguments)]
fn hand_attention(
    dims: Dims,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    scale: f64,
    softcap: f64,
    visible: impl Fn(usize) -> usize,
) -> Vec<f64> {
    let Dims { d_k, d_v, n_tokens, n_head, n_head_kv, n_kv, n_seq } = dims;
    let mut out = vec![0.0; d_v * n_head * n_tokens * n_seq];
    for s in 0..n_seq {
        for t in 0..n_tokens {
            for h in 0..n_head {
                let hk = h / (n_head / n_head_kv);
                let qrow = &q[d_k * (t + n_tokens * (h + n_head * s))..][..d_k];
                let logits: Vec<f64> = (0..visible(t))
                    .map(|j| {
                        let krow = &k[d_k * (j + n_kv * (hk + n_head_kv * s))..][..d_k];
                        let x = scale * qrow.iter().zip(krow).map(|(a, b)| a * b).sum::<f64>();
                        if softcap > 0.0 { softcap * (x / softcap).tanh() } else { x }
                    })
                    .collect();
                let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = logits.iter().map(|l| (l - max).exp()).collect();
                let total: f64 = w.iter().sum();
                let o = &mut out[d_v * (h + n_head * (t + n_tokens * s))..][..d_v];
                for (j, wj) in w.iter().enumerate() {
                    let vrow = &v[d_v * (j + n_kv * (hk + n_head_kv * s))..][..d_v];
                    for (oi, vi) in o.iter_mut().zip(vrow) {
                        *oi += wj * vi / total;
                    }
                }
            }
        }
    }
    out
}

/// A causal prefill: `n_tokens` new tokens after `n_kv - n_tokens` cached ones, through a padded
/// mask (more rows than tokens) in `mask_dt`, with q read through a permuted view.
fn causal_prefill(seed: u64, dims: Dims, kv: DType, mask_dt: DType, softcap: f32) {
    let Dims { d_k, d_v, n_tokens, n_head, n_head_kv, n_kv, n_seq } = dims;
    let n_past = n_kv - n_tokens;
    let mut rng = Rng::new(seed);
    let q = rng.values(d_k * n_tokens * n_head * n_seq, F32);
    let k = rng.values(d_k * n_kv * n_head_kv * n_seq, kv);
    let v = rng.values(d_v * n_kv * n_head_kv * n_seq, kv);
    let rows = n_tokens + 3; // padding rows, never read
    let mut m = vec![f64::NEG_INFINITY; n_kv * rows];
    for t in 0..n_tokens {
        m[n_kv * t..n_kv * t + n_past + t + 1].fill(0.0);
    }
    // q as the permuted view of a [d_k, n_head, n_tokens, n_seq] projection
    let mut q_proj = vec![0.0; q.len()];
    for s in 0..n_seq {
        for h in 0..n_head {
            for t in 0..n_tokens {
                let (from, to) = (t + n_tokens * (h + n_head * s), h + n_head * (t + n_tokens * s));
                q_proj[d_k * to..d_k * (to + 1)].copy_from_slice(&q[d_k * from..d_k * (from + 1)]);
            }
        }
    }
    let mut c = Case::new();
    let qp = c.leaf("q_proj", F32, [d_k, n_head, n_tokens, n_seq], q_proj);
    let qv = c.graph.permute(qp, [0, 2, 1, 3]).unwrap();
    let kt = c.leaf("k", kv, [d_k, n_kv, n_head_kv, n_seq], k.clone());
    let vt = c.leaf("v", kv, [d_v, n_kv, n_head_kv, n_seq], v.clone());
    let mt = c.leaf("mask", mask_dt, [n_kv, rows, 1, 1], m);
    let scale = 1.0 / (d_k as f32).sqrt();
    let out = c.graph.flash_attn_ext(qv, kt, vt, Some(mt), None, scale, softcap).unwrap();
    c.output(out);
    let want = hand_attention(dims, &q, &k, &v, f64::from(scale), f64::from(softcap), |t| n_past + t + 1);
    for (name, got) in BACKENDS.iter().zip(c.run_both()) {
        let e = nmse(&got[0], &want);
        assert!(e < 1e-11, "{name}: causal prefill {dims:?} softcap {softcap}: NMSE {e:e}");
    }
}

#[test]
fn causal_prefill_equals_a_hand_loop() {
    let dims = Dims { d_k: 256, d_v: 256, n_tokens: 7, n_head: 24, n_head_kv: 4, n_kv: 7 + 57, n_seq: 1 };
    causal_prefill(20, dims, F32, F16, 0.0);
    let dims = Dims { d_k: 128, d_v: 128, n_tokens: 7, n_head: 4, n_head_kv: 2, n_kv: 7, n_seq: 2 };
    causal_prefill(21, dims, F32, F32, 0.0);
    // a chunk boundary (64 positions) inside the visible range, f16 K/V
    let dims = Dims { d_k: 64, d_v: 48, n_tokens: 11, n_head: 2, n_head_kv: 1, n_kv: 150, n_seq: 1 };
    causal_prefill(22, dims, F16, F16, 0.0);
}

#[test]
fn softcap_follows_the_tanh_formula() {
    for softcap in [0.5, 3.0, 30.0] {
        let dims = Dims { d_k: 64, d_v: 32, n_tokens: 4, n_head: 4, n_head_kv: 2, n_kv: 90, n_seq: 2 };
        causal_prefill(30, dims, F32, F32, softcap);
    }
    // a large scale saturates tanh: logits stay within (-softcap, softcap)
    let mut rng = Rng::new(31);
    let mut c = Case::new();
    let q = c.leaf("q", F32, [16, 1, 1, 1], rng.values(16, F32));
    let k = c.leaf("k", F32, [16, 2, 1, 1], rng.values(32, F32));
    let v = c.leaf("v", F32, [1, 2, 1, 1], vec![1.0, 0.0]);
    let out = c.graph.flash_attn_ext(q, k, v, None, None, 1e6, 2.0).unwrap();
    c.output(out);
    for (name, got) in BACKENDS.iter().zip(c.run_both()) {
        // weights e^(+-2) / (e^2 + e^-2) or 1/2: never the 0/1 of an uncapped softmax
        let w = got[0][0];
        let e4 = 1.0 / (1.0 + (-4f64).exp());
        let ok = [e4, 1.0 - e4, 0.5].iter().any(|x| (w - x).abs() < 1e-6);
        assert!(ok, "{name}: saturated softcap weight {w}");
    }
}

#[test]
fn fully_masked_rows_are_zero() {
    let dims = Dims { d_k: 32, d_v: 16, n_tokens: 3, n_head: 4, n_head_kv: 2, n_kv: 100, n_seq: 2 };
    let Dims { d_k, d_v, n_tokens, n_head, n_head_kv, n_kv, n_seq } = dims;
    let mut rng = Rng::new(40);
    let q = rng.values(d_k * n_tokens * n_head * n_seq, F32);
    let k = rng.values(d_k * n_kv * n_head_kv * n_seq, F16);
    let v = rng.values(d_v * n_kv * n_head_kv * n_seq, F16);
    // per sequence: token 1 sees nothing; token 0 sees everything, token 2 only position 99
    let mut m = vec![0.0; n_kv * n_tokens * n_seq];
    for s in 0..n_seq {
        let base = n_kv * n_tokens * s;
        m[base + n_kv..base + 2 * n_kv].fill(f64::NEG_INFINITY);
        m[base + 2 * n_kv..base + 3 * n_kv - 1].fill(f64::NEG_INFINITY);
    }
    let mut c = Case::new();
    let qt = c.leaf("q", F32, [d_k, n_tokens, n_head, n_seq], q.clone());
    let kt = c.leaf("k", F16, [d_k, n_kv, n_head_kv, n_seq], k.clone());
    let vt = c.leaf("v", F16, [d_v, n_kv, n_head_kv, n_seq], v.clone());
    let mt = c.leaf("mask", F16, [n_kv, n_tokens, 1, n_seq], m);
    let out = c.graph.flash_attn_ext(qt, kt, vt, Some(mt), None, 0.3, 0.0).unwrap();
    c.output(out);
    let all = hand_attention(dims, &q, &k, &v, 0.3, 0.0, |_| n_kv);
    for (name, got) in BACKENDS.iter().zip(c.run_both()) {
        let got = &got[0];
        for s in 0..n_seq {
            for h in 0..n_head {
                let row = |t: usize| d_v * (h + n_head * (t + n_tokens * s));
                let g0 = &got[row(0)..row(0) + d_v];
                assert!(nmse(g0, &all[row(0)..row(0) + d_v]) < 1e-11, "{name}: unmasked row");
                assert!(got[row(1)..row(1) + d_v].iter().all(|&x| x == 0.0), "{name}: masked row not zero");
                // only position 99 visible: the output is v[:, 99] exactly
                let hk = h / 2;
                let v99 = &v[d_v * (99 + n_kv * (hk + n_head_kv * s))..][..d_v];
                assert_bitwise(&got[row(2)..row(2) + d_v], v99, &format!("{name}: single visible position"));
            }
        }
    }
}

// ---- 4. errors ----

fn build_error(build: impl FnOnce(&mut Graph) -> Result<Tensor, GraphError>) -> OpError {
    let mut g = Graph::new();
    match build(&mut g) {
        Err(GraphError::Op(e)) => {
            assert_eq!(e.op(), "flash_attn_ext");
            e
        }
        other => panic!("expected a shape error, got {other:?}"),
    }
}

#[test]
fn bad_shapes_and_dtypes_are_build_errors() {
    let e = build_error(|g| {
        let q = g.input("q", F32, [64, 1, 6, 1])?;
        let k = g.input("k", F16, [64, 10, 4, 1])?;
        g.flash_attn_ext(q, k, k, None, None, 1.0, 0.0)
    });
    assert!(matches!(e, OpError::ShapeMismatch { .. }) && e.to_string().contains("multiple"), "{e}");
    let e = build_error(|g| {
        let q = g.input("q", F32, [128, 1, 8, 1])?;
        let k = g.input("k", F16, [64, 10, 4, 1])?;
        g.flash_attn_ext(q, k, k, None, None, 1.0, 0.0)
    });
    assert!(e.to_string().contains("d_k"), "{e}");
    let e = build_error(|g| {
        let q = g.input("q", F32, [64, 7, 8, 1])?;
        let k = g.input("k", F16, [64, 10, 4, 1])?;
        let m = g.input("m", F16, [10, 6, 1, 1])?;
        g.flash_attn_ext(q, k, k, Some(m), None, 1.0, 0.0)
    });
    assert!(e.to_string().contains("n_tokens = 7"), "{e}");
    let e = build_error(|g| {
        let q = g.input("q", F32, [64, 1, 8, 2])?;
        let k = g.input("k", F16, [64, 100, 4, 1])?;
        let t = g.input("t", F32, [10, 2, 1, 1])?;
        g.flash_attn_ext(q, k, k, None, Some(t), 1.0, 0.0)
    });
    assert!(matches!(e, OpError::DType { input: 3, .. }), "{e}");
    let e = build_error(|g| {
        let q = g.input("q", F32, [64, 1, 8, 2])?;
        let k = g.input("k", F16, [64, 100, 4, 1])?;
        let t = g.input("t", I32, [10, 3, 1, 1])?;
        g.flash_attn_ext(q, k, k, None, Some(t), 1.0, 0.0)
    });
    assert!(matches!(e, OpError::ShapeMismatch { .. }) && e.to_string().contains("block table"), "{e}");
    // a paged cache must have one sequence
    let e = build_error(|g| {
        let q = g.input("q", F32, [64, 1, 8, 2])?;
        let k = g.input("k", F16, [64, 100, 4, 2])?;
        let t = g.input("t", I32, [10, 2, 1, 1])?;
        g.flash_attn_ext(q, k, k, None, Some(t), 1.0, 0.0)
    });
    assert!(e.to_string().contains("paged"), "{e}");
    // the mask must cover the table's n_kv positions, not the cache's cells
    let e = build_error(|g| {
        let q = g.input("q", F32, [64, 1, 8, 2])?;
        let k = g.input("k", F16, [64, 100, 4, 1])?;
        let m = g.input("m", F16, [100, 1, 1, 2])?;
        let t = g.input("t", I32, [10, 2, 1, 1])?;
        g.flash_attn_ext(q, k, k, Some(m), Some(t), 1.0, 0.0)
    });
    assert!(e.to_string().contains("kv positions 10"), "{e}");
    // k/v rows must be dense
    let e = build_error(|g| {
        let q = g.input("q", F32, [10, 1, 4, 1])?;
        let kt = g.input("k", F16, [64, 10, 4, 1])?;
        let k = g.transpose(kt)?;
        let v = g.input("v", F16, [16, 64, 4, 1])?;
        g.flash_attn_ext(q, k, v, None, None, 1.0, 0.0)
    });
    assert!(matches!(e, OpError::NotContiguous { input: 1, .. }), "{e}");
}

#[test]
fn out_of_range_block_table_entries_fail_at_run_time() {
    for bad in [-3.0, 64.0, 1e6] {
        let mut rng = Rng::new(50);
        let mut c = Case::new();
        let q = c.leaf("q", F32, [16, 1, 4, 2], rng.values(128, F32));
        let k = c.leaf("k", F16, [16, 64, 2, 1], rng.values(16 * 64 * 2, F16));
        let v = c.leaf("v", F16, [16, 64, 2, 1], rng.values(16 * 64 * 2, F16));
        let mut cells: Vec<f64> = (0..40).map(|i| (i * 3 % 64) as f64).collect();
        cells[27] = bad;
        let t = c.leaf("table", I32, [20, 2, 1, 1], cells);
        let out = c.graph.flash_attn_ext(q, k, v, None, Some(t), 0.25, 0.0).unwrap();
        c.output(out);
        for (name, backend) in
            BACKENDS.iter().zip([&mut CpuBackend::new() as &mut dyn Backend, &mut ReferenceBackend::new()])
        {
            let e = c.run(backend).expect_err("the bad entry must be reported");
            let ExecError::Backend(BackendError::Kernel(KernelError::IndexOutOfRange { op, index, limit, .. })) = e
            else {
                panic!("{name}: unexpected error {e:?}")
            };
            assert_eq!((op, index, limit), ("flash_attn_ext", bad as i64, 64), "{name}");
        }
    }
}

// ---- the CPU's task split does not change the arithmetic ----

#[test]
fn results_do_not_depend_on_the_thread_count() {
    // The CPU sizes its tasks (heads per task) from the thread count; each query row's arithmetic
    // must stay the same.
    let mut rng = Rng::new(60);
    let mut c = Case::new();
    let q = c.leaf("q", F32, [64, 3, 12, 2], rng.values(64 * 3 * 12 * 2, F32));
    let k = c.leaf("k", F16, [64, 150, 2, 2], rng.values(64 * 150 * 2 * 2, F16));
    let v = c.leaf("v", F16, [48, 150, 2, 2], rng.values(48 * 150 * 2 * 2, F16));
    let m = (0..150 * 3).map(|i| if i % 9 == 4 { f64::NEG_INFINITY } else { 0.0 }).collect();
    let m = c.leaf("mask", F32, [150, 3, 1, 1], m);
    let out = c.graph.flash_attn_ext(q, k, v, Some(m), None, 0.125, 0.0).unwrap();
    c.output(out);
    let one = c.run(&mut CpuBackend::with_threads(1).unwrap()).unwrap();
    for threads in [2, 5, 16, 64] {
        let got = c.run(&mut CpuBackend::with_threads(threads).unwrap()).unwrap();
        assert_bitwise(&got[0], &one[0], &format!("{threads} threads vs 1"));
    }
}

// ---- 5. ragged == each sequence alone ----

/// One ragged batch: per sequence its token count and kv length, padding tokens before the first
/// and after the last sequence, paged or per-sequence K/V, and an optional mask.
struct Ragged {
    d: usize,
    n_head: usize,
    n_head_kv: usize,
    kv: DType,
    lens: Vec<usize>,
    kv_lens: Vec<usize>,
    lead: usize,
    pad: usize,
    /// Positions per sequence (the table's or k/v's n_kv), at least every kv length.
    n_kv: usize,
    paged: bool,
    mask: bool,
    softcap: f32,
}

/// Runs the ragged batch and, in the same graph, each non-empty sequence alone through the dense
/// op (its first `kv_len` positions, a causal mask combined with the ragged mask's rows), on the
/// CPU and the reference, and checks the ragged rows equal the dense ones bit for bit and padding
/// rows are zero. Positions past each kv length hold NaN (contiguous K/V) or garbage table
/// entries (paged), and empty sequences get garbage kv lengths and table rows.
fn ragged_equals_dense(seed: u64, r: &Ragged) {
    let Ragged { d, n_head, n_head_kv, kv, lead, pad, n_kv, paged, mask, softcap, .. } = *r;
    let (lens, kv_lens) = (&r.lens, &r.kv_lens);
    let n_seq = lens.len();
    let n_tokens = lead + lens.iter().sum::<usize>() + pad;
    let mut rng = Rng::new(seed);
    let mut offsets = vec![lead];
    for &l in lens {
        offsets.push(offsets.last().unwrap() + l);
    }
    let empty_kv_len = |s: usize| if s.is_multiple_of(2) { -5.0 } else { 1e6 };
    let kv_len_values: Vec<f64> =
        (0..n_seq).map(|s| if lens[s] == 0 { empty_kv_len(s) } else { kv_lens[s] as f64 }).collect();
    // K/V of each sequence's positions, [d, n_kv, n_head_kv] per sequence (NaN past kv_len)
    let mut k = vec![f64::NAN; d * n_kv * n_head_kv * n_seq];
    let mut v = k.clone();
    for (s, &kv_len) in kv_lens.iter().enumerate() {
        for hk in 0..n_head_kv {
            for j in 0..kv_len {
                let at = d * (j + n_kv * (hk + n_head_kv * s));
                k[at..at + d].copy_from_slice(&rng.values(d, kv));
                v[at..at + d].copy_from_slice(&rng.values(d, kv));
            }
        }
    }
    let q = rng.values(d * n_tokens * n_head, F32);
    let mvals: Vec<f64> = (0..n_kv * n_tokens)
        .map(|i| if i % 13 == 6 && i % n_kv != 0 { f64::NEG_INFINITY } else { 0.5 * rng.uniform() })
        .collect();
    let mut c = Case::new();
    let qt = c.leaf("q", F32, [d, n_tokens, n_head, 1], q.clone());
    let off = c.leaf("seq_offsets", I32, [n_seq + 1, 1, 1, 1], offsets.iter().map(|&o| o as f64).collect());
    let kvl = c.leaf("kv_lens", I32, [n_seq, 1, 1, 1], kv_len_values);
    let mt = mask.then(|| c.leaf("mask", F32, [n_kv, n_tokens, 1, 1], mvals.clone()));
    let scale = 1.0 / (d as f32).sqrt();
    // (k, v, table) of the ragged call
    let (kt, vt, table) = if paged {
        // every position of every sequence in its own shuffled cell; unused cells hold NaN
        let n_cells = n_kv * n_seq + 5;
        let mut places: Vec<usize> = (0..n_cells).collect();
        rng.shuffle(&mut places);
        let mut kc = vec![f64::NAN; d * n_cells * n_head_kv];
        let mut vc = kc.clone();
        let mut tab = vec![0.0; n_kv * n_seq];
        for s in 0..n_seq {
            for j in 0..n_kv {
                let cell = places[j + n_kv * s];
                // garbage where nothing may be read: past kv_len, and whole rows of empty sequences
                tab[j + n_kv * s] = if j < kv_lens[s] && lens[s] > 0 { cell as f64 } else { -1.0 - j as f64 };
                for hk in 0..n_head_kv {
                    let (src, dst) = (d * (j + n_kv * (hk + n_head_kv * s)), d * (cell + n_cells * hk));
                    kc[dst..dst + d].copy_from_slice(&k[src..src + d]);
                    vc[dst..dst + d].copy_from_slice(&v[src..src + d]);
                }
            }
        }
        let kc = c.leaf("k_cache", kv, [d, n_cells, n_head_kv, 1], kc);
        let vc = c.leaf("v_cache", kv, [d, n_cells, n_head_kv, 1], vc);
        let t = c.leaf("table", I32, [n_kv, n_seq, 1, 1], tab);
        (kc, vc, Some(t))
    } else {
        let kt = c.leaf("k", kv, [d, n_kv, n_head_kv, n_seq], k.clone());
        let vt = c.leaf("v", kv, [d, n_kv, n_head_kv, n_seq], v.clone());
        (kt, vt, None)
    };
    let ragged = c.graph.flash_attn_ext_ragged(qt, kt, vt, mt, table, off, kvl, scale, softcap).unwrap();
    c.output(ragged);
    // each sequence alone: q rows, its kv_len positions, causal (+ the ragged mask's rows) mask
    let mut alone = Vec::new();
    for s in (0..n_seq).filter(|&s| lens[s] > 0) {
        let (len, kv_len, t0) = (lens[s], kv_lens[s], offsets[s]);
        let mut qs = Vec::with_capacity(d * len * n_head);
        for h in 0..n_head {
            for t in t0..t0 + len {
                qs.extend_from_slice(&q[d * (t + n_tokens * h)..][..d]);
            }
        }
        let take = |x: &[f64]| {
            let mut out = Vec::with_capacity(d * kv_len * n_head_kv);
            for hk in 0..n_head_kv {
                out.extend_from_slice(&x[d * n_kv * (hk + n_head_kv * s)..][..d * kv_len]);
            }
            out
        };
        let mut m = vec![f64::NEG_INFINITY; kv_len * len];
        for i in 0..len {
            for j in 0..=kv_len - len + i {
                m[j + kv_len * i] = if mask { mvals[j + n_kv * (t0 + i)] } else { 0.0 };
            }
        }
        let qd = c.leaf("q_alone", F32, [d, len, n_head, 1], qs);
        let kd = c.leaf("k_alone", kv, [d, kv_len, n_head_kv, 1], take(&k));
        let vd = c.leaf("v_alone", kv, [d, kv_len, n_head_kv, 1], take(&v));
        let md = c.leaf("mask_alone", F32, [kv_len, len, 1, 1], m);
        let out = c.graph.flash_attn_ext(qd, kd, vd, Some(md), None, scale, softcap).unwrap();
        c.output(out);
        alone.push((s, out));
    }
    let outs = c.run_both();
    let row = d * n_head; // one token's output
    for (name, out) in BACKENDS.iter().zip(&outs) {
        let got = &out[0];
        let mut covered = vec![false; n_tokens];
        for (i, &(s, _)) in alone.iter().enumerate() {
            let (t0, len) = (offsets[s], lens[s]);
            covered[t0..t0 + len].fill(true);
            let what = format!("{name}: sequence {s} ({len} tokens over {}) vs alone", kv_lens[s]);
            assert_bitwise(&got[row * t0..row * (t0 + len)], &out[1 + i], &what);
        }
        for t in (0..n_tokens).filter(|&t| !covered[t]) {
            assert!(got[row * t..row * (t + 1)].iter().all(|&x| x == 0.0), "{name}: padding token {t} not zero");
        }
        assert!(got.iter().all(|x| x.is_finite()), "{name}: a NaN past a kv length was read");
    }
    let e = nmse(&outs[0][0], &outs[1][0]);
    assert!(e < 1e-10, "cpu vs reference NMSE {e:e}");
}

fn ragged(lens: &[usize], kv_lens: &[usize], n_kv: usize) -> Ragged {
    Ragged {
        d: 64,
        n_head: 4,
        n_head_kv: 2,
        kv: F16,
        lens: lens.to_vec(),
        kv_lens: kv_lens.to_vec(),
        lead: 0,
        pad: 0,
        n_kv,
        paged: false,
        mask: false,
        softcap: 0.0,
    }
}

#[test]
fn ragged_decode_equals_each_sequence_alone() {
    // 8 decode tokens over different cache lengths, one empty sequence, padding at the end
    let mut r = ragged(&[1, 1, 0, 1, 1, 1, 1, 1, 1], &[1, 70, 0, 64, 65, 129, 5, 200, 33], 200);
    r.pad = 3;
    ragged_equals_dense(70, &r);
    r.paged = true;
    r.kv = BF16;
    ragged_equals_dense(71, &r);
    // the 35B-A3B heads: 16 query heads over 2 kv heads of dim 256
    let mut r = ragged(&[1, 1, 1], &[300, 1, 77], 300);
    (r.d, r.n_head, r.n_head_kv, r.paged) = (256, 16, 2, true);
    ragged_equals_dense(72, &r);
}

#[test]
fn ragged_prefill_chunks_and_decodes_equal_each_sequence_alone() {
    // prefill chunks (a whole prompt, a continued one, a 1-token chunk) mixed with decodes and
    // empty sequences, padding before and after
    let lens = [130, 1, 0, 37, 1, 64, 0, 1, 3];
    let kv_lens = [130, 90, 0, 37 + 100, 2, 64 + 64, 0, 1, 3 + 61];
    let mut r = ragged(&lens, &kv_lens, 200);
    (r.lead, r.pad) = (2, 5);
    ragged_equals_dense(80, &r);
    r.paged = true;
    r.mask = true;
    ragged_equals_dense(81, &r);
    r.paged = false;
    (r.kv, r.softcap) = (F32, 4.0);
    ragged_equals_dense(82, &r);
}

#[test]
fn a_long_ragged_prefill_equals_it_alone() {
    // 300 tokens (several CPU tasks per kv head, several 64-position chunks) after 20 cached ones,
    // next to 31 decodes; head dim 128, GQA 8:2. CPU and reference both, so kept small in d.
    let mut lens = vec![300];
    let mut kv_lens = vec![320];
    for s in 0..31 {
        lens.push(1);
        kv_lens.push(1 + (s * 37) % 320);
    }
    let mut r = ragged(&lens, &kv_lens, 320);
    (r.d, r.n_head, r.n_head_kv, r.paged, r.pad) = (32, 8, 2, true, 1);
    ragged_equals_dense(90, &r);
}

/// A small ragged call with these offsets and kv lengths (3 sequences, 6 tokens, n_kv 8, paged
/// over 30 cells), run on both backends; the error each gives.
fn ragged_error(offsets: &[f64], kv_lens: &[f64], table: Option<Vec<f64>>) -> [ExecError; 2] {
    let mut rng = Rng::new(95);
    let mut c = Case::new();
    let q = c.leaf("q", F32, [16, 6, 2, 1], rng.values(16 * 6 * 2, F32));
    let k = c.leaf("k", F16, [16, 30, 1, 1], rng.values(16 * 30, F16));
    let v = c.leaf("v", F16, [16, 30, 1, 1], rng.values(16 * 30, F16));
    let t = c.leaf("table", I32, [8, 3, 1, 1], table.unwrap_or_else(|| (0..24).map(|i| i as f64).collect()));
    let o = c.leaf("seq_offsets", I32, [4, 1, 1, 1], offsets.to_vec());
    let l = c.leaf("kv_lens", I32, [3, 1, 1, 1], kv_lens.to_vec());
    let out = c.graph.flash_attn_ext_ragged(q, k, v, None, Some(t), o, l, 0.25, 0.0).unwrap();
    c.output(out);
    [
        c.run(&mut CpuBackend::new()).expect_err("cpu must fail"),
        c.run(&mut ReferenceBackend::new()).expect_err("reference must fail"),
    ]
}

fn kernel_error(e: ExecError) -> KernelError {
    match e {
        ExecError::Backend(BackendError::Kernel(k)) => k,
        other => panic!("expected a kernel error, got {other:?}"),
    }
}

#[test]
fn bad_ragged_offsets_and_kv_lens_fail_at_run_time() {
    let offsets_err = |at, value, low, high| KernelError::ValueOutOfRange {
        op: "flash_attn_ext",
        what: "seq_offsets",
        at,
        value,
        low,
        high,
    };
    let kv_err = |at, value, low, high| KernelError::ValueOutOfRange {
        op: "flash_attn_ext",
        what: "kv_lens",
        at,
        value,
        low,
        high,
    };
    let ok_lens = [8.0, 8.0, 8.0];
    for (offsets, want) in [
        (vec![0.0, 4.0, 3.0, 6.0], offsets_err(2, 3, 4, 6)),
        (vec![-1.0, 4.0, 5.0, 6.0], offsets_err(0, -1, 0, 6)),
        (vec![0.0, 4.0, 5.0, 7.0], offsets_err(3, 7, 5, 6)),
    ] {
        for (name, e) in BACKENDS.iter().zip(ragged_error(&offsets, &ok_lens, None)) {
            assert_eq!(kernel_error(e), want, "{name}: offsets {offsets:?}");
        }
    }
    // a kv length below the sequence's token count or past n_kv; the first bad sequence wins
    for (lens, want) in [
        ([8.0, 2.0, 8.0], kv_err(1, 2, 3, 8)),
        ([9.0, -1.0, 8.0], kv_err(0, 9, 1, 8)),
        ([1.0, 3.0, 0.0], kv_err(2, 0, 2, 8)),
    ] {
        for (name, e) in BACKENDS.iter().zip(ragged_error(&[0.0, 1.0, 4.0, 6.0], &lens, None)) {
            assert_eq!(kernel_error(e), want, "{name}: kv_lens {lens:?}");
        }
    }
    // a bad table entry among the positions read: sequence 1 reads positions 0..5
    let mut table: Vec<f64> = (0..24).map(|i| i as f64).collect();
    table[8 + 4] = 30.0;
    for (name, e) in BACKENDS.iter().zip(ragged_error(&[0.0, 1.0, 4.0, 6.0], &[8.0, 5.0, 8.0], Some(table))) {
        let want = KernelError::IndexOutOfRange {
            op: "flash_attn_ext",
            index: 30,
            limit: 30,
            what: "block table entry (k/v cell)",
        };
        assert_eq!(kernel_error(e), want, "{name}");
    }
}

#[test]
fn empty_sequences_and_unread_positions_are_not_checked() {
    // sequence 1 has no tokens: its kv length and table row are garbage; sequence 0 reads
    // positions 0..3 only, so its entries past 3 may be garbage too
    let mut rng = Rng::new(96);
    let mut c = Case::new();
    let q = c.leaf("q", F32, [16, 6, 2, 1], rng.values(16 * 6 * 2, F32));
    let k = c.leaf("k", F16, [16, 30, 1, 1], rng.values(16 * 30, F16));
    let v = c.leaf("v", F16, [16, 30, 1, 1], rng.values(16 * 30, F16));
    let mut table: Vec<f64> = (0..24).map(|i| i as f64).collect();
    table[3..8].fill(-7.0);
    table[8..16].fill(1e9);
    let t = c.leaf("table", I32, [8, 3, 1, 1], table);
    let o = c.leaf("seq_offsets", I32, [4, 1, 1, 1], vec![1.0, 3.0, 3.0, 5.0]);
    let l = c.leaf("kv_lens", I32, [3, 1, 1, 1], vec![3.0, -100.0, 8.0]);
    let out = c.graph.flash_attn_ext_ragged(q, k, v, None, Some(t), o, l, 0.25, 0.0).unwrap();
    c.output(out);
    let [cpu, reference] = c.run_both();
    assert_bitwise(&cpu[0][..32], &[0.0; 32], "cpu: token 0 is padding");
    assert_bitwise(&cpu[0][5 * 32..], &[0.0; 32], "cpu: token 5 is padding");
    let e = nmse(&cpu[0], &reference[0]);
    assert!(e < 1e-10, "cpu vs reference NMSE {e:e}");
}

#[test]
fn ragged_shapes_are_checked_at_build_time() {
    let e = build_error(|g| {
        let q = g.input("q", F32, [64, 5, 8, 2])?;
        let k = g.input("k", F16, [64, 10, 4, 2])?;
        let (o, l) = (g.input("o", I32, [3, 1, 1, 1])?, g.input("l", I32, [2, 1, 1, 1])?);
        g.flash_attn_ext_ragged(q, k, k, None, None, o, l, 1.0, 0.0)
    });
    assert!(e.to_string().contains("packs"), "{e}");
    let e = build_error(|g| {
        let q = g.input("q", F32, [64, 5, 8, 1])?;
        let k = g.input("k", F16, [64, 10, 4, 3])?;
        let (o, l) = (g.input("o", I32, [3, 1, 1, 1])?, g.input("l", I32, [2, 1, 1, 1])?);
        g.flash_attn_ext_ragged(q, k, k, None, None, o, l, 1.0, 0.0)
    });
    assert!(e.to_string().contains("seq_offsets.ne[0] - 1"), "{e}");
    let e = build_error(|g| {
        let q = g.input("q", F32, [64, 5, 8, 1])?;
        let k = g.input("k", F16, [64, 10, 4, 2])?;
        let (o, l) = (g.input("o", I32, [3, 1, 1, 1])?, g.input("l", I32, [3, 1, 1, 1])?);
        g.flash_attn_ext_ragged(q, k, k, None, None, o, l, 1.0, 0.0)
    });
    assert!(e.to_string().contains("kv_lens must be [n_seq = 2"), "{e}");
    let e = build_error(|g| {
        let q = g.input("q", F32, [64, 5, 8, 1])?;
        let k = g.input("k", F16, [64, 10, 4, 2])?;
        let (o, l) = (g.input("o", F32, [3, 1, 1, 1])?, g.input("l", I32, [2, 1, 1, 1])?);
        g.flash_attn_ext_ragged(q, k, k, None, None, o, l, 1.0, 0.0)
    });
    assert!(matches!(e, OpError::DType { input: 3, .. }), "{e}");
    let e = build_error(|g| {
        let q = g.input("q", F32, [64, 5, 8, 1])?;
        let k = g.input("k", F16, [64, 10, 4, 2])?;
        let m = g.input("m", F16, [10, 5, 1, 2])?;
        let (o, l) = (g.input("o", I32, [3, 1, 1, 1])?, g.input("l", I32, [2, 1, 1, 1])?);
        g.flash_attn_ext_ragged(q, k, k, Some(m), None, o, l, 1.0, 0.0)
    });
    assert!(e.to_string().contains("ragged batch's mask"), "{e}");
}
