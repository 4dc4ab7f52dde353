// attention_decode.cu: flash_attn_ext's decode on tensor cores (semantics: attention.cuh).
//
// `fa_dec_*`: f16/bf16 K/V with d_k = d_v = D (128 or 256) and few query tokens. A block takes up
// to FD_R = 8 query rows (`hb` heads of one kv group times `tb` tokens: the N columns of mma.sync
// m16n8k16, so every K/V row it reads serves all of them) over one split of the kv positions.
// The products run transposed, kv positions and head dims on the M side: S^T = K Q^T (16
// positions x 8 rows, K from shared memory, Q^T from registers loaded once) and O^T += V^T P^T
// (D x 8), where a 16-row M tile of queries would have been mostly padding for a kv group of 6
// or 8 heads; the 16 x 8 P^T becomes the B operand through two `movmatrix` transposes. Each of
// the FD_W warps walks its own chunks of FD_N = 16 positions (chunk c of the split goes to warp
// c % FD_W) with its own online-softmax state: the chunk's K and V rows (through the block table
// when paged) are copied into the warp's shared-memory ring of FD_S stages with 16-byte cp.async,
// each stage refilled as soon as its chunk is computed, and the softmax runs on the S^T fragments
// in f32. A chunk's mask values are loaded into registers an iteration ahead, and the table
// entries of the chunk that refills a stage at the top of the iteration that refills it (used
// after the chunk's products), so that no global-memory latency sits on a warp's chunk-to-chunk
// path. At the end each warp leaves its state in shared memory and warp w merges the head-dim
// tiles w, w + FD_W, ...: with one split the block writes the output rows, else (max, sum,
// acc[D]) partials for `fa_combine`, or, in the cluster entries (`fa_dec_x{2,4,8}_*`, sm_90+),
// into its shared memory for the cluster's blocks (the splits of one tile) to merge. Dynamic
// shared memory: FD_W * FD_S * 2 * FD_N * (D + FT_PAD) halves. (The measurements behind the
// layout: docs/perf-log/kernels-attention.md.)
//
// Ragged: one token per tile (tb = 1; see `fa_ragged_token` for the two tilings), whose rows all
// see its first `vis` positions, so the split simply ends there: a decode batch of n sequences
// gets the grid and the work of the dense decode of n sequences of one token.

#define FD_W 4   // warps per block
#define FD_S 2   // ring stages per warp
#define FD_N 16  // kv positions per chunk
#define FD_R 8   // query rows per block

// The 8 x 8 b16 matrix whose fragments (thread t: row t / 4, columns 2 (t % 4) and + 1) the warp
// holds in `x`, transposed, in the same layout.
__device__ __forceinline__ u32 fd_transpose(u32 x) {
    u32 r;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
    return r;
}

