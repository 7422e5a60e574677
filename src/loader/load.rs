//! [`MemoryManager::load_models_gpu`]: plan, validate, act (docs/ARCHITECTURE.md §5), and the
//! plan's trace span.

use std::sync::Arc;

use super::*;

impl MemoryManager {
    /// Loads `models` (and their additional models) onto their load devices: plans the load
    /// ([`MemoryManager::plan`]), refuses it when it is invalid or does not fit — before anything
    /// moves — and carries it out, evicting other models as planned (docs/ARCHITECTURE.md §5).
    ///
    /// # Errors
    /// Whatever [`MemoryManager::plan`] refuses; [`Error::OutOfMemory`] /
    /// [`Error::BudgetExceeded`] when the plan does not fit; a driver error mid-way, after
    /// which everything this call changed is rolled back ([`Error::RollbackIncomplete`] lists
    /// any copy that could not be rebuilt). On error the registry, every model's residency and
    /// patches, and the ledger are as they were.
    ///
    /// [`Error::OutOfMemory`]: crate::Error::OutOfMemory
    /// [`Error::BudgetExceeded`]: crate::Error::BudgetExceeded
    /// [`Error::RollbackIncomplete`]: crate::Error::RollbackIncomplete
    ///
    /// `models` may be patchers or references to them (`&[p.clone()]` or `&[&p, &q]`). After a
    /// successful load each model remembers which patches were loaded: a forward through layers
    /// whose patcher has other patches warns once ([`crate::ops::OpsSource::not_loaded`]); use
    /// [`crate::ops::OpsSource::load`] to switch the layers and load in one call.
    pub fn load_models_gpu<P: std::borrow::Borrow<ModelPatcher>>(
        &self,
        models: &[P],
        options: LoadOptions,
    ) -> Result<LoadReport> {
        let models: Vec<&ModelPatcher> = models.iter().map(|m| m.borrow()).collect();
        let mut report = self.load_models(&models, options)?;
        for m in expand(&models) {
            let model = m.model();
            model.note_loaded_patches(m.patches().version());
            let outside = model.held_outside();
            let Some(load) = report.models.iter_mut().find(|l| l.name == model.name()) else {
                continue;
            };
            load.resident_on = m
                .devices()
                .into_iter()
                .map(|d| (d, model.resident_bytes(d)))
                .filter(|(_, b)| *b > ByteSize::ZERO)
                .collect();
            if !outside.is_empty() {
                load.held_outside = outside.iter().map(|(_, b)| *b).sum();
                load.outside_keys = outside.iter().map(|(k, _)| k.clone()).collect();
                model.warn_outside_once(&outside, load.held_outside);
            }
        }
        Ok(report)
    }

