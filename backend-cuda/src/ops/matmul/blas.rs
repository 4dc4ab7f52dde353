//! mul_mat with more than `GEMV_MAX_N` tokens where `mmq` does not take the weights: cuBLAS.
//! f32 weights go through `gemm_ex` in place; f16 / bf16 weights in place with the activations
//! converted to the weights' type; q8_0 / nvfp4 weights are dequantized in row chunks to bf16
//! (`dequant_rows`) and multiplied by hi + lo bf16 activations, so the result keeps f32-level
//! accuracy.

use cudarc::cublas::result as blas;
use tessera_graph::BackendError;
use tessera_ops::{DType, TensorMeta};

use super::align;
use super::pack::{dequant_rows, pack_b, packed_f32_bytes, packed_len};
use crate::launch::{Cx, GRID_YZ, TensorArg, dt, sys_blas};

/// Bytes of dequantized bf16 weights (hi + lo parts) one cuBLAS chunk may hold.
const WEIGHT_CHUNK_BYTES: usize = 64 << 20;

/// bf16 parts of a dequantized weight value: nvfp4 values are exact in bf16, q8_0 need hi + lo.
fn weight_parts(d: DType) -> usize {
    if d == DType::Q8_0 { 2 } else { 1 }
}

/// Rows of dequantized weights per cuBLAS chunk (at most the grid's y limit).
fn chunk_rows(k: usize, m: usize, parts: usize) -> usize {
    let rows = WEIGHT_CHUNK_BYTES / (packed_len(k) * 2 * parts).max(1);
    let rows = if rows > 128 { rows / 128 * 128 } else { rows.max(1) };
    rows.min(m).min(GRID_YZ as usize)
}

/// Scratch for the cuBLAS path: converted activations, then (quantized weights) one chunk of
/// dequantized weights.
pub(super) fn blas_scratch(a: &TensorMeta, b: &TensorMeta) -> usize {
    let (k, m) = (a.ne[0], a.ne[1]);
    let rows = b.nelements() / k.max(1);
    let half = align(rows * packed_len(k) * 2);
    match a.dtype {
        DType::F32 => packed_f32_bytes(b),
        DType::F16 | DType::BF16 => half,
        _ => {
            let parts = weight_parts(a.dtype);
            2 * half + parts * align(chunk_rows(k, m, parts) * packed_len(k) * 2)
        }
    }
}

/// cuBLAS takes the product when sizes fit its ints, the output is contiguous f32 columns, and
/// plain weights are element-aligned with element strides.
pub(super) fn blas_fits(a: &TensorArg, d: DType, b: &TensorArg, out: &TensorArg) -> bool {
    let small = |x: i64| x > 0 && x <= i32::MAX as i64;
    let es = d.block_bytes() as i64;
    let plain_ok = d.is_quantized()
        || (a.data.is_multiple_of(es as u64)
            && a.nb[1] % es == 0
            && small(a.nb[1] / es)
            && (1..4).all(|i| a.nb[i] % es == 0));
    small(a.ne[0]) && small(a.ne[1]) && small(b.ne[1]) && out.nb[0] == 4 && out.nb[1] == 4 * out.ne[0] && plain_ok
}

/// One `C = alpha A^T B + beta C` through `gemm_ex` (column-major: A is k x m with `lda`, B is
/// k x n with `ldb`, C is m x n f32 with `ldc`).
struct Gemm {
    m: i32,
    n: i32,
    k: i32,
    lda: i32,
    ldb: i32,
    ldc: i32,
    ty: sys_blas::cudaDataType,
}

