//! The conv family: ssm_conv (the causal depthwise conv of the gated-DeltaNet layers) and
//! ssm_conv_update_inplace (one conv step per sequence through a slotted conv state, updated in
//! place; the state leaf's final contents are compared too).
//!
//! Qwen3.6 conv channels: `2 * H_k * S_k + H_v * S_v` = 2*16*128 + 48*128 = 10240 (dense 27B)
//! and 2*16*128 + 32*128 = 8192 (MoE 35B-A3B), `d_conv` 4. Decode is one token per sequence;
//! prefill cases keep a few tokens so the f64 judge stays fast.
//!
//! Ragged batches of ssm_conv_update_inplace use the batches of the delta_net cases
//! ([`Ragged`]): sequences shorter and longer than `d_conv - 1`, empty sequences, padding, and the
//! bad batches that must fail with the judge's error.

use tessera_ops::DType;

use super::delta_net::{RAGGED_BAD, RAGGED_EVAL, RAGGED_MANY_SLOTS, RAGGED_PERF, RAGGED_QWEN, Ragged};
use super::{BF16, F16, F32, I32, sh};
use crate::case::{Case, Init, InputSpec as In, Layout};

/// Conv channels of the dense 27B model and of the MoE model.
const C_DENSE: usize = 10240;
const C_MOE: usize = 8192;

/// A state that is slots `1 ..= n_slots` of a state with two more slots: contiguous, but not at
/// the start of its leaf, so a write to a neighbouring slot shows in the leaf comparison.
const STATE_SLICE: Layout = Layout::Window { pad: [0, 0, 2, 0], at: [0, 0, 1, 0] };

pub(super) fn cases(out: &mut Vec<Case>) {
    ssm_conv(out);
    ssm_conv_update(out);
    composed(out);
}

/// One ssm_conv case: `sx [d_conv - 1 + n_t, channels, n_seq]`, `kernel [d_conv, channels]`.
#[derive(Debug, Clone, Copy)]
struct Conv {
    type_sx: DType,
    type_k: DType,
    d_conv: usize,
    n_t: usize,
    channels: usize,
    n_seq: usize,
    layout_sx: Layout,
    layout_k: Layout,
}

impl Conv {
    fn new(d_conv: usize, n_t: usize, channels: usize, n_seq: usize) -> Self {
        Conv {
            type_sx: F32,
            type_k: F32,
            d_conv,
            n_t,
            channels,
            n_seq,
            layout_sx: Layout::Contiguous,
            layout_k: Layout::Contiguous,
        }
    }

    fn types(mut self, sx: DType, k: DType) -> Self {
        (self.type_sx, self.type_k) = (sx, k);
        self
    }

    fn layouts(mut self, sx: Layout, k: Layout) -> Self {
        (self.layout_sx, self.layout_k) = (sx, k);
        self
    }

    fn case(self) -> Case {
        let Conv { type_sx, type_k, d_conv, n_t, channels, n_seq, layout_sx, layout_k } = self;
        let sx = In::new("sx", type_sx, [d_conv - 1 + n_t, channels, n_seq, 1]).layout(layout_sx);
        let k = In::new("kernel", type_k, [d_conv, channels, 1, 1]).layout(layout_k);
        Case::new(
            "ssm_conv",
            format_args!(
                "type_sx={type_sx},type_k={type_k},d_conv={d_conv},n_t={n_t},channels={channels},n_seq={n_seq}"
            ),
            vec![sx, k],
            |g, t| g.ssm_conv(t[0], t[1]),
        )
    }
}

