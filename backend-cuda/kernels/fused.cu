// fused.cu: fused ops, each one launch computing what the subgraph it replaces computes (with
// norm.cuh's row walk and rope.cuh's angles).
//
// Norm rows (add_rms_norm_mul, rms_norm_mul, gated_rms_norm; rms_norm_mul_rope below): f32 rows with dense elements (the
// shape rules), any outer strides; the weight w (any strides) broadcasts to the rows by ggml's
// repeat rule. Rows of up to 256 run one warp per row (8 rows per 256-thread block), longer rows
// one block per row; each thread keeps its NV elements in registers between the sum of squares
// and the write (NV = 0: rows too long for that loop over their elements twice, re-reading them).
// The arithmetic is the CPU's: s = a + b, scale = 1 / sqrt(sum(s^2) / n + eps), y = (s * scale) *
// w (* silu(z)).
//
// Router rows (softmax_top_k, moe_weights, moe_router) of n_expert <= 1024 logits: one warp per row computes
// the probabilities exactly as reduce.cu's softmax kernels do for the same row
// (TAG(softmax-probs)): softmax_vec_warp for dense 16-byte aligned rows with n % 4 == 0
// (ROUTER_VEC), softmax_warp otherwise (ROUTER_GEN), so the ids equal top_k(softmax(x)) run as two
// kernels even where f32 rounding makes two probabilities equal. top_k then takes the k smallest
// u64 ranks (reduce.cu's sort_rank, TAG(sort-rank)), each placed by counting the smaller ones over
// the row's block; moe_weights recomputes the probability of each routed expert from its logit
// and the row's (max, sum); moe_router, softmax_top_k's kernel, keeps the row's probabilities in
// shared memory and divides the chosen ones by their sum.

#define FZ_ROWS_PER_WARP_BLOCK 8

__device__ __forceinline__ i64 fz_row_off(const Tensor& t, i64 i1, i64 i2, i64 i3) {
    return i1 * t.nb[1] + i2 * t.nb[2] + i3 * t.nb[3];
}

// ---- norm rows ----

#define FZ_NORM_MUL 0  // y = rms_norm(x) * w
#define FZ_GATED 1     // y = rms_norm(x) * w * silu(b)   (b is the gate z)
#define FZ_ADD 2       // s = x + b, written to `s`; y = rms_norm(s) * w

// x * sigmoid(x) (elementwise.cu's silu).
__device__ __forceinline__ float fz_silu(float x) {
    return x * sigmoid_f(x);
}

template <bool WARP>
__device__ __forceinline__ float fz_group_sum(float v, float* sh) {
    return WARP ? warp_sum(v) : block_sum(v, sh);
}

// Element i of a row's weight w (w_full: w's rows are n long, so no modulo).
__device__ __forceinline__ float fz_weight(const char* wr, const Tensor& w, bool w_full, i64 i) {
    return *(const float*)(wr + (w_full ? i : i % w.ne[0]) * w.nb[0]);
}

// An element of the result from the row's value e (x, or s = a + b), its scale, the weight and
// (GATED) the gate z.
template <int MODE>
__device__ __forceinline__ float fz_norm_value(float e, float scale, float wt, float gate) {
    float h = (e * scale) * wt;
    if (MODE == FZ_GATED) h *= fz_silu(gate);
    return h;
}

