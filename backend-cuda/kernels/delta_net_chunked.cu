// delta_net_chunked.cu: gated_delta_net's chunked form on tensor cores (S_k = S_v = 128, chunks of
// 64 tokens), for long sequences (the serial form, the slot check and the work list it writes:
// delta_net.cu).
//
// The WY / UT-transform form of backend-cpu's `chunked` (formulas in tessera_ops' reference),
// with every product on bf16 tensor cores in bf16x3: each f32 operand is split into a bf16 `hi`
// and the bf16 rounding of its remainder `lo`, and a b ~ a_hi b_lo + a_lo b_hi + a_hi b_hi with
// f32 accumulation keeps about 16 significant bits per product (NMSE ~1e-10 on the model shapes;
// plain tf32 or bf16 misses the f32 cases' 1e-7). The chunk is 64 tokens whatever the op's
// chunk length: both forms compute the same values.
//
// `gdn_cw_prep`, one block per (chunk, value head, sequence), builds what depends only on the
// chunk's inputs (gamma the cumulative sum of g over the chunk):
//   A[i][j] = beta_i (k_i . k_j) exp(gamma_i - gamma_j) (j < i),  T = (I + A)^-1,
//   W = T (beta exp(gamma) K),  U = T (beta V),  P[i][j] = (q_i . k_j) exp(gamma_i - gamma_j) (j <= i),
// and writes W and P as pre-split A-operand tiles, U in accumulator layout and exp(gamma),
// exp(gamma_last - gamma) to scratch; the block of the first value head of each key head also
// writes Q and K^T as pre-split A tiles. The in-order pass, one block per column block of a
// (value head, sequence) (`gdn_cw_scan<NT>` on mma.sync, `gdn_cw_scan_wg<NC>` on sm_90a's
// wgmma), then runs the chunks in order with its columns of the state in registers (accumulator
// layout) and, per chunk,
//   X = W S, Y = Q S, V_new = U - X,  O = exp(gamma) Y + P V_new,
//   S <- exp(gamma_last) S + K^T (exp(gamma_last - gamma) V_new),
// staging S and V_new in shared memory as split B tiles. Rows past the sequence are zero in
// every buffer (g = beta = k = q = v = 0), so they change nothing.
//
// Fragment layouts (mma.m16n8k16, lane = 4 g + t): A a0 (g, 2t..+1), a1 (g + 8, 2t..), a2 (g,
// 2t + 8..), a3 (g + 8, 2t + 8..); B b0 (k 2t..+1, n g), b1 (k 2t + 8.., n g); C c0 (g, 2t),
// c1 (g, 2t + 1), c2 (g + 8, 2t), c3 (g + 8, 2t + 1); the lower-indexed element of a pair in the
// low half. A pre-split A tile is 32 lanes x {hi a0..a3, lo a0..a3} (1 KiB, lane-major), a
// pre-split B tile 32 lanes x {hi b0, hi b1, lo b0, lo b1} (512 B).

#define CW_C 64       // tokens per chunk
#define CW_D 128      // S_k = S_v
#define CW_LD 136     // padded shared row of k, q, v (fragment loads conflict-free)
#define CW_TLD 72     // padded shared row of A and T
#define CW_TILE 256   // u32 per pre-split A tile

struct CwA {
    u32 h[4], l[4];
};
struct CwB {
    u32 h[2], l[2];
};

// x0 ~ hi0 + lo0, x1 ~ hi1 + lo1 as two packed bf16 pairs (x0 in the low halves).
__device__ __forceinline__ void cw_split2(float x0, float x1, u32& hi, u32& lo) {
    u32 h, l;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(h) : "f"(x1), "f"(x0));
    const float r0 = x0 - __uint_as_float(h << 16), r1 = x1 - __uint_as_float(h & 0xffff0000u);
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(l) : "f"(r1), "f"(r0));
    hi = h, lo = l;
}

// Term `term` of c += a b in bf16x3: a_lo b_hi, a_hi b_lo, then a_hi b_hi (small terms first).
// Callers issue one term over several independent tiles at a time, so that no mma waits on the
// one just issued (the three terms of one tile accumulate into the same registers).
__device__ __forceinline__ void cw_mma_term(float* c, const CwA& a, const CwB& b, int term) {
    if (term == 0) tc_mma_bf16(c, a.l, b.h[0], b.h[1]);
    else if (term == 1) tc_mma_bf16(c, a.h, b.l[0], b.l[1]);
    else tc_mma_bf16(c, a.h, b.h[0], b.h[1]);
}
// c[j] += a b[j] in bf16x3 for N independent tiles.
template <int N>
__device__ __forceinline__ void cw_mma3n(float (&c)[N][4], const CwA& a, const CwB (&b)[N]) {
#pragma unroll
    for (int term = 0; term < 3; term++)
#pragma unroll
        for (int j = 0; j < N; j++) cw_mma_term(c[j], a, b[j], term);
}

// A tile from f32 with element (r, k) at p[r * ld + k].
__device__ __forceinline__ CwA cw_a_rows(const float* p, int ld, int lane) {
    const int g = lane >> 2, t = lane & 3;
    const float2 x0 = *(const float2*)(p + g * ld + 2 * t), x1 = *(const float2*)(p + (g + 8) * ld + 2 * t);
    const float2 x2 = *(const float2*)(p + g * ld + 2 * t + 8), x3 = *(const float2*)(p + (g + 8) * ld + 2 * t + 8);
    CwA a;
    cw_split2(x0.x, x0.y, a.h[0], a.l[0]);
    cw_split2(x1.x, x1.y, a.h[1], a.l[1]);
    cw_split2(x2.x, x2.y, a.h[2], a.l[2]);
    cw_split2(x3.x, x3.y, a.h[3], a.l[3]);
    return a;
}

