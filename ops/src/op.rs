//! The op vocabulary: one enum, typed parameters, stable names.
//!
//! Ops are data: [`Op`] and every params type are `Eq + Hash`, so a pass can key a map by an op
//! and a backend can compare the ops of two steps. **Floats compare and hash by their bits**
//! ([`f32::to_bits`]): `0.0` and `-0.0` are different parameters, and a NaN equals a NaN with the
//! same bit pattern (so every op equals itself, as `Eq` requires). Two ops are equal exactly when
//! they compute the same thing bit for bit.

use std::fmt;
use std::hash::{Hash, Hasher};
use std::mem;

use crate::DType;
use crate::elem_program::ElemProgram;

/// Elementwise functions of one input.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum UnaryOp {
    /// `-x`
    Neg,
    /// `e^x`
    Exp,
    /// `x * sigmoid(x)`
    Silu,
    /// `1 / (1 + e^-x)`
    Sigmoid,
    /// `ln(1 + e^x)`
    Softplus,
}

impl UnaryOp {
    pub const ALL: [UnaryOp; 5] = [UnaryOp::Neg, UnaryOp::Exp, UnaryOp::Silu, UnaryOp::Sigmoid, UnaryOp::Softplus];

    pub const fn name(self) -> &'static str {
        match self {
            UnaryOp::Neg => "neg",
            UnaryOp::Exp => "exp",
            UnaryOp::Silu => "silu",
            UnaryOp::Sigmoid => "sigmoid",
            UnaryOp::Softplus => "softplus",
        }
    }
}

/// Elementwise functions of two inputs; the second broadcasts to the first (ggml's repeat rule).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
}

impl BinaryOp {
    pub const ALL: [BinaryOp; 4] = [BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Div];

    pub const fn name(self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "sub",
            BinaryOp::Mul => "mul",
            BinaryOp::Div => "div",
        }
    }
}

/// A strided window onto the source tensor's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ViewParams {
    /// Shape of the view, ggml order.
    pub ne: [usize; 4],
    /// Byte strides of the view; `nb[0]` must be the dtype's block size in bytes.
    pub nb: [usize; 4],
    /// Byte offset of the view's first element from the source's first element.
    pub offset: usize,
}

/// `y = x * scale + bias`.
#[derive(Debug, Clone, Copy)]
pub struct ScaleParams {
    pub scale: f32,
    pub bias: f32,
}

/// Root-mean-square normalisation over `ne[0]`: `y = x / sqrt(mean(x^2) + eps)`.
#[derive(Debug, Clone, Copy)]
pub struct RmsNormParams {
    pub eps: f32,
}

/// Softmax over `ne[0]` of `x * scale + mask` (the mask is an optional second input).
#[derive(Debug, Clone, Copy)]
pub struct SoftmaxParams {
    pub scale: f32,
}

/// How rotary dimensions are paired.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RopePairing {
    /// `(x[i], x[i + n_rot/2])`: split halves (GPT-NeoX; what Qwen3.5 uses).
    Neox,
    /// `(x[2i], x[2i + 1])`: adjacent pairs (original GPT-J / ggml "normal" mode).
    Adjacent,
}

/// Rotary position embedding over the first `n_rot` dims of each head.
#[derive(Debug, Clone, Copy)]
pub struct RopeParams {
    /// Rotated dims per head (even, at most `ne[0]`); the rest pass through.
    pub n_rot: usize,
    /// `theta_p = pos * freq_base^(-2p / n_rot)` for pair `p`.
    pub freq_base: f32,
    pub pairing: RopePairing,
    /// `None`: one position per token (`positions` i32 `[n_tokens]`). `Some(sections)`:
    /// interleaved multi-section rope (Qwen3.5 "imrope", ggml's `GGML_ROPE_TYPE_IMROPE`):
    /// `positions` i32 `[4 * n_tokens]`, stream-major (t, h, w, e), and pair `p` takes its
    /// position from the stream chosen by `s = p mod sum(sections)`: h if `s % 3 == 1` and
    /// `s < 3 s1`, else w if `s % 3 == 2` and `s < 3 s2`, else t if `s % 3 == 0` and `s < 3 s0`,
    /// else e (see docs/OPS.md). The sum must be positive.
    pub sections: Option<[usize; 4]>,
}

/// `rope_multi(mul(rms_norm(x, norm.eps), w), positions, rope)`: the per-head q/k norm of
/// attention, its weight and the rotation, as one op (`Op::RmsNormMulRope`).
#[derive(Debug, Clone, Copy)]
pub struct RmsNormMulRopeParams {
    pub norm: RmsNormParams,
    pub rope: RopeParams,
}

/// Attention: `softmax(scale * q k^T + mask) v` with optional logit softcapping.
#[derive(Debug, Clone, Copy)]
pub struct FlashAttnParams {
    pub scale: f32,
    /// When > 0, logits become `softcap * tanh(logit / softcap)` (after `scale`, before the mask).
    pub softcap: f32,
    /// A mask input follows `v`.
    pub mask: bool,
    /// A block-table input follows the mask: K/V are read through it from a shared paged cache.
    pub paged: bool,
    /// Ragged (varlen) token batch: `q` packs the tokens of all sequences (`[d_k, n_tokens,
    /// n_head, 1]`) and two i32 inputs come last, `seq_offsets [n_seq + 1]` and `kv_lens [n_seq]`;
    /// attention is causal, bottom-right aligned per sequence (see `Op::FlashAttnExt`).
    pub ragged: bool,
    /// A gate input comes last: the output is multiplied by `sigmoid(gate)`, `gate` f32 of the
    /// output's shape (any strides): qwen35's attention output gate, folded in by the
    /// `attention_gate` pass (`mul(flash_attn_ext(..), sigmoid(gate))`).
    pub gate: bool,
}

