//! `convert --from-hf` for `Qwen3ForCausalLM` / `Qwen3MoeForCausalLM`: a synthetic `qwen3-tiny` /
//! `qwen3moe-tiny` GGUF is written out as a HF checkpoint (transformers' names and shapes, experts
//! per expert or fused), converted back, and must give the same config and the same tensors bit
//! for bit; configs llama.cpp's qwen3moe cannot express are refused.

mod common;

use common::{StTensor, temp_dir, write_checkpoint};
use safetensors::Dtype;
use serde_json::{Value as Json, json};
use tessera_models::config::{Ffn, ModelConfig};
use tessera_models::convert::{ConvertError, convert};
use tessera_models::gguf::GgufFile;
use tessera_ops::DType;

mod synth_file;
use synth_file::synth_file;

/// The `config.json` transformers writes for `c`.
fn hf_config(c: &ModelConfig) -> Json {
    let mut j = json!({
        "architectures": [if c.arch.name() == "qwen3" { "Qwen3ForCausalLM" } else { "Qwen3MoeForCausalLM" }],
        "model_type": if c.arch.name() == "qwen3" { "qwen3" } else { "qwen3_moe" },
        "num_hidden_layers": c.n_layer,
        "hidden_size": c.n_embd,
        "num_attention_heads": c.n_head,
        "num_key_value_heads": c.n_head_kv,
        "head_dim": c.head_dim,
        "vocab_size": c.n_vocab,
        "max_position_embeddings": c.n_ctx_train,
        "rms_norm_eps": c.rms_eps,
        "rope_theta": c.rope_freq_base,
        "tie_word_embeddings": c.tied_embeddings,
        "attention_bias": false,
        "torch_dtype": "float32",
    });
    match c.ffn {
        Ffn::Dense { n_ff } => j["intermediate_size"] = json!(n_ff),
        Ffn::Moe { n_expert, n_expert_used, n_ff_exp, .. } => {
            j["intermediate_size"] = json!(n_ff_exp * 3);
            j["num_experts"] = json!(n_expert);
            j["num_experts_per_tok"] = json!(n_expert_used);
            j["moe_intermediate_size"] = json!(n_ff_exp);
            j["norm_topk_prob"] = json!(true);
            j["decoder_sparse_step"] = json!(1);
            j["mlp_only_layers"] = json!([]);
        }
    }
    j
}

/// The HF name of a GGUF tensor (the inverse of the converter's table), for non-expert tensors.
fn hf_name(gguf: &str) -> String {
    let global = [("token_embd.weight", "model.embed_tokens.weight"), ("output_norm.weight", "model.norm.weight")];
    if let Some((_, h)) = global.iter().find(|(g, _)| *g == gguf) {
        return h.to_string();
    }
    if gguf == "output.weight" {
        return "lm_head.weight".into();
    }
    let (il, t) = gguf.strip_prefix("blk.").unwrap().split_once('.').unwrap();
    let rest = match t {
        "attn_norm.weight" => "input_layernorm.weight",
        "ffn_norm.weight" => "post_attention_layernorm.weight",
        "attn_q.weight" => "self_attn.q_proj.weight",
        "attn_k.weight" => "self_attn.k_proj.weight",
        "attn_v.weight" => "self_attn.v_proj.weight",
        "attn_output.weight" => "self_attn.o_proj.weight",
        "attn_q_norm.weight" => "self_attn.q_norm.weight",
        "attn_k_norm.weight" => "self_attn.k_norm.weight",
        "ffn_gate.weight" => "mlp.gate_proj.weight",
        "ffn_up.weight" => "mlp.up_proj.weight",
        "ffn_down.weight" => "mlp.down_proj.weight",
        "ffn_gate_inp.weight" => "mlp.gate.weight",
        other => panic!("no HF name for {other}"),
    };
    format!("model.layers.{il}.{rest}")
}

