//! `mul_mat_id_weighted_sum` on the CPU: the op equals the chain it replaces (mul_mat_id, mul by
//! the router weights, sum_rows over the slots through a transpose, reshape) bit for bit, for
//! f32 and block-quantized experts, shared or per-slot activations, 1 to 17 tokens; the
//! `moe_weighted_sum` pass swallows that chain; a bad expert id names the op.

mod common;

use common::values;

use tessera_cpu::CpuBackend;
use tessera_graph::passes::{MoeWeightedSum, Pipeline};
use tessera_graph::{Backend, Graph, Session, Tensor};
use tessera_ops::{DType, Op};

const F32: DType = DType::F32;

/// Experts `[k_in, n_out, n_expert]`, activations `[k_in, n_b, n]`, ids `[k, n]` (distinct,
/// seeded), router weights `[1, k, n]`; returns the leaves, the ids leaf and its values, and
/// (fused, unfused) results.
struct Case {
    g: Graph,
    leaves: Vec<Tensor>,
    ids: (Tensor, Vec<i32>),
    fused: Tensor,
    unfused: Tensor,
}

fn case(dt: DType, n_b: usize, n: usize) -> Case {
    let (k_in, n_out, n_expert, k) = (64, 24, 8, 4);
    let mut g = Graph::new();
    let experts = g.parameter("experts", dt, [k_in, n_out, n_expert, 1]).unwrap();
    let a = g.input("a", F32, [k_in, n_b, n, 1]).unwrap();
    let ids = g.input("ids", DType::I32, [k, n, 1, 1]).unwrap();
    let w = g.input("w", F32, [1, k, n, 1]).unwrap();
    let fused = g.mul_mat_id_weighted_sum(experts, a, ids, w).unwrap();
    let ex = g.mul_mat_id(experts, a, ids).unwrap();
    let ex = g.mul(ex, w).unwrap();
    let s = g.transpose(ex).unwrap();
    let s = g.sum_rows(s).unwrap();
    let unfused = g.reshape(s, &[n_out, n]).unwrap();
    g.mark_output(fused).unwrap();
    g.mark_output(unfused).unwrap();
    let id_values = (0..n).flat_map(|t| (0..k).map(move |u| ((3 * t + 5 * u + 1) % n_expert) as i32)).collect();
    Case { g, leaves: vec![experts, a, w], ids: (ids, id_values), fused, unfused }
}

fn fill(s: &mut Session<'_, '_>, c: &Case) {
    for (i, &leaf) in c.leaves.iter().enumerate() {
        s.set_f32(leaf, &values(leaf.meta().nelements(), 7 + i as u64)).unwrap();
    }
    s.set_i32(c.ids.0, &c.ids.1).unwrap();
}

#[test]
fn the_op_equals_the_chain_it_replaces_bit_for_bit() {
    for dt in [F32, DType::Q8_0, DType::NvFp4] {
        for (n_b, n) in [(1, 1), (4, 1), (1, 3), (4, 17)] {
            let c = case(dt, n_b, n);
            let mut cpu = CpuBackend::new();
            let mut s = Session::new(&c.g, &mut cpu).unwrap();
            fill(&mut s, &c);
            s.run().unwrap();
            let (a, b) = (s.get_f32(c.fused).unwrap(), s.get_f32(c.unfused).unwrap());
            assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "{dt} n_b={n_b} n={n}");
        }
    }
}

#[test]
fn the_pass_swallows_the_chain_and_the_result_stays() {
    let c = case(DType::Q8_0, 4, 3);
    let mut cpu = CpuBackend::new();
    let want = {
        let mut s = Session::new(&c.g, &mut cpu).unwrap();
        fill(&mut s, &c);
        s.run().unwrap();
        s.get_f32(c.unfused).unwrap()
    };
    let be: &dyn Backend = &cpu;
    let run = Pipeline::new().with(MoeWeightedSum).run(c.g.clone(), &|op, inputs| be.supports(op, inputs)).unwrap();
    assert_eq!(run.reports[0].applied, 1);
    let fused_ops = run.graph.nodes().iter().filter(|n| n.op() == Some(&Op::MulMatIdWeightedSum)).count();
    assert_eq!(fused_ops, 2, "the pass fused the chain next to the op built directly");
    let mut s = Session::new(&run.graph, &mut cpu).unwrap();
    for (i, &leaf) in c.leaves.iter().enumerate() {
        s.set_f32(run.tensor(leaf).unwrap(), &values(leaf.meta().nelements(), 7 + i as u64)).unwrap();
    }
    s.set_i32(run.tensor(c.ids.0).unwrap(), &c.ids.1).unwrap();
    s.run().unwrap();
    let got = s.get_f32(run.tensor(c.unfused).unwrap()).unwrap();
    assert!(got.iter().zip(&want).all(|(x, y)| x.to_bits() == y.to_bits()));
}

#[test]
fn an_expert_id_out_of_range_names_the_op() {
    let mut g = Graph::new();
    let experts = g.parameter("experts", F32, [64, 24, 8, 1]).unwrap();
    let a = g.input("a", F32, [64, 1, 2, 1]).unwrap();
    let ids = g.input("ids", DType::I32, [4, 2, 1, 1]).unwrap();
    let w = g.input("w", F32, [1, 4, 2, 1]).unwrap();
    let y = g.mul_mat_id_weighted_sum(experts, a, ids, w).unwrap();
    g.mark_output(y).unwrap();
    let mut cpu = CpuBackend::new();
    let mut s = Session::new(&g, &mut cpu).unwrap();
    s.set_f32(experts, &values(64 * 24 * 8, 1)).unwrap();
    s.set_f32(a, &values(128, 2)).unwrap();
    s.set_f32(w, &values(8, 3)).unwrap();
    s.set_i32(ids, &[0, 1, 2, 3, 4, 8, 6, 7]).unwrap();
    let msg = s.run().unwrap_err().to_string();
    assert!(msg.contains("mul_mat_id_weighted_sum: index 8 is out of range 0..8 (expert id)"), "{msg}");
}
