// moe.cu: mul_mat_id and its fused forms on the CUDA cores, for the experts that mmq.cu's
// tensor-core kernels (`moe_mma_*`, `mmq_*_id`) do not take.
//
// - `moe_decode` / `moe_decode_glu`: a few tokens; a warp per weight row of each routed
//   (slot, token) pair's expert over matmul.cuh's fast units, with no grouping (with many experts
//   few pairs share one, and grouping costs more than the repeated reads). The glu form runs the
//   up expert's row beside the gate's and stores swiglu (mul_mat_id_swiglu).
// - `moe_decode_sum`: mul_mat_id_weighted_sum for a few tokens, each output row summing its
//   token's weighted slots, so the per-slot products never go to memory.
// - `weighted_slot_sum`: that sum after a mul_mat_id into scratch, for more tokens.
// - `moe_gemv` / `moe_gemm`: the grouped path, over the pairs that mmq.cu's `moe_prep` grouped by
//   expert: `moe_gemv` runs the rows of each expert with few pairs over them up to 8 at a time
//   (matmul.cuh's warp dot), `moe_gemm` (shared-memory tiles, f32 FMA) the busy experts.

// moe_gemm tile: weight rows x pairs x k step (256 threads, 4 x 2 outputs each).
#define MT_M 64
#define MT_N 32
#define MT_K 32

// Pairs list[0 .. nt) (nt <= NT) of one expert through weight row m (moe_gemv): one warp_dot of
// NT tokens; the slots past nt repeat the last pair and are not written.
template <int NT>
__device__ __forceinline__ void moe_gemv_pairs(const char* row, int adt, i64 k, const float* bp, i64 ldb, i64 n_b, i64 n_used, const int* list, int nt, i64 m, Tensor out, uint4* stage, bool vec) {
    const float* bt[NT];
    i64 slot[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) {
        const i64 s = list[min(t, nt - 1)], u = s % n_used, tok = s / n_used;
        slot[t] = s;
        bt[t] = bp + ((u % n_b) + n_b * tok) * ldb;
    }
    float acc[NT];
    warp_dot<NT>(row, adt, k, bt, acc, stage, vec, 0, 1);
#pragma unroll
    for (int t = 0; t < NT; t++) {
        const float v = warp_sum(acc[t]);
        if ((threadIdx.x & 31) == 0 && t < nt) *(float*)(out.data + offset_of(out, m, slot[t] % n_used, slot[t] / n_used, 0)) = v;
    }
}

// out[:, u, t] = as[:, :, e]^T b[:, u mod n_b, t] for the pairs of expert e = blockIdx.y; bp is
// the packed activations (row (u mod n_b) + n_b * t at row * ldb). Each warp is one weight row
// and runs over the expert's pairs 8 at a time, the last few with the narrowest dot that holds
// them (a batch of decode steps routes most experts one or two pairs: an 8-wide dot for one pair
// did 8 times the arithmetic).
extern "C" __global__ void __launch_bounds__(MM_WARPS * 32) moe_gemv(Tensor as, int adt, const float* bp, i64 ldb, i64 n_b, i64 n_used, const int* offsets, const int* list, Tensor out, int vec, int gemv_max) {
    grid_begin();
    __shared__ uint4 stage[MM_WARPS][STAGE_CHUNKS];
    const int warp = threadIdx.x >> 5;
    const i64 m = (i64)blockIdx.x * MM_WARPS + warp, e = blockIdx.y;
    if (m >= as.ne[1]) return;
    const int begin = offsets[e], end = offsets[e + 1];
    if (end - begin > gemv_max) return;  // moe_gemm's
    const char* row = as.data + m * as.nb[1] + e * as.nb[2];
    const i64 k = as.ne[0];
    for (int c = begin; c < end; c += 8) {
        const int nt = min(8, end - c);
        if (nt == 1) {
            moe_gemv_pairs<1>(row, adt, k, bp, ldb, n_b, n_used, list + c, nt, m, out, stage[warp], vec != 0);
        } else if (nt == 2) {
            moe_gemv_pairs<2>(row, adt, k, bp, ldb, n_b, n_used, list + c, nt, m, out, stage[warp], vec != 0);
        } else if (nt <= 4) {
            moe_gemv_pairs<4>(row, adt, k, bp, ldb, n_b, n_used, list + c, nt, m, out, stage[warp], vec != 0);
        } else {
            moe_gemv_pairs<8>(row, adt, k, bp, ldb, n_b, n_used, list + c, nt, m, out, stage[warp], vec != 0);
        }
    }
}

