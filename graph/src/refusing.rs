//! [`Refusing`]: a backend that claims not to support some ops, for tests of the scheduler's
//! fallback (a GPU backend without a kernel for an op, played by any backend).

use tessera_ops::{Op, TensorMeta};

use crate::{Backend, BackendError, BufferId, PreparedId, Task};

/// Wraps a backend and refuses the ops named in `refuse` (`Op::name`); everything else is the
/// inner backend's.
pub struct Refusing<B> {
    pub inner: B,
    refuse: Vec<String>,
}

impl<B: Backend> Refusing<B> {
    pub fn new(inner: B, refuse: &[&str]) -> Self {
        Refusing { inner, refuse: refuse.iter().map(|s| s.to_string()).collect() }
    }

    fn refuses(&self, op: &Op) -> bool {
        self.refuse.iter().any(|r| r == op.name())
    }
}

impl<B: Backend> Backend for Refusing<B> {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn supports(&self, op: &Op, inputs: &[TensorMeta]) -> bool {
        !self.refuses(op) && self.inner.supports(op, inputs)
    }
    fn alloc(&mut self, bytes: usize) -> Result<BufferId, BackendError> {
        self.inner.alloc(bytes)
    }
    fn free(&mut self, buffer: BufferId) {
        self.inner.free(buffer)
    }
    fn size(&self, buffer: BufferId) -> Result<usize, BackendError> {
        self.inner.size(buffer)
    }
    fn write(&mut self, buffer: BufferId, offset: usize, data: &[u8]) -> Result<(), BackendError> {
        self.inner.write(buffer, offset, data)
    }
    fn read(&mut self, buffer: BufferId, offset: usize, out: &mut [u8]) -> Result<(), BackendError> {
        self.inner.read(buffer, offset, out)
    }
    fn compute(&mut self, tasks: &[Task<'_>]) -> Result<(), BackendError> {
        if let Some(t) = tasks.iter().find(|t| self.refuses(t.op)) {
            return Err(BackendError::Unsupported {
                backend: self.inner.name().to_string(),
                op: t.op.name(),
                why: "refused (tessera_graph::Refusing)".into(),
            });
        }
        self.inner.compute(tasks)
    }
    fn prepare(&mut self, tasks: &[Task<'_>]) -> Result<Option<PreparedId>, BackendError> {
        if tasks.iter().any(|t| self.refuses(t.op)) {
            return Ok(None); // compute then reports it
        }
        self.inner.prepare(tasks)
    }
    fn compute_prepared(&mut self, id: PreparedId) -> Result<(), BackendError> {
        self.inner.compute_prepared(id)
    }
    fn release_prepared(&mut self, id: PreparedId) {
        self.inner.release_prepared(id)
    }
    fn synchronize(&mut self) -> Result<(), BackendError> {
        self.inner.synchronize()
    }
    fn counters(&self) -> Vec<(&'static str, u64)> {
        self.inner.counters()
    }
}
