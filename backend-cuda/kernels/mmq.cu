// mmq.cu: mul_mat and mul_mat_id with q8_0 or nvfp4 weights for many tokens, on tensor cores
// (f16 operands, f32 accumulators), dequantizing weight tiles in shared memory; and (at the end)
// mul_mat_id with few pairs an expert: `moe_prep` and `moe_mma_*`.
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
#define MQ_BK 64
#define MQ_THREADS 256
// Bytes of one row of a shared tile (64 f16: a k-tile) and of one tile; the packed activations
// use the same 128-byte rows.
#define MQ_ROW 128
#define MQ_TILE (MQ_BM * MQ_ROW)

// Raw weight bytes of one row's k-tile: two q8_0 blocks or one nvfp4 block (68 or 36: 4 more than
// a multiple of 16, and 4-byte aligned).
constexpr int mq_raw_bytes(int qt) { return qt == DT_Q8_0 ? 2 * Q8_0_BYTES : NVFP4_BYTES; }
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
// swizzle is on address bits). TAG(mmq-smem): `shared_bytes` in src/ops/mmq.rs.
#define MQ_DECODED 3
constexpr int mq_shared_bytes(int qt, int stages, int bn) { return stages * mq_slot_bytes(qt, bn) + MQ_DECODED * MQ_TILE + 1024; }

// Activations as mmq reads them, one warp per flat row r of b (f32, any strides): the row times
// 2^(15 - e), where 2^e bounds its largest magnitude, as f16 in k-tiles of 64 at
// x + (r * (k / 64) + kt) * MQ_ROW bytes, and xs[r] = 2^(e - 15) to undo it.
// Warp `warp` of `warps` packs rows warp, warp + warps, ...
__device__ __forceinline__ void mq_pack_rows(Tensor b, char* x, float* xs, i64 warp, i64 warps) {
    const i64 k = b.ne[0], rows = nelements(b) / k;
    const int lane = threadIdx.x & 31;
    for (i64 r = warp; r < rows; r += warps) {
        i64 i1, i2, i3;
        row_coords(b, r, i1, i2, i3);
        const char* src = b.data + i1 * b.nb[1] + i2 * b.nb[2] + i3 * b.nb[3];
        // dense aligned rows: a lane's 8-value groups c = lane + 32 j as two float4 each, several
        // groups' loads in flight (a scalar loop has one load in flight an iteration); the second
        // pass reads them again, from L1
        const bool vec = b.nb[0] == 4 && ((u64)src & 15) == 0;
        const float4* v4 = (const float4*)src;
        float amax = 0.0f;
        if (vec) {
#pragma unroll 4
            for (i64 c = lane; c < k / 8; c += 32) {
                const float4 p = v4[2 * c], q = v4[2 * c + 1];
                amax = fmaxf(amax, fmaxf(fmaxf(fmaxf(fabsf(p.x), fabsf(p.y)), fmaxf(fabsf(p.z), fabsf(p.w))),
                                         fmaxf(fmaxf(fabsf(q.x), fabsf(q.y)), fmaxf(fabsf(q.z), fabsf(q.w)))));
            }
        } else {
            for (i64 i = lane; i < k; i += 32) amax = fmaxf(amax, fabsf(*(const float*)(src + i * b.nb[0])));
        }
        amax = warp_max(amax);
        int e = 0;
        if (amax > 0.0f && amax <= 3.0e38f) frexpf(amax, &e);
        e = max(e, -100);
        const float scale = ldexpf(1.0f, 15 - e);
        if (lane == 0) xs[r] = ldexpf(1.0f, e - 15);
        const auto pair = [scale](float a, float b) { return (u32)f32_to_f16(a * scale) | ((u32)f32_to_f16(b * scale) << 16); };
        if (vec) {
#pragma unroll 4
            for (i64 c = lane; c < k / 8; c += 32) {
                const float4 p = v4[2 * c], q = v4[2 * c + 1];
                *(uint4*)(x + (r * (k / MQ_BK) + c / 8) * MQ_ROW + (c % 8) * 16) =
                    make_uint4(pair(p.x, p.y), pair(p.z, p.w), pair(q.x, q.y), pair(q.z, q.w));
            }
            continue;
        }
        for (i64 c = lane; c < k / 8; c += 32) {
            u32 h[4];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                h[j] = pair(*(const float*)(src + (8 * c + 2 * j) * b.nb[0]), *(const float*)(src + (8 * c + 2 * j + 1) * b.nb[0]));
            }
            *(uint4*)(x + (r * (k / MQ_BK) + c / 8) * MQ_ROW + (c % 8) * 16) = make_uint4(h[0], h[1], h[2], h[3]);
        }
    }
}

