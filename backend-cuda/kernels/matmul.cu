// matmul.cu: mul_mat and mul_mat_id.
//
// - `pack_b` copies the f32 activations (any strides) into packed rows of `ldb` elements in
//   scratch, as f32, or as f16 / bf16 (bf16 optionally split into hi + lo parts) for cuBLAS.
// - `gemv_{1,2,4,8}`: one warp per weight row, all tokens of a pass (up to NT) per weight read,
//   f32 accumulation; passes loop over the tokens, so `gemv_8` is also the general path.
//   Plain weights stream through 16-byte loads; q8_0 / nvfp4 rows are staged 32 blocks at a
//   time through shared memory with 16-byte loads and decoded from there, one block per lane.
// - `quant_x` + `gemv_fast_{1,2,4,8}`: the decode GEMV for aligned q8_0 / nvfp4 rows (and few
//   long f16 / bf16 rows), one block per weight row, units loaded straight from global memory,
//   int8 weights times int16 activations through dp4a; `moe_decode`: the same units over the
//   routed (slot, token) pairs of mul_mat_id with few tokens (see "Fast decode GEMV" below).
// - `quant_x32` + `gemv_q8w` / `gemv_f4w`: the 1-token GEMV for q8_0 / nvfp4 rows of whole
//   16-byte words, a thread per word with its activations in registers; `pack_b` +
//   `gemv_f16w` / `gemv_bf16w[_long]`: the same for f16 / bf16 rows, 2 or 5 words a thread
//   (see the end).
// - `dequant_rows` converts rows of one weight matrix to bf16 (hi, and lo = the rounding
//   remainder) for the cuBLAS path of quantized weights with many tokens.
// - `moe_group` groups the (slot, token) pairs of mul_mat_id by expert on the device (counts,
//   prefix sum, lists), checking every id; `moe_gemv` runs the rows of each expert with few
//   pairs over them 8 at a time, `moe_gemm` (shared-memory tiles, f32 FMA) the busy experts.

#define MM_WARPS 4
// moe_gemm tile: weight rows x pairs x k step (256 threads, 4 x 2 outputs each).
#define MT_M 64
#define MT_N 32
#define MT_K 32
// Per-warp staging: 32 blocks of the largest block type (nvfp4, 36 bytes).
#define STAGE_CHUNKS (32 * NVFP4_BYTES / 16)

