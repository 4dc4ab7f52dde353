//! mul_mat: f32/f16/bf16 and q8_0/nvfp4 weights, odd and model-slice sizes, batch broadcast
//! (grouped-query attention), and non-contiguous activations and weights; mul_mat_id (routed
//! experts) over every weight dtype, with per-slot and broadcast activations, 1 to 150 tokens,
//! skewed routing (repeated ids, one expert taking every pair) and out-of-range ids.
//!
//! Quantized weights are judged by the reference reading the same quantized bytes, so they take
//! the f32 bound.

use tessera_ops::DType;

use super::quant::{BLOCK_WINDOW, QUANTS};
use super::{BF16, F16, F32, FLOATS, I32, Routed};
use crate::case::{Case, Init, InputSpec as In, Layout};

/// One mul_mat case: `a [k, m, bs_a]` (weights) times `b [k, n, bs_b]` (f32 activations).
#[derive(Debug, Clone, Copy)]
pub(crate) struct MulMat {
    pub type_a: DType,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    /// Batch dims 2 and 3 of the weights.
    pub bs_a: [usize; 2],
    /// Batch dims 2 and 3 of the activations (each a multiple of `bs_a`'s).
    pub bs_b: [usize; 2],
    pub layout_a: Layout,
    pub layout_b: Layout,
}

impl MulMat {
    /// Contiguous, unbatched.
    pub(crate) fn new(type_a: DType, m: usize, n: usize, k: usize) -> Self {
        MulMat {
            type_a,
            m,
            n,
            k,
            bs_a: [1, 1],
            bs_b: [1, 1],
            layout_a: Layout::Contiguous,
            layout_b: Layout::Contiguous,
        }
    }

    fn batched(self, bs_a: [usize; 2], bs_b: [usize; 2]) -> Self {
        MulMat { bs_a, bs_b, ..self }
    }

    fn layouts(self, layout_a: Layout, layout_b: Layout) -> Self {
        MulMat { layout_a, layout_b, ..self }
    }

    /// The case, labelled like ggml's `mul_mat(type_a=f16,m=..,n=..,k=..,bs=[..],nr=[..])`,
    /// where `nr` is how many activation batches share one weight matrix.
    pub(crate) fn case(self) -> Case {
        let MulMat { type_a, m, n, k, bs_a, bs_b, .. } = self;
        let nr = [bs_b[0] / bs_a[0], bs_b[1] / bs_a[1]];
        Case::new(
            "mul_mat",
            format_args!("type_a={type_a},m={m},n={n},k={k},bs=[{},{}],nr=[{},{}]", bs_a[0], bs_a[1], nr[0], nr[1]),
            vec![
                In::new("a", type_a, [k, m, bs_a[0], bs_a[1]]).layout(self.layout_a),
                In::new("b", F32, [k, n, bs_b[0], bs_b[1]]).layout(self.layout_b),
            ],
            |g, x| g.mul_mat(x[0], x[1]),
        )
    }
}

