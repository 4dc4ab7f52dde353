//! Property tests of shape inference through the graph builder: broadcasting, mul_mat, concat,
//! repeat and reshape shapes; permute/transpose round trips; contiguity of computed outputs; and
//! that every view (and every chain of views) stays injective and inside its source's memory.

use proptest::prelude::*;
use proptest::sample::select;
use tessera_graph::{Graph, GraphError, Tensor};
use tessera_ops::{BinaryOp, DType, Op, OpError, RmsNormParams, ScaleParams, SoftmaxParams, TensorMeta, UnaryOp};

const FLOATS: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

fn shape() -> impl Strategy<Value = [usize; 4]> {
    prop::array::uniform4(1usize..=6)
}

fn axes() -> impl Strategy<Value = [usize; 4]> {
    Just(vec![0usize, 1, 2, 3]).prop_shuffle().prop_map(|v| [v[0], v[1], v[2], v[3]])
}

/// A layout for [`laid_out`]: half the time the plain contiguous one.
fn layout() -> impl Strategy<Value = [usize; 4]> {
    prop_oneof![Just([0, 1, 2, 3]), axes()]
}

fn inverse(axes: [usize; 4]) -> [usize; 4] {
    let mut inv = [0; 4];
    for (i, &a) in axes.iter().enumerate() {
        inv[a] = i;
    }
    inv
}

fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|&d| n.is_multiple_of(d)).collect()
}

/// Per dimension: a divisor of `big[i]` when `pick[i].0` is even, else the free value `pick[i].1`.
fn mostly_divisors(big: [usize; 4], pick: [(u8, usize); 4]) -> [usize; 4] {
    let mut out = [0; 4];
    for i in 0..4 {
        let (choice, r) = pick[i];
        out[i] = if choice % 2 == 0 {
            let d = divisors(big[i]);
            d[r % d.len()]
        } else {
            r
        };
    }
    out
}

fn picks() -> impl Strategy<Value = [(u8, usize); 4]> {
    prop::array::uniform4((any::<u8>(), 1usize..=6))
}

/// A tensor of shape `ne` built as an input, then (when `axes` is not the identity) laid out as
/// a permutation of a contiguous tensor, so its strides are not in order.
fn laid_out(g: &mut Graph, dtype: DType, ne: [usize; 4], axes: [usize; 4]) -> Tensor {
    // Build the source so that permuting it by `axes` gives shape `ne`: src.ne[i] = ne[axes[i]].
    let src_ne = [ne[axes[0]], ne[axes[1]], ne[axes[2]], ne[axes[3]]];
    let x = g.input("x", dtype, src_ne).unwrap();
    let y = g.permute(x, axes).unwrap();
    assert_eq!(y.ne(), ne);
    y
}

