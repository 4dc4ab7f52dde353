//! Generated `elementwise` kernels on a GPU: the fused programs against their unfused ops on the
//! same device (both kernels: float4 and rows), and the compile cache (a program compiles, or is
//! loaded from the disk cache, once per process however often it runs). test-ops judges the
//! programs against the CPU. Every test skips with a message when no GPU is usable.

mod common;

use common::{gpu, nmse};
use tessera_graph::{Backend, Graph, GraphError, Session, Tensor};
use tessera_ops::{BinaryOp, DType, ElemArg, ElemInstr, ElemProgram, ScaleParams, UnaryOp};

/// Deterministic values in [lo, hi).
fn values(n: usize, seed: u64, lo: f32, hi: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            lo + (hi - lo) * ((s.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40) as f32 / 16_777_216.0)
        })
        .collect()
}

/// The program as the unfused ops.
fn unfused(g: &mut Graph, p: &ElemProgram, x: &[Tensor]) -> Result<Tensor, GraphError> {
    let mut err = None;
    let y = p.eval(&x.iter().map(|&t| Some(t)).collect::<Vec<_>>(), |ins, args| {
        let a = (*args[0])?;
        let r = match *ins {
            ElemInstr::Unary(u, _) => g.unary(u, a),
            ElemInstr::Binary(op, _, _) => g.binary(op, a, (*args[1])?),
            ElemInstr::Scale(s, _) => g.scale_bias(a, s.scale, s.bias),
        };
        r.map_err(|e| err = Some(e)).ok()
    });
    y.ok_or_else(|| err.expect("a failed step records its error"))
}

/// `(program, input shapes, transpose input 1)`: the model chains and a 6-input program.
fn programs() -> Vec<(ElemProgram, Vec<[usize; 4]>, bool)> {
    use ElemArg::{Input as X, Value as V};
    let p = |n, instrs| ElemProgram::new(n, instrs).unwrap();
    let decay = p(
        3,
        vec![
            ElemInstr::Binary(BinaryOp::Add, X(0), X(1)),
            ElemInstr::Unary(UnaryOp::Softplus, V(0)),
            ElemInstr::Binary(BinaryOp::Mul, V(1), X(2)),
        ],
    );
    let shared = p(
        3,
        vec![
            ElemInstr::Unary(UnaryOp::Sigmoid, X(2)),
            ElemInstr::Binary(BinaryOp::Mul, X(1), V(0)),
            ElemInstr::Binary(BinaryOp::Add, X(0), V(1)),
        ],
    );
    let six = p(
        6,
        vec![
            ElemInstr::Unary(UnaryOp::Silu, X(0)),
            ElemInstr::Binary(BinaryOp::Sub, V(0), X(1)),
            ElemInstr::Unary(UnaryOp::Exp, X(2)),
            ElemInstr::Binary(BinaryOp::Div, V(1), X(3)),
            ElemInstr::Scale(ScaleParams { scale: -1.5, bias: 0.25 }, V(3)),
            ElemInstr::Binary(BinaryOp::Mul, V(4), V(2)),
            ElemInstr::Unary(UnaryOp::Neg, X(4)),
            ElemInstr::Binary(BinaryOp::Add, V(5), V(6)),
            ElemInstr::Binary(BinaryOp::Mul, V(7), X(5)),
        ],
    );
    vec![
        (decay.clone(), vec![[32, 512, 1, 1], [32, 1, 1, 1], [32, 1, 1, 1]], false),
        (decay, vec![[32, 7, 1, 1], [32, 1, 1, 1], [32, 1, 1, 1]], true),
        (shared.clone(), vec![[2048, 9, 1, 1], [2048, 9, 1, 1], [1, 9, 1, 1]], false),
        (shared, vec![[2048, 9, 1, 1], [2048, 9, 1, 1], [1, 9, 1, 1]], true),
        (six, vec![[64, 6, 2, 1], [64, 6, 2, 1], [64, 1, 1, 1], [1, 6, 2, 1], [16, 1, 2, 1], [1, 1, 1, 1]], false),
    ]
}

#[test]
fn programs_equal_their_ops_on_the_gpu_and_compile_once() {
    let Some(mut cuda) = gpu() else { return };
    for (k, (p, shapes, transpose)) in programs().into_iter().enumerate() {
        let mut g = Graph::new();
        let mut leaves = Vec::new();
        let mut xs = Vec::new();
        for (i, &ne) in shapes.iter().enumerate() {
            let t = i == 1 && transpose;
            let leaf_ne = if t { [ne[1], ne[0], ne[2], ne[3]] } else { ne };
            let leaf = g.input(&format!("x{i}"), DType::F32, leaf_ne).unwrap();
            leaves.push(leaf);
            xs.push(if t { g.transpose(leaf).unwrap() } else { leaf });
        }
        let fused = g.elementwise(p.clone(), &xs).unwrap();
        let again = g.elementwise(p.clone(), &xs).unwrap();
        let want = unfused(&mut g, &p, &xs).unwrap();
        for t in [fused, again, want] {
            g.mark_output(t).unwrap();
        }
        let before = cuda.counters();
        let mut s = Session::new(&g, &mut cuda).unwrap();
        for (i, &leaf) in leaves.iter().enumerate() {
            let n = leaf.meta().nelements();
            let (lo, hi) = if i == 3 { (0.5, 1.5) } else { (-2.0, 2.0) };
            s.set_f32(leaf, &values(n, (k * 10 + i) as u64, lo, hi)).unwrap();
        }
        s.run().unwrap();
        s.run().unwrap();
        let (a, b, w) = (s.get_f32(fused).unwrap(), s.get_f32(again).unwrap(), s.get_f32(want).unwrap());
        drop(s);
        let e = nmse(&a, &w);
        eprintln!("{p} {shapes:?}: nmse {e:e}, bit-identical {}", a == w);
        assert!(e <= 1e-12, "{p}: fused differs from its ops, nmse {e:e}");
        assert_eq!(a, b, "{p}: one program, one result");
        // Two nodes of the program, two runs: at most one generated module built or loaded.
        let count = |c: &[(&str, u64)]| {
            c.iter()
                .filter(|(n, _)| *n == "modules_compiled" || *n == "modules_from_cache")
                .map(|(_, v)| v)
                .sum::<u64>()
        };
        let new_modules = count(&cuda.counters()) - count(&before);
        assert!(new_modules <= 1 + u64::from(k == 0) * 2, "{p}: {new_modules} modules built or loaded");
    }
}
