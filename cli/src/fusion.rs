//! `--no-pass` and `--fusion-report` of `tessera run` and `tessera bench`: which fusion passes
//! run on the step graphs, and what they did.

use tessera_graph::Backend;
use tessera_models::qwen35::{Bucket, FusionSummary, Model};

/// The fusion switches `run` and `bench` share.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct FusionArgs {
    /// Switch a fusion pass off (repeatable; `all` for every pass). `TESSERA_DISABLE_PASSES=a,b`
    /// does the same.
    #[arg(long = "no-pass", value_name = "NAME")]
    pub no_pass: Vec<String>,
    /// Print what each fusion pass did to a decode step's graph, and the ops the step runs with
    /// the passes and without.
    #[arg(long = "fusion-report")]
    pub report: bool,
}

/// Switches off the passes named by `--no-pass`.
pub fn apply(model: &mut Model, args: &FusionArgs) -> Result<(), String> {
    for name in &args.no_pass {
        if name == "all" {
            model.passes_mut().set_all(false);
        } else {
            model.passes_mut().set_enabled(name, false).map_err(|e| format!("--no-pass: {e}"))?;
        }
    }
    Ok(())
}

/// The passes' work on the graph of a one-sequence decode step (`kv_pad` positions), with the
/// names of the passes that are on.
pub fn summary(
    model: &Model,
    backend: &dyn Backend,
    kv_pad: usize,
) -> Result<(Vec<&'static str>, FusionSummary), String> {
    let bucket = Bucket { n_tokens: 1, n_seq: 1, n_kv: kv_pad, all_logits: false, sample: true };
    let s = model.fusion_summary(backend, bucket).map_err(|e| format!("fusion report: {e}"))?;
    Ok((model.passes().iter().filter(|(_, on)| *on).map(|(n, _)| *n).collect(), s))
}

/// Prints a [`summary`].
pub fn print((on, s): &(Vec<&'static str>, FusionSummary)) {
    outln!("fusion passes on: {}", if on.is_empty() { "none".to_string() } else { on.join(", ") });
    let change = 100.0 * (s.ops_after as f64 / s.ops_before.max(1) as f64 - 1.0);
    outln!(
        "decode step (1 sequence): {} ops run without the passes, {} with them ({change:+.1}%)",
        s.ops_before,
        s.ops_after
    );
    if !s.reports.is_empty() {
        outln!("| pass | found | applied | skipped | ops removed | MiB not written/read |");
        outln!("| --- | --- | --- | --- | --- | --- |");
        for r in &s.reports {
            let mib = r.bytes_saved as f64 / (1 << 20) as f64;
            outln!("| {} | {} | {} | {} | {} | {mib:.3} |", r.pass, r.found, r.applied, r.skipped, r.nodes_removed);
        }
    }
}
