//! Normalisations: [`LayerNorm`], [`GroupNorm`], [`RmsNorm`].
//!
//! Which kernel (`benches/kernels.rs` measures both in one run; 2-core CPU, `[2048, 768]`):
//! - [`LayerNorm`] and [`RmsNorm`] use candle-nn's fused `ops::layer_norm` / `ops::rms_norm` on
//!   contiguous f32/f16/bf16 inputs: one pass per row, statistics in f32, 8.1× (layer norm, f32),
//!   24× (bf16), 6.8× (rms norm, f32) and 2.9× (bf16) faster than ours. The fused layer norm takes
//!   the variance as `E[x²] − mean²` in f32, less exact than our two passes when a row's mean is
//!   large against its spread.
//! - Ours, below, for other layouts and dtypes (f64) and for [`GroupNorm`], which candle-nn has no
//!   fused kernel for: statistics in f32 for f16/bf16 inputs (in the input dtype otherwise), the
//!   result cast back before the affine weight and bias are applied.

use candle_core::{DType, Module, Tensor, D};

use super::{cast_bias_weight, is_half, to_candle, LayerWeights, OpsBuilder};
use crate::error::{Error, Result, TensorContext};

fn internal(x: &Tensor) -> candle_core::Result<(Tensor, DType)> {
    let dt = x.dtype();
    if is_half(dt) {
        Ok((x.to_dtype(DType::F32)?, dt))
    } else {
        Ok((x.clone(), dt))
    }
}

/// Whether candle-nn's fused norm kernels take `x`: contiguous, f32/f16/bf16.
fn fused_applies(x: &Tensor) -> bool {
    x.is_contiguous() && matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16)
}

/// `(x − mean) / √(var + eps)` over dimension `dim` (biased variance).
fn standardize(x: &Tensor, dim: usize, eps: f64) -> candle_core::Result<Tensor> {
    let mean = x.mean_keepdim(dim)?;
    let xc = x.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(dim)?;
    xc.broadcast_div(&(var + eps)?.sqrt()?)
}

/// Layer normalisation over the last dimension with weight `[H]` and optional bias `[H]`.
#[derive(Debug, Clone)]
pub struct LayerNorm {
    weights: LayerWeights,
    eps: f64,
}

impl LayerNorm {
    /// The layer's weights.
    pub fn weights(&self) -> &LayerWeights {
        &self.weights
    }
    /// The epsilon added to the variance.
    pub fn eps(&self) -> f64 {
        self.eps
    }
    /// The forward pass with this crate's errors: `[..., H]` → `[..., H]`.
    pub fn try_forward(&self, x: &Tensor) -> Result<Tensor> {
        super::on_weight_device(&self.weights, x, |e| e, |x| self.forward_here(x))
    }

    /// The forward on the device of the layer's weight.
    fn forward_here(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.weights.weight.shape[0];
        if x.dims().last() != Some(&h) {
            return Err(Error::ShapeMismatch {
                what: format!("input of layer norm `{}`", self.weights.weight_key()),
                expected: vec![h],
                got: x.dims().to_vec(),
            });
        }
        let x = self.weights.prepare_input(x)?;
        let (w, b) = cast_bias_weight(&self.weights, x.device(), self.weights.mode())?;
        let ctx = || format!("layer norm `{}`", self.weights.weight_key());
        if fused_applies(&x) {
            let b = match b {
                Some(b) => b,
                None => w.zeros_like().ctx(ctx)?,
            };
            return candle_nn::ops::layer_norm(&x, &w, &b, self.eps as f32).ctx(ctx);
        }
        let (xi, dt) = internal(&x).ctx(ctx)?;
        let last = xi.rank() - 1;
        let y = standardize(&xi, last, self.eps)
            .and_then(|y| y.to_dtype(dt))
            .and_then(|y| y.broadcast_mul(&w))
            .ctx(ctx)?;
        match b {
            Some(b) => y.broadcast_add(&b).ctx(ctx),
            None => Ok(y),
        }
    }
}

impl Module for LayerNorm {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        self.try_forward(xs).map_err(to_candle)
    }
}

/// Group normalisation of `[B, C, ...]` over groups of `C / groups` channels and all spatial
/// positions, with per-channel weight `[C]` and bias `[C]`.
#[derive(Debug, Clone)]
pub struct GroupNorm {
    weights: LayerWeights,
    groups: usize,
    eps: f64,
}

impl GroupNorm {
    /// The layer's weights.
    pub fn weights(&self) -> &LayerWeights {
        &self.weights
    }
    /// Number of groups.
    pub fn groups(&self) -> usize {
        self.groups
    }
    /// The forward pass with this crate's errors.
    pub fn try_forward(&self, x: &Tensor) -> Result<Tensor> {
        super::on_weight_device(&self.weights, x, |e| e, |x| self.forward_here(x))
    }

