//! Rewriting a graph by rebuilding it: how fusion passes apply what they matched.
//!
//! A pass describes each rewrite as a [`Fusion`] (the nodes a fused op replaces, its inputs, and
//! what each replaced node that is read from outside becomes) without touching the graph;
//! [`Graph::fuse`] then checks every fusion and builds the new graph in one walk in build order:
//! leaves and the live nodes outside every fusion are copied, each fused node is emitted where
//! the last node of its fusion was, and dead nodes are dropped. A rebuild (rather than editing
//! nodes in place) lets a fused op have several results (views of one packed output) and new
//! nodes appear anywhere, while the new graph stays a graph that could have been built directly:
//! every node is validated by `tessera_ops::infer` again. The [`Remap`] that comes with it takes
//! the caller's handles (inputs, outputs, bound leaves) to the new graph.

use std::collections::HashMap;

use smallvec::SmallVec;
use tessera_ops::{DType, Op, TensorMeta, ViewParams};

use crate::graph::{Graph, GraphError, NodeId, NodeKind, Tensor};

/// One rewrite: `op` on `inputs` computes what `nodes` computed.
#[derive(Debug, Clone, PartialEq)]
pub struct Fusion {
    /// The op nodes replaced (in any order). The fused node is emitted where the last of them
    /// (in build order) was.
    pub nodes: Vec<NodeId>,
    /// The fused op.
    pub op: Op,
    /// Its inputs: nodes outside `nodes`, each built before the last of `nodes`.
    pub inputs: Vec<NodeId>,
    /// Every node of `nodes` that is read from outside the fusion (or is a graph output), and
    /// the tensor that stands in for it: the fused node itself or a view of it. Each must have
    /// exactly the replaced node's descriptor (dtype, shape, strides).
    pub outputs: Vec<(NodeId, FusedOutput)>,
    /// Nodes outside `nodes` whose work the fused op repeats from its inputs (they stay when
    /// something else reads them: `softmax_top_k(logits)` recomputes the softmax that `top_k`
    /// read). The fused op reads its inputs where the last replaced node was, so no in-place
    /// write may lie between the first of these (or of `nodes`) and that node.
    pub recomputes: Vec<NodeId>,
}

/// What stands in for a replaced node that is read from outside its fusion.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum FusedOutput {
    /// The fused node's result.
    Whole,
    /// A view of the fused node's result (e.g. one plane of a packed output).
    View(ViewParams),
    /// A view of the fused node's result read as another dtype of the same element size (a
    /// plane of another dtype: `moe_router`'s f32 weights beside its i32 ids).
    Bitcast(ViewParams, DType),
}

impl FusedOutput {
    /// The view ops that make the stand-in from the fused node, in order.
    pub fn views(self) -> SmallVec<[Op; 2]> {
        match self {
            FusedOutput::Whole => SmallVec::new(),
            FusedOutput::View(v) => smallvec::smallvec![Op::View(v)],
            FusedOutput::Bitcast(v, dtype) => smallvec::smallvec![Op::View(v), Op::Bitcast(dtype)],
        }
    }
}

/// Where each node of a graph went when it was rebuilt by [`Graph::fuse`].
#[derive(Debug, Clone)]
pub struct Remap {
    old_graph: u32,
    map: Vec<Option<Tensor>>,
}

impl Remap {
    /// The new graph's tensor for `old` (a handle of the graph that was rebuilt). Leaves and
    /// every node read after the rebuild have one; a node replaced inside a fusion, or dead,
    /// has none ([`GraphError::Rewritten`]).
    pub fn tensor(&self, old: Tensor) -> Result<Tensor, GraphError> {
        if old.graph != self.old_graph {
            return Err(GraphError::ForeignTensor { id: old.id });
        }
        self.map.get(old.id.index()).copied().flatten().ok_or(GraphError::Rewritten { id: old.id })
    }

    /// This remap followed by `next` (the remap of a later rebuild of the new graph).
    pub fn then(&self, next: &Remap) -> Remap {
        let map = self.map.iter().map(|t| t.and_then(|t| next.map.get(t.id.index()).copied().flatten())).collect();
        Remap { old_graph: self.old_graph, map }
    }
}

/// What [`Graph::fuse`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FuseStats {
    /// Fusions applied.
    pub fusions: usize,
    /// Ops that run (live op nodes other than views) in the old graph minus in the new one.
    pub nodes_removed: usize,
    /// Bytes the replaced intermediates were written and read with (each non-view node that
    /// no longer exists: its size once written plus once per reader).
    pub bytes_saved: u64,
}

