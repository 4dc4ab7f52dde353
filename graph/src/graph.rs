//! The lazy graph: nodes appended in build order, tensors as cheap copyable handles.
//!
//! Building computes nothing: each builder call validates the op with [`tessera_ops::infer`] and
//! appends a node. Nodes are stored in the order they were built, which is a topological order
//! (a node's inputs always exist before it) and also the program order in which in-place writes
//! to state happen; the executor runs nodes in that order.
//!
//! Passes rewrite a graph in place with [`Graph::users`], [`Graph::is_output`] and
//! [`Graph::replace`]; a replacement keeps build order a topological order and keeps every node's
//! descriptor, so the rewritten graph is one that could have been built directly.

use std::fmt;
use std::sync::OnceLock;
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
    pub(crate) graph: u32,
    pub(crate) id: NodeId,
    pub(crate) meta: TensorMeta,
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
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
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

    #[error("node {id:?} does not exist: the graph has {len} nodes")]
    UnknownNode { id: NodeId, len: usize },

    #[error("cannot replace node {id:?}: it is a {} leaf, and only op nodes can be replaced", .kind.name())]
    ReplaceLeaf { id: NodeId, kind: LeafKind },

    #[error(
        "cannot replace node {node:?} by {op}: its input {input:?} is not built before it (inputs must \
         precede the node they feed in build order)"
    )]
    ReplaceInputOrder { node: NodeId, op: &'static str, input: NodeId },

    #[error(transparent)]
    ReplaceDescriptor(Box<DescriptorChange>),

    /// Boxed to keep `GraphError` small.
    #[error(transparent)]
    Fusion(Box<crate::rewrite::FusionError>),

    #[error(
        "node {id:?} was replaced by a fusion (or was dead) when the graph was rebuilt: it has no tensor in the new graph"
    )]
    Rewritten { id: NodeId },
}

impl From<crate::rewrite::FusionError> for GraphError {
    fn from(e: crate::rewrite::FusionError) -> Self {
        GraphError::Fusion(Box::new(e))
    }
}

/// Why [`Graph::replace`] refused: the new op's output descriptor differs from the node's.
/// (Boxed in [`GraphError`] to keep that small.)
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error(
    "cannot replace node {node:?} ({old_op}, {}) by {new_op}, which gives {}: a replacement must keep \
     the node's descriptor",
    describe(old),
    describe(new)
)]
pub struct DescriptorChange {
    pub node: NodeId,
    pub old_op: Op,
    pub new_op: Op,
    /// The node's descriptor, which its users were validated against.
    pub old: TensorMeta,
    /// What `new_op` gives on the new inputs.
    pub new: TensorMeta,
}

/// `f32 [4, 3, 1, 1] nb [4, 16, 48, 48]`
fn describe(m: &TensorMeta) -> impl fmt::Display + '_ {
    fmt::from_fn(move |f| write!(f, "{} {:?} nb {:?}", m.dtype, m.ne, m.nb))
}

static NEXT_GRAPH_ID: AtomicU32 = AtomicU32::new(1);

/// A lazy compute graph.
#[derive(Debug, Clone)]
pub struct Graph {
    pub(crate) id: u32,
    pub(crate) nodes: Vec<Node>,
    outputs: Vec<NodeId>,
    /// `users[i]`: the nodes that read node `i`, ascending, each once. Built by the first
    /// [`Graph::users`] call, then kept up to date by `push` and `replace`.
    users: OnceLock<Vec<SmallVec<[NodeId; 2]>>>,
}

impl Default for Graph {
    fn default() -> Self {
        Self::new()
    }
}

