//! flash_attn_ext: toy and odd sizes, the Qwen3.6 attention shapes (27B: 24 query heads over 4 kv
//! heads of dim 256; 35B-A3B: 16 over 2; head dim 128 too), decode (1 token, 64..300 cached
//! positions) and small prefills (7 tokens), f32/f16/bf16 K/V, f32/f16 masks (shared or per
//! sequence, padded with extra rows), softcapping, contiguous and paged K/V (a shared cache read
//! through an i32 block table of distinct cells per sequence), 1 to 3 sequences, and
//! non-contiguous q (the permuted `[d, n_head, n_tokens]` projection), K/V and mask.
//!
//! Eval sizes keep the f64 reference fast (at most a few million multiply-adds per case); the
//! model-sized runs are in [`perf_cases`].
//!
//! Ragged batches ([`RaggedFa`]): prefill chunks of 1 to 300 tokens mixed with decode tokens,
//! empty sequences, padding tokens before and after, kv lengths from the chunk's own length up to
//! n_kv, per-sequence and paged K/V (shuffled cells, and a table with garbage where nothing may
//! be read), masks and softcap, sized so that the CUDA backend runs each of its tilings (split-K
//! per packed token or per short sequence, with and without a combine; the tensor-core prefill
//! alone or next to the decode kernel, with spare blocks zeroing padding; the SIMT kernel for
//! f32 and odd head dims); and error cases (offsets that decrease, pass n_tokens or start below
//! 0, a kv length below its sequence's tokens or past n_kv, a bad table entry among the positions
//! read), which must fail with the judge's error.

use tessera_ops::{DType, FlashAttnParams, Op};

use super::{BF16, F16, F32, I32, Mix, chunk_then_decode, iota};
use crate::case::{Case, Generator, Init, InputSpec as In, Layout};

/// A ragged attention batch: `n_tokens` packed tokens, sequence `s` owning tokens
/// `offsets[s] .. offsets[s + 1]` and seeing the first `kv_lens[s]` of `n_kv` positions; an
/// optional fixed block table (else distinct random cells); `bad` when the run must fail.
#[derive(Debug, Clone, Copy)]
struct RaggedFa {
    name: &'static str,
    n_tokens: usize,
    offsets: &'static [i32],
    kv_lens: &'static [i32],
    n_kv: usize,
    table: Option<&'static [i32]>,
    bad: bool,
}

impl RaggedFa {
    const fn new(
        name: &'static str,
        n_tokens: usize,
        offsets: &'static [i32],
        kv_lens: &'static [i32],
        n_kv: usize,
    ) -> Self {
        RaggedFa { name, n_tokens, offsets, kv_lens, n_kv, table: None, bad: false }
    }

    const fn table(self, table: &'static [i32]) -> Self {
        RaggedFa { table: Some(table), ..self }
    }

    const fn bad(self) -> Self {
        RaggedFa { bad: true, ..self }
    }

    fn n_seq(&self) -> usize {
        self.kv_lens.len()
    }
}

/// `N` copies of `x`.
const fn all<const N: usize>(x: i32) -> [i32; N] {
    [x; N]
}

/// kv lengths of a 300-token chunk after 20 cached positions, then 31 decodes over 1 to 320.
const fn long_kv_lens() -> [i32; 32] {
    let mut a = [320; 32];
    let mut i = 1;
    while i < 32 {
        a[i] = 1 + ((i as i32 - 1) * 37) % 320;
        i += 1;
    }
    a
}

const LONG_OFFSETS: [i32; 33] = chunk_then_decode(300);
const LONG_KV_LENS: [i32; 32] = long_kv_lens();
/// Sequence 0 reads positions 0..3 (cells 5, 1, 7), sequence 1 has no tokens (its row is
/// garbage), sequence 2 reads positions 0..8; entries past a kv length are garbage too.
const GARBAGE_TABLE: [i32; 24] =
    [5, 1, 7, -1, 99, -7, 1000, 3, -5, -5, -5, -5, -5, -5, -5, -5, 0, 2, 4, 6, 8, 9, 11, 13];
