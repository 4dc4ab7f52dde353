//! The paged KV cache: see [`PagedKvCache`].

use std::collections::BTreeMap;
use std::ops::Range;

use tessera_ops::DType;

use super::{CacheError, SeqId, SplitMix64, check_distinct, check_kv_dtype};

/// Which free block a growing sequence gets next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AllocPolicy {
    /// The lowest-numbered free block first: a fresh cache lays sequences out contiguously.
    InOrder,
    /// A seeded permutation of the free list; freed blocks go back at a random place. For tests
    /// that prove results do not depend on where the cells are (paged vs contiguous attention).
    Shuffled { seed: u64 },
}

/// The shape of a paged KV cache. Every count is in elements, tokens, cells or blocks as named.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvCacheConfig {
    /// Layers with a KV cache (the full-attention layers only).
    pub n_layers: usize,
    /// Key/value heads per layer.
    pub n_head_kv: usize,
    /// Elements per key head.
    pub head_dim_k: usize,
    /// Elements per value head.
    pub head_dim_v: usize,
    /// Cells (tokens) per block.
    pub block_size: usize,
    /// Blocks in the cache; `n_blocks * block_size` cells per layer in all.
    pub n_blocks: usize,
    /// Element type of the cache tensors: f16 (default), f32 or bf16.
    pub dtype: DType,
    /// Most tokens any one sequence may hold.
    pub max_context: usize,
    pub policy: AllocPolicy,
}

impl KvCacheConfig {
    /// A config with blocks of 16 cells, f16 storage, in-order allocation and a maximum context of
    /// the whole cache (`n_blocks * 16` tokens). Change fields with struct update syntax.
    pub fn new(n_layers: usize, n_head_kv: usize, head_dim_k: usize, head_dim_v: usize, n_blocks: usize) -> Self {
        let block_size = 16;
        KvCacheConfig {
            n_layers,
            n_head_kv,
            head_dim_k,
            head_dim_v,
            block_size,
            n_blocks,
            dtype: DType::F16,
            max_context: n_blocks.saturating_mul(block_size),
            policy: AllocPolicy::InOrder,
        }
    }

    /// Checks every field: counts positive, a supported dtype, cell ids that fit an i32, and byte
    /// sizes that fit a usize.
    pub fn validate(&self) -> Result<(), CacheError> {
        let bad = |why: String| Err(CacheError::BadConfig { why });
        for (name, v) in [
            ("n_layers", self.n_layers),
            ("n_head_kv", self.n_head_kv),
            ("head_dim_k", self.head_dim_k),
            ("head_dim_v", self.head_dim_v),
            ("block_size", self.block_size),
            ("n_blocks", self.n_blocks),
            ("max_context", self.max_context),
        ] {
            if v == 0 {
                return bad(format!("{name} must be positive"));
            }
        }
        check_kv_dtype(self.dtype)?;
        match self.n_blocks.checked_mul(self.block_size) {
            Some(n) if n <= i32::MAX as usize => {}
            _ => {
                return bad(format!(
                    "n_blocks * block_size = {} * {} cells must fit an i32 cell id",
                    self.n_blocks, self.block_size
                ));
            }
        }
        let total = (self.head_dim_k.checked_add(self.head_dim_v))
            .and_then(|d| d.checked_mul(self.n_head_kv))
            .and_then(|x| x.checked_mul(self.dtype.block_bytes()))
            .and_then(|x| x.checked_mul(self.n_blocks * self.block_size))
            .and_then(|x| x.checked_mul(self.n_layers));
        if total.is_none() {
            return bad("the cache's byte size overflows usize".into());
        }
        Ok(())
    }
}

/// A strided view of a cache tensor, ggml order: `ne` elements and `nb` byte strides per dim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvView {
    pub ne: [usize; 4],
    pub nb: [usize; 4],
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Seq {
    /// Physical blocks in logical order: block `i` holds positions `i * block_size ..`.
    blocks: Vec<u32>,
    /// Tokens held (logical positions `0..len`).
    len: usize,
}

