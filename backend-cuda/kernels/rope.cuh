// rope.cuh: the rotary angles and the rotation of one element, shared by rope.cu (rope_multi) and
// fused.cu (rms_norm_mul_rope), so the fused op rotates exactly as rope_multi after rms_norm_mul.
//
// Pair p rotates dims (a, b) = Neox (p, p + n_rot/2) or Adjacent (2p, 2p + 1) by theta = pos *
// base^(-2p / n_rot). Like the CPU, theta and its sine and cosine are computed in f64 and rounded
// to f32 (large positions lose nothing to an f32 angle); the rotation itself is f32.

#define ROPE_NEOX 0
#define ROPE_ADJACENT 1

// The position stream of pair `pair` (ggml's interleaved imrope rule on s = pair mod sum).
__device__ __forceinline__ int rope_stream(int has_sections, int s0, int s1, int s2, int s3, int pair) {
    if (!has_sections) return 0;
    int s = pair % (s0 + s1 + s2 + s3);
    if (s % 3 == 1 && s < 3 * s1) return 1;
    if (s % 3 == 2 && s < 3 * s2) return 2;
    if (s % 3 == 0 && s < 3 * s0) return 0;
    return 3;
}

// Token t's n_rot / 2 cosines, then n_rot / 2 sines, into `table` (the block's threads share the
// pairs; the caller synchronises before reading). pos: i32, n_tokens a stream, stream-major.
__device__ __forceinline__ void rope_table(float* table, const Tensor& pos, i64 t, i64 n_tokens, int n_rot, float freq_base, int has_sections, int s0, int s1, int s2, int s3) {
    const int half = n_rot >> 1;
    for (int p = threadIdx.x; p < half; p += blockDim.x) {
        int stream = rope_stream(has_sections, s0, s1, s2, s3, p);
        double position = (double)*(const int*)(pos.data + (stream * n_tokens + t) * pos.nb[0]);
        double inv_freq = pow((double)freq_base, (-2.0 * (double)p) / (double)n_rot);
        double sn, cs;
        sincos(position * inv_freq, &sn, &cs);
        table[p] = (float)cs;
        table[half + p] = (float)sn;
    }
}

// Element i0 (< n_rot) of a head after the rotation: its pair's elements come from `at(a)`,
// `at(b)` (dims a < b of pair p), the angle from `table`.
template <class At>
__device__ __forceinline__ float rope_rotated(int i0, int n_rot, int pairing, const float* table, At at) {
    const int half = n_rot >> 1;
    int p, a, b;
    if (pairing == ROPE_NEOX) {
        p = i0 < half ? i0 : i0 - half;
        a = p;
        b = p + half;
    } else {
        p = i0 >> 1;
        a = 2 * p;
        b = a + 1;
    }
    const float xa = at(a), xb = at(b), c = table[p], s = table[half + p];
    return i0 == a ? xa * c - xb * s : xa * s + xb * c;
}
