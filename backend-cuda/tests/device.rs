//! The CUDA backend's machinery on a real GPU: the pool, CUDA graph capture/replay/update, the
//! kernel cache, out-of-memory recovery and device-side data errors. Every test skips with a
//! message when no GPU is usable (ops themselves are checked by `tessera-test-ops eval
//! --backend cuda`).

mod common;

use common::gpu;
use tessera_cuda::{CudaBackend, CudaError, CudaOptions};
use tessera_graph::{Backend, BackendError, ExecError, Graph, Session, Tensor};
use tessera_ops::{DType, KernelError};

#[test]
fn without_a_gpu_new_is_an_error_not_a_panic() {
    match CudaBackend::probe() {
        Ok(info) => eprintln!("GPU present: {info}"),
        Err(e) => {
            assert!(matches!(e, CudaError::NoGpu(_)), "{e:?}");
            assert!(e.to_string().starts_with("no usable GPU: "), "{e}");
        }
    }
}

/// y = (x + b) * 2, a three-node step.
fn small_graph() -> (Graph, Tensor, Tensor, Tensor) {
    let mut g = Graph::new();
    let x = g.input("x", DType::F32, [1000, 3, 1, 1]).unwrap();
    let b = g.parameter("b", DType::F32, [1000, 1, 1, 1]).unwrap();
    let s = g.add(x, b).unwrap();
    let y = g.scale(s, 2.0).unwrap();
    g.mark_output(y).unwrap();
    (g, x, b, y)
}

fn run_small(backend: &mut dyn Backend, xs: &[f32], bs: &[f32]) -> Vec<f32> {
    let (g, x, b, y) = small_graph();
    let mut s = Session::new(&g, backend).unwrap();
    s.set_f32(x, xs).unwrap();
    s.set_f32(b, bs).unwrap();
    s.run().unwrap();
    s.get_f32(y).unwrap()
}

#[test]
fn graphs_are_captured_once_then_replayed_or_updated_and_match_eager() {
    let Some(mut cuda) = gpu() else { return };
    let xs: Vec<f32> = (0..3000).map(|i| (i as f32 * 0.37).sin()).collect();
    let bs: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.11).cos()).collect();
    let want: Vec<f32> = (0..3000).map(|i| (xs[i] + bs[i % 1000]) * 2.0).collect();

    let first = run_small(&mut cuda, &xs, &bs);
    assert_eq!(first, want);
    let st = cuda.stats().graphs;
    assert_eq!((st.captures, st.replays), (1, 0), "{st:?}");

    // Same graph, same session: replay.
    let (g, x, b, y) = small_graph();
    let mut s = Session::new(&g, &mut cuda).unwrap();
    s.set_f32(x, &xs).unwrap();
    s.set_f32(b, &bs).unwrap();
    s.run().unwrap();
    s.run().unwrap();
    assert_eq!(s.get_f32(y).unwrap(), want);
    drop(s);
    let st = cuda.stats().graphs;
    assert!(st.replays >= 1, "{st:?}");
    assert_eq!(st.captures, 1, "same structure is never re-instantiated: {st:?}");

    // Eager gives bit-identical results.
    let mut eager = CudaBackend::with_options(CudaOptions { graphs: false, ..CudaOptions::default() }).unwrap();
    assert_eq!(run_small(&mut eager, &xs, &bs), want);
    assert_eq!(eager.stats().graphs.captures, 0);
    assert!(eager.stats().graphs.eager >= 1);
}

#[test]
fn the_pool_reuses_blocks_and_survives_out_of_memory() {
    let Some(mut cuda) = gpu() else { return };
    let a = cuda.alloc(3 << 20).unwrap();
    cuda.free(a);
    let b = cuda.alloc(3 << 20).unwrap();
    let st = cuda.stats().pool;
    assert!(st.reuses >= 1, "{st:?}");
    cuda.free(b);

    let total = cuda.info().total_memory;
    match cuda.alloc(total * 4) {
        Err(BackendError::OutOfMemory { requested, .. }) => assert_eq!(requested, total * 4),
        other => panic!("expected out of memory, got {other:?}"),
    }
    // Still works afterwards.
    let xs = vec![1.0f32; 3000];
    let bs = vec![0.5f32; 1000];
    assert!(run_small(&mut cuda, &xs, &bs).iter().all(|&v| v == 3.0));
}

#[test]
fn writes_through_pinned_staging_round_trip() {
    let Some(mut cuda) = gpu() else { return };
    let len = (40 << 20) + 12345; // several staging chunks and a ragged tail
    let data: Vec<u8> = (0..len).map(|i| (i * 7 + i / 977) as u8).collect();
    let buf = cuda.alloc(len + 64).unwrap();
    cuda.write(buf, 64, &data).unwrap();
    let mut back = vec![0u8; len];
    cuda.read(buf, 64, &mut back).unwrap();
    assert!(back == data, "staged upload corrupted data");
    assert!(cuda.write(buf, 65, &data).is_err(), "a write past the end is refused");
}

#[test]
fn a_bad_row_id_is_reported_at_the_next_read() {
    let Some(mut cuda) = gpu() else { return };
    let mut g = Graph::new();
    let table = g.parameter("t", DType::F32, [8, 5, 1, 1]).unwrap();
    let ids = g.input("ids", DType::I32, [3, 1, 1, 1]).unwrap();
    let rows = g.get_rows(table, ids).unwrap();
    g.mark_output(rows).unwrap();
    let mut s = Session::new(&g, &mut cuda).unwrap();
    s.set_f32(table, &[0.25; 40]).unwrap();
    s.set_i32(ids, &[1, 7, 0]).unwrap();
    s.run().unwrap();
    match s.get_f32(rows) {
        Err(ExecError::Backend(BackendError::Kernel(KernelError::IndexOutOfRange { op, index, limit, .. }))) => {
            assert_eq!((op, index, limit), ("get_rows", 7, 5));
        }
        other => panic!("expected an index error, got {other:?}"),
    }
    // The error was consumed; good ids work again.
    s.set_i32(ids, &[1, 4, 0]).unwrap();
    s.run().unwrap();
    assert_eq!(s.get_f32(rows).unwrap(), vec![0.25; 24]);
}

#[test]
fn kernels_load_from_the_disk_cache_in_a_second_backend() {
    if gpu().is_none() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("tessera-kernel-cache-test-{}", std::process::id()));
    // SAFETY (set_var): this test binary's other tests do not read the variable.
    unsafe { std::env::set_var("TESSERA_KERNEL_CACHE", &dir) };
    let mut first = CudaBackend::new().unwrap();
    first.warm_up().unwrap();
    let st = first.stats().compile;
    assert_eq!((st.compiled + st.cache_hits) as usize, tessera_cuda::Module::ALL.len(), "{st:?}");
    let mut second = CudaBackend::new().unwrap();
    second.warm_up().unwrap();
    let st = second.stats().compile;
    assert_eq!(st.compiled, 0, "{st:?}");
    assert_eq!(st.cache_hits as usize, tessera_cuda::Module::ALL.len());
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn every_kernel_module_compiles_with_nvrtc() {
    // Needs only libnvrtc (CI installs the wheel), not a GPU.
    match tessera_cuda::nvrtc_version() {
        Err(e) => eprintln!("skipping: {e}"),
        Ok(_) => {
            for m in tessera_cuda::Module::ALL {
                if let Err(e) = tessera_cuda::compile::compile(m, &tessera_cuda::compile::target(m, "sm_90", true)) {
                    panic!("{e}");
                }
            }
        }
    }
}
