// matmul.cu: mul_mat and mul_mat_id.
//
// - `pack_b` copies the f32 activations (any strides) into packed rows of `ldb` elements in
//   scratch, as f32, or as f16 / bf16 (bf16 optionally split into hi + lo parts) for cuBLAS.
// - `gemv_{1,2,4,8}`: one warp per weight row, all tokens of a pass (up to NT) per weight read,
//   f32 accumulation; passes loop over the tokens, so `gemv_8` is also the general path.
//   Plain weights stream through 16-byte loads; q8_0 / nvfp4 rows are staged 32 blocks at a
//   time through shared memory with 16-byte loads and decoded from there, one block per lane.
// - `quant_x` + `gemv_fast_{1,2,4,8}[_r2|_r4]`: the decode GEMV for aligned q8_0 / nvfp4 rows
//   (and few long f16 / bf16 rows), one block per 1, 2 or 4 weight rows, units loaded straight
//   from global memory,
//   int8 weights times int16 activations through dp4a; `moe_decode`: the same units over the
//   routed (slot, token) pairs of mul_mat_id with few tokens (see "Fast decode GEMV" below).
// - `gemv1_q8_0_s*` / `gemv1_nvfp4_s*` / `gemv1_nvfp4_producer_s4`: the 1-token GEMV for
//   contiguous q8_0 / nvfp4 rows, rows streamed through shared memory (bulk copies on sm_90+,
//   cp.async on sm_80), a thread per 64-value unit of the row with its activations (quantized
//   in the kernel) in registers;
//   `pack_b` + `gemv_f16w` / `gemv_bf16w[_long]`: a 1-token GEMV for f16 / bf16 rows, a thread
//   per 2 or 5 16-byte words (see the end).
// - `dequant_rows` converts rows of one weight matrix to bf16 (hi, and lo = the rounding
//   remainder) for the cuBLAS path of quantized weights with many tokens.
// - `moe_gemv` runs the rows of each expert with few (slot, token) pairs of mul_mat_id over them
//   up to 8 at a time, `moe_gemm` (shared-memory tiles, f32 FMA) the busy experts, over the pairs
//   that mmq.cu's `moe_prep` grouped by expert (q8_0 / nvfp4 experts mostly take mmq.cu's
//   `moe_mma_*` instead).

#define MM_WARPS 4
// moe_gemm tile: weight rows x pairs x k step (256 threads, 4 x 2 outputs each).
#define MT_M 64
#define MT_N 32
#define MT_K 32
// Per-warp staging: 32 blocks of the largest block type (nvfp4, 36 bytes).
#define STAGE_CHUNKS (32 * NVFP4_BYTES / 16)

extern "C" __global__ void pack_b(Tensor b, float* f32_out, u16* hi_out, u16* lo_out, int half_dt, i64 ldb) {
    grid_begin();
    const i64 k = b.ne[0], total = nelements(b);
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        i64 i0, i1, i2, i3;
        unravel(b, i, i0, i1, i2, i3);
        const float v = *(const float*)(b.data + offset_of(b, i0, i1, i2, i3));
        const i64 o = (i / k) * ldb + i0;
        if (f32_out) f32_out[o] = v;
        if (hi_out) {
            if (half_dt == DT_F16) {
                hi_out[o] = f32_to_f16(v);
            } else {
                const u16 h = f32_to_bf16(v);
                hi_out[o] = h;
                if (lo_out) lo_out[o] = f32_to_bf16(v - bf16_to_f32(h));
            }
        }
    }
}

__device__ __forceinline__ float dot4(float4 w, float4 x) { return w.x * x.x + w.y * x.y + w.z * x.z + w.w * x.w; }

// Two halves packed in a u32 to f32.
__device__ __forceinline__ float half_lo(u32 v, int dt) {
    return dt == DT_F16 ? f16_to_f32((u16)(v & 0xffff)) : bf16_to_f32((u16)(v & 0xffff));
}
__device__ __forceinline__ float half_hi(u32 v, int dt) {
    return dt == DT_F16 ? f16_to_f32((u16)(v >> 16)) : bf16_to_f32((u16)(v >> 16));
}

// E2M1 code (low 4 bits) to value without a lookup table (a local array would live in local
// memory): magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; code 8 gives -0, equal to +0 in every sum.
__device__ __forceinline__ float e2m1_fast(u32 code) {
    const u32 mag = code & 7;
    const float v = mag < 2 ? 0.5f * (float)mag : __uint_as_float((((mag >> 1) + 126u) << 23) | ((mag & 1u) << 22));
    return (code & 8) ? -v : v;
}

// UE4M3 scale as `ue4m3_to_f32` in common.cuh, by bits: (8 + man) * 2^(exp - 10), subnormals
// man * 2^-9, 0x00 and 0x7F are 0, bit 7 ignored.
__device__ __forceinline__ float ue4m3_fast(u32 code) {
    code &= 0xff;
    if (code == 0 || code == 0x7f) return 0.0f;
    const u32 exp = (code >> 3) & 0xf, man = code & 7;
    return exp == 0 ? (float)man * 0.001953125f : __uint_as_float(((exp + 120u) << 23) | (man << 20));
}

// Four int8 quants packed in two u16 to floats without int-to-float conversions (a quarter-rate
// instruction): each byte, offset to unsigned, becomes the low mantissa byte of 2^23 + u.
__device__ __forceinline__ float i8_at(u32 w, u32 sel) { return __uint_as_float(__byte_perm(w, 0x4B000000u, sel)) - 8388736.0f; }
__device__ __forceinline__ float4 q8x4(u32 lo, u32 hi) {
    const u32 w = (lo | (hi << 16)) ^ 0x80808080u;
    return make_float4(i8_at(w, 0x7440), i8_at(w, 0x7441), i8_at(w, 0x7442), i8_at(w, 0x7443));
}

// E2M1 code (low 4 bits of c) s e1 e0 m0 placed as the sign, the two lowest exponent bits and the
// top mantissa bit of an f32 reads as value * 2^-126 (e = 0 is the subnormal 0.5 * m0 * 2^-126;
// NVRTC does not flush subnormals without --ftz), so one multiply by 2^126 decodes it.
__device__ __forceinline__ float e2m1_bits(u32 c) { return __uint_as_float(((c & 7u) << 22) | ((c & 8u) << 28)) * 8.507059173023462e37f; }

// Four E2M1 codes, nibble `shift` of each byte of c, to floats.
__device__ __forceinline__ float4 e2m1x4(u32 c, int shift) {
    c >>= shift;
    return make_float4(e2m1_bits(c), e2m1_bits(c >> 8), e2m1_bits(c >> 16), e2m1_bits(c >> 24));
}

// Value i0 of a dense weight row, decoding without lookup tables.
__device__ __forceinline__ float weight_value(const char* row, int dt, i64 i0) {
    if (dt == DT_Q8_0) {
        const char* blk = row + (i0 / QK8_0) * Q8_0_BYTES;
        return f16_to_f32(*(const u16*)blk) * (float)((const i8*)(blk + 2))[i0 % QK8_0];
    }
    if (dt == DT_NVFP4) {
        const u8* blk = (const u8*)row + (i0 / QK_NVFP4) * NVFP4_BYTES;
        const int j = (int)(i0 % QK_NVFP4), s = j >> 4, w = j & 15;
        const u32 byte = blk[4 + 8 * s + (w & 7)];
        return ue4m3_fast(blk[s]) * e2m1_fast(w < 8 ? byte : byte >> 4);
    }
    return load_f32(row + i0 * (dt == DT_F32 ? 4 : 2), dt);
}

