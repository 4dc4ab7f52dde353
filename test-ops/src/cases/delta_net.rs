//! gated_delta_net: toy and odd sizes, both head maps, the token-serial and the chunked algorithm
//! (chunks shorter than, equal to and longer than the sequence, lengths not a multiple of the
//! chunk), 1 to 4 sequences in shuffled state slots, f16/bf16 activations, non-contiguous q/k/v/
//! g/beta (windows, a permuted k, and llama.cpp's split of one conv output by channel offset), and
//! the Qwen3.6 GDN shapes (27B: 16 key heads, 48 value heads; 35B-A3B: 16 / 32; head dim 128)
//! at decode (1 token per sequence) and small prefills (5 to 40 tokens).
//!
//! The state is a state leaf: test-ops compares its contents after the run (the slots the
//! sequences name must hold the new states, the others keep theirs) as well as the output.
//!
//! Inputs are drawn like the model's: `k` uniform in `±sqrt(1.5 / S_k)` (`|k|^2` about 0.5, so the
//! delta rule is contractive as with callers' l2-normalised keys), `q` and `v` in `[-1, 1)`, `g`
//! (log decay) in `[-1, 0)`, `beta` in `[0, 1)`, the state in `[-1, 1)`. Eval sizes keep the f64
//! reference well under a second per case; model-sized runs are in [`perf_cases`].
//!
//! Ragged batches ([`Ragged`], shared with the conv cases): prefill chunks of 1 to 300 tokens
//! mixed with decode tokens, sequences without tokens (naming a slot another sequence uses, or
//! none in range), padding tokens before and after, and error cases (offsets that decrease or
//! pass `n_tokens`, two sequences with tokens in one slot, a slot out of range), which must fail
//! with the judge's error and leave the state as it was.

use tessera_graph::{Graph, Tensor};
use tessera_ops::{DType, DeltaNetAlgo, GatedDeltaNetParams, HeadMap};

use super::{BF16, F16, F32, I32, chunk_then_decode, iota};
use crate::case::{Case, Init, InputSpec as In, Layout};

/// A ragged batch of the recurrent ops' cases: `n_tokens` packed tokens, sequence `s` owning
/// tokens `offsets[s] .. offsets[s + 1]` and state slot `slots[s]` (of `n_slots`); `bad` when the
/// run must fail (the case expects the judge's error).
#[derive(Debug, Clone, Copy)]
pub(super) struct Ragged {
    pub name: &'static str,
    pub n_tokens: usize,
    pub offsets: &'static [i32],
    pub slots: &'static [i32],
    pub n_slots: usize,
    pub bad: bool,
}

impl Ragged {
    const fn new(
        name: &'static str,
        n_tokens: usize,
        offsets: &'static [i32],
        slots: &'static [i32],
        n_slots: usize,
    ) -> Self {
        Ragged { name, n_tokens, offsets, slots, n_slots, bad: false }
    }

    const fn bad(self) -> Self {
        Ragged { bad: true, ..self }
    }

    pub fn n_seq(&self) -> usize {
        self.slots.len()
    }

    /// The `slots` and `seq_offsets` inputs.
    pub fn inputs(&self) -> [In; 2] {
        [
            In::new("slots", I32, [self.n_seq(), 1, 1, 1]).init(Init::Fixed(self.slots)),
            In::new("seq_offsets", I32, [self.n_seq() + 1, 1, 1, 1]).init(Init::Fixed(self.offsets)),
        ]
    }

    /// `,ragged=name` for a label.
    pub fn label(&self) -> String {
        format!(",ragged={}", self.name)
    }

    /// The case, marked as expecting an error when the batch is bad.
    pub fn finish(&self, case: Case) -> Case {
        if self.bad { case.expect_error() } else { case }
    }
}

