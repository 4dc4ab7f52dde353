//! Feed-forward blocks: dense SwiGLU, and a mixture of experts with top-k routing, with or
//! without a sigmoid-gated shared expert (docs/notes/hybrid-ops.md §5.1).
//!
//! Weights under a block prefix `pre` (`e = n_embd`, `E` experts of `ff` units):
//!
//! | name | shape | block |
//! | --- | --- | --- |
//! | `{pre}.ffn_gate.weight`, `{pre}.ffn_up.weight` | `[e, n_ff]` | dense |
//! | `{pre}.ffn_down.weight` | `[n_ff, e]` | dense |
//! | `{pre}.ffn_gate_inp.weight` (router) | `[e, E]` | MoE |
//! | `{pre}.ffn_gate_exps.weight`, `{pre}.ffn_up_exps.weight` | `[e, ff, E]` | MoE |
//! | `{pre}.ffn_down_exps.weight` | `[ff, e, E]` | MoE |
//! | `{pre}.ffn_gate_inp_shexp.weight` (shared gate) | `[e]` | shared expert |
//! | `{pre}.ffn_{gate,up}_shexp.weight` | `[e, ff_sh]` | shared expert |
//! | `{pre}.ffn_down_shexp.weight` | `[ff_sh, e]` | shared expert |
//!
//! A shared expert with the routed experts' width and dtype can run as one more routed slot:
//! [`route_shared_expert`] stacks its weights after the experts' at load (index `E`), and
//! [`moe`] then routes every token to it as slot `k` with weight `sigmoid(shared gate)` (on steps
//! of at most [`MoeSpec::route_shared_max_tokens`] tokens).

use tessera_graph::{Backend, Graph, Tensor};

use crate::arch::StepBuilder;
use crate::layers::project::{Rows, project};
use crate::model::ModelError;
use crate::weights::{ModelWeights, WeightsError};

/// Dense SwiGLU: `down(silu(gate(x)) * up(x))` over `x` `[n_embd, n]`, weights under `pre`.
pub fn swiglu(b: &mut StepBuilder<'_>, pre: &str, x: Tensor) -> Result<Tensor, ModelError> {
    let wg = b.param(&format!("{pre}.ffn_gate.weight"))?;
    let wu = b.param(&format!("{pre}.ffn_up.weight"))?;
    let wd = b.param(&format!("{pre}.ffn_down.weight"))?;
    let g = &mut b.g;
    let gt = g.mul_mat(wg, x)?;
    let up = g.mul_mat(wu, x)?;
    let a = g.swiglu(gt, up)?;
    Ok(g.mul_mat(wd, a)?)
}

/// The routing and the experts of one MoE block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeSpec {
    /// Routed experts (`E`).
    pub n_expert: usize,
    /// Experts per token (`k`, at most `E`): the top `k` of the router's softmax.
    pub n_expert_used: usize,
    /// Divide the `k` routing weights by their sum (Qwen3-MoE's `norm_topk_prob`, Qwen3.5's
    /// routing); else they are the softmax probabilities as they are.
    pub renormalize: bool,
    /// A sigmoid-gated shared expert (`ffn_*_shexp`) is added to the routed experts' sum.
    pub shared_expert: bool,
    /// Steps of at most this many tokens run the shared expert as routed slot `k` when
    /// [`route_shared_expert`] stacked it at load (else, and on longer steps, it runs on its
    /// own). From [`crate::model::ModelOptions::route_shared_expert`].
    pub route_shared_max_tokens: usize,
}

/// The constant i32 `[1, 1]` holding the shared expert's index among the stacked experts
/// (`n_expert`), placed by [`insert_shared_expert_id`].
pub const SHARED_EXPERT_ID: &str = "moe.shared_expert_id";

/// The stacked gate, up and down experts of block `pre` when its shared expert is routed: routed
/// experts `0..n_expert`, the shared expert last.
pub fn stacked_experts(pre: &str) -> [String; 3] {
    ["gate", "up", "down"].map(|p| format!("{pre}.ffn_{p}_exps.merged"))
}

/// The router's rows of block `pre` stacked with the shared expert's gate row.
pub fn stacked_router(pre: &str) -> String {
    format!("{pre}.ffn_gate_inp.merged")
}

