//! One token's routed-expert products (mul_mat_id_swiglu, then mul_mat_id_weighted_sum over its
//! result) run from one captured CUDA graph step after step with new routes, activations and
//! router weights, against the CPU backend: the one-token kernels (`moe_ring_*`) read the ids on
//! the device at every replay. Skips with a message when no GPU is usable.

mod common;

use common::{gpu, nmse, value};
use tessera_cpu::CpuBackend;
use tessera_graph::{Backend, Graph, Session, Tensor};
use tessera_ops::DType;

const N_EXPERT: usize = 16;
const N_USED: usize = 9;
const K: usize = 256;
const FF: usize = 256;

struct Step {
    g: Graph,
    experts: [Tensor; 3],
    x: Tensor,
    ids: Tensor,
    w: Tensor,
    outs: [Tensor; 2],
}

/// gate/up [K, FF, 16] and down [FF, K, 16] experts of `d`, one token routed to 9 of them.
fn step(d: DType) -> Step {
    let mut g = Graph::new();
    let gate = g.parameter("gate", d, [K, FF, N_EXPERT, 1]).unwrap();
    let up = g.parameter("up", d, [K, FF, N_EXPERT, 1]).unwrap();
    let down = g.parameter("down", d, [FF, K, N_EXPERT, 1]).unwrap();
    let x = g.input("x", DType::F32, [K, 1, 1, 1]).unwrap();
    let ids = g.input("ids", DType::I32, [N_USED, 1, 1, 1]).unwrap();
    let w = g.input("w", DType::F32, [1, N_USED, 1, 1]).unwrap();
    let h = g.mul_mat_id_swiglu(gate, up, x, ids).unwrap();
    let y = g.mul_mat_id_weighted_sum(down, h, ids, w).unwrap();
    g.mark_output(h).unwrap();
    g.mark_output(y).unwrap();
    Step { g, experts: [gate, up, down], x, ids, w, outs: [h, y] }
}

/// Runs `rounds` tokens through one session of `backend` (the same graph each round), returning
/// each round's outputs.
fn rounds(backend: &mut dyn Backend, d: DType, rounds: usize) -> Vec<[Vec<f32>; 2]> {
    let st = step(d);
    let mut s = Session::new(&st.g, backend).unwrap();
    let mut seed = 7u64;
    for e in st.experts {
        let n = e.meta().nelements();
        let vals: Vec<f32> = (0..n).map(|_| 0.1 * value(&mut seed)).collect();
        s.set_f32(e, &vals).unwrap();
    }
    (0..rounds)
        .map(|r| {
            // 9 distinct experts, another set each round
            let ids: Vec<i32> = (0..N_USED).map(|u| ((u * 5 + 3 * r) % N_EXPERT) as i32).collect();
            let x: Vec<f32> = (0..K).map(|_| value(&mut seed)).collect();
            let w: Vec<f32> = (0..N_USED).map(|_| 0.5 * (value(&mut seed) + 1.0)).collect();
            s.set_i32(st.ids, &ids).unwrap();
            s.set_f32(st.x, &x).unwrap();
            s.set_f32(st.w, &w).unwrap();
            s.run().unwrap();
            st.outs.map(|t| s.get_f32(t).unwrap())
        })
        .collect()
}

#[test]
fn one_token_expert_products_replay_with_new_routes() {
    let Some(mut cuda) = gpu() else { return };
    for d in [DType::Q8_0, DType::NvFp4] {
        let before = cuda.stats().graphs;
        let got = rounds(&mut cuda, d, 4);
        let after = cuda.stats().graphs;
        // one capture, then replays: the later rounds run the first round's graph
        assert_eq!(after.captures - before.captures, 1, "{d:?}: {after:?}");
        assert!(after.replays - before.replays >= 3, "{d:?}: {after:?}");
        let want = rounds(&mut CpuBackend::new(), d, 4);
        for (r, (g, w)) in got.iter().zip(&want).enumerate() {
            for (i, name) in ["swiglu", "weighted sum"].iter().enumerate() {
                let e = nmse(&g[i], &w[i]);
                eprintln!("{d:?} round {r} {name}: nmse {e:.3e}");
                // the int16 activations of the GPU's one-token kernels against the CPU's f32
                assert!(e <= 1e-7, "{d:?} round {r} {name}: nmse {e:e}");
            }
        }
    }
}
