//! flash_attn_ext on the CPU: online-softmax attention in f32.
//!
//! Work is split over (sequence, kv head, block of tokens, block of the kv head's query
//! heads); each task keeps its query rows, a running maximum `m`, a running sum `l` and an f32
//! accumulator per query row, and walks the kv positions in chunks of [`CHUNK`]. Per chunk it
//! computes the logits of every query row against the chunk's K rows (f32/f16/bf16 rows are read straight from their bytes by the SIMD
//! dot of [`super::sum`]), scales, softcaps and masks them, rescales the accumulator by
//! `exp(m_old - m_new)` when the maximum grows, and adds `exp(l_j - m) * v_j` (V rows decoded once
//! per chunk, shared by the task's rows). Query head `h` reads kv head `h / (n_head /
//! n_head_kv)`: a task holds heads of one group, which read the same K/V rows (GQA sharing). Head
//! blocks shrink only when there are too few tasks for the threads.
//!
//! A paged cache is read through the block table: logical position `j` of sequence `s` is cell
//! `table[j, s]`. The table is validated before anything is computed; the arithmetic does not
//! depend on where a row lives, so paged and contiguous K/V holding the same rows give bit-identical
//! results. A row whose every logit is `-inf` comes out as zeros (the reference's rule).
//!
//! Ragged batches (`params.ragged`) run the same tasks per sequence: a segment is one sequence's
//! run of packed tokens, and a row of token `i` of a sequence with `L` tokens and kv length `K`
//! sees positions `0 ..= K - L + i`: positions past that get logit `-inf` inside the chunk that
//! straddles them, and chunks past the task's last visible position are not visited. Since a
//! masked position changes nothing in the online softmax (weight 0, maximum unchanged), each row
//! gets exactly the bits of a dense call over that sequence alone with a causal mask. Offsets, kv
//! lengths and the table entries read are checked first (the reference's order).
//!
//! Results go to a scratch buffer laid out per task, then into the output's rows
//! (`[d_v, n_head, n_tokens, n_seq]`); rows of tokens of no sequence are zeros.

use std::ops::Range;

use tessera_ops::{FlashAttnParams, KernelError, checked_seq_offsets};

use super::math::{exp, map_in_place, zip_in_place};
use super::par;
use super::strided::{Dst, Src, decode, row_coords};
use super::sum::dot_rows;

const OP: &str = "flash_attn_ext";
/// Query rows (heads times tokens) a task aims for: they share every K/V row the task reads, and
/// their accumulators should stay in L1/L2.
const ROWS: usize = 32;
/// Kv positions per online-softmax step.
const CHUNK: usize = 64;
/// Multiply-adds (logits and weighted values) below which a call runs as one serial task.
const SPLIT_WORK: usize = 1 << 17;

/// Per-task scratch.
#[derive(Default)]
struct Scratch {
    /// The block's query rows, `d_k` each.
    q: Vec<f32>,
    /// Logits, then weights, of the current chunk: `CHUNK` per query row.
    s: Vec<f32>,
    /// One mask run of the current chunk.
    mask: Vec<f32>,
    /// One decoded V row.
    v: Vec<f32>,
    /// The portable dot's conversion buffer.
    dot: Vec<f32>,
    /// Running maximum and sum per query row.
    m: Vec<f32>,
    l: Vec<f32>,
}

/// The query rows of one sequence: packed tokens `tokens` of q's (and the output's) sequence
/// slot `qs`, reading row `s` of the table (or sequence `s` of k/v). Token `tokens.start + i`
/// sees positions `0..first_visible + i` when `causal`, else `0..first_visible`.
struct Segment {
    s: usize,
    qs: usize,
    tokens: Range<usize>,
    first_visible: usize,
    causal: bool,
    /// Where this segment's positions start in the cell list.
    cells_at: usize,
}

impl Segment {
    /// Positions the segment's last token sees (the most any of its rows reads).
    fn reads(&self) -> usize {
        self.first_visible + if self.causal { self.tokens.len() - 1 } else { 0 }
    }
}

