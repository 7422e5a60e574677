//! candle-transformers' `quantized_nn` on managed weights: [`Linear`], [`linear`], [`linear_b`],
//! [`linear_no_bias`], [`Embedding`], [`RmsNorm`], [`layer_norm`], [`layer_norm_no_bias`], built
//! from a [`VarBuilder`] of [`crate::quantized_var_builder`].
//!
//! Each layer holds [`QTensor`] handles and fetches at every forward (resident or streamed,
//! patched where its patcher patches it), then runs candle-transformers' forward on what it
//! fetched: the same bits as candle's layers on the same file. Where candle's layers hold a
//! dequantized tensor (embeddings, biases, norms), these dequantize at each forward instead, so
//! nothing outside the ledger is kept.

use std::sync::Arc;

use candle_core::{Module, Result, Tensor};

use crate::quantized::{QMatMul, QTensor};
use crate::quantized_var_builder::VarBuilder;

/// A quantized embedding table `[vocab, hidden]`: rows dequantized at use.
#[derive(Debug, Clone)]
pub struct Embedding {
    table: QTensor,
    hidden_size: usize,
}

impl Embedding {
    /// The table `weight` `[d1, d2]` under `vb`.
    ///
    /// # Errors
    /// A missing weight or another shape, inside candle's error.
    pub fn new(d1: usize, d2: usize, vb: VarBuilder) -> Result<Self> {
        let table = QTensor::clone(&*vb.get((d1, d2), "weight")?);
        Ok(Embedding {
            table,
            hidden_size: d2,
        })
    }

    /// An embedding on the table `table` `[vocab, hidden]` (a handle from
    /// `gguf_file::Content::tensor`): managed, unlike candle-nn's `Embedding::new` on a
    /// dequantized copy.
    pub fn from_qtensor(table: impl Into<QTensor>, hidden_size: usize) -> Self {
        Embedding {
            table: table.into(),
            hidden_size,
        }
    }

    /// The table, dequantized now (a tensor the caller owns).
    ///
    /// # Errors
    /// As [`QTensor::dequantize`].
    pub fn embeddings(&self) -> Result<Tensor> {
        self.table.dequantize(&self.table.device()?)
    }

    /// The table's handle: [`Linear::from_embedding`] makes a tied output head on it that stays
    /// managed.
    pub fn qtensor(&self) -> &QTensor {
        &self.table
    }

    /// The width of a row.
    pub fn hidden_size(&self) -> usize {
        self.hidden_size
    }
}

impl Module for Embedding {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let mut dims = xs.dims().to_vec();
        dims.push(self.hidden_size);
        let rows = self.table.embedding(&xs.flatten_all()?)?;
        rows.reshape(dims)
    }
}

/// A linear layer `x Wᵀ (+ b)` on a quantized weight.
#[derive(Debug, Clone)]
pub struct Linear {
    weight: QMatMul,
    bias: Option<Bias>,
}

/// A linear layer's bias: owned as given, or a managed weight dequantized at each forward.
#[derive(Debug, Clone)]
enum Bias {
    Owned(Tensor),
    Managed(QTensor),
}

impl Linear {
    /// A layer on `weight` and an optional owned `bias` (candle-transformers' `from_arc`).
    ///
    /// # Errors
    /// As [`QMatMul::from_qtensor`].
    pub fn from_arc(weight: Arc<QTensor>, bias: Option<Tensor>) -> Result<Self> {
        Ok(Linear::from_weights(QMatMul::from_arc(weight)?, bias))
    }

    /// A layer on a ready matmul and an optional owned `bias`.
    pub fn from_weights(weight: QMatMul, bias: Option<Tensor>) -> Self {
        Linear {
            weight,
            bias: bias.map(Bias::Owned),
        }
    }

    /// A tied output head on an embedding's table, managed (a LoRA on the table reaches it).
    ///
    /// # Errors
    /// As [`QMatMul::from_qtensor`].
    pub fn from_embedding(embedding: &Embedding) -> Result<Self> {
        Ok(Linear {
            weight: QMatMul::from_qtensor(embedding.qtensor().clone())?,
            bias: None,
        })
    }

