//! quantize (f32 -> q8_0 / nvfp4, byte-exact with `tessera_ops::quant`) and dequantize
//! (`kernels/quant.cu`).

use tessera_graph::{BackendError, Task};
use tessera_ops::{DType, Op, TensorMeta};

use crate::compile::{Kernel, Module};
use crate::launch::{Cx, TensorArg, blocks_for, config, dt, unsupported};

const QUANTIZE_Q8_0: Kernel = Kernel::new(Module::Quant, "quantize_q8_0");
const QUANTIZE_NVFP4: Kernel = Kernel::new(Module::Quant, "quantize_nvfp4");
const DEQUANTIZE: Kernel = Kernel::new(Module::Quant, "dequantize");

const THREADS: u32 = 256;

/// The shape rules restrict quantize to f32 rows and dequantize to q8_0 / nvfp4 rows, all dense;
/// both dtypes have kernels.
pub(crate) fn supports(op: &Op, _inputs: &[TensorMeta]) -> bool {
    matches!(op, Op::Quantize(DType::Q8_0 | DType::NvFp4) | Op::Dequantize)
}

#[allow(dead_code)]
pub(crate) fn scratch_bytes(_task: &Task<'_>) -> usize {
    0
}

pub(crate) fn run(cx: &mut Cx<'_>, task: &Task<'_>, ins: &[TensorArg], out: TensorArg) -> Result<(), BackendError> {
    let src = ins[0];
    match task.op {
        Op::Quantize(DType::Q8_0) => {
            // One warp per block of 32 values.
            let blocks = out.nelements() / 32;
            let mut a = cx.kernel(QUANTIZE_Q8_0)?;
            a.arg(&out).arg(&src);
            // SAFETY: `quantize_q8_0(dst, src)`: src is f32 with dense rows and dst contiguous
            // q8_0 of the same shape, ne0 a multiple of 32 (shape rules); lane j of a warp reads
            // value j of its block, whole warps per thread block.
            unsafe { a.launch(config((blocks_for(blocks * 32, THREADS).min(1 << 20), 1, 1), (THREADS, 1, 1), 0)) }
        }
        Op::Quantize(DType::NvFp4) => {
            // One thread per 16-value sub-block.
            let subs = out.nelements() / 16;
            let mut a = cx.kernel(QUANTIZE_NVFP4)?;
            a.arg(&out).arg(&src);
            // SAFETY: `quantize_nvfp4(dst, src)`: src is f32 with dense rows and dst contiguous
            // nvfp4 of the same shape, ne0 a multiple of 64 (shape rules); each thread reads the
            // 16 values of its sub-block and writes its scale byte and 8 code bytes.
            unsafe { a.launch(config((blocks_for(subs, THREADS), 1, 1), (THREADS, 1, 1), 0)) }
        }
        Op::Dequantize => {
            let code = dt(task.inputs[0].meta.dtype);
            let mut a = cx.kernel(DEQUANTIZE)?;
            a.arg(&out).arg(&src).arg(&code);
            // SAFETY: `dequantize(dst, src, dt)`: src has dense rows of whole q8_0 / nvfp4 blocks
            // and dst is f32 of the same shape (shape rules).
            unsafe { a.launch(config((blocks_for(out.nelements(), THREADS), 1, 1), (THREADS, 1, 1), 0)) }
        }
        _ => Err(unsupported(task, "not a quantize / dequantize op")),
    }
}

#[cfg(test)]
mod tests {
    //! Byte equality with `tessera_ops::quant` on hard inputs (test-ops compares quantized outputs
    //! by their values). Skips without a GPU.

    use tessera_graph::{Graph, Session};
    use tessera_ops::{DType, quant};

    use crate::CudaBackend;

    /// Values that hit every rounding rule: exact q8_0 ties, E2M1 midpoints, UE4M3 subnormal and
    /// overflow scales, NaN, infinities, zeros and f32 subnormals, then random blocks over a wide
    /// range of magnitudes.
    fn hard_values() -> Vec<f32> {
        let mut v: Vec<f32> = Vec::new();
        // q8_0 ties: amax 127 * s, values (k + 0.5) * s.
        for e in [-20, -3, 0, 5] {
            let s = 2f32.powi(e);
            v.push(127.0 * s);
            v.extend((0..63).map(|k| (k as f32 - 31.5) * s));
        }
        // E2M1 midpoints at power-of-two scales (d = 1 when amax = 6).
        for e in [-8, 0, 4] {
            let s = 2f32.powi(e);
            for sub in 0..4 {
                v.push(6.0 * s);
                let mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, 0.0];
                v.extend(mids.iter().map(|m| m * s * (1.0 + sub as f32 * 1e-7)));
            }
        }
        // Sub-block amax / 6 around UE4M3's subnormal range, 256 and 448.
        for amax6 in [
            1e-4f32,
            0.0009765625,
            0.00146,
            0.0029296875,
            0.0136,
            0.015625,
            0.0155,
            240.0,
            255.9,
            256.0,
            300.0,
            448.0,
            500.0,
            1e6,
        ] {
            v.push(amax6 * 6.0);
            v.extend((1..16).map(|k| amax6 * (k as f32 * 0.37 - 2.9)));
        }
        // NaN, infinities, zeros, f32 subnormals.
        for special in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0, 1e-40, -3e-39] {
            v.push(special);
            v.extend((1..64).map(|k| if special.is_finite() { special * k as f32 } else { k as f32 * 0.1 }));
        }
        // Random blocks, magnitudes 2^-30 .. 2^30.
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for _ in 0..64 {
            let scale = 2f32.powi((next() % 61) as i32 - 30);
            for _ in 0..64 {
                v.push(((next() >> 11) as f32 / (1u64 << 53) as f32 * 2.0 - 1.0) * scale);
            }
        }
        v.resize(v.len().next_multiple_of(64), 0.5);
        v
    }

    #[test]
    fn quantize_is_byte_exact_with_the_reference() {
        let mut cuda = match CudaBackend::new() {
            Ok(b) => b,
            Err(e) => return eprintln!("skipping: {e}"),
        };
        let xs = hard_values();
        for to in [DType::Q8_0, DType::NvFp4] {
            let mut g = Graph::new();
            let x = g.input("x", DType::F32, [xs.len(), 1, 1, 1]).expect("input");
            let q = g.quantize(x, to).expect("quantize");
            g.mark_output(q).expect("output");
            let mut s = Session::new(&g, &mut cuda).expect("session");
            s.set_f32(x, &xs).expect("set");
            s.run().expect("run");
            let got = s.get(q).expect("get");
            let mut want = vec![0u8; got.len()];
            match to {
                DType::Q8_0 => quant::quantize_q8_0(&xs, &mut want),
                _ => quant::quantize_nvfp4(&xs, &mut want),
            }
            .expect("reference");
            let bb = to.block_bytes();
            for (b, (g, w)) in got.chunks(bb).zip(want.chunks(bb)).enumerate() {
                assert_eq!(g, w, "{to} block {b}: values {:?}", &xs[b * to.block_size()..(b + 1) * to.block_size()]);
            }
        }
    }
}
