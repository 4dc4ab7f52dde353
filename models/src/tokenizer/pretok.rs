//! Pre-tokenizers: split text into the words that BPE merges within (never across).
//!
//! `qwen35` and `qwen2` (`tokenizer.ggml.pre`) are one regex each, as llama.cpp writes them:
//!
//! ```text
//! qwen2:  (?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}
//!         | ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
//! qwen35: the same with combining marks kept in words: [\p{L}\p{M}]+ for \p{L}+, and
//!         [^\s\p{L}\p{M}\p{N}] in the punctuation runs
//! ```
//!
//! The contractions are spelled out (`'[sS]`) rather than `(?i:'s)`: Unicode case folding would
//! also take `'ſ` (long s) and `'K` (Kelvin sign). The `regex` crate (linear time, no
//! look-around) runs the pattern without `\s+(?!\S)`; its one effect is restored by hand: a run
//! of spaces (no newline, or `\s*[\r\n]+` would have matched) followed by a non-space gives up its
//! last char, which then starts the next word (" Hello" keeps its space). Every other alternative
//! is unchanged, and the `regex` crate's leftmost-first alternation is the backtracking order.

use regex::Regex;

/// The pre-tokenizers this tokenizer implements (`tokenizer.ggml.pre`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreTokenizer {
    /// `qwen2` (also written by converters for Qwen 2 / 2.5 / 3 and their distillations).
    Qwen2,
    /// `qwen35`: Qwen 3.5, combining marks kept with their letters.
    Qwen35,
}

impl PreTokenizer {
    /// The pre-tokenizer for a `tokenizer.ggml.pre` value, `None` when not implemented.
    pub fn from_name(name: &str) -> Option<PreTokenizer> {
        match name {
            "qwen2" | "deepseek-r1-qwen" => Some(PreTokenizer::Qwen2),
            "qwen35" => Some(PreTokenizer::Qwen35),
            _ => None,
        }
    }

    /// The `tokenizer.ggml.pre` name.
    pub fn name(self) -> &'static str {
        match self {
            PreTokenizer::Qwen2 => "qwen2",
            PreTokenizer::Qwen35 => "qwen35",
        }
    }

    /// The pattern the `regex` crate runs: llama.cpp's with `\s+(?!\S)|\s+` as `\s+` (see the
    /// module doc for how the look-ahead is restored).
    fn pattern(self) -> &'static str {
        match self {
            PreTokenizer::Qwen2 => {
                r"'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD]|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+"
            }
            PreTokenizer::Qwen35 => {
                r"'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD]|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+"
            }
        }
    }
}

/// A compiled pre-tokenizer.
#[derive(Clone, Debug)]
pub(crate) struct Splitter {
    re: Regex,
}

impl Splitter {
    pub(crate) fn new(pre: PreTokenizer) -> Splitter {
        // The patterns are constants checked by the tests below; a failure here is a bug.
        let re = Regex::new(pre.pattern()).expect("pre-tokenizer pattern compiles");
        Splitter { re }
    }

    /// Calls `f` with each word of `text`, in order; the words concatenate to `text`.
    pub(crate) fn split<'t>(&self, text: &'t str, mut f: impl FnMut(&'t str)) {
        let mut pos = 0;
        while pos < text.len() {
            let Some(m) = self.re.find_at(text, pos) else {
                // Every char is matched by some alternative; keep the rest whole regardless.
                f(&text[pos..]);
                return;
            };
            if m.start() > pos {
                f(&text[pos..m.start()]);
            }
            let mut end = m.end();
            let word = m.as_str();
            // `\s+(?!\S)`: a space run (no newline) before a non-space leaves its last char.
            if end < text.len()
                && word.chars().nth(1).is_some()
                && word.chars().all(|c| c.is_whitespace() && c != '\r' && c != '\n')
            {
                let last = word.chars().next_back().map_or(0, char::len_utf8);
                end -= last;
            }
            f(&text[m.start()..end]);
            pos = end;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(pre: PreTokenizer, s: &str) -> Vec<String> {
        let mut v = Vec::new();
        Splitter::new(pre).split(s, |w| v.push(w.to_string()));
        v
    }

    #[test]
    fn splits_like_the_backtracking_regex() {
        let q = PreTokenizer::Qwen35;
        assert_eq!(words(q, "Hello world"), ["Hello", " world"]);
        assert_eq!(words(q, "   Hello"), ["  ", " Hello"]);
        assert_eq!(words(q, "a  \n  b"), ["a", "  \n", " ", " b"]);
        assert_eq!(words(q, "x   "), ["x", "   "]);
        assert_eq!(words(q, "I'll 333"), ["I", "'ll", " ", "3", "3", "3"]);
        assert_eq!(words(q, "it'S"), ["it", "'S"]);
        assert_eq!(words(q, "!!! ("), ["!!!", " ("]);
        assert_eq!(words(q, "\n\n\tx"), ["\n\n", "\tx"]);
        // A combining mark stays in its word with qwen35, not with qwen2.
        assert_eq!(words(q, "Vie\u{0302}t"), ["Vie\u{0302}t"]);
        assert_eq!(words(PreTokenizer::Qwen2, "Vie\u{0302}t"), ["Vie", "\u{0302}t"]);
        // Long s is not an `'s` contraction.
        assert_eq!(words(q, "'ſ"), ["'ſ"]);
    }

    #[test]
    fn names_round_trip() {
        for p in [PreTokenizer::Qwen2, PreTokenizer::Qwen35] {
            assert_eq!(PreTokenizer::from_name(p.name()), Some(p));
        }
        assert_eq!(PreTokenizer::from_name("llama3"), None);
    }
}
