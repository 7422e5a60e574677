//! [`Linear`]: `y = x·Wᵀ + b` over the last dimension.

use candle_core::{Module, Tensor};

use super::{cast_bias_weight, to_candle, LayerWeights, OpsBuilder};
use crate::error::{Error, Result, TensorContext};

/// A linear layer whose weight `[out, in]` (and bias `[out]`) are fetched at every forward.
#[derive(Debug, Clone)]
pub struct Linear {
    weights: LayerWeights,
    in_dim: usize,
    out_dim: usize,
}

impl Linear {
    /// Input features.
    pub fn in_dim(&self) -> usize {
        self.in_dim
    }
    /// Output features.
    pub fn out_dim(&self) -> usize {
        self.out_dim
    }
    /// The layer's weights.
    pub fn weights(&self) -> &LayerWeights {
        &self.weights
    }

    /// The forward pass with this crate's errors. `x` is `[..., in]`; the output `[..., out]`.
    pub fn try_forward(&self, x: &Tensor) -> Result<Tensor> {
        super::on_weight_device(&self.weights, x, |e| e, |x| self.forward_here(x))
    }

    /// The forward on the device of the layer's weight.
    fn forward_here(&self, x: &Tensor) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        if dims.last() != Some(&self.in_dim) {
            return Err(Error::ShapeMismatch {
                what: format!("input of linear `{}` (last dim)", self.weights.weight_key()),
                expected: vec![self.in_dim],
                got: dims,
            });
        }
        let x = self.weights.prepare_input(x)?;
        let (w, b) = cast_bias_weight(&self.weights, x.device(), self.weights.mode())?;
        let ctx = || format!("linear `{}`", self.weights.weight_key());
        let rows = dims[..dims.len() - 1].iter().product::<usize>();
        let x2 = if dims.len() == 2 {
            x
        } else {
            x.reshape((rows, self.in_dim)).ctx(ctx)?
        };
        let mut y = x2.matmul(&w.t().ctx(ctx)?).ctx(ctx)?;
        if let Some(b) = b {
            y = y.broadcast_add(&b).ctx(ctx)?;
        }
        if dims.len() == 2 {
            return Ok(y);
        }
        let mut out = dims;
        *out.last_mut().unwrap_or(&mut 0) = self.out_dim;
        y.reshape(out).ctx(ctx)
    }
}

impl Module for Linear {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        self.try_forward(xs).map_err(to_candle)
    }
}

impl OpsBuilder {
    /// A [`Linear`] from `<name>.weight` `[out, in]` and, with `bias`, `<name>.bias` `[out]`.
    ///
    /// # Errors
    /// [`Error::UnknownWeight`] for a missing key, [`Error::ShapeMismatch`] for a weight that is
    /// not 2-d or a bias of the wrong length.
    pub fn linear(&self, name: &str, bias: bool) -> Result<Linear> {
        let weights = self.layer(name, 2, bias, |s| s[0])?;
        let (out_dim, in_dim) = (weights.weight.shape[0], weights.weight.shape[1]);
        Ok(Linear {
            weights,
            in_dim,
            out_dim,
        })
    }

    /// A [`Linear`] whose weight must be `[out_dim, in_dim]`.
    ///
    /// # Errors
    /// As [`OpsBuilder::linear`], and [`Error::ShapeMismatch`] for other dimensions.
    pub fn linear_dims(
        &self,
        name: &str,
        in_dim: usize,
        out_dim: usize,
        bias: bool,
    ) -> Result<Linear> {
        let l = self.linear(name, bias)?;
        OpsBuilder::expect_shape(&l.weights, &[out_dim, in_dim])?;
        Ok(l)
    }
}