/// Where a flash_attn_ext node's inputs sit: `q, k, v`, then each optional one whose flag is set,
/// in this order (see [`FlashAttnParams::inputs`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlashAttnInputs {
    pub mask: Option<usize>,
    pub table: Option<usize>,
    /// `seq_offsets`; `kv_lens` is the next input.
    pub ragged: Option<usize>,
    pub gate: Option<usize>,
    /// How many inputs the node takes.
    pub count: usize,
}

impl FlashAttnParams {
    /// The positions of the optional inputs: the one map every rule, reference and kernel reads.
    pub fn inputs(&self) -> FlashAttnInputs {
        let mut next = 3;
        let mut take = |present: bool, n: usize| {
            let at = present.then_some(next);
            next += if present { n } else { 0 };
            at
        };
        let mask = take(self.mask, 1);
        let table = take(self.paged, 1);
        let ragged = take(self.ragged, 2);
        let gate = take(self.gate, 1);
        FlashAttnInputs { mask, table, ragged, gate, count: next }
    }

    /// These parameters without the gate: the attention that the gate then scales.
    pub fn ungated(self) -> FlashAttnParams {
        FlashAttnParams { gate: false, ..self }
    }
}

/// Sort direction of `argsort`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SortOrder {
    Ascending,
    Descending,
}

/// Which key head serves value head `h` when there are more value heads than key heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HeadMap {
    /// Key head `h mod H_k` (llama.cpp's GGUF layout for qwen35/qwen35moe).
    Tiled,
    /// Key head `h / (H_v / H_k)` (the HF checkpoint layout, `repeat_interleave`).
    Grouped,
}

/// How `gated_delta_net` walks the tokens; both give the same result within rounding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeltaNetAlgo {
    /// One token at a time: the recurrence as written.
    Serial,
    /// Chunks of `chunk` tokens in the WY / UT-transform form (prefill).
    Chunked { chunk: usize },
}

/// The gated delta rule (Qwen3.5 linear attention).
#[derive(Debug, Clone, Copy)]
pub struct GatedDeltaNetParams {
    /// Multiplies `q` (typically `1/sqrt(S_k)`).
    pub scale: f32,
    pub head_map: HeadMap,
    pub algo: DeltaNetAlgo,
    /// Ragged (varlen) token batch: q, k, v, g and beta pack the tokens of all sequences
    /// (`[.., n_tokens, 1]`) and an eighth input, `seq_offsets` i32 `[n_seq + 1]`, says whose
    /// they are (see `Op::GatedDeltaNet`).
    pub ragged: bool,
}

/// `gated_delta_net` with its input preparation (`Op::GatedDeltaNetFused`): the q and k l2 norms
/// (epsilon `eps`), `sigmoid(beta)` and the decay `softplus(alpha + dt_bias) * a`.
#[derive(Debug, Clone, Copy)]
pub struct GatedDeltaNetFusedParams {
    /// The delta rule's parameters.
    pub net: GatedDeltaNetParams,
    /// Epsilon of the q and k l2 norms.
    pub eps: f32,
}

/// The family an op belongs to: which file of `rules/` holds its shape rules, and which module of
/// the reference and of each backend runs it. [`Op::family`] is the one place that decides it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Family {
    /// Copies, casts, gathers and scatters: get_rows, set_rows, cpy, cast, cont, concat, repeat.
    Data,
    /// Zero-copy views (view, reshape, permute, transpose): resolved by the executor, never run.
    View,
    /// One elementwise op: unary, binary, scale, swiglu.
    Elementwise,
    /// Row reductions and norms over `ne[0]`: rms_norm, l2_norm, sum_rows, softmax, argmax, top_k,
    /// argsort.
    Reduce,
    /// mul_mat and mul_mat_id.
    Matmul,
    /// quantize and dequantize.
    Quant,
    /// rope_multi.
    Rope,
    /// flash_attn_ext.
    Attention,
    /// The causal convolutions: ssm_conv and ssm_conv_update_inplace.
    Conv,
    /// gated_delta_net.
    DeltaNet,
    /// sample.
    Sample,
    /// Fused ops defined by the subgraph they replace (norms, router, matmul + GLU / weighted sum).
    Fused,
    /// A fused elementwise program (`Op::Elementwise`).
    ElemFuse,
}

impl Family {
    pub const ALL: [Family; 13] = [
        Family::Data,
        Family::View,
        Family::Elementwise,
        Family::Reduce,
        Family::Matmul,
        Family::Quant,
        Family::Rope,
        Family::Attention,
        Family::Conv,
        Family::DeltaNet,
        Family::Sample,
        Family::Fused,
        Family::ElemFuse,
    ];

    /// Lower-case name: also the name of the family's file in `rules/` (and `reference/`).
    pub const fn name(self) -> &'static str {
        match self {
            Family::Data => "data",
            Family::View => "view",
            Family::Elementwise => "elementwise",
            Family::Reduce => "reduce",
            Family::Matmul => "matmul",
            Family::Quant => "quant",
            Family::Rope => "rope",
            Family::Attention => "attention",
            Family::Conv => "conv",
            Family::DeltaNet => "delta_net",
            Family::Sample => "sample",
            Family::Fused => "fused",
            Family::ElemFuse => "elemfuse",
        }
    }
}

