//! `tessera demo`: a tiny `qwen35moe` built in memory, three prompts of different lengths batched
//! through chunked prefill and decode by the engine on the best backend present, with a
//! self-check against each sequence run alone and, when that backend is not the CPU, against the
//! CPU oracle (the same batched run on the CPU: identical greedy tokens, logits within a bound).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use tessera_cpu::CpuBackend;
use tessera_graph::Backend;
use tessera_models::config::ModelConfig;
use tessera_models::engine::{Engine, EngineConfig, Event};
use tessera_models::gguf::GgufFile;
use tessera_models::model::{Model, ModelOptions};
use tessera_models::sample::SamplerParams;
use tessera_models::synth::synthesize;
use tessera_ops::DType;

use crate::backend::{self, BackendChoice};
use crate::run::{print_memory, print_speed};

/// Prompt lengths of the three sequences.
const PROMPT_LENS: [usize; 3] = [5, 23, 61];
/// Tokens generated per sequence.
const N_NEW: usize = 12;
/// The engine's per-step token budget: small, so the long prompts are chunked beside decoding.
const BUDGET: usize = 16;
/// Largest |logit| difference from the CPU oracle accepted for another backend. The weights are
/// f32 but the KV cache is f16 (the default): K/V values that differ in their last f32 bit
/// between backends (another summation order) can round to neighbouring f16 values, a 2^-11
/// relative step; measured 1.4e-3 on an H200 (4.7e-5 with an f32 cache, see
/// models/tests/cuda_backend.rs).
const ORACLE_BOUND: f32 = 5e-3;

/// Removes the temporary checkpoint when the demo ends, however it ends.
struct TempFile(PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn prompt(len: usize, salt: u32, n_vocab: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(salt * 7919) as usize % n_vocab) as u32)
        .collect()
}

/// Runs the demo; `Err` on any failure, including a failed self-check.
pub fn run(choice: BackendChoice) -> Result<(), String> {
    let config = ModelConfig::preset("tiny-moe").map_err(|e| e.to_string())?;
    let path = TempFile(std::env::temp_dir().join(format!("tessera_demo_{}.gguf", std::process::id())));
    let t0 = Instant::now();
    synthesize(&config, DType::F32, 1, &path.0, None).map_err(|e| e.to_string())?;
    let gguf = GgufFile::open(&path.0).map_err(|e| e.to_string())?;
    let opened = backend::open(choice)?;
    let on_cpu = opened.backend.name() == "cpu";
    outln!("backend: {}", opened.description);
    outln!("model: synthetic tiny-moe, f32 weights, seed 1, built in {:.1} ms", t0.elapsed().as_secs_f64() * 1e3);
    let prompts: Vec<Vec<u32>> =
        PROMPT_LENS.iter().enumerate().map(|(i, &n)| prompt(n, i as u32 + 1, config.n_vocab)).collect();
    let mut main = BatchedRun::new(&gguf, opened.backend, opened.kv_pad, true)?;
    main.run(&prompts, true)?;
    main.self_check_alone(&prompts)?;
    if on_cpu {
        outln!("oracle check: skipped (the demo ran on the CPU oracle itself)");
        return Ok(());
    }
    let mut oracle = BatchedRun::new(&gguf, Box::new(CpuBackend::new()), 1, false)?;
    oracle.run(&prompts, false)?;
    let mut worst = 0f32;
    for (seq, tokens) in &main.tokens {
        let logits = main.logits.get(seq).map(Vec::as_slice).unwrap_or(&[]);
        let want_tokens = oracle.tokens.get(seq).map(Vec::as_slice).unwrap_or(&[]);
        let want_logits = oracle.logits.get(seq).map(Vec::as_slice).unwrap_or(&[]);
        if tokens.as_slice() != want_tokens {
            return Err(format!(
                "oracle check failed: seq {seq} gave {} on {}, {} on the cpu",
                join(tokens),
                main.backend,
                join(want_tokens)
            ));
        }
        if logits.len() != want_logits.len() {
            return Err(format!(
                "oracle check failed: seq {seq} recorded {} logits, the cpu {}",
                logits.len(),
                want_logits.len()
            ));
        }
        worst = logits.iter().zip(want_logits).map(|(a, b)| (a - b).abs()).fold(worst, f32::max);
    }
    outln!(
        "oracle check: {} tokens identical to the cpu's; logits of every fed position within {worst:.2e} of the cpu's (bound {ORACLE_BOUND:.0e}): {}",
        main.backend,
        if worst <= ORACLE_BOUND { "ok" } else { "FAILED" }
    );
    if worst > ORACLE_BOUND {
        return Err(format!("oracle check failed: logits differ from the cpu's by {worst:e}"));
    }
    Ok(())
}

