//! The tensors a model's code holds as its own, outside the ledger (`Model::held_outside`,
//! docs/ARCHITECTURE.md §11): the held-outside table.
//!
//! It counts each tensor handed to a model's code — a parameter `nn::VarBuilder::get` returned,
//! a managed quantized weight dequantized — per model, key and tensor, until a layer constructor
//! adopts it, the source it was read through is dropped, or the model is: a tensor's own drop
//! cannot be seen. It stays bounded by what the model's code can hold, not by how often it reads:
//! a second copy of one weight read in one form (patcher, dtype, device, call) from one source is
//! kept and handed out in place of every later read, so a weight read in a loop counts two copies.
//!
//! The table lives with the models, below the layers that feed it: what handed a tensor out is
//! an [`Origin`] (a weak handle compared by address) and the form it was handed out in a
//! [`Form`] (compared, never read), so this module names no layer type. `ops` hands tensors out
//! through it; the ledger reads its figures. Lookups are O(copies of the key); the ledger's
//! figures O(entries of the model). Its lock (`Rank::HeldOutside`) is never held while a weight
//! is read, and kept copies are dropped after it is released.

use std::any::Any;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Weak;

use candle_core::{Device, Tensor, TensorId};

use crate::lock::{Mutex, Rank};
use crate::size::ByteSize;
use crate::vram::DeviceId;

/// What handed a tensor out (a layer source: a builder and every layer built from it), held
/// without keeping it alive: its tensors count while it lives, and only hand-outs from one origin
/// share a kept copy.
#[derive(Clone)]
pub(crate) struct Origin(Weak<dyn Any + Send + Sync>);

impl Origin {
    /// The origin `handle` points at; identity is the allocation.
    pub(crate) fn new<T: Any + Send + Sync>(handle: Weak<T>) -> Origin {
        Origin(handle)
    }

    fn alive(&self) -> bool {
        self.0.strong_count() > 0
    }

    fn same_as(&self, other: &Origin) -> bool {
        self.0.ptr_eq(&other.0)
    }
}

/// What makes two hand-outs of one weight the same bits in the same place, as the code handing
/// them out tells them apart (the patcher it fetched through, the dtype and device asked for, the
/// call). Any `PartialEq` type is one; forms of two types are never the same.
pub(crate) trait Form: Any + Send + Sync {
    /// Whether `other` is this form.
    fn same(&self, other: &dyn Form) -> bool;
}

impl<T: Any + Send + Sync + PartialEq> Form for T {
    fn same(&self, other: &dyn Form) -> bool {
        (other as &dyn Any).downcast_ref::<T>() == Some(self)
    }
}

/// One weight about to be handed to a model's code.
pub(crate) struct HandOut<'a> {
    /// The model's id ([`super::Model::id`]).
    pub(crate) model_id: u64,
    /// The device the model loads to: a tensor on its candle device is counted there.
    pub(crate) load_device: DeviceId,
    /// The weight's key.
    pub(crate) key: &'a str,
    pub(crate) origin: Origin,
    pub(crate) form: Box<dyn Form>,
}

/// One tensor handed to a model's code (a clean weight read twice may be handed out twice as one
/// tensor). A tensor's drop cannot be seen (candle gives no weak handle on one), so it counts
/// until a layer adopts every hand-out of it, its origin is dropped, or its model is.
struct OutsideTensor {
    id: TensorId,
    bytes: ByteSize,
    /// The ledger's device for it.
    device: DeviceId,
    origin: Origin,
    form: Box<dyn Form>,
    /// Hand-outs not adopted by a layer: counted while any is left.
    handouts: u32,
    /// The second copy made of one weight in one form from one origin: kept, and handed out in
    /// place of every later read, so reading a weight again and again counts two copies, not one
    /// per read. (The first is not kept: model code that reads each weight once and transforms
    /// it — experts stacked at build — must not pay for the copies it dropped.)
    kept: Option<Tensor>,
}

/// The tensors one model's code holds as its own, by key.
#[derive(Default)]
struct Outside {
    by_key: HashMap<String, Vec<OutsideTensor>>,
    /// Entries keeping a copy: their tensors are released as soon as any call sees their origin
    /// gone, whichever model it asks about.
    keeping: usize,
}

