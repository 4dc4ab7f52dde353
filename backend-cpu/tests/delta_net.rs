//! gated_delta_net on the CPU backend, through graphs and sessions: against the f64 reference
//! (both algorithms), chunked against serial in f32, on strided q/k/v views split from one conv
//! output, with misaligned buffers, with the state carried in place from a prefill to decode
//! steps (within one run and across session runs), with several sequences in shuffled slots, the
//! two head maps as one model, and the errors at build and run time.

mod common;

use common::Rng;
use tessera_cpu::{CpuBackend, ReferenceBackend};
use tessera_graph::{Backend, BackendError, ExecError, Graph, GraphError, Session, SessionOptions, Tensor};
use tessera_ops::{DType, DeltaNetAlgo, GatedDeltaNetParams, HeadMap, KernelError, OpError};

const F32: DType = DType::F32;
const SERIAL: DeltaNetAlgo = DeltaNetAlgo::Serial;

#[derive(Debug, Clone, Copy)]
struct Dims {
    s_k: usize,
    s_v: usize,
    h_k: usize,
    h_v: usize,
    n_t: usize,
    n_seq: usize,
    n_slots: usize,
}

impl Dims {
    fn qk(&self) -> [usize; 4] {
        [self.s_k, self.h_k, self.n_t, self.n_seq]
    }
    fn v(&self) -> [usize; 4] {
        [self.s_v, self.h_v, self.n_t, self.n_seq]
    }
    fn heads(&self) -> [usize; 4] {
        [1, self.h_v, self.n_t, self.n_seq]
    }
    fn state(&self) -> [usize; 4] {
        [self.s_k, self.s_v, self.h_v, self.n_slots]
    }
    /// Elements of one (slot) of the state.
    fn slot_len(&self) -> usize {
        self.s_k * self.s_v * self.h_v
    }
}

/// Values of the seven inputs `[q, k, v, g, beta, state, slots]` in logical order.
#[derive(Debug, Clone)]
struct Data(Vec<Vec<f64>>);

/// q and k rows l2-normalised (as the model's callers do), v and the state in [-1, 1), g in
/// [-1.5, 0), beta in (0, 1); sequence `s` uses slot `slots[s]`.
fn data(d: Dims, slots: &[usize], seed: u64) -> Data {
    assert_eq!(slots.len(), d.n_seq);
    let mut rng = Rng(seed);
    let mut normed = |n: usize, row: usize| {
        let mut x: Vec<f64> = (0..n).map(|_| rng.uniform(-1.0, 1.0)).collect();
        for r in x.chunks_mut(row) {
            let norm = r.iter().map(|e| e * e).sum::<f64>().sqrt().max(1e-6);
            r.iter_mut().for_each(|e| *e /= norm);
        }
        x
    };
    let qk: usize = d.qk().iter().product();
    let (q, k) = (normed(qk, d.s_k), normed(qk, d.s_k));
    let mut uniform = |n: usize, lo: f64, hi: f64| (0..n).map(|_| rng.uniform(lo, hi)).collect::<Vec<f64>>();
    let heads: usize = d.heads().iter().product();
    let v = uniform(d.v().iter().product(), -1.0, 1.0);
    let g = uniform(heads, -1.5, 0.0);
    let beta = uniform(heads, 0.0, 1.0);
    let state = uniform(d.state().iter().product(), -1.0, 1.0);
    Data(vec![q, k, v, g, beta, state, slots.iter().map(|&s| s as f64).collect()])
}

fn params(head_map: HeadMap, algo: DeltaNetAlgo, s_k: usize) -> GatedDeltaNetParams {
    GatedDeltaNetParams { scale: 1.0 / (s_k as f32).sqrt(), head_map, algo, ragged: false }
}

/// The seven leaves of a problem (the state a state leaf) and the op on them.
fn graph(d: Dims, p: GatedDeltaNetParams) -> (Graph, Vec<Tensor>, Tensor) {
    let mut g = Graph::new();
    let leaves = vec![
        g.input("q", F32, d.qk()).unwrap(),
        g.input("k", F32, d.qk()).unwrap(),
        g.input("v", F32, d.v()).unwrap(),
        g.input("g", F32, d.heads()).unwrap(),
        g.input("beta", F32, d.heads()).unwrap(),
        g.state("state", F32, d.state()).unwrap(),
        g.input("slots", DType::I32, [d.n_seq, 1, 1, 1]).unwrap(),
    ];
    let l = &leaves;
    let out = g.gated_delta_net(l[0], l[1], l[2], l[3], l[4], l[5], l[6], p).unwrap();
    g.mark_output(out).unwrap();
    (g, leaves, out)
}

