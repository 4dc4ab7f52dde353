//! Token sampling from f32 logits: greedy, temperature, top-k, top-p (nucleus), seeded.
//!
//! A [`Sampler`] keeps a sequence's [`SamplerParams`] and its seeded generator (SplitMix64). Each
//! token takes one uniform draw `u` from the generator ([`Sampler::next_settings`]) and picks by
//! `tessera_ops::sample::sample`: the same exact integer rule that the `sample` op computes on
//! every backend, so sampling here and sampling on the device with the same `u` give the same
//! token bit for bit (docs/OPS.md, `sample`).
//!
//! The rule, as in llama.cpp's default chain: top-k on the raw logits, softmax at the
//! temperature, top-p over the probabilities in rank order (largest first, lowest id on ties),
//! then one draw from the kept tokens in proportion to their probabilities. The draw walks the
//! kept tokens in id order (no sort of the vocabulary); the weights are integers
//! (`trunc(e^((l - max) / t) · 2^40)`), so no summation order can move a pick. Temperature 0 (or
//! top-k 1) is greedy: the largest logit, the lowest id on ties; NaN logits are never picked.

use tessera_ops::sample::{MAX_TOP_K, SampleSettings, sample as sample_row};

use crate::cache::SplitMix64;

/// Why sampler parameters or logits were refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SampleError {
    #[error("temperature must be >= 0 and finite, got {0}")]
    Temperature(f32),
    #[error("top_p must be in (0, 1], got {0}")]
    TopP(f32),
    #[error("top_k must be at least 1 (leave it unset to keep every token)")]
    TopK,
    #[error("no logits to sample from")]
    Empty,
    #[error("every logit is NaN")]
    AllNan,
    #[error("the uniform draw u must be in [0, 1), got {0}")]
    U(f32),
}

/// How to pick the next token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplerParams {
    /// Softmax temperature; 0 is greedy. Must be finite and >= 0.
    pub temperature: f32,
    /// Keep only the `k` largest logits (`None`: all). `Some(0)` is an error.
    pub top_k: Option<usize>,
    /// Keep the smallest set of most likely tokens whose probability sums to at least `top_p`,
    /// in (0, 1]; 1 keeps all.
    pub top_p: f32,
    /// Seed of the generator.
    pub seed: u64,
}

impl Default for SamplerParams {
    /// Greedy.
    fn default() -> Self {
        SamplerParams::greedy()
    }
}

impl SamplerParams {
    /// Greedy decoding (temperature 0).
    pub fn greedy() -> Self {
        SamplerParams { temperature: 0.0, top_k: None, top_p: 1.0, seed: 0 }
    }

    /// Checks the ranges documented on the fields.
    pub fn validate(&self) -> Result<(), SampleError> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(SampleError::Temperature(self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SampleError::TopP(self.top_p));
        }
        if self.top_k == Some(0) {
            return Err(SampleError::TopK);
        }
        Ok(())
    }

    /// Whether sampling ignores the generator (temperature 0).
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// The op's settings for these params with the draw `u` (in [0, 1)). `top_k` above 2^24 is
    /// 2^24 (every row is shorter, so both keep every token).
    pub fn settings(&self, u: f32) -> Result<SampleSettings, SampleError> {
        self.validate()?;
        let k = self.top_k.map_or(0, |k| k.min(MAX_TOP_K as usize) as u32);
        SampleSettings::new(self.temperature, k, self.top_p, u).map_err(|_| SampleError::U(u))
    }
}

/// A seeded sampler: [`SamplerParams`] plus the generator state.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplerParams,
    rng: SplitMix64,
}

impl Sampler {
    /// A sampler for validated `params`.
    pub fn new(params: SamplerParams) -> Result<Sampler, SampleError> {
        params.validate()?;
        Ok(Sampler { params, rng: SplitMix64::new(params.seed) })
    }

    /// A greedy sampler.
    pub fn greedy() -> Sampler {
        Sampler { params: SamplerParams::greedy(), rng: SplitMix64::new(0) }
    }

    pub fn params(&self) -> &SamplerParams {
        &self.params
    }

    /// The settings of the next token's pick: the params and a fresh draw `u` (none for greedy,
    /// which leaves the generator as it was). What the `sample` op takes as one row of its
    /// settings tensor ([`SampleSettings::to_row`]).
    pub fn next_settings(&mut self) -> SampleSettings {
        let u = if self.params.is_greedy() { 0.0 } else { self.next_u() };
        self.params.settings(u).expect("Sampler::new validated the params, and draws are in [0, 1)")
    }

    /// Picks a token id from `logits` (one value per vocab entry) with [`Sampler::next_settings`]:
    /// NaN logits are never picked; `-inf` logits have probability 0 unless every logit is NaN or
    /// `-inf` (then the `-inf` ones are equally likely).
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32, SampleError> {
        if logits.is_empty() {
            return Err(SampleError::Empty);
        }
        let settings = self.next_settings();
        sample_row(logits, &settings).ok_or(SampleError::AllNan)
    }

    /// Uniform in [0, 1) with 24 bits (exact in f32, as the op's settings hold it).
    fn next_u(&mut self) -> f32 {
        (self.rng.next_u64() >> 40) as f32 / (1u32 << 24) as f32
    }
}

