//! `delta_net_prep`'s cases: a DeltaNet block's preparation as the model builds it (one conv
//! output holding q, k and v per token, beta and alpha as row windows of one projection, the
//! decay as the three ops the pass sees when it runs alone), at the Qwen3.5 heads and small ones,
//! decode and prefill batches; and near-misses it must leave alone.

use tessera_graph::{Graph, GraphError, Tensor};
use tessera_ops::{DType, DeltaNetAlgo, GatedDeltaNetParams, HeadMap};

use super::FusionCase;
use crate::case::{Init, InputSpec as In};

const PASS: &str = "delta_net_prep";
const F32: DType = DType::F32;
const I32: DType = DType::I32;
const EPS: f32 = 1e-6;

/// `(s_k, h_k, h_v, offsets, slots, n_slots, chunked)`.
type Shape = (usize, usize, usize, &'static [i32], &'static [i32], usize, bool);

const SHAPES: [Shape; 4] = [
    // 35B-A3B heads, a decode step of 3 sequences and a padding token
    (128, 16, 32, &[0, 1, 2, 3], &[2, 0, 1], 4, false),
    // 27B heads, a prefill of 70 tokens next to a decode token
    (128, 16, 48, &[0, 70, 71], &[1, 0], 2, true),
    // small heads, an empty sequence and padding
    (16, 2, 4, &[0, 5, 5, 9], &[0, 2, 1], 3, true),
    (8, 1, 3, &[0, 1, 2], &[1, 0], 2, false),
];

/// What can differ from the model's graph (near-misses).
#[derive(Clone, Copy, PartialEq)]
enum Miss {
    None,
    /// The normalised qk is also a graph output.
    NormOutput,
    /// q and k from two l2_norms.
    TwoNorms,
    /// silu instead of sigmoid on beta.
    SiluBeta,
    /// The decay's softplus read again.
    SoftplusRead,
}

fn inputs(s: Shape) -> (Vec<In>, usize) {
    let (s_k, h_k, h_v, offsets, slots, n_slots, _) = s;
    let n = (*offsets.last().expect("offsets") as usize) + 1;
    let ch = 2 * h_k * s_k + h_v * s_k;
    let k_range = (1.5 / s_k as f32).sqrt();
    let v = vec![
        In::new("conv", F32, [ch, n, 1, 1]).init(Init::Uniform { lo: -k_range, hi: k_range }),
        In::new("proj", F32, [2 * h_v + 3, n, 1, 1]),
        In::new("dt_bias", F32, [h_v, 1, 1, 1]),
        In::new("a", F32, [h_v, 1, 1, 1]).init(Init::Uniform { lo: -1.0, hi: -0.1 }),
        In::new("state", F32, [s_k, s_k, h_v, n_slots]).state(),
        In::new("slots", I32, [slots.len(), 1, 1, 1]).init(Init::Fixed(slots)),
        In::new("seq_offsets", I32, [offsets.len(), 1, 1, 1]).init(Init::Fixed(offsets)),
    ];
    (v, n)
}

fn build(g: &mut Graph, x: &[Tensor], s: Shape, n: usize, miss: Miss) -> Result<Tensor, GraphError> {
    let (s_k, h_k, h_v, _, _, _, chunked) = s;
    let f = 4;
    let ch = 2 * h_k * s_k + h_v * s_k;
    let rows = 2 * h_v + 3;
    let (conv, proj, dt_bias, a, state, slots, offsets) = (x[0], x[1], x[2], x[3], x[4], x[5], x[6]);
    let pnb = [f, rows * f, rows * n * f, rows * n * f];
    let beta = g.view(proj, [h_v, n, 1, 1], pnb, 0)?;
    let beta = if miss == Miss::SiluBeta { g.silu(beta)? } else { g.sigmoid(beta)? };
    let beta = g.reshape(beta, &[1, h_v, n, 1])?;
    let alpha = g.view(proj, [h_v, n, 1, 1], pnb, h_v * f)?;
    let alpha = g.add(alpha, dt_bias)?;
    let sp = g.softplus(alpha)?;
    if miss == Miss::SoftplusRead {
        let other = g.scale(sp, 2.0)?;
        g.mark_output(other)?;
    }
    let decay = g.mul(sp, a)?;
    let decay = g.reshape(decay, &[1, h_v, n, 1])?;
    let nb = |d: usize| [f, d * f, ch * f, ch * n * f];
    let (q, k) = if miss == Miss::TwoNorms {
        let q = g.view(conv, [s_k, h_k, n, 1], nb(s_k), 0)?;
        let k = g.view(conv, [s_k, h_k, n, 1], nb(s_k), h_k * s_k * f)?;
        (g.l2_norm(q, EPS)?, g.l2_norm(k, EPS)?)
    } else {
        let qk = g.view(conv, [s_k, 2 * h_k, n, 1], nb(s_k), 0)?;
        let qk = g.l2_norm(qk, EPS)?;
        if miss == Miss::NormOutput {
            g.mark_output(qk)?;
        }
        let nb_qk = [f, s_k * f, 2 * h_k * s_k * f, 2 * h_k * s_k * n * f];
        (g.view(qk, [s_k, h_k, n, 1], nb_qk, 0)?, g.view(qk, [s_k, h_k, n, 1], nb_qk, h_k * s_k * f)?)
    };
    let v = g.view(conv, [s_k, h_v, n, 1], nb(s_k), 2 * h_k * s_k * f)?;
    let algo = if chunked { DeltaNetAlgo::Chunked { chunk: 64 } } else { DeltaNetAlgo::Serial };
    let p = GatedDeltaNetParams { scale: 1.0 / (s_k as f32).sqrt(), head_map: HeadMap::Tiled, algo, ragged: true };
    g.gated_delta_net_ragged(q, k, v, decay, beta, state, slots, offsets, p)
}

pub(super) fn cases() -> Vec<FusionCase> {
    let mut out = Vec::new();
    for s in SHAPES {
        let (ins, n) = inputs(s);
        let label = format!("s_k={},h_k={},h_v={},n={n},chunked={}", s.0, s.1, s.2, s.6);
        out.push(FusionCase::new(PASS, label, ins, 1, move |g, x| build(g, x, s, n, Miss::None)));
    }
    let s = SHAPES[2];
    for (miss, name) in [
        (Miss::NormOutput, "norm_output"),
        (Miss::TwoNorms, "two_norms"),
        (Miss::SiluBeta, "silu_beta"),
        (Miss::SoftplusRead, "softplus_read_again"),
    ] {
        let (ins, n) = inputs(s);
        out.push(FusionCase::new(PASS, format!("miss={name}"), ins, 0, move |g, x| build(g, x, s, n, miss)));
    }
    out
}
