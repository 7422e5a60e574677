//! Convolutions: [`Conv1d`], [`Conv2d`], [`ConvTranspose2d`], through candle's `conv1d`,
//! `conv2d` and `conv_transpose2d`.

use candle_core::{Module, Tensor};

use super::{cast_bias_weight, to_candle, LayerWeights, OpsBuilder};
use crate::error::{Error, Result, TensorContext};

/// Padding, stride, dilation and groups of a convolution (defaults 0, 1, 1, 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvConfig {
    /// Zero padding on each side.
    pub padding: usize,
    /// Stride.
    pub stride: usize,
    /// Dilation.
    pub dilation: usize,
    /// Groups (input and output channels are split into this many independent groups).
    pub groups: usize,
}

impl Default for ConvConfig {
    fn default() -> Self {
        ConvConfig {
            padding: 0,
            stride: 1,
            dilation: 1,
            groups: 1,
        }
    }
}

/// Padding, output padding, stride and dilation of a transposed convolution (defaults 0, 0, 1, 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvTransposeConfig {
    /// Padding removed from each side of the output.
    pub padding: usize,
    /// Extra rows/columns added to one side of the output.
    pub output_padding: usize,
    /// Stride.
    pub stride: usize,
    /// Dilation.
    pub dilation: usize,
}

impl Default for ConvTransposeConfig {
    fn default() -> Self {
        ConvTransposeConfig {
            padding: 0,
            output_padding: 0,
            stride: 1,
            dilation: 1,
        }
    }
}

fn check_input(weights: &LayerWeights, x: &Tensor, rank: usize, channels: usize) -> Result<()> {
    let d = x.dims();
    if d.len() != rank || d[1] != channels {
        let mut expected = vec![0; rank];
        expected[1] = channels;
        return Err(Error::ShapeMismatch {
            what: format!(
                "input of `{}` (batch, {channels} channels, spatial dims; 0 = any)",
                weights.weight_key()
            ),
            expected,
            got: d.to_vec(),
        });
    }
    Ok(())
}

fn add_channel_bias(y: Tensor, b: Option<Tensor>, rank: usize) -> candle_core::Result<Tensor> {
    match b {
        None => Ok(y),
        Some(b) => {
            let mut shape = vec![1; rank];
            shape[1] = b.dims1()?;
            y.broadcast_add(&b.reshape(shape)?)
        }
    }
}

/// The forward shared by the grouped convolutions: check the input's rank and channels, fetch
/// and cast the weights, convolve with `op`, add the bias per output channel.
fn conv_forward(
    weights: &LayerWeights,
    config: ConvConfig,
    x: &Tensor,
    rank: usize,
    what: &str,
    op: impl FnOnce(&Tensor, &Tensor) -> candle_core::Result<Tensor>,
) -> Result<Tensor> {
    check_input(weights, x, rank, weights.weight.shape[1] * config.groups)?;
    let x = weights.prepare_input(x)?;
    let (w, b) = cast_bias_weight(weights, x.device(), weights.mode())?;
    let ctx = || format!("{what} `{}`", weights.weight_key());
    let y = op(&x, &w).ctx(ctx)?;
    add_channel_bias(y, b, rank).ctx(ctx)
}

/// A 1-d convolution with weight `[out, in/groups, k]` and bias `[out]`.
#[derive(Debug, Clone)]
pub struct Conv1d {
    weights: LayerWeights,
    config: ConvConfig,
}

impl Conv1d {
    /// The layer's weights.
    pub fn weights(&self) -> &LayerWeights {
        &self.weights
    }
    /// The configuration.
    pub fn config(&self) -> ConvConfig {
        self.config
    }
    /// The forward pass with this crate's errors: `[B, in, L]` → `[B, out, L']`.
    pub fn try_forward(&self, x: &Tensor) -> Result<Tensor> {
        super::on_weight_device(&self.weights, x, |e| e, |x| self.forward_here(x))
    }

    /// The forward on the device of the layer's weight.
    fn forward_here(&self, x: &Tensor) -> Result<Tensor> {
        let c = self.config;
        conv_forward(&self.weights, c, x, 3, "conv1d", |x, w| {
            x.conv1d(w, c.padding, c.stride, c.dilation, c.groups)
        })
    }
}

impl Module for Conv1d {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        self.try_forward(xs).map_err(to_candle)
    }
}

/// A 2-d convolution with weight `[out, in/groups, kh, kw]` and bias `[out]`.
#[derive(Debug, Clone)]
pub struct Conv2d {
    weights: LayerWeights,
    config: ConvConfig,
}

