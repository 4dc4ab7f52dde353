//! Data movement: get_rows, set_rows, cpy, cast, cont, concat, repeat.

use super::{BF16, F16, F32, FLOATS, I32, sh};
use crate::case::{Case, Init, InputSpec as In, Layout};

pub(super) fn cases(out: &mut Vec<Case>) {
    get_rows(out);
    set_rows(out);
    cpy(out);
    cast(out);
    cont(out);
    concat(out);
    repeat(out);
}

/// `(ne0, source rows, ids per batch, ne2, ne3)`; 2048 and 5120 are embedding rows.
const GET_ROWS_SHAPES: [(usize, usize, usize, usize, usize); 6] =
    [(1, 1, 1, 1, 1), (7, 5, 3, 1, 1), (33, 10, 5, 2, 1), (128, 16, 7, 3, 2), (2048, 64, 4, 1, 1), (5120, 32, 2, 1, 1)];

fn get_rows(out: &mut Vec<Case>) {
    for dtype in [F32, F16, BF16, I32] {
        for (ne0, rows, n, ne2, ne3) in GET_ROWS_SHAPES {
            out.push(get_rows_case(dtype, [ne0, rows, ne2, ne3], n, Layout::Contiguous));
        }
    }
    // Rows must be dense, but the table may be a window or have its outer dims permuted.
    for (dtype, layout) in [(F32, Layout::WINDOW), (F16, Layout::WINDOW), (F32, Layout::SWAP12)] {
        out.push(get_rows_case(dtype, [33, 9, 3, 1], 4, layout));
    }
}