// y (and s) have x's shape [n, ne1, ne2, ne3]; b is the addend (ADD) or the gate (GATED), with
// x's shape; every row of x, b, y and s is dense (nb0 = 4), checked by the shape rules and the
// host. With NV > 0 the group covers the row: n <= NV * group size.
template <bool WARP, int NV, int MODE>
__device__ void fz_norm_rows(Tensor y, Tensor s, Tensor x, Tensor b, Tensor w, float eps) {
    __shared__ float sh[32];
    RowGroup<WARP> g;
    const i64 n = x.ne[0], rows = x.ne[1] * x.ne[2] * x.ne[3];
    const bool w_full = w.ne[0] == n;
    for (i64 r = g.first; r < rows; r += g.step) {
        i64 i1, i2, i3;
        row_coords(x, r, i1, i2, i3);
        const float* xr = (const float*)(x.data + fz_row_off(x, i1, i2, i3));
        const float* br = MODE == FZ_NORM_MUL ? nullptr : (const float*)(b.data + fz_row_off(b, i1, i2, i3));
        float* sr = MODE == FZ_ADD ? (float*)(s.data + fz_row_off(s, i1, i2, i3)) : nullptr;
        float* yr = (float*)(y.data + fz_row_off(y, i1, i2, i3));
        const char* wr = w.data + fz_row_off(w, bcast_index(i1, w.ne[1]), bcast_index(i2, w.ne[2]), bcast_index(i3, w.ne[3]));
        float v[NV > 0 ? NV : 1], bv[NV > 0 ? NV : 1], wv[NV > 0 ? NV : 1];
        float acc = 0.0f;
        if (NV > 0) {
            // Every load first (x, b and the weights), then the stores of s: a store between
            // loads would hold the next loads back (s may alias them for all the compiler knows),
            // one memory round trip per element instead of one for the row.
#pragma unroll
            for (int j = 0; j < (NV > 0 ? NV : 1); j++) {
                i64 i = g.lane + (i64)j * g.size;
                v[j] = i < n ? xr[i] : 0.0f;
                bv[j] = MODE != FZ_NORM_MUL && i < n ? br[i] : 0.0f;
                wv[j] = i < n ? fz_weight(wr, w, w_full, i) : 0.0f;
            }
#pragma unroll
            for (int j = 0; j < (NV > 0 ? NV : 1); j++) {
                i64 i = g.lane + (i64)j * g.size;
                if (MODE == FZ_ADD) {
                    v[j] += bv[j];
                    if (i < n) sr[i] = v[j];
                }
                acc += v[j] * v[j];
            }
        } else {
            for (i64 i = g.lane; i < n; i += g.size) {
                float e = xr[i];
                if (MODE == FZ_ADD) {
                    e += br[i];
                    sr[i] = e;
                }
                acc += e * e;
            }
        }
        float ss = fz_group_sum<WARP>(acc, sh);
        float scale = 1.0f / sqrtf(ss / (float)n + eps);
        if (NV > 0) {
#pragma unroll
            for (int j = 0; j < (NV > 0 ? NV : 1); j++) {
                i64 i = g.lane + (i64)j * g.size;
                if (i < n) yr[i] = fz_norm_value<MODE>(v[j], scale, wv[j], bv[j]);
            }
        } else {
            // s was written by this same thread above: program order makes it visible.
            for (i64 i = g.lane; i < n; i += g.size) {
                float e = MODE == FZ_ADD ? sr[i] : xr[i];
                yr[i] = fz_norm_value<MODE>(e, scale, fz_weight(wr, w, w_full, i), MODE == FZ_GATED ? br[i] : 0.0f);
            }
        }
    }
}

// Entry points per mode: `_warp4` (n <= 128) and `_warp` (n <= 256), 8 rows per 256-thread
// block (the short rows' kernel holds half the registers: twice the warps a multiprocessor),
// `_block` (n <= 8 * blockDim.x, one block per row), `_loop` (any n, one block per row).
#define FZ_NORM_KERNELS(MODE, NAME)                                                                                    \
    extern "C" __global__ void NAME##_warp4(Tensor y, Tensor s, Tensor x, Tensor b, Tensor w, float eps) {            \
        grid_begin();                                                                                                 \
        fz_norm_rows<true, 4, MODE>(y, s, x, b, w, eps);                                                               \
    }                                                                                                                  \
    extern "C" __global__ void NAME##_warp(Tensor y, Tensor s, Tensor x, Tensor b, Tensor w, float eps) {             \
        grid_begin();                                                                                                 \
        fz_norm_rows<true, 8, MODE>(y, s, x, b, w, eps);                                                               \
    }                                                                                                                  \
    extern "C" __global__ void NAME##_block(Tensor y, Tensor s, Tensor x, Tensor b, Tensor w, float eps) {            \
        grid_begin();                                                                                                 \
        fz_norm_rows<false, 8, MODE>(y, s, x, b, w, eps);                                                              \
    }                                                                                                                  \
    extern "C" __global__ void NAME##_loop(Tensor y, Tensor s, Tensor x, Tensor b, Tensor w, float eps) {             \
        grid_begin();                                                                                                 \
        fz_norm_rows<false, 0, MODE>(y, s, x, b, w, eps);                                                              \
    }

FZ_NORM_KERNELS(FZ_NORM_MUL, rms_norm_mul)
FZ_NORM_KERNELS(FZ_GATED, gated_rms_norm)
FZ_NORM_KERNELS(FZ_ADD, add_rms_norm_mul)

