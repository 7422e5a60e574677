//! The memory manager: which models stay loaded, how much of each, and who is evicted.
//!
//! A [`MemoryManager`] owns the registry of loaded models (most recently used first) and computes
//! each scheduled device's ledger from it: the ledger of a device is the sum of the resident bytes
//! of the registered models on it, so it is exact by construction (I2, docs/ARCHITECTURE.md §4.2).
//! A budgeted device's free memory is its total minus the ledger; a CUDA device without a budget
//! reports the driver's free memory.
//!
//! [`MemoryManager::load_models_gpu`] is *plan, validate, act* (docs/ARCHITECTURE.md §5): a pure
//! [`MemoryManager::plan`] ([`plan`]) decides every eviction, each model's weight budget
//! ([`weight_budget`]) and exactly which weights will be resident, checks the result against
//! every budget and refuses invalid requests — all before anything moves; execution
//! (`loader/execute.rs`) then carries the plan out in an order that keeps the ledger within budget at
//! every step, and rolls back what it did if the driver fails mid-way. Eviction order: most
//! offloaded bytes first, then fewest outside handles, then smallest, then most recently used;
//! smart memory unloads each victim only by what is missing.
//!
//! Models being loaded stay in the registry throughout (they take their final places before the
//! first copy is built), so the ledger counts them at every step. Bytes of prefetched weights are
//! booked in the ledger (`loader/ledger.rs`) by reservation, and a reservation that would overrun a budget is
//! refused, so the bound holds whatever loads on other threads. So are the manual casts `ops`
//! layers cache for resident weights ([`crate::ops::CastCache`]): plans count them as free, and a
//! load that needs their room (or [`MemoryManager::free_memory`]) drops them before it evicts.
//!
//! Locks: every lock of the crate is ranked in `src/lock/rank.rs` (docs/ARCHITECTURE.md §7 is the
//! same table, and debug builds check every acquisition against it).
//!
//! The manager lock is held while a load is planned and executed, which serializes loads (that
//! is what keeps the plan's figures true while it is carried out); it is never held while calling
//! a model's memory estimator or any other user code.
//! `loaded_models` and `memory_report` do not take it: they read the registry view (each model's
//! bytes live) and the ledger's books (each device's figure as of the last step). `ledger` and
//! `get_free_memory` do, to be exact: summed mid-load they could mix a victim's copies before
//! they were dropped with the copies built after them.
//!
//! The host tier ([`MemoryManager::host_tier`]) has a ledger of its own: host copies of lazily
//! read weights held plus bytes being read, bounded by `--ram-budget`. Its lock is taken inside
//! `Model::state` when a weight's residency changes and is never held across a file read, a
//! driver call or a wait.

#[cfg(test)]
mod booking_tests;
mod dynamic;
mod execute;
mod free;
mod global;
mod ledger;
mod load;
#[cfg(test)]
mod model_based;
mod options;
mod placement;
pub mod plan;
mod predict;
mod report;
mod reserve;
mod source;

use free::cleanup;
use load::expand;

use std::sync::Arc;

use crate::lock::{Mutex, Rank};

use crate::error::Result;
use crate::offload::{PinnedPool, PrefetchGate, Streamer, TransferEngine, TransferSnapshot};
use crate::patcher::ModelPatcher;
use crate::size::ByteSize;
use crate::vram::{Config, DeviceId, Hardware, Policy, VramState};
use crate::weights::{HostTier, Model};

use self::ledger::Ledger;
pub use dynamic::{DynamicDeviceReport, DynamicLayerReport};
pub use global::{global, init_global};
pub use options::{weight_budget, InputShape, LoadOptions, MIN_WEIGHT_BUDGET};
pub use plan::{
    DepthOption, LoadPlan, PlacedOn, PlanProblem, PlannedDevice, PlannedHost, PlannedLoad,
};
pub use predict::{Recommendation, StepAudit, RECOMMEND_GAIN};
pub use report::{DeviceMemory, Eviction, LoadReport, LoadedModelInfo, MemoryReport, ModelLoad};
pub use reserve::{KeepGuard, MemoryReservation, ReservationInfo};

