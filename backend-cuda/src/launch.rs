//! What a kernel wrapper works with: tensors as device descriptors ([`TensorArg`]) and the launch
//! context ([`Cx`]) of one task.

use std::sync::Arc;

use std::ffi::c_void;
use std::marker::PhantomData;

use cudarc::driver::{CudaFunction, CudaStream, DeviceRepr, LaunchConfig, sys};
use smallvec::SmallVec;
use tessera_graph::{BackendError, Task};
use tessera_ops::{DType, TensorMeta};

use crate::compile::{Kernel, Kernels};
use crate::device::DeviceInfo;
use crate::errors::{CudaError, NAME};

/// A tensor as kernels receive it, by value; mirrors `struct Tensor` in kernels/common.cuh:
/// TAG(tensor-arg). `data` is the address of element (0, 0, 0, 0).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TensorArg {
    pub data: u64,
    pub ne: [i64; 4],
    pub nb: [i64; 4],
}

// SAFETY: `TensorArg` is `repr(C)` plain data matching the kernels' `struct Tensor` layout
// (one 8-byte pointer, then two arrays of four i64).
unsafe impl DeviceRepr for TensorArg {}

impl TensorArg {
    pub fn new(data: u64, meta: &TensorMeta) -> TensorArg {
        TensorArg { data, ne: meta.ne.map(|n| n as i64), nb: meta.nb.map(|n| n as i64) }
    }

    pub fn nelements(&self) -> i64 {
        self.ne.iter().product()
    }
}

/// A lazily created cuBLAS handle bound to the backend's stream, with a fixed workspace so that
/// cuBLAS calls can be captured into CUDA graphs.
pub(crate) struct Blas {
    handle: Option<sys_blas::cublasHandle_t>,
    workspace: Option<(u64, usize)>,
}

pub(crate) use cudarc::cublas::sys as sys_blas;

/// The trace entry of a cuBLAS call (cuBLAS picks its kernels by shape, invisibly to us).
pub(crate) const BLAS_TRACE: &str = "cublas";

/// cuBLAS workspace bytes (cuBLAS asks for up to 32 MiB on Hopper).
pub(crate) const BLAS_WORKSPACE: usize = 32 << 20;

/// Most blocks along a grid's y or z dimension.
pub(crate) const GRID_YZ: i64 = 65535;

impl Blas {
    pub fn new() -> Blas {
        Blas { handle: None, workspace: None }
    }

    /// The handle; `workspace` is a device block of [`BLAS_WORKSPACE`] bytes the caller owns
    /// (from the pool) for the handle's lifetime.
    pub fn handle(
        &mut self,
        stream: &CudaStream,
        workspace: impl FnOnce() -> Result<u64, CudaError>,
    ) -> Result<sys_blas::cublasHandle_t, CudaError> {
        if let Some(h) = self.handle {
            return Ok(h);
        }
        // SAFETY: checks that the library loads before calling into it.
        if !unsafe { sys_blas::is_culib_present() } {
            return Err(CudaError::Cublas {
                what: "loading cuBLAS".into(),
                detail: "libcublas.so was not found".into(),
            });
        }
        let err = |what: &'static str| {
            move |e: cudarc::cublas::result::CublasError| CudaError::Cublas {
                what: what.into(),
                detail: format!("{e:?}"),
            }
        };
        let h = cudarc::cublas::result::create_handle().map_err(err("creating a handle"))?;
        let ws = workspace()?;
        // SAFETY: `h` is a fresh handle; the stream and the workspace outlive it (both are owned
        // by the backend, which destroys the handle first).
        unsafe {
            cudarc::cublas::result::set_stream(h, stream.cu_stream() as _).map_err(err("setting the stream"))?;
            sys_blas::cublasSetWorkspace_v2(h, ws as *mut std::ffi::c_void, BLAS_WORKSPACE)
                .result()
                .map_err(err("setting the workspace"))?;
        }
        self.handle = Some(h);
        self.workspace = Some((ws, BLAS_WORKSPACE));
        Ok(h)
    }

    /// Destroys the handle; returns the workspace block for the caller to free.
    pub fn destroy(&mut self) -> Option<u64> {
        if let Some(h) = self.handle.take() {
            // SAFETY: created by `create_handle`, destroyed once.
            let _ = unsafe { cudarc::cublas::result::destroy_handle(h) };
        }
        self.workspace.take().map(|(p, _)| p)
    }
}