// Rows [m0, m0 + gridDim.y) of weight matrix (a2, a3) to bf16 rows of `ld` elements: hi, and
// the rounding remainder at lo when lo is not null.
extern "C" __global__ void dequant_rows(Tensor a, int adt, i64 m0, i64 a2, i64 a3, u16* hi, u16* lo, i64 ld) {
    grid_begin();
    const i64 r = blockIdx.y;
    const char* row = a.data + (m0 + r) * a.nb[1] + a2 * a.nb[2] + a3 * a.nb[3];
    for (i64 i0 = blockIdx.x * (i64)blockDim.x + threadIdx.x; i0 < a.ne[0]; i0 += (i64)gridDim.x * blockDim.x) {
        const float v = weight_value(row, adt, i0);
        const u16 h = f32_to_bf16(v);
        hi[r * ld + i0] = h;
        if (lo) lo[r * ld + i0] = f32_to_bf16(v - bf16_to_f32(h));
    }
}

// Quantized rows are read in units of 8 per block: q8_0 unit j of a block is values 4j .. 4j + 3;
// nvfp4 unit 2s + h is values 16s + 4h .. + 3 (low nibbles of bytes 4h .. 4h + 3 of sub-block s)
// and 16s + 8 + 4h .. + 3 (their high nibbles). `blk` is the block's bytes (2- or 4-aligned).
// acc[t] += unit . bt[t] at the unit's values.
template <int NT>
__device__ __forceinline__ void dot_unit(const char* blk, int dt, int u, i64 kb, const float* const* bt, float* acc) {
    if (dt == DT_Q8_0) {
        const float d = f16_to_f32(*(const u16*)blk);
        const u16* q = (const u16*)(blk + 2) + 2 * u;
        const float4 w = q8x4(q[0], q[1]);
#pragma unroll
        for (int t = 0; t < NT; t++) acc[t] += d * dot4(w, *(const float4*)(bt[t] + kb + 4 * u));
    } else {
        const int s = u >> 1, h = u & 1;
        const float d = ue4m3_fast(((const u8*)blk)[s]);
        const u32 c = *(const u32*)(blk + 4 + 8 * s + 4 * h);
        const float4 w0 = e2m1x4(c, 0), w1 = e2m1x4(c, 4);
        const i64 at = kb + 16 * s + 4 * h;
#pragma unroll
        for (int t = 0; t < NT; t++) acc[t] += d * (dot4(w0, *(const float4*)(bt[t] + at)) + dot4(w1, *(const float4*)(bt[t] + at + 8)));
    }
}

// Per-lane partial dots of one weight row (dense, `dt`, k elements) with NT activation rows
// (packed f32, 16-byte aligned, k rounded up to 8 readable), over part `part` of `parts`
// interleaved slices of the row. `vec`: the row starts 16-byte aligned and its byte length is a
// multiple of 16, so it may be read in 16-byte pieces. `stage` is this warp's shared staging.
template <int NT>
__device__ __forceinline__ void warp_dot(const char* row, int dt, i64 k, const float* const* bt, float* acc, uint4* stage, bool vec, int part, int parts) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = 0.0f;
    if (dt == DT_Q8_0 || dt == DT_NVFP4) {
        // segments of 32 blocks; with `vec` the next segment's 16-byte pieces are loaded into
        // registers while the current one is decoded from shared memory
        const int bsz = dt == DT_Q8_0 ? Q8_0_BYTES : NVFP4_BYTES, qk = dt == DT_Q8_0 ? QK8_0 : QK_NVFP4;
        const i64 nblk = k / qk, step = 32 * (i64)parts;
        uint4 pre[STAGE_CHUNKS / 32 + 1];
        i64 b0 = 32 * (i64)part;
        if (vec && b0 < nblk) {
            const int chunks = (int)min((i64)32, nblk - b0) * bsz / 16;
#pragma unroll
            for (int i = 0; i < STAGE_CHUNKS / 32 + 1; i++) {
                if (lane + 32 * i < chunks) pre[i] = ((const uint4*)(row + b0 * bsz))[lane + 32 * i];
            }
        }
        for (; b0 < nblk; b0 += step) {
            const int nb = (int)min((i64)32, nblk - b0), bytes = nb * bsz;
            __syncwarp();
            if (vec) {
#pragma unroll
                for (int i = 0; i < STAGE_CHUNKS / 32 + 1; i++) {
                    if (lane + 32 * i < bytes / 16) stage[lane + 32 * i] = pre[i];
                }
                const i64 next = b0 + step;
                if (next < nblk) {
                    const int chunks = (int)min((i64)32, nblk - next) * bsz / 16;
#pragma unroll
                    for (int i = 0; i < STAGE_CHUNKS / 32 + 1; i++) {
                        if (lane + 32 * i < chunks) pre[i] = ((const uint4*)(row + next * bsz))[lane + 32 * i];
                    }
                }
            } else {
                for (int c = lane; c < bytes; c += 32) ((char*)stage)[c] = row[b0 * bsz + c];
            }
            __syncwarp();
            // lanes take consecutive units, so their activation reads are coalesced
            for (int g = lane; g < nb * 8; g += 32) {
                const int bi = g >> 3;
                dot_unit<NT>((const char*)stage + bi * bsz, dt, g & 7, (b0 + bi) * qk, bt, acc);
            }
        }
    } else if (vec) {
        // 16-byte pieces, 4 in flight per lane: 4 f32 or 8 halves each
        const uint4* w = (const uint4*)row;
        const i64 nv = dt == DT_F32 ? k / 4 : k / 8;
        for (i64 j0 = lane + 128 * (i64)part; j0 < nv; j0 += 128 * (i64)parts) {
            uint4 v[4];
#pragma unroll
            for (int u = 0; u < 4; u++) {
                if (j0 + 32 * u < nv) v[u] = w[j0 + 32 * u];
            }
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const i64 j = j0 + 32 * u;
                if (j >= nv) break;
                if (dt == DT_F32) {
                    const float4 w0 = make_float4(__uint_as_float(v[u].x), __uint_as_float(v[u].y), __uint_as_float(v[u].z), __uint_as_float(v[u].w));
#pragma unroll
                    for (int t = 0; t < NT; t++) acc[t] += dot4(w0, ((const float4*)bt[t])[j]);
                } else {
                    const float4 w0 = make_float4(half_lo(v[u].x, dt), half_hi(v[u].x, dt), half_lo(v[u].y, dt), half_hi(v[u].y, dt));
                    const float4 w1 = make_float4(half_lo(v[u].z, dt), half_hi(v[u].z, dt), half_lo(v[u].w, dt), half_hi(v[u].w, dt));
#pragma unroll
                    for (int t = 0; t < NT; t++) {
                        const float4* x = (const float4*)bt[t] + 2 * j;
                        acc[t] += dot4(w0, x[0]) + dot4(w1, x[1]);
                    }
                }
            }
        }
    } else {
        const int es = dt == DT_F32 ? 4 : 2;
        for (i64 i = lane + 32 * (i64)part; i < k; i += 32 * (i64)parts) {
            const float w = load_f32(row + i * es, dt);
#pragma unroll
            for (int t = 0; t < NT; t++) acc[t] += w * bt[t][i];
        }
    }
}

