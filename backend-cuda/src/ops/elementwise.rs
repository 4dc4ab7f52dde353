//! Unary, binary (with broadcasting), scale and swiglu: `kernels/elementwise.cu`.

use cudarc::driver::PushKernelArg;
use tessera_graph::{BackendError, Task};
use tessera_ops::{BinaryOp, DType, Op, TensorMeta, UnaryOp};

use crate::compile::{Kernel, Module};
use crate::launch::{Cx, TensorArg, blocks_for, config, dt, launch_error};

const UNARY: Kernel = Kernel::new(Module::Elementwise, "unary");
const BINARY: Kernel = Kernel::new(Module::Elementwise, "binary");
const BINARY_F32_CONTIG: Kernel = Kernel::new(Module::Elementwise, "binary_f32_contig");
const SCALE: Kernel = Kernel::new(Module::Elementwise, "scale");
const SWIGLU: Kernel = Kernel::new(Module::Elementwise, "swiglu");

const THREADS: u32 = 256;

/// The family takes plain dtypes only (the shape rules refuse quantized elementwise inputs).
pub(crate) fn supports(_op: &Op, inputs: &[TensorMeta]) -> bool {
    inputs.iter().all(|m| !m.dtype.is_quantized())
}

/// TAG(unary-code): the codes `unary_f` in elementwise.cu switches on.
fn unary_code(u: UnaryOp) -> i32 {
    match u {
        UnaryOp::Neg => 0,
        UnaryOp::Exp => 1,
        UnaryOp::Silu => 2,
        UnaryOp::Sigmoid => 3,
        UnaryOp::Softplus => 4,
    }
}

/// TAG(binary-code): the codes `binary_f` in elementwise.cu switches on.
fn binary_code(b: BinaryOp) -> i32 {
    match b {
        BinaryOp::Add => 0,
        BinaryOp::Sub => 1,
        BinaryOp::Mul => 2,
        BinaryOp::Div => 3,
    }
}

pub(crate) fn run(cx: &mut Cx<'_>, task: &Task<'_>, ins: &[TensorArg], out: TensorArg) -> Result<(), BackendError> {
    let n = out.nelements();
    let cfg = config((blocks_for(n, THREADS), 1, 1), (THREADS, 1, 1), 0);
    let odt = dt(task.output.meta.dtype);
    let idt = |i: usize| dt(task.inputs[i].meta.dtype);
    match task.op {
        Op::Unary(u) => {
            let (f, src, sdt, code) = (cx.function(UNARY)?, ins[0], idt(0), unary_code(*u));
            let mut a = cx.stream.launch_builder(&f);
            a.arg(&out).arg(&odt).arg(&src).arg(&sdt).arg(&code);
            // SAFETY: `unary(dst, dst_dt, src, src_dt, code)`; src has dst's shape (shape rules),
            // every address is inside its buffer (checked in compute) and the dtypes are plain.
            unsafe { a.launch(cfg) }.map_err(|e| launch_error(UNARY, e))?;
        }
        Op::Binary(b) => {
            let code = binary_code(*b);
            let all_f32 = [&task.output.meta, &task.inputs[0].meta, &task.inputs[1].meta].iter().all(|m| m.dtype == DType::F32);
            let contiguous = task.output.meta.is_contiguous() && task.inputs[0].meta.is_contiguous() && task.inputs[1].meta.is_contiguous();
            // b broadcasts as a whole prefix repeat only when it is a run of full rows of a.
            let b_meta = &task.inputs[1].meta;
            let prefix = b_meta.ne[1..].iter().all(|&d| d == 1) && b_meta.ne[0] == task.output.meta.ne[0]
                || b_meta.ne == task.output.meta.ne;
            if all_f32 && contiguous && prefix {
                let f = cx.function(BINARY_F32_CONTIG)?;
                let nb = ins[1].nelements();
                let (d, x, y) = (out.data, ins[0].data, ins[1].data);
                let mut a = cx.stream.launch_builder(&f);
                a.arg(&d).arg(&x).arg(&y).arg(&n).arg(&nb).arg(&code);
                // SAFETY: all three are contiguous f32 of n, n and nb elements, nb divides n and b
                // repeats as whole rows (checked above).
                unsafe { a.launch(cfg) }.map_err(|e| launch_error(BINARY_F32_CONTIG, e))?;
            } else {
                let f = cx.function(BINARY)?;
                let (x, y, xdt, ydt) = (ins[0], ins[1], idt(0), idt(1));
                let mut a = cx.stream.launch_builder(&f);
                a.arg(&out).arg(&odt).arg(&x).arg(&xdt).arg(&y).arg(&ydt).arg(&code);
                // SAFETY: a has dst's shape and b's dims divide it (shape rules); addresses checked.
                unsafe { a.launch(cfg) }.map_err(|e| launch_error(BINARY, e))?;
            }
        }
        Op::Scale(p) => {
            let f = cx.function(SCALE)?;
            let (src, sdt, s, bias) = (ins[0], idt(0), p.scale, p.bias);
            let mut a = cx.stream.launch_builder(&f);
            a.arg(&out).arg(&odt).arg(&src).arg(&sdt).arg(&s).arg(&bias);
            // SAFETY: src has dst's shape; addresses checked.
            unsafe { a.launch(cfg) }.map_err(|e| launch_error(SCALE, e))?;
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
            let f = cx.function(SWIGLU)?;
            let mut a = cx.stream.launch_builder(&f);
            a.arg(&out).arg(&odt).arg(&gate).arg(&gdt).arg(&up).arg(&udt);
            // SAFETY: gate and up have dst's shape (the fused input's rows are 2 * ne0 long, so
            // the second half starts ne0 elements in and stays inside the row).
            unsafe { a.launch(cfg) }.map_err(|e| launch_error(SWIGLU, e))?;
        }
        _ => return Err(crate::launch::unsupported(task, "not an elementwise op")),
    }
    Ok(())
}