extern "C" __global__ void mmq_pack_x(Tensor b, char* x, float* xs) {
    grid_begin();
    const i64 per_block = blockDim.x >> 5;
    mq_pack_rows(b, x, xs, blockIdx.x * per_block + (threadIdx.x >> 5), (i64)gridDim.x * per_block);
}

// Byte offset of 16-byte chunk c of row r in a swizzled shared tile.
__device__ __forceinline__ int mq_swz(int r, int c) { return r * MQ_ROW + ((c ^ (r & 7)) << 4); }

// Four q8_0 quants (the int8 of one word) times the f16 pair `d2` (the block scale twice) to four
// f16 (two words): each byte, offset to unsigned, becomes the low mantissa byte of the f16
// 1024 + u; subtracting 1024 + 128 leaves the integer exactly, and the product is rounded once.
__device__ __forceinline__ uint2 mq_q8x4_f16(u32 w, u32 d2) {
    const u32 u = w ^ 0x80808080u;
    u32 v[2] = {__byte_perm(u, 0x64646464u, 0x4140), __byte_perm(u, 0x64646464u, 0x4342)};
#pragma unroll
    for (int i = 0; i < 2; i++) asm("sub.rn.f16x2 %0, %0, %1;\n\tmul.rn.f16x2 %0, %0, %2;" : "+r"(v[i]) : "r"(0x64806480u), "r"(d2));
    return make_uint2(v[0], v[1]);
}

// A UE4M3 scale as f16 bits worth 1/256 of its value: its exponent and mantissa bits moved into
// f16's (exponent bias 15 instead of 7: a factor 2^-8, exact for normal and subnormal codes), 0x7F
// read as 0 as ggml does.
__device__ __forceinline__ u32 mq_ue4m3_f16_div256(u32 code) { return code == 0x7F ? 0u : (code & 0x7F) << 7; }

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

// ---------------------------------------------------------------------------------------------
// mul_mat_id with few pairs per expert (a batch of decode steps, a short prefill): each routed
// expert's weights are read from memory once and multiplied by all of its (slot, token) pairs on
// tensor cores (`moe_mma_q8_0` / `moe_mma_nvfp4`), after `moe_prep` grouped the pairs and packed
// the activations in one launch. (With a few pairs an expert, the tiled kernels above would do
// 128-column tiles for a handful of columns, and a warp-per-row GEMV re-decodes a row per pair.)
//
// `moe_prep`: its last block groups the pairs s = u + n_used t of ids [n_used, T] by expert
// (counts, a block-wide prefix sum, then the pair lists, in no particular order; counts in shared
// memory when they fit), checking every id, and lists the experts with 1 ..= max_pairs pairs in
// increasing order (`MeExpert`); the other blocks pack the activations as `mmq_pack_x` does
// (none when x is null: moe.cu's kernels read f32 rows).
//
// `moe_mma_*`: a work item is ME_ROWS = 32 weight rows (two m16 tiles) of one listed expert. The
// grid is one wave of blocks whose warps take the items round-robin, each warp on its own: it
// streams its items' rows in k-chunks of 256 values (cp.async of 16-byte pieces, coalesced)
// through a ring of ME_STAGES shared-memory stages of its own, ME_STAGES - 1 chunks in flight
// across item boundaries, and multiplies each chunk by up to 32 pairs a pass with mma.sync
// m16n8k16 (f16 operands, f32 sums; 1, 2 or 4 n8 tiles as the expert's pairs need; an expert with
// more pairs takes more passes over its rows). Lane (g, c) = (lane / 4, lane % 4) decodes its own
// fragment values straight from the staged bytes: rows g and g + 8 of a tile and, of every 64
// values, nvfp4 sub-block c (16 values, one scale) or q8_0 values 8c .. 8c + 7 of both blocks. So
// the k order inside an mma is a permutation of the true one, and the B fragments (the packed
// activations, read through L1) are permuted alike (`me_frag_b`).
//
// nvfp4 without lookup tables: an E2M1 code's magnitude bits in bits 9-11 of an f16 and its sign
// in bit 15 read as value * 2^-14 (code 1, 0.5, lands on the subnormal 2^-15); times the
// sub-block scale * 2^6 (at most 480 * 64) that is value * scale * 2^-8, exact in f16 (at most 6
// significant bits, never below 2^-18), and the output is scaled back by 2^8. q8_0 as
// `mq_q8x4_f16` (one rounding, as the tiled kernels): the error budget at the top of this file.

