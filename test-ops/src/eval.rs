//! Eval mode: run one case on a backend and on its judge, with guard bytes around every buffer,
//! and compare every computed node, plus the final contents of every leaf an op updates in place
//! (recurrent state, caches).

use tessera_graph::{Backend, BackendError, ExecError, Session, SessionOptions, Tensor};
use tessera_ops::{DType, Op, host};

use crate::case::{Built, Case};
use crate::check::{Comparison, compare_exact, compare_float};

/// Guard bytes around every buffer in eval mode; the session fails the run with
/// `ExecError::GuardOverwritten` when a kernel wrote into them.
pub const GUARD_BYTES: usize = 64;

/// The comparison of one computed node, or of a leaf updated in place.
#[derive(Debug, Clone, PartialEq)]
pub struct OutputCheck {
    /// The node's op as displayed (`mul_mat`, `cont`, ...) with its index in the graph; for a
    /// leaf updated in place, `state:<leaf name>#index` (its contents after the run).
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

/// What an eval or fusion result says about itself, from its outcome and its compared outputs.
pub trait Judged {
    fn outcome(&self) -> &Outcome;
    fn checks(&self) -> &[OutputCheck];

    fn passed(&self) -> bool {
        *self.outcome() == Outcome::Passed
    }

    fn failed(&self) -> bool {
        matches!(self.outcome(), Outcome::Failed(_))
    }

    /// The largest NMSE over the compared outputs (0 when none were compared).
    fn max_nmse(&self) -> f64 {
        self.checks().iter().map(|c| c.comparison.nmse).fold(0.0, f64::max)
    }

    /// The tightest bound applied (0 when none or only exact comparisons).
    fn bound(&self) -> f64 {
        self.checks().iter().map(|c| c.bound).filter(|&b| b > 0.0).reduce(f64::min).unwrap_or(0.0)
    }

    /// The failure reasons joined by `; ` (why it is unsupported; empty when it passed).
    fn reason(&self) -> String {
        match self.outcome() {
            Outcome::Passed => String::new(),
            Outcome::Failed(r) => r.join("; "),
            Outcome::Unsupported(why) => why.clone(),
        }
    }
}

impl Judged for CaseResult {
    fn outcome(&self) -> &Outcome {
        &self.outcome
    }

    fn checks(&self) -> &[OutputCheck] {
        &self.checks
    }
}

/// Runs `case` on `backend` and on `judge` (fresh sessions with guard bytes) and compares every
/// computed node and, after the run, every leaf updated in place ([`Built::updated`]): integers
/// exactly, floats by NaN/Inf agreement and NMSE against the case's bound.
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
    if case.expects_error() {
        if let Some(outcome) = eval_error_case(backend, judge, &built, &data) {
            result.outcome = outcome;
        }
        return result;
    }
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
    let compared = built.checked.iter().chain(&built.updated);
    for ((t, got), want) in compared.zip(&got).zip(&want) {
        for (part, dtype, got, want) in parts(&built, t, got, want) {
            let own = case.judge().filter(|_| t.id() == built.output.id());
            let (bound, comparison) = if let Some(judge) = own {
                (0.0, judge(&seen_inputs(&built, &data), &got, &want))
            } else if dtype.is_float() {
                let bound = case.nmse_bound(dtype);
                (bound, compare_float(&got, &want, bound))
            } else {
                (0.0, compare_exact(&got, &want))
            };
            let node = node_label(&built, t) + &part;
            reasons.extend(comparison.mismatches.iter().map(|m| format!("{node}: {m}")));
            result.checks.push(OutputCheck { node, dtype, bound, comparison });
        }
    }
    if !reasons.is_empty() {
        result.outcome = Outcome::Failed(reasons);
    }
    result
}

