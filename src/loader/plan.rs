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
//! The tensors a loading model's code holds as its own ([`Model::held_outside`]) join the
//! ledger when the load registers the model, as copies nothing can evict: a model not yet
//! registered has them added to the projection before anything is decided, so evictions make
//! room for them and a partial load's budget leaves it (the plan and the load's bound check
//! agree).
//!
//! A plan that cannot be carried out without overrunning a budget has a [`PlanProblem`]; a
//! request that is invalid (a patch that does not fit, an fp8 scale that is not a finite non-zero
//! number, an unknown GPU) is an error from `plan` itself. Execution (`loader/execute.rs`) carries
//! the plan out step by step, so its only failures are the driver's.
//!
//! Complexity: O(weights of the requested models) plus O(weights) of each model actually chosen
//! for eviction; O(registry) for the candidates' order.

mod group;
mod planner;

use std::sync::Arc;

use super::report::Eviction;
use super::{weight_budget, Entry, Inner, LoadOptions, MemoryManager};
use crate::error::{Error, Result};
use crate::patcher::selection::{self, WeightView};
use crate::patcher::ModelPatcher;
use crate::size::ByteSize;
use crate::vram::{DeviceId, VramState};
use crate::weights::Model;

pub(in crate::loader) use group::DepthChoice;
use group::{from_disk, shrink_to_fit, GroupPlan};
use planner::registered;
pub(in crate::loader) use planner::Planner;

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
    /// Bytes of parameters the model's code holds as its own tensors
    /// ([`crate::weights::Model::held_outside`]): not managed, never evicted or streamed, but in
    /// the ledger of their device (and in `ledger_after`) like resident copies that stay; not in
    /// `resident` or `streaming`.
    pub held_outside: ByteSize,
    /// Of the model's size, the bytes of quantized (GGUF) weights: their GGML blocks, counted
    /// as the blocks they are in `resident`, `streaming` and `to_move`.
    pub quantized: ByteSize,
    /// Per device the model's weights are resident on (one entry unless the model is split by
    /// a [`crate::DeviceMap`]): bytes resident and streaming there.
    pub placed: Vec<PlacedOn>,
    /// Device memory the load leaves free beside the resident weights and the activation
    /// memory it asked for, for streaming: the prefetch window and, on a GPU, the weight in use
    /// and the one used before it, whose stream-ordered free may still be queued (`depth` times
    /// the largest weight a classic partial load streams, plus two; at most half
    /// of what is free). Under residency by use the keeper leaves this figure and the
    /// activation memory free beside the copies it keeps — at most what the classic selection
    /// leaves — so both modes stream the same weights. Zero for a full load.
    pub streaming_room: ByteSize,
    /// Under residency by use: what its keeper leaves free beside the copies it keeps (the
    /// activation memory and the streaming room, at most what the classic selection leaves).
    pub(crate) keeper_room: ByteSize,
    /// The steady step this load predicts ([`crate::costs`]): compute, copies and the part of
    /// them exposed, with the planned resident set (for a dynamic load, the one its use keeps:
    /// the classic selection), the manager's lanes and prefetch depth, and the cost model's
    /// figures. Filled by [`MemoryManager::plan`]; a load does not pay for it.
    pub predicted: Option<crate::costs::StepPrediction>,
    /// An option that may change output bits and is predicted faster for this load (with the
    /// same resident set and room as `predicted`; [`MemoryManager::recommend`]). Filled by
    /// [`MemoryManager::plan`].
    pub recommended: Option<super::Recommendation>,
    /// The prefetch depth the model's streamer runs with: the configuration's when it sets one
    /// ([`crate::vram::Config::prefetch_depth`]), else the planner's choice (`depths`).
    pub prefetch_depth: usize,
    /// The prefetch depths the planner weighed for this load, each with the step it predicts
    /// (its own room, hence its own resident set): the fastest wins, a deeper one only when
    /// at least 2 % faster (fewer bytes otherwise). Empty when the depth was not chosen: the
    /// configuration sets it, the load is full, the engine has no lanes, the model is split by
    /// a device map, or none of its compute is measured yet (the depth is chosen from its
    /// second load on).
    pub depths: Vec<DepthOption>,
}

