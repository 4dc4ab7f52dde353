// attention_prefill.cu: flash_attn_ext's prefill on tensor cores (semantics: attention.cuh).
//
// `fa_mma_*`: f16/bf16 K/V with d_k = d_v = D (128 or 256). A block takes FT_BM = 64 tokens of
// one query head and walks the kv positions in tiles of FT_BN = 64: S = Q K^T and O += P V on
// tensor cores (Q and P rounded to the K/V type, f32 accumulators), with the online softmax on
// the S fragments in f32 (a row's max may lag its logits by up to FT_STALE). Two product paths
// (`ft_scores`, `ft_pv`): wgmma on sm_90a, mma.sync elsewhere; each group of 4 warps holds the
// block's 64 rows (16 a warp). On sm_90a a block may be two such groups (blockDim.x = 256, the
// host's choice), each walking half of the block's kv tiles with its own K, V and mask tiles,
// merged at the end (`ft_merge_groups`); or (`fa_mma_pair_*`, 384 threads) two query heads of
// one kv head, each consumer group the same 64 tokens of its own head, both reading one K, V and
// mask tile set that a third, producer group copies once for both, two stages deep on mbarriers.
// A tile's K and V rows (through the block table when paged; each
// row's offsets looked up once a tile) are copied into shared memory with 16-byte cp.async,
// overlapping the tensor cores (the schedules are at the loops). An f16 mask with 16-byte aligned
// rows is staged in shared memory too (FT_BN columns of the block's 64 rows, read by the
// softmax); other masks are read from global memory. With a mask, the block first finds its last
// tile that any of its rows can see (`ft_mask_stop`), so a causal mask's upper triangle costs
// neither copies nor tensor-core work. The output leaves through the K and V tiles in 16-byte row
// pieces. Dynamic shared memory: the Q tile (a head pair's two), then each tile set's K and V
// tiles (64 x D halves, laid out for the path: `ft_at`) and mask tile (FT_BM * FT_MLD halves):
// one set a group, or a head pair's two stages. TAG(fa-mma-tile)
//
// Ragged: a block takes 64 tokens of one sequence of at least `l_min` tokens (tile x counts such
// sequences' ceil(L / 64) tiles in order: the first warp finds this block's by a running scan)
// and stops at the last position its last token sees; logits past each row's own last position
// are -inf (the causal rule, on the fly: no mask needed). Blocks past the last tile zero the
// padding tokens' rows (the host launches one spare tile row so that there are some).

#define FT_BM 64
#define FT_BN 64
#define FT_NO_CELL 0xFFFFFFFFu  // a row offset for a position without a K/V row (past j_stop)
#define FT_MLD 72  // halves between the mask tile's rows (144 bytes: a fragment's 32 reads hit 32 banks)

// Waits for the threads that share warp group `wg`'s tiles: its 128 (named barrier 1 + wg; 0 is
// __syncthreads), or with PAIR both groups' 256 (barrier 1).
template <bool PAIR>
__device__ __forceinline__ void ft_group_sync(int wg) {
    if (PAIR) asm volatile("bar.sync 1, 256;" ::: "memory");
    else asm volatile("bar.sync %0, 128;" ::"r"(1 + wg) : "memory");
}
// 2^x as one ex2.approx (2 ulp; results below 2^-126 flush to 0, which a softmax sum of at least
// 1 cannot see): a probability is one multiply-add into base-2 units and this; CUDA's expf added
// range reduction.
#define FT_LOG2E 1.4426950408889634f
#define FT_STALE 5.5451774f  // 8 ln 2: how far a row's logits may pass its running max before it moves
__device__ __forceinline__ float ft_exp2(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FT_WGMMA 1
#endif

#ifdef FT_WGMMA
#define FT_WG 2
// the warpgroups' register split in a head pair (`setmaxnreg`)
#define FT_PRODUCER_REGS 56
#define FT_CONSUMER_REGS 224
// On sm_90a each warpgroup of the block (4 warps) runs both products as wgmma: S = Q K^T as
// m64n64k16 steps with Q and K read from shared memory, O += P V as m64nDk16 steps with P from
// registers (the S fragments, rounded) and V read from shared memory transposed. The tensor
// cores read each K and V value once for the block's 64 rows, where mma.sync's ldmatrix read it
// once per warp; and the loads and their latencies leave the instruction stream. Tiles are D / 64
// sub-tiles of ROWS rows of 128 bytes with wgmma's 128-byte swizzle (common.cuh), 1024-byte aligned.
constexpr int ft_tile_halves(int rows, int d) { return rows * d; }
template <int ROWS, int D>
__device__ __forceinline__ constexpr int ft_at(int r, int c) {
    return (c >> 6) * (ROWS * 64) + r * 64 + ((((c >> 3) ^ r) & 7) << 3) + (c & 7);
}

#define FT_WG_SS(T)                                                                                            \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                         \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." T "." T " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n" \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])                                                                                    \
                 : "l"(a), "l"(b), "r"(accumulate)                                                              \
                 : "memory")

#define FT_WG_RS128(T)                                                                                     \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                                         \
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." T "." T " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n" \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])                                                                                     \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(1)                                      \
                 : "memory")

#define FT_WG_RS256(T)                                                                                     \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"                                                         \
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32." T "." T " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n" \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])                                                                                     \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(1)                                      \
                 : "memory")


