//! Issue 23, item 3 (the checkpoint half): a checkpoint whose tensors disagree with its config is
//! an error (or, where transformers also accepts it, a warning), never silent; non-finite weights
//! are named at conversion and refused unless `allow_nonfinite`. Each case is a small checkpoint
//! directory made here from the `fixtures/hf` models.

mod common;

use common::{Counting, StTensor, f32_bytes, fixture_config, fixture_tensors, temp_dir, write_checkpoint};
use safetensors::Dtype;
use serde_json::{Value as Json, json};
use tessera_models::convert::{ConvertError, ConvertOptions, convert, convert_with_options};
use tessera_models::gguf::GgufFile;
use tessera_ops::DType;

#[global_allocator]
static ALLOC: Counting = Counting;

/// Converts `tensors` with `config` in a fresh directory; returns the result and the output's
/// bytes (`None` when no output exists afterwards).
fn convert_case(
    config: &Json,
    tensors: &[StTensor],
    opts: ConvertOptions,
) -> (Result<tessera_models::convert::ConvertReport, ConvertError>, Option<GgufFile>) {
    let dir = temp_dir("convert");
    write_checkpoint(&dir, config, tensors);
    let out = dir.join("out.gguf");
    let r = convert_with_options(&dir, &out, &opts, None);
    let file = out.exists().then(|| GgufFile::from_bytes(std::fs::read(&out).unwrap()).unwrap());
    // Nothing but the inputs and (on success) the output: no temporary left behind.
    let names: Vec<String> =
        std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert!(names.iter().all(|n| ["config.json", "model.safetensors", "out.gguf"].contains(&n.as_str())), "{names:?}");
    std::fs::remove_dir_all(dir).unwrap();
    (r, file)
}

fn f32_opts() -> ConvertOptions {
    ConvertOptions::new(DType::F32)
}

/// The fixture's tensors with `name`'s values replaced by `f(index, value)`.
fn edit_values(mut tensors: Vec<StTensor>, name: &str, f: impl Fn(usize, f32) -> f32) -> Vec<StTensor> {
    let t = tensors.iter_mut().find(|t| t.0 == name).unwrap_or_else(|| panic!("{name}"));
    assert_eq!(t.1, Dtype::F32);
    let v: Vec<f32> = t.3.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    t.3 = f32_bytes(&v.iter().enumerate().map(|(i, &x)| f(i, x)).collect::<Vec<_>>());
    tensors
}

#[test]
fn untied_config_without_lm_head_is_an_error() {
    // It used to convert as tied, silently.
    let config = fixture_config("qwen35-dense");
    assert_eq!(config["tie_word_embeddings"], json!(false));
    let tensors: Vec<StTensor> =
        fixture_tensors("qwen35-dense").into_iter().filter(|t| t.0 != "lm_head.weight").collect();
    let (r, out) = convert_case(&config, &tensors, f32_opts());
    let e = r.unwrap_err();
    assert!(matches!(e, ConvertError::UntiedWithoutLmHead), "{e}");
    assert!(e.to_string().contains("lm_head.weight") && e.to_string().contains("tie_word_embeddings"), "{e}");
    assert!(out.is_none());
    // Declared tied, the same checkpoint converts, without output.weight.
    let mut tied = config.clone();
    tied["tie_word_embeddings"] = json!(true);
    let (r, out) = convert_case(&tied, &tensors, f32_opts());
    assert!(r.unwrap().warnings.is_empty());
    assert!(out.unwrap().tensor("output.weight").is_none());
}

#[test]
fn lm_head_of_a_tied_config_is_a_warning() {
    let mut config = fixture_config("qwen35-dense");
    config["tie_word_embeddings"] = json!(true);
    let (r, out) = convert_case(&config, &fixture_tensors("qwen35-dense"), f32_opts());
    let report = r.unwrap();
    assert_eq!(report.warnings.len(), 1, "{:?}", report.warnings);
    assert!(report.warnings[0].contains("lm_head.weight") && report.warnings[0].contains("ignored"));
    assert!(out.unwrap().tensor("output.weight").is_none());
    // A head equal to the embedding is no news.
    let tensors = fixture_tensors("qwen35-dense");
    let embd = tensors.iter().find(|t| t.0 == "model.embed_tokens.weight").unwrap().3.clone();
    let tensors: Vec<StTensor> =
        tensors.into_iter().map(|t| if t.0 == "lm_head.weight" { (t.0, t.1, t.2, embd.clone()) } else { t }).collect();
    let (r, _) = convert_case(&config, &tensors, f32_opts());
    assert!(r.unwrap().warnings.is_empty());
}

