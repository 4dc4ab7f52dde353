//! Issue 23, item 2: every count is bounded before anything is sized from it. A tiny file or
//! config with an absurd layer / expert / head / vocab count is a clear error naming the key and
//! the value, in well under a second and 100 MB of heap, on every path: reading the config
//! (`inspect`), loading a model (`run`), converting and synthesizing.

mod common;

use common::{Cost, Counting, edit_gguf, fixture, fixture_config, measure, preset_bytes, temp_dir, with_kvs};
use serde_json::json;
use tessera_cpu::CpuBackend;
use tessera_models::config::{ConfigError, MAX_LAYERS, ModelConfig, TensorProblem};
use tessera_models::convert::{config_from_hf, convert};
use tessera_models::gguf::{Array, GgufError, GgufFile, Value};
use tessera_models::model::{Model, ModelOptions};
use tessera_models::synth::{SynthError, output_bytes, synthesize};
use tessera_models::weights::ModelWeights;
use tessera_ops::DType;

#[global_allocator]
static ALLOC: Counting = Counting;

const MB: usize = 1 << 20;

/// The bound of the issue: under a second and under 100 MB. Measured figures are far below
/// (a few MB, milliseconds); the bound leaves room for a slow shared machine.
fn assert_cheap(cost: Cost, what: &str) {
    assert!(cost.peak_heap < 100 * MB, "{what}: {} MB of heap", cost.peak_heap / MB);
    assert!(cost.time.as_secs_f64() < 1.0, "{what}: {:?}", cost.time);
}

fn opts() -> ModelOptions {
    ModelOptions { kv_blocks: 8, block_size: 4, max_context: 32, kv_dtype: DType::F32, ..ModelOptions::default() }
}

/// What `tessera inspect` checks: the config, then the tensors against it.
fn inspect(f: &GgufFile) -> Result<ModelConfig, ConfigError> {
    let c = ModelConfig::from_gguf(f)?;
    c.validate_tensors(f)?;
    Ok(c)
}

/// Every path that reads a GGUF refuses `f` cheaply with an error containing each of `needles`.
fn refused_everywhere(f: &GgufFile, needles: &[&str]) {
    let (r, cost) = measure(|| inspect(f));
    let e = r.expect_err("inspect accepted it").to_string();
    assert_cheap(cost, &e);
    for n in needles {
        assert!(e.contains(n), "inspect: `{n}` not in: {e}");
    }
    let (r, cost) = measure(|| {
        let mut be = CpuBackend::new();
        Model::load(f, &mut be, opts()).map(|_| ())
    });
    let e = r.expect_err("Model::load accepted it").to_string();
    assert_cheap(cost, &e);
    for n in needles {
        assert!(e.contains(n), "run: `{n}` not in: {e}");
    }
}

#[test]
fn absurd_counts_in_a_gguf_are_named_at_once() {
    let dense = GgufFile::from_bytes(preset_bytes("tiny")).unwrap();
    let moe = GgufFile::from_bytes(preset_bytes("tiny-moe")).unwrap();
    // The file: block_count = 10^9.
    refused_everywhere(
        &with_kvs(&dense, &[("qwen35.block_count", Some(Value::U32(1_000_000_000)))]),
        &["qwen35.block_count", "1000000000", "4096"],
    );
    // u64 counts are read too; the largest is refused the same way.
    refused_everywhere(
        &with_kvs(&dense, &[("qwen35.block_count", Some(Value::U64(u64::MAX)))]),
        &["qwen35.block_count", &u64::MAX.to_string()],
    );
    for (key, value) in [
        ("qwen35.embedding_length", 1u64 << 40),
        ("qwen35.attention.head_count", 1 << 30),
        ("qwen35.attention.head_count_kv", 1 << 30),
        ("qwen35.vocab_size", 1 << 31),
        ("qwen35.feed_forward_length", 1 << 40),
        ("qwen35.context_length", 1 << 40),
        ("qwen35.ssm.time_step_rank", 1 << 32),
        ("qwen35.ssm.inner_size", 1 << 40),
        ("qwen35.ssm.conv_kernel", 1 << 40),
        ("qwen35.full_attention_interval", 1 << 40),
    ] {
        refused_everywhere(&with_kvs(&dense, &[(key, Some(Value::U64(value)))]), &[key, &value.to_string()]);
    }
    for (key, value) in [
        ("qwen35moe.expert_count", 1_000_000u64),
        ("qwen35moe.expert_used_count", 1 << 40),
        ("qwen35moe.expert_feed_forward_length", 1 << 40),
    ] {
        refused_everywhere(&with_kvs(&moe, &[(key, Some(Value::U64(value)))]), &[key, &value.to_string()]);
    }
}

