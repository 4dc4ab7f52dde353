// data.cu: get_rows, set_rows, cpy / cast / cont, concat, repeat.
//
// Values move through f32 registers: a plain dtype converts with round to nearest even (f16,
// bf16), like the CPU oracle. When source and destination are both i32 the host passes DT_F32 for
// both, so the 32-bit patterns are moved unchanged (exact beyond 2^24). Quantized (q8_0, nvfp4)
// rows are only read (get_rows, set_rows sources), decoded per element or per 8 values.
//
// Every kernel has a general path (any strides, one element per thread) and, where the host found
// the rows dense and 16-byte aligned, a path that moves 8 values per thread with 16-byte accesses.

// 16 bytes, for vector loads and stores (no CUDA headers, so no uint4).
struct alignas(16) DataV16 {
    u32 x, y, z, w;
};

__device__ __forceinline__ void data_unpack2(u32 w, int dt, float* v) {
    if (dt == DT_F16) {
        v[0] = f16_to_f32((u16)(w & 0xffffu));
        v[1] = f16_to_f32((u16)(w >> 16));
    } else {
        v[0] = bf16_to_f32((u16)(w & 0xffffu));
        v[1] = bf16_to_f32((u16)(w >> 16));
    }
}

__device__ __forceinline__ u32 data_pack2(const float* v, int dt) {
    if (dt == DT_F16) return (u32)f32_to_f16(v[0]) | ((u32)f32_to_f16(v[1]) << 16);
    return (u32)f32_to_bf16(v[0]) | ((u32)f32_to_bf16(v[1]) << 16);
}

// Loads 8 consecutive values of a plain dtype (f32, f16, bf16) at a 16-byte aligned address.
__device__ __forceinline__ void data_load8(const char* p, int dt, float* v) {
    if (dt == DT_F32) {
        DataV16 a = ((const DataV16*)p)[0], b = ((const DataV16*)p)[1];
        v[0] = __uint_as_float(a.x);
        v[1] = __uint_as_float(a.y);
        v[2] = __uint_as_float(a.z);
        v[3] = __uint_as_float(a.w);
        v[4] = __uint_as_float(b.x);
        v[5] = __uint_as_float(b.y);
        v[6] = __uint_as_float(b.z);
        v[7] = __uint_as_float(b.w);
    } else {
        DataV16 a = *(const DataV16*)p;
        data_unpack2(a.x, dt, v);
        data_unpack2(a.y, dt, v + 2);
        data_unpack2(a.z, dt, v + 4);
        data_unpack2(a.w, dt, v + 6);
    }
}

// Stores 8 consecutive values of a plain dtype (f32, f16, bf16) at a 16-byte aligned address.
__device__ __forceinline__ void data_store8(char* p, int dt, const float* v) {
    if (dt == DT_F32) {
        DataV16 a, b;
        a.x = __float_as_uint(v[0]);
        a.y = __float_as_uint(v[1]);
        a.z = __float_as_uint(v[2]);
        a.w = __float_as_uint(v[3]);
        b.x = __float_as_uint(v[4]);
        b.y = __float_as_uint(v[5]);
        b.z = __float_as_uint(v[6]);
        b.w = __float_as_uint(v[7]);
        ((DataV16*)p)[0] = a;
        ((DataV16*)p)[1] = b;
    } else {
        DataV16 a;
        a.x = data_pack2(v, dt);
        a.y = data_pack2(v + 2, dt);
        a.z = data_pack2(v + 4, dt);
        a.w = data_pack2(v + 6, dt);
        *(DataV16*)p = a;
    }
}

__device__ __forceinline__ int data_elem_bytes(int dt) { return (dt == DT_F16 || dt == DT_BF16) ? 2 : 4; }

// Values 8g .. 8g + 7 of a q8_0 row (blocks of 34 bytes, so only 2-byte aligned).
__device__ __forceinline__ void data_load8_q8_0(const char* row, i64 g, float* v) {
    const char* block = row + (g >> 2) * Q8_0_BYTES;
    float d = f16_to_f32(*(const u16*)block);
    const u16* q = (const u16*)(block + 2 + (g & 3) * 8);
#pragma unroll
    for (int k = 0; k < 4; k++) {
        u16 w = q[k];
        v[2 * k] = d * (float)(i8)(w & 0xff);
        v[2 * k + 1] = d * (float)(i8)(w >> 8);
    }
}

