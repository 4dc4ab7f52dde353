//! The fusion cases of each pass: its pattern at the models' shapes, odd shapes and shapes drawn
//! from a seeded generator, in each surrounding ([`Ctx`]: extra readers, an output in the middle,
//! in-place writes before and after); its variants (inputs read through views, chains, both
//! operand orders); and near-misses the pass must leave alone: an intermediate with a second
//! reader or marked as an output, a wrong op or parameter, a shape or layout the fused op
//! refuses, a view where the pattern needs a computed tensor, and an in-place write between the
//! pattern's nodes into a tensor the fused op would read late.
//!
//! Every pass of `passes::standard()` needs an entry in [`generators`]; the mode fails for a
//! pass without one.

use std::fmt;
use std::sync::Arc;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tessera_graph::{Graph, GraphError, Tensor};
use tessera_ops::{BinaryOp, DType, RopePairing, RopeParams, UnaryOp};

use super::{FusionCase, PassGenerator};
use crate::case::{Init, InputSpec as In, Layout, Shape};

type R = Result<Tensor, GraphError>;

const F32: DType = DType::F32;
const F16: DType = DType::F16;
const I32: DType = DType::I32;
const EPS: f32 = 1e-6;

/// Every pass's generator, by pass name.
pub(super) fn generators() -> Vec<PassGenerator> {
    vec![
        PassGenerator { pass: "add_rms_norm_mul", cases: add_rms_norm_mul },
        PassGenerator { pass: "gated_rms_norm", cases: gated_rms_norm },
        PassGenerator { pass: "rms_norm_mul", cases: rms_norm_mul },
        PassGenerator { pass: "rms_norm_mul_rope", cases: rms_norm_mul_rope },
        PassGenerator { pass: "attention_gate", cases: attention_gate },
        PassGenerator { pass: "softmax_top_k", cases: softmax_top_k },
        PassGenerator { pass: "moe_weights", cases: moe_weights },
        PassGenerator { pass: "moe_router", cases: moe_router },
        PassGenerator { pass: "fold_scales", cases: fold_scales },
        PassGenerator { pass: "elementwise_chains", cases: elementwise_chains },
        PassGenerator { pass: "gate_up_swiglu", cases: gate_up_swiglu },
        PassGenerator { pass: "moe_weighted_sum", cases: moe_weighted_sum },
        PassGenerator { pass: "delta_net_prep", cases: super::delta_net::cases },
    ]
}

/// What surrounds a pattern.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ctx {
    /// The pattern's result is the graph's output.
    Plain,
    /// Every float input is read by another op too (an output; block-quantized weights, which no
    /// elementwise op reads, excepted), and the result by two consumers.
    Readers,
    /// The result is an output and read by a consumer.
    MidOutput,
    /// The first input is a state leaf written in place just before the pattern (which reads it
    /// through the write's result) and again just after it.
    InPlace,
}

const CTXS: [Ctx; 4] = [Ctx::Plain, Ctx::Readers, Ctx::MidOutput, Ctx::InPlace];

impl fmt::Display for Ctx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Ctx::Plain => "plain",
            Ctx::Readers => "readers",
            Ctx::MidOutput => "mid_output",
            Ctx::InPlace => "in_place",
        })
    }
}

/// Builds a pattern from its inputs; returns its result.
type Core = Arc<dyn Fn(&mut Graph, &[Tensor]) -> R + Send + Sync>;
/// An op reading a pattern's result (the pattern's inputs at hand).
type Consume = fn(&mut Graph, Tensor, &[Tensor]) -> R;

fn core(f: impl Fn(&mut Graph, &[Tensor]) -> R + Send + Sync + 'static) -> Core {
    Arc::new(f)
}

/// A float result scaled: what reads a normalised activation.
fn halve(g: &mut Graph, r: Tensor, _: &[Tensor]) -> R {
    g.scale(r, 0.5)
}

/// The pattern `core` on `inputs` (the first contiguous) in the surroundings `ctx`.
fn embed(
    pass: &'static str,
    params: String,
    mut inputs: Vec<In>,
    expect: usize,
    ctx: Ctx,
    core: Core,
    consume: Consume,
) -> FusionCase {
    let n = inputs.len();
    if ctx == Ctx::InPlace {
        let first = inputs[0].clone();
        assert_eq!(first.layout, Layout::Contiguous, "{pass}: an in-place context writes a contiguous first input");
        let x = first.ne;
        let (side, ids) = ([x[0], 1, x[2], x[3]], [1, x[2], x[3], 1]);
        let init = Init::Ids { rows: x[1], unique: true };
        inputs[0] = first.state();
        inputs.push(In::new("side", inputs[0].dtype, side).init(inputs[0].init));
        inputs.push(In::new("side_ids", I32, ids).init(init));
        inputs.push(In::new("side2", inputs[0].dtype, side).init(inputs[0].init));
        inputs.push(In::new("side2_ids", I32, ids).init(init));
    }
    FusionCase::new(pass, format_args!("{params},ctx={ctx}"), inputs, expect, move |g, t| {
        let (x, extra) = t.split_at(n);
        match ctx {
            Ctx::Plain => core(g, x),
            Ctx::MidOutput => {
                let r = core(g, x)?;
                g.mark_output(r)?;
                consume(g, r, x)
            }
            Ctx::Readers => {
                for &i in x.iter().filter(|i| i.dtype().is_float() && !i.dtype().is_quantized()) {
                    let y = g.neg(i)?;
                    g.mark_output(y)?;
                }
                let r = core(g, x)?;
                let a = consume(g, r, x)?;
                g.mark_output(a)?;
                consume(g, r, x)
            }
            Ctx::InPlace => {
                let mut x = x.to_vec();
                x[0] = g.set_rows(t[0], extra[0], extra[1])?;
                let r = core(g, &x)?;
                g.set_rows(t[0], extra[2], extra[3])?;
                Ok(r)
            }
        }
    })
}

/// A case outside any context.
fn plain(
    pass: &'static str,
    params: impl fmt::Display,
    inputs: Vec<In>,
    expect: usize,
    build: impl Fn(&mut Graph, &[Tensor]) -> R + Send + Sync + 'static,
) -> FusionCase {
    FusionCase::new(pass, params, inputs, expect, build)
}

/// `n` shapes `[e, rows, 1, 1]` drawn from a generator seeded by the pass's name: rows of
/// `1..=max_e` elements, `1..=max_rows` of them.
fn drawn(pass: &str, n: usize, max_e: usize, max_rows: usize) -> Vec<[usize; 4]> {
    let seed = pass.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
    let mut rng = SmallRng::seed_from_u64(seed);
    (0..n).map(|_| [rng.random_range(1..=max_e), rng.random_range(1..=max_rows), 1, 1]).collect()
}

/// The weight of a norm over rows of `e`.
fn weight(e: usize) -> In {
    In::new("w", F32, [e, 1, 1, 1]).init(Init::POSITIVE)
}

/// Inputs for an in-place write into `x` of shape `ne` between a pattern's nodes: the rows and
/// their ids (one row per `[.., j, k]`).
fn write_into(ne: [usize; 4]) -> [In; 2] {
    [
        In::new("src", F32, [ne[0], 1, ne[2], ne[3]]),
        In::new("ids", I32, [1, ne[2], ne[3], 1]).init(Init::Ids { rows: ne[1], unique: true }),
    ]
}

// ---- add_rms_norm_mul: s = a + b; rms_norm(s) * w ----

const ARNM: &str = "add_rms_norm_mul";

fn arnm(g: &mut Graph, a: Tensor, b: Tensor, w: Tensor) -> R {
    let s = g.add(a, b)?;
    let h = g.rms_norm(s, EPS)?;
    g.mul(h, w)
}

fn arnm_inputs(ne: [usize; 4]) -> Vec<In> {
    vec![In::new("a", F32, ne), In::new("b", F32, ne), weight(ne[0])]
}

