// delta_net.cu: gated_delta_net, the gated delta rule over per-slot f32 states.
//
// Each column `j` of a head's state (`S[.][j]`, `S_k` floats, contiguous in memory: the state is
// `[S_k, S_v, H_v, n_slots]`) evolves on its own: per token it needs only `k`, `q`, `v[j]`, `g`
// and `beta`. So a group of GROUP = 8 lanes owns one column for the whole sequence, holding it in
// registers as NC float4 chunks per lane (chunk r of lane l covers keys (r * GROUP + l) * 4 .. + 4,
// so each load instruction of a group reads 128 consecutive bytes), reads and writes it once,
// in place in its slot. Per token (with d = exp(g), both dot products over the old state):
//
//   sk = S . k,  sq = S . q,  delta = beta (v - d sk),
//   o = d sq + delta (k . q),  S <- d S + k delta
//
// which is the reference's decay / delta / rank-1 update / readout, regrouped so that one
// reduction (two sums at once over the group's 8 lanes) is on the per-token dependency chain.
// This exact serial form serves the serial algorithm, decode and the chunked algorithm on shapes
// the chunked kernels (at the end of the file) do not cover.
//
// `gdn_prep` first writes k, q (times scale) and k . q per token as padded f32 rows to scratch,
// so the main kernels read key chunks as float4. A block of 4 warps owns 16 columns of one (value
// head, sequence): `gdn_*` loads each token's inputs one token ahead in registers (decode and
// general shapes); `gdn_tiled_n4_vec` (prefill, S_k = 128) stages 16-token tiles in shared memory
// with cp.async, double buffered. Slots are validated by `gdn_check_slots` first; the main kernels
// do nothing when an error is recorded.

#define GDN_GROUP 8
#define GDN_WARPS 4
#define GDN_COLS (GDN_WARPS * 32 / GDN_GROUP)

// Slots must be in range and distinct; the first bad one in sequence order is reported, as
// `tessera_ops::checked_slots` does. One block; sequence s is bad when its slot is out of range or
// an earlier sequence names the same slot.
extern "C" __global__ void gdn_check_slots(Tensor slots, i64 n_slots, u64 err, u32 op) {
    __shared__ long long first_bad;
    if (threadIdx.x == 0) first_bad = 0x7fffffffffffffffLL;
    __syncthreads();
    i64 n = slots.ne[0];
    for (i64 s = threadIdx.x; s < n; s += blockDim.x) {
        i64 v = *(const int*)(slots.data + s * slots.nb[0]);
        bool bad = v < 0 || v >= n_slots;
        for (i64 e = 0; e < s && !bad; e++) bad = *(const int*)(slots.data + e * slots.nb[0]) == v;
        if (bad) atomicMin(&first_bad, (long long)s);
    }
    __syncthreads();
    if (threadIdx.x != 0 || first_bad >= n) return;
    i64 s = first_bad;
    i64 v = *(const int*)(slots.data + s * slots.nb[0]);
    if (v < 0 || v >= n_slots) {
        report_error((ErrorRecord*)err, ERR_INDEX_OUT_OF_RANGE, WHAT_STATE_SLOT, op, v, n_slots, 0, 0);
        return;
    }
    i64 e = 0;
    while (*(const int*)(slots.data + e * slots.nb[0]) != v) e++;
    report_error((ErrorRecord*)err, ERR_DUPLICATE_INDEX, WHAT_STATE_SLOT, op, v, n_slots, e, s);
}

// Sums of a and b over the 8 lanes of a group (aligned groups: xor 4, 2, 1 stays inside).
__device__ __forceinline__ void group_sum2(float& a, float& b) {
#pragma unroll
    for (int o = GDN_GROUP / 2; o > 0; o >>= 1) {
        a += __shfl_xor_sync(0xffffffffu, a, o);
        b += __shfl_xor_sync(0xffffffffu, b, o);
    }
}

// Pre-pass: k and q (times scale) of every (token, key head, sequence) as f32 rows of KS floats
// (zero padded past S_k), and k . q, in scratch: kbuf, qbuf [n_seq][H_k][n_t][KS], kq
// [n_seq][H_k][n_t]. One warp per row; grid-stride over rows.
extern "C" __global__ void gdn_prep(Tensor q, int qdt, Tensor k, int kdt, float scale, int ks_len, float* kbuf,
                                   float* qbuf, float* kq) {
    const i64 s_k = k.ne[0], h_k = k.ne[1], n_t = k.ne[2], n_seq = k.ne[3];
    const i64 rows = h_k * n_t * n_seq;
    const int lane = threadIdx.x & 31;
    for (i64 row = (blockIdx.x * (i64)blockDim.x + threadIdx.x) >> 5; row < rows;
         row += ((i64)gridDim.x * blockDim.x) >> 5) {
        const i64 t = row % n_t, kh = (row / n_t) % h_k, s = row / (n_t * h_k);  // row = (s, kh, t)
        float acc = 0.0f;
        for (int i = lane; i < ks_len; i += 32) {
            float kv = 0.0f, qv = 0.0f;
            if (i < s_k) {
                kv = load_f32(k.data + offset_of(k, i, kh, t, s), kdt);
                qv = load_f32(q.data + offset_of(q, i, kh, t, s), qdt) * scale;
            }
            kbuf[row * ks_len + i] = kv;
            qbuf[row * ks_len + i] = qv;
            acc = fmaf(kv, qv, acc);
        }
        acc = warp_sum(acc);
        if (lane == 0) kq[row] = acc;
    }
}

