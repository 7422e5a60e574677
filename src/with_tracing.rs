//! candle-transformers' `models::with_tracing` on managed layers: the same names, constructors and
//! `Module` impls (each layer enters a `TRACE` span around its forward, as upstream's do), built
//! on [`crate::nn`], so a candle-transformers model file that imports
//! `crate::models::with_tracing::{...}` ports with its `use` lines alone — the including crate
//! maps `models::with_tracing` here (`tests/ported/models_shim.rs` shows the lines).
//!
//! Differences from upstream, as everywhere in [`crate::nn`]: accessors that return a layer's
//! tensor fetch it ([`Embedding::embeddings`] returns the fetched table by value), and
//! `from_weights` on a tensor [`VarBuilder::get`] just returned builds the managed layer on its
//! key. [`QMatMul`] is upstream's wrapper on [`crate::quantized::QMatMul`] (a managed quantized
//! weight fetched at every forward), so quantized model files that import it from
//! `with_tracing` (`quantized_qwen3`, `quantized_qwen3_moe`) port the same way.

use candle_core::{Module, Result, Tensor};

use crate::nn::VarBuilder;

/// A managed embedding table whose forward is traced.
#[derive(Debug, Clone)]
pub struct Embedding {
    inner: crate::nn::Embedding,
    span: tracing::Span,
}

impl Embedding {
    /// The table `[d1, d2]` under `vb` (`weight`).
    ///
    /// # Errors
    /// A missing weight or another shape, typed inside candle's error.
    pub fn new(d1: usize, d2: usize, vb: VarBuilder) -> Result<Self> {
        let inner = crate::nn::embedding(d1, d2, vb)?;
        let span = tracing::span!(tracing::Level::TRACE, "embedding");
        Ok(Self { inner, span })
    }

    /// An embedding on a table `[vocab, hidden]` (managed when `vb.get` just returned it).
    ///
    /// # Errors
    /// A table that is not two-dimensional.
    pub fn from_weights(weights: Tensor) -> Result<Self> {
        let (_in_size, out_size) = weights.dims2()?;
        let inner = crate::nn::Embedding::new(weights, out_size);
        let span = tracing::span!(tracing::Level::TRACE, "embedding");
        Ok(Self { inner, span })
    }

    /// The table, fetched now for a managed embedding (upstream returns `&Tensor`; code such as
    /// T5's tied head, `x.matmul(&shared.embeddings().t()?)`, compiles unchanged on this). A
    /// failed fetch panics, naming the weight: see [`crate::nn::Embedding::embeddings`].
    pub fn embeddings(&self) -> Tensor {
        self.inner.embeddings()
    }

    /// The table, fetched now, or the fetch's error.
    ///
    /// # Errors
    /// Errors of the fetch.
    pub fn try_embeddings(&self) -> Result<Tensor> {
        self.inner.try_embeddings()
    }
}

impl Module for Embedding {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let _enter = self.span.enter();
        self.inner.forward(xs)
    }
}

/// A managed linear layer whose forward is traced.
#[derive(Debug, Clone)]
pub struct Linear {
    inner: crate::nn::Linear,
    span: tracing::Span,
}

impl Linear {
    /// A linear layer on `weights` `[out, in]` and `bias`: managed when `vb.get` just returned
    /// them, or when `weights` is the table a managed embedding just fetched (upstream's tied
    /// head, `Linear::from_weights(embed.embeddings().clone(), None)`): see
    /// [`crate::nn::Linear::new`].
    pub fn from_weights(weights: Tensor, bias: Option<Tensor>) -> Self {
        let inner = crate::nn::Linear::new(weights, bias);
        let span = tracing::span!(tracing::Level::TRACE, "linear");
        Self { inner, span }
    }

    /// The layer it wraps.
    pub fn inner(&self) -> &crate::nn::Linear {
        &self.inner
    }
}

/// [`linear`] when `b`, else [`linear_no_bias`].
///
/// # Errors
/// As [`crate::nn::linear()`].
pub fn linear_b(d1: usize, d2: usize, b: bool, vb: VarBuilder) -> Result<Linear> {
    let inner = crate::nn::linear_b(d1, d2, b, vb)?;
    let span = tracing::span!(tracing::Level::TRACE, "linear");
    Ok(Linear { inner, span })
}

/// A linear layer `d1 → d2` with bias.
///
/// # Errors
/// As [`crate::nn::linear()`].
pub fn linear(d1: usize, d2: usize, vb: VarBuilder) -> Result<Linear> {
    let inner = crate::nn::linear(d1, d2, vb)?;
    let span = tracing::span!(tracing::Level::TRACE, "linear");
    Ok(Linear { inner, span })
}

