// delta_net.cu: gated_delta_net, the gated delta rule over per-slot f32 states: the slot check,
// the serial and tiled kernels and the fused op's input preparation (the chunked form on tensor
// cores: delta_net_chunked.cu; what both share: delta_net.cuh).
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
// with cp.async, double buffered. Slots are validated first (by `gdn_check_slots`, or by block 0 of
// `gdn_prep` when the chunked kernels do not run); the main kernels do nothing when an error is
// recorded.
//
// Ragged batches (a seq_offsets tensor; null `offsets.data` means dense) pack the tokens of all
// sequences along the token dimension: block z of a kernel is sequence s, and reads its token range
// from the offsets on the device (no host readback: a captured CUDA graph replays with new
// offsets). Each kernel takes the sequences whose length lies in its range (`gdn_runs`): the plain
// serial kernel the short ones (decode), the tiled or the chunked kernels the longer ones (the
// long ones through a work list the check kernel writes); `gdn_prep` zeroes the outputs of tokens
// of no sequence.

#define GDN_GROUP 8
#define GDN_WARPS 4
#define GDN_COLS (GDN_WARPS * 32 / GDN_GROUP)

// The state-slot check of `check_state_slots` (common.cuh), run as one block before any state is
// written. Ragged (`offsets.data` not null): the seq_offsets first, then the slots of the sequences
// with tokens, then (when `table` is not null) the work list of the kernels for long sequences
// (tiled and chunked): table[0] = the number m of sequences longer than serial_max, table[1 + i]
// the i-th of them (i < m), and table[1 + n_seq + i] its first chunk of 64 (CW_C) tokens in the
// chunk buffers (i <= m; the last entry is the total).
__device__ void gdn_check(const Tensor& slots, const Tensor& offsets, i64 n_tokens, i64 n_slots, i64 serial_max,
                          int* table, u64 err, u32 op) {
    __shared__ int lens[RAGGED_STAGE];
    if (offsets.data == nullptr) {
        check_state_slots(slots, n_slots, err, op);
        return;
    }
    if (!check_seq_offsets(offsets, n_tokens, err, op)) return;
    check_ragged_state_slots(slots, offsets, n_slots, err, op);
    __syncthreads();  // the error record thread 0 may just have written
    if (table == nullptr || ((volatile ErrorRecord*)err)->code != 0u) return;
    const i64 n_seq = slots.ne[0];
    auto len_of = [&](i64 s) -> i64 { return seq_offset(offsets, s + 1, n_tokens) - seq_offset(offsets, s, n_tokens); };
    for (i64 s = threadIdx.x; s < n_seq && s < RAGGED_STAGE; s += blockDim.x) lens[s] = (int)len_of(s);
    __syncthreads();
    if (threadIdx.x != 0) return;
    int m = 0, chunks = 0;
    for (i64 s = 0; s < n_seq; s++) {
        const i64 len = s < RAGGED_STAGE ? lens[s] : len_of(s);
        if (len <= serial_max) continue;
        table[1 + m] = (int)s;
        table[1 + n_seq + m] = chunks;
        chunks += (int)((len + 63) / 64);
        m++;
    }
    table[1 + n_seq + m] = chunks;
    table[0] = m;
}
extern "C" __global__ void gdn_check_slots(Tensor slots, Tensor offsets, i64 n_tokens, i64 n_slots, i64 serial_max,
                                           int* table, u64 err, u32 op) {
    grid_begin();
    gdn_check(slots, offsets, n_tokens, n_slots, serial_max, table, err, op);
}

// Sums of a and b over the 8 lanes of a group (aligned groups: xor 4, 2, 1 stays inside).
__device__ __forceinline__ void group_sum2(float& a, float& b) {
#pragma unroll
    for (int o = GDN_GROUP / 2; o > 0; o >>= 1) {
        a += __shfl_xor_sync(0xffffffffu, a, o);
        b += __shfl_xor_sync(0xffffffffu, b, o);
    }
}

