// moe_mma.cu: mul_mat_id with few pairs per expert (a batch of decode steps, a short prefill):
// each routed expert's weights are read from memory once and multiplied by all of its (slot,
// token) pairs on tensor cores (`moe_mma_q8_0` / `moe_mma_nvfp4`), after `moe_prep` grouped the
// pairs and packed the activations in one launch. (With a few pairs an expert, the tiled kernels
// of mmq.cu would do 128-column tiles for a handful of columns, and a warp-per-row GEMV re-decodes
// a row per pair.)
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
// `mq_q8x4_f16` (one rounding, as the tiled kernels): the error budget at the top of mmq.cu.

#define ME_WARPS 4
#define ME_ROWS 32
// 64-value units of a k-chunk (one stage).
#define ME_UNITS 4
#define ME_STAGES 3
// Experts whose pair counts `moe_prep` keeps in shared memory; more count in the cursor array.
#define ME_SHARED_EXPERTS 4096

// Bytes of one row's k-chunk, of a staged row (16 bytes of padding: fewer bank conflicts between
// the 8 rows a fragment load touches) and of one warp's stage. TAG(moe-mma-smem): `moe_shared_bytes`
// in src/ops/matmul/moe_mma.rs.
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
__device__ __forceinline__ MeItem me_item(const Tensor& as, const char* as_up, i64 n_half, const MeExpert* listed, i64 i, int tiles, int chunks, int nt_max) {
    MeItem it;
    it.up = i >= n_half;
    if (it.up) i -= n_half;
    const int4 ex = __ldg((const int4*)(listed + 1 + i / tiles));
    it.m0 = (i % tiles) * ME_ROWS;
    it.w = (it.up ? as_up : as.data) + ex.x * as.nb[2] + it.m0 * as.nb[1];
    it.rows = (int)min((i64)ME_ROWS, as.ne[1] - it.m0);
    it.first = ex.y, it.count = ex.z;
    it.nt = min(nt_max, ex.z <= 8 ? 1 : ex.z <= 16 ? 2 : 4);
    it.units = (ex.z + 8 * it.nt - 1) / (8 * it.nt) * chunks;
    return it;
}

// A warp's copies: the k-chunks of its items in the order the warp multiplies them, chunk n into
// stage n mod S of the warp's ring (S stages: ME_STAGES, or 2 in the narrow entries), one cp.async commit group a chunk. Four lanes copy a
// row's chunk, 64 contiguous bytes an instruction (eight rows at once): a lane's addresses are its
// row's plus constants (a few instructions a piece), and an instruction still reads whole runs of
// sectors. Rows past the item's are zero-filled.
template <int QT, int S>
struct MeLoader {
    MeItem it;
    const char* as_up;
    i64 i, n_items, n_half, step;
    int tiles, chunks, nt_max, q;
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
                if (i < n_items) it = me_item(as, as_up, n_half, listed, i, tiles, chunks, nt_max);
            }
        }
        tc_commit();
    }

    // Waits until this lane's copies of the oldest chunk in flight have landed (the caller's warp
    // barrier makes that every lane's).
    __device__ __forceinline__ void wait() { tc_wait<S - 2>(); }
};

