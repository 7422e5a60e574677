//! [`Linear`] and its constructors [`linear`], [`linear_no_bias`], [`linear_b`]: `y = x·Wᵀ + b`,
//! candle-nn's forward on fetched weights.

use candle_core::{Module, Tensor};

use super::held::{fetch, fetch_on_load_device, input, Held};
use super::{Embedding, VarBuilder};
use crate::ops::{to_candle, LayerWeights};

/// candle-nn's `Linear` whose weight `[out, in]` and bias `[out]` are fetched at every forward.
#[derive(Debug, Clone)]
pub struct Linear {
    held: Held<candle_nn::Linear>,
    /// The managed weight whose fetched copy `new` was given (see [`Linear::copies_managed`]).
    copies: Option<String>,
}

impl Linear {
    /// A linear layer on owned tensors, as candle-nn's `Linear::new`: not managed — unless
    /// `weight` (and `bias`) are tensors [`VarBuilder::get`] just returned, unchanged: then the
    /// layer fetches those keys instead (the tensors are dropped with the call), as [`linear`]
    /// would have built it.
    ///
    /// Given, without a bias, the table a managed [`Embedding::embeddings`] just fetched (a tied
    /// head spelled as upstream, `Linear::new(emb.embeddings().clone(), None)`), the layer fetches the
    /// embedding's weight, as [`Linear::from_embedding`] does: managed, evicted with it, patched
    /// by a LoRA on it. With a bias (or once the embedding's model is gone) it is an unmanaged
    /// copy, which is warned about and reported by [`Linear::copies_managed`].
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        if let Some(w) = super::held::adopt(&weight, bias.as_ref()) {
            return Linear::fetched(w);
        }
        if bias.is_none() {
            if let Some(w) = super::held::adopt_handed_out(&weight) {
                return Linear::fetched(w);
            }
        }
        let copies = super::held::handed_out(&weight);
        if let Some(what) = &copies {
            let text = format!(
                "Linear::new on the fetched table of managed embedding {what} with a bias: the layer is an unmanaged copy (outside the ledger, and a LoRA on the embedding will not reach it)"
            );
            tracing::warn!("{text}");
            crate::warnings::echo(&format!("linear-table:{what}"), || text);
        }
        Linear {
            held: Held::Owned(candle_nn::Linear::new(weight, bias)),
            copies,
        }
    }

    /// The managed weight this layer holds an unmanaged copy of, when it was made with
    /// [`Linear::new`] on a table a managed [`Embedding::embeddings`] fetched and a bias (a
    /// bias-free one is adopted: it fetches the table's weight).
    pub fn copies_managed(&self) -> Option<&str> {
        self.copies.as_deref()
    }

    /// A bias-free linear layer that fetches `embedding`'s table as its weight: the managed form
    /// of a tied output head (candle-nn: `Linear::new(emb.embeddings().clone(), None)`).
    pub fn from_embedding(embedding: &Embedding) -> Self {
        match embedding.held() {
            Held::Fetched(w) => Linear {
                held: Held::Fetched(w.clone()),
                copies: None,
            },
            Held::Owned(e) => Linear::new(e.embeddings().clone(), None),
        }
    }

    pub(crate) fn fetched(weights: LayerWeights) -> Self {
        Linear {
            held: Held::Fetched(weights),
            copies: None,
        }
    }

    /// The weight `[out, in]`: fetched now (patched and cast) for a managed layer.
    ///
    /// # Errors
    /// Errors of the fetch (patch math, cast, a weight wrapper).
    pub fn weight(&self) -> candle_core::Result<Tensor> {
        match &self.held {
            Held::Owned(l) => Ok(l.weight().clone()),
            Held::Fetched(w) => fetch_on_load_device(w).map(|(w, _)| w),
        }
    }

    /// The bias `[out]`, if the layer has one: fetched now for a managed layer.
    ///
    /// # Errors
    /// As [`Linear::weight`].
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

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match &self.held {
            Held::Owned(l) => l.forward(x),
            Held::Fetched(w) => {
                let in_dim = w.weight_shape()[1];
                if x.dims().last() != Some(&in_dim) {
                    return Err(to_candle(crate::Error::ShapeMismatch {
                        what: format!("input of linear `{}` (last dim)", w.weight_key()),
                        expected: vec![in_dim],
                        got: x.dims().to_vec(),
                    }));
                }
                super::held::on_weight_device(w, x, |x| {
                    let x = input(w, x)?;
                    let (weight, bias) = fetch(w, x.device())?;
                    candle_nn::Linear::new(weight, bias).forward(&x)
                })
            }
        }
    }
}

/// A [`Linear`] from `weight` `[out_dim, in_dim]` and `bias` `[out_dim]` under `vb`.
///
/// # Errors
/// A missing weight or another shape: [`crate::Error::UnknownWeight`] /
/// [`crate::Error::ShapeMismatch`] inside candle's error.
pub fn linear(in_dim: usize, out_dim: usize, vb: VarBuilder<'_>) -> candle_core::Result<Linear> {
    let w = vb.weights("weight", &[out_dim, in_dim], Some(("bias", out_dim)))?;
    Ok(Linear::fetched(w))
}

/// A [`Linear`] from `weight` `[out_dim, in_dim]` alone.
///
/// # Errors
/// As [`linear`].
pub fn linear_no_bias(
    in_dim: usize,
    out_dim: usize,
    vb: VarBuilder<'_>,
) -> candle_core::Result<Linear> {
    let w = vb.weights("weight", &[out_dim, in_dim], None)?;
    Ok(Linear::fetched(w))
}

/// [`linear`] when `bias`, else [`linear_no_bias`].
///
/// # Errors
/// As [`linear`].
pub fn linear_b(
    in_dim: usize,
    out_dim: usize,
    bias: bool,
    vb: VarBuilder<'_>,
) -> candle_core::Result<Linear> {
    if bias {
        linear(in_dim, out_dim, vb)
    } else {
        linear_no_bias(in_dim, out_dim, vb)
    }
}