/// One operation in a graph. Inputs are positional; each variant documents them.
/// Semantics, shapes and tolerances of every op are in `docs/OPS.md`.
///
/// `Eq` and `Hash` compare the variant and every parameter, **floats by their bits**
/// ([`f32::to_bits`]): `0.0` and `-0.0` are different parameters, and a NaN equals a NaN with the
/// same bit pattern, so every op equals itself. Equal ops compute the same thing bit for bit, which
/// is what a pass's pattern table or a CUDA graph key wants. The params types with floats
/// ([`ScaleParams`], [`RmsNormParams`], [`SoftmaxParams`], [`RopeParams`],
/// [`RmsNormMulRopeParams`], [`FlashAttnParams`], [`GatedDeltaNetParams`],
/// [`GatedDeltaNetFusedParams`]) follow the same rule.
#[derive(Debug, Clone)]
pub enum Op {
    // ---- data movement ----
    /// `[src, ids]`: rows `ids[i, j, k]` of `src[:, :, j, k]`. Output f32 (i32 for i32 sources).
    GetRows,
    /// `[dst, src, ids]`: writes row `r` of `src[:, :, j, k]` to row `ids[r, j, k]` of `dst`, in
    /// place; the output is `dst`.
    SetRows,
    /// `[src, dst]`: copies `src` into `dst` element by element in logical order, converting the
    /// dtype, in place; the output is `dst`. Element counts must match, shapes need not.
    Cpy,
    /// `[src]`: a new contiguous tensor of the given dtype holding `src`'s values.
    Cast(DType),
    /// `[src]`: a contiguous copy of `src` (same dtype).
    Cont,
    /// `[a, b]`: `a` and `b` joined along dimension `dim`.
    Concat { dim: usize },
    /// `[src]`: `src` tiled to shape `ne` (each `ne[i]` a multiple of `src.ne[i]`).
    Repeat { ne: [usize; 4] },

    // ---- views: zero-copy, share the source's memory ----
    /// `[src]`: a strided window onto `src`.
    View(ViewParams),
    /// `[src]`: the same contiguous data with another shape of equal element count.
    Reshape { ne: [usize; 4] },
    /// `[src]`: dimension `i` of `src` becomes dimension `axes[i]` of the result (ggml's rule).
    Permute { axes: [usize; 4] },
    /// `[src]`: swaps dimensions 0 and 1.
    Transpose,
    /// `[src]`: the same bytes read as `dtype`, shape and strides unchanged; `src` and `dtype` are
    /// both unquantized with one element size (f32 <-> i32, f16 <-> bf16). How a packed output
    /// hands out a plane of another dtype (`moe_router`'s weights).
    Bitcast(DType),

    // ---- elementwise ----
    /// `[x]`
    Unary(UnaryOp),
    /// `[a, b]`: `b` broadcasts to `a` (each `a.ne[i]` a multiple of `b.ne[i]`).
    Binary(BinaryOp),
    /// `[x]`: `x * scale + bias`.
    Scale(ScaleParams),
    /// `[gate, up]`: `silu(gate) * up`; or `[x]`: the first half of each row is the gate and the
    /// second half the up projection.
    Swiglu,

    // ---- normalisation and reductions (over ne[0]) ----
    /// `[x]`
    RmsNorm(RmsNormParams),
    /// `[x]`: sum of each row; output `[1, ne1, ne2, ne3]`.
    SumRows,
    /// `[x]` or `[x, mask]`.
    Softmax(SoftmaxParams),
    /// `[x]`: index of the largest element of each row (first on ties); output i32
    /// `[1, ne1, ne2, ne3]`.
    Argmax,

    /// `[x]`: `x / max(||x||_2, eps)` per row (ggml's definition); output f32.
    L2Norm { eps: f32 },
    /// `[x]`: i32 indices of the `k` largest elements of each row (`1 <= k <= ne0`), largest
    /// first (ties: lower index first; `-0.0 == 0.0`; NaN below every number); output
    /// `[k, ne1, ne2, ne3]`. Equals the first `k` of `Argsort(Descending)`.
    TopK { k: usize },
    /// `[x]`: i32 indices that sort each row, stable in both orders (ties: lower index first;
    /// `-0.0 == 0.0`; NaN below every number, so first ascending and last descending).
    Argsort(SortOrder),

    // ---- quantization ----
    /// `[x]` f32 (dense rows, `ne[0]` whole blocks): the same values as a contiguous
    /// block-quantized tensor (q8_0 or nvfp4), byte for byte what `crate::quant` writes.
    Quantize(DType),
    /// `[x]` quantized (dense rows): a contiguous f32 tensor of its values.
    Dequantize,

