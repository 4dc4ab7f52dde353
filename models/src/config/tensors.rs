//! The weight tensors of a family as data: each [`ArchSpec`](crate::arch::ArchSpec) lists
//! [`TensorGroup`]s (which blocks have them, [`BlockPart`]) of [`TensorTemplate`]s (a llama.cpp
//! name and a shape whose dims are config values, [`Dim`]); [`ModelConfig::tensor_specs`] walks
//! them for a config, and [`ModelConfig::tensor_problems`] checks a file against the result.
//! `synth`, the converter and the weight loader all take their tensor list from there.

use std::collections::HashSet;
use std::fmt;

use super::{ConfigError, Ffn, LayerKind, ModelConfig};
use crate::gguf::GgufFile;

/// A dimension of a tensor template: a value of the config (saturating products, exact on a
/// validated config).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dim {
    /// `n_embd`.
    Embd,
    /// `n_vocab`.
    Vocab,
    /// `head_dim`.
    HeadDim,
    /// `head_dim * n_head`: the attention's q (and output) width.
    QDim,
    /// `2 * head_dim * n_head`: q with its gate interleaved per head.
    QGateDim,
    /// `head_dim * n_head_kv`.
    KvDim,
    /// The dense FFN's `n_ff`.
    Ffn,
    /// Routed experts.
    Experts,
    /// A routed expert's width.
    ExpertFfn,
    /// The shared expert's width.
    SharedFfn,
    /// The gated DeltaNet's conv kernel width.
    SsmConvKernel,
    /// The gated DeltaNet's conv channels, `2 H_k S_k + H_v S_v`.
    SsmConvChannels,
    /// The gated DeltaNet's value width, `H_v S_v`.
    SsmValueDim,
    /// `H_v`, its value heads.
    SsmValueHeads,
    /// `S_v`, its value head dim.
    SsmValueHeadDim,
}

/// Which tensors of a family a config has: the parts of a block (or of the model) a
/// [`TensorGroup`] belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockPart {
    /// Model-level tensors every config has (named as is).
    Global,
    /// Model-level tensors of an untied LM head (`output.weight`).
    UntiedHead,
    /// Every main block (named `blk.N.{name}`).
    Block,
    /// Main blocks whose mixer is full attention ([`ModelConfig::layer_kind`]).
    Attention,
    /// Main blocks whose mixer is gated DeltaNet.
    Recurrent,
    /// Every main block of a config with a dense FFN.
    DenseFfn,
    /// Every main block of a config with routed experts.
    Moe,
    /// Every main block of a config with routed experts and a shared expert.
    SharedExpert,
}

/// One tensor of a family: its llama.cpp name (after `blk.N.` for block parts) and its shape in
/// ggml order (`ne[0]` first, 1 to 4 dims).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorTemplate {
    /// llama.cpp's name (`attn_q.weight`), without the `blk.N.` of block parts.
    pub name: &'static str,
    /// `ne[0]` first.
    pub shape: &'static [Dim],
}

/// The tensors of one [`BlockPart`], in file order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorGroup {
    /// Which configs and blocks have these tensors.
    pub part: BlockPart,
    /// The tensors, in file order.
    pub tensors: &'static [TensorTemplate],
}

/// A template: `t("attn_q.weight", &[Dim::Embd, Dim::QGateDim])`.
pub const fn t(name: &'static str, shape: &'static [Dim]) -> TensorTemplate {
    TensorTemplate { name, shape }
}

/// The token embedding and final norm, as every llama.cpp decoder names them.
pub const EMBEDDING_AND_FINAL_NORM: TensorGroup = TensorGroup {
    part: BlockPart::Global,
    tensors: &[t("token_embd.weight", &[Dim::Embd, Dim::Vocab]), t("output_norm.weight", &[Dim::Embd])],
};

/// The LM head of a model whose head is not the embedding (`output.weight`).
pub const UNTIED_HEAD: TensorGroup =
    TensorGroup { part: BlockPart::UntiedHead, tensors: &[t("output.weight", &[Dim::Embd, Dim::Vocab])] };

/// One weight tensor: its llama.cpp name and shape in ggml order (`ne[0]` innermost, padded with 1s).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// The full name (`blk.3.attn_q.weight`).
    pub name: String,
    /// The shape, ggml order, padded with 1s.
    pub ne: [usize; 4],
    /// Dimensions written to the file (1..=4).
    pub n_dims: usize,
}

impl TensorSpec {
    /// A spec of `name` with dims `dims` (1 to 4, ggml order).
    pub fn new(name: impl Into<String>, dims: &[usize]) -> TensorSpec {
        let mut ne = [1; 4];
        ne[..dims.len()].copy_from_slice(dims);
        TensorSpec { name: name.into(), ne, n_dims: dims.len() }
    }