fn ssm_conv(out: &mut Vec<Case>) {
    // Toy and odd sizes, d_conv 1 to 4.
    for (d_conv, n_t, channels, n_seq) in
        [(4, 1, 1, 1), (4, 5, 7, 2), (3, 33, 67, 3), (1, 7, 33, 1), (2, 7, 33, 2), (4, 17, 128, 1)]
    {
        out.push(Conv::new(d_conv, n_t, channels, n_seq).case());
    }
    // Narrower storage.
    out.push(Conv::new(4, 5, 67, 2).types(F16, F16).case());
    out.push(Conv::new(4, 3, 128, 1).types(BF16, F32).case());
    out.push(Conv::new(4, 3, 33, 2).types(F32, BF16).case());
    // Non-contiguous: sx transposed from channel-innermost tokens (how x arrives), a window,
    // sequences interleaved; the kernel transposed.
    out.push(Conv::new(4, 7, 67, 2).layouts(Layout::TRANSPOSED, Layout::Contiguous).case());
    out.push(Conv::new(4, 5, 33, 2).layouts(Layout::WINDOW, Layout::Contiguous).case());
    out.push(Conv::new(4, 3, 33, 3).layouts(Layout::SWAP12, Layout::TRANSPOSED).case());
    // Qwen3.6 channel counts: decode and a short prefill.
    out.push(Conv::new(4, 1, C_DENSE, 1).case());
    out.push(Conv::new(4, 1, C_MOE, 4).case());
    out.push(Conv::new(4, 8, C_DENSE, 2).layouts(Layout::TRANSPOSED, Layout::Contiguous).case());
    out.push(Conv::new(4, 8, C_MOE, 1).types(BF16, F32).case());
}

/// One ssm_conv_update_inplace case: `x [channels, n_t, n_seq]`, `state [d_conv - 1, channels,
/// n_slots]` (a state leaf), `kernel [d_conv, channels]`, distinct `slots` i32 `[n_seq]`.
#[derive(Debug, Clone, Copy)]
struct Update {
    type_x: DType,
    type_k: DType,
    silu: bool,
    d_conv: usize,
    channels: usize,
    n_t: usize,
    n_seq: usize,
    n_slots: usize,
    /// Layouts of x, state, kernel and slots.
    layouts: [Layout; 4],
    /// A ragged batch (`n_t` its packed tokens, `n_seq` 1) instead of dense sequences.
    ragged: Option<Ragged>,
}

impl Update {
    fn new(d_conv: usize, channels: usize, n_t: usize, n_seq: usize, n_slots: usize) -> Self {
        Update {
            type_x: F32,
            type_k: F32,
            silu: true,
            d_conv,
            channels,
            n_t,
            n_seq,
            n_slots,
            layouts: [Layout::Contiguous; 4],
            ragged: None,
        }
    }

    /// `channels` over the ragged batch `r`.
    fn ragged(d_conv: usize, channels: usize, r: Ragged) -> Self {
        Update { ragged: Some(r), ..Update::new(d_conv, channels, r.n_tokens, 1, r.n_slots) }
    }

    fn types(mut self, x: DType, k: DType) -> Self {
        (self.type_x, self.type_k) = (x, k);
        self
    }

    fn silu(mut self, silu: bool) -> Self {
        self.silu = silu;
        self
    }

    /// Sets the layout of input `i` (0 x, 1 state, 2 kernel, 3 slots).
    fn layout(mut self, i: usize, layout: Layout) -> Self {
        self.layouts[i] = layout;
        self
    }

    fn case(self) -> Case {
        let Update { type_x, type_k, silu, d_conv, channels, n_t, n_seq, n_slots, layouts, ragged } = self;
        let mut inputs = vec![
            In::new("x", type_x, [channels, n_t, n_seq, 1]).layout(layouts[0]),
            In::new("state", F32, [d_conv - 1, channels, n_slots, 1]).layout(layouts[1]).state(),
            In::new("kernel", type_k, [d_conv, channels, 1, 1]).layout(layouts[2]),
        ];
        match ragged {
            None => inputs.push(
                In::new("slots", I32, [n_seq, 1, 1, 1])
                    .layout(layouts[3])
                    .init(Init::Ids { rows: n_slots, unique: true }),
            ),
            Some(r) => inputs.extend(r.inputs().map(|i| i.layout(layouts[3]))),
        }
        let case = Case::new(
            "ssm_conv_update_inplace",
            format_args!(
                "type_x={type_x},type_k={type_k},silu={silu},d_conv={d_conv},channels={channels},n_t={n_t},\
                 n_seq={n_seq},n_slots={n_slots}{}",
                ragged.map(|r| r.label()).unwrap_or_default()
            ),
            inputs,
            move |g, t| match *t {
                [x, state, kernel, slots] => g.ssm_conv_update_inplace(x, state, kernel, slots, silu),
                [x, state, kernel, slots, offsets] => {
                    g.ssm_conv_update_inplace_ragged(x, state, kernel, slots, offsets, silu)
                }
                _ => unreachable!("ssm_conv_update_inplace cases have 4 or 5 inputs"),
            },
        );
        match ragged {
            Some(r) => r.finish(case),
            None => case,
        }
    }
}

