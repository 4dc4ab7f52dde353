//! Views compose and agree with plain index arithmetic: random chains of permute / transpose /
//! reshape / view (with `cont` where a step needs contiguous input) are built on a source holding
//! `0, 1, 2, ...`, run on the reference backend (and the chain test also on the CPU backend), and
//! every tensor of the chain, read directly and through `cont`, must equal what a small Rust model
//! of the same steps predicts.
//!
//! The model is independent of `TensorMeta`: permute and reshape move logical indices, and a view
//! reads the buffer the way its definition says, element `j` at byte `offset + sum_d j[d] * nb[d]`
//! from the first byte of the tensor it views.

mod common;

use common::Rng;
use proptest::prelude::*;
use proptest::sample::select;
use tessera_cpu::{CpuBackend, ReferenceBackend};
use tessera_graph::{Backend, Graph, Session, SessionOptions, Tensor};
use tessera_ops::DType;

/// Steps of a chain. Parameters that depend on the current shape are drawn from `seed` when the
/// step is applied.
#[derive(Debug, Clone)]
enum Step {
    Permute([usize; 4]),
    Transpose,
    Reshape(u64),
    Window(u64),
    Reinterpret(u64),
    Cont,
}

fn axes() -> impl Strategy<Value = [usize; 4]> {
    Just(vec![0usize, 1, 2, 3]).prop_shuffle().prop_map(|v| [v[0], v[1], v[2], v[3]])
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => axes().prop_map(Step::Permute),
        1 => Just(Step::Transpose),
        2 => any::<u64>().prop_map(Step::Reshape),
        3 => any::<u64>().prop_map(Step::Window),
        2 => any::<u64>().prop_map(Step::Reinterpret),
        1 => Just(Step::Cont),
    ]
}

/// A random divisor of `n`.
fn divisor_of(r: &mut Rng, n: usize) -> usize {
    let ds: Vec<usize> = (1..=n).filter(|&d| n.is_multiple_of(d)).collect();
    ds[r.below(ds.len())]
}

/// Logical index `i` of a tensor of shape `ne` -> position in logical (ggml) order.
fn linear(i: [usize; 4], ne: [usize; 4]) -> usize {
    i[0] + ne[0] * (i[1] + ne[1] * (i[2] + ne[2] * i[3]))
}

fn indices(ne: [usize; 4]) -> Vec<[usize; 4]> {
    let mut out = Vec::with_capacity(ne.iter().product());
    for i3 in 0..ne[3] {
        for i2 in 0..ne[2] {
            for i1 in 0..ne[1] {
                for i0 in 0..ne[0] {
                    out.push([i0, i1, i2, i3]);
                }
            }
        }
    }
    out
}

/// What the model knows about the current tensor of a chain.
#[derive(Debug, Clone)]
struct Model {
    ne: [usize; 4],
    /// The source value (= source flat index) of each logical element, in logical order.
    vals: Vec<usize>,
    /// The buffer the current tensor lives in, one source value per element slot: the source
    /// itself, or the output of the last `cont`.
    mem: Vec<usize>,
    /// The slot of the current tensor's element `[0, 0, 0, 0]` in `mem`.
    first: usize,
}

impl Model {
    fn source(ne: [usize; 4]) -> Self {
        let n = ne.iter().product();
        Model { ne, vals: (0..n).collect(), mem: (0..n).collect(), first: 0 }
    }

    /// Dimension `i` becomes dimension `axes[i]`: element `j` of the result is element `i` of the
    /// input with `i[k] = j[axes[k]]`.
    fn permute(&self, axes: [usize; 4]) -> Self {
        let mut ne = [0; 4];
        for k in 0..4 {
            ne[axes[k]] = self.ne[k];
        }
        let vals = indices(ne)
            .into_iter()
            .map(|j| self.vals[linear([j[axes[0]], j[axes[1]], j[axes[2]], j[axes[3]]], self.ne)])
            .collect();
        Model { ne, vals, ..self.clone() }
    }

    /// Same logical order, new shape (only valid on contiguous data).
    fn reshape(&self, ne: [usize; 4]) -> Self {
        Model { ne, ..self.clone() }
    }

    /// Reads `mem` the way a view is defined: element `j` at byte `offset + sum j[d] * nb[d]`
    /// from the current tensor's first byte.
    fn view(&self, ne: [usize; 4], nb: [usize; 4], offset: usize, eb: usize) -> Self {
        let vals = indices(ne)
            .into_iter()
            .map(|j| {
                let byte = offset + (0..4).map(|d| j[d] * nb[d]).sum::<usize>();
                assert_eq!(byte % eb, 0);
                self.mem[self.first + byte / eb]
            })
            .collect();
        Model { ne, vals, mem: self.mem.clone(), first: self.first + offset / eb }
    }

