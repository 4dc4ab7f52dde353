//! Block-quantized data: quantize / dequantize round trips and get_rows from q8_0 / nvfp4
//! embedding tables (2048 and 5120 are the Qwen3.6 n_embd).
//!
//! Quantized inputs are made by `host::encode` (which quantizes the drawn f32 values); the judge
//! reads the same bytes, so the comparison is of the computation, not of the quantization error,
//! and the f32 bound applies. A quantized output (quantize) is compared by its dequantized values;
//! the CPU and the reference both write `tessera_ops::quant`'s bytes, so they agree exactly (the
//! byte equality itself is asserted by backend-cpu/tests/quant.rs).

use tessera_ops::DType;

use super::{F32, I32, sh};
use crate::case::{Case, Init, InputSpec as In, Layout};

pub(crate) const Q8_0: DType = DType::Q8_0;
pub(crate) const NVFP4: DType = DType::NvFp4;
/// Both block-quantized dtypes.
pub(crate) const QUANTS: [DType; 2] = [Q8_0, NVFP4];

/// A window of whole blocks: 64 extra values per row (a multiple of both block sizes) and an
/// extra row, starting one block and one row in.
pub(crate) const BLOCK_WINDOW: Layout = Layout::Window { pad: [64, 1, 0, 0], at: [64, 1, 0, 0] };

/// Row shapes for quantize / dequantize: small, odd row counts, batched, model widths.
const SHAPES: [[usize; 4]; 6] =
    [[64, 1, 1, 1], [128, 3, 1, 1], [192, 5, 2, 1], [256, 7, 3, 2], [2048, 4, 1, 1], [5120, 2, 1, 1]];

pub(crate) fn cases(out: &mut Vec<Case>) {
    for to in QUANTS {
        for ne in SHAPES {
            out.push(quantize(to, ne, Layout::Contiguous, Init::SIGNED));
            out.push(dequantize(to, ne, Layout::Contiguous));
        }
        // Wide-range values (scales far from 1) and non-contiguous inputs with dense rows.
        out.push(quantize(to, [256, 6, 1, 1], Layout::Contiguous, Init::Uniform { lo: -300.0, hi: 300.0 }));
        out.push(quantize(to, [128, 5, 3, 1], Layout::SWAP12, Init::SIGNED));
        out.push(quantize(to, [128, 5, 1, 1], BLOCK_WINDOW, Init::SIGNED));
        out.push(dequantize(to, [128, 5, 3, 1], Layout::SWAP12));
        out.push(dequantize(to, [128, 5, 1, 1], BLOCK_WINDOW));
        for ne in [[64, 3, 1, 1], [2048, 2, 1, 1], [5120, 1, 1, 1]] {
            out.push(round_trip(to, ne));
        }
    }
    get_rows(out);
}

fn quantize(to: DType, ne: [usize; 4], layout: Layout, init: Init) -> Case {
    let range = match init {
        Init::Uniform { lo, hi } if (lo, hi) != (-1.0, 1.0) => format!(",range=[{lo},{hi}]"),
        _ => String::new(),
    };
    Case::new(
        "quantize",
        format_args!("type={to},ne={}{range}", sh(ne)),
        vec![In::new("x", F32, ne).layout(layout).init(init)],
        move |g, x| g.quantize(x[0], to),
    )
}

fn dequantize(from: DType, ne: [usize; 4], layout: Layout) -> Case {
    Case::new(
        "dequantize",
        format_args!("type={from},ne={}", sh(ne)),
        vec![In::new("x", from, ne).layout(layout)],
        |g, x| g.dequantize(x[0]),
    )
}

/// `dequantize(quantize(x))`: both nodes are compared.
fn round_trip(to: DType, ne: [usize; 4]) -> Case {
    Case::new(
        "quantize",
        format_args!("round_trip,type={to},ne={}", sh(ne)),
        vec![In::new("x", F32, ne)],
        move |g, x| {
            let q = g.quantize(x[0], to)?;
            g.dequantize(q)
        },
    )
}

/// get_rows from quantized tables: `(ne0, rows, ids per batch, ne2, ne3)`.
fn get_rows(out: &mut Vec<Case>) {
    let shapes = [(64, 5, 3, 1, 1), (128, 16, 7, 3, 2), (192, 9, 4, 2, 1), (2048, 64, 4, 1, 1), (5120, 32, 2, 1, 1)];
    for dtype in QUANTS {
        for (ne0, rows, n, ne2, ne3) in shapes {
            out.push(get_rows_case(dtype, [ne0, rows, ne2, ne3], n, Layout::Contiguous));
        }
        out.push(get_rows_case(dtype, [128, 9, 1, 1], 4, BLOCK_WINDOW));
        out.push(get_rows_case(dtype, [128, 9, 3, 1], 4, Layout::SWAP12));
    }
}

fn get_rows_case(dtype: DType, src: [usize; 4], n: usize, layout: Layout) -> Case {
    Case::new(
        "get_rows",
        format_args!("type={dtype},ne={},n={n}", sh(src)),
        vec![
            In::new("src", dtype, src).layout(layout),
            In::new("ids", I32, [n, src[2], src[3], 1]).init(Init::Ids { rows: src[1], unique: false }),
        ],
        |g, x| g.get_rows(x[0], x[1]),
    )
}
