//! # tessera-cuda: the CUDA backend
//!
//! [`CudaBackend`] runs every op on an NVIDIA GPU. It loads the CUDA libraries at run time
//! (cudarc's dynamic loading), so this crate builds and its tests run on machines without CUDA;
//! [`CudaBackend::new`] says why when no GPU is usable.
//!
//! # How a step runs
//!
//! 1. `compute` validates every task (shape rules, buffer bounds) on the host.
//! 2. The tasks' kernels are enqueued on the backend's one stream, each through its family's typed
//!    wrapper in `ops/` (kernels in `kernels/*.cu`, compiled by NVRTC at first use and cached on
//!    disk, see [`compile`]).
//! 3. With CUDA graphs on (the default), the whole step is captured into a graph the first time its
//!    structure is seen and replayed afterwards ([`GraphStats`]).
//! 4. Nothing waits for the GPU until results are asked for (`read`, `synchronize`); data errors
//!    found by kernels (a row id out of range) are reported there.
//!
//! Memory comes from a caching pool ([`PoolStats`]); writes of 1 MiB and more go through pinned
//! staging memory.

mod ceilings;
pub mod compile;
mod device;
mod errors;
mod graphs;
mod launch;
mod ops;
mod pool;
mod profile;
mod staging;

use cudarc::driver::{result, sys};
use smallvec::SmallVec;
use tessera_graph::{Backend, BackendError, BufferId, PreparedId, Task, TensorRef, check_range};
use tessera_ops::{Op, TensorMeta};

pub use ceilings::Ceilings;
pub use compile::{CompileStats, Module};
pub use device::{DeviceInfo, libraries_present, nvrtc_version};
pub use errors::CudaError;
pub use graphs::GraphStats;
pub use pool::{PoolStats, size_class};

use device::Device;
use errors::{ErrorRecord, NAME};
use graphs::{Graphs, StepKey};
use launch::{Blas, Cx, TensorArg};
use pool::Pool;
use staging::{STAGING_THRESHOLD, Staging};

/// How to set up a [`CudaBackend`].
#[derive(Debug, Clone)]
pub struct CudaOptions {
    /// Device ordinal.
    pub device: usize,
    /// Capture steps into CUDA graphs and replay them (default on; `TESSERA_CUDA_GRAPHS=0` turns
    /// it off).
    pub graphs: bool,
    /// Executable graphs kept at most.
    pub graph_capacity: usize,
    /// Compile kernels that have one for the device's architecture-specific features (Hopper's
    /// `wgmma` in `mmq` and in the prefill attention); off, every kernel takes its portable path,
    /// the one other GPUs run (default on; `TESSERA_CUDA_ARCH_SPECIFIC=0` turns it off, to test
    /// that path on Hopper).
    pub arch_specific: bool,
    /// Time every op with CUDA events and print the totals per op and shapes to stderr when the
    /// backend is dropped; steps then run eagerly (default off; `TESSERA_CUDA_PROFILE=1`).
    pub profile: bool,
    /// Let each kernel start while the one before it is finishing (programmatic dependent launch,
    /// sm_90 and later; every kernel waits for its predecessor's results before it reads
    /// anything). Default on; `TESSERA_CUDA_OVERLAP=0` turns it off, to compare.
    pub overlap_launches: bool,
}

impl Default for CudaOptions {
    fn default() -> Self {
        let on = |var| std::env::var(var).map(|v| v != "0").unwrap_or(true);
        CudaOptions {
            device: 0,
            graphs: on("TESSERA_CUDA_GRAPHS"),
            graph_capacity: 64,
            arch_specific: on("TESSERA_CUDA_ARCH_SPECIFIC"),
            profile: std::env::var("TESSERA_CUDA_PROFILE").is_ok_and(|v| v != "0"),
            overlap_launches: on("TESSERA_CUDA_OVERLAP"),
        }
    }
}

