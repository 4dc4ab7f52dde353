//! The `qwen35` / `qwen35moe` forward pass: one graph per step, built the way llama.cpp builds it
//! (docs/notes/hybrid-ops.md §2.2, §4.2, §5.1), run on a backend with weights and caches resident.
//!
//! Token layout inside a step graph: the tokens of every sequence of the step packed one after
//! the other, padded to the step's bucket ([`crate::batch`]): column `j` of every `[n_embd, N]`
//! activation is packed token `j`, and the ragged ops read which sequence owns it from the
//! `seq_offsets` input. Any mix of decode tokens and prompt chunks is one graph.

use std::collections::HashMap;
use std::ops::Range;

use tessera_graph::passes::{PassReport, PassRun, Pipeline, UnknownPass};
use tessera_graph::{
    Backend, BackendError, ExecError, Executable, Graph, GraphError, SessionOptions, SharedArenas, Tensor, TensorRef,
};
use tessera_ops::sample::SampleSettings;
use tessera_ops::{DType, DeltaNetAlgo, GatedDeltaNetParams, HeadMap, RopePairing, RopeParams, TensorMeta};

use crate::batch::StepInputs;
use crate::cache::{AllocPolicy, CacheError, KvCacheConfig, PagedKvCache, RecurrentCache, RecurrentConfig, SeqId};
use crate::config::{ConfigError, Ffn, LayerKind, ModelConfig};
use crate::gguf::GgufFile;
use crate::weights::{ModelWeights, WeightsError};

/// Why a model could not be loaded or stepped.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Weights(#[from] WeightsError),
    #[error(transparent)]
    Cache(#[from] CacheError),
    #[error(transparent)]
    Graph(#[from] GraphError),
    #[error(transparent)]
    Exec(#[from] ExecError),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error("bad batch: {why}")]
    BadBatch { why: String },
    #[error(transparent)]
    Synth(#[from] crate::synth::SynthError),
    #[error(transparent)]
    Pass(#[from] UnknownPass),
}

type R<T> = Result<T, ModelError>;

/// Cache sizes of a [`Model`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelOptions {
    /// KV blocks shared by all sequences.
    pub kv_blocks: usize,
    /// Cells per KV block.
    pub block_size: usize,
    /// Most tokens one sequence may hold.
    pub max_context: usize,
    /// KV cache element type: f16 (the default, as llama.cpp), f32 or bf16.
    pub kv_dtype: DType,
    pub policy: AllocPolicy,
    /// Sequences live at once (recurrent state slots).
    pub n_slots: usize,
    /// The attention's KV length (`n_kv`, the block table's width) is rounded up to a multiple
    /// of this; positions past a sequence's length are never read. 1 = exact. Decode steps keep one shape for
    /// `kv_pad` tokens, so their planned step graph (and on a GPU its captured CUDA graph) is
    /// replayed instead of built again every step. A GPU backend wants e.g. 256, the CPU 32.
    pub kv_pad: usize,
    /// Planned step graphs kept (one per shape [`Bucket`]); the least recently used are freed
    /// beyond it. They share one activation arena per backend (steps run one at a time), so a
    /// graph held costs its small input buffers and, on a GPU, its captured CUDA graph.
    pub step_graphs: usize,
    /// Stack the projections that read one input into one matrix at load ([`merge_projections`]):
    /// one matmul a group instead of one a weight (default on; `TESSERA_MERGE_PROJECTIONS=0`
    /// turns it off, to compare).
    pub merge_projections: bool,
    /// Steps of at most this many tokens run a MoE block's shared expert as one more slot of the
    /// routed experts ([`route_shared_experts`]: its weights stacked onto theirs at load, its gate
    /// logit a row of the router's); longer steps run it on its own, where the dense matmul beats
    /// one more expert in the grouped one. 0: never, and nothing is stacked (default 64;
    /// `TESSERA_ROUTE_SHARED_EXPERT=N` sets it, to compare).
    pub route_shared_expert: usize,
}

impl Default for ModelOptions {
    fn default() -> Self {
        ModelOptions {
            kv_blocks: 64,
            block_size: 16,
            max_context: 1024,
            kv_dtype: DType::F16,
            policy: AllocPolicy::InOrder,
            n_slots: 4,
            kv_pad: 1,
            step_graphs: 64,
            merge_projections: std::env::var("TESSERA_MERGE_PROJECTIONS").map_or(true, |v| v != "0"),
            route_shared_expert: std::env::var("TESSERA_ROUTE_SHARED_EXPERT")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(SHARED_EXPERT_ROUTED_TOKENS),
        }
    }
}

/// Default of [`ModelOptions::route_shared_expert`]: decode and short steps, where one more slot
/// in the routed experts' kernels beats the shared expert's own launches; a long prefill runs the
/// dense matmuls faster (docs/perf-log/fusion.md).
pub const SHARED_EXPERT_ROUTED_TOKENS: usize = 64;

/// Which logits [`Model::step`] returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// The last token of each sequence: `n_vocab` values per sequence.
    Last,
    /// Every token: `n_tokens * n_vocab` values per sequence, token-major.
    All,
}

/// Per-layer resident cache memory.
#[derive(Debug, Clone, Copy)]
enum LayerCache {
    /// K and V storage `[head_dim * n_head_kv, n_cells]`.
    Attn { k: TensorRef, v: TensorRef },
    /// Conv state `[d_conv - 1, channels, n_slots]` and delta state `[S_k, S_v, H_v, n_slots]`.
    Recurrent { conv: TensorRef, delta: TensorRef },
}

/// A loaded model: config, resident weights, and the two caches with their backend memory.
#[derive(Debug)]
pub struct Model {
    pub config: ModelConfig,
    pub weights: ModelWeights,
    pub kv: PagedKvCache,
    pub recurrent: RecurrentCache,
    layers: Vec<LayerCache>,
    /// [`ModelOptions::kv_pad`].
    kv_pad: usize,
    /// [`ModelOptions::route_shared_expert`].
    route_shared_expert: usize,
    /// Planned step graphs by shape, replayed when a step of the same shape comes again.
    steps: StepCache,
    /// Where the last [`Model::step`]'s time went.
    last_times: StepTimes,
    /// The fusion passes run on every step graph before it is planned.
    passes: Pipeline,
    /// What the passes did to the step graph built last.
    pass_reports: Vec<PassReport>,
}

/// What a step graph's shape depends on: packed tokens and sequences (each rounded up by
/// [`crate::batch::bucket_len`]), the attention's KV length (rounded up by `kv_pad`) and which
/// logits it computes. Everything else in the graph (weights, cache memory, the config) is fixed
/// for the model's lifetime, and the mix of lengths inside a bucket is data, not shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Bucket {
    /// Packed tokens of all sequences, padding included.
    pub n_tokens: usize,
    /// Sequences, empty padding sequences included.
    pub n_seq: usize,
    pub n_kv: usize,
    pub all_logits: bool,
    /// The graph ends in the `sample` op: token ids come back instead of logits.
    pub sample: bool,
}

/// What a step returns.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Output<'a> {
    Logits(Logits),
    /// One token per sequence, picked on the device with these settings (one per sequence).
    Tokens(&'a [SampleSettings]),
}

/// One sequence's result of a step.
#[derive(Debug, Clone)]
enum SeqOut {
    Logits(Vec<f32>),
    Token(u32),
}

/// Where a step's time went, in seconds, summed over its graphs.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepTimes {
    /// On the host before anything is queued: the step's inputs (positions, block table, offsets),
    /// finding the planned graph (or building and planning it) and writing the inputs.
    pub prepare: f64,
    /// Handing the planned tasks to the backend: launching (a replayed CUDA graph) or, on a
    /// synchronous backend (the CPU), computing.
    pub launch: f64,
    /// Waiting for the backend to finish and reading the results back.
    pub wait: f64,
}

