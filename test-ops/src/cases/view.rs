//! Views as ops: view, reshape, permute, transpose and bitcast, each followed by an op that reads the view
//! (`cont`, or an elementwise op), since a view alone computes nothing. Views as *inputs* of other
//! ops are covered everywhere through [`crate::Layout`].

use tessera_graph::{Graph, GraphError, Tensor};
use tessera_ops::DType;

use super::{BF16, F16, F32, I32, sh};
use crate::case::{Case, InputSpec as In};

pub(super) fn cases(out: &mut Vec<Case>) {
    permute(out);
    transpose(out);
    reshape(out);
    view(out);
    bitcast(out);
}

fn permute(out: &mut Vec<Case>) {
    let perms = [[1, 0, 2, 3], [0, 2, 1, 3], [2, 1, 0, 3], [1, 2, 3, 0], [3, 0, 1, 2]];
    for dtype in [F32, F16] {
        for axes in perms {
            out.push(permute_case(dtype, [7, 5, 3, 2], axes));
        }
    }
    out.push(permute_case(BF16, [33, 4, 3, 1], [0, 2, 1, 3]));
    out.push(permute_case(I32, [5, 4, 3, 2], [2, 3, 0, 1]));
    // Splitting heads: [head_dim, n_head, n_tokens] -> [head_dim, n_tokens, n_head].
    out.push(permute_case(F32, [128, 8, 6, 1], [0, 2, 1, 3]));
}

fn permute_case(dtype: DType, ne: [usize; 4], axes: [usize; 4]) -> Case {
    Case::new(
        "permute",
        format_args!("type={dtype},ne={},axes={}", sh(ne), sh(axes)),
        vec![In::new("x", dtype, ne)],
        move |g, x| {
            let p = g.permute(x[0], axes)?;
            g.cont(p)
        },
    )
}

fn transpose(out: &mut Vec<Case>) {
    for dtype in [F32, BF16] {
        for ne in [[7, 5, 1, 1], [33, 67, 2, 1], [128, 16, 4, 1]] {
            out.push(Case::new(
                "transpose",
                format_args!("type={dtype},ne={}", sh(ne)),
                vec![In::new("x", dtype, ne)],
                |g, x| {
                    let t = g.transpose(x[0])?;
                    g.cont(t)
                },
            ));
        }
    }
    // A transposed matrix read directly by an elementwise op.
    out.push(Case::new(
        "transpose",
        "type=f32,ne=[33,7,2,1],then=silu",
        vec![In::new("x", F32, [33, 7, 2, 1])],
        |g, x| {
            let t = g.transpose(x[0])?;
            g.silu(t)
        },
    ));
}

fn reshape(out: &mut Vec<Case>) {
    let pairs: [([usize; 4], [usize; 4]); 3] =
        [([12, 5, 2, 1], [60, 2, 1, 1]), ([7, 3, 1, 1], [1, 21, 1, 1]), ([5120, 2, 1, 1], [128, 40, 2, 1])];
    for (ne, to) in pairs {
        out.push(Case::new(
            "reshape",
            format_args!("type=f32,ne={},to={}", sh(ne), sh(to)),
            vec![In::new("x", F32, ne)],
            move |g, x| {
                let r = g.reshape(x[0], &to)?;
                g.cont(r)
            },
        ));
    }
    // Split heads then bring tokens inward: reshape -> permute -> cont (a Q projection).
    for (dtype, head_dim) in [(F32, 128), (F16, 256)] {
        out.push(Case::new(
            "reshape",
            format_args!("type={dtype},ne=[{},3,1,1],to=[{head_dim},4,3,1],then=permute(0,2,1,3)", 4 * head_dim),
            vec![In::new("x", dtype, [4 * head_dim, 3, 1, 1])],
            move |g, x| {
                let r = g.reshape(x[0], &[head_dim, 4, 3])?;
                let p = g.permute(r, [0, 2, 1, 3])?;
                g.cont(p)
            },
        ));
    }
    // Reshape of a computed (contiguous) result.
    out.push(Case::new(
        "reshape",
        "type=f32,ne=[6,4,1,1],after=neg,to=[3,8,1,1],then=exp",
        vec![In::new("x", F32, [6, 4, 1, 1])],
        |g, x| {
            let n = g.neg(x[0])?;
            let r = g.reshape(n, &[3, 8])?;
            g.exp(r)
        },
    ));
}

