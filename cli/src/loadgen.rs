//! `tessera loadgen`: a bounded load generator for an OpenAI-compatible completion server on this
//! machine (`tessera serve`, llama.cpp's `llama-server`).
//!
//! `--clients N` concurrent clients (tokio tasks on one thread, each with one kept-alive HTTP/1.1
//! connection) share `--requests M` requests in all: each takes the next request number until M
//! are issued, so M requests are sent exactly once, with no retries. Each request is bounded by
//! `--timeout` (connect, headers and the whole body), its response by [`MAX_RESPONSE_BYTES`].
//! Per request it measures, from the moment the request is sent: the time to the first streamed
//! content (TTFT), the gaps between content chunks (inter-token latency, ITL), the total latency
//! and the output tokens (the server's `usage.completion_tokens`, else the content chunks
//! counted). The report gives requests ok / failed with the first errors, throughput and
//! p50 / p90 / p99 of TTFT, ITL and latency, as a table or, with `--json`, as JSON.
//!
//! Traffic goes only to the loopback address: the URL's host must be an IPv4 address in
//! 127.0.0.0/8, `::1` or `localhost` (resolved, and only its loopback addresses kept); anything
//! else is refused before any connection or name lookup.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper::body::Bytes;
use hyper::client::conn::http1::SendRequest;
use hyper::header::{ACCEPT, CONTENT_TYPE, HOST};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};

/// Most bytes one response may have (a non-streamed completion or a whole stream): past it the
/// request fails, so a misbehaving server cannot grow the client's memory without bound.
pub const MAX_RESPONSE_BYTES: usize = 16 << 20;

/// Most concurrent clients (each holds one socket).
pub const MAX_CLIENTS: usize = 1024;

/// How many failed requests the report lists.
const SHOWN_ERRORS: usize = 5;