/// Block bookkeeping of a paged KV cache: fixed-size blocks of cells, a free list, per-sequence
/// block lists.
///
/// # Layout
///
/// Each full-attention layer owns one K and one V tensor of `n_cells = n_blocks * block_size`
/// cells plus one **sink** cell ([`PagedKvCache::sink_cell`], the last row). A cell holds one
/// token's keys (or values) for every kv head, so the storage tensor is
/// `[head_dim * n_head_kv, n_cells + 1, 1, 1]` (ggml order, [`PagedKvCache::k_shape`]): row `c`
/// is cell `c`, which is what `set_rows` writes a step's new rows into (row ids from
/// [`PagedKvCache::write_cells`]). The padding tokens of a step bucket write their (ignored) K/V
/// to the sink, which no block table names. Paged `flash_attn_ext` reads the same bytes through the view
/// `[head_dim, n_cells, n_head_kv, 1]` given by [`PagedKvCache::k_view`] (dense rows of
/// `head_dim`, cell stride `head_dim * n_head_kv` elements, head stride `head_dim` elements).
///
/// # Invariants (checked by [`PagedKvCache::check_invariants`])
///
/// - Every block `0..n_blocks` is either on the free list or in exactly one sequence's block
///   list, never both, never twice.
/// - A sequence of `len` tokens holds exactly `ceil(len / block_size)` blocks, and
///   `len <= max_context`.
/// - Logical position `j` of a sequence lives in cell `blocks[j / block_size] * block_size +
///   j % block_size`, so no two live (sequence, position) pairs share a cell.
/// - With [`AllocPolicy::InOrder`] the free list hands out the lowest free block first.
///
/// `PartialEq` compares the whole state (free-list order and shuffle generator included), so a
/// test can assert that a failed call changed nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PagedKvCache {
    cfg: KvCacheConfig,
    /// Free blocks; allocation pops from the end. InOrder keeps it sorted descending.
    free: Vec<u32>,
    seqs: BTreeMap<SeqId, Seq>,
    /// Used only by [`AllocPolicy::Shuffled`].
    rng: SplitMix64,
}

impl PagedKvCache {
    /// An empty cache: every block free, no sequences.
    pub fn new(cfg: KvCacheConfig) -> Result<Self, CacheError> {
        cfg.validate()?;
        // validate() bounds n_blocks * block_size by i32::MAX, so block ids fit a u32.
        let mut free: Vec<u32> = (0..cfg.n_blocks as u32).rev().collect();
        let mut rng = SplitMix64::new(0);
        if let AllocPolicy::Shuffled { seed } = cfg.policy {
            rng = SplitMix64::new(seed);
            for i in (1..free.len()).rev() {
                let j = rng.below(i + 1);
                free.swap(i, j);
            }
        }
        Ok(PagedKvCache { cfg, free, seqs: BTreeMap::new(), rng })
    }

    pub fn config(&self) -> &KvCacheConfig {
        &self.cfg
    }

    /// Cells per layer: `n_blocks * block_size` (the sink not counted).
    pub fn n_cells(&self) -> usize {
        self.cfg.n_blocks * self.cfg.block_size
    }

    /// The cell padding tokens write to: the row after the last block's cells. It belongs to no
    /// sequence and no block table names it, so what is written there is never read.
    pub fn sink_cell(&self) -> i32 {
        // n_cells < i32::MAX (validated), so the sink fits an i32.
        self.n_cells() as i32
    }

    /// Blocks on the free list.
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Blocks held by sequences.
    pub fn used_blocks(&self) -> usize {
        self.cfg.n_blocks - self.free.len()
    }

    /// Live sequences.
    pub fn n_sequences(&self) -> usize {
        self.seqs.len()
    }

    pub fn contains(&self, id: SeqId) -> bool {
        self.seqs.contains_key(&id)
    }

    /// Live sequence ids, ascending.
    pub fn sequence_ids(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.seqs.keys().copied()
    }

    /// Blocks needed to hold `len` tokens.
    pub fn blocks_for_len(&self, len: usize) -> usize {
        len.div_ceil(self.cfg.block_size)
    }

    fn seq(&self, id: SeqId) -> Result<&Seq, CacheError> {
        self.seqs.get(&id).ok_or(CacheError::UnknownSequence { id })
    }