#[test]
fn counts_within_the_limits_are_checked_against_the_tensors() {
    let dense = GgufFile::from_bytes(preset_bytes("tiny")).unwrap();
    // 4000 blocks is allowed, but the file holds 4: one problem, no list of 56000 missing tensors.
    let f = with_kvs(&dense, &[("qwen35.block_count", Some(Value::U32(4000)))]);
    refused_everywhere(&f, &["block_count is 4000", "blocks 0..=3 only"]);
    let (problems, _) = measure(|| ModelConfig::from_gguf(&f).unwrap().tensor_problems(&f).unwrap());
    assert_eq!(problems, [TensorProblem::Blocks { block_count: 4000, main_layers: 4000, found: 4 }]);
    // Metadata only: no blocks at all.
    let bare = edit_gguf(&dense, &[], |n| n == "output.weight");
    refused_everywhere(&bare, &["no `blk.N` tensors"]);
    // The weights loader checks too, before any allocation.
    let c = ModelConfig::from_gguf(&f).unwrap();
    let (r, cost) = measure(|| ModelWeights::load(&f, &c, &mut CpuBackend::new()).map(|_| ()));
    assert_cheap(cost, "ModelWeights::load");
    assert!(r.unwrap_err().to_string().contains("block_count is 4000"));
    // An expert count within the limit but not the file's: wrong shapes, named.
    let moe = GgufFile::from_bytes(preset_bytes("tiny-moe")).unwrap();
    let f = with_kvs(&moe, &[("qwen35moe.expert_count", Some(Value::U32(60_000)))]);
    refused_everywhere(&f, &["blk.0.ffn_gate_inp.weight", "[64, 60000, 1, 1]"]);
    // Blocks beyond block_count are tensors the config does not expect (llama.cpp refuses them).
    let f = with_kvs(&dense, &[("qwen35.block_count", Some(Value::U32(2)))]);
    refused_everywhere(&f, &["`blk.2.attn_norm.weight` is not part of this config"]);
    // So is any unknown tensor.
    let mut w = tessera_models::gguf::GgufWriter::from_file(&dense).unwrap();
    w.add_tensor("blk.0.mystery.weight", DType::F32, &[4], vec![0u8; 16]).unwrap();
    let f = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
    refused_everywhere(&f, &["`blk.0.mystery.weight` is not part of this config"]);
}

#[test]
fn metadata_arrays_are_bounded_before_conversion() {
    let dense = GgufFile::from_bytes(preset_bytes("tiny")).unwrap();
    // 100000 rope sections: refused by length, not converted element by element.
    let long = Value::Array(Array::I32(vec![1; 100_000]));
    let f = with_kvs(&dense, &[("qwen35.rope.dimension_sections", Some(long))]);
    let (r, cost) = measure(|| ModelConfig::from_gguf(&f));
    assert_cheap(cost, "sections");
    let e = r.unwrap_err();
    assert!(matches!(&e, ConfigError::Gguf(GgufError::TooLarge { value: 100_000, max: 4, .. })), "{e}");
    assert!(e.to_string().contains("qwen35.rope.dimension_sections"), "{e}");
    // Recurrent-layer flags of another length than block_count: refused before copying.
    let flags = Value::Array(Array::Bool(vec![true; 100_000]));
    let f = with_kvs(&dense, &[("qwen35.attention.recurrent_layers", Some(flags))]);
    let e = ModelConfig::from_gguf(&f).unwrap_err().to_string();
    assert!(e.contains("qwen35.attention.recurrent_layers") && e.contains("100000 entries"), "{e}");
}

