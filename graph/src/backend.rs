//! The `Backend` trait: what a device must offer the executor (and, later, the scheduler).
//!
//! A backend owns its memory, handed out as opaque [`BufferId`]s, and computes *tasks*: one op
//! with its inputs and output given as (buffer, byte offset, descriptor). The executor resolves
//! views and in-place aliasing before a task reaches a backend, so a backend never sees a view op
//! and must honour arbitrary strides on its inputs. `compute` takes a slice of tasks so a backend
//! can record a whole segment at once (CUDA graph capture).

use smallvec::SmallVec;
use tessera_ops::{KernelError, Op, TensorMeta};

use crate::NodeId;

/// A handle to memory owned by a backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BufferId(pub u32);

/// A tensor placed in a backend buffer: its first element is at `offset` bytes into `buffer`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorRef {
    pub buffer: BufferId,
    pub offset: usize,
    pub meta: TensorMeta,
}

/// One op to compute. `output` may share memory with an input only where the op writes that
/// input in place (`Op::writes_input`); the executor guarantees no other overlap between the
/// output and the inputs. An op that updates an input as a side effect (`Op::updates_input`,
/// recurrent state) may write that input; no other input overlaps it, and the output is separate.
#[derive(Debug, Clone)]
pub struct Task<'g> {
    pub node: NodeId,
    pub op: &'g Op,
    pub inputs: SmallVec<[TensorRef; 4]>,
    pub output: TensorRef,
}

/// Why a backend could not do what was asked.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BackendError {
    #[error("{backend}: out of memory allocating {requested} bytes ({detail})")]
    OutOfMemory { backend: String, requested: usize, detail: String },

    #[error("{backend}: op {op} is not supported: {why}")]
    Unsupported { backend: String, op: &'static str, why: String },

    #[error("{backend}: buffer {buffer:?} does not exist")]
    UnknownBuffer { backend: String, buffer: BufferId },

    #[error("{backend}: access of {len} bytes at offset {offset} is outside buffer {buffer:?} of {size} bytes")]
    OutOfBounds { backend: String, buffer: BufferId, offset: usize, len: usize, size: usize },

    #[error(transparent)]
    Kernel(#[from] KernelError),

    #[error("{backend}: device error: {detail}")]
    Device { backend: String, detail: String },
}

/// A task list a backend checked and kept (see [`Backend::prepare`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PreparedId(pub u32);

/// A device that can hold tensors and compute ops on them.
pub trait Backend {
    /// A short stable name (`cpu`, `ref`, `cuda`), used in reports and test-ops filters.
    fn name(&self) -> &str;

    /// Whether this backend can compute `op` on inputs with these descriptors. The scheduler
    /// sends unsupported nodes elsewhere.
    fn supports(&self, op: &Op, inputs: &[TensorMeta]) -> bool;

    /// Allocates `bytes` bytes (contents unspecified).
    fn alloc(&mut self, bytes: usize) -> Result<BufferId, BackendError>;

    /// Releases a buffer. Freeing an unknown buffer is a no-op.
    fn free(&mut self, buffer: BufferId);

    /// Size of a buffer in bytes.
    fn size(&self, buffer: BufferId) -> Result<usize, BackendError>;

    /// Copies `data` into `buffer` at `offset`.
    fn write(&mut self, buffer: BufferId, offset: usize, data: &[u8]) -> Result<(), BackendError>;

    /// Copies `out.len()` bytes from `buffer` at `offset` into `out`. Waits for pending work.
    fn read(&mut self, buffer: BufferId, offset: usize, out: &mut [u8]) -> Result<(), BackendError>;

    /// Computes the tasks in order. An asynchronous backend may return before the work is done;
    /// `read` and `synchronize` wait for it.
    fn compute(&mut self, tasks: &[Task<'_>]) -> Result<(), BackendError>;

    /// Checks `tasks` once and keeps what running them again needs, so that a graph planned
    /// once runs step after step without the host checking and resolving every task again
    /// ([`Backend::compute_prepared`]). `None`: this backend keeps nothing, and the caller calls
    /// `compute` each time (the default).
    fn prepare(&mut self, tasks: &[Task<'_>]) -> Result<Option<PreparedId>, BackendError> {
        let _ = tasks;
        Ok(None)
    }

    /// Computes a task list kept by [`Backend::prepare`], exactly as `compute` would.
    fn compute_prepared(&mut self, id: PreparedId) -> Result<(), BackendError> {
        Err(BackendError::Unsupported {
            backend: self.name().to_string(),
            op: "prepared task list",
            why: format!("{id:?} was not prepared by this backend"),
        })
    }

    /// Forgets a prepared task list (before the memory it names is freed).
    fn release_prepared(&mut self, id: PreparedId) {
        let _ = id;
    }

    /// Waits until all queued work is done, and reports any error it found (a data error such as
    /// an index out of range, found by a device kernel). Synchronous backends have nothing to do.
    fn synchronize(&mut self) -> Result<(), BackendError> {
        Ok(())
    }

    /// Hands memory a caching allocator keeps for reuse back to the system: after a large buffer
    /// was freed for good (a shared arena replaced by a larger one), so its block does not stay
    /// cached beside its successor. Backends that cache nothing have nothing to do.
    fn release_cached(&mut self) -> Result<(), BackendError> {
        Ok(())
    }

    /// Named counters of what the backend did so far (graph captures and replays, pool reuses,
    /// kernels compiled, ...), for reports and benches; empty when it keeps none.
    fn counters(&self) -> Vec<(&'static str, u64)> {
        Vec::new()
    }
}

/// Checks that `[offset, offset + len)` lies within a buffer of `size` bytes; shared by backends.
pub fn check_range(
    backend: &str,
    buffer: BufferId,
    size: usize,
    offset: usize,
    len: usize,
) -> Result<(), BackendError> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(BackendError::OutOfBounds { backend: backend.to_string(), buffer, offset, len, size }),
    }
}
