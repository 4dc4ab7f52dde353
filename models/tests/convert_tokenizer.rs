//! Issue 24, item 4: `convert` writes the checkpoint's vocabulary as llama.cpp's converter does.
//!
//! The full case writes HF tokenizer files (`tokenizer.json`, `tokenizer_config.json`) from the
//! fixture vocabulary (tests/data/vocab/, llama.cpp's qwen35 vocabulary GGUF, gzipped), converts a
//! checkpoint with them and compares the `tokenizer.*` keys with the fixture's: the same tokens,
//! types, merges, special ids and chat template (the `[PAD{i}]` fillers are type 5, unused, as
//! llama.cpp's converter writes them today; the fixture, made by an older converter, has 4).
//! Small hand-made tokenizers cover each rule and error.

mod common;

use common::{StTensor, fixture_config, fixture_tensors, temp_dir, write_checkpoint};
use safetensors::Dtype;
use serde_json::{Value as Json, json};
use tessera_models::chat::{ChatMessage, ChatTemplate};
use tessera_models::convert::{ConvertError, ConvertReport, convert};
use tessera_models::gguf::{GgufFile, Value};
use tessera_models::hf_vocab::{QWEN2_PRE_REGEX, QWEN35_PRE_REGEX};
use tessera_ops::DType;

mod synth_file;
use synth_file::fixture_vocab;

/// The dense fixture with `n_vocab` tokens: config edited, the embedding resized (f16 zeros but a
/// few values) and tied.
fn checkpoint(n_vocab: usize) -> (Json, Vec<StTensor>) {
    let mut config = fixture_config("qwen35-dense");
    config["vocab_size"] = json!(n_vocab);
    config["tie_word_embeddings"] = json!(true);
    let n_embd = config["hidden_size"].as_u64().unwrap() as usize;
    let mut tensors: Vec<StTensor> =
        fixture_tensors("qwen35-dense").into_iter().filter(|t| t.0 != "lm_head.weight").collect();
    let embd = tensors.iter_mut().find(|t| t.0 == "model.embed_tokens.weight").unwrap();
    let mut bytes = vec![0u8; n_vocab * n_embd * 2];
    for (i, b) in bytes.chunks_exact_mut(2).enumerate().step_by(97) {
        b.copy_from_slice(&half::f16::from_f32((i % 7) as f32 * 0.01).to_le_bytes());
    }
    *embd = (embd.0.clone(), Dtype::F16, vec![n_vocab, n_embd], bytes);
    (config, tensors)
}

