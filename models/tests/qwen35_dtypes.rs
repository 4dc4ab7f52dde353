//! The model in every weight dtype the ops support, and prefill chunking at the sizes.

use tessera_cpu::CpuBackend;
use tessera_models::config::ModelConfig;
use tessera_models::gguf::GgufFile;
use tessera_models::model::{Logits, Model, ModelOptions};
use tessera_models::synth::synthesize;
use tessera_ops::DType;

fn model_file(preset: &str, dtype: DType, tag: &str) -> GgufFile {
    let c = ModelConfig::preset(preset).unwrap();
    let path = std::env::temp_dir().join(format!("tessera_qwen35_dtypes_{preset}_{tag}_{}.gguf", std::process::id()));
    synthesize(&c, dtype, 7, &path, None).unwrap();
    let f = GgufFile::open(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    f
}

fn opts() -> ModelOptions {
    ModelOptions { kv_blocks: 40, block_size: 4, max_context: 128, kv_dtype: DType::F32, ..ModelOptions::default() }
}

fn tokens(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| i.wrapping_mul(2_654_435_761) % 256).collect()
}

fn nmse(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(&x, &y)| (x as f64 - y as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|&y| (y as f64).powi(2)).sum();
    num / den.max(f64::MIN_POSITIVE)
}

/// Last-token logits of `toks` fed in chunks of `chunk`.
fn last_logits(f: &GgufFile, toks: &[u32], chunk: usize, opts: ModelOptions) -> Vec<f32> {
    let mut be = CpuBackend::new();
    let mut m = Model::load(f, &mut be, opts).unwrap();
    let mut last = Vec::new();
    for c in toks.chunks(chunk) {
        last = m.step(&mut be, &[(0, c)], Logits::Last).unwrap().remove(0);
    }
    last
}

/// Synth draws the same values for every dtype and rounds them to it, so each dtype's logits must
/// stay close to f32's, by how much its rounding allows: the weights really are read in that dtype.
/// Measured (seed 7): f16 2-3e-7, bf16 2-9e-5, q8_0 2-3e-4, nvfp4 0.05-0.12.
#[test]
fn every_weight_dtype_runs_and_tracks_f32() {
    let toks = tokens(12);
    for preset in ["tiny", "tiny-moe"] {
        let reference = last_logits(&model_file(preset, DType::F32, "f32"), &toks, 12, opts());
        for (dtype, bound) in [(DType::F16, 1e-5), (DType::BF16, 1e-3), (DType::Q8_0, 1e-3), (DType::NvFp4, 0.2)] {
            let got = last_logits(&model_file(preset, dtype, dtype.name()), &toks, 12, opts());
            assert!(got.iter().all(|x| x.is_finite()), "{preset} {dtype}: non-finite logits");
            let e = nmse(&got, &reference);
            assert!(e <= bound, "{preset} {dtype}: nmse vs f32 {e:e} > {bound:e}");
            assert!(e > 0.0, "{preset} {dtype}: identical to f32, so the weights were not read as {dtype}");
        }
    }
}

/// Prefill split into chunks of 1, 7 and 64 tokens gives the logits of one chunk (70 tokens: the
/// chunked delta rule runs whole and partial chunks, attention spans many KV blocks).
#[test]
fn prefill_chunks_of_1_7_and_64_equal_one_chunk() {
    let toks = tokens(70);
    for preset in ["tiny", "tiny-moe"] {
        let f = model_file(preset, DType::F32, "chunks");
        let whole = last_logits(&f, &toks, 70, opts());
        for chunk in [1, 7, 64] {
            let e = nmse(&last_logits(&f, &toks, chunk, opts()), &whole);
            assert!(e <= 1e-8, "{preset} chunk {chunk}: nmse {e:e}");
        }
    }
}

/// The default K/V cache is f16 (as llama.cpp's); it stays close to an f32 cache.
#[test]
fn default_f16_kv_cache_tracks_f32() {
    assert_eq!(ModelOptions::default().kv_dtype, DType::F16);
    let toks = tokens(20);
    let f = model_file("tiny-moe", DType::F32, "kv");
    let f32_kv = last_logits(&f, &toks, 20, opts());
    let f16_kv = last_logits(&f, &toks, 20, ModelOptions { kv_dtype: DType::F16, ..opts() });
    let e = nmse(&f16_kv, &f32_kv);
    assert!(e > 0.0 && e <= 1e-4, "nmse {e:e}");
}
