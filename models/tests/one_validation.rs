//! Issue 23, item 3 (the config half): one `ModelConfig::validate` for every path. Every value
//! the model uses is checked where the config is read, so `inspect` (config + tensor check) never
//! says "ok" for a file `run` (load + a step) refuses, and `convert` / `synth` never write one.

mod common;

use common::{Counting, fixture_config, preset_bytes, with_kvs};
use serde_json::json;
use tessera_cpu::CpuBackend;
use tessera_models::config::{ConfigError, ModelConfig};
use tessera_models::convert::config_from_hf;
use tessera_models::gguf::{Array, GgufFile, Value};
use tessera_models::model::{Logits, Model, ModelOptions};
use tessera_ops::DType;

#[global_allocator]
static ALLOC: Counting = Counting;

fn opts() -> ModelOptions {
    ModelOptions { kv_blocks: 8, block_size: 4, max_context: 32, kv_dtype: DType::F32, ..ModelOptions::default() }
}

/// `tessera inspect`'s verdict.
fn inspect(f: &GgufFile) -> Result<(), String> {
    let c = ModelConfig::from_gguf(f).map_err(|e| e.to_string())?;
    c.validate_tensors(f).map_err(|e| e.to_string())
}

/// `tessera run`'s: load, then one step whose logits must be finite.
fn run(f: &GgufFile) -> Result<(), String> {
    let mut be = CpuBackend::new();
    let mut m = Model::load(f, &mut be, opts()).map_err(|e| e.to_string())?;
    // One token: a longer prompt could be refused for the context length, a property of the
    // request rather than of the file.
    let logits = m.step(&mut be, &[(1, &[1])], Logits::Last).map_err(|e| e.to_string())?;
    m.free(&mut be);
    if logits.iter().flatten().all(|x| x.is_finite()) { Ok(()) } else { Err("non-finite logits".into()) }
}

/// The values of the issue that `inspect` reported "tensors: ok" for and only `run` refused, and
/// their neighbours: each an error naming the key and the value, on both paths.
#[test]
fn bad_values_are_refused_by_inspect_and_run_alike() {
    let dense = GgufFile::from_bytes(preset_bytes("tiny")).unwrap();
    let moe = GgufFile::from_bytes(preset_bytes("tiny-moe")).unwrap();
    let sections = |v: &[i32]| Value::Array(Array::I32(v.to_vec()));
    let cases: Vec<(&GgufFile, &str, Value, &str)> = vec![
        (&dense, "qwen35.attention.layer_norm_rms_epsilon", Value::F32(f32::NAN), "NaN"),
        (&dense, "qwen35.attention.layer_norm_rms_epsilon", Value::F32(-1e-6), "-0.000001"),
        (&dense, "qwen35.attention.layer_norm_rms_epsilon", Value::F32(0.0), "0 must"),
        (&dense, "qwen35.attention.layer_norm_rms_epsilon", Value::F64(f64::INFINITY), "inf"),
        (&dense, "qwen35.rope.freq_base", Value::F32(0.0), "0 must"),
        (&dense, "qwen35.rope.freq_base", Value::F32(-10_000.0), "-10000"),
        (&dense, "qwen35.rope.freq_base", Value::F32(f32::NAN), "NaN"),
        (&dense, "qwen35.rope.dimension_count", Value::U32(0), "0 must"),
        (&dense, "qwen35.rope.dimension_count", Value::U32(15), "15 must"),
        (&dense, "qwen35.rope.dimension_count", Value::U32(34), "34 must"),
        (&dense, "qwen35.rope.dimension_sections", sections(&[0, 0, 0, 0]), "the sum is 0"),
        (&dense, "qwen35.rope.dimension_sections", sections(&[4, 3, 2, 0]), "the sum is 9"),
        (&dense, "qwen35.rope.dimension_sections", sections(&[-1, 3, 2, 0]), "-1"),
        (&dense, "qwen35.rope.dimension_sections", sections(&[i32::MAX, i32::MAX, 2, 0]), "4294967296"),
        (&dense, "qwen35.ssm.conv_kernel", Value::U32(1), "1 must"),
        (&dense, "qwen35.context_length", Value::U32(0), "must be nonzero"),
        (&dense, "qwen35.attention.head_count_kv", Value::U32(0), "must be nonzero"),
        (&dense, "qwen35.attention.head_count_kv", Value::U32(3), "not a multiple"),
        (&moe, "qwen35moe.expert_used_count", Value::U32(0), "must be nonzero"),
        (&moe, "qwen35moe.expert_used_count", Value::U32(9), "9 is more than expert_count 8"),
    ];
    for (base, key, value, needle) in cases {
        let f = with_kvs(base, &[(key, Some(value.clone()))]);
        let i = inspect(&f).expect_err(&format!("inspect accepted {key} = {value:?}"));
        let r = run(&f).expect_err(&format!("run accepted {key} = {value:?}"));
        for e in [&i, &r] {
            assert!(e.contains(key) && e.contains(needle), "{key} = {value:?}: `{needle}` not in: {e}");
        }
    }
}

