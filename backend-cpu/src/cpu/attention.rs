//! flash_attn_ext on the CPU.
use tessera_ops::{FlashAttnParams, KernelError};

use super::strided::{Dst, Src};

pub(super) fn flash_attn_ext(
    _p: &FlashAttnParams,
    _q: Src<'_>,
    _k: Src<'_>,
    _v: Src<'_>,
    _mask: Option<Src<'_>>,
    _table: Option<Src<'_>>,
    _dst: &mut Dst<'_>,
) -> Result<(), KernelError> {
    todo!("flash_attn_ext cpu")
}
