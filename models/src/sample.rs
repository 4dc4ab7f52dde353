//! Token sampling from f32 logits: greedy, temperature, top-k, top-p (nucleus), seeded.
//!
//! A [`Sampler`] is deterministic: the same [`SamplerParams`] (seed included) and the same logits
//! give the same tokens, on every platform (the generator is SplitMix64, the arithmetic is f64
//! over the f32 logits in a fixed order).
//!
//! Order of the filters, as in llama.cpp's default chain: top-k on the raw logits, then softmax at
//! the temperature, then top-p over the sorted probabilities, then one draw. Temperature 0 is
//! greedy: the largest logit, the lowest id on ties; top-k / top-p do not change the argmax.

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

    /// Picks a token id from `logits` (one value per vocab entry). NaN logits are never picked;
    /// `-inf` logits have probability 0 unless every other logit is NaN or `-inf`.
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32, SampleError> {
        if logits.is_empty() {
            return Err(SampleError::Empty);
        }
        if self.params.is_greedy() {
            return argmax(logits).ok_or(SampleError::AllNan);
        }
        // Candidates sorted by logit, largest first, lowest id first on ties.
        let mut cand: Vec<(u32, f32)> =
            logits.iter().enumerate().filter(|(_, l)| !l.is_nan()).map(|(i, &l)| (i as u32, l)).collect();
        if cand.is_empty() {
            return Err(SampleError::AllNan);
        }
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if let Some(k) = self.params.top_k {
            cand.truncate(k);
        }
        let max = cand[0].1 as f64;
        if max == f64::NEG_INFINITY {
            return Ok(cand[0].0);
        }
        let t = self.params.temperature as f64;
        let mut probs: Vec<f64> = cand.iter().map(|&(_, l)| ((l as f64 - max) / t).exp()).collect();
        let sum: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= sum);
        // Nucleus: the shortest prefix reaching top_p (at least one token).
        let top_p = self.params.top_p as f64;
        let mut keep = probs.len();
        if top_p < 1.0 {
            let mut acc = 0.0;
            for (i, p) in probs.iter().enumerate() {
                acc += p;
                if acc >= top_p {
                    keep = i + 1;
                    break;
                }
            }
        }
        let kept = &probs[..keep];
        let total: f64 = kept.iter().sum();
        let u = self.next_f64() * total;
        let mut acc = 0.0;
        for (i, p) in kept.iter().enumerate() {
            acc += p;
            if u < acc {
                return Ok(cand[i].0);
            }
        }
        Ok(cand[keep - 1].0)
    }

    /// Uniform in [0, 1) with 53 bits.
    fn next_f64(&mut self) -> f64 {
        (self.rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64
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
