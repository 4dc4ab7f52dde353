//! The fusion framework without a backend: `Graph::fuse` and its checks, `Remap`, the
//! `Matcher` guards and the `Pipeline` (switches, reports, DOT clusters). Running rewritten
//! graphs is checked in `backend-cpu/tests/rewrite.rs`.

use tessera_graph::passes::{FoldScales, Pass, Pipeline};
use tessera_graph::{FusedOutput, Fusion, FusionError, Graph, GraphError, Op, Tensor, TensorMeta};
use tessera_ops::{DType, ScaleParams, ViewParams};

const F32: DType = DType::F32;

fn all_supported(_: &Op, _: &[TensorMeta]) -> bool {
    true
}

fn scale(s: f32, b: f32) -> Op {
    Op::Scale(ScaleParams { scale: s, bias: b })
}

/// x -> scale(2, 1) -> scale(3, 0.5) -> output.
fn two_scales() -> (Graph, Tensor, Tensor, Tensor) {
    let mut g = Graph::new();
    let x = g.input("x", F32, [8, 4, 1, 1]).unwrap();
    let a = g.scale_bias(x, 2.0, 1.0).unwrap();
    let b = g.scale_bias(a, 3.0, 0.5).unwrap();
    g.mark_output(b).unwrap();
    (g, x, a, b)
}

#[test]
fn fold_scales_rebuilds_the_graph_and_remaps_handles() {
    let (g, x, a, b) = two_scales();
    let run = Pipeline::new().with(FoldScales).run(g, &all_supported).unwrap();
    let ops: Vec<&Op> = run.graph.nodes().iter().filter_map(|n| n.op()).collect();
    assert_eq!(ops, [&scale(6.0, 3.5)]);
    let r = &run.reports[0];
    assert_eq!((r.pass, r.found, r.applied, r.skipped, r.nodes_removed), ("fold_scales", 1, 1, 0, 1));
    // The intermediate [8, 4] f32 was written once and read once.
    assert_eq!(r.bytes_saved, 2 * 8 * 4 * 4);
    let (x2, b2) = (run.tensor(x).unwrap(), run.tensor(b).unwrap());
    assert_eq!(run.graph.outputs(), [b2.id()]);
    assert_eq!(run.graph.node(b2.id()).inputs.as_slice(), [x2.id()]);
    assert!(matches!(run.tensor(a), Err(GraphError::Rewritten { .. })));
}

#[test]
fn an_intermediate_with_two_readers_is_not_swallowed() {
    let (mut g, _, a, _) = two_scales();
    let other = g.neg(a).unwrap();
    g.mark_output(other).unwrap();
    assert!(FoldScales.find(&g).is_empty());
    let run = Pipeline::new().with(FoldScales).run(g, &all_supported).unwrap();
    assert_eq!(run.reports[0].applied, 0);
}

#[test]
fn switches_and_environment() {
    let mut p = Pipeline::new().with(FoldScales);
    assert_eq!(p.passes(), [("fold_scales", true)]);
    p.set_enabled("fold_scales", false).unwrap();
    let err = p.set_enabled("fold_scale", false).unwrap_err();
    assert_eq!(err.to_string(), "unknown pass `fold_scale` (passes: fold_scales)");
    let (g, ..) = two_scales();
    let run = p.run(g, &all_supported).unwrap();
    assert!(run.reports.is_empty() && run.remap.is_none());
    assert_eq!(run.graph.nodes().iter().filter(|n| n.op().is_some()).count(), 2);
    // An unsupported fused op is skipped.
    let (g, ..) = two_scales();
    let run = Pipeline::new().with(FoldScales).run(g, &|_, _| false).unwrap();
    assert_eq!((run.reports[0].applied, run.reports[0].skipped), (0, 1));
}

#[test]
fn dot_after_a_pass_draws_the_fused_nodes_as_clusters() {
    let mut p = Pipeline::new().with(FoldScales);
    p.dump_after("fold_scales").unwrap();
    assert!(p.dump_after("nope").is_err());
    let (g, ..) = two_scales();
    let dot = p.run(g, &all_supported).unwrap().dot.unwrap();
    assert!(dot.contains("subgraph cluster_0") && dot.contains("fold_scales: scale"), "{dot}");
}

