// sample.cu: one token id per row of f32 logits, from per-row settings (temperature, top_k, top_p,
// u), computing exactly the integers of `tessera_ops::sample` (the CPU's rule, docs/OPS.md):
// masses q = trunc(exp((l - max) / t) * 2^40) through the same f32 exp, sums in u64, ranks
// (larger logit, then lower index) as u64, so the pick is the CPU's bit for bit.
//
// Five launches, no host sync (backend-cuda/src/ops/sample.rs launches them):
//  1. sample_stats  (chunks, rows): per chunk of SMP_CHUNK logits its max, first argmax and count
//     of non-NaN; block (0, 0) checks every row's settings (the first bad one is the error).
//  2. sample_hist   (chunks, rows): per chunk a histogram of SMP_BINS bins of x = (l - max) / t
//     (bin floor(-2x), the last one catches x <= -31.5): counts and masses. Bins are monotone in
//     l, so "bins 0..=b" is always a prefix of the rank order.
//  3. sample_plan   (rows): merges a row's partials. Greedy rows get their argmax. Rows that keep
//     every token draw here: the chunk where the running mass passes floor(u W), then the token
//     within it. Rows with top-k / top-p whose threshold lies within the first SMP_CAP tokens of
//     the rank order (by the bin counts) are left to steps 4-5; the rest select the exact
//     threshold rank here with a radix select over the row (one block, 8 passes) and draw.
//  4. sample_gather (chunks, rows): the small rows' candidates (bins 0..=hi) into a list.
//  5. sample_small  (rows): sorts a small row's candidates by rank, cuts top-k and top-p, sorts
//     the kept ones by index and draws. Block 0 also reports a row whose logits are all NaN.
//
// Scratch (host-computed offsets): first_nan, per-chunk stats, bin counts and masses, per-row
// plans, candidate counts and lists. Invalid settings or NaN rows never lead out of bounds: such
// rows write 0 and are reported through the error record.

// TAG(sample-limits): the host's CHUNK, BINS, CAP constants in src/ops/sample.rs.
#define SMP_CHUNK 2048
#define SMP_THREADS 256
#define SMP_BINS 64
#define SMP_CAP 2048
#define SMP_BIG_THREADS 1024
#define SMP_MASS_ONE (1ull << 40)
#define SMP_ERR_BAD_VALUE 4u
// TAG(sample-fields): tessera_ops::sample::SampleField::code.
#define SMP_WHAT_TEMPERATURE 16u
#define SMP_WHAT_TOP_K 17u
#define SMP_WHAT_TOP_P 18u
#define SMP_WHAT_U 19u
#define SMP_WHAT_LOGITS 20u

#define SMP_MODE_DONE 0
#define SMP_MODE_SMALL 1

#define SMP_FULL 0xffffffffu

// ---- the exact arithmetic of tessera_ops::sample ----

// TAG(sample-exp): the constants of ops/src/sample.rs by their bits.
__device__ __forceinline__ u64 smp_exp_mass(float x) {
    if (!(x >= -32.0f)) return 0;
    const float n = floorf(__fadd_rn(__fmul_rn(x, __int_as_float(0x3fb8aa3b)), 0.5f));
    if (n < -40.0f) return 0;
    float r = __fmaf_rn(-n, __int_as_float(0x3f317200), x);
    r = __fmaf_rn(-n, __int_as_float(0x35bfbe8e), r);
    float p = __int_as_float(0x39500d01);
    p = __fmaf_rn(p, r, __int_as_float(0x3ab60b61));
    p = __fmaf_rn(p, r, __int_as_float(0x3c088889));
    p = __fmaf_rn(p, r, __int_as_float(0x3d2aaaab));
    p = __fmaf_rn(p, r, __int_as_float(0x3e2aaaab));
    p = __fmaf_rn(p, r, 0.5f);
    p = __fmaf_rn(p, r, 1.0f);
    p = __fmaf_rn(p, r, 1.0f);
    const float scale = __int_as_float(((int)n + 40 + 127) << 23);
    return __float2ull_rz(__fmul_rn(p, scale));
}

// (l - max) / t with IEEE single operations (no contraction), as the CPU computes it.
__device__ __forceinline__ float smp_x(float l, float mx, float t) { return __fdiv_rn(__fsub_rn(l, mx), t); }

// The mass of a logit that is not NaN.
__device__ __forceinline__ u64 smp_mass(float l, float mx, float t) {
    return l == mx ? SMP_MASS_ONE : smp_exp_mass(smp_x(l, mx, t));
}