struct Entry {
    patcher: ModelPatcher,
    device: DeviceId,
    /// Set when a load left every weight resident and current: the model's residency generation
    /// and the patcher's signature then. While both still match, loading the model again is a
    /// no-op that visits no weight.
    full_at: Option<FullAt>,
}

/// A model fully loaded by a patcher, as of one residency generation.
#[derive(Debug, Clone, Copy, PartialEq)]
struct FullAt {
    generation: u64,
    signature: crate::patcher::ResidencySignature,
}

impl Clone for Entry {
    /// The same handle (same patcher id), for the undo log.
    fn clone(&self) -> Self {
        Entry {
            patcher: self.patcher.same_handle(),
            device: self.device,
            full_at: self.full_at,
        }
    }
}

impl Entry {
    fn model(&self) -> &Arc<Model> {
        self.patcher.model()
    }
    /// Handles outside the registry: every other `Arc<Model>` (user patchers and clones).
    fn outside_handles(&self) -> usize {
        Arc::strong_count(self.model()).saturating_sub(1)
    }
}

struct Inner {
    registry: Vec<Entry>,
    pool: Option<PinnedPool>,
    /// Models that left the registry during the current call; their derived values (managed
    /// modules) are dropped at its end.
    unloaded: Vec<Arc<Model>>,
}

/// The registry of loaded models, the per-device ledger and the policy.
pub struct MemoryManager {
    policy: Policy,
    host: HostTier,
    engine: Arc<TransferEngine>,
    ledger: Arc<Ledger>,
    /// The ledger's column for cached manual casts, the gate every model's `CastCache` books on.
    cast_gate: Arc<dyn PrefetchGate>,
    /// Every manual-cast cache this manager attached (weakly): plans count all booked casts as
    /// free, so dropping casts must reach every cache, not only registered models' (a model that
    /// left the registry while a handle kept it alive may still hold casts).
    casts: Arc<Mutex<Vec<std::sync::Weak<crate::ops::CastCache>>>>,
    /// Models kept by [`KeepGuard`]s: model id → live guards (a leaf lock).
    kept: Arc<Mutex<std::collections::HashMap<u64, usize>>>,
    inner: Mutex<Inner>,
    /// The registry as reports read it: published whenever the manager lock is released
    /// ([`InnerGuard`]), so `loaded_models` and `memory_report` never wait for a load (a leaf
    /// lock, held for an `Arc` clone).
    view: Arc<Mutex<Arc<[ViewEntry]>>>,
    /// Residency by use (dynamic mode): the keeper streamers of loaded models fault in through.
    dynamic: Arc<dynamic::Dynamic>,
    /// The measured costs of cost-aware misses (`--cost-aware-misses`), shared by every
    /// streamer this manager attaches; `None` when off.
    misses: Option<Arc<crate::offload::MissCosts>>,
    /// The measured copy figures of every device (`crate::costs`), fed by the streamers'
    /// synchronous fetches.
    costs: Arc<crate::costs::CostModel>,
    /// The last [`StepAudit`] of each model.
    audits: Mutex<Vec<StepAudit>>,
    /// The planner's last prefetch-depth choice per model, kept while what it was made for
    /// holds (`plan::group`): a reload that decides nothing new does not predict again.
    depth_choices: Mutex<Vec<plan::DepthChoice>>,
}

/// A registry entry as reports see it: membership and order as of the last release of the
/// manager lock; each model's resident bytes are read live.
#[derive(Clone)]
struct ViewEntry {
    model: std::sync::Weak<Model>,
    device: DeviceId,
    size: ByteSize,
    /// The registered patcher's fingerprints: residency by use keeps only copies of what the
    /// registered patcher computes with (a rollback can rebuild those).
    fingerprints: Arc<[crate::weights::Fingerprint]>,
}

/// The manager lock; releasing it publishes the registry view, and only then reopens the
/// devices the call closed ([`InnerGuard::hold_closed`]).
struct InnerGuard<'a> {
    guard: crate::lock::MutexGuard<'a, Inner>,
    view: &'a Mutex<Arc<[ViewEntry]>>,
    /// Devices closed to bookings and fault-in commits until the view is published: a fault-in
    /// committing in between would see a model the call removed as still registered, and keep
    /// a copy the ledger never counts.
    closed: Vec<ledger::LoadingGuard>,
}

