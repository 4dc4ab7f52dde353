//! `elementwise`: a fused chain of unary / binary / scale ops as one [`ElemProgram`].
//!
//! The rules are those of the chain it replaces narrowed to what `elementwise_chains` emits: f32
//! inputs (the chain would round to a half input's dtype in between), any strides, and ggml's
//! repeat rule between every input and the output, whose shape is the per-dimension largest
//! input's (in a chain that is the shape of its last op).

use super::elementwise::unary_flops;
use super::{can_repeat, contiguous, expect_dtype};
use crate::{DType, ElemInstr, ElemProgram, Op, OpError, TensorMeta};

const ARITY: [&str; 7] = ["0", "1", "2", "3", "4", "5", "6"];

pub(super) fn infer(op: &Op, inputs: &[&TensorMeta]) -> Result<TensorMeta, OpError> {
    let Op::Elementwise(p) = op else { unreachable!("elemfuse::infer called for {op}") };
    let n = p.n_inputs();
    if inputs.len() != n {
        return Err(OpError::Arity { op: op.name(), expected: ARITY[n.min(6)], got: inputs.len() });
    }
    let mut ne = [1usize; 4];
    for (i, m) in inputs.iter().enumerate() {
        expect_dtype(op, i, m, DType::F32, "f32")?;
        for (n, &d) in ne.iter_mut().zip(&m.ne) {
            *n = (*n).max(d);
        }
    }
    for m in inputs {
        if !can_repeat(&m.ne, &ne) {
            return Err(OpError::ShapeMismatch {
                op: op.name(),
                lhs: ne,
                rhs: m.ne,
                why: "each dimension of every input must divide the output's (the largest input's)".into(),
            });
        }
    }
    contiguous(op, DType::F32, ne)
}

/// The flops of the ops the program replaces, each over the whole output (rules/mod.rs counts:
/// unary per function, binary 1, scale 2 per element).
pub(super) fn flops(p: &ElemProgram, out: &TensorMeta) -> u64 {
    let per: u64 = p
        .instrs()
        .iter()
        .map(|i| match i {
            ElemInstr::Unary(u, _) => unary_flops(*u),
            ElemInstr::Binary(..) => 1,
            ElemInstr::Scale(..) => 2,
        })
        .sum();
    (out.nelements() as u64).saturating_mul(per)
}

#[cfg(test)]
mod tests {
    use crate::{BinaryOp, DType, ElemArg, ElemInstr, ElemProgram, Op, OpError, TensorMeta, UnaryOp, cost, infer};

    fn f32s(ne: [usize; 4]) -> TensorMeta {
        TensorMeta::contiguous("t", DType::F32, ne).unwrap()
    }

    /// `mul(softplus(add(x0, x1)), x2)`: the DeltaNet decay.
    fn decay() -> Op {
        use ElemArg::{Input as X, Value as V};
        Op::Elementwise(
            ElemProgram::new(
                3,
                vec![
                    ElemInstr::Binary(BinaryOp::Add, X(0), X(1)),
                    ElemInstr::Unary(UnaryOp::Softplus, V(0)),
                    ElemInstr::Binary(BinaryOp::Mul, V(1), X(2)),
                ],
            )
            .unwrap(),
        )
    }

    #[test]
    fn the_output_is_the_largest_input_and_every_input_broadcasts() {
        let op = decay();
        let (alpha, bias) = (f32s([32, 7, 1, 1]), f32s([32, 1, 1, 1]));
        let out = infer(&op, &[&alpha, &bias, &bias]).unwrap();
        assert_eq!((out.dtype, out.ne), (DType::F32, [32, 7, 1, 1]));
        assert!(out.is_contiguous());
        // the largest shape may come from any input, and per dimension from different ones
        assert_eq!(infer(&op, &[&bias, &bias, &alpha]).unwrap().ne, [32, 7, 1, 1]);
        assert_eq!(infer(&op, &[&f32s([1, 7, 1, 1]), &bias, &bias]).unwrap().ne, [32, 7, 1, 1]);
        // strided inputs are fine
        let mut t = f32s([7, 32, 1, 1]);
        t.ne = [32, 7, 1, 1];
        t.nb = [4 * 7, 4, 4 * 7 * 32, 4 * 7 * 32];
        assert!(infer(&op, &[&t, &bias, &bias]).is_ok());
        let err = |inputs: &[&TensorMeta]| infer(&op, inputs).unwrap_err();
        assert!(matches!(err(&[&alpha, &bias]), OpError::Arity { .. }));
        assert!(matches!(err(&[&alpha, &f32s([5, 1, 1, 1]), &bias]), OpError::ShapeMismatch { .. }));
        let half = TensorMeta::contiguous("t", DType::F16, [32, 1, 1, 1]).unwrap();
        assert!(matches!(err(&[&alpha, &bias, &half]), OpError::DType { input: 2, .. }));
    }

    #[test]
    fn cost_is_the_replaced_ops() {
        let op = decay();
        let (alpha, bias) = (f32s([32, 7, 1, 1]), f32s([32, 1, 1, 1]));
        let out = infer(&op, &[&alpha, &bias, &bias]).unwrap();
        let c = cost(&op, &[&alpha, &bias, &bias], &out);
        assert_eq!(c.flops, 224 * (1 + 6 + 1));
        assert_eq!(c.bytes, 4 * (224 + 32 + 32 + 224));
    }
}
