//! `delta_net_prep`: a gated DeltaNet's input preparation folded into its delta rule.
//!
//! A Qwen3.5 linear-attention block writes, before `gated_delta_net` (models/src/layers/delta_net.rs):
//!
//! ```text
//! qk   = l2_norm(qk_raw)                         [S_k, 2 H_k, n, 1], q and k side by side
//! q, k = view(qk, heads 0..H_k), view(qk, heads H_k..2 H_k)
//! g    = reshape(softplus(alpha + dt_bias) * a)  [1, H_v, n, 1]  (after elementwise_chains: one
//!                                                 `elementwise` op; either form is matched)
//! beta = reshape(sigmoid(beta_raw))              [1, H_v, n, 1]
//! o    = gated_delta_net(q, k, v, g, beta, state, slots[, seq_offsets])
//! ```
//!
//! which becomes `gated_delta_net_fused(qk_raw, v, alpha, dt_bias, a, beta_raw, state, slots[,
//! seq_offsets])`: three small kernels fewer a layer on a GPU. Guards: the l2_norm is read only
//! by the two views (exactly its first and last `H_k` heads, its own strides), each view, reshape
//! and prep op only by the next step, none a graph output. The fused op's shape rules (f32, alpha
//! and beta `[H_v, n, 1, 1]`-like, dt_bias and a broadcasting) are checked by the pipeline; the
//! rewrite needs no in-place write between the prep ops and the delta rule (the model builds its
//! conv update first).

use tessera_ops::{BinaryOp, ElemArg, ElemInstr, ElemProgram, GatedDeltaNetFusedParams, Op, UnaryOp};

use super::Pass;
use super::pattern::Matcher;
use crate::graph::{Graph, NodeId};
use crate::rewrite::{FusedOutput, Fusion};

/// See the module doc.
pub struct DeltaNetPrep;

impl Pass for DeltaNetPrep {
    fn name(&self) -> &'static str {
        "delta_net_prep"
    }

    fn find(&self, g: &Graph) -> Vec<Fusion> {
        let m = Matcher::new(g);
        m.ops()
            .filter_map(|(d, op)| {
                let Op::GatedDeltaNet(net) = op else { return None };
                let ins = m.inputs(d);
                let (qk, eps, qk_nodes) = normed_qk(&m, d, ins[0], ins[1])?;
                let (alpha, dt_bias, a, decay_nodes) = decay(&m, d, ins[3])?;
                let (beta, beta_nodes) =
                    through_reshape(&m, d, ins[4], |op| matches!(op, Op::Unary(UnaryOp::Sigmoid)))?;
                let mut nodes = vec![d];
                nodes.extend(qk_nodes);
                nodes.extend(decay_nodes);
                nodes.extend(beta_nodes);
                let mut inputs = vec![qk, ins[2], alpha, dt_bias, a, m.input(beta, 0)?];
                inputs.extend_from_slice(&ins[5..]);
                Some(Fusion {
                    nodes,
                    op: Op::GatedDeltaNetFused(GatedDeltaNetFusedParams { net: *net, eps }),
                    inputs,
                    outputs: vec![(d, FusedOutput::Whole)],
                    recomputes: vec![],
                })
            })
            .collect()
    }
}

/// q and k as the delta rule `d` reads them from one l2_norm: `(qk_raw, eps, [norm, q, k])`.
fn normed_qk(m: &Matcher<'_>, d: NodeId, q: NodeId, k: NodeId) -> Option<(NodeId, f32, [NodeId; 3])> {
    let (Some(Op::View(qv)), Some(Op::View(kv))) = (m.op(q), m.op(k)) else { return None };
    let norm = m.input(q, 0)?;
    let Some(&Op::L2Norm { eps }) = m.op(norm) else { return None };
    if m.input(k, 0)? != norm || q == k || m.only_reader(q)? != d || m.only_reader(k)? != d {
        return None;
    }
    // The norm is read by exactly these two views and is not an output.
    if m.graph().is_output(norm) || m.users(norm).any(|u| u != q && u != k) {
        return None;
    }
    let n = m.meta(norm);
    let h_k = n.ne[1] / 2;
    let half = [n.ne[0], h_k, n.ne[2], n.ne[3]];
    let heads = n.ne[1] == 2 * h_k && qv.ne == half && kv.ne == half && qv.nb == n.nb && kv.nb == n.nb;
    (heads && qv.offset == 0 && kv.offset == h_k * n.nb[1]).then_some((m.input(norm, 0)?, eps, [norm, q, k]))
}

