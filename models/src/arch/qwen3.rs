//! The `qwen3` / `qwen3moe` family (Qwen3 dense and Qwen3-MoE), built the way llama.cpp builds it
//! (`src/models/qwen3.cpp`, `qwen3moe.cpp`) from the public seams only.
//!
//! Block `il` is `x += attention(rms_norm(x) * attn_norm)`, then `x += ffn(rms_norm(x) *
//! ffn_norm)`. The attention ([`crate::layers::attention`]) is plain GQA with per-head q/k RMS norms
//! and NEOX rope over the whole head (`rope.dimension_count` = `key_length`, as llama.cpp asserts),
//! no output gate; the FFN is [dense SwiGLU](crate::layers::ffn::swiglu) (`qwen3`) or
//! [top-k of a softmax router, weights renormalised](crate::layers::ffn::moe) over stacked experts
//! with no shared expert (`qwen3moe`; llama.cpp always renormalises, HF's `norm_topk_prob`). The
//! trunk ends in `rms_norm * output_norm`; the head is `output.weight` or, tied, `token_embd`.
//! Every block is attention, so every layer uses the paged KV cache.

use tessera_graph::{Backend, Tensor};
use tessera_ops::{RopePairing, RopeParams};

use crate::arch::{ArchSpec, Architecture, LayerCacheNeed, StepBuilder};
use crate::config::{
    Arch, BlockPart, ConfigError, Dim, EMBEDDING_AND_FINAL_NORM, Ffn, Field, KeySpec, ModelConfig, TensorGroup,
    UNTIED_HEAD, t,
};
use crate::layers::attention::{self, AttentionSpec};
use crate::layers::ffn::{self, MoeSpec};
use crate::layers::norm::{rms_norm, token_embedding};
use crate::layers::project::merge_groups;
use crate::model::{ModelError, ModelOptions};
use crate::weights::{ModelWeights, WeightsError};

/// The keys both variants share (llama.cpp's `LLM_KV_NAMES`; `rope.dimension_count` is absent
/// from llama.cpp's converted files and reads as `key_length`).
macro_rules! common_keys {
    ($($more:expr),* $(,)?) => {
        &[
            KeySpec::required("block_count", Field::BlockCount),
            KeySpec::required("context_length", Field::ContextLength),
            KeySpec::required("embedding_length", Field::EmbeddingLength),
            KeySpec::required("vocab_size", Field::VocabSize),
            KeySpec::required("attention.head_count", Field::HeadCount),
            KeySpec::required("attention.head_count_kv", Field::HeadCountKv),
            KeySpec::required("attention.key_length", Field::KeyLength),
            KeySpec::required("attention.value_length", Field::ValueLength),
            KeySpec::required("attention.layer_norm_rms_epsilon", Field::RmsEps),
            KeySpec::required("rope.freq_base", Field::RopeFreqBase),
            KeySpec::optional("rope.dimension_count", Field::RopeDimensionCount),
            $($more),*
        ]
    };
}

/// `qwen3`: dense SwiGLU FFN.
pub static QWEN3: ArchSpec = ArchSpec {
    name: "qwen3",
    hf_names: &["Qwen3ForCausalLM", "qwen3"],
    keys: common_keys![KeySpec::required("feed_forward_length", Field::FeedForwardLength)],
    tensors: &[EMBEDDING_AND_FINAL_NORM, UNTIED_HEAD, BLOCK, DENSE_FFN],
    make: Qwen3::make,
    presets: &[
        ("qwen3-tiny", || preset(Arch::of(&QWEN3), 4, 64, 2, 1, 32, Ffn::Dense { n_ff: 128 }, 256)),
        ("qwen3-32b", || preset(Arch::of(&QWEN3), 64, 5120, 64, 8, 128, Ffn::Dense { n_ff: 25_600 }, 151_936)),
    ],
};

