//! quantize and dequantize on the CPU.
use tessera_ops::KernelError;

use super::strided::{Dst, Src};

pub(super) fn convert(_x: Src<'_>, _dst: &mut Dst<'_>) -> Result<(), KernelError> {
    todo!("quantize cpu")
}
