//! The writer: metadata and tensors in insertion order, tensor data aligned and padded like
//! llama.cpp writes it.

use std::collections::HashSet;
use std::io::{self, Write};
use std::path::Path;

use tessera_files::AtomicFile;
use tessera_ops::{DType, MAX_DIMS};

use super::error::{GgufError, Result};
use super::read::{GgufFile, tensor_size};
use super::value::{Array, Value};
use super::{ALIGNMENT_KEY, DEFAULT_ALIGNMENT, GGUF_MAGIC, GGUF_VERSION, MAX_ARRAY_DEPTH};

/// A tensor to be written: its bytes now ([`GgufWriter::add_tensor`]) or later, streamed
/// ([`GgufWriter::add_tensor_info`] + [`GgufWriter::write_with`]).
#[derive(Debug, Clone)]
struct PendingTensor {
    name: String,
    dtype: DType,
    dims: Vec<usize>,
    size: usize,
    data: Option<Vec<u8>>,
}

/// Builds a GGUF v3 file. Output is deterministic: kvs and tensors in insertion order, tensor
/// offsets assigned in order, each tensor's data padded with zeros to the alignment (so the data
/// section ends aligned too), as llama.cpp's `gguf_write_to_file` does.
///
/// The alignment is `general.alignment` if that kv was added (it must be a `u32` nonzero power of
/// two), else 32.
#[derive(Debug, Clone, Default)]
pub struct GgufWriter {
    metadata: Vec<(String, Value)>,
    keys: HashSet<String>,
    tensors: Vec<PendingTensor>,
    names: HashSet<String>,
}

impl GgufWriter {
    /// An empty file: no metadata, no tensors.
    pub fn new() -> GgufWriter {
        GgufWriter::default()
    }

    /// A writer holding a copy of `file`'s metadata and tensors (with their bytes), in file order;
    /// writing it re-lays the tensors back to back, so a file laid out like llama.cpp's comes out
    /// byte for byte the same.
    pub fn from_file(file: &GgufFile) -> Result<GgufWriter> {
        let mut w = GgufWriter::new();
        for (k, v) in file.metadata() {
            w.add_kv(k.clone(), v.clone())?;
        }
        for t in file.tensors() {
            w.add_tensor(t.name.clone(), t.dtype, t.dims(), file.tensor_data(&t.name)?)?;
        }
        Ok(w)
    }

    /// Adds a metadata kv (`add_kv("qwen35.block_count", 40u32)`, `add_kv("general.name", "x")`).
    /// Errors on a duplicate key, arrays nested deeper than [`MAX_ARRAY_DEPTH`], or a bad
    /// `general.alignment`.
    pub fn add_kv(&mut self, key: impl Into<String>, value: impl Into<Value>) -> Result<&mut Self> {
        let key = key.into();
        let value = value.into();
        check_value(&key, &value)?;
        if self.keys.contains(&key) {
            return Err(GgufError::DuplicateKey { key });
        }
        self.keys.insert(key.clone());
        self.metadata.push((key, value));
        Ok(self)
    }

    /// Sets `general.alignment` (adding the kv, or replacing its value in place).
    pub fn set_alignment(&mut self, alignment: u32) -> Result<&mut Self> {
        let value = Value::U32(alignment);
        check_value(ALIGNMENT_KEY, &value)?;
        match self.metadata.iter_mut().find(|(k, _)| k == ALIGNMENT_KEY) {
            Some((_, v)) => *v = value,
            None => {
                self.add_kv(ALIGNMENT_KEY, value)?;
            }
        }
        Ok(self)
    }

    /// The alignment the file will be written with.
    pub fn alignment(&self) -> usize {
        match self.metadata.iter().find(|(k, _)| k == ALIGNMENT_KEY) {
            Some((_, Value::U32(a))) => *a as usize,
            _ => DEFAULT_ALIGNMENT,
        }
    }

