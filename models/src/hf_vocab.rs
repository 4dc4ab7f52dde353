//! The vocabulary of a Hugging Face checkpoint (`tokenizer.json`, `tokenizer_config.json`,
//! `chat_template.jinja` / `chat_template.json`, `config.json`) as the GGUF `tokenizer.*` keys
//! llama.cpp's converter writes for Qwen3.5 (`_set_vocab_gpt2` + gguf-py's `SpecialVocab`;
//! semantics only), so that llama.cpp and Tessera's tokenizer load the converted file with text.
//!
//! | key | from |
//! | --- | --- |
//! | `tokenizer.ggml.model` | `"gpt2"` (a byte-level BPE `tokenizer.json` is required) |
//! | `tokenizer.ggml.pre` | the pre-tokenizer's split regex: Qwen3.5's is `"qwen35"`, Qwen2/3's `"qwen2"`; another is an error |
//! | `tokenizer.ggml.tokens` | id `i < vocab_size` (`config.json`): the added token or vocab entry with that id, else `[PAD{i}]` |
//! | `tokenizer.ggml.token_type` (i32) | 1 normal; 3 control for added tokens that are `special` or look special (`<\|...\|>`, ...); 4 user-defined for other added tokens; 5 unused for `[PAD{i}]` |
//! | `tokenizer.ggml.merges` | `model.merges`, `"a b"` strings or `["a", "b"]` pairs (a space inside a part is written as `Ġ`) |
//! | `tokenizer.ggml.{bos,eos,unknown,seperator,padding,cls,mask}_token_id` (u32) | `tokenizer_config.json`'s `{bos,eos,...}_token` text looked up in `added_tokens`, else `config.json`'s `{bos,...}_token_id` |
//! | `tokenizer.ggml.add_{bos,eos,sep}_token` (bool) | `tokenizer_config.json`'s `add_{bos,eos,sep}_token`; a `TemplateProcessing` post-processor that starts with BOS / ends with EOS sets them true |
//! | `tokenizer.chat_template` (+ `.{name}`, `tokenizer.chat_templates`) | `tokenizer_config.json`'s `chat_template` (a string or a list of `{name, template}`), else `chat_template.jinja`, else `chat_template.json` |
//!
//! A checkpoint without `tokenizer.json` converts without a vocabulary ([`read_hf_vocab`] returns
//! `None`). Every other problem (bad JSON, not BPE, an id at or beyond `vocab_size`, two tokens
//! with one id, an unknown pre-tokenizer) is an error naming the file and what was wrong.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde_json::Value as Json;

use crate::gguf::{Array, Value};

/// Token types (llama.cpp's `llama_token_type`, gguf-py's `TokenType`).
pub const TOKEN_NORMAL: i32 = 1;
pub const TOKEN_CONTROL: i32 = 3;
pub const TOKEN_USER_DEFINED: i32 = 4;
pub const TOKEN_UNUSED: i32 = 5;

