//! The fused ops against their compositions on the same GPU (test-ops judges them against the
//! CPU). softmax_top_k must give the composition's ids even where the softmax kernel rounds
//! near-equal logits to equal or swapped probabilities, which only holds while fused.cu computes
//! the probabilities as reduce.cu's softmax kernels do (TAG(softmax-probs)). Every test skips
//! with a message when no GPU is usable.

mod common;

use common::{gpu, unit};
use tessera_graph::{Graph, Session, Tensor};
use tessera_ops::DType;

/// Router logits full of near-ties: four levels plus noise of a few f32 ulps, so that many
/// probabilities are equal or one ulp apart after softmax.
fn near_ties(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            let level = (unit(&mut s) * 4.0).floor() * 0.25;
            level + (unit(&mut s) - 0.5) * 4e-7
        })
        .collect()
}

/// Runs `outputs` of `g` on the GPU with `leaf` filled with `values`.
fn run(g: &Graph, leaf: Tensor, values: &[f32], outputs: &[Tensor]) -> Vec<Vec<f32>> {
    let Some(mut cuda) = gpu() else { return Vec::new() };
    let mut s = Session::new(g, &mut cuda).unwrap();
    s.set_f32(leaf, values).unwrap();
    s.run().unwrap();
    outputs
        .iter()
        .map(|&t| match t.dtype() {
            DType::I32 => s.get_f64(t).unwrap().into_iter().map(|v| v as f32).collect(),
            _ => s.get_f32(t).unwrap(),
        })
        .collect()
}

#[test]
fn softmax_top_k_gives_the_composition_ids_on_near_ties() {
    // Dense aligned rows (softmax_vec_warp's layout) and a window of them (softmax_warp's).
    for (n_expert, k, tokens) in [(256, 8, 64), (128, 40, 16), (1024, 8, 8), (61, 7, 9)] {
        let mut g = Graph::new();
        let leaf = g.input("logits", DType::F32, [n_expert + 4, tokens, 1, 1]).unwrap();
        let nb = leaf.meta().nb;
        let dense = g.view(leaf, [n_expert, tokens, 1, 1], nb, 0).unwrap();
        let dense = g.cont(dense).unwrap();
        let window = g.view(leaf, [n_expert, tokens, 1, 1], nb, 4).unwrap();
        let mut outs = Vec::new();
        for logits in [dense, window] {
            let fused = g.softmax_top_k(logits, k).unwrap();
            let probs = g.softmax(logits, 1.0, None).unwrap();
            let unfused = g.top_k(probs, k).unwrap();
            let w = g.moe_weights(logits, fused).unwrap();
            let rows = g.reshape(probs, &[1, n_expert, tokens]).unwrap();
            let picked = g.get_rows(rows, unfused).unwrap();
            let picked = g.reshape(picked, &[k, tokens]).unwrap();
            let total = g.sum_rows(picked).unwrap();
            let w_unfused = g.div(picked, total).unwrap();
            outs.extend([fused, unfused, w, w_unfused]);
        }
        for &t in &outs {
            g.mark_output(t).unwrap();
        }
        let values = near_ties((n_expert + 4) * tokens, n_expert as u64);
        let got = run(&g, leaf, &values, &outs);
        if got.is_empty() {
            return;
        }
        for (layout, o) in ["dense", "window"].iter().zip(got.chunks(4)) {
            assert_eq!(o[0], o[1], "{layout} rows of {n_expert}, k = {k}: ids differ from top_k(softmax)");
            let (err, norm) = o[2]
                .iter()
                .zip(&o[3])
                .fold((0.0f64, 0.0f64), |(e, n), (&a, &b)| (e + f64::from(a - b).powi(2), n + f64::from(b).powi(2)));
            assert!(err <= 1e-12 * norm, "{layout}: moe_weights differ from the composition: {}", err / norm);
        }
    }
}

