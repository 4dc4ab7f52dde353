//! rope_multi: plain (one position per token) and interleaved multi-section ("imrope", Qwen3.5's
//! `[11, 11, 10, 0]`) rotary embedding, NEOX and adjacent pairing, full and partial rotation
//! (Qwen3.6 rotates 64 of 256 dims), contiguous and strided `x` (q as a view into the joint
//! q+gate projection, heads and tokens swapped, windows), f32/f16/bf16.
//!
//! Positions are i32 in `[0, 32768)` (ids) or, for a few cases, up to 10^6: the backend must not
//! lose the angle's accuracy at large positions (the judge computes it in f64).

use tessera_graph::{Graph, GraphError, Tensor};
use tessera_ops::{DType, RopePairing, RopeParams};

use super::{BF16, F16, F32, I32, sh};
use crate::case::{Case, Init, InputSpec as In, Layout};

/// Qwen3.5/3.6's interleaved sections.
const QWEN: [usize; 4] = [11, 11, 10, 0];
/// Qwen3.6's rope base (read from the GGUF in practice).
const BASE: f32 = 1e7;

/// Positions drawn as ids below 32768 (a long context).
const POS_IDS: Init = Init::Ids { rows: 32_768, unique: false };
/// Positions up to 10^6 (i32 uniform draws are scaled by 10^6).
const POS_LARGE: Init = Init::Uniform { lo: 0.0, hi: 1.0 };

pub(crate) fn cases(out: &mut Vec<Case>) {
    model_shapes(out);
    odd_shapes(out);
    strided(out);
}

/// One case description: `x`'s dtype, shape and layout, the params, and how positions are drawn.
#[derive(Clone, Copy)]
struct Rope {
    dtype: DType,
    ne: [usize; 4],
    layout: Layout,
    p: RopeParams,
    pos_init: Init,
    pos_layout: Layout,
}

impl Rope {
    fn new(ne: [usize; 4], n_rot: usize, freq_base: f32, pairing: RopePairing, sections: Option<[usize; 4]>) -> Self {
        Rope {
            dtype: F32,
            ne,
            layout: Layout::Contiguous,
            p: RopeParams { n_rot, freq_base, pairing, sections },
            pos_init: POS_IDS,
            pos_layout: Layout::Contiguous,
        }
    }

    /// The Qwen3.6 attention rope: NEOX, 64 of 256 dims, base 1e7, imrope or plain.
    fn qwen(n_head: usize, n_tokens: usize, imrope: bool) -> Self {
        Rope::new([256, n_head, n_tokens, 1], 64, BASE, RopePairing::Neox, imrope.then_some(QWEN))
    }

    fn dtype(mut self, dtype: DType) -> Self {
        self.dtype = dtype;
        self
    }

    fn layout(mut self, layout: Layout) -> Self {
        self.layout = layout;
        self
    }

    fn positions(mut self, init: Init, layout: Layout) -> Self {
        self.pos_init = init;
        self.pos_layout = layout;
        self
    }

    fn n_pos(&self) -> usize {
        self.ne[2] * if self.p.sections.is_some() { 4 } else { 1 }
    }

    /// `type=..,ne=..,n_rot=..,base=..,neox|adjacent[,sections=..][,pos=large]`
    fn label(&self) -> String {
        let p = &self.p;
        let pairing = match p.pairing {
            RopePairing::Neox => "neox",
            RopePairing::Adjacent => "adjacent",
        };
        let mut label =
            format!("type={},ne={},n_rot={},base={:e},{pairing}", self.dtype, sh(self.ne), p.n_rot, p.freq_base);
        if let Some(s) = p.sections {
            label.push_str(&format!(",sections={}", sh(s)));
        }
        if self.pos_init == POS_LARGE {
            label.push_str(",pos=large");
        }
        label
    }

    fn case(self) -> Case {
        let p = self.p;
        Case::new(
            "rope_multi",
            self.label(),
            vec![
                In::new("x", self.dtype, self.ne).layout(self.layout),
                In::new("pos", I32, [self.n_pos(), 1, 1, 1]).init(self.pos_init).layout(self.pos_layout),
            ],
            move |g, x| g.rope_multi(x[0], x[1], p),
        )
    }
}

/// Qwen3.6 attention q and k heads: dense 27B (24 q / 4 kv heads) and MoE 35B-A3B (16 / 2), head
/// dim 256, a few tokens, imrope and plain; and the full-rotation head dim 128 variants.
fn model_shapes(out: &mut Vec<Case>) {
    for n_head in [24, 16, 4, 2] {
        for imrope in [true, false] {
            out.push(Rope::qwen(n_head, if n_head > 4 { 3 } else { 5 }, imrope).case());
        }
    }
    // Decode: one token.
    out.push(Rope::qwen(24, 1, true).case());
    out.push(Rope::qwen(2, 1, false).case());
    // Large positions.
    out.push(Rope::qwen(16, 4, true).positions(POS_LARGE, Layout::Contiguous).case());
    out.push(Rope::qwen(4, 3, false).positions(POS_LARGE, Layout::Contiguous).case());
    // Head dim 128, fully and partly rotated, both pairings, base 1e4 and 1e6.
    for pairing in [RopePairing::Neox, RopePairing::Adjacent] {
        out.push(Rope::new([128, 16, 4, 1], 128, 1e4, pairing, None).case());
        out.push(Rope::new([128, 4, 3, 1], 32, 1e6, pairing, Some(QWEN)).case());
    }
    // Stored narrower.
    out.push(Rope::qwen(16, 3, true).dtype(BF16).case());
    out.push(Rope::qwen(4, 3, false).dtype(F16).case());
    out.push(Rope::new([128, 4, 2, 1], 128, 1e4, RopePairing::Adjacent, None).dtype(F16).case());
}

