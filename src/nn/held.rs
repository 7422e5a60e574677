//! What a layer of [`crate::nn`] holds — the keys of weights it fetches, or tensors it owns — and
//! the fetch every fetched layer's forward and accessors go through; and the adoption of tensors
//! handed to a model's code: a constructor given a tensor `VarBuilder::get` (or a managed
//! accessor) just returned builds the managed layer on its key instead.
//!
//! What a model's code holds as its own, outside the ledger, is counted in the held-outside table
//! (`weights/outside.rs`, docs/ARCHITECTURE.md §11): [`get`] hands a parameter out through it and
//! [`adopt`] takes it back off. The list a constructor adopts from keeps the last 4 096
//! hand-outs; lookups in it are O(its length).

use candle_core::{DType, Device, Tensor, TensorId};

use crate::ops::{cast_bias_weight, to_candle, LayerWeights, Via, WeakSource};

/// A layer's tensors: fetched through the patcher at every use, or owned as candle-nn owns them
/// (a layer made with `new`, which the memory manager cannot evict).
#[derive(Debug, Clone)]
pub(crate) enum Held<L> {
    /// Keys and source of the weight (and bias); fetched at every forward.
    Fetched(LayerWeights),
    /// candle-nn's own layer on owned tensors.
    Owned(L),
}

/// The weight and bias of `w` ready for a forward on `device`: [`cast_bias_weight`] (resident
/// copy or streamed, cast to the mode's compute dtype, wrapped), recorded in the forward order.
pub(crate) fn fetch(
    w: &LayerWeights,
    device: &Device,
) -> candle_core::Result<(Tensor, Option<Tensor>)> {
    cast_bias_weight(w, device, w.mode()).map_err(to_candle)
}

/// Runs `f` where `w`'s weight lives (a split model's remote layer: input moved there, output
/// moved home; [`crate::ops::on_weight_device`]).
pub(crate) fn on_weight_device(
    w: &LayerWeights,
    x: &Tensor,
    f: impl FnOnce(&Tensor) -> candle_core::Result<Tensor>,
) -> candle_core::Result<Tensor> {
    crate::ops::on_weight_device(w, x, to_candle, f)
}

/// [`fetch`] on the patcher's load device: what accessors such as `Linear::weight` return.
pub(crate) fn fetch_on_load_device(
    w: &LayerWeights,
) -> candle_core::Result<(Tensor, Option<Tensor>)> {
    let device = w
        .source()
        .patcher()
        .load_device()
        .to_candle()
        .map_err(to_candle)?;
    fetch(w, &device)
}

/// A float input cast to the dtype the layer computes in (`ManualCast`, `MixedPrecision`), or
/// checked to be in it (`DisableWeightInit`).
pub(crate) fn input(w: &LayerWeights, x: &Tensor) -> candle_core::Result<Tensor> {
    w.prepare_input(x).map_err(to_candle)
}

/// The error a constructor returns for a bad argument (zero groups, say): a typed
/// [`crate::Error::ShapeMismatch`] inside candle's error.
pub(crate) fn bad_shape(what: String, expected: Vec<usize>, got: Vec<usize>) -> candle_core::Error {
    to_candle(crate::Error::ShapeMismatch {
        what,
        expected,
        got,
    })
}

/// A tensor a managed accessor (`Embedding::embeddings`) handed out: the managed weight it is a
/// fetched copy of, so a layer made on it (the tied head, docs/PORTING.md) can fetch that weight
/// instead of holding the copy.
struct HandedOut {
    id: candle_core::TensorId,
    /// The weight, as a message names it: `` `key` of `model` ``.
    what: String,
    source: crate::ops::WeakSource,
    mode: crate::ops::OpsMode,
    key: String,
    shape: Vec<usize>,
}

/// Tensors handed out by managed accessors, newest last. Bounded: only the recent ones are
/// remembered; a table used after that makes an owned layer, never a wrong one.
static HANDED_OUT: crate::lock::Mutex<std::collections::VecDeque<HandedOut>> =
    crate::lock::Mutex::new(
        crate::lock::Rank::NnHandedOut,
        std::collections::VecDeque::new(),
    );

/// How many handed-out tensors are remembered.
const HANDED_OUT_KEPT: usize = 64;

/// Remembers that `t` is a fetched copy of the managed weight `weights` names.
pub(crate) fn note_handed_out(t: &Tensor, weights: &LayerWeights) {
    let model = weights.source().patcher().model().name().to_string();
    let entry = HandedOut {
        id: t.id(),
        what: format!("`{}` of `{model}`", weights.weight_key()),
        source: weights.source().downgrade(),
        mode: weights.mode(),
        key: weights.weight_key().to_string(),
        shape: weights.weight_shape().to_vec(),
    };
    let mut h = HANDED_OUT.lock();
    if h.len() == HANDED_OUT_KEPT {
        h.pop_front();
    }
    h.push_back(entry);
}

