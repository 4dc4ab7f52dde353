//! A test case as data: what its inputs look like, how to build the op from them, and how close a
//! backend must come to its judge.
//!
//! A [`Case`] never holds tensor data. [`Case::build`] makes a fresh [`Graph`] (one leaf per
//! input, made non-contiguous as its [`Layout`] says, then the op), and [`Case::input_data`]
//! makes the leaves' bytes from a seed derived from the label, so every backend of a run sees the
//! same numbers.

use std::fmt;
use std::sync::Arc;

use tessera_graph::{Graph, GraphError, NodeId, NodeKind, Tensor};
use tessera_ops::{Cost, DType, TensorMeta, cost};

use crate::check::Comparison;
use crate::inputs;

/// NMSE bound for cases whose inputs are all f32 (or integer): only f32-versus-f64 arithmetic
/// differs between a backend and its judge.
pub const NMSE_F32: f64 = 1e-7;

/// NMSE bound for cases with an f16 or bf16 input or output. A backend may compute through the
/// half type (e.g. convert mul_mat activations to bf16: relative error up to 2^-9 per product,
/// NMSE about 1.3e-6) or round differently (bf16 truncation: NMSE about 5e-6); this allows both.
pub const NMSE_HALF: f64 = 1e-5;

/// The bound a case without an explicit one gets for output dtype `out` given its input dtypes.
pub fn default_bound(inputs: impl IntoIterator<Item = DType>, out: DType) -> f64 {
    let half = |d: DType| matches!(d, DType::F16 | DType::BF16);
    if half(out) || inputs.into_iter().any(half) { NMSE_HALF } else { NMSE_F32 }
}

/// How an input is laid out in memory when the op sees it. Every input starts as a contiguous
/// leaf; the non-contiguous layouts add a zero-copy view node on top of it, so the backend must
/// honour the strides (views never reach a backend: the executor resolves them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// The leaf itself.
    Contiguous,
    /// `permute(axes)` (ggml rule: leaf dimension `i` becomes dimension `axes[i]`) of a leaf whose
    /// shape is chosen so the result has the input's shape.
    Permuted([usize; 4]),
    /// A window of a larger leaf of shape `ne + pad`, starting at element index `at`
    /// (`at[i] <= pad[i]`) and keeping the leaf's strides: rows stay dense, but they are not
    /// adjacent and the first element is not at the start of the buffer.
    Window { pad: [usize; 4], at: [usize; 4] },
}

impl Layout {
    /// Dimensions 0 and 1 swapped (a transposed matrix).
    pub const TRANSPOSED: Layout = Layout::Permuted([1, 0, 2, 3]);
    /// Dimensions 1 and 2 swapped (ggml's `[head_dim, n_head, n_tokens]` -> per-head matrices).
    pub const SWAP12: Layout = Layout::Permuted([0, 2, 1, 3]);
    /// A window with a few extra elements per row and an extra row, offset into both.
    pub const WINDOW: Layout = Layout::Window { pad: [3, 1, 0, 0], at: [2, 1, 0, 0] };

    /// Shape of the contiguous leaf that backs an input of shape `ne`.
    pub fn leaf_shape(&self, ne: [usize; 4]) -> [usize; 4] {
        match *self {
            Layout::Contiguous => ne,
            Layout::Permuted(axes) => std::array::from_fn(|i| ne[axes[i]]),
            Layout::Window { pad, .. } => std::array::from_fn(|i| ne[i] + pad[i]),
        }
    }

    /// Adds the view nodes that turn `leaf` into the input of shape `ne`; returns the input and
    /// its byte offset from the leaf's first byte.
    fn apply(&self, g: &mut Graph, leaf: Tensor, ne: [usize; 4]) -> Result<(Tensor, usize), GraphError> {
        match *self {
            Layout::Contiguous => Ok((leaf, 0)),
            Layout::Permuted(axes) => Ok((g.permute(leaf, axes)?, 0)),
            Layout::Window { at, .. } => {
                let offset = leaf.meta().offset_of(at);
                Ok((g.view(leaf, ne, leaf.meta().nb, offset)?, offset))
            }
        }
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Layout::Contiguous => f.write_str("cont"),
            Layout::Permuted(a) => write!(f, "perm({},{},{},{})", a[0], a[1], a[2], a[3]),
            Layout::Window { pad, at } => write!(f, "view(pad={},at={})", Shape(*pad), Shape(*at)),
        }
    }
}

