//! Planning a load: every decision of [`MemoryManager::load_models_gpu`], made before anything
//! moves.
//!
//! [`MemoryManager::plan`] reads the registry and each model's residency under the manager's lock
//! and changes nothing. It decides, in ComfyUI's order (docs/ARCHITECTURE.md §5):
//!
//! 1. registry entries nobody holds any more count as gone;
//! 2. `extra_mem` and the minimum to keep free;
//! 3. per device, which other models are evicted and which of their weights go (the same
//!    selection rule [`crate::patcher::ModelPatcher::partially_unload`] uses), until the bytes
//!    still to load ×1.1 plus `extra_mem` are free, then the minimum;
//! 4. per model, its weight budget ([`super::weight_budget`]) and exactly which weights will be
//!    resident (the rules of `ModelPatcher::load` / `partially_load`);
//! 5. the ledger after each step, checked against each budgeted device's total.
//!
//! A plan that cannot be carried out without overrunning a budget has a [`PlanProblem`]; a
//! request that is invalid (a patch that does not fit, an fp8 scale that is not a finite non-zero
//! number, an unknown GPU) is an error from `plan` itself. Execution (`loader/execute.rs`) carries
//! the plan out step by step, so its only failures are the driver's.
//!
//! Complexity: O(weights of the requested models) plus O(weights) of each model actually chosen
//! for eviction; O(registry) for the candidates' order.

use std::sync::Arc;

use super::report::Eviction;
use super::{weight_budget, Entry, Inner, LoadOptions, MemoryManager};
use crate::error::{Error, Result};
use crate::patcher::selection::{self, WeightView};
use crate::patcher::ModelPatcher;
use crate::size::ByteSize;
use crate::vram::{DeviceId, VramState};
use crate::weights::Model;

/// What one model's load will do.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct PlannedLoad {
    /// Model name.
    pub name: String,
    /// Model id ([`crate::weights::Model::id`]).
    pub model_id: u64,
    /// The load device.
    pub device: DeviceId,
    /// Whether every weight will be resident.
    pub full: bool,
    /// The bytes a partial load may add beyond those already loaded (ComfyUI's
    /// `lowvram_model_memory`); `None` for a full load, zero under `--novram`.
    pub weight_budget: Option<ByteSize>,
    /// Bytes already resident and current for this patcher on the device.
    pub already_loaded: ByteSize,
    /// Bytes resident after the load.
    pub resident: ByteSize,
    /// Bytes that will stream at use.
    pub streaming: ByteSize,
    /// Bytes to materialize (missing or stale copies).
    pub to_move: ByteSize,
    /// Bytes of this model's resident copies the load drops (not wanted, stale, or elsewhere).
    pub to_drop: ByteSize,
    /// Weights that will stream with patches (applied at use).
    pub lazy_patched: usize,
    /// Of the model's size, the bytes of quantized (GGUF) weights: their GGML blocks, counted
    /// as the blocks they are in `resident`, `streaming` and `to_move`.
    pub quantized: ByteSize,
    /// Per device the model's weights are resident on (one entry unless the model is split by
    /// a [`crate::DeviceMap`]): bytes resident and streaming there.
    pub placed: Vec<PlacedOn>,
}

/// One device's part of a planned load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct PlacedOn {
    /// The device.
    pub device: DeviceId,
    /// Bytes resident there after the load.
    pub resident: ByteSize,
    /// Bytes of weights mapped there that will stream to it at use.
    pub streaming: ByteSize,
}

/// One device's ledger before and after a plan.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct PlannedDevice {
    /// The device.
    pub device: DeviceId,
    /// Its total as the scheduler sees it (budget-capped).
    pub total: ByteSize,
    /// Whether the ledger is bounded by it.
    pub budgeted: bool,
    /// The ledger now (resident bytes of registered models, bytes in flight, cached casts and
    /// reservations).
    pub ledger_before: ByteSize,
    /// The ledger after the plan is carried out.
    pub ledger_after: ByteSize,
    /// Of both, the bytes held by reservations ([`crate::loader::MemoryManager::reserve`]): never
    /// evicted.
    pub reserved: ByteSize,
}

/// The host tier before a plan: what it holds, and what the load will read from files.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct PlannedHost {
    /// The host budget (`--ram-budget`); `None`: unbounded.
    pub budget: Option<ByteSize>,
    /// The host ledger now: host copies held plus bytes being read.
    pub ledger_before: ByteSize,
    /// Bytes of clean weights the load reads from their files to build resident copies (lazily
    /// read weights whose host copy is not held now). Streamed weights are read at use.
    pub from_disk: ByteSize,
}