/// Makes block `pre`'s shared expert one more routed expert, once at load: its gate, up and down
/// matrices stacked after the routed experts' ([`ModelWeights::stack`]) and its gate row after the
/// router's rows. Returns whether anything was stacked; a block whose shared expert has another
/// width or dtype than its routed experts is left alone. Once any block stacked, call
/// [`insert_shared_expert_id`].
pub fn route_shared_expert(
    weights: &mut ModelWeights,
    pre: &str,
    backend: &mut dyn Backend,
) -> Result<bool, WeightsError> {
    let w = |n: &str| format!("{pre}.ffn_{n}.weight");
    let parts = ["gate", "up", "down"].map(|p| [w(&format!("{p}_exps")), w(&format!("{p}_shexp"))]);
    let fits = parts.iter().all(|[exps, shexp]| {
        let (Ok(e), Ok(s)) = (weights.get(exps), weights.get(shexp)) else { return false };
        e.meta.dtype == s.meta.dtype && e.meta.ne[..2] == s.meta.ne[..2] && s.meta.ne[2..] == [1, 1]
    });
    if !fits {
        return Ok(false);
    }
    let mut any = false;
    for ([exps, shexp], merged) in parts.iter().zip(stacked_experts(pre)) {
        any |= weights.stack(&[exps, shexp], &merged, 2, backend)?;
    }
    // (rows a multiple of 4: the router's logits then have 16-byte rows, read as float4)
    weights.stack_padded(&[&w("gate_inp"), &w("gate_inp_shexp")], &stacked_router(pre), 1, 4, backend)?;
    Ok(any)
}

/// Places [`SHARED_EXPERT_ID`] = `n_expert`, the index a stacked shared expert has.
pub fn insert_shared_expert_id(
    weights: &mut ModelWeights,
    n_expert: usize,
    backend: &mut dyn Backend,
) -> Result<(), WeightsError> {
    let id = i32::try_from(n_expert).map_err(|_| WeightsError::Bad {
        name: SHARED_EXPERT_ID.into(),
        why: format!("{n_expert} experts overflow an i32"),
    })?;
    weights.insert_i32(SHARED_EXPERT_ID, [1, 1, 1, 1], &[id], backend)
}

/// The MoE block of `pre` over `x` `[n_embd, n]`: `[n_embd, n]`.
pub fn moe(b: &mut StepBuilder<'_>, spec: &MoeSpec, pre: &str, x: Tensor) -> Result<Tensor, ModelError> {
    let k = spec.n_expert_used;
    if spec.shared_expert && x.ne()[1] <= spec.route_shared_max_tokens {
        let stacked = stacked_experts(pre);
        if stacked.iter().all(|m| b.has_weight(m)) && b.has_weight(SHARED_EXPERT_ID) {
            return moe_shared_routed(b, spec, pre, x, &stacked);
        }
    }
    let w_inp = b.param(&format!("{pre}.ffn_gate_inp.weight"))?;
    let w_ge = b.param(&format!("{pre}.ffn_gate_exps.weight"))?;
    let w_ue = b.param(&format!("{pre}.ffn_up_exps.weight"))?;
    let w_de = b.param(&format!("{pre}.ffn_down_exps.weight"))?;
    let shared = if spec.shared_expert {
        Some([
            b.param(&format!("{pre}.ffn_gate_inp_shexp.weight"))?,
            b.param(&format!("{pre}.ffn_gate_shexp.weight"))?,
            b.param(&format!("{pre}.ffn_up_shexp.weight"))?,
            b.param(&format!("{pre}.ffn_down_shexp.weight"))?,
        ])
    } else {
        None
    };
    let g = &mut b.g;

    let logits = g.mul_mat(w_inp, x)?; // [n_expert, n]
    let probs = g.softmax(logits, 1.0, None)?;
    let sel = g.top_k(probs, k)?; // i32 [k, n]
    let w = routing_weights(g, probs, sel, k, spec.renormalize)?;
    let moe = routed_experts(g, [w_ge, w_ue, w_de], x, sel, w)?;
    let Some([w_sh_inp, w_sg, w_su, w_sd]) = shared else { return Ok(moe) };

    let sg = g.mul_mat(w_sg, x)?;
    let su = g.mul_mat(w_su, x)?;
    let sa = g.swiglu(sg, su)?;
    let sh = g.mul_mat(w_sd, sa)?; // [e, n]
    let gate = g.mul_mat(w_sh_inp, x)?; // [1, n]
    let gate = g.sigmoid(gate)?;
    let sh = g.mul(sh, gate)?;
    Ok(g.add(moe, sh)?)
}

