//! What a layer of [`crate::nn`] holds — the keys of weights it fetches, or tensors it owns — and
//! the fetch every fetched layer's forward and accessors go through; and the tensors a model's
//! code holds as its own, outside the ledger (`Model::held_outside`, docs/ARCHITECTURE.md §11).
//!
//! The held-outside table counts each tensor `VarBuilder::get` (or a quantized `dequantize` of a
//! managed weight) handed to a model's code, per model, key and tensor, until a layer constructor adopts it, the
//! source it was read through is dropped, or the model is: a tensor's own drop cannot be seen.
//! It stays bounded by what the model's code can hold, not by how often it reads: a second copy
//! of one weight read in one form (patcher, dtype, device, call) from one source is kept and
//! handed out in place of every later read, so a weight read in a loop counts two copies. The
//! list a constructor adopts from keeps the last 4 096 hand-outs. Lookups are O(copies of the
//! key); the ledger's figures O(entries of the model).

use candle_core::{DType, Device, Tensor, TensorId};

use crate::ops::{cast_bias_weight, to_candle, LayerWeights, OpsSource, WeakSource};
use crate::size::ByteSize;
use crate::vram::DeviceId;

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

/// What makes two hand-outs of one weight the same bits in the same place: the patcher the
/// source fetched through (its patches and wrappers), the dtype and device asked for, and the
/// path (a `VarBuilder::get` in its mode, or a dequantize).
#[derive(Clone)]
struct Form {
    /// Compared by allocation; the weak handle keeps the address from being reused.
    patcher: std::sync::Weak<crate::patcher::ModelPatcher>,
    dtype: DType,
    location: candle_core::DeviceLocation,
    via: Via,
}

/// The call that handed a tensor out.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Via {
    Get(crate::ops::OpsMode),
    Dequantize,
}

impl Form {
    fn new(source: &OpsSource, dtype: DType, device: &Device, via: Via) -> Form {
        Form {
            patcher: std::sync::Arc::downgrade(&source.patcher()),
            dtype,
            location: device.location(),
            via,
        }
    }

    fn same(&self, other: &Form) -> bool {
        self.patcher.ptr_eq(&other.patcher)
            && self.dtype == other.dtype
            && self.location == other.location
            && self.via == other.via
    }
}

/// One tensor handed to a model's code (a clean weight read twice may be handed out twice as one
/// tensor). A tensor's drop cannot be seen (candle gives no weak handle on one), so it counts
/// until a layer adopts every hand-out of it, its source is dropped (the builder and every layer
/// built from it), or its model is.
struct OutsideTensor {
    id: TensorId,
    bytes: ByteSize,
    /// The ledger's device for it.
    device: DeviceId,
    source: WeakSource,
    form: Form,
    /// Hand-outs not adopted by a layer: counted while any is left.
    handouts: u32,
    /// The second copy made of one weight in one form from one source: kept, and handed out in
    /// place of every later read, so reading a weight again and again counts two copies, not one
    /// per read. (The first is not kept: model code that reads each weight once and transforms
    /// it — experts stacked at build — must not pay for the copies it dropped.)
    kept: Option<Tensor>,
}

/// The tensors one model's code holds as its own, by key.
#[derive(Default)]
struct Outside {
    by_key: std::collections::HashMap<String, Vec<OutsideTensor>>,
    /// Entries keeping a copy: their tensors are released as soon as any call sees their source
    /// gone, whichever model it asks about.
    keeping: usize,
}

/// Drops the entries of `copies` whose source is gone, moving the copies they kept to `released`
/// (to be dropped once the table's lock is released).
fn prune_copies(copies: &mut Vec<OutsideTensor>, keeping: &mut usize, released: &mut Vec<Tensor>) {
    copies.retain_mut(|o| {
        let alive = o.source.alive();
        if !alive {
            if let Some(t) = o.kept.take() {
                *keeping = keeping.saturating_sub(1);
                released.push(t);
            }
        }
        alive
    });
}

impl Outside {
    /// Drops the entries whose source is gone ([`prune_copies`]).
    fn prune(&mut self, released: &mut Vec<Tensor>) {
        let keeping = &mut self.keeping;
        self.by_key.retain(|_, copies| {
            prune_copies(copies, keeping, released);
            !copies.is_empty()
        });
    }

