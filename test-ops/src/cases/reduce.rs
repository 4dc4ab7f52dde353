//! Row-wise ops over `ne[0]`: rms_norm, sum_rows, softmax (scale, f32/f16 mask), argmax,
//! l2_norm, top_k, argsort.

use tessera_graph::{Graph, GraphError, Tensor};
use tessera_ops::{DType, SortOrder};

use super::{BF16, F16, F32, sh};
use crate::case::{Case, Init, InputSpec as In, Layout};

pub(super) fn cases(out: &mut Vec<Case>) {
    rms_norm(out);
    sum_rows(out);
    softmax(out);
    argmax(out);
    l2_norm(out);
    top_k(out);
    argsort(out);
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

// ---- l2_norm, top_k, argsort ----

fn l2_norm(out: &mut Vec<Case>) {
    // GDN q/k rows (S_k = 128, 16 key heads), attention heads (256), odd sizes, model widths.
    for ne in [[1, 1, 1, 1], [7, 3, 1, 1], [33, 5, 2, 3], [128, 16, 4, 1], [256, 8, 2, 1], [5120, 3, 1, 1]] {
        out.push(l2_norm_case(F32, ne, 1e-6, Layout::Contiguous, Init::SIGNED));
    }
    for eps in [0.0, 1e-12] {
        out.push(l2_norm_case(F32, [67, 3, 1, 1], eps, Layout::Contiguous, Init::SIGNED));
    }
    // Small rows (norm about 0.02) under a larger eps: divided by eps, not by their norm.
    out.push(l2_norm_case(F32, [16, 4, 1, 1], 0.5, Layout::Contiguous, Init::Uniform { lo: -0.01, hi: 0.01 }));
    out.push(l2_norm_case(F16, [128, 4, 1, 1], 1e-6, Layout::Contiguous, Init::SIGNED));
    out.push(l2_norm_case(BF16, [128, 32, 1, 1], 1e-6, Layout::Contiguous, Init::SIGNED));
    out.push(l2_norm_case(F32, [128, 4, 16, 1], 1e-6, Layout::SWAP12, Init::SIGNED));
    out.push(l2_norm_case(F32, [33, 4, 2, 1], 1e-6, Layout::WINDOW, Init::SIGNED));
    out.push(l2_norm_case(F32, [7, 33, 1, 1], 1e-6, Layout::TRANSPOSED, Init::SIGNED));
    // q and k of a GDN layer as strided views into the conv output [2 H_k S_k + H_v S_v, n_tokens]
    // (dense 27B: 16 key heads, 48 value heads; MoE: 16 / 32), as llama.cpp splits it.
    for (h_k, h_v, n_tokens) in [(16, 48, 2), (16, 32, 3)] {
        out.push(l2_norm_qk_split(h_k, h_v, 128, n_tokens));
    }
}

fn l2_norm_case(dtype: DType, ne: [usize; 4], eps: f32, layout: Layout, init: Init) -> Case {
    let range = match init {
        Init::Uniform { lo, hi } if (lo, hi) != (-1.0, 1.0) => format!(",init=[{lo},{hi})"),
        _ => String::new(),
    };
    Case::new(
        "l2_norm",
        format_args!("type={dtype},ne={},eps={eps:e}{range}", sh(ne)),
        vec![In::new("x", dtype, ne).layout(layout).init(init)],
        move |g, x| g.l2_norm(x[0], eps),
    )
}

/// `l2_norm` of the q and k channel ranges of a GDN conv output `[2 h_k s + h_v s, n_tokens]`,
/// each viewed as `[s, h_k, n_tokens]` with the conv output's row stride.
fn l2_norm_qk_split(h_k: usize, h_v: usize, s: usize, n_tokens: usize) -> Case {
    let channels = 2 * h_k * s + h_v * s;
    let ne = [channels, n_tokens, 1, 1];
    Case::new(
        "l2_norm",
        format_args!("type=f32,conv={},q_k_views=[{s},{h_k},{n_tokens}],eps=1e-6", sh(ne)),
        vec![In::new("conv", F32, ne)],
        move |g, x| {
            let nb = x[0].meta().nb;
            let view_nb = [nb[0], s * nb[0], nb[1], nb[1] * n_tokens];
            let q = g.view(x[0], [s, h_k, n_tokens, 1], view_nb, 0)?;
            let k = g.view(x[0], [s, h_k, n_tokens, 1], view_nb, h_k * s * nb[0])?;
            let qn = g.l2_norm(q, 1e-6)?;
            let kn = g.l2_norm(k, 1e-6)?;
            // One output: both normalised rows, side by side.
            g.concat(qn, kn, 1)
        },
    )
}

fn top_k(out: &mut Vec<Case>) {
    // The MoE router: 8 of 256 experts (Qwen3.6 35B-A3B) for decode and small batches, and other
    // k around the insertion/partition switch (32).
    for n_tokens in [1, 7, 32] {
        out.push(top_k_case(F32, [256, n_tokens, 1, 1], 8, Layout::Contiguous, Init::SIGNED));
    }
    for k in [1, 16, 32, 33, 256] {
        out.push(top_k_case(F32, [256, 5, 1, 1], k, Layout::Contiguous, Init::SIGNED));
    }
    for (ne, k) in [([1, 1, 1, 1], 1), ([7, 3, 1, 1], 7), ([33, 5, 2, 3], 5), ([67, 3, 1, 1], 40)] {
        out.push(top_k_case(F32, ne, k, Layout::Contiguous, Init::Distinct));
    }
    // Top-40 sampling over a Qwen3.5-sized vocabulary row.
    out.push(top_k_case(F32, [248_320, 1, 1, 1], 40, Layout::Contiguous, Init::SIGNED));
    // Half types: bf16 has 8 bits of mantissa, so a 256-wide row holds many exact ties.
    out.push(top_k_case(BF16, [256, 6, 1, 1], 8, Layout::Contiguous, Init::SIGNED));
    out.push(top_k_case(BF16, [256, 3, 1, 1], 100, Layout::Contiguous, Init::SIGNED));
    out.push(top_k_case(F16, [128, 4, 1, 1], 8, Layout::Contiguous, Init::SIGNED));
    out.push(top_k_case(F32, [33, 5, 4, 1], 4, Layout::SWAP12, Init::SIGNED));
    out.push(top_k_case(F32, [33, 5, 2, 1], 9, Layout::WINDOW, Init::SIGNED));
    out.push(top_k_case(F32, [7, 33, 1, 1], 3, Layout::TRANSPOSED, Init::SIGNED));
    // The whole router (llama.cpp build_moe_ffn, softmax gating, normalised weights).
    for (n_expert, n_used, n_tokens) in [(256, 8, 4), (128, 8, 3)] {
        out.push(router_case(n_expert, n_used, n_tokens));
    }
}

fn top_k_case(dtype: DType, ne: [usize; 4], k: usize, layout: Layout, init: Init) -> Case {
    let distinct = if init == Init::Distinct { ",distinct" } else { "" };
    Case::new(
        "top_k",
        format_args!("type={dtype},ne={},k={k}{distinct}", sh(ne)),
        vec![In::new("x", dtype, ne).layout(layout).init(init)],
        move |g, x| g.top_k(x[0], k),
    )
}

/// `probs = softmax(logits)`, `sel = top_k(probs)`, `w = get_rows(probs as [1, n_expert, T], sel)`
/// normalised to sum 1 per token. The logits are distinct (spaced `2 / n_expert`), so the
/// selection cannot flip between the backend's f32 softmax and the judge's f64 one.
fn router_case(n_expert: usize, n_used: usize, n_tokens: usize) -> Case {
    Case::new(
        "top_k",
        format_args!("router,n_expert={n_expert},n_used={n_used},n_tokens={n_tokens}"),
        vec![In::new("logits", F32, [n_expert, n_tokens, 1, 1]).init(Init::Distinct)],
        move |g, x| route(g, x[0], n_expert, n_used, n_tokens),
    )
}

fn route(g: &mut Graph, logits: Tensor, n_expert: usize, n_used: usize, n_tokens: usize) -> Result<Tensor, GraphError> {
    let probs = g.softmax(logits, 1.0, None)?;
    let sel = g.top_k(probs, n_used)?;
    let rows = g.reshape(probs, &[1, n_expert, n_tokens])?;
    let w = g.get_rows(rows, sel)?;
    let w = g.reshape(w, &[n_used, n_tokens])?;
    let total = g.sum_rows(w)?;
    g.div(w, total)
}

fn argsort(out: &mut Vec<Case>) {
    for order in [SortOrder::Ascending, SortOrder::Descending] {
        for ne in [[1, 1, 1, 1], [7, 3, 1, 1], [33, 5, 2, 3], [256, 4, 1, 1], [1000, 2, 1, 1]] {
            out.push(argsort_case(F32, ne, order, Layout::Contiguous));
        }
        // Ties: bf16 rows of 256 uniform values repeat many values.
        out.push(argsort_case(BF16, [256, 3, 1, 1], order, Layout::Contiguous));
        out.push(argsort_case(F32, [33, 5, 2, 1], order, Layout::WINDOW));
    }
    out.push(argsort_case(F16, [67, 3, 1, 1], SortOrder::Descending, Layout::Contiguous));
    out.push(argsort_case(F32, [7, 33, 1, 1], SortOrder::Ascending, Layout::TRANSPOSED));
    out.push(argsort_case(F32, [33, 5, 4, 1], SortOrder::Descending, Layout::SWAP12));
}

fn argsort_case(dtype: DType, ne: [usize; 4], order: SortOrder, layout: Layout) -> Case {
    let order_name = match order {
        SortOrder::Ascending => "asc",
        SortOrder::Descending => "desc",
    };
    Case::new(
        "argsort",
        format_args!("type={dtype},ne={},order={order_name}", sh(ne)),
        vec![In::new("x", dtype, ne).layout(layout)],
        move |g, x| g.argsort(x[0], order),
    )
}

/// Full-size cases for perf mode (to be listed by `perf.rs`): the MoE router's top 8 of 256 over a
/// 2048-token prefill, a full argsort of a Qwen3.5-sized vocabulary row, and the l2_norm of a
/// 512-token prefill's GDN q (16 key heads, plus the dense model's 48 value-head width).
pub(super) fn perf_cases() -> Vec<Case> {
    vec![
        // 8 of 256 for one row (the router at decode) is an eval case: `perf --eval-cases` times it.
        top_k_case(F32, [256, 512, 1, 1], 8, Layout::Contiguous, Init::SIGNED),
        top_k_case(F32, [256, 2048, 1, 1], 8, Layout::Contiguous, Init::SIGNED),
        top_k_case(F32, [248_320, 4, 1, 1], 40, Layout::Contiguous, Init::SIGNED),
        argsort_case(F32, [248_320, 1, 1, 1], SortOrder::Descending, Layout::Contiguous),
        l2_norm_case(F32, [128, 16, 512, 1], 1e-6, Layout::Contiguous, Init::SIGNED),
        l2_norm_case(F32, [128, 48, 512, 1], 1e-6, Layout::Contiguous, Init::SIGNED),
        // Decode: one token's hidden state.
        rms_norm_case(F32, [5120, 1, 1, 1], 1e-6, Layout::Contiguous),
    ]
}