// ---- rms_norm_mul_rope: attention's per-head q/k norm, weight and rotation ----
//
// y = rope_multi(rms_norm(x) * w, pos): x f32 [hd, n_head, n_tokens, 1] with dense rows (any
// outer strides: q is a view of the joint q+gate projection), hd <= FZ_ROPE_HD_MAX; w f32
// broadcasting to x; pos i32 as rope_multi's (n_tokens, or 4 * n_tokens stream-major with
// sections); y f32 contiguous. Grid (n_tokens, head groups) of 256 threads, as rope.cu: the block
// computes its token's n_rot / 2 (cos, sin) once with rope.cuh's code, as rope.cu does, then
// each warp takes one head row at a time: the norm as rms_norm_mul_warp computes it (the same
// NV = 8 registers per lane, the same sum order: the same bits), the weighted row into shared
// memory, then each element rotated with its pair partner by rope.cuh's rotation.

#define FZ_ROPE_HD_MAX 256
#define FZ_ROPE_WARPS 8

extern "C" __global__ void rms_norm_mul_rope(Tensor y, Tensor x, Tensor w, Tensor pos, float eps, int n_rot, float freq_base, int pairing, int has_sections, int s0, int s1, int s2, int s3, int heads_per_block) {
    grid_begin();
    __shared__ float table[FZ_ROPE_HD_MAX];                   // n_rot / 2 cosines, then n_rot / 2 sines
    __shared__ float rows[FZ_ROPE_WARPS][FZ_ROPE_HD_MAX];     // each warp's weighted norm row
    const i64 t = blockIdx.x;
    rope_table(table, pos, t, x.ne[2], n_rot, freq_base, has_sections, s0, s1, s2, s3);
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n = (int)x.ne[0];
    const bool w_full = w.ne[0] == n;
    const i64 h0 = (i64)blockIdx.y * heads_per_block;
    const i64 h_end = min(h0 + heads_per_block, x.ne[1]);
    float* sh = rows[warp];
    for (i64 h = h0 + warp; h < h_end; h += FZ_ROPE_WARPS) {
        const float* xr = (const float*)(x.data + h * x.nb[1] + t * x.nb[2]);
        const char* wr = w.data + fz_row_off(w, h % w.ne[1], t % w.ne[2], 0);
        float v[8], wv[8];
        float acc = 0.0f;
        // rms_norm_mul_warp's loads and sum of squares (fz_norm_rows<true, 8, FZ_NORM_MUL>).
#pragma unroll
        for (int j = 0; j < 8; j++) {
            int i = lane + j * 32;
            v[j] = i < n ? xr[i] : 0.0f;
            wv[j] = i < n ? fz_weight(wr, w, w_full, i) : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < 8; j++) acc += v[j] * v[j];
        float ss = warp_sum(acc);
        float scale = 1.0f / sqrtf(ss / (float)n + eps);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            int i = lane + j * 32;
            if (i < n) sh[i] = fz_norm_value<FZ_NORM_MUL>(v[j], scale, wv[j], 0.0f);
        }
        __syncwarp();
        float* yr = (float*)(y.data + h * y.nb[1] + t * y.nb[2]);
        for (int i0 = lane; i0 < n; i0 += 32) {
            yr[i0] = i0 < n_rot ? rope_rotated(i0, n_rot, pairing, table, [sh](int d) { return sh[d]; }) : sh[i0];
        }
        // The row is read by the whole warp before the next head overwrites it.
        __syncwarp();
    }
}

// ---- router rows: the softmax kernels' probabilities (TAG(softmax-probs)) ----

// The probability of logit z in a row of max m and sum s: what both softmax kernels write
// (zeros for a row whose logits are all -inf).
__device__ __forceinline__ float fz_prob(float z, MaxSum t) {
    return t.m == -TS_INF ? 0.0f : expf(z - t.m) / t.s;
}

// Each lane holds up to 32 elements of its row: slot q is element fz_elem<VEC>(lane, q), valid
// when below n. VEC (softmax_vec_warp's layout): float4 j = lane + 32 (q / 4), component q % 4;
// else (softmax_warp's): element lane + 32 q.
#define ROUTER_MAX 1024

template <bool VEC>
__device__ __forceinline__ i64 fz_elem(int lane, int q) {
    return VEC ? 4 * (i64)(lane + 32 * (q >> 2)) + (q & 3) : (i64)lane + 32 * q;
}

