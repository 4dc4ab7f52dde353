// gemv_one.cu: mul_mat of one token against one weight matrix, a decode step's projections.
// Such a product is one pass over the weights and nothing else, so these kernels are built to
// keep that stream near the device's copy bandwidth: each thread keeps its share of the
// activations in registers for every row, and the next rows' loads are in flight while the
// current ones are multiplied.
//
// - `gemv_ring_{q8_0,nvfp4}_s{3,4}`, `gemv_ring_nvfp4_producer_s4`: contiguous q8_0 / nvfp4 rows
//   streamed through a ring of 3 or 4 shared-memory stages (bulk copies on sm_90+, cp.async on
//   sm_80), a thread per 64-value unit of the row with its activations quantized in the kernel;
//   `gemv_ring_{q8_0,nvfp4}_t2_s{3,4}` the same for two tokens, each row read once for both.
// - `gemv_f16w` / `gemv_bf16w[_long]` / `gemv_f32w[_long]`: f16 / bf16 / f32 rows of 16-byte
//   words, a thread per 2 or 5 words of every row with their activations (packed by `pack_b`) in
//   registers.

// ---------------------------------------------------------------------------------------------
// The ring GEMV over q8_0 / nvfp4 weights (`gemv_ring_q8_0_s*`, `gemv_ring_nvfp4_s*`): one
// weight matrix of contiguous rows (row r at r * row_bytes, 16-byte aligned), k % 256 == 0, one
// activation row.
//
// A row is read in units of 64 values: one nvfp4 block (36 bytes) or two q8_0 blocks (68 bytes),
// both 4-byte aligned. Thread (g, j) of a block owns unit j of the rows of group g, so its 64
// activations live in registers as int16 pairs (no separate quantization kernel: group 0
// quantizes each unit once, in shared memory, and every group reads the result; quantizing in
// every thread added a tenth to the kernel's instructions). Each block streams a contiguous
// range of rows through a ring of S shared-memory stages, S - 1 stages of rows_stage rows in
// flight (S = 3 or 4, an entry point each: the host picks by the device's memory bandwidth): on
// sm_90+ one thread copies each stage with bulk (TMA) copies completing on the stage's mbarrier
// (no per-16-byte copy instructions, faster than cp.async for both types; which thread:
// `copier`; unless nvfp4 is bound by its arithmetic it also has L2 fetch each stage it copies:
// `l2_prefetch`), on sm_80 every thread copies 16-byte pieces with cp.async; one block barrier a
// stage frees the buffer before it is refilled (in `gemv_ring_nvfp4_producer_s4` a warp of its
// own copies and adds up instead, paced by per-stage mbarriers: no block barrier in the loop). A
// thread reads its unit with 4-byte shared loads (no bank conflicts: the unit strides 9 and 17
// words are odd) and writes one partial per row (nvfp4: two rows at a time, interleaved, for
// instruction-level parallelism), and during the next stage a few warps (or the producer warp)
// add up the partials of each row. Per unit: q8_0 32 dp2a (int16 activations x int8 quants) and
// 2 f16 scales; nvfp4 8 code words, each decoded with 4 byte permutes into the E2M1 values + 128
// as unsigned bytes, 4 dp2a per word (the +128 is taken back by a per-sub-block constant folded
// into the dot's start), 4 UE4M3 scales decoded as f16.

// TAG(gemv-ring-consts): GR_MAX_THREADS, GR_MAX_THREADS_NVFP4, GR_MAX_THREADS_T2,
// GR_MAX_THREADS_T4 and GR_XSTRIDE are mirrored in src/ops/matmul/gemv_one.rs. nvfp4, bound by
// its arithmetic, takes more warps (96 registers fit 640 threads): 8 groups of 80 units instead
// of 7 at k = 5120.
#define GR_MAX_THREADS 576
#define GR_MAX_THREADS_NVFP4 640
// The two-token entries' (`_t2_`): their second token's 37 words of activations take registers.
#define GR_MAX_THREADS_T2 512
// The three- and four-token entries' (`_t3_`, `_t4_`): 3 or 4 x 37 words of activations a thread
// (at 288 threads or more ptxas held the four-token ones to 168 registers and spilled).
#define GR_MAX_THREADS_T4 256
// Bytes of staged f32 activations per 64-value unit: 256 and 16 of padding, so that the
// threads' 16-byte reads of their own units spread over all banks.
#define GR_XSTRIDE 272
// E2M1 magnitudes times 2 (0, 0.5, 1, 1.5, 2, 3, 4, 6), bytes 0..7 of the lookup pair.
#define GR_E2M1_LO 0x03020100u
#define GR_E2M1_HI 0x0C080604u

// PTX prmt in its default mode: selector nibble i picks byte (nibble & 7) of {b, a} into byte i,
// and a nibble with its top bit set replicates that byte's sign bit instead (`__byte_perm` masks
// the top bits away, so it cannot do this).
__device__ __forceinline__ u32 gr_prmt(u32 a, u32 b, u32 s) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(s));
    return d;
}

