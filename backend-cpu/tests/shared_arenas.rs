//! Executables placed in shared arenas (a model's step graphs): run in turns they give what
//! each gives placed alone, the arena is the largest plan and a quarter (not the sum), a larger
//! plan replaces it and makes the executables placed before stale, and guard bytes are refused.

use tessera_cpu::CpuBackend;
use tessera_graph::{Backend, ExecError, Executable, Graph, SessionOptions, SharedArenas, Tensor};
use tessera_ops::DType;

/// `y = sum_rows(silu(x) * x + x)` over `[n, rows]`: intermediates that need an arena.
fn chain(n: usize, rows: usize) -> (Graph, Tensor, Tensor) {
    let mut g = Graph::new();
    let x = g.input("x", DType::F32, [n, rows, 1, 1]).unwrap();
    let s = g.silu(x).unwrap();
    let p = g.mul(s, x).unwrap();
    let q = g.add(p, x).unwrap();
    let y = g.sum_rows(q).unwrap();
    g.mark_output(y).unwrap();
    (g, x, y)
}

fn values(n: usize, seed: f32) -> Vec<f32> {
    (0..n).map(|i| (i as f32 * 0.37 + seed).sin() * 3.0).collect()
}

/// Sets `x`, runs, reads `y`.
fn run(exe: &mut Executable, cpu: &mut CpuBackend, x: Tensor, y: Tensor, input: &[f32]) -> Vec<f32> {
    let mut s = exe.session(cpu);
    s.set_f32(x, input).unwrap();
    s.run().unwrap();
    s.get_f32(y).unwrap()
}

#[test]
fn executables_in_turns_equal_each_alone_in_one_arena_as_large_as_the_largest() {
    let mut cpu = CpuBackend::new();
    let opts = SessionOptions::default();
    let (small, xs, ys) = chain(64, 3);
    let (big, xb, yb) = chain(256, 9);
    let want_small: Vec<Vec<f32>> = (0..3)
        .map(|k| {
            let mut alone = Executable::new(small.clone(), &mut cpu, opts, &[]).unwrap();
            let y = run(&mut alone, &mut cpu, xs, ys, &values(64 * 3, k as f32));
            alone.free(&mut [&mut cpu]);
            y
        })
        .collect();
    let want_big: Vec<Vec<f32>> = (0..3)
        .map(|k| {
            let mut alone = Executable::new(big.clone(), &mut cpu, opts, &[]).unwrap();
            let y = run(&mut alone, &mut cpu, xb, yb, &values(256 * 9, 10.0 + k as f32));
            alone.free(&mut [&mut cpu]);
            y
        })
        .collect();

    let mut shared = SharedArenas::new();
    let mut a = Executable::scheduled_shared(small.clone(), &mut [&mut cpu], opts, &[], &mut shared).unwrap();
    assert_eq!(a.arena_generation(), Some(shared.generation()));
    let b = Executable::scheduled_shared(big.clone(), &mut [&mut cpu], opts, &[], &mut shared).unwrap();
    // The larger plan replaced the arena: the first executable is stale and is placed again.
    assert_eq!(b.arena_generation(), Some(shared.generation()));
    assert_ne!(a.arena_generation(), Some(shared.generation()));
    a.free(&mut [&mut cpu]);
    let mut a = Executable::scheduled_shared(small, &mut [&mut cpu], opts, &[], &mut shared).unwrap();
    let mut b = b;
    assert_eq!(a.arena_generation(), b.arena_generation());

    let (pa, pb) = (a.plan().stats.arena_bytes, b.plan().stats.arena_bytes);
    assert!(pa > 0 && pb > pa, "arenas {pa} and {pb}");
    // the largest plan and a quarter of headroom, whatever the other plans need
    assert_eq!(shared.bytes(), pb + pb / 4, "shared arena for plans {pa} and {pb}");

    for k in 0..3 {
        assert_eq!(run(&mut a, &mut cpu, xs, ys, &values(64 * 3, k as f32)), want_small[k], "small, turn {k}");
        assert_eq!(run(&mut b, &mut cpu, xb, yb, &values(256 * 9, 10.0 + k as f32)), want_big[k], "big, turn {k}");
    }
    a.free(&mut [&mut cpu]);
    b.free(&mut [&mut cpu]);
    let generation = shared.generation();
    shared.free(&mut [&mut cpu]);
    assert_eq!(shared.bytes(), 0);
    assert!(shared.generation() > generation, "freeing makes every executable placed before stale");
}

#[test]
fn guard_bytes_need_an_arena_of_their_own() {
    let mut cpu = CpuBackend::new();
    let (g, _, _) = chain(16, 2);
    let mut shared = SharedArenas::new();
    let opts = SessionOptions { guard_bytes: 64, ..SessionOptions::default() };
    let backends: &mut [&mut dyn Backend] = &mut [&mut cpu];
    let err = Executable::scheduled_shared(g, backends, opts, &[], &mut shared).unwrap_err();
    assert!(matches!(err, ExecError::SharedArenaGuards), "{err}");
    assert_eq!(shared.bytes(), 0);
}