// Converts one row of `ne0` values with the calling threads (`lane` of `width`). `vec`: both rows
// are dense and 16-byte aligned and ne0 is a multiple of 8 (for q8_0 sources: the destination).
__device__ __forceinline__ void convert_row(char* d, int ddt, i64 dnb0, const char* s, int sdt, i64 snb0, i64 ne0,
                                            bool vec, int lane, int width) {
    if (vec) {
        // Two groups of 8 per step, both loads issued before the stores.
        float v[8], w[8];
        i64 groups = ne0 >> 3;
        for (i64 g = lane; g < groups; g += 2 * width) {
            bool two = g + width < groups;
            if (sdt == DT_Q8_0) {
                data_load8_q8_0(s, g, v);
                if (two) data_load8_q8_0(s, g + width, w);
            } else {
                data_load8(s + g * 8 * snb0, sdt, v);
                if (two) data_load8(s + (g + width) * 8 * snb0, sdt, w);
            }
            data_store8(d + g * 8 * dnb0, ddt, v);
            if (two) data_store8(d + (g + width) * 8 * dnb0, ddt, w);
        }
    } else {
        for (i64 i0 = lane; i0 < ne0; i0 += width) {
            store_f32(d + i0 * dnb0, ddt, load_row_value(s, sdt, i0, snb0));
        }
    }
}

// ---- cpy / cast / cont ----------------------------------------------------------------------

// Element e of src (flat, logical order) to element e of dst; the shapes may differ.
extern "C" __global__ void copy_general(Tensor dst, int dst_dt, Tensor src, int src_dt) {
    grid_begin();
    i64 n = nelements(dst);
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        i64 d0, d1, d2, d3, s0, s1, s2, s3;
        unravel(dst, i, d0, d1, d2, d3);
        unravel(src, i, s0, s1, s2, s3);
        float v = load_f32(src.data + offset_of(src, s0, s1, s2, s3), src_dt);
        store_f32(dst.data + offset_of(dst, d0, d1, d2, d3), dst_dt, v);
    }
}

// Both contiguous, n elements. `vec`: both addresses are 16-byte aligned (8 values per thread,
// the tail one by one).
extern "C" __global__ void copy_flat(char* dst, int dst_dt, const char* src, int src_dt, i64 n, int vec) {
    grid_begin();
    i64 tid = blockIdx.x * (i64)blockDim.x + threadIdx.x, stride = (i64)gridDim.x * blockDim.x;
    i64 head = 0;
    if (vec) {
        int db = data_elem_bytes(dst_dt), sb = data_elem_bytes(src_dt);
        i64 groups = n >> 3;
        float v[8];
        for (i64 g = tid; g < groups; g += stride) {
            data_load8(src + g * 8 * sb, src_dt, v);
            data_store8(dst + g * 8 * db, dst_dt, v);
        }
        head = groups << 3;
    }
    int db = data_elem_bytes(dst_dt), sb = data_elem_bytes(src_dt);
    for (i64 i = head + tid; i < n; i += stride) {
        store_f32(dst + i * db, dst_dt, load_f32(src + i * sb, src_dt));
    }
}

// The same with the dtypes fixed at compile time (every branch on them folds away): both
// addresses 16-byte aligned. Entries copy_flat_{src}_{dst}; i32 -> i32 runs as f32_f32.
template <int S, int D>
__device__ __forceinline__ void copy_flat_t(char* dst, const char* src, i64 n) {
    const int sb = S == DT_F32 ? 4 : 2, db = D == DT_F32 ? 4 : 2;
    i64 tid = blockIdx.x * (i64)blockDim.x + threadIdx.x, stride = (i64)gridDim.x * blockDim.x;
    i64 groups = n >> 3;
    for (i64 g = tid; g < groups; g += stride) {
        float v[8];
        data_load8(src + g * 8 * sb, S, v);
        data_store8(dst + g * 8 * db, D, v);
    }
    for (i64 i = (groups << 3) + tid; i < n; i += stride) store_f32(dst + i * db, D, load_f32(src + i * sb, S));
}

#define COPY_FLAT(SN, S, DN, D) \
    extern "C" __global__ void copy_flat_##SN##_##DN(char* dst, const char* src, i64 n) { grid_begin(); copy_flat_t<S, D>(dst, src, n); }
COPY_FLAT(f32, DT_F32, f32, DT_F32)
COPY_FLAT(f32, DT_F32, f16, DT_F16)
COPY_FLAT(f32, DT_F32, bf16, DT_BF16)
COPY_FLAT(f16, DT_F16, f32, DT_F32)
COPY_FLAT(f16, DT_F16, f16, DT_F16)
COPY_FLAT(f16, DT_F16, bf16, DT_BF16)
COPY_FLAT(bf16, DT_BF16, f32, DT_F32)
COPY_FLAT(bf16, DT_BF16, f16, DT_F16)
COPY_FLAT(bf16, DT_BF16, bf16, DT_BF16)