/// The table of the bad-entry case: sequence 1 reads positions 0..5, and position 4 is cell 64.
const BAD_TABLE: [i32; 24] = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 64, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23];

/// Eval batches (see the module doc); the kv length of an empty sequence is never read, so some
/// are garbage.
const RAGGED_EVAL: [RaggedFa; 10] = [
    // A whole 40-token prompt, a decode, an empty sequence, a 5-token chunk after 40 cached
    // positions, two decodes at kv 1 and 97, a 3-token chunk; 4 padding tokens at the end.
    RaggedFa::new("mix", 55, &[0, 40, 41, 41, 46, 47, 48, 51], &[40, 90, -3, 45, 1, 97, 3], 97),
    // Decodes (kv 1 to 200), an empty sequence, padding at the end.
    RaggedFa::new("decode", 8, &[0, 1, 2, 3, 3, 4, 5, 6], &[200, 1, 64, 9999, 65, 129, 33], 200),
    // Padding before the first sequence and after the last, an empty first sequence.
    RaggedFa::new("lead", 12, &[2, 2, 9, 10], &[0, 30, 1], 40),
    // No sequence has tokens: every output is 0.
    RaggedFa::new("empty", 6, &[1, 1, 1], &[-1, 77], 8),
    // Qwen-sized mix: decodes around a 17-token chunk, an empty sequence, padding.
    RaggedFa::new("qwen_mix", 23, &[0, 1, 2, 19, 20, 20, 21], &[300, 2, 57, 99, 0, 150], 300),
    // Long caches over few sequences: the decode kernel splits them and combines.
    RaggedFa::new("split", 14, &[0, 1, 3, 13], &[400, 512, 300], 512),
    // One sequence of 100 tokens after 30 cached, 3 padding tokens before and 5 after.
    RaggedFa::new("one", 108, &[3, 103], &[130], 160),
    // A 300-token chunk after 20 cached positions and 31 decode tokens.
    RaggedFa::new("long", 331, &LONG_OFFSETS, &LONG_KV_LENS, 320),
    // Garbage in the table where nothing is read (past kv lengths, the empty sequence's row).
    RaggedFa::new("garbage", 9, &[0, 3, 3, 8], &[3, 12345, 8], 8).table(&GARBAGE_TABLE),
    // Decode-like (fewer than 2 tokens a sequence): padding before and after, an empty sequence.
    RaggedFa::new("lead_decode", 5, &[1, 2, 2, 4], &[50, 7, 60], 64),
];

/// Bad batches (3 sequences, 6 tokens, n_kv 8): each must fail like the judge.
const RAGGED_BAD: [RaggedFa; 9] = [
    RaggedFa::new("decreasing", 6, &[0, 3, 2, 5], &[8, 8, 8], 8).bad(),
    RaggedFa::new("past_end", 6, &[0, 3, 4, 7], &[8, 8, 8], 8).bad(),
    RaggedFa::new("negative", 6, &[-1, 2, 4, 6], &[8, 8, 8], 8).bad(),
    RaggedFa::new("kv_short", 6, &[0, 1, 4, 6], &[8, 2, 8], 8).bad(),
    RaggedFa::new("kv_long", 6, &[0, 1, 4, 6], &[8, 8, 9], 8).bad(),
    RaggedFa::new("bad_cell", 6, &[0, 1, 4, 6], &[8, 5, 8], 8).table(&BAD_TABLE).bad(),
    // 5 tokens: decode-like, the decode kernel alone on CUDA
    RaggedFa::new("decreasing_5", 5, &[0, 3, 2, 5], &[8, 8, 8], 8).bad(),
    RaggedFa::new("kv_long_5", 5, &[0, 1, 4, 5], &[8, 8, 9], 8).bad(),
    RaggedFa::new("bad_cell_5", 5, &[0, 1, 4, 5], &[8, 5, 8], 8).table(&BAD_TABLE).bad(),
];
/// A bad batch over enough positions that the decode kernel splits them (and, on sm_90+, merges
/// the splits in a cluster whose first block finds the error).
const RAGGED_BAD_SPLIT: RaggedFa = RaggedFa::new("kv_long_split", 5, &[0, 1, 4, 5], &[200, 200, 201], 200).bad();

