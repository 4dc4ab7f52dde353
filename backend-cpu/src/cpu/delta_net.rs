//! gated_delta_net on the CPU: one rayon task per (sequence, value head), each running the
//! token-serial recurrence or the chunked WY / UT-transform form on that head's `S_k x S_v` state,
//! read from and written back to the sequence's slot in place.
//!
//! The state of one (slot, head) is `S_v` runs of `S_k` floats: run `j` holds `S[.][j]` (ggml
//! layout, key dim fastest), i.e. `S^T` row-major. The serial form updates it run by run (a dot
//! product and an axpy over each run per token: one pass over the state per token); the chunked
//! form does the per-chunk products as small dense matmuls (`matrixmultiply::sgemm`) and solves
//! the unit lower triangular system by forward substitution. The state is updated in place when
//! its bytes are 4-byte aligned, else through a copy; results are the same bits either way. The
//! formulas are in `tessera_ops::reference` (delta_net) and docs/OPS.md; this file computes the
//! same in f32 with f32 accumulation.

use std::ops::Range;

use tessera_ops::{
    DeltaNetAlgo, GatedDeltaNetParams, HeadMap, KernelError, checked_ragged_slots, checked_seq_offsets, checked_slots,
};

use super::StateMut;
use super::math::exp;
use super::par;
use super::strided::{Dst, Src, cast_f32_mut, row_coords};

const OP: &str = "gated_delta_net";

/// One sequence of a recurrent op's batch: its state slot, the index of its tokens along the
/// outermost dimension (`s` dense, 0 ragged) and its tokens along the token dimension.
pub(super) struct Seq {
    pub slot: usize,
    pub outer: usize,
    pub tokens: Range<usize>,
}

/// The sequences a recurrent op runs, checked before anything is written. Dense (no `offsets`):
/// `n_seq` sequences of all `n_t` tokens. Ragged: sequence `s` owns tokens `offsets[s] ..
/// offsets[s + 1]`; sequences without tokens are left out and their slots not checked.
pub(super) fn sequences(
    op: &'static str,
    offsets: Option<Src<'_>>,
    slots: Src<'_>,
    n_t: usize,
    n_seq: usize,
    n_slots: usize,
) -> Result<Vec<Seq>, KernelError> {
    let slot = |s: usize| i64::from(slots.elem_i32([s, 0, 0, 0]));
    let Some(offsets) = offsets else {
        let slot_of = checked_slots(op, (0..n_seq).map(slot), n_slots)?;
        return Ok(slot_of.into_iter().enumerate().map(|(s, slot)| Seq { slot, outer: s, tokens: 0..n_t }).collect());
    };
    let n = offsets.ne()[0];
    let offsets = checked_seq_offsets(op, (0..n).map(|i| i64::from(offsets.elem_i32([i, 0, 0, 0]))), n_t)?;
    let slot_of = checked_ragged_slots(op, (0..n.saturating_sub(1)).map(slot), &offsets, n_slots)?;
    Ok(slot_of
        .into_iter()
        .zip(offsets.windows(2))
        .filter_map(|(slot, w)| slot.map(|slot| Seq { slot, outer: 0, tokens: w[0]..w[1] }))
        .collect())
}

