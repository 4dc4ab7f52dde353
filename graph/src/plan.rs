//! The execution plan of a graph: which nodes run, in what order, and where every tensor's bytes
//! live. Pure: built from a `&Graph` alone, with no backend, so it is tested without one.
//!
//! # Storage
//!
//! Every live node gets a [`Slot`]: a byte offset into one of two kinds of storage.
//! - **Leaves** (parameters, inputs, state) keep their own storage for the plan's lifetime: they
//!   are set once and read by every run.
//! - **Computed tensors** share one **arena**. A computing node that is neither a view nor an
//!   in-place write is a *root*: it owns an arena interval from the step that computes it to the
//!   last step that reads it or any alias of it. Views alias their source's bytes (at the view's
//!   offset), an in-place op (`Op::writes_input`) aliases the input it writes, so both stretch
//!   their root's lifetime instead of taking memory. Outputs live to the end of the run.
//!
//! # Backends
//!
//! A plan may spread a graph over several backends ([`Plan::scheduled`], with the assignment of
//! `schedule::assign`): every live node has a *home* backend, each backend its own arena, and a
//! task that reads a value living on another backend reads a **mirror**: an interval of its own
//! backend's arena holding a copy of the value's whole root, refreshed before every segment of
//! tasks that reads it (the executor copies it). In-place writes never cross backends: an op that
//! writes or updates a tensor runs where that tensor lives.
//!
//! # Packing
//!
//! The intervals are packed offline: in each of a few orders (largest first, the "greedy by size"
//! planner of TFLite's arena, and others), each goes to an offset where it overlaps no
//! already-placed interval whose lifetime overlaps its own, and the smallest arena wins. Knowing
//! every lifetime up front beats ggml-alloc's online best fit on fragmentation;
//! [`MemoryStats::lower_bound_bytes`] (the most bytes live at one step) bounds what any packing
//! can reach, and the tests check the ratio on random and model graphs.

use smallvec::SmallVec;
use tessera_ops::TensorMeta;

use crate::{Graph, NodeId, NodeKind};

/// Arena offsets are multiples of this (CUDA's allocation granularity for coalesced and TMA
/// access; harmless on the CPU).
pub const ARENA_ALIGN: usize = 256;

/// How a plan uses memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanOptions {
    /// Let computed tensors whose lifetimes do not overlap share arena bytes. Off: every root
    /// keeps its own bytes, so every live tensor can still be read after a run (tools that
    /// compare every node use this).
    pub reuse: bool,
    /// Bytes of guard pattern kept free before and after every arena interval (forces `reuse`
    /// off: a later tenant would overwrite an earlier one's guards).
    pub guard_bytes: usize,
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions { reuse: true, guard_bytes: 0 }
    }
}

/// Where a slot's bytes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Storage {
    /// The storage of leaf `NodeId` (its own buffer, or memory bound by the caller) on its home
    /// backend.
    Leaf(NodeId),
    /// The compute arena of backend `usize`.
    Arena(usize),
}

/// A live node's bytes: `offset` bytes into `storage`, with the node's descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    pub storage: Storage,
    pub offset: usize,
    pub meta: TensorMeta,
}

/// One arena interval: the bytes `[offset, offset + bytes)` of backend `backend`'s arena belong to
/// `root` (or, for a mirror, to its copy) from step `first` to step `last` inclusive (step = index
/// into [`Plan::live`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Interval {
    pub root: NodeId,
    pub backend: usize,
    /// A copy of `root`, which lives on another backend.
    pub mirror: bool,
    pub offset: usize,
    pub bytes: usize,
    pub first: usize,
    pub last: usize,
}

impl Interval {
    /// Whether the two are in one arena and alive at a common step.
    pub fn lifetimes_overlap(&self, other: &Interval) -> bool {
        self.backend == other.backend && self.first <= other.last && other.first <= self.last
    }

    /// Whether the two share a byte.
    pub fn bytes_overlap(&self, other: &Interval) -> bool {
        self.offset < other.offset + other.bytes && other.offset < self.offset + self.bytes
    }
}

