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

mod bookings;
mod miss;

use super::engine::{Pending, TransferEngine};
use super::Keeper;
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
    /// Bytes booked on the gate for it (0: unbooked), returned once its copy is used or, dropped
    /// unused, once its device buffer's free has executed.
    booked: ByteSize,
    /// Requested from a routing (`prefetch_routed`), not predicted from use.
    routed: bool,
}

/// What [`Streamer::submit`] did with a weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Submitted {
    /// Its copy was queued.
    Queued,
    /// Nothing to do: in flight already, or it runs on the host.
    Skipped,
    /// No room (the cap or the gate): the caller stops.
    Refused,
}

/// Where prefetched bytes are booked: the memory manager's ledger implements it.
pub trait PrefetchGate: Send + Sync {
    /// Books `bytes` in flight on `device` when its ledger plus `bytes` plus `keep_free` stays
    /// within its budget; returns whether it did.
    fn try_reserve(&self, device: DeviceId, bytes: ByteSize, keep_free: ByteSize) -> bool;
    /// Returns bytes booked by [`PrefetchGate::try_reserve`].
    fn release(&self, device: DeviceId, bytes: ByteSize);
    /// A booking spent without being returned: its bytes now count as what the gate made of
    /// them (a prefetched weight kept resident). The default does nothing.
    fn absorbed(&self, device: DeviceId, bytes: ByteSize) {
        let _ = (device, bytes);
    }
    /// Whether bookings on `device` are closed now (a load is planned or executed there).
    fn is_closed(&self, device: DeviceId) -> bool {
        let _ = device;
        false
    }
    /// Bytes booked in flight on `device` now (what may come back to a waiter).
    fn booked_in_flight(&self, device: DeviceId) -> ByteSize {
        let _ = device;
        ByteSize::ZERO
    }
    /// [`PrefetchGate::try_reserve`], waiting up to `timeout` for bookings to come back when
    /// there is no room now (the default does not wait).
    fn reserve_waiting(
        &self,
        device: DeviceId,
        bytes: ByteSize,
        keep_free: ByteSize,
        timeout: std::time::Duration,
    ) -> bool {
        let _ = timeout;
        self.try_reserve(device, bytes, keep_free)
    }
    /// Waits until a booking comes back or a kept copy leaves a device, at most `timeout`;
    /// returns at once when one did since [`PrefetchGate::returns`] gave `seen`. The default
    /// does not wait.
    fn wait_returned(&self, seen: u64, timeout: std::time::Duration) {
        let _ = (seen, timeout);
    }
    /// How many times a booking came back or a kept copy left a device so far (for
    /// [`PrefetchGate::wait_returned`]).
    fn returns(&self) -> u64 {
        0
    }
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

