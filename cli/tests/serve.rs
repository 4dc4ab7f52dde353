//! `tessera serve` through a real socket on 127.0.0.1 (a free port the server picks and prints):
//! OpenAI's request and response shapes, streamed and not; concurrent clients get what each gets
//! alone (greedy); a client that goes away frees its cache blocks; a full queue is a 503; bad
//! and hostile requests are each a 4xx and the server keeps serving. The model is a tiny
//! synthetic qwen35moe speaking the fixture vocabulary (as in tests/text.rs).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

fn tessera() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tessera"))
}

/// A tiny-moe model speaking the fixture vocabulary.
fn model(dir: &Path) -> PathBuf {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tests/data/vocab/ggml-vocab-qwen35.gguf.gz");
    let mut vocab = Vec::new();
    flate2::read::GzDecoder::new(std::fs::File::open(fixture).unwrap()).read_to_end(&mut vocab).unwrap();
    let vocab_path = dir.join("vocab.gguf");
    std::fs::write(&vocab_path, vocab).unwrap();
    let out = dir.join("m.gguf");
    let st = tessera()
        .args(["synth", "--preset", "tiny-moe", "--dtype", "f32", "-q", "-o"])
        .arg(&out)
        .arg("--vocab")
        .arg(&vocab_path)
        .output()
        .unwrap();
    assert!(st.status.success(), "{}", String::from_utf8_lossy(&st.stderr));
    out
}

/// A running server, killed when dropped.
struct Server {
    child: Child,
    addr: SocketAddr,
    _dir: tempfile::TempDir,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve(extra: &[&str]) -> Server {
    let dir = tempfile::tempdir().unwrap();
    let m = model(dir.path());
    let mut child = tessera()
        .arg("serve")
        .arg(&m)
        .args(["--backend", "cpu", "--port", "0", "--ctx", "256"])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let addr = line.trim().strip_prefix("listening on http://").unwrap_or_else(|| panic!("{line:?}")).parse().unwrap();
    Server { child, addr, _dir: dir }
}

/// An HTTP/1.1 answer: status, headers (lower-case names), body (de-chunked).
struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&self.body)))
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The `data:` payloads of an SSE body.
    fn events(&self) -> Vec<String> {
        self.text().lines().filter_map(|l| l.strip_prefix("data: ")).map(str::to_string).collect()
    }
}

fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    s
}

fn send(s: &mut TcpStream, method: &str, path: &str, body: &[u8]) -> std::io::Result<()> {
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes())?;
    s.write_all(body)
}

fn read_answer(mut s: TcpStream) -> Answer {
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    parse(&raw)
}

fn parse(raw: &[u8]) -> Answer {
    let end =
        raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap_or_else(|| panic!("{:?}", String::from_utf8_lossy(raw)));
    let head = String::from_utf8_lossy(&raw[..end]).into_owned();
    let mut lines = head.lines();
    let status = lines.next().unwrap().split(' ').nth(1).unwrap().parse().unwrap();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let mut body = raw[end + 4..].to_vec();
    if headers.iter().any(|(k, v)| k == "transfer-encoding" && v.contains("chunked")) {
        body = dechunk(&body);
    }
    Answer { status, headers, body }
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(nl) = b.windows(2).position(|w| w == b"\r\n") {
        let n = usize::from_str_radix(std::str::from_utf8(&b[..nl]).unwrap().trim(), 16).unwrap();
        if n == 0 {
            break;
        }
        out.extend_from_slice(&b[nl + 2..nl + 2 + n]);
        b = &b[nl + 2 + n + 2..];
    }
    out
}

fn request(addr: SocketAddr, method: &str, path: &str, body: &[u8]) -> Answer {
    let mut s = connect(addr);
    send(&mut s, method, path, body).unwrap();
    read_answer(s)
}

fn post(addr: SocketAddr, path: &str, body: &Value) -> Answer {
    request(addr, "POST", path, body.to_string().as_bytes())
}

fn get(addr: SocketAddr, path: &str) -> Answer {
    request(addr, "GET", path, b"")
}

/// A metric's value in the Prometheus text.
fn metric(addr: SocketAddr, name: &str) -> f64 {
    let text = get(addr, "/metrics").text();
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("no {name} in\n{text}"))
        .parse()
        .unwrap()
}

