// reduce.cu: row-wise ops over ne[0]: rms_norm, l2_norm, sum_rows, softmax (scale, optional
// f32/f16 mask), argmax, top_k and argsort.
//
// Rows are (i1, i2, i3) in ggml order, flattened as r = i1 + ne1 * (i2 + ne2 * i3). Each kernel
// comes in two shapes chosen by the host: WARP (one warp per row, 8 rows per 256-thread block, for
// rows up to 1024 elements) and BLOCK (one block per row). Any strides, f32/f16/bf16 inputs,
// computed in f32 like the CPU oracle (l2_norm redoes an over/underflowing sum of squares in f64
// as the CPU does). Long rows with few of them (a vocabulary softmax or argmax) split each row
// over several blocks through scratch partials.
//
// Sorting (top_k, argsort) orders elements by a u64 rank: an order-preserving u32 key of the value
// (NaN lowest, -0 == +0, complemented for descending) in the high half and the index in the low
// half, ascending. Ranks are distinct, so this is the CPU's stable order exactly.

// The row walk and the norm rows are in norm.cuh (shared with delta_net.cu).

// ---- rms_norm and l2_norm entries ----

extern "C" __global__ void norm_warp(Tensor dst, Tensor src, int src_dt, float eps, int mode) { grid_begin(); norm_rows<true>(dst, src, src_dt, eps, mode); }
extern "C" __global__ void norm_block(Tensor dst, Tensor src, int src_dt, float eps, int mode) { grid_begin(); norm_rows<false>(dst, src, src_dt, eps, mode); }
extern "C" __global__ void norm_vec_warp(Tensor dst, Tensor src, float eps, int mode) { grid_begin(); norm_rows_vec<true, 8>(dst, src, eps, mode); }
extern "C" __global__ void norm_vec_block(Tensor dst, Tensor src, float eps, int mode) { grid_begin(); norm_rows_vec<false, 4>(dst, src, eps, mode); }
extern "C" __global__ void norm_vec_sub8(Tensor dst, Tensor src, float eps, int mode) { grid_begin(); norm_rows_sub<8, 4>(dst, src, eps, mode); }
extern "C" __global__ void norm_vec_sub16(Tensor dst, Tensor src, float eps, int mode) { grid_begin(); norm_rows_sub<16, 4>(dst, src, eps, mode); }

// ---- sum_rows ----

// vec: f32 rows dense and 16-byte aligned with ne0 % 4 == 0 (read as float4).
template <bool WARP>
__device__ void sum_rows_impl(Tensor dst, Tensor src, int src_dt, int vec) {
    __shared__ float sh[32];
    RowGroup<WARP> g;
    i64 rows = rd_n_rows(src), n = src.ne[0];
    for (i64 r = g.first; r < rows; r += g.step) {
        const char* x = rd_row_ptr(src, r);
        float acc = 0.0f;
        if (vec) {
            const float4* x4 = (const float4*)x;
            int n4 = (int)(n >> 2);
#pragma unroll 4
            for (int i = g.lane; i < n4; i += g.size) {
                float4 v = x4[i];
                acc += (v.x + v.y) + (v.z + v.w);
            }
        } else {
            for (i64 i = g.lane; i < n; i += g.size) acc += load_f32(x + i * src.nb[0], src_dt);
        }
        float s = group_sum<WARP>(acc, sh);
        if (g.lane == 0) *(float*)rd_row_ptr(dst, r) = s;
    }
}

extern "C" __global__ void sum_rows_warp(Tensor dst, Tensor src, int src_dt, int vec) { grid_begin(); sum_rows_impl<true>(dst, src, src_dt, vec); }
extern "C" __global__ void sum_rows_block(Tensor dst, Tensor src, int src_dt, int vec) { grid_begin(); sum_rows_impl<false>(dst, src, src_dt, vec); }

// ---- softmax ----

// Online softmax state: MaxSum, ms_add, ms_merge, warp_ms (common.cuh).

