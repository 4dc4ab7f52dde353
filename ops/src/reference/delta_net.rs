use super::RefTensor;
use crate::{GatedDeltaNetParams, KernelError, TensorMeta};
pub(super) fn compute(
    _p: &GatedDeltaNetParams,
    _inputs: &[RefTensor],
    _out: &TensorMeta,
) -> Result<(RefTensor, RefTensor), KernelError> {
    todo!("gated_delta_net reference")
}
