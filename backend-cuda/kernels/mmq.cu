// mmq.cu: mul_mat and mul_mat_id with q8_0 or nvfp4 weights for many tokens, on tensor cores
// (f16 operands, f32 accumulators), dequantizing weight tiles in shared memory. (mul_mat_id with
// few pairs an expert: moe_mma.cu.)
//
// Accuracy: nvfp4 weights are exact in f16 (E2M1 times a UE4M3 scale: at most 6 significant
// bits, with the scale folded in). q8_0 weights are their f16 scale times the 8-bit quant, rounded
// once to f16 (relative error at most 2^-11), as a dequantize-to-f16 GEMM rounds them. Activations
// are rounded to f16 after scaling each row by a power of two that brings its largest magnitude
// just under 2^15 (`mmq_pack_x`), so no row overflows or loses its small values, and the output
// is scaled back exactly. Each f16 rounding adds about 4e-8 to a dot product's normalized squared
// error (11 significant bits): about 3e-8 for nvfp4, 7e-8 for q8_0, under the f32 bound (1e-7) of
// the CPU oracle. (Keeping q8_0 exact meant scaling each 32-value block's partial sums in f32
// between tensor-core steps: 128 more instructions a thread and k-tile, with every wgmma waited
// for; docs/GPU.md.) A q8_0 weight beyond f16's range (|d q| > 65504) would
// overflow; trained weights are many orders of magnitude smaller.
//
// Tiles: a block computes 128 weight rows x 128 activation columns (256 for mul_mat's wide tiles)
// of one batch (or one expert's columns), k in steps of 64. Each k-tile's raw weight bytes (the
// 16-byte blocks that hold them) and packed activations go through a ring of S shared-memory slots
// (16-byte cp.async), loaded S - 2 tiles ahead; the raw weights of tile kt + 1 are decoded into one of three f16 tiles while the tensor
// cores multiply tile kt (and, with wgmma, finish tile kt - 1), so one barrier per k-tile orders
// everything. Shared tiles have 128-byte rows whose 16-byte chunks are
// XOR-swizzled (chunk c of row r at c ^ (r % 8)): Hopper's 128-byte swizzle, which also keeps
// ldmatrix and the decode stores free of bank conflicts.
//
// Two multiply paths over the same tiles: on sm_90a (Hopper) two warpgroups issue asynchronous
// `wgmma` (64 x 128 or 64 x 256 x 16 each) straight from shared memory, and the decode of the
// next tile runs while they work; elsewhere (sm_80, sm_100) 8 warps of 64 x 32 (64 x 64) use
// `ldmatrix` and `mma.sync`.

#define MQ_BM 128
// Columns of a block tile: MQ_BN for mul_mat_id and narrow mul_mat tiles, MQ_BN_WIDE for mul_mat
// tiles where the columns fill it (each decoded weight tile then serves twice the columns).
#define MQ_BN 128
#define MQ_BN_WIDE 256
#define MQ_THREADS 256
// Bytes of one shared tile: MQ_BM rows of 64 f16 (a k-tile), MQ_ROW bytes each, as the packed
// activations (quant_mma.cuh).
#define MQ_TILE (MQ_BM * MQ_ROW)

// A row's k-tile is copied as the 16-byte aligned blocks of global memory that hold its bytes (5 or
// 3 at any of the four offsets: whole-block copies, several per row, instead of 4-byte copies
// scattered over the tile's rows), and starts `shift` bytes into its slot row (its address mod 16).
constexpr int mq_raw_blocks(int qt) { return (mq_raw_bytes(qt) + 12 + 15) / 16; }
// Bytes between raw weight rows in a slot.
constexpr int mq_raw_stride(int qt) { return 16 * mq_raw_blocks(qt); }

