// common.cuh: prepended to every kernel family by the Rust side (NVRTC, no include paths).
//
// It holds what every family needs: the tensor descriptor passed by value (mirrors
// `TensorArg` in src/launch.rs; the two change together: TAG(tensor-arg)), dtype codes (the
// ggml type ids of `tessera_ops::DType`), f16/bf16 conversion through PTX (no cuda_fp16.h, so the
// NVRTC wheel alone can compile us), quantized block decoding and warp reductions.

typedef long long i64;
typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef signed char i8;

// dtype codes: tessera_ops::DType as u32 (ggml type ids).
#define DT_F32 0
#define DT_F16 1
#define DT_Q8_0 8
#define DT_I32 26
#define DT_BF16 30
#define DT_NVFP4 40

// NVRTC has no math.h: the IEEE specials by bit pattern.
#define TS_INF __int_as_float(0x7f800000)
#define TS_NAN __int_as_float(0x7fc00000)

#define QK8_0 32
#define Q8_0_BYTES 34
#define QK_NVFP4 64
#define NVFP4_BYTES 36

// A tensor as the kernels see it: `data` points at element (0,0,0,0); `ne` are elements per
// dimension (ggml order, ne[0] innermost); `nb` are byte strides (nb[0] is one block's bytes).
struct Tensor {
    char* data;
    i64 ne[4];
    i64 nb[4];
};

