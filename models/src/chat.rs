//! Chat templates: a model's `tokenizer.chat_template` (Jinja) rendered into the prompt text, as
//! Hugging Face transformers renders it (`apply_chat_template`), with minijinja.
//!
//! The template sees what transformers gives it: `messages` (a list of maps, each with at least
//! `role` and `content`), `add_generation_prompt`, `bos_token` / `eos_token` (the text of the
//! vocabulary's BOS / EOS ids, as llama.cpp passes them), and whatever else the caller adds
//! (`tools`, `enable_thinking`, ...). The environment is transformers': `trim_blocks` and
//! `lstrip_blocks` on, `{% break %}` / `{% continue %}`, the functions `raise_exception(msg)` and
//! `strftime_now(format)` (local time), a `tojson` filter that writes Python's
//! `json.dumps(x, ensure_ascii=False)` text (`indent`, `sort_keys`, `ensure_ascii`, `separators`),
//! and Python's string / dict / list methods (`.startswith`, `.split`, `.strip`, `.items()`, ...,
//! minijinja-contrib's `pycompat`).
//!
//! Not supported: transformers' `{% generation %}` tag (a template using it fails to compile with
//! [`ChatError::Syntax`], never renders differently).
//!
//! A template is untrusted input (it comes with the model file): one render runs at most
//! [`RENDER_FUEL`] template instructions and fails with [`ChatError::Render`] beyond that, so a
//! hostile template cannot hang the caller; recursion is bounded by minijinja.
//!
//! ```
//! use tessera_models::chat::{ChatMessage, ChatTemplate};
//!
//! let t = ChatTemplate::new(
//!     "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}\
//!      {% if add_generation_prompt %}<|assistant|>{% endif %}",
//! )?;
//! let text = t.render(&[ChatMessage::user("Hi")], true)?;
//! assert_eq!(text, "<|user|>Hi\n<|assistant|>");
//! # Ok::<(), tessera_models::chat::ChatError>(())
//! ```

use std::fmt::Write as _;

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind};
use serde_json::Value as Json;

use crate::gguf::{GgufError, GgufFile, Value as GgufValue};

/// The GGUF key of the default chat template (llama.cpp's converter writes it from
/// `tokenizer_config.json`'s `chat_template`).
pub const CHAT_TEMPLATE_KEY: &str = "tokenizer.chat_template";

/// The most template instructions one render may run (minijinja's fuel). A long conversation
/// through Qwen's template costs a few thousand per message.
pub const RENDER_FUEL: u64 = 20_000_000;

/// The name the template has in error messages.
const NAME: &str = "chat_template";

/// Why a chat template could not be loaded or rendered.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ChatError {
    /// The GGUF has no `tokenizer.chat_template` (or no template of the asked name).
    #[error("the GGUF has no chat template (`{key}`)")]
    NoTemplate { key: String },
    /// A GGUF key has the wrong type or an out-of-range value.
    #[error("`{key}`: {why}")]
    BadMetadata { key: String, why: String },
    /// The template does not compile.
    #[error("the chat template does not compile: {detail}")]
    Syntax { detail: String },
    /// The template called `raise_exception(message)` (it refuses the conversation).
    #[error("the chat template refused the conversation: {message}")]
    Raised { message: String },
    /// Rendering failed: an undefined value used, a bad filter argument, out of fuel, ...
    #[error("rendering the chat template failed: {detail}")]
    Render { detail: String },
    /// A variable given to [`ChatTemplate::render_json`] is one the renderer sets itself.
    #[error("`{name}` is set by the renderer and cannot be passed as an extra variable")]
    ReservedVariable { name: String },
    #[error(transparent)]
    Gguf(#[from] GgufError),
}

/// One message of a conversation: a role (`system`, `user`, `assistant`, `tool`) and its text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage { role: role.into(), content: content.into() }
    }

    pub fn system(content: impl Into<String>) -> ChatMessage {
        ChatMessage::new("system", content)
    }

    pub fn user(content: impl Into<String>) -> ChatMessage {
        ChatMessage::new("user", content)
    }

    pub fn assistant(content: impl Into<String>) -> ChatMessage {
        ChatMessage::new("assistant", content)
    }

    /// The message as the template sees it: a map `{role, content}`.
    fn to_value(&self) -> Value {
        Value::from_pairs([("role", Value::from(self.role.as_str())), ("content", Value::from(self.content.as_str()))])
    }
}

