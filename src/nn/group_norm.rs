//! [`GroupNorm`] and [`group_norm`]: candle-nn's group normalisation of `[B, C, ...]` on fetched
//! weights.

use candle_core::{Module, Tensor};

use super::held::{bad_shape, fetch, input, Held};
use super::VarBuilder;
use crate::ops::LayerWeights;

/// candle-nn's `GroupNorm` whose weight `[C]` and bias `[C]` are fetched at every forward.
#[derive(Debug, Clone)]
pub struct GroupNorm {
    held: Held<candle_nn::GroupNorm>,
    num_channels: usize,
    num_groups: usize,
    eps: f64,
}

/// candle-nn's refusal (`num_groups` must divide `num_channels`), and zero groups, which
/// candle-nn accepts for zero channels and then divides by.
fn check_groups(what: &str, num_channels: usize, num_groups: usize) -> candle_core::Result<()> {
    if num_groups == 0 || !num_channels.is_multiple_of(num_groups) {
        return Err(bad_shape(
            format!("group norm `{what}`: {num_groups} groups must divide {num_channels} channels"),
            vec![num_groups.max(1) * num_channels.div_ceil(num_groups.max(1))],
            vec![num_channels],
        ));
    }
    Ok(())
}

impl GroupNorm {
    /// A group norm on owned tensors, as candle-nn's `GroupNorm::new`: not managed.
    ///
    /// # Errors
    /// When `num_groups` is zero or does not divide `num_channels`.
    pub fn new(
        weight: Tensor,
        bias: Tensor,
        num_channels: usize,
        num_groups: usize,
        eps: f64,
    ) -> candle_core::Result<Self> {
        check_groups("(owned)", num_channels, num_groups)?;
        Ok(GroupNorm {
            held: Held::Owned(candle_nn::GroupNorm::new(
                weight,
                bias,
                num_channels,
                num_groups,
                eps,
            )?),
            num_channels,
            num_groups,
            eps,
        })
    }

    /// The keys the layer fetches, or `None` for a layer on owned tensors.
    pub fn weights(&self) -> Option<&LayerWeights> {
        match &self.held {
            Held::Fetched(w) => Some(w),
            Held::Owned(_) => None,
        }
    }
}

impl Module for GroupNorm {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match &self.held {
            Held::Owned(g) => g.forward(x),
            Held::Fetched(w) => super::held::on_weight_device(w, x, |x| {
                let x = input(w, x)?;
                let (weight, bias) = fetch(w, x.device())?;
                let bias = match bias {
                    Some(b) => b,
                    None => weight.zeros_like()?,
                };
                candle_nn::GroupNorm::new(
                    weight,
                    bias,
                    self.num_channels,
                    self.num_groups,
                    self.eps,
                )?
                .forward(&x)
            }),
        }
    }
}

/// A [`GroupNorm`] of `num_groups` groups over `num_channels` channels from `weight` and `bias`
/// `[num_channels]` under `vb`.
///
/// # Errors
/// A missing weight or another shape ([`crate::Error::UnknownWeight`] /
/// [`crate::Error::ShapeMismatch`]), or `num_groups` zero or not dividing `num_channels`, inside
/// candle's error.
pub fn group_norm(
    num_groups: usize,
    num_channels: usize,
    eps: f64,
    vb: VarBuilder<'_>,
) -> candle_core::Result<GroupNorm> {
    let w = vb.weights("weight", &[num_channels], Some(("bias", num_channels)))?;
    check_groups(w.weight_key(), num_channels, num_groups)?;
    Ok(GroupNorm {
        held: Held::Fetched(w),
        num_channels,
        num_groups,
        eps,
    })
}
