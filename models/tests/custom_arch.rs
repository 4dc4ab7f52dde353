//! An architecture defined outside the crate: the runtime serves what it declares and refuses
//! what it cannot serve, with errors naming the layer.

use tessera_cpu::CpuBackend;
use tessera_graph::Tensor;
use tessera_models::arch::{Architecture, LayerCacheNeed, StepBuilder};
use tessera_models::layers::norm::{rms_norm, token_embedding};
use tessera_models::model::{Logits, Model, ModelError, ModelOptions};
use tessera_models::weights::ModelWeights;

/// Embedding, final norm, head; `needs` declared as given; `attend` asks layer 0 for a KV cache.
#[derive(Debug)]
struct Toy {
    needs: Vec<LayerCacheNeed>,
    attend: bool,
}

const VOCAB: usize = 16;
const EMBD: usize = 8;

impl Architecture for Toy {
    fn name(&self) -> &str {
        "toy"
    }

    fn n_vocab(&self) -> usize {
        VOCAB
    }

    fn layer_caches(&self) -> Vec<LayerCacheNeed> {
        self.needs.clone()
    }

    fn build(&self, b: &mut StepBuilder<'_>) -> Result<Tensor, ModelError> {
        let x = token_embedding(b, "token_embd.weight")?;
        if self.attend {
            b.kv_cache(0)?;
        }
        rms_norm(b, x, "output_norm.weight", 1e-6)
    }
}

fn load(toy: Toy, be: &mut CpuBackend) -> Result<Model, ModelError> {
    let mut w = ModelWeights::default();
    let values: Vec<f32> = (0..EMBD * VOCAB).map(|i| ((i * 7) % 11) as f32 / 11.0 - 0.5).collect();
    w.insert_f32("token_embd.weight", [EMBD, VOCAB, 1, 1], &values, be)?;
    w.insert_f32("output_norm.weight", [EMBD, 1, 1, 1], &[1.0; EMBD], be)?;
    w.insert_f32("output.weight", [EMBD, VOCAB, 1, 1], &values, be)?;
    Model::from_arch(Box::new(toy), w, be, ModelOptions::default())
}

#[test]
fn a_cacheless_architecture_steps_and_counts_its_weights() {
    let mut be = CpuBackend::new();
    let mut m = load(Toy { needs: vec![LayerCacheNeed::None; 2], attend: false }, &mut be).unwrap();
    let out = m.step(&mut be, &[(0, &[1, 2, 3][..])], Logits::All).unwrap();
    assert_eq!(out[0].len(), 3 * VOCAB);
    assert!(out[0].iter().all(|v| v.is_finite()));
    assert_eq!(m.weights.tensor_bytes(), 4 * (2 * EMBD * VOCAB + EMBD));
    assert!(m.config().is_none());
    let e = m.step(&mut be, &[(0, &[VOCAB as u32][..])], Logits::Last).unwrap_err();
    assert!(matches!(e, ModelError::BadBatch { .. }), "{e}");
    m.free(&mut be);
}

#[test]
fn cache_needs_that_one_cache_cannot_serve_are_refused() {
    let mut be = CpuBackend::new();
    let a = |d| LayerCacheNeed::Attention { n_head_kv: 1, k_dim: d, v_dim: d };
    let e = load(Toy { needs: vec![a(4), a(8)], attend: false }, &mut be).unwrap_err();
    assert!(matches!(&e, ModelError::CacheNeeds { arch, .. } if arch == "toy"), "{e}");
    assert!(e.to_string().contains("layer 1"), "{e}");
    let e = load(Toy { needs: vec![a(0)], attend: false }, &mut be).unwrap_err();
    assert!(e.to_string().contains("zero dimension"), "{e}");
}

#[test]
fn a_layer_asking_for_a_cache_it_did_not_declare_is_an_error() {
    let mut be = CpuBackend::new();
    let mut m = load(Toy { needs: vec![LayerCacheNeed::None], attend: true }, &mut be).unwrap();
    let e = m.step(&mut be, &[(0, &[1][..])], Logits::Last).unwrap_err();
    assert!(matches!(&e, ModelError::Layer { why } if why.contains("layer 0")), "{e}");
    m.free(&mut be);
}
