//! `elementwise_chains`: a tree of elementwise ops (unary, binary with broadcasting, scale)
//! becomes one `elementwise` op running the tree as an [`ElemProgram`].
//!
//! A tree is grown from a root (an elementwise op not swallowed by a later tree) through operands
//! that are elementwise ops read only there ([`Matcher::sole_user`]), breadth first, as long as
//! the tree reads at most [`MAX_ELEM_INPUTS`] distinct tensors; what it does not swallow is an
//! input. Trees of at least two ops are fused. Everything is f32 (the unfused ops would round to
//! a half input's dtype in between); broadcasting needs no check of its own: in a chain of ggml
//! binary ops every tensor read divides the last op's shape, which is the fused op's output.
//! Roots are taken in reverse build order, so an op a tree could not take (the input limit)
//! roots a tree of its own.

use std::collections::{HashMap, HashSet, VecDeque};

use tessera_ops::{DType, ElemArg, ElemInstr, ElemProgram, MAX_ELEM_INPUTS, MAX_ELEM_INSTRS, Op};

use super::Pass;
use super::pattern::Matcher;
use crate::graph::{Graph, NodeId};
use crate::rewrite::{FusedOutput, Fusion};

/// See the module doc.
pub struct ElementwiseChains;

/// An elementwise op (unary, binary, scale) on f32 tensors giving f32.
fn eligible(m: &Matcher<'_>, id: NodeId) -> bool {
    m.op(id).is_some_and(|op| matches!(op, Op::Unary(_) | Op::Binary(_) | Op::Scale(_)))
        && m.meta(id).dtype == DType::F32
        && m.inputs(id).iter().all(|&i| m.meta(i).dtype == DType::F32)
}

/// The distinct tensors the nodes of `tree` read from outside it, in first-read order.
fn externals(m: &Matcher<'_>, tree: &[NodeId], inside: &HashSet<NodeId>) -> Vec<NodeId> {
    let mut out = Vec::new();
    for &n in tree {
        for &i in m.inputs(n) {
            if !inside.contains(&i) && !out.contains(&i) {
                out.push(i);
            }
        }
    }
    out
}

/// Appends the instructions of the subtree at `n` (post-order, first operand first) and returns
/// the operand that names its result; inputs get their index on first use.
fn emit(
    m: &Matcher<'_>,
    n: NodeId,
    inside: &HashSet<NodeId>,
    inputs: &mut Vec<NodeId>,
    instrs: &mut Vec<ElemInstr>,
    done: &mut HashMap<NodeId, ElemArg>,
) -> ElemArg {
    if let Some(&a) = done.get(&n) {
        return a;
    }
    if !inside.contains(&n) {
        let i = inputs.iter().position(|&x| x == n).unwrap_or_else(|| {
            inputs.push(n);
            inputs.len() - 1
        });
        return ElemArg::Input(i as u8);
    }
    let args: Vec<ElemArg> = m.inputs(n).iter().map(|&i| emit(m, i, inside, inputs, instrs, done)).collect();
    let ins = match m.op(n).expect("a tree node is an op") {
        Op::Unary(u) => ElemInstr::Unary(*u, args[0]),
        Op::Binary(b) => ElemInstr::Binary(*b, args[0], args[1]),
        Op::Scale(p) => ElemInstr::Scale(*p, args[0]),
        other => unreachable!("{other} is not an elementwise op"),
    };
    let a = ElemArg::Value(instrs.len() as u8);
    instrs.push(ins);
    done.insert(n, a);
    a
}

impl Pass for ElementwiseChains {
    fn name(&self) -> &'static str {
        "elementwise_chains"
    }

    fn find(&self, g: &Graph) -> Vec<Fusion> {
        let m = Matcher::new(g);
        let candidates: Vec<NodeId> = m.ops().map(|(id, _)| id).filter(|&id| eligible(&m, id)).collect();
        let mut taken: HashSet<NodeId> = HashSet::new();
        let mut found = Vec::new();
        for &root in candidates.iter().rev() {
            if taken.contains(&root) {
                continue;
            }
            // Grow breadth first through operands read only here, within the input limit.
            let mut tree = vec![root];
            let mut inside: HashSet<NodeId> = HashSet::from([root]);
            let mut queue: VecDeque<NodeId> = VecDeque::from([root]);
            while let Some(n) = queue.pop_front() {
                for &c in m.inputs(n) {
                    if inside.contains(&c)
                        || taken.contains(&c)
                        || !eligible(&m, c)
                        || m.sole_user(c) != Some(n)
                        || tree.len() >= MAX_ELEM_INSTRS
                    {
                        continue;
                    }
                    inside.insert(c);
                    tree.push(c);
                    if externals(&m, &tree, &inside).len() > MAX_ELEM_INPUTS {
                        inside.remove(&c);
                        tree.pop();
                        continue;
                    }
                    queue.push_back(c);
                }
            }
            taken.extend(tree.iter().copied());
            if tree.len() < 2 {
                continue;
            }
            let (mut inputs, mut instrs, mut done) = (Vec::new(), Vec::new(), HashMap::new());
            emit(&m, root, &inside, &mut inputs, &mut instrs, &mut done);
            let Ok(program) = ElemProgram::new(inputs.len(), instrs) else { continue };
            found.push(Fusion {
                nodes: tree,
                op: Op::Elementwise(program),
                inputs,
                outputs: vec![(root, FusedOutput::Whole)],
                recomputes: vec![],
            });
        }
        found.reverse(); // build order
        found
    }
}

