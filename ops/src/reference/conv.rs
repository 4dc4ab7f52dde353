//! ssm_conv and ssm_conv_update_inplace in f64: the causal depthwise convolution, with no flip
//! (`kernel[0]` multiplies the oldest sample of the window), as ggml's `ggml_ssm_conv`.

use super::RefTensor;
use super::delta_net::{SeqSpan, sequences};
use crate::{KernelError, Op, TensorMeta};

/// `ssm_conv [sx, kernel]`: `out[c, t, s] = sum_{i < d_conv} sx[t + i, c, s] * kernel[i, c]`.
pub(super) fn compute(op: &Op, inputs: &[RefTensor], out: &TensorMeta) -> Result<RefTensor, KernelError> {
    let [sx, kernel] = inputs else {
        return Err(KernelError::Unsupported {
            op: op.name(),
            why: format!("expected 2 inputs, got {}", inputs.len()),
        });
    };
    let d_conv = kernel.ne[0];
    let [channels, n_t, n_seq, _] = out.ne;
    let mut y = RefTensor::zeros(out.ne);
    for s in 0..n_seq {
        for t in 0..n_t {
            for c in 0..channels {
                let acc: f64 = (0..d_conv).map(|i| sx.at([t + i, c, s, 0]) * kernel.at([i, c, 0, 0])).sum();
                y.set([c, t, s, 0], acc);
            }
        }
    }
    Ok(y)
}

