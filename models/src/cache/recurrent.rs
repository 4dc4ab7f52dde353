//! The recurrent-state cache: see [`RecurrentCache`].

use std::collections::{BTreeMap, BTreeSet};

use super::{CacheError, SeqId, check_distinct};

/// The shape of a recurrent-state cache. Every count is in elements or slots as named.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecurrentConfig {
    /// Layers with a recurrent state (the gated-DeltaNet layers).
    pub n_layers: usize,
    /// Conv ring: `(d_conv - 1, channels)` — samples kept per channel, and channels.
    pub conv: (usize, usize),
    /// Delta-rule state: `(S_k, S_v, H_v)` — key dim, value dim, value heads.
    pub delta: (usize, usize, usize),
    /// Sequences that can be live at once.
    pub n_slots: usize,
}

impl RecurrentConfig {
    pub fn new(n_layers: usize, conv: (usize, usize), delta: (usize, usize, usize), n_slots: usize) -> Self {
        RecurrentConfig { n_layers, conv, delta, n_slots }
    }

    /// Checks every count is positive, slot ids fit an i32, and byte sizes fit a usize.
    pub fn validate(&self) -> Result<(), CacheError> {
        let (kc, ch) = self.conv;
        let (sk, sv, hv) = self.delta;
        for (name, v) in [
            ("n_layers", self.n_layers),
            ("d_conv - 1", kc),
            ("conv channels", ch),
            ("S_k", sk),
            ("S_v", sv),
            ("H_v", hv),
            ("n_slots", self.n_slots),
        ] {
            if v == 0 {
                return Err(CacheError::BadConfig { why: format!("{name} must be positive") });
            }
        }
        if self.n_slots > i32::MAX as usize {
            return Err(CacheError::BadConfig { why: format!("n_slots = {} must fit an i32", self.n_slots) });
        }
        let per_slot = kc
            .checked_mul(ch)
            .and_then(|c| sk.checked_mul(sv).and_then(|d| d.checked_mul(hv)).and_then(|d| d.checked_add(c)))
            .and_then(|x| x.checked_mul(4));
        if per_slot.and_then(|x| x.checked_mul(self.n_layers)).and_then(|x| x.checked_mul(self.n_slots)).is_none() {
            return Err(CacheError::BadConfig { why: "the cache's byte size overflows usize".into() });
        }
        Ok(())
    }
}

/// Slot bookkeeping of the recurrent-state cache: one slot per sequence for every gated-DeltaNet
/// layer.
///
/// Each recurrent layer owns two f32 state tensors (ggml order):
/// - the conv ring `[d_conv - 1, channels, n_slots, 1]` ([`RecurrentCache::conv_shape`]), read and
///   written in place by `ssm_conv_update_inplace`;
/// - the delta-rule state `[S_k, S_v, H_v, n_slots]` ([`RecurrentCache::delta_shape`]), read and
///   written in place by `gated_delta_net`.
///
/// A sequence owns the same slot index in every layer. The ops take the slots of a step's
/// sequences as i32 `[n_seq]` ([`RecurrentCache::slots`]).
///
/// A freshly assigned slot still holds whatever its previous owner left there: the runner must
/// zero it (in every layer, both tensors) before the sequence's first step. The slots waiting for
/// that are returned once by [`RecurrentCache::take_slots_to_clear`].
///
/// # Invariants (checked by [`RecurrentCache::check_invariants`])
///
/// - Every slot `0..n_slots` is either free or owned by exactly one sequence.
/// - Slots waiting to be cleared are owned.
/// - The free list hands out the lowest free slot first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecurrentCache {
    cfg: RecurrentConfig,
    /// Free slots, lowest first out.
    free: BTreeSet<u32>,
    owner: BTreeMap<SeqId, u32>,
    /// Assigned slots not yet handed to the runner for zeroing.
    to_clear: BTreeSet<u32>,
}

impl RecurrentCache {
    /// An empty cache: every slot free.
    pub fn new(cfg: RecurrentConfig) -> Result<Self, CacheError> {
        cfg.validate()?;
        Ok(RecurrentCache {
            cfg,
            free: (0..cfg.n_slots as u32).collect(),
            owner: BTreeMap::new(),
            to_clear: BTreeSet::new(),
        })
    }

