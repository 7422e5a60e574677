//! residency (work in progress)
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod error;
pub mod float;
pub mod size;

pub use error::{Error, Result};
pub use float::{Dtype, Fp8Format, Rounding};
pub use size::ByteSize;