/// A linear layer `d1 → d2` without bias.
///
/// # Errors
/// As [`crate::nn::linear()`].
pub fn linear_no_bias(d1: usize, d2: usize, vb: VarBuilder) -> Result<Linear> {
    let inner = crate::nn::linear_no_bias(d1, d2, vb)?;
    let span = tracing::span!(tracing::Level::TRACE, "linear");
    Ok(Linear { inner, span })
}

impl Module for Linear {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let _enter = self.span.enter();
        self.inner.forward(xs)
    }
}

/// A managed 2-d convolution whose forward is traced.
#[derive(Debug, Clone)]
pub struct Conv2d {
    inner: crate::nn::Conv2d,
    span: tracing::Span,
}

impl Module for Conv2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _enter = self.span.enter();
        self.inner.forward(x)
    }
}

/// A 2-d convolution under `vs` (`weight`, `bias`).
///
/// # Errors
/// As [`crate::nn::conv2d()`].
pub fn conv2d(
    in_channels: usize,
    out_channels: usize,
    kernel_size: usize,
    cfg: crate::nn::Conv2dConfig,
    vs: VarBuilder,
) -> Result<Conv2d> {
    let span = tracing::span!(tracing::Level::TRACE, "conv2d");
    let inner = crate::nn::conv2d(in_channels, out_channels, kernel_size, cfg, vs)?;
    Ok(Conv2d { inner, span })
}

/// A managed layer norm whose forward is traced.
#[derive(Clone, Debug)]
pub struct LayerNorm {
    inner: crate::nn::LayerNorm,
    span: tracing::Span,
}

impl LayerNorm {
    /// A layer norm on `weight` and `bias` (managed when `vb.get` just returned them).
    pub fn new(weight: Tensor, bias: Tensor, eps: f64) -> Self {
        let inner = crate::nn::LayerNorm::new(weight, bias, eps);
        let span = tracing::span!(tracing::Level::TRACE, "layer-norm");
        Self { inner, span }
    }
}

impl Module for LayerNorm {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let _enter = self.span.enter();
        self.inner.forward(xs)
    }
}

/// A layer norm of `size` under `vb`.
///
/// # Errors
/// As [`crate::nn::layer_norm()`].
pub fn layer_norm<C: Into<crate::nn::LayerNormConfig>>(
    size: usize,
    c: C,
    vb: VarBuilder,
) -> Result<LayerNorm> {
    let inner = crate::nn::layer_norm(size, c, vb)?;
    let span = tracing::span!(tracing::Level::TRACE, "layer-norm");
    Ok(LayerNorm { inner, span })
}

/// A managed RMS norm whose forward is traced.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    inner: crate::nn::RmsNorm,
    span: tracing::Span,
}

impl RmsNorm {
    /// An RMS norm of `size` under `vb` (`weight`).
    ///
    /// # Errors
    /// As [`crate::nn::rms_norm()`].
    pub fn new(size: usize, eps: f64, vb: VarBuilder) -> Result<Self> {
        let span = tracing::span!(tracing::Level::TRACE, "rms-norm");
        let inner = crate::nn::rms_norm(size, eps, vb)?;
        Ok(Self { inner, span })
    }

    /// candle-nn's differentiable (unfused) forward.
    ///
    /// # Errors
    /// As the forward.
    pub fn forward_diff(&self, x: &Tensor) -> Result<Tensor> {
        let _enter = self.span.enter();
        self.inner.forward_diff(x)
    }
}

impl Module for RmsNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _enter = self.span.enter();
        self.inner.forward(x)
    }
}

/// candle's `QMatMul` on a managed quantized weight, its forward traced (upstream's
/// `with_tracing::QMatMul`).
#[derive(Clone)]
pub struct QMatMul {
    inner: crate::quantized::QMatMul,
    span: tracing::Span,
}

impl QMatMul {
    /// The weight `weight` `[out_dim, in_dim]` under `vb` (upstream asks for the shape
    /// `(in_dim, out_dim)`, candle's GGUF order; so does this).
    ///
    /// # Errors
    /// A missing weight or another shape, typed inside candle's error.
    pub fn new(
        out_dim: usize,
        in_dim: usize,
        vb: crate::quantized_var_builder::VarBuilder,
    ) -> Result<Self> {
        let ws = vb.get((in_dim, out_dim), "weight")?;
        QMatMul::from_weights(ws)
    }

    /// A matmul on a weight handle (managed or owned).
    ///
    /// # Errors
    /// candle's errors for an owned tensor.
    pub fn from_weights(ws: std::sync::Arc<crate::quantized::QTensor>) -> Result<Self> {
        let inner = crate::quantized::QMatMul::from_arc(ws)?;
        let span = tracing::span!(tracing::Level::TRACE, "qmatmul");
        Ok(Self { inner, span })
    }
}

impl Module for QMatMul {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let _enter = self.span.enter();
        self.inner.forward(xs)
    }
}

impl std::fmt::Debug for QMatMul {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "QMatMul")
    }
}