/// The segments of a dense batch (one per sequence, all of q's tokens over all `n_kv`
/// positions) or of a ragged one (one per sequence with tokens; offsets and kv lengths checked
/// as the reference checks them).
fn segments(
    ragged: Option<(Src<'_>, Src<'_>)>,
    n_tokens: usize,
    n_seq: usize,
    n_kv: usize,
) -> Result<Vec<Segment>, KernelError> {
    let Some((offsets, kv_lens)) = ragged else {
        let seg = |s| Segment { s, qs: s, tokens: 0..n_tokens, first_visible: n_kv, causal: false, cells_at: 0 };
        return Ok((0..n_seq).map(seg).collect());
    };
    let n = offsets.ne()[0];
    let offsets = checked_seq_offsets(OP, (0..n).map(|i| i64::from(offsets.elem_i32([i, 0, 0, 0]))), n_tokens)?;
    let mut out = Vec::new();
    for (s, w) in offsets.windows(2).enumerate() {
        let len = w[1] - w[0];
        if len == 0 {
            continue; // no tokens: its kv length and table row are not read
        }
        let kv_len = i64::from(kv_lens.elem_i32([s, 0, 0, 0]));
        if kv_len < len as i64 || kv_len > n_kv as i64 {
            let (low, high) = (len as i64, n_kv as i64);
            return Err(KernelError::ValueOutOfRange { op: OP, what: "kv_lens", at: s, value: kv_len, low, high });
        }
        let first_visible = kv_len as usize - len + 1;
        out.push(Segment { s, qs: 0, tokens: w[0]..w[1], first_visible, causal: true, cells_at: 0 });
    }
    Ok(out)
}

/// The k/v row of every position each segment reads (`reads()` per segment, from `cells_at`),
/// checking the block table's entries against the cache's `n_cells` rows in (segment, position)
/// order.
fn cells(table: Option<Src<'_>>, n_rows: usize, segs: &mut [Segment]) -> Result<Vec<usize>, KernelError> {
    let mut out = Vec::with_capacity(segs.iter().map(Segment::reads).sum());
    for seg in segs {
        seg.cells_at = out.len();
        let Some(t) = &table else {
            out.extend(0..seg.reads());
            continue;
        };
        for j in 0..seg.reads() {
            let c = t.elem_i32([j, seg.s, 0, 0]);
            match usize::try_from(c) {
                Ok(c) if c < n_rows => out.push(c),
                _ => {
                    return Err(KernelError::IndexOutOfRange {
                        op: OP,
                        index: i64::from(c),
                        limit: n_rows,
                        what: "block table entry (k/v cell)",
                    });
                }
            }
        }
    }
    Ok(out)
}

/// A flash_attn_ext task's attention operands (`ragged`: `(seq_offsets, kv_lens)` of a ragged
/// batch); a gate, when the op has one, is applied by `fused::gated_attention`.
pub(super) struct Operands<'a> {
    pub q: Src<'a>,
    pub k: Src<'a>,
    pub v: Src<'a>,
    pub mask: Option<Src<'a>>,
    pub table: Option<Src<'a>>,
    pub ragged: Option<(Src<'a>, Src<'a>)>,
}

