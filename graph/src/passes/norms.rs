//! The normalisation fusions of the hybrid models' blocks:
//!
//! - `add_rms_norm_mul`: `s = a + b; h = rms_norm(s) * w`, where `s` is also read later (the
//!   residual stream), becomes one `add_rms_norm_mul(a, b, w)` whose two planes stand in for `s`
//!   and `h` (the pre-norm of every attention, DeltaNet and FFN block after the first);
//! - `gated_rms_norm`: `rms_norm(x) * w * silu(z)` (the DeltaNet output gate);
//! - `rms_norm_mul`: `rms_norm(x) * w` (the first block's norm, the q/k norms of attention);
//! - `rms_norm_mul_rope`: `rope_multi(rms_norm_mul(x, w), positions)` (attention's q and k, per
//!   head: normed, weighted, rotated).
//!
//! They run in that order, so each matches what the one before left.

use tessera_ops::{BinaryOp, Op, RmsNormMulRopeParams, RmsNormParams, UnaryOp, ViewParams};

use super::Pass;
use super::pattern::Matcher;
use crate::graph::{Graph, NodeId};
use crate::rewrite::{FusedOutput, Fusion};

const MUL: Op = Op::Binary(BinaryOp::Mul);

/// `r = rms_norm(x)` read only by `m = mul(r, w)`: `(r, m, w, params)`.
fn norm_then_mul(m: &Matcher<'_>, r: NodeId) -> Option<(NodeId, NodeId, RmsNormParams)> {
    let Op::RmsNorm(p) = m.op(r)? else { return None };
    let (mul, _) = m.sole_user_op(r, |o| *o == MUL)?;
    let w = m.input(mul, 1)?;
    (m.input(mul, 0)? == r && w != r).then_some((mul, w, *p))
}

/// See the module doc.
pub struct AddRmsNormMul;

impl Pass for AddRmsNormMul {
    fn name(&self) -> &'static str {
        "add_rms_norm_mul"
    }

    fn find(&self, g: &Graph) -> Vec<Fusion> {
        let m = Matcher::new(g);
        let mut found = Vec::new();
        for (s, op) in m.ops() {
            if *op != Op::Binary(BinaryOp::Add) {
                continue;
            }
            let [e, n, 1, 1] = m.meta(s).ne else { continue };
            // Among the sum's readers, a norm whose only reader multiplies it by a weight.
            let Some((r, mul, w, p)) = m.users(s).find_map(|r| norm_then_mul(&m, r).map(|(mul, w, p)| (r, mul, w, p)))
            else {
                continue;
            };
            let plane = |k: usize| {
                let nb = [4, 4 * e, 4 * e * n, 4 * e * n];
                FusedOutput::View(ViewParams { ne: [e, n, 1, 1], nb, offset: k * 4 * e * n })
            };
            let mut outputs = vec![(mul, plane(1))];
            if m.users(s).any(|u| u != r) || g.is_output(s) {
                outputs.push((s, plane(0)));
            }
            found.push(Fusion {
                nodes: vec![s, r, mul],
                op: Op::AddRmsNormMul(p),
                inputs: vec![m.input(s, 0).expect("add has two inputs"), m.input(s, 1).expect("add has two inputs"), w],
                outputs,
                recomputes: vec![],
            });
        }
        found
    }
}

/// See the module doc.
pub struct GatedRmsNorm;

impl Pass for GatedRmsNorm {
    fn name(&self) -> &'static str {
        "gated_rms_norm"
    }

    fn find(&self, g: &Graph) -> Vec<Fusion> {
        let m = Matcher::new(g);
        let mut found = Vec::new();
        for (r, _) in m.ops() {
            let Some((m1, w, p)) = norm_then_mul(&m, r) else { continue };
            // m2 = m1 * silu(z) (either order), silu(z) read only there.
            let Some((m2, _)) = m.sole_user_op(m1, |o| *o == MUL) else { continue };
            let other = match (m.input(m2, 0), m.input(m2, 1)) {
                (Some(a), Some(b)) if a == m1 => b,
                (Some(a), Some(b)) if b == m1 => a,
                _ => continue,
            };
            if m.op(other) != Some(&Op::Unary(UnaryOp::Silu)) || m.sole_user(other) != Some(m2) {
                continue;
            }
            let z = m.input(other, 0).expect("silu has one input");
            found.push(Fusion {
                nodes: vec![r, m1, other, m2],
                op: Op::GatedRmsNorm(p),
                inputs: vec![m.input(r, 0).expect("rms_norm has one input"), w, z],
                outputs: vec![(m2, FusedOutput::Whole)],
                recomputes: vec![],
            });
        }
        found
    }
}

/// See the module doc.
pub struct RmsNormMul;

impl Pass for RmsNormMul {
    fn name(&self) -> &'static str {
        "rms_norm_mul"
    }

    fn find(&self, g: &Graph) -> Vec<Fusion> {
        let m = Matcher::new(g);
        m.ops()
            .filter_map(|(r, _)| {
                let (mul, w, p) = norm_then_mul(&m, r)?;
                Some(Fusion {
                    nodes: vec![r, mul],
                    op: Op::RmsNormMul(p),
                    inputs: vec![m.input(r, 0)?, w],
                    outputs: vec![(mul, FusedOutput::Whole)],
                    recomputes: vec![],
                })
            })
            .collect()
    }
}

/// See the module doc: an `rms_norm_mul` whose only reader is a `rope_multi` of it (input 0).
pub struct RmsNormMulRope;

impl Pass for RmsNormMulRope {
    fn name(&self) -> &'static str {
        "rms_norm_mul_rope"
    }

    fn find(&self, g: &Graph) -> Vec<Fusion> {
        let m = Matcher::new(g);
        m.ops()
            .filter_map(|(nm, op)| {
                let Op::RmsNormMul(norm) = op else { return None };
                let (rope, Op::RopeMulti(rp)) = m.sole_user_op(nm, |o| matches!(o, Op::RopeMulti(_)))? else {
                    return None;
                };
                // The norm is the rotated tensor, not the positions.
                if m.input(rope, 0)? != nm {
                    return None;
                }
                Some(Fusion {
                    nodes: vec![nm, rope],
                    op: Op::RmsNormMulRope(RmsNormMulRopeParams { norm: *norm, rope: *rp }),
                    inputs: vec![m.input(nm, 0)?, m.input(nm, 1)?, m.input(rope, 1)?],
                    outputs: vec![(rope, FusedOutput::Whole)],
                    recomputes: vec![],
                })
            })
            .collect()
    }
}
