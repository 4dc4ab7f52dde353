//! The device: a CUDA context with event tracking off (we order our own work on one stream), the
//! stream every kernel, copy and graph launch goes to, and what we know about the chip.

use std::cell::Cell;
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::{CudaContext, CudaStream, sys};

use crate::CudaError;

/// Serialises, across the threads of the process, stream captures with the driver calls that
/// synchronise the whole device (`cuMemAlloc`, `cuMemFree`, pinned host memory): one of those on
/// another thread invalidates a capture in progress (two backends on two threads, as the tests
/// run). Held by [`crate::graphs::Graphs::run`] for a whole capture and around each such call.
static DEVICE_WIDE: Mutex<()> = Mutex::new(());

thread_local! {
    /// [`device_wide`] guards this thread holds: a capture may allocate (the lock is not re-taken).
    static HELD: Cell<usize> = const { Cell::new(0) };
}

/// Holds [`DEVICE_WIDE`] (re-entrant within a thread) until dropped.
pub(crate) struct DeviceWide(Option<MutexGuard<'static, ()>>);

/// Takes the process-wide lock for a capture or a device-synchronising call.
pub(crate) fn device_wide() -> DeviceWide {
    let guard = if HELD.get() == 0 {
        // (a panic while held leaves nothing to repair: the lock guards no data)
        Some(DEVICE_WIDE.lock().unwrap_or_else(|e| e.into_inner()))
    } else {
        None
    };
    HELD.set(HELD.get() + 1);
    DeviceWide(guard)
}

impl Drop for DeviceWide {
    fn drop(&mut self) {
        HELD.set(HELD.get() - 1);
        self.0.take();
    }
}

/// Facts about the GPU that kernels and reports use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    /// Compute capability, e.g. (9, 0) for Hopper.
    pub compute_capability: (i32, i32),
    pub multiprocessors: usize,
    pub total_memory: usize,
    pub l2_bytes: usize,
    /// Largest dynamic shared memory a block may opt in to.
    pub max_shared_per_block: usize,
    /// Peak DRAM bandwidth in bytes/s from the memory clock and bus width (0 where the driver
    /// does not report them): a tuning input, not a measurement.
    pub peak_memory_bandwidth: u64,
    /// NVRTC's version, (major, minor).
    pub nvrtc_version: (i32, i32),
}

impl DeviceInfo {
    /// The NVRTC architecture flag for this device, e.g. `sm_90`.
    pub fn arch(&self) -> String {
        format!("sm_{}{}", self.compute_capability.0, self.compute_capability.1)
    }
}

impl std::fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} ({}, {} SMs, {:.1} GiB, {:.2} TB/s peak, {} MiB L2, NVRTC {}.{})",
            self.name,
            self.arch(),
            self.multiprocessors,
            self.total_memory as f64 / (1u64 << 30) as f64,
            self.peak_memory_bandwidth as f64 / 1e12,
            self.l2_bytes >> 20,
            self.nvrtc_version.0,
            self.nvrtc_version.1
        )
    }
}

/// A context and its one stream.
pub(crate) struct Device {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub info: DeviceInfo,
}

/// Whether the CUDA driver and NVRTC libraries can be loaded at all (without touching a device).
/// cudarc's dynamic loading panics when a library is missing, so every entry point asks first.
pub fn libraries_present() -> Result<(), CudaError> {
    // SAFETY: these only try to dlopen the libraries.
    let driver = unsafe { cudarc::driver::sys::is_culib_present() };
    let nvrtc = unsafe { cudarc::nvrtc::sys::is_culib_present() };
    match (driver, nvrtc) {
        (true, true) => Ok(()),
        (false, _) => Err(CudaError::NoGpu("the CUDA driver library (libcuda.so) was not found".into())),
        (_, false) => Err(CudaError::NoGpu("the NVRTC library (libnvrtc.so) was not found".into())),
    }
}

/// NVRTC's version; needs only libnvrtc (no GPU).
pub fn nvrtc_version() -> Result<(i32, i32), CudaError> {
    // SAFETY: checks that the library loads before calling into it.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(CudaError::NoGpu("the NVRTC library (libnvrtc.so) was not found".into()));
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two valid out-pointers.
    let r = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    if r != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(CudaError::Nvrtc(format!("nvrtcVersion failed: {r:?}")));
    }
    Ok((major, minor))
}

impl Device {
    pub fn open(ordinal: usize) -> Result<Device, CudaError> {
        libraries_present()?;
        let count = CudaContext::device_count().map_err(|e| CudaError::NoGpu(format!("cuInit/device count: {e}")))?;
        if count <= 0 {
            return Err(CudaError::NoGpu("the driver reports no CUDA device".into()));
        }
        if ordinal >= count as usize {
            return Err(CudaError::NoGpu(format!("device {ordinal} requested but only {count} present")));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| CudaError::NoGpu(format!("creating a context: {e}")))?;
        // SAFETY: called right after creating the context, before any allocation; the backend
        // runs everything on one stream, so cudarc's per-buffer events (which break stream capture)
        // are not needed.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(CudaError::driver("creating a stream"))?;
        let attr = |a| ctx.attribute(a).map_err(CudaError::driver("reading a device attribute"));
        use sys::CUdevice_attribute as A;
        let info = DeviceInfo {
            ordinal,
            name: ctx.name().map_err(CudaError::driver("reading the device name"))?,
            compute_capability: ctx.compute_capability().map_err(CudaError::driver("compute capability"))?,
            multiprocessors: attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as usize,
            total_memory: ctx.total_mem().map_err(CudaError::driver("total memory"))?,
            l2_bytes: attr(A::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)? as usize,
            max_shared_per_block: attr(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)? as usize,
            // kHz x bits, two transfers a clock
            peak_memory_bandwidth: match (
                attr(A::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE),
                attr(A::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH),
            ) {
                (Ok(khz), Ok(bits)) if khz > 0 && bits > 0 => 2 * 1000 * khz as u64 * bits as u64 / 8,
                _ => 0,
            },
            nvrtc_version: nvrtc_version()?,
        };
        Ok(Device { ctx, stream, info })
    }
}
