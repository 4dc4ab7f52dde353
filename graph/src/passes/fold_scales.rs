//! `fold_scales`: `scale(scale(x, s1, b1), s2, b2)` becomes `scale(x, s1 s2, b1 s2 + b2)`.
//!
//! The smallest complete pass, and the one docs/FUSION.md walks through: one pattern (a scale
//! whose only reader is another scale), one fused op of the existing vocabulary, one stand-in.
//! The fold rounds differently from the two steps (one multiply-add instead of two), within the
//! elementwise bounds test-ops judges scale by.

use tessera_ops::{Op, ScaleParams};

use super::Pass;
use super::pattern::Matcher;
use crate::graph::Graph;
use crate::rewrite::{FusedOutput, Fusion};

/// See the module doc.
pub struct FoldScales;

impl Pass for FoldScales {
    fn name(&self) -> &'static str {
        "fold_scales"
    }

    fn find(&self, g: &Graph) -> Vec<Fusion> {
        let m = Matcher::new(g);
        let mut found = Vec::new();
        for (first, op) in m.ops() {
            let Op::Scale(a) = op else { continue };
            let Some((second, Op::Scale(b))) = m.sole_user_op(first, |o| matches!(o, Op::Scale(_))) else {
                continue;
            };
            let folded = ScaleParams { scale: a.scale * b.scale, bias: a.bias * b.scale + b.bias };
            found.push(Fusion {
                nodes: vec![first, second],
                op: Op::Scale(folded),
                inputs: m.inputs(first).to_vec(),
                outputs: vec![(second, FusedOutput::Whole)],
                recomputes: vec![],
            });
        }
        found
    }
}
