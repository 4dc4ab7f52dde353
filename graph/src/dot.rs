//! Graphviz DOT export: one box per node with its op, shape and dtype.

use std::fmt::Write;

use crate::{Graph, NodeId, NodeKind};

impl Graph {
    /// The graph in Graphviz DOT. Leaves are ellipses, views dashed, outputs bold.
    pub fn to_dot(&self) -> String {
        self.to_dot_clustered(&[])
    }

    /// [`Graph::to_dot`] with each `(label, nodes)` group drawn as a labelled cluster (e.g. the
    /// nodes a fusion pass produced).
    pub fn to_dot_clustered(&self, clusters: &[(String, Vec<NodeId>)]) -> String {
        let mut s = String::from("digraph tessera {\n  rankdir=TB;\n  node [shape=box, fontname=\"monospace\"];\n");
        for (c, (label, ids)) in clusters.iter().enumerate() {
            let _ = writeln!(
                s,
                "  subgraph cluster_{c} {{\n    label=\"{}\"; style=filled; color=lightgrey;",
                escape(label)
            );
            for id in ids {
                let _ = writeln!(s, "    n{};", id.index());
            }
            s.push_str("  }\n");
        }
        for (i, n) in self.nodes().iter().enumerate() {
            let what = match &n.kind {
                NodeKind::Op(op) => op.to_string(),
                NodeKind::Leaf(k) => k.name().to_string(),
            };
            let name = n.name.as_deref().map(|s| format!("{}\\n", escape(s))).unwrap_or_default();
            let ne = n.meta.ne;
            let mut style = Vec::new();
            match &n.kind {
                NodeKind::Leaf(_) => style.push("shape=ellipse"),
                NodeKind::Op(op) if op.is_view() => style.push("style=dashed"),
                NodeKind::Op(_) => {}
            }
            if self.outputs().iter().any(|o| o.index() == i) {
                style.push("penwidth=2");
            }
            let label = format!(
                "#{i} {}{}\\n[{}, {}, {}, {}] {}",
                name,
                escape(&what),
                ne[0],
                ne[1],
                ne[2],
                ne[3],
                n.meta.dtype
            );
            let _ = writeln!(
                s,
                "  n{i} [label=\"{label}\"{}{}];",
                if style.is_empty() { "" } else { ", " },
                style.join(", ")
            );
            for (slot, inp) in n.inputs.iter().enumerate() {
                let _ = writeln!(s, "  n{} -> n{i} [label=\"{slot}\"];", inp.index());
            }
        }
        s.push_str("}\n");
        s
    }
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}
