//! The tensor-core decode attention (`fa_dec_*`) over the ways its splits merge, one step after
//! another on one backend with CUDA graphs: one split, clusters of 2, 4 and 8 blocks (sm_90+) and
//! `fa_combine` for a long context. Steps of one structure whose cluster shape differs must run
//! as graphs of their own kernels, never as updates of a graph that would keep another shape (the
//! shape is compiled into each cluster entry for that reason). Against the CPU backend; skips with
//! a message when no GPU is usable.

mod common;

use common::{gpu, nmse, value};
use tessera_cpu::CpuBackend;
use tessera_graph::{Backend, Graph, Session};
use tessera_ops::DType;

/// One decode token of 16 query heads over 2 f16 K/V heads of dim 256 (the 35B-A3B attention)
/// and `n_kv` positions, through `backend`.
fn decode(backend: &mut dyn Backend, n_kv: usize, seed: u64) -> Vec<f32> {
    let mut g = Graph::new();
    let q = g.input("q", DType::F32, [256, 1, 16, 1]).unwrap();
    let k = g.input("k", DType::F16, [256, n_kv, 2, 1]).unwrap();
    let v = g.input("v", DType::F16, [256, n_kv, 2, 1]).unwrap();
    let out = g.flash_attn_ext(q, k, v, None, None, 1.0 / 16.0, 0.0).unwrap();
    g.mark_output(out).unwrap();
    let mut s = Session::new(&g, backend).unwrap();
    let mut state = seed;
    for t in [q, k, v] {
        let vals: Vec<f32> = (0..t.meta().nelements()).map(|_| value(&mut state)).collect();
        s.set_f32(t, &vals).unwrap();
    }
    s.run().unwrap();
    s.get_f32(out).unwrap()
}

#[test]
fn decode_attention_matches_the_cpu_whichever_way_its_splits_merge() {
    let Some(mut cuda) = gpu() else { return };
    // 64 positions: one split; 100, 256, 512: 2, 4 and 8 splits (clusters of that size on
    // sm_90+); 4096: 64 splits merged by fa_combine; then smaller contexts again
    for (i, n_kv) in [64, 100, 256, 512, 4096, 256, 100].into_iter().enumerate() {
        let seed = 7 + i as u64;
        let got = decode(&mut cuda, n_kv, seed);
        let want = decode(&mut CpuBackend::new(), n_kv, seed);
        let e = nmse(&got, &want);
        eprintln!("{n_kv} positions: nmse {e:.3e}, graphs {:?}", cuda.stats().graphs);
        // f16 K/V, Q and P rounded to f16 for the tensor cores (eval's bound for these inputs)
        assert!(e <= 1e-5, "{n_kv} positions: nmse {e:e}");
    }
}
