//! Row-wise ops over `ne[0]`: rms_norm, sum_rows, softmax (scale, f32/f16 mask), argmax.

use tessera_ops::DType;

use super::{BF16, F16, F32, sh};
use crate::case::{Case, Init, InputSpec as In, Layout};

pub(super) fn cases(out: &mut Vec<Case>) {
    rms_norm(out);
    sum_rows(out);
    softmax(out);
    argmax(out);
}

/// Shapes shared by the row-wise ops: odd sizes, per-head rows (head dim 128 and 256), and
/// Qwen3.6 hidden sizes (2048, 5120) for a few tokens.
const ROW_SHAPES: [[usize; 4]; 7] =
    [[1, 1, 1, 1], [7, 3, 1, 1], [33, 5, 2, 3], [128, 16, 4, 1], [256, 8, 2, 1], [2048, 7, 1, 1], [5120, 7, 1, 1]];

fn rms_norm(out: &mut Vec<Case>) {
    for ne in ROW_SHAPES {
        out.push(rms_norm_case(F32, ne, 1e-6, Layout::Contiguous));
    }
    for eps in [0.0, 1e-5, 0.1] {
        out.push(rms_norm_case(F32, [67, 3, 1, 1], eps, Layout::Contiguous));
    }
    out.push(rms_norm_case(F16, [128, 4, 1, 1], 1e-6, Layout::Contiguous));
    out.push(rms_norm_case(BF16, [5120, 2, 1, 1], 1e-6, Layout::Contiguous));
    // Per-head q/k norm of a projection viewed as [head_dim, n_tokens, n_head].
    out.push(rms_norm_case(F32, [128, 4, 8, 1], 1e-6, Layout::SWAP12));
    out.push(rms_norm_case(F32, [33, 4, 2, 1], 1e-6, Layout::WINDOW));
    out.push(rms_norm_case(F32, [7, 33, 1, 1], 1e-6, Layout::TRANSPOSED));
}

fn rms_norm_case(dtype: DType, ne: [usize; 4], eps: f32, layout: Layout) -> Case {
    Case::new(
        "rms_norm",
        format_args!("type={dtype},ne={},eps={eps:e}", sh(ne)),
        vec![In::new("x", dtype, ne).layout(layout)],
        move |g, x| g.rms_norm(x[0], eps),
    )
}

fn sum_rows(out: &mut Vec<Case>) {
    for ne in [[1, 1, 1, 1], [7, 3, 1, 1], [33, 5, 2, 3], [4096, 2, 1, 1], [5120, 7, 1, 1]] {
        out.push(one_input("sum_rows", F32, ne, Layout::Contiguous, Init::SIGNED));
    }
    out.push(one_input("sum_rows", F16, [67, 3, 1, 1], Layout::Contiguous, Init::SIGNED));
    out.push(one_input("sum_rows", BF16, [256, 3, 1, 1], Layout::Contiguous, Init::SIGNED));
    out.push(one_input("sum_rows", F32, [33, 5, 4, 1], Layout::SWAP12, Init::SIGNED));
    out.push(one_input("sum_rows", F32, [33, 5, 2, 1], Layout::WINDOW, Init::SIGNED));
}

fn argmax(out: &mut Vec<Case>) {
    // Distinct values per row: no near ties, so the index cannot flip between f32 and f64.
    for ne in [[1, 1, 1, 1], [7, 3, 1, 1], [33, 5, 2, 3], [4096, 4, 1, 1], [5120, 3, 1, 1]] {
        out.push(one_input("argmax", F32, ne, Layout::Contiguous, Init::Distinct));
    }
    out.push(one_input("argmax", F16, [67, 3, 1, 1], Layout::Contiguous, Init::Distinct));
    out.push(one_input("argmax", BF16, [100, 3, 1, 1], Layout::Contiguous, Init::Distinct));
    out.push(one_input("argmax", F32, [33, 5, 4, 1], Layout::SWAP12, Init::Distinct));
    out.push(one_input("argmax", F32, [33, 5, 2, 1], Layout::WINDOW, Init::Distinct));
}

