//! The qwen35 / qwen35moe forward pass on synthetic `tiny` / `tiny-moe` checkpoints (f32 weights)
//! on the CPU backend: consistency across step shapes, batching, paging and runs, and errors.

use tessera_cpu::CpuBackend;
use tessera_models::cache::{AllocPolicy, CacheError};
use tessera_models::config::ConfigError;
use tessera_models::gguf::{GgufFile, GgufWriter, Value};
use tessera_models::model::{Logits, Model, ModelError, ModelOptions};
use tessera_models::weights::WeightsError;
use tessera_ops::DType;

mod model_steps;
mod synth_file;
use model_steps::{assert_close, file, load, nmse, opts, run_chunks, tokens};

const PRESETS: [&str; 2] = ["tiny", "tiny-moe"];

#[test]
fn logits_are_finite_and_shaped() {
    for p in PRESETS {
        let (mut m, mut be) = load(p, opts());
        let t = tokens(5, 1);
        let out = m.step(&mut be, &[(0, &t)], Logits::All).unwrap();
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].len(), 5 * m.n_vocab(), "{p}");
        assert!(out[0].iter().all(|x| x.is_finite()), "{p}");
        let spread = out[0].iter().fold(0f32, |a, &x| a.max(x.abs()));
        assert!(spread > 0.0, "{p}: all-zero logits");
        assert_eq!(m.seq_len(0).unwrap(), 5);
    }
}

#[test]
fn all_logits_last_row_equals_last_logits() {
    for p in PRESETS {
        let t = tokens(6, 2);
        let (mut m, mut be) = load(p, opts());
        let all = m.step(&mut be, &[(0, &t)], Logits::All).unwrap().remove(0);
        let last = run_chunks(p, &t, 6, opts());
        let v = m.n_vocab();
        assert_close(&all[5 * v..], &last, p);
    }
}

#[test]
fn decode_after_prefill_equals_longer_prefill() {
    for p in PRESETS {
        let t = tokens(9, 3);
        let (mut m, mut be) = load(p, opts());
        m.step(&mut be, &[(0, &t[..8])], Logits::Last).unwrap();
        let dec = m.step(&mut be, &[(0, &t[8..])], Logits::Last).unwrap().remove(0);
        let full = run_chunks(p, &t, 9, opts());
        assert_close(&dec, &full, p);
    }
}

#[test]
fn prefill_chunking_does_not_change_logits() {
    for p in PRESETS {
        let t = tokens(10, 4);
        let all = run_chunks(p, &t, 10, opts());
        for chunk in [1, 3] {
            let c = run_chunks(p, &t, chunk, opts());
            assert_close(&c, &all, &format!("{p} chunk {chunk}"));
        }
    }
}

#[test]
fn batched_sequences_equal_each_alone() {
    for p in PRESETS {
        let (a, b, c) = (tokens(7, 5), tokens(7, 6), tokens(4, 7));
        let alone_a = run_chunks(p, &a, 7, opts());
        let alone_b = run_chunks(p, &b, 7, opts());
        let alone_c = run_chunks(p, &c, 4, opts());
        let (mut m, mut be) = load(p, opts());
        // Three sequences, two lengths, one packed graph.
        let out = m.step(&mut be, &[(10, &a), (20, &b), (30, &c)], Logits::Last).unwrap();
        assert_close(&out[0], &alone_a, &format!("{p} a"));
        assert_close(&out[1], &alone_b, &format!("{p} b"));
        assert_close(&out[2], &alone_c, &format!("{p} c"));
        // A batched decode step after the batched prefill.
        let next = [tokens(1, 8), tokens(1, 9)];
        let out = m.step(&mut be, &[(20, &next[1]), (10, &next[0])], Logits::Last).unwrap();
        let mut a2 = a.clone();
        a2.extend(&next[0]);
        let mut b2 = b.clone();
        b2.extend(&next[1]);
        assert_close(&out[1], &run_chunks(p, &a2, 8, opts()), &format!("{p} a decode"));
        assert_close(&out[0], &run_chunks(p, &b2, 8, opts()), &format!("{p} b decode"));
    }
}