/// The HF checkpoint of an f32 GGUF of the family: torch shapes are ggml's reversed (same bytes);
/// experts per expert, or fused as transformers 5 may save them.
fn hf_tensors(f: &GgufFile, fused: bool) -> Vec<StTensor> {
    let mut out: Vec<StTensor> = Vec::new();
    for t in f.tensors() {
        let data = f.tensor_data(&t.name).unwrap().to_vec();
        let torch: Vec<usize> = t.dims().iter().rev().copied().collect();
        let Some(which) =
            ["gate", "up", "down"].into_iter().find(|w| t.name.ends_with(&format!("ffn_{w}_exps.weight")))
        else {
            out.push((hf_name(&t.name), Dtype::F32, torch, data));
            continue;
        };
        let il = t.name.strip_prefix("blk.").unwrap().split_once('.').unwrap().0;
        let p = format!("model.layers.{il}.mlp.experts");
        let (n_expert, per) = (torch[0], data.len() / torch[0]);
        if !fused {
            for e in 0..n_expert {
                let name = format!("{p}.{e}.{which}_proj.weight");
                out.push((name, Dtype::F32, torch[1..].to_vec(), data[e * per..(e + 1) * per].to_vec()));
            }
        } else if which == "down" {
            out.push((format!("{p}.down_proj"), Dtype::F32, torch, data));
        } else if which == "gate" {
            // gate and up interleaved per expert: [E, 2·ff, n_embd], gate rows first
            let up = f.tensor_data(&t.name.replace("gate_exps", "up_exps")).unwrap();
            let mut both = Vec::with_capacity(2 * data.len());
            for e in 0..n_expert {
                both.extend(&data[e * per..(e + 1) * per]);
                both.extend(&up[e * per..(e + 1) * per]);
            }
            out.push((format!("{p}.gate_up_proj"), Dtype::F32, vec![n_expert, 2 * torch[1], torch[2]], both));
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn round_trip(preset: &str, fused: bool) {
    let f = synth_file(preset, DType::F32, 7);
    let config = ModelConfig::from_gguf(&f).unwrap();
    let dir = temp_dir("convert_qwen3");
    write_checkpoint(&dir, &hf_config(&config), &hf_tensors(&f, fused));
    let out = dir.join("out.gguf");
    let report = convert(&dir, &out, DType::F32).unwrap();
    assert!(report.warnings.is_empty(), "{preset}: {:?}", report.warnings);
    assert_eq!(report.config, config, "{preset}");
    let g = GgufFile::open(&out).unwrap();
    assert_eq!(g.get_str("general.architecture").unwrap(), config.arch.name());
    assert_eq!(g.tensors().len(), f.tensors().len(), "{preset}");
    for t in f.tensors() {
        assert_eq!(g.tensor(&t.name).unwrap().ne, t.ne, "{preset} {}", t.name);
        assert_eq!(g.tensor_data(&t.name).unwrap(), f.tensor_data(&t.name).unwrap(), "{preset} {}", t.name);
    }
    drop(g);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn dense_checkpoint_converts_back_to_the_same_tensors() {
    round_trip("qwen3-tiny", false);
}

#[test]
fn moe_checkpoint_per_expert_and_fused_convert_back_to_the_same_tensors() {
    round_trip("qwen3moe-tiny", false);
    round_trip("qwen3moe-tiny", true);
}

fn convert_err(preset: &str, edit: impl Fn(&mut Json)) -> ConvertError {
    let f = synth_file(preset, DType::F32, 7);
    let mut cfg = hf_config(&ModelConfig::from_gguf(&f).unwrap());
    edit(&mut cfg);
    let dir = temp_dir("convert_qwen3_err");
    write_checkpoint(&dir, &cfg, &hf_tensors(&f, false));
    let e = convert(&dir, &dir.join("out.gguf"), DType::F32).unwrap_err();
    assert!(!dir.join("out.gguf").exists());
    std::fs::remove_dir_all(&dir).unwrap();
    e
}

#[test]
fn what_llama_cpp_cannot_express_is_refused() {
    let e = convert_err("qwen3moe-tiny", |c| c["norm_topk_prob"] = json!(false)).to_string();
    assert!(e.contains("norm_topk_prob"), "{e}");
    let e = convert_err("qwen3moe-tiny", |c| c["mlp_only_layers"] = json!([1])).to_string();
    assert!(e.contains("mlp_only_layers"), "{e}");
    let e = convert_err("qwen3-tiny", |c| c["attention_bias"] = json!(true)).to_string();
    assert!(e.contains("attention_bias"), "{e}");
    let e = convert_err("qwen3-tiny", |c| c["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0})).to_string();
    assert!(e.contains("yarn"), "{e}");
    // a GGUF-level check names the config.json key
    let e = convert_err("qwen3-tiny", |c| c["num_key_value_heads"] = json!(3)).to_string();
    assert!(e.contains("num_key_value_heads"), "{e}");
    // a missing tensor names the GGUF tensor it feeds
    let f = synth_file("qwen3-tiny", DType::F32, 7);
    let dir = temp_dir("convert_qwen3_missing");
    let mut t = hf_tensors(&f, false);
    t.retain(|x| x.0 != "model.layers.1.self_attn.k_norm.weight");
    write_checkpoint(&dir, &hf_config(&ModelConfig::from_gguf(&f).unwrap()), &t);
    let e = convert(&dir, &dir.join("out.gguf"), DType::F32).unwrap_err().to_string();
    assert!(e.contains("model.layers.1.self_attn.k_norm.weight") && e.contains("blk.1.attn_k_norm.weight"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
