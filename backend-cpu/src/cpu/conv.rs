//! ssm_conv and ssm_conv_update_inplace on the CPU: the causal depthwise convolution of the
//! gated-DeltaNet layers, `out[c, t, s] = sum_{i < d_conv} w[t + i, c, s] * kernel[i, c]`.
//!
//! The output is channel-innermost (`[channels, n_t, n_seq]`), so tasks split over output rows
//! `(t, s)`: each row is `d_conv` axpys over the channel vectors of its window (f32, taps in
//! index order, as ggml sums them). The kernel is transposed once into per-tap channel vectors,
//! and an input whose channel vectors are not dense (ssm_conv's `sx` is time-innermost; a
//! transposed `x`) is first transposed into channel-major f32 in cache-sized tiles, so no row
//! reads memory with a large stride. The update op then writes each sequence's new state back to its slot, in parallel over
//! (sequence, channel block); it runs after every output row is done, because the rows read the
//! old state. Slots are checked (in range, distinct) before anything is written. A ragged batch
//! (tokens of all sequences packed, `seq_offsets` saying whose) runs the same per sequence, each
//! output row finding its sequence in a token table; tokens of no sequence output 0.

use tessera_ops::{DType, KernelError};

use super::StateMut;
use super::delta_net::{Seq, sequences};
use super::math::silu;
use super::par;
use super::strided::{Dst, DstRow, Src, cast_f32, row_coords};

const UPDATE: &str = "ssm_conv_update_inplace";

/// Channels per state write-back task.
const STATE_BLOCK: usize = 512;

/// Rows of the channel-major copy one transpose task fills.
const TRANSPOSE_ROWS: usize = 16;

/// Per-task scratch: an output row that cannot be written in place, and one window vector.
#[derive(Default)]
struct Scratch {
    out: Vec<f32>,
    w: Vec<f32>,
}

/// `t` with dimensions 0 and 1 swapped (no copy): row `(j, s)` of the result is column `j` of
/// matrix `s` of `t`.
fn swap01<'a>(op: &'static str, t: Src<'a>) -> Result<Src<'a>, KernelError> {
    let meta = t.meta;
    let mut m = meta;
    m.ne.swap(0, 1);
    m.nb.swap(0, 1);
    Src::new(t.bytes(), m)
        .ok_or_else(|| KernelError::Unsupported { op, why: format!("cannot read {:?} transposed", meta.ne) })
}

/// The kernel `[d_conv, channels]` as `d_conv` f32 channel vectors, tap-major.
fn taps(op: &'static str, kernel: Src<'_>) -> Result<Vec<f32>, KernelError> {
    let [d_conv, channels, _, _] = kernel.ne();
    let cols = swap01(op, kernel)?;
    let mut taps = vec![0.0; d_conv * channels];
    for (i, tap) in taps.chunks_exact_mut(channels).enumerate() {
        cols.load_row([i, 0, 0], tap);
    }
    Ok(taps)
}

/// `acc[c] += w[c] * tap[c]`.
#[inline]
fn axpy(acc: &mut [f32], w: &[f32], tap: &[f32]) {
    for ((a, &x), &k) in acc.iter_mut().zip(w).zip(tap) {
        *a += x * k;
    }
}

/// Where one channel vector of a window is: row `at` of a tensor (dense or not), or a slice of a
/// channel-major copy.
#[derive(Clone, Copy)]
enum Vector<'a> {
    Row(&'a Src<'a>, [usize; 3]),
    Dense(&'a [f32]),
}