// The experts with more than gemv_max pairs: grid (ceil(M / MT_M), n_expert), 256 threads;
// each block runs its MT_M weight rows over the expert's pairs MT_N at a time, with weight
// tiles decoded to f32 and activation tiles gathered through shared memory.
extern "C" __global__ void __launch_bounds__(256) moe_gemm(Tensor as, int adt, const float* bp, i64 ldb, i64 n_b, i64 n_used, const int* offsets, const int* list, Tensor out, int gemv_max) {
    grid_begin();
    __shared__ __align__(16) float wt[MT_K][MT_M + 4];
    __shared__ __align__(16) float xt[MT_K][MT_N + 4];
    __shared__ int pairs[MT_N];
    const i64 e = blockIdx.y, m0 = (i64)blockIdx.x * MT_M;
    const int begin = offsets[e], end = offsets[e + 1];
    if (end - begin <= gemv_max) return;
    const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
    const i64 k = as.ne[0], rows = as.ne[1];
    const char* base = as.data + e * as.nb[2];
    for (int c = begin; c < end; c += MT_N) {
        const int np = min(MT_N, end - c);
        __syncthreads();
        if (tid < MT_N) pairs[tid] = tid < np ? list[c + tid] : -1;
        __syncthreads();
        float acc[4][2];
#pragma unroll
        for (int i = 0; i < 4; i++) acc[i][0] = acc[i][1] = 0.0f;
        for (i64 k0 = 0; k0 < k; k0 += MT_K) {
            {
                const int r = tid >> 2, kk = (tid & 3) * 8;
                const i64 m = m0 + r;
                const char* row = base + m * as.nb[1];
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    const i64 i0 = k0 + kk + j;
                    wt[kk + j][r] = (m < rows && i0 < k) ? weight_value(row, adt, i0) : 0.0f;
                }
            }
            {
                const int p = tid >> 3, kk = (tid & 7) * 4;
                const i64 s = pairs[p];
                const float* x = s >= 0 ? bp + ((s % n_used) % n_b + n_b * (s / n_used)) * ldb : nullptr;
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const i64 i0 = k0 + kk + j;
                    xt[kk + j][p] = (x && i0 < k) ? x[i0] : 0.0f;
                }
            }
            __syncthreads();
#pragma unroll
            for (int kk = 0; kk < MT_K; kk++) {
                const float4 w = *(const float4*)&wt[kk][tx * 4];
                const float2 x = *(const float2*)&xt[kk][ty * 2];
                acc[0][0] += w.x * x.x;
                acc[1][0] += w.y * x.x;
                acc[2][0] += w.z * x.x;
                acc[3][0] += w.w * x.x;
                acc[0][1] += w.x * x.y;
                acc[1][1] += w.y * x.y;
                acc[2][1] += w.z * x.y;
                acc[3][1] += w.w * x.y;
            }
            __syncthreads();
        }
#pragma unroll
        for (int i = 0; i < 4; i++) {
#pragma unroll
            for (int j = 0; j < 2; j++) {
                const i64 m = m0 + tx * 4 + i;
                const int p = ty * 2 + j;
                if (m < rows && p < np) {
                    const i64 s = pairs[p];
                    *(float*)(out.data + offset_of(out, m, s % n_used, s / n_used, 0)) = acc[i][j];
                }
            }
        }
    }
}

