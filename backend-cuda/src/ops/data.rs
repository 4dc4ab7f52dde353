//! Data movement: get_rows, set_rows, cpy / cast / cont, concat, repeat (`kernels/data.cu`).
//!
//! Values move through f32 registers; when source and destination are both i32 the kernels get
//! `DT_F32` for both, so the bit patterns move unchanged. Rows that are dense and 16-byte aligned
//! take the 8-values-per-thread paths (16-byte loads and stores).

use tessera_graph::{BackendError, Task};
use tessera_ops::{DType, Op, TensorMeta};

use crate::compile::{Kernel, Module};
use crate::errors::op_code;
use crate::launch::{Cx, TensorArg, blocks_for, config, dt, unsupported};

const COPY_GENERAL: Kernel = Kernel::new(Module::Data, "copy_general");
const COPY_FLAT: Kernel = Kernel::new(Module::Data, "copy_flat");
/// `copy_flat_{src}_{dst}`: contiguous, 16-byte aligned, dtypes fixed at compile time.
const COPY_FLAT_TYPED: [[Kernel; 3]; 3] = [
    [
        Kernel::new(Module::Data, "copy_flat_f32_f32"),
        Kernel::new(Module::Data, "copy_flat_f32_f16"),
        Kernel::new(Module::Data, "copy_flat_f32_bf16"),
    ],
    [
        Kernel::new(Module::Data, "copy_flat_f16_f32"),
        Kernel::new(Module::Data, "copy_flat_f16_f16"),
        Kernel::new(Module::Data, "copy_flat_f16_bf16"),
    ],
    [
        Kernel::new(Module::Data, "copy_flat_bf16_f32"),
        Kernel::new(Module::Data, "copy_flat_bf16_f16"),
        Kernel::new(Module::Data, "copy_flat_bf16_bf16"),
    ],
];
const COPY_ROWS: Kernel = Kernel::new(Module::Data, "copy_rows");
const COPY_TRANSPOSE: Kernel = Kernel::new(Module::Data, "copy_transpose");
const GET_ROWS: Kernel = Kernel::new(Module::Data, "get_rows");
const SET_ROWS: Kernel = Kernel::new(Module::Data, "set_rows");
const CONCAT: Kernel = Kernel::new(Module::Data, "concat");
const REPEAT: Kernel = Kernel::new(Module::Data, "repeat");

const THREADS: u32 = 256;

/// set_rows blocks each check every id before writing, so the grid is capped (blocks loop over
/// the rows).
const SET_ROWS_MAX_BLOCKS: u32 = 1024;
/// Up to this many ids per slice, set_rows makes the last of duplicate ids win (a quadratic check).
const SET_ROWS_DEDUP_MAX: i64 = 4096;

/// The shape rules already restrict the dtypes to what the kernels read: any dtype for the
/// source of get_rows and set_rows (quantized rows are decoded), plain dtypes everywhere else.
/// Row ids (the last input of get_rows and set_rows) must number fewer than 2^31.
pub(crate) fn supports(op: &Op, inputs: &[TensorMeta]) -> bool {
    match op {
        // The kernels index ids with 32-bit math.
        Op::GetRows | Op::SetRows => inputs.last().is_some_and(|ids| ids.nelements() < (1 << 31)),
        Op::Cpy | Op::Cast(_) | Op::Cont | Op::Concat { .. } | Op::Repeat { .. } => {
            inputs.iter().all(|m| !m.dtype.is_quantized())
        }
        _ => false,
    }
}

#[allow(dead_code)]
pub(crate) fn scratch_bytes(_task: &Task<'_>) -> usize {
    0
}

/// The dtype codes a kernel gets for moving `src` to `dst`: i32 to i32 moves as raw 32-bit words.
fn move_codes(src: DType, dst: DType) -> (i32, i32) {
    if src == DType::I32 && dst == DType::I32 { (dt(DType::F32), dt(DType::F32)) } else { (dt(src), dt(dst)) }
}

/// True when every row of `t` (of dtype `d`) is dense and starts 16-byte aligned, so the rows can
/// be moved 8 values at a time (the caller checks that ne0 is a multiple of 8).
fn rows_aligned(t: &TensorArg, d: DType) -> bool {
    !d.is_quantized()
        && t.nb[0] == d.block_bytes() as i64
        && t.data.is_multiple_of(16)
        && (1..4).all(|i| t.ne[i] == 1 || t.nb[i] % 16 == 0)
}

/// Threads per row for a row of `ne0` values moved 8 at a time (or one at a time when not `vec`).
fn row_threads(ne0: i64, vec: bool) -> u32 {
    let work = if vec { ne0 / 8 } else { ne0 };
    (work.clamp(1, THREADS as i64) as u32).next_multiple_of(32)
}

