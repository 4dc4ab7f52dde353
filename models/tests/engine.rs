//! The generation engine on a synthetic `tiny-moe` checkpoint (f32 weights) on the CPU backend:
//! agreement with hand-driven `Model::step`, chunked prefill beside decoding, cache hygiene over
//! many requests, seeded sampling, and errors.

use std::collections::BTreeMap;

use tessera_cpu::CpuBackend;
use tessera_models::config::LayerKind;
use tessera_models::engine::{Engine, EngineConfig, EngineError, Event, Finish};
use tessera_models::gguf::GgufFile;
use tessera_models::model::{Logits, Model, ModelOptions};
use tessera_models::sample::{SampleError, SamplerParams, argmax};
use tessera_ops::DType;

mod synth_file;
use synth_file::synth_file;

fn file() -> GgufFile {
    synth_file("tiny-moe", DType::F32, 42)
}

/// f32 KV: the recorded logits are compared with one pass over the same tokens, and f16 KV rows
/// written by chunks of other sizes move logits by up to about 1e-3.
fn opts() -> ModelOptions {
    ModelOptions { kv_blocks: 32, block_size: 4, max_context: 64, kv_dtype: DType::F32, ..ModelOptions::default() }
}

fn engine(budget: usize) -> Engine {
    let mut be = CpuBackend::new();
    let m = Model::load(&file(), &mut be, opts()).unwrap();
    Engine::new(m, Box::new(be), EngineConfig { max_tokens_per_step: budget }).unwrap()
}

fn tokens(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed * 97)) % 256).collect()
}

/// Greedy tokens by driving `Model::step` by hand: whole prompt, then one token at a time.
fn manual_greedy(prompt: &[u32], n: usize) -> Vec<u32> {
    let mut be = CpuBackend::new();
    let mut m = Model::load(&file(), &mut be, opts()).unwrap();
    let mut logits = m.step(&mut be, &[(7, prompt)], Logits::Last).unwrap().remove(0);
    let mut out = Vec::new();
    loop {
        let t = argmax(&logits).unwrap();
        out.push(t);
        if out.len() == n {
            break;
        }
        logits = m.step(&mut be, &[(7, &[t])], Logits::Last).unwrap().remove(0);
    }
    m.free(&mut be);
    out
}

fn alone(prompt: &[u32], n: usize, params: SamplerParams) -> Vec<u32> {
    let mut e = engine(64);
    let id = e.submit(prompt, n, params).unwrap();
    e.run_to_completion().unwrap().remove(&id).unwrap()
}

#[test]
fn greedy_matches_manual_model_steps() {
    let prompt = tokens(9, 1);
    let want = manual_greedy(&prompt, 6);
    let mut e = engine(64);
    let id = e.submit(&prompt, 6, SamplerParams::greedy()).unwrap();
    let mut events = Vec::new();
    while !e.is_idle() {
        events.extend(e.step().unwrap());
    }
    let got: Vec<u32> =
        events.iter().filter_map(|ev| if let Event::Token { token, .. } = ev { Some(*token) } else { None }).collect();
    assert_eq!(got, want);
    assert_eq!(events.last(), Some(&Event::Finished { seq: id, reason: Finish::Length }));
    assert_eq!(e.stats().generated, 6);
    assert_eq!(e.stats().prefill_tokens, 9);
    assert_eq!(e.stats().decode_tokens, 5);
}

#[test]
fn long_prompt_is_chunked_beside_decoding() {
    let short = tokens(3, 2);
    let long = tokens(40, 3);
    let want_short = alone(&short, 10, SamplerParams::greedy());
    let want_long = alone(&long, 4, SamplerParams::greedy());

    let mut e = engine(8);
    let a = e.submit(&short, 10, SamplerParams::greedy()).unwrap();
    // Step 1 prefills the short prompt alone and samples its first token.
    let ev = e.step().unwrap();
    assert!(matches!(ev.as_slice(), [Event::Token { seq, .. }] if *seq == a));
    let b = e.submit(&long, 4, SamplerParams::greedy()).unwrap();
    let mut got: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
    if let [Event::Token { seq, token }] = ev.as_slice() {
        got.entry(*seq).or_default().push(*token);
    }
    // While the long prompt is chunked (7 tokens a step beside 1 decode token), the short
    // sequence gets a token every step.
    let mut steps_with_long_prefill = 0;
    while !e.is_idle() {
        let long_before = e.model().seq_len(b).unwrap_or(0);
        let ev = e.step().unwrap();
        let long_after = e.model().seq_len(b).unwrap_or(usize::MAX);
        let short_tokens = ev.iter().filter(|x| matches!(x, Event::Token { seq, .. } if *seq == a)).count();
        if long_after != usize::MAX && long_after > long_before && long_after <= long.len() && got[&a].len() < 10 {
            steps_with_long_prefill += 1;
            assert_eq!(short_tokens, 1, "the short sequence decodes while the long prompt is prefilled");
            assert!(long_after - long_before <= 7);
        }
        for x in ev {
            if let Event::Token { seq, token } = x {
                got.entry(seq).or_default().push(token);
            }
        }
    }
    assert!(steps_with_long_prefill >= 5, "{steps_with_long_prefill}");
    assert_eq!(got[&a], want_short);
    assert_eq!(got[&b], want_long);
}

