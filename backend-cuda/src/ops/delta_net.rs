//! IN PROGRESS: the delta_net family (kernels/delta_net.cu). A helper is writing it.

use tessera_graph::{BackendError, Task};
use tessera_ops::{Op, TensorMeta};

use crate::launch::{Cx, TensorArg, unsupported};

pub(crate) fn supports(_op: &Op, _inputs: &[TensorMeta]) -> bool {
    false
}

#[allow(dead_code)]
pub(crate) fn scratch_bytes(_task: &Task<'_>) -> usize {
    0
}

pub(crate) fn run(_cx: &mut Cx<'_>, task: &Task<'_>, _ins: &[TensorArg], _out: TensorArg) -> Result<(), BackendError> {
    Err(unsupported(task, "in progress"))
}