/// Words of a `--prompt-tokens` prompt: each, with the space before it, is one token in
/// GPT-2-style byte-level BPE vocabularies (qwen's among them).
const WORDS: [&str; 16] =
    ["the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "on", "at", "by", "from"];

/// `tessera loadgen`'s arguments.
#[derive(clap::Args, Debug, Clone)]
pub struct LoadgenArgs {
    /// The server's root URL: http://127.0.0.1:PORT (loopback only); requests go to
    /// {url}/v1/completions or {url}/v1/chat/completions.
    #[arg(long)]
    pub url: String,
    /// Concurrent clients, each with one connection.
    #[arg(long, default_value_t = 8)]
    pub clients: usize,
    /// Requests in all, shared by the clients.
    #[arg(long, default_value_t = 64)]
    pub requests: usize,
    /// max_tokens of each request.
    #[arg(long = "max-tokens", default_value_t = 32)]
    pub max_tokens: usize,
    /// The prompt of every request.
    #[arg(long, conflicts_with = "prompt_tokens")]
    pub prompt: Option<String>,
    /// Instead of --prompt: about K tokens of common words, different for each request.
    #[arg(long = "prompt-tokens", value_name = "K", default_value_t = 32)]
    pub prompt_tokens: usize,
    /// Send the prompt as a user message to /v1/chat/completions.
    #[arg(long)]
    pub chat: bool,
    /// Ask for server-sent events (TTFT and ITL are only measured on streams).
    #[arg(long)]
    pub stream: bool,
    /// Seconds one request may take (connect, headers and the whole body).
    #[arg(long, default_value_t = 60.0)]
    pub timeout: f64,
    /// The request's "model" field (left out when not given).
    #[arg(long)]
    pub model: Option<String>,
    /// The request's "temperature" field (left out when not given).
    #[arg(long)]
    pub temperature: Option<f32>,
    /// Send "ignore_eos": true (a llama.cpp extension) so every request generates max_tokens.
    #[arg(long = "ignore-eos")]
    pub ignore_eos: bool,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Where requests go: loopback socket addresses, the Host header and the endpoint path.
#[derive(Debug, Clone, PartialEq)]
pub struct Target {
    pub addrs: Vec<SocketAddr>,
    pub host: String,
    pub path: String,
}

/// The host of `url` when it may be sent traffic: `Ok(Some(ip))` for a loopback IP literal,
/// `Ok(None)` for `localhost`, an error naming the host otherwise. No name is looked up here.
fn loopback_host(host: &str) -> Result<Option<IpAddr>, String> {
    if host.eq_ignore_ascii_case("localhost") {
        return Ok(None);
    }
    let bare = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
    match bare.parse::<IpAddr>() {
        Ok(ip) if ip.is_loopback() => Ok(Some(ip)),
        _ => Err(format!(
            "loadgen sends traffic only to this machine: host `{host}` is not a loopback address \
             (127.0.0.0/8, ::1 or localhost)"
        )),
    }
}

/// Parses `url` (`http://HOST[:PORT][/PREFIX]`) into a [`Target`] for the completion endpoint;
/// `localhost` is resolved to its loopback addresses only.
pub async fn target(url: &str, chat: bool) -> Result<Target, String> {
    let uri: hyper::Uri = url.parse().map_err(|e| format!("--url `{url}`: {e}"))?;
    match uri.scheme_str() {
        Some("http") => {}
        Some(s) => return Err(format!("--url `{url}`: scheme `{s}` is not supported (plain http to loopback)")),
        None => return Err(format!("--url `{url}`: give the scheme, http://127.0.0.1:PORT")),
    }
    let host = uri.host().ok_or_else(|| format!("--url `{url}`: no host"))?;
    let ip = loopback_host(host).map_err(|e| format!("--url `{url}`: {e}"))?;
    if uri.query().is_some() {
        return Err(format!("--url `{url}`: a query string is not supported"));
    }
    let port = uri.port_u16().unwrap_or(80);
    let addrs = match ip {
        Some(ip) => vec![SocketAddr::new(ip, port)],
        None => {
            let all = tokio::net::lookup_host(("localhost", port))
                .await
                .map_err(|e| format!("--url `{url}`: resolving localhost: {e}"))?;
            let addrs: Vec<SocketAddr> = all.filter(|a| a.ip().is_loopback()).collect();
            if addrs.is_empty() {
                return Err(format!("--url `{url}`: localhost resolves to no loopback address"));
            }
            addrs
        }
    };
    let prefix = uri.path().trim_end_matches('/');
    let endpoint = if chat { "/v1/chat/completions" } else { "/v1/completions" };
    let authority = uri.authority().map_or(host, |a| a.as_str());
    // The Host header never carries user info.
    let host_header = authority.rsplit('@').next().unwrap_or(authority).to_string();
    Ok(Target { addrs, host: host_header, path: format!("{prefix}{endpoint}") })
}

/// The prompt text of request `i`.
fn prompt_text(args: &LoadgenArgs, i: usize) -> String {
    match &args.prompt {
        Some(p) => p.clone(),
        None => (0..args.prompt_tokens).map(|j| WORDS[(i * 7 + j) % WORDS.len()]).collect::<Vec<_>>().join(" "),
    }
}

/// The JSON body of request `i` (OpenAI's completions or chat completions shape).
pub fn request_body(args: &LoadgenArgs, i: usize) -> Value {
    let text = prompt_text(args, i);
    let mut body = if args.chat {
        json!({ "messages": [{ "role": "user", "content": text }] })
    } else {
        json!({ "prompt": text })
    };
    body["max_tokens"] = json!(args.max_tokens);
    body["stream"] = json!(args.stream);
    if args.stream {
        body["stream_options"] = json!({ "include_usage": true });
    }
    if let Some(m) = &args.model {
        body["model"] = json!(m);
    }
    if let Some(t) = args.temperature {
        body["temperature"] = json!(t);
    }
    if args.ignore_eos {
        body["ignore_eos"] = json!(true);
    }
    body
}

/// What one successful request measured. Times are seconds from sending the request.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Measured {
    /// Time to the first content chunk (streams only).
    pub ttft: Option<f64>,
    /// Gaps between successive content chunks (streams only).
    pub itl: Vec<f64>,
    /// Time to the end of the response.
    pub latency: f64,
    /// Output tokens: `usage.completion_tokens`, else the content chunks counted.
    pub tokens: usize,
    /// Whether `tokens` came from the server's `usage`.
    pub tokens_from_usage: bool,
    /// `usage.prompt_tokens`, when the server said.
    pub prompt_tokens: Option<usize>,
}

/// The content a completion chunk or response carries: every choice's `text`,
/// `delta.content` / `delta.reasoning_content` or `message.content` joined.
fn content_of(v: &Value) -> String {
    let mut out = String::new();
    for c in v.get("choices").and_then(Value::as_array).into_iter().flatten() {
        let parts = [
            c.get("text"),
            c.pointer("/delta/content"),
            c.pointer("/delta/reasoning_content"),
            c.pointer("/message/content"),
            c.pointer("/message/reasoning_content"),
        ];
        for s in parts.into_iter().flatten().filter_map(Value::as_str) {
            out.push_str(s);
        }
    }
    out
}

/// The message of an `{"error": ...}` object (OpenAI's shape or a bare string), if `v` is one.
fn error_of(v: &Value) -> Option<String> {
    let e = v.get("error")?;
    Some(match e.get("message").and_then(Value::as_str) {
        Some(m) => m.to_string(),
        None => e.as_str().map_or_else(|| e.to_string(), str::to_string),
    })
}

/// `usage`'s (completion_tokens, prompt_tokens), when present.
fn usage_of(v: &Value) -> (Option<usize>, Option<usize>) {
    let get = |k: &str| v.pointer(&format!("/usage/{k}")).and_then(Value::as_u64).map(|n| n as usize);
    (get("completion_tokens"), get("prompt_tokens"))
}

/// An incremental reader of a server-sent event stream of completion chunks: fed the body's bytes
/// as they arrive with their arrival time, it records content times and usage until `data: [DONE]`.
#[derive(Debug, Default)]
pub struct SseReader {
    /// Bytes of an unfinished line.
    line: Vec<u8>,
    /// The `data:` lines of the event being read, joined with newlines.
    data: String,
    has_data: bool,
    /// Arrival times of the events that carried content.
    content_times: Vec<f64>,
    completion_tokens: Option<usize>,
    prompt_tokens: Option<usize>,
    done: bool,
}

impl SseReader {
    /// Feeds `bytes` that arrived `t` seconds after the request was sent. An event that is not
    /// JSON, an `{"error": ...}` event or data after `[DONE]` is an error.
    pub fn feed(&mut self, bytes: &[u8], t: f64) -> Result<(), String> {
        for &b in bytes {
            if b != b'\n' {
                self.line.push(b);
                continue;
            }
            let mut line = std::mem::take(&mut self.line);
            if line.last() == Some(&b'\r') {
                line.pop();
            }
            let line = String::from_utf8(line).map_err(|_| "stream line is not UTF-8".to_string())?;
            self.line_done(&line, t)?;
        }
        Ok(())
    }

    fn line_done(&mut self, line: &str, t: f64) -> Result<(), String> {
        if line.is_empty() {
            return self.dispatch(t);
        }
        if line.starts_with(':') {
            return Ok(()); // a comment (keep-alive)
        }
        let (field, value) = line.split_once(':').unwrap_or((line, ""));
        let value = value.strip_prefix(' ').unwrap_or(value);
        if field == "data" {
            if self.has_data {
                self.data.push('\n');
            }
            self.data.push_str(value);
            self.has_data = true;
        }
        Ok(()) // event:, id:, retry: and unknown fields carry nothing measured
    }

    fn dispatch(&mut self, t: f64) -> Result<(), String> {
        if !self.has_data {
            return Ok(());
        }
        let data = std::mem::take(&mut self.data);
        self.has_data = false;
        if self.done {
            return Err(format!("stream data after [DONE]: {}", snippet(&data)));
        }
        if data.trim() == "[DONE]" {
            self.done = true;
            return Ok(());
        }
        let v: Value =
            serde_json::from_str(&data).map_err(|e| format!("stream event is not JSON ({e}): {}", snippet(&data)))?;
        if let Some(e) = error_of(&v) {
            return Err(format!("error event in the stream: {e}"));
        }
        if !content_of(&v).is_empty() {
            self.content_times.push(t);
        }
        let (completion, prompt) = usage_of(&v);
        self.completion_tokens = completion.or(self.completion_tokens);
        self.prompt_tokens = prompt.or(self.prompt_tokens);
        Ok(())
    }

    /// The measurement of a stream that ended `latency` seconds after the request; a stream
    /// without `data: [DONE]` is an error.
    pub fn finish(mut self, latency: f64) -> Result<Measured, String> {
        if !self.line.is_empty() {
            let line = String::from_utf8(std::mem::take(&mut self.line)).unwrap_or_default();
            self.line_done(&line, latency)?;
        }
        self.dispatch(latency)?;
        if !self.done {
            return Err("the stream ended without `data: [DONE]`".to_string());
        }
        let itl = self.content_times.windows(2).map(|w| w[1] - w[0]).collect();
        Ok(Measured {
            ttft: self.content_times.first().copied(),
            itl,
            latency,
            tokens: self.completion_tokens.unwrap_or(self.content_times.len()),
            tokens_from_usage: self.completion_tokens.is_some(),
            prompt_tokens: self.prompt_tokens,
        })
    }
}

/// At most 200 characters of `s`, on one line.
fn snippet(s: &str) -> String {
    let one_line: String = s.chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
    match one_line.char_indices().nth(200) {
        Some((i, _)) => format!("{}...", &one_line[..i]),
        None => one_line,
    }
}

/// Opens one HTTP/1.1 connection to the target.
async fn connect(target: &Target) -> Result<SendRequest<Full<Bytes>>, String> {
    let stream = tokio::net::TcpStream::connect(&target.addrs[..])
        .await
        .map_err(|e| format!("connecting to {}: {e}", target.host))?;
    stream.set_nodelay(true).map_err(|e| format!("connecting to {}: {e}", target.host))?;
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| format!("connecting to {}: {e}", target.host))?;
    // The connection's errors show in the requests sent through it.
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(sender)
}