/// Why a [`Fusion`] is not applicable, checked before anything is built.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FusionError {
    #[error("fusion {fusion} ({op}) names no node")]
    Empty { fusion: usize, op: &'static str },
    #[error("fusion {fusion} ({op}): node {node:?} is not an op node of this graph")]
    NotAnOp { fusion: usize, op: &'static str, node: NodeId },
    #[error("fusion {fusion} ({op}): node {node:?} is already replaced by fusion {other}")]
    Overlap { fusion: usize, op: &'static str, node: NodeId, other: usize },
    #[error("fusion {fusion} ({op}): input {input:?} is not built before the fusion's last node {last:?}")]
    InputOrder { fusion: usize, op: &'static str, input: NodeId, last: NodeId },
    #[error("fusion {fusion} ({op}): input {input:?} is one of the replaced nodes")]
    InputInside { fusion: usize, op: &'static str, input: NodeId },
    #[error(
        "fusion {fusion} ({op}): node {node:?} is read by {user:?} outside the fusion (or is a graph output) but \
         has no stand-in in `outputs`"
    )]
    Unmapped { fusion: usize, op: &'static str, node: NodeId, user: NodeId },
    #[error(
        "fusion {fusion} ({op}): node {node:?} is read by {user:?}, which is built before the fusion's last node \
         {last:?}: the fused node would come too late"
    )]
    EarlyUser { fusion: usize, op: &'static str, node: NodeId, user: NodeId, last: NodeId },
    #[error(
        "fusion {fusion} ({op}): {writer:?} writes a tensor in place between the fusion's first and last node, so \
         the fused op could read other values than the nodes it replaces"
    )]
    InPlaceBetween { fusion: usize, op: &'static str, writer: NodeId },
    #[error("fusion {fusion} ({op}): the stand-in for {node:?} is {got:?}, the node was {want:?}")]
    Descriptor { fusion: usize, op: &'static str, node: NodeId, want: TensorMeta, got: TensorMeta },
}

impl Graph {
    /// This graph with `fusions` applied (see the module doc), and where every node went.
    /// Every fusion is checked first (a [`FusionError`] or an op's own error leaves nothing
    /// half-built):
    /// - its nodes are op nodes, in no other fusion; its inputs lie outside it and precede its
    ///   last node;
    /// - every node read from outside it (or marked as an output) has a stand-in of exactly its
    ///   descriptor, and every such reader comes after the fusion's last node;
    /// - no node between its first and last node (or the first node it recomputes,
    ///   [`Fusion::recomputes`]) writes a tensor in place: the fused op reads its inputs where the
    ///   last node was, so nothing may change them in between.
    pub fn fuse(&self, fusions: &[Fusion]) -> Result<(Graph, Remap, FuseStats), GraphError> {
        let live_ids = self.live_nodes();
        let mut live = vec![false; self.len()];
        for id in &live_ids {
            live[id.index()] = true;
        }
        let owner = self.check_fusions(fusions, &live)?;
        let last_of: HashMap<NodeId, usize> =
            fusions.iter().enumerate().map(|(f, fu)| (*fu.nodes.iter().max().expect("checked non-empty"), f)).collect();

        let mut g = Graph::new();
        let mut map: Vec<Option<Tensor>> = vec![None; self.len()];
        let get = |map: &[Option<Tensor>], id: NodeId| map[id.index()].expect("inputs precede their users");
        for (i, n) in self.nodes().iter().enumerate() {
            let id = NodeId(i as u32);
            match &n.kind {
                NodeKind::Leaf(kind) => {
                    let t = g.leaf(*kind, n.name.as_deref().unwrap_or(""), n.meta.dtype, n.meta.ne)?;
                    g.nodes[t.id.index()].name.clone_from(&n.name);
                    map[i] = Some(t);
                }
                NodeKind::Op(_) if !live[i] => {}
                NodeKind::Op(op) => match (owner.get(&id), last_of.get(&id)) {
                    (None, _) => {
                        let inputs: SmallVec<[Tensor; 4]> = n.inputs.iter().map(|&x| get(&map, x)).collect();
                        let t = g.op(op.clone(), &inputs)?;
                        g.nodes[t.id.index()].name.clone_from(&n.name);
                        map[i] = Some(t);
                    }
                    (Some(_), Some(&f)) => {
                        let fu = &fusions[f];
                        let inputs: SmallVec<[Tensor; 4]> = fu.inputs.iter().map(|&x| get(&map, x)).collect();
                        let fused = g.op(fu.op.clone(), &inputs)?;
                        for &(node, how) in &fu.outputs {
                            let mut t = fused;
                            for view in how.views() {
                                t = g.op(view, &[t])?;
                            }
                            let want = self.node(node).meta;
                            if t.meta != want {
                                let op = fu.op.name();
                                return Err(FusionError::Descriptor { fusion: f, op, node, want, got: t.meta }.into());
                            }
                            g.nodes[t.id.index()].name.clone_from(&self.node(node).name);
                            map[node.index()] = Some(t);
                        }
                    }
                    (Some(_), None) => {} // inside a fusion: its stand-in (if any) comes at the last node
                },
            }
        }
        for &o in self.outputs() {
            g.mark_output(get(&map, o))?;
        }
        let ops =
            |g: &Graph, ids: &[NodeId]| ids.iter().filter(|id| g.node(**id).op().is_some_and(|o| !o.is_view())).count();
        let new_live = g.live_nodes();
        let mut stats = FuseStats {
            fusions: fusions.len(),
            nodes_removed: ops(self, &live_ids).saturating_sub(ops(&g, &new_live)),
            bytes_saved: 0,
        };
        for (&node, _) in owner.iter().filter(|(node, _)| map[node.index()].is_none()) {
            let n = self.node(node);
            if n.op().is_some_and(|op| !op.is_view()) {
                let readers = self.users(node).iter().filter(|u| live[u.index()]).count() as u64;
                stats.bytes_saved += n.meta.nbytes_contiguous() as u64 * (1 + readers);
            }
        }
        Ok((g, Remap { old_graph: self.id, map }, stats))
    }

    /// Whether [`Graph::fuse`] would accept `fusion` on its own (the checks listed there, and
    /// the fused op valid on its inputs).
    pub fn check_fusion(&self, fusion: &Fusion) -> Result<(), GraphError> {
        let mut live = vec![false; self.len()];
        for id in self.live_nodes() {
            live[id.index()] = true;
        }
        self.check_fusions(std::slice::from_ref(fusion), &live)?;
        let metas: Vec<&TensorMeta> = fusion.inputs.iter().map(|&i| &self.node(i).meta).collect();
        let fused = tessera_ops::infer(&fusion.op, &metas)?;
        for &(node, how) in &fusion.outputs {
            let mut got = fused;
            for view in how.views() {
                got = tessera_ops::infer(&view, &[&got])?;
            }
            let want = self.node(node).meta;
            if got != want {
                return Err(FusionError::Descriptor { fusion: 0, op: fusion.op.name(), node, want, got }.into());
            }
        }
        Ok(())
    }

    /// Checks `fusions` against this graph; returns which fusion owns each replaced node.
    fn check_fusions(&self, fusions: &[Fusion], live: &[bool]) -> Result<HashMap<NodeId, usize>, GraphError> {
        let mut owner: HashMap<NodeId, usize> = HashMap::new();
        for (f, fu) in fusions.iter().enumerate() {
            let op = fu.op.name();
            let (Some(&first), Some(&last)) = (fu.nodes.iter().min(), fu.nodes.iter().max()) else {
                return Err(FusionError::Empty { fusion: f, op }.into());
            };
            let first = fu.recomputes.iter().copied().fold(first, NodeId::min);
            for &node in &fu.nodes {
                if self.nodes().get(node.index()).and_then(|n| n.op()).is_none() {
                    return Err(FusionError::NotAnOp { fusion: f, op, node }.into());
                }
                if let Some(other) = owner.insert(node, f) {
                    return Err(FusionError::Overlap { fusion: f, op, node, other }.into());
                }
            }
            for &input in &fu.inputs {
                if input.index() >= self.len() || input >= last {
                    return Err(FusionError::InputOrder { fusion: f, op, input, last }.into());
                }
                if fu.nodes.contains(&input) {
                    return Err(FusionError::InputInside { fusion: f, op, input }.into());
                }
            }
            for &node in &fu.nodes {
                let mapped = fu.outputs.iter().any(|(n, _)| *n == node);
                let outside = self.users(node).iter().copied().filter(|u| live[u.index()] && !fu.nodes.contains(u));
                // A graph output is read after the whole graph: it needs a stand-in, never too late.
                if self.is_output(node) && !mapped {
                    return Err(FusionError::Unmapped { fusion: f, op, node, user: node }.into());
                }
                for user in outside {
                    if !mapped {
                        return Err(FusionError::Unmapped { fusion: f, op, node, user }.into());
                    }
                    if user < last {
                        return Err(FusionError::EarlyUser { fusion: f, op, node, user, last }.into());
                    }
                }
            }
            let between = self.nodes().iter().zip(live).enumerate().take(last.index()).skip(first.index() + 1);
            for (i, (n, &is_live)) in between {
                let writes = n.op().is_some_and(|o| o.writes_input().is_some() || o.updates_input().is_some());
                let writer = NodeId(i as u32);
                if writes && is_live && !fu.nodes.contains(&writer) {
                    return Err(FusionError::InPlaceBetween { fusion: f, op, writer }.into());
                }
            }
        }
        Ok(owner)
    }
}