impl StepTimes {
    pub fn total(&self) -> f64 {
        self.prepare + self.launch + self.wait
    }
}

impl std::ops::AddAssign for StepTimes {
    fn add_assign(&mut self, o: StepTimes) {
        self.prepare += o.prepare;
        self.launch += o.launch;
        self.wait += o.wait;
    }
}

/// A planned step graph with its per-step leaves.
#[derive(Debug)]
struct StepGraph {
    exe: Executable,
    io: StepIo,
    /// When it last ran (the cache's clock), for eviction.
    used: u64,
}

/// Planned step graphs kept per [`Bucket`], least recently used evicted beyond `capacity`, all
/// placed in one shared arena per backend.
#[derive(Debug, Default)]
struct StepCache {
    graphs: HashMap<Bucket, StepGraph>,
    arenas: SharedArenas,
    clock: u64,
    capacity: usize,
    stats: StepCacheStats,
}

/// What the step-graph cache did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepCacheStats {
    /// Steps whose graph was built and planned.
    pub built: u64,
    /// Steps that reused a planned graph.
    pub reused: u64,
    /// Planned graphs dropped: to stay within the capacity, or placed in a shared arena since
    /// replaced by a larger one.
    pub evicted: u64,
    /// Bytes of the shared activation arenas (as large as the largest step planned, plus a
    /// quarter).
    pub arena_bytes: usize,
}

/// Graph construction state: the graph, the bindings to resident memory, the per-step leaves.
struct Builder<'m> {
    g: Graph,
    binds: Vec<(Tensor, TensorRef)>,
    w: &'m ModelWeights,
    /// The shared expert's id for every token, `[1, n]` (built once a step, at its first use).
    shared_expert_ids: Option<Tensor>,
}

impl Builder<'_> {
    fn p(&mut self, name: &str) -> R<Tensor> {
        let (t, b) = self.w.param(&mut self.g, name)?;
        self.binds.push(b);
        Ok(t)
    }

    fn state(&mut self, name: &str, place: TensorRef) -> R<Tensor> {
        let t = self.g.state(name, place.meta.dtype, place.meta.ne)?;
        self.binds.push((t, place));
        Ok(t)
    }
}

/// What the fusion passes do to one step graph ([`Model::fusion_summary`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FusionSummary {
    /// Ops that run (live op nodes other than views: each is at least one kernel launch on a
    /// GPU) before the passes.
    pub ops_before: usize,
    /// The same after the passes.
    pub ops_after: usize,
    /// One report per enabled pass, in order.
    pub reports: Vec<PassReport>,
}

/// Live op nodes that compute (views cost nothing at run time).
fn running_ops(g: &Graph) -> usize {
    g.live_nodes().into_iter().filter(|&id| g.node(id).op().is_some_and(|op| !op.is_view())).count()
}

/// A step graph's inputs and output.
#[derive(Debug, Clone, Copy)]
struct StepIo {
    tokens: Tensor,
    leaves: Leaves,
    /// `[n_seq]`: the row of each sequence's last token (unless every row's logits are kept).
    last_rows: Option<Tensor>,
    /// `[4, n_seq]`: each sequence's sampling settings (when the graph ends in `sample`).
    settings: Option<Tensor>,
    /// Logits `[n_vocab, rows]`, or token ids i32 `[1, n_seq]`.
    out: Tensor,
}

impl StepIo {
    /// These handles in the graph the passes rewrote.
    fn remap(self, run: &PassRun) -> Result<StepIo, GraphError> {
        let l = self.leaves;
        Ok(StepIo {
            tokens: run.tensor(self.tokens)?,
            leaves: Leaves {
                positions: run.tensor(l.positions)?,
                write_cells: run.tensor(l.write_cells)?,
                block_table: run.tensor(l.block_table)?,
                seq_offsets: run.tensor(l.seq_offsets)?,
                kv_lens: run.tensor(l.kv_lens)?,
                slots: run.tensor(l.slots)?,
                decode: l.decode,
            },
            last_rows: self.last_rows.map(|t| run.tensor(t)).transpose()?,
            settings: self.settings.map(|t| run.tensor(t)).transpose()?,
            out: run.tensor(self.out)?,
        })
    }
}

/// The projections of a block that read the same input, in the order their rows are stacked, and
/// the name the stacked matrix is registered under ([`merge_projections`]).
fn projection_groups(config: &ModelConfig, il: usize) -> Vec<(Vec<String>, String)> {
    let pre = format!("blk.{il}");
    let w = |n: &str| format!("{pre}.{n}.weight");
    match config.layer_kind(il) {
        LayerKind::GatedDeltaNet => vec![
            (vec![w("attn_qkv"), w("attn_gate"), w("ssm_beta"), w("ssm_alpha")], format!("{pre}.in_proj.merged")),
            (vec![w("attn_qkv"), w("attn_gate")], format!("{pre}.in_proj_qkvz.merged")),
            (vec![w("ssm_beta"), w("ssm_alpha")], format!("{pre}.in_proj_ba.merged")),
        ],
        LayerKind::FullAttention => {
            vec![(vec![w("attn_q"), w("attn_k"), w("attn_v")], format!("{pre}.attn_qkv.merged"))]
        }
    }
}

/// Stacks, once at load, the projections of each block that read the same input into one resident
/// matrix ([`ModelWeights::merge_rows`]: one dtype and row length; the names stay as windows of
/// it), so a step runs one matmul a group: the DeltaNet block's qkv, z, beta and alpha (or the two
/// pairs of them that stack), the attention block's q, k and v. vLLM's merged linear layers do the
/// same; here the file is untouched and the graph reads each part through a view.
pub fn merge_projections(
    config: &ModelConfig,
    weights: &mut ModelWeights,
    backend: &mut dyn Backend,
) -> Result<(), WeightsError> {
    for il in 0..config.n_main_layers() {
        // (a group whose parts are missing, already windows or do not stack is left alone)
        for (parts, merged) in projection_groups(config, il) {
            let names: Vec<&str> = parts.iter().map(String::as_str).collect();
            weights.merge_rows(&names, &merged, backend)?;
        }
    }
    Ok(())
}

/// The constant i32 `[1, 1]` holding the shared expert's index among the stacked experts
/// (`n_expert`), which [`route_shared_experts`] places.
const SHARED_EXPERT_ID: &str = "moe.shared_expert_id";

/// The stacked gate, up and down experts of block `il` when its shared expert is routed: routed
/// experts `0..n_expert`, the shared expert last.
fn stacked_experts(il: usize) -> [String; 3] {
    ["gate", "up", "down"].map(|p| format!("blk.{il}.ffn_{p}_exps.merged"))
}

