//! Fused ops (issue 21): add_rms_norm_mul, rms_norm_mul, rms_norm_mul_rope, gated_rms_norm,
//! softmax_top_k, moe_weights, moe_router, mul_mat_swiglu, mul_mat_id_swiglu, mul_mat_id_weighted_sum, judged
//! like every op (the CPU by the f64 reference, which is the composition of the replaced ops;
//! other backends by the CPU).
//!
//! Shapes: the Qwen3.6 35B-A3B sizes (n_embd 2048, DeltaNet rows of S_v = 128 over 32 value
//! heads, attention heads of 256, a router of 8 of 256 experts, expert and shared-expert FFNs of
//! 512) at a few tokens, odd sizes, rows long enough for each CUDA kernel shape (a warp per row up
//! to 256, a block up to 8192, a loop beyond; router rows up to 1024 in two layouts), broadcast
//! weights and strided inputs.
//!
//! **Router ties** ([`tie_judge`]): softmax can round distinct logits to one probability (when
//! `x - max` rounds to the same f32), and then top_k's rule picks the lower index, where the f64
//! reference (which keeps the logits apart) picks the larger logit. The `ties` cases build rows
//! where that happens at the top-k cut; their ids pass when they are exactly the ids of that f32
//! rule, computed here from the logits (on the CPU, they are the composition's bit for bit).

use tessera_graph::{Graph, GraphError, Tensor};
use tessera_ops::{DType, RopePairing, RopeParams};

use super::quant::{BLOCK_WINDOW, QUANTS};
use super::{F32, I32, Mix, Routed, sh};
use crate::case::{Case, Generator, Init, InputSpec as In, Layout};
use crate::check::{Comparison, Mismatch};

pub(super) fn cases(out: &mut Vec<Case>) {
    add_rms_norm_mul(out);
    rms_norm_mul(out);
    rms_norm_mul_rope(out);
    gated_rms_norm(out);
    softmax_top_k(out);
    moe_weights(out);
    moe_router(out);
    mul_mat_swiglu(out);
    mul_mat_id_swiglu(out);
    mul_mat_id_weighted_sum(out);
}

const EPS: f32 = 1e-6;

/// Weight shapes, by name in labels.
fn w_label(w: [usize; 4]) -> String {
    format!("w={}", sh(w))
}

fn add_rms_norm_mul(out: &mut Vec<Case>) {
    // The residual stream of the 35B-A3B (n_embd 2048) at decode and a few tokens, odd rows, rows
    // past one warp (300) and past one block's registers (9000).
    for (e, n) in [(2048, 1), (2048, 7), (1, 1), (7, 3), (33, 5), (300, 2), (9000, 2)] {
        out.push(add_case([e, n, 1, 1], [e, 1, 1, 1], EPS, [Layout::Contiguous; 2]));
    }
    for eps in [0.0, 0.1] {
        out.push(add_case([67, 3, 1, 1], [67, 1, 1, 1], eps, [Layout::Contiguous; 2]));
    }
    // A weight per token, a scalar weight and one tiled along the row.
    out.push(add_case([33, 4, 1, 1], [33, 4, 1, 1], EPS, [Layout::Contiguous; 2]));
    out.push(add_case([64, 3, 1, 1], [1, 1, 1, 1], EPS, [Layout::Contiguous; 2]));
    out.push(add_case([64, 3, 1, 1], [16, 1, 1, 1], EPS, [Layout::Contiguous; 2]));
    // Addends whose rows are apart (windows of wider tensors).
    out.push(add_case([2048, 3, 1, 1], [2048, 1, 1, 1], EPS, [Layout::WINDOW, Layout::Contiguous]));
    out.push(add_case([300, 5, 1, 1], [300, 1, 1, 1], EPS, [Layout::Contiguous, Layout::WINDOW]));
    // The passes' users: both planes read through views, as in the model step.
    out.push(add_planes_case(2048, 5));
}

fn add_case(ne: [usize; 4], w: [usize; 4], eps: f32, layouts: [Layout; 2]) -> Case {
    Case::new(
        "add_rms_norm_mul",
        format_args!("ne={},{},eps={eps:e}", sh(ne), w_label(w)),
        vec![
            In::new("a", F32, ne).layout(layouts[0]),
            In::new("b", F32, ne).layout(layouts[1]),
            In::new("w", F32, w).init(Init::POSITIVE),
        ],
        move |g, x| g.add_rms_norm_mul(x[0], x[1], x[2], eps),
    )
}

/// `add_rms_norm_mul`, then each plane through its view `[E, n, 1, 1]` (byte offsets 0 and
/// `E * n * 4`) into the next ops: the residual plus 1, the normed input times 2, side by side.
fn add_planes_case(e: usize, n: usize) -> Case {
    Case::new(
        "add_rms_norm_mul",
        format_args!("ne={},{},eps={EPS:e},plane_views", sh([e, n, 1, 1]), w_label([e, 1, 1, 1])),
        vec![
            In::new("a", F32, [e, n, 1, 1]),
            In::new("b", F32, [e, n, 1, 1]),
            In::new("w", F32, [e, 1, 1, 1]).init(Init::POSITIVE),
        ],
        move |g, x| {
            let both = g.add_rms_norm_mul(x[0], x[1], x[2], EPS)?;
            let nb = [4, 4 * e, 4 * e * n, 4 * e * n];
            let s = g.view(both, [e, n, 1, 1], nb, 0)?;
            let h = g.view(both, [e, n, 1, 1], nb, 4 * e * n)?;
            let s = g.scale_bias(s, 1.0, 1.0)?;
            let h = g.scale(h, 2.0)?;
            g.concat(s, h, 0)
        },
    )
}

fn rms_norm_mul(out: &mut Vec<Case>) {
    // The final norm (2048), per-head q/k norms (256 wide heads, weight per head dim), odd rows,
    // the CUDA kernels' row lengths (warp <= 256 < block <= 8192 < loop).
    let shapes: [([usize; 4], [usize; 4]); 9] = [
        ([2048, 1, 1, 1], [2048, 1, 1, 1]),
        ([2048, 7, 1, 1], [2048, 1, 1, 1]),
        ([256, 16, 3, 1], [256, 1, 1, 1]),
        ([1, 1, 1, 1], [1, 1, 1, 1]),
        ([7, 3, 1, 1], [7, 1, 1, 1]),
        ([33, 5, 2, 3], [33, 5, 1, 1]),
        ([257, 3, 1, 1], [257, 1, 1, 1]),
        ([5120, 3, 1, 1], [5120, 1, 1, 1]),
        ([9000, 2, 1, 1], [9000, 1, 1, 1]),
    ];
    for (x, w) in shapes {
        out.push(norm_mul_case(x, w, EPS, Layout::Contiguous, Layout::Contiguous));
    }
    // Broadcast weights: scalar, tiled along ne0, varying in dims 2 and 3.
    out.push(norm_mul_case([64, 3, 1, 1], [1, 1, 1, 1], EPS, Layout::Contiguous, Layout::Contiguous));
    out.push(norm_mul_case([64, 3, 1, 1], [16, 1, 1, 1], EPS, Layout::Contiguous, Layout::Contiguous));
    out.push(norm_mul_case([16, 3, 4, 2], [16, 1, 2, 2], 0.0, Layout::Contiguous, Layout::Contiguous));
    // Strided x (heads and tokens swapped; rows apart) and a transposed weight per row.
    out.push(norm_mul_case([256, 4, 16, 1], [256, 1, 1, 1], EPS, Layout::SWAP12, Layout::Contiguous));
    out.push(norm_mul_case([33, 4, 2, 1], [33, 1, 1, 1], EPS, Layout::WINDOW, Layout::Contiguous));
    out.push(norm_mul_case([7, 33, 1, 1], [7, 33, 1, 1], EPS, Layout::Contiguous, Layout::TRANSPOSED));
    // The attention q norm: q is a view of the joint q+gate projection with head stride 2 * hd.
    out.push(q_norm_case(256, 16, 3));
}

