use super::RefTensor;
use crate::{KernelError, Op, TensorMeta};
pub(super) fn compute(_op: &Op, _inputs: &[RefTensor], _out: &TensorMeta) -> Result<RefTensor, KernelError> {
    todo!("ssm_conv reference")
}
pub(super) fn update(_silu: bool, _inputs: &[RefTensor], _out: &TensorMeta) -> Result<(RefTensor, RefTensor), KernelError> {
    todo!("ssm_conv_update reference")
}
