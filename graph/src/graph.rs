//! The lazy graph: nodes appended in build order, tensors as cheap copyable handles.
//!
//! Building computes nothing: each builder call validates the op with [`tessera_ops::infer`] and
//! appends a node. Nodes are stored in the order they were built, which is a topological order
//! (a node's inputs always exist before it) and also the program order in which in-place writes
//! to state happen; the executor runs nodes in that order.

use std::sync::atomic::{AtomicU32, Ordering};

use smallvec::SmallVec;
use tessera_ops::{DType, Op, OpError, TensorMeta};

/// Index of a node in its graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub u32);

impl NodeId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// A tensor: a node of one graph plus its descriptor. Copy it freely; it owns nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tensor {
    graph: u32,
    id: NodeId,
    meta: TensorMeta,
}

impl Tensor {
    pub fn id(&self) -> NodeId {
        self.id
    }
    pub fn meta(&self) -> &TensorMeta {
        &self.meta
    }
    pub fn dtype(&self) -> DType {
        self.meta.dtype
    }
    /// Shape in ggml order (`ne[0]` innermost).
    pub fn ne(&self) -> [usize; 4] {
        self.meta.ne
    }
}

/// The three kinds of leaf.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LeafKind {
    /// Weights: set once, live for the model's lifetime.
    Parameter,
    /// Per-step data: token ids, positions, masks, block tables, slot ids.
    Input,
    /// Persistent state that ops read and write in place (KV cache, recurrent state).
    State,
}

impl LeafKind {
    pub fn name(self) -> &'static str {
        match self {
            LeafKind::Parameter => "parameter",
            LeafKind::Input => "input",
            LeafKind::State => "state",
        }
    }
}

/// What a node is.
#[derive(Debug, Clone, PartialEq)]
pub enum NodeKind {
    Leaf(LeafKind),
    Op(Op),
}

/// One node: what it is, its inputs, its output descriptor and an optional name.
#[derive(Debug, Clone)]
pub struct Node {
    pub kind: NodeKind,
    pub inputs: SmallVec<[NodeId; 4]>,
    pub meta: TensorMeta,
    pub name: Option<String>,
}

impl Node {
    pub fn op(&self) -> Option<&Op> {
        match &self.kind {
            NodeKind::Op(op) => Some(op),
            NodeKind::Leaf(_) => None,
        }
    }

    /// `op` name, or the leaf kind.
    pub fn label(&self) -> &'static str {
        match &self.kind {
            NodeKind::Op(op) => op.name(),
            NodeKind::Leaf(k) => k.name(),
        }
    }
}

/// Why a graph could not be built or used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GraphError {
    #[error(transparent)]
    Op(#[from] OpError),

    #[error("tensor {id:?} belongs to another graph")]
    ForeignTensor { id: NodeId },
}

static NEXT_GRAPH_ID: AtomicU32 = AtomicU32::new(1);

/// A lazy compute graph.
#[derive(Debug, Clone)]
pub struct Graph {
    id: u32,
    nodes: Vec<Node>,
    outputs: Vec<NodeId>,
}

impl Default for Graph {
    fn default() -> Self {
        Self::new()
    }
}

impl Graph {
    pub fn new() -> Self {
        Graph { id: NEXT_GRAPH_ID.fetch_add(1, Ordering::Relaxed), nodes: Vec::new(), outputs: Vec::new() }
    }

    /// A weight tensor (contiguous).
    pub fn parameter(&mut self, name: &str, dtype: DType, ne: [usize; 4]) -> Result<Tensor, GraphError> {
        self.leaf(LeafKind::Parameter, name, dtype, ne)
    }

    /// A per-step input (contiguous).
    pub fn input(&mut self, name: &str, dtype: DType, ne: [usize; 4]) -> Result<Tensor, GraphError> {
        self.leaf(LeafKind::Input, name, dtype, ne)
    }

