//! The reader: parse and validate every field before anything is used.

use std::collections::HashMap;
use std::fmt;
use std::path::Path;
use std::sync::Arc;

use tessera_ops::{DType, MAX_DIMS};

use super::error::{GgufError, Result};
use super::value::{Array, ArrayElement, Value, ValueType};
use super::{ALIGNMENT_KEY, DEFAULT_ALIGNMENT, GGUF_MAGIC, MAX_ARRAY_DEPTH};

/// Fewest bytes one metadata kv can take: key length (8), value type (4), a one-byte value.
const MIN_KV_BYTES: usize = 8 + 4 + 1;
/// Fewest bytes one tensor info can take: name length (8), n_dims (4), one dim (8), type (4),
/// offset (8).
const MIN_TENSOR_INFO_BYTES: usize = 8 + 4 + 8 + 4 + 8;
/// Largest capacity reserved up front for a list whose elements are parsed one by one (strings,
/// nested arrays, kvs, tensor infos); beyond it the list grows only as elements actually parse.
const MAX_RESERVE: usize = 1 << 16;

/// One tensor of a GGUF file, validated: its bytes lie inside the data section, aligned, and
/// overlap no other tensor's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: DType,
    /// The number of dimensions written in the file (1..=4).
    pub n_dims: usize,
    /// Elements per dimension in ggml order (`ne[0]` innermost), padded with 1s to 4. Every entry
    /// is at least 1 and `ne[0]` is a whole number of `dtype` blocks.
    pub ne: [usize; MAX_DIMS],
    /// Byte offset of the data, relative to the start of the data section (a multiple of the
    /// alignment).
    pub offset: u64,
    /// Byte size of the data (`dtype.row_bytes(ne[0]) * ne[1] * ne[2] * ne[3]`).
    pub size: usize,
}

impl TensorInfo {
    /// The dimensions as written in the file (`ne[..n_dims]`).
    pub fn dims(&self) -> &[usize] {
        &self.ne[..self.n_dims]
    }

    /// The number of logical elements.
    pub fn n_elements(&self) -> usize {
        // Cannot overflow: the byte size is at most isize::MAX (checked at parse time) and every
        // dtype stores at least 36 bytes per 64 elements, so the count is below usize::MAX.
        self.ne.iter().product()
    }
}

/// The bytes behind a [`GgufFile`].
enum Storage {
    Mmap(memmap2::Mmap),
    Shared(Arc<[u8]>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mmap(m) => m,
            Storage::Shared(b) => b,
        }
    }
}

/// A parsed, validated GGUF file (v2 or v3, little-endian).
///
/// Every count, length, type id, dimension, offset and range was checked when the file was opened,
/// so [`GgufFile::tensor_data`] cannot read out of bounds. Tensor slices from
/// [`GgufFile::from_bytes`] are not necessarily aligned in memory beyond 8 bytes; those of
/// [`GgufFile::open`] are aligned to the file's alignment (the map starts on a page).
pub struct GgufFile {
    storage: Storage,
    version: u32,
    metadata: Vec<(String, Value)>,
    key_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    alignment: usize,
    data_offset: usize,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("alignment", &self.alignment)
            .field("data_offset", &self.data_offset)
            .finish()
    }
}

