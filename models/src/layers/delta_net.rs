//! Gated DeltaNet linear attention over the recurrent cache, as llama.cpp builds Qwen3.5's
//! linear-attention layers (docs/notes/hybrid-ops.md §2.2): the qkv, z, beta and alpha
//! projections (stacked at load into one matmul where they fit), the causal conv through the
//! layer's conv ring (`ssm_conv_update_inplace`, SiLU), l2-normed q and k, `beta = sigmoid`,
//! the decay `softplus(alpha + dt_bias) * A`, the delta rule reading and writing the layer's state
//! slots in place (token-serial for decode steps, chunked otherwise), a gated RMS norm
//! (`rms_norm(o) * w * silu(z)`) and the output projection.
//!
//! Weights under a block prefix `pre` (`e = n_embd`, `H_k` key heads of `S_k`, `H_v` value heads
//! of `S_v`, `ch = 2 H_k S_k + H_v S_v` conv channels):
//!
//! | name | shape |
//! | --- | --- |
//! | `{pre}.attn_qkv.weight` | `[e, ch]` |
//! | `{pre}.attn_gate.weight` (z) | `[e, H_v S_v]` |
//! | `{pre}.ssm_beta.weight`, `{pre}.ssm_alpha.weight` | `[e, H_v]` |
//! | `{pre}.ssm_conv1d.weight` | `[d_conv, ch]` |
//! | `{pre}.ssm_dt.bias`, `{pre}.ssm_a` | `[H_v]` |
//! | `{pre}.ssm_norm.weight` | `[S_v]` |
//! | `{pre}.ssm_out.weight` | `[H_v S_v, e]` |
//!
//! The layer's cache is the one its [`crate::arch::LayerCacheNeed::Recurrent`] declared: conv
//! `[d_conv - 1, ch]` and state `[S_k, S_v, H_v]` per slot.

use tessera_graph::Tensor;
use tessera_ops::{DeltaNetAlgo, GatedDeltaNetParams, HeadMap};

use crate::arch::StepBuilder;
use crate::layers::project::{ProjectionGroup, Rows, project_group};
use crate::model::ModelError;

/// The shape of one gated DeltaNet layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeltaNetSpec {
    /// `H_k`, the key (and query) heads; a divisor of `n_head_v` (value head `h` reads key head
    /// `h mod H_k`: [`HeadMap::Tiled`]).
    pub n_head_k: usize,
    /// `H_v`, the value heads.
    pub n_head_v: usize,
    /// `S_k`, the key head dim.
    pub head_k_dim: usize,
    /// `S_v`, the value head dim.
    pub head_v_dim: usize,
    /// Epsilon of the q/k l2 norms and of the gated output norm.
    pub eps: f32,
}

impl DeltaNetSpec {
    /// Conv channels: `2 H_k S_k + H_v S_v` (q, k and v side by side).
    pub fn conv_channels(&self) -> usize {
        2 * self.n_head_k * self.head_k_dim + self.n_head_v * self.head_v_dim
    }
}

/// The projection groups of block `pre`, widest first: all four (`{pre}.in_proj.merged`), or
/// qkv with z and beta with alpha when all four do not stack (their dtypes differ).
pub fn projection_groups(pre: &str) -> Vec<ProjectionGroup> {
    let w = |n: &str| format!("{pre}.{n}.weight");
    vec![
        ProjectionGroup::new(
            &[w("attn_qkv"), w("attn_gate"), w("ssm_beta"), w("ssm_alpha")],
            format!("{pre}.in_proj.merged"),
        ),
        ProjectionGroup::new(&[w("attn_qkv"), w("attn_gate")], format!("{pre}.in_proj_qkvz.merged")),
        ProjectionGroup::new(&[w("ssm_beta"), w("ssm_alpha")], format!("{pre}.in_proj_ba.merged")),
    ]
}

