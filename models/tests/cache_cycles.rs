//! Cache bookkeeping under long random workloads: the paged KV cache and the recurrent-state cache
//! driven together the way a runner drives them, with a simulated physical cell store that proves
//! every sequence reads back exactly the tokens it wrote, wherever the blocks landed.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;

use proptest::prelude::*;
use tessera_models::cache::{
    AllocPolicy, CacheError, KvCacheConfig, PagedKvCache, RecurrentCache, RecurrentConfig, SeqId,
};

/// What a cell holds in the simulated store: the (sequence, logical position) last written there.
type Token = (SeqId, usize);

/// A runner in miniature: both caches plus a store of `n_cells` cells written through
/// `write_cells` and read through `block_table`.
struct Sim {
    kv: PagedKvCache,
    rec: RecurrentCache,
    store: Vec<Option<Token>>,
    /// Model of what the caches should hold: sequence -> length.
    lens: BTreeMap<SeqId, usize>,
    /// Slots the runner has zeroed, per sequence, after `take_slots_to_clear`.
    cleared: BTreeSet<SeqId>,
}

impl Sim {
    fn new(policy: AllocPolicy, block_size: usize, n_blocks: usize, max_context: usize, n_slots: usize) -> Self {
        let cfg = KvCacheConfig { block_size, max_context, policy, ..KvCacheConfig::new(2, 2, 4, 4, n_blocks) };
        let kv = PagedKvCache::new(cfg).expect("valid kv config");
        let rec = RecurrentCache::new(RecurrentConfig::new(3, (3, 8), (4, 4, 2), n_slots)).expect("valid config");
        let store = vec![None; kv.n_cells()];
        Sim { kv, rec, store, lens: BTreeMap::new(), cleared: BTreeSet::new() }
    }

    /// Adds a sequence to both caches, or to neither.
    fn add(&mut self, id: SeqId) -> Result<(), CacheError> {
        self.rec.add_sequence(id)?;
        if let Err(e) = self.kv.add_sequence(id) {
            self.rec.remove_sequence(id).expect("just added");
            return Err(e);
        }
        self.lens.insert(id, 0);
        Ok(())
    }

    fn remove(&mut self, id: SeqId) -> Result<(), CacheError> {
        self.kv.remove_sequence(id)?;
        self.rec.remove_sequence(id)?;
        self.lens.remove(&id);
        self.cleared.remove(&id);
        Ok(())
    }

    /// One step: reserve for every request (all or nothing), write the new tokens to their cells.
    fn step(&mut self, requests: &[(SeqId, usize)]) -> Result<(), CacheError> {
        let before = self.kv.clone();
        let ranges = match self.kv.reserve_many(requests) {
            Ok(r) => r,
            Err(e) => {
                assert_eq!(self.kv, before, "failed reserve_many changed the cache: {e}");
                return Err(e);
            }
        };
        for slot in self.rec.take_slots_to_clear() {
            let id = self.rec.sequence_ids().find(|&id| self.rec.slot(id) == Ok(slot as u32)).expect("owned slot");
            self.cleared.insert(id);
        }
        let step: Vec<(SeqId, Range<usize>)> = requests.iter().map(|r| r.0).zip(ranges).collect();
        let rows = self.kv.write_cells(&step).expect("reserved positions");
        let tokens = step.iter().flat_map(|(id, r)| r.clone().map(move |p| (*id, p)));
        for (row, tok) in rows.iter().zip(tokens) {
            self.store[*row as usize] = Some(tok);
        }
        for &(id, n) in requests {
            *self.lens.get_mut(&id).expect("model knows the sequence") += n;
        }
        self.check_step_attention(&step);
        Ok(())
    }

