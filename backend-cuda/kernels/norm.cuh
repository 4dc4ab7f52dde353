// norm.cuh: the row walk of the row-wise kernels and the rms_norm / l2_norm row code, shared by
// reduce.cu (rms_norm, l2_norm and the other row reductions) and delta_net.cu
// (gdn_input_prep normalises q and k exactly as l2_norm does: the same device code).
//
// Rows are (i1, i2, i3) in ggml order, flattened as r = i1 + ne1 * (i2 + ne2 * i3).

#define ROWS_PER_WARP_BLOCK 8

__device__ __forceinline__ char* rd_row_ptr(const Tensor& t, i64 r) {
    i64 i1, i2, i3;
    row_coords(t, r, i1, i2, i3);
    return t.data + i1 * t.nb[1] + i2 * t.nb[2] + i3 * t.nb[3];
}

__device__ __forceinline__ i64 rd_n_rows(const Tensor& t) { return t.ne[1] * t.ne[2] * t.ne[3]; }

// The row a thread works on, its lane within the row's group and the group's size.
template <bool WARP>
struct RowGroup {
    i64 first, step;
    int lane, size;
    __device__ __forceinline__ RowGroup() {
        if (WARP) {
            first = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
            step = (i64)gridDim.x * (blockDim.x >> 5);
            lane = threadIdx.x & 31;
            size = 32;
        } else {
            first = blockIdx.x;
            step = gridDim.x;
            lane = threadIdx.x;
            size = blockDim.x;
        }
    }
};

template <bool WARP>
__device__ __forceinline__ float group_sum(float v, float* sh) {
    return WARP ? warp_sum(v) : block_sum(v, sh);
}

template <bool WARP>
__device__ __forceinline__ double group_sum_f64(double v, double* sh) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (WARP) return v;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    v = lane < nwarps ? sh[lane] : 0.0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    return v;
}

// ---- rms_norm and l2_norm ----

#define NORM_RMS 0
#define NORM_L2 1

// l2_norm's scale 1 / max(||x||, eps) from the row's f32 sum of squares ss, redone in f64 by
// `ss_f64()` where ss over/underflowed (the CPU's rule); every lane of the group takes the same
// branch (ss is group-uniform).
template <typename SsF64>
__device__ __forceinline__ float l2_scale(float ss, float eps, SsF64 ss_f64) {
    const float norm = ss >= 1.17549435e-38f && ss <= 3.40282347e38f ? sqrtf(ss) : (float)sqrt(ss_f64());
    return 1.0f / fmaxf(norm, eps);
}

// The scale of a row from its sum of squares (rms_norm's, or l2_norm's by `l2_scale`, the f64
// sum read back from the row).
template <bool WARP>
__device__ __forceinline__ float norm_scale(int mode, float ss, float eps, i64 n, const char* row, int dt, i64 nb0, int lane, int size, double* shd) {
    if (mode == NORM_RMS) return 1.0f / sqrtf(ss / (float)n + eps);
    return l2_scale(ss, eps, [&] {
        double acc = 0.0;
        for (i64 i = lane; i < n; i += size) {
            double v = (double)load_f32(row + i * nb0, dt);
            acc += v * v;
        }
        return group_sum_f64<WARP>(acc, shd);
    });
}

// Any dtype and strides.
template <bool WARP>
__device__ void norm_rows(Tensor dst, Tensor src, int src_dt, float eps, int mode) {
    __shared__ float sh[32];
    __shared__ double shd[32];
    RowGroup<WARP> g;
    i64 rows = rd_n_rows(src), n = src.ne[0];
    for (i64 r = g.first; r < rows; r += g.step) {
        const char* x = rd_row_ptr(src, r);
        char* y = rd_row_ptr(dst, r);
        float acc = 0.0f;
        for (i64 i = g.lane; i < n; i += g.size) {
            float v = load_f32(x + i * src.nb[0], src_dt);
            acc += v * v;
        }
        float ss = group_sum<WARP>(acc, sh);
        float s = norm_scale<WARP>(mode, ss, eps, n, x, src_dt, src.nb[0], g.lane, g.size, shd);
        for (i64 i = g.lane; i < n; i += g.size) {
            *(float*)(y + i * dst.nb[0]) = load_f32(x + i * src.nb[0], src_dt) * s;
        }
    }
}