/// `qkvgb` is `[q, k, v, g, beta]`; `offsets` is the ragged batch's `seq_offsets` (`None`:
/// dense).
pub(super) fn gated_delta_net(
    p: &GatedDeltaNetParams,
    qkvgb: [Src<'_>; 5],
    state: StateMut<'_>,
    slots: Src<'_>,
    offsets: Option<Src<'_>>,
    dst: &mut Dst<'_>,
) -> Result<(), KernelError> {
    let [q, k, v, g, beta] = qkvgb;
    let [s_k, h_k, n_t, n_seq] = q.ne();
    let [s_v, h_v, ..] = v.ne();
    let n_slots = state.meta.ne[3];
    let seqs = sequences(OP, offsets, slots, n_t, n_seq, n_slots)?;
    let mat_bytes = s_k * s_v * 4;
    if state.bytes.len() < mat_bytes * h_v * n_slots || dst.ne() != [s_v, h_v, n_t, n_seq] {
        return Err(KernelError::Unsupported { op: OP, why: "state or output does not match q and v".into() });
    }
    let chunk = match p.algo {
        DeltaNetAlgo::Serial => None,
        DeltaNetAlgo::Chunked { chunk: 0 } => {
            return Err(KernelError::Unsupported { op: OP, why: "chunk size 0".into() });
        }
        DeltaNetAlgo::Chunked { chunk } => Some(chunk),
    };

    // The state of every (slot, head), then the ones the sequences name, in (seq, head) order.
    let mut mats: Vec<Option<&mut [u8]>> =
        state.bytes.chunks_exact_mut(mat_bytes).take(h_v * n_slots).map(Some).collect();
    let mut tasks: Vec<(&Seq, usize, &mut [u8])> = Vec::with_capacity(seqs.len() * h_v);
    for (s, seq) in seqs.iter().enumerate() {
        for h in 0..h_v {
            let m = mats[seq.slot * h_v + h].take().ok_or(KernelError::DuplicateIndex {
                op: OP,
                index: seq.slot,
                first: s,
                second: s,
                what: "state slot",
            })?;
            tasks.push((seq, h, m));
        }
    }

    let ratio = h_v / h_k;
    let inputs = Inputs { q, k, v, g, beta, scale: p.scale, head_map: p.head_map, h_k, ratio };
    // Outputs per (seq, head), in task order: [L][S_v] for a sequence of L tokens.
    let n_out: usize = seqs.iter().map(|q| q.tokens.len()).sum();
    let mut outs = vec![0f32; n_out * h_v * s_v];
    let mut tasks: Vec<_> = {
        let mut rest = outs.as_mut_slice();
        tasks
            .into_iter()
            .map(|task| {
                let (o, tail) = std::mem::take(&mut rest).split_at_mut(task.0.tokens.len() * s_v);
                rest = tail;
                (task, o)
            })
            .collect()
    };
    // A task's work is about one pass over its state per token.
    let min_len = super::strided::rows_per_task(s_k * s_v * n_out.div_ceil(seqs.len().max(1)));
    par::chunks_mut(&mut tasks, 1, min_len, Scratch::default, |sc, _, task| {
        let [((seq, h, bytes), o)] = task else { unreachable!("chunks of one task") };
        let (seq, h, o) = (*seq, *h, &mut **o);
        let mut copied = Vec::new();
        let st: &mut [f32] = match cast_f32_mut(bytes) {
            Some(st) => st,
            None => {
                // Misaligned state: work on a copy and write it back.
                copied = bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
                &mut copied
            }
        };
        match chunk {
            None => serial(&inputs, seq, h, st, o, sc),
            Some(c) => chunked(&inputs, seq, h, st, o, c.min(seq.tokens.len()), sc),
        }
        if !copied.is_empty() {
            for (b, x) in bytes.chunks_exact_mut(4).zip(&copied) {
                b.copy_from_slice(&x.to_le_bytes());
            }
        }
    });

    // Where each token's outputs are: (sequence's first output, its first token, its length),
    // by (outer, token); tokens of no sequence (ragged padding) output 0.
    let mut owner: Vec<Option<(usize, usize, usize)>> = vec![None; n_t * n_seq];
    let mut base = 0;
    for seq in &seqs {
        for t in seq.tokens.clone() {
            owner[seq.outer * n_t + t] = Some((base, seq.tokens.start, seq.tokens.len()));
        }
        base += seq.tokens.len() * h_v * s_v;
    }
    let ne = dst.ne();
    let zeros = vec![0f32; s_v];
    dst.for_each_row(
        s_v,
        || (),
        |_, r, mut row| {
            let [h, t, s] = row_coords(ne, r);
            match owner[s * n_t + t] {
                Some((base, start, len)) => row.store(&outs[base + (h * len + t - start) * s_v..][..s_v]),
                None => row.store(&zeros),
            }
        },
    );
    Ok(())
}

/// The op's activations and what is needed to address them per (head, token, sequence).
struct Inputs<'a> {
    q: Src<'a>,
    k: Src<'a>,
    v: Src<'a>,
    g: Src<'a>,
    beta: Src<'a>,
    scale: f32,
    head_map: HeadMap,
    h_k: usize,
    ratio: usize,
}

