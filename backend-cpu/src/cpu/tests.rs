//! Backend-level tests: hand-built tasks (aliasing, bad descriptors, out-of-range placements),
//! and thread pools.

use tessera_graph::{Backend, BackendError, BufferId, NodeId, Task, TensorRef};
use tessera_ops::{DType, Op, RmsNormParams, SoftmaxParams, TensorMeta, UnaryOp, ViewParams};

use super::CpuBackend;
use super::testutil::{F16, F32, case, check};

fn meta(dtype: DType, ne: [usize; 4]) -> TensorMeta {
    TensorMeta::contiguous("test", dtype, ne).expect("valid test shape")
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn read_f32(cpu: &mut CpuBackend, buffer: BufferId, offset: usize, n: usize) -> Vec<f32> {
    let mut raw = vec![0u8; 4 * n];
    cpu.read(buffer, offset, &mut raw).expect("readable");
    raw.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
}

/// A buffer holding `values` (f32).
fn buffer_with(cpu: &mut CpuBackend, values: &[f32], extra: usize) -> BufferId {
    let b = cpu.alloc(4 * values.len() + extra).expect("alloc");
    cpu.write(b, 0, &f32_bytes(values)).expect("write");
    b
}

fn task<'g>(op: &'g Op, inputs: &[TensorRef], output: TensorRef) -> Task<'g> {
    Task { node: NodeId(0), op, inputs: inputs.iter().copied().collect(), output }
}

#[test]
fn supports_every_non_view_op_the_rules_accept() {
    let cpu = CpuBackend::new();
    let x = meta(F32, [4, 3, 1, 1]);
    assert!(cpu.supports(&Op::Unary(UnaryOp::Exp), &[x]));
    assert!(cpu.supports(&Op::MulMat, &[meta(F16, [4, 2, 1, 1]), x]));
    assert!(!cpu.supports(&Op::MulMat, &[x, meta(F16, [4, 2, 1, 1])]), "activations must be f32");
    assert!(!cpu.supports(&Op::Unary(UnaryOp::Exp), &[meta(DType::I32, [4, 1, 1, 1])]));
    assert!(!cpu.supports(&Op::Transpose, &[x]), "views never reach a backend");
    let view = Op::View(ViewParams { ne: [2, 3, 1, 1], nb: [4, 16, 48, 48], offset: 0 });
    assert!(!cpu.supports(&view, &[x]));
}

#[test]
fn an_input_at_the_output_placement_is_read_before_it_is_written() {
    let mut cpu = CpuBackend::new();
    let x = [1.0f32, -2.0, 3.0, 4.0, 0.5, -6.0];
    let buf = buffer_with(&mut cpu, &x, 0);
    let r = TensorRef { buffer: buf, offset: 0, meta: meta(F32, [3, 2, 1, 1]) };
    let softmax = Op::Softmax(SoftmaxParams { scale: 1.0 });
    let neg = Op::Unary(UnaryOp::Neg);
    cpu.compute(&[task(&neg, &[r], r), task(&softmax, &[r], r)]).expect("aliased tasks run");
    let got = read_f32(&mut cpu, buf, 0, 6);
    for row in 0..2 {
        let z: Vec<f32> = x[3 * row..3 * row + 3].iter().map(|v| -v).collect();
        let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let total: f32 = z.iter().map(|v| (v - max).exp()).sum();
        for i in 0..3 {
            let want = (z[i] - max).exp() / total;
            assert!((got[3 * row + i] - want).abs() < 1e-6, "row {row} element {i}");
        }
    }
}

#[test]
fn an_input_overlapping_a_shifted_output_is_copied_first() {
    let mut cpu = CpuBackend::new();
    let x: Vec<f32> = (0..8).map(|i| i as f32).collect();
    let buf = buffer_with(&mut cpu, &x, 4);
    // cont of elements 0..8 written one element later: a naive forward copy would smear x[0].
    let src = TensorRef { buffer: buf, offset: 0, meta: meta(F32, [8, 1, 1, 1]) };
    let dst = TensorRef { buffer: buf, offset: 4, meta: meta(F32, [8, 1, 1, 1]) };
    cpu.compute(&[task(&Op::Cont, &[src], dst)]).expect("runs");
    assert_eq!(read_f32(&mut cpu, buf, 4, 8), x);
}

#[test]
fn inputs_beside_the_output_in_one_arena_are_read_in_place() {
    let mut cpu = CpuBackend::new();
    // [a (4) | out (4) | b (4)] in one buffer
    let buf = buffer_with(&mut cpu, &[1., 2., 3., 4., 0., 0., 0., 0., 10., 20., 30., 40.], 0);
    let at = |offset| TensorRef { buffer: buf, offset, meta: meta(F32, [4, 1, 1, 1]) };
    let add = Op::Binary(tessera_ops::BinaryOp::Add);
    cpu.compute(&[task(&add, &[at(0), at(32)], at(16))]).expect("runs");
    assert_eq!(read_f32(&mut cpu, buf, 0, 12), [1., 2., 3., 4., 11., 22., 33., 44., 10., 20., 30., 40.]);
}