// A group's column of the state, to and from registers (chunk r of lane l: keys (r * GROUP + l) * 4
// .. + 4; zero past S_k and for a missing column).
template <int NC, bool VEC>
__device__ __forceinline__ void gdn_load_state(float (&st)[NC][4], const char* sbase, bool has_col, int lig, i64 s_k,
                                               i64 nb0) {
#pragma unroll
    for (int r = 0; r < NC; r++) {
        const int i0 = (r * GDN_GROUP + lig) * 4;
        if (VEC) {
            float4 x = has_col ? *(const float4*)(sbase + i0 * 4) : make_float4(0.f, 0.f, 0.f, 0.f);
            st[r][0] = x.x, st[r][1] = x.y, st[r][2] = x.z, st[r][3] = x.w;
        } else {
#pragma unroll
            for (int e = 0; e < 4; e++) st[r][e] = has_col && i0 + e < s_k ? *(const float*)(sbase + (i0 + e) * nb0) : 0.0f;
        }
    }
}
template <int NC, bool VEC>
__device__ __forceinline__ void gdn_store_state(const float (&st)[NC][4], char* sbase, int lig, i64 s_k, i64 nb0) {
#pragma unroll
    for (int r = 0; r < NC; r++) {
        const int i0 = (r * GDN_GROUP + lig) * 4;
        if (VEC) {
            *(float4*)(sbase + i0 * 4) = make_float4(st[r][0], st[r][1], st[r][2], st[r][3]);
        } else {
#pragma unroll
            for (int e = 0; e < 4; e++)
                if (i0 + e < s_k) *(float*)(sbase + (i0 + e) * nb0) = st[r][e];
        }
    }
}

// One token of the recurrence for a group's column (see the top of the file); returns o.
template <int NC>
__device__ __forceinline__ float gdn_step(float (&st)[NC][4], const float4 (&k)[NC], const float4 (&q)[NC], float v,
                                          float d, float b, float kq) {
    float sk[NC], sq[NC];
#pragma unroll
    for (int r = 0; r < NC; r++) {
        sk[r] = st[r][0] * k[r].x;
        sq[r] = st[r][0] * q[r].x;
        sk[r] = fmaf(st[r][1], k[r].y, sk[r]);
        sq[r] = fmaf(st[r][1], q[r].y, sq[r]);
        sk[r] = fmaf(st[r][2], k[r].z, sk[r]);
        sq[r] = fmaf(st[r][2], q[r].z, sq[r]);
        sk[r] = fmaf(st[r][3], k[r].w, sk[r]);
        sq[r] = fmaf(st[r][3], q[r].w, sq[r]);
    }
#pragma unroll
    for (int r = 1; r < NC; r++) sk[0] += sk[r], sq[0] += sq[r];
    group_sum2(sk[0], sq[0]);
    const float delta = b * (v - d * sk[0]);
#pragma unroll
    for (int r = 0; r < NC; r++) {
        st[r][0] = fmaf(st[r][0], d, k[r].x * delta);
        st[r][1] = fmaf(st[r][1], d, k[r].y * delta);
        st[r][2] = fmaf(st[r][2], d, k[r].z * delta);
        st[r][3] = fmaf(st[r][3], d, k[r].w * delta);
    }
    return fmaf(delta, kq, d * sq[0]);
}

// One token's inputs for one group: its key chunks of k and q, v[col], g, beta and k . q.
template <int NC>
struct GdnTok {
    float4 k[NC], q[NC];
    float v, g, b, kq;
};

// NC: float4 chunks per lane (S_k <= 32 NC). VEC: the state is 16-byte aligned with S_k = 32 NC,
// so chunks move as float4. k and q come from gdn_prep's buffers (row (s, kh, t) of KS floats);
// each token's inputs are loaded one token ahead so their latency hides behind the recurrence.
template <int NC, bool VEC>
__device__ __forceinline__ void gdn_body(Tensor out, Tensor v, int vdt, Tensor g, int gdt, Tensor beta, int bdt,
                                         Tensor state, Tensor slots, int h_k, int grouped, const float* kbuf,
                                         const float* qbuf, const float* kqbuf, u64 err) {
    const int KS = 32 * NC;
    if (((volatile ErrorRecord*)err)->code != 0u) return;
    const i64 s_k = state.ne[0], n_t = v.ne[2], s_v = v.ne[0], h_v = v.ne[1];
    const i64 h = blockIdx.y, s = blockIdx.z;
    const i64 kh = grouped ? h / (h_v / h_k) : h % h_k;
    const i64 slot = *(const int*)(slots.data + s * slots.nb[0]);
    if (slot < 0 || slot >= state.ne[3]) return;  // unreachable after gdn_check_slots

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int lig = lane & (GDN_GROUP - 1);
    const i64 col = (i64)blockIdx.x * GDN_COLS + warp * (32 / GDN_GROUP) + lane / GDN_GROUP;
    const bool has_col = col < s_v;
    const i64 vcol = has_col ? col : 0;  // a valid column to read v from (its result is unused)
    char* sbase = state.data + col * state.nb[1] + h * state.nb[2] + slot * state.nb[3];

    float st[NC][4];
    gdn_load_state<NC, VEC>(st, sbase, has_col, lig, s_k, state.nb[0]);

    const i64 row0 = (s * h_k + kh) * n_t;  // gdn_prep row of token 0
    GdnTok<NC> nx;
    auto load_tok = [&](i64 t) {
        const float* kr = kbuf + (row0 + t) * KS;
        const float* qr = qbuf + (row0 + t) * KS;
#pragma unroll
        for (int r = 0; r < NC; r++) {
            const int i0 = (r * GDN_GROUP + lig) * 4;
            nx.k[r] = *(const float4*)(kr + i0);
            nx.q[r] = *(const float4*)(qr + i0);
        }
        nx.v = load_f32(v.data + offset_of(v, vcol, h, t, s), vdt);
        nx.g = load_f32(g.data + offset_of(g, 0, h, t, s), gdt);
        nx.b = load_f32(beta.data + offset_of(beta, 0, h, t, s), bdt);
        nx.kq = kqbuf[row0 + t];
    };
    load_tok(0);
    for (i64 t = 0; t < n_t; t++) {
        const GdnTok<NC> cu = nx;
        if (t + 1 < n_t) load_tok(t + 1);
        const float o = gdn_step<NC>(st, cu.k, cu.q, cu.v, expf(cu.g), cu.b, cu.kq);
        if (lig == 0 && has_col) *(float*)(out.data + offset_of(out, col, h, t, s)) = o;
    }

    if (has_col) gdn_store_state<NC, VEC>(st, sbase, lig, s_k, state.nb[0]);
}

