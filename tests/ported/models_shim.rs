// The path candle-transformers' image and text models name for their traced layers:
// `crate::models::with_tracing`, mapped to residency's (managed layers). Included at the root of
// a crate that ports such a file, beside `shim.rs`.

/// The ported files' `crate::models::with_tracing`: residency's, on managed layers.
#[allow(unused_imports)]
mod models {
    pub mod with_tracing {
        pub use residency::with_tracing::*;
    }
}