/// What the packing achieved.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// Bytes of the arenas (all backends): the peak of computed-tensor memory.
    pub arena_bytes: usize,
    /// The most bytes of computed tensors alive at one step: no packing can do better.
    pub lower_bound_bytes: usize,
    /// Bytes without any sharing (every root its own interval).
    pub unshared_bytes: usize,
    /// Bytes of the live leaves (their own storage, outside the arena).
    pub leaf_bytes: usize,
}

/// The plan of one graph: live nodes in execution order, a slot per live node, the computing
/// nodes (tasks) in order, and the arena layout.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Live nodes in execution (build) order.
    pub live: Vec<NodeId>,
    /// Indexed by node; `None` for nodes that are not live.
    pub slots: Vec<Option<Slot>>,
    /// Computing nodes (live, not leaves, not views) in execution order.
    pub tasks: Vec<NodeId>,
    /// Live leaves.
    pub leaves: Vec<NodeId>,
    /// The arena's intervals, one per root.
    pub intervals: Vec<Interval>,
    pub stats: MemoryStats,
    pub options: PlanOptions,
    /// Each live node's home backend, by node (0 where not live).
    pub home: Vec<usize>,
    /// Arena bytes of each backend.
    pub arenas: Vec<usize>,
    /// Indexed by node: see [`Plan::survives_run`].
    kept: Vec<bool>,
    /// Indexed by node: its storage root.
    root: Vec<NodeId>,
    /// (root, backend) -> index of its mirror interval.
    mirror_of: std::collections::HashMap<(NodeId, usize), usize>,
}

/// Rounds `n` up to the arena alignment.
fn aligned(n: usize) -> usize {
    n.div_ceil(ARENA_ALIGN) * ARENA_ALIGN
}

impl Plan {
    /// Plans `graph` on one backend. Never fails: every live node gets a slot.
    pub fn new(graph: &Graph, options: PlanOptions) -> Plan {
        Plan::scheduled(graph, options, &vec![0; graph.len()], 1)
    }

