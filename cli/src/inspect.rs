//! `tessera inspect FILE`.

use std::fmt::Write as _;
use std::path::Path;

use tessera_models::config::ModelConfig;
use tessera_models::gguf::{Array, GgufError, GgufFile, Value};

/// Array elements printed before the rest is summarised.
const SHOWN: usize = 8;

/// Prints the report; `Err` (with the message) when the file cannot be read, or when it is not a
/// valid qwen35 / qwen35moe model (after printing everything that could be read).
pub fn run(path: &Path) -> Result<(), String> {
    let f = open(path)?;
    let mut out = String::new();
    report(&f, path, &mut out);
    out!("{out}");
    let config = ModelConfig::from_gguf(&f).map_err(|e| format!("{}: model config: {e}", path.display()))?;
    outln!("model config:\n{config}");
    match config.validate_tensors(&f) {
        Ok(()) => {
            outln!("tensors: ok ({} expected, all present with the right shapes)", config.tensor_specs().len());
            Ok(())
        }
        Err(e) => Err(format!("{}: tensors: {e}", path.display())),
    }
}

/// Opens a GGUF, with an error that names the file (I/O errors do already, parse errors do not).
pub fn open(path: &Path) -> Result<GgufFile, String> {
    GgufFile::open(path).map_err(|e| match e {
        GgufError::File { .. } => e.to_string(),
        e => format!("{}: {e}", path.display()),
    })
}

fn report(f: &GgufFile, path: &Path, out: &mut String) {
    // Writing to a String cannot fail.
    let _ = writeln!(out, "file: {}", path.display());
    let _ = writeln!(
        out,
        "GGUF v{}, alignment {}, {} metadata keys, {} tensors, data at byte {}",
        f.version(),
        f.alignment(),
        f.metadata().len(),
        f.tensors().len(),
        f.data_offset()
    );
    let arch = f.get("general.architecture").and_then(Value::as_str).unwrap_or("(none)");
    let _ = writeln!(out, "architecture: {arch}");
    let _ = writeln!(out, "metadata:");
    let width = f.metadata().iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    for (k, v) in f.metadata() {
        let _ = writeln!(out, "  {k:width$}  {:<18} {}", v.type_description(), value_summary(v));
    }
    let _ = writeln!(out, "tensors:");
    let nw = f.tensors().iter().map(|t| t.name.len()).max().unwrap_or(4).max(4);
    let _ = writeln!(out, "  {:nw$}  {:6} {:28} {:>14}", "name", "dtype", "shape", "bytes");
    let mut total = 0u64;
    for t in f.tensors() {
        let shape = format!("{:?}", t.dims());
        let _ = writeln!(out, "  {:nw$}  {:6} {:28} {:>14}", t.name, t.dtype.name(), shape, t.size);
        total += t.size as u64;
    }
    let _ = writeln!(out, "  total tensor bytes: {total}");
}

/// A value for display: scalars as is, strings quoted, arrays as their first items plus a count.
fn value_summary(v: &Value) -> String {
    match v {
        Value::String(s) => format!("{s:?}"),
        Value::Array(a) => array_summary(a),
        Value::U8(x) => x.to_string(),
        Value::I8(x) => x.to_string(),
        Value::U16(x) => x.to_string(),
        Value::I16(x) => x.to_string(),
        Value::U32(x) => x.to_string(),
        Value::I32(x) => x.to_string(),
        Value::U64(x) => x.to_string(),
        Value::I64(x) => x.to_string(),
        Value::F32(x) => x.to_string(),
        Value::F64(x) => x.to_string(),
        Value::Bool(x) => x.to_string(),
    }
}

fn array_summary(a: &Array) -> String {
    fn items<T: std::fmt::Debug>(v: &[T]) -> Vec<String> {
        v.iter().take(SHOWN).map(|x| format!("{x:?}")).collect()
    }
    let shown = match a {
        Array::U8(v) => items(v),
        Array::I8(v) => items(v),
        Array::U16(v) => items(v),
        Array::I16(v) => items(v),
        Array::U32(v) => items(v),
        Array::I32(v) => items(v),
        Array::F32(v) => items(v),
        Array::Bool(v) => items(v),
        Array::String(v) => items(v),
        Array::Array(v) => v.iter().take(SHOWN).map(array_summary).collect(),
        Array::U64(v) => items(v),
        Array::I64(v) => items(v),
        Array::F64(v) => items(v),
    };
    let len = a.len();
    if len > SHOWN { format!("[{}, ...] ({len} items)", shown.join(", ")) } else { format!("[{}]", shown.join(", ")) }
}