/// Perf batches: decodes of 1 to 128 sequences at 512 and 4096 cached positions, one prefill of
/// 512 and of 2048 tokens, and a 300-token chunk (ending at position 1024) with 31 decode
/// tokens at 1024.
const D1: [i32; 2] = iota();
const D8: [i32; 9] = iota();
const D32: [i32; 33] = iota();
const D128: [i32; 129] = iota();
const MIX_300_31: [i32; 33] = chunk_then_decode(300);
const RAGGED_PERF: [RaggedFa; 12] = [
    RaggedFa::new("decode1", 1, &D1, &all::<1>(512), 512),
    RaggedFa::new("decode8", 8, &D8, &all::<8>(512), 512),
    RaggedFa::new("decode32", 32, &D32, &all::<32>(512), 512),
    RaggedFa::new("decode128", 128, &D128, &all::<128>(512), 512),
    RaggedFa::new("decode1", 1, &D1, &all::<1>(4096), 4096),
    RaggedFa::new("decode8", 8, &D8, &all::<8>(4096), 4096),
    RaggedFa::new("decode32", 32, &D32, &all::<32>(4096), 4096),
    RaggedFa::new("decode128", 128, &D128, &all::<128>(4096), 4096),
    RaggedFa::new("prefill512", 512, &[0, 512], &[512], 512),
    RaggedFa::new("prefill2048", 2048, &[0, 2048], &[2048], 2048),
    RaggedFa::new("mix300+31", 331, &MIX_300_31, &all::<32>(1024), 1024),
    RaggedFa::new("mix300+31", 331, &MIX_300_31, &all::<32>(4096), 4096),
];

/// One flash_attn_ext case.
#[derive(Debug, Clone, Copy)]
struct Fa {
    kv: DType,
    d_k: usize,
    d_v: usize,
    n_tokens: usize,
    n_head: usize,
    n_head_kv: usize,
    n_kv: usize,
    n_seq: usize,
    /// Mask dtype, its ne[3] (1 or n_seq) and extra padding rows beyond n_tokens.
    mask: Option<(DType, usize, usize)>,
    /// The mask is causal (`causal_mask`) rather than `Init::Mask`'s scattered -inf.
    causal: bool,
    /// Cells of the shared paged cache (`None`: contiguous K/V).
    cells: Option<usize>,
    softcap: f32,
    q_layout: Layout,
    k_layout: Layout,
    v_layout: Layout,
    mask_layout: Layout,
    /// A ragged batch (`n_tokens`, `n_seq` and `n_kv` are its) instead of dense sequences.
    ragged: Option<RaggedFa>,
    /// An output gate (the output times `sigmoid(gate)`), laid out so.
    gate: Option<Layout>,
}

impl Fa {
    /// Contiguous f16 K/V, no mask, d_k = d_v = `d`.
    fn new(d: usize, n_tokens: usize, n_head: usize, n_head_kv: usize, n_kv: usize, n_seq: usize) -> Self {
        Fa {
            kv: F16,
            d_k: d,
            d_v: d,
            n_tokens,
            n_head,
            n_head_kv,
            n_kv,
            n_seq,
            mask: None,
            causal: false,
            cells: None,
            softcap: 0.0,
            q_layout: Layout::Contiguous,
            k_layout: Layout::Contiguous,
            v_layout: Layout::Contiguous,
            mask_layout: Layout::Contiguous,
            ragged: None,
            gate: None,
        }
    }

    /// Contiguous f16 K/V of dim `d`, `n_head` over `n_head_kv` heads, over the ragged batch `r`.
    fn ragged(d: usize, n_head: usize, n_head_kv: usize, r: RaggedFa) -> Self {
        Fa { ragged: Some(r), ..Fa::new(d, r.n_tokens, n_head, n_head_kv, r.n_kv, r.n_seq()) }
    }