// The bin of a logit that is not NaN: floor(-2x) capped at SMP_BINS - 1 (monotone in l).
__device__ __forceinline__ int smp_bin(float l, float mx, float t) {
    if (l == mx) return 0;
    const float y = __fmul_rn(-smp_x(l, mx, t), 2.0f);
    return y < (float)(SMP_BINS - 1) ? (int)y : SMP_BINS - 1;
}

__device__ __forceinline__ u64 smp_rank(float l, i64 i) {
    const u32 b = __float_as_uint(__fadd_rn(l, 0.0f));
    const u32 key = b ^ ((u32)((int)b >> 31) | 0x80000000u);
    return ((u64)(~key) << 32) | (u64)i;
}

// v = m 2^-e for v in [0, 1].
__device__ __forceinline__ void smp_split(float v, u64& m, u32& e) {
    const u32 bits = __float_as_uint(v), ex = bits >> 23, frac = bits & 0x7fffffu;
    if (ex == 0) {
        m = frac;
        e = 149;
    } else {
        m = frac | (1u << 23);
        e = 150 - ex;
    }
}

// floor(w v) and ceil(w v) exactly (128-bit product).
__device__ __forceinline__ u64 smp_mul_floor(u64 w, float v) {
    u64 m;
    u32 e;
    smp_split(v, m, e);
    const u64 lo = w * m, hi = __umul64hi(w, m);
    if (e >= 128) return 0;
    if (e >= 64) return hi >> (e - 64);
    if (e == 0) return lo;
    return (lo >> e) | (hi << (64 - e));
}
__device__ __forceinline__ u64 smp_mul_ceil(u64 w, float v) {
    u64 m;
    u32 e;
    smp_split(v, m, e);
    const u64 lo = w * m, hi = __umul64hi(w, m);
    const u64 fl = smp_mul_floor(w, v);
    bool exact;
    if (e >= 128) exact = (lo | hi) == 0;
    else if (e >= 64) exact = lo == 0 && (e == 64 || (hi & ((1ull << (e - 64)) - 1)) == 0);
    else exact = e == 0 || (lo & ((1ull << e) - 1)) == 0;
    return fl + (exact ? 0 : 1);
}

__device__ __forceinline__ bool smp_finite(float v) { return (__float_as_uint(v) & 0x7f800000u) != 0x7f800000u; }

// One row's settings, checked as SampleSettings::from_row does (same order of checks).
struct SmpSettings {
    float t, p, u, bad;
    u32 k, field;  // field: 0 when valid, else the SMP_WHAT_* of the first bad value
};

__device__ __forceinline__ SmpSettings smp_settings(const Tensor& s, i64 r) {
    const char* row = s.data + r * s.nb[1];
    SmpSettings o;
    o.t = *(const float*)row;
    const float k = *(const float*)(row + s.nb[0]);
    o.p = *(const float*)(row + 2 * s.nb[0]);
    o.u = *(const float*)(row + 3 * s.nb[0]);
    o.k = 0;
    o.field = 0;
    o.bad = 0.0f;
    if (!(smp_finite(o.t) && o.t >= 0.0f)) {
        o.field = SMP_WHAT_TEMPERATURE;
        o.bad = o.t;
    } else if (!(k >= 0.0f && k <= 16777216.0f && k == floorf(k))) {
        o.field = SMP_WHAT_TOP_K;
        o.bad = k;
    } else if (!(o.p > 0.0f && o.p <= 1.0f)) {
        o.field = SMP_WHAT_TOP_P;
        o.bad = o.p;
    } else if (!(o.u >= 0.0f && o.u < 1.0f)) {
        o.field = SMP_WHAT_U;
        o.bad = o.u;
    } else {
        o.k = (u32)k;
    }
    return o;
}

__device__ __forceinline__ bool smp_greedy(const SmpSettings& s) { return s.t == 0.0f || s.k == 1; }

// Per-chunk statistics: the max (meaningless when valid == 0), its first index, the count of
// non-NaN logits.
struct SmpStat {
    float max;
    int arg;
    int valid;
    int pad;
};

// A row's plan for steps 4-5 (mode SMALL) or nothing more to do (DONE).
struct SmpPlan {
    u64 w_all;   // the mass of every non-NaN logit
    float max;
    int mode;
    int hi;      // gather bins 0..=hi
    int k_eff;   // tokens kept by top-k (the count of non-NaN logits when top-k keeps all)
    int topk;    // top-k cuts (k_eff < valid)
    int pad;
};