/// The eval batches (see the module doc); every one of them has padding or empty sequences.
pub(super) const RAGGED_EVAL: [Ragged; 7] = [
    // Prefill chunks (70 tokens: several chunks, a partial last one), decode tokens, empty
    // sequences (one in another's slot, one out of range), 4 padding tokens at the end.
    Ragged::new("mix", 86, &[0, 5, 6, 6, 76, 77, 77, 80, 82], &[4, 0, 4, 2, 5, 99, 1, 3], 6),
    // A 300-token prefill next to decode tokens and a 37-token chunk.
    Ragged::new("long", 343, &[0, 300, 301, 302, 339, 340], &[2, 0, 3, 1, 4], 5),
    // Decode: single tokens, an empty sequence reusing a slot, padding at the end.
    Ragged::new("decode", 8, &[0, 1, 2, 3, 3, 4, 5], &[3, 1, 0, 3, 5, 2], 6),
    // Padding before the first sequence, an empty first sequence with a slot out of range.
    Ragged::new("lead", 12, &[2, 2, 9, 10], &[7, 1, 0], 3),
    // No sequence has tokens: every output 0, the state untouched.
    Ragged::new("empty", 4, &[0, 0, 0], &[9, 9], 2),
    // More sequences than slots (the empty ones share).
    Ragged::new("shared", 7, &[0, 2, 2, 2, 7], &[1, 1, 0, 0], 2),
    // No more tokens than sequences (the CUDA conv update's one-launch decode path): padding
    // before and after, empty sequences sharing a slot and out of range.
    Ragged::new("decode_wide", 4, &[1, 2, 2, 3, 3, 3], &[0, 4, 2, 4, 9], 6),
];

/// Bad batches: each must fail before anything is written.
pub(super) const RAGGED_BAD: [Ragged; 7] = [
    Ragged::new("decreasing", 6, &[0, 3, 2, 5], &[0, 1, 2], 3).bad(),
    Ragged::new("past_end", 6, &[0, 3, 7], &[0, 1], 3).bad(),
    Ragged::new("negative", 6, &[-1, 2], &[0], 3).bad(),
    Ragged::new("repeated_slot", 6, &[0, 2, 2, 5], &[1, 0, 1], 3).bad(),
    Ragged::new("slot_out_of_range", 6, &[0, 1, 4], &[0, 3], 3).bad(),
    // the same two with no more tokens than sequences (the decode paths)
    Ragged::new("decode_repeated_slot", 3, &[0, 1, 2, 3], &[1, 0, 1], 3).bad(),
    Ragged::new("decode_slot_out_of_range", 2, &[0, 1, 2], &[0, 3], 3).bad(),
];

/// More slots than the CUDA backend's one-pass slot check holds (a bitmap of 8192), so that its
/// exact pass decides: a decode batch over far-apart slots, and the same with a slot repeated.
pub(super) const RAGGED_MANY_SLOTS: [Ragged; 2] = [
    Ragged::new("many_slots", 4, &[0, 1, 2, 3, 4], &[8199, 3, 8192, 0], 8200),
    Ragged::new("many_slots_repeated", 4, &[0, 1, 2, 3, 4], &[8199, 3, 8199, 0], 8200).bad(),
];

/// For 128-wide heads: sequences over several 64-token chunks (130 and 69 tokens), at the CUDA
/// backend's limit of 16 tokens for its decode kernel and past it, decode tokens, an empty
/// sequence, padding.
const RAGGED_LONG: Ragged =
    Ragged::new("long128", 238, &[0, 130, 131, 131, 200, 216, 233, 235], &[3, 0, 9, 5, 1, 4, 2], 6);

/// A Qwen-sized mix: decode tokens around a 17-token chunk, an empty sequence, padding.
pub(super) const RAGGED_QWEN: Ragged = Ragged::new("qwen_mix", 23, &[0, 1, 2, 19, 20, 20, 21], &[5, 2, 0, 1, 5, 3], 6);