#[test]
fn set_rows_with_its_destination_placed_apart_copies_it_first() {
    let mut cpu = CpuBackend::new();
    let old = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
    let dst_buf = buffer_with(&mut cpu, &old, 0);
    let src_buf = buffer_with(&mut cpu, &[9.0, 8.0], 0);
    let ids_buf = cpu.alloc(4).expect("alloc");
    cpu.write(ids_buf, 0, &1i32.to_le_bytes()).expect("write");
    let out_buf = cpu.alloc(24).expect("alloc");
    let dst = TensorRef { buffer: dst_buf, offset: 0, meta: meta(F32, [2, 3, 1, 1]) };
    let src = TensorRef { buffer: src_buf, offset: 0, meta: meta(F32, [2, 1, 1, 1]) };
    let ids = TensorRef { buffer: ids_buf, offset: 0, meta: meta(DType::I32, [1, 1, 1, 1]) };
    let out = TensorRef { buffer: out_buf, ..dst };
    cpu.compute(&[task(&Op::SetRows, &[dst, src, ids], out)]).expect("runs");
    assert_eq!(read_f32(&mut cpu, out_buf, 0, 6), [1., 2., 9., 8., 5., 6.]);
    assert_eq!(read_f32(&mut cpu, dst_buf, 0, 6), old, "the destination input is not written");
}

#[test]
fn mul_mat_into_a_strided_output_is_computed_through_scratch() {
    let mut cpu = CpuBackend::new();
    // a = [[1, 2], [3, 4], [5, 6]] (M = 3 rows of K = 2); b = two columns [1, 1] and [1, -1]
    let a_buf = buffer_with(&mut cpu, &[1., 2., 3., 4., 5., 6.], 0);
    let b_buf = buffer_with(&mut cpu, &[1., 1., 1., -1.], 0);
    let out_buf = cpu.alloc(24).expect("alloc");
    let a = TensorRef { buffer: a_buf, offset: 0, meta: meta(F32, [2, 3, 1, 1]) };
    let b = TensorRef { buffer: b_buf, offset: 0, meta: meta(F32, [2, 2, 1, 1]) };
    // out [3, 2] stored column-major: element (m, n) at byte 8 m + 4 n
    let out_meta = TensorMeta { dtype: F32, ne: [3, 2, 1, 1], nb: [8, 4, 24, 24] };
    let out = TensorRef { buffer: out_buf, offset: 0, meta: out_meta };
    cpu.compute(&[task(&Op::MulMat, &[a, b], out)]).expect("runs");
    assert_eq!(read_f32(&mut cpu, out_buf, 0, 6), [3., -1., 7., -1., 11., -1.]);
}

#[test]
fn bad_placements_and_descriptors_are_errors_and_buffers_survive() {
    let mut cpu = CpuBackend::new();
    let buf = buffer_with(&mut cpu, &[1.0; 8], 0);
    let good = TensorRef { buffer: buf, offset: 0, meta: meta(F32, [4, 2, 1, 1]) };
    let exp = Op::Unary(UnaryOp::Exp);
    let run = |cpu: &mut CpuBackend, inputs: &[TensorRef], out: TensorRef| cpu.compute(&[task(&exp, inputs, out)]);

    let past_end = TensorRef { offset: 4, ..good };
    assert!(matches!(run(&mut cpu, &[good], past_end), Err(BackendError::OutOfBounds { .. })));
    let other = cpu.alloc(64).expect("alloc");
    let out = TensorRef { buffer: other, offset: 0, meta: good.meta };
    assert!(matches!(run(&mut cpu, &[past_end], out), Err(BackendError::OutOfBounds { .. })));
    let unknown = TensorRef { buffer: BufferId(99), ..good };
    assert!(matches!(run(&mut cpu, &[unknown], out), Err(BackendError::UnknownBuffer { .. })));
    assert!(matches!(run(&mut cpu, &[good], unknown), Err(BackendError::UnknownBuffer { .. })));

    let mut empty = good;
    empty.meta.ne[1] = 0;
    assert!(matches!(run(&mut cpu, &[empty], out), Err(BackendError::Unsupported { .. })));
    let mut huge = good;
    huge.meta.nb[1] = usize::MAX / 2;
    assert!(matches!(run(&mut cpu, &[huge], out), Err(BackendError::OutOfBounds { .. })));
    huge.meta.nb[1] = usize::MAX;
    assert!(matches!(run(&mut cpu, &[huge], out), Err(BackendError::Unsupported { .. })), "span overflows");
    let wrong_shape = TensorRef { meta: meta(F32, [8, 1, 1, 1]), ..out };
    assert!(matches!(run(&mut cpu, &[good], wrong_shape), Err(BackendError::Unsupported { .. })));
    let overlapping = TensorRef { meta: TensorMeta { nb: [4, 4, 32, 32], ..good.meta }, ..out };
    assert!(matches!(run(&mut cpu, &[good], overlapping), Err(BackendError::Kernel(_))));
    let transpose = Op::Transpose;
    assert!(matches!(cpu.compute(&[task(&transpose, &[good], out)]), Err(BackendError::Unsupported { .. })));
    let norm = Op::RmsNorm(RmsNormParams { eps: f32::NAN });
    assert!(matches!(cpu.compute(&[task(&norm, &[good], out)]), Err(BackendError::Unsupported { .. })));

    // Every failed task put its output buffer back.
    assert_eq!(read_f32(&mut cpu, buf, 0, 8), [1.0; 8]);
    run(&mut cpu, &[good], out).expect("a good task still runs");
    assert_eq!(read_f32(&mut cpu, other, 0, 8), [1f32.exp(); 8]);
}

