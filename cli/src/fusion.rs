//! `--no-pass` and `--fusion-report` of `tessera run` and `tessera bench`: which fusion passes
//! run on the step graphs, and what they did.

use tessera_graph::Backend;
use tessera_models::model::{Bucket, FusionSummary, Model};

/// The fusion switches `run` and `bench` share.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct FusionArgs {
    /// Switch a fusion pass off (repeatable; `all` for every pass). `TESSERA_DISABLE_PASSES=a,b`
    /// does the same.
    #[arg(long = "no-pass", value_name = "NAME")]
    pub no_pass: Vec<String>,
    /// Print what each fusion pass did to a decode step's graph, the ops the step runs with the
    /// passes and without, and those it runs with them by kind.
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

/// Kernel launches of a one-sequence decode step (3-token prompt, then one token, greedy) with
/// every pass off and with the passes as set, where the backend counts them (its
/// `kernel_launches` counter, the CUDA backend); `None` elsewhere. The step graphs are built
/// again for each, and the sequence used is removed afterwards.
pub fn launches(model: &mut Model, backend: &mut dyn Backend) -> Result<Option<[u64; 2]>, String> {
    let count = |b: &dyn Backend| b.counters().into_iter().find(|(k, _)| *k == "kernel_launches").map(|(_, v)| v);
    if count(backend).is_none() {
        return Ok(None);
    }
    let set = model.passes();
    let mut out = [0; 2];
    for (i, on) in [false, true].into_iter().enumerate() {
        for &(name, was) in &set {
            model.passes_mut().set_enabled(name, on && was).map_err(|e| e.to_string())?;
        }
        model.drop_step_graphs(&mut [&mut *backend]);
        let err = |e: tessera_models::model::ModelError| format!("fusion report: {e}");
        model.add_sequence(PROBE).map_err(err)?;
        let ran = model.step_greedy(backend, &[(PROBE, &[1, 2, 3])]).and_then(|_| {
            let before = count(backend).unwrap_or(0);
            model.step_greedy(backend, &[(PROBE, &[4])])?;
            Ok(count(backend).unwrap_or(0) - before)
        });
        model.remove_sequence(PROBE).map_err(err)?;
        out[i] = ran.map_err(err)?;
    }
    Ok(Some(out))
}

/// The sequence id [`launches`] runs its steps as (removed afterwards).
const PROBE: u32 = 0;

/// Prints the kernel launches of [`launches`].
pub fn print_launches([off, on]: [u64; 2]) {
    let change = 100.0 * (on as f64 / off.max(1) as f64 - 1.0);
    outln!("decode step (1 sequence): {off} kernel launches without the passes, {on} with them ({change:+.1}%)");
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
    let kinds: Vec<String> = s.kinds_after.iter().map(|(name, n)| format!("{name} {n}")).collect();
    outln!("ops the step runs, by kind: {}", kinds.join(", "));
    if !s.reports.is_empty() {
        outln!("| pass | found | applied | skipped | ops removed | MiB not written/read |");
        outln!("| --- | --- | --- | --- | --- | --- |");
        for r in &s.reports {
            let mib = r.bytes_saved as f64 / (1 << 20) as f64;
            outln!("| {} | {} | {} | {} | {} | {mib:.3} |", r.pass, r.found, r.applied, r.skipped, r.nodes_removed);
        }
    }
}