// Pre-split tiles: an A tile in global memory (this lane's 32 bytes), a B tile in shared memory.
__device__ __forceinline__ CwA cw_a_load(const u32* tile, int lane) {
    const uint4 x = ((const uint4*)tile)[2 * lane], y = ((const uint4*)tile)[2 * lane + 1];
    CwA a;
    a.h[0] = x.x, a.h[1] = x.y, a.h[2] = x.z, a.h[3] = x.w;
    a.l[0] = y.x, a.l[1] = y.y, a.l[2] = y.z, a.l[3] = y.w;
    return a;
}
__device__ __forceinline__ void cw_a_store(u32* tile, int lane, const CwA& a) {
    ((uint4*)tile)[2 * lane] = make_uint4(a.h[0], a.h[1], a.h[2], a.h[3]);
    ((uint4*)tile)[2 * lane + 1] = make_uint4(a.l[0], a.l[1], a.l[2], a.l[3]);
}
// The A tile made of two accumulator tiles side by side (columns 0..7 and 8..15).
__device__ __forceinline__ void cw_a_store_acc(u32* tile, int lane, const float* c0, const float* c1) {
    CwA a;
    cw_split2(c0[0], c0[1], a.h[0], a.l[0]);
    cw_split2(c0[2], c0[3], a.h[1], a.l[1]);
    cw_split2(c1[0], c1[1], a.h[2], a.l[2]);
    cw_split2(c1[2], c1[3], a.h[3], a.l[3]);
    cw_a_store(tile, lane, a);
}
__device__ __forceinline__ CwB cw_b_load(const uint4* tile, int lane) {
    const uint4 x = tile[lane];
    CwB b;
    b.h[0] = x.x, b.h[1] = x.y, b.l[0] = x.z, b.l[1] = x.w;
    return b;
}
// Element (k, n) of a pre-split B tile in shared memory.
__device__ __forceinline__ void cw_b_put(uint4* tile, int k, int n, float x) {
    u16* p = (u16*)tile;
    const int lane = n * 4 + ((k & 7) >> 1), r = k >> 3, half = k & 1;
    const u16 hi = f32_to_bf16(x);
    p[(lane * 4 + r) * 2 + half] = hi;
    p[(lane * 4 + 2 + r) * 2 + half] = f32_to_bf16(x - bf16_to_f32(hi));
}

// Four consecutive values x (times f) as hi / lo bf16 pairs at element `at` of the split rows hi
// and lo (8-byte aligned).
__device__ __forceinline__ void cw_put4(u16* hi, u16* lo, int at, float4 x, float f) {
    u32 h0, l0, h1, l1;
    cw_split2(x.x * f, x.y * f, h0, l0);
    cw_split2(x.z * f, x.w * f, h1, l1);
    *(uint2*)(hi + at) = make_uint2(h0, h1);
    *(uint2*)(lo + at) = make_uint2(l0, l1);
}

// Chunk `gc` of the chunk buffers: dense, chunk ci of sequence s is gc = s n_chunks + ci (tokens
// ci CW_C.. of outer index s); ragged (a work list `table` from gdn_check_slots), the chunks of the
// i-th long sequence are table[1 + n_seq + i] .. table[1 + n_seq + i + 1], its tokens starting at
// seq_offsets[s] (outer index 0). Per (chunk, value head) `vch = gc H_v + h`, per (chunk, key
// head) `kch = gc H_k + kh`.
struct CwChunk {
    i64 gc, t0, cn, outer;  // chunk, first token, tokens (<= CW_C), outer index
};

