//! The model on two backends: ops the first refuses run on the second (the scheduler's fallback),
//! and the engine's tokens and logits are exactly those of one backend alone.

use tessera_cpu::CpuBackend;
use tessera_graph::Refusing;
use tessera_models::engine::{Engine, EngineConfig};
use tessera_models::gguf::GgufFile;
use tessera_models::model::{Model, ModelOptions};
use tessera_models::sample::SamplerParams;
use tessera_ops::DType;

mod synth_file;
use synth_file::synth_file;

fn file(preset: &str) -> GgufFile {
    synth_file(preset, DType::F32, 5)
}

fn opts() -> ModelOptions {
    ModelOptions { kv_blocks: 64, block_size: 4, max_context: 96, n_slots: 4, kv_pad: 8, ..Default::default() }
}

/// Three prompts, greedy and sampled, generated with logits recorded (so the logits path runs)
/// and then without (so the greedy-on-device path runs).
fn generate(mut e: Engine) -> (Vec<Vec<u32>>, Vec<Vec<f32>>) {
    let mut tokens = Vec::new();
    let mut logits = Vec::new();
    for record in [true, false] {
        e.record_logits(record);
        let sampled = SamplerParams { temperature: 0.8, top_k: Some(20), top_p: 0.9, seed: 11 };
        let ids = [
            e.submit(&[1, 2, 3, 4, 5, 6, 7], 6, SamplerParams::greedy()).unwrap(),
            e.submit(&[9, 8], 9, sampled).unwrap(),
            e.submit(&[3; 13], 4, SamplerParams::greedy()).unwrap(),
        ];
        let mut out = e.run_to_completion().unwrap();
        for id in ids {
            tokens.push(out.remove(&id).unwrap());
            logits.push(e.take_logits(id));
        }
    }
    (tokens, logits)
}

#[test]
fn refused_ops_fall_back_to_the_second_backend_with_identical_results() {
    for preset in ["tiny", "tiny-moe"] {
        let f = file(preset);
        let alone = {
            let mut be = CpuBackend::new();
            let m = Model::load(&f, &mut be, opts()).unwrap();
            generate(Engine::new(m, Box::new(be), EngineConfig { max_tokens_per_step: 8 }).unwrap())
        };
        // the router's ops, a norm used everywhere, and the head's matmuls and argmax
        for refuse in [&["top_k", "softmax", "argmax"][..], &["rms_norm", "l2_norm"], &["mul_mat", "get_rows"]] {
            let mut first = Refusing::new(CpuBackend::new(), refuse);
            let m = Model::load(&f, &mut first, opts()).unwrap();
            let e = Engine::with_fallback(
                m,
                Box::new(first),
                Box::new(CpuBackend::new()),
                EngineConfig { max_tokens_per_step: 8 },
            )
            .unwrap();
            let got = generate(e);
            assert_eq!(got.0, alone.0, "{preset}, refusing {refuse:?}: tokens");
            assert_eq!(got.1, alone.1, "{preset}, refusing {refuse:?}: logits");
        }
    }
}

#[test]
fn a_refused_state_update_is_an_error_naming_the_op() {
    let f = file("tiny");
    // (with the passes on the step holds gated_delta_net_fused; without, gated_delta_net)
    let mut first = Refusing::new(CpuBackend::new(), &["gated_delta_net", "gated_delta_net_fused"]);
    let m = Model::load(&f, &mut first, opts()).unwrap();
    let mut e =
        Engine::with_fallback(m, Box::new(first), Box::new(CpuBackend::new()), EngineConfig { max_tokens_per_step: 8 })
            .unwrap();
    e.submit(&[1, 2, 3], 2, SamplerParams::greedy()).unwrap();
    let err = e.run_to_completion().unwrap_err().to_string();
    assert!(err.contains("gated_delta_net"), "{err}");
}
