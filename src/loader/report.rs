//! What a load did and where memory is: plain structs for programs, `Display` for people.

use std::fmt;
use std::sync::Arc;

use crate::size::ByteSize;
use crate::vram::DeviceId;

/// One model's part of a load.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct ModelLoad {
    /// Model name.
    pub name: String,
    /// Load device.
    pub device: DeviceId,
    /// Bytes resident after the load.
    pub resident: ByteSize,
    /// Bytes that stream at use.
    pub streaming: ByteSize,
    /// Bytes of resident copies this load built, in their resident form (an f32 copy of a bf16
    /// weight counts 4 bytes a value). Not the bytes copied over the bus
    /// ([`LoadReport::copied`]); 0 for weights residency by use builds at their first use.
    pub built: ByteSize,
    /// Streamed weights carrying patches (applied lazily at use).
    pub lazy_patched: usize,
    /// Whether every weight is resident.
    pub full: bool,
    /// Bytes of parameters the model's code holds as its own tensors, outside the ledger
    /// ([`crate::weights::Model::held_outside`]): never evicted or streamed, not in any budget.
    pub held_outside: ByteSize,
    /// Their keys.
    pub outside_keys: Vec<String>,
    /// Bytes resident after the load on each device holding some (one entry unless the model is
    /// split by a device map).
    pub resident_on: Vec<(DeviceId, ByteSize)>,
}

impl ModelLoad {
    /// Where the resident bytes are, for a line of text: `sim:0` alone, or `sim:0 12 KiB, sim:1
    /// 4 KiB` for a split model.
    fn placed(&self) -> String {
        if self.resident_on.len() <= 1 {
            return self.device.to_string();
        }
        self.resident_on
            .iter()
            .map(|(d, b)| format!("{d} {b}"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// A model unloaded (partly or fully) to make room.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Eviction {
    /// Model name.
    pub name: String,
    /// Model id ([`crate::weights::Model::id`]).
    pub model_id: u64,
    /// Device it was evicted from.
    pub device: DeviceId,
    /// Bytes freed on that device.
    pub freed: ByteSize,
    /// Whether it was unloaded completely (and left the registry).
    pub fully: bool,
    /// The free memory the eviction was working towards.
    pub required: ByteSize,
    /// The free memory before this model gave up its bytes.
    pub free: ByteSize,
}

impl Eviction {
    /// Why, in words: what was needed and what was free.
    pub fn reason(&self) -> String {
        format!(
            "{} needed on {}, {} free",
            self.required, self.device, self.free
        )
    }
}

/// What [`crate::loader::MemoryManager::load_models_gpu`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct LoadReport {
    /// Per loaded model.
    pub models: Vec<ModelLoad>,
    /// Models evicted, in order.
    pub evicted: Vec<Eviction>,
    /// Bytes the manager's transfer engine copied to devices while the load built its copies
    /// ([`crate::offload::TransferSnapshot::bytes_copied`] diffed across it): the load's bus
    /// traffic, exact when no forward copies on another thread meanwhile. Casts and patches
    /// applied on the device make it differ from [`LoadReport::built`].
    pub copied: ByteSize,
}

impl LoadReport {
    /// Bytes of resident copies the load built, every model's ([`ModelLoad::built`]).
    pub fn built(&self) -> ByteSize {
        self.models.iter().map(|m| m.built).sum()
    }
}

impl fmt::Display for LoadReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for m in &self.models {
            if m.full {
                writeln!(
                    f,
                    "loaded completely {} on {}: {} resident, {} built",
                    m.name,
                    m.placed(),
                    m.resident,
                    m.built
                )?;
            } else {
                writeln!(
                    f,
                    "loaded partially {} on {}: {} resident, {} streaming, {} built, {} lowvram patches",
                    m.name,
                    m.placed(),
                    m.resident,
                    m.streaming,
                    m.built,
                    m.lazy_patched
                )?;
            }
            if m.held_outside > ByteSize::ZERO {
                writeln!(
                    f,
                    "  {} held outside the ledger's copies by the model's own tensors ({} keys: {})",
                    m.held_outside,
                    m.outside_keys.len(),
                    m.outside_keys
                        .iter()
                        .take(4)
                        .cloned()
                        .collect::<Vec<_>>()
                        .join(", ")
                )?;
            }
        }
        for e in &self.evicted {
            writeln!(
                f,
                "evicted {} from {}: {} freed{} ({})",
                e.name,
                e.device,
                e.freed,
                if e.fully { ", unloaded" } else { ", partially" },
                e.reason()
            )?;
        }
        if self.copied > ByteSize::ZERO {
            writeln!(f, "{} copied to devices", self.copied)?;
        }
        Ok(())
    }
}

