//! # tessera-ops: the op vocabulary
//!
//! Everything a backend and a graph agree on: element types ([`DType`]), tensor descriptors in
//! **ggml dimension order** ([`TensorMeta`]: `ne[0]` is the innermost, contiguous dimension), the
//! [`Op`] enum with typed parameters, pure shape/dtype inference ([`infer`]) with errors that name
//! the op and the shapes ([`OpError`]), a cost model ([`cost`]), host element access ([`host`]),
//! and the plain f64 reference implementation of every op ([`reference`](mod@reference)).

mod dtype;
mod elem_program;
mod error;
pub mod host;
mod kernel_error;
mod meta;
mod op;
pub mod quant;
pub mod reference;
mod rules;
pub mod sample;

pub use dtype::DType;
pub use elem_program::{ElemArg, ElemInstr, ElemProgram, MAX_ELEM_INPUTS, MAX_ELEM_INSTRS};
pub use error::OpError;
pub use kernel_error::{KernelError, checked_ragged_slots, checked_seq_offsets, checked_slots};
pub use meta::{MAX_DIMS, TensorMeta};
pub use op::{
    BinaryOp, DeltaNetAlgo, Family, FlashAttnInputs, FlashAttnParams, GatedDeltaNetFusedParams, GatedDeltaNetParams,
    HeadMap, Op, RmsNormMulRopeParams, RmsNormParams, RopePairing, RopeParams, ScaleParams, SoftmaxParams, SortOrder,
    UnaryOp, ViewParams,
};
pub use rules::{Cost, cost, infer};