    /// Plans `graph` over `n_backends` backends, node `i` living on backend `home[i]` (views and
    /// in-place writes must live where their root does: `schedule::assign` makes such an
    /// assignment). Never fails.
    pub fn scheduled(graph: &Graph, options: PlanOptions, home: &[usize], n_backends: usize) -> Plan {
        let reuse = options.reuse && options.guard_bytes == 0;
        let live = graph.live_nodes();
        let n = graph.len();
        let n_backends = n_backends.max(1);
        let mut step_of = vec![usize::MAX; n];
        for (i, id) in live.iter().enumerate() {
            step_of[id.index()] = i;
        }
        // Each live node's storage root: leaves and arena roots are their own.
        let mut root = vec![NodeId(u32::MAX); n];
        let mut tasks = Vec::new();
        let mut leaves = Vec::new();
        for &id in &live {
            let node = graph.node(id);
            root[id.index()] = match &node.kind {
                NodeKind::Leaf(_) => {
                    leaves.push(id);
                    id
                }
                NodeKind::Op(op) if op.is_view() => root[node.inputs[0].index()],
                NodeKind::Op(op) => {
                    tasks.push(id);
                    match op.writes_input() {
                        Some(w) => root[node.inputs[w].index()],
                        None => id,
                    }
                }
            };
        }
        // Last step at which each root's bytes are read (through any alias) or must survive.
        let end = live.len();
        let mut last = vec![0usize; n];
        for (i, &id) in live.iter().enumerate() {
            let r = root[id.index()].index();
            last[r] = last[r].max(i);
            for inp in &graph.node(id).inputs {
                let r = root[inp.index()].index();
                last[r] = last[r].max(i);
            }
        }
        for out in graph.outputs() {
            last[root[out.index()].index()] = end;
        }

        let guard = options.guard_bytes;
        let mut intervals: Vec<Interval> = tasks
            .iter()
            .filter(|t| root[t.index()] == **t)
            .map(|&t| Interval {
                root: t,
                backend: home[t.index()],
                mirror: false,
                offset: 0,
                bytes: aligned(graph.node(t).meta.nbytes_contiguous() + 2 * guard),
                first: step_of[t.index()],
                last: last[t.index()],
            })
            .collect();
        // Mirrors: a task reading a root that lives on another backend reads a copy in its own
        // backend's arena, alive from the start of the first segment (run of tasks on one
        // backend) that reads it, where the executor copies it in, to its last reader there.
        let mut mirror_of: std::collections::HashMap<(NodeId, usize), usize> = Default::default();
        let mut segment_start = 0;
        for (k, &t) in tasks.iter().enumerate() {
            let b = home[t.index()];
            if k == 0 || home[tasks[k - 1].index()] != b {
                segment_start = step_of[t.index()];
            }
            let step = step_of[t.index()];
            for inp in &graph.node(t).inputs {
                let r = root[inp.index()];
                if home[r.index()] == b {
                    continue;
                }
                let i = *mirror_of.entry((r, b)).or_insert_with(|| {
                    intervals.push(Interval {
                        root: r,
                        backend: b,
                        mirror: true,
                        offset: 0,
                        bytes: aligned(graph.node(r).meta.nbytes_contiguous() + 2 * guard),
                        first: segment_start,
                        last: step,
                    });
                    intervals.len() - 1
                });
                intervals[i].first = intervals[i].first.min(segment_start);
                intervals[i].last = intervals[i].last.max(step);
            }
        }
        let unshared_bytes = intervals.iter().map(|iv| iv.bytes).sum();
        let mut arenas = vec![0; n_backends];
        let mut lower_bound_bytes = 0;
        for (b, arena) in arenas.iter_mut().enumerate() {
            let mut mine: Vec<Interval> = intervals.iter().copied().filter(|iv| iv.backend == b).collect();
            *arena = if reuse { pack(&mut mine) } else { stack(&mut mine) };
            lower_bound_bytes += lower_bound(&mine, end + 1);
            let mut it = mine.into_iter();
            for iv in intervals.iter_mut().filter(|iv| iv.backend == b) {
                *iv = it.next().expect("the same intervals, in order");
            }
        }
        let arena_bytes = arenas.iter().sum();

        let mut slots: Vec<Option<Slot>> = vec![None; n];
        let mut leaf_bytes = 0;
        for iv in intervals.iter().filter(|iv| !iv.mirror) {
            let meta = graph.node(iv.root).meta;
            slots[iv.root.index()] =
                Some(Slot { storage: Storage::Arena(iv.backend), offset: iv.offset + guard, meta });
        }
        for &id in &live {
            let node = graph.node(id);
            let slot = match &node.kind {
                NodeKind::Leaf(_) => {
                    leaf_bytes += node.meta.nbytes_contiguous();
                    Slot { storage: Storage::Leaf(id), offset: 0, meta: node.meta }
                }
                NodeKind::Op(op) if op.is_view() => {
                    let src = slots[node.inputs[0].index()].expect("inputs are placed before their users");
                    let extra = if let tessera_ops::Op::View(v) = op { v.offset } else { 0 };
                    Slot { offset: src.offset + extra, meta: node.meta, ..src }
                }
                NodeKind::Op(op) => match op.writes_input() {
                    Some(w) => {
                        let dst = slots[node.inputs[w].index()].expect("inputs are placed before their users");
                        Slot { meta: node.meta, ..dst }
                    }
                    None => continue, // a root: placed above
                },
            };
            slots[id.index()] = Some(slot);
        }
        let mut kept = vec![false; n];
        for &id in &live {
            let r = root[id.index()];
            kept[id.index()] = graph.node(r).op().is_none() || !reuse || last[r.index()] == end;
        }
        let stats = MemoryStats { arena_bytes, lower_bound_bytes, unshared_bytes, leaf_bytes };
        let mut home_of = vec![0; n];
        for &id in &live {
            home_of[id.index()] = home[id.index()];
        }
        Plan { live, slots, tasks, leaves, intervals, stats, options, home: home_of, arenas, kept, root, mirror_of }
    }

    /// Where task `task` reads its input `input`: the input's own slot when it lives on the task's
    /// backend, else the matching bytes of the mirror of its root there.
    pub fn input_slot(&self, task: NodeId, input: NodeId) -> Option<Slot> {
        let b = self.home[task.index()];
        let slot = self.slot(input)?;
        let r = self.root[input.index()];
        if self.home[r.index()] == b {
            return Some(slot);
        }
        let m = self.intervals[*self.mirror_of.get(&(r, b))?];
        let root_start = self.slot(r)?.offset;
        let guard = self.options.guard_bytes;
        Some(Slot {
            storage: Storage::Arena(b),
            offset: m.offset + guard + (slot.offset - root_start),
            meta: slot.meta,
        })
    }

