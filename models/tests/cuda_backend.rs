//! The tiny qwen35 / qwen35moe (and, where [`F32_PRESETS`] lists them, qwen3 / qwen3moe) models on
//! the CUDA backend against the CPU oracle: logits of a
//! prompt within a stated bound, greedy streams of 32 tokens identical with f32 weights, a batch
//! of sequences equal to each alone, CUDA-graph replay bit-identical to eager execution, and
//! decode of 1-4 sequences over quantized weights the ring GEMVs take. Skips with a message when
//! no GPU is usable.

use tessera_cpu::CpuBackend;
use tessera_cuda::{CudaBackend, CudaOptions};
use tessera_graph::Backend;
use tessera_models::config::ModelConfig;
use tessera_models::gguf::GgufFile;
use tessera_models::model::{Logits, Model, ModelOptions};
use tessera_ops::DType;

mod synth_file;
use synth_file::synth_file;

fn gpu(graphs: bool) -> Option<CudaBackend> {
    match CudaBackend::with_options(CudaOptions { graphs, ..CudaOptions::default() }) {
        Ok(b) => Some(b),
        Err(e) => {
            eprintln!("skipping: {e}");
            None
        }
    }
}

fn file(preset: &str, dtype: DType) -> GgufFile {
    synth_file(preset, dtype, 42)
}

fn opts() -> ModelOptions {
    ModelOptions { kv_blocks: 64, block_size: 16, max_context: 256, kv_dtype: DType::F32, ..ModelOptions::default() }
}