fn norm_mul_case(x: [usize; 4], w: [usize; 4], eps: f32, x_layout: Layout, w_layout: Layout) -> Case {
    Case::new(
        "rms_norm_mul",
        format_args!("ne={},{},eps={eps:e}", sh(x), w_label(w)),
        vec![In::new("x", F32, x).layout(x_layout), In::new("w", F32, w).layout(w_layout).init(Init::POSITIVE)],
        move |g, x| g.rms_norm_mul(x[0], x[1], eps),
    )
}

/// `rms_norm_mul` of q, a view `[hd, n_head, n]` of the projection `[2 hd n_head, n]` (q and the
/// gate interleaved per head), as qwen35's attention reads it.
fn q_norm_case(hd: usize, n_head: usize, n: usize) -> Case {
    let ne = [2 * hd * n_head, n, 1, 1];
    Case::new(
        "rms_norm_mul",
        format_args!("qg={},q_view=[{hd},{n_head},{n}],{},eps={EPS:e}", sh(ne), w_label([hd, 1, 1, 1])),
        vec![In::new("qg", F32, ne), In::new("w", F32, [hd, 1, 1, 1]).init(Init::POSITIVE)],
        move |g, x| {
            let nb = [4, 2 * hd * 4, 2 * hd * n_head * 4, 2 * hd * n_head * n * 4];
            let q = g.view(x[0], [hd, n_head, n, 1], nb, 0)?;
            g.rms_norm_mul(q, x[1], EPS)
        },
    )
}

/// Qwen3.5/3.6's rope: NEOX, 64 of 256 dims, interleaved sections, base 1e7.
const QWEN35_ROPE: RopeParams =
    RopeParams { n_rot: 64, freq_base: 1e7, pairing: RopePairing::Neox, sections: Some([11, 11, 10, 0]) };
/// Qwen3's rope: NEOX over the whole head of 128, one position per token, base 1e6.
const QWEN3_ROPE: RopeParams = RopeParams { n_rot: 128, freq_base: 1e6, pairing: RopePairing::Neox, sections: None };

/// How `rms_norm_mul_rope`'s `x` is laid out: a tensor of its own, or q / k viewed in a joint
/// projection `[row, n_tokens]` at row offset `first` with head stride `head_stride` elements
/// (qwen35's q interleaved with its gate: stride 2 hd; qwen3's k in the stacked q/k/v rows).
#[derive(Clone, Copy)]
enum Heads {
    Own(Layout),
    Joint { row: usize, first: usize, head_stride: usize },
}

fn rms_norm_mul_rope(out: &mut Vec<Case>) {
    let own = Heads::Own(Layout::Contiguous);
    // qwen35: q viewed in the joint q+gate projection (16 heads of 256), k in the stacked q/k/v
    // rows (2 heads), decode and a few tokens.
    for n in [1, 3] {
        let q = Heads::Joint { row: 2 * 256 * 16, first: 0, head_stride: 512 };
        out.push(norm_rope_case([256, 16, n, 1], [256, 1, 1, 1], QWEN35_ROPE, q));
        let k = Heads::Joint { row: 2 * 256 * 16 + 2 * 2 * 256, first: 2 * 256 * 16, head_stride: 256 };
        out.push(norm_rope_case([256, 2, n, 1], [256, 1, 1, 1], QWEN35_ROPE, k));
    }
    // qwen3 (head dim 128, plain NEOX over the whole head): q and k in the stacked q/k/v rows.
    for n in [1, 5] {
        let qkv = 128 * (32 + 4 + 4);
        out.push(norm_rope_case(
            [128, 32, n, 1],
            [128, 1, 1, 1],
            QWEN3_ROPE,
            Heads::Joint { row: qkv, first: 0, head_stride: 128 },
        ));
        out.push(norm_rope_case(
            [128, 4, n, 1],
            [128, 1, 1, 1],
            QWEN3_ROPE,
            Heads::Joint { row: qkv, first: 128 * 32, head_stride: 128 },
        ));
    }
    out.push(norm_rope_case([256, 16, 4, 1], [256, 1, 1, 1], QWEN35_ROPE, own));
    out.push(norm_rope_case([128, 8, 7, 1], [128, 1, 1, 1], QWEN3_ROPE, own));
    // Odd heads and rotations: partial NEOX, adjacent pairs, the smallest head, a head past one
    // warp (300: CUDA leaves it to the CPU), heads and tokens swapped (rows apart).
    let rope = |n_rot, pairing, sections| RopeParams { n_rot, freq_base: 1e4, pairing, sections };
    out.push(norm_rope_case([33, 5, 3, 1], [33, 1, 1, 1], rope(32, RopePairing::Neox, None), own));
    out.push(norm_rope_case([6, 7, 2, 1], [6, 1, 1, 1], rope(4, RopePairing::Adjacent, None), own));
    out.push(norm_rope_case([2, 3, 1, 1], [2, 1, 1, 1], rope(2, RopePairing::Neox, Some([1, 0, 0, 0])), own));
    out.push(norm_rope_case([70, 3, 5, 1], [70, 1, 1, 1], rope(40, RopePairing::Neox, Some([2, 3, 1, 1])), own));
    out.push(norm_rope_case([300, 2, 3, 1], [300, 1, 1, 1], rope(64, RopePairing::Neox, None), own));
    out.push(norm_rope_case([64, 4, 6, 1], [64, 1, 1, 1], QWEN35_ROPE, Heads::Own(Layout::SWAP12)));
    // Broadcast weights: per head, scalar, tiled along the head.
    out.push(norm_rope_case([64, 4, 3, 1], [64, 4, 1, 1], QWEN3_ROPE_64, own));
    out.push(norm_rope_case([64, 4, 3, 1], [1, 1, 1, 1], QWEN3_ROPE_64, own));
    out.push(norm_rope_case([64, 4, 3, 1], [16, 1, 1, 1], QWEN3_ROPE_64, own));
}

/// [`QWEN3_ROPE`] for heads of 64.
const QWEN3_ROPE_64: RopeParams = RopeParams { n_rot: 64, ..QWEN3_ROPE };

