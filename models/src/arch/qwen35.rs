//! The `qwen35` / `qwen35moe` family (Qwen3.5 / 3.6): a hybrid of gated DeltaNet linear
//! attention and gated full attention, built the way llama.cpp builds it
//! (docs/notes/hybrid-ops.md §2.2, §4.2, §5.1).
//!
//! Block `il` is `x += mixer(rms_norm(x) * attn_norm)`, then `x += ffn(rms_norm(x) *
//! post_attention_norm)`, where the mixer is [gated attention](crate::layers::attention) (q and
//! its gate interleaved per head, q/k norms, interleaved M-RoPE) on every
//! `full_attention_interval`-th block and [gated DeltaNet](crate::layers::delta_net) on the others
//! ([`ModelConfig::layer_kind`]), and the FFN is [dense SwiGLU](crate::layers::ffn::swiglu)
//! (`qwen35`) or [top-k experts plus a sigmoid-gated shared expert](crate::layers::ffn::moe)
//! (`qwen35moe`). The trunk ends in `rms_norm * output_norm`.

use tessera_graph::{Backend, Tensor};
use tessera_ops::{RopePairing, RopeParams};

use crate::arch::{ArchSpec, Architecture, LayerCacheNeed, StepBuilder};
use crate::config::{
    Arch, BlockPart, ConfigError, Dim, EMBEDDING_AND_FINAL_NORM, Ffn, Field, KeySpec, LayerKind, ModelConfig,
    SsmConfig, TensorGroup, UNTIED_HEAD, t,
};
use crate::layers::attention::{self, AttentionSpec, GateLayout};
use crate::layers::delta_net::{self, DeltaNetSpec};
use crate::layers::ffn::{self, MoeSpec};
use crate::layers::norm::{rms_norm, token_embedding};
use crate::layers::project::merge_groups;
use crate::model::{ModelError, ModelOptions};
use crate::weights::{ModelWeights, WeightsError};

/// The metadata keys both variants read, in llama.cpp's file order: the dense variant's
/// `feed_forward_length` goes after `vocab_size` (`$ffn`), the MoE variant's expert keys at the end
/// (`$moe`).
macro_rules! qwen35_keys {
    ($($ffn:expr),*; $($moe:expr),* $(,)?) => {
        &[
            KeySpec::required("block_count", Field::BlockCount),
            KeySpec::required("context_length", Field::ContextLength),
            KeySpec::required("embedding_length", Field::EmbeddingLength),
            KeySpec::required("vocab_size", Field::VocabSize),
            $($ffn,)*
            KeySpec::required("attention.head_count", Field::HeadCount),
            KeySpec::required("attention.head_count_kv", Field::HeadCountKv),
            KeySpec::required("attention.key_length", Field::KeyLength),
            KeySpec::required("attention.value_length", Field::ValueLength),
            KeySpec::required("attention.layer_norm_rms_epsilon", Field::RmsEps),
            KeySpec::required("rope.freq_base", Field::RopeFreqBase),
            KeySpec::required("rope.dimension_count", Field::RopeDimensionCount),
            KeySpec::required("rope.dimension_sections", Field::RopeSections),
            KeySpec::required("ssm.conv_kernel", Field::SsmConvKernel),
            KeySpec::required("ssm.state_size", Field::SsmStateSize),
            KeySpec::required("ssm.group_count", Field::SsmGroupCount),
            KeySpec::required("ssm.time_step_rank", Field::SsmTimeStepRank),
            KeySpec::required("ssm.inner_size", Field::SsmInnerSize),
            KeySpec::default("full_attention_interval", Field::FullAttentionInterval, 4),
            KeySpec::optional("attention.recurrent_layers", Field::RecurrentLayers),
            KeySpec::optional("nextn_predict_layers", Field::NextnPredictLayers),
            $($moe,)*
        ]
    };
}

