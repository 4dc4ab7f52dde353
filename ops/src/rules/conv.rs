//! ssm_conv, ssm_conv_update_inplace: the causal depthwise convolution of the gated-DeltaNet
//! (and Mamba) layers.
//!
//! - `ssm_conv [sx, kernel]`: `sx [d_conv - 1 + n_t, channels, n_seq, 1]` (time innermost, any
//!   float type, any strides) and `kernel [d_conv, channels, 1, 1]` (any float type, any strides)
//!   give a contiguous f32 `[channels, n_t, n_seq, 1]`.
//! - `ssm_conv_update_inplace [x, state, kernel, slots]`: `x [channels, n_t, n_seq, 1]` (any float
//!   type, any strides), `state [d_conv - 1, channels, n_slots, 1]` f32 and contiguous (it is
//!   updated in place, slot by slot), `kernel [d_conv, channels, 1, 1]` (any float type, any
//!   strides), `slots` i32 `[n_seq, 1, 1, 1]` (any strides) give a contiguous f32
//!   `[channels, n_t, n_seq, 1]`. Slot values (in range, distinct) are checked at run time.
//!   Ragged (`ragged: true`): `x [channels, n_tokens, 1, 1]` packs every sequence's tokens and a
//!   fifth input `seq_offsets` i32 `[n_seq + 1]` says which are whose (`slots` `[n_seq]`; more
//!   sequences than slots is allowed, as empty sequences touch no slot); output
//!   `[channels, n_tokens, 1, 1]`.

use super::{contiguous, expect_arity, expect_dtype, expect_float, expect_not_quantized};
use crate::{DType, Op, OpError, TensorMeta};

pub(super) fn infer(op: &Op, inputs: &[&TensorMeta]) -> Result<TensorMeta, OpError> {
    match op {
        Op::SsmConv => infer_conv(op, inputs),
        Op::SsmConvUpdate { .. } => infer_update(op, inputs),
        _ => unreachable!("conv::infer called for {op}"),
    }
}

fn infer_conv(op: &Op, inputs: &[&TensorMeta]) -> Result<TensorMeta, OpError> {
    let name = op.name();
    expect_arity(op, inputs, 2)?;
    let (sx, kernel) = (inputs[0], inputs[1]);
    for (i, m) in [sx, kernel].into_iter().enumerate() {
        expect_float(op, i, m)?;
        expect_not_quantized(op, i, m)?;
    }
    if sx.ne[3] != 1 {
        let why = "sx must be [d_conv - 1 + n_t, channels, n_seq, 1] (ne[3] = 1)".into();
        return Err(OpError::InvalidShape { op: name, shape: sx.ne, why });
    }
    check_kernel(name, kernel)?;
    let d_conv = kernel.ne[0];
    if kernel.ne[1] != sx.ne[1] {
        let why = format!("kernel has {} channels (ne[1]), sx has {} (ne[1])", kernel.ne[1], sx.ne[1]);
        return Err(OpError::ShapeMismatch { op: name, lhs: sx.ne, rhs: kernel.ne, why });
    }
    if sx.ne[0] < d_conv {
        let why = format!("sx has {} time steps (ne[0]), fewer than d_conv = {d_conv} (kernel ne[0])", sx.ne[0]);
        return Err(OpError::ShapeMismatch { op: name, lhs: sx.ne, rhs: kernel.ne, why });
    }
    let n_t = sx.ne[0] - (d_conv - 1);
    contiguous(op, DType::F32, [sx.ne[1], n_t, sx.ne[2], 1])
}