// c + a.lo16 * b.byte0 + a.hi16 * b.byte1 (`lo`) or bytes 2 and 3 (`hi`); a holds two int16,
// b four signed (`ss`) or unsigned (`su`) bytes.
#define GR_DP2A(NAME, PTX)                                           \
    __device__ __forceinline__ int NAME(u32 a, u32 b, int c) {       \
        int d;                                                        \
        asm(PTX " %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c)); \
        return d;                                                     \
    }
GR_DP2A(gr_dp2a_lo_ss, "dp2a.lo.s32.s32")
GR_DP2A(gr_dp2a_hi_ss, "dp2a.hi.s32.s32")
GR_DP2A(gr_dp2a_lo_su, "dp2a.lo.s32.u32")
GR_DP2A(gr_dp2a_hi_su, "dp2a.hi.s32.u32")

// sm_90+: bulk (TMA) copies global -> shared completing on an mbarrier (one per stage buffer).
#if __CUDA_ARCH__ >= 900
__device__ __forceinline__ void gr_bar_expect(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void gr_bulk(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst), "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}
// Asks L2 for bytes at src (16-byte aligned, a multiple of 16), completing on nothing.
__device__ __forceinline__ void gr_prefetch_l2(const void* src, u32 bytes) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
}
#endif

// Two int16 in one word, a in the low half.
__device__ __forceinline__ u32 gr_pair(int a, int b) { return ((u32)a & 0xffffu) | ((u32)b << 16); }

// Four E2M1 codes (the nibbles of the low 16 bits of p; the same codes with their sign bits
// flipped in n) to unsigned bytes 2 * value + 128: the positive codes look up their magnitude in
// p (negative ones replicate a clear sign bit: 0), the negative ones in n, and p + 128 - n never
// carries between bytes. `lo` is GR_E2M1_LO in a register.
__device__ __forceinline__ u32 gr_e2m1x4(u32 lo, u32 p, u32 n) {
    return gr_prmt(lo, GR_E2M1_HI, p) + 0x80808080u - gr_prmt(lo, GR_E2M1_HI, n);
}

// UE4M3 scales (the four bytes of sw) as f16 bit patterns (code & 0x7f) << 7 (= value / 256),
// to f32; 0x7F alone reads 0: bit 7 of `nz` is clear exactly for the bytes equal to 0x7F, and the
// sign-replicating prmt turns those bits into byte masks.
__device__ __forceinline__ void gr_ue4m3x4(u32 sw, float* ws) {
    const u32 nz = ((~sw & 0x7f7f7f7fu) + 0x7f7f7f7fu) | sw;
    const u32 c7 = sw & gr_prmt(nz, 0u, 0xBA98u) & 0x7f7f7f7fu;
    const u32 h01 = gr_prmt(c7, 0u, 0x1404u) >> 1, h23 = gr_prmt(c7, 0u, 0x3424u) >> 1;
    ws[0] = f16_to_f32((u16)h01);
    ws[1] = f16_to_f32((u16)(h01 >> 16));
    ws[2] = f16_to_f32((u16)h23);
    ws[3] = f16_to_f32((u16)(h23 >> 16));
}

// R nvfp4 blocks (9 words at w + i * stride each, i < R) . the same 64 activations of each of NT
// tokens, in lockstep so that the R x NT independent chains interleave (each code word decoded
// once for the NT tokens): x[32 t + 8 s + 4 h + i] holds token t's int16 pair of values
// 16 s + 4 h + i and + 8 (code word 1 + 2 s + h, bytes i), cs[4 t + s] = -128 * (sum of its int16
// activations of sub-block s); lo = GR_E2M1_LO. out[NT i + t] = sum_s scale_s / 256 * dot_s
// (E2M1 values times 2).
template <int R, int NT = 1>
__device__ __forceinline__ void gr_units_nvfp4(const u32* w, int stride, const u32* x, const int* cs, u32 lo, float* out) {
    u32 u[R][9];
#pragma unroll
    for (int r = 0; r < R; r++) {
#pragma unroll
        for (int i = 0; i < 9; i++) u[r][i] = w[r * stride + i];
    }
    float ws[R][4];
#pragma unroll
    for (int r = 0; r < R; r++) {
        gr_ue4m3x4(u[r][0], ws[r]);
#pragma unroll
        for (int t = 0; t < NT; t++) out[NT * r + t] = 0.0f;
    }
#pragma unroll
    for (int s = 0; s < 4; s++) {
        int dot[R][NT];
#pragma unroll
        for (int r = 0; r < R; r++) {
#pragma unroll
            for (int t = 0; t < NT; t++) dot[r][t] = cs[4 * t + s];
        }
#pragma unroll
        for (int h = 0; h < 2; h++) {
#pragma unroll
            for (int r = 0; r < R; r++) {
                const u32 q = u[r][1 + 2 * s + h], n = q ^ 0x88888888u;
                const u32 d0 = gr_e2m1x4(lo, q, n), d1 = gr_e2m1x4(lo, q >> 16, n >> 16);
#pragma unroll
                for (int t = 0; t < NT; t++) {
                    const u32* xp = x + 32 * t + 8 * s + 4 * h;
                    dot[r][t] = gr_dp2a_lo_su(xp[0], d0, dot[r][t]);
                    dot[r][t] = gr_dp2a_hi_su(xp[1], d0, dot[r][t]);
                    dot[r][t] = gr_dp2a_lo_su(xp[2], d1, dot[r][t]);
                    dot[r][t] = gr_dp2a_hi_su(xp[3], d1, dot[r][t]);
                }
            }
        }
#pragma unroll
        for (int r = 0; r < R; r++) {
#pragma unroll
            for (int t = 0; t < NT; t++) out[NT * r + t] = fmaf((float)dot[r][t], ws[r][s], out[NT * r + t]);
        }
    }
}

// Two q8_0 blocks (17 words u: f16 scale, 32 quants, f16 scale, 32 quants) . their 64
// activations, x[p] the int16 pair of values 2 p and 2 p + 1. Two dp2a chains per block.
__device__ __forceinline__ float gr_dot_q8_0(const u32 (&u)[17], const u32* x) {
    // block 0: quants at bytes 2 .. 33 (words 0 hi, 1 .. 7, 8 lo); block 1 at bytes 36 .. 67
    int a0 = gr_dp2a_hi_ss(x[0], u[0], 0), a1 = 0;
#pragma unroll
    for (int i = 1; i < 8; i++) {
        a0 = gr_dp2a_lo_ss(x[2 * i - 1], u[i], a0);
        a1 = gr_dp2a_hi_ss(x[2 * i], u[i], a1);
    }
    a0 = gr_dp2a_lo_ss(x[15], u[8], a0);
    int b0 = 0, b1 = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        b0 = gr_dp2a_lo_ss(x[16 + 2 * i], u[9 + i], b0);
        b1 = gr_dp2a_hi_ss(x[17 + 2 * i], u[9 + i], b1);
    }
    return fmaf((float)(a0 + a1), f16_to_f32((u16)u[0]), (float)(b0 + b1) * f16_to_f32((u16)(u[8] >> 16)));
}

// The same for the two q8_0 blocks at w (17 words).
__device__ __forceinline__ float gr_unit_q8_0(const u32* w, const u32* x) {
    u32 u[17];
#pragma unroll
    for (int i = 0; i < 17; i++) u[i] = w[i];
    return gr_dot_q8_0(u, x);
}

// Quantizes one unit of 64 staged f32 activations (16-byte aligned, GR_XSTRIDE bytes) in place
// to what the unit dots read: words 0-31 the int16 pairs (q8_0: x[p] = values 2 p, 2 p + 1;
// nvfp4: x[8 s + 4 h + i] = values 16 s + 4 h + i and + 8, matching code word 1 + 2 s + h),
// words 32-35 nvfp4's cs[s] = -128 * (sum of sub-block s's int16 values), word 36 the f32 scale
// (|x - dx q| <= dx / 2, dx = amax / 32767; nvfp4's times 128: its E2M1 values are doubled and
// its scales read as value / 256).
template <int DT>
__device__ __forceinline__ void gr_quantize_unit(u32* slot) {
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
                    w[8 * s + 4 * h + i] = gr_pair(q[e], q[e + 8]);
                    sum += q[e] + q[e + 8];
                }
            }
            w[32 + s] = (u32)(-128 * sum);
        }
    } else {
#pragma unroll
        for (int p = 0; p < 32; p++) w[p] = gr_pair(q[2 * p], q[2 * p + 1]);
#pragma unroll
        for (int s = 0; s < 4; s++) w[32 + s] = 0u;
    }
    w[36] = __float_as_uint(dx);
