//! The `qwen35` / `qwen35moe` converter (Qwen3.5 / 3.6): `config.json` keys and the tensor
//! transforms of the module doc of [`super`] (norms `+1`, `ssm_a = -exp(A_log)`, the value-head
//! reorder, the `conv1d` layout, stacked or fused experts), coded by hand: they need the config's
//! head counts.

use serde_json::Value as Json;
use tessera_ops::DType;

use super::{
    Checkpoint, Entry, Map, R, RowMap, TensorPlan, VHeads, cfg_err, field, get_usize, opt_f64, opt_usize, positive,
};
use crate::config::{Arch, Dim, Ffn, LayerKind, MAX_LAYERS, ModelConfig, SsmConfig, TensorSpec};

/// The [`ModelConfig`] of a HF Qwen3.5 `config.json` (parsed; `c` its text config), validated
/// ([`ModelConfig::validate`]). A key that is present with the wrong type is an error, never a
/// default; `null` counts as absent. Errors name the `config.json` key and its value (and the GGUF
/// key when the check is [`ModelConfig::validate`]'s).
pub(super) fn config_from_hf(arch: Arch, json: &Json, c: &Json) -> R<ModelConfig> {
    let n_layer = get_usize(c, "num_hidden_layers")?;
    // Before anything is sized from it (`layer_types` below).
    if n_layer > MAX_LAYERS {
        return Err(cfg_err(format!(
            "`num_hidden_layers` is {n_layer}, above Tessera's limit of {MAX_LAYERS} layers (far above any real model)"
        )));
    }
    let head_dim = get_usize(c, "head_dim")?;
    let rope = field(c, "rope_parameters").or_else(|| field(c, "rope_scaling"));
    let rope_get = |key: &str| -> R<Option<f64>> {
        match rope.map(|r| opt_f64(r, key)).transpose()?.flatten() {
            Some(v) => Ok(Some(v)),
            None => opt_f64(c, key),
        }
    };
    let partial = rope_get("partial_rotary_factor")?.unwrap_or(1.0);
    if !(partial > 0.0 && partial <= 1.0) {
        return Err(cfg_err(format!("`partial_rotary_factor` is {partial}, must be in (0, 1]")));
    }
    let rope_theta = positive("rope_theta", rope_get("rope_theta")?.unwrap_or(10_000.0))?;
    let rms_eps = positive("rms_norm_eps", opt_f64(c, "rms_norm_eps")?.unwrap_or(1e-6))?;
    // In (0, head_dim]: partial is in (0, 1].
    let n_rot = (head_dim as f64 * partial).round() as usize;
    let mut rope_sections = [0usize; 4];
    match rope.and_then(|r| field(r, "mrope_section")) {
        Some(s) => {
            let s = s.as_array().ok_or_else(|| cfg_err(format!("`mrope_section` is {s}, expected an array")))?;
            if s.len() > 4 {
                return Err(cfg_err(format!("`mrope_section` has {} entries, at most 4", s.len())));
            }
            for (i, v) in s.iter().enumerate() {
                rope_sections[i] = v.as_u64().and_then(|v| usize::try_from(v).ok()).ok_or_else(|| {
                    cfg_err(format!("`mrope_section` entry {i} is {v}, expected a non-negative integer"))
                })?;
            }
            let sum = rope_sections.iter().try_fold(0usize, |a, &s| a.checked_add(s));
            if sum.is_none_or(|s| s == 0 || s > n_rot / 2) {
                let sum = sum.map_or_else(|| "overflows".to_string(), |s| format!("is {s}"));
                return Err(cfg_err(format!(
                    "`mrope_section` {rope_sections:?}: the sum {sum}; it must be > 0 and at most the rotated \
                     pairs, head_dim {head_dim} x partial_rotary_factor {partial} / 2 = {}",
                    n_rot / 2
                )));
            }
        }
        None => rope_sections[0] = n_rot / 2,
    }
    let interval = opt_usize(c, "full_attention_interval")?.unwrap_or(4);
    let recurrent: Option<Vec<bool>> = match field(c, "layer_types") {
        None => None,
        Some(types) => {
            let types =
                types.as_array().ok_or_else(|| cfg_err(format!("`layer_types` is {types}, expected an array")))?;
            if types.len() != n_layer {
                return Err(cfg_err(format!(
                    "`layer_types` has {} entries, num_hidden_layers is {n_layer}",
                    types.len()
                )));
            }
            let mut flags = Vec::with_capacity(n_layer);
            for t in types {
                match t.as_str() {
                    Some("linear_attention") => flags.push(true),
                    Some("full_attention") => flags.push(false),
                    _ => return Err(cfg_err(format!("unknown layer type {t} in `layer_types`"))),
                }
            }
            Some(flags)
        }
    };
    let ffn = if arch == Arch::QWEN35MOE {
        Ffn::Moe {
            n_expert: get_usize(c, "num_experts")?,
            n_expert_used: get_usize(c, "num_experts_per_tok")?,
            n_ff_exp: get_usize(c, "moe_intermediate_size")?,
            n_ff_shexp: Some(get_usize(c, "shared_expert_intermediate_size")?),
        }
    } else {
        Ffn::Dense { n_ff: get_usize(c, "intermediate_size")? }
    };
    let ssm_dt_rank = get_usize(c, "linear_num_value_heads")?;
    let value_head_dim = get_usize(c, "linear_value_head_dim")?;
    let ssm_d_inner = ssm_dt_rank.checked_mul(value_head_dim).ok_or_else(|| {
        cfg_err(format!("`linear_num_value_heads` {ssm_dt_rank} x `linear_value_head_dim` {value_head_dim} overflows"))
    })?;
    let tied = match field(c, "tie_word_embeddings").or_else(|| field(json, "tie_word_embeddings")) {
        None => false,
        Some(v) => v.as_bool().ok_or_else(|| cfg_err(format!("`tie_word_embeddings` is {v}, expected a bool")))?,
    };
    let mut config = ModelConfig {
        arch,
        n_layer,
        n_ctx_train: opt_usize(c, "max_position_embeddings")?.unwrap_or(4096),
        n_embd: get_usize(c, "hidden_size")?,
        n_vocab: get_usize(c, "vocab_size")?,
        n_head: get_usize(c, "num_attention_heads")?,
        n_head_kv: get_usize(c, "num_key_value_heads")?,
        head_dim,
        rms_eps: rms_eps as f32,
        rope_freq_base: rope_theta as f32,
        n_rot,
        rope_sections: Some(rope_sections),
        ssm: Some(SsmConfig {
            d_conv: get_usize(c, "linear_conv_kernel_dim")?,
            d_state: get_usize(c, "linear_key_head_dim")?,
            n_group: get_usize(c, "linear_num_key_heads")?,
            dt_rank: ssm_dt_rank,
            d_inner: ssm_d_inner,
            full_attention_interval: interval,
            recurrent_layers: recurrent.clone(),
        }),
        nextn_predict_layers: 0,
        ffn,
        tied_embeddings: tied,
    };
    super::validated(&config)?;
    // Keep the explicit per-layer flags only when the interval does not already say the same.
    if let Some(flags) = recurrent {
        let set = |c: &mut ModelConfig, r: Option<Vec<bool>>| {
            if let Some(s) = c.ssm.as_mut() {
                s.recurrent_layers = r;
            }
        };
        set(&mut config, None);
        let by_interval: Vec<bool> = (0..n_layer).map(|i| config.layer_kind(i) == LayerKind::GatedDeltaNet).collect();
        if by_interval != flags {
            set(&mut config, Some(flags));
        }
    }
    Ok(config)
}

