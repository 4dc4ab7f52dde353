//! The GGUF tokenizer against llama.cpp's own tokenizer test for the Qwen 3.5 vocabulary
//! (tests/data/vocab/: the vocabulary-only GGUF, gzipped, its test strings and the ids llama.cpp
//! gives them), a round-trip property over arbitrary text, streaming decode, and bad metadata.

use std::io::Read;
use std::path::PathBuf;
use std::sync::OnceLock;

use proptest::prelude::*;
use tessera_models::gguf::{GgufFile, GgufWriter};
use tessera_models::tokenizer::{EncodeOptions, PreTokenizer, TokenType, Tokenizer, TokenizerError};

fn data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/vocab").join(name)
}

fn vocab_bytes() -> Vec<u8> {
    let gz = std::fs::read(data("ggml-vocab-qwen35.gguf.gz")).expect("fixture present");
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(&gz[..]).read_to_end(&mut out).expect("fixture is gzip");
    out
}

fn qwen35() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let f = GgufFile::from_bytes(vocab_bytes()).expect("fixture is a GGUF");
        Tokenizer::from_gguf(&f).expect("fixture has a tokenizer")
    })
}

/// llama.cpp's test cases: (text, ids).
fn cases() -> Vec<(String, Vec<u32>)> {
    let inp = std::fs::read_to_string(data("ggml-vocab-qwen35.gguf.inp")).expect("inp");
    let out = std::fs::read_to_string(data("ggml-vocab-qwen35.gguf.out")).expect("out");
    let texts: Vec<&str> = inp.split("\n__ggml_vocab_test__\n").collect();
    // The file ends with a separator: the last piece is empty and is no case.
    let texts = &texts[..texts.len() - 1];
    let ids: Vec<Vec<u32>> = out
        .split('\n')
        .take(texts.len())
        .map(|l| l.split_whitespace().map(|t| t.parse().expect("id")).collect())
        .collect();
    assert_eq!(texts.len(), ids.len());
    texts.iter().map(|t| t.to_string()).zip(ids).collect()
}

#[test]
fn reads_the_vocabulary_metadata() {
    let t = qwen35();
    assert_eq!(t.n_vocab(), 151_936);
    assert_eq!(t.pre_tokenizer(), PreTokenizer::Qwen35);
    assert_eq!(t.eos(), Some(151_643));
    assert_eq!(t.bos(), Some(151_643));
    assert_eq!(t.pad(), Some(151_643));
    assert!(!t.add_bos());
    assert!(t.chat_template().is_some_and(|s| s.contains("<|im_start|>")));
    let im_end = t.token_id("<|im_end|>").expect("<|im_end|> in vocab");
    assert_eq!(t.token_type(im_end), Some(TokenType::Control));
    assert!(t.is_eog(im_end) && t.is_eog(151_643));
    assert_eq!(t.eot(), Some(im_end));
    assert_eq!(t.token_text(9707), Some("Hello"));
}

#[test]
fn matches_llama_cpp_on_its_test_strings() {
    let t = qwen35();
    let cases = cases();
    assert_eq!(cases.len(), 50);
    let mut failed = Vec::new();
    for (text, want) in &cases {
        let got = t.encode(text);
        if &got != want {
            failed.push(format!("{text:?}\n  got  {got:?}\n  want {want:?}"));
        }
        assert_eq!(t.decode(want, false).unwrap(), *text, "decode of {want:?}");
    }
    assert!(failed.is_empty(), "{} of {} cases differ:\n{}", failed.len(), cases.len(), failed.join("\n"));
}

