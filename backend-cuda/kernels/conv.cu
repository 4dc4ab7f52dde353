// conv.cu: ssm_conv and ssm_conv_update_inplace, the causal depthwise convolution (no flip:
// kernel[0] multiplies the oldest sample of the window).

// ssm_conv tile: 32 channels x CONV_TT outputs per block of 256 threads (8 warps).
#define CONV_CH 32
#define CONV_TT 64
#define CONV_WARPS 8

// ssm_conv: out[c, t, s] = sum_{i < d_conv} sx[t + i, c, s] * kernel[i, c].
// Grid (ceil(C / 32), ceil(n_t / 64), n_seq), block 256, dynamic shared memory
// 4 (32 W + 32 d_conv) bytes with W = (64 + d_conv - 1) | 1 (odd rows: no bank conflicts); needs
// 64 + d_conv - 1 <= 96. The window tile is read with time across lanes when `time_fastest`
// (sx's time stride is the smaller one), else with channels across lanes, so either layout reads
// coalesced; each thread's 12 loads are issued before any is stored.
extern "C" __global__ void __launch_bounds__(256)
    ssm_conv_tiled(Tensor out, Tensor sx, int sdt, Tensor kern, int kdt, int time_fastest) {
    grid_begin();
    extern __shared__ float sh[];
    const i64 d_conv = kern.ne[0], channels = out.ne[0], n_t = out.ne[1];
    const i64 c0 = (i64)blockIdx.x * CONV_CH, t0 = (i64)blockIdx.y * CONV_TT, s = blockIdx.z;
    const int wlen = CONV_TT + (int)d_conv - 1, w = wlen | 1;
    float* xs = sh;                // [CONV_CH][w]
    float* ks = sh + CONV_CH * w;  // [d_conv][CONV_CH]
    const int avail = (int)min((i64)wlen, n_t - t0 + d_conv - 1);  // window samples inside sx
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const char* base = sx.data + t0 * sx.nb[0] + c0 * sx.nb[1] + s * sx.nb[2];
    float r[4][3];
    // time_fastest: warp w takes channels w, w + 8, w + 16, w + 24 and lanes take samples
    // lane, lane + 32, lane + 64; otherwise lanes take channels and warps take the samples.
#pragma unroll
    for (int a = 0; a < 4; a++) {
#pragma unroll
        for (int b = 0; b < 3; b++) {
            const int c = time_fastest ? warp + a * CONV_WARPS : lane;
            const int j = time_fastest ? lane + b * 32 : warp + (a * 3 + b) * CONV_WARPS;
            r[a][b] = c0 + c < channels && j < avail ? load_f32(base + j * sx.nb[0] + c * sx.nb[1], sdt) : 0.0f;
        }
    }
#pragma unroll
    for (int a = 0; a < 4; a++) {
#pragma unroll
        for (int b = 0; b < 3; b++) {
            const int c = time_fastest ? warp + a * CONV_WARPS : lane;
            const int j = time_fastest ? lane + b * 32 : warp + (a * 3 + b) * CONV_WARPS;
            if (j < wlen) xs[c * w + j] = r[a][b];
        }
    }
    for (int idx = threadIdx.x; idx < CONV_CH * d_conv; idx += blockDim.x) {
        const int c = idx % CONV_CH, i = idx / CONV_CH;
        ks[idx] = c0 + c < channels ? load_f32(kern.data + offset_of(kern, i, c0 + c, 0, 0), kdt) : 0.0f;
    }
    __syncthreads();
    const int c = lane;
    if (c0 + c >= channels) return;
    char* obase = out.data + (c0 + c) * out.nb[0] + t0 * out.nb[1] + s * out.nb[2];
#pragma unroll
    for (int m = 0; m < CONV_TT / CONV_WARPS; m++) {
        const int tt = warp + m * CONV_WARPS;
        if (t0 + tt < n_t) {
            float acc = 0.0f;
            for (int i = 0; i < d_conv; i++) acc = fmaf(xs[c * w + tt + i], ks[i * CONV_CH + c], acc);
            *(float*)(obase + tt * out.nb[1]) = acc;
        }
    }
}