// One ring slot of a block of `bn` columns: the activation tile (bn rows of MQ_ROW bytes), then the
// raw weights (`mq_raw_stride` bytes a row; 16 bytes of slack: q8_0 decoding reads a whole word past
// a row's end), 1024-byte aligned.
constexpr int mq_slot_bytes(int qt, int bn) { return (bn * MQ_ROW + MQ_BM * mq_raw_stride(qt) + 16 + 1023) & ~1023; }
// The ring and three decoded weight tiles, plus 1 KiB to align the base to 1024 bytes (wgmma's
// swizzle is on address bits). TAG(mmq-smem): `shared_bytes` in src/ops/matmul/mmq.rs.
#define MQ_DECODED 3
constexpr int mq_shared_bytes(int qt, int stages, int bn) { return stages * mq_slot_bytes(qt, bn) + MQ_DECODED * MQ_TILE + 1024; }

extern "C" __global__ void mmq_pack_x(Tensor b, char* x, float* xs) {
    grid_begin();
    const i64 per_block = blockDim.x >> 5;
    mq_pack_rows(b, x, xs, blockIdx.x * per_block + (threadIdx.x >> 5), (i64)gridDim.x * per_block);
}

// Byte offset of 16-byte chunk c of row r in a swizzled shared tile.
__device__ __forceinline__ int mq_swz(int r, int c) { return r * MQ_ROW + ((c ^ (r & 7)) << 4); }

// Four E2M1 codes (nibbles 0-3 of `codes`) to four f16 (two words) times the f16 pair `d2`, which
// holds the block scale / 256. The magnitudes times 256 have f16 high bytes from an 8-entry byte
// table (__byte_perm; their low bytes are 0), the sign picks the negated byte; the product is
// exact (at most 6 significant bits, at least 2^-10).
__device__ __forceinline__ uint2 mq_e2m1x4_f16(u32 codes, u32 d2) {
    const u32 pos = __byte_perm(0x5E5C5800u, 0x66646260u, codes & 0x7777u);
    const u32 hi = __byte_perm(pos, pos | 0x80808080u, 0x3210u | ((codes & 0x8888u) >> 1));
    u32 v[2] = {__byte_perm(hi, 0u, 0x1404), __byte_perm(hi, 0u, 0x3424)};
#pragma unroll
    for (int i = 0; i < 2; i++) asm("fma.rn.f16x2 %0, %0, %1, %2;" : "+r"(v[i]) : "r"(d2), "r"(0x80008000u));
    return make_uint2(v[0], v[1]);
}

// The nibbles of bytes 0-3 of `x` (each in bits 0-3 of its byte) as nibbles 0-3 of the result.
__device__ __forceinline__ u32 mq_gather_nibbles(u32 x) {
    const u32 t = x | (x >> 4);
    return __byte_perm(t, 0u, 0x4420);
}