template <bool WARP>
__device__ __forceinline__ MaxSum group_ms(MaxSum v, float* shm, float* shs) {
    v = warp_ms(v);
    if (WARP) return v;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    __syncthreads();
    if (lane == 0) {
        shm[warp] = v.m;
        shs[warp] = v.s;
    }
    __syncthreads();
    v = lane < nwarps ? MaxSum{shm[lane], shs[lane]} : MaxSum{-TS_INF, 0.0f};
    v = warp_ms(v);
    __syncthreads();
    return v;
}

// z of element i of row (i1, i2, i3): x * scale + mask[i, i1, i2 % mne2, i3 % mne3].
__device__ __forceinline__ const char* rd_mask_row(const Tensor& mask, i64 r, const Tensor& src) {
    i64 i1, i2, i3;
    row_coords(src, r, i1, i2, i3);
    return mask.data + i1 * mask.nb[1] + (i2 % mask.ne[2]) * mask.nb[2] + (i3 % mask.ne[3]) * mask.nb[3];
}

__device__ __forceinline__ float softmax_z(const char* x, int x_dt, i64 xnb0, const char* m, int m_dt, i64 mnb0, float scale, i64 i) {
    float v = load_f32(x + i * xnb0, x_dt) * scale;
    if (m) v += load_f32(m + i * mnb0, m_dt);
    return v;
}

__device__ __forceinline__ MaxSum finish_ms(MaxSum t) {
    if (t.m == TS_INF) t.s = TS_NAN;
    return t;
}

// Writes exp(z - m) / s over [lo, hi) of a row (zeros for a fully masked row).
__device__ __forceinline__ void softmax_write(char* y, i64 ynb0, const char* x, int x_dt, i64 xnb0, const char* m, int m_dt, i64 mnb0, float scale, MaxSum t, i64 lo, i64 hi, int lane, int size) {
    for (i64 i = lo + lane; i < hi; i += size) {
        float out = t.m == -TS_INF ? 0.0f : expf(softmax_z(x, x_dt, xnb0, m, m_dt, mnb0, scale, i) - t.m) / t.s;
        *(float*)(y + i * ynb0) = out;
    }
}

template <bool WARP>
__device__ void softmax_impl(Tensor dst, Tensor src, int src_dt, Tensor mask, int mask_dt, int has_mask, float scale) {
    __shared__ float shm[32], shs[32];
    RowGroup<WARP> g;
    i64 rows = rd_n_rows(src), n = src.ne[0];
    for (i64 r = g.first; r < rows; r += g.step) {
        const char* x = rd_row_ptr(src, r);
        const char* m = has_mask ? rd_mask_row(mask, r, src) : nullptr;
        MaxSum t{-TS_INF, 0.0f};
        for (i64 i = g.lane; i < n; i += g.size) t = ms_add(t, softmax_z(x, src_dt, src.nb[0], m, mask_dt, mask.nb[0], scale, i));
        t = finish_ms(group_ms<WARP>(t, shm, shs));
        softmax_write(rd_row_ptr(dst, r), dst.nb[0], x, src_dt, src.nb[0], m, mask_dt, mask.nb[0], scale, t, 0, n, g.lane, g.size);
    }
}

extern "C" __global__ void softmax_warp(Tensor dst, Tensor src, int src_dt, Tensor mask, int mask_dt, int has_mask, float scale) {
    grid_begin();
    softmax_impl<true>(dst, src, src_dt, mask, mask_dt, has_mask, scale);
}
extern "C" __global__ void softmax_block(Tensor dst, Tensor src, int src_dt, Tensor mask, int mask_dt, int has_mask, float scale) {
    grid_begin();
    softmax_impl<false>(dst, src, src_dt, mask, mask_dt, has_mask, scale);
}

