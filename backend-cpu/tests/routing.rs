//! The row-selection and row-normalisation ops of the hybrid models on the CPU backend:
//!
//! - `top_k` / `argsort`: the MoE router (softmax over 256 experts, top 8, gather and renormalise
//!   the weights, as llama.cpp's `build_moe_ffn` for qwen35moe), top_k as the head of a
//!   descending argsort for every k, order and tie rules, and agreement with a plain sort;
//! - `l2_norm`: unit rows, scale invariance, ggml's `max(norm, eps)` rule against HF/FLA's
//!   `rsqrt(sum x^2 + eps)`.

mod common;

use common::values;

use tessera_cpu::{CpuBackend, ReferenceBackend};
use tessera_graph::{Backend, Graph, Session, Tensor};
use tessera_ops::{DType, SortOrder};

const F32: DType = DType::F32;

/// Builds a graph from one f32 input `[ne]` holding `x`, runs it on `backend` and returns every
/// output as f64.
fn eval(
    backend: &mut dyn Backend,
    ne: [usize; 4],
    x: &[f32],
    build: impl FnOnce(&mut Graph, Tensor) -> Vec<Tensor>,
) -> Vec<Vec<f64>> {
    let mut g = Graph::new();
    let xt = g.input("x", F32, ne).unwrap();
    let outs = build(&mut g, xt);
    for &o in &outs {
        g.mark_output(o).unwrap();
    }
    let mut s = Session::new(&g, backend).unwrap();
    s.set_f32(xt, x).unwrap();
    s.run().unwrap();
    outs.iter().map(|&o| s.get_f64(o).unwrap()).collect()
}

/// The indices of `row` (no NaN) sorted by the documented rule: descending by value (`-0.0` equal
/// to `0.0`), ties by lower index.
fn plain_sort_desc(row: &[f32]) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..row.len()).collect();
    idx.sort_by(|&a, &b| row[b].partial_cmp(&row[a]).expect("no NaN").then(a.cmp(&b)));
    idx
}

#[test]
fn moe_router_selects_and_renormalises_the_top_8_of_256() {
    let (n_expert, n_used, n_tokens) = (256, 8, 5);
    let logits = values(n_expert * n_tokens, 11);
    let outs = eval(&mut CpuBackend::new(), [n_expert, n_tokens, 1, 1], &logits, |g, x| {
        let probs = g.softmax(x, 1.0, None).unwrap();
        let sel = g.top_k(probs, n_used).unwrap();
        // get_rows of probs viewed as [1, n_expert, n_tokens]: one weight per selected expert
        let rows = g.reshape(probs, &[1, n_expert, n_tokens]).unwrap();
        let w = g.get_rows(rows, sel).unwrap();
        let w = g.reshape(w, &[n_used, n_tokens]).unwrap();
        let total = g.sum_rows(w).unwrap();
        let w = g.div(w, total).unwrap();
        let on_logits = g.top_k(x, n_used).unwrap();
        vec![sel, w, on_logits]
    });
    let (sel, w, on_logits) = (&outs[0], &outs[1], &outs[2]);
    assert_eq!(sel, on_logits, "softmax is monotone: the same experts, in the same order");
    for t in 0..n_tokens {
        let row = &logits[t * n_expert..(t + 1) * n_expert];
        let want: Vec<f64> = plain_sort_desc(row)[..n_used].iter().map(|&i| i as f64).collect();
        assert_eq!(sel[t * n_used..(t + 1) * n_used], want[..], "token {t}");
        // renormalised weights: softmax restricted to the selected logits
        let sel_logits: Vec<f64> = want.iter().map(|&i| f64::from(row[i as usize])).collect();
        let z: f64 = sel_logits.iter().map(|l| l.exp()).sum();
        for (u, l) in sel_logits.iter().enumerate() {
            let got = w[t * n_used + u];
            assert!((got - l.exp() / z).abs() < 1e-6, "token {t} slot {u}: {got} vs {}", l.exp() / z);
        }
        let total: f64 = w[t * n_used..(t + 1) * n_used].iter().sum();
        assert!((total - 1.0).abs() < 1e-6);
    }
}

#[test]
fn top_k_is_the_head_of_a_descending_argsort_for_every_k() {
    let ne = [67, 3, 2, 1];
    // Few distinct values: plenty of ties, which must break the same way in both ops.
    let x: Vec<f32> = values(ne.iter().product(), 12).iter().map(|v| (v * 4.0).round() / 4.0).collect();
    let ks: Vec<usize> = (1..=67).collect();
    let outs = eval(&mut CpuBackend::new(), ne, &x, |g, x| {
        let mut outs = vec![g.argsort(x, SortOrder::Descending).unwrap()];
        outs.extend(ks.iter().map(|&k| g.top_k(x, k).unwrap()));
        outs
    });
    let full = &outs[0];
    for (k, top) in ks.iter().zip(&outs[1..]) {
        for (r, row) in top.chunks(*k).enumerate() {
            assert_eq!(row, &full[r * 67..r * 67 + k], "k {k}, row {r}");
        }
    }
    for (r, row) in x.chunks(67).enumerate() {
        let want: Vec<f64> = plain_sort_desc(row).iter().map(|&i| i as f64).collect();
        assert_eq!(full[r * 67..(r + 1) * 67], want[..], "row {r}");
    }
}

