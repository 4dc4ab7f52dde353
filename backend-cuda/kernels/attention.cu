// attention.cu: flash_attn_ext (online-softmax attention, f32 accumulation), optionally reading K/V
// through a paged block table.
//
// `fa_partial` is the SIMT kernel for decode and small prefills (f32 or mixed K/V, odd head dims,
// unaligned rows; `fa_dec_*` below takes aligned f16/bf16). A block takes a tile of query rows
// (up to FA_R rows: `hb` query heads of one kv group times `tb` tokens, so every K/V row it reads
// serves all of them: GQA sharing) and a range of kv positions (a split: long contexts are cut
// into `n_splits` ranges run by different blocks). Each of its FA_W warps walks chunks of 32
// positions: per position, lane `l` holds elements `l*8 .. l*8+7` of the K row (one 16-byte load
// for f16/bf16 when aligned), the warp reduces the 8 rows' dots at once (`fa_sum8`, 9 shuffles)
// and lane `c` gets the logits of position `c`; then softcap, mask, the chunk's branch-free
// online-softmax update and the weighted V rows (same element layout as K). Each chunk's K/V
// rows are prefetched into L2 one chunk ahead. The warps' states are merged in shared memory;
// with one split the block writes the output rows, else it writes (max, sum, acc[d_v]) partials
// to scratch and `fa_combine` merges the splits. `fa_mma_*` (below) is the tensor-core prefill.
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
// same three kernels run them with other tilings (see each), the host picking the launches from
// the shapes alone (a CUDA graph replays them with new offsets), never reading offsets back.

#define FA_W 4    // warps per block
#define FA_R 8    // query rows per block (tile)
#define FA_D 256  // largest head dim (d_k and d_v)
#define FA_E 8    // elements per lane per 256-wide chunk of the head dim
#define FA_KU 4   // K/V rows loaded ahead per lane (memory-level parallelism)

// Eight elements starting at `row + e0` (elements e0 .. e0+7 of a row) as f32; elements at or past
// `d` read as 0. VEC: the row is 16-byte aligned, d % 8 == 0 and dt is the compile-time DT.
template <int DT, bool VEC>
__device__ __forceinline__ void fa_load8(const char* row, int dt, int e0, int d, float* x) {
    if (VEC) {
        if (e0 >= d) {
#pragma unroll
            for (int k = 0; k < 8; k++) x[k] = 0.0f;
            return;
        }
        if (DT == DT_F32) {
            float4 a = *(const float4*)(row + (i64)e0 * 4);
            float4 b = *(const float4*)(row + (i64)e0 * 4 + 16);
            x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w;
            x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
        } else {
            uint4 u = *(const uint4*)(row + (i64)e0 * 2);
            u32 w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
            for (int k = 0; k < 4; k++) {
                u16 lo = (u16)(w[k] & 0xffffu), hi = (u16)(w[k] >> 16);
                if (DT == DT_F16) {
                    x[2 * k] = f16_to_f32(lo);
                    x[2 * k + 1] = f16_to_f32(hi);
                } else {
                    x[2 * k] = bf16_to_f32(lo);
                    x[2 * k + 1] = bf16_to_f32(hi);
                }
            }
        }
    } else {
        if (dt == DT_F32) {
#pragma unroll
            for (int k = 0; k < 8; k++) x[k] = e0 + k < d ? ((const float*)row)[e0 + k] : 0.0f;
        } else {
            const u16* h = (const u16*)row;
#pragma unroll
            for (int k = 0; k < 8; k++) {
                u16 b = e0 + k < d ? h[e0 + k] : (u16)0;
                x[k] = dt == DT_F16 ? f16_to_f32(b) : bf16_to_f32(b);
            }
        }
    }
}

// Sums each of the FA_R == 8 values v[r] over the warp in 9 shuffles (a transposing butterfly
// instead of 8 separate 5-shuffle reductions); lane L ends up with the sum for row fa_row(L).
__device__ __forceinline__ int fa_row(int lane) { return ((lane >> 4) & 1) * 4 + ((lane >> 3) & 1) * 2 + ((lane >> 2) & 1); }
__device__ __forceinline__ float fa_sum8(const float* v, int lane) {
    const bool b4 = lane & 16, b3 = lane & 8, b2 = lane & 4;
    float w[4], y[2];
#pragma unroll
    for (int i = 0; i < 4; i++) w[i] = (b4 ? v[i + 4] : v[i]) + __shfl_xor_sync(0xffffffffu, b4 ? v[i] : v[i + 4], 16);
#pragma unroll
    for (int i = 0; i < 2; i++) y[i] = (b3 ? w[i + 2] : w[i]) + __shfl_xor_sync(0xffffffffu, b3 ? w[i] : w[i + 2], 8);
    float z = (b2 ? y[1] : y[0]) + __shfl_xor_sync(0xffffffffu, b2 ? y[0] : y[1], 4);
    z += __shfl_xor_sync(0xffffffffu, z, 2);
    z += __shfl_xor_sync(0xffffffffu, z, 1);
    return z;
}