    /// The forward on the device of the layer's weight.
    fn forward_here(&self, x: &Tensor) -> Result<Tensor> {
        let c = self.weights.weight.shape[0];
        let dims = x.dims().to_vec();
        if dims.len() < 2 || dims[1] != c {
            return Err(Error::ShapeMismatch {
                what: format!(
                    "input of group norm `{}` (batch, channels, ...)",
                    self.weights.weight_key()
                ),
                expected: vec![0, c],
                got: dims,
            });
        }
        let x = self.weights.prepare_input(x)?;
        let (w, b) = cast_bias_weight(&self.weights, x.device(), self.weights.mode())?;
        let ctx = || format!("group norm `{}`", self.weights.weight_key());
        let (xi, dt) = internal(&x).ctx(ctx)?;
        let n = dims[0];
        let per_group = xi.elem_count() / (n * self.groups).max(1);
        let mut cshape = vec![1; dims.len()];
        cshape[1] = c;
        let y = xi
            .reshape((n, self.groups, per_group))
            .and_then(|g| standardize(&g, 2, self.eps))
            .and_then(|y| y.reshape(dims.as_slice()))
            .and_then(|y| y.to_dtype(dt))
            .and_then(|y| y.broadcast_mul(&w.reshape(cshape.as_slice())?))
            .ctx(ctx)?;
        match b {
            Some(b) => y
                .broadcast_add(&b.reshape(cshape.as_slice()).ctx(ctx)?)
                .ctx(ctx),
            None => Ok(y),
        }
    }
}

impl Module for GroupNorm {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        self.try_forward(xs).map_err(to_candle)
    }
}

/// RMS normalisation over the last dimension: `x / √(mean(x²) + eps) · w`.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    weights: LayerWeights,
    eps: f64,
}

impl RmsNorm {
    /// The layer's weights.
    pub fn weights(&self) -> &LayerWeights {
        &self.weights
    }
    /// The forward pass with this crate's errors: `[..., H]` → `[..., H]`.
    pub fn try_forward(&self, x: &Tensor) -> Result<Tensor> {
        super::on_weight_device(&self.weights, x, |e| e, |x| self.forward_here(x))
    }

    /// The forward on the device of the layer's weight.
    fn forward_here(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.weights.weight.shape[0];
        if x.dims().last() != Some(&h) {
            return Err(Error::ShapeMismatch {
                what: format!("input of rms norm `{}`", self.weights.weight_key()),
                expected: vec![h],
                got: x.dims().to_vec(),
            });
        }
        let x = self.weights.prepare_input(x)?;
        let (w, _) = cast_bias_weight(&self.weights, x.device(), self.weights.mode())?;
        let ctx = || format!("rms norm `{}`", self.weights.weight_key());
        if fused_applies(&x) {
            return candle_nn::ops::rms_norm(&x, &w, self.eps as f32).ctx(ctx);
        }
        let (xi, dt) = internal(&x).ctx(ctx)?;
        xi.sqr()
            .and_then(|s| s.mean_keepdim(D::Minus1))
            .and_then(|m| (m + self.eps)?.sqrt())
            .and_then(|r| xi.broadcast_div(&r))
            .and_then(|y| y.to_dtype(dt))
            .and_then(|y| y.broadcast_mul(&w))
            .ctx(ctx)
    }
}

impl Module for RmsNorm {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        self.try_forward(xs).map_err(to_candle)
    }
}

impl OpsBuilder {
    /// A [`LayerNorm`] from `<name>.weight` `[H]` and, with `bias`, `<name>.bias` `[H]`.
    ///
    /// # Errors
    /// [`Error::UnknownWeight`] for a missing key, [`Error::ShapeMismatch`] for a weight that is
    /// not 1-d or a bias of another length.
    pub fn layer_norm(&self, name: &str, eps: f64, bias: bool) -> Result<LayerNorm> {
        let weights = self.layer(name, 1, bias, |s| s[0])?;
        Ok(LayerNorm { weights, eps })
    }

    /// A [`GroupNorm`] of `groups` groups from `<name>.weight` `[C]` and `<name>.bias` `[C]`.
    ///
    /// # Errors
    /// As [`OpsBuilder::layer_norm`], and [`Error::ShapeMismatch`] when `C` is not a multiple of
    /// `groups`.
    pub fn group_norm(&self, name: &str, groups: usize, eps: f64) -> Result<GroupNorm> {
        let weights = self.layer(name, 1, true, |s| s[0])?;
        let c = weights.weight.shape[0];
        if groups == 0 || c % groups != 0 {
            return Err(Error::ShapeMismatch {
                what: format!(
                    "group norm `{}`: {c} channels in {groups} groups",
                    weights.weight_key()
                ),
                expected: vec![groups.max(1) * c.div_ceil(groups.max(1))],
                got: vec![c],
            });
        }
        Ok(GroupNorm {
            weights,
            groups,
            eps,
        })
    }

    /// An [`RmsNorm`] from `<name>.weight` `[H]`.
    ///
    /// # Errors
    /// [`Error::UnknownWeight`] for a missing key, [`Error::ShapeMismatch`] when it is not 1-d.
    pub fn rms_norm(&self, name: &str, eps: f64) -> Result<RmsNorm> {
        let weights = self.layer(name, 1, false, |_| 0)?;
        Ok(RmsNorm { weights, eps })
    }
}