    /// The dims as written (`ne[..n_dims]`).
    pub fn dims(&self) -> &[usize] {
        &self.ne[..self.n_dims]
    }

    /// Logical element count (saturating; specs of a validated config stay below 2^57).
    pub fn n_elements(&self) -> usize {
        self.ne.iter().fold(1usize, |acc, &d| acc.saturating_mul(d))
    }
}

/// A tensor of the file that does not match the config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TensorProblem {
    /// The config needs it and the file lacks it.
    Missing { name: String },
    /// Present with another shape.
    WrongShape { name: String, expected: [usize; 4], found: [usize; 4] },
    /// The config has more main blocks than the file has `blk.N` tensors for (`found` is one more
    /// than the highest block index present, 0 when there is none). Reported alone, instead of
    /// every tensor of the missing blocks.
    Blocks { block_count: usize, main_layers: usize, found: usize },
    /// A tensor the config does not expect (an unknown name, or a block at or beyond
    /// `block_count`).
    Unexpected { name: String },
}

impl fmt::Display for TensorProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TensorProblem::Missing { name } => write!(f, "tensor `{name}` is missing"),
            TensorProblem::WrongShape { name, expected, found } => {
                write!(f, "tensor `{name}` has shape {found:?}, expected {expected:?}")
            }
            TensorProblem::Blocks { block_count, main_layers, found: 0 } => write!(
                f,
                "block_count is {block_count} ({main_layers} main blocks) but the file has no `blk.N` tensors"
            ),
            TensorProblem::Blocks { block_count, main_layers, found } => write!(
                f,
                "block_count is {block_count} ({main_layers} main blocks) but the file has tensors for blocks \
                 0..={} only",
                found - 1
            ),
            TensorProblem::Unexpected { name } => write!(f, "tensor `{name}` is not part of this config"),
        }
    }
}

impl ModelConfig {
    /// The size of `d` in this config (saturating: exact on a validated config, and an
    /// unvalidated one must not panic here; 0 for a group the config does not have).
    pub fn dim(&self, d: Dim) -> usize {
        let m = |a: usize, b: usize| a.saturating_mul(b);
        let ssm = self.ssm.as_ref();
        let (n_ff, n_expert, n_ff_exp, n_ff_shexp) = match self.ffn {
            Ffn::Dense { n_ff } => (n_ff, 0, 0, 0),
            Ffn::Moe { n_expert, n_ff_exp, n_ff_shexp, .. } => (0, n_expert, n_ff_exp, n_ff_shexp.unwrap_or(0)),
        };
        match d {
            Dim::Embd => self.n_embd,
            Dim::Vocab => self.n_vocab,
            Dim::HeadDim => self.head_dim,
            Dim::QDim => m(self.head_dim, self.n_head),
            Dim::QGateDim => m(2, m(self.head_dim, self.n_head)),
            Dim::KvDim => m(self.head_dim, self.n_head_kv),
            Dim::Ffn => n_ff,
            Dim::Experts => n_expert,
            Dim::ExpertFfn => n_ff_exp,
            Dim::SharedFfn => n_ff_shexp,
            Dim::SsmConvKernel => ssm.map_or(0, |s| s.d_conv),
            Dim::SsmConvChannels => self.ssm_conv_dim(),
            Dim::SsmValueDim => ssm.map_or(0, |s| s.d_inner),
            Dim::SsmValueHeads => ssm.map_or(0, |s| s.dt_rank),
            Dim::SsmValueHeadDim => self.ssm_head_v_dim(),
        }
    }

    /// Whether this config has the tensors of `part` (in block `il` for block parts).
    fn has_part(&self, part: BlockPart, il: usize) -> bool {
        match part {
            BlockPart::Global | BlockPart::Block => true,
            BlockPart::UntiedHead => !self.tied_embeddings,
            BlockPart::Attention => self.layer_kind(il) == LayerKind::FullAttention,
            BlockPart::Recurrent => self.layer_kind(il) == LayerKind::GatedDeltaNet,
            BlockPart::DenseFfn => matches!(self.ffn, Ffn::Dense { .. }),
            BlockPart::Moe => matches!(self.ffn, Ffn::Moe { .. }),
            BlockPart::SharedExpert => matches!(self.ffn, Ffn::Moe { n_ff_shexp: Some(_), .. }),
        }
    }