#[cfg(test)]
mod tests {
    use tessera_ops::{DType, Op, TensorMeta};

    use super::ElementwiseChains;
    use crate::Graph;
    use crate::passes::{Pass, Pipeline};

    fn all(_: &Op, _: &[TensorMeta]) -> bool {
        true
    }

    fn programs(g: &Graph) -> Vec<String> {
        let run = Pipeline::new().with(ElementwiseChains).run(g.clone(), &all).unwrap();
        run.graph
            .live_nodes()
            .iter()
            .filter_map(|&id| match run.graph.node(id).op() {
                Some(Op::Elementwise(p)) => Some(p.to_string()),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn the_deltanet_decay_becomes_one_program() {
        let mut g = Graph::new();
        let alpha = g.input("alpha", DType::F32, [32, 5, 1, 1]).unwrap();
        let bias = g.input("dt_bias", DType::F32, [32, 1, 1, 1]).unwrap();
        let a = g.input("a", DType::F32, [32, 1, 1, 1]).unwrap();
        let s = g.add(alpha, bias).unwrap();
        let s = g.softplus(s).unwrap();
        let y = g.mul(s, a).unwrap();
        g.mark_output(y).unwrap();
        assert_eq!(programs(&g), ["v0=add(x0,x1);v1=softplus(v0);v2=mul(v1,x2)"]);
        let run = Pipeline::new().with(ElementwiseChains).run(g, &all).unwrap();
        assert_eq!((run.reports[0].applied, run.reports[0].nodes_removed), (1, 2));
        let y2 = run.tensor(y).unwrap();
        assert_eq!(run.graph.node(y2.id()).inputs.len(), 3);
    }

    #[test]
    fn shared_reads_and_read_twice_intermediates() {
        let mut g = Graph::new();
        let x = g.input("x", DType::F32, [8, 2, 1, 1]).unwrap();
        let gate = g.input("gate", DType::F32, [1, 2, 1, 1]).unwrap();
        // x read by two ops of one tree: one input
        let sg = g.sigmoid(gate).unwrap();
        let xs = g.mul(x, sg).unwrap();
        let y = g.add(x, xs).unwrap();
        // an intermediate with two readers ends a tree: e = exp(y) roots its own
        let e = g.exp(y).unwrap();
        let p = g.mul(e, x).unwrap();
        let q = g.sub(e, x).unwrap();
        let q = g.neg(q).unwrap();
        g.mark_output(p).unwrap();
        g.mark_output(q).unwrap();
        assert_eq!(programs(&g), ["v0=sigmoid(x1);v1=mul(x0,v0);v2=add(x0,v1);v3=exp(v2)", "v0=sub(x0,x1);v1=neg(v0)"]);
    }

    #[test]
    fn limits_single_ops_and_other_dtypes() {
        let mut g = Graph::new();
        let xs: Vec<_> = (0..8).map(|_| g.input("x", DType::F32, [4, 1, 1, 1]).unwrap()).collect();
        let mut acc = xs[0];
        for &x in &xs[1..] {
            acc = g.add(acc, x).unwrap();
        }
        g.mark_output(acc).unwrap();
        // 7 adds over 8 inputs: the last five adds read six tensors; the first two form a tree
        let found = ElementwiseChains.find(&g);
        let sizes: Vec<(usize, usize)> = found.iter().map(|f| (f.nodes.len(), f.inputs.len())).collect();
        assert_eq!(sizes, [(2, 3), (5, 6)]);

        let mut g = Graph::new();
        let x = g.input("x", DType::F32, [4, 1, 1, 1]).unwrap();
        let h = g.input("h", DType::F16, [4, 1, 1, 1]).unwrap();
        let y = g.neg(x).unwrap();
        g.mark_output(y).unwrap();
        let z = g.neg(h).unwrap();
        let z = g.exp(z).unwrap();
        g.mark_output(z).unwrap();
        assert!(ElementwiseChains.find(&g).is_empty(), "one op, and f16 chains, stay");
    }
}