// The row's softmax statistics (every lane gets them) and, when p != nullptr, this lane's
// probabilities p[q], q < Q (0 for slots past the row). `x` is the row's first logit, nb0 its
// element stride; n <= 32 Q, Q a multiple of 4 up to 32 (slots past Q would only add nothing to
// the sums: a smaller Q gives the same bits with less work).
template <bool VEC, int Q = 32>
__device__ __forceinline__ MaxSum fz_router_row(const char* x, i64 nb0, i64 n, int lane, float* p) {
    static_assert(Q % 4 == 0 && Q <= 32, "whole float4 groups, up to ROUTER_MAX");
    if (VEC) {
        // softmax_vec_impl<true, 8> with scale 1 and no mask.
        const float4* x4 = (const float4*)x;
        int n4 = (int)(n >> 2);
        float4 v[Q / 4];
        float mx = -TS_INF;
#pragma unroll
        for (int j = 0; j < Q / 4; j++) {
            int i = lane + j * 32;
            if (i < n4) {
                float4 a = x4[i];
                v[j] = a;
                mx = fmaxf(mx, fmaxf(fmaxf(a.x, a.y), fmaxf(a.z, a.w)));
            } else {
                v[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            }
        }
        mx = warp_max(mx);
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < Q / 4; j++) {
            int i = lane + j * 32;
            if (i < n4) {
                v[j] = make_float4(expf(v[j].x - mx), expf(v[j].y - mx), expf(v[j].z - mx), expf(v[j].w - mx));
                acc += (v[j].x + v[j].y) + (v[j].z + v[j].w);
            }
        }
        float total = warp_sum(acc);
        if (p) {
#pragma unroll
            for (int j = 0; j < Q / 4; j++) {
                bool ok = lane + j * 32 < n4 && mx != -TS_INF;
                p[4 * j + 0] = ok ? v[j].x / total : 0.0f;
                p[4 * j + 1] = ok ? v[j].y / total : 0.0f;
                p[4 * j + 2] = ok ? v[j].z / total : 0.0f;
                p[4 * j + 3] = ok ? v[j].w / total : 0.0f;
            }
        }
        return MaxSum{mx, total};
    }
    // softmax_impl<true> with scale 1 and no mask: the online state over i = lane, lane + 32, ...
    float z[Q];
    MaxSum t{-TS_INF, 0.0f};
#pragma unroll
    for (int q = 0; q < Q; q++) {
        i64 i = lane + 32 * q;
        z[q] = i < n ? *(const float*)(x + i * nb0) : -TS_INF;
        if (i < n) t = ms_add(t, z[q]);
    }
    t = warp_ms(t);
    if (t.m == TS_INF) t.s = TS_NAN;  // finish_ms
    if (p) {
#pragma unroll
        for (int q = 0; q < Q; q++) p[q] = (i64)lane + 32 * q < n ? fz_prob(z[q], t) : 0.0f;
    }
    return t;
}

// ---- softmax_top_k ----

// reduce.cu's sort_rank (TAG(sort-rank)), descending: the order-preserving u32 key of v (-0 ==
// +0, NaN lowest), complemented, over the index; the smallest rank comes first.
__device__ __forceinline__ u64 fz_rank_desc(float v, i64 i) {
    u32 bits = __float_as_uint(v + 0.0f);
    u32 key = bits ^ ((u32)((int)bits >> 31) | 0x80000000u);
    if (v != v) key = 0;
    key = ~key;
    return ((u64)key << 32) | (u64)(u32)i;
}

#define FZ_RANK_NONE 0xffffffffffffffffull

__device__ __forceinline__ u64 fz_warp_min_u64(u64 v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        u64 w = __shfl_xor_sync(0xffffffffu, v, o);
        v = w < v ? w : v;
    }
    return v;
}