impl GgufFile {
    /// Maps and parses the file at `path`, which must be a regular file (a directory, FIFO or
    /// device is an error naming what it is, and a FIFO never blocks: [`tessera_files::open_input`]).
    ///
    /// The file is memory-mapped, not read: the usual mmap caveat applies. If another process
    /// truncates or rewrites the file while it is mapped, tensor bytes may change under the reader
    /// (after validation) or touching them may raise SIGBUS. Don't modify model files in place
    /// while they are open.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        let file_err = |source| GgufError::File { path: path.to_path_buf(), source };
        let file = tessera_files::open_input(path).map_err(file_err)?;
        // SAFETY: the map is only read, and every access goes through ranges validated against its
        // length at parse time. Soundness relies on the file not being truncated or modified while
        // mapped (documented on this function), which Rust cannot enforce for files.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(file_err)?;
        GgufFile::from_storage(Storage::Mmap(map))
    }

    /// Parses a GGUF file held in memory.
    pub fn from_bytes(bytes: impl Into<Arc<[u8]>>) -> Result<GgufFile> {
        GgufFile::from_storage(Storage::Shared(bytes.into()))
    }

    fn from_storage(storage: Storage) -> Result<GgufFile> {
        let p = parse(storage.bytes())?;
        Ok(GgufFile {
            storage,
            version: p.version,
            metadata: p.metadata,
            key_index: p.key_index,
            tensors: p.tensors,
            tensor_index: p.tensor_index,
            alignment: p.alignment,
            data_offset: p.data_offset,
        })
    }

    /// The format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The alignment of the data section and of every tensor offset (`general.alignment`, or 32).
    pub fn alignment(&self) -> usize {
        self.alignment
    }

    /// The absolute file offset of the data section (a multiple of the alignment).
    pub fn data_offset(&self) -> usize {
        self.data_offset
    }

    /// The whole file.
    pub fn bytes(&self) -> &[u8] {
        self.storage.bytes()
    }

    /// Every metadata kv, in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }

    /// The value of `key`, if present.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.key_index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// The value of `key`, or [`GgufError::MissingKey`].
    pub fn value(&self, key: &str) -> Result<&Value> {
        self.get(key).ok_or_else(|| GgufError::MissingKey { key: key.to_string() })
    }

    /// Every tensor, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The tensor called `name`, if present.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The bytes of the tensor called `name`.
    pub fn tensor_data(&self, name: &str) -> Result<&[u8]> {
        let info = self.tensor(name).ok_or_else(|| GgufError::MissingTensor { name: name.to_string() })?;
        Ok(self.info_data(info))
    }

    /// The bytes of one of this file's own tensor infos.
    fn info_data(&self, info: &TensorInfo) -> &[u8] {
        // In range: `info` comes from `self.tensors`, and `parse` checked offset + size <= data length.
        let start = self.data_offset + info.offset as usize;
        &self.bytes()[start..start + info.size]
    }

    fn typed<'s, T>(&'s self, key: &str, expected: &'static str, f: impl FnOnce(&'s Value) -> Option<T>) -> Result<T> {
        let v = self.value(key)?;
        f(v).ok_or_else(|| GgufError::WrongType { key: key.to_string(), expected, found: v.type_description() })
    }
}