/// Runs the op once on `backend` with `guard` bytes around buffers (odd values misalign them);
/// returns the output and the whole state afterwards.
fn run_with(
    backend: &mut dyn Backend,
    d: Dims,
    p: GatedDeltaNetParams,
    x: &Data,
    guard: usize,
) -> (Vec<f64>, Vec<f64>) {
    let (g, leaves, out) = graph(d, p);
    let mut s =
        Session::with_options(&g, backend, SessionOptions { guard_bytes: guard, ..Default::default() }).unwrap();
    for (t, vals) in leaves.iter().zip(&x.0) {
        s.set_f64(*t, vals).unwrap();
    }
    s.run().unwrap();
    (s.get_f64(out).unwrap(), s.get_f64(leaves[5]).unwrap())
}

fn cpu(d: Dims, p: GatedDeltaNetParams, x: &Data) -> (Vec<f64>, Vec<f64>) {
    run_with(&mut CpuBackend::new(), d, p, x, 0)
}

fn reference(d: Dims, p: GatedDeltaNetParams, x: &Data) -> (Vec<f64>, Vec<f64>) {
    run_with(&mut ReferenceBackend::new(), d, p, x, 0)
}

fn nmse(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let err: f64 = got.iter().zip(want).map(|(a, b)| (a - b) * (a - b)).sum();
    let norm: f64 = want.iter().map(|b| b * b).sum();
    if norm == 0.0 { err } else { err / norm }
}

fn dims(s_k: usize, s_v: usize, h_k: usize, h_v: usize, n_t: usize, n_seq: usize, n_slots: usize) -> Dims {
    Dims { s_k, s_v, h_k, h_v, n_t, n_seq, n_slots }
}

/// Slots `n_slots - 1, n_slots - 3, ...` for the sequences (distinct, not in order).
fn spread_slots(d: Dims) -> Vec<usize> {
    (0..d.n_seq).map(|s| (d.n_slots - 1 + 2 * s * (d.n_slots - 1)) % d.n_slots).collect()
}

#[test]
fn cpu_matches_reference_and_chunked_matches_serial() {
    let shapes = [
        dims(1, 1, 1, 1, 1, 1, 1),
        dims(4, 3, 1, 2, 9, 1, 2),
        dims(7, 5, 2, 6, 37, 2, 3),
        dims(16, 16, 3, 3, 70, 1, 1),
        dims(128, 128, 2, 4, 20, 1, 2),
    ];
    for (n, d) in shapes.into_iter().enumerate() {
        let x = data(d, &spread_slots(d), 100 + n as u64);
        for map in [HeadMap::Tiled, HeadMap::Grouped] {
            let (o_ref, st_ref) = reference(d, params(map, SERIAL, d.s_k), &x);
            let (o_ser, st_ser) = cpu(d, params(map, SERIAL, d.s_k), &x);
            assert!(nmse(&o_ser, &o_ref) < 1e-9, "{d:?} {map:?} serial out {:e}", nmse(&o_ser, &o_ref));
            assert!(nmse(&st_ser, &st_ref) < 1e-9, "{d:?} {map:?} serial state {:e}", nmse(&st_ser, &st_ref));
            for chunk in [1, 3, 8, 16, 64] {
                let p = params(map, DeltaNetAlgo::Chunked { chunk }, d.s_k);
                let (o, st) = cpu(d, p, &x);
                let what = format!("{d:?} {map:?} chunk {chunk}");
                assert!(nmse(&o, &o_ser) < 1e-6, "{what}: vs serial out {:e}", nmse(&o, &o_ser));
                assert!(nmse(&st, &st_ser) < 1e-6, "{what}: vs serial state {:e}", nmse(&st, &st_ser));
                assert!(nmse(&o, &o_ref) < 1e-9, "{what}: vs reference out {:e}", nmse(&o, &o_ref));
                assert!(nmse(&st, &st_ref) < 1e-9, "{what}: vs reference state {:e}", nmse(&st, &st_ref));
            }
        }
    }
}