// Dense, aligned f32 rows (x and dst 16-byte, an f16 mask 8-byte, an f32 mask 16-byte aligned),
// ne0 % 4 == 0 and ne0 / 4 <= NV * group size: z stays in registers through max, sum and write.
__device__ __forceinline__ float4 load_mask4(const char* m, int m_dt, int i) {
    if (m_dt == DT_F16) {
        uint2 h = ((const uint2*)m)[i];
        return make_float4(f16_to_f32((u16)(h.x & 0xffff)), f16_to_f32((u16)(h.x >> 16)), f16_to_f32((u16)(h.y & 0xffff)), f16_to_f32((u16)(h.y >> 16)));
    }
    return ((const float4*)m)[i];
}

template <bool WARP>
__device__ __forceinline__ float group_max(float v, float* sh) {
    return WARP ? warp_max(v) : block_max(v, sh);
}

template <bool WARP, int NV>
__device__ void softmax_vec_impl(Tensor dst, Tensor src, Tensor mask, int mask_dt, int has_mask, float scale) {
    __shared__ float sh[32];
    RowGroup<WARP> g;
    i64 rows = rd_n_rows(src);
    int n4 = (int)(src.ne[0] >> 2);
    for (i64 r = g.first; r < rows; r += g.step) {
        const float4* x = (const float4*)rd_row_ptr(src, r);
        const char* m = has_mask ? rd_mask_row(mask, r, src) : nullptr;
        float4 v[NV];
        float mx = -TS_INF;
#pragma unroll
        for (int j = 0; j < NV; j++) {
            int i = g.lane + j * g.size;
            if (i < n4) {
                float4 a = x[i];
                a = make_float4(a.x * scale, a.y * scale, a.z * scale, a.w * scale);
                if (m) {
                    float4 b = load_mask4(m, mask_dt, i);
                    a = make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
                }
                v[j] = a;
                mx = fmaxf(mx, fmaxf(fmaxf(a.x, a.y), fmaxf(a.z, a.w)));
            }
        }
        mx = group_max<WARP>(mx, sh);
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < NV; j++) {
            int i = g.lane + j * g.size;
            if (i < n4) {
                v[j] = make_float4(expf(v[j].x - mx), expf(v[j].y - mx), expf(v[j].z - mx), expf(v[j].w - mx));
                acc += (v[j].x + v[j].y) + (v[j].z + v[j].w);
            }
        }
        float total = group_sum<WARP>(acc, sh);
        float4* y = (float4*)rd_row_ptr(dst, r);
#pragma unroll
        for (int j = 0; j < NV; j++) {
            int i = g.lane + j * g.size;
            if (i < n4) {
                y[i] = mx == -TS_INF ? make_float4(0.0f, 0.0f, 0.0f, 0.0f)
                                     : make_float4(v[j].x / total, v[j].y / total, v[j].z / total, v[j].w / total);
            }
        }
    }
}

extern "C" __global__ void softmax_vec_warp(Tensor dst, Tensor src, Tensor mask, int mask_dt, int has_mask, float scale) {
    grid_begin();
    softmax_vec_impl<true, 8>(dst, src, mask, mask_dt, has_mask, scale);
}
extern "C" __global__ void softmax_vec_block(Tensor dst, Tensor src, Tensor mask, int mask_dt, int has_mask, float scale) {
    grid_begin();
    softmax_vec_impl<false, 4>(dst, src, mask, mask_dt, has_mask, scale);
}

// Split rows: grid (chunks, rows); block (c, r) covers [c * chunk, (c + 1) * chunk) of row r.
// Pass 1 writes each chunk's (max, sum) to part[r * chunks + c].
extern "C" __global__ void softmax_split_partial(Tensor src, int src_dt, Tensor mask, int mask_dt, int has_mask, float scale, i64 chunk, float2* part) {
    grid_begin();
    __shared__ float shm[32], shs[32];
    i64 r = blockIdx.y, n = src.ne[0];
    const char* x = rd_row_ptr(src, r);
    const char* m = has_mask ? rd_mask_row(mask, r, src) : nullptr;
    i64 lo = blockIdx.x * chunk, hi = min(n, lo + chunk);
    MaxSum t{-TS_INF, 0.0f};
    for (i64 i = lo + threadIdx.x; i < hi; i += blockDim.x) t = ms_add(t, softmax_z(x, src_dt, src.nb[0], m, mask_dt, mask.nb[0], scale, i));
    t = group_ms<false>(t, shm, shs);
    if (threadIdx.x == 0) part[r * gridDim.x + blockIdx.x] = make_float2(t.m, t.s);
}

