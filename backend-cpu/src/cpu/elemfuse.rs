//! `elementwise`: a fused chain of unary / binary / scale ops ([`ElemProgram`]), row by row.
//!
//! Each output row is computed as the unfused ops would compute it: every input's row is read
//! (tiled along `ne0` and picked by `i mod ne` in the other dimensions, ggml's repeat rule), then
//! each instruction runs over the row with the same f32 function and loop helpers as this
//! backend's elementwise kernels ([`super::elementwise`], [`super::math`]), so the fused op gives
//! the unfused graph's bits (tested below). An input one element wide (`ne0 = 1`, a per-token
//! gate) stays one element, and so does every instruction on such values only: computed once per
//! row, as the unfused op on the narrow tensor computed it, then broadcast like binary's scalar
//! operand. Intermediates live in per-task scratch rows; the last instruction writes the output
//! row.

use smallvec::SmallVec;
use tessera_ops::{BinaryOp, ElemArg, ElemInstr, ElemProgram, UnaryOp};

use super::elementwise::softplus;
use super::math::{exp, map, sigmoid, silu, zip};
use super::strided::{Dst, Src, row_coords};

/// Per-task scratch: each input's row tiled to `ne0`, each instruction's result row, the output
/// row when it cannot be written in place.
#[derive(Default)]
struct Scratch {
    inputs: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    out: Vec<f32>,
}

/// `out = instr(a, b)` over a row (`b` only for binary instructions). `out` is as long as the
/// longer operand; a binary operand of one element is broadcast (as binary's kernel does).
fn apply(ins: &ElemInstr, out: &mut [f32], a: &[f32], b: &[f32]) {
    if let ElemInstr::Binary(op, _, _) = *ins
        && a.len() != b.len()
    {
        let f = |x: f32, y: f32| match op {
            BinaryOp::Add => x + y,
            BinaryOp::Sub => x - y,
            BinaryOp::Mul => x * y,
            BinaryOp::Div => x / y,
        };
        return match (a, b) {
            (_, [y]) => map(out, a, |x| f(x, *y)),
            ([x], _) => map(out, b, |y| f(*x, y)),
            _ => unreachable!("operands are one element or the whole row"),
        };
    }
    match *ins {
        ElemInstr::Unary(u, _) => match u {
            UnaryOp::Neg => map(out, a, |v| -v),
            UnaryOp::Exp => map(out, a, exp),
            UnaryOp::Silu => map(out, a, silu),
            UnaryOp::Sigmoid => map(out, a, sigmoid),
            UnaryOp::Softplus => map(out, a, softplus),
        },
        ElemInstr::Binary(op, _, _) => match op {
            BinaryOp::Add => zip(out, a, b, |x, y| x + y),
            BinaryOp::Sub => zip(out, a, b, |x, y| x - y),
            BinaryOp::Mul => zip(out, a, b, |x, y| x * y),
            BinaryOp::Div => zip(out, a, b, |x, y| x / y),
        },
        ElemInstr::Scale(p, _) => {
            let (s, bias) = (p.scale, p.bias);
            map(out, a, move |v| v * s + bias)
        }
    }
}

/// The row of `x` that output row `c` reads (ggml's repeat rule: `i mod ne` in each dimension).
fn broadcast_row(x: &Src<'_>, c: [usize; 3]) -> [usize; 3] {
    let xne = x.ne();
    [c[0] % xne[1], c[1] % xne[2], c[2] % xne[3]]
}

/// Loads row `cx` of `x` into `buf`, tiled to `ne0` elements (one element stays one).
fn load_tiled(x: &Src<'_>, cx: [usize; 3], ne0: usize, buf: &mut Vec<f32>) {
    let xne = x.ne();
    let ne0 = if xne[0] == 1 { 1 } else { ne0 };
    buf.resize(ne0, 0.0);
    x.load_row(cx, &mut buf[..xne[0]]);
    for i in xne[0]..ne0 {
        buf[i] = buf[i - xne[0]];
    }
}

