//! The rewrite basics passes build on: ops as `Eq + Hash` data (floats by bits), `users`,
//! `is_output` and `replace`. Running a rewritten graph is checked in
//! `backend-cpu/tests/rewrite.rs` (this crate knows no backend).

use std::collections::HashMap;
use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};

use proptest::prelude::*;
use tessera_graph::{DescriptorChange, Graph, GraphError, LeafKind, NodeId, Tensor};
use tessera_ops::{
    BinaryOp, DType, DeltaNetAlgo, FlashAttnParams, GatedDeltaNetParams, HeadMap, Op, OpError, RmsNormParams,
    RopePairing, RopeParams, ScaleParams, SoftmaxParams, UnaryOp,
};

const F32: DType = DType::F32;

fn hash_of<T: Hash>(x: &T) -> u64 {
    let mut h = DefaultHasher::new();
    x.hash(&mut h);
    h.finish()
}

/// Dense attention with a mask, no table, no gate.
fn masked_attention(scale: f32, softcap: f32) -> FlashAttnParams {
    FlashAttnParams { scale, softcap, mask: true, paged: false, ragged: false, gate: false }
}

fn ids(ts: &[Tensor]) -> Vec<NodeId> {
    ts.iter().map(|t| t.id()).collect()
}

/// `users` recomputed from scratch: the reference the index is checked against.
fn users_by_scan(g: &Graph, id: NodeId) -> Vec<NodeId> {
    (0..g.len() as u32).map(NodeId).filter(|&u| g.node(u).inputs.contains(&id)).collect()
}

fn assert_users_match_scan(g: &Graph) {
    for i in 0..g.len() as u32 {
        assert_eq!(g.users(NodeId(i)), users_by_scan(g, NodeId(i)).as_slice(), "users of node {i}");
    }
}

// ---- Op: Eq + Hash, floats by bits ----

fn rope(freq_base: f32) -> RopeParams {
    RopeParams { n_rot: 64, freq_base, pairing: RopePairing::Neox, sections: Some([11, 11, 10, 0]) }
}

/// One op of every params type that holds a float, built from that float.
fn float_ops(x: f32) -> Vec<Op> {
    vec![
        Op::Scale(ScaleParams { scale: x, bias: 1.0 }),
        Op::Scale(ScaleParams { scale: 1.0, bias: x }),
        Op::RmsNorm(RmsNormParams { eps: x }),
        Op::Softmax(SoftmaxParams { scale: x }),
        Op::L2Norm { eps: x },
        Op::RopeMulti(rope(x)),
        Op::FlashAttnExt(masked_attention(x, 0.0)),
        Op::FlashAttnExt(masked_attention(0.125, x)),
        Op::GatedDeltaNet(GatedDeltaNetParams {
            scale: x,
            head_map: HeadMap::Tiled,
            algo: DeltaNetAlgo::Serial,
            ragged: false,
        }),
    ]
}

#[test]
fn op_floats_compare_by_bits() {
    let other_nan = f32::from_bits(f32::NAN.to_bits() | 1);
    assert!(other_nan.is_nan() && other_nan.to_bits() != f32::NAN.to_bits());
    let (zero, neg_zero, nan, other) = (float_ops(0.0), float_ops(-0.0), float_ops(f32::NAN), float_ops(other_nan));
    for i in 0..zero.len() {
        assert_ne!(zero[i], neg_zero[i], "0.0 and -0.0 are different parameters");
        assert_eq!(nan[i], float_ops(f32::NAN)[i], "a NaN parameter equals the same NaN: every op equals itself");
        assert_eq!(hash_of(&nan[i]), hash_of(&float_ops(f32::NAN)[i]));
        assert_ne!(nan[i], other[i], "NaNs with other bits differ");
        assert_ne!(nan[i], zero[i]);
    }
    // The params types on their own follow the same rule.
    assert_ne!(RmsNormParams { eps: 0.0 }, RmsNormParams { eps: -0.0 });
    assert_eq!(SoftmaxParams { scale: f32::NAN }, SoftmaxParams { scale: f32::NAN });
    assert_eq!(hash_of(&rope(f32::NAN)), hash_of(&rope(f32::NAN)));
}

