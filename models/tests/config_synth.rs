//! Config and synthetic-checkpoint round trips: metadata, tensor bytes, determinism, and errors
//! that name the key or tensor at fault.

use std::path::PathBuf;

use tessera_models::config::{ConfigError, ModelConfig, TensorProblem};
use tessera_models::gguf::{GgufFile, GgufWriter, Value};
use tessera_models::synth::{SynthProgress, storage_dtype, synthesize, tensor_bytes};
use tessera_ops::DType;

fn temp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("tessera_config_synth_{}_{name}.gguf", std::process::id()))
}

/// Synthesizes `preset` in `dtype`, returns the path (removed by the caller).
fn synth(preset: &str, dtype: DType, seed: u64, tag: &str) -> (ModelConfig, PathBuf) {
    let c = ModelConfig::preset(preset).unwrap();
    let path = temp(&format!("{preset}_{dtype}_{seed}_{tag}"));
    synthesize(&c, dtype, seed, &path, None).unwrap();
    (c, path)
}

#[test]
fn tiny_presets_round_trip_in_every_dtype() {
    for preset in ["tiny", "tiny-moe"] {
        for dtype in [DType::F32, DType::F16, DType::Q8_0, DType::NvFp4] {
            let (c, path) = synth(preset, dtype, 3, "rt");
            let f = GgufFile::open(&path).unwrap();
            let back = ModelConfig::from_gguf(&f).unwrap();
            assert_eq!(back, c, "{preset} {dtype}");
            back.validate_tensors(&f).unwrap();
            let specs = c.tensor_specs();
            assert_eq!(f.tensors().len(), specs.len());
            for spec in &specs {
                let info = f.tensor(&spec.name).unwrap();
                assert_eq!(info.dtype, storage_dtype(spec, dtype), "{}", spec.name);
                assert_eq!(info.ne, spec.ne, "{}", spec.name);
                assert_eq!(f.tensor_data(&spec.name).unwrap(), tensor_bytes(spec, dtype, 3), "{}", spec.name);
            }
            // Every metadata key of the config is in the file with the same value.
            for (k, v) in c.to_metadata() {
                assert_eq!(f.get(&k), Some(&v), "{k}");
            }
            // Values are finite after decoding.
            for spec in &specs {
                let info = f.tensor(&spec.name).unwrap();
                let vals = tessera_ops::host::decode(info.dtype, f.tensor_data(&spec.name).unwrap());
                assert!(vals.iter().all(|x| x.is_finite()), "{}", spec.name);
            }
            std::fs::remove_file(&path).unwrap();
        }
    }
}

#[test]
fn same_seed_same_file_other_seed_other_file() {
    let (_, a) = synth("tiny-moe", DType::Q8_0, 11, "a");
    let (_, b) = synth("tiny-moe", DType::Q8_0, 11, "b");
    let (_, c) = synth("tiny-moe", DType::Q8_0, 12, "c");
    let (a_bytes, b_bytes, c_bytes) =
        (std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap(), std::fs::read(&c).unwrap());
    assert_eq!(a_bytes, b_bytes);
    assert_ne!(a_bytes, c_bytes);
    for p in [a, b, c] {
        std::fs::remove_file(p).unwrap();
    }
}

#[test]
fn progress_reaches_total() {
    let c = ModelConfig::preset("tiny").unwrap();
    let path = temp("progress");
    let mut last = SynthProgress { bytes_written: 1, total_bytes: 0 };
    let mut calls = 0;
    let mut cb = |p: SynthProgress| {
        assert!(p.bytes_written <= p.total_bytes);
        last = p;
        calls += 1;
    };
    let report = synthesize(&c, DType::F16, 1, &path, Some(&mut cb)).unwrap();
    assert!(calls > 2);
    assert_eq!(last.bytes_written, last.total_bytes);
    assert_eq!(last.total_bytes, report.data_bytes);
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.tensors().iter().map(|t| t.size as u64).sum::<u64>(), report.data_bytes);
    std::fs::remove_file(path).unwrap();
}

/// A copy of `f` with `edit` applied to the metadata and tensor list (tensor bytes zeroed).
fn rewrite(
    f: &GgufFile,
    keep_kv: impl Fn(&str) -> bool,
    extra_kv: Vec<(String, Value)>,
    tensor: impl Fn(&str, &[usize]) -> Option<Vec<usize>>,
) -> GgufFile {
    let mut w = GgufWriter::new();
    for (k, v) in f.metadata() {
        if keep_kv(k) {
            let v = extra_kv.iter().find(|(ek, _)| ek == k).map_or_else(|| v.clone(), |(_, ev)| ev.clone());
            w.add_kv(k.clone(), v).unwrap();
        }
    }
    for (k, v) in &extra_kv {
        if f.get(k).is_none() {
            w.add_kv(k.clone(), v.clone()).unwrap();
        }
    }
    for t in f.tensors() {
        if let Some(dims) = tensor(&t.name, t.dims()) {
            let size = t.dtype.row_bytes(dims[0]).unwrap() * dims[1..].iter().product::<usize>();
            w.add_tensor(t.name.clone(), t.dtype, &dims, vec![0u8; size]).unwrap();
        }
    }
    GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap()
}

