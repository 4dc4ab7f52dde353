//! `delta_net_prep` on a DeltaNet block's graph as the model builds it: the preparation (q/k
//! l2_norm, beta's sigmoid, the decay as three ops or as elementwise_chains' program) folds into
//! the delta rule; ops before and after, and what it must leave alone.

use tessera_graph::passes::{DeltaNetPrep, ElementwiseChains, Pipeline};
use tessera_graph::{Graph, Op, Tensor, TensorMeta};
use tessera_ops::{DType, DeltaNetAlgo, GatedDeltaNetParams, HeadMap};

const F32: DType = DType::F32;

fn all_supported(_: &Op, _: &[TensorMeta]) -> bool {
    true
}

/// A block of `s_k`-wide heads (h_k 2, h_v 4) over 3 tokens; `write_between`: a set_rows into
/// the state just before the l2_norm (an in-place write between the prep ops and the rule).
fn block(write_between: bool) -> (Graph, Tensor) {
    let (s_k, h_k, h_v, n, f) = (16, 2, 4, 3, 4);
    let ch = 2 * h_k * s_k + h_v * s_k;
    let mut g = Graph::new();
    let conv = g.input("conv", F32, [ch, n, 1, 1]).unwrap();
    let proj = g.input("proj", F32, [2 * h_v, n, 1, 1]).unwrap();
    let dt_bias = g.input("dt_bias", F32, [h_v, 1, 1, 1]).unwrap();
    let a = g.input("a", F32, [h_v, 1, 1, 1]).unwrap();
    let state = g.state("state", F32, [s_k, s_k, h_v, 2]).unwrap();
    let slots = g.input("slots", DType::I32, [1, 1, 1, 1]).unwrap();
    let offsets = g.input("offsets", DType::I32, [2, 1, 1, 1]).unwrap();
    let pnb = [f, 2 * h_v * f, 2 * h_v * n * f, 2 * h_v * n * f];
    let beta = g.view(proj, [h_v, n, 1, 1], pnb, 0).unwrap();
    let beta = g.sigmoid(beta).unwrap();
    let beta = g.reshape(beta, &[1, h_v, n, 1]).unwrap();
    let alpha = g.view(proj, [h_v, n, 1, 1], pnb, h_v * f).unwrap();
    let d = g.add(alpha, dt_bias).unwrap();
    let d = g.softplus(d).unwrap();
    let d = g.mul(d, a).unwrap();
    let d = g.reshape(d, &[1, h_v, n, 1]).unwrap();
    let state = if write_between {
        let rows = g.input("rows", F32, [s_k, 1, 1, 1]).unwrap();
        let ids = g.input("ids", DType::I32, [1, 1, 1, 1]).unwrap();
        let flat = g.reshape(state, &[s_k, s_k * h_v * 2]).unwrap();
        g.set_rows(flat, rows, ids).unwrap();
        state
    } else {
        state
    };
    let nb = |w: usize| [f, w * f, ch * f, ch * n * f];
    let qk = g.view(conv, [s_k, 2 * h_k, n, 1], nb(s_k), 0).unwrap();
    let qk = g.l2_norm(qk, 1e-6).unwrap();
    let nb_qk = [f, s_k * f, 2 * h_k * s_k * f, 2 * h_k * s_k * n * f];
    let q = g.view(qk, [s_k, h_k, n, 1], nb_qk, 0).unwrap();
    let k = g.view(qk, [s_k, h_k, n, 1], nb_qk, h_k * s_k * f).unwrap();
    let v = g.view(conv, [s_k, h_v, n, 1], nb(s_k), 2 * h_k * s_k * f).unwrap();
    let p = GatedDeltaNetParams { scale: 0.25, head_map: HeadMap::Tiled, algo: DeltaNetAlgo::Serial, ragged: true };
    let o = g.gated_delta_net_ragged(q, k, v, d, beta, state, slots, offsets, p).unwrap();
    g.mark_output(o).unwrap();
    (g, o)
}

/// The ops that run (views not counted), by name.
fn ops(g: &Graph) -> Vec<&'static str> {
    g.nodes().iter().filter_map(|n| n.op()).filter(|o| !o.is_view()).map(|o| o.name()).collect()
}

#[test]
fn the_preparation_folds_into_the_delta_rule_in_both_decay_forms() {
    let (g, _) = block(false);
    assert_eq!(ops(&g), ["sigmoid", "add", "softplus", "mul", "l2_norm", "gated_delta_net"]);
    let alone = Pipeline::new().with(DeltaNetPrep).run(g.clone(), &all_supported).unwrap();
    assert_eq!(ops(&alone.graph), ["gated_delta_net_fused"]);
    assert_eq!((alone.reports[0].applied, alone.reports[0].nodes_removed), (1, 5));
    let after_chains = Pipeline::new().with(ElementwiseChains).with(DeltaNetPrep).run(g, &all_supported).unwrap();
    assert_eq!(ops(&after_chains.graph), ["gated_delta_net_fused"]);
    assert_eq!((after_chains.reports[1].applied, after_chains.reports[1].nodes_removed), (1, 3));
    let fused = after_chains.graph.nodes().iter().find_map(|n| n.op().filter(|o| !o.is_view())).unwrap();
    assert_eq!(fused.updates_input(), Some(6), "the state is updated in place, as gated_delta_net's");
}

#[test]
fn an_in_place_write_between_or_a_second_reader_keeps_it_unfused() {
    let (g, _) = block(true);
    let run = Pipeline::new().with(DeltaNetPrep).run(g, &all_supported).unwrap();
    assert_eq!((run.reports[0].found, run.reports[0].applied), (1, 0));
    // beta's sigmoid read again
    let (mut g, _) = block(false);
    let sig = g.nodes().iter().position(|n| n.op().is_some_and(|o| o.name() == "sigmoid")).unwrap();
    let sig = g.tensor(tessera_graph::NodeId(sig as u32)).unwrap();
    let other = g.neg(sig).unwrap();
    g.mark_output(other).unwrap();
    let run = Pipeline::new().with(DeltaNetPrep).run(g, &all_supported).unwrap();
    assert_eq!(run.reports[0].applied, 0);
}
