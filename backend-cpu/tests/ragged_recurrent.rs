//! Ragged (varlen) batches of the recurrent ops on the CPU backend: a batch that packs prefill
//! chunks, decode tokens, empty sequences and padding gives, bit for bit, the outputs and final
//! state of running each sequence alone with the dense op (the CPU runs the same per-sequence
//! code either way: same chunking from the sequence's first token, same summation order), tokens
//! of no sequence output 0, and bad offsets or slots fail before anything is written. The f64
//! reference agrees with the ragged CPU run within the f32 bound.

mod common;

use common::Rng;
use tessera_cpu::{CpuBackend, ReferenceBackend};
use tessera_graph::{Backend, BackendError, ExecError, Graph, Session, Tensor};
use tessera_ops::{DType, DeltaNetAlgo, GatedDeltaNetParams, HeadMap, KernelError};

const F32: DType = DType::F32;
const I32: DType = DType::I32;

/// `n` values uniform in `[lo, hi)`, rounded to f32 (so every backend sees exactly them).
fn uniform(rng: &mut Rng, n: usize, lo: f64, hi: f64) -> Vec<f64> {
    (0..n).map(|_| rng.uniform(lo, hi) as f32 as f64).collect()
}

/// A ragged batch: `lead` padding tokens, then sequences of `lens` tokens, then `tail` padding
/// tokens; `slots[s]` for every sequence (those of empty sequences may be anything).
struct Batch {
    lead: usize,
    lens: Vec<usize>,
    tail: usize,
    slots: Vec<i64>,
}

impl Batch {
    fn n_tokens(&self) -> usize {
        self.lead + self.lens.iter().sum::<usize>() + self.tail
    }

    fn offsets(&self) -> Vec<i64> {
        let mut o = vec![self.lead as i64];
        for &l in &self.lens {
            o.push(o.last().unwrap() + l as i64);
        }
        o
    }

    /// (first token, length, slot) of each sequence with tokens.
    fn sequences(&self) -> Vec<(usize, usize, usize)> {
        let o = self.offsets();
        (0..self.lens.len())
            .filter(|&s| self.lens[s] > 0)
            .map(|s| (o[s] as usize, self.lens[s], self.slots[s] as usize))
            .collect()
    }

    /// Token `t` belongs to a sequence.
    fn owned(&self, t: usize) -> bool {
        let o = self.offsets();
        t >= o[0] as usize && t < *o.last().unwrap() as usize
    }
}

/// Sets the leaves, runs once and reads `reads`; the error of a failed run, with the leaves read
/// afterwards.
fn run(
    backend: &mut dyn Backend,
    g: &Graph,
    leaves: &[(Tensor, &[f64])],
    reads: &[Tensor],
) -> (Result<(), ExecError>, Vec<Vec<f64>>) {
    let mut s = Session::new(g, backend).unwrap();
    for (t, v) in leaves {
        s.set_f64(*t, v).unwrap();
    }
    let r = s.run();
    let out = reads.iter().map(|&t| s.get_f64(t).unwrap()).collect();
    (r, out)
}

// ---- gated_delta_net ----

#[derive(Clone, Copy)]
struct Heads {
    s_k: usize,
    s_v: usize,
    h_k: usize,
    h_v: usize,
    n_slots: usize,
}

/// Per-token inputs of a packed batch `[q, k, v, g, beta]` and the state.
struct GdnData {
    tokens: [Vec<f64>; 5],
    state: Vec<f64>,
}

impl Heads {
    /// Elements per token of q/k, v, g/beta.
    fn per_token(&self) -> [usize; 5] {
        let (qk, v, gb) = (self.s_k * self.h_k, self.s_v * self.h_v, self.h_v);
        [qk, qk, v, gb, gb]
    }

    fn data(&self, n_tokens: usize, seed: u64) -> GdnData {
        let mut rng = Rng(seed);
        let kr = (1.5 / self.s_k as f64).sqrt();
        let ranges = [(-1.0, 1.0), (-kr, kr), (-1.0, 1.0), (-1.0, 0.0), (0.0, 1.0)];
        let tokens =
            std::array::from_fn(|i| uniform(&mut rng, self.per_token()[i] * n_tokens, ranges[i].0, ranges[i].1));
        let state = uniform(&mut rng, self.s_k * self.s_v * self.h_v * self.n_slots, -1.0, 1.0);
        GdnData { tokens, state }
    }

