//! Running a planned graph on one backend, in build order.
//!
//! A [`Session`] realises a [`Plan`] on a backend: one arena buffer holds every computed tensor
//! (intervals shared where lifetimes allow), each unbound leaf gets a buffer of its own, views and
//! in-place ops resolve to their source's bytes (so backends never see a view). Placement checks
//! once that the backend supports every task and that no in-place write aliases another input;
//! `run` then only checks that the leaves were set and hands the prebuilt task list to the
//! backend. `set` fills leaves, `get` reads a tensor that survives the run (leaves, outputs, and
//! every node when memory reuse is off). With guard bytes on, every buffer and arena interval is
//! framed by a known pattern that `run` checks afterwards, so a kernel writing outside its output
//! is caught.
//!
//! An [`Executable`] is the same placement owning its graph, so it can be kept and run again step
//! after step (a model's planned step graphs); [`Executable::session`] lends it a backend.

use smallvec::SmallVec;
use tessera_ops::{DType, TensorMeta, host};

use crate::plan::{Plan, PlanOptions, Storage};
use crate::{
    Backend, BackendError, BufferId, Graph, GraphError, NodeId, NodeKind, PreparedId, Task, Tensor, TensorRef,
};

/// Why a session could not place, run or read a graph.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ExecError {
    #[error(transparent)]
    Graph(#[from] GraphError),

    #[error(transparent)]
    Backend(#[from] BackendError),

    #[error("node {node:?} ({name}) is a leaf that was never set")]
    UnsetLeaf { node: NodeId, name: String },

    #[error("node {node:?} ({label}) is not a leaf; only leaves can be set")]
    NotALeaf { node: NodeId, label: &'static str },

    #[error("node {node:?}: expected {expected} bytes of data, got {got}")]
    DataSize { node: NodeId, expected: usize, got: usize },

    #[error("backend {backend} does not support {op} on inputs {inputs:?} (node {node:?})")]
    Unsupported { backend: String, op: String, node: NodeId, inputs: Vec<([usize; 4], DType)> },

    #[error("node {node:?}: bound memory holds {got:?}, but the leaf is {want:?}")]
    BindingMismatch { node: NodeId, want: ([usize; 4], DType), got: ([usize; 4], DType) },

    #[error("node {node:?} ({op}) wrote outside its output: the guard bytes {side} it were overwritten")]
    GuardOverwritten { node: NodeId, op: &'static str, side: &'static str },

    #[error("node {node:?} ({op}) writes in place into memory that another of its inputs also occupies")]
    AliasedInPlace { node: NodeId, op: &'static str },

    #[error("node {node:?} is not computed by this graph: mark it as an output")]
    NotComputed { node: NodeId },

    #[error(
        "node {node:?} ({label}) is an intermediate whose memory was reused after its last use: mark it as an \
         output, or place the graph with `keep_intermediates`"
    )]
    NotKept { node: NodeId, label: &'static str },
}

/// Options for placing a graph.
#[derive(Debug, Clone, Copy, Default)]
pub struct SessionOptions {
    /// Bytes of guard pattern before and after every buffer and arena interval (0 turns guards
    /// off; guards imply `keep_intermediates`).
    pub guard_bytes: usize,
    /// Give every computed tensor bytes of its own, so each can be read after a run. Off (the
    /// default): tensors whose lifetimes do not overlap share memory, and only leaves and
    /// outputs (and their aliases) can be read back.
    pub keep_intermediates: bool,
}

impl SessionOptions {
    fn plan_options(&self) -> PlanOptions {
        PlanOptions { reuse: !self.keep_intermediates, guard_bytes: self.guard_bytes }
    }
}

const GUARD_BYTE: u8 = 0xA7;

/// A task with its placement resolved once.
#[derive(Debug, Clone)]
struct Prepared {
    node: NodeId,
    inputs: SmallVec<[TensorRef; 4]>,
    output: TensorRef,
}

/// A plan realised on a backend: the buffers it owns, where every live node is, the prepared
/// tasks. Knows nothing of the graph's lifetime, so a [`Session`] can borrow or own it.
#[derive(Debug)]
struct Placement {
    plan: Plan,
    place: Vec<Option<TensorRef>>,
    leaf_set: Vec<bool>,
    /// Buffers this placement allocated (the arena and unbound leaves), freed with it.
    owned: Vec<BufferId>,
    /// Guarded byte ranges `(buffer, offset of the data, data length)`.
    guarded: Vec<(BufferId, usize, usize)>,
    tasks: Vec<Prepared>,
    guard: usize,
    /// The task list as the backend kept it after the first run (`Backend::prepare`), and
    /// whether preparing was tried.
    kept: Option<PreparedId>,
    prepare_tried: bool,
}

impl Placement {
    fn new(
        graph: &Graph,
        backend: &mut dyn Backend,
        opts: SessionOptions,
        bindings: &[(Tensor, TensorRef)],
    ) -> Result<Placement, ExecError> {
        let mut bound: Vec<Option<TensorRef>> = vec![None; graph.len()];
        for (t, place) in bindings {
            let node = match graph.tensor(t.id()) {
                Some(same) if same == *t => graph.node(t.id()),
                _ => return Err(GraphError::ForeignTensor { id: t.id() }.into()),
            };
            if !matches!(node.kind, NodeKind::Leaf(_)) {
                return Err(ExecError::NotALeaf { node: t.id(), label: node.label() });
            }
            if place.meta != node.meta {
                return Err(ExecError::BindingMismatch {
                    node: t.id(),
                    want: (node.meta.ne, node.meta.dtype),
                    got: (place.meta.ne, place.meta.dtype),
                });
            }
            let size = backend.size(place.buffer)?;
            crate::check_range(backend.name(), place.buffer, size, place.offset, place.meta.span_bytes())?;
            bound[t.id().index()] = Some(*place);
        }
        let plan = Plan::new(graph, opts.plan_options());
        let mut p = Placement {
            place: vec![None; graph.len()],
            leaf_set: vec![false; graph.len()],
            owned: Vec::new(),
            guarded: Vec::new(),
            tasks: Vec::with_capacity(plan.tasks.len()),
            guard: opts.guard_bytes,
            plan,
            kept: None,
            prepare_tried: false,
        };
        // From here on an error must free what was allocated: the caller never sees `p`.
        match p.realise(graph, backend, &bound) {
            Ok(()) => Ok(p),
            Err(e) => {
                p.free(backend);
                Err(e)
            }
        }
    }

    fn realise(
        &mut self,
        graph: &Graph,
        backend: &mut dyn Backend,
        bound: &[Option<TensorRef>],
    ) -> Result<(), ExecError> {
        let guard = self.guard;
        let arena = match self.plan.stats.arena_bytes {
            0 => None,
            bytes => {
                let b = backend.alloc(bytes)?;
                self.owned.push(b);
                Some(b)
            }
        };
        if let Some(arena) = arena
            && guard > 0
        {
            for iv in &self.plan.intervals {
                let len = graph.node(iv.root).meta.nbytes_contiguous();
                self.guarded.push((arena, iv.offset + guard, len));
            }
        }
        let mut leaf_buf: Vec<Option<BufferId>> = vec![None; graph.len()];
        for &leaf in &self.plan.leaves {
            if let Some(place) = bound[leaf.index()] {
                self.leaf_set[leaf.index()] = true;
                self.place[leaf.index()] = Some(place);
                continue;
            }
            let len = graph.node(leaf).meta.nbytes_contiguous();
            let b = backend.alloc(len + 2 * guard)?;
            self.owned.push(b);
            if guard > 0 {
                self.guarded.push((b, guard, len));
            }
            leaf_buf[leaf.index()] = Some(b);
        }
        for &(buffer, at, len) in &self.guarded {
            let pattern = vec![GUARD_BYTE; guard];
            backend.write(buffer, at - guard, &pattern)?;
            backend.write(buffer, at + len, &pattern)?;
        }
        for &id in &self.plan.live {
            if self.place[id.index()].is_some() {
                continue; // bound
            }
            let slot = self.plan.slot(id).expect("every live node has a slot");
            let place = match slot.storage {
                Storage::Arena => TensorRef {
                    buffer: arena.expect("arena slots exist only with an arena"),
                    offset: slot.offset,
                    meta: slot.meta,
                },
                Storage::Leaf(leaf) => match (bound[leaf.index()], leaf_buf[leaf.index()]) {
                    (Some(b), _) => TensorRef { buffer: b.buffer, offset: b.offset + slot.offset, meta: slot.meta },
                    (None, Some(buffer)) => TensorRef { buffer, offset: guard + slot.offset, meta: slot.meta },
                    (None, None) => unreachable!("every live leaf is bound or has a buffer"),
                },
            };
            self.place[id.index()] = Some(place);
        }
        for &id in &self.plan.tasks {
            let node = graph.node(id);
            let NodeKind::Op(op) = &node.kind else { unreachable!("tasks are ops") };
            let inputs: SmallVec<[TensorRef; 4]> =
                node.inputs.iter().map(|&i| self.placed(i)).collect::<Result<_, _>>()?;
            let metas: SmallVec<[TensorMeta; 4]> = inputs.iter().map(|r| r.meta).collect();
            if !backend.supports(op, &metas) {
                return Err(ExecError::Unsupported {
                    backend: backend.name().to_string(),
                    op: op.to_string(),
                    node: id,
                    inputs: metas.iter().map(|m| (m.ne, m.dtype)).collect(),
                });
            }
            let output = self.placed(id)?;
            if let Some(w) = op.writes_input()
                && inputs.iter().enumerate().any(|(i, r)| i != w && overlap(r, &output))
            {
                return Err(ExecError::AliasedInPlace { node: id, op: op.name() });
            }
            if let Some(u) = op.updates_input() {
                let state = &inputs[u];
                if inputs.iter().enumerate().any(|(i, r)| i != u && overlap(r, state)) {
                    return Err(ExecError::AliasedInPlace { node: id, op: op.name() });
                }
            }
            self.tasks.push(Prepared { node: id, inputs, output });
        }
        Ok(())
    }

    fn placed(&self, id: NodeId) -> Result<TensorRef, ExecError> {
        self.place.get(id.index()).copied().flatten().ok_or(ExecError::NotComputed { node: id })
    }

    fn free(&mut self, backend: &mut dyn Backend) {
        if let Some(id) = self.kept.take() {
            backend.release_prepared(id);
        }
        // Newest first: a pool that reuses the last freed block of a size (the CUDA backend's)
        // then hands the same graph's next placement the same addresses, so a captured step
        // replays rather than updates.
        for b in self.owned.drain(..).rev() {
            backend.free(b);
        }
    }
}

/// The placement a session works on: its own (freed when the session is dropped) or an
/// [`Executable`]'s (kept).
enum Held<'g> {
    Own(Box<Placement>),
    Lent(&'g mut Placement),
}

/// A graph placed on a backend. Frees what it allocated when dropped (unless it was lent by an
/// [`Executable`], which keeps it).
pub struct Session<'g, 'b> {
    graph: &'g Graph,
    backend: &'b mut dyn Backend,
    held: Held<'g>,
}

impl<'g, 'b> Session<'g, 'b> {
    /// Places `graph` on `backend` without guards.
    pub fn new(graph: &'g Graph, backend: &'b mut dyn Backend) -> Result<Self, ExecError> {
        Self::with_options(graph, backend, SessionOptions::default())
    }

    pub fn with_options(
        graph: &'g Graph,
        backend: &'b mut dyn Backend,
        opts: SessionOptions,
    ) -> Result<Self, ExecError> {
        Self::with_bindings(graph, backend, opts, &[])
    }

    /// Places `graph` with some leaves bound to memory that already lives on the backend:
    /// parameters and caches that outlive one step's graph. A bound leaf counts as set; the
    /// session neither allocates, guards nor frees its memory. Each binding must name a leaf of
    /// this graph, have exactly that leaf's descriptor, and lie inside its buffer.
    pub fn with_bindings(
        graph: &'g Graph,
        backend: &'b mut dyn Backend,
        opts: SessionOptions,
        bindings: &[(Tensor, TensorRef)],
    ) -> Result<Self, ExecError> {
        let placement = Placement::new(graph, backend, opts, bindings)?;
        Ok(Session { graph, backend, held: Held::Own(Box::new(placement)) })
    }

    fn p(&self) -> &Placement {
        match &self.held {
            Held::Own(p) => p,
            Held::Lent(p) => p,
        }
    }

    fn p_mut(&mut self) -> &mut Placement {
        match &mut self.held {
            Held::Own(p) => p,
            Held::Lent(p) => p,
        }
    }

    /// The plan this session runs (memory statistics, slots, tasks).
    pub fn plan(&self) -> &Plan {
        &self.p().plan
    }

    fn leaf(&self, t: &Tensor) -> Result<TensorRef, ExecError> {
        let node = self.node_of(t)?;
        if !matches!(node.kind, NodeKind::Leaf(_)) {
            return Err(ExecError::NotALeaf { node: t.id(), label: node.label() });
        }
        self.p().placed(t.id())
    }

    fn node_of(&self, t: &Tensor) -> Result<&'g crate::Node, ExecError> {
        match self.graph.tensor(t.id()) {
            Some(same) if same == *t => Ok(self.graph.node(t.id())),
            _ => Err(GraphError::ForeignTensor { id: t.id() }.into()),
        }
    }

    /// Fills a leaf with raw bytes in its dtype, contiguous, ggml order.
    pub fn set(&mut self, t: Tensor, data: &[u8]) -> Result<(), ExecError> {
        let place = self.leaf(&t)?;
        let expected = place.meta.nbytes_contiguous();
        if data.len() != expected {
            return Err(ExecError::DataSize { node: t.id(), expected, got: data.len() });
        }
        self.backend.write(place.buffer, place.offset, data)?;
        self.p_mut().leaf_set[t.id().index()] = true;
        Ok(())
    }

    /// Fills a leaf from f64 values in logical order, converted to its dtype.
    pub fn set_f64(&mut self, t: Tensor, values: &[f64]) -> Result<(), ExecError> {
        let expected = t.meta().nelements();
        if values.len() != expected {
            return Err(ExecError::DataSize { node: t.id(), expected, got: values.len() });
        }
        self.set(t, &host::encode(t.dtype(), values))
    }

    /// Fills a leaf from f32 values in logical order, converted to its dtype.
    pub fn set_f32(&mut self, t: Tensor, values: &[f32]) -> Result<(), ExecError> {
        if t.dtype() == DType::F32 && values.len() == t.meta().nelements() {
            return self.set(t, bytemuck::cast_slice(values));
        }
        let v: Vec<f64> = values.iter().map(|&x| x as f64).collect();
        self.set_f64(t, &v)
    }

    /// Fills an i32 leaf.
    pub fn set_i32(&mut self, t: Tensor, values: &[i32]) -> Result<(), ExecError> {
        if t.dtype() == DType::I32 && values.len() == t.meta().nelements() {
            return self.set(t, bytemuck::cast_slice(values));
        }
        let v: Vec<f64> = values.iter().map(|&x| x as f64).collect();
        self.set_f64(t, &v)
    }

    /// Computes every live node. Errors before running anything if a leaf that is read was never
    /// set. (Backend support and in-place aliasing were checked when the graph was placed.)
    pub fn run(&mut self) -> Result<(), ExecError> {
        let graph = self.graph;
        let p: &mut Placement = match &mut self.held {
            Held::Own(p) => p,
            Held::Lent(p) => p,
        };
        for &id in &p.plan.leaves {
            if !p.leaf_set[id.index()] {
                let name = graph.node(id).name.clone().unwrap_or_default();
                return Err(ExecError::UnsetLeaf { node: id, name });
            }
        }
        match p.kept {
            Some(id) => self.backend.compute_prepared(id)?,
            None => {
                let tasks: Vec<Task<'_>> = p
                    .tasks
                    .iter()
                    .map(|t| Task {
                        node: t.node,
                        op: graph.node(t.node).op().expect("tasks are ops"),
                        inputs: t.inputs.clone(),
                        output: t.output,
                    })
                    .collect();
                if !p.prepare_tried {
                    p.prepare_tried = true;
                    p.kept = self.backend.prepare(&tasks)?;
                }
                match p.kept {
                    Some(id) => self.backend.compute_prepared(id)?,
                    None => self.backend.compute(&tasks)?,
                }
            }
        }
        let p: &Placement = p;
        if p.guard > 0 {
            let mut buf = vec![0u8; p.guard];
            for &(buffer, at, len) in &p.guarded {
                for (side, from) in [("before", at - p.guard), ("after", at + len)] {
                    self.backend.read(buffer, from, &mut buf)?;
                    if buf.iter().any(|&b| b != GUARD_BYTE) {
                        let node = guarded_node(p, buffer, at);
                        let op = graph.node(node).label();
                        return Err(ExecError::GuardOverwritten { node, op, side });
                    }
                }
            }
        }
        Ok(())
    }

    /// Waits for the backend to finish queued work (asynchronous backends) and reports any error
    /// it found.
    pub fn synchronize(&mut self) -> Result<(), ExecError> {
        Ok(self.backend.synchronize()?)
    }

    /// Reads a tensor as contiguous bytes of its dtype in logical order: a leaf, an output (or an
    /// alias of one), or any live node when intermediates are kept.
    pub fn get(&mut self, t: Tensor) -> Result<Vec<u8>, ExecError> {
        let node = self.node_of(&t)?;
        let place = self.p().placed(t.id())?;
        if !self.p().plan.survives_run(t.id()) {
            return Err(ExecError::NotKept { node: t.id(), label: node.label() });
        }
        let meta = place.meta;
        let mut raw = vec![0u8; meta.span_bytes()];
        self.backend.read(place.buffer, place.offset, &mut raw)?;
        if meta.is_contiguous() {
            return Ok(raw);
        }
        let step = meta.dtype.block_bytes();
        let mut out = Vec::with_capacity(meta.nbytes_contiguous());
        host::for_each_block(&meta, |at| out.extend_from_slice(&raw[at..at + step]));
        Ok(out)
    }

    /// Reads a tensor as f64 values in logical order (see [`Session::get`]).
    pub fn get_f64(&mut self, t: Tensor) -> Result<Vec<f64>, ExecError> {
        Ok(host::decode(t.dtype(), &self.get(t)?))
    }

    /// Reads a tensor as f32 values in logical order (see [`Session::get`]).
    pub fn get_f32(&mut self, t: Tensor) -> Result<Vec<f32>, ExecError> {
        if t.dtype() == DType::F32 {
            let bytes = self.get(t)?;
            return Ok(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect());
        }
        Ok(self.get_f64(t)?.into_iter().map(|x| x as f32).collect())
    }

    /// Where a live node's data lives (for tests and tools).
    pub fn placement(&self, t: Tensor) -> Option<TensorRef> {
        self.p().place.get(t.id().index()).copied().flatten()
    }
}

/// The node whose guarded range starts at `at` in `buffer`.
fn guarded_node(p: &Placement, buffer: BufferId, at: usize) -> NodeId {
    p.plan
        .live
        .iter()
        .copied()
        .find(|&id| p.place[id.index()].is_some_and(|r| r.buffer == buffer && r.offset == at))
        .unwrap_or(NodeId(0))
}

impl Drop for Session<'_, '_> {
    fn drop(&mut self) {
        if let Held::Own(p) = &mut self.held {
            p.free(self.backend);
        }
    }
}

/// A placed graph that owns its graph and outlives any one borrow of the backend: plan once,
/// then run it step after step ([`Executable::session`] lends it the backend). Its memory is
/// released by [`Executable::free`] (it cannot free on drop: it holds no backend).
#[derive(Debug)]
pub struct Executable {
    graph: Graph,
    placement: Placement,
}

impl Executable {
    /// Places `graph` on `backend` (see [`Session::with_bindings`]).
    pub fn new(
        graph: Graph,
        backend: &mut dyn Backend,
        opts: SessionOptions,
        bindings: &[(Tensor, TensorRef)],
    ) -> Result<Executable, ExecError> {
        let placement = Placement::new(&graph, backend, opts, bindings)?;
        Ok(Executable { graph, placement })
    }

    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    pub fn plan(&self) -> &Plan {
        &self.placement.plan
    }

    /// A session over this placement on `backend` (the one it was placed on): set, run, get.
    /// Dropping the session keeps the placement.
    pub fn session<'s, 'b>(&'s mut self, backend: &'b mut dyn Backend) -> Session<'s, 'b> {
        Session { graph: &self.graph, backend, held: Held::Lent(&mut self.placement) }
    }

    /// Frees the buffers the placement allocated on `backend`.
    pub fn free(&mut self, backend: &mut dyn Backend) {
        self.placement.free(backend);
    }
}

/// True when two placed tensors share any byte (a conservative check on their spans).
fn overlap(a: &TensorRef, b: &TensorRef) -> bool {
    a.buffer == b.buffer && a.offset < b.offset + b.meta.span_bytes() && b.offset < a.offset + a.meta.span_bytes()
}