// Grid (ceil(S_v / COLS), H_v, n_seq), block 128 threads.
#define GDN_KERNEL(name, NC, VEC)                                                                          \
    extern "C" __global__ void __launch_bounds__(GDN_WARPS * 32)                                           \
        name(Tensor out, Tensor v, int vdt, Tensor g, int gdt, Tensor beta, int bdt, Tensor state,         \
             Tensor slots, int h_k, int grouped, const float* kbuf, const float* qbuf, const float* kq,    \
             u64 err) {                                                                                    \
        gdn_body<NC, VEC>(out, v, vdt, g, gdt, beta, bdt, state, slots, h_k, grouped, kbuf, qbuf, kq, err); \
    }

GDN_KERNEL(gdn_n1, 1, false)
GDN_KERNEL(gdn_n2, 2, false)
GDN_KERNEL(gdn_n4, 4, false)
GDN_KERNEL(gdn_n8, 8, false)
GDN_KERNEL(gdn_n4_vec, 4, true)

// Asynchronous 16- and 4-byte copies from global to shared memory (sm_80+).
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src));
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_addr(dst)), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }

// Prefill: as gdn_body, but the block stages TT = 64 / NC tokens at a time in shared memory,
// double buffered: k and q rows and k . q by cp.async from gdn_prep's buffers, v, g and beta
// through registers, the next tile's loads in flight while the current tile is computed. Needs
// 16-byte aligned prep buffers. Buffer layout (floats): k [TT][KS], q [TT][KS], v [TT][COLS],
// exp(g) [TT], beta [TT], k . q [TT]; dynamic shared memory 2 * 4 * (2 TT KS + TT COLS + 3 TT).
template <int NC, bool VEC>
__device__ __forceinline__ void gdn_tiled_body(Tensor out, Tensor v, int vdt, Tensor g, int gdt, Tensor beta,
                                               int bdt, Tensor state, Tensor slots, int h_k, int grouped,
                                               const float* kbuf, const float* qbuf, const float* kqbuf, u64 err) {
    const int KS = 32 * NC, TT = 64 / NC, VM = TT * GDN_COLS / (GDN_WARPS * 32);
    const int BUF = 2 * TT * KS + TT * GDN_COLS + 3 * TT;
    extern __shared__ __align__(16) float sh[];
    if (((volatile ErrorRecord*)err)->code != 0u) return;
    const i64 s_k = state.ne[0], n_t = v.ne[2], s_v = v.ne[0], h_v = v.ne[1];
    const i64 h = blockIdx.y, s = blockIdx.z, col0 = (i64)blockIdx.x * GDN_COLS;
    const i64 kh = grouped ? h / (h_v / h_k) : h % h_k;
    const i64 slot = *(const int*)(slots.data + s * slots.nb[0]);
    if (slot < 0 || slot >= state.ne[3]) return;  // unreachable after gdn_check_slots

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int lig = lane & (GDN_GROUP - 1), myc = warp * (32 / GDN_GROUP) + lane / GDN_GROUP;
    const i64 col = col0 + myc;
    const bool has_col = col < s_v;
    char* sbase = state.data + col * state.nb[1] + h * state.nb[2] + slot * state.nb[3];
    float st[NC][4];
    gdn_load_state<NC, VEC>(st, sbase, has_col, lig, s_k, state.nb[0]);

    const i64 row0 = (s * h_k + kh) * n_t;  // gdn_prep row of token 0
    float rv[VM], rg = 0.0f, rb = 0.0f;
    auto issue = [&](i64 t0, float* buf) {
        const int tn = (int)min((i64)TT, n_t - t0);
        const float* ksrc = kbuf + (row0 + t0) * KS;
        const float* qsrc = qbuf + (row0 + t0) * KS;
        for (int c = tid; c < tn * KS / 4; c += blockDim.x) {
            cp_async16(buf + c * 4, ksrc + c * 4);
            cp_async16(buf + TT * KS + c * 4, qsrc + c * 4);
        }
        if (tid < tn) cp_async4(buf + 2 * TT * KS + TT * GDN_COLS + 2 * TT + tid, kqbuf + row0 + t0 + tid);
        cp_async_commit();
#pragma unroll
        for (int m = 0; m < VM; m++) {
            const int idx = tid + m * GDN_WARPS * 32, tt = idx / GDN_COLS, c = idx % GDN_COLS;
            rv[m] = tt < tn && col0 + c < s_v ? load_f32(v.data + offset_of(v, col0 + c, h, t0 + tt, s), vdt) : 0.0f;
        }
        if (tid < tn) {
            rg = load_f32(g.data + offset_of(g, 0, h, t0 + tid, s), gdt);
            rb = load_f32(beta.data + offset_of(beta, 0, h, t0 + tid, s), bdt);
        }
    };

    issue(0, sh);
    for (i64 t0 = 0, i = 0; t0 < n_t; t0 += TT, i++) {
        float* cur = sh + (i & 1) * BUF;
        float *vs = cur + 2 * TT * KS, *gs = vs + TT * GDN_COLS, *bs = gs + TT, *kqs = bs + TT;
        const int tn = (int)min((i64)TT, n_t - t0);
#pragma unroll
        for (int m = 0; m < VM; m++) vs[tid + m * GDN_WARPS * 32] = rv[m];
        if (tid < tn) gs[tid] = expf(rg), bs[tid] = rb;
        cp_async_wait_all();
        __syncthreads();
        if (t0 + TT < n_t) issue(t0 + TT, sh + ((i + 1) & 1) * BUF);
        for (int tt = 0; tt < tn; tt++) {
            float4 k[NC], q[NC];
#pragma unroll
            for (int r = 0; r < NC; r++) {
                const int i0 = (r * GDN_GROUP + lig) * 4;
                k[r] = *(const float4*)(cur + tt * KS + i0);
                q[r] = *(const float4*)(cur + TT * KS + tt * KS + i0);
            }
            const float o = gdn_step<NC>(st, k, q, vs[tt * GDN_COLS + myc], gs[tt], bs[tt], kqs[tt]);
            if (lig == 0 && has_col) *(float*)(out.data + offset_of(out, col, h, t0 + tt, s)) = o;
        }
        __syncthreads();  // this buffer is refilled two tiles on
    }
    if (has_col) gdn_store_state<NC, VEC>(st, sbase, lig, s_k, state.nb[0]);
}