fn add_rms_norm_mul() -> Vec<FusionCase> {
    let mut out = Vec::new();
    // The tiny models' stream (64), the 35B-A3B's (2048), odd rows, one element, a row past a warp.
    let mut shapes = vec![[64, 1, 1, 1], [64, 5, 1, 1], [2048, 1, 1, 1], [2048, 7, 1, 1], [67, 3, 1, 1], [1, 1, 1, 1]];
    shapes.extend(drawn(ARNM, 2, 600, 9));
    for ne in shapes {
        for ctx in CTXS {
            let c = core(|g, x| arnm(g, x[0], x[1], x[2]));
            out.push(embed(ARNM, format!("ne={}", Shape(ne)), arnm_inputs(ne), 1, ctx, c, halve));
        }
    }
    let ne = [64, 3, 1, 1];
    // The residual stream: the sum is read again after the norm (its plane stands in for it).
    for ctx in CTXS {
        let c = core(|g, x| {
            let s = g.add(x[0], x[1])?;
            let h = g.rms_norm(s, EPS)?;
            let h = g.mul(h, x[2])?;
            let f = g.scale(h, 0.5)?;
            g.add(s, f)
        });
        out.push(embed(ARNM, format!("ne={},residual", Shape(ne)), arnm_inputs(ne), 1, ctx, c, halve));
    }
    // The sum an output of the graph.
    out.push(plain(ARNM, "ne=[64,3,1,1],sum_output", arnm_inputs(ne), 1, |g, x| {
        let s = g.add(x[0], x[1])?;
        g.mark_output(s)?;
        let h = g.rms_norm(s, EPS)?;
        g.mul(h, x[2])
    }));
    // Two blocks of the stream: two fusions, the second reading the first's sum plane.
    out.push(plain(ARNM, "ne=[64,3,1,1],two_blocks", arnm_inputs(ne), 2, |g, x| {
        let s1 = g.add(x[0], x[1])?;
        let h1 = g.rms_norm(s1, EPS)?;
        let h1 = g.mul(h1, x[2])?;
        let f = g.scale(h1, 0.25)?;
        let s2 = g.add(s1, f)?;
        let h2 = g.rms_norm(s2, EPS)?;
        let h2 = g.mul(h2, x[2])?;
        g.add(s2, h2)
    }));
    // Addends whose rows are apart, a weight per token, eps 0.
    let windowed = vec![In::new("a", F32, ne).layout(Layout::WINDOW), In::new("b", F32, ne), weight(64)];
    out.push(plain(ARNM, "ne=[64,3,1,1],a=window", windowed, 1, |g, x| arnm(g, x[0], x[1], x[2])));
    let per_token = vec![In::new("a", F32, ne), In::new("b", F32, ne), In::new("w", F32, ne).init(Init::POSITIVE)];
    out.push(plain(ARNM, "ne=[64,3,1,1],w=per_token", per_token, 1, |g, x| arnm(g, x[0], x[1], x[2])));
    out.push(plain(ARNM, "ne=[64,3,1,1],eps=0", arnm_inputs(ne), 1, |g, x| {
        let s = g.add(x[0], x[1])?;
        let h = g.rms_norm(s, 0.0)?;
        g.mul(h, x[2])
    }));

    // Near-misses.
    out.push(plain(ARNM, "miss=norm_two_readers", arnm_inputs(ne), 0, |g, x| {
        let s = g.add(x[0], x[1])?;
        let h = g.rms_norm(s, EPS)?;
        let other = g.neg(h)?;
        g.mark_output(other)?;
        g.mul(h, x[2])
    }));
    out.push(plain(ARNM, "miss=norm_output", arnm_inputs(ne), 0, |g, x| {
        let s = g.add(x[0], x[1])?;
        let h = g.rms_norm(s, EPS)?;
        g.mark_output(h)?;
        g.mul(h, x[2])
    }));
    out.push(plain(ARNM, "miss=sub", arnm_inputs(ne), 0, |g, x| {
        let s = g.sub(x[0], x[1])?;
        let h = g.rms_norm(s, EPS)?;
        g.mul(h, x[2])
    }));
    // A transposed addend (nb0 != 4): the add takes it, the fused op refuses it.
    let t = [8, 5, 1, 1];
    let transposed = vec![In::new("a", F32, t).layout(Layout::TRANSPOSED), In::new("b", F32, t), weight(8)];
    out.push(plain(ARNM, "miss=a_transposed", transposed, 0, |g, x| arnm(g, x[0], x[1], x[2])));
    // A 3-D sum (the fused op stacks its planes in dim 2), and an f16 weight.
    out.push(plain(ARNM, "miss=sum_3d", arnm_inputs([16, 3, 2, 1]), 0, |g, x| arnm(g, x[0], x[1], x[2])));
    let half_w = vec![In::new("a", F32, ne), In::new("b", F32, ne), In::new("w", F16, [64, 1, 1, 1])];
    out.push(plain(ARNM, "miss=w_f16", half_w, 0, |g, x| arnm(g, x[0], x[1], x[2])));
    out.push(plain(ARNM, "miss=view_of_sum", arnm_inputs(ne), 0, |g, x| {
        let s = g.add(x[0], x[1])?;
        let v = g.view(s, s.ne(), s.meta().nb, 0)?;
        let h = g.rms_norm(v, EPS)?;
        g.mul(h, x[2])
    }));
    // `a` rewritten between the add and the mul: the fused op would read the new rows.
    let mut written = arnm_inputs(ne);
    written[0] = written[0].clone().state();
    written.extend(write_into(ne));
    out.push(plain(ARNM, "miss=in_place_between", written, 0, |g, x| {
        let s = g.add(x[0], x[1])?;
        g.set_rows(x[0], x[3], x[4])?;
        let h = g.rms_norm(s, EPS)?;
        g.mul(h, x[2])
    }));
    out
}

// ---- gated_rms_norm: rms_norm(x) * w * silu(z) ----

const GATED: &str = "gated_rms_norm";

fn gated(g: &mut Graph, x: Tensor, w: Tensor, z: Tensor) -> R {
    let h = g.rms_norm(x, EPS)?;
    let h = g.mul(h, w)?;
    let z = g.silu(z)?;
    g.mul(h, z)
}

fn gated_inputs(ne: [usize; 4], w: [usize; 4]) -> Vec<In> {
    vec![
        In::new("x", F32, ne),
        In::new("w", F32, w).init(Init::POSITIVE),
        In::new("z", F32, ne).init(Init::Uniform { lo: -8.0, hi: 8.0 }),
    ]
}

fn gated_rms_norm() -> Vec<FusionCase> {
    let mut out = Vec::new();
    // The tiny models' DeltaNet output (S_v 16 over 4 heads), the 35B-A3B's (128 over 32), odd.
    let mut shapes = vec![
        ([16, 4, 1, 1], [16, 1, 1, 1]),
        ([16, 4, 5, 1], [16, 1, 1, 1]),
        ([128, 32, 1, 1], [128, 1, 1, 1]),
        ([128, 32, 3, 1], [128, 1, 1, 1]),
        ([7, 3, 1, 1], [7, 1, 1, 1]),
        ([33, 5, 2, 1], [33, 1, 2, 1]),
        ([1, 1, 1, 1], [1, 1, 1, 1]),
    ];
    shapes.extend(drawn(GATED, 2, 300, 9).into_iter().map(|ne| (ne, [ne[0], 1, 1, 1])));
    for (ne, w) in shapes {
        for ctx in CTXS {
            let c = core(|g, x| gated(g, x[0], x[1], x[2]));
            let params = format!("ne={},w={}", Shape(ne), Shape(w));
            out.push(embed(GATED, params, gated_inputs(ne, w), 1, ctx, c, halve));
        }
    }
    let (ne, w) = ([16, 4, 3, 1], [16, 1, 1, 1]);
    // The gate on the left, the gate computed before the norm, z a reshaped projection (the
    // model's), x with heads and tokens swapped.
    out.push(plain(GATED, "gate_first", gated_inputs(ne, w), 1, |g, x| {
        let h = g.rms_norm(x[0], EPS)?;
        let h = g.mul(h, x[1])?;
        let z = g.silu(x[2])?;
        g.mul(z, h)
    }));
    out.push(plain(GATED, "silu_before_norm", gated_inputs(ne, w), 1, |g, x| {
        let z = g.silu(x[2])?;
        let h = g.rms_norm(x[0], EPS)?;
        let h = g.mul(h, x[1])?;
        g.mul(h, z)
    }));
    let projected = vec![
        In::new("x", F32, ne),
        In::new("w", F32, w).init(Init::POSITIVE),
        In::new("zp", F32, [64, 3, 1, 1]).init(Init::Uniform { lo: -8.0, hi: 8.0 }),
    ];
    out.push(plain(GATED, "z=reshaped", projected, 1, |g, x| {
        let z = g.reshape(x[2], &[16, 4, 3])?;
        gated(g, x[0], x[1], z)
    }));
    let swapped = vec![
        In::new("x", F32, ne).layout(Layout::SWAP12),
        In::new("w", F32, w).init(Init::POSITIVE),
        In::new("z", F32, ne).layout(Layout::WINDOW),
    ];
    out.push(plain(GATED, "x=swap12,z=window", swapped, 1, |g, x| gated(g, x[0], x[1], x[2])));

    // Near-misses.
    out.push(plain(GATED, "miss=silu_two_readers", gated_inputs(ne, w), 0, |g, x| {
        let h = g.rms_norm(x[0], EPS)?;
        let h = g.mul(h, x[1])?;
        let z = g.silu(x[2])?;
        let other = g.scale(z, 2.0)?;
        g.mark_output(other)?;
        g.mul(h, z)
    }));
    out.push(plain(GATED, "miss=product_two_readers", gated_inputs(ne, w), 0, |g, x| {
        let h = g.rms_norm(x[0], EPS)?;
        let h = g.mul(h, x[1])?;
        g.mark_output(h)?;
        let z = g.silu(x[2])?;
        g.mul(h, z)
    }));
    out.push(plain(GATED, "miss=sigmoid_gate", gated_inputs(ne, w), 0, |g, x| {
        let h = g.rms_norm(x[0], EPS)?;
        let h = g.mul(h, x[1])?;
        let z = g.sigmoid(x[2])?;
        g.mul(h, z)
    }));
    out.push(plain(GATED, "miss=view_of_gate", gated_inputs(ne, w), 0, |g, x| {
        let h = g.rms_norm(x[0], EPS)?;
        let h = g.mul(h, x[1])?;
        let z = g.silu(x[2])?;
        let z = g.view(z, z.ne(), z.meta().nb, 0)?;
        g.mul(h, z)
    }));
    // A transposed gate (nb0 != 4): silu takes it, the fused op refuses it.
    let t = [7, 33, 1, 1];
    let transposed = vec![
        In::new("x", F32, t),
        In::new("w", F32, [7, 1, 1, 1]).init(Init::POSITIVE),
        In::new("z", F32, t).layout(Layout::TRANSPOSED),
    ];
    out.push(plain(GATED, "miss=z_transposed", transposed, 0, |g, x| gated(g, x[0], x[1], x[2])));
    // x rewritten between the norm and the product.
    let mut written = gated_inputs(ne, w);
    written[0] = written[0].clone().state();
    written.extend(write_into(ne));
    out.push(plain(GATED, "miss=in_place_between", written, 0, |g, x| {
        let h = g.rms_norm(x[0], EPS)?;
        let h = g.mul(h, x[1])?;
        g.set_rows(x[0], x[3], x[4])?;
        let z = g.silu(x[2])?;
        g.mul(h, z)
    }));
    out
}

// ---- rms_norm_mul: rms_norm(x) * w ----

const RNM: &str = "rms_norm_mul";

fn rnm(g: &mut Graph, x: Tensor, w: Tensor) -> R {
    let h = g.rms_norm(x, EPS)?;
    g.mul(h, w)
}

fn rnm_inputs(ne: [usize; 4], w: [usize; 4]) -> Vec<In> {
    vec![In::new("x", F32, ne), In::new("w", F32, w).init(Init::POSITIVE)]
}