/// The text of a streamed completion and its finish reason.
fn streamed_text(a: &Answer, chat: bool) -> (String, String) {
    let events = a.events();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{}", a.text());
    let mut text = String::new();
    let mut finish = String::new();
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap();
        let Some(c) = v["choices"].get(0) else { continue };
        let piece = if chat { &c["delta"]["content"] } else { &c["text"] };
        text.push_str(piece.as_str().unwrap_or(""));
        if let Some(f) = c["finish_reason"].as_str() {
            finish = f.to_string();
        }
    }
    (text, finish)
}

#[test]
fn completions_chat_models_health_and_metrics() {
    let server = serve(&[]);
    let addr = server.addr;

    let models = get(addr, "/v1/models");
    assert_eq!(models.status, 200);
    assert_eq!(models.json()["data"][0]["id"], "m");
    assert_eq!(get(addr, "/health").json()["status"], "ok");

    // Greedy completion: OpenAI's shape, `length` after max_tokens, usage counted.
    let req = json!({"model": "m", "prompt": "Hello, world", "max_tokens": 6, "temperature": 0});
    let a = post(addr, "/v1/completions", &req);
    assert_eq!(a.status, 200, "{}", a.text());
    let v = a.json();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["prompt_tokens"], 3);
    assert_eq!(v["usage"]["completion_tokens"], 6);
    assert_eq!(v["usage"]["total_tokens"], 9);
    let text = v["choices"][0]["text"].as_str().unwrap().to_string();
    assert!(!text.is_empty());

    // The same streamed: the same text, chunk by chunk, ending in [DONE]; usage when asked.
    let mut sreq = req.clone();
    sreq["stream"] = json!(true);
    sreq["stream_options"] = json!({"include_usage": true});
    let a = post(addr, "/v1/completions", &sreq);
    assert_eq!(a.status, 200);
    assert!(a.headers.iter().any(|(k, v)| k == "content-type" && v.starts_with("text/event-stream")));
    assert_eq!(streamed_text(&a, false), (text.clone(), "length".to_string()));
    let events = a.events();
    let usage: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], 6);

    // A stop string ends the text just before it, with finish_reason stop.
    let stop: String = text.chars().skip(text.chars().count() / 2).take(3).collect();
    if !stop.trim().is_empty() {
        let mut r = req.clone();
        r["stop"] = json!([stop]);
        let v = post(addr, "/v1/completions", &r).json();
        let cut = v["choices"][0]["text"].as_str().unwrap();
        assert!(text.starts_with(cut) && !cut.contains(&stop), "{stop:?}: {cut:?} of {text:?}");
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
    }

    // Chat: the template renders the messages; streamed and not agree.
    let chat = json!({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                      "max_tokens": 4, "temperature": 0});
    let v = post(addr, "/v1/chat/completions", &chat).json();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    let reply = v["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() > 5);
    let mut schat = chat.clone();
    schat["stream"] = json!(true);
    let a = post(addr, "/v1/chat/completions", &schat);
    let (streamed, finish) = streamed_text(&a, true);
    assert_eq!(streamed, reply);
    assert_eq!(finish, v["choices"][0]["finish_reason"].as_str().unwrap());
    let first: Value = serde_json::from_str(&a.events()[0]).unwrap();
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");

    // Prompts may be token ids.
    let v =
        post(addr, "/v1/completions", &json!({"prompt": [9707, 11, 1879], "max_tokens": 6, "temperature": 0})).json();
    assert_eq!(v["choices"][0]["text"].as_str().unwrap(), text);

    let m = get(addr, "/metrics");
    assert!(m.headers.iter().any(|(k, v)| k == "content-type" && v.starts_with("text/plain")));
    let m = m.text();
    assert!(m.contains("tessera_requests_total{route=\"/v1/completions\",status=\"200\"}"), "{m}");
    assert!(m.contains("# TYPE tessera_step_seconds histogram"), "{m}");
    assert!(metric(addr, "tessera_generated_tokens_total") >= 18.0);
    assert!(metric(addr, "tessera_prompt_tokens_total") >= 12.0);
    // The gauge is set by the engine thread between steps, after the last reply went out.
    eventually("no sequence running", || metric(addr, "tessera_sequences_running") == 0.0);
}