    /// Adds an empty sequence (no blocks until [`reserve`](Self::reserve)).
    pub fn add_sequence(&mut self, id: SeqId) -> Result<(), CacheError> {
        if self.seqs.contains_key(&id) {
            return Err(CacheError::DuplicateSequence { id });
        }
        self.seqs.insert(id, Seq { blocks: Vec::new(), len: 0 });
        Ok(())
    }

    /// Tokens held by sequence `id`.
    pub fn len(&self, id: SeqId) -> Result<usize, CacheError> {
        Ok(self.seq(id)?.len)
    }

    /// The physical blocks of sequence `id`, in logical order.
    pub fn blocks(&self, id: SeqId) -> Result<&[u32], CacheError> {
        Ok(&self.seq(id)?.blocks)
    }

    /// Blocks that growing `id` by `n` tokens would take from the free list.
    fn plan(&self, id: SeqId, n: usize) -> Result<(usize, usize), CacheError> {
        let s = self.seq(id)?;
        let new_len = s.len.saturating_add(n);
        if new_len > self.cfg.max_context {
            return Err(CacheError::ContextTooLong { id, len: new_len, max: self.cfg.max_context });
        }
        Ok((new_len, self.blocks_for_len(new_len) - s.blocks.len()))
    }

    fn take_block(&mut self) -> u32 {
        // Callers check free.len() first.
        self.free.pop().expect("free list checked before allocation")
    }

    fn release_block(&mut self, block: u32) {
        match self.cfg.policy {
            AllocPolicy::InOrder => {
                let at = self.free.partition_point(|&b| b > block);
                self.free.insert(at, block);
            }
            AllocPolicy::Shuffled { .. } => {
                self.free.push(block);
                let last = self.free.len() - 1;
                let j = self.rng.below(self.free.len());
                self.free.swap(last, j);
            }
        }
    }

    /// Extends sequence `id` by `n` tokens, taking blocks from the free list as needed, and returns
    /// the logical positions of the new tokens (`old_len..old_len + n`). All or nothing: on
    /// [`CacheError::OutOfBlocks`] or [`CacheError::ContextTooLong`] the cache is unchanged.
    pub fn reserve(&mut self, id: SeqId, n: usize) -> Result<Range<usize>, CacheError> {
        let (new_len, needed) = self.plan(id, n)?;
        if needed > self.free.len() {
            return Err(CacheError::OutOfBlocks { needed, free: self.free.len() });
        }
        let new: Vec<u32> = (0..needed).map(|_| self.take_block()).collect();
        let s = self.seqs.get_mut(&id).ok_or(CacheError::UnknownSequence { id })?;
        let old_len = s.len;
        s.blocks.extend(new);
        s.len = new_len;
        Ok(old_len..new_len)
    }

    /// [`reserve`](Self::reserve) for several distinct sequences at once, all or nothing: if any
    /// request fails (unknown id, context too long, not enough blocks for all of them together),
    /// the cache is unchanged. Returns each sequence's new positions, in request order.
    pub fn reserve_many(&mut self, requests: &[(SeqId, usize)]) -> Result<Vec<Range<usize>>, CacheError> {
        check_distinct(&requests.iter().map(|r| r.0).collect::<Vec<_>>())?;
        let mut needed = 0usize;
        for &(id, n) in requests {
            needed = needed.saturating_add(self.plan(id, n)?.1);
        }
        if needed > self.free.len() {
            return Err(CacheError::OutOfBlocks { needed, free: self.free.len() });
        }
        requests.iter().map(|&(id, n)| self.reserve(id, n)).collect()
    }

    /// Shortens sequence `id` to `new_len` tokens (rolling back a step or a draft), returning the
    /// blocks no longer needed to the free list. Returns how many blocks were freed.
    pub fn truncate(&mut self, id: SeqId, new_len: usize) -> Result<usize, CacheError> {
        let keep = self.blocks_for_len(new_len);
        let s = self.seqs.get_mut(&id).ok_or(CacheError::UnknownSequence { id })?;
        if new_len > s.len {
            return Err(CacheError::PositionOutOfRange { id, start: s.len, end: new_len, len: s.len });
        }
        let dropped = s.blocks.split_off(keep);
        s.len = new_len;
        let n = dropped.len();
        for b in dropped.into_iter().rev() {
            self.release_block(b);
        }
        Ok(n)
    }