/// A case of an op with one input and no parameters (`sum_rows`, `argmax`).
fn one_input(op: &'static str, dtype: DType, ne: [usize; 4], layout: Layout, init: Init) -> Case {
    let build = match op {
        "sum_rows" => |g: &mut tessera_graph::Graph, x: &[tessera_graph::Tensor]| g.sum_rows(x[0]),
        "argmax" => |g: &mut tessera_graph::Graph, x: &[tessera_graph::Tensor]| g.argmax(x[0]),
        _ => unreachable!("one_input: unknown op {op}"),
    };
    Case::new(
        op,
        format_args!("type={dtype},ne={}", sh(ne)),
        vec![In::new("x", dtype, ne).layout(layout).init(init)],
        build,
    )
}

/// The mask of a softmax case.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Mask {
    None,
    /// A mask of this dtype and shape.
    Some(DType, [usize; 4]),
}

fn softmax(out: &mut Vec<Case>) {
    let shapes = [[1, 1, 1, 1], [7, 3, 1, 1], [33, 5, 2, 3], [128, 16, 4, 1], [4096, 4, 1, 1], [256, 8, 16, 1]];
    for ne in shapes {
        for mask in [Mask::None, Mask::Some(F32, ne), Mask::Some(F16, ne)] {
            out.push(softmax_case(F32, ne, 1.0, mask, Layout::Contiguous));
        }
    }
    // Attention scales 1/sqrt(head_dim) for head dims 128 and 256.
    for scale in [0.088_388_35, 0.0625] {
        out.push(softmax_case(F32, [256, 8, 16, 1], scale, Mask::Some(F32, [256, 8, 16, 1]), Layout::Contiguous));
    }
    out.push(softmax_case(F32, [33, 5, 2, 1], 4.0, Mask::None, Layout::Contiguous));
    // One mask shared by every head (dims 2 and 3 broadcast), and a mask padded with extra rows.
    out.push(softmax_case(F32, [64, 7, 4, 2], 1.0, Mask::Some(F32, [64, 7, 1, 1]), Layout::Contiguous));
    out.push(softmax_case(F32, [64, 7, 4, 2], 0.125, Mask::Some(F16, [64, 7, 2, 1]), Layout::Contiguous));
    out.push(softmax_case(F32, [67, 3, 2, 1], 1.0, Mask::Some(F16, [67, 8, 1, 1]), Layout::Contiguous));
    // Inputs stored narrower, or non-contiguous.
    out.push(softmax_case(F16, [67, 3, 1, 1], 1.0, Mask::None, Layout::Contiguous));
    out.push(softmax_case(BF16, [128, 4, 1, 1], 1.0, Mask::Some(F32, [128, 4, 1, 1]), Layout::Contiguous));
    out.push(softmax_case(F32, [33, 5, 4, 1], 0.5, Mask::Some(F32, [33, 5, 1, 1]), Layout::SWAP12));
    out.push(softmax_case(F32, [33, 5, 2, 1], 1.0, Mask::None, Layout::WINDOW));
    out.push(softmax_case(F32, [7, 33, 1, 1], 1.0, Mask::Some(F16, [7, 33, 1, 1]), Layout::TRANSPOSED));
}

fn softmax_case(dtype: DType, ne: [usize; 4], scale: f32, mask: Mask, layout: Layout) -> Case {
    let x = In::new("x", dtype, ne).layout(layout);
    match mask {
        Mask::None => Case::new(
            "softmax",
            format_args!("type={dtype},ne={},scale={scale},mask=none", sh(ne)),
            vec![x],
            move |g, x| g.softmax(x[0], scale, None),
        ),
        Mask::Some(mask_type, mask_ne) => Case::new(
            "softmax",
            format_args!("type={dtype},ne={},scale={scale},mask={mask_type}{}", sh(ne), sh(mask_ne)),
            vec![x, In::new("mask", mask_type, mask_ne).init(Init::Mask)],
            move |g, x| g.softmax(x[0], scale, Some(x[1])),
        ),
    }
}