__device__ __forceinline__ SmpStat smp_stat_merge(SmpStat a, SmpStat b) {
    if (b.valid == 0) return a;
    if (a.valid == 0) return b;
    SmpStat o;
    o.valid = a.valid + b.valid;
    o.pad = 0;
    if (b.max > a.max || (b.max == a.max && b.arg < a.arg)) {
        o.max = b.max;
        o.arg = b.arg;
    } else {
        o.max = a.max;
        o.arg = a.arg;
    }
    return o;
}

__device__ __forceinline__ SmpStat smp_warp_stat(SmpStat v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        SmpStat w;
        w.max = __shfl_xor_sync(SMP_FULL, v.max, o);
        w.arg = __shfl_xor_sync(SMP_FULL, v.arg, o);
        w.valid = __shfl_xor_sync(SMP_FULL, v.valid, o);
        w.pad = 0;
        v = smp_stat_merge(v, w);
    }
    return v;
}

// Block-wide merge (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ SmpStat smp_block_stat(SmpStat v) {
    __shared__ SmpStat sh[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = smp_warp_stat(v);
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    SmpStat none;
    none.max = 0.0f;
    none.arg = 0;
    none.valid = 0;
    none.pad = 0;
    v = lane < nwarps ? sh[lane] : none;
    v = smp_warp_stat(v);
    __syncthreads();
    return v;
}

// The merged statistics of row r (every thread of the block gets them).
__device__ SmpStat smp_row_stat(const SmpStat* stats, i64 r, i64 chunks) {
    SmpStat v;
    v.max = 0.0f;
    v.arg = 0;
    v.valid = 0;
    v.pad = 0;
    for (i64 c = threadIdx.x; c < chunks; c += blockDim.x) v = smp_stat_merge(v, stats[r * chunks + c]);
    return smp_block_stat(v);
}

// Exclusive prefix sum of one u64 per thread over the block, and the block total.
__device__ u64 smp_block_scan(u64 v, u64& total) {
    __shared__ u64 sh[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    u64 x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u64 y = __shfl_up_sync(SMP_FULL, x, o);
        if (lane >= o) x += y;
    }
    __syncthreads();
    if (lane == 31) sh[warp] = x;
    __syncthreads();
    if (warp == 0) {
        u64 w = lane < nwarps ? sh[lane] : 0;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const u64 y = __shfl_up_sync(SMP_FULL, w, o);
            if (lane >= o) w += y;
        }
        if (lane < nwarps) sh[lane] = w;  // inclusive sums of the warps
    }
    __syncthreads();
    const u64 before = warp == 0 ? 0 : sh[warp - 1];
    total = sh[nwarps - 1];
    __syncthreads();
    return before + x - v;
}

// A thread's run of consecutive additions to one bucket of a shared histogram (count, mass and
// smallest index), flushed with atomics when the bucket changes: rows whose values crowd into one
// bucket (flat logits, the top bytes of close keys) then cost one atomic per thread, not one per
// element (64-bit shared atomics are compare-and-swap loops, slow under contention).
struct SmpRun {
    int b;
    u32 c;
    u32 id;
    u64 m;
};

__device__ __forceinline__ SmpRun smp_run() {
    SmpRun r;
    r.b = -1;
    r.c = 0;
    r.id = 0xffffffffu;
    r.m = 0;
    return r;
}

__device__ __forceinline__ void smp_run_flush(SmpRun& r, u32* cnt, u64* mass, u32* min_id) {
    if (r.c != 0) {
        atomicAdd(&cnt[r.b], r.c);
        atomicAdd((unsigned long long*)&mass[r.b], (unsigned long long)r.m);
        if (min_id) atomicMin(&min_id[r.b], r.id);
    }
    r.c = 0;
    r.m = 0;
    r.id = 0xffffffffu;
}

__device__ __forceinline__ void smp_run_add(SmpRun& r, u32* cnt, u64* mass, u32* min_id, int b, u64 q, u32 id) {
    if (b != r.b) {
        smp_run_flush(r, cnt, mass, min_id);
        r.b = b;
    }
    r.c++;
    r.m += q;
    r.id = min(r.id, id);
}

// The bin of a logit that is not NaN from its x (at_max: l == max): floor(-2x) capped at
// SMP_BINS - 1, the same as smp_bin.
__device__ __forceinline__ int smp_bin_x(bool at_max, float x) {
    if (at_max) return 0;
    const float y = __fmul_rn(-x, 2.0f);
    return y < (float)(SMP_BINS - 1) ? (int)y : SMP_BINS - 1;
}

