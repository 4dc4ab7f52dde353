//! The tokenizer a GGUF carries: byte-level BPE read from `tokenizer.ggml.*` metadata.
//!
//! Keys read (llama.cpp's names): `tokenizer.ggml.model` (must be `gpt2`, byte-level BPE),
//! `.pre` (`qwen35` or `qwen2`, see [`PreTokenizer`]), `.tokens`, `.token_type` (optional: all
//! normal), `.merges` (`"left right"`, rank = index), the special ids `.bos_token_id`,
//! `.eos_token_id`, `.eot_token_id`, `.eom_token_id`, `.padding_token_id`,
//! `.unknown_token_id`, `.add_bos_token`, and `tokenizer.chat_template`.
//!
//! Encoding, as llama.cpp does it:
//!
//! 1. Special tokens are cut out of the text first, whole: control (and unknown) tokens when
//!    `parse_special`, user-defined tokens always, longest token text first.
//! 2. The rest is split into words by the pre-tokenizer regex.
//! 3. Each word's UTF-8 bytes become byte tokens, merged by rank (`bpe.rs`).
//!
//! Decoding maps each token back to its bytes (normal tokens through the byte alphabet,
//! user-defined ones as written, control tokens only when asked for). A token may end inside a
//! UTF-8 sequence (an emoji is often two or three tokens): [`StreamDecoder`] holds such bytes back
//! until the char is complete. Why our own code and not the `tokenizers` crate: see docs/TEXT.md.

mod bpe;
mod pretok;

use std::collections::HashMap;
use std::ops::Range;

use aho_corasick::AhoCorasick;

pub use pretok::PreTokenizer;

use crate::gguf::{GgufError, GgufFile, Value};
use bpe::{MergeTable, pair_key};

/// A token's kind (`tokenizer.ggml.token_type`, llama.cpp's values).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenType {
    /// 0: not set.
    Undefined,
    /// 1: an ordinary BPE token, written in the byte alphabet.
    Normal,
    /// 2: the unknown token.
    Unknown,
    /// 3: a control token (`<|im_start|>`): matched in text only when parsing specials, and
    ///    decoded only when asked for.
    Control,
    /// 4: a user-defined token (`<think>`): always matched in text, decoded as written.
    UserDefined,
    /// 5: an unused slot.
    Unused,
    /// 6: a byte token (`<0x0A>`, SentencePiece vocabularies).
    Byte,
}

impl TokenType {
    fn from_i32(v: i32) -> Option<TokenType> {
        Some(match v {
            0 => TokenType::Undefined,
            1 => TokenType::Normal,
            2 => TokenType::Unknown,
            3 => TokenType::Control,
            4 => TokenType::UserDefined,
            5 => TokenType::Unused,
            6 => TokenType::Byte,
            _ => return None,
        })
    }
}

/// What can be wrong with a GGUF's tokenizer metadata or a decode request.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TokenizerError {
    /// The file has no `tokenizer.ggml.model` key: it carries no tokenizer.
    #[error("no tokenizer in this GGUF (tokenizer.ggml.model is missing)")]
    Missing,
    /// A `tokenizer.ggml.model` other than `gpt2`.
    #[error("tokenizer.ggml.model `{0}` is not supported (only `gpt2`, byte-level BPE)")]
    UnsupportedModel(String),
    /// A `tokenizer.ggml.pre` that is not implemented.
    #[error("tokenizer.ggml.pre `{0}` is not supported (supported: qwen35, qwen2)")]
    UnsupportedPre(String),
    /// A key of the wrong type, or unreadable.
    #[error("tokenizer metadata: {0}")]
    Gguf(#[from] GgufError),
    /// Metadata that is present but inconsistent.
    #[error("tokenizer metadata: {0}")]
    Invalid(String),
    /// A token id at or past the vocabulary size.
    #[error("token id {id} is out of range (vocabulary of {n_vocab} tokens)")]
    IdOutOfRange { id: u32, n_vocab: usize },
}

/// Options of [`Tokenizer::encode_with`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EncodeOptions {
    /// Cut control tokens (`<|im_start|>`) out of the text; otherwise their text is BPE-encoded
    /// like any other. User-defined tokens are matched either way.
    pub parse_special: bool,
    /// Put the BOS token first.
    pub add_bos: bool,
}

