//! The fusion passes on the model's step graphs (CPU): each built-in pass fires where the model
//! has its pattern, a decode step runs fewer ops, and the logits with the passes on equal those
//! with every pass off (the CPU computes each fused op as the subgraph it replaces).

use tessera_cpu::CpuBackend;
use tessera_models::gguf::GgufFile;
use tessera_models::model::{Bucket, Logits, Model};
use tessera_ops::DType;

mod model_steps;
mod synth_file;
use model_steps::opts;
use synth_file::synth_file;

const PRESETS: [&str; 2] = ["tiny", "tiny-moe"];

fn file(preset: &str) -> GgufFile {
    synth_file(preset, DType::F32, 11)
}

/// Every logit of a 9-token prompt, then of a 3-sequence mixed step.
fn logits(preset: &str, passes: bool) -> Vec<f32> {
    let mut be = CpuBackend::new();
    let mut m = Model::load(&file(preset), &mut be, opts()).unwrap();
    m.passes_mut().set_all(passes);
    let a: Vec<u32> = (0..9).map(|i| (i * 37 + 5) % 256).collect();
    let mut out = m.step(&mut be, &[(0, &a)], Logits::All).unwrap().remove(0);
    let (b, c) = ([7u32, 8, 9, 10], [11u32]);
    for l in m.step(&mut be, &[(0, &[3]), (1, &b), (2, &c)], Logits::All).unwrap() {
        out.extend(l);
    }
    m.free(&mut be);
    out
}

#[test]
fn the_passes_fire_on_the_model_and_keep_its_logits() {
    for p in PRESETS {
        let on = logits(p, true);
        let off = logits(p, false);
        let num: f64 = on.iter().zip(&off).map(|(&x, &y)| (x as f64 - y as f64).powi(2)).sum();
        let den: f64 = off.iter().map(|&y| (y as f64).powi(2)).sum();
        assert!(num / den <= 1e-12, "{p}: logits with the passes differ, nmse {:e}", num / den);

        let mut be = CpuBackend::new();
        let m = Model::load(&file(p), &mut be, opts()).unwrap();
        let c = m.config().unwrap();
        let bucket = Bucket { n_tokens: 1, n_seq: 1, n_kv: 32, all_logits: false, sample: true };
        let s = m.fusion_summary(&be, bucket).unwrap();
        assert!(s.ops_after < s.ops_before, "{p}: {s:?}");
        // the kinds add up to the ops, most first
        assert_eq!(s.kinds_after.iter().map(|k| k.1).sum::<usize>(), s.ops_after, "{p}");
        assert!(s.kinds_after.windows(2).all(|w| w[0].1 >= w[1].1), "{p}: {:?}", s.kinds_after);
        let kind = |name: &str| s.kinds_after.iter().find(|k| k.0 == name).map_or(0, |k| k.1);
        assert_eq!(kind("add"), 0, "{p}: every residual add goes into a norm: {:?}", s.kinds_after);
        let applied = |name: &str| s.reports.iter().find(|r| r.pass == name).map_or(0, |r| r.applied);
        let layers = c.n_main_layers();
        let attn =
            (0..layers).filter(|&il| c.layer_kind(il) == tessera_models::config::LayerKind::FullAttention).count();
        // Every block's two pre-norms follow a residual add except the first layer's first, and the
        // output norm follows the last add.
        assert_eq!(applied("add_rms_norm_mul"), 2 * layers, "{p}");
        assert_eq!(applied("gated_rms_norm"), layers - attn, "{p}");
        assert_eq!(applied("rms_norm_mul"), 1 + 2 * attn, "{p}: the first norm and the q/k norms");
        // ... and each q/k norm then takes its rotation along (one op fewer each).
        let rope = s.reports.iter().find(|r| r.pass == "rms_norm_mul_rope").expect("the pass ran");
        assert_eq!((rope.applied, rope.nodes_removed), (2 * attn, 2 * attn), "{p}: q and k of each attention");
        // The attention output gate mul(o, sigmoid(gate)) goes into the attention (two ops).
        let gate = s.reports.iter().find(|r| r.pass == "attention_gate").expect("the pass ran");
        assert_eq!((gate.applied, gate.nodes_removed), (attn, 2 * attn), "{p}");
        let moe = matches!(c.ffn, tessera_models::config::Ffn::Moe { .. });
        assert_eq!(applied("softmax_top_k"), if moe { layers } else { 0 }, "{p}");
        assert_eq!(applied("moe_weights"), if moe { layers } else { 0 }, "{p}");
        // ... and the two router ops of each MoE block become one.
        assert_eq!(applied("moe_router"), if moe { layers } else { 0 }, "{p}");
        // elementwise_chains: the DeltaNet decay mul(softplus(add(alpha, dt_bias)), a) (3 ops).
        // (The shared expert is routed as one more slot, so its gate add(moe, mul(sh,
        // sigmoid(gate))) is not in the graph.)
        let chains = s.reports.iter().find(|r| r.pass == "elementwise_chains").expect("the pass ran");
        assert_eq!(chains.applied, layers - attn, "{p}");
        assert_eq!(chains.nodes_removed, 2 * (layers - attn), "{p}");
        // delta_net_prep: every DeltaNet layer's l2_norm of q and k, beta's sigmoid and the decay
        // program (what elementwise_chains left) go into its delta rule: three ops a layer.
        let prep = s.reports.iter().find(|r| r.pass == "delta_net_prep").expect("the pass ran");
        assert_eq!((prep.applied, prep.nodes_removed), (layers - attn, 3 * (layers - attn)), "{p}");
        // gate_up_swiglu: the dense FFN's products, or the routed experts' (the shared expert's
        // among them), each pair with its swiglu (two ops removed a fusion).
        let glu = s.reports.iter().find(|r| r.pass == "gate_up_swiglu").expect("the pass ran");
        assert_eq!((glu.applied, glu.nodes_removed), (layers, 2 * layers), "{p}");
        let mut m = m;
        m.free(&mut be);
    }
}
