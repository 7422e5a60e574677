//! Carrying a [`LoadPlan`] out, and rolling it back when the driver fails mid-way.
//!
//! Order of execution, chosen so the ledger never runs ahead of memory (docs/ARCHITECTURE.md §4.2):
//!
//! 1. the requested models take their final places at the front of the registry (so the ledger
//!    counts them, and the copies they are about to gain, at every step);
//! 2. evictions drop the planned copies of other models;
//! 3. per model: first drop its copies the plan does not keep (not wanted, stale, or on another
//!    device), then build the missing ones one by one, each committed as soon as it exists. The
//!    ledger therefore only falls, then rises to the planned figure, which the plan checked.
//!
//! Every copy dropped and built is recorded in an [`Undo`] log. If building fails (a driver out
//! of memory, a failed transfer), the rollback restores the registry's order and entries, drops
//! every copy this call built, and rebuilds the dropped ones through a patcher whose fingerprint
//! matches them (the registered one or the requested one), where the budget allows. The error
//! then says which copies, if any, could not be restored (docs/ARCHITECTURE.md §4.4).

use std::sync::Arc;

use super::plan::{LoadPlan, Step};
use super::report::{LoadReport, ModelLoad};
use super::{Entry, Inner, LoadOptions, MemoryManager};
use crate::error::{Error, Result};
use crate::patcher::ModelPatcher;
use crate::size::ByteSize;
use crate::vram::DeviceId;
use crate::weights::{Fingerprint, Model, SlotResidency, StreamHook};

/// A resident copy this call dropped.
struct Dropped {
    model: Arc<Model>,
    index: usize,
    fingerprint: Fingerprint,
    device: DeviceId,
    bytes: ByteSize,
}

/// A resident copy this call built.
struct Built {
    model: Arc<Model>,
    index: usize,
    fingerprint: Fingerprint,
    device: DeviceId,
}

/// What a call changed, to undo it.
pub(super) struct Undo {
    registry: Vec<Entry>,
    hooks: Vec<(Arc<Model>, Option<StreamHook>)>,
    dropped: Vec<Dropped>,
    built: Vec<Built>,
}

impl Undo {
    pub(super) fn new(inner: &Inner) -> Undo {
        Undo {
            registry: inner.registry.clone(),
            hooks: Vec::new(),
            dropped: Vec::new(),
            built: Vec::new(),
        }
    }
}

/// Drops resident copy `index` of `model`, recording it.
fn drop_copy(model: &Arc<Model>, index: usize, undo: &mut Undo) -> ByteSize {
    let old = model.state_mut().evict(index, None);
    match old {
        SlotResidency::Resident {
            fingerprint,
            device,
            bytes,
            ..
        } => {
            undo.dropped.push(Dropped {
                model: Arc::clone(model),
                index,
                fingerprint,
                device,
                bytes,
            });
            bytes
        }
        SlotResidency::Offloaded => ByteSize::ZERO,
    }
}