// out[m, n, i2, i3] for a: [k, M, A2, A3] and the packed activations bp (row n + N * (i2 + B2 *
// i3) at row * ldb). Grid: (ceil(M * parts / MM_WARPS), batches); `parts` (1 or MM_WARPS) warps
// share one weight row, each taking an interleaved slice of it, and add up through shared memory.
template <int NT>
__device__ __forceinline__ void gemv_body(Tensor a, int adt, const float* bp, i64 ldb, i64 n, i64 b2, i64 b3, Tensor out, int vec, int parts) {
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

// ---------------------------------------------------------------------------------------------
// Fast decode GEMV (contiguous-row weights, 1..8 tokens per weight read).
//
// gemv_fast: one block of GF_THREADS threads per R weight rows (R = 1, 2 or 4: `_rR` entries); the
// threads stride over the rows in units of 16 values (q8_0: half a block, 17 bytes; nvfp4: one
// 16-value sub-block, 8.5 bytes; f16 / bf16: 8 values, 16 bytes), a few units loaded straight
// from global memory before any is used, then a block reduction. Each token's activations of a
// unit are loaded once for the block's R rows: with several tokens they outweigh the weights. Quantized weights multiply int16 activations split in two int8 halves
// (x_q = 256 hi + lo, per-16-value f32 scale, written once per call by `quant_x`) with `dp4a`,
// so a unit costs a few integer instructions per weight byte; the int16 activations keep
// |x - d x_q| <= amax / 65278 per block, far inside the f32 bound. f16 / bf16 weights use
// the packed f32 activations of `pack_b`.

#define GF_THREADS 128
#define GF_UNITS 4
// Largest |x_q|: hi = (x_q + 128) >> 8 and lo = x_q - 256 hi both stay in int8.
#define XQ_MAX 32639.0f

__device__ __forceinline__ int dp4a(int a, int b, int c) {
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

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

// 8 E2M1 codes (the nibbles of q) to 2 x E2M1 as int8: x = the low nibbles of bytes 0..3, y =
// their high nibbles (two 8-entry byte lookups per nibble pair and a select on the sign bit).
__device__ __forceinline__ int2 e2m1x8_i8(u32 q) {
    const u32 pos_lo = 0x03020100u, pos_hi = 0x0C080604u, neg_lo = 0xFDFEFF00u, neg_hi = 0xF4F8FAFCu;
    const u32 sel = 0x32103210u | ((q & 0x88888888u) >> 1);
    u32 t[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const u32 s = (q >> (16 * i)) & 0x7777u;
        const u32 p = __byte_perm(pos_lo, pos_hi, s), n = __byte_perm(neg_lo, neg_hi, s);
        t[i] = __byte_perm(p, n, sel >> (16 * i));
    }
    return make_int2((int)__byte_perm(t[0], t[1], 0x6420), (int)__byte_perm(t[0], t[1], 0x7531));
}

// One unit's raw weight bytes as loaded.
// Units of a weight row of k values for gf_load / gf_dot: 16 values of q8_0 / nvfp4 (against 16
// int16 activations and their scale), 8 of f16 / bf16 or 4 of f32 (16 bytes, against f32
// activations).
__device__ __forceinline__ i64 gf_units(int dt, i64 k) {
    return (dt == DT_Q8_0 || dt == DT_NVFP4) ? k / 16 : dt == DT_F32 ? k / 4 : k / 8;
}

struct GfRaw {
    uint4 w;
    u32 w4, sc;
};

__device__ __forceinline__ GfRaw gf_load(const char* row, int dt, i64 u) {
    GfRaw r;
    if (dt == DT_Q8_0) {
        const char* blk = row + (u >> 1) * Q8_0_BYTES;
        const char* q = blk + 2 + 16 * (u & 1);
        const u32* p = (const u32*)((u64)q & ~(u64)3);
        r.sc = *(const u16*)blk;
        r.w = make_uint4(p[0], p[1], p[2], p[3]);
        // the fifth word only when the quants start mid-word (it may lie past the row otherwise)
        r.w4 = ((u64)q & 2) ? p[4] : 0u;
        if ((u64)q & 2) r.sc |= 0x10000u;
    } else if (dt == DT_NVFP4) {
        const u8* blk = (const u8*)row + (u >> 2) * NVFP4_BYTES;
        const u32* p = (const u32*)(blk + 4 + 8 * (u & 3));
        r.sc = blk[u & 3];
        r.w = make_uint4(p[0], p[1], 0u, 0u);
        r.w4 = 0u;
    } else {
        r.w = ((const uint4*)row)[u];
        r.w4 = r.sc = 0u;
    }
    return r;
}

// acc[r][t] += unit u of weight row r . activation row t, for R rows loaded as raw[0..R): each
// row's unit is decoded once and each token's activations are loaded once for all R rows (at 8
// tokens the activations are 32x the nvfp4 weight bytes, so reading them once per row, not per
// R rows, is what bounds a one-row block).
template <int NT, int R>
__device__ __forceinline__ void gf_dot(const GfRaw* raw, int dt, i64 u, const char* const* xt, const float* const* st, float (*acc)[NT]) {
    if (dt == DT_Q8_0 || dt == DT_NVFP4) {
        int w[R][4];
        float dw[R];
#pragma unroll
        for (int r = 0; r < R; r++) {
            if (dt == DT_Q8_0) {
                const u32 s = (raw[r].sc & 0x10000u) ? 0x5432u : 0x3210u;
                w[r][0] = (int)__byte_perm(raw[r].w.x, raw[r].w.y, s);
                w[r][1] = (int)__byte_perm(raw[r].w.y, raw[r].w.z, s);
                w[r][2] = (int)__byte_perm(raw[r].w.z, raw[r].w.w, s);
                w[r][3] = (int)__byte_perm(raw[r].w.w, raw[r].w4, s);
                dw[r] = f16_to_f32((u16)(raw[r].sc & 0xffff));
            } else {
                const int2 a = e2m1x8_i8(raw[r].w.x), b = e2m1x8_i8(raw[r].w.y);
                w[r][0] = a.x;
                w[r][1] = b.x;
                w[r][2] = a.y;
                w[r][3] = b.y;
                dw[r] = 0.5f * ue4m3_fast(raw[r].sc);
            }
        }
#pragma unroll
        for (int t = 0; t < NT; t++) {
            const uint4 h = ((const uint4*)xt[t])[2 * u], l = ((const uint4*)xt[t])[2 * u + 1];
            const float sx = st[t][u];
#pragma unroll
            for (int r = 0; r < R; r++) {
                const int ih = dp4a(w[r][3], (int)h.w, dp4a(w[r][2], (int)h.z, dp4a(w[r][1], (int)h.y, dp4a(w[r][0], (int)h.x, 0))));
                const int il = dp4a(w[r][3], (int)l.w, dp4a(w[r][2], (int)l.z, dp4a(w[r][1], (int)l.y, dp4a(w[r][0], (int)l.x, 0))));
                acc[r][t] += (float)(ih * 256 + il) * (dw[r] * sx);
            }
        }
    } else if (dt == DT_F32) {
#pragma unroll
        for (int t = 0; t < NT; t++) {
            const float4 x = ((const float4*)xt[t])[u];
#pragma unroll
            for (int r = 0; r < R; r++) {
                const float4 w = make_float4(__uint_as_float(raw[r].w.x), __uint_as_float(raw[r].w.y), __uint_as_float(raw[r].w.z), __uint_as_float(raw[r].w.w));
                acc[r][t] += dot4(w, x);
            }
        }
    } else {
        float4 w0[R], w1[R];
#pragma unroll
        for (int r = 0; r < R; r++) {
            w0[r] = make_float4(half_lo(raw[r].w.x, dt), half_hi(raw[r].w.x, dt), half_lo(raw[r].w.y, dt), half_hi(raw[r].w.y, dt));
            w1[r] = make_float4(half_lo(raw[r].w.z, dt), half_hi(raw[r].w.z, dt), half_lo(raw[r].w.w, dt), half_hi(raw[r].w.w, dt));
        }
#pragma unroll
        for (int t = 0; t < NT; t++) {
            const float4* x = (const float4*)xt[t] + 2 * u;
            const float4 x0 = x[0], x1 = x[1];
#pragma unroll
            for (int r = 0; r < R; r++) acc[r][t] += dot4(w0[r], x0) + dot4(w1[r], x1);
        }
    }
}

// acc[r][t] += units gl, gl + g, ... of weight row `row[r]` . activation row t. Loads go out
// GF_UNITS (one row) or GF_UNITS / 2 (several rows: R loads each) units ahead of their use.
template <int NT, int R>
__device__ __forceinline__ void gf_rows(const char* const* row, int adt, i64 nu, int gl, int g, const char* const* xt, const float* const* st, float (*acc)[NT]) {
    constexpr int U = R == 1 ? GF_UNITS : GF_UNITS / 2;
    for (i64 u0 = gl; u0 < nu; u0 += U * g) {
        GfRaw raw[U][R];
#pragma unroll
        for (int i = 0; i < U; i++) {
            if (u0 + i * g < nu) {
#pragma unroll
                for (int r = 0; r < R; r++) raw[i][r] = gf_load(row[r], adt, u0 + i * g);
            }
        }
#pragma unroll
        for (int i = 0; i < U; i++) {
            if (u0 + i * g < nu) gf_dot<NT, R>(raw[i], adt, u0 + i * g, xt, st, acc);
        }
    }
}

// Warp sums of N values a lane (N a power of two <= 32) in N - 1 + log2(32 / N) shuffles
// instead of 5 N: while a lane holds several values, each step sends half of them to the partner
// lane across bit O and keeps the other half (lanes with bit O set the upper half), adding what
// the partner sent; then single values add up as in warp_sum. Lane l ends with the total of
// value l / (32 / N) in v[0].
template <int N, int O>
__device__ __forceinline__ void warp_sum_scatter(float* v, int lane) {
    if constexpr (O > 0) {
        if constexpr (N > 1) {
            constexpr int H = N / 2;
            const bool up = lane & O;
#pragma unroll
            for (int i = 0; i < H; i++) {
                const float send = up ? v[i] : v[i + H], keep = up ? v[i + H] : v[i];
                v[i] = keep + __shfl_xor_sync(0xffffffffu, send, O);
            }
            warp_sum_scatter<H, O / 2>(v, lane);
        } else {
            v[0] += __shfl_xor_sync(0xffffffffu, v[0], O);
            warp_sum_scatter<1, O / 2>(v, lane);
        }
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

extern "C" __global__ void __launch_bounds__(MM_WARPS * 32) gemv_1(Tensor a, int adt, const float* bp, i64 ldb, i64 n, i64 b2, i64 b3, Tensor out, int vec, int parts) {
    l2_prefetch_rows(a, adt, (i64)blockIdx.x * (MM_WARPS / parts), MM_WARPS / parts);
    grid_begin();
    gemv_body<1>(a, adt, bp, ldb, n, b2, b3, out, vec, parts);
}
extern "C" __global__ void __launch_bounds__(MM_WARPS * 32) gemv_2(Tensor a, int adt, const float* bp, i64 ldb, i64 n, i64 b2, i64 b3, Tensor out, int vec, int parts) {
    l2_prefetch_rows(a, adt, (i64)blockIdx.x * (MM_WARPS / parts), MM_WARPS / parts);
    grid_begin();
    gemv_body<2>(a, adt, bp, ldb, n, b2, b3, out, vec, parts);
}
extern "C" __global__ void __launch_bounds__(MM_WARPS * 32) gemv_4(Tensor a, int adt, const float* bp, i64 ldb, i64 n, i64 b2, i64 b3, Tensor out, int vec, int parts) {
    l2_prefetch_rows(a, adt, (i64)blockIdx.x * (MM_WARPS / parts), MM_WARPS / parts);
    grid_begin();
    gemv_body<4>(a, adt, bp, ldb, n, b2, b3, out, vec, parts);
}
extern "C" __global__ void __launch_bounds__(MM_WARPS * 32) gemv_8(Tensor a, int adt, const float* bp, i64 ldb, i64 n, i64 b2, i64 b3, Tensor out, int vec, int parts) {
    l2_prefetch_rows(a, adt, (i64)blockIdx.x * (MM_WARPS / parts), MM_WARPS / parts);
    grid_begin();
    gemv_body<8>(a, adt, bp, ldb, n, b2, b3, out, vec, parts);
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
extern "C" __global__ void __launch_bounds__(GF_THREADS) moe_decode_glu(Tensor as, Tensor as_up, int adt, const char* x, i64 ldx, i64 n_b, Tensor ids, Tensor out, u64 err, u32 op) {
    grid_begin();
    moe_decode_body<true>(as, as_up, adt, x, ldx, n_b, ids, out, err, op);
}

// ---------------------------------------------------------------------------------------------
// 1-token GEMV over q8_0 / nvfp4 weights (`gemv1_q8_0`, `gemv1_nvfp4`): one weight matrix of
// contiguous rows (row r at r * row_bytes, 16-byte aligned), k % 256 == 0, one activation row.
//
// A row is read in units of 64 values: one nvfp4 block (36 bytes) or two q8_0 blocks (68 bytes),
// both 4-byte aligned. Thread (g, j) of a block owns unit j of the rows of group g, so its 64
// activations live in registers as int16 pairs (no separate quantization kernel: group 0
// quantizes each unit once, in shared memory, and every group reads the result; quantizing in
// every thread cost 13% of the kernel's instructions). Each block streams a contiguous range of
// rows through a ring of S shared-memory stages, S - 1 stages of rows_stage rows in flight (S = 3
// or 4, an entry point each: the host picks by the device's memory bandwidth): on sm_90+
// one thread copies each stage with bulk (TMA) copies completing on the stage's mbarrier (no
// per-16-byte copy instructions: on an H200 q8_0 75 -> 77% and nvfp4 48 -> 54% of copy bandwidth
// against cp.async; which thread: `copier`; unless nvfp4 is bound by its arithmetic it also has
// L2 fetch each stage it copies: `l2_prefetch`), on sm_80 every thread copies 16-byte pieces with
// cp.async; one block barrier a stage frees the buffer before it is refilled (in
// `gemv1_nvfp4_producer_s4` a warp of its own copies and adds up instead, paced by per-stage
// mbarriers: no block barrier in the loop). A thread reads its unit with 4-byte shared loads
// (no bank conflicts: the unit strides 9 and 17 words are odd) and writes one partial per row
// (nvfp4: two rows at a time, interleaved, for instruction-level parallelism), and during the
// next stage a few warps (or the producer warp) add up the partials of each row. Per
// unit: q8_0 32 dp2a (int16 activations x int8 quants) and 2 f16 scales; nvfp4 8 code words,
// each decoded with 4 byte permutes into the E2M1 values + 128 as unsigned bytes, 4 dp2a per
// word (the +128 is taken back by a per-sub-block constant folded into the dot's start), 4 UE4M3
// scales decoded as f16.

// TAG(gemv1-consts): G1_MAX_THREADS, G1_MAX_THREADS_NVFP4 and G1_XSTRIDE are mirrored in
// src/ops/matmul.rs. nvfp4, bound by its arithmetic, takes more warps (96 registers fit 640
// threads): 8 groups of 80 units instead of 7 at k = 5120.
#define G1_MAX_THREADS 576
#define G1_MAX_THREADS_NVFP4 640
// Bytes of staged f32 activations per 64-value unit: 256 and 16 of padding, so that the
// threads' 16-byte reads of their own units spread over all banks.
#define G1_XSTRIDE 272
// E2M1 magnitudes times 2 (0, 0.5, 1, 1.5, 2, 3, 4, 6), bytes 0..7 of the lookup pair.
#define G1_E2M1_LO 0x03020100u
#define G1_E2M1_HI 0x0C080604u

// PTX prmt in its default mode: selector nibble i picks byte (nibble & 7) of {b, a} into byte i,
// and a nibble with its top bit set replicates that byte's sign bit instead (`__byte_perm` masks
// the top bits away, so it cannot do this).
__device__ __forceinline__ u32 g1_prmt(u32 a, u32 b, u32 s) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(s));
    return d;
}

// c + a.lo16 * b.byte0 + a.hi16 * b.byte1 (`lo`) or bytes 2 and 3 (`hi`); a holds two int16,
// b four signed (`ss`) or unsigned (`su`) bytes.
#define G1_DP2A(NAME, PTX)                                           \
    __device__ __forceinline__ int NAME(u32 a, u32 b, int c) {       \
        int d;                                                        \
        asm(PTX " %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c)); \
        return d;                                                     \
    }
G1_DP2A(g1_dp2a_lo_ss, "dp2a.lo.s32.s32")
G1_DP2A(g1_dp2a_hi_ss, "dp2a.hi.s32.s32")
G1_DP2A(g1_dp2a_lo_su, "dp2a.lo.s32.u32")
G1_DP2A(g1_dp2a_hi_su, "dp2a.hi.s32.u32")

// sm_90+: bulk (TMA) copies global -> shared completing on an mbarrier (one per stage buffer).
#if __CUDA_ARCH__ >= 900
__device__ __forceinline__ void g1_bar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void g1_bar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void g1_fence_bar_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
__device__ __forceinline__ void g1_bar_expect(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void g1_bulk(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst), "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}
// Asks L2 for bytes at src (16-byte aligned, a multiple of 16), completing on nothing.
__device__ __forceinline__ void g1_prefetch_l2(const void* src, u32 bytes) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void g1_bar_wait(u32 bar, u32 parity) {
    asm volatile(
        "{\n\t.reg .pred p;\n\t"
        "G1_WAIT:\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n\t"
        "@!p bra G1_WAIT;\n\t}" ::"r"(bar),
        "r"(parity)
        : "memory");
}
#endif

// Two int16 in one word, a in the low half.
__device__ __forceinline__ u32 g1_pair(int a, int b) { return ((u32)a & 0xffffu) | ((u32)b << 16); }

// Four E2M1 codes (the nibbles of the low 16 bits of p; the same codes with their sign bits
// flipped in n) to unsigned bytes 2 * value + 128: the positive codes look up their magnitude in
// p (negative ones replicate a clear sign bit: 0), the negative ones in n, and p + 128 - n never
// carries between bytes. `lo` is G1_E2M1_LO in a register.
__device__ __forceinline__ u32 g1_e2m1x4(u32 lo, u32 p, u32 n) {
    return g1_prmt(lo, G1_E2M1_HI, p) + 0x80808080u - g1_prmt(lo, G1_E2M1_HI, n);
}

// UE4M3 scales (the four bytes of sw) as f16 bit patterns (code & 0x7f) << 7 (= value / 256),
// to f32; 0x7F alone reads 0: bit 7 of `nz` is clear exactly for the bytes equal to 0x7F, and the
// sign-replicating prmt turns those bits into byte masks.
__device__ __forceinline__ void g1_ue4m3x4(u32 sw, float* ws) {
    const u32 nz = ((~sw & 0x7f7f7f7fu) + 0x7f7f7f7fu) | sw;
    const u32 c7 = sw & g1_prmt(nz, 0u, 0xBA98u) & 0x7f7f7f7fu;
    const u32 h01 = g1_prmt(c7, 0u, 0x1404u) >> 1, h23 = g1_prmt(c7, 0u, 0x3424u) >> 1;
    ws[0] = f16_to_f32((u16)h01);
    ws[1] = f16_to_f32((u16)(h01 >> 16));
    ws[2] = f16_to_f32((u16)h23);
    ws[3] = f16_to_f32((u16)(h23 >> 16));
}

// R nvfp4 blocks (9 words at w + i * stride each, i < R) . the same 64 activations, in lockstep
// so that the R independent chains interleave: x[8 s + 4 h + i] holds the int16 pair of values
// 16 s + 4 h + i and + 8 (code word 1 + 2 s + h, bytes i), cs[s] = -128 * (sum of the int16
// activations of sub-block s); lo = G1_E2M1_LO. out[i] = sum_s scale_s / 256 * dot_s (E2M1
// values times 2).
template <int R>
__device__ __forceinline__ void g1_units_nvfp4(const u32* w, int stride, const u32* x, const int* cs, u32 lo, float* out) {
    u32 u[R][9];
#pragma unroll
    for (int r = 0; r < R; r++) {
#pragma unroll
        for (int i = 0; i < 9; i++) u[r][i] = w[r * stride + i];
    }
    float ws[R][4];
#pragma unroll
    for (int r = 0; r < R; r++) {
        g1_ue4m3x4(u[r][0], ws[r]);
        out[r] = 0.0f;
    }
#pragma unroll
    for (int s = 0; s < 4; s++) {
        int dot[R];
#pragma unroll
        for (int r = 0; r < R; r++) dot[r] = cs[s];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const u32* xp = x + 8 * s + 4 * h;
#pragma unroll
            for (int r = 0; r < R; r++) {
                const u32 q = u[r][1 + 2 * s + h], n = q ^ 0x88888888u;
                const u32 d0 = g1_e2m1x4(lo, q, n), d1 = g1_e2m1x4(lo, q >> 16, n >> 16);
                dot[r] = g1_dp2a_lo_su(xp[0], d0, dot[r]);
                dot[r] = g1_dp2a_hi_su(xp[1], d0, dot[r]);
                dot[r] = g1_dp2a_lo_su(xp[2], d1, dot[r]);
                dot[r] = g1_dp2a_hi_su(xp[3], d1, dot[r]);
            }
        }
#pragma unroll
        for (int r = 0; r < R; r++) out[r] = fmaf((float)dot[r], ws[r][s], out[r]);
    }
}

// Two q8_0 blocks (17 words at w: f16 scale, 32 quants, f16 scale, 32 quants) . their 64
// activations, x[p] the int16 pair of values 2 p and 2 p + 1. Two dp2a chains per block.
__device__ __forceinline__ float g1_unit_q8_0(const u32* w, const u32* x) {
    u32 u[17];
#pragma unroll
    for (int i = 0; i < 17; i++) u[i] = w[i];
    // block 0: quants at bytes 2 .. 33 (words 0 hi, 1 .. 7, 8 lo); block 1 at bytes 36 .. 67
    int a0 = g1_dp2a_hi_ss(x[0], u[0], 0), a1 = 0;
#pragma unroll
    for (int i = 1; i < 8; i++) {
        a0 = g1_dp2a_lo_ss(x[2 * i - 1], u[i], a0);
        a1 = g1_dp2a_hi_ss(x[2 * i], u[i], a1);
    }
    a0 = g1_dp2a_lo_ss(x[15], u[8], a0);
    int b0 = 0, b1 = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        b0 = g1_dp2a_lo_ss(x[16 + 2 * i], u[9 + i], b0);
        b1 = g1_dp2a_hi_ss(x[17 + 2 * i], u[9 + i], b1);
    }
    return fmaf((float)(a0 + a1), f16_to_f32((u16)u[0]), (float)(b0 + b1) * f16_to_f32((u16)(u[8] >> 16)));
}

// Quantizes one unit of 64 staged f32 activations (16-byte aligned, G1_XSTRIDE bytes) in place
// to what the unit dots read: words 0-31 the int16 pairs (q8_0: x[p] = values 2 p, 2 p + 1;
// nvfp4: x[8 s + 4 h + i] = values 16 s + 4 h + i and + 8, matching code word 1 + 2 s + h),
// words 32-35 nvfp4's cs[s] = -128 * (sum of sub-block s's int16 values), word 36 the f32 scale
// (|x - dx q| <= dx / 2, dx = amax / 32767; nvfp4's times 128: its E2M1 values are doubled and
// its scales read as value / 256).
template <int DT>
__device__ __forceinline__ void g1_quantize_unit(u32* slot) {
    float v[64], amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; i++) {
        const float4 f = ((const float4*)slot)[i];
        v[4 * i] = f.x;
        v[4 * i + 1] = f.y;
        v[4 * i + 2] = f.z;
        v[4 * i + 3] = f.w;
    }
#pragma unroll
    for (int e = 0; e < 64; e++) amax = fmaxf(amax, fabsf(v[e]));
    const float id = amax > 0.0f ? 32767.0f / amax : 0.0f;
    int q[64];
#pragma unroll
    for (int e = 0; e < 64; e++) q[e] = (int)fminf(fmaxf(rintf(v[e] * id), -32767.0f), 32767.0f);
    u32 w[37];
    float dx = amax / 32767.0f;
    if (DT == DT_NVFP4) {
        dx *= 128.0f;
#pragma unroll
        for (int s = 0; s < 4; s++) {
            int sum = 0;
#pragma unroll
            for (int h = 0; h < 2; h++) {
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const int e = 16 * s + 4 * h + i;
                    w[8 * s + 4 * h + i] = g1_pair(q[e], q[e + 8]);
                    sum += q[e] + q[e + 8];
                }
            }
            w[32 + s] = (u32)(-128 * sum);
        }
    } else {
#pragma unroll
        for (int p = 0; p < 32; p++) w[p] = g1_pair(q[2 * p], q[2 * p + 1]);
#pragma unroll
        for (int s = 0; s < 4; s++) w[32 + s] = 0u;
    }
    w[36] = __float_as_uint(dx);
#pragma unroll
    for (int i = 0; i < 9; i++) ((uint4*)slot)[i] = make_uint4(w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]);
    slot[36] = w[36];
}

// out[m] = a row m . b for the rows [m0, m1) of this block (an even split over the grid); see
// above. `groups` groups of nu = k / 64 threads (the rest idle in the arithmetic), `rows_stage`
// rows a stage (a multiple of groups). P (sm_90+ only): the block's last warp, beyond the
// groups' threads, copies and adds up instead. Dynamic shared memory: S stages of rows_stage
// rows, then 2 (P: S + 1) x rp x nu partials (rp = rows_stage | 1: an odd stride between a row's
// partials keeps their stores and sums free of bank conflicts); the f32 activations are staged
// over the last stage and the partials before the loop (the host sizes it for the larger of the
// two).
template <int DT, int S, bool P>
__device__ __forceinline__ void gemv1_body(const Tensor& a, const Tensor& b, const Tensor& out, int groups, int rows_stage) {
    constexpr int UB = DT == DT_NVFP4 ? NVFP4_BYTES : 2 * Q8_0_BYTES;
    extern __shared__ __align__(16) char g1_shared[];
    const int tid = threadIdx.x, nt = blockDim.x;
    const int nu = (int)(a.ne[0] / 64), row_bytes = nu * UB, stage_bytes = rows_stage * row_bytes, rp = rows_stage | 1;
    const i64 rows = a.ne[1];
    const i64 m0 = (i64)blockIdx.x * rows / gridDim.x, m1 = ((i64)blockIdx.x + 1) * rows / gridDim.x;
    const int nst = (int)((m1 - m0 + rows_stage - 1) / rows_stage);
    float* parts = (float*)(g1_shared + S * stage_bytes);
    char* xf = g1_shared + (S - 1) * stage_bytes;
    const u32 ring = tc_smem(g1_shared);
    const char* src0 = a.data + m0 * row_bytes;
    auto stage_rows = [&](int s) { return (int)min((i64)rows_stage, m1 - m0 - (i64)s * rows_stage); };
#if __CUDA_ARCH__ >= 900
    // full barriers (stage s landed: bars + 8 (s % S)) and, with P, empty ones (every other
    // thread is done with stage s: empty + 8 (s % S))
    __shared__ __align__(8) u64 g1_bars[P ? 2 * S : S];
    const u32 bars = tc_smem(g1_bars), empty = bars + 8 * S;
    // Issuing a stage's copies holds the issuing thread for hundreds of cycles, so that thread is
    // the block's last: warp 0 also adds up partials, and as the copier it held every stage's
    // barrier (+2% on each 1-token GEMV of the perf catalogue on an H200; with the ring of 3 the
    // last thread alone cost nvfp4 at k = 17408 2%, which the L2 prefetch below wins back).
    const int copier = nt - 1;
    // Unless nvfp4 is bound by its arithmetic (the ring of 4: an H200), the copier also has L2
    // fetch each stage it copies in the loop, right after the copies, and stage S - 1 at the
    // start (its buffer holds the activations until they are quantized). Measured, mechanism not
    // isolated: 0-1% faster on each 1-token GEMV with the ring of 3 (H100), q8_0 at 5120 x 17408
    // 1.4% faster on an H200, nvfp4 there 3-10% slower. Issued before the copies the same
    // prefetch cost 5%, a stage ahead of them 5-11% (docs/PERF.md).
    constexpr bool l2_prefetch = !(DT == DT_NVFP4 && S == 4);
    // bulk path: the copier issues stage s (contiguous rows) in pieces of at most 32 KiB, all
    // completing on the buffer's barrier
    auto issue_bulk = [&](int s) {
        if (s >= nst) return;
        const u32 bytes = (u32)(stage_rows(s) * row_bytes), bar = bars + 8 * (s % S);
        const u32 dst = ring + (u32)((s % S) * stage_bytes);
        const char* src = src0 + (i64)s * stage_bytes;
        g1_bar_expect(bar, bytes);
        for (u32 o = 0; o < bytes; o += 32768u) g1_bulk(dst + o, src + o, min(bytes - o, 32768u), bar);
    };
    auto prefetch_l2 = [&](int s) {
        if (s >= nst) return;
        const u32 bytes = (u32)(stage_rows(s) * row_bytes);
        const char* src = src0 + (i64)s * stage_bytes;
        for (u32 o = 0; o < bytes; o += 32768u) g1_prefetch_l2(src + o, min(bytes - o, 32768u));
    };
#else
    // cp.async path: every thread copies 16-byte pieces, one commit group a stage
    auto issue = [&](int s) {
        if (s < nst) {
            const int n16 = stage_rows(s) * row_bytes / 16;
            const char* src = src0 + (i64)s * stage_bytes + 16 * tid;
            u32 dst = ring + (u32)((s % S) * stage_bytes) + 16 * tid;
#pragma unroll 4
            for (int c = tid; c < n16; c += nt, src += 16 * nt, dst += 16 * nt) tc_cp16_at(dst, src, true);
        }
        tc_commit();
    };
#endif

    // The activations as f32, unit j at xf + G1_XSTRIDE j: the first loads go out before the
    // first stages' copies (they are L2 hits that should not queue behind them).
    const bool vec = b.nb[0] == 4 && ((u64)b.data & 15) == 0;
    const int n4 = nu * 16;
    auto load_x = [&](int c) {
        if (vec) return ((const float4*)b.data)[c];
        const char* p = b.data + 4 * (i64)c * b.nb[0];
        return make_float4(*(const float*)p, *(const float*)(p + b.nb[0]), *(const float*)(p + 2 * b.nb[0]), *(const float*)(p + 3 * b.nb[0]));
    };
    float4 xv[8];
#pragma unroll
    for (int i = 0; i < 8; i++) {
        if (tid + i * nt < n4) xv[i] = load_x(tid + i * nt);
    }
#if __CUDA_ARCH__ >= 900
    if (tid == copier) {
#pragma unroll
        for (int i = 0; i < S; i++) {
            g1_bar_init(bars + 8 * i, 1);
            if (P) g1_bar_init(empty + 8 * i, nt - 32);
        }
        g1_fence_bar_init();
#pragma unroll
        for (int s = 0; s < S - 1; s++) issue_bulk(s);
        if constexpr (l2_prefetch) prefetch_l2(S - 1);
    }
#else
#pragma unroll
    for (int s = 0; s < S - 1; s++) issue(s);
#endif
    for (int c0 = tid; c0 < n4; c0 += 8 * nt) {
        if (c0 != tid) {
#pragma unroll
            for (int i = 0; i < 8; i++) {
                if (c0 + i * nt < n4) xv[i] = load_x(c0 + i * nt);
            }
        }
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int c = c0 + i * nt;
            if (c < n4) *(float4*)(xf + 16 * c + 16 * (c >> 4)) = xv[i];
        }
    }
    __syncthreads();
    const int g = tid / nu, j = tid - g * nu;
    const bool worker = g < groups;
    // 0, but opaque and per thread: or-ed into values that the compiler would otherwise copy from
    // a uniform register or negate before every use.
    const u32 zero = (u32)(rows_stage + tid) & 0x80000000u;
    // Group 0 quantizes each unit once, in place; then every group reads its unit's words.
    if (g == 0) g1_quantize_unit<DT>((u32*)(xf + G1_XSTRIDE * j));
    __syncthreads();
    u32 x[32];
    int cs[4] = {0, 0, 0, 0};
    float dx = 0.0f;
    if (worker) {
        const uint4* q = (const uint4*)(xf + G1_XSTRIDE * j);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const uint4 v = q[i];
            x[4 * i] = v.x;
            x[4 * i + 1] = v.y;
            x[4 * i + 2] = v.z;
            x[4 * i + 3] = v.w;
        }
        const uint4 t = q[8];
        if (DT == DT_NVFP4) {
            cs[0] = (int)t.x;
            cs[1] = (int)t.y;
            cs[2] = (int)t.z;
            cs[3] = (int)t.w;
        }
        dx = __uint_as_float(*(const u32*)(q + 9));
    }

    // Row r of stage s: its nu partials at parts[(s & 1) rp nu + i rp + r], unit i. L
    // consecutive threads add up a row (every L-th partial each, then shuffles). nvfp4 takes L
    // growing with nu, so that a few warps do the work in few instructions (16 or 32 threads a
    // row measured the same); q8_0, bound by the copies, takes a warp a row, so that no warp lags
    // behind to the barrier that frees the next buffer (H100: L = 8 cost q8_0 1-2% of copy
    // bandwidth).
    const int lg = DT == DT_Q8_0 ? 5 : nu <= 40 ? 2 : nu <= 80 ? 3 : nu <= 160 ? 4 : 5, L = 1 << lg, sub = tid & (L - 1);
    const int row_step = nt >> lg, warp_rows = 32 >> lg;
    auto reduce = [&](int s) {
        const float* p = parts + (s & 1) * rp * nu;
        const int n = stage_rows(s), n_warps = (n + warp_rows - 1) & -warp_rows;
        // whole warps take part in the shuffles
        for (int r = tid >> lg; r < n_warps; r += row_step) {
            float v0 = 0.0f, v1 = 0.0f;
            if (r < n) {
                int i = sub;
                for (; i + L < nu; i += 2 * L) {
                    v0 += p[i * rp + r];
                    v1 += p[(i + L) * rp + r];
                }
                if (i < nu) v0 += p[i * rp + r];
            }
            float v = v0 + v1;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                if (o < L) v += __shfl_xor_sync(0xffffffffu, v, o);
            }
            if (sub == 0 && r < n) *(float*)(out.data + offset_of(out, m0 + (i64)s * rows_stage + r, 0, 0, 0)) = v;
        }
    };
    const u32 e2m1_lo = G1_E2M1_LO | zero;
    // this thread's dots of stage s, partials into p
    auto dots = [&](int s, float* p) {
        if (!worker) return;
        const char* sb = g1_shared + (s % S) * stage_bytes;
        const int n = stage_rows(s);
        if (DT == DT_NVFP4) {
            // two rows at a time: two independent units for the scheduler to interleave
            for (int r = g; r < n; r += 2 * groups) {
                const u32* w = (const u32*)(sb + r * row_bytes + UB * j);
                float v[2];
                if (r + groups < n) {
                    g1_units_nvfp4<2>(w, groups * row_bytes / 4, x, cs, e2m1_lo, v);
                    p[j * rp + r + groups] = dx * v[1];
                } else {
                    g1_units_nvfp4<1>(w, 0, x, cs, e2m1_lo, v);
                }
                p[j * rp + r] = dx * v[0];
            }
        } else {
            for (int r = g; r < n; r += groups) p[j * rp + r] = dx * g1_unit_q8_0((const u32*)(sb + r * row_bytes + UB * j), x);
        }
    };
