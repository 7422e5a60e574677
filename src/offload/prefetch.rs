//! Prefetching streamed weights in forward order.
//!
//! A [`Streamer`] is attached to a partially loaded model. The first forward records the order
//! in which weights are fetched ([`crate::weights::Model::forward_order`]); on every later fetch
//! of a streamed weight the streamer requests the next `depth` streamed weights of that order
//! (wrapping around to the start, so the next step's first weights arrive during this step's
//! last layers) while the current layer computes, within a cap on bytes in flight.
//!
//! Every prefetched weight holds a reservation on a [`PrefetchGate`] (the memory manager's ledger)
//! from the moment it is requested until it is used or dropped: the gate refuses a reservation
//! that would take the device's ledger past its budget (less the activation memory the last load
//! asked to keep free), so bytes in flight stay within what is free at every moment, whatever
//! else loads meanwhile. A refused prefetch is not an error: that weight is fetched when used.
//!
//! Correctness never depends on the order being right: an in-flight fetch is keyed by weight,
//! fingerprint (patch list), dtype and device, and is only used when all four match the request.
//! Anything else is a miss and is fetched synchronously — a different branch, a different clone
//! or a changed model costs time, never a wrong weight.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use crate::lock::{Mutex, Rank};
use candle_core::Tensor;

use super::engine::{Pending, TransferEngine};
use crate::error::Result;
use crate::float::Dtype;
use crate::patcher::ModelPatcher;
use crate::size::ByteSize;
use crate::vram::DeviceId;
use crate::weights::Fingerprint;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FetchKey {
    index: usize,
    fingerprint: Fingerprint,
    dtype: Dtype,
    device: DeviceId,
}

/// A prefetched weight; its ledger booking travels inside `pending` (returned when the weight
/// is used, or after its device buffer's free when it is dropped unused).
struct InFlight {
    key: FetchKey,
    pending: Pending,
}

/// Where prefetched bytes are booked: the memory manager's ledger implements it.
pub trait PrefetchGate: Send + Sync {
    /// Books `bytes` in flight on `device` when its ledger plus `bytes` plus `keep_free` stays
    /// within its budget; returns whether it did.
    fn try_reserve(&self, device: DeviceId, bytes: ByteSize, keep_free: ByteSize) -> bool;
    /// Returns bytes booked by [`PrefetchGate::try_reserve`].
    fn release(&self, device: DeviceId, bytes: ByteSize);
}

/// Bytes booked on a gate, returned when dropped.
pub(crate) struct Reservation {
    gate: Arc<dyn PrefetchGate>,
    device: DeviceId,
    bytes: ByteSize,
}

impl Reservation {
    /// Books `bytes` on `gate` for `device`, keeping `keep_free` free; `None` when refused.
    pub(crate) fn take(
        gate: &Arc<dyn PrefetchGate>,
        device: DeviceId,
        bytes: ByteSize,
        keep_free: ByteSize,
    ) -> Option<Reservation> {
        gate.try_reserve(device, bytes, keep_free)
            .then(|| Reservation {
                gate: Arc::clone(gate),
                device,
                bytes,
            })
    }

    /// The bytes booked.
    pub(crate) fn bytes(&self) -> ByteSize {
        self.bytes
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.gate.release(self.device, self.bytes);
    }
}

struct Gate {
    gate: Arc<dyn PrefetchGate>,
    keep_free: ByteSize,
}

/// Per-model prefetch state on top of a shared [`TransferEngine`].
pub struct Streamer {
    engine: Arc<TransferEngine>,
    depth: AtomicUsize,
    cap: AtomicU64,
    gate: Mutex<Option<Gate>>,
    inflight: Mutex<VecDeque<InFlight>>,
}

impl std::fmt::Debug for Streamer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Streamer")
            .field("depth", &self.depth())
            .field("in_flight", &self.in_flight_bytes())
            .finish()
    }
}

impl Streamer {
    /// A streamer prefetching `depth` weights ahead, with at most `cap` bytes in flight.
    pub fn new(engine: Arc<TransferEngine>, depth: usize, cap: ByteSize) -> Streamer {
        Streamer {
            engine,
            depth: AtomicUsize::new(depth),
            cap: AtomicU64::new(cap.bytes()),
            gate: Mutex::new(Rank::StreamerGate, None),
            inflight: Mutex::new(Rank::StreamerQueue, VecDeque::new()),
        }
    }

