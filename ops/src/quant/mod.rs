//! Block-quantized formats, byte-compatible with ggml and GGUF files: [`q8_0`] (ggml type 8) and
//! [`nvfp4`] (ggml type 40).
//!
//! Pure functions over host slices: whole-tensor `quantize_*` / `dequantize_*` (a contiguous run of
//! blocks, e.g. one row), per-block `quantize_block_*` / `dequantize_block_*` on fixed-size arrays
//! for kernels and executors to reuse, and `dequantize_*_f64` for the f64 reference. Dequantization
//! reproduces ggml's `dequantize_row_*` bit for bit; quantization reproduces ggml's
//! `quantize_row_*_ref`, which is what `llama-quantize` writes (ggml's `quantize_q8_0` and
//! `quantize_nvfp4` ignore the importance matrix and call the reference). The tests in
//! `ops/tests/quant_fixtures.rs` hold both to fixtures made with the `gguf` Python package
//! (`tools/gen_quant_fixtures.py`).
//!
//! Sources (read for semantics; nothing copied): ggml-org/ggml at d99724f2 (`include/ggml.h:398,430`
//! type ids, `src/ggml-common.h` block structs and tables, `src/ggml-impl.h` UE4M3 and f16
//! conversions, `src/ggml-quants.c` reference (de)quantizers, `src/ggml.c:736,759` type traits);
//! PyPI `gguf` 0.19.0 (`gguf/quants.py`: `np_roundf`, `Q8_0`, `NVFP4`); ggml-org/llama.cpp's
//! `convert_hf_to_gguf.py`, `src/llama-model.cpp` and `src/llama-graph.cpp` for the per-tensor scale.
//! Each format's exact layout, rounding and non-finite handling is in its module docs.
//!
//! # q8_0
//!
//! 32 values, 34 bytes: f16 `d = amax / 127`, then 32 `i8` quants `round(x / d)` (half away from
//! zero, with `1 / d` taken from the f32 `d`).
//!
//! # nvfp4
//!
//! 64 values, 36 bytes: four UE4M3 sub-block scales (one per 16 values) then 32 bytes of E2M1
//! codes, element `j` of a sub-block in the low nibble of its byte `j`, element `j + 8` in the high
//! nibble. Scale `ue4m3(amax / 6)`, codes nearest on the E2M1 grid.
//!
//! # The NVFP4 per-tensor scale (`weight_scale_2`)
//!
//! NVIDIA ModelOpt NVFP4 checkpoints carry, per linear layer, `weight` (packed E2M1), `weight_scale`
//! (one E4M3 per 16 values) and two f32 scalars, `weight_scale_2` (the per-tensor "global" scale,
//! typically `amax(W) / (6 * 448)`) and `input_scale` (for activation quantization). The real weight
//! is `e2m1 * weight_scale * weight_scale_2`. A ggml NVFP4 block holds only the first two factors.
//!
//! **Storage** (llama.cpp `convert_hf_to_gguf.py`, ggml-org/llama.cpp at 0024aa74, `ModelBase`):
//! - `_nvfp4_pack` regroups the nibbles into ggml's order and copies the E4M3 `weight_scale` bytes
//!   verbatim as UE4M3 (`& 0x7F`, sign bit dropped); nothing is re-quantized. Its docstring: "The
//!   per-tensor scale2 factor is stored as a separate tensor and applied at inference time via
//!   ggml_mul()".
//! - `_repack_nvfp4` writes the weight as `<gguf name>.weight` (NVFP4) and, through
//!   `_write_scale_tensor`, `weight_scale_2` as an f32 tensor named `<gguf name>.scale` (shape `[1]`)
//!   and `input_scale` as `<gguf name>.input_scale`. Either is **omitted when it is trivially 1**
//!   (`_scale_is_trivial`: at most one element and `|s - 1| < 1e-6`), so a missing `.scale` means 1.
//! - MoE experts (`_generate_nvfp4_tensors`, `_flush_nvfp4_experts`, `_write_scales_tensor`): the
//!   experts of one layer and projection are stacked into one NVFP4 tensor and their scalars into
//!   f32 vectors of length `n_expert` (`<name>.scale`, `<name>.input_scale`), omitted when all are
//!   within 1e-6 of 1.
//!
//! **Inference** (llama.cpp `src/llama-graph.cpp` at 00395eb2; the `src/llama-model.cpp` loader as
//! found in several indexed copies of llama.cpp whose exact commit the index did not name):
//! - `src/llama-model.cpp`, `llama_model::load_tensors`: after the per-architecture tensors, a
//!   generic loop loads, for every present weight, the optional `tn(<tensor>, "scale", il)` into
//!   `<w>_s` with shape `{1}` (attention q/k/v/o/qkv/gate, dense and shared-expert FFN, SSM, NextN)
//!   or `{n_expert}` (`ffn_{gate,up,down}_exps`), and likewise `"input_scale"` into `<w>_in_s`; the
//!   output head gets `output.scale` when it is NVFP4.
//! - `src/llama-graph.cpp`, `llm_graph_context::build_lora_mm(w, cur, w_s)`:
//!   `res = ggml_mul_mat(w, cur); if (w_s) res = ggml_mul(res, w_s);` — the scale multiplies the
//!   **matmul output** (broadcasting the 1-element f32 tensor), before LoRA deltas are added.
//!   `build_lora_mm_id` does the same per expert: `w_s` reshaped to `[1, n_expert, 1]`, repeated over
//!   tokens and gathered with the routing `ids` before the `ggml_mul`. `build_ffn` applies
//!   `ffn_{up,gate,down}_s` with `ggml_mul` right after the matmul and asserts that an NVFP4 weight
//!   with a scale has no bias and no LoRA (the scale would otherwise land after them).
//! - In that version the `*_in_s` input scales are loaded but not read by `build_lora_mm`,
//!   `build_lora_mm_id` or `build_ffn`: activations are not pre-scaled.
//!
//! So for Tessera: dequantizing an NVFP4 tensor gives `e2m1 * ue4m3` only (what this module does);
//! a model multiplies the matmul result by `<name>.scale` (1 when absent), which equals scaling the
//! dequantized weight since the scale is one scalar per tensor (or per expert).