/// Every single-key edit of a tiny model's metadata, over a spread of values: whenever `inspect`
/// says ok, `run` loads and steps with finite logits; whenever `inspect` refuses, so does `run`.
#[test]
fn inspect_ok_exactly_when_run_ok() {
    let ints: [u64; 16] = [0, 1, 2, 3, 4, 6, 7, 8, 15, 16, 17, 32, 33, 64, 4096, 1 << 33];
    let floats: [f64; 10] = [0.0, -1.0, 1e-6, 1e-30, 1.0, 1e7, 1e30, f64::NAN, f64::INFINITY, f64::NEG_INFINITY];
    let sections: [[i32; 4]; 6] = [[8, 0, 0, 0], [2, 2, 2, 2], [3, 3, 2, 0], [0, 0, 0, 1], [1, 0, 0, 0], [0, 0, 0, 0]];
    let (mut agreed_ok, mut agreed_err) = (0, 0);
    for preset in ["tiny", "tiny-moe"] {
        let base = GgufFile::from_bytes(preset_bytes(preset)).unwrap();
        for (key, v) in base.metadata().to_vec() {
            if !key.contains('.') || key.starts_with("general.") {
                continue;
            }
            let values: Vec<Value> = match v {
                Value::U32(_) => ints.iter().map(|&i| Value::U64(i)).collect(),
                Value::F32(_) => floats.iter().map(|&x| Value::F64(x)).collect(),
                Value::Array(Array::I32(_)) => sections.iter().map(|s| Value::Array(Array::I32(s.to_vec()))).collect(),
                _ => continue,
            };
            for value in values {
                let f = with_kvs(&base, &[(&key, Some(value.clone()))]);
                match (inspect(&f), run(&f)) {
                    (Ok(()), Ok(())) => agreed_ok += 1,
                    (Err(_), Err(_)) => agreed_err += 1,
                    (i, r) => panic!("{preset} {key} = {value:?}: inspect {i:?} but run {r:?}"),
                }
            }
        }
    }
    // Both outcomes were exercised.
    assert!(agreed_ok > 20 && agreed_err > 100, "{agreed_ok} ok, {agreed_err} refused");
}

/// `synth --set` goes through the same check.
#[test]
fn overrides_are_validated() {
    let c = ModelConfig::preset("tiny").unwrap();
    for (key, value) in [
        ("attention.layer_norm_rms_epsilon", "NaN"),
        ("attention.layer_norm_rms_epsilon", "-1"),
        ("rope.freq_base", "0"),
        ("rope.dimension_count", "0"),
        ("rope.dimension_sections", "5,5,0,0"),
        ("ssm.conv_kernel", "1"),
    ] {
        let e = c.with_override(key, value).unwrap_err();
        assert!(matches!(e, ConfigError::Inconsistent { .. }), "{key}={value}: {e}");
        assert!(e.to_string().contains(&format!("qwen35.{key}")), "{e}");
    }
}

/// A hand-built config is validated where it is used, not trusted.
#[test]
fn hand_built_configs_are_validated_where_used() {
    let tiny = ModelConfig::preset("tiny").unwrap();
    let f = GgufFile::from_bytes(preset_bytes("tiny")).unwrap();
    let bad = ModelConfig { rms_eps: f32::NAN, ..tiny.clone() };
    assert!(bad.validate_tensors(&f).unwrap_err().to_string().contains("layer_norm_rms_epsilon"));
    let mut be = CpuBackend::new();
    let e = Model::with_config(&f, bad, &mut be, opts()).map(|_| ()).unwrap_err().to_string();
    assert!(e.contains("layer_norm_rms_epsilon"), "{e}");
    // Wrapping sums are errors, not [0, 0, 0, 0]: 2^63 + 2^63 = 0 in a u64.
    let wraps = ModelConfig { rope_sections: Some([1 << 63, 1 << 63, 0, 0]), ..tiny };
    let e = wraps.validate().unwrap_err().to_string();
    assert!(e.contains("rope.dimension_sections") && e.contains("overflows"), "{e}");
}

