//! Elementwise: add/sub/mul/div with broadcasting, the unary functions, scale, swiglu (split and
//! fused).

use tessera_ops::{BinaryOp, DType, UnaryOp};

use super::{BF16, F16, F32, sh};
use crate::case::{Case, Init, InputSpec as In, Layout};

pub(super) fn cases(out: &mut Vec<Case>) {
    binary(out);
    unary(out);
    scale(out);
    swiglu(out);
}

/// `(a, b)` shapes: same shape, and `b` broadcast along each dimension (the norm weight of a
/// 5120-wide model, a per-head bias, a per-row scale).
const BINARY_SHAPES: [([usize; 4], [usize; 4]); 7] = [
    ([1, 1, 1, 1], [1, 1, 1, 1]),
    ([7, 3, 1, 1], [7, 3, 1, 1]),
    ([33, 5, 2, 3], [33, 1, 1, 1]),
    ([33, 5, 2, 3], [1, 5, 1, 3]),
    ([67, 4, 3, 2], [67, 4, 1, 1]),
    ([5120, 7, 1, 1], [5120, 1, 1, 1]),
    ([128, 16, 4, 1], [1, 16, 4, 1]),
];

fn binary(out: &mut Vec<Case>) {
    for op in BinaryOp::ALL {
        for (a, b) in BINARY_SHAPES {
            out.push(binary_case(op, [F32, F32], [a, b], [Layout::Contiguous; 2]));
        }
        out.push(binary_case(op, [F16, F16], [[67, 3, 1, 1], [67, 1, 1, 1]], [Layout::Contiguous; 2]));
        out.push(binary_case(op, [BF16, F32], [[33, 4, 2, 1], [33, 4, 1, 1]], [Layout::Contiguous; 2]));
        out.push(binary_case(op, [F32, F16], [[2048, 3, 1, 1], [2048, 1, 1, 1]], [Layout::Contiguous; 2]));
        out.push(binary_case(op, [F32, F32], [[33, 5, 4, 1], [33, 1, 4, 1]], [Layout::SWAP12, Layout::WINDOW]));
        out.push(binary_case(op, [F32, F32], [[7, 9, 2, 1], [7, 9, 2, 1]], [Layout::WINDOW, Layout::TRANSPOSED]));
    }
}

fn binary_case(op: BinaryOp, types: [DType; 2], shapes: [[usize; 4]; 2], layouts: [Layout; 2]) -> Case {
    // Divisors stay away from zero so the quotient is well conditioned.
    let b_init = if op == BinaryOp::Div { Init::POSITIVE } else { Init::SIGNED };
    Case::new(
        op.name(),
        format_args!("type_a={},type_b={},ne_a={},ne_b={}", types[0], types[1], sh(shapes[0]), sh(shapes[1])),
        vec![
            In::new("a", types[0], shapes[0]).layout(layouts[0]),
            In::new("b", types[1], shapes[1]).layout(layouts[1]).init(b_init),
        ],
        move |g, x| g.binary(op, x[0], x[1]),
    )
}

fn unary(out: &mut Vec<Case>) {
    for op in UnaryOp::ALL {
        for ne in [[1, 1, 1, 1], [7, 3, 1, 1], [33, 5, 2, 3], [5120, 7, 1, 1]] {
            out.push(unary_case(op, F32, ne, Layout::Contiguous, Init::SIGNED));
        }
        out.push(unary_case(op, F16, [67, 3, 1, 1], Layout::Contiguous, Init::SIGNED));
        out.push(unary_case(op, BF16, [2048, 2, 1, 1], Layout::Contiguous, Init::SIGNED));
        out.push(unary_case(op, F32, [33, 5, 2, 3], Layout::SWAP12, Init::SIGNED));
        out.push(unary_case(op, F16, [33, 4, 2, 1], Layout::WINDOW, Init::SIGNED));
        // Wide range: the overflow-safe branches of exp, sigmoid, silu and softplus.
        out.push(unary_case(op, F32, [257, 3, 1, 1], Layout::Contiguous, Init::Uniform { lo: -20.0, hi: 20.0 }));
    }
}

