//! `tessera-test-ops`: check every backend against its judge (`eval`), time ops (`perf`), check
//! the fusion passes (`fusion`), or list the cases (`list`).
//!
//! ```text
//! tessera-test-ops eval [--op mul_mat,softmax] [--filter type_a=f16] [--backend cpu] [-v]
//! tessera-test-ops perf --op mul_mat [--time-ms 250]
//! tessera-test-ops fusion [--backend cpu|cuda|all] [--pass rms_norm_mul] [--filter miss=] [-v]
//! tessera-test-ops list [--perf]
//! ```
//!
//! `eval` and `fusion` exit non-zero when any case fails; their last line is always `N passed, M
//! failed`.

use std::collections::BTreeMap;
use std::io::{self, Write};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Args, Parser, Subcommand};
use tessera_test_ops::backends::{self, BackendEntry};
use tessera_test_ops::{
    Case, CaseResult, Judged, Outcome, PerfBudget, Selection, catalogue, eval_case, op_names, perf_case, perf_catalogue,
};

#[derive(Parser)]
#[command(
    name = "tessera-test-ops",
    about = "Tessera's test-backend-ops: every op on every backend, against its judge"
)]
struct Cli {
    #[command(subcommand)]
    mode: Mode,
}

#[derive(Subcommand)]
enum Mode {
    /// Run each case on each selected backend and on its judge, and compare.
    Eval {
        #[command(flatten)]
        select: Select,
        /// Print every case, not only failures.
        #[arg(short, long)]
        verbose: bool,
    },
    /// Time each case on each selected backend (model-sized cases).
    Perf {
        #[command(flatten)]
        select: Select,
        /// Time budget per case, milliseconds.
        #[arg(long, default_value_t = 250)]
        time_ms: u64,
        /// Byte budget per case (by the cost model), GB.
        #[arg(long, default_value_t = 32.0)]
        bytes_gb: f64,
        /// Time the eval catalogue instead of the perf catalogue.
        #[arg(long)]
        eval_cases: bool,
        /// After each case, print the backend's counters that changed (graph captures and
        /// replays, pool reuses, ...).
        #[arg(long)]
        counters: bool,
    },
    /// Check the fusion passes: each pass of the standard pipeline on graphs with its pattern and
    /// near-misses, and the models' step graphs, with the pass on and off on each backend.
    Fusion {
        /// Backend name (repeatable or comma-separated), or `all`; default: every backend that
        /// has a judge (`ref` only when named).
        #[arg(long = "backend", value_delimiter = ',')]
        backends: Vec<String>,
        /// Only this pass (repeatable or comma-separated); the models then run with only it on.
        #[arg(long = "pass", value_delimiter = ',')]
        passes: Vec<String>,
        /// Keep only cases whose label contains this substring (`model(` for the models).
        #[arg(long)]
        filter: Option<String>,
        /// Skip the models' step graphs.
        #[arg(long)]
        no_models: bool,
        /// Print every case, not only failures.
        #[arg(short, long)]
        verbose: bool,
    },
    /// Print the labels of the selected cases.
    List {
        #[command(flatten)]
        select: Select,
        /// List the perf catalogue instead of the eval catalogue.
        #[arg(long)]
        perf: bool,
    },
}

#[derive(Args)]
struct Select {
    /// Exact op name (repeatable or comma-separated), e.g. `mul_mat`, `rms_norm`.
    #[arg(long = "op", value_delimiter = ',')]
    ops: Vec<String>,
    /// Keep only cases whose label contains this substring.
    #[arg(long)]
    filter: Option<String>,
    /// Backend name (repeatable or comma-separated); default: every backend that has a judge.
    #[arg(long = "backend", value_delimiter = ',')]
    backends: Vec<String>,
}

impl Select {
    fn selection(&self) -> Selection {
        Selection { ops: self.ops.clone(), filter: self.filter.clone() }
    }

