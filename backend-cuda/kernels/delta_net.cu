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
// A block of 4 warps owns 16 columns of one (value head, sequence) and stages TT tokens of q, k,
// v, g, beta (converted to f32) in shared memory at a time. Slots are validated by
// `gdn_check_slots` first; the main kernel does nothing when an error is recorded.

#define GDN_GROUP 8
#define GDN_WARPS 4
#define GDN_COLS (GDN_WARPS * 32 / GDN_GROUP)
#define GDN_TT 16

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

// Sums of a, b and c over the 8 lanes of a group (aligned groups: xor 4, 2, 1 stays inside).
__device__ __forceinline__ void group_sum3(float& a, float& b, float& c) {
#pragma unroll
    for (int o = GDN_GROUP / 2; o > 0; o >>= 1) {
        a += __shfl_xor_sync(0xffffffffu, a, o);
        b += __shfl_xor_sync(0xffffffffu, b, o);
        c += __shfl_xor_sync(0xffffffffu, c, o);
    }
}

// The raw bits of one float element (f32, f16 or bf16): loads stay branch free so that a tile's
// loads can all be in flight at once; `raw_to_f32` converts them later.
__device__ __forceinline__ u32 load_raw(const char* p, int dt) {
    return dt == DT_F32 ? *(const u32*)p : (u32)*(const u16*)p;
}
__device__ __forceinline__ float raw_to_f32(u32 raw, int dt) {
    return dt == DT_F32 ? __uint_as_float(raw) : dt == DT_F16 ? f16_to_f32((u16)raw) : bf16_to_f32((u16)raw);
}