#[test]
fn misaligned_buffers_give_identical_bits() {
    let d = dims(9, 6, 2, 4, 13, 2, 3);
    let x = data(d, &[2, 0], 7);
    for algo in [SERIAL, DeltaNetAlgo::Chunked { chunk: 4 }] {
        let p = params(HeadMap::Tiled, algo, d.s_k);
        let aligned = run_with(&mut CpuBackend::new(), d, p, &x, 0);
        for guard in [1, 3] {
            assert_eq!(run_with(&mut CpuBackend::new(), d, p, &x, guard), aligned, "{algo:?} guard {guard}");
        }
    }
}

/// q, k and v as strided views of one conv output `[2 H_k S_k + H_v S_v, n_t, n_seq]` (llama.cpp's
/// split by channel offset), g and beta as windows of wider tensors.
#[test]
fn strided_views_of_a_conv_output() {
    let d = dims(8, 6, 2, 4, 11, 2, 2);
    let x = data(d, &[1, 0], 11);
    let ch = 2 * d.h_k * d.s_k + d.h_v * d.s_v;
    let run = |backend: &mut dyn Backend, p: GatedDeltaNetParams| {
        let mut g = Graph::new();
        let conv = g.input("conv", F32, [ch, d.n_t, d.n_seq, 1]).unwrap();
        let gb = g.input("gb", F32, [2 * d.h_v + 1, d.n_t, d.n_seq, 1]).unwrap();
        let state = g.state("state", F32, d.state()).unwrap();
        let slots = g.input("slots", DType::I32, [d.n_seq, 1, 1, 1]).unwrap();
        let (row, tok) = (4 * ch, 4 * ch * d.n_t);
        let q = g.view(conv, d.qk(), [4, 4 * d.s_k, row, tok], 0).unwrap();
        let k = g.view(conv, d.qk(), [4, 4 * d.s_k, row, tok], 4 * d.h_k * d.s_k).unwrap();
        let v = g.view(conv, d.v(), [4, 4 * d.s_v, row, tok], 8 * d.h_k * d.s_k).unwrap();
        let gbt = [4, 4, 4 * (2 * d.h_v + 1), 4 * (2 * d.h_v + 1) * d.n_t];
        let gg = g.view(gb, d.heads(), gbt, 4).unwrap();
        let beta = g.view(gb, d.heads(), gbt, 4 * (d.h_v + 1)).unwrap();
        let out = g.gated_delta_net(q, k, v, gg, beta, state, slots, p).unwrap();
        g.mark_output(out).unwrap();
        // Interleave the logical inputs into the packed leaves.
        let mut conv_vals = vec![0.0; ch * d.n_t * d.n_seq];
        let mut gb_vals = vec![0.5; (2 * d.h_v + 1) * d.n_t * d.n_seq];
        for s in 0..d.n_seq {
            for t in 0..d.n_t {
                let (tok, qk_row) = (s * d.n_t + t, d.h_k * d.s_k);
                let at = |i: usize| (s * d.n_t + t) * qk_row + i;
                for i in 0..qk_row {
                    conv_vals[tok * ch + i] = x.0[0][at(i)];
                    conv_vals[tok * ch + qk_row + i] = x.0[1][at(i)];
                }
                let vr = d.h_v * d.s_v;
                for i in 0..vr {
                    conv_vals[tok * ch + 2 * qk_row + i] = x.0[2][tok * vr + i];
                }
                for h in 0..d.h_v {
                    gb_vals[tok * (2 * d.h_v + 1) + 1 + h] = x.0[3][tok * d.h_v + h];
                    gb_vals[tok * (2 * d.h_v + 1) + 1 + d.h_v + h] = x.0[4][tok * d.h_v + h];
                }
            }
        }
        let mut s = Session::new(&g, backend).unwrap();
        s.set_f64(conv, &conv_vals).unwrap();
        s.set_f64(gb, &gb_vals).unwrap();
        s.set_f64(state, &x.0[5]).unwrap();
        s.set_f64(slots, &x.0[6]).unwrap();
        s.run().unwrap();
        (s.get_f64(out).unwrap(), s.get_f64(state).unwrap())
    };
    for algo in [SERIAL, DeltaNetAlgo::Chunked { chunk: 4 }] {
        let p = params(HeadMap::Tiled, algo, d.s_k);
        let want = reference(d, p, &x);
        assert_eq!(run(&mut ReferenceBackend::new(), p), want, "{algo:?}: the views read the same values");
        let got = run(&mut CpuBackend::new(), p);
        assert!(nmse(&got.0, &want.0) < 1e-9 && nmse(&got.1, &want.1) < 1e-9, "{algo:?}");
    }
}