extern "C" __global__ void pack_b(Tensor b, float* f32_out, u16* hi_out, u16* lo_out, int half_dt, i64 ldb) {
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

// One block: groups the pairs s = u + n_used * t of ids [n_used, T] by expert. offsets[e] ..
// offsets[e + 1] index list[] (the pairs of expert e, in no particular order); cursor has
// n_expert ints of scratch. Bad ids are reported and their pairs dropped.
extern "C" __global__ void moe_group(Tensor ids, i64 n_expert, int* offsets, int* cursor, int* list, u64 err, u32 op) {
    const i64 n_used = ids.ne[0], n_pairs = ids.ne[0] * ids.ne[1];
    for (i64 e = threadIdx.x; e < n_expert; e += blockDim.x) cursor[e] = 0;
    __syncthreads();
    for (i64 s = threadIdx.x; s < n_pairs; s += blockDim.x) {
        const int id = *(const int*)(ids.data + (s % n_used) * ids.nb[0] + (s / n_used) * ids.nb[1]);
        if (id < 0 || id >= n_expert) {
            report_error((ErrorRecord*)err, ERR_INDEX_OUT_OF_RANGE, WHAT_EXPERT_ID, op, id, n_expert, 0, 0);
        } else {
            atomicAdd(&cursor[id], 1);
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int acc = 0;
        for (i64 e = 0; e < n_expert; e++) {
            offsets[e] = acc;
            acc += cursor[e];
            cursor[e] = 0;
        }
        offsets[n_expert] = acc;
    }
    __syncthreads();
    for (i64 s = threadIdx.x; s < n_pairs; s += blockDim.x) {
        const int id = *(const int*)(ids.data + (s % n_used) * ids.nb[0] + (s / n_used) * ids.nb[1]);
        if (id >= 0 && id < n_expert) list[offsets[id] + atomicAdd(&cursor[id], 1)] = (int)s;
    }
}

// out[:, u, t] = as[:, :, e]^T b[:, u mod n_b, t] for the pairs of expert e = blockIdx.y; bp is
// the packed activations (row (u mod n_b) + n_b * t at row * ldb). Each warp is one weight row
// and runs over the expert's pairs 8 at a time.
extern "C" __global__ void __launch_bounds__(MM_WARPS * 32) moe_gemv(Tensor as, int adt, const float* bp, i64 ldb, i64 n_b, i64 n_used, const int* offsets, const int* list, Tensor out, int vec, int gemv_max) {
    __shared__ uint4 stage[MM_WARPS][STAGE_CHUNKS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const i64 m = (i64)blockIdx.x * MM_WARPS + warp, e = blockIdx.y;
    if (m >= as.ne[1]) return;
    const int begin = offsets[e], end = offsets[e + 1];
    if (end - begin > gemv_max) return;  // moe_gemm's
    const char* row = as.data + m * as.nb[1] + e * as.nb[2];
    for (int c = begin; c < end; c += 8) {
        const int nt = min(8, end - c);
        const float* bt[8];
        i64 slot[8];
#pragma unroll
        for (int t = 0; t < 8; t++) {
            const i64 s = list[c + min(t, nt - 1)], u = s % n_used, tok = s / n_used;
            slot[t] = s;
            bt[t] = bp + ((u % n_b) + n_b * tok) * ldb;
        }
        float acc[8];
        warp_dot<8>(row, adt, as.ne[0], bt, acc, stage[warp], vec != 0, 0, 1);
#pragma unroll
        for (int t = 0; t < 8; t++) {
            const float v = warp_sum(acc[t]);
            if (lane == 0 && t < nt) *(float*)(out.data + offset_of(out, m, slot[t] % n_used, slot[t] / n_used, 0)) = v;
        }
    }
}

// The experts with more than gemv_max pairs: grid (ceil(M / MT_M), n_expert), 256 threads;
// each block runs its MT_M weight rows over the expert's pairs MT_N at a time, with weight
// tiles decoded to f32 and activation tiles gathered through shared memory.
extern "C" __global__ void __launch_bounds__(256) moe_gemm(Tensor as, int adt, const float* bp, i64 ldb, i64 n_b, i64 n_used, const int* offsets, const int* list, Tensor out, int gemv_max) {
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
// gemv_fast: one block of GF_THREADS threads per weight row; the threads stride over the row in units of
// 16 values (q8_0: half a block, 17 bytes; nvfp4: one 16-value sub-block, 8.5 bytes; f16 / bf16:
// 8 values, 16 bytes), GF_UNITS units loaded straight from global memory before any is used, then
// a block reduction. Quantized weights multiply int16 activations split in two int8 halves
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

// acc[t] += unit u's values . activation row t.
template <int NT>
__device__ __forceinline__ void gf_dot(const GfRaw& r, int dt, i64 u, const char* const* xt, const float* const* st, float* acc) {
    if (dt == DT_Q8_0 || dt == DT_NVFP4) {
        int w[4];
        float dw;
        if (dt == DT_Q8_0) {
            const u32 s = (r.sc & 0x10000u) ? 0x5432u : 0x3210u;
            w[0] = (int)__byte_perm(r.w.x, r.w.y, s);
            w[1] = (int)__byte_perm(r.w.y, r.w.z, s);
            w[2] = (int)__byte_perm(r.w.z, r.w.w, s);
            w[3] = (int)__byte_perm(r.w.w, r.w4, s);
            dw = f16_to_f32((u16)(r.sc & 0xffff));
        } else {
            const int2 a = e2m1x8_i8(r.w.x), b = e2m1x8_i8(r.w.y);
            w[0] = a.x;
            w[1] = b.x;
            w[2] = a.y;
            w[3] = b.y;
            dw = 0.5f * ue4m3_fast(r.sc);
        }
#pragma unroll
        for (int t = 0; t < NT; t++) {
            const uint4 h = ((const uint4*)xt[t])[2 * u], l = ((const uint4*)xt[t])[2 * u + 1];
            const int ih = dp4a(w[3], (int)h.w, dp4a(w[2], (int)h.z, dp4a(w[1], (int)h.y, dp4a(w[0], (int)h.x, 0))));
            const int il = dp4a(w[3], (int)l.w, dp4a(w[2], (int)l.z, dp4a(w[1], (int)l.y, dp4a(w[0], (int)l.x, 0))));
            acc[t] += (float)(ih * 256 + il) * (dw * st[t][u]);
        }
    } else {
        const float4 w0 = make_float4(half_lo(r.w.x, dt), half_hi(r.w.x, dt), half_lo(r.w.y, dt), half_hi(r.w.y, dt));
        const float4 w1 = make_float4(half_lo(r.w.z, dt), half_hi(r.w.z, dt), half_lo(r.w.w, dt), half_hi(r.w.w, dt));
#pragma unroll
        for (int t = 0; t < NT; t++) {
            const float4* x = (const float4*)xt[t] + 2 * u;
            acc[t] += dot4(w0, x[0]) + dot4(w1, x[1]);
        }
    }
}

// acc[t] += units gl, gl + g, ... of a weight row . activation row t, U units loaded at a time.
template <int NT>
__device__ __forceinline__ void gf_row(const char* row, int adt, i64 nu, int gl, int g, const char* const* xt, const float* const* st, float* acc) {
    constexpr int U = GF_UNITS;
    for (i64 u0 = gl; u0 < nu; u0 += U * g) {
        GfRaw raw[U];
#pragma unroll
        for (int i = 0; i < U; i++) {
            if (u0 + i * g < nu) raw[i] = gf_load(row, adt, u0 + i * g);
        }
#pragma unroll
        for (int i = 0; i < U; i++) {
            if (u0 + i * g < nu) gf_dot<NT>(raw[i], adt, u0 + i * g, xt, st, acc);
        }
    }
}

// out[m, n, i2, i3] = a row m (of batch (i2 / (b2 / A2), i3 / (b3 / A3))) . activation rows;
// one block per weight row, grid (M, batches). x: the activation rows at x + row * ldx (bytes);
// quantized weights: the `quant_x` rows (ldx = 2 k), their scales after them from the next
// 256-byte boundary; f16 / bf16: packed f32 rows.
template <int NT>
__device__ __forceinline__ void gemv_fast_body(Tensor a, int adt, const char* x, i64 ldx, i64 n, i64 b2, i64 b3, Tensor out) {
    __shared__ float red[GF_THREADS / 32][NT];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const i64 m = blockIdx.x, k = a.ne[0];
    const i64 nu = (adt == DT_Q8_0 || adt == DT_NVFP4) ? k / 16 : k / 8;
    const float* xs = (const float*)(x + ((n * b2 * b3 * ldx + 255) & ~(i64)255));
    for (i64 batch = blockIdx.y; batch < b2 * b3; batch += gridDim.y) {
        const i64 i2 = batch % b2, i3 = batch / b2;
        const i64 a2 = i2 / (b2 / a.ne[2]), a3 = i3 / (b3 / a.ne[3]);
        const char* row = a.data + m * a.nb[1] + a2 * a.nb[2] + a3 * a.nb[3];
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
            float acc[NT];
#pragma unroll
            for (int t = 0; t < NT; t++) acc[t] = 0.0f;
            gf_row<NT>(row, adt, nu, tid, GF_THREADS, xt, st, acc);
#pragma unroll
            for (int t = 0; t < NT; t++) {
                const float v = warp_sum(acc[t]);
                if (lane == 0) red[warp][t] = v;
            }
            __syncthreads();
            if (tid < nt) {
                float v = 0.0f;
#pragma unroll
                for (int w = 0; w < GF_THREADS / 32; w++) v += red[w][tid];
                *(float*)(out.data + offset_of(out, m, n0 + tid, i2, i3)) = v;
            }
            __syncthreads();
        }
    }
}

extern "C" __global__ void __launch_bounds__(GF_THREADS) gemv_fast_1(Tensor a, int adt, const char* x, i64 ldx, i64 n, i64 b2, i64 b3, Tensor out) {
    gemv_fast_body<1>(a, adt, x, ldx, n, b2, b3, out);
}
extern "C" __global__ void __launch_bounds__(GF_THREADS) gemv_fast_2(Tensor a, int adt, const char* x, i64 ldx, i64 n, i64 b2, i64 b3, Tensor out) {
    gemv_fast_body<2>(a, adt, x, ldx, n, b2, b3, out);
}
extern "C" __global__ void __launch_bounds__(GF_THREADS) gemv_fast_4(Tensor a, int adt, const char* x, i64 ldx, i64 n, i64 b2, i64 b3, Tensor out) {
    gemv_fast_body<4>(a, adt, x, ldx, n, b2, b3, out);
}
extern "C" __global__ void __launch_bounds__(GF_THREADS) gemv_fast_8(Tensor a, int adt, const char* x, i64 ldx, i64 n, i64 b2, i64 b3, Tensor out) {
    gemv_fast_body<8>(a, adt, x, ldx, n, b2, b3, out);
}

extern "C" __global__ void __launch_bounds__(MM_WARPS * 32) gemv_1(Tensor a, int adt, const float* bp, i64 ldb, i64 n, i64 b2, i64 b3, Tensor out, int vec, int parts) {
    gemv_body<1>(a, adt, bp, ldb, n, b2, b3, out, vec, parts);
}
extern "C" __global__ void __launch_bounds__(MM_WARPS * 32) gemv_2(Tensor a, int adt, const float* bp, i64 ldb, i64 n, i64 b2, i64 b3, Tensor out, int vec, int parts) {
    gemv_body<2>(a, adt, bp, ldb, n, b2, b3, out, vec, parts);
}
extern "C" __global__ void __launch_bounds__(MM_WARPS * 32) gemv_4(Tensor a, int adt, const float* bp, i64 ldb, i64 n, i64 b2, i64 b3, Tensor out, int vec, int parts) {
    gemv_body<4>(a, adt, bp, ldb, n, b2, b3, out, vec, parts);
}
extern "C" __global__ void __launch_bounds__(MM_WARPS * 32) gemv_8(Tensor a, int adt, const float* bp, i64 ldb, i64 n, i64 b2, i64 b3, Tensor out, int vec, int parts) {
    gemv_body<8>(a, adt, bp, ldb, n, b2, b3, out, vec, parts);
}

// mul_mat_id decode: block (x, s) runs the rows x * 4 .. + 3 (a warp each) of the expert of pair
// s = u + n_used * t only, against activation row (u mod n_b) + n_b * t of `quant_x` (quantized
// weights, scales after the rows at the next 256-byte boundary) or packed f32 rows; a bad id is
// reported and its pair skipped.
extern "C" __global__ void __launch_bounds__(GF_THREADS) moe_decode(Tensor as, int adt, const char* x, i64 ldx, i64 n_b, Tensor ids, Tensor out, u64 err, u32 op) {
    const i64 n_used = ids.ne[0], s = blockIdx.y, u = s % n_used, t = s / n_used;
    const int id = *(const int*)(ids.data + u * ids.nb[0] + t * ids.nb[1]);
    if (id < 0 || id >= as.ne[2]) {
        if (blockIdx.x == 0 && threadIdx.x == 0) report_error((ErrorRecord*)err, ERR_INDEX_OUT_OF_RANGE, WHAT_EXPERT_ID, op, id, as.ne[2], 0, 0);
        return;
    }
    const int lane = threadIdx.x & 31;
    const i64 m = (i64)blockIdx.x * (GF_THREADS / 32) + (threadIdx.x >> 5), k = as.ne[0];
    if (m >= as.ne[1]) return;
    const i64 nu = (adt == DT_Q8_0 || adt == DT_NVFP4) ? k / 16 : k / 8;
    const i64 r = u % n_b + n_b * t;
    const float* xs = (const float*)(x + ((n_b * ids.ne[1] * ldx + 255) & ~(i64)255));
    const char* xt[1] = {x + r * ldx};
    const float* st[1] = {xs + r * (k / 16)};
    float acc[1] = {0.0f};
    gf_row<1>(as.data + m * as.nb[1] + id * as.nb[2], adt, nu, lane, 32, xt, st, acc);
    const float v = warp_sum(acc[0]);
    if (lane == 0) *(float*)(out.data + offset_of(out, m, u, t, 0)) = v;
}

// ---------------------------------------------------------------------------------------------
// q8_0 decode GEMV over whole 16-byte words (1 token, one weight matrix, rows of k % 256 == 0
// values, so 34-byte blocks fill whole 16-byte words, and at most GW_MAX_THREADS words a row).
//
// Thread t of a block owns word t of every weight row; as all rows share one layout, the
// activations of the word's bytes are built once per block, in registers, byte-aligned with the
// word: int16 values (`quant_x32`, one scale per 32 values) split into int8 hi / lo quads, zero at
// the scale bytes, apart for block A (the one the word starts in) and B (the next). A step takes
// GW_R rows: one 16-byte load per row (a warp reads 512 contiguous bytes) plus the two blocks' f16
// scales, 16 dp4a per row, one block reduction for the GW_R sums; the next step's loads are
// issued before this step's arithmetic and reduction.

#define GW_R 4
#define GW_MAX_THREADS 512

__device__ __forceinline__ uint4 ldg_nc_v4(const void* p) {
    uint4 v;
    asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// Activation row r of b (k values) as int16 at xq + r * k and one f32 scale per 32 values at
// xs + r * k / 32 (|x - d x_q| <= amax / 65278). One thread per 32 values.
extern "C" __global__ void quant_x32(Tensor b, short* xq, float* xs) {
    const i64 k = b.ne[0], nbk = k / 32, total = nbk * (nelements(b) / k);
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        const i64 r = i / nbk, j = i % nbk;
        i64 i1, i2, i3;
        row_coords(b, r, i1, i2, i3);
        const char* src = b.data + i1 * b.nb[1] + i2 * b.nb[2] + i3 * b.nb[3] + 32 * j * b.nb[0];
        float v[32], amax = 0.0f;
#pragma unroll
        for (int e = 0; e < 32; e++) {
            v[e] = *(const float*)(src + e * b.nb[0]);
            amax = fmaxf(amax, fabsf(v[e]));
        }
        const float id = amax > 0.0f ? XQ_MAX / amax : 0.0f;
        u32 q[16];
#pragma unroll
        for (int e = 0; e < 16; e++) {
            const int q0 = (int)fminf(fmaxf(rintf(v[2 * e] * id), -XQ_MAX), XQ_MAX);
            const int q1 = (int)fminf(fmaxf(rintf(v[2 * e + 1] * id), -XQ_MAX), XQ_MAX);
            q[e] = ((u32)q0 & 0xffffu) | ((u32)q1 << 16);
        }
        uint4* dst = (uint4*)(xq + r * k + 32 * j);
#pragma unroll
        for (int e = 0; e < 4; e++) dst[e] = make_uint4(q[4 * e], q[4 * e + 1], q[4 * e + 2], q[4 * e + 3]);
        xs[r * nbk + j] = amax / XQ_MAX;
    }
}

// One step's weights: word `w` of rows m0 .. m0 + GW_R - 1 (clamped to the last row) and the
// scales of its blocks A (at byte oa) and B (`bsz` bytes on): q8_0's f16, nvfp4's scale word.
struct GwRaw {
    uint4 v[GW_R];
    u32 da[GW_R], db[GW_R];
};

__device__ __forceinline__ void gw_load(GwRaw& raw, const Tensor& a, i64 m0, int w, int oa, bool live, bool has_b, int bsz) {
#pragma unroll
    for (int r = 0; r < GW_R; r++) {
        const char* rp = a.data + min(m0 + r, a.ne[1] - 1) * a.nb[1];
        raw.v[r] = live ? ldg_nc_v4(rp + 16 * w) : make_uint4(0u, 0u, 0u, 0u);
        if (bsz == Q8_0_BYTES) {
            raw.da[r] = live ? *(const u16*)(rp + oa) : 0u;
            raw.db[r] = has_b ? *(const u16*)(rp + oa + bsz) : 0u;
        } else {
            raw.da[r] = live ? *(const u32*)(rp + oa) : 0u;
            raw.db[r] = has_b ? *(const u32*)(rp + oa + bsz) : 0u;
        }
    }
}

__device__ __forceinline__ int dp4a_x4(uint4 v, const u32* x) {
    return dp4a((int)v.w, (int)x[3], dp4a((int)v.z, (int)x[2], dp4a((int)v.y, (int)x[1], dp4a((int)v.x, (int)x[0], 0))));
}

// out[m] = a row m . x for a: [k, M] q8_0 (rows 16-byte aligned, k % 256 == 0, k / 32 * 34 / 16
// <= blockDim.x words) and one activation row x (`quant_x32`: xq, xs). Grid-stride over GW_R
// rows a step.
extern "C" __global__ void __launch_bounds__(GW_MAX_THREADS) gemv_q8w(Tensor a, const short* xq, const float* xs, Tensor out) {
    __shared__ float red[GW_MAX_THREADS / 32][GW_R];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const i64 rows = a.ne[1];
    const int nblk = (int)(a.ne[0] / QK8_0), words = nblk * Q8_0_BYTES / 16;
    const int w = tid, ba = 16 * w / Q8_0_BYTES, oa = ba * Q8_0_BYTES;
    const bool live = w < words, has_b = live && ba + 1 < nblk && 16 * w + 15 >= oa + Q8_0_BYTES + 2;
    const float sa = live ? xs[ba] : 0.0f, sb = has_b ? xs[ba + 1] : 0.0f;
    u32 ha[4], la[4], hb[4], lb[4];
#pragma unroll
    for (int c = 0; c < 4; c++) ha[c] = la[c] = hb[c] = lb[c] = 0u;
#pragma unroll
    for (int i = 0; i < 16; i++) {
        const int o = 16 * w + i, bi = o / Q8_0_BYTES, p = o - bi * Q8_0_BYTES;
        const int q = live && p >= 2 ? (int)xq[bi * QK8_0 + p - 2] : 0;
        const int h = (q + 128) >> 8, l = q - 256 * h;
        const u32 hv = (u32)(h & 0xff) << (8 * (i & 3)), lv = (u32)(l & 0xff) << (8 * (i & 3));
        if (bi == ba) {
            ha[i >> 2] |= hv;
            la[i >> 2] |= lv;
        } else {
            hb[i >> 2] |= hv;
            lb[i >> 2] |= lv;
        }
    }
    const i64 stride = (i64)gridDim.x * GW_R;
    i64 m0 = (i64)blockIdx.x * GW_R;
    GwRaw next;
    if (m0 < rows) gw_load(next, a, m0, w, oa, live, has_b, Q8_0_BYTES);
    for (; m0 < rows; m0 += stride) {
        const GwRaw cur = next;
        if (m0 + stride < rows) gw_load(next, a, m0 + stride, w, oa, live, has_b, Q8_0_BYTES);
#pragma unroll
        for (int r = 0; r < GW_R; r++) {
            const float va = (float)(dp4a_x4(cur.v[r], ha) * 256 + dp4a_x4(cur.v[r], la)) * (f16_to_f32((u16)cur.da[r]) * sa);
            const float vb = (float)(dp4a_x4(cur.v[r], hb) * 256 + dp4a_x4(cur.v[r], lb)) * (f16_to_f32((u16)cur.db[r]) * sb);
            const float v = warp_sum(va + vb);
            if (lane == 0) red[warp][r] = v;
        }
        __syncthreads();
        if (tid < GW_R && m0 + tid < rows) {
            float v = 0.0f;
            for (int i = 0; i < (int)(blockDim.x >> 5); i++) v += red[i][tid];
            *(float*)(out.data + offset_of(out, m0 + tid, 0, 0, 0)) = v;
        }
        __syncthreads();
    }
}

// `gemv_q8w` for nvfp4 rows (k % 256 == 0: 36-byte blocks fill whole words). Every 4-byte piece
// of a word lies in one block's scale word (zero activations) or in one half of a 16-value
// sub-block s: its low nibbles are values 16 s + 4 h + 0..3, its high nibbles 16 s + 8 + 4 h +
// 0..3. Per piece: int8 hi / lo activation quads for both nibble sets, the activation scale and
// which scale byte (block A's or B's scale word, byte s) applies.
extern "C" __global__ void __launch_bounds__(GW_MAX_THREADS) gemv_f4w(Tensor a, const short* xq, const float* xs, Tensor out) {
    __shared__ float red[GW_MAX_THREADS / 32][GW_R];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const i64 rows = a.ne[1];
    const int nblk = (int)(a.ne[0] / QK_NVFP4), words = nblk * NVFP4_BYTES / 16;
    const int w = tid, ba = 16 * w / NVFP4_BYTES, oa = ba * NVFP4_BYTES;
    const bool live = w < words, has_b = live && ba + 1 < nblk && 16 * w + 15 >= oa + NVFP4_BYTES + 4;
    u32 hl[4], ll[4], hh[4], lh[4], sel[4];
    float sx[4];
#pragma unroll
    for (int c = 0; c < 4; c++) {
        const int o = 16 * w + 4 * c, bi = o / NVFP4_BYTES, p = o - bi * NVFP4_BYTES;
        const bool quants = live && p >= 4;
        const int s = quants ? (p - 4) >> 3 : 0, e0 = 64 * bi + 16 * s + 4 * (((p - 4) >> 2) & 1);
        hl[c] = ll[c] = hh[c] = lh[c] = 0u;
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int ql = quants ? (int)xq[e0 + e] : 0, qh = quants ? (int)xq[e0 + 8 + e] : 0;
            const int h0 = (ql + 128) >> 8, l0 = ql - 256 * h0, h1 = (qh + 128) >> 8, l1 = qh - 256 * h1;
            hl[c] |= (u32)(h0 & 0xff) << (8 * e);
            ll[c] |= (u32)(l0 & 0xff) << (8 * e);
            hh[c] |= (u32)(h1 & 0xff) << (8 * e);
            lh[c] |= (u32)(l1 & 0xff) << (8 * e);
        }
        sx[c] = quants ? 0.5f * xs[2 * bi + (s >> 1)] : 0.0f;
        sel[c] = (bi == ba ? 0u : 4u) + (u32)s;
    }
    const i64 stride = (i64)gridDim.x * GW_R;
    i64 m0 = (i64)blockIdx.x * GW_R;
    GwRaw next;
    if (m0 < rows) gw_load(next, a, m0, w, oa, live, has_b, NVFP4_BYTES);
    for (; m0 < rows; m0 += stride) {
        const GwRaw cur = next;
        if (m0 + stride < rows) gw_load(next, a, m0 + stride, w, oa, live, has_b, NVFP4_BYTES);
#pragma unroll
        for (int r = 0; r < GW_R; r++) {
            const u32 q[4] = {cur.v[r].x, cur.v[r].y, cur.v[r].z, cur.v[r].w};
            float v = 0.0f;
#pragma unroll
            for (int c = 0; c < 4; c++) {
                const int2 t = e2m1x8_i8(q[c]);
                const int ih = dp4a(t.y, (int)hh[c], dp4a(t.x, (int)hl[c], 0));
                const int il = dp4a(t.y, (int)lh[c], dp4a(t.x, (int)ll[c], 0));
                v += (float)(ih * 256 + il) * (ue4m3_fast(__byte_perm(cur.da[r], cur.db[r], sel[c])) * sx[c]);
            }
            v = warp_sum(v);
            if (lane == 0) red[warp][r] = v;
        }
        __syncthreads();
        if (tid < GW_R && m0 + tid < rows) {
            float v = 0.0f;
            for (int i = 0; i < (int)(blockDim.x >> 5); i++) v += red[i][tid];
            *(float*)(out.data + offset_of(out, m0 + tid, 0, 0, 0)) = v;
        }
        __syncthreads();
    }
}

// `gemv_q8w` for f16 / bf16 rows (1 token, one weight matrix, rows of 16-byte aligned whole
// words of 8 values, at most WORDS words a thread): thread t owns words t + blockDim.x j of every
// row and their 8 f32 activations (packed by `pack_b`) in registers; a step takes R rows, the
// next step's loads issued before this step's arithmetic and reduction. `gemv_*w`: 2 words a
// thread, GW_R rows a step, up to GW_MAX_THREADS threads; `gemv_*w_long`: 5 words, 2 rows, up to
// GH_LONG_THREADS threads (the register budget of 40 activations and 2 x 10 words in flight).
#define GH_LONG_THREADS 448

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
    gemv_half_words<DT_F16, 2, GW_R>(a, x, out);
}
extern "C" __global__ void __launch_bounds__(GW_MAX_THREADS) gemv_bf16w(Tensor a, const float* x, Tensor out) {
    gemv_half_words<DT_BF16, 2, GW_R>(a, x, out);
}
extern "C" __global__ void __launch_bounds__(GH_LONG_THREADS) gemv_f16w_long(Tensor a, const float* x, Tensor out) {
    gemv_half_words<DT_F16, 5, 2>(a, x, out);
}
extern "C" __global__ void __launch_bounds__(GH_LONG_THREADS) gemv_bf16w_long(Tensor a, const float* x, Tensor out) {
    gemv_half_words<DT_BF16, 5, 2>(a, x, out);
}
