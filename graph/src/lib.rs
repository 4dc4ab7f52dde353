//! # tessera-graph: the lazy compute graph
//!
//! Build a [`Graph`] of ops on [`Tensor`] handles (nothing is computed while building), place it
//! on a [`Backend`] with a [`Session`], fill its leaves, run it, read results.
//!
//! Shapes are in **ggml order**: `ne[0]` is the innermost, contiguous dimension. A PyTorch
//! `[batch, seq, hidden]` tensor is `ne = [hidden, seq, batch, 1]` here.
//!
//! ```
//! use tessera_graph::{Graph, Session};
//! use tessera_ops::DType;
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let mut g = Graph::new();
//! let w = g.parameter("w", DType::F32, [3, 2, 1, 1])?; // 2 output rows of K = 3
//! let x = g.input("x", DType::F32, [3, 1, 1, 1])?;
//! let y = g.mul_mat(w, x)?; // [2, 1, 1, 1]
//! let y = g.silu(y)?;
//! g.mark_output(y)?;
//! # let _ = (&g, y);
//! # Ok(()) }
//! ```

mod backend;
mod build;
mod dot;
mod graph;
pub mod passes;
pub mod plan;
mod refusing;
mod rewrite;
pub mod schedule;
mod session;

pub use backend::{Backend, BackendError, BufferId, PreparedId, Task, TensorRef, check_range};
pub use build::shape4;
pub use graph::{DescriptorChange, Graph, GraphError, LeafKind, Node, NodeId, NodeKind, Tensor};
pub use plan::{MemoryStats, Plan, PlanOptions};
pub use refusing::Refusing;
pub use rewrite::{FuseStats, FusedOutput, Fusion, FusionError, Remap};
pub use session::{ExecError, Executable, Session, SessionOptions, SharedArenas};
pub use tessera_ops::{DType, Op, TensorMeta};
