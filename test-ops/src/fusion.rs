//! Fusion mode (issue 21): every pass of `passes::standard()` on graphs that contain its pattern
//! and on near-misses that must not match, and the models' step graphs, each run with the pass on
//! and off on a backend.
//!
//! A [`FusionCase`] is an ordinary [`Case`] (seeded inputs, a builder that may mark outputs in the
//! middle of its graph and write state in place) plus the pass under test and how many fusions
//! it must apply. [`check_fusion_case`] runs the pass alone on the built graph twice: once as if
//! the backend had every fused op (the count then depends only on the pattern and
//! `Graph::check_fusion`, and must be the expected one), and once with the backend's `supports`.
//! It then runs the graph without and with the pass on the backend and compares every graph
//! output and every leaf an op writes in place with eval's comparisons and bounds (NMSE under the
//! case's bound per dtype, integers exactly). [`check_model_case`] does the same for a synthetic
//! model: two copies, passes on and off, the same steps (prefill, decode, a mixed bucket), the
//! logits of every step compared. A pass of the standard pipeline without a generator is a failure
//! ([`generator_gaps`]), so a pass cannot be added untested.

mod delta_net;
mod patterns;

use std::fmt;

use tessera_graph::passes::{Pipeline, UnknownPass, standard};
use tessera_graph::{Backend, ExecError, Graph, GraphError, NodeKind, Session, SessionOptions, Tensor};
use tessera_ops::DType;

use crate::case::{Built, Case, InputSpec, NMSE_F32};
use crate::check::{compare_exact, compare_float};
use crate::eval::{GUARD_BYTES, Judged, Outcome, OutputCheck};

/// One graph for one pass: the pattern in some surroundings, or a near-miss.
#[derive(Clone)]
pub struct FusionCase {
    pass: &'static str,
    case: Case,
    expect: usize,
}

impl fmt::Debug for FusionCase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FusionCase").field("label", &self.vars()).field("expect", &self.expect).finish()
    }
}

impl FusionCase {
    /// A graph for pass `pass`, labelled `pass(params)`, on which the pass must apply exactly
    /// `expect` fusions. `build` makes the graph from the inputs (laid out as each spec says);
    /// what it returns is marked as an output, and it may mark more.
    pub fn new(
        pass: &'static str,
        params: impl fmt::Display,
        inputs: Vec<InputSpec>,
        expect: usize,
        build: impl Fn(&mut Graph, &[Tensor]) -> Result<Tensor, GraphError> + Send + Sync + 'static,
    ) -> FusionCase {
        FusionCase { pass, case: Case::new(pass, params, inputs, build), expect }
    }

    /// The pass under test.
    pub fn pass(&self) -> &'static str {
        self.pass
    }

    /// The label, also the `--filter` key.
    pub fn vars(&self) -> &str {
        self.case.vars()
    }

    /// Fusions the pass must apply.
    pub fn expected(&self) -> usize {
        self.expect
    }

    /// The graph, its inputs and their data, as eval builds them.
    pub fn case(&self) -> &Case {
        &self.case
    }
}

/// The cases of one pass.
#[derive(Debug, Clone, Copy)]
pub struct PassGenerator {
    pub pass: &'static str,
    pub cases: fn() -> Vec<FusionCase>,
}

/// A generator for every pass this mode knows.
pub fn pass_generators() -> Vec<PassGenerator> {
    patterns::generators()
}

/// What is wrong with the generators against `pipeline`: each pass without a generator (a pass
/// added untested), and each generator of a pass the pipeline does not have (a pass renamed).
pub fn generator_gaps(pipeline: &Pipeline) -> Vec<String> {
    let gens = pass_generators();
    let names: Vec<&str> = pipeline.passes().into_iter().map(|(n, _)| n).collect();
    let mut gaps: Vec<String> = names
        .iter()
        .filter(|n| !gens.iter().any(|g| g.pass == **n))
        .map(|n| format!("pass `{n}` has no generator (test-ops/src/fusion/patterns.rs)"))
        .collect();
    gaps.extend(
        gens.iter()
            .filter(|g| !names.contains(&g.pass))
            .map(|g| format!("generator for `{}`, which is not a pass of the pipeline", g.pass)),
    );
    gaps
}