    pub fn config(&self) -> &RecurrentConfig {
        &self.cfg
    }

    pub fn free_slots(&self) -> usize {
        self.free.len()
    }

    pub fn used_slots(&self) -> usize {
        self.owner.len()
    }

    pub fn contains(&self, id: SeqId) -> bool {
        self.owner.contains_key(&id)
    }

    /// Live sequence ids, ascending.
    pub fn sequence_ids(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.owner.keys().copied()
    }

    /// Gives sequence `id` the lowest free slot and marks it to be cleared (see
    /// [`take_slots_to_clear`](Self::take_slots_to_clear)). Returns the slot.
    pub fn add_sequence(&mut self, id: SeqId) -> Result<u32, CacheError> {
        if self.owner.contains_key(&id) {
            return Err(CacheError::DuplicateSequence { id });
        }
        let slot = self.free.pop_first().ok_or(CacheError::OutOfSlots { n_slots: self.cfg.n_slots })?;
        self.owner.insert(id, slot);
        self.to_clear.insert(slot);
        Ok(slot)
    }

    /// The slot of sequence `id`.
    pub fn slot(&self, id: SeqId) -> Result<u32, CacheError> {
        self.owner.get(&id).copied().ok_or(CacheError::UnknownSequence { id })
    }

    /// Frees the slot of sequence `id` and returns it.
    pub fn remove_sequence(&mut self, id: SeqId) -> Result<u32, CacheError> {
        let slot = self.owner.remove(&id).ok_or(CacheError::UnknownSequence { id })?;
        self.to_clear.remove(&slot);
        self.free.insert(slot);
        Ok(slot)
    }

    /// The `slots` input of a step, i32 `[n_seq]`: the slot of each of `ids` (distinct), in order.
    pub fn slots(&self, ids: &[SeqId]) -> Result<Vec<i32>, CacheError> {
        check_distinct(ids)?;
        // Slots are below n_slots <= i32::MAX (validated), so the cast is exact.
        ids.iter().map(|&id| self.slot(id).map(|s| s as i32)).collect()
    }

    /// True when sequence `id`'s slot has not yet been handed out for zeroing.
    pub fn needs_clear(&self, id: SeqId) -> Result<bool, CacheError> {
        Ok(self.to_clear.contains(&self.slot(id)?))
    }

    /// The slots assigned since the last call (ascending, owned by live sequences), which the
    /// runner must zero in every layer's conv and delta state before those sequences run. Each
    /// assignment is reported once; a slot freed before being taken is not reported.
    pub fn take_slots_to_clear(&mut self) -> Vec<i32> {
        std::mem::take(&mut self.to_clear).into_iter().map(|s| s as i32).collect()
    }

    /// Shape of one layer's conv state, ggml order: `[d_conv - 1, channels, n_slots, 1]`, f32.
    pub fn conv_shape(&self) -> [usize; 4] {
        [self.cfg.conv.0, self.cfg.conv.1, self.cfg.n_slots, 1]
    }

    /// Shape of one layer's delta-rule state, ggml order: `[S_k, S_v, H_v, n_slots]`, f32.
    pub fn delta_shape(&self) -> [usize; 4] {
        let (sk, sv, hv) = self.cfg.delta;
        [sk, sv, hv, self.cfg.n_slots]
    }

    /// Bytes of one slot of one layer's conv state: `(d_conv - 1) * channels * 4`.
    pub fn conv_bytes_per_slot(&self) -> usize {
        self.cfg.conv.0 * self.cfg.conv.1 * 4
    }

    /// Bytes of one slot of one layer's delta state: `S_k * S_v * H_v * 4`.
    pub fn delta_bytes_per_slot(&self) -> usize {
        let (sk, sv, hv) = self.cfg.delta;
        sk * sv * hv * 4
    }

    /// Bytes of state one sequence owns over all recurrent layers.
    pub fn bytes_per_sequence(&self) -> usize {
        (self.conv_bytes_per_slot() + self.delta_bytes_per_slot()) * self.cfg.n_layers
    }

    /// Bytes of every recurrent state tensor: `bytes_per_sequence * n_slots`.
    pub fn total_bytes(&self) -> usize {
        self.bytes_per_sequence() * self.cfg.n_slots
    }