#[test]
fn absurd_counts_in_a_config_json_are_named_at_once() {
    let base = fixture_config("qwen35-dense");
    for (key, value) in [
        ("num_hidden_layers", json!(1_000_000_000_000u64)),
        ("hidden_size", json!(1u64 << 40)),
        ("vocab_size", json!(1u64 << 40)),
        ("num_attention_heads", json!(1u64 << 40)),
        ("intermediate_size", json!(u64::MAX)),
        ("linear_num_value_heads", json!(1u64 << 33)),
        // Their product overflows a u64: named, not wrapped.
        ("linear_value_head_dim", json!(1u64 << 62)),
    ] {
        let mut j = base.clone();
        j[key] = value.clone();
        let (r, cost) = measure(|| config_from_hf(&j));
        let e = r.expect_err(key).to_string();
        assert_cheap(cost, &e);
        assert!(e.contains(key) && e.contains(&value.to_string()), "{key}: {e}");
    }
    // The whole converter, on a checkpoint directory with num_hidden_layers = 10^12 (the issue's).
    let dir = temp_dir("layers");
    let mut j = base.clone();
    j["num_hidden_layers"] = json!(1_000_000_000_000u64);
    std::fs::write(dir.join("config.json"), j.to_string()).unwrap();
    std::fs::copy(fixture("qwen35-dense").join("model.safetensors"), dir.join("model.safetensors")).unwrap();
    let out = dir.join("out.gguf");
    let (r, cost) = measure(|| convert(&dir, &out, DType::F32));
    let e = r.unwrap_err().to_string();
    assert_cheap(cost, &e);
    assert!(e.contains("num_hidden_layers") && e.contains("1000000000000"), "{e}");
    assert!(!out.exists());
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn synth_refuses_absurd_counts_and_outputs_that_cannot_fit() {
    let dir = temp_dir("synth");
    let path = dir.join("big.gguf");
    let tiny = ModelConfig::preset("tiny").unwrap();
    // `tessera synth --set block_count=1000000000`.
    let (r, cost) = measure(|| tiny.with_override("block_count", "1000000000"));
    assert_cheap(cost, "override");
    assert!(r.unwrap_err().to_string().contains("qwen35.block_count"));
    // The same count set directly in the struct: synthesize validates before sizing anything.
    let c = ModelConfig { n_layer: 1_000_000_000, ..tiny.clone() };
    let (r, cost) = measure(|| synthesize(&c, DType::F16, 1, &path, None));
    assert_cheap(cost, "synthesize");
    assert!(r.unwrap_err().to_string().contains("1000000000"));
    // `--set expert_count=1000000`.
    let moe = ModelConfig::preset("tiny-moe").unwrap();
    let e = moe.with_override("expert_count", "1000000").unwrap_err().to_string();
    assert!(e.contains("qwen35moe.expert_count") && e.contains("1000000") && e.contains("65536"), "{e}");
    // Within the limits but bigger than any disk: the size is computed first and refused before a
    // byte is written (65536 experts on the 35B-A3B trunk: about 9.5e12 weights, 19 TB in f16).
    let huge = ModelConfig::preset("qwen35moe-35b-a3b").unwrap().with_override("expert_count", "65536").unwrap();
    let (bytes, cost) = measure(|| output_bytes(&huge, DType::F16).unwrap());
    assert_cheap(cost, "output_bytes");
    assert!(bytes > 15_000_000_000_000, "{bytes}");
    let (r, cost) = measure(|| synthesize(&huge, DType::F16, 1, &path, None));
    assert_cheap(cost, "synthesize huge");
    match r {
        Err(SynthError::NoSpace { needed, available, .. }) => assert!(needed == bytes && available < needed),
        other => panic!("{other:?}"),
    }
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "nothing written");
    // The total weight count is bounded too: 4096 layers of 2^20-wide FFNs is 2^55 weights.
    let wide = ModelConfig { n_layer: MAX_LAYERS, n_embd: 1 << 20, ..tiny.clone() };
    let wide = ModelConfig { ffn: tessera_models::config::Ffn::Dense { n_ff: 1 << 20 }, ..wide };
    let e = wide.validate().unwrap_err();
    assert!(matches!(e, ConfigError::TooManyParams { .. }), "{e}");
    std::fs::remove_dir_all(dir).unwrap();
}
