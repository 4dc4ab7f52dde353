//! [`ElemProgram`]: the straight-line program of `Op::Elementwise` (the generic elementwise
//! fusion, family "elemfuse"; docs/OPS.md, "Fused elementwise programs").
//!
//! A program is what a chain of elementwise ops computes at one output position: each
//! instruction is a unary function, a binary op or a scale of program inputs (`x0 .. x5`) or of
//! earlier results (`v0 ..`), and the last instruction's result is the output. It is data like
//! every op parameter: `Eq + Hash` with floats by their bits (through [`ScaleParams`]), so equal
//! programs compute the same thing bit for bit and a backend can cache one compiled kernel per
//! program. A program is valid by construction ([`ElemProgram::new`] checks it).

use std::fmt;

use crate::{BinaryOp, OpError, ScaleParams, UnaryOp};

/// Most inputs a program reads (the CUDA kernel takes each as a by-value descriptor).
pub const MAX_ELEM_INPUTS: usize = 6;

/// Most instructions in one program.
pub const MAX_ELEM_INSTRS: usize = 64;

/// An operand: a program input or the result of an earlier instruction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ElemArg {
    /// Input `i` of the op (`x{i}`).
    Input(u8),
    /// The result of instruction `k` (`v{k}`), `k` before the instruction that reads it.
    Value(u8),
}

/// One instruction: the same function as the op of the same name, on one element.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ElemInstr {
    Unary(UnaryOp, ElemArg),
    Binary(BinaryOp, ElemArg, ElemArg),
    /// `a * scale + bias`.
    Scale(ScaleParams, ElemArg),
}

impl ElemInstr {
    /// The operands, in order.
    pub fn args(&self) -> impl Iterator<Item = ElemArg> {
        let (a, b) = match *self {
            ElemInstr::Unary(_, a) | ElemInstr::Scale(_, a) => (a, None),
            ElemInstr::Binary(_, a, b) => (a, Some(b)),
        };
        std::iter::once(a).chain(b)
    }

    /// The name of the op this instruction computes (`add`, `sigmoid`, `scale`).
    pub fn name(&self) -> &'static str {
        match self {
            ElemInstr::Unary(u, _) => u.name(),
            ElemInstr::Binary(b, _, _) => b.name(),
            ElemInstr::Scale(..) => "scale",
        }
    }
}

/// A straight-line elementwise program over `n_inputs` f32 inputs (see the module doc).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ElemProgram {
    n_inputs: u8,
    instrs: Vec<ElemInstr>,
}

impl ElemProgram {
    /// A program over `n_inputs` inputs (1 to [`MAX_ELEM_INPUTS`]) computing `instrs` in order
    /// (1 to [`MAX_ELEM_INSTRS`]); the last one's result is the output. Refused: an operand that
    /// names an input past `n_inputs` or an instruction not before its reader, an input no
    /// instruction reads, a scale or bias that is not finite (scale's own rule).
    pub fn new(n_inputs: usize, instrs: Vec<ElemInstr>) -> Result<ElemProgram, OpError> {
        let bad = |why: String| Err(OpError::InvalidParam { op: "elementwise", why });
        if n_inputs == 0 || n_inputs > MAX_ELEM_INPUTS {
            return bad(format!("a program reads 1 to {MAX_ELEM_INPUTS} inputs, not {n_inputs}"));
        }
        if instrs.is_empty() || instrs.len() > MAX_ELEM_INSTRS {
            return bad(format!("a program has 1 to {MAX_ELEM_INSTRS} instructions, not {}", instrs.len()));
        }
        let mut read = [false; MAX_ELEM_INPUTS];
        for (k, ins) in instrs.iter().enumerate() {
            for a in ins.args() {
                match a {
                    ElemArg::Input(i) if (i as usize) < n_inputs => read[i as usize] = true,
                    ElemArg::Input(i) => return bad(format!("instruction {k} reads x{i} of {n_inputs} inputs")),
                    ElemArg::Value(v) if (v as usize) < k => {}
                    ElemArg::Value(v) => {
                        return bad(format!("instruction {k} reads v{v}, which is not computed before it"));
                    }
                }
            }
            if let ElemInstr::Scale(p, _) = ins
                && !(p.scale.is_finite() && p.bias.is_finite())
            {
                return bad(format!("instruction {k}: scale {} and bias {} must be finite", p.scale, p.bias));
            }
        }
        if let Some(i) = read[..n_inputs].iter().position(|r| !r) {
            return bad(format!("no instruction reads input x{i}"));
        }
        Ok(ElemProgram { n_inputs: n_inputs as u8, instrs })
    }