fn rms_norm_mul() -> Vec<FusionCase> {
    let mut out = Vec::new();
    // The tiny models' first and output norms (64) and q/k norms (32-wide heads), the 35B-A3B's,
    // odd shapes, a weight varying along dim 1.
    let mut shapes = vec![
        ([64, 1, 1, 1], [64, 1, 1, 1]),
        ([64, 9, 1, 1], [64, 1, 1, 1]),
        ([32, 2, 5, 1], [32, 1, 1, 1]),
        ([256, 16, 3, 1], [256, 1, 1, 1]),
        ([2048, 7, 1, 1], [2048, 1, 1, 1]),
        ([7, 3, 1, 1], [7, 1, 1, 1]),
        ([33, 5, 2, 3], [33, 5, 1, 1]),
        ([1, 1, 1, 1], [1, 1, 1, 1]),
    ];
    shapes.extend(drawn(RNM, 2, 600, 9).into_iter().map(|ne| (ne, [ne[0], 1, 1, 1])));
    for (ne, w) in shapes {
        for ctx in CTXS {
            let c = core(|g, x| rnm(g, x[0], x[1]));
            let params = format!("ne={},w={}", Shape(ne), Shape(w));
            out.push(embed(RNM, params, rnm_inputs(ne, w), 1, ctx, c, halve));
        }
    }
    let (ne, w) = ([32, 4, 3, 1], [32, 1, 1, 1]);
    // x through views: heads and tokens swapped, rows apart, the q half of a joint q+gate
    // projection (the model's attention); a transposed weight; two norms in a row.
    for (name, layout) in [("swap12", Layout::SWAP12), ("window", Layout::WINDOW)] {
        let inputs = vec![In::new("x", F32, ne).layout(layout), In::new("w", F32, w).init(Init::POSITIVE)];
        out.push(plain(RNM, format_args!("x={name}"), inputs, 1, |g, x| rnm(g, x[0], x[1])));
    }
    let joint = vec![In::new("qg", F32, [2 * 32 * 2, 3, 1, 1]), In::new("w", F32, w).init(Init::POSITIVE)];
    out.push(plain(RNM, "x=q_view", joint, 1, |g, x| {
        let (hd, nh, n) = (32, 2, 3);
        let nb = [4, 2 * hd * 4, 2 * hd * nh * 4, 2 * hd * nh * n * 4];
        let q = g.view(x[0], [hd, nh, n, 1], nb, 0)?;
        rnm(g, q, x[1])
    }));
    let t = [7, 33, 1, 1];
    let w_t = vec![In::new("x", F32, t), In::new("w", F32, t).layout(Layout::TRANSPOSED).init(Init::POSITIVE)];
    out.push(plain(RNM, "w=transposed", w_t, 1, |g, x| rnm(g, x[0], x[1])));
    out.push(plain(RNM, "two_norms", rnm_inputs(ne, w), 2, |g, x| {
        let h = rnm(g, x[0], x[1])?;
        rnm(g, h, x[1])
    }));

    // Near-misses.
    out.push(plain(RNM, "miss=norm_two_readers", rnm_inputs(ne, w), 0, |g, x| {
        let h = g.rms_norm(x[0], EPS)?;
        let other = g.neg(h)?;
        g.mark_output(other)?;
        g.mul(h, x[1])
    }));
    out.push(plain(RNM, "miss=norm_output", rnm_inputs(ne, w), 0, |g, x| {
        let h = g.rms_norm(x[0], EPS)?;
        g.mark_output(h)?;
        g.mul(h, x[1])
    }));
    out.push(plain(RNM, "miss=add", rnm_inputs(ne, w), 0, |g, x| {
        let h = g.rms_norm(x[0], EPS)?;
        g.add(h, x[1])
    }));
    out.push(plain(RNM, "miss=l2_norm", rnm_inputs(ne, w), 0, |g, x| {
        let h = g.l2_norm(x[0], EPS)?;
        g.mul(h, x[1])
    }));
    // A transposed x (nb0 != 4) and an f16 weight: rms_norm and mul take them, the fused op not.
    let x_t = vec![In::new("x", F32, t).layout(Layout::TRANSPOSED), In::new("w", F32, [7, 1, 1, 1])];
    out.push(plain(RNM, "miss=x_transposed", x_t, 0, |g, x| rnm(g, x[0], x[1])));
    let half_w = vec![In::new("x", F32, ne), In::new("w", F16, w)];
    out.push(plain(RNM, "miss=w_f16", half_w, 0, |g, x| rnm(g, x[0], x[1])));
    out.push(plain(RNM, "miss=view_of_norm", rnm_inputs(ne, w), 0, |g, x| {
        let h = g.rms_norm(x[0], EPS)?;
        let v = g.view(h, h.ne(), h.meta().nb, 0)?;
        g.mul(v, x[1])
    }));
    let mut written = rnm_inputs(ne, w);
    written[0] = written[0].clone().state();
    written.extend(write_into(ne));
    out.push(plain(RNM, "miss=in_place_between", written, 0, |g, x| {
        let h = g.rms_norm(x[0], EPS)?;
        g.set_rows(x[0], x[2], x[3])?;
        g.mul(h, x[1])
    }));
    out
}

// ---- rms_norm_mul_rope: rope_multi(rms_norm_mul(x, w), positions) ----

const RNMR: &str = "rms_norm_mul_rope";

/// Qwen3.5's rope (NEOX, 64 of 256 dims, interleaved sections), and qwen3's (NEOX, whole head).
const ROPE_QWEN35: RopeParams =
    RopeParams { n_rot: 64, freq_base: 1e7, pairing: RopePairing::Neox, sections: Some([11, 11, 10, 0]) };
const ROPE_QWEN3: RopeParams = RopeParams { n_rot: 128, freq_base: 1e6, pairing: RopePairing::Neox, sections: None };

fn rnmr(g: &mut Graph, x: Tensor, w: Tensor, pos: Tensor, p: RopeParams) -> R {
    let h = g.rms_norm_mul(x, w, EPS)?;
    g.rope_multi(h, pos, p)
}

/// `x [hd, n_head, n]`, its weight `[hd]` and the positions `p` needs for `n` tokens.
fn rnmr_inputs(ne: [usize; 4], p: RopeParams) -> Vec<In> {
    let n_pos = ne[2] * if p.sections.is_some() { 4 } else { 1 };
    vec![
        In::new("x", F32, ne),
        In::new("w", F32, [ne[0], 1, 1, 1]).init(Init::POSITIVE),
        In::new("pos", I32, [n_pos, 1, 1, 1]).init(Init::Ids { rows: 32_768, unique: false }),
    ]
}

fn rope_label(p: RopeParams) -> String {
    format!("n_rot={},{:?},sections={:?}", p.n_rot, p.pairing, p.sections)
}

fn rms_norm_mul_rope() -> Vec<FusionCase> {
    let mut out = Vec::new();
    let small = |n_rot, pairing, sections| RopeParams { n_rot, freq_base: 1e4, pairing, sections };
    // The tiny models' heads (32), qwen35's q and k heads (256, imrope), qwen3's (128, plain),
    // odd heads (partial NEOX, adjacent pairs, the smallest), a head past one CUDA warp.
    let mut shapes = vec![
        ([32, 2, 5, 1], small(32, RopePairing::Neox, Some([4, 4, 4, 4]))),
        ([32, 1, 1, 1], small(16, RopePairing::Neox, None)),
        ([256, 16, 3, 1], ROPE_QWEN35),
        ([256, 2, 1, 1], ROPE_QWEN35),
        ([128, 8, 2, 1], ROPE_QWEN3),
        ([6, 3, 5, 1], small(4, RopePairing::Adjacent, None)),
        ([2, 1, 1, 1], small(2, RopePairing::Neox, None)),
        ([300, 2, 2, 1], small(64, RopePairing::Neox, None)),
    ];
    // Drawn heads: an even head dim, rotated in full, over drawn heads and 2 tokens.
    shapes.extend(drawn(RNMR, 2, 200, 9).into_iter().map(|[e, h, _, _]| {
        let hd = (e + e % 2).max(2);
        ([hd, h, 2, 1], small(hd, RopePairing::Neox, None))
    }));
    for (ne, p) in shapes {
        for ctx in CTXS {
            let c = core(move |g, x| rnmr(g, x[0], x[1], x[2], p));
            let params = format!("ne={},{}", Shape(ne), rope_label(p));
            out.push(embed(RNMR, params, rnmr_inputs(ne, p), 1, ctx, c, halve));
        }
    }
    let (ne, p) = ([32, 4, 3, 1], small(16, RopePairing::Neox, Some([2, 2, 2, 2])));
    // x through views: heads and tokens swapped, rows apart, the q half of a joint q+gate
    // projection (qwen35's attention); both q and k of one layer.
    for (name, layout) in [("swap12", Layout::SWAP12), ("window", Layout::WINDOW)] {
        let mut inputs = rnmr_inputs(ne, p);
        inputs[0] = inputs[0].clone().layout(layout);
        out.push(plain(RNMR, format_args!("x={name}"), inputs, 1, move |g, x| rnmr(g, x[0], x[1], x[2], p)));
    }
    let mut joint = rnmr_inputs(ne, p);
    joint[0] = In::new("qg", F32, [2 * 32 * 4, 3, 1, 1]);
    out.push(plain(RNMR, "x=q_view", joint, 1, move |g, x| {
        let (hd, nh, n) = (32, 4, 3);
        let nb = [4, 2 * hd * 4, 2 * hd * nh * 4, 2 * hd * nh * n * 4];
        let q = g.view(x[0], [hd, nh, n, 1], nb, 0)?;
        rnmr(g, q, x[1], x[2], p)
    }));
    let mut qk = rnmr_inputs(ne, p);
    qk.push(In::new("k", F32, [32, 2, 3, 1]));
    qk.push(In::new("kw", F32, [32, 1, 1, 1]).init(Init::POSITIVE));
    out.push(plain(RNMR, "q_and_k", qk, 2, move |g, x| {
        let q = rnmr(g, x[0], x[1], x[2], p)?;
        let k = rnmr(g, x[3], x[4], x[2], p)?;
        let k = g.scale(k, 0.5)?;
        g.mark_output(k)?;
        Ok(q)
    }));

    // Near-misses.
    out.push(plain(RNMR, "miss=norm_two_readers", rnmr_inputs(ne, p), 0, move |g, x| {
        let h = g.rms_norm_mul(x[0], x[1], EPS)?;
        let other = g.neg(h)?;
        g.mark_output(other)?;
        g.rope_multi(h, x[2], p)
    }));
    out.push(plain(RNMR, "miss=norm_output", rnmr_inputs(ne, p), 0, move |g, x| {
        let h = g.rms_norm_mul(x[0], x[1], EPS)?;
        g.mark_output(h)?;
        g.rope_multi(h, x[2], p)
    }));
    // The chain before rms_norm_mul ran (this pass alone does not take rms_norm and mul).
    out.push(plain(RNMR, "miss=unfused_norm", rnmr_inputs(ne, p), 0, move |g, x| {
        let h = g.rms_norm(x[0], EPS)?;
        let h = g.mul(h, x[1])?;
        g.rope_multi(h, x[2], p)
    }));
    let mut no_weight = rnmr_inputs(ne, p);
    no_weight.remove(1);
    out.push(plain(RNMR, "miss=plain_norm", no_weight, 0, move |g, x| {
        let h = g.rms_norm(x[0], EPS)?;
        g.rope_multi(h, x[1], p)
    }));
    out.push(plain(RNMR, "miss=gated_norm", rnmr_inputs(ne, p), 0, move |g, x| {
        let h = g.gated_rms_norm(x[0], x[1], x[0], EPS)?;
        g.rope_multi(h, x[2], p)
    }));
    out.push(plain(RNMR, "miss=view_of_norm", rnmr_inputs(ne, p), 0, move |g, x| {
        let h = g.rms_norm_mul(x[0], x[1], EPS)?;
        let v = g.view(h, h.ne(), h.meta().nb, 0)?;
        g.rope_multi(v, x[2], p)
    }));
    out.push(plain(RNMR, "miss=scale_between", rnmr_inputs(ne, p), 0, move |g, x| {
        let h = g.rms_norm_mul(x[0], x[1], EPS)?;
        let h = g.scale(h, 2.0)?;
        g.rope_multi(h, x[2], p)
    }));
    let mut written = rnmr_inputs(ne, p);
    written[0] = written[0].clone().state();
    written.extend(write_into(ne));
    out.push(plain(RNMR, "miss=in_place_between", written, 0, move |g, x| {
        let h = g.rms_norm_mul(x[0], x[1], EPS)?;
        g.set_rows(x[0], x[3], x[4])?;
        g.rope_multi(h, x[2], p)
    }));
    out
}