/// Counters of everything the backend did, for tests, benches and reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CudaStats {
    pub pool: PoolStats,
    pub graphs: GraphStats,
    pub compile: CompileStats,
}

struct Block {
    ptr: u64,
    len: usize,
    class: usize,
}

/// The CUDA backend. See the crate docs.
pub struct CudaBackend {
    dev: Device,
    pool: Pool,
    blocks: Vec<Option<Block>>,
    free_ids: Vec<u32>,
    kernels: compile::Kernels,
    blas: Blas,
    /// Scratch device memory shared by the tasks of a step: (address, class size).
    scratch: Option<(u64, usize)>,
    /// The device [`ErrorRecord`] (one pool block, zeroed).
    errors: u64,
    /// Zeroed device counters (`COUNTER_BYTES`) that a kernel's blocks coordinate through (mmq's
    /// split tiles); every kernel leaves them zeroed.
    counters: u64,
    /// [`Cx::dense_pairs`]: written once here, read by every step.
    dense_pairs: u64,
    graphs: Graphs,
    use_graphs: bool,
    /// Whether launches overlap ([`CudaOptions::overlap_launches`] on a device that has it).
    overlap: bool,
    staging: Option<Staging>,
    /// Per-op device times, when profiling ([`CudaOptions::profile`]).
    profile: Option<profile::Profile>,
    /// Task lists kept by `prepare`, by [`PreparedId`].
    kept: Vec<Option<KeptStep>>,
}

/// A pool block of `bytes` zeroed bytes that lives as long as the backend.
fn alloc_zeroed(pool: &mut Pool, bytes: usize, what: &'static str) -> Result<u64, CudaError> {
    let (ptr, _) = pool.alloc(bytes)?;
    // SAFETY: a fresh block of at least `bytes` bytes.
    unsafe { result::memset_d8_sync(ptr, 0, bytes) }.map_err(CudaError::driver(what))?;
    Ok(ptr)
}

impl CudaBackend {
    /// A backend on device 0 with default options.
    pub fn new() -> Result<CudaBackend, CudaError> {
        Self::with_options(CudaOptions::default())
    }

    pub fn with_options(opts: CudaOptions) -> Result<CudaBackend, CudaError> {
        let dev = Device::open(opts.device)?;
        let kernels =
            compile::Kernels::new(dev.ctx.clone(), dev.info.arch(), opts.arch_specific, dev.info.nvrtc_version);
        let mut pool = Pool::new(dev.stream.cu_stream());
        let errors = alloc_zeroed(&mut pool, std::mem::size_of::<ErrorRecord>(), "zeroing the error record")?;
        let counters = alloc_zeroed(&mut pool, launch::COUNTER_BYTES, "zeroing the block counters")?;
        let table = ops::DensePairs::table();
        let (dense_pairs, _) = pool.alloc(table.len())?;
        // SAFETY: a fresh block of at least table.len() bytes; synchronous copy from host memory.
        unsafe { result::memcpy_htod_sync(dense_pairs, &table) }
            .map_err(CudaError::driver("writing the pair lists"))?;
        let overlap = opts.overlap_launches && dev.info.compute_capability.0 >= 9;
        Ok(CudaBackend {
            dev,
            pool,
            blocks: Vec::new(),
            free_ids: Vec::new(),
            kernels,
            blas: Blas::new(),
            scratch: None,
            errors,
            counters,
            dense_pairs,
            graphs: Graphs::new(opts.graph_capacity),
            use_graphs: opts.graphs && !opts.profile,
            overlap,
            staging: None,
            profile: opts.profile.then(profile::Profile::default),
            kept: Vec::new(),
        })
    }

    /// Whether a GPU is usable here, and which; `Err` says why not (no driver, no device, ...).
    pub fn probe() -> Result<DeviceInfo, CudaError> {
        Device::open(0).map(|d| d.info)
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.dev.info
    }

    pub fn stats(&self) -> CudaStats {
        CudaStats { pool: self.pool.stats, graphs: self.graphs.stats, compile: self.kernels.stats }
    }

