//! Host memory for the CPU backends: 64-byte aligned buffers addressed by `BufferId`.

use tessera_graph::{BackendError, BufferId, TensorRef, check_range};

/// One 64-byte aligned chunk; buffers are vectors of these so every buffer starts on a cache
/// line and f32/f16 views of it are aligned.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Chunk([u8; 64]);

/// An aligned, zero-initialised byte buffer.
pub struct HostBuffer {
    chunks: Vec<Chunk>,
    len: usize,
}

impl HostBuffer {
    fn new(len: usize) -> Result<Self, std::collections::TryReserveError> {
        let n = len.div_ceil(64);
        let mut chunks = Vec::new();
        chunks.try_reserve_exact(n)?;
        chunks.resize(n, Chunk([0; 64]));
        Ok(HostBuffer { chunks, len })
    }

    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `Chunk` is `repr(C)` over `[u8; 64]` with no padding, so the chunk vector is
        // `64 * chunks.len() >= len` initialised bytes.
        unsafe { std::slice::from_raw_parts(self.chunks.as_ptr().cast::<u8>(), self.len) }
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.chunks.as_mut_ptr().cast::<u8>(), self.len) }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// The buffer table shared by [`crate::CpuBackend`] and [`crate::ReferenceBackend`].
pub struct HostBuffers {
    backend: &'static str,
    slots: Vec<Option<HostBuffer>>,
    free_slots: Vec<u32>,
    /// Bytes currently allocated.
    pub allocated: usize,
}

impl HostBuffers {
    pub fn new(backend: &'static str) -> Self {
        HostBuffers { backend, slots: Vec::new(), free_slots: Vec::new(), allocated: 0 }
    }

    pub fn alloc(&mut self, bytes: usize) -> Result<BufferId, BackendError> {
        let buf = HostBuffer::new(bytes).map_err(|e| BackendError::OutOfMemory {
            backend: self.backend.to_string(),
            requested: bytes,
            detail: e.to_string(),
        })?;
        self.allocated += bytes;
        let id = match self.free_slots.pop() {
            Some(i) => {
                self.slots[i as usize] = Some(buf);
                i
            }
            None => {
                self.slots.push(Some(buf));
                (self.slots.len() - 1) as u32
            }
        };
        Ok(BufferId(id))
    }

    pub fn free(&mut self, id: BufferId) {
        if let Some(slot) = self.slots.get_mut(id.0 as usize)
            && let Some(buf) = slot.take()
        {
            self.allocated -= buf.len();
            self.free_slots.push(id.0);
        }
    }

    /// Buffers allocated and not yet freed.
    pub fn live(&self) -> usize {
        self.slots.len() - self.free_slots.len()
    }

    pub fn get(&self, id: BufferId) -> Result<&HostBuffer, BackendError> {
        self.slots
            .get(id.0 as usize)
            .and_then(|s| s.as_ref())
            .ok_or(BackendError::UnknownBuffer { backend: self.backend.to_string(), buffer: id })
    }

    pub fn get_mut(&mut self, id: BufferId) -> Result<&mut HostBuffer, BackendError> {
        let backend = self.backend;
        self.slots
            .get_mut(id.0 as usize)
            .and_then(|s| s.as_mut())
            .ok_or(BackendError::UnknownBuffer { backend: backend.to_string(), buffer: id })
    }

    /// Moves a buffer out of the table (to write it while reading others); put it back with
    /// [`HostBuffers::restore`].
    pub fn take(&mut self, id: BufferId) -> Result<HostBuffer, BackendError> {
        let backend = self.backend;
        self.slots
            .get_mut(id.0 as usize)
            .and_then(|s| s.take())
            .ok_or(BackendError::UnknownBuffer { backend: backend.to_string(), buffer: id })
    }

    pub fn restore(&mut self, id: BufferId, buf: HostBuffer) {
        self.slots[id.0 as usize] = Some(buf);
    }

    pub fn write(&mut self, id: BufferId, offset: usize, data: &[u8]) -> Result<(), BackendError> {
        let backend = self.backend;
        let buf = self.get_mut(id)?;
        check_range(backend, id, buf.len(), offset, data.len())?;
        buf.bytes_mut()[offset..offset + data.len()].copy_from_slice(data);
        Ok(())
    }

    pub fn read(&self, id: BufferId, offset: usize, out: &mut [u8]) -> Result<(), BackendError> {
        let buf = self.get(id)?;
        check_range(self.backend, id, buf.len(), offset, out.len())?;
        out.copy_from_slice(&buf.bytes()[offset..offset + out.len()]);
        Ok(())
    }

    /// The bytes of a placed tensor, from its first byte to the end of its span, after checking
    /// the span lies inside the buffer.
    pub fn tensor_bytes(&self, t: &TensorRef) -> Result<&[u8], BackendError> {
        let buf = self.get(t.buffer)?;
        let span = t.meta.span_bytes();
        check_range(self.backend, t.buffer, buf.len(), t.offset, span)?;
        Ok(&buf.bytes()[t.offset..t.offset + span])
    }

    pub fn backend_name(&self) -> &'static str {
        self.backend
    }
}

/// The buffer half of `tessera_graph::Backend` for a backend whose host memory is a
/// [`HostBuffers`] field named `buffers` (the CPU and reference backends share it).
macro_rules! host_buffer_methods {
    () => {
        fn alloc(&mut self, bytes: usize) -> Result<tessera_graph::BufferId, tessera_graph::BackendError> {
            self.buffers.alloc(bytes)
        }

        fn free(&mut self, buffer: tessera_graph::BufferId) {
            self.buffers.free(buffer)
        }

        fn size(&self, buffer: tessera_graph::BufferId) -> Result<usize, tessera_graph::BackendError> {
            Ok(self.buffers.get(buffer)?.len())
        }

        fn write(
            &mut self,
            buffer: tessera_graph::BufferId,
            offset: usize,
            data: &[u8],
        ) -> Result<(), tessera_graph::BackendError> {
            self.buffers.write(buffer, offset, data)
        }

        fn read(
            &mut self,
            buffer: tessera_graph::BufferId,
            offset: usize,
            out: &mut [u8],
        ) -> Result<(), tessera_graph::BackendError> {
            self.buffers.read(buffer, offset, out)
        }
    };
}
pub(crate) use host_buffer_methods;
