//! [`StepBuilder`]: the graph of one step under construction, with what a family's
//! [`Architecture::build`](super::Architecture::build) reads.

use std::collections::HashMap;

use tessera_graph::{Graph, Tensor, TensorRef};

use crate::cache::KvView;
use crate::model::{Bucket, LayerMemory, ModelError, ModelOptions};
use crate::weights::ModelWeights;

/// The input leaves of a step graph, shared by every layer (filled each step from the packed
/// batch, [`crate::batch`]). All i32. A leaf no op reads gets no memory and is not written.
#[derive(Debug, Clone, Copy)]
pub struct StepLeaves {
    /// Token ids `[n_tokens]` (padding tokens: 0).
    pub tokens: Tensor,
    /// Positions `[4 n_tokens]`, stream-major: four M-RoPE streams `(p, p, p, 0)`; the first
    /// `n_tokens` are the token positions.
    pub positions: Tensor,
    /// The KV cache row each token's K/V is written to, `[n_tokens]` (padding: the sink cell).
    pub write_cells: Tensor,
    /// `[n_kv, n_seq]`: each sequence's logical position -> KV cache cell.
    pub block_table: Tensor,
    /// `[n_seq + 1]`: sequence `s` owns packed tokens `seq_offsets[s] .. seq_offsets[s + 1]`.
    pub seq_offsets: Tensor,
    /// `[n_seq]`: each sequence's KV length after this step.
    pub kv_lens: Tensor,
    /// `[n_seq]`: each sequence's recurrent state slot.
    pub slots: Tensor,
    /// Every sequence of the bucket feeds at most one token (a decode step): recurrences run
    /// token-serial, else chunked.
    pub decode: bool,
}

impl StepLeaves {
    /// These leaves after the fusion passes rewrote the graph.
    pub(crate) fn remap(self, run: &tessera_graph::passes::PassRun) -> Result<StepLeaves, tessera_graph::GraphError> {
        Ok(StepLeaves {
            tokens: run.tensor(self.tokens)?,
            positions: run.tensor(self.positions)?,
            write_cells: run.tensor(self.write_cells)?,
            block_table: run.tensor(self.block_table)?,
            seq_offsets: run.tensor(self.seq_offsets)?,
            kv_lens: run.tensor(self.kv_lens)?,
            slots: run.tensor(self.slots)?,
            decode: self.decode,
        })
    }
}

/// One attention layer's KV cache in a step graph.
#[derive(Debug, Clone, Copy)]
pub struct KvCacheTensors {
    /// K storage `[k_dim n_head_kv, n_cells + 1]` (row `c` = cell `c`): the target of `set_rows`.
    pub k: Tensor,
    /// V storage `[v_dim n_head_kv, n_cells + 1]`.
    pub v: Tensor,
    /// The view `[k_dim, n_cells, n_head_kv, 1]` paged `flash_attn_ext` reads K through.
    pub k_view: KvView,
    /// The view `[v_dim, n_cells, n_head_kv, 1]` of V.
    pub v_view: KvView,
}

/// The graph of one step under construction, with bindings to the model's resident memory.
///
/// - [`StepBuilder::param`] binds a resident weight as a parameter leaf (once per name: asking
///   again returns the same leaf);
/// - [`StepBuilder::leaves`] are the step's inputs;
/// - [`StepBuilder::kv_cache`] / [`StepBuilder::recurrent_state`] bind layer `il`'s cache
///   memory as in-place state leaves (the layer must have declared that cache in
///   [`Architecture::layer_caches`](super::Architecture::layer_caches));
/// - [`StepBuilder::g`] is the graph: add ops to it directly.
pub struct StepBuilder<'m> {
    /// The graph under construction (ggml-order shapes; see `tessera_graph::Graph`).
    pub g: Graph,
    binds: Vec<(Tensor, TensorRef)>,
    weights: &'m ModelWeights,
    params: HashMap<String, Tensor>,
    memo: HashMap<String, Tensor>,
    leaves: StepLeaves,
    layers: &'m [LayerMemory],
    kv_views: (KvView, KvView),
    bucket: Bucket,
    options: &'m ModelOptions,
}

impl std::fmt::Debug for StepBuilder<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepBuilder")
            .field("bucket", &self.bucket)
            .field("nodes", &self.g.len())
            .field("bindings", &self.binds.len())
            .finish_non_exhaustive()
    }
}