/// A GGUF's tokenizer. Cheap to share (`&self` everywhere, `Send + Sync`).
#[derive(Clone, Debug)]
pub struct Tokenizer {
    pre: PreTokenizer,
    splitter: pretok::Splitter,
    types: Vec<TokenType>,
    /// Token texts as stored in the vocabulary (byte alphabet for normal tokens).
    texts: Vec<String>,
    /// Every token's decoded bytes, back to back; `piece_ranges[id]` is its slice.
    piece_bytes: Vec<u8>,
    piece_ranges: Vec<Range<usize>>,
    byte_ids: [u32; 256],
    merges: MergeTable,
    /// Control, unknown and user-defined tokens, longest text first (ties by id).
    specials: Vec<u32>,
    /// Finds which of `specials` occur in a text (pattern i is `specials[i]`).
    special_finder: Option<AhoCorasick>,
    bos: Option<u32>,
    eos: Option<u32>,
    eot: Option<u32>,
    eom: Option<u32>,
    pad: Option<u32>,
    unk: Option<u32>,
    add_bos: bool,
    eog: Vec<u32>,
    chat_template: Option<String>,
}

/// Texts of control tokens that end a turn or a generation in the vocabularies we know, used
/// when the file names no EOT token (llama.cpp does the same).
const EOG_TEXTS: &[&str] = &["<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|eom_id|>"];

