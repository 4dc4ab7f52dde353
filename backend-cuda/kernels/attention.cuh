// attention.cuh: what the flash_attn_ext kernels share (attention.cu: the SIMT kernel and the
// split combine; attention_prefill.cu: the tensor-core prefill; attention_decode.cu: the
// tensor-core decode): the semantics, the gated store, the ragged-batch lookups and the 16-bit
// tensor-core helpers.
//
// Semantics match backend-cpu/src/cpu/attention.rs: logit = dot * scale, or
// softcap * tanh(dot * scale / softcap); plus mask[j, t, 0, s % mask.ne3]; a row whose logits are
// all -inf comes out as zeros. Query head h reads kv head h / (n_head / n_head_kv).
//
// Gated (`gate.data` non-null): every kernel writes an output element o as o * sigmoid(gate) at
// the same coordinates (`fa_store`): mul(attention, sigmoid(gate)) with the unfused kernels'
// arithmetic (common.cuh's sigmoid_f, one rounded product), the attention's output gate without
// a launch of its own.
//
// Ragged batches (`offsets.data` non-null; the dense layout passes a null offsets tensor and none
// of this runs): q packs every sequence's tokens in one sequence slot; sequence s owns tokens
// offsets[s] .. offsets[s + 1] and its L tokens are the last of its kv_lens[s] positions, token i
// of it seeing positions 0 ..= kv_lens[s] - L + i (row s of the table, or sequence s of k/v). The
// same kernels run them with other tilings (see each), the host picking the launches from
// the shapes alone (a CUDA graph replays them with new offsets), never reading offsets back.

// An output value o gated by z: o * sigmoid(z), one rounded product.
__device__ __forceinline__ float fa_gated(float o, float z) { return __fmul_rn(o, sigmoid_f(z)); }
// Output element (e, h, t, s) = o, times sigmoid(gate[e, h, t, s]) when gated.
__device__ __forceinline__ void fa_store(const Tensor& out, const Tensor& gate, i64 e, i64 h, i64 t, i64 s, float o) {
    if (gate.data) {
        o = fa_gated(o, *(const float*)(gate.data + e * gate.nb[0] + h * gate.nb[1] + t * gate.nb[2] + s * gate.nb[3]));
    }
    *(float*)(out.data + e * out.nb[0] + h * out.nb[1] + t * out.nb[2] + s * out.nb[3]) = o;
}
// Whether x's rows are contiguous f32 and 16-byte aligned (fa_store4's fast path; a null x passes).
__device__ __forceinline__ bool fa_rows_vec(const Tensor& x) {
    return !x.data || (x.nb[0] == 4 && (((u64)x.data | (u64)x.nb[1] | (u64)x.nb[2] | (u64)x.nb[3]) & 15) == 0);
}
// Output elements e .. e + 3 of (h, t, s), as fa_store: one 16-byte store (and gate load) where
// `vec` (fa_rows_vec of out and gate) and e is a multiple of 4, else four fa_store.
__device__ __forceinline__ void fa_store4(const Tensor& out, const Tensor& gate, bool vec, i64 e, i64 h, i64 t, i64 s,
                                          float4 o) {
    if (!vec) {
        fa_store(out, gate, e, h, t, s, o.x);
        fa_store(out, gate, e + 1, h, t, s, o.y);
        fa_store(out, gate, e + 2, h, t, s, o.z);
        fa_store(out, gate, e + 3, h, t, s, o.w);
        return;
    }
    if (gate.data) {
        const float4 z = *(const float4*)(gate.data + e * 4 + h * gate.nb[1] + t * gate.nb[2] + s * gate.nb[3]);
        o = make_float4(fa_gated(o.x, z.x), fa_gated(o.y, z.y), fa_gated(o.z, z.z), fa_gated(o.w, z.w));
    }
    *(float4*)(out.data + e * 4 + h * out.nb[1] + t * out.nb[2] + s * out.nb[3]) = o;
}