/// Perf batches: decode of 1, 4, 8, 32 and 128 sequences, one prefill of 512 and of 2048 tokens, and
/// a 300-token chunk with 31 decode tokens.
const DECODE_1: [i32; 2] = iota();
const DECODE_4: [i32; 5] = iota();
const DECODE_8: [i32; 9] = iota();
const DECODE_32: [i32; 33] = iota();
const DECODE_128: [i32; 129] = iota();
const SLOTS_1: [i32; 1] = iota();
const SLOTS_4: [i32; 4] = iota();
const SLOTS_8: [i32; 8] = iota();
const SLOTS_32: [i32; 32] = iota();
const SLOTS_128: [i32; 128] = iota();
const MIX_300_31: [i32; 33] = chunk_then_decode(300);
pub(super) const RAGGED_PERF: [Ragged; 8] = [
    Ragged::new("decode1", 1, &DECODE_1, &SLOTS_1, 128),
    Ragged::new("decode4", 4, &DECODE_4, &SLOTS_4, 128),
    Ragged::new("decode8", 8, &DECODE_8, &SLOTS_8, 128),
    Ragged::new("decode32", 32, &DECODE_32, &SLOTS_32, 128),
    Ragged::new("decode128", 128, &DECODE_128, &SLOTS_128, 128),
    Ragged::new("prefill512", 512, &[0, 512], &[0], 1),
    Ragged::new("prefill2048", 2048, &[0, 2048], &[0], 1),
    Ragged::new("mix300+31", 331, &MIX_300_31, &SLOTS_32, 128),
];

const SERIAL: DeltaNetAlgo = DeltaNetAlgo::Serial;

const fn chunk(c: usize) -> DeltaNetAlgo {
    DeltaNetAlgo::Chunked { chunk: c }
}

/// One gated_delta_net case.
#[derive(Debug, Clone, Copy)]
struct Gdn {
    s_k: usize,
    s_v: usize,
    h_k: usize,
    h_v: usize,
    n_t: usize,
    n_seq: usize,
    n_slots: usize,
    map: HeadMap,
    algo: DeltaNetAlgo,
    /// dtype of q, k and v (g and beta stay f32).
    dtype: DType,
    q_layout: Layout,
    k_layout: Layout,
    v_layout: Layout,
    gb_layout: Layout,
    /// q, k and v are channel windows of one conv output `[2 H_k S_k + H_v S_v, n_t, n_seq]`.
    conv_split: bool,
    /// A ragged batch (`n_t` its packed tokens, `n_seq` 1) instead of dense sequences.
    ragged: Option<Ragged>,
}

impl Gdn {
    /// Square heads of `s`, tiled map, serial, f32, contiguous, two spare slots.
    fn new(s: usize, h_k: usize, h_v: usize, n_t: usize, n_seq: usize) -> Self {
        Gdn {
            s_k: s,
            s_v: s,
            h_k,
            h_v,
            n_t,
            n_seq,
            n_slots: n_seq + 2,
            map: HeadMap::Tiled,
            algo: SERIAL,
            dtype: F32,
            q_layout: Layout::Contiguous,
            k_layout: Layout::Contiguous,
            v_layout: Layout::Contiguous,
            gb_layout: Layout::Contiguous,
            conv_split: false,
            ragged: None,
        }
    }

    /// Heads of `s` over the ragged batch `r`.
    fn ragged(s: usize, h_k: usize, h_v: usize, r: Ragged) -> Self {
        Gdn { ragged: Some(r), n_slots: r.n_slots, ..Gdn::new(s, h_k, h_v, r.n_tokens, 1) }
    }

    fn s_v(mut self, s_v: usize) -> Self {
        self.s_v = s_v;
        self
    }

    fn slots(mut self, n_slots: usize) -> Self {
        self.n_slots = n_slots;
        self
    }

    fn map(mut self, map: HeadMap) -> Self {
        self.map = map;
        self
    }

    fn algo(mut self, algo: DeltaNetAlgo) -> Self {
        self.algo = algo;
        self
    }

    fn dtype(mut self, dtype: DType) -> Self {
        self.dtype = dtype;
        self
    }

    fn layouts(mut self, q: Layout, k: Layout, v: Layout, gb: Layout) -> Self {
        (self.q_layout, self.k_layout, self.v_layout, self.gb_layout) = (q, k, v, gb);
        self
    }

    fn conv_split(mut self) -> Self {
        self.conv_split = true;
        self
    }

    fn params(&self) -> GatedDeltaNetParams {
        let ragged = self.ragged.is_some();
        GatedDeltaNetParams { scale: 1.0 / (self.s_k as f32).sqrt(), head_map: self.map, algo: self.algo, ragged }
    }