    /// What the step's attention sees through the table and the mask: token `t` of sequence `s`
    /// (at position `p`) sees exactly that sequence's tokens `0..=p`, each once.
    fn check_step_attention(&self, step: &[(SeqId, Range<usize>)]) {
        let ids: Vec<SeqId> = step.iter().map(|r| r.0).collect();
        let n_tokens = step.iter().map(|r| r.1.len()).max().unwrap_or(0);
        let n_kv = self.kv.padded_n_kv(&ids, 8).unwrap();
        let table = self.kv.block_table(&ids, n_kv).unwrap();
        let mask = self.kv.causal_mask(step, n_kv, n_tokens).unwrap();
        for (s, (id, r)) in step.iter().enumerate() {
            for t in 0..n_tokens {
                let row = &mask[(s * n_tokens + t) * n_kv..][..n_kv];
                let seen: Vec<Token> = (0..n_kv)
                    .filter(|&j| row[j] == 0.0)
                    .map(|j| self.store[table[s * n_kv + j] as usize].expect("visible cell was written"))
                    .collect();
                let want: Vec<Token> =
                    if t < r.len() { (0..=r.start + t).map(|p| (*id, p)).collect() } else { Vec::new() };
                assert_eq!(seen, want, "sequence {id} token {t}");
                assert!(row.iter().all(|&x| x == 0.0 || x == f32::NEG_INFINITY));
            }
        }
    }

    fn truncate(&mut self, id: SeqId, new_len: usize) -> Result<(), CacheError> {
        self.kv.truncate(id, new_len)?;
        self.lens.insert(id, new_len);
        Ok(())
    }

    /// Every invariant the runner relies on.
    fn check(&self) {
        self.kv.check_invariants().unwrap();
        self.rec.check_invariants().unwrap();
        let ids: Vec<SeqId> = self.lens.keys().copied().collect();
        assert_eq!(self.kv.sequence_ids().collect::<Vec<_>>(), ids);
        assert_eq!(self.rec.sequence_ids().collect::<Vec<_>>(), ids);
        for (&id, &len) in &self.lens {
            assert!(len == 0 || self.cleared.contains(&id), "sequence {id} ran on a slot never cleared");
        }
        let used: usize = self.lens.values().map(|&l| self.kv.blocks_for_len(l)).sum();
        assert_eq!(self.kv.used_blocks(), used);
        assert_eq!(self.kv.free_blocks() + used, self.kv.config().n_blocks);
        assert_eq!(self.rec.used_slots(), ids.len());

        // Slots: distinct, in range, and each one zeroed before use.
        let slots = self.rec.slots(&ids).unwrap();
        assert_eq!(slots.iter().collect::<BTreeSet<_>>().len(), slots.len());
        assert!(slots.iter().all(|&s| (0..self.rec.config().n_slots as i32).contains(&s)));

        // Block table: every logical position of every sequence maps to a distinct cell holding
        // exactly that token; padding stays in range.
        let n_kv = self.kv.padded_n_kv(&ids, 4).unwrap();
        let table = self.kv.block_table(&ids, n_kv).unwrap();
        assert_eq!(table.len(), n_kv * ids.len());
        let mut seen = BTreeSet::new();
        for (s, &id) in ids.iter().enumerate() {
            let len = self.lens[&id];
            assert_eq!(self.kv.len(id).unwrap(), len);
            let row = &table[s * n_kv..(s + 1) * n_kv];
            assert!(row.iter().all(|&c| (0..self.kv.n_cells() as i32).contains(&c)));
            assert_eq!(&row[..len], self.kv.cells_for(id, 0..len).unwrap().as_slice());
            for (pos, &cell) in row[..len].iter().enumerate() {
                assert!(seen.insert(cell), "cell {cell} is shared");
                assert_eq!(self.store[cell as usize], Some((id, pos)), "sequence {id} position {pos}");
            }
        }
    }

    /// The logical contents: each sequence's tokens read through its block table.
    fn logical(&self) -> BTreeMap<SeqId, Vec<Option<Token>>> {
        self.lens
            .iter()
            .map(|(&id, &len)| {
                let cells = self.kv.cells_for(id, 0..len).unwrap();
                (id, cells.iter().map(|&c| self.store[c as usize]).collect())
            })
            .collect()
    }

