//! Model weights resident in backend memory: see [`ModelWeights`].

use std::collections::{HashMap, HashSet};

use tessera_graph::{Backend, BackendError, DType, Graph, GraphError, Tensor, TensorMeta, TensorRef};

use crate::config::{ConfigError, ModelConfig, TensorSpec, merged_gate_up};
use crate::gguf::{GgufError, GgufFile};

/// Why weights could not be loaded or used.
#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(transparent)]
    Graph(#[from] GraphError),
    #[error("weight {name} is not loaded")]
    Missing { name: String },
    #[error("weight {name}: {why}")]
    Bad { name: String, why: String },
}

/// Every weight of [`ModelConfig::tensor_specs`], uploaded once into backend memory (one buffer
/// per tensor, or windows of one stacked matrix: [`ModelWeights::merge_rows`]), by llama.cpp name. Step graphs reference them as parameter leaves bound to this
/// memory ([`ModelWeights::param`] + `Session::with_bindings`), so nothing is copied per step.
///
/// The buffers belong to the backend they were loaded on; call [`ModelWeights::free`] to release
/// them (the backend is not held, so there is no `Drop`).
#[derive(Debug, Default)]
pub struct ModelWeights {
    tensors: HashMap<String, TensorRef>,
    /// The names that are windows of a stacked matrix.
    windows: HashSet<String>,
    /// The names made at load rather than read (stacked matrices, constants): not counted by
    /// [`ModelWeights::tensor_bytes`].
    derived: HashSet<String>,
}

impl ModelWeights {
    /// Checks `config` ([`ModelConfig::validate`]) and `file` against it
    /// ([`ModelConfig::validate_tensors`]: every tensor present with its shape, no block count
    /// beyond the file's, no unexpected tensor), then allocates and writes each tensor of the config
    /// on `backend`. Nothing is allocated before both checks pass, and every buffer is sized from a
    /// tensor the file holds.
    ///
    /// A merged `blk.N.ffn_gate_up_exps.weight` (which `validate_tensors` accepts in place of the
    /// gate/up pair) is split here: per expert its first `n_ff_exp` rows are the gate, the next
    /// `n_ff_exp` the up projection (llama.cpp's `ggml_swiglu` on the merged product takes the
    /// first half as the gate).
    pub fn load(file: &GgufFile, config: &ModelConfig, backend: &mut dyn Backend) -> Result<Self, WeightsError> {
        config.validate()?;
        config.validate_tensors(file)?;
        let mut w = ModelWeights::default();
        for spec in config.tensor_specs() {
            if let Err(e) = w.load_one(file, &spec, backend) {
                w.free(backend);
                return Err(e);
            }
        }
        Ok(w)
    }

    /// Uploads the tensor of `spec`: the file's own, or its half of a merged gate/up tensor.
    fn load_one(&mut self, file: &GgufFile, spec: &TensorSpec, backend: &mut dyn Backend) -> Result<(), WeightsError> {
        let bad = |why: String| WeightsError::Bad { name: spec.name.clone(), why };
        // (file tensor, the part of it this spec is: (rows per expert in the file, first row))
        let (info, part) = match file.tensor(&spec.name) {
            Some(info) => (info, None),
            None => {
                let merged = merged_gate_up(spec).ok_or_else(|| WeightsError::Missing { name: spec.name.clone() })?;
                let info =
                    file.tensor(&merged.name).ok_or_else(|| WeightsError::Missing { name: spec.name.clone() })?;
                let first = if spec.name.ends_with("ffn_up_exps.weight") { spec.ne[1] } else { 0 };
                (info, Some((info.ne[1], first)))
            }
        };
        let meta = TensorMeta::contiguous("weight", info.dtype, spec.ne).map_err(|e| bad(e.to_string()))?;
        let data = file.tensor_data(&info.name)?;
        let nbytes = meta.nbytes_contiguous();
        // Bytes of one row of ne[0] elements; the file validated that rows are whole blocks.
        let row = info.dtype.row_bytes(info.ne[0]).ok_or_else(|| bad("row size overflows".into()))?;
        let expected = match part {
            None => nbytes,
            Some((rows, _)) => row.checked_mul(rows).and_then(|b| b.checked_mul(spec.ne[2])).unwrap_or(usize::MAX),
        };
        if data.len() != expected {
            return Err(bad(format!("{} bytes of data for a {expected}-byte tensor", data.len())));
        }
        let buffer = backend.alloc(nbytes)?;
        let written = match part {
            None => backend.write(buffer, 0, data),
            Some((rows, first)) => {
                // Per expert: rows [first, first + ne[1]) of its `rows`-row slab.
                let take = row * spec.ne[1];
                (0..spec.ne[2]).try_for_each(|ex| {
                    let at = ex * rows * row + first * row;
                    backend.write(buffer, ex * take, &data[at..at + take])
                })
            }
        };
        if let Err(e) = written {
            backend.free(buffer);
            return Err(e.into());
        }
        self.tensors.insert(spec.name.clone(), TensorRef { buffer, offset: 0, meta });
        Ok(())
    }