// Same shapes, dense rows: blockDim.y rows per block, blockDim.x threads per row.
extern "C" __global__ void copy_rows(Tensor dst, int dst_dt, Tensor src, int src_dt, int vec) {
    grid_begin();
    i64 rows = dst.ne[1] * dst.ne[2] * dst.ne[3];
    for (i64 r = blockIdx.x * (i64)blockDim.y + threadIdx.y; r < rows; r += (i64)gridDim.x * blockDim.y) {
        i64 i1 = r % dst.ne[1], i2 = (r / dst.ne[1]) % dst.ne[2], i3 = r / (dst.ne[1] * dst.ne[2]);
        convert_row(dst.data + offset_of(dst, 0, i1, i2, i3), dst_dt, dst.nb[0], src.data + offset_of(src, 0, i1, i2, i3),
                    src_dt, src.nb[0], dst.ne[0], vec != 0, threadIdx.x, blockDim.x);
    }
}

// Same shapes where one side is dense along ne0 and the other along ne1 (a transposed view: the
// V cache written through its transpose, cont of a transposed tensor). A 32 x 32 tile goes
// through shared memory so both the reads and the writes are coalesced. `src_fast0`: src is the
// side dense along ne0. Blocks of 32 x 8 threads; grid (tiles along ne0, tiles along ne1, ne2*ne3
// with a stride).
extern "C" __global__ void copy_transpose(Tensor dst, int dst_dt, Tensor src, int src_dt, int src_fast0) {
    grid_begin();
    __shared__ float tile[32][33];
    i64 t0 = (i64)blockIdx.x * 32, t1 = (i64)blockIdx.y * 32;
    int tx = threadIdx.x;
    i64 planes = dst.ne[2] * dst.ne[3];
    for (i64 z = blockIdx.z; z < planes; z += gridDim.z) {
        i64 i2 = z % dst.ne[2], i3 = z / dst.ne[2];
        for (int k = threadIdx.y; k < 32; k += blockDim.y) {
            i64 i0 = t0 + (src_fast0 ? tx : k), i1 = t1 + (src_fast0 ? k : tx);
            if (i0 < dst.ne[0] && i1 < dst.ne[1]) {
                tile[i1 - t1][i0 - t0] = load_f32(src.data + offset_of(src, i0, i1, i2, i3), src_dt);
            }
        }
        __syncthreads();
        for (int k = threadIdx.y; k < 32; k += blockDim.y) {
            i64 i0 = t0 + (src_fast0 ? k : tx), i1 = t1 + (src_fast0 ? tx : k);
            if (i0 < dst.ne[0] && i1 < dst.ne[1]) {
                store_f32(dst.data + offset_of(dst, i0, i1, i2, i3), dst_dt, tile[i1 - t1][i0 - t0]);
            }
        }
        __syncthreads();
    }
}

// ---- get_rows / set_rows --------------------------------------------------------------------

// Id e (flat, logical order) of an i32 ids tensor of [n0, n1, n2] (the host keeps its element
// count below 2^31, so 32-bit index math suffices).
__device__ __forceinline__ int data_id_at(const Tensor& ids, i64 e) {
    u32 x = (u32)e, n0 = (u32)ids.ne[0], n1 = (u32)ids.ne[1];
    u32 e0 = x % n0, q = x / n0, e1 = q % n1, e2 = q / n1;
    return *(const int*)(ids.data + e0 * ids.nb[0] + e1 * ids.nb[1] + e2 * ids.nb[2]);
}

// Reports the first id (logical order) outside 0..limit; every block that calls it finds the same
// one, so the record is the one the CPU gives whichever block wins. Call with the whole block.
__device__ void report_first_bad(const Tensor& ids, i64 limit, u64 err, u32 op, u32 what) {
    __shared__ unsigned long long first;
    if (threadIdx.x == 0 && threadIdx.y == 0) first = ~0ull;
    __syncthreads();
    i64 n = nelements(ids);
    for (i64 e = threadIdx.x; e < n; e += blockDim.x) {
        int id = data_id_at(ids, e);
        if (id < 0 || id >= limit) atomicMin(&first, (unsigned long long)e);
    }
    __syncthreads();
    if (threadIdx.x == 0 && first != ~0ull) {
        report_error((ErrorRecord*)err, ERR_INDEX_OUT_OF_RANGE, what, op, data_id_at(ids, (i64)first), limit, 0, 0);
    }
}