// Every kernel's first statement, after at most some l2_prefetch_rows (a test checks): with
// programmatic dependent launch (`Launch` in src/launch.rs) a kernel may be launched while the one
// before it on the stream is finishing (once that one's blocks have all exited, before its
// completion is flushed). Wait until that grid has completed and its writes are visible. No
// kernel triggers its dependents earlier: their blocks would hold SM resources while they wait
// (measured slower on prefill, docs/perf-log/engine.md). A no-op without the launch attribute.
__device__ __forceinline__ void grid_begin() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// sm_90+: mbarriers in shared memory (`bar` a shared::cta address): a ring stage's "full" or
// "empty" signal between warps, waited on by phase parity.
#if __CUDA_ARCH__ >= 900
__device__ __forceinline__ void mb_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// Makes the inits visible to the async proxy (bulk copies) and to the block's other threads.
__device__ __forceinline__ void mb_fence_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
__device__ __forceinline__ void mb_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// Arrives on `bar` once every cp.async this thread issued so far has landed (one of the arrivals
// counted at init: noinc).
__device__ __forceinline__ void mb_arrive_copies(u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
// Waits until phase `parity` (0 or 1) of `bar` has completed.
__device__ __forceinline__ void mb_wait(u32 bar, u32 parity) {
    asm volatile(
        "{\n\t.reg .pred p;\n\t"
        "MB_WAIT:\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n\t"
        "@!p bra MB_WAIT;\n\t}" ::"r"(bar),
        "r"(parity)
        : "memory");
}

// sm_90+: thread-block clusters. The block's rank in its cluster; a barrier of every thread of
// the cluster that orders the shared-memory writes before it with the (remote) reads after it
// (`cl_sync`), or that orders nothing (`cl_sync_relaxed`: e.g. that no block exits while others
// still read its shared memory, their reads being complete once used); and a load from the
// shared memory of block `rank` of the cluster at the address where this block has `p`.
__device__ __forceinline__ u32 cl_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ void cl_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ void cl_sync_relaxed() {
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory");
}
__device__ __forceinline__ float cl_ld_f32(const float* p, u32 rank) {
    u32 a;
    float v;
    asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    asm volatile("mapa.shared::cluster.u32 %0, %0, %1;" : "+r"(a) : "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(a) : "memory");
    return v;
}
#endif

// Bytes of a dense row of `ne0` elements of dtype `dt`.
__device__ __forceinline__ i64 dense_row_bytes(int dt, i64 ne0) {
    switch (dt) {
        case DT_F16:
        case DT_BF16: return 2 * ne0;
        case DT_Q8_0: return ne0 / QK8_0 * Q8_0_BYTES;
        case DT_NVFP4: return ne0 / QK_NVFP4 * NVFP4_BYTES;
        default: return 4 * ne0;
    }
}

// The one thing a kernel may do before grid_begin(): one thread has L2 fetch up to the first 32
// KiB of rows [m0, m0 + rows) of `a` (matrix 0), the weight rows the block reads first, so they
// stream in while the previous kernel finishes. Valid for any data, not only weights: a prefetch
// only warms L2, which every write goes through, so it never makes a stale value visible; the
// range is clipped to the rows that exist and rounded inwards to 16 bytes.
__device__ __forceinline__ void l2_prefetch_rows(const Tensor& a, int dt, i64 m0, i64 rows) {
#if __CUDA_ARCH__ >= 900
    rows = min(rows, a.ne[1] - m0);
    if (threadIdx.x == 0 && rows > 0) {
        const i64 rb = dense_row_bytes(dt, a.ne[0]);
        const i64 span = a.nb[1] == rb ? rows * rb : rb;
        const u64 lo = ((u64)(a.data + m0 * a.nb[1]) + 15) & ~15ull;
        const u64 hi = min((u64)(a.data + m0 * a.nb[1] + span), lo + 32768) & ~15ull;
        if (hi > lo) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(lo), "r"((u32)(hi - lo)) : "memory");
    }
#endif
}

__device__ __forceinline__ i64 nelements(const Tensor& t) { return t.ne[0] * t.ne[1] * t.ne[2] * t.ne[3]; }

// Byte offset of element (i0, i1, i2, i3) of a plain (non-block) tensor.
__device__ __forceinline__ i64 offset_of(const Tensor& t, i64 i0, i64 i1, i64 i2, i64 i3) {
    return i0 * t.nb[0] + i1 * t.nb[1] + i2 * t.nb[2] + i3 * t.nb[3];
}

// Row `row` (a flat index over dims 1..3) into coordinates: two divisions per row, not per
// element. Per-element 64-bit division costs ~70 instructions and made elementwise kernels
// instruction-bound at 15% of copy bandwidth, so kernels walk rows and stride over ne[0]; rows
// that fit 32 bits (every model's) divide in 32 bits, and a dimension of 1 not at all (a
// warp-per-row kernel over short rows, gated_rms_norm's, spent most of its instructions here).
__device__ __forceinline__ void row_coords(const Tensor& t, i64 row, i64& i1, i64& i2, i64& i3) {
    if ((u64)row <= 0xffffffffull && (u64)t.ne[1] <= 0xffffffffull && (u64)t.ne[2] <= 0xffffffffull) {
        const u32 n1 = (u32)t.ne[1], n2 = (u32)t.ne[2], r0 = (u32)row;
        const u32 r = n1 == 1 ? r0 : r0 / n1;
        i1 = n1 == 1 ? 0 : r0 - r * n1;
        const u32 q = n2 == 1 ? r : r / n2;
        i2 = n2 == 1 ? 0 : r - q * n2;
        i3 = q;
        return;
    }
    i1 = row % t.ne[1];
    i64 r = row / t.ne[1];
    i2 = r % t.ne[2];
    i3 = r / t.ne[2];
}

// i mod n for a broadcast index (n >= 1): no division where n is 1 or i < n, as for most weights.
__device__ __forceinline__ i64 bcast_index(i64 i, i64 n) { return n == 1 ? 0 : i < n ? i : i % n; }

// Unravels a flat logical index (ne[0] fastest) into coordinates (slow: prefer row_coords).
__device__ __forceinline__ void unravel(const Tensor& t, i64 i, i64& i0, i64& i1, i64& i2, i64& i3) {
    i0 = i % t.ne[0];
    i /= t.ne[0];
    i1 = i % t.ne[1];
    i /= t.ne[1];
    i2 = i % t.ne[2];
    i3 = i / t.ne[2];
}

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float(((u32)h) << 16); }
__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// Reads one element of a plain dtype (f32, f16, bf16, i32) as f32.
__device__ __forceinline__ float load_f32(const char* p, int dt) {
    switch (dt) {
        case DT_F32: return *(const float*)p;
        case DT_F16: return f16_to_f32(*(const u16*)p);
        case DT_BF16: return bf16_to_f32(*(const u16*)p);
        case DT_I32: return (float)*(const int*)p;
        default: return TS_NAN;  // unreachable: the host refuses other dtypes
    }
}

