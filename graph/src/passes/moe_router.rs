//! The MoE router, in two passes over what the model builder writes:
//!
//! ```text
//! probs = softmax(logits)                 [n_expert, n]
//! ids   = top_k(probs, k)                 i32 [k, n]          softmax_top_k(logits)
//! w     = get_rows(reshape(probs), ids)   [1, k, n]
//! w     = reshape(w, [k, n])                                   moe_weights(logits, ids)
//! w     = div(w, sum_rows(w))                                  -> [1, k, n]
//! w     = reshape(w, [1, k, n])
//! ```
//!
//! A shared expert routed as one more slot (qwen35's `ffn` when its weights were stacked with the
//! routed experts') extends both ends, and both fusions take the extension along:
//!
//! ```text
//! ids = concat(top_k(probs, k), tail, 0)               softmax_top_k(logits, tail)
//! w   = get_rows(.., view(ids, the first k rows)) ..
//! w   = concat(w, reshape(sigmoid(gate), [1, 1, n]), 1)    moe_weights(logits, ids, gate)
//! ```
//!
//! `softmax_top_k` runs first: afterwards the softmax is read only by the weights' chain, which
//! `moe_weights` then swallows whole. `moe_router` then merges the two fused ops of the same
//! logits into one (its output packs the ids and the weights' bits as two i32 planes; the
//! readers get views of them, the weights' bitcast to f32).

use tessera_ops::{BinaryOp, DType, Op, SoftmaxParams, UnaryOp};

use super::Pass;
use super::pattern::Matcher;
use crate::build::router_planes;
use crate::graph::{Graph, NodeId};
use crate::rewrite::{FusedOutput, Fusion};

/// `probs = softmax(logits)` with scale 1 and no mask: its input.
fn plain_softmax(m: &Matcher<'_>, probs: NodeId) -> Option<NodeId> {
    match m.op(probs)? {
        Op::Softmax(SoftmaxParams { scale }) if *scale == 1.0 && m.inputs(probs).len() == 1 => m.input(probs, 0),
        _ => None,
    }
}

/// See the module doc.
pub struct SoftmaxTopK;

impl Pass for SoftmaxTopK {
    fn name(&self) -> &'static str {
        "softmax_top_k"
    }

    fn find(&self, g: &Graph) -> Vec<Fusion> {
        let m = Matcher::new(g);
        m.ops()
            .filter_map(|(top, op)| {
                let Op::TopK { k } = op else { return None };
                let probs = m.input(top, 0)?;
                let logits = plain_softmax(&m, probs)?;
                // The softmax stays if something else reads it (else it is dropped as dead); the
                // fused op recomputes it, so no in-place write may come between the two.
                let (nodes, inputs, last) = match appended(&m, top) {
                    Some((concat, tail)) => (vec![top, concat], vec![logits, tail], concat),
                    None => (vec![top], vec![logits], top),
                };
                Some(Fusion {
                    nodes,
                    op: Op::SoftmaxTopK { k: *k },
                    inputs,
                    outputs: vec![(last, FusedOutput::Whole)],
                    recomputes: vec![probs],
                })
            })
            .collect()
    }
}

/// `concat(top, tail, 0)` as the only reader of `top`, with an i32 `tail` of `top`'s tokens: the
/// concat and the tail.
fn appended(m: &Matcher<'_>, top: NodeId) -> Option<(NodeId, NodeId)> {
    let (concat, _) = m.sole_user_op(top, |o| *o == Op::Concat { dim: 0 })?;
    let tail = m.input(concat, 1)?;
    let (t, x) = (m.meta(tail), m.meta(top));
    (m.input(concat, 0)? == top && t.dtype == DType::I32 && t.ne[1..] == x.ne[1..]).then_some((concat, tail))
}

/// See the module doc.
pub struct MoeWeights;

impl Pass for MoeWeights {
    fn name(&self) -> &'static str {
        "moe_weights"
    }

    fn find(&self, g: &Graph) -> Vec<Fusion> {
        Matcher::new(g).fusions_at(&Op::GetRows, weights_chain)
    }
}