fn tokens(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed * 97)) % 256).collect()
}

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// The prompt's logits (every position) and a greedy continuation of `n` tokens.
fn prompt_and_greedy(m: &mut Model, be: &mut dyn Backend, prompt: &[u32], n: usize) -> (Vec<f32>, Vec<u32>) {
    let all = m.step(be, &[(0, prompt)], Logits::All).unwrap().remove(0);
    let v = m.n_vocab();
    let mut next = argmax(&all[all.len() - v..]);
    let mut stream = vec![next];
    while stream.len() < n {
        let l = m.step(be, &[(0, &[next])], Logits::Last).unwrap().remove(0);
        next = argmax(&l);
        stream.push(next);
    }
    (all, stream)
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

fn nmse(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(&x, &y)| (x as f64 - y as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|&y| (y as f64).powi(2)).sum();
    num / den.max(f64::MIN_POSITIVE)
}

/// The presets of the f32 and batch/replay checks: both families.
const F32_PRESETS: [&str; 4] = ["tiny", "tiny-moe", "qwen3-tiny", "qwen3moe-tiny"];

#[test]
fn f32_models_match_the_cpu_and_greedy_streams_are_identical() {
    let Some(mut cuda) = gpu(true) else { return };
    for preset in F32_PRESETS {
        let f = file(preset, DType::F32);
        let prompt = tokens(24, 1);
        let mut cpu = CpuBackend::new();
        let mut mc = Model::load(&f, &mut cpu, opts()).unwrap();
        let (want, want_stream) = prompt_and_greedy(&mut mc, &mut cpu, &prompt, 32);
        let mut mg = Model::load(&f, &mut cuda, opts()).unwrap();
        let (got, got_stream) = prompt_and_greedy(&mut mg, &mut cuda, &prompt, 32);
        mg.free(&mut cuda);
        let (d, e) = (max_abs_diff(&got, &want), nmse(&got, &want));
        eprintln!("{preset} f32: prompt logits max |cuda - cpu| = {d:.3e}, nmse = {e:.3e}");
        assert!(e <= 1e-9 && d <= 1e-3, "{preset}: max |diff| {d:e}, nmse {e:e}");
        assert_eq!(got_stream, want_stream, "{preset}: greedy streams differ");
    }
    let st = cuda.stats();
    eprintln!("graphs: {:?}; pool: {:?}", st.graphs, st.pool);
    // Decode steps share one structure (one more KV cell each): after the first capture they are
    // updated into the executable graph, not re-instantiated.
    assert!(st.graphs.updates + st.graphs.replays > st.graphs.captures, "{:?}", st.graphs);
}

#[test]
fn with_a_padded_kv_length_decode_steps_replay_one_graph() {
    let Some(mut cuda) = gpu(true) else { return };
    let f = file("tiny-moe", DType::F32);
    let prompt = tokens(20, 6);
    let mut cpu = CpuBackend::new();
    let mut mc = Model::load(&f, &mut cpu, opts()).unwrap();
    let (_, want) = prompt_and_greedy(&mut mc, &mut cpu, &prompt, 40);
    let padded = ModelOptions { kv_pad: 64, ..opts() };
    let mut mg = Model::load(&f, &mut cuda, padded).unwrap();
    let before = cuda.stats().graphs;
    let (_, got) = prompt_and_greedy(&mut mg, &mut cuda, &prompt, 40);
    mg.free(&mut cuda);
    let st = cuda.stats().graphs;
    let (replays, captures, updates) =
        (st.replays - before.replays, st.captures - before.captures, st.updates - before.updates);
    eprintln!("40 greedy steps with n_kv padded to 64: {replays} replays, {updates} updates, {captures} captures");
    assert_eq!(got, want, "padding the kv length must not change the tokens");
    // Positions 20..59 fall into two 64-wide shapes at most (prefill and decode share none).
    assert!(replays >= 35, "decode steps should replay their graph: {st:?}");
}

#[test]
fn quantized_models_stay_close_to_the_cpu() {
    let Some(mut cuda) = gpu(true) else { return };
    for preset in ["tiny", "tiny-moe"] {
        for dtype in [DType::BF16, DType::Q8_0, DType::NvFp4] {
            let f = file(preset, dtype);
            let prompt = tokens(16, 2);
            let mut cpu = CpuBackend::new();
            let mut mc = Model::load(&f, &mut cpu, opts()).unwrap();
            let want = mc.step(&mut cpu, &[(0, &prompt)], Logits::All).unwrap().remove(0);
            let mut mg = Model::load(&f, &mut cuda, opts()).unwrap();
            let got = mg.step(&mut cuda, &[(0, &prompt)], Logits::All).unwrap().remove(0);
            mg.free(&mut cuda);
            let e = nmse(&got, &want);
            eprintln!(
                "{preset} {}: prompt logits nmse = {e:.3e}, max |diff| = {:.3e}",
                dtype.name(),
                max_abs_diff(&got, &want)
            );
            // The same weights on both sides. With more than 8 tokens the GPU feeds tensor cores
            // 16-bit activations and the CPU multiplies in f32: bf16 weights go through cuBLAS with
            // bf16 activations (~2^-9 relative per product); q8_0 / nvfp4 weights through mmq with
            // row-scaled f16 activations (~2^-12), which the layers amplify to ~1e-6 at the logits:
            // the half-precision bound (test-ops' 1e-5).
            if dtype != DType::BF16 {
                assert!(e <= 1e-5, "{preset} {}: nmse {e:e}", dtype.name());
                continue;
            }
            // In the MoE a position whose router scores are near a tie can pick another expert
            // under that rounding and then differs a lot; most positions must still agree closely.
            let v = mc.n_vocab();
            let mut per_pos: Vec<f64> = got.chunks(v).zip(want.chunks(v)).map(|(g, w)| nmse(g, w)).collect();
            per_pos.sort_by(f64::total_cmp);
            let median = per_pos[per_pos.len() / 2];
            let off = per_pos.iter().filter(|&&x| x > 2e-4).count();
            eprintln!(
                "{preset} bf16: per-position nmse median {median:.3e}, {off} of {} positions above 2e-4",
                per_pos.len()
            );
            assert!(median <= 2e-4, "{preset} bf16: median per-position nmse {median:e}");
            if preset == "tiny" {
                assert!(e <= 2e-4, "{preset} bf16: nmse {e:e}");
            }
        }
    }
}

#[test]
fn a_batch_equals_each_sequence_alone_and_replay_equals_eager() {
    let (Some(mut graphs), Some(mut eager)) = (gpu(true), gpu(false)) else { return };
    for preset in F32_PRESETS {
        let f = file(preset, DType::F32);
        let seqs = [tokens(9, 3), tokens(9, 4), tokens(9, 5)];
        let mut alone = Vec::new();
        for s in &seqs {
            let mut m = Model::load(&f, &mut graphs, opts()).unwrap();
            alone.push(m.step(&mut graphs, &[(0, s)], Logits::Last).unwrap().remove(0));
            m.free(&mut graphs);
        }
        let mut m = Model::load(&f, &mut graphs, opts()).unwrap();
        let batch: Vec<(u32, &[u32])> = seqs.iter().enumerate().map(|(i, s)| (i as u32, s.as_slice())).collect();
        let together = m.step(&mut graphs, &batch, Logits::Last).unwrap();
        // Decode a few steps with graphs, and the same on an eager backend: bit-identical.
        let mut with_graphs = Vec::new();
        let mut me = Model::load(&f, &mut eager, opts()).unwrap();
        me.step(&mut eager, &batch, Logits::Last).unwrap();
        let mut without = Vec::new();
        for t in 0..4u32 {
            let step: Vec<(u32, Vec<u32>)> = (0..3).map(|i| (i, vec![(t * 7 + i) % 256])).collect();
            let step: Vec<(u32, &[u32])> = step.iter().map(|(i, v)| (*i, v.as_slice())).collect();
            with_graphs.push(m.step(&mut graphs, &step, Logits::Last).unwrap());
            without.push(me.step(&mut eager, &step, Logits::Last).unwrap());
        }
        m.free(&mut graphs);
        me.free(&mut eager);
        for (i, (t, a)) in together.iter().zip(&alone).enumerate() {
            let e = nmse(t, a);
            assert!(e <= 1e-10, "{preset}: sequence {i} batched vs alone nmse {e:e}");
        }
        assert_eq!(with_graphs, without, "{preset}: CUDA graph replay differs from eager execution");
    }
}

/// Decode steps of 1 to 4 sequences over q8_0 / nvfp4 weights whose rows are whole 256-value
/// chunks (tiny-moe widened to 256): the kernels a real model's decode takes at those widths (the
/// ring GEMV for one to four tokens a launch, the routed experts' ring at one token), in captured
/// steps, against the CPU.
#[test]
fn decode_of_one_to_four_sequences_over_ring_shaped_weights_matches_the_cpu() {
    let Some(mut cuda) = gpu(true) else { return };
    let config = ModelConfig::preset("tiny-moe")
        .unwrap()
        .with_overrides(&[
            ("embedding_length", "256"),
            ("expert_feed_forward_length", "256"),
            ("expert_shared_feed_forward_length", "256"),
            ("ssm.state_size", "64"),
            ("ssm.inner_size", "256"),
            ("attention.key_length", "128"),
            ("attention.value_length", "128"),
        ])
        .unwrap();
    for dtype in [DType::Q8_0, DType::NvFp4] {
        let mut cpu = CpuBackend::new();
        let mut mc = Model::synthetic(config.clone(), dtype, 7, &mut cpu, opts()).unwrap();
        let mut mg = Model::synthetic(config.clone(), dtype, 7, &mut cuda, opts()).unwrap();
        let prompts: Vec<Vec<u32>> = (0..4).map(|i| tokens(5, 10 + i)).collect();
        let batch: Vec<(u32, &[u32])> = prompts.iter().enumerate().map(|(i, p)| (i as u32, p.as_slice())).collect();
        mc.step(&mut cpu, &batch, Logits::Last).unwrap();
        mg.step(&mut cuda, &batch, Logits::Last).unwrap();
        for (t, n) in [1u32, 2, 3, 4, 4, 3, 2, 1].into_iter().enumerate() {
            let step: Vec<(u32, Vec<u32>)> = (0..n).map(|i| (i, vec![(t as u32 * 31 + i * 7) % 256])).collect();
            let step: Vec<(u32, &[u32])> = step.iter().map(|(i, v)| (*i, v.as_slice())).collect();
            let want = mc.step(&mut cpu, &step, Logits::Last).unwrap();
            let got = mg.step(&mut cuda, &step, Logits::Last).unwrap();
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let e = nmse(g, w);
                // int16 activations in the ring GEMVs (~5e-10 a product), and f16 ones in the
                // prompt's tensor-core products, which the layers carry into the caches
                assert!(e <= 1e-5, "{}: step {t} ({n} sequences), sequence {i}: nmse {e:e}", dtype.name());
            }
        }
        mc.free(&mut cpu);
        mg.free(&mut cuda);
    }
}

