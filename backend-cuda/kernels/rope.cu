// rope.cu: rope_multi, rotary position embedding over the first n_rot dims of each head.
//
// x [head_dim, n_head, n_tokens, 1] (any float dtype, any strides), positions i32 [n_tokens] or
// [4 * n_tokens] stream-major (t, h, w, e) with sections; output f32 of x's shape. Pair p rotates
// dims (a, b) = Neox (p, p + n_rot/2) or Adjacent (2p, 2p + 1) by theta = pos * base^(-2p / n_rot).
// Like the CPU, theta and its sine and cosine are computed in f64 and rounded to f32 (large
// positions lose nothing to an f32 angle); the rotation itself is f32.
//
// Grid (n_tokens, head groups): a block computes its token's n_rot / 2 (cos, sin) into shared
// memory once, then writes every element of its heads (dims from n_rot on are copied).

#define ROPE_NEOX 0
#define ROPE_ADJACENT 1

// The position stream of pair `pair` (ggml's interleaved imrope rule on s = pair mod sum).
// TAG(rope-angle): fused.cu's rms_norm_mul_rope repeats this rule, the angle table and the
// rotation below, so the fused op matches rope_multi after rms_norm_mul.
__device__ __forceinline__ int rope_stream(int has_sections, int s0, int s1, int s2, int s3, int pair) {
    if (!has_sections) return 0;
    int s = pair % (s0 + s1 + s2 + s3);
    if (s % 3 == 1 && s < 3 * s1) return 1;
    if (s % 3 == 2 && s < 3 * s2) return 2;
    if (s % 3 == 0 && s < 3 * s0) return 0;
    return 3;
}

extern "C" __global__ void rope_multi(Tensor dst, Tensor src, int src_dt, Tensor pos, int n_rot, float freq_base, int pairing, int has_sections, int s0, int s1, int s2, int s3, int heads_per_block) {
    grid_begin();
    extern __shared__ float table[];  // n_rot / 2 cosines, then n_rot / 2 sines
    int half = n_rot >> 1;
    i64 t = blockIdx.x, n_tokens = src.ne[2];
    for (int p = threadIdx.x; p < half; p += blockDim.x) {
        int stream = rope_stream(has_sections, s0, s1, s2, s3, p);
        double position = (double)*(const int*)(pos.data + (stream * n_tokens + t) * pos.nb[0]);
        double inv_freq = pow((double)freq_base, (-2.0 * (double)p) / (double)n_rot);
        double sn, cs;
        sincos(position * inv_freq, &sn, &cs);
        table[p] = (float)cs;
        table[half + p] = (float)sn;
    }
    __syncthreads();
    i64 ne0 = src.ne[0];
    i64 h0 = (i64)blockIdx.y * heads_per_block;
    i64 nh = min((i64)heads_per_block, src.ne[1] - h0);
    // 32-bit index math: nh * ne0 is one block's heads (the host keeps it below 2^31).
    int ne0i = (int)ne0, total = (int)(nh * ne0);
    for (int e = threadIdx.x; e < total; e += blockDim.x) {
        int hi = e / ne0i, i0 = e - hi * ne0i;
        i64 h = h0 + hi;
        const char* x = src.data + h * src.nb[1] + t * src.nb[2];
        float out;
        if (i0 < n_rot) {
            int p, a, b;
            if (pairing == ROPE_NEOX) {
                p = (int)(i0 < half ? i0 : i0 - half);
                a = p;
                b = p + half;
            } else {
                p = (int)(i0 >> 1);
                a = 2 * p;
                b = a + 1;
            }
            float xa = load_f32(x + a * src.nb[0], src_dt), xb = load_f32(x + b * src.nb[0], src_dt);
            float c = table[p], s = table[half + p];
            out = i0 == a ? xa * c - xb * s : xa * s + xb * c;
        } else {
            out = load_f32(x + i0 * src.nb[0], src_dt);
        }
        *(float*)(dst.data + i0 * dst.nb[0] + h * dst.nb[1] + t * dst.nb[2]) = out;
    }
}