/// A registered model.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct LoadedModelInfo {
    /// Model name.
    pub name: String,
    /// Model id.
    pub model_id: u64,
    /// Device.
    pub device: DeviceId,
    /// Bytes resident there.
    pub resident: ByteSize,
    /// Size in the resident dtype.
    pub size: ByteSize,
    /// Handles held outside the registry.
    pub outside_handles: usize,
    /// Of `size`, the bytes of quantized (GGUF) weights, in their GGML blocks.
    pub quantized: ByteSize,
    /// Resident bytes per device holding any (a model split by a [`crate::DeviceMap`] has
    /// several; `resident` is their sum).
    pub placed: Vec<(DeviceId, ByteSize)>,
}

/// One device's memory: a row of [`MemoryReport::devices`] (one per device the manager
/// schedules or a model is placed on, in [`DeviceId`] order).
///
/// `ledger` is what the manager booked there: resident weights, copies in flight, cached casts
/// and reservations (`cached_casts` and `reserved` are parts of it). `free` is what a load may
/// still use: `total` less the ledger on a budgeted device, the driver's figure otherwise.
///
/// ```
/// use residency::loader::{DeviceMemory, MemoryManager};
/// use residency::{ByteSize, Config, DeviceId, Hardware};
///
/// let config = Config::default().with_vram_budget(ByteSize::gib(1));
/// let manager = MemoryManager::new(config, Hardware::cpu_only(ByteSize::gib(8)))?;
/// let report = manager.memory_report();
/// let cpu: &DeviceMemory = report
///     .devices
///     .iter()
///     .find(|d| d.device == DeviceId::Cpu)
///     .expect("the budgeted CPU is scheduled");
/// assert!(cpu.budgeted);
/// assert_eq!(cpu.ledger, ByteSize::ZERO);
/// assert!(cpu.free <= cpu.total);
/// # Ok::<(), residency::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct DeviceMemory {
    /// Device.
    pub device: DeviceId,
    /// Total (budget-capped).
    pub total: ByteSize,
    /// Whether our ledger bounds it.
    pub budgeted: bool,
    /// The ledger: resident bytes of registered models, bytes in flight and cached casts.
    pub ledger: ByteSize,
    /// The part of the ledger that is cached manual casts (`ops` layers' compute-dtype copies of
    /// resident weights), the first thing a load gives up.
    pub cached_casts: ByteSize,
    /// The part of the ledger held by reservations (memory that is not weights).
    pub reserved: ByteSize,
    /// The part of the ledger booked for copies in flight: streamed weights being copied or in
    /// use, prefetches, fault-ins. It comes back as the copies' buffers are freed; an
    /// out-of-memory while it is large is often only waiting for it.
    pub in_flight: ByteSize,
    /// Highest ledger seen.
    pub peak: ByteSize,
    /// Free memory now.
    pub free: ByteSize,
}

