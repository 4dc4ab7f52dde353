//! Shape rules and costs of the ops around block-quantized weights: which ops take q8_0 / nvfp4
//! inputs (get_rows, mul_mat and mul_mat_id weights, dequantize), which refuse them (everything
//! elementwise or reducing), what quantize accepts, and the routed-expert byte count of mul_mat_id.

use tessera_ops::reference::{RefTensor, compute};
use tessera_ops::{BinaryOp, DType, Op, OpError, RmsNormParams, ScaleParams, SoftmaxParams, TensorMeta, UnaryOp};
use tessera_ops::{cost, host, infer, quant};

const QUANTS: [DType; 2] = [DType::Q8_0, DType::NvFp4];

fn meta(dtype: DType, ne: [usize; 4]) -> TensorMeta {
    TensorMeta::contiguous("test", dtype, ne).unwrap()
}

#[test]
fn elementwise_and_reducing_ops_refuse_quantized_inputs() {
    for dt in QUANTS {
        let q = meta(dt, [64, 4, 1, 1]);
        let f = meta(DType::F32, [64, 4, 1, 1]);
        let one: [(Op, Vec<&TensorMeta>); 10] = [
            (Op::Unary(UnaryOp::Silu), vec![&q]),
            (Op::Unary(UnaryOp::Exp), vec![&q]),
            (Op::Binary(BinaryOp::Add), vec![&q, &f]),
            (Op::Binary(BinaryOp::Mul), vec![&f, &q]),
            (Op::Scale(ScaleParams { scale: 2.0, bias: 0.0 }), vec![&q]),
            (Op::Swiglu, vec![&q]),
            (Op::RmsNorm(RmsNormParams { eps: 1e-6 }), vec![&q]),
            (Op::Softmax(SoftmaxParams { scale: 1.0 }), vec![&q]),
            (Op::SumRows, vec![&q]),
            (Op::Cont, vec![&q]),
        ];
        for (op, inputs) in one {
            let e = infer(&op, &inputs).unwrap_err();
            match e {
                OpError::DType { dtype, .. } => assert_eq!(dtype, dt, "{op}"),
                other => panic!("{op} on {dt}: expected a dtype error, got {other}"),
            }
            assert!(e.to_string().starts_with(op.name()), "the error names the op: {e}");
        }
        assert!(infer(&Op::Cast(DType::F32), &[&q]).is_err());
        assert!(infer(&Op::Cpy, &[&f, &q]).is_err(), "cpy into a quantized tensor");
        assert!(infer(&Op::Concat { dim: 1 }, &[&q, &q]).is_err());
    }
}

#[test]
fn row_readers_take_quantized_inputs() {
    for dt in QUANTS {
        let table = meta(dt, [128, 10, 1, 1]);
        let ids = meta(DType::I32, [3, 1, 1, 1]);
        let y = infer(&Op::GetRows, &[&table, &ids]).unwrap();
        assert_eq!((y.dtype, y.ne), (DType::F32, [128, 3, 1, 1]));
        let x = meta(DType::F32, [128, 2, 1, 1]);
        assert_eq!(infer(&Op::MulMat, &[&table, &x]).unwrap().ne, [10, 2, 1, 1]);
        let experts = meta(dt, [128, 10, 4, 1]);
        let ids = meta(DType::I32, [2, 2, 1, 1]);
        let b = meta(DType::F32, [128, 1, 2, 1]);
        assert_eq!(infer(&Op::MulMatId, &[&experts, &b, &ids]).unwrap().ne, [10, 2, 2, 1]);
        assert_eq!(infer(&Op::Dequantize, &[&table]).unwrap(), meta(DType::F32, [128, 10, 1, 1]));
    }
}

#[test]
fn quantize_needs_an_f32_input_of_whole_blocks_and_a_quantized_target() {
    let x = meta(DType::F32, [2048, 3, 1, 1]);
    for dt in QUANTS {
        let q = infer(&Op::Quantize(dt), &[&x]).unwrap();
        assert_eq!(q, meta(dt, [2048, 3, 1, 1]));
        assert_eq!(cost(&Op::Quantize(dt), &[&x], &q).bytes, (2048 * 3 * 4 + q.nbytes_contiguous()) as u64);
    }
    let e = infer(&Op::Quantize(DType::NvFp4), &[&meta(DType::F32, [32, 1, 1, 1])]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "quantize: invalid shape [32, 1, 1, 1]: ne[0] must be a multiple of nvfp4's block size 64"
    );
    let e = infer(&Op::Quantize(DType::BF16), &[&x]).unwrap_err();
    assert!(matches!(e, OpError::InvalidParam { op: "quantize", .. }), "{e}");
    let e = infer(&Op::Quantize(DType::Q8_0), &[&meta(DType::F16, [64, 1, 1, 1])]).unwrap_err();
    assert!(matches!(e, OpError::DType { op: "quantize", input: 0, dtype: DType::F16, .. }), "{e}");
    // a transposed input has strided rows
    let t = TensorMeta { ne: [64, 64, 1, 1], nb: [256, 4, 16384, 16384], dtype: DType::F32 };
    assert!(matches!(infer(&Op::Quantize(DType::Q8_0), &[&t]), Err(OpError::NotContiguous { .. })));
}

#[test]
fn mul_mat_id_bytes_count_only_routed_experts() {
    // The Qwen3.6 MoE shape: 256 experts of 512 x 2048 nvfp4, top-8, one decoded token.
    let w = meta(DType::NvFp4, [2048, 512, 256, 1]);
    let b = meta(DType::F32, [2048, 1, 1, 1]);
    let ids = meta(DType::I32, [8, 1, 1, 1]);
    let out = infer(&Op::MulMatId, &[&w, &b, &ids]).unwrap();
    let c = cost(&Op::MulMatId, &[&w, &b, &ids], &out);
    let expert = (2048 / 64 * 36 * 512) as u64;
    assert_eq!(c.bytes, 8 * expert + 2048 * 4 + 8 * 4 + 512 * 8 * 4);
    assert!(c.bytes < w.nbytes_contiguous() as u64 / 20, "far less than all 256 experts");
    assert_eq!(c.flops, 2 * 2048 * 512 * 8);
}

#[test]
fn reference_quantize_stores_the_quantizer_bytes() {
    let vals: Vec<f32> = (0..5120 * 2).map(|i| ((i * 7919) % 2003) as f32 / 100.0 - 10.0).collect();
    let x = meta(DType::F32, [5120, 2, 1, 1]);
    let input = RefTensor::new(x.ne, vals.iter().map(|&v| f64::from(v)).collect());
    for dt in QUANTS {
        let out = infer(&Op::Quantize(dt), &[&x]).unwrap();
        let y = compute(&Op::Quantize(dt), std::slice::from_ref(&input), &out).unwrap();
        let mut got = vec![0u8; out.nbytes_contiguous()];
        host::scatter_f64(&y.data, &mut got, 0, &out);
        let mut want = vec![0u8; got.len()];
        match dt {
            DType::Q8_0 => quant::quantize_q8_0(&vals, &mut want).unwrap(),
            _ => quant::quantize_nvfp4(&vals, &mut want).unwrap(),
        }
        assert!(got == want, "{dt}");
    }
}