fn norm_rope_case(x: [usize; 4], w: [usize; 4], p: RopeParams, heads: Heads) -> Case {
    let [hd, n_head, n, _] = x;
    let n_pos = n * if p.sections.is_some() { 4 } else { 1 };
    let sections = p.sections.map_or(String::new(), |s| format!(",sections={}", sh(s)));
    let pairing = match p.pairing {
        RopePairing::Neox => "neox",
        RopePairing::Adjacent => "adjacent",
    };
    let rope = format!("n_rot={},base={:e},{pairing}{sections}", p.n_rot, p.freq_base);
    let (x_in, view) = match heads {
        Heads::Own(layout) => (In::new("x", F32, x).layout(layout), String::new()),
        Heads::Joint { row, first, head_stride } => {
            (In::new("proj", F32, [row, n, 1, 1]), format!(",in=[{row},{n}]@{first},head_stride={head_stride}"))
        }
    };
    let pos = In::new("pos", I32, [n_pos, 1, 1, 1]).init(Init::Ids { rows: 32_768, unique: false });
    Case::new(
        "rms_norm_mul_rope",
        format_args!("ne={}{view},{},{rope},eps={EPS:e}", sh(x), w_label(w)),
        vec![x_in, In::new("w", F32, w).init(Init::POSITIVE), pos],
        move |g, t| {
            let x = match heads {
                Heads::Own(_) => t[0],
                Heads::Joint { first, head_stride, .. } => {
                    let nb = t[0].meta().nb;
                    g.view(t[0], [hd, n_head, n, 1], [4, 4 * head_stride, nb[1], nb[2]], 4 * first)?
                }
            };
            g.rms_norm_mul_rope(x, t[1], t[2], EPS, p)
        },
    )
}

fn gated_rms_norm(out: &mut Vec<Case>) {
    // The DeltaNet output gate of the 35B-A3B: rows of S_v = 128 over 32 value heads.
    for n in [1, 3] {
        out.push(gated_case([128, 32, n, 1], [128, 1, 1, 1], EPS, [Layout::Contiguous; 2]));
    }
    let shapes: [([usize; 4], [usize; 4]); 6] = [
        ([1, 1, 1, 1], [1, 1, 1, 1]),
        ([7, 3, 1, 1], [7, 1, 1, 1]),
        ([33, 5, 2, 3], [33, 1, 2, 1]),
        ([300, 4, 1, 1], [300, 1, 1, 1]),
        ([2048, 3, 1, 1], [2048, 1, 1, 1]),
        ([9000, 2, 1, 1], [9000, 1, 1, 1]),
    ];
    for (x, w) in shapes {
        out.push(gated_case(x, w, EPS, [Layout::Contiguous; 2]));
    }
    out.push(gated_case([64, 3, 1, 1], [16, 1, 1, 1], 0.0, [Layout::Contiguous; 2]));
    out.push(gated_case([128, 4, 8, 1], [128, 1, 1, 1], EPS, [Layout::SWAP12, Layout::WINDOW]));
    out.push(gated_case([33, 4, 2, 1], [33, 1, 1, 1], EPS, [Layout::WINDOW, Layout::SWAP12]));
}

fn gated_case(x: [usize; 4], w: [usize; 4], eps: f32, layouts: [Layout; 2]) -> Case {
    Case::new(
        "gated_rms_norm",
        format_args!("ne={},{},eps={eps:e}", sh(x), w_label(w)),
        vec![
            In::new("x", F32, x).layout(layouts[0]),
            In::new("w", F32, w).init(Init::POSITIVE),
            // gates over silu's curved part and both tails
            In::new("z", F32, x).layout(layouts[1]).init(Init::Uniform { lo: -8.0, hi: 8.0 }),
        ],
        move |g, x| g.gated_rms_norm(x[0], x[1], x[2], eps),
    )
}

fn softmax_top_k(out: &mut Vec<Case>) {
    // The router: 8 of 256 experts at decode and a few tokens. Distinct logits (spaced 2 / 256):
    // no two probabilities are near-equal, so f32 and f64 pick the same experts.
    for n in [1, 7, 32] {
        out.push(top_k_case([256, n, 1, 1], 8, Layout::Contiguous, Init::Distinct));
    }
    for k in [1, 16, 33, 256] {
        out.push(top_k_case([256, 5, 1, 1], k, Layout::Contiguous, Init::Distinct));
    }
    // Odd expert counts (rows not a multiple of 4 take the CUDA kernel's general layout), the
    // longest router row the CUDA kernel takes, and a large k.
    for (ne, k) in [([1, 1, 1, 1], 1), ([7, 3, 1, 1], 7), ([33, 5, 1, 1], 5), ([250, 3, 1, 1], 8)] {
        out.push(top_k_case(ne, k, Layout::Contiguous, Init::Distinct));
    }
    out.push(top_k_case([1024, 3, 1, 1], 8, Layout::Contiguous, Init::Distinct));
    out.push(top_k_case([1000, 2, 1, 1], 100, Layout::Contiguous, Init::Distinct));
    out.push(top_k_case([128, 4, 1, 1], 8, Layout::Contiguous, Init::Distinct));
    // Strided logits: rows apart (misaligned), and a transposed view (nb0 != 4).
    out.push(top_k_case([256, 3, 1, 1], 8, Layout::WINDOW, Init::Distinct));
    out.push(top_k_case([40, 6, 1, 1], 4, Layout::TRANSPOSED, Init::Distinct));
    // Ids appended (a shared expert as slot k): one row, several, after strided logits.
    for (ne, k, m, layout) in [
        ([256, 1, 1, 1], 8, 1, Layout::Contiguous),
        ([256, 7, 1, 1], 8, 1, Layout::WINDOW),
        ([33, 5, 1, 1], 5, 3, Layout::Contiguous),
    ] {
        out.push(Case::new(
            "softmax_top_k",
            format_args!("ne={},k={k},tail={m}", sh(ne)),
            vec![
                In::new("logits", F32, ne).layout(layout).init(Init::Distinct),
                In::new("tail", I32, [m, ne[1], 1, 1])
                    .layout(layout)
                    .init(Init::Ids { rows: ne[0] + 1, unique: false }),
            ],
            move |g, x| g.softmax_top_k_then(x[0], k, x[1]),
        ));
    }
    // Many rows (the CUDA warp-per-row kernel from 64, k <= 32): both layouts, k = 32, and
    // k = 33 (the block kernel again).
    for (ne, k, layout) in [
        ([256, 100, 1, 1], 8, Layout::Contiguous),
        ([250, 70, 1, 1], 8, Layout::Contiguous),
        ([1024, 64, 1, 1], 32, Layout::Contiguous),
        ([256, 65, 1, 1], 33, Layout::Contiguous),
        ([40, 80, 1, 1], 4, Layout::TRANSPOSED),
    ] {
        out.push(top_k_case(ne, k, layout, Init::Distinct));
    }
    // Probabilities tied by f32 rounding at the cut, in both CUDA layouts and both kernels.
    for (ne, layout) in [
        ([256, 4, 1, 1], Layout::Contiguous),
        ([256, 3, 1, 1], Layout::WINDOW),
        ([256, 80, 1, 1], Layout::Contiguous),
        ([256, 66, 1, 1], Layout::WINDOW),
    ] {
        out.push(ties_case(ne, 8, layout));
    }
}

fn top_k_case(ne: [usize; 4], k: usize, layout: Layout, init: Init) -> Case {
    Case::new(
        "softmax_top_k",
        format_args!("ne={},k={k}", sh(ne)),
        vec![In::new("logits", F32, ne).layout(layout).init(init)],
        move |g, x| g.softmax_top_k(x[0], k),
    )
}

/// Router logits with ties after softmax (`Generator::f`): per row one logit 1, twenty logits
/// `j · 1e-9` (`j < 20`, shuffled), the rest in [-3, -0.5). Every `x - max` of the twenty rounds
/// to -1 in f32, so their probabilities are equal and top-8 takes the lowest seven indices among
/// them; in f64 the larger `j` wins.
fn tie_logits(ne: [usize; 4], _args: [f32; 4], seed: u64) -> Vec<f32> {
    let mut rng = Mix(seed);
    let n = ne[0];
    let mut out = Vec::with_capacity(n * ne[1]);
    for _ in 0..ne[1] {
        let mut row: Vec<f32> = (0..n).map(|_| -3.0 + 2.5 * rng.unit()).collect();
        let mut order: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            order.swap(i, rng.below(i + 1));
        }
        row[order[0]] = 1.0;
        for (j, &i) in order[1..21.min(n)].iter().enumerate() {
            row[i] = j as f32 * 1e-9;
        }
        out.extend(row);
    }
    out
}

