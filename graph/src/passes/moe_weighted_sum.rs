//! The routed experts' combine, as the model builder writes it after the down projection:
//!
//! ```text
//! ex  = mul_mat_id(experts, a, ids)       [N, k, n]
//! ex  = mul(ex, w)                        w: the router weights [1, k, n]
//! s   = transpose(ex)                     [k, N, n]      mul_mat_id_weighted_sum(experts, a, ids, w)
//! s   = sum_rows(s)                       [1, N, n]      -> [N, n]
//! out = reshape(s, [N, n])
//! ```
//!
//! Each intermediate must be read only by the next step (and not be a graph output): the
//! weighted expert outputs are never stored.

use tessera_ops::{BinaryOp, DType, Op};

use super::Pass;
use super::pattern::Matcher;
use crate::graph::{Graph, NodeId};
use crate::rewrite::{FusedOutput, Fusion};

/// See the module doc.
pub struct MoeWeightedSum;

impl Pass for MoeWeightedSum {
    fn name(&self) -> &'static str {
        "moe_weighted_sum"
    }

    fn find(&self, g: &Graph) -> Vec<Fusion> {
        Matcher::new(g).fusions_at(&Op::MulMatId, combine)
    }
}

/// The chain from `mmid = mul_mat_id(experts, a, ids)` to the reshaped sum over the slots.
fn combine(m: &Matcher<'_>, mmid: NodeId) -> Option<Fusion> {
    let [n_out, k, n, 1] = m.meta(mmid).ne else { return None };
    let mul = m.only_reader(mmid)?;
    if m.op(mul)? != &Op::Binary(BinaryOp::Mul) || m.input(mul, 0)? != mmid {
        return None;
    }
    let w = m.input(mul, 1)?;
    if m.meta(w).ne != [1, k, n, 1] || m.meta(w).dtype != DType::F32 {
        return None;
    }
    let tr = m.only_reader(mul)?;
    if m.op(tr)? != &Op::Transpose {
        return None;
    }
    let sum = m.only_reader(tr)?;
    if m.op(sum)? != &Op::SumRows || m.meta(sum).ne != [1, n_out, n, 1] {
        return None;
    }
    let out = m.only_reader(sum)?;
    if !matches!(m.op(out)?, Op::Reshape { .. }) || m.meta(out).ne != [n_out, n, 1, 1] {
        return None;
    }
    let (experts, a, ids) = (m.input(mmid, 0)?, m.input(mmid, 1)?, m.input(mmid, 2)?);
    let inputs = vec![experts, a, ids, w];
    let metas: Vec<_> = inputs.iter().map(|&i| m.meta(i)).collect();
    tessera_ops::infer(&Op::MulMatIdWeightedSum, &metas).ok()?;
    Some(Fusion {
        nodes: vec![mmid, mul, tr, sum, out],
        op: Op::MulMatIdWeightedSum,
        inputs,
        outputs: vec![(out, FusedOutput::Whole)],
        recomputes: Vec::new(),
    })
}
