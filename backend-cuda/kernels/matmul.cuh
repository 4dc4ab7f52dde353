// matmul.cuh: device code that more than one matmul module uses (pack.cu, gemv.cu, moe.cu).
// Each module is its own NVRTC translation unit and NVRTC is given no include files, so
// src/compile.rs compiles this header after common.cuh and before each of those modules' files
// (`Module::headers`), as it does common.cuh for every module.
//
// - Weight values without lookup tables (a local array would live in local memory): E2M1, UE4M3
//   and int8 decoded by bit tricks; `weight_value` reads one value of any dense row
//   (`dequant_rows`, `moe_gemm`).
// - The warp dot (`dot_unit`, `warp_dot`): a warp runs one weight row against up to NT packed f32
//   activation rows, q8_0 / nvfp4 staged through shared memory; `gemv_warp_N` and `moe_gemv` take
//   it, so the dense and the grouped MoE paths decode and add up alike.
// - The fast units (`gf_load`, `gf_dot`, `gf_rows`): contiguous weight rows read straight from
//   global memory against int16 activations (`quant_x`) through dp4a; `gemv_fast_*` and the MoE
//   decode kernels take them.

// Warps a block of the warp GEMVs (`gemv_warp_N`, `moe_gemv`): TAG(mm-warps), `MM_WARPS` in
// src/ops/matmul/mod.rs.
#define MM_WARPS 4
// Per-warp staging: 32 blocks of the largest block type (nvfp4, 36 bytes).
#define STAGE_CHUNKS (32 * NVFP4_BYTES / 16)

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

// ---------------------------------------------------------------------------------------------
// Fast GEMV units: a weight row is read in units (16 values of q8_0: half a block, 17 bytes;
// nvfp4: one 16-value sub-block, 8.5 bytes; f16 / bf16: 8 values, 16 bytes; f32: 4 values), a
// few units loaded straight from global memory before any is used. Quantized weights multiply
// int16 activations split in two int8 halves (x_q = 256 hi + lo, per-16-value f32 scale, written
// once per call by gemv.cu's `quant_x`) with `dp4a`, so a unit costs a few integer instructions
// per weight byte; the int16 activations keep |x - d x_q| <= amax / 65278 per block, far inside
// the f32 bound. f16 / bf16 / f32 weights use the packed f32 activations of `pack_b`.

// Threads a block of the fast GEMVs: `GF_THREADS` in src/ops/matmul/mod.rs.
#define GF_THREADS 128
#define GF_UNITS 4

__device__ __forceinline__ int dp4a(int a, int b, int c) {
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
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

// Units of a weight row of k values for gf_load / gf_dot: 16 values of q8_0 / nvfp4 (against 16
// int16 activations and their scale), 8 of f16 / bf16 or 4 of f32 (16 bytes, against f32
// activations).
__device__ __forceinline__ i64 gf_units(int dt, i64 k) {
    return (dt == DT_Q8_0 || dt == DT_NVFP4) ? k / 16 : dt == DT_F32 ? k / 4 : k / 8;
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
