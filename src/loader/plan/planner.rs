//! The plan under construction ([`Planner`]): each device's projected ledger, the victims
//! chosen so far and their evictions.

use super::*;

/// A device's ledger as the plan goes.
#[derive(Debug, Clone, Copy)]
pub(in crate::loader) struct DeviceProjection {
    pub(in crate::loader) device: DeviceId,
    pub(in crate::loader) total: ByteSize,
    pub(in crate::loader) budgeted: bool,
    /// The ledger now.
    pub(in crate::loader) before: ByteSize,
    /// The ledger once unheld entries are gone (where the plan starts).
    pub(in crate::loader) start: ByteSize,
    /// Free memory at the start, as the manager measures it.
    pub(in crate::loader) free_at_start: ByteSize,
    pub(in crate::loader) ledger: ByteSize,
    /// Under residency by use: the other models' bytes a classic load would evict here, which
    /// the load leaves resident and its fault-ins take by the one priority order. Room for the
    /// resident set its use keeps ([`Planner::free_to_keep`]), never for anything booked now.
    pub(in crate::loader) by_use_credit: ByteSize,
}

impl DeviceProjection {
    /// Free memory once the plan's steps so far are done: what was free at the start plus what
    /// the ledger shrank by since (or minus what it grew by).
    pub(in crate::loader) fn free(&self) -> ByteSize {
        self.free_at_start
            .saturating_add(self.start)
            .saturating_sub(self.ledger)
    }
}

/// A registry entry chosen for eviction on one device: its copies there not yet dropped. A
/// model split across devices is a victim per device; `gone` (unloaded fully) is model-wide.
pub(in crate::loader) struct Victim {
    pub(in crate::loader) model_id: u64,
    pub(in crate::loader) device: DeviceId,
    pub(in crate::loader) remaining: Vec<(usize, ByteSize, bool)>,
    pub(in crate::loader) gone: bool,
}

/// The plan under construction.
pub(in crate::loader) struct Planner<'a> {
    pub(in crate::loader) mm: &'a MemoryManager,
    pub(in crate::loader) registry: &'a [Entry],
    pub(in crate::loader) devices: Vec<DeviceProjection>,
    pub(in crate::loader) victims: Vec<Victim>,
    pub(in crate::loader) evictions: Vec<Eviction>,
    pub(in crate::loader) steps: Vec<Step>,
    /// The streamers of the models being planned: a load cancels their unused prefetches
    /// before it plans (`MemoryManager::cancel_own_prefetches`), so their bookings are free to
    /// the plan (zero by then in a load; what a dry `plan()` counts free).
    pub(in crate::loader) planned_streamers: Vec<Arc<crate::offload::Streamer>>,
}

impl<'a> Planner<'a> {
    /// `model`'s name, followed by what holds room on `device` that no plan can take (kept
    /// models, reservations, copies in flight), so an out-of-memory names them.
    pub(in crate::loader) fn naming_holders(&self, model: &str, device: DeviceId) -> String {
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
        // Copies in flight (prefetches of other models, misses, fault-ins) hold room until their
        // buffers are freed; the planned models' own prefetches are counted free.
        let own = self.own_prefetches(device);
        let in_flight = self
            .mm
            .ledger
            .in_flight(device)
            .saturating_add(self.mm.ledger.faulting(device))
            .saturating_sub(own);
        if in_flight > ByteSize::ZERO {
            held.push(format!("copies in flight ({in_flight})"));
        }
        if held.is_empty() {
            model.to_string()
        } else {
            format!("{model} (room held by {})", held.join(", "))
        }
    }

