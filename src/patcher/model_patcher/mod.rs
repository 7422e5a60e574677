//! [`ModelPatcher`]: the per-use handle on a shared [`Model`].
//!
//! `mod.rs` holds the handle, its patch set and options, fingerprints and sizes;
//! `materialize.rs` builds a weight as it is used (patched, rounded, cast, on its device: the one
//! path behind resident copies and streamed fetches); `placement.rs` chooses which weights are
//! resident (load, partial load and unload, pins).

use std::any::Any;
use std::collections::HashMap;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use candle_core::Tensor;

mod materialize;
mod patches;
mod placement;

pub(crate) use materialize::{cast_weight, Finish};

use super::adapters::{self, DoraNorm, Offset, Patch, PatchEntry};
use crate::error::{Error, Result};
use crate::float::Dtype;
use crate::size::ByteSize;
use crate::vram::DeviceId;
use crate::weights::{Fingerprint, Model, SlotResidency};

static NEXT_PATCHER_ID: AtomicU64 = AtomicU64::new(1);
static NEXT_PATCH_ID: AtomicU64 = AtomicU64::new(1);

/// A patch target: a weight key, optionally narrowed by an offset `(dim, start, len)`.
#[derive(Debug, Clone, PartialEq)]
pub struct PatchKey {
    /// The weight key.
    pub key: String,
    /// The region of the weight the patch applies to.
    pub offset: Option<Offset>,
}

impl PatchKey {
    /// The key alone, when the patch covers the whole weight.
    pub fn whole(&self) -> Option<&str> {
        self.offset.is_none().then_some(self.key.as_str())
    }
}

impl PartialEq<str> for PatchKey {
    /// A key without offset equals its name.
    fn eq(&self, other: &str) -> bool {
        self.whole() == Some(other)
    }
}

impl PartialEq<&str> for PatchKey {
    fn eq(&self, other: &&str) -> bool {
        self.whole() == Some(*other)
    }
}

impl std::fmt::Display for PatchKey {
    /// `key`, or `key[dim 0: 64..128]` for a region.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.offset {
            None => f.write_str(&self.key),
            Some(o) => write!(
                f,
                "{}[dim {}: {}..{}]",
                self.key,
                o.dim,
                o.start,
                o.start + o.len
            ),
        }
    }
}

impl From<&str> for PatchKey {
    fn from(key: &str) -> Self {
        PatchKey {
            key: key.to_string(),
            offset: None,
        }
    }
}
impl From<String> for PatchKey {
    fn from(key: String) -> Self {
        PatchKey { key, offset: None }
    }
}
impl From<(String, Offset)> for PatchKey {
    fn from((key, offset): (String, Offset)) -> Self {
        PatchKey {
            key,
            offset: Some(offset),
        }
    }
}
impl From<(&str, Offset)> for PatchKey {
    fn from((key, offset): (&str, Offset)) -> Self {
        PatchKey {
            key: key.to_string(),
            offset: Some(offset),
        }
    }
}

/// A patch entry with the process-unique id that fingerprints are built from (shared by clones,
/// never reused).
#[derive(Debug, Clone)]
pub struct SetEntry {
    /// Unique id of this entry.
    pub id: u64,
    /// The entry.
    pub entry: PatchEntry,
}

/// Patches per weight key; shared copy-on-write between clones.
#[derive(Debug, Clone, Default)]
pub struct PatchSet {
    map: HashMap<String, Arc<Vec<SetEntry>>>,
    /// Changes with every addition (process-unique; 0 for an empty set), so "same patches" is one
    /// comparison.
    version: u64,
}

impl PatchSet {
    /// The entries for `key`, in application order.
    pub fn get(&self, key: &str) -> &[SetEntry] {
        self.map.get(key).map(|v| v.as_slice()).unwrap_or(&[])
    }
    /// Number of patched keys.
    pub fn len(&self) -> usize {
        self.map.len()
    }
    /// Whether no key is patched.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
    /// Patched keys.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.map.keys().map(|k| k.as_str())
    }
    /// The set's version: process-unique per addition, shared by clones that added nothing
    /// since, 0 for an empty set. Equal versions mean the same patches.
    pub fn version(&self) -> u64 {
        self.version
    }
}