// A group's operand tiles as wgmma descriptors, made once before the kv loop: a product's steps
// add constants to them (a descriptor's start address counts 16-byte units).
struct FtTiles {
    u64 q, k, v;
};
__device__ __forceinline__ FtTiles ft_tiles(const u16* sQ, const u16* sK, const u16* sV) {
    return {wg_desc(sQ), wg_desc(sK), wg_desc_mn(sV, FT_BN * 128)};
}
// sc = the block's S tile (Q K^T; this thread's fragments of its warp's 16 rows, as mma.sync's).
template <int DT, int D>
__device__ __forceinline__ void ft_scores(float (&sc)[FT_BN / 8][4], const FtTiles& t, int, int) {
    float* d = &sc[0][0];
    wg_fence();
#pragma unroll
    for (int ks = 0; ks < D / 16; ks++) {
        // k step ks: sub-tile ks / 4 (64 x 64 halves), 16 columns (32 bytes) each step within it
        const u64 step = (ks >> 2) * (64 * 64 * 2 / 16) + (ks & 3) * 2, a = t.q + step, b = t.k + step;
        const int accumulate = ks > 0;
        if (DT == DT_BF16) FT_WG_SS("bf16");
        else FT_WG_SS("f16");
    }
    wg_commit();
    wg_wait<0>();
}
// o += P V for the tile, P the rounded probabilities `sc`.
template <int DT, int D>
__device__ __forceinline__ void ft_pv(float (&o)[D / 8][4], const float (&sc)[FT_BN / 8][4], const FtTiles& t, int) {
    float* d = &o[0][0];
    // every fragment packed before the fence (a register written between two wgmmas makes ptxas
    // serialize them)
    u32 p[FT_BN / 16][4];
#pragma unroll
    for (int kk = 0; kk < FT_BN / 16; kk++) {
        p[kk][0] = ft_pack<DT>(sc[2 * kk][0], sc[2 * kk][1]);
        p[kk][1] = ft_pack<DT>(sc[2 * kk][2], sc[2 * kk][3]);
        p[kk][2] = ft_pack<DT>(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
        p[kk][3] = ft_pack<DT>(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
    }
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < FT_BN / 16; kk++) {
        const u32* a = p[kk];
        const u64 b = t.v + kk * (16 * 64 * 2 / 16);  // 16 k rows of 128 bytes a step
        if (D == 256) {
            if (DT == DT_BF16) FT_WG_RS256("bf16");
            else FT_WG_RS256("f16");
        } else {
            if (DT == DT_BF16) FT_WG_RS128("bf16");
            else FT_WG_RS128("f16");
        }
    }
    wg_commit();
    wg_wait<0>();
}
#else
#define FT_WG 1
// Elsewhere each warp runs mma.sync m16n8k16 on its 16 rows, operands through ldmatrix from tiles
// of ROWS rows padded by FT_PAD halves (bank-conflict free); the block is one group of 4 warps.
constexpr int ft_tile_halves(int rows, int d) { return rows * (d + FT_PAD); }
template <int ROWS, int D>
__device__ __forceinline__ constexpr int ft_at(int r, int c) {
    return r * (D + FT_PAD) + c;
}
// The group's operand tiles (mma.sync reads them through ldmatrix).
struct FtTiles {
    const u16 *q, *k, *v;
};
__device__ __forceinline__ FtTiles ft_tiles(const u16* sQ, const u16* sK, const u16* sV) { return {sQ, sK, sV}; }
// sc = this warp's 16 rows of S = Q K^T for the tile.
template <int DT, int D>
__device__ __forceinline__ void ft_scores(float (&sc)[FT_BN / 8][4], const FtTiles& t, int warp, int lane) {
    constexpr int LD = D + FT_PAD;
    const u16 *sQ = t.q, *sK = t.k;
#pragma unroll
    for (int n = 0; n < FT_BN / 8; n++) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.0f;
#pragma unroll 4
    for (int kk = 0; kk < D; kk += 16) {
        u32 a[4];
        tc_ldsm4(a, &sQ[(warp * 16 + (lane & 15)) * LD + kk + (lane >> 4) * 8]);
#pragma unroll
        for (int n = 0; n < FT_BN / 8; n += 2) {
            u32 b[4];
            tc_ldsm4(b, &sK[(n * 8 + (lane & 7) + (lane >> 4) * 8) * LD + kk + ((lane >> 3) & 1) * 8]);
            ft_mma<DT>(sc[n], a, b[0], b[1]);
            ft_mma<DT>(sc[n + 1], a, b[2], b[3]);
        }
    }
}
// o += P V for this warp's 16 rows, P the rounded probabilities `sc`.
template <int DT, int D>
__device__ __forceinline__ void ft_pv(float (&o)[D / 8][4], const float (&sc)[FT_BN / 8][4], const FtTiles& t, int lane) {
    constexpr int LD = D + FT_PAD;
    const u16* sV = t.v;
#pragma unroll
    for (int kk = 0; kk < FT_BN / 16; kk++) {
        const u32 a[4] = {ft_pack<DT>(sc[2 * kk][0], sc[2 * kk][1]), ft_pack<DT>(sc[2 * kk][2], sc[2 * kk][3]),
                          ft_pack<DT>(sc[2 * kk + 1][0], sc[2 * kk + 1][1]), ft_pack<DT>(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
#pragma unroll
        for (int n = 0; n < D / 8; n += 2) {
            u32 b[4];
            tc_ldsm4_trans(b, &sV[(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + n * 8 + (lane >> 4) * 8]);
            ft_mma<DT>(o[n], a, b[0], b[1]);
            ft_mma<DT>(o[n + 1], a, b[2], b[3]);
        }
    }
}
#endif

// Copies query rows first .. first + rows - 1 of the tile into sQ (D halves a row; element (r, c)
// at sQ[ft_at<ROWS, D>(r, c)]), rounded to the K/V type, with THREADS threads: row r is f32 at
// `q0 + r * nb1` with element stride nb0 (float4 loads where nb0 == 4 and the rows are 16-byte
// aligned), or zeros from row `valid` on. A thread keeps one 4-column piece and steps its row
// pointer (no address arithmetic a value), and issues a batch of loads before it stores
// any of them, so that one memory latency covers the round; `WHOLE` (a head pair's consumers,
// whose registers are free until the kv walk) takes the group's rows in one round.
template <int DT, int ROWS, int D, int THREADS, bool WHOLE>
__device__ __forceinline__ void ft_load_q(u16* sQ, const char* q0, i64 nb0, i64 nb1, int valid, int first, int rows,
                                          int tid) {
    constexpr int PIECES = D / 4, STEP = THREADS / PIECES;
#ifdef FT_WGMMA
    // a group's whole tile in one round (a pair's consumers: 32 loads a thread at D = 256), or a
    // two-group share: 16 loads a thread at D = 256, 8 at D = 128
    constexpr int BATCH = WHOLE ? ROWS / STEP : ROWS / 2 / STEP;
#else
    constexpr int BATCH = 8;  // (16 spill on mma.sync's register budget)
#endif
    static_assert(THREADS % PIECES == 0, "whole rows a pass");
    const int c = tid % PIECES * 4, per = rows / STEP;  // the caller's rows: whole batches a thread
    int r = first + tid / PIECES;
    const char* p = q0 + (i64)r * nb1 + (i64)c * nb0;
    const i64 step = (i64)STEP * nb1;
    const bool vec = nb0 == 4 && ((unsigned long long)q0 & 15) == 0 && (nb1 & 15) == 0;
#pragma unroll 1
    for (int b0 = 0; b0 < per; b0 += BATCH) {
        float4 x[BATCH];
#pragma unroll
        for (int i = 0; i < BATCH; i++) {
            const char* pi = p + i * step;
            x[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (r + i * STEP < valid) {
                if (vec) {
                    x[i] = *(const float4*)pi;
                } else {
                    x[i] = make_float4(*(const float*)pi, *(const float*)(pi + nb0), *(const float*)(pi + 2 * nb0),
                                       *(const float*)(pi + 3 * nb0));
                }
            }
        }
#pragma unroll
        for (int i = 0; i < BATCH; i++) {
            *(uint2*)&sQ[ft_at<ROWS, D>(r + i * STEP, c)] =
                make_uint2(ft_pack<DT>(x[i].x, x[i].y), ft_pack<DT>(x[i].z, x[i].w));
        }
        r += BATCH * STEP;
        p += BATCH * step;
    }
}

#if FT_WG == 2
// The end of a two-group block: group 1 hands its softmax state (max, sum and O of the same rows
// and columns, thread for thread) to group 0 through `so`, its own K and V tiles (free once its
// last products were waited for), and returns false; group 0 merges it into its own and returns
// true.
template <int D>
__device__ __forceinline__ bool ft_merge_groups(float (&o)[D / 8][4], float (&m)[2], float (&l)[2], float* so, int wg, int gt) {
    __shared__ float s_ml[4][128];
    __syncthreads();
    if (wg == 1) {
        s_ml[0][gt] = m[0], s_ml[1][gt] = m[1], s_ml[2][gt] = l[0], s_ml[3][gt] = l[1];
#pragma unroll
        for (int n = 0; n < D / 8; n++) *(float4*)&so[(n * 128 + gt) * 4] = make_float4(o[n][0], o[n][1], o[n][2], o[n][3]);
    }
    __syncthreads();
    if (wg == 1) return false;
#pragma unroll
    for (int rr = 0; rr < 2; rr++) {
        const float m1 = s_ml[rr][gt], l1 = s_ml[2 + rr][gt], mx = fmaxf(m[rr], m1);
        const float ms = mx == -TS_INF ? 0.0f : mx, a0 = exp2f((m[rr] - ms) * FT_LOG2E), a1 = exp2f((m1 - ms) * FT_LOG2E);
        l[rr] = l[rr] * a0 + l1 * a1;
        m[rr] = mx;
#pragma unroll
        for (int n = 0; n < D / 8; n++) {
            const float2 x = *(const float2*)&so[(n * 128 + gt) * 4 + 2 * rr];
            o[n][2 * rr] = o[n][2 * rr] * a0 + x.x * a1;
            o[n][2 * rr + 1] = o[n][2 * rr + 1] * a0 + x.y * a1;
        }
    }
    return true;
}
#endif

// The end of the kv positions a prefill block needs under a mask: past the last tile that any
// of its rows (tokens t0 .. t_end) sees, tiles are all -inf (a causal mask's upper triangle) and
// cost nothing. A NaN counts as seen (it reaches the output). Call with the whole block: every
// thread scans, from the last tile down, 1 tile in the first pass, then 2, 4, 8 and 16 (each
// thread's loads of a pass all issued before any is tested: one memory latency a pass, where a
// block near the start of a causal prefill has most of the tiles to scan, and a mask that sees
// the last tile costs one tile's loads), then one barrier a tile of the pass, from the last,
// until one was seen. Tile 0 is always kept. `mstage`: an f16 mask with 16-byte aligned rows,
// read in pieces of 8 values.
__device__ __forceinline__ int ft_mask_stop(const Tensor& mask, int mdt, i64 m_seq, bool mstage, int t0, int t_end, int j_stop) {
    constexpr int PIECES = FT_BM * FT_BN / 8;  // a tile's 8-value pieces
    const int tid = threadIdx.x;
    int last = (j_stop + FT_BN - 1) / FT_BN - 1;
    for (int pass = 1; last > 0; pass = min(2 * pass, 16)) {
        const int lo = max(1, last - pass + 1);
        u32 seen = 0;  // bit i: tile last - i
        if (mstage) {
            // -inf is 0xFC00; a NaN is any other pattern
#pragma unroll 8
            for (int idx = tid; idx < (last - lo + 1) * PIECES; idx += blockDim.x) {
                const int i = idx / PIECES, e8 = idx % PIECES;
                const int t = t0 + e8 / (FT_BN / 8), j = (last - i) * FT_BN + e8 % (FT_BN / 8) * 8;
                if (t < t_end && j < j_stop) {
                    const uint4 x = *(const uint4*)(mask.data + (i64)j * 2 + (i64)t * mask.nb[1] + m_seq);
                    const u32 w[4] = {x.x, x.y, x.z, x.w};
                    bool any = false;
#pragma unroll
                    for (int e = 0; e < 8; e++) any |= j + e < j_stop && (u16)(w[e / 2] >> (16 * (e % 2))) != 0xFC00u;
                    seen |= (u32)any << i;
                }
            }
        } else {
#pragma unroll 8
            for (int idx = tid; idx < (last - lo + 1) * FT_BM * FT_BN; idx += blockDim.x) {
                const int i = idx / (FT_BM * FT_BN), e = idx % (FT_BM * FT_BN);
                const int t = t0 + e / FT_BN, j = (last - i) * FT_BN + e % FT_BN;
                if (t < t_end && j < j_stop) {
                    seen |= (u32) !(load_f32(mask.data + (i64)j * mask.nb[0] + (i64)t * mask.nb[1] + m_seq, mdt) == -TS_INF) << i;
                }
            }
        }
        int i = 0;
        for (; i <= last - lo; i++) {
            if (__syncthreads_or((seen >> i) & 1u)) break;
        }
        if (i <= last - lo) return min(j_stop, (last - i + 1) * FT_BN);
        last = lo - 1;
    }
    return min(j_stop, FT_BN);
}

template <int DT, int D, bool PAIR>
__device__ __forceinline__ void fa_mma_impl(Tensor q, Tensor k, Tensor v, Tensor mask, Tensor table, Tensor offsets,
                                            Tensor kv_lens, Tensor out, Tensor gate, int mdt, int has_mask, int paged,
                                            float scale, float softcap, int l_min, u64 err, u32 opcode) {
    extern __shared__ __align__(16) u16 ft_smem[];
    // per slot (two a group's tile set, one a tile in flight; a pair's one a stage): each
    // position's K row offset, then its V row offset, in 16-byte units from the head's first row
    // (the host keeps them below 2^32 - 1), or FT_NO_CELL; and whether warp 0 / 1's 32 cells hold
    // a -1
    __shared__ __align__(8) u32 s_off[2 * FT_WG][2 * FT_BN];
    __shared__ int s_gap[2 * FT_WG][2];
    __shared__ int s_work[3];
#ifdef FT_WGMMA
    // 1024-byte aligned by pointer arithmetic, so that accesses stay shared-space ones (the
    // unpadded tiles leave room for it in the host's size, which the padded ones fill)
    u16* sQ = ft_smem + ((1024 - (tc_smem(ft_smem) & 1023)) & 1023) / 2;
#else
    u16* sQ = ft_smem;
#endif
    // Q, then each tile set's K, V and mask tiles (blockDim.x / 128 groups, at most FT_WG; with
    // PAIR two consumer groups, each its own Q tile, and the producer group: one tile set, two
    // stages)
    const int groups = (int)blockDim.x >> 7;
    // wg through a shuffle from lane 0: the compiler then knows it is warp-uniform, and keeps the
    // tiles' addresses and wgmma descriptors in uniform registers
    const int tid = threadIdx.x, wg = __shfl_sync(0xffffffffu, tid >> 7, 0), gt = tid & 127, lane = tid & 31,
              warp = (tid >> 5) & 3;
    const int g = lane >> 2, tq = lane & 3;
    constexpr int GROUP_HALVES = 2 * ft_tile_halves(FT_BN, D) + FT_BM * FT_MLD;
    const int ts = PAIR ? 0 : wg;  // this group's tile set (a pair's one, copied by its producer group)
    __shared__ __align__(8) u64 s_bar[4];  // a pair's full[2], empty[2]
    const u32 full0 = tc_smem(&s_bar[0]), empty0 = tc_smem(&s_bar[2]);
    u16* const sQ0 = sQ;
    if (PAIR) sQ += wg * ft_tile_halves(FT_BM, D);
    u16* sK = sQ0 + (PAIR ? 2 : 1) * ft_tile_halves(FT_BM, D) + ts * GROUP_HALVES;
    u16* sV = sK + ft_tile_halves(FT_BN, D);
    u16* sM = sV + ft_tile_halves(FT_BN, D);

    const int n_tokens = (int)q.ne[1], n_head = (int)q.ne[2];
    const int n_cells = (int)k.ne[1], n_head_kv = (int)k.ne[2];
    const int n_kv = paged ? (int)table.ne[0] : n_cells;
    // Dense: the grid's blocks in launch order take every head's last token tile first, then
    // every head's next-to-last, ...: under a causal mask the tiles that see the most positions
    // start first and the short ones fill the last wave.
    const int lin = (int)(blockIdx.x + gridDim.x * blockIdx.y);
    const int hb = offsets.data ? (int)blockIdx.y : lin % (int)gridDim.y;  // the block's head (pair)
    // Tokens t0 .. t_end (at most 64) of sequence s, in q's slot qs; token t sees positions
    // j <= t + causal (dense: all, causal = n_kv) and the block walks positions 0 .. j_stop.
    int t0 = ((int)gridDim.x - 1 - lin / (int)gridDim.y) * FT_BM, t_end = n_tokens, s = blockIdx.z, qs = blockIdx.z, causal = n_kv, j_stop = n_kv;
    if (offsets.data) {
        if (!fa_ragged_valid(offsets, kv_lens, n_tokens, n_kv, err, opcode)) return;
        const int n_seq = (int)kv_lens.ne[0];
        if (tid < 32) {
            // This block's (sequence, tile) among the tiles of the sequences it takes, in order.
            int base = 0;
            for (int s0 = 0; s0 < n_seq; s0 += 32) {
                const int si = s0 + lane;
                const int len = si < n_seq ? fa_i32(offsets, si + 1) - fa_i32(offsets, si) : 0;
                const int c = len >= l_min ? (len + FT_BM - 1) / FT_BM : 0;
                int x = c;
#pragma unroll
                for (int d = 1; d < 32; d <<= 1) {
                    const int y = __shfl_up_sync(0xffffffffu, x, d);
                    if (lane >= d) x += y;
                }
                const int first = base + x - c;
                if ((int)blockIdx.x >= first && (int)blockIdx.x < first + c) {
                    s_work[0] = si;
                    s_work[1] = (int)blockIdx.x - first;
                }
                base += __shfl_sync(0xffffffffu, x, 31);
            }
            if (lane == 0) s_work[2] = base;
        }
        __syncthreads();
        qs = 0;
        if ((int)blockIdx.x >= s_work[2]) {
            // A spare block: zero the rows of padding tokens (before offsets[0], from offsets[n_seq]).
            const int lead = fa_i32(offsets, 0), tail = fa_i32(offsets, n_seq);
            const i64 rows = (i64)(lead + n_tokens - tail) * n_head;
            const i64 spare = (i64)(gridDim.x - s_work[2]) * gridDim.y;
            for (i64 r = (i64)(blockIdx.x - s_work[2]) * gridDim.y + hb; r < rows; r += spare) {
                const int tp = (int)(r / n_head), hr = (int)(r % n_head), t = tp < lead ? tp : tail + (tp - lead);
                for (int e = tid; e < (int)out.ne[0]; e += blockDim.x) fa_store(out, gate, e, hr, t, 0, 0.0f);
            }
            return;
        }
        s = s_work[0];
        const int o = fa_i32(offsets, s), len = fa_i32(offsets, s + 1) - o;
        t0 = o + s_work[1] * FT_BM;
        t_end = min(o + len, t0 + FT_BM);
        causal = fa_i32(kv_lens, s) - len - o;  // token t's last position is t + causal
        j_stop = t_end + causal;                // <= kv_lens[s] <= n_kv
    }
    // (a pair's producer, group 2, takes the second head's: both heads read one kv head, the
    // host's condition)
    const int h = PAIR ? 2 * hb + min(wg, 1) : hb, hk = h / (n_head / n_head_kv);
    const i64 ks = paged ? 0 : s;
    const char* kbase = k.data + hk * k.nb[2] + ks * k.nb[3];
    const char* vbase = v.data + hk * v.nb[2] + ks * v.nb[3];
    const i64 m_seq = has_mask ? (qs % mask.ne[3]) * mask.nb[3] : 0;
    const float inner = softcap > 0.0f ? scale / softcap : 0.0f;
    // the mask goes through shared memory when it is f16 with 16-byte aligned rows of whole pieces
    const bool mstage = has_mask && mdt == DT_F16 && mask.nb[0] == 2 && (mask.nb[1] & 15) == 0 &&
                        ((u64)(mask.data + m_seq) & 15) == 0 && (mask.ne[0] & 7) == 0;

    // the row offsets of positions j0 .. j0 + 63 (FT_NO_CELL past j_stop; an out-of-range table
    // entry is reported and reads as FT_NO_CELL too)
    const u64 k_nb16 = (u64)k.nb[1] >> 4, v_nb16 = (u64)v.nb[1] >> 4;  // 16-byte aligned rows (host)
    auto find_cells = [&](int j0, int slot) {
        u32* offs = s_off[slot];
        if (gt < FT_BN) {
            const int j = j0 + gt;
            int cell = -1;
            if (j < j_stop) {
                const int raw = paged ? *(const int*)(table.data + (i64)j * table.nb[0] + (i64)s * table.nb[1]) : j;
                if (raw < 0 || raw >= n_cells) {
                    report_error((ErrorRecord*)err, ERR_INDEX_OUT_OF_RANGE, WHAT_KV_CELL, opcode, raw, n_cells, 0, 0);
                } else {
                    cell = raw;
                }
            }
            offs[gt] = cell < 0 ? FT_NO_CELL : (u32)((u64)cell * k_nb16);
            offs[FT_BN + gt] = cell < 0 ? FT_NO_CELL : (u32)((u64)cell * v_nb16);
            const bool gap = __any_sync(0xffffffffu, cell < 0);
            if (lane == 0) s_gap[slot][gt >> 5] = gap;
        }
    };
    // copies the tile's rows of K or V (zeros for FT_NO_CELL) into dst with one group: a thread
    // takes the same two 16-byte pieces (c8 and c8 + D / 16 of the row's D / 8) of every RPP-th
    // row, so that one shared-memory address serves all its rows plus constants, and a row's
    // source address is one offset read and a multiply-add
    auto copy_rows = [&](u16* dst, const char* base, const u32* offs) {
        constexpr int HALF = D / 16, RPP = 128 / HALF;
        constexpr int ROW_STEP = 2 * (ft_at<FT_BN, D>(RPP, 0) - ft_at<FT_BN, D>(0, 0));  // bytes, RPP rows on
        constexpr int SECOND = 2 * (ft_at<FT_BN, D>(0, D / 2) - ft_at<FT_BN, D>(0, 0));   // bytes, D / 2 columns on
        const int c8 = gt % HALF, r0 = gt / HALF;
        const u32 d0 = tc_smem(dst) + 2 * ft_at<FT_BN, D>(r0, c8 * 8);
        const char *src = base + c8 * 16, *src2 = src + D;
        // (whole 64-bit registers, so that a row's address is one multiply-add)
        asm("" : "+l"(src), "+l"(src2));
#pragma unroll
        for (int i = 0; i < FT_BN / RPP; i++) {
            const u32 o = offs[r0 + RPP * i];
            const bool ok = o != FT_NO_CELL;
            const u64 at = (u64)(ok ? o : 0) * 16;
            tc_cp16_at(d0 + i * ROW_STEP, src + at, ok);
            tc_cp16_at(d0 + i * ROW_STEP + SECOND, src2 + at, ok);
        }
    };
    // copies the mask's columns j0 .. j0 + 63 of the block's rows into dst with one group: a
    // thread takes the same 8 columns of every 16th row
    auto copy_mask = [&](int j0, u16* dst) {
        constexpr int PIECES = FT_BN / 8, RSTEP = 128 / PIECES;
        const int c = gt % PIECES * 8, r0 = gt / PIECES, j = j0 + c;
        const u32 d0 = tc_smem(dst + r0 * FT_MLD + c);
        const char* p = mask.data + m_seq + (i64)j * 2 + (i64)(t0 + r0) * mask.nb[1];
        const i64 step = (i64)RSTEP * mask.nb[1];
        const bool in_cols = j < (int)mask.ne[0];
#pragma unroll
        for (int i = 0; i < FT_BM / RSTEP; i++) {
            const bool ok = in_cols && t0 + r0 + i * RSTEP < t_end;
            tc_cp16_at(d0 + i * RSTEP * FT_MLD * 2, ok ? p + i * step : mask.data, ok);
        }
    };

    // the first tile's copies fly while the mask is scanned and Q is loaded (its cells are the
    // same for any j_stop the scan leaves: at least one whole tile); group 0 always takes it (a
    // pair's producer, group 2)
    if (PAIR && tid == 0) {
#ifdef FT_WGMMA
        // full: each producer thread's copies (noinc) and its arrival; empty: every consumer thread
        for (int i = 0; i < 2; i++) mb_init(full0 + 8 * i, 256), mb_init(empty0 + 8 * i, 256);
        mb_fence_init();
#endif
    }
    if (wg == (PAIR ? 2 : 0)) find_cells(0, 0);
    __syncthreads();
    if (wg == (PAIR ? 2 : 0) && j_stop > 0) {
        copy_rows(sK, kbase, s_off[0]);
        if (PAIR) copy_rows(sV, vbase, s_off[0] + FT_BN);
        if (mstage) copy_mask(0, sM);
#ifdef FT_WGMMA
        if (PAIR) mb_arrive_copies(full0), mb_arrive(full0);
#endif
    }
    tc_commit();
    if (has_mask) j_stop = ft_mask_stop(mask, mdt, m_seq, mstage, t0, t_end, j_stop);
    // Two groups of one head split the block's kv tiles: group 0 the first half (rounded up),
    // group 1 the rest; their partial softmax states are merged at the end. A pair's groups both
    // walk all of them.
    const bool split = !PAIR && groups == 2;
    const int n_tiles = (j_stop + FT_BN - 1) / FT_BN, half = split ? (n_tiles + 1) / 2 : n_tiles;
    const int j_begin = wg == 0 || !split ? 0 : half * FT_BN, j_end = wg == 0 || !split ? min(j_stop, half * FT_BN) : j_stop;
    if (split && wg == 1 && j_begin < j_end) {
        find_cells(j_begin, 2);
        ft_group_sync<false>(1);
        copy_rows(sK, kbase, s_off[2]);
        if (mstage) copy_mask(j_begin, sM);
    }
    tc_commit();

    // each group loads its share of the query rows (a pair's groups all of their own head's)
    const int q_rows = split ? FT_BM / 2 : FT_BM;
    if (!PAIR || wg < 2) {
        ft_load_q<DT, FT_BM, D, 128, PAIR>(sQ, q.data + (i64)t0 * q.nb[1] + (i64)h * q.nb[2] + (i64)qs * q.nb[3],
                                           q.nb[0], q.nb[1], t_end - t0, split ? wg * q_rows : 0, q_rows, gt);
    }
#ifdef FT_WGMMA
    tc_fence_async();
#endif
    __syncthreads();  // Q written (each group reads all of it)

    float o[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m[2] = {-TS_INF, -TS_INF}, l[2] = {0.0f, 0.0f};  // the rows' running max (natural units) and sum
    const FtTiles tiles = ft_tiles(sQ, sK, sV);
    const int tok[2] = {t0 + warp * 16 + g, t0 + warp * 16 + g + 8};
    const u16* mrow = sM + (warp * 16 + g) * FT_MLD + 2 * tq;  // this thread's mask values: row g, pair tq

    // Logits and the online-softmax update of tile j0 (rows g and g + 8 of the warp's 16): sc
    // becomes the probabilities, o and l are rescaled where the max moves; `offs` and `gap` are
    // the tile's cells, `mrow` this thread's values of its staged mask.
    auto tile_softmax = [&](float (&sc)[FT_BN / 8][4], int j0, const u32* offs, const int* gap, const u16* mrow) {
        // The softcap and mask choices are uniform branches around whole loops: taken per
        // element, every element inlined tanhf and the mask's dtype switch, and the loop outgrew
        // the instruction cache.
        if (softcap > 0.0f) {
#pragma unroll
            for (int n = 0; n < FT_BN / 8; n++) {
#pragma unroll
                for (int i = 0; i < 4; i++) sc[n][i] = softcap * tanhf(sc[n][i] * inner);
            }
        } else if (!mstage) {
#pragma unroll
            for (int n = 0; n < FT_BN / 8; n++) {
#pragma unroll
                for (int i = 0; i < 4; i++) sc[n][i] *= scale;
            }
        }
        if (mstage) {
            // the scale (without a softcap) folded into the mask's add; rows past t_end were
            // zero-filled, columns past j_stop become -inf below
            const float mul = softcap > 0.0f ? 1.0f : scale;
#pragma unroll
            for (int n = 0; n < FT_BN / 8; n++) {
#pragma unroll
                for (int rr = 0; rr < 2; rr++) {
                    const u32 mm = *(const u32*)&mrow[rr * 8 * FT_MLD + n * 8];
                    sc[n][2 * rr] = fmaf(sc[n][2 * rr], mul, f16_to_f32((u16)mm));
                    sc[n][2 * rr + 1] = fmaf(sc[n][2 * rr + 1], mul, f16_to_f32((u16)(mm >> 16)));
                }
            }
        } else if (has_mask) {
#pragma unroll
            for (int n = 0; n < FT_BN / 8; n++) {
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const int j = j0 + n * 8 + 2 * tq + (i & 1), t = tok[i >> 1];
                    if (j < j_stop && t < t_end) {
                        const float mv = load_f32(mask.data + (i64)j * mask.nb[0] + (i64)t * mask.nb[1] + m_seq, mdt);
                        sc[n][i] += mv;
                    }
                }
            }
        }
        float mx[2] = {-TS_INF, -TS_INF};
        // A tile whose 64 cells are all valid and whose positions every row of the warp sees
        // (all but a causal batch's diagonal tiles) needs no test per logit.
        const bool whole = !gap[0] && !gap[1] && j0 + FT_BN - 1 <= t0 + warp * 16 + causal;
        if (whole) {
            // four independent chains a row (two warps a scheduler hide little dependent latency)
            float m4[2][4];
#pragma unroll
            for (int rr = 0; rr < 2; rr++) {
#pragma unroll
                for (int c = 0; c < 4; c++) m4[rr][c] = fmaxf(sc[2 * c][2 * rr], sc[2 * c][2 * rr + 1]);
#pragma unroll
                for (int c = 0; c < 4; c++) m4[rr][c] = fmaxf(m4[rr][c], fmaxf(sc[2 * c + 1][2 * rr], sc[2 * c + 1][2 * rr + 1]));
                mx[rr] = fmaxf(fmaxf(m4[rr][0], m4[rr][1]), fmaxf(m4[rr][2], m4[rr][3]));
            }
        } else {
#pragma unroll
            for (int n = 0; n < FT_BN / 8; n++) {
                const uint2 cc = *(const uint2*)&offs[n * 8 + 2 * tq];
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const int j = j0 + n * 8 + 2 * tq + (i & 1), rr = i >> 1;
                    const float x = ((i & 1) ? cc.y : cc.x) != FT_NO_CELL && j <= tok[rr] + causal ? sc[n][i] : -TS_INF;
                    sc[n][i] = x;
                    mx[rr] = fmaxf(mx[rr], x);
                }
            }
        }
#pragma unroll
        for (int rr = 0; rr < 2; rr++) {
            mx[rr] = fmaxf(mx[rr], __shfl_xor_sync(0xffffffffu, mx[rr], 1));
            mx[rr] = fmaxf(mx[rr], __shfl_xor_sync(0xffffffffu, mx[rr], 2));
        }
        // The running max moves (and O and l are rescaled) only when some row of the warp sees a
        // logit more than FT_STALE above it: below that the probabilities of a stale max stay
        // under 2^8, which f32 sums and the rounded P hold as well as values under 1, and O's
        // 128 products a thread are skipped on most tiles.
        if (__any_sync(0xffffffffu, mx[0] > m[0] + FT_STALE || mx[1] > m[1] + FT_STALE)) {
            float alpha[2];
#pragma unroll
            for (int rr = 0; rr < 2; rr++) {
                const float m_new = fmaxf(m[rr], mx[rr]);
                alpha[rr] = m_new == -TS_INF ? 1.0f : exp2f((m[rr] - m_new) * FT_LOG2E);
                l[rr] *= alpha[rr];
                m[rr] = m_new;
            }
#pragma unroll
            for (int n = 0; n < D / 8; n++) {
                o[n][0] *= alpha[0];
                o[n][1] *= alpha[0];
                o[n][2] *= alpha[1];
                o[n][3] *= alpha[1];
            }
        }
        const float ms[2] = {m[0] == -TS_INF ? 0.0f : m[0] * FT_LOG2E, m[1] == -TS_INF ? 0.0f : m[1] * FT_LOG2E};
        float ls[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};  // two partial sums a row
#pragma unroll
        for (int n = 0; n < FT_BN / 8; n++) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const float p = ft_exp2(fmaf(sc[n][i], FT_LOG2E, -ms[i >> 1]));
                sc[n][i] = p;
                ls[i >> 1][n & 1] += p;
            }
        }
        l[0] += ls[0][0] + ls[0][1];
        l[1] += ls[1][0] + ls[1][1];
    };

    // The copies overlap the tensor cores, staggered over one K, one V and one mask buffer: V of
    // tile j lands while S of tile j and the softmax are computed, K of tile j + 1 (copied as
    // soon as every warp's S is done) while the softmax and P V of tile j are, and the mask of
    // tile j + 1 during P V; three barriers a tile. (Two buffers of each, all of tile j + 1
    // copied during tile j, left one block a multiprocessor at D = 256 and were slower:
    // docs/perf-log.) Each group walks its tiles with its own buffers and barriers.
    for (int j0 = j_begin, buf = 0; !PAIR && j0 < j_end; j0 += FT_BN, buf ^= 1) {
        const int slot = 2 * ts + buf;
        const u32* offs = s_off[slot];
        tc_wait<0>();
#ifdef FT_WGMMA
        tc_fence_async();  // this thread's copies, before the tensor cores read them
#endif
        ft_group_sync<false>(wg);  // K and the mask of this tile landed; V is free
        copy_rows(sV, vbase, offs + FT_BN);
        tc_commit();
        const bool more = j0 + FT_BN < j_end;
        if (more) find_cells(j0 + FT_BN, slot ^ 1);

        // S = Q K^T for this warp's 16 rows and the tile's 64 keys.
        float sc[FT_BN / 8][4];
        ft_scores<DT, D>(sc, tiles, warp, lane);
        ft_group_sync<false>(wg);  // every warp's S is done (K is free) and the next tile's cells are in
        if (more) copy_rows(sK, kbase, s_off[slot ^ 1]);
        tc_commit();
        tile_softmax(sc, j0, offs, s_gap[slot], mrow);
        tc_wait<1>();  // V of this tile (the next K may still be in flight)
#ifdef FT_WGMMA
        tc_fence_async();
#endif
        ft_group_sync<false>(wg);  // V of this tile landed; every warp is done with the mask and `offs`
        if (more && mstage) copy_mask(j0 + FT_BN, sM);
        tc_commit();
        // O += P V.
        ft_pv<DT, D>(o, sc, tiles, lane);
    }

#ifdef FT_WGMMA
    // A head pair is warp-specialized: group 2 (the producer) looks up each tile's cells and
    // copies its K, V and mask rows into one of two stages, then arrives on the stage's full
    // barrier (its copies' landing counted through cp.async.mbarrier.arrive); groups 0 and 1
    // (the consumers, one head each) wait on it, run the tile, and arrive on the stage's empty
    // barrier, which the producer waits on before it refills the stage. No barrier joins the
    // consumers within the loop, and the producer's registers go to them.
    if (PAIR) {
        constexpr u64 STAGE = GROUP_HALVES * 2 / 16;  // a stage's step in descriptor units
        const int n_tiles = (j_stop + FT_BN - 1) / FT_BN;
        if (wg == 2) {
            asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(FT_PRODUCER_REGS));
            for (int it = 1; it < n_tiles; it++) {
                const int b = it & 1;
                if (it >= 2) mb_wait(empty0 + 8 * b, (u32)((it >> 1) - 1) & 1u);
                find_cells(it * FT_BN, b);
                asm volatile("bar.sync 3, 128;" ::: "memory");  // the tile's cells, to every producer thread
                u16* kb = sK + b * GROUP_HALVES;
                copy_rows(kb, kbase, s_off[b]);
                copy_rows(kb + ft_tile_halves(FT_BN, D), vbase, s_off[b] + FT_BN);
                if (mstage) copy_mask(it * FT_BN, kb + 2 * ft_tile_halves(FT_BN, D));
                mb_arrive_copies(full0 + 8 * b);
                mb_arrive(full0 + 8 * b);
            }
            return;
        }
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(FT_CONSUMER_REGS));
        for (int it = 0; it < n_tiles; it++) {
            const int b = it & 1, j0 = it * FT_BN;
            mb_wait(full0 + 8 * b, (u32)(it >> 1) & 1u);
            tc_fence_async();  // the producer's copies, before the tensor cores read them
            const FtTiles tb = {tiles.q, tiles.k + b * STAGE, tiles.v + b * STAGE};
            float sc[FT_BN / 8][4];
            ft_scores<DT, D>(sc, tb, warp, lane);
            tile_softmax(sc, j0, s_off[b], s_gap[b], mrow + b * GROUP_HALVES);
            ft_pv<DT, D>(o, sc, tb, lane);
            mb_arrive(empty0 + 8 * b);
        }
    }
#endif

#pragma unroll
    for (int rr = 0; rr < 2; rr++) {
        l[rr] += __shfl_xor_sync(0xffffffffu, l[rr], 1);
        l[rr] += __shfl_xor_sync(0xffffffffu, l[rr], 2);
    }
#if FT_WG == 2
    if (split && !ft_merge_groups<D>(o, m, l, (float*)(sQ + ft_tile_halves(FT_BM, D) + GROUP_HALVES), wg, gt)) return;
#endif
    // The output goes through the group's K and V tiles (free once every warp's last P V is done;
    // at least FT_BM x D floats in either layout; a pair's group 1 through both Q tiles, as large):
    // each thread puts its values, times 1 / l, in f32 rows of D whose 8-value chunks are
    // XOR-swizzled by the row (a store's 8 rows meet different banks), then the group writes whole
    // rows, 16 bytes a thread (fa_store4): scattered 4-byte stores, 8 rows an instruction, held the
    // block's end up on the memory pipe.
    float* so = PAIR && wg == 1 ? (float*)sQ0 : (float*)sK;
    ft_group_sync<PAIR>(wg);
#pragma unroll
    for (int rr = 0; rr < 2; rr++) {
        const float inv = m[rr] == -TS_INF ? 0.0f : 1.0f / l[rr];
        const int r = warp * 16 + g + 8 * rr;
#pragma unroll
        for (int n = 0; n < D / 8; n++) {
            *(float2*)&so[r * D + (n ^ (r & 7)) * 8 + 2 * tq] = make_float2(o[n][2 * rr] * inv, o[n][2 * rr + 1] * inv);
        }
    }
    ft_group_sync<PAIR>(wg);
    constexpr int C4 = D / 4, RSTEP = 128 / C4;
    const int c4 = gt % C4, rows = min(FT_BM, t_end - t0);
    const bool vec = fa_rows_vec(out) && fa_rows_vec(gate);
    for (int r = gt / C4; r < rows; r += RSTEP) {
        const float4 x = *(const float4*)&so[r * D + ((c4 >> 1) ^ (r & 7)) * 8 + (c4 & 1) * 4];
        fa_store4(out, gate, vec, c4 * 4, h, t0 + r, qs, x);
    }
}

