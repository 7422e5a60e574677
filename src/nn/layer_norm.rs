//! [`LayerNorm`], [`RmsNorm`] and their constructors [`layer_norm`], [`layer_norm_no_bias`],
//! [`rms_norm`]: candle-nn's normalisations over the last dimension, on fetched weights.
//!
//! The forward is candle-nn 0.11's, step for step: its fused kernel (`ops::layer_norm`,
//! `ops::rms_norm`) on a contiguous input where candle-nn uses it, otherwise statistics in f32 for
//! f16/bf16 inputs (sum / size, not `mean`), so a port computes the same bits.

use candle_core::{DType, Module, Tensor, D};

pub use candle_nn::LayerNormConfig;

use super::held::{fetch, fetch_on_load_device, input, Held};
use super::VarBuilder;
use crate::ops::LayerWeights;

/// candle-nn's `LayerNorm` (which with `remove_mean: false` is an RMS norm) whose weight `[H]`
/// and optional bias `[H]` are fetched at every forward.
#[derive(Debug, Clone)]
pub struct LayerNorm {
    held: Held<candle_nn::LayerNorm>,
    remove_mean: bool,
    eps: f64,
}

impl LayerNorm {
    /// A layer norm on owned tensors, as candle-nn's `LayerNorm::new`: not managed.
    ///
    /// Tensors [`VarBuilder::get`] just returned, unchanged, make a managed layer on their keys
    /// instead (as with every `new` of this module).
    pub fn new(weight: Tensor, bias: Tensor, eps: f64) -> Self {
        match super::held::adopt(&weight, Some(&bias)) {
            Some(w) => LayerNorm::managed(w, true, eps),
            None => LayerNorm::owned(candle_nn::LayerNorm::new(weight, bias, eps), true, eps),
        }
    }

    /// A bias-free layer norm on an owned weight (candle-nn's `LayerNorm::new_no_bias`).
    pub fn new_no_bias(weight: Tensor, eps: f64) -> Self {
        match super::held::adopt(&weight, None) {
            Some(w) => LayerNorm::managed(w, true, eps),
            None => LayerNorm::owned(candle_nn::LayerNorm::new_no_bias(weight, eps), true, eps),
        }
    }

    /// An RMS norm on an owned weight (candle-nn's `LayerNorm::rms_norm`).
    pub fn rms_norm(weight: Tensor, eps: f64) -> Self {
        match super::held::adopt(&weight, None) {
            Some(w) => LayerNorm::managed(w, false, eps),
            None => LayerNorm::owned(candle_nn::LayerNorm::rms_norm(weight, eps), false, eps),
        }
    }

    fn managed(w: LayerWeights, remove_mean: bool, eps: f64) -> Self {
        LayerNorm {
            held: Held::Fetched(w),
            remove_mean,
            eps,
        }
    }

    fn owned(l: candle_nn::LayerNorm, remove_mean: bool, eps: f64) -> Self {
        LayerNorm {
            held: Held::Owned(l),
            remove_mean,
            eps,
        }
    }

    /// The weight `[H]`: fetched now for a managed layer.
    ///
    /// # Errors
    /// Errors of the fetch (patch math, cast, a weight wrapper).
    pub fn weight(&self) -> candle_core::Result<Tensor> {
        match &self.held {
            Held::Owned(l) => Ok(l.weight().clone()),
            Held::Fetched(w) => fetch_on_load_device(w).map(|(w, _)| w),
        }
    }

    /// The bias `[H]`, if any: fetched now for a managed layer.
    ///
    /// # Errors
    /// As [`LayerNorm::weight`].
    pub fn bias(&self) -> candle_core::Result<Option<Tensor>> {
        match &self.held {
            Held::Owned(l) => Ok(l.bias().cloned()),
            Held::Fetched(w) if w.bias_key().is_none() => Ok(None),
            Held::Fetched(w) => fetch_on_load_device(w).map(|(_, b)| b),
        }
    }

    /// The epsilon added to the variance.
    pub fn eps(&self) -> f64 {
        self.eps
    }

    /// Whether the mean is removed (false: an RMS norm).
    pub fn remove_mean(&self) -> bool {
        self.remove_mean
    }

    /// The keys the layer fetches, or `None` for a layer on owned tensors.
    pub fn weights(&self) -> Option<&LayerWeights> {
        match &self.held {
            Held::Fetched(w) => Some(w),
            Held::Owned(_) => None,
        }
    }
}

