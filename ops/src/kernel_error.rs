//! Errors that only the data can reveal (an op that was valid to build but got bad values).

/// A failure while computing an op, found in its input values.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum KernelError {
    #[error("{op}: index {index} is out of range 0..{limit} ({what})")]
    IndexOutOfRange { op: &'static str, index: i64, limit: usize, what: &'static str },

    #[error("{op}: not supported here: {why}")]
    Unsupported { op: &'static str, why: String },
}