/// Token range `r` of a `[.., .., n_t, n_seq]` input given in logical order.
fn tokens(vals: &[f64], ne: [usize; 4], r: std::ops::Range<usize>) -> Vec<f64> {
    let per_tok = ne[0] * ne[1];
    (0..ne[3])
        .flat_map(|s| vals[(s * ne[2] + r.start) * per_tok..(s * ne[2] + r.end) * per_tok].iter().copied())
        .collect()
}

/// A prefill of `T` tokens (chunked) and then one decode step, both updating the same state leaf
/// in one graph run, equal `T + 1` tokens processed serially: outputs and final state.
#[test]
fn prefill_then_decode_equals_serial() {
    let full = dims(16, 8, 2, 4, 21, 2, 3);
    let t = full.n_t - 1;
    let x = data(full, &[2, 0], 21);
    let (o_want, st_want) = cpu(full, params(HeadMap::Tiled, SERIAL, full.s_k), &x);

    let pre = Dims { n_t: t, ..full };
    let dec = Dims { n_t: 1, ..full };
    let mut g = Graph::new();
    let state = g.state("state", F32, full.state()).unwrap();
    let slots = g.input("slots", DType::I32, [full.n_seq, 1, 1, 1]).unwrap();
    let mut leaves = Vec::new();
    let mut outs = Vec::new();
    for (d, algo) in [(pre, DeltaNetAlgo::Chunked { chunk: 8 }), (dec, SERIAL)] {
        let l: Vec<Tensor> = [d.qk(), d.qk(), d.v(), d.heads(), d.heads()]
            .into_iter()
            .map(|ne| g.input("x", F32, ne).unwrap())
            .collect();
        let p = params(HeadMap::Tiled, algo, d.s_k);
        let o = g.gated_delta_net(l[0], l[1], l[2], l[3], l[4], state, slots, p).unwrap();
        g.mark_output(o).unwrap();
        leaves.push(l);
        outs.push(o);
    }
    let mut cpu = CpuBackend::new();
    let mut s = Session::new(&g, &mut cpu).unwrap();
    let nes = [full.qk(), full.qk(), full.v(), full.heads(), full.heads()];
    for (i, ne) in nes.into_iter().enumerate() {
        s.set_f64(leaves[0][i], &tokens(&x.0[i], ne, 0..t)).unwrap();
        s.set_f64(leaves[1][i], &tokens(&x.0[i], ne, t..t + 1)).unwrap();
    }
    s.set_f64(state, &x.0[5]).unwrap();
    s.set_f64(slots, &x.0[6]).unwrap();
    s.run().unwrap();
    let (o_pre, o_dec) = (s.get_f64(outs[0]).unwrap(), s.get_f64(outs[1]).unwrap());
    let st = s.get_f64(state).unwrap();
    assert!(nmse(&st, &st_want) < 1e-10, "state {:e}", nmse(&st, &st_want));
    let o_ne = full.v();
    assert!(nmse(&o_pre, &tokens(&o_want, o_ne, 0..t)) < 1e-10);
    assert!(nmse(&o_dec, &tokens(&o_want, o_ne, t..t + 1)) < 1e-10);
}

/// One decode graph run once per token in one session: the state leaf persists in place across
/// the runs, and the outputs and final state equal one chunked run over all the tokens.
#[test]
fn decode_steps_across_session_runs_equal_one_prefill() {
    let full = dims(32, 16, 2, 6, 9, 3, 5);
    let x = data(full, &[3, 0, 4], 33);
    let (o_want, st_want) = cpu(full, params(HeadMap::Tiled, DeltaNetAlgo::Chunked { chunk: 4 }, full.s_k), &x);
    let dec = Dims { n_t: 1, ..full };
    let (g, leaves, out) = graph(dec, params(HeadMap::Tiled, SERIAL, dec.s_k));
    let mut cpu = CpuBackend::new();
    let mut s = Session::new(&g, &mut cpu).unwrap();
    s.set_f64(leaves[5], &x.0[5]).unwrap();
    s.set_f64(leaves[6], &x.0[6]).unwrap();
    let nes = [full.qk(), full.qk(), full.v(), full.heads(), full.heads()];
    for t in 0..full.n_t {
        for (i, ne) in nes.into_iter().enumerate() {
            s.set_f64(leaves[i], &tokens(&x.0[i], ne, t..t + 1)).unwrap();
        }
        s.run().unwrap();
        let o = s.get_f64(out).unwrap();
        let e = nmse(&o, &tokens(&o_want, full.v(), t..t + 1));
        assert!(e < 1e-10, "token {t}: {e:e}");
    }
    let st = s.get_f64(leaves[5]).unwrap();
    assert!(nmse(&st, &st_want) < 1e-10, "{:e}", nmse(&st, &st_want));
}