/// A compiled chat template and the special-token texts it is rendered with.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

/// The message of a `raise_exception` call, carried as the source of minijinja's error so that
/// [`ChatTemplate::render`] can tell a refusal from a template bug.
#[derive(Debug)]
struct Raised(String);

impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

impl ChatTemplate {
    /// Compiles `source` with transformers' environment; no special tokens
    /// ([`ChatTemplate::with_special_tokens`] sets them).
    pub fn new(source: impl Into<String>) -> Result<ChatTemplate, ChatError> {
        let source = source.into();
        let mut env = Environment::new();
        let syntax = env
            .syntax()
            .to_builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| ChatError::Syntax { detail: e.to_string() })?;
        env.set_syntax(syntax);
        env.set_fuel(Some(RENDER_FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, source.clone()).map_err(|e| ChatError::Syntax { detail: describe(&e) })?;
        Ok(ChatTemplate { env, source, bos_token: None, eos_token: None })
    }

    /// The default chat template of a GGUF (`tokenizer.chat_template`), with the texts of its
    /// `tokenizer.ggml.bos_token_id` / `eos_token_id` tokens (when present) as `bos_token` /
    /// `eos_token`.
    pub fn from_gguf(file: &GgufFile) -> Result<ChatTemplate, ChatError> {
        Self::from_gguf_key(file, CHAT_TEMPLATE_KEY)
    }

    /// A named template of a GGUF (`tokenizer.chat_template.{name}`, as llama.cpp's converter
    /// writes the extra templates of `chat_template` lists, e.g. `tool_use`).
    pub fn from_gguf_named(file: &GgufFile, name: &str) -> Result<ChatTemplate, ChatError> {
        Self::from_gguf_key(file, &format!("{CHAT_TEMPLATE_KEY}.{name}"))
    }

    fn from_gguf_key(file: &GgufFile, key: &str) -> Result<ChatTemplate, ChatError> {
        let source = match file.get(key) {
            None => return Err(ChatError::NoTemplate { key: key.to_string() }),
            Some(GgufValue::String(s)) => s.clone(),
            Some(v) => {
                let why = format!("is {}, expected a string", v.type_description());
                return Err(ChatError::BadMetadata { key: key.to_string(), why });
            }
        };
        let bos = special_token_text(file, "tokenizer.ggml.bos_token_id")?;
        let eos = special_token_text(file, "tokenizer.ggml.eos_token_id")?;
        Ok(ChatTemplate::new(source)?.with_special_tokens(bos, eos))
    }

    /// The same template rendered with these `bos_token` / `eos_token` texts (`None`: undefined).
    pub fn with_special_tokens(mut self, bos_token: Option<String>, eos_token: Option<String>) -> ChatTemplate {
        self.bos_token = bos_token;
        self.eos_token = eos_token;
        self
    }

    /// The template text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The `bos_token` text the template is rendered with.
    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    /// The `eos_token` text the template is rendered with.
    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// The prompt text of `messages`; with `add_generation_prompt`, followed by what starts the
    /// assistant's reply (for Qwen: `<|im_start|>assistant\n`).
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String, ChatError> {
        let messages: Vec<Value> = messages.iter().map(ChatMessage::to_value).collect();
        self.render_values(Value::from(messages), add_generation_prompt, Vec::new())
    }

    /// Like [`ChatTemplate::render`] with messages of any shape (`tool_calls`,
    /// `reasoning_content`, content lists, ...) and extra variables (`tools`, `enable_thinking`,
    /// `documents`, ...), as JSON. Maps keep `serde_json`'s key order. An extra variable named
    /// `messages`, `add_generation_prompt`, `bos_token` or `eos_token` is an error.
    pub fn render_json(
        &self,
        messages: &[Json],
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, Json>,
    ) -> Result<String, ChatError> {
        let mut vars = Vec::with_capacity(extra.len());
        for (k, v) in extra {
            if ["messages", "add_generation_prompt", "bos_token", "eos_token"].contains(&k.as_str()) {
                return Err(ChatError::ReservedVariable { name: k.clone() });
            }
            vars.push((k.clone(), json_to_value(v)));
        }
        let messages: Vec<Value> = messages.iter().map(json_to_value).collect();
        self.render_values(Value::from(messages), add_generation_prompt, vars)
    }