// What a valid, non-greedy row keeps: top-k cuts when k_eff < valid; top-p when p < 1.
__device__ __forceinline__ i64 smp_k_eff(const SmpSettings& s, i64 valid) {
    return (s.k == 0 || (i64)s.k >= valid) ? valid : (i64)s.k;
}

__device__ __forceinline__ const float* smp_row(const Tensor& logits, i64 r) {
    return (const float*)(logits.data + r * logits.nb[1]);
}

__device__ __forceinline__ void smp_write(const Tensor& dst, i64 r, i64 id) { *(int*)(dst.data + r * dst.nb[1]) = (int)id; }

// ---- 1. per-chunk statistics; settings check ----

extern "C" __global__ void __launch_bounds__(SMP_THREADS) sample_stats(Tensor logits, Tensor settings, SmpStat* stats, u32* ccount, int* first_nan, u64 err,
                                        u32 op) {
    grid_begin();
    const i64 r = blockIdx.y, c = blockIdx.x, chunks = gridDim.x, n = logits.ne[0];
    if (c == 0 && threadIdx.x == 0) {
        ccount[r] = 0;
        if (r == 0) {
            *first_nan = 0x7fffffff;
            for (i64 q = 0; q < logits.ne[1]; q++) {
                const SmpSettings s = smp_settings(settings, q);
                if (s.field != 0) {
                    report_error((ErrorRecord*)err, SMP_ERR_BAD_VALUE, s.field, op, q, 0, (i64)__float_as_uint(s.bad), 0);
                    break;
                }
            }
        }
    }
    const float* x = smp_row(logits, r);
    SmpStat v;
    v.max = 0.0f;
    v.arg = 0;
    v.valid = 0;
    v.pad = 0;
    const i64 lo = c * SMP_CHUNK, hi = min(n, lo + SMP_CHUNK);
    for (i64 i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        const float l = x[i];
        if (l == l) {
            if (v.valid == 0 || l > v.max) {
                v.max = l;
                v.arg = (int)i;
            }
            v.valid++;
        }
    }
    v = smp_block_stat(v);
    if (threadIdx.x == 0) stats[r * chunks + c] = v;
}

// ---- 2. per-chunk bin histograms (rows with top-k / top-p) or masses (rows keeping all) ----

extern "C" __global__ void __launch_bounds__(SMP_THREADS) sample_hist(Tensor logits, Tensor settings, const SmpStat* stats,
                                                                      u32* hcount, u64* hmass, u64* ctotal) {
    grid_begin();
    __shared__ u32 cnt[SMP_THREADS / 32][SMP_BINS];
    __shared__ u64 mass[SMP_THREADS / 32][SMP_BINS];
    const i64 r = blockIdx.y, c = blockIdx.x, chunks = gridDim.x, n = logits.ne[0];
    const SmpSettings s = smp_settings(settings, r);
    const SmpStat st = smp_row_stat(stats, r, chunks);
    if (s.field != 0 || st.valid == 0 || smp_greedy(s)) return;
    const float* x = smp_row(logits, r);
    const i64 lo = c * SMP_CHUNK, hi = min(n, lo + SMP_CHUNK);
    if (smp_k_eff(s, st.valid) == st.valid && !(s.p < 1.0f)) {
        // Every token kept: only the chunk's mass is needed.
        u64 mine = 0;
        for (i64 i = lo + threadIdx.x; i < hi; i += blockDim.x) {
            const float l = x[i];
            if (l == l) mine += smp_mass(l, st.max, s.t);
        }
        u64 total;
        smp_block_scan(mine, total);
        if (threadIdx.x == 0) ctotal[r * chunks + c] = total;
        return;
    }
    const int warp = threadIdx.x >> 5;
    for (int b = threadIdx.x; b < (SMP_THREADS / 32) * SMP_BINS; b += blockDim.x) {
        cnt[b / SMP_BINS][b % SMP_BINS] = 0;
        mass[b / SMP_BINS][b % SMP_BINS] = 0;
    }
    __syncthreads();
    SmpRun run = smp_run();
    for (i64 i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        const float l = x[i];
        if (l == l) {
            const bool at_max = l == st.max;
            const float xx = at_max ? 0.0f : smp_x(l, st.max, s.t);
            const u64 q = at_max ? SMP_MASS_ONE : smp_exp_mass(xx);
            smp_run_add(run, cnt[warp], mass[warp], nullptr, smp_bin_x(at_max, xx), q, 0);
        }
    }
    smp_run_flush(run, cnt[warp], mass[warp], nullptr);
    __syncthreads();
    for (int b = threadIdx.x; b < SMP_BINS; b += blockDim.x) {
        u32 tc = 0;
        u64 tm = 0;
        for (int w = 0; w < SMP_THREADS / 32; w++) {
            tc += cnt[w][b];
            tm += mass[w][b];
        }
        hcount[(r * chunks + c) * SMP_BINS + b] = tc;
        hmass[(r * chunks + c) * SMP_BINS + b] = tm;
    }
}