pub(super) fn cases(out: &mut Vec<Case>) {
    let sizes =
        [(1, 1, 1), (7, 3, 5), (16, 8, 32), (33, 7, 67), (64, 16, 128), (1, 4, 256), (1, 40, 300), (128, 1, 2048)];
    for type_a in FLOATS {
        for (m, n, k) in sizes {
            out.push(MulMat::new(type_a, m, n, k).case());
        }
    }
    // Slices of Qwen3.6 projections: 512 rows of a 5120-wide (27B) and 256 of a 2048-wide model,
    // decoding 1 to 8 tokens.
    for type_a in FLOATS {
        for n in [1, 2, 3, 4, 8] {
            out.push(MulMat::new(type_a, 512, n, 5120).case());
        }
        for n in [1, 5] {
            out.push(MulMat::new(type_a, 256, n, 2048).case());
        }
        // One token against a stacked router's 257 rows (a short last group of rows a block) and
        // rows of 1024 values.
        out.push(MulMat::new(type_a, 257, 1, 2048).case());
        out.push(MulMat::new(type_a, 33, 1, 1024).case());
    }
    // Batch broadcast: each weight matrix serves bs_b / bs_a consecutive activation batches.
    let batches = [([1, 1], [2, 1]), ([2, 1], [2, 1]), ([2, 1], [4, 1]), ([1, 2], [3, 2]), ([2, 2], [4, 2])];
    for type_a in FLOATS {
        for (bs_a, bs_b) in batches {
            out.push(MulMat::new(type_a, 16, 5, 32).batched(bs_a, bs_b).case());
        }
    }
    attention(out);
    // Non-contiguous operands: transposed or windowed activations, windowed or head-permuted
    // weights (weights must keep dense rows).
    for type_a in FLOATS {
        out.push(MulMat::new(type_a, 9, 6, 33).layouts(Layout::Contiguous, Layout::TRANSPOSED).case());
        out.push(MulMat::new(type_a, 9, 6, 33).layouts(Layout::Contiguous, Layout::WINDOW).case());
        out.push(MulMat::new(type_a, 9, 6, 33).layouts(Layout::WINDOW, Layout::Contiguous).case());
    }
    out.push(MulMat::new(F32, 8, 3, 64).batched([2, 1], [4, 1]).layouts(Layout::SWAP12, Layout::SWAP12).case());
    out.push(MulMat::new(F16, 8, 3, 64).batched([2, 1], [2, 1]).layouts(Layout::WINDOW, Layout::SWAP12).case());
    // f32 weights against a prefill's tokens (a backend may take 16-byte aligned rows with k % 4
    // == 0 on tensor cores, in few tiles, splitting k): partial tiles along m, n and k, one split
    // along k with a short last split, more tiles than a backend would split, windows whose rows
    // stay 16-byte aligned, and k % 4 != 0; and fewer tokens.
    for (m, n, k) in [(67, 300, 100), (130, 260, 1028), (520, 530, 64), (40, 260, 66), (67, 45, 100)] {
        out.push(MulMat::new(F32, m, n, k).case());
    }
    out.push(MulMat::new(F32, 40, 256, 96).layouts(ALIGNED_WINDOW, ALIGNED_WINDOW).case());
    quantized(out);
    mul_mat_id(out);
}

/// A window of rows 4 values longer than the input's, from value 4 of the second row: with k % 4
/// == 0 its rows start 16-byte aligned.
const ALIGNED_WINDOW: Layout = Layout::Window { pad: [4, 1, 0, 0], at: [4, 1, 0, 0] };

