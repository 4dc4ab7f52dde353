//! `elementwise` (issue 21, the generic elementwise fusion): programs of unary / binary / scale
//! instructions judged like every op (the CPU by the f64 reference, the composition of the
//! replaced ops; other backends by the CPU).
//!
//! - The model's chains (the DeltaNet decay, the attention and shared-expert gates) at the
//!   35B-A3B sizes.
//! - Seeded random programs of 2 to 6 instructions over every unary and binary op and scale, on
//!   1 to 6 inputs that broadcast in every dimension (rows, columns, scalars, tiled `ne0`), some
//!   strided (transposed, dims swapped, windows of wider tensors), so both CUDA kernels (the
//!   float4 one for contiguous inputs repeating along the flat index, the row one otherwise) run.
//!   `exp` reads only inputs and `div` divides only by inputs drawn in [0.5, 1.5), so no value
//!   overflows and no quotient is ill-conditioned.
//! - Perf: the model's chains at 1 / 32 / 512 tokens, fused next to the unfused ops.

use tessera_graph::{Graph, Tensor};
use tessera_ops::{BinaryOp, ElemArg, ElemInstr, ElemProgram, ScaleParams, UnaryOp};

use super::{F32, sh};
use crate::case::{Case, Init, InputSpec as In, Layout};

const NAMES: [&str; 6] = ["x0", "x1", "x2", "x3", "x4", "x5"];

pub(super) fn cases(out: &mut Vec<Case>) {
    model_chains(out);
    random_programs(out);
}

/// `mul(softplus(add(alpha, dt_bias)), a)`: the DeltaNet decay, `[H]` vectors against `[H, n]`.
fn decay() -> ElemProgram {
    use ElemArg::{Input as X, Value as V};
    let instrs = vec![
        ElemInstr::Binary(BinaryOp::Add, X(0), X(1)),
        ElemInstr::Unary(UnaryOp::Softplus, V(0)),
        ElemInstr::Binary(BinaryOp::Mul, V(1), X(2)),
    ];
    ElemProgram::new(3, instrs).expect("valid")
}

/// `mul(o, sigmoid(gate))`: the attention output gate.
fn attn_gate() -> ElemProgram {
    use ElemArg::{Input as X, Value as V};
    let instrs = vec![ElemInstr::Unary(UnaryOp::Sigmoid, X(1)), ElemInstr::Binary(BinaryOp::Mul, X(0), V(0))];
    ElemProgram::new(2, instrs).expect("valid")
}

/// `add(moe, mul(sh, sigmoid(gate)))`: the shared expert gated by one logit per token.
fn shared_gate() -> ElemProgram {
    use ElemArg::{Input as X, Value as V};
    let instrs = vec![
        ElemInstr::Unary(UnaryOp::Sigmoid, X(2)),
        ElemInstr::Binary(BinaryOp::Mul, X(1), V(0)),
        ElemInstr::Binary(BinaryOp::Add, X(0), V(1)),
    ];
    ElemProgram::new(3, instrs).expect("valid")
}

/// The model chains' programs and input shapes at `n` tokens (35B-A3B: 32 value heads, 16
/// attention heads of 256, n_embd 2048).
fn chain_specs(n: usize) -> [(&'static str, ElemProgram, Vec<[usize; 4]>); 3] {
    [
        ("decay", decay(), vec![[32, n, 1, 1], [32, 1, 1, 1], [32, 1, 1, 1]]),
        ("attn_gate", attn_gate(), vec![[4096, n, 1, 1], [4096, n, 1, 1]]),
        ("shared_gate", shared_gate(), vec![[2048, n, 1, 1], [2048, n, 1, 1], [1, n, 1, 1]]),
    ]
}

fn model_chains(out: &mut Vec<Case>) {
    for n in [1, 7] {
        for (name, p, shapes) in chain_specs(n) {
            out.push(case(&format!("{name},"), p, &shapes, &vec![Layout::Contiguous; shapes.len()], &[]));
        }
    }
    // The attention gate reads its gate as a window of the joint q+gate projection.
    let (_, p, shapes) = chain_specs(3).into_iter().nth(1).expect("three chains");
    out.push(case("attn_gate,", p, &shapes, &[Layout::Contiguous, Layout::WINDOW], &[]));
}

/// A case running `p` on inputs of `shapes` (as the op sees them) and `layouts`; inputs in
/// `divisors` are drawn in [0.5, 1.5), the others in [-2, 2).
fn case(what: &str, p: ElemProgram, shapes: &[[usize; 4]], layouts: &[Layout], divisors: &[usize]) -> Case {
    let inputs = shapes
        .iter()
        .zip(layouts)
        .enumerate()
        .map(|(i, (&ne, &layout))| {
            let init = if divisors.contains(&i) { Init::POSITIVE } else { Init::Uniform { lo: -2.0, hi: 2.0 } };
            In::new(NAMES[i], F32, ne).layout(layout).init(init)
        })
        .collect();
    let shapes: Vec<String> = shapes.iter().map(|&s| sh(s).to_string()).collect();
    let label = format!("{what}ne=[{}],prog={p}", shapes.join(";"));
    Case::new("elementwise", label, inputs, move |g, x| g.elementwise(p.clone(), x))
}

/// xorshift64*: the programs are data of the catalogue, the same on every run.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 33) as usize % n
    }
}