/// Three sequences in shuffled slots of six: each equals the sequence run alone in slot 0, and the
/// slots nobody names keep their bits.
#[test]
fn shuffled_slots_equal_sequences_run_alone() {
    let d = dims(12, 10, 1, 3, 17, 3, 6);
    let slots = [4usize, 0, 2];
    let x = data(d, &slots, 44);
    for algo in [SERIAL, DeltaNetAlgo::Chunked { chunk: 5 }] {
        let p = params(HeadMap::Grouped, algo, d.s_k);
        let (o, st) = cpu(d, p, &x);
        let one = Dims { n_seq: 1, n_slots: 1, ..d };
        let n = d.slot_len();
        for (s, &slot) in slots.iter().enumerate() {
            let seq = |vals: &Vec<f64>| {
                let per = vals.len() / d.n_seq;
                vals[s * per..(s + 1) * per].to_vec()
            };
            let alone = Data(vec![
                seq(&x.0[0]),
                seq(&x.0[1]),
                seq(&x.0[2]),
                seq(&x.0[3]),
                seq(&x.0[4]),
                x.0[5][slot * n..(slot + 1) * n].to_vec(),
                vec![0.0],
            ]);
            let (o1, st1) = cpu(one, p, &alone);
            assert_eq!(o1, seq(&o), "{algo:?}: sequence {s} output");
            assert_eq!(st1, st[slot * n..(slot + 1) * n], "{algo:?}: sequence {s} state");
        }
        for slot in [1, 3, 5] {
            let bits = |v: &[f64]| v.iter().map(|x| (*x as f32).to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&st[slot * n..(slot + 1) * n]), bits(&x.0[5][slot * n..(slot + 1) * n]), "slot {slot}");
        }
    }
}

/// The converter's value-head reorder on dimension `dim` of `vals` (shape `ne`): new head
/// `r H_k + kh` takes old head `kh R + r`.
fn reorder_heads(vals: &[f64], ne: [usize; 4], dim: usize, h_k: usize) -> Vec<f64> {
    let ratio = ne[dim] / h_k;
    let inner: usize = ne[..dim].iter().product();
    let mut out = vec![0.0; vals.len()];
    for (i, o) in out.iter_mut().enumerate() {
        let head = (i / inner) % ne[dim];
        let (r, kh) = (head / h_k, head % h_k);
        let from = i - head * inner + (kh * ratio + r) * inner;
        *o = vals[from];
    }
    out
}

/// HF's grouped head map on HF-ordered value heads and llama.cpp's tiled map on the converter's
/// reordered heads are the same model: the same numbers, bit for bit, once reordered.
#[test]
fn grouped_on_hf_order_equals_tiled_on_gguf_order() {
    let d = dims(8, 8, 2, 6, 10, 2, 2);
    let x = data(d, &[1, 0], 55);
    for algo in [SERIAL, DeltaNetAlgo::Chunked { chunk: 4 }] {
        let (o_hf, st_hf) = cpu(d, params(HeadMap::Grouped, algo, d.s_k), &x);
        let mut gguf = x.clone();
        gguf.0[2] = reorder_heads(&x.0[2], d.v(), 1, d.h_k);
        gguf.0[3] = reorder_heads(&x.0[3], d.heads(), 1, d.h_k);
        gguf.0[4] = reorder_heads(&x.0[4], d.heads(), 1, d.h_k);
        gguf.0[5] = reorder_heads(&x.0[5], d.state(), 2, d.h_k);
        let (o, st) = cpu(d, params(HeadMap::Tiled, algo, d.s_k), &gguf);
        assert_eq!(o, reorder_heads(&o_hf, d.v(), 1, d.h_k), "{algo:?}");
        assert_eq!(st, reorder_heads(&st_hf, d.state(), 2, d.h_k), "{algo:?}");
        // And tiled on HF order is a different model.
        let (o_wrong, _) = cpu(d, params(HeadMap::Tiled, algo, d.s_k), &x);
        assert!(nmse(&o_wrong, &o_hf) > 1e-3);
    }
}

