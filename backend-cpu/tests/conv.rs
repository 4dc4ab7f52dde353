//! The conv state contract of `ssm_conv_update_inplace`, on the CPU backend and on the f64
//! reference:
//!
//! 1. decoding one token at a time, the state persisting in the session across runs, gives what
//!    `ssm_conv` over the whole sequence (zero initial state) then SiLU gives;
//! 2. one step equals the composed graph `concat(state[slot], x^T) -> ssm_conv -> silu` plus the
//!    copy of the window's last `d_conv - 1` samples back into the slot, for any `n_t`;
//! 3. sequences with shuffled slots touch only their own slots;
//! 4. bad inputs are refused when the graph is built, bad slot values when it runs, and a failed
//!    run leaves the state untouched.

mod common;

use common::{backends, values};

use tessera_graph::{BackendError, ExecError, Graph, GraphError, Session, Tensor};
use tessera_ops::{DType, KernelError, OpError, UnaryOp};

const F32: DType = DType::F32;
const I32: DType = DType::I32;

fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

/// Asserts `got` and `want` agree to a relative error of `tol` (max abs difference over the
/// largest magnitude).
fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want.iter().fold(1e-30f32, |m, v| m.max(v.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol * scale, "{what}: element {i}: got {g}, want {w}");
    }
}

/// Index of `state[j, c, k]` in a contiguous `[keep, channels, n_slots]` state.
fn st(keep: usize, channels: usize, j: usize, c: usize, k: usize) -> usize {
    j + keep * (c + channels * k)
}

#[test]
fn decoding_token_by_token_equals_one_conv_over_the_sequence() {
    let (channels, d_conv, n_steps, n_slots, slot) = (67, 4, 9, 3, 2);
    let keep = d_conv - 1;
    let xs = values(channels * n_steps, 1); // token t: xs[t * channels ..][..channels]
    let kernel = values(d_conv * channels, 2);
    for (name, mut backend) in backends() {
        // One decode step: x [channels, 1, 1], the state kept by the session across runs.
        let mut g = Graph::new();
        let x = g.input("x", F32, [channels, 1, 1, 1]).unwrap();
        let state = g.state("conv_state", F32, [keep, channels, n_slots, 1]).unwrap();
        let k = g.parameter("kernel", F32, [d_conv, channels, 1, 1]).unwrap();
        let slots = g.input("slots", I32, [1, 1, 1, 1]).unwrap();
        let y = g.ssm_conv_update_inplace(x, state, k, slots, true).unwrap();
        g.mark_output(y).unwrap();
        let mut s = Session::new(&g, backend.as_mut()).unwrap();
        s.set_f32(state, &vec![0.0; keep * channels * n_slots]).unwrap();
        s.set_f32(k, &kernel).unwrap();
        s.set_i32(slots, &[slot as i32]).unwrap();
        let mut stepped = Vec::new();
        for t in 0..n_steps {
            s.set_f32(x, &xs[t * channels..(t + 1) * channels]).unwrap();
            s.run().unwrap();
            stepped.extend(s.get_f32(y).unwrap());
        }
        let final_state = s.get_f32(state).unwrap();
        drop(s);

        // The whole sequence at once: sx = zero padding then every token, time innermost.
        let mut g = Graph::new();
        let sx = g.input("sx", F32, [keep + n_steps, channels, 1, 1]).unwrap();
        let k = g.parameter("kernel", F32, [d_conv, channels, 1, 1]).unwrap();
        let conv = g.ssm_conv(sx, k).unwrap();
        let y = g.unary(UnaryOp::Silu, conv).unwrap();
        g.mark_output(y).unwrap();
        let mut sx_vals = vec![0.0; (keep + n_steps) * channels];
        for t in 0..n_steps {
            for c in 0..channels {
                sx_vals[keep + t + (keep + n_steps) * c] = xs[t * channels + c];
            }
        }
        let mut s = Session::new(&g, backend.as_mut()).unwrap();
        s.set_f32(sx, &sx_vals).unwrap();
        s.set_f32(k, &kernel).unwrap();
        s.run().unwrap();
        let whole = s.get_f32(y).unwrap(); // [channels, n_steps]
        assert_close(&format!("{name}: stepped vs whole"), &stepped, &whole, 1e-6);

        // And against f64 by hand, for the last token.
        let t = n_steps - 1;
        for c in 0..channels {
            let acc: f64 =
                (0..d_conv).map(|i| f64::from(xs[(t + 1 + i - d_conv) * channels + c] * kernel[i + d_conv * c])).sum();
            let want = silu(acc) as f32;
            assert!((stepped[t * channels + c] - want).abs() < 1e-5, "{name}: channel {c}");
        }
        // The slot holds the last `keep` tokens, oldest first; the other slots stay zero.
        for c in 0..channels {
            for j in 0..keep {
                let want = xs[(n_steps - keep + j) * channels + c];
                assert_eq!(final_state[st(keep, channels, j, c, slot)], want, "{name}: state c={c} j={j}");
            }
        }
        for k in (0..n_slots).filter(|&k| k != slot) {
            let range = st(keep, channels, 0, 0, k)..st(keep, channels, 0, 0, k + 1);
            assert!(final_state[range].iter().all(|&v| v == 0.0), "{name}: slot {k} was touched");
        }
    }
}