/// The router's rows stacked with the shared expert's gate row.
fn stacked_router(il: usize) -> String {
    format!("blk.{il}.ffn_gate_inp.merged")
}

/// Makes each MoE block's shared expert one more routed expert, once at load: its gate, up and
/// down matrices stacked after the routed experts' (index `n_expert`;
/// [`ModelWeights::stack`]) and its gate row after the router's rows. A step then runs the
/// shared expert inside the routed experts' kernels, weighted by `sigmoid` of its gate logit,
/// instead of three matmuls, the gate's and a weighting of its own (`ffn`). A block whose shared
/// expert has another width or dtype than its routed experts is left alone.
pub fn route_shared_experts(
    config: &ModelConfig,
    weights: &mut ModelWeights,
    backend: &mut dyn Backend,
) -> Result<(), WeightsError> {
    let Ffn::Moe { n_expert, .. } = config.ffn else { return Ok(()) };
    let mut any = false;
    for il in 0..config.n_main_layers() {
        let w = |n: &str| format!("blk.{il}.ffn_{n}.weight");
        let parts = ["gate", "up", "down"].map(|p| [w(&format!("{p}_exps")), w(&format!("{p}_shexp"))]);
        let fits = parts.iter().all(|[exps, shexp]| {
            let (Ok(e), Ok(s)) = (weights.get(exps), weights.get(shexp)) else { return false };
            e.meta.dtype == s.meta.dtype && e.meta.ne[..2] == s.meta.ne[..2] && s.meta.ne[2..] == [1, 1]
        });
        if !fits {
            continue;
        }
        for ([exps, shexp], merged) in parts.iter().zip(stacked_experts(il)) {
            any |= weights.stack(&[exps, shexp], &merged, 2, backend)?;
        }
        // (rows a multiple of 4: the router's logits then have 16-byte rows, read as float4)
        weights.stack_padded(&[&w("gate_inp"), &w("gate_inp_shexp")], &stacked_router(il), 1, 4, backend)?;
    }
    if any {
        weights.insert_i32(SHARED_EXPERT_ID, [1, 1, 1, 1], &[n_expert as i32], backend)?;
    }
    Ok(())
}

/// Rows `first .. first + rows` of a `[total, n]` tensor of 4-byte elements: one projection of a
/// group that may have run as one matmul over stacked weights (or the routed slots of the ids).
#[derive(Debug, Clone, Copy)]
struct Rows {
    product: Tensor,
    first: usize,
    total: usize,
}

impl Rows {
    /// The rows as `[rows, n]`, a view: tokens `total` floats apart.
    fn rows(self, g: &mut Graph, rows: usize) -> R<Tensor> {
        let (f, n) = (4, self.product.ne()[1]);
        let step = self.total * f;
        Ok(g.view(self.product, [rows, n, 1, 1], [f, step, step * n, step * n], self.first * f)?)
    }

    /// The rows as `[a, b, n]` (`a b` rows), a view: tokens `total` floats apart.
    fn heads(self, g: &mut Graph, a: usize, b: usize) -> R<Tensor> {
        let (f, n) = (4, self.product.ne()[1]);
        let step = self.total * f;
        Ok(g.view(self.product, [a, b, n, 1], [f, a * f, step, step * n], self.first * f)?)
    }
}

impl Builder<'_> {
    /// The shared expert's index for each of `n` tokens, i32 `[1, n]`: the constant repeated,
    /// once a step graph.
    fn shared_expert_ids(&mut self, n: usize) -> R<Tensor> {
        if let Some(t) = self.shared_expert_ids {
            return Ok(t);
        }
        let id = self.p(SHARED_EXPERT_ID)?;
        let t = self.g.repeat(id, &[1, n])?;
        self.shared_expert_ids = Some(t);
        Ok(t)
    }

    /// The products of `x` with the weights `names` of one projection group: through the group's
    /// stacked matrix when it was merged at load, else one matmul each.
    fn project(&mut self, x: Tensor, names: &[String], merged: Option<&str>) -> R<Vec<Rows>> {
        if let Some(m) = merged.filter(|m| self.w.contains(m)) {
            let product = {
                let w = self.p(m)?;
                self.g.mul_mat(w, x)?
            };
            let total = product.ne()[0];
            let mut first = 0;
            let mut out = Vec::with_capacity(names.len());
            for name in names {
                let rows = self.w.get(name)?.meta.ne[1];
                out.push(Rows { product, first, total });
                first += rows;
            }
            return Ok(out);
        }
        let mut out = Vec::with_capacity(names.len());
        for name in names {
            let w = self.p(name)?;
            let product = self.g.mul_mat(w, x)?;
            out.push(Rows { product, first: 0, total: product.ne()[0] });
        }
        Ok(out)
    }
}

/// Leaves shared by every layer of a step graph (see [`StepInputs`]).
#[derive(Debug, Clone, Copy)]
struct Leaves {
    positions: Tensor,
    write_cells: Tensor,
    block_table: Tensor,
    seq_offsets: Tensor,
    kv_lens: Tensor,
    slots: Tensor,
    /// Whether every sequence of the bucket feeds at most one token (decode): the delta rule
    /// then runs token-serial, else chunked.
    decode: bool,
}

fn alloc_zeroed(backend: &mut dyn Backend, ne: [usize; 4], dtype: DType) -> R<TensorRef> {
    let meta = TensorMeta::contiguous("cache", dtype, ne).map_err(GraphError::from)?;
    let bytes = meta.nbytes_contiguous();
    let buffer = backend.alloc(bytes)?;
    backend.write(buffer, 0, &vec![0u8; bytes])?;
    Ok(TensorRef { buffer, offset: 0, meta })
}

impl Model {
    /// Reads the config from `file` (an unknown architecture or bad metadata is a
    /// [`ConfigError`]), loads the weights and allocates zeroed caches on `backend`.
    pub fn load(file: &GgufFile, backend: &mut dyn Backend, opts: ModelOptions) -> R<Model> {
        let config = ModelConfig::from_gguf(file)?;
        Self::with_config(file, config, backend, opts)
    }

    /// [`Model::load`] with an explicit config.
    pub fn with_config(
        file: &GgufFile,
        config: ModelConfig,
        backend: &mut dyn Backend,
        opts: ModelOptions,
    ) -> R<Model> {
        config.validate()?;
        let weights = ModelWeights::load(file, &config, backend)?;
        Self::with_weights(config, weights, backend, opts)
    }

    /// A model of `config` with seeded synthetic weights uploaded straight to `backend`: the
    /// weights `tessera synth` would write with this dtype and seed (`synth::upload_weights`), with
    /// no file and no disk (what `tessera bench --preset` runs).
    pub fn synthetic(
        config: ModelConfig,
        weight: DType,
        seed: u64,
        backend: &mut dyn Backend,
        opts: ModelOptions,
    ) -> R<Model> {
        let weights = crate::synth::upload_weights(&config, weight, seed, backend)?;
        Self::with_weights(config, weights, backend, opts)
    }