// ---- attention_gate: mul(flash_attn_ext(..), sigmoid(gate)) ----

const AG: &str = "attention_gate";

/// Attention inputs: q `[d, n_t, n_h, n_s]`, f16 K/V `[d, n_kv, n_kv_h, n_s]`, a gate of the
/// output's shape `[d, n_h, n_t, n_s]`.
fn attention_inputs(d: usize, n_t: usize, n_h: usize, n_kv_h: usize, n_kv: usize, n_s: usize) -> Vec<In> {
    vec![
        In::new("q", F32, [d, n_t, n_h, n_s]),
        In::new("k", F16, [d, n_kv, n_kv_h, n_s]),
        In::new("v", F16, [d, n_kv, n_kv_h, n_s]),
        In::new("gate", F32, [d, n_h, n_t, n_s]),
    ]
}

fn attend(g: &mut Graph, x: &[Tensor]) -> R {
    let scale = 1.0 / (x[0].ne()[0] as f32).sqrt();
    g.flash_attn_ext(x[0], x[1], x[2], None, None, scale, 0.0)
}

fn attention_gate() -> Vec<FusionCase> {
    let mut out = Vec::new();
    // Decode and a short prefill at the 35B-A3B's heads (16 over 2, d 256), odd sizes (the
    // SIMT kernel), several sequences; the attention first or second in the product.
    let shapes = [(256, 1, 16, 2, 70, 1), (256, 9, 16, 2, 40, 1), (40, 3, 6, 3, 33, 2), (16, 1, 4, 2, 300, 3)];
    for (d, n_t, n_h, n_kv_h, n_kv, n_s) in shapes {
        let params = format!("d={d},n_t={n_t},n_h={n_h},n_kv_h={n_kv_h},n_kv={n_kv},n_s={n_s}");
        for ctx in CTXS {
            let c = core(|g, x| {
                let a = attend(g, x)?;
                let s = g.sigmoid(x[3])?;
                g.mul(a, s)
            });
            out.push(embed(AG, params.clone(), attention_inputs(d, n_t, n_h, n_kv_h, n_kv, n_s), 1, ctx, c, halve));
        }
        out.push(plain(
            AG,
            format_args!("{params},gate_first"),
            attention_inputs(d, n_t, n_h, n_kv_h, n_kv, n_s),
            1,
            |g, x| {
                let s = g.sigmoid(x[3])?;
                let a = attend(g, x)?;
                g.mul(s, a)
            },
        ));
    }
    // The gate read in place from a wider projection (qwen35's q+gate rows).
    let mut strided = attention_inputs(256, 2, 16, 2, 50, 1);
    strided[3] = strided[3].clone().layout(Layout::WINDOW);
    out.push(plain(AG, "gate=window", strided, 1, |g, x| {
        let a = attend(g, x)?;
        let s = g.sigmoid(x[3])?;
        g.mul(a, s)
    }));

    // Near-misses: the attention or the sigmoid read again, a broadcast gate, another
    // activation, another product.
    let small = || attention_inputs(16, 2, 4, 2, 20, 1);
    out.push(plain(AG, "miss=attention_read_again", small(), 0, |g, x| {
        let a = attend(g, x)?;
        g.mark_output(a)?;
        let s = g.sigmoid(x[3])?;
        g.mul(a, s)
    }));
    out.push(plain(AG, "miss=sigmoid_read_again", small(), 0, |g, x| {
        let a = attend(g, x)?;
        let s = g.sigmoid(x[3])?;
        g.mark_output(s)?;
        g.mul(a, s)
    }));
    let mut broadcast = small();
    broadcast[3] = In::new("gate", F32, [16, 1, 2, 1]);
    out.push(plain(AG, "miss=broadcast_gate", broadcast, 0, |g, x| {
        let a = attend(g, x)?;
        let s = g.sigmoid(x[3])?;
        g.mul(a, s)
    }));
    out.push(plain(AG, "miss=silu", small(), 0, |g, x| {
        let a = attend(g, x)?;
        let s = g.silu(x[3])?;
        g.mul(a, s)
    }));
    out.push(plain(AG, "miss=add", small(), 0, |g, x| {
        let a = attend(g, x)?;
        let s = g.sigmoid(x[3])?;
        g.add(a, s)
    }));
    out
}

// ---- softmax_top_k: top_k(softmax(logits), k) ----

const STK: &str = "softmax_top_k";

fn stk(g: &mut Graph, logits: Tensor, k: usize) -> R {
    let p = g.softmax(logits, 1.0, None)?;
    g.top_k(p, k)
}

/// Router logits, distinct per row (no two probabilities near-equal, so the ids do not depend on
/// rounding).
fn logits(ne: [usize; 4]) -> In {
    In::new("logits", F32, ne).init(Init::Distinct)
}

/// What reads the selected ids: the routing weights gathered by them from another softmax.
fn gather(g: &mut Graph, ids: Tensor, x: &[Tensor]) -> R {
    let [e, n, ..] = x[0].ne();
    let p = g.softmax(x[0], 1.0, None)?;
    let p3 = g.reshape(p, &[1, e, n])?;
    g.get_rows(p3, ids)
}

/// Router shapes `(logits ne, k)`: the tiny-moe router (2 of 8), the 35B-A3B's (8 of 256), odd
/// counts, then `more` and two drawn from `pass`'s generator.
fn router_shapes(pass: &str, more: &[([usize; 4], usize)]) -> Vec<([usize; 4], usize)> {
    let mut shapes = vec![([8, 1, 1, 1], 2), ([8, 6, 1, 1], 2), ([256, 1, 1, 1], 8), ([256, 7, 1, 1], 8)];
    shapes.extend_from_slice(&[([7, 3, 1, 1], 7), ([1, 1, 1, 1], 1)]);
    shapes.extend_from_slice(more);
    shapes.extend(drawn(pass, 2, 300, 9).into_iter().map(|ne| (ne, ne[0].min(8))));
    shapes
}

/// `router(g, logits, k)` of `pass` at each shape in every surrounding, its result read by
/// `consume`.
fn router_cases(
    pass: &'static str,
    shapes: Vec<([usize; 4], usize)>,
    router: fn(&mut Graph, Tensor, usize) -> R,
    consume: Consume,
) -> Vec<FusionCase> {
    let mut out = Vec::new();
    for (ne, k) in shapes {
        for ctx in CTXS {
            let c = core(move |g, x| router(g, x[0], k));
            out.push(embed(pass, format!("ne={},k={k}", Shape(ne)), vec![logits(ne)], 1, ctx, c, consume));
        }
    }
    out
}

fn softmax_top_k() -> Vec<FusionCase> {
    // Also the longest CUDA row and a 32-token step.
    let shapes = router_shapes(STK, &[([256, 32, 1, 1], 8), ([33, 5, 1, 1], 5), ([1024, 3, 1, 1], 8)]);
    let mut out = router_cases(STK, shapes, stk, gather);
    let (ne, k) = ([64, 3, 1, 1], 4);
    // The probabilities read by the weights too (they stay), strided logits.
    out.push(plain(STK, "probs_read_again", vec![logits(ne)], 1, move |g, x| {
        let p = g.softmax(x[0], 1.0, None)?;
        let ids = g.top_k(p, k)?;
        let p3 = g.reshape(p, &[1, 64, 3])?;
        g.mark_output(ids)?;
        g.get_rows(p3, ids)
    }));
    for (name, layout) in [("window", Layout::WINDOW), ("transposed", Layout::TRANSPOSED)] {
        let inputs = vec![logits(ne).layout(layout)];
        out.push(plain(STK, format_args!("logits={name}"), inputs, 1, move |g, x| stk(g, x[0], k)));
    }

    // The ids with a shared expert's appended (the concat goes into the fused op), from a view of
    // stacked router logits.
    out.extend(shared_slot_cases(STK));
    // The top k read besides the concat: the concat stays.
    out.push(plain(STK, "top_also_read", shared_router_inputs(8, 3), 1, move |g, x| {
        let p = g.softmax(x[0], 1.0, None)?;
        let top = g.top_k(p, 2)?;
        let ids = g.concat(top, x[1], 0)?;
        g.mark_output(top)?;
        Ok(ids)
    }));

    // Near-misses.
    out.push(plain(STK, "miss=scaled_softmax", vec![logits(ne)], 0, move |g, x| {
        let p = g.softmax(x[0], 0.5, None)?;
        g.top_k(p, k)
    }));
    let masked = vec![logits(ne), In::new("mask", F32, ne).init(Init::Mask)];
    out.push(plain(STK, "miss=masked_softmax", masked, 0, move |g, x| {
        let p = g.softmax(x[0], 1.0, Some(x[1]))?;
        g.top_k(p, k)
    }));
    out.push(plain(STK, "miss=sigmoid", vec![logits(ne)], 0, move |g, x| {
        let p = g.sigmoid(x[0])?;
        g.top_k(p, k)
    }));
    out.push(plain(STK, "miss=logits_3d", vec![logits([16, 3, 2, 1])], 0, move |g, x| stk(g, x[0], k)));
    out.push(plain(STK, "miss=view_of_probs", vec![logits(ne)], 0, move |g, x| {
        let p = g.softmax(x[0], 1.0, None)?;
        let v = g.view(p, p.ne(), p.meta().nb, 0)?;
        g.top_k(v, k)
    }));
    // The logits rewritten between the softmax and top_k: the fused op, placed at top_k, would
    // read the new rows.
    let written = vec![logits(ne).state(), write_into(ne)[0].clone(), write_into(ne)[1].clone()];
    out.push(plain(STK, "miss=in_place_between", written, 0, move |g, x| {
        let p = g.softmax(x[0], 1.0, None)?;
        g.set_rows(x[0], x[1], x[2])?;
        g.top_k(p, k)
    }));
    out
}

