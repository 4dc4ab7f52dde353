//! flash_attn_ext: toy and odd sizes, the Qwen3.6 attention shapes (27B: 24 query heads over 4 kv
//! heads of dim 256; 35B-A3B: 16 over 2; head dim 128 too), decode (1 token, 64..300 cached
//! positions) and small prefills (7 tokens), f32/f16/bf16 K/V, f32/f16 masks (shared or per
//! sequence, padded with extra rows), softcapping, contiguous and paged K/V (a shared cache read
//! through an i32 block table of distinct cells per sequence), 1 to 3 sequences, and
//! non-contiguous q (the permuted `[d, n_head, n_tokens]` projection), K/V and mask.
//!
//! Eval sizes keep the f64 reference fast (at most a few million multiply-adds per case); the
//! model-sized runs are in [`perf_cases`].

use tessera_ops::DType;

use super::{BF16, F16, F32, I32};
use crate::case::{Case, Init, InputSpec as In, Layout};

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
    /// Cells of the shared paged cache (`None`: contiguous K/V).
    cells: Option<usize>,
    softcap: f32,
    q_layout: Layout,
    k_layout: Layout,
    v_layout: Layout,
    mask_layout: Layout,
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
            cells: None,
            softcap: 0.0,
            q_layout: Layout::Contiguous,
            k_layout: Layout::Contiguous,
            v_layout: Layout::Contiguous,
            mask_layout: Layout::Contiguous,
        }
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

    fn case(self) -> Case {
        let Fa { kv, d_k, d_v, n_tokens, n_head, n_head_kv, n_kv, n_seq, mask, cells, softcap, .. } = self;
        let rows = cells.unwrap_or(n_kv);
        let kv_seq = if cells.is_some() { 1 } else { n_seq };
        let mut inputs = vec![
            In::new("q", F32, [d_k, n_tokens, n_head, n_seq]).layout(self.q_layout),
            In::new("k", kv, [d_k, rows, n_head_kv, kv_seq]).layout(self.k_layout),
            In::new("v", kv, [d_v, rows, n_head_kv, kv_seq]).layout(self.v_layout),
        ];
        let mut label =
            format!("kv={kv},dk={d_k},dv={d_v},nt={n_tokens},nh={n_head},nh_kv={n_head_kv},n_kv={n_kv},ns={n_seq}");
        if let Some((dt, ne3, pad)) = mask {
            let ne = [n_kv, n_tokens + pad, 1, ne3];
            inputs.push(In::new("mask", dt, ne).layout(self.mask_layout).init(Init::Mask));
            label.push_str(&format!(",mask={dt}[{},{},1,{ne3}]", ne[0], ne[1]));
        }
        if let Some(c) = cells {
            inputs.push(In::new("table", I32, [n_kv, n_seq, 1, 1]).init(Init::Ids { rows: c, unique: true }));
            label.push_str(&format!(",paged={c}"));
        }
        if softcap > 0.0 {
            label.push_str(&format!(",softcap={softcap}"));
        }
        let scale = 1.0 / (d_k as f32).sqrt();
        let (has_mask, has_table) = (mask.is_some(), cells.is_some());
        Case::new("flash_attn_ext", label, inputs, move |g, x| {
            let m = has_mask.then(|| x[3]);
            let t = has_table.then(|| x[3 + usize::from(has_mask)]);
            g.flash_attn_ext(x[0], x[1], x[2], m, t, scale, softcap)
        })
    }
}

pub(crate) fn cases(out: &mut Vec<Case>) {
    toy(out);
    qwen(out);
    paged(out);
    layouts(out);
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
    // 35B-A3B MoE: 16 query heads, 2 kv heads, head dim 256.
    out.push(Fa::new(256, 1, 16, 2, 100, 3).mask_per_seq(F16, 0).case());
    out.push(Fa::new(256, 1, 16, 2, 257, 2).kv(BF16).mask(F32).case());
    out.push(Fa::new(256, 7, 16, 2, 7 + 64, 2).mask_per_seq(F16, 1).case());
    // Head dim 128.
    out.push(Fa::new(128, 1, 16, 4, 200, 1).mask(F16).case());
    out.push(Fa::new(128, 7, 8, 2, 7 + 33, 2).kv(BF16).mask(F16).case());
    out.push(Fa::new(128, 1, 32, 8, 150, 3).kv(F32).case());
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
/// 32 sequences, f16 and bf16 K/V), and a 512-token causal-shaped prefill, at the 27B and 35B-A3B
/// head counts.
pub(super) fn perf_cases() -> Vec<Case> {
    vec![
        Fa::new(256, 1, 24, 4, 4096, 1).mask(F16).case(),
        Fa::new(256, 1, 16, 2, 4096, 4).mask_per_seq(F16, 0).case(),
        Fa::new(256, 1, 24, 4, 4096, 4).mask_per_seq(F16, 0).paged(4 * 4096 + 256).case(),
        Fa::new(256, 1, 24, 4, 4096, 32).mask_per_seq(F16, 0).paged(32 * 4096 + 256).case(),
        Fa::new(256, 1, 16, 2, 4096, 32).kv(BF16).mask_per_seq(F16, 0).paged(32 * 4096 + 256).case(),
        Fa::new(256, 512, 24, 4, 512, 1).mask(F16).q_layout(Layout::SWAP12).case(),
        Fa::new(256, 512, 16, 2, 2048, 1).kv(BF16).mask(F16).case(),
    ]
}