    /// A model over weights already on `backend`, with zeroed caches allocated there. On an
    /// error the weights and whatever was allocated are freed.
    pub fn with_weights(
        config: ModelConfig,
        mut weights: ModelWeights,
        backend: &mut dyn Backend,
        opts: ModelOptions,
    ) -> R<Model> {
        let merged = (|| {
            if opts.merge_projections {
                merge_projections(&config, &mut weights, backend)?;
            }
            if opts.route_shared_expert > 0 {
                route_shared_experts(&config, &mut weights, backend)?;
            }
            Ok::<(), WeightsError>(())
        })();
        if let Err(e) = merged {
            weights.free(backend);
            return Err(e.into());
        }
        match Self::assemble(config, backend, opts) {
            Ok(mut m) => {
                m.weights = weights;
                Ok(m)
            }
            Err(e) => {
                weights.free(backend);
                Err(e)
            }
        }
    }

    /// A model of `config` with its caches and no weights yet (the caller moves them in).
    fn assemble(config: ModelConfig, backend: &mut dyn Backend, opts: ModelOptions) -> R<Model> {
        config.validate()?;
        let n_main = config.n_main_layers();
        let n_attn = (0..n_main).filter(|&il| config.layer_kind(il) == LayerKind::FullAttention).count();
        let n_rec = n_main - n_attn;
        let hd = config.head_dim;
        let kv_cfg = KvCacheConfig {
            block_size: opts.block_size,
            max_context: opts.max_context,
            dtype: opts.kv_dtype,
            policy: opts.policy,
            ..KvCacheConfig::new(n_attn.max(1), config.n_head_kv, hd, hd, opts.kv_blocks)
        };
        let kv = PagedKvCache::new(kv_cfg)?;
        let rec_cfg = RecurrentConfig::new(
            n_rec.max(1),
            (config.ssm_d_conv - 1, config.ssm_conv_dim()),
            (config.ssm_d_state, config.ssm_head_v_dim(), config.ssm_dt_rank),
            opts.n_slots,
        );
        let recurrent = RecurrentCache::new(rec_cfg)?;
        let steps = StepCache { capacity: opts.step_graphs.max(1), ..StepCache::default() };
        let mut model = Model {
            config,
            weights: ModelWeights::default(),
            kv,
            recurrent,
            layers: Vec::new(),
            kv_pad: opts.kv_pad.max(1),
            route_shared_expert: opts.route_shared_expert,
            steps,
            last_times: StepTimes::default(),
            passes: tessera_graph::passes::standard(),
            pass_reports: Vec::new(),
        };
        model.passes.disable_from_env()?;
        for il in 0..n_main {
            let (shapes, dtype) = match model.config.layer_kind(il) {
                LayerKind::FullAttention => ([model.kv.k_shape(), model.kv.v_shape()], opts.kv_dtype),
                LayerKind::GatedDeltaNet => ([model.recurrent.conv_shape(), model.recurrent.delta_shape()], DType::F32),
            };
            // On an error, free what this model allocated so far (the caller frees the weights).
            let a = match alloc_zeroed(backend, shapes[0], dtype) {
                Ok(a) => a,
                Err(e) => {
                    model.free(backend);
                    return Err(e);
                }
            };
            let b = match alloc_zeroed(backend, shapes[1], dtype) {
                Ok(b) => b,
                Err(e) => {
                    backend.free(a.buffer);
                    model.free(backend);
                    return Err(e);
                }
            };
            model.layers.push(match model.config.layer_kind(il) {
                LayerKind::FullAttention => LayerCache::Attn { k: a, v: b },
                LayerKind::GatedDeltaNet => LayerCache::Recurrent { conv: a, delta: b },
            });
        }
        Ok(model)
    }

    /// Frees the weights, caches and planned step graphs on `backend`.
    pub fn free(&mut self, backend: &mut dyn Backend) {
        self.free_on(&mut [backend]);
    }

    /// Frees the weights, caches and planned step graphs: on `backends`, those the model's steps
    /// ran on ([`Model::step_on`]), the first the one it was loaded on.
    pub fn free_on(&mut self, backends: &mut [&mut dyn Backend]) {
        for (_, mut sg) in self.steps.graphs.drain() {
            sg.exe.free(backends);
        }
        self.steps.arenas.free(backends);
        let Some(backend) = backends.first_mut() else { return };
        let backend = &mut **backend;
        self.steps.stats.arena_bytes = 0;
        self.weights.free(backend);
        for l in self.layers.drain(..) {
            let (a, b) = match l {
                LayerCache::Attn { k, v } => (k, v),
                LayerCache::Recurrent { conv, delta } => (conv, delta),
            };
            backend.free(a.buffer);
            backend.free(b.buffer);
        }
    }

    /// Adds sequence `id` to both caches (its recurrent slot is zeroed before its first step).
    pub fn add_sequence(&mut self, id: SeqId) -> R<()> {
        self.recurrent.add_sequence(id)?;
        if let Err(e) = self.kv.add_sequence(id) {
            self.recurrent.remove_sequence(id)?;
            return Err(e.into());
        }
        Ok(())
    }

    /// Removes sequence `id` from both caches.
    pub fn remove_sequence(&mut self, id: SeqId) -> R<()> {
        self.kv.remove_sequence(id)?;
        self.recurrent.remove_sequence(id)?;
        Ok(())
    }

    /// Tokens sequence `id` holds.
    pub fn seq_len(&self, id: SeqId) -> R<usize> {
        Ok(self.kv.len(id)?)
    }

    /// Runs one step: appends `tokens` to each sequence (added on first use) and returns its
    /// logits, in batch order. Sequences are distinct and each has at least one token. Cache space
    /// for the whole batch is reserved first, all or nothing (a sequence past `max_context` or a
    /// full cache is an error before anything runs, and sequences this call added are removed
    /// again). An error while a graph runs (after reservation) leaves the reserved positions and
    /// any state already updated in place: the caller should remove the affected sequences.
    pub fn step(&mut self, backend: &mut dyn Backend, batch: &[(SeqId, &[u32])], which: Logits) -> R<Vec<Vec<f32>>> {
        self.step_on(&mut [backend], batch, which)
    }

    /// [`Model::step`] over several backends in order of preference: the first is the one the
    /// model was loaded on; an op it does not support runs on the next that does
    /// (`tessera_graph::schedule`), its inputs copied over and back.
    pub fn step_on(
        &mut self,
        backends: &mut [&mut dyn Backend],
        batch: &[(SeqId, &[u32])],
        which: Logits,
    ) -> R<Vec<Vec<f32>>> {
        let out = self.step_as(backends, batch, Output::Logits(which))?;
        Ok(out.into_iter().map(|o| if let SeqOut::Logits(l) = o { l } else { Vec::new() }).collect())
    }

    /// [`Model::step`] with sampling on the device: the graph ends in the `sample` op over each
    /// sequence's last logits with that sequence's `settings` (temperature, top-k, top-p and
    /// its uniform draw, from [`crate::sample::Sampler::next_settings`]), and only the token ids
    /// (4 bytes a sequence, not `n_vocab * 4`) come back: the token
    /// [`crate::sample::Sampler::sample`] would pick from [`Model::step`]'s last logits.
    pub fn step_sample_on(
        &mut self,
        backends: &mut [&mut dyn Backend],
        batch: &[(SeqId, &[u32])],
        settings: &[SampleSettings],
    ) -> R<Vec<u32>> {
        if settings.len() != batch.len() {
            let why = format!("{} sampling settings for {} sequences", settings.len(), batch.len());
            return Err(ModelError::BadBatch { why });
        }
        let out = self.step_as(backends, batch, Output::Tokens(settings))?;
        Ok(out.into_iter().map(|o| if let SeqOut::Token(t) = o { t } else { 0 }).collect())
    }