#[test]
fn ops_the_gpu_refuses_run_on_the_cpu_with_the_same_results() {
    // The scheduler's fallback, as a GPU without a kernel for some ops would need it: the CUDA
    // backend made to refuse the router's top_k and every rms_norm, with the CPU behind it.
    let (Some(alone), Some(refusing)) = (gpu(true), gpu(true)) else { return };
    let mut alone = alone;
    let mut first = tessera_graph::Refusing::new(refusing, &["top_k", "rms_norm"]);
    let mut cpu = CpuBackend::new();
    for preset in ["tiny", "tiny-moe"] {
        let f = file(preset, DType::F32);
        let prompt = tokens(24, 3);
        let mut a = Model::load(&f, &mut alone, opts()).unwrap();
        let (want, want_stream) = prompt_and_greedy(&mut a, &mut alone, &prompt, 16);
        a.free(&mut alone);

        let mut m = Model::load(&f, &mut first, opts()).unwrap();
        let v = m.n_vocab();
        let all = m.step_on(&mut [&mut first, &mut cpu], &[(0, &prompt)], Logits::All).unwrap().remove(0);
        let mut next = argmax(&all[all.len() - v..]);
        let mut stream = vec![next];
        while stream.len() < 16 {
            next = m.step_greedy_on(&mut [&mut first, &mut cpu], &[(0, &[next])]).unwrap()[0];
            stream.push(next);
        }
        m.free_on(&mut [&mut first, &mut cpu]);
        let e = nmse(&all, &want);
        eprintln!(
            "{preset}: CUDA + CPU fallback vs CUDA alone: logits NMSE {e:.2e}, max |diff| {}",
            max_abs_diff(&all, &want)
        );
        assert!(e < 1e-10, "{preset}: NMSE {e}");
        assert_eq!(stream, want_stream, "{preset}: greedy streams differ");
    }
    assert_eq!(cpu.allocated(), 0, "the fallback's buffers were freed");
}

