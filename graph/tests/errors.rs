//! Bad input through the public graph API: every case asserts the error variant (with the op name
//! and the offending shapes or dtypes as fields) and that the `Display` text names the op and the
//! shapes, so a user reading only the message can find the bad call. A failed build must also
//! leave the graph unchanged. The last test throws many random op/shape/dtype combinations at
//! `Graph::op` and only asks that none of them panics.

use tessera_graph::{Graph, GraphError, Tensor, shape4};
use tessera_ops::{BinaryOp, DType, Op, OpError, RmsNormParams, ScaleParams, SoftmaxParams, UnaryOp, ViewParams};

const F32: DType = DType::F32;
const F16: DType = DType::F16;
const I32: DType = DType::I32;

fn leaf(g: &mut Graph, dtype: DType, ne: [usize; 4]) -> Tensor {
    g.input("x", dtype, ne).expect("a valid leaf")
}

/// Unwraps the `OpError` of a failed build and checks that the graph did not grow.
fn op_err(g: &Graph, before: usize, r: Result<Tensor, GraphError>) -> (OpError, String) {
    assert_eq!(g.len(), before, "a failed build must not append a node");
    match r {
        Err(GraphError::Op(e)) => {
            let msg = e.to_string();
            assert_eq!(GraphError::Op(e.clone()).to_string(), msg, "GraphError::Op is transparent");
            (e, msg)
        }
        Err(other) => panic!("expected GraphError::Op, got {other:?}"),
        Ok(t) => panic!("expected an error, got a tensor of shape {:?}", t.ne()),
    }
}

/// Builds `f` on `g` and returns its `OpError` and message.
fn build_err(g: &mut Graph, f: impl FnOnce(&mut Graph) -> Result<Tensor, GraphError>) -> (OpError, String) {
    let before = g.len();
    let r = f(g);
    op_err(g, before, r)
}

fn assert_mentions(msg: &str, parts: &[&str]) {
    for p in parts {
        assert!(msg.contains(p), "error message {msg:?} should mention {p:?}");
    }
}

// ---- binary broadcasting ----

#[test]
fn add_with_non_divisible_broadcast() {
    let mut g = Graph::new();
    let a = leaf(&mut g, F32, [4, 3, 1, 1]);
    let b = leaf(&mut g, F32, [3, 3, 1, 1]);
    let (e, msg) = build_err(&mut g, |g| g.add(a, b));
    assert!(matches!(e, OpError::ShapeMismatch { op: "add", lhs: [4, 3, 1, 1], rhs: [3, 3, 1, 1], .. }), "{e:?}");
    assert_mentions(&msg, &["add", "[4, 3, 1, 1]", "[3, 3, 1, 1]"]);
}

#[test]
fn binary_second_operand_larger_than_first() {
    let mut g = Graph::new();
    let a = leaf(&mut g, F32, [2, 1, 1, 1]);
    let b = leaf(&mut g, F32, [2, 4, 1, 1]);
    for op in BinaryOp::ALL {
        let (e, msg) = build_err(&mut g, |g| g.binary(op, a, b));
        assert!(
            matches!(e, OpError::ShapeMismatch { op: name, lhs: [2, 1, 1, 1], rhs: [2, 4, 1, 1], .. } if name == op.name()),
            "{e:?}"
        );
        assert_mentions(&msg, &[op.name(), "[2, 1, 1, 1]", "[2, 4, 1, 1]"]);
    }
}

#[test]
fn binary_on_i32_is_a_dtype_error() {
    let mut g = Graph::new();
    let a = leaf(&mut g, F32, [4, 1, 1, 1]);
    let b = leaf(&mut g, I32, [4, 1, 1, 1]);
    let (e, msg) = build_err(&mut g, |g| g.mul(a, b));
    assert_eq!(e, OpError::DType { op: "mul", input: 1, dtype: I32, expected: "a float type (f32, f16, bf16)" });
    assert_mentions(&msg, &["mul", "input 1", "i32"]);
    let (e, _) = build_err(&mut g, |g| g.sub(b, a));
    assert!(matches!(e, OpError::DType { op: "sub", input: 0, dtype: I32, .. }), "{e:?}");
}

// ---- mul_mat ----

#[test]
fn mul_mat_inner_dimension_mismatch() {
    let mut g = Graph::new();
    let w = leaf(&mut g, F32, [4, 3, 1, 1]);
    let x = leaf(&mut g, F32, [5, 2, 1, 1]);
    let (e, msg) = build_err(&mut g, |g| g.mul_mat(w, x));
    assert!(matches!(e, OpError::ShapeMismatch { op: "mul_mat", lhs: [4, 3, 1, 1], rhs: [5, 2, 1, 1], .. }), "{e:?}");
    assert_mentions(&msg, &["mul_mat", "[4, 3, 1, 1]", "[5, 2, 1, 1]", "K"]);
}

#[test]
fn mul_mat_activations_must_be_f32() {
    let mut g = Graph::new();
    let w = leaf(&mut g, F16, [4, 3, 1, 1]);
    for bad in [F16, DType::BF16, I32] {
        let x = leaf(&mut g, bad, [4, 2, 1, 1]);
        let (e, msg) = build_err(&mut g, |g| g.mul_mat(w, x));
        assert_eq!(e, OpError::DType { op: "mul_mat", input: 1, dtype: bad, expected: "f32 activations" });
        assert_mentions(&msg, &["mul_mat", "input 1", bad.name(), "f32"]);
    }
    // f16 weights with f32 activations are fine
    let x = leaf(&mut g, F32, [4, 2, 1, 1]);
    assert_eq!(g.mul_mat(w, x).unwrap().ne(), [3, 2, 1, 1]);
}