    fn physical(&self) -> BTreeMap<SeqId, Vec<i32>> {
        self.lens.iter().map(|(&id, &len)| (id, self.kv.cells_for(id, 0..len).unwrap())).collect()
    }
}

/// SplitMix64, for seeded workloads.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

#[test]
fn thousand_cycles_leave_nothing_in_use() {
    for policy in [AllocPolicy::InOrder, AllocPolicy::Shuffled { seed: 42 }] {
        let mut sim = Sim::new(policy, 4, 24, 40, 6);
        let mut rng = Rng(7);
        let (mut adds, mut fails) = (0, 0);
        for cycle in 0..1000u32 {
            // Add a sequence (may fail: out of slots).
            match sim.add(cycle) {
                Ok(()) => adds += 1,
                Err(CacheError::OutOfSlots { .. }) => fails += 1,
                Err(e) => panic!("{e}"),
            }
            // Extend a few random live sequences in one step (prefill or decode sized).
            let ids: Vec<SeqId> = sim.lens.keys().copied().collect();
            if !ids.is_empty() {
                let mut req = BTreeMap::new();
                for _ in 0..1 + rng.below(3) {
                    let n = if rng.below(4) == 0 { 1 + rng.below(12) } else { 1 };
                    req.insert(ids[rng.below(ids.len())], n);
                }
                let req: Vec<(SeqId, usize)> = req.into_iter().collect();
                match sim.step(&req) {
                    Ok(()) => {}
                    Err(CacheError::OutOfBlocks { .. } | CacheError::ContextTooLong { .. }) => fails += 1,
                    Err(e) => panic!("{e}"),
                }
            }
            // Remove one at random, more often when the cache is busy.
            if !sim.lens.is_empty() && rng.below(3) > 0 {
                let ids: Vec<SeqId> = sim.lens.keys().copied().collect();
                sim.remove(ids[rng.below(ids.len())]).unwrap();
            }
            sim.check();
        }
        assert!(adds > 500 && fails > 0, "the workload should exercise both paths: {adds} adds, {fails} fails");
        let ids: Vec<SeqId> = sim.lens.keys().copied().collect();
        for id in ids {
            sim.remove(id).unwrap();
        }
        sim.check();
        assert_eq!(sim.kv.free_blocks(), 24);
        assert_eq!(sim.kv.used_blocks(), 0);
        assert_eq!(sim.rec.used_slots(), 0);
        assert_eq!(sim.rec.free_slots(), 6);
        assert!(sim.rec.take_slots_to_clear().is_empty());
    }
}

#[test]
fn shuffled_placement_differs_but_logical_contents_match() {
    let run = |policy| {
        let mut sim = Sim::new(policy, 4, 16, 64, 4);
        for id in 0..3 {
            sim.add(id).unwrap();
        }
        sim.step(&[(0, 7), (1, 5), (2, 9)]).unwrap();
        sim.remove(1).unwrap();
        sim.add(3).unwrap();
        sim.step(&[(0, 1), (2, 1), (3, 6)]).unwrap();
        for _ in 0..5 {
            sim.step(&[(0, 1), (2, 1), (3, 1)]).unwrap();
        }
        sim.check();
        sim
    };
    let a = run(AllocPolicy::InOrder);
    let b = run(AllocPolicy::Shuffled { seed: 3 });
    let c = run(AllocPolicy::Shuffled { seed: 4 });
    assert_eq!(a.logical(), b.logical());
    assert_eq!(a.logical(), c.logical());
    assert_ne!(a.physical(), b.physical());
    assert_ne!(b.physical(), c.physical());
    // In order, a fresh cache lays the first sequence out contiguously.
    assert_eq!(a.kv.cells_for(0, 0..8).unwrap(), (0..8).collect::<Vec<i32>>());
}