#[test]
fn layers_beyond_the_config_are_named() {
    // A 4-layer config on the 8-layer checkpoint: 4 layers used to be dropped without a word.
    let mut config = fixture_config("qwen35-dense");
    config["num_hidden_layers"] = json!(4);
    let types = config["layer_types"].as_array().unwrap()[..4].to_vec();
    config["layer_types"] = Json::Array(types);
    let tensors = fixture_tensors("qwen35-dense");
    let beyond = tensors
        .iter()
        .filter(|t| ["4", "5", "6", "7"].iter().any(|l| t.0.starts_with(&format!("model.layers.{l}."))))
        .count();
    assert_eq!(beyond, 3 * 14 + 11);
    let (r, out) = convert_case(&config, &tensors, f32_opts());
    let e = r.unwrap_err();
    match &e {
        ConvertError::ExtraLayers { n_layer: 4, names, count } => {
            assert_eq!(*count, beyond, "{names:?}");
            assert!(names.iter().all(|n| n.starts_with("model.layers.") && !n.starts_with("model.layers.0")));
        }
        other => panic!("{other}"),
    }
    let msg = e.to_string();
    assert!(msg.contains("num_hidden_layers = 4") && msg.contains("model.layers.4."), "{msg}");
    assert!(out.is_none());
}

#[test]
fn unknown_tensors_are_named_and_known_extras_skipped() {
    let config = fixture_config("qwen35-dense");
    let extra = |name: &str| (name.to_string(), Dtype::F32, vec![4], f32_bytes(&[0.0; 4]));
    let mut tensors = fixture_tensors("qwen35-dense");
    tensors.push(extra("model.layers.0.mlp.mystery.weight"));
    tensors.push(extra("model.something_else"));
    let (r, out) = convert_case(&config, &tensors, f32_opts());
    let e = r.unwrap_err();
    assert!(matches!(&e, ConvertError::UnknownTensors { count: 2, .. }), "{e}");
    let msg = e.to_string();
    assert!(msg.contains("model.layers.0.mlp.mystery.weight") && msg.contains("model.something_else"), "{msg}");
    assert!(out.is_none());
    // MTP, vision and rotary buffers are skipped by rule: converted, no warning.
    let mut tensors = fixture_tensors("qwen35-dense");
    for n in ["mtp.fc.weight", "mtp.layers.0.input_layernorm.weight", "model.visual.blocks.0.attn.qkv.weight"] {
        tensors.push(extra(n));
    }
    tensors.push(extra("model.layers.3.self_attn.rotary_emb.inv_freq"));
    let (r, out) = convert_case(&config, &tensors, f32_opts());
    assert!(r.unwrap().warnings.is_empty());
    assert!(out.is_some());
}

#[test]
fn wrong_shapes_and_dtypes_are_named_before_writing() {
    let config = fixture_config("qwen35-dense");
    let tensors: Vec<StTensor> = fixture_tensors("qwen35-dense")
        .into_iter()
        .map(|t| {
            if t.0 == "model.layers.2.mlp.up_proj.weight" {
                let half = t.3.len() / 2;
                (t.0, t.1, vec![48, 64], t.3[..half].to_vec())
            } else {
                t
            }
        })
        .collect();
    let (r, out) = convert_case(&config, &tensors, f32_opts());
    let e = r.unwrap_err().to_string();
    assert!(e.contains("model.layers.2.mlp.up_proj.weight") && e.contains("[48, 64]"), "{e}");
    assert!(out.is_none());
    let tensors: Vec<StTensor> = fixture_tensors("qwen35-dense")
        .into_iter()
        .map(|t| if t.0 == "model.norm.weight" { (t.0, Dtype::I32, t.2, t.3) } else { t })
        .collect();
    let (r, _) = convert_case(&config, &tensors, f32_opts());
    let e = r.unwrap_err().to_string();
    assert!(e.contains("model.norm.weight") && e.contains("I32"), "{e}");
}