// NC: float4 chunks per lane (S_k <= 32 NC). VEC: the state is 16-byte aligned with S_k = 32 NC,
// so chunks move as float4. `tt_cap` (<= GDN_TT): tokens per staged tile, min(GDN_TT, n_t).
template <int NC, bool VEC>
__device__ __forceinline__ void gdn_body(Tensor out, Tensor q, int qdt, Tensor k, int kdt, Tensor v, int vdt,
                                         Tensor g, int gdt, Tensor beta, int bdt, Tensor state, Tensor slots,
                                         float scale, int grouped, int tt_cap, u64 err) {
    const int KS = 32 * NC;                            // staged keys per token (zero padded past S_k)
    const int KM = GDN_TT * KS / (GDN_WARPS * 32);     // key elements per thread per tile
    const int VM = GDN_TT * GDN_COLS / (GDN_WARPS * 32);  // v elements per thread per tile
    extern __shared__ __align__(16) float sh[];
    float* ks = sh;                    // [tt_cap][KS]
    float* qs = ks + tt_cap * KS;      // [tt_cap][KS], times scale
    float* vs = qs + tt_cap * KS;      // [tt_cap][COLS]
    float* os = vs + tt_cap * GDN_COLS;  // [tt_cap][COLS]
    float* gs = os + tt_cap * GDN_COLS;  // [tt_cap] exp(g)
    float* bs = gs + tt_cap;             // [tt_cap] beta

    if (((volatile ErrorRecord*)err)->code != 0u) return;
    const i64 s_k = k.ne[0], h_k = k.ne[1], n_t = k.ne[2], s_v = v.ne[0], h_v = v.ne[1];
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
#pragma unroll
    for (int r = 0; r < NC; r++) {
        const int i0 = (r * GDN_GROUP + lig) * 4;
        if (VEC) {
            float4 x = has_col ? *(const float4*)(sbase + i0 * 4) : make_float4(0.f, 0.f, 0.f, 0.f);
            st[r][0] = x.x, st[r][1] = x.y, st[r][2] = x.z, st[r][3] = x.w;
        } else {
#pragma unroll
            for (int e = 0; e < 4; e++)
                st[r][e] = has_col && i0 + e < s_k ? *(const float*)(sbase + (i0 + e) * state.nb[0]) : 0.0f;
        }
    }

    // The next tile's inputs, raw, in registers: loaded while the current tile is computed.
    u32 pk[KM], pq[KM], pv[VM], pg = 0, pb = 0;
    auto load_tile = [&](i64 t0) {
        const int tn = (int)min((i64)tt_cap, n_t - t0);
#pragma unroll
        for (int m = 0; m < KM; m++) {
            const int idx = tid + m * GDN_WARPS * 32, tt = idx / KS, i = idx % KS;
            pk[m] = pq[m] = 0;
            if (tt < tn && i < s_k) {
                pk[m] = load_raw(k.data + offset_of(k, i, kh, t0 + tt, s), kdt);
                pq[m] = load_raw(q.data + offset_of(q, i, kh, t0 + tt, s), qdt);
            }
        }
#pragma unroll
        for (int m = 0; m < VM; m++) {
            const int idx = tid + m * GDN_WARPS * 32, tt = idx / GDN_COLS, c = idx % GDN_COLS;
            pv[m] = 0;
            if (tt < tn && col0 + c < s_v) pv[m] = load_raw(v.data + offset_of(v, col0 + c, h, t0 + tt, s), vdt);
        }
        if (tid < tn) {
            pg = load_raw(g.data + offset_of(g, 0, h, t0 + tid, s), gdt);
            pb = load_raw(beta.data + offset_of(beta, 0, h, t0 + tid, s), bdt);
        }
    };
    auto store_tile = [&](int tn) {
#pragma unroll
        for (int m = 0; m < KM; m++) {
            const int idx = tid + m * GDN_WARPS * 32;
            if (idx < tn * KS) {
                ks[idx] = raw_to_f32(pk[m], kdt);
                qs[idx] = raw_to_f32(pq[m], qdt) * scale;
            }
        }
#pragma unroll
        for (int m = 0; m < VM; m++) {
            const int idx = tid + m * GDN_WARPS * 32;
            if (idx < tn * GDN_COLS) vs[idx] = raw_to_f32(pv[m], vdt);
        }
        if (tid < tn) {
            gs[tid] = expf(raw_to_f32(pg, gdt));
            bs[tid] = raw_to_f32(pb, bdt);
        }
    };

    load_tile(0);
    for (i64 t0 = 0; t0 < n_t; t0 += tt_cap) {
        const int tn = (int)min((i64)tt_cap, n_t - t0);
        __syncthreads();  // the previous tile's staged inputs and outputs are consumed
        store_tile(tn);
        __syncthreads();
        if (t0 + tt_cap < n_t) load_tile(t0 + tt_cap);
        for (int tt = 0; tt < tn; tt++) {
            float kk[NC][4], qq[NC][4];
#pragma unroll
            for (int r = 0; r < NC; r++) {
                const int i0 = (r * GDN_GROUP + lig) * 4;
                float4 a = *(const float4*)(ks + tt * KS + i0);
                float4 b = *(const float4*)(qs + tt * KS + i0);
                kk[r][0] = a.x, kk[r][1] = a.y, kk[r][2] = a.z, kk[r][3] = a.w;
                qq[r][0] = b.x, qq[r][1] = b.y, qq[r][2] = b.z, qq[r][3] = b.w;
            }
            float sk[NC], sq[NC], kq[NC];
#pragma unroll
            for (int r = 0; r < NC; r++) {
                sk[r] = st[r][0] * kk[r][0];
                sq[r] = st[r][0] * qq[r][0];
                kq[r] = kk[r][0] * qq[r][0];
#pragma unroll
                for (int e = 1; e < 4; e++) {
                    sk[r] = fmaf(st[r][e], kk[r][e], sk[r]);
                    sq[r] = fmaf(st[r][e], qq[r][e], sq[r]);
                    kq[r] = fmaf(kk[r][e], qq[r][e], kq[r]);
                }
            }
#pragma unroll
            for (int r = 1; r < NC; r++) sk[0] += sk[r], sq[0] += sq[r], kq[0] += kq[r];
            group_sum3(sk[0], sq[0], kq[0]);
            const float d = gs[tt];
            const float delta = bs[tt] * (vs[tt * GDN_COLS + myc] - d * sk[0]);
            const float o = fmaf(delta, kq[0], d * sq[0]);
#pragma unroll
            for (int r = 0; r < NC; r++) {
#pragma unroll
                for (int e = 0; e < 4; e++) st[r][e] = fmaf(st[r][e], d, kk[r][e] * delta);
            }
            if (lig == 0) os[tt * GDN_COLS + myc] = o;
        }
        __syncthreads();
        for (int idx = tid; idx < tn * GDN_COLS; idx += blockDim.x) {
            const int tt = idx / GDN_COLS, c = idx % GDN_COLS;
            if (col0 + c < s_v) *(float*)(out.data + offset_of(out, col0 + c, h, t0 + tt, s)) = os[idx];
        }
    }

    if (!has_col) return;
#pragma unroll
    for (int r = 0; r < NC; r++) {
        const int i0 = (r * GDN_GROUP + lig) * 4;
        if (VEC) {
            *(float4*)(sbase + i0 * 4) = make_float4(st[r][0], st[r][1], st[r][2], st[r][3]);
        } else {
#pragma unroll
            for (int e = 0; e < 4; e++)
                if (i0 + e < s_k) *(float*)(sbase + (i0 + e) * state.nb[0]) = st[r][e];
        }
    }
}

// Grid (ceil(S_v / COLS), H_v, n_seq), block 128 threads, dynamic shared memory
// 4 tt_cap (2 * 32 NC + 2 COLS + 2) bytes.
#define GDN_KERNEL(name, NC, VEC)                                                                             \
    extern "C" __global__ void __launch_bounds__(GDN_WARPS * 32)                                              \
        name(Tensor out, Tensor q, int qdt, Tensor k, int kdt, Tensor v, int vdt, Tensor g, int gdt,          \
             Tensor beta, int bdt, Tensor state, Tensor slots, float scale, int grouped, int tt_cap, u64 err) {\
        gdn_body<NC, VEC>(out, q, qdt, k, kdt, v, vdt, g, gdt, beta, bdt, state, slots, scale, grouped, tt_cap, \
                          err);                                                                       \
    }

GDN_KERNEL(gdn_n1, 1, false)
GDN_KERNEL(gdn_n2, 2, false)
GDN_KERNEL(gdn_n4, 4, false)
GDN_KERNEL(gdn_n8, 8, false)
GDN_KERNEL(gdn_n4_vec, 4, true)