extern "C" __global__ void __launch_bounds__(GDN_WARPS * 32)
    gdn_tiled_n4_vec(Tensor out, Tensor v, int vdt, Tensor g, int gdt, Tensor beta, int bdt, Tensor state,
                     Tensor slots, int h_k, int grouped, const float* kbuf, const float* qbuf, const float* kq,
                     u64 err) {
    gdn_tiled_body<4, true>(out, v, vdt, g, gdt, beta, bdt, state, slots, h_k, grouped, kbuf, qbuf, kq, err);
}

// ---- Chunked form (S_k = S_v = 128, chunks of at most 64 tokens) ----
//
// The WY / UT-transform form of backend-cpu's `chunked`, in two kernels. `gdn_chunk_prep`, one
// block per (chunk, value head, sequence), builds what depends only on the chunk's inputs: with
// gamma the cumulative sum of g over the chunk,
//   A[i][j] = beta_i (k_i . k_j) exp(gamma_i - gamma_j) (j < i),  T = (I + A)^-1,
//   W = T (beta exp(gamma) K),  U = T (beta V),  QKm[i][j] = (q_i . k_j) exp(gamma_i - gamma_j) (j <= i),
// and writes W, U, QKm and gamma to a slot of scratch. `gdn_chunk_scan`, one block per 16 state
// columns of a (value head, sequence), then runs the chunks in order with its slice of the state
// in shared memory:
//   V_new = U - W S,  O = exp(gamma) (Q S) + QKm V_new,
//   S <- exp(gamma_last) S + K^T (exp(gamma_last - gamma) V_new).
// Rows of a chunk past its length are zero in W, U and QKm.

#define GC_C 64                                   // rows of a chunk slot
#define GC_D 128                                  // S_k = S_v
#define GC_LD (GC_D + 4)                          // padded shared row of k, q, v
#define GC_TLD (GC_C + 1)                         // padded shared row of A and T
#define GC_SLOT (2 * GC_C * GC_D + GC_C * GC_C + GC_C + GC_D * GC_D)  // W, U, QKm, gamma, S (floats)
#define GC_QK (2 * GC_C * GC_D)                   // offsets in a slot: QKm, gamma, starting state
#define GC_GAM (GC_QK + GC_C * GC_C)
#define GC_S (GC_GAM + GC_C)
#define GC_COLS 32                                // state columns per scan block

