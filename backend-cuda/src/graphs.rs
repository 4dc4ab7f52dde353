//! CUDA graph capture and replay of whole steps.
//!
//! A step (one `compute` call) is identified by its [`StepKey`]: the ops with their params, the
//! descriptors of every input and output, and the device addresses they resolve to. Its
//! *structure* is the sequence of op kinds alone. The first time a structure is seen the step's
//! kernels are captured into a CUDA graph and instantiated; the same full key again replays the
//! executable graph with one launch. A step of the same structure that differs in shapes, params
//! or addresses (the next decode step: one more KV cell; the pool handed out other blocks) is
//! captured again and *updated* into the existing executable graph (`cuGraphExecUpdate`), which is
//! much cheaper than instantiating, provided it launched the same kernels in the same order (and,
//! when it calls cuBLAS, which picks kernels by shape, has the same shapes). The driver accepts
//! some updates that change a node's function but keeps the node's launch attributes (cuBLAS's
//! Hopper kernels run in thread-block clusters), which gave wrong results; so a different kernel
//! sequence is instantiated instead. Counters let tests and benches see which happened.

use std::collections::hash_map::DefaultHasher;
use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};

use cudarc::driver::sys;
use tessera_graph::BackendError;
use tessera_ops::{Op, TensorMeta};

use crate::errors::NAME;

/// What the graph cache has done.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GraphStats {
    /// Steps captured and instantiated as a new executable graph.
    pub captures: u64,
    /// Steps captured and updated into an existing executable graph of the same structure.
    pub updates: u64,
    /// Steps replayed from an executable graph without capturing.
    pub replays: u64,
    /// Steps run eagerly (graphs off, or a capture that failed).
    pub eager: u64,
    /// Captures the driver refused (the step then ran eagerly).
    pub capture_failures: u64,
    /// Kernels (and cuBLAS calls) the steps ran: each eager step its launches, each graph launch
    /// the launches its graph was captured from. Divided by the steps, a step's launch count.
    pub kernels: u64,
}

/// What identifies a step: see the module docs.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct StepKey {
    pub ops: Vec<Op>,
    pub metas: Vec<TensorMeta>,
    pub addrs: Vec<u64>,
}

impl StepKey {
    fn structure_hash(&self) -> u64 {
        let mut h = DefaultHasher::new();
        for op in &self.ops {
            op.name().hash(&mut h);
        }
        h.finish()
    }

    fn same_structure(&self, other: &StepKey) -> bool {
        self.ops.len() == other.ops.len() && self.ops.iter().zip(&other.ops).all(|(a, b)| a.name() == b.name())
    }

    fn same(&self, other: &StepKey) -> bool {
        self.addrs == other.addrs && self.metas == other.metas && self.ops == other.ops
    }
}

struct Entry {
    /// Unique among the entries this cache ever held.
    id: u64,
    /// Bumped whenever `key` changes (an update applied another step's kernels).
    epoch: u64,
    key: StepKey,
    /// The kernels the step launched (see `Cx::trace`).
    trace: Vec<&'static str>,
    exec: sys::CUgraphExec,
}

impl Entry {
    /// Whether a step of `key` that launched `trace` may be applied to this executable graph.
    fn updatable_to(&self, key: &StepKey, trace: &[&'static str]) -> bool {
        self.key.same_structure(key)
            && self.trace == trace
            && (!trace.contains(&crate::launch::BLAS_TRACE) || (self.key.metas == key.metas && self.key.ops == key.ops))
    }
}

/// Executable graphs by step structure, least recently captured evicted first.
/// Which executable graph a step ran as, and in which state: a prepared task list that ran as
/// `(id, epoch)` can be launched again directly while that entry still has that epoch.
pub(crate) type Ran = Option<(u64, u64)>;

pub(crate) struct Graphs {
    entries: HashMap<u64, Vec<Entry>>,
    /// Entry id -> its structure hash.
    by_id: HashMap<u64, u64>,
    next_id: u64,
    order: VecDeque<u64>,
    capacity: usize,
    pub stats: GraphStats,
}

fn driver(what: &str, r: sys::CUresult) -> Result<(), BackendError> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(BackendError::Device { backend: NAME.into(), detail: format!("{what}: {r:?}") })
    }
}

impl Graphs {
    pub fn new(capacity: usize) -> Graphs {
        Graphs {
            entries: HashMap::new(),
            by_id: HashMap::new(),
            next_id: 0,
            order: VecDeque::new(),
            capacity: capacity.max(1),
            stats: GraphStats::default(),
        }
    }

    /// Launches entry `id` again if it still holds the step it ran as `(id, epoch)`; `None` when
    /// it was evicted or updated to another step since.
    pub fn relaunch(&mut self, (id, epoch): (u64, u64), stream: sys::CUstream) -> Option<Result<(), BackendError>> {
        let hash = self.by_id.get(&id)?;
        let e = self.entries.get(hash)?.iter().find(|e| e.id == id && e.epoch == epoch)?;
        self.stats.replays += 1;
        self.stats.kernels += e.trace.len() as u64;
        // SAFETY: a live executable graph and our stream.
        Some(driver("cuGraphLaunch", unsafe { sys::cuGraphLaunch(e.exec, stream) }))
    }

