//! Reference elementwise ops: unary functions, broadcasting binary ops, scale, swiglu.

use super::RefTensor;
use crate::{BinaryOp, Op, TensorMeta, UnaryOp};

pub(super) fn compute(op: &Op, inputs: &[RefTensor], out: &TensorMeta) -> RefTensor {
    match op {
        Op::Unary(u) => map(&inputs[0], out, |x| unary(*u, x)),
        Op::Binary(b) => binary(*b, &inputs[0], &inputs[1], out),
        Op::Scale(p) => {
            let (scale, bias) = (f64::from(p.scale), f64::from(p.bias));
            map(&inputs[0], out, |x| x * scale + bias)
        }
        Op::Swiglu => match inputs {
            [gate, up] => swiglu_split(gate, up, out),
            [x] => swiglu_fused(x, out),
            _ => unreachable!("swiglu takes 1 or 2 inputs; infer checks this"),
        },
        _ => unreachable!("reference elementwise::compute called for {op}"),
    }
}

fn map(x: &RefTensor, out: &TensorMeta, f: impl Fn(f64) -> f64) -> RefTensor {
    RefTensor::new(out.ne, x.data.iter().map(|&v| f(v)).collect())
}

/// `1 / (1 + e^-x)`, evaluated so that neither branch overflows for large `|x|`.
fn sigmoid(x: f64) -> f64 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

/// `x * sigmoid(x)` (the same value as `x / (1 + e^-x)`, without the inf/inf risk).
fn silu(x: f64) -> f64 {
    x * sigmoid(x)
}

fn unary(u: UnaryOp, x: f64) -> f64 {
    match u {
        UnaryOp::Neg => -x,
        UnaryOp::Exp => x.exp(),
        UnaryOp::Silu => silu(x),
        UnaryOp::Sigmoid => sigmoid(x),
        // ln(1 + e^x) = max(x, 0) + ln(1 + e^-|x|): no overflow for large x, no underflow to 0
        // loss for very negative x.
        UnaryOp::Softplus => x.max(0.0) + (-x.abs()).exp().ln_1p(),
    }
}

/// `out[i] = a[i] (op) b[i mod b.ne]`: `b` broadcasts to `a` (ggml's repeat rule).
fn binary(op: BinaryOp, a: &RefTensor, b: &RefTensor, out: &TensorMeta) -> RefTensor {
    let f = |x: f64, y: f64| match op {
        BinaryOp::Add => x + y,
        BinaryOp::Sub => x - y,
        BinaryOp::Mul => x * y,
        BinaryOp::Div => x / y,
    };
    let mut y = RefTensor::zeros(out.ne);
    for i in RefTensor::indices(out.ne) {
        let ib = [i[0] % b.ne[0], i[1] % b.ne[1], i[2] % b.ne[2], i[3] % b.ne[3]];
        y.set(i, f(a.at(i), b.at(ib)));
    }
    y
}

/// Separate inputs: `silu(gate) * up`, same shapes.
fn swiglu_split(gate: &RefTensor, up: &RefTensor, out: &TensorMeta) -> RefTensor {
    RefTensor::new(out.ne, gate.data.iter().zip(&up.data).map(|(&g, &u)| silu(g) * u).collect())
}

/// One input `x [2n, ...]`: in each row, `x[0..n]` is the gate and `x[n..2n]` the up projection;
/// the output is `[n, ...]`.
fn swiglu_fused(x: &RefTensor, out: &TensorMeta) -> RefTensor {
    let n = out.ne[0];
    let mut y = RefTensor::zeros(out.ne);
    for i in RefTensor::indices(out.ne) {
        let [i0, i1, i2, i3] = i;
        let gate = x.at([i0, i1, i2, i3]);
        let up = x.at([n + i0, i1, i2, i3]);
        y.set(i, silu(gate) * up);
    }
    y
}

#[cfg(test)]
mod tests {
    use crate::reference::testutil::{assert_close, run};
    use crate::{BinaryOp, Op, ScaleParams, UnaryOp};

    fn unary(u: UnaryOp, xs: &[f64]) -> Vec<f64> {
        run(&Op::Unary(u), &[([xs.len(), 1, 1, 1], xs.to_vec())]).data
    }

    #[test]
    fn neg_and_exp() {
        assert_eq!(unary(UnaryOp::Neg, &[1., -2., 0.]), vec![-1., 2., -0.]);
        assert_close(&unary(UnaryOp::Exp, &[0., 1., -1.]), &[1., std::f64::consts::E, 1. / std::f64::consts::E]);
    }