/// Estimates activation memory for an input shape (supplied by the model's author).
pub type MemoryEstimator = Arc<dyn Fn(&[usize]) -> ByteSize + Send + Sync>;

/// A function applied to a weight at use, after it is fetched, patched and cast to the compute
/// dtype (see [`ModelPatcher::add_weight_wrapper`]). It runs on every forward, on resident and
/// streamed weights alike, so it never changes residency or fingerprints.
pub type WeightWrapper = Arc<dyn Fn(Tensor) -> Result<Tensor> + Send + Sync>;

pub use crate::weights::WEIGHT_SCALE_SUFFIX;

/// Per-patcher options.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PatcherOptions {
    /// The dtype weights compute in; resident copies are kept in it. `None`: as stored.
    pub compute_dtype: Option<Dtype>,
    /// How DoRA normalises.
    pub dora: DoraNorm,
    /// Quantized (GGUF) weights with patches: re-quantized to their own format after patching
    /// (resident and streamed alike, so they stay block-sized and use the quantized kernels)
    /// instead of used dense. Smaller and faster, lossy; off by default (ComfyUI-GGUF's
    /// semantics: patched weights dense).
    pub requantize_patched: bool,
}

/// What a patcher's resident copies depend on, for the whole model at once
/// ([`ModelPatcher::residency_signature`]).
pub(crate) type ResidencySignature = (u64, Option<Dtype>, DoraNorm, bool, DeviceId, u64);

/// What a [`ModelPatcher::load`] or partial load did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LoadOutcome {
    /// Bytes resident on the device after the call (this model).
    pub resident: ByteSize,
    /// Bytes that stream at use (in the resident dtype).
    pub streaming: ByteSize,
    /// Bytes materialized by this call (new or re-patched copies).
    pub moved: ByteSize,
    /// Bytes whose resident copies were dropped by this call.
    pub freed: ByteSize,
    /// Streamed weights that carry patches (applied lazily at use).
    pub lazy_patched: usize,
    /// Whether every weight is resident.
    pub full: bool,
}

/// The per-use handle on a model: `Arc<Model>` + its own patch set + devices + options.
///
/// # Sharing
///
/// - [`Clone::clone`] shares the [`Model`] — its clean weights **and its resident copies** — and
///   copies the patch set copy-on-write: the map of patched keys is shared until either side adds
///   patches, so a clone costs O(1) and the first `add_patches` on it O(number of patched keys).
///   Options, devices, attachments, weight wrappers and additional models are copied
///   (attachments and wrappers by `Arc`, copy-on-write).
///   The clone records its parent's id ([`ModelPatcher::parent_id`]).
/// - A device map ([`ModelPatcher::with_device_map`]) is shared (resolved once, with its
///   activation counters), so a clone is split the same way; the load device of a patcher the
///   manager places ([`ModelPatcher::with_auto_device`]) is one cell shared by its clones, which
///   share its resident copies.
/// - Nothing a clone does changes the original's patches, and no patcher ever changes a clean
///   weight (I1, docs/ARCHITECTURE.md §4.1): patched values are always new tensors.
/// - Resident copies belong to the model and carry the fingerprint of the patch list they were
///   built from. A clone with different patches re-materializes only the weights whose patch lists
///   differ; other patchers see a stale fingerprint and stream those weights until they load again.
/// - `ModelPatcher` is `Send + Sync`; the model's residency is behind one lock.
pub struct ModelPatcher {
    model: Arc<Model>,
    patches: Arc<PatchSet>,
    load_device: DeviceId,
    offload_device: DeviceId,
    options: PatcherOptions,
    id: u64,
    parent: Option<u64>,
    additional: Vec<ModelPatcher>,
    attachments: Arc<HashMap<String, Arc<dyn Any + Send + Sync>>>,
    estimator: Option<MemoryEstimator>,
    wrappers: Arc<HashMap<String, Vec<WeightWrapper>>>,
    /// Every weight's fingerprint, computed once per patch set and options (every change
    /// clears it: those take `&mut self`).
    fingerprints: std::sync::OnceLock<Arc<[Fingerprint]>>,
    /// A device map resolved against the model (a split model); shared by clones.
    placement: Option<Arc<crate::patcher::device_map::Placement>>,
    /// The load device, when the manager chooses it ([`ModelPatcher::with_auto_device`]):
    /// shared by clones, set by each load.
    auto_device: Option<Arc<AtomicDevice>>,
}