/// The MoE block with its shared expert routed as slot `k` of every token: the router's logits
/// and the shared gate's in one matmul, the routed ids with the shared expert's appended, the
/// routed weights with `sigmoid` of the shared gate appended, and the experts' matmuls over
/// `k + 1` slots.
fn moe_shared_routed(
    b: &mut StepBuilder<'_>,
    spec: &MoeSpec,
    pre: &str,
    x: Tensor,
    stacked: &[String; 3],
) -> Result<Tensor, ModelError> {
    let (n_expert, k) = (spec.n_expert, spec.n_expert_used);
    let n = x.ne()[1];
    let router = [format!("{pre}.ffn_gate_inp.weight"), format!("{pre}.ffn_gate_inp_shexp.weight")];
    let rows = project(b, x, &router, Some(&stacked_router(pre)))?;
    let experts = [b.param(&stacked[0])?, b.param(&stacked[1])?, b.param(&stacked[2])?];
    // The shared expert's index for every token, i32 [1, n], built once a step graph.
    let shared = b.memo("moe.shared_expert_ids", |b| {
        let id = b.param(SHARED_EXPERT_ID)?;
        Ok(b.g.repeat(id, &[1, n])?)
    })?;
    let g = &mut b.g;
    let logits = rows[0].rows(g, n_expert)?; // [n_expert, n]
    let gate = rows[1].rows(g, 1)?; // [1, n]
    let probs = g.softmax(logits, 1.0, None)?;
    let sel = g.top_k(probs, k)?;
    let ids = g.concat(sel, shared, 0)?; // i32 [k + 1, n]
    let routed = Rows { product: ids, first: 0, total: k + 1 }.rows(g, k)?;
    let w = routing_weights(g, probs, routed, k, spec.renormalize)?;
    let gate = g.sigmoid(gate)?;
    let gate = g.reshape(gate, &[1, 1, n])?;
    let w = g.concat(w, gate, 1)?; // [1, k + 1, n]
    routed_experts(g, experts, x, ids, w)
}

/// The routing weights of the experts `sel` (`[k, n]`): `probs` at them, renormalised over the
/// `k` slots when `renormalize`, `[1, k, n]`.
pub fn routing_weights(
    g: &mut Graph,
    probs: Tensor,
    sel: Tensor,
    k: usize,
    renormalize: bool,
) -> Result<Tensor, ModelError> {
    let [n_expert, n, ..] = probs.ne();
    let p3 = g.reshape(probs, &[1, n_expert, n])?;
    let w = g.get_rows(p3, sel)?; // [1, k, n]
    if !renormalize {
        return Ok(w);
    }
    let w = g.reshape(w, &[k, n])?;
    let wsum = g.sum_rows(w)?; // [1, n]
    let w = g.div(w, wsum)?;
    Ok(g.reshape(w, &[1, k, n])?)
}

/// `sum_u w[u] * down_u(swiglu(gate_u(x), up_u(x)))` over the slots `u` of `ids` (`[slots, n]`),
/// the experts' `[gate, up, down]` stacks indexed by the ids: `[n_embd, n]`.
pub fn routed_experts(
    g: &mut Graph,
    [w_ge, w_ue, w_de]: [Tensor; 3],
    x: Tensor,
    ids: Tensor,
    w: Tensor,
) -> Result<Tensor, ModelError> {
    let [e, n, ..] = x.ne();
    let cur = g.reshape(x, &[e, 1, n])?;
    let gt = g.mul_mat_id(w_ge, cur, ids)?; // [n_ff, slots, n]
    let up = g.mul_mat_id(w_ue, cur, ids)?;
    let a = g.swiglu(gt, up)?;
    let ex = g.mul_mat_id(w_de, a, ids)?; // [e, slots, n]
    let ex = g.mul(ex, w)?;
    // the weighted experts summed over the slots in one reduction (k - 1 adds of slot views
    // were k - 1 launches a layer)
    let slots_first = g.transpose(ex)?; // [slots, e, n]
    let moe = g.sum_rows(slots_first)?; // [1, e, n]
    Ok(g.reshape(moe, &[e, n])?)
}
