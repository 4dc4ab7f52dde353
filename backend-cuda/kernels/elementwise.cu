// elementwise.cu: unary, binary with broadcasting, scale, swiglu.
//
// One thread per output element, grid-stride loops; any strides and any plain dtype (f32, f16,
// bf16; i32 where the shape rules allow), computed in f32 like the CPU oracle.
// Unary codes follow tessera_ops::UnaryOp (TAG(unary-code)): 0 neg, 1 exp, 2 silu, 3 sigmoid,
// 4 softplus. Binary codes follow BinaryOp (TAG(binary-code)): 0 add, 1 sub, 2 mul, 3 div.

__device__ __forceinline__ float sigmoid_f(float x) {
    // Stable for large |x|: never exponentiates a positive number.
    if (x >= 0.0f) return 1.0f / (1.0f + expf(-x));
    float e = expf(x);
    return e / (1.0f + e);
}

__device__ __forceinline__ float unary_f(int code, float x) {
    switch (code) {
        case 0: return -x;
        case 1: return expf(x);
        case 2: return x * sigmoid_f(x);
        case 3: return sigmoid_f(x);
        case 4: return fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x)));
        default: return TS_NAN;
    }
}

extern "C" __global__ void unary(Tensor dst, int dst_dt, Tensor src, int src_dt, int code) {
    i64 n = nelements(dst);
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        i64 i0, i1, i2, i3;
        unravel(dst, i, i0, i1, i2, i3);
        float x = load_f32(src.data + offset_of(src, i0, i1, i2, i3), src_dt);
        store_f32(dst.data + offset_of(dst, i0, i1, i2, i3), dst_dt, unary_f(code, x));
    }
}

__device__ __forceinline__ float binary_f(int code, float a, float b) {
    switch (code) {
        case 0: return a + b;
        case 1: return a - b;
        case 2: return a * b;
        case 3: return a / b;
        default: return TS_NAN;
    }
}

// dst = a (op) b, b broadcast over a by repetition (b.ne[d] divides a.ne[d]).
extern "C" __global__ void binary(Tensor dst, int dst_dt, Tensor a, int a_dt, Tensor b, int b_dt, int code) {
    i64 n = nelements(dst);
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        i64 i0, i1, i2, i3;
        unravel(dst, i, i0, i1, i2, i3);
        float x = load_f32(a.data + offset_of(a, i0, i1, i2, i3), a_dt);
        float y = load_f32(b.data + offset_of(b, i0 % b.ne[0], i1 % b.ne[1], i2 % b.ne[2], i3 % b.ne[3]), b_dt);
        store_f32(dst.data + offset_of(dst, i0, i1, i2, i3), dst_dt, binary_f(code, x, y));
    }
}

// Contiguous f32 fast path for the model's hot binaries: 4 elements per thread when aligned.
extern "C" __global__ void binary_f32_contig(float* dst, const float* a, const float* b, i64 n, i64 nb, int code) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        dst[i] = binary_f(code, a[i], b[i % nb]);
    }
}

extern "C" __global__ void scale(Tensor dst, int dst_dt, Tensor src, int src_dt, float s, float bias) {
    i64 n = nelements(dst);
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        i64 i0, i1, i2, i3;
        unravel(dst, i, i0, i1, i2, i3);
        float x = load_f32(src.data + offset_of(src, i0, i1, i2, i3), src_dt);
        store_f32(dst.data + offset_of(dst, i0, i1, i2, i3), dst_dt, x * s + bias);
    }
}

// dst = silu(gate) * up.
extern "C" __global__ void swiglu(Tensor dst, int dst_dt, Tensor gate, int gate_dt, Tensor up, int up_dt) {
    i64 n = nelements(dst);
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        i64 i0, i1, i2, i3;
        unravel(dst, i, i0, i1, i2, i3);
        float g = load_f32(gate.data + offset_of(gate, i0, i1, i2, i3), gate_dt);
        float u = load_f32(up.data + offset_of(up, i0, i1, i2, i3), up_dt);
        store_f32(dst.data + offset_of(dst, i0, i1, i2, i3), dst_dt, g * sigmoid_f(g) * u);
    }
}
