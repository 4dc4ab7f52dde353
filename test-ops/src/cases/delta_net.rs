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

use tessera_ops::{DType, DeltaNetAlgo, GatedDeltaNetParams, HeadMap};

use super::{BF16, F16, F32, I32};
use crate::case::{Case, Init, InputSpec as In, Layout};

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
        }
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
        GatedDeltaNetParams {
            scale: 1.0 / (self.s_k as f32).sqrt(),
            head_map: self.map,
            algo: self.algo,
            ragged: false,
        }
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
        format!(
            "type={},s_k={},s_v={},h_k={},h_v={},n_t={},n_seq={},n_slots={},{map},{algo}{split}",
            self.dtype, self.s_k, self.s_v, self.h_k, self.h_v, self.n_t, self.n_seq, self.n_slots
        )
    }

    fn case(self) -> Case {
        let Gdn { s_k, s_v, h_k, h_v, n_t, n_seq, n_slots, .. } = self;
        let k_range = (1.5 / s_k as f32).sqrt();
        let k_init = Init::Uniform { lo: -k_range, hi: k_range };
        let heads = [1, h_v, n_t, n_seq];
        let g = In::new("g", F32, heads).init(Init::Uniform { lo: -1.0, hi: 0.0 }).layout(self.gb_layout);
        let beta = In::new("beta", F32, heads).init(Init::Uniform { lo: 0.0, hi: 1.0 }).layout(self.gb_layout);
        let state = In::new("state", F32, [s_k, s_v, h_v, n_slots]).state();
        let slots = In::new("slots", I32, [n_seq, 1, 1, 1]).init(Init::Ids { rows: n_slots, unique: true });
        let p = self.params();
        if self.conv_split {
            // One conv output holds q, k, v per token; k's values need the smaller range, so the
            // whole leaf gets it (q and v only scale the output).
            let ch = 2 * h_k * s_k + h_v * s_v;
            let conv = In::new("conv", self.dtype, [ch, n_t, n_seq, 1]).init(k_init);
            let eb = self.dtype.block_bytes();
            return Case::new("gated_delta_net", self.label(), vec![conv, g, beta, state, slots], move |gr, x| {
                let nb = |row: usize| [eb, eb * row, eb * ch, eb * ch * n_t];
                let q = gr.view(x[0], [s_k, h_k, n_t, n_seq], nb(s_k), 0)?;
                let k = gr.view(x[0], [s_k, h_k, n_t, n_seq], nb(s_k), eb * h_k * s_k)?;
                let v = gr.view(x[0], [s_v, h_v, n_t, n_seq], nb(s_v), eb * 2 * h_k * s_k)?;
                gr.gated_delta_net(q, k, v, x[1], x[2], x[3], x[4], p)
            });
        }
        let q = In::new("q", self.dtype, [s_k, h_k, n_t, n_seq]).layout(self.q_layout);
        let k = In::new("k", self.dtype, [s_k, h_k, n_t, n_seq]).layout(self.k_layout).init(k_init);
        let v = In::new("v", self.dtype, [s_v, h_v, n_t, n_seq]).layout(self.v_layout);
        Case::new("gated_delta_net", self.label(), vec![q, k, v, g, beta, state, slots], move |gr, x| {
            gr.gated_delta_net(x[0], x[1], x[2], x[3], x[4], x[5], x[6], p)
        })
    }
}

pub(crate) fn cases(out: &mut Vec<Case>) {
    toy(out);
    layouts(out);
    qwen(out);
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
/// over 512 tokens for comparison).
pub(super) fn perf_cases() -> Vec<Case> {
    vec![
        Gdn::new(128, 16, 48, 1, 128).slots(128).case(),
        Gdn::new(128, 16, 48, 2048, 1).slots(1).algo(chunk(64)).case(),
        Gdn::new(128, 16, 48, 512, 1).slots(1).case(),
    ]
}