// ssm_conv for kernels too long for the tile: one thread per output.
extern "C" __global__ void ssm_conv_direct(Tensor out, Tensor sx, int sdt, Tensor kern, int kdt) {
    grid_begin();
    const i64 n = nelements(out);
    for (i64 idx = blockIdx.x * (i64)blockDim.x + threadIdx.x; idx < n; idx += (i64)gridDim.x * blockDim.x) {
        i64 c, t, s, u;
        unravel(out, idx, c, t, s, u);
        float acc = 0.0f;
        for (i64 i = 0; i < kern.ne[0]; i++)
            acc = fmaf(load_f32(sx.data + offset_of(sx, t + i, c, s, 0), sdt),
                       load_f32(kern.data + offset_of(kern, i, c, 0, 0), kdt), acc);
        *(float*)(out.data + offset_of(out, c, t, s, 0)) = acc;
    }
}

// The state-slot check of `check_state_slots` (common.cuh), run as one block before any state is
// written; for a ragged batch (`offsets.data` not null) its seq_offsets first, then the slots of
// the sequences with tokens.
// The slot (and ragged offsets) check of ssm_conv_update_inplace, run by block (0, 0) of
// conv_update_out before its own work (a launch of its own cost a decode step more than the check):
// the outputs only read the state, through in-range slots, and conv_update_state, which writes it,
// runs after and does nothing once an error is recorded; `conv_update_seq` runs it in every block
// and writes nothing unless it passed (the result, to every thread). Call with one whole block.
__device__ bool conv_check_slots(const Tensor& slots, const Tensor& offsets, i64 n_tokens, i64 n_slots, u64 err, u32 op) {
    if (offsets.data == nullptr) return check_state_slots(slots, n_slots, err, op);
    return check_seq_offsets(offsets, n_tokens, err, op) && check_ragged_state_slots(slots, offsets, n_slots, err, op);
}

// ssm_conv_update_inplace sees its tokens packed: token u of x [C, n_t, n_outer] is (u mod n_t,
// u / n_t), n_outer = n_seq dense and 1 ragged. Dense (`offsets.data` null) sequence s owns tokens
// s n_t .. (s + 1) n_t; ragged ones seq_offsets[s] .. seq_offsets[s + 1], the rest padding.
__device__ __forceinline__ float conv_x(const Tensor& x, int xdt, i64 c, i64 t, i64 o) {
    return load_f32(x.data + c * x.nb[0] + t * x.nb[1] + o * x.nb[2], xdt);
}

// ssm_conv_update_inplace outputs: out[c, u] = sum_i w_s[u - begin_s + i, c] kernel[i, c] (SiLU
// if `silu`) for packed token u of sequence s, w_s being its slot's state then its tokens; 0 for
// padding. A block covers 256 channels of UPD_T consecutive tokens: UPD_T threads first find the
// tokens' sequences (ragged: a binary search of the offsets) and slots for the whole block. A
// block whose tokens and their windows lie inside one sequence (a prefill's, all but its first
// block) then runs `conv_update_interior`: a thread loads its channel's taps and whole window into
// registers (every load in flight at once), then computes and stores its UPD_T outputs, with no
// per-tap checks. Other blocks run `conv_update_window` on UPD_SUB tokens at a time (positions
// stepped without divisions, the outputs stored last): a tap before its sequence's first token
// reads the slot's state instead. Longer kernels (d_conv > UPD_MAXD) take a plain loop over the
// taps. Reads the state only: `conv_update_state` writes it afterwards.
#define UPD_T 32
#define UPD_SUB 8
#define UPD_MAXD 8

// One output from its window w[0 .. TAPS) (oldest first) and the taps: the same fmaf order on
// every path, so the same bits.
template <int TAPS>
__device__ __forceinline__ float conv_out(const float* w, const float* kr, i64 d_conv, int silu) {
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < TAPS; i++) {
        if (i < d_conv) acc = fmaf(w[i], kr[i], acc);
    }
    return silu ? acc / (1.0f + expf(-acc)) : acc;
}

// conv_update_out's block inside one sequence, D taps of f32 x: (pt, po) is the (t, outer) of
// the window's first sample, packed token u0 - (D - 1); the block's UPD_T tokens and the window
// share po (a sequence never crosses an outer index).
template <int D>
__device__ __forceinline__ void conv_update_interior(const Tensor& out, const Tensor& x, const Tensor& kern, int kdt,
                                                     int silu, i64 c, i64 pt, i64 po) {
    float kr[D], xw[UPD_T + D - 1];
#pragma unroll
    for (int i = 0; i < D; i++) kr[i] = load_f32(kern.data + offset_of(kern, i, c, 0, 0), kdt);
    const char* px = x.data + c * x.nb[0] + pt * x.nb[1] + po * x.nb[2];
#pragma unroll
    for (int j = 0; j < UPD_T + D - 1; j++) xw[j] = *(const float*)(px + j * x.nb[1]);
    char* pout = out.data + c * out.nb[0] + (pt + D - 1) * out.nb[1] + po * out.nb[2];
#pragma unroll
    for (int t = 0; t < UPD_T; t++) *(float*)(pout + t * out.nb[1]) = conv_out<D>(xw + t, kr, D, silu);
}