/// `ssm_conv_update_inplace [x, state, kernel, slots]` (+ `seq_offsets` when `ragged`): per
/// sequence `s` with slot `k = slots[s]`, the window `w = concat(state[:, :, k], x_s^T)` (`x_s`
/// the sequence's tokens: `x[:, :, s]` dense, `x[:, offsets[s] .. offsets[s + 1], 0]` ragged;
/// `d_conv - 1 + L` samples per channel, oldest first) gives its outputs
/// `sum_i w[t + i, c] * kernel[i, c]` (then SiLU if `silu`), and the new `state[:, :, k]` is the
/// last `d_conv - 1` samples of `w`. Ragged tokens of no sequence output 0, and a sequence
/// without tokens touches nothing. Returns the output and the whole new state. Offsets and slots
/// are checked before anything is computed.
pub(super) fn update(
    silu: bool,
    ragged: bool,
    inputs: &[RefTensor],
    out: &TensorMeta,
) -> Result<(RefTensor, RefTensor), KernelError> {
    const OP: &str = "ssm_conv_update_inplace";
    let n_in = if ragged { 5 } else { 4 };
    let (Some([x, state, kernel, slots]), true) = (inputs.first_chunk(), inputs.len() == n_in) else {
        return Err(KernelError::Unsupported { op: OP, why: format!("expected {n_in} inputs, got {}", inputs.len()) });
    };
    let d_conv = kernel.ne[0];
    let keep = d_conv - 1;
    let [channels, n_t, n_seq, _] = out.ne;
    let seqs = sequences(OP, inputs.get(4), slots, n_t, n_seq, state.ne[2])?;
    let mut y = RefTensor::zeros(out.ne);
    let mut new_state = state.clone();
    for SeqSpan { slot: k, outer: s, tokens } in seqs {
        let len = tokens.len();
        let mut w = vec![0.0; keep + len];
        for c in 0..channels {
            for (j, wj) in w.iter_mut().enumerate() {
                *wj = if j < keep { state.at([j, c, k, 0]) } else { x.at([c, tokens.start + j - keep, s, 0]) };
            }
            for t in 0..len {
                let acc: f64 = (0..d_conv).map(|i| w[t + i] * kernel.at([i, c, 0, 0])).sum();
                y.set([c, tokens.start + t, s, 0], if silu { acc / (1.0 + (-acc).exp()) } else { acc });
            }
            for j in 0..keep {
                new_state.set([j, c, k, 0], w[len + j]);
            }
        }
    }
    Ok((y, new_state))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(ne: [usize; 4]) -> TensorMeta {
        TensorMeta::contiguous("out", crate::DType::F32, ne).unwrap()
    }

    fn silu(x: f64) -> f64 {
        x / (1.0 + (-x).exp())
    }

    #[test]
    fn ssm_conv_is_a_causal_correlation_without_flip() {
        // 1 channel, d_conv 3: sx = [1, 2, 3, 4] (2 outputs), kernel = [1, 10, 100].
        let sx = RefTensor::new([4, 1, 1, 1], vec![1., 2., 3., 4.]);
        let k = RefTensor::new([3, 1, 1, 1], vec![1., 10., 100.]);
        let y = compute(&Op::SsmConv, &[sx, k], &meta([1, 2, 1, 1])).unwrap();
        assert_eq!(y.data, [1. + 20. + 300., 2. + 30. + 400.]);
    }

    #[test]
    fn ssm_conv_channels_and_sequences_are_independent() {
        // 2 channels, 2 sequences, d_conv 2, 1 output each: out[c, 0, s] = sx[0,c,s] k[0,c] + sx[1,c,s] k[1,c].
        let sx = RefTensor::new([2, 2, 2, 1], vec![1., 2., 3., 4., 5., 6., 7., 8.]);
        let k = RefTensor::new([2, 2, 1, 1], vec![1., -1., 2., 0.5]);
        let y = compute(&Op::SsmConv, &[sx, k], &meta([2, 1, 2, 1])).unwrap();
        assert_eq!(y.data, [1. - 2., 6. + 2., 5. - 6., 14. + 4.]);
    }

    #[test]
    fn update_convolves_through_the_state_and_keeps_the_last_samples() {
        // 1 channel, d_conv 3 (state keeps 2), 2 slots; one sequence in slot 1, n_t = 1.
        let x = RefTensor::new([1, 1, 1, 1], vec![5.]);
        let state = RefTensor::new([2, 1, 2, 1], vec![9., 9., 1., 2.]);
        let k = RefTensor::new([3, 1, 1, 1], vec![1., 10., 100.]);
        let slots = RefTensor::new([1, 1, 1, 1], vec![1.]);
        let (y, st) =
            update(false, false, &[x.clone(), state.clone(), k.clone(), slots.clone()], &meta([1, 1, 1, 1])).unwrap();
        assert_eq!(y.data, [1. + 20. + 500.]);
        assert_eq!(st.data, [9., 9., 2., 5.]);
        let (y, _) = update(true, false, &[x, state, k, slots], &meta([1, 1, 1, 1])).unwrap();
        assert_eq!(y.data, [silu(521.)]);
    }

    #[test]
    fn update_with_more_tokens_than_the_state_keeps_the_last_inputs() {
        // d_conv 2 (state keeps 1), 1 channel, n_t = 3: window [s0, a, b, c].
        let x = RefTensor::new([1, 3, 1, 1], vec![2., 3., 4.]);
        let state = RefTensor::new([1, 1, 1, 1], vec![1.]);
        let k = RefTensor::new([2, 1, 1, 1], vec![1., 10.]);
        let slots = RefTensor::new([1, 1, 1, 1], vec![0.]);
        let (y, st) = update(false, false, &[x, state, k, slots], &meta([1, 3, 1, 1])).unwrap();
        assert_eq!(y.data, [21., 32., 43.]);
        assert_eq!(st.data, [4.]);
    }

    #[test]
    fn update_with_fewer_tokens_than_the_state_shifts_it() {
        // d_conv 4 (state keeps 3), n_t = 1: state [a, b, c] + x -> [b, c, x].
        let x = RefTensor::new([1, 1, 1, 1], vec![7.]);
        let state = RefTensor::new([3, 1, 1, 1], vec![1., 2., 3.]);
        let k = RefTensor::new([4, 1, 1, 1], vec![1., 1., 1., 1.]);
        let slots = RefTensor::new([1, 1, 1, 1], vec![0.]);
        let (y, st) = update(false, false, &[x, state, k, slots], &meta([1, 1, 1, 1])).unwrap();
        assert_eq!(y.data, [13.]);
        assert_eq!(st.data, [2., 3., 7.]);
    }

    #[test]
    fn bad_slots_are_errors() {
        let run = |slots: Vec<f64>| {
            let n = slots.len();
            let x = RefTensor::zeros([1, 1, n, 1]);
            let state = RefTensor::zeros([1, 1, 3, 1]);
            let k = RefTensor::zeros([2, 1, 1, 1]);
            update(false, false, &[x, state, k, RefTensor::new([n, 1, 1, 1], slots)], &meta([1, 1, n, 1]))
        };
        assert!(run(vec![2., 0.]).is_ok());
        assert!(matches!(run(vec![3.]), Err(KernelError::IndexOutOfRange { index: 3, limit: 3, .. })));
        assert!(matches!(run(vec![-1.]), Err(KernelError::IndexOutOfRange { index: -1, .. })));
        let e = run(vec![1., 0., 1.]).unwrap_err();
        assert!(e.to_string().contains("state slot 1 is named by both sequence 0 and sequence 2"), "{e}");
    }
}