    fn kv(mut self, kv: DType) -> Self {
        self.kv = kv;
        self
    }

    fn d_v(mut self, d_v: usize) -> Self {
        self.d_v = d_v;
        self
    }

    /// A shared mask (ne[3] = 1) of `dtype`.
    fn mask(mut self, dtype: DType) -> Self {
        self.mask = Some((dtype, 1, 0));
        self
    }

    /// A causal mask instead of scattered -inf (see `causal_mask`).
    fn causal(mut self) -> Self {
        self.causal = true;
        self
    }

    /// A mask per sequence, with `pad` extra rows.
    fn mask_per_seq(mut self, dtype: DType, pad: usize) -> Self {
        self.mask = Some((dtype, self.n_seq, pad));
        self
    }

    fn paged(mut self, cells: usize) -> Self {
        self.cells = Some(cells);
        self
    }

    fn softcap(mut self, softcap: f32) -> Self {
        self.softcap = softcap;
        self
    }

    fn q_layout(mut self, l: Layout) -> Self {
        self.q_layout = l;
        self
    }

    fn kv_layout(mut self, k: Layout, v: Layout) -> Self {
        self.k_layout = k;
        self.v_layout = v;
        self
    }

    fn mask_layout(mut self, l: Layout) -> Self {
        self.mask_layout = l;
        self
    }

    /// The output gated by `sigmoid(gate)`, the gate laid out as `l`.
    fn gated(mut self, l: Layout) -> Self {
        self.gate = Some(l);
        self
    }

    fn case(self) -> Case {
        let Fa { kv, d_k, d_v, n_tokens, n_head, n_head_kv, n_kv, n_seq, mask, cells, softcap, ragged, .. } = self;
        let rows = cells.unwrap_or(n_kv);
        let kv_seq = if cells.is_some() { 1 } else { n_seq };
        let q_seq = if ragged.is_some() { 1 } else { n_seq };
        let mut inputs = vec![
            In::new("q", F32, [d_k, n_tokens, n_head, q_seq]).layout(self.q_layout),
            In::new("k", kv, [d_k, rows, n_head_kv, kv_seq]).layout(self.k_layout),
            In::new("v", kv, [d_v, rows, n_head_kv, kv_seq]).layout(self.v_layout),
        ];
        let mut label =
            format!("kv={kv},dk={d_k},dv={d_v},nt={n_tokens},nh={n_head},nh_kv={n_head_kv},n_kv={n_kv},ns={n_seq}");
        if let Some((dt, ne3, pad)) = mask {
            let ne = [n_kv, n_tokens + pad, 1, ne3];
            let init = if self.causal {
                Init::Generated(Generator { f: causal_mask, args: [n_tokens as f32, 0.0, 0.0, 0.0] })
            } else {
                Init::Mask
            };
            inputs.push(In::new("mask", dt, ne).layout(self.mask_layout).init(init));
            label.push_str(&format!(
                ",mask={dt}[{},{},1,{ne3}]{}",
                ne[0],
                ne[1],
                if self.causal { ",causal" } else { "" }
            ));
        }
        if let Some(c) = cells {
            let init = match ragged.and_then(|r| r.table) {
                Some(t) => Init::Fixed(t),
                None => Init::Ids { rows: c, unique: true },
            };
            inputs.push(In::new("table", I32, [n_kv, n_seq, 1, 1]).init(init));
            label.push_str(&format!(",paged={c}"));
        }
        if softcap > 0.0 {
            label.push_str(&format!(",softcap={softcap}"));
        }
        if let Some(r) = ragged {
            inputs.push(In::new("seq_offsets", I32, [n_seq + 1, 1, 1, 1]).init(Init::Fixed(r.offsets)));
            inputs.push(In::new("kv_lens", I32, [n_seq, 1, 1, 1]).init(Init::Fixed(r.kv_lens)));
            label.push_str(&format!(",ragged={}", r.name));
        }
        if let Some(l) = self.gate {
            inputs.push(In::new("gate", F32, [d_v, n_head, n_tokens, q_seq]).layout(l));
            label.push_str(",gated");
        }
        let scale = 1.0 / (d_k as f32).sqrt();
        let params = FlashAttnParams {
            scale,
            softcap,
            mask: mask.is_some(),
            paged: cells.is_some(),
            ragged: ragged.is_some(),
            gate: self.gate.is_some(),
        };
        let case = Case::new("flash_attn_ext", label, inputs, move |g, x| g.op(Op::FlashAttnExt(params), x));
        if ragged.is_some_and(|r| r.bad) { case.expect_error() } else { case }
    }
}

