//! Host-to-device uploads through pinned staging memory.
//!
//! A copy from pageable memory goes through a driver bounce buffer one piece at a time. For large
//! writes (weights from an mmap'd GGUF) we copy into one of two pinned chunks while the other
//! chunk's DMA to the device is in flight, so reading the source and the transfer overlap.

use cudarc::driver::sys;

use crate::CudaError;

/// Writes at least this large go through staging; smaller ones are direct async copies.
pub(crate) const STAGING_THRESHOLD: usize = 1 << 20;
const CHUNK: usize = 16 << 20;

pub(crate) struct Staging {
    chunks: [(*mut u8, sys::CUevent); 2],
}

fn check(what: &str, r: sys::CUresult) -> Result<(), CudaError> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CudaError::Driver { what: what.into(), detail: format!("{r:?}") })
    }
}

impl Staging {
    pub fn new() -> Result<Staging, CudaError> {
        let mut chunks = [(std::ptr::null_mut(), std::ptr::null_mut()); 2];
        let _wide = crate::device::device_wide();
        for c in &mut chunks {
            let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
            // SAFETY: a plain pinned host allocation, freed in Drop.
            check("allocating pinned staging memory", unsafe { sys::cuMemHostAlloc(&mut p, CHUNK, 0) })?;
            let mut ev: sys::CUevent = std::ptr::null_mut();
            // SAFETY: valid out-pointer.
            check("creating an event", unsafe {
                sys::cuEventCreate(&mut ev, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
            })?;
            *c = (p.cast(), ev);
        }
        Ok(Staging { chunks })
    }

    /// Copies `data` to device address `dst` on `stream`, pipelined through the pinned chunks.
    /// Returns when every byte of `data` has been read (the device copies may still be queued).
    pub fn upload(&mut self, stream: sys::CUstream, dst: u64, data: &[u8]) -> Result<(), CudaError> {
        for (i, piece) in data.chunks(CHUNK).enumerate() {
            let (buf, ev) = self.chunks[i % 2];
            if i >= 2 {
                // The DMA out of this chunk two pieces ago must be done before we overwrite it.
                // SAFETY: an event recorded on our stream.
                check("waiting for a staging copy", unsafe { sys::cuEventSynchronize(ev) })?;
            }
            // SAFETY: `buf` is a pinned chunk of CHUNK >= piece.len() bytes, not in use by the device.
            unsafe { std::ptr::copy_nonoverlapping(piece.as_ptr(), buf, piece.len()) };
            let at = dst + (i * CHUNK) as u64;
            // SAFETY: the caller checked that `dst..dst + data.len()` lies in one allocation.
            check("copying to the device", unsafe { sys::cuMemcpyHtoDAsync_v2(at, buf.cast(), piece.len(), stream) })?;
            // SAFETY: our event and stream.
            check("recording an event", unsafe { sys::cuEventRecord(ev, stream) })?;
        }
        // The chunks are reused by the next upload, which waits on the events; the caller's data
        // was fully copied into pinned memory above.
        for (_, ev) in self.chunks {
            // SAFETY: as above (an unrecorded event counts as complete).
            check("waiting for a staging copy", unsafe { sys::cuEventSynchronize(ev) })?;
        }
        Ok(())
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        let _wide = crate::device::device_wide();
        for (p, ev) in self.chunks {
            // SAFETY: allocated in `new`, freed once; the events were synchronised by `upload`.
            unsafe {
                sys::cuEventDestroy_v2(ev);
                sys::cuMemFreeHost(p.cast());
            }
        }
    }
}