// The register-window part of conv_update_out for one thread's channel and UPD_SUB tokens from
// packed token u0 (tcount of them valid; tbegin / tslot theirs; (pt, po) the (t, outer) of token
// u0 - keep): D taps (D = 0: any d_conv <= UPD_MAXD, read as UPD_MAXD with zero taps past
// d_conv), f32 x read directly when X32. The common shape (4 taps, f32 activations) compiles
// without the generic loads' dtype switch and with windows of its own size, so it holds fewer
// registers.
template <int D, bool X32>
__device__ __forceinline__ void conv_update_window(const Tensor& out, const Tensor& x, int xdt, const Tensor& state,
                                                   const Tensor& kern, int kdt, int silu, i64 c, i64 u0, i64 tcount,
                                                   const long long* tbegin, const int* tslot, i64 pt, i64 po) {
    constexpr int TAPS = D > 0 ? D : UPD_MAXD;
    const i64 n_t = out.ne[1], d_conv = D > 0 ? D : kern.ne[0], keep = d_conv - 1;
    const char* st = state.data + c * state.nb[1];
    float kr[TAPS], xw[UPD_SUB + TAPS - 1], o[UPD_SUB];
#pragma unroll
    for (int i = 0; i < TAPS; i++) kr[i] = i < d_conv ? load_f32(kern.data + offset_of(kern, i, c, 0, 0), kdt) : 0.0f;
    // xw[j] = x at packed token u0 - keep + j (where it exists), its (t, outer) stepped along.
    const i64 pt0 = pt, po0 = po;
#pragma unroll
    for (int j = 0; j < UPD_SUB + TAPS - 1; j++) {
        const char* px = x.data + c * x.nb[0] + pt * x.nb[1] + po * x.nb[2];
        xw[j] = j < tcount + keep && pt >= 0 ? (X32 ? *(const float*)px : load_f32(px, xdt)) : 0.0f;
        if (++pt == n_t) pt = 0, po++;
    }
#pragma unroll
    for (int t = 0; t < UPD_SUB; t++) {
        const i64 u = u0 + t, begin = tbegin[t];
        float acc = 0.0f;
        if (t < tcount && begin >= 0) {
            const i64 slot = tslot[t];
            const bool slot_ok = slot >= 0 && slot < state.ne[2];  // unless the check fails
            float w[TAPS];
#pragma unroll
            for (int i = 0; i < TAPS; i++) {
                const i64 p = u - keep + i;
                w[i] = xw[t + i];
                if (p < begin) w[i] = slot_ok ? *(const float*)(st + slot * state.nb[2] + (p - begin + keep) * state.nb[0]) : 0.0f;
            }
            acc = conv_out<TAPS>(w, kr, d_conv, silu);
        }
        o[t] = acc;
    }
    i64 ot = pt0 + keep, oo = po0;  // (t, outer) of u0
    while (ot >= n_t) ot -= n_t, oo++;
#pragma unroll
    for (int t = 0; t < UPD_SUB; t++) {
        if (t < tcount) *(float*)(out.data + c * out.nb[0] + ot * out.nb[1] + oo * out.nb[2]) = o[t];
        if (++ot == n_t) ot = 0, oo++;
    }
}