// Writes one element of a plain dtype from f32 (round to nearest even; i32 rounds half away from
// zero and saturates, like the CPU backend).
__device__ __forceinline__ void store_f32(char* p, int dt, float v) {
    switch (dt) {
        case DT_F32: *(float*)p = v; break;
        case DT_F16: *(u16*)p = f32_to_f16(v); break;
        case DT_BF16: *(u16*)p = f32_to_bf16(v); break;
        case DT_I32: {
            float r = roundf(v);
            int x = r != r ? 0 : (r >= 2147483647.0f ? 2147483647 : (r <= -2147483648.0f ? (int)0x80000000 : (int)r));
            *(int*)p = x;
            break;
        }
        default: break;
    }
}

// q8_0 block: f16 scale d, then 32 int8 quants; value = d * q.
__device__ __forceinline__ float q8_0_value(const char* block, int j) {
    return f16_to_f32(*(const u16*)block) * (float)((const i8*)(block + 2))[j];
}

// UE4M3 (unsigned E4M3, bias 7) to f32, the NVFP4 sub-block scale, decoded as ggml does: 0x00 and
// 0x7F are 0, bit 7 is ignored (so 0xFF reads as exponent 15, mantissa 7: 480).
__device__ __forceinline__ float ue4m3_to_f32(u8 code) {
    if (code == 0 || code == 0x7f) return 0.0f;
    int exp = (code >> 3) & 0xf, man = code & 7;
    return exp == 0 ? ldexpf((float)man, -9) : ldexpf((float)(8 + man), exp - 10);
}

// E2M1 (fp4) code to value; code 8 (E2M1's -0) reads as +0, like ggml's integer table. A
// file-scope constant table: a local array indexed at run time would live in local memory.
__constant__ float E2M1_VALUES[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                      0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
__device__ __forceinline__ float e2m1_value(u32 code) { return E2M1_VALUES[code & 15]; }

// NVFP4 block (ggml layout): 4 E4M3 scales (one per 16 values), then 32 bytes of packed E2M1
// codes. Within each 16-value sub-block s, byte k of its 8 bytes holds value k (low nibble) and
// value k + 8 (high nibble).
__device__ __forceinline__ float nvfp4_value(const char* block, int j) {
    int s = j >> 4, w = j & 15;
    float d = ue4m3_to_f32(((const u8*)block)[s]);
    u8 byte = ((const u8*)block)[4 + s * 8 + (w & 7)];
    u32 code = w < 8 ? (byte & 0xf) : (byte >> 4);
    return d * e2m1_value(code);
}

// Value `i0` of a row of any dtype (plain or block-quantized) starting at `row`.
__device__ __forceinline__ float load_row_value(const char* row, int dt, i64 i0, i64 nb0) {
    switch (dt) {
        case DT_Q8_0: return q8_0_value(row + (i0 / QK8_0) * nb0, (int)(i0 % QK8_0));
        case DT_NVFP4: return nvfp4_value(row + (i0 / QK_NVFP4) * nb0, (int)(i0 % QK_NVFP4));
        default: return load_f32(row + i0 * nb0, dt);
    }
}

// Online softmax state (the softmax kernels of reduce.cu and the fused router of fused.cu, which
// must give the same probabilities): running max m and the sum s of exp(z - m). -inf values add nothing; a NaN
// poisons s; a +inf max makes the row NaN (exp(inf - inf)), as on the CPU.
struct MaxSum {
    float m, s;
};

__device__ __forceinline__ MaxSum ms_add(MaxSum a, float z) {
    if (z > a.m) {
        a.s = (a.m == -TS_INF ? 0.0f : a.s * expf(a.m - z)) + 1.0f;
        a.m = z;
    } else if (z != -TS_INF) {
        a.s += expf(z - a.m);  // NaN z (or NaN m) gives NaN
    }
    return a;
}

__device__ __forceinline__ MaxSum ms_merge(MaxSum a, MaxSum b) {
    float m = fmaxf(a.m, b.m);
    if (m == -TS_INF) return MaxSum{m, a.s + b.s};
    float s = (a.m == -TS_INF ? 0.0f : a.s * expf(a.m - m)) + (b.m == -TS_INF ? 0.0f : b.s * expf(b.m - m));
    if (a.m != a.m || b.m != b.m) s = TS_NAN;
    return MaxSum{m, s};
}

__device__ __forceinline__ MaxSum warp_ms(MaxSum v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        MaxSum w{__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o)};
        v = ms_merge(v, w);
    }
    return v;
}

