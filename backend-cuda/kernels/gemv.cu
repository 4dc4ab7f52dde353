// gemv.cu: mul_mat and mul_mat_swiglu at 1-8 tokens a pass, f32 accumulation. Few tokens
// against large weights are bound by the weight read, so every kernel here reads each weight
// byte once for all the tokens of a pass.
//
// - `gemv_warp_{1,2,4,8}`: one warp per weight row (or MM_WARPS warps sharing a long row), up to
//   NT tokens a pass over `pack_b`'s f32 rows, any weight dtype and outer strides (matmul.cuh's
//   warp dot: plain weights stream through 16-byte loads, q8_0 / nvfp4 rows are staged 32 blocks
//   at a time through shared memory and decoded from there, one block per lane); passes loop over
//   the tokens, so `gemv_warp_8` is also the general path for what no other kernel takes.
// - `quant_x` + `gemv_fast_{1,2,4,8}[_r2|_r4]`: the decode GEMV for contiguous q8_0 / nvfp4 rows
//   (and few long f16 / bf16 rows), a block per 1, 2 or 4 weight rows reading matmul.cuh's fast
//   units, int8 weights times int16 activations through dp4a. `gemv_fast_glu_N`: mul_mat_swiglu,
//   a gate row and its up row a block, swiglu before the store.

// ---------------------------------------------------------------------------------------------
// Warp GEMV (any weights and strides, 1..8 tokens a pass).

// out[m, n, i2, i3] for a: [k, M, A2, A3] and the packed activations bp (row n + N * (i2 + B2 *
// i3) at row * ldb). Grid: (ceil(M * parts / MM_WARPS), batches); `parts` (1 or MM_WARPS) warps
// share one weight row, each taking an interleaved slice of it, and add up through shared memory.
template <int NT>
__device__ __forceinline__ void gemv_warp_body(Tensor a, int adt, const float* bp, i64 ldb, i64 n, i64 b2, i64 b3, Tensor out, int vec, int parts) {
    __shared__ uint4 stage[MM_WARPS][STAGE_CHUNKS];
    __shared__ float red[MM_WARPS][NT];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, part = warp % parts;
    const i64 m = (i64)blockIdx.x * (MM_WARPS / parts) + warp / parts;
    const bool valid = m < a.ne[1];
    for (i64 batch = blockIdx.y; batch < b2 * b3; batch += gridDim.y) {
        const i64 i2 = batch % b2, i3 = batch / b2;
        const i64 a2 = i2 / (b2 / a.ne[2]), a3 = i3 / (b3 / a.ne[3]);
        const char* row = a.data + m * a.nb[1] + a2 * a.nb[2] + a3 * a.nb[3];
        for (i64 n0 = 0; n0 < n; n0 += NT) {
            const int nt = (int)min((i64)NT, n - n0);
            const float* bt[NT];
#pragma unroll
            for (int t = 0; t < NT; t++) bt[t] = bp + (batch * n + n0 + min(t, nt - 1)) * ldb;
            float acc[NT];
#pragma unroll
            for (int t = 0; t < NT; t++) acc[t] = 0.0f;
            if (valid) warp_dot<NT>(row, adt, a.ne[0], bt, acc, stage[warp], vec != 0, part, parts);
            if (parts == 1) {
                // no block barrier: the warps of a block stay independent
#pragma unroll
                for (int t = 0; t < NT; t++) {
                    const float v = warp_sum(acc[t]);
                    if (valid && lane == 0 && t < nt) *(float*)(out.data + offset_of(out, m, n0 + t, i2, i3)) = v;
                }
                continue;
            }
#pragma unroll
            for (int t = 0; t < NT; t++) {
                const float v = warp_sum(acc[t]);
                if (lane == 0) red[warp][t] = v;
            }
            __syncthreads();
            if (valid && part == 0 && lane < nt) {
                float v = 0.0f;
                for (int p = 0; p < parts; p++) v += red[warp + p][lane];
                *(float*)(out.data + offset_of(out, m, n0 + lane, i2, i3)) = v;
            }
            __syncthreads();
        }
    }
}

