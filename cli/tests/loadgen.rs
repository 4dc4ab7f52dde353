//! `tessera loadgen` against a mock OpenAI-compatible server started here: a tokio listener on
//! 127.0.0.1 answering HTTP/1.1 (kept alive) with server-sent event chunks at set delays, so the
//! measured TTFT / ITL / latency have known lower bounds. Also: failed and timed-out requests,
//! non-streamed and chat requests, and the refusal of any host that is not a loopback address.
//! Last, loadgen against `tessera serve` with a tiny synthetic qwen35moe speaking the fixture
//! vocabulary on the CPU: no request fails and the server's cache is empty afterwards.

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

fn tessera() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tessera"))
}

/// How the mock answers.
#[derive(Clone, Copy, Default)]
struct Behaviour {
    /// Delay before the first content chunk.
    first: Duration,
    /// Delay between content chunks.
    gap: Duration,
    /// Send `usage` in the last chunk / the response.
    usage: bool,
    /// Answer every k-th request (1-based, in arrival order) with HTTP 500.
    fail_every: Option<usize>,
    /// Never answer (the client's timeout ends the request).
    stall: bool,
}

/// What the mock saw.
#[derive(Default)]
struct Seen {
    connections: AtomicUsize,
    requests: AtomicUsize,
    failed: AtomicUsize,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
    /// Requests the mock found malformed (answered 400).
    problems: Mutex<Vec<String>>,
}

/// Starts the mock on a free loopback port in a thread of its own; it lives until the test
/// process ends.
fn mock(b: Behaviour) -> (SocketAddr, Arc<Seen>) {
    let seen = Arc::new(Seen::default());
    let (tx, rx) = std::sync::mpsc::channel();
    let seen2 = seen.clone();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        rt.block_on(async move {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(listener.local_addr().unwrap()).unwrap();
            loop {
                let (sock, _) = listener.accept().await.unwrap();
                seen2.connections.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(serve_connection(sock, b, seen2.clone()));
            }
        });
    });
    (rx.recv().unwrap(), seen)
}

/// One request's head and body, or `None` when the client closed the connection.
async fn read_request(sock: &mut TcpStream, buf: &mut Vec<u8>) -> Option<(String, Vec<u8>)> {
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).into_owned();
            let len = head
                .lines()
                .find_map(|l| l.split_once(':').filter(|(k, _)| k.eq_ignore_ascii_case("content-length")))
                .map_or(0, |(_, v)| v.trim().parse::<usize>().unwrap());
            while buf.len() < end + 4 + len {
                let mut chunk = [0u8; 4096];
                let n = sock.read(&mut chunk).await.ok()?;
                if n == 0 {
                    return None;
                }
                buf.extend_from_slice(&chunk[..n]);
            }
            let body = buf[end + 4..end + 4 + len].to_vec();
            buf.drain(..end + 4 + len);
            return Some((head, body));
        }
        let mut chunk = [0u8; 4096];
        let n = sock.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

async fn respond(sock: &mut TcpStream, status: &str, body: &Value) -> std::io::Result<()> {
    let body = body.to_string();
    let head = format!("HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n", body.len());
    sock.write_all(head.as_bytes()).await?;
    sock.write_all(body.as_bytes()).await
}

/// Writes one server-sent event as one HTTP chunk.
async fn event(sock: &mut TcpStream, data: &str) -> std::io::Result<()> {
    let ev = format!("data: {data}\n\n");
    sock.write_all(format!("{:x}\r\n{ev}\r\n", ev.len()).as_bytes()).await?;
    sock.flush().await
}

