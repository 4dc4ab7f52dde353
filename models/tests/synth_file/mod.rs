//! A synthetic checkpoint for a test: a preset's GGUF with seeded weights, written to a fresh
//! temporary path, opened (memory-mapped) and the path removed again, so tests leave no files
//! behind and never share one. The tiny presets take a few milliseconds.

use std::sync::atomic::{AtomicUsize, Ordering};

use tessera_models::config::ModelConfig;
use tessera_models::gguf::GgufFile;
use tessera_models::synth::synthesize;
use tessera_ops::DType;

/// The `preset` checkpoint with `dtype` weights from `seed`.
#[allow(dead_code)] // not every test binary that shares this module synthesizes
pub fn synth_file(preset: &str, dtype: DType, seed: u64) -> GgufFile {
    static N: AtomicUsize = AtomicUsize::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let config = ModelConfig::preset(preset).unwrap();
    let path =
        std::env::temp_dir().join(format!("tessera_test_{preset}_{}_{}_{n}.gguf", dtype.name(), std::process::id()));
    synthesize(&config, dtype, seed, &path, None).unwrap();
    let file = GgufFile::open(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    file
}

/// llama.cpp's qwen35 test vocabulary (the fixture `tests/data/vocab/ggml-vocab-qwen35.gguf.gz`),
/// in memory.
#[allow(dead_code)] // not every test binary that shares this module reads the vocabulary
pub fn fixture_vocab() -> GgufFile {
    use std::io::Read;
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/vocab/ggml-vocab-qwen35.gguf.gz");
    let gz = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut bytes = Vec::new();
    flate2::read::GzDecoder::new(&gz[..]).read_to_end(&mut bytes).unwrap();
    GgufFile::from_bytes(bytes).unwrap()
}