fn ssm_conv_update(out: &mut Vec<Case>) {
    // Toy sizes; n_t below, at and above d_conv - 1 (the state is shifted, replaced, or both).
    out.push(Update::new(4, 1, 1, 1, 1).case());
    for (i, n_t) in [1, 2, 3, 5, 17].into_iter().enumerate() {
        out.push(Update::new(4, 7, n_t, 2, 4).silu(i % 2 == 0).case());
    }
    out.push(Update::new(2, 33, 3, 2, 5).case());
    out.push(Update::new(3, 67, 1, 3, 3).silu(false).case());
    out.push(Update::new(4, 129, 2, 4, 7).case());
    // Dense sequences long enough for the CUDA kernel's 32-token blocks inside a sequence (the
    // second sequence's at an outer index of 1), beside blocks that straddle two sequences.
    out.push(Update::new(4, 67, 80, 2, 3).case());
    // Narrower x and kernel.
    out.push(Update::new(4, 67, 2, 2, 4).types(F16, F16).case());
    out.push(Update::new(4, 128, 1, 3, 4).types(BF16, BF16).case());
    out.push(Update::new(4, 33, 3, 2, 3).types(F32, BF16).case());
    // Non-contiguous x (transposed from token-innermost, windowed, sequences interleaved),
    // kernel and slots; a state that is a slice of a larger one.
    out.push(Update::new(4, 67, 3, 2, 4).layout(0, Layout::TRANSPOSED).case());
    out.push(Update::new(4, 33, 2, 2, 4).layout(0, Layout::WINDOW).case());
    out.push(Update::new(4, 33, 5, 3, 4).layout(0, Layout::SWAP12).case());
    out.push(Update::new(4, 67, 1, 2, 4).layout(2, Layout::TRANSPOSED).silu(false).case());
    out.push(Update::new(4, 33, 2, 3, 5).layout(1, STATE_SLICE).case());
    out.push(Update::new(4, 33, 1, 3, 6).layout(3, Layout::WINDOW).case());
    // Qwen3.6: decode (one token per sequence, 1 to 4 sequences in 4 to 8 slots) and short
    // prefills.
    out.push(Update::new(4, C_DENSE, 1, 1, 4).case());
    out.push(Update::new(4, C_DENSE, 1, 4, 8).case());
    out.push(Update::new(4, C_MOE, 1, 2, 6).case());
    out.push(Update::new(4, C_MOE, 1, 4, 4).layout(1, STATE_SLICE).case());
    out.push(Update::new(4, C_DENSE, 7, 1, 4).case());
    out.push(Update::new(4, C_MOE, 5, 2, 8).types(BF16, F32).case());
    out.push(Update::new(4, C_DENSE, 4, 2, 8).layout(0, Layout::TRANSPOSED).case());
    ragged(out);
}

/// Ragged batches: each eval batch (sequences of 1 to 300 tokens, below and above the 3 kept
/// samples), with and without SiLU, a transposed x and half precision, a strided slots and
/// offsets, the bad batches, and the MoE channels over a small mix.
fn ragged(out: &mut Vec<Case>) {
    for (i, r) in RAGGED_EVAL.into_iter().enumerate() {
        out.push(Update::ragged(4, 67, r).silu(i % 2 == 0).case());
    }
    let mix = RAGGED_EVAL[0];
    out.push(Update::ragged(4, 33, mix).layout(0, Layout::TRANSPOSED).case());
    out.push(Update::ragged(3, 33, mix).types(BF16, F16).case());
    out.push(Update::ragged(4, 33, mix).layout(1, STATE_SLICE).layout(3, Layout::WINDOW).case());
    for r in RAGGED_BAD {
        out.push(Update::ragged(4, 7, r).case());
    }
    // Past the CUDA kernels' bitmap of slots (8192): dense and ragged, and a repeat it must catch.
    out.push(Update::new(4, 7, 1, 3, 8200).case());
    for r in RAGGED_MANY_SLOTS {
        out.push(Update::ragged(4, 7, r).case());
    }
    out.push(Update::ragged(4, C_MOE, RAGGED_QWEN).case());
}