#[test]
fn concurrent_clients_get_what_each_gets_alone() {
    let server = serve(&["--max-seqs", "3", "--max-tokens-per-step", "16"]);
    let addr = server.addr;
    let prompts = ["Hello, world", "The quick brown fox jumps over the lazy dog", "1 2 3"];
    let body = |p: &str, stream: bool| json!({"prompt": p, "max_tokens": 12, "temperature": 0, "stream": stream, "stop": ["\u{1}"]});
    let alone: Vec<String> = prompts
        .iter()
        .map(|p| {
            post(addr, "/v1/completions", &body(p, false)).json()["choices"][0]["text"].as_str().unwrap().to_string()
        })
        .collect();
    // Together, twice over (one streamed, one not, per prompt): six clients at once.
    let handles: Vec<_> = prompts
        .iter()
        .flat_map(|p| [(p.to_string(), false), (p.to_string(), true)])
        .map(|(p, stream)| {
            std::thread::spawn(move || {
                let a = post(addr, "/v1/completions", &body(&p, stream));
                assert_eq!(a.status, 200, "{}", a.text());
                if stream {
                    streamed_text(&a, false).0
                } else {
                    a.json()["choices"][0]["text"].as_str().unwrap().to_string()
                }
            })
        })
        .collect();
    let together: Vec<String> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    for (i, a) in alone.iter().enumerate() {
        assert_eq!(&together[2 * i], a, "prompt {i}, not streamed");
        assert_eq!(&together[2 * i + 1], a, "prompt {i}, streamed");
    }
}

/// Waits until `f` holds (the engine thread acts between steps).
fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < Duration::from_secs(60), "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Opens a streamed completion and reads up to its first event; returns the open connection.
fn open_stream(addr: SocketAddr, max_tokens: usize) -> (TcpStream, Vec<u8>) {
    let mut s = connect(addr);
    let body = json!({"prompt": "Count: 1 2 3", "max_tokens": max_tokens, "temperature": 0, "stream": true});
    send(&mut s, "POST", "/v1/completions", body.to_string().as_bytes()).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !got.windows(6).any(|w| w == b"data: ") {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
    }
    (s, got)
}

#[test]
fn a_client_that_goes_away_frees_its_blocks_and_a_full_queue_is_503() {
    let server = serve(&["--max-seqs", "1", "--queue", "1"]);
    let addr = server.addr;
    // One running (holding blocks), one waiting in the queue.
    let (a, _) = open_stream(addr, 200);
    eventually("blocks in use", || metric(addr, "tessera_kv_blocks_used") > 0.0);
    let mut b = connect(addr);
    let body = json!({"prompt": "waiting", "max_tokens": 200, "temperature": 0, "stream": true});
    send(&mut b, "POST", "/v1/completions", body.to_string().as_bytes()).unwrap();
    eventually("a waiting sequence", || metric(addr, "tessera_sequences_waiting") == 1.0);
    // A third is beyond the queue: 503 with a clear body.
    let c = post(addr, "/v1/completions", &json!({"prompt": "x", "max_tokens": 2}));
    assert_eq!(c.status, 503, "{}", c.text());
    assert!(c.json()["error"]["message"].as_str().unwrap().contains("busy"), "{}", c.text());
    assert!(c.headers.iter().any(|(k, _)| k == "retry-after"));
    // Both clients go away: their sequences are cancelled and every block is free, long before
    // 200 tokens could have been generated.
    drop(a);
    drop(b);
    eventually("the cache emptied", || {
        metric(addr, "tessera_kv_blocks_used") == 0.0
            && metric(addr, "tessera_sequences_running") == 0.0
            && metric(addr, "tessera_sequences_waiting") == 0.0
    });
    assert!(metric(addr, "tessera_cancelled_total") >= 2.0);
    assert!(metric(addr, "tessera_generated_tokens_total") < 200.0);
    // The same for a client waiting on a whole (not streamed) answer.
    let before = metric(addr, "tessera_generated_tokens_total");
    let mut w = connect(addr);
    let body = json!({"prompt": "whole", "max_tokens": 240, "temperature": 0, "stop": ["\u{1}"]});
    send(&mut w, "POST", "/v1/completions", body.to_string().as_bytes()).unwrap();
    eventually("blocks in use", || metric(addr, "tessera_kv_blocks_used") > 0.0);
    drop(w);
    eventually("the cache emptied", || metric(addr, "tessera_kv_blocks_used") == 0.0);
    assert!(metric(addr, "tessera_cancelled_total") >= 3.0);
    assert!(metric(addr, "tessera_generated_tokens_total") - before < 240.0);
    // And the server takes new work.
    let a = post(addr, "/v1/completions", &json!({"prompt": "again", "max_tokens": 2, "temperature": 0}));
    assert_eq!(a.status, 200, "{}", a.text());
}