#if __CUDA_ARCH__ >= 900
    if constexpr (P) {
        // No block barrier in the loop: the others wait for their stage's copy, take their dots
        // and arrive on its empty barrier; the last warp waits for that, refills the buffer, then
        // adds up the stage. Stage s's partials go to buffer s % (S + 1): the stage that reuses
        // it, s + S + 1, is copied after the last warp added up stage s.
        __syncthreads();  // the activations are in registers: the last stage's buffer is free
        const bool producer = tid >= nt - 32;
        const int lane = tid & 31;
        // L lanes a row, every row of a stage at once. Not `reduce` with the lane for tid: one
        // lambda for both cost this kernel 7% (4 chains) and 21% (reduce's 2) on an H200.
        const int lg = max(0, 5 - (32 - __clz(rows_stage - 1))), L = 1 << lg, sub = lane & (L - 1);
        auto sum_stage = [&](int s) {
            const float* p = parts + (s % (S + 1)) * rp * nu;
            const int n = stage_rows(s);
            for (int r0 = 0; r0 < n; r0 += 32 >> lg) {
                const int r = r0 + (lane >> lg);
                float v0 = 0.0f, v1 = 0.0f, v2 = 0.0f, v3 = 0.0f;
                if (r < n) {
                    int i = sub;
                    for (; i + 3 * L < nu; i += 4 * L) {
                        v0 += p[i * rp + r];
                        v1 += p[(i + L) * rp + r];
                        v2 += p[(i + 2 * L) * rp + r];
                        v3 += p[(i + 3 * L) * rp + r];
                    }
                    for (; i < nu; i += L) v0 += p[i * rp + r];
                }
                float v = (v0 + v1) + (v2 + v3);
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) {
                    if (o < L) v += __shfl_xor_sync(0xffffffffu, v, o);
                }
                if (sub == 0 && r < n) *(float*)(out.data + offset_of(out, m0 + (i64)s * rows_stage + r, 0, 0, 0)) = v;
            }
        };
        auto wait_free = [&](int s) { g1_bar_wait(empty + 8 * (s % S), (u32)(s / S) & 1u); };
        for (int s = 0; s < nst; s++) {
            if (producer) {
                if (s > 0) wait_free(s - 1);
                if (tid == copier) {
                    tc_fence_async();
                    issue_bulk(s + S - 1);
                    if (l2_prefetch && s > 0) prefetch_l2(s + S - 1);
                }
                __syncwarp();
                if (s > 0) sum_stage(s - 1);
            } else {
                g1_bar_wait(bars + 8 * (s % S), (u32)(s / S) & 1u);  // stage s landed
                dots(s, parts + (s % (S + 1)) * rp * nu);
                g1_bar_arrive(empty + 8 * (s % S));
            }
        }
        if (producer && nst > 0) {
            wait_free(nst - 1);
            sum_stage(nst - 1);
        }
    } else