/// Why a plan cannot be carried out.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[non_exhaustive]
pub enum PlanProblem {
    /// Not enough can be freed right now (other models' pinned weights, or models loaded in the
    /// same call, hold the rest).
    OutOfMemory {
        /// The model that does not fit.
        model: String,
        /// The device.
        device: DeviceId,
        /// Bytes it needs.
        required: ByteSize,
        /// Bytes that would be free.
        available: ByteSize,
    },
    /// The model can never fit this device's budget.
    BudgetExceeded {
        /// The model.
        model: String,
        /// The device.
        device: DeviceId,
        /// Bytes it needs.
        required: ByteSize,
        /// The device's total.
        budget: ByteSize,
    },
    /// A weight of a lazily read model is larger than the whole host budget: it can never be
    /// read (raise `--ram-budget`).
    HostBudgetExceeded {
        /// The model.
        model: String,
        /// The weight.
        key: String,
        /// Its bytes.
        required: ByteSize,
        /// The host budget.
        budget: ByteSize,
    },
}

impl PlanProblem {
    /// The error `load_models_gpu` returns for this problem.
    pub fn to_error(&self) -> Error {
        match self.clone() {
            PlanProblem::OutOfMemory {
                model,
                device,
                required,
                available,
            } => Error::OutOfMemory {
                model,
                device: device.to_string(),
                required,
                available,
            },
            PlanProblem::BudgetExceeded {
                model,
                device,
                required,
                budget,
            } => Error::BudgetExceeded {
                model,
                device: device.to_string(),
                required,
                budget,
            },
            PlanProblem::HostBudgetExceeded {
                model,
                key,
                required,
                budget,
            } => Error::BudgetExceeded {
                model: format!("`{model}` weight `{key}`"),
                device: "host (--ram-budget)".into(),
                required,
                budget,
            },
        }
    }
}

/// A step of execution.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Step {
    /// Drop `indices` of model `model_id` on `device`; `fully`: drop every copy and unregister.
    Evict {
        model_id: u64,
        device: DeviceId,
        indices: Vec<usize>,
        fully: bool,
    },
    /// Make exactly `want` resident for the `k`-th requested model.
    Load { k: usize, want: Vec<bool> },
}

/// Everything [`MemoryManager::load_models_gpu`] would do with the same models and options now:
/// evictions, per-model budgets and residency, bytes to move, the ledger after, and whether it
/// fits. Plain data; asking for it changes nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct LoadPlan {
    /// Per requested model (additional models included), in load order.
    pub models: Vec<PlannedLoad>,
    /// Models that would be unloaded, in order (partly, or `fully` and unregistered).
    pub evictions: Vec<Eviction>,
    /// The ledgers of the devices involved.
    pub devices: Vec<PlannedDevice>,
    /// The host tier: its ledger and the bytes the load reads from files.
    pub host: PlannedHost,
    /// Why the plan cannot be carried out, if it cannot.
    pub problem: Option<PlanProblem>,
    /// A dynamic load (residency by use, docs/ARCHITECTURE.md §5.3): it moves nothing — what
    /// the models' `resident` figures hold is what is resident and current now (and pinned
    /// weights); the rest becomes resident as forwards use it.
    pub dynamic: bool,
    #[cfg_attr(feature = "serde", serde(skip))]
    pub(super) steps: Vec<Step>,
}

impl LoadPlan {
    /// Whether the load fits: carrying the plan out keeps every budgeted ledger within its total.
    pub fn fits(&self) -> bool {
        self.problem.is_none()
    }
    /// Bytes the load would materialize.
    pub fn bytes_to_move(&self) -> ByteSize {
        self.models.iter().map(|m| m.to_move).sum()
    }
    /// Bytes eviction would free.
    pub fn bytes_to_evict(&self) -> ByteSize {
        self.evictions.iter().map(|e| e.freed).sum()
    }
}

/// A device's ledger as the plan goes.
#[derive(Debug, Clone, Copy)]
struct DeviceProjection {
    device: DeviceId,
    total: ByteSize,
    budgeted: bool,
    /// The ledger now.
    before: ByteSize,
    /// The ledger once unheld entries are gone (where the plan starts).
    start: ByteSize,
    /// Free memory at the start, as the manager measures it.
    free_at_start: ByteSize,
    ledger: ByteSize,
}

impl DeviceProjection {
    /// Free memory once the plan's steps so far are done: what was free at the start plus what
    /// the ledger shrank by since (or minus what it grew by).
    fn free(&self) -> ByteSize {
        self.free_at_start
            .saturating_add(self.start)
            .saturating_sub(self.ledger)
    }
}

/// A registry entry chosen for eviction on one device: its copies there not yet dropped. A
/// model split across devices is a victim per device; `gone` (unloaded fully) is model-wide.
struct Victim {
    model_id: u64,
    device: DeviceId,
    remaining: Vec<(usize, ByteSize, bool)>,
    gone: bool,
}

/// The plan under construction.
pub(super) struct Planner<'a> {
    mm: &'a MemoryManager,
    registry: &'a [Entry],
    devices: Vec<DeviceProjection>,
    victims: Vec<Victim>,
    evictions: Vec<Eviction>,
    steps: Vec<Step>,
}

