//! Planned step graphs: the memory planner's verifier on the real `qwen35` / `qwen35moe` step
//! graphs, and the model's cache of planned graphs (reused by shape, evicted beyond its
//! capacity) giving the same logits as building every step afresh.

use tessera_cpu::CpuBackend;
use tessera_graph::plan::{Plan, PlanOptions, verify};
use tessera_models::gguf::GgufFile;
use tessera_models::model::{Bucket, Logits, Model, ModelOptions};
use tessera_ops::DType;

mod synth_file;
use synth_file::synth_file;

fn file(preset: &str) -> GgufFile {
    synth_file(preset, DType::F32, 3)
}

fn opts(step_graphs: usize, kv_pad: usize) -> ModelOptions {
    ModelOptions {
        kv_blocks: 64,
        block_size: 4,
        max_context: 96,
        n_slots: 4,
        kv_pad,
        step_graphs,
        ..Default::default()
    }
}

#[test]
fn model_step_graphs_pass_the_planner_verifier() {
    for preset in ["tiny", "tiny-moe"] {
        let f = file(preset);
        let mut be = CpuBackend::new();
        let mut m = Model::load(&f, &mut be, opts(8, 1)).unwrap();
        for (n_tokens, n_seq, n_kv, all_logits) in
            [(1, 1, 8, false), (1, 4, 32, false), (64, 1, 64, false), (7, 3, 16, true), (16, 2, 48, false)]
        {
            let bucket = Bucket { n_tokens, n_seq, n_kv, all_logits, sample: false };
            let (g, _) = m.step_graph(bucket).unwrap();
            let plan = Plan::new(&g, PlanOptions::default());
            verify(&g, &plan, 1.25).unwrap_or_else(|why| panic!("{preset} {bucket:?}: {why}"));
            let s = plan.stats;
            assert!(s.arena_bytes < s.unshared_bytes / 4, "{preset} {bucket:?}: {s:?}");
        }
        m.free(&mut be);
    }
}

/// Greedy continuation of three sequences of different lengths, stepping them apart and
/// together so shapes change from step to step.
fn generate(m: &mut Model, be: &mut CpuBackend) -> Vec<Vec<f32>> {
    let prompts: [&[u32]; 3] = [&[1, 2, 3, 4, 5], &[9, 8], &[7, 7, 7, 7, 7, 7, 7, 7, 7]];
    let mut out = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        out.extend(m.step(be, &[(i as u32, p)], Logits::Last).unwrap());
    }
    let mut last: Vec<u32> = out.iter().map(|l| tessera_models::sample::argmax(l).unwrap()).collect();
    for step in 0..12 {
        // every third step the first sequence runs alone, else all three together
        let ids: Vec<u32> = if step % 3 == 0 { vec![0] } else { vec![0, 1, 2] };
        let toks: Vec<[u32; 1]> = ids.iter().map(|&i| [last[i as usize]]).collect();
        let batch: Vec<(u32, &[u32])> = ids.iter().zip(&toks).map(|(&i, t)| (i, &t[..])).collect();
        let logits = m.step(be, &batch, Logits::Last).unwrap();
        for (&i, l) in ids.iter().zip(&logits) {
            last[i as usize] = tessera_models::sample::argmax(l).unwrap();
        }
        out.extend(logits);
    }
    out
}

#[test]
fn cached_step_graphs_give_the_logits_of_fresh_ones() {
    let f = file("tiny-moe");
    let mut be = CpuBackend::new();
    // capacity 1: every change of shape evicts and rebuilds; kv_pad 8: decode shapes repeat
    let mut fresh = Model::load(&f, &mut be, opts(1, 8)).unwrap();
    let a = generate(&mut fresh, &mut be);
    let fs = fresh.step_cache_stats();
    fresh.free(&mut be);
    let mut cached = Model::load(&f, &mut be, opts(8, 8)).unwrap();
    let b = generate(&mut cached, &mut be);
    let cs = cached.step_cache_stats();
    cached.free(&mut be);
    assert_eq!(a, b, "reusing planned step graphs changed the logits");
    assert!(cs.reused > fs.reused && cs.built < fs.built, "fresh {fs:?}, cached {cs:?}");
    assert!(fs.evicted > 0 && cs.evicted == 0, "fresh {fs:?}, cached {cs:?}");
    assert_eq!(cs.built + cs.reused, fs.built + fs.reused);
    // everything the model allocated, weights, caches and planned graphs, was freed
    assert_eq!(be.allocated(), 0);
}

#[test]
fn padding_the_kv_length_changes_no_logit() {
    let f = file("tiny");
    let mut be = CpuBackend::new();
    let mut exact = Model::load(&f, &mut be, opts(8, 1)).unwrap();
    let a = generate(&mut exact, &mut be);
    exact.free(&mut be);
    let mut padded = Model::load(&f, &mut be, opts(8, 32)).unwrap();
    let b = generate(&mut padded, &mut be);
    padded.free(&mut be);
    for (x, y) in a.iter().zip(&b) {
        let err = x.iter().zip(y).map(|(p, q)| (p - q).abs()).fold(0f32, f32::max);
        assert!(err < 1e-5, "masked KV padding moved a logit by {err}");
    }
}