#define FA_MMA(NAME, DT, D, PAIR)                                                                              \
    extern "C" __global__ void __launch_bounds__(PAIR ? 384 : 128 * FT_WG)                                     \
        NAME(Tensor q, Tensor k, Tensor v, Tensor mask, Tensor table, Tensor offsets, Tensor kv_lens, Tensor out, \
             Tensor gate,                                                                                        \
             int mdt, int has_mask, int paged, float scale, float softcap, int l_min, u64 err, u32 opcode) {     \
        grid_begin();                                                                                            \
        fa_mma_impl<DT, D, PAIR>(q, k, v, mask, table, offsets, kv_lens, out, gate, mdt, has_mask, paged, scale,  \
                                 softcap, l_min, err, opcode);                                                 \
    }

FA_MMA(fa_mma_f16_d128, DT_F16, 128, false)
FA_MMA(fa_mma_f16_d256, DT_F16, 256, false)
FA_MMA(fa_mma_bf16_d128, DT_BF16, 128, false)
FA_MMA(fa_mma_bf16_d256, DT_BF16, 256, false)
#if FT_WG == 2
// Head pairs (sm_90a only: 384 threads, grid y = heads / 2; the host's choice)
FA_MMA(fa_mma_pair_f16_d128, DT_F16, 128, true)
FA_MMA(fa_mma_pair_f16_d256, DT_F16, 256, true)
FA_MMA(fa_mma_pair_bf16_d128, DT_BF16, 128, true)
FA_MMA(fa_mma_pair_bf16_d256, DT_BF16, 256, true)
#endif