#[test]
fn mul_mat_integer_weights() {
    let mut g = Graph::new();
    let w = leaf(&mut g, I32, [4, 3, 1, 1]);
    let x = leaf(&mut g, F32, [4, 2, 1, 1]);
    let (e, msg) = build_err(&mut g, |g| g.mul_mat(w, x));
    assert!(matches!(e, OpError::DType { op: "mul_mat", input: 0, dtype: I32, .. }), "{e:?}");
    assert_mentions(&msg, &["mul_mat", "input 0", "i32"]);
}

#[test]
fn mul_mat_batch_not_divisible() {
    let mut g = Graph::new();
    let w = leaf(&mut g, F32, [4, 3, 2, 1]);
    let x = leaf(&mut g, F32, [4, 5, 3, 1]);
    let (e, msg) = build_err(&mut g, |g| g.mul_mat(w, x));
    assert!(matches!(e, OpError::ShapeMismatch { op: "mul_mat", lhs: [4, 3, 2, 1], rhs: [4, 5, 3, 1], .. }), "{e:?}");
    assert_mentions(&msg, &["mul_mat", "[4, 3, 2, 1]", "[4, 5, 3, 1]"]);
    // dim 3 too
    let w = leaf(&mut g, F32, [4, 3, 1, 2]);
    let x = leaf(&mut g, F32, [4, 5, 1, 5]);
    let (e, _) = build_err(&mut g, |g| g.mul_mat(w, x));
    assert!(matches!(e, OpError::ShapeMismatch { op: "mul_mat", .. }), "{e:?}");
}

#[test]
fn mul_mat_of_transposed_weights_needs_contiguous_rows() {
    let mut g = Graph::new();
    let w = leaf(&mut g, F32, [3, 4, 1, 1]);
    let wt = g.transpose(w).unwrap(); // [4, 3] with nb [12, 4, ..]
    let x = leaf(&mut g, F32, [4, 2, 1, 1]);
    let (e, msg) = build_err(&mut g, |g| g.mul_mat(wt, x));
    assert_eq!(e, OpError::NotContiguous { op: "mul_mat", input: 0, shape: [4, 3, 1, 1], nb: [12, 4, 48, 48] });
    assert_mentions(&msg, &["mul_mat", "[4, 3, 1, 1]", "[12, 4, 48, 48]", "contiguous"]);
}

#[test]
fn mul_mat_output_too_large_to_address() {
    // Each input fits (2^31 rows of one f32), but the [2^31, 2^31] f32 output would need 2^64 bytes.
    let mut g = Graph::new();
    let n = 1usize << 31;
    let w = leaf(&mut g, F32, [1, n, 1, 1]);
    let x = leaf(&mut g, F32, [1, n, 1, 1]);
    let (e, msg) = build_err(&mut g, |g| g.mul_mat(w, x));
    assert_eq!(e, OpError::TooLarge { op: "mul_mat", shape: [n, n, 1, 1], dtype: F32 });
    assert_mentions(&msg, &["mul_mat", &format!("[{n}, {n}, 1, 1]"), "too large"]);
}

// ---- dtypes of unary ops, reductions, softmax masks ----

#[test]
fn integer_input_to_float_ops() {
    let mut g = Graph::new();
    let x = leaf(&mut g, I32, [4, 2, 1, 1]);
    for u in UnaryOp::ALL {
        let (e, msg) = build_err(&mut g, |g| g.unary(u, x));
        assert!(matches!(e, OpError::DType { op, input: 0, dtype: I32, .. } if op == u.name()), "{e:?}");
        assert_mentions(&msg, &[u.name(), "i32"]);
    }
    let (e, msg) = build_err(&mut g, |g| g.silu(x));
    assert_eq!(e, OpError::DType { op: "silu", input: 0, dtype: I32, expected: "a float type (f32, f16, bf16)" });
    assert_eq!(msg, "silu: input 0 has dtype i32, expected a float type (f32, f16, bf16)");
    for (name, f) in [
        ("scale", (|g: &mut Graph, x| g.scale(x, 2.0)) as fn(&mut Graph, Tensor) -> Result<Tensor, GraphError>),
        ("rms_norm", |g, x| g.rms_norm(x, 1e-6)),
        ("sum_rows", |g, x| g.sum_rows(x)),
        ("argmax", |g, x| g.argmax(x)),
        ("softmax", |g, x| g.softmax(x, 1.0, None)),
        ("swiglu", |g, x| g.swiglu_fused(x)),
    ] {
        let (e, msg) = build_err(&mut g, |g| f(g, x));
        assert!(matches!(e, OpError::DType { op, input: 0, dtype: I32, .. } if op == name), "{name}: {e:?}");
        assert_mentions(&msg, &[name, "i32"]);
    }
}

#[test]
fn get_rows_ids_must_be_i32() {
    let mut g = Graph::new();
    let src = leaf(&mut g, F32, [4, 5, 1, 1]);
    let ids = leaf(&mut g, F32, [3, 1, 1, 1]);
    let (e, msg) = build_err(&mut g, |g| g.get_rows(src, ids));
    assert_eq!(e, OpError::DType { op: "get_rows", input: 1, dtype: F32, expected: "i32 row ids" });
    assert_mentions(&msg, &["get_rows", "input 1", "f32", "i32"]);
}

#[test]
fn softmax_mask_dtype_f16_ok_i32_not() {
    let mut g = Graph::new();
    let x = leaf(&mut g, F32, [4, 3, 1, 1]);
    let m16 = leaf(&mut g, F16, [4, 3, 1, 1]);
    let m32 = leaf(&mut g, F32, [4, 3, 1, 1]);
    assert_eq!(g.softmax(x, 1.0, Some(m16)).unwrap().ne(), [4, 3, 1, 1]);
    assert_eq!(g.softmax(x, 1.0, Some(m32)).unwrap().ne(), [4, 3, 1, 1]);
    for bad in [I32, DType::BF16] {
        let m = leaf(&mut g, bad, [4, 3, 1, 1]);
        let (e, msg) = build_err(&mut g, |g| g.softmax(x, 1.0, Some(m)));
        assert_eq!(e, OpError::DType { op: "softmax", input: 1, dtype: bad, expected: "an f32 or f16 mask" });
        assert_mentions(&msg, &["softmax", "input 1", bad.name(), "mask"]);
    }
}