/// What is wrong with a request, if anything: method, path and the OpenAI body fields.
fn problem(head: &str, body: &Value) -> Option<String> {
    let first = head.lines().next().unwrap_or("");
    let chat = first.starts_with("POST /v1/chat/completions ");
    if !chat && !first.starts_with("POST /v1/completions ") {
        return Some(format!("request line `{first}`"));
    }
    if !head.lines().any(|l| l.to_ascii_lowercase().starts_with("host: 127.0.0.1:")) {
        return Some(format!("no Host header in `{head}`"));
    }
    let has_prompt = if chat { body["messages"][0]["content"].is_string() } else { body["prompt"].is_string() };
    if !has_prompt || body["max_tokens"].as_u64().is_none() || body["stream"].as_bool().is_none() {
        return Some(format!("body {body}"));
    }
    None
}

async fn serve_connection(mut sock: TcpStream, b: Behaviour, seen: Arc<Seen>) {
    let mut buf = Vec::new();
    while let Some((head, body)) = read_request(&mut sock, &mut buf).await {
        let n = seen.requests.fetch_add(1, Ordering::SeqCst) + 1;
        let now = seen.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        seen.max_in_flight.fetch_max(now, Ordering::SeqCst);
        let result = answer(&mut sock, n, &head, &body, b, &seen).await;
        seen.in_flight.fetch_sub(1, Ordering::SeqCst);
        if result.is_err() {
            return;
        }
    }
}

async fn answer(
    sock: &mut TcpStream,
    n: usize,
    head: &str,
    body: &[u8],
    b: Behaviour,
    seen: &Seen,
) -> std::io::Result<()> {
    let body: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    if let Some(p) = problem(head, &body) {
        seen.problems.lock().unwrap().push(p.clone());
        return respond(sock, "400 Bad Request", &json!({ "error": { "message": p } })).await;
    }
    if b.stall {
        tokio::time::sleep(Duration::from_secs(30)).await;
        return Err(ErrorKind::TimedOut.into());
    }
    if b.fail_every.is_some_and(|k| n.is_multiple_of(k)) {
        seen.failed.fetch_add(1, Ordering::SeqCst);
        return respond(sock, "500 Internal Server Error", &json!({ "error": { "message": "mock failure" } })).await;
    }
    let chat = head.starts_with("POST /v1/chat/");
    let tokens = body["max_tokens"].as_u64().unwrap() as usize;
    let usage = json!({ "completion_tokens": tokens, "prompt_tokens": 11, "total_tokens": tokens + 11 });
    let piece = |i: usize| {
        if chat { json!({ "delta": { "content": format!("t{i} ") } }) } else { json!({ "text": format!("t{i} ") }) }
    };
    if body["stream"] != json!(true) {
        tokio::time::sleep(b.first + b.gap * tokens.saturating_sub(1) as u32).await;
        let choice = if chat {
            json!({ "message": { "role": "assistant", "content": "t0 t1" }, "finish_reason": "length" })
        } else {
            json!({ "text": "t0 t1", "finish_reason": "length" })
        };
        let mut v = json!({ "choices": [choice] });
        if b.usage {
            v["usage"] = usage;
        }
        return respond(sock, "200 OK", &v).await;
    }
    let head = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n";
    sock.write_all(head.as_bytes()).await?;
    if chat {
        // A role-only chunk first: not content, so not the first token.
        event(sock, &json!({ "choices": [{ "delta": { "role": "assistant" } }] }).to_string()).await?;
    }
    for i in 0..tokens {
        tokio::time::sleep(if i == 0 { b.first } else { b.gap }).await;
        event(sock, &json!({ "choices": [piece(i)] }).to_string()).await?;
    }
    let mut last = json!({ "choices": [] });
    if b.usage {
        last["usage"] = usage;
    }
    event(sock, &last.to_string()).await?;
    event(sock, "[DONE]").await?;
    sock.write_all(b"0\r\n\r\n").await
}

fn loadgen(addr: SocketAddr, args: &[&str]) -> Output {
    tessera().args(["loadgen", "--url", &format!("http://{addr}")]).args(args).output().unwrap()
}