/// The composed graph for sequence `s` of `x [channels, n_t, n_seq]` in slot `slot` of `state`:
/// returns `silu(ssm_conv(concat(state[slot], x_s^T)))` after adding the copy of the window's
/// last `keep` samples back into the slot.
fn composed(g: &mut Graph, x: Tensor, state: Tensor, k: Tensor, s: usize, slot: usize) -> Result<Tensor, GraphError> {
    let [channels, n_t, _, _] = x.ne();
    let [keep, _, _, _] = state.ne();
    let snb = state.meta().nb;
    let slot_view = g.view(state, [keep, channels, 1, 1], snb, slot * snb[2])?;
    let xnb = x.meta().nb;
    let x_s = g.view(x, [channels, n_t, 1, 1], xnb, s * xnb[2])?;
    let xt = g.transpose(x_s)?;
    let window = g.concat(slot_view, xt, 0)?; // [keep + n_t, channels, 1]
    let conv = g.ssm_conv(window, k)?;
    let y = g.unary(UnaryOp::Silu, conv)?;
    let wnb = window.meta().nb;
    let tail = g.view(window, [keep, channels, 1, 1], wnb, n_t * wnb[0])?;
    g.cpy(tail, slot_view)?;
    Ok(y)
}

#[test]
fn one_step_equals_the_composed_graph_for_any_token_count() {
    let (channels, d_conv, n_slots) = (45, 4, 4);
    let keep = d_conv - 1;
    let slot_ids = [3usize, 1];
    for n_t in [1, 2, 3, 5, 17] {
        let n_seq = slot_ids.len();
        let x_vals = values(channels * n_t * n_seq, 10 + n_t as u64);
        let state_vals = values(keep * channels * n_slots, 20 + n_t as u64);
        let kernel = values(d_conv * channels, 30);
        for (name, mut backend) in backends() {
            let mut g = Graph::new();
            let x = g.input("x", F32, [channels, n_t, n_seq, 1]).unwrap();
            let fused_state = g.state("fused_state", F32, [keep, channels, n_slots, 1]).unwrap();
            let plain_state = g.state("plain_state", F32, [keep, channels, n_slots, 1]).unwrap();
            let k = g.parameter("kernel", F32, [d_conv, channels, 1, 1]).unwrap();
            let slots = g.input("slots", I32, [n_seq, 1, 1, 1]).unwrap();
            let fused = g.ssm_conv_update_inplace(x, fused_state, k, slots, true).unwrap();
            g.mark_output(fused).unwrap();
            let mut plain = Vec::new();
            for (s, &slot) in slot_ids.iter().enumerate() {
                let y = composed(&mut g, x, plain_state, k, s, slot).unwrap();
                g.mark_output(y).unwrap();
                plain.push(y);
            }
            let mut sess = Session::new(&g, backend.as_mut()).unwrap();
            sess.set_f32(x, &x_vals).unwrap();
            sess.set_f32(fused_state, &state_vals).unwrap();
            sess.set_f32(plain_state, &state_vals).unwrap();
            sess.set_f32(k, &kernel).unwrap();
            sess.set_i32(slots, &slot_ids.map(|v| v as i32)).unwrap();
            sess.run().unwrap();
            let got = sess.get_f32(fused).unwrap();
            let want: Vec<f32> = plain.iter().flat_map(|&y| sess.get_f32(y).unwrap()).collect();
            assert_close(&format!("{name}: n_t={n_t}: output"), &got, &want, 1e-6);
            let fused_after = sess.get_f32(fused_state).unwrap();
            let plain_after = sess.get_f32(plain_state).unwrap();
            assert_eq!(fused_after, plain_after, "{name}: n_t={n_t}: state");
            assert_ne!(fused_after, state_vals, "{name}: n_t={n_t}: the state was not updated");
        }
    }
}