#[test]
fn argsort_orders_are_stable_and_mirror_on_distinct_values() {
    let ne = [300, 4, 1, 1];
    let x = values(1200, 13);
    let neg: Vec<f32> = x.iter().map(|v| -v).collect();
    let asc = eval(&mut CpuBackend::new(), ne, &x, |g, x| vec![g.argsort(x, SortOrder::Ascending).unwrap()]);
    let desc_of_neg = eval(&mut CpuBackend::new(), ne, &neg, |g, x| vec![g.argsort(x, SortOrder::Descending).unwrap()]);
    assert_eq!(asc, desc_of_neg, "ascending(x) == descending(-x) without ties");
    for (r, idx) in asc[0].chunks(300).enumerate() {
        let row = &x[r * 300..(r + 1) * 300];
        assert!(idx.windows(2).all(|w| row[w[0] as usize] < row[w[1] as usize]), "row {r} not ascending");
    }
    // All equal: both orders are the identity permutation.
    let flat = vec![0.5f32; 40];
    let outs = eval(&mut CpuBackend::new(), [40, 1, 1, 1], &flat, |g, x| {
        vec![g.argsort(x, SortOrder::Ascending).unwrap(), g.argsort(x, SortOrder::Descending).unwrap()]
    });
    let identity: Vec<f64> = (0..40).map(f64::from).collect();
    assert_eq!(outs, vec![identity.clone(), identity]);
}

#[test]
fn cpu_and_reference_agree_on_large_router_batches() {
    // 64 tokens x 256 experts, several k: the selection paths (insertion and partition) must
    // both equal the reference's full sort.
    let ne = [256, 64, 1, 1];
    let x = values(256 * 64, 14);
    let build =
        |g: &mut Graph, x: Tensor| [1, 8, 16, 32, 33, 128, 256].iter().map(|&k| g.top_k(x, k).unwrap()).collect();
    let cpu = eval(&mut CpuBackend::new(), ne, &x, build);
    let reference = eval(&mut ReferenceBackend::new(), ne, &x, build);
    assert_eq!(cpu, reference);
}

#[test]
fn l2_norm_gives_unit_rows_and_is_scale_invariant() {
    let ne = [128, 16, 3, 1];
    let x = values(128 * 48, 15);
    let scaled: Vec<f32> = x.iter().map(|v| v * 1000.0).collect();
    let a = eval(&mut CpuBackend::new(), ne, &x, |g, x| vec![g.l2_norm(x, 1e-6).unwrap()]);
    let b = eval(&mut CpuBackend::new(), ne, &scaled, |g, x| vec![g.l2_norm(x, 1e-6).unwrap()]);
    for (r, (ra, rb)) in a[0].chunks(128).zip(b[0].chunks(128)).enumerate() {
        let norm: f64 = ra.iter().map(|v| v * v).sum::<f64>().sqrt();
        assert!((norm - 1.0).abs() < 1e-6, "row {r}: norm {norm}");
        assert!(ra.iter().zip(rb).all(|(u, v)| (u - v).abs() < 1e-6), "row {r}: not scale invariant");
    }
}

#[test]
fn l2_norm_eps_clamps_the_norm_like_ggml_not_like_hf() {
    // eps 1e-6 (qwen35's rms eps, also its l2 eps). Row norms 1e-2, 1e-4 and 1e-7: ggml divides
    // the first two by their norm and the last by eps. HF/FLA's x * rsqrt(sum x^2 + 1e-6) clamps
    // at 1e-3 instead, so it agrees only where the norm dominates 1e-3.
    let x = [0.006, 0.008, 0.0, 0.000_06, 0.000_08, 0.0, 6e-8, 8e-8, 0.0];
    let y = eval(&mut CpuBackend::new(), [3, 3, 1, 1], &x, |g, x| vec![g.l2_norm(x, 1e-6).unwrap()]);
    let y = &y[0];
    let want = [0.6, 0.8, 0.0, 0.6, 0.8, 0.0, 0.06, 0.08, 0.0];
    for (i, (g, w)) in y.iter().zip(want).enumerate() {
        assert!((g - w).abs() < 1e-6, "element {i}: {g} vs {w}");
    }
    let hf = |v: f64, sum_sq: f64| v / (sum_sq + 1e-6).sqrt();
    assert!((y[0] - hf(0.006, 1e-4)).abs() < 0.01, "norm-dominated rows agree with HF");
    assert!((y[3] - hf(0.000_06, 1e-8)).abs() > 0.5, "small rows do not");
}