impl PlannedLoad {
    /// `m`'s plan before anything is decided: nothing resident, moved or streamed.
    fn empty(m: &ModelPatcher, prefetch_depth: usize) -> PlannedLoad {
        PlannedLoad {
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
            held_outside: m.model().held_outside().iter().map(|(_, b)| *b).sum(),
            quantized: m.model().quantized_size().0,
            placed: Vec::new(),
            streaming_room: ByteSize::ZERO,
            keeper_room: ByteSize::ZERO,
            predicted: None,
            recommended: None,
            prefetch_depth,
            depths: Vec::new(),
        }
    }

    /// Counts what the load of `views` with `want` resident moves, drops and streams, and
    /// whether it is full.
    fn count_moves(&mut self, views: &[WeightView], want: &[bool]) {
        for (w, &wanted) in views.iter().zip(want) {
            let old = w.on_device.unwrap_or(ByteSize::ZERO);
            match (wanted, w.current) {
                (true, true) => {}
                (true, false) => {
                    self.to_move = self.to_move.saturating_add(w.size);
                    self.to_drop = self.to_drop.saturating_add(old);
                }
                (false, _) => {
                    self.streaming = self.streaming.saturating_add(w.size);
                    self.to_drop = self.to_drop.saturating_add(old);
                    if w.patched {
                        self.lazy_patched += 1;
                    }
                }
            }
        }
        self.full = want.iter().all(|&w| w);
    }
}