impl Inputs<'_> {
    fn key_head(&self, h: usize) -> usize {
        match self.head_map {
            HeadMap::Tiled => h % self.h_k,
            HeadMap::Grouped => h / self.ratio,
        }
    }

    /// `g` (or `beta` when `which` is 1) of value head `h` at token `t` of sequence `s`.
    fn scalar(&self, which: usize, h: usize, t: usize, s: usize) -> f32 {
        let mut x = [0f32];
        [self.g, self.beta][which].load_row([h, t, s], &mut x);
        x[0]
    }

    /// Loads token `t`'s scaled q, k and v rows of value head `h` into the given rows.
    fn load(&self, h: usize, t: usize, s: usize, q: &mut [f32], k: &mut [f32], v: &mut [f32]) {
        let kh = self.key_head(h);
        self.q.load_row([kh, t, s], q);
        q.iter_mut().for_each(|x| *x *= self.scale);
        self.k.load_row([kh, t, s], k);
        self.v.load_row([h, t, s], v);
    }
}

/// Per-task buffers, reused across the (sequence, head) pairs a rayon task handles.
#[derive(Default)]
struct Scratch {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    /// `U`, then `V_new` (chunked).
    u: Vec<f32>,
    /// `beta exp(gamma) K` (chunked).
    kb: Vec<f32>,
    w: Vec<f32>,
    gamma: Vec<f32>,
    beta: Vec<f32>,
    /// `A` of the chunk, `chunk x chunk` row-major (strictly lower part used).
    a: Vec<f32>,
    /// `T = (I + A)^-1`, `chunk x chunk` row-major.
    t: Vec<f32>,
    /// `Q K^T ⊙ Gamma` of the chunk, `chunk x chunk` row-major.
    qk: Vec<f32>,
}

/// The elements of row `i` of a row-major matrix with rows of `n`.
#[inline]
fn span(i: usize, n: usize) -> std::ops::Range<usize> {
    i * n..(i + 1) * n
}

/// `sum_i a[i] b[i]` with sixteen partial sums (vectorises into independent chains; the order
/// is fixed, so results do not depend on alignment or threads).
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    const W: usize = 16;
    let (ca, cb) = (a.chunks_exact(W), b.chunks_exact(W));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    let mut acc = [0f32; W];
    for (x, y) in ca.zip(cb) {
        for i in 0..W {
            acc[i] += x[i] * y[i];
        }
    }
    let mut half = [0f32; 8];
    for i in 0..8 {
        half[i] = acc[i] + acc[i + 8];
    }
    ((half[0] + half[4]) + (half[1] + half[5])) + ((half[2] + half[6]) + (half[3] + half[7])) + tail
}

/// `y += a x`
#[inline]
fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// The recurrence over one sequence's tokens on one head's state `st` (`S_v` runs of `S_k`); `o`
/// is `[L][S_v]`.
fn serial(x: &Inputs<'_>, seq: &Seq, h: usize, st: &mut [f32], o: &mut [f32], sc: &mut Scratch) {
    let (s_k, s_v, s) = (x.q.ne()[0], x.v.ne()[0], seq.outer);
    sc.q.resize(s_k, 0.0);
    sc.k.resize(s_k, 0.0);
    sc.v.resize(s_v, 0.0);
    for (t, o_t) in seq.tokens.clone().zip(o.chunks_exact_mut(s_v)) {
        x.load(h, t, s, &mut sc.q, &mut sc.k, &mut sc.v);
        let decay = exp(x.scalar(0, h, t, s));
        let beta = x.scalar(1, h, t, s);
        for ((run, o_j), &v_j) in st.chunks_exact_mut(s_k).zip(o_t.iter_mut()).zip(&sc.v) {
            // S <- exp(g) S; u = S^T k; S <- S + k (beta (v - u))^T; o = S^T q
            let u = decay * dot(run, &sc.k);
            let delta = beta * (v_j - u);
            for (e, &kk) in run.iter_mut().zip(&sc.k) {
                *e = decay * *e + delta * kk;
            }
            *o_j = dot(run, &sc.q);
        }
    }
}