    /// [`Reservation::take`], waiting up to `timeout` for room to come back.
    pub(crate) fn take_waiting(
        gate: &Arc<dyn PrefetchGate>,
        device: DeviceId,
        bytes: ByteSize,
        keep_free: ByteSize,
        timeout: std::time::Duration,
    ) -> Option<Reservation> {
        gate.reserve_waiting(device, bytes, keep_free, timeout)
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

    /// The device booked on.
    pub(crate) fn device(&self) -> DeviceId {
        self.device
    }

    /// Gives the booking up without returning it: its bytes now belong to what the gate counts
    /// them as (a prefetched weight kept resident).
    pub(crate) fn absorb(mut self) {
        self.gate.absorbed(self.device, self.bytes);
        self.bytes = ByteSize::ZERO;
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
    /// Residency by use: what keeps fetched weights, and the room left free beside them.
    keeper: Option<(Arc<dyn Keeper>, ByteSize)>,
}

/// Per-model prefetch state on top of a shared [`TransferEngine`].
pub struct Streamer {
    engine: Arc<TransferEngine>,
    depth: AtomicUsize,
    cap: AtomicU64,
    gate: Mutex<Option<Gate>>,
    inflight: Mutex<VecDeque<InFlight>>,
    /// The manager's cost-aware misses, when on (`--cost-aware-misses`).
    misses: once_cell::sync::OnceCell<Arc<super::MissCosts>>,
    /// The cost model synchronous fetches are timed into (`crate::costs`).
    costs: once_cell::sync::OnceCell<Arc<crate::costs::CostModel>>,
    /// This model's prepared host copies, with cost-aware misses ([`super::PreparedCopies`]).
    prepared: once_cell::sync::OnceCell<super::PreparedCopies>,
    /// The input rows of the latest matmul a weight was fetched for (what a prefetch predicted
    /// from use will most likely run on).
    last_rows: AtomicUsize,
    /// What its gates booked and was not returned yet ([`Streamer::outstanding_on`]).
    outstanding: Arc<bookings::Outstanding>,
}

/// A streamed fetch's result: the weight on its device, or — a cost-aware miss run on the host —
/// its clean host copy, not copied, or the prepared copy an earlier host run kept.
pub(crate) enum Fetch {
    Device(Tensor),
    Host(Tensor),
    Prepared(Arc<candle_core::quantized::QTensor>),
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
            misses: once_cell::sync::OnceCell::new(),
            costs: once_cell::sync::OnceCell::new(),
            prepared: once_cell::sync::OnceCell::new(),
            last_rows: AtomicUsize::new(1),
            outstanding: Arc::new(bookings::Outstanding::new()),
        }
    }

    /// Turns cost-aware misses on for this streamer's model, with the manager's figures (once:
    /// later calls keep the first).
    /// Times this streamer's synchronous fetches into `costs` (the first one given stays).
    pub(crate) fn set_costs(&self, costs: Arc<crate::costs::CostModel>) {
        let _ = self.costs.set(costs);
    }

    pub(crate) fn set_misses(&self, costs: Arc<super::MissCosts>) {
        let _ = self
            .prepared
            .set(super::PreparedCopies::new(Arc::clone(costs.prepared())));
        let _ = self.misses.set(costs);
    }

    /// Keeps `q`, the `QTensor` a host run of weight `index` built from its clean host copy, for
    /// the next host runs when the prepared copies have room ([`super::PreparedCopies::offer`]).
    /// Whether it was kept.
    pub(crate) fn offer_prepared(
        &self,
        patcher: &ModelPatcher,
        index: usize,
        q: &Arc<candle_core::quantized::QTensor>,
    ) -> bool {
        self.prepared.get().is_some_and(|p| {
            let bytes = patcher.model().slots()[index].bytes();
            p.offer(index, q, bytes, |i| patcher.resident_weight(i).is_some())
        })
    }

    /// The cost-aware misses' figures, when on.
    pub(crate) fn misses(&self) -> Option<&Arc<super::MissCosts>> {
        self.misses.get()
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
        *self.gate.lock() = gate.map(|(gate, keep_free)| Gate {
            gate: Arc::new(bookings::Counted {
                inner: gate,
                outstanding: Arc::clone(&self.outstanding),
            }),
            keep_free,
            keeper: None,
        });
    }

    /// Makes fetched weights resident by use through `keeper`, leaving `room` free beside what
    /// it keeps (a gate must be set; `None` stops keeping).
    pub(crate) fn set_keeper(&self, keeper: Option<(Arc<dyn Keeper>, ByteSize)>) {
        if let Some(g) = self.gate.lock().as_mut() {
            g.keeper = keeper;
        }
    }

    fn keeper(&self) -> Option<(Arc<dyn Keeper>, ByteSize)> {
        self.gate
            .lock()
            .as_ref()
            .and_then(|g| g.keeper.as_ref().map(|(k, room)| (Arc::clone(k), *room)))
    }