/// A [`DeviceId`] the manager can change under shared handles.
#[derive(Debug)]
pub(crate) struct AtomicDevice(std::sync::atomic::AtomicU64);

impl AtomicDevice {
    fn encode(d: DeviceId) -> u64 {
        match d {
            DeviceId::Cpu => u64::MAX,
            DeviceId::Cuda(n) => (n as u64) << 1,
            DeviceId::Sim(n) => ((n as u64) << 1) | 1,
        }
    }
    fn new(d: DeviceId) -> AtomicDevice {
        AtomicDevice(std::sync::atomic::AtomicU64::new(Self::encode(d)))
    }
    fn get(&self) -> DeviceId {
        match self.0.load(Ordering::Acquire) {
            u64::MAX => DeviceId::Cpu,
            v if v & 1 == 1 => DeviceId::Sim((v >> 1) as usize),
            v => DeviceId::Cuda((v >> 1) as usize),
        }
    }
    fn set(&self, d: DeviceId) {
        self.0.store(Self::encode(d), Ordering::Release);
    }
}

/// The fingerprint of an unpatched weight resident in `dtype`: the hash of the dtype alone, as
/// [`ModelPatcher::fingerprint`] computes it, read from a table.
fn clean_fingerprint(dtype: Dtype) -> Fingerprint {
    fn hash_of(dtype: Dtype) -> Fingerprint {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        dtype.hash(&mut h);
        h.finish()
    }
    static TABLE: once_cell::sync::Lazy<[(Dtype, Fingerprint); 6]> =
        once_cell::sync::Lazy::new(|| Dtype::ALL.map(|d| (d, hash_of(d))));
    TABLE
        .iter()
        .find(|(d, _)| *d == dtype)
        .map(|&(_, f)| f)
        .unwrap_or_else(|| hash_of(dtype))
}

impl Clone for ModelPatcher {
    fn clone(&self) -> Self {
        ModelPatcher {
            model: Arc::clone(&self.model),
            patches: Arc::clone(&self.patches),
            load_device: self.load_device,
            offload_device: self.offload_device,
            options: self.options,
            id: NEXT_PATCHER_ID.fetch_add(1, Ordering::Relaxed),
            parent: Some(self.id),
            additional: self.additional.clone(),
            attachments: Arc::clone(&self.attachments),
            estimator: self.estimator.clone(),
            wrappers: Arc::clone(&self.wrappers),
            fingerprints: self.fingerprints.clone(),
            placement: self.placement.clone(),
            auto_device: self.auto_device.clone(),
        }
    }
}

impl ModelPatcher {
    /// Another handle that *is* this patcher: same id and parent, same patches, devices and
    /// options (a [`Clone::clone`] is a new patcher whose parent is this one). The memory manager
    /// keeps such handles in its registry and undo log.
    /// Takes `other`'s computed fingerprints when this handle has none and both want the same
    /// resident copies (same model, equal residency signatures): a no-op reload then publishes
    /// the registry's view without hashing every weight again.
    pub(crate) fn adopt_fingerprints(&self, other: &ModelPatcher) {
        if !Arc::ptr_eq(&self.model, &other.model)
            || self.residency_signature() != other.residency_signature()
        {
            return;
        }
        if let Some(all) = other.fingerprints.get() {
            // Already set (a race with another reader) is the same value.
            let _ = self.fingerprints.set(Arc::clone(all));
        }
    }