// sigmoid(x), stable for large |x|: never exponentiates a positive number (the unary sigmoid and
// silu, swiglu and every fused kernel that applies them).
__device__ __forceinline__ float sigmoid_f(float x) {
    if (x >= 0.0f) return 1.0f / (1.0f + expf(-x));
    float e = expf(x);
    return e / (1.0f + e);
}

// The unary and binary ops' device math by code (TAG(unary-code), TAG(binary-code); codes in
// elementwise.cu): elementwise.cu's kernels, the generated elementwise programs and
// delta_net.cu's gdn_input_prep.
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

__device__ __forceinline__ float binary_f(int code, float a, float b) {
    switch (code) {
        case 0: return a + b;
        case 1: return a - b;
        case 2: return a * b;
        case 3: return a / b;
        default: return TS_NAN;
    }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Block-wide sum for blockDim.x a multiple of 32 (up to 1024); every thread gets the result.
// `scratch` is 32 floats of shared memory; the call ends with a barrier so scratch may be reused.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch[lane] : 0.0f;
    v = warp_sum(v);
    __syncthreads();
    return v;
}
__device__ __forceinline__ float block_max(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch[lane] : -TS_INF;
    v = warp_max(v);
    __syncthreads();
    return v;
}

// Data errors (a bad row id, slot or block-table entry) are recorded here, first one wins, and
// reported by the host at its next synchronisation point. Mirrors `ErrorRecord` in src/errors.rs:
// TAG(error-record).
struct ErrorRecord {
    u32 code;  // 0 = none, else ERR_*
    u32 what;  // WHAT_*: which kind of index was bad
    u32 task;  // index of the task in its compute() call
    u32 pad;
    i64 index;
    i64 limit;
    i64 first;
    i64 second;
};

__device__ __forceinline__ void report_error(ErrorRecord* rec, u32 code, u32 what, u32 task, i64 index, i64 limit, i64 first, i64 second) {
    if (atomicCAS(&rec->code, 0u, code) == 0u) {
        rec->what = what;
        rec->task = task;
        rec->index = index;
        rec->limit = limit;
        rec->first = first;
        rec->second = second;
    }
}

#define ERR_INDEX_OUT_OF_RANGE 1u
#define ERR_DUPLICATE_INDEX 2u
#define ERR_VALUE_OUT_OF_RANGE 3u  // index = value, first = its position, second..=limit allowed

