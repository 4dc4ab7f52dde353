//! Typed builders: one method per op, each a thin wrapper over [`Graph::op`].

use tessera_ops::{
    BinaryOp, DType, ElemInstr, ElemProgram, FlashAttnParams, GatedDeltaNetFusedParams, GatedDeltaNetParams, Op,
    RmsNormMulRopeParams, RmsNormParams, RopeParams, ScaleParams, SoftmaxParams, SortOrder, TensorMeta, UnaryOp,
    ViewParams,
};

use crate::{Graph, GraphError, Tensor};

type R = Result<Tensor, GraphError>;

/// Pads a shape of 1 to 4 dims with trailing 1s (`[n]` -> `[n, 1, 1, 1]`).
pub fn shape4(dims: &[usize]) -> Result<[usize; 4], GraphError> {
    if dims.is_empty() || dims.len() > 4 {
        return Err(GraphError::Op(tessera_ops::OpError::InvalidParam {
            op: "shape",
            why: format!("a shape has 1 to 4 dimensions, got {}", dims.len()),
        }));
    }
    let mut ne = [1; 4];
    ne[..dims.len()].copy_from_slice(dims);
    Ok(ne)
}

impl Graph {
    // ---- data movement ----

    /// Rows `ids` of `src`: `src [ne0, nr, ne2, ne3]`, `ids` i32 `[n, ne2, ne3]` -> `[ne0, n, ne2, ne3]`.
    pub fn get_rows(&mut self, src: Tensor, ids: Tensor) -> R {
        self.op(Op::GetRows, &[src, ids])
    }

    /// Writes the rows of `src` into rows `ids` of `dst` in place; returns `dst`.
    pub fn set_rows(&mut self, dst: Tensor, src: Tensor, ids: Tensor) -> R {
        self.op(Op::SetRows, &[dst, src, ids])
    }

    /// Copies `src` into `dst` (same element count, any layouts, converting dtype); returns `dst`.
    pub fn cpy(&mut self, src: Tensor, dst: Tensor) -> R {
        self.op(Op::Cpy, &[src, dst])
    }

    /// A new contiguous tensor of dtype `to`.
    pub fn cast(&mut self, x: Tensor, to: DType) -> R {
        self.op(Op::Cast(to), &[x])
    }

    /// A contiguous copy.
    pub fn cont(&mut self, x: Tensor) -> R {
        self.op(Op::Cont, &[x])
    }

    pub fn concat(&mut self, a: Tensor, b: Tensor, dim: usize) -> R {
        self.op(Op::Concat { dim }, &[a, b])
    }

    /// Tiles `x` to shape `dims` (1 to 4 dims, each a multiple of `x`'s).
    pub fn repeat(&mut self, x: Tensor, dims: &[usize]) -> R {
        let ne = shape4(dims)?;
        self.op(Op::Repeat { ne }, &[x])
    }

    // ---- views ----

    /// A strided window: shape `ne`, byte strides `nb`, starting `offset` bytes into `x`.
    pub fn view(&mut self, x: Tensor, ne: [usize; 4], nb: [usize; 4], offset: usize) -> R {
        self.op(Op::View(ViewParams { ne, nb, offset }), &[x])
    }

    /// Same data, new shape (1 to 4 dims); `x` must be contiguous.
    pub fn reshape(&mut self, x: Tensor, dims: &[usize]) -> R {
        let ne = shape4(dims)?;
        self.op(Op::Reshape { ne }, &[x])
    }

    /// Dimension `i` of `x` becomes dimension `axes[i]` (ggml's rule).
    pub fn permute(&mut self, x: Tensor, axes: [usize; 4]) -> R {
        self.op(Op::Permute { axes }, &[x])
    }

    /// Swaps dimensions 0 and 1.
    pub fn transpose(&mut self, x: Tensor) -> R {
        self.op(Op::Transpose, &[x])
    }

    /// The same bytes read as `dtype` (an unquantized dtype of `x`'s element size), shape and
    /// strides unchanged.
    pub fn bitcast(&mut self, x: Tensor, dtype: DType) -> R {
        self.op(Op::Bitcast(dtype), &[x])
    }

    // ---- elementwise ----