    /// The mirrors, each as (the root it copies, its interval).
    pub fn mirrors(&self) -> impl Iterator<Item = &Interval> {
        self.intervals.iter().filter(|iv| iv.mirror)
    }

    /// The storage root of a live node: itself for leaves and arena roots, else what it aliases.
    pub fn root(&self, id: NodeId) -> NodeId {
        self.root[id.index()]
    }

    /// The slot of a live node.
    pub fn slot(&self, id: NodeId) -> Option<Slot> {
        self.slots.get(id.index()).copied().flatten()
    }

    /// Whether `id`'s bytes still hold its value after a run: leaves always; computed tensors
    /// when their interval was not shared (reuse off) or lives to the end (outputs and what
    /// aliases them).
    pub fn survives_run(&self, id: NodeId) -> bool {
        self.kept.get(id.index()).copied().unwrap_or(false)
    }
}

/// Packs the intervals at the lowest offsets clear of every placed interval they share a step
/// with, in each of a few orders (largest first, as TFLite's arena; longest-lived first; in
/// program order; by bytes times steps), and keeps the smallest arena: no single order is best
/// on every graph, and each pass costs little next to building the graph. Returns the arena size.
fn pack(intervals: &mut [Interval]) -> usize {
    type Key = fn(&Interval) -> (std::cmp::Reverse<usize>, usize);
    let orders: [Key; 4] = [
        |iv| (std::cmp::Reverse(iv.bytes), iv.first),
        |iv| (std::cmp::Reverse(iv.last - iv.first), iv.first),
        |iv| (std::cmp::Reverse(0), iv.first),
        |iv| (std::cmp::Reverse(iv.bytes * (iv.last - iv.first + 1)), iv.first),
    ];
    let mut best: Option<(usize, Vec<usize>)> = None;
    let mut try_order = |order: &[usize]| {
        for best_fit in [false, true] {
            let (top, offsets) = pack_in_order(intervals, order, best_fit);
            if best.as_ref().is_none_or(|(t, _)| top < *t) {
                best = Some((top, offsets));
            }
        }
    };
    for key in orders {
        let mut order: Vec<usize> = (0..intervals.len()).collect();
        order.sort_by_key(|&i| (key(&intervals[i]), i));
        try_order(&order);
    }
    // Small arenas, where one alignment unit is a large share: every order up to 8 intervals,
    // seeded shuffles up to 64 (deterministic, so a plan never changes from run to run).
    let n = intervals.len();
    if n <= 8 {
        let mut order: Vec<usize> = (0..n).collect();
        permutations(&mut order, 0, &mut try_order);
    } else if n <= 64 {
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut order: Vec<usize> = (0..n).collect();
        for _ in 0..64 {
            for i in (1..n).rev() {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                order.swap(i, (state % (i as u64 + 1)) as usize);
            }
            try_order(&order);
        }
    }
    let Some((top, offsets)) = best else { return 0 };
    for (iv, off) in intervals.iter_mut().zip(offsets) {
        iv.offset = off;
    }
    top
}

/// Calls `f` with every permutation of `v[k..]` (Heap's recursion, in place).
fn permutations(v: &mut Vec<usize>, k: usize, f: &mut impl FnMut(&[usize])) {
    if k == v.len() {
        f(v);
        return;
    }
    for i in k..v.len() {
        v.swap(k, i);
        permutations(v, k + 1, f);
        v.swap(k, i);
    }
}

