//! Freeing room: [`MemoryManager::free_memory`], unloading everything, and dropping models no
//! handle reaches any more.

use std::sync::Arc;

use super::*;
use crate::offload::PrefetchGate;

/// How long a load waits for the copies its models' last forward used to return their
/// bookings ([`MemoryManager::cancel_own_prefetches`]): a queued free runs within a copy's time;
/// a forward of the same model running meanwhile would hold them for its whole step.
const OWN_BOOKINGS_WAIT_MS: u64 = 200;

/// How long that wait goes on without a booking coming back before it stops.
const OWN_BOOKINGS_SLICE_MS: u64 = 5;

impl MemoryManager {
    /// Evicts models on `device` (not in `keep_loaded`, by model id) until more than `required`
    /// bytes are free. Returns what was evicted.
    pub fn free_memory(
        &self,
        required: ByteSize,
        device: DeviceId,
        keep_loaded: &[&ModelPatcher],
    ) -> Vec<Eviction> {
        let keep: Vec<u64> = keep_loaded.iter().map(|m| m.model().id()).collect();
        let mut inner = self.lock_inner();
        // No fault-in refills the room being freed, or keeps a copy of a model leaving the
        // registry, until the call is done.
        self.close_all(&mut inner);
        cleanup(&mut inner);
        let _span =
            tracing::debug_span!("free_memory", %device, required = required.bytes()).entered();
        let evictions = self.make_room(&mut inner, required, device, &keep, false);
        let stale = Self::take_stale(&mut inner);
        drop(inner);
        drop(stale);
        evictions
    }

    /// Dynamic mode's last resort for an out-of-memory (`retry_on_oom`): [`MemoryManager::free_memory`]
    /// where the models kept loaded go last instead of never — their weights stream then, so
    /// weights never cause an out-of-memory.
    pub(crate) fn free_memory_under_pressure(
        &self,
        required: ByteSize,
        device: DeviceId,
        last: &[&ModelPatcher],
    ) -> Vec<Eviction> {
        let last: Vec<u64> = last.iter().map(|m| m.model().id()).collect();
        let mut inner = self.lock_inner();
        self.close_all(&mut inner);
        cleanup(&mut inner);
        let _span =
            tracing::debug_span!("free_memory", %device, required = required.bytes()).entered();
        let evictions = self.make_room_ordered(&mut inner, required, device, &last, false, true);
        let stale = Self::take_stale(&mut inner);
        drop(inner);
        drop(stale);
        evictions
    }

    /// Frees memory on `device` towards more than `required` free: cached casts first, then the
    /// planner's evictions of models not in `keep` (nor kept by a guard). With `all_or_nothing`
    /// the evictions are carried out only when they reach `required` (a caller that fails
    /// otherwise evicts nothing). Returns what was evicted. Runs under the manager lock.
    pub(super) fn make_room(
        &self,
        inner: &mut Inner,
        required: ByteSize,
        device: DeviceId,
        keep: &[u64],
        all_or_nothing: bool,
    ) -> Vec<Eviction> {
        self.make_room_ordered(inner, required, device, keep, all_or_nothing, false)
    }

    /// [`MemoryManager::make_room`]; with `keep_goes_last` (dynamic mode) the `keep` models'
    /// weights go after every other's instead of never.
    pub(super) fn make_room_ordered(
        &self,
        inner: &mut Inner,
        required: ByteSize,
        device: DeviceId,
        keep: &[u64],
        all_or_nothing: bool,
        keep_goes_last: bool,
    ) -> Vec<Eviction> {
        self.drop_casts(inner, device);
        if self.free_in(&inner.registry, device) < required {
            self.cancel_prefetches(inner, device);
            if all_or_nothing && self.free_in(&inner.registry, device) >= required {
                // The prefetches were the room: no model gives anything up.
                self.refresh_ledger(inner);
                return Vec::new();
            }
        }
        let mut planner = plan::Planner::new(self, inner);
        if keep_goes_last {
            planner.evict_for_room(required, device, keep);
        } else {
            planner.evict(required, device, keep);
        }
        if all_or_nothing && planner.free(device) < required {
            return Vec::new();
        }
        let (evictions, steps) = planner.into_evictions();
        let mut undo = execute::Undo::new(inner);
        self.execute_evictions(inner, &steps, &evictions, "free_memory", &mut undo);
        execute::log_evictions(&evictions);
        self.refresh_ledger(inner);
        evictions
    }

    /// Cancels the unused prefetches bound for `device` (the second thing room is taken from,
    /// after cached casts and before any model) and waits — under the manager lock, which may
    /// wait — until their bookings came back: each returns once its buffer's free executed, so
    /// the room is the device's before it is counted free.
    pub(super) fn cancel_prefetches(&self, inner: &Inner, device: DeviceId) {
        let streamers = inner
            .registry
            .iter()
            .filter_map(|e| crate::offload::streamer_of(&e.patcher));
        self.cancel_prefetches_of(streamers, device);
    }

    /// Cancels the unused prefetches of the models a load is about to plan, on the devices
    /// they load on: a reload's plan then sees the room a first load saw (it counted the
    /// model's own prefetches as taken, and gave it a smaller streaming window and resident
    /// set than its first load); the next forward fetches them again. Then waits, briefly, for
    /// the rest of what the models' streamers booked there: the copies their last forward used,
    /// whose stream-ordered frees may still be queued behind copies (counted taken, they left a
    /// plan made right after a step less room than one made a moment later, and the planner
    /// weighed every prefetch depth alike in 3-4 loads of 18 on the planner bench).
    pub(super) fn cancel_own_prefetches(&self, all: &[ModelPatcher]) {
        for m in all {
            let Some(s) = crate::offload::streamer_of(m) else {
                continue;
            };
            if !Arc::ptr_eq(s.engine(), &self.engine) {
                continue;
            }
            for device in m.devices() {
                if s.booked_on(device) > ByteSize::ZERO {
                    self.cancel_prefetches_of(std::iter::once(Arc::clone(&s)), device);
                }
                self.wait_own_bookings(&s, device);
            }
        }
    }

