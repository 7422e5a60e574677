//! Where a model the manager places goes (docs/ARCHITECTURE.md §5.1).
//!
//! A patcher made with [`crate::ModelPatcher::with_auto_device`] leaves its load device to the
//! manager. Before planning, each such model of a load is fixed on one scheduled GPU (simulated
//! GPUs when given, else CUDA devices), in this order of preference:
//!
//! 1. the device holding most of its current resident copies (a reload moves nothing);
//! 2. a device where it fits without evicting anything: the one with the most free memory
//!    (ties: the lowest ordinal);
//! 3. the device where eviction costs least: the fewest bytes of other models to give up, among
//!    devices where enough can be given up (kept models and reservations cannot), ties by the
//!    lowest ordinal; when no device can make room, the one with the largest total (the model
//!    loads partially there).
//!
//! Models placed earlier in the same call count against the device they were placed on. The
//! decision is a function of the registry and the ledgers, so [`crate::MemoryManager::plan`]
//! shows it ([`crate::loader::PlannedLoad::device`]) and the load makes the same one.
//!
//! Complexity: O(devices × (weights of the model + registry)).

use super::{Entry, Inner, MemoryManager};
use crate::patcher::ModelPatcher;
use crate::size::ByteSize;
use crate::vram::DeviceId;

impl MemoryManager {
    /// The scheduled GPUs a model can be placed on, in ordinal order.
    pub(super) fn placement_devices(&self) -> Vec<DeviceId> {
        let sims = self.engine.devices().sims().len();
        if sims > 0 {
            return (0..sims).map(DeviceId::Sim).collect();
        }
        self.policy
            .hardware()
            .gpus
            .iter()
            .map(|g| DeviceId::Cuda(g.ordinal))
            .filter(|&d| self.policy.is_scheduled(d))
            .collect()
    }

    /// Replaces every auto-placed patcher of `all` by a handle fixed on its chosen device, and
    /// returns the originals with their choices (to record once the load succeeded).
    pub(super) fn place_auto(
        &self,
        inner: &Inner,
        all: &mut [ModelPatcher],
    ) -> Vec<(ModelPatcher, DeviceId)> {
        let mut chosen_for = Vec::new();
        if !all.iter().any(ModelPatcher::is_auto_device) {
            return chosen_for;
        }
        let devices = self.placement_devices();
        if devices.is_empty() {
            return chosen_for;
        }
        let in_call: Vec<u64> = all.iter().map(|m| m.model().id()).collect();
        let mut added: Vec<ByteSize> = vec![ByteSize::ZERO; devices.len()];
        // Free as the planner counts it: entries nobody holds are gone and cached casts are the
        // first thing a load gives up (so `plan` and the load, which cleans up first, place
        // alike).
        let mut planner = super::plan::Planner::new(self, inner);
        for m in all.iter_mut() {
            if !m.is_auto_device() {
                continue;
            }
            let size = m.resident_model_size();
            let current: Vec<ByteSize> = devices
                .iter()
                .map(|&d| m.placed_on(d).loaded_size())
                .collect();
            let free: Vec<ByteSize> = devices
                .iter()
                .zip(&added)
                .map(|(&d, a)| planner.free(d).saturating_sub(*a))
                .collect();
            let need = |k: usize| {
                size.saturating_sub(current[k])
                    .saturating_add(self.policy.minimum_inference_memory_on(devices[k]))
            };
            let chosen = best(&current, |c| *c > ByteSize::ZERO, |k| current[k])
                .or_else(|| {
                    let fits: Vec<bool> = (0..devices.len()).map(|k| free[k] >= need(k)).collect();
                    best(&fits, |&f| f, |k| free[k])
                })
                .or_else(|| {
                    (0..devices.len())
                        .filter_map(|k| {
                            let missing = need(k).saturating_sub(free[k]);
                            let evictable =
                                self.evictable_on(&inner.registry, devices[k], &in_call);
                            (evictable >= missing).then_some((missing, k))
                        })
                        .min()
                        .map(|(_, k)| k)
                })
                .unwrap_or_else(|| {
                    best(&devices, |_| true, |k| self.policy.total_memory(devices[k])).unwrap_or(0)
                });
            added[chosen] = added[chosen].saturating_add(size.saturating_sub(current[chosen]));
            tracing::debug!(model = m.model().name(), device = %devices[chosen], "placed");
            chosen_for.push((m.same_handle(), devices[chosen]));
            *m = m.placed_on(devices[chosen]);
        }
        chosen_for
    }

    /// Bytes of held, unkept models not in `in_call` resident on `device`: what eviction could
    /// give up there (cached casts are already counted free).
    fn evictable_on(&self, registry: &[Entry], device: DeviceId, in_call: &[u64]) -> ByteSize {
        registry
            .iter()
            .filter(|e| e.outside_handles() > 0)
            .filter(|e| !in_call.contains(&e.model().id()) && !self.is_kept(e.model().id()))
            .map(|e| e.model().resident_bytes(device))
            .sum()
    }
}

/// The index among `items` passing `ok` with the largest `key`, ties to the lowest index.
fn best<T, K: Ord>(
    items: &[T],
    ok: impl Fn(&T) -> bool,
    key: impl Fn(usize) -> K,
) -> Option<usize> {
    let mut out: Option<(usize, K)> = None;
    for (k, item) in items.iter().enumerate() {
        if !ok(item) {
            continue;
        }
        let v = key(k);
        if out.as_ref().is_none_or(|(_, b)| v > *b) {
            out = Some((k, v));
        }
    }
    out.map(|(k, _)| k)
}
