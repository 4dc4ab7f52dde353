//! Reference quantize and dequantize.
//!
//! Both are the identity on logical values: the caller gathers a quantized input as its
//! dequantized values (`host::gather_f64`), and stores a quantized output by quantizing whole
//! blocks (`host::scatter_f64`, which calls `crate::quant`'s quantizers on the f32 values). So the
//! reference's quantized bytes are exactly `crate::quant`'s.

use super::RefTensor;
use crate::{Op, TensorMeta};

pub(super) fn compute(op: &Op, inputs: &[RefTensor], out: &TensorMeta) -> RefTensor {
    match op {
        Op::Quantize(_) | Op::Dequantize => RefTensor::new(out.ne, inputs[0].data.clone()),
        _ => unreachable!("reference quant::compute called for {op}"),
    }
}

#[cfg(test)]
mod tests {
    use crate::reference::{RefTensor, compute};
    use crate::{DType, Op, TensorMeta, host, infer, quant};

    #[test]
    fn quantize_then_store_gives_the_quantizer_bytes() {
        let vals: Vec<f32> = (0..128).map(|i| ((i * 37) % 29) as f32 / 7.0 - 2.0).collect();
        let x = TensorMeta::contiguous("t", DType::F32, [64, 2, 1, 1]).unwrap();
        let xs = RefTensor::new(x.ne, vals.iter().map(|&v| f64::from(v)).collect());
        for dt in [DType::Q8_0, DType::NvFp4] {
            let out = infer(&Op::Quantize(dt), &[&x]).unwrap();
            let y = compute(&Op::Quantize(dt), std::slice::from_ref(&xs), &out).unwrap();
            let mut bytes = vec![0u8; out.nbytes_contiguous()];
            host::scatter_f64(&y.data, &mut bytes, 0, &out);
            let mut want = vec![0u8; bytes.len()];
            match dt {
                DType::Q8_0 => quant::quantize_q8_0(&vals, &mut want).unwrap(),
                _ => quant::quantize_nvfp4(&vals, &mut want).unwrap(),
            }
            assert_eq!(bytes, want, "{dt}");
            // dequantize reads the stored values back unchanged
            let back = RefTensor::new(out.ne, host::gather_f64(&bytes, 0, &out));
            let d = infer(&Op::Dequantize, &[&out]).unwrap();
            let z = compute(&Op::Dequantize, std::slice::from_ref(&back), &d).unwrap();
            assert_eq!(z.data, back.data);
        }
    }
}
