// rope.cu: rope_multi, rotary position embedding over the first n_rot dims of each head.
//
// x [head_dim, n_head, n_tokens, 1] (any float dtype, any strides), positions i32 [n_tokens] or
// [4 * n_tokens] stream-major (t, h, w, e) with sections; output f32 of x's shape. The angles and
// the rotation are rope.cuh's.
//
// Grid (n_tokens, head groups): a block computes its token's n_rot / 2 (cos, sin) into shared
// memory once, then writes every element of its heads (dims from n_rot on are copied).

extern "C" __global__ void rope_multi(Tensor dst, Tensor src, int src_dt, Tensor pos, int n_rot, float freq_base, int pairing, int has_sections, int s0, int s1, int s2, int s3, int heads_per_block) {
    grid_begin();
    extern __shared__ float table[];  // n_rot / 2 cosines, then n_rot / 2 sines
    i64 t = blockIdx.x;
    rope_table(table, pos, t, src.ne[2], n_rot, freq_base, has_sections, s0, s1, s2, s3);
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
            out = rope_rotated(i0, n_rot, pairing, table, [&](int d) { return load_f32(x + d * src.nb[0], src_dt); });
        } else {
            out = load_f32(x + i0 * src.nb[0], src_dt);
        }
        *(float*)(dst.data + i0 * dst.nb[0] + h * dst.nb[1] + t * dst.nb[2]) = out;
    }
}