    fn label(&self) -> String {
        let algo = match self.algo {
            DeltaNetAlgo::Serial => "serial".to_string(),
            DeltaNetAlgo::Chunked { chunk } => format!("chunk{chunk}"),
        };
        let map = match self.map {
            HeadMap::Tiled => "tiled",
            HeadMap::Grouped => "grouped",
        };
        let split = if self.conv_split { ",conv_split" } else { "" };
        let ragged = self.ragged.map(|r| r.label()).unwrap_or_default();
        format!(
            "type={},s_k={},s_v={},h_k={},h_v={},n_t={},n_seq={},n_slots={},{map},{algo}{split}{ragged}",
            self.dtype, self.s_k, self.s_v, self.h_k, self.h_v, self.n_t, self.n_seq, self.n_slots
        )
    }

    fn case(self) -> Case {
        match self.ragged {
            Some(r) => r.finish(self.build_case()),
            None => self.build_case(),
        }
    }

    fn build_case(self) -> Case {
        let Gdn { s_k, s_v, h_k, h_v, n_t, n_seq, n_slots, ragged, .. } = self;
        let k_range = (1.5 / s_k as f32).sqrt();
        let k_init = Init::Uniform { lo: -k_range, hi: k_range };
        let heads = [1, h_v, n_t, n_seq];
        let g = In::new("g", F32, heads).init(Init::Uniform { lo: -1.0, hi: 0.0 }).layout(self.gb_layout);
        let beta = In::new("beta", F32, heads).init(Init::Uniform { lo: 0.0, hi: 1.0 }).layout(self.gb_layout);
        let state = In::new("state", F32, [s_k, s_v, h_v, n_slots]).state();
        // Dense: distinct slots drawn at random; ragged: the batch's slots and offsets.
        let tail: Vec<In> = match ragged {
            None => vec![In::new("slots", I32, [n_seq, 1, 1, 1]).init(Init::Ids { rows: n_slots, unique: true })],
            Some(r) => r.inputs().to_vec(),
        };
        let p = self.params();
        // The op on q, k, v and the inputs after them (g, beta, state, slots and the offsets).
        let op = move |gr: &mut Graph, q, k, v, x: &[Tensor]| match *x {
            [g, beta, state, slots] => gr.gated_delta_net(q, k, v, g, beta, state, slots, p),
            [g, beta, state, slots, offsets] => gr.gated_delta_net_ragged(q, k, v, g, beta, state, slots, offsets, p),
            _ => unreachable!("gated_delta_net cases have 4 or 5 inputs after q, k and v"),
        };
        if self.conv_split {
            // One conv output holds q, k, v per token; k's values need the smaller range, so the
            // whole leaf gets it (q and v only scale the output).
            let ch = 2 * h_k * s_k + h_v * s_v;
            let conv = In::new("conv", self.dtype, [ch, n_t, n_seq, 1]).init(k_init);
            let eb = self.dtype.block_bytes();
            let inputs = [vec![conv, g, beta, state], tail].concat();
            return Case::new("gated_delta_net", self.label(), inputs, move |gr, x| {
                let nb = |row: usize| [eb, eb * row, eb * ch, eb * ch * n_t];
                let q = gr.view(x[0], [s_k, h_k, n_t, n_seq], nb(s_k), 0)?;
                let k = gr.view(x[0], [s_k, h_k, n_t, n_seq], nb(s_k), eb * h_k * s_k)?;
                let v = gr.view(x[0], [s_v, h_v, n_t, n_seq], nb(s_v), eb * 2 * h_k * s_k)?;
                op(gr, q, k, v, &x[1..])
            });
        }
        let q = In::new("q", self.dtype, [s_k, h_k, n_t, n_seq]).layout(self.q_layout);
        let k = In::new("k", self.dtype, [s_k, h_k, n_t, n_seq]).layout(self.k_layout).init(k_init);
        let v = In::new("v", self.dtype, [s_v, h_v, n_t, n_seq]).layout(self.v_layout);
        let inputs = [vec![q, k, v, g, beta, state], tail].concat();
        Case::new("gated_delta_net", self.label(), inputs, move |gr, x| op(gr, x[0], x[1], x[2], &x[3..]))
    }
}

pub(crate) fn cases(out: &mut Vec<Case>) {
    toy(out);
    layouts(out);
    qwen(out);
    ragged(out);
    fused(out);
}

