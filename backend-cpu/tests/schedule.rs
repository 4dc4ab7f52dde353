//! A graph spread over two backends (`Session::scheduled`): ops the first refuses run on the
//! second, values cross through mirrors, and the results are those of one backend alone.

use smallvec::SmallVec;
use tessera_cpu::CpuBackend;
use tessera_graph::{Backend, ExecError, Graph, Refusing, Session, SessionOptions, Tensor};
use tessera_ops::DType::{F32, I32};

/// A CPU backend refusing some ops, as a GPU backend lacking a kernel would.
fn refusing(refuse: &[&str]) -> Refusing<CpuBackend> {
    Refusing::new(CpuBackend::new(), refuse)
}

/// x -> rms_norm -> mul w -> silu -> softmax -> (a view of it) -> mul_mat with w2, plus a state
/// row written in place; returns the graph, its leaves and outputs.
/// Leaves with the values to fill them with.
type Fills = Vec<(Tensor, Vec<f32>)>;

fn graph() -> (Graph, Fills, Vec<Tensor>) {
    let mut g = Graph::new();
    let x = g.input("x", F32, [8, 4, 1, 1]).unwrap();
    let w = g.parameter("w", F32, [8, 1, 1, 1]).unwrap();
    let w2 = g.parameter("w2", F32, [8, 3, 1, 1]).unwrap();
    let st = g.state("s", F32, [3, 6, 1, 1]).unwrap();
    let ids = g.input("ids", I32, [4, 1, 1, 1]).unwrap();
    let h = g.rms_norm(x, 1e-6).unwrap();
    let h = g.mul(h, w).unwrap();
    let h = g.silu(h).unwrap();
    let p = g.softmax(h, 1.0, None).unwrap();
    let v = g.view(p, [8, 2, 1, 1], p.meta().nb, 2 * 32).unwrap(); // rows 2..4
    let y = g.mul_mat(w2, p).unwrap(); // [3, 4]
    let yv = g.mul_mat(w2, v).unwrap(); // [3, 2]
    let s2 = g.set_rows(st, y, ids).unwrap();
    for o in [y, yv, s2] {
        g.mark_output(o).unwrap();
    }
    let fill = |n: usize, k: f32| (0..n).map(|i| ((i * 7 % 13) as f32 - 6.0) * k).collect::<Vec<f32>>();
    let leaves = vec![(x, fill(32, 0.3)), (w, fill(8, 0.2)), (w2, fill(24, 0.1)), (st, vec![0.0; 18])];
    (g, leaves, vec![y, yv, s2, ids])
}

fn run(
    g: &Graph,
    leaves: &[(Tensor, Vec<f32>)],
    ids: Tensor,
    outs: &[Tensor],
    s: &mut Session<'_, '_>,
) -> Vec<Vec<f32>> {
    let _ = g;
    for (t, v) in leaves {
        s.set_f32(*t, v).unwrap();
    }
    s.set_i32(ids, &[5, 0, 2, 3]).unwrap();
    s.run().unwrap();
    outs.iter().map(|o| s.get_f32(*o).unwrap()).collect()
}

#[test]
fn refused_ops_run_on_the_next_backend_with_the_same_results() {
    let (g, leaves, outs) = graph();
    let ids = outs[3];
    let outs = &outs[..3];
    let mut alone = CpuBackend::new();
    let want = {
        let mut s = Session::new(&g, &mut alone).unwrap();
        run(&g, &leaves, ids, outs, &mut s)
    };
    for refuse in [&["softmax"][..], &["rms_norm", "mul_mat"], &["silu", "mul"], &["mul_mat"]] {
        let mut first = refusing(refuse);
        let mut second = CpuBackend::new();
        let got = {
            let mut s = Session::scheduled(&g, vec![&mut first, &mut second], SessionOptions::default(), &[]).unwrap();
            assert!(s.segments() >= 2, "{refuse:?}: {} segments", s.segments());
            let home = &s.plan().home;
            for n in g.live_nodes() {
                if let Some(op) = g.node(n).op().filter(|o| !o.is_view()) {
                    assert_eq!(
                        home[n.index()] == 1,
                        refuse.contains(&op.name()),
                        "{refuse:?}: {op} on {}",
                        home[n.index()]
                    );
                }
            }
            let r = run(&g, &leaves, ids, outs, &mut s);
            // twice: mirrors are refreshed every run
            let again = run(&g, &leaves, ids, outs, &mut s);
            assert_eq!(r, again);
            r
        };
        assert_eq!(got, want, "{refuse:?}");
        assert_eq!(first.inner.allocated(), 0, "the first backend's buffers were freed");
        assert_eq!(second.allocated(), 0, "the second backend's buffers were freed");
    }
}

#[test]
fn an_in_place_write_is_never_moved_off_its_state() {
    let (g, ..) = graph();
    let mut first = refusing(&["set_rows"]);
    let mut second = CpuBackend::new();
    let e = Session::scheduled(&g, vec![&mut first, &mut second], SessionOptions::default(), &[])
        .err()
        .expect("set_rows must run where the state lives");
    assert!(matches!(&e, ExecError::Unsupported { op, backend, .. } if op == "set_rows" && backend == "cpu"), "{e}");
}

#[test]
fn an_op_no_backend_supports_is_named() {
    let (g, ..) = graph();
    let mut first = refusing(&["softmax"]);
    let mut second = refusing(&["softmax"]);
    let e = Session::scheduled(&g, vec![&mut first, &mut second], SessionOptions::default(), &[])
        .err()
        .expect("nobody runs softmax");
    assert!(matches!(&e, ExecError::Unsupported { op, .. } if op.starts_with("softmax")), "{e}");
    let none: Vec<&mut dyn Backend> = Vec::new();
    assert!(matches!(Session::scheduled(&g, none, SessionOptions::default(), &[]), Err(ExecError::NoBackend)));
}

#[test]
fn guards_hold_across_backends() {
    let (g, leaves, outs) = graph();
    let ids = outs[3];
    let mut first = refusing(&["silu"]);
    let mut second = CpuBackend::new();
    let opts = SessionOptions { guard_bytes: 32, ..Default::default() };
    let mut s = Session::scheduled(&g, vec![&mut first, &mut second], opts, &[]).unwrap();
    let got = run(&g, &leaves, ids, &outs[..3], &mut s);
    let metas: SmallVec<[usize; 3]> = got.iter().map(Vec::len).collect();
    assert_eq!(metas.as_slice(), &[12, 6, 18]);
}
