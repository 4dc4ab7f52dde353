//! The f64 reference as a backend: gathers each input into logical f64 values, runs
//! `tessera_ops::reference`, scatters the result into the output's layout (rounding to its dtype).
//! Slow and obviously right; test-ops judges the CPU backend against it.

use smallvec::SmallVec;
use tessera_graph::{Backend, BackendError, Task, TensorRef, check_range};
use tessera_ops::reference::{self, RefTensor};
use tessera_ops::{Op, TensorMeta, host};

use crate::buffers::HostBuffers;

/// Computes every op in f64 with plain loops.
pub struct ReferenceBackend {
    buffers: HostBuffers,
}

impl Default for ReferenceBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl ReferenceBackend {
    pub fn new() -> Self {
        ReferenceBackend { buffers: HostBuffers::new("ref") }
    }
}

impl Backend for ReferenceBackend {
    fn name(&self) -> &str {
        "ref"
    }

    fn supports(&self, op: &Op, _inputs: &[TensorMeta]) -> bool {
        !op.is_view()
    }

    crate::buffers::host_buffer_methods!();

    fn compute(&mut self, tasks: &[Task<'_>]) -> Result<(), BackendError> {
        for task in tasks {
            let inputs: SmallVec<[RefTensor; 4]> = task
                .inputs
                .iter()
                .map(|r| Ok(RefTensor::new(r.meta.ne, host::gather_f64(self.buffers.tensor_bytes(r)?, 0, &r.meta))))
                .collect::<Result<_, BackendError>>()?;
            match task.op.updates_input() {
                None => {
                    let result = reference::compute(task.op, &inputs, &task.output.meta)?;
                    self.store(&task.output, &result)?;
                }
                Some(u) => {
                    let (result, state) = reference::compute_updating(task.op, &inputs, &task.output.meta)?;
                    self.store(&task.output, &result)?;
                    self.store(&task.inputs[u], &state)?;
                }
            }
        }
        Ok(())
    }
}

impl ReferenceBackend {
    /// Writes logical values into a placed tensor, rounding to its dtype.
    fn store(&mut self, at: &TensorRef, values: &RefTensor) -> Result<(), BackendError> {
        let span = at.meta.span_bytes();
        let buf = self.buffers.get_mut(at.buffer)?;
        check_range("ref", at.buffer, buf.len(), at.offset, span)?;
        host::scatter_f64(&values.data, &mut buf.bytes_mut()[at.offset..at.offset + span], 0, &at.meta);
        Ok(())
    }
}