// Grid (H_v, n_chunks, n_seq) dense, (H_v, chunk bound, 1) ragged (blocks past the work list's
// total return), 256 threads, dynamic shared memory CW_PREP_SHARED (110336 bytes).
// VEC: q, k and v are f32 with 16-byte aligned rows of 128 contiguous floats (their rows then
// move as float4, k and q by cp.async); else any float dtype and strides, one element at a time.
// Scratch per (sequence, value head, chunk) `vch`: wf 32 A tiles [mt 4][kk 8], pf 16 A tiles
// [mt 4][kk 4] (kk <= mt written), uf [mt 4][nt 16][32 lanes][4] floats, gm [exp(gamma) 64]
// [exp(gamma_last - gamma) 64]; per (sequence, key head, chunk) `kch`: qf 32 A tiles [mt 4][kk 8]
// (q times scale), ktf 32 A tiles [key mt 8][token kk 4].
#define CW_PREP_SHARED (4 * (2 * CW_C * CW_LD + 2 * CW_C * CW_TLD + 3 * 256 + 3 * CW_C))
template <bool VEC>
__device__ __forceinline__ void cw_prep_body(Tensor q, int qdt, Tensor k, int kdt, Tensor v, int vdt, Tensor g, int gdt,
                                             Tensor beta, int bdt, float scale, int h_k, int grouped, u32* wf, u32* pf,
                                             float* uf, float* gm, u32* qf, u32* ktf, Tensor offsets,
                                             const int* table, u64 err) {
    extern __shared__ __align__(16) float sh[];
    float* ks = sh;                   // k rows, then beta exp(gamma) k [C][LD]
    float* qs = ks + CW_C * CW_LD;    // q rows (times scale), then beta v [C][LD]
    float* as = qs + CW_C * CW_LD;    // A [C][TLD]
    float* ts = as + CW_C * CW_TLD;   // T [C][TLD]
    float* rs = ts + CW_C * CW_TLD;   // the solve's partial products, 3 x 16 x 16
    float* gam = rs + 3 * 256;        // gamma
    float* bet = gam + CW_C;          // beta
    float* bw = bet + CW_C;           // beta exp(gamma)
    if (((volatile ErrorRecord*)err)->code != 0u) return;
    const i64 n_t = v.ne[2], h_v = v.ne[1];
    // Heads fastest and the last chunks first: the early chunks' buffers, written last, are
    // still in L2 when gdn_cw_scan starts reading them.
    const i64 h = blockIdx.x, last = gridDim.y - 1 - blockIdx.y;
    CwChunk ch;
    if (table == nullptr) {
        ch = CwChunk{blockIdx.z * (i64)gridDim.y + last, last * CW_C, min((i64)CW_C, n_t - last * CW_C), blockIdx.z};
    } else {
        const i64 n_seq = offsets.ne[0] - 1, m = table[0];
        const int* first = table + 1 + n_seq;
        if (last >= first[m]) return;
        i64 lo = 0, hi = m;  // the long sequence i whose chunks hold `last`: first[i] <= last < first[i + 1]
        while (hi - lo > 1) {
            const i64 mid = (lo + hi) >> 1;
            if (first[mid] <= last) lo = mid;
            else hi = mid;
        }
        const i64 s = table[1 + lo], begin = seq_offset(offsets, s, n_t) + (last - first[lo]) * CW_C;
        ch = CwChunk{last, begin, min((i64)CW_C, seq_offset(offsets, s + 1, n_t) - begin), 0};
    }
    const i64 ratio = h_v / h_k;
    const i64 kh = grouped ? h / ratio : h % h_k;
    const bool kwriter = grouped ? h % ratio == 0 : h < h_k;  // first value head of key head kh
    const i64 t0 = ch.t0, s = ch.outer;
    const int cn = (int)ch.cn;
    const i64 vch = ch.gc * h_v + h, kch = ch.gc * h_k + kh;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

    // v rows in registers until q is done with (element (r, c) of vr[m] is idx = tid + 256 m,
    // r = idx / 128, c = idx % 128; VEC: four consecutive c per float4); k and q rows to shared
    // as f32, then split in place below.
    float vr[32];
    if (VEC) {
#pragma unroll
        for (int m = 0; m < 8; m++) {
            const int idx = tid + 256 * m, r = idx >> 5, c = (idx & 31) * 4;
            float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
            if (r < cn) x = *(const float4*)(v.data + offset_of(v, c, h, t0 + r, s));
            vr[4 * m] = x.x, vr[4 * m + 1] = x.y, vr[4 * m + 2] = x.z, vr[4 * m + 3] = x.w;
        }
#pragma unroll
        for (int m = 0; m < 8; m++) {
            const int idx = tid + 256 * m, r = idx >> 5, c = (idx & 31) * 4;
            if (r < cn) {
                tc_cp16(ks + r * CW_LD + c, k.data + offset_of(k, c, kh, t0 + r, s), true);
                tc_cp16(qs + r * CW_LD + c, q.data + offset_of(q, c, kh, t0 + r, s), true);
            } else {
                *(float4*)(ks + r * CW_LD + c) = make_float4(0.f, 0.f, 0.f, 0.f);
                *(float4*)(qs + r * CW_LD + c) = make_float4(0.f, 0.f, 0.f, 0.f);
            }
        }
        tc_commit();
    } else {
#pragma unroll 4
        for (int m = 0; m < 32; m++) {
            const int idx = tid + 256 * m, r = idx >> 7, c = idx & 127;
            vr[m] = r < cn ? load_f32(v.data + offset_of(v, c, h, t0 + r, s), vdt) : 0.0f;
            ks[r * CW_LD + c] = r < cn ? load_f32(k.data + offset_of(k, c, kh, t0 + r, s), kdt) : 0.0f;
            qs[r * CW_LD + c] = r < cn ? load_f32(q.data + offset_of(q, c, kh, t0 + r, s), qdt) : 0.0f;
        }
    }
    if (tid < CW_C) {
        const bool in = tid < cn;
        gam[tid] = in ? load_f32(g.data + offset_of(g, 0, h, t0 + tid, s), gdt) : 0.0f;
        bet[tid] = in ? load_f32(beta.data + offset_of(beta, 0, h, t0 + tid, s), bdt) : 0.0f;
    }
    if (VEC) tc_wait<0>();
    __syncthreads();
    // k and q (times scale) as hi / lo bf16 rows in their own bytes: KH, KL [C][LD] in ks's, QH,
    // QL in qs's, read from here on through ldmatrix, each value split once.
    u16 *KH = (u16*)ks, *KL = KH + CW_C * CW_LD, *QH = (u16*)qs, *QL = QH + CW_C * CW_LD;
    {
        float4 x[8];
#pragma unroll
        for (int m = 0; m < 8; m++) {
            const int idx = tid + 256 * m;
            x[m] = *(const float4*)(ks + (idx >> 5) * CW_LD + (idx & 31) * 4);
        }
        __syncthreads();
#pragma unroll
        for (int m = 0; m < 8; m++) {
            const int idx = tid + 256 * m;
            cw_put4(KH, KL, (idx >> 5) * CW_LD + (idx & 31) * 4, x[m], 1.0f);
            x[m] = *(const float4*)(qs + (idx >> 5) * CW_LD + (idx & 31) * 4);
        }
        if (warp == 0) {  // inclusive scan of g, two tokens per lane
            const float a = gam[2 * lane], b = a + gam[2 * lane + 1];
            float y = b;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const float z = __shfl_up_sync(0xffffffffu, y, o);
                if (lane >= o) y += z;
            }
            gam[2 * lane] = y - b + a;
            gam[2 * lane + 1] = y;
        }
        __syncthreads();
#pragma unroll
        for (int m = 0; m < 8; m++) {
            const int idx = tid + 256 * m;
            cw_put4(QH, QL, (idx >> 5) * CW_LD + (idx & 31) * 4, x[m], scale);
        }
    }
    if (tid < CW_C) {
        const float gi = gam[tid];
        gm[vch * 2 * CW_C + tid] = expf(gi);
        gm[vch * 2 * CW_C + CW_C + tid] = expf(gam[CW_C - 1] - gi);
        bw[tid] = bet[tid] * expf(gi);
    }
    __syncthreads();

    const int g8 = lane >> 2, t4 = lane & 3;
    // ldmatrix lanes: an A tile's row and column (16 rows from r0, 16 columns from c0) at
    // (r0 + ar, c0 + ac); a pair of B tiles (8 n-rows each from n0, 16 k from c0) at (n0 + br,
    // c0 + bc); a transposed pair (16 k-rows from r0, 8 n-columns each from n0) at (r0 + bc +
    // (lane & 7), n0 + (br & 8)).
    const int ar = lane & 15, ac = (lane >> 4) * 8, br = (lane & 7) + (lane >> 4) * 8, bc = ((lane >> 3) & 1) * 8;
    {
        // K K^T and Q K^T: warp owns rows 16 mt.. and columns 8 (nb + j).. (tiles right of the
        // diagonal are skipped: they are masked). Warps w and w + 4 share a scheduler, so they
        // take rows from opposite ends.
        const int mt = warp < 4 ? warp : 7 - warp, nb = (warp >> 2) * 4;
        float ca[4][4], cp[4][4];
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) ca[j][e] = 0.0f, cp[j][e] = 0.0f;
#pragma unroll 2
        for (int kk = 0; kk < CW_D / 16; kk++) {
            const int ao = (16 * mt + ar) * CW_LD + 16 * kk + ac;
            CwA ak, aq;
            tc_ldsm4(ak.h, KH + ao), tc_ldsm4(ak.l, KL + ao);
            tc_ldsm4(aq.h, QH + ao), tc_ldsm4(aq.l, QL + ao);
            CwB b[4];
#pragma unroll
            for (int jp = 0; jp < 2; jp++) {
                const int bo = (8 * (nb + 2 * jp) + br) * CW_LD + 16 * kk + bc;
                u32 hh[4], ll[4];
                tc_ldsm4(hh, KH + bo), tc_ldsm4(ll, KL + bo);
                b[2 * jp] = CwB{{hh[0], hh[1]}, {ll[0], ll[1]}};
                b[2 * jp + 1] = CwB{{hh[2], hh[3]}, {ll[2], ll[3]}};
            }
#pragma unroll
            for (int term = 0; term < 3; term++)
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    if (8 * (nb + j) > 16 * mt + 15) continue;
                    cw_mma_term(ca[j], ak, b[j], term);
                    cw_mma_term(cp[j], aq, b[j], term);
                }
        }
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int i = 16 * mt + g8 + 8 * (e >> 1), jj = 8 * (nb + j) + 2 * t4 + (e & 1);
                const float d = jj <= i ? expf(gam[i] - gam[jj]) : 0.0f;
                as[i * CW_TLD + jj] = jj < i ? ca[j][e] * (bet[i] * d) : 0.0f;
                cp[j][e] = jj <= i ? cp[j][e] * d : 0.0f;
            }
