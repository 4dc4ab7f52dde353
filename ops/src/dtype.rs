//! Element types, including the block-quantized model.
//!
//! Every dtype is described as blocks: `block_size` logical elements stored in `block_bytes`
//! bytes. Plain types have a block of one element; block-quantized formats (q8_0, nvfp4; next
//! issue) pack several values with a shared scale. A row (`ne[0]` elements) must be a whole number
//! of blocks.

use std::fmt;

/// The element type of a tensor. Discriminants are the GGUF / ggml type ids, so a tensor read from
/// a GGUF file maps to a `DType` with [`DType::from_ggml_id`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum DType {
    F32 = 0,
    F16 = 1,
    /// 32 values as an f16 scale and 32 i8 quants (34 bytes), as in GGUF.
    Q8_0 = 8,
    I32 = 26,
    BF16 = 30,
    /// 64 values as 4 sub-blocks of 16, one UE4M3 scale byte each, then packed E2M1 nibbles
    /// (36 bytes), as in GGUF (ggml type 40). See [`crate::quant`].
    NvFp4 = 40,
}

impl DType {
    /// Every dtype, in a stable order (used by test-ops and property tests).
    pub const ALL: [DType; 6] = [DType::F32, DType::F16, DType::BF16, DType::I32, DType::Q8_0, DType::NvFp4];

    /// The dtypes of one element per block.
    pub const PLAIN: [DType; 4] = [DType::F32, DType::F16, DType::BF16, DType::I32];

    /// Stable lower-case name, as ggml spells it.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::Q8_0 => "q8_0",
            DType::NvFp4 => "nvfp4",
        }
    }

    /// Logical elements per block (1 for plain types).
    pub const fn block_size(self) -> usize {
        match self {
            DType::Q8_0 => crate::quant::Q8_0_BLOCK,
            DType::NvFp4 => crate::quant::NVFP4_BLOCK,
            _ => 1,
        }
    }

    /// Bytes per block.
    pub const fn block_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::Q8_0 => crate::quant::Q8_0_BLOCK_BYTES,
            DType::NvFp4 => crate::quant::NVFP4_BLOCK_BYTES,
        }
    }

    /// True for block-quantized formats.
    pub const fn is_quantized(self) -> bool {
        self.block_size() > 1
    }

    /// True for types holding real numbers (floats and quantized), false for integer types.
    pub const fn is_float(self) -> bool {
        !matches!(self, DType::I32)
    }

    /// Bytes of one row of `ne0` elements, or `None` when `ne0` is not a whole number of blocks or
    /// the size overflows.
    pub fn row_bytes(self, ne0: usize) -> Option<usize> {
        if !ne0.is_multiple_of(self.block_size()) {
            return None;
        }
        (ne0 / self.block_size()).checked_mul(self.block_bytes())
    }

    /// The GGUF / ggml type id.
    pub const fn ggml_id(self) -> u32 {
        self as u32
    }

    /// The dtype for a GGUF / ggml type id, if Tessera supports it.
    pub fn from_ggml_id(id: u32) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.ggml_id() == id)
    }

    /// Rounds an f64 to the nearest value this dtype can hold (ties to even for floats, saturating
    /// for integers). The f64 reference stores through this so it models the output's precision.
    /// Block-quantized values depend on their whole block, so they pass through unchanged here
    /// (storing them through [`crate::host::scatter_f64`] quantizes).
    pub fn round(self, x: f64) -> f64 {
        match self {
            DType::F32 => x as f32 as f64,
            DType::F16 => half::f16::from_f64(x).to_f64(),
            DType::BF16 => half::bf16::from_f64(x).to_f64(),
            DType::I32 => x.round().clamp(i32::MIN as f64, i32::MAX as f64),
            DType::Q8_0 | DType::NvFp4 => x,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ggml_ids_round_trip() {
        for d in DType::ALL {
            assert_eq!(DType::from_ggml_id(d.ggml_id()), Some(d));
        }
        assert_eq!(DType::from_ggml_id(2), None, "q4_0 is not supported");
        assert_eq!(DType::Q8_0.row_bytes(64), Some(68));
        assert_eq!(DType::NvFp4.row_bytes(128), Some(72));
        assert_eq!(DType::NvFp4.row_bytes(32), None);
    }

    #[test]
    fn row_bytes_of_plain_types() {
        assert_eq!(DType::F32.row_bytes(5), Some(20));
        assert_eq!(DType::BF16.row_bytes(3), Some(6));
        assert_eq!(DType::F32.row_bytes(usize::MAX), None);
    }

    #[test]
    fn rounding_models_storage_precision() {
        assert_eq!(DType::F16.round(1.0 + 1e-5), 1.0);
        assert_eq!(DType::BF16.round(1.0 + 1e-3), 1.0);
        assert_eq!(DType::I32.round(2.6), 3.0);
        assert_eq!(DType::F32.round(0.1), 0.1f32 as f64);
    }
}