impl<'a> Planner<'a> {
    /// `model`'s name, followed by what holds room on `device` that no plan can take (kept
    /// models, reservations), so an out-of-memory names them.
    fn naming_holders(&self, model: &str, device: DeviceId) -> String {
        let mut held: Vec<String> = self
            .registry
            .iter()
            .filter(|e| e.model().name() != model && self.mm.is_kept(e.model().id()))
            .filter_map(|e| {
                let bytes = e.model().resident_bytes(device);
                (bytes > ByteSize::ZERO)
                    .then(|| format!("kept model `{}` ({bytes})", e.model().name()))
            })
            .collect();
        held.extend(
            self.mm
                .reservations()
                .into_iter()
                .filter(|r| r.device == device && r.bytes > ByteSize::ZERO)
                .map(|r| format!("reservation `{}` ({})", r.name, r.bytes)),
        );
        if held.is_empty() {
            model.to_string()
        } else {
            format!("{model} (room held by {})", held.join(", "))
        }
    }

    pub(super) fn new(mm: &'a MemoryManager, inner: &'a Inner) -> Planner<'a> {
        Planner {
            mm,
            registry: &inner.registry,
            devices: Vec::new(),
            victims: Vec::new(),
            evictions: Vec::new(),
            steps: Vec::new(),
        }
    }

    fn held(e: &Entry) -> bool {
        e.outside_handles() > 0
    }

    fn device(&mut self, device: DeviceId) -> &mut DeviceProjection {
        if let Some(p) = self.devices.iter().position(|d| d.device == device) {
            return &mut self.devices[p];
        }
        let before = self.mm.ledger_in(self.registry, device);
        let unheld: ByteSize = self
            .registry
            .iter()
            .filter(|e| !Self::held(e))
            .map(|e| e.model().resident_bytes(device))
            .sum();
        // Unheld entries and cached casts are gone before anything else: the plan starts
        // without them.
        let cached = self.mm.cached_in(device);
        let start = before.saturating_sub(unheld).saturating_sub(cached);
        let free_at_start = self
            .mm
            .free_in(self.registry, device)
            .saturating_add(unheld)
            .saturating_add(cached);
        self.devices.push(DeviceProjection {
            device,
            total: self.mm.policy.total_memory(device),
            budgeted: self.mm.policy.is_budgeted(device),
            before,
            start,
            free_at_start,
            ledger: start,
        });
        self.devices.last_mut().unwrap_or_else(|| unreachable!())
    }

    /// Free memory on `device` after the steps planned so far.
    pub(super) fn free(&mut self, device: DeviceId) -> ByteSize {
        self.device(device).free()
    }

    fn add(&mut self, device: DeviceId, bytes: ByteSize) {
        let d = self.device(device);
        d.ledger = d.ledger.saturating_add(bytes);
    }

    fn sub(&mut self, device: DeviceId, bytes: ByteSize) {
        let d = self.device(device);
        d.ledger = d.ledger.saturating_sub(bytes);
    }

    fn victim(&mut self, e: &Entry, device: DeviceId) -> usize {
        let id = e.model().id();
        if let Some(p) = self
            .victims
            .iter()
            .position(|v| v.model_id == id && v.device == device)
        {
            return p;
        }
        self.victims.push(Victim {
            model_id: id,
            device,
            remaining: e.model().state().resident_on(device),
            gone: false,
        });
        self.victims.len() - 1
    }

    /// Projected resident bytes of entry `e` on `device`.
    fn resident_of(&self, e: &Entry, device: DeviceId) -> ByteSize {
        let id = e.model().id();
        if self.victims.iter().any(|v| v.model_id == id && v.gone) {
            return ByteSize::ZERO;
        }
        match self
            .victims
            .iter()
            .find(|v| v.model_id == id && v.device == device)
        {
            Some(v) => v.remaining.iter().map(|r| r.1).sum(),
            None => e.model().resident_bytes(device),
        }
    }

    /// Whether entry `e` keeps copies on a device other than `device` in the plan so far.
    fn elsewhere(&self, e: &Entry, device: DeviceId) -> bool {
        let devices = e.model().state().devices();
        devices
            .into_iter()
            .any(|d| d != device && self.resident_of(e, d) > ByteSize::ZERO)
    }

    /// Plans evicting models on `device` (not in `keep`, by model id) until more than `required`
    /// bytes are free: candidates most offloaded first, then fewest outside handles, then
    /// smallest, then most recently used; with smart memory each gives up only what is missing.
    pub(super) fn evict(&mut self, required: ByteSize, device: DeviceId, keep: &[u64]) {
        if self.mm.policy.dynamic_vram() {
            return self.evict_by_priority(required, device, &[], keep);
        }
        let registry = self.registry;
        let mut candidates: Vec<(std::cmp::Reverse<ByteSize>, usize, ByteSize, usize)> = registry
            .iter()
            .enumerate()
            .filter(|(_, e)| {
                // Any model with copies here, split models included (resident_of is checked
                // below).
                Self::held(e) && !keep.contains(&e.model().id()) && !self.mm.is_kept(e.model().id())
            })
            .filter_map(|(i, e)| {
                let resident = self.resident_of(e, device);
                if resident == ByteSize::ZERO {
                    return None;
                }
                let size = e.patcher.resident_model_size();
                Some((
                    std::cmp::Reverse(size.saturating_sub(resident)),
                    e.outside_handles(),
                    size,
                    i,
                ))
            })
            .collect();
        candidates.sort();
        let smart = !self.mm.policy.config().disable_smart_memory;
        for (_, _, _, pos) in candidates {
            let free = self.free(device);
            // Without smart memory every candidate goes, as in ComfyUI.
            if smart && free > required {
                break;
            }
            let e = &registry[pos];
            let v = self.victim(e, device);
            let missing = required.saturating_sub(free);
            // A whole model gives up everything or nothing.
            let (indices, freed, fully) = if smart && !e.model().is_whole() {
                let dropped = selection::unload(&self.victims[v].remaining, missing);
                // A mask by weight index: `contains` on the list made this O(weights²).
                let mut is_dropped = vec![false; e.model().len()];
                for &i in &dropped {
                    if let Some(d) = is_dropped.get_mut(i) {
                        *d = true;
                    }
                }
                let remaining = &mut self.victims[v].remaining;
                let mut freed = ByteSize::ZERO;
                remaining.retain(|&(i, b, _)| {
                    let drop = is_dropped.get(i).copied().unwrap_or(false);
                    if drop {
                        freed = freed.saturating_add(b);
                    }
                    !drop
                });
                let empty = remaining.is_empty();
                // A split model that keeps copies on another device stays registered.
                (dropped, freed, empty && !self.elsewhere(e, device))
            } else {
                let all: Vec<usize> = self.victims[v].remaining.iter().map(|r| r.0).collect();
                let freed = self.victims[v].remaining.iter().map(|r| r.1).sum();
                self.victims[v].remaining.clear();
                (all, freed, true)
            };
            self.sub(device, freed);
            if fully {
                // A model unloaded fully loses its copies on every device (what the plan has
                // not already taken from them).
                // The devices first: the guard of a `for`'s iterator expression lives through
                // the loop, and `sub` may read this model's residency again.
                let devices = e.model().state().devices();
                for other in devices {
                    if other != device {
                        let bytes = self.resident_of(e, other);
                        self.sub(other, bytes);
                    }
                }
                for other in self
                    .victims
                    .iter_mut()
                    .filter(|o| o.model_id == e.model().id())
                {
                    other.gone = true;
                }
            }
            self.evictions.push(Eviction {
                name: e.model().name().to_string(),
                model_id: e.model().id(),
                device,
                freed,
                fully,
                required,
                free,
            });
            self.steps.push(Step::Evict {
                model_id: e.model().id(),
                device,
                indices,
                fully,
            });
        }
    }

    /// [`Planner::evict`] for `free_memory` and reservations: in dynamic mode the models the call
    /// keeps loaded (`last`: in use by the step being retried) rank above every other model —
    /// their weights go last but can go (they stream then): weights never cause an
    /// out-of-memory. In classic mode they are kept, as in ComfyUI.
    pub(super) fn evict_for_room(&mut self, required: ByteSize, device: DeviceId, last: &[u64]) {
        if self.mm.policy.dynamic_vram() {
            return self.evict_by_priority(required, device, last, &[]);
        }
        self.evict(required, device, last)
    }

    /// Dynamic mode's eviction: weight by weight in the one priority order of residency by use
    /// (`loader/dynamic.rs`: the least recently loaded model first; in a model stale weights,
    /// then the ones used later in a forward) until more than `required` bytes are free. Models
    /// in `last` go after all others; models in `keep` (being loaded) and `KeepGuard`s' never.
    fn evict_by_priority(
        &mut self,
        required: ByteSize,
        device: DeviceId,
        last: &[u64],
        keep: &[u64],
    ) {
        let registry = self.registry;
        let held = registry.iter().filter(|e| Self::held(e));
        let models: Vec<Arc<Model>> = held
            .clone()
            .filter(|e| last.contains(&e.model().id()))
            .chain(held.filter(|e| !last.contains(&e.model().id())))
            .map(|e| Arc::clone(e.model()))
            .collect();
        let order = super::dynamic::victim_order(&models, device, |id| {
            keep.contains(&id) || self.mm.is_kept(id)
        });
        // Per registry entry: the weights this walk drops, and the free figure before.
        let mut dropped: Vec<(usize, Vec<usize>, ByteSize, ByteSize)> = Vec::new();
        for c in order {
            let free = self.free(device);
            if free > required {
                break;
            }
            let Some(pos) = registry
                .iter()
                .position(|e| Arc::ptr_eq(e.model(), &c.model) && Self::held(e))
            else {
                continue;
            };
            let e = &registry[pos];
            if e.model().is_whole() {
                continue;
            }
            let v = self.victim(e, device);
            let Some(at) = self.victims[v]
                .remaining
                .iter()
                .position(|r| r.0 == c.index)
            else {
                continue;
            };
            let (_, bytes, _) = self.victims[v].remaining.remove(at);
            self.sub(device, bytes);
            match dropped.iter_mut().find(|d| d.0 == pos) {
                Some(d) => {
                    d.1.push(c.index);
                    d.2 = d.2.saturating_add(bytes);
                }
                None => dropped.push((pos, vec![c.index], bytes, free)),
            }
        }
        for (pos, indices, freed, free) in dropped {
            let e = &registry[pos];
            // A model stays registered (and prioritized) with nothing resident: its weights
            // come back by use.
            let fully = false;
            self.evictions.push(Eviction {
                name: e.model().name().to_string(),
                model_id: e.model().id(),
                device,
                freed,
                fully,
                required,
                free,
            });
            self.steps.push(Step::Evict {
                model_id: e.model().id(),
                device,
                indices,
                fully,
            });
        }
    }

    /// The evictions planned, and their steps.
    pub(super) fn into_evictions(self) -> (Vec<Eviction>, Vec<Step>) {
        (self.evictions, self.steps)
    }
}