    fn load_models(&self, models: &[&ModelPatcher], options: LoadOptions) -> Result<LoadReport> {
        let mut all = expand(models);
        let options = options.resolved(&all);
        for m in &all {
            tracing::info!(
                model = m.model().name(),
                "Requested to load {}",
                m.model().name()
            );
        }
        let mut devices: Vec<DeviceId> = all.iter().flat_map(|m| m.devices()).collect();
        devices.sort();
        devices.dedup();
        let _span = tracing::info_span!(
            "load_models_gpu",
            models = %all.iter().map(|m| m.model().name()).collect::<Vec<_>>().join(","),
            devices = ?devices,
            budget = devices.first().map(|&d| self.policy.total_memory(d).bytes()),
            memory_required = options.memory_required.bytes(),
        )
        .entered();
        self.drop_unheld_prefetches();
        let mut inner = self.lock_inner();
        // Closed until the lock is released and the registry's view published.
        inner.hold_closed(self.close(&devices));
        cleanup(&mut inner);
        // A device that cannot hold tensors (a CUDA device in a build without CUDA tensors, or
        // without a driver) is refused here in both modes, not at the first forward: a load by
        // use moves nothing, and would otherwise succeed.
        if let Some(e) = devices.iter().find_map(|d| d.to_candle().err()) {
            let stale = Self::take_stale(&mut inner);
            drop(inner);
            drop(stale);
            return Err(e);
        }
        let placed = self.place_auto(&inner, &mut all);
        // A placed model may go to a device not closed above: close it too.
        if !placed.is_empty() {
            let mut more: Vec<DeviceId> = all.iter().flat_map(|m| m.devices()).collect();
            more.retain(|d| !devices.contains(d));
            more.sort();
            more.dedup();
            inner.hold_closed(self.close(&more));
        }
        // Every handle of a placed model the caller passed learns where it went (two handles of
        // one model in a call load as one, the last given).
        let record_placement = || {
            for (m, d) in &placed {
                m.set_auto_device(*d);
                for other in models
                    .iter()
                    .copied()
                    .chain(models.iter().flat_map(|x| x.additional_models()))
                {
                    if Arc::ptr_eq(other.model(), m.model()) {
                        other.set_auto_device(*d);
                    }
                }
            }
        };
        if let Some(report) = self.reload_noop(&mut inner, &all, &options) {
            record_placement();
            for m in &all {
                self.attach_cast_cache(m, &options);
            }
            self.refresh_ledger(&inner);
            // Models the cleanup above dropped (no handle left) are freed now, outside the lock,
            // not kept until the next call that changes something.
            let dropped = std::mem::take(&mut inner.unloaded);
            drop(inner);
            drop(dropped);
            return Ok(report);
        }
        inner
            .unloaded
            .extend(all.iter().map(|m| Arc::clone(m.model())));
        self.cancel_own_prefetches(&all);
        let result = self
            .plan_locked(&inner, &all, &options)
            .and_then(|plan| {
                trace_plan(&plan);
                match &plan.problem {
                    Some(problem) => Err(problem.to_error()),
                    None => {
                        let _span = tracing::debug_span!(
                            "execute",
                            models = %plan.models.iter().map(|m| m.name.as_str()).collect::<Vec<_>>().join(","),
                            to_move = plan.bytes_to_move().bytes(),
                            to_evict = plan.bytes_to_evict().bytes(),
                        )
                        .entered();
                        self.execute(&mut inner, &plan, &all, &options)
                    }
                }
            });
        if result.is_ok() {
            record_placement();
        }
        self.refresh_ledger(&inner);
        let stale = Self::take_stale(&mut inner);
        drop(inner);
        drop(stale);
        result
    }

    /// The load of models that are all fully loaded already, by patchers with the same
    /// signature, with nothing changed since and nothing to evict: what the plan would decide, in
    /// O(models) instead of O(weights) — the registry order is all that changes. `None` when
    /// anything differs; the full plan then runs.
    pub(super) fn reload_noop(
        &self,
        inner: &mut Inner,
        all: &[ModelPatcher],
        options: &LoadOptions,
    ) -> Option<LoadReport> {
        if self.policy.vram_state() == VramState::NoVram {
            return None;
        }
        for m in all {
            let e = inner
                .registry
                .iter()
                .find(|e| Arc::ptr_eq(e.model(), m.model()))?;
            let full = e.full_at?;
            if e.device != m.load_device()
                || full.signature != m.residency_signature()
                || full.generation != m.model().residency_generation()
            {
                return None;
            }
        }
        // With nothing to load, the plan evicts only to keep `extra_mem` (and the minimum) free.
        for d in all.iter().flat_map(|m| m.devices()) {
            let (extra_mem, min_required, _) = self.memory_to_keep_free(options, d);
            if self.policy.is_scheduled(d) {
                let free = self.free_in(&inner.registry, d);
                if free <= ByteSize::from_f64(extra_mem) || free.as_f64() < min_required {
                    return None;
                }
            }
        }
        let mut report = LoadReport::default();
        let mut entries = Vec::with_capacity(all.len());
        for m in all {
            let pos = inner
                .registry
                .iter()
                .position(|e| Arc::ptr_eq(e.model(), m.model()))?;
            let mut e = inner.registry.remove(pos);
            m.adopt_fingerprints(&e.patcher);
            e.patcher = m.same_handle();
            entries.push(e);
            report.models.push(ModelLoad {
                name: m.model().name().to_string(),
                device: m.load_device(),
                resident: m
                    .devices()
                    .iter()
                    .map(|&d| m.model().resident_bytes(d))
                    .sum(),
                streaming: ByteSize::ZERO,
                built: ByteSize::ZERO,
                lazy_patched: 0,
                full: true,
                held_outside: ByteSize::ZERO,
                outside_keys: Vec::new(),
                resident_on: Vec::new(),
            });
        }
        for e in entries {
            inner.registry.insert(0, e);
        }
        Some(report)
    }

