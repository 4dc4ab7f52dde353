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

    #[error("a graph needs at least one backend to run on")]
    NoBackend,

    #[error("the graph was placed on {placed} backend(s) but is run with {given}")]
    BackendCount { placed: usize, given: usize },

    #[error(
        "node {node:?} ({label}) is an intermediate whose memory was reused after its last use: mark it as an \
         output, or place the graph with `keep_intermediates`"
    )]
    NotKept { node: NodeId, label: &'static str },

    #[error(
        "guard bytes need an arena of the graph's own: a shared arena's guards are overwritten by the other graphs"
    )]
    SharedArenaGuards,
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

/// Arena buffers shared by executables that never run at the same time, such as a model's step
/// graphs (one runs, its outputs are read, then the next runs): one buffer per backend, as large
/// as the largest plan placed in it, instead of one per executable. A plan larger than the
/// buffer replaces it (with a quarter of headroom) and starts a new generation: executables
/// placed in an older one point at freed memory and must be placed again before they run
/// ([`Executable::arena_generation`]).
#[derive(Debug, Default)]
pub struct SharedArenas {
    buffers: Vec<Option<(BufferId, usize)>>,
    generation: u64,
}

impl SharedArenas {
    pub fn new() -> SharedArenas {
        SharedArenas::default()
    }

    /// Bumped each time a buffer is replaced or freed.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Bytes of the buffers held, all backends together.
    pub fn bytes(&self) -> usize {
        self.buffers.iter().flatten().map(|&(_, n)| n).sum()
    }

    /// Frees the buffers on `backends` (those the executables were placed on); executables
    /// placed before are stale from then on.
    pub fn free(&mut self, backends: &mut [&mut dyn Backend]) {
        for (b, slot) in self.buffers.iter_mut().enumerate() {
            if let (Some((buffer, _)), Some(be)) = (slot.take(), backends.get_mut(b)) {
                be.free(buffer);
            }
        }
        self.generation += 1;
    }

    /// Backend `b`'s arena for a plan of `bytes`, replaced by a larger one when too small.
    fn arena(&mut self, backends: &mut [&mut dyn Backend], b: usize, bytes: usize) -> Result<BufferId, ExecError> {
        if self.buffers.len() <= b {
            self.buffers.resize(b + 1, None);
        }
        if let Some((buffer, have)) = self.buffers[b]
            && have >= bytes
        {
            return Ok(buffer);
        }
        if let Some((old, _)) = self.buffers[b].take() {
            backends[b].free(old);
            // (a caching pool would keep the old block beside the new one)
            backends[b].release_cached()?;
        }
        self.generation += 1;
        let size = bytes.saturating_add(bytes / 4);
        let buffer = backends[b].alloc(size)?;
        self.buffers[b] = Some((buffer, size));
        Ok(buffer)
    }
}

/// A task with its placement resolved once.
#[derive(Debug, Clone)]
struct Prepared {
    node: NodeId,
    inputs: SmallVec<[TensorRef; 4]>,
    output: TensorRef,
}

/// A copy of a value's bytes from its home backend into a mirror on another, before a segment.
#[derive(Debug, Clone, Copy)]
struct Transfer {
    from: usize,
    src: (BufferId, usize),
    dst: (BufferId, usize),
    bytes: usize,
}

/// Consecutive tasks on one backend, the copies they need first, and the task list as the
/// backend kept it after the first run (`Backend::prepare`).
#[derive(Debug)]
struct Segment {
    backend: usize,
    tasks: Vec<Prepared>,
    transfers: Vec<Transfer>,
    kept: Option<PreparedId>,
    prepare_tried: bool,
}

/// A plan realised on its backends: the buffers it owns, where every live node is, the prepared
/// segments. Knows nothing of the graph's lifetime, so a [`Session`] can borrow or own it.
#[derive(Debug)]
struct Placement {
    plan: Plan,
    place: Vec<Option<TensorRef>>,
    leaf_set: Vec<bool>,
    /// Buffers this placement allocated (arenas and unbound leaves), with their backend.
    owned: Vec<(usize, BufferId)>,
    /// Guarded byte ranges `(backend, buffer, offset of the data, data length)`.
    guarded: Vec<(usize, BufferId, usize, usize)>,
    segments: Vec<Segment>,
    guard: usize,
    /// The generation of the shared arenas it was placed in, if it was.
    arena_generation: Option<u64>,
}