impl InnerGuard<'_> {
    /// Keeps `guard`'s devices closed until this lock is released and the view published.
    fn hold_closed(&mut self, guard: ledger::LoadingGuard) {
        self.closed.push(guard);
    }
}

impl std::ops::Deref for InnerGuard<'_> {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.guard
    }
}

impl std::ops::DerefMut for InnerGuard<'_> {
    fn deref_mut(&mut self) -> &mut Inner {
        &mut self.guard
    }
}

impl Drop for InnerGuard<'_> {
    fn drop(&mut self) {
        let entries: Arc<[ViewEntry]> = self
            .guard
            .registry
            .iter()
            .map(|e| ViewEntry {
                model: Arc::downgrade(e.model()),
                device: e.device,
                size: e.patcher.resident_model_size(),
                fingerprints: e.patcher.fingerprints(),
            })
            .collect();
        *self.view.lock() = entries;
        // The view is true again: the devices reopen (a fault-in's commit checks both).
        self.closed.clear();
    }
}

impl std::fmt::Debug for MemoryManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryManager")
            .field("vram_state", &self.policy.vram_state())
            .field("loaded", &self.view.lock().len())
            .finish()
    }
}

impl MemoryManager {
    /// A manager for this configuration and machine.
    pub fn new(config: Config, hardware: Hardware) -> Result<MemoryManager> {
        Ok(MemoryManager::with_policy(Policy::new(config, hardware)?))
    }

    /// A manager for an already resolved policy.
    pub fn with_policy(policy: Policy) -> MemoryManager {
        let config = policy.config();
        let devices = crate::device::Devices::simulated(&config.sim_gpus);
        let compute_gpu = devices.gpu(policy.compute_device());
        let pool = if config.disable_pinned_memory {
            None
        } else {
            let limit = config
                .pinned_memory_limit
                .unwrap_or_else(|| crate::offload::default_limit(policy.hardware().host.available));
            // Page-locked for the compute device (in candle's context on CUDA) where there is one.
            Some(match compute_gpu.clone() {
                Some(gpu) => PinnedPool::pinned(limit, gpu),
                None => PinnedPool::aligned(limit),
            })
        };
        let host = host_tier(&policy, compute_gpu.clone());
        let mut lanes = config.transfer_lanes_for(policy.compute_device());
        if let Some(crate::device::Gpu::Cuda(ctx)) = &compute_gpu {
            // A weight a lane copies is allocated on the lane's stream and freed by compute on
            // another: that is ordered only while cudarc tracks events, which an engine can turn
            // off through candle. Without it, lanes would free memory under running kernels.
            if lanes > 0 && !ctx.is_event_tracking() {
                tracing::warn!(
                    lanes,
                    "cudarc event tracking is off in candle's CUDA context; transfers run on the compute stream (no lanes)"
                );
                lanes = 0;
            }
        }
        let engine = Arc::new(
            TransferEngine::new(lanes, pool.clone())
                .with_host_tier(host.clone())
                .with_devices(devices),
        );
        let ledger = Arc::new(Ledger::default());
        // A GPU whose total is not a budget: prefetch and cached casts also fit what the driver
        // says is free, so memory the engine allocated outside the manager is respected.
        for gpu in &policy.hardware().gpus {
            let device = DeviceId::Cuda(gpu.ordinal);
            if policy.is_scheduled(device) && !policy.is_budgeted(device) {
                let n = gpu.ordinal;
                ledger.set_free_probe(device, Arc::new(move || crate::vram::driver_free_memory(n)));
            }
        }
        let kept = Arc::new(Mutex::new(
            Rank::KeepCounts,
            std::collections::HashMap::new(),
        ));
        let view: Arc<Mutex<Arc<[ViewEntry]>>> =
            Arc::new(Mutex::new(Rank::ManagerView, Arc::from(Vec::new())));
        let casts = Arc::new(Mutex::new(Rank::ManagerCasts, Vec::new()));
        let config_misses = policy.config().cost_aware_misses;
        let prepared = policy
            .config()
            .prepared_host_limit(policy.hardware().host.available);
        let costs = Arc::new(crate::costs::CostModel::new());
        // Each GPU's copies start from what it says of itself: a simulated GPU's spec (its
        // streams copy side by side), a CUDA device's modelled PCIe link (one bus).
        for (n, spec) in config.sim_gpus.iter().enumerate() {
            costs.seed(
                DeviceId::Sim(n),
                &format!("sim:{n} {spec}"),
                spec.into(),
                false,
            );
        }
        for gpu in &policy.hardware().gpus {
            let device = DeviceId::Cuda(gpu.ordinal);
            let label = format!("{device} {}", gpu.name);
            costs.seed(device, &label, crate::costs::Link::MODELLED_PCIE, true);
        }
        let dynamic = Arc::new(dynamic::Dynamic::new(
            Arc::clone(&ledger),
            Arc::clone(&view),
            Arc::clone(&kept),
            Arc::clone(&casts),
        ));
        MemoryManager {
            policy,
            host,
            engine,
            cast_gate: Arc::new(ledger.cast_column()),
            casts,
            kept,
            ledger,
            inner: Mutex::new(
                Rank::Manager,
                Inner {
                    registry: Vec::new(),
                    pool,
                    unloaded: Vec::new(),
                },
            ),
            view,
            dynamic,
            misses: config_misses
                .then(|| Arc::new(crate::offload::MissCosts::with_prepared(prepared))),
            costs,
            audits: Mutex::new(Rank::Audits, Vec::new()),
            depth_choices: Mutex::new(Rank::DepthChoices, Vec::new()),
        }
    }