// Decodes the raw k-tile `raw` (MQ_BM rows of mq_raw_stride bytes) into the swizzled f16 tile
// `dst`. Thread t takes row t / 2, half t % 2; its row's k-tile starts `shift` bytes into the row.
template <int QT>
__device__ __forceinline__ void mq_decode(const char* raw, char* dst, u32 shift) {
    const int r = threadIdx.x >> 1, h = threadIdx.x & 1;
    const char* row = raw + r * mq_raw_stride(QT) + shift;
    if (QT == DT_Q8_0) {
        // block h: f16 scale at 34 h, 32 quants from 34 h + 2 (word-aligned for h = 1 only)
        const u32* w = (const u32*)(row + (h ? 36 : 0));
        u32 q[9];
#pragma unroll
        for (int i = 0; i < 9; i++) q[i] = w[i];
        if (!h) {
#pragma unroll
            for (int i = 0; i < 8; i++) q[i] = __byte_perm(q[i], q[i + 1], 0x5432);
        }
        const u32 d = *(const u16*)(row + Q8_0_BYTES * h), d2 = d | (d << 16);
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const uint2 a = mq_q8x4_f16(q[2 * c], d2), b = mq_q8x4_f16(q[2 * c + 1], d2);
            *(uint4*)(dst + mq_swz(r, 4 * h + c)) = make_uint4(a.x, a.y, b.x, b.y);
        }
    } else {
        // sub-blocks 2 h and 2 h + 1: scale byte s, codes at 4 + 8 s (byte j: value j low nibble,
        // value j + 8 high nibble)
        const u32 scales = *(const u32*)row;
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int s = 2 * h + i;
            const u32 d = mq_ue4m3_f16_div256((scales >> (8 * s)) & 0xFF);
            const u32 d2 = d | (d << 16);
            const u32 w0 = *(const u32*)(row + 4 + 8 * s), w1 = *(const u32*)(row + 8 + 8 * s);
            const uint2 v0 = mq_e2m1x4_f16(mq_gather_nibbles(w0 & 0x0F0F0F0Fu), d2);
            const uint2 v1 = mq_e2m1x4_f16(mq_gather_nibbles(w1 & 0x0F0F0F0Fu), d2);
            const uint2 v2 = mq_e2m1x4_f16(mq_gather_nibbles((w0 >> 4) & 0x0F0F0F0Fu), d2);
            const uint2 v3 = mq_e2m1x4_f16(mq_gather_nibbles((w1 >> 4) & 0x0F0F0F0Fu), d2);
            *(uint4*)(dst + mq_swz(r, 2 * s)) = make_uint4(v0.x, v0.y, v1.x, v1.y);
            *(uint4*)(dst + mq_swz(r, 2 * s + 1)) = make_uint4(v2.x, v2.y, v3.x, v3.y);
        }
    }
}

// What a block works on: weight rows from `w` (row m at w + m * nb1, `rows` of them) and output
// element m of column c at ocol[c] + m * onb0. Its columns' packed activation rows are xrow[c]
// (-1: none) with scales xscale[c].
struct MqTile {
    const char* w;
    i64 nb1, rows, onb0;
};

// This thread's share of every k-tile's copies, in order from tile 0, with addresses worked out
// once per block: the packed activation chunks (chunk tid % 8 of tile columns tid / 8 + 32 i) and
// the 16-byte blocks tid + 256 i of the raw weights (block c: row c / mq_raw_blocks, so a warp's
// copies are whole runs of a few rows). `shift` is the decode's: where thread tid's decode row
// (tid / 2) starts in its slot row.
template <int QT, int BN>
struct MqLoader {
    static constexpr int RB = mq_raw_bytes(QT), NBLK = mq_raw_blocks(QT), ACOPIES = (MQ_BM * NBLK + MQ_THREADS - 1) / MQ_THREADS,
                         XCOPIES = BN * (MQ_ROW / 16) / MQ_THREADS;
    const char* xsrc[XCOPIES];
    u32 xdst[XCOPIES], xvalid;
    // the k-tile's first byte in weight row c / NBLK (it moves by RB), and the offset 16 (c % NBLK)
    // of the aligned block copied from there: (asrc & ~15) + ablk
    u64 asrc[ACOPIES];
    u32 ablk[ACOPIES], adst[ACOPIES], avalid, shift;
    // (every one of the NBLK blocks then holds some of the k-tile's bytes, at any 4-byte offset)
    static_assert(RB % 16 == 4, "a k-tile of 4 mod 16 bytes");

    // Tiles from kt0 of rows `ktiles` tiles long.
    __device__ __forceinline__ MqLoader(const MqTile& t, i64 m0, const i64* xrow, const char* x, i64 ktiles, int kt0) {
        const int tid = threadIdx.x;
        xvalid = 0;
#pragma unroll
        for (int i = 0; i < XCOPIES; i++) {
            const int c = (tid >> 3) + 32 * i;
            const i64 r = xrow[c];
            xsrc[i] = x + ((r < 0 ? 0 : r) * ktiles + kt0) * MQ_ROW + (tid & 7) * 16;
            xdst[i] = mq_swz(c, tid & 7);
            xvalid |= (u32)(r >= 0) << i;
        }
        avalid = 0;
        const char* first = t.w + (i64)kt0 * RB;
#pragma unroll
        for (int i = 0; i < ACOPIES; i++) {
            const int c = tid + MQ_THREADS * i, r = c / NBLK, b = c % NBLK;
            const bool valid = c < MQ_BM * NBLK && m0 + r < t.rows;
            asrc[i] = (u64)(valid ? first + (m0 + r) * t.nb1 : t.w);
            ablk[i] = 16 * b;
            adst[i] = BN * MQ_ROW + r * mq_raw_stride(QT) + 16 * b;
            avalid |= (u32)valid << i;
        }
        shift = (u32)(u64)(first + (m0 + (tid >> 1)) * t.nb1) & 15;
    }