/// How an input's values are drawn (seeded, see [`Case::input_data`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// Uniform in `[lo, hi)`; for an i32 input, uniform integers in `[lo * 10^6, hi * 10^6)`.
    Uniform { lo: f32, hi: f32 },
    /// i32 row ids in `0..rows`, drawn per column `[.., j, k]`; `unique` makes the ids of a column
    /// distinct (set_rows with repeated ids has a last-write-wins order a parallel backend need
    /// not follow).
    Ids { rows: usize, unique: bool },
    /// A softmax mask: uniform in `[-1, 1)` with about a quarter of the entries `-inf`; element 0
    /// of every row stays finite, so no row is fully masked.
    Mask,
    /// Each row a shuffle of evenly spaced values in `(-1, 1)`: no ties, and neighbours are at
    /// least `2 / ne0` apart, so argmax cannot flip between f32 and f64.
    Distinct,
    /// Exactly these integers in logical order, one per element (e.g. a ragged batch's
    /// `seq_offsets` and slots).
    Fixed(&'static [i32]),
    /// Values made by a function of the input's shape, the case's parameters and a seed
    /// (structured data: a vocabulary's logits, per-row settings).
    Generated(Generator),
}

/// A value generator for [`Init::Generated`]: `f(ne, args, seed)` returns the input's values in
/// logical order (`ne` as the op sees it).
#[derive(Debug, Clone, Copy)]
pub struct Generator {
    pub f: fn([usize; 4], [f32; 4], u64) -> Vec<f32>,
    pub args: [f32; 4],
}

impl PartialEq for Generator {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::fn_addr_eq(self.f, other.f) && self.args == other.args
    }
}

impl Init {
    /// The default: uniform in `[-1, 1)`.
    pub const SIGNED: Init = Init::Uniform { lo: -1.0, hi: 1.0 };
    /// Positive and away from zero (divisors).
    pub const POSITIVE: Init = Init::Uniform { lo: 0.5, hi: 1.5 };
}

/// One input of a case: its dtype and shape as the op sees them, its layout and its values.
#[derive(Debug, Clone, PartialEq)]
pub struct InputSpec {
    pub name: &'static str,
    pub dtype: DType,
    /// Shape in ggml order (`ne[0]` innermost), as the op sees it.
    pub ne: [usize; 4],
    pub layout: Layout,
    pub init: Init,
    /// The leaf is persistent state ([`Graph::state`]) rather than a per-step input
    /// ([`Graph::input`]); set it for inputs an op updates in place.
    pub state: bool,
}

impl InputSpec {
    /// A contiguous input of uniform values in `[-1, 1)` (for i32: see [`Init::Uniform`]).
    pub fn new(name: &'static str, dtype: DType, ne: [usize; 4]) -> Self {
        InputSpec { name, dtype, ne, layout: Layout::Contiguous, init: Init::SIGNED, state: false }
    }

    /// Makes the leaf a state leaf (recurrent state, a cache) instead of an input.
    pub fn state(mut self) -> Self {
        self.state = true;
        self
    }

    pub fn layout(mut self, layout: Layout) -> Self {
        self.layout = layout;
        self
    }

    pub fn init(mut self, init: Init) -> Self {
        self.init = init;
        self
    }
}

/// A case's own judgement of the op's output (instead of NMSE or exact equality): `(inputs, got,
/// want)` with every input's values as the op sees them, in logical order.
pub type JudgeFn = Arc<dyn Fn(&[Vec<f64>], &[f64], &[f64]) -> Comparison + Send + Sync>;

/// Builds the op under test from the case's inputs (already laid out) and returns its result.
pub type BuildFn = Arc<dyn Fn(&mut Graph, &[Tensor]) -> Result<Tensor, GraphError> + Send + Sync>;

