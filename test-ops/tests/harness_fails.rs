//! The harness can fail: a backend that corrupts a value, writes NaN, writes outside its output,
//! or lacks an op is reported, with the reason.

use tessera_graph::{Backend, BackendError, BufferId, Task};
use tessera_ops::{Op, TensorMeta};
use tessera_test_ops::{Case, CaseResult, Judged, Outcome, backends, catalogue, eval_case};

/// What the faulty backend does after computing each task correctly.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Fault {
    /// Adds 10 to the first element of the output (or 1 to an i32).
    Corrupt,
    /// Writes NaN into the first element of the output.
    Nan,
    /// Writes 4 bytes just past the end of the output.
    Overrun,
    /// Writes 4 bytes just before the start of the output.
    Underrun,
    /// Claims not to support mul_mat.
    NoMulMat,
}

/// The CPU backend with a fault injected.
struct Faulty {
    inner: Box<dyn Backend>,
    fault: Fault,
}

impl Backend for Faulty {
    fn name(&self) -> &str {
        "faulty"
    }
    fn supports(&self, op: &Op, inputs: &[TensorMeta]) -> bool {
        !(self.fault == Fault::NoMulMat && *op == Op::MulMat) && self.inner.supports(op, inputs)
    }
    fn alloc(&mut self, bytes: usize) -> Result<BufferId, BackendError> {
        self.inner.alloc(bytes)
    }
    fn free(&mut self, buffer: BufferId) {
        self.inner.free(buffer)
    }
    fn size(&self, buffer: BufferId) -> Result<usize, BackendError> {
        self.inner.size(buffer)
    }
    fn write(&mut self, buffer: BufferId, offset: usize, data: &[u8]) -> Result<(), BackendError> {
        self.inner.write(buffer, offset, data)
    }
    fn read(&mut self, buffer: BufferId, offset: usize, out: &mut [u8]) -> Result<(), BackendError> {
        self.inner.read(buffer, offset, out)
    }
    fn compute(&mut self, tasks: &[Task<'_>]) -> Result<(), BackendError> {
        self.inner.compute(tasks)?;
        for task in tasks {
            let out = &task.output;
            let first = out.offset;
            match self.fault {
                Fault::Corrupt | Fault::Nan => {
                    let size = out.meta.dtype.block_bytes();
                    let mut bytes = vec![0; size];
                    self.inner.read(out.buffer, first, &mut bytes)?;
                    let x = tessera_ops::host::decode(out.meta.dtype, &bytes)[0];
                    let bad = match self.fault {
                        Fault::Nan => f64::NAN,
                        _ if out.meta.dtype.is_float() => x + 10.0,
                        _ => x + 1.0,
                    };
                    let bytes = tessera_ops::host::encode(out.meta.dtype, &[bad]);
                    self.inner.write(out.buffer, first, &bytes)?;
                }
                Fault::Overrun => self.inner.write(out.buffer, first + out.meta.span_bytes(), &[0x55; 4])?,
                Fault::Underrun => self.inner.write(out.buffer, first - 4, &[0x55; 4])?,
                Fault::NoMulMat => {}
            }
        }
        Ok(())
    }
}

fn case(label: &str) -> Case {
    catalogue().into_iter().find(|c| c.vars() == label).unwrap_or_else(|| panic!("no case {label}"))
}

fn run_faulty(label: &str, fault: Fault) -> CaseResult {
    let mut backend = Faulty { inner: backends::make("cpu").expect("cpu is registered"), fault };
    let mut judge = backends::make("ref").expect("ref is registered");
    eval_case(&case(label), &mut backend, judge.as_mut())
}

const ADD: &str = "add(type_a=f32,type_b=f32,ne_a=[33,5,2,3],ne_b=[33,1,1,1])";
const MUL_MAT: &str = "mul_mat(type_a=f16,m=33,n=7,k=67,bs=[1,1],nr=[1,1])";
const ARGMAX: &str = "argmax(type=f32,ne=[7,3,1,1])";

#[test]
fn the_healthy_backend_passes_these_cases() {
    for label in [ADD, MUL_MAT, ARGMAX] {
        let mut backend = backends::make("cpu").unwrap();
        let mut judge = backends::make("ref").unwrap();
        let r = eval_case(&case(label), backend.as_mut(), judge.as_mut());
        assert!(r.passed(), "{label}: {}", r.reason());
    }
}

#[test]
fn a_corrupted_value_fails_on_nmse() {
    for label in [ADD, MUL_MAT] {
        let r = run_faulty(label, Fault::Corrupt);
        assert!(r.failed(), "{label} passed with a corrupted value");
        assert!(r.reason().contains("nmse"), "{label}: {}", r.reason());
        assert!(r.max_nmse() > r.bound());
    }
}

#[test]
fn a_wrong_integer_fails_exactly() {
    let r = run_faulty(ARGMAX, Fault::Corrupt);
    assert!(r.failed());
    assert!(r.reason().contains("integer values differ"), "{}", r.reason());
}

#[test]
fn nan_output_is_caught() {
    let r = run_faulty(MUL_MAT, Fault::Nan);
    assert!(r.failed());
    assert!(r.reason().contains("non-finite"), "{}", r.reason());
}

#[test]
fn writes_outside_the_output_hit_the_guards() {
    for (fault, side) in [(Fault::Overrun, "after"), (Fault::Underrun, "before")] {
        for label in [ADD, MUL_MAT, ARGMAX] {
            let r = run_faulty(label, fault);
            assert!(r.failed(), "{label}: {fault:?} not caught");
            let why = r.reason();
            assert!(why.contains("guard bytes") && why.contains(side), "{label}: {why}");
        }
    }
}

#[test]
fn unsupported_ops_are_reported_not_passed() {
    let r = run_faulty(MUL_MAT, Fault::NoMulMat);
    assert!(matches!(r.outcome, Outcome::Unsupported(_)), "{:?}", r.outcome);
    assert!(!r.passed() && !r.failed());
}
