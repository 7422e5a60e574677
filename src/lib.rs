//! residency (work in progress)
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod attention;
pub mod error;
pub mod size;

pub use error::{Error, Result};
pub use size::ByteSize;