#[test]
fn norms_match_their_compositions() {
    for e in [128, 2048, 9000] {
        let mut g = Graph::new();
        let leaf = g.input("x", DType::F32, [e, 12, 1, 1]).unwrap();
        let nb = leaf.meta().nb;
        let view = |g: &mut Graph, row: usize| g.view(leaf, [e, 4, 1, 1], nb, row * nb[1]).unwrap();
        let (a, b, z) = (view(&mut g, 0), view(&mut g, 4), view(&mut g, 8));
        let w = g.view(leaf, [e, 1, 1, 1], nb, 11 * nb[1]).unwrap();
        let both = g.add_rms_norm_mul(a, b, w, 1e-6).unwrap();
        let s = g.add(a, b).unwrap();
        let h = g.rms_norm(s, 1e-6).unwrap();
        let h = g.mul(h, w).unwrap();
        let unfused = g.concat(s, h, 2).unwrap();
        let norm_mul = g.rms_norm_mul(a, w, 1e-6).unwrap();
        let n = g.rms_norm(a, 1e-6).unwrap();
        let n = g.mul(n, w).unwrap();
        let gated = g.gated_rms_norm(a, w, z, 1e-6).unwrap();
        let sz = g.silu(z).unwrap();
        let gz = g.mul(n, sz).unwrap();
        let outs = [both, unfused, norm_mul, n, gated, gz];
        for &t in &outs {
            g.mark_output(t).unwrap();
        }
        let mut st = e as u64;
        let values: Vec<f32> = (0..e * 12).map(|_| unit(&mut st) * 4.0 - 2.0).collect();
        let got = run(&g, leaf, &values, &outs);
        if got.is_empty() {
            return;
        }
        for (name, pair) in ["add_rms_norm_mul", "rms_norm_mul", "gated_rms_norm"].iter().zip(got.chunks(2)) {
            let (err, norm) = pair[0]
                .iter()
                .zip(&pair[1])
                .fold((0.0f64, 0.0f64), |(e, n), (&x, &y)| (e + f64::from(x - y).powi(2), n + f64::from(y).powi(2)));
            assert!(err <= 1e-12 * norm, "{name} ({e}): NMSE {} against its composition", err / norm);
        }
    }
}

/// `rms_norm_mul_rope` against `rope_multi(rms_norm_mul(..))` on the GPU: qwen35's q viewed in
/// the joint q+gate projection (256 wide, 64 rotated, imrope) and qwen3's heads (128, plain),
/// at decode and a few tokens. The kernel repeats rms_norm_mul_warp's norm and uses rope.cu's
/// angles (`rope.cuh`), so the two agree to rounding.
#[test]
fn rms_norm_mul_rope_matches_its_composition() {
    use tessera_ops::{RopePairing, RopeParams};
    let qwen35 = RopeParams { n_rot: 64, freq_base: 1e7, pairing: RopePairing::Neox, sections: Some([11, 11, 10, 0]) };
    let qwen3 = RopeParams { n_rot: 128, freq_base: 1e6, pairing: RopePairing::Neox, sections: None };
    for (hd, nh, n, p, joint) in [(256, 16, 1, qwen35, true), (256, 16, 7, qwen35, true), (128, 32, 5, qwen3, false)] {
        let Some(mut cuda) = gpu() else { return };
        let mut g = Graph::new();
        let stride = if joint { 2 * hd } else { hd };
        let proj = g.input("proj", DType::F32, [stride * nh, n, 1, 1]).unwrap();
        let w = g.input("w", DType::F32, [hd, 1, 1, 1]).unwrap();
        let n_pos = n * if p.sections.is_some() { 4 } else { 1 };
        let pos = g.input("pos", DType::I32, [n_pos, 1, 1, 1]).unwrap();
        let nb = proj.meta().nb;
        let x = g.view(proj, [hd, nh, n, 1], [4, 4 * stride, nb[1], nb[2]], 0).unwrap();
        let fused = g.rms_norm_mul_rope(x, w, pos, 1e-6, p).unwrap();
        let h = g.rms_norm_mul(x, w, 1e-6).unwrap();
        let unfused = g.rope_multi(h, pos, p).unwrap();
        g.mark_output(fused).unwrap();
        g.mark_output(unfused).unwrap();
        let mut st = (hd * n) as u64;
        let xs: Vec<f32> = (0..stride * nh * n).map(|_| unit(&mut st) * 4.0 - 2.0).collect();
        let ws: Vec<f32> = (0..hd).map(|_| unit(&mut st) + 0.5).collect();
        let ps: Vec<i32> = (0..n_pos).map(|_| (unit(&mut st) * 32768.0) as i32).collect();
        let mut s = Session::new(&g, &mut cuda).unwrap();
        s.set_f32(proj, &xs).unwrap();
        s.set_f32(w, &ws).unwrap();
        s.set_i32(pos, &ps).unwrap();
        s.run().unwrap();
        let (a, b) = (s.get_f32(fused).unwrap(), s.get_f32(unfused).unwrap());
        let (err, norm) = a
            .iter()
            .zip(&b)
            .fold((0.0f64, 0.0f64), |(e, m), (&x, &y)| (e + f64::from(x - y).powi(2), m + f64::from(y).powi(2)));
        assert!(err <= 1e-12 * norm, "hd {hd}, {n} tokens: NMSE {} against its composition", err / norm);
    }
}
