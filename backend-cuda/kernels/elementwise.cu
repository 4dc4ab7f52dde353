// elementwise.cu: unary, binary with broadcasting, scale, swiglu.
//
// Any strides and any plain dtype (f32, f16, bf16; i32 where the shape rules allow), computed in
// f32 like the CPU oracle. Launch shape (see `row_launch` in ops/elementwise.rs): blockDim.x
// threads stride over ne[0] of one row, blockDim.y rows per block, rows = ne1*ne2*ne3 over a
// grid-stride loop, so coordinates cost two divisions per row. Contiguous f32 gets a flat,
// 16-byte vectorised path.
// Unary codes follow tessera_ops::UnaryOp (TAG(unary-code)): 0 neg, 1 exp, 2 silu, 3 sigmoid,
// 4 softplus. Binary codes follow BinaryOp (TAG(binary-code)): 0 add, 1 sub, 2 mul, 3 div.

// unary_f and binary_f (the codes' device math) are in common.cuh, shared with delta_net.cu.

// Loops over the rows this thread handles: `body(i1, i2, i3)` then strides over ne[0] itself.
#define FOR_EACH_ROW(t)                                                                            \
    for (i64 row = (i64)blockIdx.x * blockDim.y + threadIdx.y, nrows = (t).ne[1] * (t).ne[2] * (t).ne[3]; \
         row < nrows; row += (i64)gridDim.x * blockDim.y)

extern "C" __global__ void unary(Tensor dst, int dst_dt, Tensor src, int src_dt, int code) {
    grid_begin();
    FOR_EACH_ROW(dst) {
        i64 i1, i2, i3;
        row_coords(dst, row, i1, i2, i3);
        const char* s = src.data + offset_of(src, 0, i1, i2, i3);
        char* d = dst.data + offset_of(dst, 0, i1, i2, i3);
        for (i64 i0 = threadIdx.x; i0 < dst.ne[0]; i0 += blockDim.x) {
            store_f32(d + i0 * dst.nb[0], dst_dt, unary_f(code, load_f32(s + i0 * src.nb[0], src_dt)));
        }
    }
}

// dst = a (op) b, b broadcast over a by repetition (b.ne[d] divides a.ne[d]).
extern "C" __global__ void binary(Tensor dst, int dst_dt, Tensor a, int a_dt, Tensor b, int b_dt, int code) {
    grid_begin();
    FOR_EACH_ROW(dst) {
        i64 i1, i2, i3;
        row_coords(dst, row, i1, i2, i3);
        const char* x = a.data + offset_of(a, 0, i1, i2, i3);
        const char* y = b.data + offset_of(b, 0, bcast_index(i1, b.ne[1]), bcast_index(i2, b.ne[2]), bcast_index(i3, b.ne[3]));
        char* d = dst.data + offset_of(dst, 0, i1, i2, i3);
        if (b.ne[0] == dst.ne[0]) {
            for (i64 i0 = threadIdx.x; i0 < dst.ne[0]; i0 += blockDim.x)
                store_f32(d + i0 * dst.nb[0], dst_dt, binary_f(code, load_f32(x + i0 * a.nb[0], a_dt), load_f32(y + i0 * b.nb[0], b_dt)));
        } else {
            for (i64 i0 = threadIdx.x; i0 < dst.ne[0]; i0 += blockDim.x)
                store_f32(d + i0 * dst.nb[0], dst_dt,
                          binary_f(code, load_f32(x + i0 * a.nb[0], a_dt), load_f32(y + bcast_index(i0, b.ne[0]) * b.nb[0], b_dt)));
        }
    }
}

// Contiguous f32, b a contiguous block of `nb` elements repeated along the flat index (nb a
// multiple of 4 and 16-byte aligned pointers: checked by the host): 4 elements per thread.
extern "C" __global__ void binary_f32_vec4(float4* dst, const float4* a, const float4* b, i64 n4, i64 nb4, int code) {
    grid_begin();
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n4; i += (i64)gridDim.x * blockDim.x) {
        float4 x = a[i], y = b[nb4 == n4 ? i : i % nb4], r;
        r.x = binary_f(code, x.x, y.x);
        r.y = binary_f(code, x.y, y.y);
        r.z = binary_f(code, x.z, y.z);
        r.w = binary_f(code, x.w, y.w);
        dst[i] = r;
    }
}

// Contiguous f32 unary / scale: 4 elements per thread.
extern "C" __global__ void unary_f32_vec4(float4* dst, const float4* src, i64 n4, int code) {
    grid_begin();
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n4; i += (i64)gridDim.x * blockDim.x) {
        float4 x = src[i], r;
        r.x = unary_f(code, x.x);
        r.y = unary_f(code, x.y);
        r.z = unary_f(code, x.z);
        r.w = unary_f(code, x.w);
        dst[i] = r;
    }
}

extern "C" __global__ void scale_f32_vec4(float4* dst, const float4* src, i64 n4, float s, float bias) {
    grid_begin();
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n4; i += (i64)gridDim.x * blockDim.x) {
        float4 x = src[i];
        dst[i] = make_float4(x.x * s + bias, x.y * s + bias, x.z * s + bias, x.w * s + bias);
    }
}

extern "C" __global__ void scale(Tensor dst, int dst_dt, Tensor src, int src_dt, float s, float bias) {
    grid_begin();
    FOR_EACH_ROW(dst) {
        i64 i1, i2, i3;
        row_coords(dst, row, i1, i2, i3);
        const char* x = src.data + offset_of(src, 0, i1, i2, i3);
        char* d = dst.data + offset_of(dst, 0, i1, i2, i3);
        for (i64 i0 = threadIdx.x; i0 < dst.ne[0]; i0 += blockDim.x)
            store_f32(d + i0 * dst.nb[0], dst_dt, load_f32(x + i0 * src.nb[0], src_dt) * s + bias);
    }
}

// dst = silu(gate) * up.
extern "C" __global__ void swiglu(Tensor dst, int dst_dt, Tensor gate, int gate_dt, Tensor up, int up_dt) {
    grid_begin();
    FOR_EACH_ROW(dst) {
        i64 i1, i2, i3;
        row_coords(dst, row, i1, i2, i3);
        const char* g = gate.data + offset_of(gate, 0, i1, i2, i3);
        const char* u = up.data + offset_of(up, 0, i1, i2, i3);
        char* d = dst.data + offset_of(dst, 0, i1, i2, i3);
        for (i64 i0 = threadIdx.x; i0 < dst.ne[0]; i0 += blockDim.x) {
            float gv = load_f32(g + i0 * gate.nb[0], gate_dt);
            store_f32(d + i0 * dst.nb[0], dst_dt, gv * sigmoid_f(gv) * load_f32(u + i0 * up.nb[0], up_dt));
        }
    }
}
