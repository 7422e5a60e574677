//! A streamed weight's miss ([`Streamer::fetch_miss`]): the copy made now, on the calling
//! thread — kept by use where the keeper books room for it, else booked in flight while it is
//! copied (room made from the lowest-priority memory first: this model's unused prefetches,
//! the keeper's evictions, then other models' unused prefetches), or run on the host where
//! cost-aware misses say so.

use std::sync::Arc;

use candle_core::Tensor;

use super::{Fetch, Reservation, Streamer};
use crate::error::Result;
use crate::offload::Keeper;
use crate::patcher::ModelPatcher;
use crate::size::ByteSize;

impl Streamer {
    /// A miss of weight `index`: fetched now and kept by use where the keeper books room for
    /// it, else copied in flight and dropped after use; with cost-aware misses, run on the host
    /// where the rule says (its use and the prefetch after it noted here, as the caller does
    /// for a fetch to the device).
    pub(super) fn fetch_miss(
        &self,
        patcher: &ModelPatcher,
        index: usize,
        host: Option<(candle_core::quantized::GgmlDType, usize)>,
        keeper: Option<&(Arc<dyn Keeper>, ByteSize)>,
    ) -> Result<Fetch> {
        tracing::debug!(model = patcher.model().name(), weight = index, "miss");
        let stats = self.engine.stats();
        stats.miss();
        let costs = host.and_then(|h| self.misses.get().map(|c| (c, h)));
        // With cost-aware misses a copy is kept only where keeping it pays back: where
        // the host computes it about as fast as the device, it never does.
        let worth_keeping = costs.is_none_or(|(c, (ggml, rows))| c.worth_keeping(ggml, rows));
        // The fault-in's booking: returned when dropped, on every path out of here
        // (an error, a panic in a kernel the engine catches) unless committed.
        let booking = keeper
            .as_ref()
            .filter(|_| worth_keeping)
            .and_then(|(k, room)| k.book(patcher, index, *room));
        let booked = booking.is_some();
        let bytes = patcher.model().slots()[index].bytes().bytes();
        if let Some((c, (ggml, rows))) = costs.filter(|_| !booked) {
            // A weight the device map puts on the host runs there (llama.cpp's
            // `-ot exps=CPU`, `-ncmoe`); any other miss where the rule says.
            if patcher.streams_always(index)
                || c.choose(ggml, rows, bytes) == crate::offload::MissRun::Host
            {
                let prepared = self.prepared.get().and_then(|p| p.get(index));
                let fetch = match prepared {
                    Some(q) => Fetch::Prepared(q),
                    None => Fetch::Host(patcher.model().slots()[index].clean()?),
                };
                if let Some((k, _)) = keeper {
                    k.note_use(patcher, index, false);
                }
                self.prefetch_after(patcher, index);
                return Ok(fetch);
            }
        }
        // A weight not kept is booked in flight while it is copied, like a prefetch
        // (`book_miss` makes the room when there is none).
        let transit = if booked {
            None
        } else {
            self.book_miss(patcher, index, keeper.map(|(k, _)| k))
        };
        let t0 = std::time::Instant::now();
        let fetched = self.fetch_through_pressure(patcher, index);
        #[cfg(test)]
        crate::fault::fetched();
        let waited = t0.elapsed().as_nanos() as u64;
        stats.waited(waited);
        if let Some((c, _)) = costs.filter(|_| fetched.is_ok()) {
            c.note_fetch(bytes, waited);
        }
        if let Some(model) = self.costs.get().filter(|_| fetched.is_ok()) {
            model.note_copy(patcher.weight_device(index), bytes, waited);
        }
        match (fetched, keeper, booking) {
            (Ok((t, hold)), Some((k, _)), Some(booking)) => {
                k.commit(patcher, index, &t, hold, booking);
                Ok(Fetch::Device(t))
            }
            (Ok((t, hold)), keeper, _) => {
                // Refused a keep for the moment's room (copies in flight held it: a busy core
                // lags their frees), the copy made in flight is kept where it can be now, as
                // a prefetched one is: otherwise the same lag refused it at every forward and
                // by use settled below the classic set for a whole run.
                let returned = match (keeper.filter(|_| worth_keeping), transit) {
                    (Some((k, room)), Some(b)) => k
                        .keep_prefetched(patcher, index, &t, hold, b, *room)
                        .map(|(hold, b)| (hold, Some(b))),
                    (_, transit) => Some((hold, transit)),
                };
                if let Some((hold, transit)) = returned {
                    hold.release_then(Box::new(move || drop(transit)));
                }
                Ok(Fetch::Device(t))
            }
            (Err(e), _, _) => Err(e),
        }
    }

