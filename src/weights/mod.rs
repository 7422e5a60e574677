//! Models as named weight slots, and where each weight currently lives.
//!
//! A [`Model`] is the shared, immutable set of weights of one checkpoint: per slot its name,
//! shape, storage dtype and the **clean** tensor. A model read eagerly holds every clean tensor in
//! host RAM; a model read lazily ([`Model::from_safetensors_lazy`], `lazy.rs`) leaves them in
//! its files and holds host copies through a [`HostTier`] (`host.rs`) within a RAM budget.
//! Either way [`Slot::clean`] is the one way to a clean weight: it returns the host tensor,
//! reading it first when it is not held. Clean tensors are never mutated (I1,
//! docs/ARCHITECTURE.md §4.1): patches produce new tensors.
//!
//! Next to the clean weights a model keeps its *residency*: for each slot either
//! [`SlotResidency::Offloaded`] or [`SlotResidency::Resident`] — one materialized, patched copy
//! on a load device together with the fingerprint of the patch list it was built from and its
//! byte size. Every [`crate::patcher::ModelPatcher`] cloned from the same model shares this
//! residency; fingerprints tell a clone which resident copies are its own.
//!
//! Locks: `Model::state` (`Rank::ModelState` in the crate's lock table, `src/lock/rank.rs`)
//! guards residency and pins; the forward-order recorder ranks after it. Neither is held across a
//! call into user code, and no thread reads `Model::state` twice (the checker refuses it). A
//! change of a weight's residency tells the model's host tier under `Model::state`; a pin that
//! change releases is dropped after the write lock is released (`StateMut`).
//!
//! Complexity: lookups by name are O(1); residency updates are O(number of weights touched).

mod gguf;
mod host;
mod lazy;
mod pin;
mod quant;
mod safetensors;
mod usage;
mod writer;

use std::any::Any;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::lock::{Mutex, Rank, RwLock, RwLockReadGuard, RwLockWriteGuard};
use candle_core::quantized::QTensor;
use candle_core::Tensor;
use once_cell::sync::OnceCell;

use crate::error::{Error, Result};
use crate::float::Dtype;
use crate::size::ByteSize;
use crate::vram::DeviceId;

pub use self::host::{HeldCopy, HostStats, HostTier, MIN_PIN_BYTES};
pub(crate) use self::pin::host_bytes;
pub use self::pin::PinnedWeight;
pub(crate) use self::quant::qtensor_from_bytes;
pub use self::quant::{block_bytes, GgufMetadata};
pub(crate) use self::safetensors::{
    read_file_tensors, safetensors_dtype, write_le_bytes, FileTensor, TensorFile,
};
#[cfg(test)]
pub(crate) use self::safetensors::{read_raw_tensors, save_safetensors_with_raw, RawTensor};
pub use self::safetensors::{save_safetensors, SafetensorsOptions};
pub(crate) use self::usage::{WeightUse, NONE as NO_POSITION};
pub(crate) use self::writer::{save_safetensors_streaming, LazyTensor, Sink, Source};
pub use candle_core::quantized::GgmlDType;

/// What the offload layer hangs on a model to stream it (an `offload::Streamer`).
pub(crate) type StreamHook = Arc<dyn Any + Send + Sync>;

/// A fingerprint of the patch list (and resident dtype) a resident copy was built from.
pub type Fingerprint = u64;

/// Where a clean weight is: in host memory for good (read eagerly), or in its file (read
/// lazily, with a host copy held by the model's host tier while memory allows).
#[derive(Debug)]
enum Clean {
    Host(Tensor),
    Disk(Box<lazy::DiskWeight>),
}

/// One weight: metadata and the clean tensor.
#[derive(Debug)]
pub struct Slot {
    name: String,
    shape: Vec<usize>,
    dtype: Dtype,
    clean: Clean,
    bytes: ByteSize,
    /// The GGML block format of a quantized weight (its clean tensor is its block bytes).
    quant: Option<GgmlDType>,
}

impl Slot {
    /// The weight's key.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// Its shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    /// Its storage dtype; for a quantized weight, the dtype it dequantizes to (f32), which is
    /// what its patches compute in.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }
    /// The GGML block format of a quantized weight (`Q4_0`, `Q4K`, ...), else `None`.
    pub fn quantized(&self) -> Option<GgmlDType> {
        self.quant
    }
    /// The clean tensor on the host (storage dtype; `U8` bytes for fp8 E5M2; for a quantized
    /// weight its block bytes, a `U8` tensor of [`Slot::bytes`] elements). Never mutated.
    ///
    /// For a weight read eagerly this is the tensor read with the model. For one read lazily it
    /// is the host copy its host tier holds, read from the file first (and booked in the tier's
    /// ledger, evicting other copies within its budget) when the tier does not hold it; where
    /// the stored dtype is what the tensor holds, the read fills the tensor's own buffer.
    ///
    /// # Errors
    /// For a lazily read weight: [`Error::File`] naming the file and the tensor when it cannot
    /// be read (truncated or removed underneath); [`Error::BudgetExceeded`] when the weight alone
    /// is larger than the host budget. A failed read changes nothing else.
    pub fn clean(&self) -> Result<Tensor> {
        match &self.clean {
            Clean::Host(t) => Ok(t.clone()),
            Clean::Disk(d) => d.clean(&self.name, self.dtype),
        }
    }
    /// Whether the weight stays in its file until needed (read lazily).
    pub fn is_lazy(&self) -> bool {
        matches!(self.clean, Clean::Disk(_))
    }
    /// Bytes in storage dtype (a quantized weight: its block bytes, exactly).
    pub fn bytes(&self) -> ByteSize {
        self.bytes
    }
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// Bytes this weight takes in `dtype` (dense: dequantized, for a quantized weight).
    pub fn bytes_in(&self, dtype: Dtype) -> ByteSize {
        ByteSize((self.numel() * dtype.size_in_bytes()) as u64)
    }
}

