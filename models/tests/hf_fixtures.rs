//! The HF-conversion oracle: convert `fixtures/hf/{qwen35-dense,qwen35moe}` (tiny random Qwen3.5
//! checkpoints saved by transformers, see `fixtures/hf/README.md`; and `qwen3-dense`, `qwen3moe`,
//! Qwen3 / Qwen3-MoE, checked when generated) to f32 GGUF, run them on the CPU
//! backend and compare with the logits and greedy tokens transformers computed: one pass per
//! sequence, prompts fed in chunks, several sequences batched in one step (the reference ran each
//! alone), and quantized weights by the KL divergence from the f32 reference.

use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};
use tessera_cpu::CpuBackend;
use tessera_models::cache::SeqId;
use tessera_models::convert::convert;
use tessera_models::engine::{Engine, EngineConfig};
use tessera_models::gguf::GgufFile;
use tessera_models::model::{Logits, Model, ModelOptions};
use tessera_models::sample::SamplerParams;
use tessera_ops::DType;

const TOL: f32 = 1e-3;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/hf").join(name)
}

struct Reference {
    bytes: Vec<u8>,
}

impl Reference {
    fn open(dir: &Path) -> Reference {
        Reference { bytes: std::fs::read(dir.join("reference.safetensors")).unwrap() }
    }

    fn st(&self) -> SafeTensors<'_> {
        SafeTensors::deserialize(&self.bytes).unwrap()
    }

    fn ids(&self, name: &str) -> Vec<u32> {
        let st = self.st();
        let t = st.tensor(name).unwrap();
        assert_eq!(t.dtype(), Dtype::I32, "{name}");
        t.data().chunks_exact(4).map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as u32).collect()
    }

    fn f32s(&self, name: &str) -> (Vec<usize>, Vec<f32>) {
        let st = self.st();
        let t = st.tensor(name).unwrap();
        assert_eq!(t.dtype(), Dtype::F32, "{name}");
        (t.shape().to_vec(), t.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
    }
}

fn opts() -> ModelOptions {
    ModelOptions { kv_blocks: 64, block_size: 4, max_context: 128, kv_dtype: DType::F32, ..ModelOptions::default() }
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

fn argmax(v: &[f32]) -> u32 {
    v.iter().enumerate().fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &x)| if x > bv { (i, x) } else { (bi, bv) }).0
        as u32
}

fn check(name: &str) {
    let dir = fixture(name);
    let out = std::env::temp_dir().join(format!("tessera_hf_{name}_{}.gguf", std::process::id()));
    let report = convert(&dir, &out, DType::F32).unwrap();
    let file = GgufFile::open(&out).unwrap();
    report.config.validate_tensors(&file).unwrap();
    let reference = Reference::open(&dir);
    let mut be = CpuBackend::new();

    // Prompt logits.
    let prompt = reference.ids("prompt.ids");
    let (shape, want) = reference.f32s("prompt.logits");
    assert_eq!(shape, [prompt.len(), report.config.n_vocab]);
    let mut m = Model::load(&file, &mut be, opts()).unwrap();
    let got = m.step(&mut be, &[(0, &prompt)], Logits::All).unwrap().remove(0);
    let prompt_diff = max_abs_diff(&got, &want);
    eprintln!("{name}: prompt ({} tokens) logits max |diff| = {prompt_diff:e}", prompt.len());

    // Greedy continuation.
    let cont = reference.ids("continuation.ids");
    let n_vocab = report.config.n_vocab;
    let mut last = got[got.len() - n_vocab..].to_vec();
    let mut tokens = Vec::new();
    for _ in 0..cont.len() {
        let t = argmax(&last);
        tokens.push(t);
        last = m.step(&mut be, &[(0, &[t])], Logits::Last).unwrap().remove(0);
    }
    let n_match = tokens.iter().zip(&cont).take_while(|(a, b)| a == b).count();
    eprintln!("{name}: greedy {n_match}/{} tokens match (got {tokens:?}, want {cont:?})", cont.len());
    m.free(&mut be);

    // Every position of prompt + continuation in one pass, and the extra prompts alone.
    let mut full_ids = prompt.clone();
    full_ids.extend(&cont);
    let (_, want_full) = reference.f32s("full.logits");
    let mut m = Model::load(&file, &mut be, opts()).unwrap();
    let got_full = m.step(&mut be, &[(0, &full_ids)], Logits::All).unwrap().remove(0);
    let full_diff = max_abs_diff(&got_full, &want_full);
    eprintln!("{name}: full ({} tokens) logits max |diff| = {full_diff:e}", full_ids.len());
    m.free(&mut be);
    let mut extra_diff = 0.0f32;
    for i in 0..3 {
        let ids = reference.ids(&format!("extra{i}.ids"));
        let (_, want) = reference.f32s(&format!("extra{i}.logits"));
        let mut m = Model::load(&file, &mut be, opts()).unwrap();
        let got = m.step(&mut be, &[(0, &ids)], Logits::All).unwrap().remove(0);
        let d = max_abs_diff(&got, &want);
        eprintln!("{name}: extra{i} ({} tokens) logits max |diff| = {d:e}", ids.len());
        extra_diff = extra_diff.max(d);
        m.free(&mut be);
    }
    drop(file);
    std::fs::remove_file(&out).unwrap();

    assert!(prompt_diff <= TOL, "{name}: prompt logits differ by {prompt_diff}");
    assert_eq!(tokens, cont, "{name}: greedy continuation");
    assert!(full_diff <= TOL, "{name}: full logits differ by {full_diff}");
    assert!(extra_diff <= TOL, "{name}: extra prompt logits differ by {extra_diff}");
}