/// Odd head dims, `n_rot` at its limits, sections whose sum is not `n_rot / 2` (wrapping, and the
/// e stream for pairs they do not cover).
fn odd_shapes(out: &mut Vec<Case>) {
    out.push(Rope::new([2, 1, 1, 1], 2, 1e4, RopePairing::Neox, None).case());
    out.push(Rope::new([6, 3, 7, 1], 2, 1e4, RopePairing::Adjacent, None).case());
    out.push(Rope::new([10, 3, 7, 1], 6, 1e4, RopePairing::Neox, None).case());
    out.push(Rope::new([66, 2, 5, 1], 66, 500.0, RopePairing::Neox, Some([2, 3, 1, 4])).case());
    out.push(Rope::new([40, 3, 4, 1], 40, 1e4, RopePairing::Adjacent, Some([1, 1, 1, 1])).case());
    out.push(Rope::new([32, 2, 3, 1], 32, 1e4, RopePairing::Neox, Some([3, 0, 0, 0])).case());
}

/// Non-contiguous `x` (and positions).
fn strided(out: &mut Vec<Case>) {
    // [head_dim, n_tokens, n_head] leaves seen as [head_dim, n_head, n_tokens] and windows.
    out.push(Rope::qwen(4, 5, true).layout(Layout::SWAP12).case());
    out.push(Rope::new([128, 4, 3, 1], 64, 1e4, RopePairing::Adjacent, None).layout(Layout::WINDOW).case());
    out.push(
        Rope::new([33 * 2, 3, 2, 1], 32, 1e4, RopePairing::Neox, Some(QWEN))
            .layout(Layout::Window { pad: [6, 2, 1, 0], at: [3, 1, 1, 0] })
            .positions(POS_IDS, Layout::Window { pad: [3, 0, 0, 0], at: [2, 0, 0, 0] })
            .case(),
    );
    // q of Qwen's joint q+gate projection: per token [q_h0, gate_h0, q_h1, gate_h1, ...], q the
    // view with head stride 2 * head_dim (dense 24 heads, MoE 16 heads), imrope and plain.
    for (n_head, n_tokens, imrope) in [(24, 3, true), (16, 4, true), (16, 2, false)] {
        out.push(joint_q_case(256, n_head, n_tokens, imrope));
    }
}

/// `rope_multi` of q viewed in the joint projection `[2 * head_dim * n_head, n_tokens]`.
fn joint_q_case(head_dim: usize, n_head: usize, n_tokens: usize, imrope: bool) -> Case {
    let p = RopeParams { n_rot: 64, freq_base: BASE, pairing: RopePairing::Neox, sections: imrope.then_some(QWEN) };
    let joint = [2 * head_dim * n_head, n_tokens, 1, 1];
    let n_pos = n_tokens * if imrope { 4 } else { 1 };
    let sections = if imrope { format!(",sections={}", sh(QWEN)) } else { String::new() };
    Case::new(
        "rope_multi",
        format_args!("type=f32,q_of_joint_qg={},head_dim={head_dim},n_rot=64,base=1e7,neox{sections}", sh(joint)),
        vec![In::new("qg", F32, joint), In::new("pos", I32, [n_pos, 1, 1, 1]).init(POS_IDS)],
        move |g, x| joint_q(g, x[0], x[1], head_dim, n_head, n_tokens, p),
    )
}

fn joint_q(
    g: &mut Graph,
    qg: Tensor,
    pos: Tensor,
    head_dim: usize,
    n_head: usize,
    n_tokens: usize,
    p: RopeParams,
) -> Result<Tensor, GraphError> {
    let nb = qg.meta().nb;
    let q = g.view(qg, [head_dim, n_head, n_tokens, 1], [nb[0], 2 * head_dim * nb[0], nb[1], nb[2]], 0)?;
    g.rope_multi(q, pos, p)
}

/// Full-size rope for perf mode: a 512-token prefill of the dense model's 24 q heads (imrope and
/// plain) and of the joint-projection view. (To be listed by `perf.rs`.)
pub(super) fn perf_cases() -> Vec<Case> {
    vec![
        Rope::qwen(24, 512, true).case(),
        Rope::qwen(24, 512, false).case(),
        Rope::qwen(4, 512, true).case(),
        joint_q_case(256, 24, 512, true),
    ]
}
