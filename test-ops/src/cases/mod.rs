//! The catalogue: every eval case and every perf case, one file per op family.
//!
//! Shapes are in ggml order (`ne[0]` innermost). Eval cases mix tiny and odd sizes (1, 7, 33,
//! 67: not multiples of any SIMD width) with slices of the Qwen3.6 model sizes (n_embd 2048 and
//! 5120, head dim 128 and 256), and exercise non-contiguous inputs through [`Layout`]s. Each eval
//! case stays small enough that the whole catalogue, judged by the slow f64 reference, runs in
//! seconds; the perf catalogue ([`perf_catalogue`]) has the full model-sized shapes.
//!
//! NMSE bounds: [`crate::NMSE_F32`] (1e-7) when everything is f32, [`crate::NMSE_HALF`] (1e-5)
//! when an input or output is f16/bf16 (see [`crate::default_bound`]); integer outputs (argmax,
//! i32 data movement) are compared exactly. No case overrides these today.

mod attention;
mod conv;
mod data;
mod delta_net;
mod elementwise;
mod elemfuse;
mod fused;
mod matmul;
mod perf;
mod quant;
mod reduce;
mod rope;
mod sample;
mod view;

use tessera_ops::DType;

use crate::case::{Case, Shape};

pub(crate) const F32: DType = DType::F32;
pub(crate) const F16: DType = DType::F16;
pub(crate) const BF16: DType = DType::BF16;
pub(crate) const I32: DType = DType::I32;

/// The float dtypes, f32 first.
pub(crate) const FLOATS: [DType; 3] = [F32, F16, BF16];

/// Shorthand for a shape in a label: `[a,b,c,d]`.
/// `[0, 1, .., N - 1]`: ragged offsets of one token per sequence, or distinct state slots.
pub(crate) const fn iota<const N: usize>() -> [i32; N] {
    let mut a = [0; N];
    let mut i = 0;
    while i < N {
        a[i] = i as i32;
        i += 1;
    }
    a
}

/// Ragged offsets `[0, len, len + 1, .., len + N - 2]`: one sequence of `len` tokens, then
/// `N - 2` decode tokens.
pub(crate) const fn chunk_then_decode<const N: usize>(len: i32) -> [i32; N] {
    let mut a = [0; N];
    let mut i = 1;
    while i < N {
        a[i] = len + i as i32 - 1;
        i += 1;
    }
    a
}

pub(crate) fn sh(ne: [usize; 4]) -> Shape {
    Shape(ne)
}

/// SplitMix64: the stream of the generated inputs (logits of the sampler and router cases), the
/// same on every run.
pub(crate) struct Mix(pub u64);

impl Mix {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1) with 24 bits.
    pub fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / 16_777_216.0
    }

    /// Uniform in [lo, hi).
    pub fn range(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * self.unit()
    }

    /// Uniform in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// The routed ops' cases (mul_mat_id and its fusions): experts of `type_a` with rows of `k` and
/// `m` of them, activations `[k, n_b, n_tokens]`, `n_used` ids a token (`ids`: how they are drawn,
/// labelled, unless distinct experts).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Routed {
    pub type_a: tessera_ops::DType,
    pub n_expert: usize,
    pub n_used: usize,
    pub n_b: usize,
    pub m: usize,
    pub k: usize,
    pub n_tokens: usize,
    pub ids: Option<(&'static str, crate::case::Init)>,
}

impl Routed {
    /// `type_a=..,n_mats=..,n_used=..,b=..,m=..,n=..,k=..[,ids=..]`, and the ids' init.
    pub fn label_and_ids(&self) -> (String, crate::case::Init) {
        let Routed { type_a, n_expert, n_used, n_b, m, k, n_tokens, ids } = *self;
        let (ids_label, init) = match ids {
            Some((name, init)) => (format!(",ids={name}"), init),
            None => (String::new(), crate::case::Init::Ids { rows: n_expert, unique: true }),
        };
        let b = sh([k, n_b, n_tokens, 1]);
        (format!("type_a={type_a},n_mats={n_expert},n_used={n_used},b={b},m={m},n={n_tokens},k={k}{ids_label}"), init)
    }
}

/// Every eval case, grouped by op family.
pub fn catalogue() -> Vec<Case> {
    let mut cases = Vec::new();
    data::cases(&mut cases);
    view::cases(&mut cases);
    elementwise::cases(&mut cases);
    reduce::cases(&mut cases);
    matmul::cases(&mut cases);
    quant::cases(&mut cases);
    rope::cases(&mut cases);
    attention::cases(&mut cases);
    conv::cases(&mut cases);
    delta_net::cases(&mut cases);
    sample::cases(&mut cases);
    fused::cases(&mut cases);
    elemfuse::cases(&mut cases);
    cases
}

/// Model-sized cases for perf mode (too big to judge with the f64 reference in reasonable time).
pub fn perf_catalogue() -> Vec<Case> {
    perf::cases()
}
