//! Unary, binary (with broadcasting), scale and swiglu: `kernels/elementwise.cu`.

use tessera_graph::{BackendError, Task};
use tessera_ops::{BinaryOp, DType, Op, TensorMeta, UnaryOp};

use crate::compile::{Kernel, Module};
use cudarc::driver::LaunchConfig;

use crate::launch::{Cx, TensorArg, blocks_for, config, dt};

const UNARY: Kernel = Kernel::new(Module::Elementwise, "unary");
const UNARY_F32_VEC4: Kernel = Kernel::new(Module::Elementwise, "unary_f32_vec4");
const BINARY: Kernel = Kernel::new(Module::Elementwise, "binary");
const BINARY_F32_VEC4: Kernel = Kernel::new(Module::Elementwise, "binary_f32_vec4");
const SCALE: Kernel = Kernel::new(Module::Elementwise, "scale");
const SCALE_F32_VEC4: Kernel = Kernel::new(Module::Elementwise, "scale_f32_vec4");
const SWIGLU: Kernel = Kernel::new(Module::Elementwise, "swiglu");

const THREADS: u32 = 256;

/// The launch shape of the row kernels (`FOR_EACH_ROW` in elementwise.cu): `x` threads stride
/// over `ne[0]` (a power of two from 32 to 256 that covers short rows without idle warps), `y`
/// rows per block, a grid-stride loop over the rest.
pub(crate) fn row_launch(ne: [i64; 4]) -> LaunchConfig {
    let tx = (ne[0].max(32) as u64).next_power_of_two().min(THREADS as u64) as u32;
    let ty = THREADS / tx;
    let rows = ne[1] * ne[2] * ne[3];
    config((blocks_for(rows, ty).min(1 << 20), 1, 1), (tx, ty, 1), 0)
}

/// A launch for flat kernels over `n` items, capped (they grid-stride).
fn flat_launch(n: i64) -> LaunchConfig {
    config((blocks_for(n, THREADS).min(1 << 20), 1, 1), (THREADS, 1, 1), 0)
}

/// True when every tensor is contiguous f32 with 16-byte aligned data and a multiple of 4
/// elements: the `*_f32_vec4` kernels apply.
fn vec4_f32(metas: &[&TensorMeta], args: &[TensorArg]) -> bool {
    metas.iter().all(|m| m.dtype == DType::F32 && m.is_contiguous() && m.nelements() % 4 == 0)
        && args.iter().all(|a| a.data % 16 == 0)
}

/// The family takes plain dtypes only (the shape rules refuse quantized elementwise inputs).
pub(crate) fn supports(_op: &Op, inputs: &[TensorMeta]) -> bool {
    inputs.iter().all(|m| !m.dtype.is_quantized())
}

/// TAG(unary-code): the codes `unary_f` in elementwise.cu switches on.
pub(super) fn unary_code(u: UnaryOp) -> i32 {
    match u {
        UnaryOp::Neg => 0,
        UnaryOp::Exp => 1,
        UnaryOp::Silu => 2,
        UnaryOp::Sigmoid => 3,
        UnaryOp::Softplus => 4,
    }
}

/// TAG(binary-code): the codes `binary_f` in elementwise.cu switches on.
pub(super) fn binary_code(b: BinaryOp) -> i32 {
    match b {
        BinaryOp::Add => 0,
        BinaryOp::Sub => 1,
        BinaryOp::Mul => 2,
        BinaryOp::Div => 3,
    }
}

/// `out = gate sigmoid(gate) up` over f32 tensors of one shape (gate may be out: each element is
/// read before it is written), for the ops that end in swiglu (mul_mat_swiglu's fallback).
pub(super) fn swiglu_f32(cx: &mut Cx<'_>, gate: TensorArg, up: TensorArg, out: TensorArg) -> Result<(), BackendError> {
    let f32 = dt(DType::F32);
    swiglu_launch(cx, out, f32, gate, f32, up, f32)
}

fn swiglu_launch(
    cx: &mut Cx<'_>,
    out: TensorArg,
    odt: i32,
    gate: TensorArg,
    gdt: i32,
    up: TensorArg,
    udt: i32,
) -> Result<(), BackendError> {
    let mut a = cx.kernel(SWIGLU)?;
    a.arg(&out).arg(&odt).arg(&gate).arg(&gdt).arg(&up).arg(&udt);
    // SAFETY: gate and up have out's shape with their own strides and dtypes; each thread reads
    // element i of both before it writes element i of out.
    unsafe { a.launch(row_launch(out.ne)) }?;
    Ok(())
}