/// The `config.json` values of the issue, each named with its value by `config_from_hf`.
#[test]
fn bad_config_json_values_are_named() {
    let base = fixture_config("qwen35-dense");
    let moe = fixture_config("qwen35moe");
    let rope = |key: &str, v: serde_json::Value| {
        let mut j = base.clone();
        j["rope_parameters"][key] = v.clone();
        if j.get(key).is_some() {
            j[key] = v;
        }
        j
    };
    let top = |j: &serde_json::Value, key: &str, v: serde_json::Value| {
        let mut j = j.clone();
        j[key] = v;
        j
    };
    let two63 = 1u64 << 63;
    // head_dim 12 x 0.25 = 3 rotated dims (without sections, which would be refused first).
    let mut odd_rot = top(&base, "head_dim", json!(12));
    odd_rot["rope_parameters"].as_object_mut().unwrap().remove("mrope_section");
    let cases: Vec<(serde_json::Value, &str, &str)> = vec![
        // [2^63, 2^63, 0] summed to 0 and was written as [0, 0, 0, 0].
        (rope("mrope_section", json!([two63, two63, 0])), "mrope_section", "overflows"),
        (rope("mrope_section", json!([5, 3, 2])), "mrope_section", "the sum is 10"),
        (rope("mrope_section", json!([-1, 3, 2])), "mrope_section", "-1"),
        (rope("mrope_section", json!([0, 0, 0])), "mrope_section", "the sum is 0"),
        (rope("mrope_section", json!([1, 2, 3, 1, 1])), "mrope_section", "5 entries"),
        (rope("partial_rotary_factor", json!(-0.25)), "partial_rotary_factor", "-0.25"),
        (rope("partial_rotary_factor", json!(0.0)), "partial_rotary_factor", "is 0"),
        (rope("partial_rotary_factor", json!(1.5)), "partial_rotary_factor", "1.5"),
        (rope("rope_theta", json!(-10000.0)), "rope_theta", "-10000"),
        (rope("rope_theta", json!(0.0)), "rope_theta", "is 0"),
        (rope("rope_theta", json!(1e39)), "rope_theta", "inf"),
        (rope("rope_theta", json!("big")), "rope_theta", "\"big\""),
        (top(&base, "rms_norm_eps", json!(-1e-6)), "rms_norm_eps", "-0.000001"),
        (top(&base, "rms_norm_eps", json!(0.0)), "rms_norm_eps", "is 0"),
        (top(&base, "rms_norm_eps", json!("NaN")), "rms_norm_eps", "\"NaN\""),
        (top(&base, "rms_norm_eps", json!(1e-60)), "rms_norm_eps", "0 must"),
        (top(&base, "max_position_embeddings", json!(-5)), "max_position_embeddings", "-5"),
        (top(&base, "max_position_embeddings", json!(0)), "max_position_embeddings", "nonzero"),
        (top(&base, "tie_word_embeddings", json!("no")), "tie_word_embeddings", "\"no\""),
        (top(&base, "linear_conv_kernel_dim", json!(1)), "linear_conv_kernel_dim", "1 must"),
        (odd_rot, "partial_rotary_factor", "3 must be even"),
        (top(&base, "num_key_value_heads", json!(3)), "num_key_value_heads", "not a multiple"),
        (top(&base, "full_attention_interval", json!(1.5)), "full_attention_interval", "1.5"),
        (top(&moe, "num_experts_per_tok", json!(0)), "num_experts_per_tok", "nonzero"),
        (top(&moe, "num_experts_per_tok", json!(9)), "num_experts_per_tok", "9 is more than expert_count 8"),
    ];
    for (j, key, needle) in cases {
        let e = config_from_hf(&j).expect_err(key).to_string();
        assert!(e.contains(key) && e.contains(needle), "{key}: `{needle}` not in: {e}");
    }
    // The untouched fixtures still read, with the sections as given.
    let c = config_from_hf(&base).unwrap();
    assert_eq!((c.n_rot, c.rope_sections), (16, Some([3, 3, 2, 0])));
}

/// `inspect` accepts a merged `ffn_gate_up_exps` in place of the gate/up pair (as llama.cpp's
/// loader does), so `run` must load it too, with the same logits.
#[test]
fn merged_gate_up_experts_run_like_the_pair() {
    let f = GgufFile::from_bytes(preset_bytes("tiny-moe")).unwrap();
    let mut w = tessera_models::gguf::GgufWriter::new();
    for (k, v) in f.metadata() {
        w.add_kv(k.clone(), v.clone()).unwrap();
    }
    for t in f.tensors() {
        let Some(prefix) = t.name.strip_suffix("ffn_gate_exps.weight") else {
            if !t.name.ends_with("ffn_up_exps.weight") {
                w.add_tensor(t.name.clone(), t.dtype, t.dims(), f.tensor_data(&t.name).unwrap()).unwrap();
            }
            continue;
        };
        // Per expert: the gate's rows, then the up projection's.
        let gate = f.tensor_data(&t.name).unwrap();
        let up = f.tensor_data(&format!("{prefix}ffn_up_exps.weight")).unwrap();
        let slab = gate.len() / t.ne[2];
        let mut merged = Vec::with_capacity(2 * gate.len());
        for ex in 0..t.ne[2] {
            merged.extend_from_slice(&gate[ex * slab..(ex + 1) * slab]);
            merged.extend_from_slice(&up[ex * slab..(ex + 1) * slab]);
        }
        let dims = [t.ne[0], 2 * t.ne[1], t.ne[2]];
        w.add_tensor(format!("{prefix}ffn_gate_up_exps.weight"), t.dtype, &dims, merged).unwrap();
    }
    let merged = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
    inspect(&merged).unwrap();
    let logits = |f: &GgufFile| {
        let mut be = CpuBackend::new();
        let mut m = Model::load(f, &mut be, opts()).unwrap();
        let l = m.step(&mut be, &[(1, &[5, 6, 7])], Logits::All).unwrap();
        m.free(&mut be);
        l
    };
    assert_eq!(logits(&merged), logits(&f));
}