/// Where memory is.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct MemoryReport {
    /// Per device, in [`DeviceId`] order.
    pub devices: Vec<DeviceMemory>,
    /// The host tier: host copies of lazily read weights (bounded by `--ram-budget`) and the
    /// weights pinned in place.
    pub host: crate::weights::HostStats,
    /// Per registered model, most recently used first.
    pub models: Vec<LoadedModelInfo>,
    /// Host staging memory held by the transfer engine.
    pub pinned: ByteSize,
    /// Whether that memory is page-locked.
    pub pinned_is_page_locked: bool,
    /// Transfer counters.
    pub transfers: crate::offload::TransferSnapshot,
    /// Live reservations, oldest first.
    pub reservations: Vec<super::ReservationInfo>,
    /// Whether residency is decided by use (dynamic mode, ComfyUI's DynamicVRAM).
    pub dynamic: bool,
    /// In dynamic mode, per device: hits, misses, faults-in, evictions, and the offline optimum
    /// for the same uses.
    pub dynamic_devices: Vec<super::DynamicDeviceReport>,
    /// Cost-aware misses (`--cost-aware-misses`): where misses ran and the measured costs.
    pub misses: Option<crate::offload::MissReport>,
    /// The cost model's figures per device ([`super::MemoryManager::costs`]).
    pub costs: Vec<crate::costs::DeviceCosts>,
    /// The last audited step of each model ([`super::MemoryManager::audit`]): predicted beside
    /// measured.
    pub audits: Vec<super::StepAudit>,
}

impl fmt::Display for MemoryReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for d in &self.devices {
            let mut parts = Vec::new();
            if d.cached_casts > ByteSize::ZERO {
                parts.push(format!("{} of it cached manual casts", d.cached_casts));
            }
            if d.reserved > ByteSize::ZERO {
                parts.push(format!("{} reserved", d.reserved));
            }
            if d.in_flight > ByteSize::ZERO {
                parts.push(format!("{} in flight", d.in_flight));
            }
            let casts = if parts.is_empty() {
                String::new()
            } else {
                format!(" ({})", parts.join(", "))
            };
            writeln!(
                f,
                "{}: {} {}, {} used{casts} (peak {}), {} free",
                d.device,
                if d.budgeted { "budget" } else { "total" },
                d.total,
                d.ledger,
                d.peak,
                d.free
            )?;
        }
        let h = &self.host;
        writeln!(
            f,
            "host: {}, {} held in {} weights (peak {}); {} reads ({}), {} hits, {} evictions; {} pinned in place of {}",
            h.budget
                .map_or_else(|| "no budget".to_string(), |b| format!("budget {b}")),
            h.ledger,
            h.weights_held,
            h.peak,
            h.reads,
            h.bytes_read,
            h.hits,
            h.evictions,
            h.pinned,
            h.pin_budget
        )?;
        for r in &self.reservations {
            writeln!(f, "  reservation `{}`: {} on {}", r.name, r.bytes, r.device)?;
        }
        for m in &self.models {
            write!(
                f,
                "  {:<24} {:>12} resident {:>12} streaming on {}",
                m.name,
                m.resident.to_string(),
                m.size.saturating_sub(m.resident).to_string(),
                m.device
            )?;
            if m.quantized > ByteSize::ZERO {
                write!(
                    f,
                    " ({} of its {} in quantized blocks)",
                    m.quantized, m.size
                )?;
            }
            if m.placed.len() > 1 {
                let parts: Vec<String> = m
                    .placed
                    .iter()
                    .map(|(d, b)| format!("{b} on {d}"))
                    .collect();
                write!(f, " (split: {})", parts.join(", "))?;
            }
            writeln!(f)?;
        }
        if self.dynamic {
            writeln!(f, "residency by use (dynamic mode):")?;
            for d in &self.dynamic_devices {
                writeln!(f, "  {d}")?;
            }
        }
        if let Some(m) = &self.misses {
            writeln!(f, "{m}")?;
        }
        for c in &self.costs {
            writeln!(f, "costs {c}")?;
        }
        for a in &self.audits {
            writeln!(f, "step {a}")?;
        }
        let t = &self.transfers;
        writeln!(
            f,
            "transfers: {} read for streamed fetches; {} copied to devices by loads and fetches ({} staged, {} direct from pinned weights, {} pageable), {} fetches, prefetch {} hits / {} misses, {:.1} ms waiting; staging {} ({})",
            t.bytes_transferred,
            t.bytes_copied(),
            t.bytes_staged,
            t.bytes_direct,
            t.bytes_pageable,
            t.fetches,
            t.prefetch_hits,
            t.prefetch_misses,
            t.wait_ns as f64 / 1e6,
            self.pinned,
            if self.pinned_is_page_locked { "page-locked" } else { "pageable" }
        )
    }
}

