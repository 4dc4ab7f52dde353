//! The graph itself: which nodes are live, output marking, names, and the DOT export.

use tessera_graph::{Graph, LeafKind, NodeId, NodeKind};
use tessera_ops::{DType, Op};

const F32: DType = DType::F32;

fn ids(ts: &[tessera_graph::Tensor]) -> Vec<NodeId> {
    ts.iter().map(|t| t.id()).collect()
}

#[test]
fn live_nodes_skip_dead_nodes_and_unused_leaves() {
    let mut g = Graph::new();
    let x = g.input("x", F32, [4, 3, 1, 1]).unwrap();
    let unused = g.parameter("unused", F32, [2, 1, 1, 1]).unwrap();
    let a = g.silu(x).unwrap();
    let dead = g.exp(x).unwrap();
    let dead2 = g.neg(dead).unwrap();
    let c = g.neg(a).unwrap();
    let after = g.sum_rows(c).unwrap(); // built after the output, not needed by it
    g.mark_output(c).unwrap();
    let live = g.live_nodes();
    assert_eq!(live, ids(&[x, a, c]));
    for t in [unused, dead, dead2, after] {
        assert!(!live.contains(&t.id()), "{:?} should be dead", t.id());
    }
}

#[test]
fn live_nodes_are_in_build_order_and_closed_under_inputs() {
    let mut g = Graph::new();
    let w = g.parameter("w", F32, [4, 3, 1, 1]).unwrap();
    let x = g.input("x", F32, [4, 2, 1, 1]).unwrap();
    let y = g.mul_mat(w, x).unwrap();
    let t = g.transpose(y).unwrap(); // a view
    let c = g.cont(t).unwrap();
    let s = g.softmax(c, 1.0, None).unwrap();
    g.mark_output(s).unwrap();
    g.mark_output(y).unwrap();
    let live = g.live_nodes();
    assert_eq!(live, ids(&[w, x, y, t, c, s]));
    assert!(live.windows(2).all(|p| p[0] < p[1]));
    for &id in &live {
        for inp in &g.node(id).inputs {
            assert!(live.contains(inp), "input {inp:?} of live {id:?} must be live");
        }
    }
}

#[test]
fn nothing_is_live_without_outputs_or_state_updates() {
    let mut g = Graph::new();
    let x = g.input("x", F32, [4, 1, 1, 1]).unwrap();
    let _ = g.exp(x).unwrap();
    assert!(g.live_nodes().is_empty());
    assert!(Graph::new().live_nodes().is_empty());
}

#[test]
fn in_place_state_updates_are_live_without_being_outputs() {
    let mut g = Graph::new();
    let cache = g.state("kv", DType::F16, [4, 8, 1, 1]).unwrap();
    let k = g.input("k", F32, [4, 2, 1, 1]).unwrap();
    let slots = g.input("slots", DType::I32, [2, 1, 1, 1]).unwrap();
    let kk = g.scale(k, 0.5).unwrap();
    let set = g.set_rows(cache, kk, slots).unwrap();
    // a cpy into a window of a second state, through a view
    let conv = g.state("conv", F32, [4, 3, 1, 1]).unwrap();
    let row = g.view(conv, [4, 1, 1, 1], [4, 16, 16, 16], 16).unwrap();
    let src = g.input("src", F32, [4, 1, 1, 1]).unwrap();
    let cp = g.cpy(src, row).unwrap();
    let dead = g.exp(k).unwrap();
    // the in-place results share the written tensors' descriptors
    assert_eq!(set.meta(), cache.meta());
    assert_eq!(cp.meta(), row.meta());
    assert!(g.outputs().is_empty());
    let live = g.live_nodes();
    assert_eq!(live, ids(&[cache, k, slots, kk, set, conv, row, src, cp]));
    assert!(!live.contains(&dead.id()));
}

#[test]
fn in_place_writer_keeps_a_dead_looking_chain_alive() {
    // y = exp(x) is only consumed by a cpy into state: the cpy makes it live.
    let mut g = Graph::new();
    let x = g.input("x", F32, [3, 1, 1, 1]).unwrap();
    let y = g.exp(x).unwrap();
    let s = g.state("s", DType::BF16, [3, 1, 1, 1]).unwrap();
    let c = g.cpy(y, s).unwrap();
    assert_eq!(g.live_nodes(), ids(&[x, y, s, c]));
}

#[test]
fn mark_output_is_idempotent_and_keeps_first_order() {
    let mut g = Graph::new();
    let x = g.input("x", F32, [4, 1, 1, 1]).unwrap();
    let a = g.exp(x).unwrap();
    let b = g.neg(x).unwrap();
    g.mark_output(b).unwrap();
    g.mark_output(a).unwrap();
    g.mark_output(b).unwrap();
    g.mark_output(a).unwrap();
    assert_eq!(g.outputs(), &[b.id(), a.id()]);
    // a leaf can be an output too, and stays live alone
    g.mark_output(x).unwrap();
    g.mark_output(x).unwrap();
    assert_eq!(g.outputs(), &[b.id(), a.id(), x.id()]);
    assert_eq!(g.live_nodes(), ids(&[x, a, b]));
}

