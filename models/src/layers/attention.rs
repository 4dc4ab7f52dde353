//! Attention over the paged KV cache, as llama.cpp's Qwen families build it: q/k/v projections
//! (one matmul when they were stacked at load), optional per-head q/k RMS norms, rotary
//! embedding, this step's K/V rows written into the layer's cache (`set_rows` at the step's
//! `write_cells`), ragged flash attention through the block table, an optional sigmoid output
//! gate, and the output projection.
//!
//! Weights, under a block prefix `pre` (llama.cpp names, ggml-order shapes, `e = n_embd`,
//! `hd = head_dim`):
//!
//! | name | shape | when |
//! | --- | --- | --- |
//! | `{pre}.attn_q.weight` | `[e, hd n_head]`, or `[e, 2 hd n_head]` with a gate | always |
//! | `{pre}.attn_k.weight`, `{pre}.attn_v.weight` | `[e, hd n_head_kv]` | always |
//! | `{pre}.attn_output.weight` | `[hd n_head, e]` | always |
//! | `{pre}.attn_q_norm.weight`, `{pre}.attn_k_norm.weight` | `[hd]` | [`AttentionSpec::qk_norm`] |
//!
//! The layer's cache is the one its [`crate::arch::LayerCacheNeed::Attention`] declared:
//! `n_head_kv` heads of `head_dim` for both K and V.

use tessera_graph::Tensor;
use tessera_ops::RopeParams;

use crate::arch::StepBuilder;
use crate::layers::project::{ProjectionGroup, Rows, project_group};
use crate::model::ModelError;

/// How the output gate is stored, when the attention has one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GateLayout {
    /// Qwen3.5: `attn_q` holds `2 hd` rows per head, the head's q then its gate; the output is
    /// multiplied by `sigmoid(gate)` before the output projection.
    InterleavedPerHead,
}

/// The shape and options of one attention layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionSpec {
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads; query head `h` reads kv head `h / (n_head / n_head_kv)` (a divisor of
    /// `n_head`).
    pub n_head_kv: usize,
    /// Per-head dim of q, k and v.
    pub head_dim: usize,
    /// Epsilon of the q/k RMS norms.
    pub eps: f32,
    /// Per-head RMS norm of q and k (times `attn_q_norm` / `attn_k_norm`) before the rotary
    /// embedding.
    pub qk_norm: bool,
    /// The rotary embedding of q and k. With `sections` (M-RoPE) the step's four position
    /// streams are read; without, the first (the token positions).
    pub rope: RopeParams,
    /// The output gate, if any.
    pub gate: Option<GateLayout>,
}

/// The q, k, v projection group of block `pre` (stacked at load as `{pre}.attn_qkv.merged`).
pub fn projection_groups(pre: &str) -> Vec<ProjectionGroup> {
    let w = |n: &str| format!("{pre}.{n}.weight");
    vec![ProjectionGroup::new(&[w("attn_q"), w("attn_k"), w("attn_v")], format!("{pre}.attn_qkv.merged"))]
}

/// The attention of layer `il` (weights under `pre`) over `x` `[n_embd, n_tokens]`: `[n_embd,
/// n_tokens]`. The layer must have declared an attention cache.
pub fn attention(
    b: &mut StepBuilder<'_>,
    spec: &AttentionSpec,
    il: usize,
    pre: &str,
    x: Tensor,
) -> Result<Tensor, ModelError> {
    let AttentionSpec { n_head: nh, n_head_kv: nkv, head_dim: hd, eps, .. } = *spec;
    let n = x.ne()[1];
    let f = 4; // f32 activations
    let group = projection_groups(pre).swap_remove(0);
    let rows = project_group(b, x, &group)?;
    let [qg, k, v]: [Rows; 3] =
        rows.try_into().map_err(|_| ModelError::Layer { why: "q/k/v: not three projections".into() })?;
    let wo = b.param(&format!("{pre}.attn_output.weight"))?;
    let norms = if spec.qk_norm {
        Some((b.param(&format!("{pre}.attn_q_norm.weight"))?, b.param(&format!("{pre}.attn_k_norm.weight"))?))
    } else {
        None
    };
    let l = b.leaves();
    let g = &mut b.g;

    let (q, gate) = match spec.gate {
        Some(GateLayout::InterleavedPerHead) => {
            // q and its gate interleaved per head in rows 0 .. 2 hd nh of the q projection
            let step = qg.total * f;
            let nb = [f, 2 * hd * f, step, step * n];
            let q = g.view(qg.product, [hd, nh, n, 1], nb, qg.first * f)?;
            // read in place by the gating below (no copy: the output has the view's shape)
            let gate = g.view(qg.product, [hd, nh, n, 1], nb, (qg.first + hd) * f)?;
            (q, Some(gate))
        }
        None => (qg.heads(g, hd, nh)?, None),
    };
    let mut q = q;
    if let Some((qn, _)) = norms {
        q = g.rms_norm(q, eps)?;
        q = g.mul(q, qn)?;
    }
    let mut k = k.heads(g, hd, nkv)?;
    if let Some((_, kn)) = norms {
        k = g.rms_norm(k, eps)?;
        k = g.mul(k, kn)?;
    }
    let v = v.rows(g, hd * nkv)?;

    let positions = if spec.rope.sections.is_some() {
        l.positions
    } else {
        // stream-major: the first stream is the token positions
        g.view(l.positions, [n, 1, 1, 1], [4, 4 * n, 4 * n, 4 * n], 0)?
    };
    let q = g.rope_multi(q, positions, spec.rope)?;
    let k = g.rope_multi(k, positions, spec.rope)?;

    let cache = b.kv_cache(il)?;
    let g = &mut b.g;
    let k = g.reshape(k, &[hd * nkv, n])?;
    let kc = g.set_rows(cache.k, k, l.write_cells)?;
    let vc = g.set_rows(cache.v, v, l.write_cells)?;
    let kc = g.view(kc, cache.k_view.ne, cache.k_view.nb, 0)?;
    let vc = g.view(vc, cache.v_view.ne, cache.v_view.nb, 0)?;

    let q = g.permute(q, [0, 2, 1, 3])?; // [hd, n, nh, 1]
    let scale = 1.0 / (hd as f32).sqrt();
    let (bt, offs, lens) = (Some(l.block_table), l.seq_offsets, l.kv_lens);
    let mut o = g.flash_attn_ext_ragged(q, kc, vc, None, bt, offs, lens, scale, 0.0)?; // [hd, nh, n, 1]
    if let Some(gate) = gate {
        let sg = g.sigmoid(gate)?;
        o = g.mul(o, sg)?;
    }
    let o = g.reshape(o, &[hd * nh, n])?;
    Ok(g.mul_mat(wo, o)?)
}