/// `a [n0, n1, n2]` (any float type and layout) as f32 with dimensions 0 and 1 swapped, dense:
/// `out[i1 + n1 * (i0 + n0 * i2)] = a[i0, i1, i2]`. Each task fills `TRANSPOSE_ROWS` rows of the
/// output from runs of `a`'s rows, so a time-innermost tensor is read along its rows.
fn channel_major(a: &Src<'_>) -> Vec<f32> {
    let [n0, n1, n2, _] = a.ne();
    let mut out = vec![0.0; n0 * n1 * n2];
    par::chunks_mut(
        &mut out,
        n0 * n1,
        1,
        || (),
        |_, i2, plane| {
            par::chunks_mut(plane, TRANSPOSE_ROWS * n1, 1, Vec::new, |run, b, block| {
                let j0 = b * TRANSPOSE_ROWS;
                let rows = block.len() / n1;
                run.resize(rows, 0.0);
                for i1 in 0..n1 {
                    a.gather_flat_f32(j0 + n0 * (i1 + n1 * i2), run);
                    for (d, &v) in run.iter().enumerate() {
                        block[d * n1 + i1] = v;
                    }
                }
            });
        },
    );
    out
}

/// Fills one output row of `channels` values: `acc = sum_i window(i) * taps[i]`, where
/// `window(i)` is the channel vector of window sample `i`; then SiLU if `act`.
fn conv_row<'a>(
    row: &mut DstRow<'_>,
    sc: &mut Scratch,
    taps: &[f32],
    channels: usize,
    act: bool,
    window: impl Fn(usize) -> Vector<'a>,
) {
    let Scratch { out, w } = sc;
    row.fill_f32(out, |acc| {
        acc.fill(0.0);
        for (i, tap) in taps.chunks_exact(channels).enumerate() {
            match window(i) {
                Vector::Dense(xs) => axpy(acc, xs, tap),
                Vector::Row(src, at) => match src.row_f32(at) {
                    Some(xs) => axpy(acc, xs, tap),
                    None => {
                        w.resize(channels, 0.0);
                        src.load_row(at, w);
                        axpy(acc, w, tap);
                    }
                },
            }
        }
        if act {
            acc.iter_mut().for_each(|v| *v = silu(*v));
        }
    });
}

/// `ssm_conv [sx, kernel]`: `sx [d_conv - 1 + n_t, channels, n_seq]` (any float type and
/// strides), `kernel [d_conv, channels]`; output f32 `[channels, n_t, n_seq]`.
pub(super) fn ssm_conv(sx: Src<'_>, kernel: Src<'_>, dst: &mut Dst<'_>) -> Result<(), KernelError> {
    const OP: &str = "ssm_conv";
    let ne = dst.ne();
    let channels = ne[0];
    let len = sx.ne()[0];
    let d_conv = kernel.ne()[0];
    let taps = taps(OP, kernel)?;
    // Row (j, s) of `cols` is sample j of every channel of sequence s; read it in place only
    // when its channels are dense (sx transposed from channel-innermost data).
    let cols = swap01(OP, sx)?;
    let copy = (!cols.dense_rows()).then(|| channel_major(&sx));
    dst.for_each_row(channels * d_conv, Scratch::default, |sc, r, mut row| {
        let [t, s, _] = row_coords(ne, r);
        conv_row(&mut row, sc, &taps, channels, false, |i| match &copy {
            Some(c) => Vector::Dense(&c[(t + i + len * s) * channels..][..channels]),
            None => Vector::Row(&cols, [t + i, s, 0]),
        });
    });
    Ok(())
}