/// A random chain of `n_instrs` instructions (plus one per input left unread) over `n_inputs`
/// inputs, starting with unary op `first_unary`; returns it and the inputs it divides by.
fn random_program(rng: &mut Rng, n_inputs: usize, n_instrs: usize, first_unary: usize) -> (ElemProgram, Vec<usize>) {
    let mut instrs: Vec<ElemInstr> = Vec::new();
    let mut divisors = Vec::new();
    let pick = |rng: &mut Rng, k: usize| {
        let i = rng.below(n_inputs + k);
        if i < n_inputs { ElemArg::Input(i as u8) } else { ElemArg::Value((i - n_inputs) as u8) }
    };
    for k in 0..n_instrs {
        // Each instruction reads the one before (so the output depends on every instruction) and
        // any input or earlier result.
        let a = if k == 0 { ElemArg::Input(rng.below(n_inputs) as u8) } else { ElemArg::Value(k as u8 - 1) };
        // The first instruction of each program cycles through the unary ops, so every one runs.
        let kind = if k == 0 { 0 } else { rng.below(3) };
        let ins = match kind {
            0 => {
                let u = if k == 0 { UnaryOp::ALL[first_unary % 5] } else { UnaryOp::ALL[rng.below(5)] };
                let u = if u == UnaryOp::Exp && !matches!(a, ElemArg::Input(_)) { UnaryOp::Silu } else { u };
                ElemInstr::Unary(u, a)
            }
            1 => {
                let op = BinaryOp::ALL[rng.below(4)];
                if op == BinaryOp::Div {
                    let d = rng.below(n_inputs);
                    divisors.push(d);
                    ElemInstr::Binary(op, a, ElemArg::Input(d as u8))
                } else {
                    // Not `a` itself: `a - a` would make the rest of the chain zero.
                    let b = pick(rng, k);
                    let b = if b == a { ElemArg::Input(rng.below(n_inputs) as u8) } else { b };
                    ElemInstr::Binary(op, a, b)
                }
            }
            _ => {
                let (s, b) = [(0.5, 0.0), (-1.5, 0.25), (2.0, -1.0), (0.0883883, 0.0)][rng.below(4)];
                ElemInstr::Scale(ScaleParams { scale: s, bias: b }, a)
            }
        };
        instrs.push(ins);
    }
    for i in 0..n_inputs as u8 {
        if !instrs.iter().any(|x| x.args().any(|a| a == ElemArg::Input(i))) {
            let last = ElemArg::Value((instrs.len() - 1) as u8);
            let op = BinaryOp::ALL[rng.below(3)]; // add, sub or mul
            instrs.push(ElemInstr::Binary(op, last, ElemArg::Input(i)));
        }
    }
    (ElemProgram::new(n_inputs, instrs).expect("a valid program"), divisors)
}

fn random_programs(out: &mut Vec<Case>) {
    use Layout::Contiguous as C;
    const T: Layout = Layout::TRANSPOSED;
    const W: Layout = Layout::WINDOW;
    const S: Layout = Layout::SWAP12;
    // (input shapes, layouts): the output is the per-dimension largest.
    let sets: [(&[[usize; 4]], &[Layout]); 8] = [
        (&[[67, 3, 1, 1]], &[C]),
        (&[[33, 5, 2, 1], [33, 5, 2, 1]], &[C, T]),
        (&[[64, 8, 1, 1], [64, 1, 1, 1], [1, 1, 1, 1]], &[C, C, C]),
        (&[[64, 8, 2, 1], [64, 8, 1, 1], [16, 1, 1, 1], [1, 8, 2, 1]], &[C, C, C, C]),
        (&[[1, 4, 3, 2], [7, 1, 1, 1], [7, 4, 1, 2], [1, 1, 3, 1], [7, 4, 3, 2]], &[C, C, S, C, W]),
        (
            &[[33, 4, 2, 1], [33, 1, 2, 1], [33, 4, 2, 1], [11, 4, 1, 1], [1, 4, 2, 1], [33, 4, 2, 1]],
            &[W, C, S, C, T, C],
        ),
        (&[[128, 16, 1, 1], [128, 16, 1, 1], [1, 16, 1, 1], [128, 1, 1, 1]], &[C, C, C, C]),
        (&[[1, 1, 1, 1], [1, 1, 1, 1]], &[C, C]),
    ];
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut count = 0;
    for (shapes, layouts) in sets {
        for depth in 2..=6 {
            let (p, divisors) = random_program(&mut rng, shapes.len(), depth, count);
            count += 1;
            out.push(case("", p, shapes, layouts, &divisors));
        }
    }
}

/// The model chains at 1, 32 and 512 tokens, the fused op next to the ops it replaces.
pub(super) fn perf_cases() -> Vec<Case> {
    let mut out = Vec::new();
    for n in [1, 32, 512] {
        for (name, p, shapes) in chain_specs(n) {
            let inputs: Vec<In> = shapes.iter().enumerate().map(|(i, &ne)| In::new(NAMES[i], F32, ne)).collect();
            for fused in [true, false] {
                let kind = if fused { "fused" } else { "unfused" };
                let p = p.clone();
                let build = move |g: &mut Graph, x: &[Tensor]| {
                    if fused { g.elementwise(p.clone(), x) } else { g.elementwise_unfused(&p, x) }
                };
                let label = format_args!("{name},{kind},ne={},n_tokens={n}", sh(shapes[0]));
                out.push(Case::new("elementwise", label, inputs.clone(), build));
            }
        }
    }
    out
}