    pub fn unary(&mut self, op: UnaryOp, x: Tensor) -> R {
        self.op(Op::Unary(op), &[x])
    }
    pub fn neg(&mut self, x: Tensor) -> R {
        self.unary(UnaryOp::Neg, x)
    }
    pub fn exp(&mut self, x: Tensor) -> R {
        self.unary(UnaryOp::Exp, x)
    }
    pub fn silu(&mut self, x: Tensor) -> R {
        self.unary(UnaryOp::Silu, x)
    }
    pub fn sigmoid(&mut self, x: Tensor) -> R {
        self.unary(UnaryOp::Sigmoid, x)
    }
    pub fn softplus(&mut self, x: Tensor) -> R {
        self.unary(UnaryOp::Softplus, x)
    }

    /// `a op b`, `b` broadcast to `a`'s shape.
    pub fn binary(&mut self, op: BinaryOp, a: Tensor, b: Tensor) -> R {
        self.op(Op::Binary(op), &[a, b])
    }
    pub fn add(&mut self, a: Tensor, b: Tensor) -> R {
        self.binary(BinaryOp::Add, a, b)
    }
    pub fn sub(&mut self, a: Tensor, b: Tensor) -> R {
        self.binary(BinaryOp::Sub, a, b)
    }
    pub fn mul(&mut self, a: Tensor, b: Tensor) -> R {
        self.binary(BinaryOp::Mul, a, b)
    }
    pub fn div(&mut self, a: Tensor, b: Tensor) -> R {
        self.binary(BinaryOp::Div, a, b)
    }

    /// `x * scale`.
    pub fn scale(&mut self, x: Tensor, scale: f32) -> R {
        self.op(Op::Scale(ScaleParams { scale, bias: 0.0 }), &[x])
    }

    /// `x * scale + bias`.
    pub fn scale_bias(&mut self, x: Tensor, scale: f32, bias: f32) -> R {
        self.op(Op::Scale(ScaleParams { scale, bias }), &[x])
    }

    /// `silu(gate) * up`.
    pub fn swiglu(&mut self, gate: Tensor, up: Tensor) -> R {
        self.op(Op::Swiglu, &[gate, up])
    }

    /// `silu(x[..n]) * x[n..]` per row of `2n` values (a fused gate+up projection).
    pub fn swiglu_fused(&mut self, x: Tensor) -> R {
        self.op(Op::Swiglu, &[x])
    }

    // ---- normalisation and reductions ----

    pub fn rms_norm(&mut self, x: Tensor, eps: f32) -> R {
        self.op(Op::RmsNorm(RmsNormParams { eps }), &[x])
    }

    pub fn sum_rows(&mut self, x: Tensor) -> R {
        self.op(Op::SumRows, &[x])
    }

    /// `softmax(x * scale + mask)` over `ne[0]`.
    pub fn softmax(&mut self, x: Tensor, scale: f32, mask: Option<Tensor>) -> R {
        match mask {
            Some(m) => self.op(Op::Softmax(SoftmaxParams { scale }), &[x, m]),
            None => self.op(Op::Softmax(SoftmaxParams { scale }), &[x]),
        }
    }

    pub fn argmax(&mut self, x: Tensor) -> R {
        self.op(Op::Argmax, &[x])
    }

    // ---- matmul ----

    /// `a [K, M, ..]` (weights) times `b [K, N, ..]` (f32 activations) -> f32 `[M, N, ..]`.
    pub fn mul_mat(&mut self, a: Tensor, b: Tensor) -> R {
        self.op(Op::MulMat, &[a, b])
    }

    /// Routed experts: `experts [K, N, n_expert]`, `b [K, n_used or 1, n_tokens]` f32, `ids` i32
    /// `[n_used, n_tokens]` -> f32 `[N, n_used, n_tokens]`.
    pub fn mul_mat_id(&mut self, experts: Tensor, b: Tensor, ids: Tensor) -> R {
        self.op(Op::MulMatId, &[experts, b, ids])
    }

    // ---- more reductions ----

    /// `x / max(||x||_2, eps)` per row.
    pub fn l2_norm(&mut self, x: Tensor, eps: f32) -> R {
        self.op(Op::L2Norm { eps }, &[x])
    }

    /// i32 indices of the `k` largest elements of each row, largest first.
    pub fn top_k(&mut self, x: Tensor, k: usize) -> R {
        self.op(Op::TopK { k }, &[x])
    }

    /// i32 indices that sort each row.
    pub fn argsort(&mut self, x: Tensor, order: SortOrder) -> R {
        self.op(Op::Argsort(order), &[x])
    }

    // ---- sampling ----