    /// Turns CUDA graph capture on or off (off: every step runs eagerly).
    pub fn set_graphs(&mut self, on: bool) {
        let on = on && self.profile.is_none();
        self.use_graphs = on;
    }

    /// Compiles (or loads from the disk cache) every kernel module now, so that first use does not.
    pub fn warm_up(&mut self) -> Result<(), CudaError> {
        self.kernels.load_all()
    }

    fn block(&self, id: BufferId) -> Result<&Block, BackendError> {
        self.blocks
            .get(id.0 as usize)
            .and_then(|b| b.as_ref())
            .ok_or(BackendError::UnknownBuffer { backend: NAME.into(), buffer: id })
    }

    /// The device address of a placed tensor after checking it lies inside its buffer.
    fn address(&self, r: &TensorRef) -> Result<u64, BackendError> {
        let b = self.block(r.buffer)?;
        check_range(NAME, r.buffer, b.len, r.offset, r.meta.span_bytes())?;
        Ok(b.ptr + r.offset as u64)
    }

    fn stream(&self) -> sys::CUstream {
        self.dev.stream.cu_stream()
    }

    /// Waits for queued work and reports the first data error a kernel recorded since the last
    /// check.
    fn sync_and_check(&mut self) -> Result<(), BackendError> {
        self.dev.ctx.bind_to_thread().map_err(CudaError::driver("binding the context"))?;
        // SAFETY: our stream.
        unsafe { result::stream::synchronize(self.stream()) }.map_err(CudaError::driver("synchronising the stream"))?;
        let mut rec = ErrorRecord::default();
        // SAFETY: `errors` holds one ErrorRecord; the stream is idle.
        unsafe { result::memcpy_dtoh_sync(bytemuck::bytes_of_mut(&mut rec), self.errors) }
            .map_err(CudaError::driver("reading the error record"))?;
        if let Some(e) = rec.to_kernel_error() {
            // SAFETY: as above.
            unsafe { result::memset_d8_sync(self.errors, 0, std::mem::size_of::<ErrorRecord>()) }
                .map_err(CudaError::driver("clearing the error record"))?;
            return Err(BackendError::Kernel(e));
        }
        Ok(())
    }

    /// Makes the scratch arena at least `bytes` long. Growing it moves it, so every captured
    /// graph (which bakes in its address) is dropped.
    fn ensure_scratch(&mut self, bytes: usize) -> Result<u64, BackendError> {
        if bytes == 0 {
            return Ok(self.scratch.map_or(0, |s| s.0));
        }
        if let Some((ptr, class)) = self.scratch
            && class >= bytes
        {
            return Ok(ptr);
        }
        if let Some((ptr, class)) = self.scratch.take() {
            self.pool.free(ptr, class);
        }
        self.graphs.clear();
        let (ptr, class) = self.pool.alloc(bytes)?;
        self.scratch = Some((ptr, class));
        Ok(ptr)
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        if let Some(p) = &self.profile {
            eprint!("{}", p.report());
        }
        let _ = self.dev.ctx.bind_to_thread();
        let _wide = device::device_wide();
        // SAFETY: our stream; waits for queued work before memory goes away.
        let _ = unsafe { result::stream::synchronize(self.dev.stream.cu_stream()) };
        self.graphs.clear();
        if let Some(ws) = self.blas.destroy() {
            // SAFETY: the workspace block, no longer used by cuBLAS.
            let _ = unsafe { result::free_sync(ws) };
        }
        for b in self.blocks.drain(..).flatten() {
            // SAFETY: blocks we allocated; the stream is idle.
            let _ = unsafe { result::free_sync(b.ptr) };
        }
        if let Some((ptr, _)) = self.scratch.take() {
            // SAFETY: as above.
            let _ = unsafe { result::free_sync(ptr) };
        }
        // SAFETY: as above.
        let _ = unsafe { result::free_sync(self.errors) };
        // SAFETY: as above.
        let _ = unsafe { result::free_sync(self.counters) };
        // SAFETY: as above.
        let _ = unsafe { result::free_sync(self.dense_pairs) };
        self.pool.release_all();
        // The staging events and pinned chunks go while the context is alive: `dev`, declared
        // first, may hold its last reference (compute-sanitizer saw cuEventDestroy fail with
        // CONTEXT_IS_DESTROYED at exit).
        self.staging = None;
    }
}

