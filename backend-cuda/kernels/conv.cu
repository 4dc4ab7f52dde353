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
// written.
extern "C" __global__ void conv_check_slots(Tensor slots, i64 n_slots, u64 err, u32 op) { check_state_slots(slots, n_slots, err, op); }

// Sample j of channel c's window for sequence s: the slot's state for j < keep, then x.
__device__ __forceinline__ float window_at(const Tensor& x, int xdt, const char* st, i64 st_nb0, i64 keep, i64 c,
                                           i64 s, i64 j) {
    return j < keep ? *(const float*)(st + j * st_nb0) : load_f32(x.data + offset_of(x, c, j - keep, s, 0), xdt);
}

// ssm_conv_update_inplace outputs: out[c, t, s] = sum_i w[t + i, c] kernel[i, c] (SiLU if `silu`),
// the window being the slot's state then x. One thread per (channel, UPD_T tokens); channels
// across threads. For d_conv <= UPD_MAXD the thread's window and taps sit in registers (all loads
// in flight at once, the outputs stored last). Reads the state only: `conv_update_state` writes it
// afterwards.
#define UPD_T 8
#define UPD_MAXD 8
extern "C" __global__ void conv_update_out(Tensor out, Tensor x, int xdt, Tensor state, Tensor kern, int kdt,
                                           Tensor slots, int silu, u64 err) {
    if (((volatile ErrorRecord*)err)->code != 0u) return;
    const i64 channels = out.ne[0], n_t = out.ne[1], d_conv = kern.ne[0], keep = d_conv - 1;
    const i64 c = blockIdx.x * (i64)blockDim.x + threadIdx.x, t0 = (i64)blockIdx.y * UPD_T, s = blockIdx.z;
    if (c >= channels) return;
    const i64 slot = *(const int*)(slots.data + s * slots.nb[0]);
    if (slot < 0 || slot >= state.ne[2]) return;  // unreachable after conv_check_slots
    const char* st = state.data + c * state.nb[1] + slot * state.nb[2];
    const i64 tcount = min((i64)UPD_T, n_t - t0);
    if (d_conv <= UPD_MAXD) {
        float kr[UPD_MAXD], wr[UPD_T + UPD_MAXD - 1], o[UPD_T];
#pragma unroll
        for (int i = 0; i < UPD_MAXD; i++)
            kr[i] = i < d_conv ? load_f32(kern.data + offset_of(kern, i, c, 0, 0), kdt) : 0.0f;
#pragma unroll
        for (int j = 0; j < UPD_T + UPD_MAXD - 1; j++)
            wr[j] = j < tcount + keep ? window_at(x, xdt, st, state.nb[0], keep, c, s, t0 + j) : 0.0f;
#pragma unroll
        for (int t = 0; t < UPD_T; t++) {
            float acc = 0.0f;
#pragma unroll
            for (int i = 0; i < UPD_MAXD; i++)
                if (i < d_conv) acc = fmaf(wr[t + i], kr[i], acc);
            o[t] = silu ? acc / (1.0f + expf(-acc)) : acc;
        }
#pragma unroll
        for (int t = 0; t < UPD_T; t++)
            if (t < tcount) *(float*)(out.data + offset_of(out, c, t0 + t, s, 0)) = o[t];
        return;
    }
    for (i64 t = t0; t < t0 + tcount; t++) {
        float acc = 0.0f;
        for (i64 i = 0; i < d_conv; i++)
            acc = fmaf(window_at(x, xdt, st, state.nb[0], keep, c, s, t + i),
                       load_f32(kern.data + offset_of(kern, i, c, 0, 0), kdt), acc);
        if (silu) acc = acc / (1.0f + expf(-acc));
        *(float*)(out.data + offset_of(out, c, t, s, 0)) = acc;
    }
}

// ssm_conv_update_inplace state: the slot keeps the last keep samples of its window. One thread
// per (channel, sequence); ascending j reads sample n_t + j (> j) before it is overwritten.
extern "C" __global__ void conv_update_state(Tensor x, int xdt, Tensor state, Tensor slots, i64 d_conv, u64 err) {
    if (((volatile ErrorRecord*)err)->code != 0u) return;
    const i64 channels = x.ne[0], n_t = x.ne[1], keep = d_conv - 1;
    const i64 c = blockIdx.x * (i64)blockDim.x + threadIdx.x, s = blockIdx.y;
    if (c >= channels) return;
    const i64 slot = *(const int*)(slots.data + s * slots.nb[0]);
    if (slot < 0 || slot >= state.ne[2]) return;
    char* st = state.data + c * state.nb[1] + slot * state.nb[2];
    for (i64 j = 0; j < keep; j++) {
        const float v = window_at(x, xdt, st, state.nb[0], keep, c, s, n_t + j);
        *(float*)(st + j * state.nb[0]) = v;
    }
}