/// One greedy pass in `order`, each interval at the lowest free offset (or, with `best_fit`, in
/// the smallest free gap it fits, else on top): the offsets and the arena size.
fn pack_in_order(intervals: &[Interval], order: &[usize], best_fit: bool) -> (usize, Vec<usize>) {
    let mut offsets = vec![0usize; intervals.len()];
    let mut placed: Vec<usize> = Vec::with_capacity(intervals.len());
    let mut top = 0;
    for &i in order {
        let me = intervals[i];
        // Placed intervals alive with this one, by offset.
        let mut busy: SmallVec<[(usize, usize); 32]> = placed
            .iter()
            .filter(|&&j| intervals[j].lifetimes_overlap(&me))
            .map(|&j| (offsets[j], offsets[j] + intervals[j].bytes))
            .collect();
        busy.sort_unstable();
        let mut offset = 0;
        // (gap size, gap start) of the best gap so far, for best fit
        let mut fit: Option<(usize, usize)> = None;
        for &(start, stop) in &busy {
            if start >= offset + me.bytes {
                if !best_fit {
                    break;
                }
                if fit.is_none_or(|(g, _)| start - offset < g) {
                    fit = Some((start - offset, offset));
                }
            }
            offset = offset.max(stop);
        }
        if let Some((_, at)) = fit {
            offset = at;
        }
        offsets[i] = offset;
        top = top.max(offset + me.bytes);
        placed.push(i);
    }
    (top, offsets)
}

/// No sharing: intervals one after another in execution order. Returns the arena size.
fn stack(intervals: &mut [Interval]) -> usize {
    let mut top = 0;
    for iv in intervals.iter_mut() {
        iv.offset = top;
        top += iv.bytes;
    }
    top
}

/// The most bytes alive at one step (`steps` steps, 0..steps).
fn lower_bound(intervals: &[Interval], steps: usize) -> usize {
    let mut delta = vec![0i64; steps + 1];
    for iv in intervals {
        delta[iv.first] += iv.bytes as i64;
        delta[iv.last.min(steps - 1) + 1] -= iv.bytes as i64;
    }
    let (mut cur, mut best) = (0i64, 0i64);
    for d in delta {
        cur += d;
        best = best.max(cur);
    }
    best as usize
}

