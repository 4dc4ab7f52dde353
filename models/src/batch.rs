//! One model step's packed (ragged) token layout and its padding to a shape bucket.
//!
//! A step feeds any mix of sequences and token counts (decode tokens, prompt chunks) through one
//! graph. The tokens of every sequence are packed one after the other: sequence `s` owns the
//! tokens `seq_offsets[s] .. seq_offsets[s + 1]`, and the ops that mix tokens of one sequence
//! (`flash_attn_ext`, `gated_delta_net`, `ssm_conv_update_inplace`) read those offsets; every
//! other op treats the tokens as independent columns.
//!
//! The graph's shape is the step's bucket: the token and sequence counts rounded up by
//! [`bucket_len`] and the KV length rounded up to the model's `kv_pad`. Padding tokens belong to
//! no sequence (token 0 at position 0, K/V written to the cache's sink cell, outputs zero and never
//! read); padding sequences have no tokens, so they read and write no state. Two steps of one
//! bucket therefore share one planned graph (on a GPU one captured CUDA graph, replayed) whatever
//! their mix of lengths.

use std::ops::Range;

use crate::cache::{CacheError, PagedKvCache, RecurrentCache, SeqId};

/// The bucket of `n` tokens (or sequences): `n` rounded up to the next of 1, 2, 3, 4, 6, 8, 12,
/// 16, 24, 32, 48, 64 and beyond 64 to a multiple of 64. At most a third of a small bucket and
/// 63 tokens of a large one are padding, and a decode stream whose width drifts by one or two
/// stays in one bucket.
pub fn bucket_len(n: usize) -> usize {
    const SMALL: [usize; 12] = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64];
    match SMALL.iter().find(|&&b| b >= n) {
        Some(&b) => b,
        None => n.div_ceil(64) * 64,
    }
}

/// A step's host-side inputs in the packed layout, padded to its bucket.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct StepInputs {
    /// Token ids `[n_tokens]` (padding: 0).
    pub tokens: Vec<i32>,
    /// imrope positions `[4 * n_tokens]`, stream-major `(p, p, p, 0)` (padding: 0).
    pub positions: Vec<i32>,
    /// The cache row each token's K/V goes to `[n_tokens]` (padding: the sink cell).
    pub write_cells: Vec<i32>,
    /// `[n_kv, n_seq]`: logical position -> cell (padding sequences: cell 0, never read).
    pub block_table: Vec<i32>,
    /// `[n_seq + 1]`: sequence `s` owns tokens `seq_offsets[s] .. seq_offsets[s + 1]`.
    pub seq_offsets: Vec<i32>,
    /// `[n_seq]`: each sequence's KV length after this step (padding: 0).
    pub kv_lens: Vec<i32>,
    /// `[n_seq]`: recurrent state slots (padding: 0, never read: the sequence is empty).
    pub slots: Vec<i32>,
    /// `[n_seq]`: the row of each sequence's last token (padding: 0).
    pub last_rows: Vec<i32>,
    /// Bucket sizes: packed tokens, sequences, KV positions.
    pub n_tokens: usize,
    pub n_seq: usize,
    pub n_kv: usize,
}

impl StepInputs {
    /// Lays out `batch` (`(sequence, tokens, positions reserved for them)`, positions already
    /// reserved in `kv`) in a bucket of at least `min_tokens` tokens, `kv_pad` rounding the KV
    /// length.
    pub fn new(
        kv: &PagedKvCache,
        recurrent: &RecurrentCache,
        batch: &[(SeqId, &[u32], Range<usize>)],
        kv_pad: usize,
    ) -> Result<StepInputs, CacheError> {
        let real_tokens: usize = batch.iter().map(|b| b.1.len()).sum();
        let (n_tokens, n_seq) = (bucket_len(real_tokens), bucket_len(batch.len()));
        let ids: Vec<SeqId> = batch.iter().map(|b| b.0).collect();

        let mut tokens = Vec::with_capacity(n_tokens);
        let mut pos = Vec::with_capacity(n_tokens);
        let mut seq_offsets = Vec::with_capacity(n_seq + 1);
        let mut last_rows = Vec::with_capacity(n_seq);
        seq_offsets.push(0);
        for (_, toks, range) in batch {
            tokens.extend(toks.iter().map(|&t| t as i32));
            pos.extend(range.clone().map(|p| p as i32));
            seq_offsets.push(tokens.len() as i32);
            last_rows.push(tokens.len() as i32 - 1);
        }
        tokens.resize(n_tokens, 0);
        pos.resize(n_tokens, 0);
        seq_offsets.resize(n_seq + 1, real_tokens as i32);
        last_rows.resize(n_seq, 0);
        let mut positions = Vec::with_capacity(4 * n_tokens);
        for _ in 0..3 {
            positions.extend_from_slice(&pos);
        }
        positions.resize(4 * n_tokens, 0);

        let step: Vec<(SeqId, Range<usize>)> = batch.iter().map(|b| (b.0, b.2.clone())).collect();
        let mut write_cells = kv.write_cells(&step)?;
        write_cells.resize(n_tokens, kv.sink_cell());
        let n_kv = kv.padded_n_kv(&ids, kv_pad)?;
        let mut block_table = kv.block_table(&ids, n_kv)?;
        block_table.resize(n_kv * n_seq, 0);
        let mut kv_lens = ids.iter().map(|&id| Ok(kv.len(id)? as i32)).collect::<Result<Vec<i32>, CacheError>>()?;
        kv_lens.resize(n_seq, 0);
        let mut slots = recurrent.slots(&ids)?;
        slots.resize(n_seq, 0);
        Ok(StepInputs {
            tokens,
            positions,
            write_cells,
            block_table,
            seq_offsets,
            kv_lens,
            slots,
            last_rows,
            n_tokens,
            n_seq,
            n_kv,
        })
    }

