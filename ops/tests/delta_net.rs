//! gated_delta_net in the f64 reference: the chunked (WY / UT-transform) form equals the
//! token-serial recurrence for every length, chunk size and head layout; splitting a sequence
//! into runs that carry the state equals one run; and the two head maps describe the same model
//! once the value heads are reordered the way llama.cpp's converter does
//! (docs/notes/hybrid-ops.md §2.4).

use proptest::prelude::*;
use proptest::sample::select;
use tessera_ops::reference::{RefTensor, compute_updating};
use tessera_ops::{DType, DeltaNetAlgo, GatedDeltaNetParams, HeadMap, Op, TensorMeta};

/// splitmix64, to draw the data of a case from its seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Sizes of one problem.
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

/// The seven inputs `[q, k, v, g, beta, state, slots]`, as the model's callers make them: q and k
/// rows l2-normalised, beta in (0, 1), g a log decay in [-2, 0.05) (slightly positive values
/// included), sequence `s` in slot `n_slots - 1 - s`.
fn inputs(d: Dims, seed: u64) -> Vec<RefTensor> {
    let mut rng = Rng(seed);
    let normed_rows = |ne: [usize; 4], rng: &mut Rng| {
        let mut data: Vec<f64> = (0..ne.iter().product()).map(|_| rng.uniform(-1.0, 1.0)).collect();
        for row in data.chunks_mut(ne[0]) {
            let n = row.iter().map(|x| x * x).sum::<f64>().sqrt().max(1e-6);
            row.iter_mut().for_each(|x| *x /= n);
        }
        RefTensor::new(ne, data)
    };
    let qk = [d.s_k, d.h_k, d.n_t, d.n_seq];
    let heads = [1, d.h_v, d.n_t, d.n_seq];
    let q = normed_rows(qk, &mut rng);
    let k = normed_rows(qk, &mut rng);
    let mut uniform = |ne: [usize; 4], lo: f64, hi: f64| {
        RefTensor::new(ne, (0..ne.iter().product()).map(|_| rng.uniform(lo, hi)).collect())
    };
    let v = uniform([d.s_v, d.h_v, d.n_t, d.n_seq], -1.0, 1.0);
    let g = uniform(heads, -2.0, 0.05);
    let beta = uniform(heads, 0.0, 1.0);
    let state = uniform([d.s_k, d.s_v, d.h_v, d.n_slots], -1.0, 1.0);
    let slots = RefTensor::new([d.n_seq, 1, 1, 1], (0..d.n_seq).map(|s| (d.n_slots - 1 - s) as f64).collect());
    vec![q, k, v, g, beta, state, slots]
}

fn op(head_map: HeadMap, algo: DeltaNetAlgo, s_k: usize) -> Op {
    Op::GatedDeltaNet(GatedDeltaNetParams { scale: 1.0 / (s_k as f32).sqrt(), head_map, algo, ragged: false })
}

/// Runs the op through the shape rules and the reference: (output, new state).
fn run(op: &Op, ins: &[RefTensor]) -> (RefTensor, RefTensor) {
    let dtype = |i: usize| if i == 6 { DType::I32 } else { DType::F32 };
    let metas: Vec<TensorMeta> =
        ins.iter().enumerate().map(|(i, t)| TensorMeta::contiguous("t", dtype(i), t.ne).unwrap()).collect();
    let refs: Vec<&TensorMeta> = metas.iter().collect();
    let out = tessera_ops::infer(op, &refs).unwrap();
    compute_updating(op, ins, &out).unwrap()
}

fn nmse(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let err: f64 = got.iter().zip(want).map(|(a, b)| (a - b) * (a - b)).sum();
    let norm: f64 = want.iter().map(|b| b * b).sum();
    if norm == 0.0 { err } else { err / norm }
}