// ---- 3. plans, greedy rows, rows that keep every token, large selections ----

// Finds, from element `from` on in index order, the first kept element at which base + the
// running kept mass exceeds `target` (kept: not NaN and, with has_cut, rank <= cut). Call with
// the whole block; returns the index to every thread, or -1 when the row ends first (never, for
// a target below the kept mass).
__device__ i64 smp_draw_from(const float* x, i64 n, float mx, float t, i64 from, u64 base, u64 target, bool has_cut, u64 cut) {
    __shared__ long long found;
    const int ITEMS = 4;
    if (threadIdx.x == 0) found = -1;
    __syncthreads();
    for (i64 tile = from; tile < n; tile += (i64)blockDim.x * ITEMS) {
        const i64 i0 = tile + (i64)threadIdx.x * ITEMS;
        u64 q[ITEMS];
        u64 mine = 0;
#pragma unroll
        for (int j = 0; j < ITEMS; j++) {
            const i64 i = i0 + j;
            q[j] = 0;
            if (i < n) {
                const float l = x[i];
                if (l == l && (!has_cut || smp_rank(l, i) <= cut)) q[j] = smp_mass(l, mx, t);
            }
            mine += q[j];
        }
        u64 total;
        const u64 before = base + smp_block_scan(mine, total);
        if (before <= target && target < before + mine) {
            u64 acc = before;
#pragma unroll
            for (int j = 0; j < ITEMS; j++) {
                acc += q[j];
                if (acc > target && found < 0) found = i0 + j;
            }
        }
        __syncthreads();
        if (found >= 0) break;
        base += total;
    }
    const i64 out = found;
    __syncthreads();
    return out;
}

// The first rank, among the non-NaN logits of bin `bin` with rank <= bound, at which the running
// count (by_mass false) or mass (true) in rank order, starting from below_cnt0 / below_mass0 (the
// count and mass of the bins before `bin`), reaches `target`: a radix select on the 64-bit rank,
// 8 bits a pass (bits 24..31 are an index's and always 0: no pass). It stops early when the
// chosen bucket holds one element, or, once the key is fixed, when the first of its equal-logit
// ties (equal masses) reaches the target: that element is the smallest index of the bucket.
// Also gives the mass of the ranks below it and of the element itself. Call with the whole block.
__device__ u64 smp_select(const float* x, i64 n, float mx, float t, int bin, u64 bound, u64 target, bool by_mass,
                          u64 below_cnt0, u64 below_mass0, u64& below, u64& own) {
    __shared__ u32 cnt[256];
    __shared__ u64 mass[256];
    __shared__ u32 min_id[256];
    __shared__ u64 sh_prefix, sh_below, sh_below_cnt, sh_own;
    __shared__ int sh_done;
    if (threadIdx.x == 0) {
        sh_prefix = 0;
        sh_below = below_mass0;
        sh_below_cnt = below_cnt0;
        sh_own = 0;
        sh_done = 0;
    }
    u64 mask = 0;
    for (int pass = 0; pass < 7; pass++) {
        const int shift = pass < 4 ? 56 - 8 * pass : 16 - 8 * (pass - 4);
        for (int b = threadIdx.x; b < 256; b += blockDim.x) {
            cnt[b] = 0;
            mass[b] = 0;
            min_id[b] = 0xffffffffu;
        }
        __syncthreads();
        if (sh_done) break;
        const u64 prefix = sh_prefix;
        SmpRun run = smp_run();
        for (i64 i = threadIdx.x; i < n; i += blockDim.x) {
            const float l = x[i];
            if (!(l == l)) continue;
            const bool at_max = l == mx;
            const float xx = at_max ? 0.0f : smp_x(l, mx, t);
            if (smp_bin_x(at_max, xx) != bin) continue;
            const u64 rk = smp_rank(l, i);
            if (rk > bound || (rk & mask) != prefix) continue;
            const u64 q = at_max ? SMP_MASS_ONE : smp_exp_mass(xx);
            smp_run_add(run, cnt, mass, min_id, (int)((rk >> shift) & 255), q, (u32)i);
        }
        smp_run_flush(run, cnt, mass, min_id);
        __syncthreads();
        if (threadIdx.x == 0) {
            u64 bc = sh_below_cnt, bm = sh_below;
            int d = 255;
            for (int b = 0; b < 256; b++) {
                const bool reach = by_mass ? bm + mass[b] >= target : bc + cnt[b] >= target;
                if (reach && cnt[b] > 0) {
                    d = b;
                    break;
                }
                bc += cnt[b];
                bm += mass[b];
            }
            sh_below_cnt = bc;
            sh_below = bm;
            u64 pre = prefix | ((u64)d << shift);
            u64 ow = mass[d];
            int done = 0;
            if (cnt[d] == 1) {
                done = 1;
            } else if (shift == 32 && cnt[d] > 1) {
                // The key is fixed: the bucket's elements are ties of equal mass.
                const u64 qt = mass[d] / cnt[d];
                const u64 m = by_mass ? (qt == 0 ? 2 : (target - bm + qt - 1) / qt) : target - bc;
                if (m <= 1) {
                    done = 1;
                    ow = qt;
                }
            }
            if (done && min_id[d] < (u32)n) pre = smp_rank(x[min_id[d]], min_id[d]);
            sh_prefix = pre;
            sh_own = ow;
            sh_done = done;
        }
        mask |= 255ull << shift;
        __syncthreads();
    }
    below = sh_below;
    own = sh_own;
    const u64 out = sh_prefix;
    __syncthreads();
    return out;
}