// Pass 2: every block merges its row's partials, then writes its chunk.
extern "C" __global__ void softmax_split_write(Tensor dst, Tensor src, int src_dt, Tensor mask, int mask_dt, int has_mask, float scale, i64 chunk, const float2* part) {
    grid_begin();
    __shared__ float shm[32], shs[32];
    i64 r = blockIdx.y, n = src.ne[0];
    MaxSum t{-TS_INF, 0.0f};
    for (i64 c = threadIdx.x; c < gridDim.x; c += blockDim.x) {
        float2 p = part[r * gridDim.x + c];
        t = ms_merge(t, MaxSum{p.x, p.y});
    }
    t = finish_ms(group_ms<false>(t, shm, shs));
    const char* x = rd_row_ptr(src, r);
    const char* m = has_mask ? rd_mask_row(mask, r, src) : nullptr;
    i64 lo = blockIdx.x * chunk, hi = min(n, lo + chunk);
    softmax_write(rd_row_ptr(dst, r), dst.nb[0], x, src_dt, src.nb[0], m, mask_dt, mask.nb[0], scale, t, lo, hi, threadIdx.x, blockDim.x);
}

// ---- argmax ----

// The best (value, index) so far; index -1 means none (every value NaN). The larger value wins,
// the lower index on ties; NaNs never win.
struct Best {
    float v;
    int i;
};

__device__ __forceinline__ Best best_merge(Best a, Best b) {
    if (b.i < 0) return a;
    if (a.i < 0) return b;
    if (b.v > a.v || (b.v == a.v && b.i < a.i)) return b;
    return a;
}

__device__ __forceinline__ Best warp_best(Best v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        Best w{__shfl_xor_sync(0xffffffffu, v.v, o), __shfl_xor_sync(0xffffffffu, v.i, o)};
        v = best_merge(v, w);
    }
    return v;
}

template <bool WARP>
__device__ __forceinline__ Best group_best(Best v, float* shv, int* shi) {
    v = warp_best(v);
    if (WARP) return v;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    __syncthreads();
    if (lane == 0) {
        shv[warp] = v.v;
        shi[warp] = v.i;
    }
    __syncthreads();
    v = lane < nwarps ? Best{shv[lane], shi[lane]} : Best{0.0f, -1};
    v = warp_best(v);
    __syncthreads();
    return v;
}

// Best over [lo, hi) of a row, scanned in increasing index per thread.
__device__ __forceinline__ Best scan_best(const char* x, int dt, i64 nb0, i64 lo, i64 hi, int lane, int size) {
    Best b{0.0f, -1};
    for (i64 i = lo + lane; i < hi; i += size) {
        float v = load_f32(x + i * nb0, dt);
        if (v == v && (b.i < 0 || v > b.v)) b = Best{v, (int)i};
    }
    return b;
}

template <bool WARP>
__device__ void argmax_impl(Tensor dst, Tensor src, int src_dt) {
    __shared__ float shv[32];
    __shared__ int shi[32];
    RowGroup<WARP> g;
    i64 rows = rd_n_rows(src), n = src.ne[0];
    for (i64 r = g.first; r < rows; r += g.step) {
        Best b = group_best<WARP>(scan_best(rd_row_ptr(src, r), src_dt, src.nb[0], 0, n, g.lane, g.size), shv, shi);
        if (g.lane == 0) *(int*)rd_row_ptr(dst, r) = b.i < 0 ? 0 : b.i;
    }
}

extern "C" __global__ void argmax_warp(Tensor dst, Tensor src, int src_dt) { grid_begin(); argmax_impl<true>(dst, src, src_dt); }
extern "C" __global__ void argmax_block(Tensor dst, Tensor src, int src_dt) { grid_begin(); argmax_impl<false>(dst, src, src_dt); }