    /// Adds a tensor placed by the caller (synthetic weights).
    pub(crate) fn insert(&mut self, name: String, place: TensorRef) {
        self.tensors.insert(name, place);
    }

    /// The placed tensor `name`.
    pub fn get(&self, name: &str) -> Result<TensorRef, WeightsError> {
        self.tensors.get(name).copied().ok_or_else(|| WeightsError::Missing { name: name.to_string() })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Loaded tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// A parameter leaf of `g` with tensor `name`'s dtype and shape, and the binding of that leaf
    /// to the resident memory (pass it to `Session::with_bindings`).
    pub fn param(&self, g: &mut Graph, name: &str) -> Result<(Tensor, (Tensor, TensorRef)), WeightsError> {
        let place = self.get(name)?;
        let t = g.parameter(name, place.meta.dtype, place.meta.ne)?;
        Ok((t, (t, place)))
    }

    /// Places the matrices `parts` (one dtype, one row length, 2-d) one after the other in a new
    /// buffer, registered as `merged` (their rows stacked: `[K, M_1 + M_2 + ..]`), each part now a
    /// window of it: one matmul then reads a shared input for all of them (projections of one
    /// input, [`crate::layers::project::merge_groups`]). Nothing changes (`Ok(false)`) when a part is missing,
    /// already a window, or they do not stack; the parts' old buffers are freed once the copy is
    /// made.
    pub fn merge_rows(
        &mut self,
        parts: &[&str],
        merged: &str,
        backend: &mut dyn Backend,
    ) -> Result<bool, WeightsError> {
        self.stack(parts, merged, 1, backend)
    }

    /// [`ModelWeights::merge_rows`] along dimension `axis`: the parts agree on every dimension
    /// below it and have none above it (a `[K, M]` matrix stacks onto `[K, M, E]` experts along
    /// axis 2 as one more expert), so stacking is placing their bytes one after the other.
    pub fn stack(
        &mut self,
        parts: &[&str],
        merged: &str,
        axis: usize,
        backend: &mut dyn Backend,
    ) -> Result<bool, WeightsError> {
        self.stack_padded(parts, merged, axis, 1, backend)
    }

    /// [`ModelWeights::stack`] with the stacked dimension rounded up to a multiple of `multiple`
    /// by zeros after the last part (the parts' windows do not cover them): a product's rows then
    /// keep an alignment its readers want (the router's logits as 16-byte rows).
    pub fn stack_padded(
        &mut self,
        parts: &[&str],
        merged: &str,
        axis: usize,
        multiple: usize,
        backend: &mut dyn Backend,
    ) -> Result<bool, WeightsError> {
        let Some(places) = parts.iter().map(|p| self.tensors.get(*p).copied()).collect::<Option<Vec<_>>>() else {
            return Ok(false);
        };
        let first = places[0].meta;
        let stacks = axis < 4
            && places.iter().all(|p| {
                p.meta.dtype == first.dtype
                    && p.meta.ne[..axis] == first.ne[..axis]
                    && p.meta.ne[axis + 1..].iter().all(|&n| n == 1)
                    && p.meta.is_contiguous()
            });
        if !stacks || self.tensors.contains_key(merged) || parts.iter().any(|p| self.windows.contains(*p)) {
            return Ok(false);
        }
        let mut ne = first.ne;
        ne[axis] = places.iter().map(|p| p.meta.ne[axis]).sum::<usize>().next_multiple_of(multiple.max(1));
        let meta = TensorMeta::contiguous("weight", first.dtype, ne)
            .map_err(|e| WeightsError::Bad { name: merged.to_string(), why: e.to_string() })?;
        let buffer = backend.alloc(meta.nbytes_contiguous())?;
        let parts_bytes: usize = places.iter().map(|p| p.meta.nbytes_contiguous()).sum();
        if parts_bytes < meta.nbytes_contiguous() {
            // (zero bytes are zero values in every weight dtype: a zero scale in the quantized ones)
            let pad = vec![0u8; meta.nbytes_contiguous() - parts_bytes];
            if let Err(e) = backend.write(buffer, parts_bytes, &pad) {
                backend.free(buffer);
                return Err(e.into());
            }
        }
        let mut at = 0;
        let mut windows = Vec::with_capacity(places.len());
        for place in &places {
            let n = place.meta.nbytes_contiguous();
            let mut bytes = vec![0u8; n];
            let copied =
                backend.read(place.buffer, place.offset, &mut bytes).and_then(|()| backend.write(buffer, at, &bytes));
            if let Err(e) = copied {
                backend.free(buffer);
                return Err(e.into());
            }
            windows.push(TensorRef { buffer, offset: at, meta: place.meta });
            at += n;
        }
        for (name, (old, window)) in parts.iter().zip(places.iter().zip(windows)) {
            backend.free(old.buffer);
            self.tensors.insert(name.to_string(), window);
            self.windows.insert(name.to_string());
        }
        self.tensors.insert(merged.to_string(), TensorRef { buffer, offset: 0, meta });
        self.derived.insert(merged.to_string());
        Ok(true)
    }

    /// Places a constant i32 tensor `name` of shape `ne` made at load (not read from the file).
    pub fn insert_i32(
        &mut self,
        name: &str,
        ne: [usize; 4],
        values: &[i32],
        backend: &mut dyn Backend,
    ) -> Result<(), WeightsError> {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.upload(name, DType::I32, ne, values.len(), &bytes, backend)?;
        self.derived.insert(name.to_string());
        Ok(())
    }

    /// Places an f32 tensor `name` of shape `ne` (ggml order) holding `values` (`ne`'s element
    /// count of them, `ne[0]` innermost): weights made by the caller rather than read from a
    /// file (an architecture defined outside this crate, a test).
    pub fn insert_f32(
        &mut self,
        name: &str,
        ne: [usize; 4],
        values: &[f32],
        backend: &mut dyn Backend,
    ) -> Result<(), WeightsError> {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.upload(name, DType::F32, ne, values.len(), &bytes, backend)
    }

    /// Uploads `bytes` (`count` values of `dtype`, which must fill `ne`) as tensor `name`.
    fn upload(
        &mut self,
        name: &str,
        dtype: DType,
        ne: [usize; 4],
        count: usize,
        bytes: &[u8],
        backend: &mut dyn Backend,
    ) -> Result<(), WeightsError> {
        let bad = |why: String| WeightsError::Bad { name: name.to_string(), why };
        let meta = TensorMeta::contiguous("weight", dtype, ne).map_err(|e| bad(e.to_string()))?;
        if meta.nelements() != count {
            return Err(bad(format!("{count} values for shape {ne:?}")));
        }
        let buffer = backend.alloc(meta.nbytes_contiguous())?;
        if let Err(e) = backend.write(buffer, 0, bytes) {
            backend.free(buffer);
            return Err(e.into());
        }
        self.insert(name.to_string(), TensorRef { buffer, offset: 0, meta });
        Ok(())
    }

    /// Bytes of the weights as loaded: every tensor read from the file or placed by the caller,
    /// once (a window of a stacked matrix counts as the part it is; the stacked matrices and
    /// constants made at load are not counted again).
    pub fn tensor_bytes(&self) -> usize {
        self.tensors.iter().filter(|(n, _)| !self.derived.contains(*n)).map(|(_, t)| t.meta.nbytes_contiguous()).sum()
    }

    /// Frees every buffer on `backend` (the one the weights were loaded on), once each (merged
    /// tensors share one).
    pub fn free(&mut self, backend: &mut dyn Backend) {
        self.windows.clear();
        self.derived.clear();
        let mut buffers: Vec<_> = self.tensors.drain().map(|(_, t)| t.buffer).collect();
        buffers.sort_unstable();
        buffers.dedup();
        for b in buffers {
            backend.free(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use tessera_cpu::CpuBackend;
    use tessera_graph::{Backend, DType, TensorMeta, TensorRef};

    use super::ModelWeights;

    /// Places an f32 tensor of shape `ne` holding `first, first + 1, ..`.
    fn put(w: &mut ModelWeights, be: &mut CpuBackend, name: &str, ne: [usize; 4], first: f32) {
        let meta = TensorMeta::contiguous("weight", DType::F32, ne).unwrap();
        let buffer = be.alloc(meta.nbytes_contiguous()).unwrap();
        let bytes: Vec<u8> = (0..meta.nelements()).flat_map(|i| (first + i as f32).to_le_bytes()).collect();
        be.write(buffer, 0, &bytes).unwrap();
        w.insert(name.to_string(), TensorRef { buffer, offset: 0, meta });
    }

    fn values(w: &ModelWeights, be: &mut CpuBackend, name: &str) -> Vec<f32> {
        let t = w.get(name).unwrap();
        let mut bytes = vec![0u8; t.meta.nbytes_contiguous()];
        be.read(t.buffer, t.offset, &mut bytes).unwrap();
        bytes.chunks(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect()
    }

    #[test]
    fn a_matrix_stacks_onto_experts_as_one_more_and_both_become_windows() {
        let mut be = CpuBackend::new();
        let mut w = ModelWeights::default();
        put(&mut w, &mut be, "exps", [2, 3, 4, 1], 0.0);
        put(&mut w, &mut be, "one", [2, 3, 1, 1], 100.0);
        assert!(w.stack(&["exps", "one"], "all", 2, &mut be).unwrap());
        let all = w.get("all").unwrap();
        assert_eq!(all.meta.ne, [2, 3, 5, 1]);
        let want: Vec<f32> = (0..24).map(|i| i as f32).chain((0..6).map(|i| 100.0 + i as f32)).collect();
        assert_eq!(values(&w, &mut be, "all"), want);
        assert_eq!(values(&w, &mut be, "one"), want[24..]);
        assert_eq!(w.get("one").unwrap().offset, 24 * 4);
        // windows do not stack again, and neither does a taken name
        put(&mut w, &mut be, "other", [2, 3, 1, 1], 0.0);
        assert!(!w.stack(&["one", "other"], "again", 2, &mut be).unwrap());
        assert!(!w.stack(&["other"], "all", 2, &mut be).unwrap());
        w.free(&mut be);
    }

    #[test]
    fn padded_stacks_end_in_zero_rows_outside_every_window() {
        let mut be = CpuBackend::new();
        let mut w = ModelWeights::default();
        put(&mut w, &mut be, "router", [2, 5, 1, 1], 1.0);
        put(&mut w, &mut be, "gate", [2, 1, 1, 1], 50.0);
        assert!(w.stack_padded(&["router", "gate"], "both", 1, 4, &mut be).unwrap());
        assert_eq!(w.get("both").unwrap().meta.ne, [2, 8, 1, 1]);
        let want: Vec<f32> = (0..10).map(|i| 1.0 + i as f32).chain([50.0, 51.0]).chain([0.0; 4]).collect();
        assert_eq!(values(&w, &mut be, "both"), want);
        assert_eq!(values(&w, &mut be, "gate"), [50.0, 51.0]);
        w.free(&mut be);
    }

    #[test]
    fn parts_that_do_not_stack_are_left_alone() {
        let mut be = CpuBackend::new();
        let mut w = ModelWeights::default();
        put(&mut w, &mut be, "exps", [2, 3, 4, 1], 0.0);
        put(&mut w, &mut be, "wide", [2, 4, 1, 1], 0.0); // another row count below the axis
        put(&mut w, &mut be, "rows", [2, 3, 1, 1], 0.0);
        assert!(!w.stack(&["exps", "wide"], "m", 2, &mut be).unwrap());
        assert!(!w.stack(&["exps", "rows"], "m", 1, &mut be).unwrap()); // exps has a dimension above axis 1
        assert!(!w.stack(&["exps", "missing"], "m", 2, &mut be).unwrap());
        assert!(!w.contains("m"));
        assert_eq!(values(&w, &mut be, "rows"), [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
        assert!(w.insert_i32("ids", [1, 2, 1, 1], &[7], &mut be).is_err(), "one value for two elements");
        w.insert_i32("id", [1, 1, 1, 1], &[7], &mut be).unwrap();
        assert_eq!(w.get("id").unwrap().meta.dtype, DType::I32);
        w.free(&mut be);
    }
}