    /// Adds a tensor with its bytes. `dims` is in ggml order (`ne[0]` first), 1 to 4 entries, each
    /// at least 1, `dims[0]` a whole number of blocks; `data` must be exactly the dtype's size.
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        dtype: DType,
        dims: &[usize],
        data: impl Into<Vec<u8>>,
    ) -> Result<&mut Self> {
        let name = name.into();
        let data = data.into();
        let size = checked_size(&name, dtype, dims)?;
        if data.len() != size {
            return Err(GgufError::SizeMismatch { name, expected: size as u64, got: data.len() as u64 });
        }
        self.push_tensor(PendingTensor { name, dtype, dims: dims.to_vec(), size, data: Some(data) })
    }

    /// Adds a tensor whose bytes [`GgufWriter::write_with`] will ask for when writing, in order.
    pub fn add_tensor_info(&mut self, name: impl Into<String>, dtype: DType, dims: &[usize]) -> Result<&mut Self> {
        let name = name.into();
        let size = checked_size(&name, dtype, dims)?;
        self.push_tensor(PendingTensor { name, dtype, dims: dims.to_vec(), size, data: None })
    }

    fn push_tensor(&mut self, t: PendingTensor) -> Result<&mut Self> {
        if self.names.contains(&t.name) {
            return Err(GgufError::DuplicateTensor { name: t.name });
        }
        self.names.insert(t.name.clone());
        self.tensors.push(t);
        Ok(self)
    }

    /// Each tensor's data offset relative to the data section, in insertion order.
    pub fn tensor_offsets(&self) -> Result<Vec<u64>> {
        let align = self.alignment() as u64;
        let mut offsets = Vec::with_capacity(self.tensors.len());
        let mut next = 0u64;
        for t in &self.tensors {
            offsets.push(next);
            let padded = (t.size as u64).div_ceil(align).checked_mul(align);
            next = padded.and_then(|p| next.checked_add(p)).ok_or_else(|| GgufError::TooLarge {
                what: "total tensor data".into(),
                value: u64::MAX,
                max: u64::MAX,
            })?;
        }
        Ok(offsets)
    }

    /// The header: magic through tensor infos, padded to the alignment (the data section start).
    fn header(&self) -> Result<Vec<u8>> {
        let mut b = Vec::new();
        b.extend_from_slice(&GGUF_MAGIC);
        b.extend_from_slice(&GGUF_VERSION.to_le_bytes());
        b.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        b.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            put_str(&mut b, k);
            b.extend_from_slice(&v.value_type().id().to_le_bytes());
            put_value(&mut b, v);
        }
        for (t, offset) in self.tensors.iter().zip(self.tensor_offsets()?) {
            put_str(&mut b, &t.name);
            b.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for &d in &t.dims {
                b.extend_from_slice(&(d as u64).to_le_bytes());
            }
            b.extend_from_slice(&t.dtype.ggml_id().to_le_bytes());
            b.extend_from_slice(&offset.to_le_bytes());
        }
        b.resize(b.len().next_multiple_of(self.alignment()), 0);
        Ok(b)
    }

    /// Writes the file; every tensor must have been added with its bytes.
    pub fn write_to(&self, w: impl Write) -> Result<()> {
        if let Some(t) = self.tensors.iter().find(|t| t.data.is_none()) {
            return Err(GgufError::MissingTensor { name: t.name.clone() });
        }
        self.write_with(w, |_, _| Ok(()))
    }

    /// Writes the file, calling `fill(name, out)` in tensor order for each tensor added with
    /// [`GgufWriter::add_tensor_info`]; it must write exactly that tensor's byte size to `out`
    /// (else [`GgufError::SizeMismatch`]). Tensors added with bytes are written from memory.
    pub fn write_with<W: Write>(
        &self,
        mut w: W,
        mut fill: impl FnMut(&str, &mut dyn Write) -> io::Result<()>,
    ) -> Result<()> {
        let align = self.alignment();
        w.write_all(&self.header()?)?;
        let zeros = vec![0u8; align];
        for t in &self.tensors {
            match &t.data {
                Some(d) => w.write_all(d)?,
                None => {
                    let mut counted = Counting { inner: &mut w, written: 0 };
                    fill(&t.name, &mut counted)?;
                    if counted.written != t.size as u64 {
                        return Err(GgufError::SizeMismatch {
                            name: t.name.clone(),
                            expected: t.size as u64,
                            got: counted.written,
                        });
                    }
                }
            }
            w.write_all(&zeros[..t.size.next_multiple_of(align) - t.size])?;
        }
        w.flush()?;
        Ok(())
    }

    /// The file as bytes (every tensor must have its bytes).
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        self.write_to(&mut out)?;
        Ok(out)
    }

    /// Writes the file to `path`, atomically: see [`GgufWriter::write_file_with`].
    pub fn write_file(&self, path: impl AsRef<Path>) -> Result<()> {
        // Fail before creating the file when a tensor has no bytes.
        if let Some(t) = self.tensors.iter().find(|t| t.data.is_none()) {
            return Err(GgufError::MissingTensor { name: t.name.clone() });
        }
        self.write_file_with(path, |_, _| Ok(()))
    }

    /// [`GgufWriter::write_with`] to a file at `path`, atomically ([`tessera_files::AtomicFile`]):
    /// the bytes go to a temporary file in `path`'s directory that replaces `path` only once it
    /// is complete and synced. On any error (including one from `fill`) the temporary is removed
    /// and an existing file at `path` is left as it was.
    pub fn write_file_with(
        &self,
        path: impl AsRef<Path>,
        fill: impl FnMut(&str, &mut dyn Write) -> io::Result<()>,
    ) -> Result<()> {
        let path = path.as_ref();
        let file_err = |source| GgufError::File { path: path.to_path_buf(), source };
        let mut file = AtomicFile::create(path).map_err(file_err)?;
        self.write_with(&mut file, fill).map_err(|e| match e {
            GgufError::Io(source) => file_err(source),
            e => e,
        })?;
        file.commit().map_err(file_err)
    }
}