impl MemoryManager {
    /// Carries out the evictions of a plan (they cannot fail).
    /// `evictions` are the plan's, one per eviction step in the same order; `cause` names what
    /// needed the room (the models being loaded), for the trace.
    pub(super) fn execute_evictions(
        &self,
        inner: &mut Inner,
        steps: &[Step],
        evictions: &[super::Eviction],
        cause: &str,
        undo: &mut Undo,
    ) {
        let mut unloaded = 0usize;
        let mut why = evictions.iter();
        for step in steps {
            let Step::Evict {
                model_id,
                indices,
                fully,
                ..
            } = step
            else {
                continue;
            };
            let why = why.next();
            let _span = tracing::debug_span!(
                "evict",
                victim = why.map_or("", |e| e.name.as_str()),
                device = %why.map_or(String::new(), |e| e.device.to_string()),
                bytes = why.map_or(0, |e| e.freed.bytes()),
                fully = *fully,
                load = cause,
                required = why.map_or(0, |e| e.required.bytes()),
                free = why.map_or(0, |e| e.free.bytes()),
            )
            .entered();
            let Some(pos) = inner
                .registry
                .iter()
                .position(|e| e.model().id() == *model_id)
            else {
                continue;
            };
            let model = Arc::clone(inner.registry[pos].model());
            if *fully {
                let all: Vec<usize> = (0..model.len()).collect();
                for i in all {
                    drop_copy(&model, i, undo);
                }
                undo.hooks.push((Arc::clone(&model), model.stream_hook()));
                model.set_stream_hook(None);
                inner.registry.remove(pos);
                inner.unloaded.push(Arc::clone(&model));
                unloaded += 1;
            } else {
                for &i in indices {
                    drop_copy(&model, i, undo);
                }
                // Partly evicted, its weights now stream: with prefetch, like a partial load. No
                // plan left room for its prefetch window, so the prefetches keep free what a
                // forward needs besides them: the weights in use (two of its largest, the one
                // computing and the one just taken) and the default activation memory.
                if model.stream_hook().is_none() && !indices.is_empty() {
                    undo.hooks.push((Arc::clone(&model), None));
                    let patcher = inner.registry[pos].patcher.clone();
                    let largest = (0..model.len())
                        .map(|i| patcher.resident_size(i))
                        .max()
                        .unwrap_or(ByteSize::ZERO);
                    let (extra, min_required, _) = self
                        .memory_to_keep_free(&super::LoadOptions::default(), patcher.load_device());
                    let keep_free = ByteSize::from_f64(extra.max(min_required).ceil())
                        .saturating_add(largest.saturating_mul(2));
                    // A classic model (a dynamic one has its streamer): no keeper, no room.
                    self.give_streamer(&patcher, keep_free, keep_free, None);
                }
            }
        }
        if unloaded > 0 {
            tracing::info!("{unloaded} models unloaded.");
        }
    }

    /// Carries out `plan` for the requested models `all`. On error everything is rolled back.
    pub(super) fn execute(
        &self,
        inner: &mut Inner,
        plan: &LoadPlan,
        all: &[ModelPatcher],
        options: &LoadOptions,
    ) -> Result<LoadReport> {
        let mut undo = Undo::new(inner);
        // 1. The requested models take their final places: each load goes to the front, so the
        // last one loaded is the most recently used.
        for m in all {
            inner
                .registry
                .retain(|e| !Arc::ptr_eq(e.model(), m.model()));
        }
        for m in all {
            inner.registry.insert(
                0,
                Entry {
                    patcher: m.same_handle(),
                    device: m.load_device(),
                    full_at: None,
                },
            );
        }
        // 2. Cached casts give up the room the plan needs (it planned them as free), then
        // evictions.
        self.drop_casts_for(inner, plan, options);
        let cause = if tracing::enabled!(tracing::Level::DEBUG) {
            all.iter()
                .map(|m| m.model().name())
                .collect::<Vec<_>>()
                .join(",")
        } else {
            String::new()
        };
        self.execute_evictions(inner, &plan.steps, &plan.evictions, &cause, &mut undo);
        log_evictions(&plan.evictions);
        // The ledger as it stands after the evictions (a step its trace shows).
        self.refresh_ledger(inner);
        // 3. Loads.
        let copied_before = self.engine.stats().snapshot().bytes_copied();
        let mut report = LoadReport {
            models: Vec::new(),
            evicted: plan.evictions.clone(),
            copied: ByteSize::ZERO,
        };
        for step in &plan.steps {
            let Step::Load { k, want } = step else {
                continue;
            };
            let m = &all[*k];
            match self.load_planned(m, want, &mut undo) {
                Ok(load) => {
                    for d in m.devices() {
                        self.note_ledger(inner, d);
                    }
                    report.models.push(load);
                }
                Err(e) => return Err(self.rollback(inner, undo, all, e)),
            }
        }
        report.copied = self
            .engine
            .stats()
            .snapshot()
            .bytes_copied()
            .saturating_sub(copied_before);
        // Never report success over a budget (the plan checked it; a patcher changed behind the
        // manager's back is the only way here).
        if let Some(e) = self.over_budget(inner, plan, all) {
            return Err(self.rollback(inner, undo, all, e));
        }
        for (m, load) in all.iter().zip(&report.models) {
            let k = plan
                .models
                .iter()
                .position(|p| p.model_id == m.model().id());
            let planned = k.map(|k| &plan.models[k]);
            let keeper_room = planned.map_or(options.memory_required, |p| p.keeper_room);
            let depth = planned.map(|p| p.prefetch_depth);
            let chosen = k.and_then(|k| plan.steady.get(k)).map(Vec::as_slice);
            self.attach_streamer(m, load, options, (keeper_room, chosen), depth);
            self.attach_cast_cache(m, options);
            log_load(load);
            if load.full {
                if let Some(e) = inner
                    .registry
                    .iter_mut()
                    .find(|e| Arc::ptr_eq(e.model(), m.model()))
                {
                    e.full_at = Some(super::FullAt {
                        generation: m.model().residency_generation(),
                        signature: m.residency_signature(),
                    });
                }
            }
        }
        Ok(report)
    }