    /// One token id per row: `logits` f32 `[n_vocab, n_rows, 1, 1]` (dense rows), `settings` f32
    /// `[4, n_rows, 1, 1]` holding each row's `(temperature, top_k, top_p, u)` (temperature 0 is
    /// greedy, top_k 0 and top_p 1 keep every token, `u` in [0, 1) is the row's uniform draw)
    /// -> i32 `[1, n_rows, 1, 1]`. The rule is `tessera_ops::sample::sample` (docs/OPS.md).
    pub fn sample(&mut self, logits: Tensor, settings: Tensor) -> R {
        self.op(Op::Sample, &[logits, settings])
    }

    // ---- fused ops (what the fusion passes emit; each equals the subgraph it replaces) ----

    /// `s = add(a, b)` and `h = mul(rms_norm(s, eps), w)` in one op: `a`, `b` f32 `[E, n, 1, 1]`
    /// (dense rows), `w` f32 broadcasting to them (e.g. `[E]`) -> f32 `[E, n, 2, 1]`, `s` in plane
    /// 0 and `h` in plane 1: read them through views `[E, n, 1, 1]` with contiguous strides at byte
    /// offsets 0 and `E * n * 4`.
    pub fn add_rms_norm_mul(&mut self, a: Tensor, b: Tensor, w: Tensor, eps: f32) -> R {
        self.op(Op::AddRmsNormMul(RmsNormParams { eps }), &[a, b, w])
    }

    /// `mul(rms_norm(x, eps), w)`: `x` f32 (dense rows), `w` f32 broadcasting to `x` -> f32.
    pub fn rms_norm_mul(&mut self, x: Tensor, w: Tensor, eps: f32) -> R {
        self.op(Op::RmsNormMul(RmsNormParams { eps }), &[x, w])
    }

    /// `rope_multi(mul(rms_norm(x, eps), w), positions, rope)` (attention's per-head q/k norm,
    /// weight and rotation): `x` f32 `[head_dim, n_head, n_tokens, 1]` (dense rows), `w` f32
    /// broadcasting to `x`, `positions` as [`Graph::rope_multi`]'s -> f32 of `x`'s shape.
    pub fn rms_norm_mul_rope(&mut self, x: Tensor, w: Tensor, positions: Tensor, eps: f32, rope: RopeParams) -> R {
        self.op(Op::RmsNormMulRope(RmsNormMulRopeParams { norm: RmsNormParams { eps }, rope }), &[x, w, positions])
    }

    /// `mul(mul(rms_norm(x, eps), w), silu(z))`: `x`, `z` f32 of one shape (dense rows), `w` f32
    /// broadcasting to `x` -> f32 (the gated DeltaNet output norm).
    pub fn gated_rms_norm(&mut self, x: Tensor, w: Tensor, z: Tensor, eps: f32) -> R {
        self.op(Op::GatedRmsNorm(RmsNormParams { eps }), &[x, w, z])
    }

    /// `top_k(softmax(logits), k)`: `logits` f32 `[n_expert, n]` -> i32 `[k, n]`, the experts of
    /// the `k` largest probabilities per token (largest first, lower index on ties).
    pub fn softmax_top_k(&mut self, logits: Tensor, k: usize) -> R {
        self.op(Op::SoftmaxTopK { k }, &[logits])
    }

    /// [`Graph::softmax_top_k`] with the ids of `tail` (i32 `[m, n]`) appended to each token's:
    /// `concat(top_k(softmax(logits), k), tail, 0)`, i32 `[k + m, n]` (a shared expert routed as
    /// one more slot).
    pub fn softmax_top_k_then(&mut self, logits: Tensor, k: usize, tail: Tensor) -> R {
        self.op(Op::SoftmaxTopK { k }, &[logits, tail])
    }

    /// [`Graph::moe_weights`] with `sigmoid(gate)` (`gate` f32 `[1, n]`) appended to each token's
    /// weights: f32 `[1, k + 1, n]` (a shared expert's gated weight).
    pub fn moe_weights_gated(&mut self, logits: Tensor, ids: Tensor, gate: Tensor) -> R {
        self.op(Op::MoeWeights, &[logits, ids, gate])
    }

    /// The whole router: `softmax_top_k(logits, k)` and `moe_weights` of those ids, packed as
    /// i32 `[k, n, 2]` (plane 1 the f32 weights' bits); [`Graph::router_planes`] splits it.
    pub fn moe_router(&mut self, logits: Tensor, k: usize) -> R {
        self.op(Op::MoeRouter { k }, &[logits])
    }