/// q8_0 / nvfp4 weights: odd sizes, slices of the 2048- and 5120-wide projections at 1, 2, 5
/// and 17 tokens (GEMV and GEMM paths), 1-token products of rows 4 to 272 blocks of 64 values
/// long, batch broadcast, windowed weights, strided activations, 13 and 24 tokens over thousands
/// of rows, and products of 12 to 200 tokens with partial tiles, and two of more tiles than a
/// GPU holds.
fn quantized(out: &mut Vec<Case>) {
    for type_a in QUANTS {
        for (m, n, k) in [(1, 1, 64), (7, 3, 64), (33, 7, 128), (19, 4, 192), (5, 9, 320)] {
            out.push(MulMat::new(type_a, m, n, k).case());
        }
        for n in [1, 2, 5, 17] {
            out.push(MulMat::new(type_a, 96, n, 5120).case());
            out.push(MulMat::new(type_a, 160, n, 2048).case());
        }
        // One token against rows of 4 to 272 64-value units (a backend's 1-token GEMV may lay
        // out its threads by the units of a row), more rows than a GPU has multiprocessors, odd
        // row counts, and activations that do not start 16-byte aligned.
        for (m, k) in [(1000, 256), (333, 512), (2000, 1024), (301, 3072), (150, 17408)] {
            out.push(MulMat::new(type_a, m, 1, k).case());
        }
        out.push(MulMat::new(type_a, 300, 1, 1024).layouts(Layout::Contiguous, Layout::WINDOW).case());
        // Two and four tokens of windowed (and of transposed) activations against contiguous
        // rows (a backend may run a 1-token GEMV once a token over views of the columns).
        out.push(MulMat::new(type_a, 300, 2, 1024).layouts(Layout::Contiguous, Layout::WINDOW).case());
        out.push(MulMat::new(type_a, 300, 2, 512).layouts(Layout::Contiguous, Layout::TRANSPOSED).case());
        out.push(MulMat::new(type_a, 700, 4, 1024).layouts(Layout::Contiguous, Layout::WINDOW).case());
        // Two to four tokens over rows enough for several stages of a 1-token GEMV's ring a block
        // (a backend may read each row once for all of them), and against rows of 272 units.
        for (m, n, k) in [
            (8200, 2, 2048),
            (5000, 3, 1024),
            (2050, 3, 4096),
            (8200, 4, 2048),
            (2050, 4, 4096),
            (150, 2, 17408),
            (150, 3, 17408),
            (150, 4, 17408),
        ] {
            out.push(MulMat::new(type_a, m, n, k).case());
        }
        // 2 to 8 tokens over enough rows for a backend to share each activation load among
        // several rows a block, with row counts that leave a short last block, and batches.
        for (m, n, k) in [(1058, 5, 256), (1100, 2, 512), (601, 8, 1024), (2049, 3, 256)] {
            out.push(MulMat::new(type_a, m, n, k).case());
        }
        out.push(MulMat::new(type_a, 1056, 4, 128).batched([2, 1], [4, 1]).case());
        out.push(MulMat::new(type_a, 16, 5, 128).batched([2, 1], [4, 1]).case());
        out.push(MulMat::new(type_a, 16, 2, 128).batched([1, 2], [3, 2]).case());
        out.push(MulMat::new(type_a, 9, 6, 128).layouts(BLOCK_WINDOW, Layout::TRANSPOSED).case());
        out.push(MulMat::new(type_a, 9, 2, 128).layouts(BLOCK_WINDOW, Layout::WINDOW).case());
        // Many tokens (a backend's tiled GEMM): partial tiles in both dimensions, one and three
        // 64-value k-steps, batch broadcast, windowed weights with transposed activations.
        out.push(MulMat::new(type_a, 200, 130, 192).case());
        out.push(MulMat::new(type_a, 64, 20, 64).case());
        out.push(MulMat::new(type_a, 16, 12, 128).batched([2, 1], [4, 1]).case());
        out.push(MulMat::new(type_a, 40, 24, 128).layouts(BLOCK_WINDOW, Layout::TRANSPOSED).case());
        // 9 to 32 tokens over enough rows for a backend to read each row once for all of them on
        // tensor cores (a short last 32-row group; 13 and 24 tokens: partial column tiles).
        out.push(MulMat::new(type_a, 6400 + 8, 13, 512).case());
        out.push(MulMat::new(type_a, 8448 + 8, 24, 256).case());
        // More 128 x 128 tiles than a GPU holds at once (150 on a 132-multiprocessor GPU), so
        // that the last ones may be split along k (a block each, then split blocks, in one grid).
        out.push(MulMat::new(type_a, 150 * 128 - 40, 40, 512).case());
        // A grid of 256-column tiles where a backend takes them for large grids (160 row tiles
        // of 200 tokens): partial rows, columns and k-steps, rows of 3 k-steps whose start moves
        // by 4 bytes mod 16 from row to row, and a last wave split along k.
        out.push(MulMat::new(type_a, 160 * 128 - 40, 200, 192).case());
    }
    // q8_0 rows that are not whole 64-value steps.
    out.push(MulMat::new(QUANTS[0], 33, 12, 96).case());
}

/// One mul_mat_id case: experts `[k, n, n_expert]` of `type_a`, activations `[k, n_b, n_tokens]`,
/// `n_used` distinct experts per token.
#[derive(Debug, Clone, Copy)]
struct MulMatId {
    type_a: DType,
    n_expert: usize,
    n_used: usize,
    n_b: usize,
    n: usize,
    k: usize,
    n_tokens: usize,
    layout_a: Layout,
    layout_b: Layout,
    /// How the ids are drawn when not `n_used` distinct experts a token: a label and the init.
    routing: Option<(&'static str, Init)>,
}

impl MulMatId {
    fn new(type_a: DType, n_expert: usize, n_used: usize, n_b: usize, n: usize, k: usize, n_tokens: usize) -> Self {
        MulMatId {
            type_a,
            n_expert,
            n_used,
            n_b,
            n,
            k,
            n_tokens,
            layout_a: Layout::Contiguous,
            layout_b: Layout::Contiguous,
            routing: None,
        }
    }

    fn layouts(self, layout_a: Layout, layout_b: Layout) -> Self {
        MulMatId { layout_a, layout_b, ..self }
    }

    /// Ids drawn by `init` (labelled `ids=name`) instead of distinct experts a token.
    fn routing(self, name: &'static str, init: Init) -> Self {
        MulMatId { routing: Some((name, init)), ..self }
    }