macro_rules! strict_getters {
    ($($(#[$doc:meta])* $fn:ident -> $t:ty = $variant:ident),* $(,)?) => {
        impl GgufFile {$(
            $(#[$doc])*
            pub fn $fn(&self, key: &str) -> Result<$t> {
                self.typed(key, ValueType::$variant.name(), |v| match v {
                    Value::$variant(x) => Some(*x),
                    _ => None,
                })
            }
        )*}
    };
}

strict_getters!(
    /// The `u8` value of `key` (no other type accepted).
    get_u8 -> u8 = U8,
    /// The `i8` value of `key` (no other type accepted).
    get_i8 -> i8 = I8,
    /// The `u16` value of `key` (no other type accepted).
    get_u16 -> u16 = U16,
    /// The `i16` value of `key` (no other type accepted).
    get_i16 -> i16 = I16,
    /// The `u32` value of `key` (no other type accepted; see [`GgufFile::get_usize`]).
    get_u32 -> u32 = U32,
    /// The `i32` value of `key` (no other type accepted).
    get_i32 -> i32 = I32,
    /// The `f32` value of `key` (no other type accepted; see [`GgufFile::get_float`]).
    get_f32 -> f32 = F32,
    /// The `bool` value of `key`.
    get_bool -> bool = Bool,
    /// The `u64` value of `key` (no other type accepted).
    get_u64 -> u64 = U64,
    /// The `i64` value of `key` (no other type accepted).
    get_i64 -> i64 = I64,
    /// The `f64` value of `key` (no other type accepted).
    get_f64 -> f64 = F64,
);

impl GgufFile {
    /// The string value of `key`.
    pub fn get_str(&self, key: &str) -> Result<&str> {
        self.typed(key, "string", Value::as_str)
    }

    /// The array value of `key`, of any element type.
    pub fn get_array(&self, key: &str) -> Result<&Array> {
        self.typed(key, "array", Value::as_array)
    }

    /// The elements of the array `key`, which must have element type `T`
    /// (`get_array_of::<u32>`, `get_array_of::<String>`, `get_array_of::<Array>` for nested).
    pub fn get_array_of<T: ArrayElement>(&self, key: &str) -> Result<&[T]> {
        let expected = match T::TYPE {
            ValueType::U8 => "array of u8",
            ValueType::I8 => "array of i8",
            ValueType::U16 => "array of u16",
            ValueType::I16 => "array of i16",
            ValueType::U32 => "array of u32",
            ValueType::I32 => "array of i32",
            ValueType::F32 => "array of f32",
            ValueType::Bool => "array of bool",
            ValueType::String => "array of string",
            ValueType::Array => "array of array",
            ValueType::U64 => "array of u64",
            ValueType::I64 => "array of i64",
            ValueType::F64 => "array of f64",
        };
        self.typed(key, expected, |v| v.as_array().and_then(T::slice))
    }

    /// The string array `key` (e.g. `tokenizer.ggml.tokens`).
    pub fn get_str_array(&self, key: &str) -> Result<&[String]> {
        self.get_array_of(key)
    }

    /// The `f32` array `key`.
    pub fn get_f32_array(&self, key: &str) -> Result<&[f32]> {
        self.get_array_of(key)
    }

    /// The `i32` array `key`.
    pub fn get_i32_array(&self, key: &str) -> Result<&[i32]> {
        self.get_array_of(key)
    }

    /// The `u32` array `key`.
    pub fn get_u32_array(&self, key: &str) -> Result<&[u32]> {
        self.get_array_of(key)
    }

    /// Tolerant: a count or size stored as any integer type (u8..u64, i8..i64) that is
    /// non-negative and fits a `usize`, as llama.cpp accepts u32 or u64 for most counts.
    pub fn get_usize(&self, key: &str) -> Result<usize> {
        let i = self.typed(key, "integer", Value::as_int)?;
        usize::try_from(i).map_err(|_| out_of_range(key, i, "usize"))
    }

    /// [`GgufFile::get_usize`] for an optional key: `Ok(None)` when absent.
    pub fn get_usize_opt(&self, key: &str) -> Result<Option<usize>> {
        self.get(key).map(|_| self.get_usize(key)).transpose()
    }

    /// Tolerant: any integer type whose value fits an `i64`.
    pub fn get_int(&self, key: &str) -> Result<i64> {
        let i = self.typed(key, "integer", Value::as_int)?;
        i64::try_from(i).map_err(|_| out_of_range(key, i, "i64"))
    }

    /// Tolerant: `f32` or `f64`, widened to `f64`.
    pub fn get_float(&self, key: &str) -> Result<f64> {
        self.typed(key, "f32 or f64", Value::as_float)
    }

    /// [`GgufFile::get_float`] for an optional key: `Ok(None)` when absent.
    pub fn get_float_opt(&self, key: &str) -> Result<Option<f64>> {
        self.get(key).map(|_| self.get_float(key)).transpose()
    }

    /// Tolerant: an array of any integer type whose elements are non-negative and fit `usize`
    /// (e.g. per-layer head counts, rope sections). The result has the array's length, which the
    /// file's size bounds; use [`GgufFile::get_usize_array_max`] where the caller knows a bound.
    pub fn get_usize_array(&self, key: &str) -> Result<Vec<usize>> {
        self.get_usize_array_max(key, usize::MAX)
    }

    /// [`GgufFile::get_usize_array`] for an array of at most `max_len` elements: a longer one is
    /// [`GgufError::TooLarge`] before anything is converted or allocated.
    pub fn get_usize_array_max(&self, key: &str, max_len: usize) -> Result<Vec<usize>> {
        let arr = self.get_array(key)?;
        if arr.len() > max_len {
            return Err(GgufError::TooLarge {
                what: format!("array `{key}`"),
                value: arr.len() as u64,
                max: max_len as u64,
            });
        }
        let ints = self.typed(key, "array of integers", |v| v.as_array().and_then(Array::to_ints))?;
        ints.into_iter().map(|i| usize::try_from(i).map_err(|_| out_of_range(key, i, "usize"))).collect()
    }
}

fn out_of_range(key: &str, value: i128, target: &'static str) -> GgufError {
    GgufError::OutOfRange { key: key.to_string(), value: value.to_string(), target }
}

/// Everything `parse` extracts; owns its data so it can sit next to the storage it came from.
struct Parsed {
    version: u32,
    metadata: Vec<(String, Value)>,
    key_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    alignment: usize,
    data_offset: usize,
}

/// A bounds-checked little-endian reader. `ctx` names the item being read (a kv, a tensor info)
/// for error messages; fields name themselves.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    ctx: String,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn what(&self, field: impl fmt::Display) -> String {
        format!("{field} of {}", self.ctx)
    }

    fn take(&mut self, n: u64, field: impl fmt::Display) -> Result<&'a [u8]> {
        let available = self.remaining();
        match usize::try_from(n) {
            Ok(n) if n <= available => {
                let s = &self.buf[self.pos..self.pos + n];
                self.pos += n;
                Ok(s)
            }
            _ => Err(GgufError::Truncated {
                what: self.what(field),
                offset: self.pos as u64,
                need: n,
                available: available as u64,
            }),
        }
    }

    fn array<const N: usize>(&mut self, field: impl fmt::Display) -> Result<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N as u64, field)?);
        Ok(a)
    }

    fn u32(&mut self, field: impl fmt::Display) -> Result<u32> {
        self.array(field).map(u32::from_le_bytes)
    }

    fn u64(&mut self, field: impl fmt::Display) -> Result<u64> {
        self.array(field).map(u64::from_le_bytes)
    }

    fn string(&mut self, field: &str) -> Result<String> {
        let len = self.u64(format_args!("{field} length"))?;
        let start = self.pos as u64;
        let bytes = self.take(len, field)?;
        std::str::from_utf8(bytes)
            .map(str::to_string)
            .map_err(|_| GgufError::InvalidUtf8 { what: self.what(field), offset: start })
    }

    fn bool(&mut self, field: &str) -> Result<bool> {
        let offset = self.pos as u64;
        match self.array::<1>(field)?[0] {
            0 => Ok(false),
            1 => Ok(true),
            byte => Err(GgufError::InvalidBool { what: self.what(field), offset, byte }),
        }
    }

    fn value_type(&mut self, field: impl fmt::Display + Copy) -> Result<ValueType> {
        let offset = self.pos as u64;
        let type_id = self.u32(field)?;
        ValueType::from_id(type_id).ok_or_else(|| GgufError::UnknownValueType {
            what: self.what(field),
            type_id,
            offset,
        })
    }

    fn value(&mut self, ty: ValueType) -> Result<Value> {
        Ok(match ty {
            ValueType::U8 => Value::U8(u8::from_le_bytes(self.array("value")?)),
            ValueType::I8 => Value::I8(i8::from_le_bytes(self.array("value")?)),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array("value")?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array("value")?)),
            ValueType::U32 => Value::U32(u32::from_le_bytes(self.array("value")?)),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array("value")?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array("value")?)),
            ValueType::Bool => Value::Bool(self.bool("value")?),
            ValueType::String => Value::String(self.string("value")?),
            ValueType::Array => Value::Array(self.array_value(1)?),
            ValueType::U64 => Value::U64(u64::from_le_bytes(self.array("value")?)),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array("value")?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array("value")?)),
        })
    }

    /// Reads an array header and its elements; `depth` is 1 for a top-level array.
    fn array_value(&mut self, depth: usize) -> Result<Array> {
        let elem = self.value_type(format_args!("array element type (depth {depth})"))?;
        if elem == ValueType::Array && depth >= MAX_ARRAY_DEPTH {
            return Err(GgufError::NestingTooDeep { what: self.ctx.clone(), max: MAX_ARRAY_DEPTH });
        }
        let n = self.u64(format_args!("array length (depth {depth})"))?;
        // Bound the count by what the rest of the file could hold before reserving anything.
        let max = (self.remaining() / elem.min_size()) as u64;
        if n > max {
            let what = self.what(format_args!("array length (depth {depth})"));
            return Err(GgufError::TooLarge { what, value: n, max });
        }
        let n = n as usize; // <= remaining bytes, so it fits.
        Ok(match elem {
            ValueType::U8 => Array::U8(self.take(n as u64, "u8 array")?.to_vec()),
            ValueType::I8 => Array::I8(self.fixed(n, "i8 array", i8::from_le_bytes)?),
            ValueType::U16 => Array::U16(self.fixed(n, "u16 array", u16::from_le_bytes)?),
            ValueType::I16 => Array::I16(self.fixed(n, "i16 array", i16::from_le_bytes)?),
            ValueType::U32 => Array::U32(self.fixed(n, "u32 array", u32::from_le_bytes)?),
            ValueType::I32 => Array::I32(self.fixed(n, "i32 array", i32::from_le_bytes)?),
            ValueType::F32 => Array::F32(self.fixed(n, "f32 array", f32::from_le_bytes)?),
            ValueType::U64 => Array::U64(self.fixed(n, "u64 array", u64::from_le_bytes)?),
            ValueType::I64 => Array::I64(self.fixed(n, "i64 array", i64::from_le_bytes)?),
            ValueType::F64 => Array::F64(self.fixed(n, "f64 array", f64::from_le_bytes)?),
            ValueType::Bool => Array::Bool((0..n).map(|_| self.bool("bool array element")).collect::<Result<_>>()?),
            ValueType::String => {
                let mut v = Vec::with_capacity(n.min(MAX_RESERVE));
                for _ in 0..n {
                    v.push(self.string("string array element")?);
                }
                Array::String(v)
            }
            ValueType::Array => {
                let mut v = Vec::with_capacity(n.min(MAX_RESERVE));
                for _ in 0..n {
                    v.push(self.array_value(depth + 1)?);
                }
                Array::Array(v)
            }
        })
    }

    /// `n` fixed-size little-endian elements (`n * N` was bounded by the bytes left).
    fn fixed<T, const N: usize>(&mut self, n: usize, field: &str, f: fn([u8; N]) -> T) -> Result<Vec<T>> {
        let total = (n as u64).saturating_mul(N as u64);
        let bytes = self.take(total, field)?;
        Ok(bytes
            .chunks_exact(N)
            .map(|c| {
                let mut a = [0u8; N];
                a.copy_from_slice(c);
                f(a)
            })
            .collect())
    }
}

