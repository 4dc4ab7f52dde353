//! rope_multi semantics on the CPU backend (and the f64 reference backend where stated):
//!
//! - text-only imrope (streams t = h = w = the token position, e = 0, llama.cpp's text input) is
//!   exactly plain one-stream NEOX rope;
//! - the NEOX pairing matches a hand-written HF `apply_rotary_pos_emb` (rotate_half with
//!   `cos`/`sin` of `cat(freqs, freqs)` over the first `rotary_dim` dims) at Qwen3.6's head dim 256,
//!   rotary dim 64, base 1e7;
//! - ADJACENT pairing differs from NEOX and matches its own formula;
//! - the interleaved section map of `[11, 11, 10, 0]` (and the `e` stream of sections that do not
//!   cover every pair), recovered from the output angles;
//! - bad position lengths and bad `n_rot` are build errors.

mod common;

use common::values;

use tessera_cpu::{CpuBackend, ReferenceBackend};
use tessera_graph::{Backend, Graph, GraphError, Session, Tensor};
use tessera_ops::{DType, OpError, RopePairing, RopeParams};

const F32: DType = DType::F32;
const I32: DType = DType::I32;

/// Builds `rope_multi(x, positions)` for contiguous `x` and returns the output on `backend`.
fn rope(backend: &mut dyn Backend, x_ne: [usize; 4], x: &[f32], pos: &[i32], p: RopeParams) -> Vec<f32> {
    let mut g = Graph::new();
    let xt = g.input("x", F32, x_ne).unwrap();
    let pt = g.input("pos", I32, [pos.len(), 1, 1, 1]).unwrap();
    let y = g.rope_multi(xt, pt, p).unwrap();
    run(&mut g, backend, y, &[(xt, x), (pt, &[])], pos)
}

/// Marks `y` as output, sets `f32` leaves (and the i32 leaf, whose f32 slice is empty, to
/// `pos`), runs and reads `y`.
fn run(g: &mut Graph, backend: &mut dyn Backend, y: Tensor, leaves: &[(Tensor, &[f32])], pos: &[i32]) -> Vec<f32> {
    g.mark_output(y).unwrap();
    let mut s = Session::new(g, backend).unwrap();
    for &(t, v) in leaves {
        if t.dtype() == I32 {
            s.set_i32(t, pos).unwrap();
        } else {
            s.set_f32(t, v).unwrap();
        }
    }
    s.run().unwrap();
    s.get_f32(y).unwrap()
}

fn params(n_rot: usize, freq_base: f32, pairing: RopePairing, sections: Option<[usize; 4]>) -> RopeParams {
    RopeParams { n_rot, freq_base, pairing, sections }
}

fn max_abs_diff(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(&x, &y)| (f64::from(x) - y).abs()).fold(0.0, f64::max)
}

const QWEN_SECTIONS: [usize; 4] = [11, 11, 10, 0];

#[test]
fn text_imrope_equals_plain_neox_exactly() {
    let ne = [256, 4, 5, 1];
    let x = values(ne.iter().product(), 1);
    let tokens: Vec<i32> = vec![0, 1, 7, 4095, 131_071];
    // llama.cpp's text positions: (p, p, p, 0), stream-major.
    let mut streams = tokens.clone();
    streams.extend(&tokens);
    streams.extend(&tokens);
    streams.extend([0; 5]);
    let plain = params(64, 1e7, RopePairing::Neox, None);
    let multi = params(64, 1e7, RopePairing::Neox, Some(QWEN_SECTIONS));
    let a = rope(&mut CpuBackend::new(), ne, &x, &tokens, plain);
    let b = rope(&mut CpuBackend::new(), ne, &x, &streams, multi);
    assert!(a.iter().zip(&b).all(|(u, v)| u.to_bits() == v.to_bits()), "cpu: imrope text != neox");
    let a = rope(&mut ReferenceBackend::new(), ne, &x, &tokens, plain);
    let b = rope(&mut ReferenceBackend::new(), ne, &x, &streams, multi);
    assert!(a.iter().zip(&b).all(|(u, v)| u.to_bits() == v.to_bits()), "reference: imrope text != neox");
    // Dims from 64 on pass through bit for bit.
    for (row, (got, want)) in a.chunks(256).zip(x.chunks(256)).enumerate() {
        assert_eq!(got[64..], want[64..], "row {row}: pass-through dims changed");
    }
}