#[test]
fn equal_ops_hash_equal_and_differing_ops_differ() {
    let eps = 1e-6f32;
    // Built twice from the same values: equal, same hash.
    for (a, b) in float_ops(eps).into_iter().zip(float_ops(eps)) {
        assert_eq!(a, b);
        assert_eq!(hash_of(&a), hash_of(&b));
    }
    // Every field counts, and so does the variant when the parameters look alike.
    let gdn = |head_map, algo| Op::GatedDeltaNet(GatedDeltaNetParams { scale: 0.5, head_map, algo, ragged: false });
    let distinct = [
        Op::Cont,
        Op::Transpose,
        Op::Cast(F32),
        Op::Quantize(F32),
        Op::Concat { dim: 1 },
        Op::TopK { k: 1 },
        Op::Repeat { ne: [4, 2, 1, 1] },
        Op::Reshape { ne: [4, 2, 1, 1] },
        Op::Permute { axes: [1, 0, 2, 3] },
        Op::Unary(UnaryOp::Neg),
        Op::Unary(UnaryOp::Exp),
        Op::Binary(BinaryOp::Add),
        Op::Binary(BinaryOp::Mul),
        Op::RmsNorm(RmsNormParams { eps }),
        Op::Softmax(SoftmaxParams { scale: eps }),
        Op::L2Norm { eps },
        Op::RopeMulti(rope(1e6)),
        Op::RopeMulti(RopeParams { sections: None, ..rope(1e6) }),
        Op::RopeMulti(RopeParams { pairing: RopePairing::Adjacent, ..rope(1e6) }),
        Op::FlashAttnExt(masked_attention(0.125, 0.0)),
        Op::FlashAttnExt(FlashAttnParams { paged: true, ..masked_attention(0.125, 0.0) }),
        Op::FlashAttnExt(FlashAttnParams { gate: true, ..masked_attention(0.125, 0.0) }),
        Op::SsmConvUpdate { silu: true, ragged: false },
        Op::SsmConvUpdate { silu: false, ragged: false },
        Op::SsmConvUpdate { silu: true, ragged: true },
        Op::GatedDeltaNet(GatedDeltaNetParams {
            scale: 0.5,
            head_map: HeadMap::Tiled,
            algo: DeltaNetAlgo::Serial,
            ragged: true,
        }),
        gdn(HeadMap::Tiled, DeltaNetAlgo::Serial),
        gdn(HeadMap::Grouped, DeltaNetAlgo::Serial),
        gdn(HeadMap::Tiled, DeltaNetAlgo::Chunked { chunk: 64 }),
        gdn(HeadMap::Tiled, DeltaNetAlgo::Chunked { chunk: 32 }),
    ];
    for (i, a) in distinct.iter().enumerate() {
        for (j, b) in distinct.iter().enumerate() {
            assert_eq!(a == b, i == j, "{a} vs {b}");
        }
    }
}

#[test]
fn ops_key_a_hash_map() {
    let mut seen: HashMap<Op, usize> = HashMap::new();
    let ops = [
        Op::RmsNorm(RmsNormParams { eps: 1e-6 }),
        Op::Unary(UnaryOp::Silu),
        Op::RmsNorm(RmsNormParams { eps: 1e-6 }),
        Op::L2Norm { eps: f32::NAN },
        Op::L2Norm { eps: f32::NAN },
        Op::Scale(ScaleParams { scale: 0.0, bias: 0.0 }),
        Op::Scale(ScaleParams { scale: -0.0, bias: 0.0 }),
    ];
    for op in ops {
        *seen.entry(op).or_default() += 1;
    }
    assert_eq!(seen.len(), 5);
    assert_eq!(seen[&Op::RmsNorm(RmsNormParams { eps: 1e-6 })], 2);
    assert_eq!(seen[&Op::L2Norm { eps: f32::NAN }], 2, "a NaN key finds itself");
    assert_eq!(seen[&Op::Scale(ScaleParams { scale: -0.0, bias: 0.0 })], 1);
    assert!(!seen.contains_key(&Op::RmsNorm(RmsNormParams { eps: 1e-5 })));
}

// ---- users, is_output ----