#[test]
fn failing_reserve_leaves_everything_unchanged() {
    for policy in [AllocPolicy::InOrder, AllocPolicy::Shuffled { seed: 9 }] {
        let mut sim = Sim::new(policy, 4, 4, 12, 2);
        sim.add(1).unwrap();
        sim.add(2).unwrap();
        sim.step(&[(1, 9)]).unwrap();
        let (kv, rec) = (sim.kv.clone(), sim.rec.clone());
        assert_eq!(sim.kv.reserve(2, 5), Err(CacheError::OutOfBlocks { needed: 2, free: 1 }));
        assert_eq!(sim.kv.reserve(1, 4), Err(CacheError::ContextTooLong { id: 1, len: 13, max: 12 }));
        assert_eq!(sim.step(&[(2, 4), (1, 1), (9, 1)]), Err(CacheError::UnknownSequence { id: 9 }));
        assert_eq!(sim.step(&[(1, 3), (2, 5)]), Err(CacheError::OutOfBlocks { needed: 2, free: 1 }));
        assert_eq!(sim.add(1), Err(CacheError::DuplicateSequence { id: 1 }));
        assert_eq!(sim.add(3), Err(CacheError::OutOfSlots { n_slots: 2 }));
        assert_eq!(sim.kv, kv);
        assert_eq!(sim.rec, rec);
        sim.check();
    }
}

/// One operation of the property test.
#[derive(Debug, Clone)]
enum Op {
    Add(SeqId),
    Remove(SeqId),
    Step(Vec<(SeqId, usize)>),
    Truncate(SeqId, usize),
}

fn op() -> impl Strategy<Value = Op> {
    let id = 0u32..8;
    prop_oneof![
        3 => id.clone().prop_map(Op::Add),
        2 => id.clone().prop_map(Op::Remove),
        4 => prop::collection::btree_map(id.clone(), 0usize..20, 1..4)
            .prop_map(|m| Op::Step(m.into_iter().collect())),
        1 => (id, 0usize..30).prop_map(|(i, n)| Op::Truncate(i, n)),
    ]
}

fn policy() -> impl Strategy<Value = AllocPolicy> {
    prop_oneof![Just(AllocPolicy::InOrder), any::<u64>().prop_map(|seed| AllocPolicy::Shuffled { seed })]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// After every operation, successful or not: invariants hold, the model agrees, every sequence
    /// reads back its own tokens, and failures leave both caches exactly as they were.
    #[test]
    fn random_operations_keep_invariants(
        policy in policy(),
        block_size in 1usize..6,
        n_blocks in 1usize..24,
        max_context in 1usize..48,
        n_slots in 1usize..6,
        ops in prop::collection::vec(op(), 1..80),
    ) {
        let mut sim = Sim::new(policy, block_size, n_blocks, max_context, n_slots);
        for op in ops {
            let (kv, rec) = (sim.kv.clone(), sim.rec.clone());
            let result = match &op {
                Op::Add(id) => sim.add(*id),
                Op::Remove(id) => sim.remove(*id),
                Op::Step(req) => sim.step(req),
                Op::Truncate(id, n) => sim.truncate(*id, *n),
            };
            if let Err(e) = result {
                prop_assert_eq!(&sim.kv, &kv, "{:?} failed ({}) but changed the kv cache", op, e);
                prop_assert_eq!(&sim.rec, &rec, "{:?} failed ({}) but changed the recurrent cache", op, e);
            }
            sim.check();
        }
        let ids: Vec<SeqId> = sim.lens.keys().copied().collect();
        for id in ids {
            sim.remove(id).unwrap();
        }
        sim.check();
        prop_assert_eq!(sim.kv.free_blocks(), n_blocks);
        prop_assert_eq!(sim.rec.free_slots(), n_slots);
    }
}