    /// [`Model::step_sample_on`] with greedy settings for every sequence: the argmax of each
    /// sequence's last logits (the lowest id on ties).
    pub fn step_greedy(&mut self, backend: &mut dyn Backend, batch: &[(SeqId, &[u32])]) -> R<Vec<u32>> {
        self.step_greedy_on(&mut [backend], batch)
    }

    /// [`Model::step_greedy`] over several backends (see [`Model::step_on`]).
    pub fn step_greedy_on(&mut self, backends: &mut [&mut dyn Backend], batch: &[(SeqId, &[u32])]) -> R<Vec<u32>> {
        self.step_sample_on(backends, batch, &vec![SampleSettings::greedy(); batch.len()])
    }

    fn step_as(
        &mut self,
        backends: &mut [&mut dyn Backend],
        batch: &[(SeqId, &[u32])],
        what: Output<'_>,
    ) -> R<Vec<SeqOut>> {
        if backends.is_empty() {
            return Err(ExecError::NoBackend.into());
        }
        if batch.is_empty() {
            return Err(ModelError::BadBatch { why: "empty batch".into() });
        }
        for (id, toks) in batch {
            if toks.is_empty() {
                return Err(ModelError::BadBatch { why: format!("sequence {id} has no tokens") });
            }
            if let Some(&t) = toks.iter().find(|&&t| t as usize >= self.config.n_vocab) {
                return Err(ModelError::BadBatch {
                    why: format!("token {t} of sequence {id} is outside the vocab of {}", self.config.n_vocab),
                });
            }
        }
        let mut added = Vec::new();
        for (id, _) in batch {
            if !self.kv.contains(*id) {
                if let Err(e) = self.add_sequence(*id) {
                    for a in added {
                        let _ = self.remove_sequence(a);
                    }
                    return Err(e);
                }
                added.push(*id);
            }
        }
        let requests: Vec<(SeqId, usize)> = batch.iter().map(|(id, t)| (*id, t.len())).collect();
        let ranges = match self.kv.reserve_many(&requests) {
            Ok(r) => r,
            Err(e) => {
                for a in added {
                    let _ = self.remove_sequence(a);
                }
                return Err(e.into());
            }
        };
        self.last_times = StepTimes::default();
        self.clear_new_slots(&mut *backends[0])?;
        let packed: Vec<(SeqId, &[u32], Range<usize>)> =
            batch.iter().zip(ranges).map(|((id, toks), r)| (*id, *toks, r)).collect();
        self.run_step(backends, &packed, what)
    }

    /// Zeroes the recurrent slots handed out since the last step, in every recurrent layer.
    fn clear_new_slots(&mut self, backend: &mut dyn Backend) -> R<()> {
        let slots = self.recurrent.take_slots_to_clear();
        if slots.is_empty() {
            return Ok(());
        }
        let (conv_b, delta_b) = (self.recurrent.conv_bytes_per_slot(), self.recurrent.delta_bytes_per_slot());
        for l in &self.layers {
            if let LayerCache::Recurrent { conv, delta } = l {
                for &s in &slots {
                    let s = s as usize;
                    backend.write(conv.buffer, conv.offset + s * conv_b, &vec![0u8; conv_b])?;
                    backend.write(delta.buffer, delta.offset + s * delta_b, &vec![0u8; delta_b])?;
                }
            }
        }
        Ok(())
    }

    /// Runs one packed step: lays the batch out in its bucket, finds (or builds) the bucket's
    /// planned graph, writes the inputs, runs it and reads each sequence's result back.
    fn run_step(
        &mut self,
        backends: &mut [&mut dyn Backend],
        batch: &[(SeqId, &[u32], Range<usize>)],
        what: Output<'_>,
    ) -> R<Vec<SeqOut>> {
        let t0 = std::time::Instant::now();
        let inp = StepInputs::new(&self.kv, &self.recurrent, batch, self.kv_pad)?;
        let n_vocab = self.config.n_vocab;
        let bucket = Bucket {
            n_tokens: inp.n_tokens,
            n_seq: inp.n_seq,
            n_kv: inp.n_kv,
            all_logits: what == Output::Logits(Logits::All),
            sample: matches!(what, Output::Tokens(_)),
        };
        let sg = self.planned_step(backends, bucket)?;
        let mut s = sg.exe.session_on(backends.iter_mut().map(|b| -> &mut dyn Backend { &mut **b }).collect());
        let io = &sg.io;
        s.set_i32(io.tokens, &inp.tokens)?;
        // A leaf no op reads has no memory: the attention's leaves in a model whose blocks are
        // all gated DeltaNet (fewer than `full_attention_interval`), the state slots in one
        // without any.
        let l = &io.leaves;
        for (t, values) in [
            (l.positions, &inp.positions),
            (l.write_cells, &inp.write_cells),
            (l.block_table, &inp.block_table),
            (l.seq_offsets, &inp.seq_offsets),
            (l.kv_lens, &inp.kv_lens),
            (l.slots, &inp.slots),
        ] {
            if s.placement(t).is_some() {
                s.set_i32(t, values)?;
            }
        }
        if let Some(rows) = io.last_rows {
            s.set_i32(rows, &inp.last_rows)?;
        }
        if let (Some(t), Output::Tokens(settings)) = (io.settings, what) {
            let padding = std::iter::repeat_n(SampleSettings::greedy(), inp.n_seq - settings.len());
            let rows: Vec<f32> = settings.iter().copied().chain(padding).flat_map(|st| st.to_row()).collect();
            s.set_f32(t, &rows)?;
        }
        let t1 = std::time::Instant::now();
        s.run()?;
        let t2 = std::time::Instant::now();
        let n_seq = batch.len();
        let out = if bucket.sample {
            let ids = s.get(io.out)?;
            ids.chunks_exact(4)
                .take(n_seq)
                .map(|c| SeqOut::Token(i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as u32))
                .collect()
        } else {
            let all = s.get_f32(io.out)?;
            let rows = |s: usize| if bucket.all_logits { inp.rows(s) } else { s..s + 1 };
            (0..n_seq).map(|i| SeqOut::Logits(all[rows(i).start * n_vocab..rows(i).end * n_vocab].to_vec())).collect()
        };
        let t3 = std::time::Instant::now();
        drop(s);
        self.last_times += StepTimes {
            prepare: (t1 - t0).as_secs_f64(),
            launch: (t2 - t1).as_secs_f64(),
            wait: (t3 - t2).as_secs_f64(),
        };
        Ok(out)
    }