#define ME_WARPS 4
#define ME_ROWS 32
// 64-value units of a k-chunk (one stage).
#define ME_UNITS 4
#define ME_STAGES 3
// Experts whose pair counts `moe_prep` keeps in shared memory; more count in the cursor array.
#define ME_SHARED_EXPERTS 4096

// Bytes of one row's k-chunk, of a staged row (16 bytes of padding: fewer bank conflicts between
// the 8 rows a fragment load touches) and of one warp's stage. TAG(moe-mma-smem): `moe_shared_bytes`
// in src/ops/mmq.rs.
constexpr int me_chunk_bytes(int qt) { return ME_UNITS * mq_raw_bytes(qt); }
constexpr int me_row_stride(int qt) { return me_chunk_bytes(qt) + 16; }
constexpr int me_stage_bytes(int qt) { return ME_ROWS * me_row_stride(qt); }

// A listed expert: its id, its first entry in the pair list, its pair count. Entry 0 of the list
// holds the number of listed experts in `e`.
struct __align__(16) MeExpert {
    int e, first, count, unused;
};

// Exclusive prefix sum of v over the block (blockDim.x a multiple of 32); `total` gets the sum.
__device__ __forceinline__ int me_block_scan(int v, int& total) {
    __shared__ int sums[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    int x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) sums[warp] = x;
    __syncthreads();
    if (warp == 0) {
        int w = lane < warps ? sums[lane] : 0;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += y;
        }
        sums[lane] = w;
    }
    __syncthreads();
    total = sums[warps - 1];
    const int before = x - v + (warp > 0 ? sums[warp - 1] : 0);
    __syncthreads();
    return before;
}

__device__ __forceinline__ int me_id(const Tensor& ids, u32 s, u32 n_used) {
    return __ldg((const int*)(ids.data + (i64)(s % n_used) * ids.nb[0] + (i64)(s / n_used) * ids.nb[1]));
}

// Pairs a thread of the grouping block reads ahead: the ids of ME_ID_BATCH pairs are loaded before
// any is counted, so that their latencies overlap (one load, then its atomic, an iteration kept
// the single grouping block waiting on each load in turn).
#define ME_ID_BATCH 8

// Calls f(s, id) for the pairs s = threadIdx.x + j blockDim.x < n_pairs, ME_ID_BATCH ids in flight.
template <typename F>
__device__ __forceinline__ void me_for_ids(const Tensor& ids, u32 n_pairs, u32 n_used, F f) {
    for (u32 s0 = threadIdx.x; s0 < n_pairs; s0 += ME_ID_BATCH * blockDim.x) {
        int id[ME_ID_BATCH];
#pragma unroll
        for (int j = 0; j < ME_ID_BATCH; j++) {
            const u32 s = s0 + j * blockDim.x;
            id[j] = s < n_pairs ? me_id(ids, s, n_used) : 0;
        }
#pragma unroll
        for (int j = 0; j < ME_ID_BATCH; j++) {
            const u32 s = s0 + j * blockDim.x;
            if (s < n_pairs) f(s, id[j]);
        }
    }
}

// moe_prep's grouping block. cnt: n_expert ints (shared memory or scratch).
__device__ void me_group(const Tensor& ids, int n_expert, int* cnt, int* offsets, int* list, MeExpert* listed, int max_pairs, u64 err, u32 op) {
    // pair and id counts fit u32: `moe_fits` keeps n_pairs <= i32::MAX
    const u32 n_used = (u32)ids.ne[0], n_pairs = (u32)(ids.ne[0] * ids.ne[1]);
    volatile int* vcnt = cnt;
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) vcnt[e] = 0;
    __syncthreads();
    me_for_ids(ids, n_pairs, n_used, [&](u32, int id) {
        if (id < 0 || id >= n_expert) {
            report_error((ErrorRecord*)err, ERR_INDEX_OUT_OF_RANGE, WHAT_EXPERT_ID, op, id, n_expert, 0, 0);
        } else {
            atomicAdd(cnt + id, 1);
        }
    });
    __syncthreads();
    // thread t owns experts [e0, e1)
    const int per = (n_expert + (int)blockDim.x - 1) / (int)blockDim.x;
    const int e0 = min(n_expert, (int)threadIdx.x * per), e1 = min(n_expert, e0 + per);
    int pairs = 0, busy = 0;
    for (int e = e0; e < e1; e++) {
        const int n = vcnt[e];
        pairs += n;
        busy += n > 0 && n <= max_pairs;
    }
    int total, n_listed;
    int at = me_block_scan(pairs, total);
    int slot = 1 + me_block_scan(busy, n_listed);
    for (int e = e0; e < e1; e++) {
        const int n = vcnt[e];
        offsets[e] = at;
        if (n > 0 && n <= max_pairs) listed[slot++] = MeExpert{e, at, n, 0};
        vcnt[e] = at;  // from here on the expert's cursor into the list
        at += n;
    }
    if (threadIdx.x == 0) {
        offsets[n_expert] = total;
        listed[0] = MeExpert{n_listed, 0, 0, 0};
    }
    __syncthreads();
    me_for_ids(ids, n_pairs, n_used, [&](u32 s, int id) {
        if (id >= 0 && id < n_expert) list[atomicAdd(cnt + id, 1)] = (int)s;
    });
}