    /// Removes sequence `id`, returning all its blocks to the free list. Returns how many.
    pub fn remove_sequence(&mut self, id: SeqId) -> Result<usize, CacheError> {
        let s = self.seqs.remove(&id).ok_or(CacheError::UnknownSequence { id })?;
        let n = s.blocks.len();
        for b in s.blocks.into_iter().rev() {
            self.release_block(b);
        }
        Ok(n)
    }

    /// The physical cell of logical position `pos` (`< len`) of sequence `id`.
    pub fn cell(&self, id: SeqId, pos: usize) -> Result<i32, CacheError> {
        let s = self.seq(id)?;
        if pos >= s.len {
            return Err(CacheError::PositionOutOfRange { id, start: pos, end: pos + 1, len: s.len });
        }
        Ok(self.cell_unchecked(s, pos))
    }

    /// `blocks[pos / block_size] * block_size + pos % block_size`; `pos < len` is the caller's.
    fn cell_unchecked(&self, s: &Seq, pos: usize) -> i32 {
        let bs = self.cfg.block_size;
        // Cell ids are below n_cells <= i32::MAX (validated), so the cast is exact.
        (s.blocks[pos / bs] as usize * bs + pos % bs) as i32
    }

    /// The physical cells of logical positions `range` (inside `0..len`) of sequence `id`.
    pub fn cells_for(&self, id: SeqId, range: Range<usize>) -> Result<Vec<i32>, CacheError> {
        let s = self.seq(id)?;
        if range.start > range.end || range.end > s.len {
            return Err(CacheError::PositionOutOfRange { id, start: range.start, end: range.end, len: s.len });
        }
        Ok(range.map(|p| self.cell_unchecked(s, p)).collect())
    }

    /// The `set_rows` row ids of one step: the cells of each `(sequence, positions)` pair,
    /// concatenated in request order (the order of the step's new K/V rows). Row `r` of the
    /// step's `[head_dim * n_head_kv, n_tokens]` K (or V) goes to cache row `result[r]`.
    pub fn write_cells(&self, step: &[(SeqId, Range<usize>)]) -> Result<Vec<i32>, CacheError> {
        let mut out = Vec::with_capacity(step.iter().map(|(_, r)| r.len()).sum());
        for (id, r) in step {
            out.extend(self.cells_for(*id, r.clone())?);
        }
        Ok(out)
    }

    /// The longest of the given sequences: the smallest `n_kv` a block table for them can have.
    pub fn max_len(&self, ids: &[SeqId]) -> Result<usize, CacheError> {
        ids.iter().try_fold(0, |m, &id| Ok(m.max(self.len(id)?)))
    }

    /// [`max_len`](Self::max_len) rounded up to a multiple of `multiple` (at least `multiple`
    /// when `multiple > 0`), so consecutive decode steps keep one table shape (for CUDA graph
    /// reuse). `multiple = 0` is treated as 1.
    pub fn padded_n_kv(&self, ids: &[SeqId], multiple: usize) -> Result<usize, CacheError> {
        let m = multiple.max(1);
        Ok(self.max_len(ids)?.max(1).div_ceil(m) * m)
    }

    /// The block table of paged `flash_attn_ext`: i32 `[n_kv, n_seq]` (ggml order, so entry
    /// `(j, s)` is at index `s * n_kv + j`), naming the physical cell of logical position `j` of
    /// sequence `ids[s]`.
    ///
    /// Positions `j >= len` of a sequence are padding: they name a valid cell (the sequence's last
    /// cell, or cell 0 for an empty sequence) so the kernel stays in bounds, but hold nothing of
    /// that sequence at that position. **The attention mask must hide them** (`-inf` at
    /// `j >= len`, and the causal part for the step's own tokens). `n_kv` must be at least every
    /// sequence's length; ids must be distinct.
    pub fn block_table(&self, ids: &[SeqId], n_kv: usize) -> Result<Vec<i32>, CacheError> {
        check_distinct(ids)?;
        let mut out = Vec::with_capacity(n_kv * ids.len());
        for &id in ids {
            let s = self.seq(id)?;
            if s.len > n_kv {
                return Err(CacheError::TableTooShort { id, len: s.len, n_kv });
            }
            out.extend((0..s.len).map(|p| self.cell_unchecked(s, p)));
            let pad = if s.len == 0 { 0 } else { self.cell_unchecked(s, s.len - 1) };
            out.resize(out.len() + (n_kv - s.len), pad);
        }
        Ok(out)
    }

