// pack.cu: the copies the matmul paths make before a product, into scratch.
//
// - `pack_b` copies the f32 activations (any strides) into packed rows of `ldb` elements: f32 for
//   the GEMVs, which then read a token's activations in 16-byte pieces whatever the input's
//   strides, or f16 / bf16 (bf16 optionally split into hi + lo parts) for cuBLAS.
// - `dequant_rows` converts rows of one weight matrix to bf16 (hi, and lo = the rounding
//   remainder) for the cuBLAS path of quantized weights with many tokens: cuBLAS has no q8_0 /
//   nvfp4 type, and the hi + lo parts keep the product at f32-level accuracy.

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
