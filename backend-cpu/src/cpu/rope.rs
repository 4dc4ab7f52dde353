//! rope_multi on the CPU.
use tessera_ops::{KernelError, RopeParams};

use super::strided::{Dst, Src};

pub(super) fn rope_multi(_p: &RopeParams, _x: Src<'_>, _pos: Src<'_>, _dst: &mut Dst<'_>) -> Result<(), KernelError> {
    todo!("rope cpu")
}