// mul_mat_id decode: block (x, s) runs the rows x * 4 .. + 3 (a warp each) of the expert of pair
// s = u + n_used * t only, against activation row (u mod n_b) + n_b * t of `quant_x` (quantized
// weights, scales after the rows at the next 256-byte boundary) or packed f32 rows; a bad id is
// reported and its pair skipped. With GLU each warp also runs the same row of the up experts
// `as_up` and stores swiglu(gate, up) (mul_mat_id_swiglu).
template <bool GLU>
__device__ __forceinline__ void moe_decode_body(Tensor as, Tensor as_up, int adt, const char* x, i64 ldx, i64 n_b, Tensor ids, Tensor out, u64 err, u32 op) {
    constexpr int R = GLU ? 2 : 1;
    const i64 n_used = ids.ne[0], s = blockIdx.y, u = s % n_used, t = s / n_used;
    const int id = *(const int*)(ids.data + u * ids.nb[0] + t * ids.nb[1]);
    if (id < 0 || id >= as.ne[2]) {
        if (blockIdx.x == 0 && threadIdx.x == 0) report_error((ErrorRecord*)err, ERR_INDEX_OUT_OF_RANGE, WHAT_EXPERT_ID, op, id, as.ne[2], 0, 0);
        return;
    }
    const int lane = threadIdx.x & 31;
    const i64 m = (i64)blockIdx.x * (GF_THREADS / 32) + (threadIdx.x >> 5), k = as.ne[0];
    if (m >= as.ne[1]) return;
    const i64 nu = gf_units(adt, k);
    const i64 r = u % n_b + n_b * t;
    const float* xs = (const float*)(x + ((n_b * ids.ne[1] * ldx + 255) & ~(i64)255));
    const char* xt[1] = {x + r * ldx};
    const float* st[1] = {xs + r * (k / 16)};
    const i64 at = m * as.nb[1] + id * as.nb[2];
    const char* row[R];
    row[0] = as.data + at;
    if constexpr (GLU) row[1] = as_up.data + at;
    float acc[R][1];
#pragma unroll
    for (int i = 0; i < R; i++) acc[i][0] = 0.0f;
    gf_rows<1, R>(row, adt, nu, lane, 32, xt, st, acc);
    warp_sum_scatter<R, 16>(&acc[0][0], lane);  // GLU: lanes 0-15 hold the gate's sum, 16-31 the up's
    float v = acc[0][0];
    if constexpr (GLU) {
        const float up = __shfl_sync(0xffffffffu, v, 16);
        v = v * sigmoid_f(v) * up;
    }
    if (lane == 0) *(float*)(out.data + offset_of(out, m, u, t, 0)) = v;
}

extern "C" __global__ void __launch_bounds__(GF_THREADS) moe_decode(Tensor as, int adt, const char* x, i64 ldx, i64 n_b, Tensor ids, Tensor out, u64 err, u32 op) {
    grid_begin();
    moe_decode_body<false>(as, as, adt, x, ldx, n_b, ids, out, err, op);
}
// (at most 56 registers: a decode step's 9 slots x 128 blocks run in one wave)
extern "C" __global__ void __launch_bounds__(GF_THREADS, 9) moe_decode_glu(Tensor as, Tensor as_up, int adt, const char* x, i64 ldx, i64 n_b, Tensor ids, Tensor out, u64 err, u32 op) {
    grid_begin();
    moe_decode_body<true>(as, as_up, adt, x, ldx, n_b, ids, out, err, op);
}

