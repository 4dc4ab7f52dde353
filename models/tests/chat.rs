//! Issue 24, item 2: chat templates rendered as transformers renders them.
//!
//! Templates (`tests/data/chat/`):
//! - `qwen35-vocab.jinja`: the `tokenizer.chat_template` of llama.cpp's qwen35 vocabulary file
//!   (`ggml-vocab-qwen35.gguf`), extracted byte for byte once;
//! - `tools-thinking.jinja`: written for these tests in the style of Qwen's templates (tools with
//!   `tojson`, a `namespace`, reversed slicing, `.startswith` / `.split` / `.strip`, reasoning
//!   kept only after the last user turn, `{% continue %}`, `raise_exception`);
//! - `tojson.jinja`: Python's `json.dumps` layouts.
//!
//! Every expected text below is what Python's Jinja2 3.1 renders with transformers' settings
//! (`ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`, loop controls, its
//! `tojson` / `raise_exception`); the `qwen35-vocab` ones were also derived by reading the
//! template (a default system prompt unless the first message is a system message, one
//! `<|im_start|>{role}\n{content}<|im_end|>\n` a message, then `<|im_start|>assistant\n`).

use std::time::Instant;

use serde_json::{Value as Json, json};
use tessera_models::chat::{CHAT_TEMPLATE_KEY, ChatError, ChatMessage, ChatTemplate};
use tessera_models::gguf::{GgufFile, GgufWriter};

fn data(name: &str) -> String {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/chat").join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn qwen() -> ChatTemplate {
    ChatTemplate::new(data("qwen35-vocab.jinja")).unwrap()
}

#[test]
fn qwen35_vocab_template_adds_the_default_system_prompt() {
    let text = qwen().render(&[ChatMessage::user("Hello")], true).unwrap();
    assert_eq!(
        text,
        "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n\
         <|im_start|>assistant\n"
    );
}

#[test]
fn qwen35_vocab_template_keeps_a_given_system_prompt() {
    let msgs = [ChatMessage::system("Sys"), ChatMessage::user("Hello"), ChatMessage::assistant("Hi there")];
    let text = qwen().render(&msgs, false).unwrap();
    assert_eq!(
        text,
        "<|im_start|>system\nSys<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\nHi \
         there<|im_end|>\n"
    );
    // The generation prompt is the only difference add_generation_prompt makes.
    let with = qwen().render(&msgs, true).unwrap();
    assert_eq!(with, format!("{text}<|im_start|>assistant\n"));
    // No messages: only the generation prompt.
    assert_eq!(qwen().render(&[], true).unwrap(), "<|im_start|>assistant\n");
}

fn tool() -> Json {
    // Keys in alphabetical order: serde_json's maps iterate sorted, Python's in insertion order.
    json!({"function": {"description": "Weather in a city, in °C", "name": "get_weather",
        "parameters": {"properties": {"city": {"type": "string"}}, "required": ["city"], "type": "object"}},
        "type": "function"})
}

#[test]
fn tools_reasoning_and_tool_calls_render_as_jinja2_does() {
    let t = ChatTemplate::new(data("tools-thinking.jinja")).unwrap();
    let messages = [
        json!({"role": "system", "content": "  Be brief.\n"}),
        json!({"role": "user", "content": "Weather in Paris?"}),
        json!({"role": "assistant", "content": "<think>\nThe user wants weather.\n</think>\n\nLet me check.",
            "tool_calls": [{"function": {"arguments": {"city": "Paris"}, "name": "get_weather"}, "type": "function"}]}),
        json!({"role": "tool", "content": "{\"temp\": 21.5}"}),
        json!({"role": "assistant", "content": "<think>\nGot it.\n</think>\n\nIt is 21.5 °C in Paris."}),
    ];
    let mut extra = serde_json::Map::new();
    extra.insert("tools".into(), json!([tool()]));
    extra.insert("enable_thinking".into(), json!(false));
    let text = t.render_json(&messages, true, &extra).unwrap();
    let want = "<|im_start|>system\nBe brief.\n\nYou may call these functions:\n<tools>\n{\"function\": {\"description\": \
                \"Weather in a city, in °C\", \"name\": \"get_weather\", \"parameters\": {\"properties\": {\"city\": \
                {\"type\": \"string\"}}, \"required\": [\"city\"], \"type\": \"object\"}}, \"type\": \
                \"function\"}\n</tools><|im_end|>\n<|im_start|>user\nWeather in \
                Paris?<|im_end|><|im_start|>assistant\n<think>\nThe user wants weather.\n</think>\n\nLet me \
                check.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \
                \"Paris\"}}\n</tool_call><|im_end|><|im_start|>user\n<tool_response>\n{\"temp\": \
                21.5}\n</tool_response><|im_end|><|im_start|>assistant\n<think>\nGot it.\n</think>\n\nIt is 21.5 °C in \
                Paris.<|im_end|><|im_start|>assistant\n<think>\n\n</think>\n\n";
    assert_eq!(text, want);
}