/// Where one weight lives.
#[derive(Debug, Clone)]
pub enum SlotResidency {
    /// Only the clean copy on the offload device exists; uses stream it.
    Offloaded,
    /// A materialized copy lives on `device`.
    Resident {
        /// The resident copy: a dense tensor (patched, in the resident dtype), or a quantized
        /// weight's blocks.
        tensor: ResidentWeight,
        /// The fingerprint of the patch list it was built from.
        fingerprint: Fingerprint,
        /// Where it lives.
        device: DeviceId,
        /// Its size.
        bytes: ByteSize,
    },
}

/// A resident copy of one weight.
#[derive(Debug, Clone)]
pub enum ResidentWeight {
    /// A dense tensor: patched, in the resident dtype, on the load device.
    Dense(Tensor),
    /// A quantized weight's blocks on the load device, as candle's `QTensor` (never patched:
    /// patches on a quantized weight apply to its dequantized value at use).
    Quantized(Arc<QTensor>),
}

impl ResidentWeight {
    /// The dense tensor, for a dense copy.
    pub fn dense(&self) -> Option<&Tensor> {
        match self {
            ResidentWeight::Dense(t) => Some(t),
            ResidentWeight::Quantized(_) => None,
        }
    }
    /// The quantized tensor, for a quantized copy.
    pub fn quantized(&self) -> Option<&Arc<QTensor>> {
        match self {
            ResidentWeight::Quantized(q) => Some(q),
            ResidentWeight::Dense(_) => None,
        }
    }
}

/// The mutable part of a model: residency and pins, guarded by one lock.
///
/// Slots change only through [`Residency::set`], which keeps a running byte total per device, so
/// the memory manager's ledger (asked on every load) costs O(devices) per model, not O(weights).
#[derive(Debug)]
pub(crate) struct Residency {
    slots: Vec<SlotResidency>,
    pub(crate) pinned: Vec<bool>,
    /// Resident bytes and weights per device (devices holding none are absent).
    totals: Vec<(DeviceId, u64, usize)>,
    /// Bumped by every change of a slot: equal generations mean identical residency.
    generation: u64,
    /// The host tier told when a weight gains or loses its resident copy, and the model's id.
    host: Option<(HostTier, u64)>,
    /// What keeps each resident copy's device memory in its device's books (a simulated GPU
    /// counts a resident copy until the residency drops it).
    holds: Vec<crate::device::DeviceHold>,
    /// Pins released by changes made under the write lock, dropped after it is released
    /// ([`StateMut`]): unpinning waits for the copies out of the weight, and no forward may wait
    /// on a copy for this model's residency lock.
    released: Vec<Arc<PinnedWeight>>,
}

impl Residency {
    pub(crate) fn new(len: usize) -> Residency {
        Residency {
            slots: vec![SlotResidency::Offloaded; len],
            pinned: vec![false; len],
            totals: Vec::new(),
            generation: 0,
            host: None,
            holds: vec![crate::device::DeviceHold::default(); len],
            released: Vec::new(),
        }
    }

    /// Every slot's residency, by weight index.
    pub(crate) fn slots(&self) -> &[SlotResidency] {
        &self.slots
    }

    /// Sets weight `index`'s residency, keeping `hold` with it (what keeps the copy's device
    /// memory counted by its device), and returns the previous one.
    pub(crate) fn set_held(
        &mut self,
        index: usize,
        new: SlotResidency,
        hold: crate::device::DeviceHold,
    ) -> SlotResidency {
        let old = self.set(index, new);
        self.holds[index] = hold;
        old
    }