fn infer_update(op: &Op, inputs: &[&TensorMeta]) -> Result<TensorMeta, OpError> {
    let name = op.name();
    let ragged = matches!(op, Op::SsmConvUpdate { ragged: true, .. });
    let (n_in, expected) =
        if ragged { (5, "5 (x, state, kernel, slots, seq_offsets)") } else { (4, "4 (x, state, kernel, slots)") };
    if inputs.len() != n_in {
        return Err(OpError::Arity { op: name, expected, got: inputs.len() });
    }
    let (x, state, kernel, slots) = (inputs[0], inputs[1], inputs[2], inputs[3]);
    for (i, m) in [(0, x), (2, kernel)] {
        expect_float(op, i, m)?;
        expect_not_quantized(op, i, m)?;
    }
    expect_dtype(op, 1, state, DType::F32, "f32 conv state")?;
    expect_dtype(op, 3, slots, DType::I32, "i32 slot ids")?;
    if ragged {
        expect_dtype(op, 4, inputs[4], DType::I32, "i32 seq_offsets")?;
    }
    if x.ne[3] != 1 || (ragged && x.ne[2] != 1) {
        let why = if ragged {
            "ragged x packs every sequence's tokens: [channels, n_tokens, 1, 1]".into()
        } else {
            "x must be [channels, n_t, n_seq, 1] (ne[3] = 1)".into()
        };
        return Err(OpError::InvalidShape { op: name, shape: x.ne, why });
    }
    if state.ne[3] != 1 {
        let why = "state must be [d_conv - 1, channels, n_slots, 1] (ne[3] = 1)".into();
        return Err(OpError::InvalidShape { op: name, shape: state.ne, why });
    }
    if !state.is_contiguous() {
        return Err(OpError::NotContiguous { op: name, input: 1, shape: state.ne, nb: state.nb });
    }
    check_kernel(name, kernel)?;
    let (channels, n_seq) = (x.ne[0], x.ne[2]);
    if kernel.ne[1] != channels {
        let why = format!("kernel has {} channels (ne[1]), x has {channels} (ne[0])", kernel.ne[1]);
        return Err(OpError::ShapeMismatch { op: name, lhs: x.ne, rhs: kernel.ne, why });
    }
    if state.ne[1] != channels {
        let why = format!("state has {} channels (ne[1]), x has {channels} (ne[0])", state.ne[1]);
        return Err(OpError::ShapeMismatch { op: name, lhs: x.ne, rhs: state.ne, why });
    }
    if state.ne[0] + 1 != kernel.ne[0] {
        let why = format!(
            "state keeps {} time steps (ne[0]), but a kernel of d_conv = {} (ne[0]) needs d_conv - 1",
            state.ne[0], kernel.ne[0]
        );
        return Err(OpError::ShapeMismatch { op: name, lhs: state.ne, rhs: kernel.ne, why });
    }
    if ragged {
        let n = slots.ne[0];
        if slots.ne != [n, 1, 1, 1] {
            let why = "slots must be [n_seq, 1, 1, 1]".into();
            return Err(OpError::ShapeMismatch { op: name, lhs: x.ne, rhs: slots.ne, why });
        }
        let offsets = inputs[4];
        if offsets.ne != [n + 1, 1, 1, 1] {
            let why = format!("seq_offsets must be [n_seq + 1, 1, 1, 1] = [{}, 1, 1, 1] ({n} slots)", n + 1);
            return Err(OpError::ShapeMismatch { op: name, lhs: slots.ne, rhs: offsets.ne, why });
        }
        return contiguous(op, DType::F32, [channels, x.ne[1], 1, 1]);
    }
    if slots.ne != [n_seq, 1, 1, 1] {
        let why = format!("slots must be [n_seq] = [{n_seq}, 1, 1, 1], one per sequence of x (ne[2])");
        return Err(OpError::ShapeMismatch { op: name, lhs: x.ne, rhs: slots.ne, why });
    }
    if n_seq > state.ne[2] {
        let why = format!("{n_seq} sequences need distinct slots, but state has only {} (ne[2])", state.ne[2]);
        return Err(OpError::ShapeMismatch { op: name, lhs: x.ne, rhs: state.ne, why });
    }
    contiguous(op, DType::F32, [channels, x.ne[1], n_seq, 1])
}

/// The kernel is a `[d_conv, channels]` matrix.
fn check_kernel(name: &'static str, kernel: &TensorMeta) -> Result<(), OpError> {
    if kernel.ne[2] != 1 || kernel.ne[3] != 1 {
        let why = "kernel must be [d_conv, channels, 1, 1]".into();
        return Err(OpError::InvalidShape { op: name, shape: kernel.ne, why });
    }
    Ok(())
}

/// `2 * d_conv` per output element (one multiply-add per tap). The optional SiLU of the update
/// op is not counted (a few flops per output, negligible next to the taps).
pub(super) fn flops(inputs: &[&TensorMeta], out: &TensorMeta) -> u64 {
    // ssm_conv: kernel is input 1; ssm_conv_update_inplace: input 2.
    let kernel = if inputs.len() == 2 { inputs[1] } else { inputs[2] };
    (out.nelements() as u64).saturating_mul(2).saturating_mul(kernel.ne[0] as u64)
}