pub(crate) fn run(cx: &mut Cx<'_>, task: &Task<'_>, ins: &[TensorArg], out: TensorArg) -> Result<(), BackendError> {
    let odt = task.output.meta.dtype;
    let idt = |i: usize| task.inputs[i].meta.dtype;
    match task.op {
        Op::GetRows => get_rows(cx, out, odt, ins[0], idt(0), ins[1]),
        Op::SetRows => {
            // The output aliases the destination input; a task placing them apart gets the old
            // values copied over first.
            if out != ins[0] {
                copy(cx, out, odt, ins[0], idt(0))?;
            }
            set_rows(cx, out, odt, ins[1], idt(1), ins[2])
        }
        Op::Cpy | Op::Cast(_) | Op::Cont => copy(cx, out, odt, ins[0], idt(0)),
        Op::Concat { dim } => concat(cx, out, ins[0], ins[1], idt(0), *dim),
        Op::Repeat { .. } => repeat(cx, out, ins[0], idt(0)),
        _ => Err(unsupported(task, "not a data op")),
    }
}

/// Element e of `src` (logical order) to element e of `dst` (same element count), converting.
fn copy(cx: &mut Cx<'_>, dst: TensorArg, ddt: DType, src: TensorArg, sdt: DType) -> Result<(), BackendError> {
    let (sc, dc) = move_codes(sdt, ddt);
    let n = dst.nelements();
    let dense = |t: &TensorArg, d: DType| {
        let mut expect = d.block_bytes() as i64;
        (0..4).all(|i| {
            let ok = t.ne[i] == 1 || t.nb[i] == expect;
            expect *= t.ne[i];
            ok
        })
    };
    if dense(&dst, ddt) && dense(&src, sdt) {
        let aligned = dst.data.is_multiple_of(16) && src.data.is_multiple_of(16);
        // Index of a float dtype code in COPY_FLAT_TYPED (i32 moves as f32).
        let slot = |code: i32| [DType::F32, DType::F16, DType::BF16].iter().position(|d| dt(*d) == code);
        if let (true, Some(si), Some(di)) = (aligned, slot(sc), slot(dc)) {
            let k = COPY_FLAT_TYPED[si][di];
            let blocks = blocks_for(n / 8, THREADS).min(65_536);
            let (d, s) = (dst.data, src.data);
            let mut a = cx.kernel(k)?;
            a.arg(&d).arg(&s).arg(&n);
            // SAFETY: `copy_flat_{src}_{dst}(dst, src, n)`: both tensors are dense with n
            // elements of the kernel's dtypes (checked above) and 16-byte aligned.
            return unsafe { a.launch(config((blocks, 1, 1), (THREADS, 1, 1), 0)) };
        }
        let vec = i32::from(aligned);
        let blocks = blocks_for(if vec != 0 { n / 8 } else { n }, THREADS).min(65_536);
        let (d, s) = (dst.data, src.data);
        let mut a = cx.kernel(COPY_FLAT)?;
        a.arg(&d).arg(&dc).arg(&s).arg(&sc).arg(&n).arg(&vec);
        // SAFETY: `copy_flat(dst, dst_dt, src, src_dt, n, vec)`: both tensors are dense (checked
        // above) with n elements of plain dtypes, so [0, n) lies in each buffer; vec only when
        // both addresses are 16-byte aligned.
        return unsafe { a.launch(config((blocks, 1, 1), (THREADS, 1, 1), 0)) };
    }
    if dst.ne == src.ne && dst.nb[0] == ddt.block_bytes() as i64 && src.nb[0] == sdt.block_bytes() as i64 {
        let vec = dst.ne[0] % 8 == 0 && rows_aligned(&dst, ddt) && rows_aligned(&src, sdt);
        // Short rows share a block (tx a power of two, so whole warps hold whole rows).
        let work = if vec { dst.ne[0] / 8 } else { dst.ne[0] };
        let tx = (work.clamp(1, THREADS as i64) as u32).next_power_of_two();
        let ty = (THREADS / tx).max(1);
        let rows = dst.ne[1] * dst.ne[2] * dst.ne[3];
        let blocks = blocks_for(rows, ty).min(65_536);
        let vec = i32::from(vec);
        let mut a = cx.kernel(COPY_ROWS)?;
        a.arg(&dst).arg(&dc).arg(&src).arg(&sc).arg(&vec);
        // SAFETY: `copy_rows(dst, dst_dt, src, src_dt, vec)`: same shapes, dense rows of plain
        // dtypes; every address is an element of its tensor (checked in compute); vec only with
        // ne0 % 8 == 0 and 16-byte aligned rows.
        return unsafe { a.launch(config((blocks, 1, 1), (tx, ty, 1), 0)) };
    }
    let (se, de) = (sdt.block_bytes() as i64, ddt.block_bytes() as i64);
    let src_fast0 = if src.nb[0] == se && dst.nb[1] == de && dst.nb[0] != de {
        Some(1i32)
    } else if src.nb[1] == se && dst.nb[0] == de && src.nb[0] != se {
        Some(0)
    } else {
        None
    };
    let tiles = ((dst.ne[0] + 31) / 32, (dst.ne[1] + 31) / 32);
    if let (true, Some(fast)) = (dst.ne == src.ne && tiles.1 <= 65_535 && tiles.0 <= 1 << 30, src_fast0) {
        let planes = (dst.ne[2] * dst.ne[3]).clamp(1, 65_535) as u32;
        let mut a = cx.kernel(COPY_TRANSPOSE)?;
        a.arg(&dst).arg(&dc).arg(&src).arg(&sc).arg(&fast);
        // SAFETY: `copy_transpose(dst, dst_dt, src, src_dt, src_fast0)`: same shapes and plain
        // dtypes; each tile element is bounds-checked against ne0 and ne1, planes loop over
        // ne2 * ne3; 32 x 8 threads match the 32 x 33 shared tile.
        return unsafe { a.launch(config((tiles.0 as u32, tiles.1 as u32, planes), (32, 8, 1), 0)) };
    }
    let mut a = cx.kernel(COPY_GENERAL)?;
    a.arg(&dst).arg(&dc).arg(&src).arg(&sc);
    // SAFETY: `copy_general(dst, dst_dt, src, src_dt)`: equal element counts (shape rules), each
    // flat index unravelled against its own tensor's shape, plain dtypes.
    unsafe { a.launch(config((blocks_for(n, THREADS), 1, 1), (THREADS, 1, 1), 0)) }
}