#define WHAT_ROW_ID 1u
#define WHAT_STATE_SLOT 2u
#define WHAT_EXPERT_ID 3u
#define WHAT_KV_CELL 4u
#define WHAT_DEST_ROW 5u
#define WHAT_SEQ_OFFSETS 6u
#define WHAT_KV_LENS 7u

// Whether the n slots slot(0 .. n) (SLOT_SKIP for a sequence that is not checked) are in range and
// distinct, in one pass: each in-range slot sets its bit in a shared bitmap, and a bit already set
// is a repeat. O(n) a block, so that a kernel can afford the check in every block; where n_slots
// exceeds the bitmap it returns false, as for a bad slot, and the caller runs its exact pass. Call
// with one whole block; the result goes to every thread.
#define SLOT_BITMAP_BITS 8192
#define SLOT_SKIP (-(1LL << 62))  // a sequence whose slot is not checked (no tokens)
template <typename Slot>
__device__ bool slots_distinct_fast(i64 n, i64 n_slots, Slot slot) {
    __shared__ u32 seen[SLOT_BITMAP_BITS / 32];
    if (n_slots > SLOT_BITMAP_BITS) return false;
    for (i64 i = threadIdx.x; i < (n_slots + 31) / 32; i += blockDim.x) seen[i] = 0u;
    __syncthreads();
    bool bad = false;
    for (i64 s = threadIdx.x; s < n; s += blockDim.x) {
        const i64 v = slot(s);
        if (v == SLOT_SKIP) continue;
        bad = bad || v < 0 || v >= n_slots || ((atomicOr(&seen[v >> 5], 1u << (v & 31)) >> (v & 31)) & 1u);
    }
    return !__syncthreads_or(bad);
}

// Slots must be in range and distinct; the first bad one in sequence order is reported, as
// `tessera_ops::checked_slots` does. Call with one whole block; sequence s is bad when its slot is
// out of range or an earlier sequence names the same slot. Kernels that write state run after it
// on the stream and return early when the error record is set (or, checking in every block, on
// the result: true, to every thread, when the slots are fine). The bitmap pass decides; the
// exact pass below runs only to find the slot to report (or past the bitmap's size).
__device__ bool check_state_slots(const Tensor& slots, i64 n_slots, u64 err, u32 op) {
    i64 n = slots.ne[0];
    if (slots_distinct_fast(n, n_slots, [&](i64 s) -> i64 { return *(const int*)(slots.data + s * slots.nb[0]); })) return true;
    __shared__ long long first_bad;
    if (threadIdx.x == 0) first_bad = 0x7fffffffffffffffLL;
    __syncthreads();
    for (i64 s = threadIdx.x; s < n; s += blockDim.x) {
        i64 v = *(const int*)(slots.data + s * slots.nb[0]);
        bool bad = v < 0 || v >= n_slots;
        for (i64 e = 0; e < s && !bad; e++) bad = *(const int*)(slots.data + e * slots.nb[0]) == v;
        if (bad) atomicMin(&first_bad, (long long)s);
    }
    __syncthreads();
    const bool ok = first_bad >= n;
    if (threadIdx.x != 0 || ok) return ok;
    i64 s = first_bad;
    i64 v = *(const int*)(slots.data + s * slots.nb[0]);
    if (v < 0 || v >= n_slots) {
        report_error((ErrorRecord*)err, ERR_INDEX_OUT_OF_RANGE, WHAT_STATE_SLOT, op, v, n_slots, 0, 0);
        return false;
    }
    i64 e = 0;
    while (*(const int*)(slots.data + e * slots.nb[0]) != v) e++;
    report_error((ErrorRecord*)err, ERR_DUPLICATE_INDEX, WHAT_STATE_SLOT, op, v, n_slots, e, s);
    return false;
}