impl super::MemoryManager {
    /// The registered models, most recently used first, as of the last manager call (each one's
    /// resident bytes live). Never waits for a load in progress.
    pub fn loaded_models(&self) -> Vec<LoadedModelInfo> {
        let view = Arc::clone(&self.view.lock());
        view.iter()
            .filter_map(|e| {
                let model = e.model.upgrade()?;
                // One read of the model's residency: a second read while holding the first
                // waits behind a queued writer (a load evicting this model), which waits for
                // the first read — the deadlock the lock checker refuses.
                let placed: Vec<(DeviceId, ByteSize)> = {
                    let state = model.state();
                    state
                        .devices()
                        .into_iter()
                        .map(|d| (d, state.bytes_on(d)))
                        .collect()
                };
                Some(LoadedModelInfo {
                    name: model.name().to_string(),
                    model_id: model.id(),
                    device: e.device,
                    resident: placed.iter().map(|p| p.1).sum(),
                    size: e.size,
                    // The registry's reference and the one upgraded here are not outside.
                    outside_handles: Arc::strong_count(&model).saturating_sub(2),
                    quantized: model.quantized_size().0,
                    placed,
                })
            })
            .collect()
    }

    /// A report of every device's memory and every loaded model, for people (`Display`) and
    /// programs (its fields). It never waits for a load in progress: each device's ledger and free
    /// memory are the ledger's book as of the manager's last step (one consistent figure per
    /// device, within its budget), the models the registry as of the last manager call with
    /// their resident bytes read live.
    ///
    /// With no call in flight (the manager lock free now) the books are brought up to date first,
    /// so the report agrees with [`super::MemoryManager::ledger`]: a patcher's own
    /// `partially_unload` changes residency without a manager call.
    pub fn memory_report(&self) -> MemoryReport {
        if let Some(guard) = self.inner.try_lock() {
            let inner = super::InnerGuard {
                guard,
                view: &self.view,
                closed: Vec::new(),
            };
            self.refresh_ledger(&inner);
        }
        let models = self.loaded_models();
        let mut devices: Vec<DeviceId> = models
            .iter()
            .flat_map(|m| std::iter::once(m.device).chain(m.placed.iter().map(|p| p.0)))
            .collect();
        devices.push(self.policy.compute_device());
        devices.extend(self.placement_devices());
        devices.sort();
        devices.dedup();
        let devices = devices
            .into_iter()
            .map(|d| DeviceMemory {
                device: d,
                total: self.policy.total_memory(d),
                budgeted: self.policy.is_budgeted(d),
                ledger: self.ledger.booked(d),
                cached_casts: self.cached_in(d),
                reserved: self.ledger.reserved(d),
                in_flight: self
                    .ledger
                    .in_flight(d)
                    .saturating_add(self.ledger.faulting(d)),
                peak: self.ledger.peak(d),
                free: self.free_with(self.ledger.booked(d), d),
            })
            .collect();
        let pool = self.engine.pool().map(|p| p.stats()).unwrap_or_default();
        MemoryReport {
            devices,
            host: self.host.stats(),
            models,
            pinned: pool.allocated,
            pinned_is_page_locked: pool.pinned,
            transfers: self.engine.stats().snapshot(),
            reservations: self.reservations(),
            dynamic: self.policy.dynamic_vram(),
            dynamic_devices: self.dynamic.report(false),
            misses: self.miss_report(),
            costs: self.costs(),
            audits: self.audits(),
        }
    }
}