// Grid: pack blocks + 1 (the last groups). Dynamic shared memory: n_expert ints when n_expert <=
// ME_SHARED_EXPERTS, else none (the counts go to `cursor`, n_expert ints of scratch). offsets:
// n_expert + 1 ints; list: n_used * T; listed: n_expert + 1 entries. x, xs: as mmq_pack_x (b's
// rows), or x null.
extern "C" __global__ void moe_prep(Tensor ids, i64 n_expert, int* offsets, int* cursor, int* list, MeExpert* listed, int max_pairs, Tensor b, char* x, float* xs, u64 err, u32 op) {
    grid_begin();
    extern __shared__ int me_counts[];
    if (blockIdx.x == gridDim.x - 1) {
        int* cnt = n_expert <= ME_SHARED_EXPERTS ? me_counts : cursor;
        me_group(ids, (int)n_expert, cnt, offsets, list, listed, max_pairs, err, op);
    } else if (x) {
        const i64 per_block = blockDim.x >> 5;
        mq_pack_rows(b, x, xs, blockIdx.x * per_block + (threadIdx.x >> 5), (i64)(gridDim.x - 1) * per_block);
    }
}

__device__ __forceinline__ u32 me_hmul2(u32 a, u32 b) {
    u32 r;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

// The E2M1 codes in the high nibbles of x's four bytes (sign bit 7, magnitude bits 4-6) as the
// high bytes of f16 value * 2^-14 (sign bit 7, magnitude bits 1-3; see above): three
// instructions for four values.
__device__ __forceinline__ u32 me_e2m1_hi(u32 x) { return (x & 0x80808080u) | ((x >> 3) & 0x0E0E0E0Eu); }

// The staged words a lane decodes of one 64-value unit of one row (`row`, 4-byte aligned): nvfp4
// the scale word and sub-block c's two code words; q8_0 both blocks' scales and the five words
// that hold its 8 + 8 quants. Loading them apart from the decode lets a warp issue a unit's
// shared-memory loads while it still decodes the previous one.
template <int QT>
struct MeRaw {
    u32 w[QT == DT_NVFP4 ? 3 : 7];
};
template <int QT>
__device__ __forceinline__ void me_raw_a(MeRaw<QT>& r, const char* row, int c) {
    const u32* w = (const u32*)row;
    if (QT == DT_NVFP4) {
        r.w[0] = w[0], r.w[1] = w[1 + 2 * c], r.w[2] = w[2 + 2 * c];
    } else {
        // block h: f16 scale at 34 h, quants from 34 h + 2; this lane's are 8c .. 8c + 7 of each
        // (block 0's start mid-word)
        r.w[0] = w[0], r.w[1] = w[8], r.w[2] = w[2 * c], r.w[3] = w[2 * c + 1], r.w[4] = w[2 * c + 2];
        r.w[5] = w[9 + 2 * c], r.w[6] = w[10 + 2 * c];
    }
}

// This lane's weights of a unit of one row, from its staged words, as f16 pairs: A[2j] and
// A[2j + 1] are the row's halves of step j's a0 / a2 (or a1 / a3) fragment registers, k-slots
// (2c, 2c + 1) and (2c + 8, 2c + 9).
template <int QT>
__device__ __forceinline__ void me_frag_a(u32 (&A)[8], const MeRaw<QT>& r, int c) {
    if (QT == DT_NVFP4) {
        // sub-block c: scale byte c, code bytes 4 + 8c .. (byte i: value i low, value i + 8 high)
        const u32 sw = r.w[0];
        const u32 d = mq_ue4m3_f16_div256((sw >> (8 * c)) & 0xFF);
        const u32 d2 = me_hmul2(d | (d << 16), 0x74007400u);  // scale * 2^6
#pragma unroll
        for (int h = 0; h < 2; h++) {
            // word h holds values 4h .. 4h + 3 (low nibbles) and 8 + 4h .. (high nibbles); each
            // byte of lo / hi becomes one value's f16 high byte (me_e2m1_hi), placed by byte_perm
            // above a zero low byte. Step j takes values 4j .. 4j + 3 as pairs (0, 1), (2, 3): the
            // activations' natural f16 pairs, whose two registers of a step come from one 16-byte
            // load (`me_frag_b`)
            const u32 w = r.w[1 + h], lo = me_e2m1_hi(w << 4), hi = me_e2m1_hi(w);
            A[2 * h + 0] = me_hmul2(__byte_perm(lo, 0u, 0x1404), d2);
            A[2 * h + 1] = me_hmul2(__byte_perm(lo, 0u, 0x3424), d2);
            A[2 * h + 4] = me_hmul2(__byte_perm(hi, 0u, 0x1404), d2);
            A[2 * h + 5] = me_hmul2(__byte_perm(hi, 0u, 0x3424), d2);
        }
    } else {
        const u32 s0 = r.w[0] & 0xFFFFu, s1 = r.w[1] >> 16, d0 = s0 | (s0 << 16), d1 = s1 | (s1 << 16);
        const u32 a = r.w[2], b = r.w[3], e = r.w[4];
        uint2 t = mq_q8x4_f16(__byte_perm(a, b, 0x5432), d0);
        A[0] = t.x, A[1] = t.y;
        t = mq_q8x4_f16(__byte_perm(b, e, 0x5432), d0);
        A[2] = t.x, A[3] = t.y;
        t = mq_q8x4_f16(r.w[5], d1);
        A[4] = t.x, A[5] = t.y;
        t = mq_q8x4_f16(r.w[6], d1);
        A[6] = t.x, A[7] = t.y;
    }
}

// The B fragment registers of one column for one 64-value unit, `xr` its packed f16 activations
// (16-byte aligned, natural order), in the order `me_frag_a` gives the weights: B[2j], B[2j + 1]
// are step j's b0, b1.
template <int QT>
__device__ __forceinline__ void me_frag_b(u32 (&B)[8], const char* xr, int c) {
    if (QT == DT_NVFP4) {
        // values 16c .. 16c + 15 as pairs (0, 1) .. (14, 15) in p.x .. q.w, in the weights' order
        const uint4 p = __ldg((const uint4*)(xr + 32 * c)), q = __ldg((const uint4*)(xr + 32 * c + 16));
        B[0] = p.x, B[1] = p.y, B[2] = p.z, B[3] = p.w;
        B[4] = q.x, B[5] = q.y, B[6] = q.z, B[7] = q.w;
    } else {
        // values 8c .. 8c + 7 of block 0, then of block 1
        const uint4 p = __ldg((const uint4*)(xr + 16 * c)), q = __ldg((const uint4*)(xr + 64 + 16 * c));
        B[0] = p.x, B[1] = p.y, B[2] = p.z, B[3] = p.w;
        B[4] = q.x, B[5] = q.y, B[6] = q.z, B[7] = q.w;
    }
}

// One work item: `rows` (<= ME_ROWS) weight rows from `w` (row m0 of its expert), the expert's
// pairs list[first .. first + count), n8 tiles a pass, and k-chunks over all passes (`units`);
// `up`: the rows are the up experts' (the second half of a gate-and-up launch).
struct MeItem {
    const char* w;
    i64 m0;
    int rows, first, count, nt, units, up;
};

// Item i of a launch: the listed experts' 32-row tiles of `as`, then (with `as_up`, `n_half`
// items each) the same tiles of the up experts, whose shape and strides are as's.
__device__ __forceinline__ MeItem me_item(const Tensor& as, const char* as_up, i64 n_half, const MeExpert* listed, i64 i, int tiles, int chunks) {
    MeItem it;
    it.up = i >= n_half;
    if (it.up) i -= n_half;
    const int4 ex = __ldg((const int4*)(listed + 1 + i / tiles));
    it.m0 = (i % tiles) * ME_ROWS;
    it.w = (it.up ? as_up : as.data) + ex.x * as.nb[2] + it.m0 * as.nb[1];
    it.rows = (int)min((i64)ME_ROWS, as.ne[1] - it.m0);
    it.first = ex.y, it.count = ex.z;
    it.nt = ex.z <= 8 ? 1 : ex.z <= 16 ? 2 : 4;
    it.units = (ex.z + 8 * it.nt - 1) / (8 * it.nt) * chunks;
    return it;
}

// A warp's copies: the k-chunks of its items in the order the warp multiplies them, chunk n into
// stage n mod ME_STAGES of the warp's ring, one cp.async commit group a chunk. Four lanes copy a
// row's chunk, 64 contiguous bytes an instruction (eight rows at once): a lane's addresses are its
// row's plus constants (a few instructions a piece), and an instruction still reads whole runs of
// sectors. Rows past the item's are zero-filled.
template <int QT>
struct MeLoader {
    MeItem it;
    const char* as_up;
    i64 i, n_items, n_half, step;
    int tiles, chunks, q;
    // the shared address of the warp's ring
    u32 ring;

    // Copies the next k-chunk (if any) into stage s; always commits a group, so that the wait
    // counts stay in step.
    __device__ __forceinline__ void issue(const Tensor& as, const MeExpert* listed, int s) {
        constexpr int CB = me_chunk_bytes(QT), PIECES = CB / 16, STRIDE = me_row_stride(QT), STAGE = me_stage_bytes(QT);
        static_assert(ME_ROWS % 8 == 0, "eight rows an instruction");
        if (i < n_items) {
            // lane: row lane / 4 + 8 r, pieces lane % 4 + 4 j
            const int lane = threadIdx.x & 31, row = lane >> 2, p0 = lane & 3;
            const char* src = it.w + row * as.nb[1] + (i64)(q % chunks) * CB + 16 * p0;
            const u32 dst = ring + s * STAGE + row * STRIDE + 16 * p0;
#pragma unroll
            for (int r = 0; r < ME_ROWS / 8; r++) {
                const bool valid = row + 8 * r < it.rows;
                const char* from = valid ? src + 8 * r * as.nb[1] : it.w;
#pragma unroll
                for (int j = 0; j < (PIECES + 3) / 4; j++) {
                    if (p0 + 4 * j < PIECES) tc_cp16_at(dst + 8 * r * STRIDE + 64 * j, from + 64 * j, valid);
                }
            }
            if (++q == it.units) {
                q = 0;
                i += step;
                if (i < n_items) it = me_item(as, as_up, n_half, listed, i, tiles, chunks);
            }
        }
        tc_commit();
    }

    // Waits until this lane's copies of the oldest chunk in flight have landed (the caller's warp
    // barrier makes that every lane's).
    __device__ __forceinline__ void wait() { tc_wait<ME_STAGES - 2>(); }
};

// Packed activation row of pair s.
__device__ __forceinline__ i64 me_xrow(u32 s, u32 n_used, u32 n_b) {
    const u32 u = s % n_used, t = s / n_used;
    return (i64)(u % n_b) + (i64)n_b * t;
}

// The staged words of one 64-value unit (`ub`) of a chunk (`st`) for rows g, g + 8 of both m16 tiles.
template <int QT>
struct MeUnit {
    MeRaw<QT> r[2][2];
};
template <int QT>
__device__ __forceinline__ void me_load_unit(MeUnit<QT>& u, const char* st, int ub) {
    constexpr int STRIDE = me_row_stride(QT), RAW = mq_raw_bytes(QT);
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
#pragma unroll
    for (int mt = 0; mt < 2; mt++) {
#pragma unroll
        for (int h = 0; h < 2; h++) me_raw_a<QT>(u.r[mt][h], st + (mt * 16 + h * 8 + g) * STRIDE + ub * RAW, c);
    }
}

// A unit's weights (its staged words) times the B fragments of its NT n8 tiles, into the
// accumulators of both m16 tiles.
template <int QT, int NT>
__device__ __forceinline__ void me_mma_unit(float (&acc)[2][NT][4], const u32 (&B)[NT][8], const MeUnit<QT>& u) {
    const int c = threadIdx.x & 3;
#pragma unroll
    for (int mt = 0; mt < 2; mt++) {
        u32 lo[8], hi[8];
        me_frag_a<QT>(lo, u.r[mt][0], c);
        me_frag_a<QT>(hi, u.r[mt][1], c);
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const u32 a[4] = {lo[2 * j], hi[2 * j], lo[2 * j + 1], hi[2 * j + 1]};
#pragma unroll
            for (int nt = 0; nt < NT; nt++) tc_mma_f16(acc[mt][nt], a, B[nt][2 * j], B[nt][2 * j + 1]);
        }
    }
}

