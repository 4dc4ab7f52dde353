//! Issue 23, item 6: converting holds at most about one tensor's f32 copy beyond the mapped
//! checkpoint (it streams chunks of rows, so in fact much less). The heap is measured with a
//! counting allocator on a checkpoint with a 16 MB embedding; the process's whole resident set on
//! a 2 GB checkpoint is measured with the release binary (docs/MODELS.md), on a checkpoint that
//! [`write_big_checkpoint`] makes.

mod common;

use std::io::{BufWriter, Write};
use std::path::Path;

use common::{Counting, StTensor, f32_bytes, fixture_config, fixture_tensors, measure, temp_dir, write_checkpoint};
use safetensors::Dtype;
use serde_json::json;
use tessera_models::convert::{CHUNK_ELEMS, convert};
use tessera_models::gguf::GgufFile;
use tessera_ops::DType;

#[global_allocator]
static ALLOC: Counting = Counting;

const MB: usize = 1 << 20;

/// Deterministic values in (-0.05, 0.05) (xorshift), cheap to make in bulk.
fn values(n: usize, seed: u64) -> impl Iterator<Item = f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n).map(move |_| {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1
    })
}

#[test]
fn convert_heap_stays_below_one_tensor() {
    // The dense fixture with a 65536-token vocabulary: embedding and head 65536 x 64 f32, 16 MB
    // each. Converting used to hold such a tensor as f32 and again as f64 (48 MB) plus its
    // encoding.
    let vocab = 65_536;
    let mut config = fixture_config("qwen35-dense");
    config["vocab_size"] = json!(vocab);
    let tensors: Vec<StTensor> = fixture_tensors("qwen35-dense")
        .into_iter()
        .map(|t| match t.0.as_str() {
            "model.embed_tokens.weight" | "lm_head.weight" => {
                let v: Vec<f32> = values(vocab * 64, t.0.len() as u64).collect();
                (t.0, Dtype::F32, vec![vocab, 64], f32_bytes(&v))
            }
            _ => t,
        })
        .collect();
    let dir = temp_dir("memory");
    write_checkpoint(&dir, &config, &tensors);
    drop(tensors);
    let one_tensor = vocab * 64 * 4;
    for dtype in [DType::F32, DType::F16, DType::Q8_0, DType::NvFp4] {
        let out = dir.join(format!("{dtype}.gguf"));
        let (r, cost) = measure(|| convert(&dir, &out, dtype));
        r.unwrap();
        // A chunk of f32 values and its encoding, plus the header and bookkeeping.
        let bound = 2 * CHUNK_ELEMS * 4 + 4 * MB;
        assert!(
            cost.peak_heap < bound && cost.peak_heap < one_tensor,
            "{dtype}: {:.1} MB of heap (one tensor: {} MB)",
            cost.peak_heap as f64 / MB as f64,
            one_tensor / MB
        );
        eprintln!(
            "{dtype}: peak heap {:.1} MB, one f32 tensor {} MB",
            cost.peak_heap as f64 / MB as f64,
            one_tensor / MB
        );
        let f = GgufFile::open(&out).unwrap();
        assert_eq!(f.tensor("token_embd.weight").unwrap().ne, [64, vocab, 1, 1]);
    }
    std::fs::remove_dir_all(dir).unwrap();
}

/// The layout of the big checkpoint: a qwen35 with an embedding of `vocab` x 1024 (with Qwen3.5's
/// 248320 tokens, 1 GB of f32) and `n_layer` layers (3 gated DeltaNet + 1 attention, repeated)
/// of about 54 MB each.
fn big_config(n_layer: usize, vocab: usize) -> serde_json::Value {
    let types: Vec<&str> =
        (0..n_layer).map(|i| if (i + 1) % 4 == 0 { "full_attention" } else { "linear_attention" }).collect();
    json!({
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "hidden_size": 1024,
        "vocab_size": vocab,
        "num_hidden_layers": n_layer,
        "layer_types": types,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
        "linear_value_head_dim": 128,
        "intermediate_size": 3072,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": true,
        "rope_parameters": {"mrope_section": [6, 5, 5], "partial_rotary_factor": 0.25, "rope_theta": 10000000.0}
    })
}

