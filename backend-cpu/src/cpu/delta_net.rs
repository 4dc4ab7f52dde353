//! gated_delta_net on the CPU.
use tessera_ops::{GatedDeltaNetParams, KernelError};

use super::StateMut;
use super::strided::{Dst, Src};

/// `qkvgb` is `[q, k, v, g, beta]`.
pub(super) fn gated_delta_net(
    _p: &GatedDeltaNetParams,
    _qkvgb: [Src<'_>; 5],
    _state: StateMut<'_>,
    _slots: Src<'_>,
    _dst: &mut Dst<'_>,
) -> Result<(), KernelError> {
    todo!("gated_delta_net cpu")
}