extern "C" __global__ void __launch_bounds__(SMP_BIG_THREADS)
    sample_plan(Tensor dst, Tensor logits, Tensor settings, const SmpStat* stats, const u32* hcount, const u64* hmass,
                const u64* ctotal, SmpPlan* plans, int* first_nan, i64 chunks) {
    grid_begin();
    __shared__ u32 red_cnt[16][SMP_BINS];
    __shared__ u64 red_mass[16][SMP_BINS];
    __shared__ u64 cumc[SMP_BINS];
    __shared__ u64 cumm[SMP_BINS];
    __shared__ int sh_mode, sh_hi;
    __shared__ long long sh_chunk;
    __shared__ u64 sh_base;
    const i64 r = blockIdx.x, n = logits.ne[0];
    const SmpSettings s = smp_settings(settings, r);
    const SmpStat st = smp_row_stat(stats, r, chunks);
    SmpPlan* plan = &plans[r];
    if (s.field != 0 || st.valid == 0 || smp_greedy(s)) {
        if (threadIdx.x == 0) {
            plan->mode = SMP_MODE_DONE;
            if (s.field == 0 && st.valid == 0) atomicMin(first_nan, (int)r);
            smp_write(dst, r, s.field == 0 && st.valid > 0 ? st.arg : 0);
        }
        return;
    }
    const float* x = smp_row(logits, r);
    const i64 valid = st.valid, k_eff = smp_k_eff(s, valid);
    const bool topk = k_eff < valid, topp = s.p < 1.0f;
    if (!topk && !topp) {
        // Keep every token: the row's mass, then the chunk where the running mass passes the
        // target, then the token within it.
        if (threadIdx.x == 0) {
            plan->mode = SMP_MODE_DONE;
            sh_chunk = -1;
        }
        u64 w = 0, total;
        for (i64 c0 = 0; c0 < chunks; c0 += blockDim.x) {
            const i64 c = c0 + threadIdx.x;
            smp_block_scan(c < chunks ? ctotal[r * chunks + c] : 0, total);
            w += total;
        }
        const u64 target = smp_mul_floor(w, s.u);
        u64 base = 0;
        for (i64 c0 = 0; c0 < chunks; c0 += blockDim.x) {
            const i64 c = c0 + threadIdx.x;
            const u64 m = c < chunks ? ctotal[r * chunks + c] : 0;
            const u64 before = base + smp_block_scan(m, total);
            if (before <= target && target < before + m) {
                sh_chunk = c;
                sh_base = before;
            }
            __syncthreads();
            if (sh_chunk >= 0) break;
            base += total;
        }
        const i64 c = sh_chunk;
        const i64 id = c < 0 ? -1 : smp_draw_from(x, n, st.max, s.t, c * SMP_CHUNK, sh_base, target, false, 0);
        if (threadIdx.x == 0) smp_write(dst, r, id < 0 ? st.arg : id);
        return;
    }
    // Merge the chunks' bins: thread t sums bin t % 64 over chunks t / 64, t / 64 + 16, ...
    {
        const int b = threadIdx.x & (SMP_BINS - 1), slice = threadIdx.x / SMP_BINS;
        if (slice < 16) {
            u32 cn = 0;
            u64 ma = 0;
            for (i64 c = slice; c < chunks; c += 16) {
                cn += hcount[(r * chunks + c) * SMP_BINS + b];
                ma += hmass[(r * chunks + c) * SMP_BINS + b];
            }
            red_cnt[slice][b] = cn;
            red_mass[slice][b] = ma;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            // Inclusive running counts and masses over the bins, in rank order.
            u64 cc = 0, cm = 0;
            for (int bb = 0; bb < SMP_BINS; bb++) {
                for (int k = 0; k < 16; k++) {
                    cc += red_cnt[k][bb];
                    cm += red_mass[k][bb];
                }
                cumc[bb] = cc;
                cumm[bb] = cm;
            }
        }
        __syncthreads();
    }
    const u64 w_all = cumm[SMP_BINS - 1];
    if (threadIdx.x == 0) {
        // The bin of the top-k threshold, or of the top-p one when top-k keeps all.
        const u64 need = topk ? 0 : smp_mul_ceil(w_all, s.p);
        int hi = SMP_BINS - 1;
        for (int b = 0; b < SMP_BINS; b++) {
            if (topk ? cumc[b] >= (u64)k_eff : cumm[b] >= need) {
                hi = b;
                break;
            }
        }
        sh_mode = cumc[hi] <= SMP_CAP ? SMP_MODE_SMALL : SMP_MODE_DONE;
        sh_hi = hi;
        plan->w_all = w_all;
        plan->max = st.max;
        plan->mode = sh_mode;
        plan->hi = hi;
        plan->k_eff = (int)k_eff;
        plan->topk = topk ? 1 : 0;
    }
    __syncthreads();
    if (sh_mode == SMP_MODE_SMALL) return;
    // Large selections: the exact threshold ranks by radix selects within the threshold bins,
    // then the draw over the row.
    const int hi = sh_hi;
    u64 below = 0, own = 0, cut = ~0ull, w = w_all;
    if (topk) {
        cut = smp_select(x, n, st.max, s.t, hi, ~0ull, (u64)k_eff, false, hi > 0 ? cumc[hi - 1] : 0,
                         hi > 0 ? cumm[hi - 1] : 0, below, own);
        w = below + own;  // the top-k set's mass
    }
    if (topp) {
        const u64 need = smp_mul_ceil(w, s.p);
        // The first bin whose running mass reaches it; with top-k, bins before the top-k bin are
        // wholly kept by top-k, and the top-k bin itself is bounded by the top-k rank.
        int bp = topk ? hi : SMP_BINS - 1;
        for (int b = 0; b < bp; b++) {
            if (cumm[b] >= need) {
                bp = b;
                break;
            }
        }
        cut = smp_select(x, n, st.max, s.t, bp, cut, need, true, bp > 0 ? cumc[bp - 1] : 0, bp > 0 ? cumm[bp - 1] : 0,
                         below, own);
        w = below + own;
    }
    const i64 id = smp_draw_from(x, n, st.max, s.t, 0, 0, smp_mul_floor(w, s.u), true, cut);
    if (threadIdx.x == 0) smp_write(dst, r, id < 0 ? st.arg : id);
}