#[test]
fn softmax_mask_too_short_or_wrong_width() {
    let mut g = Graph::new();
    let x = leaf(&mut g, F32, [4, 3, 2, 1]);
    // fewer rows than x
    let short = leaf(&mut g, F32, [4, 2, 1, 1]);
    let (e, msg) = build_err(&mut g, |g| g.softmax(x, 1.0, Some(short)));
    assert!(matches!(e, OpError::ShapeMismatch { op: "softmax", lhs: [4, 3, 2, 1], rhs: [4, 2, 1, 1], .. }), "{e:?}");
    assert_mentions(&msg, &["softmax", "[4, 3, 2, 1]", "[4, 2, 1, 1]", "mask"]);
    // row width differs
    let wide = leaf(&mut g, F32, [5, 3, 1, 1]);
    let (e, _) = build_err(&mut g, |g| g.softmax(x, 1.0, Some(wide)));
    assert!(matches!(e, OpError::ShapeMismatch { op: "softmax", rhs: [5, 3, 1, 1], .. }), "{e:?}");
    // dim 2 does not divide
    let odd = leaf(&mut g, F32, [4, 3, 3, 1]);
    let (e, _) = build_err(&mut g, |g| g.softmax(x, 1.0, Some(odd)));
    assert!(matches!(e, OpError::ShapeMismatch { op: "softmax", rhs: [4, 3, 3, 1], .. }), "{e:?}");
    // a longer mask that broadcasts over dim 2 is fine
    let long = leaf(&mut g, F32, [4, 8, 1, 1]);
    assert!(g.softmax(x, 1.0, Some(long)).is_ok());
}

#[test]
fn softmax_non_finite_scale() {
    let mut g = Graph::new();
    let x = leaf(&mut g, F32, [4, 3, 1, 1]);
    for s in [f32::NAN, f32::INFINITY] {
        let (e, msg) = build_err(&mut g, |g| g.softmax(x, s, None));
        assert!(matches!(e, OpError::InvalidParam { op: "softmax", .. }), "{e:?}");
        assert_mentions(&msg, &["softmax", "scale", &s.to_string()]);
    }
}

// ---- get_rows / set_rows ----

#[test]
fn get_rows_ids_shape_must_match_batches() {
    let mut g = Graph::new();
    let src = leaf(&mut g, F32, [4, 5, 2, 1]);
    let ids = leaf(&mut g, I32, [3, 1, 1, 1]);
    let (e, msg) = build_err(&mut g, |g| g.get_rows(src, ids));
    assert!(matches!(e, OpError::ShapeMismatch { op: "get_rows", lhs: [4, 5, 2, 1], rhs: [3, 1, 1, 1], .. }), "{e:?}");
    assert_mentions(&msg, &["get_rows", "[4, 5, 2, 1]", "[3, 1, 1, 1]", "ids"]);
    // ids with a fourth dimension
    let ids4 = leaf(&mut g, I32, [3, 2, 1, 2]);
    let (e, _) = build_err(&mut g, |g| g.get_rows(src, ids4));
    assert!(matches!(e, OpError::ShapeMismatch { op: "get_rows", rhs: [3, 2, 1, 2], .. }), "{e:?}");
    // the right one
    let ok = leaf(&mut g, I32, [3, 2, 1, 1]);
    assert_eq!(g.get_rows(src, ok).unwrap().ne(), [4, 3, 2, 1]);
}

#[test]
fn get_rows_of_transposed_source() {
    let mut g = Graph::new();
    let src = leaf(&mut g, F32, [5, 4, 1, 1]);
    let t = g.transpose(src).unwrap();
    let ids = leaf(&mut g, I32, [2, 1, 1, 1]);
    let (e, msg) = build_err(&mut g, |g| g.get_rows(t, ids));
    assert_eq!(e, OpError::NotContiguous { op: "get_rows", input: 0, shape: [4, 5, 1, 1], nb: [20, 4, 80, 80] });
    assert_mentions(&msg, &["get_rows", "[4, 5, 1, 1]"]);
}

#[test]
fn set_rows_source_shape_mismatch() {
    let mut g = Graph::new();
    let dst = g.state("kv", F16, [4, 8, 1, 1]).unwrap();
    let src = leaf(&mut g, F32, [3, 2, 1, 1]);
    let ids = leaf(&mut g, I32, [2, 1, 1, 1]);
    let (e, msg) = build_err(&mut g, |g| g.set_rows(dst, src, ids));
    assert!(matches!(e, OpError::ShapeMismatch { op: "set_rows", lhs: [4, 8, 1, 1], rhs: [3, 2, 1, 1], .. }), "{e:?}");
    assert_mentions(&msg, &["set_rows", "[4, 8, 1, 1]", "[3, 2, 1, 1]"]);
}

#[test]
fn set_rows_ids_mismatch() {
    let mut g = Graph::new();
    let dst = g.state("kv", F32, [4, 8, 1, 1]).unwrap();
    let src = leaf(&mut g, F32, [4, 2, 1, 1]);
    let ids = leaf(&mut g, I32, [3, 1, 1, 1]);
    let (e, msg) = build_err(&mut g, |g| g.set_rows(dst, src, ids));
    assert!(matches!(e, OpError::ShapeMismatch { op: "set_rows", lhs: [4, 2, 1, 1], rhs: [3, 1, 1, 1], .. }), "{e:?}");
    assert_mentions(&msg, &["set_rows", "[4, 2, 1, 1]", "[3, 1, 1, 1]", "ids"]);
    // float ids
    let fids = leaf(&mut g, F32, [2, 1, 1, 1]);
    let (e, _) = build_err(&mut g, |g| g.set_rows(dst, src, fids));
    assert_eq!(e, OpError::DType { op: "set_rows", input: 2, dtype: F32, expected: "i32 row ids" });
    // integer destination
    let idst = g.state("ints", I32, [4, 8, 1, 1]).unwrap();
    let ids = leaf(&mut g, I32, [2, 1, 1, 1]);
    let (e, msg) = build_err(&mut g, |g| g.set_rows(idst, src, ids));
    assert!(matches!(e, OpError::DType { op: "set_rows", input: 0, dtype: I32, .. }), "{e:?}");
    assert_mentions(&msg, &["set_rows", "i32"]);
}