    /// Sets weight `index`'s residency and returns the previous one (the previous copy's device
    /// hold is dropped with it).
    pub(crate) fn set(&mut self, index: usize, new: SlotResidency) -> SlotResidency {
        self.generation += 1;
        self.holds[index] = crate::device::DeviceHold::default();
        if let SlotResidency::Resident { device, bytes, .. } = &new {
            let t = self.total_mut(*device);
            t.1 += bytes.bytes();
            t.2 += 1;
        }
        let new_device = match &new {
            SlotResidency::Resident { device, .. } => Some(*device),
            SlotResidency::Offloaded => None,
        };
        let old = std::mem::replace(&mut self.slots[index], new);
        let old_device = match &old {
            SlotResidency::Resident { device, .. } => Some(*device),
            SlotResidency::Offloaded => None,
        };
        if old_device != new_device {
            if let Some((tier, id)) = &self.host {
                let released = tier.note_resident(*id, index, new_device);
                self.released.extend(released);
            }
        }
        if let SlotResidency::Resident { device, bytes, .. } = &old {
            let t = self.total_mut(*device);
            t.1 = t.1.saturating_sub(bytes.bytes());
            t.2 = t.2.saturating_sub(1);
            if t.2 == 0 {
                self.totals.retain(|t| t.2 > 0);
            }
        }
        old
    }

    fn total_mut(&mut self, device: DeviceId) -> &mut (DeviceId, u64, usize) {
        let pos = match self.totals.iter().position(|t| t.0 == device) {
            Some(p) => p,
            None => {
                self.totals.push((device, 0, 0));
                self.totals.len() - 1
            }
        };
        &mut self.totals[pos]
    }

    /// Bytes resident on `device`.
    pub(crate) fn bytes_on(&self, device: DeviceId) -> ByteSize {
        self.totals
            .iter()
            .find(|t| t.0 == device)
            .map_or(ByteSize::ZERO, |t| ByteSize(t.1))
    }

    /// Bytes resident anywhere.
    pub(crate) fn bytes_total(&self) -> ByteSize {
        ByteSize(self.totals.iter().map(|t| t.1).sum())
    }

    /// Changes whenever any slot changes.
    pub(crate) fn generation(&self) -> u64 {
        self.generation
    }

    /// The copies resident on `device`: `(index, bytes, pinned)` in index order.
    pub(crate) fn resident_on(&self, device: DeviceId) -> Vec<(usize, ByteSize, bool)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| match s {
                SlotResidency::Resident {
                    device: d, bytes, ..
                } if *d == device => Some((i, *bytes, self.pinned[i])),
                _ => None,
            })
            .collect()
    }

    /// The devices holding resident weights.
    pub(crate) fn devices(&self) -> Vec<DeviceId> {
        let mut d: Vec<DeviceId> = self.totals.iter().map(|t| t.0).collect();
        d.sort();
        d
    }
}

/// The residency write lock of a model. Released pins are dropped after the lock is released.
pub(crate) struct StateMut<'a>(Option<RwLockWriteGuard<'a, Residency>>);

impl std::ops::Deref for StateMut<'_> {
    type Target = Residency;
    fn deref(&self) -> &Residency {
        self.0
            .as_deref()
            .unwrap_or_else(|| unreachable!("held until dropped"))
    }
}

impl std::ops::DerefMut for StateMut<'_> {
    fn deref_mut(&mut self) -> &mut Residency {
        self.0
            .as_deref_mut()
            .unwrap_or_else(|| unreachable!("held until dropped"))
    }
}

impl StateMut<'_> {
    /// The pins released so far, for a caller holding another lock that forbids waiting: it
    /// drops them once it released that lock too.
    #[must_use = "released pins must be dropped outside every lock"]
    pub(crate) fn take_released(&mut self) -> Vec<Arc<PinnedWeight>> {
        std::mem::take(&mut self.released)
    }
}

impl Drop for StateMut<'_> {
    fn drop(&mut self) {
        let released = self
            .0
            .as_mut()
            .map(|g| std::mem::take(&mut g.released))
            .unwrap_or_default();
        drop(self.0.take());
        drop(released);
    }
}

/// The suffix of a per-tensor scale stored next to a quantized weight: `<layer>.weight` (fp8) is
/// scaled by the f32 scalar `<layer>.weight_scale` (see [`crate::ops`]).
pub const WEIGHT_SCALE_SUFFIX: &str = ".weight_scale";

/// Refuses a model whose fp8 weights have an unusable per-tensor scale: the scale must hold one
/// value, finite and non-zero (a NaN scale would only fail later, during a load).
fn check_scales(model: &str, slots: &[Slot], index: &HashMap<String, usize>) -> Result<()> {
    for s in slots {
        let Some(prefix) = s.name.strip_suffix(WEIGHT_SCALE_SUFFIX) else {
            continue;
        };
        let scaled = index
            .get(&format!("{prefix}.weight"))
            .is_some_and(|&i| slots[i].dtype.is_fp8());
        if !scaled {
            continue;
        }
        check_fp8_scale(model, &s.name, &s.clean()?, s.dtype)?;
    }
    Ok(())
}