/// Sends one request over `conn` (opened first when there is none or it was closed) and measures
/// its response.
async fn one_request(
    conn: &mut Option<SendRequest<Full<Bytes>>>,
    target: &Target,
    body: Vec<u8>,
    stream: bool,
) -> Result<Measured, String> {
    if conn.as_ref().is_none_or(|c| c.is_closed()) {
        *conn = Some(connect(target).await?);
    }
    let Some(sender) = conn.as_mut() else { return Err("no connection".to_string()) };
    sender.ready().await.map_err(|e| format!("connection: {e}"))?;
    let req = Request::post(target.path.as_str())
        .header(HOST, target.host.as_str())
        .header(CONTENT_TYPE, "application/json")
        .header(ACCEPT, if stream { "text/event-stream" } else { "application/json" })
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| format!("building the request: {e}"))?;
    let t0 = Instant::now();
    let resp = sender.send_request(req).await.map_err(|e| format!("sending the request: {e}"))?;
    let status = resp.status();
    let content_type =
        resp.headers().get(CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("").to_ascii_lowercase();
    let mut body = resp.into_body();
    let mut received = 0usize;
    let mut next_bytes = async || -> Result<Option<Bytes>, String> {
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| format!("reading the response: {e}"))?;
            if let Ok(data) = frame.into_data() {
                received += data.len();
                if received > MAX_RESPONSE_BYTES {
                    return Err(format!("the response is over {MAX_RESPONSE_BYTES} bytes"));
                }
                return Ok(Some(data));
            }
        }
        Ok(None)
    };
    let is_stream = status.is_success() && stream && content_type.starts_with("text/event-stream");
    if !is_stream {
        let mut all = Vec::new();
        while let Some(data) = next_bytes().await? {
            all.extend_from_slice(&data);
        }
        let latency = t0.elapsed().as_secs_f64();
        let text = String::from_utf8_lossy(&all);
        let v: Option<Value> = serde_json::from_slice(&all).ok();
        if !status.is_success() {
            let why = v.as_ref().and_then(error_of).unwrap_or_else(|| snippet(&text));
            return Err(format!("HTTP {status}: {why}"));
        }
        if stream {
            return Err(format!(
                "asked for a stream, got content-type `{content_type}`: {}",
                v.as_ref().and_then(error_of).unwrap_or_else(|| snippet(&text))
            ));
        }
        let v = v.ok_or_else(|| format!("the response is not JSON: {}", snippet(&text)))?;
        if let Some(e) = error_of(&v) {
            return Err(format!("error response: {e}"));
        }
        let (completion, prompt) = usage_of(&v);
        return Ok(Measured {
            ttft: None,
            itl: Vec::new(),
            latency,
            tokens: completion.unwrap_or(0),
            tokens_from_usage: completion.is_some(),
            prompt_tokens: prompt,
        });
    }
    let mut sse = SseReader::default();
    while let Some(data) = next_bytes().await? {
        sse.feed(&data, t0.elapsed().as_secs_f64())?;
    }
    sse.finish(t0.elapsed().as_secs_f64())
}

