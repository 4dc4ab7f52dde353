//! Which backend runs each node, when a graph is placed on several (ggml's scheduler, in one
//! pass over the live nodes in build order).
//!
//! - A leaf lives on backend 0 (the caller's preferred backend, where bound memory lives).
//! - A view lives where its source's bytes are; so does an op that writes or updates an input in
//!   place (`Op::writes_input`, `Op::updates_input`): state never moves between backends, and
//!   such an op that its home backend does not support is an error.
//! - Any other op goes to the first backend, in preference order, that supports it with these
//!   input descriptors. Its inputs that live elsewhere are read from mirrors (`plan.rs`).

use smallvec::SmallVec;
use tessera_ops::TensorMeta;

use crate::{Backend, ExecError, Graph, NodeKind};

/// The home backend of every live node (indexed by node; 0 where not live), or the first op no
/// allowed backend supports.
pub fn assign(graph: &Graph, backends: &[&dyn Backend]) -> Result<Vec<usize>, ExecError> {
    let mut home = vec![0usize; graph.len()];
    for id in graph.live_nodes() {
        let node = graph.node(id);
        let op = match &node.kind {
            NodeKind::Leaf(_) => continue,
            NodeKind::Op(op) => op,
        };
        let pinned = if op.is_view() { Some(0) } else { op.writes_input().or(op.updates_input()) };
        let metas: SmallVec<[TensorMeta; 4]> = node.inputs.iter().map(|i| graph.node(*i).meta).collect();
        let unsupported = |b: usize| ExecError::Unsupported {
            backend: backends[b].name().to_string(),
            op: op.to_string(),
            node: id,
            inputs: metas.iter().map(|m| (m.ne, m.dtype)).collect(),
        };
        home[id.index()] = match pinned {
            Some(i) => {
                let b = home[node.inputs[i].index()];
                if !op.is_view() && !backends[b].supports(op, &metas) {
                    return Err(unsupported(b));
                }
                b
            }
            None => (0..backends.len()).find(|&b| backends[b].supports(op, &metas)).ok_or_else(|| unsupported(0))?,
        };
    }
    Ok(home)
}
