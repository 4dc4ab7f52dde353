//! Reference rope_multi: the rotation written out per head, token and pair, in f64.
//!
//! For pair `p < n_rot / 2` with dims `(a, b)` (Neox: `(p, p + n_rot/2)`, Adjacent:
//! `(2p, 2p + 1)`) and `theta = pos * freq_base^(-2p / n_rot)`:
//! `y[a] = x[a] cos theta - x[b] sin theta`, `y[b] = x[a] sin theta + x[b] cos theta`.
//! Dims from `n_rot` on are copied. The shape rules have validated the params and shapes.

use super::RefTensor;
use crate::{KernelError, Op, RopePairing, TensorMeta};

pub(super) fn compute(op: &Op, inputs: &[RefTensor], out: &TensorMeta) -> Result<RefTensor, KernelError> {
    let Op::RopeMulti(p) = op else { unreachable!("reference rope::compute called for {op}") };
    let (x, pos) = (&inputs[0], &inputs[1]);
    let ne = x.ne;
    let n_tokens = ne[2];
    let half = p.n_rot / 2;
    // Dims from n_rot on pass through unchanged.
    let mut y = RefTensor::new(out.ne, x.data.clone());
    for t in 0..n_tokens {
        for h in 0..ne[1] {
            for pair in 0..half {
                let stream = position_stream(p.sections, pair);
                let position = pos.data[stream * n_tokens + t];
                let theta = position * f64::from(p.freq_base).powf(-2.0 * pair as f64 / p.n_rot as f64);
                let (a, b) = pair_dims(p.pairing, p.n_rot, pair);
                let (xa, xb) = (x.at([a, h, t, 0]), x.at([b, h, t, 0]));
                y.set([a, h, t, 0], xa * theta.cos() - xb * theta.sin());
                y.set([b, h, t, 0], xa * theta.sin() + xb * theta.cos());
            }
        }
    }
    Ok(y)
}

/// The two dims rotated together by pair `pair` (`0 <= pair < n_rot / 2`).
fn pair_dims(pairing: RopePairing, n_rot: usize, pair: usize) -> (usize, usize) {
    match pairing {
        RopePairing::Neox => (pair, pair + n_rot / 2),
        RopePairing::Adjacent => (2 * pair, 2 * pair + 1),
    }
}

/// The position stream (0 = t, 1 = h, 2 = w, 3 = e) pair `pair` takes its position from: 0 without
/// sections; with sections, ggml's interleaved (imrope) rule on `s = pair mod sum(sections)`:
/// h if `s % 3 == 1 && s < 3 s1`, else w if `s % 3 == 2 && s < 3 s2`, else t if
/// `s % 3 == 0 && s < 3 s0`, else e.
fn position_stream(sections: Option<[usize; 4]>, pair: usize) -> usize {
    let Some(sec) = sections else { return 0 };
    let total: usize = sec.iter().sum();
    let s = pair % total;
    if s % 3 == 1 && s < 3 * sec[1] {
        1
    } else if s % 3 == 2 && s < 3 * sec[2] {
        2
    } else if s.is_multiple_of(3) && s < 3 * sec[0] {
        0
    } else {
        3
    }
}

#[cfg(test)]
mod tests {
    use super::position_stream;
    use crate::reference::testutil::assert_close;
    use crate::reference::{RefTensor, compute};
    use crate::{DType, Op, RopePairing, RopeParams, TensorMeta, infer};

    fn run(p: RopeParams, x: ([usize; 4], Vec<f64>), pos: Vec<f64>) -> Vec<f64> {
        let op = Op::RopeMulti(p);
        let xm = TensorMeta::contiguous("t", DType::F32, x.0).unwrap();
        let pm = TensorMeta::contiguous("t", DType::I32, [pos.len(), 1, 1, 1]).unwrap();
        let out = infer(&op, &[&xm, &pm]).unwrap();
        let inputs = [RefTensor::new(x.0, x.1), RefTensor::new(pm.ne, pos)];
        compute(&op, &inputs, &out).unwrap().data
    }

