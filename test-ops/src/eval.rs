//! Eval mode: run one case on a backend and on its judge, with guard bytes around every buffer,
//! and compare every computed node.

use tessera_graph::{Backend, ExecError, Session, SessionOptions, Tensor};
use tessera_ops::DType;

use crate::case::{Built, Case};
use crate::check::{Comparison, compare_exact, compare_float};

/// Guard bytes around every buffer in eval mode; the session fails the run with
/// `ExecError::GuardOverwritten` when a kernel wrote into them.
pub const GUARD_BYTES: usize = 64;

/// The comparison of one computed node.
#[derive(Debug, Clone, PartialEq)]
pub struct OutputCheck {
    /// The node's op as displayed (`mul_mat`, `cont`, ...) with its index in the graph.
    pub node: String,
    pub dtype: DType,
    /// The bound applied (0 for exact integer comparison).
    pub bound: f64,
    pub comparison: Comparison,
}

/// How a case ended on one backend.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    Passed,
    /// Why it failed: the backend errored (e.g. a guard was overwritten), the judge errored, or
    /// outputs differ. Each entry is one reason.
    Failed(Vec<String>),
    /// The backend does not support the op on these inputs; not counted as passed or failed.
    Unsupported(String),
}

/// The result of one case on one backend.
#[derive(Debug, Clone, PartialEq)]
pub struct CaseResult {
    pub label: String,
    pub op: &'static str,
    pub backend: String,
    pub judge: String,
    pub outcome: Outcome,
    pub checks: Vec<OutputCheck>,
}

impl CaseResult {
    pub fn passed(&self) -> bool {
        self.outcome == Outcome::Passed
    }

    pub fn failed(&self) -> bool {
        matches!(self.outcome, Outcome::Failed(_))
    }

    /// The largest NMSE over the compared outputs (0 when none were compared).
    pub fn max_nmse(&self) -> f64 {
        self.checks.iter().map(|c| c.comparison.nmse).fold(0.0, f64::max)
    }

    /// The tightest bound applied (0 when none or only exact comparisons).
    pub fn bound(&self) -> f64 {
        self.checks.iter().map(|c| c.bound).filter(|&b| b > 0.0).reduce(f64::min).unwrap_or(0.0)
    }

    /// The failure reasons joined by `; ` (empty when it passed).
    pub fn reason(&self) -> String {
        match &self.outcome {
            Outcome::Passed => String::new(),
            Outcome::Failed(r) => r.join("; "),
            Outcome::Unsupported(why) => why.clone(),
        }
    }
}

/// Runs `case` on `backend` and on `judge` (fresh sessions with guard bytes) and compares every
/// computed node: integers exactly, floats by NaN/Inf agreement and NMSE against the case's bound.
pub fn eval_case(case: &Case, backend: &mut dyn Backend, judge: &mut dyn Backend) -> CaseResult {
    let mut result = CaseResult {
        label: case.vars().to_string(),
        op: case.op(),
        backend: backend.name().to_string(),
        judge: judge.name().to_string(),
        outcome: Outcome::Passed,
        checks: Vec::new(),
    };
    let built = match case.build() {
        Ok(b) => b,
        Err(e) => {
            result.outcome = Outcome::Failed(vec![format!("the case does not build: {e}")]);
            return result;
        }
    };
    let data = case.input_data(&built);
    let want = match run_and_read(judge, &built, &data) {
        Ok(v) => v,
        Err(e) => {
            result.outcome = Outcome::Failed(vec![format!("judge {} failed: {e}", result.judge)]);
            return result;
        }
    };
    let got = match run_and_read(backend, &built, &data) {
        Ok(v) => v,
        Err(ExecError::Unsupported { op, .. }) => {
            result.outcome = Outcome::Unsupported(format!("{op} is not supported"));
            return result;
        }
        Err(e) => {
            result.outcome = Outcome::Failed(vec![format!("{e}")]);
            return result;
        }
    };
    let mut reasons = Vec::new();
    for ((t, got), want) in built.checked.iter().zip(&got).zip(&want) {
        let dtype = t.dtype();
        let (bound, comparison) = if dtype.is_float() {
            let bound = case.nmse_bound(dtype);
            (bound, compare_float(got, want, bound))
        } else {
            (0.0, compare_exact(got, want))
        };
        let node = node_label(&built, t);
        reasons.extend(comparison.mismatches.iter().map(|m| format!("{node}: {m}")));
        result.checks.push(OutputCheck { node, dtype, bound, comparison });
    }
    if !reasons.is_empty() {
        result.outcome = Outcome::Failed(reasons);
    }
    result
}

/// `op#index`, e.g. `cont#2`.
fn node_label(built: &Built, t: &Tensor) -> String {
    format!("{}#{}", built.graph.node(t.id()).label(), t.id().index())
}

/// Places the case's graph on `backend` with guards, sets its leaves, runs it once and reads
/// every checked node as f64 in logical order.
fn run_and_read(backend: &mut dyn Backend, built: &Built, data: &[Vec<u8>]) -> Result<Vec<Vec<f64>>, ExecError> {
    let mut session = Session::with_options(&built.graph, backend, SessionOptions { guard_bytes: GUARD_BYTES })?;
    for (leaf, bytes) in built.leaves.iter().zip(data) {
        session.set(*leaf, bytes)?;
    }
    session.run()?;
    built.checked.iter().map(|t| session.get_f64(*t)).collect()
}