/// One task with its tensors resolved to device descriptors.
struct Resolved<'t, 'g> {
    task: &'t Task<'g>,
    inputs: SmallVec<[TensorArg; 4]>,
    output: TensorArg,
}

impl Backend for CudaBackend {
    fn name(&self) -> &str {
        NAME
    }

    fn supports(&self, op: &Op, inputs: &[TensorMeta]) -> bool {
        let refs: SmallVec<[&TensorMeta; 4]> = inputs.iter().collect();
        !op.is_view() && tessera_ops::infer(op, &refs).is_ok() && ops::supports(op, inputs)
    }

    fn alloc(&mut self, bytes: usize) -> Result<BufferId, BackendError> {
        self.dev.ctx.bind_to_thread().map_err(CudaError::driver("binding the context"))?;
        let (ptr, class) = self.pool.alloc(bytes)?;
        let block = Block { ptr, len: bytes, class };
        let id = match self.free_ids.pop() {
            Some(i) => {
                self.blocks[i as usize] = Some(block);
                i
            }
            None => {
                self.blocks.push(Some(block));
                (self.blocks.len() - 1) as u32
            }
        };
        Ok(BufferId(id))
    }

    fn free(&mut self, buffer: BufferId) {
        if let Some(slot) = self.blocks.get_mut(buffer.0 as usize)
            && let Some(b) = slot.take()
        {
            self.pool.free(b.ptr, b.class);
            self.free_ids.push(buffer.0);
        }
    }

    fn size(&self, buffer: BufferId) -> Result<usize, BackendError> {
        Ok(self.block(buffer)?.len)
    }

    fn write(&mut self, buffer: BufferId, offset: usize, data: &[u8]) -> Result<(), BackendError> {
        let b = self.block(buffer)?;
        check_range(NAME, buffer, b.len, offset, data.len())?;
        let dst = b.ptr + offset as u64;
        if data.is_empty() {
            return Ok(());
        }
        self.dev.ctx.bind_to_thread().map_err(CudaError::driver("binding the context"))?;
        let stream = self.stream();
        if data.len() >= STAGING_THRESHOLD {
            if self.staging.is_none() {
                self.staging = Some(Staging::new()?);
            }
            let staging = self.staging.as_mut().expect("created above");
            return Ok(staging.upload(stream, dst, data)?);
        }
        // SAFETY: `dst..dst + len` lies in the block (checked); a copy from pageable memory
        // has read `data` when the call returns.
        unsafe { result::memcpy_htod_async(dst, data, stream) }.map_err(CudaError::driver("copying to the device"))?;
        Ok(())
    }

    fn read(&mut self, buffer: BufferId, offset: usize, out: &mut [u8]) -> Result<(), BackendError> {
        let b = self.block(buffer)?;
        check_range(NAME, buffer, b.len, offset, out.len())?;
        let src = b.ptr + offset as u64;
        self.sync_and_check()?;
        if out.is_empty() {
            return Ok(());
        }
        // SAFETY: `src..src + len` lies in the block; the stream is idle.
        unsafe { result::memcpy_dtoh_sync(out, src) }.map_err(CudaError::driver("copying from the device"))?;
        Ok(())
    }

    fn synchronize(&mut self) -> Result<(), BackendError> {
        self.sync_and_check()
    }

    fn release_cached(&mut self) -> Result<(), BackendError> {
        self.dev.ctx.bind_to_thread().map_err(CudaError::driver("binding the context"))?;
        Ok(self.pool.trim()?)
    }