/// A prefetch depth the planner weighed ([`PlannedLoad::depths`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct DepthOption {
    /// Streamed weights prefetched ahead of use.
    pub depth: usize,
    /// The step predicted with it.
    pub predicted: crate::costs::StepPrediction,
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
    /// With cost-aware misses (`--cost-aware-misses`): the rule a miss of these models' streamed
    /// quantized weights is placed by — on the host from its host copy when `rows × host <
    /// link + rows × device`, else uploaded; kept only where 8 uses pay its upload back — with
    /// the costs measured so far and the misses placed so far. `None` when the mode is off.
    pub misses: Option<crate::offload::MissReport>,
    #[cfg_attr(feature = "serde", serde(skip))]
    pub(super) steps: Vec<Step>,
    /// Per model, the resident set of the steady step `predicted` is made for.
    #[cfg_attr(feature = "serde", serde(skip))]
    pub(super) steady: Vec<Vec<bool>>,
    /// Per model, the bytes its copies in flight may take in that step.
    pub(super) rooms: Vec<u64>,
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
    pub fn plan<P: std::borrow::Borrow<ModelPatcher>>(
        &self,
        models: &[P],
        options: LoadOptions,
    ) -> Result<LoadPlan> {
        let models: Vec<&ModelPatcher> = models.iter().map(|m| m.borrow()).collect();
        let mut all = super::expand(&models);
        let options = options.resolved(&all);
        let inner = self.lock_inner();
        self.place_auto(&inner, &mut all);
        let mut plan = self.plan_locked(&inner, &all, &options)?;
        drop(inner);
        for (k, planned) in plan.models.iter_mut().enumerate() {
            let steady = &plan.steady[k];
            let depth = planned.prefetch_depth;
            planned.predicted =
                Some(self.predict_with(&all[k], |i| steady[i], plan.rooms[k], depth, false));
            planned.recommended = self.recommend_with(&all[k], |i| steady[i], plan.rooms[k], depth);
        }
        Ok(plan)
    }

    /// Fits `sub_want` (model `m`'s weights on `device`, `sub`) to the device's budget beside
    /// `base` (the projected ledger less the `here` bytes the model holds there now): a full
    /// load that does not fit is a problem, a partial one shrinks; on a GPU what stays resident
    /// must leave room to stream the largest weight that streams. The problem, if any.
    #[allow(clippy::too_many_arguments)]
    fn fit_budget(
        &self,
        p: &mut Planner<'_>,
        m: &ModelPatcher,
        device: DeviceId,
        sub: &[WeightView],
        sub_want: &mut [bool],
        budget: Option<ByteSize>,
        base: ByteSize,
        here: ByteSize,
    ) -> Option<PlanProblem> {
        let full = sub_want.iter().all(|&w| w);
        let budgeted = self.policy.is_budgeted(device);
        let total = self.policy.total_memory(device);
        let mut problem = None;
        if budgeted {
            let after = base.saturating_add(selection::wanted_bytes(sub, sub_want));
            if after > total {
                if budget.is_none() && full {
                    // The model's own tensors there stay with it: part of what it needs.
                    let size: ByteSize =
                        sub.iter().map(|w| w.size).sum::<ByteSize>().saturating_add(
                            crate::weights::outside::outside_on(m.model().id(), device),
                        );
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
                            required: selection::wanted_bytes(sub, sub_want).saturating_sub(here),
                            available: p.free(device),
                        }
                    });
                } else if !shrink_to_fit(sub, sub_want, total.saturating_sub(base)) {
                    problem = Some(PlanProblem::OutOfMemory {
                        model: p.naming_holders(m.model().name(), device),
                        device,
                        required: selection::wanted_bytes(sub, sub_want).saturating_sub(here),
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
                    .zip(sub_want.iter())
                    .filter(|(_, &w)| !w)
                    .map(|(v, _)| v.size)
                    .max()
                    .unwrap_or(ByteSize::ZERO);
                let kept = base.saturating_add(selection::wanted_bytes(sub, sub_want));
                if kept.saturating_add(streamed) <= total {
                    break;
                }
                let room = total.saturating_sub(base).saturating_sub(streamed);
                if !shrink_to_fit(sub, sub_want, room) {
                    problem = Some(PlanProblem::OutOfMemory {
                        model: format!(
                            "{} (its pinned weights leave no room to stream a {streamed} weight)",
                            p.naming_holders(m.model().name(), device)
                        ),
                        device,
                        required: selection::wanted_bytes(sub, sub_want)
                            .saturating_add(streamed)
                            .saturating_sub(here),
                        available: p.free(device),
                    });
                    break;
                }
            }
        }
        problem
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
        p.planning(all);
        let req = Requested::new(all);

        let mut devices: Vec<DeviceId> = all.iter().flat_map(|m| m.devices()).collect();
        devices.sort();
        devices.dedup();
        // What the models' code holds as its own tensors and the ledger does not count yet (a
        // model not registered): the load registers the model, so it lands with the load and
        // stays, like a resident copy nothing can evict. In the projection from the start.
        for m in all {
            if registered(&inner.registry, m.model()) {
                continue;
            }
            for (device, bytes) in crate::weights::outside::outside_by_device(m.model().id()) {
                p.add(device, bytes);
            }
        }

        // Evictions, per device.
        self.plan_evictions(&mut p, &req, &devices, options);

        // Budgets and residency, per model in load order and, for a split model, per device.
        let mut models = Vec::with_capacity(all.len());
        let mut host = PlannedHost {
            budget: self.host.budget(),
            ledger_before: self.host.ledger(),
            from_disk: ByteSize::ZERO,
        };
        let mut steadies = Vec::with_capacity(all.len());
        let mut rooms = vec![u64::MAX; all.len()];
        for (k, m) in all.iter().enumerate() {
            let mut want = vec![false; req.views[k].len()];
            let mut planned = PlannedLoad::empty(m, self.policy.config().prefetch_depth());
            let mut steady = vec![false; req.views[k].len()];
            let model_devices = m.devices();
            let counted = registered(&inner.registry, m.model());
            for &device in &model_devices {
                let part = self.plan_on_device(
                    &mut p,
                    &req,
                    (k, device, counted),
                    options,
                    &mut problem,
                    &mut planned,
                );
                if device == m.load_device() {
                    rooms[k] = part.prefetch_room;
                }
                match &part.indices {
                    None => {
                        want.copy_from_slice(&part.want);
                        steady.copy_from_slice(&part.steady);
                    }
                    Some(ix) => {
                        for (j, &i) in ix.iter().enumerate() {
                            want[i] = part.want[j];
                            steady[i] = part.steady[j];
                        }
                    }
                }
            }
            // Copies on devices the model no longer uses are dropped.
            Self::drop_elsewhere(&mut p, m, &model_devices, counted, &mut planned);
            planned.count_moves(&req.views[k], &want);
            host.from_disk = host
                .from_disk
                .saturating_add(from_disk(m, &req.views[k], &want));
            models.push(planned);
            steadies.push(steady);
            p.steps.push(Step::Load { k, want });
        }
        // A device no requested model loads weights on, where one's code holds tensors (a table
        // dequantized to the host): no budget above saw them.
        if problem.is_none() {
            problem = outside_problem(&p, all, &devices);
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
            misses: self.miss_report(),
            steps: p.steps,
            steady: steadies,
            rooms,
        })
    }

    /// The evictions of a load of `req` on each of `devices`: room for what it loads (1.1× its
    /// bytes plus what to keep free) on a classic load, only the activation memory asked for
    /// under residency by use (which moves nothing at load).
    fn plan_evictions(
        &self,
        p: &mut Planner<'_>,
        req: &Requested<'_>,
        devices: &[DeviceId],
        options: &LoadOptions,
    ) {
        let keep: Vec<u64> = req.all.iter().map(|m| m.model().id()).collect();
        for &device in devices {
            p.device(device);
            if !self.policy.is_scheduled(device) {
                continue;
            }
            let to_load: ByteSize = (0..req.all.len()).map(|k| req.to_load(k, device)).sum();
            let (extra_mem, min_required, _) = self.memory_to_keep_free(options, device);
            let want = to_load.as_f64() * 1.1 + extra_mem;
            if self.dynamic_load(device, options) {
                // Residency by use: the load moves nothing, so it needs no room, unless the engine
                // asked for activation memory (then by the one priority order).
                if options.memory_required > ByteSize::ZERO {
                    p.evict(options.memory_required, device, &keep);
                }
                // What a classic load would evict stays resident, and the fault-ins take it by
                // the one priority order: room for the resident set by use keeps, which is then
                // the classic load's (computed with those models still counted, it was smaller
                // and streamed larger weights: 13 % more bytes than classic on the main job).
                let want = ByteSize::from_f64(want.max(min_required));
                let credit = want
                    .saturating_sub(p.free(device))
                    .min(p.evictable_by_use(device, &keep));
                p.device(device).by_use_credit = credit;
                continue;
            }
            p.evict(ByteSize::from_f64(want), device, &keep);
            if p.free(device).as_f64() < min_required {
                p.evict(ByteSize::from_f64(min_required), device, &keep);
            }
        }
    }

    /// Drops `m`'s copies on devices it no longer uses (`model_devices` are those it does) from
    /// the projection (`counted`: the ledger counts them) and counts them in `planned`.
    fn drop_elsewhere(
        p: &mut Planner<'_>,
        m: &ModelPatcher,
        model_devices: &[DeviceId],
        counted: bool,
        planned: &mut PlannedLoad,
    ) {
        // Read once, then released: the projection may read every model's residency (a device
        // it has not seen yet), this one's included.
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
    }

    /// Plans model `k` of `req` on `device` (`counted`: the ledger counts its copies): which of
    /// its weights there are resident, what its steady step keeps, the prefetch room, and the
    /// plan's figures for it (`planned`). The first problem met is kept in `problem`.
    fn plan_on_device(
        &self,
        p: &mut Planner<'_>,
        req: &Requested<'_>,
        (k, device, counted): (usize, DeviceId, bool),
        options: &LoadOptions,
        problem: &mut Option<PlanProblem>,
        planned: &mut PlannedLoad,
    ) -> DevicePart {
        let m = &req.all[k];
        // This device's weights, as the selection rules see them: all of an unsplit
        // model's (no copy), a split model's mapped here.
        let indices: Option<Vec<usize>> = m.device_map().map(|_| {
            (0..req.views[k].len())
                .filter(|&i| req.placed[k][i] == (device, false))
                .collect()
        });
        let sub: std::borrow::Cow<[WeightView]> = match &indices {
            None => std::borrow::Cow::Borrowed(&req.views[k]),
            Some(ix) => ix.iter().map(|&i| req.views[k][i]).collect(),
        };
        let already = req.already_on(k, device);
        let GroupPlan {
            want: sub_want,
            budget,
            room,
            steady: sub_steady,
            depth,
            weighed,
            prefetch_room,
            keeper_room,
        } = self.plan_group(p, m, device, &sub, already, options);
        if device == m.load_device() {
            planned.prefetch_depth = depth;
            planned.depths = weighed;
        }
        let dynamic_here = self.dynamic_load(device, options);
        planned.streaming_room = planned.streaming_room.max(room);
        planned.keeper_room = planned.keeper_room.max(keeper_room);
        // What the ledger counts of this model on the device now.
        let here: ByteSize = if counted {
            m.model().resident_bytes(device)
        } else {
            ByteSize::ZERO
        };
        let mut sub_want = sub_want;
        let base = p.device(device).ledger.saturating_sub(here);
        if problem.is_none() {
            *problem = self.fit_budget(p, m, device, &sub, &mut sub_want, budget, base, here);
        }
        let resident = selection::wanted_bytes(&sub, &sub_want);
        p.sub(device, here);
        p.add(device, resident);
        // The steady step's resident set: what a classic load keeps (after any
        // shrinking above), what a dynamic load's use will keep.
        let sub_steady = if dynamic_here {
            sub_steady
        } else {
            sub_want.clone()
        };
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
        DevicePart {
            indices,
            want: sub_want,
            steady: sub_steady,
            prefetch_room,
        }
    }
}