    /// Fetches weight `index` now; a device out of memory for its copy (copies in flight on
    /// other threads hold it: they are unbooked only while a load decides, or beyond the room
    /// when threads share a small device) is waited out while the gate sees bookings come back,
    /// for a little while, then returned.
    fn fetch_through_pressure(
        &self,
        patcher: &ModelPatcher,
        index: usize,
    ) -> Result<(Tensor, crate::device::DeviceHold)> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_millis(200);
        let mut tries = 0;
        let gate = self.gate.lock().as_ref().map(|g| Arc::clone(&g.gate));
        loop {
            // Read before the attempt: a return between its failure and the wait is not missed.
            let seen = gate.as_ref().map_or(0, |g| g.returns());
            match self.engine.fetch_now_held(patcher, index) {
                Err(e) if e.is_retryable() && std::time::Instant::now() < deadline => {
                    let device = patcher.weight_device(index);
                    tries += 1;
                    // Once for frees queued on streams (they run at once), more only while
                    // other copies are in flight.
                    let waiting_on = gate
                        .as_ref()
                        .map_or(ByteSize::ZERO, |g| g.booked_in_flight(device));
                    if tries > 1 && waiting_on == ByteSize::ZERO {
                        return Err(e);
                    }
                    match &gate {
                        // Woken when a booking comes back (or after a few milliseconds).
                        Some(g) => {
                            g.wait_returned(seen, std::time::Duration::from_millis(5));
                        }
                        None => std::thread::sleep(std::time::Duration::from_millis(1)),
                    }
                }
                other => return other,
            }
        }
    }

    /// Books a missed weight's bytes in flight on its device for its copy. When there is no
    /// room: this model's unused prefetches (the lowest priority memory there is) are cancelled,
    /// a keeper (dynamic mode) evicts kept copies of the lowest priority for it, and the
    /// bookings of copies other threads have in flight are waited for, briefly. `None` without a
    /// gate, on the CPU, or when the room did not come (the copy then goes unbooked, within the
    /// room its load left).
    fn book_miss(
        &self,
        patcher: &ModelPatcher,
        index: usize,
        keeper: Option<&Arc<dyn Keeper>>,
    ) -> Option<Reservation> {
        let device = patcher.weight_device(index);
        if device.is_cpu() {
            return None;
        }
        let (gate, keep_free) = {
            let g = self.gate.lock();
            let g = g.as_ref()?;
            (Arc::clone(&g.gate), g.keep_free)
        };
        let bytes = patcher.resident_size(index);
        if let Some(r) = Reservation::take(&gate, device, bytes, keep_free) {
            return Some(r);
        }
        // A load is deciding on the device: its plan leaves room for one streamed weight, but
        // threads missing together would each copy unbooked into memory the load is
        // allocating (a load on another thread then failed with "0 B available" on a tiny
        // simulated GPU). Wait a little for the room or for the load to end, then go on as
        // below; past the bound the plan's room is this copy's, unbooked.
        let deadline = std::time::Instant::now() + std::time::Duration::from_millis(100);
        while gate.is_closed(device) {
            let wait = std::time::Duration::from_millis(2);
            if let Some(r) = Reservation::take_waiting(&gate, device, bytes, keep_free, wait) {
                return Some(r);
            }
            if std::time::Instant::now() >= deadline {
                return None;
            }
        }
        // Prefetches predicted from use are the lowest priority memory there is; routed ones
        // name weights about to run (`prefetch_routed`: a later call never trims what it names).
        self.drop_predicted_on(None);
        if let Some(r) = Reservation::take(&gate, device, bytes, keep_free) {
            return Some(r);
        }
        // Copies in flight give their room back as their stream-ordered frees run (behind a
        // busy core, a little late): a moment's wait for them before a kept copy is evicted,
        // which comes back by use at the next forward, one copy more (classic only waits).
        if keeper.is_some() && gate.booked_in_flight(device) > ByteSize::ZERO {
            if let Some(r) = Reservation::take_waiting(
                &gate,
                device,
                bytes,
                keep_free,
                std::time::Duration::from_millis(2),
            ) {
                return Some(r);
            }
        }
        // The weight in use comes before the activation memory the load asked to keep free:
        // room for both when evictions give it, else for the weight alone. First from other
        // models' copies (`spare`); the model's own only once copies in flight had their time
        // to come back: evicted for a moment's room, its copies came back at the next forward
        // and were evicted again, every forward (the main job at 4 MiB: 1 496 evictions, 220
        // once spared; a large weight of the classic set pushed fifteen small ones out).
        let make = |spare: bool| match keeper {
            Some(k) if k.make_room(patcher, index, bytes.saturating_add(keep_free), spare) => {
                (true, keep_free)
            }
            Some(k) => (k.make_room(patcher, index, bytes, spare), ByteSize::ZERO),
            None => (false, keep_free),
        };
        let (made, keep_free) = make(true);
        if let Some(r) = Reservation::take(&gate, device, bytes, keep_free) {
            return Some(r);
        }
        // Then other models' (their next forward's first weights, prefetched at the end of
        // their last): this forward runs now.
        self.engine.drop_predicted_on(device);
        if let Some(r) = Reservation::take(&gate, device, bytes, keep_free) {
            return Some(r);
        }
        if gate.booked_in_flight(device) > ByteSize::ZERO {
            let waited = Reservation::take_waiting(
                &gate,
                device,
                bytes,
                keep_free,
                std::time::Duration::from_millis(20),
            );
            if waited.is_some() || keeper.is_none() {
                return waited;
            }
        } else if !made && keeper.is_none() {
            // Nothing in flight to come back (ours were cancelled: their bookings are back).
            return None;
        }
        let (_, keep_free) = make(false);
        Reservation::take(&gate, device, bytes, keep_free)
    }
}