    /// The transfer engine streamed weights go through.
    pub fn transfer_engine(&self) -> &Arc<TransferEngine> {
        &self.engine
    }

    /// The host tier: the ledger of host copies of models read lazily through it (bounded by
    /// `--ram-budget`), and the weights page-locked in place (docs/ARCHITECTURE.md §3).
    pub fn host_tier(&self) -> &HostTier {
        &self.host
    }

    /// Reads a model from safetensors files the way this configuration asks: lazily through the
    /// manager's host tier when `--ram-budget` is set (weights stay in their files until needed,
    /// host copies within the budget), eagerly into host memory otherwise (the default).
    ///
    /// # Errors
    /// As [`Model::from_safetensors`] / [`Model::from_safetensors_lazy`].
    pub fn read_model<P: AsRef<std::path::Path>>(
        &self,
        name: impl Into<String>,
        paths: &[P],
    ) -> Result<Model> {
        if self.policy.config().ram_budget.is_some() {
            Model::from_safetensors_lazy(name, paths, &self.host)
        } else {
            Model::from_safetensors(name, paths)
        }
    }

    /// Reads a GGUF model as this manager's policy wants it: lazily through the host tier under
    /// `--ram-budget` ([`Model::from_gguf_lazy`]), else eagerly ([`Model::from_gguf`]).
    ///
    /// # Errors
    /// As [`Model::from_gguf`].
    pub fn read_gguf(
        &self,
        name: impl Into<String>,
        path: impl AsRef<std::path::Path>,
    ) -> Result<Model> {
        if self.policy.config().ram_budget.is_some() {
            Model::from_gguf_lazy(name, path, &self.host)
        } else {
            Model::from_gguf(name, path)
        }
    }

    /// Transfer counters (bytes, prefetch hits and misses, time waiting).
    pub fn transfer_stats(&self) -> TransferSnapshot {
        self.engine.stats().snapshot()
    }

    /// The policy.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// The device a patcher should load on under this policy (its compute device).
    pub fn compute_device(&self) -> DeviceId {
        self.policy.compute_device()
    }

    /// The ledger of `device`: bytes resident there across registered models, plus bytes of
    /// prefetched weights in flight, cached casts and reservations. Exact: it waits for a load
    /// in progress (a sum read mid-load could mix a victim's copies before they were dropped
    /// with the new copies built after; [`MemoryManager::memory_report`] never waits).
    pub fn ledger(&self, device: DeviceId) -> ByteSize {
        self.ledger_in(&self.lock_inner().registry, device)
    }

