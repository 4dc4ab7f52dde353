//! The one error type of GGUF reading and writing.

use std::path::PathBuf;

/// Everything that can go wrong reading or writing a GGUF file.
///
/// Reader errors name the field (`what`) and, where the file is at fault, the byte offset at which
/// reading it began, so a hostile or corrupted file can be diagnosed from the message alone.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GgufError {
    /// Opening, mapping or writing a file failed.
    #[error("GGUF I/O error on {path}: {source}")]
    File {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// Writing to a caller's `Write` failed.
    #[error("GGUF I/O error: {0}")]
    Io(#[from] std::io::Error),
    /// The first four bytes are not `GGUF`.
    #[error("not a GGUF file: magic is {found:02x?}, expected \"GGUF\" (47 47 55 46)")]
    BadMagic { found: [u8; 4] },
    /// A version other than 2 or 3 (version 1 used 32-bit counts; big-endian files read as a
    /// byte-swapped version).
    #[error("unsupported GGUF version {version} (supported: 2 and 3, little-endian){hint}")]
    UnsupportedVersion { version: u32, hint: &'static str },
    /// The file ends inside a field.
    #[error("truncated GGUF: {what} at byte {offset} needs {need} bytes, only {available} left")]
    Truncated { what: String, offset: u64, need: u64, available: u64 },
    /// A count or length larger than the rest of the file could possibly hold (or than a limit).
    #[error("GGUF {what} is too large: {value} (at most {max} possible here)")]
    TooLarge { what: String, value: u64, max: u64 },
    /// A string that is not UTF-8.
    #[error("GGUF {what} at byte {offset} is not valid UTF-8")]
    InvalidUtf8 { what: String, offset: u64 },
    /// A bool byte other than 0 or 1.
    #[error("GGUF {what} at byte {offset} is an invalid bool byte {byte:#04x} (must be 0 or 1)")]
    InvalidBool { what: String, offset: u64, byte: u8 },
    /// A metadata key that appears twice.
    #[error("duplicate GGUF metadata key `{key}`")]
    DuplicateKey { key: String },
    /// A tensor name that appears twice.
    #[error("duplicate GGUF tensor name `{name}`")]
    DuplicateTensor { name: String },
    /// A metadata value type id outside 0..=12.
    #[error("unknown GGUF value type {type_id} for {what} at byte {offset}")]
    UnknownValueType { what: String, type_id: u32, offset: u64 },
    /// Arrays nested deeper than [`super::MAX_ARRAY_DEPTH`].
    #[error("GGUF {what}: arrays nested deeper than {max} levels")]
    NestingTooDeep { what: String, max: usize },
    /// A ggml tensor type id that Tessera does not support.
    #[error("GGUF tensor `{name}` has ggml type id {type_id}, which Tessera does not support")]
    UnknownTensorType { name: String, type_id: u32 },
    /// Bad tensor dimensions: `n_dims` outside 1..=4, a zero dimension, a row that is not whole
    /// blocks, or a byte size that overflows.
    #[error("GGUF tensor `{name}` has bad dimensions: {reason}")]
    BadDims { name: String, reason: String },
    /// `general.alignment` that is zero or not a power of two.
    #[error("GGUF general.alignment is {value}; it must be a nonzero power of two")]
    BadAlignment { value: u64 },
    /// A tensor data offset that is not a multiple of the alignment.
    #[error("GGUF tensor `{name}` data offset {offset} is not a multiple of the alignment {alignment}")]
    Misaligned { name: String, offset: u64, alignment: u64 },
    /// A tensor whose bytes do not lie inside the data section.
    #[error("GGUF tensor `{name}` bytes [{offset}, {offset}+{size}) lie outside the data section of {data_len} bytes")]
    OutOfBounds { name: String, offset: u64, size: u64, data_len: u64 },
    /// Two tensors whose byte ranges overlap.
    #[error("GGUF tensors `{first}` [{first_start}, {first_end}) and `{second}` (from {second_start}) overlap")]
    Overlap { first: String, first_start: u64, first_end: u64, second: String, second_start: u64 },
    /// A metadata key that is not present.
    #[error("GGUF metadata key `{key}` is missing")]
    MissingKey { key: String },
    /// A metadata value of another type than the getter asked for.
    #[error("GGUF metadata key `{key}` has type {found}, expected {expected}")]
    WrongType { key: String, expected: &'static str, found: String },
    /// A metadata number that does not fit the requested type (e.g. a negative count).
    #[error("GGUF metadata key `{key}` value {value} does not fit {target}")]
    OutOfRange { key: String, value: String, target: &'static str },
    /// A tensor name that is not present.
    #[error("GGUF tensor `{name}` is missing")]
    MissingTensor { name: String },
    /// Writer: tensor bytes of another length than dtype and shape require.
    #[error("GGUF tensor `{name}` needs {expected} bytes for its dtype and shape, got {got}")]
    SizeMismatch { name: String, expected: u64, got: u64 },
}

/// Shorthand for results of this module.
pub type Result<T, E = GgufError> = std::result::Result<T, E>;