fn ties_case(ne: [usize; 4], k: usize, layout: Layout) -> Case {
    Case::new(
        "softmax_top_k",
        format_args!("ne={},k={k},ties", sh(ne)),
        vec![
            In::new("logits", F32, ne)
                .layout(layout)
                .init(Init::Generated(Generator { f: tie_logits, args: [0.0; 4] })),
        ],
        move |g, x| g.softmax_top_k(x[0], k),
    )
    .with_judge(move |inputs, got, want| tie_judge(ne[0], k, inputs, got, want))
}

/// Passes ids that are exactly the f32 rule's: per row, order by `x - max` rounded to f32, larger
/// first, lower index among equal ones (softmax is monotone, so equal rounded differences are
/// equal probabilities; the distinct ones in these rows are far apart). Both the composition and
/// the fused op on any backend follow it; the f64 reference does not (it keeps the logits apart),
/// so the CPU passes against it through the rule. The `nmse` column is the share of rows whose
/// ids differ from the judge's (1 against the reference, 0 against the CPU).
fn tie_judge(n: usize, k: usize, inputs: &[Vec<f64>], got: &[f64], want: &[f64]) -> Comparison {
    let logits = &inputs[0];
    let rows = logits.len() / n;
    if got.len() != want.len() || got.len() != rows * k {
        return Comparison {
            nmse: f64::INFINITY,
            mismatches: vec![Mismatch::Length { got: got.len(), want: want.len() }],
        };
    }
    let (mut differ, mut bad) = (0usize, Vec::new());
    for r in 0..rows {
        let (g, w) = (&got[r * k..(r + 1) * k], &want[r * k..(r + 1) * k]);
        differ += usize::from(g != w);
        let row: Vec<f32> = logits[r * n..(r + 1) * n].iter().map(|&v| v as f32).collect();
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut idx: Vec<usize> = (0..n).collect();
        idx.sort_by(|&i, &j| (row[j] - max).total_cmp(&(row[i] - max)).then(i.cmp(&j)));
        if !idx[..k].iter().zip(g).all(|(&i, &v)| i as f64 == v) {
            bad.push(r * k);
        }
    }
    let mismatches = match bad.first() {
        Some(&first) => vec![Mismatch::Exact { count: bad.len(), first, got: got[first], want: want[first] }],
        None => Vec::new(),
    };
    Comparison { nmse: differ as f64 / rows as f64, mismatches }
}

/// An out-of-range expert id (256 of 256) in token 1, slot 5, after valid ones, and a second bad
/// one (-1) later: the first in logical order is the error.
const BAD_IDS: [i32; 24] = [3, 9, 200, 17, 0, 255, 4, 8, 1, 2, 77, 6, 5, 256, 30, 31, 11, 12, 13, -1, 15, 16, 19, 18];

fn moe_weights(out: &mut Vec<Case>) {
    // The router's 8 of 256 at decode and a few tokens (distinct ids per token, as top-k gives).
    for n in [1, 7, 32] {
        out.push(moe_case([256, n, 1, 1], 8, true, Layout::Contiguous, Layout::Contiguous));
    }
    // Odd counts, repeated ids, k past one warp's lanes, the longest CUDA router row.
    for (ne, k, unique) in
        [([1, 1, 1, 1], 1, true), ([7, 3, 1, 1], 7, true), ([33, 5, 1, 1], 12, false), ([250, 3, 1, 1], 40, true)]
    {
        out.push(moe_case(ne, k, unique, Layout::Contiguous, Layout::Contiguous));
    }
    out.push(moe_case([1024, 2, 1, 1], 8, true, Layout::Contiguous, Layout::Contiguous));
    // Strided logits and ids.
    out.push(moe_case([256, 3, 1, 1], 8, true, Layout::WINDOW, Layout::TRANSPOSED));
    out.push(moe_case([40, 6, 1, 1], 4, false, Layout::TRANSPOSED, Layout::WINDOW));
    // A gate's sigmoid appended (a shared expert as slot k), the gate contiguous and strided.
    for (ne, k, layout) in [
        ([256, 1, 1, 1], 8, Layout::Contiguous),
        ([256, 7, 1, 1], 8, Layout::WINDOW),
        ([7, 3, 1, 1], 7, Layout::Contiguous),
    ] {
        out.push(Case::new(
            "moe_weights",
            format_args!("ne={},k={k},gated", sh(ne)),
            vec![
                In::new("logits", F32, ne).init(Init::Uniform { lo: -4.0, hi: 4.0 }),
                In::new("ids", I32, [k, ne[1], 1, 1]).init(Init::Ids { rows: ne[0], unique: true }),
                In::new("gate", F32, [1, ne[1], 1, 1]).layout(layout).init(Init::Uniform { lo: -8.0, hi: 8.0 }),
            ],
            |g, x| g.moe_weights_gated(x[0], x[1], x[2]),
        ));
    }
    // The model's chain: ids from softmax_top_k, then the weights of the same logits; and with
    // the shared expert routed (stacked logits, its id appended, its gate's weight appended).
    for n in [1, 5] {
        out.push(router_chain_case(256, 8, n));
        out.push(shared_router_case(256, 8, n));
    }
    // A bad expert id: the run fails like the judge's, naming the first one.
    out.push(
        Case::new(
            "moe_weights",
            "ne=[256,3,1,1],k=8,ids=bad",
            vec![
                In::new("logits", F32, [256, 3, 1, 1]).init(Init::Distinct),
                In::new("ids", I32, [8, 3, 1, 1]).init(Init::Fixed(&BAD_IDS)),
            ],
            |g, x| g.moe_weights(x[0], x[1]),
        )
        .expect_error(),
    );
}

fn moe_case(ne: [usize; 4], k: usize, unique: bool, logits_layout: Layout, ids_layout: Layout) -> Case {
    let ids_init = Init::Ids { rows: ne[0], unique };
    let repeats = if unique { "" } else { ",repeats" };
    Case::new(
        "moe_weights",
        format_args!("ne={},k={k}{repeats}", sh(ne)),
        vec![
            In::new("logits", F32, ne).layout(logits_layout).init(Init::Uniform { lo: -4.0, hi: 4.0 }),
            In::new("ids", I32, [k, ne[1], 1, 1]).layout(ids_layout).init(ids_init),
        ],
        |g, x| g.moe_weights(x[0], x[1]),
    )
}

/// `sel = softmax_top_k(logits, k)`, `w = moe_weights(logits, sel)`: both compared.
fn router_chain_case(n_expert: usize, k: usize, n: usize) -> Case {
    Case::new(
        "moe_weights",
        format_args!("router,n_expert={n_expert},k={k},n_tokens={n}"),
        vec![In::new("logits", F32, [n_expert, n, 1, 1]).init(Init::Distinct)],
        move |g, x| route(g, x[0], k),
    )
}