#pragma unroll
        for (int q = 0; q < 2; q++) {
            const int kk = nb / 2 + q;
            if (kk <= mt) cw_a_store_acc(pf + (vch * 16 + mt * 4 + kk) * CW_TILE, lane, cp[2 * q], cp[2 * q + 1]);
        }
        if (kwriter) {
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const int kk = (warp >> 2) * 4 + q, ao = (16 * mt + ar) * CW_LD + 16 * kk + ac;
                CwA a;
                tc_ldsm4(a.h, QH + ao), tc_ldsm4(a.l, QL + ao);
                cw_a_store(qf + (kch * 32 + mt * 8 + kk) * CW_TILE, lane, a);
            }
            // K^T's tiles: rows are keys 16 warp.., columns tokens 16 kk.. (k transposed)
#pragma unroll
            for (int kk = 0; kk < 4; kk++) {
                const int ao = (16 * kk + (lane & 7) + (lane >> 4) * 8) * CW_LD + 16 * warp + bc;
                CwA a;
                tc_ldsm4_trans(a.h, KH + ao), tc_ldsm4_trans(a.l, KL + ao);
                cw_a_store(ktf + (kch * 32 + warp * 4 + kk) * CW_TILE, lane, a);
            }
        }
    }
    __syncthreads();

    // beta exp(gamma) k in place of k (from its split: about 16 bits of k, as every product sees
    // it), beta v in place of q.
#pragma unroll 4
    for (int m = 0; m < CW_C * CW_D / 1024; m++) {
        const int idx = tid + 256 * m, r = idx >> 5, c = (idx & 31) * 4;
        const uint2 hi = *(const uint2*)(KH + r * CW_LD + c), lo = *(const uint2*)(KL + r * CW_LD + c);
        const float4 x = make_float4(
            __uint_as_float(hi.x << 16) + __uint_as_float(lo.x << 16),
            __uint_as_float(hi.x & 0xffff0000u) + __uint_as_float(lo.x & 0xffff0000u),
            __uint_as_float(hi.y << 16) + __uint_as_float(lo.y << 16),
            __uint_as_float(hi.y & 0xffff0000u) + __uint_as_float(lo.y & 0xffff0000u));
        cw_put4(KH, KL, r * CW_LD + c, x, bw[r]);
    }
    if (VEC) {
#pragma unroll
        for (int m = 0; m < 8; m++) {
            const int idx = tid + 256 * m, r = idx >> 5, c = (idx & 31) * 4;
            cw_put4(QH, QL, r * CW_LD + c, make_float4(vr[4 * m], vr[4 * m + 1], vr[4 * m + 2], vr[4 * m + 3]), bet[r]);
        }
    } else {
#pragma unroll
        for (int m = 0; m < 32; m++) {
            const int idx = tid + 256 * m, r = idx >> 7, c = idx & 127;
            const float x = vr[m] * bet[r];
            const u16 hi = f32_to_bf16(x);
            QH[r * CW_LD + c] = hi;
            QL[r * CW_LD + c] = f32_to_bf16(x - bf16_to_f32(hi));
        }
    }
    // T = (I + A)^-1, unit lower triangular. The 16 x 16 diagonal blocks first: lane c of warp I
    // solves column c of (I + A_II) by forward substitution in registers.
    if (warp < 4 && lane < 16) {
        const int c = lane, o = 16 * warp;
        float tc[16];
#pragma unroll
        for (int r = 0; r < 16; r++) {
            float acc = 0.0f;
#pragma unroll
            for (int m = 0; m < r; m++) acc = fmaf(as[(o + r) * CW_TLD + o + m], tc[m], acc);
            tc[r] = r == c ? 1.0f : (r < c ? 0.0f : -acc);
        }
#pragma unroll
        for (int r = 0; r < 16; r++) ts[(o + r) * CW_TLD + o + c] = tc[r];
    }
    __syncthreads();
    // Then block rows I = 1..3: T_IJ = -T_II sum_{K=J}^{I-1} A_IK T_KJ for J < I; thread (r, c)
    // of 16 x 16 does element (r, c) of every J (T_II is zero right of its diagonal).
    {
        const int r = tid >> 4, c = tid & 15;
#pragma unroll
        for (int I = 1; I < 4; I++) {
#pragma unroll
            for (int J = 0; J < I; J++) {
                float acc = 0.0f;
#pragma unroll
                for (int m = 16 * J; m < 16 * I; m++) acc = fmaf(as[(16 * I + r) * CW_TLD + m], ts[m * CW_TLD + 16 * J + c], acc);
                rs[J * 256 + tid] = acc;
            }
            __syncthreads();
#pragma unroll
            for (int J = 0; J < I; J++) {
                float acc = 0.0f;
#pragma unroll
                for (int m = 0; m < 16; m++) acc = fmaf(ts[(16 * I + r) * CW_TLD + 16 * I + m], rs[J * 256 + m * 16 + c], acc);
                ts[(16 * I + r) * CW_TLD + 16 * J + c] = -acc;
            }
            __syncthreads();
        }
    }

    {
        // W = T (beta exp(gamma) K), U = T (beta V): warp owns rows 16 mt.. and columns 8 (nb +
        // j)..; T is zero right of its diagonal, so kk stops at mt (rows from opposite ends for
        // warps w and w + 4, as above).
        const int mt = warp < 4 ? warp : 7 - warp, nb = (warp >> 2) * 8;
        float cw[8][4], cu[8][4];
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) cw[j][e] = 0.0f, cu[j][e] = 0.0f;
        for (int kk = 0; kk <= mt; kk++) {
            const CwA a = cw_a_rows(ts + 16 * mt * CW_TLD + 16 * kk, CW_TLD, lane);
#pragma unroll
            for (int jg = 0; jg < 8; jg += 4) {
                CwB bk[4], bv[4];
#pragma unroll
                for (int jp = 0; jp < 2; jp++) {
                    const int bo = (16 * kk + bc + (lane & 7)) * CW_LD + 8 * (nb + jg + 2 * jp) + (br & 8);
                    u32 kh4[4], kl4[4], vh4[4], vl4[4];
                    tc_ldsm4_trans(kh4, KH + bo), tc_ldsm4_trans(kl4, KL + bo);
                    tc_ldsm4_trans(vh4, QH + bo), tc_ldsm4_trans(vl4, QL + bo);
                    bk[2 * jp] = CwB{{kh4[0], kh4[1]}, {kl4[0], kl4[1]}};
                    bk[2 * jp + 1] = CwB{{kh4[2], kh4[3]}, {kl4[2], kl4[3]}};
                    bv[2 * jp] = CwB{{vh4[0], vh4[1]}, {vl4[0], vl4[1]}};
                    bv[2 * jp + 1] = CwB{{vh4[2], vh4[3]}, {vl4[2], vl4[3]}};
                }
#pragma unroll
                for (int term = 0; term < 3; term++)
#pragma unroll
                    for (int j = 0; j < 4; j++) {
                        cw_mma_term(cw[jg + j], a, bk[j], term);
                        cw_mma_term(cu[jg + j], a, bv[j], term);
                    }
            }
        }
