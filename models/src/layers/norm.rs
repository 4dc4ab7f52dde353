//! Norms and the embedding lookup: the small pieces every family's trunk is made of.

use tessera_graph::Tensor;

use crate::arch::StepBuilder;
use crate::model::ModelError;

/// `rms_norm(x) * w` with the resident weight `weight` (`[ne0]`, broadcast over the other
/// dimensions of `x`): each row of `ne[0]` elements divided by `sqrt(mean(x^2) + eps)`, then
/// scaled per element.
pub fn rms_norm(b: &mut StepBuilder<'_>, x: Tensor, weight: &str, eps: f32) -> Result<Tensor, ModelError> {
    let w = b.param(weight)?;
    let h = b.g.rms_norm(x, eps)?;
    Ok(b.g.mul(h, w)?)
}

/// The rows of the embedding matrix `weight` (`[n_embd, n_vocab]`, any weight dtype) for the
/// step's tokens: f32 `[n_embd, n_tokens]`, column `j` the packed token `j`.
pub fn token_embedding(b: &mut StepBuilder<'_>, weight: &str) -> Result<Tensor, ModelError> {
    let w = b.param(weight)?;
    let tokens = b.leaves().tokens;
    Ok(b.g.get_rows(w, tokens)?)
}
