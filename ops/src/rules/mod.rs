//! Shape/dtype inference and cost, one file per op family. [`infer`] is pure: it sees only the
//! op and its inputs' descriptors and either returns the output descriptor or says what is wrong.

mod attention;
mod conv;
mod data;
mod delta_net;
mod elementwise;
mod elemfuse;
mod fused;
mod matmul;
mod quant;
mod reduce;
mod rope;
mod sample;
mod view;

use crate::{DType, Family, Op, OpError, TensorMeta};

/// What an op costs to run once: arithmetic and the memory traffic it cannot avoid.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Cost {
    /// Floating-point operations (a multiply-add counts as 2).
    pub flops: u64,
    /// Bytes read plus bytes written, each tensor counted once at its dtype's size.
    pub bytes: u64,
}

/// The output descriptor of `op` applied to `inputs`, or an error naming the op and the offending
/// inputs. Views get the strides of the window they describe; every other op gets a contiguous
/// output, except in-place ops whose output is the tensor they write.
pub fn infer(op: &Op, inputs: &[&TensorMeta]) -> Result<TensorMeta, OpError> {
    match op.family() {
        Family::Data => data::infer(op, inputs),
        Family::View => view::infer(op, inputs),
        Family::Elementwise => elementwise::infer(op, inputs),
        Family::Reduce => reduce::infer(op, inputs),
        Family::Matmul => matmul::infer(op, inputs),
        Family::Quant => quant::infer(op, inputs),
        Family::Rope => rope::infer(op, inputs),
        Family::Attention => attention::infer(op, inputs),
        Family::Conv => conv::infer(op, inputs),
        Family::DeltaNet => delta_net::infer(op, inputs),
        Family::Sample => sample::infer(op, inputs),
        Family::Fused => fused::infer(op, inputs),
        Family::ElemFuse => elemfuse::infer(op, inputs),
    }
}