// dst[:, r, j, k] = src[:, ids[r, j, k], j, k]. One block per destination row.
extern "C" __global__ void get_rows(Tensor dst, int dst_dt, Tensor src, int src_dt, Tensor ids, int vec, u64 err, u32 op) {
    grid_begin();
    i64 rows = dst.ne[1] * dst.ne[2] * dst.ne[3];
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        i64 i1 = r % dst.ne[1], i2 = (r / dst.ne[1]) % dst.ne[2], i3 = r / (dst.ne[1] * dst.ne[2]);
        int id = *(const int*)(ids.data + i1 * ids.nb[0] + i2 * ids.nb[1] + i3 * ids.nb[2]);
        if (id < 0 || id >= src.ne[1]) {
            report_first_bad(ids, src.ne[1], err, op, WHAT_ROW_ID);
            continue;  // uniform across the block
        }
        const char* s = src.data + id * src.nb[1] + i2 * src.nb[2] + i3 * src.nb[3];
        convert_row(dst.data + offset_of(dst, 0, i1, i2, i3), dst_dt, dst.nb[0], s, src_dt, src.nb[0], dst.ne[0], vec != 0,
                    threadIdx.x, blockDim.x);
    }
}

// Row r of src[:, :, j, k] to row ids[r, j, k] of dst[:, :, j, k]. Nothing is written when any id
// is out of range (the first one is reported); among source rows naming the same destination row
// the last one wins when `dedup` (the host sets it for up to 4096 ids per slice: the check is
// quadratic; ggml does not order duplicate writes either). Every block checks all ids, so the
// host caps the grid.
extern "C" __global__ void set_rows(Tensor dst, int dst_dt, Tensor src, int src_dt, Tensor ids, int vec, int dedup, u64 err,
                                    u32 op) {
    grid_begin();
    i64 rows = src.ne[1] * src.ne[2] * src.ne[3];
    i64 n = nelements(ids), limit = dst.ne[1];
    // Validate every id first (the same answer in every block).
    int bad = 0;
    for (i64 e = threadIdx.x; e < n; e += blockDim.x) {
        int id = data_id_at(ids, e);
        bad |= id < 0 || id >= limit;
    }
    if (__syncthreads_or(bad)) {
        if (blockIdx.x == 0) report_first_bad(ids, limit, err, op, WHAT_DEST_ROW);
        return;
    }
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        i64 i1 = r % src.ne[1], i2 = (r / src.ne[1]) % src.ne[2], i3 = r / (src.ne[1] * src.ne[2]);
        // ids has src's row shape: row r's id is ids[i1, i2, i3]; a later id in the same slice
        // naming the same destination row wins over this one.
        const char* slice = ids.data + i2 * ids.nb[1] + i3 * ids.nb[2];
        int target = *(const int*)(slice + i1 * ids.nb[0]);
        int later = 0;
        for (i64 e0 = i1 + 1 + threadIdx.x; dedup && e0 < ids.ne[0]; e0 += blockDim.x) {
            later |= *(const int*)(slice + e0 * ids.nb[0]) == target;
        }
        if (__syncthreads_or(later)) continue;
        convert_row(dst.data + offset_of(dst, 0, target, i2, i3), dst_dt, dst.nb[0], src.data + offset_of(src, 0, i1, i2, i3),
                    src_dt, src.nb[0], src.ne[0], vec != 0, threadIdx.x, blockDim.x);
    }
}

// ---- concat / repeat (same dtype: raw element moves) ----------------------------------------

// dst = a followed by b along `dim`.
extern "C" __global__ void concat(Tensor dst, Tensor a, Tensor b, int dt, int dim) {
    grid_begin();
    i64 n = nelements(dst);
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        i64 c[4];
        unravel(dst, i, c[0], c[1], c[2], c[3]);
        i64 at = offset_of(dst, c[0], c[1], c[2], c[3]);
        const Tensor* s = &a;
        if (c[dim] >= a.ne[dim]) {
            c[dim] -= a.ne[dim];
            s = &b;
        }
        float v = load_f32(s->data + offset_of(*s, c[0], c[1], c[2], c[3]), dt);
        store_f32(dst.data + at, dt, v);
    }
}

// dst[i] = src[i mod src.ne] per dimension.
extern "C" __global__ void repeat(Tensor dst, Tensor src, int dt) {
    grid_begin();
    i64 n = nelements(dst);
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        i64 i0, i1, i2, i3;
        unravel(dst, i, i0, i1, i2, i3);
        float v = load_f32(src.data + offset_of(src, i0 % src.ne[0], i1 % src.ne[1], i2 % src.ne[2], i3 % src.ne[3]), dt);
        store_f32(dst.data + offset_of(dst, i0, i1, i2, i3), dt, v);
    }
}