/// Refuses a per-tensor fp8 scale (`key`, stored as `dtype`) that is not one finite, non-zero
/// value: [`Error::BadWeight`] naming the model and key. The loader and `lora_merge` (which must
/// never write what the loader refuses) share it.
pub(crate) fn check_fp8_scale(model: &str, key: &str, scale: &Tensor, dtype: Dtype) -> Result<()> {
    let bad = |reason: String| Error::BadWeight {
        model: model.to_string(),
        key: key.to_string(),
        reason,
    };
    if scale.elem_count() != 1 {
        return Err(bad(format!(
            "a per-tensor scale must hold one value, not shape {:?}",
            scale.dims()
        )));
    }
    let v = crate::float::to_f32(scale, dtype)?
        .flatten_all()
        .and_then(|t| t.to_vec1::<f32>())
        .map_err(|e| Error::tensor(format!("reading `{key}`"), e))?[0];
    if !v.is_finite() || v == 0.0 {
        return Err(bad(format!("scale {v} is not a finite non-zero number")));
    }
    Ok(())
}

static NEXT_MODEL_ID: AtomicU64 = AtomicU64::new(1);

fn next_model_id() -> u64 {
    NEXT_MODEL_ID.fetch_add(1, Ordering::Relaxed)
}

/// A shared, named set of weight slots with their residency.
pub struct Model {
    id: u64,
    name: String,
    slots: Vec<Slot>,
    index: HashMap<String, usize>,
    total: ByteSize,
    numel: u64,
    /// Block bytes and elements of the quantized weights (included in `total` and `numel`).
    quantized: (ByteSize, u64),
    /// The GGUF file's metadata, for a model read from one.
    metadata: Option<Arc<GgufMetadata>>,
    state: RwLock<Residency>,
    forward_order: Mutex<ForwardOrder>,
    /// Set once the forward order is complete: every later fetch skips the order's lock.
    order_complete: std::sync::atomic::AtomicBool,
    /// Every weight's uses: last use, count, first-use position, successor; the watermark.
    usage: usage::Usage,
    skipped: Vec<String>,
    stream_hook: RwLock<Option<StreamHook>>,
    /// The manual-cast cache attached by the memory manager (an `ops::CastCache`), if any.
    cast_hook: RwLock<Option<StreamHook>>,
    /// Loaded whole or not at all (a [`crate::managed::Managed`] model).
    whole: std::sync::atomic::AtomicBool,
    /// Loaded by a manager in dynamic mode: its weights become resident by use.
    dynamic: std::sync::atomic::AtomicBool,
    /// Set (and warned about, once) when a weight was fetched for a GPU without the model being
    /// loaded there.
    used_unloaded: std::sync::atomic::AtomicBool,
    /// A value built from the resident copies (a managed model's module), valid while the
    /// residency generation and the builder's key are the ones it was built at.
    derived: Mutex<Option<Derived>>,
    /// The host tier holding this model's host copies (lazy models) or pins (set on the first
    /// pin of an eager model); told when the model is dropped.
    host: OnceCell<HostTier>,
}

impl Drop for Model {
    fn drop(&mut self) {
        if let Some(tier) = self.host.get() {
            tier.forget_model(self.id);
        }
    }
}

/// A value built from a model's resident copies.
struct Derived {
    generation: u64,
    key: u64,
    value: Arc<dyn Any + Send + Sync>,
}

#[derive(Debug, Default)]
struct ForwardOrder {
    order: Vec<usize>,
    seen: Vec<bool>,
    complete: bool,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("id", &self.id)
            .field("name", &self.name)
            .field("weights", &self.slots.len())
            .field("size", &self.total)
            .finish()
    }
}

impl Model {
    /// A model from tensors in memory. Each tensor's candle dtype gives its storage dtype
    /// (`F8E4M3` is fp8 E4M3FN; `F64` is stored as f32); use [`Model::from_typed_tensors`] for fp8
    /// E5M2 weights held as `U8` bytes. Tensors are moved to the CPU (the offload tier).
    pub fn from_tensors<I, S>(name: impl Into<String>, tensors: I) -> Result<Model>
    where
        I: IntoIterator<Item = (S, Tensor)>,
        S: Into<String>,
    {
        let name = name.into();
        let mut typed = Vec::new();
        for (key, t) in tensors {
            let key = key.into();
            let dtype = Dtype::from_candle_storage(t.dtype(), None).map_err(|_| Error::UnsupportedDtype {
                dtype: format!("{:?}", t.dtype()),
                what: format!("weight `{key}` of model `{name}` (float weights only; U8 needs from_typed_tensors)"),
            })?;
            typed.push((key, t, dtype));
        }
        Model::from_typed_tensors(name, typed)
    }

