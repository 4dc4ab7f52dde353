//! quantize, dequantize.
//!
//! `quantize(to)`: f32 `x` (dense rows, any outer strides, `ne[0]` a whole number of `to`'s
//! blocks) -> a contiguous tensor of dtype `to` (q8_0 or nvfp4), with the bytes
//! `tessera_ops::quant` writes. `dequantize`: a block-quantized `x` (dense rows) -> contiguous
//! f32 of its values.

use super::{contiguous, expect_arity, expect_dtype};
use crate::{DType, Op, OpError, TensorMeta};

pub(super) fn infer(op: &Op, inputs: &[&TensorMeta]) -> Result<TensorMeta, OpError> {
    expect_arity(op, inputs, 1)?;
    let x = inputs[0];
    let name = op.name();
    match op {
        Op::Quantize(to) => {
            if !to.is_quantized() {
                return Err(OpError::InvalidParam {
                    op: name,
                    why: format!("target dtype {to} is not block-quantized (q8_0 or nvfp4)"),
                });
            }
            expect_dtype(op, 0, x, DType::F32, "f32")?;
            if !x.has_contiguous_rows() {
                return Err(OpError::NotContiguous { op: name, input: 0, shape: x.ne, nb: x.nb });
            }
            if !x.ne[0].is_multiple_of(to.block_size()) {
                return Err(OpError::InvalidShape {
                    op: name,
                    shape: x.ne,
                    why: format!("ne[0] must be a multiple of {to}'s block size {}", to.block_size()),
                });
            }
            contiguous(op, *to, x.ne)
        }
        Op::Dequantize => {
            if !x.dtype.is_quantized() {
                return Err(OpError::DType {
                    op: name,
                    input: 0,
                    dtype: x.dtype,
                    expected: "a block-quantized type (q8_0, nvfp4)",
                });
            }
            if !x.has_contiguous_rows() {
                return Err(OpError::NotContiguous { op: name, input: 0, shape: x.ne, nb: x.nb });
            }
            contiguous(op, DType::F32, x.ne)
        }
        _ => unreachable!("quant::infer called for {op}"),
    }
}

#[cfg(test)]
mod tests {
    use crate::{DType, Op, OpError, TensorMeta, infer};

    fn meta(dtype: DType, ne: [usize; 4]) -> TensorMeta {
        TensorMeta::contiguous("t", dtype, ne).unwrap()
    }

    #[test]
    fn quantize_shapes_and_errors() {
        let x = meta(DType::F32, [128, 3, 2, 1]);
        let q = infer(&Op::Quantize(DType::Q8_0), &[&x]).unwrap();
        assert_eq!((q.dtype, q.ne, q.nb[1]), (DType::Q8_0, [128, 3, 2, 1], 4 * 34));
        let q = infer(&Op::Quantize(DType::NvFp4), &[&x]).unwrap();
        assert_eq!((q.dtype, q.nb[1]), (DType::NvFp4, 2 * 36));
        let e = infer(&Op::Quantize(DType::F16), &[&x]).unwrap_err();
        assert!(matches!(e, OpError::InvalidParam { op: "quantize", .. }), "{e}");
        let odd = meta(DType::F32, [96, 1, 1, 1]);
        let e = infer(&Op::Quantize(DType::NvFp4), &[&odd]).unwrap_err();
        assert!(e.to_string().contains("block size 64"), "{e}");
        let h = meta(DType::F16, [64, 1, 1, 1]);
        assert!(matches!(infer(&Op::Quantize(DType::Q8_0), &[&h]), Err(OpError::DType { input: 0, .. })));
        let mut t = meta(DType::F32, [64, 2, 1, 1]);
        t.nb = [8, 4, 512, 512];
        assert!(matches!(infer(&Op::Quantize(DType::Q8_0), &[&t]), Err(OpError::NotContiguous { .. })));
    }

    #[test]
    fn dequantize_shapes_and_errors() {
        let q = meta(DType::NvFp4, [128, 5, 1, 1]);
        let y = infer(&Op::Dequantize, &[&q]).unwrap();
        assert_eq!((y.dtype, y.ne), (DType::F32, [128, 5, 1, 1]));
        let f = meta(DType::F32, [128, 5, 1, 1]);
        let e = infer(&Op::Dequantize, &[&f]).unwrap_err();
        assert!(e.to_string().contains("block-quantized"), "{e}");
        assert!(matches!(infer(&Op::Dequantize, &[&q, &q]), Err(OpError::Arity { .. })));
    }
}