/// `passes::standard()` with only `pass` switched on.
pub fn only(pass: &str) -> Result<Pipeline, UnknownPass> {
    let mut p = standard();
    p.set_all(false);
    p.set_enabled(pass, true)?;
    Ok(p)
}

/// The result of one fusion case or model case on one backend.
#[derive(Debug, Clone, PartialEq)]
pub struct FusionResult {
    pub label: String,
    /// The pass under test (`models` for a model case).
    pub pass: String,
    pub backend: String,
    pub outcome: Outcome,
    /// Each compared output (graph outputs, leaves written in place, a model step's logits).
    pub checks: Vec<OutputCheck>,
    /// Fusions applied as if every fused op were supported (a model case: on its first step).
    pub applied: usize,
    /// Fusions expected (a model case: `applied`, nothing is expected of the count).
    pub expected: usize,
}

impl FusionResult {
    fn new(label: &str, pass: &str, backend: &str, expected: usize) -> FusionResult {
        FusionResult {
            label: label.to_string(),
            pass: pass.to_string(),
            backend: backend.to_string(),
            outcome: Outcome::Passed,
            checks: Vec::new(),
            applied: 0,
            expected,
        }
    }

    fn fail(mut self, why: impl fmt::Display) -> FusionResult {
        self.outcome = Outcome::Failed(vec![why.to_string()]);
        self
    }
}

impl Judged for FusionResult {
    fn outcome(&self) -> &Outcome {
        &self.outcome
    }

    fn checks(&self) -> &[OutputCheck] {
        &self.checks
    }
}

/// Runs `fc` with `pipeline` (normally [`only`] its pass) on `backend`: the number of fusions,
/// then every output and written leaf with the pass against without it (see the module doc).
pub fn check_fusion_case(fc: &FusionCase, pipeline: &Pipeline, backend: &mut dyn Backend) -> FusionResult {
    let mut r = FusionResult::new(fc.vars(), fc.pass, backend.name(), fc.expect);
    let built = match fc.case.build() {
        Ok(b) => b,
        Err(e) => return r.fail(format!("the case does not build: {e}")),
    };
    let data = fc.case.input_data(&built);
    let counted = match pipeline.run(built.graph.clone(), &|_, _| true) {
        Ok(run) => run,
        Err(e) => return r.fail(format!("the pass failed: {e}")),
    };
    r.applied = counted.reports.iter().map(|p| p.applied).sum();
    // A wrong count fails the case; the outputs are still compared, to say whether the fusion
    // changed them.
    let mut reasons = Vec::new();
    if r.applied != fc.expect {
        let found: usize = counted.reports.iter().map(|p| p.found).sum();
        let skipped: usize = counted.reports.iter().map(|p| p.skipped).sum();
        reasons.push(format!(
            "{} applied {} fusions, expected {} (found {found}, skipped {skipped})",
            fc.pass, r.applied, fc.expect
        ));
    }
    let run = {
        let be: &dyn Backend = backend;
        match pipeline.run(built.graph.clone(), &|op, inputs| be.supports(op, inputs)) {
            Ok(run) => run,
            Err(e) => return r.fail(format!("the pass failed: {e}")),
        }
    };
    let here: usize = run.reports.iter().map(|p| p.applied).sum();
    if here != r.applied && reasons.is_empty() {
        r.outcome = Outcome::Unsupported(format!("{} of {} fused ops not supported", r.applied - here, r.applied));
        return r;
    }
    // Every graph output, then every leaf written in place, in the graph before the pass.
    let outputs: Vec<Tensor> = built.graph.outputs().iter().filter_map(|&id| built.graph.tensor(id)).collect();
    let read: Vec<Tensor> = outputs.iter().chain(&built.updated).copied().collect();
    let off = match run_and_read(backend, &built.graph, &built, &data, &read, &|t| Ok(t)) {
        Ok(v) => v,
        Err(ExecError::Unsupported { op, .. }) if reasons.is_empty() => {
            r.outcome = Outcome::Unsupported(format!("{op} is not supported"));
            return r;
        }
        Err(e) => {
            reasons.push(format!("without the pass: {e}"));
            r.outcome = Outcome::Failed(reasons);
            return r;
        }
    };
    let on = match run_and_read(backend, &run.graph, &built, &data, &read, &|t| run.tensor(t)) {
        Ok(v) => v,
        Err(e) => {
            reasons.push(format!("with the pass: {e}"));
            r.outcome = Outcome::Failed(reasons);
            return r;
        }
    };
    for ((t, on), off) in read.iter().zip(&on).zip(&off) {
        let dtype = t.dtype();
        let (bound, comparison) = if dtype.is_float() {
            let bound = fc.case.nmse_bound(dtype);
            (bound, compare_float(on, off, bound))
        } else {
            (0.0, compare_exact(on, off))
        };
        let node = node_label(&built.graph, t);
        reasons.extend(comparison.mismatches.iter().map(|m| format!("{node}: {m}")));
        r.checks.push(OutputCheck { node, dtype, bound, comparison });
    }
    if !reasons.is_empty() {
        r.outcome = Outcome::Failed(reasons);
    }
    r
}