/// Bytes of the backend's block counters ([`Cx::counters`]).
pub(crate) const COUNTER_BYTES: usize = 256;

/// Everything a kernel wrapper needs to launch one task's kernels.
pub(crate) struct Cx<'a> {
    pub stream: &'a Arc<CudaStream>,
    pub kernels: &'a mut Kernels,
    pub info: &'a DeviceInfo,
    /// Scratch device memory for this task (at least what the op's `scratch_bytes` asked for),
    /// reused by the next task; 0 when none was asked for.
    pub scratch: u64,
    /// The device `ErrorRecord` kernels report data errors to.
    pub errors: u64,
    /// `COUNTER_BYTES` of zeroed device counters for a kernel whose blocks coordinate (mmq's
    /// split tiles); the kernel leaves them zeroed (kernels on the stream run one after another).
    pub counters: u64,
    pub blas: &'a mut Blas,
    /// Allocates cuBLAS's workspace on first use.
    pub alloc_workspace: &'a mut dyn FnMut() -> Result<u64, CudaError>,
    /// The kernels this step launched, in order (`"cublas"` for a cuBLAS call): what decides
    /// whether a captured graph may be applied to an executable one as an update.
    pub trace: &'a mut Vec<&'static str>,
    /// Launch kernels with programmatic stream serialization ([`Launch`]).
    pub overlap: bool,
    /// The constant pair lists a dense mul_mat of a few tokens hands `moe_mma_*` as one expert
    /// (`ops::DensePairs`).
    pub dense_pairs: u64,
}

/// One kernel launch being put together: the addresses of its arguments, in the kernel's
/// parameter order, then [`Launch::launch`].
///
/// With `overlap` (the default on sm_90 and later, [`crate::CudaOptions::overlap_launches`]) the
/// launch carries programmatic stream serialization: the GPU may launch the kernel as soon as the
/// blocks of the one before it on the stream have exited, without waiting for that grid's
/// completion to be flushed, so launch latency hides behind the previous kernel's end (also inside
/// a captured graph, as programmatic edges), and the dense GEMVs have L2 fetch their first weight
/// rows meanwhile. That is safe because every kernel begins with `grid_begin()`
/// (kernels/common.cuh), which waits until the previous grid has completed and its writes are
/// visible before anything else runs (only L2 prefetches may come first); a test checks every
/// kernel source for it. cudarc's `LaunchArgs` cannot set launch attributes, hence this small
/// builder over `cuLaunchKernelEx`.
pub(crate) struct Launch<'a> {
    stream: &'a CudaStream,
    kernel: Kernel,
    func: CudaFunction,
    overlap: bool,
    args: SmallVec<[*mut c_void; 16]>,
    /// The argument values are borrowed for 'a.
    values: PhantomData<&'a ()>,
}

impl<'a> Launch<'a> {
    /// Adds the next argument; `value` must outlive the launch.
    pub fn arg<T: DeviceRepr>(&mut self, value: &'a T) -> &mut Self {
        self.args.push(value as *const T as *mut c_void);
        self
    }

    /// Enqueues the kernel; an error names it.
    ///
    /// # Safety
    ///
    /// The arguments must match the kernel's parameters in number, order and type, and the kernel
    /// must stay within the memory its arguments describe.
    pub unsafe fn launch(&mut self, cfg: LaunchConfig) -> Result<(), BackendError> {
        let mut attr = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            // SAFETY: an all-zero union is a valid value of every one of its plain-data fields.
            value: unsafe { std::mem::zeroed() },
        };
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: self.overlap as u32,
        };
        // SAFETY: `config` and `attr` live across the call; the argument addresses point at
        // values that outlive `self` (the caller's contract covers what they hold).
        unsafe { sys::cuLaunchKernelEx(&config, self.func.cu_function(), self.args.as_mut_ptr(), std::ptr::null_mut()) }
            .result()
            .map_err(|e| launch_error(self.kernel, e))
    }
}