    /// The engine.
    pub fn engine(&self) -> &Arc<TransferEngine> {
        &self.engine
    }
    /// How many streamed weights are requested ahead.
    pub fn depth(&self) -> usize {
        self.depth.load(Ordering::Relaxed)
    }
    /// Sets the depth (0 disables prefetching).
    pub fn set_depth(&self, depth: usize) {
        self.depth.store(depth, Ordering::Relaxed);
    }
    /// Sets the cap on bytes in flight.
    pub fn set_cap(&self, cap: ByteSize) {
        self.cap.store(cap.bytes(), Ordering::Relaxed);
    }
    /// Books every prefetch on `gate` from now on, keeping `keep_free` bytes of the device free
    /// (the activation memory of the coming forward); `None` removes the gate.
    pub fn set_gate(&self, gate: Option<(Arc<dyn PrefetchGate>, ByteSize)>) {
        *self.gate.lock() = gate.map(|(gate, keep_free)| Gate { gate, keep_free });
    }
    /// Bytes of prefetched weights not yet used.
    pub fn in_flight_bytes(&self) -> ByteSize {
        self.inflight.lock().iter().map(|f| f.pending.bytes()).sum()
    }
    /// Drops every prefetched weight.
    pub fn clear(&self) {
        let dropped = std::mem::take(&mut *self.inflight.lock());
        drop(dropped);
    }

    /// Drops the prefetched weights bound for `device`; returns their bytes. Their bookings
    /// come back once each one's device buffer is freed (stream-ordered).
    pub fn cancel_on(&self, device: DeviceId) -> ByteSize {
        let dropped: Vec<InFlight> = {
            let mut q = self.inflight.lock();
            let (gone, kept): (Vec<InFlight>, Vec<InFlight>) =
                q.drain(..).partition(|f| f.key.device == device);
            q.extend(kept);
            gone
        };
        dropped.iter().map(|f| f.pending.bytes()).sum()
    }

    fn key(patcher: &ModelPatcher, index: usize) -> FetchKey {
        FetchKey {
            index,
            fingerprint: patcher.fingerprint(index),
            dtype: patcher.resident_dtype(index),
            device: patcher.weight_device(index),
        }
    }

    /// Fetches streamed weight `index`: from a matching prefetch (hit) or synchronously (miss);
    /// then requests the next weights of the recorded order.
    pub fn fetch(&self, patcher: &ModelPatcher, index: usize) -> Result<Tensor> {
        let key = Streamer::key(patcher, index);
        let found = {
            let mut q = self.inflight.lock();
            // Entries for this weight with another key are stale: drop them.
            q.retain(|f| f.key.index != index || f.key == key);
            q.iter()
                .position(|f| f.key == key)
                .and_then(|p| q.remove(p))
        };
        let stats = self.engine.stats();
        let weight = match found {
            Some(f) => match f.pending.wait() {
                Ok(t) => {
                    tracing::debug!(model = patcher.model().name(), weight = index, "hit");
                    stats.hit();
                    t
                }
                // A failed prefetch (a lane's copy or allocation failed) costs time, never the
                // forward: the weight is fetched now, on this thread.
                Err(e) => {
                    tracing::debug!(error = %e, weight = index, "a prefetch failed; fetching now");
                    tracing::debug!(model = patcher.model().name(), weight = index, "miss");
                    stats.miss();
                    let t0 = std::time::Instant::now();
                    let t = self.engine.fetch_now(patcher, index)?;
                    stats.waited(t0.elapsed().as_nanos() as u64);
                    t
                }
            },
            None => {
                tracing::debug!(model = patcher.model().name(), weight = index, "miss");
                stats.miss();
                let t0 = std::time::Instant::now();
                let t = self.engine.fetch_now(patcher, index)?;
                stats.waited(t0.elapsed().as_nanos() as u64);
                t
            }
        };
        self.prefetch_after(patcher, index);
        Ok(weight)
    }

    fn prefetch_after(&self, patcher: &ModelPatcher, index: usize) {
        let depth = self.depth();
        if depth == 0 || self.engine.lanes() == 0 {
            return;
        }
        let (order, complete) = patcher.model().forward_order();
        if !complete || order.is_empty() {
            return;
        }
        let Some(pos) = order.iter().position(|&i| i == index) else {
            return;
        };
        let cap = ByteSize(self.cap.load(Ordering::Relaxed));
        let mut q = self.inflight.lock();
        let mut requested = 0;
        for step in 1..order.len() {
            if requested >= depth {
                break;
            }
            let next = order[(pos + step) % order.len()];
            if patcher.resident_tensor(next).is_some() {
                continue;
            }
            let key = Streamer::key(patcher, next);
            requested += 1;
            if q.iter().any(|f| f.key == key) {
                continue;
            }
            let bytes = patcher.resident_size(next);
            let in_flight: ByteSize = q.iter().map(|f| f.pending.bytes()).sum();
            if in_flight.saturating_add(bytes) > cap {
                break;
            }
            let reservation = match &*self.gate.lock() {
                Some(g) => match Reservation::take(&g.gate, key.device, bytes, g.keep_free) {
                    Some(r) => Some(r),
                    None => break,
                },
                None => None,
            };
            let pending = self.engine.submit_booked(patcher, next, reservation);
            q.push_back(InFlight { key, pending });
        }
        // Never hold more than a few rounds of unused prefetches (a branch not taken).
        while q.len() > 2 * depth + 2 {
            q.pop_front();
        }
    }
}