/// Qwen3.5's pre-tokenizer regex as its `tokenizer.json` writes it (llama.cpp's `qwen35`).
pub const QWEN35_PRE_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's / Qwen3's (llama.cpp's `qwen2`).
pub const QWEN2_PRE_REGEX: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The special-token kinds gguf-py's `SpecialVocab` reads, with their GGUF id keys (llama.cpp
/// spells `seperator`).
const SPECIAL: [(&str, &str); 7] = [
    ("bos", "tokenizer.ggml.bos_token_id"),
    ("eos", "tokenizer.ggml.eos_token_id"),
    ("unk", "tokenizer.ggml.unknown_token_id"),
    ("sep", "tokenizer.ggml.seperator_token_id"),
    ("pad", "tokenizer.ggml.padding_token_id"),
    ("cls", "tokenizer.ggml.cls_token_id"),
    ("mask", "tokenizer.ggml.mask_token_id"),
];

/// The `add_*_token` flags llama.cpp has keys for.
const ADD_KEYS: [(&str, &str); 3] = [
    ("bos", "tokenizer.ggml.add_bos_token"),
    ("eos", "tokenizer.ggml.add_eos_token"),
    ("sep", "tokenizer.ggml.add_sep_token"),
];

/// Why a checkpoint's vocabulary could not be read.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {why}")]
pub struct VocabError {
    pub path: PathBuf,
    pub why: String,
}

/// A checkpoint's vocabulary, ready to be written as GGUF metadata.
#[derive(Debug, Clone, PartialEq)]
pub struct HfVocab {
    pub pre: String,
    pub tokens: Vec<String>,
    pub token_types: Vec<i32>,
    pub merges: Vec<String>,
    /// `(kind, id)` in the order gguf-py sets them (`bos`, `eos`, ... from `tokenizer_config.json`
    /// first, then the ones only `config.json` has).
    pub special_ids: Vec<(&'static str, u32)>,
    /// `(kind, add)` for `bos`, `eos`, `sep`.
    pub add_special: Vec<(&'static str, bool)>,
    /// `(name, template)`; the name `default` is `tokenizer.chat_template`.
    pub chat_templates: Vec<(String, String)>,
    /// Things read but not written (as gguf-py logs them), one line each.
    pub notes: Vec<String>,
}

impl HfVocab {
    /// The `tokenizer.*` key-value pairs, in llama.cpp's order.
    pub fn to_metadata(&self) -> Vec<(String, Value)> {
        let mut kv: Vec<(String, Value)> = vec![
            ("tokenizer.ggml.model".into(), Value::from("gpt2")),
            ("tokenizer.ggml.pre".into(), Value::from(self.pre.as_str())),
            ("tokenizer.ggml.tokens".into(), Value::Array(Array::String(self.tokens.clone()))),
            ("tokenizer.ggml.token_type".into(), Value::Array(Array::I32(self.token_types.clone()))),
        ];
        if !self.merges.is_empty() {
            kv.push(("tokenizer.ggml.merges".into(), Value::Array(Array::String(self.merges.clone()))));
        }
        for (kind, id) in &self.special_ids {
            if let Some((_, key)) = SPECIAL.iter().find(|(k, _)| k == kind) {
                kv.push(((*key).into(), Value::U32(*id)));
            }
        }
        for (kind, add) in &self.add_special {
            if let Some((_, key)) = ADD_KEYS.iter().find(|(k, _)| k == kind) {
                kv.push(((*key).into(), Value::Bool(*add)));
            }
        }
        let mut names = Vec::new();
        for (name, t) in &self.chat_templates {
            if name == "default" {
                kv.push(("tokenizer.chat_template".into(), Value::from(t.as_str())));
            } else {
                kv.push((format!("tokenizer.chat_template.{name}"), Value::from(t.as_str())));
                names.push(name.clone());
            }
        }
        if !names.is_empty() {
            kv.push(("tokenizer.chat_templates".into(), Value::Array(Array::String(names))));
        }
        kv
    }
}

fn read_json(path: &Path) -> Result<Option<Json>, VocabError> {
    let text = match tessera_files::read_input_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(VocabError { path: path.into(), why: e.to_string() }),
    };
    serde_json::from_str(&text).map(Some).map_err(|e| VocabError { path: path.into(), why: format!("bad JSON: {e}") })
}

/// Does `t` look like a control token although not marked special (gguf-py's
/// `does_token_look_special`)?
fn looks_special(t: &str) -> bool {
    ["<pad>", "<mask>", "<2mass>", "[@BOS@]"].contains(&t)
        || (t.starts_with("<|") && t.ends_with("|>"))
        || (t.starts_with("<\u{ff5c}") && t.ends_with("\u{ff5c}>"))
        || (t.starts_with("<unused") && t.ends_with('>'))
}

/// The regex of the pre-tokenizer's `Split` (alone or in a `Sequence`), if any.
fn split_regex(pre: &Json) -> Option<&str> {
    match pre.get("type").and_then(Json::as_str) {
        Some("Split") => pre.get("pattern").and_then(|p| p.get("Regex")).and_then(Json::as_str),
        Some("Sequence") => pre.get("pretokenizers")?.as_array()?.iter().find_map(split_regex),
        _ => None,
    }
}

/// The vocabulary of the checkpoint in `dir` with `n_vocab` ids (`config.json`'s `vocab_size`),
/// or `None` when it has no `tokenizer.json`. `config` is the parsed `config.json`.
pub fn read_hf_vocab(dir: &Path, n_vocab: usize, config: &Json) -> Result<Option<HfVocab>, VocabError> {
    let tok_path = dir.join("tokenizer.json");
    let Some(tok) = read_json(&tok_path)? else { return Ok(None) };
    let err = |why: String| VocabError { path: tok_path.clone(), why };
    let model = tok.get("model").ok_or_else(|| err("no `model`".into()))?;
    let mtype = model.get("type").and_then(Json::as_str).unwrap_or("");
    if mtype != "BPE" || model.get("byte_fallback").and_then(Json::as_bool).unwrap_or(false) {
        return Err(err(format!("`model` is a {mtype} tokenizer; a byte-level BPE (GPT-2 style) is needed")));
    }
    // The pre-tokenizer names llama.cpp's `pre` (it hashes tokenizations; the regex says the same).
    let regex = tok.get("pre_tokenizer").and_then(split_regex);
    let pre = match regex {
        Some(QWEN35_PRE_REGEX) => "qwen35",
        Some(QWEN2_PRE_REGEX) => "qwen2",
        Some(r) => return Err(err(format!("unknown pre-tokenizer regex `{r}` (Qwen3.5's or Qwen2's is expected)"))),
        None => return Err(err("no `pre_tokenizer` Split regex (Qwen3.5's is expected)".into())),
    };

    // id -> text: the model's vocab, then added tokens (which may repeat a vocab entry).
    let vocab = model.get("vocab").and_then(Json::as_object).ok_or_else(|| err("no `model.vocab` map".into()))?;
    let mut by_id: Vec<Option<&str>> = vec![None; n_vocab];
    // Checks `id` (an integer below `n_vocab`, not another text's) and records `text` there.
    let place = |by_id: &[Option<&str>], text: &str, id: &Json, what: &str| -> Result<usize, VocabError> {
        let i = id
            .as_u64()
            .and_then(|i| usize::try_from(i).ok())
            .ok_or_else(|| err(format!("{what} `{text}`: id {id} is not a non-negative integer")))?;
        if i >= n_vocab {
            return Err(err(format!("{what} `{text}` has id {i}, but config.json's vocab_size is {n_vocab}")));
        }
        if let Some(prev) = by_id[i].filter(|p| *p != text) {
            return Err(err(format!("tokens `{prev}` and `{text}` both have id {i}")));
        }
        Ok(i)
    };
    for (text, id) in vocab {
        let i = place(&by_id, text, id, "token")?;
        by_id[i] = Some(text.as_str());
    }
    let mut added: HashMap<usize, bool> = HashMap::new();
    let added_list = tok.get("added_tokens").and_then(Json::as_array).map(Vec::as_slice).unwrap_or(&[]);
    for a in added_list {
        let text =
            a.get("content").and_then(Json::as_str).ok_or_else(|| err(format!("added token {a} has no `content`")))?;
        let i = place(&by_id, text, a.get("id").unwrap_or(&Json::Null), "added token")?;
        by_id[i] = Some(text);
        added.insert(i, a.get("special").and_then(Json::as_bool).unwrap_or(false));
    }
    let mut tokens = Vec::with_capacity(n_vocab);
    let mut token_types = Vec::with_capacity(n_vocab);
    for (i, t) in by_id.iter().enumerate() {
        match (t, added.get(&i)) {
            (None, _) => {
                tokens.push(format!("[PAD{i}]"));
                token_types.push(TOKEN_UNUSED);
            }
            (Some(t), Some(special)) if *special || looks_special(t) => {
                tokens.push(t.to_string());
                token_types.push(TOKEN_CONTROL);
            }
            (Some(t), Some(_)) => {
                // gguf-py pre-normalizes SentencePiece spaces in user-defined tokens.
                tokens.push(t.replace('\u{2581}', " "));
                token_types.push(TOKEN_USER_DEFINED);
            }
            (Some(t), None) => {
                tokens.push(t.to_string());
                token_types.push(TOKEN_NORMAL);
            }
        }
    }

    let mut merges = Vec::new();
    if let Some(m) = model.get("merges") {
        let m = m.as_array().ok_or_else(|| err("`model.merges` is not a list".into()))?;
        merges.reserve(m.len());
        for (i, e) in m.iter().enumerate() {
            match e {
                Json::String(s) => merges.push(s.clone()),
                Json::Array(p) if p.len() == 2 && p.iter().all(Json::is_string) => {
                    // A space inside a part would split the pair: written as U+0120, as gguf-py does.
                    let part = |j: &Json| j.as_str().unwrap_or_default().replace(' ', "\u{120}");
                    merges.push(format!("{} {}", part(&p[0]), part(&p[1])));
                }
                _ => return Err(err(format!("merge {i} is {e}, expected \"a b\" or [\"a\", \"b\"]"))),
            }
        }
    }

    let mut v = HfVocab {
        pre: pre.into(),
        tokens,
        token_types,
        merges,
        special_ids: Vec::new(),
        add_special: Vec::new(),
        chat_templates: Vec::new(),
        notes: Vec::new(),
    };
    special_tokens(dir, &tok, added_list, config, n_vocab, &mut v)?;
    Ok(Some(v))
}

/// Special token ids, `add_*_token` flags and the chat template (gguf-py's `SpecialVocab` with
/// `load_merges`, without `n_vocab`: ids beyond the vocabulary are refused here, not skipped).
fn special_tokens(
    dir: &Path,
    tok: &Json,
    added: &[Json],
    config: &Json,
    n_vocab: usize,
    v: &mut HfVocab,
) -> Result<(), VocabError> {
    let cfg_path = dir.join("tokenizer_config.json");
    let tc = read_json(&cfg_path)?.unwrap_or(Json::Null);
    let text_of = |j: Option<&Json>| -> Option<String> {
        match j? {
            Json::String(s) => Some(s.clone()),
            Json::Object(o) => o.get("content").and_then(Json::as_str).map(str::to_string),
            _ => None,
        }
    };
    let set = |v: &mut HfVocab, kind: &'static str, id: i64, from: &Path| -> Result<(), VocabError> {
        if v.special_ids.iter().any(|(k, _)| *k == kind) {
            return Ok(());
        }
        match u32::try_from(id).ok().filter(|&i| (i as usize) < n_vocab) {
            Some(i) => {
                v.special_ids.push((kind, i));
                Ok(())
            }
            None => Err(VocabError {
                path: from.into(),
                why: format!("the {kind} token id {id} is not a token id (vocab_size {n_vocab})"),
            }),
        }
    };
    // A TemplateProcessing post-processor that wraps a sequence in BOS / EOS adds them.
    let bos_text = text_of(tc.get("bos_token")).or_else(|| text_of(tc.get("cls_token")));
    let eos_text = text_of(tc.get("eos_token")).or_else(|| text_of(tc.get("sep_token")));
    if let Some(pp) = tok.get("post_processor").filter(|p| !p.is_null()) {
        let procs: Vec<&Json> = match pp.get("processors").and_then(Json::as_array) {
            Some(list) => list.iter().collect(),
            None => vec![pp],
        };
        for p in procs {
            if p.get("type").and_then(Json::as_str) != Some("TemplateProcessing") {
                continue;
            }
            let single = p.get("single").and_then(Json::as_array).map(Vec::as_slice).unwrap_or(&[]);
            let special_id = |e: Option<&Json>| {
                e.and_then(|e| e.get("SpecialToken"))
                    .and_then(|s| s.get("id"))
                    .and_then(Json::as_str)
                    .map(str::to_string)
            };
            if single.len() > 1 {
                if let Some(first) = special_id(single.first()) {
                    v.add_special.push(("bos", Some(&first) == bos_text.as_ref()));
                }
                if let Some(last) = special_id(single.last()) {
                    v.add_special.push(("eos", Some(&last) == eos_text.as_ref()));
                }
            }
        }
    }
    if tc.is_object() && tc.as_object().is_some_and(|o| !o.is_empty()) {
        // The chat template: tokenizer_config.json's, else chat_template.jinja, else .json.
        let jinja = dir.join("chat_template.jinja");
        let json = dir.join("chat_template.json");
        let alt: Option<Json> = match tessera_files::read_input_to_string(&jinja) {
            Ok(t) => Some(Json::String(t)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                read_json(&json)?.and_then(|j| j.get("chat_template").cloned())
            }
            Err(e) => return Err(VocabError { path: jinja, why: e.to_string() }),
        };
        match tc.get("chat_template").cloned().or(alt) {
            None | Some(Json::Null) => {}
            Some(Json::String(t)) => v.chat_templates.push(("default".into(), t)),
            Some(Json::Array(list)) => {
                for c in list {
                    let name = c.get("name").and_then(Json::as_str).unwrap_or("");
                    let name: String =
                        name.chars().map(|ch| if ch.is_ascii_alphanumeric() { ch } else { '_' }).collect();
                    if let (false, Some(t)) = (name.is_empty(), c.get("template").and_then(Json::as_str)) {
                        v.chat_templates.retain(|(n, _)| *n != name);
                        v.chat_templates.push((name, t.to_string()));
                    }
                }
            }
            Some(other) => v.notes.push(format!(
                "{}: `chat_template` is {other:.40}, neither a string nor a list; ignored",
                cfg_path.display()
            )),
        }
        for (kind, _) in SPECIAL {
            if let Some(add) = tc.get(format!("add_{kind}_token")).and_then(Json::as_bool) {
                v.add_special.retain(|(k, _)| *k != kind);
                if ADD_KEYS.iter().any(|(k, _)| *k == kind) {
                    v.add_special.push((kind, add));
                } else {
                    v.notes.push(format!("add_{kind}_token has no GGUF key; not written"));
                }
            }
            let text = match kind {
                "bos" => bos_text.clone(),
                "eos" => eos_text.clone(),
                _ => text_of(tc.get(format!("{kind}_token"))),
            };
            let Some(text) = text else { continue };
            let id = added.iter().find(|a| a.get("content").and_then(Json::as_str) == Some(text.as_str()));
            if let Some(id) = id.and_then(|a| a.get("id")).and_then(Json::as_i64) {
                set(v, kind, id, &cfg_path)?;
            }
        }
    }
    // config.json's `{kind}_token_id` for the kinds still unset (integers only, as gguf-py).
    let cfg = dir.join("config.json");
    for (kind, _) in SPECIAL {
        let key = format!("{kind}_token_id");
        let id = config.get(&key).filter(|j| !j.is_null()).or_else(|| config.get("text_config")?.get(&key));
        if let Some(id) = id.and_then(Json::as_i64) {
            set(v, kind, id, &cfg)?;
        }
    }
    Ok(())
}
