//! The memory manager: which models stay loaded, how much of each, and who is evicted.
//!
//! A [`MemoryManager`] owns the registry of loaded models (most recently used first) and computes
//! each scheduled device's ledger from it: the ledger of a device is the sum of the resident bytes
//! of the registered models on it, so it is exact by construction (I2, docs/ARCHITECTURE.md §4.2).
//! A budgeted device's free memory is its total minus the ledger; a CUDA device without a budget
//! reports the driver's free memory.
//!
//! [`MemoryManager::load_models_gpu`] follows docs/ARCHITECTURE.md §5: drop entries whose patchers
//! were all dropped; work out `extra_mem` and the minimum; evict other models until the bytes still
//! to load (×1.1) plus `extra_mem` are free; then give each model its weight budget
//! ([`weight_budget`]) and load it fully or partially. Eviction order
//! ([`MemoryManager::free_memory`]): most offloaded bytes first, then fewest outside handles, then
//! smallest, then most recently used; smart memory unloads each victim only by what is missing.
//!
//! Locks (the crate's lock table, lowest rank first; a lock may only be taken while holding
//! locks of lower rank):
//!
//! | rank | lock | guards |
//! |---|---|---|
//! | 1 | `MemoryManager::inner` | registry, peaks |
//! | 2 | `Model::state` | residency and pins of one model |
//! | 4 | `Model::forward_order` | first-forward order (leaf) |
//! | 5 | the candle device table in `vram` | one candle device per ordinal (leaf) |
//! | 6 | `ops::OpsSource`'s patcher handle | which patcher layers fetch through (leaf; held only to clone an `Arc`) |
//!
//! The manager lock is held while a load materializes weights, which serializes loads (that is
//! what keeps the ledger within budget); it is never held while calling a model's memory
//! estimator or any other user code.

mod report;

use std::sync::Arc;

use once_cell::sync::OnceCell;
use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::offload::{PinnedPool, Streamer, TransferEngine, TransferSnapshot};
use crate::patcher::ModelPatcher;
use crate::size::ByteSize;
use crate::vram::{Config, DeviceId, Hardware, Policy, VramState};
use crate::weights::Model;

pub use report::{Eviction, LoadReport, LoadedModelInfo, MemoryReport, ModelLoad};

/// Options of one [`MemoryManager::load_models_gpu`] call.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadOptions {
    /// Activation memory the coming forward needs (from the model's estimator).
    pub memory_required: ByteSize,
    /// The least free memory to leave; defaults to `extra_mem`.
    pub minimum_memory_required: Option<ByteSize>,
    /// Load every weight, whatever the state.
    pub force_full_load: bool,
    /// Prefer patched weights for residency.
    pub force_patch_weights: bool,
}

impl LoadOptions {
    /// Options with this activation memory.
    pub fn with_memory_required(mut self, bytes: ByteSize) -> Self {
        self.memory_required = bytes;
        self
    }
    /// Forces a full load.
    pub fn with_force_full_load(mut self, on: bool) -> Self {
        self.force_full_load = on;
        self
    }
}

/// 128 MiB: the smallest weight budget a partial load gets.
pub const MIN_WEIGHT_BUDGET: ByteSize = ByteSize::mib(128);

/// The weight budget of a partial load (docs/ARCHITECTURE.md §5, step 7), pure:
/// `max(128 MiB, free_now − minimum_memory_required, min(free_now × ratio, free_now −
/// minimum_inference_memory)) − already_loaded`, at least one byte and never more than `free`,
/// where `free_now = free + already_loaded`.
pub fn weight_budget(
    free: ByteSize,
    already_loaded: ByteSize,
    minimum_memory_required: f64,
    minimum_inference_memory: f64,
    ratio: f64,
) -> ByteSize {
    let free_now = free.as_f64() + already_loaded.as_f64();
    let b = (MIN_WEIGHT_BUDGET.as_f64())
        .max(free_now - minimum_memory_required)
        .max((free_now * ratio).min(free_now - minimum_inference_memory))
        - already_loaded.as_f64();
    ByteSize::from_f64(b)
        .max(ByteSize(1))
        .min(free.max(ByteSize(1)))
}