/// The cost of `op` on `inputs` producing `out` (as returned by [`infer`]). Counts saturate at
/// `u64::MAX` rather than overflow: every tensor fits in memory, but a product of three such
/// sizes (a matmul's flops) or a sum of three (bytes moved) need not fit in 64 bits.
pub fn cost(op: &Op, inputs: &[&TensorMeta], out: &TensorMeta) -> Cost {
    if op.is_view() {
        return Cost::default();
    }
    let size = |m: &TensorMeta| m.nbytes_contiguous() as u64;
    let count = |m: &TensorMeta| m.nelements() as u64;
    let bytes_in = inputs.iter().fold(0u64, |acc, m| acc.saturating_add(size(m)));
    let mut bytes = bytes_in.saturating_add(size(out));
    let n = count(out);
    let flops = match op {
        Op::MulMat | Op::MulMatId => matmul::flops(inputs, out),
        // 6 flops per rotated element; the dims past n_rot are copied.
        Op::RopeMulti(p) => n.saturating_mul(6).saturating_mul(p.n_rot as u64) / out.ne[0].max(1) as u64,
        Op::FlashAttnExt(p) => attention::flops(p, inputs, out),
        Op::SsmConv | Op::SsmConvUpdate { .. } => conv::flops(inputs, out),
        Op::GatedDeltaNet(_) => delta_net::flops(inputs, out),
        Op::L2Norm { .. } => count(inputs[0]).saturating_mul(3),
        Op::TopK { .. } | Op::Argsort(_) => count(inputs[0]).saturating_mul(8),
        Op::Quantize(_) | Op::Dequantize => count(inputs[0]).saturating_mul(2),
        Op::Unary(u) => n.saturating_mul(elementwise::unary_flops(*u)),
        Op::Binary(_) => n,
        Op::Scale(_) => n.saturating_mul(2),
        Op::Swiglu => n.saturating_mul(6),
        Op::RmsNorm(_) => count(inputs[0]).saturating_mul(3),
        Op::SumRows => count(inputs[0]),
        Op::Softmax(_) => count(inputs[0]).saturating_mul(5),
        Op::Argmax => count(inputs[0]),
        // About 10 a logit: the max, the exp of the weight, the compares and sums of the draw.
        Op::Sample => count(inputs[0]).saturating_mul(10),
        Op::AddRmsNormMul(_)
        | Op::RmsNormMul(_)
        | Op::RmsNormMulRope(_)
        | Op::GatedRmsNorm(_)
        | Op::GatedDeltaNetFused(_)
        | Op::SoftmaxTopK { .. }
        | Op::MoeWeights
        | Op::MoeRouter { .. }
        | Op::MulMatSwiglu
        | Op::MulMatIdSwiglu
        | Op::MulMatIdWeightedSum => fused::flops(op, inputs, out),
        Op::Elementwise(p) => elemfuse::flops(p, out),
        // Data movement does no arithmetic; views returned above.
        Op::GetRows
        | Op::SetRows
        | Op::Cpy
        | Op::Cast(_)
        | Op::Cont
        | Op::Concat { .. }
        | Op::Repeat { .. }
        | Op::View(_)
        | Op::Reshape { .. }
        | Op::Permute { .. }
        | Op::Transpose
        | Op::Bitcast(_) => 0,
    };
    match op {
        // Only the gathered rows of the source are read.
        Op::GetRows => bytes = size(inputs[1]).saturating_add(size(out).saturating_mul(2)),
        // Only the written rows of the destination are touched.
        Op::SetRows => bytes = size(inputs[1]).saturating_mul(2).saturating_add(size(inputs[2])),
        Op::Cpy => bytes = size(inputs[0]).saturating_add(size(inputs[1])),
        // Only the routed experts' weights are read.
        Op::MulMatId => bytes = matmul::mul_mat_id_bytes(inputs, out),
        // The routed experts' weights, the activations, the ids, the router weights, the output.
        Op::MulMatIdWeightedSum => {
            bytes = matmul::mul_mat_id_bytes(&inputs[..3], out).saturating_add(size(inputs[3]));
        }
        // Both weights' routed experts, the activations, the ids and the output once.
        Op::MulMatIdSwiglu => {
            let (wg, wu, x, ids) = (inputs[0], inputs[1], inputs[2], inputs[3]);
            bytes = matmul::mul_mat_id_bytes(&[wg, x, ids], out)
                .saturating_add(matmul::mul_mat_id_bytes(&[wu, x, ids], out))
                .saturating_sub(size(x).saturating_add(size(ids)).saturating_add(size(out)));
        }
        // K/V are read once per kv head; a paged cache is read only where the table points.
        Op::FlashAttnExt(p) => bytes = attention::bytes(p, inputs, out),
        // The conv/recurrent state of the named slots is read and written, not all slots.
        Op::SsmConvUpdate { .. } => bytes = conv::update_bytes(inputs, out),
        Op::GatedDeltaNet(_) => bytes = delta_net::bytes(inputs, out),
        Op::GatedDeltaNetFused(_) => bytes = fused::delta_net_fused_bytes(inputs, out),
        // Every input read once and the output written once (the default above).
        Op::Cast(_)
        | Op::Cont
        | Op::Concat { .. }
        | Op::Repeat { .. }
        | Op::View(_)
        | Op::Reshape { .. }
        | Op::Permute { .. }
        | Op::Transpose
        | Op::Bitcast(_)
        | Op::Unary(_)
        | Op::Binary(_)
        | Op::Scale(_)
        | Op::Swiglu
        | Op::RmsNorm(_)
        | Op::L2Norm { .. }
        | Op::SumRows
        | Op::Softmax(_)
        | Op::Argmax
        | Op::TopK { .. }
        | Op::Argsort(_)
        | Op::MulMat
        | Op::Quantize(_)
        | Op::Dequantize
        | Op::RopeMulti(_)
        | Op::SsmConv
        | Op::Sample
        | Op::AddRmsNormMul(_)
        | Op::RmsNormMul(_)
        | Op::RmsNormMulRope(_)
        | Op::GatedRmsNorm(_)
        | Op::SoftmaxTopK { .. }
        | Op::MoeWeights
        | Op::MoeRouter { .. }
        | Op::MulMatSwiglu
        | Op::Elementwise(_) => {}
    }
    Cost { flops, bytes }
}

// ---- helpers shared by the family files ----

pub(crate) fn expect_arity(op: &Op, inputs: &[&TensorMeta], n: usize) -> Result<(), OpError> {
    if inputs.len() != n {
        return Err(OpError::Arity { op: op.name(), expected: ARITY_NAMES[n.min(4)], got: inputs.len() });
    }
    Ok(())
}

