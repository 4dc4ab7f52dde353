//! The memory planner on random graphs: the independent verifier (`plan::verify`) accepts every
//! plan (no two live values share bytes, the arena within 1.25x of the most bytes alive at once),
//! and running with shared memory gives bit for bit the outputs of running with every tensor in
//! bytes of its own.

use proptest::prelude::*;
use tessera_cpu::CpuBackend;
use tessera_graph::plan::{Plan, PlanOptions, verify};
use tessera_graph::{Backend, Graph, Refusing, Session, SessionOptions, Tensor, schedule};
use tessera_ops::DType;

/// One random op applied to earlier tensors (indices taken modulo what exists).
#[derive(Debug, Clone)]
enum Step {
    Silu(usize),
    Neg(usize),
    /// `a + b` when shapes agree, else `a + a`.
    Add(usize, usize),
    /// The first half of the rows, made contiguous.
    HalfRows(usize),
    Transpose(usize),
    SumRows(usize),
    /// `cpy(a, b)` into an earlier computed tensor of the same shape (an in-place write).
    CopyInto(usize, usize),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        any::<usize>().prop_map(Step::Silu),
        any::<usize>().prop_map(Step::Neg),
        (any::<usize>(), any::<usize>()).prop_map(|(a, b)| Step::Add(a, b)),
        any::<usize>().prop_map(Step::HalfRows),
        any::<usize>().prop_map(Step::Transpose),
        any::<usize>().prop_map(Step::SumRows),
        (any::<usize>(), any::<usize>()).prop_map(|(a, b)| Step::CopyInto(a, b)),
    ]
}

/// Builds the graph: two inputs, the steps, and the chosen outputs.
fn build(inputs: [(usize, usize); 2], steps: &[Step], outs: &[usize]) -> (Graph, Vec<Tensor>, Vec<Tensor>) {
    let mut g = Graph::new();
    let ins: Vec<Tensor> = inputs
        .iter()
        .enumerate()
        .map(|(i, &(a, b))| g.input(&format!("x{i}"), DType::F32, [a, b, 1, 1]).unwrap())
        .collect();
    let mut ts = ins.clone();
    let mut computed: Vec<Tensor> = Vec::new();
    // The storage each tensor writes: itself, or what a cpy wrote into.
    let mut groups: Vec<(Tensor, u32)> = ins.iter().map(|t| (*t, t.id().0)).collect();
    for s in steps {
        let pick = |i: usize| ts[i % ts.len()];
        let t = match *s {
            Step::Silu(a) => g.silu(pick(a)).unwrap(),
            Step::Neg(a) => g.neg(pick(a)).unwrap(),
            Step::Add(a, b) => {
                let (x, y) = (pick(a), pick(b));
                let y = if x.ne() == y.ne() { y } else { x };
                g.add(x, y).unwrap()
            }
            Step::HalfRows(a) => {
                let x = pick(a);
                let [n0, n1, ..] = x.ne();
                let rows = n1.div_ceil(2);
                let v = g.view(x, [n0, rows, 1, 1], x.meta().nb, 0).unwrap();
                g.cont(v).unwrap()
            }
            Step::Transpose(a) => {
                let t = g.transpose(pick(a)).unwrap();
                g.cont(t).unwrap()
            }
            Step::SumRows(a) => g.sum_rows(pick(a)).unwrap(),
            Step::CopyInto(a, b) => {
                let src = pick(a);
                // Not into the bytes `src` itself lives in (an aliased write, refused).
                let src_group = group_of(&groups, src);
                let same: Vec<Tensor> = computed
                    .iter()
                    .copied()
                    .filter(|c| c.ne() == src.ne() && c.meta().is_contiguous() && group_of(&groups, *c) != src_group)
                    .collect();
                if same.is_empty() {
                    g.silu(src).unwrap()
                } else {
                    let dst = same[b % same.len()];
                    let t = g.cpy(src, dst).unwrap();
                    groups.push((t, group_of(&groups, dst)));
                    t
                }
            }
        };
        if !groups.iter().any(|(x, _)| x.id() == t.id()) {
            groups.push((t, t.id().0));
        }
        ts.push(t);
        computed.push(t);
    }
    let outputs: Vec<Tensor> =
        if computed.is_empty() { Vec::new() } else { outs.iter().map(|&o| computed[o % computed.len()]).collect() };
    for &o in &outputs {
        g.mark_output(o).unwrap();
    }
    (g, ins, outputs)
}