#[test]
fn nodes_record_kind_inputs_meta_and_name() {
    let mut g = Graph::new();
    let w = g.parameter("w", F32, [4, 3, 1, 1]).unwrap();
    let x = g.input("x", F32, [4, 2, 1, 1]).unwrap();
    let s = g.state("s", F32, [1, 1, 1, 1]).unwrap();
    let y = g.mul_mat(w, x).unwrap();
    g.set_name(y, "logits").unwrap();
    assert_eq!(g.len(), 4);
    assert!(!g.is_empty());
    assert_eq!(g.node(w.id()).kind, NodeKind::Leaf(LeafKind::Parameter));
    assert_eq!(g.node(x.id()).kind, NodeKind::Leaf(LeafKind::Input));
    assert_eq!(g.node(s.id()).kind, NodeKind::Leaf(LeafKind::State));
    assert_eq!(g.node(y.id()).kind, NodeKind::Op(Op::MulMat));
    assert_eq!(g.node(y.id()).inputs.as_slice(), &[w.id(), x.id()]);
    assert_eq!(g.node(y.id()).meta, *y.meta());
    assert_eq!(g.node(y.id()).name.as_deref(), Some("logits"));
    assert_eq!(g.node(w.id()).name.as_deref(), Some("w"));
    assert_eq!(g.node(y.id()).label(), "mul_mat");
    assert_eq!(g.node(s.id()).label(), "state");
    assert_eq!(g.tensor(y.id()), Some(y));
    assert_eq!(g.tensor(NodeId(99)), None);
}

#[test]
fn dot_shows_every_node_and_edge() {
    let mut g = Graph::new();
    let w = g.parameter("w", DType::F16, [4, 3, 1, 1]).unwrap();
    let x = g.input("x", F32, [4, 2, 1, 1]).unwrap();
    let y = g.mul_mat(w, x).unwrap(); // [3, 2]
    let t = g.transpose(y).unwrap(); // [2, 3], a view
    let c = g.cont(t).unwrap();
    let r = g.reshape(c, &[6]).unwrap();
    let am = g.argmax(c).unwrap(); // i32 [1, 3]
    g.mark_output(r).unwrap();
    g.mark_output(am).unwrap();
    let dot = g.to_dot();
    assert!(dot.starts_with("digraph tessera {"), "{dot}");
    assert!(dot.trim_end().ends_with('}'), "{dot}");

    let line_of = |i: usize| -> &str {
        dot.lines().find(|l| l.trim_start().starts_with(&format!("n{i} [label="))).unwrap_or_else(|| panic!("{dot}"))
    };
    let expect = [
        (w, "parameter", "[4, 3, 1, 1] f16"),
        (x, "input", "[4, 2, 1, 1] f32"),
        (y, "mul_mat", "[3, 2, 1, 1] f32"),
        (t, "transpose", "[2, 3, 1, 1] f32"),
        (c, "cont", "[2, 3, 1, 1] f32"),
        (r, "reshape([6, 1, 1, 1])", "[6, 1, 1, 1] f32"),
        (am, "argmax", "[1, 3, 1, 1] i32"),
    ];
    for (tensor, op, shape_dtype) in expect {
        let line = line_of(tensor.id().index());
        assert!(line.contains(op), "{line:?} should name {op}");
        assert!(line.contains(shape_dtype), "{line:?} should show {shape_dtype}");
    }
    assert!(line_of(w.id().index()).contains("w\\n"), "leaf names are shown");
    assert!(line_of(w.id().index()).contains("shape=ellipse"));
    assert!(line_of(t.id().index()).contains("style=dashed"), "views are dashed");
    assert!(line_of(r.id().index()).contains("penwidth=2"), "outputs are bold");
    assert!(!line_of(c.id().index()).contains("penwidth"), "non-outputs are not");

    // exactly one edge per input slot, labelled with the slot
    let edges: Vec<&str> = dot.lines().filter(|l| l.contains("->")).collect();
    let n_inputs: usize = g.nodes().iter().map(|n| n.inputs.len()).sum();
    assert_eq!(edges.len(), n_inputs, "{dot}");
    for (from, to, slot) in [(w, y, 0), (x, y, 1), (y, t, 0), (t, c, 0), (c, r, 0), (c, am, 0)] {
        let edge = format!("n{} -> n{} [label=\"{slot}\"];", from.id().index(), to.id().index());
        assert!(edges.iter().any(|e| e.trim() == edge), "missing {edge} in {dot}");
    }
}

#[test]
fn dot_escapes_names_and_labels() {
    let mut g = Graph::new();
    let x = g.input("x", F32, [2, 1, 1, 1]).unwrap();
    g.set_name(x, "say \"hi\" \\ bye").unwrap();
    let dot = g.to_dot();
    let line = dot.lines().find(|l| l.contains("n0 [label=")).unwrap();
    // inside the quoted label every quote is escaped, so the label ends where it should
    assert!(line.contains("say \\\"hi\\\" \\\\ bye"), "{line}");
    let label = &line[line.find("label=\"").unwrap() + 7..];
    let mut escaped = false;
    let mut end = None;
    for (i, ch) in label.char_indices() {
        match (escaped, ch) {
            (true, _) => escaped = false,
            (false, '\\') => escaped = true,
            (false, '"') => {
                end = Some(i);
                break;
            }
            _ => {}
        }
    }
    let label = &label[..end.expect("a closed label")];
    assert!(label.ends_with("[2, 1, 1, 1] f32"), "{label}");
}