fn get_rows(
    cx: &mut Cx<'_>,
    dst: TensorArg,
    ddt: DType,
    src: TensorArg,
    sdt: DType,
    ids: TensorArg,
) -> Result<(), BackendError> {
    let (sc, dc) = if sdt == DType::I32 { move_codes(sdt, ddt) } else { (dt(sdt), dt(ddt)) };
    let dst_ok = dst.ne[0] % 8 == 0 && rows_aligned(&dst, ddt);
    let vec = dst_ok && (sdt == DType::Q8_0 || rows_aligned(&src, sdt));
    let rows = dst.ne[1] * dst.ne[2] * dst.ne[3];
    let (vec, err, op) = (i32::from(vec), cx.errors, op_code("get_rows"));
    let mut a = cx.kernel(GET_ROWS)?;
    a.arg(&dst).arg(&dc).arg(&src).arg(&sc).arg(&ids).arg(&vec).arg(&err).arg(&op);
    // SAFETY: `get_rows(dst, dst_dt, src, src_dt, ids, vec, err, op)`: ids is i32 of shape
    // [dst.ne1, dst.ne2, dst.ne3] (shape rules); a row id outside 0..src.ne1 is reported and the
    // row skipped; src rows are dense (whole blocks when quantized); vec only with ne0 % 8 == 0
    // and 16-byte aligned plain rows (q8_0 sources are read with 2-byte loads).
    unsafe { a.launch(config((blocks_for(rows, 1).min(1 << 20), 1, 1), (row_threads(dst.ne[0], vec != 0), 1, 1), 0)) }
}

fn set_rows(
    cx: &mut Cx<'_>,
    dst: TensorArg,
    ddt: DType,
    src: TensorArg,
    sdt: DType,
    ids: TensorArg,
) -> Result<(), BackendError> {
    let vec = dst.ne[0] % 8 == 0 && rows_aligned(&dst, ddt) && rows_aligned(&src, sdt);
    let rows = src.ne[1] * src.ne[2] * src.ne[3];
    let (dc, sc) = (dt(ddt), dt(sdt));
    let (vec, err, op) = (i32::from(vec), cx.errors, op_code("set_rows"));
    let dedup = i32::from(ids.ne[0] <= SET_ROWS_DEDUP_MAX);
    let mut a = cx.kernel(SET_ROWS)?;
    a.arg(&dst).arg(&dc).arg(&src).arg(&sc).arg(&ids).arg(&vec).arg(&dedup).arg(&err).arg(&op);
    // SAFETY: `set_rows(dst, dst_dt, src, src_dt, ids, vec, dedup, err, op)`: ids is i32 of shape
    // [src.ne1, src.ne2, src.ne3] and dst has src's ne0, ne2, ne3 (shape rules); nothing is
    // written when any id is outside 0..dst.ne1; dst is a plain float dtype, src any float dtype
    // with dense rows when quantized; vec only with ne0 % 8 == 0 and 16-byte aligned plain rows.
    unsafe {
        a.launch(config(
            (blocks_for(rows, 1).min(SET_ROWS_MAX_BLOCKS), 1, 1),
            (row_threads(dst.ne[0], vec != 0), 1, 1),
            0,
        ))
    }
}