// Output element (e, h, t, s) = o, times sigmoid(gate[e, h, t, s]) when gated.
__device__ __forceinline__ void fa_store(const Tensor& out, const Tensor& gate, i64 e, i64 h, i64 t, i64 s, float o) {
    if (gate.data) {
        const float z = *(const float*)(gate.data + e * gate.nb[0] + h * gate.nb[1] + t * gate.nb[2] + s * gate.nb[3]);
        o = __fmul_rn(o, sigmoid_f(z));
    }
    *(float*)(out.data + e * out.nb[0] + h * out.nb[1] + t * out.nb[2] + s * out.nb[3]) = o;
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

template <int DT, bool VEC>
__device__ __forceinline__ void fa_partial_impl(
    Tensor q, Tensor k, Tensor v, Tensor mask, Tensor table, Tensor offsets, Tensor kv_lens, Tensor out, Tensor gate,
    int kdt, int vdt, int mdt, int has_mask, int paged, float scale, float softcap, int n_splits, int split_len, int hb,
    int tb, int h_blocks, int t_blocks, int seq_stride, float* part, u64 err, u32 opcode) {
    __shared__ float s_p[FA_W][FA_R][32];
    __shared__ float s_m[FA_W][FA_R];
    __shared__ float s_l[FA_W][FA_R];
    __shared__ float s_acc[FA_W][FA_R][FA_D];
    __shared__ __align__(16) float s_q[FA_R][FA_D];

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int dk = (int)q.ne[0], n_tokens = (int)q.ne[1], n_head = (int)q.ne[2];
    const int dv = (int)v.ne[0], n_cells = (int)k.ne[1], n_head_kv = (int)k.ne[2];
    const int n_kv = paged ? (int)table.ne[0] : n_cells;
    const int group = n_head / n_head_kv;

    const int tile = blockIdx.x, split = blockIdx.y;
    const int tbi = tile % t_blocks, hbi = (tile / t_blocks) % h_blocks, hk = tile / (t_blocks * h_blocks);
    // Dense: tokens t0 .. t0 + tn of sequence s (q's slot qs = s) over all positions. Ragged
    // (tb == 1): one token of sequence s in slot 0, seeing its first `vis` positions.
    int s = blockIdx.z, qs = blockIdx.z, t0 = tbi * tb, tn = min(tb, n_tokens - t0), vis = n_kv;
    if (offsets.data) {
        if (!fa_ragged_valid(offsets, kv_lens, n_tokens, n_kv, err, opcode)) return;
        if (!fa_ragged_token(offsets, kv_lens, tbi, seq_stride, s, t0, vis)) return;
        qs = 0;
        tn = 1;
    }
    const int h0 = hk * group + hbi * hb;
    const int hn = min(hb, group - hbi * hb);
    const int nrows = hn * tn;
    const int j_begin = split * split_len, j_end = min(min(n_kv, vis), j_begin + split_len);
    const i64 ks = paged ? 0 : s;
    const char* kbase = k.data + hk * k.nb[2] + ks * k.nb[3];
    const char* vbase = v.data + hk * v.nb[2] + ks * v.nb[3];

    // The tile's query rows, f32, zero-padded to FA_R x FA_D.
    int tok[FA_R];
#pragma unroll
    for (int r = 0; r < FA_R; r++) tok[r] = t0 + (r < nrows ? r % tn : 0);
#pragma unroll 8
    for (int idx = threadIdx.x; idx < FA_R * FA_D; idx += FA_W * 32) {
        const int r = idx / FA_D, i = idx % FA_D;
        float x = 0.0f;
        if (r < nrows && i < dk) {
            const int h = h0 + r / tn, t = t0 + r % tn;
            x = *(const float*)(q.data + (i64)i * q.nb[0] + (i64)t * q.nb[1] + (i64)h * q.nb[2] + (i64)qs * q.nb[3]);
        }
        s_q[r][i] = x;
    }
    __syncthreads();
    const int kbytes = dk * (kdt == DT_F32 ? 4 : 2), vbytes = dv * (vdt == DT_F32 ? 4 : 2);

    float acc[FA_R][FA_E], m[FA_R], l[FA_R];
#pragma unroll
    for (int r = 0; r < FA_R; r++) {
        m[r] = -TS_INF;
        l[r] = 0.0f;
#pragma unroll
        for (int e = 0; e < FA_E; e++) acc[r][e] = 0.0f;
    }
    const float inner = softcap > 0.0f ? scale / softcap : 0.0f;
    const i64 m_seq = has_mask ? (qs % mask.ne[3]) * mask.nb[3] : 0;

    // The cache row of position jj (its table entry when paged, unchecked), -1 past the range.
    auto raw_cell = [&](int jj) -> int {
        if (jj >= j_end) return -1;
        return paged ? *(const int*)(table.data + (i64)jj * table.nb[0] + (i64)s * table.nb[1]) : jj;
    };
    // Starts a row's K and V towards L2 (one chunk ahead) so that the row-by-row loads hit it.
    auto prefetch = [&](int c) {
        if (c < 0 || c >= n_cells) return;
        const char* kp = kbase + (i64)c * k.nb[1];
        const char* vp = vbase + (i64)c * v.nb[1];
        for (int o = 0; o < kbytes; o += 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(kp + o));
        for (int o = 0; o < vbytes; o += 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(vp + o));
    };
    int next = raw_cell(j_begin + warp * 32 + lane);
    prefetch(next);
    for (int c0 = j_begin + warp * 32; c0 < j_end; c0 += FA_W * 32) {
        const int j = c0 + lane;
        const int raw = next;
        next = raw_cell(j + FA_W * 32);
        prefetch(next);
        int cell = -1;
        if (j < j_end) {
            if (raw < 0 || raw >= n_cells) {
                report_error((ErrorRecord*)err, ERR_INDEX_OUT_OF_RANGE, WHAT_KV_CELL, opcode, raw, n_cells, 0, 0);
            } else {
                cell = raw;
            }
        }
        // Logits: lane c ends up with position c0 + c's logit for every row.
        float sl[FA_R];
#pragma unroll
        for (int r = 0; r < FA_R; r++) s_p[warp][r][lane] = 0.0f;
        __syncwarp();
#pragma unroll 1
        for (int cc = 0; cc < 32; cc += FA_KU) {
            float kx[FA_KU][FA_E];
            int cl[FA_KU];
#pragma unroll
            for (int u = 0; u < FA_KU; u++) {
                cl[u] = __shfl_sync(0xffffffffu, cell, cc + u);
                if (cl[u] >= 0) {
                    fa_load8<DT, VEC>(kbase + (i64)cl[u] * k.nb[1], kdt, lane * FA_E, dk, kx[u]);
                } else {
#pragma unroll
                    for (int e = 0; e < FA_E; e++) kx[u][e] = 0.0f;
                }
            }
            if ((cl[0] & cl[1] & cl[2] & cl[3]) < 0) continue;  // FA_KU == 4: no valid row in the group
            float d[FA_KU][FA_R];
#pragma unroll
            for (int r = 0; r < FA_R; r++) {
                const float4 qa = *(const float4*)&s_q[r][lane * FA_E];
                const float4 qb = *(const float4*)&s_q[r][lane * FA_E + 4];
                const float qr[FA_E] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
#pragma unroll
                for (int u = 0; u < FA_KU; u++) {
                    d[u][r] = 0.0f;
#pragma unroll
                    for (int e = 0; e < FA_E; e++) d[u][r] += qr[e] * kx[u][e];
                }
            }
#pragma unroll
            for (int u = 0; u < FA_KU; u++) {
                const float z = fa_sum8(d[u], lane);
                if ((lane & 3) == 0) s_p[warp][fa_row(lane)][cc + u] = z;
            }
        }
        __syncwarp();
#pragma unroll
        for (int r = 0; r < FA_R; r++) sl[r] = s_p[warp][r][lane];
        __syncwarp();
        // Online-softmax update per row; weights go to shared memory for the V pass.
        float mv[FA_R];
#pragma unroll
        for (int r = 0; r < FA_R; r++) {
            mv[r] = has_mask && cell >= 0 ? load_f32(mask.data + (i64)j * mask.nb[0] + (i64)tok[r] * mask.nb[1] + m_seq, mdt) : 0.0f;
        }
#pragma unroll
        for (int r = 0; r < FA_R; r++) {
            float x = (softcap > 0.0f ? softcap * tanhf(sl[r] * inner) : sl[r] * scale) + mv[r];
            x = cell >= 0 ? x : -TS_INF;
            // Branch-free so that the rows' reductions interleave: while everything so far is
            // masked (m_new = -inf) alpha and p are 0 and the state stays zero.
            const float m_new = fmaxf(m[r], warp_max(x));
            const float ms = m_new == -TS_INF ? 0.0f : m_new;
            const float alpha = expf(m[r] - ms);
            const float p = expf(x - ms);
            l[r] = l[r] * alpha + warp_sum(p);
#pragma unroll
            for (int e = 0; e < FA_E; e++) acc[r][e] *= alpha;
            m[r] = m_new;
            s_p[warp][r][lane] = p;
        }
        __syncwarp();
#pragma unroll 1
        for (int cc = 0; cc < 32; cc += FA_KU) {
            float vx[FA_KU][FA_E];
            int cl[FA_KU];
#pragma unroll
            for (int u = 0; u < FA_KU; u++) {
                cl[u] = __shfl_sync(0xffffffffu, cell, cc + u);
                if (cl[u] >= 0) {
                    fa_load8<DT, VEC>(vbase + (i64)cl[u] * v.nb[1], vdt, lane * FA_E, dv, vx[u]);
                } else {
#pragma unroll
                    for (int e = 0; e < FA_E; e++) vx[u][e] = 0.0f;
                }
            }
#pragma unroll
            for (int u = 0; u < FA_KU; u++) {
#pragma unroll
                for (int r = 0; r < FA_R; r++) {
                    float w = s_p[warp][r][cc + u];
#pragma unroll
                    for (int e = 0; e < FA_E; e++) acc[r][e] += w * vx[u][e];
                }
            }
        }
        __syncwarp();
    }

    // Merge the warps.
#pragma unroll
    for (int r = 0; r < FA_R; r++) {
        if (lane == 0) {
            s_m[warp][r] = m[r];
            s_l[warp][r] = l[r];
        }
#pragma unroll
        for (int e = 0; e < FA_E; e++) s_acc[warp][r][lane * FA_E + e] = acc[r][e];
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < nrows * dv; idx += blockDim.x) {
        const int r = idx / dv, e = idx % dv;
        float mm = -TS_INF;
#pragma unroll
        for (int w = 0; w < FA_W; w++) mm = fmaxf(mm, s_m[w][r]);
        float ll = 0.0f, a = 0.0f;
        if (mm != -TS_INF) {
#pragma unroll
            for (int w = 0; w < FA_W; w++) {
                float f = expf(s_m[w][r] - mm);
                ll += s_l[w][r] * f;
                a += s_acc[w][r][e] * f;
            }
        }
        const int h = h0 + r / tn, t = t0 + r % tn;
        if (n_splits == 1) {
            fa_store(out, gate, e, h, t, qs, mm == -TS_INF ? 0.0f : a / ll);
        } else {
            const i64 g = ((i64)qs * n_head + h) * n_tokens + t;
            const i64 n_rows_g = (i64)n_head * n_tokens * out.ne[3];
            float* pp = part + ((i64)split * n_rows_g + g) * (dv + 2);
            if (e == 0) {
                pp[0] = mm;
                pp[1] = ll;
            }
            pp[2 + e] = a;
        }
    }
}

#define FA_PARTIAL(NAME, DT, VEC)                                                                              \
    extern "C" __global__ void __launch_bounds__(FA_W * 32, 3) NAME(                                              \
        Tensor q, Tensor k, Tensor v, Tensor mask, Tensor table, Tensor offsets, Tensor kv_lens, Tensor out,   \
        Tensor gate,                                                                                           \
        int kdt, int vdt, int mdt, int has_mask, int paged, float scale, float softcap, int n_splits,          \
        int split_len, int hb, int tb, int h_blocks, int t_blocks, int seq_stride, float* part, u64 err,       \
        u32 opcode) {                                                                                          \
        grid_begin();                                                                                          \
        fa_partial_impl<DT, VEC>(q, k, v, mask, table, offsets, kv_lens, out, gate, kdt, vdt, mdt, has_mask, paged,  \
                                 scale, softcap, n_splits, split_len, hb, tb, h_blocks, t_blocks, seq_stride,  \
                                 part, err, opcode);                                                           \
    }

FA_PARTIAL(fa_partial_any, DT_F32, false)
FA_PARTIAL(fa_partial_f32, DT_F32, true)
FA_PARTIAL(fa_partial_f16, DT_F16, true)
FA_PARTIAL(fa_partial_bf16, DT_BF16, true)

// Merges `n_splits` partials (max, sum, acc[d_v]) of each output row: one block per row
// g = (s * n_head + h) * n_tokens + t (blockDim a multiple of 32). With a ragged batch tiled by
// sequence (`seq_stride > 0`), rows of tokens the split-K kernel did not take are left alone.
// One round of loads does most of the work: each split's max and sum (into shared memory) and
// the first FC_PRE partials of the thread's first element (into registers), all in flight at once;
// then the factors e^(max_i - max), and the sums in the same order as a plain loop would take them
// (a decode's 32 splits load nothing more). n_splits <= FC_SPLITS: TAG(fa-splits).
#define FC_SPLITS 384
#define FC_PRE 32
extern "C" __global__ void fa_combine(const float* part, Tensor out, Tensor gate, Tensor offsets, Tensor kv_lens,
                                      int seq_stride, int n_splits, int dv, int n_tokens, int n_head) {
    grid_begin();
    __shared__ float scratch[32];
    __shared__ float factor[FC_SPLITS], sums[FC_SPLITS];
    const i64 g = blockIdx.x;
    if (offsets.data && seq_stride > 0) {
        // offsets were checked by the split-K kernel; with bad ones its output is not used
        int s, t, vis;
        fa_ragged_token(offsets, kv_lens, (int)(g % n_tokens), 0, s, t, vis);
        const int len = fa_i32(offsets, s + 1) - fa_i32(offsets, s);
        if (vis == 0 || len > seq_stride || len < 0) return;
    }
    const i64 n_rows_g = (i64)n_head * n_tokens * out.ne[3];
    const i64 stride = dv + 2, split_stride = n_rows_g * stride;
    const float* pg = part + g * stride;
    const int e0 = threadIdx.x;
    float pre[FC_PRE];
#pragma unroll
    for (int i = 0; i < FC_PRE; i++) pre[i] = e0 < dv && i < n_splits ? pg[i * split_stride + 2 + e0] : 0.0f;
    float mm = -TS_INF;
    for (int i = threadIdx.x; i < n_splits; i += blockDim.x) {
        const float m = pg[i * split_stride], l = pg[i * split_stride + 1];
        factor[i] = m;
        sums[i] = l;
        mm = fmaxf(mm, m);
    }
    mm = block_max(mm, scratch);  // its barriers also order the writes to factor and sums
    const float ms = mm == -TS_INF ? 0.0f : mm;
    float ll = 0.0f;
    for (int i = threadIdx.x; i < n_splits; i += blockDim.x) {
        const float f = expf(factor[i] - ms);
        factor[i] = f;
        ll += sums[i] * f;
    }
    ll = block_sum(ll, scratch);
    const int t = (int)(g % n_tokens), h = (int)((g / n_tokens) % n_head), s = (int)(g / ((i64)n_tokens * n_head));
    for (int e = threadIdx.x; e < dv; e += blockDim.x) {
        float a = 0.0f;
        int i = 0;
        if (e == e0) {
#pragma unroll
            for (; i < FC_PRE; i++) {
                if (i < n_splits) a += pre[i] * factor[i];
            }
        }
#pragma unroll 16
        for (; i < n_splits; i++) a += pg[i * split_stride + 2 + e] * factor[i];
        fa_store(out, gate, e, h, t, s, mm == -TS_INF ? 0.0f : a / ll);
    }
}

// ---- prefill on tensor cores ----
//
// `fa_mma_*`: f16/bf16 K/V with d_k = d_v = D (128 or 256). A block takes FT_BM = 64 tokens of
// one query head and walks the kv positions in tiles of FT_BN = 64: S = Q K^T and O += P V on
// tensor cores (Q and P rounded to the K/V type, f32 accumulators), with the online softmax on
// the S fragments in f32 (base-2 units). Two product paths (`ft_scores`, `ft_pv`): wgmma on
// sm_90a, mma.sync elsewhere; each group of 4 warps holds the block's 64 rows (16 a warp). On
// sm_90a a block may be two such groups (blockDim.x = 256, the host's choice), each walking half
// of the block's kv tiles with its own K, V and mask tiles, merged at the end
// (`ft_merge_groups`). A tile's K and V rows (through the block table when paged) are copied
// into shared memory with 16-byte cp.async, overlapping the tensor cores (the schedule is at the
// loop). An f16 mask with 16-byte aligned rows rides along with K (FT_BN columns of the block's
// 64 rows, read from shared memory by the softmax); other masks are read from global memory.
// With a mask, the block first finds its last tile that any of its rows can see
// (`ft_mask_stop`), so a causal mask's upper triangle costs neither copies nor tensor-core work.
// Dynamic shared memory: the Q tile, then each group's K and V tiles (64 x D halves, laid out for
// the path: `ft_at`) and mask tile (FT_BM * FT_MLD halves). TAG(fa-mma-tile)
//
// Ragged: a block takes 64 tokens of one sequence of at least `l_min` tokens (tile x counts such
// sequences' ceil(L / 64) tiles in order: the first warp finds this block's by a running scan)
// and stops at the last position its last token sees; logits past each row's own last position
// are -inf (the causal rule, on the fly: no mask needed). Blocks past the last tile zero the
// padding tokens' rows (the host launches one spare tile row so that there are some).

#define FT_BM 64
#define FT_BN 64
#define FT_PAD 8
#define FT_MLD 72  // halves between the mask tile's rows (144 bytes: a fragment's 32 reads hit 32 banks)

// Waits for the 128 threads of warp group `wg` (named barrier 1 + wg; 0 is __syncthreads).
__device__ __forceinline__ void ft_group_sync(int wg) { asm volatile("bar.sync %0, 128;" ::"r"(1 + wg) : "memory"); }

__device__ __forceinline__ void ft_ldsm4_trans_at(u32* r, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ft_ldsm4_trans(u32* r, const void* p) { ft_ldsm4_trans_at(r, tc_smem(p)); }
template <int DT>
__device__ __forceinline__ u16 ft_half(float x) {
    return DT == DT_BF16 ? f32_to_bf16(x) : f32_to_f16(x);
}
template <int DT>
__device__ __forceinline__ u32 ft_pack(float lo, float hi) {
    return (u32)ft_half<DT>(lo) | ((u32)ft_half<DT>(hi) << 16);
}
// Copies a tile's query rows into sQ (ROWS rows of D halves; element (r, c) at sQ[at(r, c)], with
// c a multiple of 4 and the 4 halves from c adjacent), rounded to the K/V type: row r is f32 at
// row(r) with element stride nb0 (float4 loads where nb0 == 4 and aligned), or zeros where row(r)
// is null. A thread issues a round's loads (up to 8 groups of 4) before it
// stores any of them, so one memory latency covers the round; a load-then-store loop waited one
// latency per element, which dominated the one-token decode.
template <int DT, int ROWS, int D, int THREADS, typename Row, typename At>
__device__ __forceinline__ void ft_load_q(u16* sQ, i64 nb0, Row row, At at) {
    constexpr int PER = ROWS * D / 4 / THREADS, BATCH = PER < 8 ? PER : 8;
    static_assert(ROWS * D % (4 * THREADS) == 0 && PER % BATCH == 0, "whole rounds per thread");
#pragma unroll 1
    for (int b0 = 0; b0 < PER; b0 += BATCH) {
        float4 x[BATCH];
#pragma unroll
        for (int i = 0; i < BATCH; i++) {
            const int gi = threadIdx.x + (b0 + i) * THREADS, r = gi / (D / 4), c = gi % (D / 4) * 4;
            const char* p = row(r);
            x[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (p) {
                p += c * nb0;
                if (nb0 == 4 && ((unsigned long long)p & 15) == 0) {
                    x[i] = *(const float4*)p;
                } else {
                    const float* f = (const float*)p;
                    x[i] = make_float4(f[0], *(const float*)(p + nb0), *(const float*)(p + 2 * nb0),
                                       *(const float*)(p + 3 * nb0));
                }
            }
        }
#pragma unroll
        for (int i = 0; i < BATCH; i++) {
            const int gi = threadIdx.x + (b0 + i) * THREADS, r = gi / (D / 4), c = gi % (D / 4) * 4;
            *(uint2*)&sQ[at(r, c)] = make_uint2(ft_pack<DT>(x[i].x, x[i].y), ft_pack<DT>(x[i].z, x[i].w));
        }
    }
}
// 2^x as one ex2.approx (2 ulp; results below 2^-126 flush to 0, which a softmax sum of at least
// 1 cannot see): the prefill kernel keeps its logits in base-2 units (scaled by log2(e) with the
// scale), so a probability is one subtraction and this; CUDA's expf added range reduction.
#define FT_LOG2E 1.4426950408889634f
__device__ __forceinline__ float ft_exp2(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}
// c += a * b for one m16n8k16 tile (row.col, f32 accumulators).
template <int DT>
__device__ __forceinline__ void ft_mma(float* c, const u32* a, u32 b0, u32 b1) {
    if (DT == DT_BF16) tc_mma_bf16(c, a, b0, b1);
    else tc_mma_f16(c, a, b0, b1);
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FT_WGMMA 1
#endif

#ifdef FT_WGMMA
#define FT_WG 2
// On sm_90a each warpgroup of the block (4 warps) runs both products as wgmma: S = Q K^T as
// m64n64k16 steps with Q and K read from shared memory, O += P V as m64nDk16 steps with P from
// registers (the S fragments, rounded) and V read from shared memory transposed. The tensor
// cores read each K and V value once for the block's 64 rows, where mma.sync's ldmatrix read it
// once per warp; and the loads and their latencies leave the instruction stream. Tiles are D / 64
// sub-tiles of ROWS rows of 128 bytes with wgmma's 128-byte swizzle (common.cuh), 1024-byte aligned.
constexpr int ft_tile_halves(int rows, int d) { return rows * d; }
template <int ROWS, int D>
__device__ __forceinline__ int ft_at(int r, int c) {
    return (c >> 6) * (ROWS * 64) + r * 64 + ((((c >> 3) ^ r) & 7) << 3) + (c & 7);
}

#define FT_WG_SS(T)                                                                                            \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                         \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." T "." T " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n" \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])                                                                                    \
                 : "l"(a), "l"(b), "r"(accumulate)                                                              \
                 : "memory")

#define FT_WG_RS128(T)                                                                                     \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                                         \
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." T "." T " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n" \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])                                                                                     \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(1)                                      \
                 : "memory")

#define FT_WG_RS256(T)                                                                                     \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"                                                         \
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32." T "." T " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n" \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])                                                                                     \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(1)                                      \
                 : "memory")


// sc = the block's S tile (Q K^T; this thread's fragments of its warp's 16 rows, as mma.sync's).
template <int DT, int D>
__device__ __forceinline__ void ft_scores(float (&sc)[FT_BN / 8][4], const u16* sQ, const u16* sK, int, int) {
    float* d = &sc[0][0];
    wg_fence();
#pragma unroll
    for (int ks = 0; ks < D / 16; ks++) {
        const int off = (ks >> 2) * 64 * 64 + (ks & 3) * 16;
        const u64 a = wg_desc(sQ + off), b = wg_desc(sK + off);
        const int accumulate = ks > 0;
        if (DT == DT_BF16) FT_WG_SS("bf16");
        else FT_WG_SS("f16");
    }
    wg_commit();
    wg_wait<0>();
}
// o += P V for the tile, P the rounded probabilities `sc`.
template <int DT, int D>
__device__ __forceinline__ void ft_pv(float (&o)[D / 8][4], const float (&sc)[FT_BN / 8][4], const u16* sV, int) {
    float* d = &o[0][0];
    // every fragment packed before the fence (a register written between two wgmmas makes ptxas
    // serialize them)
    u32 p[FT_BN / 16][4];
#pragma unroll
    for (int kk = 0; kk < FT_BN / 16; kk++) {
        p[kk][0] = ft_pack<DT>(sc[2 * kk][0], sc[2 * kk][1]);
        p[kk][1] = ft_pack<DT>(sc[2 * kk][2], sc[2 * kk][3]);
        p[kk][2] = ft_pack<DT>(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
        p[kk][3] = ft_pack<DT>(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
    }
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < FT_BN / 16; kk++) {
        const u32* a = p[kk];
        const u64 b = wg_desc_mn(sV + kk * 16 * 64, FT_BN * 128);
        if (D == 256) {
            if (DT == DT_BF16) FT_WG_RS256("bf16");
            else FT_WG_RS256("f16");
        } else {
            if (DT == DT_BF16) FT_WG_RS128("bf16");
            else FT_WG_RS128("f16");
        }
    }
    wg_commit();
    wg_wait<0>();
}
#else
#define FT_WG 1
// Elsewhere each warp runs mma.sync m16n8k16 on its 16 rows, operands through ldmatrix from tiles
// of ROWS rows padded by FT_PAD halves (bank-conflict free); the block is one group of 4 warps.
constexpr int ft_tile_halves(int rows, int d) { return rows * (d + FT_PAD); }
template <int ROWS, int D>
__device__ __forceinline__ int ft_at(int r, int c) {
    return r * (D + FT_PAD) + c;
}
// sc = this warp's 16 rows of S = Q K^T for the tile.
template <int DT, int D>
__device__ __forceinline__ void ft_scores(float (&sc)[FT_BN / 8][4], const u16* sQ, const u16* sK, int warp, int lane) {
    constexpr int LD = D + FT_PAD;
#pragma unroll
    for (int n = 0; n < FT_BN / 8; n++) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.0f;
#pragma unroll 4
    for (int kk = 0; kk < D; kk += 16) {
        u32 a[4];
        tc_ldsm4(a, &sQ[(warp * 16 + (lane & 15)) * LD + kk + (lane >> 4) * 8]);
#pragma unroll
        for (int n = 0; n < FT_BN / 8; n += 2) {
            u32 b[4];
            tc_ldsm4(b, &sK[(n * 8 + (lane & 7) + (lane >> 4) * 8) * LD + kk + ((lane >> 3) & 1) * 8]);
            ft_mma<DT>(sc[n], a, b[0], b[1]);
            ft_mma<DT>(sc[n + 1], a, b[2], b[3]);
        }
    }
}
// o += P V for this warp's 16 rows, P the rounded probabilities `sc`.
template <int DT, int D>
__device__ __forceinline__ void ft_pv(float (&o)[D / 8][4], const float (&sc)[FT_BN / 8][4], const u16* sV, int lane) {
    constexpr int LD = D + FT_PAD;
#pragma unroll
    for (int kk = 0; kk < FT_BN / 16; kk++) {
        const u32 a[4] = {ft_pack<DT>(sc[2 * kk][0], sc[2 * kk][1]), ft_pack<DT>(sc[2 * kk][2], sc[2 * kk][3]),
                          ft_pack<DT>(sc[2 * kk + 1][0], sc[2 * kk + 1][1]), ft_pack<DT>(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
#pragma unroll
        for (int n = 0; n < D / 8; n += 2) {
            u32 b[4];
            ft_ldsm4_trans(b, &sV[(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + n * 8 + (lane >> 4) * 8]);
            ft_mma<DT>(o[n], a, b[0], b[1]);
            ft_mma<DT>(o[n + 1], a, b[2], b[3]);
        }
    }
}
#endif

#if FT_WG == 2
// The end of a two-group block: group 1 hands its softmax state (max, sum and O of the same rows
// and columns, thread for thread) to group 0 through `so`, its own K and V tiles (free once its
// last products were waited for), and returns false; group 0 merges it into its own and returns
// true.
template <int D>
__device__ __forceinline__ bool ft_merge_groups(float (&o)[D / 8][4], float (&m)[2], float (&l)[2], float* so, int wg, int gt) {
    __shared__ float s_ml[4][128];
    __syncthreads();
    if (wg == 1) {
        s_ml[0][gt] = m[0], s_ml[1][gt] = m[1], s_ml[2][gt] = l[0], s_ml[3][gt] = l[1];
#pragma unroll
        for (int n = 0; n < D / 8; n++) *(float4*)&so[(n * 128 + gt) * 4] = make_float4(o[n][0], o[n][1], o[n][2], o[n][3]);
    }
    __syncthreads();
    if (wg == 1) return false;
#pragma unroll
    for (int rr = 0; rr < 2; rr++) {
        const float m1 = s_ml[rr][gt], l1 = s_ml[2 + rr][gt], mx = fmaxf(m[rr], m1);
        const float ms = mx == -TS_INF ? 0.0f : mx, a0 = exp2f(m[rr] - ms), a1 = exp2f(m1 - ms);
        l[rr] = l[rr] * a0 + l1 * a1;
        m[rr] = mx;
#pragma unroll
        for (int n = 0; n < D / 8; n++) {
            const float2 x = *(const float2*)&so[(n * 128 + gt) * 4 + 2 * rr];
            o[n][2 * rr] = o[n][2 * rr] * a0 + x.x * a1;
            o[n][2 * rr + 1] = o[n][2 * rr + 1] * a0 + x.y * a1;
        }
    }
    return true;
}
#endif

// The end of the kv positions a prefill block needs under a mask: past the last tile that any
// of its rows (tokens t0 .. t_end) sees, tiles are all -inf (a causal mask's upper triangle) and
// cost nothing. A NaN counts as seen (it reaches the output). Call with the whole block; the
// first 128 threads scan, and a thread's loads of a tile are all issued before any is tested
// (one memory latency a tile, not one a value: a block near the start of a causal prefill scans
// most tiles). `mstage`: an f16 mask with 16-byte aligned rows, read in pieces of 8 values.
__device__ __forceinline__ int ft_mask_stop(const Tensor& mask, int mdt, i64 m_seq, bool mstage, int t0, int t_end, int j_stop) {
    const int tid = threadIdx.x;
    int last = (j_stop + FT_BN - 1) / FT_BN - 1;
    for (; last > 0; last--) {
        bool seen = false;
        if (tid >= 128) {
            // (the first group scans)
        } else if (mstage) {
            // -inf is 0xFC00; a NaN is any other pattern
#pragma unroll
            for (int i = 0; i < FT_BM * FT_BN / 8 / 128; i++) {
                const int idx = tid + 128 * i, t = t0 + idx / (FT_BN / 8), j = last * FT_BN + idx % (FT_BN / 8) * 8;
                if (t < t_end && j < j_stop) {
                    const uint4 x = *(const uint4*)(mask.data + (i64)j * 2 + (i64)t * mask.nb[1] + m_seq);
                    const u32 w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
                    for (int e = 0; e < 8; e++) {
                        seen |= j + e < j_stop && (u16)(w[e / 2] >> (16 * (e % 2))) != 0xFC00u;
                    }
                }
            }
        } else {
#pragma unroll 8
            for (int idx = tid; idx < FT_BM * FT_BN; idx += 128) {
                const int t = t0 + idx / FT_BN, j = last * FT_BN + idx % FT_BN;
                if (t < t_end && j < j_stop) {
                    seen |= !(load_f32(mask.data + (i64)j * mask.nb[0] + (i64)t * mask.nb[1] + m_seq, mdt) == -TS_INF);
                }
            }
        }
        if (__syncthreads_or(seen)) break;
    }
    return min(j_stop, (last + 1) * FT_BN);
}

template <int DT, int D>
__device__ __forceinline__ void fa_mma_impl(Tensor q, Tensor k, Tensor v, Tensor mask, Tensor table, Tensor offsets,
                                            Tensor kv_lens, Tensor out, Tensor gate, int mdt, int has_mask, int paged,
                                            float scale, float softcap, int l_min, u64 err, u32 opcode) {
    extern __shared__ __align__(16) u16 ft_smem[];
    __shared__ __align__(8) int s_cell[FT_WG][2][FT_BN];
    __shared__ int s_gap[FT_WG][2][2];  // per tile buffer: whether warp 0 / 1's 32 cells hold a -1
    __shared__ int s_work[3];
#ifdef FT_WGMMA
    // 1024-byte aligned by pointer arithmetic, so that accesses stay shared-space ones (the
    // unpadded tiles leave room for it in the host's size, which the padded ones fill)
    u16* sQ = ft_smem + ((1024 - (tc_smem(ft_smem) & 1023)) & 1023) / 2;
#else
    u16* sQ = ft_smem;
#endif
    // Q, then each warp group's K, V and mask tiles (blockDim.x / 128 groups, at most FT_WG)
    const int groups = (int)blockDim.x >> 7;
    const int tid = threadIdx.x, wg = tid >> 7, gt = tid & 127, lane = tid & 31, warp = (tid >> 5) & 3;
    const int g = lane >> 2, tq = lane & 3;
    constexpr int GROUP_HALVES = 2 * ft_tile_halves(FT_BN, D) + FT_BM * FT_MLD;
    u16* sK = sQ + ft_tile_halves(FT_BM, D) + wg * GROUP_HALVES;
    u16* sV = sK + ft_tile_halves(FT_BN, D);
    u16* sM = sV + ft_tile_halves(FT_BN, D);

    const int n_tokens = (int)q.ne[1], n_head = (int)q.ne[2];
    const int n_cells = (int)k.ne[1], n_head_kv = (int)k.ne[2];
    const int n_kv = paged ? (int)table.ne[0] : n_cells;
    // Dense: the grid's blocks in launch order take every head's last token tile first, then
    // every head's next-to-last, ...: under a causal mask the tiles that see the most positions
    // start first and the short ones fill the last wave.
    const int lin = (int)(blockIdx.x + gridDim.x * blockIdx.y);
    const int h = offsets.data ? (int)blockIdx.y : lin % (int)gridDim.y;
    // Tokens t0 .. t_end (at most 64) of sequence s, in q's slot qs; token t sees positions
    // j <= t + causal (dense: all, causal = n_kv) and the block walks positions 0 .. j_stop.
    int t0 = ((int)gridDim.x - 1 - lin / (int)gridDim.y) * FT_BM, t_end = n_tokens, s = blockIdx.z, qs = blockIdx.z, causal = n_kv, j_stop = n_kv;
    if (offsets.data) {
        if (!fa_ragged_valid(offsets, kv_lens, n_tokens, n_kv, err, opcode)) return;
        const int n_seq = (int)kv_lens.ne[0];
        if (tid < 32) {
            // This block's (sequence, tile) among the tiles of the sequences it takes, in order.
            int base = 0;
            for (int s0 = 0; s0 < n_seq; s0 += 32) {
                const int si = s0 + lane;
                const int len = si < n_seq ? fa_i32(offsets, si + 1) - fa_i32(offsets, si) : 0;
                const int c = len >= l_min ? (len + FT_BM - 1) / FT_BM : 0;
                int x = c;
#pragma unroll
                for (int d = 1; d < 32; d <<= 1) {
                    const int y = __shfl_up_sync(0xffffffffu, x, d);
                    if (lane >= d) x += y;
                }
                const int first = base + x - c;
                if ((int)blockIdx.x >= first && (int)blockIdx.x < first + c) {
                    s_work[0] = si;
                    s_work[1] = (int)blockIdx.x - first;
                }
                base += __shfl_sync(0xffffffffu, x, 31);
            }
            if (lane == 0) s_work[2] = base;
        }
        __syncthreads();
        qs = 0;
        if ((int)blockIdx.x >= s_work[2]) {
            // A spare block: zero the rows of padding tokens (before offsets[0], from offsets[n_seq]).
            const int lead = fa_i32(offsets, 0), tail = fa_i32(offsets, n_seq);
            const i64 rows = (i64)(lead + n_tokens - tail) * n_head;
            const i64 spare = (i64)(gridDim.x - s_work[2]) * gridDim.y;
            for (i64 r = (i64)(blockIdx.x - s_work[2]) * gridDim.y + h; r < rows; r += spare) {
                const int tp = (int)(r / n_head), hr = (int)(r % n_head), t = tp < lead ? tp : tail + (tp - lead);
                for (int e = tid; e < (int)out.ne[0]; e += blockDim.x) fa_store(out, gate, e, hr, t, 0, 0.0f);
            }
            return;
        }
        s = s_work[0];
        const int o = fa_i32(offsets, s), len = fa_i32(offsets, s + 1) - o;
        t0 = o + s_work[1] * FT_BM;
        t_end = min(o + len, t0 + FT_BM);
        causal = fa_i32(kv_lens, s) - len - o;  // token t's last position is t + causal
        j_stop = t_end + causal;                // <= kv_lens[s] <= n_kv
    }
    const int hk = h / (n_head / n_head_kv);
    const i64 ks = paged ? 0 : s;
    const char* kbase = k.data + hk * k.nb[2] + ks * k.nb[3];
    const char* vbase = v.data + hk * v.nb[2] + ks * v.nb[3];
    const i64 m_seq = has_mask ? (qs % mask.ne[3]) * mask.nb[3] : 0;
    const float inner = softcap > 0.0f ? scale / softcap : 0.0f;
    // logits in base-2 units (ft_exp2)
    const float scale_2 = scale * FT_LOG2E, softcap_2 = softcap * FT_LOG2E;
    // the mask goes through shared memory when it is f16 with 16-byte aligned rows of whole pieces
    const bool mstage = has_mask && mdt == DT_F16 && mask.nb[0] == 2 && (mask.nb[1] & 15) == 0 &&
                        ((u64)(mask.data + m_seq) & 15) == 0 && (mask.ne[0] & 7) == 0;

    // cells[r]: the K/V row of position j0 + r, or -1 past j_stop (an out-of-range table entry is
    // reported and reads as -1 too)
    auto find_cells = [&](int j0, int slot) {
        int* cells = s_cell[wg][slot];
        if (gt < FT_BN) {
            const int j = j0 + gt;
            int cell = -1;
            if (j < j_stop) {
                const int raw = paged ? *(const int*)(table.data + (i64)j * table.nb[0] + (i64)s * table.nb[1]) : j;
                if (raw < 0 || raw >= n_cells) {
                    report_error((ErrorRecord*)err, ERR_INDEX_OUT_OF_RANGE, WHAT_KV_CELL, opcode, raw, n_cells, 0, 0);
                } else {
                    cell = raw;
                }
            }
            cells[gt] = cell;
            const bool gap = __any_sync(0xffffffffu, cell < 0);
            if (lane == 0) s_gap[wg][slot][gt >> 5] = gap;
        }
    };
    // copies the tile's rows of K or V (zeros for cells of -1) into dst: a thread always takes the
    // same 16-byte piece of every 128 / (D / 8)-th row, so that the addresses it computes once
    // serve every row (a copy is a few instructions, not a division and a generic-to-shared
    // conversion each; the 4 warps issue 2 x 64 rows of copies a tile)
    auto copy_rows = [&](u16* dst, const char* base, i64 nb1, const int* cells) {
        constexpr int CPR = D / 8, RPP = 128 / CPR;
        const int c8 = gt % CPR, r0 = gt / CPR;
        const u32 d0 = tc_smem(dst);
        const char* src = base + c8 * 16;
#pragma unroll
        for (int i = 0; i < FT_BN / RPP; i++) {
            const int r = r0 + RPP * i, cell = cells[r];
            tc_cp16_at(d0 + 2 * ft_at<FT_BN, D>(r, c8 * 8), src + (i64)max(cell, 0) * nb1, cell >= 0);
        }
    };
    // copies the mask's columns j0 .. j0 + 63 of the block's rows into dst
    auto copy_mask = [&](int j0, u16* dst) {
        for (int idx = gt; idx < FT_BM * (FT_BN / 8); idx += 128) {
            const int r = idx / (FT_BN / 8), j = j0 + idx % (FT_BN / 8) * 8, t = t0 + r;
            const bool ok = t < t_end && j < (int)mask.ne[0];
            tc_cp16(&dst[r * FT_MLD + j - j0], ok ? mask.data + (i64)j * 2 + (i64)t * mask.nb[1] + m_seq : mask.data, ok);
        }
    };

    // the first tile's copies fly while the mask is scanned and Q is loaded (its cells are the
    // same for any j_stop the scan leaves: at least one whole tile); group 0 always takes it
    if (wg == 0) find_cells(0, 0);
    __syncthreads();
    if (wg == 0 && j_stop > 0) {
        copy_rows(sK, kbase, k.nb[1], s_cell[0][0]);
        if (mstage) copy_mask(0, sM);
    }
    tc_commit();
    if (has_mask) j_stop = ft_mask_stop(mask, mdt, m_seq, mstage, t0, t_end, j_stop);
    // The groups split the block's kv tiles: group 0 the first half (rounded up), group 1 the
    // rest; their partial softmax states are merged at the end.
    const int n_tiles = (j_stop + FT_BN - 1) / FT_BN, half = groups == 2 ? (n_tiles + 1) / 2 : n_tiles;
    const int j_begin = wg == 0 ? 0 : half * FT_BN, j_end = wg == 0 ? min(j_stop, half * FT_BN) : j_stop;
    if (wg == 1 && j_begin < j_end) {
        find_cells(j_begin, 0);
        ft_group_sync(1);
        copy_rows(sK, kbase, k.nb[1], s_cell[1][0]);
        if (mstage) copy_mask(j_begin, sM);
    }
    tc_commit();

    if (wg == 0) ft_load_q<DT, FT_BM, D, 128>(
        sQ, q.nb[0],
        [&](int r) -> const char* {
            const int t = t0 + r;
            return t < t_end ? q.data + (i64)t * q.nb[1] + (i64)h * q.nb[2] + (i64)qs * q.nb[3] : nullptr;
        },
        [](int r, int c) { return ft_at<FT_BM, D>(r, c); });
#ifdef FT_WGMMA
    tc_fence_async();
#endif
    __syncthreads();  // Q written (each group reads all of it)

    float o[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m[2] = {-TS_INF, -TS_INF}, l[2] = {0.0f, 0.0f};
    const int tok[2] = {t0 + warp * 16 + g, t0 + warp * 16 + g + 8};

    // The copies overlap the tensor cores, staggered over one K, one V and one mask buffer: V of
    // tile j lands while S of tile j is computed, K and the mask of tile j + 1 while O takes P V
    // of tile j; two barriers a tile. (Two buffers of each, all of tile j + 1 copied during tile
    // j, left one block a multiprocessor at D = 256 and were slower: docs/perf-log.)
    // Each group walks its tiles with its own buffers and barriers.
    for (int j0 = j_begin, buf = 0; j0 < j_end; j0 += FT_BN, buf ^= 1) {
        const int* cell = s_cell[wg][buf];
        tc_wait<0>();
#ifdef FT_WGMMA
        tc_fence_async();  // this thread's copies, before the tensor cores read them
#endif
        ft_group_sync(wg);  // K and the mask of this tile landed; V is free
        copy_rows(sV, vbase, v.nb[1], cell);
        tc_commit();
        const bool more = j0 + FT_BN < j_end;
        if (more) find_cells(j0 + FT_BN, buf ^ 1);

        // S = Q K^T for this warp's 16 rows and the tile's 64 keys.
        float sc[FT_BN / 8][4];
        ft_scores<DT, D>(sc, sQ, sK, warp, lane);
        // Logits and the online-softmax update (rows g and g + 8 of the warp's 16). The softcap
        // and mask choices are uniform branches around whole loops: taken per element, every
        // element inlined tanhf and the mask's dtype switch, and the loop outgrew the
        // instruction cache.
        if (softcap > 0.0f) {
#pragma unroll
            for (int n = 0; n < FT_BN / 8; n++) {
#pragma unroll
                for (int i = 0; i < 4; i++) sc[n][i] = softcap_2 * tanhf(sc[n][i] * inner);
            }
        } else {
#pragma unroll
            for (int n = 0; n < FT_BN / 8; n++) {
#pragma unroll
                for (int i = 0; i < 4; i++) sc[n][i] *= scale_2;
            }
        }
        if (mstage) {
            // rows past t_end were zero-filled; columns past j_stop become -inf below
#pragma unroll
            for (int n = 0; n < FT_BN / 8; n++) {
#pragma unroll
                for (int rr = 0; rr < 2; rr++) {
                    const u32 mm = *(const u32*)&sM[(warp * 16 + g + 8 * rr) * FT_MLD + n * 8 + 2 * tq];
                    sc[n][2 * rr] = fmaf(f16_to_f32((u16)mm), FT_LOG2E, sc[n][2 * rr]);
                    sc[n][2 * rr + 1] = fmaf(f16_to_f32((u16)(mm >> 16)), FT_LOG2E, sc[n][2 * rr + 1]);
                }
            }
        } else if (has_mask) {
#pragma unroll
            for (int n = 0; n < FT_BN / 8; n++) {
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const int j = j0 + n * 8 + 2 * tq + (i & 1), t = tok[i >> 1];
                    if (j < j_stop && t < t_end) {
                        const float mv = load_f32(mask.data + (i64)j * mask.nb[0] + (i64)t * mask.nb[1] + m_seq, mdt);
                        sc[n][i] = fmaf(mv, FT_LOG2E, sc[n][i]);
                    }
                }
            }
        }
        float mx[2] = {-TS_INF, -TS_INF};
        // A tile whose 64 cells are all valid and whose positions every row of the warp sees
        // (all but a causal batch's diagonal tiles) needs no test per logit.
        const bool whole = !s_gap[wg][buf][0] && !s_gap[wg][buf][1] && j0 + FT_BN - 1 <= t0 + warp * 16 + causal;
        if (whole) {
#pragma unroll
            for (int n = 0; n < FT_BN / 8; n++) {
#pragma unroll
                for (int i = 0; i < 4; i++) mx[i >> 1] = fmaxf(mx[i >> 1], sc[n][i]);
            }
        } else {
#pragma unroll
            for (int n = 0; n < FT_BN / 8; n++) {
                const int2 cc = *(const int2*)&cell[n * 8 + 2 * tq];
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const int j = j0 + n * 8 + 2 * tq + (i & 1), rr = i >> 1;
                    const float x = ((i & 1) ? cc.y : cc.x) >= 0 && j <= tok[rr] + causal ? sc[n][i] : -TS_INF;
                    sc[n][i] = x;
                    mx[rr] = fmaxf(mx[rr], x);
                }
            }
        }
#pragma unroll
        for (int rr = 0; rr < 2; rr++) {
            mx[rr] = fmaxf(mx[rr], __shfl_xor_sync(0xffffffffu, mx[rr], 1));
            mx[rr] = fmaxf(mx[rr], __shfl_xor_sync(0xffffffffu, mx[rr], 2));
        }
        float ms[2], alpha[2];
#pragma unroll
        for (int rr = 0; rr < 2; rr++) {
            const float m_new = fmaxf(m[rr], mx[rr]);
            ms[rr] = m_new == -TS_INF ? 0.0f : m_new;
            alpha[rr] = exp2f(m[rr] - ms[rr]);
            l[rr] *= alpha[rr];
            m[rr] = m_new;
        }
        // O is rescaled only when some row of the warp has a new maximum (after the first tiles
        // most have not; times 1 would change nothing)
        if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
            for (int n = 0; n < D / 8; n++) {
                o[n][0] *= alpha[0];
                o[n][1] *= alpha[0];
                o[n][2] *= alpha[1];
                o[n][3] *= alpha[1];
            }
        }
#pragma unroll
        for (int n = 0; n < FT_BN / 8; n++) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const float p = ft_exp2(sc[n][i] - ms[i >> 1]);
                sc[n][i] = p;
                l[i >> 1] += p;
            }
        }
        tc_wait<0>();
#ifdef FT_WGMMA
        tc_fence_async();
#endif
        ft_group_sync(wg);  // V of this tile landed; every warp is done with K, the mask and `cell`
        if (more) {
            copy_rows(sK, kbase, k.nb[1], s_cell[wg][buf ^ 1]);
            if (mstage) copy_mask(j0 + FT_BN, sM);
        }
        tc_commit();
        // O += P V.
        ft_pv<DT, D>(o, sc, sV, lane);
    }

#pragma unroll
    for (int rr = 0; rr < 2; rr++) {
        l[rr] += __shfl_xor_sync(0xffffffffu, l[rr], 1);
        l[rr] += __shfl_xor_sync(0xffffffffu, l[rr], 2);
    }
#if FT_WG == 2
    if (groups == 2 && !ft_merge_groups<D>(o, m, l, (float*)(sQ + ft_tile_halves(FT_BM, D) + GROUP_HALVES), wg, gt)) return;
#endif
#pragma unroll
    for (int rr = 0; rr < 2; rr++) {
        if (tok[rr] >= t_end) continue;
        const float inv = m[rr] == -TS_INF ? 0.0f : 1.0f / l[rr];
#pragma unroll
        for (int n = 0; n < D / 8; n++) {
            const int d = n * 8 + 2 * tq;
            fa_store(out, gate, d, h, tok[rr], qs, o[n][2 * rr] * inv);
            fa_store(out, gate, d + 1, h, tok[rr], qs, o[n][2 * rr + 1] * inv);
        }
    }
}

#define FA_MMA(NAME, DT, D)                                                                                    \
    extern "C" __global__ void __launch_bounds__(128 * FT_WG)                                                  \
        NAME(Tensor q, Tensor k, Tensor v, Tensor mask, Tensor table, Tensor offsets, Tensor kv_lens, Tensor out, \
             Tensor gate,                                                                                        \
             int mdt, int has_mask, int paged, float scale, float softcap, int l_min, u64 err, u32 opcode) {     \
        grid_begin();                                                                                            \
        fa_mma_impl<DT, D>(q, k, v, mask, table, offsets, kv_lens, out, gate, mdt, has_mask, paged, scale, softcap,  \
                           l_min, err, opcode);                                                                \
    }

FA_MMA(fa_mma_f16_d128, DT_F16, 128)
FA_MMA(fa_mma_f16_d256, DT_F16, 256)
FA_MMA(fa_mma_bf16_d128, DT_BF16, 128)
FA_MMA(fa_mma_bf16_d256, DT_BF16, 256)

// ---- decode on tensor cores ----
//
// `fa_dec_*`: f16/bf16 K/V with d_k = d_v = D (128 or 256) and few query tokens. A block takes up
// to FD_R = 8 query rows (`hb` heads of one kv group times `tb` tokens: the N columns of mma.sync
// m16n8k16, so every K/V row it reads serves all of them) over one split of the kv positions.
// The products run transposed, kv positions and head dims on the M side: S^T = K Q^T (16
// positions x 8 rows, K from shared memory, Q^T from registers loaded once) and O^T += V^T P^T
// (D x 8), where a 16-row M tile of queries would have been mostly padding for a kv group of 6
// or 8 heads; the 16 x 8 P^T becomes the B operand through two `movmatrix` transposes. Each of
// the FD_W warps walks its own chunks of FD_N = 16 positions (chunk c of the split goes to warp
// c % FD_W) with its own online-softmax state: the chunk's K and V rows (through the block table
// when paged) are copied into the warp's shared-memory ring of FD_S stages with 16-byte cp.async,
// each stage refilled as soon as its chunk is computed, and the softmax runs on the S^T fragments
// in f32. The chunk's table entries and mask values are loaded into registers a chunk ahead, so that no
// global-memory latency sits on a warp's chunk-to-chunk path. At the end each warp leaves its
// state in shared memory and warp w merges the head-dim tiles w, w + FD_W, ...: with one split
// the block writes the output rows, else (max, sum, acc[D]) partials for `fa_combine`. Dynamic
// shared memory: FD_W * FD_S * 2 * FD_N * (D + FT_PAD) halves. (The measurements behind the
// layout: docs/perf-log/kernels-attention.md.)
//
// Ragged: one token per tile (tb = 1; see `fa_ragged_token` for the two tilings), whose rows all
// see its first `vis` positions, so the split simply ends there: a decode batch of n sequences
// gets the grid and the work of the dense decode of n sequences of one token.

#define FD_W 4   // warps per block
#define FD_S 2   // ring stages per warp
#define FD_N 16  // kv positions per chunk
#define FD_R 8   // query rows per block

// The 8 x 8 b16 matrix whose fragments (thread t: row t / 4, columns 2 (t % 4) and + 1) the warp
// holds in `x`, transposed, in the same layout.
__device__ __forceinline__ u32 fd_transpose(u32 x) {
    u32 r;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
    return r;
}

template <int DT, int D>
__device__ __forceinline__ void fa_dec_impl(Tensor q, Tensor k, Tensor v, Tensor mask, Tensor table, Tensor offsets,
                                            Tensor kv_lens, Tensor out, Tensor gate, int mdt, int has_mask, int paged,
                                            float scale, float softcap, int split_len, int hb, int tb, int h_blocks,
                                            int t_blocks, int seq_stride, float* part, u64 err, u32 opcode) {
    extern __shared__ __align__(16) u16 fd_smem[];
    __shared__ u32 s_valid[FD_W][FD_S];
    __shared__ float s_m[FD_W][FD_R];
    __shared__ float s_l[FD_W][FD_R];
    constexpr int LD = D + FT_PAD;                    // halves per K/V row in shared memory
    constexpr int STAGE = 2 * FD_N * LD;              // halves per stage (K then V)
    constexpr int WARP_HALVES = FD_S * STAGE;         // a warp's ring
    constexpr int CPR = D / 8;                        // 16-byte pieces per row
    constexpr int MT = D / 16;                        // k16 steps of S^T, m16 tiles of O^T
    static_assert(WARP_HALVES * 2 >= FD_R * D * 4, "a warp's ring holds its f32 accumulators");

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tq = lane & 3;
    const int n_tokens = (int)q.ne[1], n_head = (int)q.ne[2];
    const int n_cells = (int)k.ne[1], n_head_kv = (int)k.ne[2];
    const int n_kv = paged ? (int)table.ne[0] : n_cells;
    const int group = (u32)n_head / (u32)n_head_kv;  // (unsigned: cheaper divisions, all >= 0)
    const int n_splits = (int)gridDim.y;

    const int tile = blockIdx.x, split = blockIdx.y;
    const int tbi = (u32)tile % (u32)t_blocks, hbi = (u32)tile / (u32)t_blocks % (u32)h_blocks;
    const int hk = (u32)tile / (u32)(t_blocks * h_blocks);
    // Dense: tokens t0 .. t0 + tn of sequence s (q's slot qs = s) over all positions. Ragged
    // (tb == 1): one token of sequence s in slot 0, seeing its first `vis` positions.
    // (See `fa_ragged_local` for how a ragged block finds its token: s starts as a guess.)
    int s = blockIdx.z, qs = blockIdx.z, t0 = tbi * tb, tn = min(tb, n_tokens - t0);
    if (offsets.data) {
        if (blockIdx.x == 0 && blockIdx.y == 0 && !fa_ragged_valid(offsets, kv_lens, n_tokens, n_kv, err, opcode)) return;
        s = fa_ragged_guess(tbi, seq_stride, (int)kv_lens.ne[0]);
        qs = 0;
        t0 = tbi;
        tn = 1;
    }
    const int h0 = hk * group + hbi * hb;
    const int hn = min(hb, group - hbi * hb);
    const int nrows = hn * tn;
    const int j_begin = split * split_len;
    int j_end = min(n_kv, j_begin + split_len);
    const char* kbase = k.data + hk * k.nb[2] + (paged ? 0 : s) * k.nb[3];
    const char* vbase = v.data + hk * v.nb[2] + (paged ? 0 : s) * v.nb[3];
    const i64 m_seq = has_mask ? (i64)((u32)qs % (u32)mask.ne[3]) * mask.nb[3] : 0;
    const float inner = softcap > 0.0f ? scale / softcap : 0.0f;

    u16* ring = fd_smem + warp * WARP_HALVES;
    const u32 ring_s = tc_smem(ring);
    const u32 knb = (u32)k.nb[1], vnb = (u32)v.nb[1];  // below 2^31 (the host's condition)
    // The tokens of this thread's two S^T columns (rows 2 tq and 2 tq + 1), for the mask.
    int tok[2] = {t0 + (2 * tq < nrows ? (u32)(2 * tq) % (u32)tn : 0), t0 + (2 * tq + 1 < nrows ? (u32)(2 * tq + 1) % (u32)tn : 0)};

    int n_chunks = (j_end - j_begin + FD_N - 1) / FD_N;
    int my_chunks = n_chunks > warp ? (n_chunks - warp + FD_W - 1) / FD_W : 0;
    // The table entry (unchecked; j itself when not paged) of lane's position in chunk `it`.
    // Loaded an iteration before `issue` needs it, so that its latency hides behind a chunk.
    auto raw_of = [&](int it) -> int {
        const int j = j_begin + (warp + it * FD_W) * FD_N + lane;
        if (!paged || it >= my_chunks || lane >= FD_N || j >= j_end) return j;
        return *(const int*)(table.data + (i64)j * table.nb[0] + (i64)s * table.nb[1]);
    };
    // The mask bits (f32, f16 or bf16; converted by `mask_val` only when used) of the fragment's
    // positions in chunk `it` (g and g + 8, for the columns' tokens), loaded a chunk ahead for
    // the same reason.
    auto mask_bits = [&](int it, u32* mb) {
        const int j0 = j_begin + (warp + it * FD_W) * FD_N;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int j = j0 + g + (i >> 1) * 8;
            mb[i] = 0;
            if (has_mask && it < my_chunks && j < j_end) {
                const char* mp = mask.data + (i64)j * mask.nb[0] + (i64)tok[i & 1] * mask.nb[1] + m_seq;
                mb[i] = mdt == DT_F32 ? *(const u32*)mp : (u32)*(const u16*)mp;
            }
        }
    };
    auto mask_val = [&](u32 b) -> float {
        return mdt == DT_F32 ? __uint_as_float(b) : mdt == DT_F16 ? f16_to_f32((u16)b) : bf16_to_f32((u16)b);
    };
    // Starts the copy of this warp's chunk `it` (table entry `raw` from `raw_of`) into ring stage
    // `st`; invalid positions read as 0.
    auto issue = [&](int it, int st, int raw) {
        const int j0 = j_begin + (warp + it * FD_W) * FD_N;
        const bool mine = lane < FD_N && j0 + lane < j_end;
        const bool bad = mine && (raw < 0 || raw >= n_cells);
        const int cell = mine && !bad ? raw : -1;
        if (__any_sync(0xffffffffu, bad)) {
            const bool report = !offsets.data || fa_ragged_valid_warp(offsets, kv_lens, n_tokens, n_kv);
            if (bad && report) report_error((ErrorRecord*)err, ERR_INDEX_OUT_OF_RANGE, WHAT_KV_CELL, opcode, raw, n_cells, 0, 0);
        }
        const u32 valid = __ballot_sync(0xffffffffu, cell >= 0);
        if (lane == 0) s_valid[warp][st] = valid;
        // Lane takes piece lane % CPR of rows lane / CPR, + 32 / CPR, ...
        const u32 sK = ring_s + st * STAGE * 2 + (lane / CPR * LD + lane % CPR * 8) * 2;
        const u32 sV = sK + FD_N * LD * 2;
        const char* kp = kbase + lane % CPR * 16;
        const char* vp = vbase + lane % CPR * 16;
#pragma unroll
        for (int i = 0; i < FD_N * CPR / 32; i++) {
            const int p = i * 32 / CPR + lane / CPR;
            const int cl = __shfl_sync(0xffffffffu, cell, p);
            const bool ok = cl >= 0;
            const u32 row = ok ? cl : 0;
            tc_cp16_at(sK + i * 32 / CPR * LD * 2, kp + (u64)row * knb, ok);
            tc_cp16_at(sV + i * 32 / CPR * LD * 2, vp + (u64)row * vnb, ok);
        }
    };

    float o[MT][4];
#pragma unroll
    for (int n = 0; n < MT; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m[2] = {-TS_INF, -TS_INF}, l[2] = {0.0f, 0.0f};

    // The first chunks' table entries; for a ragged block, those of the guessed sequence over the
    // whole split, loaded in the same round as the values that confirm the guess and narrow the
    // range (positions past it are then ignored by `issue`).
    int raw_pre[FD_S];
#pragma unroll
    for (int it = 0; it < FD_S; it++) raw_pre[it] = raw_of(it);
    if (offsets.data) {
        const int guess = s;
        int vis;
        if (!fa_ragged_local(offsets, kv_lens, tbi, seq_stride, n_tokens, n_kv, s, t0, vis)) return;
        j_end = min(j_end, vis);
        n_chunks = (j_end - j_begin + FD_N - 1) / FD_N;
        my_chunks = n_chunks > warp ? (n_chunks - warp + FD_W - 1) / FD_W : 0;
        kbase = k.data + hk * k.nb[2] + (paged ? 0 : s) * k.nb[3];
        vbase = v.data + hk * v.nb[2] + (paged ? 0 : s) * v.nb[3];
        tok[0] = tok[1] = t0;
        if (s != guess) {
#pragma unroll
            for (int it = 0; it < FD_S; it++) raw_pre[it] = raw_of(it);
        }
    }
    // Q^T as the B operand, rounded to the K/V type: qf[i] holds row g's elements 16 i + 2 tq, + 1
    // and 16 i + 2 tq + 8, + 9 (zeros for rows past nrows, which read row 0: one straight-line
    // path for the warp). The loads go out first, with the first mask values, so that their
    // latency passes while the first chunks' copies are issued; they are packed after.
    const bool q_live = g < nrows;
    float2 qx[MT][2];
    {
        const int r = q_live ? g : 0, h = h0 + (u32)r / (u32)tn, t = t0 + (u32)r % (u32)tn;
        const char* qrow = q.data + (i64)t * q.nb[1] + (i64)h * q.nb[2] + (i64)qs * q.nb[3];
        const bool pairs = q.nb[0] == 4 && ((q.nb[1] | q.nb[2] | q.nb[3] | (i64)q.data) & 7) == 0;
        if (pairs) {
#pragma unroll
            for (int i = 0; i < MT; i++) {
                qx[i][0] = *(const float2*)(qrow + (16 * i + 2 * tq) * 4);
                qx[i][1] = *(const float2*)(qrow + (16 * i + 2 * tq + 8) * 4);
            }
        } else {
            const i64 nb0 = q.nb[0];
#pragma unroll
            for (int i = 0; i < MT; i++) {
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int e = 16 * i + 2 * tq + 8 * h;
                    qx[i][h] = make_float2(*(const float*)(qrow + e * nb0), *(const float*)(qrow + (e + 1) * nb0));
                }
            }
        }
    }
    u32 mb[4];
    mask_bits(0, mb);
#pragma unroll
    for (int st = 0; st < FD_S; st++) {
        if (st < my_chunks) issue(st, st, raw_pre[st]);
        tc_commit();
    }
    int raw_next = raw_of(FD_S);
    u32 qf[MT][2];
#pragma unroll
    for (int i = 0; i < MT; i++) {
        qf[i][0] = q_live ? ft_pack<DT>(qx[i][0].x, qx[i][0].y) : 0u;
        qf[i][1] = q_live ? ft_pack<DT>(qx[i][1].x, qx[i][1].y) : 0u;
    }
    // Pending copy groups at the top of iteration it: chunks it .. it + FD_S - 1.
    for (int it = 0; it < my_chunks; it++) {
        float mv[4];
#pragma unroll
        for (int i = 0; i < 4; i++) mv[i] = mask_val(mb[i]);
        mask_bits(it + 1, mb);
        const int st = it % FD_S;
        tc_wait<FD_S - 1>();
        __syncwarp();
        const u32 sK = ring_s + st * STAGE * 2, sV = sK + FD_N * LD * 2;
        const u32 valid = s_valid[warp][st];

        // S^T = K Q^T: 16 positions x 8 rows, four accumulator chains over the k steps.
        float sa[4][4];
#pragma unroll
        for (int c = 0; c < 4; c++) sa[c][0] = sa[c][1] = sa[c][2] = sa[c][3] = 0.0f;
#pragma unroll
        for (int i = 0; i < MT; i++) {
            u32 a[4];
            tc_ldsm4_at(a, sK + ((lane & 15) * LD + 16 * i + (lane >> 4) * 8) * 2);
            ft_mma<DT>(sa[i & 3], a, qf[i][0], qf[i][1]);
        }
        // Logits and the online-softmax update: element i is position g + 8 (i >> 1) of column
        // (row) 2 tq + (i & 1).
        float sc[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float d = (sa[0][i] + sa[1][i]) + (sa[2][i] + sa[3][i]);
            const float x = (softcap > 0.0f ? softcap * tanhf(d * inner) : d * scale) + mv[i];
            sc[i] = (valid >> (g + (i >> 1) * 8)) & 1 ? x : -TS_INF;
        }
        float ms[2], alpha[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            float mx = fmaxf(sc[r], sc[r + 2]);
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
            const float m_new = fmaxf(m[r], mx);
            ms[r] = m_new == -TS_INF ? 0.0f : m_new;
            alpha[r] = expf(m[r] - ms[r]);
            l[r] *= alpha[r];
            m[r] = m_new;
        }
#pragma unroll
        for (int n = 0; n < MT; n++) {
            o[n][0] *= alpha[0];
            o[n][1] *= alpha[1];
            o[n][2] *= alpha[0];
            o[n][3] *= alpha[1];
        }
#pragma unroll
        for (int i = 0; i < 4; i++) {
            sc[i] = expf(sc[i] - ms[i & 1]);
            l[i & 1] += sc[i];
        }
        // O^T += V^T P^T: P^T's two 8 x 8 halves (positions 0-7, 8-15), transposed, are the B
        // fragments; V^T's through transposing ldmatrix of the V rows.
        const u32 b0 = fd_transpose(ft_pack<DT>(sc[0], sc[1])), b1 = fd_transpose(ft_pack<DT>(sc[2], sc[3]));
#pragma unroll
        for (int n = 0; n < MT; n++) {
            u32 a[4];
            ft_ldsm4_trans_at(a, sV + (((lane & 7) + (lane >> 4) * 8) * LD + 16 * n + ((lane >> 3) & 1) * 8) * 2);
            ft_mma<DT>(o[n], a, b0, b1);
        }
        __syncwarp();  // the stage is consumed: refill it with chunk it + FD_S
        if (it + FD_S < my_chunks) issue(it + FD_S, st, raw_next);
        tc_commit();
        raw_next = raw_of(it + FD_S + 1);
    }

    // Merge the warps: each leaves (m, l) per row and its O^T fragments (in its own ring), then
    // warp w merges the head-dim tiles w, w + FD_W, ... for all rows.
    tc_wait<0>();
    __syncthreads();
    float* so = (float*)ring;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 4);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 8);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 16);
        if (g == 0) {
            s_m[warp][2 * tq + r] = m[r];
            s_l[warp][2 * tq + r] = l[r];
        }
    }