template <int DT, int D, int C>
__device__ __forceinline__ void fa_dec_impl(Tensor q, Tensor k, Tensor v, Tensor mask, Tensor table, Tensor offsets,
                                            Tensor kv_lens, Tensor out, Tensor gate, int mdt, int has_mask, int paged,
                                            float scale, float softcap, int split_len, int hb, int tb, int h_blocks,
                                            int t_blocks, int seq_stride, float* part, u64 err, u32 opcode) {
    extern __shared__ __align__(16) u16 fd_smem[];
    __shared__ u32 s_valid[FD_W][FD_S];
    __shared__ float s_m[FD_W][FD_R];
    __shared__ float s_l[FD_W][FD_R];
    constexpr int LD = D + FT_PAD;                    // halves per K/V row in shared memory
    constexpr int STAGE = 2 * FD_N * LD;              // halves per stage (K then V)
    constexpr int WARP_HALVES = FD_S * STAGE;         // a warp's ring
    constexpr int CPR = D / 8;                        // 16-byte pieces per row
    constexpr int MT = D / 16;                        // k16 steps of S^T, m16 tiles of O^T
    static_assert(WARP_HALVES * 2 >= FD_R * D * 4, "a warp's ring holds its f32 accumulators");

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tq = lane & 3;
    const int n_tokens = (int)q.ne[1], n_head = (int)q.ne[2];
    const int n_cells = (int)k.ne[1], n_head_kv = (int)k.ne[2];
    const int n_kv = paged ? (int)table.ne[0] : n_cells;
    const int group = (u32)n_head / (u32)n_head_kv;  // (unsigned: cheaper divisions, all >= 0)
    const int n_splits = (int)gridDim.y;

    const int tile = blockIdx.x, split = blockIdx.y;
    const int tbi = (u32)tile % (u32)t_blocks, hbi = (u32)tile / (u32)t_blocks % (u32)h_blocks;
    const int hk = (u32)tile / (u32)(t_blocks * h_blocks);
    // Dense: tokens t0 .. t0 + tn of sequence s (q's slot qs = s) over all positions. Ragged
    // (tb == 1): one token of sequence s in slot 0, seeing its first `vis` positions.
    // (See `fa_ragged_local` for how a ragged block finds its token: s starts as a guess.)
    int s = blockIdx.z, qs = blockIdx.z, t0 = tbi * tb, tn = min(tb, n_tokens - t0);
    // A block of a cluster never returns early (the others read its shared memory at the end):
    // one with nothing to do is `dead`, takes no chunk and writes nothing.
    bool dead = false;
    if (offsets.data) {
        if (blockIdx.x == 0 && blockIdx.y == 0 && !fa_ragged_valid(offsets, kv_lens, n_tokens, n_kv, err, opcode)) {
            if (C == 1) return;
            dead = true;
        }
        s = fa_ragged_guess(tbi, seq_stride, (int)kv_lens.ne[0]);
        qs = 0;
        t0 = tbi;
        tn = 1;
    }
    const int h0 = hk * group + hbi * hb;
    const int hn = min(hb, group - hbi * hb);
    const int nrows = hn * tn;
    const int j_begin = split * split_len;
    int j_end = min(n_kv, j_begin + split_len);
    const char* kbase = k.data + hk * k.nb[2] + (paged ? 0 : s) * k.nb[3];
    const char* vbase = v.data + hk * v.nb[2] + (paged ? 0 : s) * v.nb[3];
    const i64 m_seq = has_mask ? (i64)((u32)qs % (u32)mask.ne[3]) * mask.nb[3] : 0;
    const float inner = softcap > 0.0f ? scale / softcap : 0.0f;

    u16* ring = fd_smem + warp * WARP_HALVES;
    const u32 ring_s = tc_smem(ring);
    const u32 knb = (u32)k.nb[1], vnb = (u32)v.nb[1];  // below 2^31 (the host's condition)
    // The tokens of this thread's two S^T columns (rows 2 tq and 2 tq + 1), for the mask.
    int tok[2] = {t0 + (2 * tq < nrows ? (u32)(2 * tq) % (u32)tn : 0), t0 + (2 * tq + 1 < nrows ? (u32)(2 * tq + 1) % (u32)tn : 0)};

    int n_chunks = (j_end - j_begin + FD_N - 1) / FD_N;
    int my_chunks = n_chunks > warp ? (n_chunks - warp + FD_W - 1) / FD_W : 0;
    // The table entry (unchecked; j itself when not paged) of lane's position in chunk `it`.
    // Loaded a chunk's products before `issue` needs it, so that its latency hides behind them.
    auto raw_of = [&](int it) -> int {
        const int j = j_begin + (warp + it * FD_W) * FD_N + lane;
        if (!paged || it >= my_chunks || lane >= FD_N || j >= j_end) return j;
        return *(const int*)(table.data + (i64)j * table.nb[0] + (i64)s * table.nb[1]);
    };
    // The mask bits (f32, f16 or bf16; converted by `mask_val` only when used) of the fragment's
    // positions in chunk `it` (g and g + 8, for the columns' tokens), loaded a chunk ahead for
    // the same reason.
    auto mask_bits = [&](int it, u32* mb) {
        const int j0 = j_begin + (warp + it * FD_W) * FD_N;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int j = j0 + g + (i >> 1) * 8;
            mb[i] = 0;
            if (has_mask && it < my_chunks && j < j_end) {
                const char* mp = mask.data + (i64)j * mask.nb[0] + (i64)tok[i & 1] * mask.nb[1] + m_seq;
                mb[i] = mdt == DT_F32 ? *(const u32*)mp : (u32)*(const u16*)mp;
            }
        }
    };
    auto mask_val = [&](u32 b) -> float {
        return mdt == DT_F32 ? __uint_as_float(b) : mdt == DT_F16 ? f16_to_f32((u16)b) : bf16_to_f32((u16)b);
    };
    // Starts the copy of this warp's chunk `it` (table entry `raw` from `raw_of`) into ring stage
    // `st`; invalid positions read as 0.
    auto issue = [&](int it, int st, int raw) {
        const int j0 = j_begin + (warp + it * FD_W) * FD_N;
        const bool mine = lane < FD_N && j0 + lane < j_end;
        const bool bad = mine && (raw < 0 || raw >= n_cells);
        const int cell = mine && !bad ? raw : -1;
        if (__any_sync(0xffffffffu, bad)) {
            const bool report = !offsets.data || fa_ragged_valid_warp(offsets, kv_lens, n_tokens, n_kv);
            if (bad && report) report_error((ErrorRecord*)err, ERR_INDEX_OUT_OF_RANGE, WHAT_KV_CELL, opcode, raw, n_cells, 0, 0);
        }
        const u32 valid = __ballot_sync(0xffffffffu, cell >= 0);
        if (lane == 0) s_valid[warp][st] = valid;
        // Lane takes piece lane % CPR of rows lane / CPR, + 32 / CPR, ...
        const u32 sK = ring_s + st * STAGE * 2 + (lane / CPR * LD + lane % CPR * 8) * 2;
        const u32 sV = sK + FD_N * LD * 2;
        const char* kp = kbase + lane % CPR * 16;
        const char* vp = vbase + lane % CPR * 16;
#pragma unroll
        for (int i = 0; i < FD_N * CPR / 32; i++) {
            const int p = i * 32 / CPR + lane / CPR;
            const int cl = __shfl_sync(0xffffffffu, cell, p);
            const bool ok = cl >= 0;
            const u32 row = ok ? cl : 0;
            tc_cp16_at(sK + i * 32 / CPR * LD * 2, kp + (u64)row * knb, ok);
            tc_cp16_at(sV + i * 32 / CPR * LD * 2, vp + (u64)row * vnb, ok);
        }
    };

    float o[MT][4];