pub(crate) fn cases(out: &mut Vec<Case>) {
    toy(out);
    qwen(out);
    paged(out);
    layouts(out);
    ragged(out);
    gated(out);
}

/// The output gate on every kernel's store: SIMT (one split and split with its combine), the
/// tensor-core decode, both ragged tilings with the prefill kernel's padding rows; the gate
/// contiguous and strided (qwen35 reads it in place from the joint q+gate projection).
fn gated(out: &mut Vec<Case>) {
    let [mix, decode, lead, _, qwen_mix, ..] = RAGGED_EVAL;
    out.push(Fa::new(7, 3, 2, 1, 13, 1).kv(F32).d_v(5).mask(F32).gated(Layout::Contiguous).case());
    out.push(Fa::new(32, 4, 4, 2, 900, 2).kv(F32).gated(Layout::TRANSPOSED).case());
    out.push(Fa::new(256, 1, 16, 2, 257, 2).kv(BF16).mask(F32).gated(Layout::WINDOW).case());
    out.push(Fa::new(256, 1, 24, 4, 300, 2).mask_per_seq(F16, 0).paged(640).gated(Layout::Contiguous).case());
    out.push(Fa::ragged(64, 4, 2, decode).kv(F32).paged(1600).gated(Layout::WINDOW).case());
    out.push(Fa::ragged(33, 6, 3, mix).d_v(20).paged(400).gated(Layout::Contiguous).case());
    out.push(Fa::ragged(256, 16, 2, qwen_mix).paged(6 * 300).gated(Layout::WINDOW).case());
    out.push(Fa::ragged(128, 8, 2, lead).gated(Layout::Contiguous).case());
}

/// Ragged batches on every CUDA tiling, and the error cases.
fn ragged(out: &mut Vec<Case>) {
    let [mix, decode, lead, empty, qwen_mix, split, one, long, garbage, lead_decode] = RAGGED_EVAL;
    // SIMT: f32 and odd head dims, per-sequence and paged K/V, mask, softcap.
    out.push(Fa::ragged(16, 4, 2, mix).kv(F32).case());
    out.push(Fa::ragged(33, 6, 3, mix).d_v(20).paged(400).mask(F16).case());
    out.push(Fa::ragged(64, 4, 2, decode).kv(F32).paged(1600).softcap(20.0).case());
    out.push(Fa::ragged(64, 4, 2, long).kv(F32).paged(320 * 32 + 7).case());
    out.push(Fa::ragged(16, 2, 1, garbage).kv(F32).paged(16).case());
    out.push(Fa::ragged(40, 4, 2, lead).kv(BF16).mask(F32).case());
    out.push(Fa::ragged(24, 2, 2, empty).kv(F32).case());
    out.push(Fa::ragged(32, 4, 1, one).kv(F32).paged(170).case());
    // Tensor cores (f16/bf16, head dim 128 or 256): decode kernel alone (decode, split), both
    // kernels (mix, lead, empty, qwen_mix, long), the prefill kernel alone (one).
    out.push(Fa::ragged(256, 16, 2, decode).paged(1700).case());
    out.push(Fa::ragged(256, 16, 2, qwen_mix).paged(6 * 300).case());
    out.push(Fa::ragged(256, 16, 2, qwen_mix).kv(BF16).mask(F16).case());
    out.push(Fa::ragged(256, 16, 2, split).paged(3 * 512 + 5).case());
    out.push(Fa::ragged(128, 8, 2, mix).kv(BF16).paged(7 * 97).mask(F32).softcap(30.0).case());
    out.push(Fa::ragged(128, 8, 2, lead).case());
    out.push(Fa::ragged(128, 8, 2, empty).paged(20).case());
    out.push(Fa::ragged(128, 8, 2, one).kv(BF16).paged(200).q_layout(Layout::SWAP12).case());
    out.push(Fa::ragged(128, 4, 2, long).paged(320 * 32 + 1).mask(F16).case());
    out.push(Fa::ragged(128, 4, 2, garbage).paged(16).case());
    out.push(Fa::ragged(256, 16, 2, lead_decode).paged(200).mask(F16).case());
    out.push(Fa::ragged(128, 8, 2, lead_decode).kv(BF16).case());
    // Errors, on the SIMT and on the tensor-core kernels.
    for r in RAGGED_BAD {
        out.push(Fa::ragged(16, 2, 1, r).kv(F32).paged(64).case());
        out.push(Fa::ragged(128, 4, 2, r).paged(64).case());
    }
    out.push(Fa::ragged(128, 4, 2, RAGGED_BAD_SPLIT).paged(700).case());
}