extern "C" __global__ void __launch_bounds__(256) conv_update_out(Tensor out, Tensor x, int xdt, Tensor state,
                                                                  Tensor kern, int kdt, Tensor slots, Tensor offsets,
                                                                  int silu, u64 err, u32 op) {
    grid_begin();
    const i64 n_all = out.ne[1] * out.ne[2];
    if (blockIdx.x == 0 && blockIdx.y == 0) {
        conv_check_slots(slots, offsets, n_all, state.ne[2], err, op);
        __syncthreads();  // thread 0 may just have recorded an error: the whole block sees it below
    }
    __shared__ long long tbegin[UPD_T];  // first token of each token's sequence, -1 for none
    __shared__ int tslot[UPD_T];
    __shared__ long long wpos[2];  // (t, outer) of packed token u0 - keep (t < 0 before the start)
    __shared__ int interior;       // the block's tokens and windows inside one sequence
    if (((volatile ErrorRecord*)err)->code != 0u) return;
    const i64 channels = out.ne[0], n_t = out.ne[1], n_seq = slots.ne[0];
    const i64 d_conv = kern.ne[0], keep = d_conv - 1;
    const i64 u0 = (i64)blockIdx.y * UPD_T, tcount = min((i64)UPD_T, n_all - u0);
    if (threadIdx.x < UPD_T) {
        const i64 u = u0 + threadIdx.x;
        i64 seq = -1, begin = -1;
        if (u < n_all) {
            if (offsets.data == nullptr) {
                seq = u / n_t, begin = seq * n_t;
            } else {
                seq = seq_of_token(offsets, n_seq, u, n_all);
                if (seq >= 0) begin = seq_offset(offsets, seq, n_all);
            }
        }
        tbegin[threadIdx.x] = begin;
        tslot[threadIdx.x] = seq >= 0 ? *(const int*)(slots.data + seq * slots.nb[0]) : -1;
    } else if (threadIdx.x == UPD_T) {
        const i64 p0 = u0 - keep, o = p0 >= 0 ? p0 / n_t : 0;
        wpos[0] = p0 - o * n_t, wpos[1] = o;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        const i64 begin = tbegin[0];
        interior = tcount == UPD_T && begin >= 0 && begin == tbegin[UPD_T - 1] && u0 - keep >= begin;
    }
    __syncthreads();
    const i64 c = blockIdx.x * (i64)blockDim.x + threadIdx.x;
    if (c >= channels) return;
    if (d_conv == 4 && xdt == DT_F32 && interior) {
        conv_update_interior<4>(out, x, kern, kdt, silu, c, wpos[0], wpos[1]);
        return;
    }
    if (d_conv <= UPD_MAXD) {
        // UPD_SUB tokens a pass, the window's position stepped along
        i64 pt = wpos[0], po = wpos[1];
        for (int g = 0; g < UPD_T && g < tcount; g += UPD_SUB) {
            const i64 count = min((i64)UPD_SUB, tcount - g);
            if (d_conv == 4 && xdt == DT_F32) {
                conv_update_window<4, true>(out, x, xdt, state, kern, kdt, silu, c, u0 + g, count, tbegin + g, tslot + g, pt, po);
            } else {
                conv_update_window<0, false>(out, x, xdt, state, kern, kdt, silu, c, u0 + g, count, tbegin + g, tslot + g, pt, po);
            }
            pt += UPD_SUB;
            while (pt >= n_t) pt -= n_t, po++;
        }
        return;
    }
    const char* st = state.data + c * state.nb[1];
    for (i64 t = 0; t < tcount; t++) {
        const i64 u = u0 + t, begin = tbegin[t], slot = tslot[t];
        float acc = 0.0f;
        if (begin >= 0 && slot >= 0 && slot < state.ne[2]) {
            for (i64 i = 0; i < d_conv; i++) {
                const i64 p = u - keep + i;
                const float w = p >= begin ? conv_x(x, xdt, c, p % n_t, p / n_t)
                                           : *(const float*)(st + slot * state.nb[2] + (p - begin + keep) * state.nb[0]);
                acc = fmaf(w, load_f32(kern.data + offset_of(kern, i, c, 0, 0), kdt), acc);
            }
            if (silu) acc = acc / (1.0f + expf(-acc));
        }
        *(float*)(out.data + c * out.nb[0] + (u % n_t) * out.nb[1] + (u / n_t) * out.nb[2]) = acc;
    }
}

// ssm_conv_update_inplace state: each sequence with L > 0 tokens keeps the last keep samples of
// its window (sample L + j: the old sample while L + j < keep, else its token L + j - keep). One
// thread per (channel, sequence); ascending j reads sample L + j (> j) before it is overwritten.
// A sequence without tokens touches nothing (its slot value is not used).
extern "C" __global__ void conv_update_state(Tensor x, int xdt, Tensor state, Tensor slots, Tensor offsets, i64 d_conv,
                                             u64 err) {
    grid_begin();
    if (((volatile ErrorRecord*)err)->code != 0u) return;
    const i64 channels = x.ne[0], n_t = x.ne[1], n_all = n_t * x.ne[2], keep = d_conv - 1;
    const i64 c = blockIdx.x * (i64)blockDim.x + threadIdx.x, s = blockIdx.y;
    if (c >= channels) return;
    // Dense: tokens 0 .. n_t of outer index s; ragged: tokens begin .. end of outer index 0.
    const bool dense = offsets.data == nullptr;
    const i64 begin = dense ? 0 : seq_offset(offsets, s, n_all), outer = dense ? s : 0;
    const i64 len = (dense ? n_t : seq_offset(offsets, s + 1, n_all)) - begin;
    const i64 slot = *(const int*)(slots.data + s * slots.nb[0]);
    if (len <= 0 || slot < 0 || slot >= state.ne[2]) return;
    char* st = state.data + c * state.nb[1] + slot * state.nb[2];
    for (i64 j = 0; j < keep; j++) {
        const i64 m = len + j;
        const float v = m < keep ? *(const float*)(st + m * state.nb[0]) : conv_x(x, xdt, c, begin + m - keep, outer);
        *(float*)(st + j * state.nb[0]) = v;
    }
}

