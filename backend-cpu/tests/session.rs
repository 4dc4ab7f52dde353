//! Session-level behaviour on the f64 reference backend: errors from setting, running and reading
//! a placed graph; guard bytes catching a kernel that writes outside its output; in-place writes
//! whose source overlaps the destination; and where views and in-place results are placed.

use tessera_cpu::{CpuBackend, ReferenceBackend};
use tessera_graph::{
    Backend, BackendError, BufferId, ExecError, Graph, GraphError, Session, SessionOptions, Task, Tensor,
};
use tessera_ops::{DType, KernelError, Op, TensorMeta};

const F32: DType = DType::F32;
const I32: DType = DType::I32;

/// What the wrapper does besides delegating to the reference backend.
#[derive(Clone, Copy, PartialEq)]
enum Misbehave {
    Nothing,
    /// After computing, write one byte just past the last task's output span.
    WriteAfter,
    /// After computing, write one byte just before the last task's output.
    WriteBefore,
    /// Claim not to support this op.
    Refuse(&'static str),
}

/// `ReferenceBackend` with a twist, counting allocations so tests can see buffers are freed.
struct Wrapped {
    inner: ReferenceBackend,
    mode: Misbehave,
    live_buffers: usize,
}

impl Wrapped {
    fn new(mode: Misbehave) -> Self {
        Wrapped { inner: ReferenceBackend::new(), mode, live_buffers: 0 }
    }
}

impl Backend for Wrapped {
    fn name(&self) -> &str {
        "wrapped-ref"
    }
    fn supports(&self, op: &Op, inputs: &[TensorMeta]) -> bool {
        !matches!(self.mode, Misbehave::Refuse(name) if op.name() == name) && self.inner.supports(op, inputs)
    }
    fn alloc(&mut self, bytes: usize) -> Result<BufferId, BackendError> {
        let b = self.inner.alloc(bytes)?;
        self.live_buffers += 1;
        Ok(b)
    }
    fn free(&mut self, buffer: BufferId) {
        if self.inner.size(buffer).is_ok() {
            self.live_buffers -= 1;
        }
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
        let Some(last) = tasks.last() else { return Ok(()) };
        let out = last.output;
        match self.mode {
            Misbehave::WriteAfter => self.inner.write(out.buffer, out.offset + out.meta.span_bytes(), &[0]),
            Misbehave::WriteBefore => self.inner.write(out.buffer, out.offset - 1, &[0]),
            Misbehave::Nothing | Misbehave::Refuse(_) => Ok(()),
        }
    }
}

fn guarded() -> SessionOptions {
    SessionOptions { guard_bytes: 16, ..Default::default() }
}

fn iota(n: usize) -> Vec<f64> {
    (0..n).map(|i| i as f64).collect()
}

// ---- errors ----

#[test]
fn running_with_an_unset_input() {
    let mut g = Graph::new();
    let x = g.input("tokens", F32, [4, 1, 1, 1]).unwrap();
    let w = g.parameter("w", F32, [4, 1, 1, 1]).unwrap();
    let y = g.add(x, w).unwrap();
    g.mark_output(y).unwrap();
    let mut be = ReferenceBackend::new();
    let mut s = Session::new(&g, &mut be).unwrap();
    s.set_f64(w, &[1.0; 4]).unwrap();
    let e = s.run().unwrap_err();
    assert_eq!(e, ExecError::UnsetLeaf { node: x.id(), name: "tokens".into() });
    let msg = e.to_string();
    assert!(msg.contains("tokens") && msg.contains("never set"), "{msg}");
    s.set_f64(x, &[1.0; 4]).unwrap();
    s.run().unwrap();
    assert_eq!(s.get_f64(y).unwrap(), vec![2.0; 4]);
}

#[test]
fn running_with_an_unset_state() {
    let mut g = Graph::new();
    let st = g.state("conv", F32, [2, 1, 1, 1]).unwrap();
    let y = g.exp(st).unwrap();
    g.mark_output(y).unwrap();
    let mut be = ReferenceBackend::new();
    let mut s = Session::new(&g, &mut be).unwrap();
    assert_eq!(s.run(), Err(ExecError::UnsetLeaf { node: st.id(), name: "conv".into() }));
}

#[test]
fn set_with_the_wrong_data_size() {
    let mut g = Graph::new();
    let x = g.input("x", F32, [4, 3, 1, 1]).unwrap();
    let y = g.neg(x).unwrap();
    g.mark_output(y).unwrap();
    let mut be = ReferenceBackend::new();
    let mut s = Session::new(&g, &mut be).unwrap();
    let e = s.set(x, &[0u8; 47]).unwrap_err();
    assert_eq!(e, ExecError::DataSize { node: x.id(), expected: 48, got: 47 });
    assert!(e.to_string().contains("48") && e.to_string().contains("47"), "{e}");
    assert_eq!(s.set(x, &[0u8; 49]), Err(ExecError::DataSize { node: x.id(), expected: 48, got: 49 }));
    // value counts for the typed setters
    assert_eq!(s.set_f64(x, &[0.0; 11]), Err(ExecError::DataSize { node: x.id(), expected: 12, got: 11 }));
    assert_eq!(s.set_f32(x, &[0.0; 13]), Err(ExecError::DataSize { node: x.id(), expected: 12, got: 13 }));
    // a failed set leaves the leaf unset
    assert_eq!(s.run(), Err(ExecError::UnsetLeaf { node: x.id(), name: "x".into() }));
}

#[test]
fn set_on_a_non_leaf() {
    let mut g = Graph::new();
    let x = g.input("x", F32, [4, 1, 1, 1]).unwrap();
    let y = g.silu(x).unwrap();
    let v = g.reshape(y, &[2, 2]).unwrap();
    g.mark_output(v).unwrap();
    let mut be = ReferenceBackend::new();
    let mut s = Session::new(&g, &mut be).unwrap();
    let e = s.set_f64(y, &[0.0; 4]).unwrap_err();
    assert_eq!(e, ExecError::NotALeaf { node: y.id(), label: "silu" });
    assert!(e.to_string().contains("silu"), "{e}");
    assert_eq!(s.set(v, &[0u8; 16]), Err(ExecError::NotALeaf { node: v.id(), label: "reshape" }));
}

#[test]
fn get_of_a_node_that_is_not_live() {
    let mut g = Graph::new();
    let x = g.input("x", F32, [4, 1, 1, 1]).unwrap();
    let y = g.exp(x).unwrap();
    let dead = g.neg(x).unwrap();
    let unused = g.input("unused", F32, [1, 1, 1, 1]).unwrap();
    g.mark_output(y).unwrap();
    let mut be = ReferenceBackend::new();
    let mut s = Session::new(&g, &mut be).unwrap();
    s.set_f64(x, &[0.0; 4]).unwrap();
    s.run().unwrap();
    let e = s.get_f64(dead).unwrap_err();
    assert_eq!(e, ExecError::NotComputed { node: dead.id() });
    assert!(e.to_string().contains("mark it as an output"), "{e}");
    assert!(s.placement(dead).is_none());
    // an unused leaf has no storage either
    assert_eq!(s.set_f64(unused, &[1.0]), Err(ExecError::NotComputed { node: unused.id() }));
    // the live ones read fine
    assert_eq!(s.get_f64(y).unwrap(), vec![1.0; 4]);
    assert_eq!(s.get_f64(x).unwrap(), vec![0.0; 4]);
}

#[test]
fn tensors_of_another_graph_are_refused() {
    let mut other = Graph::new();
    let f = other.input("f", F32, [4, 1, 1, 1]).unwrap();
    let mut g = Graph::new();
    let x = g.input("x", F32, [4, 1, 1, 1]).unwrap();
    let y = g.exp(x).unwrap();
    g.mark_output(y).unwrap();
    let mut be = ReferenceBackend::new();
    let mut s = Session::new(&g, &mut be).unwrap();
    let foreign = ExecError::Graph(GraphError::ForeignTensor { id: f.id() });
    assert_eq!(s.set_f64(f, &[0.0; 4]), Err(foreign.clone()));
    assert_eq!(s.get(f), Err(foreign));
}

#[test]
fn get_rows_with_an_out_of_range_id() {
    let mut g = Graph::new();
    let table = g.parameter("table", F32, [2, 3, 1, 1]).unwrap();
    let ids = g.input("ids", I32, [2, 1, 1, 1]).unwrap();
    let rows = g.get_rows(table, ids).unwrap();
    g.mark_output(rows).unwrap();
    let mut be = ReferenceBackend::new();
    let mut s = Session::new(&g, &mut be).unwrap();
    s.set_f64(table, &iota(6)).unwrap();
    for (bad, index) in [(5, 5i64), (-1, -1), (3, 3)] {
        s.set_i32(ids, &[0, bad]).unwrap();
        let e = s.run().unwrap_err();
        assert_eq!(
            e,
            ExecError::Backend(BackendError::Kernel(KernelError::IndexOutOfRange {
                op: "get_rows",
                index,
                limit: 3,
                what: "row id"
            }))
        );
        let msg = e.to_string();
        assert!(msg.contains("get_rows") && msg.contains(&index.to_string()) && msg.contains("0..3"), "{msg}");
    }
    s.set_i32(ids, &[2, 0]).unwrap();
    s.run().unwrap();
    assert_eq!(s.get_f64(rows).unwrap(), vec![4.0, 5.0, 0.0, 1.0]);
}

#[test]
fn set_rows_with_an_out_of_range_slot() {
    let mut g = Graph::new();
    let cache = g.state("kv", F32, [2, 4, 1, 1]).unwrap();
    let k = g.input("k", F32, [2, 1, 1, 1]).unwrap();
    let slot = g.input("slot", I32, [1, 1, 1, 1]).unwrap();
    g.set_rows(cache, k, slot).unwrap();
    let mut be = ReferenceBackend::new();
    let mut s = Session::new(&g, &mut be).unwrap();
    s.set_f64(cache, &[0.0; 8]).unwrap();
    s.set_f64(k, &[1.0, 2.0]).unwrap();
    s.set_i32(slot, &[4]).unwrap();
    let e = s.run().unwrap_err();
    assert!(
        matches!(
            e,
            ExecError::Backend(BackendError::Kernel(KernelError::IndexOutOfRange {
                op: "set_rows",
                index: 4,
                limit: 4,
                ..
            }))
        ),
        "{e:?}"
    );
}

#[test]
fn unsupported_op_is_reported_before_anything_runs() {
    let mut g = Graph::new();
    let x = g.input("x", F32, [4, 2, 1, 1]).unwrap();
    let y = g.neg(x).unwrap();
    let z = g.exp(y).unwrap();
    g.mark_output(z).unwrap();
    let mut be = Wrapped::new(Misbehave::Refuse("exp"));
    // Support is checked once, when the graph is placed.
    let e = Session::new(&g, &mut be).err().expect("placing an unsupported op fails");
    assert_eq!(
        e,
        ExecError::Unsupported {
            backend: "wrapped-ref".into(),
            op: "exp".into(),
            node: z.id(),
            inputs: vec![([4, 2, 1, 1], F32)]
        }
    );
    assert!(e.to_string().contains("exp") && e.to_string().contains("[4, 2, 1, 1]"), "{e}");
}

// ---- guard bytes ----

#[test]
fn a_write_past_the_output_is_caught_by_guard_bytes() {
    let mut g = Graph::new();
    let x = g.input("x", F32, [4, 3, 1, 1]).unwrap();
    let y = g.silu(x).unwrap();
    g.mark_output(y).unwrap();
    let mut be = Wrapped::new(Misbehave::WriteAfter);
    let mut s = Session::with_options(&g, &mut be, guarded()).unwrap();
    s.set_f64(x, &iota(12)).unwrap();
    let e = s.run().unwrap_err();
    assert_eq!(e, ExecError::GuardOverwritten { node: y.id(), op: "silu", side: "after" });
    let msg = e.to_string();
    assert!(msg.contains("silu") && msg.contains("after"), "{msg}");
}

#[test]
fn a_write_before_the_output_is_caught_by_guard_bytes() {
    let mut g = Graph::new();
    let x = g.input("x", F32, [4, 3, 1, 1]).unwrap();
    let y = g.sum_rows(x).unwrap();
    g.mark_output(y).unwrap();
    let mut be = Wrapped::new(Misbehave::WriteBefore);
    let mut s = Session::with_options(&g, &mut be, guarded()).unwrap();
    s.set_f64(x, &iota(12)).unwrap();
    assert_eq!(s.run(), Err(ExecError::GuardOverwritten { node: y.id(), op: "sum_rows", side: "before" }));
}

#[test]
fn without_guards_a_write_past_the_buffer_is_out_of_bounds() {
    // 64 f32 fill the arena exactly (its intervals are 256-byte aligned), so the byte past the
    // output is past the arena.
    let mut g = Graph::new();
    let x = g.input("x", F32, [64, 1, 1, 1]).unwrap();
    let y = g.neg(x).unwrap();
    g.mark_output(y).unwrap();
    let mut be = Wrapped::new(Misbehave::WriteAfter);
    let mut s = Session::new(&g, &mut be).unwrap();
    s.set_f64(x, &iota(64)).unwrap();
    let e = s.run().unwrap_err();
    assert!(matches!(e, ExecError::Backend(BackendError::OutOfBounds { offset: 256, len: 1, size: 256, .. })), "{e:?}");
}

#[test]
fn guards_stay_intact_for_correct_kernels_views_and_state_writes() {
    let mut g = Graph::new();
    let x = g.input("x", F32, [3, 2, 1, 1]).unwrap();
    let t = g.transpose(x).unwrap();
    let c = g.cont(t).unwrap();
    let st = g.state("s", F32, [2, 4, 1, 1]).unwrap();
    let window = g.view(st, [2, 3, 1, 1], [4, 8, 32, 32], 8).unwrap(); // rows 1..4
    g.cpy(c, window).unwrap();
    g.mark_output(c).unwrap();
    let mut be = Wrapped::new(Misbehave::Nothing);
    let mut s = Session::with_options(&g, &mut be, guarded()).unwrap();
    s.set_f64(x, &iota(6)).unwrap();
    s.set_f64(st, &[-1.0; 8]).unwrap();
    s.run().unwrap();
    assert_eq!(s.get_f64(c).unwrap(), vec![0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
    assert_eq!(s.get_f64(st).unwrap(), vec![-1.0, -1.0, 0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
}

#[test]
fn dropping_a_session_frees_its_buffers() {
    let mut g = Graph::new();
    let x = g.input("x", F32, [4, 1, 1, 1]).unwrap();
    let y = g.exp(x).unwrap();
    let r = g.reshape(y, &[2, 2]).unwrap();
    g.mark_output(r).unwrap();
    let mut be = Wrapped::new(Misbehave::Nothing);
    {
        let mut s = Session::with_options(&g, &mut be, guarded()).unwrap();
        s.set_f64(x, &[0.0; 4]).unwrap();
        s.run().unwrap();
    }
    assert_eq!(be.live_buffers, 0);
    {
        let _s = Session::new(&g, &mut be).unwrap();
    }
    assert_eq!(be.live_buffers, 0);
}

// ---- in-place writes ----

#[test]
fn cpy_whose_source_overlaps_its_destination() {
    let mut g = Graph::new();
    let st = g.state("s", F32, [2, 4, 1, 1]).unwrap();
    let rows01 = g.view(st, [2, 2, 1, 1], [4, 8, 16, 16], 0).unwrap();
    let rows12 = g.view(st, [2, 2, 1, 1], [4, 8, 16, 16], 8).unwrap();
    let cp = g.cpy(rows01, rows12).unwrap();
    let mut be = ReferenceBackend::new();
    // Found when the graph is placed, before anything can run.
    let e = Session::new(&g, &mut be).err().expect("an aliased in-place write is refused");
    assert_eq!(e, ExecError::AliasedInPlace { node: cp.id(), op: "cpy" });
    assert!(e.to_string().contains("cpy"), "{e}");
}

#[test]
fn set_rows_whose_source_is_a_view_of_its_destination() {
    let mut g = Graph::new();
    let st = g.state("s", F32, [2, 4, 1, 1]).unwrap();
    let row0 = g.view(st, [2, 1, 1, 1], [4, 8, 8, 8], 0).unwrap();
    let ids = g.input("ids", I32, [1, 1, 1, 1]).unwrap();
    let sr = g.set_rows(st, row0, ids).unwrap();
    let mut be = ReferenceBackend::new();
    let e = Session::new(&g, &mut be).err().expect("an aliased in-place write is refused");
    assert_eq!(e, ExecError::AliasedInPlace { node: sr.id(), op: "set_rows" });
    let _ = ids;
}

#[test]
fn cpy_between_disjoint_rows_of_one_state() {
    let mut g = Graph::new();
    let st = g.state("s", F32, [2, 4, 1, 1]).unwrap();
    let row0 = g.view(st, [2, 1, 1, 1], [4, 8, 8, 8], 0).unwrap();
    let row3 = g.view(st, [2, 1, 1, 1], [4, 8, 8, 8], 24).unwrap();
    g.cpy(row0, row3).unwrap();
    let mut be = ReferenceBackend::new();
    let mut s = Session::new(&g, &mut be).unwrap();
    s.set_f64(st, &iota(8)).unwrap();
    s.run().unwrap();
    assert_eq!(s.get_f64(st).unwrap(), vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 0.0, 1.0]);
}

// ---- placement ----

#[test]
fn views_share_their_source_buffer_at_the_right_offset() {
    let mut g = Graph::new();
    let x = g.input("x", F32, [4, 3, 2, 1]).unwrap();
    let y = g.neg(x).unwrap();
    let v = g.view(y, [2, 2, 2, 1], [4, 16, 48, 96], 20).unwrap(); // starts at element (1, 1, 0)
    let vv = g.view(v, [1, 2, 1, 1], [4, 16, 48, 48], 4).unwrap(); // element (1, 0, 0) of v
    let p = g.permute(v, [2, 0, 1, 3]).unwrap();
    let t = g.transpose(y).unwrap();
    let r = g.reshape(y, &[12, 2]).unwrap();
    let c = g.cont(p).unwrap();
    for out in [vv, p, t, r, c] {
        g.mark_output(out).unwrap();
    }
    let mut be = ReferenceBackend::new();
    let mut s = Session::with_options(&g, &mut be, guarded()).unwrap();
    let py = s.placement(y).unwrap();
    let px = s.placement(x).unwrap();
    assert_ne!(px.buffer, py.buffer, "a computing op gets its own buffer");
    assert_eq!(py.offset, 16, "past the guard bytes");
    let at = |t: Tensor| s.placement(t).unwrap();
    assert_eq!((at(v).buffer, at(v).offset), (py.buffer, py.offset + 20));
    assert_eq!((at(vv).buffer, at(vv).offset), (py.buffer, py.offset + 24));
    assert_eq!((at(p).buffer, at(p).offset), (py.buffer, py.offset + 20));
    assert_eq!((at(t).buffer, at(t).offset), (py.buffer, py.offset));
    assert_eq!((at(r).buffer, at(r).offset), (py.buffer, py.offset));
    let (pc, bytes_y) = (at(c), py.meta.span_bytes());
    assert!(
        pc.buffer != py.buffer || pc.offset >= py.offset + bytes_y || pc.offset + pc.meta.span_bytes() <= py.offset
    );
    for t in [v, vv, p, t, r, c] {
        assert_eq!(at(t).meta, *t.meta());
    }
    // and the values read through them
    s.set_f64(x, &iota(24)).unwrap();
    s.run().unwrap();
    let neg = |v: &[f64]| v.iter().map(|x| -x).collect::<Vec<_>>();
    // v = y[1..3, 1..3, 0..2]: elements i0 + 4 i1 + 12 i2
    let v_elems = [5.0, 6.0, 9.0, 10.0, 17.0, 18.0, 21.0, 22.0];
    assert_eq!(s.get_f64(v).unwrap(), neg(&v_elems));
    assert_eq!(s.get_f64(vv).unwrap(), neg(&[6.0, 10.0]));
    assert_eq!(s.get_f64(r).unwrap(), neg(&iota(24)));
    // p: v's dim 0 -> 2, dim 1 -> 0, dim 2 -> 1; p[j0, j1, j2] = v[j2, j0, j1]
    let mut want = Vec::new();
    for j2 in 0..2 {
        for j1 in 0..2 {
            for j0 in 0..2 {
                want.push(-v_elems[j2 + 2 * j0 + 4 * j1]);
            }
        }
    }
    assert_eq!(s.get_f64(p).unwrap(), want);
    assert_eq!(s.get_f64(c).unwrap(), want);
}

#[test]
fn in_place_results_live_in_the_written_tensor() {
    let mut g = Graph::new();
    let st = g.state("s", F32, [3, 4, 1, 1]).unwrap();
    let row2 = g.view(st, [3, 1, 1, 1], [4, 12, 12, 12], 24).unwrap();
    let x = g.input("x", F32, [3, 1, 1, 1]).unwrap();
    let cp = g.cpy(x, row2).unwrap();
    let k = g.input("k", F32, [3, 1, 1, 1]).unwrap();
    let ids = g.input("ids", I32, [1, 1, 1, 1]).unwrap();
    let sr = g.set_rows(st, k, ids).unwrap();
    let mut be = ReferenceBackend::new();
    let mut s = Session::new(&g, &mut be).unwrap();
    let ps = s.placement(st).unwrap();
    assert_eq!(s.placement(row2).unwrap().offset, ps.offset + 24);
    assert_eq!(s.placement(cp).unwrap(), s.placement(row2).unwrap());
    assert_eq!(s.placement(sr).unwrap(), ps);

    s.set_f64(st, &[0.0; 12]).unwrap();
    s.set_f64(x, &[7.0, 8.0, 9.0]).unwrap();
    s.set_f64(k, &[1.0, 2.0, 3.0]).unwrap();
    s.set_i32(ids, &[0]).unwrap();
    s.run().unwrap();
    // the cpy wrote row 2 of the state, then set_rows row 0 (build order)
    assert_eq!(s.get_f64(st).unwrap(), vec![1.0, 2.0, 3.0, 0.0, 0.0, 0.0, 7.0, 8.0, 9.0, 0.0, 0.0, 0.0]);
    assert_eq!(s.get_f64(cp).unwrap(), vec![7.0, 8.0, 9.0]);
    // state persists across runs: a second step writes another slot and keeps the first
    s.set_f64(x, &[-7.0, -8.0, -9.0]).unwrap();
    s.set_f64(k, &[4.0, 5.0, 6.0]).unwrap();
    s.set_i32(ids, &[3]).unwrap();
    s.run().unwrap();
    assert_eq!(s.get_f64(st).unwrap(), vec![1.0, 2.0, 3.0, 0.0, 0.0, 0.0, -7.0, -8.0, -9.0, 4.0, 5.0, 6.0]);
    assert_eq!(s.get_f64(sr).unwrap(), s.get_f64(st).unwrap());
}

#[test]
fn cpy_converts_into_a_strided_view_of_state() {
    // a transposed f16 window of the state receives a f32 source in logical order
    let mut g = Graph::new();
    let st = g.state("s", DType::F16, [2, 3, 1, 1]).unwrap();
    let t = g.transpose(st).unwrap(); // [3, 2], nb [4, 2]
    let x = g.input("x", F32, [3, 2, 1, 1]).unwrap();
    g.cpy(x, t).unwrap();
    let mut be = ReferenceBackend::new();
    let mut s = Session::new(&g, &mut be).unwrap();
    s.set_f64(st, &[0.0; 6]).unwrap();
    s.set_f64(x, &[0.5, 1.5, 2.5, 3.5, 4.5, 5.5]).unwrap();
    s.run().unwrap();
    // t[j0, j1] = st[j1, j0]
    assert_eq!(s.get_f64(t).unwrap(), vec![0.5, 1.5, 2.5, 3.5, 4.5, 5.5]);
    assert_eq!(s.get_f64(st).unwrap(), vec![0.5, 3.5, 1.5, 4.5, 2.5, 5.5]);
}

/// Parameters and caches live in backend buffers that outlive one step's graph: a state updated
/// by one graph's session is what the next graph's session reads.
#[test]
fn bound_leaves_persist_across_graphs() {
    use tessera_graph::{SessionOptions, TensorRef};

    let mut backend = CpuBackend::new();
    let meta = TensorMeta::contiguous("t", DType::F32, [2, 3, 1, 1]).unwrap();
    let buffer = backend.alloc(meta.nbytes_contiguous()).unwrap();
    backend.write(buffer, 0, &tessera_ops::host::encode(DType::F32, &[0.0; 6])).unwrap();
    let cache = TensorRef { buffer, offset: 0, meta };

    // Step 1: write row 1 of the cache.
    let mut g1 = Graph::new();
    let state = g1.state("cache", DType::F32, [2, 3, 1, 1]).unwrap();
    let src = g1.input("src", DType::F32, [2, 1, 1, 1]).unwrap();
    let ids = g1.input("ids", DType::I32, [1, 1, 1, 1]).unwrap();
    g1.set_rows(state, src, ids).unwrap();
    {
        let mut s = Session::with_bindings(&g1, &mut backend, SessionOptions::default(), &[(state, cache)]).unwrap();
        s.set_f32(src, &[5.0, 6.0]).unwrap();
        s.set_i32(ids, &[1]).unwrap();
        s.run().unwrap();
    }
    // Step 2: another graph reads the same memory.
    let mut g2 = Graph::new();
    let state2 = g2.state("cache", DType::F32, [2, 3, 1, 1]).unwrap();
    let sum = g2.sum_rows(state2).unwrap();
    g2.mark_output(sum).unwrap();
    let mut s = Session::with_bindings(&g2, &mut backend, SessionOptions::default(), &[(state2, cache)]).unwrap();
    s.run().unwrap();
    assert_eq!(s.get_f32(sum).unwrap(), vec![0.0, 11.0, 0.0]);
    drop(s);
    // The session did not free bound memory.
    assert_eq!(backend.size(buffer).unwrap(), meta.nbytes_contiguous());

    // A binding must match the leaf and fit its buffer.
    let mut g3 = Graph::new();
    let wrong = g3.state("cache", DType::F32, [3, 2, 1, 1]).unwrap();
    let err = Session::with_bindings(&g3, &mut backend, SessionOptions::default(), &[(wrong, cache)]).err().unwrap();
    assert!(matches!(err, ExecError::BindingMismatch { .. }), "{err}");
    let right = g3.state("other", DType::F32, [2, 3, 1, 1]).unwrap();
    let off_end = TensorRef { offset: 4, ..cache };
    let err = Session::with_bindings(&g3, &mut backend, SessionOptions::default(), &[(right, off_end)]).err().unwrap();
    assert!(matches!(err, ExecError::Backend(BackendError::OutOfBounds { .. })), "{err}");
}