const ARITY_NAMES: [&str; 5] = ["0", "1", "2", "3", "4"];

/// Arity for ops with optional trailing inputs: `n` the counts accepted, `expected` them in
/// words ("1 or 2").
pub(crate) fn expect_arity_in(
    op: &Op,
    inputs: &[&TensorMeta],
    n: std::ops::RangeInclusive<usize>,
    expected: &'static str,
) -> Result<(), OpError> {
    if !n.contains(&inputs.len()) {
        return Err(OpError::Arity { op: op.name(), expected, got: inputs.len() });
    }
    Ok(())
}

/// A plain float type. Block-quantized tensors are refused too: they are weights, read only by the
/// ops that take them explicitly (get_rows, mul_mat, mul_mat_id, dequantize).
pub(crate) fn expect_float(op: &Op, input: usize, m: &TensorMeta) -> Result<(), OpError> {
    if !m.dtype.is_float() || m.dtype.is_quantized() {
        return Err(OpError::DType { op: op.name(), input, dtype: m.dtype, expected: "a float type (f32, f16, bf16)" });
    }
    Ok(())
}

pub(crate) fn expect_dtype(
    op: &Op,
    input: usize,
    m: &TensorMeta,
    want: DType,
    expected: &'static str,
) -> Result<(), OpError> {
    if m.dtype != want {
        return Err(OpError::DType { op: op.name(), input, dtype: m.dtype, expected });
    }
    Ok(())
}

/// Block-quantized tensors are weights: only ops that read them by rows accept them.
pub(crate) fn expect_not_quantized(op: &Op, input: usize, m: &TensorMeta) -> Result<(), OpError> {
    if m.dtype.is_quantized() {
        return Err(OpError::DType { op: op.name(), input, dtype: m.dtype, expected: "a non-quantized type" });
    }
    Ok(())
}

pub(crate) fn contiguous(op: &Op, dtype: DType, ne: [usize; 4]) -> Result<TensorMeta, OpError> {
    TensorMeta::contiguous(op.name(), dtype, ne)
}

/// ggml's repeat rule: `small` can be tiled to `big` when each dimension divides.
pub(crate) fn can_repeat(small: &[usize; 4], big: &[usize; 4]) -> bool {
    small.iter().zip(big).all(|(s, b)| b % s == 0)
}

#[cfg(test)]
mod tests {
    use crate::{
        BinaryOp, DType, DeltaNetAlgo, ElemArg, ElemInstr, ElemProgram, Family, FlashAttnParams,
        GatedDeltaNetFusedParams, GatedDeltaNetParams, HeadMap, Op, RmsNormMulRopeParams, RmsNormParams, RopePairing,
        RopeParams, ScaleParams, SoftmaxParams, SortOrder, UnaryOp, ViewParams,
    };

