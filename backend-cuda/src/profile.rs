//! Per-op device time of eager steps, for finding where a step's time goes
//! (`TESSERA_CUDA_PROFILE=1`): each task is bracketed by two CUDA events, the step waits for its
//! end, and the times are kept per op and input shapes. The report is printed to stderr when the
//! backend is dropped. Profiling runs steps eagerly (no graph capture) and synchronises after each
//! one, so it measures kernels, not the step's throughput. A row's time a step is its median launch
//! times its launches a step, the median taken without the row's first launch: a kernel's first
//! launch also waits for its module to compile or load, which in a sum outweighed hundreds of real
//! launches, and as one of a row's two launches (an op of the prompt's last step only) it was the
//! median.

use std::collections::HashMap;

use cudarc::driver::{result, sys};
use tessera_graph::Task;

use crate::errors::CudaError;

/// Device time per op and shapes.
#[derive(Debug, Default)]
pub(crate) struct Profile {
    /// `op [shapes of the inputs]` -> the seconds of each launch.
    rows: HashMap<String, Vec<f64>>,
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
            self.rows.entry(m.label).or_default().push(ms as f64 * 1e-3);
        }
        Ok(())
    }

    /// The rows, most time first, as a printable table: per row the launches a step, the median
    /// launch and the time a step (median times launches), and the shares of the steps' total.
    pub fn report(&self) -> String {
        let steps = self.steps.max(1) as f64;
        let mut rows: Vec<(&String, f64, f64)> =
            self.rows.iter().map(|(label, times)| (label, times.len() as f64 / steps, warm_median(times))).collect();
        rows.sort_by(|a, b| (b.1 * b.2).total_cmp(&(a.1 * a.2)));
        let total: f64 = rows.iter().map(|r| r.1 * r.2).sum();
        let mut out = format!(
            "tessera-cuda profile: {} steps, {:.1} us of kernels a step (median launches)\n  us/step  share  launches/step  us/launch  op and inputs\n",
            self.steps,
            total * 1e6
        );
        for (label, launches, median) in rows.iter().take(40) {
            out += &format!(
                "  {:8.1}  {:4.1}%  {:6.1}  {:9.1}  {label}\n",
                launches * median * 1e6,
                100.0 * launches * median / total.max(1e-12),
                launches,
                median * 1e6
            );
        }
        out
    }
}

/// The lower median of a row's launches after its first (all of them when there is one).
fn warm_median(times: &[f64]) -> f64 {
    let mut t = times.get(1..).filter(|rest| !rest.is_empty()).unwrap_or(times).to_vec();
    t.sort_by(f64::total_cmp);
    t.get((t.len().max(1) - 1) / 2).copied().unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::warm_median;

    #[test]
    fn the_first_launch_is_left_out_of_the_median() {
        // a compile-sized first launch, then the real ones
        assert_eq!(warm_median(&[8.0, 1e-4]), 1e-4);
        assert_eq!(warm_median(&[8.0, 3e-4, 1e-4, 2e-4]), 2e-4);
        assert_eq!(warm_median(&[8.0, 3e-4, 1e-4]), 1e-4);
        assert_eq!(warm_median(&[5e-4]), 5e-4);
        assert_eq!(warm_median(&[]), 0.0);
    }
}
