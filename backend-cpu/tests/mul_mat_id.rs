//! mul_mat_id semantics on both backends: it equals a loop of mul_mat over the routed experts
//! (each slot's expert taken as a view of the expert tensor), for every weight dtype, with one
//! activation row per slot and with one broadcast row; out-of-range ids are data errors.

use tessera_cpu::{CpuBackend, ReferenceBackend};
use tessera_graph::{Backend, BackendError, ExecError, Graph, Session, Tensor};
use tessera_ops::{DType, KernelError};

const F32: DType = DType::F32;

/// Deterministic values in `[-1, 1)`.
fn values(n: usize, seed: usize) -> Vec<f32> {
    (0..n).map(|i| ((i * 7919 + seed * 104_729) % 2003) as f32 / 1001.5 - 1.0).collect()
}

/// Routed experts: `n_used` distinct ids per token.
fn routes(n_expert: usize, n_used: usize, n_tokens: usize) -> Vec<i32> {
    (0..n_tokens).flat_map(|t| (0..n_used).map(move |u| ((5 * t + 3 * u + 1) % n_expert) as i32)).collect()
}

struct Setup {
    k: usize,
    n: usize,
    n_expert: usize,
    n_used: usize,
    n_b: usize,
    n_tokens: usize,
}

/// `(mul_mat_id result, loop-of-mul_mat result)` on `backend`.
fn run(backend: &mut dyn Backend, dtype: DType, s: &Setup) -> (Vec<f32>, Vec<f32>) {
    let Setup { k, n, n_expert, n_used, n_b, n_tokens } = *s;
    let ids_v = routes(n_expert, n_used, n_tokens);
    let mut g = Graph::new();
    let w = g.parameter("experts", dtype, [k, n, n_expert, 1]).unwrap();
    let b = g.input("b", F32, [k, n_b, n_tokens, 1]).unwrap();
    let ids = g.input("ids", DType::I32, [n_used, n_tokens, 1, 1]).unwrap();
    let fused = g.mul_mat_id(w, b, ids).unwrap();
    g.mark_output(fused).unwrap();
    // The loop: expert ids[u, t] as a view of `w`, times row (u mod n_b, t) of `b`.
    let wm = w.meta();
    let bm = b.meta();
    let mut looped: Vec<Tensor> = Vec::new();
    for t in 0..n_tokens {
        for u in 0..n_used {
            let e = ids_v[u + n_used * t] as usize;
            let we = g.view(w, [k, n, 1, 1], wm.nb, e * wm.nb[2]).unwrap();
            let col = g.view(b, [k, 1, 1, 1], bm.nb, (u % n_b) * bm.nb[1] + t * bm.nb[2]).unwrap();
            let y = g.mul_mat(we, col).unwrap();
            g.mark_output(y).unwrap();
            looped.push(y);
        }
    }
    let mut sess = Session::new(&g, backend).unwrap();
    sess.set_f32(w, &values(k * n * n_expert, 1)).unwrap();
    sess.set_f32(b, &values(k * n_b * n_tokens, 2)).unwrap();
    sess.set_i32(ids, &ids_v).unwrap();
    sess.run().unwrap();
    let got = sess.get_f32(fused).unwrap();
    let want = looped.iter().flat_map(|&y| sess.get_f32(y).unwrap()).collect();
    (got, want)
}

fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    let norm: f64 = want.iter().map(|&w| f64::from(w).powi(2)).sum();
    let err: f64 = got.iter().zip(want).map(|(&g, &w)| (f64::from(g) - f64::from(w)).powi(2)).sum();
    assert!(err <= 1e-12 * norm, "{what}: nmse {:e}", err / norm);
}

#[test]
fn mul_mat_id_equals_a_loop_of_mul_mat_over_the_routed_experts() {
    let setups = [
        // decode: one token, a row per slot (down projection)
        Setup { k: 128, n: 24, n_expert: 8, n_used: 2, n_b: 2, n_tokens: 1 },
        // broadcast row (gate / up), several tokens, top-8 of 16
        Setup { k: 64, n: 33, n_expert: 16, n_used: 8, n_b: 1, n_tokens: 3 },
        // prefill: enough tokens that experts are shared and take the GEMM path
        Setup { k: 192, n: 40, n_expert: 8, n_used: 4, n_b: 4, n_tokens: 11 },
    ];
    for dtype in [F32, DType::F16, DType::BF16, DType::Q8_0, DType::NvFp4] {
        for s in &setups {
            let what = format!("{dtype} k={} n={} experts={} used={} n_b={}", s.k, s.n, s.n_expert, s.n_used, s.n_b);
            let (got, want) = run(&mut CpuBackend::new(), dtype, s);
            assert_close(&got, &want, &format!("cpu {what}"));
            let (got_ref, want_ref) = run(&mut ReferenceBackend::new(), dtype, s);
            assert_close(&got_ref, &want_ref, &format!("ref {what}"));
            assert_close(&got, &got_ref, &format!("cpu vs ref {what}"));
        }
    }
}

#[test]
fn out_of_range_expert_ids_are_kernel_errors_on_both_backends() {
    for bad in [-1, 8, i32::MAX] {
        let mut errors = Vec::new();
        let backends: [Box<dyn Backend>; 2] = [Box::new(CpuBackend::new()), Box::new(ReferenceBackend::new())];
        for mut backend in backends {
            let mut g = Graph::new();
            let w = g.parameter("experts", DType::Q8_0, [64, 4, 8, 1]).unwrap();
            let b = g.input("b", F32, [64, 1, 2, 1]).unwrap();
            let ids = g.input("ids", DType::I32, [2, 2, 1, 1]).unwrap();
            let y = g.mul_mat_id(w, b, ids).unwrap();
            g.mark_output(y).unwrap();
            let mut sess = Session::new(&g, backend.as_mut()).unwrap();
            sess.set_f32(w, &values(64 * 4 * 8, 3)).unwrap();
            sess.set_f32(b, &values(128, 4)).unwrap();
            sess.set_i32(ids, &[0, 7, bad, 1]).unwrap();
            errors.push(sess.run().unwrap_err());
        }
        let want =
            KernelError::IndexOutOfRange { op: "mul_mat_id", index: i64::from(bad), limit: 8, what: "expert id" };
        for e in &errors {
            match e {
                ExecError::Backend(BackendError::Kernel(k)) => assert_eq!(k, &want),
                other => panic!("expected a kernel error, got {other:?}"),
            }
        }
        assert_eq!(errors[0], errors[1], "both backends report the same error");
    }
}