    fn render_values(
        &self,
        messages: Value,
        add_generation_prompt: bool,
        mut vars: Vec<(String, Value)>,
    ) -> Result<String, ChatError> {
        vars.push(("messages".into(), messages));
        vars.push(("add_generation_prompt".into(), Value::from(add_generation_prompt)));
        if let Some(b) = &self.bos_token {
            vars.push(("bos_token".into(), Value::from(b.as_str())));
        }
        if let Some(e) = &self.eos_token {
            vars.push(("eos_token".into(), Value::from(e.as_str())));
        }
        let tmpl = self.env.get_template(NAME).map_err(|e| ChatError::Render { detail: describe(&e) })?;
        tmpl.render(Value::from_pairs(vars)).map_err(|e| {
            let mut source = std::error::Error::source(&e);
            while let Some(s) = source {
                if let Some(r) = s.downcast_ref::<Raised>() {
                    return ChatError::Raised { message: r.0.clone() };
                }
                source = s.source();
            }
            ChatError::Render { detail: describe(&e) }
        })
    }
}

/// The text of the token whose id is at `key`, or `None` when the key is absent; an error when the
/// id is not an integer or not a token of `tokenizer.ggml.tokens`.
fn special_token_text(file: &GgufFile, key: &str) -> Result<Option<String>, ChatError> {
    let Some(v) = file.get(key) else { return Ok(None) };
    let bad = |why: String| ChatError::BadMetadata { key: key.to_string(), why };
    let id = v.as_int().ok_or_else(|| bad(format!("is {}, expected an integer", v.type_description())))?;
    let tokens = file.get_str_array("tokenizer.ggml.tokens")?;
    let tok = usize::try_from(id).ok().and_then(|i| tokens.get(i));
    tok.map(|t| Some(t.clone()))
        .ok_or_else(|| bad(format!("{id} is not a token id (the vocabulary has {})", tokens.len())))
}

/// minijinja's error with where it happened (line, and the failing source range's text).
fn describe(e: &Error) -> String {
    let mut s = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(inner) = source {
        let _ = write!(s, ": {inner}");
        source = inner.source();
    }
    s
}

/// `raise_exception(message)`: the template refuses the input (transformers raises
/// `TemplateError(message)`).
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, format!("raise_exception: {message}")).with_source(Raised(message)))
}

/// `strftime_now(format)`: the local time formatted by C's `strftime` (Python's
/// `datetime.now().strftime(format)` for the common directives).
fn strftime_now(format: String) -> Result<String, Error> {
    let bad = |why: &str| Error::new(ErrorKind::InvalidOperation, format!("strftime_now: {why}"));
    if format.is_empty() {
        return Ok(String::new());
    }
    let c_format = std::ffi::CString::new(format.as_str()).map_err(|_| bad("the format contains a NUL byte"))?;
    // SAFETY: `time` accepts a null pointer (it then only returns the time).
    let now = unsafe { libc::time(std::ptr::null_mut()) };
    // SAFETY: `tm` is plain data; all-zero is a valid value that `localtime_r` overwrites.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    // SAFETY: both pointers are to live locals of the right types.
    if unsafe { libc::localtime_r(&now, &mut tm) }.is_null() {
        return Err(bad("the local time is not available"));
    }
    // A result that does not fit makes strftime return 0: retry larger, up to a bound.
    let mut cap = 64 + 4 * format.len();
    while cap <= 1 << 16 {
        let mut buf = vec![0u8; cap];
        // SAFETY: `buf` has `cap` writable bytes, `c_format` is NUL-terminated, `tm` initialised.
        let n = unsafe { libc::strftime(buf.as_mut_ptr().cast(), cap, c_format.as_ptr(), &tm) };
        if n > 0 {
            buf.truncate(n);
            return String::from_utf8(buf).map_err(|_| bad("the result is not UTF-8"));
        }
        cap *= 4;
    }
    Err(bad("the result is longer than 64 KiB or empty"))
}