extern "C" __global__ void __launch_bounds__(MM_WARPS * 32) gemv_warp_1(Tensor a, int adt, const float* bp, i64 ldb, i64 n, i64 b2, i64 b3, Tensor out, int vec, int parts) {
    l2_prefetch_rows(a, adt, (i64)blockIdx.x * (MM_WARPS / parts), MM_WARPS / parts);
    grid_begin();
    gemv_warp_body<1>(a, adt, bp, ldb, n, b2, b3, out, vec, parts);
}
extern "C" __global__ void __launch_bounds__(MM_WARPS * 32) gemv_warp_2(Tensor a, int adt, const float* bp, i64 ldb, i64 n, i64 b2, i64 b3, Tensor out, int vec, int parts) {
    l2_prefetch_rows(a, adt, (i64)blockIdx.x * (MM_WARPS / parts), MM_WARPS / parts);
    grid_begin();
    gemv_warp_body<2>(a, adt, bp, ldb, n, b2, b3, out, vec, parts);
}
extern "C" __global__ void __launch_bounds__(MM_WARPS * 32) gemv_warp_4(Tensor a, int adt, const float* bp, i64 ldb, i64 n, i64 b2, i64 b3, Tensor out, int vec, int parts) {
    l2_prefetch_rows(a, adt, (i64)blockIdx.x * (MM_WARPS / parts), MM_WARPS / parts);
    grid_begin();
    gemv_warp_body<4>(a, adt, bp, ldb, n, b2, b3, out, vec, parts);
}
extern "C" __global__ void __launch_bounds__(MM_WARPS * 32) gemv_warp_8(Tensor a, int adt, const float* bp, i64 ldb, i64 n, i64 b2, i64 b3, Tensor out, int vec, int parts) {
    l2_prefetch_rows(a, adt, (i64)blockIdx.x * (MM_WARPS / parts), MM_WARPS / parts);
    grid_begin();
    gemv_warp_body<8>(a, adt, bp, ldb, n, b2, b3, out, vec, parts);
}

// ---------------------------------------------------------------------------------------------
// Fast decode GEMV (contiguous-row weights, 1..8 tokens per weight read).
//
// gemv_fast: one block of GF_THREADS threads per R weight rows (R = 1, 2 or 4: `_rR` entries); the
// threads stride over the rows in matmul.cuh's units, then a block reduction. Each token's
// activations of a unit are loaded once for the block's R rows: with several tokens they
// outweigh the weights.

// Largest |x_q|: hi = (x_q + 128) >> 8 and lo = x_q - 256 hi both stay in int8.
#define XQ_MAX 32639.0f

// Activation row r (a flat row of b) as 16-value blocks: at xq + r * 2 k + 32 j the 16 hi bytes
// then the 16 lo bytes of block j, at xs[r * k / 16 + j] its scale. One thread per block.
extern "C" __global__ void quant_x(Tensor b, char* xq, float* xs) {
    grid_begin();
    const i64 k = b.ne[0], nbk = k / 16, total = nbk * (nelements(b) / k);
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        const i64 r = i / nbk, j = i % nbk;
        i64 i1, i2, i3;
        row_coords(b, r, i1, i2, i3);
        const char* src = b.data + i1 * b.nb[1] + i2 * b.nb[2] + i3 * b.nb[3] + 16 * j * b.nb[0];
        float v[16], amax = 0.0f;
#pragma unroll
        for (int e = 0; e < 16; e++) {
            v[e] = *(const float*)(src + e * b.nb[0]);
            amax = fmaxf(amax, fabsf(v[e]));
        }
        const float d = amax / XQ_MAX, id = amax > 0.0f ? XQ_MAX / amax : 0.0f;
        u32 hi[4], lo[4];
#pragma unroll
        for (int w = 0; w < 4; w++) {
            hi[w] = lo[w] = 0;
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int q = (int)fminf(fmaxf(rintf(v[4 * w + e] * id), -XQ_MAX), XQ_MAX);
                const int h = (q + 128) >> 8, l = q - 256 * h;
                hi[w] |= (u32)(h & 0xff) << (8 * e);
                lo[w] |= (u32)(l & 0xff) << (8 * e);
            }
        }
        uint4* dst = (uint4*)(xq + r * 2 * k + 32 * j);
        dst[0] = make_uint4(hi[0], hi[1], hi[2], hi[3]);
        dst[1] = make_uint4(lo[0], lo[1], lo[2], lo[3]);
        xs[r * nbk + j] = d;
    }
}