/// Whether model `m` is in the registry (and held).
fn registered(registry: &[Entry], m: &Arc<Model>) -> bool {
    registry
        .iter()
        .any(|e| Arc::ptr_eq(e.model(), m) && Planner::held(e))
}

impl MemoryManager {
    /// Plans loading `models` (and their additional models) with `options`: what
    /// [`MemoryManager::load_models_gpu`] would do if called now, changing nothing. An engine can
    /// ask whether a load fits ([`LoadPlan::fits`]) and what it would evict before committing.
    ///
    /// # Errors
    /// Invalid requests, as `load_models_gpu` reports them: a patch chain that does not fit its
    /// weight, an fp8 weight whose scale is not a finite non-zero number, a GPU the machine does
    /// not have. A request that is valid but does not fit is an `Ok` plan with a
    /// [`LoadPlan::problem`].
    pub fn plan(&self, models: &[ModelPatcher], options: LoadOptions) -> Result<LoadPlan> {
        let mut all = super::expand(models);
        let options = options.resolved(&all);
        let inner = self.lock_inner();
        self.place_auto(&inner, &mut all);
        self.plan_locked(&inner, &all, &options)
    }

    pub(super) fn plan_locked(
        &self,
        inner: &Inner,
        all: &[ModelPatcher],
        options: &LoadOptions,
    ) -> Result<LoadPlan> {
        for m in all {
            self.validate_request(m)?;
        }
        let mut problem = self.host_problem(all);
        let mut p = Planner::new(self, inner);
        // What to keep free, per device (its own reserve).
        let keep_free = |device: DeviceId| self.memory_to_keep_free(options, device);
        let views: Vec<Vec<WeightView>> = all
            .iter()
            .map(|m| m.weight_views(m.load_device()))
            .collect();
        // Each weight's device (a split model's weights differ) and whether it only ever
        // streams (mapped to the host).
        let placed: Vec<Vec<(DeviceId, bool)>> = all
            .iter()
            .map(|m| {
                (0..m.model().len())
                    .map(|i| (m.weight_device(i), m.streams_always(i)))
                    .collect()
            })
            .collect();
        // Bytes current on their device, per model and device.
        let already_on = |k: usize, device: DeviceId| -> ByteSize {
            views[k]
                .iter()
                .zip(&placed[k])
                .filter(|(w, &(d, host))| w.current && d == device && !host)
                .map(|(w, _)| w.on_device.unwrap_or(ByteSize::ZERO))
                .sum()
        };

        // Evictions, per device.
        let mut devices: Vec<DeviceId> = all.iter().flat_map(|m| m.devices()).collect();
        devices.sort();
        devices.dedup();
        let keep: Vec<u64> = all.iter().map(|m| m.model().id()).collect();
        for &device in &devices {
            p.device(device);
            if !self.policy.is_scheduled(device) {
                continue;
            }
            let to_load: ByteSize = (0..all.len())
                .map(|k| {
                    let size: ByteSize = views[k]
                        .iter()
                        .zip(&placed[k])
                        .filter(|(_, &(d, host))| d == device && !host)
                        .map(|(w, _)| w.size)
                        .sum();
                    size.saturating_sub(already_on(k, device))
                })
                .sum();
            if self.dynamic_load(device, options) {
                // Residency by use: the load moves nothing, so it needs no room, unless the engine
                // asked for activation memory (then by the one priority order).
                if options.memory_required > ByteSize::ZERO {
                    p.evict(options.memory_required, device, &keep);
                }
                continue;
            }
            let (extra_mem, min_required, _) = keep_free(device);
            let want = to_load.as_f64() * 1.1 + extra_mem;
            p.evict(ByteSize::from_f64(want), device, &keep);
            if p.free(device).as_f64() < min_required {
                p.evict(ByteSize::from_f64(min_required), device, &keep);
            }
        }

        // Budgets and residency, per model in load order and, for a split model, per device.
        let mut models = Vec::with_capacity(all.len());
        let mut host = PlannedHost {
            budget: self.host.budget(),
            ledger_before: self.host.ledger(),
            from_disk: ByteSize::ZERO,
        };
        for (k, m) in all.iter().enumerate() {
            let mut want = vec![false; views[k].len()];
            let mut planned = PlannedLoad {
                name: m.model().name().to_string(),
                model_id: m.model().id(),
                device: m.load_device(),
                full: false,
                weight_budget: None,
                already_loaded: ByteSize::ZERO,
                resident: ByteSize::ZERO,
                streaming: ByteSize::ZERO,
                to_move: ByteSize::ZERO,
                to_drop: ByteSize::ZERO,
                lazy_patched: 0,
                quantized: m.model().quantized_size().0,
                placed: Vec::new(),
            };
            let model_devices = m.devices();
            let counted = registered(&inner.registry, m.model());
            for &device in &model_devices {
                // This device's weights, as the selection rules see them: all of an unsplit
                // model's (no copy), a split model's mapped here.
                let indices: Option<Vec<usize>> = m.device_map().map(|_| {
                    (0..views[k].len())
                        .filter(|&i| placed[k][i] == (device, false))
                        .collect()
                });
                let sub: std::borrow::Cow<[WeightView]> = match &indices {
                    None => std::borrow::Cow::Borrowed(&views[k]),
                    Some(ix) => ix.iter().map(|&i| views[k][i]).collect(),
                };
                let already = already_on(k, device);
                let (sub_want, budget) = self.plan_group(&mut p, m, device, &sub, already, options);
                // What the ledger counts of this model on the device now.
                let here: ByteSize = if counted {
                    m.model().resident_bytes(device)
                } else {
                    ByteSize::ZERO
                };
                let mut sub_want = sub_want;
                let full = sub_want.iter().all(|&w| w);
                let budgeted = self.policy.is_budgeted(device);
                let total = self.policy.total_memory(device);
                let base = p.device(device).ledger.saturating_sub(here);
                if budgeted && problem.is_none() {
                    let after = base.saturating_add(selection::wanted_bytes(&sub, &sub_want));
                    if after > total {
                        if budget.is_none() && full {
                            let size: ByteSize = sub.iter().map(|w| w.size).sum();
                            problem = Some(if size > total {
                                PlanProblem::BudgetExceeded {
                                    model: m.model().name().to_string(),
                                    device,
                                    required: size,
                                    budget: total,
                                }
                            } else {
                                PlanProblem::OutOfMemory {
                                    model: p.naming_holders(m.model().name(), device),
                                    device,
                                    required: selection::wanted_bytes(&sub, &sub_want)
                                        .saturating_sub(here),
                                    available: p.free(device),
                                }
                            });
                        } else if !shrink_to_fit(&sub, &mut sub_want, total.saturating_sub(base)) {
                            problem = Some(PlanProblem::OutOfMemory {
                                model: p.naming_holders(m.model().name(), device),
                                device,
                                required: selection::wanted_bytes(&sub, &sub_want)
                                    .saturating_sub(here),
                                available: p.free(device),
                            });
                        }
                    }
                }
                // On a GPU a weight that streams needs device room while it is copied and used:
                // what stays resident (pinned weights included) must leave the largest of them.
                if budgeted && problem.is_none() && !device.is_cpu() {
                    for _ in 0..sub.len().max(1) {
                        let streamed = sub
                            .iter()
                            .zip(&sub_want)
                            .filter(|(_, &w)| !w)
                            .map(|(v, _)| v.size)
                            .max()
                            .unwrap_or(ByteSize::ZERO);
                        let kept = base.saturating_add(selection::wanted_bytes(&sub, &sub_want));
                        if kept.saturating_add(streamed) <= total {
                            break;
                        }
                        let room = total.saturating_sub(base).saturating_sub(streamed);
                        if !shrink_to_fit(&sub, &mut sub_want, room) {
                            problem = Some(PlanProblem::OutOfMemory {
                                model: format!(
                                    "{} (its pinned weights leave no room to stream a {streamed} weight)",
                                    p.naming_holders(m.model().name(), device)
                                ),
                                device,
                                required: selection::wanted_bytes(&sub, &sub_want)
                                    .saturating_add(streamed)
                                    .saturating_sub(here),
                                available: p.free(device),
                            });
                            break;
                        }
                    }
                }
                let resident = selection::wanted_bytes(&sub, &sub_want);
                p.sub(device, here);
                p.add(device, resident);
                match &indices {
                    None => want.copy_from_slice(&sub_want),
                    Some(ix) => {
                        for (j, &i) in ix.iter().enumerate() {
                            want[i] = sub_want[j];
                        }
                    }
                }
                let streaming: ByteSize = sub
                    .iter()
                    .zip(&sub_want)
                    .filter(|(_, &w)| !w)
                    .map(|(v, _)| v.size)
                    .sum();
                if device == m.load_device() {
                    planned.weight_budget = budget;
                }
                planned.already_loaded = planned.already_loaded.saturating_add(already);
                planned.resident = planned.resident.saturating_add(resident);
                planned.placed.push(PlacedOn {
                    device,
                    resident,
                    streaming,
                });
            }
            // Copies on devices the model no longer uses are dropped.
            // Read once, then released: `sub` may read every model's residency (a device the
            // projection has not seen yet), this one's included.
            let elsewhere: Vec<(DeviceId, ByteSize)> = {
                let st = m.model().state();
                st.devices()
                    .into_iter()
                    .filter(|d| !model_devices.contains(d))
                    .map(|d| (d, st.bytes_on(d)))
                    .collect()
            };
            for (other, bytes) in elsewhere {
                planned.to_drop = planned.to_drop.saturating_add(bytes);
                if counted {
                    p.sub(other, bytes);
                }
            }
            for (w, &wanted) in views[k].iter().zip(&want) {
                match (wanted, w.on_device, w.current) {
                    (true, _, true) => {}
                    (true, old, false) => {
                        planned.to_move = planned.to_move.saturating_add(w.size);
                        planned.to_drop = planned
                            .to_drop
                            .saturating_add(old.unwrap_or(ByteSize::ZERO));
                    }
                    (false, old, _) => {
                        planned.streaming = planned.streaming.saturating_add(w.size);
                        planned.to_drop = planned
                            .to_drop
                            .saturating_add(old.unwrap_or(ByteSize::ZERO));
                        if w.patched {
                            planned.lazy_patched += 1;
                        }
                    }
                }
            }
            planned.full = want.iter().all(|&w| w);
            host.from_disk = host
                .from_disk
                .saturating_add(from_disk(m, &views[k], &want));
            models.push(planned);
            p.steps.push(Step::Load { k, want });
        }
        let devices = p
            .devices
            .iter()
            .map(|d| PlannedDevice {
                device: d.device,
                total: d.total,
                budgeted: d.budgeted,
                ledger_before: d.before,
                ledger_after: d.ledger,
                reserved: self.ledger.reserved(d.device),
            })
            .collect();
        let dynamic = all
            .iter()
            .any(|m| self.dynamic_load(m.load_device(), options));
        Ok(LoadPlan {
            models,
            evictions: p.evictions,
            devices,
            host,
            problem,
            dynamic,
            steps: p.steps,
        })
    }