// Split rows: grid (chunks, rows); pass 1 writes each chunk's best to part[r * chunks + c].
extern "C" __global__ void argmax_split_partial(Tensor src, int src_dt, i64 chunk, int2* part) {
    grid_begin();
    __shared__ float shv[32];
    __shared__ int shi[32];
    i64 r = blockIdx.y, n = src.ne[0];
    i64 lo = blockIdx.x * chunk, hi = min(n, lo + chunk);
    Best b = group_best<false>(scan_best(rd_row_ptr(src, r), src_dt, src.nb[0], lo, hi, threadIdx.x, blockDim.x), shv, shi);
    if (threadIdx.x == 0) part[r * gridDim.x + blockIdx.x] = make_int2(__float_as_int(b.v), b.i);
}

// Pass 2: one warp per row merges the row's `chunks` partials.
extern "C" __global__ void argmax_split_final(Tensor dst, i64 chunks, const int2* part) {
    grid_begin();
    i64 r = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (r >= rd_n_rows(dst)) return;
    Best b{0.0f, -1};
    for (i64 c = lane; c < chunks; c += 32) {
        int2 p = part[r * chunks + c];
        b = best_merge(b, Best{__int_as_float(p.x), p.y});
    }
    b = warp_best(b);
    if (lane == 0) *(int*)rd_row_ptr(dst, r) = b.i < 0 ? 0 : b.i;
}

// ---- top_k and argsort ----

// The CPU's sort key: order-preserving u32 of v with -0 == +0 and NaN lowest (0); complemented
// for descending so that smaller keys always come first.
__device__ __forceinline__ u64 sort_rank(float v, int desc, i64 i) {
    u32 bits = __float_as_uint(v + 0.0f);
    u32 key = bits ^ ((u32)((int)bits >> 31) | 0x80000000u);
    if (v != v) key = 0;
    if (desc) key = ~key;
    return ((u64)key << 32) | (u64)(u32)i;
}

#define RANK_NONE 0xffffffffffffffffull

__device__ __forceinline__ u64 warp_min_u64(u64 v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        u64 w = __shfl_xor_sync(0xffffffffu, v, o);
        v = w < v ? w : v;
    }
    return v;
}

// Small k of short rows (k <= 16, ne0 <= 32 * E): one warp per row, E ranks per lane in
// registers; k rounds of a warp-wide minimum, the winner's lane drops it.
template <int E>
__device__ void topk_warp_impl(Tensor dst, Tensor src, int src_dt, int desc, int k) {
    i64 rows = rd_n_rows(src), n = src.ne[0];
    i64 r = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (r >= rows) return;
    const char* x = rd_row_ptr(src, r);
    u64 v[E];
#pragma unroll
    for (int j = 0; j < E; j++) {
        i64 i = lane + 32 * j;
        v[j] = i < n ? sort_rank(load_f32(x + i * src.nb[0], src_dt), desc, i) : RANK_NONE;
    }
    char* y = rd_row_ptr(dst, r);
    for (int t = 0; t < k; t++) {
        u64 mine = v[0];
#pragma unroll
        for (int j = 1; j < E; j++) mine = v[j] < mine ? v[j] : mine;
        u64 best = warp_min_u64(mine);
        if (mine == best) {
#pragma unroll
            for (int j = 0; j < E; j++)
                if (v[j] == best) v[j] = RANK_NONE;
        }
        if (lane == 0) *(int*)(y + t * dst.nb[0]) = (int)(u32)best;
    }
}

extern "C" __global__ void topk_warp8(Tensor dst, Tensor src, int src_dt, int desc, int k) { grid_begin(); topk_warp_impl<8>(dst, src, src_dt, desc, k); }
extern "C" __global__ void topk_warp16(Tensor dst, Tensor src, int src_dt, int desc, int k) { grid_begin(); topk_warp_impl<16>(dst, src, src_dt, desc, k); }

#define SORT_TILE 2048

