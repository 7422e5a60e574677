//! What a layer of [`crate::nn`] holds — the keys of weights it fetches, or tensors it owns — and
//! the fetch every fetched layer's forward and accessors go through.

use candle_core::{Device, Tensor};

use crate::ops::{cast_bias_weight, to_candle, LayerWeights};

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

/// Tensors handed out by managed accessors (`Embedding::embeddings`), by id, newest last: a
/// layer later made with `new` on one of them is an unmanaged copy of a managed weight (the tied
/// head mistake, docs/PORTING.md). Bounded: only the recent ones are remembered.
static HANDED_OUT: crate::lock::Mutex<std::collections::VecDeque<(candle_core::TensorId, String)>> =
    crate::lock::Mutex::new(
        crate::lock::Rank::NnHandedOut,
        std::collections::VecDeque::new(),
    );

/// How many handed-out tensors are remembered.
const HANDED_OUT_KEPT: usize = 64;

/// Remembers that `t` is a fetched copy of managed weight `what` (`key` of `model`).
pub(crate) fn note_handed_out(t: &Tensor, what: String) {
    let mut h = HANDED_OUT.lock();
    if h.len() == HANDED_OUT_KEPT {
        h.pop_front();
    }
    h.push_back((t.id(), what));
}

/// The managed weight `t` is a fetched copy of, when an accessor handed it out recently.
pub(crate) fn handed_out(t: &Tensor) -> Option<String> {
    let id = t.id();
    HANDED_OUT
        .lock()
        .iter()
        .rev()
        .find(|(i, _)| *i == id)
        .map(|(_, w)| w.clone())
}
