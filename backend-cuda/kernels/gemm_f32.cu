// gemm_f32.cu: mul_mat of f32 weights against more than GEMV_MAX_N tokens on tensor cores, in
// split tf32 (3xTF32). out[m, n] = sum_k a[k, m] b[k, n] for one f32 matrix a [K, M] and f32
// columns b [K, N] whose rows / columns are K contiguous values from 16-byte aligned addresses,
// K % 4 == 0; the host (matmul/gemm_f32.rs) leaves every other layout to cuBLAS.
//
// Every operand value x is split as its fragment is loaded into hi = tf32(x) and lo = tf32(x -
// hi), and a b ~ a_lo b_hi + a_hi b_lo + a_hi b_hi (small terms first; a_lo b_lo, about 2^-22 of
// the product, is left out) with f32 accumulation: about 21 significant bits a product where
// plain tf32 keeps 11, f32-level logits for the MoE router, whose top-k must be an f32 product's.
//
// Block tile GF_BM x GF_BN outputs, four warps of 32 x 32 (2 x 4 m16n8k8 tiles each). k-tiles of
// GF_BK values of A's rows and B's columns stream through GF_STAGES shared-memory stages by
// cp.async, rows and k past the ends zero-filled; rows are padded to GF_LD floats, so each 8-row
// phase of an ldmatrix (16 bytes a row, 36 words apart) hits 32 distinct banks. ldmatrix of 32-bit
// values hands lane 4 g + t value (g, t) of each 8 x 4 matrix: exactly the tf32 fragments.
//
// Few tiles fill few multiprocessors (the router's 256 x 512 outputs are 32 tiles), so the host
// may split K: block x is split x % splits of tile x / splits (tiles M-fastest), over k-tiles
// [split kper, split kper + kper). A split block stores its sums at `partial` (fragment order,
// coalesced), and the last of a tile's blocks to finish (counted in `count[tile]`: zeroed, and left
// zeroed) adds the tile's partials up in split order, so the result does not depend on timing.

#define GF_BM 64
#define GF_BN 64
#define GF_BK 32
#define GF_LD 36
#define GF_STAGES 4
#define GF_THREADS 128
// Floats of one stage: GF_BM rows of A, then GF_BN columns of B. TAG(gemm-f32-smem): the host's
// `SHARED` is GF_STAGES stages.
#define GF_STAGE_FLOATS ((GF_BM + GF_BN) * GF_LD)