/// An error case ([`Case::expect_error`]): `None` (passed) when the judge and the backend both
/// fail with the same data error and leave every leaf updated in place as it was before the run.
fn eval_error_case(
    backend: &mut dyn Backend,
    judge: &mut dyn Backend,
    built: &Built,
    data: &[Vec<u8>],
) -> Option<Outcome> {
    let want = match run_expecting_error(judge, built, data) {
        Ok(r) => r,
        Err(ErrorRun::Unexpected(why) | ErrorRun::Unsupported(why)) => {
            return Some(Outcome::Failed(vec![format!("judge {}: {why}", judge.name())]));
        }
    };
    let got = match run_expecting_error(backend, built, data) {
        Ok(r) => r,
        Err(ErrorRun::Unsupported(why)) => return Some(Outcome::Unsupported(why)),
        Err(ErrorRun::Unexpected(why)) => return Some(Outcome::Failed(vec![why])),
    };
    let mut reasons = Vec::new();
    if got.0 != want.0 {
        reasons.push(format!("failed with \"{}\", the judge with \"{}\"", got.0, want.0));
    }
    for ((t, got), want) in built.updated.iter().zip(&got.1).zip(&want.1) {
        if got != want {
            reasons.push(format!("{}: changed by the failed run", node_label(built, t)));
        }
    }
    (!reasons.is_empty()).then_some(Outcome::Failed(reasons))
}

/// Why a run that must fail with a data error did not.
enum ErrorRun {
    Unsupported(String),
    /// It succeeded, or failed otherwise.
    Unexpected(String),
}

/// Runs a case that must fail with a data error; returns the error's message and every updated
/// leaf read after the failed run.
fn run_expecting_error(
    backend: &mut dyn Backend,
    built: &Built,
    data: &[Vec<u8>],
) -> Result<(String, Vec<Vec<f64>>), ErrorRun> {
    let unexpected = |e: ExecError| ErrorRun::Unexpected(format!("failed with a non-data error: {e}"));
    let mut session =
        Session::with_options(&built.graph, backend, SessionOptions { guard_bytes: GUARD_BYTES, ..Default::default() })
            .map_err(unexpected)?;
    for (leaf, bytes) in built.leaves.iter().zip(data) {
        session.set(*leaf, bytes).map_err(unexpected)?;
    }
    // An asynchronous backend may report the error only when it next synchronises.
    let error = match session.run().and_then(|()| session.synchronize()) {
        Err(ExecError::Backend(BackendError::Kernel(e))) => e.to_string(),
        Err(ExecError::Unsupported { op, .. }) => return Err(ErrorRun::Unsupported(format!("{op} is not supported"))),
        Err(e) => return Err(unexpected(e)),
        Ok(()) => return Err(ErrorRun::Unexpected("the run succeeded; it must fail with a data error".into())),
    };
    let after = built.updated.iter().map(|t| session.get_f64(*t)).collect::<Result<_, _>>().map_err(unexpected)?;
    Ok((error, after))
}

/// Every input's values as the op sees them (through its layout), in logical order.
fn seen_inputs(built: &Built, data: &[Vec<u8>]) -> Vec<Vec<f64>> {
    built.inputs.iter().zip(data).map(|((seen, offset), bytes)| host::gather_f64(bytes, *offset, seen.meta())).collect()
}

/// `op#index`, e.g. `cont#2`; `state:name#index` for a leaf updated in place.
/// A node's value as the parts compared on their own: the whole at its dtype, or for an output
/// of packed planes (`Op::packed_planes`: `moe_router`'s ids and weights) each plane at its own
/// dtype, the stored bits reinterpreted (`[name]` after the node's label).
fn parts(built: &Built, t: &Tensor, got: &[f64], want: &[f64]) -> Vec<(String, DType, Vec<f64>, Vec<f64>)> {
    let planes = built.graph.node(t.id()).op().map_or(&[][..], Op::packed_planes);
    if planes.is_empty() {
        return vec![(String::new(), t.dtype(), got.to_vec(), want.to_vec())];
    }
    let stored = t.dtype();
    let plane = |v: &[f64], i: usize, dtype: DType| -> Vec<f64> {
        let len = v.len() / planes.len();
        v[i * len..(i + 1) * len].iter().map(|&x| reinterpret(x, stored, dtype)).collect()
    };
    planes
        .iter()
        .enumerate()
        .map(|(i, &(name, d))| (format!("[{name}]"), d, plane(got, i, d), plane(want, i, d)))
        .collect()
}