/// The `p`-th percentile (0 to 100) of ascending `sorted` values, linear between the closest
/// ranks (numpy's default: rank `p / 100 * (n - 1)`); `None` for no values.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    let last = sorted.len().checked_sub(1)?;
    let rank = (p.clamp(0.0, 100.0) / 100.0) * last as f64;
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    Some(sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64))
}

/// Summary of one metric's samples, in seconds.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    pub n: usize,
    pub mean: f64,
    pub min: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

impl Summary {
    /// The summary of `samples` (any order); `None` for none.
    pub fn of(samples: &[f64]) -> Option<Summary> {
        let mut s = samples.to_vec();
        s.sort_by(f64::total_cmp);
        let n = s.len();
        Some(Summary {
            n,
            mean: s.iter().sum::<f64>() / n.max(1) as f64,
            min: *s.first()?,
            p50: percentile(&s, 50.0)?,
            p90: percentile(&s, 90.0)?,
            p99: percentile(&s, 99.0)?,
            max: *s.last()?,
        })
    }

    fn json_ms(s: Option<&Summary>) -> Value {
        s.map_or(Value::Null, |s| {
            json!({ "n": s.n, "mean": s.mean * 1e3, "min": s.min * 1e3, "p50": s.p50 * 1e3,
                    "p90": s.p90 * 1e3, "p99": s.p99 * 1e3, "max": s.max * 1e3 })
        })
    }
}

