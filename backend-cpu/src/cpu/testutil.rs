//! Test helpers: build a graph once, run it on the [`ReferenceBackend`] and on the
//! [`CpuBackend`] with the same seeded inputs, and compare every output by NMSE.
//!
//! The CPU backend runs twice: with buffers at aligned offsets and at an odd byte offset (guard
//! bytes around every buffer), so the misaligned decoding paths are exercised and any write
//! outside an output is caught by the session's guard check. Both CPU runs must agree bit for
//! bit: the layout of the data must not change the arithmetic.

use tessera_graph::{Backend, ExecError, Graph, GraphError, Session, SessionOptions, Tensor};
use tessera_ops::DType;

use crate::{CpuBackend, ReferenceBackend};

/// xorshift64*: a tiny deterministic generator, enough for test data.
pub(crate) struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `[lo, hi)`.
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform integer in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// The leaves of a test graph and the values to fill them with.
pub(crate) struct Leaves {
    pub rng: Rng,
    fills: Vec<(Tensor, Vec<f64>)>,
}

impl Leaves {
    /// Fills `t` with uniform values in `[-1, 1)`.
    pub fn random(&mut self, t: Tensor) -> Tensor {
        self.random_in(t, -1.0, 1.0)
    }

    /// Fills `t` with uniform values in `[lo, hi)`.
    pub fn random_in(&mut self, t: Tensor, lo: f64, hi: f64) -> Tensor {
        let v = (0..t.meta().nelements()).map(|_| self.rng.uniform(lo, hi)).collect();
        self.values(t, v)
    }

    /// Fills `t` with uniform integers in `0..limit` (row ids).
    pub fn ids(&mut self, t: Tensor, limit: usize) -> Tensor {
        let v = (0..t.meta().nelements()).map(|_| self.rng.below(limit) as f64).collect();
        self.values(t, v)
    }

    /// Fills `t` with `v` (logical order).
    pub fn values(&mut self, t: Tensor, v: Vec<f64>) -> Tensor {
        assert_eq!(v.len(), t.meta().nelements(), "test fill of the wrong size");
        self.fills.push((t, v));
        t
    }
}

/// Every output's values in logical order, or why they could not be read.
pub(crate) type Outputs = Result<Vec<Vec<f64>>, ExecError>;

/// A graph, its leaf values and the tensors to compare.
pub(crate) struct Case {
    graph: Graph,
    fills: Vec<(Tensor, Vec<f64>)>,
    outputs: Vec<Tensor>,
}

/// Builds a case from `build`, which adds leaves (registering their values with `Leaves`) and
/// ops, and returns the tensors to compare.
pub(crate) fn case(seed: u64, build: impl FnOnce(&mut Graph, &mut Leaves) -> Result<Vec<Tensor>, GraphError>) -> Case {
    let mut graph = Graph::new();
    let mut leaves = Leaves { rng: Rng::new(seed), fills: Vec::new() };
    let outputs = build(&mut graph, &mut leaves).expect("test graph builds");
    for &t in &outputs {
        graph.mark_output(t).expect("output of this graph");
    }
    Case { graph, fills: leaves.fills, outputs }
}

impl Case {
    /// Runs the case on `backend` (buffers `guard` bytes into their allocations) and reads every
    /// output as f64.
    pub fn run(&self, backend: &mut dyn Backend, guard: usize) -> Outputs {
        let mut s =
            Session::with_options(&self.graph, backend, SessionOptions { guard_bytes: guard, ..Default::default() })?;
        for (t, v) in &self.fills {
            s.set_f64(*t, v)?;
        }
        s.run()?;
        self.outputs.iter().map(|&t| s.get_f64(t)).collect()
    }

    /// Runs the case on `backend` and reads the outputs whether or not the run succeeded (to see
    /// what a failed step left in state).
    pub fn run_and_read(&self, backend: &mut dyn Backend) -> (Result<(), ExecError>, Outputs) {
        let mut s = match Session::new(&self.graph, backend) {
            Ok(s) => s,
            Err(e) => return (Err(e.clone()), Err(e)),
        };
        for (t, v) in &self.fills {
            if let Err(e) = s.set_f64(*t, v) {
                return (Err(e.clone()), Err(e));
            }
        }
        let run = s.run();
        (run, self.outputs.iter().map(|&t| s.get_f64(t)).collect())
    }
}

/// Normalised mean squared error `sum (got - want)^2 / sum want^2` over the finite reference
/// values. Where the reference is not finite the result must be the same non-finite value
/// (NaN for NaN, the same infinity); otherwise the NMSE is infinite.
pub(crate) fn nmse(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "output lengths differ");
    let (mut err, mut norm) = (0.0, 0.0);
    for (&g, &w) in got.iter().zip(want) {
        if !w.is_finite() {
            let same = (w.is_nan() && g.is_nan()) || g == w;
            if !same {
                return f64::INFINITY;
            }
            continue;
        }
        if !g.is_finite() {
            return f64::INFINITY;
        }
        err += (g - w) * (g - w);
        norm += w * w;
    }
    if norm == 0.0 { if err == 0.0 { 0.0 } else { f64::INFINITY } } else { err / norm }
}

/// Runs `build` on both backends and asserts every output's NMSE is at most `bound` (0 demands
/// exact equality). Returns the largest NMSE seen.
pub(crate) fn check(
    seed: u64,
    bound: f64,
    build: impl FnOnce(&mut Graph, &mut Leaves) -> Result<Vec<Tensor>, GraphError>,
) -> f64 {
    let c = case(seed, build);
    let want = c.run(&mut ReferenceBackend::new(), 0).expect("reference run");
    let got = c.run(&mut CpuBackend::new(), 0).expect("cpu run");
    let got_odd = c.run(&mut CpuBackend::new(), 5).expect("cpu run at odd offsets");
    let mut worst: f64 = 0.0;
    for (i, ((g, g_odd), w)) in got.iter().zip(&got_odd).zip(&want).enumerate() {
        let same = g.iter().zip(g_odd).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same, "output {i}: aligned and misaligned CPU runs differ");
        let e = nmse(g, w);
        assert!(e <= bound, "output {i}: NMSE {e:e} exceeds {bound:e}\n got {:?}\nwant {:?}", head(g), head(w));
        worst = worst.max(e);
    }
    worst
}

fn head(v: &[f64]) -> &[f64] {
    &v[..v.len().min(16)]
}

/// Runs `build` on both backends, expects both to fail, and returns the CPU's error after
/// asserting it equals the reference's.
pub(crate) fn check_error(build: impl FnOnce(&mut Graph, &mut Leaves) -> Result<Vec<Tensor>, GraphError>) -> ExecError {
    let c = case(1, build);
    let want = c.run(&mut ReferenceBackend::new(), 0).expect_err("reference must fail");
    let got = c.run(&mut CpuBackend::new(), 0).expect_err("cpu must fail");
    assert_eq!(got, want, "cpu and reference fail differently");
    got
}

/// Shorthands for tests.
pub(crate) const F32: DType = DType::F32;
pub(crate) const F16: DType = DType::F16;
pub(crate) const BF16: DType = DType::BF16;
pub(crate) const I32: DType = DType::I32;
/// Every float dtype.
pub(crate) const FLOATS: [DType; 3] = [F32, F16, BF16];