fn concat(
    cx: &mut Cx<'_>,
    dst: TensorArg,
    a_in: TensorArg,
    b_in: TensorArg,
    d: DType,
    dim: usize,
) -> Result<(), BackendError> {
    let code = move_codes(d, d).0;
    let dim = dim.min(3) as i32;
    let mut a = cx.kernel(CONCAT)?;
    a.arg(&dst).arg(&a_in).arg(&b_in).arg(&code).arg(&dim);
    // SAFETY: `concat(dst, a, b, dt, dim)`: a, b and dst share the plain dtype; dst.ne[dim] =
    // a.ne[dim] + b.ne[dim] and the other dims match (shape rules), so every read is in a or b.
    unsafe { a.launch(config((blocks_for(dst.nelements(), THREADS), 1, 1), (THREADS, 1, 1), 0)) }
}

fn repeat(cx: &mut Cx<'_>, dst: TensorArg, src: TensorArg, d: DType) -> Result<(), BackendError> {
    let code = move_codes(d, d).0;
    let mut a = cx.kernel(REPEAT)?;
    a.arg(&dst).arg(&src).arg(&code);
    // SAFETY: `repeat(dst, src, dt)`: same plain dtype; src coordinates are taken modulo src.ne,
    // so every read is an element of src.
    unsafe { a.launch(config((blocks_for(dst.nelements(), THREADS), 1, 1), (THREADS, 1, 1), 0)) }
}

#[cfg(test)]
mod tests {
    //! Row-id errors and duplicate ids on a real GPU (test-ops uses valid, distinct ids). Skips
    //! without a GPU.

    use tessera_graph::{BackendError, ExecError, Graph, Session};
    use tessera_ops::{DType, KernelError};

    use crate::CudaBackend;

    fn gpu() -> Option<CudaBackend> {
        CudaBackend::new().map_err(|e| eprintln!("skipping: {e}")).ok()
    }

    fn out_of_range(e: ExecError) -> (&'static str, i64, usize) {
        match e {
            ExecError::Backend(BackendError::Kernel(KernelError::IndexOutOfRange { op, index, limit, .. })) => {
                (op, index, limit)
            }
            other => panic!("expected IndexOutOfRange, got {other:?}"),
        }
    }

    #[test]
    fn get_rows_reports_the_first_bad_id() {
        let Some(mut cuda) = gpu() else { return };
        let mut g = Graph::new();
        let src = g.input("src", DType::F16, [64, 5, 1, 1]).expect("src");
        let ids = g.input("ids", DType::I32, [4, 1, 1, 1]).expect("ids");
        let out = g.get_rows(src, ids).expect("get_rows");
        g.mark_output(out).expect("output");
        let mut s = Session::new(&g, &mut cuda).expect("session");
        s.set_f32(src, &vec![1.0; 320]).expect("set");
        s.set_i32(ids, &[0, 7, 2, -1]).expect("set");
        let e = s.run().and_then(|()| s.get(out).map(drop)).expect_err("bad id");
        assert_eq!(out_of_range(e), ("get_rows", 7, 5));
    }

    #[test]
    fn set_rows_last_duplicate_wins_and_a_bad_id_writes_nothing() {
        let Some(mut cuda) = gpu() else { return };
        let mut g = Graph::new();
        let cache = g.state("cache", DType::F16, [8, 4, 1, 1]).expect("cache");
        let src = g.input("src", DType::F32, [8, 3, 1, 1]).expect("src");
        let ids = g.input("ids", DType::I32, [3, 1, 1, 1]).expect("ids");
        let out = g.set_rows(cache, src, ids).expect("set_rows");
        g.mark_output(out).expect("output");
        let mut s = Session::new(&g, &mut cuda).expect("session");
        let rows: Vec<f32> = (0..24).map(|i| (i / 8) as f32 + 1.0).collect();
        s.set_f32(cache, &[0.0; 32]).expect("set");
        s.set_f32(src, &rows).expect("set");
        s.set_i32(ids, &[2, 0, 2]).expect("set");
        s.run().expect("run");
        let got = s.get_f32(out).expect("get");
        let want: Vec<f32> = [2.0, 0.0, 3.0, 0.0].iter().flat_map(|&v| [v; 8]).collect();
        assert_eq!(got, want);
        s.set_i32(ids, &[1, 4, 3]).expect("set");
        let e = s.run().and_then(|()| s.get(out).map(drop)).expect_err("bad id");
        assert_eq!(out_of_range(e), ("set_rows", 4, 4));
        assert_eq!(s.get_f32(out).expect("get"), want, "nothing written");
    }
}