    /// A model from `(key, tensor, storage dtype)` triples; the tensor must be in
    /// `dtype.candle_storage_dtype()` (`U8` for fp8 E5M2). f64 weights are stored as f32.
    pub fn from_typed_tensors<I, S>(name: impl Into<String>, tensors: I) -> Result<Model>
    where
        I: IntoIterator<Item = (S, Tensor, Dtype)>,
        S: Into<String>,
    {
        let name = name.into();
        let mut slots = Vec::new();
        let mut index = HashMap::new();
        for (key, t, dtype) in tensors {
            let key = key.into();
            let (t, dtype) = if dtype == Dtype::F64 {
                let t = t
                    .to_dtype(candle_core::DType::F32)
                    .map_err(|e| Error::tensor(format!("`{key}` of `{name}`: f64 to f32"), e))?;
                (t, Dtype::F32)
            } else {
                (t, dtype)
            };
            if t.dtype() != dtype.candle_storage_dtype() {
                return Err(Error::UnsupportedDtype {
                    dtype: format!("{:?}", t.dtype()),
                    what: format!("weight `{key}` of `{name}` declared as {dtype}"),
                });
            }
            let t = t.to_device(&candle_core::Device::Cpu).map_err(|e| {
                Error::tensor(format!("`{key}` of `{name}`: moving to the host"), e)
            })?;
            if index.insert(key.clone(), slots.len()).is_some() {
                return Err(Error::BadPatch {
                    key: key.clone(),
                    reason: format!("model `{name}` has two weights named `{key}`"),
                });
            }
            let shape = t.dims().to_vec();
            let bytes = ByteSize((t.elem_count() * dtype.size_in_bytes()) as u64);
            slots.push(Slot {
                name: key,
                shape,
                dtype,
                clean: Clean::Host(t),
                bytes,
                quant: None,
            });
        }
        Model::assemble(name, slots, index, Vec::new())
    }

    fn assemble(
        name: String,
        slots: Vec<Slot>,
        index: HashMap<String, usize>,
        skipped: Vec<String>,
    ) -> Result<Model> {
        Model::assemble_with_id(next_model_id(), name, slots, index, skipped, None)
    }

    fn assemble_with_id(
        id: u64,
        name: String,
        slots: Vec<Slot>,
        index: HashMap<String, usize>,
        skipped: Vec<String>,
        tier: Option<HostTier>,
    ) -> Result<Model> {
        check_scales(&name, &slots, &index)?;
        let total = slots.iter().map(|s| s.bytes).sum();
        let numel = slots.iter().map(|s| s.numel() as u64).sum();
        let quantized = slots
            .iter()
            .filter(|s| s.quant.is_some())
            .fold((ByteSize::ZERO, 0u64), |(b, n), s| {
                (b.saturating_add(s.bytes), n + s.numel() as u64)
            });
        let n = slots.len();
        let mut residency = Residency::new(n);
        let host = OnceCell::new();
        if let Some(tier) = tier {
            residency.host = Some((tier.clone(), id));
            let _ = host.set(tier);
        }
        Ok(Model {
            id,
            name,
            slots,
            index,
            total,
            numel,
            quantized,
            metadata: None,
            state: RwLock::new(Rank::ModelState, residency),
            forward_order: Mutex::new(
                Rank::ForwardOrder,
                ForwardOrder {
                    order: Vec::new(),
                    seen: vec![false; n],
                    complete: false,
                },
            ),
            order_complete: std::sync::atomic::AtomicBool::new(false),
            usage: usage::Usage::new(n),
            skipped,
            stream_hook: RwLock::new(Rank::StreamHook, None),
            cast_hook: RwLock::new(Rank::StreamHook, None),
            whole: std::sync::atomic::AtomicBool::new(false),
            dynamic: std::sync::atomic::AtomicBool::new(false),
            used_unloaded: std::sync::atomic::AtomicBool::new(false),
            derived: Mutex::new(Rank::Derived, None),
            host,
        })
    }

    /// The host tier holding this model's host copies (a model read lazily) or pins.
    pub fn host_tier(&self) -> Option<&HostTier> {
        self.host.get()
    }

    /// Whether the model was read lazily (its weights stay in their files until needed).
    pub fn is_lazy(&self) -> bool {
        self.slots.iter().any(Slot::is_lazy)
    }

    /// Page-locks `clean`, the host copy of weight `index`, in place through `tier` when its pin
    /// budget allows (see [`HostTier`]); `None` when it cannot, and the weight is then staged. A
    /// model pins through one tier: the one it was read through, else the first it pinned in.
    pub(crate) fn pin_clean(
        &self,
        index: usize,
        tier: &HostTier,
        clean: &Tensor,
    ) -> Option<Arc<PinnedWeight>> {
        if self.host.get().is_none() {
            let mut st = self.state.write();
            if self.host.set(tier.clone()).is_ok() {
                st.host = Some((tier.clone(), self.id));
            }
        }
        let ours = self.host.get().filter(|t| t.same(tier))?;
        let lazy = self.slots.get(index)?.is_lazy();
        // A weight resident on a GPU is not pinned: its uses copy nothing from the host.
        if let Some(SlotResidency::Resident { device, .. }) = self.state.read().slots.get(index) {
            if !device.is_cpu() {
                return None;
            }
        }
        ours.try_pin(self.id, index, clean, lazy)
    }

    /// The pin of weight `index`'s clean host copy, when it is page-locked in place now (any copy
    /// from those bytes must be recorded in it).
    pub(crate) fn existing_pin(&self, index: usize) -> Option<Arc<PinnedWeight>> {
        self.host.get()?.pin_of(self.id, index)
    }