/// A value read as `from` (its logical f64), with its bits read as `to` (both 4-byte types).
fn reinterpret(x: f64, from: DType, to: DType) -> f64 {
    let bits = match from {
        DType::I32 => x as i32 as u32,
        _ => (x as f32).to_bits(),
    };
    match to {
        DType::I32 => f64::from(bits as i32),
        _ => f64::from(f32::from_bits(bits)),
    }
}

fn node_label(built: &Built, t: &Tensor) -> String {
    let node = built.graph.node(t.id());
    match node.op() {
        Some(_) => format!("{}#{}", node.label(), t.id().index()),
        None => format!("state:{}#{}", node.name.as_deref().unwrap_or(node.label()), t.id().index()),
    }
}

/// Places the case's graph on `backend` with guards, sets its leaves, runs it once and reads
/// every checked node, then every updated leaf, as f64 in logical order.
fn run_and_read(backend: &mut dyn Backend, built: &Built, data: &[Vec<u8>]) -> Result<Vec<Vec<f64>>, ExecError> {
    let mut session = Session::with_options(
        &built.graph,
        backend,
        SessionOptions { guard_bytes: GUARD_BYTES, ..Default::default() },
    )?;
    for (leaf, bytes) in built.leaves.iter().zip(data) {
        session.set(*leaf, bytes)?;
    }
    session.run()?;
    built.checked.iter().chain(&built.updated).map(|t| session.get_f64(*t)).collect()
}

#[cfg(test)]
mod tests {
    use tessera_graph::{BackendError, BufferId, Task};
    use tessera_ops::{Op, TensorMeta};

    use super::*;
    use crate::backends;
    use crate::case::{Init, InputSpec, Layout};

    /// set_rows into a windowed state leaf: the op's output is the window, the leaf is larger.
    fn set_rows_into_state() -> Case {
        let dst = InputSpec::new("dst", DType::F32, [8, 6, 1, 1]).layout(Layout::WINDOW).state();
        let src = InputSpec::new("src", DType::F32, [8, 3, 1, 1]);
        let ids = InputSpec::new("ids", DType::I32, [3, 1, 1, 1]).init(Init::Ids { rows: 6, unique: true });
        Case::new("set_rows", "state", vec![dst, src, ids], |g, t| g.set_rows(t[0], t[1], t[2]))
    }

    /// How [`BadState`] gets state wrong.
    #[derive(Clone, Copy, PartialEq)]
    enum StateFault {
        /// Writes 4 bytes just before each in-place target's view: inside the leaf when the view
        /// starts past the leaf's first byte, outside both the op's output and every guard.
        Scribble,
        /// Puts the state an op updates (`Op::updates_input`) back as it was before the run:
        /// right outputs, forgotten state.
        Forget,
    }

    /// The CPU backend with a [`StateFault`].
    struct BadState(Box<dyn Backend>, StateFault);

    impl Backend for BadState {
        fn name(&self) -> &str {
            "bad-state"
        }
        fn supports(&self, op: &Op, inputs: &[TensorMeta]) -> bool {
            self.0.supports(op, inputs)
        }
        fn alloc(&mut self, bytes: usize) -> Result<BufferId, BackendError> {
            self.0.alloc(bytes)
        }
        fn free(&mut self, buffer: BufferId) {
            self.0.free(buffer)
        }
        fn size(&self, buffer: BufferId) -> Result<usize, BackendError> {
            self.0.size(buffer)
        }
        fn write(&mut self, buffer: BufferId, offset: usize, data: &[u8]) -> Result<(), BackendError> {
            self.0.write(buffer, offset, data)
        }
        fn read(&mut self, buffer: BufferId, offset: usize, out: &mut [u8]) -> Result<(), BackendError> {
            self.0.read(buffer, offset, out)
        }
        fn compute(&mut self, tasks: &[Task<'_>]) -> Result<(), BackendError> {
            let mut saved = Vec::new();
            for task in tasks {
                if let Some(u) = task.op.updates_input() {
                    let r = task.inputs[u];
                    let mut bytes = vec![0; r.meta.span_bytes()];
                    self.0.read(r.buffer, r.offset, &mut bytes)?;
                    saved.push((r, bytes));
                }
            }
            self.0.compute(tasks)?;
            match self.1 {
                StateFault::Forget => {
                    for (r, bytes) in saved {
                        self.0.write(r.buffer, r.offset, &bytes)?;
                    }
                }
                StateFault::Scribble => {
                    for task in tasks {
                        if let Some(i) = task.op.writes_input().or(task.op.updates_input()) {
                            let target = &task.inputs[i];
                            self.0.write(target.buffer, target.offset - 4, &1e3f32.to_le_bytes())?;
                        }
                    }
                }
            }
            Ok(())
        }
    }