#[test]
fn non_finite_weights_are_named_in_every_dtype() {
    let config = fixture_config("qwen35-dense");
    let up = "model.layers.0.mlp.up_proj.weight";
    // Row 5 of the GGUF tensor (torch row 5 of [96, 64]), column 7.
    let at = 5 * 64 + 7;
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let tensors = edit_values(fixture_tensors("qwen35-dense"), up, |i, x| if i == at { bad } else { x });
        for dtype in [DType::F32, DType::F16, DType::BF16, DType::Q8_0, DType::NvFp4] {
            let (r, out) = convert_case(&config, &tensors, ConvertOptions::new(dtype));
            match r {
                Err(ConvertError::NonFinite { gguf, source_name, count, row, col, first, .. }) => {
                    assert_eq!((gguf.as_str(), source_name.as_str()), ("blk.0.ffn_up.weight", up));
                    assert_eq!((count, row, col), (1, 5, 7));
                    assert!(first.is_nan() == bad.is_nan() && (bad.is_nan() || first == bad), "{first}");
                }
                other => panic!("{bad} {dtype}: {other:?}"),
            }
            assert!(out.is_none(), "{dtype}: no output");
            // Allowed: converted, with a warning naming the tensor.
            let opts = ConvertOptions { dtype, allow_nonfinite: true };
            let (r, out) = convert_case(&config, &tensors, opts);
            let report = r.unwrap();
            assert_eq!(report.warnings.len(), 1, "{:?}", report.warnings);
            assert!(report.warnings[0].contains("blk.0.ffn_up.weight"), "{:?}", report.warnings);
            let f = out.unwrap();
            if dtype == DType::F32 {
                let b = &f.tensor_data("blk.0.ffn_up.weight").unwrap()[at * 4..at * 4 + 4];
                let got = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                assert!(got.is_nan() == bad.is_nan() && (bad.is_nan() || got == bad));
            }
        }
    }
}

#[test]
fn magnitudes_beyond_the_storage_dtype_are_named() {
    let config = fixture_config("qwen35-dense");
    let up = "model.layers.1.mlp.up_proj.weight";
    let tensors = edit_values(fixture_tensors("qwen35-dense"), up, |i, x| if i == 100 { 1e30 } else { x });
    // f32 and bf16 hold 1e30; f16 (max 65504), q8_0 (an f16 block scale) and nvfp4 (at most 2688,
    // beyond it values are clipped) do not.
    for (dtype, fits) in
        [(DType::F32, true), (DType::BF16, true), (DType::F16, false), (DType::Q8_0, false), (DType::NvFp4, false)]
    {
        let (r, _) = convert_case(&config, &tensors, ConvertOptions::new(dtype));
        match (fits, r) {
            (true, Ok(report)) => assert!(report.warnings.is_empty()),
            (false, Err(e @ ConvertError::NonFinite { .. })) => {
                let m = e.to_string();
                assert!(
                    m.contains("blk.1.ffn_up.weight") && m.contains(&dtype.to_string()) && m.contains("1e30"),
                    "{m}"
                );
            }
            (_, other) => panic!("{dtype}: {other:?}"),
        }
    }
}

#[test]
fn values_made_non_finite_by_the_transforms_are_named() {
    // ssm_a = -exp(A_log): A_log = 100 is finite, its ssm_a is -inf in f32.
    let config = fixture_config("qwen35-dense");
    let a_log = "model.layers.0.linear_attn.A_log";
    let tensors = edit_values(fixture_tensors("qwen35-dense"), a_log, |i, x| if i == 2 { 100.0 } else { x });
    let (r, _) = convert_case(&config, &tensors, f32_opts());
    match r {
        Err(ConvertError::NonFinite { gguf, source_name, count: 1, first, .. }) => {
            assert_eq!((gguf.as_str(), source_name.as_str(), first), ("blk.0.ssm_a", a_log, f32::NEG_INFINITY));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn fixtures_convert_without_warnings() {
    for name in ["qwen35-dense", "qwen35moe"] {
        let dir = common::fixture(name);
        let out = temp_dir("fixture").join("x.gguf");
        let report = convert(&dir, &out, DType::NvFp4).unwrap();
        assert!(report.warnings.is_empty(), "{name}: {:?}", report.warnings);
        std::fs::remove_dir_all(out.parent().unwrap()).unwrap();
    }
}