pub mod nvfp4;
pub mod q8_0;

pub use nvfp4::{
    E2M1_HALVES, NVFP4_BLOCK, NVFP4_BLOCK_BYTES, NVFP4_SUB_BLOCK, dequantize_block_nvfp4, dequantize_nvfp4,
    dequantize_nvfp4_f64, e2m1_to_f32, f32_to_ue4m3, quantize_block_nvfp4, quantize_nvfp4, ue4m3_to_f32,
};
pub use q8_0::{
    Q8_0_BLOCK, Q8_0_BLOCK_BYTES, dequantize_block_q8_0, dequantize_q8_0, dequantize_q8_0_f64, quantize_block_q8_0,
    quantize_q8_0,
};

/// A length precondition of a whole-tensor (de)quantizer does not hold. Nothing was written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    /// The value count is not a whole number of blocks.
    #[error("{format}: {values} values is not a whole number of {block}-value blocks")]
    PartialBlock { format: &'static str, values: usize, block: usize },
    /// The byte buffer does not match the value count.
    #[error("{format}: {values} values take {expected} bytes, but the buffer has {bytes}")]
    ByteCount { format: &'static str, values: usize, expected: usize, bytes: usize },
}

/// Checks that `values` is a whole number of `block`-value blocks and `bytes` is exactly their size.
fn check_lengths(
    format: &'static str,
    block: usize,
    block_bytes: usize,
    values: usize,
    bytes: usize,
) -> Result<(), QuantError> {
    if !values.is_multiple_of(block) {
        return Err(QuantError::PartialBlock { format, values, block });
    }
    // Cannot overflow for a slice of f32 values, but stays checked rather than rely on that.
    let expected = (values / block).checked_mul(block_bytes);
    match expected {
        Some(expected) if expected == bytes => Ok(()),
        _ => Err(QuantError::ByteCount { format, values, expected: expected.unwrap_or(usize::MAX), bytes }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_the_format_and_sizes() {
        let e = check_lengths("q8_0", 32, 34, 40, 34).unwrap_err();
        assert_eq!(e.to_string(), "q8_0: 40 values is not a whole number of 32-value blocks");
        let e = check_lengths("nvfp4", 64, 36, 128, 70).unwrap_err();
        assert_eq!(e.to_string(), "nvfp4: 128 values take 72 bytes, but the buffer has 70");
        assert_eq!(check_lengths("nvfp4", 64, 36, 0, 0), Ok(()));
    }
}