/// candle-nn 0.11's `LayerNorm::forward` on given tensors.
fn layer_norm_forward(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    remove_mean: bool,
    eps: f64,
) -> candle_core::Result<Tensor> {
    if x.is_contiguous() && remove_mean {
        if let Some(bias) = bias {
            return candle_nn::ops::layer_norm(x, weight, bias, eps as f32);
        }
    }
    let x_dtype = x.dtype();
    let internal_dtype = match x_dtype {
        DType::F16 | DType::BF16 => DType::F32,
        d => d,
    };
    let hidden_size = x.dim(D::Minus1)?;
    let x = x.to_dtype(internal_dtype)?;
    let x = if remove_mean {
        let mean_x = (x.sum_keepdim(D::Minus1)? / hidden_size as f64)?;
        x.broadcast_sub(&mean_x)?
    } else {
        x
    };
    let norm_x = (x.sqr()?.sum_keepdim(D::Minus1)? / hidden_size as f64)?;
    let x_normed = x.broadcast_div(&(norm_x + eps)?.sqrt()?)?;
    let x = x_normed.to_dtype(x_dtype)?.broadcast_mul(weight)?;
    match bias {
        None => Ok(x),
        Some(bias) => x.broadcast_add(bias),
    }
}

impl Module for LayerNorm {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match &self.held {
            Held::Owned(l) => l.forward(x),
            Held::Fetched(w) => super::held::on_weight_device(w, x, |x| {
                let x = input(w, x)?;
                let (weight, bias) = fetch(w, x.device())?;
                layer_norm_forward(&x, &weight, bias.as_ref(), self.remove_mean, self.eps)
            }),
        }
    }
}

/// candle-nn's `RmsNorm`: a [`LayerNorm`] without mean removal or bias, using the fused
/// `ops::rms_norm` on contiguous inputs.
#[derive(Debug, Clone)]
pub struct RmsNorm(LayerNorm);

impl RmsNorm {
    /// An RMS norm on an owned weight, as candle-nn's `RmsNorm::new`: not managed, unless
    /// `weight` is a tensor [`VarBuilder::get`] just returned (Flux's `QkNorm`): then managed.
    pub fn new(weight: Tensor, eps: f64) -> Self {
        RmsNorm(LayerNorm::rms_norm(weight, eps))
    }

    /// The [`LayerNorm`] it is.
    pub fn into_inner(self) -> LayerNorm {
        self.0
    }

    /// The weight `[H]`: fetched now for a managed layer.
    ///
    /// # Errors
    /// As [`LayerNorm::weight`].
    pub fn weight(&self) -> candle_core::Result<Tensor> {
        self.0.weight()
    }

    /// The epsilon.
    pub fn eps(&self) -> f64 {
        self.0.eps()
    }

    /// The unfused forward ([`LayerNorm`]'s), for any layout.
    ///
    /// # Errors
    /// candle's errors, and those of the fetch.
    pub fn forward_diff(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        self.0.forward(xs)
    }
}

impl Module for RmsNorm {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        if !xs.is_contiguous() {
            return self.0.forward(xs);
        }
        match &self.0.held {
            Held::Owned(l) => candle_nn::ops::rms_norm(xs, l.weight(), self.0.eps as f32),
            Held::Fetched(w) => super::held::on_weight_device(w, xs, |xs| {
                let xs = input(w, xs)?;
                let (weight, _) = fetch(w, xs.device())?;
                candle_nn::ops::rms_norm(&xs, &weight, self.0.eps as f32)
            }),
        }
    }
}

/// A [`LayerNorm`] of width `size` under `vb`: `weight` (or `gamma`) `[size]` and, when
/// `config.affine`, `bias` (or `beta`) `[size]` — candle-nn's names and aliases. `config` is a
/// [`LayerNormConfig`] or an `f64` epsilon.
///
/// # Errors
/// A missing weight or another shape: [`crate::Error::UnknownWeight`] /
/// [`crate::Error::ShapeMismatch`] inside candle's error.
pub fn layer_norm<C: Into<LayerNormConfig>>(
    size: usize,
    config: C,
    vb: VarBuilder<'_>,
) -> candle_core::Result<LayerNorm> {
    let config = config.into();
    let weight_name = ["weight", "gamma"]
        .into_iter()
        .find(|name| vb.contains_tensor(name))
        .unwrap_or("weight");
    let bias_name = config.affine.then(|| {
        ["bias", "beta"]
            .into_iter()
            .find(|name| vb.contains_tensor(name))
            .unwrap_or("bias")
    });
    let w = vb.weights(weight_name, &[size], bias_name.map(|b| (b, size)))?;
    Ok(LayerNorm {
        held: Held::Fetched(w),
        remove_mean: config.remove_mean,
        eps: config.eps,
    })
}

/// A [`LayerNorm`] without bias (the mean is removed).
///
/// # Errors
/// As [`layer_norm`].
pub fn layer_norm_no_bias(
    size: usize,
    eps: f64,
    vb: VarBuilder<'_>,
) -> candle_core::Result<LayerNorm> {
    let config = LayerNormConfig {
        eps,
        remove_mean: true,
        affine: false,
    };
    layer_norm(size, config, vb)
}

/// An [`RmsNorm`] of width `size` from `weight` `[size]` under `vb`.
///
/// # Errors
/// As [`layer_norm`].
pub fn rms_norm(size: usize, eps: f64, vb: VarBuilder<'_>) -> candle_core::Result<RmsNorm> {
    let config = LayerNormConfig {
        eps,
        remove_mean: false,
        affine: false,
    };
    Ok(RmsNorm(layer_norm(size, config, vb)?))
}