    /// Counts one more hand-out of `t` (weight `key`, in `form`, from `source`).
    fn note(
        &mut self,
        key: &str,
        t: &Tensor,
        device: DeviceId,
        source: WeakSource,
        form: Form,
        released: &mut Vec<Tensor>,
    ) {
        let copies = self.by_key.entry(key.to_string()).or_default();
        // A count whose source is gone is over: a clean tensor handed out again by the builder
        // of a model built again starts a new one.
        prune_copies(copies, &mut self.keeping, released);
        if let Some(o) = copies.iter_mut().find(|o| o.id == t.id()) {
            // The same tensor again: a resident or clean copy is handed out as itself.
            o.handouts = o.handouts.saturating_add(1);
            return;
        }
        let earlier = copies
            .iter()
            .filter(|o| o.source.same_as(&source) && o.form.same(&form));
        let keep = earlier.clone().next().is_some() && !earlier.clone().any(|o| o.kept.is_some());
        if keep {
            self.keeping += 1;
        }
        copies.push(OutsideTensor {
            id: t.id(),
            bytes: ByteSize((t.elem_count() * t.dtype().size_in_bytes()) as u64),
            device,
            source,
            form,
            handouts: 1,
            kept: keep.then(|| t.clone()),
        });
    }

    /// The copy kept for weight `key` in `form` from `source`, counted as handed out once more.
    fn hand_out_kept(&mut self, key: &str, source: &WeakSource, form: &Form) -> Option<Tensor> {
        let o = self.by_key.get_mut(key)?.iter_mut().find(|o| {
            o.kept.is_some() && o.source.alive() && o.source.same_as(source) && o.form.same(form)
        })?;
        o.handouts = o.handouts.saturating_add(1);
        o.kept.clone()
    }

    /// One hand-out of tensor `id` (weight `key`) adopted by a layer: gone from the count once
    /// every hand-out of it is.
    fn adopted(&mut self, key: &str, id: TensorId, released: &mut Vec<Tensor>) {
        let Some(copies) = self.by_key.get_mut(key) else {
            return;
        };
        let Some(at) = copies.iter().position(|o| o.id == id) else {
            return;
        };
        copies[at].handouts = copies[at].handouts.saturating_sub(1);
        if copies[at].handouts == 0 {
            if let Some(t) = copies.remove(at).kept {
                self.keeping = self.keeping.saturating_sub(1);
                released.push(t);
            }
            if copies.is_empty() {
                self.by_key.remove(key);
            }
        }
    }
}

/// Set by the first hand-out: until then (most processes: no model keeps raw tensors) the
/// ledger's per-model lookup is one atomic load, not a lock.
static ANY_OUTSIDE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Per model (by id): the parameters its code holds as its own tensors.
static OUTSIDE: crate::lock::Mutex<Option<std::collections::HashMap<u64, Outside>>> =
    crate::lock::Mutex::new(crate::lock::Rank::NnHandedOut, None);

/// Prunes every model that keeps copies (their tensors must not outlive their source, whoever
/// asks next), then `f` on the table.
fn with_outside<R>(f: impl FnOnce(&mut std::collections::HashMap<u64, Outside>) -> R) -> R {
    let mut released = Vec::new();
    let r = {
        let mut outside = OUTSIDE.lock();
        let models = outside.get_or_insert_with(Default::default);
        for table in models.values_mut().filter(|t| t.keeping > 0) {
            table.prune(&mut released);
        }
        f(models)
    };
    // Tensors are freed outside the lock.
    drop(released);
    r
}

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
    let form = Form::new(weights.source(), dtype, device, Via::Get(weights.mode()));
    let t = hand_out(weights.source(), weights.weight_key(), form, read)?;
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

/// Managed weight `key` of `source`'s model dequantized for the caller (`quantized::QTensor`'s
/// `dequantize`) in `dtype` on `device`: counted outside the ledger as a `VarBuilder::get`
/// tensor is (the same table, the same rules), never adopted.
pub(crate) fn dequantized(
    source: &OpsSource,
    key: &str,
    dtype: DType,
    device: &Device,
    read: impl FnOnce() -> candle_core::Result<Tensor>,
) -> candle_core::Result<Tensor> {
    let form = Form::new(source, dtype, device, Via::Dequantize);
    hand_out(source, key, form, read)
}