    fn counters(&self) -> Vec<(&'static str, u64)> {
        let s = self.stats();
        vec![
            ("graph_captures", s.graphs.captures),
            ("graph_updates", s.graphs.updates),
            ("graph_replays", s.graphs.replays),
            ("eager_steps", s.graphs.eager),
            ("capture_failures", s.graphs.capture_failures),
            ("kernel_launches", s.graphs.kernels),
            ("pool_allocs", s.pool.allocs),
            ("pool_reuses", s.pool.reuses),
            ("pool_device_allocs", s.pool.device_allocs),
            ("pool_peak_bytes", s.pool.peak_bytes as u64),
            ("modules_compiled", s.compile.compiled),
            ("modules_from_cache", s.compile.cache_hits),
        ]
    }

    fn compute(&mut self, tasks: &[Task<'_>]) -> Result<(), BackendError> {
        if tasks.is_empty() {
            return Ok(());
        }
        self.dev.ctx.bind_to_thread().map_err(CudaError::driver("binding the context"))?;
        let (resolved, scratch) = self.resolve(tasks)?;
        self.execute(&resolved, scratch).map(|_| ())
    }

    /// Checks the tasks once and keeps them with their resolved arguments; running them again
    /// ([`Backend::compute_prepared`]) relaunches the step's executable graph directly while it
    /// still holds this step, with no per-task work on the host.
    fn prepare(&mut self, tasks: &[Task<'_>]) -> Result<Option<PreparedId>, BackendError> {
        if tasks.is_empty() || self.profile.is_some() {
            return Ok(None);
        }
        let (resolved, scratch) = self.resolve(tasks)?;
        let kept = KeptStep {
            tasks: resolved
                .iter()
                .map(|r| KeptTask {
                    node: r.task.node,
                    op: r.task.op.clone(),
                    inputs: r.task.inputs.clone(),
                    output: r.task.output,
                    args: r.inputs.clone(),
                    out_arg: r.output,
                })
                .collect(),
            scratch,
            ran: None,
        };
        let id = match self.kept.iter().position(Option::is_none) {
            Some(i) => {
                self.kept[i] = Some(kept);
                i
            }
            None => {
                self.kept.push(Some(kept));
                self.kept.len() - 1
            }
        };
        Ok(Some(PreparedId(id as u32)))
    }

    fn compute_prepared(&mut self, id: PreparedId) -> Result<(), BackendError> {
        let i = id.0 as usize;
        let Some(mut kept) = self.kept.get_mut(i).and_then(Option::take) else {
            return Err(BackendError::Unsupported {
                backend: NAME.into(),
                op: "prepared task list",
                why: format!("{id:?} is not a task list this backend kept"),
            });
        };
        let result = self.run_kept(&mut kept);
        self.kept[i] = Some(kept);
        result
    }

    fn release_prepared(&mut self, id: PreparedId) {
        if let Some(slot) = self.kept.get_mut(id.0 as usize) {
            *slot = None;
        }
    }
}

/// A task with owned copies of what running it again needs.
struct KeptTask {
    node: tessera_graph::NodeId,
    op: Op,
    inputs: SmallVec<[TensorRef; 4]>,
    output: TensorRef,
    args: SmallVec<[TensorArg; 4]>,
    out_arg: TensorArg,
}

/// A task list kept by `prepare`: its tasks, the scratch bytes they need, and the executable
/// graph it last ran as (with the scratch address baked into it).
struct KeptStep {
    tasks: Vec<KeptTask>,
    scratch: usize,
    ran: Option<((u64, u64), u64)>,
}

impl CudaBackend {
    /// Checks every task on the host (shape rules, buffer bounds, kernel support) and resolves
    /// its arguments to device addresses; returns them with the scratch bytes the step needs.
    fn resolve<'t, 'g>(&self, tasks: &'t [Task<'g>]) -> Result<(Vec<Resolved<'t, 'g>>, usize), BackendError> {
        let mut resolved = Vec::with_capacity(tasks.len());
        let mut scratch = 0usize;
        for task in tasks {
            let metas: SmallVec<[&TensorMeta; 4]> = task.inputs.iter().map(|r| &r.meta).collect();
            let inferred = tessera_ops::infer(task.op, &metas).map_err(|e| launch::unsupported(task, e.to_string()))?;
            if inferred.ne != task.output.meta.ne || inferred.dtype != task.output.meta.dtype {
                return Err(launch::unsupported(task, "the output descriptor disagrees with the shape rules"));
            }
            let inputs = task
                .inputs
                .iter()
                .map(|r| Ok(TensorArg::new(self.address(r)?, &r.meta)))
                .collect::<Result<SmallVec<[TensorArg; 4]>, BackendError>>()?;
            let output = TensorArg::new(self.address(&task.output)?, &task.output.meta);
            let in_metas: SmallVec<[TensorMeta; 4]> = task.inputs.iter().map(|r| r.meta).collect();
            if !ops::supports(task.op, &in_metas) {
                return Err(launch::unsupported(task, "no CUDA kernel for these inputs"));
            }
            scratch = scratch.max(ops::scratch_bytes(task));
            resolved.push(Resolved { task, inputs, output });
        }
        Ok((resolved, scratch))
    }

    /// A kept step: relaunched when its executable graph still holds it and the scratch did not
    /// move, else enqueued (and captured) again from its kept tasks.
    fn run_kept(&mut self, kept: &mut KeptStep) -> Result<(), BackendError> {
        self.dev.ctx.bind_to_thread().map_err(CudaError::driver("binding the context"))?;
        let scratch = self.ensure_scratch(kept.scratch)?;
        if self.use_graphs
            && let Some((ran, at)) = kept.ran
            && at == scratch
        {
            let stream = self.stream();
            if let Some(done) = self.graphs.relaunch(ran, stream) {
                return done;
            }
        }
        let tasks: Vec<Task<'_>> = kept
            .tasks
            .iter()
            .map(|t| Task { node: t.node, op: &t.op, inputs: t.inputs.clone(), output: t.output })
            .collect();
        let resolved: Vec<Resolved<'_, '_>> = tasks
            .iter()
            .zip(&kept.tasks)
            .map(|(task, t)| Resolved { task, inputs: t.args.clone(), output: t.out_arg })
            .collect();
        let ran = self.execute(&resolved, kept.scratch)?;
        kept.ran = ran.map(|r| (r, scratch));
        Ok(())
    }

    /// Enqueues resolved tasks: replayed or captured as a CUDA graph when graphs are on, else
    /// eagerly. Returns the executable graph the step ran as.
    fn execute(&mut self, resolved: &[Resolved<'_, '_>], scratch: usize) -> Result<graphs::Ran, BackendError> {
        let scratch = self.ensure_scratch(scratch)?;
        let stream = self.stream();
        let CudaBackend {
            dev,
            kernels,
            blas,
            pool,
            graphs,
            use_graphs,
            overlap,
            errors,
            counters,
            dense_pairs,
            profile,
            ..
        } = self;
        let mut alloc_workspace = || -> Result<u64, CudaError> { pool.alloc(launch::BLAS_WORKSPACE).map(|(p, _)| p) };
        let mut record = || -> Result<Vec<&'static str>, BackendError> {
            let mut trace = Vec::new();
            let mut cx = Cx {
                stream: &dev.stream,
                kernels,
                info: &dev.info,
                scratch,
                errors: *errors,
                counters: *counters,
                blas,
                alloc_workspace: &mut alloc_workspace,
                trace: &mut trace,
                overlap: *overlap,
                dense_pairs: *dense_pairs,
            };
            let mut marks = Vec::new();
            for r in resolved {
                if let Some(p) = profile.as_ref() {
                    marks.push(p.begin(r.task, stream)?);
                }
                ops::run(&mut cx, r.task, &r.inputs, r.output)?;
                if let (Some(p), Some(m)) = (profile.as_ref(), marks.last()) {
                    p.end(m, stream)?;
                }
            }
            if let Some(p) = profile.as_mut() {
                p.finish(marks)?;
            }
            Ok(trace)
        };
        if !*use_graphs {
            graphs.stats.eager += 1;
            let trace = record()?;
            graphs.stats.kernels += trace.len() as u64;
            return Ok(None);
        }
        let mut key = StepKey { ops: Vec::with_capacity(resolved.len()), metas: Vec::new(), addrs: Vec::new() };
        for r in resolved {
            key.ops.push(r.task.op.clone());
            for (meta, arg) in
                r.task.inputs.iter().map(|x| &x.meta).zip(&r.inputs).chain([(&r.task.output.meta, &r.output)])
            {
                key.metas.push(*meta);
                key.addrs.push(arg.data);
            }
        }
        key.addrs.push(scratch);
        graphs.run(stream, key, record)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn only_mmq_the_prefill_attention_and_the_chunked_delta_rule_on_hopper_get_the_arch_specific_target() {
        use crate::Module;
        use crate::compile::target;
        assert_eq!(target(Module::Mmq, "sm_90", true), "sm_90a");
        assert_eq!(target(Module::AttentionPrefill, "sm_90", true), "sm_90a");
        assert_eq!(target(Module::AttentionPrefill, "sm_80", true), "sm_80");
        assert_eq!(target(Module::AttentionDecode, "sm_90", true), "sm_90");
        assert_eq!(target(Module::Attention, "sm_90", true), "sm_90");
        assert_eq!(target(Module::DeltaNetChunked, "sm_90", true), "sm_90a");
        assert_eq!(target(Module::DeltaNetChunked, "sm_90", false), "sm_90");
        assert_eq!(target(Module::DeltaNet, "sm_90", true), "sm_90");
        assert_eq!(target(Module::Conv, "sm_90", true), "sm_90");
        assert_eq!(target(Module::Mmq, "sm_90", false), "sm_90");
        assert_eq!(target(Module::Mmq, "sm_80", true), "sm_80");
        assert_eq!(target(Module::Mmq, "sm_100", true), "sm_100");
        assert_eq!(target(Module::Gemv, "sm_90", true), "sm_90");
    }

    #[test]
    fn a_kernel_dir_replaces_the_files_it_has() {
        use crate::Module;
        let dir = std::env::temp_dir().join(format!("tessera-kernel-dir-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("rope.cu"), "// trying a change\n").unwrap();
        let rope = Module::Rope.source_from(Some(&dir));
        assert!(rope.contains("// trying a change") && rope.contains("struct Tensor"), "{rope}");
        assert!(!rope.contains("extern \"C\" __global__"));
        // files the folder lacks come from the binary
        assert_eq!(Module::Data.source_from(Some(&dir)), Module::Data.source_from(None));
        // a shared header replaces the built-in one in every module that has it
        std::fs::write(dir.join("matmul.cuh"), "// a header change\n").unwrap();
        for m in [Module::Pack, Module::Gemv, Module::Moe] {
            let src = m.source_from(Some(&dir));
            assert!(src.contains("// a header change") && !src.contains("float weight_value("), "{}", m.name());
        }
        assert_eq!(Module::GemvOne.source_from(Some(&dir)), Module::GemvOne.source_from(None));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn every_module_has_its_source() {
        for m in crate::Module::ALL {
            let src = m.source();
            assert!(src.contains("struct Tensor"), "{} lacks common.cuh", m.name());
            assert!(src.contains("extern \"C\" __global__"), "kernels/{}.cu defines no kernel", m.name());
            for (file, _) in m.headers() {
                assert!(src.contains(&format!("#line 1 \"{file}\"")), "{} lacks {file}", m.name());
            }
        }
    }
}