/// The router of qwen35's `moe_shared_routed` after the passes: logits `[n_expert + 1, n]` (the
/// shared gate's last), the ids with the shared expert's appended and the weights with the
/// gate's: both compared.
fn shared_router_case(n_expert: usize, k: usize, n: usize) -> Case {
    Case::new(
        "moe_weights",
        format_args!("router,n_expert={n_expert},k={k},n_tokens={n},shared"),
        vec![
            In::new("logits", F32, [n_expert + 1, n, 1, 1]).init(Init::Distinct),
            In::new("shared", I32, [1, n, 1, 1]).init(Init::Ids { rows: n_expert + 1, unique: false }),
        ],
        move |g, x| {
            let row = 4 * (n_expert + 1);
            let logits = g.view(x[0], [n_expert, n, 1, 1], [4, row, row * n, row * n], 0)?;
            let gate = g.view(x[0], [1, n, 1, 1], [4, row, row * n, row * n], 4 * n_expert)?;
            let ids = g.softmax_top_k_then(logits, k, x[1])?;
            let slot = 4 * (k + 1);
            let routed = g.view(ids, [k, n, 1, 1], [4, slot, slot * n, slot * n], 0)?;
            let w = g.moe_weights_gated(logits, routed, gate)?;
            g.mark_output(ids)?;
            Ok(w)
        },
    )
}

fn route(g: &mut Graph, logits: Tensor, k: usize) -> Result<Tensor, GraphError> {
    let sel = g.softmax_top_k(logits, k)?;
    g.moe_weights(logits, sel)
}

fn moe_router(out: &mut Vec<Case>) {
    // 8 of 256 at decode and a few tokens; odd counts (the CUDA kernel's general layout), k past
    // one warp's lanes, the longest CUDA router row; strided logits.
    for (ne, k, layout) in [
        ([256, 1, 1, 1], 8, Layout::Contiguous),
        ([256, 7, 1, 1], 8, Layout::Contiguous),
        ([256, 32, 1, 1], 8, Layout::Contiguous),
        ([1, 1, 1, 1], 1, Layout::Contiguous),
        ([7, 3, 1, 1], 7, Layout::Contiguous),
        ([250, 3, 1, 1], 40, Layout::Contiguous),
        ([1024, 2, 1, 1], 8, Layout::Contiguous),
        ([256, 3, 1, 1], 8, Layout::WINDOW),
        ([40, 6, 1, 1], 4, Layout::TRANSPOSED),
        // many rows: the CUDA warp-per-row kernel (from 64 rows, k <= 32)
        ([256, 128, 1, 1], 8, Layout::Contiguous),
        ([33, 64, 1, 1], 5, Layout::Contiguous),
        ([1024, 70, 1, 1], 32, Layout::Contiguous),
        ([40, 80, 1, 1], 4, Layout::TRANSPOSED),
    ] {
        out.push(Case::new(
            "moe_router",
            format_args!("ne={},k={k}", sh(ne)),
            vec![In::new("logits", F32, ne).layout(layout).init(Init::Distinct)],
            move |g, x| {
                let r = g.moe_router(x[0], k)?;
                planes(g, r)
            },
        ));
    }
    // A tail of m ids and gates (qwen35's shared expert: m = 1, its gate logit a row of the
    // stacked router's), contiguous and strided.
    for (n_expert, n, k, m, layout) in [
        (256, 1, 8, 1, Layout::Contiguous),
        (256, 5, 8, 1, Layout::WINDOW),
        (33, 4, 5, 3, Layout::Contiguous),
        (256, 96, 8, 1, Layout::WINDOW),
        (33, 64, 5, 3, Layout::Contiguous),
    ] {
        out.push(Case::new(
            "moe_router",
            format_args!("ne=[{n_expert},{n},1,1],k={k},tail={m}"),
            vec![
                In::new("logits", F32, [n_expert, n, 1, 1]).layout(layout).init(Init::Distinct),
                In::new("tail", I32, [m, n, 1, 1]).layout(layout).init(Init::Ids { rows: n_expert + 1, unique: false }),
                In::new("gate", F32, [m, n, 1, 1]).layout(layout).init(Init::Uniform { lo: -8.0, hi: 8.0 }),
            ],
            move |g, x| {
                let r = g.moe_router_then(x[0], k, x[1], x[2])?;
                planes(g, r)
            },
        ));
    }
}

/// A router's two planes as outputs: the ids (compared exactly) and the weights (f32).
fn planes(g: &mut Graph, router: Tensor) -> Result<Tensor, GraphError> {
    let (ids, w) = g.router_planes(router)?;
    g.mark_output(ids)?;
    Ok(w)
}

/// f32 weights and the two block formats.
const GATE_UP_TYPES: [DType; 3] = [F32, QUANTS[0], QUANTS[1]];

/// One gate-and-up case: weights `[k, m, bs_a]` of `type_a` (gate and up), activations
/// `[k, n, bs_b]` f32.
#[derive(Debug, Clone, Copy)]
struct GateUp {
    type_a: DType,
    m: usize,
    n: usize,
    k: usize,
    bs_a: [usize; 2],
    bs_b: [usize; 2],
    layout_w: Layout,
    layout_x: Layout,
}

impl GateUp {
    fn new(type_a: DType, m: usize, n: usize, k: usize) -> Self {
        let (bs, cont) = ([1, 1], Layout::Contiguous);
        GateUp { type_a, m, n, k, bs_a: bs, bs_b: bs, layout_w: cont, layout_x: cont }
    }

    /// Labelled like mul_mat's: `mul_mat_swiglu(type_a=q8_0,m=..,n=..,k=..,bs=[..],nr=[..])`.
    fn case(self) -> Case {
        let GateUp { type_a, m, n, k, bs_a, bs_b, .. } = self;
        let nr = [bs_b[0] / bs_a[0], bs_b[1] / bs_a[1]];
        let w = [k, m, bs_a[0], bs_a[1]];
        Case::new(
            "mul_mat_swiglu",
            format_args!("type_a={type_a},m={m},n={n},k={k},bs=[{},{}],nr=[{},{}]", bs_a[0], bs_a[1], nr[0], nr[1]),
            vec![
                In::new("wg", type_a, w).layout(self.layout_w),
                In::new("wu", type_a, w).layout(self.layout_w),
                In::new("x", F32, [k, n, bs_b[0], bs_b[1]]).layout(self.layout_x),
            ],
            |g, x| g.mul_mat_swiglu(x[0], x[1], x[2]),
        )
        .with_bound(gate_up_bound(type_a))
    }
}

/// The gate-and-up ops' bound: two products, each within mul_mat's bound, so twice it for block
/// weights, which a backend may multiply by activations it quantizes (the CUDA decode kernels'
/// int16 activations put one q8_0 product near 6e-8); the default otherwise.
fn gate_up_bound(type_a: DType) -> f64 {
    let one = crate::case::default_bound([type_a, F32], F32);
    if type_a.is_quantized() { 2.0 * one } else { one }
}