/// A graph built for one case.
#[derive(Debug, Clone)]
pub struct Built {
    pub graph: Graph,
    /// One leaf per input, in input order.
    pub leaves: Vec<Tensor>,
    /// What the op sees of each input: the leaf or a view of it, with the view's byte offset.
    pub inputs: Vec<(Tensor, usize)>,
    /// The result returned by the builder (marked as the graph's output).
    pub output: Tensor,
    /// Every node whose value is compared: each live computing node (views and leaves excluded).
    pub checked: Vec<Tensor>,
    /// Every leaf some live op writes in place ([`tessera_ops::Op::updates_input`] or [`tessera_ops::Op::writes_input`],
    /// directly or through views), in leaf order: its final contents are compared too.
    pub updated: Vec<Tensor>,
}

/// One test case. The label (`vars()`) is `op(params)` plus the layout of every non-contiguous
/// input; it identifies the case and is what `--filter` matches.
#[derive(Clone)]
pub struct Case {
    op: &'static str,
    label: String,
    inputs: Vec<InputSpec>,
    build: BuildFn,
    nmse_bound: Option<f64>,
    /// The run must fail with a data error (`KernelError`), the same on the backend as on its
    /// judge, and leave every leaf an op updates in place untouched.
    expect_error: bool,
    judge: Option<JudgeFn>,
}

impl fmt::Debug for Case {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Case").field("label", &self.label).field("inputs", &self.inputs).finish_non_exhaustive()
    }
}

impl Case {
    /// A case for op `op` (an `Op::name()`), labelled `op(params,...)`.
    pub fn new(
        op: &'static str,
        params: impl fmt::Display,
        inputs: Vec<InputSpec>,
        build: impl Fn(&mut Graph, &[Tensor]) -> Result<Tensor, GraphError> + Send + Sync + 'static,
    ) -> Self {
        let mut label = format!("{op}({params}");
        for input in inputs.iter().filter(|i| i.layout != Layout::Contiguous) {
            label.push_str(&format!(",{}={}", input.name, input.layout));
        }
        label.push(')');
        Case { op, label, inputs, build: Arc::new(build), nmse_bound: None, expect_error: false, judge: None }
    }

    /// Judges the op's output with `judge` instead of by NMSE or equality (an op whose result
    /// may legitimately move with rounding, such as a sampled token id near a boundary).
    pub fn with_judge(
        mut self,
        judge: impl Fn(&[Vec<f64>], &[f64], &[f64]) -> Comparison + Send + Sync + 'static,
    ) -> Self {
        self.judge = Some(Arc::new(judge));
        self
    }

    /// The case's own judge of the op's output, if it has one.
    pub fn judge(&self) -> Option<&JudgeFn> {
        self.judge.as_ref()
    }

    /// Marks the case as one whose run must fail (bad values): it passes when the backend fails
    /// with the judge's `KernelError` and leaves the state leaves as they were.
    pub fn expect_error(mut self) -> Self {
        self.expect_error = true;
        self
    }

    pub fn expects_error(&self) -> bool {
        self.expect_error
    }

    /// Overrides the NMSE bound (otherwise [`default_bound`] per compared output).
    pub fn with_bound(mut self, nmse: f64) -> Self {
        self.nmse_bound = Some(nmse);
        self
    }