impl Placement {
    fn new(
        graph: &Graph,
        backends: &mut [&mut dyn Backend],
        opts: SessionOptions,
        bindings: &[(Tensor, TensorRef)],
        shared: Option<&mut SharedArenas>,
    ) -> Result<Placement, ExecError> {
        if shared.is_some() && opts.guard_bytes > 0 {
            return Err(ExecError::SharedArenaGuards);
        }
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
            let size = backends[0].size(place.buffer)?;
            crate::check_range(backends[0].name(), place.buffer, size, place.offset, place.meta.span_bytes())?;
            bound[t.id().index()] = Some(*place);
        }
        let home = {
            let view: Vec<&dyn Backend> = backends.iter().map(|b| &**b).collect();
            crate::schedule::assign(graph, &view)?
        };
        let plan = Plan::scheduled(graph, opts.plan_options(), &home, backends.len());
        let mut p = Placement {
            place: vec![None; graph.len()],
            leaf_set: vec![false; graph.len()],
            owned: Vec::new(),
            guarded: Vec::new(),
            segments: Vec::new(),
            guard: opts.guard_bytes,
            arena_generation: None,
            plan,
        };
        // From here on an error must free what was allocated: the caller never sees `p`.
        match p.realise(graph, backends, &bound, shared) {
            Ok(()) => Ok(p),
            Err(e) => {
                p.free(backends);
                Err(e)
            }
        }
    }

    fn realise(
        &mut self,
        graph: &Graph,
        backends: &mut [&mut dyn Backend],
        bound: &[Option<TensorRef>],
        mut shared: Option<&mut SharedArenas>,
    ) -> Result<(), ExecError> {
        let guard = self.guard;
        let mut arenas: Vec<Option<BufferId>> = vec![None; backends.len()];
        for (b, &bytes) in self.plan.arenas.iter().enumerate() {
            if bytes == 0 {
                continue;
            }
            arenas[b] = Some(match shared.as_deref_mut() {
                Some(s) => s.arena(backends, b, bytes)?,
                None => {
                    let buffer = backends[b].alloc(bytes)?;
                    self.owned.push((b, buffer));
                    buffer
                }
            });
        }
        // (read after every arena is in place: growing one bumps the generation)
        self.arena_generation = shared.map(|s| s.generation());
        if guard > 0 {
            for iv in &self.plan.intervals {
                if let Some(arena) = arenas[iv.backend] {
                    let len = graph.node(iv.root).meta.nbytes_contiguous();
                    self.guarded.push((iv.backend, arena, iv.offset + guard, len));
                }
            }
        }
        let mut leaf_buf: Vec<Option<BufferId>> = vec![None; graph.len()];
        for &leaf in &self.plan.leaves {
            if let Some(place) = bound[leaf.index()] {
                self.leaf_set[leaf.index()] = true;
                self.place[leaf.index()] = Some(place);
                continue;
            }
            let b = self.plan.home[leaf.index()];
            let len = graph.node(leaf).meta.nbytes_contiguous();
            let buffer = backends[b].alloc(len + 2 * guard)?;
            self.owned.push((b, buffer));
            if guard > 0 {
                self.guarded.push((b, buffer, guard, len));
            }
            leaf_buf[leaf.index()] = Some(buffer);
        }
        for &(b, buffer, at, len) in &self.guarded {
            let pattern = vec![GUARD_BYTE; guard];
            backends[b].write(buffer, at - guard, &pattern)?;
            backends[b].write(buffer, at + len, &pattern)?;
        }
        let resolve = |slot: crate::plan::Slot| -> TensorRef {
            match slot.storage {
                Storage::Arena(b) => TensorRef {
                    buffer: arenas[b].expect("arena slots exist only with an arena"),
                    offset: slot.offset,
                    meta: slot.meta,
                },
                Storage::Leaf(leaf) => match (bound[leaf.index()], leaf_buf[leaf.index()]) {
                    (Some(at), _) => TensorRef { buffer: at.buffer, offset: at.offset + slot.offset, meta: slot.meta },
                    (None, Some(buffer)) => TensorRef { buffer, offset: guard + slot.offset, meta: slot.meta },
                    (None, None) => unreachable!("every live leaf is bound or has a buffer"),
                },
            }
        };
        for &id in &self.plan.live {
            if self.place[id.index()].is_none() {
                self.place[id.index()] = Some(resolve(self.plan.slot(id).expect("every live node has a slot")));
            }
        }
        for &id in &self.plan.tasks {
            let node = graph.node(id);
            let NodeKind::Op(op) = &node.kind else { unreachable!("tasks are ops") };
            let b = self.plan.home[id.index()];
            let inputs: SmallVec<[TensorRef; 4]> = node
                .inputs
                .iter()
                .map(|&i| self.plan.input_slot(id, i).map(resolve).ok_or(ExecError::NotComputed { node: i }))
                .collect::<Result<_, _>>()?;
            let metas: SmallVec<[TensorMeta; 4]> = inputs.iter().map(|r| r.meta).collect();
            if !backends[b].supports(op, &metas) {
                return Err(ExecError::Unsupported {
                    backend: backends[b].name().to_string(),
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
            if self.segments.last().is_none_or(|s| s.backend != b) {
                self.segments.push(Segment {
                    backend: b,
                    tasks: Vec::new(),
                    transfers: Vec::new(),
                    kept: None,
                    prepare_tried: false,
                });
            }
            let seg = self.segments.last_mut().expect("pushed above");
            // The mirrors this task reads, refreshed once before its segment.
            for &i in &node.inputs {
                let r = self.plan.root(i);
                let from = self.plan.home[r.index()];
                if from == b {
                    continue;
                }
                let src = self.place[r.index()].expect("roots are placed");
                let dst = resolve(self.plan.input_slot(id, r).expect("a mirror for every foreign root read"));
                let bytes = src.meta.nbytes_contiguous();
                if !seg.transfers.iter().any(|t| t.dst == (dst.buffer, dst.offset)) {
                    seg.transfers.push(Transfer {
                        from,
                        src: (src.buffer, src.offset),
                        dst: (dst.buffer, dst.offset),
                        bytes,
                    });
                }
            }
            seg.tasks.push(Prepared { node: id, inputs, output });
        }
        Ok(())
    }

    fn placed(&self, id: NodeId) -> Result<TensorRef, ExecError> {
        self.place.get(id.index()).copied().flatten().ok_or(ExecError::NotComputed { node: id })
    }

    fn free(&mut self, backends: &mut [&mut dyn Backend]) {
        // (Backends missing from `backends` keep what is theirs: a caller error that must not
        // panic in a destructor.)
        for seg in &mut self.segments {
            if let (Some(id), Some(be)) = (seg.kept.take(), backends.get_mut(seg.backend)) {
                be.release_prepared(id);
            }
        }
        // Newest first: a pool that reuses the last freed block of a size (the CUDA backend's)
        // then hands the same graph's next placement the same addresses, so a captured step
        // replays rather than updates.
        for (b, buffer) in self.owned.drain(..).rev() {
            if let Some(be) = backends.get_mut(b) {
                be.free(buffer);
            }
        }
    }

    /// Whether `backends` are as many as the placement's.
    fn check(&self, backends: &[&mut dyn Backend]) -> Result<(), ExecError> {
        let placed = self.plan.arenas.len();
        if backends.len() == placed { Ok(()) } else { Err(ExecError::BackendCount { placed, given: backends.len() }) }
    }

    /// Runs the segments in order, each after copying the mirrors it reads.
    fn run(&mut self, graph: &Graph, backends: &mut [&mut dyn Backend]) -> Result<(), ExecError> {
        self.check(backends)?;
        for &id in &self.plan.leaves {
            if !self.leaf_set[id.index()] {
                let name = graph.node(id).name.clone().unwrap_or_default();
                return Err(ExecError::UnsetLeaf { node: id, name });
            }
        }
        for seg in &mut self.segments {
            for t in &seg.transfers {
                let mut bytes = vec![0u8; t.bytes];
                backends[t.from].read(t.src.0, t.src.1, &mut bytes)?;
                backends[seg.backend].write(t.dst.0, t.dst.1, &bytes)?;
            }
            let backend = &mut *backends[seg.backend];
            if let Some(id) = seg.kept {
                backend.compute_prepared(id)?;
                continue;
            }
            let tasks: Vec<Task<'_>> = seg
                .tasks
                .iter()
                .map(|t| Task {
                    node: t.node,
                    op: graph.node(t.node).op().expect("tasks are ops"),
                    inputs: t.inputs.clone(),
                    output: t.output,
                })
                .collect();
            if !seg.prepare_tried {
                seg.prepare_tried = true;
                seg.kept = backend.prepare(&tasks)?;
            }
            match seg.kept {
                Some(id) => backend.compute_prepared(id)?,
                None => backend.compute(&tasks)?,
            }
        }
        if self.guard > 0 {
            let mut buf = vec![0u8; self.guard];
            for &(b, buffer, at, len) in &self.guarded {
                for (side, from) in [("before", at - self.guard), ("after", at + len)] {
                    backends[b].read(buffer, from, &mut buf)?;
                    if buf.iter().any(|&x| x != GUARD_BYTE) {
                        let node = self.guarded_node(buffer, at);
                        let op = graph.node(node).label();
                        return Err(ExecError::GuardOverwritten { node, op, side });
                    }
                }
            }
        }
        Ok(())
    }

    /// The node whose guarded range starts at `at` in `buffer`.
    fn guarded_node(&self, buffer: BufferId, at: usize) -> NodeId {
        self.plan
            .live
            .iter()
            .copied()
            .find(|&id| self.place[id.index()].is_some_and(|r| r.buffer == buffer && r.offset == at))
            .unwrap_or(NodeId(0))
    }
}

/// The placement a session works on: its own (freed when the session is dropped) or an
/// [`Executable`]'s (kept).
enum Held<'g> {
    Own(Box<Placement>),
    Lent(&'g mut Placement),
}

impl Held<'_> {
    fn get(&self) -> &Placement {
        match self {
            Held::Own(p) => p,
            Held::Lent(p) => p,
        }
    }

    fn get_mut(&mut self) -> &mut Placement {
        match self {
            Held::Own(p) => p,
            Held::Lent(p) => p,
        }
    }
}

/// A graph placed on one backend, or spread over several ([`Session::scheduled`]). Frees what it
/// allocated when dropped (unless it was lent by an [`Executable`], which keeps it).
pub struct Session<'g, 'b> {
    graph: &'g Graph,
    backends: Vec<&'b mut dyn Backend>,
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
        Self::scheduled(graph, vec![backend], opts, bindings)
    }

    /// Places `graph` over `backends`, in order of preference (`schedule::assign`): every op
    /// runs on the first that supports it, state is written where it lives, values cross
    /// backends through mirrors copied before the segments that read them. Leaves, and the
    /// memory of `bindings`, live on the first backend.
    pub fn scheduled(
        graph: &'g Graph,
        mut backends: Vec<&'b mut dyn Backend>,
        opts: SessionOptions,
        bindings: &[(Tensor, TensorRef)],
    ) -> Result<Self, ExecError> {
        if backends.is_empty() {
            return Err(ExecError::NoBackend);
        }
        let placement = Placement::new(graph, &mut backends, opts, bindings, None)?;
        Ok(Session { graph, backends, held: Held::Own(Box::new(placement)) })
    }

    fn p(&self) -> &Placement {
        self.held.get()
    }

    /// The plan this session runs (memory statistics, slots, tasks, home backends).
    pub fn plan(&self) -> &Plan {
        &self.p().plan
    }

    /// How many segments (runs of consecutive tasks on one backend) a run has.
    pub fn segments(&self) -> usize {
        self.p().segments.len()
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
        self.p().check(&self.backends)?;
        let b = self.p().plan.home[t.id().index()];
        self.backends[b].write(place.buffer, place.offset, data)?;
        self.held.get_mut().leaf_set[t.id().index()] = true;
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
        self.held.get_mut().run(self.graph, &mut self.backends)
    }

    /// Waits for the backends to finish queued work (asynchronous backends) and reports any
    /// error one found.
    pub fn synchronize(&mut self) -> Result<(), ExecError> {
        for b in &mut self.backends {
            b.synchronize()?;
        }
        Ok(())
    }

    /// Reads a tensor as contiguous bytes of its dtype in logical order: a leaf, an output (or an
    /// alias of one), or any live node when intermediates are kept.
    pub fn get(&mut self, t: Tensor) -> Result<Vec<u8>, ExecError> {
        let node = self.node_of(&t)?;
        let place = self.p().placed(t.id())?;
        if !self.p().plan.survives_run(t.id()) {
            return Err(ExecError::NotKept { node: t.id(), label: node.label() });
        }
        self.p().check(&self.backends)?;
        let b = self.p().plan.home[t.id().index()];
        let meta = place.meta;
        let mut raw = vec![0u8; meta.span_bytes()];
        self.backends[b].read(place.buffer, place.offset, &mut raw)?;
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

    /// Where a live node's data lives on its home backend (for tests and tools).
    pub fn placement(&self, t: Tensor) -> Option<TensorRef> {
        self.p().place.get(t.id().index()).copied().flatten()
    }
}

impl Drop for Session<'_, '_> {
    fn drop(&mut self) {
        if let Held::Own(p) = &mut self.held {
            p.free(&mut self.backends);
        }
    }
}

/// A placed graph that owns its graph and outlives any one borrow of the backends: plan once,
/// then run it step after step ([`Executable::session`] lends it the backend). Its memory is
/// released by [`Executable::free`] (it cannot free on drop: it holds no backend).
#[derive(Debug)]
pub struct Executable {
    graph: Graph,
    placement: Placement,
    backends: usize,
}

impl Executable {
    /// Places `graph` on `backend` (see [`Session::with_bindings`]).
    pub fn new(
        graph: Graph,
        backend: &mut dyn Backend,
        opts: SessionOptions,
        bindings: &[(Tensor, TensorRef)],
    ) -> Result<Executable, ExecError> {
        Self::scheduled(graph, &mut [backend], opts, bindings)
    }

    /// Places `graph` over `backends` (see [`Session::scheduled`]).
    pub fn scheduled(
        graph: Graph,
        backends: &mut [&mut dyn Backend],
        opts: SessionOptions,
        bindings: &[(Tensor, TensorRef)],
    ) -> Result<Executable, ExecError> {
        if backends.is_empty() {
            return Err(ExecError::NoBackend);
        }
        let placement = Placement::new(&graph, backends, opts, bindings, None)?;
        Ok(Executable { graph, placement, backends: backends.len() })
    }

    /// As [`Executable::scheduled`], with each backend's arena taken from `shared` (grown when
    /// the plan needs more) instead of allocated for this executable alone. It may run only
    /// while `shared` is at the generation it was placed in ([`Executable::arena_generation`]),
    /// and its outputs are only good until another executable of `shared` runs.
    pub fn scheduled_shared(
        graph: Graph,
        backends: &mut [&mut dyn Backend],
        opts: SessionOptions,
        bindings: &[(Tensor, TensorRef)],
        shared: &mut SharedArenas,
    ) -> Result<Executable, ExecError> {
        if backends.is_empty() {
            return Err(ExecError::NoBackend);
        }
        let placement = Placement::new(&graph, backends, opts, bindings, Some(shared))?;
        Ok(Executable { graph, placement, backends: backends.len() })
    }

    /// The generation of the [`SharedArenas`] it was placed in (`None`: arenas of its own).
    pub fn arena_generation(&self) -> Option<u64> {
        self.placement.arena_generation
    }

    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    pub fn plan(&self) -> &Plan {
        &self.placement.plan
    }

    /// How many backends it was placed on.
    pub fn n_backends(&self) -> usize {
        self.backends
    }

    /// A session over this placement on `backend` (the one it was placed on): set, run, get.
    /// Dropping the session keeps the placement.
    pub fn session<'s, 'b>(&'s mut self, backend: &'b mut dyn Backend) -> Session<'s, 'b> {
        Session { graph: &self.graph, backends: vec![backend], held: Held::Lent(&mut self.placement) }
    }

    /// A session over this placement on `backends` (those it was placed on, in the same order).
    pub fn session_on<'s, 'b>(&'s mut self, backends: Vec<&'b mut dyn Backend>) -> Session<'s, 'b> {
        Session { graph: &self.graph, backends, held: Held::Lent(&mut self.placement) }
    }

    /// Frees the buffers the placement allocated on `backends` (those it was placed on).
    pub fn free(&mut self, backends: &mut [&mut dyn Backend]) {
        self.placement.free(backends);
    }
}

/// True when two placed tensors share any byte (a conservative check on their spans).
fn overlap(a: &TensorRef, b: &TensorRef) -> bool {
    a.buffer == b.buffer && a.offset < b.offset + b.meta.span_bytes() && b.offset < a.offset + a.meta.span_bytes()
}
