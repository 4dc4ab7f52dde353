//! The backend's errors, and data errors found by kernels on the device.
//!
//! A kernel that meets a bad index (a row id, state slot, expert id or block-table entry out of
//! range, or a slot named twice) writes an [`ErrorRecord`] to device memory (the first one wins)
//! and skips the write. The host reads the record at its next synchronisation point (`read`,
//! `synchronize`) and returns it as the same `KernelError` the CPU backend gives, so the
//! step needs no host synchronisation of its own.

use tessera_graph::BackendError;
use tessera_ops::KernelError;

pub(crate) const NAME: &str = "cuda";

/// What can go wrong in the CUDA backend.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CudaError {
    #[error("no usable GPU: {0}")]
    NoGpu(String),
    #[error("NVRTC: {0}")]
    Nvrtc(String),
    #[error("NVRTC could not compile kernels/{module}.cu for {arch}:\n{log}")]
    Compile { module: &'static str, arch: String, log: String },
    #[error("CUDA driver error while {what}: {detail}")]
    Driver { what: String, detail: String },
    #[error("out of device memory allocating {requested} bytes: {detail}")]
    OutOfMemory { requested: usize, detail: String },
    #[error("cuBLAS error while {what}: {detail}")]
    Cublas { what: String, detail: String },
}

impl CudaError {
    /// A `map_err` adapter for driver calls: `.map_err(CudaError::driver("creating a stream"))`.
    pub fn driver<E: std::fmt::Display>(what: &'static str) -> impl Fn(E) -> CudaError {
        move |e| CudaError::Driver { what: what.to_string(), detail: e.to_string() }
    }
}

impl From<CudaError> for BackendError {
    fn from(e: CudaError) -> BackendError {
        match e {
            CudaError::OutOfMemory { requested, detail } => {
                BackendError::OutOfMemory { backend: NAME.into(), requested, detail }
            }
            other => BackendError::Device { backend: NAME.into(), detail: other.to_string() },
        }
    }
}

/// Device-side error record; mirrors `struct ErrorRecord` in kernels/common.cuh:
/// TAG(error-record).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub(crate) struct ErrorRecord {
    pub code: u32,
    pub what: u32,
    pub op: u32,
    pub pad: u32,
    pub index: i64,
    pub limit: i64,
    pub first: i64,
    pub second: i64,
}

pub(crate) const ERR_INDEX_OUT_OF_RANGE: u32 = 1;
pub(crate) const ERR_DUPLICATE_INDEX: u32 = 2;
/// `KernelError::ValueOutOfRange`: `index` holds the value, `first` its position, `second` and
/// `limit` the allowed `low..=high`.
pub(crate) const ERR_VALUE_OUT_OF_RANGE: u32 = 3;
/// `KernelError::BadValue` (sample's settings and NaN rows): `what` is a
/// `tessera_ops::sample::SampleField` code, `index` the row, `first` the f32 bits of the value.
pub(crate) const ERR_BAD_VALUE: u32 = 4;

/// The ops that can report data errors, by the code kernels store in `ErrorRecord::op`.
pub(crate) const OPS_WITH_ERRORS: [&str; 12] = [
    "get_rows",
    "set_rows",
    "mul_mat_id",
    "flash_attn_ext",
    "gated_delta_net",
    "ssm_conv_update_inplace",
    "top_k",
    "sample",
    "moe_weights",
    "mul_mat_id_swiglu",
    "mul_mat_id_weighted_sum",
    "gated_delta_net_fused",
];

/// The code kernels pass as `op` for the op named `name` (its index in [`OPS_WITH_ERRORS`]).
pub(crate) fn op_code(name: &str) -> u32 {
    OPS_WITH_ERRORS.iter().position(|n| *n == name).unwrap_or(0) as u32
}

fn what_name(what: u32) -> &'static str {
    match what {
        1 => "row id",
        2 => "state slot",
        3 => "expert id",
        4 => "block table entry (k/v cell)",
        5 => "destination row",
        6 => "seq_offsets",
        7 => "kv_lens",
        _ => "index",
    }
}

impl ErrorRecord {
    /// The `KernelError` this record describes, or `None` when no error was recorded.
    pub fn to_kernel_error(self) -> Option<KernelError> {
        let op = OPS_WITH_ERRORS.get(self.op as usize).copied().unwrap_or("kernel");
        let what = what_name(self.what);
        match self.code {
            0 => None,
            ERR_DUPLICATE_INDEX => Some(KernelError::DuplicateIndex {
                op,
                index: self.index.max(0) as usize,
                first: self.first.max(0) as usize,
                second: self.second.max(0) as usize,
                what,
            }),
            ERR_INDEX_OUT_OF_RANGE => {
                Some(KernelError::IndexOutOfRange { op, index: self.index, limit: self.limit.max(0) as usize, what })
            }
            ERR_VALUE_OUT_OF_RANGE => Some(KernelError::ValueOutOfRange {
                op,
                what,
                at: self.first.max(0) as usize,
                value: self.index,
                low: self.second,
                high: self.limit,
            }),
            ERR_BAD_VALUE => {
                let field = tessera_ops::sample::SampleField::from_code(self.what);
                Some(KernelError::BadValue {
                    op,
                    row: self.index.max(0) as usize,
                    what: field.map_or("value", |f| f.name()),
                    value: f64::from(f32::from_bits(self.first as u32)),
                    expected: field.map_or("", |f| f.expected()),
                })
            }
            other => Some(KernelError::Unsupported { op, why: format!("unknown device error code {other}") }),
        }
    }
}