/// `op#index` of a node of `g`, `state:name#index` for a leaf.
fn node_label(g: &Graph, t: &Tensor) -> String {
    let node = g.node(t.id());
    match &node.kind {
        NodeKind::Op(_) => format!("{}#{}", node.label(), t.id().index()),
        NodeKind::Leaf(_) => format!("state:{}#{}", node.name.as_deref().unwrap_or(node.label()), t.id().index()),
    }
}

/// Places `graph` (the case's graph, or it rewritten) on `backend` with guard bytes, sets the
/// case's leaves (`map` takes a handle of the case's graph to `graph`), runs it once and reads
/// `read` (handles of the case's graph) as f64 in logical order.
fn run_and_read(
    backend: &mut dyn Backend,
    graph: &Graph,
    built: &Built,
    data: &[Vec<u8>],
    read: &[Tensor],
    map: &dyn Fn(Tensor) -> Result<Tensor, GraphError>,
) -> Result<Vec<Vec<f64>>, ExecError> {
    let mut session =
        Session::with_options(graph, backend, SessionOptions { guard_bytes: GUARD_BYTES, ..Default::default() })?;
    for (leaf, bytes) in built.leaves.iter().zip(data) {
        session.set(map(*leaf)?, bytes)?;
    }
    session.run()?;
    read.iter().map(|&t| session.get_f64(map(t)?)).collect()
}

/// A synthetic model run twice, its passes on (all of them, or one) and off.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelCase {
    /// A `ModelConfig::preset` name.
    pub preset: &'static str,
    /// The pass switched on (`None`: every pass of the standard pipeline).
    pub pass: Option<&'static str>,
}

/// The model presets checked.
pub const MODEL_PRESETS: [&str; 2] = ["tiny", "tiny-moe"];

impl ModelCase {
    /// `model(tiny,passes=all)`.
    pub fn label(&self) -> String {
        format!("model({},passes={})", self.preset, self.pass.unwrap_or("all"))
    }
}

/// The model cases: every preset with every pass on, or with only `pass` on.
pub fn model_cases(pass: Option<&'static str>) -> Vec<ModelCase> {
    MODEL_PRESETS.iter().map(|&preset| ModelCase { preset, pass }).collect()
}

