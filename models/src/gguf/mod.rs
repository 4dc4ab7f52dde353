//! GGUF v3 reading and writing, as llama.cpp writes them, safe on hostile input.
//!
//! # Layout (all little-endian)
//!
//! ```text
//! magic            4 bytes  "GGUF"
//! version          u32      3 (2 is read too: same layout)
//! tensor_count     u64
//! metadata_kv_count u64
//! metadata kvs     key: string (u64 length + UTF-8 bytes), value type: u32, value
//! tensor infos     name: string, n_dims: u32 (1..=4), ne: u64 x n_dims (ggml order, ne[0]
//!                  first), ggml type: u32, offset: u64 (relative to the data section, a
//!                  multiple of the alignment)
//! padding          zeros to the next multiple of the alignment
//! data section     tensor bytes; each tensor padded with zeros to the alignment
//! ```
//!
//! Value types ([`ValueType`]): u8 0, i8 1, u16 2, i16 3, u32 4, i32 5, f32 6, bool 7 (one byte,
//! 0 or 1), string 8, array 9 (element type u32, count u64, elements; arrays nest), u64 10, i64
//! 11, f64 12. The alignment is the `general.alignment` kv (a `u32`, a nonzero power of two) or
//! [`DEFAULT_ALIGNMENT`] (32).
//!
//! # Safety on hostile input
//!
//! [`GgufFile`] validates every field before using it and reports a [`GgufError`] that names the
//! field and byte offset; it never panics or reads out of bounds. Counts and lengths are checked
//! against the bytes left before anything is reserved (a string of 2^60 bytes or an array of 2^50
//! elements fails at once), arrays nest at most [`MAX_ARRAY_DEPTH`] levels, keys and tensor names
//! are unique, dimensions are nonzero with rows of whole blocks and sizes computed with checked
//! arithmetic, and tensor ranges are aligned, inside the data section and disjoint. Unlike
//! llama.cpp, tensors need not be stored in info order or back to back.
//!
//! # Example
//!
//! ```
//! use tessera_models::gguf::{GgufFile, GgufWriter, Value};
//! use tessera_ops::DType;
//!
//! let mut w = GgufWriter::new();
//! w.add_kv("general.architecture", "qwen35")?;
//! w.add_kv("qwen35.block_count", 2u32)?;
//! w.add_kv("tokenizer.ggml.tokens", vec!["a", "b"])?;
//! let weights: Vec<u8> = [1.0f32, 2.0, 3.0].iter().flat_map(|x| x.to_le_bytes()).collect();
//! w.add_tensor("output_norm.weight", DType::F32, &[3], weights.clone())?;
//! let bytes = w.to_bytes()?;
//!
//! let f = GgufFile::from_bytes(bytes)?;
//! assert_eq!(f.get_str("general.architecture")?, "qwen35");
//! assert_eq!(f.get_usize("qwen35.block_count")?, 2);
//! assert_eq!(f.get_str_array("tokenizer.ggml.tokens")?, ["a", "b"]);
//! assert_eq!(f.tensors()[0].ne, [3, 1, 1, 1]);
//! assert_eq!(f.tensor_data("output_norm.weight")?, &weights[..]);
//! assert!(matches!(f.get("qwen35.block_count"), Some(Value::U32(2))));
//! # Ok::<(), tessera_models::gguf::GgufError>(())
//! ```

mod error;
mod read;
mod value;
mod write;

pub use error::{GgufError, Result};
pub use read::{GgufFile, TensorInfo};
pub use value::{Array, ArrayElement, Value, ValueType};
pub use write::GgufWriter;

/// The four magic bytes that start every GGUF file.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// The version the writer emits.
pub const GGUF_VERSION: u32 = 3;
/// The alignment when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: usize = 32;
/// The metadata key holding the alignment (a `u32`).
pub const ALIGNMENT_KEY: &str = "general.alignment";
/// The deepest nesting of arrays read or written (an array of arrays of scalars is depth 2).
pub const MAX_ARRAY_DEPTH: usize = 8;