    /// The f32 attention mask of one step, `[n_kv, n_tokens, 1, n_seq]` (ggml order: entry
    /// `(j, t, s)` at index `(s * n_tokens + t) * n_kv + j`), for paged `flash_attn_ext` with the
    /// table from [`block_table`](Self::block_table) over the same sequences in the same order.
    ///
    /// `step[s] = (id, positions)` names the positions (already [`reserve`](Self::reserve)d) of
    /// the step's tokens of sequence `s`; token `t < positions.len()` sits at position
    /// `positions.start + t` and sees kv positions `j <= positions.start + t` (0.0), everything
    /// else is `-inf`: later tokens (causality), the table's padding, and every position of the
    /// padding rows `t >= positions.len()` (a row of `-inf` gives zeros). Needs
    /// `positions.len() <= n_tokens` and `positions.end <= min(len, n_kv)`.
    pub fn causal_mask(
        &self,
        step: &[(SeqId, Range<usize>)],
        n_kv: usize,
        n_tokens: usize,
    ) -> Result<Vec<f32>, CacheError> {
        check_distinct(&step.iter().map(|r| r.0).collect::<Vec<_>>())?;
        let mut out = vec![f32::NEG_INFINITY; n_kv * n_tokens * step.len()];
        for (s, (id, r)) in step.iter().enumerate() {
            let len = self.len(*id)?;
            if r.start > r.end || r.end > len {
                return Err(CacheError::PositionOutOfRange { id: *id, start: r.start, end: r.end, len });
            }
            if r.end > n_kv {
                return Err(CacheError::TableTooShort { id: *id, len: r.end, n_kv });
            }
            if r.len() > n_tokens {
                return Err(CacheError::PositionOutOfRange { id: *id, start: r.start, end: r.end, len: n_tokens });
            }
            for t in 0..r.len() {
                let row = (s * n_tokens + t) * n_kv;
                out[row..=row + r.start + t].fill(0.0);
            }
        }
        Ok(out)
    }

    /// Element size of the cache dtype in bytes.
    fn elt(&self) -> usize {
        self.cfg.dtype.block_bytes()
    }

    /// Storage shape of one layer's K tensor, ggml order: `[head_dim_k * n_head_kv, n_cells + 1,
    /// 1, 1]` (one row per cell and the sink; the `set_rows` target).
    pub fn k_shape(&self) -> [usize; 4] {
        [self.cfg.head_dim_k * self.cfg.n_head_kv, self.n_cells() + 1, 1, 1]
    }

    /// Storage shape of one layer's V tensor: `[head_dim_v * n_head_kv, n_cells + 1, 1, 1]`.
    pub fn v_shape(&self) -> [usize; 4] {
        [self.cfg.head_dim_v * self.cfg.n_head_kv, self.n_cells() + 1, 1, 1]
    }

    fn attn_view(&self, d: usize) -> KvView {
        let (e, h, c) = (self.elt(), self.cfg.n_head_kv, self.n_cells());
        KvView { ne: [d, c, h, 1], nb: [e, d * h * e, d * e, d * h * c * e] }
    }

    /// The view of the K storage that paged `flash_attn_ext` reads: `[head_dim_k, n_cells,
    /// n_head_kv, 1]` with byte strides `[e, head_dim_k * n_head_kv * e, head_dim_k * e, ..]`
    /// (`e` the element size), offset 0.
    pub fn k_view(&self) -> KvView {
        self.attn_view(self.cfg.head_dim_k)
    }

    /// The V counterpart of [`k_view`](Self::k_view).
    pub fn v_view(&self) -> KvView {
        self.attn_view(self.cfg.head_dim_v)
    }

