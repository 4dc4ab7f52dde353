//! The catalogue itself: size, unique labels, coverage of every op, deterministic data, and the
//! small cases evaluated on every judged backend (so `cargo test` covers test-ops).

use std::collections::HashSet;

use tessera_ops::{BinaryOp, Op, UnaryOp};
use tessera_test_ops::{Judged, Outcome, Selection, backends, catalogue, eval_case, op_names, perf_catalogue};

#[test]
fn catalogue_is_large_with_unique_labels() {
    let cases = catalogue();
    assert!(cases.len() >= 250, "only {} eval cases", cases.len());
    let mut seen = HashSet::new();
    for c in cases.iter().chain(&perf_catalogue()) {
        assert!(seen.insert(c.vars().to_string()), "duplicate label {}", c.vars());
        assert!(c.vars().starts_with(c.op()), "label {} does not start with its op {}", c.vars(), c.op());
    }
}

/// One instance of every `Op` variant. The match in `variant_name` is exhaustive on purpose: a new
/// variant fails to compile here until it is listed (and then this test asks for cases).
fn every_op() -> Vec<Op> {
    let mut ops = vec![
        Op::GetRows,
        Op::SetRows,
        Op::Cpy,
        Op::Cast(tessera_ops::DType::F16),
        Op::Cont,
        Op::Concat { dim: 0 },
        Op::Repeat { ne: [1; 4] },
        Op::View(tessera_ops::ViewParams { ne: [1; 4], nb: [4; 4], offset: 0 }),
        Op::Reshape { ne: [1; 4] },
        Op::Permute { axes: [0, 1, 2, 3] },
        Op::Transpose,
        Op::Bitcast(tessera_ops::DType::I32),
        Op::Scale(tessera_ops::ScaleParams { scale: 1.0, bias: 0.0 }),
        Op::Swiglu,
        Op::RmsNorm(tessera_ops::RmsNormParams { eps: 0.0 }),
        Op::SumRows,
        Op::Softmax(tessera_ops::SoftmaxParams { scale: 1.0 }),
        Op::Argmax,
        Op::MulMat,
        Op::MulMatId,
        Op::L2Norm { eps: 0.0 },
        Op::TopK { k: 1 },
        Op::Argsort(tessera_ops::SortOrder::Descending),
        Op::Quantize(tessera_ops::DType::Q8_0),
        Op::Dequantize,
        Op::RopeMulti(tessera_ops::RopeParams {
            n_rot: 2,
            freq_base: 1e4,
            pairing: tessera_ops::RopePairing::Neox,
            sections: None,
        }),
        Op::FlashAttnExt(tessera_ops::FlashAttnParams {
            scale: 1.0,
            softcap: 0.0,
            mask: false,
            paged: false,
            ragged: false,
            gate: false,
        }),
        Op::SsmConv,
        Op::SsmConvUpdate { silu: true, ragged: false },
        Op::GatedDeltaNet(tessera_ops::GatedDeltaNetParams {
            scale: 1.0,
            head_map: tessera_ops::HeadMap::Tiled,
            algo: tessera_ops::DeltaNetAlgo::Serial,
            ragged: false,
        }),
    ];
    ops.push(Op::Sample);
    let norm = tessera_ops::RmsNormParams { eps: 0.0 };
    ops.extend([
        Op::AddRmsNormMul(norm),
        Op::RmsNormMul(norm),
        Op::RmsNormMulRope(tessera_ops::RmsNormMulRopeParams {
            norm,
            rope: tessera_ops::RopeParams {
                n_rot: 2,
                freq_base: 1e4,
                pairing: tessera_ops::RopePairing::Neox,
                sections: None,
            },
        }),
        Op::GatedRmsNorm(norm),
        Op::SoftmaxTopK { k: 1 },
        Op::MoeWeights,
        Op::MoeRouter { k: 1 },
        Op::MulMatSwiglu,
        Op::MulMatIdSwiglu,
        Op::MulMatIdWeightedSum,
        Op::GatedDeltaNetFused(tessera_ops::GatedDeltaNetFusedParams {
            net: tessera_ops::GatedDeltaNetParams {
                scale: 1.0,
                head_map: tessera_ops::HeadMap::Tiled,
                algo: tessera_ops::DeltaNetAlgo::Serial,
                ragged: true,
            },
            eps: 1e-6,
        }),
    ]);
    let neg = tessera_ops::ElemInstr::Unary(UnaryOp::Neg, tessera_ops::ElemArg::Input(0));
    ops.push(Op::Elementwise(tessera_ops::ElemProgram::new(1, vec![neg]).expect("a valid program")));
    ops.extend(UnaryOp::ALL.map(Op::Unary));
    ops.extend(BinaryOp::ALL.map(Op::Binary));
    for op in &ops {
        variant_name(op);
    }
    ops
}

