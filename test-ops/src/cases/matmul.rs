//! mul_mat: f32/f16/bf16 weights, odd and model-slice sizes, batch broadcast (grouped-query
//! attention), and non-contiguous activations and weights.

use tessera_ops::DType;

use super::{F16, F32, FLOATS};
use crate::case::{Case, InputSpec as In, Layout};

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
    let sizes = [(1, 1, 1), (7, 3, 5), (16, 8, 32), (33, 7, 67), (64, 16, 128), (1, 4, 256), (128, 1, 2048)];
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
}

/// Attention-shaped products with grouped-query broadcast: `kq = k^T q` with q permuted from
/// `[head_dim, n_head, n_tokens]`, and `kqv = v^T softmax(kq)`.
fn attention(out: &mut Vec<Case>) {
    // (head_dim, n_kv, n_tokens, n_head_kv, n_head)
    for (head_dim, n_kv, n_tokens, n_head_kv, n_head) in [(128, 32, 5, 2, 8), (256, 16, 3, 1, 4)] {
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