    // ---- attention ----
    /// `[x, positions]`: `x [head_dim, n_head, n_tokens, 1]`; see [`RopeParams`].
    RopeMulti(RopeParams),
    /// `[q, k, v]` + `[mask]` if `mask` + `[block_table]` if `paged` + `[seq_offsets, kv_lens]` if
    /// `ragged`:
    /// `q [d_k, n_tokens, n_head, n_seq]` f32; `k [d_k, n_kv, n_head_kv, n_seq]`,
    /// `v [d_v, n_kv, n_head_kv, n_seq]` (f32/f16/bf16); `mask [n_kv, >= n_tokens, 1, 1 or n_seq]`
    /// (f32/f16, added to the logits); with `paged`, `k`/`v` are a shared cache
    /// `[d, n_cells, n_head_kv, 1]` and `block_table` i32 `[n_kv, n_seq]` names the cell of each
    /// logical position. Output f32 `[d_v, n_head, n_tokens, n_seq]`. Query head `h` reads kv head
    /// `h / (n_head / n_head_kv)`. Logit `j` is `scale * q.k_j` (or `softcap * tanh(scale * q.k_j /
    /// softcap)` when `softcap > 0`) plus `mask[j, t, 0, s % mask.ne3]`; `-inf` positions are
    /// skipped and a row whose every logit is `-inf` is all zeros. q may have any strides, k/v need
    /// dense rows; a block-table entry outside `0..n_cells` is `KernelError::IndexOutOfRange`.
    /// With `ragged`, `q [d_k, n_tokens, n_head, 1]` packs the sequences' tokens: sequence `s` owns
    /// tokens `seq_offsets[s] .. seq_offsets[s + 1]` (its `L` tokens sit at positions
    /// `kv_lens[s] - L ..` and token `i` attends positions `0 ..= kv_lens[s] - L + i`, through row
    /// `s` of the table or of k/v); the mask, if any, is `[n_kv, >= n_tokens, 1, 1]`; tokens of no
    /// sequence output 0; output `[d_v, n_head, n_tokens, 1]`.
    FlashAttnExt(FlashAttnParams),

    // ---- recurrent (gated DeltaNet) ----
    /// `[sx, kernel]`: causal depthwise conv; `sx [d_conv - 1 + n_t, channels, n_seq]`,
    /// `kernel [d_conv, channels]` -> `[channels, n_t, n_seq]`,
    /// `out[c, t, s] = sum_i sx[t + i, c, s] * kernel[i, c]`.
    SsmConv,
    /// `[x, state, kernel, slots]`: one conv step per sequence, updating the conv state in place.
    /// `x [channels, n_t, n_seq]`, `state [d_conv - 1, channels, n_slots]` f32 contiguous, `kernel
    /// [d_conv, channels]`, `slots` i32 `[n_seq]` (distinct). Equals
    /// `ssm_conv(concat(state[slot], x^T))` (then SiLU if `silu`); afterwards `state[slot]` holds
    /// the last `d_conv - 1` samples of that window, for any `n_t >= 1`. An out-of-range or
    /// repeated slot fails the run before anything is written. With `ragged`,
    /// `[x, state, kernel, slots, seq_offsets]`: `x [channels, n_tokens, 1]` packs the tokens of
    /// all sequences, sequence `s` owning tokens `seq_offsets[s] .. seq_offsets[s + 1]` (i32
    /// `[n_seq + 1]`, non-decreasing, at most `n_tokens`); each sequence with tokens convolves its
    /// own after its slot's samples and saves its last `d_conv - 1`; one without tokens touches
    /// nothing (its slot is not checked); tokens of no sequence output 0. Output
    /// `[channels, n_tokens, 1]`.
    SsmConvUpdate { silu: bool, ragged: bool },
    /// `[q, k, v, g, beta, state, slots]`: `q, k [S_k, H_k, n_t, n_seq]`, `v [S_v, H_v, n_t,
    /// n_seq]`, `g` (log decay), `beta [1, H_v, n_t, n_seq]`, `state [S_k, S_v, H_v, n_slots]` f32,
    /// `slots` i32 `[n_seq]`. Per head and token: `S <- exp(g) S; u = S^T k;
    /// S <- S + k (beta (v - u))^T; o = S^T (scale q)`. Output f32 `[S_v, H_v, n_t, n_seq]`; each
    /// sequence's final state is written back to its slot in place. `state[i, j, h, slot]` is
    /// `S[k = i][v = j]` (ggml layout); value head `h` reads key head per [`HeadMap`]; slots must
    /// be distinct and in range (checked before anything is written). q/k are not normalised.
    /// With `ragged`, `[q, k, v, g, beta, state, slots, seq_offsets]`: q, k, v, g and beta are
    /// `[.., n_tokens, 1]`, sequence `s` owning tokens `seq_offsets[s] .. seq_offsets[s + 1]`
    /// (i32 `[n_seq + 1]`); each sequence with tokens runs from its slot's state and writes its
    /// final state back (chunks restart at its first token); one without tokens touches nothing
    /// (its slot is not checked); tokens of no sequence output 0. Output `[S_v, H_v, n_tokens, 1]`.
    GatedDeltaNet(GatedDeltaNetParams),

    // ---- matrix multiplication ----
    /// `[as, b, ids]`: expert weights `as [K, N, n_expert]` (any weight dtype, quantized too;
    /// dense rows), f32 activations `b [K, n_b, n_tokens]` (`n_b` divides `n_used`: in practice
    /// `n_used`, one row per slot, or 1, broadcast), routed ids i32 `[n_used, n_tokens]`; output
    /// f32 `[N, n_used, n_tokens]` with `out[:, u, t] = as[:, :, ids[u, t]]^T b[:, u mod n_b, t]`
    /// (ggml's `mul_mat_id`). An id outside `0..n_expert` is a `KernelError::IndexOutOfRange`.
    MulMatId,
    /// `[a, b]`: `a [K, M, A2, A3]` (weights: f32, f16, bf16, q8_0 or nvfp4, dense rows) times
    /// `b [K, N, B2, B3]` (activations, f32) gives f32
    /// `[M, N, B2, B3]`: `out[m, n] = sum_k a[k, m] * b[k, n]`; `a` broadcasts over dims 2 and 3.
    MulMat,