    /// How many inputs the op takes.
    pub fn n_inputs(&self) -> usize {
        self.n_inputs as usize
    }

    /// The instructions, in order; the last one's result is the output.
    pub fn instrs(&self) -> &[ElemInstr] {
        &self.instrs
    }

    /// Evaluates the program on one set of operand values of any type: `inputs[i]` is `x{i}`,
    /// `step(instr, operands)` computes one instruction. Returns the output.
    pub fn eval<T: Clone>(&self, inputs: &[T], mut step: impl FnMut(&ElemInstr, &[&T]) -> T) -> T {
        let mut values: Vec<T> = Vec::with_capacity(self.instrs.len());
        for ins in &self.instrs {
            let v = {
                let args: smallvec::SmallVec<[&T; 2]> = ins
                    .args()
                    .map(|a| match a {
                        ElemArg::Input(i) => &inputs[i as usize],
                        ElemArg::Value(k) => &values[k as usize],
                    })
                    .collect();
                step(ins, &args)
            };
            values.push(v);
        }
        values.pop().expect("a program has at least one instruction")
    }
}

impl fmt::Display for ElemArg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ElemArg::Input(i) => write!(f, "x{i}"),
            ElemArg::Value(k) => write!(f, "v{k}"),
        }
    }
}

/// `v0=add(x0,x1);v1=softplus(v0);v2=mul(v1,x2)`: compact, unique for a program (floats print
/// in full, `{:?}` of f32 round-trips), usable in test labels.
impl fmt::Display for ElemProgram {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (k, ins) in self.instrs.iter().enumerate() {
            if k > 0 {
                f.write_str(";")?;
            }
            match ins {
                ElemInstr::Unary(u, a) => write!(f, "v{k}={}({a})", u.name())?,
                ElemInstr::Binary(b, x, y) => write!(f, "v{k}={}({x},{y})", b.name())?,
                ElemInstr::Scale(p, a) => write!(f, "v{k}=scale({a},{:?},{:?})", p.scale, p.bias)?,
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn x(i: u8) -> ElemArg {
        ElemArg::Input(i)
    }

    #[test]
    fn programs_are_checked() {
        let add = ElemInstr::Binary(BinaryOp::Add, x(0), x(1));
        let p = ElemProgram::new(2, vec![add, ElemInstr::Unary(UnaryOp::Softplus, ElemArg::Value(0))]).unwrap();
        assert_eq!(p.to_string(), "v0=add(x0,x1);v1=softplus(v0)");
        assert_eq!(p.eval(&[1.0f64, 2.0], |i, a| if i.name() == "add" { a[0] + a[1] } else { -*a[0] }), -3.0);
        for (n, instrs) in [
            (0, vec![add]),
            (7, vec![add]),
            (2, vec![]),
            (1, vec![add]),                                                    // reads x1 of 1
            (3, vec![add]),                                                    // x2 unread
            (2, vec![add, ElemInstr::Unary(UnaryOp::Exp, ElemArg::Value(1))]), // reads itself
            (1, vec![ElemInstr::Scale(ScaleParams { scale: f32::NAN, bias: 0.0 }, x(0))]),
        ] {
            assert!(matches!(ElemProgram::new(n, instrs), Err(OpError::InvalidParam { .. })));
        }
        assert!(ElemProgram::new(1, vec![ElemInstr::Unary(UnaryOp::Neg, x(0)); MAX_ELEM_INSTRS + 1]).is_err());
    }

    #[test]
    fn equal_programs_hash_alike_and_floats_compare_by_bits() {
        use std::collections::HashSet;
        let s =
            |b: f32| ElemProgram::new(1, vec![ElemInstr::Scale(ScaleParams { scale: 1.0, bias: b }, x(0))]).unwrap();
        let set: HashSet<ElemProgram> = [s(0.0), s(0.0), s(-0.0)].into_iter().collect();
        assert_eq!(set.len(), 2);
    }
}