#[test]
fn many_requests_leave_the_caches_empty() {
    let mut e = engine(64);
    let t0 = std::time::Instant::now();
    for i in 0..1000u32 {
        let prompt = tokens(1 + (i as usize % 3), i);
        let id = e.submit(&prompt, 1 + (i as usize % 2), SamplerParams::greedy()).unwrap();
        let out = e.run_to_completion().unwrap();
        assert_eq!(out[&id].len(), 1 + (i as usize % 2));
        assert_eq!(e.model().kv.used_blocks(), 0);
        assert_eq!(e.model().recurrent.used_slots(), 0);
    }
    // And a cancelled running sequence returns its space too.
    let id = e.submit(&tokens(5, 1), 8, SamplerParams::greedy()).unwrap();
    e.step().unwrap();
    assert!(e.model().kv.used_blocks() > 0);
    e.cancel(id).unwrap();
    assert_eq!(e.model().kv.used_blocks(), 0);
    assert_eq!(e.model().recurrent.used_slots(), 0);
    assert_eq!(e.model().kv.n_sequences(), 0);
    e.model().kv.check_invariants().unwrap();
    e.model().recurrent.check_invariants().unwrap();
    eprintln!("1000 cycles in {:?}", t0.elapsed());
}

#[test]
fn more_sequences_than_slots_queue_and_match() {
    let prompts: Vec<Vec<u32>> = (0..6).map(|i| tokens(2 + i * 3, i as u32 + 10)).collect();
    let mut e = engine(16);
    let ids: Vec<u32> = prompts.iter().map(|p| e.submit(p, 3, SamplerParams::greedy()).unwrap()).collect();
    let out = e.run_to_completion().unwrap();
    for (p, id) in prompts.iter().zip(ids) {
        assert_eq!(out[&id], alone(p, 3, SamplerParams::greedy()));
    }
    assert_eq!(e.model().kv.used_blocks(), 0);
}

/// Eight prompts batched in one engine, sequence `i` seeded `base + i`, at `temperature` with
/// top-p 0.9.
fn sampled_streams(temperature: f32, base: u64) -> Vec<Vec<u32>> {
    sampled_streams_with(temperature, base, false)
}

/// [`sampled_streams`]; with `host`, every fed token's logits are recorded, so the engine samples
/// on the host from the logits instead of in the step graph.
fn sampled_streams_with(temperature: f32, base: u64, host: bool) -> Vec<Vec<u32>> {
    let mut e = engine(64);
    e.record_logits(host);
    let ids: Vec<u32> = (0..8u32)
        .map(|i| {
            let p = SamplerParams { temperature, top_k: None, top_p: 0.9, seed: base + i as u64 };
            e.submit(&tokens(6, i + 4), 16, p).unwrap()
        })
        .collect();
    let mut out = e.run_to_completion().unwrap();
    ids.iter().map(|id| out.remove(id).unwrap()).collect()
}

/// At temperature 0.8 the synthetic checkpoint is all but greedy: its logits are sharply peaked
/// (tied embeddings: the last token's own logit leads the next by 10+), so every seed gives the
/// same stream there. The "different seed differs" half therefore runs at temperature 8, where the
/// kept set has several tokens; the sampler's unit tests check seeds at 0.8 on flatter logits.
#[test]
fn seeded_sampling_is_reproducible() {
    let a = sampled_streams(0.8, 1);
    assert_eq!(a, sampled_streams(0.8, 1));
    let p = SamplerParams { temperature: 0.8, top_k: None, top_p: 0.9, seed: 1 };
    assert_eq!(alone(&tokens(6, 4), 16, p), a[0], "alone as in the batch");
    let hot = sampled_streams(8.0, 1);
    assert_eq!(hot, sampled_streams(8.0, 1));
    assert_ne!(hot, sampled_streams(8.0, 1000));
    let p = SamplerParams { temperature: 8.0, top_k: None, top_p: 0.9, seed: 1 };
    assert_eq!(alone(&tokens(6, 4), 16, p), hot[0], "alone as in the batch");
}

/// The step graph's `sample` op and the host `Sampler` pick the same tokens from the same
/// settings, so the device path (no logits recorded) and the host path (logits recorded)
/// generate the same streams, greedy-like and hot.
#[test]
fn sampling_on_the_device_equals_sampling_on_the_host() {
    for t in [0.8, 8.0] {
        assert_eq!(sampled_streams_with(t, 3, false), sampled_streams_with(t, 3, true), "temperature {t}");
    }
}