/// Checks a plan against its graph with code of its own (it shares nothing with the planner but
/// the alignment): every live node has a slot; views and in-place results lie inside the bytes of
/// what they alias; computed values that are alive at a common step never share a byte; outputs
/// survive the run; and the arena is within `max_ratio` of the most bytes alive at one step.
/// Returns what is wrong, for tests and tools.
pub fn verify(graph: &Graph, plan: &Plan, max_ratio: f64) -> Result<(), String> {
    let live = graph.live_nodes();
    if live != plan.live {
        return Err("the plan's live nodes are not the graph's".into());
    }
    let end = live.len();
    let mut step = vec![usize::MAX; graph.len()];
    for (i, id) in live.iter().enumerate() {
        step[id.index()] = i;
    }
    // Storage groups: a computed value, the views of it and the in-place writes into it (and
    // into those), found by walking inputs: group[v] = the first node of its chain.
    let mut group: Vec<usize> = (0..graph.len()).collect();
    for &id in &live {
        let node = graph.node(id);
        if let Some(op) = node.op() {
            let alias = if op.is_view() { Some(0) } else { op.writes_input() };
            if let Some(a) = alias {
                group[id.index()] = group[node.inputs[a].index()];
            }
        }
        if plan.slot(id).is_none() {
            return Err(format!("live node {id:?} has no slot"));
        }
    }
    let span = |id: NodeId| {
        let s = plan.slot(id).expect("checked above");
        (s.storage, s.offset, s.offset + s.meta.span_bytes())
    };
    // Aliases lie inside their group head's bytes.
    for &id in &live {
        let head = NodeId(group[id.index()] as u32);
        let ((st, a, b), (hs, ha, hb)) = (span(id), span(head));
        if st != hs || a < ha || b > hb {
            return Err(format!("{id:?} is not inside the bytes of {head:?}, which it aliases"));
        }
    }
    // Each computed group's lifetime: its head's step to the last read of any member (the end
    // for outputs).
    let mut last = vec![None::<usize>; graph.len()];
    let mut touch = |g: usize, at: usize| {
        let l = &mut last[g];
        *l = Some(l.map_or(at, |v: usize| v.max(at)));
    };
    for &id in &live {
        touch(group[id.index()], step[id.index()]);
        for inp in &graph.node(id).inputs {
            touch(group[inp.index()], step[id.index()]);
        }
    }
    for out in graph.outputs() {
        touch(group[out.index()], end);
        if !plan.survives_run(*out) {
            return Err(format!("output {out:?} does not survive the run"));
        }
    }
    // (first step, last step, storage, start byte, end byte) of every computed value, and of
    // every mirror (alive, as the plan says, from the segment that copies it in to its last
    // reader; the executor's copies make that the plan's own claim, checked for overlap here).
    let mut values: Vec<(usize, usize, Storage, usize, usize)> = live
        .iter()
        .filter(|id| group[id.index()] == id.index() && graph.node(**id).op().is_some())
        .map(|&id| {
            let (st, a, b) = span(id);
            (step[id.index()], last[id.index()].unwrap_or(step[id.index()]), st, a, b)
        })
        .collect();
    for m in plan.mirrors() {
        let len = graph.node(m.root).meta.nbytes_contiguous();
        let at = m.offset + plan.options.guard_bytes;
        values.push((m.first, m.last, Storage::Arena(m.backend), at, at + len));
        let readers_on_b = live.iter().filter(|t| plan.home[t.index()] == m.backend && graph.node(**t).op().is_some());
        for t in readers_on_b {
            let reads = graph.node(*t).inputs.iter().any(|i| NodeId(group[i.index()] as u32) == m.root);
            let at_step = step[t.index()];
            if reads && (at_step < m.first || at_step > m.last) {
                return Err(format!("{t:?} reads the mirror of {:?} outside its lifetime", m.root));
            }
        }
    }
    for (i, x) in values.iter().enumerate() {
        for y in &values[i + 1..] {
            let alive_together = x.0 <= y.1 && y.0 <= x.1;
            let share_bytes = x.2 == y.2 && x.3 < y.4 && y.3 < x.4;
            if alive_together && share_bytes {
                return Err(format!(
                    "values alive at steps {}..={} and {}..={} share bytes of {:?}",
                    x.0, x.1, y.0, y.1, x.2
                ));
            }
        }
    }
    // Each backend's arena against the most bytes alive at once there.
    for (bk, &arena) in plan.arenas.iter().enumerate() {
        let mut alive = vec![0usize; end + 2];
        for &(first, last, st, a, b) in &values {
            if st == Storage::Arena(bk) {
                let bytes = (b - a).div_ceil(ARENA_ALIGN) * ARENA_ALIGN;
                for v in &mut alive[first..=last] {
                    *v += bytes;
                }
            }
        }
        let bound = alive.iter().copied().max().unwrap_or(0);
        if arena as f64 > max_ratio * bound as f64 {
            return Err(format!(
                "backend {bk}'s arena is {arena} bytes, over {max_ratio} x the {bound} bytes alive at once"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_ops::DType;

    #[test]
    fn a_chain_reuses_memory_and_views_share_their_source() {
        let mut g = Graph::new();
        let x = g.input("x", DType::F32, [1024, 1, 1, 1]).unwrap();
        let a = g.silu(x).unwrap(); // 4 KiB
        let b = g.silu(a).unwrap();
        let v = g.view(b, [512, 1, 1, 1], [4, 2048, 2048, 2048], 2048).unwrap();
        let c = g.silu(v).unwrap();
        let d = g.silu(c).unwrap();
        g.mark_output(d).unwrap();
        let p = Plan::new(&g, PlanOptions::default());
        assert_eq!(p.tasks.len(), 4);
        let (sb, sv) = (p.slot(b.id()).unwrap(), p.slot(v.id()).unwrap());
        assert_eq!((sv.storage, sv.offset), (sb.storage, sb.offset + 2048));
        // a and c can share, b and d can share: two intervals of 4 KiB at most alive at once.
        assert_eq!(p.stats.lower_bound_bytes, 4096 + 4096);
        assert_eq!(p.stats.arena_bytes, p.stats.lower_bound_bytes);
        assert!(p.stats.unshared_bytes > p.stats.arena_bytes);
    }

    #[test]
    fn without_reuse_every_root_has_its_own_bytes() {
        let mut g = Graph::new();
        let x = g.input("x", DType::F32, [100, 1, 1, 1]).unwrap();
        let a = g.silu(x).unwrap();
        let b = g.silu(a).unwrap();
        let c = g.silu(b).unwrap();
        g.mark_output(c).unwrap();
        let p = Plan::new(&g, PlanOptions { reuse: false, guard_bytes: 16 });
        assert_eq!(p.stats.arena_bytes, 3 * aligned(400 + 32));
        for iv in &p.intervals {
            assert_eq!(p.slot(iv.root).unwrap().offset, iv.offset + 16);
        }
    }
}