    /// Which of `views` (one model's weights on `device`; `already` of their bytes current
    /// there) will be resident, and the weight budget of a partial load (`None`: full).
    #[allow(clippy::too_many_arguments)]
    fn plan_group(
        &self,
        p: &mut Planner<'_>,
        m: &ModelPatcher,
        device: DeviceId,
        views: &[WeightView],
        already: ByteSize,
        options: &LoadOptions,
    ) -> (Vec<bool>, Option<ByteSize>) {
        let (_, min_required, min_inf) = self.memory_to_keep_free(options, device);
        // A whole model (a managed module) cannot stream: it loads fully or not at all.
        let whole = m.model().is_whole();
        let novram = !whole
            && self.policy.vram_state() == VramState::NoVram
            && self.policy.is_scheduled(device);
        let full = whole || (!novram && self.full_load(device, options));
        if full {
            return (vec![true; views.len()], None);
        }
        if novram {
            // ComfyUI gives this load a 0.1-byte budget: every castable weight streams, even
            // with `force_full_load`.
            return (vec![false; views.len()], Some(ByteSize::ZERO));
        }
        if self.dynamic_load(device, options) {
            // Residency by use: what is resident and current stays (pinned weights are loaded,
            // as asked); everything else becomes resident when a forward uses it.
            let want: Vec<bool> = views
                .iter()
                .map(|w| w.pinned || (w.current && w.on_device.is_some()))
                .collect();
            let kept = selection::wanted_bytes(views, &want);
            return (want, Some(kept));
        }
        let budget = weight_budget(
            p.free(device),
            already,
            min_required,
            min_inf,
            self.policy.weight_ratio(device),
        );
        let select = |budget: ByteSize| {
            if already > ByteSize::ZERO {
                selection::grow(views, budget, options.force_patch_weights)
            } else {
                selection::from_scratch(views, budget, options.force_patch_weights, false)
            }
        };
        let mut want = select(budget);
        let mut budget = budget;
        // Room for the weights prefetched while this model streams (they are counted in the
        // ledger) and the one in use: without it a partial load that takes every free byte (the
        // 128 MiB floor on a small device) leaves streaming nothing to work with. Shrinking the
        // resident set can stream a larger weight than before, which needs more room: each
        // round shrinks the selected bytes (not only the budget, which can stay above them for
        // many rounds when weights are large) until the room is there or nothing is left.
        for _ in 0..=views.len() {
            let wanted = selection::wanted_bytes(views, &want);
            let room_after = p
                .free(device)
                .saturating_add(already)
                .saturating_sub(wanted);
            let needed = self.prefetch_room(views, &want, p.free(device), options, device);
            if room_after >= needed || budget == ByteSize::ZERO {
                break;
            }
            budget = budget
                .min(wanted)
                .saturating_sub(needed.saturating_sub(room_after));
            want = select(budget);
        }
        (want, Some(budget))
    }