/// `tojson`: Python's `json.dumps(value, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`, the filter transformers installs (no HTML escaping, `", "` / `": "`
/// separators, `indent` puts one item a line).
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let indent: Option<String> = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or_default().to_string()),
        Some(v) => {
            let n = v.as_usize().filter(|&n| n <= 64).ok_or_else(|| {
                Error::new(ErrorKind::InvalidOperation, format!("tojson: indent must be 0..=64 or a string, not {v}"))
            })?;
            Some(" ".repeat(n))
        }
    };
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    let (item_sep, key_sep) = match separators {
        Some(s) if !s.is_none() => {
            let parts: Vec<Value> = s.try_iter()?.collect();
            match (parts.first().and_then(Value::as_str), parts.get(1).and_then(Value::as_str), parts.len()) {
                (Some(a), Some(b), 2) => (a.to_string(), b.to_string()),
                _ => {
                    return Err(Error::new(ErrorKind::InvalidOperation, "tojson: separators must be two strings"));
                }
            }
        }
        // Python's defaults: `", "` without indent, `","` with it (the newline follows).
        _ => (if indent.is_some() { "," } else { ", " }.to_string(), ": ".to_string()),
    };
    kwargs.assert_all_used()?;
    let mut w = JsonWriter {
        out: String::new(),
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
    };
    w.value(value, 0)?;
    Ok(Value::from_safe_string(w.out))
}

/// The most nested lists / maps `tojson` writes (Python's recursion limit is about 1000).
const JSON_MAX_DEPTH: usize = 256;

struct JsonWriter {
    out: String,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

impl JsonWriter {
    fn err(why: String) -> Error {
        Error::new(ErrorKind::BadSerialization, format!("tojson: {why}"))
    }

    fn value(&mut self, v: &Value, depth: usize) -> Result<(), Error> {
        if depth > JSON_MAX_DEPTH {
            return Err(Self::err(format!("nested deeper than {JSON_MAX_DEPTH} levels")));
        }
        match v.kind() {
            ValueKind::Undefined => return Err(Self::err("an undefined value is not JSON".into())),
            ValueKind::None => self.out.push_str("null"),
            ValueKind::Bool => self.out.push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number if v.is_integer() => {
                let _ = write!(self.out, "{v}");
            }
            ValueKind::Number => {
                let x = f64::try_from(v.clone()).map_err(|_| Self::err(format!("{v} is not a number")))?;
                self.out.push_str(&py_float_repr(x));
            }
            ValueKind::String => self.string(v.as_str().unwrap_or_default()),
            ValueKind::Map => {
                let mut entries = Vec::new();
                for k in v.try_iter()? {
                    let item = v.get_item(&k)?;
                    entries.push((json_key(&k)?, item));
                }
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(&b.0));
                }
                self.seq('{', '}', entries.len(), depth, |w, i| {
                    let (k, item) = &entries[i];
                    w.string(k);
                    let sep = w.key_sep.clone();
                    w.out.push_str(&sep);
                    w.value(item, depth + 1)
                })?;
            }
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = v.try_iter()?.collect();
                self.seq('[', ']', items.len(), depth, |w, i| w.value(&items[i], depth + 1))?;
            }
            _ => return Err(Self::err(format!("a {} is not JSON serializable", v.kind()))),
        }
        Ok(())
    }

    /// `open item sep item ... close`, one item a line when indenting (Python's layout).
    fn seq(
        &mut self,
        open: char,
        close: char,
        n: usize,
        depth: usize,
        mut item: impl FnMut(&mut JsonWriter, usize) -> Result<(), Error>,
    ) -> Result<(), Error> {
        self.out.push(open);
        if n == 0 {
            self.out.push(close);
            return Ok(());
        }
        for i in 0..n {
            if i > 0 {
                let sep = self.item_sep.clone();
                self.out.push_str(&sep);
            }
            self.newline(depth + 1);
            item(self, i)?;
        }
        self.newline(depth);
        self.out.push(close);
        Ok(())
    }

    fn newline(&mut self, depth: usize) {
        if let Some(ind) = &self.indent {
            self.out.push('\n');
            for _ in 0..depth {
                self.out.push_str(ind);
            }
        }
    }

    fn string(&mut self, s: &str) {
        self.out.push('"');
        for c in s.chars() {
            match c {
                '"' => self.out.push_str("\\\""),
                '\\' => self.out.push_str("\\\\"),
                '\n' => self.out.push_str("\\n"),
                '\r' => self.out.push_str("\\r"),
                '\t' => self.out.push_str("\\t"),
                '\u{8}' => self.out.push_str("\\b"),
                '\u{c}' => self.out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ensure_ascii && (c as u32) > 0x7e) => {
                    let mut units = [0u16; 2];
                    for u in c.encode_utf16(&mut units) {
                        let _ = write!(self.out, "\\u{u:04x}");
                    }
                }
                c => self.out.push(c),
            }
        }
        self.out.push('"');
    }
}