// Sorts tile blockIdx.y (SORT_TILE elements) of row blockIdx.x in shared memory (bitonic over p,
// the tile padded to a power of two). The row is src's values, or (in != 0) in_n ranks of an
// earlier stage at in[row * in_stride]. With `final` (one tile per row) the first k indices go to
// dst; else the first min(cap, len) ranks go to runs[row * out_stride + tile * out_run ...].
extern "C" __global__ void sort_tile(Tensor src, int src_dt, const u64* in, i64 in_n, i64 in_stride, int desc, int p, i64 cap, u64* runs, i64 out_stride, i64 out_run, Tensor dst, int k, int final) {
    grid_begin();
    __shared__ u64 s[SORT_TILE];
    i64 r = blockIdx.x, n = in ? in_n : src.ne[0];
    i64 base = (i64)blockIdx.y * SORT_TILE;
    i64 len = min((i64)SORT_TILE, n - base);
    if (in) {
        const u64* row = in + r * in_stride + base;
        for (int i = threadIdx.x; i < p; i += blockDim.x) s[i] = i < len ? row[i] : RANK_NONE;
    } else {
        const char* x = rd_row_ptr(src, r);
        for (int i = threadIdx.x; i < p; i += blockDim.x) {
            s[i] = i < len ? sort_rank(load_f32(x + (base + i) * src.nb[0], src_dt), desc, base + i) : RANK_NONE;
        }
    }
    __syncthreads();
    for (int size = 2; size <= p; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int t = threadIdx.x; t < (p >> 1); t += blockDim.x) {
                int i = 2 * t - (t & (stride - 1)), j = i + stride;
                u64 a = s[i], b = s[j];
                bool up = (i & size) == 0;
                if ((a > b) == up) {
                    s[i] = b;
                    s[j] = a;
                }
            }
            __syncthreads();
        }
    }
    if (final) {
        char* y = rd_row_ptr(dst, r);
        for (int i = threadIdx.x; i < k; i += blockDim.x) *(int*)(y + i * dst.nb[0]) = (int)(u32)s[i];
    } else {
        i64 keep = min(cap, len);
        u64* out = runs + r * out_stride + (i64)blockIdx.y * out_run;
        for (int i = threadIdx.x; i < keep; i += blockDim.x) out[i] = s[i];
    }
}

// Length of sorted run j (runs of stride s, each truncated to cap) of a row of n.
__device__ __forceinline__ i64 run_len(i64 j, i64 s, i64 n, i64 cap) {
    i64 lo = j * s;
    return lo >= n ? 0 : min(cap, min(s, n - lo));
}

// Merges runs (2j, 2j + 1) of stride s into runs of stride 2s, each truncated to cap: an element's
// place is its index in its run plus the count of smaller ranks in the other run (ranks are
// distinct). With `final`, the first k go to dst as indices.
// Threads cover the first width = min(cap, s) places of each of the nruns = ceil(n / s) runs.
extern "C" __global__ void merge_runs(const u64* in, u64* out, i64 rows, i64 n, i64 s, i64 cap, i64 nruns, i64 width, Tensor dst, int final) {
    grid_begin();
    i64 per_row = nruns * width, total = rows * per_row;
    for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (i64)gridDim.x * blockDim.x) {
        i64 r = e / per_row, rem = e - r * per_row;
        i64 j = rem / width, i = rem - j * width;
        i64 pos = j * s + i;
        if (i >= run_len(j, s, n, cap)) continue;
        const u64* row = in + r * n;
        u64 v = row[pos];
        i64 q = j ^ 1;
        i64 lq = run_len(q, s, n, cap);
        const u64* other = row + q * s;
        i64 lo = 0, hi = lq;
        while (lo < hi) {
            i64 mid = (lo + hi) >> 1;
            if (other[mid] < v) lo = mid + 1;
            else hi = mid;
        }
        i64 place = i + lo;
        if (place >= cap) continue;
        if (final) {
            if (place < dst.ne[0]) *(int*)(rd_row_ptr(dst, r) + place * dst.nb[0]) = (int)(u32)v;
        } else {
            out[r * n + (j & ~(i64)1) * s + place] = v;
        }
    }
}
