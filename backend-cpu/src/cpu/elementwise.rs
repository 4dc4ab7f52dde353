//! Elementwise ops: unary functions, broadcasting binary ops, scale, swiglu.
//!
//! Every row is computed in f32 and stored in the output's dtype (the first input's). Rows that
//! are dense, aligned f32 on both sides are read and written in place; any other layout or dtype
//! goes through one f32 scratch row per task. `exp`, `sigmoid` and `silu` are the vectorisable
//! versions of [`super::math`].

use tessera_ops::{BinaryOp, ScaleParams, UnaryOp};

use super::math::{exp, map, map_in_place, sigmoid, silu, zip, zip_in_place};
use super::strided::{Dst, Src, row_coords};

/// `ln(1 + e^x) = max(x, 0) + ln(1 + e^-|x|)`: no overflow for large `x`, and `ln_1p` keeps the
/// tiny values of very negative `x`.
#[inline]
pub(super) fn softplus(x: f32) -> f32 {
    x.max(0.0) + exp(-x.abs()).ln_1p()
}

/// Per-task scratch: the first operand's row and the second's.
#[derive(Default)]
struct Scratch {
    a: Vec<f32>,
    b: Vec<f32>,
}

/// `dst[i] = f(x[i])`, same shapes.
fn map_rows(x: Src<'_>, dst: &mut Dst<'_>, f: impl Fn(f32) -> f32 + Sync + Send) {
    let ne = dst.ne();
    dst.for_each_row(ne[0], Vec::new, |scratch, r, mut row| {
        let c = row_coords(ne, r);
        if let Some(xs) = x.row_f32(c)
            && let Some(out) = row.f32_mut()
        {
            return map(out, xs, &f);
        }
        row.fill_f32(scratch, |out| {
            x.load_row(c, out);
            map_in_place(out, &f);
        });
    });
}

pub(super) fn unary(op: UnaryOp, x: Src<'_>, dst: &mut Dst<'_>) {
    match op {
        UnaryOp::Neg => map_rows(x, dst, |v| -v),
        UnaryOp::Exp => map_rows(x, dst, exp),
        UnaryOp::Silu => map_rows(x, dst, silu),
        UnaryOp::Sigmoid => map_rows(x, dst, sigmoid),
        UnaryOp::Softplus => map_rows(x, dst, softplus),
    }
}

/// `x * scale + bias`.
pub(super) fn scale(p: ScaleParams, x: Src<'_>, dst: &mut Dst<'_>) {
    let (s, b) = (p.scale, p.bias);
    map_rows(x, dst, move |v| v * s + b);
}

/// `out[i] = f(a[i], b[i mod b.len()])`; `b.len()` divides `out.len()`.
#[inline(always)]
fn zip_tiled(out: &mut [f32], a: &[f32], b: &[f32], f: &impl Fn(f32, f32) -> f32) {
    if let [y] = b {
        return map(out, a, |x| f(x, *y));
    }
    for (os, xs) in out.chunks_mut(b.len()).zip(a.chunks(b.len())) {
        zip(os, xs, b, f);
    }
}

/// `out[i] = f(out[i], b[i mod b.len()])`.
#[inline(always)]
fn zip_tiled_in_place(out: &mut [f32], b: &[f32], f: &impl Fn(f32, f32) -> f32) {
    if let [y] = b {
        return map_in_place(out, |x| f(x, *y));
    }
    for os in out.chunks_mut(b.len()) {
        zip_in_place(os, b, f);
    }
}

/// `dst[i] = f(a[i], b[i mod b.ne])`: `b` broadcasts to `a`'s shape by tiling (ggml's repeat
/// rule), in every dimension.
fn zip_rows(a: Src<'_>, b: Src<'_>, dst: &mut Dst<'_>, f: impl Fn(f32, f32) -> f32 + Sync + Send) {
    let (ne, bne) = (dst.ne(), b.ne());
    dst.for_each_row(ne[0], Scratch::default, |scratch, r, mut row| {
        let Scratch { a: a_row, b: b_row } = scratch;
        let c = row_coords(ne, r);
        let cb = [c[0] % bne[1], c[1] % bne[2], c[2] % bne[3]];
        let ys: &[f32] = match b.row_f32(cb) {
            Some(ys) => ys,
            None => {
                b_row.resize(bne[0], 0.0);
                b.load_row(cb, b_row);
                b_row
            }
        };
        if let Some(xs) = a.row_f32(c)
            && let Some(out) = row.f32_mut()
        {
            return zip_tiled(out, xs, ys, &f);
        }
        row.fill_f32(a_row, |out| {
            a.load_row(c, out);
            zip_tiled_in_place(out, ys, &f);
        });
    });
}

pub(super) fn binary(op: BinaryOp, a: Src<'_>, b: Src<'_>, dst: &mut Dst<'_>) {
    match op {
        BinaryOp::Add => zip_rows(a, b, dst, |x, y| x + y),
        BinaryOp::Sub => zip_rows(a, b, dst, |x, y| x - y),
        BinaryOp::Mul => zip_rows(a, b, dst, |x, y| x * y),
        BinaryOp::Div => zip_rows(a, b, dst, |x, y| x / y),
    }
}