#pragma unroll
    for (int n = 0; n < MT; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m[2] = {-TS_INF, -TS_INF}, l[2] = {0.0f, 0.0f};

    // The first chunks' table entries; for a ragged block, those of the guessed sequence over the
    // whole split, loaded in the same round as the values that confirm the guess and narrow the
    // range (positions past it are then ignored by `issue`).
    int raw_pre[FD_S];
#pragma unroll
    for (int it = 0; it < FD_S; it++) raw_pre[it] = raw_of(it);
    if (offsets.data) {
        const int guess = s;
        int vis;
        if (dead || !fa_ragged_local(offsets, kv_lens, tbi, seq_stride, n_tokens, n_kv, s, t0, vis)) {
            if (C == 1) return;
            dead = true;
            s = guess;
            t0 = 0;
            vis = 0;
        }
        j_end = min(j_end, vis);
        n_chunks = (j_end - j_begin + FD_N - 1) / FD_N;
        my_chunks = n_chunks > warp ? (n_chunks - warp + FD_W - 1) / FD_W : 0;
        kbase = k.data + hk * k.nb[2] + (paged ? 0 : s) * k.nb[3];
        vbase = v.data + hk * v.nb[2] + (paged ? 0 : s) * v.nb[3];
        tok[0] = tok[1] = t0;
        if (s != guess) {
#pragma unroll
            for (int it = 0; it < FD_S; it++) raw_pre[it] = raw_of(it);
        }
    }
    // Q^T as the B operand, rounded to the K/V type: qf[i] holds row g's elements 16 i + 2 tq, + 1
    // and 16 i + 2 tq + 8, + 9 (zeros for rows past nrows, which read row 0: one straight-line
    // path for the warp). The loads go out first, with the first mask values, so that their
    // latency passes while the first chunks' copies are issued; they are packed after.
    const bool q_live = g < nrows;
    float2 qx[MT][2];
    {
        const int r = q_live ? g : 0, h = h0 + (u32)r / (u32)tn, t = t0 + (u32)r % (u32)tn;
        const char* qrow = q.data + (i64)t * q.nb[1] + (i64)h * q.nb[2] + (i64)qs * q.nb[3];
        const bool pairs = q.nb[0] == 4 && ((q.nb[1] | q.nb[2] | q.nb[3] | (i64)q.data) & 7) == 0;
        if (pairs) {
#pragma unroll
            for (int i = 0; i < MT; i++) {
                qx[i][0] = *(const float2*)(qrow + (16 * i + 2 * tq) * 4);
                qx[i][1] = *(const float2*)(qrow + (16 * i + 2 * tq + 8) * 4);
            }
        } else {
            const i64 nb0 = q.nb[0];
#pragma unroll
            for (int i = 0; i < MT; i++) {
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int e = 16 * i + 2 * tq + 8 * h;
                    qx[i][h] = make_float2(*(const float*)(qrow + e * nb0), *(const float*)(qrow + (e + 1) * nb0));
                }
            }
        }
    }
    u32 mb[4];
    mask_bits(0, mb);
