//! Seeded input data: each leaf's bytes, drawn from its [`Init`] and laid out as its [`Layout`]
//! says (the logical values land exactly where the op's view of the leaf reads them; the rest of a
//! larger leaf is filler the op must not read).

use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use tessera_ops::{DType, TensorMeta, host};

use crate::case::{Init, InputSpec, Layout};

/// Scale of i32 values drawn from [`Init::Uniform`].
const INT_SCALE: f64 = 1e6;

/// The bytes of the leaf `leaf` behind input `spec`, whose view `seen` starts `offset` bytes into
/// the leaf.
pub(crate) fn leaf_bytes(spec: &InputSpec, leaf: &TensorMeta, seen: &TensorMeta, offset: usize, seed: u64) -> Vec<u8> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let values = logical_values(spec, &mut rng);
    if spec.layout == Layout::Contiguous {
        return encode(spec.dtype, &values);
    }
    let filler_init = if matches!(spec.init, Init::Ids { .. } | Init::Fixed(_)) {
        Init::Uniform { lo: 0.0, hi: 0.0 }
    } else {
        Init::SIGNED
    };
    let filler = draw_uniform(spec.dtype, filler_init, leaf.nelements(), &mut rng);
    let mut bytes = encode(spec.dtype, &filler);
    let values: Vec<f64> = values.iter().map(|&x| f64::from(x)).collect();
    host::scatter_f64(&values, &mut bytes, offset, seen);
    bytes
}

/// The values of an input in logical order (`ne[0]` fastest).
fn logical_values(spec: &InputSpec, rng: &mut SmallRng) -> Vec<f32> {
    let n: usize = spec.ne.iter().product();
    let row = spec.ne[0];
    match spec.init {
        Init::Uniform { .. } => draw_uniform(spec.dtype, spec.init, n, rng),
        Init::Ids { rows, unique } => {
            let mut out = Vec::with_capacity(n);
            let mut all: Vec<usize> = (0..rows).collect();
            for _ in 0..n / row {
                if unique {
                    assert!(row <= rows, "{}: {row} unique ids need at least as many rows, got {rows}", spec.name);
                    all.shuffle(rng);
                    out.extend(all[..row].iter().map(|&r| r as f32));
                } else {
                    out.extend((0..row).map(|_| rng.random_range(0..rows) as f32));
                }
            }
            out
        }
        Init::Mask => (0..n)
            .map(|i| {
                let x = rng.random_range(-1.0..1.0);
                if i % row != 0 && rng.random_range(0..4) == 0 { f32::NEG_INFINITY } else { x }
            })
            .collect(),
        Init::Generated(g) => {
            let values = (g.f)(spec.ne, g.args, rng.random::<u64>());
            assert_eq!(values.len(), n, "{}: {} generated values for {n} elements", spec.name, values.len());
            values
        }
        Init::Fixed(values) => {
            assert_eq!(values.len(), n, "{}: {} fixed values for {n} elements", spec.name, values.len());
            // |values| < 2^24 in practice: exact in f32.
            values.iter().map(|&v| v as f32).collect()
        }
        Init::Distinct => {
            let mut out = Vec::with_capacity(n);
            let mut levels: Vec<f32> = (0..row).map(|i| (-1.0 + 2.0 * (i as f64 + 0.5) / row as f64) as f32).collect();
            for _ in 0..n / row {
                levels.shuffle(rng);
                out.extend_from_slice(&levels);
            }
            out
        }
    }
}

/// `n` values uniform in the range of `init` (integers for i32, see [`Init::Uniform`]).
fn draw_uniform(dtype: DType, init: Init, n: usize, rng: &mut SmallRng) -> Vec<f32> {
    let Init::Uniform { lo, hi } = init else { unreachable!("draw_uniform takes Init::Uniform") };
    if hi <= lo {
        return vec![lo; n];
    }
    if dtype.is_float() {
        (0..n).map(|_| rng.random_range(lo..hi)).collect()
    } else {
        let (lo, hi) = ((f64::from(lo) * INT_SCALE) as i32, (f64::from(hi) * INT_SCALE) as i32);
        // |values| <= 10^6 < 2^24: exact in f32.
        (0..n).map(|_| rng.random_range(lo..hi) as f32).collect()
    }
}

/// Contiguous bytes of `dtype` holding `values` (f32 values are exact in f64, so this rounds
/// each value once, to nearest).
fn encode(dtype: DType, values: &[f32]) -> Vec<u8> {
    let values: Vec<f64> = values.iter().map(|&x| f64::from(x)).collect();
    host::encode(dtype, &values)
}