    #[test]
    fn sigmoid_values_and_extremes() {
        let y = unary(UnaryOp::Sigmoid, &[0., 2., -2., 1000., -1000.]);
        let s2 = 1. / (1. + (-2f64).exp());
        assert_close(&y, &[0.5, s2, 1. - s2, 1., 0.]);
        assert!(y.iter().all(|v| v.is_finite()));
    }

    #[test]
    fn silu_values_and_extremes() {
        let y = unary(UnaryOp::Silu, &[0., 1., -1., 1000., -1000.]);
        let s1 = 1. / (1. + (-1f64).exp());
        assert_close(&y, &[0., s1, -(1. - s1), 1000., 0.]);
    }

    #[test]
    fn softplus_is_stable() {
        let y = unary(UnaryOp::Softplus, &[0., 1., -1., 1000., -100., -1000.]);
        assert_close(&y[..3], &[2f64.ln(), (1. + 1f64.exp()).ln(), (1. + (-1f64).exp()).ln()]);
        assert_eq!(y[3], 1000., "softplus(x) = x for large x, not inf");
        let tiny = (-100f64).exp(); // ln(1 + e^-100) ~ e^-100: must not round to 0 via ln(1 + tiny)
        assert!((y[4] - tiny).abs() <= 1e-12 * tiny, "softplus(-100) = {}, want {tiny}", y[4]);
        assert_eq!(y[5], 0., "e^-1000 underflows f64");
    }

    #[test]
    fn binary_same_shape() {
        let a = ([2, 2, 1, 1], vec![1., 2., 3., 4.]);
        let b = ([2, 2, 1, 1], vec![4., 3., 2., 1.]);
        assert_eq!(run(&Op::Binary(BinaryOp::Add), &[a.clone(), b.clone()]).data, vec![5., 5., 5., 5.]);
        assert_eq!(run(&Op::Binary(BinaryOp::Sub), &[a.clone(), b.clone()]).data, vec![-3., -1., 1., 3.]);
        assert_eq!(run(&Op::Binary(BinaryOp::Mul), &[a.clone(), b.clone()]).data, vec![4., 6., 6., 4.]);
        assert_eq!(run(&Op::Binary(BinaryOp::Div), &[a, b]).data, vec![0.25, 2. / 3., 1.5, 4.]);
    }

    #[test]
    fn binary_broadcasts_a_row_and_a_column() {
        let a = ([3, 2, 1, 1], vec![1., 2., 3., 4., 5., 6.]);
        // a row [3, 1] is added to every row
        let y = run(&Op::Binary(BinaryOp::Add), &[a.clone(), ([3, 1, 1, 1], vec![10., 20., 30.])]);
        assert_eq!(y.data, vec![11., 22., 33., 14., 25., 36.]);
        // a column [1, 2] multiplies each row by its own factor
        let y = run(&Op::Binary(BinaryOp::Mul), &[a, ([1, 2, 1, 1], vec![2., -1.])]);
        assert_eq!(y.data, vec![2., 4., 6., -4., -5., -6.]);
    }

    #[test]
    fn binary_broadcasts_by_tiling_not_stretching() {
        // b.ne[0] = 2 divides a.ne[0] = 4: b is tiled (i mod 2), as ggml's repeat does
        let y = run(&Op::Binary(BinaryOp::Sub), &[([4, 1, 1, 2], vec![0.; 8]), ([2, 1, 1, 1], vec![1., 2.])]);
        assert_eq!(y.data, vec![-1., -2., -1., -2., -1., -2., -1., -2.]);
    }

    #[test]
    fn scale_multiplies_then_adds_bias() {
        let y = run(&Op::Scale(ScaleParams { scale: 2.0, bias: -1.0 }), &[([3, 1, 1, 1], vec![0., 1., -2.5])]);
        assert_eq!(y.data, vec![-1., 1., -6.]);
    }

    #[test]
    fn swiglu_with_two_inputs() {
        let y = run(&Op::Swiglu, &[([2, 1, 1, 1], vec![0., 1.]), ([2, 1, 1, 1], vec![5., 3.])]);
        let silu1 = 1. / (1. + (-1f64).exp());
        assert_close(&y.data, &[0., 3. * silu1]);
    }

    #[test]
    fn swiglu_fused_splits_each_row_in_halves() {
        // two rows of [gate0, gate1, up0, up1]
        let x = vec![0., 1., 5., 3., 1., -1., 2., 4.];
        let y = run(&Op::Swiglu, &[([4, 2, 1, 1], x)]);
        assert_eq!(y.ne, [2, 2, 1, 1]);
        let s1 = 1. / (1. + (-1f64).exp());
        assert_close(&y.data, &[0., 3. * s1, 2. * s1, 4. * -(1. - s1)]);
    }
}