/// One step mixing prompt chunks of several lengths with decode tokens is one graph, and each
/// sequence's logits (every row, so the causal order inside a chunk is checked too) equal the
/// sequence run alone. Then the same sequences continue in a step of another mix, so the
/// recurrent state and the KV cache written by the packed step are checked as well.
#[test]
fn a_mixed_step_is_one_graph_and_equals_each_sequence_alone() {
    for p in PRESETS {
        let prompts = [tokens(9, 1), tokens(1, 2), tokens(3, 3), tokens(1, 4), tokens(13, 5)];
        let (mut m, mut be) = load(p, ModelOptions { n_slots: 8, ..opts() });
        // Sequences 1 and 3 already hold a few tokens and decode one now.
        let before = [tokens(5, 6), tokens(2, 7)];
        m.step(&mut be, &[(1, &before[0]), (3, &before[1])], Logits::Last).unwrap();
        let built = m.step_cache_stats().built;
        let batch: Vec<(u32, &[u32])> = prompts.iter().enumerate().map(|(i, t)| (i as u32, &t[..])).collect();
        let out = m.step(&mut be, &batch, Logits::All).unwrap();
        assert_eq!(m.step_cache_stats().built, built + 1, "{p}: the mixed step is one graph");
        let history = |i: usize| -> Vec<u32> {
            let pre: &[u32] = match i {
                1 => &before[0],
                3 => &before[1],
                _ => &[],
            };
            [pre, &prompts[i][..]].concat()
        };
        let n_vocab = m.n_vocab();
        for (i, got) in out.iter().enumerate() {
            let h = history(i);
            let (mut alone, mut be1) = load(p, opts());
            let all = alone.step(&mut be1, &[(0, &h)], Logits::All).unwrap().remove(0);
            let want = &all[(h.len() - prompts[i].len()) * n_vocab..];
            assert_close(got, want, &format!("{p} sequence {i}"));
        }
        // A second step of another mix: decode for 0, 2, 4 and a chunk for 1.
        let next = [tokens(1, 8), tokens(4, 9), tokens(1, 10), tokens(1, 11)];
        let out = m.step(&mut be, &[(0, &next[0]), (1, &next[1]), (2, &next[2]), (4, &next[3])], Logits::Last).unwrap();
        for (k, i) in [0usize, 1, 2, 4].into_iter().enumerate() {
            let h = [history(i), next[k].clone()].concat();
            let want = run_chunks(p, &h, h.len(), opts());
            assert_close(&out[k], &want, &format!("{p} sequence {i}, second step"));
        }
    }
}

#[test]
fn shuffled_blocks_equal_in_order() {
    for p in PRESETS {
        let shuffled = ModelOptions { policy: AllocPolicy::Shuffled { seed: 9 }, ..opts() };
        let run = |o: ModelOptions| {
            let (mut m, mut be) = load(p, o);
            let (a, b) = (tokens(11, 1), tokens(11, 2));
            // Interleave two sequences so their blocks alternate.
            let mut out = Vec::new();
            for i in 0..11 {
                out = m.step(&mut be, &[(1, &a[i..=i]), (2, &b[i..=i])], Logits::Last).unwrap();
            }
            out
        };
        let (x, y) = (run(opts()), run(shuffled));
        assert_close(&y[0], &x[0], p);
        assert_close(&y[1], &x[1], p);
    }
}