/// `ssm_conv_update_inplace [x, state, kernel, slots]` (+ `offsets`, the ragged batch's
/// `seq_offsets`): for a sequence in slot `k` whose tokens are `x_s` (`x[:, :, s]`, or its token
/// range of `x[:, :, 0]` ragged), the window is `concat(state[:, :, k], x_s^T)`; its outputs are
/// the window's convolution (then SiLU if `act`), and `state[:, :, k]` becomes the window's last
/// `d_conv - 1` samples. Ragged tokens of no sequence output 0.
pub(super) fn ssm_conv_update(
    act: bool,
    x: Src<'_>,
    state: StateMut<'_>,
    kernel: Src<'_>,
    slots: Src<'_>,
    offsets: Option<Src<'_>>,
    dst: &mut Dst<'_>,
) -> Result<(), KernelError> {
    let ne = dst.ne();
    let [channels, n_t, n_seq, _] = ne;
    let d_conv = kernel.ne()[0];
    let keep = d_conv - 1;
    let n_slots = state.meta.ne[2];
    let slot_elems = keep * channels;
    let m = &state.meta;
    let fits = m.dtype == DType::F32 && m.ne == [keep, channels, n_slots, 1] && m.is_contiguous();
    if !fits || state.bytes.len() < n_slots * slot_elems * 4 {
        let why = format!("state must be contiguous f32 [{keep}, {channels}, n_slots, 1], got {:?}", state.meta);
        return Err(KernelError::Unsupported { op: UPDATE, why });
    }
    let seqs = sequences(UPDATE, offsets, slots, n_t, n_seq, n_slots)?;
    // Output row (t, s) belongs to the sequence in slot `k` whose first token is `start`:
    // owner[s * n_t + t] = Some((k, start)); None for ragged padding (zeros).
    let mut owner: Vec<Option<(usize, usize)>> = vec![None; n_t * n_seq];
    for seq in &seqs {
        for t in seq.tokens.clone() {
            owner[seq.outer * n_t + t] = Some((seq.slot, seq.tokens.start));
        }
    }
    // Outputs first: they read the old state. Row (j, k) of `cols` is sample j of every channel
    // of slot k.
    if !outputs_by_channel(act, &x, state.bytes, &kernel, &owner, dst) {
        let taps = taps(UPDATE, kernel)?;
        let cols = swap01(UPDATE, Src::new(state.bytes, state.meta).ok_or_else(state_too_small)?)?;
        // x's channel vectors are its rows; copy them dense first when they are strided.
        let copy = (!x.dense_rows()).then(|| swap01(UPDATE, x).map(|xt| channel_major(&xt))).transpose()?;
        dst.for_each_row(channels * d_conv, Scratch::default, |sc, r, mut row| {
            let [t, s, _] = row_coords(ne, r);
            let Some((k, start)) = owner[s * n_t + t] else {
                return row.fill_f32(&mut sc.out, |out| out.fill(0.0));
            };
            conv_row(&mut row, sc, &taps, channels, act, |i| match (t - start + i).checked_sub(keep) {
                None => Vector::Row(&cols, [t - start + i, k, 0]),
                Some(tt) => match &copy {
                    Some(c) => Vector::Dense(&c[(start + tt + n_t * s) * channels..][..channels]),
                    None => Vector::Row(&x, [start + tt, s, 0]),
                },
            });
        });
    }

    // Then each named slot keeps the last `keep` samples of its window.
    let mut by_slot: Vec<Option<&mut [u8]>> =
        state.bytes[..n_slots * slot_elems * 4].chunks_exact_mut(slot_elems * 4).map(Some).collect();
    let mut jobs = Vec::with_capacity(seqs.len());
    for seq in &seqs {
        jobs.push((seq, by_slot[seq.slot].take().ok_or_else(state_too_small)?));
    }
    par::chunks_mut(
        &mut jobs,
        1,
        1,
        || (),
        |_, _, job| {
            for (seq, slot) in job {
                par::chunks_mut(slot, STATE_BLOCK * keep * 4, 1, Vec::new, |xs, b, block| {
                    save_block(&x, seq, b * STATE_BLOCK, keep, block, xs);
                });
            }
        },
    );
    Ok(())
}

/// `f32` elements of `src` with element strides (0 for dimensions of extent 1, whose byte stride
/// may be anything), when it is f32, aligned, and every stride used a whole number of elements.
fn f32_elements<'a>(src: &Src<'a>) -> Option<(&'a [f32], [usize; 3])> {
    let (ne, nb) = (src.ne(), src.meta.nb);
    if src.dtype() != DType::F32 || (0..3).any(|d| ne[d] > 1 && nb[d] % 4 != 0) {
        return None;
    }
    let strides = std::array::from_fn(|d| if ne[d] > 1 { nb[d] / 4 } else { 0 });
    let bytes = src.bytes();
    Some((cast_f32(&bytes[..bytes.len() / 4 * 4])?, strides))
}