/// ssm_conv_update_inplace: `x`, `kernel`, `slots` (and `seq_offsets`) and the output once each,
/// plus the state of the `n_seq` named slots read and written (the other slots are not touched;
/// ragged: every sequence counted as if it had tokens).
pub(super) fn update_bytes(inputs: &[&TensorMeta], out: &TensorMeta) -> u64 {
    let size = |m: &TensorMeta| m.nbytes_contiguous() as u64;
    let (x, state, kernel, slots) = (inputs[0], inputs[1], inputs[2], inputs[3]);
    let per_slot = size(state) / state.ne[2].max(1) as u64;
    let touched = per_slot.saturating_mul(slots.ne[0] as u64).saturating_mul(2);
    let offsets = inputs.get(4).map_or(0, |m| size(m));
    [size(x), size(kernel), size(slots), offsets, size(out), touched].into_iter().fold(0u64, u64::saturating_add)
}

#[cfg(test)]
mod tests {
    use crate::{DType, Op, OpError, TensorMeta, cost, infer};

    fn meta(dtype: DType, ne: [usize; 4]) -> TensorMeta {
        TensorMeta::contiguous("t", dtype, ne).unwrap()
    }

    const UPDATE: Op = Op::SsmConvUpdate { silu: true, ragged: false };
    const RAGGED: Op = Op::SsmConvUpdate { silu: false, ragged: true };

    #[test]
    fn ssm_conv_output_is_channels_by_tokens() {
        let sx = meta(DType::F32, [3 + 5, 64, 2, 1]);
        let k = meta(DType::F32, [4, 64, 1, 1]);
        let out = infer(&Op::SsmConv, &[&sx, &k]).unwrap();
        assert_eq!((out.dtype, out.ne), (DType::F32, [64, 5, 2, 1]));
        assert!(out.is_contiguous());
        let c = cost(&Op::SsmConv, &[&sx, &k], &out);
        assert_eq!(c.flops, 64 * 5 * 2 * 2 * 4);
        // A transposed, half-precision sx is fine.
        let mut t = meta(DType::F16, [8, 64, 1, 1]);
        t.nb = [128, 2, 1024, 1024];
        assert!(infer(&Op::SsmConv, &[&t, &k]).is_ok());
    }

    #[test]
    fn ssm_conv_shape_errors() {
        let k = meta(DType::F32, [4, 64, 1, 1]);
        let too_short = meta(DType::F32, [3, 64, 1, 1]);
        assert!(matches!(infer(&Op::SsmConv, &[&too_short, &k]), Err(OpError::ShapeMismatch { .. })));
        let channels = meta(DType::F32, [8, 63, 1, 1]);
        assert!(matches!(infer(&Op::SsmConv, &[&channels, &k]), Err(OpError::ShapeMismatch { .. })));
        let ids = meta(DType::I32, [8, 64, 1, 1]);
        assert!(matches!(infer(&Op::SsmConv, &[&ids, &k]), Err(OpError::DType { input: 0, .. })));
        let k3 = meta(DType::F32, [4, 64, 2, 1]);
        assert!(matches!(
            infer(&Op::SsmConv, &[&meta(DType::F32, [8, 64, 1, 1]), &k3]),
            Err(OpError::InvalidShape { .. })
        ));
        assert!(matches!(infer(&Op::SsmConv, &[&k]), Err(OpError::Arity { .. })));
    }

    fn update_inputs() -> [TensorMeta; 4] {
        [
            meta(DType::BF16, [128, 3, 2, 1]),
            meta(DType::F32, [3, 128, 6, 1]),
            meta(DType::F32, [4, 128, 1, 1]),
            meta(DType::I32, [2, 1, 1, 1]),
        ]
    }

    fn infer_update(m: &[TensorMeta; 4]) -> Result<TensorMeta, OpError> {
        infer(&UPDATE, &[&m[0], &m[1], &m[2], &m[3]])
    }

    #[test]
    fn update_output_and_cost() {
        let m = update_inputs();
        let out = infer_update(&m).unwrap();
        assert_eq!((out.dtype, out.ne), (DType::F32, [128, 3, 2, 1]));
        let c = cost(&UPDATE, &[&m[0], &m[1], &m[2], &m[3]], &out);
        assert_eq!(c.flops, 128 * 3 * 2 * 2 * 4);
        // x (bf16) + kernel + slots + out + 2 slots of state read and written.
        let state_slot = 3 * 128 * 4;
        assert_eq!(c.bytes, (128 * 3 * 2 * 2 + 4 * 128 * 4 + 2 * 4 + 128 * 3 * 2 * 4 + 2 * 2 * state_slot) as u64);
        // A transposed x is fine.
        let mut m = update_inputs();
        m[0].nb = [6, 2, 768, 1536];
        m[0].ne = [128, 3, 2, 1];
        assert!(infer_update(&m).is_ok());
    }