#[test]
fn special_tokens_are_cut_out_before_bpe() {
    let t = qwen35();
    let start = t.token_id("<|im_start|>").unwrap();
    let end = t.token_id("<|im_end|>").unwrap();
    let text = "<|im_start|>user\nHello<|im_end|>\n";
    let ids = t.encode(text);
    assert_eq!(ids[0], start);
    assert!(ids.contains(&end));
    let mut expect = vec![start];
    expect.extend(t.encode("user\nHello"));
    expect.push(end);
    expect.extend(t.encode("\n"));
    assert_eq!(ids, expect);
    // Decoded with specials they come back; without, they are dropped.
    assert_eq!(t.decode(&ids, true).unwrap(), text);
    assert_eq!(t.decode(&ids, false).unwrap(), "user\nHello\n");
    // Not parsed: the control token's text is encoded as plain text.
    let plain = t.encode_with(text, EncodeOptions { parse_special: false, add_bos: false });
    assert!(!plain.contains(&start) && !plain.contains(&end));
    assert_eq!(t.decode(&plain, false).unwrap(), text);
    // BOS on request.
    let with_bos = t.encode_with("Hi", EncodeOptions { parse_special: true, add_bos: true });
    assert_eq!(with_bos[0], 151_643);
}

#[test]
fn stream_decoding_holds_back_split_chars() {
    let t = qwen35();
    let text = "🦙 😶‍🌫️ Äpfel 我想在apple工作 ½";
    let ids = t.encode(text);
    let mut dec = t.stream_decoder(false);
    let mut got = String::new();
    let mut held = false;
    for &id in &ids {
        let s = dec.push(id).unwrap();
        // Every piece returned is whole chars; some tokens end inside a char.
        held |= s.is_empty() && dec.has_pending();
        got.push_str(&s);
    }
    assert!(held, "expected a token ending inside a char in {ids:?}");
    assert!(!dec.has_pending());
    assert_eq!(dec.finish(), "");
    assert_eq!(got, text);
    // A stream cut inside a char ends with U+FFFD.
    // " 🦙" is 11162 99 247 (llama.cpp's case): the first token is " " and 2 bytes of 4.
    let llama = t.encode(" 🦙");
    assert_eq!(llama, [11162, 99, 247]);
    let mut dec = t.stream_decoder(false);
    assert_eq!(dec.push(llama[0]).unwrap(), " ");
    assert_eq!(dec.finish(), "\u{FFFD}");
}

/// One word of 200,000 bytes merges in O(n log n) (a quadratic merge loop would take minutes).
#[test]
fn long_words_are_not_quadratic() {
    let t = qwen35();
    let mut state = 7u32;
    let letters: String = (0..200_000)
        .map(|_| {
            state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            char::from(b'a' + (state >> 24) as u8 % 26)
        })
        .collect();
    for text in [letters, "a".repeat(200_000), "!".repeat(200_000)] {
        let start = std::time::Instant::now();
        let ids = t.encode(&text);
        assert_eq!(t.decode(&ids, false).unwrap(), text);
        assert!(start.elapsed().as_secs() < 20, "{:?} for {} bytes", start.elapsed(), text.len());
    }
}

#[test]
fn bad_ids_are_errors() {
    let t = qwen35();
    let e = t.decode(&[9707, 200_000], false).unwrap_err();
    assert!(matches!(e, TokenizerError::IdOutOfRange { id: 200_000, n_vocab: 151_936 }), "{e}");
    assert!(t.piece(u32::MAX, true).is_err());
}

