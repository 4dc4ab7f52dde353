//! `tessera demo`: a tiny `qwen35moe` built in memory, three prompts of different lengths batched
//! through chunked prefill and decode by the engine, with a self-check against each sequence run
//! alone.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use tessera_cpu::CpuBackend;
use tessera_models::config::ModelConfig;
use tessera_models::engine::{Engine, EngineConfig, Event};
use tessera_models::gguf::GgufFile;
use tessera_models::qwen35::{Model, ModelOptions};
use tessera_models::sample::SamplerParams;
use tessera_models::synth::synthesize;
use tessera_ops::DType;

use crate::run::{print_memory, print_speed};

/// Prompt lengths of the three sequences.
const PROMPT_LENS: [usize; 3] = [5, 23, 61];
/// Tokens generated per sequence.
const N_NEW: usize = 12;
/// The engine's per-step token budget: small, so the long prompts are chunked beside decoding.
const BUDGET: usize = 16;

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
pub fn run() -> Result<(), String> {
    let config = ModelConfig::preset("tiny-moe").map_err(|e| e.to_string())?;
    let path = TempFile(std::env::temp_dir().join(format!("tessera_demo_{}.gguf", std::process::id())));
    let t0 = Instant::now();
    synthesize(&config, DType::F32, 1, &path.0, None).map_err(|e| e.to_string())?;
    let gguf = GgufFile::open(&path.0).map_err(|e| e.to_string())?;
    let mut backend = CpuBackend::new();
    let model = Model::load(&gguf, &mut backend, ModelOptions::default()).map_err(|e| e.to_string())?;
    println!("backend: cpu (no other backend built; nothing to check against the CPU oracle)");
    println!("model: synthetic tiny-moe, f32 weights, seed 1, built in {:.1} ms", t0.elapsed().as_secs_f64() * 1e3);
    println!("model: {}", model.config);
    let mut engine = Engine::new(model, Box::new(backend), EngineConfig { max_tokens_per_step: BUDGET })
        .map_err(|e| e.to_string())?;
    print_memory(&engine.memory());

    let prompts: Vec<Vec<u32>> =
        PROMPT_LENS.iter().enumerate().map(|(i, &n)| prompt(n, i as u32 + 1, config.n_vocab)).collect();
    println!(
        "batched run: {} sequences, prompts of {:?} tokens, {N_NEW} new tokens each (greedy), at most {BUDGET} tokens a step",
        prompts.len(),
        PROMPT_LENS
    );
    let mut ids = Vec::new();
    for p in &prompts {
        ids.push(engine.submit(p, N_NEW, SamplerParams::greedy()).map_err(|e| e.to_string())?);
    }
    let t1 = Instant::now();
    let mut batched: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
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
                batched.entry(seq).or_default().push(token);
            }
        }
    }
    let wall = t1.elapsed().as_secs_f64();
    let stats = *engine.stats();
    println!("steps: {steps} ({mixed_steps} fed prompt chunks beside decode tokens)");
    for (id, p) in ids.iter().zip(&prompts) {
        let toks = batched.get(id).map(Vec::as_slice).unwrap_or(&[]);
        println!("seq {id}: prompt {} tokens -> {}", p.len(), join(toks));
    }
    println!(
        "tokens generated: {} in {:.2} ms ({:.1} tokens/s generated, {:.1} tokens/s fed)",
        stats.generated,
        wall * 1e3,
        stats.generated as f64 / wall,
        (stats.prefill_tokens + stats.decode_tokens) as f64 / wall
    );
    print_speed(&stats);

    // Self-check: each sequence alone (fresh ids on the same, now idle, engine).
    let mut ok = true;
    for (id, p) in ids.iter().zip(&prompts) {
        let solo = engine.submit(p, N_NEW, SamplerParams::greedy()).map_err(|e| e.to_string())?;
        let mut out = engine.run_to_completion().map_err(|e| e.to_string())?;
        let alone = out.remove(&solo).unwrap_or_default();
        if batched.get(id) != Some(&alone) {
            ok = false;
            println!("self-check: seq {id} alone gave {} (batched {:?})", join(&alone), batched.get(id));
        }
    }
    let kv_used = engine.model().kv.used_blocks();
    let slots_used = engine.model().recurrent.used_slots();
    println!("caches after the run: {kv_used} kv blocks, {slots_used} recurrent slots in use");
    if !ok || kv_used != 0 || slots_used != 0 {
        return Err(
            "self-check failed: batched tokens differ from each sequence run alone, or cache space leaked".into()
        );
    }
    println!("self-check: batched tokens equal each sequence run alone: ok");
    Ok(())
}

fn join(t: &[u32]) -> String {
    t.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}