// mul_mat_id_weighted_sum for a few tokens: block (x, t) runs the rows x * 4 .. + 3 (a warp each)
// of every slot u of token t, out[m, t] = sum_u w[0, u, t] * (expert ids[u, t] row m . activation
// row (u mod n_b) + n_b t), the activations as `moe_decode` reads them. The slots go 9 at a time
// (a qwen35moe token's 8 routed and its shared expert) with their loads in flight, at most 128
// registers so that a token's blocks run in one wave; a bad id is reported (block 0) and its slot
// skipped.
#define MDS_SLOTS 9
extern "C" __global__ void __launch_bounds__(GF_THREADS, 4) moe_decode_sum(Tensor as, int adt, const char* x, i64 ldx, i64 n_b, Tensor ids, Tensor w, Tensor out, u64 err, u32 op) {
    grid_begin();
    const i64 n_used = ids.ne[0], t = blockIdx.y;
    const int lane = threadIdx.x & 31;
    const i64 m = (i64)blockIdx.x * (GF_THREADS / 32) + (threadIdx.x >> 5), k = as.ne[0];
    const i64 nu = gf_units(adt, k);
    const float* xs = (const float*)(x + ((n_b * ids.ne[1] * ldx + 255) & ~(i64)255));
    const i64 mr = min(m, as.ne[1] - 1);  // a warp past the last row checks ids, stores nothing
    float acc = 0.0f;
    for (i64 u0 = 0; u0 < n_used; u0 += MDS_SLOTS) {
        const char* row[MDS_SLOTS];
        const char* xt[MDS_SLOTS];
        const float* st[MDS_SLOTS];
        float wt[MDS_SLOTS];
#pragma unroll
        for (int j = 0; j < MDS_SLOTS; j++) {
            const i64 u = u0 + j;
            row[j] = nullptr;
            if (u >= n_used) continue;
            const int id = *(const int*)(ids.data + u * ids.nb[0] + t * ids.nb[1]);
            if (id < 0 || id >= as.ne[2]) {
                if (blockIdx.x == 0 && threadIdx.x == 0) report_error((ErrorRecord*)err, ERR_INDEX_OUT_OF_RANGE, WHAT_EXPERT_ID, op, id, as.ne[2], 0, 0);
                continue;
            }
            const i64 r = u % n_b + n_b * t;
            row[j] = as.data + mr * as.nb[1] + id * as.nb[2];
            xt[j] = x + r * ldx;
            st[j] = xs + r * (k / 16);
            wt[j] = *(const float*)(w.data + u * w.nb[1] + t * w.nb[2]);
        }
        for (i64 un = lane; un < nu; un += 32) {
            GfRaw raw[MDS_SLOTS];
#pragma unroll
            for (int j = 0; j < MDS_SLOTS; j++) {
                if (row[j]) raw[j] = gf_load(row[j], adt, un);
            }
#pragma unroll
            for (int j = 0; j < MDS_SLOTS; j++) {
                if (!row[j]) continue;
                float a[1][1] = {{0.0f}};
                gf_dot<1, 1>(&raw[j], adt, un, &xt[j], &st[j], a);
                acc += wt[j] * a[0][0];
            }
        }
    }
    acc = warp_sum(acc);
    if (lane == 0 && m < as.ne[1]) *(float*)(out.data + offset_of(out, m, t, 0, 0)) = acc;
}

// out[m, t] = sum_u w[0, u, t] * y[m, u, t] (mul_mat_id_weighted_sum after mul_mat_id wrote y
// [M, n_used, T]): a thread per output element, the slots in order.
extern "C" __global__ void weighted_slot_sum(Tensor y, Tensor w, Tensor out) {
    grid_begin();
    const i64 total = y.ne[0] * y.ne[2];
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        const i64 m = i % y.ne[0], t = i / y.ne[0];
        float acc = 0.0f;
        for (i64 u = 0; u < y.ne[1]; u++) {
            const float wu = *(const float*)(w.data + u * w.nb[1] + t * w.nb[2]);
            acc += wu * *(const float*)(y.data + m * y.nb[0] + u * y.nb[1] + t * y.nb[2]);
        }
        *(float*)(out.data + offset_of(out, m, t, 0, 0)) = acc;
    }
}
