//! Fusion passes: graph rewrites anyone can write, switch off, verify and measure.
//!
//! A [`Pass`] looks at a graph and returns the [`Fusion`]s it found, without changing anything;
//! a [`Pipeline`] runs its passes in order between building a graph and planning it: it keeps
//! each found fusion that is safe ([`Graph::check_fusion`]), does not overlap one kept before,
//! and whose fused op the target backend supports, rebuilds the graph with them
//! ([`Graph::fuse`]) and reports what each pass did ([`PassReport`]). Passes are named and can
//! be switched off by name from the API ([`Pipeline::set_enabled`]) or the environment
//! (`TESSERA_DISABLE_PASSES=a,b`, [`Pipeline::disable_from_env`]); the graph after any pass can
//! be dumped as DOT with the fused nodes drawn as clusters ([`Pipeline::dump_after`]).
//!
//! Writing a pass: docs/FUSION.md. The [`pattern::Matcher`] answers the questions a pattern asks
//! (which op, who reads it, may it be swallowed) with the guards that keep a rewrite safe.

mod attention_gate;
mod delta_net;
mod elementwise;
mod fold_scales;
mod gate_up;
mod moe_router;
mod moe_weighted_sum;
mod norms;
pub mod pattern;

pub use attention_gate::AttentionGate;
pub use delta_net::DeltaNetPrep;
pub use elementwise::ElementwiseChains;
pub use fold_scales::FoldScales;
pub use gate_up::GateUpSwiglu;
pub use moe_router::{MoeRouter, MoeWeights, SoftmaxTopK};
pub use moe_weighted_sum::MoeWeightedSum;
pub use norms::{AddRmsNormMul, GatedRmsNorm, RmsNormMul, RmsNormMulRope};

use tessera_ops::{Op, TensorMeta};

use crate::graph::{Graph, GraphError, NodeId};
use crate::rewrite::{Fusion, Remap};

/// A graph rewrite: finds fusions in a graph.
pub trait Pass: Send + Sync {
    /// Stable lower-case name (`rms_norm_mul`), used to switch the pass off and in reports.
    fn name(&self) -> &'static str;

    /// The fusions this pass would apply to `g`, in build order. It may return overlapping or
    /// unsafe candidates: the pipeline keeps only those [`Graph::check_fusion`] accepts, in
    /// order, skipping any that overlaps one kept before.
    fn find(&self, g: &Graph) -> Vec<Fusion>;
}

/// What one pass did to one graph.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PassReport {
    pub pass: &'static str,
    /// Fusions the pass found.
    pub found: usize,
    /// Fusions applied.
    pub applied: usize,
    /// Found but not applied: unsafe (see [`Graph::check_fusion`]), overlapping an applied one,
    /// or a fused op the backend does not support.
    pub skipped: usize,
    /// Ops that run (views not counted) removed from the graph.
    pub nodes_removed: usize,
    /// Intermediate bytes no longer written and read.
    pub bytes_saved: u64,
}

/// A switch that named a pass the pipeline does not have.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown pass `{name}` (passes: {known})")]
pub struct UnknownPass {
    pub name: String,
    pub known: String,
}

/// The environment variable naming passes to switch off, comma-separated.
pub const DISABLE_ENV: &str = "TESSERA_DISABLE_PASSES";

/// An ordered list of named passes, each on or off.
#[derive(Default)]
pub struct Pipeline {
    passes: Vec<(Box<dyn Pass>, bool)>,
    /// The pass after which [`Pipeline::run`] renders the graph as DOT.
    dump: Option<String>,
}

/// What [`Pipeline::run`] gives back.
#[derive(Debug)]
pub struct PassRun {
    /// The rewritten graph.
    pub graph: Graph,
    /// Where every node of the input graph went (`None`: no pass ran, the graph is the input).
    pub remap: Option<Remap>,
    /// One report per enabled pass, in order.
    pub reports: Vec<PassReport>,
    /// The graph after the pass named in [`Pipeline::dump_after`], as DOT, the nodes that pass
    /// made drawn as clusters.
    pub dot: Option<String>,
}

impl PassRun {
    /// `t` (a handle of the input graph) in the rewritten graph.
    pub fn tensor(&self, t: crate::Tensor) -> Result<crate::Tensor, GraphError> {
        match &self.remap {
            Some(r) => r.tensor(t),
            None => Ok(t),
        }
    }
}

impl std::fmt::Debug for Pipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let passes: Vec<String> =
            self.passes.iter().map(|(p, on)| format!("{}{}", p.name(), if *on { "" } else { " (off)" })).collect();
        f.debug_struct("Pipeline").field("passes", &passes).field("dump", &self.dump).finish()
    }
}

/// The built-in passes, all on, in the order they run.
pub fn standard() -> Pipeline {
    Pipeline::new()
        .with(AddRmsNormMul)
        .with(GatedRmsNorm)
        .with(RmsNormMul)
        .with(RmsNormMulRope)
        .with(AttentionGate)
        .with(SoftmaxTopK)
        .with(MoeWeights)
        .with(MoeRouter)
        .with(MoeWeightedSum)
        .with(FoldScales)
        .with(ElementwiseChains)
        .with(DeltaNetPrep)
        .with(GateUpSwiglu)
}