    /// Drops the cached casts of each planned device whose room the plan needs: where the
    /// ledger after the plan, the casts and the memory to keep free pass the device's total.
    fn drop_casts_for(&self, inner: &Inner, plan: &LoadPlan, options: &LoadOptions) {
        for d in &plan.devices {
            let (extra_mem, min_required, _) = self.memory_to_keep_free(options, d.device);
            let keep_free = ByteSize::from_f64(extra_mem.max(min_required).ceil());
            let cached = self.cached_in(d.device);
            if cached > ByteSize::ZERO
                && d.ledger_after
                    .saturating_add(cached)
                    .saturating_add(keep_free)
                    > d.total
            {
                self.drop_casts(inner, d.device);
            }
        }
    }

    /// The out-of-memory of a budgeted planned device whose ledger passed its total after the
    /// loads, naming the first of `all` on it.
    fn over_budget(&self, inner: &Inner, plan: &LoadPlan, all: &[ModelPatcher]) -> Option<Error> {
        plan.devices
            .iter()
            .filter(|d| self.policy.is_budgeted(d.device))
            .find_map(|d| {
                let ledger = self.ledger_in(&inner.registry, d.device);
                (ledger > d.total).then(|| Error::OutOfMemory {
                    model: all
                        .iter()
                        .find(|m| m.devices().contains(&d.device))
                        .map(|m| m.model().name().to_string())
                        .unwrap_or_default(),
                    device: d.device.to_string(),
                    required: ledger,
                    available: d.total,
                })
            })
    }

    /// Makes exactly `want` resident for `m`: drops what the plan does not keep, then builds and
    /// commits the missing copies one by one.
    fn load_planned(&self, m: &ModelPatcher, want: &[bool], undo: &mut Undo) -> Result<ModelLoad> {
        let model = m.model();
        m.note_devices(self.engine.devices());
        let fingerprints: Vec<Fingerprint> = (0..model.len()).map(|i| m.fingerprint(i)).collect();
        // Each weight's device: the load device, or its mapped one in a split model.
        let devices: Vec<DeviceId> = (0..model.len()).map(|i| m.weight_device(i)).collect();
        let keep = |s: &SlotResidency, i: usize| {
            want[i]
                && matches!(s, SlotResidency::Resident { device: d, fingerprint, .. }
                    if *d == devices[i] && *fingerprint == fingerprints[i])
        };
        let to_drop: Vec<usize> = {
            let st = model.state();
            st.slots()
                .iter()
                .enumerate()
                .filter(|(i, s)| matches!(s, SlotResidency::Resident { .. }) && !keep(s, *i))
                .map(|(i, _)| i)
                .collect()
        };
        for i in to_drop {
            drop_copy(model, i, undo);
        }
        let to_build: Vec<usize> = {
            let st = model.state();
            (0..model.len())
                .filter(|&i| want[i] && !keep(&st.slots()[i], i))
                .collect()
        };
        let mut built = ByteSize::ZERO;
        for i in to_build {
            // The transfer path of a streamed weight: on a GPU through page-locked memory.
            let device = devices[i];
            let (tensor, hold) = self.engine.load_held(m, i)?;
            let (tensor, bytes) = m.resident_from(i, tensor, device)?;
            model.state_mut().set_held(
                i,
                SlotResidency::Resident {
                    tensor,
                    fingerprint: fingerprints[i],
                    device,
                    bytes,
                },
                hold,
            );
            undo.built.push(Built {
                model: Arc::clone(model),
                index: i,
                fingerprint: fingerprints[i],
                device,
            });
            built = built.saturating_add(bytes);
        }
        let outcome = m.load_outcome();
        Ok(ModelLoad {
            name: model.name().to_string(),
            device: m.load_device(),
            resident: outcome.resident,
            streaming: outcome.streaming,
            built,
            lazy_patched: outcome.lazy_patched,
            full: outcome.full,
            held_outside: ByteSize::ZERO,
            outside_keys: Vec::new(),
            resident_on: Vec::new(),
        })
    }