/// `qwen3moe`: routed experts, no shared expert.
pub static QWEN3MOE: ArchSpec = ArchSpec {
    name: "qwen3moe",
    hf_names: &["Qwen3MoeForCausalLM", "qwen3_moe"],
    keys: common_keys![
        KeySpec::required("expert_count", Field::ExpertCount),
        KeySpec::required("expert_used_count", Field::ExpertUsedCount),
        KeySpec::required("expert_feed_forward_length", Field::ExpertFeedForwardLength),
    ],
    tensors: &[EMBEDDING_AND_FINAL_NORM, UNTIED_HEAD, BLOCK, MOE_FFN],
    make: Qwen3::make,
    presets: &[
        ("qwen3moe-tiny", || {
            let ffn = Ffn::Moe { n_expert: 8, n_expert_used: 2, n_ff_exp: 64, n_ff_shexp: None };
            ModelConfig { tied_embeddings: true, ..preset(Arch::of(&QWEN3MOE), 4, 64, 2, 1, 32, ffn, 256) }
        }),
        ("qwen3moe-30b-a3b", || {
            let ffn = Ffn::Moe { n_expert: 128, n_expert_used: 8, n_ff_exp: 768, n_ff_shexp: None };
            preset(Arch::of(&QWEN3MOE), 48, 2048, 32, 4, 128, ffn, 151_936)
        }),
    ],
};

/// A preset of the family: the Qwen3 HF configs' context (40960), rope base (1e6) and eps (1e-6),
/// untied head, `n_rot` the whole head.
#[allow(clippy::too_many_arguments)]
fn preset(
    arch: Arch,
    n_layer: usize,
    n_embd: usize,
    n_head: usize,
    n_head_kv: usize,
    head_dim: usize,
    ffn: Ffn,
    n_vocab: usize,
) -> ModelConfig {
    ModelConfig {
        arch,
        n_layer,
        n_ctx_train: 40_960,
        n_embd,
        n_vocab,
        n_head,
        n_head_kv,
        head_dim,
        rms_eps: 1e-6,
        rope_freq_base: 1_000_000.0,
        n_rot: head_dim,
        rope_sections: None,
        ssm: None,
        nextn_predict_layers: 0,
        ffn,
        tied_embeddings: false,
    }
}

// The tensors (llama.cpp's `LLM_TENSOR_NAMES`, `create_tensor` calls of qwen3.cpp / qwen3moe.cpp),
// shapes in ggml order, in file order.

const BLOCK: TensorGroup = TensorGroup {
    part: BlockPart::Block,
    tensors: &[
        t("attn_norm.weight", &[Dim::Embd]),
        t("attn_q.weight", &[Dim::Embd, Dim::QDim]),
        t("attn_k.weight", &[Dim::Embd, Dim::KvDim]),
        t("attn_v.weight", &[Dim::Embd, Dim::KvDim]),
        t("attn_output.weight", &[Dim::QDim, Dim::Embd]),
        t("attn_k_norm.weight", &[Dim::HeadDim]),
        t("attn_q_norm.weight", &[Dim::HeadDim]),
        t("ffn_norm.weight", &[Dim::Embd]),
    ],
};

const DENSE_FFN: TensorGroup = TensorGroup {
    part: BlockPart::DenseFfn,
    tensors: &[
        t("ffn_gate.weight", &[Dim::Embd, Dim::Ffn]),
        t("ffn_down.weight", &[Dim::Ffn, Dim::Embd]),
        t("ffn_up.weight", &[Dim::Embd, Dim::Ffn]),
    ],
};

const MOE_FFN: TensorGroup = TensorGroup {
    part: BlockPart::Moe,
    tensors: &[
        t("ffn_gate_inp.weight", &[Dim::Embd, Dim::Experts]),
        t("ffn_gate_exps.weight", &[Dim::Embd, Dim::ExpertFfn, Dim::Experts]),
        t("ffn_down_exps.weight", &[Dim::ExpertFfn, Dim::Embd, Dim::Experts]),
        t("ffn_up_exps.weight", &[Dim::Embd, Dim::ExpertFfn, Dim::Experts]),
    ],
};

/// A `qwen3` / `qwen3moe` model's forward pass over a validated [`ModelConfig`].
#[derive(Debug, Clone)]
pub struct Qwen3 {
    config: ModelConfig,
}

