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
    id: candle_core::TensorId,
    source: crate::ops::WeakSource,
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

/// How many handed-out parameters are remembered for adoption.
const RAW_KEPT: usize = 4096;

/// The parameters one model's code holds as its own tensors, by key and tensor (a key read twice
/// and kept twice is two tensors): bytes, the device the
/// tensor was made for (the patcher's load device), and the source it was read through. A
/// tensor's drop cannot be seen, so an entry counts while its source lives: the model built from
/// that `VarBuilder` (its managed layers hold the source) — a model dropped and built again does
/// not count twice.
type Outside = std::collections::HashMap<(String, candle_core::TensorId), OutsideTensor>;

/// One handed-out tensor (a clean weight read twice may be handed out twice as one tensor).
struct OutsideTensor {
    bytes: crate::ByteSize,
    device: crate::vram::DeviceId,
    source: crate::ops::WeakSource,
    /// Hand-outs not adopted by a layer: counted while any is left.
    handouts: u32,
}

/// Set by the first hand-out: until then (most processes: no model keeps raw tensors) the
/// ledger's per-model lookup is one atomic load, not a lock.
static ANY_OUTSIDE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Per model (by id): the parameters its code holds as its own tensors.
static OUTSIDE: crate::lock::Mutex<Option<std::collections::HashMap<u64, Outside>>> =
    crate::lock::Mutex::new(crate::lock::Rank::NnHandedOut, None);

/// Notes that `t`, the parameter `weights` names, was handed to model code: it is outside the
/// ledger until a layer constructor adopts it.
pub(crate) fn note_raw(t: &Tensor, weights: &LayerWeights) {
    let patcher = weights.source().patcher();
    let model_id = patcher.model().id();
    let key = weights.weight_key().to_string();
    let bytes = crate::ByteSize((t.elem_count() * t.dtype().size_in_bytes()) as u64);
    let device = patcher.load_device();
    ANY_OUTSIDE.store(true, std::sync::atomic::Ordering::Relaxed);
    {
        let mut raw = RAW.lock();
        if raw.len() == RAW_KEPT {
            raw.pop_front();
        }
        raw.push_back(RawGet {
            id: t.id(),
            source: weights.source().downgrade(),
            mode: weights.mode(),
            key: key.clone(),
            shape: weights.weight_shape().to_vec(),
            model_id,
        });
    }
    OUTSIDE
        .lock()
        .get_or_insert_with(Default::default)
        .entry(model_id)
        .or_default()
        .entry((key, t.id()))
        .and_modify(|o| {
            // Handed out again by a builder of a model rebuilt since: the old count is over.
            if !o.source.alive() {
                o.source = weights.source().downgrade();
                o.handouts = 0;
            }
            o.handouts += 1;
        })
        .or_insert(OutsideTensor {
            bytes,
            device,
            source: weights.source().downgrade(),
            handouts: 1,
        });
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
    if let Some(map) = OUTSIDE.lock().as_mut().and_then(|m| m.get_mut(&w.model_id)) {
        let mut adopted = |entry: (String, candle_core::TensorId)| {
            if let Some(o) = map.get_mut(&entry) {
                o.handouts = o.handouts.saturating_sub(1);
                if o.handouts == 0 {
                    map.remove(&entry);
                }
            }
        };
        adopted((w.key.clone(), w.id));
        if let (Some((key, _)), Some(b)) = (&bias, bias_id) {
            adopted((key.clone(), b));
        }
    }
    Some(layer)
}

/// The parameters model `model_id` holds outside the ledger (handed out by `VarBuilder::get` and
/// kept by the model as its own tensors), by key, with their bytes.
pub(crate) fn outside_of(model_id: u64) -> Vec<(String, crate::ByteSize)> {
    let mut by_key: Vec<(String, crate::ByteSize)> = Vec::new();
    // Live entries come sorted by key: one row per key, its tensors summed.
    for (k, b, _) in live_outside(model_id) {
        match by_key.last_mut() {
            Some((last, sum)) if *last == k => *sum = sum.saturating_add(b),
            _ => by_key.push((k, b)),
        }
    }
    by_key
}

/// Bytes of the parameters model `model_id`'s code holds on `device` (see [`outside_of`]).
pub(crate) fn outside_on(model_id: u64, device: crate::vram::DeviceId) -> crate::ByteSize {
    live_outside(model_id)
        .into_iter()
        .filter(|(_, _, d)| *d == device)
        .map(|(_, b, _)| b)
        .sum()
}

/// Bytes of the parameters model `model_id`'s code holds, per device they are on (see
/// [`outside_of`]).
pub(crate) fn outside_by_device(model_id: u64) -> Vec<(crate::vram::DeviceId, crate::ByteSize)> {
    let mut by_device: Vec<(crate::vram::DeviceId, crate::ByteSize)> = Vec::new();
    for (_, b, d) in live_outside(model_id) {
        match by_device.iter_mut().find(|(x, _)| *x == d) {
            Some((_, sum)) => *sum = sum.saturating_add(b),
            None => by_device.push((d, b)),
        }
    }
    by_device
}

/// The entries of `model_id` whose source still lives (dead ones are dropped).
fn live_outside(model_id: u64) -> Vec<(String, crate::ByteSize, crate::vram::DeviceId)> {
    if !ANY_OUTSIDE.load(std::sync::atomic::Ordering::Relaxed) {
        return Vec::new();
    }
    let mut outside = OUTSIDE.lock();
    let Some(keys) = outside.as_mut().and_then(|m| m.get_mut(&model_id)) else {
        return Vec::new();
    };
    keys.retain(|_, o| o.source.alive());
    let mut live: Vec<_> = keys
        .iter()
        .map(|((k, _), o)| (k.clone(), o.bytes, o.device))
        .collect();
    live.sort_by(|a, b| a.0.cmp(&b.0));
    live
}

/// Forgets model `model_id` (it was dropped).
pub(crate) fn forget_model(model_id: u64) {
    if let Some(m) = OUTSIDE.lock().as_mut() {
        m.remove(&model_id);
    }
}