/// The ledger's device for a tensor on `device` handed out by a model loaded on `load`: the load
/// device when `device` is its candle device, else the device it names (the host, a GPU).
fn ledger_device(load: DeviceId, device: &Device) -> DeviceId {
    if load.to_candle().is_ok_and(|d| d.same_device(device)) {
        return load;
    }
    match device.location() {
        candle_core::DeviceLocation::Cuda { gpu_id } => DeviceId::Cuda(gpu_id),
        _ => DeviceId::Cpu,
    }
}

/// Hands out weight `key` of `source`'s model in `form`: the copy kept for it, or `read()`'s
/// tensor, counted.
fn hand_out(
    source: &OpsSource,
    key: &str,
    form: Form,
    read: impl FnOnce() -> candle_core::Result<Tensor>,
) -> candle_core::Result<Tensor> {
    let patcher = source.patcher();
    let model_id = patcher.model().id();
    let weak = source.downgrade();
    ANY_OUTSIDE.store(true, std::sync::atomic::Ordering::Relaxed);
    let kept = with_outside(|models| {
        models
            .get_mut(&model_id)
            .and_then(|t| t.hand_out_kept(key, &weak, &form))
    });
    if let Some(t) = kept {
        return Ok(t);
    }
    let t = read()?;
    let counted_on = ledger_device(patcher.load_device(), t.device());
    let mut released = Vec::new();
    with_outside(|models| {
        models
            .entry(model_id)
            .or_default()
            .note(key, &t, counted_on, weak, form, &mut released)
    });
    drop(released);
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
    let mut released = Vec::new();
    with_outside(|models| {
        if let Some(table) = models.get_mut(&w.model_id) {
            table.adopted(&w.key, w.id, &mut released);
            if let (Some((key, _)), Some(b)) = (&bias, bias_id) {
                table.adopted(key, b, &mut released);
            }
        }
    });
    drop(released);
    Some(layer)
}

/// The parameters model `model_id` holds outside the ledger (handed out by `VarBuilder::get` or
/// dequantized by `quantized::QTensor`, and kept by the model as its own tensors), by key, with
/// their bytes.
pub(crate) fn outside_of(model_id: u64) -> Vec<(String, ByteSize)> {
    let mut by_key: Vec<(String, ByteSize)> = Vec::new();
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
pub(crate) fn outside_on(model_id: u64, device: DeviceId) -> ByteSize {
    live_outside(model_id)
        .into_iter()
        .filter(|(_, _, d)| *d == device)
        .map(|(_, b, _)| b)
        .sum()
}

/// Bytes of the parameters model `model_id`'s code holds, per device they are on (see
/// [`outside_of`]).
pub(crate) fn outside_by_device(model_id: u64) -> Vec<(DeviceId, ByteSize)> {
    let mut by_device: Vec<(DeviceId, ByteSize)> = Vec::new();
    for (_, b, d) in live_outside(model_id) {
        match by_device.iter_mut().find(|(x, _)| *x == d) {
            Some((_, sum)) => *sum = sum.saturating_add(b),
            None => by_device.push((d, b)),
        }
    }
    by_device
}

/// The entries of `model_id` whose source still lives (dead ones are dropped), sorted by key.
fn live_outside(model_id: u64) -> Vec<(String, ByteSize, DeviceId)> {
    if !ANY_OUTSIDE.load(std::sync::atomic::Ordering::Relaxed) {
        return Vec::new();
    }
    let mut released = Vec::new();
    let mut live: Vec<_> = with_outside(|models| {
        let Some(table) = models.get_mut(&model_id) else {
            return Vec::new();
        };
        table.prune(&mut released);
        table
            .by_key
            .iter()
            .flat_map(|(k, copies)| copies.iter().map(|o| (k.clone(), o.bytes, o.device)))
            .collect()
    });
    drop(released);
    live.sort_by(|a, b| a.0.cmp(&b.0));
    live
}

/// Forgets model `model_id` (it was dropped), with the copies kept for it.
pub(crate) fn forget_model(model_id: u64) {
    let table = OUTSIDE.lock().as_mut().and_then(|m| m.remove(&model_id));
    drop(table);
}