// The B fragments of unit u (counted over the whole row) of each n8 tile's column.
template <int QT, int NT>
__device__ __forceinline__ void me_load_b(u32 (&B)[NT][8], const char* const (&xcol)[NT], int u) {
    const int c = threadIdx.x & 3;
#pragma unroll
    for (int nt = 0; nt < NT; nt++) me_frag_b<QT>(B[nt], xcol[nt] + (i64)u * 128, c);
}

// The warp's passes over one item (NT n8 tiles a pass), consuming its chunks from the ring. The
// activations (B fragments, read through L1 from L2) are loaded a unit ahead of the unit that
// multiplies them, into a second set of registers, so that their latency overlaps the previous
// unit's decode and mma (four units a chunk in order, each starting with its own loads, left
// the warp stalled on them); with NT = 1 and nvfp4 the unit's staged weight words too. The wider
// passes keep fewer sets: every path of the kernel shares its register count, which with 168
// still allows three blocks a multiprocessor.
template <int QT, int NT>
__device__ __forceinline__ void me_run_item(const MeItem& it, MeLoader<QT>& ld, const Tensor& as, const MeExpert* listed, char* ring, int& slot, const char* x, const float* xs, u32 n_used, u32 n_b, const int* list, const Tensor& out) {
    constexpr int STAGE = me_stage_bytes(QT);
    constexpr bool AHEAD = NT <= 2, AHEAD_A = NT == 1 && QT == DT_NVFP4;
    static_assert(ME_UNITS % 2 == 0, "units go in pairs");
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const i64 xbytes = 2 * as.ne[0];
    const float back = QT == DT_NVFP4 ? 256.0f : 1.0f;
    const int n_units = ld.chunks * ME_UNITS;
    for (int p0 = 0; p0 < it.count; p0 += 8 * NT) {
        const int np = min(8 * NT, it.count - p0);
        const int* pairs = list + it.first + p0;
        // column g of each n8 tile (past the pass's pairs: its last pair, not stored)
        const char* xcol[NT];
#pragma unroll
        for (int nt = 0; nt < NT; nt++) xcol[nt] = x + me_xrow((u32)__ldg(pairs + min(8 * nt + g, np - 1)), n_used, n_b) * xbytes;
        float acc[2][NT][4];
#pragma unroll
        for (int mt = 0; mt < 2; mt++) {
#pragma unroll
            for (int nt = 0; nt < NT; nt++) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.0f;
        }
        u32 B0[NT][8], B1[NT][8];
        if (AHEAD) me_load_b<QT, NT>(B0, xcol, 0);
        for (int ch = 0; ch < ld.chunks; ch++) {
            // this chunk has landed (every lane's copies: the warp barrier), and every lane is done
            // with the stage the next copies refill
            ld.wait();
            __syncwarp();
            ld.issue(as, listed, slot == 0 ? ME_STAGES - 1 : slot - 1);
            const char* st = ring + slot * STAGE;
            // two units an iteration, ping-ponging B0 / B1 and U0 / U1 (not unrolled further:
            // unrolled, the loads of all four units were hoisted into 240 registers)
            MeUnit<QT> U0, U1;
            if (AHEAD_A) me_load_unit<QT>(U0, st, 0);
#pragma unroll 1
            for (int ub = 0; ub < ME_UNITS; ub += 2) {
                const int u = ch * ME_UNITS + ub;
                me_load_b<QT, NT>(AHEAD ? B1 : B0, xcol, AHEAD ? u + 1 : u);
                me_load_unit<QT>(AHEAD_A ? U1 : U0, st, AHEAD_A ? ub + 1 : ub);
                me_mma_unit<QT, NT>(acc, B0, U0);
                if (!AHEAD || u + 2 < n_units) me_load_b<QT, NT>(B0, xcol, AHEAD ? u + 2 : u + 1);
                if (!AHEAD_A) me_load_unit<QT>(U1, st, ub + 1);
                else if (ub + 2 < ME_UNITS) me_load_unit<QT>(U0, st, ub + 2);
                me_mma_unit<QT, NT>(acc, AHEAD ? B1 : B0, U1);
            }
            slot = slot + 1 == ME_STAGES ? 0 : slot + 1;
        }
        // accumulator (i, j) of an n8 tile: row g + 8 (i / 2), column 2c + i % 2
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int p = 8 * nt + 2 * c + e;
                if (p >= np) continue;
                const u32 s = (u32)__ldg(pairs + p), u = s % n_used, t = s / n_used;
                const float f = back * __ldg(xs + me_xrow(s, n_used, n_b));
                char* o = out.data + u * out.nb[1] + t * out.nb[2];
#pragma unroll
                for (int mt = 0; mt < 2; mt++) {
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        const int r = mt * 16 + h * 8 + g;
                        if (r < it.rows) *(float*)(o + (it.m0 + r) * out.nb[0]) = acc[mt][nt][2 * h + e] * f;
                    }
                }
            }
        }
    }
}

