//! The HF-conversion oracle: convert `fixtures/hf/{qwen35-dense,qwen35moe}` (tiny random Qwen3.5
//! checkpoints saved by transformers, see `fixtures/hf/README.md`) to f32 GGUF, run them on the CPU
//! backend and compare with the logits and greedy tokens transformers computed.

use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};
use tessera_cpu::CpuBackend;
use tessera_models::convert::convert;
use tessera_models::gguf::GgufFile;
use tessera_models::qwen35::{Logits, Model, ModelOptions};
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