/// A synthesized file for one test: `tag` keeps tests that run in parallel off each other's files.
fn tiny_file(preset: &str, tag: &str) -> (ModelConfig, GgufFile, PathBuf) {
    let (c, path) = synth(preset, DType::F32, 5, tag);
    let f = GgufFile::open(&path).unwrap();
    (c, f, path)
}

#[test]
fn missing_tensor_and_wrong_shape_are_named() {
    let (c, f, path) = tiny_file("tiny", "err1");
    let missing = rewrite(&f, |_| true, vec![], |n, d| (n != "blk.1.attn_k_norm.weight").then(|| d.to_vec()));
    let e = c.validate_tensors(&missing).unwrap_err();
    assert!(e.to_string().contains("`blk.1.attn_k_norm.weight` is missing"), "{e}");

    let wrong =
        rewrite(&f, |_| true, vec![], |n, d| Some(if n == "blk.0.ssm_out.weight" { vec![64, 32] } else { d.to_vec() }));
    match c.validate_tensors(&wrong) {
        Err(ConfigError::Tensors { problems }) => assert_eq!(
            problems,
            [TensorProblem::WrongShape {
                name: "blk.0.ssm_out.weight".into(),
                expected: [64, 64, 1, 1],
                found: [64, 32, 1, 1]
            }]
        ),
        other => panic!("{other:?}"),
    }
    std::fs::remove_file(path).unwrap();
}

#[test]
fn merged_gate_up_experts_are_accepted() {
    let (c, f, path) = tiny_file("tiny-moe", "err2");
    let merged = rewrite(
        &f,
        |_| true,
        vec![],
        |n, d| (!n.ends_with("ffn_up_exps.weight") && !n.ends_with("ffn_gate_exps.weight")).then(|| d.to_vec()),
    );
    assert!(c.validate_tensors(&merged).is_err());
    let mut w = GgufWriter::from_file(&merged).unwrap();
    for il in 0..c.n_layer {
        w.add_tensor(
            format!("blk.{il}.ffn_gate_up_exps.weight"),
            DType::F32,
            &[64, 128, 8],
            vec![0u8; 64 * 128 * 8 * 4],
        )
        .unwrap();
    }
    let merged = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
    c.validate_tensors(&merged).unwrap();
    std::fs::remove_file(path).unwrap();
}

#[test]
fn unknown_architecture_and_missing_key_are_named() {
    let (_, f, path) = tiny_file("tiny", "err3");
    let llama = rewrite(
        &f,
        |_| true,
        vec![("general.architecture".into(), Value::String("llama".into()))],
        |_, d| Some(d.to_vec()),
    );
    let e = ModelConfig::from_gguf(&llama).unwrap_err();
    assert!(matches!(&e, ConfigError::UnknownArchitecture { arch } if arch == "llama"), "{e}");
    assert!(e.to_string().contains("`llama`"));

    for key in ["qwen35.ssm.state_size", "qwen35.feed_forward_length", "qwen35.rope.dimension_sections"] {
        let g = rewrite(&f, |k| k != key, vec![], |_, d| Some(d.to_vec()));
        let e = ModelConfig::from_gguf(&g).unwrap_err().to_string();
        assert!(e.contains(key) && e.contains("missing"), "{key}: {e}");
    }
    std::fs::remove_file(path).unwrap();
}

#[test]
fn inconsistent_keys_are_named() {
    let (_, f, path) = tiny_file("tiny", "err4");
    let cases: [(&str, Value); 6] = [
        ("qwen35.attention.head_count_kv", Value::U32(3)),
        ("qwen35.ssm.inner_size", Value::U32(66)),
        ("qwen35.rope.dimension_count", Value::U32(48)),
        ("qwen35.attention.value_length", Value::U32(16)),
        ("qwen35.vocab_size", Value::U32(300)),
        ("qwen35.full_attention_interval", Value::U32(0)),
    ];
    for (key, v) in cases {
        let g = rewrite(&f, |_| true, vec![(key.to_string(), v)], |_, d| Some(d.to_vec()));
        let e = ModelConfig::from_gguf(&g).unwrap_err();
        assert!(matches!(&e, ConfigError::Inconsistent { key: k, .. } if k == key), "{key}: {e}");
        assert!(e.to_string().contains(key));
    }
    // A missing vocab_size falls back to token_embd's rows.
    let g = rewrite(&f, |k| k != "qwen35.vocab_size", vec![], |_, d| Some(d.to_vec()));
    assert_eq!(ModelConfig::from_gguf(&g).unwrap().n_vocab, 256);
    std::fs::remove_file(path).unwrap();
}