    pub(crate) fn same_handle(&self) -> ModelPatcher {
        ModelPatcher {
            id: self.id,
            parent: self.parent,
            ..self.clone()
        }
    }
}

impl fmt::Debug for ModelPatcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ModelPatcher")
            .field("model", &self.model.name())
            .field("id", &self.id)
            .field("parent", &self.parent)
            .field("patched_keys", &self.patches.len())
            .field("load_device", &self.load_device())
            .field("offload_device", &self.offload_device)
            .field("options", &self.options)
            .finish()
    }
}
impl ModelPatcher {
    /// A patcher on `model` that computes on `load_device`, its clean weights kept in host memory
    /// (the usual case: `ModelPatcher::new(model, load_device, DeviceId::Cpu)`, with the devices
    /// named).
    pub fn on_device(model: impl Into<Arc<Model>>, load_device: DeviceId) -> Self {
        ModelPatcher::new(model, load_device, DeviceId::Cpu)
    }

    /// A patcher on `model` that computes on `load_device` and keeps clean weights on
    /// `offload_device` (the device weights go back to when evicted; the host, `DeviceId::Cpu`,
    /// in every configuration ComfyUI ships). [`ModelPatcher::on_device`] names the usual case.
    pub fn new(
        model: impl Into<Arc<Model>>,
        load_device: DeviceId,
        offload_device: DeviceId,
    ) -> Self {
        ModelPatcher {
            model: model.into(),
            patches: Arc::new(PatchSet::default()),
            load_device,
            offload_device,
            options: PatcherOptions::default(),
            id: NEXT_PATCHER_ID.fetch_add(1, Ordering::Relaxed),
            parent: None,
            additional: Vec::new(),
            attachments: Arc::new(HashMap::new()),
            estimator: None,
            wrappers: Arc::new(HashMap::new()),
            fingerprints: std::sync::OnceLock::new(),
            placement: None,
            auto_device: None,
        }
    }

    /// Sets the compute dtype (manual cast); resident copies are kept in it.
    pub fn with_compute_dtype(mut self, dtype: Option<Dtype>) -> Self {
        self.options.compute_dtype = dtype;
        self.fingerprints = std::sync::OnceLock::new();
        self
    }

    /// Sets how DoRA normalises (default: the paper's form).
    pub fn with_dora_norm(mut self, dora: DoraNorm) -> Self {
        self.options.dora = dora;
        self.fingerprints = std::sync::OnceLock::new();
        self
    }

    /// The options.
    pub fn options(&self) -> PatcherOptions {
        self.options
    }

    /// The shared model.
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// The device this patcher computes on (for one the manager places, where its last load put
    /// it).
    pub fn load_device(&self) -> DeviceId {
        match &self.auto_device {
            Some(d) => d.get(),
            None => self.load_device,
        }
    }

    /// Leaves the load device to the memory manager (docs/ARCHITECTURE.md §5.1): each load puts
    /// the model where it is already resident, else on the GPU where it fits with the least
    /// eviction, else where eviction costs least — decided in [`crate::MemoryManager::plan`]
    /// and shown there. The device given to [`ModelPatcher::new`] is where it starts. Clones
    /// share the choice (they share the model's resident copies).
    pub fn with_auto_device(mut self) -> Self {
        self.auto_device = Some(Arc::new(AtomicDevice::new(self.load_device())));
        self
    }

    /// Whether the manager chooses the load device.
    pub fn is_auto_device(&self) -> bool {
        self.auto_device.is_some()
    }

    /// This handle fixed on `device` (what a plan decided for an auto-placed patcher).
    pub(crate) fn placed_on(&self, device: DeviceId) -> ModelPatcher {
        let mut p = self.same_handle();
        p.auto_device = None;
        p.load_device = device;
        p
    }

    /// Records the manager's choice for an auto-placed patcher (and its clones).
    pub(crate) fn set_auto_device(&self, device: DeviceId) {
        if let Some(d) = &self.auto_device {
            d.set(device);
        }
    }

