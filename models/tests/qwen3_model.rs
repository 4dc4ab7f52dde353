//! The qwen3 / qwen3moe forward pass on synthetic `qwen3-tiny` / `qwen3moe-tiny` checkpoints (f32
//! weights) on the CPU backend: batching, chunking, cached step graphs replayed against fresh
//! ones, greedy determinism, and the family's own checks. llama.cpp agreement is in docs/MODELS.md
//! ("qwen3 against llama.cpp"), transformers agreement in `hf_fixtures.rs`.

use tessera_models::config::{ConfigError, ModelConfig};
use tessera_models::model::{Logits, ModelOptions};

mod model_steps;
mod synth_file;
use model_steps::{assert_close, load, opts, run_chunks, tokens};

const PRESETS: [&str; 2] = ["qwen3-tiny", "qwen3moe-tiny"];

#[test]
fn the_file_loads_as_its_family() {
    for p in PRESETS {
        let (m, _be) = load(p, opts());
        let c = m.config().unwrap();
        assert_eq!(m.arch().name(), c.arch.name());
        assert!(c.arch.name().starts_with("qwen3") && !c.arch.name().starts_with("qwen35"), "{p}");
        assert_eq!((c.n_rot, c.rope_sections, c.ssm.is_none()), (c.head_dim, None, true), "{p}");
        // the dense model is untied, the MoE one tied
        assert_eq!(m.arch().lm_head(), if p == "qwen3-tiny" { "output.weight" } else { "token_embd.weight" });
    }
}

#[test]
fn logits_are_finite_and_prefill_chunking_does_not_change_them() {
    for p in PRESETS {
        let t = tokens(10, 4);
        let (mut m, mut be) = load(p, opts());
        let all = m.step(&mut be, &[(0, &t)], Logits::All).unwrap().remove(0);
        let v = m.n_vocab();
        assert_eq!(all.len(), 10 * v);
        assert!(all.iter().all(|x| x.is_finite()) && all.iter().any(|&x| x != 0.0), "{p}");
        for chunk in [1, 3, 10] {
            let c = run_chunks(p, &t, chunk, opts());
            assert_close(&c, &all[9 * v..], &format!("{p} chunk {chunk}"));
        }
    }
}

#[test]
fn batched_sequences_equal_each_alone() {
    for p in PRESETS {
        let (a, b, c) = (tokens(7, 5), tokens(9, 6), tokens(1, 7));
        let alone = [&a, &b, &c].map(|t| run_chunks(p, t, t.len(), opts()));
        let (mut m, mut be) = load(p, opts());
        let out = m.step(&mut be, &[(10, &a), (20, &b), (30, &c)], Logits::Last).unwrap();
        for (i, (got, want)) in out.iter().zip(&alone).enumerate() {
            assert_close(got, want, &format!("{p} sequence {i}"));
        }
        // a batched decode step after the batched prefill, in another order
        let next = [tokens(1, 8), tokens(1, 9)];
        let out = m.step(&mut be, &[(20, &next[1]), (10, &next[0])], Logits::Last).unwrap();
        assert_close(&out[1], &run_chunks(p, &[a.clone(), next[0].clone()].concat(), 8, opts()), &format!("{p} a"));
        assert_close(&out[0], &run_chunks(p, &[b.clone(), next[1].clone()].concat(), 10, opts()), &format!("{p} b"));
    }
}

/// Decode steps of one shape reuse (replay) the cached step graph; each equals the same history
/// run on a fresh model, whose graphs are all built anew, bit for bit.
#[test]
fn replayed_step_graphs_equal_fresh_ones() {
    for p in PRESETS {
        let prompt = tokens(6, 3);
        // KV length padded to 16: the five decode steps below keep one shape
        let (mut m, mut be) = load(p, ModelOptions { kv_pad: 16, ..opts() });
        let mut history = prompt.clone();
        let mut tok = m.step_greedy(&mut be, &[(0, &prompt)]).unwrap();
        let reused = m.step_cache_stats().reused;
        for _ in 0..5 {
            history.extend(&tok);
            let replayed = m.step(&mut be, &[(0, &tok)], Logits::Last).unwrap().remove(0);
            let fresh = run_chunks(p, &history, history.len(), opts());
            assert_close(&replayed, &fresh, p);
            tok = vec![argmax(&replayed)];
        }
        assert!(
            m.step_cache_stats().reused >= reused + 3,
            "{p}: decode steps did not replay: {:?}",
            m.step_cache_stats()
        );
    }
}