    fn cont(&self) -> Self {
        Model { ne: self.ne, vals: self.vals.clone(), mem: self.vals.clone(), first: 0 }
    }
}

/// Applies `step` to the graph and the model; inserts a `cont` first where the step needs
/// contiguous input or dense rows. Returns every tensor it added with its model.
fn apply(g: &mut Graph, cur: Tensor, m: &Model, step: &Step) -> Vec<(Tensor, Model)> {
    let eb = cur.dtype().block_bytes();
    let meta = *cur.meta();
    let needs_cont = match step {
        Step::Reshape(_) | Step::Reinterpret(_) => !meta.is_contiguous(),
        Step::Window(_) => meta.nb[0] != eb,
        _ => false,
    };
    if needs_cont {
        let c = g.cont(cur).unwrap();
        let mc = m.cont();
        let mut rest = apply(g, c, &mc, step);
        rest.insert(0, (c, mc));
        return rest;
    }
    let out = match step {
        Step::Permute(axes) => (g.permute(cur, *axes).unwrap(), m.permute(*axes)),
        Step::Transpose => (g.transpose(cur).unwrap(), m.permute([1, 0, 2, 3])),
        Step::Cont => (g.cont(cur).unwrap(), m.cont()),
        Step::Reshape(seed) => {
            let mut r = Rng(*seed);
            let n = meta.nelements();
            let d0 = divisor_of(&mut r, n);
            let d1 = divisor_of(&mut r, n / d0);
            let d2 = divisor_of(&mut r, n / d0 / d1);
            let ne = [d0, d1, d2, n / d0 / d1 / d2];
            (g.reshape(cur, &ne).unwrap(), m.reshape(ne))
        }
        Step::Window(seed) => {
            // A sub-box of the current tensor, outer dims possibly skipping (step 2) and
            // reordered (a view may list the outer strides in any order).
            let mut r = Rng(*seed);
            let mut order = [1, 2, 3];
            for k in (1..3).rev() {
                order.swap(k, r.below(k + 1));
            }
            let start = meta.ne.map(|n| r.below(n));
            let mut ne = [1; 4];
            let mut nb = [eb; 4];
            let avail0 = meta.ne[0] - start[0];
            ne[0] = 1 + r.below(avail0);
            for (slot, &src_dim) in order.iter().enumerate() {
                let step = 1 + r.below(2);
                let avail = (meta.ne[src_dim] - 1 - start[src_dim]) / step + 1;
                ne[slot + 1] = 1 + r.below(avail);
                nb[slot + 1] = meta.nb[src_dim] * step;
            }
            let offset = (0..4).map(|d| start[d] * meta.nb[d]).sum::<usize>();
            let t = g.view(cur, ne, nb, offset).unwrap_or_else(|e| panic!("window of {meta:?}: {e}"));
            (t, m.view(ne, nb, offset, eb))
        }
        Step::Reinterpret(seed) => {
            // The contiguous bytes from some element on, read as another contiguous shape.
            let mut r = Rng(*seed);
            let n = meta.nelements();
            let skip = r.below(n);
            let mut room = n - skip;
            let mut ne = [1; 4];
            for d in ne.iter_mut() {
                *d = 1 + r.below(room.min(5));
                room /= *d;
            }
            let nb = [eb, eb * ne[0], eb * ne[0] * ne[1], eb * ne[0] * ne[1] * ne[2]];
            let offset = skip * eb;
            let t = g.view(cur, ne, nb, offset).unwrap_or_else(|e| panic!("reinterpret of {meta:?}: {e}"));
            (t, m.view(ne, nb, offset, eb))
        }
    };
    vec![out]
}

