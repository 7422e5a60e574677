//! [`Embedding`]: rows of a `[vocab, hidden]` table picked by integer ids.

use candle_core::{Module, Tensor};

use super::{cast_bias_weight, to_candle, LayerWeights, OpsBuilder};
use crate::error::{Error, Result, TensorContext};

/// An embedding table `[vocab, hidden]` fetched at every forward.
#[derive(Debug, Clone)]
pub struct Embedding {
    weights: LayerWeights,
    vocab: usize,
    hidden: usize,
}

impl Embedding {
    /// Number of rows.
    pub fn vocab_size(&self) -> usize {
        self.vocab
    }
    /// Width of a row.
    pub fn hidden_size(&self) -> usize {
        self.hidden
    }
    /// The layer's weights.
    pub fn weights(&self) -> &LayerWeights {
        &self.weights
    }

    /// The forward pass with this crate's errors: `ids` of any integer dtype and shape `[...]`
    /// give `[..., hidden]` in the compute dtype.
    pub fn try_forward(&self, ids: &Tensor) -> Result<Tensor> {
        super::on_weight_device(&self.weights, ids, |e| e, |ids| self.forward_here(ids))
    }

    /// The forward on the device of the layer's weight.
    fn forward_here(&self, ids: &Tensor) -> Result<Tensor> {
        if ids.dtype().is_float() {
            return Err(Error::UnsupportedDtype {
                dtype: format!("{:?}", ids.dtype()),
                what: format!("ids of embedding `{}`", self.weights.weight_key()),
            });
        }
        let (w, _) = cast_bias_weight(&self.weights, ids.device(), self.weights.mode())?;
        let ctx = || format!("embedding `{}`", self.weights.weight_key());
        let flat = ids.flatten_all().ctx(ctx)?;
        let rows = w.index_select(&flat, 0).ctx(ctx)?;
        let mut shape = ids.dims().to_vec();
        shape.push(self.hidden);
        rows.reshape(shape).ctx(ctx)
    }
}

impl Module for Embedding {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        self.try_forward(xs).map_err(to_candle)
    }
}

impl OpsBuilder {
    /// An [`Embedding`] from `<name>.weight` `[vocab, hidden]`.
    ///
    /// # Errors
    /// [`Error::UnknownWeight`] for a missing key, [`Error::ShapeMismatch`] when it is not 2-d.
    pub fn embedding(&self, name: &str) -> Result<Embedding> {
        let weights = self.layer(name, 2, false, |_| 0)?;
        let (vocab, hidden) = (weights.weight.shape[0], weights.weight.shape[1]);
        Ok(Embedding {
            weights,
            vocab,
            hidden,
        })
    }
}