/// A matrix for [`gemm`]: element `(r, c)` at `data[r * rs + c * cs]`.
#[derive(Clone, Copy)]
struct Mat<'a> {
    data: &'a [f32],
    rs: usize,
    cs: usize,
}

impl<'a> Mat<'a> {
    /// Row-major with rows of `n`.
    fn rows(data: &'a [f32], n: usize) -> Self {
        Mat { data, rs: n, cs: 1 }
    }

    /// The transpose of a row-major matrix with rows of `n`.
    fn transposed(data: &'a [f32], n: usize) -> Self {
        Mat { data, rs: 1, cs: n }
    }

    /// True when every element of an `rows x cols` matrix lies in `data`.
    fn covers(&self, rows: usize, cols: usize) -> bool {
        (rows - 1) * self.rs + (cols - 1) * self.cs < self.data.len()
    }
}

/// `C = alpha A B + beta C` for `[m, k, n]`: `A (m x k)`, `B (k x n)` and `C (m x n)` row-major with rows of
/// `rsc` (`C` is not read when `beta` is 0), by `matrixmultiply::sgemm` (single-threaded: this
/// runs inside a rayon task).
fn gemm([m, k, n]: [usize; 3], alpha: f32, a: Mat<'_>, b: Mat<'_>, beta: f32, c: &mut [f32], rsc: usize) {
    if m == 0 || n == 0 || k == 0 {
        return;
    }
    let c_covered = (m - 1) * rsc + n - 1 < c.len();
    assert!(a.covers(m, k) && b.covers(k, n) && c_covered, "gated_delta_net: gemm operand out of its slice");
    // SAFETY: the assertion above puts every element sgemm reads of A (m x k at strides rs, cs)
    // and B (k x n) inside their slices, and every element it reads or writes of C (m x n at
    // strides rsc, 1) inside `c`. `c` is borrowed mutably, so it overlaps neither A nor B.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            alpha,
            a.data.as_ptr(),
            a.rs as isize,
            a.cs as isize,
            b.data.as_ptr(),
            b.rs as isize,
            b.cs as isize,
            beta,
            c.as_mut_ptr(),
            rsc as isize,
            1,
        );
    }
}

