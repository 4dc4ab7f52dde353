//! The `gate_up_swiglu` pass on the CPU: qwen35moe's FFN (the router, the routed experts' gate,
//! up and down projections, the shared expert's) at scaled-down shapes, with the pass and
//! without; the CPU computes each fused op as the products and swiglu it replaces, so the
//! outputs are equal bit for bit.

mod common;

use common::values;

use tessera_cpu::CpuBackend;
use tessera_graph::passes::standard;
use tessera_graph::{Backend, Graph, Session, Tensor};
use tessera_ops::DType;

const F32: DType = DType::F32;
/// n_embd, the expert and shared FFN width, experts, experts a token.
const E: usize = 256;
const FF: usize = 64;
const N_EXPERT: usize = 16;
const K: usize = 4;

/// The FFN of one block over `n` tokens; returns the leaves (in fill order) and the two results
/// (the routed experts' down projections `[E, K, n]`, the shared expert's `[E, n]`).
fn ffn(g: &mut Graph, dt: DType, n: usize) -> (Vec<Tensor>, [Tensor; 2]) {
    let x = g.input("x", F32, [E, n, 1, 1]).unwrap();
    let w_inp = g.parameter("ffn_gate_inp", F32, [E, N_EXPERT, 1, 1]).unwrap();
    let w_ge = g.parameter("ffn_gate_exps", dt, [E, FF, N_EXPERT, 1]).unwrap();
    let w_ue = g.parameter("ffn_up_exps", dt, [E, FF, N_EXPERT, 1]).unwrap();
    let w_de = g.parameter("ffn_down_exps", dt, [FF, E, N_EXPERT, 1]).unwrap();
    let w_sg = g.parameter("ffn_gate_shexp", dt, [E, FF, 1, 1]).unwrap();
    let w_su = g.parameter("ffn_up_shexp", dt, [E, FF, 1, 1]).unwrap();
    let w_sd = g.parameter("ffn_down_shexp", dt, [FF, E, 1, 1]).unwrap();
    let logits = g.mul_mat(w_inp, x).unwrap();
    let probs = g.softmax(logits, 1.0, None).unwrap();
    let sel = g.top_k(probs, K).unwrap();
    let cur = g.reshape(x, &[E, 1, n]).unwrap();
    let gt = g.mul_mat_id(w_ge, cur, sel).unwrap();
    let up = g.mul_mat_id(w_ue, cur, sel).unwrap();
    let a = g.swiglu(gt, up).unwrap();
    let ex = g.mul_mat_id(w_de, a, sel).unwrap();
    let sg = g.mul_mat(w_sg, x).unwrap();
    let su = g.mul_mat(w_su, x).unwrap();
    let sa = g.swiglu(sg, su).unwrap();
    let sh = g.mul_mat(w_sd, sa).unwrap();
    g.mark_output(ex).unwrap();
    g.mark_output(sh).unwrap();
    (vec![x, w_inp, w_ge, w_ue, w_de, w_sg, w_su, w_sd], [ex, sh])
}

/// Runs `g` on `cpu` with each leaf (mapped by `map` from the built graph's handle) filled with
/// seeded values; returns the outputs.
fn run(
    cpu: &mut CpuBackend,
    g: &Graph,
    leaves: &[Tensor],
    outs: &[Tensor],
    map: impl Fn(Tensor) -> Tensor,
) -> Vec<Vec<f32>> {
    let mut s = Session::new(g, cpu).unwrap();
    for (i, &leaf) in leaves.iter().enumerate() {
        s.set_f32(map(leaf), &values(leaf.meta().nelements(), 100 + i as u64)).unwrap();
    }
    s.run().unwrap();
    outs.iter().map(|&t| s.get_f32(map(t)).unwrap()).collect()
}

#[test]
fn the_fused_ffn_equals_the_unfused_one_bit_for_bit() {
    for dt in [F32, DType::Q8_0, DType::NvFp4] {
        for n in [1, 5, 17] {
            let mut g = Graph::new();
            let (leaves, outs) = ffn(&mut g, dt, n);
            let mut cpu = CpuBackend::new();
            let off = run(&mut cpu, &g, &leaves, &outs, |t| t);

            let mut passes = standard();
            passes.set_all(false);
            passes.set_enabled("gate_up_swiglu", true).unwrap();
            let be: &dyn Backend = &cpu;
            let fused = passes.run(g, &|op, inputs| be.supports(op, inputs)).unwrap();
            let r = fused.reports[0];
            assert_eq!((r.pass, r.applied, r.nodes_removed), ("gate_up_swiglu", 2, 4), "{dt} n={n}");
            let on = run(&mut cpu, &fused.graph, &leaves, &outs, |t| fused.tensor(t).unwrap());
            for (i, (a, b)) in on.iter().zip(&off).enumerate() {
                let same = a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(same, "{dt} n={n}: output {i} differs with the pass");
            }
        }
    }
}