    // ---- sampling ----
    /// `[logits, settings]`: `logits` f32 `[n_vocab, n_rows, 1, 1]` (dense rows), `settings` f32
    /// `[4, n_rows, 1, 1]` holding per row `(temperature, top_k, top_p, u)`; output i32
    /// `[1, n_rows, 1, 1]`, the token drawn from each row by `crate::sample::sample` (greedy at
    /// temperature 0; `u` in [0, 1) is the row's uniform draw). Out-of-range settings and rows of
    /// NaN logits are `KernelError::BadValue`.
    Sample,

    // ---- fused: each is defined by the subgraph it replaces (docs/OPS.md, "Fused ops") ----
    /// `[a, b, w]`: `a`, `b` f32 `[E, n, 1, 1]` (same shape, dense rows), `w` f32 broadcasting
    /// to `[E, n, 1, 1]`. Output f32 contiguous `[E, n, 2, 1]`: plane 0 is `s = add(a, b)`, plane
    /// 1 is `mul(rms_norm(s, eps), w)` (the residual stream and the next block's normed input,
    /// read through views `[E, n, 1, 1]` at byte offsets 0 and `E * n * 4`).
    AddRmsNormMul(RmsNormParams),
    /// `[x, w]`: `mul(rms_norm(x, eps), w)`; `x` f32 with dense rows, `w` f32 broadcasting to
    /// `x`. Output f32, `x`'s shape.
    RmsNormMul(RmsNormParams),
    /// `[x, w, z]`: `mul(mul(rms_norm(x, eps), w), silu(z))` (the gated DeltaNet output norm);
    /// `x`, `z` f32 of one shape with dense rows, `w` f32 broadcasting to `x`. Output f32.
    GatedRmsNorm(RmsNormParams),
    /// `[x, w, positions]`: `rope_multi(mul(rms_norm(x, eps), w), positions)` (attention's q/k
    /// norm, weight and rotation): `x` f32 `[head_dim, n_head, n_tokens, 1]` with dense rows (any
    /// outer strides: q read through a view of a joint projection), `w` f32 broadcasting to `x`,
    /// `positions` as rope_multi's. Output f32 contiguous, `x`'s shape.
    RmsNormMulRope(RmsNormMulRopeParams),
    /// `[qk, v, alpha, dt_bias, a, beta, state, slots]` (+ `seq_offsets` with `net.ragged`): the
    /// gated DeltaNet with its input preparation, exactly `gated_delta_net(l2_norm(q, eps),
    /// l2_norm(k, eps), v, reshape(softplus(alpha + dt_bias) * a), reshape(sigmoid(beta)), state,
    /// slots[, seq_offsets])` where `q` and `k` are the first and the last `H_k` heads of `qk`
    /// f32 `[S_k, 2 H_k, n_t, n_seq]` (dense rows: q and k side by side, as a DeltaNet block's
    /// conv output holds them), `alpha` and `beta` f32 `[H_v, n_t, n_seq, 1]` (any strides; the
    /// reshape makes them `[1, H_v, n_t, n_seq]`), `dt_bias` and `a` f32 broadcasting to `alpha`;
    /// `v`, `state`, `slots`, `seq_offsets` and the output (and the in-place state write) as
    /// `gated_delta_net`'s.
    GatedDeltaNetFused(GatedDeltaNetFusedParams),
    /// `[logits]` f32 `[n_expert, n, 1, 1]`: `top_k(softmax(logits), k)`, i32 `[k, n, 1, 1]`,
    /// selected on the f32 probabilities as the two ops compute them (`1 <= k <= n_expert`).
    SoftmaxTopK { k: usize },
    /// `[logits, ids]`: `logits` f32 `[n_expert, n, 1, 1]`, `ids` i32 `[k, n, 1, 1]`. Output f32
    /// `[1, k, n, 1]`: `softmax(logits)` at the ids, divided by their sum per token (qwen35's
    /// `get_rows` / `sum_rows` / `div` chain). An id outside `0..n_expert` is
    /// `KernelError::IndexOutOfRange`.
    MoeWeights,
    /// `[logits]`, or `[logits, tail, gate]`: the whole router, `softmax_top_k` and
    /// `moe_weights` of the same logits in one op. Without a tail: `ids = softmax_top_k(logits,
    /// k)`, `w = moe_weights(logits, ids)`; with `tail` i32 and `gate` f32, both `[m, n, 1, 1]`:
    /// `ids = softmax_top_k(logits, k, tail)` (the tail appended), `w = concat(moe_weights(logits,
    /// the first k ids), reshape(sigmoid(gate), [1, m, n]), 1)`. Output i32 `[k + m, n, 2, 1]`:
    /// plane 0 the ids, plane 1 the bits of the f32 weights (read them through `Bitcast(F32)` of
    /// a view of the plane): graph nodes have one output of one dtype.
    MoeRouter { k: usize },
    /// `[wg, wu, x]`: `swiglu(mul_mat(wg, x), mul_mat(wu, x))`, a gated FFN's gate and up
    /// projections with their GLU: `wg` and `wu` of one dtype and shape (mul_mat's weights), `x`
    /// mul_mat's f32 activations. Output f32, mul_mat's shape.
    MulMatSwiglu,
    /// `[wg, wu, x, ids]`: `swiglu(mul_mat_id(wg, x, ids), mul_mat_id(wu, x, ids))`, the routed
    /// experts' gate and up projections with their GLU: `wg` and `wu` of one dtype and shape
    /// (mul_mat_id's experts). Output f32 `[N, n_used, n_tokens]`. An id outside `0..n_expert`
    /// is a `KernelError::IndexOutOfRange`.
    MulMatIdSwiglu,
    /// `[as, b, ids, w]`: the routed experts' outputs weighted and summed over the slots,
    /// `out[:, t] = sum_u w[0, u, t] * mul_mat_id(as, b, ids)[:, u, t]` (qwen35's down projection,
    /// `mul` by the router weights and `sum_rows` over the slots): `as`, `b`, `ids` as
    /// mul_mat_id's, `w` f32 `[1, n_used, n_tokens]`. Output f32 `[N, n_tokens]`. An id outside
    /// `0..n_expert` is a `KernelError::IndexOutOfRange`.
    MulMatIdWeightedSum,
    /// `[x0 .. x{n-1}]` (`n = program.n_inputs()`, at most 6), all f32, any strides: the program
    /// (a chain of unary / binary / scale ops) at every position of the output, f32 contiguous of
    /// the per-dimension largest input shape; every input broadcasts to it by ggml's repeat rule
    /// (each `ne[i]` divides the output's). What `elementwise_chains` emits for a tree of
    /// elementwise ops (docs/OPS.md, "Fused elementwise programs").
    Elementwise(ElemProgram),
}