// out[:, u, t] = as[:, :, e]^T b[:, u mod n_b, t] for the pairs of the experts `moe_prep` listed,
// x, xs the packed rows of b. as: [K, N, E] q8_0 / nvfp4, K % 256 == 0, 16-byte aligned rows and
// experts. With `as_up` (not null: experts of as's shape and strides, mul_mat_id_swiglu's up
// experts) the same products of those go to `out_up`, in the same launch over the same grouping.
// Grid: any number of blocks of ME_WARPS warps (the host: one wave); dynamic shared memory
// ME_WARPS * ME_STAGES * me_stage_bytes.
template <int QT>
__device__ __forceinline__ void moe_mma_body(Tensor as, const char* as_up, const char* x, const float* xs, i64 n_used, i64 n_b, const int* list, const MeExpert* listed, Tensor out, Tensor out_up) {
    extern __shared__ __align__(16) char me_smem[];
    constexpr int STAGE = me_stage_bytes(QT);
    const int warp = threadIdx.x >> 5;
    MeLoader<QT> ld;
    ld.chunks = (int)(as.ne[0] / (64 * ME_UNITS));
    ld.tiles = (int)((as.ne[1] + ME_ROWS - 1) / ME_ROWS);
    ld.as_up = as_up;
    ld.n_half = (i64)__ldg(&listed[0].e) * ld.tiles;
    ld.n_items = as_up ? 2 * ld.n_half : ld.n_half;
    ld.step = (i64)gridDim.x * ME_WARPS;
    ld.i = (i64)blockIdx.x * ME_WARPS + warp;
    ld.q = 0;
    if (ld.i >= ld.n_items) return;
    ld.it = me_item(as, as_up, ld.n_half, listed, ld.i, ld.tiles, ld.chunks);
    char* ring = me_smem + warp * ME_STAGES * STAGE;
    ld.ring = tc_smem(ring);
#pragma unroll
    for (int s = 0; s < ME_STAGES - 1; s++) ld.issue(as, listed, s);
    int slot = 0;
    for (i64 i = (i64)blockIdx.x * ME_WARPS + warp; i < ld.n_items; i += ld.step) {
        const MeItem it = me_item(as, as_up, ld.n_half, listed, i, ld.tiles, ld.chunks);
        const Tensor& o = it.up ? out_up : out;
        if (it.nt == 1) {
            me_run_item<QT, 1>(it, ld, as, listed, ring, slot, x, xs, (u32)n_used, (u32)n_b, list, o);
        } else if (it.nt == 2) {
            me_run_item<QT, 2>(it, ld, as, listed, ring, slot, x, xs, (u32)n_used, (u32)n_b, list, o);
        } else {
            me_run_item<QT, 4>(it, ld, as, listed, ring, slot, x, xs, (u32)n_used, (u32)n_b, list, o);
        }
    }
    tc_wait<0>();
}

extern "C" __global__ void __launch_bounds__(ME_WARPS * 32) moe_mma_q8_0(Tensor as, const char* as_up, const char* x, const float* xs, i64 n_used, i64 n_b, const int* list, const MeExpert* listed, Tensor out, Tensor out_up) {
    grid_begin();
    moe_mma_body<DT_Q8_0>(as, as_up, x, xs, n_used, n_b, list, listed, out, out_up);
}
extern "C" __global__ void __launch_bounds__(ME_WARPS * 32) moe_mma_nvfp4(Tensor as, const char* as_up, const char* x, const float* xs, i64 n_used, i64 n_b, const int* list, const MeExpert* listed, Tensor out, Tensor out_up) {
    grid_begin();
    moe_mma_body<DT_NVFP4>(as, as_up, x, xs, n_used, n_b, list, listed, out, out_up);
}