#[test]
fn sequences_touch_only_their_own_slots() {
    let (channels, d_conv, n_slots, n_t) = (1000, 4, 8, 2);
    let keep = d_conv - 1;
    let slot_ids = [5usize, 0, 6];
    let n_seq = slot_ids.len();
    let x_vals = values(channels * n_t * n_seq, 40);
    let state_vals = values(keep * channels * n_slots, 41);
    let kernel = values(d_conv * channels, 42);
    for (name, mut backend) in backends() {
        let mut g = Graph::new();
        let x = g.input("x", F32, [channels, n_t, n_seq, 1]).unwrap();
        let state = g.state("state", F32, [keep, channels, n_slots, 1]).unwrap();
        let k = g.parameter("kernel", F32, [d_conv, channels, 1, 1]).unwrap();
        let slots = g.input("slots", I32, [n_seq, 1, 1, 1]).unwrap();
        let y = g.ssm_conv_update_inplace(x, state, k, slots, false).unwrap();
        g.mark_output(y).unwrap();
        let mut sess = Session::new(&g, backend.as_mut()).unwrap();
        sess.set_f32(x, &x_vals).unwrap();
        sess.set_f32(state, &state_vals).unwrap();
        sess.set_f32(k, &kernel).unwrap();
        sess.set_i32(slots, &slot_ids.map(|v| v as i32)).unwrap();
        sess.run().unwrap();
        let after = sess.get_f32(state).unwrap();
        for slot in 0..n_slots {
            for c in 0..channels {
                for j in 0..keep {
                    let i = st(keep, channels, j, c, slot);
                    let want = match slot_ids.iter().position(|&k| k == slot) {
                        // window sample n_t + j: old sample n_t + j while below keep, else a token
                        Some(_) if n_t + j < keep => state_vals[st(keep, channels, n_t + j, c, slot)],
                        Some(s) => x_vals[c + channels * (n_t + j - keep + n_t * s)],
                        None => state_vals[i],
                    };
                    assert_eq!(after[i].to_bits(), want.to_bits(), "{name}: slot {slot} c={c} j={j}");
                }
            }
        }
    }
}

/// Builds one update on fresh leaves of these descriptors.
fn build_update(
    x: [usize; 4],
    state: [usize; 4],
    kernel: [usize; 4],
    slots: (DType, [usize; 4]),
) -> Result<Tensor, GraphError> {
    let mut g = Graph::new();
    let x = g.input("x", F32, x)?;
    let state = g.state("state", F32, state)?;
    let k = g.parameter("kernel", F32, kernel)?;
    let slots = g.input("slots", slots.0, slots.1)?;
    g.ssm_conv_update_inplace(x, state, k, slots, true)
}

fn op_error(r: Result<Tensor, GraphError>) -> OpError {
    match r {
        Err(GraphError::Op(e)) => e,
        other => panic!("expected a shape error, got {other:?}"),
    }
}