fn parse(buf: &[u8]) -> Result<Parsed> {
    let mut c = Cursor { buf, pos: 0, ctx: "header".to_string() };
    let magic = c.array::<4>("magic")?;
    if magic != GGUF_MAGIC {
        return Err(GgufError::BadMagic { found: magic });
    }
    let version = c.u32("version")?;
    if !matches!(version, 2 | 3) {
        let hint = match version {
            1 => " (version 1 used 32-bit counts and lengths)",
            v if matches!(v.swap_bytes(), 1..=3) => " (this looks like a big-endian file)",
            _ => "",
        };
        return Err(GgufError::UnsupportedVersion { version, hint });
    }
    let tensor_count = c.u64("tensor count")?;
    let kv_count = c.u64("metadata kv count")?;
    let max_kvs = (c.remaining() / MIN_KV_BYTES) as u64;
    if kv_count > max_kvs {
        return Err(GgufError::TooLarge { what: "metadata kv count".into(), value: kv_count, max: max_kvs });
    }

    let mut metadata = Vec::with_capacity((kv_count as usize).min(MAX_RESERVE));
    let mut key_index = HashMap::new();
    for i in 0..kv_count {
        c.ctx = format!("metadata kv #{i}");
        let key = c.string("key")?;
        c.ctx = format!("metadata kv #{i} `{key}`");
        let ty = c.value_type("value type")?;
        let value = c.value(ty)?;
        if key_index.insert(key.clone(), metadata.len()).is_some() {
            return Err(GgufError::DuplicateKey { key });
        }
        metadata.push((key, value));
    }

    let alignment = match key_index.get(ALIGNMENT_KEY).map(|&i| &metadata[i].1) {
        None => DEFAULT_ALIGNMENT,
        Some(&Value::U32(a)) if a.is_power_of_two() => a as usize,
        Some(&Value::U32(a)) => return Err(GgufError::BadAlignment { value: a.into() }),
        Some(v) => {
            return Err(GgufError::WrongType {
                key: ALIGNMENT_KEY.into(),
                expected: "u32",
                found: v.type_description(),
            });
        }
    };

    let max_tensors = (c.remaining() / MIN_TENSOR_INFO_BYTES) as u64;
    if tensor_count > max_tensors {
        return Err(GgufError::TooLarge { what: "tensor count".into(), value: tensor_count, max: max_tensors });
    }
    let mut tensors = Vec::with_capacity((tensor_count as usize).min(MAX_RESERVE));
    let mut tensor_index = HashMap::new();
    for i in 0..tensor_count {
        c.ctx = format!("tensor info #{i}");
        let name = c.string("name")?;
        c.ctx = format!("tensor info #{i} `{name}`");
        let info = tensor_info(&mut c, name)?;
        if tensor_index.insert(info.name.clone(), tensors.len()).is_some() {
            return Err(GgufError::DuplicateTensor { name: info.name });
        }
        tensors.push(info);
    }

    // The data section starts at the next multiple of the alignment.
    let header_end = c.pos;
    let data_offset = header_end.div_ceil(alignment).saturating_mul(alignment);
    if !tensors.is_empty() && data_offset > buf.len() {
        return Err(GgufError::Truncated {
            what: "padding before the tensor data section".into(),
            offset: header_end as u64,
            need: (data_offset - header_end) as u64,
            available: (buf.len() - header_end) as u64,
        });
    }
    let data_len = buf.len().saturating_sub(data_offset) as u64;
    for t in &tensors {
        if !t.offset.is_multiple_of(alignment as u64) {
            return Err(GgufError::Misaligned { name: t.name.clone(), offset: t.offset, alignment: alignment as u64 });
        }
        let size = t.size as u64;
        if t.offset.checked_add(size).is_none_or(|end| end > data_len) {
            return Err(GgufError::OutOfBounds { name: t.name.clone(), offset: t.offset, size, data_len });
        }
    }
    let mut order: Vec<&TensorInfo> = tensors.iter().collect();
    order.sort_by_key(|t| t.offset);
    for w in order.windows(2) {
        let (a, b) = (w[0], w[1]);
        let a_end = a.offset + a.size as u64; // checked above
        if a_end > b.offset {
            return Err(GgufError::Overlap {
                first: a.name.clone(),
                first_start: a.offset,
                first_end: a_end,
                second: b.name.clone(),
                second_start: b.offset,
            });
        }
    }

    Ok(Parsed { version, metadata, key_index, tensors, tensor_index, alignment, data_offset })
}