/// A window of `x`: shape `ne`, `x`'s strides, starting at element `at`.
fn window(g: &mut Graph, x: Tensor, ne: [usize; 4], at: [usize; 4]) -> Result<Tensor, GraphError> {
    let m = *x.meta();
    g.view(x, ne, m.nb, m.offset_of(at))
}

fn view(out: &mut Vec<Case>) {
    // The second half of each row of a fused projection (the up part of gate+up, or the gate of
    // a q+gate projection), and a block of rows.
    for (dtype, ne0, rows) in [(F32, 14, 3), (F16, 256, 5), (F32, 1024, 2)] {
        let half = ne0 / 2;
        out.push(Case::new(
            "view",
            format_args!("type={dtype},ne=[{ne0},{rows},1,1],window=[{half},{rows},1,1],at=[{half},0,0,0]"),
            vec![In::new("x", dtype, [ne0, rows, 1, 1])],
            move |g, x| {
                let v = window(g, x[0], [half, rows, 1, 1], [half, 0, 0, 0])?;
                g.cont(v)
            },
        ));
    }
    out.push(Case::new(
        "view",
        "type=f32,ne=[33,9,4,1],window=[33,3,2,1],at=[0,5,1,0]",
        vec![In::new("x", F32, [33, 9, 4, 1])],
        |g, x| {
            let v = window(g, x[0], [33, 3, 2, 1], [0, 5, 1, 0])?;
            g.cont(v)
        },
    ));
    // Reinterpreting strides: every other row of a matrix, as a new matrix.
    out.push(Case::new(
        "view",
        "type=f32,ne=[7,10,1,1],every_other_row",
        vec![In::new("x", F32, [7, 10, 1, 1])],
        |g, x| {
            let m = *x[0].meta();
            let v = g.view(x[0], [7, 5, 1, 1], [m.nb[0], 2 * m.nb[1], 10 * m.nb[1], 10 * m.nb[1]], 0)?;
            g.cont(v)
        },
    ));
    // A window read directly by elementwise ops, and a view of a view.
    out.push(Case::new(
        "view",
        "type=f32,ne=[67,5,1,1],window=[60,4,1,1],at=[7,1,0,0],then=mul",
        vec![In::new("x", F32, [67, 5, 1, 1]), In::new("y", F32, [60, 1, 1, 1])],
        |g, x| {
            let v = window(g, x[0], [60, 4, 1, 1], [7, 1, 0, 0])?;
            g.mul(v, x[1])
        },
    ));
    out.push(Case::new(
        "view",
        "type=f16,ne=[33,8,2,1],view_of_view,then=sigmoid",
        vec![In::new("x", F16, [33, 8, 2, 1])],
        |g, x| {
            let v = window(g, x[0], [30, 6, 2, 1], [3, 2, 0, 0])?;
            let w = window(g, v, [20, 3, 1, 1], [5, 1, 1, 0])?;
            g.sigmoid(w)
        },
    ));
}

fn bitcast(out: &mut Vec<Case>) {
    // f32 bits as i32 (compared exactly), f16 bits as bf16, each copied out.
    for (from, to, ne) in [(F32, I32, [9, 4, 1, 1]), (F16, BF16, [64, 3, 2, 1])] {
        out.push(Case::new(
            "bitcast",
            format_args!("type={from},to={to},ne={}", sh(ne)),
            vec![In::new("x", from, ne)],
            move |g, x| {
                let b = g.bitcast(x[0], to)?;
                g.cont(b)
            },
        ));
    }
    // A round trip through i32 of a strided window, read by an elementwise op: the plane of a
    // packed output read in place (moe_router's weights).
    out.push(Case::new(
        "bitcast",
        "type=f32,ne=[33,6,2,1],window=[30,4,2,1],at=[3,1,0,0],to=i32,then=bitcast(f32),silu",
        vec![In::new("x", F32, [33, 6, 2, 1])],
        |g, x| {
            let v = window(g, x[0], [30, 4, 2, 1], [3, 1, 0, 0])?;
            let i = g.bitcast(v, DType::I32)?;
            let f = g.bitcast(i, DType::F32)?;
            g.silu(f)
        },
    ));
}