    /// Splits the model across devices by `map` (docs/ARCHITECTURE.md §5.2): each weight a
    /// rule maps to a device is resident there (within that device's budget) and the layer
    /// using it computes there; weights mapped to [`crate::Target::Host`] always stream to the
    /// load device; the rest stay on the load device. Clones share the map. An empty map undoes
    /// a split.
    pub fn with_device_map(mut self, map: crate::DeviceMap) -> Self {
        self.placement = (!map.is_empty())
            .then(|| crate::patcher::device_map::Placement::resolve(map, &self.model));
        self
    }

    /// The device map, when the model is split.
    pub fn device_map(&self) -> Option<&crate::DeviceMap> {
        self.placement.as_ref().map(|p| &p.map)
    }

    /// The device weight `index` is resident on (and computes on) when resident: its mapped
    /// device, else the load device.
    pub fn weight_device(&self, index: usize) -> DeviceId {
        match self
            .placement
            .as_ref()
            .and_then(|p| p.targets.get(index).copied().flatten())
        {
            Some(crate::Target::Device(d)) => d,
            _ => self.load_device(),
        }
    }

    /// Whether weight `index` is mapped to the host: never resident, streamed at every use.
    pub fn streams_always(&self, index: usize) -> bool {
        self.placement
            .as_ref()
            .is_some_and(|p| p.targets.get(index).copied().flatten() == Some(crate::Target::Host))
    }

    /// Every device this patcher's weights are resident on when loaded: the load device and the
    /// devices its map names, sorted.
    pub fn devices(&self) -> Vec<DeviceId> {
        let mut out = vec![self.load_device()];
        if let Some(p) = &self.placement {
            out.extend(p.targets.iter().filter_map(|t| match t {
                Some(crate::Target::Device(d)) => Some(*d),
                _ => None,
            }));
        }
        out.sort();
        out.dedup();
        out
    }

    /// For a weight mapped to another device than the load device: (load device, its device,
    /// the split's activation counters).
    pub(crate) fn remote_weight(
        &self,
        index: usize,
    ) -> Option<(
        DeviceId,
        DeviceId,
        &crate::patcher::device_map::ActivationMoves,
    )> {
        let p = self.placement.as_ref()?;
        match p.targets.get(index).copied().flatten() {
            Some(crate::Target::Device(d)) if d != self.load_device() => {
                Some((self.load_device(), d, &p.moves))
            }
            _ => None,
        }
    }

    /// What the split model's forwards moved between devices (zero for an unsplit model).
    pub fn split_stats(&self) -> crate::patcher::SplitStats {
        self.placement
            .as_ref()
            .map(|p| p.moves.snapshot())
            .unwrap_or_default()
    }

    /// The placement's identity (0 when unsplit): part of the residency signature.
    pub(crate) fn placement_id(&self) -> u64 {
        self.placement.as_ref().map_or(0, |p| p.id)
    }

    /// Tells a split model's placement the manager's devices (for its activation copies).
    pub(crate) fn note_devices(&self, devices: &crate::device::Devices) {
        if let Some(p) = &self.placement {
            p.moves.set_devices(devices);
        }
    }

    /// The device clean weights live on.
    pub fn offload_device(&self) -> DeviceId {
        self.offload_device
    }

    /// This handle's process-unique id.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The id of the patcher this one was cloned from.
    pub fn parent_id(&self) -> Option<u64> {
        self.parent
    }

    /// Whether `other` shares this patcher's model.
    pub fn is_clone(&self, other: &ModelPatcher) -> bool {
        Arc::ptr_eq(&self.model, &other.model)
    }

    /// Total size of the clean weights (storage dtypes).
    pub fn model_size(&self) -> ByteSize {
        self.model.model_size()
    }

    /// Total size of the weights in their resident dtype. O(1): the model's size in storage
    /// dtypes, or its dense elements times the compute dtype's width plus its quantized weights'
    /// block bytes.
    pub fn resident_model_size(&self) -> ByteSize {
        match self.options.compute_dtype {
            None => self.model.model_size(),
            Some(d) => {
                let (q_bytes, q_numel) = self.model.quantized_size();
                d.storage_size(self.model.numel() - q_numel)
                    .saturating_add(q_bytes)
            }
        }
    }