/// The composition the fused update replaces, as llama.cpp builds it (delta-net-base
/// `build_conv_state`): `window = concat(state[slot], x^T)`, `y = silu(ssm_conv(window))`, and the
/// window's last `d_conv - 1` samples copied back into the slot (a cpy into a view of the state
/// leaf, compared after the run).
fn composed_case(channels: usize, n_t: usize, n_slots: usize, slot: usize) -> Case {
    let d_conv = 4;
    let keep = d_conv - 1;
    let inputs = vec![
        In::new("x", F32, [channels, n_t, 1, 1]),
        In::new("state", F32, [keep, channels, n_slots, 1]).state(),
        In::new("kernel", F32, [d_conv, channels, 1, 1]),
    ];
    Case::new(
        "ssm_conv",
        format_args!(
            "composed,d_conv={d_conv},channels={channels},n_t={n_t},state={},slot={slot}",
            sh([keep, channels, n_slots, 1])
        ),
        inputs,
        move |g, t| {
            let (x, state, k) = (t[0], t[1], t[2]);
            let nb = state.meta().nb;
            let slot_view = g.view(state, [keep, channels, 1, 1], nb, slot * nb[2])?;
            let xt = g.transpose(x)?;
            let window = g.concat(slot_view, xt, 0)?;
            let y = g.ssm_conv(window, k)?;
            let y = g.unary(tessera_ops::UnaryOp::Silu, y)?;
            let wnb = window.meta().nb;
            let tail = g.view(window, [keep, channels, 1, 1], wnb, n_t * wnb[0])?;
            g.cpy(tail, slot_view)?;
            Ok(y)
        },
    )
}

fn composed(out: &mut Vec<Case>) {
    out.push(composed_case(67, 1, 4, 2));
    out.push(composed_case(33, 5, 3, 0));
    out.push(composed_case(C_MOE, 1, 4, 3));
}

/// Model-sized conv cases for perf mode: Qwen3.6 decode (1 token for 1 to 4 sequences) and
/// prefill (512 and 2048 tokens), dense (10240 channels) and MoE (8192).
pub(super) fn perf_cases() -> Vec<Case> {
    let mut out = vec![
        Conv::new(4, 512, C_DENSE, 1).case(),
        Conv::new(4, 2048, C_MOE, 1).case(),
        // The PERF-ANCHORS ssm_conv prefill: sx 2051 x 10240.
        Conv::new(4, 2048, C_DENSE, 1).case(),
        // Decode batches of 32 and 128 sequences (the eval catalogue has the 1-4 sequence shapes;
        // the MoE decode batches are with the ragged ones below).
        Update::new(4, C_DENSE, 1, 32, 64).case(),
        Update::new(4, C_DENSE, 1, 128, 128).case(),
        Update::new(4, C_DENSE, 512, 1, 4).case(),
        Update::new(4, C_MOE, 2048, 1, 4).case(),
        Update::new(4, C_DENSE, 512, 1, 4).layout(0, Layout::TRANSPOSED).case(),
    ];
    // The 35B-A3B conv, dense next to ragged for the same work: decode of 1 to 128 sequences,
    // prefills of 512 and 2048 tokens, a 300-token chunk with 31 decode tokens (ragged only).
    for r in RAGGED_PERF {
        if r.n_seq() == 1 || r.n_tokens == r.n_seq() {
            out.push(Update::new(4, C_MOE, r.n_tokens / r.n_seq(), r.n_seq(), r.n_slots).case());
        }
        out.push(Update::ragged(4, C_MOE, r).case());
    }
    out
}