/// transformers' Qwen3.5 rope, written out: `inv_freq = 1 / base^(arange(0, d, 2) / d)`,
/// `emb = cat(freqs, freqs)`, `q_rot = q[..., :d] * cos(emb) + rotate_half(q[..., :d]) * sin(emb)`
/// with `rotate_half(x) = cat(-x[d/2:], x[:d/2])`, and `q[..., d:]` passed through. One head at a
/// time: `q` is `[head_dim]` at `position`.
fn hf_apply_rotary(q: &[f32], position: f64, rotary_dim: usize, base: f64) -> Vec<f64> {
    let half = rotary_dim / 2;
    let inv_freq: Vec<f64> =
        (0..rotary_dim).step_by(2).map(|i| 1.0 / base.powf(i as f64 / rotary_dim as f64)).collect();
    let emb: Vec<f64> = inv_freq.iter().chain(&inv_freq).map(|f| position * f).collect();
    let q: Vec<f64> = q.iter().map(|&v| f64::from(v)).collect();
    let rot = &q[..rotary_dim];
    let rotate_half: Vec<f64> = rot[half..].iter().map(|v| -v).chain(rot[..half].iter().copied()).collect();
    let mut out: Vec<f64> = (0..rotary_dim).map(|i| rot[i] * emb[i].cos() + rotate_half[i] * emb[i].sin()).collect();
    out.extend_from_slice(&q[rotary_dim..]);
    out
}

#[test]
fn neox_matches_the_hf_reference_at_qwen_sizes() {
    let (head_dim, n_head, n_tokens) = (256, 16, 4);
    let ne = [head_dim, n_head, n_tokens, 1];
    let x = values(ne.iter().product(), 2);
    let tokens = [0, 3, 1000, 40_000];
    let mut want = Vec::new();
    for (t, &position) in tokens.iter().enumerate() {
        for h in 0..n_head {
            let at = (t * n_head + h) * head_dim;
            want.extend(hf_apply_rotary(&x[at..at + head_dim], f64::from(position), 64, 1e7));
        }
    }
    let p = params(64, 1e7, RopePairing::Neox, None);
    let cpu = rope(&mut CpuBackend::new(), ne, &x, &tokens, p);
    assert!(max_abs_diff(&cpu, &want) < 2e-6, "cpu vs HF: {}", max_abs_diff(&cpu, &want));
    let reference = rope(&mut ReferenceBackend::new(), ne, &x, &tokens, p);
    assert!(max_abs_diff(&reference, &want) < 1e-7, "reference vs HF: {}", max_abs_diff(&reference, &want));
    // The same through imrope with text positions.
    let mut streams: Vec<i32> = tokens.repeat(3);
    streams.extend([0; 4]);
    let multi = rope(&mut CpuBackend::new(), ne, &x, &streams, params(64, 1e7, RopePairing::Neox, Some(QWEN_SECTIONS)));
    assert!(max_abs_diff(&multi, &want) < 2e-6);
}

#[test]
fn adjacent_pairing_differs_and_matches_its_formula() {
    let ne = [128, 2, 3, 1];
    let x = values(ne.iter().product(), 3);
    let tokens = [5, 17, 250];
    let (n_rot, base) = (32usize, 10_000f64);
    let adjacent =
        rope(&mut CpuBackend::new(), ne, &x, &tokens, params(n_rot, base as f32, RopePairing::Adjacent, None));
    let neox = rope(&mut CpuBackend::new(), ne, &x, &tokens, params(n_rot, base as f32, RopePairing::Neox, None));
    let mut want = Vec::new();
    for (row, xs) in x.chunks(128).enumerate() {
        let position = f64::from(tokens[row / 2]);
        let mut y: Vec<f64> = xs.iter().map(|&v| f64::from(v)).collect();
        for p in 0..n_rot / 2 {
            let theta = position * base.powf(-2.0 * p as f64 / n_rot as f64);
            let (a, b) = (y[2 * p], y[2 * p + 1]);
            y[2 * p] = a * theta.cos() - b * theta.sin();
            y[2 * p + 1] = a * theta.sin() + b * theta.cos();
        }
        want.extend(y);
    }
    assert!(max_abs_diff(&adjacent, &want) < 2e-6, "adjacent vs formula: {}", max_abs_diff(&adjacent, &want));
    let neox64: Vec<f64> = neox.iter().map(|&v| f64::from(v)).collect();
    assert!(max_abs_diff(&adjacent, &neox64) > 0.1, "adjacent and neox pairings must differ");
}

/// The position each pair of a one-token, one-head rope used, recovered from the output: with
/// `x[a] = 1, x[b] = 0` the pair comes out as `(cos theta, sin theta)`, and `theta / inv_freq`
/// is the position (kept below pi by small positions).
fn positions_used(n_rot: usize, sections: [usize; 4], streams: [i32; 4]) -> Vec<i32> {
    let half = n_rot / 2;
    let mut x = vec![0f32; n_rot];
    x[..half].fill(1.0);
    let p = params(n_rot, 10.0, RopePairing::Neox, Some(sections));
    let y = rope(&mut CpuBackend::new(), [n_rot, 1, 1, 1], &x, &streams, p);
    (0..half)
        .map(|i| {
            let theta = f64::from(y[i + half]).atan2(f64::from(y[i]));
            let inv_freq = 10f64.powf(-2.0 * i as f64 / n_rot as f64);
            (theta / inv_freq).round() as i32
        })
        .collect()
}