    /// Persistent state that ops update in place (contiguous).
    pub fn state(&mut self, name: &str, dtype: DType, ne: [usize; 4]) -> Result<Tensor, GraphError> {
        self.leaf(LeafKind::State, name, dtype, ne)
    }

    fn leaf(&mut self, kind: LeafKind, name: &str, dtype: DType, ne: [usize; 4]) -> Result<Tensor, GraphError> {
        let meta = TensorMeta::contiguous(kind.name(), dtype, ne)?;
        Ok(self.push(Node { kind: NodeKind::Leaf(kind), inputs: SmallVec::new(), meta, name: Some(name.to_string()) }))
    }

    /// Appends `op` applied to `inputs` after validating it. Every typed builder goes through here.
    pub fn op(&mut self, op: Op, inputs: &[Tensor]) -> Result<Tensor, GraphError> {
        for t in inputs {
            self.check(t)?;
        }
        let metas: SmallVec<[&TensorMeta; 4]> = inputs.iter().map(|t| &t.meta).collect();
        let meta = tessera_ops::infer(&op, &metas)?;
        let ids = inputs.iter().map(|t| t.id).collect();
        Ok(self.push(Node { kind: NodeKind::Op(op), inputs: ids, meta, name: None }))
    }

    fn push(&mut self, node: Node) -> Tensor {
        let id = NodeId(self.nodes.len() as u32);
        let meta = node.meta;
        self.nodes.push(node);
        Tensor { graph: self.id, id, meta }
    }

    /// A handle belongs here when it names an existing node of this graph with that node's
    /// descriptor. Comparing the descriptor catches handles from a clone that has since grown
    /// differently (clones share the graph's identity, so the index alone is not enough).
    fn check(&self, t: &Tensor) -> Result<(), GraphError> {
        match self.nodes.get(t.id.index()) {
            Some(n) if t.graph == self.id && n.meta == t.meta => Ok(()),
            _ => Err(GraphError::ForeignTensor { id: t.id }),
        }
    }

    /// Names a node (shown in DOT dumps and errors).
    pub fn set_name(&mut self, t: Tensor, name: &str) -> Result<(), GraphError> {
        self.check(&t)?;
        self.nodes[t.id.index()].name = Some(name.to_string());
        Ok(())
    }

    /// Marks `t` as a result to keep: the executor computes everything it depends on.
    pub fn mark_output(&mut self, t: Tensor) -> Result<(), GraphError> {
        self.check(&t)?;
        if !self.outputs.contains(&t.id) {
            self.outputs.push(t.id);
        }
        Ok(())
    }

    pub fn outputs(&self) -> &[NodeId] {
        &self.outputs
    }

    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    pub fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id.index()]
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// The handle of an existing node, e.g. one found by walking `nodes()`.
    pub fn tensor(&self, id: NodeId) -> Option<Tensor> {
        self.nodes.get(id.index()).map(|n| Tensor { graph: self.id, id, meta: n.meta })
    }

    /// Nodes that must run, in execution (build) order: everything the outputs depend on, plus
    /// every op that writes a tensor in place (`Op::writes_input`, `Op::updates_input`: a state
    /// update is a result even when nothing reads it), plus what those depend on.
    pub fn live_nodes(&self) -> Vec<NodeId> {
        let mut live = vec![false; self.nodes.len()];
        for id in &self.outputs {
            live[id.index()] = true;
        }
        for (i, n) in self.nodes.iter().enumerate() {
            if n.op().is_some_and(|op| op.writes_input().is_some() || op.updates_input().is_some()) {
                live[i] = true;
            }
        }
        // Inputs precede their users, so one backward sweep closes the set.
        for i in (0..self.nodes.len()).rev() {
            if live[i] {
                for inp in &self.nodes[i].inputs {
                    live[inp.index()] = true;
                }
            }
        }
        (0..self.nodes.len()).filter(|&i| live[i]).map(|i| NodeId(i as u32)).collect()
    }
}
