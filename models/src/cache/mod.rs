//! # Cache bookkeeping for the hybrid Qwen3.5/3.6 models
//!
//! Two caches, both pure host-side data structures: they decide *where* each sequence's state
//! lives and hand the runner the i32 index tensors the ops consume. The cache tensors themselves
//! are graph state leaves that the model builder creates from the shapes exposed here.
//!
//! - [`PagedKvCache`] (full-attention layers): the K/V cells of every layer are split into
//!   fixed-size blocks of `block_size` cells; a free list hands blocks to sequences as they grow.
//!   It produces the block table (`i32 [n_kv, n_seq]`, logical position -> physical cell) read by
//!   paged `flash_attn_ext`, the matching causal mask, and the row ids that `set_rows` writes a
//!   step's new K/V rows to. A step's growth is all or nothing (`reserve_many`), and `truncate`
//!   rolls a sequence back.
//! - [`RecurrentCache`] (gated-DeltaNet layers): one state slot per sequence holding the conv ring
//!   (`[d_conv - 1, channels, n_slots]`) and the delta-rule state (`[S_k, S_v, H_v, n_slots]`),
//!   addressed by the `slots` i32 `[n_seq]` input of `ssm_conv_update_inplace` and
//!   `gated_delta_net`.
//!
//! All shapes are in **ggml order**: `ne[0]` is the innermost, contiguous dimension.
//!
//! Sequences are named by the runner with a [`SeqId`]; both caches keep their own membership, so a
//! runner adds and removes every sequence in both.
//!
//! ```
//! use tessera_models::cache::{AllocPolicy, KvCacheConfig, PagedKvCache, RecurrentCache, RecurrentConfig};
//!
//! # fn main() -> Result<(), tessera_models::cache::CacheError> {
//! // 1 attention layer, 2 kv heads of 4 dims, 4 blocks of 2 cells (8 cells in all).
//! let cfg = KvCacheConfig { block_size: 2, ..KvCacheConfig::new(1, 2, 4, 4, 4) };
//! let mut kv = PagedKvCache::new(cfg)?;
//! kv.add_sequence(7)?;
//! let new = kv.reserve(7, 3)?; // prefill 3 tokens: logical positions 0..3
//! assert_eq!(new, 0..3);
//! assert_eq!(kv.cells_for(7, new)?, vec![0, 1, 2]); // set_rows targets: cells 0, 1 and 2
//! assert_eq!(kv.free_blocks(), 2);
//! // The table for one sequence and 4 kv positions: position 3 is padding (its last cell).
//! assert_eq!(kv.block_table(&[7], 4)?, vec![0, 1, 2, 2]);
//! kv.remove_sequence(7)?;
//! assert_eq!(kv.free_blocks(), 4);
//!
//! // The same cache with a shuffled free list places the tokens elsewhere.
//! let shuffled = KvCacheConfig { policy: AllocPolicy::Shuffled { seed: 1 }, ..cfg };
//! let mut kv2 = PagedKvCache::new(shuffled)?;
//! kv2.add_sequence(7)?;
//! kv2.reserve(7, 3)?;
//! assert_eq!(kv2.len(7)?, 3);
//!
//! // The recurrent cache: 3 DeltaNet layers, conv (d_conv - 1 = 3, 8 channels),
//! // delta (S_k = 4, S_v = 4, H_v = 2), 2 slots.
//! let mut rec = RecurrentCache::new(RecurrentConfig::new(3, (3, 8), (4, 4, 2), 2))?;
//! let slot = rec.add_sequence(7)?;
//! assert_eq!(rec.take_slots_to_clear(), vec![slot as i32]); // zero it before first use
//! assert_eq!(rec.slots(&[7])?, vec![slot as i32]);
//! assert_eq!(rec.conv_shape(), [3, 8, 2, 1]);
//! rec.remove_sequence(7)?;
//! # Ok(())
//! # }
//! ```

mod kv;
mod recurrent;

pub use kv::{AllocPolicy, KvCacheConfig, KvView, PagedKvCache};
pub use recurrent::{RecurrentCache, RecurrentConfig};

use tessera_ops::DType;

/// The runner's name for a sequence. Any value; each cache holds each id at most once.
pub type SeqId = u32;

/// What can go wrong in cache bookkeeping. A failing call leaves the cache unchanged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CacheError {
    #[error("unknown sequence {id}")]
    UnknownSequence { id: SeqId },
    #[error("sequence {id} is already in the cache")]
    DuplicateSequence { id: SeqId },
    #[error("out of kv blocks: {needed} needed, {free} free")]
    OutOfBlocks { needed: usize, free: usize },
    #[error("out of recurrent state slots: all {n_slots} are in use")]
    OutOfSlots { n_slots: usize },
    #[error("sequence {id} would hold {len} tokens, more than the maximum context of {max}")]
    ContextTooLong { id: SeqId, len: usize, max: usize },
    #[error("bad cache config: {why}")]
    BadConfig { why: String },
    #[error("positions {start}..{end} of sequence {id} are past its length {len}")]
    PositionOutOfRange { id: SeqId, start: usize, end: usize, len: usize },
    #[error("a block table of {n_kv} kv positions cannot hold sequence {id} of length {len}")]
    TableTooShort { id: SeqId, len: usize, n_kv: usize },
    #[error("sequence {id} appears twice in one request")]
    RepeatedSequence { id: SeqId },
    #[error("cache invariant broken: {why}")]
    Invariant { why: String },
}

/// The cache dtypes a KV cache may hold (flash attention reads f32, f16 or bf16 keys/values).
pub(crate) fn check_kv_dtype(dtype: DType) -> Result<(), CacheError> {
    match dtype {
        DType::F16 | DType::F32 | DType::BF16 => Ok(()),
        other => Err(CacheError::BadConfig { why: format!("kv cache dtype must be f16, f32 or bf16, got {other}") }),
    }
}

/// Rejects a repeated id in a request that must name each sequence once.
pub(crate) fn check_distinct(ids: &[SeqId]) -> Result<(), CacheError> {
    let mut seen = std::collections::BTreeSet::new();
    for &id in ids {
        if !seen.insert(id) {
            return Err(CacheError::RepeatedSequence { id });
        }
    }
    Ok(())
}

/// SplitMix64: a tiny seeded generator for the shuffled allocation policy (no statistical
/// claims beyond "a different placement per seed", which is all the paging tests need).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SplitMix64(u64);

impl SplitMix64 {
    pub(crate) fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A value in `0..n` (`n > 0`); the modulo bias is irrelevant here.
    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}