#[test]
fn metadata_round_trips_for_every_preset() {
    for name in ModelConfig::preset_names() {
        let c = ModelConfig::preset(name).unwrap();
        let mut w = GgufWriter::new();
        for (k, v) in c.to_metadata() {
            w.add_kv(k, v).unwrap();
        }
        if !c.tied_embeddings {
            // Tying is read from the presence of output.weight.
            w.add_tensor("output.weight", DType::F32, &[1], vec![0u8; 4]).unwrap();
        }
        let f = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
        assert_eq!(ModelConfig::from_gguf(&f).unwrap(), c, "{name}");
    }
    // Explicit recurrent layers override the interval and round trip too.
    let mut c = ModelConfig::preset("tiny").unwrap();
    if let Some(s) = c.ssm.as_mut() {
        s.recurrent_layers = Some(vec![false, true, true, false]);
    }
    c.validate().unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in c.to_metadata() {
        w.add_kv(k, v).unwrap();
    }
    w.add_tensor("output.weight", DType::F32, &[1], vec![0u8; 4]).unwrap();
    let back = ModelConfig::from_gguf(&GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap()).unwrap();
    assert_eq!(back, c);
    assert_eq!(back.tensor_specs().iter().filter(|s| s.name.ends_with("attn_q.weight")).count(), 2);
    assert!(back.tensor_specs().iter().any(|s| s.name == "blk.0.attn_q.weight"));
}

#[test]
fn tiny_preset_sizes() {
    let t = ModelConfig::preset("tiny").unwrap();
    let m = ModelConfig::preset("tiny-moe").unwrap();
    assert!(t.n_params() < 200_000, "{}", t.n_params());
    assert!(m.n_params() < 600_000, "{}", m.n_params());
    assert_eq!(t.tensor_specs().len(), 3 + 2 * (2 + 9 + 3) + 2 * (2 + 6 + 3));
}

#[test]
fn uploaded_synthetic_weights_are_the_file_s_weights() {
    use tessera_cpu::CpuBackend;
    use tessera_models::model::{Logits, Model, ModelOptions};
    for (preset, dtype) in [("tiny", DType::F32), ("tiny-moe", DType::Q8_0), ("tiny-moe", DType::NvFp4)] {
        let c = ModelConfig::preset(preset).unwrap();
        let path = std::env::temp_dir().join(format!("tessera_upload_{preset}_{dtype}_{}.gguf", std::process::id()));
        synthesize(&c, dtype, 9, &path, None).unwrap();
        let file = tessera_models::gguf::GgufFile::open(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        let mut be = CpuBackend::new();
        let opts = ModelOptions { kv_blocks: 16, block_size: 4, max_context: 32, ..ModelOptions::default() };
        let mut from_file = Model::load(&file, &mut be, opts).unwrap();
        let mut uploaded = Model::synthetic(c.clone(), dtype, 9, &mut be, opts).unwrap();
        let prompt = [3u32, 1, 4, 1, 5, 9, 2, 6];
        let a = from_file.step(&mut be, &[(0, &prompt)], Logits::All).unwrap();
        let b = uploaded.step(&mut be, &[(0, &prompt)], Logits::All).unwrap();
        assert_eq!(a, b, "{preset} {dtype}: the uploaded weights differ from the file's");
        for name in c.tensor_specs().iter().map(|s| s.name.clone()) {
            let (x, y) = (from_file.weights.get(&name).unwrap(), uploaded.weights.get(&name).unwrap());
            assert_eq!(x.meta, y.meta, "{name}");
        }
        from_file.free(&mut be);
        uploaded.free(&mut be);
        assert_eq!(be.allocated(), 0);
    }
    // a config the synthesizer refuses is an error, not a partial upload
    let mut be = CpuBackend::new();
    let c = ModelConfig::preset("tiny").unwrap();
    let e = Model::synthetic(c, DType::I32, 1, &mut be, ModelOptions::default()).unwrap_err();
    assert!(e.to_string().contains("not supported for synthesis"), "{e}");
    assert_eq!(be.allocated(), 0);
}