#pragma unroll
    for (int i = 0; i < 9; i++) ((uint4*)slot)[i] = make_uint4(w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]);
    slot[36] = w[36];
}

// Quantizes n units of 64 staged f32 activations (unit t at xa + GR_XSTRIDE t, 16-byte aligned)
// in place to what the unit dots read: words 0-31 the int16 pairs (q8_0: x[p] = values 2 p, 2 p + 1;
// nvfp4: x[8 s + 4 h + i] = values 16 s + 4 h + i and + 8, matching code word 1 + 2 s + h), words
// 32-35 nvfp4's cs[s] = -128 * (sum of sub-block s's int16 values), word 36 the f32 scale
// (|x - dx q| <= dx / 2, dx = amax / 32767; nvfp4's times 128: its E2M1 values are doubled and
// its scales read as value / 256): the same words as gr_quantize_unit, eight consecutive threads a
// unit, the 8 values of the 4 words each writes (the unit's amax and sub-block sums by shuffles).
// `moe_ring_*`, whose blocks stream few rows, take it: there one thread's 64-value chain was a
// large part of the block's time; the dense ring keeps gr_quantize_unit (the 8-thread form made it
// slower: docs/perf-log/kernels-matmul.md). Call with every thread of the block (shuffles and warp
// barriers; a whole number of warps).
template <int DT>
__device__ __forceinline__ void gr_quantize_units(char* xa, int n) {
    const int p = threadIdx.x & 7;
    // nvfp4: words 8 s + 4 h .. + 3 (s = p / 2, h = p % 2) pair values e0 + i and e0 + 8 + i;
    // q8_0: words 4 p .. + 3 hold values 8 p .. 8 p + 7
    const int e0 = DT == DT_NVFP4 ? 16 * (p >> 1) + 4 * (p & 1) : 8 * p, e1 = DT == DT_NVFP4 ? e0 + 8 : e0 + 4;
    for (int t0 = 0; t0 < n; t0 += (int)blockDim.x >> 3) {
        const int t = t0 + ((int)threadIdx.x >> 3);
        const bool live = t < n;
        float* slot = (float*)(xa + GR_XSTRIDE * (live ? t : 0));
        const float4 z = make_float4(0.f, 0.f, 0.f, 0.f), a = live ? *(const float4*)(slot + e0) : z, b = live ? *(const float4*)(slot + e1) : z;
        const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        float amax = 0.0f;
#pragma unroll
        for (int e = 0; e < 8; e++) amax = fmaxf(amax, fabsf(v[e]));
#pragma unroll
        for (int o = 4; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        const float id = amax > 0.0f ? 32767.0f / amax : 0.0f;
        int q[8], sum = 0;
#pragma unroll
        for (int e = 0; e < 8; e++) {
            q[e] = (int)fminf(fmaxf(rintf(v[e] * id), -32767.0f), 32767.0f);
            sum += q[e];
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);  // the sub-block's other half (nvfp4)
        __syncwarp();  // every value of the warp's units is read before any word overwrites it
        if (live) {
            u32* w = (u32*)slot;
            if (DT == DT_NVFP4) {
                *(uint4*)(w + 4 * p) = make_uint4(gr_pair(q[0], q[4]), gr_pair(q[1], q[5]), gr_pair(q[2], q[6]), gr_pair(q[3], q[7]));
                if ((p & 1) == 0) w[32 + (p >> 1)] = (u32)(-128 * sum);
            } else {
                *(uint4*)(w + 4 * p) = make_uint4(gr_pair(q[0], q[1]), gr_pair(q[2], q[3]), gr_pair(q[4], q[5]), gr_pair(q[6], q[7]));
                if (p < 4) w[32 + p] = 0u;
            }
            if (p == 0) w[36] = __float_as_uint(DT == DT_NVFP4 ? amax / 32767.0f * 128.0f : amax / 32767.0f);
        }
        __syncwarp();
    }
}

// A thread's quantized unit of activations (words as the quantization wrote them, at q) into
// registers: the 32 int16 pairs, nvfp4's four sub-block constants, the scale.
template <int DT>
__device__ __forceinline__ void gr_unit_words(const uint4* q, u32 (&x)[32], int (&cs)[4], float& dx) {
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

// Stages n4 float4 of f32 activations, float4 c at xa + 16 c + 16 (c >> 4) (unit c / 16 at
// GR_XSTRIDE bytes a unit), V a thread a round: xv holds the first round's loads, issued by the
// caller before it started the weight copies; the later rounds load through load_x(c).
template <int V, typename Load>
__device__ __forceinline__ void gr_stage_x(char* xa, float4 (&xv)[V], int n4, Load load_x) {
    const int tid = threadIdx.x, nt = blockDim.x;
    for (int c0 = tid; c0 < n4; c0 += V * nt) {
        if (c0 != tid) {
#pragma unroll
            for (int i = 0; i < V; i++) {
                if (c0 + i * nt < n4) xv[i] = load_x(c0 + i * nt);
            }
        }
#pragma unroll
        for (int i = 0; i < V; i++) {
            const int c = c0 + i * nt;
            if (c < n4) *(float4*)(xa + 16 * c + 16 * (c >> 4)) = xv[i];
        }
    }
}

// out[m, t] = a row m . b[:, t] for the rows [m0, m1) of this block (an even split over the grid)
// and the NT tokens t (columns of b: each row read once for all of them); see above. `groups`
// groups of nu = k / 64 threads (the rest idle in the arithmetic), `rows_stage` rows a stage (a
// multiple of groups). A thread holds its unit's activations of every token; with NT > 1 each
// nvfp4 code word is decoded once for the tokens, one row at a time. P (sm_90+ only, NT = 1):
// the block's last warp, beyond the groups' threads, copies and adds up instead. Dynamic shared
// memory: S stages of rows_stage rows, then 2 (P: S + 1) x NT x rp x nu partials (rp =
// rows_stage | 1: an odd stride between a row's partials keeps their stores and sums free of bank
// conflicts); the NT tokens' f32 activations are staged over the last stage and the partials
// before the loop (the host sizes it for the larger of the two).
template <int DT, int S, bool P, int NT>
__device__ __forceinline__ void gemv_ring_body(const Tensor& a, const Tensor& b, const Tensor& out, int groups, int rows_stage) {
    static_assert(!P || NT == 1, "the producer entry takes one token");
    constexpr int UB = DT == DT_NVFP4 ? NVFP4_BYTES : 2 * Q8_0_BYTES;
    extern __shared__ __align__(16) char gr_shared[];
    const int tid = threadIdx.x, nt = blockDim.x;
    const int nu = (int)(a.ne[0] / 64), row_bytes = nu * UB, stage_bytes = rows_stage * row_bytes, rp = rows_stage | 1;
    // floats of a stage's partials: token t's at t * rp * nu
    const int pb = NT * rp * nu;
    const i64 rows = a.ne[1];
    const i64 m0 = (i64)blockIdx.x * rows / gridDim.x, m1 = ((i64)blockIdx.x + 1) * rows / gridDim.x;
    const int nst = (int)((m1 - m0 + rows_stage - 1) / rows_stage);
    float* parts = (float*)(gr_shared + S * stage_bytes);
    char* xf = gr_shared + (S - 1) * stage_bytes;
    const u32 ring = tc_smem(gr_shared);
    const char* src0 = a.data + m0 * row_bytes;
    auto stage_rows = [&](int s) { return (int)min((i64)rows_stage, m1 - m0 - (i64)s * rows_stage); };
#if __CUDA_ARCH__ >= 900
    // full barriers (stage s landed: bars + 8 (s % S)) and, with P, empty ones (every other
    // thread is done with stage s: empty + 8 (s % S))
    __shared__ __align__(8) u64 gr_bars[P ? 2 * S : S];
    const u32 bars = tc_smem(gr_bars), empty = bars + 8 * S;
    // Issuing a stage's copies holds the issuing thread for hundreds of cycles, so that thread is
    // the block's last: warp 0 also adds up partials, and as the copier it held every stage's
    // barrier (with the ring of 3 the last thread alone made nvfp4's long rows slower, which the
    // L2 prefetch below wins back; docs/perf-log/kernels-matmul.md).
    const int copier = nt - 1;
    // Unless nvfp4 is bound by its arithmetic (the ring of 4: an H200), the copier also has L2
    // fetch each stage it copies in the loop, right after the copies, and stage S - 1 at the
    // start (its buffer holds the activations until they are quantized). Chosen by measurement,
    // the mechanism not isolated: as fast or faster with the ring of 3 and for q8_0, slower for
    // nvfp4 with the ring of 4; issued before the copies, or a stage ahead of them, it was slower
    // (docs/perf-log/kernels-matmul.md).
    constexpr bool l2_prefetch = !(DT == DT_NVFP4 && S == 4);
    // bulk path: the copier issues stage s (contiguous rows) in pieces of at most 32 KiB, all
    // completing on the buffer's barrier
    auto issue_bulk = [&](int s) {
        if (s >= nst) return;
        const u32 bytes = (u32)(stage_rows(s) * row_bytes), bar = bars + 8 * (s % S);
        const u32 dst = ring + (u32)((s % S) * stage_bytes);
        const char* src = src0 + (i64)s * stage_bytes;
        gr_bar_expect(bar, bytes);
        for (u32 o = 0; o < bytes; o += 32768u) gr_bulk(dst + o, src + o, min(bytes - o, 32768u), bar);
    };
    auto prefetch_l2 = [&](int s) {
        if (s >= nst) return;
        const u32 bytes = (u32)(stage_rows(s) * row_bytes);
        const char* src = src0 + (i64)s * stage_bytes;
        for (u32 o = 0; o < bytes; o += 32768u) gr_prefetch_l2(src + o, min(bytes - o, 32768u));
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

    // The activations as f32, token t's unit j at xf + GR_XSTRIDE (t nu + j): the first loads go
    // out before the first stages' copies (they are L2 hits that should not queue behind them).
    const bool vec = b.nb[0] == 4 && ((u64)b.data & 15) == 0 && (NT == 1 || b.nb[1] % 16 == 0);
    const int n4 = nu * 16;  // float4 a token
    auto load_x = [&](int c) {
        const int t = NT == 1 ? 0 : c / n4, e = c - t * n4;
        const char* row = b.data + (i64)t * b.nb[1];
        if (vec) return ((const float4*)row)[e];
        const char* p = row + 4 * (i64)e * b.nb[0];
        return make_float4(*(const float*)p, *(const float*)(p + b.nb[0]), *(const float*)(p + 2 * b.nb[0]), *(const float*)(p + 3 * b.nb[0]));
    };
    float4 xv[8];
#pragma unroll
    for (int i = 0; i < 8; i++) {
        if (tid + i * nt < NT * n4) xv[i] = load_x(tid + i * nt);
    }
#if __CUDA_ARCH__ >= 900
    if (tid == copier) {
#pragma unroll
        for (int i = 0; i < S; i++) {
            mb_init(bars + 8 * i, 1);
            if (P) mb_init(empty + 8 * i, nt - 32);
        }
        mb_fence_init();
#pragma unroll
        for (int s = 0; s < S - 1; s++) issue_bulk(s);
        if constexpr (l2_prefetch) prefetch_l2(S - 1);
    }
#else
#pragma unroll
    for (int s = 0; s < S - 1; s++) issue(s);
#endif
    gr_stage_x(xf, xv, NT * n4, load_x);
    __syncthreads();
    const int g = tid / nu, j = tid - g * nu;
    const bool worker = g < groups;
    // 0, but opaque and per thread: or-ed into values that the compiler would otherwise copy from
    // a uniform register or negate before every use.
    const u32 zero = (u32)(rows_stage + tid) & 0x80000000u;
    // Group t quantizes token t's units (each once, in place; groups 0 .. groups - 1 take the
    // tokens in turn); then every group reads its unit's words of every token. (One token keeps
    // its own form: the loop made ptxas spill the sm_80 nvfp4 entries.)
    if (NT == 1) {
        if (g == 0) gr_quantize_unit<DT>((u32*)(xf + GR_XSTRIDE * j));
    } else if (worker) {
        for (int t = g; t < NT; t += groups) gr_quantize_unit<DT>((u32*)(xf + GR_XSTRIDE * (t * nu + j)));
    }
    __syncthreads();
    u32 x[NT][32];
    int cs[NT][4];
    float dx[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) {
        cs[t][0] = cs[t][1] = cs[t][2] = cs[t][3] = 0;
        dx[t] = 0.0f;
        if (worker) gr_unit_words<DT>((const uint4*)(xf + GR_XSTRIDE * (t * nu + j)), x[t], cs[t], dx[t]);
    }

    // Row r of stage s: its nu partials at parts[(s & 1) rp nu + i rp + r], unit i. L
    // consecutive threads add up a row (every L-th partial each, then shuffles). nvfp4 takes L
    // growing with nu, so that a few warps do the work in few instructions (16 or 32 threads a
    // row took the same time); q8_0, bound by the copies, takes a warp a row, so that no warp lags
    // behind to the barrier that frees the next buffer (fewer lanes a row cost q8_0 copy
    // bandwidth).
    const int lg = DT == DT_Q8_0 ? 5 : nu <= 40 ? 2 : nu <= 80 ? 3 : nu <= 160 ? 4 : 5, L = 1 << lg, sub = tid & (L - 1);
    const int row_step = nt >> lg, warp_rows = 32 >> lg;
    auto reduce = [&](int s) {
        // row r of token t is item t n + r of the stage's NT n
        const int n = stage_rows(s), items = NT * n, n_warps = (items + warp_rows - 1) & -warp_rows;
        // whole warps take part in the shuffles
        for (int it = tid >> lg; it < n_warps; it += row_step) {
            const int t = NT == 1 ? 0 : min(it / n, NT - 1), r = it - t * n;
            const float* p = parts + (s & 1) * pb + t * rp * nu;
            float v0 = 0.0f, v1 = 0.0f;
            if (it < items) {
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
            if (sub == 0 && it < items) *(float*)(out.data + offset_of(out, m0 + (i64)s * rows_stage + r, t, 0, 0)) = v;
        }
    };
    const u32 e2m1_lo = GR_E2M1_LO | zero;
    // this thread's dots of stage s, partials into p
    auto dots = [&](int s, float* p) {
        if (!worker) return;
        const char* sb = gr_shared + (s % S) * stage_bytes;
        const int n = stage_rows(s);
        if (DT == DT_NVFP4 && NT > 1) {
            // a row at a time: its NT tokens' chains interleave
            for (int r = g; r < n; r += groups) {
                float v[NT];
                gr_units_nvfp4<1, NT>((const u32*)(sb + r * row_bytes + UB * j), 0, x[0], cs[0], e2m1_lo, v);
#pragma unroll
                for (int t = 0; t < NT; t++) p[t * rp * nu + j * rp + r] = dx[t] * v[t];
            }
        } else if (DT == DT_NVFP4) {
            // two rows at a time: two independent units for the scheduler to interleave
            for (int r = g; r < n; r += 2 * groups) {
                const u32* w = (const u32*)(sb + r * row_bytes + UB * j);
                float v[2];
                if (r + groups < n) {
                    gr_units_nvfp4<2>(w, groups * row_bytes / 4, x[0], cs[0], e2m1_lo, v);
                    p[j * rp + r + groups] = dx[0] * v[1];
                } else {
                    gr_units_nvfp4<1>(w, 0, x[0], cs[0], e2m1_lo, v);
                }
                p[j * rp + r] = dx[0] * v[0];
            }
        } else {
            for (int r = g; r < n; r += groups) {
                u32 u[17];
                const u32* w = (const u32*)(sb + r * row_bytes + UB * j);
#pragma unroll
                for (int i = 0; i < 17; i++) u[i] = w[i];
#pragma unroll
                for (int t = 0; t < NT; t++) p[t * rp * nu + j * rp + r] = dx[t] * gr_dot_q8_0(u, x[t]);
            }
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
        // lambda for both made this kernel markedly slower (docs/perf-log/kernels-matmul.md).
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
        auto wait_free = [&](int s) { mb_wait(empty + 8 * (s % S), (u32)(s / S) & 1u); };
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
                mb_wait(bars + 8 * (s % S), (u32)(s / S) & 1u);  // stage s landed
                dots(s, parts + (s % (S + 1)) * rp * nu);
                mb_arrive(empty + 8 * (s % S));
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
            mb_wait(bars + 8 * (s % S), (u32)(s / S) & 1u);  // stage s landed
#else
            tc_wait<S - 2>();
            // stage s landed for every thread; stage s - 1's buffer and partials are free
            __syncthreads();
            issue(s + S - 1);
            if (s > 0) reduce(s - 1);
#endif
            dots(s, parts + (s & 1) * pb);
        }
        __syncthreads();
        if (nst > 0) reduce(nst - 1);
    }
}

#define GR_ENTRY(NAME, DT, S, P, NT, THREADS)                                                          \
    extern "C" __global__ void __launch_bounds__(THREADS) NAME(Tensor a, Tensor b, Tensor out, int groups, \
                                                                int rows_stage) {                        \
        l2_prefetch_rows(a, DT, (i64)blockIdx.x * a.ne[1] / gridDim.x, a.ne[1] / gridDim.x + 1);         \
        grid_begin();                                                                                    \
        gemv_ring_body<DT, S, P, NT>(a, b, out, groups, rows_stage);                                     \
    }
GR_ENTRY(gemv_ring_q8_0_s3, DT_Q8_0, 3, false, 1, GR_MAX_THREADS)
GR_ENTRY(gemv_ring_q8_0_s4, DT_Q8_0, 4, false, 1, GR_MAX_THREADS)
GR_ENTRY(gemv_ring_nvfp4_s3, DT_NVFP4, 3, false, 1, GR_MAX_THREADS_NVFP4)
GR_ENTRY(gemv_ring_nvfp4_s4, DT_NVFP4, 4, false, 1, GR_MAX_THREADS_NVFP4)
// taken on sm_90+ with the ring of 4 only (before sm_90 it is the entry above)
GR_ENTRY(gemv_ring_nvfp4_producer_s4, DT_NVFP4, 4, true, 1, GR_MAX_THREADS_NVFP4)
// two tokens (each row read once for both): fewer threads, for the second token's registers
GR_ENTRY(gemv_ring_q8_0_t2_s3, DT_Q8_0, 3, false, 2, GR_MAX_THREADS_T2)
GR_ENTRY(gemv_ring_q8_0_t2_s4, DT_Q8_0, 4, false, 2, GR_MAX_THREADS_T2)
GR_ENTRY(gemv_ring_nvfp4_t2_s3, DT_NVFP4, 3, false, 2, GR_MAX_THREADS_T2)
GR_ENTRY(gemv_ring_nvfp4_t2_s4, DT_NVFP4, 4, false, 2, GR_MAX_THREADS_T2)
// three and four tokens (each row read once for all of them)
GR_ENTRY(gemv_ring_q8_0_t3_s3, DT_Q8_0, 3, false, 3, GR_MAX_THREADS_T4)
GR_ENTRY(gemv_ring_q8_0_t3_s4, DT_Q8_0, 4, false, 3, GR_MAX_THREADS_T4)
GR_ENTRY(gemv_ring_nvfp4_t3_s3, DT_NVFP4, 3, false, 3, GR_MAX_THREADS_T4)
GR_ENTRY(gemv_ring_nvfp4_t3_s4, DT_NVFP4, 4, false, 3, GR_MAX_THREADS_T4)
GR_ENTRY(gemv_ring_q8_0_t4_s3, DT_Q8_0, 3, false, 4, GR_MAX_THREADS_T4)
GR_ENTRY(gemv_ring_q8_0_t4_s4, DT_Q8_0, 4, false, 4, GR_MAX_THREADS_T4)
GR_ENTRY(gemv_ring_nvfp4_t4_s3, DT_NVFP4, 3, false, 4, GR_MAX_THREADS_T4)
GR_ENTRY(gemv_ring_nvfp4_t4_s4, DT_NVFP4, 4, false, 4, GR_MAX_THREADS_T4)

// ---------------------------------------------------------------------------------------------
// One token against the experts it was routed to (`moe_ring_{q8_0,nvfp4}_{id,glu,sum}`):
// mul_mat_id, mul_mat_id_swiglu and mul_mat_id_weighted_sum of a decode step's single token, over
// q8_0 / nvfp4 experts [k, M, E] of contiguous rows. The ring GEMV's structure (units of 64 values
// a thread with their quantized activations in registers, MR_STAGES shared-memory stages of
// bulk copies, one block barrier a stage, partials added up a stage later), with each stage
// gathered from the experts that ids names: one launch instead of the activations' quantization
// and a warp-per-row kernel, and the weights streamed at the copy rate rather than a row's load
// latency at a time. sm_90+ only (bulk copies): the host takes these kernels there only.
//
// - `_id` / `_glu`: output row o = u M + m (slot u, weight row m; out [M, n_used] in that order),
//   each block an even share, rs of them a stage. A stage's rows are copied as one piece per slot
//   it spans (at most a few: rs < M in practice); `_glu` copies the up experts' rows after the
//   gate's (stage rows rs ..) and stores swiglu(gate, up). Every group reads the one activation
//   row.
// - `_sum`: output row m of out [M]; a stage holds rs rows of every slot (slot u at stage rows
//   u rs ..), one piece a slot. groups = c n_used: group g takes slot g / c, whose activation row
//   (u mod n_b) it holds in registers, and the stage's rows g mod c, + c, ...; a row's value is
//   sum_u w[u] (row of slot u . its activations), the slots in order for every row.
//
// A bad expert id is reported (block 0) and read as expert 0, so that every copy stays inside the
// tensor. Dynamic shared memory: MR_STAGES stages of W = rs (`_id`), 2 rs (`_glu`) or n_used rs
// (`_sum`) weight rows, 2 x (W | 1) x nu f32 partials, then the staged activations (n_x rows of nu
// units, GR_XSTRIDE bytes each; n_x = n_b for `_sum`, else 1). TAG(moe-ring-consts): MR_STAGES and
// MR_MAX_SLOTS in src/ops/matmul/gemv_one.rs.
#define MR_STAGES 4
#define MR_MAX_SLOTS 32
#define MR_ID 0
#define MR_GLU 1
#define MR_SUM 2

template <int DT, int MODE>
__device__ __forceinline__ void moe_ring_body(const Tensor& as, const Tensor& as_up, const Tensor& b, const Tensor& ids,
                                              const Tensor& rw, const Tensor& out, int groups, int rs, u64 err, u32 op) {
#if __CUDA_ARCH__ >= 900
    constexpr int S = MR_STAGES;
    constexpr int UB = DT == DT_NVFP4 ? NVFP4_BYTES : 2 * Q8_0_BYTES;
    extern __shared__ __align__(16) char mr_shared[];
    __shared__ i64 mr_expert[MR_MAX_SLOTS];  // byte offset of each slot's expert
    __shared__ float mr_weight[MR_MAX_SLOTS];
    __shared__ __align__(8) u64 mr_bars[S];
    const int tid = threadIdx.x, nt = blockDim.x;
    const int nu = (int)(as.ne[0] / 64), row_bytes = nu * UB, n_used = (int)ids.ne[0];
    const i64 M = as.ne[1];
    const int W = MODE == MR_GLU ? 2 * rs : MODE == MR_SUM ? n_used * rs : rs;
    const int stage_bytes = W * row_bytes, rp = W | 1;
    const int n_x = MODE == MR_SUM ? (int)b.ne[1] : 1;
    const i64 rows = MODE == MR_SUM ? M : n_used * M;
    const i64 o0 = (i64)blockIdx.x * rows / gridDim.x, o1 = ((i64)blockIdx.x + 1) * rows / gridDim.x;
    const int nst = (int)((o1 - o0 + rs - 1) / rs);
    float* parts = (float*)(mr_shared + S * stage_bytes);
    char* xa = (char*)(parts + 2 * rp * nu);
    const u32 ring = tc_smem(mr_shared), bars = tc_smem(mr_bars);
    auto stage_rows = [&](int s) { return (int)min((i64)rs, o1 - o0 - (i64)s * rs); };

    if (MODE == MR_SUM && tid < n_used) mr_weight[tid] = *(const float*)(rw.data + tid * rw.nb[1]);
    // the activations' first loads, before the copies (L2 hits that should not queue behind them)
    const int n4 = n_x * nu * 16;
    auto load_x = [&](int c) {
        const int e = 4 * (c % (nu * 16));
        const char* p = b.data + (i64)(c / (nu * 16)) * b.nb[1] + (i64)e * b.nb[0];
        return make_float4(*(const float*)p, *(const float*)(p + b.nb[0]), *(const float*)(p + 2 * b.nb[0]), *(const float*)(p + 3 * b.nb[0]));
    };
    float4 xv[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        if (tid + i * nt < n4) xv[i] = load_x(tid + i * nt);
    }

    // stage s: its rows' pieces, all completing on the stage buffer's barrier
    auto bulk = [&](u32 dst, const char* src, u32 bytes, u32 bar) {
        for (u32 o = 0; o < bytes; o += 32768u) gr_bulk(dst + o, src + o, min(bytes - o, 32768u), bar);
    };
    auto issue = [&](int s) {
        if (s >= nst) return;
        const i64 a = o0 + (i64)s * rs;
        const int n = stage_rows(s);
        const u32 bar = bars + 8 * (s % S), dst = ring + (u32)((s % S) * stage_bytes);
        gr_bar_expect(bar, (u32)((MODE == MR_ID ? n : MODE == MR_GLU ? 2 * n : n_used * n) * row_bytes));
        if (MODE == MR_SUM) {
            for (int u = 0; u < n_used; u++) bulk(dst + (u32)(u * rs * row_bytes), as.data + mr_expert[u] + a * as.nb[1], (u32)(n * row_bytes), bar);
        } else {
            for (int i = 0; i < n;) {
                const i64 o = a + i, u = o / M, m = o - u * M;
                const int len = (int)min((i64)(n - i), M - m);
                bulk(dst + (u32)(i * row_bytes), as.data + mr_expert[u] + m * as.nb[1], (u32)(len * row_bytes), bar);
                if (MODE == MR_GLU) bulk(dst + (u32)((rs + i) * row_bytes), as_up.data + mr_expert[u] + m * as.nb[1], (u32)(len * row_bytes), bar);
                i += len;
            }
        }
    };
    // The last warp reads the ids (its lane u slot u's) and its last thread copies: the first
    // stages go out without waiting for a block barrier.
    const int copier = nt - 1;
    if (tid >= nt - 32) {
        const int u = tid - (nt - 32);
        if (u < n_used) {
            int id = *(const int*)(ids.data + u * ids.nb[0]);
            if (id < 0 || id >= as.ne[2]) {
                if (blockIdx.x == 0) report_error((ErrorRecord*)err, ERR_INDEX_OUT_OF_RANGE, WHAT_EXPERT_ID, op, id, as.ne[2], 0, 0);
                id = 0;
            }
            mr_expert[u] = id * as.nb[2];
        }
        __syncwarp();
        if (tid == copier) {
#pragma unroll
            for (int i = 0; i < S; i++) mb_init(bars + 8 * i, 1);
            mb_fence_init();
#pragma unroll
            for (int s = 0; s < S - 1; s++) issue(s);
        }
    }
    gr_stage_x(xa, xv, n4, load_x);
    __syncthreads();
    gr_quantize_units<DT>(xa, n_x * nu);
    __syncthreads();
    const int g = tid / nu, j = tid - g * nu;
    const bool worker = g < groups;
    // _sum: group g's slot and its place among the slot's c groups
    const int c = MODE == MR_SUM ? groups / n_used : groups, slot = MODE == MR_SUM ? g / c : 0, h = g - slot * c;
    const u32 zero = (u32)(rs + tid) & 0x80000000u;  // as in gemv_ring_body
    u32 x[32];
    int cs[4] = {0, 0, 0, 0};
    float dx = 0.0f;
    if (worker) gr_unit_words<DT>((const uint4*)(xa + GR_XSTRIDE * ((slot % n_x) * nu + j)), x, cs, dx);
    const u32 e2m1_lo = GR_E2M1_LO | zero;
    // this thread's dots of stage s into p: the weight rows it takes are i = h, h + c, ... < the
    // rows of its part of the stage (`_glu`: the gate rows, then the up rows), two at a time for nvfp4
    auto dots = [&](int s, float* p) {
        if (!worker) return;
        const char* sb = mr_shared + (s % S) * stage_bytes;
        const int n = stage_rows(s), span = MODE == MR_GLU ? 2 * n : n;
        // weight row index i of this thread's span to its stage row
        auto at = [&](int i) { return MODE == MR_SUM ? slot * rs + i : (MODE == MR_GLU && i >= n ? rs + i - n : i); };
        for (int i = h; i < span; i += 2 * c) {
            const int r0 = at(i);
            const u32* w = (const u32*)(sb + r0 * row_bytes + UB * j);
            if (DT == DT_NVFP4) {
                float v[2];
                if (i + c < span) {
                    const int r1 = at(i + c);
                    gr_units_nvfp4<2>(w, (r1 - r0) * row_bytes / 4, x, cs, e2m1_lo, v);
                    p[j * rp + r1] = dx * v[1];
                } else {
                    gr_units_nvfp4<1>(w, 0, x, cs, e2m1_lo, v);
                }
                p[j * rp + r0] = dx * v[0];
            } else {
                p[j * rp + r0] = dx * gr_unit_q8_0(w, x);
                if (i + c < span) {
                    const int r1 = at(i + c);
                    p[j * rp + r1] = dx * gr_unit_q8_0((const u32*)(sb + r1 * row_bytes + UB * j), x);
                }
            }
        }
    };
    // stage s's output rows from its partials: L consecutive threads a row (every L-th unit each,
    // then shuffles)
    const int lg = nu <= 40 ? 2 : nu <= 80 ? 3 : nu <= 160 ? 4 : 5, L = 1 << lg, sub = tid & (L - 1);
    const int row_step = nt >> lg, warp_rows = 32 >> lg;
    auto reduce = [&](int s) {
        const float* p = parts + (s & 1) * rp * nu;
        const int n = stage_rows(s), n_warps = (n + warp_rows - 1) & -warp_rows;
        for (int r = tid >> lg; r < n_warps; r += row_step) {
            float v = 0.0f, v_up = 0.0f;
            if (r < n) {
                for (int i = sub; i < nu; i += L) {
                    if (MODE == MR_SUM) {
                        for (int u = 0; u < n_used; u++) v = fmaf(mr_weight[u], p[i * rp + u * rs + r], v);
                    } else {
                        v += p[i * rp + r];
                        if (MODE == MR_GLU) v_up += p[i * rp + rs + r];
                    }
                }
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                if (o < L) {
                    v += __shfl_xor_sync(0xffffffffu, v, o);
                    if (MODE == MR_GLU) v_up += __shfl_xor_sync(0xffffffffu, v_up, o);
                }
            }
            if (sub == 0 && r < n) {
                const i64 o = o0 + (i64)s * rs + r;
                if (MODE == MR_SUM) {
                    *(float*)(out.data + offset_of(out, o, 0, 0, 0)) = v;
                } else {
                    const i64 u = o / M;
                    *(float*)(out.data + offset_of(out, o - u * M, u, 0, 0)) = MODE == MR_GLU ? v * sigmoid_f(v) * v_up : v;
                }
            }
        }
    };
    for (int s = 0; s < nst; s++) {
        __syncthreads();  // stage s - 1's buffer and partials are free
        if (tid == copier) {
            tc_fence_async();
            issue(s + S - 1);
        }
        if (s > 0) reduce(s - 1);
        mb_wait(bars + 8 * (s % S), (u32)(s / S) & 1u);  // stage s landed
        dots(s, parts + (s & 1) * rp * nu);
    }
    __syncthreads();
    if (nst > 0) reduce(nst - 1);
#endif
}

#define MR_ENTRY(NAME, DT, MODE, THREADS)                                                                  \
    extern "C" __global__ void __launch_bounds__(THREADS) NAME(Tensor as, Tensor as_up, Tensor b, Tensor ids, \
                                                                Tensor rw, Tensor out, int groups, int rs,    \
                                                                u64 err, u32 op) {                            \
        grid_begin();                                                                                         \
        moe_ring_body<DT, MODE>(as, as_up, b, ids, rw, out, groups, rs, err, op);                             \
    }
MR_ENTRY(moe_ring_q8_0_id, DT_Q8_0, MR_ID, GR_MAX_THREADS)
MR_ENTRY(moe_ring_q8_0_glu, DT_Q8_0, MR_GLU, GR_MAX_THREADS)
MR_ENTRY(moe_ring_q8_0_sum, DT_Q8_0, MR_SUM, GR_MAX_THREADS)
MR_ENTRY(moe_ring_nvfp4_id, DT_NVFP4, MR_ID, GR_MAX_THREADS_NVFP4)
MR_ENTRY(moe_ring_nvfp4_glu, DT_NVFP4, MR_GLU, GR_MAX_THREADS_NVFP4)
MR_ENTRY(moe_ring_nvfp4_sum, DT_NVFP4, MR_SUM, GR_MAX_THREADS_NVFP4)

// ---------------------------------------------------------------------------------------------
// Word GEMVs for f16 / bf16 / f32 rows (1 token, one weight matrix, rows of 16-byte aligned
// whole words of 8 halves or 4 floats, at most WORDS words a thread): thread t owns words t +
// blockDim.x j of every row and their f32 activations (packed by `pack_b`) in registers; a step
// takes R rows, the next step's loads issued before this step's arithmetic and reduction.
// `gemv_*w`: 2 words a thread, GW_R rows a step, up to GW_MAX_THREADS threads; `gemv_*w_long`: 5
// words, 2 rows, up to GH_LONG_THREADS threads (the register budget of 40 activations and 2 x 10
// words in flight).
#define GW_R 4
#define GW_MAX_THREADS 512
#define GH_LONG_THREADS 448

__device__ __forceinline__ uint4 ldg_nc_v4(const void* p) {
    uint4 v;
    asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// Values a 16-byte word of DT holds: 4 f32, else 8 halves.
template <int DT>
__device__ __forceinline__ constexpr int word_values() { return DT == DT_F32 ? 4 : 8; }

// w's values (type DT) . x[0 .. word_values).
template <int DT>
__device__ __forceinline__ float dot_word(uint4 w, const float* x) {
    const u32 q[4] = {w.x, w.y, w.z, w.w};
    float v = 0.0f;
    if constexpr (DT == DT_F32) {
#pragma unroll
        for (int c = 0; c < 4; c++) v = fmaf(__uint_as_float(q[c]), x[c], v);
    } else {
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const float lo = DT == DT_F16 ? f16_to_f32((u16)(q[c] & 0xffff)) : __uint_as_float(q[c] << 16);
            const float hi = DT == DT_F16 ? f16_to_f32((u16)(q[c] >> 16)) : __uint_as_float(q[c] & 0xffff0000u);
            v = fmaf(lo, x[2 * c], fmaf(hi, x[2 * c + 1], v));
        }
    }
    return v;
}

template <int DT, int WORDS, int R>
__device__ __forceinline__ void gemv_word_rows(Tensor a, const float* x, Tensor out) {
    constexpr int V = word_values<DT>();
    __shared__ float red[GW_MAX_THREADS / 32][R];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, nt = (int)blockDim.x;
    const i64 rows = a.ne[1];
    const int words = (int)(a.ne[0] / V);
    float xr[WORDS][V];
    bool live[WORDS];
#pragma unroll
    for (int j = 0; j < WORDS; j++) {
        const int w = tid + nt * j;
        live[j] = w < words;
#pragma unroll
        for (int e = 0; e < V; e++) xr[j][e] = live[j] ? x[V * w + e] : 0.0f;
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
            for (int j = 0; j < WORDS; j++) v += dot_word<DT>(cur[r][j], xr[j]);
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

// The entry points: WORDS words a thread (2, or 5 for long rows), R rows a step.
#define GW_ENTRY(NAME, DT, WORDS, R, THREADS)                                                           \
    extern "C" __global__ void __launch_bounds__(THREADS) NAME(Tensor a, const float* x, Tensor out) { \
        grid_begin();                                                                                \
        gemv_word_rows<DT, WORDS, R>(a, x, out);                                                     \
    }
GW_ENTRY(gemv_f16w, DT_F16, 2, GW_R, GW_MAX_THREADS)
GW_ENTRY(gemv_bf16w, DT_BF16, 2, GW_R, GW_MAX_THREADS)
GW_ENTRY(gemv_f16w_long, DT_F16, 5, 2, GH_LONG_THREADS)
GW_ENTRY(gemv_bf16w_long, DT_BF16, 5, 2, GH_LONG_THREADS)
GW_ENTRY(gemv_f32w, DT_F32, 2, GW_R, GW_MAX_THREADS)
GW_ENTRY(gemv_f32w_long, DT_F32, 5, 2, GH_LONG_THREADS)