#pragma unroll
        for (int q = 0; q < 4; q++)
            cw_a_store_acc(wf + (vch * 32 + mt * 8 + nb / 2 + q) * CW_TILE, lane, cw[2 * q], cw[2 * q + 1]);
#pragma unroll
        for (int j = 0; j < 8; j++)
            *(float4*)(uf + ((vch * 4 + mt) * 16 + nb + j) * 128 + lane * 4) = make_float4(cu[j][0], cu[j][1], cu[j][2], cu[j][3]);
    }
}

#define CW_PREP_KERNEL(name, VEC)                                                                               \
    extern "C" __global__ void __launch_bounds__(256, 2)                                                        \
        name(Tensor q, int qdt, Tensor k, int kdt, Tensor v, int vdt, Tensor g, int gdt, Tensor beta, int bdt,  \
             float scale, int h_k, int grouped, u32* wf, u32* pf, float* uf, float* gm, u32* qf, u32* ktf,      \
             Tensor offsets, const int* table, u64 err) {                                                       \
        grid_begin();                                                                                           \
        cw_prep_body<VEC>(q, qdt, k, kdt, v, vdt, g, gdt, beta, bdt, scale, h_k, grouped, wf, pf, uf, gm, qf,  \
                          ktf, offsets, table, err);                                                            \
    }

CW_PREP_KERNEL(gdn_cw_prep, false)
CW_PREP_KERNEL(gdn_cw_prep_vec, true)

// What both in-order kernels share: the sequence a block runs and the staging of each chunk's A
// tiles. Grid (column blocks, H_v, n_seq) dense, (column blocks, H_v, long-sequence bound) ragged:
// block z is the z-th long sequence of the work list (blocks past its count do nothing). The
// sequence's chunks are g0 .. g0 + nch of the buffers, its len tokens from `base` at outer index
// `so`, its state in slot `slot`. The staging: W, Q (32 A tiles of 64 uint4 each), two buffers
// of K^T (32 tiles) and of P (10 tiles: (mt, kk <= mt) at mt (mt + 1) / 2 + kk) and of the decays
// (gm's layout, 128 floats), `CW_STAGE_BYTES` in all.
#define CW_STAGE_BYTES (16 * 64 * (32 + 32 + 2 * 32 + 2 * 10) + 4 * 2 * 2 * CW_C)
struct CwScan {
    i64 h, kh, h_v, h_k, s, g0, nch, base, len, so, slot;
    uint4 *wsm, *qsm, *ksm, *psm;
    float* gsm;

    // False when the block has nothing to run: an error is recorded, the block is past the work
    // list, or the slot is out of range (unreachable after gdn_check_slots).
    __device__ __forceinline__ bool init(const Tensor& out, const Tensor& state, const Tensor& slots, int hk, int grouped,
                                         const Tensor& offsets, const int* table, u64 err, void* stage) {
        if (((volatile ErrorRecord*)err)->code != 0u) return false;
        const i64 n_t = out.ne[2];
        h_v = out.ne[1], h_k = hk, h = blockIdx.y;
        if (table == nullptr) {
            s = blockIdx.z, nch = (n_t + CW_C - 1) / CW_C, g0 = s * nch, base = 0, len = n_t, so = s;
        } else {
            const i64 n_seq = offsets.ne[0] - 1, i = blockIdx.z;
            if (i >= table[0]) return false;
            s = table[1 + i], g0 = table[1 + n_seq + i], nch = table[1 + n_seq + i + 1] - g0;
            base = seq_offset(offsets, s, n_t), len = seq_offset(offsets, s + 1, n_t) - base, so = 0;
        }
        kh = grouped ? h / (h_v / h_k) : h % h_k;
        slot = *(const int*)(slots.data + s * slots.nb[0]);
        wsm = (uint4*)stage, qsm = wsm + 32 * 64, ksm = qsm + 32 * 64, psm = ksm + 2 * 32 * 64;
        gsm = (float*)(psm + 2 * 10 * 64);
        return slot >= 0 && slot < state.ne[3];
    }
    __device__ __forceinline__ i64 vch(i64 ci) const { return (g0 + ci) * h_v + h; }
    __device__ __forceinline__ i64 kch(i64 ci) const { return (g0 + ci) * h_k + kh; }

    // Chunk ci's W, Q and decays (one cp.async group), then its P and K^T into buffer ci & 1
    // (another), copied by the block's `threads` threads.
    __device__ __forceinline__ void copy_chunk(i64 ci, const u32* wf, const u32* pf, const float* gm, const u32* qf,
                                               const u32* ktf, int tid, int threads) const {
        const i64 v = vch(ci), k = kch(ci);
        const uint4* w = (const uint4*)(wf + v * 32 * CW_TILE);
        const uint4* qq = (const uint4*)(qf + k * 32 * CW_TILE);
        for (int i = tid; i < 32 * 64; i += threads) tc_cp16(wsm + i, w + i, true), tc_cp16(qsm + i, qq + i, true);
        if (tid < 32) tc_cp16(gsm + (ci & 1) * 2 * CW_C + tid * 4, gm + v * 2 * CW_C + tid * 4, true);
        tc_commit();
        const uint4* kt = (const uint4*)(ktf + k * 32 * CW_TILE);
        uint4* kd = ksm + (ci & 1) * 32 * 64;
        for (int i = tid; i < 32 * 64; i += threads) tc_cp16(kd + i, kt + i, true);
        const uint4* p = (const uint4*)(pf + v * 16 * CW_TILE);
        uint4* pd = psm + (ci & 1) * 10 * 64;
        for (int i = tid; i < 10 * 64; i += threads) {
            const int tile = i >> 6, pm = tile >= 6 ? 3 : tile >= 3 ? 2 : tile >= 1 ? 1 : 0;
            const int pk = tile - pm * (pm + 1) / 2;
            tc_cp16(pd + i, p + (pm * 4 + pk) * 64 + (i & 63), true);
        }
        tc_commit();
    }
};