// ---- moe_router: softmax_top_k and moe_weights of the same logits ----

const MR: &str = "moe_router";

/// The router as the two passes before this one leave it: the ids (an output), the weights.
fn fused_router(g: &mut Graph, logits: Tensor, k: usize) -> R {
    let ids = g.softmax_top_k(logits, k)?;
    g.mark_output(ids)?;
    g.moe_weights(logits, ids)
}

/// [`shared_router`] as the two passes before this one leave it: the ids with the shared id
/// appended (an output), the weights of their first `k` with the gate's sigmoid appended.
fn fused_shared_router(g: &mut Graph, x: &[Tensor], k: usize) -> R {
    let [e1, n, ..] = x[0].ne();
    let row = 4 * e1;
    let logits = g.view(x[0], [e1 - 1, n, 1, 1], [4, row, row * n, row * n], 0)?;
    let gate = g.view(x[0], [1, n, 1, 1], [4, row, row * n, row * n], 4 * (e1 - 1))?;
    let ids = g.softmax_top_k_then(logits, k, x[1])?;
    g.mark_output(ids)?;
    let slot = 4 * (k + 1);
    let routed = g.view(ids, [k, n, 1, 1], [4, slot, slot * n, slot * n], 0)?;
    g.moe_weights_gated(logits, routed, gate)
}

fn moe_router() -> Vec<FusionCase> {
    // Also k past one warp's lanes.
    let mut out = router_cases(MR, router_shapes(MR, &[([250, 3, 1, 1], 40)]), fused_router, halve);
    for (e, n, k) in SHARED_ROUTERS {
        let params = format_args!("shared_slot,e={e},n={n},k={k}");
        out.push(plain(MR, params, shared_router_inputs(e, n), 1, move |g, x| fused_shared_router(g, x, k)));
    }
    // The ids read by the experts' product, the weights scaling it (the ids and the weights then
    // reach their readers as views of the two planes).
    let (ne, k) = ([8, 6, 1, 1], 2);
    let experts = vec![logits(ne), In::new("as", F32, [16, 4, 8, 1]), In::new("b", F32, [16, 1, 6, 1])];
    out.push(plain(MR, "weighted_experts", experts, 1, move |g, x| {
        let ids = g.softmax_top_k(x[0], k)?;
        let w = g.moe_weights(x[0], ids)?;
        let y = g.mul_mat_id(x[1], x[2], ids)?;
        g.mul(y, w)
    }));

    // Near-misses.
    let two = vec![logits(ne), logits(ne)];
    out.push(plain(MR, "miss=other_logits", two, 0, move |g, x| {
        let ids = g.softmax_top_k(x[0], k)?;
        g.mark_output(ids)?;
        g.moe_weights(x[1], ids)
    }));
    out.push(plain(MR, "miss=ids_input", vec![logits(ne), ids_input(8, k, 6, true)], 0, |g, x| {
        g.moe_weights(x[0], x[1])
    }));
    // A tail without a gate, and the weights of the wrong window of the ids (slots 1 ..= k).
    let (e, n) = (8, 3);
    out.push(plain(MR, "miss=tail_without_gate", shared_router_inputs(e, n), 0, move |g, x| {
        let logits = g.view(x[0], [e, n, 1, 1], [4, 36, 108, 108], 0)?;
        let ids = g.softmax_top_k_then(logits, k, x[1])?;
        g.mark_output(ids)?;
        let routed = g.view(ids, [k, n, 1, 1], [4, 12, 36, 36], 0)?;
        g.moe_weights(logits, routed)
    }));
    out.push(plain(MR, "miss=shifted_window", shared_router_inputs(e, n), 0, move |g, x| {
        let logits = g.view(x[0], [e, n, 1, 1], [4, 36, 108, 108], 0)?;
        let gate = g.view(x[0], [1, n, 1, 1], [4, 36, 108, 108], 4 * e)?;
        let ids = g.softmax_top_k_then(logits, k, x[1])?;
        g.mark_output(ids)?;
        let routed = g.view(ids, [k, n, 1, 1], [4, 12, 36, 36], 4)?;
        g.moe_weights_gated(logits, routed, gate)
    }));
    // The ids read before the weights exist (the fused op, placed at the weights, comes too late
    // for that reader), and the logits rewritten between the two.
    out.push(plain(MR, "miss=ids_read_first", vec![logits(ne)], 0, move |g, x| {
        let ids = g.softmax_top_k(x[0], k)?;
        let early = g.cont(ids)?;
        g.mark_output(early)?;
        g.moe_weights(x[0], ids)
    }));
    let written = vec![logits(ne).state(), write_into(ne)[0].clone(), write_into(ne)[1].clone()];
    out.push(plain(MR, "miss=in_place_between", written, 0, move |g, x| {
        let ids = g.softmax_top_k(x[0], k)?;
        g.mark_output(ids)?;
        g.set_rows(x[0], x[1], x[2])?;
        g.moe_weights(x[0], ids)
    }));
    out
}

// ---- moe_weights: get_rows(softmax(logits), ids) renormalised over the k slots ----

const MOE: &str = "moe_weights";

/// The model's chain from the probabilities to the renormalised `[1, k, n]` weights.
fn weights_of(g: &mut Graph, p: Tensor, ids: Tensor) -> R {
    let [e, n, ..] = p.ne();
    let k = ids.ne()[0];
    let p3 = g.reshape(p, &[1, e, n])?;
    let w = g.get_rows(p3, ids)?;
    let w = g.reshape(w, &[k, n])?;
    let sum = g.sum_rows(w)?;
    let w = g.div(w, sum)?;
    g.reshape(w, &[1, k, n])
}

/// The router as the model builds it: ids from top_k of the probabilities (an output), weights.
fn router(g: &mut Graph, logits: Tensor, k: usize) -> R {
    let p = g.softmax(logits, 1.0, None)?;
    let ids = g.top_k(p, k)?;
    g.mark_output(ids)?;
    weights_of(g, p, ids)
}

/// Ids given as an input: the probabilities are read only by the chain and go with it.
fn given_ids(g: &mut Graph, logits: Tensor, ids: Tensor) -> R {
    let p = g.softmax(logits, 1.0, None)?;
    weights_of(g, p, ids)
}

/// The router with a shared expert routed as slot `k` (qwen35's `moe_shared_routed`): logits
/// `[e + 1, n]` whose last row is the shared gate's, `tail` i32 `[1, n]` the shared expert's id;
/// the ids `[k + 1, n]` (an output) and the weights `[1, k + 1, n]`, the gate's sigmoid last.
fn shared_router(g: &mut Graph, x: &[Tensor], k: usize) -> R {
    let [e1, n, ..] = x[0].ne();
    let e = e1 - 1;
    let row = 4 * e1;
    let logits = g.view(x[0], [e, n, 1, 1], [4, row, row * n, row * n], 0)?;
    let gate = g.view(x[0], [1, n, 1, 1], [4, row, row * n, row * n], 4 * e)?;
    let p = g.softmax(logits, 1.0, None)?;
    let top = g.top_k(p, k)?;
    let ids = g.concat(top, x[1], 0)?;
    g.mark_output(ids)?;
    let slot = 4 * (k + 1);
    let routed = g.view(ids, [k, n, 1, 1], [4, slot, slot * n, slot * n], 0)?;
    let w = weights_of(g, p, routed)?;
    let gate = g.sigmoid(gate)?;
    let gate = g.reshape(gate, &[1, 1, n])?;
    g.concat(w, gate, 1)
}

/// Inputs of [`shared_router`]: `e` routed experts' logits and the gate's, the shared id `e`.
fn shared_router_inputs(e: usize, n: usize) -> Vec<In> {
    vec![logits([e + 1, n, 1, 1]), In::new("tail", I32, [1, n, 1, 1]).init(Init::Ids { rows: e + 1, unique: false })]
}

/// The shapes [`shared_router`] is checked at: tiny-moe's, the 35B-A3B's, odd ones.
const SHARED_ROUTERS: [(usize, usize, usize); 5] = [(8, 1, 2), (8, 6, 2), (256, 1, 8), (256, 7, 8), (33, 5, 5)];

/// [`shared_router`] at [`SHARED_ROUTERS`], each one fusion of `pass`.
fn shared_slot_cases(pass: &'static str) -> Vec<FusionCase> {
    SHARED_ROUTERS
        .into_iter()
        .map(|(e, n, k)| {
            let params = format_args!("shared_slot,e={e},n={n},k={k}");
            plain(pass, params, shared_router_inputs(e, n), 1, move |g, x| shared_router(g, x, k))
        })
        .collect()
}

fn ids_input(e: usize, k: usize, n: usize, unique: bool) -> In {
    In::new("ids", I32, [k, n, 1, 1]).init(Init::Ids { rows: e, unique })
}

