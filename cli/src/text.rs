//! Text in and out for `tessera run`: prompts given as text (`--prompt`, with `--chat` through
//! the file's chat template) and generated tokens shown as text while they arrive, held back only
//! as long as they could still turn into a `--stop` string.

use std::path::Path;

use tessera_models::chat::{ChatMessage, ChatTemplate};
use tessera_models::gguf::GgufFile;
use tessera_models::tokenizer::{EncodeOptions, StreamDecoder, Tokenizer};

/// The file's tokenizer, or a message saying to use ids when it has none.
pub fn tokenizer(gguf: &GgufFile, file: &Path) -> Result<Tokenizer, String> {
    Tokenizer::from_gguf(gguf).map_err(|e| {
        format!("{}: {e}; this file cannot take text: give the prompt as token ids with --tokens", file.display())
    })
}

/// The ids of a text prompt. With `chat`, the text is the user's message rendered through the
/// file's chat template with the assistant's turn opened, and the template's control tokens
/// (`<|im_start|>`) are parsed; a plain prompt is encoded as text, so it cannot inject them.
pub fn encode_prompt(
    tok: &Tokenizer,
    gguf: &GgufFile,
    file: &Path,
    text: &str,
    chat: bool,
) -> Result<Vec<u32>, String> {
    let (text, parse_special) = if chat {
        let template = ChatTemplate::from_gguf(gguf).map_err(|e| format!("{}: --chat: {e}", file.display()))?;
        let rendered = template
            .render(&[ChatMessage::user(text)], true)
            .map_err(|e| format!("{}: --chat: {e}", file.display()))?;
        (rendered, true)
    } else {
        (text.to_string(), false)
    };
    let ids = tok.encode_with(&text, EncodeOptions { parse_special, add_bos: tok.add_bos() });
    if ids.is_empty() {
        return Err("--prompt: the text encodes to no tokens".into());
    }
    Ok(ids)
}

/// One sequence's generated text, decoded token by token.
pub struct TextStream<'t> {
    /// `None` once finished.
    decoder: Option<StreamDecoder<'t>>,
    text: String,
    /// Bytes of `text` already handed out.
    shown: usize,
    stops: &'t [String],
    stopped: bool,
}

impl<'t> TextStream<'t> {
    pub fn new(tok: &'t Tokenizer, stops: &'t [String]) -> TextStream<'t> {
        TextStream { decoder: Some(tok.stream_decoder(false)), text: String::new(), shown: 0, stops, stopped: false }
    }

    /// Adds a generated token; returns the text that can be shown now. After a stop string
    /// appears the text ends just before it and [`TextStream::stopped`] is true.
    pub fn push(&mut self, id: u32) -> Result<String, String> {
        let Some(decoder) = self.decoder.as_mut().filter(|_| !self.stopped) else { return Ok(String::new()) };
        self.text.push_str(&decoder.push(id).map_err(|e| e.to_string())?);
        if let Some(at) = self.stops.iter().filter_map(|s| self.text.find(s.as_str())).min() {
            self.text.truncate(at);
            self.stopped = true;
            return Ok(self.take(self.text.len()));
        }
        // Hold back a tail that could be the start of a stop string.
        let hold = self.stops.iter().map(|s| held_back(&self.text, s)).max().unwrap_or(0);
        Ok(self.take(self.text.len() - hold))
    }

    /// Whether a stop string ended the text.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// The rest of the text once the sequence finished (held-back bytes, an unfinished char).
    pub fn finish(&mut self) -> String {
        if let Some(decoder) = self.decoder.take()
            && !self.stopped
        {
            self.text.push_str(&decoder.finish());
        }
        self.take(self.text.len())
    }

    /// The whole text so far.
    pub fn text(&self) -> &str {
        &self.text
    }

    fn take(&mut self, upto: usize) -> String {
        let upto = floor_char_boundary(&self.text, upto.max(self.shown));
        let out = self.text[self.shown..upto].to_string();
        self.shown = upto;
        out
    }
}

/// Bytes at the end of `text` that are a proper prefix of `stop` (they may yet become it).
fn held_back(text: &str, stop: &str) -> usize {
    (1..stop.len())
        .rev()
        .find(|&n| {
            n <= text.len()
                && text.is_char_boundary(text.len() - n)
                && stop.as_bytes().starts_with(&text.as_bytes()[text.len() - n..])
        })
        .unwrap_or(0)
}

fn floor_char_boundary(s: &str, mut i: usize) -> usize {
    i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tail_that_may_become_a_stop_string_is_held_back() {
        assert_eq!(held_back("hello wor", "world"), 3);
        assert_eq!(held_back("hello", "world"), 0);
        assert_eq!(held_back("abc\n", "\n\n"), 1);
        assert_eq!(held_back("é", "éa"), 2);
    }
}