    fn catalogue_case(op: &str, label_part: &str) -> Case {
        crate::catalogue()
            .into_iter()
            .find(|c| c.op() == op && c.vars().contains(label_part))
            .unwrap_or_else(|| panic!("no {op} case with {label_part}"))
    }

    #[test]
    fn wrong_or_forgotten_state_updates_fail() {
        let mut judge = backends::make("ref").unwrap();
        let sliced = catalogue_case("ssm_conv_update_inplace", "state=view");
        let plain = catalogue_case("ssm_conv_update_inplace", "channels=67");
        for case in [&sliced, &plain] {
            let mut cpu = backends::make("cpu").unwrap();
            let r = eval_case(case, cpu.as_mut(), judge.as_mut());
            assert!(r.passed(), "{}: {}", case.vars(), r.reason());
            assert!(r.checks.iter().any(|c| c.node.starts_with("state:state")), "{:?}", r.checks);
            let mut forgets = BadState(backends::make("cpu").unwrap(), StateFault::Forget);
            let r = eval_case(case, &mut forgets, judge.as_mut());
            assert!(r.failed() && r.reason().starts_with("state:state"), "{}: {}", case.vars(), r.reason());
        }
        // Slot 0 of the larger leaf is outside the op's view: only the leaf comparison sees it.
        let mut scribbles = BadState(backends::make("cpu").unwrap(), StateFault::Scribble);
        let r = eval_case(&sliced, &mut scribbles, judge.as_mut());
        assert!(r.failed() && r.reason().starts_with("state:state"), "{}", r.reason());
    }

    #[test]
    fn error_cases_pass_only_when_both_sides_fail_alike_and_keep_the_state() {
        let mut judge = backends::make("ref").unwrap();
        let bad = catalogue_case("gated_delta_net", "ragged=repeated_slot");
        assert!(bad.expects_error());
        let mut cpu = backends::make("cpu").unwrap();
        let r = eval_case(&bad, cpu.as_mut(), judge.as_mut());
        assert!(r.passed(), "{}", r.reason());
        // A run that succeeds fails an error case.
        let good = catalogue_case("gated_delta_net", "ragged=decode").expect_error();
        let r = eval_case(&good, cpu.as_mut(), judge.as_mut());
        assert!(r.failed() && r.reason().contains("must fail"), "{}", r.reason());
        // So does a failed run that changed the state.
        let mut forgets = BadState(backends::make("cpu").unwrap(), StateFault::Scribble);
        let bad_conv = catalogue_case("ssm_conv_update_inplace", "ragged=past_end");
        let r = eval_case(&bad_conv, &mut forgets, judge.as_mut());
        assert!(r.passed() || r.reason().contains("changed by the failed run"), "{}", r.reason());
    }

    #[test]
    fn a_leaf_updated_in_place_is_compared_after_the_run() {
        let case = set_rows_into_state();
        let built = case.build().unwrap();
        assert_eq!(built.updated, vec![built.leaves[0]]);
        assert!(
            matches!(built.graph.node(built.leaves[0].id()).kind, tessera_graph::NodeKind::Leaf(k) if k.name() == "state")
        );
        let mut cpu = backends::make("cpu").unwrap();
        let mut judge = backends::make("ref").unwrap();
        let r = eval_case(&case, cpu.as_mut(), judge.as_mut());
        assert!(r.passed(), "{}", r.reason());
        assert!(r.checks.iter().any(|c| c.node.starts_with("state:dst")), "{:?}", r.checks);

        let mut bad = BadState(backends::make("cpu").unwrap(), StateFault::Scribble);
        let r = eval_case(&case, &mut bad, judge.as_mut());
        assert!(r.failed());
        assert!(r.reason().starts_with("state:dst"), "{}", r.reason());
    }
}