    /// The selected cases of `all`, or an error naming the op names that no catalogue knows.
    fn cases(&self, all: Vec<Case>) -> Result<Vec<Case>, String> {
        let every: Vec<Case> = catalogue().into_iter().chain(perf_catalogue()).collect();
        let known = op_names(&every);
        let unknown: Vec<&str> = self.ops.iter().map(String::as_str).filter(|o| !known.contains(o)).collect();
        if !unknown.is_empty() {
            return Err(format!("unknown op {}; known: {}", unknown.join(", "), known.join(", ")));
        }
        Ok(self.selection().apply(all))
    }

    /// The selected backends, or an error naming the unknown ones.
    fn backends(&self, judged_only: bool) -> Result<Vec<BackendEntry>, String> {
        let all = backends::registry();
        if self.backends.is_empty() {
            return Ok(all.into_iter().filter(|e| !judged_only || e.judge.is_some()).collect());
        }
        self.backends
            .iter()
            .map(|name| {
                all.iter().find(|e| e.name == name).copied().ok_or_else(|| {
                    let names: Vec<&str> = all.iter().map(|e| e.name).collect();
                    format!("unknown backend {name}; known: {}", names.join(", "))
                })
            })
            .collect()
    }
}

/// Why the command stopped early.
enum CliError {
    /// A bad argument (unknown op or backend).
    Usage(String),
    /// Writing the report failed (e.g. a closed pipe: `... | head`).
    Io(io::Error),
}

impl From<io::Error> for CliError {
    fn from(e: io::Error) -> Self {
        CliError::Io(e)
    }
}