    /// The planned step graph of `bucket`: the cached one, or a new one built, planned and
    /// placed (evicting the least recently used beyond the capacity).
    fn planned_step(&mut self, backends: &mut [&mut dyn Backend], bucket: Bucket) -> R<&mut StepGraph> {
        // A graph placed on other backends than these is planned again.
        if self.steps.graphs.get(&bucket).is_some_and(|g| g.exe.n_backends() != backends.len())
            && let Some(mut old) = self.steps.graphs.remove(&bucket)
        {
            old.exe.free(backends);
        }
        // So is one placed in an arena since replaced by a larger one.
        let generation = Some(self.steps.arenas.generation());
        if self.steps.graphs.get(&bucket).is_some_and(|g| g.exe.arena_generation() != generation)
            && let Some(mut old) = self.steps.graphs.remove(&bucket)
        {
            old.exe.free(backends);
            self.steps.stats.evicted += 1;
        }
        self.steps.clock += 1;
        let clock = self.steps.clock;
        if self.steps.graphs.contains_key(&bucket) {
            self.steps.stats.reused += 1;
        } else {
            while self.steps.graphs.len() >= self.steps.capacity {
                let Some((&oldest, _)) = self.steps.graphs.iter().min_by_key(|(_, g)| g.used) else { break };
                if let Some(mut old) = self.steps.graphs.remove(&oldest) {
                    old.exe.free(backends);
                    self.steps.stats.evicted += 1;
                }
            }
            let sg = self.build_step(backends, bucket)?;
            self.steps.stats.built += 1;
            self.steps.stats.arena_bytes = self.steps.arenas.bytes();
            self.steps.graphs.insert(bucket, sg);
        }
        let sg = self.steps.graphs.get_mut(&bucket).expect("present or inserted above");
        sg.used = clock;
        Ok(sg)
    }

    /// Where the last [`Model::step`]'s time went.
    pub fn last_step_times(&self) -> StepTimes {
        self.last_times
    }

    /// What the step-graph cache has done.
    pub fn step_cache_stats(&self) -> StepCacheStats {
        self.steps.stats
    }

    /// The step graph of `bucket` (for tools and tests: DOT dumps, the memory planner's checks),
    /// with the bindings of its weight and cache leaves.
    pub fn step_graph(&self, bucket: Bucket) -> R<(Graph, Vec<(Tensor, TensorRef)>)> {
        let (b, _) = self.build_graph(bucket)?;
        Ok((b.g, b.binds))
    }

    /// The fusion passes run on every step graph (`tessera_graph::passes::standard`, minus
    /// those named in `TESSERA_DISABLE_PASSES`): switch passes here; step graphs planned
    /// before keep what they were built with.
    pub fn passes_mut(&mut self) -> &mut Pipeline {
        &mut self.passes
    }

    /// Frees the planned step graphs (not the arenas they share): the next step of each bucket is
    /// built again, with the passes as they are now.
    pub fn drop_step_graphs(&mut self, backends: &mut [&mut dyn Backend]) {
        for (_, mut sg) in self.steps.graphs.drain() {
            sg.exe.free(backends);
            self.steps.stats.evicted += 1;
        }
    }

    /// The fusion passes' names, in order, with whether each is on.
    pub fn passes(&self) -> Vec<(&'static str, bool)> {
        self.passes.passes()
    }

    /// What the passes did to the step graph built last (one report per enabled pass).
    pub fn pass_reports(&self) -> &[PassReport] {
        &self.pass_reports
    }

    /// What the enabled passes do to the step graph of `bucket` on `backend` (built and
    /// rewritten, not planned): the ops that run before and after, and each pass's report.
    pub fn fusion_summary(&self, backend: &dyn Backend, bucket: Bucket) -> R<FusionSummary> {
        let (b, _) = self.build_graph(bucket)?;
        let ops_before = running_ops(&b.g);
        let run = self.passes.run(b.g, &|op, inputs| backend.supports(op, inputs))?;
        Ok(FusionSummary { ops_before, ops_after: running_ops(&run.graph), reports: run.reports })
    }

    /// Builds the step graph of `bucket`, runs the fusion passes on it (a fusion whose op the
    /// first backend lacks is skipped) and plans it.
    fn build_step(&mut self, backends: &mut [&mut dyn Backend], bucket: Bucket) -> R<StepGraph> {
        let (b, io) = self.build_graph(bucket)?;
        let Builder { g, binds, .. } = b;
        let first = &*backends[0];
        let run = self.passes.run(g, &|op, inputs| first.supports(op, inputs))?;
        let io = io.remap(&run)?;
        let binds = binds.into_iter().map(|(t, r)| Ok((run.tensor(t)?, r))).collect::<Result<Vec<_>, GraphError>>()?;
        self.pass_reports = run.reports;
        let exe = Executable::scheduled_shared(
            run.graph,
            backends,
            SessionOptions::default(),
            &binds,
            &mut self.steps.arenas,
        )?;
        Ok(StepGraph { exe, io, used: 0 })
    }

    /// Builds the step graph of `bucket`: token ids in, logits (or sampled token ids) out.
    fn build_graph(&self, bucket: Bucket) -> R<(Builder<'_>, StepIo)> {
        let Bucket { n_tokens: n, n_seq, n_kv, all_logits, sample } = bucket;
        if sample && all_logits {
            return Err(ModelError::BadBatch { why: "sampling steps keep only the last logits".into() });
        }
        let c = &self.config;
        let mut b = Builder { g: Graph::new(), binds: Vec::new(), w: &self.weights, shared_expert_ids: None };
        let tokens = b.g.input("tokens", DType::I32, [n, 1, 1, 1])?;
        let leaves = Leaves {
            positions: b.g.input("positions", DType::I32, [4 * n, 1, 1, 1])?,
            write_cells: b.g.input("kv_write_cells", DType::I32, [n, 1, 1, 1])?,
            block_table: b.g.input("block_table", DType::I32, [n_kv, n_seq, 1, 1])?,
            seq_offsets: b.g.input("seq_offsets", DType::I32, [n_seq + 1, 1, 1, 1])?,
            kv_lens: b.g.input("kv_lens", DType::I32, [n_seq, 1, 1, 1])?,
            slots: b.g.input("state_slots", DType::I32, [n_seq, 1, 1, 1])?,
            decode: n <= n_seq,
        };
        let last_rows = if all_logits { None } else { Some(b.g.input("last_rows", DType::I32, [n_seq, 1, 1, 1])?) };

        let embd = b.p("token_embd.weight")?;
        let mut x = b.g.get_rows(embd, tokens)?;
        for il in 0..c.n_main_layers() {
            let pre = format!("blk.{il}");
            let norm_w = b.p(&format!("{pre}.attn_norm.weight"))?;
            let h = b.g.rms_norm(x, c.rms_eps)?;
            let h = b.g.mul(h, norm_w)?;
            let mixed = match self.layers[il] {
                LayerCache::Attn { k, v } => self.attention(&mut b, il, h, &leaves, (k, v))?,
                LayerCache::Recurrent { conv, delta } => self.delta_net(&mut b, il, h, &leaves, (conv, delta))?,
            };
            x = b.g.add(x, mixed)?;
            let post_w = b.p(&format!("{pre}.post_attention_norm.weight"))?;
            let h = b.g.rms_norm(x, c.rms_eps)?;
            let h = b.g.mul(h, post_w)?;
            let f = self.ffn(&mut b, il, h)?;
            x = b.g.add(x, f)?;
        }
        let out_w = b.p("output_norm.weight")?;
        let mut h = b.g.rms_norm(x, c.rms_eps)?;
        h = b.g.mul(h, out_w)?;
        if let Some(rows) = last_rows {
            h = b.g.get_rows(h, rows)?;
        }
        let head = if c.tied_embeddings { embd } else { b.p("output.weight")? };
        let mut out = b.g.mul_mat(head, h)?;
        let settings = if sample { Some(b.g.input("sample_settings", DType::F32, [4, n_seq, 1, 1])?) } else { None };
        if let Some(st) = settings {
            out = b.g.sample(out, st)?; // i32 [1, n_seq]
        }
        b.g.mark_output(out)?;
        Ok((b, StepIo { tokens, leaves, last_rows, settings, out }))
    }