#[test]
fn two_runs_are_bit_identical() {
    for p in PRESETS {
        let t = tokens(8, 11);
        let a = run_chunks(p, &t, 3, opts());
        let b = run_chunks(p, &t, 3, opts());
        assert_eq!(
            a.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            b.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
    }
}

#[test]
fn removed_sequence_slot_is_reused_clean() {
    let t = tokens(5, 12);
    let fresh = run_chunks("tiny", &t, 5, opts());
    let (mut m, mut be) = load("tiny", ModelOptions { n_slots: 1, ..opts() });
    m.step(&mut be, &[(0, &tokens(6, 13))], Logits::Last).unwrap();
    m.remove_sequence(0).unwrap();
    let again = m.step(&mut be, &[(1, &t)], Logits::Last).unwrap().remove(0);
    assert_close(&again, &fresh, "reused slot");
}

/// A copy of `src` with tensor `drop` left out and `general.architecture` set to `arch`.
fn rewrite(src: &GgufFile, drop: Option<&str>, arch: Option<&str>) -> GgufFile {
    let mut w = GgufWriter::new();
    for (k, v) in src.metadata() {
        let v = match (k.as_str(), arch) {
            ("general.architecture", Some(a)) => Value::from(a),
            _ => v.clone(),
        };
        w.add_kv(k.clone(), v).unwrap();
    }
    for t in src.tensors() {
        if Some(t.name.as_str()) != drop {
            w.add_tensor(t.name.clone(), t.dtype, t.dims(), src.tensor_data(&t.name).unwrap()).unwrap();
        }
    }
    GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap()
}

#[test]
fn missing_tensor_is_a_clear_error() {
    let f = rewrite(&file("tiny"), Some("blk.0.ssm_a"), None);
    let mut be = CpuBackend::new();
    let e = Model::load(&f, &mut be, opts()).unwrap_err();
    assert!(matches!(e, ModelError::Weights(WeightsError::Config(ConfigError::Tensors { .. }))), "{e:?}");
    assert!(e.to_string().contains("blk.0.ssm_a"), "{e}");
}

#[test]
fn unknown_architecture_is_a_clear_error() {
    let f = rewrite(&file("tiny"), None, Some("llama"));
    let mut be = CpuBackend::new();
    let e = Model::load(&f, &mut be, opts()).unwrap_err();
    assert!(matches!(e, ModelError::Config(ConfigError::UnknownArchitecture { .. })), "{e:?}");
    assert!(e.to_string().contains("llama"), "{e}");
}

#[test]
fn exceeding_the_cache_is_an_error_and_changes_nothing() {
    let (mut m, mut be) = load("tiny", ModelOptions { max_context: 8, ..opts() });
    m.step(&mut be, &[(0, &tokens(6, 1))], Logits::Last).unwrap();
    let e = m.step(&mut be, &[(0, &tokens(3, 2))], Logits::Last).unwrap_err();
    assert!(matches!(e, ModelError::Cache(CacheError::ContextTooLong { .. })), "{e:?}");
    assert_eq!(m.seq_len(0).unwrap(), 6);
    // Out of blocks: 2 blocks of 4 cells in all.
    let (mut m, mut be) = load("tiny", ModelOptions { kv_blocks: 2, ..opts() });
    let e = m.step(&mut be, &[(0, &tokens(5, 1)), (1, &tokens(5, 1))], Logits::Last).unwrap_err();
    assert!(matches!(e, ModelError::Cache(CacheError::OutOfBlocks { .. })), "{e:?}");
    assert!(!m.kv.contains(0) && !m.kv.contains(1));
    // A token outside the vocab and an empty sequence are batch errors.
    assert!(matches!(m.step(&mut be, &[(0, &[9999])], Logits::Last), Err(ModelError::BadBatch { .. })));
    assert!(matches!(m.step(&mut be, &[(0, &[])], Logits::Last), Err(ModelError::BadBatch { .. })));
}

#[test]
fn f16_kv_cache_stays_close_to_f32() {
    for p in PRESETS {
        let t = tokens(9, 14);
        let f32_run = run_chunks(p, &t, 4, opts());
        let f16_run = run_chunks(p, &t, 4, ModelOptions { kv_dtype: DType::F16, ..opts() });
        assert!(f16_run.iter().all(|x| x.is_finite()), "{p}");
        let e = nmse(&f16_run, &f32_run);
        assert!(e <= 1e-4, "{p}: f16 cache nmse {e:e}");
    }
}

#[test]
fn a_model_without_attention_layers_runs() {
    // Two blocks under a full-attention interval of 4: gated DeltaNet only, so the step graph
    // has no rope positions, KV write cells or block table to fill.
    let mut config = tessera_models::config::ModelConfig::preset("tiny-moe").unwrap();
    config.n_layer = 2;
    if let Some(s) = config.ssm.as_mut() {
        s.full_attention_interval = 4;
    }
    let path = std::env::temp_dir().join(format!("tessera_test_no_attention_{}.gguf", std::process::id()));
    tessera_models::synth::synthesize(&config, DType::F32, 7, &path, None).unwrap();
    let f = GgufFile::open(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    let mut be = CpuBackend::new();
    let mut m = Model::load(&f, &mut be, opts()).unwrap();
    let first = m.step_greedy(&mut be, &[(0, &tokens(5, 1))]).unwrap();
    let next = m.step_greedy(&mut be, &[(0, &first)]).unwrap();
    assert_eq!((first.len(), next.len()), (1, 1));
}

#[test]
fn projections_are_stacked_once_at_load_and_change_no_logit() {
    use tessera_graph::Backend;
    let buffers = |be: &CpuBackend| be.counters().into_iter().find(|(k, _)| *k == "buffers").map(|(_, v)| v).unwrap();
    for p in PRESETS {
        let f = file(p);
        let mut be = CpuBackend::new();
        let before = buffers(&be);
        let mut m = Model::load(&f, &mut be, opts()).unwrap();
        // block 0 is a DeltaNet block: qkv, z, beta and alpha stacked in that order
        let w = &m.weights;
        let stacked = w.get("blk.0.in_proj.merged").unwrap();
        let parts =
            ["attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha"].map(|n| w.get(&format!("blk.0.{n}.weight")).unwrap());
        let rows: usize = parts.iter().map(|t| t.meta.ne[1]).sum();
        assert_eq!(stacked.meta.ne, [parts[0].meta.ne[0], rows, 1, 1], "{p}");
        let mut at = 0;
        for (name, part) in ["attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha"].iter().zip(&parts) {
            assert_eq!((part.buffer, part.offset), (stacked.buffer, at), "{p} {name}");
            // the windows hold the file's values
            let mut got = vec![0u8; part.meta.nbytes_contiguous()];
            be.read(part.buffer, part.offset, &mut got).unwrap();
            assert_eq!(got, f.tensor_data(&format!("blk.0.{name}.weight")).unwrap(), "{p} {name}");
            at += part.meta.nbytes_contiguous();
        }
        // the attention block's q, k and v too (the last block of these presets is one)
        let last = m.config().unwrap().n_main_layers() - 1;
        assert!(m.weights.contains(&format!("blk.{last}.attn_qkv.merged")), "{p}");
        // the same logits as the weights used one by one, bit for bit (a row's dot product does
        // not depend on the rows beside it)
        let toks = tokens(9, 3);
        let merged = m.step(&mut be, &[(0, &toks)], Logits::All).unwrap();
        let (mut plain, mut be2) = load(p, ModelOptions { merge_projections: false, ..opts() });
        assert!(!plain.weights.contains("blk.0.in_proj.merged"));
        assert_eq!(merged, plain.step(&mut be2, &[(0, &toks)], Logits::All).unwrap(), "{p}");
        // each buffer is freed once
        m.free(&mut be);
        assert_eq!(buffers(&be), before, "{p}");
        plain.free(&mut be2);
    }
}

#[test]
fn the_shared_expert_is_routed_as_one_more_slot_and_changes_no_logit_beyond_rounding() {
    use tessera_graph::Backend;
    let f = file("tiny-moe");
    let (mut m, mut be) = load("tiny-moe", opts());
    let w = &m.weights;
    // experts 0..8 routed, 8 the shared one; the router's 8 rows and the shared gate's
    for (p, shexp) in ["gate", "up", "down"].iter().map(|p| (p, format!("blk.0.ffn_{p}_shexp.weight"))) {
        let stacked = w.get(&format!("blk.0.ffn_{p}_exps.merged")).unwrap();
        let exps = w.get(&format!("blk.0.ffn_{p}_exps.weight")).unwrap();
        let shared = w.get(&shexp).unwrap();
        assert_eq!(stacked.meta.ne, [exps.meta.ne[0], exps.meta.ne[1], 9, 1], "{p}");
        assert_eq!((shared.buffer, shared.offset), (stacked.buffer, exps.meta.nbytes_contiguous()), "{p}");
        let mut got = vec![0u8; shared.meta.nbytes_contiguous()];
        be.read(shared.buffer, shared.offset, &mut got).unwrap();
        assert_eq!(got, f.tensor_data(&shexp).unwrap(), "{p}: the window holds the file's values");
    }
    // 8 router rows and the shared gate's, padded to a multiple of 4 rows (float4 logit rows)
    assert_eq!(w.get("blk.0.ffn_gate_inp.merged").unwrap().meta.ne, [64, 12, 1, 1]);
    // the same logits as the shared expert run on its own, within f32 rounding (its output is
    // summed with the routed experts' in another order)
    let toks = tokens(9, 5);
    let routed = m.step(&mut be, &[(0, &toks)], Logits::All).unwrap().remove(0);
    let (mut own, mut be2) = load("tiny-moe", ModelOptions { route_shared_expert: 0, ..opts() });
    assert!(!own.weights.contains("blk.0.ffn_gate_exps.merged"));
    let want = own.step(&mut be2, &[(0, &toks)], Logits::All).unwrap().remove(0);
    let num: f64 = routed.iter().zip(&want).map(|(&x, &y)| (x as f64 - y as f64).powi(2)).sum();
    let den: f64 = want.iter().map(|&y| (y as f64).powi(2)).sum();
    assert!(num / den < 1e-10, "nmse {:e}", num / den);
    // a step longer than the limit runs the shared expert on its own, over the stacked weights'
    // windows: the unrouted logits bit for bit
    let (mut long, mut be3) = load("tiny-moe", ModelOptions { route_shared_expert: 4, ..opts() });
    assert!(long.weights.contains("blk.0.ffn_gate_exps.merged"));
    assert_eq!(long.step(&mut be3, &[(0, &toks)], Logits::All).unwrap().remove(0), want);
    m.free(&mut be);
    own.free(&mut be2);
    long.free(&mut be3);
}