impl Op {
    /// Stable lower-case name, used in errors, logs, DOT dumps and test-ops filters.
    pub fn name(&self) -> &'static str {
        match self {
            Op::GetRows => "get_rows",
            Op::SetRows => "set_rows",
            Op::Cpy => "cpy",
            Op::Cast(_) => "cast",
            Op::Cont => "cont",
            Op::Concat { .. } => "concat",
            Op::Repeat { .. } => "repeat",
            Op::View(_) => "view",
            Op::Reshape { .. } => "reshape",
            Op::Permute { .. } => "permute",
            Op::Transpose => "transpose",
            Op::Bitcast(_) => "bitcast",
            Op::Unary(u) => u.name(),
            Op::Binary(b) => b.name(),
            Op::Scale(_) => "scale",
            Op::Swiglu => "swiglu",
            Op::RmsNorm(_) => "rms_norm",
            Op::SumRows => "sum_rows",
            Op::Softmax(_) => "softmax",
            Op::Argmax => "argmax",
            Op::MulMat => "mul_mat",
            Op::MulMatId => "mul_mat_id",
            Op::L2Norm { .. } => "l2_norm",
            Op::TopK { .. } => "top_k",
            Op::Argsort(_) => "argsort",
            Op::Quantize(_) => "quantize",
            Op::Dequantize => "dequantize",
            Op::RopeMulti(_) => "rope_multi",
            Op::FlashAttnExt(_) => "flash_attn_ext",
            Op::SsmConv => "ssm_conv",
            Op::SsmConvUpdate { .. } => "ssm_conv_update_inplace",
            Op::GatedDeltaNet(_) => "gated_delta_net",
            Op::Sample => "sample",
            Op::AddRmsNormMul(_) => "add_rms_norm_mul",
            Op::RmsNormMul(_) => "rms_norm_mul",
            Op::RmsNormMulRope(_) => "rms_norm_mul_rope",
            Op::GatedRmsNorm(_) => "gated_rms_norm",
            Op::GatedDeltaNetFused(_) => "gated_delta_net_fused",
            Op::SoftmaxTopK { .. } => "softmax_top_k",
            Op::MoeWeights => "moe_weights",
            Op::MoeRouter { .. } => "moe_router",
            Op::MulMatSwiglu => "mul_mat_swiglu",
            Op::MulMatIdSwiglu => "mul_mat_id_swiglu",
            Op::MulMatIdWeightedSum => "mul_mat_id_weighted_sum",
            Op::Elementwise(_) => "elementwise",
        }
    }

    /// The op's family: the one op -> family map that the shape rules, the reference and the
    /// backends dispatch on (no `_` arm, so a new op must choose its family here).
    pub fn family(&self) -> Family {
        match self {
            Op::GetRows | Op::SetRows | Op::Cpy | Op::Cast(_) | Op::Cont | Op::Concat { .. } | Op::Repeat { .. } => {
                Family::Data
            }
            Op::View(_) | Op::Reshape { .. } | Op::Permute { .. } | Op::Transpose | Op::Bitcast(_) => Family::View,
            Op::Unary(_) | Op::Binary(_) | Op::Scale(_) | Op::Swiglu => Family::Elementwise,
            Op::RmsNorm(_)
            | Op::L2Norm { .. }
            | Op::SumRows
            | Op::Softmax(_)
            | Op::Argmax
            | Op::TopK { .. }
            | Op::Argsort(_) => Family::Reduce,
            Op::MulMat | Op::MulMatId => Family::Matmul,
            Op::Quantize(_) | Op::Dequantize => Family::Quant,
            Op::RopeMulti(_) => Family::Rope,
            Op::FlashAttnExt(_) => Family::Attention,
            Op::SsmConv | Op::SsmConvUpdate { .. } => Family::Conv,
            Op::GatedDeltaNet(_) => Family::DeltaNet,
            Op::Sample => Family::Sample,
            Op::AddRmsNormMul(_)
            | Op::RmsNormMul(_)
            | Op::RmsNormMulRope(_)
            | Op::GatedRmsNorm(_)
            | Op::GatedDeltaNetFused(_)
            | Op::SoftmaxTopK { .. }
            | Op::MoeWeights
            | Op::MoeRouter { .. }
            | Op::MulMatSwiglu
            | Op::MulMatIdSwiglu
            | Op::MulMatIdWeightedSum => Family::Fused,
            Op::Elementwise(_) => Family::ElemFuse,
        }
    }

    /// True for zero-copy views: the output shares its first input's memory and no backend
    /// computes anything for it.
    pub fn is_view(&self) -> bool {
        self.family() == Family::View
    }

    /// The input this op writes in place and whose memory its output is, if any.
    /// The executor gives the output the same storage as that input.
    pub fn writes_input(&self) -> Option<usize> {
        match self {
            Op::SetRows => Some(0),
            Op::Cpy => Some(1),
            _ => None,
        }
    }

    /// The planes (along dimension 2) of an output that packs results of different dtypes into
    /// one tensor of the first's element size, each plane's name and dtype; empty when the output
    /// is one dtype. A reader takes a plane through a view and `Bitcast`.
    pub fn packed_planes(&self) -> &'static [(&'static str, DType)] {
        match self {
            Op::MoeRouter { .. } => &[("ids", DType::I32), ("weights", DType::F32)],
            _ => &[],
        }
    }

    /// The input this op updates in place as a side effect while producing a separate output
    /// (recurrent state). Such ops run even when nothing reads their output.
    pub fn updates_input(&self) -> Option<usize> {
        match self {
            Op::SsmConvUpdate { .. } => Some(1),
            Op::GatedDeltaNet(_) => Some(5),
            Op::GatedDeltaNetFused(_) => Some(6),
            _ => None,
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Op::Cast(d) => write!(f, "cast({d})"),
            Op::Concat { dim } => write!(f, "concat(dim={dim})"),
            Op::Repeat { ne } => write!(f, "repeat({ne:?})"),
            Op::View(v) => write!(f, "view({:?}, offset={})", v.ne, v.offset),
            Op::Reshape { ne } => write!(f, "reshape({ne:?})"),
            Op::Permute { axes } => write!(f, "permute({axes:?})"),
            Op::Scale(p) => write!(f, "scale(x{}, +{})", p.scale, p.bias),
            Op::RmsNorm(p) => write!(f, "rms_norm(eps={})", p.eps),
            Op::AddRmsNormMul(p) => write!(f, "add_rms_norm_mul(eps={})", p.eps),
            Op::RmsNormMul(p) => write!(f, "rms_norm_mul(eps={})", p.eps),
            Op::RmsNormMulRope(p) => write!(
                f,
                "rms_norm_mul_rope(eps={}, n_rot={}, base={}, {:?}, sections={:?})",
                p.norm.eps, p.rope.n_rot, p.rope.freq_base, p.rope.pairing, p.rope.sections
            ),
            Op::GatedRmsNorm(p) => write!(f, "gated_rms_norm(eps={})", p.eps),
            Op::GatedDeltaNetFused(p) => write!(
                f,
                "gated_delta_net_fused(eps={}, scale={}, {:?}, {:?}, ragged={})",
                p.eps, p.net.scale, p.net.head_map, p.net.algo, p.net.ragged
            ),
            Op::SoftmaxTopK { k } => write!(f, "softmax_top_k({k})"),
            Op::MoeRouter { k } => write!(f, "moe_router({k})"),
            Op::Bitcast(d) => write!(f, "bitcast({d})"),
            Op::Elementwise(p) => write!(f, "elementwise({p})"),
            Op::Softmax(p) => write!(f, "softmax(scale={})", p.scale),
            Op::L2Norm { eps } => write!(f, "l2_norm(eps={eps})"),
            Op::TopK { k } => write!(f, "top_k({k})"),
            Op::Argsort(o) => write!(f, "argsort({o:?})"),
            Op::Quantize(d) => write!(f, "quantize({d})"),
            Op::RopeMulti(p) => write!(
                f,
                "rope_multi(n_rot={}, base={}, {:?}, sections={:?})",
                p.n_rot, p.freq_base, p.pairing, p.sections
            ),
            Op::FlashAttnExt(p) => write!(
                f,
                "flash_attn_ext(scale={}, softcap={}, mask={}, paged={}, ragged={}{})",
                p.scale,
                p.softcap,
                p.mask,
                p.paged,
                p.ragged,
                if p.gate { ", gated" } else { "" }
            ),
            Op::SsmConvUpdate { silu, ragged } => write!(f, "ssm_conv_update_inplace(silu={silu}, ragged={ragged})"),
            Op::GatedDeltaNet(p) => {
                write!(f, "gated_delta_net(scale={}, {:?}, {:?}, ragged={})", p.scale, p.head_map, p.algo, p.ragged)
            }
            other => f.write_str(other.name()),
        }
    }
}