// `gdn_cw_scan<NT>`: 64 NT threads (2 NT warps), 8 NT state columns a block (S_v / (8 NT) column
// blocks), dynamic shared memory `scan_shared(NT)` in ops/delta_net.rs (213 KiB at NT = 8, 185 at
// NT = 4): `gdn_cw_scan` NT = 8, `gdn_cw_scan4` NT = 4, which the host takes where the NT = 8 grid
// would leave multiprocessors idle (a 32-head prefill: 64 blocks). Warps 0..NT-1 compute X = W S
// (then V_new), warps NT..2NT-1 Y = Q S (then the outputs), each for token rows 16 mt.. and four
// column tiles 4 ng..; every warp then updates the state tiles it holds in registers: keys 16
// sm.., column tiles 4 sg.. . Chunk ci + 1's tiles are copied while chunk ci finishes; X warps
// read U straight into registers.
template <int NT>
__device__ __forceinline__ void cw_scan_body(Tensor out, Tensor state, Tensor slots, int h_k, int grouped, const u32* wf,
                                             const u32* pf, const float* uf, const float* gm, const u32* qf,
                                             const u32* ktf, Tensor offsets, const int* table, u64 err) {
    static_assert(NT == 4 || NT == 8, "four X warps (one a row tile), whole groups of four column tiles");
    extern __shared__ __align__(16) uint4 shq[];
    uint4* sb = shq + CW_STAGE_BYTES / 16;  // S as B tiles [kk 8][NT][32]
    uint4* vb = sb + 8 * NT * 32;            // V_new as B tiles [kk 4][NT][32]
    uint4* vbs = vb + 4 * NT * 32;           // exp(gamma_last - gamma) V_new as B tiles
    CwScan sc;
    if (!sc.init(out, state, slots, h_k, grouped, offsets, table, err, shq)) return;
    const i64 h = sc.h, nch = sc.nch, base = sc.base, len = sc.len, so = sc.so, slot = sc.slot;
    const uint4 *wsm = sc.wsm, *qsm = sc.qsm, *ksm = sc.ksm, *psm = sc.psm;
    const float* gsm = sc.gsm;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g8 = lane >> 2, t4 = lane & 3;
    const int col0 = blockIdx.x * 8 * NT;
    const int sm = warp & 7, sg = warp >> 3;
    const bool xw = warp < NT;
    // Y warps w and w + 4 share a scheduler: rows from opposite ends (the outputs' work grows
    // with mt).
    const int w2 = xw ? warp : warp - NT, ng = w2 >> 2;
    const int mt = xw || ng == 0 ? (w2 & 3) : 3 - (w2 & 3);
    auto copy_chunk = [&](i64 ci) { sc.copy_chunk(ci, wf, pf, gm, qf, ktf, tid, 64 * NT); };

    char* sbase = state.data + h * state.nb[2] + slot * state.nb[3];
    float st[4][4];
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int key = 16 * sm + g8 + 8 * (e >> 1), col = col0 + 8 * (4 * sg + j) + 2 * t4 + (e & 1);
            st[j][e] = *(const float*)(sbase + col * state.nb[1] + key * state.nb[0]);
        }

    copy_chunk(0);
    for (i64 ci = 0; ci < nch; ci++) {
        const i64 vch = sc.vch(ci);
        const float* gv = gsm + (ci & 1) * 2 * CW_C;
        const uint4* kbuf = ksm + (ci & 1) * 32 * 64;
        const uint4* pbuf = psm + (ci & 1) * 10 * 64;
        float4 u[4];
        if (xw) {
#pragma unroll
            for (int j = 0; j < 4; j++) u[j] = *(const float4*)(uf + ((vch * 4 + mt) * 16 + col0 / 8 + 4 * ng + j) * 128 + lane * 4);
        }
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                cw_b_put(sb + (sm * NT + 4 * sg + j) * 32, g8 + 8 * (e >> 1), 2 * t4 + (e & 1), st[j][e]);
        tc_wait<1>();  // W, Q and the decays of this chunk
        __syncthreads();

        float acc[4][4];
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[j][e] = 0.0f;
        {
            const u32* at = (const u32*)((xw ? wsm : qsm) + mt * 8 * 64);
#pragma unroll
            for (int kk = 0; kk < 8; kk++) {
                const CwA a = cw_a_load(at + kk * CW_TILE, lane);
                CwB b[4];
#pragma unroll
                for (int j = 0; j < 4; j++) b[j] = cw_b_load(sb + (kk * NT + 4 * ng + j) * 32, lane);
                cw_mma3n<4>(acc, a, b);
            }
        }
        if (xw) {
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int nt = 4 * ng + j;
                const float uu[4] = {u[j].x, u[j].y, u[j].z, u[j].w};
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int r = g8 + 8 * (e >> 1), c = 2 * t4 + (e & 1);
                    const float vn = uu[e] - acc[j][e];
                    cw_b_put(vb + (mt * NT + nt) * 32, r, c, vn);
                    cw_b_put(vbs + (mt * NT + nt) * 32, r, c, vn * gv[CW_C + 16 * mt + r]);
                }
            }
        }
        tc_wait<0>();  // P and K^T of this chunk
        __syncthreads();
        // W, Q and decay buffer (ci + 1) & 1 were last read before the barrier, P and K^T buffer
        // (ci + 1) & 1 in chunk ci - 1.
        if (ci + 1 < nch) copy_chunk(ci + 1);
        if (!xw) {
#pragma unroll
            for (int j = 0; j < 4; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[j][e] *= gv[16 * mt + g8 + 8 * (e >> 1)];
            for (int kk = 0; kk <= mt; kk++) {
                const CwA p = cw_a_load((const u32*)(pbuf + (mt * (mt + 1) / 2 + kk) * 64), lane);
                CwB b[4];
#pragma unroll
                for (int j = 0; j < 4; j++) b[j] = cw_b_load(vb + (kk * NT + 4 * ng + j) * 32, lane);
                cw_mma3n<4>(acc, p, b);
            }
#pragma unroll
            for (int j = 0; j < 4; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const i64 tok = ci * CW_C + 16 * mt + g8 + 8 * (e >> 1);
                    const int col = col0 + 8 * (4 * ng + j) + 2 * t4 + (e & 1);
                    if (tok < len) *(float*)(out.data + offset_of(out, col, h, base + tok, so)) = acc[j][e];
                }
        }
        const float el = gv[CW_C - 1];
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) st[j][e] *= el;
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            const CwA a = cw_a_load((const u32*)(kbuf + (sm * 4 + kk) * 64), lane);
            CwB b[4];
#pragma unroll
            for (int j = 0; j < 4; j++) b[j] = cw_b_load(vbs + (kk * NT + 4 * sg + j) * 32, lane);
            cw_mma3n<4>(st, a, b);
        }
    }

#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int key = 16 * sm + g8 + 8 * (e >> 1), col = col0 + 8 * (4 * sg + j) + 2 * t4 + (e & 1);
            *(float*)(sbase + col * state.nb[1] + key * state.nb[0]) = st[j][e];
        }
}