/// The chain from `get = get_rows(reshape(softmax(logits)), ids)` to the renormalised weights.
fn weights_chain(m: &Matcher<'_>, get: NodeId) -> Option<Fusion> {
    let (p3, ids) = (m.input(get, 0)?, m.input(get, 1)?);
    let Op::Reshape { .. } = m.op(p3)? else { return None };
    let probs = m.input(p3, 0)?;
    let logits = plain_softmax(m, probs)?;
    let [n_expert, n, 1, 1] = m.meta(probs).ne else { return None };
    if m.meta(p3).ne != [1, n_expert, n, 1] {
        return None;
    }
    // get -> reshape [k, n] read by sum_rows and div only; div(w, sum) -> reshape [1, k, n].
    let r1 = m.only_reader(get)?;
    let [k, n1, 1, 1] = m.meta(r1).ne else { return None };
    if n1 != n || !matches!(m.op(r1)?, Op::Reshape { .. }) {
        return None;
    }
    let users: Vec<NodeId> = m.users(r1).collect();
    let [a, b] = users[..] else { return None };
    let (sum, div) = if m.op(a)? == &Op::SumRows { (a, b) } else { (b, a) };
    if m.op(sum)? != &Op::SumRows
        || m.op(div)? != &Op::Binary(BinaryOp::Div)
        || m.inputs(div) != [r1, sum]
        || m.only_reader(sum)? != div
        || m.graph().is_output(r1)
    {
        return None;
    }
    let r2 = m.only_reader(div)?;
    if !matches!(m.op(r2)?, Op::Reshape { .. }) || m.meta(r2).ne != [1, k, n, 1] {
        return None;
    }
    let mut nodes = vec![get, r1, sum, div, r2];
    let mut inputs = vec![logits, ids];
    let mut last = r2;
    if let Some((concat, gate, chain)) = gated(m, r2) {
        nodes.extend(chain);
        inputs.push(gate);
        last = concat;
    }
    // The probabilities go too when nothing else reads them.
    if m.only_reader(p3) == Some(get) {
        nodes.push(p3);
        if m.only_reader(probs) == Some(p3) {
            nodes.push(probs);
        }
    }
    // What stays outside (read by others) the fused op still recomputes from the logits.
    let recomputes = [probs, p3].into_iter().filter(|n| !nodes.contains(n)).collect();
    Some(Fusion { nodes, op: Op::MoeWeights, inputs, outputs: vec![(last, FusedOutput::Whole)], recomputes })
}

/// `concat(w, reshape(sigmoid(gate), [1, 1, n]), 1)` as the only reader of the weights `w`
/// `[1, k, n]`, with `gate` f32 `[1, n]` and the sigmoid and reshape read once: the concat, the
/// gate and the nodes from the sigmoid to the concat.
fn gated(m: &Matcher<'_>, w: NodeId) -> Option<(NodeId, NodeId, [NodeId; 3])> {
    let concat = m.only_reader(w)?;
    if !matches!(m.op(concat)?, Op::Concat { dim: 1 }) || m.input(concat, 0)? != w {
        return None;
    }
    let shaped = m.input(concat, 1)?;
    let sig = m.input(shaped, 0)?;
    let gate = m.input(sig, 0)?;
    let n = m.meta(w).ne[2];
    let ok = matches!(m.op(shaped)?, Op::Reshape { .. })
        && m.only_reader(shaped) == Some(concat)
        && m.meta(shaped).ne == [1, 1, n, 1]
        && m.op(sig)? == &Op::Unary(UnaryOp::Sigmoid)
        && m.sole_user(sig) == Some(shaped)
        && m.meta(gate).dtype == DType::F32
        && m.meta(gate).ne == [1, n, 1, 1];
    ok.then_some((concat, gate, [sig, shaped, concat]))
}

/// See the module doc.
pub struct MoeRouter;

impl Pass for MoeRouter {
    fn name(&self) -> &'static str {
        "moe_router"
    }

    fn find(&self, g: &Graph) -> Vec<Fusion> {
        Matcher::new(g).fusions_at(&Op::MoeWeights, router)
    }
}

/// `w = moe_weights(logits, ids[, gate])` whose ids are `top = softmax_top_k(logits, k)`, or,
/// with a gate, the first `k` rows of `top = softmax_top_k(logits, k, tail)` (a view), `tail`
/// and `gate` of one shape.
fn router(m: &Matcher<'_>, w: NodeId) -> Option<Fusion> {
    let (logits, ids) = (m.input(w, 0)?, m.input(w, 1)?);
    let gate = m.input(w, 2);
    let (top, window) = match (m.op(ids)?, gate) {
        (Op::SoftmaxTopK { .. }, None) => (ids, None),
        (Op::View(v), Some(_)) if v.offset == 0 => (m.input(ids, 0)?, Some(ids)),
        _ => return None,
    };
    let Op::SoftmaxTopK { k } = *m.op(top)? else { return None };
    let tail = m.input(top, 1);
    let n = m.meta(top).ne[1];
    if m.input(top, 0)? != logits || m.meta(ids).ne != [k, n, 1, 1] || tail.is_some() != gate.is_some() {
        return None;
    }
    // the window must be the first k ids of each token: top's own rows, cut short
    if window.is_some() && m.meta(ids).nb[1] != m.meta(top).nb[1] {
        return None;
    }
    let mut inputs = vec![logits];
    if let (Some(tail), Some(gate)) = (tail, gate) {
        if m.meta(tail).ne != m.meta(gate).ne {
            return None;
        }
        inputs.extend([tail, gate]);
    }
    let mut nodes = vec![top, w];
    nodes.extend(window.filter(|&v| m.only_reader(v) == Some(w)));
    let packed = tessera_ops::infer(&Op::MoeRouter { k }, &inputs.iter().map(|&i| m.meta(i)).collect::<Vec<_>>());
    let (id_plane, w_plane) = router_planes(packed.ok()?);
    Some(Fusion {
        nodes,
        op: Op::MoeRouter { k },
        inputs,
        outputs: vec![(top, FusedOutput::View(id_plane)), (w, FusedOutput::Bitcast(w_plane, DType::F32))],
        recomputes: vec![],
    })
}
