//! A toy architecture defined outside `tessera-models`: a two-layer MLP language model (token
//! embedding, two pre-norm SwiGLU residual blocks, final norm, LM head `output.weight`),
//! with seeded random weights, run through the same runtime as Qwen3.5: on the CPU backend and,
//! where a GPU is present, on the CUDA backend too.
//!
//! It has no attention and no recurrence, so every layer declares [`LayerCacheNeed::None`]; its
//! step graph is built from the public layer builders. The program checks that a batch of two
//! sequences gives each the logits it gets alone, then decodes a few tokens greedily; on CUDA it
//! checks the logits against the CPU's and the greedy tokens for equality.
//!
//! ```text
//! cargo run -p tessera-models --example mlp_lm
//! ```

use tessera_cpu::CpuBackend;
use tessera_cuda::CudaBackend;
use tessera_graph::{Backend, Tensor};
use tessera_models::arch::{Architecture, LayerCacheNeed, StepBuilder};
use tessera_models::layers::ffn::swiglu;
use tessera_models::layers::norm::{rms_norm, token_embedding};
use tessera_models::model::{Logits, Model, ModelError, ModelOptions};
use tessera_models::weights::ModelWeights;

/// The toy's shape.
#[derive(Debug, Clone, Copy)]
struct MlpLm {
    n_vocab: usize,
    n_embd: usize,
    n_ff: usize,
    n_layer: usize,
}

impl Architecture for MlpLm {
    fn name(&self) -> &str {
        "mlp-lm"
    }

    fn n_vocab(&self) -> usize {
        self.n_vocab
    }

    fn layer_caches(&self) -> Vec<LayerCacheNeed> {
        vec![LayerCacheNeed::None; self.n_layer]
    }

    fn build(&self, b: &mut StepBuilder<'_>) -> Result<Tensor, ModelError> {
        let mut x = token_embedding(b, "token_embd.weight")?;
        for il in 0..self.n_layer {
            let pre = format!("blk.{il}");
            let h = rms_norm(b, x, &format!("{pre}.ffn_norm.weight"), 1e-6)?;
            let f = swiglu(b, &pre, h)?;
            x = b.g.add(x, f)?;
        }
        rms_norm(b, x, "output_norm.weight", 1e-6)
    }
}

impl MlpLm {
    /// Every weight, seeded: `(name, ggml-order shape, values)`.
    fn weights(&self, seed: u64) -> Vec<(String, [usize; 4], Vec<f32>)> {
        let mut state = seed;
        let mut values = |n: usize, scale: f32| -> Vec<f32> {
            (0..n)
                .map(|_| {
                    // SplitMix64 to a uniform value in [-scale, scale)
                    state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
                    let mut z = state;
                    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                    z ^= z >> 31;
                    ((z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
                })
                .collect()
        };
        let (v, e, ff) = (self.n_vocab, self.n_embd, self.n_ff);
        let mut w = vec![("token_embd.weight".to_string(), [e, v, 1, 1], values(e * v, 1.0))];
        for il in 0..self.n_layer {
            let p = |n: &str| format!("blk.{il}.{n}.weight");
            w.push((p("ffn_norm"), [e, 1, 1, 1], vec![1.0; e]));
            w.push((p("ffn_gate"), [e, ff, 1, 1], values(e * ff, 1.0 / (e as f32).sqrt())));
            w.push((p("ffn_up"), [e, ff, 1, 1], values(e * ff, 1.0 / (e as f32).sqrt())));
            w.push((p("ffn_down"), [ff, e, 1, 1], values(ff * e, 1.0 / (ff as f32).sqrt())));
        }
        w.push(("output_norm.weight".to_string(), [e, 1, 1, 1], vec![1.0; e]));
        w.push(("output.weight".to_string(), [e, v, 1, 1], values(e * v, 1.0 / (e as f32).sqrt())));
        w
    }
}

/// What one backend computed: the batched logits of the second sequence and the greedy tokens.
struct Run {
    logits: Vec<f32>,
    tokens: Vec<u32>,
}

/// Loads the toy on `backend`, checks batch == alone and decodes greedily.
fn run(arch: MlpLm, backend: &mut dyn Backend) -> Result<Run, Box<dyn std::error::Error>> {
    let mut weights = ModelWeights::default();
    for (name, ne, values) in arch.weights(7) {
        weights.insert_f32(&name, ne, &values, backend)?;
    }
    let mut model = Model::from_arch(Box::new(arch), weights, backend, ModelOptions::default())?;

    // Two sequences in one step give the logits each gets alone.
    let (a, b): (&[u32], &[u32]) = (&[1, 2, 3], &[9, 8]);
    let both = model.step(backend, &[(0, a), (1, b)], Logits::All)?;
    model.remove_sequence(0)?;
    model.remove_sequence(1)?;
    let alone = model.step(backend, &[(2, b)], Logits::All)?;
    model.remove_sequence(2)?;
    let diff = both[1].iter().zip(&alone[0]).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
    println!("{}: batch vs alone: max |logit difference| {diff:e}", backend.name());
    assert!(diff < 1e-5, "a sequence's logits depend on its batch");

    // Greedy decoding, the token sampled on the device each step.
    let mut tokens = vec![5u32];
    let mut last = vec![5u32];
    for _ in 0..8 {
        let next = model.step_greedy(backend, &[(3, &last)])?[0];
        tokens.push(next);
        last = vec![next];
    }
    println!("{}: {} greedy: {tokens:?}", backend.name(), model.arch().name());
    model.free(backend);
    Ok(Run { logits: both[1].clone(), tokens })
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let arch = MlpLm { n_vocab: 64, n_embd: 32, n_ff: 96, n_layer: 2 };
    let cpu = run(arch, &mut CpuBackend::new())?;
    match CudaBackend::new() {
        Ok(mut cuda) => {
            let gpu = run(arch, &mut cuda)?;
            let diff = gpu.logits.iter().zip(&cpu.logits).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
            println!("cuda vs cpu: max |logit difference| {diff:e}");
            assert!(diff < 1e-3, "CUDA logits differ from the CPU's");
            assert_eq!(gpu.tokens, cpu.tokens, "CUDA's greedy tokens differ from the CPU's");
        }
        Err(e) => println!("cuda: skipped ({e})"),
    }
    Ok(())
}