    /// ComfyUI's figures of memory to keep free for a load: `extra_mem = max(minimum inference
    /// memory, memory_required + reserve)`, the minimum (`max(minimum inference memory, given +
    /// reserve)` when given, else `extra_mem`), and the minimum inference memory itself — with
    /// `device`'s reserve.
    pub(super) fn memory_to_keep_free(
        &self,
        options: &LoadOptions,
        device: DeviceId,
    ) -> (f64, f64, f64) {
        let reserve = self.policy.reserve_on(device).as_f64();
        let min_inf = self.policy.minimum_inference_memory_on_f64(device);
        let extra_mem = min_inf.max(options.memory_required.as_f64() + reserve);
        let min_required = match options.minimum_memory_required {
            Some(m) => min_inf.max(m.as_f64() + reserve),
            None => extra_mem,
        };
        (extra_mem, min_required, min_inf)
    }

    /// Whether a load on `device` is a dynamic one (residency by use): the mode is on, the
    /// device is scheduled and the load is not forced full.
    pub(super) fn dynamic_load(&self, device: DeviceId, options: &LoadOptions) -> bool {
        self.policy.dynamic_vram() && self.policy.is_scheduled(device) && !options.force_full_load
    }

    pub(super) fn full_load(&self, device: DeviceId, options: &LoadOptions) -> bool {
        options.force_full_load
            || matches!(
                self.policy.vram_state(),
                VramState::HighVram | VramState::Shared | VramState::Disabled
            )
            || !self.policy.is_scheduled(device)
    }

    /// A partially loaded model streams: give it a prefetching streamer whose bytes in flight
    /// are booked in the ledger, keeping free the activation memory the load asked for (each
    /// prefetch also keeps the weights in use beside it free: `offload/prefetch.rs`). In
    /// dynamic mode every loaded model gets one: its weights are kept through it. It prefetches
    /// `depth` weights ahead (the plan's [`super::PlannedLoad::prefetch_depth`]).
    pub(super) fn attach_streamer(
        &self,
        m: &ModelPatcher,
        load: &ModelLoad,
        options: &LoadOptions,
        (keeper_room, chosen): (ByteSize, Option<&[bool]>),
        depth: Option<usize>,
    ) {
        let dynamic = self.dynamic_load(m.load_device(), options);
        if load.full && !dynamic {
            crate::offload::attach_streamer(m, None);
            return;
        }
        if dynamic {
            // Loaded again: prioritized (the registry's front), its watermark reset, and the
            // classic selection ranked first among its weights used as often.
            m.model().usage().reset_watermark();
            if let Some(chosen) = chosen {
                m.model().usage().choose(chosen);
            }
        }
        self.give_streamer(m, options.memory_required, keeper_room, depth);
    }