    /// Checks the [invariants](Self); `Err(CacheError::Invariant)` names the first broken
    /// one. For tests and debug assertions.
    pub fn check_invariants(&self) -> Result<(), CacheError> {
        let broken = |why: String| Err(CacheError::Invariant { why });
        let mut seen = vec![false; self.cfg.n_slots];
        for (who, &s) in self.free.iter().map(|s| (None, s)).chain(self.owner.iter().map(|(&id, s)| (Some(id), s))) {
            match seen.get_mut(s as usize) {
                None => return broken(format!("slot {s} is out of range 0..{}", self.cfg.n_slots)),
                Some(true) => return broken(format!("slot {s} is held twice (last by {who:?}, None = free)")),
                Some(f) => *f = true,
            }
        }
        if let Some(s) = seen.iter().position(|&f| !f) {
            return broken(format!("slot {s} is neither free nor owned"));
        }
        if let Some(s) = self.to_clear.iter().find(|s| self.free.contains(s)) {
            return broken(format!("slot {s} is free but waiting to be cleared"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache(n_slots: usize) -> RecurrentCache {
        RecurrentCache::new(RecurrentConfig::new(3, (3, 16), (8, 4, 2), n_slots)).unwrap()
    }

    #[test]
    fn config_validation() {
        for bad in [
            RecurrentConfig::new(0, (3, 16), (8, 4, 2), 2),
            RecurrentConfig::new(3, (0, 16), (8, 4, 2), 2),
            RecurrentConfig::new(3, (3, 0), (8, 4, 2), 2),
            RecurrentConfig::new(3, (3, 16), (0, 4, 2), 2),
            RecurrentConfig::new(3, (3, 16), (8, 4, 2), 0),
            RecurrentConfig::new(3, (3, 16), (8, 4, 2), 1 << 40),
            RecurrentConfig::new(3, (3, 16), (1 << 40, 1 << 40, 2), 2),
        ] {
            assert!(matches!(RecurrentCache::new(bad), Err(CacheError::BadConfig { .. })), "{bad:?}");
        }
    }

    #[test]
    fn shapes_and_bytes() {
        let c = cache(4);
        assert_eq!(c.conv_shape(), [3, 16, 4, 1]);
        assert_eq!(c.delta_shape(), [8, 4, 2, 4]);
        assert_eq!(c.conv_bytes_per_slot(), 3 * 16 * 4);
        assert_eq!(c.delta_bytes_per_slot(), 8 * 4 * 2 * 4);
        assert_eq!(c.bytes_per_sequence(), 3 * (192 + 256));
        assert_eq!(c.total_bytes(), 4 * 3 * (192 + 256));
    }

    #[test]
    fn slots_lifecycle() {
        let mut c = cache(2);
        assert_eq!(c.add_sequence(10).unwrap(), 0);
        assert_eq!(c.add_sequence(11).unwrap(), 1);
        assert_eq!(c.add_sequence(10), Err(CacheError::DuplicateSequence { id: 10 }));
        assert_eq!(c.add_sequence(12), Err(CacheError::OutOfSlots { n_slots: 2 }));
        assert!(c.needs_clear(10).unwrap());
        assert_eq!(c.take_slots_to_clear(), vec![0, 1]);
        assert!(c.take_slots_to_clear().is_empty());
        assert!(!c.needs_clear(10).unwrap());
        assert_eq!(c.slots(&[11, 10]).unwrap(), vec![1, 0]);
        assert_eq!(c.slots(&[11, 11]), Err(CacheError::RepeatedSequence { id: 11 }));
        assert_eq!(c.slots(&[13]), Err(CacheError::UnknownSequence { id: 13 }));
        assert_eq!(c.remove_sequence(10).unwrap(), 0);
        assert_eq!(c.add_sequence(12).unwrap(), 0);
        // Added then removed before the runner looked: nothing to clear for it.
        assert_eq!(c.remove_sequence(12).unwrap(), 0);
        assert!(c.take_slots_to_clear().is_empty());
        c.check_invariants().unwrap();
        assert_eq!(c.remove_sequence(12), Err(CacheError::UnknownSequence { id: 12 }));
        assert_eq!(c.remove_sequence(11).unwrap(), 1);
        assert_eq!(c.free_slots(), 2);
        c.check_invariants().unwrap();
    }
}