    /// Gated full attention (notes §4.2): q and gate interleaved per head in `attn_q`, q/k rms
    /// norms, imrope, K/V written into the paged cache, paged flash attention, sigmoid gate.
    fn attention(
        &self,
        b: &mut Builder<'_>,
        il: usize,
        x: Tensor,
        l: &Leaves,
        (k_store, v_store): (TensorRef, TensorRef),
    ) -> R<Tensor> {
        let c = &self.config;
        let (hd, nh, nkv) = (c.head_dim, c.n_head, c.n_head_kv);
        let n = x.ne()[1];
        let f = 4; // f32 activations
        let pre = &format!("blk.{il}");
        let (names, merged) = projection_groups(c, il).swap_remove(0);
        let [qg, k, v] = b.project(x, &names, Some(&merged))?[..] else { unreachable!("three projections") };
        let wo = b.p(&format!("{pre}.attn_output.weight"))?;
        let qn = b.p(&format!("{pre}.attn_q_norm.weight"))?;
        let kn = b.p(&format!("{pre}.attn_k_norm.weight"))?;
        let g = &mut b.g;

        // q and its gate interleaved per head in rows 0 .. 2 hd nh of the q projection
        let step = qg.total * f;
        let nb = [f, 2 * hd * f, step, step * n];
        let q = g.view(qg.product, [hd, nh, n, 1], nb, qg.first * f)?;
        let gate = g.view(qg.product, [hd, nh, n, 1], nb, (qg.first + hd) * f)?;
        let gate = g.cont(gate)?;
        let gate = g.reshape(gate, &[hd * nh, n])?;
        let q = g.rms_norm(q, c.rms_eps)?;
        let q = g.mul(q, qn)?;
        let k = k.heads(g, hd, nkv)?;
        let k = g.rms_norm(k, c.rms_eps)?;
        let k = g.mul(k, kn)?;
        let v = v.rows(g, hd * nkv)?;

        let rope = RopeParams {
            n_rot: c.n_rot,
            freq_base: c.rope_freq_base,
            pairing: RopePairing::Neox,
            sections: Some(c.rope_sections),
        };
        let q = g.rope_multi(q, l.positions, rope)?;
        let k = g.rope_multi(k, l.positions, rope)?;

        let kc = b.state(&format!("{pre}.cache_k"), k_store)?;
        let vc = b.state(&format!("{pre}.cache_v"), v_store)?;
        let g = &mut b.g;
        let k = g.reshape(k, &[hd * nkv, n])?;
        let kc = g.set_rows(kc, k, l.write_cells)?;
        let vc = g.set_rows(vc, v, l.write_cells)?;
        let kview = self.kv.k_view();
        let vview = self.kv.v_view();
        let kc = g.view(kc, kview.ne, kview.nb, 0)?;
        let vc = g.view(vc, vview.ne, vview.nb, 0)?;

        let q = g.permute(q, [0, 2, 1, 3])?; // [hd, n, nh, 1]
        let scale = 1.0 / (hd as f32).sqrt();
        let (bt, offs, lens) = (Some(l.block_table), l.seq_offsets, l.kv_lens);
        let o = g.flash_attn_ext_ragged(q, kc, vc, None, bt, offs, lens, scale, 0.0)?; // [hd, nh, n, 1]
        let o = g.reshape(o, &[hd * nh, n])?;
        let sg = g.sigmoid(gate)?;
        let o = g.mul(o, sg)?;
        Ok(g.mul_mat(wo, o)?)
    }

    /// Gated DeltaNet linear attention (notes §2.2).
    fn delta_net(
        &self,
        b: &mut Builder<'_>,
        il: usize,
        x: Tensor,
        l: &Leaves,
        (conv_store, delta_store): (TensorRef, TensorRef),
    ) -> R<Tensor> {
        let c = &self.config;
        let (hk, hv, sk, sv) = (c.ssm_n_group, c.ssm_dt_rank, c.ssm_d_state, c.ssm_head_v_dim());
        let ch = c.ssm_conv_dim();
        let n = x.ne()[1];
        let f = 4;
        let pre = &format!("blk.{il}");
        let groups = projection_groups(c, il);
        let rows = if b.w.contains(&groups[0].1) {
            b.project(x, &groups[0].0, Some(&groups[0].1))?
        } else {
            let mut rows = b.project(x, &groups[1].0, Some(&groups[1].1))?;
            rows.extend(b.project(x, &groups[2].0, Some(&groups[2].1))?);
            rows
        };
        let [qkv, z, beta, alpha] = rows[..] else { unreachable!("four projections") };
        let w_conv = b.p(&format!("{pre}.ssm_conv1d.weight"))?;
        let dt_bias = b.p(&format!("{pre}.ssm_dt.bias"))?;
        let ssm_a = b.p(&format!("{pre}.ssm_a"))?;
        let w_norm = b.p(&format!("{pre}.ssm_norm.weight"))?;
        let w_out = b.p(&format!("{pre}.ssm_out.weight"))?;
        let conv_state = b.state(&format!("{pre}.conv_state"), conv_store)?;
        let delta_state = b.state(&format!("{pre}.delta_state"), delta_store)?;
        let g = &mut b.g;

        let beta = beta.rows(g, hv)?;
        let beta = g.sigmoid(beta)?;
        let beta = g.reshape(beta, &[1, hv, n, 1])?;
        let alpha = alpha.rows(g, hv)?;
        let alpha = g.add(alpha, dt_bias)?;
        let alpha = g.softplus(alpha)?;
        let gdecay = g.mul(alpha, ssm_a)?;
        let gdecay = g.reshape(gdecay, &[1, hv, n, 1])?;

        let qkv = qkv.rows(g, ch)?;
        let conv = g.ssm_conv_update_inplace_ragged(qkv, conv_state, w_conv, l.slots, l.seq_offsets, true)?; // [ch, n, 1]
        let nb = |d: usize| [f, d * f, ch * f, ch * n * f];
        // q and k lie side by side in each token's conv output: one l2_norm over both heads' rows
        let qk = g.view(conv, [sk, 2 * hk, n, 1], nb(sk), 0)?;
        let qk = g.l2_norm(qk, c.rms_eps)?; // [sk, 2 hk, n] contiguous
        let nb_qk = [f, sk * f, 2 * hk * sk * f, 2 * hk * sk * n * f];
        let q = g.view(qk, [sk, hk, n, 1], nb_qk, 0)?;
        let k = g.view(qk, [sk, hk, n, 1], nb_qk, hk * sk * f)?;
        let v = g.view(conv, [sv, hv, n, 1], nb(sv), 2 * hk * sk * f)?;
        let algo = if l.decode { DeltaNetAlgo::Serial } else { DeltaNetAlgo::Chunked { chunk: 64 } };
        let params =
            GatedDeltaNetParams { scale: 1.0 / (sk as f32).sqrt(), head_map: HeadMap::Tiled, algo, ragged: true };
        let o = g.gated_delta_net_ragged(q, k, v, gdecay, beta, delta_state, l.slots, l.seq_offsets, params)?; // [sv, hv, n, 1]

        let o = g.rms_norm(o, c.rms_eps)?;
        let o = g.mul(o, w_norm)?;
        let z = z.heads(g, sv, hv)?;
        let z = g.silu(z)?;
        let o = g.mul(o, z)?;
        let o = g.reshape(o, &[hv * sv, n])?;
        Ok(g.mul_mat(w_out, o)?)
    }

