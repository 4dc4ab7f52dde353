//! `gate_up_swiglu`: a gated FFN's gate and up projections with their GLU become one op.
//!
//! ```text
//! gate = mul_mat(wg, x)                   up = mul_mat(wu, x)
//! swiglu(gate, up)                                             mul_mat_swiglu(wg, wu, x)
//!
//! gate = mul_mat_id(wg, x, ids)           up = mul_mat_id(wu, x, ids)
//! swiglu(gate, up)                                             mul_mat_id_swiglu(wg, wu, x, ids)
//! ```
//!
//! Both products read the same activations (and the same expert ids), each product is read only
//! by the swiglu ([`Matcher::sole_user`]), and the fused op's rules accept the inputs (the two
//! weights of one dtype and shape). `swiglu(a, b)` is `silu(a) * b`, so the weight of the product
//! in the first operand is the gate, whichever name the model gave it: `swiglu(up, gate)` fuses
//! to `mul_mat_swiglu(wu, wg, x)`. A swiglu of one product with itself stays (no two products).

use smallvec::SmallVec;
use tessera_ops::{Op, TensorMeta};

use super::Pass;
use super::pattern::Matcher;
use crate::graph::{Graph, NodeId};
use crate::rewrite::{FusedOutput, Fusion};

/// See the module doc.
pub struct GateUpSwiglu;

impl Pass for GateUpSwiglu {
    fn name(&self) -> &'static str {
        "gate_up_swiglu"
    }

    fn find(&self, g: &Graph) -> Vec<Fusion> {
        Matcher::new(g).fusions_at(&Op::Swiglu, gate_up)
    }
}

/// The fusion of `glu = swiglu(gate, up)` when both operands are products of one kind over the
/// same activations (and ids) read only there.
fn gate_up(m: &Matcher<'_>, glu: NodeId) -> Option<Fusion> {
    let [gate, up] = *m.inputs(glu) else { return None };
    if gate == up || m.sole_user(gate) != Some(glu) || m.sole_user(up) != Some(glu) {
        return None;
    }
    let (product, fused) = match m.op(gate)? {
        Op::MulMat => (Op::MulMat, Op::MulMatSwiglu),
        Op::MulMatId => (Op::MulMatId, Op::MulMatIdSwiglu),
        _ => return None,
    };
    // The same op on the same activations (and ids): inputs past the weight are one node each.
    let (g_in, u_in) = (m.inputs(gate), m.inputs(up));
    if m.op(up)? != &product || g_in.len() != u_in.len() || g_in[1..] != u_in[1..] {
        return None;
    }
    let mut inputs = vec![g_in[0], u_in[0]];
    inputs.extend_from_slice(&g_in[1..]);
    let metas: SmallVec<[&TensorMeta; 4]> = inputs.iter().map(|&i| m.meta(i)).collect();
    tessera_ops::infer(&fused, &metas).ok()?;
    Some(Fusion {
        nodes: vec![gate, up, glu],
        op: fused,
        inputs,
        outputs: vec![(glu, FusedOutput::Whole)],
        recomputes: vec![],
    })
}

#[cfg(test)]
mod tests {
    use tessera_ops::{DType, Op, TensorMeta};

    use super::GateUpSwiglu;
    use crate::passes::{Pass, Pipeline};
    use crate::{Graph, Tensor};

    const F32: DType = DType::F32;

    fn all(_: &Op, _: &[TensorMeta]) -> bool {
        true
    }

    /// How many fusions applied, and the fused ops after the pass with their inputs' names.
    fn fused(g: &Graph) -> (usize, Vec<(Op, Vec<String>)>) {
        let run = Pipeline::new().with(GateUpSwiglu).run(g.clone(), &all).unwrap();
        let name = |id| run.graph.node(id).name.clone().unwrap_or_default();
        let ops = run
            .graph
            .live_nodes()
            .iter()
            .filter_map(|&id| {
                let node = run.graph.node(id);
                let op = node.op().filter(|o| matches!(o, Op::MulMatSwiglu | Op::MulMatIdSwiglu))?;
                Some((op.clone(), node.inputs.iter().map(|&i| name(i)).collect()))
            })
            .collect();
        (run.reports[0].applied, ops)
    }

