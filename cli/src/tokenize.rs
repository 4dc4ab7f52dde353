//! `tessera tokenize FILE "text" | --file PATH [--json] [--no-parse-special]`: the ids of a text
//! under a GGUF's tokenizer, as llama.cpp's `llama-tokenize` gives them.
//!
//! Prints the ids comma-separated on one line (the form `tessera run --tokens` reads), or with
//! `--json` one object `{"ids": [..], "pieces": [..]}` where each piece is the token's text
//! (control tokens as written; a token ending inside a UTF-8 char shows U+FFFD for the partial
//! bytes). Control tokens in the text (`<|im_start|>`) are parsed unless `--no-parse-special`;
//! BOS is added when the file's `tokenizer.ggml.add_bos_token` says so.

use std::path::Path;

use tessera_models::tokenizer::{EncodeOptions, Tokenizer};

use crate::inspect;

/// Where the text comes from.
pub enum Text<'a> {
    Arg(&'a str),
    File(&'a Path),
}

/// Loads the tokenizer of `gguf`, encodes the text and prints the result.
pub fn run(gguf: &Path, text: Text<'_>, json: bool, parse_special: bool) -> Result<(), String> {
    let text = match text {
        Text::Arg(s) => s.to_string(),
        Text::File(p) => {
            let bytes = tessera_files::read_input(p).map_err(|e| format!("{}: {e}", p.display()))?;
            String::from_utf8(bytes).map_err(|e| {
                format!("{}: not UTF-8 text (invalid byte at offset {})", p.display(), e.utf8_error().valid_up_to())
            })?
        }
    };
    let f = inspect::open(gguf)?;
    let tok = Tokenizer::from_gguf(&f).map_err(|e| format!("{}: {e}", gguf.display()))?;
    outln!("{}", render(&tok, &text, json, parse_special)?);
    Ok(())
}

/// The output for `text`: comma-separated ids, or the JSON object.
pub fn render(tok: &Tokenizer, text: &str, json: bool, parse_special: bool) -> Result<String, String> {
    let ids = tok.encode_with(text, EncodeOptions { parse_special, add_bos: tok.add_bos() });
    if !json {
        return Ok(ids.iter().map(u32::to_string).collect::<Vec<_>>().join(","));
    }
    let pieces = ids
        .iter()
        .map(|&id| tok.piece(id, true).map(|b| String::from_utf8_lossy(b).into_owned()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())?;
    Ok(serde_json::json!({ "ids": ids, "pieces": pieces }).to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_models::gguf::{GgufFile, GgufWriter};

    /// GPT-2's byte alphabet for one byte.
    fn byte_char(b: u8) -> String {
        let keep = |x: u32| (0x21..=0x7e).contains(&x) || (0xa1..=0xac).contains(&x) || (0xae..=0xff).contains(&x);
        let x = u32::from(b);
        if keep(x) {
            return char::from(b).to_string();
        }
        char::from_u32(256 + (0..x).filter(|&y| !keep(y)).count() as u32).unwrap().to_string()
    }

    fn tiny() -> GgufWriter {
        let mut tokens: Vec<String> = (0..=255u8).map(byte_char).collect();
        tokens.extend(["hi".to_string(), "Ġhi".to_string(), "<|end|>".to_string()]);
        let mut types = vec![1i32; 258];
        types.push(3);
        let mut w = GgufWriter::new();
        w.add_kv("tokenizer.ggml.model", "gpt2").unwrap();
        w.add_kv("tokenizer.ggml.pre", "qwen35").unwrap();
        w.add_kv("tokenizer.ggml.tokens", tokens).unwrap();
        w.add_kv("tokenizer.ggml.token_type", types).unwrap();
        w.add_kv("tokenizer.ggml.merges", vec!["h i", "Ġ hi"]).unwrap();
        w
    }

    #[test]
    fn prints_ids_and_json() {
        let f = GgufFile::from_bytes(tiny().to_bytes().unwrap()).unwrap();
        let tok = Tokenizer::from_gguf(&f).unwrap();
        assert_eq!(render(&tok, "hi hi<|end|>", false, true).unwrap(), "256,257,258");
        assert_eq!(render(&tok, "hi<|end|>", true, true).unwrap(), r#"{"ids":[256,258],"pieces":["hi","<|end|>"]}"#);
        // Not parsed: the control token's text is plain text.
        assert_eq!(render(&tok, "<|", false, false).unwrap(), "60,124");
    }

    #[test]
    fn a_file_without_a_tokenizer_says_so() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("none.gguf");
        let mut w = GgufWriter::new();
        w.add_kv("general.architecture", "qwen35").unwrap();
        std::fs::write(&path, w.to_bytes().unwrap()).unwrap();
        let e = run(&path, Text::Arg("hi"), false, true).unwrap_err();
        assert!(e.contains("none.gguf") && e.contains("no tokenizer in this GGUF"), "{e}");
        let text = dir.path().join("text.txt");
        std::fs::write(&text, [0xffu8, 0x41]).unwrap();
        let ok = dir.path().join("tok.gguf");
        std::fs::write(&ok, tiny().to_bytes().unwrap()).unwrap();
        let e = run(&ok, Text::File(&text), false, true).unwrap_err();
        assert!(e.contains("not UTF-8"), "{e}");
    }
}
