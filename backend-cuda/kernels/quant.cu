// quant.cu: quantize (f32 -> q8_0 / nvfp4) and dequantize (q8_0 / nvfp4 -> f32).
//
// The encoders write exactly the bytes of tessera_ops::quant (ggml's reference quantizers), so
// every rounding step is spelled out with the _rn intrinsics: NVRTC contracts a * b + c into an
// FMA by default, which would change the last bit and so the chosen codes.

// ---- q8_0 -----------------------------------------------------------------------------------

// One warp per block of 32 values (lane j holds value j). amax is NaN when any value is NaN;
// d = amax / 127 (stored as f16, or 0x7E00 when NaN); q = round_half_away(x * (1 / d)) saturated
// to i8, 0 when not finite.
extern "C" __global__ void quantize_q8_0(Tensor dst, Tensor src) {
    grid_begin();
    i64 blocks_per_row = dst.ne[0] / QK8_0;
    i64 blocks = blocks_per_row * dst.ne[1] * dst.ne[2] * dst.ne[3];
    int lane = threadIdx.x & 31;
    i64 warp = (blockIdx.x * (i64)blockDim.x + threadIdx.x) >> 5, warps = ((i64)gridDim.x * blockDim.x) >> 5;
    for (i64 b = warp; b < blocks; b += warps) {
        i64 r = b / blocks_per_row, bi = b % blocks_per_row;
        i64 i1 = r % dst.ne[1], i2 = (r / dst.ne[1]) % dst.ne[2], i3 = r / (dst.ne[1] * dst.ne[2]);
        float x = *(const float*)(src.data + offset_of(src, bi * QK8_0 + lane, i1, i2, i3));
        float a = fabsf(x);
        bool any_nan = __any_sync(0xffffffffu, a != a);
        float amax = warp_max(a);
        if (any_nan) amax = TS_NAN;
        float d = __fdiv_rn(amax, 127.0f);
        float id = d == 0.0f ? 0.0f : __fdiv_rn(1.0f, d);
        char* out = dst.data + i1 * dst.nb[1] + i2 * dst.nb[2] + i3 * dst.nb[3] + bi * Q8_0_BYTES;
        if (lane == 0) *(u16*)out = d != d ? (u16)0x7E00 : f32_to_f16(d);
        float v = __fmul_rn(x, id);
        int q = 0;
        if (v == v && fabsf(v) != TS_INF) {
            float rv = roundf(v);  // half away from zero
            q = rv >= 127.0f ? 127 : (rv <= -128.0f ? -128 : (int)rv);
        }
        ((i8*)(out + 2))[lane] = (i8)q;
    }
}

// ---- nvfp4 ----------------------------------------------------------------------------------

// ggml_fp32_to_ue4m3: see tessera_ops::quant::nvfp4::f32_to_ue4m3 (half-up mantissa rounding,
// exponent 15 is overflow to 0x7E, subnormal mantissa (x * 512 + 0.5) truncated and capped at 7).
__device__ __forceinline__ u8 f32_to_ue4m3(float x) {
    if (x != x || x <= 0.0f) return 0;
    x = fminf(x, 448.0f);
    u32 bits = __float_as_uint(x);
    int exp = (int)((bits >> 23) & 0xff) - 127 + 7;
    if (exp <= 0) {
        int man = (int)__fadd_rn(__fmul_rn(x, 512.0f), 0.5f);
        return (u8)(man < 0 ? 0 : (man > 7 ? 7 : man));
    }
    if (exp >= 15) return 0x7E;
    u32 man = ((bits >> 20) & 7) + ((bits >> 19) & 1);
    if (man > 7) {
        man = 0;
        exp += 1;
        if (exp >= 15) return 0x7E;
    }
    return (u8)(((u32)exp << 3) | man);
}

// ggml's best_index_mxfp4: the code nearest to x, lowest code on ties.
__device__ __forceinline__ u32 nearest_e2m1(float x, float d_half) {
    const float halves[16] = {0.f, 1.f, 2.f, 3.f, 4.f, 6.f, 8.f, 12.f, 0.f, -1.f, -2.f, -3.f, -4.f, -6.f, -8.f, -12.f};
    u32 best = 0;
    float best_err = fabsf(__fsub_rn(__fmul_rn(halves[0], d_half), x));
#pragma unroll
    for (u32 i = 1; i < 16; i++) {
        float err = fabsf(__fsub_rn(__fmul_rn(halves[i], d_half), x));
        if (err < best_err) {
            best = i;
            best_err = err;
        }
    }
    return best;
}

// One thread per 16-value sub-block: its UE4M3 scale byte and 8 bytes of codes (value k in the
// low nibble of byte k, value k + 8 in the high nibble).
extern "C" __global__ void quantize_nvfp4(Tensor dst, Tensor src) {
    grid_begin();
    i64 subs_per_row = dst.ne[0] / 16;
    i64 subs = subs_per_row * dst.ne[1] * dst.ne[2] * dst.ne[3];
    for (i64 t = blockIdx.x * (i64)blockDim.x + threadIdx.x; t < subs; t += (i64)gridDim.x * blockDim.x) {
        i64 r = t / subs_per_row, si = t % subs_per_row;
        i64 i1 = r % dst.ne[1], i2 = (r / dst.ne[1]) % dst.ne[2], i3 = r / (dst.ne[1] * dst.ne[2]);
        const float* x = (const float*)(src.data + offset_of(src, si * 16, i1, i2, i3));
        float v[16];
        float amax = 0.0f;
#pragma unroll
        for (int k = 0; k < 16; k++) {
            v[k] = x[k];
            float a = fabsf(v[k]);
            if (amax < a) amax = a;
        }
        u8 code = f32_to_ue4m3(__fdiv_rn(amax, 6.0f));
        float d_half = __fmul_rn(ue4m3_to_f32(code), 0.5f);
        i64 b = si >> 2;
        int s = (int)(si & 3);
        char* block = dst.data + i1 * dst.nb[1] + i2 * dst.nb[2] + i3 * dst.nb[3] + b * NVFP4_BYTES;
        block[s] = (char)code;
        u8* qs = (u8*)block + 4 + s * 8;
#pragma unroll
        for (int k = 0; k < 8; k++) {
            qs[k] = (u8)(nearest_e2m1(v[k], d_half) | (nearest_e2m1(v[k + 8], d_half) << 4));
        }
    }
}

// ---- dequantize -----------------------------------------------------------------------------

// dst (f32, any strides) = the values of src (dense quantized rows of dtype `dt`).
extern "C" __global__ void dequantize(Tensor dst, Tensor src, int dt) {
    grid_begin();
    i64 n = nelements(dst);
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        i64 i0, i1, i2, i3;
        unravel(dst, i, i0, i1, i2, i3);
        const char* row = src.data + i1 * src.nb[1] + i2 * src.nb[2] + i3 * src.nb[3];
        *(float*)(dst.data + offset_of(dst, i0, i1, i2, i3)) = load_row_value(row, dt, i0, src.nb[0]);
    }
}