#[test]
fn dense_fixture_matches_transformers() {
    check("qwen35-dense");
}

#[test]
fn moe_fixture_matches_transformers() {
    check("qwen35moe");
}

/// Whether fixture `name` has been generated; when not, says how to make it (the Qwen3 fixtures
/// are made on a machine with transformers, see `fixtures/hf/README.md`).
fn generated(name: &str) -> bool {
    let there = fixture(name).join("reference.safetensors").exists();
    if !there {
        eprintln!(
            "skipped: fixtures/hf/{name} is not generated yet (python3 tools/gen_hf_fixtures.py fixtures/hf {name}, \
             where torch + transformers are installed)"
        );
    }
    there
}

#[test]
fn qwen3_dense_fixture_matches_transformers() {
    if generated("qwen3-dense") {
        check("qwen3-dense");
    }
}

#[test]
fn qwen3moe_fixture_matches_transformers() {
    if generated("qwen3moe") {
        check("qwen3moe");
    }
}

#[test]
fn converts_to_quantized_dtypes() {
    let dir = fixture("qwen35-dense");
    for dtype in [DType::F16, DType::BF16, DType::Q8_0, DType::NvFp4] {
        let out = std::env::temp_dir().join(format!("tessera_hf_q_{dtype}_{}.gguf", std::process::id()));
        let report = convert(&dir, &out, dtype).unwrap();
        let file = GgufFile::open(&out).unwrap();
        report.config.validate_tensors(&file).unwrap();
        assert_eq!(file.tensor("blk.0.attn_qkv.weight").unwrap().dtype, dtype);
        drop(file);
        std::fs::remove_file(&out).unwrap();
    }
}