pub(crate) fn run(cx: &mut Cx<'_>, task: &Task<'_>, ins: &[TensorArg], out: TensorArg) -> Result<(), BackendError> {
    let n = out.nelements();
    let rows = row_launch(out.ne);
    let odt = dt(task.output.meta.dtype);
    let idt = |i: usize| dt(task.inputs[i].meta.dtype);
    let om = &task.output.meta;
    match task.op {
        Op::Unary(u) => {
            let code = unary_code(*u);
            if vec4_f32(&[om, &task.inputs[0].meta], &[out, ins[0]]) {
                let (n4, d, x) = (n / 4, out.data, ins[0].data);
                let mut a = cx.kernel(UNARY_F32_VEC4)?;
                a.arg(&d).arg(&x).arg(&n4).arg(&code);
                // SAFETY: both are contiguous f32 of n = 4 * n4 elements, 16-byte aligned.
                unsafe { a.launch(flat_launch(n4)) }?;
            } else {
                let (src, sdt) = (ins[0], idt(0));
                let mut a = cx.kernel(UNARY)?;
                a.arg(&out).arg(&odt).arg(&src).arg(&sdt).arg(&code);
                // SAFETY: `unary(dst, dst_dt, src, src_dt, code)`; src has dst's shape (shape
                // rules), every address is inside its buffer (checked in compute), dtypes plain.
                unsafe { a.launch(rows) }?;
            }
        }
        Op::Binary(b) => {
            let code = binary_code(*b);
            let bm = &task.inputs[1].meta;
            // b repeats along the flat index when it equals a leading block of a's dims.
            let k = (0..4).find(|&d| bm.ne[d] != om.ne[d]).unwrap_or(4);
            let repeats_flat = bm.ne[k.min(3)..].iter().all(|&d| d == 1) || k == 4;
            let nb = ins[1].nelements();
            if repeats_flat && nb % 4 == 0 && vec4_f32(&[om, &task.inputs[0].meta, bm], &[out, ins[0], ins[1]]) {
                let (n4, nb4, d, x, y) = (n / 4, nb / 4, out.data, ins[0].data, ins[1].data);
                let mut a = cx.kernel(BINARY_F32_VEC4)?;
                a.arg(&d).arg(&x).arg(&y).arg(&n4).arg(&nb4).arg(&code);
                // SAFETY: contiguous f32, 16-byte aligned, n = 4 * n4 and nb = 4 * nb4 elements;
                // b is a leading block of a's dims, so b[i % nb] is the broadcast element.
                unsafe { a.launch(flat_launch(n4)) }?;
            } else {
                let (x, y, xdt, ydt) = (ins[0], ins[1], idt(0), idt(1));
                let mut a = cx.kernel(BINARY)?;
                a.arg(&out).arg(&odt).arg(&x).arg(&xdt).arg(&y).arg(&ydt).arg(&code);
                // SAFETY: a has dst's shape and b's dims divide it (shape rules); addresses checked.
                unsafe { a.launch(rows) }?;
            }
        }
        Op::Scale(p) => {
            let (s, bias) = (p.scale, p.bias);
            if vec4_f32(&[om, &task.inputs[0].meta], &[out, ins[0]]) {
                let (n4, d, x) = (n / 4, out.data, ins[0].data);
                let mut a = cx.kernel(SCALE_F32_VEC4)?;
                a.arg(&d).arg(&x).arg(&n4).arg(&s).arg(&bias);
                // SAFETY: both contiguous f32 of 4 * n4 elements, 16-byte aligned.
                unsafe { a.launch(flat_launch(n4)) }?;
            } else {
                let (src, sdt) = (ins[0], idt(0));
                let mut a = cx.kernel(SCALE)?;
                a.arg(&out).arg(&odt).arg(&src).arg(&sdt).arg(&s).arg(&bias);
                // SAFETY: src has dst's shape; addresses checked.
                unsafe { a.launch(rows) }?;
            }
        }
        Op::Swiglu => {
            // The fused form reads gate and up as the two halves of each row of one input.
            let (gate, up, gdt, udt) = match ins {
                [g, u] => (*g, *u, idt(0), idt(1)),
                [x] => {
                    let half = out.ne[0];
                    let gate = TensorArg { ne: out.ne, ..*x };
                    let up = TensorArg { data: x.data + (half * x.nb[0]) as u64, ..gate };
                    (gate, up, idt(0), idt(0))
                }
                _ => return Err(crate::launch::unsupported(task, "swiglu takes one or two inputs")),
            };
            // (gate and up have dst's shape: the fused input's rows are 2 * ne0 long, so the
            // second half starts ne0 elements in and stays inside the row)
            swiglu_launch(cx, out, odt, gate, gdt, up, udt)?;
        }
        _ => return Err(crate::launch::unsupported(task, "not an elementwise op")),
    }
    Ok(())
}