#pragma unroll
    for (int st = 0; st < FD_S; st++) {
        if (st < my_chunks) issue(st, st, raw_pre[st]);
        tc_commit();
    }
    u32 qf[MT][2];
#pragma unroll
    for (int i = 0; i < MT; i++) {
        qf[i][0] = q_live ? ft_pack<DT>(qx[i][0].x, qx[i][0].y) : 0u;
        qf[i][1] = q_live ? ft_pack<DT>(qx[i][1].x, qx[i][1].y) : 0u;
    }
    // Pending copy groups at the top of iteration it: chunks it .. it + FD_S - 1.
    for (int it = 0; it < my_chunks; it++) {
        float mv[4];
#pragma unroll
        for (int i = 0; i < 4; i++) mv[i] = mask_val(mb[i]);
        mask_bits(it + 1, mb);
        // the table entries of the chunk that refills this stage: loaded here, used after the
        // products (carried over from the previous iteration, ptxas placed the wait for them at
        // the loop's top)
        const int raw_refill = raw_of(it + FD_S);
        const int st = it % FD_S;
        tc_wait<FD_S - 1>();
        __syncwarp();
        const u32 sK = ring_s + st * STAGE * 2, sV = sK + FD_N * LD * 2;
        const u32 valid = s_valid[warp][st];

        // S^T = K Q^T: 16 positions x 8 rows, four accumulator chains over the k steps.
        float sa[4][4];
#pragma unroll
        for (int c = 0; c < 4; c++) sa[c][0] = sa[c][1] = sa[c][2] = sa[c][3] = 0.0f;
#pragma unroll
        for (int i = 0; i < MT; i++) {
            u32 a[4];
            tc_ldsm4_at(a, sK + ((lane & 15) * LD + 16 * i + (lane >> 4) * 8) * 2);
            ft_mma<DT>(sa[i & 3], a, qf[i][0], qf[i][1]);
        }
        // Logits and the online-softmax update: element i is position g + 8 (i >> 1) of column
        // (row) 2 tq + (i & 1).
        float sc[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float d = (sa[0][i] + sa[1][i]) + (sa[2][i] + sa[3][i]);
            const float x = (softcap > 0.0f ? softcap * tanhf(d * inner) : d * scale) + mv[i];
            sc[i] = (valid >> (g + (i >> 1) * 8)) & 1 ? x : -TS_INF;
        }
        float ms[2], alpha[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            float mx = fmaxf(sc[r], sc[r + 2]);
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
            const float m_new = fmaxf(m[r], mx);
            ms[r] = m_new == -TS_INF ? 0.0f : m_new;
            alpha[r] = expf(m[r] - ms[r]);
            l[r] *= alpha[r];
            m[r] = m_new;
        }
#pragma unroll
        for (int n = 0; n < MT; n++) {
            o[n][0] *= alpha[0];
            o[n][1] *= alpha[1];
            o[n][2] *= alpha[0];
            o[n][3] *= alpha[1];
        }
#pragma unroll
        for (int i = 0; i < 4; i++) {
            sc[i] = expf(sc[i] - ms[i & 1]);
            l[i & 1] += sc[i];
        }
        // O^T += V^T P^T: P^T's two 8 x 8 halves (positions 0-7, 8-15), transposed, are the B
        // fragments; V^T's through transposing ldmatrix of the V rows.
        const u32 b0 = fd_transpose(ft_pack<DT>(sc[0], sc[1])), b1 = fd_transpose(ft_pack<DT>(sc[2], sc[3]));
#pragma unroll
        for (int n = 0; n < MT; n++) {
            u32 a[4];
            tc_ldsm4_trans_at(a, sV + (((lane & 7) + (lane >> 4) * 8) * LD + 16 * n + ((lane >> 3) & 1) * 8) * 2);
            ft_mma<DT>(o[n], a, b0, b1);
        }
        __syncwarp();  // the stage is consumed: refill it with chunk it + FD_S
        if (it + FD_S < my_chunks) issue(it + FD_S, st, raw_refill);
        tc_commit();
    }

    // Merge the warps: each leaves (m, l) per row and its O^T fragments (in its own ring), then
    // warp w merges the head-dim tiles w, w + FD_W, ... for all rows.
    tc_wait<0>();
    __syncthreads();
    float* so = (float*)ring;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 4);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 8);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 16);
        if (g == 0) {
            s_m[warp][2 * tq + r] = m[r];
            s_l[warp][2 * tq + r] = l[r];
        }
    }