fn moe_weights() -> Vec<FusionCase> {
    let shapes = router_shapes(MOE, &[([33, 5, 1, 1], 12)]);
    let mut out = router_cases(MOE, shapes.clone(), router, halve);
    for (ne, k) in shapes {
        // Ids as an input (repeats allowed where k > 4), the probabilities swallowed.
        let inputs = vec![logits(ne), ids_input(ne[0], k, ne[1], k <= 4)];
        out.push(plain(MOE, format_args!("ne={},k={k},ids=input", Shape(ne)), inputs, 1, |g, x| {
            given_ids(g, x[0], x[1])
        }));
    }
    let (ne, k) = ([8, 6, 1, 1], 2);
    // The experts' outputs weighted as the model does.
    let experts = vec![logits(ne), In::new("ex", F32, [16, k, 6, 1])];
    out.push(plain(MOE, "weighted_experts", experts, 1, move |g, x| {
        let w = router(g, x[0], k)?;
        g.mul(x[1], w)
    }));

    // A shared expert's gate appended (the sigmoid, reshape and concat go into the fused op).
    out.extend(shared_slot_cases(MOE));
    // The gate's sigmoid read again: it stays, and so does the concat (the weights still fuse).
    out.push(plain(MOE, "gate_sigmoid_read_again", vec![logits([9, 3, 1, 1])], 1, move |g, x| {
        let routed = g.view(x[0], [8, 3, 1, 1], [4, 36, 108, 108], 0)?;
        let w = router(g, routed, 2)?;
        let gate = g.view(x[0], [1, 3, 1, 1], [4, 36, 108, 108], 32)?;
        let gate = g.sigmoid(gate)?;
        g.mark_output(gate)?;
        let gate = g.reshape(gate, &[1, 1, 3])?;
        g.concat(w, gate, 1)
    }));

    // Near-misses.
    let ids = || vec![logits(ne), ids_input(8, k, 6, true)];
    out.push(plain(MOE, "miss=scaled_softmax", ids(), 0, |g, x| {
        let p = g.softmax(x[0], 0.5, None)?;
        weights_of(g, p, x[1])
    }));
    out.push(plain(MOE, "miss=gathered_output", ids(), 0, |g, x| {
        let p = g.softmax(x[0], 1.0, None)?;
        let p3 = g.reshape(p, &[1, 8, 6])?;
        let w = g.get_rows(p3, x[1])?;
        let w = g.reshape(w, &[2, 6])?;
        g.mark_output(w)?;
        let sum = g.sum_rows(w)?;
        let w = g.div(w, sum)?;
        g.reshape(w, &[1, 2, 6])
    }));
    out.push(plain(MOE, "miss=sum_two_readers", ids(), 0, |g, x| {
        let p = g.softmax(x[0], 1.0, None)?;
        let p3 = g.reshape(p, &[1, 8, 6])?;
        let w = g.get_rows(p3, x[1])?;
        let w = g.reshape(w, &[2, 6])?;
        let sum = g.sum_rows(w)?;
        g.mark_output(sum)?;
        let w = g.div(w, sum)?;
        g.reshape(w, &[1, 2, 6])
    }));
    out.push(plain(MOE, "miss=not_renormalised", ids(), 0, |g, x| {
        let p = g.softmax(x[0], 1.0, None)?;
        let p3 = g.reshape(p, &[1, 8, 6])?;
        g.get_rows(p3, x[1])
    }));
    out.push(plain(MOE, "miss=sub", ids(), 0, |g, x| {
        let p = g.softmax(x[0], 1.0, None)?;
        let p3 = g.reshape(p, &[1, 8, 6])?;
        let w = g.get_rows(p3, x[1])?;
        let w = g.reshape(w, &[2, 6])?;
        let sum = g.sum_rows(w)?;
        let w = g.sub(w, sum)?;
        g.reshape(w, &[1, 2, 6])
    }));
    out.push(plain(MOE, "miss=other_final_shape", ids(), 0, |g, x| {
        let p = g.softmax(x[0], 1.0, None)?;
        let p3 = g.reshape(p, &[1, 8, 6])?;
        let w = g.get_rows(p3, x[1])?;
        let w = g.reshape(w, &[2, 6])?;
        let sum = g.sum_rows(w)?;
        let w = g.div(w, sum)?;
        g.reshape(w, &[2, 1, 6])
    }));
    out.push(plain(MOE, "miss=view_of_probs", ids(), 0, |g, x| {
        let p = g.softmax(x[0], 1.0, None)?;
        let p3 = g.view(p, [1, 8, 6, 1], [4, 4, 32, 192], 0)?;
        let w = g.get_rows(p3, x[1])?;
        let w = g.reshape(w, &[2, 6])?;
        let sum = g.sum_rows(w)?;
        let w = g.div(w, sum)?;
        g.reshape(w, &[1, 2, 6])
    }));
    // The logits rewritten between the softmax and the gather, with the ids given (the softmax is
    // then one of the replaced nodes) and from top_k (the softmax stays: the fused op, placed at
    // the chain's end, would read the new rows).
    let mut written = ids();
    written[0] = written[0].clone().state();
    written.extend(write_into(ne));
    out.push(plain(MOE, "miss=in_place_between,ids=input", written, 0, |g, x| {
        let p = g.softmax(x[0], 1.0, None)?;
        g.set_rows(x[0], x[2], x[3])?;
        weights_of(g, p, x[1])
    }));
    let written = vec![logits(ne).state(), write_into(ne)[0].clone(), write_into(ne)[1].clone()];
    out.push(plain(MOE, "miss=in_place_between,ids=top_k", written, 0, move |g, x| {
        let p = g.softmax(x[0], 1.0, None)?;
        let ids = g.top_k(p, k)?;
        g.mark_output(ids)?;
        g.set_rows(x[0], x[1], x[2])?;
        weights_of(g, p, ids)
    }));
    out
}

// ---- fold_scales: scale(scale(x)) ----

const FOLD: &str = "fold_scales";

fn two_scales(g: &mut Graph, x: Tensor) -> R {
    let a = g.scale_bias(x, 2.0, 0.5)?;
    g.scale_bias(a, -1.5, 0.25)
}

fn fold_scales() -> Vec<FusionCase> {
    let mut out = Vec::new();
    let mut shapes = vec![[64, 1, 1, 1], [2048, 7, 1, 1], [67, 3, 1, 1], [1, 1, 1, 1], [33, 5, 2, 3]];
    shapes.extend(drawn(FOLD, 2, 600, 9));
    for ne in shapes {
        for ctx in CTXS {
            let c = core(|g, x| two_scales(g, x[0]));
            out.push(embed(FOLD, format!("ne={}", Shape(ne)), vec![In::new("x", F32, ne)], 1, ctx, c, halve));
        }
    }
    let ne = [33, 4, 1, 1];
    let x = || vec![In::new("x", F32, ne)];
    // Chains of three (the second fold overlaps the first: one) and four scales (two), a
    // transposed input, scales without bias.
    out.push(plain(FOLD, "chain=3", x(), 1, |g, x| {
        let a = two_scales(g, x[0])?;
        g.scale(a, 3.0)
    }));
    out.push(plain(FOLD, "chain=4", x(), 2, |g, x| {
        let a = two_scales(g, x[0])?;
        two_scales(g, a)
    }));
    out.push(plain(FOLD, "x=transposed", vec![In::new("x", F32, ne).layout(Layout::TRANSPOSED)], 1, |g, x| {
        two_scales(g, x[0])
    }));
    out.push(plain(FOLD, "no_bias", x(), 1, |g, x| {
        let a = g.scale(x[0], 0.125)?;
        g.scale(a, 8.0)
    }));

    // Near-misses.
    out.push(plain(FOLD, "miss=first_two_readers", x(), 0, |g, x| {
        let a = g.scale_bias(x[0], 2.0, 0.5)?;
        let other = g.neg(a)?;
        g.mark_output(other)?;
        g.scale(a, 3.0)
    }));
    out.push(plain(FOLD, "miss=first_output", x(), 0, |g, x| {
        let a = g.scale_bias(x[0], 2.0, 0.5)?;
        g.mark_output(a)?;
        g.scale(a, 3.0)
    }));
    out.push(plain(FOLD, "miss=neg_between", x(), 0, |g, x| {
        let a = g.scale_bias(x[0], 2.0, 0.5)?;
        let a = g.neg(a)?;
        g.scale(a, 3.0)
    }));
    out.push(plain(FOLD, "miss=view_between", x(), 0, |g, x| {
        let a = g.scale_bias(x[0], 2.0, 0.5)?;
        let v = g.reshape(a, &[33 * 4])?;
        g.scale(v, 3.0)
    }));
    let mut written = x();
    written[0] = written[0].clone().state();
    written.extend(write_into(ne));
    out.push(plain(FOLD, "miss=in_place_between", written, 0, |g, x| {
        let a = g.scale_bias(x[0], 2.0, 0.5)?;
        g.set_rows(x[0], x[1], x[2])?;
        g.scale(a, 3.0)
    }));
    out
}

// ---- elementwise_chains: a tree of f32 unary / binary / scale ops ----

const ELEM: &str = "elementwise_chains";

/// One step of a drawn elementwise chain, applied to the chain's value so far.
#[derive(Debug, Clone, Copy)]
enum Step {
    Unary(UnaryOp),
    Scale(f32, f32),
    /// `value op input[i]`.
    Binary(BinaryOp, usize),
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Step::Unary(u) => f.write_str(u.name()),
            Step::Scale(s, b) => write!(f, "scale({s},{b})"),
            Step::Binary(op, i) => write!(f, "{}(x{i})", op.name()),
        }
    }
}

/// A chain drawn from `seed`: 2 to 6 steps over the full-shape input 0 and up to 5 more inputs
/// of shape `[e, n]`, `[e, 1]`, `[1, n]` or `[1, 1]` (broadcast), some read twice; divisors are
/// positive. No exp (a chain of them overflows).
fn drawn_chain(seed: u64, e: usize, n: usize) -> (Vec<In>, Vec<Step>) {
    const NAMES: [&str; 6] = ["x0", "x1", "x2", "x3", "x4", "x5"];
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut inputs = vec![In::new(NAMES[0], F32, [e, n, 1, 1])];
    let mut steps = Vec::new();
    for _ in 0..rng.random_range(2..=6usize) {
        let step = match rng.random_range(0..3) {
            0 => {
                let u = [UnaryOp::Neg, UnaryOp::Sigmoid, UnaryOp::Silu, UnaryOp::Softplus][rng.random_range(0..4)];
                Step::Unary(u)
            }
            1 => Step::Scale([0.5, -1.25, 2.0][rng.random_range(0..3)], [0.0, 0.25][rng.random_range(0..2)]),
            _ => {
                let op = BinaryOp::ALL[rng.random_range(0..4)];
                // Read an input again, or add one (while there is room).
                let reuse = inputs.len() > 1 && (inputs.len() == NAMES.len() || rng.random_range(0..3) == 0);
                let i = if reuse {
                    rng.random_range(1..inputs.len())
                } else {
                    let ne = [[e, n, 1, 1], [e, 1, 1, 1], [1, n, 1, 1], [1, 1, 1, 1]][rng.random_range(0..4)];
                    inputs.push(In::new(NAMES[inputs.len()], F32, ne).init(Init::POSITIVE));
                    inputs.len() - 1
                };
                Step::Binary(op, i)
            }
        };
        steps.push(step);
    }
    if steps.len() < 2 {
        steps.push(Step::Unary(UnaryOp::Neg));
    }
    (inputs, steps)
}

fn run_chain(g: &mut Graph, x: &[Tensor], steps: &[Step]) -> R {
    let mut v = x[0];
    for s in steps {
        v = match *s {
            Step::Unary(u) => g.unary(u, v)?,
            Step::Scale(s, b) => g.scale_bias(v, s, b)?,
            Step::Binary(op, i) => g.binary(op, v, x[i])?,
        };
    }
    Ok(v)
}