extern "C" __global__ void __launch_bounds__(GF_THREADS) gemm_f32(Tensor a, Tensor b, Tensor out, int tiles_m, int splits,
                                                                   int kper, float* partial, unsigned* count) {
    grid_begin();
    extern __shared__ __align__(16) float gf_sh[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const i64 M = a.ne[1], N = b.ne[1], K = a.ne[0];
    const int tile = blockIdx.x / splits, split = blockIdx.x % splits;
    const i64 m0 = (i64)(tile % tiles_m) * GF_BM, n0 = (i64)(tile / tiles_m) * GF_BN;
    const i64 ktiles = (K + GF_BK - 1) / GF_BK, kt0 = (i64)split * kper;
    const int nk = (int)(min(ktiles, kt0 + kper) - kt0);

    // This thread's copies: 16 bytes at value c4 of each k-tile, of A rows and B columns r0 + 16 i.
    const int r0 = tid >> 3, c4 = (tid & 7) * 4;
    const char* pa = a.data + (m0 + r0) * a.nb[1] + c4 * 4;
    const char* pb = b.data + (n0 + r0) * b.nb[1] + c4 * 4;
    u32 rows_ok = 0;  // bit i: A row r0 + 16 i exists; bit 4 + i: B column r0 + 16 i
#pragma unroll
    for (int i = 0; i < 4; i++) {
        if (m0 + r0 + 16 * i < M) rows_ok |= 1u << i;
        if (n0 + r0 + 16 * i < N) rows_ok |= 16u << i;
    }
    const u32 smem = tc_smem(gf_sh), sdst = smem + (r0 * GF_LD + c4) * 4;
    auto load = [&](int stage, i64 kt) {
        const bool kin = kt * GF_BK + c4 < K;  // K % 4 == 0: a 16-byte piece is all in or all out
        const i64 kb = kt * GF_BK * 4;
        const u32 dst = sdst + stage * GF_STAGE_FLOATS * 4;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const bool va = kin && (rows_ok >> i & 1), vb = kin && (rows_ok >> (4 + i) & 1);
            tc_cp16_at(dst + i * 16 * GF_LD * 4, va ? pa + i * 16 * a.nb[1] + kb : a.data, va);
            tc_cp16_at(dst + (GF_BM + i * 16) * GF_LD * 4, vb ? pb + i * 16 * b.nb[1] + kb : b.data, vb);
        }
    };
#pragma unroll
    for (int s = 0; s < GF_STAGES - 1; s++) {
        if (s < nk) load(s, kt0 + s);
        tc_commit();
    }

    // ldmatrix rows: lane l gives row l % 8 of matrix l / 8. A (16 x 8 tile): matrix i is rows
    // + 8 (i % 2), k + 4 (i / 2), i.e. a0..a3; B (two n8 tiles): matrix i is columns + 8 (i / 2),
    // k + 4 (i % 2), i.e. b0, b1 of the first tile, then of the second.
    const int wm = warp & 1, wn = warp >> 1, mi = lane >> 3, mr = lane & 7;
    const u32 a_at = smem + ((wm * 32 + (mi & 1) * 8 + mr) * GF_LD + (mi >> 1) * 4) * 4;
    const u32 b_at = smem + ((GF_BM + wn * 32 + (mi >> 1) * 8 + mr) * GF_LD + (mi & 1) * 4) * 4;
    float acc[2][4][4];
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int nt = 0; nt < 4; nt++)
#pragma unroll
            for (int j = 0; j < 4; j++) acc[mt][nt][j] = 0.0f;

    for (int i = 0; i < nk; i++) {
        tc_wait<GF_STAGES - 2>();
        __syncthreads();
        // refill the stage read in the previous iteration (every warp is past the barrier)
        if (i + GF_STAGES - 1 < nk) load((i + GF_STAGES - 1) % GF_STAGES, kt0 + i + GF_STAGES - 1);
        tc_commit();
        const u32 st = (i % GF_STAGES) * GF_STAGE_FLOATS * 4;
#pragma unroll
        for (int kk = 0; kk < GF_BK / 8; kk++) {
            u32 ah[2][4], al[2][4], bh[4][2], bl[4][2], r[4];
#pragma unroll
            for (int mt = 0; mt < 2; mt++) {
                tc_ldsm4_at(r, a_at + st + (mt * 16 * GF_LD + kk * 8) * 4);
#pragma unroll
                for (int j = 0; j < 4; j++) tc_split_tf32(r[j], ah[mt][j], al[mt][j]);
            }
#pragma unroll
            for (int np = 0; np < 2; np++) {
                tc_ldsm4_at(r, b_at + st + (np * 16 * GF_LD + kk * 8) * 4);
#pragma unroll
                for (int j = 0; j < 4; j++) tc_split_tf32(r[j], bh[2 * np + j / 2][j % 2], bl[2 * np + j / 2][j % 2]);
            }
            // one term over all eight tiles at a time: no mma waits on the one just issued
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
#pragma unroll
                for (int nt = 0; nt < 4; nt++) tc_mma_tf32(acc[mt][nt], al[mt], bh[nt][0], bh[nt][1]);
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
#pragma unroll
                for (int nt = 0; nt < 4; nt++) tc_mma_tf32(acc[mt][nt], ah[mt], bl[nt][0], bl[nt][1]);
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
#pragma unroll
                for (int nt = 0; nt < 4; nt++) tc_mma_tf32(acc[mt][nt], ah[mt], bh[nt][0], bh[nt][1]);
        }
    }

    if (splits > 1) {
        float4* mine = (float4*)partial + (i64)blockIdx.x * 8 * GF_THREADS;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const float* c = acc[j / 4][j % 4];
            mine[j * GF_THREADS + tid] = make_float4(c[0], c[1], c[2], c[3]);
        }
        if (!split_last_arrival(count + tile, splits)) return;
        const float4* first = (const float4*)partial + (i64)tile * splits * 8 * GF_THREADS;
        // split sp's sums: this block's own from its registers
        auto part = [&](int sp, int j) {
            const float* c = acc[j / 4][j % 4];
            return sp == split ? make_float4(c[0], c[1], c[2], c[3]) : __ldcg(first + (sp * 8 + j) * GF_THREADS + tid);
        };
        float4 sum[8];
#pragma unroll
        for (int j = 0; j < 8; j++) sum[j] = part(0, j);
        for (int sp = 1; sp < splits; sp++) {
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const float4 v = part(sp, j);
                sum[j].x += v.x, sum[j].y += v.y, sum[j].z += v.z, sum[j].w += v.w;
            }
        }
#pragma unroll
        for (int j = 0; j < 8; j++) {
            float* c = acc[j / 4][j % 4];
            c[0] = sum[j].x, c[1] = sum[j].y, c[2] = sum[j].z, c[3] = sum[j].w;
        }
        if (tid == 0) count[tile] = 0u;
    }

    // c0 (g, 2t), c1 (g, 2t + 1), c2 (g + 8, 2t), c3 (g + 8, 2t + 1) of each m16n8 tile
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < 2; mt++) {
#pragma unroll
        for (int nt = 0; nt < 4; nt++) {
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const i64 m = m0 + wm * 32 + mt * 16 + g + 8 * (j >> 1), n = n0 + wn * 32 + nt * 8 + 2 * t + (j & 1);
                if (m < M && n < N) *(float*)(out.data + m * 4 + n * out.nb[1]) = acc[mt][nt][j];
            }
        }
    }
}
