// candle-transformers' `quantized_qwen3_moe` (with `quantized_qwen3` and `fused_moe`) on
// residency: the module the three ported files name as `super::` — candle-core with `quantized`
// = residency's mirror, residency's `quantized_nn`, `quantized_var_builder`, `with_tracing` and
// `nn::moe`. Included as a module by `tests/moe.rs`, `examples/moe.rs` and `benches/moe.rs`:
// `#[path = ".../tests/ported/qwen3_moe_managed.rs"] mod managed;`.

pub mod candle {
    pub use candle_core::*;
    pub mod quantized {
        pub use residency::quantized::*;
    }
}
pub use residency::nn::moe;
pub use residency::{quantized_nn, quantized_var_builder, with_tracing};
pub mod fused_moe {
    include!("fused_moe.rs");
}
pub mod quantized_qwen3 {
    include!("quantized_qwen3.rs");
}
pub mod quantized_qwen3_moe {
    include!("quantized_qwen3_moe.rs");
}
