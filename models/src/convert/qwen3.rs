//! The `qwen3` / `qwen3moe` converter (`Qwen3ForCausalLM`, `Qwen3MoeForCausalLM`): the
//! `config.json` keys, and the tensors as a table ([`TENSORS`]). Every tensor is copied as it is:
//! Qwen3's RMS norms compute `x·w` (no `+1`, unlike Qwen3.5's), and `q_proj` has no gate.
//! Experts are per expert (`mlp.experts.N.*_proj.weight`) or fused (`mlp.experts.gate_up_proj`
//! `[E, 2·ff, n_embd]`, gate rows first, and `mlp.experts.down_proj` `[E, n_embd, ff]`).
//!
//! What llama.cpp's `qwen3moe` cannot express is refused: `norm_topk_prob: false` (llama.cpp
//! always renormalises the top-k weights), dense layers among the MoE ones (`mlp_only_layers`,
//! `decoder_sparse_step` other than 1), attention biases, and rope scaling.

use serde_json::Value as Json;

use super::HfHow::{Experts, Same};
use super::{HfTensor, R, cfg_err, field, get_usize, hf, opt_f64, opt_usize, positive};
use crate::config::{Arch, Ffn, MAX_LAYERS, ModelConfig};

/// GGUF tensor ← checkpoint tensor, both variants (a config has the rows its
/// [`crate::arch::qwen3`] tensor list names).
pub(super) static TENSORS: &[HfTensor] = &[
    hf("token_embd.weight", "{p}embed_tokens.weight", Same),
    hf("output_norm.weight", "{p}norm.weight", Same),
    hf("output.weight", "lm_head.weight", Same),
    hf("attn_norm.weight", "{p}layers.{i}.input_layernorm.weight", Same),
    hf("attn_q.weight", "{p}layers.{i}.self_attn.q_proj.weight", Same),
    hf("attn_k.weight", "{p}layers.{i}.self_attn.k_proj.weight", Same),
    hf("attn_v.weight", "{p}layers.{i}.self_attn.v_proj.weight", Same),
    hf("attn_output.weight", "{p}layers.{i}.self_attn.o_proj.weight", Same),
    hf("attn_q_norm.weight", "{p}layers.{i}.self_attn.q_norm.weight", Same),
    hf("attn_k_norm.weight", "{p}layers.{i}.self_attn.k_norm.weight", Same),
    hf("ffn_norm.weight", "{p}layers.{i}.post_attention_layernorm.weight", Same),
    hf("ffn_gate.weight", "{p}layers.{i}.mlp.gate_proj.weight", Same),
    hf("ffn_up.weight", "{p}layers.{i}.mlp.up_proj.weight", Same),
    hf("ffn_down.weight", "{p}layers.{i}.mlp.down_proj.weight", Same),
    hf("ffn_gate_inp.weight", "{p}layers.{i}.mlp.gate.weight", Same),
    hf(
        "ffn_gate_exps.weight",
        "{p}layers.{i}.mlp.experts.{e}.gate_proj.weight",
        Experts { fused: "{p}layers.{i}.mlp.experts.gate_up_proj", half: Some(0) },
    ),
    hf(
        "ffn_up_exps.weight",
        "{p}layers.{i}.mlp.experts.{e}.up_proj.weight",
        Experts { fused: "{p}layers.{i}.mlp.experts.gate_up_proj", half: Some(1) },
    ),
    hf(
        "ffn_down_exps.weight",
        "{p}layers.{i}.mlp.experts.{e}.down_proj.weight",
        Experts { fused: "{p}layers.{i}.mlp.experts.down_proj", half: None },
    ),
];

/// The config of a Qwen3 / Qwen3-MoE `config.json` (`c` its text config; validated by the
/// caller). Defaults are transformers' (`Qwen3Config`, `Qwen3MoeConfig`) where a key may be
/// absent.
pub(super) fn config_from_hf(arch: Arch, json: &Json, c: &Json) -> R<ModelConfig> {
    let n_layer = get_usize(c, "num_hidden_layers")?;
    if n_layer > MAX_LAYERS {
        return Err(cfg_err(format!(
            "`num_hidden_layers` is {n_layer}, above Tessera's limit of {MAX_LAYERS} layers (far above any real model)"
        )));
    }
    let n_embd = get_usize(c, "hidden_size")?;
    let n_head = get_usize(c, "num_attention_heads")?;
    let head_dim = match opt_usize(c, "head_dim")? {
        Some(d) => d,
        None => n_embd.checked_div(n_head).ok_or_else(|| cfg_err("`num_attention_heads` is 0"))?,
    };
    let rope = field(c, "rope_parameters").or_else(|| field(c, "rope_scaling"));
    if let Some(kind) = rope.and_then(|r| field(r, "rope_type").or_else(|| field(r, "type")))
        && kind.as_str() != Some("default")
    {
        return Err(cfg_err(format!("rope scaling `rope_type` {kind} is not supported (only plain rope)")));
    }
    let rope_theta = match rope.map(|r| opt_f64(r, "rope_theta")).transpose()?.flatten() {
        Some(v) => v,
        None => opt_f64(c, "rope_theta")?.unwrap_or(10_000.0),
    };
    let flag = |key: &str, default: bool| -> R<bool> {
        match field(c, key).or_else(|| field(json, key)) {
            None => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| cfg_err(format!("`{key}` is {v}, expected a bool"))),
        }
    };
    if flag("attention_bias", false)? {
        return Err(cfg_err("`attention_bias` is true: llama.cpp's qwen3 attention has no biases"));
    }
    let ffn = if arch.name() == "qwen3moe" {
        if !flag("norm_topk_prob", false)? {
            return Err(cfg_err(
                "`norm_topk_prob` is false (or absent): llama.cpp's qwen3moe always renormalises the top-k weights",
            ));
        }
        if opt_usize(c, "decoder_sparse_step")?.unwrap_or(1) != 1
            || field(c, "mlp_only_layers").and_then(Json::as_array).is_some_and(|a| !a.is_empty())
        {
            return Err(cfg_err("dense layers among the MoE ones (`mlp_only_layers`, `decoder_sparse_step`)"));
        }
        Ffn::Moe {
            // (transformers 5 writes `num_local_experts`, earlier versions `num_experts`)
            n_expert: match opt_usize(c, "num_experts")? {
                Some(n) => n,
                None => get_usize(c, "num_local_experts")?,
            },
            n_expert_used: get_usize(c, "num_experts_per_tok")?,
            n_ff_exp: get_usize(c, "moe_intermediate_size")?,
            n_ff_shexp: None,
        }
    } else {
        Ffn::Dense { n_ff: get_usize(c, "intermediate_size")? }
    };
    Ok(ModelConfig {
        arch,
        n_layer,
        n_ctx_train: opt_usize(c, "max_position_embeddings")?.unwrap_or(40_960),
        n_embd,
        n_vocab: get_usize(c, "vocab_size")?,
        n_head,
        n_head_kv: opt_usize(c, "num_key_value_heads")?.unwrap_or(n_head),
        head_dim,
        rms_eps: positive("rms_norm_eps", opt_f64(c, "rms_norm_eps")?.unwrap_or(1e-6))? as f32,
        rope_freq_base: positive("rope_theta", rope_theta)? as f32,
        n_rot: head_dim,
        rope_sections: None,
        ssm: None,
        nextn_predict_layers: 0,
        ffn,
        tied_embeddings: flag("tie_word_embeddings", false)?,
    })
}