/// The outcome of a run.
#[derive(Debug, Clone)]
pub struct Report {
    pub ok: usize,
    pub failed: usize,
    /// The first failed requests, by completion: (request number, error).
    pub errors: Vec<(usize, String)>,
    /// Seconds from the first request to the end of the last.
    pub wall: f64,
    pub output_tokens: usize,
    /// Whether every ok request's tokens came from the server's `usage`.
    pub tokens_from_usage: bool,
    pub prompt_tokens: Option<usize>,
    pub ttft: Option<Summary>,
    pub itl: Option<Summary>,
    pub latency: Option<Summary>,
}

impl Report {
    fn new(results: Vec<(usize, Result<Measured, String>)>, wall: f64) -> Report {
        let (mut ttft, mut itl, mut latency) = (Vec::new(), Vec::new(), Vec::new());
        let (mut ok, mut failed, mut errors) = (0, 0, Vec::new());
        let (mut output_tokens, mut from_usage, mut prompt_tokens) = (0, true, Some(0));
        for (i, r) in results {
            match r {
                Ok(m) => {
                    ok += 1;
                    ttft.extend(m.ttft);
                    itl.extend_from_slice(&m.itl);
                    latency.push(m.latency);
                    output_tokens += m.tokens;
                    from_usage &= m.tokens_from_usage;
                    prompt_tokens = prompt_tokens.zip(m.prompt_tokens).map(|(a, b)| a + b);
                }
                Err(e) => {
                    failed += 1;
                    if errors.len() < SHOWN_ERRORS {
                        errors.push((i, e));
                    }
                }
            }
        }
        Report {
            ok,
            failed,
            errors,
            wall,
            output_tokens,
            tokens_from_usage: from_usage && ok > 0,
            prompt_tokens: prompt_tokens.filter(|_| ok > 0),
            ttft: Summary::of(&ttft),
            itl: Summary::of(&itl),
            latency: Summary::of(&latency),
        }
    }