/// `silu(gate) * up` with separate inputs of equal shape, or, with `up` absent, per row of `x`
/// (`2n` long): `silu(x[i]) * x[n + i]` for `i < n`.
pub(super) fn swiglu(x: Src<'_>, up: Option<Src<'_>>, dst: &mut Dst<'_>) {
    if let Some(up) = up {
        return zip_rows(x, up, dst, |g, u| silu(g) * u);
    }
    let ne = dst.ne();
    let n = ne[0];
    dst.for_each_row(3 * n, Scratch::default, |scratch, r, mut row| {
        let c = row_coords(ne, r);
        let xs: &[f32] = match x.row_f32(c) {
            Some(xs) => xs,
            None => {
                scratch.b.resize(2 * n, 0.0);
                x.load_row(c, &mut scratch.b);
                &scratch.b
            }
        };
        let (gate, up) = xs.split_at(n);
        row.fill_f32(&mut scratch.a, |out| zip(out, gate, up, |g, u| silu(g) * u));
    });
}

#[cfg(test)]
mod tests {
    use tessera_ops::{BinaryOp, UnaryOp};

    use crate::cpu::testutil::{BF16, F16, F32, FLOATS, check};

    #[test]
    fn unary_ops_on_odd_shapes() {
        for u in UnaryOp::ALL {
            check(20, 1e-12, |g, l| {
                let x = l.random_in(g.input("x", F32, [37, 3, 2, 1])?, -6.0, 6.0);
                Ok(vec![g.unary(u, x)?])
            });
        }
    }

    #[test]
    fn unary_ops_are_stable_at_extremes() {
        let xs = vec![-1000., -120., -90., -30., -1e-8, 0., 1e-8, 30., 90., 120., 1000., -0.];
        for u in [UnaryOp::Neg, UnaryOp::Silu, UnaryOp::Sigmoid, UnaryOp::Softplus] {
            check(21, 1e-12, |g, l| {
                let x = l.values(g.input("x", F32, [12, 1, 1, 1])?, xs.clone());
                Ok(vec![g.unary(u, x)?])
            });
        }
        // exp overflows to inf exactly where the reference does
        check(21, 1e-12, |g, l| {
            let x = l.values(g.input("x", F32, [12, 1, 1, 1])?, xs.clone());
            Ok(vec![g.exp(x)?])
        });
    }

    #[test]
    fn unary_ops_on_half_types_and_transposed_inputs() {
        for dt in [F16, BF16] {
            for u in UnaryOp::ALL {
                check(22, 1e-5, |g, l| {
                    let x = l.random_in(g.input("x", dt, [5, 9, 2, 1])?, -4.0, 4.0);
                    let t = g.transpose(x)?;
                    Ok(vec![g.unary(u, t)?])
                });
            }
        }
    }

    #[test]
    fn binary_ops_broadcast_in_every_dimension() {
        let shapes = [[12, 4, 3, 2], [12, 1, 1, 1], [1, 4, 1, 1], [4, 2, 3, 1], [1, 1, 1, 1], [6, 4, 1, 2]];
        for op in BinaryOp::ALL {
            for b_ne in shapes {
                check(23, 1e-12, |g, l| {
                    let a = l.random(g.input("a", F32, [12, 4, 3, 2])?);
                    let b = l.random_in(g.input("b", F32, b_ne)?, 0.5, 2.0);
                    Ok(vec![g.binary(op, a, b)?])
                });
            }
        }
    }

    #[test]
    fn binary_ops_mix_dtypes_and_strided_operands() {
        for (da, db) in [(F16, F32), (BF16, F16), (F32, BF16)] {
            for op in BinaryOp::ALL {
                check(24, 1e-5, |g, l| {
                    let a = l.random(g.input("a", da, [7, 6, 2, 1])?);
                    let a = g.permute(a, [1, 0, 2, 3])?; // [6, 7, 2]
                    let b = l.random_in(g.input("b", db, [7, 3, 1, 1])?, 0.5, 2.0);
                    let b = g.transpose(b)?; // [3, 7]: tiles twice along ne0
                    Ok(vec![g.binary(op, a, b)?])
                });
            }
        }
    }

    #[test]
    fn scale_with_bias_on_a_permuted_input() {
        for dt in FLOATS {
            let bound = if dt == F32 { 1e-12 } else { 1e-5 };
            check(25, bound, |g, l| {
                let x = l.random(g.input("x", dt, [4, 5, 3, 2])?);
                let p = g.permute(x, [3, 1, 0, 2])?;
                Ok(vec![g.scale_bias(p, -1.75, 0.25)?])
            });
        }
    }

    #[test]
    fn swiglu_split_and_fused() {
        for dt in FLOATS {
            let bound = if dt == F32 { 1e-12 } else { 1e-5 };
            check(26, bound, |g, l| {
                let gate = l.random_in(g.input("gate", dt, [33, 5, 2, 1])?, -8.0, 8.0);
                let up = l.random(g.input("up", F32, [5, 33, 2, 1])?);
                let up = g.transpose(up)?;
                let split = g.swiglu(gate, up)?;
                let x = l.random_in(g.input("x", dt, [66, 5, 2, 1])?, -8.0, 8.0);
                let fused = g.swiglu_fused(x)?;
                let xv = g.view(
                    x,
                    [34, 5, 2, 1],
                    [dt.block_bytes(), 66 * dt.block_bytes(), 330 * dt.block_bytes(), 660 * dt.block_bytes()],
                    2 * dt.block_bytes(),
                )?;
                let fused_view = g.swiglu_fused(xv)?;
                Ok(vec![split, fused, fused_view])
            });
        }
    }
}