#[test]
fn bad_and_hostile_requests_get_4xx_and_the_server_keeps_serving() {
    let server = serve(&[]);
    let addr = server.addr;
    let ok = json!({"prompt": "Hello", "max_tokens": 2, "temperature": 0});
    let with = |k: &str, v: Value| {
        let mut r = ok.clone();
        r[k] = v;
        r
    };
    // (body, status, the field the error names).
    let cases: Vec<(Vec<u8>, u16, Option<&str>)> = vec![
        (b"{\"prompt\": \"Hello\", ".to_vec(), 400, None),
        (b"not json at all".to_vec(), 400, None),
        (b"[1, 2, 3]".to_vec(), 400, None),
        (b"{\"prompt\": \"\xff\xfe\x80\"}".to_vec(), 400, None),
        (with("max_tokens", json!(1u64 << 60)).to_string().into_bytes(), 400, Some("max_tokens")),
        (with("max_tokens", json!(0)).to_string().into_bytes(), 400, Some("max_tokens")),
        (with("max_tokens", json!(-5)).to_string().into_bytes(), 400, Some("max_tokens")),
        (with("max_tokens", json!("ten")).to_string().into_bytes(), 400, Some("max_tokens")),
        (with("temperature", json!(-1.0)).to_string().into_bytes(), 400, Some("temperature")),
        (with("temperature", json!("hot")).to_string().into_bytes(), 400, Some("temperature")),
        (with("top_p", json!(0)).to_string().into_bytes(), 400, Some("top_p")),
        (with("top_p", json!(1.5)).to_string().into_bytes(), 400, Some("top_p")),
        (with("top_k", json!(-7)).to_string().into_bytes(), 400, Some("top_k")),
        (with("seed", json!(-1)).to_string().into_bytes(), 400, Some("seed")),
        (with("stop", json!(["a", "b", "c", "d", "e"])).to_string().into_bytes(), 400, Some("stop")),
        (with("stop", json!([""])).to_string().into_bytes(), 400, Some("stop")),
        (with("stop", json!(7)).to_string().into_bytes(), 400, Some("stop")),
        (with("stream", json!("yes")).to_string().into_bytes(), 400, Some("stream")),
        (with("n", json!(3)).to_string().into_bytes(), 400, Some("n")),
        (with("prompt", json!(["a", "b"])).to_string().into_bytes(), 400, Some("prompt")),
        (with("prompt", json!([1, 1u64 << 40])).to_string().into_bytes(), 400, Some("prompt")),
        (with("prompt", json!([999_999_999u32])).to_string().into_bytes(), 400, Some("prompt")),
        (with("prompt", json!("")).to_string().into_bytes(), 400, Some("prompt")),
        (with("prompt", json!("word ".repeat(300))).to_string().into_bytes(), 400, Some("prompt")),
        (json!({"max_tokens": 2}).to_string().into_bytes(), 400, Some("prompt")),
    ];
    for (body, status, param) in &cases {
        let a = request(addr, "POST", "/v1/completions", body);
        let shown = String::from_utf8_lossy(&body[..body.len().min(80)]).into_owned();
        assert_eq!(a.status, *status, "{shown}: {}", a.text());
        let err = &a.json()["error"];
        assert!(!err["message"].as_str().unwrap().is_empty(), "{shown}");
        assert_eq!(err["param"].as_str(), *param, "{shown}: {}", a.text());
    }
    let chat_cases = [
        json!({"messages": "hi"}),
        json!({"messages": []}),
        json!({"messages": [{"role": "wizard", "content": "hi"}]}),
        json!({"messages": [{"role": "user", "content": 5}]}),
        json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
    ];
    for body in &chat_cases {
        let a = post(addr, "/v1/chat/completions", body);
        assert_eq!(a.status, 400, "{body}: {}", a.text());
        assert_eq!(a.json()["error"]["param"], "messages", "{body}");
    }
    // A 10 MB prompt: refused (413) by the body limit, whether or not the server reads it all.
    let huge = json!({"prompt": "a".repeat(10 << 20), "max_tokens": 2}).to_string();
    let mut s = connect(addr);
    let mut reader = s.try_clone().unwrap();
    let writer = std::thread::spawn(move || send(&mut s, "POST", "/v1/completions", huge.as_bytes()));
    let mut raw = Vec::new();
    let _ = reader.read_to_end(&mut raw);
    let _ = writer.join().unwrap();
    let a = parse(&raw);
    assert_eq!(a.status, 413, "{}", a.text());
    // Unknown routes and methods.
    assert_eq!(get(addr, "/v1/nothing").status, 404);
    assert_eq!(get(addr, "/v1/completions").status, 405);
    // Still serving, with the same answer as before.
    let a = post(addr, "/v1/completions", &ok);
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(get(addr, "/health").status, 200);
}