    fn named(op: Op, names: &[&str]) -> (Op, Vec<String>) {
        (op, names.iter().map(|n| n.to_string()).collect())
    }

    /// The dense FFN `[wg, wu, x]` (2048 -> 512 at 3 tokens, q8_0 weights).
    fn dense(g: &mut Graph, dt: DType) -> [Tensor; 3] {
        let wg = g.parameter("wg", dt, [2048, 512, 1, 1]).unwrap();
        let wu = g.parameter("wu", dt, [2048, 512, 1, 1]).unwrap();
        let x = g.input("x", F32, [2048, 3, 1, 1]).unwrap();
        [wg, wu, x]
    }

    /// The routed experts `[wg, wu, x, ids]` (16 experts, top-4, 2 tokens, one activation row).
    fn routed(g: &mut Graph) -> [Tensor; 4] {
        let wg = g.parameter("wge", DType::NvFp4, [256, 64, 16, 1]).unwrap();
        let wu = g.parameter("wue", DType::NvFp4, [256, 64, 16, 1]).unwrap();
        let x = g.input("cur", F32, [256, 1, 2, 1]).unwrap();
        let ids = g.input("ids", DType::I32, [4, 2, 1, 1]).unwrap();
        [wg, wu, x, ids]
    }

    /// Both forms in one graph, `swiglu(gate, up)` or with the operands `swapped`; returns the
    /// routed form's result.
    fn both_forms(dt: DType, swapped: bool) -> (Graph, Tensor) {
        let glu = |g: &mut Graph, gate: Tensor, up: Tensor| {
            let a = if swapped { g.swiglu(up, gate) } else { g.swiglu(gate, up) }.unwrap();
            g.mark_output(a).unwrap();
            a
        };
        let mut g = Graph::new();
        let [wg, wu, x] = dense(&mut g, dt);
        let (gate, up) = (g.mul_mat(wg, x).unwrap(), g.mul_mat(wu, x).unwrap());
        glu(&mut g, gate, up);
        let [eg, eu, cur, ids] = routed(&mut g);
        let (gate, up) = (g.mul_mat_id(eg, cur, ids).unwrap(), g.mul_mat_id(eu, cur, ids).unwrap());
        let r = glu(&mut g, gate, up);
        (g, r)
    }

    #[test]
    fn fuses_the_dense_and_the_routed_form() {
        let (g, r) = both_forms(DType::Q8_0, false);
        let (applied, ops) = fused(&g);
        assert_eq!(applied, 2);
        assert_eq!(
            ops,
            [named(Op::MulMatSwiglu, &["wg", "wu", "x"]), named(Op::MulMatIdSwiglu, &["wge", "wue", "cur", "ids"])]
        );
        let run = Pipeline::new().with(GateUpSwiglu).run(g, &all).unwrap();
        assert_eq!(run.reports[0].nodes_removed, 4);
        assert_eq!(run.tensor(r).unwrap().ne(), [64, 4, 2, 1]);
    }

    #[test]
    fn swapped_operands_swap_the_weights() {
        // swiglu(up, gate) = silu(up) * gate: the first operand's weight is the fused op's gate
        let (g, _) = both_forms(F32, true);
        let (_, ops) = fused(&g);
        assert_eq!(
            ops,
            [named(Op::MulMatSwiglu, &["wu", "wg", "x"]), named(Op::MulMatIdSwiglu, &["wue", "wge", "cur", "ids"])]
        );
    }

