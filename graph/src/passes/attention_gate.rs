//! `attention_gate`: `mul(flash_attn_ext(..), sigmoid(gate))` (qwen35's attention output gate;
//! either operand order) becomes the attention with `gate` as its last input
//! (`FlashAttnParams::gate`). The attention kernels scale each output element as they write it,
//! so the gate takes no launch of its own and the ungated output is never written and read back.

use tessera_ops::{BinaryOp, DType, FlashAttnParams, Op, UnaryOp};

use super::Pass;
use super::pattern::Matcher;
use crate::graph::{Graph, NodeId};
use crate::rewrite::{FusedOutput, Fusion};

/// See the module doc.
pub struct AttentionGate;

impl Pass for AttentionGate {
    fn name(&self) -> &'static str {
        "attention_gate"
    }

    fn find(&self, g: &Graph) -> Vec<Fusion> {
        Matcher::new(g).fusions_at(&Op::Binary(BinaryOp::Mul), |m, mul| {
            let (a, b) = (m.input(mul, 0)?, m.input(mul, 1)?);
            gated(m, mul, a, b).or_else(|| gated(m, mul, b, a))
        })
    }
}

/// `mul = attn * sig` with `attn` an ungated flash_attn_ext and `sig = sigmoid(gate)`, each read
/// only by `mul`, `gate` f32 of the attention's shape (no broadcast).
fn gated(m: &Matcher<'_>, mul: NodeId, attn: NodeId, sig: NodeId) -> Option<Fusion> {
    let Op::FlashAttnExt(p) = m.op(attn)? else { return None };
    let gate = m.input(sig, 0)?;
    let ok = !p.gate
        && m.op(sig)? == &Op::Unary(UnaryOp::Sigmoid)
        && m.sole_user(attn) == Some(mul)
        && m.sole_user(sig) == Some(mul)
        && m.meta(gate).dtype == DType::F32
        && m.meta(gate).ne == m.meta(attn).ne
        && m.meta(mul).ne == m.meta(attn).ne;
    if !ok {
        return None;
    }
    let mut inputs = m.inputs(attn).to_vec();
    inputs.push(gate);
    Some(Fusion {
        nodes: vec![attn, sig, mul],
        op: Op::FlashAttnExt(FlashAttnParams { gate: true, ..*p }),
        inputs,
        outputs: vec![(mul, FusedOutput::Whole)],
        recomputes: vec![],
    })
}