/// Two copies fused into one concat whose planes stand in for them: a fusion with two results.
#[test]
fn a_fusion_with_two_results_reads_them_through_views() {
    let mut g = Graph::new();
    let a = g.input("a", F32, [8, 4, 1, 1]).unwrap();
    let b = g.input("b", F32, [8, 4, 1, 1]).unwrap();
    let ca = g.cont(a).unwrap();
    let cb = g.cont(b).unwrap();
    let sum = g.add(ca, cb).unwrap();
    g.mark_output(sum).unwrap();
    g.mark_output(ca).unwrap();
    let plane = |k: usize| ViewParams { ne: [8, 4, 1, 1], nb: [4, 32, 128, 128], offset: k * 128 };
    let f = Fusion {
        nodes: vec![ca.id(), cb.id()],
        op: Op::Concat { dim: 2 },
        inputs: vec![a.id(), b.id()],
        outputs: vec![(ca.id(), FusedOutput::View(plane(0))), (cb.id(), FusedOutput::View(plane(1)))],
        recomputes: vec![],
    };
    g.check_fusion(&f).unwrap();
    let (g2, remap, stats) = g.fuse(&[f]).unwrap();
    assert_eq!((stats.fusions, stats.bytes_saved), (1, 0));
    let labels: Vec<&str> = g2.nodes().iter().map(|n| n.label()).collect();
    assert_eq!(labels, ["input", "input", "concat", "view", "view", "add"]);
    assert_eq!(g2.outputs().len(), 2);
    assert_eq!(remap.tensor(ca).unwrap().meta(), ca.meta());
}

fn fusion_error(g: &Graph, f: &Fusion) -> FusionError {
    match g.check_fusion(f) {
        Err(GraphError::Fusion(e)) => *e,
        other => panic!("expected a fusion error, got {other:?}"),
    }
}

#[test]
fn unsafe_fusions_are_refused_with_the_reason() {
    let (g, x, a, b) = two_scales();
    let good = Fusion {
        nodes: vec![a.id(), b.id()],
        op: scale(6.0, 3.5),
        inputs: vec![x.id()],
        outputs: vec![(b.id(), FusedOutput::Whole)],
        recomputes: vec![],
    };
    g.check_fusion(&good).unwrap();
    // The output has no stand-in.
    let f = Fusion { outputs: vec![], ..good.clone() };
    assert!(matches!(fusion_error(&g, &f), FusionError::Unmapped { .. }));
    // A stand-in of another shape.
    let v = ViewParams { ne: [8, 2, 1, 1], nb: [4, 32, 64, 64], offset: 0 };
    let f = Fusion { outputs: vec![(b.id(), FusedOutput::View(v))], ..good.clone() };
    assert!(matches!(fusion_error(&g, &f), FusionError::Descriptor { .. }));
    // An input inside the fusion, and a leaf among the replaced nodes.
    let f = Fusion { inputs: vec![a.id()], ..good.clone() };
    assert!(matches!(fusion_error(&g, &f), FusionError::InputInside { .. }));
    let f = Fusion { nodes: vec![x.id(), a.id(), b.id()], ..good.clone() };
    assert!(matches!(fusion_error(&g, &f), FusionError::NotAnOp { .. }));
    // Overlapping fusions.
    let err = g.fuse(&[good.clone(), good.clone()]).unwrap_err();
    assert!(matches!(&err, GraphError::Fusion(e) if matches!(**e, FusionError::Overlap { .. })), "{err}");
}