    #[test]
    fn near_misses_stay_unfused() {
        // other activations for the up product
        let mut g = Graph::new();
        let [wg, wu, x] = dense(&mut g, F32);
        let x2 = g.input("x2", F32, [2048, 3, 1, 1]).unwrap();
        let gate = g.mul_mat(wg, x).unwrap();
        let up = g.mul_mat(wu, x2).unwrap();
        let a = g.swiglu(gate, up).unwrap();
        g.mark_output(a).unwrap();
        assert!(GateUpSwiglu.find(&g).is_empty(), "different x");

        // other ids for the up product
        let mut g = Graph::new();
        let [eg, eu, cur, ids] = routed(&mut g);
        let ids2 = g.input("ids2", DType::I32, [4, 2, 1, 1]).unwrap();
        let gate = g.mul_mat_id(eg, cur, ids).unwrap();
        let up = g.mul_mat_id(eu, cur, ids2).unwrap();
        let r = g.swiglu(gate, up).unwrap();
        g.mark_output(r).unwrap();
        assert!(GateUpSwiglu.find(&g).is_empty(), "different ids");

        // a product read elsewhere too, or a graph output
        for read_again in [true, false] {
            let mut g = Graph::new();
            let [wg, wu, x] = dense(&mut g, F32);
            let gate = g.mul_mat(wg, x).unwrap();
            let up = g.mul_mat(wu, x).unwrap();
            let a = g.swiglu(gate, up).unwrap();
            g.mark_output(a).unwrap();
            if read_again {
                let s = g.scale(up, 2.0).unwrap();
                g.mark_output(s).unwrap();
            } else {
                g.mark_output(gate).unwrap();
            }
            assert!(GateUpSwiglu.find(&g).is_empty(), "a product read elsewhere ({read_again})");
        }

        // a dense and a routed product, one product twice, a one-input swiglu of a product
        let mut g = Graph::new();
        let [wg, _, x] = dense(&mut g, F32);
        let [eg, _, cur, ids] = routed(&mut g);
        let w64 = g.parameter("w64", F32, [256, 64, 1, 1]).unwrap();
        let x8 = g.input("x8", F32, [256, 4, 2, 1]).unwrap();
        let dense_p = g.mul_mat(w64, x8).unwrap(); // [64, 4, 2]
        let routed_p = g.mul_mat_id(eg, cur, ids).unwrap(); // [64, 4, 2]
        let mixed = g.swiglu(dense_p, routed_p).unwrap();
        g.mark_output(mixed).unwrap();
        let p = g.mul_mat(wg, x).unwrap();
        let twice = g.swiglu(p, p).unwrap();
        g.mark_output(twice).unwrap();
        let halves = g.mul_mat(wg, x).unwrap();
        let one = g.swiglu_fused(halves).unwrap();
        g.mark_output(one).unwrap();
        assert!(GateUpSwiglu.find(&g).is_empty(), "no two products of one kind");
    }

    #[test]
    fn weights_the_fused_op_refuses_stay_unfused() {
        // gate q8_0, up nvfp4: each product is valid, the fused op wants one dtype
        let mut g = Graph::new();
        let wg = g.parameter("wg", DType::Q8_0, [256, 32, 1, 1]).unwrap();
        let wu = g.parameter("wu", DType::NvFp4, [256, 32, 1, 1]).unwrap();
        let x = g.input("x", F32, [256, 2, 1, 1]).unwrap();
        let gate = g.mul_mat(wg, x).unwrap();
        let up = g.mul_mat(wu, x).unwrap();
        let a = g.swiglu(gate, up).unwrap();
        g.mark_output(a).unwrap();
        assert!(GateUpSwiglu.find(&g).is_empty());
    }

    #[test]
    fn a_backend_without_the_fused_ops_keeps_the_products() {
        let mut g = Graph::new();
        let [wg, wu, x] = dense(&mut g, DType::Q8_0);
        let gate = g.mul_mat(wg, x).unwrap();
        let up = g.mul_mat(wu, x).unwrap();
        let a = g.swiglu(gate, up).unwrap();
        g.mark_output(a).unwrap();
        let without = |op: &Op, _: &[TensorMeta]| !matches!(op, Op::MulMatSwiglu | Op::MulMatIdSwiglu);
        let run = Pipeline::new().with(GateUpSwiglu).run(g, &without).unwrap();
        let r = run.reports[0];
        assert_eq!((r.found, r.applied, r.skipped, r.nodes_removed), (1, 0, 1, 0));
    }
}