// ssm_conv_update_inplace in one launch for steps of a few tokens a sequence (decode): thread
// (c, s) runs the tokens of sequence s (grid row s < n_seq) on channel c in order, its window (the
// slot's state, then the tokens) in registers, stores each output as conv_update_out computes it
// (with its `conv_out`, so the same values), then the slot's last d_conv - 1 samples; grid row
// n_seq zeroes the ragged padding tokens. Every block checks the slots and offsets itself (one
// round of loads with `slots_distinct_fast`: cheaper than a second launch), with its taps and
// state samples already loading (through a slot clamped into range, so the loads stay in bounds
// whatever the check finds), and writes nothing unless they pass. d_conv <= UPD_MAXD.
extern "C" __global__ void __launch_bounds__(256) conv_update_seq(Tensor out, Tensor x, int xdt, Tensor state, Tensor kern,
                                                                  int kdt, Tensor slots, Tensor offsets, int silu, u64 err,
                                                                  u32 op) {
    grid_begin();
    if (((volatile ErrorRecord*)err)->code != 0u) return;
    const i64 channels = out.ne[0], n_t = out.ne[1], n_all = n_t * out.ne[2], n_seq = slots.ne[0];
    const i64 c = blockIdx.x * (i64)blockDim.x + threadIdx.x, s = blockIdx.y;
    const bool dense = offsets.data == nullptr, runs = c < channels && s < n_seq;
    const i64 d_conv = kern.ne[0], keep = d_conv - 1;
    float kr[UPD_MAXD], w[UPD_MAXD];
    char* st = nullptr;
    if (runs) {
        const i64 slot = *(const int*)(slots.data + s * slots.nb[0]);
        st = state.data + c * state.nb[1] + (slot >= 0 && slot < state.ne[2] ? slot : 0) * state.nb[2];
#pragma unroll
        for (int i = 0; i < UPD_MAXD; i++) {
            kr[i] = i < d_conv ? load_f32(kern.data + offset_of(kern, i, c, 0, 0), kdt) : 0.0f;
            w[i] = i < keep ? *(const float*)(st + i * state.nb[0]) : 0.0f;
        }
    }
    if (!conv_check_slots(slots, offsets, n_all, state.ne[2], err, op)) return;
    if (c >= channels) return;
    if (s == n_seq) {
        if (!dense) {  // before the first sequence and after the last
            const i64 first = seq_offset(offsets, 0, n_all);
            for (i64 u = 0; u < first; u++) *(float*)(out.data + c * out.nb[0] + u * out.nb[1]) = 0.0f;
            for (i64 u = seq_offset(offsets, n_seq, n_all); u < n_all; u++) *(float*)(out.data + c * out.nb[0] + u * out.nb[1]) = 0.0f;
        }
        return;
    }
    const i64 begin = dense ? 0 : seq_offset(offsets, s, n_all), outer = dense ? s : 0;
    const i64 len = (dense ? n_t : seq_offset(offsets, s + 1, n_all)) - begin;
    if (len <= 0) return;
    for (i64 t = 0; t < len; t++) {
        // w[0 .. keep) the samples before token t, w[keep] the token
        const float xv = conv_x(x, xdt, c, begin + t, outer);
        float win[UPD_MAXD];
#pragma unroll
        for (int i = 0; i < UPD_MAXD; i++) win[i] = i < keep ? w[i] : xv;
        const float acc = conv_out<UPD_MAXD>(win, kr, d_conv, silu);
        *(float*)(out.data + c * out.nb[0] + (begin + t) * out.nb[1] + outer * out.nb[2]) = acc;
#pragma unroll
        for (int i = 0; i < UPD_MAXD - 1; i++) {  // (ascending: w[i + 1] is read before it changes)
            if (i + 1 < keep) w[i] = w[i + 1];
            else if (i + 1 == keep) w[i] = xv;
        }
    }
#pragma unroll
    for (int i = 0; i < UPD_MAXD; i++) {
        if (i < keep) *(float*)(st + i * state.nb[0]) = w[i];
    }
}