#[test]
fn a_reader_before_the_fused_node_or_an_in_place_write_between_is_refused() {
    // a = scale(x); r = neg(a) reads a before c = scale(a) ... the fusion {a, c} would come too late for r.
    let mut g = Graph::new();
    let x = g.input("x", F32, [8, 1, 1, 1]).unwrap();
    let a = g.scale(x, 2.0).unwrap();
    let r = g.neg(a).unwrap();
    let c = g.scale(a, 3.0).unwrap();
    g.mark_output(r).unwrap();
    g.mark_output(c).unwrap();
    let f = Fusion {
        nodes: vec![a.id(), c.id()],
        op: scale(6.0, 0.0),
        inputs: vec![x.id()],
        outputs: vec![(a.id(), FusedOutput::Whole), (c.id(), FusedOutput::Whole)],
        recomputes: vec![],
    };
    assert!(matches!(fusion_error(&g, &f), FusionError::EarlyUser { user, .. } if user == r.id()));

    // An in-place write into the fused op's input between its nodes.
    let mut g = Graph::new();
    let st = g.state("st", F32, [8, 4, 1, 1]).unwrap();
    let src = g.input("src", F32, [8, 1, 1, 1]).unwrap();
    let ids = g.input("ids", DType::I32, [1, 1, 1, 1]).unwrap();
    let a = g.scale(st, 2.0).unwrap();
    let w = g.set_rows(st, src, ids).unwrap();
    let c = g.scale(a, 3.0).unwrap();
    g.mark_output(c).unwrap();
    let f = Fusion {
        nodes: vec![a.id(), c.id()],
        op: scale(6.0, 0.0),
        inputs: vec![st.id()],
        outputs: vec![(c.id(), FusedOutput::Whole)],
        recomputes: vec![],
    };
    assert!(matches!(fusion_error(&g, &f), FusionError::InPlaceBetween { writer, .. } if writer == w.id()));
}

/// docs/FUSION.md walks through `fold_scales` by showing its source: it must be the compiled
/// file, verbatim.
#[test]
fn the_fusion_doc_shows_the_compiled_example_pass() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let doc = std::fs::read_to_string(root.join("docs/FUSION.md")).unwrap();
    let src = std::fs::read_to_string(root.join("graph/src/passes/fold_scales.rs")).unwrap();
    assert!(
        doc.contains(&format!("```rust\n{src}```")),
        "docs/FUSION.md no longer shows graph/src/passes/fold_scales.rs"
    );
}

/// qwen35's routed-expert combine: `reshape(sum_rows(transpose(mul(mul_mat_id(experts, a, ids),
/// w))), [N, n])` over 16 experts 32 -> 24, top-4, 3 tokens; `extra` marks the weighted experts
/// as an output too (a reader outside the chain).
fn moe_combine(extra: bool) -> Graph {
    let mut g = Graph::new();
    let experts = g.input("experts", F32, [32, 24, 16, 1]).unwrap();
    let a = g.input("a", F32, [32, 4, 3, 1]).unwrap();
    let ids = g.input("ids", DType::I32, [4, 3, 1, 1]).unwrap();
    let w = g.input("w", F32, [1, 4, 3, 1]).unwrap();
    let ex = g.mul_mat_id(experts, a, ids).unwrap();
    let ex = g.mul(ex, w).unwrap();
    if extra {
        g.mark_output(ex).unwrap();
    }
    let s = g.transpose(ex).unwrap();
    let s = g.sum_rows(s).unwrap();
    let out = g.reshape(s, &[24, 3]).unwrap();
    g.mark_output(out).unwrap();
    g
}

#[test]
fn moe_weighted_sum_swallows_the_combine_unless_a_step_is_read_elsewhere() {
    use tessera_graph::passes::MoeWeightedSum;
    let fused = MoeWeightedSum.find(&moe_combine(false));
    assert_eq!(fused.len(), 1);
    assert_eq!(fused[0].op, Op::MulMatIdWeightedSum);
    assert_eq!(fused[0].nodes.len(), 5);
    let run = Pipeline::new().with(MoeWeightedSum).run(moe_combine(false), &all_supported).unwrap();
    let ops: Vec<&Op> = run.graph.nodes().iter().filter_map(|n| n.op()).collect();
    assert_eq!(ops, [&Op::MulMatIdWeightedSum]);
    let out = run.graph.outputs()[0];
    assert_eq!(run.graph.node(out).meta.ne, [24, 3, 1, 1]);
    assert!(MoeWeightedSum.find(&moe_combine(true)).is_empty());
}