fn group_of(groups: &[(Tensor, u32)], t: Tensor) -> u32 {
    groups.iter().find(|(x, _)| x.id() == t.id()).map_or(t.id().0, |(_, g)| *g)
}

/// The ops the first of two backends refuses in the scheduled runs.
const REFUSED: [&str; 3] = ["silu", "sum_rows", "cont"];

fn run(g: &Graph, ins: &[Tensor], outs: &[Tensor], keep: bool) -> Vec<Vec<f32>> {
    let mut be = CpuBackend::new();
    let opts = SessionOptions { keep_intermediates: keep, ..Default::default() };
    let s = Session::with_options(g, &mut be, opts).unwrap();
    fill_and_run(s, ins, outs)
}

/// On two backends, the first refusing [`REFUSED`].
fn run_scheduled(g: &Graph, ins: &[Tensor], outs: &[Tensor]) -> Vec<Vec<f32>> {
    let (mut first, mut second) = (Refusing::new(CpuBackend::new(), &REFUSED), CpuBackend::new());
    let s = Session::scheduled(g, vec![&mut first, &mut second], SessionOptions::default(), &[]).unwrap();
    fill_and_run(s, ins, outs)
}

fn fill_and_run(mut s: Session<'_, '_>, ins: &[Tensor], outs: &[Tensor]) -> Vec<Vec<f32>> {
    let live: Vec<(usize, Tensor)> =
        ins.iter().copied().enumerate().filter(|(_, x)| s.placement(*x).is_some()).collect();
    for (i, x) in live.iter().map(|(i, x)| (*i, x)) {
        let n = x.meta().nelements();
        let v: Vec<f32> = (0..n).map(|j| ((j * 37 + i * 11) % 17) as f32 / 8.0 - 1.0).collect();
        s.set_f32(*x, &v).unwrap();
    }
    s.run().unwrap();
    outs.iter().map(|o| s.get_f32(*o).unwrap()).collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn shared_memory_is_verified_and_computes_the_same(
        inputs in [(1usize..70, 1usize..9), (1usize..70, 1usize..9)],
        steps in prop::collection::vec(step(), 1..40),
        outs in prop::collection::vec(any::<usize>(), 1..4),
    ) {
        let (g, ins, outputs) = build(inputs, &steps, &outs);
        let plan = Plan::new(&g, PlanOptions::default());
        if let Err(why) = verify(&g, &plan, 1.25) {
            return Err(TestCaseError::fail(why));
        }
        prop_assert!(plan.stats.arena_bytes >= plan.stats.lower_bound_bytes);
        let kept = run(&g, &ins, &outputs, true);
        prop_assert_eq!(run(&g, &ins, &outputs, false), kept.clone());
        // spread over two backends: mirrors verified too, and the same outputs
        let (first, second) = (Refusing::new(CpuBackend::new(), &REFUSED), CpuBackend::new());
        let home = schedule::assign(&g, &[&first as &dyn Backend, &second]).unwrap();
        let plan = Plan::scheduled(&g, PlanOptions::default(), &home, 2);
        if let Err(why) = verify(&g, &plan, 1.25) {
            return Err(TestCaseError::fail(format!("scheduled: {why}")));
        }
        prop_assert_eq!(run_scheduled(&g, &ins, &outputs), kept);
    }
}

#[test]
fn an_intermediate_whose_memory_was_reused_cannot_be_read() {
    let mut g = Graph::new();
    let x = g.input("x", DType::F32, [64, 1, 1, 1]).unwrap();
    let a = g.silu(x).unwrap();
    let b = g.neg(a).unwrap();
    let c = g.silu(b).unwrap();
    g.mark_output(c).unwrap();
    let mut be = CpuBackend::new();
    let mut s = Session::new(&g, &mut be).unwrap();
    s.set_f32(x, &[0.5; 64]).unwrap();
    s.run().unwrap();
    let e = s.get_f32(a).unwrap_err();
    assert!(e.to_string().contains("mark it as an output"), "{e}");
    assert_eq!(s.get_f32(c).unwrap().len(), 64);
    assert_eq!(s.get_f32(x).unwrap(), vec![0.5; 64]);
}