#define CW_SCAN_KERNEL(name, NT)                                                                                   \
    extern "C" __global__ void __launch_bounds__(64 * (NT), 1)                                                    \
        name(Tensor out, Tensor state, Tensor slots, int h_k, int grouped, const u32* wf, const u32* pf,          \
             const float* uf, const float* gm, const u32* qf, const u32* ktf, Tensor offsets, const int* table,  \
             u64 err) {                                                                                           \
        grid_begin();                                                                                             \
        cw_scan_body<NT>(out, state, slots, h_k, grouped, wf, pf, uf, gm, qf, ktf, offsets, table, err);         \
    }
CW_SCAN_KERNEL(gdn_cw_scan, 8)
CW_SCAN_KERNEL(gdn_cw_scan4, 4)

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// `gdn_cw_scan_wg<NC>` (sm_90a): the same pass on warpgroup products. 256 threads (two
// warpgroups), NC state columns a block (S_v / NC column blocks), dynamic shared memory
// `CW_WG_SHARED(NC)`: `gdn_cw_scan_wg` NC = 64 (214 KiB), `gdn_cw_scan_wg32` NC = 32 (185 KiB).
// Warpgroup 0 computes X = W S, then V_new; warpgroup 1 Y = Q S, then the outputs; both then
// update their 64 keys of the state (keys 64 wg..), which stay in registers in the accumulator
// layout (warp w of a group: rows 16 w.. of its 64). Every product is an m64nNCk16 wgmma in
// bf16x3 with the A operand from registers (the staged pre-split tiles, whose lane-major layout is
// the A fragment's) and the B operand (S, V_new, scaled V_new, split into hi and lo bf16 tiles)
// read by the tensor cores from shared memory, MN-major: rows of NC columns (2 NC bytes) with the
// 2 NC-byte swizzle. Against mma.sync, each B value is read once a warpgroup rather than once a
// warp, and the operand loads leave the instruction stream.
#define CW_WG_SHARED(NC) (1024 + 2 * 2 * (CW_D * (NC) + 2 * CW_C * (NC)) + CW_STAGE_BYTES)

// d (64 x NC, this thread's accumulators) += a b for one k16 step, a from registers, b the
// MN-major tile of descriptor `b`.
#define CW_WG_RS64(d, a, b)                                                                                   \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                                 \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, " \
                 "%9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, "  \
                 "%27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"                      \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),        \
                   "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),    \
                   "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), \
                   "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), \
                   "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])                                         \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(1)                                 \
                 : "memory")
#define CW_WG_RS32(d, a, b)                                                                                   \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"                                                 \
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, " \
                 "%9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, 1;\n}\n"             \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),        \
                   "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),    \
                   "+f"(d[14]), "+f"(d[15])                                                                   \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(1)                                 \
                 : "memory")

// d += a b in bf16x3 for one k16 step: a_lo b_hi, a_hi b_lo, a_hi b_hi (small terms first), b
// the hi and lo tiles' descriptors.
template <int NC>
__device__ __forceinline__ void cw_wg_mma3(float* d, const CwA& a, u64 bh, u64 bl) {
    if (NC == 64) {
        CW_WG_RS64(d, a.l, bh);
        CW_WG_RS64(d, a.h, bl);
        CW_WG_RS64(d, a.h, bh);
    } else {
        CW_WG_RS32(d, a.l, bh);
        CW_WG_RS32(d, a.h, bl);
        CW_WG_RS32(d, a.h, bh);
    }
}
// Elements (k, n) and (k, n + 1) (n even) of an MN-major B operand of NC columns, split into the
// hi and lo tiles: row k of 2 NC bytes; its 16-byte chunk n / 8 XOR-swizzled as the 128-byte
// (NC = 64: chunk ^ k % 8) or the 64-byte mode (NC = 32: chunk ^ (k / 2) % 4) places it.
template <int NC>
__device__ __forceinline__ void cw_wg_put(u16* hi, u16* lo, int k, int n, float x0, float x1) {
    u32 h, l;
    cw_split2(x0, x1, h, l);
    const int swz = NC == 64 ? k & 7 : (k >> 1) & 3;
    const int at = k * NC + (((n >> 3) ^ swz) << 3) + (n & 7);
    *(u32*)(hi + at) = h;
    *(u32*)(lo + at) = l;
}
// The descriptor of k16 step kk of an MN-major B tile of `rows` rows (16 rows of 2 NC bytes a
// step; 8-row groups 16 NC bytes apart; swizzle mode 128-byte (1) or 64-byte (2); the leading
// offset, to a next swizzle atom along n, is the tile's size: there is none).
template <int NC>
__device__ __forceinline__ u64 cw_wg_desc(const u16* tile, int kk, int rows) {
    const u64 a = tc_smem(tile + kk * 16 * NC);
    return ((a & 0x3FFFF) >> 4) | ((u64)(rows * 2 * NC >> 4) << 16) | ((u64)(16 * NC >> 4) << 32) |
           ((NC == 64 ? 1ull : 2ull) << 62);
}

// d += A B over K k16 steps as one committed wgmma group, waited for: A this warp's fragments
// `a`, B the hi / lo tiles of `rows` rows.
template <int NC, int K>
__device__ __forceinline__ void cw_wg_product(float* d, const CwA (&a)[K], const u16* hi, const u16* lo, int rows) {
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < K; kk++) cw_wg_mma3<NC>(d, a[kk], cw_wg_desc<NC>(hi, kk, rows), cw_wg_desc<NC>(lo, kk, rows));
    wg_commit();
    wg_wait<0>();
}

