//! `tessera-test-ops`: check every backend against its judge (`eval`), time ops (`perf`), or
//! list the cases (`list`).
//!
//! ```text
//! tessera-test-ops eval [--op mul_mat,softmax] [--filter type_a=f16] [--backend cpu] [-v]
//! tessera-test-ops perf --op mul_mat [--time-ms 250]
//! tessera-test-ops list [--perf]
//! ```
//!
//! `eval` exits non-zero when any case fails; its last line is always `N passed, M failed`.

use std::collections::BTreeMap;
use std::io::{self, Write};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Args, Parser, Subcommand};
use tessera_test_ops::backends::{self, BackendEntry};
use tessera_test_ops::{
    Case, CaseResult, Outcome, PerfBudget, Selection, catalogue, eval_case, op_names, perf_case, perf_catalogue,
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