/// Tiny and odd sizes: one position, d not a multiple of any SIMD width, d_v != d_k, kv lengths
/// around the 64-position softmax chunk.
fn toy(out: &mut Vec<Case>) {
    out.push(Fa::new(4, 1, 1, 1, 1, 1).kv(F32).case());
    out.push(Fa::new(7, 3, 2, 1, 13, 1).kv(F32).d_v(5).mask(F32).case());
    out.push(Fa::new(33, 5, 6, 3, 67, 2).kv(F32).d_v(17).mask_per_seq(F16, 3).case());
    out.push(Fa::new(16, 2, 4, 2, 63, 3).mask(F16).case());
    out.push(Fa::new(16, 2, 4, 2, 65, 3).kv(BF16).mask(F32).case());
    out.push(Fa::new(40, 9, 3, 3, 129, 1).kv(F32).mask(F16).case());
    out.push(Fa::new(32, 4, 4, 2, 90, 2).kv(F32).mask(F32).softcap(5.0).case());
    out.push(Fa::new(64, 3, 2, 1, 70, 1).mask(F16).softcap(30.0).case());
    out.push(Fa::new(24, 1, 8, 8, 31, 2).kv(BF16).d_v(40).case());
}

/// Qwen3.6 attention shapes: decode over 64..300 cached positions and a 7-token prefill.
fn qwen(out: &mut Vec<Case>) {
    // 27B dense: 24 query heads, 4 kv heads, head dim 256.
    for (kv, n_kv) in [(F16, 64), (F32, 129), (BF16, 300), (F16, 300)] {
        out.push(Fa::new(256, 1, 24, 4, n_kv, 1).kv(kv).mask(F16).case());
    }
    out.push(Fa::new(256, 1, 24, 4, 200, 2).case());
    out.push(Fa::new(256, 7, 24, 4, 7 + 57, 1).mask(F16).case());
    out.push(Fa::new(256, 7, 24, 4, 7, 1).kv(F32).mask(F32).case());
    // causal masks over several 64-token tiles: the tensor-core prefill skips the kv tiles past a
    // tile's last visible position (f16 masks staged in shared memory, f32 read from global)
    out.push(Fa::new(256, 130, 8, 2, 200, 1).mask(F16).causal().case());
    out.push(Fa::new(128, 100, 4, 2, 160, 2).kv(BF16).mask_per_seq(F32, 0).causal().case());
    out.push(Fa::new(128, 192, 4, 1, 192, 1).mask(F16).causal().paged(256).case());
    // few query tiles over many positions; the first query tile's later half entirely masked
    out.push(Fa::new(128, 20, 4, 2, 700, 2).mask(F16).causal().case());
    out.push(Fa::new(128, 600, 1, 1, 600, 1).kv(BF16).mask(F16).causal().case());
    out.push(Fa::new(256, 64, 8, 2, 1024, 1).paged(1100).gated(Layout::Contiguous).case());
    // 35B-A3B MoE: 16 query heads, 2 kv heads, head dim 256.
    out.push(Fa::new(256, 1, 16, 2, 100, 3).mask_per_seq(F16, 0).case());
    out.push(Fa::new(256, 1, 16, 2, 257, 2).kv(BF16).mask(F32).case());
    out.push(Fa::new(256, 7, 16, 2, 7 + 64, 2).mask_per_seq(F16, 1).case());
    // Head dim 128.
    out.push(Fa::new(128, 1, 16, 4, 200, 1).mask(F16).case());
    out.push(Fa::new(128, 7, 8, 2, 7 + 33, 2).kv(BF16).mask(F16).case());
    out.push(Fa::new(128, 1, 32, 8, 150, 3).kv(F32).case());
    // The tensor-core decode's tilings: a kv group wider than its 8-row tile (two head blocks a
    // group), and 3 tokens of a 2-head group in one tile, with a softcap.
    out.push(Fa::new(128, 1, 16, 1, 150, 1).mask(F16).case());
    out.push(Fa::new(256, 3, 4, 2, 140, 2).kv(BF16).mask(F16).softcap(30.0).case());
}