template <int NC>
__device__ __forceinline__ void cw_scan_wg_body(Tensor out, Tensor state, Tensor slots, int h_k, int grouped,
                                                const u32* wf, const u32* pf, const float* uf, const float* gm,
                                                const u32* qf, const u32* ktf, Tensor offsets, const int* table,
                                                u64 err) {
    static_assert(NC == 32 || NC == 64, "one swizzle atom of B columns");
    constexpr int J = NC / 8, R = NC / 2;  // column tiles; accumulators a thread
    extern __shared__ __align__(16) u8 cw_wg_raw[];
    // 1024-byte aligned for the swizzle (the host's size has room for it)
    u16* s_hi = (u16*)(cw_wg_raw + ((1024 - (tc_smem(cw_wg_raw) & 1023)) & 1023));
    u16* s_lo = s_hi + CW_D * NC;  // S: keys x the block's columns
    u16* v_hi = s_lo + CW_D * NC;  // V_new: tokens x columns
    u16* v_lo = v_hi + CW_C * NC;
    u16* vs_hi = v_lo + CW_C * NC;  // exp(gamma_last - gamma) V_new
    u16* vs_lo = vs_hi + CW_C * NC;
    CwScan sc;
    if (!sc.init(out, state, slots, h_k, grouped, offsets, table, err, vs_lo + CW_C * NC)) return;
    const int tid = threadIdx.x, lane = tid & 31, wg = tid >> 7, w = (tid >> 5) & 3, g8 = lane >> 2, t4 = lane & 3;
    const int col0 = blockIdx.x * NC, key0 = 64 * wg + 16 * w + g8;
    // accumulator element 4 j + e: row (16 w + g8 + 8 (e >> 1)) of the group's 64, column 8 j + 2 t4 + (e & 1)

    char* sbase = state.data + sc.h * state.nb[2] + sc.slot * state.nb[3];
    float st[R];
#pragma unroll
    for (int i = 0; i < R; i++) {
        const int key = key0 + 8 * ((i >> 1) & 1), col = col0 + 8 * (i >> 2) + 2 * t4 + (i & 1);
        st[i] = *(const float*)(sbase + col * state.nb[1] + key * state.nb[0]);
    }

    // Warpgroup 0 issues the copies: after the chunk's second barrier it has the S update only,
    // where warpgroup 1 also has P V_new and the outputs. (Group 1's copy waits return at once;
    // the block barriers after group 0's make the tiles visible to both.)
    if (wg == 0) sc.copy_chunk(0, wf, pf, gm, qf, ktf, tid, 128);
    for (i64 ci = 0; ci < sc.nch; ci++) {
        const i64 vch = sc.vch(ci);
        const float* gv = sc.gsm + (ci & 1) * 2 * CW_C;
        const uint4* kbuf = sc.ksm + (ci & 1) * 32 * 64;
        const uint4* pbuf = sc.psm + (ci & 1) * 10 * 64;
        float4 u[J];
        if (wg == 0) {
#pragma unroll
            for (int j = 0; j < J; j++) u[j] = *(const float4*)(uf + ((vch * 4 + w) * 16 + col0 / 8 + j) * 128 + lane * 4);
        }
#pragma unroll
        for (int j = 0; j < J; j++)
#pragma unroll
            for (int r = 0; r < 2; r++)
                cw_wg_put<NC>(s_hi, s_lo, key0 + 8 * r, 8 * j + 2 * t4, st[4 * j + 2 * r], st[4 * j + 2 * r + 1]);
        tc_fence_async();
        tc_wait<1>();  // W, Q and the decays of this chunk
        __syncthreads();

        // X = W S (group 0) or Y = Q S (group 1): this warp's token rows 16 w.. of A.
        float acc[R];
#pragma unroll
        for (int i = 0; i < R; i++) acc[i] = 0.0f;
        {
            const u32* at = (const u32*)((wg == 0 ? sc.wsm : sc.qsm) + w * 8 * 64);
            CwA a[8];
#pragma unroll
            for (int kk = 0; kk < 8; kk++) a[kk] = cw_a_load(at + kk * CW_TILE, lane);
            cw_wg_product<NC>(acc, a, s_hi, s_lo, CW_D);
        }
        if (wg == 0) {
#pragma unroll
            for (int j = 0; j < J; j++)
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    const int tok = 16 * w + g8 + 8 * r, n = 8 * j + 2 * t4, i = 4 * j + 2 * r;
                    const float u0 = r ? u[j].z : u[j].x, u1 = r ? u[j].w : u[j].y;
                    const float v0 = u0 - acc[i], v1 = u1 - acc[i + 1], d = gv[CW_C + tok];
                    cw_wg_put<NC>(v_hi, v_lo, tok, n, v0, v1);
                    cw_wg_put<NC>(vs_hi, vs_lo, tok, n, v0 * d, v1 * d);
                }
        }
        tc_fence_async();
        tc_wait<0>();  // P and K^T of this chunk
        __syncthreads();
        // W, Q and decay buffer (ci + 1) & 1 were last read before the barrier, P and K^T buffer
        // (ci + 1) & 1 in chunk ci - 1.
        if (wg == 0 && ci + 1 < sc.nch) sc.copy_chunk(ci + 1, wf, pf, gm, qf, ktf, tid, 128);
        if (wg == 1) {
            // O = exp(gamma) Y + P V_new (P is zero right of its diagonal tiles)
#pragma unroll
            for (int i = 0; i < R; i++) acc[i] *= gv[16 * w + g8 + 8 * ((i >> 1) & 1)];
            CwA p[4];
#pragma unroll
            for (int kk = 0; kk < 4; kk++) {
                if (kk <= w) {
                    p[kk] = cw_a_load((const u32*)(pbuf + (w * (w + 1) / 2 + kk) * 64), lane);
                } else {
#pragma unroll
                    for (int e = 0; e < 4; e++) p[kk].h[e] = p[kk].l[e] = 0u;
                }
            }
            cw_wg_product<NC>(acc, p, v_hi, v_lo, CW_C);
#pragma unroll
            for (int i = 0; i < R; i++) {
                const i64 tok = ci * CW_C + 16 * w + g8 + 8 * ((i >> 1) & 1);
                const int col = col0 + 8 * (i >> 2) + 2 * t4 + (i & 1);
                if (tok < sc.len) *(float*)(out.data + offset_of(out, col, sc.h, sc.base + tok, sc.so)) = acc[i];
            }
        }
        // S <- exp(gamma_last) S + K^T (exp(gamma_last - gamma) V_new), this group's 64 keys
        const float el = gv[CW_C - 1];
#pragma unroll
        for (int i = 0; i < R; i++) st[i] *= el;
        {
            CwA a[4];
#pragma unroll
            for (int kk = 0; kk < 4; kk++) a[kk] = cw_a_load((const u32*)(kbuf + ((4 * wg + w) * 4 + kk) * 64), lane);
            cw_wg_product<NC>(st, a, vs_hi, vs_lo, CW_C);
        }
    }

#pragma unroll
    for (int i = 0; i < R; i++) {
        const int key = key0 + 8 * ((i >> 1) & 1), col = col0 + 8 * (i >> 2) + 2 * t4 + (i & 1);
        *(float*)(sbase + col * state.nb[1] + key * state.nb[0]) = st[i];
    }
}

#define CW_SCAN_WG_KERNEL(name, NC)                                                                             \
    extern "C" __global__ void __launch_bounds__(256, 1)                                                      \
        name(Tensor out, Tensor state, Tensor slots, int h_k, int grouped, const u32* wf, const u32* pf,      \
             const float* uf, const float* gm, const u32* qf, const u32* ktf, Tensor offsets,                 \
             const int* table, u64 err) {                                                                     \
        grid_begin();                                                                                         \
        cw_scan_wg_body<NC>(out, state, slots, h_k, grouped, wf, pf, uf, gm, qf, ktf, offsets, table, err);  \
    }
CW_SCAN_WG_KERNEL(gdn_cw_scan_wg, 64)
CW_SCAN_WG_KERNEL(gdn_cw_scan_wg32, 32)
#endif