    /// Whether the model is loaded whole or not at all: every load makes every weight resident
    /// (whatever the state, `--novram` included) and eviction unloads it completely. Set by
    /// [`crate::managed::Managed`], whose module holds the resident copies themselves.
    pub fn is_whole(&self) -> bool {
        self.whole.load(Ordering::Relaxed)
    }

    /// Whether a weight of this model was fetched for a GPU while the model was not loaded there
    /// (no resident copy and no streamer: every weight then copies from host memory at every use,
    /// through pageable copies). Warned about once per model.
    pub fn used_without_load(&self) -> bool {
        self.used_unloaded.load(Ordering::Relaxed)
    }

    /// Notes a fetch for `device` of a model that is not loaded there: warns once per model.
    /// Loading on first use instead was rejected: a patcher is not tied to a manager (the global
    /// one may not be the engine's), and a forward should not evict other models behind the
    /// engine's back.
    pub(crate) fn note_use_without_load(&self, device: DeviceId) {
        if device.is_cpu() || self.used_unloaded.swap(true, Ordering::Relaxed) {
            return;
        }
        tracing::warn!(
            model = self.name(),
            %device,
            "`{}` is used on {device} without `load_models_gpu`: every weight is copied from host memory at every use; load it before running",
            self.name()
        );
    }

    /// Whether a manager in dynamic mode loaded the model (its weights become resident by use,
    /// docs/ARCHITECTURE.md §5.3).
    pub fn is_dynamic(&self) -> bool {
        self.dynamic.load(Ordering::Relaxed)
    }

    pub(crate) fn set_dynamic(&self, dynamic: bool) {
        self.dynamic.store(dynamic, Ordering::Relaxed);
    }

    pub(crate) fn set_whole(&self, whole: bool) {
        self.whole.store(whole, Ordering::Relaxed);
    }

    /// The value built from the resident copies under `key`, if the residency has not changed
    /// since it was built.
    pub(crate) fn derived(&self, key: u64) -> Option<Arc<dyn Any + Send + Sync>> {
        let generation = self.residency_generation();
        let d = self.derived.lock();
        d.as_ref()
            .filter(|d| d.generation == generation && d.key == key)
            .map(|d| Arc::clone(&d.value))
    }

    /// Keeps `value`, built from the resident copies of `generation` under `key`, unless the
    /// residency changed meanwhile. Returns the value it replaced (to drop outside any lock).
    pub(crate) fn set_derived(
        &self,
        generation: u64,
        key: u64,
        value: Arc<dyn Any + Send + Sync>,
    ) -> Option<Arc<dyn Any + Send + Sync>> {
        if self.residency_generation() != generation {
            return Some(value);
        }
        let old = self.derived.lock().replace(Derived {
            generation,
            key,
            value,
        });
        old.map(|d| d.value)
    }

    /// Takes the derived value out when the residency changed since it was built (an eviction, a
    /// clone switch): the caller drops it, outside its locks, so the copies it held are freed as
    /// the ledger already says they are.
    pub(crate) fn take_stale_derived(&self) -> Option<Arc<dyn Any + Send + Sync>> {
        let generation = self.residency_generation();
        let mut d = self.derived.lock();
        if d.as_ref().is_some_and(|d| d.generation != generation) {
            return d.take().map(|d| d.value);
        }
        None
    }

    /// The streaming hook attached by the offload layer (an `offload::Streamer`), if any.
    pub(crate) fn stream_hook(&self) -> Option<StreamHook> {
        self.stream_hook.read().clone()
    }

    /// Attaches or detaches the streaming hook. The one replaced is dropped after the lock is
    /// released (a streamer dropping its prefetches may wait for their copies).
    pub(crate) fn set_stream_hook(&self, hook: Option<StreamHook>) {
        let old = std::mem::replace(&mut *self.stream_hook.write(), hook);
        drop(old);
    }

    /// The manual-cast cache hook attached by the memory manager (an `ops::CastCache`), if any.
    pub(crate) fn cast_hook(&self) -> Option<StreamHook> {
        self.cast_hook.read().clone()
    }

    /// Attaches or detaches the manual-cast cache hook; returns the one it replaced.
    pub(crate) fn set_cast_hook(&self, hook: Option<StreamHook>) -> Option<StreamHook> {
        std::mem::replace(&mut *self.cast_hook.write(), hook)
    }

