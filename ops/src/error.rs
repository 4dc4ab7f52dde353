//! Errors from building ops: every variant names the op and what was wrong with which input.

use crate::DType;

/// Why an op could not be built. Shapes print in ggml order (`ne[0]` first).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum OpError {
    #[error("{op}: expected {expected} inputs, got {got}")]
    Arity { op: &'static str, expected: &'static str, got: usize },

    #[error("{op}: input {input} has dtype {dtype}, expected {expected}")]
    DType { op: &'static str, input: usize, dtype: DType, expected: &'static str },

    #[error("{op}: shapes {lhs:?} and {rhs:?} are incompatible: {why}")]
    ShapeMismatch { op: &'static str, lhs: [usize; 4], rhs: [usize; 4], why: String },

    #[error("{op}: invalid shape {shape:?}: {why}")]
    InvalidShape { op: &'static str, shape: [usize; 4], why: String },

    #[error("{op}: invalid parameter: {why}")]
    InvalidParam { op: &'static str, why: String },

    #[error("{op}: input {input} (shape {shape:?}, strides {nb:?}) must be contiguous")]
    NotContiguous { op: &'static str, input: usize, shape: [usize; 4], nb: [usize; 4] },

    #[error(
        "{op}: view of shape {ne:?} strides {nb:?} at byte offset {offset} reaches byte {needed}, \
         but its source spans only {available} bytes"
    )]
    ViewOutOfRange { op: &'static str, ne: [usize; 4], nb: [usize; 4], offset: usize, needed: usize, available: usize },

    #[error("{op}: strides {nb:?} for shape {ne:?} make distinct elements share memory")]
    OverlappingStrides { op: &'static str, ne: [usize; 4], nb: [usize; 4] },

    #[error("{op}: tensor of shape {shape:?} and dtype {dtype} is too large to address")]
    TooLarge { op: &'static str, shape: [usize; 4], dtype: DType },
}

impl OpError {
    /// The name of the op the error is about.
    pub fn op(&self) -> &'static str {
        match self {
            OpError::Arity { op, .. }
            | OpError::DType { op, .. }
            | OpError::ShapeMismatch { op, .. }
            | OpError::InvalidShape { op, .. }
            | OpError::InvalidParam { op, .. }
            | OpError::NotContiguous { op, .. }
            | OpError::ViewOutOfRange { op, .. }
            | OpError::OverlappingStrides { op, .. }
            | OpError::TooLarge { op, .. } => op,
        }
    }
}