    /// Undoes a failed execution and returns the error to report.
    fn rollback(&self, inner: &mut Inner, undo: Undo, all: &[ModelPatcher], cause: Error) -> Error {
        let Undo {
            registry,
            hooks,
            dropped,
            built,
        } = undo;
        inner.registry = registry;
        for b in built.iter().rev() {
            let mut st = b.model.state_mut();
            let ours = matches!(&st.slots()[b.index], SlotResidency::Resident { fingerprint, device, .. }
                if *fingerprint == b.fingerprint && *device == b.device);
            if ours {
                st.set(b.index, SlotResidency::Offloaded);
            }
        }
        for (model, hook) in hooks {
            model.set_stream_hook(hook);
        }
        // The copies just dropped free their device memory in stream order (the stream each
        // was made on, a lane's for a prefetched one); the rebuilds below allocate on the
        // default stream, which gets that memory once those frees ran: let them run.
        let mut devices: Vec<DeviceId> = dropped.iter().map(|d| d.device).collect();
        devices.sort();
        devices.dedup();
        for device in devices {
            if let Some(gpu) = self.engine.devices().gpu(device) {
                if let Err(e) = gpu.synchronize() {
                    tracing::warn!(error = %e, %device, "synchronizing before a rollback's rebuilds");
                }
            }
        }
        let mut not_restored = Vec::new();
        for d in dropped {
            let key = d.model.slots()[d.index].name();
            let describe = || {
                format!(
                    "`{}` weight `{key}` ({} on {})",
                    d.model.name(),
                    d.bytes,
                    d.device
                )
            };
            if matches!(
                d.model.state().slots()[d.index],
                SlotResidency::Resident { .. }
            ) {
                continue;
            }
            let builder = inner
                .registry
                .iter()
                .map(|e| &e.patcher)
                .chain(all)
                .find(|p| {
                    Arc::ptr_eq(p.model(), &d.model) && p.fingerprint(d.index) == d.fingerprint
                });
            let Some(p) = builder else {
                not_restored.push(describe());
                continue;
            };
            if self.policy.is_budgeted(d.device) {
                let ledger = self.ledger_in(&inner.registry, d.device);
                if ledger.saturating_add(d.bytes) > self.policy.total_memory(d.device) {
                    not_restored.push(describe());
                    continue;
                }
            }
            // The path a load builds copies by (on a GPU through page-locked memory, counted by
            // a simulated GPU while resident).
            match self.engine.load_held(p, d.index).and_then(|(t, hold)| {
                p.resident_from(d.index, t, d.device)
                    .map(|(t, bytes)| (t, bytes, hold))
            }) {
                Ok((tensor, bytes, hold)) => {
                    d.model.state_mut().set_held(
                        d.index,
                        SlotResidency::Resident {
                            tensor,
                            fingerprint: d.fingerprint,
                            device: d.device,
                            bytes,
                        },
                        hold,
                    );
                }
                Err(e) => {
                    tracing::warn!(error = %e, "could not restore {}", describe());
                    not_restored.push(describe());
                }
            }
        }
        tracing::warn!(error = %cause, not_restored = not_restored.len(), "load failed and was rolled back");
        if not_restored.is_empty() {
            cause
        } else {
            Error::RollbackIncomplete {
                source: Box::new(cause),
                not_restored,
            }
        }
    }
}

/// One event per eviction, with numeric fields.
pub(super) fn log_evictions(evictions: &[super::Eviction]) {
    for e in evictions {
        tracing::info!(
            model = %e.name,
            model_id = e.model_id,
            device = %e.device,
            freed = e.freed.bytes(),
            fully = e.fully,
            required = e.required.bytes(),
            free = e.free.bytes(),
            "evicted {}", e.name
        );
    }
}

fn log_load(load: &ModelLoad) {
    let name = &load.name;
    let device = load.device;
    if load.full {
        tracing::info!(model = %name, %device, resident = load.resident.bytes(), built = load.built.bytes(),
            "loaded completely {name}: {} resident, {} built", load.resident, load.built);
    } else {
        tracing::info!(model = %name, %device, resident = load.resident.bytes(), streaming = load.streaming.bytes(),
            lowvram_patches = load.lazy_patched,
            "loaded partially {name}: {} resident, {} streaming, {} lowvram patches", load.resident, load.streaming, load.lazy_patched);
    }
}