    // Issues the copies of the next k-tile into the slot at shared address `slot`.
    __device__ __forceinline__ void load_next(u32 slot) {
#pragma unroll
        for (int i = 0; i < XCOPIES; i++) {
            tc_cp16_at(slot + xdst[i], xsrc[i], (xvalid >> i) & 1);
            xsrc[i] += MQ_ROW;
        }
#pragma unroll
        for (int i = 0; i < ACOPIES; i++) {
            // blocks past the tile's (the last round's upper threads) are not copied at all: a
            // zero-filling copy would still write its destination
            if (MQ_THREADS * i + (int)threadIdx.x < MQ_BM * NBLK) {
                const bool valid = (avalid >> i) & 1;
                tc_cp16_at(slot + adst[i], (const void*)((asrc[i] & ~(u64)15) + ablk[i]), valid);
                if (valid) asrc[i] += RB;
            }
        }
    }
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MQ_WGMMA 1
#define MQ_WGMMA_ON true
#else
#define MQ_WGMMA_ON false
#endif

// The accumulators of one thread for a block of BN columns: BN / 2 f32 of its warp's (mma.sync:
// 64 x BN / 4, fragment (i, j) of NJ = BN / 32 n8 tiles a row at 4 (NJ i + j)) or warpgroup's
// (wgmma: 64 x BN, n8 tile j at 4 j) output tile.
template <int BN>
struct MqAcc {
    static constexpr int N = BN / 2, NJ = BN / 32;
    float v[N];
};

// Row and column in the block tile of accumulator `idx` of this thread (the m16n8 fragment
// layout: element e of a fragment is row g + 8 (e / 2), column 2 (lane % 4) + e % 2).
template <int BN>
__device__ __forceinline__ void mq_acc_coords(int idx, int& row, int& col) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, e = idx & 3;
    const int r = (lane >> 2) + 8 * (e >> 1), c = 2 * (lane & 3) + (e & 1);
#ifdef MQ_WGMMA
    row = (warp >> 2) * 64 + (warp & 3) * 16 + r;
    col = (idx >> 2) * 8 + c;
#else
    constexpr int NJ = MqAcc<BN>::NJ;
    row = (warp & 1) * 64 + (idx / (4 * NJ)) * 16 + r;
    col = (warp >> 1) * (BN / 4) + ((idx >> 2) % NJ) * 8 + c;
#endif
}

#ifdef MQ_WGMMA
// d = A (64 x 16, descriptor a) B^T (BN x 16, descriptor b) + (accumulate ? d : 0), issued
// asynchronously by the warpgroup (BN = 128 or 256: wgmma's n).
template <int BN>
__device__ __forceinline__ void wg_mma(float* d, u64 a, u64 b, int accumulate) {
    if constexpr (BN == 128) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                     : "l"(a), "l"(b), "r"(accumulate)
                     : "memory");
    } else {
        static_assert(BN == 256, "wgmma n of 128 or 256");
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, 0, 0;\n}\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
                     : "l"(a), "l"(b), "r"(accumulate)
                     : "memory");
    }
}