// Grid (n_chunks, H_v, n_seq), 256 threads, dynamic shared memory 4 * (2 C LD + 2 C TLD + 3 C).
// k and q rows are gdn_prep's (row (s, kh, t) of 128 floats); cbuf holds n_seq H_v n_chunks slots.
extern "C" __global__ void __launch_bounds__(256)
    gdn_chunk_prep(Tensor v, int vdt, Tensor g, int gdt, Tensor beta, int bdt, int h_k, int grouped, int chunk,
                   const float* kbuf, const float* qbuf, float* cbuf, u64 err) {
    extern __shared__ __align__(16) float sh[];
    float* ks = sh;                 // k rows [C][LD]
    float* qs = ks + GC_C * GC_LD;  // q rows, then beta v rows [C][LD]
    float* as = qs + GC_C * GC_LD;  // A [C][TLD]
    float* ts = as + GC_C * GC_TLD; // T [C][TLD]
    float *gam = ts + GC_C * GC_TLD, *bet = gam + GC_C, *eg = bet + GC_C;
    if (((volatile ErrorRecord*)err)->code != 0u) return;
    const i64 n_t = v.ne[2], h_v = v.ne[1];
    const i64 ci = blockIdx.x, h = blockIdx.y, s = blockIdx.z;
    const i64 kh = grouped ? h / (h_v / h_k) : h % h_k;
    const i64 t0 = ci * chunk;
    const int cn = (int)min((i64)chunk, n_t - t0);
    const i64 row0 = (s * h_k + kh) * n_t + t0;  // gdn_prep row of the chunk's first token
    const int tid = threadIdx.x;

    for (int idx = tid; idx < GC_C * GC_D / 4; idx += blockDim.x) {
        const int r = idx / (GC_D / 4), c = (idx % (GC_D / 4)) * 4;
        float4 kv = make_float4(0.f, 0.f, 0.f, 0.f), qv = kv;
        if (r < cn) {
            kv = *(const float4*)(kbuf + (row0 + r) * GC_D + c);
            qv = *(const float4*)(qbuf + (row0 + r) * GC_D + c);
        }
        *(float4*)(ks + r * GC_LD + c) = kv;
        *(float4*)(qs + r * GC_LD + c) = qv;
    }
    if (tid < GC_C) {
        const bool in = tid < cn;
        gam[tid] = in ? load_f32(g.data + offset_of(g, 0, h, t0 + tid, s), gdt) : 0.0f;
        bet[tid] = in ? load_f32(beta.data + offset_of(beta, 0, h, t0 + tid, s), bdt) : 0.0f;
    }
    for (int idx = tid; idx < GC_C * GC_TLD; idx += blockDim.x) ts[idx] = idx / GC_TLD == idx % GC_TLD ? 1.0f : 0.0f;
    __syncthreads();
    if (tid == 0) {
        float cum = 0.0f;
        for (int i = 0; i < GC_C; i++) {
            cum += gam[i];  // zero past the chunk: later rows keep the last value
            gam[i] = cum;
        }
    }
    __syncthreads();

    float* slot = cbuf + ((s * h_v + h) * (i64)gridDim.x + ci) * GC_SLOT;
    // K K^T and Q K^T: thread (ti, tj) owns rows ti + 16 m and columns tj + 16 n.
    {
        const int ti = tid >> 4, tj = tid & 15;
        float a[4][4], b[4][4];
#pragma unroll
        for (int m = 0; m < 4; m++)
#pragma unroll
            for (int n = 0; n < 4; n++) a[m][n] = 0.0f, b[m][n] = 0.0f;
        for (int k = 0; k < GC_D; k += 4) {
            float4 kr[4], qr[4], kc[4];
#pragma unroll
            for (int m = 0; m < 4; m++) {
                kr[m] = *(const float4*)(ks + (ti + 16 * m) * GC_LD + k);
                qr[m] = *(const float4*)(qs + (ti + 16 * m) * GC_LD + k);
                kc[m] = *(const float4*)(ks + (tj + 16 * m) * GC_LD + k);
            }
#pragma unroll
            for (int m = 0; m < 4; m++)
#pragma unroll
                for (int n = 0; n < 4; n++) {
                    a[m][n] = fmaf(kr[m].x, kc[n].x, a[m][n]);
                    a[m][n] = fmaf(kr[m].y, kc[n].y, a[m][n]);
                    a[m][n] = fmaf(kr[m].z, kc[n].z, a[m][n]);
                    a[m][n] = fmaf(kr[m].w, kc[n].w, a[m][n]);
                    b[m][n] = fmaf(qr[m].x, kc[n].x, b[m][n]);
                    b[m][n] = fmaf(qr[m].y, kc[n].y, b[m][n]);
                    b[m][n] = fmaf(qr[m].z, kc[n].z, b[m][n]);
                    b[m][n] = fmaf(qr[m].w, kc[n].w, b[m][n]);
                }
        }
        float* qkm = slot + 2 * GC_C * GC_D;
#pragma unroll
        for (int m = 0; m < 4; m++)
#pragma unroll
            for (int n = 0; n < 4; n++) {
                const int i = ti + 16 * m, j = tj + 16 * n;
                const float d = expf(gam[i] - gam[j]);
                as[i * GC_TLD + j] = j < i ? a[m][n] * (bet[i] * d) : 0.0f;
                qkm[i * GC_C + j] = j <= i && i < cn ? b[m][n] * d : 0.0f;
            }
    }
    __syncthreads();

    // T = (I + A)^-1 column by column (columns are independent): T[i][c] = -sum_{j < i} A[i][j]
    // T[j][c] for i > c, with T[c][c] = 1 and zeros above (so j starts near c). Four lanes share a
    // column.
    {
        const int c = tid >> 2, part = tid & 3;
        for (int i = 1; i < cn; i++) {
            float acc = 0.0f;
            if (i > c)
                for (int j = (c & ~3) + part; j < i; j += 4) acc = fmaf(as[i * GC_TLD + j], ts[j * GC_TLD + c], acc);
            acc += __shfl_xor_sync(0xffffffffu, acc, 1);
            acc += __shfl_xor_sync(0xffffffffu, acc, 2);
            if (i > c && part == 0) ts[i * GC_TLD + c] = -acc;
            __syncwarp();
        }
    }
    __syncthreads();

    // beta v rows in place of q; beta exp(gamma) per row.
    for (int idx = tid; idx < GC_C * GC_D; idx += blockDim.x) {
        const int r = idx / GC_D, c = idx % GC_D;
        qs[r * GC_LD + c] = r < cn ? load_f32(v.data + offset_of(v, c, h, t0 + r, s), vdt) * bet[r] : 0.0f;
    }
    if (tid < GC_C) eg[tid] = bet[tid] * expf(gam[tid]);
    __syncthreads();

    // W = T (beta exp(gamma) K), U = T (beta V): warp rg owns rows 8 rg .. + 8, lane columns
    // 4 lane .. + 4 (T is zero right of its diagonal, so j stops at the warp's last row).
    {
        const int rg = tid >> 5, c = (tid & 31) * 4;
        float w[8][4], u[8][4];
#pragma unroll
        for (int r = 0; r < 8; r++)
#pragma unroll
            for (int e = 0; e < 4; e++) w[r][e] = 0.0f, u[r][e] = 0.0f;
        const int jn = min(cn, rg * 8 + 8);
        for (int j = 0; j < jn; j++) {
            const float4 k4 = *(const float4*)(ks + j * GC_LD + c), v4 = *(const float4*)(qs + j * GC_LD + c);
            const float e = eg[j];
            const float kb[4] = {e * k4.x, e * k4.y, e * k4.z, e * k4.w}, vb[4] = {v4.x, v4.y, v4.z, v4.w};
#pragma unroll
            for (int r = 0; r < 8; r++) {
                const float t = ts[(rg * 8 + r) * GC_TLD + j];
#pragma unroll
                for (int x = 0; x < 4; x++) {
                    w[r][x] = fmaf(t, kb[x], w[r][x]);
                    u[r][x] = fmaf(t, vb[x], u[r][x]);
                }
            }
        }
#pragma unroll
        for (int r = 0; r < 8; r++) {
            const int i = rg * 8 + r;
            const bool in = i < cn;
            *(float4*)(slot + i * GC_D + c) =
                in ? make_float4(w[r][0], w[r][1], w[r][2], w[r][3]) : make_float4(0.f, 0.f, 0.f, 0.f);
            *(float4*)(slot + GC_C * GC_D + i * GC_D + c) =
                in ? make_float4(u[r][0], u[r][1], u[r][2], u[r][3]) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
    }
    if (tid < GC_C) slot[2 * GC_C * GC_D + GC_C * GC_C + tid] = gam[tid];
}

// 16-byte copies of `rows` rows of 128 floats (row stride 128 in global memory, GC_LD in shared
// memory) by the block, asynchronously.
__device__ __forceinline__ void gc_copy_rows(float* dst, const float* src, int rows) {
    for (int idx = threadIdx.x; idx < rows * (GC_D / 4); idx += blockDim.x) {
        const int r = idx / (GC_D / 4), c = (idx % (GC_D / 4)) * 4;
        cp_async16(dst + r * GC_LD + c, src + r * GC_D + c);
    }
}

// Grid (S_v / 32, H_v, n_seq), 256 threads, dynamic shared memory GC_SCAN_SHARED bytes. The
// block's 128 x 32 slice of the state lives in shared memory ([key][column]) from the first chunk
// to the last. Per chunk it computes V_new = U - W S (written over U in the slot), stores the
// chunk's starting state S to the slot (for gdn_chunk_out) and updates S. W and K rows are staged
// by cp.async, each loaded while the other is in use. Thread (tr, tc) owns columns 2 tc .. + 2
// of rows tr + 16 m of V_new and of keys 8 tr .. + 8 of the state. Slots are validated by
// gdn_check_slots first.
#define GC_SCAN_SHARED (4 * (2 * GC_C * GC_LD + GC_D * GC_COLS + GC_C * GC_COLS + GC_C))
extern "C" __global__ void __launch_bounds__(256)
    gdn_chunk_scan(Tensor state, Tensor slots, int h_k, int grouped, int chunk, int n_chunks, i64 n_t,
                   const float* kbuf, float* cbuf, u64 err) {
    extern __shared__ __align__(16) float sh[];
    float* ws = sh;                   // W rows [C][LD]
    float* kts = ws + GC_C * GC_LD;   // K rows [C][LD]
    float* ss = kts + GC_C * GC_LD;   // state [D][COLS]
    float* vn = ss + GC_D * GC_COLS;  // V_new [C][COLS]
    float* es = vn + GC_C * GC_COLS;  // exp(gamma_last - gamma) [C]
    if (((volatile ErrorRecord*)err)->code != 0u) return;
    const i64 h_v = state.ne[2];
    const i64 h = blockIdx.y, s = blockIdx.z, col0 = (i64)blockIdx.x * GC_COLS;
    const i64 kh = grouped ? h / (h_v / h_k) : h % h_k;
    const i64 slot = *(const int*)(slots.data + s * slots.nb[0]);
    if (slot < 0 || slot >= state.ne[3]) return;  // unreachable after gdn_check_slots
    const int tid = threadIdx.x, tr = tid >> 4, c0 = (tid & 15) * 2;
    char* sbase = state.data + col0 * state.nb[1] + h * state.nb[2] + slot * state.nb[3];
    for (int idx = tid; idx < GC_D * GC_COLS; idx += blockDim.x) {
        const int k = idx % GC_D, j = idx / GC_D;
        ss[k * GC_COLS + j] = *(const float*)(sbase + k * state.nb[0] + j * state.nb[1]);
    }
    const i64 row0 = (s * h_k + kh) * n_t;  // gdn_prep row of token 0
    float* cslots = cbuf + (s * h_v + h) * (i64)n_chunks * GC_SLOT;
    auto chunk_len = [&](int ci) { return (int)min((i64)chunk, n_t - (i64)ci * chunk); };
    gc_copy_rows(ws, cslots, GC_C);
    cp_async_commit();
    gc_copy_rows(kts, kbuf + row0 * GC_D, chunk_len(0));
    cp_async_commit();
    for (int ci = 0; ci < n_chunks; ci++) {
        const int cn = chunk_len(ci);
        float* cs = cslots + (i64)ci * GC_SLOT;
        const float* gs = cs + GC_GAM;
        float2 u[4];
#pragma unroll
        for (int m = 0; m < 4; m++) u[m] = *(const float2*)(cs + GC_C * GC_D + (tr + 16 * m) * GC_D + col0 + c0);
        const float last = gs[cn - 1];
        if (tid < GC_C) es[tid] = tid < cn ? expf(last - gs[tid]) : 0.0f;
        asm volatile("cp.async.wait_group 1;" ::: "memory");
        __syncthreads();  // W is in place; the previous update of the state is done

        // V_new = U - W S (rows past the chunk: W and U are zero).
        float va[4][2];
#pragma unroll
        for (int m = 0; m < 4; m++) va[m][0] = 0.0f, va[m][1] = 0.0f;
#pragma unroll 4
        for (int k = 0; k < GC_D; k += 4) {
            float w[4][4];
#pragma unroll
            for (int m = 0; m < 4; m++) {
                const float4 w4 = *(const float4*)(ws + (tr + 16 * m) * GC_LD + k);
                w[m][0] = w4.x, w[m][1] = w4.y, w[m][2] = w4.z, w[m][3] = w4.w;
            }
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const float2 s2 = *(const float2*)(ss + (k + e) * GC_COLS + c0);
#pragma unroll
                for (int m = 0; m < 4; m++) {
                    va[m][0] = fmaf(w[m][e], s2.x, va[m][0]);
                    va[m][1] = fmaf(w[m][e], s2.y, va[m][1]);
                }
            }
        }
#pragma unroll
        for (int m = 0; m < 4; m++) {
            const int i = tr + 16 * m;
            const float2 x = make_float2(u[m].x - va[m][0], u[m].y - va[m][1]);
            *(float2*)(vn + i * GC_COLS + c0) = x;
            *(float2*)(cs + GC_C * GC_D + i * GC_D + col0 + c0) = x;
        }
        cp_async_wait_all();
        __syncthreads();  // V_new, es and K are in place; W is free
        if (ci + 1 < n_chunks) {
            gc_copy_rows(ws, cs + GC_SLOT, GC_C);
            cp_async_commit();
        }

        // S <- exp(gamma_last) S + K^T (es V_new); the starting S goes to the slot first.
        float sa[8][2];
#pragma unroll
        for (int m = 0; m < 8; m++) sa[m][0] = 0.0f, sa[m][1] = 0.0f;
        for (int l = 0; l < cn; l++) {
            const float2 v2 = *(const float2*)(vn + l * GC_COLS + c0);
            const float el = es[l];
            const float x0 = el * v2.x, x1 = el * v2.y;
            const float4 ka = *(const float4*)(kts + l * GC_LD + 8 * tr);
            const float4 kb = *(const float4*)(kts + l * GC_LD + 8 * tr + 4);
            const float kv[8] = {ka.x, ka.y, ka.z, ka.w, kb.x, kb.y, kb.z, kb.w};
#pragma unroll
            for (int m = 0; m < 8; m++) {
                sa[m][0] = fmaf(kv[m], x0, sa[m][0]);
                sa[m][1] = fmaf(kv[m], x1, sa[m][1]);
            }
        }
        const float dl = expf(last);
#pragma unroll
        for (int m = 0; m < 8; m++) {
            float* sp = ss + (8 * tr + m) * GC_COLS + c0;
            const float2 s2 = *(const float2*)sp;
            *(float2*)(cs + GC_S + (8 * tr + m) * GC_D + col0 + c0) = s2;
            *(float2*)sp = make_float2(fmaf(dl, s2.x, sa[m][0]), fmaf(dl, s2.y, sa[m][1]));
        }
        __syncthreads();  // K, V_new and es are free
        if (ci + 1 < n_chunks) {
            gc_copy_rows(kts, kbuf + (row0 + (i64)(ci + 1) * chunk) * GC_D, chunk_len(ci + 1));
            cp_async_commit();
        }
    }
    for (int idx = tid; idx < GC_D * GC_COLS; idx += blockDim.x) {
        const int k = idx % GC_D, j = idx / GC_D;
        *(float*)(sbase + k * state.nb[0] + j * state.nb[1]) = ss[k * GC_COLS + j];
    }
}

