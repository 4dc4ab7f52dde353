//! Projections of one input, one matmul per weight or one per group of weights stacked at load.
//!
//! A block often projects one input through several matrices (attention's q, k and v; the
//! gated DeltaNet's qkv, z, beta and alpha). [`merge_groups`] stacks such a group once at load
//! into one resident matrix ([`ModelWeights::merge_rows`]; the parts stay registered as windows of
//! it), and [`project`] then runs one matmul for the group and hands each part back as [`Rows`],
//! a strided view of the product. When a group was not stacked (the option is off, or the parts
//! differ in dtype or row length) [`project`] runs one matmul a part, and the caller sees the
//! same [`Rows`].

use tessera_graph::{Backend, Graph, Tensor};

use crate::arch::StepBuilder;
use crate::model::ModelError;
use crate::weights::{ModelWeights, WeightsError};

/// The weights of a block that read the same input, in the order their rows are stacked, and the
/// name the stacked matrix is registered under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProjectionGroup {
    /// Weight names, each `[K, M_i]` (ggml order) with the same `K`.
    pub parts: Vec<String>,
    /// The stacked `[K, sum M_i]` matrix's name (not a file tensor: made at load).
    pub merged: String,
}

impl ProjectionGroup {
    /// A group of `parts` stacked as `merged`.
    pub fn new(parts: &[String], merged: impl Into<String>) -> ProjectionGroup {
        ProjectionGroup { parts: parts.to_vec(), merged: merged.into() }
    }
}

/// Stacks each group's parts into its merged matrix ([`ModelWeights::merge_rows`]). A group whose
/// parts are missing, already windows of another stack, or do not stack (dtype, row length) is
/// left alone, so listing overlapping groups (the widest first) stacks the widest that fits.
pub fn merge_groups(
    weights: &mut ModelWeights,
    groups: &[ProjectionGroup],
    backend: &mut dyn Backend,
) -> Result<(), WeightsError> {
    for group in groups {
        let names: Vec<&str> = group.parts.iter().map(String::as_str).collect();
        weights.merge_rows(&names, &group.merged, backend)?;
    }
    Ok(())
}

/// Rows `first .. first + rows` of a `[total, n]` f32 product: one part of a projection group
/// that may have run as one matmul over stacked weights (or the routed slots of an id tensor;
/// any 4-byte element type).
#[derive(Debug, Clone, Copy)]
pub struct Rows {
    /// The `[total, n]` product (f32 or i32), contiguous.
    pub product: Tensor,
    /// The part's first row.
    pub first: usize,
    /// Rows of the product per token (`ne[0]`).
    pub total: usize,
}

impl Rows {
    /// All of a `[total, n]` tensor.
    pub fn whole(product: Tensor) -> Rows {
        Rows { product, first: 0, total: product.ne()[0] }
    }

    /// The part as `[rows, n]`, a view: tokens `total` elements apart.
    pub fn rows(self, g: &mut Graph, rows: usize) -> Result<Tensor, ModelError> {
        let (f, n) = (4, self.product.ne()[1]);
        let step = self.total * f;
        Ok(g.view(self.product, [rows, n, 1, 1], [f, step, step * n, step * n], self.first * f)?)
    }

    /// The part as `[a, b, n]` (`a b` rows: `b` heads of `a`), a view: tokens `total` elements
    /// apart.
    pub fn heads(self, g: &mut Graph, a: usize, b: usize) -> Result<Tensor, ModelError> {
        let (f, n) = (4, self.product.ne()[1]);
        let step = self.total * f;
        Ok(g.view(self.product, [a, b, n, 1], [f, a * f, step, step * n], self.first * f)?)
    }
}

/// The products of `x` (`[K, n]`) with the weights `names`: through `merged` when that stacked
/// matrix is resident (one matmul), else one matmul each. One [`Rows`] per name, in order.
pub fn project(
    b: &mut StepBuilder<'_>,
    x: Tensor,
    names: &[String],
    merged: Option<&str>,
) -> Result<Vec<Rows>, ModelError> {
    if let Some(m) = merged.filter(|m| b.has_weight(m)) {
        let w = b.param(m)?;
        let product = b.g.mul_mat(w, x)?;
        let total = product.ne()[0];
        let mut first = 0;
        let mut out = Vec::with_capacity(names.len());
        for name in names {
            let rows = b.weights().get(name)?.meta.ne[1];
            out.push(Rows { product, first, total });
            first += rows;
        }
        return Ok(out);
    }
    let mut out = Vec::with_capacity(names.len());
    for name in names {
        let w = b.param(name)?;
        let product = b.g.mul_mat(w, x)?;
        out.push(Rows::whole(product));
    }
    Ok(out)
}

/// [`project`] through a [`ProjectionGroup`].
pub fn project_group(b: &mut StepBuilder<'_>, x: Tensor, group: &ProjectionGroup) -> Result<Vec<Rows>, ModelError> {
    project(b, x, &group.parts, Some(&group.merged))
}
