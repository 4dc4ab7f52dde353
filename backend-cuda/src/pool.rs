//! A caching, stream-ordered device memory pool.
//!
//! Requests are rounded up to a size class (powers of two up to 1 MiB, then eight classes per
//! doubling, so at most 12.5% is wasted); a freed block goes to its class's free list and the next
//! request of that class reuses it without calling the driver. All work runs on one stream, so a
//! block freed while kernels that use it are still queued can be handed out again at once: whatever
//! the new owner enqueues runs after them (stream order).
//!
//! When the driver is out of memory the pool synchronises, returns every cached block to the
//! driver and tries once more; if that fails too the caller gets [`CudaError::OutOfMemory`] and the
//! pool stays usable.

use std::collections::BTreeMap;

use cudarc::driver::{result, sys};

use crate::CudaError;

const MIN_CLASS: usize = 256;
const POW2_LIMIT: usize = 1 << 20;

/// What the pool has done.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Bytes handed out and not yet freed (rounded to classes).
    pub live_bytes: usize,
    /// Bytes held in free lists for reuse.
    pub cached_bytes: usize,
    /// Largest `live_bytes + cached_bytes` seen: the device memory the pool held at its peak.
    pub peak_bytes: usize,
    /// Allocation requests.
    pub allocs: u64,
    /// Requests served from a free list.
    pub reuses: u64,
    /// Requests that went to the driver.
    pub device_allocs: u64,
    /// Times the cache was emptied to retry an allocation the driver refused.
    pub trims: u64,
}

/// The size class of a request of `bytes` bytes.
pub fn size_class(bytes: usize) -> usize {
    let bytes = bytes.max(MIN_CLASS);
    if bytes <= POW2_LIMIT {
        return bytes.next_power_of_two();
    }
    // Eight classes per doubling: round up to a multiple of 1/8 of the largest power of two below.
    let step = (1usize << (usize::BITS - 1 - bytes.leading_zeros())) / 8;
    bytes.div_ceil(step) * step
}

pub(crate) struct Pool {
    /// The stream all work using the pool's blocks runs on (waited for before blocks go back
    /// to the driver).
    stream: sys::CUstream,
    free: BTreeMap<usize, Vec<sys::CUdeviceptr>>,
    pub stats: PoolStats,
}

impl Pool {
    pub fn new(stream: sys::CUstream) -> Pool {
        Pool { stream, free: BTreeMap::new(), stats: PoolStats::default() }
    }

    /// A block of at least `bytes` bytes; returns its address and class size.
    pub fn alloc(&mut self, bytes: usize) -> Result<(sys::CUdeviceptr, usize), CudaError> {
        let class = size_class(bytes);
        self.stats.allocs += 1;
        if let Some(ptr) = self.free.get_mut(&class).and_then(Vec::pop) {
            self.stats.reuses += 1;
            self.stats.cached_bytes -= class;
            self.stats.live_bytes += class;
            return Ok((ptr, class));
        }
        let _wide = crate::device::device_wide();
        // SAFETY: plain device allocation; the context is current (bound by the caller).
        let ptr = match unsafe { result::malloc_sync(class) } {
            Ok(p) => p,
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                self.trim()?;
                // SAFETY: as above.
                unsafe { result::malloc_sync(class) }.map_err(|e| CudaError::OutOfMemory {
                    requested: bytes,
                    detail: format!("{e}; pool holds {} bytes live after emptying its cache", self.stats.live_bytes),
                })?
            }
            Err(e) => {
                return Err(CudaError::Driver { what: format!("allocating {class} bytes"), detail: e.to_string() });
            }
        };
        self.stats.device_allocs += 1;
        self.stats.live_bytes += class;
        self.stats.peak_bytes = self.stats.peak_bytes.max(self.stats.live_bytes + self.stats.cached_bytes);
        Ok((ptr, class))
    }

    /// Returns a block to its class's free list.
    pub fn free(&mut self, ptr: sys::CUdeviceptr, class: usize) {
        self.stats.live_bytes -= class;
        self.stats.cached_bytes += class;
        self.free.entry(class).or_default().push(ptr);
    }

    /// Gives every cached block back to the driver, after waiting for the stream so no queued
    /// work uses them.
    pub fn trim(&mut self) -> Result<(), CudaError> {
        // SAFETY: the backend's stream, alive as long as the pool.
        unsafe { result::stream::synchronize(self.stream) }.map_err(|e| CudaError::Driver {
            what: "synchronising before trimming the pool".into(),
            detail: e.to_string(),
        })?;
        self.stats.trims += 1;
        let _wide = crate::device::device_wide();
        for (_, ptrs) in std::mem::take(&mut self.free) {
            for p in ptrs {
                // SAFETY: `p` came from `malloc_sync`, is not live, and no queued work uses it.
                let _ = unsafe { result::free_sync(p) };
            }
        }
        self.stats.cached_bytes = 0;
        Ok(())
    }

    /// Frees everything cached; live blocks belong to their owners, who free them through `free`
    /// first (the backend does so when dropped).
    pub fn release_all(&mut self) {
        let _wide = crate::device::device_wide();
        for (_, ptrs) in std::mem::take(&mut self.free) {
            for p in ptrs {
                // SAFETY: cached blocks are not in use.
                let _ = unsafe { result::free_sync(p) };
            }
        }
        self.stats.cached_bytes = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_round_up_with_bounded_waste() {
        assert_eq!(size_class(0), 256);
        assert_eq!(size_class(1), 256);
        assert_eq!(size_class(257), 512);
        assert_eq!(size_class(1 << 20), 1 << 20);
        assert_eq!(size_class((1 << 20) + 1), (1 << 20) + (1 << 17));
        for bytes in [3_000_000usize, 178_257_920, 50_135_040, 1 << 33] {
            let c = size_class(bytes);
            assert!(c >= bytes && (c - bytes) as f64 <= bytes as f64 / 8.0, "{bytes} -> {c}");
            assert_eq!(size_class(c), c, "a class is its own class");
        }
    }
}