#endif
    {
        // one block barrier a stage
        for (int s = 0; s < nst; s++) {
#if __CUDA_ARCH__ >= 900
            __syncthreads();  // stage s - 1's buffer and partials are free
            if (tid == copier) {
                tc_fence_async();
                issue_bulk(s + S - 1);
                if (l2_prefetch && s > 0) prefetch_l2(s + S - 1);
            }
            if (s > 0) reduce(s - 1);
            g1_bar_wait(bars + 8 * (s % S), (u32)(s / S) & 1u);  // stage s landed
#else
            tc_wait<S - 2>();
            // stage s landed for every thread; stage s - 1's buffer and partials are free
            __syncthreads();
            issue(s + S - 1);
            if (s > 0) reduce(s - 1);
#endif
            dots(s, parts + (s & 1) * rp * nu);
        }
        __syncthreads();
        if (nst > 0) reduce(nst - 1);
    }
}

#define G1_ENTRY(NAME, DT, S, P, THREADS)                                                              \
    extern "C" __global__ void __launch_bounds__(THREADS) NAME(Tensor a, Tensor b, Tensor out, int groups, \
                                                                int rows_stage) {                        \
        l2_prefetch_rows(a, DT, (i64)blockIdx.x * a.ne[1] / gridDim.x, a.ne[1] / gridDim.x + 1);         \
        grid_begin();                                                                                    \
        gemv1_body<DT, S, P>(a, b, out, groups, rows_stage);                                             \
    }