// Both router kernels' row endings: the row's m tail ids after its k chosen ones (elements i0,
// i0 + step, ... of the tail row), and the tail slots' weights sigmoid(gate) (by the 32 lanes of
// one warp) into the weights plane `w`.
__device__ __forceinline__ void fz_store_tail(char* y, const Tensor& dst, const Tensor& tail, i64 r, int k, i64 i0, i64 step) {
    for (i64 i = i0; i < tail.ne[0]; i += step) {
        *(int*)(y + (k + i) * dst.nb[0]) = *(const int*)(tail.data + i * tail.nb[0] + r * tail.nb[1]);
    }
}
__device__ __forceinline__ void fz_store_gates(char* w, const Tensor& dst, const Tensor& gate, i64 r, int k, int lane) {
    for (i64 j = lane; j < gate.ne[0]; j += 32) {
        const float z = *(const float*)(gate.data + j * gate.nb[0] + r * gate.nb[1]);
        *(float*)(w + (k + j) * dst.nb[0]) = sigmoid_f(z);
    }
}

// dst i32 [k + m, rows]: per row the indices of the k largest probabilities, largest first, the
// lower index first among equal ones (top_k's rule), then the row's m ids of tail (m = 0: none).
// 1 <= k <= n <= ROUTER_MAX (host). One block per row: warp 0 computes the probabilities (as the
// softmax kernels do) and leaves their ranks in shared memory, padded to a multiple of 8 with a
// rank larger than any; then every thread places its elements by counting the smaller ranks
// (ranks are distinct: they carry the index). The count reads two ranks a shared load into four
// independent sums, and a warp whose elements all have k smaller ones stops early: the latency
// of a decode step's router is this loop.
// ROUTE (moe_router): dst is i32 [k + m, rows, 2] and plane 1 gets the weights as f32 bits, the
// k selected probabilities divided by their sum (moe_weights' arithmetic on the probabilities
// kept in shared memory), then sigmoid(gate) for the m tail slots.
template <bool VEC, bool ROUTE>
__device__ void fz_softmax_top_k(Tensor dst, Tensor src, int k, Tensor tail, Tensor gate) {
    __shared__ __align__(16) u64 ranks[ROUTER_MAX];
    __shared__ float probs[ROUTE ? ROUTER_MAX : 1];
    __shared__ int chosen[ROUTE ? ROUTER_MAX : 1];
    const i64 rows = src.ne[1], n = src.ne[0], n8 = (n + 7) & ~(i64)7;
    const int lane = threadIdx.x & 31;
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        if (threadIdx.x < 32) {
            float p[32];
            fz_router_row<VEC>(src.data + r * src.nb[1], src.nb[0], n, lane, p);
#pragma unroll
            for (int q = 0; q < 32; q++) {
                const i64 i = fz_elem<VEC>(lane, q);
                if (i < n) {
                    ranks[i] = fz_rank_desc(p[q], i);
                    if (ROUTE) probs[i] = p[q];
                }
            }
            if (n + lane < n8) ranks[n + lane] = FZ_RANK_NONE;
        }
        __syncthreads();
        char* y = dst.data + r * dst.nb[1];
        const ulonglong2* pairs = (const ulonglong2*)ranks;
        for (i64 i0 = 0; i0 < n; i0 += blockDim.x) {
            const i64 i = i0 + threadIdx.x;
            const u64 mine = i < n ? ranks[i] : FZ_RANK_NONE;
            int c[4] = {0, 0, 0, 0};
            for (i64 j = 0; j < n8 / 2; j += 4) {
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    const ulonglong2 two = pairs[j + q];
                    c[q] += (two.x < mine) + (two.y < mine);
                }
                if (__all_sync(0xffffffffu, c[0] + c[1] + c[2] + c[3] >= k)) break;
            }
            const int before = (c[0] + c[1]) + (c[2] + c[3]);
            if (i < n && before < k) {
                *(int*)(y + before * dst.nb[0]) = (int)i;
                if (ROUTE) chosen[before] = (int)i;
            }
        }
        fz_store_tail(y, dst, tail, r, k, threadIdx.x, blockDim.x);
        if (ROUTE) {
            __syncthreads();
            if (threadIdx.x < 32) {
                char* w = y + dst.nb[2];
                float acc = 0.0f;
                for (int s = lane; s < k; s += 32) acc += probs[chosen[s]];
                const float total = warp_sum(acc);
                for (int s = lane; s < k; s += 32) *(float*)(w + s * dst.nb[0]) = probs[chosen[s]] / total;
                fz_store_gates(w, dst, gate, r, k, lane);
            }
        }
        __syncthreads();
    }
}

