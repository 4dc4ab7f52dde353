//! rope_multi on the CPU: rotary position embedding of `x [head_dim, n_head, n_tokens, 1]` (any
//! float type, any strides) into a contiguous f32 output.
//!
//! The angles are computed once per (token, pair) in f64 (`pos * freq_base^(-2p / n_rot)`, then
//! `cos`/`sin`) and rounded to f32, so large positions lose no accuracy to an f32 angle; each
//! (head, token) row is then rotated in f32 with the token's table. Parallel over the rows.

use tessera_ops::{KernelError, RopePairing, RopeParams};

use super::par;
use super::strided::{Dst, Src, row_coords};

/// The position stream (0 = t, 1 = h, 2 = w, 3 = e) pair `pair` reads: 0 without sections; with
/// sections ggml's interleaved (imrope) rule on `s = pair mod sum(sections)`: h if
/// `s % 3 == 1 && s < 3 s1`, else w if `s % 3 == 2 && s < 3 s2`, else t if `s % 3 == 0 && s < 3 s0`,
/// else e.
fn position_stream(sections: Option<[usize; 4]>, pair: usize) -> usize {
    let Some(sec) = sections else { return 0 };
    let s = pair % sec.iter().sum::<usize>();
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

/// Per token, `n_rot` f32s: the `n_rot / 2` cosines then the `n_rot / 2` sines of its angles.
fn angle_table(p: &RopeParams, pos: &Src<'_>, n_tokens: usize) -> Vec<f32> {
    let half = p.n_rot / 2;
    let base = f64::from(p.freq_base);
    let inv_freq: Vec<f64> = (0..half).map(|i| base.powf(-2.0 * i as f64 / p.n_rot as f64)).collect();
    let streams: Vec<usize> = (0..half).map(|i| position_stream(p.sections, i)).collect();
    let mut table = vec![0f32; n_tokens * p.n_rot];
    par::chunks_mut(
        &mut table,
        p.n_rot,
        64,
        || (),
        |_, t, row| {
            let (cos, sin) = row.split_at_mut(half);
            for (i, (c, s)) in cos.iter_mut().zip(sin).enumerate() {
                // The shape rules fixed positions to [n_streams * n_tokens]: stream-major.
                let position = f64::from(pos.elem_i32([streams[i] * n_tokens + t, 0, 0, 0]));
                let (sin_t, cos_t) = (position * inv_freq[i]).sin_cos();
                *c = cos_t as f32;
                *s = sin_t as f32;
            }
        },
    );
    table
}

/// Rotates the first `n_rot` values of `row` (one head of one token) in place by the angles of
/// `table` (`cos` then `sin`, `n_rot / 2` each).
fn rotate(pairing: RopePairing, row: &mut [f32], table: &[f32]) {
    let n_rot = table.len();
    let (cos, sin) = table.split_at(n_rot / 2);
    match pairing {
        RopePairing::Neox => {
            let (lo, hi) = row[..n_rot].split_at_mut(n_rot / 2);
            for (((a, b), &c), &s) in lo.iter_mut().zip(hi).zip(cos).zip(sin) {
                let (xa, xb) = (*a, *b);
                *a = xa * c - xb * s;
                *b = xa * s + xb * c;
            }
        }
        RopePairing::Adjacent => {
            for ((ab, &c), &s) in row[..n_rot].chunks_exact_mut(2).zip(cos).zip(sin) {
                let (xa, xb) = (ab[0], ab[1]);
                ab[0] = xa * c - xb * s;
                ab[1] = xa * s + xb * c;
            }
        }
    }
}

/// `y = rope(x)` for `x [head_dim, n_head, n_tokens, 1]` and i32 `positions` (`[n_tokens]`, or
/// `[4 * n_tokens]` stream-major with sections); see `RopeParams` and docs/OPS.md.
pub(super) fn rope_multi(p: &RopeParams, x: Src<'_>, pos: Src<'_>, dst: &mut Dst<'_>) -> Result<(), KernelError> {
    let ne = dst.ne();
    let table = angle_table(p, &pos, ne[2]);
    dst.for_each_row(2 * ne[0], Vec::new, |scratch, r, mut row| {
        let c = row_coords(ne, r);
        let token = c[1];
        row.fill_f32(scratch, |out| {
            x.load_row(c, out);
            rotate(p.pairing, out, &table[token * p.n_rot..(token + 1) * p.n_rot]);
        });
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use tessera_ops::{RopePairing, RopeParams};

    use crate::cpu::testutil::{BF16, F16, F32, I32, check};

    fn params(n_rot: usize, pairing: RopePairing, sections: Option<[usize; 4]>) -> RopeParams {
        RopeParams { n_rot, freq_base: 10_000.0, pairing, sections }
    }

    #[test]
    fn neox_and_adjacent_of_each_dtype() {
        for (dt, pairing) in [(F32, RopePairing::Neox), (F16, RopePairing::Adjacent), (BF16, RopePairing::Neox)] {
            check(50, 1e-12, |g, l| {
                let x = l.random(g.input("x", dt, [64, 3, 5, 1])?);
                let pos = l.ids(g.input("pos", I32, [5, 1, 1, 1])?, 4096);
                Ok(vec![
                    g.rope_multi(x, pos, params(64, pairing, None))?,
                    g.rope_multi(x, pos, params(24, pairing, None))?,
                ])
            });
        }
    }

    #[test]
    fn imrope_with_partial_rotation_and_large_positions() {
        check(51, 1e-12, |g, l| {
            let x = l.random(g.input("x", F32, [256, 4, 3, 1])?);
            let v: Vec<f64> = (0..12).map(|_| l.rng.below(2_000_000) as f64 - 1_000_000.0).collect();
            let pos = l.values(g.input("pos", I32, [12, 1, 1, 1])?, v);
            let mut p = params(64, RopePairing::Neox, Some([11, 11, 10, 0]));
            p.freq_base = 1e7;
            let q = g.rope_multi(x, pos, p)?;
            p.sections = Some([3, 2, 1, 2]);
            p.pairing = RopePairing::Adjacent;
            Ok(vec![q, g.rope_multi(x, pos, p)?])
        });
    }

    #[test]
    fn strided_views_of_x_and_positions() {
        check(52, 1e-12, |g, l| {
            // q as a view into a joint q+gate projection [2 * 128 * n_head, n_tokens]
            let qg = l.random(g.input("qg", F32, [2 * 128 * 3, 4, 1, 1])?);
            let nb = qg.meta().nb;
            let q = g.view(qg, [128, 3, 4, 1], [4, 2 * 128 * 4, nb[1], nb[2]], 0)?;
            // positions as a window into a longer vector
            let pp = l.ids(g.input("pp", I32, [7, 1, 1, 1])?, 100);
            let pos = g.view(pp, [4, 1, 1, 1], [4, 16, 16, 16], 8)?;
            // x transposed: heads and tokens swapped
            let t = l.random(g.input("t", F16, [32, 4, 2, 1])?);
            let t = g.permute(t, [0, 2, 1, 3])?;
            Ok(vec![
                g.rope_multi(q, pos, params(64, RopePairing::Neox, None))?,
                g.rope_multi(t, pos, params(32, RopePairing::Adjacent, None))?,
            ])
        });
    }
}