/// Attention's q (or k) after `rms_norm_mul`: `rope_multi(rms_norm_mul(x, w), pos)` over 4 heads
/// of 32 and 3 tokens, imrope; `extra` gives the norm a second reader.
fn q_norm_rope(extra: bool) -> Graph {
    let mut g = Graph::new();
    let x = g.input("x", F32, [32, 4, 3, 1]).unwrap();
    let w = g.input("w", F32, [32, 1, 1, 1]).unwrap();
    let pos = g.input("pos", DType::I32, [12, 1, 1, 1]).unwrap();
    let h = g.rms_norm_mul(x, w, 1e-6).unwrap();
    if extra {
        let other = g.neg(h).unwrap();
        g.mark_output(other).unwrap();
    }
    let p = tessera_ops::RopeParams {
        n_rot: 16,
        freq_base: 1e7,
        pairing: tessera_ops::RopePairing::Neox,
        sections: Some([2, 2, 2, 2]),
    };
    let y = g.rope_multi(h, pos, p).unwrap();
    g.mark_output(y).unwrap();
    g
}

#[test]
fn rms_norm_mul_rope_takes_the_norm_read_only_by_its_rotation() {
    use tessera_graph::passes::RmsNormMulRope;
    let run = Pipeline::new().with(RmsNormMulRope).run(q_norm_rope(false), &all_supported).unwrap();
    let ops: Vec<&str> = run.graph.nodes().iter().filter_map(|n| n.op()).map(Op::name).collect();
    assert_eq!(ops, ["rms_norm_mul_rope"]);
    let r = &run.reports[0];
    assert_eq!((r.found, r.applied, r.nodes_removed), (1, 1, 1));
    // The normed [32, 4, 3] f32 is no longer written and read.
    assert_eq!(r.bytes_saved, 2 * 32 * 4 * 3 * 4);
    let out = run.graph.outputs()[0];
    assert_eq!(run.graph.node(out).meta.ne, [32, 4, 3, 1]);
    // A second reader of the norm keeps it; a backend without the fused op keeps the chain.
    assert!(RmsNormMulRope.find(&q_norm_rope(true)).is_empty());
    let none = |op: &Op, _: &[TensorMeta]| !matches!(op, Op::RmsNormMulRope(_));
    let run = Pipeline::new().with(RmsNormMulRope).run(q_norm_rope(false), &none).unwrap();
    assert_eq!((run.reports[0].found, run.reports[0].applied, run.reports[0].skipped), (1, 0, 1));
    assert_eq!(run.graph.nodes().iter().filter(|n| n.op().is_some()).count(), 2);
}

#[test]
fn the_standard_pipeline_fuses_rms_norm_then_mul_then_rope_into_one_op() {
    let mut g = Graph::new();
    let x = g.input("x", F32, [32, 4, 3, 1]).unwrap();
    let w = g.input("w", F32, [32, 1, 1, 1]).unwrap();
    let pos = g.input("pos", DType::I32, [3, 1, 1, 1]).unwrap();
    let h = g.rms_norm(x, 1e-6).unwrap();
    let h = g.mul(h, w).unwrap();
    let p =
        tessera_ops::RopeParams { n_rot: 32, freq_base: 1e6, pairing: tessera_ops::RopePairing::Neox, sections: None };
    let y = g.rope_multi(h, pos, p).unwrap();
    g.mark_output(y).unwrap();
    let run = tessera_graph::passes::standard().run(g, &all_supported).unwrap();
    let ops: Vec<&str> = run.graph.nodes().iter().filter_map(|n| n.op()).map(Op::name).collect();
    assert_eq!(ops, ["rms_norm_mul_rope"]);
    let applied = |name: &str| run.reports.iter().find(|r| r.pass == name).map(|r| r.applied);
    assert_eq!((applied("rms_norm_mul"), applied("rms_norm_mul_rope")), (Some(1), Some(1)));
}