/// The tensors (name, torch shape) of [`big_config`].
fn big_tensors(n_layer: usize, vocab: usize) -> Vec<(String, Vec<usize>)> {
    let (e, ff) = (1024, 3072);
    let mut t = vec![("model.embed_tokens.weight".to_string(), vec![vocab, e]), ("model.norm.weight".into(), vec![e])];
    for il in 0..n_layer {
        let p = format!("model.layers.{il}.");
        let mut add = |n: &str, s: &[usize]| t.push((format!("{p}{n}"), s.to_vec()));
        add("input_layernorm.weight", &[e]);
        add("post_attention_layernorm.weight", &[e]);
        if (il + 1) % 4 == 0 {
            add("self_attn.q_proj.weight", &[2 * 128 * 8, e]);
            add("self_attn.k_proj.weight", &[128 * 2, e]);
            add("self_attn.v_proj.weight", &[128 * 2, e]);
            add("self_attn.o_proj.weight", &[e, 128 * 8]);
            add("self_attn.q_norm.weight", &[128]);
            add("self_attn.k_norm.weight", &[128]);
        } else {
            let (qk, v) = (2 * 4 * 128, 8 * 128);
            add("linear_attn.in_proj_qkv.weight", &[qk + v, e]);
            add("linear_attn.in_proj_z.weight", &[v, e]);
            add("linear_attn.in_proj_a.weight", &[8, e]);
            add("linear_attn.in_proj_b.weight", &[8, e]);
            add("linear_attn.conv1d.weight", &[qk + v, 1, 4]);
            add("linear_attn.dt_bias", &[8]);
            add("linear_attn.A_log", &[8]);
            add("linear_attn.norm.weight", &[128]);
            add("linear_attn.out_proj.weight", &[e, v]);
        }
        add("mlp.gate_proj.weight", &[ff, e]);
        add("mlp.up_proj.weight", &[ff, e]);
        add("mlp.down_proj.weight", &[e, ff]);
    }
    t
}

/// Writes the big checkpoint into `dir` (`config.json` + `model.safetensors`, f32), streaming:
/// the generator holds one tensor's values at a time.
fn write_big(dir: &Path, n_layer: usize, vocab: usize) {
    std::fs::write(dir.join("config.json"), big_config(n_layer, vocab).to_string()).unwrap();
    let tensors = big_tensors(n_layer, vocab);
    let mut header = serde_json::Map::new();
    let mut at = 0usize;
    for (name, shape) in &tensors {
        let bytes = shape.iter().product::<usize>() * 4;
        header.insert(name.clone(), json!({"dtype": "F32", "shape": shape, "data_offsets": [at, at + bytes]}));
        at += bytes;
    }
    let mut h = serde_json::Value::Object(header).to_string().into_bytes();
    h.resize(h.len().next_multiple_of(8), b' ');
    let mut w = BufWriter::with_capacity(8 * MB, std::fs::File::create(dir.join("model.safetensors")).unwrap());
    w.write_all(&(h.len() as u64).to_le_bytes()).unwrap();
    w.write_all(&h).unwrap();
    for (i, (name, shape)) in tensors.iter().enumerate() {
        let n: usize = shape.iter().product();
        // Norm weights near 0 (HF stores w of x·(1 + w)), A_log small: like a trained model.
        for x in values(n, i as u64 + 1) {
            let x = if name.ends_with("norm.weight") || name.ends_with("A_log") { x * 0.1 } else { x };
            w.write_all(&x.to_le_bytes()).unwrap();
        }
    }
    w.flush().unwrap();
}

/// Writes the 2 GB checkpoint the figure in docs/MODELS.md was measured on (20 layers, 2.1 GB),
/// into `$TESSERA_BIG_HF_DIR`:
///
/// ```sh
/// TESSERA_BIG_HF_DIR=/tmp/big-hf cargo test --release -p tessera-models --test convert_memory \
///     -- --ignored write_big_checkpoint
/// /usr/bin/time -v target/release/tessera convert --from-hf /tmp/big-hf --out /tmp/big.gguf -q
/// ```
#[test]
#[ignore = "writes 2.1 GB; run by hand to measure (see the doc comment)"]
fn write_big_checkpoint() {
    let Ok(dir) = std::env::var("TESSERA_BIG_HF_DIR") else {
        panic!("set TESSERA_BIG_HF_DIR to the directory to write");
    };
    let dir = Path::new(&dir);
    std::fs::create_dir_all(dir).unwrap();
    write_big(dir, 20, 248_320);
}

/// The big checkpoint's layout is one the converter takes: a 4-layer version with a small
/// vocabulary (217 MB) converts.
#[test]
fn big_layout_converts() {
    let dir = temp_dir("big");
    write_big(&dir, 4, 4096);
    let out = dir.join("out.gguf");
    let report = {
        let _g = common::exclusive(); // not beside a measured test
        convert(&dir, &out, DType::Q8_0).unwrap()
    };
    assert_eq!(report.config.n_layer, 4);
    assert!(report.warnings.is_empty(), "{:?}", report.warnings);
    std::fs::remove_dir_all(dir).unwrap();
}
