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
//! What a model's own code holds as tensors of its own, outside the ledger, is counted per model
//! in the held-outside table (`outside.rs`; [`Model::held_outside`] reads it, a dropped model is
//! forgotten there).
//!
//! Locks: `Model::state` (`Rank::ModelState` in the crate's lock table, `src/lock/rank.rs`)
//! guards residency and pins; the forward-order recorder ranks after it. Neither is held across a
//! call into user code, and no thread reads `Model::state` twice (the checker refuses it). A
//! change of a weight's residency tells the model's host tier under `Model::state`; a pin that
//! change releases is dropped after the write lock is released (`StateMut`).
//!
//! Complexity: lookups by name are O(1); residency updates are O(number of weights touched).

mod access;
mod gguf;
mod host;
mod lazy;
pub(crate) mod outside;
mod page;
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
pub(crate) use self::quant::build as qtensor_from_slice;
pub(crate) use self::quant::qtensor_from_bytes;
pub use self::quant::{block_bytes, expert_key, GgufMetadata, Stack};
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

    /// Drops weight `index`'s resident copy — only one on `on` when given — and returns it
    /// (`Offloaded` when there was none to drop). The one eviction step a load's plan
    /// (`loader/execute.rs`, which records it for its undo log) and a fault-in's room
    /// (`loader/dynamic`, which returns its bytes to the ledger at once) share.
    pub(crate) fn evict(&mut self, index: usize, on: Option<DeviceId>) -> SlotResidency {
        match self.slots.get(index) {
            Some(SlotResidency::Resident { device, .. }) if on.is_none_or(|d| d == *device) => {
                self.set(index, SlotResidency::Offloaded)
            }
            _ => SlotResidency::Offloaded,
        }
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
    /// Stacked-expert tensors of a GGUF file, each held as one slot per expert.
    stacks: HashMap<String, quant::Stack>,
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
    /// The patch-set version of the patcher last loaded by a manager, plus one (0: never
    /// loaded); a forward through another patch set is warned about (the clone trap).
    loaded_patches: AtomicU64,
    /// Set once the parameters held outside the ledger were warned about.
    warned_outside: std::sync::atomic::AtomicBool,
    /// A value built from the resident copies (a managed model's module), valid while the
    /// residency generation and the builder's key are the ones it was built at.
    derived: Mutex<Option<Derived>>,
    /// The host tier holding this model's host copies (lazy models) or pins (set on the first
    /// pin of an eager model); told when the model is dropped.
    host: OnceCell<HostTier>,
}

impl Drop for Model {
    fn drop(&mut self) {
        outside::forget_model(self.id);
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
            crate::lock::check_wait("a read-back of a weight to the host (candle `to_device`)");
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
            stacks: HashMap::new(),
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
            loaded_patches: AtomicU64::new(0),
            warned_outside: std::sync::atomic::AtomicBool::new(false),
            derived: Mutex::new(Rank::Derived, None),
            host,
        })
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
mod tests;