#pragma unroll
    for (int n = 0; n < MT; n++) *(float4*)&so[(n * 32 + lane) * 4] = make_float4(o[n][0], o[n][1], o[n][2], o[n][3]);
    __syncthreads();
    float mm[2], ll[2], f[FD_W][2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        mm[r] = -TS_INF;
#pragma unroll
        for (int w = 0; w < FD_W; w++) mm[r] = fmaxf(mm[r], s_m[w][2 * tq + r]);
        ll[r] = 0.0f;
#pragma unroll
        for (int w = 0; w < FD_W; w++) {
            f[w][r] = mm[r] == -TS_INF ? 0.0f : expf(s_m[w][2 * tq + r] - mm[r]);
            ll[r] += s_l[w][2 * tq + r] * f[w][r];
        }
    }
    const i64 n_rows_g = (i64)n_head * n_tokens * out.ne[3];
    float* pr[2] = {nullptr, nullptr};
    int hr[2], tr[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = 2 * tq + r;
        hr[r] = h0 + (u32)row / (u32)tn;
        tr[r] = t0 + (u32)row % (u32)tn;
        if (row < nrows && n_splits > 1) {
            pr[r] = part + ((i64)split * n_rows_g + ((i64)qs * n_head + hr[r]) * n_tokens + tr[r]) * (D + 2);
            if (warp == 0 && g == 0) {
                pr[r][0] = mm[r];
                pr[r][1] = ll[r];
            }
        }
    }
    for (int n = warp; n < MT; n += FD_W) {
        float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int w = 0; w < FD_W; w++) {
            const float4 x = *(const float4*)((const float*)(fd_smem + w * WARP_HALVES) + (n * 32 + lane) * 4);
            a[0] += x.x * f[w][0];
            a[1] += x.y * f[w][1];
            a[2] += x.z * f[w][0];
            a[3] += x.w * f[w][1];
        }
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int r = i & 1, e = 16 * n + g + (i >> 1) * 8;
            if (2 * tq + r >= nrows) continue;
            if (n_splits == 1) fa_store(out, gate, e, hr[r], tr[r], qs, mm[r] == -TS_INF ? 0.0f : a[i] / ll[r]);
            else pr[r][2 + e] = a[i];
        }
    }
}

#define FA_DEC(NAME, DT, D)                                                                                    \
    extern "C" __global__ void __launch_bounds__(FD_W * 32, 1)                                                 \
        NAME(Tensor q, Tensor k, Tensor v, Tensor mask, Tensor table, Tensor offsets, Tensor kv_lens, Tensor out, \
             Tensor gate,                                                                                        \
             int mdt, int has_mask, int paged, float scale, float softcap, int split_len, int hb, int tb,        \
             int h_blocks, int t_blocks, int seq_stride, float* part, u64 err, u32 opcode) {                     \
        grid_begin();                                                                                            \
        fa_dec_impl<DT, D>(q, k, v, mask, table, offsets, kv_lens, out, gate, mdt, has_mask, paged, scale, softcap,  \
                           split_len, hb, tb, h_blocks, t_blocks, seq_stride, part, err, opcode);              \
    }

FA_DEC(fa_dec_f16_d128, DT_F16, 128)
FA_DEC(fa_dec_f16_d256, DT_F16, 256)
FA_DEC(fa_dec_bf16_d128, DT_BF16, 128)
FA_DEC(fa_dec_bf16_d256, DT_BF16, 256)