/// A byte-level BPE `tokenizer.json` with `pre` as its split regex.
fn tokenizer_json(vocab: &[(&str, u32)], added: &[(&str, u32, bool)], merges: Json, pre: &str) -> Json {
    let vocab: serde_json::Map<String, Json> = vocab.iter().map(|(t, i)| (t.to_string(), json!(i))).collect();
    let added: Vec<Json> = added
        .iter()
        .map(|(t, i, s)| json!({"id": i, "content": t, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": s}))
        .collect();
    json!({
        "version": "1.0",
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pre}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "",
            "end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": merges}
    })
}

/// Converts a checkpoint with `config` / `tensors` and the extra `files` (name, text) in a fresh
/// directory.
fn convert_with(
    config: &Json,
    tensors: &[StTensor],
    files: &[(&str, String)],
) -> (Result<ConvertReport, ConvertError>, Option<GgufFile>) {
    let dir = temp_dir("convert_tok");
    write_checkpoint(&dir, config, tensors);
    for (name, text) in files {
        std::fs::write(dir.join(name), text).unwrap();
    }
    let out = dir.join("out.gguf");
    let r = convert(&dir, &out, DType::Q8_0);
    let f = out.exists().then(|| GgufFile::from_bytes(std::fs::read(&out).unwrap()).unwrap());
    std::fs::remove_dir_all(&dir).unwrap();
    (r, f)
}

#[test]
fn the_fixture_vocabulary_round_trips_through_hf_files() {
    let fx = fixture_vocab();
    let tokens = fx.get_str_array("tokenizer.ggml.tokens").unwrap();
    let types = fx.get_i32_array("tokenizer.ggml.token_type").unwrap();
    let merges = fx.get_str_array("tokenizer.ggml.merges").unwrap();
    let template = fx.get_str("tokenizer.chat_template").unwrap();
    let n_vocab = tokens.len();
    // tokenizer.json: normal tokens in the vocab, control tokens as special added tokens, the
    // [PAD] fillers nowhere (they are ids the HF tokenizer does not have); merges as pairs.
    let mut vocab = Vec::new();
    let mut added = Vec::new();
    for (i, (t, ty)) in tokens.iter().zip(types).enumerate() {
        match ty {
            1 => vocab.push((t.as_str(), i as u32)),
            3 => added.push((t.as_str(), i as u32, true)),
            _ => assert!(t.starts_with("[PAD"), "{i} {t} {ty}"),
        }
    }
    let pairs: Vec<Json> = merges
        .iter()
        .map(|m| {
            let (a, b) = m.split_once(' ').unwrap();
            json!([a, b])
        })
        .collect();
    let tok = tokenizer_json(&vocab, &added, Json::Array(pairs), QWEN35_PRE_REGEX);
    let eos = &tokens[fx.get_usize("tokenizer.ggml.eos_token_id").unwrap()];
    let pad = &tokens[fx.get_usize("tokenizer.ggml.padding_token_id").unwrap()];
    let tc = json!({"add_bos_token": false, "add_prefix_space": false, "bos_token": null, "eos_token": eos,
        "pad_token": pad, "unk_token": null, "errors": "replace", "model_max_length": 262144,
        "tokenizer_class": "Qwen2Tokenizer", "chat_template": template});
    let (mut config, tensors) = checkpoint(n_vocab);
    config["bos_token_id"] = json!(fx.get_usize("tokenizer.ggml.bos_token_id").unwrap());
    let files = [("tokenizer.json", tok.to_string()), ("tokenizer_config.json", tc.to_string())];
    let (r, out) = convert_with(&config, &tensors, &files);
    let report = r.unwrap();
    assert_eq!(report.vocab_tokens, Some(n_vocab));
    assert!(report.warnings.is_empty(), "{:?}", report.warnings);
    let out = out.unwrap();
    assert_eq!(out.get_str("tokenizer.ggml.model").unwrap(), "gpt2");
    assert_eq!(out.get_str("tokenizer.ggml.pre").unwrap(), "qwen35");
    assert_eq!(out.get_str_array("tokenizer.ggml.tokens").unwrap(), tokens);
    let out_types = out.get_i32_array("tokenizer.ggml.token_type").unwrap();
    for (i, (a, b)) in out_types.iter().zip(types).enumerate() {
        let want = if tokens[i].starts_with("[PAD") { 5 } else { *b };
        assert_eq!(*a, want, "token {i} `{}`", tokens[i]);
    }
    assert_eq!(out_types.len(), types.len());
    assert_eq!(out.get_str_array("tokenizer.ggml.merges").unwrap(), merges);
    for key in ["tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id"] {
        assert_eq!(out.get(key), fx.get(key), "{key}");
        assert!(matches!(out.get(key), Some(Value::U32(_))), "{key}");
    }
    assert_eq!(out.get("tokenizer.ggml.add_bos_token"), Some(&Value::Bool(false)));
    assert_eq!(out.get_str("tokenizer.chat_template").unwrap(), template);
    // The chat template renders from the converted file, with the vocabulary's special tokens.
    let chat = ChatTemplate::from_gguf(&out).unwrap();
    assert_eq!(chat.eos_token(), Some(eos.as_str()));
    let text = chat.render(&[ChatMessage::user("Hi")], true).unwrap();
    assert!(text.ends_with("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"), "{text}");
}

/// A tiny tokenizer: 6 byte-level tokens, a gap at id 6, `<|end|>` (special) at 7, `<think>` (not
/// special) at 8; vocab_size 10.
fn tiny(merges: Json, pre: &str) -> Json {
    tokenizer_json(
        &[("a", 0), ("b", 1), ("ab", 2), ("Ġ", 3), ("Ġa", 4), ("c", 5)],
        &[("<|end|>", 7, true), ("<think>", 8, false), ("<|im_x|>", 9, false)],
        merges,
        pre,
    )
}

#[test]
fn each_rule_of_the_tiny_vocabulary() {
    let (config, tensors) = checkpoint(10);
    let tok = tiny(json!([["a", "b"], ["Ġ", "a"], ["a b", "c"]]), QWEN2_PRE_REGEX);
    let tc = json!({"eos_token": {"content": "<|end|>", "special": true}, "add_eos_token": true, "add_unk_token": false,
        "chat_template": [{"name": "default", "template": "D"}, {"name": "tool use", "template": "T"}]});
    let mut cfg = config.clone();
    cfg["pad_token_id"] = json!(7);
    cfg["eos_token_id"] = json!(2); // tokenizer_config.json's eos wins
    let files = [("tokenizer.json", tok.to_string()), ("tokenizer_config.json", tc.to_string())];
    let (r, out) = convert_with(&cfg, &tensors, &files);
    let report = r.unwrap();
    assert_eq!(report.vocab_tokens, Some(10));
    // add_unk_token has no GGUF key: noted, as gguf-py logs it.
    assert_eq!(report.warnings.len(), 1, "{:?}", report.warnings);
    assert!(report.warnings[0].contains("add_unk_token"));
    let out = out.unwrap();
    assert_eq!(out.get_str("tokenizer.ggml.pre").unwrap(), "qwen2");
    assert_eq!(
        out.get_str_array("tokenizer.ggml.tokens").unwrap(),
        ["a", "b", "ab", "Ġ", "Ġa", "c", "[PAD6]", "<|end|>", "<think>", "<|im_x|>"]
    );
    assert_eq!(out.get_i32_array("tokenizer.ggml.token_type").unwrap(), [1, 1, 1, 1, 1, 1, 5, 3, 4, 3]);
    // A space inside a merge part is written as U+0120.
    assert_eq!(out.get_str_array("tokenizer.ggml.merges").unwrap(), ["a b", "Ġ a", "aĠb c"]);
    assert_eq!(out.get("tokenizer.ggml.eos_token_id"), Some(&Value::U32(7)));
    assert_eq!(out.get("tokenizer.ggml.padding_token_id"), Some(&Value::U32(7)));
    assert_eq!(out.get("tokenizer.ggml.bos_token_id"), None);
    assert_eq!(out.get("tokenizer.ggml.add_eos_token"), Some(&Value::Bool(true)));
    assert_eq!(out.get_str("tokenizer.chat_template").unwrap(), "D");
    assert_eq!(out.get_str("tokenizer.chat_template.tool_use").unwrap(), "T");
    assert_eq!(out.get_str_array("tokenizer.chat_templates").unwrap(), ["tool_use"]);
    assert_eq!(ChatTemplate::from_gguf_named(&out, "tool_use").unwrap().render(&[], false).unwrap(), "T");
}

#[test]
fn chat_template_files_and_post_processor_flags() {
    let (config, tensors) = checkpoint(10);
    let mut tok = tiny(json!(["a b"]), QWEN35_PRE_REGEX);
    tok["post_processor"] = json!({"type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|end|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [], "special_tokens": {}});
    let tc = json!({"bos_token": "<|end|>"});
    let files = [
        ("tokenizer.json", tok.to_string()),
        ("tokenizer_config.json", tc.to_string()),
        ("chat_template.jinja", "{{ bos_token }}J".to_string()),
    ];
    let (r, out) = convert_with(&config, &tensors, &files);
    assert!(r.unwrap().warnings.is_empty());
    let out = out.unwrap();
    assert_eq!(out.get("tokenizer.ggml.add_bos_token"), Some(&Value::Bool(true)));
    assert_eq!(out.get("tokenizer.ggml.bos_token_id"), Some(&Value::U32(7)));
    assert_eq!(out.get_str("tokenizer.chat_template").unwrap(), "{{ bos_token }}J");
    assert_eq!(ChatTemplate::from_gguf(&out).unwrap().render(&[], false).unwrap(), "<|end|>J");
    // chat_template.json when there is no .jinja; tokenizer_config.json's own template wins over both.
    let files = [
        ("tokenizer.json", tok.to_string()),
        ("tokenizer_config.json", tc.to_string()),
        ("chat_template.json", json!({"chat_template": "F"}).to_string()),
    ];
    assert_eq!(convert_with(&config, &tensors, &files).1.unwrap().get_str("tokenizer.chat_template").unwrap(), "F");
    let tc2 = json!({"bos_token": "<|end|>", "chat_template": "C"});
    let files = [
        ("tokenizer.json", tok.to_string()),
        ("tokenizer_config.json", tc2.to_string()),
        ("chat_template.jinja", "J".to_string()),
    ];
    assert_eq!(convert_with(&config, &tensors, &files).1.unwrap().get_str("tokenizer.chat_template").unwrap(), "C");
}

#[test]
fn without_tokenizer_json_there_is_no_vocabulary() {
    let (config, tensors) = checkpoint(10);
    let (r, out) = convert_with(&config, &tensors, &[]);
    assert_eq!(r.unwrap().vocab_tokens, None);
    assert!(out.unwrap().metadata().iter().all(|(k, _)| !k.starts_with("tokenizer.")));
}

#[test]
fn bad_tokenizers_are_errors_naming_the_file() {
    let (config, tensors) = checkpoint(10);
    let cases: Vec<(Json, &str)> = vec![
        (tiny(json!([]), r"\s+"), "unknown pre-tokenizer regex"),
        (
            tokenizer_json(&[("a", 0), ("b", 10)], &[], json!([]), QWEN35_PRE_REGEX),
            "`b` has id 10, but config.json's vocab_size is 10",
        ),
        (tokenizer_json(&[("a", 0)], &[("<|x|>", 0, true)], json!([]), QWEN35_PRE_REGEX), "both have id 0"),
        (tiny(json!([["a"]]), QWEN35_PRE_REGEX), "merge 0"),
        (
            {
                let mut t = tiny(json!([]), QWEN35_PRE_REGEX);
                t["model"]["type"] = json!("Unigram");
                t
            },
            "byte-level BPE",
        ),
    ];
    for (tok, want) in cases {
        let (r, out) = convert_with(&config, &tensors, &[("tokenizer.json", tok.to_string())]);
        let e = r.unwrap_err().to_string();
        assert!(e.contains("tokenizer.json") && e.contains(want), "{want}: {e}");
        assert!(out.is_none());
    }
    // Not JSON at all; a special id beyond the vocabulary.
    let (r, _) = convert_with(&config, &tensors, &[("tokenizer.json", "{".into())]);
    assert!(r.unwrap_err().to_string().contains("bad JSON"));
    let mut cfg = config.clone();
    cfg["bos_token_id"] = json!(10);
    let tok = tiny(json!([]), QWEN35_PRE_REGEX);
    let (r, out) = convert_with(&cfg, &tensors, &[("tokenizer.json", tok.to_string())]);
    let e = r.unwrap_err().to_string();
    assert!(e.contains("config.json") && e.contains("bos token id 10"), "{e}");
    assert!(out.is_none());
}
