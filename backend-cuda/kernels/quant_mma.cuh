// quant_mma.cuh: what the tensor-core kernels of quantized weights share (`mmq.cu`, the tiled
// GEMM, and `moe_mma.cu`, the routed experts with few pairs each): the packed f16 activations,
// the raw bytes of a row's 64 values, and the f16 decoding of q8_0 quants and UE4M3 scales. The
// accuracy of f16 operands is discussed at the top of mmq.cu.

// Values of a k-tile, and bytes of a k-tile's packed f16 activations (one 128-byte row).
#define MQ_BK 64
#define MQ_ROW 128

// Raw weight bytes of one row's k-tile: two q8_0 blocks or one nvfp4 block (68 or 36: 4 more than
// a multiple of 16, and 4-byte aligned).
constexpr int mq_raw_bytes(int qt) { return qt == DT_Q8_0 ? 2 * Q8_0_BYTES : NVFP4_BYTES; }

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