// Zeroes the op's output rows of a ragged batch's padding tokens (before seq_offsets[0], from
// seq_offsets[n_seq] on; `out` contiguous [S_v, H_v, n_t, 1]), element i = first, first + step, ..
__device__ __forceinline__ void gdn_zero_padding(const Tensor& out, const Tensor& offsets, i64 n_t, i64 first, i64 step) {
    const i64 row = out.ne[0] * out.ne[1], n_seq = offsets.ne[0] - 1;
    const i64 lead = seq_offset(offsets, 0, n_t) * row, tail = seq_offset(offsets, n_seq, n_t) * row;
    float* o = (float*)out.data;
    for (i64 i = first; i < lead + n_t * row - tail; i += step) o[i < lead ? i : tail + (i - lead)] = 0.0f;
}

// Pre-pass: k and q (times scale) of every (token, key head, outer index) as f32 rows of KS floats
// (zero padded past S_k), and k . q, in scratch: kbuf, qbuf [n_outer][H_k][n_t][KS], kq
// [n_outer][H_k][n_t]. One warp per row; grid-stride over rows. Ragged: only the rows of
// sequences of at most serial_max tokens (those the serial kernels run), none of padding; and the
// op's outputs of padding tokens (before seq_offsets[0] and from seq_offsets[n_seq] on; `out` is
// contiguous [S_v, H_v, n_tokens, 1]) are zeroed here, grid-stride over just those rows.
extern "C" __global__ void gdn_prep(Tensor q, int qdt, Tensor k, int kdt, float scale, int ks_len, float* kbuf,
                                   float* qbuf, float* kq, Tensor offsets, i64 serial_max, Tensor out, Tensor slots,
                                   i64 n_slots, i64 list_min, int* table, int check, u64 err, u32 op) {
    grid_begin();
    // `check`: block 0 runs gdn_check_slots' check first, its work list of the sequences longer
    // than list_min included (the serial path without the chunked kernels, which need both before
    // their first kernel): what it writes is read by the kernels after this one, and this kernel
    // reads no slot and clamps the offsets.
    if (check && blockIdx.x == 0) {
        gdn_check(slots, offsets, k.ne[2], n_slots, list_min, table, err, op);
        __syncthreads();  // thread 0 may just have recorded an error: the whole block sees it below
    }
    if (((volatile ErrorRecord*)err)->code != 0u) return;
    const i64 s_k = k.ne[0], h_k = k.ne[1], n_t = k.ne[2], n_outer = k.ne[3];
    const i64 rows = h_k * n_t * n_outer;
    const int lane = threadIdx.x & 31;
    for (i64 row = (blockIdx.x * (i64)blockDim.x + threadIdx.x) >> 5; row < rows;
         row += ((i64)gridDim.x * blockDim.x) >> 5) {
        const i64 t = row % n_t, kh = (row / n_t) % h_k, s = row / (n_t * h_k);  // row = (s, kh, t)
        if (offsets.data != nullptr) {
            const i64 seq = seq_of_token(offsets, offsets.ne[0] - 1, t, n_t);
            if (seq < 0) continue;
            const i64 len = seq_offset(offsets, seq + 1, n_t) - seq_offset(offsets, seq, n_t);
            if (!gdn_runs(len, 1, serial_max)) continue;
        }
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
    if (offsets.data != nullptr) gdn_zero_padding(out, offsets, n_t, blockIdx.x * (i64)blockDim.x + threadIdx.x, (i64)gridDim.x * blockDim.x);
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
// so chunks move as float4. k and q come from gdn_prep's buffers (row (outer, kh, t) of KS
// floats); each token's inputs are loaded one token ahead so their latency hides behind the
// recurrence. Block z is sequence s (gdn_span); a sequence whose length is outside len_min ..=
// len_max (gdn_runs) returns before reading its slot.
template <int NC, bool VEC>
__device__ __forceinline__ void gdn_body(Tensor out, Tensor v, int vdt, Tensor g, int gdt, Tensor beta, int bdt,
                                         Tensor state, Tensor slots, int h_k, int grouped, const float* kbuf,
                                         const float* qbuf, const float* kqbuf, Tensor offsets, i64 len_min,
                                         i64 len_max, u64 err) {
    const int KS = 32 * NC;
    if (((volatile ErrorRecord*)err)->code != 0u) return;
    const i64 s_k = state.ne[0], n_t = v.ne[2], s_v = v.ne[0], h_v = v.ne[1];
    const i64 h = blockIdx.y, s = blockIdx.z;
    // (the slot is loaded with the offsets, before the length test, so both loads are in flight
    // at once; an empty sequence's slot value is never used)
    const i64 slot = *(const int*)(slots.data + s * slots.nb[0]);
    const GdnSpan sp = gdn_span(offsets, s, n_t);
    if (!gdn_runs(sp.end - sp.begin, len_min, len_max)) return;
    const i64 kh = grouped ? h / (h_v / h_k) : h % h_k;
    if (slot < 0 || slot >= state.ne[3]) return;  // unreachable after gdn_check_slots

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int lig = lane & (GDN_GROUP - 1);
    const i64 col = (i64)blockIdx.x * GDN_COLS + warp * (32 / GDN_GROUP) + lane / GDN_GROUP;
    const bool has_col = col < s_v;
    const i64 vcol = has_col ? col : 0;  // a valid column to read v from (its result is unused)
    char* sbase = state.data + col * state.nb[1] + h * state.nb[2] + slot * state.nb[3];

    float st[NC][4];
    gdn_load_state<NC, VEC>(st, sbase, has_col, lig, s_k, state.nb[0]);

    const i64 so = sp.outer, row0 = (so * h_k + kh) * n_t;  // gdn_prep row of token 0
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
        nx.v = load_f32(v.data + offset_of(v, vcol, h, t, so), vdt);
        nx.g = load_f32(g.data + offset_of(g, 0, h, t, so), gdt);
        nx.b = load_f32(beta.data + offset_of(beta, 0, h, t, so), bdt);
        nx.kq = kqbuf[row0 + t];
    };
    load_tok(sp.begin);
    for (i64 t = sp.begin; t < sp.end; t++) {
        const GdnTok<NC> cu = nx;
        if (t + 1 < sp.end) load_tok(t + 1);
        const float o = gdn_step<NC>(st, cu.k, cu.q, cu.v, expf(cu.g), cu.b, cu.kq);
        if (lig == 0 && has_col) *(float*)(out.data + offset_of(out, col, h, t, so)) = o;
    }

    if (has_col) gdn_store_state<NC, VEC>(st, sbase, lig, s_k, state.nb[0]);
}

// Grid (ceil(S_v / COLS), H_v, n_seq), block 128 threads.
#define GDN_KERNEL(name, NC, VEC)                                                                         \
    extern "C" __global__ void __launch_bounds__(GDN_WARPS * 32)                                          \
        name(Tensor out, Tensor v, int vdt, Tensor g, int gdt, Tensor beta, int bdt, Tensor state,        \
             Tensor slots, int h_k, int grouped, const float* kbuf, const float* qbuf, const float* kq,   \
             Tensor offsets, i64 len_min, i64 len_max, u64 err) {                                         \
        grid_begin();                                                                                     \
        gdn_body<NC, VEC>(out, v, vdt, g, gdt, beta, bdt, state, slots, h_k, grouped, kbuf, qbuf, kq,      \
                          offsets, len_min, len_max, err);                                                \
    }

GDN_KERNEL(gdn_n1, 1, false)
GDN_KERNEL(gdn_n2, 2, false)
GDN_KERNEL(gdn_n4, 4, false)
GDN_KERNEL(gdn_n8, 8, false)
GDN_KERNEL(gdn_n4_vec, 4, true)

// ---- gated_delta_net_fused at decode: the preparation inside the recurrence ----
//
// `gdn_decode_fused`: gated_delta_net_fused in one launch where every sequence is short (a decode
// step: dense single tokens, or a ragged batch of as many tokens as sequences: the host's choice),
// S_k = 128 and a 16-byte aligned state. The recurrence is gdn_n4_vec's, and so is the grid but
// for z: a block takes sequences blockIdx.z, + gridDim.z, .. (the host bounds the grid by the
// blocks the device holds at once), so that its checks below run once for all of them; what
// gdn_input_prep and gdn_prep write to scratch for it is computed per token by each group from
// qk, alpha, dt_bias, a and beta: its key head's q and k (lane chunks as gdn_body holds them)
// scaled by 1 / max(||x||, eps) (l2_norm's rule, the f64 sum where the f32 one leaves the normal
// range), q times the op's scale, k . q over the scaled values, g = softplus(alpha + dt_bias) a
// and sigmoid(beta), by the same device code as gdn_input_prep. Each block checks all the offsets
// and slots itself (the same checks and reports as gdn_check) and writes nothing unless they pass;
// the blocks also zero the outputs of padding tokens, as gdn_prep does. Saves two launches and
// the prep buffers' round trip a decode step.

// Sum of x over a group's 8 lanes, in f64 (the l2 norm's fallback).
__device__ __forceinline__ double group_sum_f64_8(double x) {
#pragma unroll
    for (int o = GDN_GROUP / 2; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// 1 / max(||x||, eps) of the group's NC chunks a lane (norm.cuh's `l2_scale`, the f64 sum over
// the chunks in registers).
template <int NC>
__device__ __forceinline__ float gdn_l2_scale(const float4 (&x)[NC], float ss, float eps) {
    return l2_scale(ss, eps, [&] {
        double acc = 0.0;
#pragma unroll
        for (int r = 0; r < NC; r++) {
            acc += (double)x[r].x * x[r].x + (double)x[r].y * x[r].y;
            acc += (double)x[r].z * x[r].z + (double)x[r].w * x[r].w;
        }
        return group_sum_f64_8(acc);
    });
}

__device__ __forceinline__ float4 gdn_mul4(float4 x, float s) { return make_float4(x.x * s, x.y * s, x.z * s, x.w * s); }

template <int NC>
__device__ __forceinline__ void gdn_decode_fused_body(Tensor out, Tensor qk, Tensor v, Tensor alpha, Tensor dt_bias,
                                                      Tensor a, Tensor beta, Tensor state, Tensor slots, int h_k,
                                                      int grouped, float eps, float scale, Tensor offsets, u64 err,
                                                      u32 op) {
    if (((volatile ErrorRecord*)err)->code != 0u) return;
    const i64 s_v = v.ne[0], h_v = v.ne[1], n_t = v.ne[2], n_slots = state.ne[3], n_seq = slots.ne[0];
    const i64 h = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int lig = lane & (GDN_GROUP - 1);
    const i64 col = (i64)blockIdx.x * GDN_COLS + warp * (32 / GDN_GROUP) + lane / GDN_GROUP;
    const bool has_col = col < s_v;
    const i64 vcol = has_col ? col : 0;
    // sequence s's state of this block's columns (its slot clamped into range: reading it is
    // harmless before the checks)
    auto state_at = [&](i64 s) {
        const i64 slot = *(const int*)(slots.data + s * slots.nb[0]);
        const i64 slot_in = slot < 0 ? 0 : (slot >= n_slots ? n_slots - 1 : slot);
        return state.data + col * state.nb[1] + h * state.nb[2] + slot_in * state.nb[3];
    };
    // The first sequence's state is read before the checks, so that its latency and theirs
    // overlap; nothing is written before they pass.
    i64 s = blockIdx.z;
    char* sbase = state_at(s);
    float st[NC][4];
    gdn_load_state<NC, true>(st, sbase, has_col, lig, 128, 4);
    // (block-uniform: every thread takes part in the checks' barriers)
    bool ok;
    if (offsets.data == nullptr) {
        ok = check_state_slots(slots, n_slots, err, op);
    } else {
        ok = check_seq_offsets(offsets, n_t, err, op);
        if (ok) ok = check_ragged_state_slots(slots, offsets, n_slots, err, op);
    }
    if (!ok) return;
    if (offsets.data != nullptr) {
        const i64 block = ((i64)blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
        gdn_zero_padding(out, offsets, n_t, block * blockDim.x + threadIdx.x, (i64)gridDim.x * gridDim.y * gridDim.z * blockDim.x);
    }
    const i64 kh = grouped ? h / (h_v / h_k) : h % h_k;

    GdnTok<NC> nx;
    auto load_tok = [&](i64 t, i64 so) {
        const char* qr = qk.data + kh * qk.nb[1] + t * qk.nb[2] + so * qk.nb[3];
        const char* kr = qr + h_k * qk.nb[1];
        float4 qv[NC], kv[NC];
#pragma unroll
        for (int r = 0; r < NC; r++) {
            const int i0 = (r * GDN_GROUP + lig) * 4;
            qv[r] = *(const float4*)(qr + 4 * i0);
            kv[r] = *(const float4*)(kr + 4 * i0);
        }
        nx.v = *(const float*)(v.data + offset_of(v, vcol, h, t, so));
        const float x = *(const float*)(alpha.data + offset_of(alpha, h, t, so, 0));
        const float d = *(const float*)(dt_bias.data + offset_of(dt_bias, h % dt_bias.ne[0], t % dt_bias.ne[1],
                                                                 so % dt_bias.ne[2], 0));
        const float sa = *(const float*)(a.data + offset_of(a, h % a.ne[0], t % a.ne[1], so % a.ne[2], 0));
        nx.g = __fmul_rn(unary_f(4, __fadd_rn(x, d)), sa);
        nx.b = unary_f(3, *(const float*)(beta.data + offset_of(beta, h, t, so, 0)));
        float ssq = 0.0f, ssk = 0.0f;
#pragma unroll
        for (int r = 0; r < NC; r++) {
            ssq += qv[r].x * qv[r].x + qv[r].y * qv[r].y + qv[r].z * qv[r].z + qv[r].w * qv[r].w;
            ssk += kv[r].x * kv[r].x + kv[r].y * kv[r].y + kv[r].z * kv[r].z + kv[r].w * kv[r].w;
        }
        group_sum2(ssq, ssk);
        const float iq = gdn_l2_scale<NC>(qv, ssq, eps), ik = gdn_l2_scale<NC>(kv, ssk, eps);
        float kq = 0.0f, unused = 0.0f;
#pragma unroll
        for (int r = 0; r < NC; r++) {
            nx.q[r] = gdn_mul4(gdn_mul4(qv[r], iq), scale);
            nx.k[r] = gdn_mul4(kv[r], ik);
            kq = fmaf(nx.k[r].x, nx.q[r].x, kq);
            kq = fmaf(nx.k[r].y, nx.q[r].y, kq);
            kq = fmaf(nx.k[r].z, nx.q[r].z, kq);
            kq = fmaf(nx.k[r].w, nx.q[r].w, kq);
        }
        group_sum2(kq, unused);
        nx.kq = kq;
    };
    // The block's sequences blockIdx.z, + gridDim.z, ..: the checks above once for all of them.
    // (No next-token prefetch as in gdn_body: a decode sequence has one token, and the second
    // token set's registers made ptxas spill.)
    for (;;) {
        const GdnSpan sp = gdn_span(offsets, s, n_t);
        // (a sequence without tokens keeps its slot unchecked and untouched)
        if (sp.end > sp.begin) {
            for (i64 t = sp.begin; t < sp.end; t++) {
                load_tok(t, sp.outer);
                const float o = gdn_step<NC>(st, nx.k, nx.q, nx.v, expf(nx.g), nx.b, nx.kq);
                if (lig == 0 && has_col) *(float*)(out.data + offset_of(out, col, h, t, sp.outer)) = o;
            }
            if (has_col) gdn_store_state<NC, true>(st, sbase, lig, 128, 4);
        }
        s += gridDim.z;
        if (s >= n_seq) break;
        sbase = state_at(s);
        gdn_load_state<NC, true>(st, sbase, has_col, lig, 128, 4);
    }
}

// Grid (ceil(S_v / COLS), H_v, at most n_seq: the host's choice), block 128 threads (GDN_WARPS *
// 32).
extern "C" __global__ void __launch_bounds__(GDN_WARPS * 32, 4)
    gdn_decode_fused(Tensor out, Tensor qk, Tensor v, Tensor alpha, Tensor dt_bias, Tensor a, Tensor beta,
                     Tensor state, Tensor slots, int h_k, int grouped, float eps, float scale, Tensor offsets,
                     u64 err, u32 op) {
    grid_begin();
    gdn_decode_fused_body<4>(out, qk, v, alpha, dt_bias, a, beta, state, slots, h_k, grouped, eps, scale, offsets,
                             err, op);
}

// Prefill: as gdn_body (grid z: the sequences, or ragged the bound on the work list's long ones),
// but the block stages TT = 64 / NC tokens at a time in shared memory,
// double buffered: k and q rows and k . q by cp.async from gdn_prep's buffers, v, g and beta
// through registers, the next tile's loads in flight while the current tile is computed. Needs
// 16-byte aligned prep buffers. Buffer layout (floats): k [TT][KS], q [TT][KS], v [TT][COLS],
// exp(g) [TT], beta [TT], k . q [TT]; dynamic shared memory 2 * 4 * (2 TT KS + TT COLS + 3 TT).
template <int NC, bool VEC>
__device__ __forceinline__ void gdn_tiled_body(Tensor out, Tensor v, int vdt, Tensor g, int gdt, Tensor beta,
                                               int bdt, Tensor state, Tensor slots, int h_k, int grouped,
                                               const float* kbuf, const float* qbuf, const float* kqbuf,
                                               Tensor offsets, const int* table, i64 len_min, i64 len_max,
                                               u64 err) {
    const int KS = 32 * NC, TT = 64 / NC, VM = TT * GDN_COLS / (GDN_WARPS * 32);
    const int BUF = 2 * TT * KS + TT * GDN_COLS + 3 * TT;
    extern __shared__ __align__(16) float sh[];
    if (((volatile ErrorRecord*)err)->code != 0u) return;
    const i64 s_k = state.ne[0], n_t = v.ne[2], s_v = v.ne[0], h_v = v.ne[1];
    const i64 h = blockIdx.y, col0 = (i64)blockIdx.x * GDN_COLS;
    // Block z is sequence z, or (ragged, with a work list) the z-th long sequence.
    if (table != nullptr && blockIdx.z >= table[0]) return;
    const i64 s = table != nullptr ? table[1 + blockIdx.z] : blockIdx.z;
    const i64 slot = *(const int*)(slots.data + s * slots.nb[0]);
    const GdnSpan sp = gdn_span(offsets, s, n_t);
    if (!gdn_runs(sp.end - sp.begin, len_min, len_max)) return;
    const i64 kh = grouped ? h / (h_v / h_k) : h % h_k;
    if (slot < 0 || slot >= state.ne[3]) return;  // unreachable after gdn_check_slots

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int lig = lane & (GDN_GROUP - 1), myc = warp * (32 / GDN_GROUP) + lane / GDN_GROUP;
    const i64 col = col0 + myc;
    const bool has_col = col < s_v;
    char* sbase = state.data + col * state.nb[1] + h * state.nb[2] + slot * state.nb[3];
    float st[NC][4];
    gdn_load_state<NC, VEC>(st, sbase, has_col, lig, s_k, state.nb[0]);

    const i64 so = sp.outer, row0 = (so * h_k + kh) * n_t;  // gdn_prep row of token 0
    float rv[VM], rg = 0.0f, rb = 0.0f;
    auto issue = [&](i64 t0, float* buf) {
        const int tn = (int)min((i64)TT, sp.end - t0);
        const float* ksrc = kbuf + (row0 + t0) * KS;
        const float* qsrc = qbuf + (row0 + t0) * KS;
        for (int c = tid; c < tn * KS / 4; c += blockDim.x) {
            tc_cp16(buf + c * 4, ksrc + c * 4, true);
            tc_cp16(buf + TT * KS + c * 4, qsrc + c * 4, true);
        }
        if (tid < tn) tc_cp4(buf + 2 * TT * KS + TT * GDN_COLS + 2 * TT + tid, kqbuf + row0 + t0 + tid, true);
        tc_commit();
#pragma unroll
        for (int m = 0; m < VM; m++) {
            const int idx = tid + m * GDN_WARPS * 32, tt = idx / GDN_COLS, c = idx % GDN_COLS;
            rv[m] = tt < tn && col0 + c < s_v ? load_f32(v.data + offset_of(v, col0 + c, h, t0 + tt, so), vdt) : 0.0f;
        }
        if (tid < tn) {
            rg = load_f32(g.data + offset_of(g, 0, h, t0 + tid, so), gdt);
            rb = load_f32(beta.data + offset_of(beta, 0, h, t0 + tid, so), bdt);
        }
    };

    issue(sp.begin, sh);
    for (i64 t0 = sp.begin, i = 0; t0 < sp.end; t0 += TT, i++) {
        float* cur = sh + (i & 1) * BUF;
        float *vs = cur + 2 * TT * KS, *gs = vs + TT * GDN_COLS, *bs = gs + TT, *kqs = bs + TT;
        const int tn = (int)min((i64)TT, sp.end - t0);
#pragma unroll
        for (int m = 0; m < VM; m++) vs[tid + m * GDN_WARPS * 32] = rv[m];
        if (tid < tn) gs[tid] = expf(rg), bs[tid] = rb;
        tc_wait<0>();
        __syncthreads();
        if (t0 + TT < sp.end) issue(t0 + TT, sh + ((i + 1) & 1) * BUF);
        for (int tt = 0; tt < tn; tt++) {
            float4 k[NC], q[NC];
#pragma unroll
            for (int r = 0; r < NC; r++) {
                const int i0 = (r * GDN_GROUP + lig) * 4;
                k[r] = *(const float4*)(cur + tt * KS + i0);
                q[r] = *(const float4*)(cur + TT * KS + tt * KS + i0);
            }
            const float o = gdn_step<NC>(st, k, q, vs[tt * GDN_COLS + myc], gs[tt], bs[tt], kqs[tt]);
            if (lig == 0 && has_col) *(float*)(out.data + offset_of(out, col, h, t0 + tt, so)) = o;
        }
        __syncthreads();  // this buffer is refilled two tiles on
    }
    if (has_col) gdn_store_state<NC, VEC>(st, sbase, lig, s_k, state.nb[0]);
}

extern "C" __global__ void __launch_bounds__(GDN_WARPS * 32)
    gdn_tiled_n4_vec(Tensor out, Tensor v, int vdt, Tensor g, int gdt, Tensor beta, int bdt, Tensor state,
                     Tensor slots, int h_k, int grouped, const float* kbuf, const float* qbuf, const float* kq,
                     Tensor offsets, const int* table, i64 len_min, i64 len_max, u64 err) {
    grid_begin();
    gdn_tiled_body<4, true>(out, v, vdt, g, gdt, beta, bdt, state, slots, h_k, grouped, kbuf, qbuf, kq, offsets,
                            table, len_min, len_max, err);
}

// ---- gated_delta_net_fused: the input preparation ----
//
// gdn_input_prep writes, in one launch, what the unfused graph's three preparation kernels write:
// qn = l2_norm(qk) (f32 [S_k, 2 H_k, n_t, n_seq], contiguous), and per (value head, token)
// g = softplus(alpha + dt_bias) * a and b = sigmoid(beta) (f32 [H_v, n_t, n_seq], contiguous);
// the delta rule's kernels then read q and k as the two halves of qn. Each value is computed by
// the same device code as the unfused kernels: blocks with blockIdx.y == 0 run norm.cuh's l2 rows
// (`norm_rows_sub<L, 4>` for dense 16-byte aligned f32 rows of at most 16 L floats, as l2_norm's
// host picks `norm_vec_sub8/16`; otherwise `norm_rows<true>`, its warp kernel); blocks with
// blockIdx.y == 1 run the scalars over a grid-stride loop, the decay as the generated elementwise
// program writes it (`__fadd_rn`, `unary_f` softplus, `__fmul_rn`) and beta through `unary_f`'s
// sigmoid. 256 threads a block (norm_rows_sub's rows per block assume it). `norm_kind`: 8, 16
// (the sub-row paths) or 0 (the warp path).
extern "C" __global__ void gdn_input_prep(Tensor qn, Tensor qk, int norm_kind, float eps, Tensor g, Tensor alpha,
                                          Tensor dt_bias, Tensor a, Tensor b, Tensor beta) {
    grid_begin();
    if (blockIdx.y == 0) {
        if (norm_kind == 8) {
            norm_rows_sub<8, 4>(qn, qk, eps, NORM_L2);
        } else if (norm_kind == 16) {
            norm_rows_sub<16, 4>(qn, qk, eps, NORM_L2);
        } else {
            norm_rows<true>(qn, qk, DT_F32, eps, NORM_L2);
        }
        return;
    }
    const i64 n0 = alpha.ne[0], n1 = alpha.ne[1], n2 = alpha.ne[2];
    const i64 n = n0 * n1 * n2 * alpha.ne[3];
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const i64 i0 = i % n0, i1 = (i / n0) % n1, i2 = (i / (n0 * n1)) % n2, i3 = i / (n0 * n1 * n2);
        const float x = *(const float*)(alpha.data + offset_of(alpha, i0, i1, i2, i3));
        const float d = *(const float*)(dt_bias.data + offset_of(dt_bias, i0 % dt_bias.ne[0], i1 % dt_bias.ne[1],
                                                                 i2 % dt_bias.ne[2], i3 % dt_bias.ne[3]));
        const float s = *(const float*)(a.data + offset_of(a, i0 % a.ne[0], i1 % a.ne[1], i2 % a.ne[2], i3 % a.ne[3]));
        ((float*)g.data)[i] = __fmul_rn(unary_f(4, __fadd_rn(x, d)), s);
        ((float*)b.data)[i] = unary_f(3, *(const float*)(beta.data + offset_of(beta, i0, i1, i2, i3)));
    }
}