/// Counts the bytes a streaming callback writes.
struct Counting<'a, W: Write> {
    inner: &'a mut W,
    written: u64,
}

impl<W: Write> Write for Counting<'_, W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.written += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

fn checked_size(name: &str, dtype: DType, dims: &[usize]) -> Result<usize> {
    let bad = |reason: String| GgufError::BadDims { name: name.to_string(), reason };
    if dims.is_empty() || dims.len() > MAX_DIMS {
        return Err(bad(format!("n_dims is {}, must be 1..={MAX_DIMS}", dims.len())));
    }
    if let Some(d) = dims.iter().position(|&n| n == 0) {
        return Err(bad(format!("ne[{d}] is 0")));
    }
    let mut ne = [1usize; MAX_DIMS];
    ne[..dims.len()].copy_from_slice(dims);
    tensor_size(dtype, &ne).map_err(bad)
}

fn check_value(key: &str, value: &Value) -> Result<()> {
    if let Value::Array(a) = value
        && a.depth() > MAX_ARRAY_DEPTH
    {
        return Err(GgufError::NestingTooDeep { what: format!("metadata kv `{key}`"), max: MAX_ARRAY_DEPTH });
    }
    if key == ALIGNMENT_KEY {
        match *value {
            Value::U32(a) if a.is_power_of_two() => {}
            Value::U32(a) => return Err(GgufError::BadAlignment { value: a.into() }),
            ref v => {
                return Err(GgufError::WrongType {
                    key: key.to_string(),
                    expected: "u32",
                    found: v.type_description(),
                });
            }
        }
    }
    Ok(())
}

fn put_str(b: &mut Vec<u8>, s: &str) {
    b.extend_from_slice(&(s.len() as u64).to_le_bytes());
    b.extend_from_slice(s.as_bytes());
}

fn put_value(b: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => b.push(*x),
        Value::I8(x) => b.extend_from_slice(&x.to_le_bytes()),
        Value::U16(x) => b.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => b.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => b.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => b.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => b.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => b.push(u8::from(*x)),
        Value::String(s) => put_str(b, s),
        Value::Array(a) => put_array(b, a),
        Value::U64(x) => b.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => b.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => b.extend_from_slice(&x.to_le_bytes()),
    }
}

fn put_array(b: &mut Vec<u8>, a: &Array) {
    b.extend_from_slice(&a.elem_type().id().to_le_bytes());
    b.extend_from_slice(&(a.len() as u64).to_le_bytes());
    macro_rules! le {
        ($v:expr) => {
            for x in $v {
                b.extend_from_slice(&x.to_le_bytes());
            }
        };
    }
    match a {
        Array::U8(v) => b.extend_from_slice(v),
        Array::I8(v) => le!(v),
        Array::U16(v) => le!(v),
        Array::I16(v) => le!(v),
        Array::U32(v) => le!(v),
        Array::I32(v) => le!(v),
        Array::F32(v) => le!(v),
        Array::Bool(v) => b.extend(v.iter().map(|&x| u8::from(x))),
        Array::String(v) => v.iter().for_each(|s| put_str(b, s)),
        Array::Array(v) => v.iter().for_each(|inner| put_array(b, inner)),
        Array::U64(v) => le!(v),
        Array::I64(v) => le!(v),
        Array::F64(v) => le!(v),
    }
}