fn to_f64(vals: &[usize]) -> Vec<f64> {
    vals.iter().map(|&v| v as f64).collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn view_chains_read_what_the_index_model_predicts(
        ne in prop::array::uniform4(1usize..=4),
        dt in select(&DType::PLAIN[..]),
        steps in prop::collection::vec(step(), 1..7),
    ) {
        // values up to 255: exact in every dtype, bf16 included
        let mut g = Graph::new();
        let x = g.input("x", dt, ne).unwrap();
        let mut chain = vec![(x, Model::source(ne))];
        for s in &steps {
            let (cur, m) = chain.last().unwrap().clone();
            chain.extend(apply(&mut g, cur, &m, s));
        }
        let (last, last_model) = chain.last().unwrap().clone();
        let y = g.cont(last).unwrap();
        for (t, _) in &chain {
            g.mark_output(*t).unwrap();
        }
        g.mark_output(y).unwrap();

        // The reference backend, and the CPU backend (whose strided `cont` kernels must agree).
        let mut reference = ReferenceBackend::new();
        let mut cpu = CpuBackend::new();
        for be in [&mut reference as &mut dyn Backend, &mut cpu] {
            let name = be.name().to_string();
            let mut s = Session::with_options(&g, be, SessionOptions { guard_bytes: 8, ..Default::default() }).unwrap();
            s.set_f64(x, &to_f64(&Model::source(ne).vals)).unwrap();
            s.run().unwrap();
            for (k, (t, m)) in chain.iter().enumerate() {
                prop_assert_eq!(t.ne(), m.ne, "step {} shape", k);
                prop_assert_eq!(
                    s.get_f64(*t).unwrap(),
                    to_f64(&m.vals),
                    "{}: step {} of {:?}: {:?}",
                    name,
                    k,
                    steps,
                    t.meta()
                );
            }
            prop_assert!(y.meta().is_contiguous());
            prop_assert_eq!(s.get_f64(y).unwrap(), to_f64(&last_model.vals), "{}", name);
            // raw bytes of the view agree with those of its materialised copy
            prop_assert_eq!(s.get(last).unwrap(), s.get(y).unwrap(), "{}", name);
        }
    }

    #[test]
    fn cont_of_permute_then_reshape_is_the_rearrangement(
        ne in prop::array::uniform4(1usize..=5),
        p in axes(),
        dt in select(&[DType::F32, DType::F16, DType::I32][..]),
        seed in any::<u64>(),
    ) {
        let mut g = Graph::new();
        let x = g.input("x", dt, ne).unwrap();
        let pt = g.permute(x, p).unwrap();
        let c = g.cont(pt).unwrap();
        let n: usize = ne.iter().product();
        let mut r = Rng(seed);
        let d0 = divisor_of(&mut r, n);
        let d1 = divisor_of(&mut r, n / d0);
        let target = [d0, d1, n / d0 / d1, 1];
        let rs = g.reshape(c, &target).unwrap();
        let back = g.reshape(rs, &[n]).unwrap();
        g.mark_output(back).unwrap();
        g.mark_output(rs).unwrap();
        g.mark_output(pt).unwrap();

        // Scatter formulation: source element i lands at j with j[p[k]] = i[k].
        let mut pne = [0; 4];
        for k in 0..4 {
            pne[p[k]] = ne[k];
        }
        let mut want = vec![f64::NAN; n];
        for (flat, i) in indices(ne).into_iter().enumerate() {
            let mut j = [0; 4];
            for k in 0..4 {
                j[p[k]] = i[k];
            }
            want[linear(j, pne)] = flat as f64;
        }

        let mut be = ReferenceBackend::new();
        let mut s = Session::new(&g, &mut be).unwrap();
        s.set_f64(x, &(0..n).map(|v| v as f64).collect::<Vec<_>>()).unwrap();
        s.run().unwrap();
        prop_assert_eq!(rs.ne(), target);
        prop_assert_eq!(s.get_f64(pt).unwrap(), want.clone());
        prop_assert_eq!(s.get_f64(rs).unwrap(), want.clone());
        prop_assert_eq!(s.get_f64(back).unwrap(), want);
        // the reshapes are views of the cont's buffer
        prop_assert_eq!(s.placement(rs).unwrap().buffer, s.placement(c).unwrap().buffer);
    }

    #[test]
    fn strided_view_reads_offset_plus_index_times_stride(
        ne in prop::array::uniform4(1usize..=4),
        seed in any::<u64>(),
        dt in select(&DType::PLAIN[..]),
    ) {
        // One view straight on a leaf, with the expected values computed from raw byte
        // arithmetic on the leaf's contiguous encoding.
        let mut g = Graph::new();
        let x = g.input("x", dt, ne).unwrap();
        let m = Model::source(ne);
        let (v, vm) = apply(&mut g, x, &m, &Step::Window(seed)).pop().unwrap();
        let vv = g.view(v, [1, 1, 1, 1], [dt.block_bytes(); 4], 0).unwrap(); // its first element
        g.mark_output(v).unwrap();
        g.mark_output(vv).unwrap();
        let n: usize = ne.iter().product();
        let src: Vec<f64> = (0..n).map(|i| i as f64).collect();
        let bytes = tessera_ops::host::encode(dt, &src);
        let tessera_ops::Op::View(params) = g.node(v.id()).op().unwrap().clone() else { unreachable!() };
        let mut want = Vec::new();
        for j in indices(params.ne) {
            let at = params.offset + (0..4).map(|d| j[d] * params.nb[d]).sum::<usize>();
            want.push(tessera_ops::host::decode(dt, &bytes[at..at + dt.block_bytes()])[0]);
        }
        prop_assert_eq!(&want, &to_f64(&vm.vals));

        let mut be = ReferenceBackend::new();
        let mut s = Session::new(&g, &mut be).unwrap();
        s.set(x, &bytes).unwrap();
        s.run().unwrap();
        prop_assert_eq!(s.get_f64(v).unwrap(), want.clone());
        prop_assert_eq!(s.get_f64(vv).unwrap(), vec![want[0]]);
    }
}
