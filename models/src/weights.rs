//! Model weights resident in backend memory: see [`ModelWeights`].

use std::collections::HashMap;

use tessera_graph::{Backend, BackendError, Graph, GraphError, Tensor, TensorMeta, TensorRef};

use crate::config::{ConfigError, ModelConfig};
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
/// per tensor), by llama.cpp name. Step graphs reference them as parameter leaves bound to this
/// memory ([`ModelWeights::param`] + `Session::with_bindings`), so nothing is copied per step.
///
/// The buffers belong to the backend they were loaded on; call [`ModelWeights::free`] to release
/// them (the backend is not held, so there is no `Drop`).
#[derive(Debug, Default)]
pub struct ModelWeights {
    tensors: HashMap<String, TensorRef>,
}

impl ModelWeights {
    /// Checks `file` against `config` ([`ModelConfig::validate_tensors`]: every tensor present
    /// with its shape), then allocates and writes each tensor of the config on `backend`.
    pub fn load(file: &GgufFile, config: &ModelConfig, backend: &mut dyn Backend) -> Result<Self, WeightsError> {
        config.validate_tensors(file)?;
        let mut w = ModelWeights::default();
        for spec in config.tensor_specs() {
            let info = file.tensor(&spec.name).ok_or_else(|| WeightsError::Missing { name: spec.name.clone() })?;
            let meta = TensorMeta::contiguous("weight", info.dtype, info.ne)
                .map_err(|e| WeightsError::Bad { name: spec.name.clone(), why: e.to_string() })?;
            let data = file.tensor_data(&spec.name)?;
            if data.len() != meta.nbytes_contiguous() {
                let why = format!("{} bytes of data for a {}-byte tensor", data.len(), meta.nbytes_contiguous());
                return Err(WeightsError::Bad { name: spec.name.clone(), why });
            }
            let buffer = backend.alloc(data.len())?;
            if let Err(e) = backend.write(buffer, 0, data) {
                backend.free(buffer);
                w.free(backend);
                return Err(e.into());
            }
            w.tensors.insert(spec.name, TensorRef { buffer, offset: 0, meta });
        }
        Ok(w)
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

    /// Frees every buffer on `backend` (the one the weights were loaded on).
    pub fn free(&mut self, backend: &mut dyn Backend) {
        for (_, t) in self.tensors.drain() {
            backend.free(t.buffer);
        }
    }
}