/// K/V read through a block table from a larger shared cache.
fn paged(out: &mut Vec<Case>) {
    out.push(Fa::new(8, 1, 2, 1, 20, 2).kv(F32).paged(64).case());
    out.push(Fa::new(256, 1, 24, 4, 300, 2).mask_per_seq(F16, 0).paged(640).case());
    out.push(Fa::new(256, 1, 16, 2, 77, 3).kv(BF16).mask(F32).paged(256).case());
    out.push(Fa::new(128, 7, 8, 2, 7 + 41, 2).mask_per_seq(F16, 2).paged(160).case());
    out.push(Fa::new(64, 2, 4, 2, 128, 1).kv(F32).mask(F16).paged(128).softcap(20.0).case());
    out.push(Fa::new(33, 3, 6, 2, 45, 3).kv(F16).d_v(20).paged(100).case());
}

/// Non-contiguous q (the permuted projection), K/V (a permuted cache view, windows), masks.
fn layouts(out: &mut Vec<Case>) {
    out.push(Fa::new(32, 5, 4, 2, 40, 2).kv(F32).mask(F32).q_layout(Layout::SWAP12).case());
    out.push(Fa::new(256, 7, 24, 4, 7 + 25, 1).mask(F16).q_layout(Layout::SWAP12).case());
    out.push(Fa::new(128, 1, 16, 2, 99, 2).mask(F16).q_layout(Layout::WINDOW).case());
    out.push(Fa::new(64, 3, 4, 2, 70, 2).kv_layout(Layout::SWAP12, Layout::SWAP12).mask(F16).case());
    out.push(Fa::new(40, 2, 6, 3, 50, 1).kv(BF16).kv_layout(Layout::WINDOW, Layout::SWAP12).case());
    out.push(Fa::new(16, 4, 2, 2, 37, 2).kv(F32).mask(F32).mask_layout(Layout::WINDOW).case());
    out.push(Fa::new(16, 4, 2, 2, 37, 1).kv(F32).mask(F16).mask_layout(Layout::TRANSPOSED).case());
    out.push(
        Fa::new(128, 2, 8, 2, 60, 2)
            .mask_per_seq(F16, 1)
            .paged(200)
            .q_layout(Layout::SWAP12)
            .kv_layout(Layout::WINDOW, Layout::WINDOW)
            .case(),
    );
}