/// One engine on one backend, with the tokens and logits of its batched run per sequence.
struct BatchedRun {
    engine: Engine,
    backend: String,
    ids: Vec<u32>,
    tokens: BTreeMap<u32, Vec<u32>>,
    logits: BTreeMap<u32, Vec<f32>>,
}

impl BatchedRun {
    fn new(gguf: &GgufFile, mut backend: Box<dyn Backend>, kv_pad: usize, verbose: bool) -> Result<BatchedRun, String> {
        let opts = ModelOptions { kv_pad, ..ModelOptions::default() };
        let model = Model::load(gguf, backend.as_mut(), opts).map_err(|e| e.to_string())?;
        if verbose {
            match model.config() {
                Some(c) => outln!("model: {c}"),
                None => outln!("model: {}", model.arch().name()),
            }
        }
        let name = backend.name().to_string();
        let engine =
            Engine::new(model, backend, EngineConfig { max_tokens_per_step: BUDGET }).map_err(|e| e.to_string())?;
        if verbose {
            print_memory(&engine.memory());
        }
        Ok(BatchedRun { engine, backend: name, ids: Vec::new(), tokens: BTreeMap::new(), logits: BTreeMap::new() })
    }

    /// The three prompts batched, greedy, logits recorded.
    fn run(&mut self, prompts: &[Vec<u32>], verbose: bool) -> Result<(), String> {
        let engine = &mut self.engine;
        engine.record_logits(true);
        if verbose {
            outln!(
                "batched run: {} sequences, prompts of {:?} tokens, {N_NEW} new tokens each (greedy), at most {BUDGET} tokens a step",
                prompts.len(),
                PROMPT_LENS
            );
        }
        for p in prompts {
            self.ids.push(engine.submit(p, N_NEW, SamplerParams::greedy()).map_err(|e| e.to_string())?);
        }
        let t1 = Instant::now();
        let (mut steps, mut mixed_steps) = (0, 0);
        while !engine.is_idle() {
            let decoding_before = engine.stats().decode_tokens;
            let prefill_before = engine.stats().prefill_tokens;
            let events = engine.step().map_err(|e| e.to_string())?;
            steps += 1;
            if engine.stats().decode_tokens > decoding_before && engine.stats().prefill_tokens > prefill_before {
                mixed_steps += 1;
            }
            for e in events {
                if let Event::Token { seq, token } = e {
                    self.tokens.entry(seq).or_default().push(token);
                }
            }
        }
        let wall = t1.elapsed().as_secs_f64();
        for id in &self.ids {
            self.logits.insert(*id, engine.take_logits(*id));
        }
        engine.record_logits(false);
        if !verbose {
            return Ok(());
        }
        let stats = *engine.stats();
        outln!("steps: {steps} ({mixed_steps} fed prompt chunks beside decode tokens)");
        for (id, p) in self.ids.iter().zip(prompts) {
            let toks = self.tokens.get(id).map(Vec::as_slice).unwrap_or(&[]);
            outln!("seq {id}: prompt {} tokens -> {}", p.len(), join(toks));
        }
        outln!(
            "tokens generated: {} in {:.2} ms ({:.1} tokens/s generated, {:.1} tokens/s fed)",
            stats.generated,
            wall * 1e3,
            stats.generated as f64 / wall,
            (stats.prefill_tokens + stats.decode_tokens) as f64 / wall
        );
        print_speed(&stats);
        Ok(())
    }

    /// Self-check: each sequence alone (fresh ids on the same, now idle, engine) gives the
    /// batched tokens, and no cache space leaks.
    fn self_check_alone(&mut self, prompts: &[Vec<u32>]) -> Result<(), String> {
        let engine = &mut self.engine;
        let mut ok = true;
        for (id, p) in self.ids.iter().zip(prompts) {
            let solo = engine.submit(p, N_NEW, SamplerParams::greedy()).map_err(|e| e.to_string())?;
            let mut out = engine.run_to_completion().map_err(|e| e.to_string())?;
            let alone = out.remove(&solo).unwrap_or_default();
            if self.tokens.get(id) != Some(&alone) {
                ok = false;
                outln!("self-check: seq {id} alone gave {} (batched {:?})", join(&alone), self.tokens.get(id));
            }
        }
        let kv_used = engine.model().kv.used_blocks();
        let slots_used = engine.model().recurrent.used_slots();
        outln!("caches after the run: {kv_used} kv blocks, {slots_used} recurrent slots in use");
        if !ok || kv_used != 0 || slots_used != 0 {
            return Err(
                "self-check failed: batched tokens differ from each sequence run alone, or cache space leaked".into()
            );
        }
        outln!("self-check: batched tokens equal each sequence run alone: ok");
        Ok(())
    }
}

fn join(t: &[u32]) -> String {
    t.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}