    /// The manager lock (releasing it publishes the registry view reports read).
    fn lock_inner(&self) -> InnerGuard<'_> {
        InnerGuard {
            guard: self.inner.lock(),
            view: &self.view,
            closed: Vec::new(),
        }
    }

    /// The device's total as the scheduler sees it (budget-capped).
    pub fn get_total_memory(&self, device: DeviceId) -> ByteSize {
        self.policy.total_memory(device)
    }

    /// Free memory on `device`: total − ledger on a budgeted device; the driver's figure on an
    /// unbudgeted GPU; host available RAM otherwise. Exact, as [`MemoryManager::ledger`] (it
    /// waits for a load in progress).
    pub fn get_free_memory(&self, device: DeviceId) -> ByteSize {
        self.free_in(&self.lock_inner().registry, device)
    }

    /// Every GPU this manager schedules (simulated GPUs when given, else CUDA devices), in
    /// order, with the bytes of weights it could take now: its free memory less the minimum
    /// inference memory. What [`crate::DeviceMap::auto`] fills:
    /// `DeviceMap::auto(&patcher, &mm.device_budgets(), Default::default())`.
    pub fn device_budgets(&self) -> Vec<(DeviceId, ByteSize)> {
        let gpus = self.placement_devices();
        let inner = self.lock_inner();
        gpus.into_iter()
            .map(|d| {
                let min_inf = self.policy.minimum_inference_memory_on(d);
                (d, self.free_in(&inner.registry, d).saturating_sub(min_inf))
            })
            .collect()
    }

    /// The resident column of `device`'s ledger: the registered models' resident copies there,
    /// plus the parameters their code holds as its own tensors there
    /// ([`Model::held_outside`]: never evicted, so counted like a resident copy that stays).
    fn resident_in(registry: &[Entry], device: DeviceId) -> ByteSize {
        registry
            .iter()
            .map(|e| {
                e.model()
                    .resident_bytes(device)
                    .saturating_add(crate::weights::outside::outside_on(e.model().id(), device))
            })
            .sum()
    }

    fn ledger_in(&self, registry: &[Entry], device: DeviceId) -> ByteSize {
        // A fault-in commits (residency, then its booking becomes resident) under this lock:
        // read between the two, its bytes would count twice.
        let _dynamic = self.dynamic.lock();
        self.ledger_from(Self::resident_in(registry, device), device)
    }

    /// `resident` plus the ledger's columns on `device`: in flight, cached casts, reservations.
    fn ledger_from(&self, resident: ByteSize, device: DeviceId) -> ByteSize {
        resident
            .saturating_add(self.ledger.in_flight(device))
            .saturating_add(self.ledger.faulting(device))
            .saturating_add(self.ledger.cached(device))
            .saturating_add(self.ledger.reserved(device))
    }

    /// Bytes of cached manual casts on `device`: counted in its ledger, but the first thing a
    /// load gives up (plans treat them as free).
    fn cached_in(&self, device: DeviceId) -> ByteSize {
        self.ledger.cached(device)
    }

    /// Drops the cached manual casts of every registered model on `device`.
    fn drop_casts(&self, inner: &Inner, device: DeviceId) -> ByteSize {
        let registered = inner
            .registry
            .iter()
            .filter_map(|e| crate::ops::cast_cache_of(e.model()))
            .collect();
        clear_casts(&self.casts, registered, device)
    }

    /// Gives a loaded model on a scheduled device a manual-cast cache booked in the ledger, which
    /// keeps free what a repeat of this load would want free (so the repeat stays a no-op).
    fn attach_cast_cache(&self, m: &ModelPatcher, options: &LoadOptions) {
        let device = m.load_device();
        if !self.policy.is_scheduled(device) {
            return;
        }
        let (extra_mem, min_required, _) = self.memory_to_keep_free(options, device);
        let keep_free =
            ByteSize::from_f64(extra_mem.max(min_required).ceil()).saturating_add(ByteSize(1));
        match crate::ops::cast_cache_of(m.model()) {
            Some(c) if c.uses_gate(&self.cast_gate) && c.device() == device => {
                c.set_keep_free(keep_free)
            }
            _ => {
                let cache = Arc::new(crate::ops::CastCache::new(
                    Arc::clone(&self.cast_gate),
                    device,
                    keep_free,
                ));
                {
                    let mut all = self.casts.lock();
                    all.retain(|w| w.strong_count() > 0);
                    all.push(Arc::downgrade(&cache));
                }
                drop(crate::ops::attach_cast_cache(m.model(), Some(cache)));
            }
        }
    }

    fn free_in(&self, registry: &[Entry], device: DeviceId) -> ByteSize {
        self.free_with(self.ledger_in(registry, device), device)
    }

    /// Free memory on `device` when its ledger is `ledger`.
    fn free_with(&self, ledger: ByteSize, device: DeviceId) -> ByteSize {
        if self.policy.is_budgeted(device) {
            return self.policy.total_memory(device).saturating_sub(ledger);
        }
        match device {
            DeviceId::Cuda(n) => crate::vram::driver_free_memory(n)
                .unwrap_or_else(|| self.policy.probed_free(device).saturating_sub(ledger)),
            DeviceId::Cpu => self.policy.hardware().host.available,
            DeviceId::Sim(_) => self.policy.probed_free(device).saturating_sub(ledger),
        }
    }

    /// Tells the ledger `device`'s resident bytes and bound (and so its peak).
    fn note_ledger(&self, inner: &Inner, device: DeviceId) {
        let bound = self
            .policy
            .is_scheduled(device)
            .then(|| self.policy.total_memory(device));
        // Fault-ins change residency and the resident column together under this lock: the
        // sum and the note must not fall between the two.
        let _dynamic = self.dynamic.lock();
        self.ledger
            .note(device, Self::resident_in(&inner.registry, device), bound);
    }

    /// [`MemoryManager::note_ledger`] for every device holding registered weights, every device
    /// the ledger has a book for (one that just lost its last weights must not keep its old
    /// resident figure: reservations and peaks add to it), and the compute device.
    fn refresh_ledger(&self, inner: &Inner) {
        let mut devices: Vec<DeviceId> = inner
            .registry
            .iter()
            .flat_map(|e| e.model().state().devices())
            .collect();
        devices.extend(self.ledger.devices());
        devices.push(self.policy.compute_device());
        devices.sort();
        devices.dedup();
        for d in devices {
            self.note_ledger(inner, d);
        }
    }

    /// Takes the derived values (managed modules) that the current call made stale — of the
    /// registered models and of those that left the registry — for the caller to drop after it
    /// releases the manager lock, so the copies they hold are freed as the ledger says.
    fn take_stale(inner: &mut Inner) -> Vec<Arc<dyn std::any::Any + Send + Sync>> {
        let unloaded = std::mem::take(&mut inner.unloaded);
        let models = || {
            inner
                .registry
                .iter()
                .map(Entry::model)
                .chain(unloaded.iter())
        };
        for m in models() {
            if let Some(c) = crate::ops::cast_cache_of(m) {
                c.take_stale(m.residency_generation());
            }
        }
        models().filter_map(|m| m.take_stale_derived()).collect()
    }

    /// Closes every device the manager knows (the ledger's books and the compute device) to
    /// bookings and fault-in commits until `inner` is released: for a call that may take models
    /// out of the registry or evict them.
    fn close_all(&self, inner: &mut InnerGuard<'_>) {
        inner.hold_closed(self.close_every_device());
    }

    /// [`MemoryManager::close`] on every device the manager knows.
    fn close_every_device(&self) -> ledger::LoadingGuard {
        let mut devices = self.ledger.devices();
        devices.push(self.policy.compute_device());
        devices.sort();
        devices.dedup();
        self.close(&devices)
    }

    /// Closes `devices` to bookings and fault-in commits until the guard drops. Taken under
    /// the residency-by-use lock: a commit either finished before (the caller sees its copy)
    /// or comes after and finds the device closed — none decided before and lands after.
    fn close(&self, devices: &[DeviceId]) -> ledger::LoadingGuard {
        let _dynamic = self.dynamic.lock();
        self.ledger.loading(devices)
    }

    /// The highest ledger (resident plus in flight) seen on `device` since the manager was built.
    pub fn peak_ledger(&self, device: DeviceId) -> ByteSize {
        self.ledger.peak(device)
    }

    /// What residency by use did on each device — hits, misses, faults-in, evictions — beside
    /// Belady's offline optimum for the same recorded uses and room (computed here, O(uses log
    /// uses): the cheap [`MemoryManager::memory_report`] leaves it out).
    pub fn dynamic_report(&self) -> Vec<DynamicDeviceReport> {
        self.dynamic.report(true)
    }

    /// [`MemoryManager::dynamic_report`] layer by layer: each layer's uses, hits and Belady's
    /// hits (the device-wide optimum, counted per layer) — for a mixture of experts, how well
    /// each layer's experts are cached. Layers in the order they were first used.
    pub fn dynamic_layer_report(&self) -> Vec<DynamicLayerReport> {
        let view = Arc::clone(&self.view.lock());
        let models: std::collections::HashMap<u64, Arc<crate::weights::Model>> = view
            .iter()
            .filter_map(|e| e.model.upgrade())
            .map(|m| (m.id(), m))
            .collect();
        self.dynamic
            .layer_report(|id, weight| match models.get(&id) {
                Some(m) => {
                    let layer = m
                        .slots()
                        .get(weight as usize)
                        .map_or_else(|| "?".to_string(), |s| crate::patcher::layer_of(s.name()));
                    (m.name().to_string(), layer)
                }
                None => (format!("model #{id}"), "?".to_string()),
            })
    }

    /// What cost-aware misses did (`--cost-aware-misses`): misses run on the host and uploaded,
    /// the bytes not copied, the measured link and matmul costs the rule compares. `None` when
    /// the mode is off.
    pub fn miss_report(&self) -> Option<crate::offload::MissReport> {
        self.misses.as_ref().map(|m| m.report())
    }

    /// Starts a new measurement of residency by use: forgets the hits, misses and recorded uses
    /// [`MemoryReport::dynamic_devices`] reports (a benchmark's steady state, say).
    pub fn reset_dynamic_stats(&self) {
        self.dynamic.reset_stats();
    }
}

