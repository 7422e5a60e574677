// The paths a ported candle-transformers model file names at its crate root: `crate::candle`
// (candle-core, with `quantized` replaced by residency's managed mirror) and `crate::utils`
// (candle-transformers' own). Every crate that includes a ported file includes this one at its
// root: `include!("<path>/tests/ported/shim.rs");`.

/// The ported files' `candle`: candle-core with `quantized` replaced by residency's mirror.
#[allow(unused_imports)]
mod candle {
    pub use candle_core::*;
    pub mod quantized {
        pub use residency::quantized::*;
    }
}

/// The ported files' `crate::utils`: candle-transformers' own.
#[allow(unused_imports)]
mod utils {
    pub use candle_transformers::utils::*;
}