#[test]
fn greedy_steps_on_the_device_pick_the_argmax_of_the_logits() {
    let f = file("tiny-moe");
    let mut be = CpuBackend::new();
    let mut a = Model::load(&f, &mut be, opts(8, 8)).unwrap();
    let mut b = Model::load(&f, &mut be, opts(8, 8)).unwrap();
    let prompts: [&[u32]; 2] = [&[5, 6, 7], &[1, 1, 2, 3, 5, 8, 13]];
    let mut last = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let l = a.step(&mut be, &[(i as u32, p)], Logits::Last).unwrap().remove(0);
        let t = b.step_greedy(&mut be, &[(i as u32, p)]).unwrap()[0];
        assert_eq!(t, tessera_models::sample::argmax(&l).unwrap());
        last.push(t);
    }
    for _ in 0..10 {
        let toks: Vec<[u32; 1]> = last.iter().map(|&t| [t]).collect();
        let batch: Vec<(u32, &[u32])> = toks.iter().enumerate().map(|(i, t)| (i as u32, &t[..])).collect();
        let logits = a.step(&mut be, &batch, Logits::Last).unwrap();
        let tokens = b.step_greedy(&mut be, &batch).unwrap();
        for (l, &t) in logits.iter().zip(&tokens) {
            assert_eq!(t, tessera_models::sample::argmax(l).unwrap());
        }
        last = tokens;
    }
    a.free(&mut be);
    b.free(&mut be);
}

/// The calls that wait for the device (`read`, `synchronize`) and the bytes read back.
#[derive(Debug, Default, Clone, Copy)]
struct Waits {
    reads: usize,
    read_bytes: usize,
    syncs: usize,
}

/// A CPU backend that counts its waits into a handle the test keeps (the engine owns the backend).
struct Counting {
    inner: CpuBackend,
    waits: std::sync::Arc<std::sync::Mutex<Waits>>,
}

impl tessera_graph::Backend for Counting {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn supports(&self, op: &tessera_graph::Op, inputs: &[tessera_graph::TensorMeta]) -> bool {
        self.inner.supports(op, inputs)
    }
    fn alloc(&mut self, bytes: usize) -> Result<tessera_graph::BufferId, tessera_graph::BackendError> {
        self.inner.alloc(bytes)
    }
    fn free(&mut self, buffer: tessera_graph::BufferId) {
        self.inner.free(buffer)
    }
    fn size(&self, buffer: tessera_graph::BufferId) -> Result<usize, tessera_graph::BackendError> {
        self.inner.size(buffer)
    }
    fn write(&mut self, b: tessera_graph::BufferId, at: usize, data: &[u8]) -> Result<(), tessera_graph::BackendError> {
        self.inner.write(b, at, data)
    }
    fn read(
        &mut self,
        b: tessera_graph::BufferId,
        at: usize,
        out: &mut [u8],
    ) -> Result<(), tessera_graph::BackendError> {
        let mut w = self.waits.lock().unwrap();
        w.reads += 1;
        w.read_bytes += out.len();
        self.inner.read(b, at, out)
    }
    fn compute(&mut self, tasks: &[tessera_graph::Task<'_>]) -> Result<(), tessera_graph::BackendError> {
        self.inner.compute(tasks)
    }
    fn synchronize(&mut self) -> Result<(), tessera_graph::BackendError> {
        self.waits.lock().unwrap().syncs += 1;
        self.inner.synchronize()
    }
}

#[test]
fn a_greedy_decode_step_waits_once_and_reads_back_only_token_ids() {
    use tessera_models::engine::{Engine, EngineConfig};
    use tessera_models::sample::SamplerParams;

    let f = file("tiny-moe");
    let waits = std::sync::Arc::new(std::sync::Mutex::new(Waits::default()));
    let mut be = Counting { inner: CpuBackend::new(), waits: waits.clone() };
    let m = Model::load(&f, &mut be, opts(8, 8)).unwrap();
    let mut e = Engine::new(m, Box::new(be), EngineConfig { max_tokens_per_step: 64 }).unwrap();
    for p in [&[1u32, 2, 3][..], &[4, 5], &[6, 7, 8, 9]] {
        e.submit(p, 20, SamplerParams::greedy()).unwrap();
    }
    e.step().unwrap(); // the prompts
    let mut decode_steps = 0;
    while !e.is_idle() {
        let before = *waits.lock().unwrap();
        let n_seq =
            e.step().unwrap().iter().filter(|ev| matches!(ev, tessera_models::engine::Event::Token { .. })).count();
        let c = *waits.lock().unwrap();
        assert_eq!(c.reads - before.reads, 1, "one wait a decode step");
        assert_eq!(c.read_bytes - before.read_bytes, 4 * n_seq, "token ids only");
        assert_eq!(c.syncs, before.syncs, "no other synchronisation");
        decode_steps += 1;
    }
    assert_eq!(decode_steps, 19);
}