impl Qwen3 {
    /// The architecture of `config` (validated first; a config of another family, or one whose
    /// rope does not cover the whole head, is an error).
    pub fn new(config: ModelConfig) -> Result<Qwen3, ConfigError> {
        config.validate()?;
        let family = |why: String| ConfigError::Inconsistent { key: "general.architecture".into(), reason: why };
        if config.ssm.is_some()
            || config.rope_sections.is_some()
            || matches!(config.ffn, Ffn::Moe { n_ff_shexp: Some(_), .. })
        {
            return Err(family(format!("{} is not a qwen3 family config", config.arch)));
        }
        if config.n_rot != config.head_dim {
            return Err(ConfigError::Inconsistent {
                key: format!("{}.rope.dimension_count", config.arch),
                reason: format!(
                    "{} must equal attention.key_length {} (llama.cpp: n_rot == n_embd_head)",
                    config.n_rot, config.head_dim
                ),
            });
        }
        Ok(Qwen3 { config })
    }

    fn make(config: ModelConfig) -> Result<Box<dyn Architecture>, ConfigError> {
        Ok(Box::new(Qwen3::new(config)?))
    }

    fn attention_spec(&self) -> AttentionSpec {
        let c = &self.config;
        AttentionSpec {
            n_head: c.n_head,
            n_head_kv: c.n_head_kv,
            head_dim: c.head_dim,
            eps: c.rms_eps,
            qk_norm: true,
            rope: RopeParams {
                n_rot: c.n_rot,
                freq_base: c.rope_freq_base,
                pairing: RopePairing::Neox,
                sections: None,
            },
            gate: None,
        }
    }
}

impl Architecture for Qwen3 {
    fn name(&self) -> &str {
        self.config.arch.name()
    }

    fn n_vocab(&self) -> usize {
        self.config.n_vocab
    }

    fn config(&self) -> Option<&ModelConfig> {
        Some(&self.config)
    }

    fn layer_caches(&self) -> Vec<LayerCacheNeed> {
        let c = &self.config;
        let need = LayerCacheNeed::Attention { n_head_kv: c.n_head_kv, k_dim: c.head_dim, v_dim: c.head_dim };
        vec![need; c.n_main_layers()]
    }

    /// Stacks each block's q/k/v projections ([`ModelOptions::merge_projections`]).
    fn prepare_weights(
        &self,
        weights: &mut ModelWeights,
        backend: &mut dyn Backend,
        opts: &ModelOptions,
    ) -> Result<(), WeightsError> {
        if opts.merge_projections {
            for il in 0..self.config.n_main_layers() {
                merge_groups(weights, &attention::projection_groups(&format!("blk.{il}")), backend)?;
            }
        }
        Ok(())
    }

    fn build(&self, b: &mut StepBuilder<'_>) -> Result<Tensor, ModelError> {
        let c = &self.config;
        let attn = self.attention_spec();
        let moe = match c.ffn {
            Ffn::Dense { .. } => None,
            Ffn::Moe { n_expert, n_expert_used, .. } => Some(MoeSpec {
                n_expert,
                n_expert_used,
                renormalize: true,
                shared_expert: false,
                route_shared_max_tokens: 0,
            }),
        };
        let mut x = token_embedding(b, "token_embd.weight")?;
        for il in 0..c.n_main_layers() {
            let pre = &format!("blk.{il}");
            let h = rms_norm(b, x, &format!("{pre}.attn_norm.weight"), c.rms_eps)?;
            let a = attention::attention(b, &attn, il, pre, h)?;
            x = b.g.add(x, a)?;
            let h = rms_norm(b, x, &format!("{pre}.ffn_norm.weight"), c.rms_eps)?;
            let f = match &moe {
                None => ffn::swiglu(b, pre, h)?,
                Some(spec) => ffn::moe(b, spec, pre, h)?,
            };
            x = b.g.add(x, f)?;
        }
        rms_norm(b, x, "output_norm.weight", c.rms_eps)
    }

    fn lm_head(&self) -> &str {
        if self.config.tied_embeddings { "token_embd.weight" } else { "output.weight" }
    }
}
