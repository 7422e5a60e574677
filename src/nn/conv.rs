//! Convolutions — [`Conv1d`], [`Conv2d`], [`ConvTranspose1d`], [`ConvTranspose2d`] and their
//! constructors — with candle-nn's config types and forwards, on fetched weights.
//!
//! Weight shapes are candle-nn's: `[out, in / groups, k]` (1-d), `[out, in / groups, k, k]`
//! (2-d), `[in, out / groups, k]` (transposed 1-d), `[in, out, k, k]` (transposed 2-d; candle has
//! no groups there); the bias is `[out]`. Zero groups is refused where candle-nn divides by it.
//!
//! Every public constructor is one layer's `build` (written once, in `conv_layer!`) with or
//! without the bias; the one thing the kinds differ in, the weight shape and its groups check,
//! is each configuration's `WeightShape`.

use candle_core::{Module, Tensor};

pub use candle_nn::{Conv1dConfig, Conv2dConfig, ConvTranspose1dConfig, ConvTranspose2dConfig};

use super::held::{bad_shape, fetch, fetch_on_load_device, input, Held};
use super::VarBuilder;
use crate::ops::LayerWeights;

fn nonzero_groups(vb: &VarBuilder<'_>, groups: usize) -> candle_core::Result<usize> {
    if groups == 0 {
        return Err(bad_shape(
            format!("convolution `{}`: zero groups", vb.key("weight")),
            vec![1],
            vec![0],
        ));
    }
    Ok(groups)
}