    fn rate(&self, n: usize) -> f64 {
        if self.wall > 0.0 { n as f64 / self.wall } else { 0.0 }
    }
}

/// Runs the load described by `args` and prints the report; an error when the arguments or URL
/// are refused, or when any request failed (after the report).
pub fn run(args: &LoadgenArgs) -> Result<(), String> {
    if args.clients == 0 || args.clients > MAX_CLIENTS {
        return Err(format!("--clients {}: give 1 to {MAX_CLIENTS}", args.clients));
    }
    if args.requests == 0 {
        return Err("--requests 0: give at least one request".to_string());
    }
    if args.max_tokens == 0 {
        return Err("--max-tokens 0: give at least one token".to_string());
    }
    if args.prompt.is_none() && args.prompt_tokens == 0 {
        return Err("--prompt-tokens 0: give at least one token, or --prompt TEXT".to_string());
    }
    if !(args.timeout.is_finite() && args.timeout > 0.0 && args.timeout <= 86_400.0) {
        return Err(format!("--timeout {}: give seconds in (0, 86400]", args.timeout));
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("starting the async runtime: {e}"))?;
    let (target, report) = rt.block_on(async {
        let target = Arc::new(target(&args.url, args.chat).await?);
        Ok::<_, String>((target.clone(), drive(args, target).await))
    })?;
    if args.json {
        print_json(args, &target, &report);
    } else {
        print_table(args, &target, &report);
    }
    match report.errors.first() {
        Some((i, e)) if report.failed > 0 => {
            Err(format!("{} of {} requests failed; the first, request {i}: {e}", report.failed, args.requests))
        }
        _ => Ok(()),
    }
}

/// The clients' loop: `args.clients` tasks take request numbers until `args.requests` are done.
async fn drive(args: &LoadgenArgs, target: Arc<Target>) -> Report {
    let next = Arc::new(AtomicUsize::new(0));
    let timeout = Duration::from_secs_f64(args.timeout);
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..args.clients.min(args.requests) {
        let (next, target, args) = (next.clone(), target.clone(), args.clone());
        tasks.spawn(async move {
            let mut conn = None;
            let mut results = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= args.requests {
                    break;
                }
                let body = request_body(&args, i).to_string().into_bytes();
                let r = match tokio::time::timeout(timeout, one_request(&mut conn, &target, body, args.stream)).await {
                    Ok(r) => r,
                    Err(_) => Err(format!("timed out after {} s", args.timeout)),
                };
                if r.is_err() {
                    // The connection's state is unknown after a failure: the next request opens
                    // a new one.
                    conn = None;
                }
                results.push((i, r));
            }
            results
        });
    }
    let mut results = Vec::with_capacity(args.requests);
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok(r) => results.extend(r),
            Err(e) => results.push((usize::MAX, Err(format!("a client task ended: {e}")))),
        }
    }
    let wall = start.elapsed().as_secs_f64();
    results.sort_by_key(|(i, _)| *i);
    Report::new(results, wall)
}

fn mode(args: &LoadgenArgs) -> &'static str {
    if args.stream { "streamed" } else { "not streamed" }
}

fn prompt_label(args: &LoadgenArgs) -> String {
    match &args.prompt {
        Some(p) => format!("{} characters", p.chars().count()),
        None => format!("about {} tokens", args.prompt_tokens),
    }
}