/// The models a plan is for, as the planner reads them: each one's weight views on its load
/// device, and each weight's device and whether it only streams (mapped to the host).
struct Requested<'a> {
    all: &'a [ModelPatcher],
    views: Vec<Vec<WeightView>>,
    placed: Vec<Vec<(DeviceId, bool)>>,
}

impl<'a> Requested<'a> {
    fn new(all: &'a [ModelPatcher]) -> Requested<'a> {
        Requested {
            all,
            views: all
                .iter()
                .map(|m| m.weight_views(m.load_device()))
                .collect(),
            placed: all
                .iter()
                .map(|m| {
                    (0..m.model().len())
                        .map(|i| (m.weight_device(i), m.streams_always(i)))
                        .collect()
                })
                .collect(),
        }
    }

    /// Bytes of model `k` current on `device`.
    fn already_on(&self, k: usize, device: DeviceId) -> ByteSize {
        self.views[k]
            .iter()
            .zip(&self.placed[k])
            .filter(|(w, &(d, host))| w.current && d == device && !host)
            .map(|(w, _)| w.on_device.unwrap_or(ByteSize::ZERO))
            .sum()
    }

    /// Bytes of model `k` that a full load would still copy onto `device`.
    fn to_load(&self, k: usize, device: DeviceId) -> ByteSize {
        let size: ByteSize = self.views[k]
            .iter()
            .zip(&self.placed[k])
            .filter(|(_, &(d, host))| d == device && !host)
            .map(|(w, _)| w.size)
            .sum();
        size.saturating_sub(self.already_on(k, device))
    }
}

/// One model's plan on one device ([`MemoryManager::plan_on_device`]): the weights it covers
/// (`None`: all of an unsplit model's), which of them are resident at load and in the steady
/// step, and the room its prefetches have.
struct DevicePart {
    indices: Option<Vec<usize>>,
    want: Vec<bool>,
    steady: Vec<bool>,
    prefetch_room: u64,
}

/// A budgeted device none of `devices` (those the requested models load weights on) where the
/// projection passes the total: tensors a model's code holds there (a table dequantized to the
/// host) that no budget above saw.
fn outside_problem(
    p: &Planner<'_>,
    all: &[ModelPatcher],
    devices: &[DeviceId],
) -> Option<PlanProblem> {
    let d = p
        .devices
        .iter()
        .find(|d| d.budgeted && d.ledger > d.total && !devices.contains(&d.device))?;
    let model = all
        .iter()
        .find(|m| crate::weights::outside::outside_on(m.model().id(), d.device) > ByteSize::ZERO)
        .map(|m| m.model().name().to_string())
        .unwrap_or_default();
    Some(PlanProblem::OutOfMemory {
        model,
        device: d.device,
        required: d.ledger.saturating_sub(d.start),
        available: d.free_at_start,
    })
}
