//! The device's measured ceilings, the denominators of every "% of peak" we report: a large
//! device-to-device copy (bytes read + written per second) and a large bf16 GEMM through cuBLAS
//! on random data (tensor-core FLOP/s). Measured with CUDA events, after warm-up, median of runs.

use cudarc::cublas::sys as blas;
use cudarc::driver::{result, sys};

use crate::{CudaBackend, CudaError};

/// What the device reached when this process measured it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ceilings {
    /// Device-to-device copy of 1 GiB: (read + written bytes) / time, in GB/s (10^9).
    pub copy_gb_per_s: f64,
    /// bf16 x bf16 -> bf16 GEMM (f32 accumulate), 8192^3, in TFLOP/s.
    pub bf16_tflop_per_s: f64,
}

struct Events(sys::CUevent, sys::CUevent);

impl Events {
    fn new() -> Result<Events, CudaError> {
        let flags = sys::CUevent_flags::CU_EVENT_DEFAULT;
        let a = result::event::create(flags).map_err(CudaError::driver("creating an event"))?;
        let b = result::event::create(flags).map_err(CudaError::driver("creating an event"))?;
        Ok(Events(a, b))
    }

    /// Milliseconds taken by `work` on `stream`, median of `runs` after 2 warm-ups.
    fn median_ms(
        &self,
        stream: sys::CUstream,
        runs: usize,
        mut work: impl FnMut() -> Result<(), CudaError>,
    ) -> Result<f64, CudaError> {
        for _ in 0..2 {
            work()?;
        }
        let mut times = Vec::with_capacity(runs);
        for _ in 0..runs {
            // SAFETY: our events and stream.
            unsafe { result::event::record(self.0, stream) }.map_err(CudaError::driver("recording an event"))?;
            work()?;
            // SAFETY: as above.
            unsafe { result::event::record(self.1, stream) }.map_err(CudaError::driver("recording an event"))?;
            // SAFETY: as above.
            unsafe { result::event::synchronize(self.1) }.map_err(CudaError::driver("waiting for an event"))?;
            // SAFETY: both recorded and complete.
            let ms =
                unsafe { result::event::elapsed(self.0, self.1) }.map_err(CudaError::driver("reading an event"))?;
            times.push(ms as f64);
        }
        times.sort_by(f64::total_cmp);
        Ok(times[times.len() / 2])
    }
}

impl Drop for Events {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once.
        unsafe {
            let _ = result::event::destroy(self.0);
            let _ = result::event::destroy(self.1);
        }
    }
}

/// Random bf16 values in [-1, 1) (never time on zeros).
fn random_bf16(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed;
    let mut out = Vec::with_capacity(2 * n);
    for _ in 0..n {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let v = ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
        out.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes());
    }
    out
}

impl CudaBackend {
    /// Measures the copy and bf16 GEMM ceilings (about a second; uses ~1.4 GiB of device memory,
    /// freed before returning).
    pub fn measure_ceilings(&mut self) -> Result<Ceilings, CudaError> {
        use tessera_graph::Backend;
        let be = |e: tessera_graph::BackendError| CudaError::Driver {
            what: "measuring ceilings".into(),
            detail: e.to_string(),
        };
        let stream = self.dev.stream.cu_stream();
        let events = Events::new()?;

        let copy_bytes = 1usize << 30;
        let src = self.alloc(copy_bytes).map_err(be)?;
        let dst = self.alloc(copy_bytes).map_err(be)?;
        let (s, d) = (self.block(src).map_err(be)?.ptr, self.block(dst).map_err(be)?.ptr);
        // SAFETY: both blocks hold copy_bytes bytes.
        unsafe { result::memset_d8_async(s, 0x5a, copy_bytes, stream) }.map_err(CudaError::driver("filling"))?;
        let copy_ms = events.median_ms(stream, 10, || {
            // SAFETY: as above; the two blocks are distinct.
            unsafe { result::memcpy_dtod_async(d, s, copy_bytes, stream) }.map_err(CudaError::driver("copying"))
        })?;
        self.free(src);
        self.free(dst);

        let n = 8192usize;
        let bytes = n * n * 2;
        let ids: Vec<_> = (0..3).map(|_| self.alloc(bytes)).collect::<Result<_, _>>().map_err(be)?;
        for (i, id) in ids.iter().take(2).enumerate() {
            self.write(*id, 0, &random_bf16(n * n, 17 + i as u64)).map_err(be)?;
        }
        let [a, b, c] = [0, 1, 2].map(|i| self.block(ids[i]).map(|blk| blk.ptr));
        let (a, b, c) = (a.map_err(be)?, b.map_err(be)?, c.map_err(be)?);
        let pool = &mut self.pool;
        let handle =
            self.blas.handle(&self.dev.stream, || pool.alloc(crate::launch::BLAS_WORKSPACE).map(|(p, _)| p))?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        let gemm_ms = events.median_ms(stream, 10, || {
            // SAFETY: a, b, c hold n*n bf16 each; alpha/beta are host f32 (the default pointer
            // mode) matching the f32 compute type.
            unsafe {
                cudarc::cublas::result::gemm_ex(
                    handle,
                    blas::cublasOperation_t::CUBLAS_OP_N,
                    blas::cublasOperation_t::CUBLAS_OP_N,
                    n as i32,
                    n as i32,
                    n as i32,
                    (&alpha as *const f32).cast(),
                    a as *const std::ffi::c_void,
                    blas::cudaDataType::CUDA_R_16BF,
                    n as i32,
                    b as *const std::ffi::c_void,
                    blas::cudaDataType::CUDA_R_16BF,
                    n as i32,
                    (&beta as *const f32).cast(),
                    c as *mut std::ffi::c_void,
                    blas::cudaDataType::CUDA_R_16BF,
                    n as i32,
                    blas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    blas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
            .map_err(|e| CudaError::Cublas { what: "bf16 GEMM".into(), detail: format!("{e:?}") })
        })?;
        for id in ids {
            self.free(id);
        }
        Ok(Ceilings {
            copy_gb_per_s: 2.0 * copy_bytes as f64 / (copy_ms * 1e-3) / 1e9,
            bf16_tflop_per_s: 2.0 * (n as f64).powi(3) / (gemm_ms * 1e-3) / 1e12,
        })
    }
}