impl From<String> for CliError {
    fn from(e: String) -> Self {
        CliError::Usage(e)
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let outcome = match cli.mode {
        Mode::Eval { select, verbose } => eval(&select, verbose),
        Mode::Perf { select, time_ms, bytes_gb, eval_cases, counters } => {
            let budget = PerfBudget {
                time: Duration::from_millis(time_ms),
                bytes: (bytes_gb * 1e9) as u64,
                ..PerfBudget::default()
            };
            perf(&select, budget, eval_cases, counters)
        }
        Mode::Fusion { backends, passes, filter, no_models, verbose } => {
            fusion(&FusionArgs { backends, passes, filter, models: !no_models, verbose })
        }
        Mode::List { select, perf } => list(&select, perf),
    };
    match outcome {
        Ok(code) => code,
        Err(CliError::Io(e)) if e.kind() == io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(CliError::Io(e)) => {
            eprintln!("error writing the report: {e}");
            ExitCode::from(2)
        }
        Err(CliError::Usage(e)) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}

fn list(select: &Select, perf: bool) -> Result<ExitCode, CliError> {
    let mut out = io::stdout().lock();
    let cases = select.cases(if perf { perf_catalogue() } else { catalogue() })?;
    for c in &cases {
        writeln!(out, "{}", c.vars())?;
    }
    writeln!(out, "{} cases", cases.len())?;
    Ok(ExitCode::SUCCESS)
}

/// Per-op counts for the summary.
#[derive(Default)]
struct Tally {
    passed: usize,
    failed: usize,
    unsupported: usize,
    worst_nmse: f64,
}

fn eval(select: &Select, verbose: bool) -> Result<ExitCode, CliError> {
    let mut out = io::stdout().lock();
    let cases = select.cases(catalogue())?;
    let entries = select.backends(true)?;
    let start = Instant::now();
    let (mut passed, mut failed, mut unsupported, mut skipped) = (0, 0, 0, 0);
    for entry in &entries {
        let Some(judge_name) = entry.judge else {
            writeln!(out, "skipping {}: it is the root judge and has nothing to be checked against", entry.name)?;
            continue;
        };
        let judge_entry = backends::find(judge_name)
            .ok_or_else(|| format!("{}: judge {judge_name} is not registered", entry.name))?;
        writeln!(out, "== {} (judge: {judge_name}): {} cases", entry.name, cases.len())?;
        let mut tally: BTreeMap<&'static str, Tally> = BTreeMap::new();
        // One instance of each for the whole run (a device backend is costly to open); every
        // case gets fresh sessions, which free their buffers when dropped.
        let (mut backend, mut judge) = match ((entry.make)(), (judge_entry.make)()) {
            (Ok(b), Ok(j)) => (b, j),
            (Err(e), _) | (_, Err(e)) => {
                writeln!(out, "skipping {}: {e}", entry.name)?;
                skipped += 1;
                continue;
            }
        };
        for case in &cases {
            let result = eval_case(case, backend.as_mut(), judge.as_mut());
            let t = tally.entry(case.op()).or_default();
            match &result.outcome {
                Outcome::Passed => t.passed += 1,
                Outcome::Failed(_) => t.failed += 1,
                Outcome::Unsupported(_) => t.unsupported += 1,
            }
            t.worst_nmse = t.worst_nmse.max(result.max_nmse());
            if verbose || result.failed() {
                writeln!(out, "{}", case_line(&result))?;
            }
        }
        writeln!(out, "-- {} per op: passed/total, worst nmse", entry.name)?;
        let width = tally.keys().map(|op| op.len()).max().unwrap_or(0);
        for (op, t) in &tally {
            let total = t.passed + t.failed + t.unsupported;
            let extra = if t.unsupported > 0 { format!(", {} not supported", t.unsupported) } else { String::new() };
            let status = if t.failed > 0 { "FAIL" } else { "ok" };
            writeln!(out, "  {op:<width$} {:>4}/{total:<4} {:>9.2e}  {status}{extra}", t.passed, t.worst_nmse)?;
            passed += t.passed;
            failed += t.failed;
            unsupported += t.unsupported;
        }
    }
    writeln!(out, "eval took {:.1} s; {unsupported} not supported (not counted)", start.elapsed().as_secs_f64())?;
    writeln!(out, "{passed} passed, {failed} failed")?;
    // A backend asked for by name that cannot run here is a failure of the request; one picked by
    // default (every registered backend) is skipped with the message above.
    let asked_and_skipped = !select.backends.is_empty() && skipped > 0;
    Ok(if failed == 0 && !asked_and_skipped { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// `  cpu  label  nmse=1.2e-9 <= 1e-7  OK` or `... FAIL: reason`.
fn case_line(r: &CaseResult) -> String {
    let status = match &r.outcome {
        Outcome::Passed => "OK".to_string(),
        Outcome::Failed(_) => format!("FAIL: {}", r.reason()),
        Outcome::Unsupported(why) => format!("not supported: {why}"),
    };
    let bound = if r.bound() > 0.0 { format!("{:.0e}", r.bound()) } else { "exact".to_string() };
    format!("  {:<4} {}  nmse={:.2e} <= {bound}  {status}", r.backend, r.label, r.max_nmse())
}

struct FusionArgs {
    backends: Vec<String>,
    passes: Vec<String>,
    filter: Option<String>,
    models: bool,
    verbose: bool,
}

/// Per-pass counts for the fusion summary.
#[derive(Default)]
struct PassTally {
    passed: usize,
    failed: usize,
    unsupported: usize,
    fusions: usize,
    worst_nmse: f64,
}

fn fusion(args: &FusionArgs) -> Result<ExitCode, CliError> {
    use tessera_test_ops::fusion::{
        FusionResult, check_fusion_case, check_model_case, generator_gaps, model_cases, only, pass_generators,
    };
    let mut out = io::stdout().lock();
    let standard = tessera_graph::passes::standard();
    let names: Vec<&'static str> = standard.passes().into_iter().map(|(n, _)| n).collect();
    let unknown: Vec<&str> = args.passes.iter().map(String::as_str).filter(|p| !names.contains(p)).collect();
    if !unknown.is_empty() {
        return Err(format!("unknown pass {}; passes: {}", unknown.join(", "), names.join(", ")).into());
    }
    let chosen: Vec<&'static str> =
        names.iter().copied().filter(|n| args.passes.is_empty() || args.passes.iter().any(|p| p == n)).collect();
    let keep = |label: &str| args.filter.as_deref().is_none_or(|f| label.contains(f));
    let start = Instant::now();
    let (mut passed, mut failed, mut unsupported, mut skipped) = (0, 0, 0, 0);

    // A pass without a generator (or a generator without a pass) fails the run once.
    for gap in generator_gaps(&standard) {
        writeln!(out, "FAIL: {gap}")?;
        failed += 1;
    }
    let gens = pass_generators();
    let mut cases = Vec::new();
    for &pass in &chosen {
        let Some(g) = gens.iter().find(|g| g.pass == pass) else { continue };
        let pipeline = only(pass).map_err(|e| e.to_string())?;
        let mine: Vec<_> = (g.cases)().into_iter().filter(|c| keep(c.vars())).collect();
        cases.push((pass, pipeline, mine));
    }
    let models: Vec<_> = if !args.models {
        Vec::new()
    } else if args.passes.is_empty() {
        model_cases(None)
    } else {
        chosen.iter().flat_map(|&p| model_cases(Some(p))).collect()
    };
    let models: Vec<_> = models.into_iter().filter(|m| keep(&m.label())).collect();

    let all = backends::registry();
    let entries: Vec<BackendEntry> = if args.backends.is_empty() || args.backends.iter().any(|b| b == "all") {
        all.into_iter().filter(|e| e.judge.is_some()).collect()
    } else {
        let select = Select { ops: Vec::new(), filter: None, backends: args.backends.clone() };
        select.backends(false)?
    };
    for entry in &entries {
        let n_cases: usize = cases.iter().map(|(_, _, c)| c.len()).sum();
        writeln!(out, "== {}: {n_cases} pass cases, {} model cases", entry.name, models.len())?;
        let mut backend = match (entry.make)() {
            Ok(b) => b,
            Err(e) => {
                writeln!(out, "skipping {}: {e}", entry.name)?;
                skipped += 1;
                continue;
            }
        };
        let mut tally: Vec<(&str, PassTally)> = Vec::new();
        let mut record = |pass: &'static str, r: &FusionResult, out: &mut io::StdoutLock<'_>| -> io::Result<()> {
            let i = match tally.iter().position(|(p, _)| *p == pass) {
                Some(i) => i,
                None => {
                    tally.push((pass, PassTally::default()));
                    tally.len() - 1
                }
            };
            let t = &mut tally[i].1;
            match &r.outcome {
                Outcome::Passed => t.passed += 1,
                Outcome::Failed(_) => t.failed += 1,
                Outcome::Unsupported(_) => t.unsupported += 1,
            }
            t.fusions += r.applied;
            t.worst_nmse = t.worst_nmse.max(r.max_nmse());
            if args.verbose || r.failed() {
                writeln!(out, "{}", fusion_line(r))?;
            }
            Ok(())
        };
        for (pass, pipeline, list) in &cases {
            for c in list {
                let r = check_fusion_case(c, pipeline, backend.as_mut());
                record(pass, &r, &mut out)?;
            }
        }
        for m in &models {
            let r = check_model_case(m, backend.as_mut());
            record("models", &r, &mut out)?;
        }
        writeln!(out, "-- {} per pass: passed/total, fusions applied, worst nmse (on vs off)", entry.name)?;
        let width = tally.iter().map(|(p, _)| p.len()).max().unwrap_or(0);
        for (pass, t) in &tally {
            let total = t.passed + t.failed + t.unsupported;
            let extra = if t.unsupported > 0 { format!(", {} not supported", t.unsupported) } else { String::new() };
            let status = if t.failed > 0 { "FAIL" } else { "ok" };
            writeln!(
                out,
                "  {pass:<width$} {:>4}/{total:<4} {:>5} fusions {:>9.2e}  {status}{extra}",
                t.passed, t.fusions, t.worst_nmse
            )?;
            passed += t.passed;
            failed += t.failed;
            unsupported += t.unsupported;
        }
    }
    writeln!(out, "fusion took {:.1} s; {unsupported} not supported (not counted)", start.elapsed().as_secs_f64())?;
    writeln!(out, "{passed} passed, {failed} failed")?;
    let asked_and_skipped = !args.backends.is_empty() && skipped > 0;
    Ok(if failed == 0 && !asked_and_skipped { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// `  cpu  label  fusions 1/1  nmse=0.00e0 <= 1e-7  OK` or `... FAIL: reason`.
fn fusion_line(r: &tessera_test_ops::fusion::FusionResult) -> String {
    let status = match &r.outcome {
        Outcome::Passed => "OK".to_string(),
        Outcome::Failed(_) => format!("FAIL: {}", r.reason()),
        Outcome::Unsupported(why) => format!("not supported: {why}"),
    };
    let bound = if r.bound() > 0.0 { format!("{:.0e}", r.bound()) } else { "exact".to_string() };
    format!(
        "  {:<4} {}  fusions {}/{}  nmse={:.2e} <= {bound}  {status}",
        r.backend,
        r.label,
        r.applied,
        r.expected,
        r.max_nmse()
    )
}

fn perf(select: &Select, budget: PerfBudget, eval_cases: bool, counters: bool) -> Result<ExitCode, CliError> {
    let mut out = io::stdout().lock();
    let cases = select.cases(if eval_cases { catalogue() } else { perf_catalogue() })?;
    let entries = select.backends(true)?;
    if cases.is_empty() {
        writeln!(out, "no perf cases selected (--eval-cases times the eval catalogue)")?;
        return Ok(ExitCode::SUCCESS);
    }
    let width = cases.iter().map(|c| c.vars().len()).max().unwrap_or(0);
    let mut errors = 0;
    for entry in &entries {
        let mut backend = match (entry.make)() {
            Ok(b) => b,
            Err(e) => {
                writeln!(out, "skipping {}: {e}", entry.name)?;
                errors += usize::from(!select.backends.is_empty());
                continue;
            }
        };
        // Device backends report the share of the device's measured ceilings.
        let ceilings = backends::ceilings(entry.name);
        match &ceilings {
            Some((device, copy, tc)) => writeln!(
                out,
                "== {} on {device}: measured copy {copy:.0} GB/s (read + write), bf16 GEMM {tc:.0} TFLOP/s",
                entry.name
            )?,
            None => writeln!(out, "== {}", entry.name)?,
        }
        writeln!(
            out,
            "{:<width$}  {:>12}  {:>9}  {:>9}  {:>7}  {:>7}",
            "case", "us/run", "GB/s", "GFLOP/s", "%copy", "%tc"
        )?;
        for case in &cases {
            let before = backend.counters();
            let result = perf_case(case, backend.as_mut(), budget);
            match result {
                Ok(r) => {
                    let (pc, pt) = match &ceilings {
                        Some((_, copy, tc)) => (
                            format!("{:.1}", 100.0 * r.gb_per_s / copy),
                            format!("{:.1}", 100.0 * r.gflop_per_s / 1e3 / tc),
                        ),
                        None => ("-".into(), "-".into()),
                    };
                    writeln!(
                        out,
                        "{:<width$}  {:>12.2}  {:>9.2}  {:>9.2}  {pc:>7}  {pt:>7}",
                        r.label, r.us_per_run, r.gb_per_s, r.gflop_per_s
                    )?
                }
                Err(tessera_graph::ExecError::Unsupported { .. }) => {
                    writeln!(out, "{:<width$}  not supported", case.vars())?
                }
                Err(e) => {
                    errors += 1;
                    writeln!(out, "{:<width$}  error: {e}", case.vars())?
                }
            }
            if counters {
                let changed: Vec<String> = backend
                    .counters()
                    .iter()
                    .zip(&before)
                    .filter(|(now, then)| now.1 != then.1)
                    .map(|(now, then)| format!("{} +{}", now.0, now.1.saturating_sub(then.1)))
                    .collect();
                writeln!(out, "  counters: {}", changed.join(", "))?;
            }
        }
    }
    Ok(if errors == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}
