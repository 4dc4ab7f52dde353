//! The straightforward executor: one graph on one backend, eager, in build order.
//!
//! A [`Session`] places every live node: leaves and computing ops get their own buffer, views and
//! in-place ops share their source's (resolved here, so backends never see a view). `set` fills
//! leaves, `run` sends every computing node to the backend as one task list, `get` reads any
//! live tensor back in logical order. With guard bytes on, each buffer is surrounded by a known
//! pattern that `run` checks afterwards, so a kernel writing outside its output is caught.

use smallvec::SmallVec;
use tessera_ops::{DType, Op, TensorMeta, host};

use crate::{Backend, BackendError, BufferId, Graph, GraphError, NodeId, NodeKind, Task, Tensor, TensorRef};

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
}

/// Options for placing a graph.
#[derive(Debug, Clone, Copy, Default)]
pub struct SessionOptions {
    /// Bytes of guard pattern before and after every buffer (0 turns guards off).
    pub guard_bytes: usize,
}

const GUARD_BYTE: u8 = 0xA7;

/// A buffer this session allocated, with the node it was allocated for.
struct Owned {
    node: NodeId,
    buffer: BufferId,
    len: usize,
}

/// A graph placed on a backend. Frees its buffers when dropped.
pub struct Session<'g, 'b> {
    graph: &'g Graph,
    backend: &'b mut dyn Backend,
    /// Where each node's data lives; `None` for nodes that are not live.
    place: Vec<Option<TensorRef>>,
    live: Vec<NodeId>,
    leaf_set: Vec<bool>,
    owned: Vec<Owned>,
    guard: usize,
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
        let mut s = Session {
            graph,
            backend,
            place: vec![None; graph.len()],
            live: graph.live_nodes(),
            leaf_set: vec![false; graph.len()],
            owned: Vec::new(),
            guard: opts.guard_bytes,
        };
        for id in s.live.clone() {
            let node = graph.node(id);
            if let Some(place) = bound[id.index()] {
                s.leaf_set[id.index()] = true;
                s.place[id.index()] = Some(place);
                continue;
            }
            let place = match &node.kind {
                NodeKind::Op(op) if op.is_view() => {
                    let src = s.placed(node.inputs[0])?;
                    let extra = if let Op::View(v) = op { v.offset } else { 0 };
                    TensorRef { buffer: src.buffer, offset: src.offset + extra, meta: node.meta }
                }
                NodeKind::Op(op) if op.writes_input().is_some() => {
                    let target = op.writes_input().map(|i| node.inputs[i]).unwrap_or(id);
                    let dst = s.placed(target)?;
                    TensorRef { meta: node.meta, ..dst }
                }
                _ => s.allocate(id, &node.meta)?,
            };
            s.place[id.index()] = Some(place);
        }
        Ok(s)
    }

    fn placed(&self, id: NodeId) -> Result<TensorRef, ExecError> {
        self.place[id.index()].ok_or(ExecError::NotComputed { node: id })
    }

    fn allocate(&mut self, node: NodeId, meta: &TensorMeta) -> Result<TensorRef, ExecError> {
        let len = meta.nbytes_contiguous();
        let buffer = self.backend.alloc(len + 2 * self.guard)?;
        self.owned.push(Owned { node, buffer, len });
        if self.guard > 0 {
            let pattern = vec![GUARD_BYTE; self.guard];
            self.backend.write(buffer, 0, &pattern)?;
            self.backend.write(buffer, self.guard + len, &pattern)?;
        }
        Ok(TensorRef { buffer, offset: self.guard, meta: *meta })
    }

    fn leaf(&self, t: &Tensor) -> Result<TensorRef, ExecError> {
        let node = self.node_of(t)?;
        if !matches!(node.kind, NodeKind::Leaf(_)) {
            return Err(ExecError::NotALeaf { node: t.id(), label: node.label() });
        }
        self.placed(t.id())
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
        self.leaf_set[t.id().index()] = true;
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
        let v: Vec<f64> = values.iter().map(|&x| x as f64).collect();
        self.set_f64(t, &v)
    }

    /// Fills an i32 leaf.
    pub fn set_i32(&mut self, t: Tensor, values: &[i32]) -> Result<(), ExecError> {
        let v: Vec<f64> = values.iter().map(|&x| x as f64).collect();
        self.set_f64(t, &v)
    }

    /// Computes every live node. Errors before running anything if a leaf that is read was never
    /// set or the backend lacks an op.
    pub fn run(&mut self) -> Result<(), ExecError> {
        let mut tasks = Vec::new();
        for &id in &self.live {
            let node = self.graph.node(id);
            let op = match &node.kind {
                NodeKind::Leaf(_) => {
                    if !self.leaf_set[id.index()] {
                        return Err(ExecError::UnsetLeaf { node: id, name: node.name.clone().unwrap_or_default() });
                    }
                    continue;
                }
                NodeKind::Op(op) if op.is_view() => continue,
                NodeKind::Op(op) => op,
            };
            let inputs: SmallVec<[TensorRef; 4]> =
                node.inputs.iter().map(|&i| self.placed(i)).collect::<Result<_, _>>()?;
            let metas: SmallVec<[TensorMeta; 4]> = inputs.iter().map(|r| r.meta).collect();
            if !self.backend.supports(op, &metas) {
                return Err(ExecError::Unsupported {
                    backend: self.backend.name().to_string(),
                    op: op.to_string(),
                    node: id,
                    inputs: metas.iter().map(|m| (m.ne, m.dtype)).collect(),
                });
            }
            let output = self.placed(id)?;
            if let Some(w) = op.writes_input() {
                let overlaps = inputs.iter().enumerate().any(|(i, r)| i != w && overlap(r, &output));
                if overlaps {
                    return Err(ExecError::AliasedInPlace { node: id, op: op.name() });
                }
            }
            if let Some(u) = op.updates_input() {
                let state = &inputs[u];
                let overlaps = inputs.iter().enumerate().any(|(i, r)| i != u && overlap(r, state));
                if overlaps {
                    return Err(ExecError::AliasedInPlace { node: id, op: op.name() });
                }
            }
            tasks.push(Task { node: id, op, inputs, output });
        }
        self.backend.compute(&tasks)?;
        if self.guard > 0 {
            self.check_guards()?;
        }
        Ok(())
    }

    fn check_guards(&mut self) -> Result<(), ExecError> {
        let mut buf = vec![0u8; self.guard];
        for o in &self.owned {
            for (side, at) in [("before", 0), ("after", self.guard + o.len)] {
                self.backend.read(o.buffer, at, &mut buf)?;
                if buf.iter().any(|&b| b != GUARD_BYTE) {
                    let op = self.graph.node(o.node).label();
                    return Err(ExecError::GuardOverwritten { node: o.node, op, side });
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

    /// Reads a live tensor as contiguous bytes of its dtype in logical order.
    pub fn get(&mut self, t: Tensor) -> Result<Vec<u8>, ExecError> {
        self.node_of(&t)?;
        let place = self.placed(t.id())?;
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

    /// Reads a live tensor as f64 values in logical order.
    pub fn get_f64(&mut self, t: Tensor) -> Result<Vec<f64>, ExecError> {
        Ok(host::decode(t.dtype(), &self.get(t)?))
    }

    /// Reads a live tensor as f32 values in logical order.
    pub fn get_f32(&mut self, t: Tensor) -> Result<Vec<f32>, ExecError> {
        Ok(self.get_f64(t)?.into_iter().map(|x| x as f32).collect())
    }

    /// Where a live node's data lives (for tests and tools).
    pub fn placement(&self, t: Tensor) -> Option<TensorRef> {
        self.place.get(t.id().index()).copied().flatten()
    }
}

/// True when two placed tensors share any byte (a conservative check on their spans).
fn overlap(a: &TensorRef, b: &TensorRef) -> bool {
    a.buffer == b.buffer && a.offset < b.offset + b.meta.span_bytes() && b.offset < a.offset + a.meta.span_bytes()
}

impl Drop for Session<'_, '_> {
    fn drop(&mut self) {
        // Newest first: a pool that reuses the last freed block of a size (the CUDA backend's)
        // then hands the same graph's next session the same addresses node for node, so a
        // captured step replays rather than updates.
        for o in self.owned.drain(..).rev() {
            self.backend.free(o.buffer);
        }
    }
}
