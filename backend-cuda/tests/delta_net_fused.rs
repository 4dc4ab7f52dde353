//! gated_delta_net_fused against its composition on the same GPU: l2_norm of the conv's q and k,
//! sigmoid of beta, softplus(alpha + dt_bias) * a, then gated_delta_net, as the unfused graph runs
//! them. gdn_input_prep computes each prep value with the unfused kernels' device code (norm.cuh's
//! l2 rows, common.cuh's unary_f, the elementwise program's `__fadd_rn` / `__fmul_rn`), so the
//! outputs and states are expected to agree bit for bit; the test asserts NMSE <= 1e-12 and
//! reports whether they are identical. Skips with a message when no GPU is usable.

mod common;

use common::{gpu, nmse};
use tessera_graph::{Graph, Session, Tensor};
use tessera_ops::{DType, DeltaNetAlgo, GatedDeltaNetParams, HeadMap};

const F32: DType = DType::F32;
const I32: DType = DType::I32;

fn uniform(seed: &mut u64, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            *seed ^= *seed << 13;
            *seed ^= *seed >> 7;
            *seed ^= *seed << 17;
            lo + (hi - lo) * ((*seed >> 40) as f32 / (1u64 << 24) as f32)
        })
        .collect()
}

/// One DeltaNet step (ragged batch `offsets`/`slots`) fused or not; returns output and state.
fn step(
    fused: bool,
    (s_k, h_k, h_v): (usize, usize, usize),
    offsets: &[i32],
    slots: &[i32],
    algo: DeltaNetAlgo,
) -> Option<(Vec<f32>, Vec<f32>)> {
    let mut cuda = gpu()?;
    let n = *offsets.last().unwrap() as usize + 1;
    let n_slots = slots.len() + 1;
    let ch = 2 * h_k * s_k + h_v * s_k;
    let f = 4;
    let mut g = Graph::new();
    let conv = g.input("conv", F32, [ch, n, 1, 1]).unwrap();
    let proj = g.input("proj", F32, [2 * h_v, n, 1, 1]).unwrap();
    let dt_bias = g.input("dt_bias", F32, [h_v, 1, 1, 1]).unwrap();
    let a = g.input("a", F32, [h_v, 1, 1, 1]).unwrap();
    let state = g.state("state", F32, [s_k, s_k, h_v, n_slots]).unwrap();
    let ts = g.input("slots", I32, [slots.len(), 1, 1, 1]).unwrap();
    let to = g.input("seq_offsets", I32, [offsets.len(), 1, 1, 1]).unwrap();
    let pnb = [f, 2 * h_v * f, 2 * h_v * n * f, 2 * h_v * n * f];
    let beta = g.view(proj, [h_v, n, 1, 1], pnb, 0).unwrap();
    let alpha = g.view(proj, [h_v, n, 1, 1], pnb, h_v * f).unwrap();
    let nb = |d: usize| [f, d * f, ch * f, ch * n * f];
    let qk = g.view(conv, [s_k, 2 * h_k, n, 1], nb(s_k), 0).unwrap();
    let v = g.view(conv, [s_k, h_v, n, 1], nb(s_k), 2 * h_k * s_k * f).unwrap();
    let p = GatedDeltaNetParams { scale: 1.0 / (s_k as f32).sqrt(), head_map: HeadMap::Tiled, algo, ragged: true };
    let o: Tensor = if fused {
        g.gated_delta_net_fused(qk, v, alpha, dt_bias, a, beta, state, ts, Some(to), 1e-6, p).unwrap()
    } else {
        let b = g.sigmoid(beta).unwrap();
        let b = g.reshape(b, &[1, h_v, n, 1]).unwrap();
        let d = g.add(alpha, dt_bias).unwrap();
        let d = g.softplus(d).unwrap();
        let d = g.mul(d, a).unwrap();
        let d = g.reshape(d, &[1, h_v, n, 1]).unwrap();
        let qkn = g.l2_norm(qk, 1e-6).unwrap();
        let nb_qk = [f, s_k * f, 2 * h_k * s_k * f, 2 * h_k * s_k * n * f];
        let q = g.view(qkn, [s_k, h_k, n, 1], nb_qk, 0).unwrap();
        let k = g.view(qkn, [s_k, h_k, n, 1], nb_qk, h_k * s_k * f).unwrap();
        g.gated_delta_net_ragged(q, k, v, d, b, state, ts, to, p).unwrap()
    };
    g.mark_output(o).unwrap();
    g.mark_output(state).unwrap();
    let mut s = Session::new(&g, &mut cuda).unwrap();
    let mut seed = 0x51ed_2701_9e37_79b9u64;
    s.set_f32(conv, &uniform(&mut seed, ch * n, -1.0, 1.0)).unwrap();
    s.set_f32(proj, &uniform(&mut seed, 2 * h_v * n, -3.0, 3.0)).unwrap();
    s.set_f32(dt_bias, &uniform(&mut seed, h_v, -1.0, 1.0)).unwrap();
    s.set_f32(a, &uniform(&mut seed, h_v, -1.0, -0.1)).unwrap();
    s.set_f32(state, &uniform(&mut seed, s_k * s_k * h_v * n_slots, -0.1, 0.1)).unwrap();
    s.set_i32(ts, slots).unwrap();
    s.set_i32(to, offsets).unwrap();
    s.run().unwrap();
    Some((s.get_f32(o).unwrap(), s.get_f32(state).unwrap()))
}

#[test]
fn fused_delta_net_matches_its_composition() {
    // 35B-A3B (h_v 32) and 27B (h_v 48) heads: a decode step, a prefill chunk with decode tokens;
    // small heads (the warp-row norm path: S_k 6 is not a multiple of 4).
    let shapes = [(128, 16, 32), (128, 16, 48), (6, 2, 4)];
    let batches: [(&[i32], &[i32]); 2] = [(&[0, 1, 2, 3], &[2, 0, 1]), (&[0, 100, 101, 118], &[1, 0, 2])];
    for shape in shapes {
        for (offsets, slots) in batches {
            for algo in [DeltaNetAlgo::Serial, DeltaNetAlgo::Chunked { chunk: 64 }] {
                let Some((of, sf)) = step(true, shape, offsets, slots, algo) else {
                    return eprintln!("skipping: no GPU");
                };
                let (ou, su) = step(false, shape, offsets, slots, algo).expect("the GPU went away");
                let (eo, es) = (nmse(&of, &ou), nmse(&sf, &su));
                let same = of.iter().chain(&sf).zip(ou.iter().chain(&su)).all(|(x, y)| x.to_bits() == y.to_bits());
                eprintln!(
                    "{shape:?} {offsets:?} {algo:?}: out nmse {eo:.3e}, state nmse {es:.3e}, bit-identical {same}"
                );
                assert!(eo <= 1e-12 && es <= 1e-12, "{shape:?} {offsets:?} {algo:?}: out {eo:.3e} state {es:.3e}");
            }
        }
    }
}