impl Tokenizer {
    /// Reads the tokenizer from a GGUF's metadata; [`TokenizerError::Missing`] when it has none.
    pub fn from_gguf(f: &GgufFile) -> Result<Tokenizer, TokenizerError> {
        let Some(model) = f.get("tokenizer.ggml.model") else { return Err(TokenizerError::Missing) };
        let model =
            model.as_str().ok_or_else(|| TokenizerError::Invalid("tokenizer.ggml.model is not a string".into()))?;
        if model != "gpt2" {
            return Err(TokenizerError::UnsupportedModel(model.to_string()));
        }
        let pre_name = match f.get("tokenizer.ggml.pre") {
            Some(_) => f.get_str("tokenizer.ggml.pre")?,
            None => {
                return Err(TokenizerError::Invalid("tokenizer.ggml.pre is missing (needed: qwen35 or qwen2)".into()));
            }
        };
        let pre =
            PreTokenizer::from_name(pre_name).ok_or_else(|| TokenizerError::UnsupportedPre(pre_name.to_string()))?;
        let texts = f.get_str_array("tokenizer.ggml.tokens")?.to_vec();
        let n_vocab = texts.len();
        if n_vocab == 0 || n_vocab > u32::MAX as usize {
            return Err(TokenizerError::Invalid(format!("tokenizer.ggml.tokens has {n_vocab} tokens")));
        }
        let types = match f.get("tokenizer.ggml.token_type") {
            None => vec![TokenType::Normal; n_vocab],
            Some(_) => {
                let raw = f.get_i32_array("tokenizer.ggml.token_type")?;
                if raw.len() != n_vocab {
                    return Err(TokenizerError::Invalid(format!(
                        "tokenizer.ggml.token_type has {} entries for {n_vocab} tokens",
                        raw.len()
                    )));
                }
                raw.iter()
                    .enumerate()
                    .map(|(i, &t)| {
                        TokenType::from_i32(t).ok_or_else(|| {
                            TokenizerError::Invalid(format!("token {i} has token type {t} (known: 0..=6)"))
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?
            }
        };
        let mut ids: HashMap<&str, u32> = HashMap::with_capacity(n_vocab);
        for (i, t) in texts.iter().enumerate() {
            // llama.cpp keeps the last id of a duplicated text; so do we.
            ids.insert(t.as_str(), i as u32);
        }

        // Decoded bytes of every token.
        let table = bpe::char_to_byte_table();
        let mut piece_bytes = Vec::new();
        let mut piece_ranges = Vec::with_capacity(n_vocab);
        for (i, (t, ty)) in texts.iter().zip(&types).enumerate() {
            let start = piece_bytes.len();
            match ty {
                TokenType::Normal => match bpe::decode_byte_chars(t, &table) {
                    Some(b) => piece_bytes.extend_from_slice(&b),
                    None => {
                        return Err(TokenizerError::Invalid(format!(
                            "normal token {i} {t:?} has a char outside the byte-level alphabet"
                        )));
                    }
                },
                _ => piece_bytes.extend_from_slice(t.as_bytes()),
            }
            piece_ranges.push(start..piece_bytes.len());
        }

        let mut byte_ids = [0u32; 256];
        for b in 0..=255u8 {
            let c = bpe::byte_char(b).to_string();
            byte_ids[b as usize] = *ids
                .get(c.as_str())
                .ok_or_else(|| TokenizerError::Invalid(format!("byte {b:#04x} ({c:?}) has no token")))?;
        }

        let merge_strs = f.get_str_array("tokenizer.ggml.merges")?;
        let mut merges = MergeTable::default();
        merges.reserve(merge_strs.len());
        let mut joined = String::new();
        for (rank, m) in merge_strs.iter().enumerate() {
            let bad = |why: &str| TokenizerError::Invalid(format!("merge {rank} {m:?}: {why}"));
            // The separator is the first space after the first char (a left part never is empty).
            let first = m.chars().next().map_or(0, char::len_utf8);
            let sep = m[first..].find(' ').map(|p| p + first).ok_or_else(|| bad("no space between its two parts"))?;
            let (l, r) = (&m[..sep], &m[sep + 1..]);
            let lid = *ids.get(l).ok_or_else(|| bad("left part is not a token"))?;
            let rid = *ids.get(r).ok_or_else(|| bad("right part is not a token"))?;
            joined.clear();
            joined.push_str(l);
            joined.push_str(r);
            let mid = *ids.get(joined.as_str()).ok_or_else(|| bad("merged text is not a token"))?;
            // The first (lowest-rank) occurrence of a pair wins.
            merges.entry(pair_key(lid, rid)).or_insert((rank as u32, mid));
        }

        let special_id = |key: &str| -> Result<Option<u32>, TokenizerError> {
            let Some(v) = f.get(key) else { return Ok(None) };
            let id = v.as_int().ok_or_else(|| TokenizerError::Invalid(format!("{key} is not an integer")))?;
            // llama.cpp writes -1 (as an unsigned max) for "none" in some converters.
            if id < 0 || id == i128::from(u32::MAX) {
                return Ok(None);
            }
            if id >= n_vocab as i128 {
                return Err(TokenizerError::Invalid(format!("{key} = {id} is out of range ({n_vocab} tokens)")));
            }
            Ok(Some(id as u32))
        };
        let bos = special_id("tokenizer.ggml.bos_token_id")?;
        let eos = special_id("tokenizer.ggml.eos_token_id")?;
        let mut eot = special_id("tokenizer.ggml.eot_token_id")?;
        let eom = special_id("tokenizer.ggml.eom_token_id")?;
        let pad = special_id("tokenizer.ggml.padding_token_id")?;
        let unk = special_id("tokenizer.ggml.unknown_token_id")?;
        let add_bos = match f.get("tokenizer.ggml.add_bos_token") {
            Some(Value::Bool(b)) => *b,
            Some(v) => {
                return Err(TokenizerError::Invalid(format!(
                    "tokenizer.ggml.add_bos_token is {}, expected bool",
                    v.type_description()
                )));
            }
            None => false,
        };
        let chat_template = match f.get("tokenizer.chat_template") {
            Some(_) => Some(f.get_str("tokenizer.chat_template")?.to_string()),
            None => None,
        };

        // End-of-generation set: eos, eot, eom, and the known end-of-turn control tokens.
        let mut eog: Vec<u32> = [eos, eot, eom].into_iter().flatten().collect();
        for (i, t) in texts.iter().enumerate() {
            if matches!(types[i], TokenType::Control | TokenType::UserDefined) && EOG_TEXTS.contains(&t.as_str()) {
                eog.push(i as u32);
                if eot.is_none() && (t == "<|im_end|>" || t == "<|eot_id|>" || t == "<end_of_turn>") {
                    eot = Some(i as u32);
                }
            }
        }
        eog.sort_unstable();
        eog.dedup();

        let mut specials: Vec<u32> = (0..n_vocab as u32)
            .filter(|&i| {
                matches!(types[i as usize], TokenType::Control | TokenType::UserDefined | TokenType::Unknown)
                    && !texts[i as usize].is_empty()
            })
            .collect();
        specials.sort_by(|&a, &b| texts[b as usize].len().cmp(&texts[a as usize].len()).then(a.cmp(&b)));
        let special_finder = if specials.is_empty() {
            None
        } else {
            let pats: Vec<&str> = specials.iter().map(|&i| texts[i as usize].as_str()).collect();
            Some(AhoCorasick::new(pats).map_err(|e| TokenizerError::Invalid(format!("special tokens: {e}")))?)
        };

        Ok(Tokenizer {
            pre,
            splitter: pretok::Splitter::new(pre),
            types,
            texts,
            piece_bytes,
            piece_ranges,
            byte_ids,
            merges,
            specials,
            special_finder,
            bos,
            eos,
            eot,
            eom,
            pad,
            unk,
            add_bos,
            eog,
            chat_template,
        })
    }

    /// Encodes `text` with control tokens parsed and no BOS (what llama.cpp's tokenizer tests
    /// and a chat-templated prompt want).
    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.encode_with(text, EncodeOptions { parse_special: true, add_bos: false })
    }

    /// Encodes `text` (see the module doc for the steps).
    pub fn encode_with(&self, text: &str, opts: EncodeOptions) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if opts.add_bos
            && let Some(b) = self.bos
        {
            out.push(b);
        }
        // Words seen in this call -> where their ids already are in `out`.
        let mut seen: HashMap<&str, Range<usize>> = HashMap::new();
        for frag in self.partition_special(text, opts.parse_special) {
            match frag {
                Fragment::Token(id) => out.push(id),
                Fragment::Text(r) => self.splitter.split(&text[r], |word| {
                    if let Some(prev) = seen.get(word) {
                        out.extend_from_within(prev.clone());
                        return;
                    }
                    let start = out.len();
                    bpe::merge_word(word.as_bytes(), &self.byte_ids, &self.merges, &mut out);
                    if word.len() <= 64 {
                        seen.insert(word, start..out.len());
                    }
                }),
            }
        }
        out
    }

    /// Cuts special tokens out of `text`, as llama.cpp does: each special token, longest first,
    /// splits every text fragment left where it occurs (leftmost first, no overlaps).
    fn partition_special(&self, text: &str, parse_special: bool) -> Vec<Fragment> {
        let mut frags = vec![Fragment::Text(0..text.len())];
        let Some(finder) = &self.special_finder else { return frags };
        if text.is_empty() {
            return Vec::new();
        }
        // Which specials occur at all (one pass), in `specials` order.
        let mut present: Vec<usize> = finder.find_overlapping_iter(text).map(|m| m.pattern().as_usize()).collect();
        present.sort_unstable();
        present.dedup();
        for p in present {
            let id = self.specials[p];
            if !parse_special && matches!(self.types[id as usize], TokenType::Control | TokenType::Unknown) {
                continue;
            }
            let needle = self.texts[id as usize].as_str();
            let mut next = Vec::with_capacity(frags.len() + 2);
            for frag in frags {
                let Fragment::Text(r) = frag else {
                    next.push(frag);
                    continue;
                };
                let mut at = r.start;
                while let Some(off) = text[at..r.end].find(needle) {
                    if off > 0 {
                        next.push(Fragment::Text(at..at + off));
                    }
                    next.push(Fragment::Token(id));
                    at += off + needle.len();
                }
                if at < r.end {
                    next.push(Fragment::Text(at..r.end));
                }
            }
            frags = next;
        }
        frags
    }

    /// The bytes of `ids`, concatenated; control tokens (and unknown, unused, undefined) only
    /// when `special`. Normal and user-defined tokens always.
    pub fn decode_bytes(&self, ids: &[u32], special: bool) -> Result<Vec<u8>, TokenizerError> {
        let mut out = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            out.extend_from_slice(self.piece(id, special)?);
        }
        Ok(out)
    }

    /// [`Tokenizer::decode_bytes`] as text; bytes that are not UTF-8 (a sequence cut off at
    /// either end) become U+FFFD.
    pub fn decode(&self, ids: &[u32], special: bool) -> Result<String, TokenizerError> {
        let bytes = self.decode_bytes(ids, special)?;
        Ok(match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        })
    }