/// The JSON report of a run that must succeed.
fn report(out: &Output) -> Value {
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

fn ms(v: &Value, metric: &str, key: &str) -> f64 {
    v[metric][key].as_f64().unwrap_or_else(|| panic!("{metric}.{key} in {v:#}"))
}

#[test]
fn streamed_completions_are_timed() {
    let b = Behaviour {
        first: Duration::from_millis(30),
        gap: Duration::from_millis(5),
        usage: true,
        ..Default::default()
    };
    let (addr, seen) = mock(b);
    let args = ["--clients", "8", "--requests", "40", "--max-tokens", "4", "--stream", "--json"];
    let v = report(&loadgen(addr, &args));
    assert!(seen.problems.lock().unwrap().is_empty(), "{:?}", seen.problems.lock().unwrap());
    assert_eq!((v["ok"].as_u64(), v["failed"].as_u64()), (Some(40), Some(0)), "{v:#}");
    assert_eq!(seen.requests.load(Ordering::SeqCst), 40);
    // Eight clients, each on one kept-alive connection, eight requests at a time.
    assert_eq!(seen.connections.load(Ordering::SeqCst), 8);
    assert!((2..=8).contains(&seen.max_in_flight.load(Ordering::SeqCst)));
    assert_eq!((v["output_tokens"].as_u64(), v["output_tokens_from_usage"].as_bool()), (Some(160), Some(true)));
    assert_eq!(v["prompt_tokens"].as_u64(), Some(40 * 11));
    // The server waits 30 ms for the first token and 5 ms between the next three.
    assert_eq!(v["ttft_ms"]["n"].as_u64(), Some(40));
    assert!(ms(&v, "ttft_ms", "min") >= 30.0, "{v:#}");
    assert_eq!(v["itl_ms"]["n"].as_u64(), Some(40 * 3));
    // Chunks read together have gap 0 (a busy machine), but some gaps show the mock's 5 ms.
    assert!(ms(&v, "itl_ms", "max") >= 4.5, "{v:#}");
    assert!(ms(&v, "latency_ms", "min") >= 45.0, "{v:#}");
    for m in ["ttft_ms", "itl_ms", "latency_ms"] {
        let (p50, p90, p99, max) = (ms(&v, m, "p50"), ms(&v, m, "p90"), ms(&v, m, "p99"), ms(&v, m, "max"));
        assert!(p50 <= p90 && p90 <= p99 && p99 <= max, "{m}: {v:#}");
    }
    // 40 requests of >= 45 ms over 8 clients take >= 5 rounds of 45 ms.
    let secs = v["duration_s"].as_f64().unwrap();
    assert!(secs >= 0.2, "{v:#}");
    assert!((v["requests_per_s"].as_f64().unwrap() - 40.0 / secs).abs() < 1e-6);
    assert!((v["output_tokens_per_s"].as_f64().unwrap() - 160.0 / secs).abs() < 1e-6);
    assert_eq!(v["errors"], json!([]));

    // The table says the same.
    let out = loadgen(addr, &["--clients", "2", "--requests", "4", "--max-tokens", "2", "--stream"]);
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{table}");
    assert!(table.contains("requests: 4 ok, 0 failed"), "{table}");
    for row in ["| ttft | 4 |", "| itl | 4 |", "| latency | 4 |"] {
        assert!(table.contains(row), "{row} in\n{table}");
    }
}

#[test]
fn chat_streams_count_content_chunks_without_usage() {
    let b = Behaviour { first: Duration::from_millis(20), gap: Duration::from_millis(2), ..Default::default() };
    let (addr, seen) = mock(b);
    let out =
        loadgen(addr, &["--clients", "3", "--requests", "7", "--max-tokens", "5", "--chat", "--stream", "--json"]);
    let v = report(&out);
    assert!(seen.problems.lock().unwrap().is_empty(), "{:?}", seen.problems.lock().unwrap());
    assert_eq!((v["ok"].as_u64(), v["output_tokens"].as_u64()), (Some(7), Some(35)), "{v:#}");
    assert_eq!((v["output_tokens_from_usage"].as_bool(), v["prompt_tokens"].as_u64()), (Some(false), None));
    // The role chunk comes at once; the first content 20 ms later.
    assert!(ms(&v, "ttft_ms", "min") >= 20.0, "{v:#}");
    assert_eq!(v["itl_ms"]["n"].as_u64(), Some(7 * 4));
}

#[test]
fn unstreamed_requests_have_latency_only() {
    let b = Behaviour {
        first: Duration::from_millis(10),
        gap: Duration::from_millis(1),
        usage: true,
        ..Default::default()
    };
    let (addr, _) = mock(b);
    for chat in [false, true] {
        let mut args = vec!["--clients", "2", "--requests", "5", "--max-tokens", "3", "--json", "--prompt", "hello"];
        if chat {
            args.push("--chat");
        }
        let v = report(&loadgen(addr, &args));
        assert_eq!((v["ok"].as_u64(), v["output_tokens"].as_u64()), (Some(5), Some(15)), "{v:#}");
        assert_eq!((v["ttft_ms"].clone(), v["itl_ms"].clone()), (Value::Null, Value::Null));
        assert!(ms(&v, "latency_ms", "min") >= 12.0, "{v:#}");
    }
}

#[test]
fn failures_are_counted_reported_and_fail_the_run() {
    let b = Behaviour { fail_every: Some(3), usage: true, ..Default::default() };
    let (addr, seen) = mock(b);
    let out = loadgen(addr, &["--clients", "4", "--requests", "30", "--max-tokens", "2", "--stream", "--json"]);
    assert_eq!(out.status.code(), Some(1));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let failed = seen.failed.load(Ordering::SeqCst);
    assert_eq!(failed, 10);
    assert_eq!((v["ok"].as_u64(), v["failed"].as_u64()), (Some(20), Some(10)), "{v:#}");
    let errors = v["errors"].as_array().unwrap();
    assert_eq!(errors.len(), 5);
    for e in errors {
        let msg = e["error"].as_str().unwrap();
        assert!(msg.contains("HTTP 500") && msg.contains("mock failure"), "{msg}");
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("error: 10 of 30 requests failed") && stderr.contains("mock failure"), "{stderr}");
    // A failed request is not retried: the mock saw 30.
    assert_eq!(seen.requests.load(Ordering::SeqCst), 30);
}

#[test]
fn requests_time_out() {
    let (addr, _) = mock(Behaviour { stall: true, ..Default::default() });
    let start = Instant::now();
    let out = loadgen(addr, &["--clients", "2", "--requests", "4", "--timeout", "0.2", "--stream", "--json"]);
    assert_eq!(out.status.code(), Some(1));
    // Two rounds of 0.2 s, not the mock's 30 s.
    assert!(start.elapsed() < Duration::from_secs(10));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((v["ok"].as_u64(), v["failed"].as_u64()), (Some(0), Some(4)), "{v:#}");
    assert!(v["errors"][0]["error"].as_str().unwrap().contains("timed out after 0.2 s"), "{v:#}");
    assert_eq!(v["latency_ms"], Value::Null);
}

#[test]
fn a_closed_port_fails_every_request_without_retries() {
    // A port just freed: nothing listens there.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let out = tessera()
        .args(["loadgen", "--url", &format!("http://127.0.0.1:{port}"), "--clients", "2", "--requests", "6", "--json"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["failed"].as_u64(), Some(6), "{v:#}");
    assert!(v["errors"][0]["error"].as_str().unwrap().contains("connecting to 127.0.0.1:"), "{v:#}");
}

#[test]
fn only_loopback_targets() {
    for url in ["http://10.1.2.3:8080", "http://192.168.0.1", "http://example.com:80", "http://[::]:8080"] {
        let start = Instant::now();
        let out = tessera().args(["loadgen", "--url", url, "--requests", "1"]).output().unwrap();
        assert_eq!(out.status.code(), Some(1), "{url}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("not a loopback address") && stderr.contains("127.0.0.0/8"), "{url}: {stderr}");
        assert!(out.stdout.is_empty(), "{url}");
        assert!(start.elapsed() < Duration::from_secs(5));
    }
    for (args, says) in [
        (&["--url", "https://127.0.0.1:1"][..], "scheme `https`"),
        (&["--url", "http://127.0.0.1:1", "--clients", "0"][..], "--clients 0"),
        (&["--url", "http://127.0.0.1:1", "--requests", "0"][..], "--requests 0"),
        (&["--url", "http://127.0.0.1:1", "--timeout", "0"][..], "--timeout 0"),
    ] {
        let out = tessera().arg("loadgen").args(args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.code() == Some(1) && stderr.contains(says), "{args:?}: {stderr}");
    }
}

/// `GET path` from a server on `addr`, the body as JSON (`Connection: close`, not chunked).
fn get_json(addr: SocketAddr, path: &str) -> Value {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or_else(|| panic!("{raw}"));
    assert!(head.starts_with("HTTP/1.1 200"), "{raw}");
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {raw}"))
}

#[test]
fn tessera_serve_answers_every_request_and_empties_its_cache() {
    let dir = tempfile::tempdir().unwrap();
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tests/data/vocab/ggml-vocab-qwen35.gguf.gz");
    let mut vocab = Vec::new();
    flate2::read::GzDecoder::new(std::fs::File::open(fixture).unwrap()).read_to_end(&mut vocab).unwrap();
    let vocab_path = dir.path().join("vocab.gguf");
    std::fs::write(&vocab_path, vocab).unwrap();
    let model = dir.path().join("m.gguf");
    let out = tessera()
        .args(["synth", "--preset", "tiny-moe", "--dtype", "f32", "-q", "-o"])
        .arg(&model)
        .arg("--vocab")
        .arg(&vocab_path)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    /// The server, killed when dropped (a failed assertion included).
    struct Server(std::process::Child);
    impl Drop for Server {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut server = Server(
        tessera()
            .arg("serve")
            .arg(&model)
            .args(["--backend", "cpu", "--port", "0", "--ctx", "256", "--max-seqs", "4"])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap(),
    );
    let mut line = String::new();
    BufReader::new(server.0.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let addr: SocketAddr =
        line.trim().strip_prefix("listening on http://").unwrap_or_else(|| panic!("{line:?}")).parse().unwrap();

    // More clients than the server runs at once: the rest wait in its queue.
    let args = ["--clients", "16", "--requests", "48", "--max-tokens", "8", "--prompt-tokens", "12", "--stream"];
    let v = report(&loadgen(addr, &[&args[..], &["--json"]].concat()));
    assert_eq!((v["ok"].as_u64(), v["failed"].as_u64()), (Some(48), Some(0)), "{v:#}");
    assert_eq!(v["output_tokens_from_usage"].as_bool(), Some(true), "{v:#}");
    let tokens = v["output_tokens"].as_u64().unwrap();
    assert!((48..=48 * 8).contains(&tokens), "{v:#}");
    assert_eq!(v["ttft_ms"]["n"].as_u64(), Some(48), "{v:#}");
    assert!(ms(&v, "ttft_ms", "p50") <= ms(&v, "latency_ms", "p50"), "{v:#}");
    // Chat through the file's template, and whole answers.
    for extra in [&["--chat", "--stream"][..], &["--chat"][..], &[][..]] {
        let args = [&["--clients", "4", "--requests", "8", "--max-tokens", "4", "--json"][..], extra].concat();
        let v = report(&loadgen(addr, &args));
        assert_eq!((v["ok"].as_u64(), v["failed"].as_u64()), (Some(8), Some(0)), "{extra:?}: {v:#}");
    }
    // Every sequence ended and freed its blocks (the engine thread says so after its step).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let health = get_json(addr, "/health");
        let idle = [&health["running"], &health["waiting"], &health["kv_blocks_used"]].map(Value::as_u64);
        if idle == [Some(0); 3] {
            break;
        }
        assert!(Instant::now() < deadline, "not idle: {health}");
        std::thread::sleep(Duration::from_millis(50));
    }
}