    /// The weight's matmul.
    pub fn weight(&self) -> &QMatMul {
        &self.weight
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = x.apply(&self.weight)?;
        match &self.bias {
            None => Ok(x),
            Some(Bias::Owned(b)) => x.broadcast_add(b),
            Some(Bias::Managed(b)) => x.broadcast_add(&b.dequantize_now(x.device())?),
        }
    }
}

/// `weight` `[out_dim, in_dim]` and, with `bias`, `bias` `[out_dim]` under `vb`.
///
/// # Errors
/// A missing weight or another shape, inside candle's error.
pub fn linear_b(in_dim: usize, out_dim: usize, bias: bool, vb: VarBuilder) -> Result<Linear> {
    let bias = if bias {
        Some(Bias::Managed(QTensor::clone(&*vb.get(out_dim, "bias")?)))
    } else {
        None
    };
    let weight = QMatMul::from_arc(vb.get((out_dim, in_dim), "weight")?)?;
    Ok(Linear { weight, bias })
}

/// [`linear_b`] with a bias.
///
/// # Errors
/// As [`linear_b`].
pub fn linear(in_dim: usize, out_dim: usize, vb: VarBuilder) -> Result<Linear> {
    linear_b(in_dim, out_dim, true, vb)
}

/// [`linear_b`] without a bias.
///
/// # Errors
/// As [`linear_b`].
pub fn linear_no_bias(in_dim: usize, out_dim: usize, vb: VarBuilder) -> Result<Linear> {
    linear_b(in_dim, out_dim, false, vb)
}

/// candle-nn's `LayerNorm` on `weight` (and `bias`) `[size]` under `vb`, dequantized at each
/// forward.
#[derive(Debug, Clone)]
pub struct LayerNorm {
    weight: QTensor,
    bias: Option<QTensor>,
    eps: f64,
}

impl Module for LayerNorm {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let w = self.weight.dequantize_now(xs.device())?;
        let layer = match &self.bias {
            Some(b) => candle_nn::LayerNorm::new(w, b.dequantize_now(xs.device())?, self.eps),
            None => candle_nn::LayerNorm::new_no_bias(w, self.eps),
        };
        layer.forward(xs)
    }
}

/// A [`LayerNorm`] with `weight` and `bias` `[size]` under `vb`.
///
/// # Errors
/// A missing weight or another shape, inside candle's error.
pub fn layer_norm(size: usize, eps: f64, vb: VarBuilder) -> Result<LayerNorm> {
    Ok(LayerNorm {
        weight: QTensor::clone(&*vb.get(size, "weight")?),
        bias: Some(QTensor::clone(&*vb.get(size, "bias")?)),
        eps,
    })
}

/// A [`LayerNorm`] with `weight` `[size]` under `vb` and no bias.
///
/// # Errors
/// As [`layer_norm`].
pub fn layer_norm_no_bias(size: usize, eps: f64, vb: VarBuilder) -> Result<LayerNorm> {
    Ok(LayerNorm {
        weight: QTensor::clone(&*vb.get(size, "weight")?),
        bias: None,
        eps,
    })
}

/// candle-transformers' quantized `RmsNorm`: `ops::rms_norm` on its weight, fetched at each
/// forward.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    weight: QTensor,
    eps: f64,
}

impl RmsNorm {
    /// The norm on `weight` `[size]` under `vb`.
    ///
    /// # Errors
    /// A missing weight or another shape, inside candle's error.
    pub fn new(size: usize, eps: f64, vb: VarBuilder) -> Result<Self> {
        Ok(RmsNorm {
            weight: QTensor::clone(&*vb.get(size, "weight")?),
            eps,
        })
    }

    /// The norm on `weight` (a handle from `gguf_file::Content::tensor`, or an owned candle
    /// `QTensor`).
    ///
    /// # Errors
    /// None today; kept fallible as candle's.
    pub fn from_qtensor(weight: impl Into<QTensor>, eps: f64) -> Result<Self> {
        Ok(RmsNorm {
            weight: weight.into(),
            eps,
        })
    }
}

impl Module for RmsNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let w = match self.weight.fetch_for_forward(x.device()) {
            Ok(fetched) => fetched.dense_on(x.device())?,
            Err(e) => return Err(crate::ops::to_candle(e)),
        };
        candle_nn::ops::rms_norm(x, &w, self.eps as f32)
    }
}