fn elementwise_chains() -> Vec<FusionCase> {
    let mut out = Vec::new();
    // The models' chains: the DeltaNet decay softplus(alpha + dt_bias) * a (4 heads in the tiny
    // models, 32 in the 35B-A3B), the attention output gate o * sigmoid(gate) and the shared
    // expert's gate sh * sigmoid(g) with one gate per token.
    for (hv, n) in [(4, 1), (4, 6), (32, 7)] {
        let inputs = vec![
            In::new("alpha", F32, [hv, n, 1, 1]),
            In::new("dt_bias", F32, [hv, 1, 1, 1]),
            In::new("a", F32, [hv, 1, 1, 1]).init(Init::Uniform { lo: -2.0, hi: -0.1 }),
        ];
        for ctx in CTXS {
            let c = core(|g, x| {
                let s = g.add(x[0], x[1])?;
                let s = g.softplus(s)?;
                g.mul(s, x[2])
            });
            let params = format!("decay,ne=[{hv},{n}]");
            out.push(embed(ELEM, params, inputs.clone(), 1, ctx, c, halve));
        }
    }
    for (e, n) in [(64, 1), (64, 5), (2048, 3)] {
        let o = vec![In::new("o", F32, [e, n, 1, 1]), In::new("gate", F32, [e, n, 1, 1])];
        let sh = vec![In::new("sh", F32, [e, n, 1, 1]), In::new("gate", F32, [1, n, 1, 1])];
        for ctx in CTXS {
            let c = core(|g, x| {
                let s = g.sigmoid(x[1])?;
                g.mul(x[0], s)
            });
            out.push(embed(ELEM, format!("attn_gate,ne=[{e},{n}]"), o.clone(), 1, ctx, c.clone(), halve));
            out.push(embed(ELEM, format!("shexp_gate,ne=[{e},{n}]"), sh.clone(), 1, ctx, c, halve));
        }
    }
    // qwen35's attention gate as the model builds it: the gate read in place from the joint
    // q+gate projection (each head's q, then its gate), the attention output [hd, nh, n].
    for (hd, nh, n) in [(32, 2, 1), (64, 4, 5)] {
        let inputs = vec![In::new("o", F32, [hd, nh, n, 1]), In::new("qg", F32, [2 * hd * nh, n, 1, 1])];
        out.push(plain(ELEM, format_args!("attn_gate=q_view,hd={hd},nh={nh},n={n}"), inputs, 1, move |g, x| {
            let nb = [4, 2 * hd * 4, 2 * hd * nh * 4, 2 * hd * nh * n * 4];
            let gate = g.view(x[1], [hd, nh, n, 1], nb, hd * 4)?;
            let s = g.sigmoid(gate)?;
            g.mul(x[0], s)
        }));
    }
    // Drawn chains over broadcast inputs, a transposed first input now and then, each in one of
    // the surroundings.
    for i in 0..16u64 {
        let [e, n, ..] = drawn(ELEM, 16, 300, 9)[i as usize];
        let (mut inputs, steps) = drawn_chain(0x5eed + i, e, n);
        let ctx = CTXS[i as usize % CTXS.len()];
        if i % 5 == 3 && ctx != Ctx::InPlace {
            inputs[0] = inputs[0].clone().layout(Layout::TRANSPOSED);
        }
        let program: Vec<String> = steps.iter().map(|s| s.to_string()).collect();
        let shapes: Vec<String> = inputs.iter().map(|s| Shape(s.ne).to_string()).collect();
        let params = format!("chain={},inputs={}", program.join(";"), shapes.join(""));
        let c = core(move |g, x| run_chain(g, x, &steps));
        out.push(embed(ELEM, params, inputs, 1, ctx, c, halve));
    }
    let ne = [33, 4, 1, 1];
    let x = |k: usize| -> Vec<In> {
        ["x0", "x1", "x2", "x3", "x4", "x5", "x6", "x7"][..k].iter().map(|&name| In::new(name, F32, ne)).collect()
    };
    // An intermediate read twice splits the tree (two fusions); eight inputs exceed one
    // program's six (two); scale chains fuse too.
    out.push(plain(ELEM, "shared_intermediate", x(3), 2, |g, x| {
        let t = g.add(x[0], x[1])?;
        let t = g.silu(t)?;
        let p = g.mul(t, x[2])?;
        let q = g.sub(t, x[2])?;
        g.add(p, q)
    }));
    out.push(plain(ELEM, "inputs=8", x(8), 2, |g, x| {
        let mut acc = x[0];
        for &xi in &x[1..] {
            acc = g.add(acc, xi)?;
        }
        Ok(acc)
    }));
    out.push(plain(ELEM, "scales", x(1), 1, |g, x| {
        let a = g.scale_bias(x[0], 2.0, 0.5)?;
        g.scale(a, -1.5)
    }));

    // Near-misses.
    out.push(plain(ELEM, "miss=single_op", x(1), 0, |g, x| g.neg(x[0])));
    out.push(plain(ELEM, "miss=f16", vec![In::new("x", F16, ne)], 0, |g, x| {
        let a = g.neg(x[0])?;
        g.exp(a)
    }));
    out.push(plain(ELEM, "miss=intermediate_output", x(1), 0, |g, x| {
        let a = g.neg(x[0])?;
        g.mark_output(a)?;
        g.exp(a)
    }));
    out.push(plain(ELEM, "miss=second_reader", x(1), 0, |g, x| {
        let a = g.neg(x[0])?;
        let b = g.exp(a)?;
        g.mark_output(b)?;
        g.sigmoid(a)
    }));
    out.push(plain(ELEM, "miss=reduce_between", x(1), 0, |g, x| {
        let a = g.neg(x[0])?;
        let s = g.sum_rows(a)?;
        g.sigmoid(s)
    }));
    out.push(plain(ELEM, "miss=view_between", x(1), 0, |g, x| {
        let a = g.neg(x[0])?;
        let v = g.reshape(a, &[33 * 4])?;
        g.exp(v)
    }));
    let mut written = x(1);
    written[0] = written[0].clone().state();
    written.extend(write_into(ne));
    out.push(plain(ELEM, "miss=in_place_between", written, 0, |g, x| {
        let a = g.neg(x[0])?;
        g.set_rows(x[0], x[1], x[2])?;
        g.exp(a)
    }));
    out
}

// ---- gate_up_swiglu: swiglu(mul_mat(wg, x), mul_mat(wu, x)), and with mul_mat_id ----

const GUS: &str = "gate_up_swiglu";
const Q8_0: DType = DType::Q8_0;
const NVFP4: DType = DType::NvFp4;

/// `swiglu(mul_mat(wg, x), mul_mat(wu, x))`.
fn dense_glu(g: &mut Graph, x: Tensor, wg: Tensor, wu: Tensor) -> R {
    let gate = g.mul_mat(wg, x)?;
    let up = g.mul_mat(wu, x)?;
    g.swiglu(gate, up)
}

/// `swiglu(mul_mat_id(wg, x, ids), mul_mat_id(wu, x, ids))`.
fn routed_glu(g: &mut Graph, x: Tensor, ids: Tensor, wg: Tensor, wu: Tensor) -> R {
    let gate = g.mul_mat_id(wg, x, ids)?;
    let up = g.mul_mat_id(wu, x, ids)?;
    g.swiglu(gate, up)
}

/// `[x, wg, wu]`: activations `[k, n]` (first, for the in-place context) and two `dt` weights
/// `[k, m]`.
fn dense_inputs(dt: DType, k: usize, m: usize, n: usize) -> Vec<In> {
    vec![In::new("x", F32, [k, n, 1, 1]), In::new("wg", dt, [k, m, 1, 1]), In::new("wu", dt, [k, m, 1, 1])]
}

/// `[x, ids, wg, wu]`: activations `[k, n_b, n]`, `n_used` distinct experts a token of
/// `n_expert`, two `dt` expert tensors `[k, m, n_expert]`.
fn routed_inputs(dt: DType, (n_expert, n_used, n_b): (usize, usize, usize), k: usize, m: usize, n: usize) -> Vec<In> {
    vec![
        In::new("x", F32, [k, n_b, n, 1]),
        In::new("ids", I32, [n_used, n, 1, 1]).init(Init::Ids { rows: n_expert, unique: true }),
        In::new("wg", dt, [k, m, n_expert, 1]),
        In::new("wu", dt, [k, m, n_expert, 1]),
    ]
}