// A ragged batch's `seq_offsets` (i32 [n_seq + 1]) must be non-decreasing within 0..=n_tokens;
// the first bad one in order is reported, as `tessera_ops::checked_seq_offsets` does. Call with one
// whole block; returns (to every thread) whether the offsets are valid. Kernels that read the
// offsets clamp them, so bad values never send a read or write out of bounds. Every position is
// checked in parallel against its predecessor: the first bad position's predecessors are all
// good, so its allowed range is the same as in the sequential rule.
__device__ bool check_seq_offsets(const Tensor& offsets, i64 n_tokens, u64 err, u32 op) {
    __shared__ long long first_bad_offset;
    if (threadIdx.x == 0) first_bad_offset = 0x7fffffffffffffffLL;
    __syncthreads();
    const i64 n = offsets.ne[0];
    auto at = [&](i64 i) -> i64 { return *(const int*)(offsets.data + i * offsets.nb[0]); };
    for (i64 i = threadIdx.x; i < n; i += blockDim.x) {
        const i64 v = at(i), low = i > 0 ? at(i - 1) : 0;
        if (v < low || v > n_tokens) atomicMin(&first_bad_offset, (long long)i);
    }
    __syncthreads();
    const long long bad = first_bad_offset;
    if (bad < n && threadIdx.x == 0) {
        const i64 low = bad > 0 ? at(bad - 1) : 0;
        report_error((ErrorRecord*)err, ERR_VALUE_OUT_OF_RANGE, WHAT_SEQ_OFFSETS, op, at(bad), n_tokens, bad, low);
    }
    __syncthreads();  // first_bad_offset is read before any later use of the shared memory
    return bad >= n;
}

// seq_offsets[i] of a ragged batch, clamped to 0..=n_tokens. Kernels read offsets only after
// check_seq_offsets passed (they do nothing once an error is recorded); the clamp keeps every
// address in bounds regardless.
__device__ __forceinline__ i64 seq_offset(const Tensor& offsets, i64 i, i64 n_tokens) {
    const i64 v = *(const int*)(offsets.data + i * offsets.nb[0]);
    return v < 0 ? 0 : (v > n_tokens ? n_tokens : v);
}

// The sequence that owns packed token u of a ragged batch: the last s < n_seq with
// seq_offsets[s] <= u, or -1 when u is padding (before seq_offsets[0] or from seq_offsets[n_seq]
// on). A binary search over the n_seq + 1 offsets.
__device__ __forceinline__ i64 seq_of_token(const Tensor& offsets, i64 n_seq, i64 u, i64 n_tokens) {
    i64 lo = 0, hi = n_seq + 1;  // first index with offset > u lies in [lo, hi]
    while (lo < hi) {
        const i64 mid = (lo + hi) >> 1;
        if (seq_offset(offsets, mid, n_tokens) > u) hi = mid;
        else lo = mid + 1;
    }
    return lo >= 1 && lo <= n_seq ? lo - 1 : -1;
}