#[test]
fn bad_shapes_and_params_fail_at_build_time() {
    let d = dims(4, 4, 2, 4, 3, 1, 1);
    let p = params(HeadMap::Tiled, SERIAL, 4);
    let build = |qk: [usize; 4], v: [usize; 4], state: ([usize; 4], DType), p: GatedDeltaNetParams| {
        let mut g = Graph::new();
        let q = g.input("q", F32, qk).unwrap();
        let k = g.input("k", F32, d.qk()).unwrap();
        let vv = g.input("v", F32, v).unwrap();
        let gg = g.input("g", F32, d.heads()).unwrap();
        let b = g.input("beta", F32, d.heads()).unwrap();
        let st = g.state("state", state.1, state.0).unwrap();
        let slots = g.input("slots", DType::I32, [1, 1, 1, 1]).unwrap();
        g.gated_delta_net(q, k, vv, gg, b, st, slots, p).map(|_| ())
    };
    let op_err = |r: Result<(), GraphError>| match r {
        Err(GraphError::Op(e)) => e,
        other => panic!("expected an op error, got {other:?}"),
    };
    assert!(build(d.qk(), d.v(), (d.state(), F32), p).is_ok());
    let e = op_err(build([5, 2, 3, 1], d.v(), (d.state(), F32), p));
    assert!(matches!(e, OpError::ShapeMismatch { op: "gated_delta_net", .. }), "{e}");
    let e = op_err(build([4, 3, 3, 1], d.v(), (d.state(), F32), p));
    assert!(matches!(e, OpError::ShapeMismatch { .. }), "S_k/H_k of q differ from k: {e}");
    let e = op_err(build(d.qk(), d.v(), (d.state(), DType::F16), p));
    assert!(matches!(e, OpError::DType { input: 5, .. }), "{e}");
    let e = op_err(build(d.qk(), d.v(), ([4, 4, 3, 1], F32), p));
    assert!(matches!(e, OpError::ShapeMismatch { .. }), "{e}");
    let chunk0 = params(HeadMap::Tiled, DeltaNetAlgo::Chunked { chunk: 0 }, 4);
    let e = op_err(build(d.qk(), d.v(), (d.state(), F32), chunk0));
    assert!(matches!(e, OpError::InvalidParam { .. }), "{e}");
}

/// Out-of-range, negative and repeated slots fail the run with a kernel error before anything is
/// written: the state keeps its values.
#[test]
fn bad_slots_fail_at_run_time_without_writing() {
    let d = dims(4, 3, 1, 2, 5, 2, 3);
    for (slots, dup) in [([0.0, 3.0], false), ([-1.0, 0.0], false), ([2.0, 2.0], true)] {
        for algo in [SERIAL, DeltaNetAlgo::Chunked { chunk: 2 }] {
            let mut x = data(d, &[0, 1], 9);
            x.0[6] = slots.to_vec();
            let (g, leaves, _) = graph(d, params(HeadMap::Tiled, algo, d.s_k));
            let backends: [Box<dyn Backend>; 2] = [Box::new(CpuBackend::new()), Box::new(ReferenceBackend::new())];
            for mut backend in backends {
                let name = backend.name().to_string();
                let mut s = Session::new(&g, backend.as_mut()).unwrap();
                for (t, vals) in leaves.iter().zip(&x.0) {
                    s.set_f64(*t, vals).unwrap();
                }
                let err = s.run().unwrap_err();
                let ExecError::Backend(BackendError::Kernel(e)) = &err else { panic!("{name}: {err}") };
                if dup {
                    assert!(matches!(e, KernelError::DuplicateIndex { what: "state slot", .. }), "{name}: {e}");
                } else {
                    assert!(matches!(e, KernelError::IndexOutOfRange { what: "state slot", limit: 3, .. }), "{e}");
                }
                let st = s.get_f64(leaves[5]).unwrap();
                let want: Vec<f64> = x.0[5].iter().map(|&v| f64::from(v as f32)).collect();
                assert_eq!(st, want, "{name}: state written despite the error");
            }
        }
    }
}
