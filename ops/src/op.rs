//! The op vocabulary: one enum, typed parameters, stable names.

use std::fmt;

use crate::DType;

/// Elementwise functions of one input.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum UnaryOp {
    /// `-x`
    Neg,
    /// `e^x`
    Exp,
    /// `x * sigmoid(x)`
    Silu,
    /// `1 / (1 + e^-x)`
    Sigmoid,
    /// `ln(1 + e^x)`
    Softplus,
}

impl UnaryOp {
    pub const ALL: [UnaryOp; 5] = [UnaryOp::Neg, UnaryOp::Exp, UnaryOp::Silu, UnaryOp::Sigmoid, UnaryOp::Softplus];

    pub const fn name(self) -> &'static str {
        match self {
            UnaryOp::Neg => "neg",
            UnaryOp::Exp => "exp",
            UnaryOp::Silu => "silu",
            UnaryOp::Sigmoid => "sigmoid",
            UnaryOp::Softplus => "softplus",
        }
    }
}

/// Elementwise functions of two inputs; the second broadcasts to the first (ggml's repeat rule).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
}

impl BinaryOp {
    pub const ALL: [BinaryOp; 4] = [BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Div];

    pub const fn name(self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "sub",
            BinaryOp::Mul => "mul",
            BinaryOp::Div => "div",
        }
    }
}

/// A strided window onto the source tensor's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ViewParams {
    /// Shape of the view, ggml order.
    pub ne: [usize; 4],
    /// Byte strides of the view; `nb[0]` must be the dtype's block size in bytes.
    pub nb: [usize; 4],
    /// Byte offset of the view's first element from the source's first element.
    pub offset: usize,
}

/// `y = x * scale + bias`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScaleParams {
    pub scale: f32,
    pub bias: f32,
}

/// Root-mean-square normalisation over `ne[0]`: `y = x / sqrt(mean(x^2) + eps)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RmsNormParams {
    pub eps: f32,
}

/// Softmax over `ne[0]` of `x * scale + mask` (the mask is an optional second input).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SoftmaxParams {
    pub scale: f32,
}

/// One operation in a graph. Inputs are positional; each variant documents them.
/// Semantics, shapes and tolerances of every op are in `docs/OPS.md`.
#[derive(Debug, Clone, PartialEq)]
pub enum Op {
    // ---- data movement ----
    /// `[src, ids]`: rows `ids[i, j, k]` of `src[:, :, j, k]`. Output f32 (i32 for i32 sources).
    GetRows,
    /// `[dst, src, ids]`: writes row `r` of `src[:, :, j, k]` to row `ids[r, j, k]` of `dst`, in
    /// place; the output is `dst`.
    SetRows,
    /// `[src, dst]`: copies `src` into `dst` element by element in logical order, converting the
    /// dtype, in place; the output is `dst`. Element counts must match, shapes need not.
    Cpy,
    /// `[src]`: a new contiguous tensor of the given dtype holding `src`'s values.
    Cast(DType),
    /// `[src]`: a contiguous copy of `src` (same dtype).
    Cont,
    /// `[a, b]`: `a` and `b` joined along dimension `dim`.
    Concat { dim: usize },
    /// `[src]`: `src` tiled to shape `ne` (each `ne[i]` a multiple of `src.ne[i]`).
    Repeat { ne: [usize; 4] },

    // ---- views: zero-copy, share the source's memory ----
    /// `[src]`: a strided window onto `src`.
    View(ViewParams),
    /// `[src]`: the same contiguous data with another shape of equal element count.
    Reshape { ne: [usize; 4] },
    /// `[src]`: dimension `i` of `src` becomes dimension `axes[i]` of the result (ggml's rule).
    Permute { axes: [usize; 4] },
    /// `[src]`: swaps dimensions 0 and 1.
    Transpose,

    // ---- elementwise ----
    /// `[x]`
    Unary(UnaryOp),
    /// `[a, b]`: `b` broadcasts to `a` (each `a.ne[i]` a multiple of `b.ne[i]`).
    Binary(BinaryOp),
    /// `[x]`: `x * scale + bias`.
    Scale(ScaleParams),
    /// `[gate, up]`: `silu(gate) * up`; or `[x]`: the first half of each row is the gate and the
    /// second half the up projection.
    Swiglu,

    // ---- normalisation and reductions (over ne[0]) ----
    /// `[x]`
    RmsNorm(RmsNormParams),
    /// `[x]`: sum of each row; output `[1, ne1, ne2, ne3]`.
    SumRows,
    /// `[x]` or `[x, mask]`.
    Softmax(SoftmaxParams),
    /// `[x]`: index of the largest element of each row (first on ties); output i32
    /// `[1, ne1, ne2, ne3]`.
    Argmax,

    // ---- matrix multiplication ----
    /// `[a, b]`: `a [K, M, A2, A3]` (weights) times `b [K, N, B2, B3]` (activations, f32) gives f32
    /// `[M, N, B2, B3]`: `out[m, n] = sum_k a[k, m] * b[k, n]`; `a` broadcasts over dims 2 and 3.
    MulMat,
}

impl Op {
    /// Stable lower-case name, used in errors, logs, DOT dumps and test-ops filters.
    pub fn name(&self) -> &'static str {
        match self {
            Op::GetRows => "get_rows",
            Op::SetRows => "set_rows",
            Op::Cpy => "cpy",
            Op::Cast(_) => "cast",
            Op::Cont => "cont",
            Op::Concat { .. } => "concat",
            Op::Repeat { .. } => "repeat",
            Op::View(_) => "view",
            Op::Reshape { .. } => "reshape",
            Op::Permute { .. } => "permute",
            Op::Transpose => "transpose",
            Op::Unary(u) => u.name(),
            Op::Binary(b) => b.name(),
            Op::Scale(_) => "scale",
            Op::Swiglu => "swiglu",
            Op::RmsNorm(_) => "rms_norm",
            Op::SumRows => "sum_rows",
            Op::Softmax(_) => "softmax",
            Op::Argmax => "argmax",
            Op::MulMat => "mul_mat",
        }
    }

    /// True for zero-copy views: the output shares its first input's memory and no backend
    /// computes anything for it.
    pub fn is_view(&self) -> bool {
        matches!(self, Op::View(_) | Op::Reshape { .. } | Op::Permute { .. } | Op::Transpose)
    }

    /// The input this op writes in place and whose memory its output is, if any.
    /// The executor gives the output the same storage as that input.
    pub fn writes_input(&self) -> Option<usize> {
        match self {
            Op::SetRows => Some(0),
            Op::Cpy => Some(1),
            _ => None,
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Op::Cast(d) => write!(f, "cast({d})"),
            Op::Concat { dim } => write!(f, "concat(dim={dim})"),
            Op::Repeat { ne } => write!(f, "repeat({ne:?})"),
            Op::View(v) => write!(f, "view({:?}, offset={})", v.ne, v.offset),
            Op::Reshape { ne } => write!(f, "reshape({ne:?})"),
            Op::Permute { axes } => write!(f, "permute({axes:?})"),
            Op::Scale(p) => write!(f, "scale(x{}, +{})", p.scale, p.bias),
            Op::RmsNorm(p) => write!(f, "rms_norm(eps={})", p.eps),
            Op::Softmax(p) => write!(f, "softmax(scale={})", p.scale),
            other => f.write_str(other.name()),
        }
    }
}
