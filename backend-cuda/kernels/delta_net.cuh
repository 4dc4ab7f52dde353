// delta_net.cuh: what gated_delta_net's serial kernels (delta_net.cu) and its chunked ones
// (delta_net_chunked.cu) share: a sequence's token span and which kernel runs it.

// A sequence's tokens: dense (`offsets.data` null) all n_t tokens of outer index s; ragged tokens
// seq_offsets[s] .. seq_offsets[s + 1] of outer index 0. Activations are read and outputs written
// at (.., token, outer).
struct GdnSpan {
    i64 begin, end, outer;
};
__device__ __forceinline__ GdnSpan gdn_span(const Tensor& offsets, i64 s, i64 n_t) {
    if (offsets.data == nullptr) return GdnSpan{0, n_t, s};
    return GdnSpan{seq_offset(offsets, s, n_t), seq_offset(offsets, s + 1, n_t), 0};
}

// Whether a kernel that takes sequences of len_min ..= len_max tokens runs a sequence of `len`:
// a ragged call splits its sequences by length between kernels (decode tokens to the plain serial
// kernel, longer ones to the tiled or the chunked kernels); a sequence without tokens runs nowhere.
__device__ __forceinline__ bool gdn_runs(i64 len, i64 len_min, i64 len_max) {
    return len > 0 && len >= len_min && len <= len_max;
}