    fn params(n_rot: usize, freq_base: f32, pairing: RopePairing, sections: Option<[usize; 4]>) -> RopeParams {
        RopeParams { n_rot, freq_base, pairing, sections }
    }

    #[test]
    fn neox_rotates_split_halves_and_passes_the_rest() {
        // head_dim 6, n_rot 4, base 100: pair 0 (dims 0, 2) theta = pos, pair 1 (dims 1, 3)
        // theta = pos / 10; dims 4, 5 pass through.
        let x = vec![1., 2., 3., 4., 5., 6.];
        let y = run(params(4, 100.0, RopePairing::Neox, None), ([6, 1, 1, 1], x), vec![2.]);
        let (c0, s0, c1, s1) = (2f64.cos(), 2f64.sin(), 0.2f64.cos(), 0.2f64.sin());
        let want = [1. * c0 - 3. * s0, 2. * c1 - 4. * s1, 1. * s0 + 3. * c0, 2. * s1 + 4. * c1, 5., 6.];
        assert_close(&y, &want);
    }

    #[test]
    fn adjacent_rotates_neighbouring_dims() {
        let x = vec![1., 2., 3., 4.];
        let y = run(params(4, 100.0, RopePairing::Adjacent, None), ([4, 1, 1, 1], x), vec![2.]);
        let (c0, s0, c1, s1) = (2f64.cos(), 2f64.sin(), 0.2f64.cos(), 0.2f64.sin());
        let want = [1. * c0 - 2. * s0, 1. * s0 + 2. * c0, 3. * c1 - 4. * s1, 3. * s1 + 4. * c1];
        assert_close(&y, &want);
    }

    #[test]
    fn each_token_uses_its_position_and_position_zero_is_identity() {
        // two heads, two tokens at positions 0 and 1, n_rot 2: only pair 0, theta = pos
        let x = vec![1., 0., 0., 1., 1., 0., 0., 1.];
        let y = run(params(2, 10.0, RopePairing::Neox, None), ([2, 2, 2, 1], x), vec![0., 1.]);
        let (c, s) = (1f64.cos(), 1f64.sin());
        assert_close(&y, &[1., 0., 0., 1., c, s, -s, c]);
    }

    #[test]
    fn interleaved_sections_pick_streams_like_ggml() {
        let streams: Vec<usize> = (0..32).map(|p| position_stream(Some([11, 11, 10, 0]), p)).collect();
        for (p, &s) in streams.iter().enumerate() {
            let want = match p % 3 {
                0 => 0,
                1 => 1,
                _ => 2,
            };
            assert_eq!(s, want, "pair {p}");
        }
        // Sections that do not cover a pair send it to stream e; the index wraps at the sum.
        assert_eq!((0..6).map(|p| position_stream(Some([1, 1, 1, 1]), p)).collect::<Vec<_>>(), [0, 1, 2, 3, 0, 1]);
        assert_eq!((0..4).map(|p| position_stream(Some([2, 0, 0, 2]), p)).collect::<Vec<_>>(), [0, 3, 3, 0]);
        assert_eq!(position_stream(None, 17), 0);
    }

    #[test]
    fn sections_read_stream_major_positions() {
        // n_rot 6: pairs 0, 1, 2 use streams t, h, w; one token with positions t=1, h=2, w=3, e=9
        let x = vec![1., 1., 1., 0., 0., 0.];
        let y = run(params(6, 1.0, RopePairing::Neox, Some([1, 1, 1, 0])), ([6, 1, 1, 1], x), vec![1., 2., 3., 9.]);
        let want = [1f64.cos(), 2f64.cos(), 3f64.cos(), 1f64.sin(), 2f64.sin(), 3f64.sin()];
        assert_close(&y, &want);
    }
}