    /// Notes a use of weight `index` served by its resident copy.
    pub(crate) fn note_hit(&self, patcher: &ModelPatcher, index: usize) {
        if let Some((k, _)) = self.keeper() {
            k.note_use(patcher, index, true);
        }
    }
    /// Bytes of prefetched weights not yet used.
    pub fn in_flight_bytes(&self) -> ByteSize {
        self.inflight.lock().iter().map(|f| f.pending.bytes()).sum()
    }
    /// Bytes booked on the gate for prefetched weights bound for `device` not yet used: what
    /// comes back to the ledger's in-flight column once they are dropped and their buffers freed.
    pub(crate) fn booked_on(&self, device: DeviceId) -> ByteSize {
        self.inflight
            .lock()
            .iter()
            .filter(|f| f.key.device == device)
            .map(|f| f.booked)
            .sum()
    }

    /// Bytes booked through this streamer's gate for `device` and not returned yet: its unused
    /// prefetches ([`Streamer::booked_on`]) and the copies its forwards used whose buffers are
    /// not freed yet (a stream-ordered free runs after the copies queued before it).
    pub(crate) fn outstanding_on(&self, device: DeviceId) -> ByteSize {
        self.outstanding.on(device)
    }

    /// Drops every prefetched weight.
    pub fn clear(&self) {
        let dropped = std::mem::take(&mut *self.inflight.lock());
        drop(dropped);
    }

    /// Drops the prefetched weights bound for `device`; returns the bytes they had booked on
    /// the gate (an unbooked prefetch returns nothing to wait for). Those bookings come back
    /// once each one's device buffer is freed (stream-ordered).
    pub fn cancel_on(&self, device: DeviceId) -> ByteSize {
        let dropped: Vec<InFlight> = {
            let mut q = self.inflight.lock();
            let (gone, kept): (Vec<InFlight>, Vec<InFlight>) =
                q.drain(..).partition(|f| f.key.device == device);
            q.extend(kept);
            gone
        };
        dropped.iter().map(|f| f.booked).sum()
    }