    /// Runs gated_delta_net over `n_t` tokens of `n_seq` sequences (dense, `offsets` None) or a
    /// ragged batch of `n_t` packed tokens; returns the run's result, the output and the state.
    fn run(
        &self,
        p: GatedDeltaNetParams,
        n_t: usize,
        tokens: &[&[f64]; 5],
        state: &[f64],
        slots: &[i64],
        offsets: Option<&[i64]>,
    ) -> (Result<(), ExecError>, Vec<f64>, Vec<f64>) {
        let Heads { s_k, s_v, h_k, h_v, n_slots } = *self;
        let n_seq = if offsets.is_some() { 1 } else { slots.len() };
        let n_t = n_t / n_seq;
        let mut g = Graph::new();
        let shapes = [
            [s_k, h_k, n_t, n_seq],
            [s_k, h_k, n_t, n_seq],
            [s_v, h_v, n_t, n_seq],
            [1, h_v, n_t, n_seq],
            [1, h_v, n_t, n_seq],
        ];
        let names = ["q", "k", "v", "g", "beta"];
        let x: Vec<Tensor> = (0..5).map(|i| g.input(names[i], F32, shapes[i]).unwrap()).collect();
        let st = g.state("state", F32, [s_k, s_v, h_v, n_slots]).unwrap();
        let sl = g.input("slots", I32, [slots.len(), 1, 1, 1]).unwrap();
        let slot_vals: Vec<f64> = slots.iter().map(|&v| v as f64).collect();
        let mut leaves: Vec<(Tensor, &[f64])> = (0..5).map(|i| (x[i], tokens[i])).collect();
        leaves.push((st, state));
        leaves.push((sl, &slot_vals));
        let offset_vals: Vec<f64>;
        let out = match offsets {
            None => g.gated_delta_net(x[0], x[1], x[2], x[3], x[4], st, sl, p).unwrap(),
            Some(o) => {
                offset_vals = o.iter().map(|&v| v as f64).collect();
                let off = g.input("seq_offsets", I32, [o.len(), 1, 1, 1]).unwrap();
                leaves.push((off, &offset_vals));
                g.gated_delta_net_ragged(x[0], x[1], x[2], x[3], x[4], st, sl, off, p).unwrap()
            }
        };
        g.mark_output(out).unwrap();
        let (r, mut got) = run(&mut CpuBackend::new(), &g, &leaves, &[out, st]);
        let state = got.pop().unwrap();
        (r, got.pop().unwrap(), state)
    }
}

fn gdn_params(algo: DeltaNetAlgo, head_map: HeadMap, s_k: usize) -> GatedDeltaNetParams {
    GatedDeltaNetParams { scale: 1.0 / (s_k as f32).sqrt(), head_map, algo, ragged: false }
}

/// Prefill chunks (70 tokens: several chunks with a partial last one), decode tokens, empty
/// sequences (one naming another's slot, one an out-of-range slot), leading and trailing
/// padding, more sequences than slots.
fn mixed_batch() -> Batch {
    Batch { lead: 2, lens: vec![5, 1, 0, 70, 1, 0, 3, 2], tail: 4, slots: vec![4, 0, 4, 2, 5, 99, 1, 3] }
}