// ---- ragged batches ----

__device__ __forceinline__ int fa_i32(const Tensor& t, int i) { return *(const int*)(t.data + (i64)i * t.nb[0]); }

// Whether a ragged call's offsets and kv lengths are valid; block-uniform, call with the whole
// block before anything else. Every block checks all of them (one coalesced read each, which also
// brings them into L1 for the lookups below), so that with bad values no block reads further (no
// out-of-range table row, no table-entry error that would mask theirs), and block (0, 0, 0)
// reports the first bad one in the CPU's order: the offsets (`check_seq_offsets`), then the kv
// lengths of sequences with tokens (`L <= kv_lens[s] <= n_kv`).
__device__ bool fa_ragged_valid(const Tensor& offsets, const Tensor& kv_lens, int n_tokens, int n_kv, u64 err, u32 opcode) {
    const int n_seq = (int)kv_lens.ne[0];
    bool bad = false;
    for (int i = threadIdx.x; i <= n_seq; i += blockDim.x) {
        // three independent loads (one round of latency): offset i, the one before, and the kv
        // length of the sequence between them
        const int o = fa_i32(offsets, i), lo = i == 0 ? 0 : fa_i32(offsets, i - 1);
        const int kl = i == 0 ? 0 : fa_i32(kv_lens, i - 1);
        bad = bad || o < lo || o > n_tokens || (i > 0 && o > lo && (kl < o - lo || kl > n_kv));
    }
    if (!__syncthreads_or(bad)) return true;
    if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 && check_seq_offsets(offsets, n_tokens, err, opcode) &&
        threadIdx.x == 0) {
        for (int s = 0; s < n_seq; s++) {
            const int len = fa_i32(offsets, s + 1) - fa_i32(offsets, s), kl = fa_i32(kv_lens, s);
            if (len > 0 && (kl < len || kl > n_kv)) {
                report_error((ErrorRecord*)err, ERR_VALUE_OUT_OF_RANGE, WHAT_KV_LENS, opcode, kl, n_kv, s, len);
                break;
            }
        }
    }
    return false;
}

// The one-token tiles of the split-K kernels on a ragged batch: tile slot `ti` is packed token
// `ti` (`seq_stride == 0`; a padding token gets `vis = 0`, so its rows come out zero), or token
// `ti % seq_stride` of sequence `ti / seq_stride` for the sequences of at most `seq_stride` tokens
// (the others, and slots past a sequence's tokens, return false: another launch writes them).
// Sets the sequence `s`, the token `t` and `vis`, the number of positions it sees.
__device__ __forceinline__ bool fa_ragged_token(const Tensor& offsets, const Tensor& kv_lens, int ti, int seq_stride,
                                                int& s, int& t, int& vis) {
    const int n_seq = (int)kv_lens.ne[0];
    if (seq_stride > 0) {
        s = ti / seq_stride;
        const int o = fa_i32(offsets, s), len = fa_i32(offsets, s + 1) - o, i = ti % seq_stride;
        if (len > seq_stride || i >= len) return false;
        t = o + i;
        vis = fa_i32(kv_lens, s) - len + i + 1;
        return true;
    }
    t = ti;
    s = 0;
    vis = 0;
    if (t < fa_i32(offsets, 0) || t >= fa_i32(offsets, n_seq)) return true;
    int lo = 0, hi = n_seq - 1;  // the last sequence starting at or before t owns it
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (fa_i32(offsets, mid) <= t) lo = mid;
        else hi = mid - 1;
    }
    s = lo;
    const int o = fa_i32(offsets, s), len = fa_i32(offsets, s + 1) - o;
    vis = fa_i32(kv_lens, s) - len + (t - o) + 1;
    return true;
}