    /// [`Graph::moe_router`] with a tail: the ids of `tail` (i32 `[m, n]`) appended to each
    /// token's and `sigmoid(gate)` (`gate` f32 `[m, n]`) to its weights: i32 `[k + m, n, 2]`.
    pub fn moe_router_then(&mut self, logits: Tensor, k: usize, tail: Tensor, gate: Tensor) -> R {
        self.op(Op::MoeRouter { k }, &[logits, tail, gate])
    }

    /// The ids (i32 `[k', n]`) and the weights (f32 `[1, k', n]`) of a [`Graph::moe_router`]
    /// output, as views of its planes.
    pub fn router_planes(&mut self, router: Tensor) -> Result<(Tensor, Tensor), GraphError> {
        let (ids, weights) = router_planes(router.meta);
        let ids = self.op(Op::View(ids), &[router])?;
        let w = self.op(Op::View(weights), &[router])?;
        Ok((ids, self.bitcast(w, DType::F32)?))
    }

    /// The routing weights: `logits` f32 `[n_expert, n]`, `ids` i32 `[k, n]` -> f32 `[1, k, n]`,
    /// `softmax(logits)` at the ids divided by their sum per token.
    pub fn moe_weights(&mut self, logits: Tensor, ids: Tensor) -> R {
        self.op(Op::MoeWeights, &[logits, ids])
    }

    /// `swiglu(mul_mat(wg, x), mul_mat(wu, x))`: a gated FFN's gate and up projections and their
    /// GLU, `wg` and `wu` of one dtype and shape -> f32, mul_mat's shape.
    pub fn mul_mat_swiglu(&mut self, wg: Tensor, wu: Tensor, x: Tensor) -> R {
        self.op(Op::MulMatSwiglu, &[wg, wu, x])
    }

    /// `swiglu(mul_mat_id(wg, x, ids), mul_mat_id(wu, x, ids))`: the routed experts' gate and up
    /// projections and their GLU -> f32 `[N, n_used, n_tokens]`.
    pub fn mul_mat_id_swiglu(&mut self, wg: Tensor, wu: Tensor, x: Tensor, ids: Tensor) -> R {
        self.op(Op::MulMatIdSwiglu, &[wg, wu, x, ids])
    }

    /// The routed experts' outputs weighted by the router and summed over the slots:
    /// `out[:, t] = sum_u w[0, u, t] * mul_mat_id(experts, x, ids)[:, u, t]`, `w` f32 `[1, n_used,
    /// n_tokens]` -> f32 `[N, n_tokens]`.
    pub fn mul_mat_id_weighted_sum(&mut self, experts: Tensor, x: Tensor, ids: Tensor, w: Tensor) -> R {
        self.op(Op::MulMatIdWeightedSum, &[experts, x, ids, w])
    }

    /// `program` (a chain of unary / binary / scale ops, see [`ElemProgram`]) at every position:
    /// `inputs[i]` is the program's `x{i}` (f32, any strides, `program.n_inputs()` of them), each
    /// broadcasting to the per-dimension largest input shape (ggml's repeat rule) -> f32
    /// contiguous of that shape. What the `elementwise_chains` pass emits.
    pub fn elementwise(&mut self, program: ElemProgram, inputs: &[Tensor]) -> R {
        self.op(Op::Elementwise(program), inputs)
    }

    /// `program` on `inputs` as the separate unary / binary / scale ops it stands for: the
    /// subgraph an `elementwise` node replaces (what its tests compare it with).
    pub fn elementwise_unfused(&mut self, program: &ElemProgram, inputs: &[Tensor]) -> R {
        let mut err = None;
        let y = program.eval(&inputs.iter().map(|&x| Some(x)).collect::<Vec<_>>(), |ins, args| {
            let a = (*args[0])?;
            let r = match *ins {
                ElemInstr::Unary(u, _) => self.unary(u, a),
                ElemInstr::Binary(op, _, _) => self.binary(op, a, (*args[1])?),
                ElemInstr::Scale(s, _) => self.scale_bias(a, s.scale, s.bias),
            };
            r.map_err(|e| err = Some(e)).ok()
        });
        match (y, err) {
            (Some(y), _) => Ok(y),
            (None, Some(e)) => Err(e),
            (None, None) => unreachable!("a failed step records its error"),
        }
    }

    // ---- quantization ----