fn unary_case(op: UnaryOp, dtype: DType, ne: [usize; 4], layout: Layout, init: Init) -> Case {
    let Init::Uniform { lo, hi } = init else { unreachable!("unary cases draw uniform inputs") };
    Case::new(
        op.name(),
        format_args!("type={dtype},ne={},range=[{lo},{hi}]", sh(ne)),
        vec![In::new("x", dtype, ne).layout(layout).init(init)],
        move |g, x| g.unary(op, x[0]),
    )
}

fn scale(out: &mut Vec<Case>) {
    for (s, b) in [(2.0, 0.0), (0.125, 0.0), (-1.5, 0.25)] {
        for ne in [[7, 3, 1, 1], [5120, 4, 1, 1]] {
            out.push(scale_case(F32, ne, s, b, Layout::Contiguous));
        }
    }
    out.push(scale_case(F16, [67, 3, 1, 1], 0.5, 1.0, Layout::Contiguous));
    out.push(scale_case(BF16, [33, 2, 1, 1], 3.0, 0.0, Layout::Contiguous));
    out.push(scale_case(F32, [33, 5, 2, 1], 0.0883883, 0.0, Layout::TRANSPOSED));
    out.push(scale_case(F32, [33, 5, 2, 1], -2.0, 0.5, Layout::WINDOW));
}

fn scale_case(dtype: DType, ne: [usize; 4], s: f32, b: f32, layout: Layout) -> Case {
    Case::new(
        "scale",
        format_args!("type={dtype},ne={},scale={s},bias={b}", sh(ne)),
        vec![In::new("x", dtype, ne).layout(layout)],
        move |g, x| g.scale_bias(x[0], s, b),
    )
}

fn swiglu(out: &mut Vec<Case>) {
    use Layout::Contiguous as C;
    for ne in [[1, 1, 1, 1], [7, 3, 1, 1], [64, 5, 2, 1], [1024, 4, 1, 1], [3072, 2, 1, 1]] {
        out.push(swiglu_split(F32, ne, [C, C]));
    }
    out.push(swiglu_split(F16, [67, 3, 1, 1], [C, C]));
    out.push(swiglu_split(BF16, [128, 2, 1, 1], [C, C]));
    out.push(swiglu_split(F32, [33, 4, 2, 1], [Layout::SWAP12, Layout::WINDOW]));
    for n in [1, 7, 33, 1024] {
        out.push(swiglu_fused(F32, [2 * n, 3, 1, 1], C));
    }
    out.push(swiglu_fused(F16, [2 * 67, 2, 1, 1], C));
    out.push(swiglu_fused(BF16, [2 * 64, 2, 1, 1], C));
    out.push(swiglu_fused(F32, [2 * 33, 4, 2, 1], Layout::WINDOW));
    out.push(swiglu_fused(F32, [2 * 7, 5, 3, 1], Layout::SWAP12));
}

fn swiglu_split(dtype: DType, ne: [usize; 4], layouts: [Layout; 2]) -> Case {
    Case::new(
        "swiglu",
        format_args!("type={dtype},ne={},split", sh(ne)),
        vec![In::new("gate", dtype, ne).layout(layouts[0]), In::new("up", dtype, ne).layout(layouts[1])],
        |g, x| g.swiglu(x[0], x[1]),
    )
}

fn swiglu_fused(dtype: DType, ne: [usize; 4], layout: Layout) -> Case {
    Case::new(
        "swiglu",
        format_args!("type={dtype},ne={},fused", sh(ne)),
        vec![In::new("gate_up", dtype, ne).layout(layout)],
        |g, x| g.swiglu_fused(x[0]),
    )
}