impl Graph {
    pub fn new() -> Self {
        Graph {
            id: NEXT_GRAPH_ID.fetch_add(1, Ordering::Relaxed),
            nodes: Vec::new(),
            outputs: Vec::new(),
            users: OnceLock::new(),
        }
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

    pub(crate) fn leaf(
        &mut self,
        kind: LeafKind,
        name: &str,
        dtype: DType,
        ne: [usize; 4],
    ) -> Result<Tensor, GraphError> {
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
        if let Some(users) = self.users.get_mut() {
            // `id` is the largest id yet, so appending keeps every list ascending; a node that
            // reads the same input twice is listed once.
            for inp in &node.inputs {
                let list = &mut users[inp.index()];
                if list.last() != Some(&id) {
                    list.push(id);
                }
            }
            users.push(SmallVec::new());
        }
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

    /// Whether `id` was marked with [`Graph::mark_output`]. Costs a scan of the outputs (a
    /// graph has few).
    pub fn is_output(&self, id: NodeId) -> bool {
        self.outputs.contains(&id)
    }

    /// The nodes that take `id` as an input, in build order, each once (a node that reads `id`
    /// twice, `add(x, x)`, is listed once). Dead nodes count: a node a rewrite left unreachable
    /// still reads its inputs (filter with [`Graph::live_nodes`] where that matters). An id
    /// outside the graph has no users.
    ///
    /// Cost: the first call builds an index of every node's users in one pass over all inputs
    /// (O(nodes + edges)); after that a call is O(1), and building a node or
    /// [`replace`](Graph::replace) keep the index up to date (O(inputs) each).
    pub fn users(&self, id: NodeId) -> &[NodeId] {
        let users = self.users.get_or_init(|| {
            let mut users = vec![SmallVec::<[NodeId; 2]>::new(); self.nodes.len()];
            for (i, n) in self.nodes.iter().enumerate() {
                let user = NodeId(i as u32);
                for inp in &n.inputs {
                    let list = &mut users[inp.index()];
                    if list.last() != Some(&user) {
                        list.push(user);
                    }
                }
            }
            users
        });
        users.get(id.index()).map_or(&[], |l| l.as_slice())
    }

    /// Makes node `node` compute `op` on `inputs` instead, keeping its id, name and output
    /// marking, so every user of `node` now reads the new op's result. Returns the node's
    /// handle (unchanged: handles taken before stay valid).
    ///
    /// Guarantees, checked before anything changes (on an error the graph is untouched):
    /// - `node` is an op node of this graph (leaves are values the caller supplies:
    ///   [`GraphError::UnknownNode`], [`GraphError::ReplaceLeaf`]);
    /// - every input is a tensor of this graph built **before** `node`, so build order stays a
    ///   topological order and the executor's program order ([`GraphError::ForeignTensor`],
    ///   [`GraphError::ReplaceInputOrder`]);
    /// - `op` is valid on the inputs ([`tessera_ops::infer`], [`GraphError::Op`]) and gives
    ///   exactly the node's [`TensorMeta`] (dtype, shape and strides), which every user was
    ///   validated against ([`GraphError::ReplaceDescriptor`]).
    ///
    /// So the result is a graph that could have been built directly. What `replace` does not
    /// judge is meaning: a pass must itself keep what users read. In particular a view reads its
    /// source's memory when it runs, so turning a computing node into a view (or the reverse)
    /// changes whether an in-place write between it and its users shows through; and replacing
    /// an in-place op drops its write. Nodes that only the old op read become dead:
    /// [`Graph::live_nodes`] skips them, and they stay in [`Graph::nodes`].
    pub fn replace(&mut self, node: NodeId, op: Op, inputs: &[Tensor]) -> Result<Tensor, GraphError> {
        let old = self.nodes.get(node.index()).ok_or(GraphError::UnknownNode { id: node, len: self.nodes.len() })?;
        let old_op = match &old.kind {
            NodeKind::Op(op) => op,
            NodeKind::Leaf(kind) => return Err(GraphError::ReplaceLeaf { id: node, kind: *kind }),
        };
        for t in inputs {
            self.check(t)?;
            if t.id >= node {
                return Err(GraphError::ReplaceInputOrder { node, op: op.name(), input: t.id });
            }
        }
        let metas: SmallVec<[&TensorMeta; 4]> = inputs.iter().map(|t| &t.meta).collect();
        let meta = tessera_ops::infer(&op, &metas)?;
        if meta != old.meta {
            let change = DescriptorChange { node, old_op: old_op.clone(), new_op: op, old: old.meta, new: meta };
            return Err(GraphError::ReplaceDescriptor(Box::new(change)));
        }
        let new_inputs: SmallVec<[NodeId; 4]> = inputs.iter().map(|t| t.id).collect();
        if let Some(users) = self.users.get_mut() {
            for inp in &self.nodes[node.index()].inputs {
                users[inp.index()].retain(|u| *u != node);
            }
            for inp in &new_inputs {
                let list = &mut users[inp.index()];
                if let Err(at) = list.binary_search(&node) {
                    list.insert(at, node);
                }
            }
        }
        let n = &mut self.nodes[node.index()];
        n.kind = NodeKind::Op(op);
        n.inputs = new_inputs;
        Ok(Tensor { graph: self.id, id: node, meta })
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