/// The gated DeltaNet of layer `il` (weights under `pre`) over `x` `[n_embd, n_tokens]`:
/// `[n_embd, n_tokens]`. The layer must have declared a recurrent cache.
pub fn delta_net(
    b: &mut StepBuilder<'_>,
    spec: &DeltaNetSpec,
    il: usize,
    pre: &str,
    x: Tensor,
) -> Result<Tensor, ModelError> {
    let DeltaNetSpec { n_head_k: hk, n_head_v: hv, head_k_dim: sk, head_v_dim: sv, eps } = *spec;
    let ch = spec.conv_channels();
    let n = x.ne()[1];
    let f = 4;
    let groups = projection_groups(pre);
    let rows = if b.has_weight(&groups[0].merged) {
        project_group(b, x, &groups[0])?
    } else {
        let mut rows = project_group(b, x, &groups[1])?;
        rows.extend(project_group(b, x, &groups[2])?);
        rows
    };
    let [qkv, z, beta, alpha]: [Rows; 4] =
        rows.try_into().map_err(|_| ModelError::Layer { why: "delta net: not four projections".into() })?;
    let w_conv = b.param(&format!("{pre}.ssm_conv1d.weight"))?;
    let dt_bias = b.param(&format!("{pre}.ssm_dt.bias"))?;
    let ssm_a = b.param(&format!("{pre}.ssm_a"))?;
    let w_norm = b.param(&format!("{pre}.ssm_norm.weight"))?;
    let w_out = b.param(&format!("{pre}.ssm_out.weight"))?;
    let (conv_state, delta_state) = b.recurrent_state(il)?;
    let l = b.leaves();
    let g = &mut b.g;

    // The conv update (an in-place write) comes before the beta and decay ops, so that nothing
    // writes in place between them and the delta rule (the delta_net_prep pass's condition).
    let qkv = qkv.rows(g, ch)?;
    let conv = g.ssm_conv_update_inplace_ragged(qkv, conv_state, w_conv, l.slots, l.seq_offsets, true)?; // [ch, n, 1]

    let beta = beta.rows(g, hv)?;
    let beta = g.sigmoid(beta)?;
    let beta = g.reshape(beta, &[1, hv, n, 1])?;
    let alpha = alpha.rows(g, hv)?;
    let alpha = g.add(alpha, dt_bias)?;
    let alpha = g.softplus(alpha)?;
    let gdecay = g.mul(alpha, ssm_a)?;
    let gdecay = g.reshape(gdecay, &[1, hv, n, 1])?;

    let nb = |d: usize| [f, d * f, ch * f, ch * n * f];
    // q and k lie side by side in each token's conv output: one l2_norm over both heads' rows
    let qk = g.view(conv, [sk, 2 * hk, n, 1], nb(sk), 0)?;
    let qk = g.l2_norm(qk, eps)?; // [sk, 2 hk, n] contiguous
    let nb_qk = [f, sk * f, 2 * hk * sk * f, 2 * hk * sk * n * f];
    let q = g.view(qk, [sk, hk, n, 1], nb_qk, 0)?;
    let k = g.view(qk, [sk, hk, n, 1], nb_qk, hk * sk * f)?;
    let v = g.view(conv, [sv, hv, n, 1], nb(sv), 2 * hk * sk * f)?;
    let algo = if l.decode { DeltaNetAlgo::Serial } else { DeltaNetAlgo::Chunked { chunk: 64 } };
    let params = GatedDeltaNetParams { scale: 1.0 / (sk as f32).sqrt(), head_map: HeadMap::Tiled, algo, ragged: true };
    let o = g.gated_delta_net_ragged(q, k, v, gdecay, beta, delta_state, l.slots, l.seq_offsets, params)?; // [sv, hv, n, 1]

    let o = g.rms_norm(o, eps)?;
    let o = g.mul(o, w_norm)?;
    let z = z.heads(g, sv, hv)?;
    let z = g.silu(z)?;
    let o = g.mul(o, z)?;
    let o = g.reshape(o, &[hv * sv, n])?;
    Ok(g.mul_mat(w_out, o)?)
}