/// The chunked form over one sequence's tokens, `chunk` tokens at a time from its first (the
/// last chunk may be shorter). `o` is `[L][S_v]`. The products are small dense matmuls; the state `S` (`S_v` runs of `S_k`) is
/// `S^T` row-major, so `X S` is `gemm(X, transposed(st))`.
fn chunked(x: &Inputs<'_>, seq: &Seq, h: usize, st: &mut [f32], o: &mut [f32], chunk: usize, sc: &mut Scratch) {
    let (s_k, s_v, n_t, s) = (x.q.ne()[0], x.v.ne()[0], seq.tokens.len(), seq.outer);
    for (buf, n) in [(&mut sc.q, s_k), (&mut sc.k, s_k), (&mut sc.w, s_k), (&mut sc.kb, s_k), (&mut sc.v, s_v)] {
        buf.resize(chunk * n, 0.0);
    }
    sc.u.resize(chunk * s_v, 0.0);
    for buf in [&mut sc.a, &mut sc.t, &mut sc.qk] {
        buf.resize(chunk * chunk, 0.0);
    }
    sc.gamma.resize(chunk, 0.0);
    sc.beta.resize(chunk, 0.0);
    let Scratch { q, k, v, u, kb, w, gamma, beta, a, t, qk } = sc;
    let mut start = 0;
    while start < n_t {
        let c = chunk.min(n_t - start);
        let mut cum = 0f32;
        for i in 0..c {
            let tok = seq.tokens.start + start + i;
            x.load(h, tok, s, &mut q[span(i, s_k)], &mut k[span(i, s_k)], &mut v[span(i, s_v)]);
            cum += x.scalar(0, h, tok, s);
            gamma[i] = cum;
            beta[i] = x.scalar(1, h, tok, s);
        }
        let (q, k) = (&q[..c * s_k], &k[..c * s_k]);

        // A[i][j] = beta_i (k_i . k_j) exp(gamma_i - gamma_j), j < i (rows of `chunk`).
        gemm([c, s_k, c], 1.0, Mat::rows(k, s_k), Mat::transposed(k, s_k), 0.0, a, chunk);
        // T = (I + A)^-1 by forward substitution: T_i = e_i - sum_{j < i} A[i][j] T_j (row i of
        // T is zero past the diagonal).
        for i in 0..c {
            for j in 0..i {
                a[i * chunk + j] *= beta[i] * exp(gamma[i] - gamma[j]);
            }
            let (done, rest) = t.split_at_mut(i * chunk);
            let row = &mut rest[..chunk];
            row.fill(0.0);
            row[i] = 1.0;
            for j in 0..i {
                axpy(&mut row[..i], -a[i * chunk + j], &done[j * chunk..j * chunk + i]);
            }
        }
        // U = T (beta V), W = T (beta exp(gamma) K).
        for i in 0..c {
            v[span(i, s_v)].iter_mut().for_each(|e| *e *= beta[i]);
            let wb = beta[i] * exp(gamma[i]);
            for (d, &kk) in kb[span(i, s_k)].iter_mut().zip(&k[span(i, s_k)]) {
                *d = wb * kk;
            }
        }
        gemm([c, c, s_v], 1.0, Mat::rows(t, chunk), Mat::rows(v, s_v), 0.0, u, s_v);
        gemm([c, c, s_k], 1.0, Mat::rows(t, chunk), Mat::rows(kb, s_k), 0.0, w, s_k);
        let (u, w) = (&mut u[..c * s_v], &w[..c * s_k]);
        let o_chunk = &mut o[start * s_v..(start + c) * s_v];
        let s_mat = Mat::transposed(st, s_k);
        // V_new = U - W S (in place of U).
        gemm([c, s_k, s_v], -1.0, Mat::rows(w, s_k), s_mat, 1.0, u, s_v);
        // O = exp(gamma) (Q S) + (Q K^T ⊙ Gamma) V_new, the mask including the diagonal.
        gemm([c, s_k, s_v], 1.0, Mat::rows(q, s_k), s_mat, 0.0, o_chunk, s_v);
        for i in 0..c {
            let e = exp(gamma[i]);
            o_chunk[span(i, s_v)].iter_mut().for_each(|x| *x *= e);
        }
        gemm([c, s_k, c], 1.0, Mat::rows(q, s_k), Mat::transposed(k, s_k), 0.0, qk, chunk);
        for i in 0..c {
            for j in 0..c {
                let x = &mut qk[i * chunk + j];
                *x = if j <= i { *x * exp(gamma[i] - gamma[j]) } else { 0.0 };
            }
        }
        gemm([c, c, s_v], 1.0, Mat::rows(qk, chunk), Mat::rows(u, s_v), 1.0, o_chunk, s_v);
        // S <- exp(gamma_last) S + (K exp(gamma_last - gamma))^T V_new; in S^T terms
        // S^T <- exp(gamma_last) S^T + (exp(gamma_last - gamma) V_new)^T K.
        let last = gamma[c - 1];
        for i in 0..c {
            let e = exp(last - gamma[i]);
            u[span(i, s_v)].iter_mut().for_each(|x| *x *= e);
        }
        gemm([s_v, c, s_k], 1.0, Mat::transposed(u, s_v), Mat::rows(k, s_k), exp(last), st, s_k);
        start += c;
    }
}
