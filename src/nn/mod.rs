//! candle-nn's layer constructors on residency-managed weights: `use residency::nn as candle_nn;`
//! ports a model written against candle-nn.
//!
//! candle-nn's layers own their tensors, so nothing under them can be evicted. The layers here
//! have candle-nn's names, constructors (same argument order, same config types — candle-nn's own,
//! re-exported), accessors and [`Module`] impls, but hold the *keys* of their weights and fetch
//! them at every forward through [`crate::ops::cast_bias_weight`], like every [`crate::ops`]
//! layer: resident and current ⇒ the resident copy, otherwise patched and cast now (streamed).
//! The forward itself is candle-nn's code run on the fetched tensors (a `candle_nn::Linear` built
//! on them, say), so a port computes what candle-nn computes, bit for bit when the weights are
//! used in their stored dtype.
//!
//! - [`VarBuilder`]: walks weight names by prefix like candle-nn's, made with
//!   [`VarBuilder::from_patcher`] or [`VarBuilder::from_source`] (to switch the patcher of every
//!   layer later with [`crate::ops::OpsSource::set_patcher`]).
//! - Layers: [`Linear`], [`Embedding`], [`LayerNorm`], [`RmsNorm`], [`GroupNorm`], [`Conv1d`],
//!   [`Conv2d`], [`ConvTranspose1d`], [`ConvTranspose2d`], built by the free functions of the same
//!   names as candle-nn's ([`linear()`], [`conv2d()`], [`layer_norm()`], ...). Each also has candle-nn's
//!   `new` on owned tensors; a layer made that way holds them as candle-nn does and is not
//!   managed.
//! - [`moe`]: candle-nn's `moe_gemm_gguf` and `moe_gemm` (mixture-of-experts matmuls) on
//!   CPU and on managed experts: a stacked GGUF tensor's experts are weights of their own, and
//!   a call fetches only the experts its routing names.
//! - The rest of candle-nn that model code uses is re-exported unchanged: [`ops`],
//!   [`Activation`], [`rotary_emb`], [`kv_cache`], [`attention`] (its CPU flash attention and
//!   masks), [`encoding`], [`Init`], [`Module`], ...
//!
//! # What a port keeps, and what it changes
//! `docs/PORTING.md` has the table. In short:
//! - The forward-order hint for prefetch needs no call: the first weight a second forward fetches
//!   marks the first forward's order complete ([`crate::weights::Model::record_use`]), which is
//!   what `finish_forward` would have done. A weight fetched twice within one forward (a tied
//!   head) ends the recorded order early; prefetch then covers the weights up to it, and the rest
//!   are fetched when used (slower, never wrong).
//! - [`VarBuilder::get`] returns a tensor the model then owns: patched and cast when it was
//!   read, but not evicted and not switched by `set_patcher`. Reading it again in the forward keeps
//!   it managed.
//! - Accessors that return a layer's tensors in candle-nn (`Linear::weight`,
//!   `Embedding::embeddings`) return `candle_core::Result<Tensor>` here: a fetched tensor.
//! - Not provided: `batch_norm`, the recurrent layers (`lstm`, `gru`), `VarMap` and the
//!   optimizers (training), which need candle-nn's own `VarBuilder`.
//!
//! # Invariants
//! - I3 (streaming is invisible): every fetched layer reads its weights through
//!   [`crate::ops::cast_bias_weight`], so its output has the same bits whatever the residency.
//! - No user input panics: bad shapes, missing weights and zero groups are typed errors
//!   ([`crate::Error::ShapeMismatch`], [`crate::Error::UnknownWeight`]) wrapped in candle's error,
//!   where candle-nn divides by zero or fails later.

pub mod conv;
pub mod embedding;
pub mod group_norm;
pub(crate) mod held;
pub mod layer_norm;
pub mod linear;
pub mod moe;
#[cfg(test)]
mod tests;
pub mod var_builder;

pub use candle_core::{Module, ModuleT};
pub use candle_nn::{
    activation, attention, cpu_flash_attention, encoding, func, func_t, init, kv_cache, loss, ops,
    prelu, rotary_emb, sampling, seq, sequential, Activation, Dropout, Func, FuncT, Init, PReLU,
    Sequential,
};

pub use conv::{
    conv1d, conv1d_no_bias, conv2d, conv2d_no_bias, conv_transpose1d, conv_transpose1d_no_bias,
    conv_transpose2d, conv_transpose2d_no_bias, Conv1d, Conv1dConfig, Conv2d, Conv2dConfig,
    ConvTranspose1d, ConvTranspose1dConfig, ConvTranspose2d, ConvTranspose2dConfig,
};
pub use embedding::{embedding, Embedding};
pub use group_norm::{group_norm, GroupNorm};
pub use layer_norm::{
    layer_norm, layer_norm_no_bias, rms_norm, LayerNorm, LayerNormConfig, RmsNorm,
};
pub use linear::{linear, linear_b, linear_no_bias, Linear};
pub use var_builder::{Param, VarBuilder};