/// A map key as Python's `json.dumps` writes it: strings as they are, numbers, booleans and
/// `None` as their JSON text.
fn json_key(k: &Value) -> Result<String, Error> {
    match k.kind() {
        ValueKind::String => Ok(k.as_str().unwrap_or_default().to_string()),
        ValueKind::None => Ok("null".into()),
        ValueKind::Bool => Ok(if k.is_true() { "true" } else { "false" }.into()),
        ValueKind::Number if k.is_integer() => Ok(k.to_string()),
        ValueKind::Number => Ok(py_float_repr(f64::try_from(k.clone())?)),
        _ => Err(JsonWriter::err(format!("keys must be str, int, float, bool or None, not {}", k.kind()))),
    }
}

/// Python's `repr(float)` as `json.dumps` writes it: the shortest digits that round-trip, fixed
/// notation for exponents -4..16 (`1.0`, `0.0001`, `1234.5`), else `1e+16` / `1.5e-05`;
/// `NaN`, `Infinity`, `-Infinity` for the non-finite values.
pub fn py_float_repr(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    // Rust's `{:e}` is the shortest round-trip form: "-1.2345e-7", "1e0".
    let e_form = format!("{x:e}");
    let (mantissa, exp) = e_form.split_once('e').unwrap_or((&e_form, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = mantissa.strip_prefix('-').map_or(("", mantissa), |m| ("-", m));
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exp) {
        let point = exp + 1; // digits before the decimal point
        if point <= 0 {
            format!("{sign}0.{}{digits}", "0".repeat((-point) as usize))
        } else if digits.len() <= point as usize {
            format!("{sign}{digits}{}.0", "0".repeat(point as usize - digits.len()))
        } else {
            let (a, b) = digits.split_at(point as usize);
            format!("{sign}{a}.{b}")
        }
    } else {
        let m = if digits.len() > 1 { format!("{}.{}", &digits[..1], &digits[1..]) } else { digits };
        format!("{sign}{m}e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs())
    }
}

/// A JSON value as a template value (maps keep `serde_json`'s key order).
fn json_to_value(j: &Json) -> Value {
    match j {
        Json::Null => Value::from(()),
        Json::Bool(b) => Value::from(*b),
        Json::Number(n) => {
            if let Some(i) = n.as_i64() {
                Value::from(i)
            } else if let Some(u) = n.as_u64() {
                Value::from(u)
            } else {
                Value::from(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        Json::String(s) => Value::from(s.as_str()),
        Json::Array(a) => Value::from(a.iter().map(json_to_value).collect::<Vec<_>>()),
        Json::Object(m) => Value::from_pairs(m.iter().map(|(k, v)| (k.as_str(), json_to_value(v)))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_float_repr() {
        let cases = [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-2.5, "-2.5"),
            (1234.5, "1234.5"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (1.2345e300, "1.2345e+300"),
            (0.0, "0.0"),
            (f64::NAN, "NaN"),
            (f64::NEG_INFINITY, "-Infinity"),
        ];
        for (x, want) in cases {
            assert_eq!(py_float_repr(x), want, "{x}");
        }
    }
}