/// `out[:, h, t, s] = softmax_j(logit(q[:, t, h, s], k_j) + mask[j, t, 0, s]) . v_j` (see the
/// module doc and `Op::FlashAttnExt`).
pub(super) fn flash_attn_ext(p: &FlashAttnParams, x: Operands<'_>, dst: &mut Dst<'_>) -> Result<(), KernelError> {
    let Operands { q, k, v, mask, table, ragged } = x;
    let [d_k, n_tokens, n_head, q_seq] = q.ne();
    let (d_v, n_rows, n_head_kv) = (v.ne()[0], k.ne()[1], k.ne()[2]);
    if !k.dense_rows() || !v.dense_rows() {
        return Err(KernelError::Unsupported { op: OP, why: "k and v rows must be dense".into() });
    }
    let paged = table.is_some();
    let n_kv = table.as_ref().map_or(n_rows, |t| t.ne()[0]);
    let n_seq = ragged.as_ref().map_or(q_seq, |(o, _)| o.ne()[0] - 1);
    let mut segs = segments(ragged, n_tokens, n_seq, n_kv)?;
    let cells = cells(table, n_rows, &mut segs)?;
    let group = n_head / n_head_kv;
    let (scale, softcap) = (p.scale, p.softcap);
    let (k_stride, k_row) = (k.meta.nb[1], k.meta.row_bytes());

    // Task shape: `tb` tokens times `hb` heads of one kv group of one segment. Every query row's
    // arithmetic is the same whatever rows share its task, so the shape only trades K/V reuse
    // (more heads and tokens per task) against parallelism; it never changes the results.
    let tb = (ROWS / group).clamp(1, n_tokens);
    let t_blocks = |seg: &Segment| seg.tokens.len().div_ceil(tb);
    let base_tasks: usize = segs.iter().map(|seg| n_head_kv * t_blocks(seg)).sum();
    // One thread, or too little work to split (decode over a short cache: a handoff between
    // threads costs more than the task): one task per kv group, whose heads then share every K/V
    // row it reads.
    let work: usize = segs.iter().map(|seg| seg.reads() * seg.tokens.len()).sum::<usize>() * n_head * (d_k + d_v);
    let threads = if work < SPLIT_WORK { 1 } else { par::threads() };
    let splits = if threads <= 1 { 1 } else { (2 * threads).div_ceil(base_tasks.max(1)).clamp(1, group) };
    let hb = group.div_ceil(splits);
    let h_blocks = group.div_ceil(hb);
    let slot = tb * hb * d_v;
    // Each segment's first task, and the segment (and its first task) of each task.
    let mut seg_task = Vec::with_capacity(segs.len());
    let mut task_seg = Vec::with_capacity(base_tasks * h_blocks);
    for (i, seg) in segs.iter().enumerate() {
        seg_task.push(task_seg.len());
        let first = task_seg.len();
        task_seg.extend(std::iter::repeat_n((i, first), n_head_kv * t_blocks(seg) * h_blocks));
    }

    // Results per task slot: row (hj, tj) of task (segment, hk, t block, h block) at
    // `(hj * tb' + tj) * d_v`, where tb' is that block's token count.
    let mut tmp = vec![0f32; task_seg.len() * slot];
    let min_tasks = if threads <= 1 { usize::MAX } else { 1 };
    par::chunks_mut(&mut tmp, slot, min_tasks, Scratch::default, |sc, task, acc| {
        let (si, first) = task_seg[task];
        let seg = &segs[si];
        let local = task - first;
        let seg_t_blocks = t_blocks(seg);
        let hbi = local % h_blocks;
        let tbi = (local / h_blocks) % seg_t_blocks;
        let hk = local / (h_blocks * seg_t_blocks);
        let (s, qs) = (seg.s, seg.qs);
        let ks = if paged { 0 } else { s };
        let (t0, h0) = (seg.tokens.start + tbi * tb, hk * group + hbi * hb);
        let (tn, hn) = (tb.min(seg.tokens.end - t0), hb.min(group - hbi * hb));
        let rows = tn * hn;
        let acc = &mut acc[..rows * d_v];
        // query row i is (head h0 + i / tn, token t0 + i % tn); it sees positions 0..visible(i)
        let coords = |i: usize| (h0 + i / tn, t0 + i % tn);
        let visible = |i: usize| {
            if seg.causal { seg.first_visible + (t0 - seg.tokens.start) + i % tn } else { seg.first_visible }
        };
        let n_read = if seg.causal { visible(tn - 1) } else { seg.first_visible };
        let cells = &cells[seg.cells_at..seg.cells_at + n_read];
        sc.q.resize(rows * d_k, 0.0);
        for (i, qrow) in sc.q.chunks_exact_mut(d_k).enumerate() {
            let (h, t) = coords(i);
            q.load_row([t, h, qs], qrow);
        }
        sc.s.resize(rows * CHUNK, 0.0);
        sc.m.clear();
        sc.m.resize(rows, f32::NEG_INFINITY);
        sc.l.clear();
        sc.l.resize(rows, 0.0);
        for j0 in (0..n_read).step_by(CHUNK) {
            let cn = CHUNK.min(n_read - j0);
            let chunk_cells = &cells[j0..j0 + cn];
            // Raw dot products of the chunk, by runs of consecutive cells (rows `nb[1]` bytes
            // apart): one dot kernel call per run and query row, each value that of
            // `dot_weights` on the K row.
            let mut c = 0;
            while c < cn {
                let first = chunk_cells[c];
                let run = 1 + chunk_cells[c + 1..].iter().zip(first + 1..).take_while(|(a, b)| *a == b).count();
                let start = k.row_start([first, hk, ks]);
                let w = &k.bytes()[start..start + (run - 1) * k_stride + k_row];
                for (i, qrow) in sc.q.chunks_exact(d_k).enumerate() {
                    dot_rows(k.dtype(), w, k_stride, qrow, &mut sc.s[i * CHUNK + c..][..run], &mut sc.dot);
                }
                c += run;
            }
            // Logits, online-softmax update, weights.
            for i in 0..rows {
                let row = &mut sc.s[i * CHUNK..i * CHUNK + cn];
                if softcap > 0.0 {
                    let inner = scale / softcap;
                    row.iter_mut().for_each(|x| *x = softcap * (*x * inner).tanh());
                } else {
                    map_in_place(row, |x| x * scale);
                }
                if let Some(m) = &mask {
                    let start = m.row_start([coords(i).1, 0, qs % m.ne()[3]]) + j0 * m.meta.nb[0];
                    sc.mask.resize(cn, 0.0);
                    decode(m.dtype(), &m.bytes()[start..], m.meta.nb[0], &mut sc.mask);
                    zip_in_place(row, &sc.mask, |x, mv| x + mv);
                }
                // Causal: positions past the row's last visible one (ragged only).
                let seen = visible(i).saturating_sub(j0).min(cn);
                row[seen..].fill(f32::NEG_INFINITY);
                let chunk_max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let m_old = sc.m[i];
                let m_new = m_old.max(chunk_max);
                if m_new == f32::NEG_INFINITY {
                    row.fill(0.0); // everything masked so far
                    continue;
                }
                if m_old != m_new && m_old != f32::NEG_INFINITY {
                    let alpha = exp(m_old - m_new);
                    map_in_place(&mut acc[i * d_v..(i + 1) * d_v], |a| a * alpha);
                    sc.l[i] *= alpha;
                }
                sc.m[i] = m_new;
                map_in_place(row, |x| exp(x - m_new));
                sc.l[i] += row.iter().sum::<f32>();
            }
            // Weighted V rows, each decoded once for all the task's rows.
            for (c, &cell) in chunk_cells.iter().enumerate() {
                let vc = [cell, hk, ks];
                let vrow: &[f32] = match v.row_f32(vc) {
                    Some(r) => r,
                    None => {
                        sc.v.resize(d_v, 0.0);
                        v.load_row(vc, &mut sc.v);
                        &sc.v
                    }
                };
                for (i, a) in acc.chunks_exact_mut(d_v).enumerate() {
                    let w = sc.s[i * CHUNK + c];
                    if w != 0.0 {
                        zip_in_place(a, vrow, |a, x| a + w * x);
                    }
                }
            }
        }
        for (i, a) in acc.chunks_exact_mut(d_v).enumerate() {
            if sc.m[i] != f32::NEG_INFINITY {
                let l = sc.l[i];
                map_in_place(a, |x| x / l);
            }
        }
    });

    // The segment of each (q slot, token), if any.
    let mut owner = vec![usize::MAX; q_seq * n_tokens];
    for (i, seg) in segs.iter().enumerate() {
        owner[seg.qs * n_tokens + seg.tokens.start..seg.qs * n_tokens + seg.tokens.end].fill(i);
    }
    let ne = dst.ne();
    dst.for_each_row(d_v, Vec::new, |scratch, r, mut row| {
        let [h, t, qs] = row_coords(ne, r);
        let si = owner[qs * n_tokens + t];
        let Some(seg) = segs.get(si) else {
            row.fill_f32(scratch, |out| out.fill(0.0)); // a token of no sequence
            return;
        };
        let (hk, hi) = (h / group, h % group);
        let lt = t - seg.tokens.start;
        let (hbi, hj, tbi, tj) = (hi / hb, hi % hb, lt / tb, lt % tb);
        let tn = tb.min(seg.tokens.len() - tbi * tb);
        let task = seg_task[si] + (hk * t_blocks(seg) + tbi) * h_blocks + hbi;
        let start = task * slot + (hj * tn + tj) * d_v;
        row.fill_f32(scratch, |out| out.copy_from_slice(&tmp[start..start + d_v]));
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::cpu::testutil::{BF16, F16, F32, I32, check, check_error};
    use tessera_graph::{BackendError, ExecError};
    use tessera_ops::KernelError;

    #[test]
    fn matches_the_reference_across_dtypes_masks_and_views() {
        for kv in [F32, F16, BF16] {
            check(60, 1e-10, |g, l| {
                // q viewed as [d, n_tokens, n_head] from a [d, n_head, n_tokens] projection
                let q = l.random(g.input("q", F32, [40, 6, 11, 2])?);
                let q = g.permute(q, [0, 2, 1, 3])?;
                let k = l.random(g.input("k", kv, [40, 131, 3, 2])?);
                let v = l.random(g.input("v", kv, [24, 131, 3, 2])?);
                let mvals = (0..131 * 13 * 2)
                    .map(|i| if i % 5 == 2 && i % 131 != 0 { f64::NEG_INFINITY } else { (i % 7) as f64 * 0.1 })
                    .collect();
                let m = l.values(g.input("m", F16, [131, 13, 1, 2])?, mvals);
                Ok(vec![
                    g.flash_attn_ext(q, k, v, None, None, 0.2, 0.0)?,
                    g.flash_attn_ext(q, k, v, Some(m), None, 0.2, 0.0)?,
                    g.flash_attn_ext(q, k, v, Some(m), None, 0.7, 3.0)?,
                ])
            });
        }
    }

    #[test]
    fn paged_matches_the_reference() {
        check(61, 1e-10, |g, l| {
            let q = l.random(g.input("q", F32, [32, 3, 4, 3])?);
            let k = l.random(g.input("k", F16, [32, 200, 2, 1])?);
            let v = l.random(g.input("v", F16, [16, 200, 2, 1])?);
            let t = l.ids(g.input("t", I32, [150, 3, 1, 1])?, 200);
            let m = l.random(g.input("m", F32, [150, 3, 1, 3])?);
            Ok(vec![g.flash_attn_ext(q, k, v, Some(m), Some(t), 0.25, 0.0)?])
        });
    }

    #[test]
    fn out_of_range_table_entries_fail_like_the_reference() {
        for bad in [-1.0, 50.0] {
            let e = check_error(|g, l| {
                let q = l.random(g.input("q", F32, [8, 1, 2, 2])?);
                let k = l.random(g.input("k", F32, [8, 50, 1, 1])?);
                let v = l.random(g.input("v", F32, [8, 50, 1, 1])?);
                let t = l.values(g.input("t", I32, [3, 2, 1, 1])?, vec![0.0, 1.0, 2.0, 3.0, bad, 5.0]);
                Ok(vec![g.flash_attn_ext(q, k, v, None, Some(t), 1.0, 0.0)?])
            });
            let ExecError::Backend(BackendError::Kernel(KernelError::IndexOutOfRange { index, limit, .. })) = e else {
                panic!("unexpected error {e:?}")
            };
            assert_eq!((index, limit), (bad as i64, 50));
        }
    }
}