#[test]
fn users_in_build_order_each_once() {
    let mut g = Graph::new();
    let x = g.input("x", F32, [4, 3, 1, 1]).unwrap();
    let w = g.parameter("w", F32, [4, 1, 1, 1]).unwrap();
    let a = g.neg(x).unwrap();
    let b = g.add(a, a).unwrap(); // reads `a` twice
    let c = g.exp(x).unwrap(); // dead: nothing reads it, not an output
    let d = g.mul(x, w).unwrap();
    g.mark_output(b).unwrap();
    g.mark_output(d).unwrap();

    assert_eq!(g.users(x.id()), ids(&[a, c, d]).as_slice());
    assert_eq!(g.users(a.id()), ids(&[b]).as_slice(), "add(a, a) lists `a`'s user once");
    assert_eq!(g.users(w.id()), ids(&[d]).as_slice());
    assert!(g.users(b.id()).is_empty() && g.users(c.id()).is_empty());
    assert!(g.users(NodeId(1000)).is_empty(), "an id outside the graph has no users");
    assert_users_match_scan(&g);

    // Built after the index: it is kept up to date.
    let e = g.sub(d, x).unwrap();
    let f = g.add(e, e).unwrap();
    assert_eq!(g.users(x.id()), ids(&[a, c, d, e]).as_slice());
    assert_eq!(g.users(e.id()), ids(&[f]).as_slice());
    assert!(g.users(f.id()).is_empty());
    assert_users_match_scan(&g);
    // A clone carries the index along and stays right as it grows on its own.
    let mut h = g.clone();
    let z = h.neg(f).unwrap();
    assert_eq!(h.users(f.id()), [z.id()]);
    assert!(g.users(f.id()).is_empty());

    assert!(g.is_output(b.id()) && g.is_output(d.id()));
    for t in [x, w, a, c, e, f] {
        assert!(!g.is_output(t.id()), "{:?}", t.id());
    }
    assert!(!g.is_output(NodeId(1000)));
    g.mark_output(f).unwrap();
    assert!(g.is_output(f.id()));
}

// ---- replace ----

/// `y = exp(neg(neg(x)))`, `y` an output; the outer neg named "twice".
fn double_neg() -> (Graph, Tensor, Tensor, Tensor, Tensor) {
    let mut g = Graph::new();
    let x = g.input("x", F32, [4, 3, 1, 1]).unwrap();
    let n1 = g.neg(x).unwrap();
    let n2 = g.neg(n1).unwrap();
    g.set_name(n2, "twice").unwrap();
    let y = g.exp(n2).unwrap();
    g.mark_output(y).unwrap();
    (g, x, n1, n2, y)
}

#[test]
fn replace_keeps_id_name_and_users_and_kills_what_only_the_old_op_read() {
    for index_built_first in [false, true] {
        let (mut g, x, n1, n2, y) = double_neg();
        if index_built_first {
            assert_eq!(g.users(n1.id()), [n2.id()]);
        }
        assert_eq!(g.live_nodes(), ids(&[x, n1, n2, y]));

        let t = g.replace(n2.id(), Op::Cont, &[x]).unwrap();
        assert_eq!(t, n2, "the same handle: id and descriptor unchanged");
        let node = g.node(n2.id());
        assert_eq!(node.op(), Some(&Op::Cont));
        assert_eq!(node.inputs.as_slice(), [x.id()]);
        assert_eq!(node.name.as_deref(), Some("twice"));
        assert_eq!(g.node(y.id()).inputs.as_slice(), [n2.id()], "the user now reads the new op");
        assert_eq!(g.len(), 4, "nothing is removed");

        // n1 is dead: only the old op read it.
        assert_eq!(g.live_nodes(), ids(&[x, n2, y]));
        assert!(g.users(n1.id()).is_empty());
        assert_eq!(g.users(x.id()), ids(&[n1, n2]).as_slice(), "the dead node still reads x");
        assert_users_match_scan(&g);

        // Old handles stay usable, and the graph keeps building.
        let z = g.neg(n2).unwrap();
        assert_eq!(g.users(n2.id()), ids(&[y, z]).as_slice());
        assert_users_match_scan(&g);
    }
}