// ---- 4. candidates of the small rows ----

extern "C" __global__ void __launch_bounds__(SMP_THREADS) sample_gather(Tensor logits, Tensor settings, const SmpPlan* plans, u32* ccount, u32* cand) {
    grid_begin();
    const i64 r = blockIdx.y, c = blockIdx.x, n = logits.ne[0];
    const SmpPlan plan = plans[r];
    if (plan.mode != SMP_MODE_SMALL) return;
    const SmpSettings s = smp_settings(settings, r);
    const float* x = smp_row(logits, r);
    const int lane = threadIdx.x & 31;
    const i64 lo = c * SMP_CHUNK, hi = min(n, lo + SMP_CHUNK);
    for (i64 base = lo; base < hi; base += blockDim.x) {
        const i64 i = base + threadIdx.x;
        const float l = i < hi ? x[i] : TS_NAN;
        const bool on = l == l && smp_bin(l, plan.max, s.t) <= plan.hi;
        const unsigned act = __ballot_sync(SMP_FULL, on);
        if (act == 0) continue;
        const int leader = __ffs(act) - 1;
        u32 slot = 0;
        if (lane == leader) slot = atomicAdd(&ccount[r], (u32)__popc(act));
        slot = __shfl_sync(SMP_FULL, slot, leader) + __popc(act & ((1u << lane) - 1));
        if (on && slot < SMP_CAP) cand[r * SMP_CAP + slot] = (u32)i;
    }
}

// ---- 5. small rows: sort, cut, draw ----