/// Clears the cached manual casts on `device` of `caches` and of every live cache the manager
/// attached (`attached`; each cache returns its bookings): their bytes. The one way casts are
/// given up, by a load's plan and by a fault-in alike.
fn clear_casts(
    attached: &Mutex<Vec<std::sync::Weak<crate::ops::CastCache>>>,
    mut caches: Vec<Arc<crate::ops::CastCache>>,
    device: DeviceId,
) -> ByteSize {
    {
        let mut all = attached.lock();
        all.retain(|w| w.strong_count() > 0);
        caches.extend(all.iter().filter_map(std::sync::Weak::upgrade));
    }
    caches
        .iter()
        .filter(|c| c.device() == device)
        .map(|c| c.clear())
        .sum()
}

/// The manager's host tier: `--ram-budget` bounds its ledger; when models compute on a GPU (CUDA,
/// in candle's context, or simulated) and without `--disable-pinned-memory`, weights are pinned in
/// place for it, within the pin budget ([`crate::vram::pin_budget`]) less what the staging pool
/// may pin.
fn host_tier(policy: &Policy, gpu: Option<crate::device::Gpu>) -> HostTier {
    let config = policy.config();
    let hw = policy.hardware();
    let gpu = if config.disable_pinned_memory {
        None
    } else {
        gpu
    };
    let staging = config
        .pinned_memory_limit
        .unwrap_or_else(|| crate::offload::default_limit(hw.host.available));
    let budget =
        crate::vram::pin_budget(&hw.host, hw.os, gpu.is_some(), config.disable_pinned_memory)
            .saturating_sub(staging);
    HostTier::with_pinning(config.ram_budget, budget, gpu)
}
