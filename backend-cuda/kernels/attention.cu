// attention.cu: flash_attn_ext (online-softmax attention, f32 accumulation), optionally reading K/V
// through a paged block table: the SIMT kernel and the combine of split partials. The tensor-core
// kernels are attention_prefill.cu (`fa_mma_*`) and attention_decode.cu (`fa_dec_*`); the
// semantics and what they share are in attention.cuh.
//
// `fa_partial` is the SIMT kernel for decode and small prefills (f32 or mixed K/V, odd head dims,
// unaligned rows; `fa_dec_*` takes aligned f16/bf16). A block takes a tile of query rows
// (up to FA_R rows: `hb` query heads of one kv group times `tb` tokens, so every K/V row it reads
// serves all of them: GQA sharing) and a range of kv positions (a split: long contexts are cut
// into `n_splits` ranges run by different blocks). Each of its FA_W warps walks chunks of 32
// positions: per position, lane `l` holds elements `l*8 .. l*8+7` of the K row (one 16-byte load
// for f16/bf16 when aligned), the warp reduces the 8 rows' dots at once (`fa_sum8`, 9 shuffles)
// and lane `c` gets the logits of position `c`; then softcap, mask, the chunk's branch-free
// online-softmax update and the weighted V rows (same element layout as K). Each chunk's K/V
// rows are prefetched into L2 one chunk ahead. The warps' states are merged in shared memory;
// with one split the block writes the output rows, else it writes (max, sum, acc[d_v]) partials
// to scratch and `fa_combine` merges the splits. `fa_mma_*` is the tensor-core prefill.

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

// Merges `n_splits` partials (max, sum, acc[d_v]) of each output row: block (g, y) takes
// elements y * blockDim.x + threadIdx.x of row g = (s * n_head + h) * n_tokens + t (blockDim a
// multiple of 32; several small blocks a row spread the partials' reads over more
// multiprocessors). With a ragged batch tiled by sequence (`seq_stride > 0`), rows of tokens the
// split-K kernel did not take are left alone. One round of loads does most of the work: the
// splits' maxima and sums and the first FC_PRE partials of the thread's element, all in flight at
// once. Up to 32 splits (a decode's) a warp holds them, lane i split i's, and every warp merges
// them itself: no block barrier. More go through shared memory. n_splits <= FC_SPLITS:
// TAG(fa-splits).
#define FC_SPLITS 384
#define FC_PRE 32
// The warp path (up to 32 splits) holds split i's factor in lane i and all of a thread's partials
// in `pre`; the shared-memory path takes the first FC_PRE partials from `pre` and the rest from
// memory.
static_assert(FC_PRE == 32, "one warp of splits in pre");
extern "C" __global__ void fa_combine(const float* part, Tensor out, Tensor gate, Tensor offsets, Tensor kv_lens,
                                      int seq_stride, int n_splits, int dv, int n_tokens, int n_head) {
    grid_begin();
    __shared__ float scratch[32];
    __shared__ float factor[FC_SPLITS], sums[FC_SPLITS];
    const i64 g = blockIdx.x;
    if (offsets.data && seq_stride > 0) {
        // offsets were checked by the split-K kernel; with bad ones its output is not used
        int s, t, vis;
        fa_ragged_token(offsets, kv_lens, (int)((u32)g % (u32)n_tokens), 0, s, t, vis);
        const int len = fa_i32(offsets, s + 1) - fa_i32(offsets, s);
        if (vis == 0 || len > seq_stride || len < 0) return;
    }
    const i64 n_rows_g = (i64)n_head * n_tokens * out.ne[3];
    const i64 stride = dv + 2, split_stride = n_rows_g * stride;
    const float* pg = part + g * stride;
    const int e = blockIdx.y * blockDim.x + threadIdx.x;
    const bool live = e < dv;
    float pre[FC_PRE];
#pragma unroll
    for (int i = 0; i < FC_PRE; i++) pre[i] = live && i < n_splits ? pg[i * split_stride + 2 + e] : 0.0f;
    // rows = gridDim.x < 2^31: 32-bit divisions
    const u32 gt = (u32)g / (u32)n_tokens;
    const int t = (int)((u32)g % (u32)n_tokens), h = (int)(gt % (u32)n_head), s = (int)(gt / (u32)n_head);
    float mm, ll, a = 0.0f;
    if (n_splits <= FC_PRE) {
        const int lane = threadIdx.x & 31;
        const bool has = lane < n_splits;
        const float m = has ? pg[lane * split_stride] : -TS_INF, l = has ? pg[lane * split_stride + 1] : 0.0f;
        mm = warp_max(m);
        const float f = has ? expf(m - (mm == -TS_INF ? 0.0f : mm)) : 0.0f;
        ll = warp_sum(l * f);
#pragma unroll
        for (int i = 0; i < FC_PRE; i++) a += pre[i] * __shfl_sync(0xffffffffu, f, i);
    } else {
        mm = -TS_INF;
        for (int i = threadIdx.x; i < n_splits; i += blockDim.x) {
            const float m = pg[i * split_stride], l = pg[i * split_stride + 1];
            factor[i] = m;
            sums[i] = l;
            mm = fmaxf(mm, m);
        }
        mm = block_max(mm, scratch);  // its barriers also order the writes to factor and sums
        const float ms = mm == -TS_INF ? 0.0f : mm;
        ll = 0.0f;
        for (int i = threadIdx.x; i < n_splits; i += blockDim.x) {
            const float f = expf(factor[i] - ms);
            factor[i] = f;
            ll += sums[i] * f;
        }
        ll = block_sum(ll, scratch);
#pragma unroll
        for (int i = 0; i < FC_PRE; i++) a += pre[i] * factor[i];
        if (live) {
#pragma unroll 16
            for (int i = FC_PRE; i < n_splits; i++) a += pg[i * split_stride + 2 + e] * factor[i];
        }
    }
    if (live) fa_store(out, gate, e, h, t, s, mm == -TS_INF ? 0.0f : a / ll);
}