/// Drops the entries of `copies` whose origin is gone, moving the copies they kept to `released`
/// (to be dropped once the table's lock is released).
fn prune_copies(copies: &mut Vec<OutsideTensor>, keeping: &mut usize, released: &mut Vec<Tensor>) {
    copies.retain_mut(|o| {
        let alive = o.origin.alive();
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
    /// Drops the entries whose origin is gone ([`prune_copies`]).
    fn prune(&mut self, released: &mut Vec<Tensor>) {
        let keeping = &mut self.keeping;
        self.by_key.retain(|_, copies| {
            prune_copies(copies, keeping, released);
            !copies.is_empty()
        });
    }

    /// Counts one more hand-out of `t` (weight `key`, in `form`, from `origin`).
    fn note(
        &mut self,
        key: &str,
        t: &Tensor,
        device: DeviceId,
        origin: Origin,
        form: Box<dyn Form>,
        released: &mut Vec<Tensor>,
    ) {
        let copies = self.by_key.entry(key.to_string()).or_default();
        // A count whose origin is gone is over: a clean tensor handed out again by the builder
        // of a model built again starts a new one.
        prune_copies(copies, &mut self.keeping, released);
        if let Some(o) = copies.iter_mut().find(|o| o.id == t.id()) {
            // The same tensor again: a resident or clean copy is handed out as itself.
            o.handouts = o.handouts.saturating_add(1);
            return;
        }
        let earlier = copies
            .iter()
            .filter(|o| o.origin.same_as(&origin) && o.form.same(&*form));
        let keep = earlier.clone().next().is_some() && !earlier.clone().any(|o| o.kept.is_some());
        if keep {
            self.keeping += 1;
        }
        copies.push(OutsideTensor {
            id: t.id(),
            bytes: ByteSize((t.elem_count() * t.dtype().size_in_bytes()) as u64),
            device,
            origin,
            form,
            handouts: 1,
            kept: keep.then(|| t.clone()),
        });
    }

    /// The copy kept for weight `key` in `form` from `origin`, counted as handed out once more.
    fn hand_out_kept(&mut self, key: &str, origin: &Origin, form: &dyn Form) -> Option<Tensor> {
        let o = self.by_key.get_mut(key)?.iter_mut().find(|o| {
            o.kept.is_some() && o.origin.alive() && o.origin.same_as(origin) && o.form.same(form)
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
static ANY_OUTSIDE: AtomicBool = AtomicBool::new(false);

/// Per model (by id): the tensors its code holds as its own.
static OUTSIDE: Mutex<Option<HashMap<u64, Outside>>> = Mutex::new(Rank::HeldOutside, None);

/// Prunes every model that keeps copies (their tensors must not outlive their origin, whoever
/// asks next), then `f` on the table.
fn with_outside<R>(f: impl FnOnce(&mut HashMap<u64, Outside>) -> R) -> R {
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

/// Hands out the weight `h` names: the copy kept for it when it was read twice before in this
/// form from this origin, else `read()`'s tensor; counted until a layer adopts it, its origin is
/// dropped, or its model is.
pub(crate) fn hand_out(
    h: HandOut<'_>,
    read: impl FnOnce() -> candle_core::Result<Tensor>,
) -> candle_core::Result<Tensor> {
    ANY_OUTSIDE.store(true, Ordering::Relaxed);
    let kept = with_outside(|models| {
        models
            .get_mut(&h.model_id)
            .and_then(|t| t.hand_out_kept(h.key, &h.origin, &*h.form))
    });
    if let Some(t) = kept {
        return Ok(t);
    }
    let t = read()?;
    let counted_on = ledger_device(h.load_device, t.device());
    let mut released = Vec::new();
    with_outside(|models| {
        models.entry(h.model_id).or_default().note(
            h.key,
            &t,
            counted_on,
            h.origin,
            h.form,
            &mut released,
        )
    });
    drop(released);
    Ok(t)
}

/// Hand-outs of model `model_id` adopted by a layer constructor, each a weight key and the
/// tensor handed out under it: each counts once less, and stops counting once every hand-out of
/// its tensor is adopted.
pub(crate) fn adopted(model_id: u64, hand_outs: &[(&str, TensorId)]) {
    let mut released = Vec::new();
    with_outside(|models| {
        if let Some(table) = models.get_mut(&model_id) {
            for &(key, id) in hand_outs {
                table.adopted(key, id, &mut released);
            }
        }
    });
    drop(released);
}

/// The tensors model `model_id`'s code holds outside the ledger, by key, with their bytes.
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

/// Bytes of the tensors model `model_id`'s code holds on `device` (see [`outside_of`]).
pub(crate) fn outside_on(model_id: u64, device: DeviceId) -> ByteSize {
    live_outside(model_id)
        .into_iter()
        .filter(|(_, _, d)| *d == device)
        .map(|(_, b, _)| b)
        .sum()
}

/// Bytes of the tensors model `model_id`'s code holds, per device they are on (see
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

/// The entries of `model_id` whose origin still lives (dead ones are dropped), sorted by key.
fn live_outside(model_id: u64) -> Vec<(String, ByteSize, DeviceId)> {
    if !ANY_OUTSIDE.load(Ordering::Relaxed) {
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