// acc += the warpgroup's 64 rows of the decoded weight tile `at` times the activation tile `xt`,
// with `decode_next` run while the tensor cores work. Returns with this tile's products still
// running (the previous tile's are done): the caller keeps its buffers until the next barrier
// after that. `first` (the first k-tile) starts the sums from zero: acc is only ever written by
// wgmma, so that tiles' products may stay in flight across iterations (a plain store to acc
// would make the compiler serialize them).
template <int BN, typename Decode>
__device__ __forceinline__ void mq_multiply(MqAcc<BN>& acc, bool first, const char* at, const char* xt, Decode decode_next) {
    const int warp = threadIdx.x >> 5;
    const u64 da = wg_desc(at + (warp >> 2) * 64 * MQ_ROW), db = wg_desc(xt);
    wg_fence();
#pragma unroll
    for (int ks = 0; ks < 4; ks++) wg_mma<BN>(acc.v, da + 2 * ks, db + 2 * ks, !first || ks > 0);
    wg_commit();
    decode_next();
    wg_wait<1>();
}

#else
// The warp's A fragment of m16 tile i of the f16 weight tile `at`, k = 16 ks .. 16 ks + 15.
__device__ __forceinline__ void mq_frag_a(u32* a, const char* at, int ks, int i, int wm, int lane) {
    const int r = wm * 64 + i * 16 + (lane & 7) + 8 * ((lane >> 3) & 1);
    tc_ldsm4(a, at + mq_swz(r, 2 * ks + (lane >> 4)));
}

// The warp's B fragments of its NJ n8 tiles of the activation tile `xt` (columns NJ 8 wn ..),
// k = 16 ks .. 16 ks + 15.
template <int NJ>
__device__ __forceinline__ void mq_frag_b(u32 (&b)[NJ][2], const char* xt, int ks, int wn, int lane) {
#pragma unroll
    for (int jp = 0; jp < NJ / 2; jp++) {
        const int c = wn * 8 * NJ + jp * 16 + (lane & 7) + 8 * (lane >> 4);
        u32 v[4];
        tc_ldsm4(v, xt + mq_swz(c, 2 * ks + ((lane >> 3) & 1)));
        b[2 * jp][0] = v[0], b[2 * jp][1] = v[1], b[2 * jp + 1][0] = v[2], b[2 * jp + 1][1] = v[3];
    }
}

// acc += the warp's 64 x BN / 4 product over the k-tile (mma.sync); the decode of the next tile
// runs first (mma.sync blocks the warp).
template <int BN, typename Decode>
__device__ __forceinline__ void mq_multiply(MqAcc<BN>& acc, bool, const char* at, const char* xt, Decode decode_next) {
    constexpr int NJ = MqAcc<BN>::NJ;
    decode_next();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wm = warp & 1, wn = warp >> 1;
#pragma unroll
    for (int p = 0; p < 2; p++) {
        u32 b[2][NJ][2];
        mq_frag_b<NJ>(b[0], xt, 2 * p, wn, lane);
        mq_frag_b<NJ>(b[1], xt, 2 * p + 1, wn, lane);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u32 a[2][4];
            mq_frag_a(a[0], at, 2 * p, i, wm, lane);
            mq_frag_a(a[1], at, 2 * p + 1, i, wm, lane);
#pragma unroll
            for (int j = 0; j < NJ; j++) {
                float* d = acc.v + 4 * (NJ * i + j);
                tc_mma_f16(d, a[0], b[0][j][0], b[0][j][1]);
                tc_mma_f16(d, a[1], b[1][j][0], b[1][j][1]);
            }
        }
    }
}
#endif