G1_ENTRY(gemv1_q8_0_s3, DT_Q8_0, 3, false, G1_MAX_THREADS)
G1_ENTRY(gemv1_q8_0_s4, DT_Q8_0, 4, false, G1_MAX_THREADS)
G1_ENTRY(gemv1_nvfp4_s3, DT_NVFP4, 3, false, G1_MAX_THREADS_NVFP4)
G1_ENTRY(gemv1_nvfp4_s4, DT_NVFP4, 4, false, G1_MAX_THREADS_NVFP4)
// taken on sm_90+ with the ring of 4 only (before sm_90 it is the entry above)
G1_ENTRY(gemv1_nvfp4_producer_s4, DT_NVFP4, 4, true, G1_MAX_THREADS_NVFP4)

// ---------------------------------------------------------------------------------------------
// Word GEMVs for f16 / bf16 rows (1 token, one weight matrix, rows of 16-byte aligned whole
// words of 8 values, at most WORDS words a thread): thread t owns words t + blockDim.x j of every
// row and their 8 f32 activations (packed by `pack_b`) in registers; a step takes R rows, the
// next step's loads issued before this step's arithmetic and reduction. `gemv_*w`: 2 words a
// thread, GW_R rows a step, up to GW_MAX_THREADS threads; `gemv_*w_long`: 5 words, 2 rows, up to
// GH_LONG_THREADS threads (the register budget of 40 activations and 2 x 10 words in flight).
#define GW_R 4
#define GW_MAX_THREADS 512
#define GH_LONG_THREADS 448