fn assert_contiguous_output(t: &Tensor) {
    let m = t.meta();
    assert!(m.is_contiguous(), "{m:?}");
    assert_eq!(*m, TensorMeta::contiguous("t", m.dtype, m.ne).unwrap());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn binary_ok_iff_each_dim_divides(
        a_ne in shape(),
        pick in picks(),
        da in select(&FLOATS[..]),
        db in select(&FLOATS[..]),
        op in select(&BinaryOp::ALL[..]),
        a_axes in layout(),
        b_axes in layout(),
    ) {
        let b_ne = mostly_divisors(a_ne, pick);
        let mut g = Graph::new();
        let a = laid_out(&mut g, da, a_ne, a_axes);
        let b = laid_out(&mut g, db, b_ne, b_axes);
        let divides = (0..4).all(|i| a_ne[i] % b_ne[i] == 0);
        match g.binary(op, a, b) {
            Ok(y) => {
                prop_assert!(divides, "{a_ne:?} {b_ne:?}");
                prop_assert_eq!(y.ne(), a_ne);
                prop_assert_eq!(y.dtype(), da);
                assert_contiguous_output(&y);
            }
            Err(e) => {
                prop_assert!(!divides, "{a_ne:?} {b_ne:?}: {e}");
                let is_mismatch = matches!(
                    &e,
                    GraphError::Op(OpError::ShapeMismatch { op: name, lhs, rhs, .. })
                        if *name == op.name() && *lhs == a_ne && *rhs == b_ne
                );
                prop_assert!(is_mismatch, "{:?}", e);
            }
        }
    }

    #[test]
    fn mul_mat_output_shape(
        a_ne in shape(),
        (n, k_other, same_k) in (1usize..=6, 1usize..=6, any::<bool>()),
        pick in picks(),
        dw in select(&FLOATS[..]),
    ) {
        // b's batch dims are multiples of a's (or free), K equal or free
        let b2 = if pick[2].0 % 2 == 0 { a_ne[2] * (1 + pick[2].1 % 3) } else { pick[2].1 };
        let b3 = if pick[3].0 % 2 == 0 { a_ne[3] * (1 + pick[3].1 % 2) } else { pick[3].1 };
        let k = if same_k { a_ne[0] } else { k_other };
        let b_ne = [k, n, b2, b3];
        let mut g = Graph::new();
        let a = g.parameter("w", dw, a_ne).unwrap();
        let b = g.input("x", DType::F32, b_ne).unwrap();
        let ok = a_ne[0] == k && b2 % a_ne[2] == 0 && b3 % a_ne[3] == 0;
        match g.mul_mat(a, b) {
            Ok(y) => {
                prop_assert!(ok);
                prop_assert_eq!(y.ne(), [a_ne[1], n, b2, b3]);
                prop_assert_eq!(y.dtype(), DType::F32);
                assert_contiguous_output(&y);
            }
            Err(e) => {
                prop_assert!(!ok, "{e}");
                let is_mismatch =
                    matches!(&e, GraphError::Op(OpError::ShapeMismatch { op: "mul_mat", .. }));
                prop_assert!(is_mismatch, "{:?}", e);
            }
        }
    }

    #[test]
    fn concat_shape(
        a_ne in shape(),
        dim in 0usize..5,
        other in shape(),
        change in prop::array::uniform4(any::<bool>()),
        dt in select(&DType::PLAIN[..]),
        same_dtype in prop::bool::weighted(0.8),
    ) {
        let mut b_ne = a_ne;
        for i in 0..4 {
            // change the concat dim freely, another dim only rarely
            if (i == dim && change[i]) || (change[i] && change[(i + 1) % 4] && change[(i + 2) % 4]) {
                b_ne[i] = other[i];
            }
        }
        let db = if same_dtype { dt } else { DType::PLAIN[(DType::PLAIN.iter().position(|&d| d == dt).unwrap() + 1) % 4] };
        let mut g = Graph::new();
        let a = g.input("a", dt, a_ne).unwrap();
        let b = g.input("b", db, b_ne).unwrap();
        let ok = dim < 4 && dt == db && (0..4).all(|i| i == dim || a_ne[i] == b_ne[i]);
        match g.concat(a, b, dim) {
            Ok(y) => {
                prop_assert!(ok);
                let mut want = a_ne;
                want[dim] += b_ne[dim];
                prop_assert_eq!(y.ne(), want);
                prop_assert_eq!(y.dtype(), dt);
                assert_contiguous_output(&y);
            }
            Err(e) => prop_assert!(!ok, "{e}"),
        }
    }

    #[test]
    fn repeat_shape(src in shape(), mult in prop::array::uniform4(1usize..=3), free in shape(), use_free in any::<bool>()) {
        let target = if use_free { free } else { [src[0] * mult[0], src[1] * mult[1], src[2] * mult[2], src[3] * mult[3]] };
        let mut g = Graph::new();
        let x = g.input("x", DType::F16, src).unwrap();
        let ok = (0..4).all(|i| target[i] % src[i] == 0);
        match g.repeat(x, &target) {
            Ok(y) => {
                prop_assert!(ok);
                prop_assert_eq!(y.ne(), target);
                prop_assert_eq!(y.dtype(), DType::F16);
                assert_contiguous_output(&y);
            }
            Err(e) => {
                prop_assert!(!ok, "{e}");
                let is_mismatch = matches!(&e, GraphError::Op(OpError::ShapeMismatch { op: "repeat", .. }));
                prop_assert!(is_mismatch, "{:?}", e);
            }
        }
    }

    #[test]
    fn reshape_preserves_the_element_count(
        src in shape(),
        src_axes in layout(),
        shuffle in axes(),
        free in shape(),
        kind in 0u8..3,
        dt in select(&DType::PLAIN[..]),
    ) {
        let count: usize = src.iter().product();
        let target = match kind {
            0 => [src[shuffle[0]], src[shuffle[1]], src[shuffle[2]], src[shuffle[3]]],
            1 => [count, 1, 1, 1],
            _ => free,
        };
        let mut g = Graph::new();
        let x = laid_out(&mut g, dt, src, src_axes);
        let ok = x.meta().is_contiguous() && target.iter().product::<usize>() == count;
        match g.reshape(x, &target) {
            Ok(y) => {
                prop_assert!(ok);
                prop_assert_eq!(y.ne(), target);
                prop_assert_eq!(y.meta().nelements(), count);
                prop_assert_eq!(y.dtype(), dt);
                assert_contiguous_output(&y);
                prop_assert!(y.meta().span_bytes() <= x.meta().span_bytes());
            }
            Err(e) => {
                prop_assert!(!ok, "{e}");
                let expected_kind = if x.meta().is_contiguous() {
                    matches!(&e, GraphError::Op(OpError::ShapeMismatch { op: "reshape", .. }))
                } else {
                    matches!(&e, GraphError::Op(OpError::NotContiguous { op: "reshape", .. }))
                };
                prop_assert!(expected_kind, "{:?}", e);
            }
        }
    }

    #[test]
    fn permute_then_inverse_is_the_identity(ne in shape(), lay in layout(), p in axes(), dt in select(&DType::PLAIN[..])) {
        let mut g = Graph::new();
        let x = laid_out(&mut g, dt, ne, lay);
        let y = g.permute(x, p).unwrap();
        for (i, &pi) in p.iter().enumerate() {
            prop_assert_eq!(y.ne()[pi], x.ne()[i]);
            prop_assert_eq!(y.meta().nb[pi], x.meta().nb[i]);
        }
        // element j of y is element i of x with i[k] = j[p[k]]: same byte offset
        let j = [y.ne()[0] - 1, y.ne()[1] / 2, y.ne()[2] - 1, 0];
        let i = [j[p[0]], j[p[1]], j[p[2]], j[p[3]]];
        prop_assert_eq!(y.meta().offset_of(j), x.meta().offset_of(i));
        let z = g.permute(y, inverse(p)).unwrap();
        prop_assert_eq!(z.meta(), x.meta());
        prop_assert_eq!(y.meta().span_bytes(), x.meta().span_bytes());
    }

    #[test]
    fn transpose_twice_is_the_identity(ne in shape(), lay in layout(), dt in select(&DType::PLAIN[..])) {
        let mut g = Graph::new();
        let x = laid_out(&mut g, dt, ne, lay);
        let t = g.transpose(x).unwrap();
        prop_assert_eq!(t.ne(), [ne[1], ne[0], ne[2], ne[3]]);
        let tt = g.transpose(t).unwrap();
        prop_assert_eq!(tt.meta(), x.meta());
        // and transpose is permute [1, 0, 2, 3]
        let p = g.permute(x, [1, 0, 2, 3]).unwrap();
        prop_assert_eq!(p.meta(), t.meta());
    }

    #[test]
    fn computed_outputs_are_contiguous(
        base in shape(),
        pool_spec in prop::collection::vec((0u8..6, select(&DType::PLAIN[..]), layout()), 4..8),
        ops in prop::collection::vec((0u8..20, any::<u64>()), 1..12),
    ) {
        let mut g = Graph::new();
        let mut pool: Vec<Tensor> = Vec::new();
        for (variant, dt, lay) in pool_spec {
            // shapes related to `base` so multi-input ops succeed often
            let ne = match variant {
                0 => base,
                1 => [1, base[1], base[2], base[3]],
                2 => [base[0], 1, 1, 1],
                3 => [base[1], base[0], base[2], base[3]],
                4 => [base[0], base[1] * 2, base[2], base[3]],
                _ => [base[2], base[2], 1, base[3]],
            };
            pool.push(laid_out(&mut g, dt, ne, lay));
        }
        let (mut oks, mut tried) = (0, 0);
        for (which, r) in ops {
            let pick = |k: u64| pool[((r >> (8 * k)) as usize) % pool.len()];
            let op = match which {
                0 => Op::GetRows,
                1 => Op::SetRows,
                2 => Op::Cpy,
                3 => Op::Cast(DType::PLAIN[(r % 4) as usize]),
                4 => Op::Cont,
                5 => Op::Concat { dim: (r % 4) as usize },
                6 => Op::Repeat { ne: [base[0] * 2, base[1], base[2], base[3]] },
                7 | 8 => Op::Unary(UnaryOp::ALL[(r % 5) as usize]),
                9 | 10 => Op::Binary(BinaryOp::ALL[(r % 4) as usize]),
                11 => Op::Scale(ScaleParams { scale: 0.5, bias: 1.0 }),
                12 => Op::Swiglu,
                13 => Op::RmsNorm(RmsNormParams { eps: 1e-5 }),
                14 => Op::SumRows,
                15 | 16 => Op::Softmax(SoftmaxParams { scale: 1.0 }),
                17 => Op::Argmax,
                _ => Op::MulMat,
            };
            let n = match &op {
                Op::SetRows => 3,
                Op::Swiglu | Op::Softmax(_) => 1 + (r % 2) as usize,
                Op::GetRows | Op::Cpy | Op::Concat { .. } | Op::Binary(_) | Op::MulMat => 2,
                _ => 1,
            };
            let inputs: Vec<Tensor> = (0..n as u64).map(pick).collect();
            tried += 1;
            if let Ok(y) = g.op(op.clone(), &inputs) {
                oks += 1;
                prop_assert!(!op.is_view());
                match op.writes_input() {
                    Some(w) => prop_assert_eq!(y.meta(), inputs[w].meta(), "{} writes its input in place", op),
                    None => assert_contiguous_output(&y),
                }
                pool.push(y);
            }
        }
        prop_assert!(oks <= tried);
    }

    #[test]
    fn views_are_injective_and_inside_their_source(
        ne in shape(),
        lay in layout(),
        dt in select(&DType::PLAIN[..]),
        start in prop::array::uniform4(0usize..6),
        len in prop::array::uniform4(1usize..=6),
        step in prop::array::uniform4(1usize..=3),
        raw_nb in prop::array::uniform4(0usize..64),
        raw_offset in 0usize..128,
        windowed in any::<bool>(),
    ) {
        let mut g = Graph::new();
        let x = laid_out(&mut g, dt, ne, lay);
        let m = *x.meta();
        let eb = dt.block_bytes();
        let (vne, vnb, offset, must_work) = if windowed && m.nb[0] == eb {
            // a window on x's own layout: rows keep their stride, outer dims may skip by `step`
            let mut vne = [1; 4];
            let mut vnb = m.nb;
            let mut s = [0; 4];
            for d in 0..4 {
                s[d] = start[d] % ne[d];
                let st = if d == 0 { 1 } else { step[d] };
                vne[d] = len[d].min((ne[d] - 1 - s[d]) / st + 1);
                vnb[d] = m.nb[d] * st;
            }
            (vne, vnb, m.offset_of(s), true)
        } else {
            let vnb = [eb, raw_nb[1] * eb, raw_nb[2] * eb, raw_nb[3] * eb];
            (len, vnb, raw_offset / eb * eb, false)
        };
        match g.view(x, vne, vnb, offset) {
            Ok(v) => {
                prop_assert_eq!(v.ne(), vne);
                prop_assert_eq!(v.meta().nb, vnb);
                prop_assert_eq!(v.dtype(), dt);
                prop_assert!(v.meta().is_injective());
                prop_assert!(offset + v.meta().span_bytes() <= m.span_bytes());
            }
            Err(e) => {
                prop_assert!(!must_work, "window {vne:?} {vnb:?} +{offset} of {m:?}: {e}");
                let why = matches!(
                    &e,
                    GraphError::Op(OpError::ViewOutOfRange { op: "view", .. } | OpError::OverlappingStrides { op: "view", .. })
                );
                prop_assert!(why, "{:?}", e);
            }
        }
    }

    #[test]
    fn view_chains_stay_inside_the_root(
        ne in shape(),
        dt in select(&DType::PLAIN[..]),
        steps in prop::collection::vec((0u8..4, axes(), prop::array::uniform4(0usize..6)), 1..8),
    ) {
        let mut g = Graph::new();
        let root = g.input("x", dt, ne).unwrap();
        let root_span = root.meta().span_bytes();
        let (mut cur, mut offset) = (root, 0usize);
        for (kind, p, r) in steps {
            let m = *cur.meta();
            let next = match kind {
                0 => g.permute(cur, p).map(|t| (t, 0)),
                1 => g.transpose(cur).map(|t| (t, 0)),
                2 => {
                    // reshape to a shuffle of the dims (fails on a non-contiguous layout)
                    let target = [m.ne[p[0]], m.ne[p[1]], m.ne[p[2]], m.ne[p[3]]];
                    let r = g.reshape(cur, &target);
                    prop_assert_eq!(r.is_ok(), m.is_contiguous());
                    r.map(|t| (t, 0))
                }
                _ => {
                    // a window keeping the current strides; drop the first r[d] of each dim
                    let s = [r[0] % m.ne[0], r[1] % m.ne[1], r[2] % m.ne[2], r[3] % m.ne[3]];
                    let vne = [m.ne[0] - s[0], m.ne[1] - s[1], m.ne[2] - s[2], m.ne[3] - s[3]];
                    let off = m.offset_of(s);
                    let r = g.view(cur, vne, m.nb, off);
                    prop_assert_eq!(r.is_ok(), m.nb[0] == dt.block_bytes(), "{:?}", r);
                    r.map(|t| (t, off))
                }
            };
            if let Ok((t, off)) = next {
                prop_assert!(t.meta().is_injective());
                prop_assert!(off + t.meta().span_bytes() <= m.span_bytes());
                offset += off;
                cur = t;
                prop_assert!(offset + cur.meta().span_bytes() <= root_span);
            }
        }
    }
}