// Grid (2 n_chunks, H_v, n_seq), 256 threads, dynamic shared memory GC_OUT_SHARED bytes: the
// outputs of 64 columns (blockIdx.x & 1) of one chunk, O = exp(gamma) (Q S) + QKm V_new, from
// the chunk's starting state and V_new that gdn_chunk_scan left in its slot. Thread (tr, tc) owns
// columns 4 tc .. + 4 of rows tr + 16 m.
#define GC_OCOLS 64
#define GC_OUT_SHARED (4 * (GC_C * GC_LD + GC_D * GC_OCOLS + GC_C * GC_C + GC_C * GC_OCOLS + GC_C))
extern "C" __global__ void __launch_bounds__(256)
    gdn_chunk_out(Tensor out, int h_k, int grouped, int chunk, int n_chunks, const float* qbuf, const float* cbuf,
                  u64 err) {
    extern __shared__ __align__(16) float sh[];
    float* qs = sh;                     // Q rows [C][LD]
    float* ss = qs + GC_C * GC_LD;      // starting state [D][OCOLS]
    float* qks = ss + GC_D * GC_OCOLS;  // QKm [C][C]
    float* vn = qks + GC_C * GC_C;      // V_new [C][OCOLS]
    float* gs = vn + GC_C * GC_OCOLS;   // gamma [C]
    if (((volatile ErrorRecord*)err)->code != 0u) return;
    const i64 n_t = out.ne[2], h_v = out.ne[1];
    const i64 ci = blockIdx.x >> 1, h = blockIdx.y, s = blockIdx.z, col0 = (i64)(blockIdx.x & 1) * GC_OCOLS;
    const i64 kh = grouped ? h / (h_v / h_k) : h % h_k;
    const i64 t0 = ci * chunk;
    const int cn = (int)min((i64)chunk, n_t - t0);
    const float* cs = cbuf + ((s * h_v + h) * (i64)n_chunks + ci) * GC_SLOT;
    const float* qsrc = qbuf + ((s * h_k + kh) * n_t + t0) * GC_D;
    const int tid = threadIdx.x, tr = tid >> 4, c0 = (tid & 15) * 4;
    for (int idx = tid; idx < GC_C * GC_D / 4; idx += blockDim.x) {
        const int r = idx / (GC_D / 4), c = (idx % (GC_D / 4)) * 4;
        *(float4*)(qs + r * GC_LD + c) = r < cn ? *(const float4*)(qsrc + r * GC_D + c) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    for (int idx = tid; idx < GC_D * GC_OCOLS / 4; idx += blockDim.x) {
        const int r = idx / (GC_OCOLS / 4), c = (idx % (GC_OCOLS / 4)) * 4;
        *(float4*)(ss + r * GC_OCOLS + c) = *(const float4*)(cs + GC_S + r * GC_D + col0 + c);
        if (r < GC_C) *(float4*)(vn + r * GC_OCOLS + c) = *(const float4*)(cs + GC_C * GC_D + r * GC_D + col0 + c);
    }
    for (int idx = tid; idx < (GC_C * GC_C + GC_C) / 4; idx += blockDim.x)
        *(float4*)(qks + idx * 4) = *(const float4*)(cs + GC_QK + idx * 4);  // QKm then gamma, contiguous
    __syncthreads();

    float o[4][4];
#pragma unroll
    for (int m = 0; m < 4; m++)
#pragma unroll
        for (int e = 0; e < 4; e++) o[m][e] = 0.0f;
#pragma unroll 2
    for (int k = 0; k < GC_D; k += 4) {
        float q[4][4];
#pragma unroll
        for (int m = 0; m < 4; m++) {
            const float4 q4 = *(const float4*)(qs + (tr + 16 * m) * GC_LD + k);
            q[m][0] = q4.x, q[m][1] = q4.y, q[m][2] = q4.z, q[m][3] = q4.w;
        }
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const float4 s4 = *(const float4*)(ss + (k + e) * GC_OCOLS + c0);
#pragma unroll
            for (int m = 0; m < 4; m++) {
                o[m][0] = fmaf(q[m][e], s4.x, o[m][0]);
                o[m][1] = fmaf(q[m][e], s4.y, o[m][1]);
                o[m][2] = fmaf(q[m][e], s4.z, o[m][2]);
                o[m][3] = fmaf(q[m][e], s4.w, o[m][3]);
            }
        }
    }
#pragma unroll
    for (int m = 0; m < 4; m++) {
        const float e = expf(gs[tr + 16 * m]);
#pragma unroll
        for (int j = 0; j < 4; j++) o[m][j] *= e;
    }
    const int ln = min(cn, tr + 49);  // the thread's last row is tr + 48 (QKm is zero above the diagonal)
    for (int l = 0; l < ln; l++) {
        const float4 v4 = *(const float4*)(vn + l * GC_OCOLS + c0);
#pragma unroll
        for (int m = 0; m < 4; m++) {
            const float qk = qks[(tr + 16 * m) * GC_C + l];
            o[m][0] = fmaf(qk, v4.x, o[m][0]);
            o[m][1] = fmaf(qk, v4.y, o[m][1]);
            o[m][2] = fmaf(qk, v4.z, o[m][2]);
            o[m][3] = fmaf(qk, v4.w, o[m][3]);
        }
    }
#pragma unroll
    for (int m = 0; m < 4; m++) {
        const int i = tr + 16 * m;
        if (i < cn)
#pragma unroll
            for (int j = 0; j < 4; j++) *(float*)(out.data + offset_of(out, col0 + c0 + j, h, t0 + i, s)) = o[m][j];
    }
}
