//! What a pass asks while matching: which op a node runs, who reads it, and whether a fusion may
//! swallow it.
//!
//! A [`Matcher`] answers on the live part of a graph (dead nodes are invisible). The guard a
//! pattern needs for each intermediate it swallows is [`Matcher::sole_user`]: the node has
//! exactly one live reader, is not a graph output and is not a view (a view's memory is its
//! source's, so it is never an intermediate of its own). The other guards (inputs built before
//! the fused node, readers of the fusion's results after it, no in-place write between its
//! first and last node, descriptors of the stand-ins) are checked by the pipeline for every
//! fusion a pass returns ([`crate::Graph::check_fusion`]), so a pattern only states what it
//! computes.

use tessera_ops::{Op, TensorMeta};

use crate::graph::{Graph, NodeId, NodeKind};
use crate::rewrite::Fusion;

/// Read-only matching over the live nodes of a graph.
pub struct Matcher<'g> {
    g: &'g Graph,
    live: Vec<bool>,
}

impl<'g> Matcher<'g> {
    pub fn new(g: &'g Graph) -> Matcher<'g> {
        let mut live = vec![false; g.len()];
        for id in g.live_nodes() {
            live[id.index()] = true;
        }
        Matcher { g, live }
    }

    pub fn graph(&self) -> &'g Graph {
        self.g
    }

    /// Live op nodes in build order, with their ops.
    pub fn ops(&self) -> impl Iterator<Item = (NodeId, &'g Op)> + '_ {
        self.g.nodes().iter().enumerate().filter(|(i, _)| self.live[*i]).filter_map(|(i, n)| match &n.kind {
            NodeKind::Op(op) => Some((NodeId(i as u32), op)),
            NodeKind::Leaf(_) => None,
        })
    }

    /// What `find` returns at each live node running `op`: the whole search of a pass whose
    /// pattern is anchored on one op.
    pub fn fusions_at(&self, op: &Op, find: impl Fn(&Self, NodeId) -> Option<Fusion>) -> Vec<Fusion> {
        self.ops().filter(|&(_, o)| o == op).filter_map(|(id, _)| find(self, id)).collect()
    }

    /// The op of `id` when it is a live op node.
    pub fn op(&self, id: NodeId) -> Option<&'g Op> {
        if !self.live.get(id.index()).copied().unwrap_or(false) {
            return None;
        }
        self.g.node(id).op()
    }

    /// Input `i` of `id`.
    pub fn input(&self, id: NodeId, i: usize) -> Option<NodeId> {
        self.g.nodes().get(id.index())?.inputs.get(i).copied()
    }

    /// The inputs of `id`.
    pub fn inputs(&self, id: NodeId) -> &'g [NodeId] {
        self.g.nodes().get(id.index()).map_or(&[], |n| &n.inputs)
    }

    pub fn meta(&self, id: NodeId) -> &'g TensorMeta {
        &self.g.node(id).meta
    }

    /// The live nodes that read `id`, in build order.
    pub fn users(&self, id: NodeId) -> impl Iterator<Item = NodeId> + '_ {
        self.g.users(id).iter().copied().filter(|u| self.live[u.index()])
    }

    /// The one live reader of `id` when a fusion may swallow `id` as an intermediate: exactly
    /// one reader, not a graph output, not a view.
    pub fn sole_user(&self, id: NodeId) -> Option<NodeId> {
        if self.g.is_output(id) || self.op(id).is_none_or(Op::is_view) {
            return None;
        }
        let mut users = self.users(id);
        let first = users.next()?;
        users.next().is_none().then_some(first)
    }

    /// The one live reader of `id` when `id` is not a graph output, views included (unlike
    /// [`Matcher::sole_user`]): for chains whose reshapes and transposes the fusion swallows.
    pub fn only_reader(&self, id: NodeId) -> Option<NodeId> {
        if self.g.is_output(id) {
            return None;
        }
        let mut users = self.users(id);
        let first = users.next()?;
        users.next().is_none().then_some(first)
    }

    /// The sole reader of `id` (see [`Matcher::sole_user`]) when it runs an op that `want`
    /// accepts.
    pub fn sole_user_op(&self, id: NodeId, want: impl Fn(&Op) -> bool) -> Option<(NodeId, &'g Op)> {
        let u = self.sole_user(id)?;
        let op = self.op(u)?;
        want(op).then_some((u, op))
    }
}