// acc = the block's product over k-tiles [kt0, kt1) (at least one): rows m0 .. m0 + MQ_BM of the
// tile's weights times its BN columns (rows `k` long).
template <int QT, int S, int BN>
__device__ __forceinline__ void mq_gemm(MqAcc<BN>& acc, const MqTile& t, i64 m0, const i64* xrow, const char* x, i64 k, int kt0, int kt1) {
    constexpr int SLOT = mq_slot_bytes(QT, BN), XTILE = BN * MQ_ROW;
    extern __shared__ __align__(16) char smem_raw[];
    // aligned by pointer arithmetic on the shared array, so the compiler keeps shared-space loads
    // and stores (an integer round trip would make every access generic)
    char* smem = smem_raw + ((1024 - (tc_smem(smem_raw) & 1023)) & 1023);
    char* abf = smem + S * SLOT;
    const int ktiles = kt1 - kt0;

    // (with wgmma, the first product overwrites acc)
    if (!MQ_WGMMA_ON) {
#pragma unroll
        for (int i = 0; i < acc.N; i++) acc.v[i] = 0.0f;
    }

    MqLoader<QT, BN> loader(t, m0, xrow, x, k / MQ_BK, kt0);
    const u32 ring = tc_smem(smem);
#pragma unroll
    for (int s = 0; s < S - 2; s++) {
        if (s < ktiles) loader.load_next(ring + s * SLOT);
        tc_commit();
    }
    tc_wait<S - 3>();
    __syncthreads();
    // where the decoded tile's rows start in their slot rows
    u32 shift = loader.shift;
    mq_decode<QT>(smem + XTILE, abf, shift);

    // ring slots of the tile being multiplied and of the next load; decoded tile in use
    int cur = 0, load = S - 2, dec = 0;
    for (int kt = 0; kt < ktiles; kt++) {
        // Tile kt + 1 has landed, tile kt is decoded, and every product of tile kt - 2 is done,
        // so its slot takes tile kt + S - 2 and its decoded tile takes tile kt + 1.
        tc_wait<S - 4>();
#ifdef MQ_WGMMA
        tc_fence_async();
#endif
        __syncthreads();
        if (kt + S - 2 < ktiles) loader.load_next(ring + load * SLOT);
        tc_commit();
        const int next = cur + 1 == S ? 0 : cur + 1, dec_next = dec + 1 == MQ_DECODED ? 0 : dec + 1;
        auto decode_next = [&]() {
            shift = (shift + mq_raw_bytes(QT)) & 15;
            if (kt + 1 < ktiles) mq_decode<QT>(smem + next * SLOT + XTILE, abf + dec_next * MQ_TILE, shift);
        };
        mq_multiply<BN>(acc, kt == 0, abf + dec * MQ_TILE, smem + cur * SLOT, decode_next);
        cur = next, dec = dec_next, load = load + 1 == S ? 0 : load + 1;
    }
#ifdef MQ_WGMMA
    wg_wait<0>();
#endif
    tc_wait<0>();
}

// Stores the block's product acc (rows m0 .. of the tile's weights; column c scaled by xscale[c]
// into ocol[c], none where it is null).
template <int BN>
__device__ __forceinline__ void mq_store(const MqAcc<BN>& acc, const MqTile& t, i64 m0, const float* xscale, char* const* ocol) {
#pragma unroll
    for (int i = 0; i < acc.N; i++) {
        int row, col;
        mq_acc_coords<BN>(i, row, col);
        const i64 m = m0 + row;
        char* dst = ocol[col];
        if (dst && m < t.rows) *(float*)(dst + m * t.onb0) = acc.v[i] * xscale[col];
    }
}