    /// A process-unique id.
    pub fn id(&self) -> u64 {
        self.id
    }
    /// The model's name (used in logs and errors).
    pub fn name(&self) -> &str {
        &self.name
    }
    /// Total size of the clean weights in their storage dtypes.
    pub fn model_size(&self) -> ByteSize {
        self.total
    }
    /// Total number of elements over all weights.
    pub fn numel(&self) -> u64 {
        self.numel
    }
    /// Block bytes and element count of the quantized weights (part of
    /// [`Model::model_size`] and [`Model::numel`]).
    pub fn quantized_size(&self) -> (ByteSize, u64) {
        self.quantized
    }
    /// The metadata of the GGUF file the model was read from (`None` for other models): model
    /// configs come from it (`llama.block_count`, ...).
    pub fn gguf_metadata(&self) -> Option<&GgufMetadata> {
        self.metadata.as_deref()
    }
    /// Number of weights.
    pub fn len(&self) -> usize {
        self.slots.len()
    }
    /// Whether the model has no weights.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }
    /// All slots, in file order.
    pub fn slots(&self) -> &[Slot] {
        &self.slots
    }
    /// The slot index of `key`.
    pub fn index_of(&self, key: &str) -> Option<usize> {
        self.index.get(key).copied()
    }
    /// The slot named `key`, or an error naming model and key.
    pub fn slot(&self, key: &str) -> Result<&Slot> {
        self.index_of(key)
            .map(|i| &self.slots[i])
            .ok_or_else(|| Error::UnknownWeight {
                model: self.name.clone(),
                key: key.to_string(),
            })
    }
    /// Weight keys in file order.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.slots.iter().map(|s| s.name.as_str())
    }
    /// Tensors in the file that are not float weights (integer buffers such as position ids),
    /// which were not loaded.
    pub fn skipped_tensors(&self) -> &[String] {
        &self.skipped
    }
    /// The clean tensor of `key` on the host (see [`Slot::clean`]).
    pub fn clean(&self, key: &str) -> Result<Tensor> {
        self.slot(key)?.clean()
    }

    /// Bytes of resident copies on `device`.
    pub fn resident_bytes(&self, device: DeviceId) -> ByteSize {
        self.state.read().bytes_on(device)
    }
    /// A number that changes whenever any of the model's resident copies changes.
    pub fn residency_generation(&self) -> u64 {
        self.state.read().generation()
    }
    /// Bytes of resident copies on any device.
    pub fn resident_bytes_total(&self) -> ByteSize {
        self.state.read().bytes_total()
    }
    /// Where weight `index` lives now.
    pub fn residency_of(&self, index: usize) -> Option<SlotResidency> {
        self.state.read().slots().get(index).cloned()
    }

    pub(crate) fn state(&self) -> RwLockReadGuard<'_, Residency> {
        self.state.read()
    }
    pub(crate) fn state_mut(&self) -> StateMut<'_> {
        StateMut(Some(self.state.write()))
    }

    /// Records that weight `index` was fetched by a forward. The first forward's order is kept;
    /// a weight seen again marks the order complete (the next forward has begun).
    pub fn record_use(&self, index: usize) {
        self.usage.record(index);
        // Free once the order is complete (after the second forward's first fetch): no lock.
        if self.order_complete.load(Ordering::Acquire) {
            return;
        }
        let mut fo = self.forward_order.lock();
        if fo.complete || index >= fo.seen.len() {
            return;
        }
        if fo.seen[index] {
            fo.complete = true;
            self.order_complete.store(true, Ordering::Release);
            return;
        }
        fo.seen[index] = true;
        fo.order.push(index);
    }

    /// Marks the recorded forward order complete (called at the end of a forward).
    pub fn finish_forward(&self) {
        let mut fo = self.forward_order.lock();
        if !fo.order.is_empty() {
            fo.complete = true;
            self.order_complete.store(true, Ordering::Release);
        }
    }

    /// The order in which weights were first used in a forward (slot indices), and whether the
    /// recording is complete.
    pub fn forward_order(&self) -> (Vec<usize>, bool) {
        let fo = self.forward_order.lock();
        (fo.order.clone(), fo.complete)
    }

    /// How many times a patched weight of this model was built (a patch chain applied to a clean
    /// weight), by any patcher: streamed LoRA'd weights count once per fetch, resident ones once
    /// per residency.
    pub fn patched_weights_built(&self) -> u64 {
        self.usage.patched()
    }

    /// How the model's weights were used (residency by use decides from it).
    pub(crate) fn usage(&self) -> &usage::Usage {
        &self.usage
    }

    /// The recorded forward order as weight keys.
    pub fn forward_order_keys(&self) -> Vec<String> {
        self.forward_order()
            .0
            .iter()
            .map(|&i| self.slots[i].name.clone())
            .collect()
    }

    /// A checksum of every clean weight's bytes (for tests of invariant I1).
    pub fn clean_checksum(&self) -> Result<u64> {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        for s in &self.slots {
            s.name.hash(&mut h);
            let bytes = tensor_bytes(&s.clean()?)?;
            bytes.hash(&mut h);
        }
        Ok(h.finish())
    }
}