/// transformers 5 may save the experts fused (`mlp.experts.gate_up_proj` `[E, 2·ff, n_embd]`, gate
/// rows first, and `mlp.experts.down_proj` `[E, n_embd, ff]`): a fused copy of the MoE fixture
/// converts to the same tensors as the per-expert original.
#[test]
fn fused_experts_convert_like_per_expert() {
    use safetensors::tensor::TensorView;
    let src = fixture("qwen35moe");
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let f32s = |name: &str| st.tensor(name).unwrap().data().to_vec();
    let (n_expert, ff, e) = (8usize, 32usize, 64usize);
    let mut out: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, view) in st.tensors() {
        if !name.contains(".mlp.experts.") {
            out.push((name.clone(), view.shape().to_vec(), view.data().to_vec()));
        }
    }
    for il in 0..8 {
        let p = format!("model.layers.{il}.mlp.experts");
        let mut gate_up = Vec::new();
        let mut down = Vec::new();
        for ex in 0..n_expert {
            gate_up.extend(f32s(&format!("{p}.{ex}.gate_proj.weight")));
            gate_up.extend(f32s(&format!("{p}.{ex}.up_proj.weight")));
            down.extend(f32s(&format!("{p}.{ex}.down_proj.weight")));
        }
        out.push((format!("{p}.gate_up_proj"), vec![n_expert, 2 * ff, e], gate_up));
        out.push((format!("{p}.down_proj"), vec![n_expert, e, ff], down));
    }
    let views = out.iter().map(|(n, s, d)| (n.clone(), TensorView::new(Dtype::F32, s.clone(), d).unwrap()));
    let fused = safetensors::tensor::serialize(views, None).unwrap();
    let dir = std::env::temp_dir().join(format!("tessera_hf_fused_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    std::fs::write(dir.join("model.safetensors"), fused).unwrap();
    let a_path = dir.join("a.gguf");
    let b_path = dir.join("b.gguf");
    convert(&src, &a_path, DType::F32).unwrap();
    convert(&dir, &b_path, DType::F32).unwrap();
    let (a, b) = (GgufFile::open(&a_path).unwrap(), GgufFile::open(&b_path).unwrap());
    for t in a.tensors() {
        assert_eq!(a.tensor_data(&t.name).unwrap(), b.tensor_data(&t.name).unwrap(), "{}", t.name);
    }
    drop((a, b));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn missing_tensor_is_named() {
    use safetensors::tensor::TensorView;
    let src = fixture("qwen35-dense");
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let dropped = "model.layers.1.linear_attn.A_log";
    let views: Vec<(String, TensorView<'_>)> = st.tensors().into_iter().filter(|(n, _)| n != dropped).collect();
    let dir = std::env::temp_dir().join(format!("tessera_hf_missing_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    std::fs::write(dir.join("model.safetensors"), safetensors::tensor::serialize(views, None).unwrap()).unwrap();
    let e = convert(&dir, &dir.join("x.gguf"), DType::F32).unwrap_err().to_string();
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(e.contains(dropped) && e.contains("blk.1.ssm_a"), "{e}");
}

/// A fixture converted to a GGUF in the temp dir (removed on drop).
struct Converted {
    path: PathBuf,
    file: Option<GgufFile>,
    reference: Reference,
    n_vocab: usize,
}

impl Converted {
    fn new(name: &str, dtype: DType) -> Converted {
        let dir = fixture(name);
        // Unique per call: tests run in parallel threads of one process.
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("tessera_hf_{name}_{dtype}_{}_{n}.gguf", std::process::id()));
        let report = convert(&dir, &path, dtype).unwrap();
        let file = GgufFile::open(&path).unwrap();
        Converted { path, file: Some(file), reference: Reference::open(&dir), n_vocab: report.config.n_vocab }
    }

    fn file(&self) -> &GgufFile {
        self.file.as_ref().unwrap()
    }

    /// The ids and reference logits of `which`: `prompt`, `full` (prompt + continuation) or
    /// `extraN`.
    fn seq(&self, which: &str) -> (Vec<u32>, Vec<f32>) {
        let ids = if which == "full" {
            let mut ids = self.reference.ids("prompt.ids");
            ids.extend(self.reference.ids("continuation.ids"));
            ids
        } else {
            self.reference.ids(&format!("{which}.ids"))
        };
        let (shape, logits) = self.reference.f32s(&format!("{which}.logits"));
        assert_eq!(shape, [ids.len(), self.n_vocab], "{which}");
        (ids, logits)
    }
}

impl Drop for Converted {
    fn drop(&mut self) {
        self.file = None;
        let _ = std::fs::remove_file(&self.path);
    }
}

/// `D_KL(P_ref ‖ P_ours)` per position, `P = softmax(logits)` over each `n_vocab` row, in f64.
fn kl_per_position(reference: &[f32], ours: &[f32], n_vocab: usize) -> Vec<f64> {
    fn log_softmax(row: &[f32]) -> Vec<f64> {
        let m = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
        let lse = m + row.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
        row.iter().map(|&x| x as f64 - lse).collect()
    }
    assert_eq!(reference.len(), ours.len());
    reference
        .chunks_exact(n_vocab)
        .zip(ours.chunks_exact(n_vocab))
        .map(|(r, o)| {
            let (lp, lq) = (log_softmax(r), log_softmax(o));
            lp.iter().zip(&lq).map(|(p, q)| p.exp() * (p - q)).sum::<f64>()
        })
        .collect()
}

/// The prompt logits of a model file (f32 K/V cache).
fn prompt_logits(file: &GgufFile, prompt: &[u32]) -> Vec<f32> {
    let mut be = CpuBackend::new();
    let mut m = Model::load(file, &mut be, opts()).unwrap();
    let got = m.step(&mut be, &[(0, prompt)], Logits::All).unwrap().remove(0);
    m.free(&mut be);
    got
}

/// `(mean, max)` over positions.
fn mean_max(v: &[f64]) -> (f64, f64) {
    (v.iter().sum::<f64>() / v.len() as f64, v.iter().copied().fold(0.0, f64::max))
}

/// A copy of the f32 GGUF `f32_file` whose tensors stored quantized in `quant` hold their
/// dequantized values (f32): the weights the quantized model computes with, with f32 matmuls.
fn fake_quantized(f32_file: &GgufFile, quant: &GgufFile, out: &Path) {
    use tessera_models::gguf::GgufWriter;
    use tessera_ops::host::{decode, encode};
    let mut w = GgufWriter::new();
    for (k, v) in f32_file.metadata() {
        w.add_kv(k.clone(), v.clone()).unwrap();
    }
    for t in f32_file.tensors() {
        let data = f32_file.tensor_data(&t.name).unwrap();
        let qd = quant.tensor(&t.name).unwrap().dtype;
        let bytes: Vec<u8> = if qd == DType::F32 {
            data.to_vec()
        } else {
            let v: Vec<f64> =
                data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64).collect();
            decode(qd, &encode(qd, &v)).iter().flat_map(|&x| (x as f32).to_le_bytes()).collect()
        };
        w.add_tensor(t.name.clone(), DType::F32, t.dims(), bytes).unwrap();
    }
    w.write_file(out).unwrap();
}

/// Quantized weights against the f32 reference, by `D_KL(P_ref ‖ P_ours)` (`P = softmax`) over
/// the 40 prompt positions, mean and max over positions. Measured (CPU backend, f32 K/V):
///
/// | fixture | bf16 mean / max | q8_0 mean / max | nvfp4 mean / max | uniform mean |
/// | --- | --- | --- | --- | --- |
/// | dense | 4.43e-4 / 8.83e-3 | 3.83e-3 / 3.38e-2 | 0.309 / 1.00 | 0.52 |
/// | MoE | 2.85e-2 / 0.356 | 6.47e-2 / 0.666 | 0.592 / 1.19 | 0.56 |
///
/// These random unit-gain models amplify weight rounding far more than trained checkpoints do
/// (the MoE router also flips experts), so nvfp4 is about as far from the reference as uniform
/// logits. That the quantized kernels themselves are right is checked separately and tightly: the
/// logits equal those of the f32 model run on the dequantized weights (KL <= 1e-9; measured
/// <= 6e-12). The KL bounds are about 3x the measured values, rounded up; the arithmetic is
/// deterministic, so they only move when the code does.
#[test]
fn quantized_weights_kl_from_reference() {
    // (fixture, dtype, bound on the mean KL, bound on the max KL over positions).
    let bounds = [
        ("qwen35-dense", DType::BF16, 1.5e-3, 3e-2),
        ("qwen35-dense", DType::Q8_0, 1.2e-2, 0.1),
        ("qwen35-dense", DType::NvFp4, 0.9, 3.0),
        ("qwen35moe", DType::BF16, 9e-2, 1.1),
        ("qwen35moe", DType::Q8_0, 0.2, 2.0),
        ("qwen35moe", DType::NvFp4, 1.8, 3.6),
    ];
    let mut failures = Vec::new();
    for name in ["qwen35-dense", "qwen35moe"] {
        let f = Converted::new(name, DType::F32);
        let (prompt, want) = f.seq("prompt");
        let nv = f.n_vocab;
        let uniform = mean_max(&kl_per_position(&want, &vec![0.0; want.len()], nv));
        eprintln!("{name}: KL(ref || uniform) mean {:.3e} max {:.3e} (chance level)", uniform.0, uniform.1);
        for &(_, dtype, mean_bound, max_bound) in bounds.iter().filter(|b| b.0 == name) {
            let q = Converted::new(name, dtype);
            let got = prompt_logits(q.file(), &prompt);
            let (mean, max) = mean_max(&kl_per_position(&want, &got, nv));
            let top1 = want.chunks_exact(nv).zip(got.chunks_exact(nv)).filter(|(w, g)| argmax(w) == argmax(g)).count();
            let fake_path = q.path.with_extension("fake.gguf");
            fake_quantized(f.file(), q.file(), &fake_path);
            let fake_file = GgufFile::open(&fake_path).unwrap();
            let fake = prompt_logits(&fake_file, &prompt);
            drop(fake_file);
            std::fs::remove_file(&fake_path).unwrap();
            let (_, fake_kl) = mean_max(&kl_per_position(&fake, &got, nv));
            let fake_diff = max_abs_diff(&fake, &got);
            eprintln!(
                "{name} {dtype}: KL(ref || ours) mean {mean:.3e} max {max:.3e}; top-1 {top1}/{}; logits max |diff| {:.3e}; vs f32 on dequantized weights: KL max {fake_kl:.1e}, max |diff| {fake_diff:.1e}",
                prompt.len(),
                max_abs_diff(&got, &want)
            );
            if mean > mean_bound || max > max_bound {
                failures.push(format!(
                    "{name} {dtype}: KL mean {mean:e} (bound {mean_bound:e}), max {max:e} (bound {max_bound:e})"
                ));
            }
            if fake_kl > 1e-9 || fake_diff > TOL {
                failures.push(format!(
                    "{name} {dtype}: differs from f32 on dequantized weights by KL {fake_kl:e}, |diff| {fake_diff:e}"
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Feeds `ids` to a fresh sequence in chunks of the given sizes; returns the logits of every
/// position.
fn run_chunked(model: &mut Model, be: &mut CpuBackend, id: SeqId, ids: &[u32], chunks: &[usize]) -> Vec<f32> {
    assert_eq!(chunks.iter().sum::<usize>(), ids.len());
    let mut out = Vec::new();
    let mut at = 0;
    for &n in chunks {
        out.extend(model.step(be, &[(id, &ids[at..at + n])], Logits::All).unwrap().remove(0));
        at += n;
    }
    model.remove_sequence(id).unwrap();
    out
}

/// The prompt fed in several chunks matches the reference, which saw it in one forward pass.
fn check_chunked(name: &str) {
    let c = Converted::new(name, DType::F32);
    let (prompt, want) = c.seq("prompt");
    let (full, want_full) = c.seq("full");
    let mut be = CpuBackend::new();
    let mut m = Model::load(c.file(), &mut be, opts()).unwrap();
    let mut worst = 0.0f32;
    let schedules: [(&str, Vec<usize>); 4] = [
        ("7+13+20", vec![7, 13, 20]),
        ("1+1+1+1+36", vec![1, 1, 1, 1, 36]),
        ("5x8", vec![8; 5]),
        ("40x1", vec![1; 40]),
    ];
    for (label, chunks) in &schedules {
        let got = run_chunked(&mut m, &mut be, 0, &prompt, chunks);
        let d = max_abs_diff(&got, &want);
        eprintln!("{name}: prompt in chunks {label}: logits max |diff| = {d:e}");
        worst = worst.max(d);
    }
    // Prompt + continuation, with chunks across the prompt/continuation boundary.
    let got = run_chunked(&mut m, &mut be, 0, &full, &[3, 30, 9, 1, 13]);
    let d = max_abs_diff(&got, &want_full);
    eprintln!("{name}: prompt + continuation in chunks 3+30+9+1+13: logits max |diff| = {d:e}");
    worst = worst.max(d);
    m.free(&mut be);
    assert!(worst <= TOL, "{name}: chunked logits differ by {worst}");
}

#[test]
fn dense_chunked_prompt_matches_transformers() {
    check_chunked("qwen35-dense");
}

#[test]
fn moe_chunked_prompt_matches_transformers() {
    check_chunked("qwen35moe");
}

/// Several sequences of different lengths in the same steps, mixing prefill chunks and
/// single-token (decode) steps, with equal-length chunks grouped into one graph: each sequence's
/// logits match the reference, which ran each sequence alone.
fn check_batched(name: &str) {
    let c = Converted::new(name, DType::F32);
    let seqs: Vec<(&str, Vec<u32>, Vec<f32>)> = ["full", "extra0", "extra1", "extra2"]
        .into_iter()
        .map(|w| {
            let (ids, logits) = c.seq(w);
            (w, ids, logits)
        })
        .collect();
    // Chunk sizes per step for each sequence (full: 56, extra0: 23, extra1: 7, extra2: 31).
    // Step 1 feeds 40 / 7 / 7 / 7 tokens (the three 7s share one graph), step 2 1 / 3 / - / 1,
    // then full decodes one token per step beside the others' prefill chunks.
    let plan: [Vec<usize>; 4] =
        [std::iter::once(40).chain(std::iter::repeat_n(1, 16)).collect(), vec![7, 3, 5, 8], vec![7], vec![7, 1, 1, 22]];
    for (s, p) in seqs.iter().zip(&plan) {
        assert_eq!(p.iter().sum::<usize>(), s.1.len(), "{}", s.0);
    }
    let mut be = CpuBackend::new();
    let o = ModelOptions { n_slots: 4, kv_blocks: 64, ..opts() };
    let mut m = Model::load(c.file(), &mut be, o).unwrap();
    let mut got: Vec<Vec<f32>> = vec![Vec::new(); seqs.len()];
    let mut fed = [0usize; 4];
    let n_steps = plan.iter().map(Vec::len).max().unwrap();
    for step in 0..n_steps {
        let mut batch: Vec<(SeqId, &[u32])> = Vec::new();
        let mut who = Vec::new();
        for (i, p) in plan.iter().enumerate() {
            if let Some(&n) = p.get(step) {
                batch.push((i as SeqId, &seqs[i].1[fed[i]..fed[i] + n]));
                who.push(i);
                fed[i] += n;
            }
        }
        let out = m.step(&mut be, &batch, Logits::All).unwrap();
        for (i, l) in who.into_iter().zip(out) {
            got[i].extend(l);
        }
    }
    m.free(&mut be);
    let mut worst = 0.0f32;
    for ((w, _, want), g) in seqs.iter().zip(&got) {
        let d = max_abs_diff(g, want);
        eprintln!("{name}: batched {w} ({} tokens): logits max |diff| = {d:e}", want.len() / c.n_vocab);
        worst = worst.max(d);
    }
    assert!(worst <= TOL, "{name}: batched logits differ by {worst}");
}

#[test]
fn dense_batched_sequences_match_transformers() {
    check_batched("qwen35-dense");
}

#[test]
fn moe_batched_sequences_match_transformers() {
    check_batched("qwen35moe");
}

/// The engine's own schedule (decode tokens first, prompt chunks under a 16-token budget) with
/// four sequences: the prompt generating the 16-token greedy continuation beside the three extra
/// prompts. The recorded logits of every fed position match the reference, and the greedy tokens
/// are the reference's continuation.
fn check_engine(name: &str) {
    let c = Converted::new(name, DType::F32);
    let (prompt, _) = c.seq("prompt");
    let cont = c.reference.ids("continuation.ids");
    let (_, want_full) = c.seq("full");
    let mut be = CpuBackend::new();
    let o = ModelOptions { n_slots: 4, kv_blocks: 64, ..opts() };
    let m = Model::load(c.file(), &mut be, o).unwrap();
    let mut engine = Engine::new(m, Box::new(be), EngineConfig { max_tokens_per_step: 16 }).unwrap();
    engine.record_logits(true);
    let greedy = SamplerParams::greedy();
    let p = engine.submit(&prompt, cont.len() + 1, greedy).unwrap();
    let extras: Vec<(SeqId, Vec<u32>, Vec<f32>)> = (0..3)
        .map(|i| {
            let (ids, want) = c.seq(&format!("extra{i}"));
            (engine.submit(&ids, 1, greedy).unwrap(), ids, want)
        })
        .collect();
    let mut tokens = engine.run_to_completion().unwrap();
    let steps = engine.stats().steps;
    let generated = tokens.remove(&p).unwrap();
    assert_eq!(generated[..cont.len()], cont[..], "{name}: greedy continuation in a batch");
    let d = max_abs_diff(&engine.take_logits(p), &want_full);
    eprintln!("{name}: engine ({steps} steps, budget 16) prompt + continuation logits max |diff| = {d:e}");
    let mut worst = d;
    for (i, (id, _, want)) in extras.iter().enumerate() {
        let d = max_abs_diff(&engine.take_logits(*id), want);
        eprintln!("{name}: engine extra{i} logits max |diff| = {d:e}");
        worst = worst.max(d);
    }
    assert!(worst <= TOL, "{name}: engine logits differ by {worst}");
}

#[test]
fn dense_engine_batch_matches_transformers() {
    check_engine("qwen35-dense");
}

#[test]
fn moe_engine_batch_matches_transformers() {
    check_engine("qwen35moe");
}

/// A 150-token sequence (`models/tests/data/hf_long_*.safetensors`, from
/// `models/tests/data/gen_hf_long.py`: transformers f32, every 7th position and the last 3 kept):
/// in one step the chunked gated delta rule crosses its 64-token chunks twice; also fed as
/// 64+1+85 and 100+50 chunks, and batched beside the 40-token prompt.
fn check_long(name: &str) {
    let c = Converted::new(name, DType::F32);
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/data/hf_long_{name}.safetensors"));
    let long = Reference { bytes: std::fs::read(&data).unwrap() };
    let ids = long.ids("ids");
    let rows: Vec<usize> = long.ids("rows").into_iter().map(|r| r as usize).collect();
    let (shape, want) = long.f32s("logits");
    assert_eq!(shape, [rows.len(), c.n_vocab]);
    let nv = c.n_vocab;
    let pick = |all: &[f32]| -> Vec<f32> { rows.iter().flat_map(|&r| all[r * nv..(r + 1) * nv].to_vec()).collect() };
    let mut be = CpuBackend::new();
    let o = ModelOptions { kv_blocks: 128, max_context: 256, n_slots: 2, ..opts() };
    let mut m = Model::load(c.file(), &mut be, o).unwrap();
    let mut worst = 0.0f32;
    for (label, chunks) in [("150", vec![150]), ("64+1+85", vec![64, 1, 85]), ("100+50", vec![100, 50])] {
        let got = run_chunked(&mut m, &mut be, 0, &ids, &chunks);
        let d = max_abs_diff(&pick(&got), &want);
        eprintln!("{name}: 150 tokens in chunks {label}: logits max |diff| = {d:e} ({} positions)", rows.len());
        worst = worst.max(d);
    }
    let (prompt, want_prompt) = c.seq("prompt");
    let out = m.step(&mut be, &[(0, &ids), (1, &prompt)], Logits::All).unwrap();
    let (d_long, d_prompt) = (max_abs_diff(&pick(&out[0]), &want), max_abs_diff(&out[1], &want_prompt));
    eprintln!("{name}: 150 tokens batched with the 40-token prompt: max |diff| = {d_long:e} / {d_prompt:e}");
    m.free(&mut be);
    worst = worst.max(d_long).max(d_prompt);
    assert!(worst <= TOL, "{name}: long-sequence logits differ by {worst}");
}

#[test]
fn dense_long_sequence_matches_transformers() {
    check_long("qwen35-dense");
}

#[test]
fn moe_long_sequence_matches_transformers() {
    check_long("qwen35moe");
}