    /// Waits while `s`'s bookings on `device` come back: at most [`OWN_BOOKINGS_WAIT_MS`], and
    /// no longer than [`OWN_BOOKINGS_SLICE_MS`] without one coming back — a booking held by a
    /// live tensor (the engine's, or a forward of the same model on another thread) is not
    /// waited for; a queued free comes back within a copy's time.
    fn wait_own_bookings(&self, s: &crate::offload::Streamer, device: DeviceId) {
        if s.outstanding_on(device) == ByteSize::ZERO {
            return;
        }
        // No new booking meanwhile: in flight can only fall.
        let _closed = self.ledger.loading(&[device]);
        let deadline =
            std::time::Instant::now() + std::time::Duration::from_millis(OWN_BOOKINGS_WAIT_MS);
        while s.outstanding_on(device) > ByteSize::ZERO && std::time::Instant::now() < deadline {
            let seen = self.ledger.returns();
            self.ledger.wait_returned(
                seen,
                std::time::Duration::from_millis(OWN_BOOKINGS_SLICE_MS),
            );
            if self.ledger.returns() == seen {
                break;
            }
        }
    }

    /// Cancels `streamers`' unused prefetches bound for `device` and waits until their
    /// bookings came back ([`MemoryManager::cancel_prefetches`]).
    fn cancel_prefetches_of(
        &self,
        streamers: impl Iterator<Item = Arc<crate::offload::Streamer>>,
        device: DeviceId,
    ) {
        // No new prefetch books on the device meanwhile: in flight can only fall from here.
        let _closed = self.ledger.loading(&[device]);
        let before = self.ledger.in_flight(device);
        let cancelled: ByteSize = streamers.map(|s| s.cancel_on(device)).sum();
        if cancelled == ByteSize::ZERO {
            return;
        }
        let target = before.saturating_sub(cancelled);
        if !self
            .ledger
            .wait_in_flight(device, target, std::time::Duration::from_secs(10))
        {
            tracing::warn!(%device, %cancelled, "cancelled prefetches did not return their bookings in 10 s");
        }
    }

    /// Unloads every model from every device; the registry is emptied.
    pub fn unload_all_models(&self) -> usize {
        let mut inner = self.lock_inner();
        // A fault-in in flight must not commit a copy after its model left (the ledger is
        // refreshed to what is registered: nothing).
        self.close_all(&mut inner);
        let n = inner.registry.len();
        let entries: Vec<Entry> = inner.registry.drain(..).collect();
        for e in entries {
            e.patcher.detach();
            crate::offload::attach_streamer(&e.patcher, None);
            inner.unloaded.push(Arc::clone(e.model()));
        }
        if let Some(pool) = &inner.pool {
            pool.trim();
        }
        self.refresh_ledger(&inner);
        let stale = Self::take_stale(&mut inner);
        drop(inner);
        drop(stale);
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
        let mut inner = self.lock_inner();
        self.close_all(&mut inner);
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
        self.refresh_ledger(&inner);
        let stale = Self::take_stale(&mut inner);
        drop(inner);
        drop(stale);
    }

    /// Drops the weights prefetched for models no handle holds (their entries leave at the
    /// cleanup the caller's call begins with) and waits, at most 100 ms and outside the manager
    /// lock, until their bookings are back: a weight dropped unused returns its booking only
    /// once its device buffer's free has executed, in stream order. [`MemoryManager::plan`]
    /// counts those bytes free; without the wait, the load that follows it would see them booked
    /// or free depending on whether a stream had run the free yet, and could place a model on
    /// another device than its plan said.
    pub(super) fn drop_unheld_prefetches(&self) {
        let mut waits: Vec<(DeviceId, ByteSize)> = Vec::new();
        {
            let inner = self.lock_inner();
            let streamers: Vec<Arc<crate::offload::Streamer>> = inner
                .registry
                .iter()
                .filter(|e| e.outside_handles() == 0)
                .filter_map(|e| crate::offload::streamer_of(&e.patcher))
                .collect();
            if streamers.is_empty() {
                return;
            }
            let devices: Vec<DeviceId> = self.ledger.devices();
            for d in devices {
                let booked: ByteSize = streamers.iter().map(|s| s.booked_on(d)).sum();
                if booked > ByteSize::ZERO {
                    // The column once they are back (other threads' bookings may move it too:
                    // the wait is bounded).
                    waits.push((d, self.ledger.in_flight(d).saturating_sub(booked)));
                }
            }
            for s in &streamers {
                s.clear();
            }
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_millis(100);
        for (d, target) in waits {
            loop {
                let seen = self.ledger.returns();
                let now = std::time::Instant::now();
                if self.ledger.in_flight(d) <= target || now >= deadline {
                    break;
                }
                self.ledger.wait_returned(seen, deadline - now);
            }
        }
    }
}

pub(super) fn cleanup(inner: &mut Inner) {
    let mut dropped = Vec::new();
    inner.registry.retain(|e| {
        let keep = e.outside_handles() > 0;
        if !keep {
            e.patcher.detach();
            crate::offload::attach_streamer(&e.patcher, None);
            tracing::debug!(model = e.model().name(), "dropped: no patcher left");
            dropped.push(Arc::clone(e.model()));
        }
        keep
    });
    inner.unloaded.extend(dropped);
}
