//! The step graphs of the tiny presets, op by op: a refactor of the model builders must not
//! change them. `tests/data/step_graph_ops.txt` holds, per preset and bucket, the node count, the
//! bindings and the histogram of every node's label (ops with their parameters, leaves by kind);
//! `TESSERA_WRITE_STEP_GRAPHS=PATH` writes what this build makes (and, beside it, the full
//! ordered node list as `PATH.full`) instead of comparing.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use tessera_cpu::CpuBackend;
use tessera_graph::Graph;
use tessera_models::config::ModelConfig;
use tessera_models::model::{Bucket, Model, ModelOptions};
use tessera_ops::DType;

fn opts() -> ModelOptions {
    ModelOptions { merge_projections: true, route_shared_expert: 64, kv_pad: 16, ..ModelOptions::default() }
}

fn label(g: &Graph, i: usize) -> String {
    let n = &g.nodes()[i];
    match n.op() {
        Some(op) => format!("{op}"),
        None => n.label().to_string(),
    }
}

fn dump() -> (String, String) {
    let (mut short, mut full) = (String::new(), String::new());
    for preset in ["tiny", "tiny-moe"] {
        let mut be = CpuBackend::new();
        let mut m = Model::synthetic(ModelConfig::preset(preset).unwrap(), DType::F32, 1, &mut be, opts()).unwrap();
        let buckets = [
            Bucket { n_tokens: 1, n_seq: 1, n_kv: 16, all_logits: false, sample: false },
            Bucket { n_tokens: 1, n_seq: 1, n_kv: 16, all_logits: false, sample: true },
            Bucket { n_tokens: 12, n_seq: 2, n_kv: 32, all_logits: false, sample: false },
            Bucket { n_tokens: 128, n_seq: 1, n_kv: 128, all_logits: true, sample: false },
        ];
        for bucket in buckets {
            let (g, binds) = m.step_graph(bucket).unwrap();
            let mut hist: BTreeMap<String, usize> = BTreeMap::new();
            for i in 0..g.len() {
                *hist.entry(label(&g, i)).or_default() += 1;
                let n = &g.nodes()[i];
                let inputs: Vec<usize> = n.inputs.iter().map(|x| x.index()).collect();
                let name = n.name.as_deref().unwrap_or("");
                writeln!(
                    full,
                    "{preset} {bucket:?} {i}: {} {inputs:?} {:?} {} {name}",
                    label(&g, i),
                    n.meta.ne,
                    n.meta.dtype
                )
                .unwrap();
            }
            writeln!(
                short,
                "{preset} {bucket:?}: {} nodes, {} live, {} bindings",
                g.len(),
                g.live_nodes().len(),
                binds.len()
            )
            .unwrap();
            for (k, v) in hist {
                writeln!(short, "  {v} {k}").unwrap();
            }
        }
        m.free(&mut be);
    }
    (short, full)
}

#[test]
fn step_graphs_of_the_tiny_presets_are_unchanged() {
    let (short, full) = dump();
    if let Ok(path) = std::env::var("TESSERA_WRITE_STEP_GRAPHS") {
        std::fs::write(&path, &short).unwrap();
        std::fs::write(format!("{path}.full"), &full).unwrap();
        return;
    }
    let want = include_str!("data/step_graph_ops.txt");
    assert!(short == want, "the step graphs changed:\n{short}");
}