/// `reshape(x)` read only by `d`, `x` read only by the reshape and an op `want` accepts:
/// `(x, [reshape, x])`.
fn through_reshape(m: &Matcher<'_>, d: NodeId, r: NodeId, want: impl Fn(&Op) -> bool) -> Option<(NodeId, [NodeId; 2])> {
    let (Op::Reshape { .. }, Some(_)) = (m.op(r)?, m.only_reader(r).filter(|&u| u == d)) else { return None };
    let x = m.input(r, 0)?;
    (want(m.op(x)?) && m.sole_user(x)? == r).then_some((x, [r, x]))
}

/// The decay `reshape(softplus(alpha + dt_bias) * a)` read by `d` through input `g`, as one
/// `elementwise` program or as the three ops: `(alpha, dt_bias, a, nodes)`.
fn decay(m: &Matcher<'_>, d: NodeId, g: NodeId) -> Option<(NodeId, NodeId, NodeId, Vec<NodeId>)> {
    let (x, nodes) = through_reshape(m, d, g, |op| matches!(op, Op::Elementwise(_) | Op::Binary(BinaryOp::Mul)))?;
    let mut nodes = nodes.to_vec();
    match m.op(x)? {
        Op::Elementwise(p) => {
            let [i, j, k] = decay_program(p)?;
            let ins = m.inputs(x);
            Some((ins[i], ins[j], ins[k], nodes))
        }
        _ => {
            // mul(softplus(add(alpha, dt_bias)), a), the softplus either operand
            let [l, r] = [m.input(x, 0)?, m.input(x, 1)?];
            let (sp, a) = if matches!(m.op(l), Some(Op::Unary(UnaryOp::Softplus))) { (l, r) } else { (r, l) };
            let Some(Op::Unary(UnaryOp::Softplus)) = m.op(sp) else { return None };
            let add = m.input(sp, 0)?;
            let Some(Op::Binary(BinaryOp::Add)) = m.op(add) else { return None };
            if m.sole_user(sp)? != x || m.sole_user(add)? != sp {
                return None;
            }
            nodes.extend([sp, add]);
            Some((m.input(add, 0)?, m.input(add, 1)?, a, nodes))
        }
    }
}

/// The inputs `[alpha, dt_bias, a]` of a program that is exactly `softplus(x_i + x_j) * x_k` (the
/// mul's operands in either order), as elementwise_chains emits it.
fn decay_program(p: &ElemProgram) -> Option<[usize; 3]> {
    use ElemArg::{Input, Value};
    let &[ElemInstr::Binary(BinaryOp::Add, Input(i), Input(j)), ElemInstr::Unary(UnaryOp::Softplus, Value(0)), mul] =
        p.instrs()
    else {
        return None;
    };
    let k = match mul {
        ElemInstr::Binary(BinaryOp::Mul, Value(1), Input(k)) | ElemInstr::Binary(BinaryOp::Mul, Input(k), Value(1)) => {
            k
        }
        _ => return None,
    };
    Some([i as usize, j as usize, k as usize])
}

#[cfg(test)]
mod tests {
    use super::decay_program;
    use tessera_ops::{BinaryOp, ElemArg, ElemInstr, ElemProgram, UnaryOp};

    #[test]
    fn the_decay_program_in_either_mul_order_and_nothing_else() {
        use ElemArg::{Input as X, Value as V};
        let prog = |mul: ElemInstr| {
            ElemProgram::new(
                3,
                vec![ElemInstr::Binary(BinaryOp::Add, X(1), X(2)), ElemInstr::Unary(UnaryOp::Softplus, V(0)), mul],
            )
            .unwrap()
        };
        assert_eq!(decay_program(&prog(ElemInstr::Binary(BinaryOp::Mul, V(1), X(0)))), Some([1, 2, 0]));
        assert_eq!(decay_program(&prog(ElemInstr::Binary(BinaryOp::Mul, X(0), V(1)))), Some([1, 2, 0]));
        assert_eq!(decay_program(&prog(ElemInstr::Binary(BinaryOp::Add, V(1), X(0)))), None);
        let silu = ElemProgram::new(
            3,
            vec![
                ElemInstr::Binary(BinaryOp::Add, X(1), X(2)),
                ElemInstr::Unary(UnaryOp::Silu, V(0)),
                ElemInstr::Binary(BinaryOp::Mul, V(1), X(0)),
            ],
        )
        .unwrap();
        assert_eq!(decay_program(&silu), None);
    }
}