__device__ __forceinline__ uint4 ldg_nc_v4(const void* p) {
    uint4 v;
    asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// w's 8 halves (type DT) . x[0..7].
template <int DT>
__device__ __forceinline__ float dot_half8(uint4 w, const float* x) {
    const u32 q[4] = {w.x, w.y, w.z, w.w};
    float v = 0.0f;
#pragma unroll
    for (int c = 0; c < 4; c++) {
        const float lo = DT == DT_F16 ? f16_to_f32((u16)(q[c] & 0xffff)) : __uint_as_float(q[c] << 16);
        const float hi = DT == DT_F16 ? f16_to_f32((u16)(q[c] >> 16)) : __uint_as_float(q[c] & 0xffff0000u);
        v = fmaf(lo, x[2 * c], fmaf(hi, x[2 * c + 1], v));
    }
    return v;
}

template <int DT, int WORDS, int R>
__device__ __forceinline__ void gemv_half_words(Tensor a, const float* x, Tensor out) {
    __shared__ float red[GW_MAX_THREADS / 32][R];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, nt = (int)blockDim.x;
    const i64 rows = a.ne[1];
    const int words = (int)(a.ne[0] / 8);
    float xr[WORDS][8];
    bool live[WORDS];
#pragma unroll
    for (int j = 0; j < WORDS; j++) {
        const int w = tid + nt * j;
        live[j] = w < words;
#pragma unroll
        for (int e = 0; e < 8; e++) xr[j][e] = live[j] ? x[8 * w + e] : 0.0f;
    }
    const i64 stride = (i64)gridDim.x * R;
    i64 m0 = (i64)blockIdx.x * R;
    uint4 next[R][WORDS];
    auto load = [&](i64 m) {
#pragma unroll
        for (int r = 0; r < R; r++) {
            const char* rp = a.data + min(m + r, rows - 1) * a.nb[1];
#pragma unroll
            for (int j = 0; j < WORDS; j++) next[r][j] = live[j] ? ldg_nc_v4(rp + 16 * (tid + nt * j)) : make_uint4(0u, 0u, 0u, 0u);
        }
    };
    if (m0 < rows) load(m0);
    for (; m0 < rows; m0 += stride) {
        uint4 cur[R][WORDS];
#pragma unroll
        for (int r = 0; r < R; r++) {
#pragma unroll
            for (int j = 0; j < WORDS; j++) cur[r][j] = next[r][j];
        }
        if (m0 + stride < rows) load(m0 + stride);
#pragma unroll
        for (int r = 0; r < R; r++) {
            float v = 0.0f;
#pragma unroll
            for (int j = 0; j < WORDS; j++) v += dot_half8<DT>(cur[r][j], xr[j]);
            v = warp_sum(v);
            if (lane == 0) red[warp][r] = v;
        }
        __syncthreads();
        if (tid < R && m0 + tid < rows) {
            float v = 0.0f;
            for (int i = 0; i < nt >> 5; i++) v += red[i][tid];
            *(float*)(out.data + offset_of(out, m0 + tid, 0, 0, 0)) = v;
        }
        __syncthreads();
    }
}

extern "C" __global__ void __launch_bounds__(GW_MAX_THREADS) gemv_f16w(Tensor a, const float* x, Tensor out) {
    grid_begin();
    gemv_half_words<DT_F16, 2, GW_R>(a, x, out);
}
extern "C" __global__ void __launch_bounds__(GW_MAX_THREADS) gemv_bf16w(Tensor a, const float* x, Tensor out) {
    grid_begin();
    gemv_half_words<DT_BF16, 2, GW_R>(a, x, out);
}
extern "C" __global__ void __launch_bounds__(GH_LONG_THREADS) gemv_f16w_long(Tensor a, const float* x, Tensor out) {
    grid_begin();
    gemv_half_words<DT_F16, 5, 2>(a, x, out);
}
extern "C" __global__ void __launch_bounds__(GH_LONG_THREADS) gemv_bf16w_long(Tensor a, const float* x, Tensor out) {
    grid_begin();
    gemv_half_words<DT_BF16, 5, 2>(a, x, out);
}

// mul_mat_id_weighted_sum for a few tokens: block (x, t) runs the rows x * 4 .. + 3 (a warp each)
// of every slot u of token t, out[m, t] = sum_u w[0, u, t] * (expert ids[u, t] row m . activation
// row (u mod n_b) + n_b t), the activations as `moe_decode` reads them. The slots go 4 at a time
// with their loads in flight; a bad id is reported (block 0) and its slot skipped.
#define MDS_SLOTS 4
extern "C" __global__ void __launch_bounds__(GF_THREADS) moe_decode_sum(Tensor as, int adt, const char* x, i64 ldx, i64 n_b, Tensor ids, Tensor w, Tensor out, u64 err, u32 op) {
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