// The same selection and weights with a warp per row, for many rows (the block kernel keeps one
// row's latency short but leaves most of its block idle while warp 0 computes the probabilities):
// k <= 32 rounds, each taking the smallest rank left among the lanes' (a warp minimum; the winning
// lane marks its slot), so the ids are the block kernel's. Lane s keeps the s-th chosen
// probability for the weights. Rows in a grid-stride loop, a warp a row. Q slots a lane: 8 for
// rows of up to 256 logits (a quarter of the selection's work), else 32.
template <bool VEC, bool ROUTE, int Q>
__device__ void fz_top_k_warp(Tensor dst, Tensor src, int k, Tensor tail, Tensor gate) {
    const i64 rows = src.ne[1], n = src.ne[0];
    const int lane = threadIdx.x & 31;
    const i64 step = (i64)gridDim.x * (blockDim.x >> 5);
    for (i64 r = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < rows; r += step) {
        float p[Q];
        fz_router_row<VEC, Q>(src.data + r * src.nb[1], src.nb[0], n, lane, p);
        char* y = dst.data + r * dst.nb[1];
        u32 taken = 0;
        float chosen = 0.0f;
        for (int s = 0; s < k; s++) {
            u64 best = FZ_RANK_NONE;
            float best_p = 0.0f;
            int best_q = -1;
#pragma unroll
            for (int q = 0; q < Q; q++) {
                const i64 i = fz_elem<VEC>(lane, q);
                const u64 rank = fz_rank_desc(p[q], i);
                if (i < n && !((taken >> q) & 1u) && rank < best) {
                    best = rank;
                    best_p = p[q];
                    best_q = q;
                }
            }
            const u64 win = fz_warp_min_u64(best);
            const bool mine = best_q >= 0 && best == win;  // ranks are distinct: one lane
            if (mine) taken |= 1u << best_q;
            const int from = __ffs(__ballot_sync(0xffffffffu, mine)) - 1;
            const float pw = __shfl_sync(0xffffffffu, best_p, from < 0 ? 0 : from);
            if (lane == s) chosen = pw;
            if (lane == 0) *(int*)(y + s * dst.nb[0]) = (int)(u32)win;
        }
        fz_store_tail(y, dst, tail, r, k, lane, 32);
        if (ROUTE) {
            char* w = y + dst.nb[2];
            const float total = warp_sum(lane < k ? chosen : 0.0f);
            if (lane < k) *(float*)(w + lane * dst.nb[0]) = chosen / total;
            fz_store_gates(w, dst, gate, r, k, lane);
        }
    }
}

// The entry points: softmax_top_k (dst, src, k, tail) and moe_router (the same and gate), a block
// (fz_softmax_top_k) or a warp (fz_top_k_warp) a row, over float4 rows (_vec) or any (_gen).
#define FZ_TOP_K_ENTRY(NAME, BODY)                                                   \
    extern "C" __global__ void NAME(Tensor dst, Tensor src, int k, Tensor tail) {    \
        grid_begin();                                                                \
        BODY(dst, src, k, tail, tail);                                               \
    }
#define FZ_ROUTER_ENTRY(NAME, BODY)                                                               \
    extern "C" __global__ void NAME(Tensor dst, Tensor src, int k, Tensor tail, Tensor gate) {    \
        grid_begin();                                                                             \
        BODY(dst, src, k, tail, gate);                                                            \
    }
FZ_TOP_K_ENTRY(softmax_top_k_vec, (fz_softmax_top_k<true, false>))
FZ_TOP_K_ENTRY(softmax_top_k_gen, (fz_softmax_top_k<false, false>))
FZ_ROUTER_ENTRY(moe_router_vec, (fz_softmax_top_k<true, true>))
FZ_ROUTER_ENTRY(moe_router_gen, (fz_softmax_top_k<false, true>))
FZ_TOP_K_ENTRY(softmax_top_k_warp_vec, (fz_top_k_warp<true, false, 32>))
FZ_TOP_K_ENTRY(softmax_top_k_warp_gen, (fz_top_k_warp<false, false, 32>))
FZ_ROUTER_ENTRY(moe_router_warp_vec, (fz_top_k_warp<true, true, 32>))
FZ_ROUTER_ENTRY(moe_router_warp_gen, (fz_top_k_warp<false, true, 32>))
FZ_TOP_K_ENTRY(softmax_top_k_warp8_vec, (fz_top_k_warp<true, false, 8>))
FZ_TOP_K_ENTRY(softmax_top_k_warp8_gen, (fz_top_k_warp<false, false, 8>))
FZ_ROUTER_ENTRY(moe_router_warp8_vec, (fz_top_k_warp<true, true, 8>))
FZ_ROUTER_ENTRY(moe_router_warp8_gen, (fz_top_k_warp<false, true, 8>))

