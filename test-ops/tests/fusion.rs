//! Fusion mode on the CPU: the `fusion` subcommand passes (every pass of the standard pipeline on
//! its cases and near-misses, the models' step graphs), every pass has a generator with both
//! kinds of cases, and the mode can fail: a pass without a generator, a pass that fuses too
//! little, and one whose rewrite computes something else are all reported.

use std::collections::HashSet;
use std::process::Command;

use tessera_graph::passes::{FoldScales, Pass, Pipeline, standard};
use tessera_graph::{Fusion, Graph};
use tessera_ops::{Op, ScaleParams};
use tessera_test_ops::fusion::{FusionCase, check_fusion_case, generator_gaps, only, pass_generators};
use tessera_test_ops::{Judged, backends};

fn tessera_test_ops(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tessera-test-ops")).args(args).output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned())
}

#[test]
fn the_fusion_mode_passes_on_the_cpu() {
    let (ok, stdout) = tessera_test_ops(&["fusion", "--backend", "cpu"]);
    let last = stdout.lines().last().unwrap_or("");
    assert!(ok && last.ends_with(" passed, 0 failed"), "{stdout}");
    let passed: usize = last.split(' ').next().unwrap().parse().unwrap();
    assert!(passed >= 300, "only {passed} cases: {stdout}");
    // Every pass and the models have their line in the summary.
    for (pass, _) in standard().passes() {
        assert!(stdout.lines().any(|l| l.trim_start().starts_with(pass) && l.ends_with("ok")), "{pass}: {stdout}");
    }
    assert!(stdout.lines().any(|l| l.trim_start().starts_with("models ")), "{stdout}");
}

#[test]
fn selections_and_bad_arguments() {
    let (ok, stdout) = tessera_test_ops(&["fusion", "--backend", "cpu", "--pass", "fold_scales", "--filter", "miss="]);
    assert!(ok, "{stdout}");
    // Only fold_scales' near-misses (their labels hold `miss=`), no model: --pass and --filter.
    let header = stdout.lines().find(|l| l.starts_with("== cpu: ")).unwrap_or("");
    let n: usize = header.trim_start_matches("== cpu: ").split(' ').next().unwrap_or("").parse().unwrap_or(0);
    let misses = pass_generators().into_iter().find(|g| g.pass == "fold_scales").map(|g| (g.cases)()).unwrap();
    let misses = misses.iter().filter(|c| c.vars().contains("miss=")).count();
    assert!(n > 0 && n == misses && header.ends_with(", 0 model cases"), "{stdout}");
    let (ok, _) = tessera_test_ops(&["fusion", "--pass", "no_such_pass"]);
    assert!(!ok);
    let (ok, _) = tessera_test_ops(&["fusion", "--backend", "no_such_backend"]);
    assert!(!ok);
}

#[test]
fn every_pass_has_a_generator_with_matches_and_near_misses() {
    assert_eq!(generator_gaps(&standard()), Vec::<String>::new());
    let mut labels = HashSet::new();
    for g in pass_generators() {
        let cases = (g.cases)();
        assert!(cases.iter().any(|c| c.expected() > 0), "{}: no case the pass must fuse", g.pass);
        assert!(cases.iter().any(|c| c.expected() == 0), "{}: no near-miss", g.pass);
        for c in &cases {
            assert_eq!(c.pass(), g.pass);
            assert!(labels.insert(c.vars().to_string()), "duplicate label {}", c.vars());
        }
    }
}

/// A pass named like a real one, for the harness to catch.
struct Impostor {
    name: &'static str,
    /// `false`: finds nothing; `true`: folds two scales as `fold_scales` does, bias off by one.
    wrong: bool,
}

impl Pass for Impostor {
    fn name(&self) -> &'static str {
        self.name
    }

    fn find(&self, g: &Graph) -> Vec<Fusion> {
        if !self.wrong {
            return Vec::new();
        }
        let mut found = FoldScales.find(g);
        for f in &mut found {
            if let Op::Scale(p) = &mut f.op {
                *p = ScaleParams { scale: p.scale, bias: p.bias + 1.0 };
            }
        }
        found
    }
}

fn fold_cases() -> Vec<FusionCase> {
    let g = pass_generators().into_iter().find(|g| g.pass == "fold_scales").unwrap();
    (g.cases)()
}

#[test]
fn a_missing_generator_a_missed_fusion_and_a_wrong_rewrite_fail() {
    let p = Pipeline::new().with(FoldScales).with(Impostor { name: "brand_new", wrong: false });
    let gaps = generator_gaps(&p);
    assert!(gaps.iter().any(|g| g.contains("`brand_new` has no generator")), "{gaps:?}");
    assert!(gaps.iter().any(|g| g.contains("`rms_norm_mul`, which is not a pass")), "{gaps:?}");

    let mut cpu = backends::make("cpu").unwrap();
    let cases = fold_cases();
    let (fuses, misses): (Vec<&FusionCase>, Vec<&FusionCase>) = cases.iter().partition(|c| c.expected() > 0);
    let real = only("fold_scales").unwrap();
    let lazy = Pipeline::new().with(Impostor { name: "fold_scales", wrong: false });
    let wrong = Pipeline::new().with(Impostor { name: "fold_scales", wrong: true });
    for c in &fuses {
        let r = check_fusion_case(c, &real, cpu.as_mut());
        assert!(r.passed(), "{}: {}", c.vars(), r.reason());
        let r = check_fusion_case(c, &lazy, cpu.as_mut());
        assert!(r.failed() && r.reason().contains("applied 0 fusions"), "{}: {}", c.vars(), r.reason());
        let r = check_fusion_case(c, &wrong, cpu.as_mut());
        assert!(r.failed() && r.reason().contains("nmse"), "{}: {}", c.vars(), r.reason());
    }
    for c in &misses {
        let r = check_fusion_case(c, &lazy, cpu.as_mut());
        assert!(r.passed(), "{}: {}", c.vars(), r.reason());
    }
}