    /// Dense SwiGLU or routed experts plus the gated shared expert (notes §5.1).
    fn ffn(&self, b: &mut Builder<'_>, il: usize, x: Tensor) -> R<Tensor> {
        let pre = &format!("blk.{il}");
        match self.config.ffn {
            Ffn::Dense { .. } => {
                let wg = b.p(&format!("{pre}.ffn_gate.weight"))?;
                let wu = b.p(&format!("{pre}.ffn_up.weight"))?;
                let wd = b.p(&format!("{pre}.ffn_down.weight"))?;
                let g = &mut b.g;
                let gt = g.mul_mat(wg, x)?;
                let up = g.mul_mat(wu, x)?;
                let a = g.swiglu(gt, up)?;
                Ok(g.mul_mat(wd, a)?)
            }
            Ffn::Moe { n_expert, n_expert_used: k, .. } => {
                let stacked = stacked_experts(il);
                let short = x.ne()[1] <= self.route_shared_expert;
                if short && stacked.iter().all(|m| b.w.contains(m)) && b.w.contains(SHARED_EXPERT_ID) {
                    return moe_shared_routed(b, il, x, &stacked, n_expert, k);
                }
                let w_inp = b.p(&format!("{pre}.ffn_gate_inp.weight"))?;
                let w_ge = b.p(&format!("{pre}.ffn_gate_exps.weight"))?;
                let w_ue = b.p(&format!("{pre}.ffn_up_exps.weight"))?;
                let w_de = b.p(&format!("{pre}.ffn_down_exps.weight"))?;
                let w_sh_inp = b.p(&format!("{pre}.ffn_gate_inp_shexp.weight"))?;
                let w_sg = b.p(&format!("{pre}.ffn_gate_shexp.weight"))?;
                let w_su = b.p(&format!("{pre}.ffn_up_shexp.weight"))?;
                let w_sd = b.p(&format!("{pre}.ffn_down_shexp.weight"))?;
                let g = &mut b.g;

                let logits = g.mul_mat(w_inp, x)?; // [n_expert, n]
                let probs = g.softmax(logits, 1.0, None)?;
                let sel = g.top_k(probs, k)?; // i32 [k, n]
                let w = routing_weights(g, probs, sel, k)?;
                let moe = routed_experts(g, [w_ge, w_ue, w_de], x, sel, w)?;

                let sg = g.mul_mat(w_sg, x)?;
                let su = g.mul_mat(w_su, x)?;
                let sa = g.swiglu(sg, su)?;
                let sh = g.mul_mat(w_sd, sa)?; // [e, n]
                let gate = g.mul_mat(w_sh_inp, x)?; // [1, n]
                let gate = g.sigmoid(gate)?;
                let sh = g.mul(sh, gate)?;
                Ok(g.add(moe, sh)?)
            }
        }
    }
}

/// The MoE block with its shared expert routed as slot `k` of every token
/// ([`route_shared_experts`]): the router's logits and the shared gate's in one matmul, the
/// routed ids with the shared expert's appended, the routed weights with `sigmoid` of the shared
/// gate appended, and the experts' matmuls over `k + 1` slots.
fn moe_shared_routed(
    b: &mut Builder<'_>,
    il: usize,
    x: Tensor,
    stacked: &[String; 3],
    n_expert: usize,
    k: usize,
) -> R<Tensor> {
    let n = x.ne()[1];
    let router = [format!("blk.{il}.ffn_gate_inp.weight"), format!("blk.{il}.ffn_gate_inp_shexp.weight")];
    let rows = b.project(x, &router, Some(&stacked_router(il)))?;
    let experts = [b.p(&stacked[0])?, b.p(&stacked[1])?, b.p(&stacked[2])?];
    let shared = b.shared_expert_ids(n)?;
    let g = &mut b.g;
    let logits = rows[0].rows(g, n_expert)?; // [n_expert, n]
    let gate = rows[1].rows(g, 1)?; // [1, n]
    let probs = g.softmax(logits, 1.0, None)?;
    let sel = g.top_k(probs, k)?;
    let ids = g.concat(sel, shared, 0)?; // i32 [k + 1, n]
    let routed = Rows { product: ids, first: 0, total: k + 1 }.rows(g, k)?;
    let w = routing_weights(g, probs, routed, k)?;
    let gate = g.sigmoid(gate)?;
    let gate = g.reshape(gate, &[1, 1, n])?;
    let w = g.concat(w, gate, 1)?; // [1, k + 1, n]
    routed_experts(g, experts, x, ids, w)
}

/// The routing weights of the experts `sel` (`[k, n]`): `probs` at them, renormalised over the
/// `k` slots, `[1, k, n]`.
fn routing_weights(g: &mut Graph, probs: Tensor, sel: Tensor, k: usize) -> R<Tensor> {
    let [n_expert, n, ..] = probs.ne();
    let p3 = g.reshape(probs, &[1, n_expert, n])?;
    let w = g.get_rows(p3, sel)?; // [1, k, n]
    let w = g.reshape(w, &[k, n])?;
    let wsum = g.sum_rows(w)?; // [1, n]
    let w = g.div(w, wsum)?;
    Ok(g.reshape(w, &[1, k, n])?)
}

/// `sum_u w[u] * down_u(swiglu(gate_u(x), up_u(x)))` over the slots `u` of `ids` (`[slots, n]`),
/// the experts' `[gate, up, down]` stacks indexed by the ids: `[n_embd, n]`.
fn routed_experts(g: &mut Graph, [w_ge, w_ue, w_de]: [Tensor; 3], x: Tensor, ids: Tensor, w: Tensor) -> R<Tensor> {
    let [e, n, ..] = x.ne();
    let cur = g.reshape(x, &[e, 1, n])?;
    let gt = g.mul_mat_id(w_ge, cur, ids)?; // [n_ff, slots, n]
    let up = g.mul_mat_id(w_ue, cur, ids)?;
    let a = g.swiglu(gt, up)?;
    let ex = g.mul_mat_id(w_de, a, ids)?; // [e, slots, n]
    let ex = g.mul(ex, w)?;
    // the weighted experts summed over the slots in one reduction (k - 1 adds of slot views
    // were k - 1 launches a layer)
    let slots_first = g.transpose(ex)?; // [slots, e, n]
    let moe = g.sum_rows(slots_first)?; // [1, e, n]
    Ok(g.reshape(moe, &[e, n])?)
}