// ---- moe_weights ----

// Reports the first id (logical order: slot fastest) of ids [k, n] outside 0..limit, as the CPU
// finds it; every warp that meets a bad id finds the same one, so the record does not depend on
// which warp wins. Call with a whole warp.
__device__ void fz_report_first_bad(const Tensor& ids, i64 limit, u64 err, u32 op, int lane) {
    const i64 k = ids.ne[0], total = ids.ne[0] * ids.ne[1];
    u64 first = FZ_RANK_NONE;
    for (i64 e = lane; e < total; e += 32) {
        int id = *(const int*)(ids.data + (e % k) * ids.nb[0] + (e / k) * ids.nb[1]);
        if ((id < 0 || id >= limit) && (u64)e < first) first = (u64)e;
    }
    first = fz_warp_min_u64(first);
    if (lane == 0 && first != FZ_RANK_NONE) {
        i64 e = (i64)first;
        int id = *(const int*)(ids.data + (e % k) * ids.nb[0] + (e / k) * ids.nb[1]);
        report_error((ErrorRecord*)err, ERR_INDEX_OUT_OF_RANGE, WHAT_EXPERT_ID, op, id, limit, 0, 0);
    }
}

// dst f32 [1, k (+ 1), rows]: w[s, r] = p[ids[s, r]] / sum_s p[ids[s, r]] with p the row's softmax
// probabilities, then sigmoid(gate[r]) when the gate has a row (gate.ne[0] == 1; 0: none). A row
// with an id outside 0..n is not written; the first bad id is reported.
template <bool VEC>
__device__ void fz_moe_weights(Tensor dst, Tensor src, Tensor ids, Tensor gate, u64 err, u32 op) {
    const i64 rows = src.ne[1], n = src.ne[0], k = ids.ne[0];
    const int lane = threadIdx.x & 31;
    const i64 step = (i64)gridDim.x * (blockDim.x >> 5);
    for (i64 r = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < rows; r += step) {
        const char* x = src.data + r * src.nb[1];
        const char* idr = ids.data + r * ids.nb[1];
        // the first 32 ids and the row are read before anything waits on them
        const int id0 = lane < k ? *(const int*)(idr + lane * ids.nb[0]) : 0;
        MaxSum t = fz_router_row<VEC>(x, src.nb[0], n, lane, nullptr);
        bool bad = id0 < 0 || id0 >= n;
        for (i64 s = lane + 32; s < k; s += 32) {
            int id = *(const int*)(idr + s * ids.nb[0]);
            bad |= id < 0 || id >= n;
        }
        if (__any_sync(0xffffffffu, bad)) {
            fz_report_first_bad(ids, n, err, op, lane);
            continue;  // uniform across the warp
        }
        const float p0 = lane < k ? fz_prob(*(const float*)(x + id0 * src.nb[0]), t) : 0.0f;
        float acc = p0;
        for (i64 s = lane + 32; s < k; s += 32) {
            int id = *(const int*)(idr + s * ids.nb[0]);
            acc += fz_prob(*(const float*)(x + id * src.nb[0]), t);
        }
        float total = warp_sum(acc);
        char* y = dst.data + r * dst.nb[2];
        if (lane < k) *(float*)(y + lane * dst.nb[1]) = p0 / total;
        for (i64 s = lane + 32; s < k; s += 32) {
            int id = *(const int*)(idr + s * ids.nb[0]);
            *(float*)(y + s * dst.nb[1]) = fz_prob(*(const float*)(x + id * src.nb[0]), t) / total;
        }
        if (gate.ne[0] > 0 && lane == 0) *(float*)(y + k * dst.nb[1]) = sigmoid_f(*(const float*)(gate.data + r * gate.nb[1]));
    }
}

extern "C" __global__ void moe_weights_vec(Tensor dst, Tensor src, Tensor ids, Tensor gate, u64 err, u32 op) {
    grid_begin();
    fz_moe_weights<true>(dst, src, ids, gate, err, op);
}
extern "C" __global__ void moe_weights_gen(Tensor dst, Tensor src, Tensor ids, Tensor gate, u64 err, u32 op) {
    grid_begin();
    fz_moe_weights<false>(dst, src, ids, gate, err, op);
}