// out[m, n, i2, i3] = a row m (of batch (i2 / (b2 / A2), i3 / (b3 / A3))) . activation rows;
// block x takes weight rows R x .. R x + R - 1 (a short last block reads row M - 1 in place of
// the rows past the end and does not store them), grid (ceil(M / R), batches). With GLU the
// block's R rows are H = R / 2 rows of the gate weights `a` and the same H rows of the up
// weights `a_up`, and it stores swiglu(gate, up) = gate sigmoid(gate) up for H output rows (grid
// ceil(M / H)). x: the activation rows at x + row * ldx (bytes); quantized weights: the
// `quant_x` rows (ldx = 2 k), their scales after them from the next 256-byte boundary; f16 /
// bf16: packed f32 rows.
template <int NT, int R, bool GLU>
__device__ __forceinline__ void gemv_fast_body(Tensor a, Tensor a_up, int adt, const char* x, i64 ldx, i64 n, i64 b2, i64 b3, Tensor out) {
    constexpr int H = GLU ? R / 2 : R;  // output rows a block
    __shared__ float red[GF_THREADS / 32][R][NT];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const i64 m0 = (i64)blockIdx.x * H, k = a.ne[0];
    const int rows = (int)min((i64)H, a.ne[1] - m0);
    const i64 nu = gf_units(adt, k);
    const float* xs = (const float*)(x + ((n * b2 * b3 * ldx + 255) & ~(i64)255));
    for (i64 batch = blockIdx.y; batch < b2 * b3; batch += gridDim.y) {
        const i64 i2 = batch % b2, i3 = batch / b2;
        const i64 a2 = i2 / (b2 / a.ne[2]), a3 = i3 / (b3 / a.ne[3]);
        const i64 at = m0 * a.nb[1] + a2 * a.nb[2] + a3 * a.nb[3];
        const char* row[R];
#pragma unroll
        for (int r = 0; r < R; r++) {
            const char* base = GLU && r >= H ? a_up.data : a.data;
            row[r] = base + at + min(r % H, rows - 1) * a.nb[1];
        }
        for (i64 n0 = 0; n0 < n; n0 += NT) {
            const int nt = (int)min((i64)NT, n - n0);
            const char* xt[NT];
            const float* st[NT];
#pragma unroll
            for (int t = 0; t < NT; t++) {
                const i64 r = batch * n + n0 + min(t, nt - 1);
                xt[t] = x + r * ldx;
                st[t] = xs + r * (k / 16);
            }
            float acc[R][NT];
#pragma unroll
            for (int r = 0; r < R; r++) {
#pragma unroll
                for (int t = 0; t < NT; t++) acc[r][t] = 0.0f;
            }
            gf_rows<NT, R>(row, adt, nu, tid, GF_THREADS, xt, st, acc);
            constexpr int C = R * NT, SPREAD = 32 / C;
            static_assert(C <= 32, "one warp sum a lane");
            warp_sum_scatter<C, 16>(&acc[0][0], lane);
            if (lane % SPREAD == 0) red[warp][lane / SPREAD / NT][lane / SPREAD % NT] = acc[0][0];
            __syncthreads();
            const int r = tid / NT, t = tid % NT;
            if (r < rows && t < nt) {
                float v = 0.0f;
#pragma unroll
                for (int w = 0; w < GF_THREADS / 32; w++) v += red[w][r][t];
                if constexpr (GLU) {
                    float u = 0.0f;
#pragma unroll
                    for (int w = 0; w < GF_THREADS / 32; w++) u += red[w][r + H][t];
                    v = v * sigmoid_f(v) * u;
                }
                *(float*)(out.data + offset_of(out, m0 + r, n0 + t, i2, i3)) = v;
            }
            __syncthreads();
        }
    }
}

#define GF_ENTRY(NAME, NT, R)                                                                                                  \
    extern "C" __global__ void __launch_bounds__(GF_THREADS) NAME(Tensor a, int adt, const char* x, i64 ldx, i64 n, i64 b2, i64 b3, Tensor out) { \
        l2_prefetch_rows(a, adt, (i64)blockIdx.x * R, R);                                                                         \
        grid_begin();                                                                                                             \
        gemv_fast_body<NT, R, false>(a, a, adt, x, ldx, n, b2, b3, out);                                                       \
    }
GF_ENTRY(gemv_fast_1, 1, 1)
GF_ENTRY(gemv_fast_2, 2, 1)
GF_ENTRY(gemv_fast_4, 4, 1)
GF_ENTRY(gemv_fast_8, 8, 1)
GF_ENTRY(gemv_fast_2_r2, 2, 2)
GF_ENTRY(gemv_fast_4_r2, 4, 2)
GF_ENTRY(gemv_fast_8_r2, 8, 2)
GF_ENTRY(gemv_fast_2_r4, 2, 4)
GF_ENTRY(gemv_fast_4_r4, 4, 4)
GF_ENTRY(gemv_fast_8_r4, 8, 4)

// mul_mat_swiglu at 1-8 tokens: one gate row and its up row a block.
#define GF_GLU_ENTRY(NAME, NT)                                                                                                 \
    extern "C" __global__ void __launch_bounds__(GF_THREADS) NAME(Tensor a, Tensor a_up, int adt, const char* x, i64 ldx, i64 n, i64 b2, i64 b3, Tensor out) { \
        l2_prefetch_rows(a, adt, blockIdx.x, 1);                                                                                                               \
        l2_prefetch_rows(a_up, adt, blockIdx.x, 1);                                                                                                            \
        grid_begin();                                                                                                                                          \
        gemv_fast_body<NT, 2, true>(a, a_up, adt, x, ldx, n, b2, b3, out);                                                     \
    }
GF_GLU_ENTRY(gemv_fast_glu_1, 1)
GF_GLU_ENTRY(gemv_fast_glu_2, 2)
GF_GLU_ENTRY(gemv_fast_glu_4, 4)
GF_GLU_ENTRY(gemv_fast_glu_8, 8)