// The decode kernel's faster twin of `fa_ragged_valid` + `fa_ragged_token`. There only block
// (0, 0, 0) checks (and reports) every offset and kv length; the other blocks check just the
// values they use, enough to keep every read in bounds (a bad batch then yields garbage, but
// block 0 reports it), and find their sequence from one round of loads when it is the guess
// `fa_ragged_guess` (the decode layout offsets[s] = s), so that a ragged decode block starts its
// first K/V copies as early as a dense one (the guessed sequence's table entries are loaded in
// the same round, see fa_dec_impl). A bad table entry is reported only after a warp has checked
// every offset and kv length (`fa_ragged_valid_warp`), so that it never masks their error.
__device__ __forceinline__ int fa_ragged_guess(int ti, int seq_stride, int n_seq) {
    return seq_stride > 0 ? ti / seq_stride : min(ti, n_seq - 1);
}
__device__ __forceinline__ bool fa_ragged_local(const Tensor& offsets, const Tensor& kv_lens, int ti, int seq_stride,
                                                int n_tokens, int n_kv, int& s, int& t, int& vis) {
    const int n_seq = (int)kv_lens.ne[0];
    int g = fa_ragged_guess(ti, seq_stride, n_seq);
    int o = fa_i32(offsets, g), o1 = fa_i32(offsets, g + 1), kl = fa_i32(kv_lens, g);
    if (seq_stride > 0) {
        const int i = ti % seq_stride;
        if (o1 - o > seq_stride || i >= o1 - o) return false;
        t = o + i;
    } else {
        t = ti;
        const int first = fa_i32(offsets, 0), last = fa_i32(offsets, n_seq);
        if (t < first || t >= last) {  // padding: its rows come out zero
            s = g;
            vis = 0;
            return true;
        }
        if (!(o <= t && t < o1)) {
            int lo = 0, hi = n_seq - 1;
            while (lo < hi) {
                const int mid = (lo + hi + 1) >> 1;
                if (fa_i32(offsets, mid) <= t) lo = mid;
                else hi = mid - 1;
            }
            g = lo;
            o = fa_i32(offsets, g);
            o1 = fa_i32(offsets, g + 1);
            kl = fa_i32(kv_lens, g);
            if (!(o <= t && t < o1)) return false;
        }
    }
    s = g;
    if (o < 0 || o1 > n_tokens || kl < o1 - o || kl > n_kv) return false;
    vis = kl - (o1 - o) + (t - o) + 1;
    return true;
}
// Whether every offset and kv length is valid, checked by one warp (call with the whole warp).
__device__ bool fa_ragged_valid_warp(const Tensor& offsets, const Tensor& kv_lens, int n_tokens, int n_kv) {
    const int n_seq = (int)kv_lens.ne[0];
    bool bad = false;
    for (int i = threadIdx.x & 31; i <= n_seq; i += 32) {
        const int o = fa_i32(offsets, i), lo = i == 0 ? 0 : fa_i32(offsets, i - 1);
        const int kl = i == 0 ? 0 : fa_i32(kv_lens, i - 1);
        bad = bad || o < lo || o > n_tokens || (i > 0 && o > lo && (kl < o - lo || kl > n_kv));
    }
    return !__any_sync(0xffffffffu, bad);
}


// ---- 16-bit tensor-core helpers (prefill and decode) ----

#define FT_PAD 8  // halves after each K/V row in shared memory: ldmatrix's 8 rows meet 8 bank groups

template <int DT>
__device__ __forceinline__ u16 ft_half(float x) {
    return DT == DT_BF16 ? f32_to_bf16(x) : f32_to_f16(x);
}
template <int DT>
__device__ __forceinline__ u32 ft_pack(float lo, float hi) {
    return (u32)ft_half<DT>(lo) | ((u32)ft_half<DT>(hi) << 16);
}
// c += a * b for one m16n8k16 tile (row.col, f32 accumulators).
template <int DT>
__device__ __forceinline__ void ft_mma(float* c, const u32* a, u32 b0, u32 b1) {
    if (DT == DT_BF16) tc_mma_bf16(c, a, b0, b1);
    else tc_mma_f16(c, a, b0, b1);
}