    /// The bytes token `id` decodes to (empty for a control token unless `special`).
    pub fn piece(&self, id: u32, special: bool) -> Result<&[u8], TokenizerError> {
        let i = id as usize;
        let ty = *self.types.get(i).ok_or(TokenizerError::IdOutOfRange { id, n_vocab: self.types.len() })?;
        let shown = match ty {
            TokenType::Normal | TokenType::UserDefined | TokenType::Byte => true,
            TokenType::Control | TokenType::Unknown | TokenType::Unused | TokenType::Undefined => special,
        };
        Ok(if shown { &self.piece_bytes[self.piece_ranges[i].clone()] } else { &[] })
    }

    /// A decoder for a stream of generated tokens, holding back incomplete UTF-8.
    pub fn stream_decoder(&self, special: bool) -> StreamDecoder<'_> {
        StreamDecoder { tok: self, special, pending: Vec::new() }
    }

    /// The vocabulary size.
    pub fn n_vocab(&self) -> usize {
        self.texts.len()
    }
    /// The pre-tokenizer (`tokenizer.ggml.pre`).
    pub fn pre_tokenizer(&self) -> PreTokenizer {
        self.pre
    }
    /// Token `id`'s text as stored in the vocabulary (byte alphabet for normal tokens).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.texts.get(id as usize).map(String::as_str)
    }
    /// Token `id`'s type.
    pub fn token_type(&self, id: u32) -> Option<TokenType> {
        self.types.get(id as usize).copied()
    }
    /// The id of the token whose vocabulary text is `text` (`"<|im_end|>"`); a linear scan.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.texts.iter().rposition(|t| t == text).map(|i| i as u32)
    }
    /// `tokenizer.ggml.bos_token_id`.
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }
    /// `tokenizer.ggml.eos_token_id`.
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }
    /// `tokenizer.ggml.eot_token_id`, else `<|im_end|>` (or another known end-of-turn token).
    pub fn eot(&self) -> Option<u32> {
        self.eot
    }
    /// `tokenizer.ggml.eom_token_id`.
    pub fn eom(&self) -> Option<u32> {
        self.eom
    }
    /// `tokenizer.ggml.padding_token_id`.
    pub fn pad(&self) -> Option<u32> {
        self.pad
    }
    /// `tokenizer.ggml.unknown_token_id`.
    pub fn unk(&self) -> Option<u32> {
        self.unk
    }
    /// `tokenizer.ggml.add_bos_token` (false when absent).
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }
    /// The tokens that end a generation (eos, eot, eom, known end-of-turn tokens), sorted.
    pub fn eog_ids(&self) -> &[u32] {
        &self.eog
    }
    /// Whether `id` ends a generation.
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.binary_search(&id).is_ok()
    }
    /// `tokenizer.chat_template`, when the file has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }
}