    #[test]
    fn update_errors_name_the_problem() {
        let with = |i: usize, t: TensorMeta| {
            let mut m = update_inputs();
            m[i] = t;
            infer_update(&m)
        };
        let e = with(3, meta(DType::F32, [2, 1, 1, 1])).unwrap_err();
        assert!(matches!(e, OpError::DType { input: 3, .. }), "{e}");
        let e = with(3, meta(DType::I32, [3, 1, 1, 1])).unwrap_err();
        assert!(e.to_string().contains("slots must be [n_seq]"), "{e}");
        let e = with(1, meta(DType::F16, [3, 128, 6, 1])).unwrap_err();
        assert!(matches!(e, OpError::DType { input: 1, .. }), "{e}");
        let e = with(1, meta(DType::F32, [3, 127, 6, 1])).unwrap_err();
        assert!(e.to_string().contains("state has 127 channels"), "{e}");
        let e = with(2, meta(DType::F32, [4, 64, 1, 1])).unwrap_err();
        assert!(e.to_string().contains("kernel has 64 channels"), "{e}");
        let e = with(1, meta(DType::F32, [2, 128, 6, 1])).unwrap_err();
        assert!(e.to_string().contains("d_conv - 1"), "{e}");
        let e = with(1, meta(DType::F32, [3, 128, 1, 1])).unwrap_err();
        assert!(e.to_string().contains("distinct slots"), "{e}");
        let mut strided = meta(DType::F32, [3, 128, 6, 1]);
        strided.nb = [4, 16, 16 * 128, 16 * 128 * 6];
        let e = with(1, strided).unwrap_err();
        assert!(matches!(e, OpError::NotContiguous { input: 1, .. }), "{e}");
        let m = update_inputs();
        let e = infer(&UPDATE, &[&m[0], &m[1], &m[2]]).unwrap_err();
        assert!(e.to_string().contains("expected 4"), "{e}");
    }

    #[test]
    fn ragged_update_packs_tokens_and_takes_offsets_last() {
        let x = meta(DType::F32, [128, 9, 1, 1]);
        let state = meta(DType::F32, [3, 128, 2, 1]);
        let k = meta(DType::F32, [4, 128, 1, 1]);
        let slots = meta(DType::I32, [3, 1, 1, 1]);
        let offsets = meta(DType::I32, [4, 1, 1, 1]);
        let out = infer(&RAGGED, &[&x, &state, &k, &slots, &offsets]).unwrap();
        assert_eq!((out.dtype, out.ne), (DType::F32, [128, 9, 1, 1]));
        let c = cost(&RAGGED, &[&x, &state, &k, &slots, &offsets], &out);
        // x + kernel + slots + offsets + out + 3 sequences' slots of state read and written
        // (3 sequences, 2 slots: sequences without tokens may share one).
        assert_eq!(c.bytes, (128 * 9 * 4 + 4 * 128 * 4 + 3 * 4 + 4 * 4 + 128 * 9 * 4 + 3 * 2 * 3 * 128 * 4) as u64);
        let e = infer(&RAGGED, &[&x, &state, &k, &slots]).unwrap_err();
        assert!(e.to_string().contains("expected 5"), "{e}");
        let e = infer(&UPDATE, &[&x, &state, &k, &slots, &offsets]).unwrap_err();
        assert!(e.to_string().contains("expected 4"), "{e}");
        let e = infer(&RAGGED, &[&x, &state, &k, &slots, &meta(DType::I32, [3, 1, 1, 1])]).unwrap_err();
        assert!(e.to_string().contains("seq_offsets must be [n_seq + 1"), "{e}");
        let e = infer(&RAGGED, &[&x, &state, &k, &slots, &meta(DType::F32, [4, 1, 1, 1])]).unwrap_err();
        assert!(matches!(e, OpError::DType { input: 4, .. }), "{e}");
        let e = infer(&RAGGED, &[&meta(DType::F32, [128, 3, 3, 1]), &state, &k, &slots, &offsets]).unwrap_err();
        assert!(e.to_string().contains("n_tokens, 1, 1"), "{e}");
    }
}
