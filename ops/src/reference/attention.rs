use super::RefTensor;
use crate::{KernelError, Op, TensorMeta};
pub(super) fn compute(_op: &Op, _inputs: &[RefTensor], _out: &TensorMeta) -> Result<RefTensor, KernelError> {
    todo!("attention reference")
}