    /// One op of every variant.
    fn every_variant() -> Vec<Op> {
        let norm = RmsNormParams { eps: 1e-6 };
        let rope = RopeParams { n_rot: 4, freq_base: 1e4, pairing: RopePairing::Neox, sections: None };
        let attn = FlashAttnParams { scale: 1.0, softcap: 0.0, mask: false, paged: false, ragged: false, gate: false };
        let dn =
            GatedDeltaNetParams { scale: 1.0, head_map: HeadMap::Tiled, algo: DeltaNetAlgo::Serial, ragged: false };
        let program = ElemProgram::new(2, vec![ElemInstr::Binary(BinaryOp::Add, ElemArg::Input(0), ElemArg::Input(1))]);
        vec![
            Op::GetRows,
            Op::SetRows,
            Op::Cpy,
            Op::Cast(DType::F16),
            Op::Cont,
            Op::Concat { dim: 0 },
            Op::Repeat { ne: [1; 4] },
            Op::View(ViewParams { ne: [1; 4], nb: [4; 4], offset: 0 }),
            Op::Reshape { ne: [1; 4] },
            Op::Permute { axes: [0, 1, 2, 3] },
            Op::Transpose,
            Op::Bitcast(DType::I32),
            Op::Unary(UnaryOp::Exp),
            Op::Binary(BinaryOp::Add),
            Op::Scale(ScaleParams { scale: 2.0, bias: 0.0 }),
            Op::Swiglu,
            Op::RmsNorm(norm),
            Op::SumRows,
            Op::Softmax(SoftmaxParams { scale: 1.0 }),
            Op::Argmax,
            Op::L2Norm { eps: 1e-6 },
            Op::TopK { k: 1 },
            Op::Argsort(SortOrder::Ascending),
            Op::Quantize(DType::Q8_0),
            Op::Dequantize,
            Op::RopeMulti(rope),
            Op::FlashAttnExt(attn),
            Op::SsmConv,
            Op::SsmConvUpdate { silu: true, ragged: false },
            Op::GatedDeltaNet(dn),
            Op::GatedDeltaNetFused(GatedDeltaNetFusedParams { net: dn, eps: 1e-6 }),
            Op::MulMatId,
            Op::MulMat,
            Op::Sample,
            Op::AddRmsNormMul(norm),
            Op::RmsNormMul(norm),
            Op::RmsNormMulRope(RmsNormMulRopeParams { norm, rope }),
            Op::GatedRmsNorm(norm),
            Op::SoftmaxTopK { k: 1 },
            Op::MoeWeights,
            Op::MoeRouter { k: 1 },
            Op::MulMatSwiglu,
            Op::MulMatIdSwiglu,
            Op::MulMatIdWeightedSum,
            Op::Elementwise(program.unwrap()),
        ]
    }

    /// The source of each family's shape rules.
    fn rules_source(f: Family) -> &'static str {
        match f {
            Family::Data => include_str!("data.rs"),
            Family::View => include_str!("view.rs"),
            Family::Elementwise => include_str!("elementwise.rs"),
            Family::Reduce => include_str!("reduce.rs"),
            Family::Matmul => include_str!("matmul.rs"),
            Family::Quant => include_str!("quant.rs"),
            Family::Rope => include_str!("rope.rs"),
            Family::Attention => include_str!("attention.rs"),
            Family::Conv => include_str!("conv.rs"),
            Family::DeltaNet => include_str!("delta_net.rs"),
            Family::Sample => include_str!("sample.rs"),
            Family::Fused => include_str!("fused.rs"),
            Family::ElemFuse => include_str!("elemfuse.rs"),
        }
    }

    /// Whether `src` names `Op::<variant>` (not `UnaryOp::..`, not a longer variant name).
    fn mentions(src: &str, variant: &str) -> bool {
        let word = |c: char| c.is_alphanumeric() || c == '_';
        let pat = format!("Op::{variant}");
        src.match_indices(&pat).any(|(at, _)| !src[..at].ends_with(word) && !src[at + pat.len()..].starts_with(word))
    }

    #[test]
    fn each_op_has_its_shape_rules_in_its_familys_file_only() {
        for op in every_variant() {
            let debug = format!("{op:?}");
            let variant: String = debug.chars().take_while(|c| c.is_alphanumeric()).collect();
            for f in Family::ALL {
                let expected = f == op.family();
                assert_eq!(
                    mentions(rules_source(f), &variant),
                    expected,
                    "Op::{variant} (family {:?}) in rules/{}.rs",
                    op.family(),
                    f.name()
                );
            }
        }
    }

    #[test]
    fn family_of_representative_ops() {
        assert_eq!(Op::GetRows.family(), Family::Data);
        assert_eq!(Op::Transpose.family(), Family::View);
        assert_eq!(Op::Binary(BinaryOp::Mul).family(), Family::Elementwise);
        assert_eq!(Op::RmsNorm(RmsNormParams { eps: 1e-6 }).family(), Family::Reduce);
        assert_eq!(Op::MulMatId.family(), Family::Matmul);
        assert_eq!(Op::SsmConvUpdate { silu: false, ragged: true }.family(), Family::Conv);
        assert_eq!(Op::MulMatIdWeightedSum.family(), Family::Fused);
        // Every family has an op and a distinct name.
        let ops = every_variant();
        for f in Family::ALL {
            assert!(ops.iter().any(|op| op.family() == f), "no op of {f:?}");
            assert_eq!(Family::ALL.iter().filter(|g| g.name() == f.name()).count(), 1);
        }
    }
}