// out [M, N, b2, b3] = a^T b for weights a [K, M, A2, A3] (K % 64 == 0, rows 4-byte aligned) and
// the packed activations x, xs of b [K, N, b2, b3]. Tiles of MQ_BM rows x BN columns, columns
// fastest, then rows, then batches (neighbouring blocks share weight tiles in L2). The grid is
// one block a tile for the first `dp` tiles, then `splits` blocks for each remaining tile, each
// over `kper` k-tiles: one block a multiprocessor, a grid of whole waves plus a few tiles would
// leave most of the GPU idle for a last tile's time. A split block stores its sums at `partial`;
// the last of a tile's blocks to finish (counted in `count[tile - dp]`, zeroed, and left zeroed)
// adds them up in split order, so results do not depend on timing. With `a_up` (not null: a second
// weight matrix of a's shape and strides, mul_mat_swiglu's up weights) the tiles of the same
// product of a_up into `out_up` follow a's in the same grid, over the same packed activations.
template <int QT, int S, int BN>
__device__ __forceinline__ void mmq_body(Tensor a, const char* a_up, const char* x, const float* xs, i64 n, i64 b2, i64 b3, Tensor out, Tensor out_up, i64 dp, int splits, int kper, float* partial, unsigned* count) {
    __shared__ i64 xrow[BN];
    __shared__ float xscale[BN];
    __shared__ char* ocol[BN];
    const i64 ncols = (n + BN - 1) / BN, nrows = (a.ne[1] + MQ_BM - 1) / MQ_BM, ktiles = a.ne[0] / MQ_BK;
    i64 tile = blockIdx.x, unit = -1;
    if (tile >= dp) unit = tile - dp, tile = dp + unit / splits;
    // tile (global: the split counters') as a tile of one product
    const i64 half = ncols * nrows * b2 * b3;
    const bool up = a_up != nullptr && tile >= half;
    const i64 local = up ? tile - half : tile;
    // the output's base and strides, selected value by value (a reference to either parameter
    // would put both on the stack)
    char* const obase = up ? out_up.data : out.data;
    const i64 onb0 = up ? out_up.nb[0] : out.nb[0], onb1 = up ? out_up.nb[1] : out.nb[1];
    const i64 onb2 = up ? out_up.nb[2] : out.nb[2], onb3 = up ? out_up.nb[3] : out.nb[3];
    const i64 rest = local / ncols, batch = rest / nrows, i2 = batch % b2, i3 = batch / b2;
    const i64 n0 = (local % ncols) * BN, m0 = (rest % nrows) * MQ_BM;
    for (int c = threadIdx.x; c < BN; c += MQ_THREADS) {
        const bool valid = n0 + c < n;
        xrow[c] = valid ? batch * n + n0 + c : -1;
        xscale[c] = valid ? xs[batch * n + n0 + c] : 0.0f;
        ocol[c] = valid ? obase + (n0 + c) * onb1 + i2 * onb2 + i3 * onb3 : nullptr;
    }
    __syncthreads();
    const i64 a2 = i2 / (b2 / a.ne[2]), a3 = i3 / (b3 / a.ne[3]);
    const MqTile t = {(up ? a_up : a.data) + a2 * a.nb[2] + a3 * a.nb[3], a.nb[1], a.ne[1], onb0};
    const int kt0 = unit < 0 ? 0 : (int)(unit % splits) * kper, kt1 = unit < 0 ? (int)ktiles : min((int)ktiles, kt0 + kper);
    MqAcc<BN> acc;
    constexpr int N = MqAcc<BN>::N;
    mq_gemm<QT, S, BN>(acc, t, m0, xrow, x, a.ne[0], kt0, kt1);
    if (unit >= 0) {
        const int tid = threadIdx.x;
        const i64 first = unit - unit % splits;  // the tile's first split block
#pragma unroll
        for (int i = 0; i < N; i++) partial[(unit * N + i) * MQ_THREADS + tid] = acc.v[i];
        if (!split_last_arrival(count + (tile - dp), splits)) return;
        MqAcc<BN> sum;
#pragma unroll
        for (int i = 0; i < N; i++) sum.v[i] = 0.0f;
        for (int sp = 0; sp < splits; sp++) {
#pragma unroll
            for (int i = 0; i < N; i++) sum.v[i] += __ldcg(partial + ((first + sp) * N + i) * MQ_THREADS + tid);
        }
        if (tid == 0) count[tile - dp] = 0u;
        mq_store(sum, t, m0, xscale, ocol);
        return;
    }
    mq_store(acc, t, m0, xscale, ocol);
}