#[test]
fn interleaved_sections_assign_streams_by_pair_mod_3() {
    // t = 1, h = 2, w = 3 (e = 0 is never used): pair p uses t, h, w for p % 3 = 0, 1, 2.
    let (t, h, w) = (1, 2, 3);
    let used = positions_used(64, QWEN_SECTIONS, [t, h, w, 0]);
    for (p, &pos) in used.iter().enumerate() {
        let want = [t, h, w][p % 3];
        assert_eq!(pos, want, "pair {p} took position {pos}, expected stream {}", ["t", "h", "w"][p % 3]);
    }
    // Sections [2, 2, 2, 2] (sum 8): s = p mod 8 gives t h w t h w e e, then repeats.
    let used = positions_used(32, [2, 2, 2, 2], [1, 2, 3, 0]);
    assert_eq!(used, [1, 2, 3, 1, 2, 3, 0, 0, 1, 2, 3, 1, 2, 3, 0, 0]);
    let used = positions_used(16, [2, 2, 2, 2], [0, 0, 0, 2]);
    assert_eq!(used, [0, 0, 0, 0, 0, 0, 2, 2]);
}

#[test]
fn strided_q_view_matches_the_contiguous_copy() {
    // q and gate interleaved per head as in Qwen's joint projection: [q_h0, g_h0, q_h1, g_h1, ...].
    let (hd, n_head, n_tokens) = (256, 4, 3);
    let joint = values(2 * hd * n_head * n_tokens, 4);
    let pos = [2, 9, 33];
    let p = params(64, 1e7, RopePairing::Neox, None);
    let mut g = Graph::new();
    let qg = g.input("qg", F32, [2 * hd * n_head, n_tokens, 1, 1]).unwrap();
    let nb = qg.meta().nb;
    let q = g.view(qg, [hd, n_head, n_tokens, 1], [4, 2 * hd * 4, nb[1], nb[2]], 0).unwrap();
    let pt = g.input("pos", I32, [n_tokens, 1, 1, 1]).unwrap();
    let y = g.rope_multi(q, pt, p).unwrap();
    let strided = run(&mut g, &mut CpuBackend::new(), y, &[(qg, &joint), (pt, &[])], &pos);
    let q_only: Vec<f32> = joint.chunks(hd).step_by(2).flatten().copied().collect();
    let dense = rope(&mut CpuBackend::new(), [hd, n_head, n_tokens, 1], &q_only, &pos, p);
    assert!(strided.iter().zip(&dense).all(|(a, b)| a.to_bits() == b.to_bits()));
}

#[test]
fn bad_positions_and_params_are_build_errors() {
    let mut g = Graph::new();
    let x = g.input("x", F32, [128, 2, 3, 1]).unwrap();
    let p3 = g.input("p3", I32, [3, 1, 1, 1]).unwrap();
    let p4 = g.input("p4", I32, [4, 1, 1, 1]).unwrap();
    let p12 = g.input("p12", I32, [12, 1, 1, 1]).unwrap();
    let neox = |n_rot, sections| params(n_rot, 1e7, RopePairing::Neox, sections);
    let is_op_err = |r: Result<Tensor, GraphError>, what: &str| match r {
        Err(GraphError::Op(e)) => e,
        other => panic!("{what}: expected an op error, got {other:?}"),
    };
    let e = is_op_err(g.rope_multi(x, p4, neox(64, None)), "4 positions for 3 tokens");
    assert!(matches!(e, OpError::ShapeMismatch { op: "rope_multi", .. }), "{e}");
    let e = is_op_err(g.rope_multi(x, p3, neox(64, Some(QWEN_SECTIONS))), "sections need 4 streams");
    assert!(matches!(e, OpError::ShapeMismatch { .. }), "{e}");
    assert!(e.to_string().contains("4 * n_tokens"), "{e}");
    let e = is_op_err(g.rope_multi(x, p3, neox(63, None)), "odd n_rot");
    assert!(matches!(e, OpError::InvalidParam { .. }), "{e}");
    let e = is_op_err(g.rope_multi(x, p3, neox(130, None)), "n_rot above head_dim");
    assert!(matches!(e, OpError::InvalidParam { .. }), "{e}");
    let e = is_op_err(g.rope_multi(x, p12, neox(64, Some([0; 4]))), "zero sections");
    assert!(matches!(e, OpError::InvalidParam { .. }), "{e}");
    assert!(g.rope_multi(x, p12, neox(64, Some(QWEN_SECTIONS))).is_ok());
}