pub(super) fn elementwise(p: &ElemProgram, xs: &[Src<'_>], dst: &mut Dst<'_>) {
    let ne = dst.ne();
    let ne0 = ne[0];
    let instrs = p.instrs();
    let last = instrs.len() - 1;
    // How long each instruction's row is: 1 when it reads only one-element values, else ne0.
    let mut width = Vec::with_capacity(instrs.len());
    for ins in instrs {
        let w = ins.args().fold(1, |w, a| match a {
            ElemArg::Input(i) if xs[i as usize].ne()[0] == 1 => w,
            ElemArg::Input(_) => ne0,
            ElemArg::Value(v) => w.max(width[v as usize]),
        });
        width.push(w);
    }
    dst.for_each_row((instrs.len() + xs.len()) * ne0, Scratch::default, |s, r, mut row| {
        let Scratch { inputs, values, out } = s;
        let c = row_coords(ne, r);
        inputs.resize_with(xs.len(), Vec::new);
        values.resize_with(last, Vec::new);
        // Inputs of the output's full row width are borrowed when dense aligned f32.
        let mut rows: SmallVec<[&[f32]; 6]> = SmallVec::new();
        for (x, buf) in xs.iter().zip(inputs.iter_mut()) {
            let cx = broadcast_row(x, c);
            match x.row_f32(cx).filter(|_| x.ne()[0] == ne0) {
                Some(v) => rows.push(v),
                None => {
                    load_tiled(x, cx, ne0, buf);
                    rows.push(buf);
                }
            }
        }
        for (v, &w) in values.iter_mut().zip(&width) {
            v.resize(w, 0.0);
        }
        for (k, ins) in instrs[..last].iter().enumerate() {
            let (done, rest) = values.split_at_mut(k);
            let arg = |a: ElemArg| -> &[f32] {
                match a {
                    ElemArg::Input(i) => rows[i as usize],
                    ElemArg::Value(v) => &done[v as usize],
                }
            };
            let mut args = ins.args().map(arg);
            let a = args.next().expect("an instruction has an operand");
            apply(ins, &mut rest[0], a, args.next().unwrap_or(&[]));
        }
        let ins = &instrs[last];
        let arg = |a: ElemArg| -> &[f32] {
            match a {
                ElemArg::Input(i) => rows[i as usize],
                ElemArg::Value(v) => &values[v as usize],
            }
        };
        let mut args = ins.args().map(arg);
        let a = args.next().expect("an instruction has an operand");
        let b = args.next().unwrap_or(&[]);
        row.fill_f32(out, |o| {
            if width[last] == o.len() {
                return apply(ins, o, a, b);
            }
            // One value for the whole row (the program reads its wide inputs only in dead code).
            let mut one = [0.0];
            apply(ins, &mut one, a, b);
            o.fill(one[0]);
        });
    });
}

#[cfg(test)]
mod tests {
    use tessera_graph::{Graph, GraphError, Tensor};
    use tessera_ops::{BinaryOp, ElemArg, ElemInstr, ElemProgram, ScaleParams, UnaryOp};

    use crate::CpuBackend;
    use crate::cpu::testutil::{F32, Rng, case, check};

    /// Can `small` be tiled to `big` (ggml's repeat rule)?
    fn repeats(small: [usize; 4], big: [usize; 4]) -> bool {
        small.iter().zip(&big).all(|(s, b)| b % s == 0)
    }

    /// A random program over inputs of `shapes` (`shapes[0]` the output's) that the unfused ops
    /// can also compute: a binary op's second operand broadcasts to its first, `exp` reads only
    /// inputs and `div` divides only by inputs (the test data keeps them in [0.25, 2), so nothing
    /// overflows or divides by almost zero), every input is read, and the result has the output's
    /// shape.
    fn random_program(rng: &mut Rng, shapes: &[[usize; 4]], n_instrs: usize) -> ElemProgram {
        let mut pool: Vec<(ElemArg, [usize; 4])> =
            shapes.iter().enumerate().map(|(i, &s)| (ElemArg::Input(i as u8), s)).collect();
        let mut instrs = Vec::new();
        let push = |instrs: &mut Vec<ElemInstr>, pool: &mut Vec<(ElemArg, [usize; 4])>, ins, ne| {
            pool.push((ElemArg::Value(instrs.len() as u8), ne));
            instrs.push(ins);
        };
        for _ in 0..n_instrs {
            let (a, ne) = pool[rng.below(pool.len())];
            match rng.below(3) {
                0 => {
                    let u = UnaryOp::ALL[rng.below(UnaryOp::ALL.len())];
                    let u = if u == UnaryOp::Exp && !matches!(a, ElemArg::Input(_)) { UnaryOp::Sigmoid } else { u };
                    push(&mut instrs, &mut pool, ElemInstr::Unary(u, a), ne);
                }
                1 => {
                    let op = BinaryOp::ALL[rng.below(4)];
                    let fits: Vec<_> = pool
                        .iter()
                        .filter(|(b, bne)| repeats(*bne, ne) && (op != BinaryOp::Div || matches!(b, ElemArg::Input(_))))
                        .collect();
                    let (b, _) = *fits[rng.below(fits.len())];
                    push(&mut instrs, &mut pool, ElemInstr::Binary(op, a, b), ne);
                }
                _ => {
                    let p = [(0.5, 0.0), (-1.5, 0.25), (2.0, -1.0)][rng.below(3)];
                    push(&mut instrs, &mut pool, ElemInstr::Scale(ScaleParams { scale: p.0, bias: p.1 }, a), ne);
                }
            }
        }
        // Every input read; the result of the output's shape.
        let read = |instrs: &[ElemInstr], i: u8| instrs.iter().any(|x| x.args().any(|a| a == ElemArg::Input(i)));
        for i in 0..shapes.len() as u8 {
            if !read(&instrs, i) || instrs.is_empty() {
                let last = pool.last().copied().filter(|(_, ne)| *ne == shapes[0]).map_or(ElemArg::Input(0), |p| p.0);
                push(&mut instrs, &mut pool, ElemInstr::Binary(BinaryOp::Mul, last, ElemArg::Input(i)), shapes[0]);
            }
        }
        if pool.last().expect("inputs").1 != shapes[0] {
            let last = pool.last().expect("inputs").0;
            push(&mut instrs, &mut pool, ElemInstr::Binary(BinaryOp::Add, ElemArg::Input(0), last), shapes[0]);
        }
        ElemProgram::new(shapes.len(), instrs).expect("a valid program")
    }

    /// Runs `p` fused and unfused on the CPU on inputs of `shapes` (each made strided when its
    /// flag says so): the same bits; then the fused op against the f64 reference.
    fn same_bits_as_the_ops(seed: u64, p: &ElemProgram, shapes: &[[usize; 4]], strided: &[bool]) {
        let build = |g: &mut Graph, l: &mut crate::cpu::testutil::Leaves| -> Result<Vec<Tensor>, GraphError> {
            let mut xs = Vec::new();
            for (&ne, &st) in shapes.iter().zip(strided) {
                let x = if st {
                    let t = l.random_in(g.input("t", F32, [ne[1], ne[0], ne[2], ne[3]])?, 0.25, 2.0);
                    g.transpose(t)?
                } else {
                    l.random_in(g.input("x", F32, ne)?, 0.25, 2.0)
                };
                xs.push(x);
            }
            let fused = g.elementwise(p.clone(), &xs)?;
            Ok(vec![fused, g.elementwise_unfused(p, &xs)?])
        };
        let outs = case(seed, build).run(&mut CpuBackend::new(), 0).expect("cpu run");
        let same = outs[0].iter().zip(&outs[1]).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same, "{p}: the fused op differs from its ops");
        check(seed, 1e-10, |g, l| Ok(vec![build(g, l)?[0]]));
    }

    #[test]
    fn the_model_chains_are_their_ops_bit_for_bit() {
        use ElemArg::{Input as X, Value as V};
        // DeltaNet decay mul(softplus(add(alpha, dt_bias)), a), per-head vectors [32]
        let decay = ElemProgram::new(
            3,
            vec![
                ElemInstr::Binary(BinaryOp::Add, X(0), X(1)),
                ElemInstr::Unary(UnaryOp::Softplus, V(0)),
                ElemInstr::Binary(BinaryOp::Mul, V(1), X(2)),
            ],
        )
        .unwrap();
        same_bits_as_the_ops(60, &decay, &[[32, 5, 1, 1], [32, 1, 1, 1], [32, 1, 1, 1]], &[false; 3]);
        // the shared-expert gate add(moe, mul(sh, sigmoid(gate))), gate [1, n]
        let gate = ElemProgram::new(
            3,
            vec![
                ElemInstr::Unary(UnaryOp::Sigmoid, X(2)),
                ElemInstr::Binary(BinaryOp::Mul, X(1), V(0)),
                ElemInstr::Binary(BinaryOp::Add, X(0), V(1)),
            ],
        )
        .unwrap();
        same_bits_as_the_ops(61, &gate, &[[64, 3, 1, 1], [64, 3, 1, 1], [1, 3, 1, 1]], &[false, true, false]);
    }

    #[test]
    fn random_programs_are_their_ops_bit_for_bit() {
        let mut rng = Rng::new(62);
        let shape_sets: [&[[usize; 4]]; 6] = [
            &[[37, 3, 2, 1], [37, 3, 2, 1]],
            &[[37, 3, 2, 1], [37, 1, 1, 1], [1, 3, 2, 1]],
            &[[16, 4, 3, 2], [16, 4, 3, 2], [4, 1, 3, 1], [1, 1, 1, 1]],
            &[[8, 5, 1, 1], [8, 5, 1, 1], [8, 1, 1, 1], [1, 5, 1, 1], [2, 1, 1, 1]],
            &[[33, 2, 2, 1], [33, 2, 2, 1], [33, 2, 2, 1], [1, 2, 1, 1], [33, 1, 2, 1], [11, 1, 1, 1]],
            &[[1, 1, 1, 1], [1, 1, 1, 1]],
        ];
        for (k, shapes) in shape_sets.iter().enumerate() {
            for depth in 2..=6 {
                let p = random_program(&mut rng, shapes, depth);
                let strided: Vec<bool> = (0..shapes.len()).map(|i| (i + depth) % 3 == 0).collect();
                same_bits_as_the_ops(63 + (k * 10 + depth) as u64, &p, shapes, &strided);
            }
        }
    }
}