/// gated_delta_net_fused (the delta rule with its input preparation): the Qwen3.5 heads (h_k 16,
/// h_v 32 as the 35B-A3B, 48 as the 27B; S_k = S_v = 128) over decode and mixed batches, small
/// heads over every eval batch, both algorithms; 128-wide small heads over the eval batches of at
/// most 16 tokens and every bad batch (a backend's one-launch decode path, which checks the
/// batch in every block), the Qwen heads over a padded decode step, and dense single tokens (up
/// to five sequences of the Qwen heads).
fn fused(out: &mut Vec<Case>) {
    let decode = RAGGED_EVAL[2];
    let mut shapes = vec![(128, 16, 32, RAGGED_QWEN), (128, 16, 48, RAGGED_QWEN), (128, 16, 32, decode)];
    shapes.push((128, 16, 48, decode));
    shapes.extend(RAGGED_EVAL.iter().map(|&r| (16, 2, 4, r)));
    shapes.extend(RAGGED_EVAL.iter().filter(|r| r.n_tokens <= 16).map(|&r| (128, 2, 4, r)));
    shapes.push((128, 2, 4, RAGGED_LONG));
    // the 35B-A3B's heads over a padded decode step of five sequences: more sequences than a
    // backend's one-launch decode grid may hold (its blocks then take several each)
    shapes.push((128, 16, 32, RAGGED_EVAL[6]));
    for (s_k, h_k, h_v, r) in shapes {
        for algo in [SERIAL, chunk(64)] {
            out.push(r.finish(fused_case(s_k, h_k, h_v, r, algo)));
        }
    }
    out.push(RAGGED_BAD[3].finish(fused_case(8, 1, 2, RAGGED_BAD[3], SERIAL)));
    for r in RAGGED_BAD {
        out.push(r.finish(fused_case(128, 1, 2, r, SERIAL)));
    }
    for (h_k, h_v, slots) in
        [(2, 4, &[2][..]), (2, 4, &[4, 0, 2][..]), (1, 3, &[3, 0][..]), (16, 32, &[4, 0, 6, 2, 5][..])]
    {
        out.push(fused_dense_case(h_k, h_v, slots));
    }
}

/// Dense single tokens of one sequence per slot in `slots` (two spare slots), 128-wide heads,
/// the grouped head map.
fn fused_dense_case(h_k: usize, h_v: usize, slots: &'static [i32]) -> Case {
    let k_range = (1.5 / 128.0f32).sqrt();
    let n_seq = slots.len();
    let inputs = vec![
        In::new("qk", F32, [128, 2 * h_k, 1, n_seq]),
        In::new("v", F32, [128, h_v, 1, n_seq]),
        In::new("alpha", F32, [h_v, 1, n_seq, 1]),
        In::new("dt_bias", F32, [h_v, 1, 1, 1]),
        In::new("a", F32, [h_v, 1, 1, 1]).init(Init::Uniform { lo: -1.0, hi: -0.1 }),
        In::new("beta", F32, [h_v, 1, n_seq, 1]),
        In::new("state", F32, [128, 128, h_v, n_seq + 2]).state().init(Init::Uniform { lo: -k_range, hi: k_range }),
        In::new("slots", I32, [n_seq, 1, 1, 1]).init(Init::Fixed(slots)),
    ];
    let p =
        GatedDeltaNetParams { scale: 1.0 / 128.0f32.sqrt(), head_map: HeadMap::Grouped, algo: SERIAL, ragged: false };
    let label = format!("s_k=128,h_k={h_k},h_v={h_v},n_t=1,n_seq={n_seq},Serial,dense");
    Case::new("gated_delta_net_fused", label, inputs, move |g, x| {
        g.gated_delta_net_fused(x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7], None, 1e-6, p)
    })
}