fn dims() -> impl Strategy<Value = Dims> {
    (1usize..=9, 1usize..=9, 1usize..=3, 1usize..=3, 1usize..70, 1usize..=2, 0usize..=2).prop_map(
        |(s_k, s_v, h_k, ratio, n_t, n_seq, extra)| Dims {
            s_k,
            s_v,
            h_k,
            h_v: h_k * ratio,
            n_t,
            n_seq,
            n_slots: n_seq + extra,
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Chunked equals serial, outputs and final state, including lengths that are not a multiple
    /// of the chunk and chunks longer than the sequence.
    #[test]
    fn chunked_equals_serial(
        d in dims(),
        chunk in select(vec![1usize, 3, 8, 16, 64]),
        grouped in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let map = if grouped { HeadMap::Grouped } else { HeadMap::Tiled };
        let ins = inputs(d, seed);
        let (o_s, st_s) = run(&op(map, DeltaNetAlgo::Serial, d.s_k), &ins);
        let (o_c, st_c) = run(&op(map, DeltaNetAlgo::Chunked { chunk }, d.s_k), &ins);
        let (eo, es) = (nmse(&o_c.data, &o_s.data), nmse(&st_c.data, &st_s.data));
        prop_assert!(eo < 1e-10, "output NMSE {eo:e} for {d:?}, chunk {chunk}");
        prop_assert!(es < 1e-10, "state NMSE {es:e} for {d:?}, chunk {chunk}");
        // Slots no sequence names (0..n_slots - n_seq) are untouched.
        let n = d.s_k * d.s_v * d.h_v;
        for at in 0..d.n_slots - d.n_seq {
            prop_assert_eq!(&st_c.data[at * n..(at + 1) * n], &ins[5].data[at * n..(at + 1) * n]);
        }
    }

    /// Running the first `split` tokens, then the rest from the state they left, equals one run.
    #[test]
    fn state_carries_across_runs(
        d in dims(),
        chunk in select(vec![1usize, 3, 16]),
        split_at in any::<prop::sample::Index>(),
        seed in any::<u64>(),
    ) {
        prop_assume!(d.n_t >= 2);
        let split = 1 + split_at.index(d.n_t - 1);
        let ins = inputs(d, seed);
        let algo = DeltaNetAlgo::Chunked { chunk };
        let (o_all, st_all) = run(&op(HeadMap::Tiled, algo, d.s_k), &ins);
        let tokens = |t: &RefTensor, r: std::ops::Range<usize>| {
            let ne = [t.ne[0], t.ne[1], r.len(), t.ne[3]];
            let mut out = RefTensor::zeros(ne);
            for i in RefTensor::indices(ne) {
                out.set(i, t.at([i[0], i[1], i[2] + r.start, i[3]]));
            }
            out
        };
        let part = |r: std::ops::Range<usize>, state: &RefTensor| -> Vec<RefTensor> {
            let mut v: Vec<RefTensor> = ins[..5].iter().map(|t| tokens(t, r.clone())).collect();
            v.push(state.clone());
            v.push(ins[6].clone());
            v
        };
        let (o1, st1) = run(&op(HeadMap::Tiled, algo, d.s_k), &part(0..split, &ins[5]));
        let (o2, st2) = run(&op(HeadMap::Tiled, DeltaNetAlgo::Serial, d.s_k), &part(split..d.n_t, &st1));
        prop_assert!(nmse(&st2.data, &st_all.data) < 1e-10);
        prop_assert!(nmse(&o1.data, &tokens(&o_all, 0..split).data) < 1e-10);
        prop_assert!(nmse(&o2.data, &tokens(&o_all, split..d.n_t).data) < 1e-10);
    }

    /// Grouped on HF-ordered value heads equals Tiled on the converter's order: new head
    /// `r H_k + kh` is old head `kh R + r` in v, g, beta, the state and the output.
    #[test]
    fn grouped_equals_tiled_after_reorder(d in dims(), chunk in select(vec![0usize, 4]), seed in any::<u64>()) {
        let algo = if chunk == 0 { DeltaNetAlgo::Serial } else { DeltaNetAlgo::Chunked { chunk } };
        let ins = inputs(d, seed);
        let (o_hf, st_hf) = run(&op(HeadMap::Grouped, algo, d.s_k), &ins);
        let mut reordered = ins.clone();
        for i in [2, 3, 4] {
            reordered[i] = reorder_heads(&ins[i], 1, d.h_k);
        }
        reordered[5] = reorder_heads(&ins[5], 2, d.h_k);
        let (o_gguf, st_gguf) = run(&op(HeadMap::Tiled, algo, d.s_k), &reordered);
        prop_assert_eq!(&o_gguf.data, &reorder_heads(&o_hf, 1, d.h_k).data);
        prop_assert_eq!(&st_gguf.data, &reorder_heads(&st_hf, 2, d.h_k).data);
    }
}

/// The converter's value-head reorder (`_reorder_v_heads`) on dimension `dim` (the head
/// dimension: 1 for v, g, beta and the output, 2 for the state `[S_k, S_v, H_v, n_slots]`): new
/// head `r H_k + kh` takes old head `kh R + r`.
fn reorder_heads(t: &RefTensor, dim: usize, h_k: usize) -> RefTensor {
    let ratio = t.ne[dim] / h_k;
    let mut out = RefTensor::zeros(t.ne);
    for i in RefTensor::indices(t.ne) {
        let (r, kh) = (i[dim] / h_k, i[dim] % h_k);
        let mut from = i;
        from[dim] = kh * ratio + r;
        out.set(i, t.at(from));
    }
    out
}