fn gate_up_swiglu() -> Vec<FusionCase> {
    let mut out = Vec::new();
    // The dense FFN: tiny's (64 -> 128) and tiny-moe's shared expert (64 -> 64), the 35B-A3B's
    // shared expert (2048 -> 512) in both block formats, odd and drawn sizes (f32).
    let mut dense = vec![
        (F32, 64, 128, 1),
        (F32, 64, 128, 5),
        (F32, 64, 64, 3),
        (Q8_0, 2048, 512, 1),
        (NVFP4, 2048, 512, 2),
        (Q8_0, 256, 40, 17),
        (F32, 33, 7, 3),
        (F32, 1, 1, 1),
    ];
    dense.extend(drawn(GUS, 2, 300, 9).into_iter().map(|[k, n, ..]| (F32, k, 24, n)));
    for (dt, k, m, n) in dense {
        for ctx in CTXS {
            let c = core(|g, x| dense_glu(g, x[0], x[1], x[2]));
            let params = format!("mul_mat,type_a={dt},k={k},m={m},n={n}");
            out.push(embed(GUS, params, dense_inputs(dt, k, m, n), 1, ctx, c, halve));
        }
    }
    // The routed experts: tiny-moe's (8 experts top-2, 64 -> 64), the 35B-A3B's rows (2048 ->
    // 512) over 16 experts top-8, activations shared by the slots (the model's) or one a slot.
    let routed = [
        (F32, (8, 2, 1), 64, 64, 1),
        (F32, (8, 2, 1), 64, 64, 6),
        (F32, (8, 2, 2), 64, 64, 3),
        (NVFP4, (16, 8, 1), 2048, 512, 1),
        (Q8_0, (16, 8, 8), 256, 48, 5),
        (Q8_0, (16, 4, 1), 128, 24, 17),
    ];
    for (dt, route, k, m, n) in routed {
        let (n_expert, n_used, n_b) = route;
        for ctx in CTXS {
            let c = core(|g, x| routed_glu(g, x[0], x[1], x[2], x[3]));
            let params =
                format!("mul_mat_id,type_a={dt},n_mats={n_expert},n_used={n_used},n_b={n_b},k={k},m={m},n={n}");
            out.push(embed(GUS, params, routed_inputs(dt, route, k, m, n), 1, ctx, c, halve));
        }
    }

    // Variants: operands swapped (the up product's weight becomes the fused op's gate), one weight
    // as both, strided activations, the model's FFN (router ids, both forms, down projections).
    let d = || dense_inputs(Q8_0, 128, 24, 3);
    let r = || routed_inputs(F32, (8, 2, 1), 64, 32, 3);
    out.push(plain(GUS, "mul_mat,swapped", d(), 1, |g, x| {
        let gate = g.mul_mat(x[1], x[0])?;
        let up = g.mul_mat(x[2], x[0])?;
        g.swiglu(up, gate)
    }));
    out.push(plain(GUS, "mul_mat_id,swapped", r(), 1, |g, x| {
        let gate = g.mul_mat_id(x[2], x[0], x[1])?;
        let up = g.mul_mat_id(x[3], x[0], x[1])?;
        g.swiglu(up, gate)
    }));
    let one = || d()[..2].to_vec(); // [x, w]
    out.push(plain(GUS, "mul_mat,one_weight", one(), 1, |g, x| dense_glu(g, x[0], x[1], x[1])));
    for layout in [Layout::TRANSPOSED, Layout::WINDOW] {
        let mut inputs = d();
        inputs[0] = inputs[0].clone().layout(layout);
        out.push(plain(GUS, "mul_mat,strided", inputs, 1, |g, x| dense_glu(g, x[0], x[1], x[2])));
    }
    let mut swapped = r();
    swapped[0] = In::new("x", F32, [64, 1, 3, 1]).layout(Layout::SWAP12);
    out.push(plain(GUS, "mul_mat_id,strided", swapped, 1, |g, x| routed_glu(g, x[0], x[1], x[2], x[3])));
    let (e, ff, n_expert, k, n) = (64, 32, 8, 2, 3);
    let ffn = vec![
        In::new("x", F32, [e, n, 1, 1]),
        In::new("w_inp", F32, [e, n_expert, 1, 1]),
        In::new("w_ge", F32, [e, ff, n_expert, 1]),
        In::new("w_ue", F32, [e, ff, n_expert, 1]),
        In::new("w_de", F32, [ff, e, n_expert, 1]),
        In::new("w_sg", F32, [e, ff, 1, 1]),
        In::new("w_su", F32, [e, ff, 1, 1]),
        In::new("w_sd", F32, [ff, e, 1, 1]),
    ];
    out.push(plain(GUS, "qwen35moe_ffn", ffn, 2, move |g, x| {
        let logits = g.mul_mat(x[1], x[0])?;
        let probs = g.softmax(logits, 1.0, None)?;
        let sel = g.top_k(probs, k)?;
        let cur = g.reshape(x[0], &[e, 1, n])?;
        let a = routed_glu(g, cur, sel, x[2], x[3])?;
        let ex = g.mul_mat_id(x[4], a, sel)?; // [e, k, n]
        let slots_first = g.transpose(ex)?;
        let moe = g.sum_rows(slots_first)?;
        let moe = g.reshape(moe, &[e, n])?;
        let sa = dense_glu(g, x[0], x[5], x[6])?;
        let sh = g.mul_mat(x[7], sa)?;
        g.add(moe, sh)
    }));

    // Near-misses.
    let d2 = || {
        let mut v = d();
        v.push(In::new("x2", F32, [128, 3, 1, 1]));
        v
    };
    out.push(plain(GUS, "miss=other_x", d2(), 0, |g, x| {
        let gate = g.mul_mat(x[1], x[0])?;
        let up = g.mul_mat(x[2], x[3])?;
        g.swiglu(gate, up)
    }));
    let mut r2 = r();
    r2.push(In::new("ids2", I32, [2, 3, 1, 1]).init(Init::Ids { rows: 8, unique: true }));
    out.push(plain(GUS, "miss=other_ids", r2, 0, |g, x| {
        let gate = g.mul_mat_id(x[2], x[0], x[1])?;
        let up = g.mul_mat_id(x[3], x[0], x[4])?;
        g.swiglu(gate, up)
    }));
    out.push(plain(GUS, "miss=gate_read_again", d(), 0, |g, x| {
        let gate = g.mul_mat(x[1], x[0])?;
        let up = g.mul_mat(x[2], x[0])?;
        let other = g.scale(gate, 2.0)?;
        g.mark_output(other)?;
        g.swiglu(gate, up)
    }));
    out.push(plain(GUS, "miss=up_output", r(), 0, |g, x| {
        let gate = g.mul_mat_id(x[2], x[0], x[1])?;
        let up = g.mul_mat_id(x[3], x[0], x[1])?;
        g.mark_output(up)?;
        g.swiglu(gate, up)
    }));
    let mixed = vec![
        In::new("x", F32, [128, 3, 1, 1]),
        In::new("wg", Q8_0, [128, 24, 1, 1]),
        In::new("wu", NVFP4, [128, 24, 1, 1]),
    ];
    out.push(plain(GUS, "miss=mixed_dtypes", mixed, 0, |g, x| dense_glu(g, x[0], x[1], x[2])));
    out.push(plain(GUS, "miss=one_product_twice", one(), 0, |g, x| {
        let p = g.mul_mat(x[1], x[0])?;
        g.swiglu(p, p)
    }));
    out.push(plain(GUS, "miss=swiglu_of_halves", one(), 0, |g, x| {
        let p = g.mul_mat(x[1], x[0])?;
        g.swiglu_fused(p)
    }));
    let mut both = r();
    both[2] = In::new("w", F32, [64, 32, 1, 1]);
    both.push(In::new("x3", F32, [64, 2, 3, 1]));
    out.push(plain(GUS, "miss=dense_and_routed", both, 0, |g, x| {
        let gate = g.mul_mat(x[2], x[4])?; // [32, 2, 3]
        let up = g.mul_mat_id(x[3], x[0], x[1])?; // [32, 2, 3]
        g.swiglu(gate, up)
    }));
    out.push(plain(GUS, "miss=view_of_gate", d(), 0, |g, x| {
        let gate = g.mul_mat(x[1], x[0])?;
        let up = g.mul_mat(x[2], x[0])?;
        let v = g.view(gate, gate.ne(), gate.meta().nb, 0)?;
        g.swiglu(v, up)
    }));
    // The activations rewritten between the gate and the up product: the fused op, placed at the
    // swiglu, would read the new rows for both.
    let mut written = d();
    written[0] = written[0].clone().state();
    written.extend(write_into([128, 3, 1, 1]));
    out.push(plain(GUS, "miss=in_place_between", written, 0, |g, x| {
        let gate = g.mul_mat(x[1], x[0])?;
        g.set_rows(x[0], x[3], x[4])?;
        let up = g.mul_mat(x[2], x[0])?;
        g.swiglu(gate, up)
    }));
    out
}

// ---- moe_weighted_sum: reshape(sum_rows(transpose(mul(mul_mat_id(experts, a, ids), w))), [N, n]) ----

const MWS: &str = "moe_weighted_sum";

/// The routed experts' combine over `a`, `ids`, the router weights `w` and `experts`.
fn combine(g: &mut Graph, a: Tensor, ids: Tensor, w: Tensor, experts: Tensor) -> R {
    let ex = g.mul_mat_id(experts, a, ids)?;
    let ex = g.mul(ex, w)?;
    let slots_first = g.transpose(ex)?;
    let s = g.sum_rows(slots_first)?;
    let [_, m, n, _] = s.ne();
    g.reshape(s, &[m, n])
}

/// `[a, ids, w, experts]`: activations `[k, n_b, n]`, `n_used` distinct experts a token of
/// `n_expert`, router weights `[1, n_used, n]`, `dt` experts `[k, m, n_expert]`.
fn combine_inputs(dt: DType, (n_expert, n_used, n_b): (usize, usize, usize), k: usize, m: usize, n: usize) -> Vec<In> {
    vec![
        In::new("a", F32, [k, n_b, n, 1]),
        In::new("ids", I32, [n_used, n, 1, 1]).init(Init::Ids { rows: n_expert, unique: true }),
        In::new("w", F32, [1, n_used, n, 1]),
        In::new("experts", dt, [k, m, n_expert, 1]),
    ]
}

fn moe_weighted_sum() -> Vec<FusionCase> {
    let mut out = Vec::new();
    // tiny-moe's down projection (64 -> 64, top-2), the 35B-A3B's rows (512 -> 2048) over 16
    // experts top-8, activations one a slot (the model's) or shared.
    let shapes = [
        (F32, (8, 2, 2), 64, 64, 1),
        (F32, (8, 2, 2), 64, 64, 5),
        (Q8_0, (16, 4, 4), 128, 96, 3),
        (NVFP4, (16, 8, 8), 512, 2048, 1),
        (Q8_0, (16, 4, 1), 128, 40, 17),
    ];
    for (dt, route, k, m, n) in shapes {
        let (n_expert, n_used, n_b) = route;
        for ctx in CTXS {
            let c = core(|g, x| combine(g, x[0], x[1], x[2], x[3]));
            let params = format!("type_a={dt},n_mats={n_expert},n_used={n_used},n_b={n_b},k={k},m={m},n={n}");
            out.push(embed(MWS, params, combine_inputs(dt, route, k, m, n), 1, ctx, c, halve));
        }
    }
    // Near-misses: the weighted experts read elsewhere, no transpose (a sum over the rows), one
    // weight a token broadcast over the slots, the sum kept as [1, N, n].
    let r = || combine_inputs(F32, (8, 2, 2), 64, 32, 3);
    out.push(plain(MWS, "miss=weighted_read_again", r(), 0, |g, x| {
        let ex = g.mul_mat_id(x[3], x[0], x[1])?;
        let ex = g.mul(ex, x[2])?;
        let other = g.scale(ex, 2.0)?;
        g.mark_output(other)?;
        let s = g.transpose(ex)?;
        let s = g.sum_rows(s)?;
        g.reshape(s, &[32, 3])
    }));
    out.push(plain(MWS, "miss=no_transpose", r(), 0, |g, x| {
        let ex = g.mul_mat_id(x[3], x[0], x[1])?;
        let ex = g.mul(ex, x[2])?;
        g.sum_rows(ex)
    }));
    let mut one = r();
    one[2] = In::new("w", F32, [1, 1, 3, 1]);
    out.push(plain(MWS, "miss=one_weight_a_token", one, 0, |g, x| combine(g, x[0], x[1], x[2], x[3])));
    out.push(plain(MWS, "miss=no_reshape", r(), 0, |g, x| {
        let ex = g.mul_mat_id(x[3], x[0], x[1])?;
        let ex = g.mul(ex, x[2])?;
        let s = g.transpose(ex)?;
        g.sum_rows(s)
    }));
    out
}