/// The outputs of ssm_conv_update_inplace channel by channel, reading the kernel, the old state
/// (`old`: the contiguous f32 `[keep, channels, n_slots]` state) and `x` where they lie, with no
/// transposed copies: the decode case, where the transposes cost more than the convolution.
/// Each value is `conv_row`'s sum in `conv_row`'s order (`0 + w_0 k_0 + w_1 k_1 + ...`, each term
/// a product then an add), then SiLU if `act`, so the bits are the same. `owner` is
/// `ssm_conv_update`'s (slot, first token) per output row. `false` (nothing written) when an
/// operand is not aligned f32 with whole-element strides.
fn outputs_by_channel(
    act: bool,
    x: &Src<'_>,
    old: &[u8],
    kernel: &Src<'_>,
    owner: &[Option<(usize, usize)>],
    dst: &mut Dst<'_>,
) -> bool {
    let ne = dst.ne();
    let n_t = ne[1];
    let [d_conv, channels, _, _] = kernel.ne();
    let keep = d_conv - 1;
    let (Some((kd, ks)), Some((xd, xs)), Some(st)) =
        (f32_elements(kernel), f32_elements(x), cast_f32(&old[..old.len() / 4 * 4]))
    else {
        return false;
    };
    dst.for_each_row(channels * d_conv, Vec::new, |scratch, r, mut row| {
        let [t, s, _] = row_coords(ne, r);
        let Some((k, start)) = owner[s * n_t + t] else {
            return row.fill_f32(scratch, |out| out.fill(0.0));
        };
        let tl = t - start;
        let old = &st[k * keep * channels..][..keep * channels];
        row.fill_f32(scratch, |out| {
            for (c, o) in out.iter_mut().enumerate() {
                let mut acc = 0.0f32;
                for i in 0..d_conv {
                    let w = match (tl + i).checked_sub(keep) {
                        None => old[c * keep + tl + i],
                        Some(tt) => xd[c * xs[0] + (start + tt) * xs[1] + s * xs[2]],
                    };
                    acc += w * kd[i * ks[0] + c * ks[1]];
                }
                *o = if act { silu(acc) } else { acc };
            }
        });
    });
    true
}

fn state_too_small() -> KernelError {
    KernelError::Unsupported { op: UPDATE, why: "the state buffer is smaller than its descriptor".into() }
}