    /// Bytes of K and V for one token over all layers:
    /// `n_layers * n_head_kv * (head_dim_k + head_dim_v) * element size`.
    pub fn bytes_per_token(&self) -> usize {
        self.cfg.n_layers * self.cfg.n_head_kv * (self.cfg.head_dim_k + self.cfg.head_dim_v) * self.elt()
    }

    /// Bytes of one layer's K plus V tensors (the sink included).
    pub fn bytes_per_layer(&self) -> usize {
        self.bytes_per_token() / self.cfg.n_layers * (self.n_cells() + 1)
    }

    /// Bytes of every cache tensor: `bytes_per_token * (n_cells + 1)`.
    pub fn total_bytes(&self) -> usize {
        self.bytes_per_token() * (self.n_cells() + 1)
    }

    /// Checks the [invariants](Self); `Err(CacheError::Invariant)` names the first broken
    /// one. For tests and debug assertions; O(n_blocks + total blocks held).
    pub fn check_invariants(&self) -> Result<(), CacheError> {
        let broken = |why: String| Err(CacheError::Invariant { why });
        let mut owner: Vec<Option<Option<SeqId>>> = vec![None; self.cfg.n_blocks];
        let mut claim = |b: u32, who: Option<SeqId>| -> Result<(), CacheError> {
            let Some(slot) = owner.get_mut(b as usize) else {
                return broken(format!("block {b} is out of range 0..{}", self.cfg.n_blocks));
            };
            if let Some(prev) = slot {
                return broken(format!("block {b} is held twice: by {prev:?} and by {who:?} (None = free list)"));
            }
            *slot = Some(who);
            Ok(())
        };
        for &b in &self.free {
            claim(b, None)?;
        }
        for (&id, s) in &self.seqs {
            if s.len > self.cfg.max_context {
                return broken(format!("sequence {id} holds {} > max_context {}", s.len, self.cfg.max_context));
            }
            if s.blocks.len() != self.blocks_for_len(s.len) {
                return broken(format!("sequence {id} of length {} holds {} blocks", s.len, s.blocks.len()));
            }
            for &b in &s.blocks {
                claim(b, Some(id))?;
            }
        }
        if let Some(b) = owner.iter().position(Option::is_none) {
            return broken(format!("block {b} is neither free nor held"));
        }
        if self.cfg.policy == AllocPolicy::InOrder && !self.free.is_sorted_by(|a, b| a > b) {
            return broken("the in-order free list is not sorted".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(block_size: usize, n_blocks: usize) -> KvCacheConfig {
        KvCacheConfig { block_size, ..KvCacheConfig::new(2, 2, 8, 4, n_blocks) }
    }

    #[test]
    fn config_validation() {
        assert!(PagedKvCache::new(cfg(4, 4)).is_ok());
        for bad in [
            KvCacheConfig { n_layers: 0, ..cfg(4, 4) },
            KvCacheConfig { block_size: 0, ..cfg(4, 4) },
            KvCacheConfig { n_blocks: 0, ..cfg(4, 4) },
            KvCacheConfig { max_context: 0, ..cfg(4, 4) },
            KvCacheConfig { dtype: DType::Q8_0, ..cfg(4, 4) },
            KvCacheConfig { dtype: DType::I32, ..cfg(4, 4) },
            KvCacheConfig { n_blocks: 1 << 28, block_size: 16, ..cfg(4, 4) },
        ] {
            assert!(matches!(PagedKvCache::new(bad), Err(CacheError::BadConfig { .. })), "{bad:?}");
        }
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            assert!(PagedKvCache::new(KvCacheConfig { dtype, ..cfg(4, 4) }).is_ok());
        }
    }

    #[test]
    fn shapes_and_bytes() {
        let kv = PagedKvCache::new(cfg(4, 3)).unwrap();
        assert_eq!(kv.n_cells(), 12);
        assert_eq!(kv.k_shape(), [16, 13, 1, 1]);
        assert_eq!(kv.v_shape(), [8, 13, 1, 1]);
        assert_eq!(kv.sink_cell(), 12);
        assert_eq!(kv.k_view(), KvView { ne: [8, 12, 2, 1], nb: [2, 32, 16, 384] });
        assert_eq!(kv.v_view(), KvView { ne: [4, 12, 2, 1], nb: [2, 16, 8, 192] });
        // 2 layers * 2 heads * (8 + 4) dims * 2 bytes.
        assert_eq!(kv.bytes_per_token(), 96);
        assert_eq!(kv.bytes_per_layer(), 48 * 13);
        assert_eq!(kv.total_bytes(), 96 * 13);
        let f32 = PagedKvCache::new(KvCacheConfig { dtype: DType::F32, ..cfg(4, 3) }).unwrap();
        assert_eq!(f32.bytes_per_token(), 192);
    }

    #[test]
    fn allocate_extend_remove() {
        let mut kv = PagedKvCache::new(cfg(4, 4)).unwrap();
        kv.add_sequence(1).unwrap();
        kv.add_sequence(2).unwrap();
        assert_eq!(kv.add_sequence(1), Err(CacheError::DuplicateSequence { id: 1 }));
        assert_eq!(kv.reserve(1, 5).unwrap(), 0..5);
        assert_eq!(kv.blocks(1).unwrap(), &[0, 1]);
        assert_eq!(kv.reserve(2, 2).unwrap(), 0..2);
        assert_eq!(kv.blocks(2).unwrap(), &[2]);
        assert_eq!(kv.reserve(1, 3).unwrap(), 5..8); // fills block 1, no new block
        assert_eq!(kv.blocks(1).unwrap(), &[0, 1]);
        assert_eq!(kv.cells_for(1, 3..6).unwrap(), vec![3, 4, 5]);
        assert_eq!(kv.cells_for(2, 0..2).unwrap(), vec![8, 9]);
        assert_eq!(kv.write_cells(&[(1, 7..8), (2, 0..2)]).unwrap(), vec![7, 8, 9]);
        assert_eq!(kv.block_table(&[2, 1], 8).unwrap(), vec![8, 9, 9, 9, 9, 9, 9, 9, 0, 1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(kv.remove_sequence(1).unwrap(), 2);
        assert_eq!(kv.free_blocks(), 3);
        // Lowest free block first.
        kv.add_sequence(3).unwrap();
        kv.reserve(3, 1).unwrap();
        assert_eq!(kv.blocks(3).unwrap(), &[0]);
        kv.check_invariants().unwrap();
        assert_eq!(kv.remove_sequence(1), Err(CacheError::UnknownSequence { id: 1 }));
    }

    #[test]
    fn failing_reserve_changes_nothing() {
        let mut kv = PagedKvCache::new(KvCacheConfig { max_context: 12, ..cfg(4, 4) }).unwrap();
        kv.add_sequence(1).unwrap();
        kv.add_sequence(2).unwrap();
        kv.reserve(1, 9).unwrap();
        let before = (kv.free.clone(), kv.seqs.clone());
        assert_eq!(kv.reserve(2, 5), Err(CacheError::OutOfBlocks { needed: 2, free: 1 }));
        assert_eq!(kv.reserve(1, 4), Err(CacheError::ContextTooLong { id: 1, len: 13, max: 12 }));
        assert_eq!(kv.reserve(1, usize::MAX), Err(CacheError::ContextTooLong { id: 1, len: usize::MAX, max: 12 }));
        assert_eq!(kv.reserve(9, 1), Err(CacheError::UnknownSequence { id: 9 }));
        assert_eq!(kv.reserve_many(&[(1, 3), (2, 5)]), Err(CacheError::OutOfBlocks { needed: 2, free: 1 }));
        assert_eq!(kv.reserve_many(&[(2, 1), (2, 1)]), Err(CacheError::RepeatedSequence { id: 2 }));
        assert_eq!((kv.free.clone(), kv.seqs.clone()), before);
        assert_eq!(kv.reserve_many(&[(2, 4), (1, 3)]).unwrap(), vec![0..4, 9..12]);
        assert_eq!(kv.free_blocks(), 0);
        kv.check_invariants().unwrap();
    }

    #[test]
    fn truncate_returns_blocks() {
        let mut kv = PagedKvCache::new(cfg(4, 4)).unwrap();
        kv.add_sequence(1).unwrap();
        kv.reserve(1, 10).unwrap();
        assert_eq!(kv.truncate(1, 5).unwrap(), 1);
        assert_eq!(kv.len(1).unwrap(), 5);
        assert_eq!(kv.truncate(1, 5).unwrap(), 0);
        assert!(matches!(kv.truncate(1, 6), Err(CacheError::PositionOutOfRange { .. })));
        assert_eq!(kv.truncate(1, 0).unwrap(), 2);
        assert_eq!(kv.free_blocks(), 4);
        kv.check_invariants().unwrap();
    }

    #[test]
    fn table_and_range_errors() {
        let mut kv = PagedKvCache::new(cfg(4, 4)).unwrap();
        kv.add_sequence(1).unwrap();
        kv.add_sequence(2).unwrap();
        kv.reserve(1, 6).unwrap();
        assert_eq!(kv.block_table(&[1], 5), Err(CacheError::TableTooShort { id: 1, len: 6, n_kv: 5 }));
        assert_eq!(kv.block_table(&[1, 1], 8), Err(CacheError::RepeatedSequence { id: 1 }));
        assert_eq!(kv.block_table(&[2], 2).unwrap(), vec![0, 0]);
        assert!(matches!(kv.cells_for(1, 4..7), Err(CacheError::PositionOutOfRange { .. })));
        assert!(matches!(kv.cell(1, 6), Err(CacheError::PositionOutOfRange { .. })));
        assert_eq!(kv.cell(1, 5).unwrap(), 5);
        assert_eq!(kv.max_len(&[1, 2]).unwrap(), 6);
        assert_eq!(kv.padded_n_kv(&[1, 2], 4).unwrap(), 8);
        assert_eq!(kv.padded_n_kv(&[2], 4).unwrap(), 4);
        assert_eq!(kv.padded_n_kv(&[1], 0).unwrap(), 6);
    }

    #[test]
    fn causal_mask_hides_future_and_padding() {
        let mut kv = PagedKvCache::new(cfg(4, 4)).unwrap();
        kv.add_sequence(1).unwrap();
        kv.add_sequence(2).unwrap();
        kv.reserve(1, 2).unwrap();
        let (a, b) = (kv.reserve(1, 2).unwrap(), kv.reserve(2, 1).unwrap());
        let (i, z) = (f32::NEG_INFINITY, 0.0);
        let m = kv.causal_mask(&[(1, a.clone()), (2, b.clone())], 5, 2).unwrap();
        #[rustfmt::skip]
        let want = vec![
            z, z, z, i, i, // seq 1, token at position 2
            z, z, z, z, i, // seq 1, token at position 3
            z, i, i, i, i, // seq 2, token at position 0
            i, i, i, i, i, // seq 2, padding row
        ];
        assert_eq!(m, want);
        assert!(matches!(kv.causal_mask(&[(1, a.clone())], 3, 2), Err(CacheError::TableTooShort { .. })));
        assert!(matches!(kv.causal_mask(&[(1, a)], 5, 1), Err(CacheError::PositionOutOfRange { .. })));
        assert!(matches!(kv.causal_mask(&[(2, 0..2)], 5, 2), Err(CacheError::PositionOutOfRange { .. })));
        assert_eq!(kv.causal_mask(&[(2, b.clone()), (2, b)], 5, 2), Err(CacheError::RepeatedSequence { id: 2 }));
    }

    #[test]
    fn shuffled_policy_is_a_seeded_permutation() {
        let a = PagedKvCache::new(KvCacheConfig { policy: AllocPolicy::Shuffled { seed: 5 }, ..cfg(2, 32) }).unwrap();
        let b = PagedKvCache::new(KvCacheConfig { policy: AllocPolicy::Shuffled { seed: 5 }, ..cfg(2, 32) }).unwrap();
        let c = PagedKvCache::new(KvCacheConfig { policy: AllocPolicy::Shuffled { seed: 6 }, ..cfg(2, 32) }).unwrap();
        assert_eq!(a.free, b.free);
        assert_ne!(a.free, c.free);
        let mut sorted = a.free.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..32).collect::<Vec<u32>>());
        a.check_invariants().unwrap();
    }
}