/// A piece of the text being encoded: still text, or a special token cut out of it.
enum Fragment {
    Text(Range<usize>),
    Token(u32),
}

/// Decodes generated tokens one at a time into text, holding back the bytes of a char that a
/// token ends inside until the tokens that complete it arrive. Bytes that can never be UTF-8
/// come out as U+FFFD.
#[derive(Debug)]
pub struct StreamDecoder<'t> {
    tok: &'t Tokenizer,
    special: bool,
    pending: Vec<u8>,
}

impl StreamDecoder<'_> {
    /// Adds token `id`; returns the text it completes (possibly empty).
    pub fn push(&mut self, id: u32) -> Result<String, TokenizerError> {
        self.pending.extend_from_slice(self.tok.piece(id, self.special)?);
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (good, bad) = rest.split_at(e.valid_up_to());
                    // `good` was just checked to be UTF-8.
                    out.push_str(std::str::from_utf8(good).unwrap_or_default());
                    match e.error_len() {
                        // An incomplete char at the end: wait for more bytes.
                        None => {
                            rest = bad;
                            break;
                        }
                        Some(n) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            rest = &bad[n..];
                        }
                    }
                }
            }
        }
        self.pending = rest.to_vec();
        Ok(out)
    }

    /// Ends the stream: the bytes still held back (an unfinished char), as U+FFFD.
    pub fn finish(self) -> String {
        String::from_utf8_lossy(&self.pending).into_owned()
    }

    /// Whether bytes of an unfinished char are held back.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }
}