fn get_rows_case(dtype: tessera_ops::DType, src: [usize; 4], n: usize, layout: Layout) -> Case {
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

fn set_rows(out: &mut Vec<Case>) {
    // `(ne0, destination rows, rows written, ne2, ne3)`: the last two are KV-cache like.
    let shapes = [(1, 1, 1, 1, 1), (7, 10, 3, 1, 1), (67, 16, 5, 2, 1), (128, 32, 4, 4, 1), (256, 8, 8, 2, 1)];
    for dst in FLOATS {
        for (ne0, rows, n, ne2, ne3) in shapes {
            out.push(set_rows_case(dst, F32, [ne0, rows, ne2, ne3], n, [Layout::Contiguous; 2]));
        }
    }
    out.push(set_rows_case(F32, F16, [64, 12, 2, 1], 5, [Layout::Contiguous; 2]));
    out.push(set_rows_case(F16, BF16, [64, 12, 2, 1], 5, [Layout::Contiguous; 2]));
    // A window of a larger cache as destination; a permuted projection as source.
    out.push(set_rows_case(F16, F32, [128, 16, 2, 1], 6, [Layout::WINDOW, Layout::Contiguous]));
    out.push(set_rows_case(F16, F32, [128, 16, 4, 1], 3, [Layout::Contiguous, Layout::SWAP12]));
    out.push(set_rows_case(F32, F32, [33, 7, 3, 1], 7, [Layout::WINDOW, Layout::TRANSPOSED]));
}

fn set_rows_case(
    dst_type: tessera_ops::DType,
    src_type: tessera_ops::DType,
    dst: [usize; 4],
    n: usize,
    layouts: [Layout; 2],
) -> Case {
    Case::new(
        "set_rows",
        format_args!("type_dst={dst_type},type_src={src_type},ne_dst={},n={n}", sh(dst)),
        vec![
            In::new("dst", dst_type, dst).layout(layouts[0]),
            In::new("src", src_type, [dst[0], n, dst[2], dst[3]]).layout(layouts[1]),
            In::new("ids", I32, [n, dst[2], dst[3], 1]).init(Init::Ids { rows: dst[1], unique: true }),
        ],
        |g, x| g.set_rows(x[0], x[1], x[2]),
    )
}

fn cpy(out: &mut Vec<Case>) {
    use Layout::Contiguous as C;
    for src in FLOATS {
        for dst in FLOATS {
            out.push(cpy_case(src, dst, [33, 5, 2, 1], [33, 5, 2, 1], [C, C]));
        }
    }
    for (src, dst) in [(F32, F16), (F32, BF16), (F16, F32)] {
        out.push(cpy_case(src, dst, [5120, 3, 1, 1], [5120, 3, 1, 1], [C, C]));
    }
    out.push(cpy_case(I32, I32, [7, 3, 2, 1], [7, 3, 2, 1], [C, C]));
    // Different shapes with the same element count: logical order is kept.
    out.push(cpy_case(F32, F32, [12, 5, 1, 1], [6, 10, 1, 1], [C, C]));
    out.push(cpy_case(F32, F16, [7, 5, 3, 1], [105, 1, 1, 1], [C, C]));
    // Strided source or destination (the V cache is written through a transposed view).
    for (src, dst) in [(F32, F32), (F32, F16)] {
        out.push(cpy_case(src, dst, [7, 33, 1, 1], [7, 33, 1, 1], [Layout::TRANSPOSED, C]));
        out.push(cpy_case(src, dst, [67, 5, 1, 1], [67, 5, 1, 1], [C, Layout::TRANSPOSED]));
    }
    out.push(cpy_case(F32, BF16, [33, 4, 3, 1], [33, 4, 3, 1], [Layout::WINDOW, Layout::WINDOW]));
    out.push(cpy_case(F16, F32, [16, 4, 6, 1], [16, 4, 6, 1], [Layout::SWAP12, Layout::Contiguous]));
}

fn cpy_case(
    src_type: tessera_ops::DType,
    dst_type: tessera_ops::DType,
    src: [usize; 4],
    dst: [usize; 4],
    layouts: [Layout; 2],
) -> Case {
    Case::new(
        "cpy",
        format_args!("type_src={src_type},type_dst={dst_type},ne_src={},ne_dst={}", sh(src), sh(dst)),
        vec![In::new("src", src_type, src).layout(layouts[0]), In::new("dst", dst_type, dst).layout(layouts[1])],
        |g, x| g.cpy(x[0], x[1]),
    )
}

fn cast(out: &mut Vec<Case>) {
    for ne in [[7, 3, 1, 1], [67, 5, 3, 1]] {
        for from in FLOATS {
            for to in FLOATS {
                out.push(cast_case(from, to, ne, Layout::Contiguous));
            }
        }
    }
    out.push(cast_case(I32, I32, [7, 3, 1, 1], Layout::Contiguous));
    out.push(cast_case(F32, F16, [33, 5, 2, 1], Layout::TRANSPOSED));
    out.push(cast_case(BF16, F32, [33, 5, 2, 1], Layout::WINDOW));
}

fn cast_case(from: tessera_ops::DType, to: tessera_ops::DType, ne: [usize; 4], layout: Layout) -> Case {
    Case::new(
        "cast",
        format_args!("type_src={from},type_dst={to},ne={}", sh(ne)),
        vec![In::new("x", from, ne).layout(layout)],
        move |g, x| g.cast(x[0], to),
    )
}

fn cont(out: &mut Vec<Case>) {
    let perms = [[1, 0, 2, 3], [0, 2, 1, 3], [2, 0, 1, 3], [3, 2, 1, 0]];
    for dtype in [F32, F16, BF16, I32] {
        for axes in perms {
            out.push(cont_case(dtype, [7, 5, 3, 2], Layout::Permuted(axes)));
        }
    }
    out.push(cont_case(F32, [7, 5, 3, 2], Layout::Contiguous));
    out.push(cont_case(F32, [33, 4, 3, 1], Layout::WINDOW));
    out.push(cont_case(F16, [67, 3, 2, 1], Layout::WINDOW));
    // Merging attention heads: [head_dim, n_tokens, n_head] -> [head_dim, n_head, n_tokens].
    out.push(cont_case(F32, [128, 16, 8, 1], Layout::SWAP12));
    out.push(cont_case(F32, [256, 4, 16, 1], Layout::SWAP12));
}

fn cont_case(dtype: tessera_ops::DType, ne: [usize; 4], layout: Layout) -> Case {
    Case::new(
        "cont",
        format_args!("type={dtype},ne={}", sh(ne)),
        vec![In::new("x", dtype, ne).layout(layout)],
        |g, x| g.cont(x[0]),
    )
}

fn concat(out: &mut Vec<Case>) {
    use Layout::Contiguous as C;
    for dtype in [F32, F16] {
        for dim in 0..4 {
            out.push(concat_case(dtype, [7, 5, 3, 2], dim, 4, [C, C]));
        }
    }
    out.push(concat_case(I32, [7, 5, 3, 1], 1, 2, [C, C]));
    out.push(concat_case(BF16, [33, 3, 2, 1], 0, 31, [C, C]));
    // Appending new K rows to a cache: [head_dim, n_kv, n_head].
    out.push(concat_case(F32, [128, 9, 4, 1], 1, 3, [C, C]));
    out.push(concat_case(F32, [7, 5, 3, 2], 0, 4, [Layout::SWAP12, Layout::WINDOW]));
    out.push(concat_case(F32, [7, 5, 3, 2], 1, 2, [Layout::WINDOW, Layout::TRANSPOSED]));
    out.push(concat_case(F16, [33, 5, 3, 1], 2, 1, [Layout::TRANSPOSED, C]));
}

/// `a` of shape `ne` and `b` equal but `extra` long in `dim`.
fn concat_case(dtype: tessera_ops::DType, ne: [usize; 4], dim: usize, extra: usize, layouts: [Layout; 2]) -> Case {
    let mut ne_b = ne;
    ne_b[dim] = extra;
    Case::new(
        "concat",
        format_args!("type={dtype},ne_a={},ne_b={},dim={dim}", sh(ne), sh(ne_b)),
        vec![In::new("a", dtype, ne).layout(layouts[0]), In::new("b", dtype, ne_b).layout(layouts[1])],
        move |g, x| g.concat(x[0], x[1], dim),
    )
}

fn repeat(out: &mut Vec<Case>) {
    let pairs = [
        ([1, 1, 1, 1], [7, 3, 2, 1]),
        ([7, 1, 1, 1], [14, 3, 1, 1]),
        ([7, 3, 1, 1], [7, 6, 4, 1]),
        ([33, 5, 2, 1], [66, 5, 4, 3]),
        ([128, 1, 2, 1], [128, 8, 4, 1]),
    ];
    for dtype in [F32, F16] {
        for (src, to) in pairs {
            out.push(repeat_case(dtype, src, to, Layout::Contiguous));
        }
    }
    out.push(repeat_case(I32, [3, 2, 1, 1], [6, 4, 3, 1], Layout::Contiguous));
    out.push(repeat_case(BF16, [5, 2, 1, 1], [5, 4, 2, 1], Layout::Contiguous));
    out.push(repeat_case(F32, [7, 3, 2, 1], [14, 6, 2, 2], Layout::TRANSPOSED));
    out.push(repeat_case(F32, [7, 3, 2, 1], [7, 9, 4, 1], Layout::WINDOW));
}

fn repeat_case(dtype: tessera_ops::DType, src: [usize; 4], to: [usize; 4], layout: Layout) -> Case {
    Case::new(
        "repeat",
        format_args!("type={dtype},ne={},to={}", sh(src), sh(to)),
        vec![In::new("x", dtype, src).layout(layout)],
        move |g, x| g.repeat(x[0], &to),
    )
}