    /// Every weight tensor of the main layers, in file order: the family's model-level groups
    /// (`token_embd`, `output_norm`, `output` unless tied), then each block's groups in
    /// declaration order. Shapes in ggml order (notes §6.3).
    pub fn tensor_specs(&self) -> Vec<TensorSpec> {
        let groups = self.arch.spec().tensors;
        let spec = |name: String, tpl: &TensorTemplate| {
            let dims: Vec<usize> = tpl.shape.iter().map(|&d| self.dim(d)).collect();
            TensorSpec::new(name, &dims)
        };
        let model_level = |g: &&TensorGroup| matches!(g.part, BlockPart::Global | BlockPart::UntiedHead);
        let mut out = Vec::new();
        for g in groups.iter().filter(model_level).filter(|g| self.has_part(g.part, 0)) {
            out.extend(g.tensors.iter().map(|tpl| spec(tpl.name.to_string(), tpl)));
        }
        for il in 0..self.n_main_layers() {
            for g in groups.iter().filter(|g| !model_level(g) && self.has_part(g.part, il)) {
                out.extend(g.tensors.iter().map(|tpl| spec(format!("blk.{il}.{}", tpl.name), tpl)));
            }
        }
        out
    }

    /// Every way the tensors of `f` disagree with this config, after [`ModelConfig::validate`]
    /// (whose error is returned as is):
    ///
    /// 1. the file must have `blk.N` tensors up to the last main block, else the one problem is
    ///    [`TensorProblem::Blocks`] (so a huge `block_count` is reported in one line, and nothing
    ///    is sized from it);
    /// 2. every tensor of [`ModelConfig::tensor_specs`] present with its shape
    ///    ([`TensorProblem::Missing`], [`TensorProblem::WrongShape`]); a merged
    ///    `blk.N.ffn_gate_up_exps.weight` `[n_embd, 2·n_ff_exp, n_expert]` (gate rows first, then
    ///    up, per expert) stands in for the gate/up pair, as llama.cpp's loader accepts;
    /// 3. no other tensor ([`TensorProblem::Unexpected`]), except those of MTP blocks (`blk.N`,
    ///    `N` in `n_main_layers()..n_layer`), which are not checked.
    pub fn tensor_problems(&self, f: &GgufFile) -> Result<Vec<TensorProblem>, ConfigError> {
        self.validate()?;
        let n_main = self.n_main_layers();
        let found = f.tensors().iter().filter_map(|t| block_index(&t.name)).max().map_or(0, |b| b.saturating_add(1));
        if n_main > found {
            return Ok(vec![TensorProblem::Blocks { block_count: self.n_layer, main_layers: n_main, found }]);
        }
        let mut problems = Vec::new();
        let mut expected: HashSet<String> = HashSet::new();
        for spec in self.tensor_specs() {
            match f.tensor(&spec.name) {
                Some(info) if info.ne == spec.ne => {}
                Some(info) => problems.push(TensorProblem::WrongShape {
                    name: spec.name.clone(),
                    expected: spec.ne,
                    found: info.ne,
                }),
                None => match merged_gate_up(&spec) {
                    Some(merged) if f.tensor(&merged.name).is_some_and(|i| i.ne == merged.ne) => {
                        expected.insert(merged.name);
                    }
                    _ => problems.push(TensorProblem::Missing { name: spec.name.clone() }),
                },
            }
            expected.insert(spec.name);
        }
        for t in f.tensors() {
            let mtp = block_index(&t.name).is_some_and(|b| (n_main..self.n_layer).contains(&b));
            if !mtp && !expected.contains(&t.name) {
                problems.push(TensorProblem::Unexpected { name: t.name.clone() });
            }
        }
        Ok(problems)
    }

    /// [`ModelConfig::tensor_problems`] as a result: `Err(ConfigError::Tensors)` naming each.
    pub fn validate_tensors(&self, f: &GgufFile) -> Result<(), ConfigError> {
        let problems = self.tensor_problems(f)?;
        if problems.is_empty() { Ok(()) } else { Err(ConfigError::Tensors { problems }) }
    }

    /// Total logical weights (at most [`super::MAX_PARAMS`] on a validated config; saturating).
    pub fn n_params(&self) -> usize {
        self.tensor_specs().iter().fold(0usize, |acc, s| acc.saturating_add(s.n_elements()))
    }
}

/// The merged expert tensor that may replace `spec` when it is an expert gate or up tensor.
pub(crate) fn merged_gate_up(spec: &TensorSpec) -> Option<TensorSpec> {
    let prefix =
        spec.name.strip_suffix("ffn_gate_exps.weight").or_else(|| spec.name.strip_suffix("ffn_up_exps.weight"))?;
    let [e, ff, n, _] = spec.ne;
    Some(TensorSpec::new(format!("{prefix}ffn_gate_up_exps.weight"), &[e, ff.saturating_mul(2), n]))
}

/// `N` of a tensor named `blk.N.*`.
fn block_index(name: &str) -> Option<usize> {
    let (n, _) = name.strip_prefix("blk.")?.split_once('.')?;
    if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    n.parse().ok()
}