// ---- Eq and Hash: floats by their bits ----
//
// `f32` is neither `Eq` nor `Hash`, so each type with a float in it implements the three traits
// through a private `key()`: its fields with every float as `Bits`. Each `key()` destructures
// every field (no `..`) and `Op::key` matches every variant (no `_`), so a field or variant added
// later does not compile until the key covers it.

/// An `f32` by its bit pattern: `0.0` and `-0.0` differ, a NaN equals a NaN of the same bits.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct Bits(u32);

impl From<f32> for Bits {
    fn from(x: f32) -> Bits {
        Bits(x.to_bits())
    }
}

/// `PartialEq`, `Eq` and `Hash` for types with a `key()`, all three from the key.
macro_rules! eq_hash_by_key {
    ($($t:ty),+ $(,)?) => {$(
        impl PartialEq for $t {
            fn eq(&self, other: &Self) -> bool {
                self.key() == other.key()
            }
        }
        impl Eq for $t {}
        impl Hash for $t {
            fn hash<H: Hasher>(&self, state: &mut H) {
                self.key().hash(state)
            }
        }
    )+};
}

eq_hash_by_key!(
    ScaleParams,
    RmsNormParams,
    SoftmaxParams,
    RopeParams,
    RmsNormMulRopeParams,
    FlashAttnParams,
    GatedDeltaNetParams,
    GatedDeltaNetFusedParams,
    Op
);