    /// Free memory a partial load leaves for streaming: the activation memory asked for plus
    /// `depth` times the largest weight that will stream (the prefetch window; on a GPU one
    /// more, for the weight in use), when the engine prefetches — at most
    /// half of what is free, so the window never crowds out residency, but never less than the
    /// largest streamed weight itself (a forward holds the weight it computes with beside the
    /// prefetched ones; found by the model-based test on a simulated GPU, where less ran the
    /// forward out of device memory).
    ///
    /// On a GPU a streamed weight is device memory while it is copied and used, so the room for
    /// the weight in use is left without prefetch too (the simulated GPU, once it counted every
    /// resident copy, ran a lane-less forward out of memory beside a partial load that took
    /// every free byte). A budgeted CPU streams from host memory and keeps ComfyUI's figures.
    fn prefetch_room(
        &self,
        views: &[WeightView],
        want: &[bool],
        free: ByteSize,
        options: &LoadOptions,
        device: DeviceId,
    ) -> ByteSize {
        let depth = self.policy.config().prefetch_depth() as u64;
        let prefetching = self.engine.lanes() > 0 && depth > 0;
        if !prefetching && device.is_cpu() {
            return ByteSize::ZERO;
        }
        let largest = views
            .iter()
            .zip(want)
            .filter(|(_, &w)| !w)
            .map(|(v, _)| v.size)
            .max()
            .unwrap_or(ByteSize::ZERO);
        if largest == ByteSize::ZERO {
            return ByteSize::ZERO;
        }
        if !prefetching {
            return largest.saturating_add(options.memory_required);
        }
        // The window, and on a GPU the weight in use beside it.
        let in_use = u64::from(!device.is_cpu());
        ByteSize(largest.bytes().saturating_mul(depth + in_use))
            .saturating_add(options.memory_required)
            .min(ByteSize(free.bytes() / 2))
            .max(largest.saturating_add(options.memory_required))
    }