    /// The packed rows of sequence `s` (of the batch it was built from).
    pub fn rows(&self, s: usize) -> Range<usize> {
        self.seq_offsets[s] as usize..self.seq_offsets[s + 1] as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::{KvCacheConfig, RecurrentConfig};

    #[test]
    fn buckets_round_up_and_keep_exact_sizes() {
        let got: Vec<usize> = (1..=13).map(bucket_len).collect();
        assert_eq!(got, [1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12, 16]);
        assert_eq!(bucket_len(64), 64);
        assert_eq!(bucket_len(65), 128);
        assert_eq!(bucket_len(300), 320);
        assert_eq!(bucket_len(512), 512);
        assert_eq!(bucket_len(2048), 2048);
        for n in 1..3000 {
            let b = bucket_len(n);
            assert!(b >= n && (b - n) * 3 <= b.max(3) || b - n < 64, "{n} -> {b}");
        }
    }

    #[test]
    fn a_mixed_batch_is_packed_and_padded() {
        // 1 attention layer, 1 kv head of 4 dims, 8 blocks of 4 cells.
        let cfg = KvCacheConfig { block_size: 4, ..KvCacheConfig::new(1, 1, 4, 4, 8) };
        let mut kv = PagedKvCache::new(cfg).unwrap();
        let mut rec = RecurrentCache::new(RecurrentConfig::new(1, (3, 4), (2, 2, 1), 6)).unwrap();
        for id in [10, 11, 12] {
            kv.add_sequence(id).unwrap();
            rec.add_sequence(id).unwrap();
        }
        kv.reserve(11, 6).unwrap(); // 11 already holds 6 tokens and decodes one
        let r = kv.reserve_many(&[(10, 3), (11, 1), (12, 1)]).unwrap();
        let (a, b, c) = ([5u32, 6, 7], [8u32], [9u32]);
        let batch = [(10, &a[..], r[0].clone()), (11, &b[..], r[1].clone()), (12, &c[..], r[2].clone())];
        let inp = StepInputs::new(&kv, &rec, &batch, 4).unwrap();
        assert_eq!((inp.n_tokens, inp.n_seq, inp.n_kv), (6, 3, 8));
        assert_eq!(inp.tokens, [5, 6, 7, 8, 9, 0]);
        assert_eq!(inp.seq_offsets, [0, 3, 4, 5]);
        assert_eq!(inp.kv_lens, [3, 7, 1]);
        assert_eq!(inp.last_rows, [2, 3, 4]);
        assert_eq!(&inp.positions[..6], [0, 1, 2, 6, 0, 0]);
        assert_eq!(&inp.positions[18..], [0; 6]);
        assert_eq!(inp.write_cells[5], kv.sink_cell());
        assert_eq!(inp.block_table.len(), 8 * 3);
        assert_eq!(inp.rows(1), 3..4);

        // Five decoding sequences pad to a bucket of 6: an empty sixth sequence and a padding
        // token whose K/V go to the sink.
        for id in [13, 14] {
            kv.add_sequence(id).unwrap();
            rec.add_sequence(id).unwrap();
        }
        let ids = [10, 11, 12, 13, 14];
        let r = kv.reserve_many(&ids.map(|id| (id, 1))).unwrap();
        let batch: Vec<(SeqId, &[u32], Range<usize>)> = ids.iter().zip(r).map(|(&id, r)| (id, &b[..], r)).collect();
        let inp = StepInputs::new(&kv, &rec, &batch, 4).unwrap();
        assert_eq!((inp.n_tokens, inp.n_seq, inp.n_kv), (6, 6, 8));
        assert_eq!(inp.seq_offsets, [0, 1, 2, 3, 4, 5, 5]);
        assert_eq!(inp.kv_lens, [4, 8, 2, 1, 1, 0]);
        assert_eq!(inp.slots[5], 0);
        assert_eq!(inp.write_cells[5], kv.sink_cell());
        assert!(inp.rows(5).is_empty());
    }
}
