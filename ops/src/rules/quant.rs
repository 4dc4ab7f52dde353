//! quantize, dequantize.
use crate::{Op, OpError, TensorMeta};
pub(super) fn infer(_op: &Op, _inputs: &[&TensorMeta]) -> Result<TensorMeta, OpError> {
    todo!("quantize shape rules")
}