fn print_table(args: &LoadgenArgs, target: &Target, r: &Report) {
    outln!(
        "target: http://{}{} ({}), {} clients, {} requests, max_tokens {}, prompt {}",
        target.host,
        target.path,
        mode(args),
        args.clients,
        args.requests,
        args.max_tokens,
        prompt_label(args)
    );
    outln!("requests: {} ok, {} failed in {:.3} s", r.ok, r.failed, r.wall);
    let counted =
        if r.tokens_from_usage { "from the server's usage" } else { "streamed chunks counted where no usage" };
    outln!(
        "throughput: {:.2} requests/s, {:.1} output tokens/s ({} output tokens, {counted})",
        r.rate(r.ok),
        r.rate(r.output_tokens),
        r.output_tokens
    );
    outln!();
    outln!("| metric | n | mean ms | p50 ms | p90 ms | p99 ms | max ms |");
    outln!("| --- | --- | --- | --- | --- | --- | --- |");
    for (name, s) in [("ttft", &r.ttft), ("itl", &r.itl), ("latency", &r.latency)] {
        match s {
            Some(s) => outln!(
                "| {name} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |",
                s.n,
                s.mean * 1e3,
                s.p50 * 1e3,
                s.p90 * 1e3,
                s.p99 * 1e3,
                s.max * 1e3
            ),
            None => outln!("| {name} | 0 | - | - | - | - | - |"),
        }
    }
    if !r.errors.is_empty() {
        outln!();
        outln!("errors (the first {} of {}):", r.errors.len(), r.failed);
        for (i, e) in &r.errors {
            outln!("  request {i}: {e}");
        }
    }
}