/// `qwen35`: dense SwiGLU FFN.
pub static QWEN35: ArchSpec = ArchSpec {
    name: "qwen35",
    hf_names: &["Qwen3_5ForCausalLM", "qwen3_5_text", "Qwen3_5ForConditionalGeneration", "qwen3_5"],
    keys: qwen35_keys![KeySpec::required("feed_forward_length", Field::FeedForwardLength);],
    tensors: &[EMBEDDING_AND_FINAL_NORM, UNTIED_HEAD, BLOCK, ATTENTION, RECURRENT, DENSE_FFN],
    make: Qwen35::make,
    presets: &[
        ("tiny", || tiny(Arch::of(&QWEN35))),
        ("qwen35-27b", || ModelConfig {
            n_layer: 64,
            n_embd: 5120,
            n_head: 24,
            n_head_kv: 4,
            ssm: Some(ssm(128, 16, 48, 4)),
            ffn: Ffn::Dense { n_ff: 17_408 },
            ..real(Arch::of(&QWEN35))
        }),
    ],
};

/// `qwen35moe`: routed experts plus one gated shared expert.
pub static QWEN35MOE: ArchSpec = ArchSpec {
    name: "qwen35moe",
    hf_names: &["Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", "Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe"],
    keys: qwen35_keys![;
        KeySpec::required("expert_count", Field::ExpertCount),
        KeySpec::required("expert_used_count", Field::ExpertUsedCount),
        KeySpec::required("expert_feed_forward_length", Field::ExpertFeedForwardLength),
        KeySpec::required("expert_shared_feed_forward_length", Field::ExpertSharedFeedForwardLength),
    ],
    tensors: &[EMBEDDING_AND_FINAL_NORM, UNTIED_HEAD, BLOCK, ATTENTION, RECURRENT, MOE_FFN, SHARED_EXPERT],
    make: Qwen35::make,
    presets: &[
        ("tiny-moe", || ModelConfig {
            ffn: Ffn::Moe { n_expert: 8, n_expert_used: 2, n_ff_exp: 64, n_ff_shexp: Some(64) },
            tied_embeddings: true,
            ..tiny(Arch::of(&QWEN35MOE))
        }),
        ("qwen35moe-35b-a3b", || ModelConfig {
            n_layer: 40,
            n_embd: 2048,
            n_head: 16,
            n_head_kv: 2,
            ssm: Some(ssm(128, 16, 32, 4)),
            ffn: Ffn::Moe { n_expert: 256, n_expert_used: 8, n_ff_exp: 512, n_ff_shexp: Some(512) },
            ..real(Arch::of(&QWEN35MOE))
        }),
    ],
};

/// The recurrent layers of a preset: conv 4, `d_inner` the value heads' width.
fn ssm(d_state: usize, n_group: usize, dt_rank: usize, interval: usize) -> SsmConfig {
    SsmConfig {
        d_conv: 4,
        d_state,
        n_group,
        dt_rank,
        d_inner: dt_rank * d_state,
        full_attention_interval: interval,
        recurrent_layers: None,
    }
}

/// The `tiny` trunk (4 layers, n_embd 64, vocab 256; see [`ModelConfig::preset`]).
fn tiny(arch: Arch) -> ModelConfig {
    ModelConfig {
        arch,
        n_layer: 4,
        n_ctx_train: 4096,
        n_embd: 64,
        n_vocab: 256,
        n_head: 2,
        n_head_kv: 1,
        head_dim: 32,
        rms_eps: 1e-6,
        rope_freq_base: 10_000_000.0,
        n_rot: 16,
        rope_sections: Some([3, 3, 2, 0]),
        ssm: Some(ssm(16, 2, 4, 2)),
        nextn_predict_layers: 0,
        ffn: Ffn::Dense { n_ff: 128 },
        tied_embeddings: false,
    }
}

/// What the real shapes share: head dim 256, vocab 248320 (from the brief); unverified: context
/// 262144, rope base 1e7, n_rot 64, sections `[11,11,10,0]`, eps 1e-6, interval 4, untied.
fn real(arch: Arch) -> ModelConfig {
    ModelConfig {
        n_ctx_train: 262_144,
        rope_freq_base: 10_000_000.0,
        n_rot: 64,
        rope_sections: Some([11, 11, 10, 0]),
        n_vocab: 248_320,
        head_dim: 256,
        ..tiny(arch)
    }
}