// ---- cpy / cast / concat / repeat ----

#[test]
fn cpy_element_count_mismatch() {
    let mut g = Graph::new();
    let src = leaf(&mut g, F32, [4, 3, 1, 1]);
    let dst = g.state("d", F32, [5, 2, 1, 1]).unwrap();
    let (e, msg) = build_err(&mut g, |g| g.cpy(src, dst));
    assert!(matches!(e, OpError::ShapeMismatch { op: "cpy", lhs: [4, 3, 1, 1], rhs: [5, 2, 1, 1], .. }), "{e:?}");
    assert_mentions(&msg, &["cpy", "[4, 3, 1, 1]", "[5, 2, 1, 1]", "number of elements"]);
    // same count, other shape: fine
    let dst2 = g.state("d2", F16, [6, 2, 1, 1]).unwrap();
    assert_eq!(g.cpy(src, dst2).unwrap().ne(), [6, 2, 1, 1]);
}

#[test]
fn cpy_float_to_int_and_back() {
    let mut g = Graph::new();
    let f = leaf(&mut g, F32, [4, 1, 1, 1]);
    let i = g.state("i", I32, [4, 1, 1, 1]).unwrap();
    let (e, msg) = build_err(&mut g, |g| g.cpy(f, i));
    assert!(matches!(e, OpError::DType { op: "cpy", input: 1, dtype: I32, .. }), "{e:?}");
    assert_mentions(&msg, &["cpy", "input 1", "i32"]);
    let fdst = g.state("f", DType::BF16, [4, 1, 1, 1]).unwrap();
    let (e, _) = build_err(&mut g, |g| g.cpy(i, fdst));
    assert!(matches!(e, OpError::DType { op: "cpy", input: 1, dtype: DType::BF16, .. }), "{e:?}");
}

#[test]
fn cast_across_kinds() {
    let mut g = Graph::new();
    let f = leaf(&mut g, F32, [4, 2, 1, 1]);
    let (e, msg) = build_err(&mut g, |g| g.cast(f, I32));
    assert!(matches!(e, OpError::DType { op: "cast", input: 0, dtype: F32, .. }), "{e:?}");
    assert_mentions(&msg, &["cast", "f32"]);
    let i = leaf(&mut g, I32, [4, 2, 1, 1]);
    let (e, _) = build_err(&mut g, |g| g.cast(i, F16));
    assert!(matches!(e, OpError::DType { op: "cast", input: 0, dtype: I32, .. }), "{e:?}");
    // same kind is fine
    assert_eq!(g.cast(f, DType::BF16).unwrap().dtype(), DType::BF16);
    assert_eq!(g.cast(i, I32).unwrap().dtype(), I32);
}

#[test]
fn concat_dim_out_of_range() {
    let mut g = Graph::new();
    let a = leaf(&mut g, F32, [4, 3, 1, 1]);
    for dim in [4, 7, usize::MAX] {
        let (e, msg) = build_err(&mut g, |g| g.concat(a, a, dim));
        assert!(matches!(e, OpError::InvalidParam { op: "concat", .. }), "{e:?}");
        assert_mentions(&msg, &["concat", &format!("dim {dim}")]);
    }
}

#[test]
fn concat_mismatched_dims_and_dtypes() {
    let mut g = Graph::new();
    let a = leaf(&mut g, F32, [4, 3, 1, 1]);
    let b = leaf(&mut g, F32, [5, 2, 1, 1]);
    let (e, msg) = build_err(&mut g, |g| g.concat(a, b, 1));
    assert!(matches!(e, OpError::ShapeMismatch { op: "concat", lhs: [4, 3, 1, 1], rhs: [5, 2, 1, 1], .. }), "{e:?}");
    assert_mentions(&msg, &["concat", "[4, 3, 1, 1]", "[5, 2, 1, 1]", "but 1"]);
    // along 0 the other dims (3 vs 2) still differ
    let (e, _) = build_err(&mut g, |g| g.concat(a, b, 0));
    assert!(matches!(e, OpError::ShapeMismatch { op: "concat", .. }), "{e:?}");
    let c = leaf(&mut g, F16, [4, 3, 1, 1]);
    let (e, msg) = build_err(&mut g, |g| g.concat(a, c, 1));
    assert_eq!(e, OpError::DType { op: "concat", input: 1, dtype: F16, expected: "the same dtype as input 0" });
    assert_mentions(&msg, &["concat", "f16"]);
}

#[test]
fn repeat_to_a_non_multiple() {
    let mut g = Graph::new();
    let x = leaf(&mut g, F32, [2, 3, 1, 1]);
    let (e, msg) = build_err(&mut g, |g| g.repeat(x, &[4, 4]));
    assert!(matches!(e, OpError::ShapeMismatch { op: "repeat", lhs: [2, 3, 1, 1], rhs: [4, 4, 1, 1], .. }), "{e:?}");
    assert_mentions(&msg, &["repeat", "[2, 3, 1, 1]", "[4, 4, 1, 1]"]);
    // zero target, and a target smaller than the source
    let (e, _) = build_err(&mut g, |g| g.repeat(x, &[2, 0]));
    assert!(matches!(e, OpError::ShapeMismatch { op: "repeat", rhs: [2, 0, 1, 1], .. }), "{e:?}");
    let (e, _) = build_err(&mut g, |g| g.repeat(x, &[1, 3]));
    assert!(matches!(e, OpError::ShapeMismatch { op: "repeat", rhs: [1, 3, 1, 1], .. }), "{e:?}");
}

