//! residency (work in progress)
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod error;
pub mod float;
pub mod loader;
pub mod patcher;
pub mod size;
pub mod vram;
pub mod weights;

pub use error::{Error, Result};
pub use float::{Dtype, Fp8Format, Rounding};
pub use size::ByteSize;

/// The attention backend the dispatcher would pick on this policy's compute device (for the
/// startup report).
pub fn attention_name(policy: &vram::Policy) -> String {
    match policy.config().attention {
        Some(flag) => format!("{flag:?} (requested)"),
        None => "auto".to_string(),
    }
}