#[test]
fn own_thread_pools_give_bit_identical_results() {
    let c = case(60, |g, l| {
        let w = l.random(g.parameter("w", F16, [96, 200, 1, 1])?);
        let x = l.random(g.input("x", F32, [96, 40, 1, 1])?);
        let y = g.mul_mat(w, x)?;
        let v = l.random(g.input("v", F32, [96, 3, 1, 1])?);
        let z = g.mul_mat(w, v)?;
        let s = g.softmax(y, 0.1, None)?;
        let n = g.rms_norm(y, 1e-6)?;
        let t = g.transpose(y)?;
        let r = g.sum_rows(t)?;
        Ok(vec![z, s, n, r])
    });
    let global = c.run(&mut CpuBackend::new(), 0).expect("global pool");
    for threads in [1, 3] {
        let mut cpu = CpuBackend::with_threads(threads).expect("pool");
        assert_eq!(cpu.num_threads(), threads);
        let got = c.run(&mut cpu, 0).expect("own pool");
        for (g, w) in got.iter().zip(&global) {
            assert!(g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits()), "{threads} threads differ");
        }
    }
}

#[test]
fn a_small_transformer_block_matches_the_reference() {
    check(61, 1e-10, |g, l| {
        let (d, t, ff) = (32, 5, 48);
        let x = l.random(g.input("x", F32, [d, t, 1, 1])?);
        let norm_w = l.random(g.parameter("norm", F32, [d, 1, 1, 1])?);
        let w_gu = l.random_in(g.parameter("gate_up", F16, [d, 2 * ff, 1, 1])?, -0.3, 0.3);
        let w_down = l.random_in(g.parameter("down", DType::BF16, [ff, d, 1, 1])?, -0.3, 0.3);
        let h = g.rms_norm(x, 1e-6)?;
        let h = g.mul(h, norm_w)?;
        let gu = g.mul_mat(w_gu, h)?;
        let act = g.swiglu_fused(gu)?;
        let down = g.mul_mat(w_down, act)?;
        let y = g.add(x, down)?;
        let logits = g.scale(y, 2.0)?;
        let p = g.softmax(logits, 1.0, None)?;
        Ok(vec![y, p, g.argmax(logits)?])
    });
}

#[test]
#[ignore = "timing, run by hand with --release"]
fn timing_row_ops() {
    use std::time::Instant;
    let (k, n) = (4096, 1024);
    type Build = fn(&mut tessera_graph::Graph, tessera_graph::Tensor) -> tessera_graph::Tensor;
    let ops: [(&str, Build); 8] = [
        ("add row-broadcast", |g, x| {
            let b = g.view(x, [4096, 1, 1, 1], [4, 16384, 16384, 16384], 0).unwrap();
            g.add(x, b).unwrap()
        }),
        ("silu", |g, x| g.silu(x).unwrap()),
        ("scale", |g, x| g.scale(x, 0.5).unwrap()),
        ("rms_norm", |g, x| g.rms_norm(x, 1e-6).unwrap()),
        ("softmax", |g, x| g.softmax(x, 1.0, None).unwrap()),
        ("sum_rows", |g, x| g.sum_rows(x).unwrap()),
        ("cast f16", |g, x| g.cast(x, F16).unwrap()),
        ("cont transposed", |g, x| {
            let t = g.transpose(x).unwrap();
            g.cont(t).unwrap()
        }),
    ];
    for (name, build) in ops {
        let mut g = tessera_graph::Graph::new();
        let x = g.input("x", F32, [k, n, 1, 1]).unwrap();
        let y = build(&mut g, x);
        g.mark_output(y).unwrap();
        let mut cpu = CpuBackend::new();
        let mut s = tessera_graph::Session::new(&g, &mut cpu).unwrap();
        s.set_f32(x, &vec![0.25; k * n]).unwrap();
        s.run().unwrap();
        let mut best = f64::INFINITY;
        for _ in 0..10 {
            let t = Instant::now();
            s.run().unwrap();
            best = best.min(t.elapsed().as_secs_f64());
        }
        let bytes = (k * n * 4 + y.meta().nbytes_contiguous()) as f64;
        println!("{name:>18}: {:8.1} us, {:6.1} GB/s", best * 1e6, bytes / best / 1e9);
    }
}