#[test]
fn repeat_to_an_unaddressable_size() {
    let mut g = Graph::new();
    let x = leaf(&mut g, F32, [1, 1, 1, 1]);
    let huge = [1usize << 32, 1 << 32, 1, 1];
    let (e, msg) = build_err(&mut g, |g| g.repeat(x, &huge));
    assert_eq!(e, OpError::TooLarge { op: "repeat", shape: huge, dtype: F32 });
    assert_mentions(&msg, &["repeat", "4294967296", "f32"]);
}

// ---- views ----

#[test]
fn reshape_must_keep_the_element_count() {
    let mut g = Graph::new();
    let x = leaf(&mut g, F32, [4, 3, 1, 1]);
    let (e, msg) = build_err(&mut g, |g| g.reshape(x, &[5, 2]));
    assert!(matches!(e, OpError::ShapeMismatch { op: "reshape", lhs: [4, 3, 1, 1], rhs: [5, 2, 1, 1], .. }), "{e:?}");
    assert_mentions(&msg, &["reshape", "[4, 3, 1, 1]", "[5, 2, 1, 1]", "element count"]);
    // a zero dim, and a product that overflows but wraps to the right count
    let (e, _) = build_err(&mut g, |g| g.reshape(x, &[12, 0]));
    assert!(matches!(e, OpError::ShapeMismatch { op: "reshape", .. }), "{e:?}");
    let wraps = [12, 1 << 32, 1 << 32, 1]; // 12 * 2^64 wraps to 0 -> must not be mistaken for anything
    let (e, _) = build_err(&mut g, |g| g.reshape(x, &wraps));
    assert!(matches!(e, OpError::ShapeMismatch { op: "reshape", .. }), "{e:?}");
}

#[test]
fn reshape_of_a_transpose_is_not_contiguous() {
    let mut g = Graph::new();
    let x = leaf(&mut g, F32, [4, 3, 1, 1]);
    let t = g.transpose(x).unwrap();
    let (e, msg) = build_err(&mut g, |g| g.reshape(t, &[12]));
    assert_eq!(e, OpError::NotContiguous { op: "reshape", input: 0, shape: [3, 4, 1, 1], nb: [16, 4, 48, 48] });
    assert_mentions(&msg, &["reshape", "[3, 4, 1, 1]", "[16, 4, 48, 48]", "contiguous"]);
    // after cont it works
    let c = g.cont(t).unwrap();
    assert_eq!(g.reshape(c, &[12]).unwrap().ne(), [12, 1, 1, 1]);
}

#[test]
fn permute_axes_must_be_a_permutation() {
    let mut g = Graph::new();
    let x = leaf(&mut g, F32, [4, 3, 2, 1]);
    for axes in [[0, 0, 1, 2], [0, 1, 2, 4], [3, 2, 1, 1], [usize::MAX, 0, 1, 2]] {
        let (e, msg) = build_err(&mut g, |g| g.permute(x, axes));
        assert!(matches!(e, OpError::InvalidParam { op: "permute", .. }), "{axes:?}: {e:?}");
        assert_mentions(&msg, &["permute", &format!("{axes:?}")]);
    }
}

#[test]
fn view_offset_past_the_end() {
    let mut g = Graph::new();
    let x = leaf(&mut g, F32, [4, 3, 1, 1]); // 48 bytes
    let (e, msg) = build_err(&mut g, |g| g.view(x, [4, 1, 1, 1], [4, 16, 16, 16], 36));
    assert_eq!(
        e,
        OpError::ViewOutOfRange {
            op: "view",
            ne: [4, 1, 1, 1],
            nb: [4, 16, 16, 16],
            offset: 36,
            needed: 52,
            available: 48
        }
    );
    assert_mentions(&msg, &["view", "[4, 1, 1, 1]", "[4, 16, 16, 16]", "36", "52", "48"]);
    // the last row exactly is fine
    assert!(g.view(x, [4, 1, 1, 1], [4, 16, 16, 16], 32).is_ok());
    // an offset so large that offset + row overflows
    let (e, _) = build_err(&mut g, |g| g.view(x, [4, 1, 1, 1], [4, 16, 16, 16], usize::MAX - 3));
    assert!(matches!(e, OpError::ViewOutOfRange { op: "view", .. }), "{e:?}");
}

#[test]
fn view_stride_past_the_end() {
    let mut g = Graph::new();
    let x = leaf(&mut g, F32, [4, 3, 1, 1]);
    let (e, msg) = build_err(&mut g, |g| g.view(x, [4, 2, 1, 1], [4, 40, 80, 80], 0));
    assert!(
        matches!(
            e,
            OpError::ViewOutOfRange {
                op: "view",
                ne: [4, 2, 1, 1],
                nb: [4, 40, 80, 80],
                needed: 56,
                available: 48,
                ..
            }
        ),
        "{e:?}"
    );
    assert_mentions(&msg, &["view", "[4, 2, 1, 1]", "[4, 40, 80, 80]"]);
    // a stride whose product with the extent overflows
    let (e, _) = build_err(&mut g, |g| g.view(x, [4, 3, 1, 1], [4, usize::MAX / 2, 1, 1], 0));
    assert!(matches!(e, OpError::ViewOutOfRange { op: "view", .. }), "{e:?}");
}