impl Pipeline {
    /// An empty pipeline (runs nothing).
    pub fn new() -> Pipeline {
        Pipeline::default()
    }

    /// Appends `pass`, switched on.
    pub fn with(mut self, pass: impl Pass + 'static) -> Pipeline {
        self.passes.push((Box::new(pass), true));
        self
    }

    /// The passes' names, in order, with whether each is on.
    pub fn passes(&self) -> Vec<(&'static str, bool)> {
        self.passes.iter().map(|(p, on)| (p.name(), *on)).collect()
    }

    fn known(&self) -> String {
        let names: Vec<&str> = self.passes.iter().map(|(p, _)| p.name()).collect();
        if names.is_empty() { "none".into() } else { names.join(", ") }
    }

    /// Switches the pass `name` on or off.
    pub fn set_enabled(&mut self, name: &str, on: bool) -> Result<(), UnknownPass> {
        let known = self.known();
        let (_, flag) = self
            .passes
            .iter_mut()
            .find(|(p, _)| p.name() == name)
            .ok_or_else(|| UnknownPass { name: name.to_string(), known })?;
        *flag = on;
        Ok(())
    }

    /// Switches every pass on or off.
    pub fn set_all(&mut self, on: bool) {
        for (_, flag) in &mut self.passes {
            *flag = on;
        }
    }

    /// Switches off the passes named in `TESSERA_DISABLE_PASSES` (comma-separated; `all` for
    /// every pass). An unknown name is an error, so a typo does not silently leave a pass on.
    pub fn disable_from_env(&mut self) -> Result<(), UnknownPass> {
        let Ok(list) = std::env::var(DISABLE_ENV) else { return Ok(()) };
        for name in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            if name == "all" {
                self.set_all(false);
            } else {
                self.set_enabled(name, false)?;
            }
        }
        Ok(())
    }

    /// Have [`Pipeline::run`] render the graph after the pass `name` as DOT ([`PassRun::dot`]).
    pub fn dump_after(&mut self, name: &str) -> Result<(), UnknownPass> {
        if !self.passes.iter().any(|(p, _)| p.name() == name) {
            return Err(UnknownPass { name: name.to_string(), known: self.known() });
        }
        self.dump = Some(name.to_string());
        Ok(())
    }

    /// Runs the enabled passes on `g` in order. `supports` says whether the backend the graph
    /// will run on has an op for these input descriptors: a fusion whose fused op it lacks is
    /// skipped.
    pub fn run(&self, g: Graph, supports: &dyn Fn(&Op, &[TensorMeta]) -> bool) -> Result<PassRun, GraphError> {
        let mut g = g;
        let mut remap: Option<Remap> = None;
        let mut reports = Vec::new();
        let mut dot = None;
        for (pass, on) in &self.passes {
            if !*on {
                continue;
            }
            let found = pass.find(&g);
            let mut kept: Vec<Fusion> = Vec::new();
            let mut taken: std::collections::HashSet<NodeId> = std::collections::HashSet::new();
            for f in &found {
                let inputs: Vec<TensorMeta> = f.inputs.iter().map(|&i| g.node(i).meta).collect();
                if f.nodes.iter().any(|n| taken.contains(n)) || !supports(&f.op, &inputs) || g.check_fusion(f).is_err()
                {
                    continue;
                }
                taken.extend(f.nodes.iter().copied());
                kept.push(f.clone());
            }
            let (new, step, stats) = g.fuse(&kept)?;
            reports.push(PassReport {
                pass: pass.name(),
                found: found.len(),
                applied: kept.len(),
                skipped: found.len() - kept.len(),
                nodes_removed: stats.nodes_removed,
                bytes_saved: stats.bytes_saved,
            });
            if self.dump.as_deref() == Some(pass.name()) {
                let clusters = fused_clusters(&new, &step, &kept, &g, pass.name());
                dot = Some(new.to_dot_clustered(&clusters));
            }
            remap = Some(match remap {
                None => step,
                Some(r) => r.then(&step),
            });
            g = new;
        }
        Ok(PassRun { graph: g, remap, reports, dot })
    }
}

/// The new graph's fused nodes (and their stand-in views), one cluster per fusion.
fn fused_clusters(new: &Graph, remap: &Remap, kept: &[Fusion], old: &Graph, pass: &str) -> Vec<(String, Vec<NodeId>)> {
    kept.iter()
        .filter_map(|f| {
            let mut ids = Vec::new();
            for &(node, how) in &f.outputs {
                // the stand-in, then each view under it down to the fused node
                let mut id = remap.tensor(old.tensor(node)?).ok()?.id();
                ids.push(id);
                for _ in how.views() {
                    id = new.node(id).inputs[0];
                    ids.push(id);
                }
            }
            ids.sort_unstable();
            ids.dedup();
            Some((format!("{pass}: {}", f.op.name()), ids))
        })
        .collect()
}