// Ascending bitonic sort of keys[0..p) (p a power of two <= SMP_CAP) by the whole block.
__device__ void smp_sort(u64* keys, int p) {
    for (int k = 2; k <= p; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = threadIdx.x; i < p; i += blockDim.x) {
                const int ixj = i ^ j;
                if (ixj > i) {
                    const u64 a = keys[i], b = keys[ixj];
                    if ((a > b) == ((i & k) == 0)) {
                        keys[i] = b;
                        keys[ixj] = a;
                    }
                }
            }
            __syncthreads();
        }
    }
}

// Inclusive prefix sums of vals[0..m) in place (m <= SMP_CAP, SMP_CAP / blockDim.x per thread).
__device__ void smp_scan_in_place(u64* vals, int m) {
    const int per = SMP_CAP / SMP_BIG_THREADS, j0 = threadIdx.x * per;
    u64 mine = 0;
    for (int j = j0; j < j0 + per; j++)
        if (j < m) mine += vals[j];
    u64 total;
    u64 acc = smp_block_scan(mine, total);
    for (int j = j0; j < j0 + per; j++)
        if (j < m) {
            acc += vals[j];
            vals[j] = acc;
        }
    __syncthreads();
}

extern "C" __global__ void __launch_bounds__(SMP_BIG_THREADS) sample_small(Tensor dst, Tensor logits, Tensor settings, const SmpPlan* plans, const u32* ccount,
                                        const u32* cand, const int* first_nan, u64 err, u32 op) {
    grid_begin();
    __shared__ u64 keys[SMP_CAP];
    __shared__ u64 cum[SMP_CAP];
    __shared__ int sh_len;
    __shared__ long long sh_pick;
    const i64 r = blockIdx.x;
    if (r == 0 && threadIdx.x == 0 && *first_nan != 0x7fffffff)
        report_error((ErrorRecord*)err, SMP_ERR_BAD_VALUE, SMP_WHAT_LOGITS, op, *first_nan, 0, (i64)__float_as_uint(TS_NAN), 0);
    const SmpPlan plan = plans[r];
    if (plan.mode != SMP_MODE_SMALL) return;
    const SmpSettings s = smp_settings(settings, r);
    const float* x = smp_row(logits, r);
    const int m = (int)min(ccount[r], (u32)SMP_CAP);
    int p = 1;
    while (p < m) p <<= 1;
    // Rank order: the id is the rank's low half.
    for (int j = threadIdx.x; j < p; j += blockDim.x) {
        if (j < m) {
            const u32 id = cand[r * SMP_CAP + j];
            keys[j] = smp_rank(x[id], id);
        } else {
            keys[j] = ~0ull;
        }
    }
    __syncthreads();
    smp_sort(keys, p);
    for (int j = threadIdx.x; j < m; j += blockDim.x) cum[j] = smp_mass(x[(u32)keys[j]], plan.max, s.t);
    __syncthreads();
    smp_scan_in_place(cum, m);
    const int len_k = plan.topk ? min(plan.k_eff, m) : m;
    const u64 w_k = plan.topk ? cum[len_k - 1] : plan.w_all;
    if (threadIdx.x == 0) sh_len = len_k;
    __syncthreads();
    if (s.p < 1.0f) {
        const u64 need = smp_mul_ceil(w_k, s.p);
        for (int j = threadIdx.x; j < len_k; j += blockDim.x)
            if (cum[j] >= need && (j == 0 || cum[j - 1] < need)) sh_len = j + 1;
        __syncthreads();
    }
    const int len = sh_len;
    const u64 target = smp_mul_floor(cum[len - 1], s.u);
    __syncthreads();
    // The kept tokens in index order.
    for (int j = threadIdx.x; j < p; j += blockDim.x) keys[j] = j < len ? (keys[j] & 0xffffffffull) : ~0ull;
    __syncthreads();
    smp_sort(keys, p);
    for (int j = threadIdx.x; j < len; j += blockDim.x) cum[j] = smp_mass(x[(u32)keys[j]], plan.max, s.t);
    __syncthreads();
    smp_scan_in_place(cum, len);
    if (threadIdx.x == 0) sh_pick = -1;
    __syncthreads();
    for (int j = threadIdx.x; j < len; j += blockDim.x)
        if (cum[j] > target && (j == 0 || cum[j - 1] <= target)) sh_pick = (long long)(keys[j] & 0xffffffffull);
    __syncthreads();
    if (threadIdx.x == 0) smp_write(dst, r, sh_pick < 0 ? (i64)(keys[len - 1] & 0xffffffffull) : sh_pick);
}