struct Entry {
    patcher: ModelPatcher,
    device: DeviceId,
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
    peaks: Vec<(DeviceId, ByteSize)>,
    pool: Option<PinnedPool>,
}

/// The registry of loaded models, the per-device ledger and the policy.
pub struct MemoryManager {
    policy: Policy,
    engine: Arc<TransferEngine>,
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for MemoryManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryManager")
            .field("vram_state", &self.policy.vram_state())
            .field("loaded", &self.inner.lock().registry.len())
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
        let pool = if config.disable_pinned_memory {
            None
        } else {
            let limit = config
                .pinned_memory_limit
                .unwrap_or_else(|| crate::offload::default_limit(policy.hardware().host.available));
            // Pinned in the compute device's (candle's) context where there is one.
            Some(match crate::vram::cuda_context(policy.compute_device()) {
                Some(ctx) => PinnedPool::pinned(limit, ctx),
                None => PinnedPool::aligned(limit),
            })
        };
        let engine = Arc::new(TransferEngine::new(
            config.transfer_lanes_for(policy.compute_device()),
            pool.clone(),
        ));
        MemoryManager {
            policy,
            engine,
            inner: Mutex::new(Inner {
                registry: Vec::new(),
                peaks: Vec::new(),
                pool,
            }),
        }
    }

    /// The transfer engine streamed weights go through.
    pub fn transfer_engine(&self) -> &Arc<TransferEngine> {
        &self.engine
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

    /// The ledger of `device`: bytes resident there across registered models.
    pub fn ledger(&self, device: DeviceId) -> ByteSize {
        ledger_of(&self.inner.lock(), device)
    }

    /// The device's total as the scheduler sees it (budget-capped).
    pub fn get_total_memory(&self, device: DeviceId) -> ByteSize {
        self.policy.total_memory(device)
    }

    /// Free memory on `device`: total − ledger on a budgeted device; the driver's figure on an
    /// unbudgeted GPU; host available RAM otherwise.
    pub fn get_free_memory(&self, device: DeviceId) -> ByteSize {
        let inner = self.inner.lock();
        self.free_of(&inner, device)
    }

    fn free_of(&self, inner: &Inner, device: DeviceId) -> ByteSize {
        if self.policy.is_budgeted(device) {
            return self
                .policy
                .total_memory(device)
                .saturating_sub(ledger_of(inner, device));
        }
        match device {
            DeviceId::Cuda(n) => crate::vram::driver_free_memory(n).unwrap_or_else(|| {
                self.policy
                    .probed_free(device)
                    .saturating_sub(ledger_of(inner, device))
            }),
            DeviceId::Cpu => self.policy.hardware().host.available,
        }
    }

    fn note_peak(&self, inner: &mut Inner, device: DeviceId) {
        let now = ledger_of(inner, device);
        match inner.peaks.iter_mut().find(|(d, _)| *d == device) {
            Some((_, p)) => *p = (*p).max(now),
            None => inner.peaks.push((device, now)),
        }
    }

    /// The highest ledger seen on `device` since the manager was built.
    pub fn peak_ledger(&self, device: DeviceId) -> ByteSize {
        let inner = self.inner.lock();
        inner
            .peaks
            .iter()
            .find(|(d, _)| *d == device)
            .map(|(_, p)| *p)
            .unwrap_or(ByteSize::ZERO)
    }

    /// Loads `models` (and their additional models) onto their load devices following
    /// docs/ARCHITECTURE.md §5, evicting other models as needed. On error nothing already loaded is
    /// lost beyond what eviction freed, and the failing model is unchanged.
    pub fn load_models_gpu(
        &self,
        models: &[ModelPatcher],
        options: LoadOptions,
    ) -> Result<LoadReport> {
        let mut all: Vec<ModelPatcher> = Vec::new();
        for m in models {
            push_unique(&mut all, m.clone());
            for extra in m.additional_models() {
                push_unique(&mut all, extra.clone());
            }
        }
        let mut inner = self.inner.lock();
        let mut report = LoadReport::default();
        // 1. drop entries nobody outside holds.
        cleanup(&mut inner);
        // 2. memory to keep free.
        let reserve = self.policy.reserve().as_f64();
        let min_inf = self.policy.minimum_inference_memory_f64();
        let extra_mem = min_inf.max(options.memory_required.as_f64() + reserve);
        let min_required = match options.minimum_memory_required {
            Some(m) => min_inf.max(m.as_f64() + reserve),
            None => extra_mem,
        };
        // A full load on a budgeted device that cannot fit even after evicting everything else
        // fails before anything is evicted (I4).
        self.check_full_loads_fit(&all, &options)?;
        // 3. registered clones of these models leave the registry (their copies stay shared).
        for m in &all {
            tracing::info!(
                model = m.model().name(),
                "Requested to load {}",
                m.model().name()
            );
            inner
                .registry
                .retain(|e| !Arc::ptr_eq(e.model(), m.model()));
        }
        // 4. free memory per device.
        let mut devices: Vec<DeviceId> = all.iter().map(|m| m.load_device()).collect();
        devices.sort();
        devices.dedup();
        let keep: Vec<u64> = all.iter().map(|m| m.model().id()).collect();
        for &device in &devices {
            if !self.policy.is_scheduled(device) {
                continue;
            }
            let to_load: ByteSize = all
                .iter()
                .filter(|m| m.load_device() == device)
                .map(|m| m.resident_model_size().saturating_sub(m.loaded_size()))
                .sum();
            let want = to_load.as_f64() * 1.1 + extra_mem;
            self.free_memory_locked(
                &mut inner,
                ByteSize::from_f64(want),
                device,
                &keep,
                &mut report,
            );
            if self.free_of(&inner, device).as_f64() < min_required {
                self.free_memory_locked(
                    &mut inner,
                    ByteSize::from_f64(min_required),
                    device,
                    &keep,
                    &mut report,
                );
            }
        }
        // 5 + 6. budgets and loads.
        for m in all {
            let mut m = m;
            let device = m.load_device();
            let load = self.load_one(&mut inner, &mut m, device, &options, min_required, min_inf);
            let load = match load {
                Ok(l) => l,
                Err(e) => {
                    // The model was taken out of the registry above; put it back as it is.
                    if m.model().resident_bytes_total() > ByteSize::ZERO {
                        inner.registry.insert(0, Entry { patcher: m, device });
                    }
                    return Err(e);
                }
            };
            self.attach_streamer(&inner, &m, &load, &options);
            report.models.push(load);
            inner.registry.insert(0, Entry { patcher: m, device });
            self.note_peak(&mut inner, device);
        }
        Ok(report)
    }

    fn full_load(&self, device: DeviceId, options: &LoadOptions) -> bool {
        options.force_full_load
            || matches!(
                self.policy.vram_state(),
                VramState::HighVram | VramState::Shared | VramState::Disabled
            )
            || !self.policy.is_scheduled(device)
    }

    /// Everything else on a device can be evicted, so a full load fits iff the models fully
    /// loaded together on that device fit its total.
    fn check_full_loads_fit(&self, all: &[ModelPatcher], options: &LoadOptions) -> Result<()> {
        let mut together: Vec<(DeviceId, ByteSize)> = Vec::new();
        for m in all {
            let device = m.load_device();
            if !self.full_load(device, options) || !self.policy.is_budgeted(device) {
                continue;
            }
            let total = self.policy.total_memory(device);
            let size = m.resident_model_size();
            if size > total {
                return Err(Error::BudgetExceeded {
                    model: m.model().name().to_string(),
                    device: device.to_string(),
                    required: size,
                    budget: total,
                });
            }
            let sum = match together.iter_mut().find(|(d, _)| *d == device) {
                Some((_, s)) => {
                    *s = s.saturating_add(size);
                    *s
                }
                None => {
                    together.push((device, size));
                    size
                }
            };
            if sum > total {
                return Err(Error::OutOfMemory {
                    model: m.model().name().to_string(),
                    device: device.to_string(),
                    required: sum,
                    available: total,
                });
            }
        }
        Ok(())
    }

    fn load_one(
        &self,
        inner: &mut Inner,
        m: &mut ModelPatcher,
        device: DeviceId,
        options: &LoadOptions,
        min_required: f64,
        min_inf: f64,
    ) -> Result<ModelLoad> {
        let name = m.model().name().to_string();
        let state = self.policy.vram_state();
        let full = self.full_load(device, options);
        let budgeted = self.policy.is_budgeted(device);
        let outcome = if full {
            if budgeted {
                let need = m
                    .resident_model_size()
                    .saturating_sub(m.model().resident_bytes(device));
                let free = self.free_of(inner, device);
                if need > free {
                    let total = self.policy.total_memory(device);
                    return Err(if m.resident_model_size() > total {
                        Error::BudgetExceeded {
                            model: name,
                            device: device.to_string(),
                            required: m.resident_model_size(),
                            budget: total,
                        }
                    } else {
                        Error::OutOfMemory {
                            model: name,
                            device: device.to_string(),
                            required: need,
                            available: free,
                        }
                    });
                }
            }
            m.load(device, ByteSize::MAX, options.force_patch_weights, true)?
        } else if state == VramState::NoVram {
            m.load(device, ByteSize::ZERO, options.force_patch_weights, false)?
        } else {
            let already = m.loaded_size();
            let free = self.free_of(inner, device);
            let budget = weight_budget(
                free,
                already,
                min_required,
                min_inf,
                self.policy.weight_ratio(device),
            );
            if already > ByteSize::ZERO {
                m.partially_load_prioritized(device, budget, options.force_patch_weights)?
                    .1
            } else {
                m.load(device, budget, options.force_patch_weights, false)?
            }
        };
        // Safety net for I2: a clone whose resident dtype differs can grow in place.
        let mut outcome = outcome;
        if budgeted {
            let ledger = ledger_of(inner, device).saturating_add(m.model().resident_bytes(device));
            let total = self.policy.total_memory(device);
            if ledger > total {
                m.partially_unload(device, ledger.saturating_sub(total));
                outcome = m.load_outcome();
            }
        }
        let load = ModelLoad {
            name: name.clone(),
            device,
            resident: outcome.resident,
            streaming: outcome.streaming,
            moved: outcome.moved,
            lazy_patched: outcome.lazy_patched,
            full: outcome.full,
        };
        if load.full {
            tracing::info!(model = %name, %device, resident = load.resident.bytes(), moved = load.moved.bytes(),
                "loaded completely {name}: {} resident, {} moved", load.resident, load.moved);
        } else {
            tracing::info!(model = %name, %device, resident = load.resident.bytes(), streaming = load.streaming.bytes(),
                lowvram_patches = load.lazy_patched,
                "loaded partially {name}: {} resident, {} streaming, {} lowvram patches", load.resident, load.streaming, load.lazy_patched);
        }
        Ok(load)
    }

    /// A partially loaded model streams: give it a prefetching streamer whose bytes in flight stay
    /// within what is free after the load beyond the activation memory asked for.
    fn attach_streamer(
        &self,
        inner: &Inner,
        m: &ModelPatcher,
        load: &ModelLoad,
        options: &LoadOptions,
    ) {
        if load.full {
            crate::offload::attach_streamer(m, None);
            return;
        }
        let cap = self
            .free_of(inner, load.device)
            .saturating_sub(options.memory_required);
        let streamer = match crate::offload::streamer_of(m) {
            Some(s) if Arc::ptr_eq(s.engine(), &self.engine) => s,
            _ => Arc::new(Streamer::new(
                Arc::clone(&self.engine),
                self.policy.config().prefetch_depth(),
                cap,
            )),
        };
        streamer.set_cap(cap);
        crate::offload::attach_streamer(m, Some(streamer));
    }

    /// Loads one model (see [`MemoryManager::load_models_gpu`]).
    pub fn load_model_gpu(&self, model: &ModelPatcher) -> Result<LoadReport> {
        self.load_models_gpu(std::slice::from_ref(model), LoadOptions::default())
    }

    /// Evicts models on `device` (not in `keep_loaded`, by model id) until more than `required`
    /// bytes are free. Returns what was evicted.
    pub fn free_memory(
        &self,
        required: ByteSize,
        device: DeviceId,
        keep_loaded: &[&ModelPatcher],
    ) -> Vec<Eviction> {
        let keep: Vec<u64> = keep_loaded.iter().map(|m| m.model().id()).collect();
        let mut inner = self.inner.lock();
        let mut report = LoadReport::default();
        self.free_memory_locked(&mut inner, required, device, &keep, &mut report);
        report.evicted
    }

    fn free_memory_locked(
        &self,
        inner: &mut Inner,
        required: ByteSize,
        device: DeviceId,
        keep: &[u64],
        report: &mut LoadReport,
    ) {
        cleanup(inner);
        // (offloaded bytes desc, outside handles asc, size asc, registry position asc = MRU first)
        let mut candidates: Vec<(std::cmp::Reverse<ByteSize>, usize, ByteSize, usize, u64)> = inner
            .registry
            .iter()
            .enumerate()
            .filter(|(_, e)| e.device == device && !keep.contains(&e.model().id()))
            .filter_map(|(i, e)| {
                let resident = e.model().resident_bytes(device);
                if resident == ByteSize::ZERO {
                    return None;
                }
                let size = e.patcher.resident_model_size();
                Some((
                    std::cmp::Reverse(size.saturating_sub(resident)),
                    e.outside_handles(),
                    size,
                    i,
                    e.model().id(),
                ))
            })
            .collect();
        candidates.sort();
        let mut unloaded = 0usize;
        let smart = !self.policy.config().disable_smart_memory;
        for (_, _, _, _, id) in candidates {
            let free = self.free_of(inner, device);
            // Without smart memory every candidate goes, as in ComfyUI.
            if smart && free > required {
                break;
            }
            let Some(pos) = inner.registry.iter().position(|e| e.model().id() == id) else {
                continue;
            };
            let entry = &inner.registry[pos];
            let name = entry.model().name().to_string();
            let missing = required.saturating_sub(free);
            let freed = if !smart {
                entry.patcher.detach()
            } else {
                entry.patcher.partially_unload(device, missing)
            };
            let fully = entry.model().resident_bytes(device) == ByteSize::ZERO;
            if fully {
                entry.patcher.detach();
                crate::offload::attach_streamer(&entry.patcher, None);
                inner.registry.remove(pos);
                unloaded += 1;
            }
            report.evicted.push(Eviction {
                name,
                device,
                freed,
                fully,
                reason: format!("{required} needed on {device}, {free} free"),
            });
        }
        if unloaded > 0 {
            tracing::info!(%device, "{unloaded} models unloaded.");
        }
    }

    /// Unloads every model from every device; the registry is emptied.
    pub fn unload_all_models(&self) -> usize {
        let mut inner = self.inner.lock();
        let n = inner.registry.len();
        for e in inner.registry.drain(..) {
            e.patcher.detach();
            crate::offload::attach_streamer(&e.patcher, None);
        }
        if let Some(pool) = &inner.pool {
            pool.trim();
        }
        tracing::info!("{n} models unloaded.");
        n
    }

    /// Returns cached device memory to the driver. Resident copies are freed as soon as they are
    /// dropped on the CPU; on each CUDA device candle computes on for residency this waits for
    /// the device's work and trims the driver's stream-ordered memory pool candle allocates from.
    /// Takes no lock while the devices synchronize.
    pub fn soft_empty_cache(&self) {
        tracing::debug!("soft_empty_cache");
        crate::vram::empty_cuda_caches();
    }

    /// Drops registry entries no patcher outside holds, and releases every weight pin.
    pub fn cleanup_models(&self) {
        let mut inner = self.inner.lock();
        cleanup(&mut inner);
        for e in &inner.registry {
            e.patcher.unpin_all_weights();
            if let Some(s) = crate::offload::streamer_of(&e.patcher) {
                s.clear();
            }
        }
        if let Some(pool) = &inner.pool {
            pool.trim();
        }
    }

    /// The registered models, most recently used first.
    pub fn loaded_models(&self) -> Vec<LoadedModelInfo> {
        let inner = self.inner.lock();
        inner
            .registry
            .iter()
            .map(|e| LoadedModelInfo {
                name: e.model().name().to_string(),
                model_id: e.model().id(),
                device: e.device,
                resident: e.model().resident_bytes(e.device),
                size: e.patcher.resident_model_size(),
                outside_handles: e.outside_handles(),
            })
            .collect()
    }

    /// Per device budget, ledger and peak, and per model resident/streaming bytes.
    pub fn memory_report(&self) -> MemoryReport {
        let models = self.loaded_models();
        let inner = self.inner.lock();
        let mut devices: Vec<DeviceId> = models.iter().map(|m| m.device).collect();
        devices.push(self.policy.compute_device());
        devices.sort();
        devices.dedup();
        let devices = devices
            .into_iter()
            .map(|d| report::DeviceMemory {
                device: d,
                total: self.policy.total_memory(d),
                budgeted: self.policy.is_budgeted(d),
                ledger: ledger_of(&inner, d),
                peak: inner
                    .peaks
                    .iter()
                    .find(|(x, _)| *x == d)
                    .map(|(_, p)| *p)
                    .unwrap_or(ByteSize::ZERO),
                free: self.free_of(&inner, d),
            })
            .collect();
        let pool = self.engine.pool().map(|p| p.stats()).unwrap_or_default();
        MemoryReport {
            devices,
            models,
            pinned: pool.allocated,
            pinned_is_page_locked: pool.pinned,
            transfers: self.engine.stats().snapshot(),
        }
    }
}