/// Reads the rest of one tensor info (after its name) and computes its byte size.
fn tensor_info(c: &mut Cursor<'_>, name: String) -> Result<TensorInfo> {
    let bad = |reason: String| GgufError::BadDims { name: name.clone(), reason };
    let n_dims = c.u32("n_dims")?;
    if n_dims == 0 || n_dims as usize > MAX_DIMS {
        return Err(bad(format!("n_dims is {n_dims}, must be 1..={MAX_DIMS}")));
    }
    let n_dims = n_dims as usize;
    let mut ne = [1usize; MAX_DIMS];
    for (d, slot) in ne.iter_mut().enumerate().take(n_dims) {
        let v = c.u64(format_args!("dim {d}"))?;
        if v == 0 {
            return Err(bad(format!("ne[{d}] is 0")));
        }
        *slot = usize::try_from(v).map_err(|_| bad(format!("ne[{d}] = {v} does not fit usize")))?;
    }
    let type_id = c.u32("ggml type")?;
    let dtype =
        DType::from_ggml_id(type_id).ok_or_else(|| GgufError::UnknownTensorType { name: name.clone(), type_id })?;
    let offset = c.u64("data offset")?;
    let size = tensor_size(dtype, &ne).map_err(bad)?;
    Ok(TensorInfo { name, dtype, n_dims, ne, offset, size })
}

/// The byte size of a tensor of `dtype` and shape `ne`, with every step checked.
pub(crate) fn tensor_size(dtype: DType, ne: &[usize; MAX_DIMS]) -> std::result::Result<usize, String> {
    if !ne[0].is_multiple_of(dtype.block_size()) {
        return Err(format!("ne[0] = {} is not a whole number of {dtype} blocks of {}", ne[0], dtype.block_size()));
    }
    let overflow = || format!("byte size of {dtype} {ne:?} overflows");
    let row = dtype.row_bytes(ne[0]).ok_or_else(overflow)?;
    let size = ne[1..].iter().try_fold(row, |acc, &n| acc.checked_mul(n)).ok_or_else(overflow)?;
    // Offsets and ends are u64 and slices are indexed by isize-bounded lengths.
    if size > isize::MAX as usize {
        return Err(overflow());
    }
    Ok(size)
}