/// The backend's `kernel_launches` counter counts what a step runs, replayed or not: a decode step
/// replayed from its CUDA graph counts what the eager step counts, and the fusion passes cut it.
#[test]
fn kernel_launches_count_a_step_replayed_or_eager_and_fall_with_the_passes() {
    let f = file("tiny-moe", DType::F32);
    let launches = |graphs: bool, passes: bool| -> Option<Vec<u64>> {
        let mut cuda = gpu(graphs)?;
        let mut m = Model::load(&f, &mut cuda, ModelOptions { kv_pad: 64, ..opts() }).unwrap();
        m.passes_mut().set_all(passes);
        let count = |b: &CudaBackend| b.counters().into_iter().find(|(k, _)| *k == "kernel_launches").unwrap().1;
        m.step(&mut cuda, &[(0, &tokens(5, 2))], Logits::Last).unwrap();
        let mut per_step = Vec::new();
        for t in 0..3u32 {
            let before = count(&cuda);
            m.step(&mut cuda, &[(0, &[t + 1])], Logits::Last).unwrap();
            per_step.push(count(&cuda) - before);
        }
        m.free(&mut cuda);
        Some(per_step)
    };
    let Some(replayed) = launches(true, true) else { return };
    let eager = launches(false, true).unwrap();
    let unfused = launches(false, false).unwrap();
    eprintln!("kernel launches a decode step: {replayed:?} replayed, {eager:?} eager, {unfused:?} without the passes");
    assert!(eager.iter().all(|&n| n > 0 && n == eager[0]), "{eager:?}");
    assert_eq!(replayed, eager);
    assert!(unfused[0] > eager[0], "{unfused:?} vs {eager:?}");
}