fn push_unique(all: &mut Vec<ModelPatcher>, m: ModelPatcher) {
    if let Some(pos) = all.iter().position(|x| x.is_clone(&m)) {
        all[pos] = m;
    } else {
        all.push(m);
    }
}

/// Resident bytes of registered models on `device`, plus their prefetched weights not yet used.
/// Staging buffers are host memory (the tier clean weights stream from, even when the budgeted
/// CPU simulates a device) and are reported separately as pinned bytes.
fn ledger_of(inner: &Inner, device: DeviceId) -> ByteSize {
    let resident: ByteSize = inner
        .registry
        .iter()
        .map(|e| e.model().resident_bytes(device))
        .sum();
    let in_flight: ByteSize = inner
        .registry
        .iter()
        .filter(|e| e.device == device)
        .filter_map(|e| crate::offload::streamer_of(&e.patcher))
        .map(|s| s.in_flight_bytes())
        .sum();
    resident.saturating_add(in_flight)
}

fn cleanup(inner: &mut Inner) {
    inner.registry.retain(|e| {
        let keep = e.outside_handles() > 0;
        if !keep {
            e.patcher.detach();
            crate::offload::attach_streamer(&e.patcher, None);
            tracing::debug!(model = e.model().name(), "dropped: no patcher left");
        }
        keep
    });
}

static GLOBAL: OnceCell<MemoryManager> = OnceCell::new();

/// The process-wide manager, built on first use from [`Config::from_env`] and
/// [`Hardware::probe`]. A bad `RESIDENCY_*` setting is reported once and the defaults are used.
pub fn global() -> &'static MemoryManager {
    GLOBAL.get_or_init(|| {
        let config = Config::from_env().unwrap_or_else(|e| {
            tracing::warn!(error = %e, "ignoring RESIDENCY_* settings");
            Config::default()
        });
        let hardware = Hardware::probe();
        match Policy::new(config, hardware.clone()) {
            Ok(policy) => MemoryManager::with_policy(policy),
            Err(e) => {
                tracing::warn!(error = %e, "falling back to the default configuration");
                // The default configuration names no CUDA device, so it always resolves.
                let policy =
                    Policy::new(Config::default(), hardware.clone()).unwrap_or_else(|_| {
                        Policy::new(Config::default(), Hardware::cpu_only(hardware.host.total))
                            .unwrap_or_else(|_| unreachable!())
                    });
                MemoryManager::with_policy(policy)
            }
        }
    })
}