/// A tiny byte-level vocabulary: the 256 byte tokens plus `extra`, with `merges`.
fn tiny(extra: &[&str], merges: &[&str], pre: &str) -> GgufWriter {
    let mut tokens: Vec<String> = (0..=255u8).map(byte_char).collect();
    tokens.extend(extra.iter().map(|s| s.to_string()));
    let mut w = GgufWriter::new();
    w.add_kv("tokenizer.ggml.model", "gpt2").unwrap();
    w.add_kv("tokenizer.ggml.pre", pre).unwrap();
    w.add_kv("tokenizer.ggml.tokens", tokens).unwrap();
    w.add_kv("tokenizer.ggml.merges", merges.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
    w
}

/// GPT-2's byte alphabet, written out independently of the crate's.
fn byte_char(b: u8) -> String {
    let keep = |x: u32| (0x21..=0x7e).contains(&x) || (0xa1..=0xac).contains(&x) || (0xae..=0xff).contains(&x);
    let x = u32::from(b);
    if keep(x) {
        return char::from(b).to_string();
    }
    let n = (0..x).filter(|&y| !keep(y)).count() as u32;
    char::from_u32(256 + n).unwrap().to_string()
}

fn load(w: &GgufWriter) -> Result<Tokenizer, TokenizerError> {
    Tokenizer::from_gguf(&GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap())
}

#[test]
fn tiny_vocabulary_merges_by_rank() {
    let t = load(&tiny(&["ab", "bc", "Ġa"], &["b c", "a b", "Ġ a"], "qwen2")).unwrap();
    assert_eq!(t.pre_tokenizer(), PreTokenizer::Qwen2);
    // "abc": "b c" ranks first, leaving a + bc.
    // Token ids: byte b is id b; ab 256, bc 257, Ġa 258.
    assert_eq!(t.encode("abc"), [97, 257]);
    // " ab": "a b" (rank 1) before "Ġ a" (rank 2), and Ġ + ab has no merge.
    assert_eq!(t.encode(" ab"), [32, 256]);
    assert_eq!(t.encode(" a"), [258]);
    assert_eq!(t.decode(&t.encode("x abc\n"), false).unwrap(), "x abc\n");
}

#[test]
fn bad_metadata_is_a_clear_error() {
    let msg = |w: &GgufWriter| load(w).unwrap_err().to_string();
    // No tokenizer at all.
    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", "qwen35").unwrap();
    assert!(matches!(load(&w), Err(TokenizerError::Missing)));
    assert!(msg(&w).contains("no tokenizer"));
    // Model and pre-tokenizer we do not implement.
    assert!(msg(&tiny_with_model("llama")).contains("`llama` is not supported"));
    assert!(msg(&tiny(&[], &[], "llama3")).contains("tokenizer.ggml.pre `llama3`"));
    // A merge whose result is not a token.
    assert!(msg(&tiny(&[], &["a b"], "qwen2")).contains("merge 0 \"a b\": merged text is not a token"));
    assert!(msg(&tiny(&[], &["ab"], "qwen2")).contains("no space"));
    // Token types that do not fit.
    let mut w = tiny(&[], &[], "qwen2");
    w.add_kv("tokenizer.ggml.token_type", vec![1i32; 3]).unwrap();
    assert!(msg(&w).contains("3 entries for 256 tokens"));
    let mut w = tiny(&[], &[], "qwen2");
    w.add_kv("tokenizer.ggml.eos_token_id", 999u32).unwrap();
    assert!(msg(&w).contains("eos_token_id = 999 is out of range"));
    // A vocabulary missing a byte.
    let mut w = GgufWriter::new();
    w.add_kv("tokenizer.ggml.model", "gpt2").unwrap();
    w.add_kv("tokenizer.ggml.pre", "qwen35").unwrap();
    w.add_kv("tokenizer.ggml.tokens", vec!["a", "b"]).unwrap();
    w.add_kv("tokenizer.ggml.merges", Vec::<String>::new()).unwrap();
    assert!(msg(&w).contains("byte 0x00"));
}

fn tiny_with_model(model: &str) -> GgufWriter {
    let mut w = GgufWriter::new();
    w.add_kv("tokenizer.ggml.model", model).unwrap();
    w
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// decode(encode(s)) == s for any UTF-8, including control-token texts and odd whitespace.
    #[test]
    fn round_trips_any_text(s in "(\\PC|\\s|<\\|im_end\\|>|[\u{300}-\u{36f}]|'[sStT]|[0-9]+){0,40}") {
        let t = qwen35();
        let ids = t.encode(&s);
        prop_assert_eq!(t.decode(&ids, true).unwrap(), s.clone());
        let mut dec = t.stream_decoder(true);
        let mut streamed = String::new();
        for &id in &ids {
            streamed.push_str(&dec.push(id).unwrap());
        }
        streamed.push_str(&dec.finish());
        prop_assert_eq!(streamed, s);
    }

    #[test]
    fn round_trips_any_chars(s in any::<String>()) {
        let t = qwen35();
        prop_assert_eq!(t.decode(&t.encode(&s), true).unwrap(), s);
    }
}
