//! Issue 24, item 5: a synthetic model with a real vocabulary (`synthesize_with_vocab`, `tessera
//! synth --vocab`): the `tokenizer.*` keys of the fixture vocabulary (tests/data/vocab/, llama.cpp's
//! qwen35 vocabulary GGUF, gzipped) copied as they are, `vocab_size` its token count, and the model
//! loads and generates ids of that vocabulary.

use tessera_cpu::CpuBackend;
use tessera_models::chat::{ChatMessage, ChatTemplate};
use tessera_models::config::ModelConfig;
use tessera_models::engine::{Engine, EngineConfig};
use tessera_models::gguf::{GgufFile, GgufWriter};
use tessera_models::model::{Model, ModelOptions};
use tessera_models::sample::SamplerParams;
use tessera_models::synth::{SynthError, SynthVocab, synthesize_with_vocab};
use tessera_ops::DType;

mod synth_file;
use synth_file::fixture_vocab;

fn out_path(tag: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("tessera_synth_vocab_{tag}_{}.gguf", std::process::id()))
}

#[test]
fn a_synthetic_model_speaks_the_fixture_vocabulary() {
    let fx = fixture_vocab();
    let vocab = SynthVocab::from_gguf(&fx).unwrap();
    assert_eq!(vocab.n_tokens, 151_936);
    let config = ModelConfig::preset("tiny").unwrap().with_override("vocab_size", "151936").unwrap();
    let path = out_path("ok");
    synthesize_with_vocab(&config, DType::F16, 3, &path, Some(&vocab), None).unwrap();
    let f = GgufFile::open(&path).unwrap();
    // Every tokenizer.* key of the vocabulary file, with the same value; none other added.
    let fx_keys: Vec<_> = fx.metadata().iter().filter(|(k, _)| k.starts_with("tokenizer.")).collect();
    let out_keys: Vec<_> = f.metadata().iter().filter(|(k, _)| k.starts_with("tokenizer.")).collect();
    assert_eq!(fx_keys, out_keys);
    assert!(out_keys.len() >= 9, "{}", out_keys.len());
    let parsed = ModelConfig::from_gguf(&f).unwrap();
    assert_eq!(parsed.n_vocab, 151_936);
    parsed.validate_tensors(&f).unwrap();
    // The chat template renders with the vocabulary's special tokens.
    let chat = ChatTemplate::from_gguf(&f).unwrap();
    assert_eq!(chat.eos_token(), Some("<|endoftext|>"));
    assert!(chat.render(&[ChatMessage::user("hi")], true).unwrap().ends_with("<|im_start|>assistant\n"));
    // It loads and generates ids of the vocabulary (<|im_start|> user \n as the prompt).
    let mut backend = CpuBackend::new();
    let model = Model::load(&f, &mut backend, ModelOptions::default()).unwrap();
    let mut engine = Engine::new(model, Box::new(backend), EngineConfig::default()).unwrap();
    let id = engine.submit(&[151_644, 872, 198], 3, SamplerParams::greedy()).unwrap();
    let out = engine.run_to_completion().unwrap();
    assert_eq!(out[&id].len(), 3);
    assert!(out[&id].iter().all(|&t| (t as usize) < 151_936), "{:?}", out[&id]);
    drop(f);
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn a_vocabulary_of_another_size_or_none_is_an_error() {
    let fx = fixture_vocab();
    let vocab = SynthVocab::from_gguf(&fx).unwrap();
    let config = ModelConfig::preset("tiny").unwrap();
    let path = out_path("mismatch");
    let e = synthesize_with_vocab(&config, DType::F16, 3, &path, Some(&vocab), None).unwrap_err();
    assert!(matches!(e, SynthError::Vocab { .. }), "{e}");
    assert!(e.to_string().contains("151936 tokens") && e.to_string().contains("vocab_size is 256"), "{e}");
    assert!(!path.exists());
    // A GGUF without a token list.
    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", "qwen35").unwrap();
    let f = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
    let e = SynthVocab::from_gguf(&f).unwrap_err();
    assert!(e.to_string().contains("tokenizer.ggml.tokens"), "{e}");
}