impl<'m> StepBuilder<'m> {
    /// A builder over `g` (which holds `leaves` already).
    pub(crate) fn new(
        g: Graph,
        leaves: StepLeaves,
        bucket: Bucket,
        weights: &'m ModelWeights,
        layers: &'m [LayerMemory],
        kv_views: (KvView, KvView),
        options: &'m ModelOptions,
    ) -> Self {
        StepBuilder {
            g,
            binds: Vec::new(),
            weights,
            params: HashMap::new(),
            memo: HashMap::new(),
            leaves,
            layers,
            kv_views,
            bucket,
            options,
        }
    }

    /// The graph and the bindings of its parameter and state leaves to resident memory.
    pub(crate) fn finish(self) -> (Graph, Vec<(Tensor, TensorRef)>) {
        (self.g, self.binds)
    }

    /// The step's input leaves.
    pub fn leaves(&self) -> StepLeaves {
        self.leaves
    }

    /// The step's shape bucket: packed tokens (`n_tokens`, each activation's `ne[1]`), sequences
    /// and KV length.
    pub fn bucket(&self) -> Bucket {
        self.bucket
    }

    /// The options the model was made with.
    pub fn options(&self) -> &ModelOptions {
        self.options
    }

    /// The resident weights (to check what load-time preparation left, or read a shape).
    pub fn weights(&self) -> &ModelWeights {
        self.weights
    }

    /// Whether the resident weight `name` exists.
    pub fn has_weight(&self, name: &str) -> bool {
        self.weights.contains(name)
    }

    /// The resident weight `name` as a parameter leaf of the graph (its dtype and shape), bound
    /// to its memory. The same leaf for the same name within one step graph.
    pub fn param(&mut self, name: &str) -> Result<Tensor, ModelError> {
        if let Some(&t) = self.params.get(name) {
            return Ok(t);
        }
        let (t, b) = self.weights.param(&mut self.g, name)?;
        self.binds.push(b);
        self.params.insert(name.to_string(), t);
        Ok(t)
    }

    /// The node `key` names in this step graph, made by `make` the first time (a per-step
    /// constant several layers share, like the shared expert's ids).
    pub fn memo(
        &mut self,
        key: &str,
        make: impl FnOnce(&mut Self) -> Result<Tensor, ModelError>,
    ) -> Result<Tensor, ModelError> {
        if let Some(&t) = self.memo.get(key) {
            return Ok(t);
        }
        let t = make(self)?;
        self.memo.insert(key.to_string(), t);
        Ok(t)
    }

    fn state(&mut self, name: String, place: TensorRef) -> Result<Tensor, ModelError> {
        let t = self.g.state(&name, place.meta.dtype, place.meta.ne)?;
        self.binds.push((t, place));
        Ok(t)
    }

    /// Layer `il`'s K and V cache storage as state leaves (`blk.{il}.cache_k`, `blk.{il}.cache_v`),
    /// with the views paged attention reads. An error when layer `il` declared no attention cache.
    pub fn kv_cache(&mut self, il: usize) -> Result<KvCacheTensors, ModelError> {
        let Some(&LayerMemory::Attention { k, v }) = self.layers.get(il) else {
            return Err(ModelError::Layer { why: format!("layer {il} declared no attention cache") });
        };
        let k = self.state(format!("blk.{il}.cache_k"), k)?;
        let v = self.state(format!("blk.{il}.cache_v"), v)?;
        Ok(KvCacheTensors { k, v, k_view: self.kv_views.0, v_view: self.kv_views.1 })
    }

    /// Layer `il`'s recurrent state as state leaves: the conv ring `[d_conv - 1, channels,
    /// n_slots]` (`blk.{il}.conv_state`) and the state `[S_k, S_v, H_v, n_slots]`
    /// (`blk.{il}.delta_state`). An error when layer `il` declared no recurrent cache.
    pub fn recurrent_state(&mut self, il: usize) -> Result<(Tensor, Tensor), ModelError> {
        let Some(&LayerMemory::Recurrent { conv, state }) = self.layers.get(il) else {
            return Err(ModelError::Layer { why: format!("layer {il} declared no recurrent cache") });
        };
        let conv = self.state(format!("blk.{il}.conv_state"), conv)?;
        let state = self.state(format!("blk.{il}.delta_state"), state)?;
        Ok((conv, state))
    }
}
