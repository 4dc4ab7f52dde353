//! gated_delta_net.
use crate::{Op, OpError, TensorMeta};
pub(super) fn infer(_op: &Op, _inputs: &[&TensorMeta]) -> Result<TensorMeta, OpError> {
    todo!("gated_delta_net shape rules")
}
pub(super) fn flops(_inputs: &[&TensorMeta], _out: &TensorMeta) -> u64 {
    todo!()
}
pub(super) fn bytes(_inputs: &[&TensorMeta], _out: &TensorMeta) -> u64 {
    todo!()
}