/// The raw bytes of a CPU tensor, in its candle dtype.
pub(crate) fn tensor_bytes(t: &Tensor) -> Result<Vec<u8>> {
    use candle_core::DType;
    let flat = t.flatten_all()?;
    let ctx = |e| Error::tensor("reading tensor bytes", e);
    Ok(match t.dtype() {
        DType::F32 => flat
            .to_vec1::<f32>()
            .map_err(ctx)?
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        DType::F16 => flat
            .to_vec1::<half::f16>()
            .map_err(ctx)?
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        DType::BF16 => flat
            .to_vec1::<half::bf16>()
            .map_err(ctx)?
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        DType::U8 => flat.to_vec1::<u8>().map_err(ctx)?,
        DType::F64 => flat
            .to_vec1::<f64>()
            .map_err(ctx)?
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        DType::F8E4M3 => {
            let flat = flat.contiguous().map_err(ctx)?;
            let (storage, layout) = flat.storage_and_layout();
            let Some((start, end)) = layout.contiguous_offsets() else {
                return Err(Error::UnsupportedDtype {
                    dtype: "f8e4m3".into(),
                    what: "reading bytes of a strided fp8 tensor".into(),
                });
            };
            match &*storage {
                candle_core::Storage::Cpu(candle_core::CpuStorage::F8E4M3(v)) => {
                    v[start..end].iter().map(|x| x.to_bits()).collect()
                }
                _ => {
                    return Err(Error::UnsupportedDtype {
                        dtype: "f8e4m3".into(),
                        what: "reading bytes of a non-CPU fp8 tensor".into(),
                    })
                }
            }
        }
        other => {
            return Err(Error::UnsupportedDtype {
                dtype: format!("{other:?}"),
                what: "reading tensor bytes".into(),
            })
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn resident(device: DeviceId, bytes: u64) -> SlotResidency {
        SlotResidency::Resident {
            tensor: ResidentWeight::Dense(
                Tensor::zeros(1, candle_core::DType::U8, &candle_core::Device::Cpu).unwrap(),
            ),
            fingerprint: 0,
            device,
            bytes: ByteSize(bytes),
        }
    }

    #[test]
    fn an_eager_model_pins_through_one_tier_and_unpins_on_gpu_residency_and_drop() {
        let locker = crate::device::SimGpu::new(0, crate::device::SimSpec::new(ByteSize::gib(1)));
        let gpu = Some(crate::device::Gpu::Sim(Arc::clone(&locker)));
        let tier = HostTier::with_pinning(None, ByteSize::mib(8), gpu.clone());
        let other = HostTier::with_pinning(None, ByteSize::mib(8), gpu);
        let mib = |v: f32| Tensor::full(v, 1 << 18, &candle_core::Device::Cpu).unwrap();
        let model = Model::from_tensors("m", [("a", mib(1.0)), ("b", mib(2.0))]).unwrap();
        let (a, b) = (model.clean("a").unwrap(), model.clean("b").unwrap());
        assert!(model.pin_clean(0, &tier, &a).is_some());
        assert!(model.host_tier().is_some_and(|t| t.same(&tier)));
        assert!(
            model.pin_clean(1, &other, &b).is_none(),
            "one tier per model"
        );
        assert_eq!(
            (tier.pinned(), locker.registered_host().len()),
            (ByteSize::mib(1), 1)
        );
        // A weight resident on a GPU is never pinned, and one that becomes resident is unpinned.
        model.state_mut().set(1, resident(DeviceId::Cuda(0), 4));
        assert!(model.pin_clean(1, &tier, &b).is_none());
        model.state_mut().set(0, resident(DeviceId::Cuda(0), 4));
        assert_eq!(
            (tier.pinned(), locker.registered_host().len()),
            (ByteSize::ZERO, 0)
        );
        model.state_mut().set(0, SlotResidency::Offloaded);
        assert!(model.pin_clean(0, &tier, &a).is_some());
        // The bits are untouched, and dropping the model unpins.
        assert_eq!(a.sum_all().unwrap().to_scalar::<f32>().unwrap(), 262144.0);
        drop(model);
        assert_eq!(
            (tier.pinned(), locker.registered_host().len()),
            (ByteSize::ZERO, 0)
        );
    }

    proptest! {
        /// The running totals always equal the sum over the slots, whatever the sequence of
        /// loads, replacements and offloads (zero-byte weights included).
        #[test]
        fn running_totals_match_the_slots(
            ops in prop::collection::vec((0usize..6, 0u8..3, 0u64..5000), 1..64)
        ) {
            let devices = [DeviceId::Cpu, DeviceId::Cuda(0)];
            let mut r = Residency::new(6);
            for (i, what, bytes) in ops {
                let new = match what {
                    0 => SlotResidency::Offloaded,
                    d => resident(devices[d as usize - 1], bytes),
                };
                r.set(i, new);
                for d in devices {
                    let sum: u64 = r
                        .slots()
                        .iter()
                        .filter_map(|s| match s {
                            SlotResidency::Resident { device, bytes, .. } if *device == d => {
                                Some(bytes.bytes())
                            }
                            _ => None,
                        })
                        .sum();
                    prop_assert_eq!(r.bytes_on(d), ByteSize(sum));
                    let holds = r.slots().iter().any(
                        |s| matches!(s, SlotResidency::Resident { device, .. } if *device == d),
                    );
                    prop_assert_eq!(r.devices().contains(&d), holds);
                }
                prop_assert_eq!(
                    r.bytes_total(),
                    r.bytes_on(DeviceId::Cpu).saturating_add(r.bytes_on(DeviceId::Cuda(0)))
                );
            }
        }
    }
}