/// Model-sized runs for perf mode: decode over 4096 cached positions (contiguous and paged, 4 and
/// 32 sequences, f16 and bf16 K/V), 512-token prefills over 512 and 2048 positions (scattered
/// and causal masks) and whole 2048-token causal prefills, at the 27B and 35B-A3B head counts.
pub(super) fn perf_cases() -> Vec<Case> {
    let mut out = vec![
        Fa::new(256, 1, 24, 4, 4096, 1).mask(F16).case(),
        Fa::new(256, 1, 16, 2, 4096, 4).mask_per_seq(F16, 0).case(),
        Fa::new(256, 1, 24, 4, 4096, 4).mask_per_seq(F16, 0).paged(4 * 4096 + 256).case(),
        Fa::new(256, 1, 24, 4, 4096, 32).mask_per_seq(F16, 0).paged(32 * 4096 + 256).case(),
        Fa::new(256, 1, 16, 2, 4096, 32).kv(BF16).mask_per_seq(F16, 0).paged(32 * 4096 + 256).case(),
        Fa::new(256, 512, 24, 4, 512, 1).mask(F16).q_layout(Layout::SWAP12).case(),
        Fa::new(256, 512, 16, 2, 2048, 1).kv(BF16).mask(F16).case(),
        Fa::new(256, 512, 24, 4, 512, 1).mask(F16).causal().q_layout(Layout::SWAP12).case(),
        Fa::new(256, 512, 16, 2, 2048, 1).kv(BF16).mask(F16).causal().case(),
        // the qwen3 family's attention (32 query heads over 4 kv heads of dim 128)
        Fa::new(128, 512, 32, 4, 512, 1).mask(F16).causal().case(),
        Fa::new(128, 512, 32, 4, 512, 1).kv(BF16).mask(F16).causal().case(),
        Fa::new(128, 512, 32, 4, 2048, 1).kv(BF16).mask(F16).causal().case(),
        // whole 2048-token causal prefills at the 35B-A3B, 27B and qwen3 head counts
        Fa::new(256, 2048, 16, 2, 2048, 1).mask(F16).causal().case(),
        Fa::new(256, 2048, 24, 4, 2048, 1).mask(F16).causal().case(),
        Fa::new(128, 2048, 32, 4, 2048, 1).kv(BF16).mask(F16).causal().case(),
    ];
    // The 35B-A3B attention layer (16 query heads over 2 kv heads of dim 256, f16 paged cache),
    // dense next to ragged for the same work: decodes of 1 to 128 sequences (dense: one token per
    // sequence, no mask), one prefill (dense: causal-shaped mask over all positions), and a
    // 300-token chunk with 31 decodes (ragged only; dense needs two calls, listed next to it).
    for r in RAGGED_PERF {
        let (n_seq, n_kv) = (r.n_seq(), r.n_kv);
        let cells = n_seq * n_kv + 256;
        if r.n_tokens == n_seq {
            out.push(Fa::new(256, 1, 16, 2, n_kv, n_seq).paged(cells).case());
        } else if n_seq == 1 {
            out.push(Fa::new(256, r.n_tokens, 16, 2, n_kv, 1).mask(F16).paged(cells).case());
        } else {
            out.push(Fa::new(256, 300, 16, 2, n_kv, 1).mask(F16).paged(cells).case());
            out.push(Fa::new(256, 1, 16, 2, n_kv, 31).paged(cells).case());
        }
        out.push(Fa::ragged(256, 16, 2, r).paged(cells).case());
    }
    out
}

/// A causal mask `[n_kv, rows, 1, ne3]` for `args[0]` query tokens that are the last of the n_kv
/// positions: token t sees positions j <= t + n_kv - n_tokens (values uniform in [-1, 1)), the
/// rest are -inf, so whole tiles past the diagonal are masked.
fn causal_mask(ne: [usize; 4], args: [f32; 4], seed: u64) -> Vec<f32> {
    let mut rng = Mix(seed);
    let (n_kv, n_tokens) = (ne[0], args[0] as usize);
    let mut out = Vec::with_capacity(ne.iter().product());
    for _ in 0..ne[2] * ne[3] {
        for t in 0..ne[1] {
            for j in 0..n_kv {
                out.push(if j + n_tokens <= t + n_kv { rng.unit() * 2.0 - 1.0 } else { f32::NEG_INFINITY });
            }
        }
    }
    out
}