#[test]
fn replace_an_output_with_a_binary_op_and_a_view() {
    let mut g = Graph::new();
    let x = g.input("x", F32, [4, 3, 1, 1]).unwrap();
    let b = g.parameter("b", F32, [4, 1, 1, 1]).unwrap();
    let s = g.silu(x).unwrap();
    let c = g.cont(s).unwrap();
    g.mark_output(c).unwrap();
    // An output stays an output, with the new op's inputs.
    let t = g.replace(c.id(), Op::Binary(BinaryOp::Add), &[x, b]).unwrap();
    assert_eq!(t, c);
    assert!(g.is_output(c.id()));
    assert_eq!(g.live_nodes(), ids(&[x, b, c]));
    assert_eq!(g.users(b.id()), [c.id()]);
    // A reshape of a contiguous tensor to its own shape has its descriptor too.
    g.replace(c.id(), Op::Reshape { ne: [4, 3, 1, 1] }, &[s]).unwrap();
    assert_eq!(g.live_nodes(), ids(&[x, s, c]));
    assert!(g.users(b.id()).is_empty());
    assert_users_match_scan(&g);
}

/// Asserts `g` is as `double_neg` built it.
fn assert_untouched(g: &Graph, dot: &str) {
    assert_eq!(g.to_dot(), dot, "a refused replace changes nothing");
    assert_users_match_scan(g);
}

#[test]
fn replace_refuses_another_descriptor() {
    let (mut g, x, _, n2, _) = double_neg();
    let dot = g.to_dot();
    let _ = g.users(x.id()); // with the index built, a refusal must leave it alone too

    // Another shape.
    let e = g.replace(n2.id(), Op::SumRows, &[x]).unwrap_err();
    let GraphError::ReplaceDescriptor(change) = &e else { panic!("{e:?}") };
    let DescriptorChange { node, old_op, new_op, old, new } = &**change;
    assert_eq!((*node, old_op, new_op), (n2.id(), &Op::Unary(UnaryOp::Neg), &Op::SumRows));
    assert_eq!((old.ne, new.ne), ([4, 3, 1, 1], [1, 3, 1, 1]));
    let msg = e.to_string();
    for part in ["NodeId(2)", "neg", "sum_rows", "f32 [4, 3, 1, 1]", "f32 [1, 3, 1, 1]"] {
        assert!(msg.contains(part), "{part:?} missing from: {msg}");
    }
    assert_untouched(&g, &dot);

    // Another dtype.
    let e = g.replace(n2.id(), Op::Cast(DType::F16), &[x]).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(&e, GraphError::ReplaceDescriptor(c) if c.new.dtype == DType::F16), "{e:?}");
    assert!(msg.contains("cast(f16)") && msg.contains("f16 [4, 3, 1, 1]"), "{msg}");
    assert_untouched(&g, &dot);

    // The same shape and dtype with other strides: a transposed view of a square tensor.
    let mut g = Graph::new();
    let sq = g.input("sq", F32, [3, 3, 1, 1]).unwrap();
    let c = g.cont(sq).unwrap();
    let e = g.replace(c.id(), Op::Transpose, &[sq]).unwrap_err();
    assert!(matches!(&e, GraphError::ReplaceDescriptor(c) if c.old.ne == c.new.ne && c.old.nb != c.new.nb), "{e:?}");
    assert!(e.to_string().contains("nb [12, 4, 36, 36]"), "{e}");
}

#[test]
fn replace_refuses_inputs_at_or_after_the_node() {
    let (mut g, x, n1, n2, y) = double_neg();
    let dot = g.to_dot();
    // An input built after the node would break build order as a topological order.
    for (node, input) in [(n1, n2), (n1, y), (n2, n2)] {
        let e = g.replace(node.id(), Op::Unary(UnaryOp::Exp), &[input]).unwrap_err();
        assert_eq!(e, GraphError::ReplaceInputOrder { node: node.id(), op: "exp", input: input.id() });
        assert!(e.to_string().contains("not built before"), "{e}");
        assert_untouched(&g, &dot);
    }
    let e = g.replace(n2.id(), Op::Binary(BinaryOp::Add), &[x, y]).unwrap_err();
    assert!(matches!(e, GraphError::ReplaceInputOrder { input, .. } if input == y.id()), "{e:?}");
    assert_untouched(&g, &dot);
}

