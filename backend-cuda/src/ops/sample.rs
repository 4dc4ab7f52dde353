//! sample: one token id per row of logits (`kernels/sample.cu`), the CPU's exact integer rule.
//!
//! Five launches on the stream, whatever the settings (rows that need less return at once):
//! per-chunk stats, per-chunk bin histograms, a plan per row (greedy rows, rows that keep every
//! token, and large top-k / top-p selections finish here), the gather of small candidate sets and
//! their sort-and-draw. Nothing waits for the host; bad settings and rows of NaN logits are
//! reported through the device error record.

use tessera_graph::{BackendError, Task};
use tessera_ops::{DType, Op, TensorMeta};

use crate::compile::{Kernel, Module};
use crate::errors::op_code;
use crate::launch::{Cx, GRID_YZ, TensorArg, config, unsupported};

const STATS: Kernel = Kernel::new(Module::Sample, "sample_stats");
const HIST: Kernel = Kernel::new(Module::Sample, "sample_hist");
const PLAN: Kernel = Kernel::new(Module::Sample, "sample_plan");
const GATHER: Kernel = Kernel::new(Module::Sample, "sample_gather");
const SMALL: Kernel = Kernel::new(Module::Sample, "sample_small");

/// TAG(sample-limits): `SMP_CHUNK`, `SMP_THREADS`, `SMP_BINS`, `SMP_CAP`, `SMP_BIG_THREADS` in
/// sample.cu.
const CHUNK: usize = 2048;
const THREADS: u32 = 256;
const BINS: usize = 64;
const CAP: usize = 2048;
const ROW_THREADS: u32 = 1024;
/// `sizeof(SmpStat)`, `sizeof(SmpPlan)` in sample.cu.
const STAT_BYTES: usize = 16;
const PLAN_BYTES: usize = 32;

/// f32 logits with dense rows and f32 settings (the shape rules check the rest); rows fit a grid
/// dimension.
pub(crate) fn supports(op: &Op, inputs: &[TensorMeta]) -> bool {
    match (op, inputs) {
        (Op::Sample, [logits, settings]) => {
            logits.dtype == DType::F32 && settings.dtype == DType::F32 && logits.ne[1] as i64 <= GRID_YZ
        }
        _ => false,
    }
}

/// Byte offsets of the scratch areas of a call with `rows` rows of `n` logits, and the total.
struct Layout {
    first_nan: usize,
    stats: usize,
    hcount: usize,
    hmass: usize,
    ctotal: usize,
    plans: usize,
    ccount: usize,
    cand: usize,
    total: usize,
}

impl Layout {
    fn new(n: usize, rows: usize) -> Layout {
        let chunks = n.div_ceil(CHUNK).max(1);
        let mut at = 0;
        let mut area = |bytes: usize| {
            let start = at;
            at = (at + bytes).next_multiple_of(16);
            start
        };
        let first_nan = area(16);
        let stats = area(rows * chunks * STAT_BYTES);
        let hcount = area(rows * chunks * BINS * 4);
        let hmass = area(rows * chunks * BINS * 8);
        let ctotal = area(rows * chunks * 8);
        let plans = area(rows * PLAN_BYTES);
        let ccount = area(rows * 4);
        let cand = area(rows * CAP * 4);
        Layout { first_nan, stats, hcount, hmass, ctotal, plans, ccount, cand, total: at }
    }
}

pub(crate) fn scratch_bytes(task: &Task<'_>) -> usize {
    match task.inputs.first() {
        Some(l) => Layout::new(l.meta.ne[0], l.meta.ne[1]).total,
        None => 0,
    }
}

pub(crate) fn run(cx: &mut Cx<'_>, task: &Task<'_>, ins: &[TensorArg], out: TensorArg) -> Result<(), BackendError> {
    let [logits, settings] = ins else { return Err(unsupported(task, "sample takes [logits, settings]")) };
    let (n, rows) = (logits.ne[0] as usize, logits.ne[1] as usize);
    if n == 0 || rows == 0 {
        return Ok(());
    }
    let chunks = n.div_ceil(CHUNK) as u32;
    let chunks_arg = chunks as i64;
    let lay = Layout::new(n, rows);
    let at = |offset: usize| cx.scratch + offset as u64;
    let (first_nan, stats, hcount, hmass, ctotal) =
        (at(lay.first_nan), at(lay.stats), at(lay.hcount), at(lay.hmass), at(lay.ctotal));
    let (plans, ccount, cand) = (at(lay.plans), at(lay.ccount), at(lay.cand));
    let (err, op) = (cx.errors, op_code("sample"));
    let grid = (chunks, rows as u32, 1);

    let mut a = cx.kernel(STATS)?;
    a.arg(logits).arg(settings).arg(&stats).arg(&ccount).arg(&first_nan).arg(&err).arg(&op);
    // SAFETY: `sample_stats(logits, settings, stats, ccount, first_nan, err, op)`; grid (chunks,
    // rows) with chunks * CHUNK >= n; the shape rules give f32 logits [n, rows] with dense rows and
    // f32 settings [4, rows]; stats holds rows * chunks SmpStat, ccount rows u32, first_nan one
    // int (Layout, within scratch_bytes).
    unsafe { a.launch(config(grid, (THREADS, 1, 1), 0)) }?;

    let mut a = cx.kernel(HIST)?;
    a.arg(logits).arg(settings).arg(&stats).arg(&hcount).arg(&hmass).arg(&ctotal);
    // SAFETY: `sample_hist(logits, settings, stats, hcount, hmass, ctotal)`; same grid; reads the
    // stats written above and writes rows * chunks * BINS counts and masses, or rows * chunks
    // chunk masses (Layout).
    unsafe { a.launch(config(grid, (THREADS, 1, 1), 0)) }?;

    let mut a = cx.kernel(PLAN)?;
    a.arg(&out)
        .arg(logits)
        .arg(settings)
        .arg(&stats)
        .arg(&hcount)
        .arg(&hmass)
        .arg(&ctotal)
        .arg(&plans)
        .arg(&first_nan)
        .arg(&chunks_arg);
    // SAFETY: `sample_plan(dst, logits, settings, stats, hcount, hmass, ctotal, plans, first_nan,
    // chunks)`;
    // one block of ROW_THREADS (1024, which its bin merge assumes) per row; dst is i32 [1, rows];
    // every index it writes is a row's element below n (or 0).
    unsafe { a.launch(config((rows as u32, 1, 1), (ROW_THREADS, 1, 1), 0)) }?;

    let mut a = cx.kernel(GATHER)?;
    a.arg(logits).arg(settings).arg(&plans).arg(&ccount).arg(&cand);
    // SAFETY: `sample_gather(logits, settings, plans, ccount, cand)`; grid (chunks, rows); writes
    // at most CAP ids per row into cand (rows * CAP u32), counting in ccount (zeroed by
    // sample_stats).
    unsafe { a.launch(config(grid, (THREADS, 1, 1), 0)) }?;

    let mut a = cx.kernel(SMALL)?;
    a.arg(&out).arg(logits).arg(settings).arg(&plans).arg(&ccount).arg(&cand).arg(&first_nan).arg(&err).arg(&op);
    // SAFETY: `sample_small(dst, logits, settings, plans, ccount, cand, first_nan, err, op)`; one
    // block of ROW_THREADS per row (its scans assume CAP / 1024 items a thread); reads at most CAP
    // candidate ids per row, each below n.
    unsafe { a.launch(config((rows as u32, 1, 1), (ROW_THREADS, 1, 1), 0)) }?;
    Ok(())
}