#[test]
fn ragged_gated_delta_net_is_each_sequence_alone_bit_for_bit() {
    let hd = Heads { s_k: 32, s_v: 24, h_k: 2, h_v: 4, n_slots: 6 };
    let batch = mixed_batch();
    let n = batch.n_tokens();
    let x = hd.data(n, 7);
    let pt = hd.per_token();
    let all: [&[f64]; 5] = std::array::from_fn(|i| x.tokens[i].as_slice());
    for algo in [DeltaNetAlgo::Serial, DeltaNetAlgo::Chunked { chunk: 16 }, DeltaNetAlgo::Chunked { chunk: 64 }] {
        for map in [HeadMap::Tiled, HeadMap::Grouped] {
            let p = gdn_params(algo, map, hd.s_k);
            let (r, out, state) = hd.run(p, n, &all, &x.state, &batch.slots, Some(&batch.offsets()));
            r.unwrap();
            let row = hd.s_v * hd.h_v;
            let mut want_state = x.state.clone();
            for (start, len, slot) in batch.sequences() {
                let part: [&[f64]; 5] = std::array::from_fn(|i| &x.tokens[i][start * pt[i]..(start + len) * pt[i]]);
                let (r, o, st) = hd.run(p, len, &part, &want_state, &[slot as i64], None);
                r.unwrap();
                assert_eq!(
                    o,
                    out[start * row..(start + len) * row],
                    "{algo:?} {map:?}: sequence at {start}, {len} tokens"
                );
                want_state = st;
            }
            assert_eq!(state, want_state, "{algo:?} {map:?}: final state");
            for t in (0..n).filter(|&t| !batch.owned(t)) {
                assert!(out[t * row..(t + 1) * row].iter().all(|&v| v == 0.0), "padding token {t} outputs 0");
            }
        }
    }
}

#[test]
fn ragged_gated_delta_net_matches_the_reference() {
    let hd = Heads { s_k: 16, s_v: 12, h_k: 1, h_v: 3, n_slots: 6 };
    let batch = mixed_batch();
    let n = batch.n_tokens();
    let x = hd.data(n, 11);
    let p = GatedDeltaNetParams { ragged: true, ..gdn_params(DeltaNetAlgo::Chunked { chunk: 8 }, HeadMap::Tiled, 16) };
    let mut g = Graph::new();
    let qk = [16, 1, n, 1];
    let t: Vec<Tensor> = [qk, qk, [12, 3, n, 1], [1, 3, n, 1], [1, 3, n, 1]]
        .iter()
        .enumerate()
        .map(|(i, &ne)| g.input(["q", "k", "v", "g", "beta"][i], F32, ne).unwrap())
        .collect();
    let st = g.state("state", F32, [16, 12, 3, 6]).unwrap();
    let sl = g.input("slots", I32, [8, 1, 1, 1]).unwrap();
    let off = g.input("seq_offsets", I32, [9, 1, 1, 1]).unwrap();
    let out = g.gated_delta_net_ragged(t[0], t[1], t[2], t[3], t[4], st, sl, off, p).unwrap();
    g.mark_output(out).unwrap();
    let slots: Vec<f64> = batch.slots.iter().map(|&v| v as f64).collect();
    let offsets: Vec<f64> = batch.offsets().iter().map(|&v| v as f64).collect();
    let mut leaves: Vec<(Tensor, &[f64])> = (0..5).map(|i| (t[i], x.tokens[i].as_slice())).collect();
    leaves.extend([(st, x.state.as_slice()), (sl, slots.as_slice()), (off, offsets.as_slice())]);
    let (r, cpu) = run(&mut CpuBackend::new(), &g, &leaves, &[out, st]);
    r.unwrap();
    let (r, want) = run(&mut ReferenceBackend::new(), &g, &leaves, &[out, st]);
    r.unwrap();
    for (got, want) in cpu.iter().zip(&want) {
        let err: f64 = got.iter().zip(want).map(|(a, b)| (a - b) * (a - b)).sum();
        let norm: f64 = want.iter().map(|b| b * b).sum();
        assert!(err / norm < 1e-10, "nmse {}", err / norm);
    }
}

