//! The tensor-core prefill attention (`fa_mma_*`) at grid sizes eval's small cases never reach,
//! against the CPU backend: on Hopper the host runs a block as two warp groups where the grid does
//! not fill the GPU (each taking half of the kv tiles, merged at the end), else as two heads of one
//! kv head sharing the K/V tiles where a kv head's query heads pair up, else as one group, so all
//! three shapes below are checked (and eval's cases whose kv heads have an even number of query heads
//! take head pairs under `TESSERA_FA_PAIR=1`: tools/gpu-check.sh). Skips with a message when no GPU is usable.

mod common;

use common::{gpu, nmse, value};
use tessera_cpu::CpuBackend;
use tessera_graph::{Backend, Graph, Session};
use tessera_ops::DType;

/// One causal prefill of `n_tokens` tokens (the last of `n_kv` positions) with `n_head` query
/// heads over `n_head_kv` f16 K/V heads of dim `d`, through `backend`.
fn prefill(
    backend: &mut dyn Backend,
    d: usize,
    n_tokens: usize,
    n_head: usize,
    n_head_kv: usize,
    n_kv: usize,
) -> Vec<f32> {
    let mut g = Graph::new();
    let q = g.input("q", DType::F32, [d, n_tokens, n_head, 1]).unwrap();
    let k = g.input("k", DType::F16, [d, n_kv, n_head_kv, 1]).unwrap();
    let v = g.input("v", DType::F16, [d, n_kv, n_head_kv, 1]).unwrap();
    let mask = g.input("mask", DType::F16, [n_kv, n_tokens, 1, 1]).unwrap();
    let out = g.flash_attn_ext(q, k, v, Some(mask), None, 1.0 / (d as f32).sqrt(), 0.0).unwrap();
    g.mark_output(out).unwrap();
    let mut s = Session::new(&g, backend).unwrap();
    let mut seed = 11u64;
    for t in [q, k, v] {
        let vals: Vec<f32> = (0..t.meta().nelements()).map(|_| value(&mut seed)).collect();
        s.set_f32(t, &vals).unwrap();
    }
    let causal: Vec<f32> = (0..n_tokens)
        .flat_map(|t| (0..n_kv).map(move |j| if j + n_tokens <= t + n_kv { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    s.set_f32(mask, &causal).unwrap();
    s.run().unwrap();
    s.get_f32(out).unwrap()
}

#[test]
fn prefill_attention_matches_the_cpu_with_each_block_layout() {
    let Some(mut cuda) = gpu() else { return };
    // (d, tokens, heads, kv heads, positions), on an H100 / H200: 192 blocks of 64 tokens (96
    // head pairs), 128 blocks over four times the positions (two groups splitting the kv tiles),
    // 256 blocks at d 128 and d 256 (head pairs), and 192 blocks whose kv heads have three query
    // heads each (one group)
    for (d, n_tokens, n_head, n_head_kv, n_kv) in [
        (256, 512, 24, 4, 512),
        (256, 512, 16, 2, 2048),
        (128, 512, 32, 4, 512),
        (256, 1024, 16, 2, 1024),
        (256, 512, 24, 8, 512),
    ] {
        let got = prefill(&mut cuda, d, n_tokens, n_head, n_head_kv, n_kv);
        let want = prefill(&mut CpuBackend::new(), d, n_tokens, n_head, n_head_kv, n_kv);
        let e = nmse(&got, &want);
        eprintln!("d {d}, {n_tokens} tokens, {n_head}/{n_head_kv} heads over {n_kv}: nmse {e:.3e}");
        // f16 K/V, Q and P rounded to f16 for the tensor cores (eval's bound for these inputs)
        assert!(e <= 1e-5, "d {d}, {n_head}/{n_head_kv} heads over {n_kv}: nmse {e:e}");
    }
}