/// Where the values of one GGUF tensor come from (ggml order = torch row-major with the axes
/// reversed), each source checked for presence, dtype and shape.
pub(super) fn plan_tensor<'c>(
    ck: &'c Checkpoint,
    c: &ModelConfig,
    prefix: &str,
    spec: &'c TensorSpec,
    dtype: DType,
    size: u64,
) -> R<TensorPlan<'c>> {
    let name = spec.name.as_str();
    let (e, v) = (c.n_embd, c.n_vocab);
    let n_rows = spec.ne[1..].iter().product::<usize>();
    let plan = |sources: Vec<&'c Entry>, rows: RowMap, cols: Option<VHeads>, map: Map| {
        let rows_each = n_rows.div_ceil(sources.len().max(1)).max(1);
        TensorPlan { spec, dtype, size, sources, rows_each, rows, cols, map }
    };
    let one = |hf: &str, shape: &[usize], rows: RowMap, cols: Option<VHeads>, map: Map| -> R<TensorPlan<'c>> {
        Ok(plan(vec![ck.source(hf, name, shape)?], rows, cols, map))
    };
    let same = |hf: &str, shape: &[usize]| one(hf, shape, RowMap::Same, None, Map::None);
    let norm = |hf: &str, shape: &[usize]| one(hf, shape, RowMap::Same, None, Map::PlusOne);
    match name {
        "token_embd.weight" => return same(&format!("{prefix}embed_tokens.weight"), &[v, e]),
        "output_norm.weight" => return norm(&format!("{prefix}norm.weight"), &[e]),
        "output.weight" => return same("lm_head.weight", &[v, e]),
        _ => {}
    }
    let unexpected = || cfg_err(format!("unexpected tensor {name}"));
    let rest = name.strip_prefix("blk.").ok_or_else(unexpected)?;
    let (il, t) = rest.split_once('.').ok_or_else(unexpected)?;
    let lp = format!("{prefix}layers.{il}.");
    let (hk, hv, sk, sv) =
        c.ssm.as_ref().map_or((1, 1, 0, 0), |s| (s.n_group, s.dt_rank, s.d_state, c.ssm_head_v_dim()));
    let r = hv / hk.max(1);
    let qk_dim = 2 * hk * sk;
    let value_dim = hv * sv;
    let conv_dim = c.ssm_conv_dim();
    let hd = c.head_dim;
    let heads = |start: usize, d: usize| VHeads { start, h_k: hk, r, d };
    let la = |s: &str| format!("{lp}linear_attn.{s}");
    let sa = |s: &str| format!("{lp}self_attn.{s}");
    let mlp = |s: &str| format!("{lp}mlp.{s}");
    match t {
        "attn_norm.weight" => norm(&format!("{lp}input_layernorm.weight"), &[e]),
        "post_attention_norm.weight" => norm(&format!("{lp}post_attention_layernorm.weight"), &[e]),
        // Full attention.
        "attn_q.weight" => same(&sa("q_proj.weight"), &[2 * hd * c.n_head, e]),
        "attn_k.weight" => same(&sa("k_proj.weight"), &[hd * c.n_head_kv, e]),
        "attn_v.weight" => same(&sa("v_proj.weight"), &[hd * c.n_head_kv, e]),
        "attn_output.weight" => same(&sa("o_proj.weight"), &[e, hd * c.n_head]),
        "attn_q_norm.weight" => norm(&sa("q_norm.weight"), &[hd]),
        "attn_k_norm.weight" => norm(&sa("k_norm.weight"), &[hd]),
        // Gated DeltaNet.
        "attn_qkv.weight" => {
            one(&la("in_proj_qkv.weight"), &[qk_dim + value_dim, e], RowMap::VHeads(heads(qk_dim, sv)), None, Map::None)
        }
        "attn_gate.weight" => {
            one(&la("in_proj_z.weight"), &[value_dim, e], RowMap::VHeads(heads(0, sv)), None, Map::None)
        }
        "ssm_conv1d.weight" => {
            let d_conv = c.dim(Dim::SsmConvKernel);
            one(&la("conv1d.weight"), &[conv_dim, 1, d_conv], RowMap::VHeads(heads(qk_dim, sv)), None, Map::None)
        }
        "ssm_dt.bias" => one(&la("dt_bias"), &[hv], RowMap::Same, Some(heads(0, 1)), Map::None),
        "ssm_a" => one(&la("A_log"), &[hv], RowMap::Same, Some(heads(0, 1)), Map::NegExp),
        "ssm_beta.weight" => one(&la("in_proj_b.weight"), &[hv, e], RowMap::VHeads(heads(0, 1)), None, Map::None),
        "ssm_alpha.weight" => one(&la("in_proj_a.weight"), &[hv, e], RowMap::VHeads(heads(0, 1)), None, Map::None),
        "ssm_norm.weight" => same(&la("norm.weight"), &[sv]),
        "ssm_out.weight" => one(&la("out_proj.weight"), &[e, value_dim], RowMap::Same, Some(heads(0, sv)), Map::None),
        // Dense FFN.
        "ffn_gate.weight" | "ffn_up.weight" | "ffn_down.weight" => {
            let Ffn::Dense { n_ff } = c.ffn else { return Err(unexpected()) };
            match t {
                "ffn_gate.weight" => same(&mlp("gate_proj.weight"), &[n_ff, e]),
                "ffn_up.weight" => same(&mlp("up_proj.weight"), &[n_ff, e]),
                _ => same(&mlp("down_proj.weight"), &[e, n_ff]),
            }
        }
        // MoE.
        _ => {
            let Ffn::Moe { n_expert, n_ff_exp, n_ff_shexp, .. } = c.ffn else {
                return Err(unexpected());
            };
            let n_ff_shexp = n_ff_shexp.unwrap_or(0);
            match t {
                "ffn_gate_inp.weight" => same(&mlp("gate.weight"), &[n_expert, e]),
                "ffn_gate_inp_shexp.weight" => same(&mlp("shared_expert_gate.weight"), &[1, e]),
                "ffn_gate_shexp.weight" => same(&mlp("shared_expert.gate_proj.weight"), &[n_ff_shexp, e]),
                "ffn_up_shexp.weight" => same(&mlp("shared_expert.up_proj.weight"), &[n_ff_shexp, e]),
                "ffn_down_shexp.weight" => same(&mlp("shared_expert.down_proj.weight"), &[e, n_ff_shexp]),
                "ffn_gate_exps.weight" | "ffn_up_exps.weight" => {
                    let gate = t == "ffn_gate_exps.weight";
                    let fused = mlp("experts.gate_up_proj");
                    if ck.has(&fused) {
                        // [E, 2·ff, n_embd], gate rows first then up.
                        let off = if gate { 0 } else { n_ff_exp };
                        one(&fused, &[n_expert, 2 * n_ff_exp, e], RowMap::Half { ff: n_ff_exp, off }, None, Map::None)
                    } else {
                        let which = if gate { "gate_proj" } else { "up_proj" };
                        let sources = (0..n_expert)
                            .map(|ex| ck.source(&mlp(&format!("experts.{ex}.{which}.weight")), name, &[n_ff_exp, e]))
                            .collect::<R<Vec<_>>>()?;
                        Ok(plan(sources, RowMap::Same, None, Map::None))
                    }
                }
                "ffn_down_exps.weight" => {
                    let fused = mlp("experts.down_proj");
                    if ck.has(&fused) {
                        same(&fused, &[n_expert, e, n_ff_exp])
                    } else {
                        let sources = (0..n_expert)
                            .map(|ex| ck.source(&mlp(&format!("experts.{ex}.down_proj.weight")), name, &[e, n_ff_exp]))
                            .collect::<R<Vec<_>>>()?;
                        Ok(plan(sources, RowMap::Same, None, Map::None))
                    }
                }
                _ => Err(unexpected()),
            }
        }
    }
}