    /// Runs a step: replays its graph when the key matches one, else captures `record` (which
    /// enqueues the step's work on `stream`) and launches the result. `record` may be called
    /// twice: once under capture and, if the driver refuses the capture, once eagerly. Returns
    /// which executable graph it ran as (`None`: eagerly).
    pub fn run(
        &mut self,
        stream: sys::CUstream,
        key: StepKey,
        mut record: impl FnMut() -> Result<Vec<&'static str>, BackendError>,
    ) -> Result<Ran, BackendError> {
        let hash = key.structure_hash();
        let bucket = self.entries.entry(hash).or_default();
        if let Some(i) = bucket.iter().position(|e| e.key.same(&key)) {
            self.stats.replays += 1;
            let e = &bucket[i];
            self.stats.kernels += e.trace.len() as u64;
            // SAFETY: a live executable graph and our stream.
            driver("cuGraphLaunch", unsafe { sys::cuGraphLaunch(e.exec, stream) })?;
            return Ok(Some((e.id, e.epoch)));
        }

        // No other thread of the process frees or allocates device memory until the capture ends.
        let wide = crate::device::device_wide();
        // SAFETY: our stream, not capturing. Relaxed mode: a kernel module loaded for the first
        // time inside the capture is allowed.
        driver("cuStreamBeginCapture", unsafe {
            sys::cuStreamBeginCapture_v2(stream, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        })?;
        let recorded = record();
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: ends the capture begun above, whatever `record` did.
        let ended = unsafe { sys::cuStreamEndCapture(stream, &mut graph) };
        drop(wide);
        if ended != sys::CUresult::CUDA_SUCCESS || graph.is_null() {
            // The driver refused the capture (a launch inside it failed, or the capture was
            // invalidated): run the step eagerly, where a genuine error is reported.
            if !graph.is_null() {
                // SAFETY: the graph just captured, owned here.
                unsafe { sys::cuGraphDestroy(graph) };
            }
            self.stats.capture_failures += 1;
            self.stats.eager += 1;
            let trace = record()?;
            self.stats.kernels += trace.len() as u64;
            return Ok(None);
        }
        let trace = match recorded {
            Ok(trace) => trace,
            Err(e) => {
                // SAFETY: the graph just captured, owned here.
                unsafe { sys::cuGraphDestroy(graph) };
                return Err(e);
            }
        };
        self.stats.kernels += trace.len() as u64;
        struct Owned(sys::CUgraph);
        impl Drop for Owned {
            fn drop(&mut self) {
                // SAFETY: the captured graph, destroyed once; executables do not need it.
                unsafe { sys::cuGraphDestroy(self.0) };
            }
        }
        let graph = Owned(graph);

        // Update the most recently used executable of this structure, if the driver accepts the
        // new graph's topology; otherwise keep it (steps of two shapes may alternate, e.g. prefill
        // and decode) and instantiate another.
        let bucket = self.entries.get_mut(&hash).expect("bucket created above");
        if let Some(i) = bucket.iter().rposition(|e| e.updatable_to(&key, &trace)) {
            // SAFETY: plain-data out-parameter, written by the driver.
            let mut info: sys::CUgraphExecUpdateResultInfo = unsafe { std::mem::zeroed() };
            // SAFETY: a live executable graph and a captured graph; launches already queued are
            // not affected by the update.
            let r = unsafe { sys::cuGraphExecUpdate_v2(bucket[i].exec, graph.0, &mut info) };
            if r == sys::CUresult::CUDA_SUCCESS {
                self.stats.updates += 1;
                let mut e = bucket.remove(i);
                e.key = key;
                e.epoch += 1;
                let ran = (e.id, e.epoch);
                let exec = e.exec;
                bucket.push(e);
                // SAFETY: as above.
                driver("cuGraphLaunch", unsafe { sys::cuGraphLaunch(exec, stream) })?;
                return Ok(Some(ran));
            }
        }
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        // SAFETY: a valid captured graph.
        driver("cuGraphInstantiate", unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph.0, 0) })?;
        self.stats.captures += 1;
        let id = self.next_id;
        self.next_id += 1;
        bucket.push(Entry { id, epoch: 0, key, trace, exec });
        self.by_id.insert(id, hash);
        self.order.push_back(hash);
        // SAFETY: just instantiated.
        let launched = driver("cuGraphLaunch", unsafe { sys::cuGraphLaunch(exec, stream) });
        self.evict();
        launched.map(|()| Some((id, 0)))
    }

    fn evict(&mut self) {
        while self.order.len() > self.capacity {
            let Some(hash) = self.order.pop_front() else { break };
            if let Some(bucket) = self.entries.get_mut(&hash)
                && !bucket.is_empty()
            {
                let e = bucket.remove(0);
                self.by_id.remove(&e.id);
                // SAFETY: an executable graph we own; launches already queued keep running.
                unsafe { sys::cuGraphExecDestroy(e.exec) };
            }
        }
    }

    /// Destroys every executable graph (when addresses they bake in go away, e.g. the scratch
    /// arena moves).
    pub fn clear(&mut self) {
        for (_, bucket) in self.entries.drain() {
            for e in bucket {
                // SAFETY: executables we own.
                unsafe { sys::cuGraphExecDestroy(e.exec) };
            }
        }
        self.order.clear();
        self.by_id.clear();
    }
}

impl Drop for Graphs {
    fn drop(&mut self) {
        self.clear();
    }
}
