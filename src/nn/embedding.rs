//! [`Embedding`] and [`embedding`]: rows of a `[vocab, hidden]` table picked by integer ids,
//! candle-nn's forward on the fetched table.

use candle_core::{Module, Tensor};

use super::held::{fetch, fetch_on_load_device, note_handed_out, Held};
use super::VarBuilder;
use crate::ops::LayerWeights;

/// candle-nn's `Embedding` whose table `[vocab, hidden]` is fetched at every forward.
#[derive(Debug, Clone)]
pub struct Embedding {
    held: Held<candle_nn::Embedding>,
    hidden_size: usize,
}

impl Embedding {
    /// An embedding on an owned table, as candle-nn's `Embedding::new`: not managed.
    ///
    /// A table [`super::VarBuilder::get`] just returned, unchanged, makes a managed embedding on
    /// its key instead.
    pub fn new(embeddings: Tensor, hidden_size: usize) -> Self {
        if let Some(w) = super::held::adopt(&embeddings, None) {
            return Embedding {
                held: Held::Fetched(w),
                hidden_size,
            };
        }
        Embedding {
            held: Held::Owned(candle_nn::Embedding::new(embeddings, hidden_size)),
            hidden_size,
        }
    }

    /// The table `[vocab, hidden]`: fetched now (patched and cast) for a managed layer.
    /// candle-nn's signature but for the reference, so upstream's tied head,
    /// `Linear::new(emb.embeddings().clone(), None)`, compiles unchanged — and that layer is
    /// managed: [`super::Linear::new`] recognises the table and fetches the embedding's weight
    /// (as [`super::Linear::from_embedding`] does).
    ///
    /// # Panics
    /// When the fetch fails (the load device out of memory, the weight's file changed
    /// underneath, patch math): candle-nn's accessor cannot fail, so there is no table to return
    /// that would not be wrong (an empty one made a later op fail far from the cause, or compute
    /// an empty result). The message, logged at error level first, names the weight, its model
    /// and the cause. [`Embedding::try_embeddings`] returns the error instead, and
    /// [`super::Linear::from_embedding`] builds a tied head without fetching at all.
    pub fn embeddings(&self) -> Tensor {
        match self.try_embeddings() {
            Ok(t) => t,
            Err(e) => {
                let weight = self.weights().map_or_else(
                    || "the owned table".to_string(),
                    |w| {
                        let model = w.source().patcher().model().name().to_string();
                        format!("`{}` of `{model}`", w.weight_key())
                    },
                );
                tracing::error!(weight = %weight, error = %e, "fetching an embedding table failed");
                panic!(
                    "fetching the embedding table {weight} failed: {e} \
                     (Embedding::try_embeddings returns this error)"
                );
            }
        }
    }

    /// The table, fetched now, or the fetch's error.
    ///
    /// # Errors
    /// Errors of the fetch (patch math, cast, a weight wrapper).
    pub fn try_embeddings(&self) -> candle_core::Result<Tensor> {
        match &self.held {
            Held::Owned(e) => Ok(e.embeddings().clone()),
            Held::Fetched(w) => {
                let (t, _) = fetch_on_load_device(w)?;
                note_handed_out(&t, w);
                Ok(t)
            }
        }
    }

    /// The width of a row.
    pub fn hidden_size(&self) -> usize {
        self.hidden_size
    }

    /// The keys the layer fetches, or `None` for a layer on an owned table.
    pub fn weights(&self) -> Option<&LayerWeights> {
        match &self.held {
            Held::Fetched(w) => Some(w),
            Held::Owned(_) => None,
        }
    }

    pub(crate) fn held(&self) -> &Held<candle_nn::Embedding> {
        &self.held
    }
}

impl Module for Embedding {
    fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        match &self.held {
            Held::Owned(e) => e.forward(ids),
            Held::Fetched(w) => super::held::on_weight_device(w, ids, |ids| {
                let (table, _) = fetch(w, ids.device())?;
                candle_nn::Embedding::new(table, self.hidden_size).forward(ids)
            }),
        }
    }
}

/// An [`Embedding`] from `weight` `[in_size, out_size]` under `vb` (`in_size` rows of width
/// `out_size`).
///
/// # Errors
/// A missing weight or another shape: [`crate::Error::UnknownWeight`] /
/// [`crate::Error::ShapeMismatch`] inside candle's error.
pub fn embedding(
    in_size: usize,
    out_size: usize,
    vb: VarBuilder<'_>,
) -> candle_core::Result<Embedding> {
    let w = vb.weights("weight", &[in_size, out_size], None)?;
    Ok(Embedding {
        held: Held::Fetched(w),
        hidden_size: out_size,
    })
}