#pragma unroll
    for (int n = 0; n < MT; n++) *(float4*)&so[(n * 32 + lane) * 4] = make_float4(o[n][0], o[n][1], o[n][2], o[n][3]);
    __syncthreads();
    float mm[2], ll[2], f[FD_W][2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        mm[r] = -TS_INF;
#pragma unroll
        for (int w = 0; w < FD_W; w++) mm[r] = fmaxf(mm[r], s_m[w][2 * tq + r]);
        ll[r] = 0.0f;
#pragma unroll
        for (int w = 0; w < FD_W; w++) {
            f[w][r] = mm[r] == -TS_INF ? 0.0f : expf(s_m[w][2 * tq + r] - mm[r]);
            ll[r] += s_l[w][2 * tq + r] * f[w][r];
        }
    }
    const i64 n_rows_g = (i64)n_head * n_tokens * out.ne[3];
    // Where this thread's merged values go: the output (one split), the split's partial rows in
    // `part` (fa_combine merges them) or, in a cluster, the block's partial rows `cpart` in
    // shared memory (after warp 0's accumulators), which the cluster merges below.
    float* cpart = (float*)fd_smem + MT * 128;
    static_assert(WARP_HALVES * 2 >= (MT * 128 + FD_R * D) * 4, "warp 0's ring holds its accumulators and the block's rows");
    __shared__ float s_cm[FD_R], s_cl[FD_R];
    float* pr[2] = {nullptr, nullptr};
    int hr[2], tr[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = 2 * tq + r;
        hr[r] = h0 + (u32)row / (u32)tn;
        tr[r] = t0 + (u32)row % (u32)tn;
        if (row < nrows && warp == 0 && g == 0 && C > 1) {
            s_cm[row] = mm[r];
            s_cl[row] = ll[r];
        }
        if (row < nrows && n_splits > 1 && C == 1) {
            pr[r] = part + ((i64)split * n_rows_g + ((i64)qs * n_head + hr[r]) * n_tokens + tr[r]) * (D + 2);
            if (warp == 0 && g == 0) {
                pr[r][0] = mm[r];
                pr[r][1] = ll[r];
            }
        }
    }
    for (int n = warp; n < MT; n += FD_W) {
        float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int w = 0; w < FD_W; w++) {
            const float4 x = *(const float4*)((const float*)(fd_smem + w * WARP_HALVES) + (n * 32 + lane) * 4);
            a[0] += x.x * f[w][0];
            a[1] += x.y * f[w][1];
            a[2] += x.z * f[w][0];
            a[3] += x.w * f[w][1];
        }
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int r = i & 1, e = 16 * n + g + (i >> 1) * 8;
            if (2 * tq + r >= nrows) continue;
            if (C > 1) cpart[(2 * tq + r) * D + e] = a[i];
            else if (n_splits == 1) fa_store(out, gate, e, hr[r], tr[r], qs, mm[r] == -TS_INF ? 0.0f : a[i] / ll[r]);
            else pr[r][2 + e] = a[i];
        }
    }