#[test]
fn bad_offsets_and_slots_fail_before_anything_is_written() {
    let hd = Heads { s_k: 8, s_v: 8, h_k: 1, h_v: 2, n_slots: 4 };
    let x = hd.data(6, 3);
    let all: [&[f64]; 5] = std::array::from_fn(|i| x.tokens[i].as_slice());
    let p = gdn_params(DeltaNetAlgo::Serial, HeadMap::Tiled, 8);
    let kernel_error = |r: Result<(), ExecError>| match r {
        Err(ExecError::Backend(BackendError::Kernel(e))) => e,
        other => panic!("expected a kernel error, got {other:?}"),
    };
    let op = "gated_delta_net";
    let value = |at, value, low, high| KernelError::ValueOutOfRange { op, what: "seq_offsets", at, value, low, high };
    for (offsets, slots, want) in [
        (vec![0, 4, 3], vec![0, 1], value(2, 3, 4, 6)),
        (vec![0, 2, 7], vec![0, 1], value(2, 7, 2, 6)),
        (vec![-1, 2, 6], vec![0, 1], value(0, -1, 0, 6)),
        // Two sequences with tokens in one slot; an out-of-range slot with tokens.
        (
            vec![0, 2, 6],
            vec![3, 3],
            KernelError::DuplicateIndex { op, index: 3, first: 0, second: 1, what: "state slot" },
        ),
        (vec![0, 0, 1, 6], vec![9, 4, 1], KernelError::IndexOutOfRange { op, index: 4, limit: 4, what: "state slot" }),
    ] {
        let (r, _, state) = hd.run(p, 6, &all, &x.state, &slots, Some(&offsets));
        assert_eq!(kernel_error(r), want, "offsets {offsets:?}, slots {slots:?}");
        assert_eq!(state, x.state, "the state is untouched");
    }
    // An empty sequence may repeat a slot or name none.
    let (r, _, _) = hd.run(p, 6, &all, &x.state, &[3, 3, -7], Some(&[0, 6, 6, 6]));
    r.unwrap();
}

// ---- ssm_conv_update_inplace ----

/// Runs ssm_conv_update_inplace over `n_t` tokens of `slots.len()` sequences (dense) or a ragged
/// batch; returns the run's result, the output and the state.
#[allow(clippy::too_many_arguments)]
fn conv_run(
    channels: usize,
    d_conv: usize,
    n_slots: usize,
    n_t: usize,
    x: &[f64],
    state: &[f64],
    kernel: &[f64],
    slots: &[i64],
    offsets: Option<&[i64]>,
) -> (Result<(), ExecError>, Vec<f64>, Vec<f64>) {
    let n_seq = if offsets.is_some() { 1 } else { slots.len() };
    let mut g = Graph::new();
    let xt = g.input("x", F32, [channels, n_t / n_seq, n_seq, 1]).unwrap();
    let st = g.state("state", F32, [d_conv - 1, channels, n_slots, 1]).unwrap();
    let kt = g.input("kernel", F32, [d_conv, channels, 1, 1]).unwrap();
    let sl = g.input("slots", I32, [slots.len(), 1, 1, 1]).unwrap();
    let slot_vals: Vec<f64> = slots.iter().map(|&v| v as f64).collect();
    let mut leaves: Vec<(Tensor, &[f64])> = vec![(xt, x), (st, state), (kt, kernel), (sl, &slot_vals)];
    let offset_vals: Vec<f64>;
    let out = match offsets {
        None => g.ssm_conv_update_inplace(xt, st, kt, sl, true).unwrap(),
        Some(o) => {
            offset_vals = o.iter().map(|&v| v as f64).collect();
            let off = g.input("seq_offsets", I32, [o.len(), 1, 1, 1]).unwrap();
            leaves.push((off, &offset_vals));
            g.ssm_conv_update_inplace_ragged(xt, st, kt, sl, off, true).unwrap()
        }
    };
    g.mark_output(out).unwrap();
    let (r, mut got) = run(&mut CpuBackend::new(), &g, &leaves, &[out, st]);
    let state = got.pop().unwrap();
    (r, got.pop().unwrap(), state)
}