// f32 rows that are dense and 16-byte aligned (src and dst), ne0 % 4 == 0 and ne0 / 4 <= NV *
// group size: the row stays in registers between the sum and the scaling.
template <bool WARP, int NV>
__device__ void norm_rows_vec(Tensor dst, Tensor src, float eps, int mode) {
    __shared__ float sh[32];
    __shared__ double shd[32];
    RowGroup<WARP> g;
    i64 rows = rd_n_rows(src), n = src.ne[0];
    int n4 = (int)(n >> 2);
    for (i64 r = g.first; r < rows; r += g.step) {
        const float4* x = (const float4*)rd_row_ptr(src, r);
        float4* y = (float4*)rd_row_ptr(dst, r);
        float4 v[NV];
#pragma unroll
        for (int j = 0; j < NV; j++) {
            int i = g.lane + j * g.size;
            v[j] = i < n4 ? x[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < NV; j++) acc += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
        float ss = group_sum<WARP>(acc, sh);
        float s = norm_scale<WARP>(mode, ss, eps, n, (const char*)x, DT_F32, 4, g.lane, g.size, shd);
#pragma unroll
        for (int j = 0; j < NV; j++) {
            int i = g.lane + j * g.size;
            if (i < n4) y[i] = make_float4(v[j].x * s, v[j].y * s, v[j].z * s, v[j].w * s);
        }
    }
}

// Short dense rows (ne0 / 4 <= NV * L): L lanes per row, 32 / L rows per warp, so that a warp
// has more loads in flight. The row loop is block-uniform; lanes past the last row load nothing
// and write nothing but still join the shuffles.
template <int L>
__device__ __forceinline__ float sub_sum(float v) {
#pragma unroll
    for (int o = L / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

template <int L>
__device__ __forceinline__ double sub_sum_f64(double v) {
#pragma unroll
    for (int o = L / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

template <int L, int NV>
__device__ void norm_rows_sub(Tensor dst, Tensor src, float eps, int mode) {
    i64 rows = rd_n_rows(src), n = src.ne[0];
    int n4 = (int)(n >> 2), lane = threadIdx.x & (L - 1);
    i64 per_block = blockDim.x / L;
    for (i64 base = (i64)blockIdx.x * per_block; base < rows; base += (i64)gridDim.x * per_block) {
        i64 r = base + threadIdx.x / L;
        bool ok = r < rows;
        const float4* x = ok ? (const float4*)rd_row_ptr(src, r) : nullptr;
        float4 v[NV];
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < NV; j++) {
            int i = lane + j * L;
            v[j] = ok && i < n4 ? x[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            acc += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
        }
        float ss = sub_sum<L>(acc);
        float s;
        if (mode == NORM_RMS) {
            s = 1.0f / sqrtf(ss / (float)n + eps);
        } else {
            bool normal = ss >= 1.17549435e-38f && ss <= 3.40282347e38f;
            float norm = sqrtf(ss);
            // The f64 redo (the CPU's rule) is taken by the whole warp when any row needs it.
            if (__any_sync(0xffffffffu, ok && !normal)) {
                double d = 0.0;
#pragma unroll
                for (int j = 0; j < NV; j++) {
                    d += (double)v[j].x * v[j].x + (double)v[j].y * v[j].y + (double)v[j].z * v[j].z + (double)v[j].w * v[j].w;
                }
                d = sub_sum_f64<L>(d);
                if (!normal) norm = (float)sqrt(d);
            }
            s = 1.0f / fmaxf(norm, eps);
        }
        if (ok) {
            float4* y = (float4*)rd_row_ptr(dst, r);
#pragma unroll
            for (int j = 0; j < NV; j++) {
                int i = lane + j * L;
                if (i < n4) y[i] = make_float4(v[j].x * s, v[j].y * s, v[j].z * s, v[j].w * s);
            }
        }
    }
}