#if __CUDA_ARCH__ >= 900
    if (C > 1) {
        // The cluster's C blocks (the splits of one tile) merge their partial rows through
        // distributed shared memory: block `rank` writes columns rank * D / C .. of every row,
        // 16 threads a row, each reading the C blocks' (max, sum) of its row and their values of
        // its columns. The second barrier keeps every block's shared memory until all are read.
        cl_sync();
        const u32 rank = cl_rank();
        const int row = tid >> 4;
        if (row < nrows && !dead) {
            float mc[C], fc[C], mx = -TS_INF, sum = 0.0f;
#pragma unroll
            for (int c = 0; c < C; c++) {
                mc[c] = cl_ld_f32(&s_cm[row], c);
                mx = fmaxf(mx, mc[c]);
            }
#pragma unroll
            for (int c = 0; c < C; c++) {
                fc[c] = mx == -TS_INF ? 0.0f : expf(mc[c] - mx);
                sum += cl_ld_f32(&s_cl[row], c) * fc[c];
            }
            const int h = h0 + (u32)row / (u32)tn, t = t0 + (u32)row % (u32)tn;
            for (int e = rank * (D / C) + (tid & 15); e < (rank + 1) * (D / C); e += 16) {
                float a = 0.0f;
#pragma unroll
                for (int c = 0; c < C; c++) a += cl_ld_f32(&cpart[row * D + e], c) * fc[c];
                fa_store(out, gate, e, h, t, qs, mx == -TS_INF ? 0.0f : a / sum);
            }
        }
        cl_sync_relaxed();
    }
#endif
}

#define FA_DEC(NAME, DT, D, C, ATTRS)                                                                           \
    extern "C" __global__ void __launch_bounds__(FD_W * 32, 1) ATTRS                                           \
        NAME(Tensor q, Tensor k, Tensor v, Tensor mask, Tensor table, Tensor offsets, Tensor kv_lens, Tensor out, \
             Tensor gate,                                                                                        \
             int mdt, int has_mask, int paged, float scale, float softcap, int split_len, int hb, int tb,        \
             int h_blocks, int t_blocks, int seq_stride, float* part, u64 err, u32 opcode) {                     \
        grid_begin();                                                                                            \
        fa_dec_impl<DT, D, C>(q, k, v, mask, table, offsets, kv_lens, out, gate, mdt, has_mask, paged, scale,    \
                              softcap, split_len, hb, tb, h_blocks, t_blocks, seq_stride, part, err, opcode);     \
    }

FA_DEC(fa_dec_f16_d128, DT_F16, 128, 1, )
FA_DEC(fa_dec_f16_d256, DT_F16, 256, 1, )
FA_DEC(fa_dec_bf16_d128, DT_BF16, 128, 1, )
FA_DEC(fa_dec_bf16_d256, DT_BF16, 256, 1, )

// sm_90+: the splits of a tile as one cluster of C = 2, 4 or 8 blocks along the grid's y, which
// merge them without `fa_combine` (its launch costs more than the merge where a split's work is
// small). The cluster shape is part of each entry, so that a CUDA graph never keeps a node's
// cluster shape for another kernel (see src/graphs.rs).
#if __CUDA_ARCH__ >= 900
#define FA_DEC_CLUSTER(C)                                                                        \
    FA_DEC(fa_dec_x##C##_f16_d128, DT_F16, 128, C, __cluster_dims__(1, C, 1))                    \
    FA_DEC(fa_dec_x##C##_f16_d256, DT_F16, 256, C, __cluster_dims__(1, C, 1))                    \
    FA_DEC(fa_dec_x##C##_bf16_d128, DT_BF16, 128, C, __cluster_dims__(1, C, 1))                  \
    FA_DEC(fa_dec_x##C##_bf16_d256, DT_BF16, 256, C, __cluster_dims__(1, C, 1))
FA_DEC_CLUSTER(2)
FA_DEC_CLUSTER(4)
FA_DEC_CLUSTER(8)
#endif
