//! Reference `elementwise`: the program as the ops it replaces. Every input is first tiled to
//! the output's shape (ggml's repeat rule; this changes no value), then each instruction runs as
//! its own op's reference ([`super::compute`] of `unary`, `binary` or `scale`) on whole tensors,
//! so the definition of the fused op is literally that composition. Intermediates stay in f64.

use super::{RefTensor, compute};
use crate::{ElemInstr, KernelError, Op, TensorMeta};

pub(super) fn compute_program(op: &Op, inputs: &[RefTensor], out: &TensorMeta) -> Result<RefTensor, KernelError> {
    let Op::Elementwise(p) = op else { unreachable!("reference elemfuse::compute_program called for {op}") };
    let tiled: Vec<RefTensor> = inputs.iter().map(|x| tile(x, out.ne)).collect();
    let mut failed = None;
    let y = p.eval(&tiled, |ins, args| {
        let op = match *ins {
            ElemInstr::Unary(u, _) => Op::Unary(u),
            ElemInstr::Binary(b, _, _) => Op::Binary(b),
            ElemInstr::Scale(s, _) => Op::Scale(s),
        };
        let args: Vec<RefTensor> = args.iter().map(|t| (*t).clone()).collect();
        compute(&op, &args, out).unwrap_or_else(|e| {
            failed.get_or_insert(e);
            RefTensor::zeros(out.ne)
        })
    });
    match failed {
        Some(e) => Err(e),
        None => Ok(y),
    }
}

/// `x` repeated to shape `ne` (each `x.ne[i]` divides `ne[i]`).
fn tile(x: &RefTensor, ne: [usize; 4]) -> RefTensor {
    if x.ne == ne {
        return x.clone();
    }
    let data = RefTensor::indices(ne).map(|i| x.at([i[0] % x.ne[0], i[1] % x.ne[1], i[2] % x.ne[2], i[3] % x.ne[3]]));
    RefTensor::new(ne, data.collect())
}

#[cfg(test)]
mod tests {
    use crate::reference::testutil::{assert_close, run};
    use crate::{BinaryOp, ElemArg, ElemInstr, ElemProgram, Op, ScaleParams, UnaryOp};

    #[test]
    fn a_program_equals_its_ops_with_broadcasting() {
        use ElemArg::{Input as X, Value as V};
        // mul(sigmoid(scale(x1, 2, 1)), x0) - x2: x1 a column, x2 a scalar
        let p = ElemProgram::new(
            3,
            vec![
                ElemInstr::Scale(ScaleParams { scale: 2.0, bias: 1.0 }, X(1)),
                ElemInstr::Unary(UnaryOp::Sigmoid, V(0)),
                ElemInstr::Binary(BinaryOp::Mul, V(1), X(0)),
                ElemInstr::Binary(BinaryOp::Sub, V(2), X(2)),
            ],
        )
        .unwrap();
        let x0 = vec![1., 2., 3., 4., 5., 6.];
        let (x1, x2) = (vec![0.5, -1.0], vec![0.25]);
        let y = run(&Op::Elementwise(p), &[([3, 2, 1, 1], x0.clone()), ([1, 2, 1, 1], x1.clone()), ([1, 1, 1, 1], x2)]);
        assert_eq!(y.ne, [3, 2, 1, 1]);
        let sig = |v: f64| 1. / (1. + (-v).exp());
        let want: Vec<f64> = (0..6).map(|i| sig(2. * x1[i / 3] + 1.) * x0[i] - 0.25).collect();
        assert_close(&y.data, &want);
    }
}
