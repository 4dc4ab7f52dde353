//! # tessera-test-ops: test-backend-ops for Tessera
//!
//! A catalogue of op cases ([`catalogue`], [`perf_catalogue`]), each a [`Case`]: a label that is
//! also its filter key, input specs (dtype, shape, layout, values), a builder, a cost and an NMSE
//! bound. [`eval_case`] runs a case on a backend and on its judge and compares every computed
//! node (NMSE, NaN/Inf, exact integers) with guard bytes around every buffer; [`perf_case`] times
//! it. The backends and who judges whom are listed in [`backends::registry`]: the f64 reference
//! judges the CPU backend, the CPU backend judges every other backend.
//!
//! [`fusion`] checks the fusion passes: each on graphs with its pattern and near-misses, and the
//! models' step graphs, with the pass on and off on a backend.
//!
//! The `tessera-test-ops` binary drives the same API: `eval`, `perf`, `fusion` and `list`.

pub mod backends;
mod case;
mod cases;
pub mod check;
mod eval;
pub mod fusion;
mod inputs;
mod perf;

pub use case::{
    BuildFn, Built, Case, Generator, Init, InputSpec, JudgeFn, Layout, NMSE_F32, NMSE_HALF, Shape, default_bound,
};
pub use cases::{catalogue, perf_catalogue};
pub use eval::{CaseResult, GUARD_BYTES, Judged, Outcome, OutputCheck, eval_case};
pub use perf::{PerfBudget, PerfResult, perf_case};

/// Which cases to run: exact op names (any of them; all when empty) and a label substring.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selection {
    pub ops: Vec<String>,
    pub filter: Option<String>,
}

impl Selection {
    pub fn matches(&self, case: &Case) -> bool {
        (self.ops.is_empty() || self.ops.iter().any(|o| o == case.op()))
            && self.filter.as_deref().is_none_or(|f| case.vars().contains(f))
    }

    /// The cases of `cases` this selection keeps, in order.
    pub fn apply(&self, cases: Vec<Case>) -> Vec<Case> {
        cases.into_iter().filter(|c| self.matches(c)).collect()
    }
}

/// Every op name that has at least one case in `cases`, sorted and deduplicated.
pub fn op_names(cases: &[Case]) -> Vec<&'static str> {
    let mut names: Vec<&'static str> = cases.iter().map(|c| c.op()).collect();
    names.sort_unstable();
    names.dedup();
    names
}