#[test]
fn reasoning_before_the_last_user_turn_is_dropped() {
    let t = ChatTemplate::new(data("tools-thinking.jinja")).unwrap();
    let msgs = [
        ChatMessage::system("You are terse."),
        ChatMessage::user("Hi"),
        ChatMessage::assistant("<think>greeting</think>Hello!"),
        ChatMessage::user("Bye"),
    ];
    let text = t.render(&msgs, true).unwrap();
    assert_eq!(
        text,
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|><|im_start|>assistant\n\
         Hello!<|im_end|><|im_start|>user\nBye<|im_end|><|im_start|>assistant\n"
    );
}

#[test]
fn raise_exception_is_a_refusal_with_the_templates_message() {
    let t = ChatTemplate::new(data("tools-thinking.jinja")).unwrap();
    let e = t.render(&[ChatMessage::assistant("x")], false).unwrap_err();
    match &e {
        ChatError::Raised { message } => assert_eq!(message, "the conversation needs a user message"),
        other => panic!("{other:?}"),
    }
    assert!(e.to_string().contains("the conversation needs a user message"), "{e}");
}

#[test]
fn tojson_writes_pythons_json_dumps() {
    let text = ChatTemplate::new(data("tojson.jinja")).unwrap().render(&[], false).unwrap();
    let want = "{\"b\": 1, \"a\": [1.5, \"é<>&'\\\"\\\\\\n\\t\\u0001\", null, true, 1e-05, 1e+16, 3.0, -0.25], \"c\": \
                {}, \"d\": []}|{\n  \"b\": 1,\n  \"a\": [\n    1.5,\n    \"é<>&'\\\"\\\\\\n\\t\\u0001\",\n    null,\n    \
                true,\n    1e-05,\n    1e+16,\n    3.0,\n    -0.25\n  ],\n  \"c\": {},\n  \"d\": []\n}|{\"a\": [1.5, \
                \"é<>&'\\\"\\\\\\n\\t\\u0001\", null, true, 1e-05, 1e+16, 3.0, -0.25], \"b\": 1, \"c\": {}, \"d\": \
                []}|{\"b\": 1, \"a\": [1.5, \"\\u00e9<>&'\\\"\\\\\\n\\t\\u0001\", null, true, 1e-05, 1e+16, 3.0, -0.25], \
                \"c\": {}, \"d\": []}|{\"b\":1,\"a\":[1.5,\"é<>&'\\\"\\\\\\n\\t\\u0001\",null,true,1e-05,1e+16,3.0,-0.25],\
                \"c\":{},\"d\":[]}";
    assert_eq!(text, want);
    // An undefined value is not JSON (Python raises too).
    let e = ChatTemplate::new("{{ nothing | tojson }}").unwrap().render(&[], false).unwrap_err();
    assert!(matches!(e, ChatError::Render { .. }) && e.to_string().contains("undefined"), "{e}");
}

#[test]
fn strftime_now_formats_the_local_time() {
    let t =
        ChatTemplate::new("{{ strftime_now('%Y-%m-%d') }}|{{ strftime_now('') }}|{{ strftime_now('%%') }}").unwrap();
    let text = t.render(&[], false).unwrap();
    let (date, rest) = text.split_once('|').unwrap();
    assert_eq!(rest, "|%");
    let parts: Vec<&str> = date.split('-').collect();
    assert_eq!(parts.len(), 3, "{text}");
    let year: u32 = parts[0].parse().unwrap();
    assert!((2024..3000).contains(&year), "{text}");
    assert!(parts[1].len() == 2 && parts[2].len() == 2, "{text}");
}

#[test]
fn python_string_and_dict_methods_work() {
    let t = ChatTemplate::new(
        "{{ '  a b  '.strip() }}|{{ 'x,y'.split(',') | join('+') }}|{{ 'abc'.startswith('ab') }}|\
         {{ 'abc'.endswith('x') }}|{{ 'ab'.upper() }}|{% for k, v in {'k': 1}.items() %}{{ k }}={{ v }}{% endfor %}|\
         {{ 'a\\n\\n'.rstrip('\\n') }}|{{ [1, 2, 3][::-1] | join }}|{{ none }}",
    )
    .unwrap();
    assert_eq!(t.render(&[], false).unwrap(), "a b|x+y|True|False|AB|k=1|a|321|None");
}