fn print_json(args: &LoadgenArgs, target: &Target, r: &Report) {
    let doc = json!({
        "url": format!("http://{}{}", target.host, target.path),
        "chat": args.chat,
        "stream": args.stream,
        "clients": args.clients,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "prompt": prompt_label(args),
        "ok": r.ok,
        "failed": r.failed,
        "errors": r.errors.iter().map(|(i, e)| json!({ "request": i, "error": e })).collect::<Vec<_>>(),
        "duration_s": r.wall,
        "requests_per_s": r.rate(r.ok),
        "output_tokens": r.output_tokens,
        "output_tokens_from_usage": r.tokens_from_usage,
        "output_tokens_per_s": r.rate(r.output_tokens),
        "prompt_tokens": r.prompt_tokens,
        "ttft_ms": Summary::json_ms(r.ttft.as_ref()),
        "itl_ms": Summary::json_ms(r.itl.as_ref()),
        "latency_ms": Summary::json_ms(r.latency.as_ref()),
    });
    outln!("{doc:#}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate_between_ranks() {
        assert_eq!(percentile(&[], 50.0), None);
        assert_eq!(percentile(&[3.0], 99.0), Some(3.0));
        let v: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.0), Some(1.0));
        assert_eq!(percentile(&v, 100.0), Some(10.0));
        // numpy.percentile(range(1, 11), [50, 90, 99]) = 5.5, 9.1, 9.91
        assert!((percentile(&v, 50.0).unwrap() - 5.5).abs() < 1e-12);
        assert!((percentile(&v, 90.0).unwrap() - 9.1).abs() < 1e-12);
        assert!((percentile(&v, 99.0).unwrap() - 9.91).abs() < 1e-12);
        let s = Summary::of(&[4.0, 1.0, 3.0, 2.0]).unwrap();
        assert_eq!((s.n, s.min, s.max, s.mean, s.p50), (4, 1.0, 4.0, 2.5, 2.5));
        assert!((s.p90 - 3.7).abs() < 1e-12 && (s.p99 - 3.97).abs() < 1e-12);
        assert_eq!(Summary::of(&[]), None);
    }

    #[test]
    fn only_loopback_hosts() {
        for ok in ["127.0.0.1", "127.4.5.6", "[::1]", "localhost", "LocalHost"] {
            assert!(loopback_host(ok).is_ok(), "{ok}");
        }
        for bad in
            ["10.0.0.1", "192.168.1.1", "0.0.0.0", "[::]", "example.com", "127.0.0.1.example.com", "[::ffff:8.8.8.8]"]
        {
            let e = loopback_host(bad).unwrap_err();
            assert!(e.contains(bad) && e.contains("loopback"), "{e}");
        }
    }

    #[tokio::test]
    async fn urls_become_endpoints() {
        let t = target("http://127.0.0.1:8080", false).await.unwrap();
        assert_eq!(t.addrs, vec!["127.0.0.1:8080".parse().unwrap()]);
        assert_eq!((t.host.as_str(), t.path.as_str()), ("127.0.0.1:8080", "/v1/completions"));
        let t = target("http://[::1]:9/prefix/", true).await.unwrap();
        assert_eq!((t.host.as_str(), t.path.as_str()), ("[::1]:9", "/prefix/v1/chat/completions"));
        let t = target("http://localhost:1234", false).await.unwrap();
        assert!(!t.addrs.is_empty() && t.addrs.iter().all(|a| a.ip().is_loopback() && a.port() == 1234));
        for (url, says) in [
            ("https://127.0.0.1:1", "scheme `https`"),
            ("127.0.0.1:1", "scheme"),
            ("http://8.8.8.8:80", "not a loopback"),
            ("http://127.0.0.1:1/?a=b", "query"),
        ] {
            let e = target(url, false).await.unwrap_err();
            assert!(e.contains(says), "{url}: {e}");
        }
    }

    #[test]
    fn bodies_have_openai_shapes() {
        let args = LoadgenArgs {
            url: String::new(),
            clients: 1,
            requests: 1,
            max_tokens: 7,
            prompt: None,
            prompt_tokens: 5,
            chat: false,
            stream: true,
            timeout: 1.0,
            model: Some("m".into()),
            temperature: None,
            ignore_eos: false,
            json: false,
        };
        let b = request_body(&args, 3);
        assert_eq!(b["prompt"].as_str().unwrap().split(' ').count(), 5);
        assert_ne!(b["prompt"], request_body(&args, 4)["prompt"]);
        assert_eq!(
            (b["max_tokens"].as_u64(), b["stream"].as_bool(), b["model"].as_str()),
            (Some(7), Some(true), Some("m"))
        );
        assert_eq!(b["stream_options"]["include_usage"], json!(true));
        assert!(b.get("temperature").is_none() && b.get("ignore_eos").is_none());
        let chat = LoadgenArgs { chat: true, stream: false, prompt: Some("hi".into()), ..args };
        let b = request_body(&chat, 0);
        assert_eq!(b["messages"], json!([{ "role": "user", "content": "hi" }]));
        assert!(b.get("prompt").is_none() && b.get("stream_options").is_none());
    }

    #[test]
    fn sse_times_content_and_reads_usage() {
        let mut r = SseReader::default();
        // A role-only chunk is no content; split lines, \r\n and comments are handled.
        r.feed(b"data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\n\n: ping\n\n", 0.1).unwrap();
        r.feed(b"data: {\"choices\":[{\"delta\":{\"content\":\"He\"}}]}\r\n\r\ndata: {\"cho", 0.3).unwrap();
        r.feed(b"ices\":[{\"delta\":{\"content\":\"llo\"}}]}\n\n", 0.45).unwrap();
        r.feed(
            b"data: {\"choices\":[],\"usage\":{\"completion_tokens\":3,\"prompt_tokens\":9}}\n\ndata: [DONE]\n\n",
            0.5,
        )
        .unwrap();
        let m = r.finish(0.6).unwrap();
        assert_eq!(m.ttft, Some(0.3));
        assert_eq!(m.itl.len(), 1);
        assert!((m.itl[0] - 0.15).abs() < 1e-12);
        assert_eq!((m.tokens, m.tokens_from_usage, m.prompt_tokens, m.latency), (3, true, Some(9), 0.6));

        // Without usage the content chunks are counted; completions use `text`.
        let mut r = SseReader::default();
        r.feed(
            b"data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: {\"choices\":[{\"text\":\"b\"}]}\n\ndata: [DONE]",
            0.2,
        )
        .unwrap();
        let m = r.finish(0.2).unwrap();
        assert_eq!((m.tokens, m.tokens_from_usage, m.itl, m.ttft), (2, false, vec![0.0], Some(0.2)));
    }

    #[test]
    fn sse_errors_are_named() {
        let finish = |bytes: &[u8]| {
            let mut r = SseReader::default();
            r.feed(bytes, 0.0).and_then(|()| r.finish(0.0)).unwrap_err()
        };
        assert!(finish(b"data: {\"choices\":[{\"text\":\"a\"}]}\n\n").contains("without `data: [DONE]`"));
        assert!(finish(b"data: nope\n\n").contains("not JSON"));
        assert!(finish(b"data: {\"error\":{\"message\":\"boom\"}}\n\n").contains("boom"));
        assert!(finish(b"data: [DONE]\n\ndata: {}\n\n").contains("after [DONE]"));
    }
}
