//! ssm_conv, ssm_conv_update_inplace.
use crate::{Op, OpError, TensorMeta};
pub(super) fn infer(_op: &Op, _inputs: &[&TensorMeta]) -> Result<TensorMeta, OpError> {
    todo!("ssm_conv shape rules")
}
pub(super) fn flops(_inputs: &[&TensorMeta], _out: &TensorMeta) -> u64 {
    todo!()
}
pub(super) fn update_bytes(_inputs: &[&TensorMeta], _out: &TensorMeta) -> u64 {
    todo!()
}