#[test]
fn view_with_overlapping_strides() {
    let mut g = Graph::new();
    let x = leaf(&mut g, F32, [4, 3, 1, 1]);
    // rows of 4 elements, 2 elements apart: distinct elements share memory
    let (e, msg) = build_err(&mut g, |g| g.view(x, [4, 2, 1, 1], [4, 8, 48, 48], 0));
    assert_eq!(e, OpError::OverlappingStrides { op: "view", ne: [4, 2, 1, 1], nb: [4, 8, 48, 48] });
    assert_mentions(&msg, &["view", "[4, 2, 1, 1]", "[4, 8, 48, 48]", "share memory"]);
    // a zero stride (a broadcast view) over a dimension of more than one element
    let (e, _) = build_err(&mut g, |g| g.view(x, [4, 3, 1, 1], [4, 0, 48, 48], 0));
    assert!(matches!(e, OpError::OverlappingStrides { op: "view", .. }), "{e:?}");
}

#[test]
fn view_element_stride_and_alignment() {
    let mut g = Graph::new();
    let x = leaf(&mut g, F32, [4, 3, 1, 1]);
    let (e, msg) = build_err(&mut g, |g| g.view(x, [2, 3, 1, 1], [8, 16, 48, 48], 0));
    assert!(matches!(e, OpError::InvalidShape { op: "view", shape: [2, 3, 1, 1], .. }), "{e:?}");
    assert_mentions(&msg, &["view", "[2, 3, 1, 1]", "nb[0]"]);
    // an offset that splits an element
    let (e, _) = build_err(&mut g, |g| g.view(x, [2, 1, 1, 1], [4, 16, 16, 16], 2));
    assert!(matches!(e, OpError::InvalidShape { op: "view", .. }), "{e:?}");
}

#[test]
fn view_with_a_zero_dimension() {
    let mut g = Graph::new();
    let x = leaf(&mut g, F32, [4, 3, 1, 1]);
    let (e, msg) = build_err(&mut g, |g| g.view(x, [4, 0, 1, 1], [4, 16, 16, 16], 0));
    assert!(matches!(e, OpError::InvalidShape { op: "view", shape: [4, 0, 1, 1], .. }), "{e:?}");
    assert_mentions(&msg, &["view", "[4, 0, 1, 1]", "at least 1"]);
}

// ---- leaves, shapes and parameters ----

#[test]
fn zero_sized_leaves() {
    let mut g = Graph::new();
    for ne in [[0, 1, 1, 1], [4, 0, 1, 1], [4, 3, 2, 0]] {
        let r = g.input("x", F32, ne);
        let (e, msg) = op_err(&g, 0, r);
        assert!(matches!(e, OpError::InvalidShape { op: "input", shape, .. } if shape == ne), "{e:?}");
        assert_mentions(&msg, &["input", &format!("{ne:?}")]);
    }
    let r = g.parameter("w", F16, [0, 2, 1, 1]);
    assert!(matches!(r, Err(GraphError::Op(OpError::InvalidShape { op: "parameter", .. }))), "{r:?}");
    let r = g.state("s", F16, [2, 2, 0, 1]);
    assert!(matches!(r, Err(GraphError::Op(OpError::InvalidShape { op: "state", .. }))), "{r:?}");
}

#[test]
fn overflowing_leaf_shapes() {
    let mut g = Graph::new();
    let cases = [
        ([usize::MAX / 2, 4, 1, 1], F32),
        ([usize::MAX, 1, 1, 1], DType::BF16),
        ([1 << 20, 1 << 20, 1 << 20, 1 << 20], F16),
        ([1 << 31, 1 << 31, 1, 1], F32), // 2^64 bytes: one past what fits
        ([1 << 30, 1 << 30, 2, 1], I32), // 2^63 bytes: fits usize, not isize
    ];
    for (ne, dtype) in cases {
        let r = g.input("x", dtype, ne);
        let (e, msg) = op_err(&g, 0, r);
        assert_eq!(e, OpError::TooLarge { op: "input", shape: ne, dtype }, "{ne:?}");
        assert_mentions(&msg, &["input", &format!("{ne:?}"), dtype.name(), "too large"]);
    }
}

#[test]
fn rms_norm_eps_must_be_finite_and_non_negative() {
    let mut g = Graph::new();
    let x = leaf(&mut g, F32, [4, 3, 1, 1]);
    for eps in [-1e-6, f32::NAN, f32::INFINITY, -0.5] {
        let (e, msg) = build_err(&mut g, |g| g.rms_norm(x, eps));
        assert!(matches!(e, OpError::InvalidParam { op: "rms_norm", .. }), "{eps}: {e:?}");
        assert_mentions(&msg, &["rms_norm", "eps", &eps.to_string()]);
    }
    assert!(g.rms_norm(x, 0.0).is_ok());
}

#[test]
fn scale_must_be_finite() {
    let mut g = Graph::new();
    let x = leaf(&mut g, F32, [4, 3, 1, 1]);
    let (e, msg) = build_err(&mut g, |g| g.scale(x, f32::NAN));
    assert!(matches!(e, OpError::InvalidParam { op: "scale", .. }), "{e:?}");
    assert_mentions(&msg, &["scale", "NaN"]);
    let (e, msg) = build_err(&mut g, |g| g.scale_bias(x, 1.0, f32::NEG_INFINITY));
    assert!(matches!(e, OpError::InvalidParam { op: "scale", .. }), "{e:?}");
    assert_mentions(&msg, &["scale", "-inf"]);
}

#[test]
fn swiglu_odd_width_and_mismatched_halves() {
    let mut g = Graph::new();
    let x = leaf(&mut g, F32, [5, 2, 1, 1]);
    let (e, msg) = build_err(&mut g, |g| g.swiglu_fused(x));
    assert!(matches!(e, OpError::InvalidShape { op: "swiglu", shape: [5, 2, 1, 1], .. }), "{e:?}");
    assert_mentions(&msg, &["swiglu", "[5, 2, 1, 1]", "even"]);
    let gate = leaf(&mut g, F32, [4, 2, 1, 1]);
    let up = leaf(&mut g, F32, [4, 1, 1, 1]);
    let (e, msg) = build_err(&mut g, |g| g.swiglu(gate, up));
    assert!(matches!(e, OpError::ShapeMismatch { op: "swiglu", lhs: [4, 2, 1, 1], rhs: [4, 1, 1, 1], .. }), "{e:?}");
    assert_mentions(&msg, &["swiglu", "[4, 2, 1, 1]", "[4, 1, 1, 1]"]);
}