    /// Bytes of this model resident on the load device with this patcher's fingerprints.
    pub fn loaded_size(&self) -> ByteSize {
        let st = self.model.state();
        st.slots()
            .iter()
            .enumerate()
            .map(|(i, s)| match s {
                SlotResidency::Resident {
                    fingerprint,
                    device,
                    bytes,
                    ..
                } if *device == self.weight_device(i) && *fingerprint == self.fingerprint(i) => {
                    *bytes
                }
                _ => ByteSize::ZERO,
            })
            .sum()
    }

    /// The device holding resident weights of this model, if any.
    pub fn current_loaded_device(&self) -> Option<DeviceId> {
        self.model.state().devices().first().copied()
    }

    /// Streamed weights (not current-resident) that carry patches: each gets its patches applied
    /// at use (ComfyUI's lowvram patches).
    pub fn lowvram_patch_counter(&self) -> usize {
        let st = self.model.state();
        (0..self.model.len())
            .filter(|&i| {
                let name = self.model.slots()[i].name();
                !self.patches.get(name).is_empty() && !self.is_current(&st.slots()[i], i)
            })
            .count()
    }

    fn is_current(&self, s: &SlotResidency, index: usize) -> bool {
        matches!(s, SlotResidency::Resident { fingerprint, device, .. }
            if *device == self.weight_device(index) && *fingerprint == self.fingerprint(index))
    }

    /// Sets the activation-memory estimator used by [`ModelPatcher::memory_required`].
    pub fn set_memory_estimator(&mut self, estimator: MemoryEstimator) {
        self.estimator = Some(estimator);
    }

    /// Activation memory a forward over `input_shape` needs, from the model's estimator (zero when
    /// none was set).
    pub fn memory_required(&self, input_shape: &[usize]) -> ByteSize {
        self.estimator
            .as_ref()
            .map(|f| f(input_shape))
            .unwrap_or(ByteSize::ZERO)
    }

    /// Adds a model that must be loaded together with this one (a control model, say).
    pub fn add_additional_model(&mut self, other: ModelPatcher) {
        self.additional.push(other);
    }

    /// The models loaded together with this one.
    pub fn additional_models(&self) -> &[ModelPatcher] {
        &self.additional
    }

    /// Attaches a typed value under `name` (copied by `Arc` into clones).
    pub fn set_attachment<T: Any + Send + Sync>(&mut self, name: &str, value: T) {
        Arc::make_mut(&mut self.attachments).insert(name.to_string(), Arc::new(value));
    }

    /// The attachment under `name`, if it has type `T`.
    pub fn attachment<T: Any + Send + Sync>(&self, name: &str) -> Option<&T> {
        self.attachments
            .get(name)
            .and_then(|a| a.downcast_ref::<T>())
    }

    /// Registers `wrapper` to run on weight `key` at every use, after it is fetched, patched and
    /// cast (ComfyUI's weight wrappers). Wrappers of one key run in registration order. They do
    /// not enter fingerprints: they apply to resident and streamed weights alike. Copy-on-write
    /// between clones, like patches.
    pub fn add_weight_wrapper(
        &mut self,
        key: &str,
        wrapper: impl Fn(Tensor) -> Result<Tensor> + Send + Sync + 'static,
    ) {
        Arc::make_mut(&mut self.wrappers)
            .entry(key.to_string())
            .or_default()
            .push(Arc::new(wrapper));
    }

    /// The wrappers registered on weight `key`, in order.
    pub fn weight_wrappers(&self, key: &str) -> &[WeightWrapper] {
        self.wrappers.get(key).map(|v| v.as_slice()).unwrap_or(&[])
    }

    /// Removes every weight wrapper.
    pub fn clear_weight_wrappers(&mut self) {
        self.wrappers = Arc::new(HashMap::new());
    }
}
