//! The server's counters and gauges, written as Prometheus text at `GET /metrics`. Handlers count
//! requests and their status; the engine thread sets the sequence and cache gauges and observes
//! each step's time after every step.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{Mutex, MutexGuard};

/// Upper bounds (seconds) of the step time histogram's buckets; `+Inf` follows.
const STEP_BUCKETS: [f64; 12] = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0];

/// Everything `/metrics` reports; one lock, taken briefly by handlers and the engine thread.
#[derive(Default)]
pub struct Metrics {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    /// Answered requests by (route, HTTP status).
    requests: BTreeMap<(&'static str, u16), u64>,
    prompt_tokens: u64,
    generated_tokens: u64,
    /// Sequences ended early because their client went away (or a stop string ended them).
    cancelled: u64,
    running: usize,
    waiting: usize,
    kv_blocks_used: usize,
    kv_blocks_total: usize,
    step_buckets: [u64; STEP_BUCKETS.len()],
    step_count: u64,
    step_sum: f64,
}

impl Metrics {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A poisoned lock still holds valid counters: keep serving them.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn request(&self, route: &'static str, status: u16) {
        *self.lock().requests.entry((route, status)).or_default() += 1;
    }

    pub fn prompt_tokens(&self, n: usize) {
        self.lock().prompt_tokens += n as u64;
    }

    pub fn generated_token(&self) {
        self.lock().generated_tokens += 1;
    }

    pub fn cancelled(&self) {
        self.lock().cancelled += 1;
    }

    /// The engine's state after a step or a command.
    pub fn gauges(&self, running: usize, waiting: usize, kv_used: usize, kv_total: usize) {
        let mut m = self.lock();
        (m.running, m.waiting, m.kv_blocks_used, m.kv_blocks_total) = (running, waiting, kv_used, kv_total);
    }

    pub fn step(&self, secs: f64) {
        let mut m = self.lock();
        if let Some(i) = STEP_BUCKETS.iter().position(|&b| secs <= b) {
            m.step_buckets[i] += 1;
        }
        m.step_count += 1;
        m.step_sum += secs;
    }

    /// `(running, waiting, kv blocks used)`: what `/health` shows.
    pub fn load(&self) -> (usize, usize, usize) {
        let m = self.lock();
        (m.running, m.waiting, m.kv_blocks_used)
    }

    /// The Prometheus text exposition (format 0.0.4).
    pub fn render(&self) -> String {
        let m = self.lock();
        let mut s = String::new();
        let head = |s: &mut String, name: &str, kind: &str, help: &str| {
            let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} {kind}");
        };
        head(&mut s, "tessera_requests_total", "counter", "HTTP requests answered, by route and status.");
        for ((route, status), n) in &m.requests {
            let _ = writeln!(s, "tessera_requests_total{{route=\"{route}\",status=\"{status}\"}} {n}");
        }
        let scalars: [(&str, &str, &str, String); 8] = [
            (
                "tessera_prompt_tokens_total",
                "counter",
                "Prompt tokens of accepted requests.",
                m.prompt_tokens.to_string(),
            ),
            ("tessera_generated_tokens_total", "counter", "Tokens generated.", m.generated_tokens.to_string()),
            (
                "tessera_cancelled_total",
                "counter",
                "Sequences ended early: their client went away or a stop string ended them.",
                m.cancelled.to_string(),
            ),
            ("tessera_sequences_running", "gauge", "Sequences in the model's caches.", m.running.to_string()),
            (
                "tessera_sequences_waiting",
                "gauge",
                "Accepted sequences waiting for cache space.",
                m.waiting.to_string(),
            ),
            ("tessera_kv_blocks_used", "gauge", "KV cache blocks holding tokens.", m.kv_blocks_used.to_string()),
            ("tessera_kv_blocks_total", "gauge", "KV cache blocks in all.", m.kv_blocks_total.to_string()),
            ("tessera_steps_total", "counter", "Engine steps run.", m.step_count.to_string()),
        ];
        for (name, kind, help, value) in scalars {
            head(&mut s, name, kind, help);
            let _ = writeln!(s, "{name} {value}");
        }
        head(&mut s, "tessera_step_seconds", "histogram", "Time of one engine step (one model forward).");
        let mut cumulative = 0;
        for (bound, n) in STEP_BUCKETS.iter().zip(m.step_buckets) {
            cumulative += n;
            let _ = writeln!(s, "tessera_step_seconds_bucket{{le=\"{bound}\"}} {cumulative}");
        }
        let _ = writeln!(s, "tessera_step_seconds_bucket{{le=\"+Inf\"}} {}", m.step_count);
        let _ = writeln!(s, "tessera_step_seconds_sum {}", m.step_sum);
        let _ = writeln!(s, "tessera_step_seconds_count {}", m.step_count);
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_histogram_is_cumulative_and_ends_with_inf() {
        let m = Metrics::default();
        m.step(0.0005);
        m.step(0.02);
        m.step(100.0);
        m.request("/v1/completions", 200);
        let text = m.render();
        assert!(text.contains("tessera_step_seconds_bucket{le=\"0.001\"} 1\n"), "{text}");
        assert!(text.contains("tessera_step_seconds_bucket{le=\"0.025\"} 2\n"), "{text}");
        assert!(text.contains("tessera_step_seconds_bucket{le=\"10\"} 2\n"), "{text}");
        assert!(text.contains("tessera_step_seconds_bucket{le=\"+Inf\"} 3\n"), "{text}");
        assert!(text.contains("tessera_requests_total{route=\"/v1/completions\",status=\"200\"} 1\n"), "{text}");
    }
}