/// Index of the largest non-NaN value (lowest index on ties), `None` if all are NaN.
pub fn argmax(logits: &[f32]) -> Option<u32> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &l) in logits.iter().enumerate() {
        if l.is_nan() {
            continue;
        }
        if best.is_none_or(|(_, b)| l > b) {
            best = Some((i, l));
        }
    }
    best.map(|(i, _)| i as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: Option<usize>, top_p: f32, seed: u64) -> SamplerParams {
        SamplerParams { temperature, top_k, top_p, seed }
    }

    #[test]
    fn rejects_bad_params() {
        assert_eq!(Sampler::new(params(-0.1, None, 1.0, 0)).unwrap_err(), SampleError::Temperature(-0.1));
        assert!(matches!(Sampler::new(params(f32::NAN, None, 1.0, 0)), Err(SampleError::Temperature(_))));
        assert_eq!(Sampler::new(params(1.0, None, 0.0, 0)).unwrap_err(), SampleError::TopP(0.0));
        assert_eq!(Sampler::new(params(1.0, None, 1.5, 0)).unwrap_err(), SampleError::TopP(1.5));
        assert_eq!(Sampler::new(params(1.0, Some(0), 1.0, 0)).unwrap_err(), SampleError::TopK);
        assert_eq!(Sampler::greedy().sample(&[]), Err(SampleError::Empty));
        assert_eq!(Sampler::greedy().sample(&[f32::NAN]), Err(SampleError::AllNan));
    }

    #[test]
    fn greedy_is_argmax_lowest_id_on_ties() {
        let mut s = Sampler::greedy();
        assert_eq!(s.sample(&[0.0, 3.0, f32::NAN, 3.0, -1.0]), Ok(1));
        assert_eq!(s.sample(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), Ok(0));
    }

    #[test]
    fn top_k_one_and_tiny_top_p_are_greedy() {
        let logits = [0.5, 2.0, 1.9, -3.0];
        for seed in 0..50 {
            assert_eq!(Sampler::new(params(5.0, Some(1), 1.0, seed)).unwrap().sample(&logits), Ok(1));
            assert_eq!(Sampler::new(params(5.0, None, 1e-6, seed)).unwrap().sample(&logits), Ok(1));
        }
    }

    #[test]
    fn top_k_and_top_p_restrict_the_support() {
        let logits = [1.0, 0.9, 0.8, 0.0, -5.0];
        let mut s = Sampler::new(params(1.0, Some(2), 1.0, 3)).unwrap();
        for _ in 0..500 {
            assert!(s.sample(&logits).unwrap() < 2);
        }
        // Probabilities at t=1: about .34 .31 .28 .07 .002; top_p 0.6 keeps ids 0 and 1.
        let mut s = Sampler::new(params(1.0, None, 0.6, 3)).unwrap();
        let mut seen = [0usize; 5];
        for _ in 0..2000 {
            seen[s.sample(&logits).unwrap() as usize] += 1;
        }
        assert!(seen[0] > 0 && seen[1] > 0 && seen[2..].iter().all(|&n| n == 0), "{seen:?}");
    }

    #[test]
    fn frequencies_follow_the_softmax() {
        let logits = [0.0f32, (3.0f32).ln()];
        let mut s = Sampler::new(params(1.0, None, 1.0, 11)).unwrap();
        let n = 20_000;
        let ones = (0..n).filter(|_| s.sample(&logits).unwrap() == 1).count();
        let f = ones as f64 / n as f64;
        assert!((f - 0.75).abs() < 0.02, "{f}");
    }

    #[test]
    fn the_op_on_a_backend_picks_what_the_host_picks() {
        use tessera_graph::{Graph, Session};
        use tessera_ops::DType;
        // Four sequences with their own params and generators; one step each, sampled here and
        // by the `sample` op (CPU backend) from the settings rows of a clone of the samplers.
        let n = 300;
        let logits: Vec<f32> = (0..4 * n).map(|i| (((i * 7919) % 1000) as f32 / 97.0).sin() * 4.0).collect();
        let params = [
            params(0.0, None, 1.0, 1),
            params(0.8, Some(40), 0.95, 2),
            params(1.3, None, 0.5, 3),
            params(1.0, None, 1.0, 4),
        ];
        for step in 0..20 {
            let mut host: Vec<Sampler> = params.iter().map(|p| Sampler::new(*p).unwrap()).collect();
            let mut device = host.clone();
            for s in host.iter_mut().chain(device.iter_mut()) {
                for _ in 0..step {
                    s.next_settings();
                }
            }
            let want: Vec<u32> =
                host.iter_mut().enumerate().map(|(r, s)| s.sample(&logits[r * n..(r + 1) * n]).unwrap()).collect();
            let rows: Vec<f32> = device.iter_mut().flat_map(|s| s.next_settings().to_row()).collect();
            let mut g = Graph::new();
            let l = g.input("logits", DType::F32, [n, 4, 1, 1]).unwrap();
            let st = g.input("settings", DType::F32, [4, 4, 1, 1]).unwrap();
            let ids = g.sample(l, st).unwrap();
            g.mark_output(ids).unwrap();
            let mut cpu = tessera_cpu::CpuBackend::new();
            let mut session = Session::new(&g, &mut cpu).unwrap();
            session.set(l, bytemuck_f32(&logits).as_slice()).unwrap();
            session.set(st, bytemuck_f32(&rows).as_slice()).unwrap();
            session.run().unwrap();
            let got: Vec<u32> = session.get_f64(ids).unwrap().iter().map(|&v| v as u32).collect();
            assert_eq!(got, want, "step {step}");
        }
    }

    fn bytemuck_f32(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn same_seed_same_stream() {
        let logits: Vec<f32> = (0..64).map(|i| ((i * 37 % 17) as f32) * 0.3).collect();
        let run = |seed| {
            let mut s = Sampler::new(params(0.8, Some(40), 0.9, seed)).unwrap();
            (0..100).map(|_| s.sample(&logits).unwrap()).collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
    }
}