// The tensors (llama.cpp's `LLM_TENSOR_NAMES`, llama-arch.cpp), shapes in ggml order (notes §6.3),
// in file order.

const BLOCK: TensorGroup = TensorGroup {
    part: BlockPart::Block,
    tensors: &[t("attn_norm.weight", &[Dim::Embd]), t("post_attention_norm.weight", &[Dim::Embd])],
};

const ATTENTION: TensorGroup = TensorGroup {
    part: BlockPart::Attention,
    tensors: &[
        t("attn_q.weight", &[Dim::Embd, Dim::QGateDim]),
        t("attn_k.weight", &[Dim::Embd, Dim::KvDim]),
        t("attn_v.weight", &[Dim::Embd, Dim::KvDim]),
        t("attn_output.weight", &[Dim::QDim, Dim::Embd]),
        t("attn_q_norm.weight", &[Dim::HeadDim]),
        t("attn_k_norm.weight", &[Dim::HeadDim]),
    ],
};

const RECURRENT: TensorGroup = TensorGroup {
    part: BlockPart::Recurrent,
    tensors: &[
        t("attn_qkv.weight", &[Dim::Embd, Dim::SsmConvChannels]),
        t("attn_gate.weight", &[Dim::Embd, Dim::SsmValueDim]),
        t("ssm_conv1d.weight", &[Dim::SsmConvKernel, Dim::SsmConvChannels]),
        t("ssm_dt.bias", &[Dim::SsmValueHeads]),
        t("ssm_a", &[Dim::SsmValueHeads]),
        t("ssm_beta.weight", &[Dim::Embd, Dim::SsmValueHeads]),
        t("ssm_alpha.weight", &[Dim::Embd, Dim::SsmValueHeads]),
        t("ssm_norm.weight", &[Dim::SsmValueHeadDim]),
        t("ssm_out.weight", &[Dim::SsmValueDim, Dim::Embd]),
    ],
};

const DENSE_FFN: TensorGroup = TensorGroup {
    part: BlockPart::DenseFfn,
    tensors: &[
        t("ffn_gate.weight", &[Dim::Embd, Dim::Ffn]),
        t("ffn_up.weight", &[Dim::Embd, Dim::Ffn]),
        t("ffn_down.weight", &[Dim::Ffn, Dim::Embd]),
    ],
};

const MOE_FFN: TensorGroup = TensorGroup {
    part: BlockPart::Moe,
    tensors: &[
        t("ffn_gate_inp.weight", &[Dim::Embd, Dim::Experts]),
        t("ffn_gate_exps.weight", &[Dim::Embd, Dim::ExpertFfn, Dim::Experts]),
        t("ffn_up_exps.weight", &[Dim::Embd, Dim::ExpertFfn, Dim::Experts]),
        t("ffn_down_exps.weight", &[Dim::ExpertFfn, Dim::Embd, Dim::Experts]),
    ],
};

const SHARED_EXPERT: TensorGroup = TensorGroup {
    part: BlockPart::SharedExpert,
    tensors: &[
        t("ffn_gate_inp_shexp.weight", &[Dim::Embd]),
        t("ffn_gate_shexp.weight", &[Dim::Embd, Dim::SharedFfn]),
        t("ffn_up_shexp.weight", &[Dim::Embd, Dim::SharedFfn]),
        t("ffn_down_shexp.weight", &[Dim::SharedFfn, Dim::Embd]),
    ],
};

/// A `qwen35` / `qwen35moe` model's forward pass over a validated [`ModelConfig`].
#[derive(Debug, Clone)]
pub struct Qwen35 {
    config: ModelConfig,
    /// `config.ssm` (the family declares it).
    ssm: SsmConfig,
    /// `config.rope_sections` (the family declares them).
    sections: [usize; 4],
}

