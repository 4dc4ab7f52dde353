//! `tessera chat FILE`: an interactive conversation. Each line read from stdin is a user message;
//! the reply is streamed as it is generated. The conversation stays in the model's caches: a turn
//! feeds only the tokens that follow what the caches already hold (the chat template rendered
//! over the whole conversation, minus the common prefix with the tokens fed before), so a long
//! conversation is not prefilled again every turn. `/reset` starts over; end of input ends.
//!
//! The recurrent (DeltaNet) state cannot be rolled back, so when a new rendering does not extend
//! the tokens already fed (a template that rewrites earlier turns), the conversation is fed again
//! from the start, and that is said on stderr.

use std::io::BufRead;
use std::path::Path;

use tessera_graph::Backend;
use tessera_models::chat::{ChatMessage, ChatTemplate};
use tessera_models::config::ModelConfig;
use tessera_models::model::{Model, ModelOptions};
use tessera_models::sample::{Sampler, SamplerParams};
use tessera_models::tokenizer::{EncodeOptions, Tokenizer};
use tessera_ops::sample::SampleSettings;

use crate::backend::{self, BackendChoice};
use crate::{inspect, output, text};

/// What `tessera chat` was asked to do.
#[derive(Debug, Clone)]
pub struct ChatArgs {
    pub params: SamplerParams,
    /// Most tokens a reply may have.
    pub max_reply: usize,
    /// Tokens the conversation may hold in all.
    pub context: usize,
    /// A system message put first.
    pub system: Option<String>,
    pub backend: BackendChoice,
}

/// Cells per KV block of the conversation's cache.
const BLOCK: usize = 16;
/// Most tokens one step feeds.
const CHUNK: usize = 512;
/// The one sequence.
const SEQ: u32 = 0;

/// Runs the conversation over stdin and stdout.
pub fn run(file: &Path, args: &ChatArgs) -> Result<(), String> {
    args.params.validate().map_err(|e| e.to_string())?;
    let gguf = inspect::open(file)?;
    let config = ModelConfig::from_gguf(&gguf).map_err(|e| format!("{}: model config: {e}", file.display()))?;
    let tok = text::tokenizer(&gguf, file)?;
    let template = ChatTemplate::from_gguf(&gguf).map_err(|e| format!("{}: {e}", file.display()))?;
    let context = args.context.min(config.n_ctx_train).max(BLOCK);
    let backend::Opened { mut backend, description, kv_pad, .. } = backend::open(args.backend)?;
    let opts = ModelOptions {
        kv_blocks: context.div_ceil(BLOCK),
        block_size: BLOCK,
        max_context: context,
        n_slots: 1,
        kv_pad,
        ..ModelOptions::default()
    };
    let model = Model::load(&gguf, backend.as_mut(), opts).map_err(|e| format!("{}: {e}", file.display()))?;
    errln!(
        "chat with {} on {description} ({context} tokens of context; /reset starts over, end of input ends)",
        file.display()
    );
    let sampler = Sampler::new(args.params).map_err(|e| e.to_string())?;
    let mut chat = Chat { model, backend, tok: &tok, template, sampler, fed: Vec::new(), messages: Vec::new() };
    if let Some(s) = &args.system {
        chat.messages.push(ChatMessage::system(s.as_str()));
    }
    let stdin = std::io::stdin();
    for line in stdin.lock().lines() {
        let line = line.map_err(|e| format!("reading stdin: {e}"))?;
        let line = line.trim_end_matches('\r');
        if line.trim().is_empty() {
            continue;
        }
        if line.trim() == "/reset" {
            chat.reset(args.system.as_deref())?;
            errln!("(conversation reset)");
            continue;
        }
        let reply = chat.turn(line, args.max_reply)?;
        outln!();
        chat.messages.push(ChatMessage::assistant(reply));
    }
    chat.model.free(chat.backend.as_mut());
    Ok(())
}

/// A conversation held in the model's caches.
struct Chat<'t> {
    model: Model,
    backend: Box<dyn Backend>,
    tok: &'t Tokenizer,
    template: ChatTemplate,
    sampler: Sampler,
    /// The tokens the caches hold, in order.
    fed: Vec<u32>,
    messages: Vec<ChatMessage>,
}

impl Chat<'_> {
    /// Empties the caches and the conversation (keeping a system message).
    fn reset(&mut self, system: Option<&str>) -> Result<(), String> {
        if !self.fed.is_empty() {
            self.model.remove_sequence(SEQ).map_err(|e| e.to_string())?;
        }
        self.fed.clear();
        self.messages.clear();
        if let Some(s) = system {
            self.messages.push(ChatMessage::system(s));
        }
        Ok(())
    }

    /// One user message: feeds what the caches lack and streams the reply; returns its text.
    fn turn(&mut self, user: &str, max_reply: usize) -> Result<String, String> {
        self.messages.push(ChatMessage::user(user));
        let rendered = self.template.render(&self.messages, true).map_err(|e| e.to_string())?;
        let ids = self.tok.encode_with(&rendered, EncodeOptions { parse_special: true, add_bos: self.tok.add_bos() });
        let common = self.fed.iter().zip(&ids).take_while(|(a, b)| a == b).count();
        if common < self.fed.len() {
            // The recurrent state cannot be rolled back to the common prefix: start again.
            errln!("(the template rewrote earlier turns: feeding the conversation again)");
            self.model.remove_sequence(SEQ).map_err(|e| e.to_string())?;
            self.fed.clear();
        }
        let new = &ids[self.fed.len()..];
        if self.fed.len() + new.len() + max_reply > self.model.kv.config().max_context {
            self.messages.pop();
            return Err(format!(
                "the conversation would exceed the {} tokens of context (use /reset or a larger --context)",
                self.model.kv.config().max_context
            ));
        }
        let mut next = self.feed(new)?;
        let mut decoder = self.tok.stream_decoder(false);
        let mut reply = String::new();
        for _ in 0..max_reply {
            if self.tok.is_eog(next) {
                // Keep the end of the turn in the caches: the template writes it there too.
                self.feed_one(next, SampleSettings::greedy())?;
                break;
            }
            let piece = decoder.push(next).map_err(|e| e.to_string())?;
            out!("{piece}");
            output::flush();
            reply.push_str(&piece);
            let settings = self.sampler.next_settings();
            next = self.feed_one(next, settings)?;
        }
        let rest = decoder.finish();
        out!("{rest}");
        reply.push_str(&rest);
        Ok(reply)
    }

    /// Feeds `tokens` in chunks; returns the token sampled after the last one.
    fn feed(&mut self, tokens: &[u32]) -> Result<u32, String> {
        let mut last = None;
        for (i, chunk) in tokens.chunks(CHUNK).enumerate() {
            let final_chunk = (i + 1) * CHUNK >= tokens.len();
            let settings = if final_chunk { self.sampler.next_settings() } else { SampleSettings::greedy() };
            last = Some(self.step(chunk, settings)?);
        }
        last.ok_or_else(|| "nothing to feed: the rendered conversation adds no tokens".to_string())
    }

    fn feed_one(&mut self, token: u32, settings: SampleSettings) -> Result<u32, String> {
        self.step(&[token], settings)
    }

    fn step(&mut self, tokens: &[u32], settings: SampleSettings) -> Result<u32, String> {
        let out = self
            .model
            .step_sample_on(&mut [self.backend.as_mut()], &[(SEQ, tokens)], &[settings])
            .map_err(|e| e.to_string())?;
        self.fed.extend_from_slice(tokens);
        Ok(out[0])
    }
}