#[test]
fn ragged_conv_update_is_each_sequence_alone_bit_for_bit() {
    // Lengths below, at and above d_conv - 1 = 3, so the saved samples mix old state and tokens.
    let batch = Batch { lead: 1, lens: vec![2, 1, 0, 3, 10, 0, 1, 40], tail: 3, slots: vec![5, 0, 5, 2, 4, -3, 1, 3] };
    let (channels, d_conv, n_slots) = (67, 4, 6);
    let n = batch.n_tokens();
    let mut rng = Rng(5);
    let x = uniform(&mut rng, channels * n, -1.0, 1.0);
    let state = uniform(&mut rng, (d_conv - 1) * channels * n_slots, -1.0, 1.0);
    let kernel = uniform(&mut rng, d_conv * channels, -1.0, 1.0);
    let (r, out, got_state) =
        conv_run(channels, d_conv, n_slots, n, &x, &state, &kernel, &batch.slots, Some(&batch.offsets()));
    r.unwrap();
    let mut want_state = state.clone();
    for (start, len, slot) in batch.sequences() {
        let xs = &x[start * channels..(start + len) * channels];
        let (r, o, st) = conv_run(channels, d_conv, n_slots, len, xs, &want_state, &kernel, &[slot as i64], None);
        r.unwrap();
        assert_eq!(o, out[start * channels..(start + len) * channels], "sequence at {start}, {len} tokens");
        want_state = st;
    }
    assert_eq!(got_state, want_state);
    for t in (0..n).filter(|&t| !batch.owned(t)) {
        assert!(out[t * channels..(t + 1) * channels].iter().all(|&v| v == 0.0), "padding token {t} outputs 0");
    }
    // The reference agrees.
    let mut g = Graph::new();
    let xt = g.input("x", F32, [channels, n, 1, 1]).unwrap();
    let st = g.state("state", F32, [d_conv - 1, channels, n_slots, 1]).unwrap();
    let kt = g.input("kernel", F32, [d_conv, channels, 1, 1]).unwrap();
    let sl = g.input("slots", I32, [8, 1, 1, 1]).unwrap();
    let off = g.input("seq_offsets", I32, [9, 1, 1, 1]).unwrap();
    let y = g.ssm_conv_update_inplace_ragged(xt, st, kt, sl, off, true).unwrap();
    g.mark_output(y).unwrap();
    let slots: Vec<f64> = batch.slots.iter().map(|&v| v as f64).collect();
    let offsets: Vec<f64> = batch.offsets().iter().map(|&v| v as f64).collect();
    let leaves: Vec<(Tensor, &[f64])> = vec![(xt, &x), (st, &state), (kt, &kernel), (sl, &slots), (off, &offsets)];
    let (r, want) = run(&mut ReferenceBackend::new(), &g, &leaves, &[y, st]);
    r.unwrap();
    for (got, want) in [&out, &got_state].into_iter().zip(&want) {
        let err: f64 = got.iter().zip(want).map(|(a, b)| (a - b) * (a - b)).sum();
        let norm: f64 = want.iter().map(|b| b * b).sum();
        assert!(err / norm < 1e-12, "nmse {}", err / norm);
    }
}

#[test]
fn conv_update_bad_offsets_and_slots_fail_before_anything_is_written() {
    let (channels, d_conv, n_slots) = (8, 4, 3);
    let mut rng = Rng(9);
    let x = uniform(&mut rng, channels * 5, -1.0, 1.0);
    let state = uniform(&mut rng, (d_conv - 1) * channels * n_slots, -1.0, 1.0);
    let kernel = uniform(&mut rng, d_conv * channels, -1.0, 1.0);
    let op = "ssm_conv_update_inplace";
    for (offsets, slots, want) in [
        (
            vec![0, 3, 2],
            vec![0, 1],
            KernelError::ValueOutOfRange { op, what: "seq_offsets", at: 2, value: 2, low: 3, high: 5 },
        ),
        (
            vec![0, 5, 6],
            vec![0, 1],
            KernelError::ValueOutOfRange { op, what: "seq_offsets", at: 2, value: 6, low: 5, high: 5 },
        ),
        (
            vec![1, 2, 4],
            vec![2, 2],
            KernelError::DuplicateIndex { op, index: 2, first: 0, second: 1, what: "state slot" },
        ),
    ] {
        let (r, _, st) = conv_run(channels, d_conv, n_slots, 5, &x, &state, &kernel, &slots, Some(&offsets));
        match r {
            Err(ExecError::Backend(BackendError::Kernel(e))) => assert_eq!(e, want),
            other => panic!("expected {want}, got {other:?}"),
        }
        assert_eq!(st, state, "the state is untouched");
    }
}
