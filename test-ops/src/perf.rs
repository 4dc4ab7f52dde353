//! Perf mode: build a case's graph once, place it once, then time repeated `run()` calls until a
//! time or byte budget is spent.

use std::time::{Duration, Instant};

use tessera_graph::{Backend, ExecError, Session, SessionOptions};

use crate::case::Case;

/// When to stop repeating a case.
#[derive(Debug, Clone, Copy)]
pub struct PerfBudget {
    /// Stop once this much time was spent timing runs...
    pub time: Duration,
    /// ...or once the runs moved this many bytes (by the case's cost model)...
    pub bytes: u64,
    /// ...but always time at least this many runs...
    pub min_runs: u64,
    /// ...and never more than this many.
    pub max_runs: u64,
}

impl Default for PerfBudget {
    fn default() -> Self {
        PerfBudget { time: Duration::from_millis(250), bytes: 32 << 30, min_runs: 3, max_runs: 100_000 }
    }
}

/// Timing of one case on one backend.
#[derive(Debug, Clone, PartialEq)]
pub struct PerfResult {
    pub label: String,
    pub backend: String,
    pub runs: u64,
    /// Mean wall time of one run, microseconds.
    pub us_per_run: f64,
    /// Cost-model bytes per second, in 10^9.
    pub gb_per_s: f64,
    /// Cost-model flops per second, in 10^9.
    pub gflop_per_s: f64,
}

/// Times `case` on `backend`: one warm-up run, then runs until `budget` is spent. The graph is
/// built, placed and filled once; no guard bytes. The clock stops after the backend has finished
/// the queued runs (`synchronize`), so the time covers asynchronous work but not reading the
/// output back.
pub fn perf_case(case: &Case, backend: &mut dyn Backend, budget: PerfBudget) -> Result<PerfResult, ExecError> {
    let built = case.build()?;
    let cost = case.cost()?;
    let data = case.input_data(&built);
    let name = backend.name().to_string();
    let mut session = Session::with_options(&built.graph, backend, SessionOptions::default())?;
    for (leaf, bytes) in built.leaves.iter().zip(&data) {
        session.set(*leaf, bytes)?;
    }
    drop(data);
    session.run()?;
    let start = Instant::now();
    let mut runs = 0u64;
    loop {
        session.run()?;
        runs += 1;
        let spent = start.elapsed() >= budget.time || runs.saturating_mul(cost.bytes) >= budget.bytes;
        if runs >= budget.max_runs || (runs >= budget.min_runs && spent) {
            break;
        }
    }
    session.synchronize()?;
    let secs = start.elapsed().as_secs_f64() / runs as f64;
    session.get(built.output)?;
    Ok(PerfResult {
        label: case.vars().to_string(),
        backend: name,
        runs,
        us_per_run: secs * 1e6,
        gb_per_s: cost.bytes as f64 / secs / 1e9,
        gflop_per_s: cost.flops as f64 / secs / 1e9,
    })
}