    pub(in crate::loader) fn new(mm: &'a MemoryManager, inner: &'a Inner) -> Planner<'a> {
        Planner {
            mm,
            registry: &inner.registry,
            devices: Vec::new(),
            victims: Vec::new(),
            evictions: Vec::new(),
            steps: Vec::new(),
            planned_streamers: Vec::new(),
        }
    }

    /// Counts the unused prefetches of `models`' streamers (of this manager) free; an unheld
    /// entry's streamer is counted with its entry ([`Planner::device`]).
    pub(in crate::loader) fn planning(&mut self, models: &[ModelPatcher]) {
        for m in models {
            let Some(s) = crate::offload::streamer_of(m) else {
                continue;
            };
            let unheld = self.registry.iter().any(|e| {
                !Self::held(e)
                    && crate::offload::streamer_of(&e.patcher).is_some_and(|x| Arc::ptr_eq(&x, &s))
            });
            if Arc::ptr_eq(s.engine(), &self.mm.engine)
                && !unheld
                && !self.planned_streamers.iter().any(|x| Arc::ptr_eq(x, &s))
            {
                self.planned_streamers.push(s);
            }
        }
    }

    /// Bytes the planned models' own unused prefetches have booked on `device`: free to the
    /// plan (a load cancels them before it plans).
    fn own_prefetches(&self, device: DeviceId) -> ByteSize {
        self.planned_streamers
            .iter()
            .map(|s| s.booked_on(device))
            .sum()
    }

    pub(in crate::loader) fn held(e: &Entry) -> bool {
        e.outside_handles() > 0
    }

    pub(in crate::loader) fn device(&mut self, device: DeviceId) -> &mut DeviceProjection {
        if let Some(p) = self.devices.iter().position(|d| d.device == device) {
            return &mut self.devices[p];
        }
        let before = self.mm.ledger_in(self.registry, device);
        // An entry nobody holds leaves at the load's cleanup, with its resident copies and the
        // weights its streamer prefetched (whose bookings the load waits for:
        // `MemoryManager::drop_unheld_prefetches`).
        let unheld: ByteSize = self
            .registry
            .iter()
            .filter(|e| !Self::held(e))
            .map(|e| {
                let prefetched = crate::offload::streamer_of(&e.patcher)
                    .map_or(ByteSize::ZERO, |s| s.booked_on(device));
                e.model().resident_bytes(device).saturating_add(prefetched)
            })
            .sum();
        // Unheld entries and cached casts are gone before anything else: the plan starts
        // without them.
        let cached = self.mm.cached_in(device);
        // The planned models' own prefetches (an unheld entry's are counted above).
        let own = self.own_prefetches(device);
        let start = before
            .saturating_sub(unheld)
            .saturating_sub(cached)
            .saturating_sub(own);
        let free_at_start = self
            .mm
            .free_in(self.registry, device)
            .saturating_add(unheld)
            .saturating_add(cached)
            .saturating_add(own);
        self.devices.push(DeviceProjection {
            device,
            total: self.mm.policy.total_memory(device),
            budgeted: self.mm.policy.is_budgeted(device),
            before,
            start,
            free_at_start,
            ledger: start,
            by_use_credit: ByteSize::ZERO,
        });
        self.devices.last_mut().unwrap_or_else(|| unreachable!())
    }

    /// Free memory on `device` after the steps planned so far.
    pub(in crate::loader) fn free(&mut self, device: DeviceId) -> ByteSize {
        self.device(device).free()
    }

    /// Free memory on `device` for the resident set a load's use keeps: [`Planner::free`] plus
    /// the other models' copies a classic load would have evicted, which residency by use's
    /// fault-ins evict instead (the same resident set in both modes: one rule).
    pub(in crate::loader) fn free_to_keep(&mut self, device: DeviceId) -> ByteSize {
        let d = self.device(device);
        d.free().saturating_add(d.by_use_credit)
    }

    /// Bytes on `device` a fault-in of the models in `keep` may evict: every other held,
    /// unkept model's copies there that are not pinned, of a model that is not whole.
    pub(in crate::loader) fn evictable_by_use(&self, device: DeviceId, keep: &[u64]) -> ByteSize {
        self.registry
            .iter()
            .filter(|e| {
                let id = e.model().id();
                Self::held(e)
                    && !keep.contains(&id)
                    && !self.mm.is_kept(id)
                    && !e.model().is_whole()
            })
            .map(|e| {
                let pinned: ByteSize = e
                    .model()
                    .state()
                    .resident_on(device)
                    .into_iter()
                    .filter(|r| r.2)
                    .map(|r| r.1)
                    .sum();
                self.resident_of(e, device).saturating_sub(pinned)
            })
            .sum()
    }

    pub(in crate::loader) fn add(&mut self, device: DeviceId, bytes: ByteSize) {
        let d = self.device(device);
        d.ledger = d.ledger.saturating_add(bytes);
    }

    pub(in crate::loader) fn sub(&mut self, device: DeviceId, bytes: ByteSize) {
        let d = self.device(device);
        d.ledger = d.ledger.saturating_sub(bytes);
    }

    pub(in crate::loader) fn victim(&mut self, e: &Entry, device: DeviceId) -> usize {
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
    pub(in crate::loader) fn resident_of(&self, e: &Entry, device: DeviceId) -> ByteSize {
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
    pub(in crate::loader) fn elsewhere(&self, e: &Entry, device: DeviceId) -> bool {
        let devices = e.model().state().devices();
        devices
            .into_iter()
            .any(|d| d != device && self.resident_of(e, d) > ByteSize::ZERO)
    }

    /// Plans evicting models on `device` (not in `keep`, by model id) until more than `required`
    /// bytes are free: candidates most offloaded first, then fewest outside handles, then
    /// smallest, then most recently used; with smart memory each gives up only what is missing.
    pub(in crate::loader) fn evict(&mut self, required: ByteSize, device: DeviceId, keep: &[u64]) {
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
    pub(in crate::loader) fn evict_for_room(
        &mut self,
        required: ByteSize,
        device: DeviceId,
        last: &[u64],
    ) {
        if self.mm.policy.dynamic_vram() {
            return self.evict_by_priority(required, device, last, &[]);
        }
        self.evict(required, device, last)
    }

    /// Dynamic mode's eviction: weight by weight in the one priority order of residency by use
    /// (`loader/dynamic/`: the least recently loaded model first; in a model stale weights,
    /// then the ones used later in a forward) until more than `required` bytes are free. Models
    /// in `last` go after all others; models in `keep` (being loaded) and `KeepGuard`s' never.
    pub(in crate::loader) fn evict_by_priority(
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
        let order = crate::loader::dynamic::victim_order(&models, device, |id| {
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
    pub(in crate::loader) fn into_evictions(self) -> (Vec<Eviction>, Vec<Step>) {
        (self.evictions, self.steps)
    }
}

/// Whether model `m` is in the registry (and held).
pub(in crate::loader) fn registered(registry: &[Entry], m: &Arc<Model>) -> bool {
    registry
        .iter()
        .any(|e| Arc::ptr_eq(e.model(), m) && Planner::held(e))
}