    /// A weight of a lazily read model that its host tier can never hold.
    fn host_problem(&self, all: &[ModelPatcher]) -> Option<PlanProblem> {
        for m in all {
            let model = m.model();
            let Some(budget) = model.host_tier().and_then(|t| t.budget()) else {
                continue;
            };
            if let Some(s) = model
                .slots()
                .iter()
                .filter(|s| s.is_lazy())
                .find(|s| s.bytes() > budget)
            {
                return Some(PlanProblem::HostBudgetExceeded {
                    model: model.name().to_string(),
                    key: s.name().to_string(),
                    required: s.bytes(),
                    budget,
                });
            }
        }
        None
    }

    /// The checks that can fail for a reason other than memory, made before anything moves.
    fn validate_request(&self, m: &ModelPatcher) -> Result<()> {
        if m.model().is_whole()
            && (m.devices().len() > 1
                || m.device_map()
                    .is_some_and(|_| (0..m.model().len()).any(|i| m.streams_always(i))))
        {
            return Err(Error::Device {
                device: m.load_device().to_string(),
                reason: format!(
                    "`{}` is loaded whole (a `Managed` model: one candle module computing on one device), so it cannot be split by a device map; port its layers with `residency::nn` to split it, or drop the map",
                    m.model().name()
                ),
            });
        }
        if let DeviceId::Cuda(n) = m.load_device() {
            if self.policy.hardware().gpu(n).is_none() {
                return Err(Error::Device {
                    device: m.load_device().to_string(),
                    reason: format!(
                        "model `{}` is set to load on a GPU this machine does not have",
                        m.model().name()
                    ),
                });
            }
        }
        m.validate()
    }
}