/// The managed weight `t` is a fetched copy of, when an accessor handed it out recently.
pub(crate) fn handed_out(t: &Tensor) -> Option<String> {
    let id = t.id();
    HANDED_OUT
        .lock()
        .iter()
        .rev()
        .find(|h| h.id == id)
        .map(|h| h.what.clone())
}

/// The managed form of a bias-free layer made on a table an accessor handed out (`t`, unchanged):
/// the layer fetches the table's own weight, as `Linear::from_embedding` does. `None` for any
/// other tensor, or when the model it came from is gone.
pub(crate) fn adopt_handed_out(t: &Tensor) -> Option<LayerWeights> {
    let id = t.id();
    let (source, mode, key, shape) = {
        let h = HANDED_OUT.lock();
        let h = h.iter().rev().find(|h| h.id == id)?;
        (h.source.clone(), h.mode, h.key.clone(), h.shape.clone())
    };
    let source = source.upgrade()?;
    crate::ops::OpsBuilder::from_source(&source, mode)
        .weights_at(key, &shape, None)
        .ok()
}

/// A parameter [`super::VarBuilder::get`] handed out: what a layer constructor needs to manage it
/// instead (`Linear::new(vb.get(..)?, None)` becomes a managed layer on the same key).
struct RawGet {
    id: TensorId,
    source: WeakSource,
    mode: crate::ops::OpsMode,
    key: String,
    shape: Vec<usize>,
    model_id: u64,
}

/// Parameters handed out by `VarBuilder::get` and not yet adopted by a layer, newest last.
/// Bounded: a constructor adopts a tensor right after it was read, so only the recent ones
/// matter.
static RAW: crate::lock::Mutex<std::collections::VecDeque<RawGet>> = crate::lock::Mutex::new(
    crate::lock::Rank::NnHandedOut,
    std::collections::VecDeque::new(),
);

/// How many hand-outs are remembered for adoption. Past it the oldest is forgotten: a
/// constructor given that tensor builds an owned layer (the tensor stays counted), never a wrong
/// one.
const RAW_KEPT: usize = 4096;

/// The parameter `weights` names, handed to model code by `VarBuilder::get` in `dtype` on
/// `device`: the copy kept for it when this weight was read twice before in this form from this
/// source, else `read()`'s tensor; counted outside the ledger until a layer constructor adopts
/// it, and remembered for adoption.
pub(crate) fn get(
    weights: &LayerWeights,
    dtype: DType,
    device: &Device,
    read: impl FnOnce() -> candle_core::Result<Tensor>,
) -> candle_core::Result<Tensor> {
    let t = weights.source().hand_out(
        weights.weight_key(),
        dtype,
        device,
        Via::Get(weights.mode()),
        read,
    )?;
    let entry = RawGet {
        id: t.id(),
        source: weights.source().downgrade(),
        mode: weights.mode(),
        key: weights.weight_key().to_string(),
        shape: weights.weight_shape().to_vec(),
        model_id: weights.source().patcher().model().id(),
    };
    let mut raw = RAW.lock();
    if raw.len() == RAW_KEPT {
        raw.pop_front();
    }
    raw.push_back(entry);
    Ok(t)
}

/// The managed form of a layer made on `weight` (and `bias`) when `VarBuilder::get` handed them
/// out unchanged, from one source in one mode: the layer fetches those keys instead of holding the
/// tensors, and they no longer count as outside the ledger. `None` for any other tensor.
pub(crate) fn adopt(weight: &Tensor, bias: Option<&Tensor>) -> Option<LayerWeights> {
    let bias_id = bias.map(|t| t.id());
    let (w, b) = {
        let mut raw = RAW.lock();
        let w = raw.iter().rposition(|r| r.id == weight.id())?;
        let b = match bias {
            Some(bias) => Some(raw.iter().rposition(|r| r.id == bias.id())?),
            None => None,
        };
        let bias_get = b.map(|b| {
            let r = &raw[b];
            (r.key.clone(), r.shape.clone(), r.source.clone(), r.mode)
        });
        let w = raw.remove(w)?;
        let b = match bias_get {
            Some(b) => {
                let id = bias.map(|t| t.id());
                raw.retain(|r| Some(r.id) != id);
                Some(b)
            }
            None => None,
        };
        (w, b)
    };
    let source = w.source.upgrade()?;
    let bias = match &b {
        Some((key, shape, bsource, mode)) => {
            // A bias from another builder or mode stays owned with its layer.
            if !bsource.same_as(&w.source) || *mode != w.mode || shape.len() != 1 {
                return None;
            }
            Some((key.clone(), shape[0]))
        }
        None => None,
    };
    let layer = crate::ops::OpsBuilder::from_source(&source, w.mode)
        .weights_at(w.key.clone(), &w.shape, bias.clone())
        .ok()?;
    let mut hand_outs = vec![(w.key.as_str(), w.id)];
    if let (Some((key, _)), Some(b)) = (&bias, bias_id) {
        hand_outs.push((key.as_str(), b));
    }
    crate::weights::outside::adopted(w.model_id, &hand_outs);
    Some(layer)
}
