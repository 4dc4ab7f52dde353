//! flash_attn_ext.
use crate::{Op, OpError, TensorMeta};
pub(super) fn infer(_op: &Op, _inputs: &[&TensorMeta]) -> Result<TensorMeta, OpError> {
    todo!("flash_attn_ext shape rules")
}
pub(super) fn flops(_inputs: &[&TensorMeta], _out: &TensorMeta) -> u64 {
    todo!()
}
pub(super) fn bytes(_inputs: &[&TensorMeta], _out: &TensorMeta) -> u64 {
    todo!()
}