impl<'a> Cx<'a> {
    /// A launch of `kernel` on the task's stream (its module compiled on first use): add the
    /// arguments, then [`Launch::launch`].
    pub fn kernel(&mut self, kernel: Kernel) -> Result<Launch<'a>, BackendError> {
        let func = self.kernels.get(kernel)?.clone();
        Ok(self.launch_of(kernel, func))
    }

    /// A launch of `func`, recorded in the step's trace as `kernel`.
    fn launch_of(&mut self, kernel: Kernel, func: CudaFunction) -> Launch<'a> {
        self.trace.push(kernel.name);
        Launch { stream: self.stream, kernel, func, overlap: self.overlap, args: SmallVec::new(), values: PhantomData }
    }

    /// The cuBLAS handle, bound to the stream.
    pub fn cublas(&mut self) -> Result<sys_blas::cublasHandle_t, BackendError> {
        self.trace.push(BLAS_TRACE);
        let alloc = &mut *self.alloc_workspace;
        Ok(self.blas.handle(self.stream, alloc)?)
    }

    /// A launch of a generated kernel (an elementwise program's entry `name`, loaded as `func`).
    pub fn generated(&mut self, name: &'static str, func: CudaFunction) -> Launch<'a> {
        self.launch_of(Kernel::new(crate::compile::Module::Elementwise, name), func)
    }

    /// How many blocks of `kernel` (`threads` a block, `shared` bytes of dynamic shared memory)
    /// the whole GPU holds at once: what one-wave grids are sized by.
    pub fn resident_blocks(&mut self, kernel: Kernel, threads: u32, shared: u32) -> Result<u64, BackendError> {
        let per_sm = self
            .kernels
            .get(kernel)?
            .occupancy_max_active_blocks_per_multiprocessor(threads, shared as usize, None)
            .map_err(|e| launch_error(kernel, e))?;
        Ok(per_sm.max(1) as u64 * self.info.multiprocessors.max(1) as u64)
    }

    /// Raises `kernel`'s dynamic shared memory limit to `bytes` (needed above 48 KiB).
    pub fn allow_shared(&mut self, kernel: Kernel, bytes: u32) -> Result<(), BackendError> {
        let f = self.kernels.get(kernel)?;
        f.set_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes as i32)
            .map_err(|e| launch_error(kernel, e))
    }
}

/// A launch configuration from grid and block sizes and dynamic shared memory bytes.
pub(crate) fn config(grid: (u32, u32, u32), block: (u32, u32, u32), shared: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: grid, block_dim: block, shared_mem_bytes: shared }
}

/// Blocks of `threads` threads to cover `n` items, capped at the grid limit (kernels loop with a
/// grid stride beyond it).
pub(crate) fn blocks_for(n: i64, threads: u32) -> u32 {
    ((n.max(1) as u64).div_ceil(threads as u64)).min(1 << 30) as u32
}

/// Tiles of `t` covering `n` (n >= 0, t >= 1).
pub(crate) fn tiles(n: i64, t: i64) -> i64 {
    (n + t - 1) / t
}

/// The integer in environment variable `name`, read once a process into `cell` (None when unset
/// or not an integer): the switches that force a kernel path, to measure paths against each other.
pub(crate) fn env_number(cell: &'static std::sync::OnceLock<Option<i64>>, name: &str) -> Option<i64> {
    *cell.get_or_init(|| std::env::var(name).ok().and_then(|v| v.parse().ok()))
}

pub(crate) fn launch_error(kernel: Kernel, e: impl std::fmt::Display) -> BackendError {
    BackendError::Device {
        backend: NAME.into(),
        detail: format!("launching {}::{}: {e}", kernel.module.name(), kernel.name),
    }
}

/// The unsupported-op error for a task a family cannot run.
pub(crate) fn unsupported(task: &Task<'_>, why: impl Into<String>) -> BackendError {
    BackendError::Unsupported { backend: NAME.into(), op: task.op.name(), why: why.into() }
}

/// The dtype code kernels switch on (`DT_*` in common.cuh: ggml type ids).
pub(crate) fn dt(d: DType) -> i32 {
    d.ggml_id() as i32
}