fn variant_name(op: &Op) -> &'static str {
    match op {
        Op::GetRows
        | Op::SetRows
        | Op::Cpy
        | Op::Cast(_)
        | Op::Cont
        | Op::Concat { .. }
        | Op::Repeat { .. }
        | Op::View(_)
        | Op::Reshape { .. }
        | Op::Permute { .. }
        | Op::Transpose
        | Op::Bitcast(_)
        | Op::Unary(_)
        | Op::Binary(_)
        | Op::Scale(_)
        | Op::Swiglu
        | Op::RmsNorm(_)
        | Op::SumRows
        | Op::Softmax(_)
        | Op::Argmax
        | Op::MulMat
        | Op::MulMatId
        | Op::L2Norm { .. }
        | Op::TopK { .. }
        | Op::Argsort(_)
        | Op::Quantize(_)
        | Op::Dequantize
        | Op::RopeMulti(_)
        | Op::FlashAttnExt(_)
        | Op::SsmConv
        | Op::SsmConvUpdate { .. }
        | Op::GatedDeltaNet(_)
        | Op::Sample
        | Op::AddRmsNormMul(_)
        | Op::RmsNormMul(_)
        | Op::RmsNormMulRope(_)
        | Op::GatedRmsNorm(_)
        | Op::GatedDeltaNetFused(_)
        | Op::SoftmaxTopK { .. }
        | Op::MoeWeights
        | Op::MoeRouter { .. }
        | Op::MulMatSwiglu
        | Op::MulMatIdSwiglu
        | Op::MulMatIdWeightedSum
        | Op::Elementwise(_) => op.name(),
    }
}

#[test]
fn every_op_has_eval_cases() {
    let cases = catalogue();
    let covered = op_names(&cases);
    for op in every_op() {
        assert!(covered.contains(&op.name()), "no eval case for {}", op.name());
    }
}

#[test]
fn every_case_builds_and_has_a_cost() {
    for c in catalogue().iter().chain(&perf_catalogue()) {
        let built = c.build().unwrap_or_else(|e| panic!("{}: {e}", c.vars()));
        assert!(!built.checked.is_empty(), "{}: nothing to compare", c.vars());
        assert!(c.bytes() > 0, "{}: zero bytes", c.vars());
    }
}

#[test]
fn input_data_is_deterministic() {
    for c in catalogue().iter().step_by(17) {
        let built = c.build().unwrap();
        assert_eq!(c.input_data(&built), c.input_data(&built), "{}", c.vars());
    }
}

#[test]
fn selection_by_op_and_substring() {
    let sel = Selection { ops: vec!["mul_mat".into()], filter: Some("type_a=f16".into()) };
    let picked = sel.apply(catalogue());
    assert!(!picked.is_empty());
    assert!(picked.iter().all(|c| c.op() == "mul_mat" && c.vars().contains("type_a=f16")));
}

/// Small cases (few input elements) on every judged backend: the same check as `eval`, cheap
/// enough for the test profile.
#[test]
fn small_cases_pass_on_every_judged_backend() {
    let small: Vec<_> = catalogue().into_iter().filter(|c| c.input_elements() <= 65_536).collect();
    assert!(small.len() >= 300, "only {} small cases", small.len());
    let mut failures = Vec::new();
    for entry in backends::registry() {
        let Some(judge) = entry.judge else { continue };
        let mut backend = match (entry.make)() {
            Ok(b) => b,
            Err(e) => {
                eprintln!("skipping backend {}: {e}", entry.name);
                continue;
            }
        };
        let mut judge = backends::make(judge).expect("judge is registered");
        for case in &small {
            let r = eval_case(case, backend.as_mut(), judge.as_mut());
            if r.outcome != Outcome::Passed {
                failures.push(format!("{} {}: {}", r.backend, r.label, r.reason()));
            }
        }
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}
