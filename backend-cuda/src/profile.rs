//! Per-op device time of eager steps, for finding where a step's time goes
//! (`TESSERA_CUDA_PROFILE=1`): each task is bracketed by two CUDA events, the step waits for its
//! end, and the times add up per op and input shapes. The report is printed to stderr when the
//! backend is dropped. Profiling runs steps eagerly (no graph capture) and synchronises after each
//! one, so it measures kernels, not the step's throughput.

use std::collections::HashMap;

use cudarc::driver::{result, sys};
use tessera_graph::Task;

use crate::errors::CudaError;

/// Device time per op and shapes.
#[derive(Debug, Default)]
pub(crate) struct Profile {
    /// `op [shapes of the inputs]` -> (launches, seconds).
    rows: HashMap<String, (u64, f64)>,
    steps: u64,
}

/// The events of one task.
pub(crate) struct Mark {
    label: String,
    start: sys::CUevent,
    end: sys::CUevent,
}

fn event() -> Result<sys::CUevent, CudaError> {
    result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).map_err(CudaError::driver("creating an event"))
}

impl Profile {
    /// Records the start of `task` on `stream`.
    pub fn begin(&self, task: &Task<'_>, stream: sys::CUstream) -> Result<Mark, CudaError> {
        let shapes: Vec<String> = task.inputs.iter().map(|r| format!("{}{:?}", r.meta.dtype, r.meta.ne)).collect();
        let (start, end) = (event()?, event()?);
        // SAFETY: a fresh event on the backend's stream.
        unsafe { result::event::record(start, stream) }.map_err(CudaError::driver("recording an event"))?;
        Ok(Mark { label: format!("{} {}", task.op.name(), shapes.join(" ")), start, end })
    }

    /// Records the end of a task.
    pub fn end(&self, mark: &Mark, stream: sys::CUstream) -> Result<(), CudaError> {
        // SAFETY: the mark's own event on the backend's stream.
        unsafe { result::event::record(mark.end, stream) }.map_err(CudaError::driver("recording an event"))
    }

    /// Waits for the step's marks and adds their times up.
    pub fn finish(&mut self, marks: Vec<Mark>) -> Result<(), CudaError> {
        self.steps += 1;
        for m in marks {
            // SAFETY: both events were recorded; synchronising on the end waits for the task.
            let ms = unsafe {
                result::event::synchronize(m.end).map_err(CudaError::driver("waiting for an event"))?;
                let ms = result::event::elapsed(m.start, m.end).map_err(CudaError::driver("timing an event"))?;
                let _ = result::event::destroy(m.start);
                let _ = result::event::destroy(m.end);
                ms
            };
            let row = self.rows.entry(m.label).or_default();
            row.0 += 1;
            row.1 += ms as f64 * 1e-3;
        }
        Ok(())
    }

    /// The rows, most time first, as a printable table.
    pub fn report(&self) -> String {
        let mut rows: Vec<(&String, &(u64, f64))> = self.rows.iter().collect();
        rows.sort_by(|a, b| b.1.1.total_cmp(&a.1.1));
        let total: f64 = rows.iter().map(|r| r.1.1).sum();
        let per_step = |s: f64| s / self.steps.max(1) as f64 * 1e6;
        let mut out = format!(
            "tessera-cuda profile: {} steps, {:.1} us of kernels a step\n  us/step  share  launches/step  op and inputs\n",
            self.steps,
            per_step(total)
        );
        for (label, (n, secs)) in rows.iter().take(40) {
            out += &format!(
                "  {:8.1}  {:4.1}%  {:6.1}  {label}\n",
                per_step(*secs),
                100.0 * secs / total.max(1e-12),
                *n as f64 / self.steps.max(1) as f64
            );
        }
        out
    }
}