// The slots of a ragged batch's sequences that have tokens (`seq_offsets[s] < seq_offsets[s + 1]`,
// offsets already checked) must be in range and distinct among themselves; sequences without
// tokens are skipped. The first bad one in sequence order is reported, as
// `tessera_ops::checked_ragged_slots` does. Call with one whole block. The bitmap pass
// (`slots_distinct_fast`) decides; past it (a bad slot, or more slots than the bitmap holds) up to
// RAGGED_STAGE sequences' slots (-1 for none) are staged in shared memory, and each thread
// compares its slot with all earlier ones without an early exit, so the loads pipeline. Returns
// (to every thread) whether they are all fine.
#define RAGGED_STAGE 2048
__device__ bool check_ragged_state_slots(const Tensor& slots, const Tensor& offsets, i64 n_slots, u64 err, u32 op) {
    __shared__ long long first_bad_ragged;
    __shared__ int staged[RAGGED_STAGE];
    const i64 n = slots.ne[0];
    auto slot = [&](i64 s) -> i64 { return *(const int*)(slots.data + s * slots.nb[0]); };
    auto has_tokens = [&](i64 s) -> bool {
        return *(const int*)(offsets.data + s * offsets.nb[0]) < *(const int*)(offsets.data + (s + 1) * offsets.nb[0]);
    };
    // The slot of sequence s if it has tokens, else -1 (never equal to a slot in range).
    auto active = [&](i64 s) -> i64 { return has_tokens(s) ? slot(s) : -1; };
    if (slots_distinct_fast(n, n_slots, [&](i64 s) -> i64 { return has_tokens(s) ? slot(s) : SLOT_SKIP; })) return true;
    if (threadIdx.x == 0) first_bad_ragged = 0x7fffffffffffffffLL;
    for (i64 s = threadIdx.x; s < n && s < RAGGED_STAGE; s += blockDim.x) staged[s] = (int)active(s);
    __syncthreads();
    for (i64 s = threadIdx.x; s < n; s += blockDim.x) {
        const i64 v = s < RAGGED_STAGE ? staged[s] : active(s);
        if (v == -1 && !has_tokens(s)) continue;
        bool bad = v < 0 || v >= n_slots;
        for (i64 e = 0; e < s; e++) bad |= (e < RAGGED_STAGE ? staged[e] : active(e)) == v;
        if (bad) atomicMin(&first_bad_ragged, (long long)s);
    }
    __syncthreads();
    const bool ok = first_bad_ragged >= n;
    if (threadIdx.x != 0 || ok) return ok;
    const i64 s = first_bad_ragged, v = slot(s);
    if (v < 0 || v >= n_slots) {
        report_error((ErrorRecord*)err, ERR_INDEX_OUT_OF_RANGE, WHAT_STATE_SLOT, op, v, n_slots, 0, 0);
        return false;
    }
    i64 e = 0;
    while (!has_tokens(e) || slot(e) != v) e++;
    report_error((ErrorRecord*)err, ERR_DUPLICATE_INDEX, WHAT_STATE_SLOT, op, v, n_slots, e, s);
    return false;
}

// ---- Tensor-core building blocks (sm_80+ PTX): shared-memory addresses, cp.async, ldmatrix and
// the bf16 / f16 m16n8k16 mma with f32 accumulators.