#[test]
fn replace_refuses_foreign_tensors_leaves_unknown_nodes_and_invalid_ops() {
    let (mut g, x, _, n2, _) = double_neg();
    let dot = g.to_dot();
    let (_, foreign, ..) = double_neg();
    assert_eq!(g.replace(n2.id(), Op::Cont, &[foreign]), Err(GraphError::ForeignTensor { id: foreign.id() }));
    assert_untouched(&g, &dot);

    let e = g.replace(x.id(), Op::Cont, &[]).unwrap_err();
    assert_eq!(e, GraphError::ReplaceLeaf { id: x.id(), kind: LeafKind::Input });
    assert!(e.to_string().contains("input leaf"), "{e}");
    assert_untouched(&g, &dot);

    let e = g.replace(NodeId(9), Op::Cont, &[x]).unwrap_err();
    assert_eq!(e, GraphError::UnknownNode { id: NodeId(9), len: 4 });
    assert_untouched(&g, &dot);

    // The op must be valid on its inputs: infer's error, naming the op.
    let e = g.replace(n2.id(), Op::MulMat, &[x]).unwrap_err();
    assert!(matches!(e, GraphError::Op(OpError::Arity { op: "mul_mat", .. })), "{e:?}");
    assert_untouched(&g, &dot);
}

// ---- random graphs, random replacements ----

/// One node of a random graph: an op on earlier nodes (indices taken modulo the node count).
#[derive(Debug, Clone)]
enum Step {
    Unary(usize, usize),
    Binary(usize, usize, usize),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        (0..UnaryOp::ALL.len(), any::<usize>()).prop_map(|(o, a)| Step::Unary(o, a)),
        (0..BinaryOp::ALL.len(), any::<usize>(), any::<usize>()).prop_map(|(o, a, b)| Step::Binary(o, a, b)),
    ]
}

/// The op and inputs of `s` on the nodes before `before`.
fn apply(g: &Graph, s: &Step, before: usize) -> (Op, Vec<Tensor>) {
    let t = |i: usize| g.tensor(NodeId((i % before) as u32)).unwrap();
    match *s {
        Step::Unary(o, a) => (Op::Unary(UnaryOp::ALL[o]), vec![t(a)]),
        Step::Binary(o, a, b) => (Op::Binary(BinaryOp::ALL[o]), vec![t(a), t(b)]),
    }
}

proptest! {
    /// Whenever the users index is first built (before, between or after the replacements), it
    /// agrees with a scan; build order stays topological; live nodes are closed under inputs.
    #[test]
    fn users_index_and_order_survive_random_replacements(
        build in prop::collection::vec(step(), 1..24),
        rewrites in prop::collection::vec((any::<usize>(), step()), 0..16),
        index_at in 0usize..20,
        n_outputs in 1usize..4,
    ) {
        let mut g = Graph::new();
        g.input("x0", F32, [4, 2, 1, 1]).unwrap();
        g.parameter("x1", F32, [4, 1, 1, 1]).unwrap();
        for s in &build {
            let (op, inputs) = apply(&g, s, g.len());
            let _ = g.op(op, &inputs); // x1 broadcasts into x0's shape, not the reverse
        }
        if g.len() == 2 {
            return Ok(());
        }
        for k in 0..n_outputs {
            g.mark_output(g.tensor(NodeId((g.len() - 1 - k % (g.len() - 2)) as u32)).unwrap()).unwrap();
        }
        for (r, (node, s)) in rewrites.iter().enumerate() {
            if r == index_at {
                let _ = g.users(NodeId(0));
            }
            let node = 2 + node % (g.len() - 2); // an op node, never a leaf
            let (op, inputs) = apply(&g, s, node);
            // An op invalid on these inputs or of another shape is refused, and nothing changes.
            let before = g.to_dot();
            match g.replace(NodeId(node as u32), op, &inputs) {
                Ok(t) => prop_assert_eq!(t.id(), NodeId(node as u32)),
                Err(e) => {
                    prop_assert!(matches!(e, GraphError::Op(_) | GraphError::ReplaceDescriptor(_)), "{:?}", e);
                    prop_assert_eq!(g.to_dot(), before);
                }
            }
        }
        assert_users_match_scan(&g);
        let live = g.live_nodes();
        for (i, n) in g.nodes().iter().enumerate() {
            prop_assert!(n.inputs.iter().all(|inp| inp.index() < i), "node {} reads a later node", i);
        }
        for &id in &live {
            prop_assert!(g.node(id).inputs.iter().all(|inp| live.contains(inp)));
        }
        for &o in g.outputs() {
            prop_assert!(live.contains(&o) && g.is_output(o));
        }
    }
}