// Where a pass writes: `out`, or `out_up` for the up experts' items, selected field by field (a
// reference to either kernel parameter made the compiler copy both to local memory and read
// their fields back from there).
struct MeOut {
    char* data;
    i64 nb0, nb1, nb2;
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
template <int QT, int NT, int S>
__device__ __forceinline__ void me_run_item(const MeItem& it, MeLoader<QT, S>& ld, const Tensor& as, const MeExpert* listed, char* ring, int& slot, const char* x, const float* xs, u32 n_used, u32 n_b, const int* list, const MeOut& out) {
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
            ld.issue(as, listed, slot == 0 ? S - 1 : slot - 1);
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
            slot = slot + 1 == S ? 0 : slot + 1;
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
                char* o = out.data + u * out.nb1 + t * out.nb2;
#pragma unroll
                for (int mt = 0; mt < 2; mt++) {
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        const int r = mt * 16 + h * 8 + g;
                        if (r < it.rows) *(float*)(o + (it.m0 + r) * out.nb0) = acc[mt][nt][2 * h + e] * f;
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
// S stages a warp's ring; N1: one n8 tile a pass (experts of more than 8 pairs take more
// passes). Grid: any number of blocks of ME_WARPS warps (the host: one wave); dynamic shared
// memory ME_WARPS * S * me_stage_bytes.
template <int QT, int S, bool N1>
__device__ __forceinline__ void moe_mma_body(Tensor as, const char* as_up, const char* x, const float* xs, i64 n_used, i64 n_b, const int* list, const MeExpert* listed, Tensor out, Tensor out_up) {
    extern __shared__ __align__(16) char me_smem[];
    constexpr int STAGE = me_stage_bytes(QT);
    const int warp = threadIdx.x >> 5;
    MeLoader<QT, S> ld;
    ld.nt_max = N1 ? 1 : 4;
    ld.chunks = (int)(as.ne[0] / (64 * ME_UNITS));
    ld.tiles = (int)((as.ne[1] + ME_ROWS - 1) / ME_ROWS);
    ld.as_up = as_up;
    ld.n_half = (i64)__ldg(&listed[0].e) * ld.tiles;
    ld.n_items = as_up ? 2 * ld.n_half : ld.n_half;
    ld.step = (i64)gridDim.x * ME_WARPS;
    ld.i = (i64)blockIdx.x * ME_WARPS + warp;
    ld.q = 0;
    if (ld.i >= ld.n_items) return;
    ld.it = me_item(as, as_up, ld.n_half, listed, ld.i, ld.tiles, ld.chunks, ld.nt_max);
    char* ring = me_smem + warp * S * STAGE;
    ld.ring = tc_smem(ring);
#pragma unroll
    for (int s = 0; s < S - 1; s++) ld.issue(as, listed, s);
    int slot = 0;
    for (i64 i = (i64)blockIdx.x * ME_WARPS + warp; i < ld.n_items; i += ld.step) {
        const MeItem it = me_item(as, as_up, ld.n_half, listed, i, ld.tiles, ld.chunks, ld.nt_max);
        const bool up = it.up;
        const MeOut o{up ? out_up.data : out.data, up ? out_up.nb[0] : out.nb[0], up ? out_up.nb[1] : out.nb[1],
                      up ? out_up.nb[2] : out.nb[2]};
        if (N1 || it.nt == 1) {
            me_run_item<QT, 1, S>(it, ld, as, listed, ring, slot, x, xs, (u32)n_used, (u32)n_b, list, o);
        } else if (it.nt == 2) {
            me_run_item<QT, 2, S>(it, ld, as, listed, ring, slot, x, xs, (u32)n_used, (u32)n_b, list, o);
        } else {
            me_run_item<QT, 4, S>(it, ld, as, listed, ring, slot, x, xs, (u32)n_used, (u32)n_b, list, o);
        }
    }
    tc_wait<0>();
}

// The entries: any pair counts (three stages a warp, 168 registers: three blocks a
// multiprocessor by registers and shared memory alike), and `_n1` for launches whose experts
// have at most 8 pairs (at most 8 tokens): one n8 tile a pass and two stages, so that four blocks
// fit (the host picks; both are correct for any pairs).
#define ME_PARAMS                                                                                            \
    Tensor as, const char *as_up, const char *x, const float *xs, i64 n_used, i64 n_b, const int *list,      \
        const MeExpert *listed, Tensor out, Tensor out_up
#define ME_ARGS as, as_up, x, xs, n_used, n_b, list, listed, out, out_up
extern "C" __global__ void __launch_bounds__(ME_WARPS * 32) moe_mma_q8_0(ME_PARAMS) {
    grid_begin();
    moe_mma_body<DT_Q8_0, ME_STAGES, false>(ME_ARGS);
}
extern "C" __global__ void __launch_bounds__(ME_WARPS * 32) moe_mma_nvfp4(ME_PARAMS) {
    grid_begin();
    moe_mma_body<DT_NVFP4, ME_STAGES, false>(ME_ARGS);
}
extern "C" __global__ void __launch_bounds__(ME_WARPS * 32, 4) moe_mma_q8_0_n1(ME_PARAMS) {
    grid_begin();
    moe_mma_body<DT_Q8_0, 2, true>(ME_ARGS);
}
extern "C" __global__ void __launch_bounds__(ME_WARPS * 32, 4) moe_mma_nvfp4_n1(ME_PARAMS) {
    grid_begin();
    moe_mma_body<DT_NVFP4, 2, true>(ME_ARGS);
}
