//! A graph rewritten with `Graph::replace` runs: users read the new op's result, and nodes only
//! the old op read are neither placed nor run. (The rewrite rules themselves are tested in
//! `graph/tests/rewrite.rs`.)

use tessera_cpu::CpuBackend;
use tessera_graph::{ExecError, Graph, Session, Tensor};
use tessera_ops::{DType, Op, UnaryOp};

const X: [f32; 12] = [0.5, -1.0, 2.0, 0.0, -0.25, 1.5, 3.0, -2.0, 0.75, -0.5, 1.0, 0.125];

/// `y = exp(neg(neg(x)))`, `x [4, 3]`; returns `(graph, x, inner neg, outer neg, y)`.
fn double_neg() -> (Graph, Tensor, Tensor, Tensor, Tensor) {
    let mut g = Graph::new();
    let x = g.input("x", DType::F32, [4, 3, 1, 1]).unwrap();
    let n1 = g.neg(x).unwrap();
    let n2 = g.neg(n1).unwrap();
    let y = g.exp(n2).unwrap();
    g.mark_output(y).unwrap();
    (g, x, n1, n2, y)
}

fn run(g: &Graph, x: Tensor, y: Tensor) -> Vec<f32> {
    let mut cpu = CpuBackend::new();
    let mut s = Session::new(g, &mut cpu).unwrap();
    s.set_f32(x, &X).unwrap();
    s.run().unwrap();
    s.get_f32(y).unwrap()
}

#[test]
fn double_negation_replaced_by_a_copy_gives_the_same_result() {
    let (g, x, _, _, y) = double_neg();
    let before = run(&g, x, y);

    let (mut g, x, n1, n2, y) = double_neg();
    g.replace(n2.id(), Op::Cont, &[x]).unwrap();
    assert_eq!(g.live_nodes(), vec![x.id(), n2.id(), y.id()]);
    let after = run(&g, x, y);
    assert_eq!(after, before, "neg(neg(x)) and cont(x) are both x exactly");
    let want: Vec<f32> = X.iter().map(|v| v.exp()).collect();
    assert!(after.iter().zip(&want).all(|(a, w)| (a - w).abs() <= 1e-6 * w.abs()), "{after:?}");

    // The inner neg is dead: never placed, so there is nothing to read.
    let mut cpu = CpuBackend::new();
    let mut s = Session::new(&g, &mut cpu).unwrap();
    s.set_f32(x, &X).unwrap();
    s.run().unwrap();
    assert!(matches!(s.get_f32(n1), Err(ExecError::NotComputed { node }) if node == n1.id()));
}

#[test]
fn users_read_the_new_op() {
    // Replace the outer neg by exp(x): y becomes exp(exp(x)).
    let (mut g, x, _, n2, y) = double_neg();
    g.replace(n2.id(), Op::Unary(UnaryOp::Exp), &[x]).unwrap();
    let got = run(&g, x, y);
    let want: Vec<f32> = X.iter().map(|v| v.exp().exp()).collect();
    assert!(got.iter().zip(&want).all(|(a, w)| (a - w).abs() <= 1e-5 * w.abs()), "{got:?} vs {want:?}");
}