fn argmax(v: &[f32]) -> u32 {
    v.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &x)| if x > b.1 { (i, x) } else { b }).0 as u32
}

#[test]
fn greedy_decoding_is_deterministic() {
    for p in PRESETS {
        let run = || {
            let (mut m, mut be) = load(p, opts());
            let mut out = m.step_greedy(&mut be, &[(0, &tokens(5, 1)), (1, &tokens(3, 2))]).unwrap();
            let mut all = out.clone();
            for _ in 0..8 {
                out = m.step_greedy(&mut be, &[(0, &out[..1]), (1, &out[1..])]).unwrap();
                all.extend(&out);
            }
            all
        };
        let a = run();
        assert_eq!(a, run(), "{p}");
        assert!(a.iter().all(|&t| (t as usize) < 256));
    }
}

#[test]
fn unmerged_projections_give_the_same_logits() {
    for p in PRESETS {
        let t = tokens(9, 3);
        let (mut m, mut be) = load(p, opts());
        assert!(m.weights.contains("blk.0.attn_qkv.merged"), "{p}");
        let merged = m.step(&mut be, &[(0, &t)], Logits::All).unwrap();
        let (mut plain, mut be2) = load(p, ModelOptions { merge_projections: false, ..opts() });
        assert_eq!(merged, plain.step(&mut be2, &[(0, &t)], Logits::All).unwrap(), "{p}");
    }
}

#[test]
fn rope_must_cover_the_whole_head() {
    let c = ModelConfig::preset("qwen3-tiny").unwrap().with_override("rope.dimension_count", "16").unwrap();
    let e = tessera_models::arch::for_config(c).unwrap_err();
    assert!(matches!(&e, ConfigError::Inconsistent { key, .. } if key == "qwen3.rope.dimension_count"), "{e}");
}

#[test]
fn real_shapes() {
    let c = ModelConfig::preset("qwen3-32b").unwrap();
    let specs = c.tensor_specs();
    let get = |n: &str| specs.iter().find(|s| s.name == n).unwrap().ne;
    assert_eq!(get("blk.63.attn_q.weight"), [5120, 64 * 128, 1, 1]);
    assert_eq!(get("blk.0.attn_k.weight"), [5120, 8 * 128, 1, 1]);
    assert_eq!(get("blk.0.ffn_down.weight"), [25_600, 5120, 1, 1]);
    assert_eq!(get("output.weight"), [5120, 151_936, 1, 1]);
    assert_eq!(specs.len(), 3 + 64 * 11);
    let m = ModelConfig::preset("qwen3moe-30b-a3b").unwrap();
    let specs = m.tensor_specs();
    let get = |n: &str| specs.iter().find(|s| s.name == n).unwrap().ne;
    assert_eq!(get("blk.47.ffn_gate_exps.weight"), [2048, 768, 128, 1]);
    assert_eq!(get("blk.0.ffn_down_exps.weight"), [768, 2048, 128, 1]);
    assert_eq!(get("blk.0.attn_output.weight"), [4096, 2048, 1, 1]);
    // about 30.5B weights, 3.3B active
    let p = m.n_params() as f64 / 1e9;
    assert!((30.0..31.0).contains(&p), "{p}");
}

#[test]
fn the_memory_report_counts_no_recurrent_state() {
    for p in PRESETS {
        let (m, _be) = load(p, opts());
        let r = tessera_models::engine::memory(&m);
        assert_eq!((r.recurrent_bytes_per_sequence, r.recurrent_cache_bytes), (0, 0), "{p}");
        assert!(r.kv_bytes_per_token > 0 && r.kv_cache_bytes > 0, "{p}");
        assert_eq!(r.total_cache_bytes, r.kv_cache_bytes, "{p}");
    }
}