    /// f32 `x` as a block-quantized tensor of dtype `to` (q8_0 or nvfp4).
    pub fn quantize(&mut self, x: Tensor, to: DType) -> R {
        self.op(Op::Quantize(to), &[x])
    }

    /// A block-quantized tensor's values as f32.
    pub fn dequantize(&mut self, x: Tensor) -> R {
        self.op(Op::Dequantize, &[x])
    }

    // ---- attention ----

    /// Rotary embedding of `x [head_dim, n_head, n_tokens]` at i32 `positions`.
    pub fn rope_multi(&mut self, x: Tensor, positions: Tensor, params: RopeParams) -> R {
        self.op(Op::RopeMulti(params), &[x, positions])
    }

    /// `softmax(scale * q k^T (+ mask)) v`, optionally reading K/V through a block table
    /// (see `Op::FlashAttnExt` for layouts).
    #[allow(clippy::too_many_arguments)]
    pub fn flash_attn_ext(
        &mut self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Option<Tensor>,
        block_table: Option<Tensor>,
        scale: f32,
        softcap: f32,
    ) -> R {
        let params = FlashAttnParams {
            scale,
            softcap,
            mask: mask.is_some(),
            paged: block_table.is_some(),
            ragged: false,
            gate: false,
        };
        let inputs: Vec<Tensor> = [Some(q), Some(k), Some(v), mask, block_table].into_iter().flatten().collect();
        self.op(Op::FlashAttnExt(params), &inputs)
    }

    /// Attention over a ragged (varlen) batch: `q [d_k, n_tokens, n_head, 1]` packs every
    /// sequence's tokens, sequence `s` owning tokens `seq_offsets[s] .. seq_offsets[s + 1]`
    /// (i32 `[n_seq + 1]`); its `L` tokens are the last of its `kv_lens[s]` (i32 `[n_seq]`)
    /// positions and attend causally (bottom-right aligned): token `i` reads positions
    /// `0 ..= kv_lens[s] - L + i` of row `s` of `block_table` (i32 `[n_kv, n_seq]`, paged cache
    /// `[d, n_cells, n_head_kv, 1]`) or of k/v `[d, n_kv, n_head_kv, n_seq]`. An optional `mask`
    /// `[n_kv, >= n_tokens, 1, 1]` adds to the logits (row t for token t). Tokens of no sequence
    /// output 0. Output f32 `[d_v, n_head, n_tokens, 1]` (see `Op::FlashAttnExt`).
    #[allow(clippy::too_many_arguments)]
    pub fn flash_attn_ext_ragged(
        &mut self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Option<Tensor>,
        block_table: Option<Tensor>,
        seq_offsets: Tensor,
        kv_lens: Tensor,
        scale: f32,
        softcap: f32,
    ) -> R {
        let params = FlashAttnParams {
            scale,
            softcap,
            mask: mask.is_some(),
            paged: block_table.is_some(),
            ragged: true,
            gate: false,
        };
        let inputs: Vec<Tensor> = [Some(q), Some(k), Some(v), mask, block_table, Some(seq_offsets), Some(kv_lens)]
            .into_iter()
            .flatten()
            .collect();
        self.op(Op::FlashAttnExt(params), &inputs)
    }

    // ---- recurrent ----

    /// Causal depthwise conv of `sx [d_conv - 1 + n_t, channels, n_seq]` with `kernel [d_conv, channels]`.
    pub fn ssm_conv(&mut self, sx: Tensor, kernel: Tensor) -> R {
        self.op(Op::SsmConv, &[sx, kernel])
    }

    /// One decode-time conv step per sequence, updating each sequence's slot of `state` in place.
    pub fn ssm_conv_update_inplace(
        &mut self,
        x: Tensor,
        state: Tensor,
        kernel: Tensor,
        slots: Tensor,
        silu: bool,
    ) -> R {
        self.op(Op::SsmConvUpdate { silu, ragged: false }, &[x, state, kernel, slots])
    }