#[test]
fn errors_are_clear() {
    let mut e = engine(64);
    let err = e.submit(&tokens(70, 1), 1, SamplerParams::greedy()).unwrap_err();
    assert!(matches!(err, EngineError::TooLong { prompt: 70, max: 64, .. }), "{err}");
    assert!(err.to_string().contains("more than the 64 a sequence can hold"), "{err}");
    // Prompt fits but not with the new tokens.
    assert!(matches!(e.submit(&tokens(60, 1), 10, SamplerParams::greedy()), Err(EngineError::TooLong { .. })));
    assert!(matches!(e.submit(&[], 1, SamplerParams::greedy()), Err(EngineError::EmptyPrompt)));
    assert!(matches!(e.submit(&[1], 0, SamplerParams::greedy()), Err(EngineError::NoNewTokens)));
    assert!(matches!(
        e.submit(&[256], 1, SamplerParams::greedy()),
        Err(EngineError::TokenOutOfVocab { token: 256, .. })
    ));
    let bad = SamplerParams { temperature: -1.0, ..SamplerParams::greedy() };
    assert!(matches!(e.submit(&[1], 1, bad), Err(EngineError::Sample(SampleError::Temperature(_)))));
    assert!(e.is_idle());
}

#[test]
fn memory_accounting() {
    let e = engine(64);
    let m = e.memory();
    let c = e.model().config().unwrap();
    let n_attn = (0..c.n_main_layers()).filter(|&il| c.layer_kind(il) == LayerKind::FullAttention).count();
    let elt = e.model().kv.config().dtype.block_bytes();
    assert_eq!(m.kv_bytes_per_token, n_attn * c.n_head_kv * 2 * c.head_dim * elt);
    assert_eq!(m.kv_cache_bytes, m.kv_bytes_per_token * (32 * 4 + 1)); // the cells and the sink
    assert_eq!(m.recurrent_cache_bytes, m.recurrent_bytes_per_sequence * 4);
    assert_eq!(m.total_cache_bytes, m.kv_cache_bytes + m.recurrent_cache_bytes);
    // f32 weights: 4 bytes a parameter.
    assert_eq!(m.weight_bytes, c.n_params() * 4);
    assert!(m.recurrent_bytes_per_sequence > 0);
}

/// With `record_logits` on, the engine keeps the logits of every fed token (prompt chunks and
/// decode tokens, in order) without changing what it generates; they equal one `Model::step` over
/// the same tokens; `take_logits` hands them over once; a finished sequence's id is not reused
/// while its logits are untaken.
#[test]
fn recorded_logits_cover_every_fed_token() {
    let prompts = [tokens(11, 1), tokens(3, 2), tokens(17, 3)];
    let n_new = 5;
    let run = |record: bool| {
        let mut e = engine(6);
        e.record_logits(record);
        let ids: Vec<_> = prompts.iter().map(|p| e.submit(p, n_new, SamplerParams::greedy()).unwrap()).collect();
        let out = e.run_to_completion().unwrap();
        (e, ids, out)
    };
    let (_, _, plain) = run(false);
    let (mut e, ids, recorded) = run(true);
    assert_eq!(plain, recorded, "recording does not change the tokens");
    let n_vocab = e.model().n_vocab();
    // A new sequence does not take an id whose logits are still held.
    let fresh = e.submit(&[1], 1, SamplerParams::greedy()).unwrap();
    assert!(!ids.contains(&fresh), "id {fresh} reused while its logits are untaken");
    e.cancel(fresh).unwrap();
    for (p, id) in prompts.iter().zip(&ids) {
        let logits = e.take_logits(*id);
        let mut fed = p.clone();
        fed.extend(&recorded[id][..n_new - 1]);
        assert_eq!(logits.len(), fed.len() * n_vocab);
        let mut be = CpuBackend::new();
        let mut m = Model::load(&file(), &mut be, opts()).unwrap();
        let alone = m.step(&mut be, &[(0, &fed)], Logits::All).unwrap().remove(0);
        m.free(&mut be);
        let d = logits.iter().zip(&alone).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(d < 1e-3, "recorded logits differ from one pass by {d}");
        assert!(e.take_logits(*id).is_empty(), "taken once");
    }
}

/// A stop token ends a sequence when it generates it: the token is its last, the reason is
/// `Finish::Stop`, and the others run to their length.
#[test]
fn a_stop_token_finishes_its_sequence_early() {
    let prompt = tokens(6, 3);
    let full = alone(&prompt, 12, SamplerParams::greedy());
    let stop = full[4];
    let first = full.iter().position(|&t| t == stop).unwrap();
    let mut e = engine(64);
    e.set_stop_tokens(&[stop]);
    let a = e.submit(&prompt, 12, SamplerParams::greedy()).unwrap();
    let mut tokens_a = Vec::new();
    let mut reason = None;
    while !e.is_idle() {
        for ev in e.step().unwrap() {
            match ev {
                Event::Token { seq, token } if seq == a => tokens_a.push(token),
                Event::Finished { seq, reason: r } if seq == a => reason = Some(r),
                _ => {}
            }
        }
    }
    assert_eq!(tokens_a, full[..=first], "generation stops at the first stop token, which is kept");
    assert_eq!(reason, Some(Finish::Stop));
    assert_eq!(e.model().kv.n_sequences(), 0, "the stopped sequence left the caches");
}
