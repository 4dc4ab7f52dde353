//! ssm_conv and ssm_conv_update_inplace on the CPU.
use tessera_ops::KernelError;

use super::StateMut;
use super::strided::{Dst, Src};

pub(super) fn ssm_conv(_sx: Src<'_>, _kernel: Src<'_>, _dst: &mut Dst<'_>) -> Result<(), KernelError> {
    todo!("ssm_conv cpu")
}

pub(super) fn ssm_conv_update(
    _silu: bool,
    _x: Src<'_>,
    _state: StateMut<'_>,
    _kernel: Src<'_>,
    _slots: Src<'_>,
    _dst: &mut Dst<'_>,
) -> Result<(), KernelError> {
    todo!("ssm_conv_update cpu")
}
