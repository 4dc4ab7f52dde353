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
// The chunked algorithm computes the same values; this exact serial form serves both.
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

// The state-slot check of `check_state_slots` (common.cuh), run as one block before any state is
// written.
extern "C" __global__ void gdn_check_slots(Tensor slots, i64 n_slots, u64 err, u32 op) { check_state_slots(slots, n_slots, err, op); }

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