    /// Drops the prefetched weights predicted from use (bound for `device`, or for any), keeping
    /// those a routing asked for (a layer's routed experts are about to run: a miss in that
    /// layer must not trim them); the bytes they had booked on the gate.
    pub(crate) fn drop_predicted_on(&self, device: Option<DeviceId>) -> ByteSize {
        let dropped: Vec<InFlight> = {
            let mut q = self.inflight.lock();
            let (gone, kept): (Vec<InFlight>, Vec<InFlight>) = q
                .drain(..)
                .partition(|f| !f.routed && device.is_none_or(|d| f.key.device == d));
            q.extend(kept);
            gone
        };
        dropped.iter().map(|f| f.booked).sum()
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
    /// then requests the next weights predicted from use. With a keeper (dynamic mode) the copy
    /// is kept resident when there is room, or room can be made by the priority order.
    pub fn fetch(&self, patcher: &ModelPatcher, index: usize) -> Result<Tensor> {
        match self.fetch_for(patcher, index, None)? {
            Fetch::Device(t) | Fetch::Host(t) => Ok(t),
            // Only a quantized weight's fetch for a matmul (`host` given) runs on the host.
            Fetch::Prepared(_) => Err(crate::error::Error::BadWeight {
                model: patcher.model().name().to_string(),
                key: patcher.model().slots()[index].name().to_string(),
                reason: "a prepared host copy for a fetch that does not run on the host".into(),
            }),
        }
    }

    /// [`Streamer::fetch`]; with `host` (the weight's GGML format and the rows of the matmul it
    /// is fetched for) and cost-aware misses on, a miss that is not kept may run on the host
    /// instead ([`super::MissCosts::choose`]): its clean host copy is returned, nothing copied.
    pub(crate) fn fetch_for(
        &self,
        patcher: &ModelPatcher,
        index: usize,
        host: Option<(candle_core::quantized::GgmlDType, usize)>,
    ) -> Result<Fetch> {
        if let Some((_, rows)) = host {
            self.last_rows.store(rows, Ordering::Relaxed);
        }
        let key = Streamer::key(patcher, index);
        let found = {
            let mut q = self.inflight.lock();
            // Entries for this weight with another key are stale: drop them.
            q.retain(|f| f.key.index != index || f.key == key);
            q.iter()
                .position(|f| f.key == key)
                .and_then(|p| q.remove(p))
        };
        let keeper = self.keeper();
        let stats = self.engine.stats();
        let prefetched = match found {
            Some(f) => {
                let t0 = std::time::Instant::now();
                let routed = f.routed;
                match f.pending.wait_parts() {
                    Ok(parts) => {
                        tracing::debug!(model = patcher.model().name(), weight = index, "hit");
                        stats.hit();
                        stats.hit_waited(t0.elapsed().as_nanos() as u64, routed);
                        Some(parts)
                    }
                    // A failed prefetch (a lane's copy or allocation failed) costs time, never the
                    // forward: the weight is fetched now, on this thread.
                    Err(e) => {
                        tracing::debug!(error = %e, weight = index, "a prefetch failed; fetching now");
                        None
                    }
                }
            }
            None => None,
        };
        let weight = match prefetched {
            Some((t, hold, booking)) => {
                #[cfg(test)]
                crate::fault::fetched();
                let returned = match (&keeper, booking) {
                    (Some((k, room)), Some(b)) => {
                        k.keep_prefetched(patcher, index, &t, hold, b, *room)
                    }
                    (_, booking) => booking.map(|b| (hold, b)),
                };
                if let Some((hold, booking)) = returned {
                    hold.release_then(Box::new(move || drop(booking)));
                }
                t
            }
            None => match self.fetch_miss(patcher, index, host, keeper.as_ref())? {
                Fetch::Device(t) => t,
                // Run on the host: its use and the prefetch after it are noted already.
                other => return Ok(other),
            },
        };
        if let Some((k, _)) = &keeper {
            k.note_use(patcher, index, false);
        }
        self.prefetch_after(patcher, index);
        Ok(Fetch::Device(weight))
    }

    /// The weight expected after weight `cur`: the successor its uses showed (each weight's
    /// latest successor — a tied head, a branch, an expert routed differently show there), else
    /// the next of the recorded first-forward order (`order`, when complete).
    fn predicted_after(patcher: &ModelPatcher, cur: usize, order: &[usize]) -> Option<usize> {
        patcher.model().usage().successor(cur).or_else(|| {
            let pos = order.iter().position(|&i| i == cur)?;
            Some(order[(pos + 1) % order.len()])
        })
    }

    fn prefetch_after(&self, patcher: &ModelPatcher, index: usize) {
        let depth = self.depth();
        if depth == 0 || self.engine.lanes() == 0 {
            return;
        }
        // The recorded order is the fallback where no successor was seen yet.
        let order = if patcher.model().usage().successor(index).is_some() {
            Vec::new()
        } else {
            match patcher.model().forward_order() {
                (order, true) => order,
                _ => return,
            }
        };
        let cap = ByteSize(self.cap.load(Ordering::Relaxed));
        let mut q = self.inflight.lock();
        let mut requested = 0;
        let mut cur = index;
        // The weights in use while these prefetches are outstanding are the one just fetched
        // and the ones predicted before each: each booking keeps the largest of them free
        // beside it (on a GPU the weight computing holds device memory too).
        let mut in_use = if patcher.weight_device(index).is_cpu() {
            ByteSize::ZERO
        } else {
            patcher.resident_size(index)
        };
        // Resident weights are skipped, not counted: walk at most the model's length (a cycle
        // of successors then wraps once).
        for _ in 0..patcher.model().len() {
            if requested >= depth {
                break;
            }
            let Some(next) = Streamer::predicted_after(patcher, cur, &order) else {
                break;
            };
            // Back at the weight just fetched: its use in the next forward is the last one to
            // prefetch (a model that streams a single weight would otherwise fetch it
            // synchronously every time: fewer weights streaming ran slower than more).
            let wrapped = next == index;
            cur = next;
            // Resident in any form: a quantized weight's resident copy is its blocks (counting it
            // as streamed booked a prefetch that was never used, which then held the gate's
            // room: 0 hits in 52 on a quantized Llama with a tied head).
            // A weight a routing names is requested by its routing (`prefetch_routed`): the
            // last token's experts predicted from use are mostly not the next one's.
            if patcher.resident_weight(next).is_some() || patcher.model().usage().is_routed(next) {
                if wrapped {
                    break;
                }
                continue;
            }
            requested += 1;
            if self.submit(&mut q, patcher, next, &mut in_use, cap, false) == Submitted::Refused
                || wrapped
            {
                break;
            }
        }
        // Never hold more than a few rounds of unused prefetches (a branch not taken); a
        // routing's prefetches are kept for the layer that asked for them.
        let routed = q.iter().filter(|f| f.routed).count();
        while q.len() > 2 * depth + 2 + routed {
            match q.iter().position(|f| !f.routed) {
                Some(p) => drop(q.remove(p)),
                None => break,
            }
        }
    }

    /// Submits a prefetch of weight `next`, unless one is in flight or it runs on the host;
    /// refused when it cannot be booked or would pass the cap (the caller stops).
    fn submit(
        &self,
        q: &mut VecDeque<InFlight>,
        patcher: &ModelPatcher,
        next: usize,
        in_use: &mut ByteSize,
        cap: ByteSize,
        routed: bool,
    ) -> Submitted {
        let key = Streamer::key(patcher, next);
        let rows = if routed {
            None
        } else {
            Some(self.last_rows.load(Ordering::Relaxed))
        };
        if q.iter().any(|f| f.key == key)
            || self.runs_on_host(patcher, next)
            || rows.is_some_and(|r| self.host_preferred(patcher, next, r))
        {
            return Submitted::Skipped;
        }
        let bytes = patcher.resident_size(next);
        if !key.device.is_cpu() {
            *in_use = (*in_use).max(bytes);
        }
        let in_flight: ByteSize = q.iter().map(|f| f.pending.bytes()).sum();
        if in_flight.saturating_add(bytes) > cap {
            return Submitted::Refused;
        }
        let reservation = match &*self.gate.lock() {
            Some(g) => match Reservation::take(
                &g.gate,
                key.device,
                bytes,
                g.keep_free.saturating_add(*in_use),
            ) {
                Some(r) => Some(r),
                None => return Submitted::Refused,
            },
            None => None,
        };
        let booked = reservation
            .as_ref()
            .map_or(ByteSize::ZERO, Reservation::bytes);
        let pending = self.engine.submit_booked(patcher, next, reservation);
        q.push_back(InFlight {
            key,
            pending,
            booked,
            routed,
        });
        Submitted::Queued
    }

    /// Whether cost-aware misses would run quantized weight `index` on the host for a matmul on
    /// `rows` rows (then prefetching it is not worth its copy).
    fn host_preferred(&self, patcher: &ModelPatcher, index: usize, rows: usize) -> bool {
        let slot = &patcher.model().slots()[index];
        match (self.misses.get(), slot.quantized()) {
            (Some(c), Some(ggml)) => c.prefers_host(ggml, rows, slot.bytes().bytes()),
            _ => false,
        }
    }

    /// Whether weight `index` always runs on the host (cost-aware misses on, a quantized weight
    /// the device map puts on the host): never prefetched.
    fn runs_on_host(&self, patcher: &ModelPatcher, index: usize) -> bool {
        self.misses.get().is_some()
            && patcher.streams_always(index)
            && patcher.model().slots()[index].quantized().is_some()
    }

    /// Prefetches `weights` in order — a mixture of experts' routed experts with the rows routed
    /// to each, known before they are used (`nn::moe`) — skipping resident ones and, with
    /// cost-aware misses, those the rule would run on the host, until one cannot be booked.
    /// With lanes only (without, a prefetch would be a synchronous copy).
    pub(crate) fn prefetch_routed(&self, patcher: &ModelPatcher, weights: &[(usize, usize)]) {
        // The prediction learns which weights a router names (their copies cannot start
        // earlier than this call).
        for &(w, _) in weights {
            patcher.model().usage().note_routed(w);
        }
        if self.engine.lanes() == 0 || weights.is_empty() {
            return;
        }
        let cap = ByteSize(self.cap.load(Ordering::Relaxed));
        let stats = self.engine.stats();
        let mut q = self.inflight.lock();
        let mut in_use = ByteSize::ZERO;
        for &(w, rows) in weights {
            if patcher.resident_weight(w).is_some() || self.runs_on_host(patcher, w) {
                continue;
            }
            if self.host_preferred(patcher, w, rows) {
                continue;
            }
            // One already in flight (predicted from use, or named by this layer's routing at an
            // earlier matrix) is skipped: not requested again, nor counted as a request.
            match self.submit(&mut q, patcher, w, &mut in_use, cap, true) {
                Submitted::Queued => stats.routed_request(),
                Submitted::Skipped => {}
                Submitted::Refused => break,
            }
        }
        // Routed prefetches are used within the layer; older unused ones go first, never one
        // this call names (in flight already, about to be used).
        let named = |f: &InFlight| weights.iter().any(|&(w, _)| w == f.key.index);
        while q.len() > weights.len().max(2 * self.depth() + 2) {
            match q.iter().position(|f| !named(f)) {
                Some(p) => drop(q.remove(p)),
                None => break,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::Model;

    #[test]
    fn prefetch_predicted_from_use_leaves_the_weights_a_routing_names_to_their_routing() {
        // Six weights streamed in order, two lanes, depth 4. Weights 2 and 3 are a routing's
        // (a mixture of experts' experts): the last token's are mostly not the next one's, so a
        // prefetch from use after weight 0 requests 1, 4 and 5, never 2 or 3 (the moe bench:
        // 19 % fewer bytes copied a token, the prediction within 1 % at 2 GB/s).
        let tensors = (0..6).map(|i| {
            let t = candle_core::Tensor::arange(0f32, 64.0, &candle_core::Device::Cpu)
                .unwrap()
                .reshape((8, 8))
                .unwrap();
            (format!("w{i}"), t)
        });
        let model = Arc::new(Model::from_tensors("m", tensors).unwrap());
        let p = ModelPatcher::new(model, DeviceId::Cpu, DeviceId::Cpu);
        let engine = Arc::new(TransferEngine::new(2, None));
        let streamer = Arc::new(Streamer::new(engine, 4, ByteSize::gib(1)));
        crate::offload::attach_streamer(&p, Some(Arc::clone(&streamer)));
        // Uses recorded (and the order completed) as a forward records them.
        for i in 0..6 {
            crate::offload::fetch_weight_at(&p, i).unwrap();
        }
        p.model().finish_forward();
        streamer.clear();
        let in_flight = |s: &Streamer| {
            let mut v: Vec<usize> = s.inflight.lock().iter().map(|f| f.key.index).collect();
            v.sort_unstable();
            v
        };
        crate::offload::fetch_weight_at(&p, 0).unwrap();
        assert_eq!(
            in_flight(&streamer),
            vec![1, 2, 3, 4],
            "from use, before a routing"
        );
        streamer.clear();
        p.model().usage().note_routed(2);
        p.model().usage().note_routed(3);
        crate::offload::fetch_weight_at(&p, 0).unwrap();
        assert_eq!(in_flight(&streamer), vec![0, 1, 4, 5]);
        streamer.clear();
    }
}