fn mul_mat_swiglu(out: &mut Vec<Case>) {
    // The 35B-A3B's shared expert (2048 -> 512) at decode and 5 tokens, and scaled down (256 ->
    // 96) at 1, 2, 5 and 17 tokens: dot products, and past 16 tokens the GEMM path for quantized
    // weights.
    for type_a in GATE_UP_TYPES {
        for n in [1, 2, 5, 17] {
            out.push(GateUp::new(type_a, 96, n, 256).case());
        }
        for n in [1, 5] {
            out.push(GateUp::new(type_a, 512, n, 2048).case());
        }
    }
    // Odd sizes, the dense model's FFN at 2 tokens (64 -> 128, tiny), weights broadcast over
    // batches of activations.
    out.push(GateUp::new(F32, 7, 3, 33).case());
    out.push(GateUp::new(F32, 128, 2, 64).case());
    for type_a in GATE_UP_TYPES {
        out.push(GateUp { bs_a: [2, 1], bs_b: [4, 1], ..GateUp::new(type_a, 16, 3, 128) }.case());
    }
    // Past 8 tokens in one launch for both products where a backend can (the tiles of gate then
    // up, partial ones and k split across blocks), over batches and with windowed weights.
    for type_a in [DType::Q8_0, DType::NvFp4] {
        out.push(GateUp::new(type_a, 200, 140, 512).case());
        out.push(GateUp { bs_a: [2, 1], bs_b: [4, 1], ..GateUp::new(type_a, 130, 20, 256) }.case());
        out.push(GateUp { layout_w: BLOCK_WINDOW, ..GateUp::new(type_a, 72, 40, 256) }.case());
    }
    // Strided: transposed or windowed activations, windowed weights (dense rows of whole blocks).
    for type_a in GATE_UP_TYPES {
        out.push(GateUp { layout_x: Layout::TRANSPOSED, ..GateUp::new(type_a, 24, 6, 128) }.case());
        out.push(GateUp { layout_w: BLOCK_WINDOW, layout_x: Layout::WINDOW, ..GateUp::new(type_a, 24, 2, 128) }.case());
    }
}

/// One routed gate-and-up case: experts `[k, m, n_expert]` of `type_a` (gate and up),
/// activations `[k, n_b, n_tokens]`, ids `[n_used, n_tokens]` (distinct experts a token unless
/// `ids` says otherwise).
#[derive(Debug, Clone, Copy)]
struct GateUpId {
    type_a: DType,
    n_expert: usize,
    n_used: usize,
    n_b: usize,
    m: usize,
    k: usize,
    n_tokens: usize,
    layout_w: Layout,
    layout_x: Layout,
    /// How the ids are drawn when not `n_used` distinct experts a token: a label and the init.
    ids: Option<(&'static str, Init)>,
}

impl GateUpId {
    fn new(type_a: DType, n_expert: usize, n_used: usize, n_b: usize, m: usize, k: usize, n_tokens: usize) -> Self {
        let cont = Layout::Contiguous;
        GateUpId { type_a, n_expert, n_used, n_b, m, k, n_tokens, layout_w: cont, layout_x: cont, ids: None }
    }