fn fused_case(s_k: usize, h_k: usize, h_v: usize, r: Ragged, algo: DeltaNetAlgo) -> Case {
    let n_t = r.n_tokens;
    let k_range = (1.5 / s_k as f32).sqrt();
    let inputs = [
        vec![
            In::new("qk", F32, [s_k, 2 * h_k, n_t, 1]),
            In::new("v", F32, [s_k, h_v, n_t, 1]),
            In::new("alpha", F32, [h_v, n_t, 1, 1]),
            In::new("dt_bias", F32, [h_v, 1, 1, 1]),
            In::new("a", F32, [h_v, 1, 1, 1]).init(Init::Uniform { lo: -1.0, hi: -0.1 }),
            In::new("beta", F32, [h_v, n_t, 1, 1]),
            In::new("state", F32, [s_k, s_k, h_v, r.n_slots]).state().init(Init::Uniform { lo: -k_range, hi: k_range }),
        ],
        r.inputs().to_vec(),
    ]
    .concat();
    let p = GatedDeltaNetParams { scale: 1.0 / (s_k as f32).sqrt(), head_map: HeadMap::Tiled, algo, ragged: true };
    let label = format!("s_k={s_k},h_k={h_k},h_v={h_v},n_t={n_t},{algo:?}{}", r.label());
    Case::new("gated_delta_net_fused", label, inputs, move |g, x| {
        g.gated_delta_net_fused(x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7], Some(x[8]), 1e-6, p)
    })
}

/// Ragged batches: every eval batch with each algorithm (chunks of 16 restart inside the
/// 37-, 70- and 300-token sequences), both head maps, a conv-output split and half precision;
/// the bad batches; and the Qwen3.6 35B-A3B heads over a small mix.
fn ragged(out: &mut Vec<Case>) {
    for r in RAGGED_EVAL {
        for algo in [SERIAL, chunk(16)] {
            out.push(Gdn::ragged(16, 2, 4, r).s_v(12).algo(algo).case());
        }
    }
    let mix = RAGGED_EVAL[0];
    out.push(Gdn::ragged(16, 2, 4, mix).algo(chunk(64)).map(HeadMap::Grouped).case());
    out.push(Gdn::ragged(8, 2, 4, mix).s_v(6).conv_split().algo(chunk(4)).case());
    out.push(Gdn::ragged(16, 2, 4, RAGGED_EVAL[2]).dtype(BF16).case());
    for r in RAGGED_BAD {
        out.push(Gdn::ragged(8, 1, 2, r).case());
        out.push(Gdn::ragged(8, 1, 2, r).algo(chunk(64)).case());
    }
    for algo in [SERIAL, chunk(64)] {
        out.push(Gdn::ragged(128, 16, 32, RAGGED_QWEN).algo(algo).case());
        out.push(Gdn::ragged(128, 2, 4, RAGGED_LONG).algo(algo).case());
    }
    out.push(Gdn::ragged(128, 2, 4, RAGGED_LONG).algo(chunk(64)).map(HeadMap::Grouped).case());
}

/// Small and odd sizes: every algorithm and both head maps on each.
fn toy(out: &mut Vec<Case>) {
    let shapes = [
        Gdn::new(1, 1, 1, 1, 1),
        Gdn::new(4, 1, 2, 7, 1).s_v(3),
        Gdn::new(7, 2, 6, 19, 2).s_v(5).slots(3),
        Gdn::new(33, 3, 3, 5, 3).s_v(17).slots(4),
    ];
    for shape in shapes {
        for algo in [SERIAL, chunk(4), chunk(16)] {
            for map in [HeadMap::Tiled, HeadMap::Grouped] {
                out.push(shape.algo(algo).map(map).case());
            }
        }
    }
    // Chunk 1 (every token its own chunk), a chunk equal to the length, and a long sequence over
    // several chunks with a partial last one.
    out.push(Gdn::new(8, 2, 4, 6, 1).algo(chunk(1)).case());
    out.push(Gdn::new(8, 2, 4, 16, 2).algo(chunk(16)).map(HeadMap::Grouped).case());
    out.push(Gdn::new(16, 1, 3, 70, 1).s_v(12).algo(chunk(8)).case());
    out.push(Gdn::new(16, 1, 3, 70, 1).s_v(12).algo(SERIAL).case());
}