#[test]
fn wrong_arity_through_graph_op() {
    let mut g = Graph::new();
    let x = leaf(&mut g, F32, [4, 4, 1, 1]);
    let ids = leaf(&mut g, I32, [2, 1, 1, 1]);
    let cases: Vec<(Op, Vec<Tensor>, &str, &str)> = vec![
        (Op::Binary(BinaryOp::Add), vec![x], "add", "2"),
        (Op::MulMat, vec![], "mul_mat", "2"),
        (Op::Unary(UnaryOp::Exp), vec![x, x], "exp", "1"),
        (Op::Transpose, vec![x, x], "transpose", "1"),
        (Op::View(ViewParams { ne: [1, 1, 1, 1], nb: [4, 4, 4, 4], offset: 0 }), vec![], "view", "1"),
        (Op::SetRows, vec![x, x], "set_rows", "3"),
        (Op::GetRows, vec![x, ids, ids], "get_rows", "2"),
        (Op::Cpy, vec![x], "cpy", "2"),
        (Op::Softmax(SoftmaxParams { scale: 1.0 }), vec![x, x, x], "softmax", "1 or 2"),
        (Op::Softmax(SoftmaxParams { scale: 1.0 }), vec![], "softmax", "1 or 2"),
        (Op::Swiglu, vec![x, x, x], "swiglu", "1 or 2"),
        (Op::RmsNorm(RmsNormParams { eps: 0.0 }), vec![x, x], "rms_norm", "1"),
        (Op::Scale(ScaleParams { scale: 1.0, bias: 0.0 }), vec![], "scale", "1"),
        (Op::Concat { dim: 0 }, vec![x, x, x], "concat", "2"),
    ];
    for (op, inputs, name, expected) in cases {
        let got = inputs.len();
        let (e, msg) = build_err(&mut g, |g| g.op(op.clone(), &inputs));
        assert_eq!(e, OpError::Arity { op: name, expected, got }, "{op}");
        assert_eq!(msg, format!("{name}: expected {expected} inputs, got {got}"));
    }
}

#[test]
fn tensor_from_another_graph() {
    let mut other = Graph::new();
    let foreign = other.input("f", F32, [4, 1, 1, 1]).unwrap();
    let mut g = Graph::new();
    let x = leaf(&mut g, F32, [4, 1, 1, 1]);
    let before = g.len();
    let r = g.add(x, foreign);
    assert_eq!(r, Err(GraphError::ForeignTensor { id: foreign.id() }));
    assert_eq!(g.len(), before);
    let msg = r.unwrap_err().to_string();
    assert_mentions(&msg, &["another graph", &format!("{:?}", foreign.id())]);
    // first position too, and the naming / output calls
    assert!(matches!(g.silu(foreign), Err(GraphError::ForeignTensor { .. })));
    assert_eq!(g.mark_output(foreign), Err(GraphError::ForeignTensor { id: foreign.id() }));
    assert_eq!(g.set_name(foreign, "nope"), Err(GraphError::ForeignTensor { id: foreign.id() }));
    assert!(g.outputs().is_empty());
    // a tensor of a later node of a clone is foreign to the original as well
    let mut clone = g.clone();
    let later = clone.neg(x).unwrap();
    assert_eq!(g.neg(later), Err(GraphError::ForeignTensor { id: later.id() }));
}

#[test]
fn handle_from_a_diverged_clone_is_foreign() {
    // A clone shares the graph's identity; once both grow, the same node index names different
    // tensors. A handle of the clone must not pass for the original's node (its descriptor would
    // not match the node it points at).
    let mut g = Graph::new();
    let x = leaf(&mut g, F32, [4, 1, 1, 1]);
    let mut clone = g.clone();
    let big = clone.input("big", F32, [1000, 1, 1, 1]).unwrap();
    let small = g.input("small", F32, [1, 1, 1, 1]).unwrap();
    assert_eq!(big.id(), small.id());
    assert_eq!(g.cont(big), Err(GraphError::ForeignTensor { id: big.id() }));
    assert_eq!(g.mark_output(big), Err(GraphError::ForeignTensor { id: big.id() }));
    // handles that predate the clone stay valid in both
    assert!(g.neg(x).is_ok());
    assert!(clone.neg(x).is_ok());
}

#[test]
fn shape4_needs_one_to_four_dims() {
    for dims in [&[][..], &[1, 2, 3, 4, 5][..]] {
        let r = shape4(dims);
        let msg = match &r {
            Err(GraphError::Op(e @ OpError::InvalidParam { op: "shape", .. })) => e.to_string(),
            other => panic!("{dims:?}: {other:?}"),
        };
        assert_mentions(&msg, &["shape", &dims.len().to_string(), "1 to 4"]);
    }
    assert_eq!(shape4(&[7]).unwrap(), [7, 1, 1, 1]);
    assert_eq!(shape4(&[1, 2, 3, 4]).unwrap(), [1, 2, 3, 4]);
    // and through the builders that take dims
    let mut g = Graph::new();
    let x = leaf(&mut g, F32, [4, 1, 1, 1]);
    let (e, _) = build_err(&mut g, |g| g.reshape(x, &[]));
    assert!(matches!(e, OpError::InvalidParam { op: "shape", .. }), "{e:?}");
    let (e, _) = build_err(&mut g, |g| g.repeat(x, &[4, 1, 1, 1, 1]));
    assert!(matches!(e, OpError::InvalidParam { op: "shape", .. }), "{e:?}");
}