    /// Attaches a prefetching streamer to `m`'s model (reusing its own when it has one of this
    /// manager's), its bytes in flight booked in the ledger keeping `keep_free` free. In
    /// dynamic mode its keeper keeps copies leaving `keeper_room` free: the plan's
    /// [`super::PlannedLoad::keeper_room`], the room the classic partial load leaves.
    /// `depth`: the prefetch depth the plan chose (`None` keeps a reused streamer's, and gives a
    /// new one the configuration's).
    pub(super) fn give_streamer(
        &self,
        m: &ModelPatcher,
        keep_free: ByteSize,
        keeper_room: ByteSize,
        depth: Option<usize>,
    ) {
        let streamer = match crate::offload::streamer_of(m) {
            Some(s) if Arc::ptr_eq(s.engine(), &self.engine) => s,
            _ => Arc::new(Streamer::new(
                Arc::clone(&self.engine),
                self.policy.config().prefetch_depth(),
                ByteSize::MAX,
            )),
        };
        self.engine.adopt(&streamer);
        if let Some(depth) = depth {
            streamer.set_depth(depth);
        }
        let gate: Arc<dyn PrefetchGate> = self.ledger.clone();
        streamer.set_gate(Some((gate, keep_free)));
        if let Some(costs) = &self.misses {
            streamer.set_misses(Arc::clone(costs));
        }
        streamer.set_costs(Arc::clone(&self.costs));
        if self.policy.dynamic_vram() {
            // Residency by use: what is kept leaves the room the plan gives it free (one rule
            // with the classic partial load's selection: `plan_group`).
            let keeper: Arc<dyn crate::offload::Keeper> = self.dynamic.clone();
            streamer.set_keeper(Some((keeper, keeper_room)));
            m.model().set_dynamic(true);
        }
        crate::offload::attach_streamer(m, Some(streamer));
    }

    /// Loads one model (see [`MemoryManager::load_models_gpu`]).
    pub fn load_model_gpu(&self, model: &ModelPatcher) -> Result<LoadReport> {
        self.load_models_gpu(&[model], LoadOptions::default())
    }
}

/// The requested models and their additional models, one patcher per model (the last one given
/// for a model wins).
pub(super) fn expand(models: &[&ModelPatcher]) -> Vec<ModelPatcher> {
    let mut all: Vec<ModelPatcher> = Vec::new();
    let mut push = |m: &ModelPatcher| match all.iter().position(|x| x.is_clone(m)) {
        Some(pos) => all[pos] = m.same_handle(),
        None => all.push(m.same_handle()),
    };
    for m in models {
        push(m);
        for extra in m.additional_models() {
            push(extra);
        }
    }
    all
}

/// The plan of a load as a zero-length `plan` span (`residency::trace`): the models with their
/// weight budgets and resident bytes, the bytes to move and to evict, each device's ledger after
/// against its total, and the problem if it does not fit.
pub(super) fn trace_plan(plan: &LoadPlan) {
    if !tracing::enabled!(tracing::Level::DEBUG) {
        return;
    }
    let budgets = plan
        .models
        .iter()
        .map(|m| match m.weight_budget {
            Some(b) => format!("{}={}", m.name, b.bytes()),
            None => format!("{}=full", m.name),
        })
        .collect::<Vec<_>>()
        .join(",");
    let ledgers = plan
        .devices
        .iter()
        .map(|d| {
            format!(
                "{}={}/{}",
                d.device,
                d.ledger_after.bytes(),
                d.total.bytes()
            )
        })
        .collect::<Vec<_>>()
        .join(",");
    let _span = tracing::debug_span!(
        "plan",
        models = %plan.models.iter().map(|m| m.name.as_str()).collect::<Vec<_>>().join(","),
        budgets = %budgets,
        resident = plan.models.iter().map(|m| m.resident.bytes()).sum::<u64>(),
        streaming = plan.models.iter().map(|m| m.streaming.bytes()).sum::<u64>(),
        to_move = plan.bytes_to_move().bytes(),
        to_evict = plan.bytes_to_evict().bytes(),
        evictions = plan.evictions.len(),
        ledgers = %ledgers,
        fits = plan.fits(),
    )
    .entered();
}
