//! Tensor descriptors: dtype, shape and byte strides.
//!
//! # Dimension order: ggml order, `ne[0]` is innermost
//!
//! **Tessera numbers dimensions the way ggml and GGUF do: `ne[0]` is the innermost, contiguous
//! dimension (the length of a row), `ne[3]` the outermost.** A PyTorch tensor of shape
//! `[batch, seq, hidden]` is a Tessera tensor with `ne = [hidden, seq, batch, 1]`. Byte strides
//! follow the same order: element `(i0, i1, i2, i3)` lives at byte
//! `i0 / block_size * nb[0] + i1 * nb[1] + i2 * nb[2] + i3 * nb[3]` from the tensor's start.
//! Tensors have exactly four dimensions; unused outer dimensions are 1.

use crate::{DType, OpError};

/// Number of dimensions of every tensor.
pub const MAX_DIMS: usize = 4;

/// The descriptor of a tensor: dtype, shape `ne` and byte strides `nb`, both in ggml order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TensorMeta {
    pub dtype: DType,
    /// Elements per dimension, `ne[0]` innermost. Every entry is at least 1.
    pub ne: [usize; 4],
    /// Byte stride per dimension; `nb[0]` is the size of one block of `dtype`.
    pub nb: [usize; 4],
}

impl TensorMeta {
    /// A contiguous tensor of `dtype` and shape `ne`. Errors when a dimension is zero, a row is
    /// not a whole number of blocks, or the byte size overflows.
    pub fn contiguous(op: &'static str, dtype: DType, ne: [usize; 4]) -> Result<Self, OpError> {
        if ne.contains(&0) {
            return Err(OpError::InvalidShape { op, shape: ne, why: "every dimension must be at least 1".into() });
        }
        if !ne[0].is_multiple_of(dtype.block_size()) {
            return Err(OpError::InvalidShape {
                op,
                shape: ne,
                why: format!("ne[0] must be a multiple of {}'s block size {}", dtype, dtype.block_size()),
            });
        }
        let too_large = || OpError::TooLarge { op, shape: ne, dtype };
        let mut nb = [0; 4];
        nb[0] = dtype.block_bytes();
        nb[1] = dtype.row_bytes(ne[0]).ok_or_else(too_large)?;
        nb[2] = nb[1].checked_mul(ne[1]).ok_or_else(too_large)?;
        nb[3] = nb[2].checked_mul(ne[2]).ok_or_else(too_large)?;
        // The total size must fit too, and stay below isize::MAX so it can back a slice.
        let bytes = nb[3].checked_mul(ne[3]).ok_or_else(too_large)?;
        if bytes > isize::MAX as usize {
            return Err(too_large());
        }
        Ok(TensorMeta { dtype, ne, nb })
    }

    /// Number of logical elements.
    pub fn nelements(&self) -> usize {
        self.ne.iter().product()
    }

    /// Number of rows (`ne[1] * ne[2] * ne[3]`).
    pub fn nrows(&self) -> usize {
        self.ne[1] * self.ne[2] * self.ne[3]
    }

    /// Bytes of one contiguous row.
    pub fn row_bytes(&self) -> usize {
        self.ne[0] / self.dtype.block_size() * self.dtype.block_bytes()
    }

    /// Bytes the tensor's data would take if contiguous.
    pub fn nbytes_contiguous(&self) -> usize {
        self.row_bytes() * self.nrows()
    }

    /// Bytes from the tensor's first byte to one past its last: the memory a view of it must
    /// fit within.
    pub fn span_bytes(&self) -> usize {
        let mut last = self.dtype.block_bytes() + (self.ne[0] / self.dtype.block_size() - 1) * self.nb[0];
        for d in 1..4 {
            last += (self.ne[d] - 1) * self.nb[d];
        }
        last
    }

    /// True when elements are laid out densely in ggml order with no gaps.
    pub fn is_contiguous(&self) -> bool {
        let mut expect = self.dtype.block_bytes();
        if self.nb[0] != expect {
            return false;
        }
        expect = self.row_bytes();
        for d in 1..4 {
            if self.ne[d] != 1 && self.nb[d] != expect {
                return false;
            }
            expect *= self.ne[d];
        }
        true
    }

    /// True when each row is dense (`nb[0]` is the block size), whatever the outer strides.
    pub fn has_contiguous_rows(&self) -> bool {
        self.nb[0] == self.dtype.block_bytes()
    }

    /// Byte offset of element `(i0, i1, i2, i3)`; `i0` must start a block.
    pub fn offset_of(&self, i: [usize; 4]) -> usize {
        i[0] / self.dtype.block_size() * self.nb[0] + i[1] * self.nb[1] + i[2] * self.nb[2] + i[3] * self.nb[3]
    }

    /// True when no two distinct elements share bytes: with dimensions sorted by stride, each
    /// stride is at least the span of all the smaller ones.
    pub fn is_injective(&self) -> bool {
        let mut dims: Vec<(usize, usize)> = Vec::with_capacity(4);
        // dimension 0 in blocks: extent of one block, count of blocks
        dims.push((self.nb[0], self.ne[0] / self.dtype.block_size()));
        for d in 1..4 {
            dims.push((self.nb[d], self.ne[d]));
        }
        dims.retain(|&(_, n)| n > 1);
        dims.sort_unstable();
        let mut span = self.dtype.block_bytes();
        for (stride, n) in dims {
            if stride < span {
                return false;
            }
            span += stride * (n - 1);
        }
        true
    }

    /// Shape and dtype equal (strides may differ).
    pub fn same_shape(&self, other: &TensorMeta) -> bool {
        self.ne == other.ne
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_strides_in_ggml_order() {
        let m = TensorMeta::contiguous("t", DType::F32, [3, 4, 5, 2]).unwrap();
        assert_eq!(m.nb, [4, 12, 48, 240]);
        assert!(m.is_contiguous());
        assert_eq!(m.span_bytes(), 480);
        assert_eq!(m.nbytes_contiguous(), 480);
        assert_eq!(m.offset_of([1, 2, 3, 1]), 4 + 24 + 144 + 240);
    }

    #[test]
    fn zero_and_overflowing_shapes_are_errors() {
        assert!(matches!(TensorMeta::contiguous("t", DType::F32, [0, 1, 1, 1]), Err(OpError::InvalidShape { .. })));
        assert!(matches!(
            TensorMeta::contiguous("t", DType::F32, [usize::MAX / 2, 4, 1, 1]),
            Err(OpError::TooLarge { .. })
        ));
    }

    #[test]
    fn transposed_layout_is_injective_but_not_contiguous() {
        let mut m = TensorMeta::contiguous("t", DType::F32, [3, 4, 1, 1]).unwrap();
        m.ne = [4, 3, 1, 1];
        m.nb = [4, 12, 48, 48];
        assert!(!m.is_contiguous());
        m.nb = [12, 4, 48, 48];
        assert!(m.is_injective());
        m.nb = [4, 8, 48, 48]; // rows of 4 with stride 2 elements overlap
        assert!(!m.is_injective());
    }
}
