//! What a streamer has booked on the ledger and not returned yet: its prefetches in flight and
//! the copies its forward used, whose stream-ordered frees may still be queued after the
//! forward ended. A plan reads it to count the planned model's own bookings free (a load first
//! waits for them to come back), so the memory a load sees does not depend on whether the last
//! step's frees had run (the planner weighed every prefetch depth alike when they had not).

use std::sync::Arc;

use super::PrefetchGate;
use crate::lock::{Mutex, Rank};
use crate::size::ByteSize;
use crate::vram::DeviceId;

/// Bytes booked through a streamer's gates and not yet returned, by device. Shared by every
/// gate the streamer was given, so bookings made before a reload are counted until they return.
pub(crate) struct Outstanding(Mutex<Vec<(DeviceId, ByteSize)>>);

impl Outstanding {
    pub(crate) fn new() -> Outstanding {
        Outstanding(Mutex::new(Rank::StreamerBookings, Vec::new()))
    }

    /// Bytes booked on `device` and not returned.
    pub(crate) fn on(&self, device: DeviceId) -> ByteSize {
        self.0
            .lock()
            .iter()
            .find(|(d, _)| *d == device)
            .map_or(ByteSize::ZERO, |(_, b)| *b)
    }

    fn add(&self, device: DeviceId, bytes: ByteSize) {
        let mut all = self.0.lock();
        match all.iter_mut().find(|(d, _)| *d == device) {
            Some((_, b)) => *b = b.saturating_add(bytes),
            None => all.push((device, bytes)),
        }
    }

    fn sub(&self, device: DeviceId, bytes: ByteSize) {
        if let Some((_, b)) = self.0.lock().iter_mut().find(|(d, _)| *d == device) {
            *b = b.saturating_sub(bytes);
        }
    }
}

/// A gate that counts what is booked through it in an [`Outstanding`], and forwards everything
/// to the gate it wraps.
pub(crate) struct Counted {
    pub(crate) inner: Arc<dyn PrefetchGate>,
    pub(crate) outstanding: Arc<Outstanding>,
}

impl PrefetchGate for Counted {
    fn try_reserve(&self, device: DeviceId, bytes: ByteSize, keep_free: ByteSize) -> bool {
        let booked = self.inner.try_reserve(device, bytes, keep_free);
        if booked {
            self.outstanding.add(device, bytes);
        }
        booked
    }

    fn release(&self, device: DeviceId, bytes: ByteSize) {
        self.inner.release(device, bytes);
        self.outstanding.sub(device, bytes);
    }

    fn absorbed(&self, device: DeviceId, bytes: ByteSize) {
        self.inner.absorbed(device, bytes);
        self.outstanding.sub(device, bytes);
    }

    fn is_closed(&self, device: DeviceId) -> bool {
        self.inner.is_closed(device)
    }

    fn booked_in_flight(&self, device: DeviceId) -> ByteSize {
        self.inner.booked_in_flight(device)
    }

    fn reserve_waiting(
        &self,
        device: DeviceId,
        bytes: ByteSize,
        keep_free: ByteSize,
        timeout: std::time::Duration,
    ) -> bool {
        let booked = self
            .inner
            .reserve_waiting(device, bytes, keep_free, timeout);
        if booked {
            self.outstanding.add(device, bytes);
        }
        booked
    }

    fn wait_returned(&self, seen: u64, timeout: std::time::Duration) {
        self.inner.wait_returned(seen, timeout)
    }

    fn returns(&self) -> u64 {
        self.inner.returns()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::offload::prefetch::Reservation;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// A gate with room for `limit` bytes on any device.
    struct Room {
        limit: u64,
        used: AtomicU64,
    }

    impl PrefetchGate for Room {
        fn try_reserve(&self, _: DeviceId, bytes: ByteSize, _: ByteSize) -> bool {
            let used = self.used.load(Ordering::Relaxed);
            let ok = used + bytes.bytes() <= self.limit;
            if ok {
                self.used.store(used + bytes.bytes(), Ordering::Relaxed);
            }
            ok
        }
        fn release(&self, _: DeviceId, bytes: ByteSize) {
            self.used.fetch_sub(bytes.bytes(), Ordering::Relaxed);
        }
    }

    #[test]
    fn what_is_booked_through_a_counted_gate_is_outstanding_until_returned_or_spent() {
        let outstanding = Arc::new(Outstanding::new());
        let room = Arc::new(Room {
            limit: 10,
            used: AtomicU64::new(0),
        });
        let gate: Arc<dyn PrefetchGate> = Arc::new(Counted {
            inner: room.clone(),
            outstanding: Arc::clone(&outstanding),
        });
        let (a, b) = (DeviceId::Sim(0), DeviceId::Sim(1));
        let first = Reservation::take(&gate, a, ByteSize(4), ByteSize::ZERO).unwrap();
        let second = Reservation::take(&gate, a, ByteSize(3), ByteSize::ZERO).unwrap();
        let other = Reservation::take(&gate, b, ByteSize(2), ByteSize::ZERO).unwrap();
        // Refused by the inner gate: nothing counted.
        assert!(Reservation::take(&gate, a, ByteSize(5), ByteSize::ZERO).is_none());
        assert_eq!(outstanding.on(a), ByteSize(7));
        assert_eq!(outstanding.on(b), ByteSize(2));
        drop(first); // returned (a copy's buffer freed)
        assert_eq!(outstanding.on(a), ByteSize(3));
        second.absorb(); // spent (a prefetched copy kept resident): not returned, not outstanding
        assert_eq!(outstanding.on(a), ByteSize::ZERO);
        assert_eq!(
            room.used.load(Ordering::Relaxed),
            3 + 2,
            "the inner gate keeps it"
        );
        drop(other);
        assert_eq!(outstanding.on(b), ByteSize::ZERO);
        assert_eq!(outstanding.on(DeviceId::Cpu), ByteSize::ZERO);
    }
}