    /// Labelled like mul_mat_id's: `mul_mat_id_swiglu(type_a=..,n_mats=..,n_used=..,b=..,m=..,n=..,k=..)`.
    fn case(self) -> Case {
        let GateUpId { type_a, n_expert, n_used, n_b, m, k, n_tokens, ids, .. } = self;
        let (label, ids) = Routed { type_a, n_expert, n_used, n_b, m, k, n_tokens, ids }.label_and_ids();
        let w = [k, m, n_expert, 1];
        Case::new(
            "mul_mat_id_swiglu",
            label,
            vec![
                In::new("wg", type_a, w).layout(self.layout_w),
                In::new("wu", type_a, w).layout(self.layout_w),
                In::new("x", F32, [k, n_b, n_tokens, 1]).layout(self.layout_x),
                In::new("ids", I32, [n_used, n_tokens, 1, 1]).init(ids),
            ],
            |g, x| g.mul_mat_id_swiglu(x[0], x[1], x[2], x[3]),
        )
        .with_bound(gate_up_bound(type_a))
    }
}

/// Ids `[4, 1]` over 8 experts with one out of range (9, slot 1).
const BAD_IDS_ONE_TOKEN: [i32; 4] = [2, 9, 0, 5];

/// Ids `[4, 3]` over 8 experts with one out of range (8, token 1 slot 2): every backend names it
/// (with several, a GPU reports whichever its threads meet first).
const BAD_GATE_UP_IDS: [i32; 12] = [0, 5, 2, 7, 1, 3, 8, 6, 4, 2, 1, 0];

fn mul_mat_id_swiglu(out: &mut Vec<Case>) {
    // The 35B-A3B's routed experts scaled down (16 experts top-4, 256 -> 64) at 1, 2, 5 and 17
    // tokens, the activations one row shared by the slots (the model's gate/up) or one a slot.
    for type_a in GATE_UP_TYPES {
        for n_tokens in [1, 2, 5, 17] {
            for n_b in [1, 4] {
                out.push(GateUpId::new(type_a, 16, 4, n_b, 64, 256, n_tokens).case());
            }
        }
    }
    // The 35B-A3B's expert shape (2048 -> 512, 256 experts, top-8) at decode, and its rows over
    // 16 experts at 5 tokens.
    out.push(GateUpId::new(QUANTS[1], 256, 8, 1, 512, 2048, 1).case());
    for type_a in QUANTS {
        out.push(GateUpId::new(type_a, 16, 8, 1, 512, 2048, 5).case());
    }
    // Skewed routing (repeated ids, every pair to one expert: a grouped product of 40 columns),
    // strided activations and windowed experts.
    for type_a in GATE_UP_TYPES {
        let repeats = GateUpId {
            ids: Some(("repeats", Init::Ids { rows: 8, unique: false })),
            ..GateUpId::new(type_a, 8, 4, 1, 40, 128, 9)
        };
        out.push(repeats.case());
        let one = GateUpId {
            ids: Some(("expert0", Init::Ids { rows: 1, unique: false })),
            ..GateUpId::new(type_a, 8, 8, 1, 40, 128, 5)
        };
        out.push(one.case());
        let strided =
            GateUpId { layout_w: BLOCK_WINDOW, layout_x: Layout::SWAP12, ..GateUpId::new(type_a, 8, 2, 2, 16, 128, 3) };
        out.push(strided.case());
    }
    // A prefill-like batch where expert 0 takes slot 0 of every token (48 pairs: the tiled
    // kernels' busy expert) and the other slots spread over the rest (the few-pairs kernels): both
    // paths over one grouping, for the gate and the up experts.
    for type_a in QUANTS {
        let busy = GateUpId {
            ids: Some(("busy0", Init::Generated(Generator { f: busy_expert0_ids, args: [8.0, 0.0, 0.0, 0.0] }))),
            ..GateUpId::new(type_a, 8, 4, 1, 64, 256, 48)
        };
        out.push(busy.case());
    }
    // One token over q8_0 / nvfp4 experts of whole 256-value chunks (a backend's one-token ring):
    // output rows that straddle two slots in one stage, several stages a block, an odd slot
    // count, and an out-of-range id.
    for type_a in QUANTS {
        out.push(GateUpId::new(type_a, 16, 9, 1, 37, 256, 1).case());
        out.push(GateUpId::new(type_a, 16, 4, 1, 300, 512, 1).case());
        let bad = GateUpId {
            ids: Some(("bad", Init::Fixed(&BAD_IDS_ONE_TOKEN))),
            ..GateUpId::new(type_a, 8, 4, 1, 24, 256, 1)
        };
        out.push(bad.case().expect_error());
    }
    // An out-of-range id: the run fails like the judge's, naming the fused op.
    for type_a in GATE_UP_TYPES {
        let bad = GateUpId {
            ids: Some(("bad", Init::Fixed(&BAD_GATE_UP_IDS))),
            ..GateUpId::new(type_a, 8, 4, 1, 24, 128, 3)
        };
        out.push(bad.case().expect_error());
    }
}

/// Ids `[n_used, n_tokens]` over `args[0]` experts: slot 0 of every token expert 0, the other
/// slots distinct experts drawn from the rest.
fn busy_expert0_ids(ne: [usize; 4], args: [f32; 4], seed: u64) -> Vec<f32> {
    let (n_used, n_tokens, n_expert) = (ne[0], ne[1] * ne[2] * ne[3], args[0] as usize);
    let mut g = Mix(seed);
    let mut out = Vec::with_capacity(n_used * n_tokens);
    for _ in 0..n_tokens {
        let mut rest: Vec<usize> = (1..n_expert).collect();
        let others = (1..n_used).map(|_| rest.swap_remove(g.below(rest.len())) as f32);
        out.extend(std::iter::once(0.0).chain(others.collect::<Vec<_>>()));
    }
    out
}

/// A routed down-projection-and-combine case (`Routed`'s experts, activations and ids) with
/// router weights f32 `[1, n_used, n_tokens]`.
fn weighted_sum(
    type_a: DType,
    n_expert: usize,
    n_used: usize,
    n_b: usize,
    m: usize,
    k: usize,
    n_tokens: usize,
) -> Routed {
    Routed { type_a, n_expert, n_used, n_b, m, k, n_tokens, ids: None }
}

fn weighted_sum_inputs(r: &Routed) -> Vec<In> {
    let (_, ids) = r.label_and_ids();
    vec![
        In::new("experts", r.type_a, [r.k, r.m, r.n_expert, 1]),
        In::new("x", F32, [r.k, r.n_b, r.n_tokens, 1]),
        In::new("ids", I32, [r.n_used, r.n_tokens, 1, 1]).init(ids),
        In::new("w", F32, [1, r.n_used, r.n_tokens, 1]),
    ]
}

/// Labelled like mul_mat_id's.
fn weighted_sum_case(r: Routed) -> Case {
    let (label, _) = r.label_and_ids();
    Case::new("mul_mat_id_weighted_sum", label, weighted_sum_inputs(&r), |g, x| {
        g.mul_mat_id_weighted_sum(x[0], x[1], x[2], x[3])
    })
}

fn mul_mat_id_weighted_sum(out: &mut Vec<Case>) {
    // The 35B-A3B's down projection scaled down (16 experts top-4, 64 -> 256) at 1, 2, 5, 17 and
    // 40 tokens (past a backend's decode path), one activation row a slot (the model's) or one
    // shared; its real shape (512 -> 2048, 256 experts top-8) at decode and 5 tokens.
    for type_a in GATE_UP_TYPES {
        for n_tokens in [1, 2, 5, 17, 40] {
            for n_b in [4, 1] {
                out.push(weighted_sum_case(weighted_sum(type_a, 16, 4, n_b, 256, 64, n_tokens)));
            }
        }
    }
    for n_tokens in [1, 5] {
        out.push(weighted_sum_case(weighted_sum(QUANTS[1], 256, 8, 8, 2048, 512, n_tokens)));
    }
    // One token over q8_0 / nvfp4 experts of whole 256-value chunks (a backend's one-token
    // ring): an odd slot count with one activation row a slot or one shared, odd rows, several
    // stages a block, and an out-of-range id.
    for type_a in QUANTS {
        for n_b in [9, 1] {
            out.push(weighted_sum_case(weighted_sum(type_a, 16, 9, n_b, 37, 256, 1)));
        }
        out.push(weighted_sum_case(weighted_sum(type_a, 16, 4, 4, 300, 512, 1)));
        let bad =
            Routed { ids: Some(("bad", Init::Fixed(&BAD_IDS_ONE_TOKEN))), ..weighted_sum(type_a, 8, 4, 4, 24, 256, 1) };
        out.push(weighted_sum_case(bad).expect_error());
    }
    // Odd rows (a backend's last block of rows), repeated ids, and a bad id naming the op.
    for type_a in GATE_UP_TYPES {
        out.push(weighted_sum_case(weighted_sum(type_a, 8, 3, 3, 37, 128, 2)));
        let repeats = Routed {
            ids: Some(("repeats", Init::Ids { rows: 8, unique: false })),
            ..weighted_sum(type_a, 8, 4, 4, 40, 128, 9)
        };
        out.push(weighted_sum_case(repeats));
        let bad =
            Routed { ids: Some(("bad", Init::Fixed(&BAD_GATE_UP_IDS))), ..weighted_sum(type_a, 8, 4, 4, 24, 128, 3) };
        out.push(weighted_sum_case(bad).expect_error());
    }
}

/// The unfused chains, for perf mode's side-by-side timings (labelled `unfused`); the add's sum
/// stays a tensor of its own, as in the model step.
fn unfused(op: &'static str, g: &mut Graph, x: &[Tensor], k: usize) -> Result<Tensor, GraphError> {
    match op {
        "add_rms_norm_mul" => {
            let s = g.add(x[0], x[1])?;
            let h = g.rms_norm(s, EPS)?;
            g.mul(h, x[2])
        }
        "rms_norm_mul" => {
            let h = g.rms_norm(x[0], EPS)?;
            g.mul(h, x[1])
        }
        // what the pass before it leaves: rms_norm_mul, then the rotation
        "rms_norm_mul_rope" => {
            let h = g.rms_norm_mul(x[0], x[1], EPS)?;
            g.rope_multi(h, x[2], QWEN35_ROPE)
        }
        "gated_rms_norm" => {
            let h = g.rms_norm(x[0], EPS)?;
            let h = g.mul(h, x[1])?;
            let z = g.silu(x[2])?;
            g.mul(h, z)
        }
        "softmax_top_k" => {
            let p = g.softmax(x[0], 1.0, None)?;
            g.top_k(p, k)
        }
        "mul_mat_swiglu" => {
            let gate = g.mul_mat(x[0], x[2])?;
            let up = g.mul_mat(x[1], x[2])?;
            g.swiglu(gate, up)
        }
        "mul_mat_id_swiglu" => {
            let gate = g.mul_mat_id(x[0], x[2], x[3])?;
            let up = g.mul_mat_id(x[1], x[2], x[3])?;
            g.swiglu(gate, up)
        }
        "mul_mat_id_weighted_sum" => {
            let ex = g.mul_mat_id(x[0], x[1], x[2])?;
            let ex = g.mul(ex, x[3])?;
            let slots_first = g.transpose(ex)?;
            let s = g.sum_rows(slots_first)?;
            let [_, m, n, _] = s.ne();
            g.reshape(s, &[m, n])
        }
        "moe_weights" => {
            let [n_expert, n, _, _] = x[0].ne();
            let p = g.softmax(x[0], 1.0, None)?;
            let rows = g.reshape(p, &[1, n_expert, n])?;
            let w = g.get_rows(rows, x[1])?;
            let w = g.reshape(w, &[k, n])?;
            let total = g.sum_rows(w)?;
            let w = g.div(w, total)?;
            g.reshape(w, &[1, k, n])
        }
        // what the passes before it leave: softmax_top_k, then moe_weights
        "moe_router" => {
            let ids = g.softmax_top_k(x[0], k)?;
            g.mark_output(ids)?;
            g.moe_weights(x[0], ids)
        }
        _ => unreachable!("unfused: unknown op {op}"),
    }
}

/// The fused op `op` on `x`.
fn fused(op: &'static str, g: &mut Graph, x: &[Tensor], k: usize) -> Result<Tensor, GraphError> {
    match op {
        "add_rms_norm_mul" => g.add_rms_norm_mul(x[0], x[1], x[2], EPS),
        "rms_norm_mul" => g.rms_norm_mul(x[0], x[1], EPS),
        "rms_norm_mul_rope" => g.rms_norm_mul_rope(x[0], x[1], x[2], EPS, QWEN35_ROPE),
        "gated_rms_norm" => g.gated_rms_norm(x[0], x[1], x[2], EPS),
        "softmax_top_k" => g.softmax_top_k(x[0], k),
        "moe_weights" => g.moe_weights(x[0], x[1]),
        "moe_router" => {
            let r = g.moe_router(x[0], k)?;
            planes(g, r)
        }
        "mul_mat_swiglu" => g.mul_mat_swiglu(x[0], x[1], x[2]),
        "mul_mat_id_swiglu" => g.mul_mat_id_swiglu(x[0], x[1], x[2], x[3]),
        "mul_mat_id_weighted_sum" => g.mul_mat_id_weighted_sum(x[0], x[1], x[2], x[3]),
        _ => unreachable!("fused: unknown op {op}"),
    }
}

/// Perf cases at the 35B-A3B shapes for 1, 8, 32 and 512 tokens, each fused op next to the chain
/// it replaces (same label with `unfused`): the residual add + norm of n_embd 2048, the final
/// norm, the q norm and rotation (16 heads of 256, imrope; unfused: rms_norm_mul then
/// rope_multi), the DeltaNet gate norm (128 x 32 heads), the router (8 of 256: softmax_top_k,
/// moe_weights, and moe_router against the two); and the FFN's gate
/// and up projections with their GLU (q8_0 and nvfp4): the routed experts (2048 -> 512, 8 of 256)
/// at 1, 2, 4, 8 and 16 tokens, the shared expert (2048 -> 512, dense) at 1 and 8; the routed down
/// projection weighted and summed over the slots (512 -> 2048) at 1, 2, 4, 8 and 16.
pub(super) fn perf_cases() -> Vec<Case> {
    let mut out = gate_up_perf_cases();
    const E: usize = 2048;
    const K: usize = 8;
    for n in [1, 8, 32, 512] {
        let specs: [(&'static str, Vec<In>); 7] = [
            (
                "add_rms_norm_mul",
                vec![In::new("a", F32, [E, n, 1, 1]), In::new("b", F32, [E, n, 1, 1]), In::new("w", F32, [E, 1, 1, 1])],
            ),
            ("rms_norm_mul", vec![In::new("x", F32, [E, n, 1, 1]), In::new("w", F32, [E, 1, 1, 1])]),
            (
                "rms_norm_mul_rope",
                vec![
                    In::new("x", F32, [256, 16, n, 1]),
                    In::new("w", F32, [256, 1, 1, 1]),
                    In::new("pos", I32, [4 * n, 1, 1, 1]).init(Init::Ids { rows: 32_768, unique: false }),
                ],
            ),
            (
                "gated_rms_norm",
                vec![
                    In::new("x", F32, [128, 32, n, 1]),
                    In::new("w", F32, [128, 1, 1, 1]),
                    In::new("z", F32, [128, 32, n, 1]),
                ],
            ),
            ("softmax_top_k", vec![In::new("logits", F32, [256, n, 1, 1]).init(Init::Distinct)]),
            (
                "moe_weights",
                vec![
                    In::new("logits", F32, [256, n, 1, 1]),
                    In::new("ids", I32, [K, n, 1, 1]).init(Init::Ids { rows: 256, unique: true }),
                ],
            ),
            ("moe_router", vec![In::new("logits", F32, [256, n, 1, 1]).init(Init::Distinct)]),
        ];
        for (op, inputs) in specs {
            let shape = sh(inputs[0].ne);
            for is_fused in [true, false] {
                let kind = if is_fused { "fused" } else { "unfused" };
                let build = move |g: &mut Graph, x: &[Tensor]| {
                    if is_fused { fused(op, g, x, K) } else { unfused(op, g, x, K) }
                };
                out.push(Case::new(op, format_args!("{kind},ne={shape},n_tokens={n}"), inputs.clone(), build));
            }
        }
    }
    out
}

/// The gate-and-up perf cases of [`perf_cases`], fused and unfused: the 35B-A3B's experts (256
/// of 512 x 2048, top-8) at 1-16 tokens and its shared expert, and the qwen3moe 30B-A3B's (128 of
/// 768 x 2048, top-8) at one token.
fn gate_up_perf_cases() -> Vec<Case> {
    const E: usize = 2048;
    const FF: usize = 512;
    let mut out = Vec::new();
    for type_a in QUANTS {
        let routed_of = |experts: usize, ff: usize, n: usize| {
            vec![
                In::new("wg", type_a, [E, ff, experts, 1]),
                In::new("wu", type_a, [E, ff, experts, 1]),
                In::new("x", F32, [E, 1, n, 1]),
                In::new("ids", I32, [8, n, 1, 1]).init(Init::Ids { rows: experts, unique: true }),
            ]
        };
        let routed = |n: usize| routed_of(256, FF, n);
        let dense = |n: usize| {
            vec![
                In::new("wg", type_a, [E, FF, 1, 1]),
                In::new("wu", type_a, [E, FF, 1, 1]),
                In::new("x", F32, [E, n, 1, 1]),
            ]
        };
        let down = |n: usize| weighted_sum_inputs(&weighted_sum(type_a, 256, 8, 8, E, FF, n));
        // (op, label part, tokens, inputs, rows m, row length k)
        let specs = [1, 2, 4, 8, 16].map(|n| ("mul_mat_id_swiglu", "n_mats=256,n_used=8,", n, routed(n), FF, E));
        // the shared expert at decode widths and a prefill micro-batch
        let shared = [1, 8, 512].map(|n| ("mul_mat_swiglu", "", n, dense(n), FF, E));
        let combine = [1, 2, 4, 8, 16].map(|n| ("mul_mat_id_weighted_sum", "n_mats=256,n_used=8,", n, down(n), E, FF));
        // the qwen3moe 30B-A3B's routed experts at one token (decode of one sequence)
        const FF3: usize = 768;
        let qwen3 = [
            ("mul_mat_id_swiglu", "n_mats=128,n_used=8,", 1, routed_of(128, FF3, 1), FF3, E),
            (
                "mul_mat_id_weighted_sum",
                "n_mats=128,n_used=8,",
                1,
                weighted_sum_inputs(&weighted_sum(type_a, 128, 8, 8, E, FF3, 1)),
                E,
                FF3,
            ),
        ];
        for (op, what, n, inputs, m, k) in specs.into_iter().chain(shared).chain(combine).chain(qwen3) {
            for is_fused in [true, false] {
                let kind = if is_fused { "fused" } else { "unfused" };
                let build = move |g: &mut Graph, x: &[Tensor]| {
                    if is_fused { fused(op, g, x, 0) } else { unfused(op, g, x, 0) }
                };
                let label = format_args!("{kind},type_a={type_a},{what}m={m},n={n},k={k}");
                out.push(Case::new(op, label, inputs.clone(), build));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tie_rows_round_to_equal_probabilities_at_the_cut() {
        let v = tie_logits([256, 2, 1, 1], [0.0; 4], 7);
        for row in v.chunks(256) {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let tied = row.iter().filter(|&&x| x != max && x >= 0.0).count();
            assert_eq!(tied, 20);
            assert!(row.iter().filter(|&&x| x >= 0.0 && x != max).all(|&x| x - max == -1.0));
        }
    }
}