// mul_mat_id: out[:, u, t] = as[:, :, e]^T b[:, u mod n_b, t] for the pairs s = u + n_used t of
// expert e = blockIdx.z, listed at list[offsets[e] .. offsets[e + 1]] (by `moe_prep`),
// for experts with more than min_pairs pairs (the others are moe.cu's). x, xs hold the packed
// rows of b. Grid: (column blocks, M / MQ_BM rounded up, n_expert); column block x takes the
// expert's column tiles x, x + gridDim.x, ..., so a grid sized for a typical expert covers any.
template <int QT, int S>
__device__ __forceinline__ void mmq_id_body(Tensor as, const char* x, const float* xs, i64 n_b, i64 n_used, const int* offsets, const int* list, int min_pairs, Tensor out) {
    __shared__ i64 xrow[MQ_BN];
    __shared__ float xscale[MQ_BN];
    __shared__ char* ocol[MQ_BN];
    const i64 e = blockIdx.z, first = offsets[e], count = offsets[e + 1] - first;
    const i64 m0 = (i64)blockIdx.y * MQ_BM;
    if (count <= min_pairs) return;
    const MqTile t = {as.data + e * as.nb[2], as.nb[1], as.ne[1], out.nb[0]};
    for (i64 n0 = (i64)blockIdx.x * MQ_BN; n0 < count; n0 += (i64)gridDim.x * MQ_BN) {
        __syncthreads();  // the previous tile is done with the tables and the shared tiles
        for (int c = threadIdx.x; c < MQ_BN; c += MQ_THREADS) {
            const bool valid = n0 + c < count;
            const i64 s = valid ? list[first + n0 + c] : 0, u = s % n_used, tok = s / n_used, r = (u % n_b) + n_b * tok;
            xrow[c] = valid ? r : -1;
            xscale[c] = valid ? xs[r] : 0.0f;
            ocol[c] = valid ? out.data + u * out.nb[1] + tok * out.nb[2] : nullptr;
        }
        __syncthreads();
        MqAcc<MQ_BN> acc;
        mq_gemm<QT, S, MQ_BN>(acc, t, m0, xrow, x, as.ne[0], 0, (int)(as.ne[0] / MQ_BK));
        mq_store(acc, t, m0, xscale, ocol);
    }
}

// Entry points: weight type x ring depth (5 slots where a block may have the shared memory, 4
// otherwise), and mul_mat's wide tiles (MQ_BN_WIDE columns, 4 slots: 221 KiB for q8_0, Hopper's
// shared memory).
#define MQ_MUL_MAT_ENTRY(NAME, QT, S, BN)                                                                    \
    extern "C" __global__ void __launch_bounds__(MQ_THREADS, 1)                                              \
        NAME(Tensor a, const char* a_up, const char* x, const float* xs, i64 n, i64 b2, i64 b3, Tensor out,   \
             Tensor out_up, i64 dp, int splits, int kper, float* partial, unsigned* count) {                  \
        grid_begin();                                                                                         \
        mmq_body<QT, S, BN>(a, a_up, x, xs, n, b2, b3, out, out_up, dp, splits, kper, partial, count);        \
    }
#define MQ_ENTRY(NAME, QT, S)                                                                                 \
    MQ_MUL_MAT_ENTRY(NAME, QT, S, MQ_BN)                                                                      \
    extern "C" __global__ void __launch_bounds__(MQ_THREADS, 1)                                              \
        NAME##_id(Tensor as, const char* x, const float* xs, i64 n_b, i64 n_used, const int* offsets,         \
                  const int* list, int min_pairs, Tensor out) {                                               \
        grid_begin();                                                                                         \
        mmq_id_body<QT, S>(as, x, xs, n_b, n_used, offsets, list, min_pairs, out);                            \
    }
MQ_ENTRY(mmq_q8_0_s4, DT_Q8_0, 4)
MQ_ENTRY(mmq_q8_0_s5, DT_Q8_0, 5)
MQ_ENTRY(mmq_nvfp4_s4, DT_NVFP4, 4)
MQ_ENTRY(mmq_nvfp4_s5, DT_NVFP4, 5)
MQ_MUL_MAT_ENTRY(mmq_wide_q8_0_s4, DT_Q8_0, 4, MQ_BN_WIDE)
MQ_MUL_MAT_ENTRY(mmq_wide_nvfp4_s4, DT_NVFP4, 4, MQ_BN_WIDE)