impl Qwen35 {
    /// The architecture of `config` (validated first; a config of another family is an error).
    pub fn new(config: ModelConfig) -> Result<Qwen35, ConfigError> {
        config.validate()?;
        let (Some(ssm), Some(sections)) = (config.ssm.clone(), config.rope_sections) else {
            return Err(ConfigError::Inconsistent {
                key: "general.architecture".into(),
                reason: format!("{} is not a qwen35 family config (no ssm group or rope sections)", config.arch),
            });
        };
        Ok(Qwen35 { config, ssm, sections })
    }

    fn make(config: ModelConfig) -> Result<Box<dyn Architecture>, ConfigError> {
        Ok(Box::new(Qwen35::new(config)?))
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
                sections: Some(self.sections),
            },
            gate: Some(GateLayout::InterleavedPerHead),
        }
    }

    fn delta_net_spec(&self) -> DeltaNetSpec {
        let s = &self.ssm;
        DeltaNetSpec {
            n_head_k: s.n_group,
            n_head_v: s.dt_rank,
            head_k_dim: s.d_state,
            head_v_dim: self.config.ssm_head_v_dim(),
            eps: self.config.rms_eps,
        }
    }
}

impl Architecture for Qwen35 {
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
        (0..c.n_main_layers())
            .map(|il| match c.layer_kind(il) {
                LayerKind::FullAttention => {
                    LayerCacheNeed::Attention { n_head_kv: c.n_head_kv, k_dim: c.head_dim, v_dim: c.head_dim }
                }
                LayerKind::GatedDeltaNet => LayerCacheNeed::Recurrent {
                    conv: [self.ssm.d_conv - 1, c.ssm_conv_dim()],
                    state: [self.ssm.d_state, c.ssm_head_v_dim(), self.ssm.dt_rank],
                },
            })
            .collect()
    }

    /// Stacks each block's projection groups ([`ModelOptions::merge_projections`]) and routes
    /// each MoE block's shared expert as expert `n_expert` ([`ModelOptions::route_shared_expert`]
    /// above 0).
    fn prepare_weights(
        &self,
        weights: &mut ModelWeights,
        backend: &mut dyn Backend,
        opts: &ModelOptions,
    ) -> Result<(), WeightsError> {
        let c = &self.config;
        if opts.merge_projections {
            for il in 0..c.n_main_layers() {
                let pre = format!("blk.{il}");
                let groups = match c.layer_kind(il) {
                    LayerKind::FullAttention => attention::projection_groups(&pre),
                    LayerKind::GatedDeltaNet => delta_net::projection_groups(&pre),
                };
                merge_groups(weights, &groups, backend)?;
            }
        }
        if let Ffn::Moe { n_expert, .. } = c.ffn
            && opts.route_shared_expert > 0
        {
            let mut any = false;
            for il in 0..c.n_main_layers() {
                any |= ffn::route_shared_expert(weights, &format!("blk.{il}"), backend)?;
            }
            if any {
                ffn::insert_shared_expert_id(weights, n_expert, backend)?;
            }
        }
        Ok(())
    }

    fn build(&self, b: &mut StepBuilder<'_>) -> Result<Tensor, ModelError> {
        let c = &self.config;
        let (attn, dn) = (self.attention_spec(), self.delta_net_spec());
        let moe = match c.ffn {
            Ffn::Dense { .. } => None,
            Ffn::Moe { n_expert, n_expert_used, .. } => Some(MoeSpec {
                n_expert,
                n_expert_used,
                renormalize: true,
                shared_expert: true,
                route_shared_max_tokens: b.options().route_shared_expert,
            }),
        };
        let mut x = token_embedding(b, "token_embd.weight")?;
        for il in 0..c.n_main_layers() {
            let pre = &format!("blk.{il}");
            let h = rms_norm(b, x, &format!("{pre}.attn_norm.weight"), c.rms_eps)?;
            let mixed = match c.layer_kind(il) {
                LayerKind::FullAttention => attention::attention(b, &attn, il, pre, h)?,
                LayerKind::GatedDeltaNet => delta_net::delta_net(b, &dn, il, pre, h)?,
            };
            x = b.g.add(x, mixed)?;
            let h = rms_norm(b, x, &format!("{pre}.post_attention_norm.weight"), c.rms_eps)?;
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