// ---- nothing panics ----

/// splitmix64: a tiny seeded generator so the fuzz loop is reproducible without extra crates.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len())]
    }
    /// Mostly small sizes, sometimes 0, sometimes huge.
    fn dim(&mut self) -> usize {
        match self.below(20) {
            0 => 0,
            1 => usize::MAX / self.pick(&[1, 2, 3, 16]),
            2 => 1 << self.pick(&[16, 31, 32, 62]),
            _ => 1 + self.below(6),
        }
    }
    fn shape(&mut self) -> [usize; 4] {
        [self.dim(), self.dim(), self.dim(), self.dim()]
    }
    fn small_shape(&mut self) -> [usize; 4] {
        [1 + self.below(6), 1 + self.below(4), 1 + self.below(3), 1 + self.below(2)]
    }
    fn f32(&mut self) -> f32 {
        self.pick(&[0.0, 1.0, -1.0, 1e-6, f32::NAN, f32::INFINITY, f32::NEG_INFINITY, f32::MAX, -0.0])
    }
    fn op(&mut self) -> Op {
        match self.below(20) {
            0 => Op::GetRows,
            1 => Op::SetRows,
            2 => Op::Cpy,
            3 => Op::Cast(self.pick(&DType::PLAIN)),
            4 => Op::Cont,
            5 => Op::Concat { dim: self.pick(&[0, 1, 2, 3, 4, usize::MAX]) },
            6 => Op::Repeat { ne: self.shape() },
            7 => {
                let offset = match self.below(4) {
                    0 => 0,
                    1 => usize::MAX - self.below(8),
                    _ => self.below(64),
                };
                let nb = [self.pick(&[0, 2, 4, 8]), self.dim().wrapping_mul(4), self.dim().wrapping_mul(2), self.dim()];
                Op::View(ViewParams { ne: self.shape(), nb, offset })
            }
            8 => Op::Reshape { ne: self.shape() },
            9 => Op::Permute { axes: [self.below(5), self.below(5), self.below(5), self.below(5)] },
            10 => Op::Transpose,
            11 => Op::Unary(self.pick(&UnaryOp::ALL)),
            12 => Op::Binary(self.pick(&BinaryOp::ALL)),
            13 => Op::Scale(ScaleParams { scale: self.f32(), bias: self.f32() }),
            14 => Op::Swiglu,
            15 => Op::RmsNorm(RmsNormParams { eps: self.f32() }),
            16 => Op::SumRows,
            17 => Op::Softmax(SoftmaxParams { scale: self.f32() }),
            18 => Op::Argmax,
            _ => Op::MulMat,
        }
    }
}

#[test]
fn random_ops_never_panic() {
    let mut rng = Rng(0x7E55_E4A0);
    let (mut ok, mut err) = (0usize, 0usize);
    for round in 0..200 {
        let mut g = Graph::new();
        let mut pool: Vec<Tensor> = Vec::new();
        // Leaves: small valid ones, plus attempts at wild shapes (which may fail, without panicking).
        for _ in 0..6 {
            let ne = rng.small_shape();
            pool.push(g.input("x", rng.pick(&DType::PLAIN), ne).expect("small shapes are valid"));
        }
        for _ in 0..4 {
            let ne = rng.shape();
            if let Ok(t) = g.state("s", rng.pick(&DType::PLAIN), ne) {
                pool.push(t);
            }
        }
        for _ in 0..60 {
            let op = rng.op();
            let n = rng.pick(&[0, 1, 1, 2, 2, 2, 3, 4]);
            let inputs: Vec<Tensor> = (0..n).map(|_| rng.pick(&pool)).collect();
            let before = g.len();
            match g.op(op.clone(), &inputs) {
                Ok(t) => {
                    ok += 1;
                    assert_eq!(g.len(), before + 1);
                    assert!(t.ne().iter().all(|&d| d >= 1), "round {round}: {op} gave {:?}", t.ne());
                    // the cost model must cope with anything that built
                    let metas: Vec<&tessera_ops::TensorMeta> = inputs.iter().map(|t| t.meta()).collect();
                    let _ = tessera_ops::cost(&op, &metas, t.meta());
                    pool.push(t);
                }
                Err(e) => {
                    err += 1;
                    assert_eq!(g.len(), before, "round {round}: a failed {op} appended a node");
                    assert!(!e.to_string().is_empty());
                }
            }
        }
        let _ = g.to_dot();
        let _ = g.live_nodes();
    }
    // the mix must exercise both outcomes
    assert!(ok > 500 && err > 500, "ok {ok}, err {err}");
}

#[test]
fn cost_of_huge_but_valid_nodes_does_not_overflow() {
    // Every tensor here fits in memory terms, but 2*K*M*N flops, or the bytes of three tensors
    // of almost 2^63 bytes each, exceed u64: the cost model saturates instead of panicking.
    let mut g = Graph::new();
    let n = 1usize << 30;
    let w = leaf(&mut g, F32, [n, n, 1, 1]); // 2^62 bytes
    let x = leaf(&mut g, F32, [n, n, 1, 1]);
    let y = g.mul_mat(w, x).unwrap();
    let c = tessera_ops::cost(&Op::MulMat, &[w.meta(), x.meta()], y.meta());
    assert_eq!(c.flops, u64::MAX);
    assert_eq!(c.bytes, 3 << 62);
    let big = leaf(&mut g, F16, [1 << 31, (1 << 31) - 1, 1, 1]); // 2^63 - 2^32 bytes
    let s = g.add(big, big).unwrap();
    let c = tessera_ops::cost(&Op::Binary(BinaryOp::Add), &[big.meta(), big.meta()], s.meta());
    assert_eq!(c.bytes, u64::MAX);
    assert_eq!(c.flops, ((1u64 << 31) - 1) << 31);
}