/// One step of a model case: its name, each sequence's new tokens, which logits come back.
type ModelStep = (&'static str, Vec<(u32, Vec<u32>)>, tessera_models::model::Logits);

/// The steps of a model case: a 9-token prompt (prefill, every logit), a decode step, a mixed
/// bucket (one sequence decoding, one prefilling, one starting with one token; every logit) and
/// a three-sequence decode.
fn model_steps() -> Vec<ModelStep> {
    use tessera_models::model::Logits;
    let prompt: Vec<u32> = (0..9).map(|i| (i * 37 + 5) % 256).collect();
    vec![
        ("prefill", vec![(0, prompt)], Logits::All),
        ("decode", vec![(0, vec![17])], Logits::Last),
        ("mixed", vec![(0, vec![3]), (1, vec![7, 8, 9, 10]), (2, vec![11])], Logits::All),
        ("decode3", vec![(0, vec![1]), (1, vec![2]), (2, vec![250])], Logits::Last),
    ]
}

/// Runs `mc` on `backend`: two models of the preset with the same f32 weights and f32 KV cache,
/// the passes on in one and off in the other, the same steps; every step's logits compared
/// (NMSE <= [`NMSE_F32`]: all f32, as eval bounds an all-f32 case). With every pass on, at least
/// one fusion must apply on the first step.
pub fn check_model_case(mc: &ModelCase, backend: &mut dyn Backend) -> FusionResult {
    use tessera_models::config::ModelConfig;
    use tessera_models::model::{Model, ModelOptions};
    let label = mc.label();
    let mut r = FusionResult::new(&label, "models", backend.name(), 0);
    let config = match ModelConfig::preset(mc.preset) {
        Ok(c) => c,
        Err(e) => return r.fail(format!("preset {}: {e}", mc.preset)),
    };
    let opts =
        ModelOptions { kv_blocks: 32, block_size: 4, max_context: 64, kv_dtype: DType::F32, ..ModelOptions::default() };
    let mut models: Vec<Model> = Vec::new();
    for on in [true, false] {
        let made = Model::synthetic(config.clone(), DType::F32, 11, backend, opts).and_then(|mut m| {
            m.passes_mut().set_all(false);
            if on {
                match mc.pass {
                    None => m.passes_mut().set_all(true),
                    Some(p) => m.passes_mut().set_enabled(p, true)?,
                }
            }
            Ok(m)
        });
        match made {
            Ok(m) => models.push(m),
            Err(e) => {
                for m in &mut models {
                    m.free(backend);
                }
                return r.fail(format!("the model does not load: {e}"));
            }
        }
    }
    let mut reasons = Vec::new();
    for (i, (name, batch, which)) in model_steps().into_iter().enumerate() {
        let batch: Vec<(u32, &[u32])> = batch.iter().map(|(id, t)| (*id, t.as_slice())).collect();
        let mut logits = Vec::new();
        for m in &mut models {
            match m.step(backend, &batch, which) {
                Ok(l) => logits.push(l.concat()),
                Err(e) => reasons.push(format!("{name}: the step failed: {e}")),
            }
        }
        if i == 0 {
            r.applied = models[0].pass_reports().iter().map(|p| p.applied).sum();
            r.expected = r.applied;
            if mc.pass.is_none() && r.applied == 0 {
                reasons.push("no pass applied a fusion to the step graph".into());
            }
        }
        let [on, off] = &logits[..] else { break };
        let to64 = |v: &[f32]| v.iter().map(|&x| f64::from(x)).collect::<Vec<f64>>();
        let comparison = compare_float(&to64(on), &to64(off), NMSE_F32);
        let node = format!("logits:{name}");
        reasons.extend(comparison.mismatches.iter().map(|m| format!("{node}: {m}")));
        r.checks.push(OutputCheck { node, dtype: DType::F32, bound: NMSE_F32, comparison });
    }
    for m in &mut models {
        m.free(backend);
    }
    if !reasons.is_empty() {
        r.outcome = Outcome::Failed(reasons);
    }
    r
}