    /// The name of the op under test (exact `--op` filter key).
    pub fn op(&self) -> &'static str {
        self.op
    }

    /// The case's label, e.g. `mul_mat(type_a=f16,m=512,n=1,k=5120,bs=[1,1])`.
    pub fn vars(&self) -> &str {
        &self.label
    }

    pub fn inputs(&self) -> &[InputSpec] {
        &self.inputs
    }

    /// The NMSE bound for a compared output of dtype `out`.
    pub fn nmse_bound(&self, out: DType) -> f64 {
        self.nmse_bound.unwrap_or_else(|| default_bound(self.inputs.iter().map(|i| i.dtype), out))
    }

    /// Builds a fresh graph: one input leaf per spec, its layout's views, then the op.
    pub fn build(&self) -> Result<Built, GraphError> {
        let mut graph = Graph::new();
        let mut leaves = Vec::with_capacity(self.inputs.len());
        let mut inputs = Vec::with_capacity(self.inputs.len());
        for spec in &self.inputs {
            let shape = spec.layout.leaf_shape(spec.ne);
            let leaf = if spec.state {
                graph.state(spec.name, spec.dtype, shape)?
            } else {
                graph.input(spec.name, spec.dtype, shape)?
            };
            leaves.push(leaf);
            inputs.push(spec.layout.apply(&mut graph, leaf, spec.ne)?);
        }
        let seen: Vec<Tensor> = inputs.iter().map(|(t, _)| *t).collect();
        let output = (self.build)(&mut graph, &seen)?;
        graph.mark_output(output)?;
        let checked = graph
            .live_nodes()
            .into_iter()
            .filter(|&id| matches!(&graph.node(id).kind, NodeKind::Op(op) if !op.is_view()))
            .filter_map(|id| graph.tensor(id))
            .collect();
        let updated = updated_leaves(&graph);
        Ok(Built { graph, leaves, inputs, output, checked, updated })
    }

    /// The bytes of every leaf of `built` (which must come from [`Case::build`] of this case),
    /// drawn from a seed derived from the label and the input's position.
    pub fn input_data(&self, built: &Built) -> Vec<Vec<u8>> {
        let seed = label_seed(&self.label);
        self.inputs
            .iter()
            .zip(&built.leaves)
            .zip(&built.inputs)
            .enumerate()
            .map(|(i, ((spec, leaf), (seen, offset)))| {
                inputs::leaf_bytes(spec, leaf.meta(), seen.meta(), *offset, seed ^ ((i as u64 + 1) * 0x9E37_79B9))
            })
            .collect()
    }

    /// The summed [`cost`] of every computing node (views cost nothing).
    pub fn cost(&self) -> Result<Cost, GraphError> {
        let built = self.build()?;
        let g = &built.graph;
        let mut total = Cost::default();
        for id in g.live_nodes() {
            let node = g.node(id);
            if let NodeKind::Op(op) = &node.kind {
                let metas: Vec<&TensorMeta> = node.inputs.iter().map(|&i| &g.node(i).meta).collect();
                let c = cost(op, &metas, &node.meta);
                total.flops = total.flops.saturating_add(c.flops);
                total.bytes = total.bytes.saturating_add(c.bytes);
            }
        }
        Ok(total)
    }

    /// Floating-point operations of one run (0 when the case does not build).
    pub fn flops(&self) -> u64 {
        self.cost().map_or(0, |c| c.flops)
    }

    /// Bytes read and written by one run (0 when the case does not build).
    pub fn bytes(&self) -> u64 {
        self.cost().map_or(0, |c| c.bytes)
    }

    /// Elements over all inputs, as the op sees them: a rough size used to pick small cases.
    pub fn input_elements(&self) -> usize {
        self.inputs.iter().map(|i| i.ne.iter().product::<usize>()).sum()
    }
}

/// The leaves that live ops write in place, found by following each written input back through
/// views to its leaf; sorted and deduplicated. A written input that is the result of another op
/// is already among the compared nodes.
fn updated_leaves(graph: &Graph) -> Vec<Tensor> {
    let mut ids: Vec<NodeId> = Vec::new();
    for id in graph.live_nodes() {
        let node = graph.node(id);
        let Some(op) = node.op() else { continue };
        for i in [op.updates_input(), op.writes_input()].into_iter().flatten() {
            let Some(&(mut at)) = node.inputs.get(i) else { continue };
            while let NodeKind::Op(view) = &graph.node(at).kind {
                if !view.is_view() {
                    break;
                }
                at = graph.node(at).inputs[0];
            }
            if matches!(graph.node(at).kind, NodeKind::Leaf(_)) {
                ids.push(at);
            }
        }
    }
    ids.sort_unstable();
    ids.dedup();
    ids.into_iter().filter_map(|id| graph.tensor(id)).collect()
}

/// A stable 64-bit seed from a label (FNV-1a), so a case's data does not depend on its position
/// in the catalogue or on the filter.
fn label_seed(label: &str) -> u64 {
    label.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// Formats a shape as `[a,b,c,d]` (for labels).
#[derive(Debug, Clone, Copy)]
pub struct Shape(pub [usize; 4]);

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.0;
        write!(f, "[{},{},{},{}]", n[0], n[1], n[2], n[3])
    }
}