macro_rules! conv_layer {
    ($(#[$doc:meta])* $name:ident, $config:ty) => {
        $(#[$doc])*
        #[derive(Debug, Clone)]
        pub struct $name {
            held: Held<candle_nn::$name>,
            config: $config,
        }

        impl $name {
            /// The layer on owned tensors, as candle-nn's `new`: not managed.
            pub fn new(weight: Tensor, bias: Option<Tensor>, config: $config) -> Self {
                $name {
                    held: Held::Owned(candle_nn::$name::new(weight, bias, config)),
                    config,
                }
            }

            /// The managed layer of `weight` under `vb`, of the shape `config` implies, and `bias`
            /// `[out_channels]` when `with_bias`: what every constructor of the kind shares.
            fn build(
                in_channels: usize,
                out_channels: usize,
                kernel_size: usize,
                config: $config,
                vb: VarBuilder<'_>,
                with_bias: bool,
            ) -> candle_core::Result<Self> {
                let shape = config.weight_shape(&vb, in_channels, out_channels, kernel_size)?;
                let weights = vb.weights("weight", &shape, bias(with_bias, out_channels))?;
                Ok($name {
                    held: Held::Fetched(weights),
                    config,
                })
            }

            /// The configuration.
            pub fn config(&self) -> &$config {
                &self.config
            }

            /// The weight: fetched now (patched and cast) for a managed layer.
            ///
            /// # Errors
            /// Errors of the fetch (patch math, cast, a weight wrapper).
            pub fn weight(&self) -> candle_core::Result<Tensor> {
                match &self.held {
                    Held::Owned(l) => Ok(l.weight().clone()),
                    Held::Fetched(w) => fetch_on_load_device(w).map(|(w, _)| w),
                }
            }

            /// The bias `[out]`, if any: fetched now for a managed layer.
            ///
            /// # Errors
            /// As the weight.
            pub fn bias(&self) -> candle_core::Result<Option<Tensor>> {
                match &self.held {
                    Held::Owned(l) => Ok(l.bias().cloned()),
                    Held::Fetched(w) if w.bias_key().is_none() => Ok(None),
                    Held::Fetched(w) => fetch_on_load_device(w).map(|(_, b)| b),
                }
            }

            /// The keys the layer fetches, or `None` for a layer on owned tensors.
            pub fn weights(&self) -> Option<&LayerWeights> {
                match &self.held {
                    Held::Fetched(w) => Some(w),
                    Held::Owned(_) => None,
                }
            }
        }

        impl Module for $name {
            fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
                match &self.held {
                    Held::Owned(l) => l.forward(x),
                    Held::Fetched(w) => {
                        super::held::on_weight_device(w, x, |x| {
                            let x = input(w, x)?;
                            let (weight, bias) = fetch(w, x.device())?;
                            candle_nn::$name::new(weight, bias, self.config).forward(&x)
                        })
                    }
                }
            }
        }
    };
}

conv_layer!(
    /// candle-nn's `Conv1d` (weight `[out, in / groups, k]`) fetched at every forward.
    Conv1d,
    Conv1dConfig
);
conv_layer!(
    /// candle-nn's `Conv2d` (weight `[out, in / groups, k, k]`) fetched at every forward.
    Conv2d,
    Conv2dConfig
);
conv_layer!(
    /// candle-nn's `ConvTranspose1d` (weight `[in, out / groups, k]`) fetched at every forward.
    ConvTranspose1d,
    ConvTranspose1dConfig
);
conv_layer!(
    /// candle-nn's `ConvTranspose2d` (weight `[in, out, k, k]`) fetched at every forward.
    ConvTranspose2d,
    ConvTranspose2dConfig
);

/// The bias request for a constructor: `("bias", out)` when `bias`.
fn bias(bias: bool, out: usize) -> Option<(&'static str, usize)> {
    bias.then_some(("bias", out))
}

/// The weight shape a convolution's configuration implies for its channels and kernel size:
/// the one thing the kinds' constructors do not share.
trait WeightShape {
    /// The shape, or zero groups refused (naming the weight under `vb`) where candle-nn divides
    /// by them.
    fn weight_shape(
        &self,
        vb: &VarBuilder<'_>,
        in_channels: usize,
        out_channels: usize,
        kernel_size: usize,
    ) -> candle_core::Result<Vec<usize>>;
}

impl WeightShape for Conv1dConfig {
    fn weight_shape(
        &self,
        vb: &VarBuilder<'_>,
        in_channels: usize,
        out_channels: usize,
        kernel_size: usize,
    ) -> candle_core::Result<Vec<usize>> {
        let groups = nonzero_groups(vb, self.groups)?;
        Ok(vec![out_channels, in_channels / groups, kernel_size])
    }
}

impl WeightShape for Conv2dConfig {
    fn weight_shape(
        &self,
        vb: &VarBuilder<'_>,
        in_channels: usize,
        out_channels: usize,
        kernel_size: usize,
    ) -> candle_core::Result<Vec<usize>> {
        let groups = nonzero_groups(vb, self.groups)?;
        Ok(vec![
            out_channels,
            in_channels / groups,
            kernel_size,
            kernel_size,
        ])
    }
}

impl WeightShape for ConvTranspose1dConfig {
    fn weight_shape(
        &self,
        vb: &VarBuilder<'_>,
        in_channels: usize,
        out_channels: usize,
        kernel_size: usize,
    ) -> candle_core::Result<Vec<usize>> {
        let groups = nonzero_groups(vb, self.groups)?;
        Ok(vec![in_channels, out_channels / groups, kernel_size])
    }
}

impl WeightShape for ConvTranspose2dConfig {
    fn weight_shape(
        &self,
        _vb: &VarBuilder<'_>,
        in_channels: usize,
        out_channels: usize,
        kernel_size: usize,
    ) -> candle_core::Result<Vec<usize>> {
        // candle has no groups here: nothing to refuse.
        Ok(vec![in_channels, out_channels, kernel_size, kernel_size])
    }
}

/// A [`Conv1d`] from `weight` `[out_channels, in_channels / groups, kernel_size]` and `bias`
/// `[out_channels]` under `vb`.
///
/// # Errors
/// A missing weight, another shape or zero groups: [`crate::Error::UnknownWeight`] /
/// [`crate::Error::ShapeMismatch`] inside candle's error.
pub fn conv1d(
    in_channels: usize,
    out_channels: usize,
    kernel_size: usize,
    cfg: Conv1dConfig,
    vb: VarBuilder<'_>,
) -> candle_core::Result<Conv1d> {
    Conv1d::build(in_channels, out_channels, kernel_size, cfg, vb, true)
}

/// [`conv1d`] without bias.
///
/// # Errors
/// As [`conv1d`].
pub fn conv1d_no_bias(
    in_channels: usize,
    out_channels: usize,
    kernel_size: usize,
    cfg: Conv1dConfig,
    vb: VarBuilder<'_>,
) -> candle_core::Result<Conv1d> {
    Conv1d::build(in_channels, out_channels, kernel_size, cfg, vb, false)
}

/// A [`Conv2d`] from `weight` `[out_channels, in_channels / groups, kernel_size, kernel_size]`
/// and `bias` `[out_channels]` under `vb`.
///
/// # Errors
/// As [`conv1d`].
pub fn conv2d(
    in_channels: usize,
    out_channels: usize,
    kernel_size: usize,
    cfg: Conv2dConfig,
    vb: VarBuilder<'_>,
) -> candle_core::Result<Conv2d> {
    Conv2d::build(in_channels, out_channels, kernel_size, cfg, vb, true)
}

/// [`conv2d`] without bias.
///
/// # Errors
/// As [`conv1d`].
pub fn conv2d_no_bias(
    in_channels: usize,
    out_channels: usize,
    kernel_size: usize,
    cfg: Conv2dConfig,
    vb: VarBuilder<'_>,
) -> candle_core::Result<Conv2d> {
    Conv2d::build(in_channels, out_channels, kernel_size, cfg, vb, false)
}

/// A [`ConvTranspose1d`] from `weight` `[in_channels, out_channels / groups, kernel_size]` and
/// `bias` `[out_channels]` under `vb`.
///
/// # Errors
/// As [`conv1d`].
pub fn conv_transpose1d(
    in_channels: usize,
    out_channels: usize,
    kernel_size: usize,
    cfg: ConvTranspose1dConfig,
    vb: VarBuilder<'_>,
) -> candle_core::Result<ConvTranspose1d> {
    ConvTranspose1d::build(in_channels, out_channels, kernel_size, cfg, vb, true)
}

/// [`conv_transpose1d`] without bias.
///
/// # Errors
/// As [`conv1d`].
pub fn conv_transpose1d_no_bias(
    in_channels: usize,
    out_channels: usize,
    kernel_size: usize,
    cfg: ConvTranspose1dConfig,
    vb: VarBuilder<'_>,
) -> candle_core::Result<ConvTranspose1d> {
    ConvTranspose1d::build(in_channels, out_channels, kernel_size, cfg, vb, false)
}

/// A [`ConvTranspose2d`] from `weight` `[in_channels, out_channels, kernel_size, kernel_size]`
/// and `bias` `[out_channels]` under `vb`.
///
/// # Errors
/// A missing weight or another shape: [`crate::Error::UnknownWeight`] /
/// [`crate::Error::ShapeMismatch`] inside candle's error.
pub fn conv_transpose2d(
    in_channels: usize,
    out_channels: usize,
    kernel_size: usize,
    cfg: ConvTranspose2dConfig,
    vb: VarBuilder<'_>,
) -> candle_core::Result<ConvTranspose2d> {
    ConvTranspose2d::build(in_channels, out_channels, kernel_size, cfg, vb, true)
}

/// [`conv_transpose2d`] without bias.
///
/// # Errors
/// As [`conv_transpose2d`].
pub fn conv_transpose2d_no_bias(
    in_channels: usize,
    out_channels: usize,
    kernel_size: usize,
    cfg: ConvTranspose2dConfig,
    vb: VarBuilder<'_>,
) -> candle_core::Result<ConvTranspose2d> {
    ConvTranspose2d::build(in_channels, out_channels, kernel_size, cfg, vb, false)
}