#[test]
fn bad_descriptors_are_refused_when_building() {
    let ok = build_update([64, 1, 2, 1], [3, 64, 4, 1], [4, 64, 1, 1], (I32, [2, 1, 1, 1]));
    assert!(ok.is_ok());
    let e = op_error(build_update([64, 1, 2, 1], [3, 64, 4, 1], [4, 64, 1, 1], (F32, [2, 1, 1, 1])));
    assert!(matches!(e, OpError::DType { input: 3, .. }), "{e}");
    let e = op_error(build_update([64, 1, 2, 1], [3, 64, 4, 1], [4, 64, 1, 1], (I32, [1, 1, 1, 1])));
    assert!(e.to_string().contains("slots must be [n_seq]"), "{e}");
    let e = op_error(build_update([64, 1, 2, 1], [3, 64, 4, 1], [4, 64, 1, 1], (I32, [2, 2, 1, 1])));
    assert!(e.to_string().contains("slots must be [n_seq]"), "{e}");
    let e = op_error(build_update([64, 1, 2, 1], [3, 63, 4, 1], [4, 64, 1, 1], (I32, [2, 1, 1, 1])));
    assert!(e.to_string().contains("state has 63 channels"), "{e}");
    let e = op_error(build_update([64, 1, 2, 1], [3, 64, 4, 1], [4, 32, 1, 1], (I32, [2, 1, 1, 1])));
    assert!(e.to_string().contains("kernel has 32 channels"), "{e}");
    let e = op_error(build_update([64, 1, 2, 1], [3, 64, 4, 1], [5, 64, 1, 1], (I32, [2, 1, 1, 1])));
    assert!(e.to_string().contains("d_conv - 1"), "{e}");

    // A state that is a window of half the channels of a larger state is not contiguous.
    let mut g = Graph::new();
    let x = g.input("x", F32, [32, 1, 2, 1]).unwrap();
    let big = g.state("state", F32, [3, 64, 4, 1]).unwrap();
    let half = g.view(big, [3, 32, 4, 1], big.meta().nb, 0).unwrap();
    let k = g.parameter("kernel", F32, [4, 32, 1, 1]).unwrap();
    let slots = g.input("slots", I32, [2, 1, 1, 1]).unwrap();
    let e = op_error(g.ssm_conv_update_inplace(x, half, k, slots, true));
    assert!(matches!(e, OpError::NotContiguous { input: 1, .. }), "{e}");
    // A transposed state is not contiguous either.
    let st = g.state("st", F32, [32, 3, 4, 1]).unwrap();
    let t = g.transpose(st).unwrap();
    let e = op_error(g.ssm_conv_update_inplace(x, t, k, slots, true));
    assert!(matches!(e, OpError::NotContiguous { input: 1, .. }), "{e}");
}

#[test]
fn bad_slot_values_fail_at_run_time_and_leave_the_state_untouched() {
    let (channels, keep, n_slots) = (300, 3, 4);
    let state_vals = values(keep * channels * n_slots, 50);
    for (bad, want_range) in [([1, 4], true), ([-1, 0], true), ([2, 2], false), ([0, 3], true)] {
        let ok = bad == [0, 3];
        for (name, mut backend) in backends() {
            let mut g = Graph::new();
            let x = g.input("x", F32, [channels, 2, 2, 1]).unwrap();
            let state = g.state("state", F32, [keep, channels, n_slots, 1]).unwrap();
            let k = g.parameter("kernel", F32, [keep + 1, channels, 1, 1]).unwrap();
            let slots = g.input("slots", I32, [2, 1, 1, 1]).unwrap();
            let y = g.ssm_conv_update_inplace(x, state, k, slots, true).unwrap();
            g.mark_output(y).unwrap();
            let mut sess = Session::new(&g, backend.as_mut()).unwrap();
            sess.set_f32(x, &values(channels * 4, 51)).unwrap();
            sess.set_f32(state, &state_vals).unwrap();
            sess.set_f32(k, &values((keep + 1) * channels, 52)).unwrap();
            sess.set_i32(slots, &bad).unwrap();
            let r = sess.run();
            let after = sess.get_f32(state).unwrap();
            if ok {
                assert!(r.is_ok(), "{name}: {r:?}");
                assert_ne!(after, state_vals, "{name}: valid slots must update the state");
                continue;
            }
            match r {
                Err(ExecError::Backend(BackendError::Kernel(KernelError::IndexOutOfRange {
                    index, limit, ..
                }))) => {
                    assert!(want_range, "{name}: {bad:?}");
                    assert!(index < 0 || index >= limit as i64, "{name}: {bad:?}");
                    assert_eq!(limit, n_slots);
                }
                Err(ExecError::Backend(BackendError::Kernel(e))) => {
                    assert!(!want_range, "{name}: {bad:?}: {e}");
                    assert!(e.to_string().contains("state slot 2 is named by both sequence"), "{name}: {e}");
                }
                other => panic!("{name}: {bad:?}: unexpected {other:?}"),
            }
            assert_eq!(after, state_vals, "{name}: {bad:?}: a failed run changed the state");
        }
    }
}