/// Bytes of `m`'s clean weights a load building `want` reads from files: lazily read weights to
/// build whose host copy is not held now.
fn from_disk(m: &ModelPatcher, views: &[WeightView], want: &[bool]) -> ByteSize {
    let model = m.model();
    let Some(tier) = model.host_tier() else {
        return ByteSize::ZERO;
    };
    model
        .slots()
        .iter()
        .enumerate()
        .filter(|(i, s)| {
            want[*i] && !views[*i].current && s.is_lazy() && !tier.holds(model.id(), *i)
        })
        .map(|(_, s)| s.bytes())
        .sum()
}

/// Drops wanted, unpinned weights smallest first until the wanted bytes are at most `room`.
/// Returns whether that was enough.
fn shrink_to_fit(views: &[WeightView], want: &mut [bool], room: ByteSize) -> bool {
    let mut order: Vec<(ByteSize, usize)> = views
        .iter()
        .enumerate()
        .filter(|(i, w)| want[*i] && !w.pinned)
        .map(|(i, w)| (w.size, i))
        .collect();
    order.sort();
    let mut bytes = selection::wanted_bytes(views, want);
    for (size, i) in order {
        if bytes <= room {
            break;
        }
        want[i] = false;
        bytes = bytes.saturating_sub(size);
    }
    bytes <= room
}