/// Half-precision activations and non-contiguous inputs.
fn layouts(out: &mut Vec<Case>) {
    for dtype in [F16, BF16] {
        out.push(Gdn::new(16, 2, 4, 9, 2).dtype(dtype).algo(chunk(4)).case());
    }
    let window = Layout::WINDOW;
    out.push(Gdn::new(8, 2, 4, 9, 2).layouts(window, window, window, window).case());
    out.push(Gdn::new(8, 2, 4, 9, 2).layouts(window, window, window, window).algo(chunk(4)).case());
    // k read through a permute of a [S_k, n_t, H_k] leaf; g/beta as a permuted [.., n_t, H_v].
    let swap = Layout::SWAP12;
    let c = Gdn::new(12, 2, 6, 7, 1).s_v(10).layouts(Layout::Contiguous, swap, Layout::Contiguous, swap);
    out.push(c.case());
    out.push(c.algo(chunk(3)).map(HeadMap::Grouped).case());
    out.push(Gdn::new(8, 2, 4, 11, 2).s_v(6).conv_split().case());
    out.push(Gdn::new(8, 2, 4, 11, 2).s_v(6).conv_split().algo(chunk(4)).case());
}

/// Qwen3.6 GDN shapes: 27B (16 key heads, 48 value heads) and 35B-A3B (16 / 32), head dim 128.
fn qwen(out: &mut Vec<Case>) {
    for (h_k, h_v) in [(16, 48), (16, 32)] {
        // Decode: one token for each of 1 to 4 sequences, in shuffled slots.
        for n_seq in 1..=4 {
            out.push(Gdn::new(128, h_k, h_v, 1, n_seq).slots(n_seq + 3).case());
        }
        out.push(Gdn::new(128, h_k, h_v, 1, 2).algo(chunk(64)).case());
    }
    // Small prefills, 27B.
    out.push(Gdn::new(128, 16, 48, 5, 1).case());
    out.push(Gdn::new(128, 16, 48, 24, 1).algo(chunk(16)).case());
    out.push(Gdn::new(128, 16, 48, 20, 1).algo(chunk(64)).case());
    // Small prefills, 35B-A3B, also in HF's grouped order and read from the conv output.
    out.push(Gdn::new(128, 16, 32, 8, 1).case());
    out.push(Gdn::new(128, 16, 32, 40, 1).algo(chunk(16)).case());
    out.push(Gdn::new(128, 16, 32, 40, 1).algo(chunk(64)).case());
    out.push(Gdn::new(128, 16, 32, 17, 2).algo(chunk(16)).map(HeadMap::Grouped).case());
    out.push(Gdn::new(128, 16, 32, 6, 1).algo(chunk(16)).conv_split().case());
}

/// Model-sized runs (for the perf catalogue, `cases/perf.rs`): 27B decode of 128 sequences (the
/// state of the 128 slots is 400 MB) and a 2048-token prefill of one sequence, chunked (serial
/// over 512 tokens for comparison); the 35B-A3B layer dense and ragged, and its fused op at
/// decode.
pub(super) fn perf_cases() -> Vec<Case> {
    let mut out = vec![
        Gdn::new(128, 16, 48, 1, 128).slots(128).case(),
        Gdn::new(128, 16, 48, 2048, 1).slots(1).algo(chunk(64)).case(),
        Gdn::new(128, 16, 48, 512, 1).slots(1).case(),
    ];
    // The 35B-A3B linear-attention layer, dense next to ragged for the same work: decode of 1 to
    // 128 sequences (serial, as the model runs decode), prefills of 512 and 2048 tokens (chunked),
    // and a 300-token chunk with 31 decode tokens (ragged only).
    for r in RAGGED_PERF {
        let algo = if r.n_tokens == r.n_seq() { SERIAL } else { chunk(64) };
        if r.n_seq() == 1 || r.n_tokens == r.n_seq() {
            out.push(Gdn::new(128, 16, 32, r.n_tokens / r.n_seq(), r.n_seq()).slots(r.n_slots).algo(algo).case());
        }
        out.push(Gdn::ragged(128, 16, 32, r).algo(algo).case());
    }
    let decodes = || RAGGED_PERF.into_iter().filter(|r| r.n_tokens == r.n_seq());
    // A decode batch under the chunked algorithm (a ragged step graph built for mixed batches).
    for r in decodes().filter(|r| r.n_seq() == 128) {
        out.push(Gdn::ragged(128, 16, 32, r).algo(chunk(64)).case());
    }
    // gated_delta_net_fused (as the model runs the layer) at decode of 1 to 32 sequences (one
    // launch up to 4 of them, three beyond).
    for r in decodes().filter(|r| r.n_seq() <= 32) {
        out.push(fused_case(128, 16, 32, r, SERIAL));
    }
    out
}