impl Conv2d {
    /// The layer's weights.
    pub fn weights(&self) -> &LayerWeights {
        &self.weights
    }
    /// The configuration.
    pub fn config(&self) -> ConvConfig {
        self.config
    }
    /// The forward pass with this crate's errors: `[B, in, H, W]` → `[B, out, H', W']`.
    pub fn try_forward(&self, x: &Tensor) -> Result<Tensor> {
        super::on_weight_device(&self.weights, x, |e| e, |x| self.forward_here(x))
    }

    /// The forward on the device of the layer's weight.
    fn forward_here(&self, x: &Tensor) -> Result<Tensor> {
        let c = self.config;
        conv_forward(&self.weights, c, x, 4, "conv2d", |x, w| {
            x.conv2d(w, c.padding, c.stride, c.dilation, c.groups)
        })
    }
}

impl Module for Conv2d {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        self.try_forward(xs).map_err(to_candle)
    }
}

/// A 2-d transposed convolution with weight `[in, out, kh, kw]` and bias `[out]` (no groups:
/// candle's `conv_transpose2d` has none).
#[derive(Debug, Clone)]
pub struct ConvTranspose2d {
    weights: LayerWeights,
    config: ConvTransposeConfig,
}

impl ConvTranspose2d {
    /// The layer's weights.
    pub fn weights(&self) -> &LayerWeights {
        &self.weights
    }
    /// The configuration.
    pub fn config(&self) -> ConvTransposeConfig {
        self.config
    }
    /// The forward pass with this crate's errors: `[B, in, H, W]` → `[B, out, H', W']`.
    pub fn try_forward(&self, x: &Tensor) -> Result<Tensor> {
        super::on_weight_device(&self.weights, x, |e| e, |x| self.forward_here(x))
    }

    /// The forward on the device of the layer's weight.
    fn forward_here(&self, x: &Tensor) -> Result<Tensor> {
        let s = &self.weights.weight.shape;
        check_input(&self.weights, x, 4, s[0])?;
        let x = self.weights.prepare_input(x)?;
        let (w, b) = cast_bias_weight(&self.weights, x.device(), self.weights.mode())?;
        let c = self.config;
        let ctx = || format!("conv_transpose2d `{}`", self.weights.weight_key());
        let y = x
            .conv_transpose2d(&w, c.padding, c.output_padding, c.stride, c.dilation)
            .ctx(ctx)?;
        add_channel_bias(y, b, 4).ctx(ctx)
    }
}

impl Module for ConvTranspose2d {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        self.try_forward(xs).map_err(to_candle)
    }
}

impl OpsBuilder {
    /// A [`Conv1d`] from `<name>.weight` `[out, in/groups, k]` and, with `bias`, `<name>.bias`.
    ///
    /// # Errors
    /// [`Error::UnknownWeight`] for a missing key, [`Error::ShapeMismatch`] for a weight that is
    /// not 3-d, a bias of the wrong length, or `out` not divisible by `groups`.
    pub fn conv1d(&self, name: &str, config: ConvConfig, bias: bool) -> Result<Conv1d> {
        let weights = self.layer(name, 3, bias, |s| s[0])?;
        check_groups(&weights, config.groups)?;
        Ok(Conv1d { weights, config })
    }

    /// A [`Conv2d`] from `<name>.weight` `[out, in/groups, kh, kw]` and, with `bias`,
    /// `<name>.bias`.
    ///
    /// # Errors
    /// As [`OpsBuilder::conv1d`], for a 4-d weight.
    pub fn conv2d(&self, name: &str, config: ConvConfig, bias: bool) -> Result<Conv2d> {
        let weights = self.layer(name, 4, bias, |s| s[0])?;
        check_groups(&weights, config.groups)?;
        Ok(Conv2d { weights, config })
    }

    /// A [`ConvTranspose2d`] from `<name>.weight` `[in, out, kh, kw]` and, with `bias`,
    /// `<name>.bias` `[out]`.
    ///
    /// # Errors
    /// [`Error::UnknownWeight`] for a missing key, [`Error::ShapeMismatch`] for a weight that is
    /// not 4-d or a bias of the wrong length.
    pub fn conv_transpose2d(
        &self,
        name: &str,
        config: ConvTransposeConfig,
        bias: bool,
    ) -> Result<ConvTranspose2d> {
        let weights = self.layer(name, 4, bias, |s| s[1])?;
        Ok(ConvTranspose2d { weights, config })
    }
}

fn check_groups(weights: &LayerWeights, groups: usize) -> Result<()> {
    let out = weights.weight.shape[0];
    if groups == 0 || !out.is_multiple_of(groups) {
        return Err(Error::ShapeMismatch {
            what: format!(
                "`{}`: {out} output channels in {groups} groups",
                weights.weight_key()
            ),
            expected: vec![groups.max(1) * out.div_ceil(groups.max(1))],
            got: vec![out],
        });
    }
    Ok(())
}