    /// Labelled like ggml's `mul_mat_id(type_a=..,n_mats=..,n_used=..,b=..,m=..,n=..,k=..)`.
    fn case(self) -> Case {
        let MulMatId { type_a, n_expert, n_used, n_b, n, k, n_tokens, routing, .. } = self;
        let route = Routed { type_a, n_expert, n_used, n_b, m: n, k, n_tokens, ids: routing };
        let (label, ids) = route.label_and_ids();
        Case::new(
            "mul_mat_id",
            label,
            vec![
                In::new("as", type_a, [k, n, n_expert, 1]).layout(self.layout_a),
                In::new("b", F32, [k, n_b, n_tokens, 1]).layout(self.layout_b),
                In::new("ids", I32, [n_used, n_tokens, 1, 1]).init(ids),
            ],
            |g, x| g.mul_mat_id(x[0], x[1], x[2]),
        )
    }
}

/// Ids [8, T] over 8 experts, token t routing slot u to expert (t + u) mod 8, except pair
/// `bad` (slot bad mod 8 of token bad / 8), which names expert 8: out of range.
const fn ids_with_one_bad<const N: usize>(bad: usize) -> [i32; N] {
    let mut ids = [0i32; N];
    let mut i = 0;
    while i < N {
        ids[i] = ((i / 8 + i % 8) % 8) as i32;
        i += 1;
    }
    ids[bad] = 8;
    ids
}

/// 17 tokens (a grouped path), 3 tokens (a decode path) and one, one bad id each.
static BAD_IDS_17: [i32; 136] = ids_with_one_bad::<136>(77);
static BAD_IDS_3: [i32; 24] = ids_with_one_bad::<24>(13);
static BAD_IDS_1: [i32; 8] = ids_with_one_bad::<8>(2);

/// Perf cases for quantized weights and routed experts (register them in `perf.rs`): decode
/// GEMVs through the 27B FFN weights (17408 x 5120) at 1-4 tokens and the 35B-A3B's dense
/// projections at 1-32 tokens, a 512-token prefill of the 2048-wide QKV
/// projection in q8_0 / nvfp4 and of the 35B-A3B's other dense projections in nvfp4; the MoE expert FFN (2048 -> 512 gate/up, 512 -> 2048 down, top-8)
/// at decode and a 512-token prefill over 64 experts, and over all 256 (151 MB of nvfp4 a
/// projection: more than L2 holds) from 1 to 2048 tokens.
pub(crate) fn perf_cases() -> Vec<Case> {
    let mut out = Vec::new();
    for type_a in QUANTS {
        // 1-4 tokens: where the ring GEMV once a token meets `dense_mma`.
        for n in [1, 2, 3, 4] {
            out.push(MulMat::new(type_a, 17408, n, 5120).case());
        }
        // The 35B-A3B's dense projections at a 1- to 32-sequence decode step (at one token their
        // few megabytes leave a launch's fixed start most of its time).
        for n in [1, 2, 3, 4, 8, 16, 32] {
            out.push(MulMat::new(type_a, 8192, n, 2048).case());
            out.push(MulMat::new(type_a, 2048, n, 4096).case());
            out.push(MulMat::new(type_a, 512, n, 2048).case());
        }
        out.push(MulMat::new(type_a, 5120, 1, 17408).case());
        out.push(MulMat::new(type_a, 6144, 512, 2048).case());
        for n_tokens in [1, 512] {
            out.push(MulMatId::new(type_a, 64, 8, 1, 512, 2048, n_tokens).case());
            out.push(MulMatId::new(type_a, 64, 8, 8, 2048, 512, n_tokens).case());
        }
        // The GEMM floor shape: a 512-token prefill through the 27B FFN up/gate weights.
        out.push(MulMat::new(type_a, 17408, 512, 5120).case());
    }
    // The 35B-A3B's other dense projections over a 512-token micro-batch (nvfp4, as its file):
    // DeltaNet inputs, attention inputs, output, and the shared expert's down; small grids, where
    // the GEMM's tile width and k-splits decide.
    for (m, k) in [(12352, 2048), (9216, 2048), (2048, 4096), (2048, 512)] {
        out.push(MulMat::new(QUANTS[1], m, 512, k).case());
    }
    // The 35B-A3B's output projection (its 151936-token vocabulary) at 2-, 4- and 32-sequence
    // decode steps (q8_0 too at 32).
    for n in [2, 4, 32] {
        out.push(MulMat::new(QUANTS[1], 151936, n, 2048).case());
    }
    out.push(MulMat::new(QUANTS[0], 151936, 32, 2048).case());
    // bf16 at the same prefill (cuBLAS); its decode shapes are in perf.rs.
    out.push(MulMat::new(BF16, 17408, 512, 5120).case());
    // The 35B-A3B's router logits (256 f32 rows) and shared-expert gate (one f32 row) over a
    // 512-token micro-batch.
    out.push(MulMat::new(F32, 256, 512, 2048).case());
    out.push(MulMat::new(F32, 1, 512, 2048).case());
    // The stacked router (256 experts' rows and the shared gate's, padded to 260) at decode.
    for n in [1, 2, 8] {
        out.push(MulMat::new(F32, 260, n, 2048).case());
    }
    // All 256 experts of the MoE, top-8, gate/up (2048 -> 512) and down (512 -> 2048): decode
    // batches of 1 to 128 sequences (at 32, 256 routed pairs over 256 experts: most read once),
    // a 512-token prefill (the mul_mat_id floor shape) and a 2048-token one.
    for n_tokens in [1, 2, 3, 4, 8, 16, 17, 32, 64, 128, 512, 2048] {
        out.push(MulMatId::new(QUANTS[1], 256, 8, 1, 512, 2048, n_tokens).case());
        out.push(MulMatId::new(QUANTS[1], 256, 8, 8, 2048, 512, n_tokens).case());
    }
    // q8_0 experts at a 32-sequence decode step.
    out.push(MulMatId::new(QUANTS[0], 256, 8, 1, 512, 2048, 32).case());
    out.push(MulMatId::new(QUANTS[0], 256, 8, 8, 2048, 512, 32).case());
    out
}

fn mul_mat_id(out: &mut Vec<Case>) {
    // (n_expert, n_used, n_tokens): decode and short prefill, 8..32 experts, top-2..8.
    let routes = [(8, 2, 1), (8, 4, 3), (16, 8, 2), (32, 4, 5), (32, 8, 1)];
    for type_a in [F32, F16, BF16, QUANTS[0], QUANTS[1]] {
        for (n_expert, n_used, n_tokens) in routes {
            // one activation row per slot (a down projection) and one broadcast row (gate / up)
            out.push(MulMatId::new(type_a, n_expert, n_used, n_used, 24, 128, n_tokens).case());
            out.push(MulMatId::new(type_a, n_expert, n_used, 1, 33, 64, n_tokens).case());
        }
        // Enough tokens that the popular experts take the GEMM path.
        out.push(MulMatId::new(type_a, 8, 4, 1, 40, 128, 9).case());
    }
    // Non-contiguous: windowed experts (dense rows), permuted activations.
    for type_a in [F32, F16, QUANTS[0], QUANTS[1]] {
        out.push(MulMatId::new(type_a, 8, 2, 2, 16, 128, 3).layouts(BLOCK_WINDOW, Layout::SWAP12).case());
    }
    out.push(MulMatId::new(F32, 8, 4, 4, 16, 96, 2).layouts(Layout::Contiguous, Layout::WINDOW).case());
    // Qwen3.6 MoE 35B-A3B shapes, 16 of its 256 experts, top-8, 3 tokens: gate/up (2048 -> 512,
    // one broadcast activation row) and down (512 -> 2048, one row per slot).
    for type_a in QUANTS {
        out.push(MulMatId::new(type_a, 16, 8, 1, 512, 2048, 3).case());
        out.push(MulMatId::new(type_a, 16, 8, 8, 2048, 512, 3).case());
    }
    out.push(MulMatId::new(F16, 16, 8, 1, 512, 2048, 1).case());
    // Prefill: tens of tokens per expert (a backend's grouped GEMM), more than 128 in one, and
    // expert rows that are not a whole tile.
    for type_a in QUANTS {
        out.push(MulMatId::new(type_a, 4, 2, 1, 150, 128, 40).case());
        out.push(MulMatId::new(type_a, 2, 2, 2, 64, 64, 150).case());
    }
    // Batched decode and short prefill (17 to 128 tokens), 32 experts top-8: 4 to 32 pairs an
    // expert on average, broadcast and per-slot activations, weight rows that end mid-tile, one
    // and two 256-value k-chunks.
    for type_a in [F32, F16, QUANTS[0], QUANTS[1]] {
        for n_tokens in [17, 24, 32, 64, 100, 128] {
            out.push(MulMatId::new(type_a, 32, 8, 1, 40, 256, n_tokens).case());
            out.push(MulMatId::new(type_a, 32, 8, 8, 72, 512, n_tokens).case());
        }
    }
    // The 35B-A3B expert shapes (32 of its 256 experts) at 32 and 128 tokens.
    for type_a in QUANTS {
        for n_tokens in [32, 128] {
            out.push(MulMatId::new(type_a, 32, 8, 1, 512, 2048, n_tokens).case());
            out.push(MulMatId::new(type_a, 32, 8, 8, 2048, 512, n_tokens).case());
        }
    }
    // Skewed routing, ids repeated within a token: every pair to expert 0 (136 pairs of 256
    // experts' 136, and 512 of 8 experts' 512), and 128 tokens over 3 of 256 experts.
    let one = Init::Ids { rows: 1, unique: false };
    let three = Init::Ids { rows: 3, unique: false };
    for type_a in [F32, F16, QUANTS[0], QUANTS[1]] {
        out.push(MulMatId::new(type_a, 256, 8, 1, 40, 256, 17).routing("expert0", one).case());
        out.push(MulMatId::new(type_a, 8, 8, 8, 40, 256, 64).routing("expert0", one).case());
        out.push(MulMatId::new(type_a, 256, 8, 8, 40, 256, 128).routing("experts0-2", three).case());
    }
    // One token over q8_0 / nvfp4 experts of whole 256-value chunks (a backend's one-token ring
    // over the routed experts): output rows that straddle two slots in one stage, several stages a
    // block, an odd slot count, and an out-of-range id.
    for type_a in QUANTS {
        out.push(MulMatId::new(type_a, 16, 9, 1, 37, 256, 1).case());
        out.push(MulMatId::new(type_a, 16, 4, 1, 300, 512, 1).case());
        let bad1 = MulMatId::new(type_a, 8, 8, 1, 40, 256, 1).routing("bad", Init::Fixed(&BAD_IDS_1));
        out.push(bad1.case().expect_error());
    }
    // One out-of-range id among 17 tokens and among 3: the run fails like the judge's.
    for type_a in [F32, QUANTS[0], QUANTS[1]] {
        let bad17 = MulMatId::new(type_a, 8, 8, 8, 40, 256, 17).routing("bad", Init::Fixed(&BAD_IDS_17));
        out.push(bad17.case().expect_error());
        let bad3 = MulMatId::new(type_a, 8, 8, 1, 40, 256, 3).routing("bad", Init::Fixed(&BAD_IDS_3));
        out.push(bad3.case().expect_error());
    }
}

/// Attention-shaped products with grouped-query broadcast: `kq = k^T q` with q permuted from
/// `[head_dim, n_head, n_tokens]`, and `kqv = v^T softmax(kq)`.
fn attention(out: &mut Vec<Case>) {
    // (head_dim, n_kv, n_tokens, n_head_kv, n_head)
    // (the one-token rows: decode, where the heads that share a kv head are one product's columns)
    for (head_dim, n_kv, n_tokens, n_head_kv, n_head) in
        [(128, 32, 5, 2, 8), (256, 16, 3, 1, 4), (128, 300, 1, 2, 8), (256, 40, 1, 2, 12)]
    {
        for type_k in [F32, F16] {
            let kq = MulMat::new(type_k, n_kv, n_tokens, head_dim)
                .batched([n_head_kv, 1], [n_head, 1])
                .layouts(Layout::Contiguous, Layout::SWAP12);
            out.push(kq.case());
        }
        // v^T: [n_kv, head_dim, n_head_kv] weights over the attention weights [n_kv, n_tokens, n_head].
        let kqv = MulMat::new(F16, head_dim, n_tokens, n_kv).batched([n_head_kv, 1], [n_head, 1]);
        out.push(kqv.case());
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn quantized_perf_cases_build_and_cost_only_routed_experts() {
        let eval: std::collections::HashSet<String> =
            crate::cases::catalogue().iter().map(|c| c.vars().to_string()).collect();
        for case in super::perf_cases() {
            let cost = case.cost().unwrap_or_else(|e| panic!("{}: {e}", case.vars()));
            assert!(cost.flops > 0 && cost.bytes > 0, "{}", case.vars());
            assert!(!eval.contains(case.vars()), "perf label {} is also an eval label", case.vars());
        }
    }
}