impl Gemm {
    fn run(&self, h: sys_blas::cublasHandle_t, a: u64, b: u64, c: u64, beta: f32) -> Result<(), BackendError> {
        let alpha = 1.0f32;
        // SAFETY: a, b, c are device addresses of matrices of the sizes and leading dimensions
        // in `self` (checked by the caller); alpha and beta are host f32 read during the call.
        unsafe {
            blas::gemm_ex(
                h,
                sys_blas::cublasOperation_t::CUBLAS_OP_T,
                sys_blas::cublasOperation_t::CUBLAS_OP_N,
                self.m,
                self.n,
                self.k,
                (&alpha as *const f32).cast(),
                a as *const _,
                self.ty,
                self.lda,
                b as *const _,
                self.ty,
                self.ldb,
                (&beta as *const f32).cast(),
                c as *mut _,
                sys_blas::cudaDataType::CUDA_R_32F,
                self.ldc,
                sys_blas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys_blas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| BackendError::Device {
            backend: crate::errors::NAME.into(),
            detail: format!("cublasGemmEx: {e:?}"),
        })
    }
}

pub(super) fn mul_mat_blas(
    cx: &mut Cx<'_>,
    a: TensorArg,
    d: DType,
    b: TensorArg,
    out: TensorArg,
) -> Result<(), BackendError> {
    let h = cx.cublas()?;
    let (k, m, n) = (a.ne[0], a.ne[1], b.ne[1]);
    let (b2, b3) = (b.ne[2], b.ne[3]);
    let (r2, r3) = (b2 / a.ne[2].max(1), b3 / a.ne[3].max(1));
    let ldb = packed_len(k as usize) as i64;
    let rows = n * b2 * b3;
    let half = align(rows as usize * ldb as usize * 2) as u64;
    let es = d.block_bytes() as i64;
    let (ty, elem) = match d {
        DType::F32 => (sys_blas::cudaDataType::CUDA_R_32F, 4),
        DType::F16 => (sys_blas::cudaDataType::CUDA_R_16F, 2),
        _ => (sys_blas::cudaDataType::CUDA_R_16BF, 2),
    };
    let (bhi, blo) = (cx.scratch, cx.scratch + half);
    match d {
        DType::F32 => pack_b(cx, b, bhi, 0, 0, 0, ldb)?,
        DType::F16 | DType::BF16 => pack_b(cx, b, 0, bhi, 0, dt(d), ldb)?,
        _ => pack_b(cx, b, 0, bhi, blo, dt(DType::BF16), ldb)?,
    }
    let g = |mm: i64, lda: i64| Gemm {
        m: mm as i32,
        n: n as i32,
        k: k as i32,
        lda: lda as i32,
        ldb: ldb as i32,
        ldc: m as i32,
        ty,
    };
    for batch in 0..b2 * b3 {
        let (i2, i3) = (batch % b2, batch / b2);
        let a_off = (i2 / r2) * a.nb[2] + (i3 / r3) * a.nb[3];
        let b_at = |base: u64| base + (batch * n * ldb * elem) as u64;
        let c = out.data + (i2 * out.nb[2] + i3 * out.nb[3]) as u64;
        if !d.is_quantized() {
            g(m, a.nb[1] / es).run(h, a.data + a_off as u64, b_at(bhi), c, 0.0)?;
            continue;
        }
        let parts = weight_parts(d);
        let chunk = chunk_rows(k as usize, m as usize, parts) as i64;
        let whi = cx.scratch + 2 * half;
        let wlo = if parts == 2 { whi + align(chunk as usize * ldb as usize * 2) as u64 } else { 0 };
        let weights = TensorArg { data: a.data + a_off as u64, ..a };
        let mut m0 = 0;
        while m0 < m {
            let rows = chunk.min(m - m0);
            dequant_rows(cx, weights, d, m0, rows, whi, wlo, ldb)?;
            let gc = g(rows, ldb);
            let c0 = c + (m0 * 4) as u64;
            gc.run(h, whi, b_at(bhi), c0, 0.0)?;
            gc.run(h, whi, b_at(blo), c0, 1.0)?;
            if parts == 2 {
                gc.run(h, wlo, b_at(bhi), c0, 1.0)?;
            }
            m0 += rows;
        }
    }
    Ok(())
}
