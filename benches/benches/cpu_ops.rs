//! Criterion benches of single ops on the CPU backend.
//!
//! Each bench builds a one-op graph once, places it with a [`Session`], fills its leaves with
//! deterministic data and times `session.run()` (the whole step: task list + kernels, no
//! placement, no host transfers).
//!
//! Throughput is reported from the cost model ([`tessera_ops::cost`]) as both elements and
//! bytes: **the "elem/s" figure is FLOP/s** (a multiply-add counts 2) and "B/s" is the memory
//! traffic the op cannot avoid. So `mul_mat/f32_1024x1024x1024` reporting `50 Gelem/s` means
//! 50 GFLOP/s.
//!
//! Run all: `cargo bench -p tessera-benches`; one group: `cargo bench -p tessera-benches -- mul_mat`.
//! Defaults are short (10 samples, 1 s warm-up, 3 s measurement) so the whole suite takes a few
//! minutes on 2 cores; criterion's own flags (`--measurement-time`, `--sample-size`, `--quick`)
//! override them.

use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use tessera_benches::fill_uniform;
use tessera_cpu::CpuBackend;
use tessera_graph::{Graph, Session, Tensor};
use tessera_ops::DType;

/// The cost of the op that produced `out` (the last node of a one-op graph), as criterion
/// throughput: FLOPs as elements, bytes as bytes (bytes only for ops without arithmetic).
fn throughput(g: &Graph, out: Tensor) -> Throughput {
    let node = g.node(out.id());
    let op = node.op().expect("the benched tensor is an op");
    let inputs: Vec<_> = node.inputs.iter().map(|&i| g.node(i).meta).collect();
    let refs: Vec<_> = inputs.iter().collect();
    let cost = tessera_ops::cost(op, &refs, out.meta());
    if cost.flops == 0 {
        Throughput::Bytes(cost.bytes) // data movement: only bandwidth means anything
    } else {
        Throughput::ElementsAndBytes { elements: cost.flops, bytes: cost.bytes }
    }
}

/// Places `g` on a fresh CPU backend, lets `fill` set its leaves, runs it once, then benches
/// `run()` as `group/name` with the throughput of the op producing `out`.
fn bench_graph(c: &mut Criterion, group: &str, name: &str, g: &Graph, out: Tensor, fill: impl FnOnce(&mut Session)) {
    let mut backend = CpuBackend::new();
    let mut session = Session::new(g, &mut backend).expect("place the graph");
    fill(&mut session);
    session.run().expect("first run");
    let mut grp = c.benchmark_group(group);
    grp.throughput(throughput(g, out));
    grp.bench_function(name, |b| b.iter(|| session.run().expect("run")));
    grp.finish();
}

/// A `fill` for [`bench_graph`] that sets each leaf to uniform data (seeded by its position).
fn uniform_leaves(leaves: &[Tensor]) -> impl FnOnce(&mut Session) + '_ {
    move |s| {
        for (i, &t) in leaves.iter().enumerate() {
            fill_uniform(s, t, i as u64 + 1).expect("fill a leaf");
        }
    }
}

/// `a [K, M]` (weights of `wtype`) times f32 `b [K, N]`.
fn mul_mat_case(c: &mut Criterion, name: &str, wtype: DType, k: usize, m: usize, n: usize) {
    let mut g = Graph::new();
    let a = g.parameter("a", wtype, [k, m, 1, 1]).expect("a");
    let b = g.input("b", DType::F32, [k, n, 1, 1]).expect("b");
    let y = g.mul_mat(a, b).expect("mul_mat");
    g.mark_output(y).expect("output");
    bench_graph(c, "mul_mat", name, &g, y, uniform_leaves(&[a, b]));
}

fn mul_mat(c: &mut Criterion) {
    mul_mat_case(c, "f32_1024x1024x1024", DType::F32, 1024, 1024, 1024);
    mul_mat_case(c, "f16w_4096x4096_n1", DType::F16, 4096, 4096, 1);
    mul_mat_case(c, "f16w_4096x4096_n64", DType::F16, 4096, 4096, 64);
}

fn rms_norm(c: &mut Criterion) {
    for rows in [1, 2048] {
        let mut g = Graph::new();
        let x = g.input("x", DType::F32, [5120, rows, 1, 1]).expect("x");
        let y = g.rms_norm(x, 1e-6).expect("rms_norm");
        g.mark_output(y).expect("output");
        bench_graph(c, "rms_norm", &format!("f32_5120x{rows}"), &g, y, uniform_leaves(&[x]));
    }
}

/// Attention-score shaped: 32 query rows over 4096 keys, scaled, with a causal f32 mask (row `r`
/// sees the first `4096 - 32 + r + 1` keys).
fn softmax(c: &mut Criterion) {
    let (n_kv, rows) = (4096, 32);
    let mut g = Graph::new();
    let x = g.input("x", DType::F32, [n_kv, rows, 1, 1]).expect("x");
    let mask = g.input("mask", DType::F32, [n_kv, rows, 1, 1]).expect("mask");
    let y = g.softmax(x, 0.125, Some(mask)).expect("softmax");
    g.mark_output(y).expect("output");

    let visible = |r: usize, i: usize| i <= n_kv - rows + r;
    let m: Vec<f32> =
        (0..rows).flat_map(|r| (0..n_kv).map(move |i| if visible(r, i) { 0.0 } else { f32::NEG_INFINITY })).collect();
    bench_graph(c, "softmax", "f32_4096x32_mask", &g, y, |s| {
        fill_uniform(s, x, 1).expect("fill x");
        s.set_f32(mask, &m).expect("set mask");
    });
}

/// Embedding lookup: 64 token ids into a `[2048, 32000]` table.
fn get_rows(c: &mut Criterion) {
    let ids: Vec<i32> = (0..64).map(|i| (i * 7919 + 13) % 32000).collect();
    for dtype in [DType::F32, DType::F16] {
        let mut g = Graph::new();
        let table = g.parameter("tok_embd", dtype, [2048, 32000, 1, 1]).expect("table");
        let tok = g.input("ids", DType::I32, [64, 1, 1, 1]).expect("ids");
        let y = g.get_rows(table, tok).expect("get_rows");
        g.mark_output(y).expect("output");
        bench_graph(c, "get_rows", &format!("{dtype}_2048x32000_64ids"), &g, y, |s| {
            fill_uniform(s, table, 1).expect("fill the table");
            s.set_i32(tok, &ids).expect("set ids");
        });
    }
}

criterion_group! {
    name = cpu_ops;
    config = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = mul_mat, rms_norm, softmax, get_rows
}
criterion_main!(cpu_ops);