impl ScaleParams {
    fn key(&self) -> (Bits, Bits) {
        let ScaleParams { scale, bias } = *self;
        (scale.into(), bias.into())
    }
}

impl RmsNormParams {
    fn key(&self) -> Bits {
        let RmsNormParams { eps } = *self;
        eps.into()
    }
}

impl SoftmaxParams {
    fn key(&self) -> Bits {
        let SoftmaxParams { scale } = *self;
        scale.into()
    }
}

/// [`RopeParams`]' key.
type RopeKey = (usize, Bits, RopePairing, Option<[usize; 4]>);

impl RopeParams {
    fn key(&self) -> RopeKey {
        let RopeParams { n_rot, freq_base, pairing, sections } = *self;
        (n_rot, freq_base.into(), pairing, sections)
    }
}

impl RmsNormMulRopeParams {
    fn key(&self) -> (Bits, RopeKey) {
        let RmsNormMulRopeParams { norm, rope } = *self;
        (norm.key(), rope.key())
    }
}

impl FlashAttnParams {
    fn key(&self) -> (Bits, Bits, [bool; 4]) {
        let FlashAttnParams { scale, softcap, mask, paged, ragged, gate } = *self;
        (scale.into(), softcap.into(), [mask, paged, ragged, gate])
    }
}

impl GatedDeltaNetParams {
    fn key(&self) -> (Bits, HeadMap, DeltaNetAlgo, bool) {
        let GatedDeltaNetParams { scale, head_map, algo, ragged } = *self;
        (scale.into(), head_map, algo, ragged)
    }
}

impl GatedDeltaNetFusedParams {
    fn key(&self) -> ((Bits, HeadMap, DeltaNetAlgo, bool), Bits) {
        let GatedDeltaNetFusedParams { net, eps } = *self;
        (net.key(), eps.into())
    }
}

/// The parameters of an op, as its key holds them (the variant is the key's other half).
#[derive(PartialEq, Eq, Hash)]
enum OpParams<'a> {
    None,
    DType(DType),
    Index(usize),
    Dims([usize; 4]),
    Flags([bool; 2]),
    Float(Bits),
    View(&'a ViewParams),
    Unary(UnaryOp),
    Binary(BinaryOp),
    Scale(&'a ScaleParams),
    RmsNorm(&'a RmsNormParams),
    Softmax(&'a SoftmaxParams),
    Order(SortOrder),
    Rope(&'a RopeParams),
    NormRope(&'a RmsNormMulRopeParams),
    FlashAttn(&'a FlashAttnParams),
    DeltaNet(&'a GatedDeltaNetParams),
    DeltaNetFused(&'a GatedDeltaNetFusedParams),
    Program(&'a ElemProgram),
}

impl Op {
    fn key(&self) -> (mem::Discriminant<Op>, OpParams<'_>) {
        use OpParams as P;
        let params = match self {
            Op::GetRows
            | Op::SetRows
            | Op::Cpy
            | Op::Cont
            | Op::Transpose
            | Op::Swiglu
            | Op::SumRows
            | Op::Argmax
            | Op::Dequantize
            | Op::SsmConv
            | Op::MulMatId
            | Op::MulMat
            | Op::Sample
            | Op::MoeWeights
            | Op::MulMatSwiglu
            | Op::MulMatIdSwiglu
            | Op::MulMatIdWeightedSum => P::None,
            Op::Cast(d) | Op::Quantize(d) | Op::Bitcast(d) => P::DType(*d),
            Op::Concat { dim: n } | Op::TopK { k: n } | Op::SoftmaxTopK { k: n } | Op::MoeRouter { k: n } => {
                P::Index(*n)
            }
            Op::Repeat { ne: d } | Op::Reshape { ne: d } | Op::Permute { axes: d } => P::Dims(*d),
            Op::View(p) => P::View(p),
            Op::Unary(u) => P::Unary(*u),
            Op::Binary(b) => P::Binary(*b),
            Op::Scale(p) => P::Scale(p),
            Op::RmsNorm(p) | Op::AddRmsNormMul(p) | Op::RmsNormMul(p) | Op::GatedRmsNorm(p) => P::RmsNorm(p),
            Op::Softmax(p) => P::Softmax(p),
            Op::L2Norm { eps } => P::Float((*eps).into()),
            Op::Argsort(o) => P::Order(*o),
            Op::RopeMulti(p) => P::Rope(p),
            Op::RmsNormMulRope(p) => P::NormRope(p),
            Op::FlashAttnExt(p) => P::FlashAttn(p),
            Op::SsmConvUpdate { silu, ragged } => P::Flags([*silu, *ragged]),
            Op::GatedDeltaNet(p) => P::DeltaNet(p),
            Op::GatedDeltaNetFused(p) => P::DeltaNetFused(p),
            Op::Elementwise(p) => P::Program(p),
        };
        (mem::discriminant(self), params)
    }
}