    /// [`Graph::ssm_conv_update_inplace`] on a ragged batch: `x [channels, n_tokens, 1, 1]` packs
    /// the tokens of all sequences, sequence `s` owning tokens `seq_offsets[s] ..
    /// seq_offsets[s + 1]` (i32 `[n_seq + 1]`) and state slot `slots[s]` (i32 `[n_seq]`). Each
    /// sequence with tokens convolves them after its slot's `d_conv - 1` saved samples and saves
    /// its last `d_conv - 1`; one without tokens touches nothing; tokens of no sequence output 0.
    /// Output f32 `[channels, n_tokens, 1, 1]`.
    pub fn ssm_conv_update_inplace_ragged(
        &mut self,
        x: Tensor,
        state: Tensor,
        kernel: Tensor,
        slots: Tensor,
        seq_offsets: Tensor,
        silu: bool,
    ) -> R {
        self.op(Op::SsmConvUpdate { silu, ragged: true }, &[x, state, kernel, slots, seq_offsets])
    }

    /// The gated delta rule, reading and writing each sequence's state slot in place.
    #[allow(clippy::too_many_arguments)]
    pub fn gated_delta_net(
        &mut self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        g: Tensor,
        beta: Tensor,
        state: Tensor,
        slots: Tensor,
        params: GatedDeltaNetParams,
    ) -> R {
        self.op(Op::GatedDeltaNet(GatedDeltaNetParams { ragged: false, ..params }), &[q, k, v, g, beta, state, slots])
    }

    /// [`Graph::gated_delta_net`] on a ragged batch (sets `params.ragged`): q, k `[S_k, H_k,
    /// n_tokens, 1]`, v `[S_v, H_v, n_tokens, 1]`, g, beta `[1, H_v, n_tokens, 1]` pack the tokens
    /// of all sequences, sequence `s` owning tokens `seq_offsets[s] .. seq_offsets[s + 1]` (i32
    /// `[n_seq + 1]`) and state slot `slots[s]` (i32 `[n_seq]`). Each sequence with tokens runs
    /// from its slot's state and writes its final state back; one without tokens touches nothing;
    /// tokens of no sequence output 0. Output f32 `[S_v, H_v, n_tokens, 1]`.
    #[allow(clippy::too_many_arguments)]
    pub fn gated_delta_net_ragged(
        &mut self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        g: Tensor,
        beta: Tensor,
        state: Tensor,
        slots: Tensor,
        seq_offsets: Tensor,
        params: GatedDeltaNetParams,
    ) -> R {
        let params = GatedDeltaNetParams { ragged: true, ..params };
        self.op(Op::GatedDeltaNet(params), &[q, k, v, g, beta, state, slots, seq_offsets])
    }

    /// [`Graph::gated_delta_net`] (ragged when `seq_offsets` is given, as
    /// [`Graph::gated_delta_net_ragged`]) with its input preparation fused:
    /// `gated_delta_net(l2_norm(q, eps), l2_norm(k, eps), v, reshape(softplus(alpha + dt_bias) *
    /// a), reshape(sigmoid(beta)), ..)` where q and k are the first and last `H_k` heads of `qk`
    /// f32 `[S_k, 2 H_k, n_t, n_seq]` (dense rows), `alpha`, `beta` f32 `[H_v, n_t, n_seq, 1]`,
    /// `dt_bias`, `a` f32 broadcasting to `alpha` (see `Op::GatedDeltaNetFused`).
    #[allow(clippy::too_many_arguments)]
    pub fn gated_delta_net_fused(
        &mut self,
        qk: Tensor,
        v: Tensor,
        alpha: Tensor,
        dt_bias: Tensor,
        a: Tensor,
        beta: Tensor,
        state: Tensor,
        slots: Tensor,
        seq_offsets: Option<Tensor>,
        eps: f32,
        params: GatedDeltaNetParams,
    ) -> R {
        let net = GatedDeltaNetParams { ragged: seq_offsets.is_some(), ..params };
        let mut inputs = vec![qk, v, alpha, dt_bias, a, beta, state, slots];
        inputs.extend(seq_offsets);
        self.op(Op::GatedDeltaNetFused(GatedDeltaNetFusedParams { net, eps }), &inputs)
    }
}

/// The views of a `moe_router` output `[k', n, 2]` (contiguous): its ids `[k', n]` and the
/// weights' plane `[1, k', n]` (still i32; bitcast it to f32).
pub fn router_planes(router: TensorMeta) -> (ViewParams, ViewParams) {
    let [slots, n, _, _] = router.ne;
    let nb = router.nb;
    let ids = ViewParams { ne: [slots, n, 1, 1], nb: [nb[0], nb[1], nb[2], nb[2]], offset: 0 };
    let weights = ViewParams { ne: [1, slots, n, 1], nb: [nb[0], nb[0], nb[1], nb[2]], offset: nb[2] };
    (ids, weights)
}