// The 32-bit shared-window address PTX's shared-memory instructions take.
__device__ __forceinline__ u32 tc_smem(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
// Asynchronous global -> shared copies of 16 or 4 bytes to a shared-window address; `valid ==
// false` zero-fills instead of reading (the source is not touched).
__device__ __forceinline__ void tc_cp16_at(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
}
__device__ __forceinline__ void tc_cp4_at(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0) : "memory");
}
// The same at a generic pointer into shared memory.
__device__ __forceinline__ void tc_cp16(void* dst, const void* src, bool valid) { tc_cp16_at(tc_smem(dst), src, valid); }
__device__ __forceinline__ void tc_cp4(void* dst, const void* src, bool valid) { tc_cp4_at(tc_smem(dst), src, valid); }
__device__ __forceinline__ void tc_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Waits until at most N of this thread's committed copy groups are still in flight.
template <int N>
__device__ __forceinline__ void tc_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }
// Orders this thread's earlier generic-proxy shared accesses (stores, cp.async) before later
// async-proxy ones (wgmma operand reads, bulk copies). sm_90+.
__device__ __forceinline__ void tc_fence_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// wgmma (sm_90a) building blocks. Operand tiles in shared memory are 1024-byte aligned groups of
// 8 rows of 128 bytes whose 16-byte chunks are XOR-swizzled (chunk c of row r at c ^ (r % 8)):
// Hopper's 128-byte swizzle.
//
// Descriptor of a K-major operand tile (rows of 64 16-bit k values): 8-row groups 1024 bytes
// apart. Adding 2 moves the start 32 bytes (16 values) along k.
__device__ __forceinline__ u64 wg_desc(const void* tile) {
    const u64 a = tc_smem(tile);
    return ((a & 0x3FFFF) >> 4) | (1ull << 16) | ((u64)(1024 >> 4) << 32) | (1ull << 62);
}
// Descriptor of an MN-major operand (rows of 64 consecutive 16-bit n values, one row per k; used
// with the transpose flag): 8 k-rows 1024 bytes apart, the next 64 n `mn_stride` bytes on.
__device__ __forceinline__ u64 wg_desc_mn(const void* tile, u32 mn_stride) {
    const u64 a = tc_smem(tile);
    return ((a & 0x3FFFF) >> 4) | ((u64)(mn_stride >> 4) << 16) | ((u64)(1024 >> 4) << 32) | (1ull << 62);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
// Waits until at most N of the warpgroup's committed wgmma groups are still running.
template <int N>
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }
#endif
// Four 8x8 b16 matrices: lanes 8i .. 8i + 7 give the row addresses of matrix i; register i of lane
// l receives matrix i's row l / 4, elements 2 (l % 4) and 2 (l % 4) + 1.
// (Of 32-bit values, 8 rows of 4: register i of lane l receives matrix i's value (l / 4, l % 4).)
__device__ __forceinline__ void tc_ldsm4_at(u32* r, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void tc_ldsm4(u32* r, const void* p) { tc_ldsm4_at(r, tc_smem(p)); }
// The same, each matrix transposed: register i of lane l receives matrix i's column l / 4,
// elements 2 (l % 4) and 2 (l % 4) + 1 (rows).
__device__ __forceinline__ void tc_ldsm4_trans_at(u32* r, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void tc_ldsm4_trans(u32* r, const void* p) { tc_ldsm4_trans_at(r, tc_smem(p)); }
// c += a * b for one m16n8k16 tile, bf16 operands (row-major A, column-major B), f32 accumulators.
__device__ __forceinline__ void tc_mma_bf16(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// c += a * b for one m16n8k16 tile, f16 operands (row-major A, column-major B), f32 accumulators.
__device__ __forceinline__ void tc_mma_f16(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Split K's hand-over: after a block stored its partial sums, whether it is the last of the
// `splits` blocks of its tile to get here (counted in *counter). The fences order every block's
// stores before its count and the last block's count before its reads of the others' partials.
// Call with the whole block; the last block resets *counter to 0 once it has read them.
__device__ __forceinline__ bool split_last_arrival(unsigned* counter, int splits) {
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(counter, 1u) == (unsigned)splits - 1;
    __syncthreads();
    if (!last) return false;
    __threadfence();
    return true;
}

// Split tf32 (3xTF32): x ~ hi + lo with hi = x truncated to tf32 and lo = tf32(x - hi) rounded to
// nearest; hi + lo keeps about 21 significant bits of x. Truncation keeps every finite x's hi
// finite (rounding the largest ones up would give inf - inf = NaN), an infinite x gets lo = 0 and
// a NaN the canonical NaN (whose payload survives the mma's 13 dropped bits). Returned as the
// .b32 operand registers of the tf32 mma (low 13 bits zero).
__device__ __forceinline__ void tc_split_tf32(u32 x, u32& hi, u32& lo) {
    const bool nan = (x & 0x7fffffffu) > 0x7f800000u;
    hi = nan ? 0x7fffffffu : x & 0xffffe000u;
    const float r = __uint_as_float(x) - __uint_as_float(hi);  // exact for finite x
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(lo) : "f"(r == r ? r : 0.0f));
}
// c += a * b for one m16n8k8 tile, tf32 operands (row-major A, column-major B), f32 accumulators.
// Fragments (lane = 4 g + t): A a0 (g, t), a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4); B b0
// (k t, n g), b1 (k t + 4, n g); C c0 (g, 2t), c1 (g, 2t + 1), c2 (g + 8, 2t), c3 (g + 8, 2t + 1).
__device__ __forceinline__ void tc_mma_tf32(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