/// Writes the new state of channels `c0 ..` of sequence `seq` into `block` (`keep` f32 per
/// channel, time innermost, maybe unaligned): with `L` the sequence's tokens, sample `j` becomes
/// window sample `L + j`, which is the old sample `L + j` while that is below `keep` (read before
/// it is overwritten: `j` ascends), and otherwise its token `L + j - keep`.
fn save_block(x: &Src<'_>, seq: &Seq, c0: usize, keep: usize, block: &mut [u8], xs: &mut Vec<f32>) {
    let [channels, n_t, _, _] = x.ne();
    let (len, s) = (seq.tokens.len(), seq.outer);
    let cb = block.len() / (keep * 4);
    // The last m tokens are the only ones kept; xs[(t - first) * cb + ci] = x[c0 + ci, t, s]
    // for the sequence's token t.
    let m = len.min(keep);
    let first = len - m;
    xs.resize(m * cb, 0.0);
    for (dt, seg) in xs.chunks_exact_mut(cb).enumerate() {
        x.gather_flat_f32(c0 + channels * (seq.tokens.start + first + dt + n_t * s), seg);
    }
    for (ci, ch) in block.chunks_exact_mut(keep * 4).enumerate() {
        for j in 0..keep {
            let from = len + j;
            let v = if from < keep {
                let mut b = [0u8; 4];
                b.copy_from_slice(&ch[from * 4..from * 4 + 4]);
                f32::from_le_bytes(b)
            } else {
                xs[(from - keep - first) * cb + ci]
            };
            ch[j * 4..j * 4 + 4].copy_from_slice(&v.to_le_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use tessera_graph::{ExecError, Graph, GraphError, Tensor};

    use crate::cpu::testutil::{BF16, F16, F32, I32, Leaves, check, check_error};

    /// `n` distinct slots out of `0..n_slots`, shuffled.
    fn slots(g: &mut Graph, l: &mut Leaves, n: usize, n_slots: usize) -> Result<Tensor, GraphError> {
        let mut all: Vec<usize> = (0..n_slots).collect();
        for i in (1..n_slots).rev() {
            all.swap(i, l.rng.below(i + 1));
        }
        let t = g.input("slots", I32, [n, 1, 1, 1])?;
        Ok(l.values(t, all[..n].iter().map(|&k| k as f64).collect()))
    }

    #[test]
    fn ssm_conv_of_each_dtype_and_layout() {
        for (seed, dt) in [(60, F32), (61, F16), (62, BF16)] {
            check(seed, 1e-12, |g, l| {
                let sx = l.random(g.input("sx", dt, [3 + 5, 67, 3, 1])?);
                let k = l.random(g.input("k", dt, [4, 67, 1, 1])?);
                Ok(vec![g.ssm_conv(sx, k)?])
            });
        }
        // sx transposed from [channels, time, n_seq] (channel-innermost, as x comes), kernel
        // transposed too; d_conv 1 and 2.
        check(63, 1e-12, |g, l| {
            let xt = l.random(g.input("xt", F32, [33, 9, 2, 1])?);
            let sx = g.permute(xt, [1, 0, 2, 3])?;
            let kt = l.random(g.input("kt", F32, [33, 4, 1, 1])?);
            let k = g.transpose(kt)?;
            let k1 = l.random(g.input("k1", F32, [1, 33, 1, 1])?);
            let k2 = l.random(g.input("k2", F16, [2, 33, 1, 1])?);
            Ok(vec![g.ssm_conv(sx, k)?, g.ssm_conv(sx, k1)?, g.ssm_conv(sx, k2)?])
        });
    }

    #[test]
    fn update_output_and_state_match_the_reference() {
        for (seed, dt, n_t, silu) in [(64, F32, 1, true), (65, BF16, 2, false), (66, F16, 5, true), (67, F32, 17, true)]
        {
            check(seed, 1e-12, |g, l| {
                let x = l.random(g.input("x", dt, [1029, n_t, 3, 1])?);
                let state = l.random(g.state("state", F32, [3, 1029, 5, 1])?);
                let k = l.random(g.input("k", dt, [4, 1029, 1, 1])?);
                let s = slots(g, l, 3, 5)?;
                let y = g.ssm_conv_update_inplace(x, state, k, s, silu)?;
                Ok(vec![y, state])
            });
        }
    }

    #[test]
    fn update_with_transposed_x_and_kernel() {
        check(68, 1e-12, |g, l| {
            let xt = l.random(g.input("xt", F32, [3, 40, 2, 1])?);
            let x = g.transpose(xt)?;
            let state = l.random(g.state("state", F32, [2, 40, 4, 1])?);
            let kt = l.random(g.input("kt", F32, [40, 3, 1, 1])?);
            let k = g.transpose(kt)?;
            let s = slots(g, l, 2, 4)?;
            let y = g.ssm_conv_update_inplace(x, state, k, s, true)?;
            Ok(vec![y, state])
        });
    }

    #[test]
    fn bad_slots_fail_like_the_reference() {
        for bad in [vec![0., 4.], vec![-1., 0.], vec![2., 2.]] {
            let e = check_error(|g, l| {
                let x = l.random(g.input("x", F32, [8, 1, 2, 1])?);
                let state = l.random(g.state("state", F32, [3, 8, 4, 1])?);
                let k = l.random(g.input("k", F32, [4, 8, 1, 1])?);
                let s = g.input("slots", I32, [2, 1, 1, 1])?;
                let s = l.values(s, bad.clone());
                Ok(vec![g.ssm_conv_update_inplace(x, state, k, s, true)?])
            });
            assert!(matches!(e, ExecError::Backend(_)), "{e}");
        }
    }
}
