//! rope_multi.
use crate::{Op, OpError, TensorMeta};
pub(super) fn infer(_op: &Op, _inputs: &[&TensorMeta]) -> Result<TensorMeta, OpError> {
    todo!("rope_multi shape rules")
}