#[test]
fn special_tokens_come_from_the_vocabulary() {
    let mut w = GgufWriter::new();
    w.add_kv("tokenizer.ggml.tokens", vec!["a", "b", "<|endoftext|>", "<|im_end|>"]).unwrap();
    w.add_kv("tokenizer.ggml.bos_token_id", 2u32).unwrap();
    w.add_kv("tokenizer.ggml.eos_token_id", 3u32).unwrap();
    w.add_kv(CHAT_TEMPLATE_KEY, "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}")
        .unwrap();
    w.add_kv(format!("{CHAT_TEMPLATE_KEY}.tool_use"), "tools: {{ tools | length }}").unwrap();
    let f = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
    let t = ChatTemplate::from_gguf(&f).unwrap();
    assert_eq!((t.bos_token(), t.eos_token()), (Some("<|endoftext|>"), Some("<|im_end|>")));
    assert_eq!(
        t.render(&[ChatMessage::user("x"), ChatMessage::user("y")], false).unwrap(),
        "<|endoftext|>x<|im_end|>y<|im_end|>"
    );
    let named = ChatTemplate::from_gguf_named(&f, "tool_use").unwrap();
    let mut extra = serde_json::Map::new();
    extra.insert("tools".into(), json!([tool(), tool()]));
    assert_eq!(named.render_json(&[], false, &extra).unwrap(), "tools: 2");
    assert!(matches!(ChatTemplate::from_gguf_named(&f, "rag"), Err(ChatError::NoTemplate { .. })));
    // Without special token ids the names are undefined (and print nothing).
    let t = ChatTemplate::new("[{{ bos_token }}]").unwrap();
    assert_eq!(t.render(&[], false).unwrap(), "[]");
}

#[test]
fn bad_metadata_is_named() {
    let build = |f: &dyn Fn(&mut GgufWriter)| {
        let mut w = GgufWriter::new();
        w.add_kv("tokenizer.ggml.tokens", vec!["a", "b"]).unwrap();
        f(&mut w);
        GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap()
    };
    let f = build(&|_| {});
    let e = ChatTemplate::from_gguf(&f).unwrap_err();
    assert!(matches!(e, ChatError::NoTemplate { .. }) && e.to_string().contains(CHAT_TEMPLATE_KEY), "{e}");
    let f = build(&|w| {
        w.add_kv(CHAT_TEMPLATE_KEY, 7u32).unwrap();
    });
    let e = ChatTemplate::from_gguf(&f).unwrap_err();
    assert!(matches!(e, ChatError::BadMetadata { .. }) && e.to_string().contains("expected a string"), "{e}");
    let f = build(&|w| {
        w.add_kv(CHAT_TEMPLATE_KEY, "x").unwrap();
        w.add_kv("tokenizer.ggml.eos_token_id", 5u32).unwrap();
    });
    let e = ChatTemplate::from_gguf(&f).unwrap_err();
    assert!(e.to_string().contains("eos_token_id") && e.to_string().contains("5 is not a token id"), "{e}");
    let f = build(&|w| {
        w.add_kv(CHAT_TEMPLATE_KEY, "{% for %}").unwrap();
    });
    assert!(matches!(ChatTemplate::from_gguf(&f), Err(ChatError::Syntax { .. })));
}

#[test]
fn syntax_errors_name_the_line() {
    let e = ChatTemplate::new("line one\n{% if x %}\n{{ x }\n").unwrap_err();
    let s = e.to_string();
    assert!(matches!(e, ChatError::Syntax { .. }) && s.contains("chat_template:3"), "{s}");
    // transformers' {% generation %} tag is not supported: a clear error, not a wrong rendering.
    let e = ChatTemplate::new("{% generation %}x{% endgeneration %}").unwrap_err();
    assert!(matches!(e, ChatError::Syntax { .. }), "{e}");
}

#[test]
fn reserved_variables_cannot_be_overridden() {
    let t = qwen();
    for name in ["messages", "add_generation_prompt", "bos_token", "eos_token"] {
        let mut extra = serde_json::Map::new();
        extra.insert(name.into(), json!(1));
        let e = t.render_json(&[], false, &extra).unwrap_err();
        assert!(matches!(&e, ChatError::ReservedVariable { name: n } if n == name), "{e}");
    }
}

#[test]
fn a_runaway_template_runs_out_of_fuel_quickly() {
    let t = ChatTemplate::new("{% for i in range(10000) %}{% for j in range(10000) %}{{ j }}{% endfor %}{% endfor %}")
        .unwrap();
    let start = Instant::now();
    let e = t.render(&[], false).unwrap_err();
    assert!(matches!(e, ChatError::Render { .. }) && e.to_string().contains("fuel"), "{e}");
    assert!(start.elapsed().as_secs() < 30, "{:?}", start.elapsed());
    // Deep recursion through a macro is an error too, never a stack overflow.
    let t = ChatTemplate::new("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}").unwrap();
    assert!(matches!(t.render(&[], false), Err(ChatError::Render { .. })));
}

#[test]
fn a_long_conversation_fits_the_fuel() {
    let t = ChatTemplate::new(data("tools-thinking.jinja")).unwrap();
    let msgs: Vec<ChatMessage> = (0..2000)
        .map(|i| if i % 2 == 0 { ChatMessage::user(format!("q{i}")) } else { ChatMessage::assistant(format!("a{i}")) })
        .collect();
    let text = t.render(&msgs, true).unwrap();
    assert!(text.contains("q1998") && text.ends_with("<|im_start|>assistant\n"));
}
