//! The live part of each device's ledger: bytes in flight, cached manual casts, the bound both are
//! held to, and the peak.
//!
//! Resident bytes are counted from the registry (each model keeps running per-device totals), so
//! they are exact by construction. What the registry cannot see is the bytes of prefetched weights
//! a transfer lane is materializing or holding for a forward: those are booked here, by
//! reservation, through the [`PrefetchGate`] every streamer the manager attaches holds.
//!
//! A reservation is granted only when `resident + in flight + bytes + keep_free ≤ total`, where
//! `resident` is the registry's figure as of the manager's last step (the manager refreshes it
//! after every call, under its own lock; between calls resident bytes only shrink, so the figure
//! is conservative) and `keep_free` is the activation memory the model's last load asked for.
//! While a load is planned and executed on a device, no reservation is granted there: the plan's
//! figures cannot be overtaken by prefetches mid-way. Cached manual casts (`ops::CastCache`) are
//! booked the same way in a column of their own, and only on a device with a bound. So on every
//! device, at every moment, resident + in flight + cached ≤ total (docs/ARCHITECTURE.md §4.2).
//!
//! Every change of a book is a sample of the device's `ledger` counter (`residency::trace`),
//! emitted after the lock is released, when a subscriber listens.
//!
//! Lock: `Ledger::books` is `Rank::LedgerBooks` in the crate's lock table (`src/lock/rank.rs`); it
//! is taken inside a streamer's queue lock when a prefetch books or returns bytes, and never held
//! across a call (a free probe is asked before it is taken). Its condition variable wakes the
//! manager waiting for cancelled prefetches' bookings.

use std::sync::Arc;

use crate::lock::{Condvar, Mutex, Rank};

use crate::offload::{PrefetchGate, Reservation};
use crate::size::ByteSize;
use crate::vram::DeviceId;

#[derive(Debug, Clone, Copy)]
struct Book {
    device: DeviceId,
    /// The ledger's manager ([`Ledger`]'s id): a trace keeps two managers' devices apart.
    manager: u64,
    /// The bound; `None` on a device the manager does not schedule.
    total: Option<ByteSize>,
    resident: ByteSize,
    in_flight: ByteSize,
    /// Bytes of cached manual casts (`ops::CastCache`).
    cached: ByteSize,
    /// Bytes the engine reserved (`MemoryManager::reserve`): never evicted, released on drop.
    reserved: ByteSize,
    /// Bytes booked to keep weights being faulted in (residency by use), until their copies are
    /// committed as resident or the fault-in gives up.
    faulting: ByteSize,
    /// Loads in progress on the device (planned or executing).
    loading: u32,
    peak: ByteSize,
}

impl Book {
    /// What a trace shows of the book: the four columns and the bound.
    fn columns(&self) -> [u64; 5] {
        [
            self.resident.bytes(),
            // Weights being faulted in are in flight too, as a trace shows them.
            self.in_flight.saturating_add(self.faulting).bytes(),
            self.cached.bytes(),
            self.reserved.bytes(),
            self.total.map_or(0, ByteSize::bytes),
        ]
    }

    /// A sample of the device's ledger counter (`residency::trace`), after the books' lock is
    /// released.
    fn trace(&self) {
        let [resident, in_flight, cached, reserved, budget] = self.columns();
        tracing::debug!(target: "residency::counter", counter = "ledger", device = %self.device,
            manager = self.manager, resident, in_flight, cached, reserved, budget);
    }

    fn note_peak(&mut self) {
        self.peak = self.peak.max(self.ledger());
    }

    /// Resident + in flight + cached + reserved + faulting.
    fn ledger(&self) -> ByteSize {
        self.kept().saturating_add(self.in_flight)
    }

    /// What stays on the device between forwards: resident + faulting + cached + reserved (not
    /// the prefetches in flight).
    fn kept(&self) -> ByteSize {
        self.resident
            .saturating_add(self.faulting)
            .saturating_add(self.cached)
            .saturating_add(self.reserved)
    }

    /// Whether `bytes` more can be kept while `room` stays free for streaming beside what is
    /// kept, and the whole ledger stays within the bound.
    fn keeps(&self, bytes: ByteSize, room: ByteSize) -> bool {
        match self.total {
            Some(total) => {
                self.kept().saturating_add(bytes).saturating_add(room) <= total
                    && self.ledger().saturating_add(bytes) <= total
            }
            None => true,
        }
    }

    /// Whether `bytes` more beside `keep_free` fit what the driver said is free (`probed`, asked
    /// before the books were locked). The driver cannot know of a booking whose buffer is not
    /// allocated yet, so every booked column counts — in flight, faulting and cached casts, the
    /// same for every kind of booking, so two bookings of different kinds cannot both pass one
    /// figure. Bookings already allocated count twice: conservative.
    fn probe_fits(&self, bytes: ByteSize, keep_free: ByteSize, probed: Option<ByteSize>) -> bool {
        let Some(free) = probed else { return true };
        let booked = self
            .in_flight
            .saturating_add(self.faulting)
            .saturating_add(self.cached);
        bytes.saturating_add(keep_free).saturating_add(booked) <= free
    }

    /// Books `bytes` when the ledger plus `bytes` plus `keep_free` stays within the bound and no
    /// load runs on the device.
    fn fits(&self, bytes: ByteSize, keep_free: ByteSize) -> bool {
        if self.loading > 0 {
            return false;
        }
        match self.total {
            Some(total) => {
                self.ledger()
                    .saturating_add(bytes)
                    .saturating_add(keep_free)
                    <= total
            }
            None => true,
        }
    }
}

/// A named reservation, for reports.
#[derive(Debug, Clone)]
pub(crate) struct Named {
    pub(crate) id: u64,
    pub(crate) name: Arc<str>,
    pub(crate) device: DeviceId,
    pub(crate) bytes: ByteSize,
}

/// What the driver says is free on a device, asked at each booking (a GPU without a budget).
pub(crate) type FreeProbe = Arc<dyn Fn() -> Option<ByteSize> + Send + Sync>;

/// Per-device in-flight bytes, bounds and peaks.
pub(crate) struct Ledger {
    books: Mutex<Vec<Book>>,
    /// Signalled when in-flight bytes are returned (a cancelled prefetch's booking comes back
    /// once its buffer's free executed).
    returned: Condvar,
    /// How many times `returned` was signalled, counted under `books` (so a waiter that read
    /// it there misses no signal).
    returns: std::sync::atomic::AtomicU64,
    /// Devices whose bookings must also fit what the driver says is free (a leaf lock, never
    /// held while a probe runs or with `books`).
    probes: Mutex<Vec<(DeviceId, FreeProbe)>>,
    /// Every live reservation by id (a leaf lock, like `books`, never held with it).
    named: Mutex<Vec<Named>>,
    /// Process-unique: which manager's ledger this is (trace series are kept apart by it).
    id: u64,
}

/// The next ledger's id.
static NEXT_LEDGER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl Default for Ledger {
    fn default() -> Ledger {
        Ledger {
            books: Mutex::new(Rank::LedgerBooks, Vec::new()),
            returned: Condvar::new(),
            returns: std::sync::atomic::AtomicU64::new(0),
            probes: Mutex::new(Rank::LedgerProbes, Vec::new()),
            named: Mutex::new(Rank::LedgerNamed, Vec::new()),
            id: NEXT_LEDGER.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        }
    }
}

impl std::fmt::Debug for Ledger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // One lock at a time: `named` ranks below `books`.
        let named = format!("{:?}", &*self.named.lock());
        let books = format!("{:?}", &*self.books.lock());
        f.debug_struct("Ledger")
            .field("books", &format_args!("{books}"))
            .field("named", &format_args!("{named}"))
            .finish()
    }
}

impl Ledger {
    /// Makes every booking on `device` (prefetch, cached casts) also fit within what `probe`
    /// says is free: memory the engine allocated outside the manager is respected on a GPU
    /// whose total is not a budget.
    pub(crate) fn set_free_probe(&self, device: DeviceId, probe: FreeProbe) {
        let mut probes = self.probes.lock();
        probes.retain(|(d, _)| *d != device);
        probes.push((device, probe));
    }

    /// What `device`'s probe says is free, when it has one that answers.
    fn probed_free(&self, device: DeviceId) -> Option<ByteSize> {
        let probe = self
            .probes
            .lock()
            .iter()
            .find(|(d, _)| *d == device)
            .map(|(_, p)| Arc::clone(p))?;
        probe()
    }

    fn with<R>(&self, device: DeviceId, f: impl FnOnce(&mut Book) -> R) -> R {
        let mut books = self.books.lock();
        let pos = match books.iter().position(|b| b.device == device) {
            Some(p) => p,
            None => {
                books.push(Book {
                    device,
                    manager: self.id,
                    total: None,
                    resident: ByteSize::ZERO,
                    in_flight: ByteSize::ZERO,
                    cached: ByteSize::ZERO,
                    reserved: ByteSize::ZERO,
                    faulting: ByteSize::ZERO,
                    loading: 0,
                    peak: ByteSize::ZERO,
                });
                books.len() - 1
            }
        };
        if !tracing::enabled!(target: "residency::counter", tracing::Level::DEBUG) {
            return f(&mut books[pos]);
        }
        let before = books[pos];
        let r = f(&mut books[pos]);
        let after = books[pos];
        drop(books);
        if after.columns() != before.columns() {
            after.trace();
        }
        r
    }

    /// Records `device`'s resident bytes (the registry's exact figure) and its bound.
    pub(crate) fn note(&self, device: DeviceId, resident: ByteSize, total: Option<ByteSize>) {
        self.with(device, |b| {
            b.resident = resident;
            b.total = total;
            b.note_peak();
        });
    }

    /// The whole ledger of `device` as the book has it: resident as of the manager's last step,
    /// plus in flight, cached casts and reservations, read together (one consistent figure).
    pub(crate) fn booked(&self, device: DeviceId) -> ByteSize {
        self.with(device, |b| b.ledger())
    }

    /// Bytes in flight on `device`.
    pub(crate) fn in_flight(&self, device: DeviceId) -> ByteSize {
        self.with(device, |b| b.in_flight)
    }

    /// Resident bytes on `device` as the book has them.
    pub(crate) fn resident(&self, device: DeviceId) -> ByteSize {
        self.with(device, |b| b.resident)
    }

    /// Bytes of cached manual casts on `device`.
    pub(crate) fn cached(&self, device: DeviceId) -> ByteSize {
        self.with(device, |b| b.cached)
    }

    /// Bytes booked for weights being faulted in on `device`.
    pub(crate) fn faulting(&self, device: DeviceId) -> ByteSize {
        self.with(device, |b| b.faulting)
    }

    /// How many bytes `device` lacks to keep `bytes` more with `room` left free (zero when it
    /// can); `None` while a load closes the device (nothing may be kept then). `in_flight`: the
    /// bytes are booked in flight already (a prefetched copy becoming resident), so only what
    /// is kept grows, not the whole ledger.
    pub(crate) fn keep_shortfall(
        &self,
        device: DeviceId,
        bytes: ByteSize,
        room: ByteSize,
        in_flight: bool,
    ) -> Option<ByteSize> {
        self.with(device, |b| {
            if b.loading > 0 {
                return None;
            }
            Some(match b.total {
                Some(total) => {
                    let need_kept = b.kept().saturating_add(bytes).saturating_add(room);
                    let need_all = if in_flight {
                        ByteSize::ZERO
                    } else {
                        b.ledger().saturating_add(bytes)
                    };
                    need_kept.max(need_all).saturating_sub(total)
                }
                None => ByteSize::ZERO,
            })
        })
    }

    /// How many bytes beyond `device`'s bound keeping `bytes` more with `room` left free would
    /// need, counting only what stays put until something is evicted (resident copies, cached
    /// casts, reservations) — not the bookings that return by themselves (copies in flight,
    /// other fault-ins). More than what may be evicted for it, and the weight cannot be kept
    /// however the moment's copies land.
    pub(crate) fn keep_excess(
        &self,
        device: DeviceId,
        bytes: ByteSize,
        room: ByteSize,
    ) -> ByteSize {
        self.with(device, |b| match b.total {
            Some(total) => b
                .resident
                .saturating_add(b.cached)
                .saturating_add(b.reserved)
                .saturating_add(bytes)
                .saturating_add(room)
                .saturating_sub(total),
            None => ByteSize::ZERO,
        })
    }

    /// How many bytes `device` lacks for `bytes` more in flight (zero when they fit); `None`
    /// while a load closes the device.
    pub(crate) fn transit_shortfall(&self, device: DeviceId, bytes: ByteSize) -> Option<ByteSize> {
        self.with(device, |b| {
            if b.loading > 0 {
                return None;
            }
            Some(match b.total {
                Some(total) => b.ledger().saturating_add(bytes).saturating_sub(total),
                None => ByteSize::ZERO,
            })
        })
    }

    /// Books `bytes` to keep a weight being faulted in on `device` (the faulting column), when
    /// [`Ledger::keep_shortfall`] is zero and the driver's figure allows it
    /// ([`Ledger::probe_allows`]); whether it did. The caller holds the manager's
    /// residency-by-use lock. Through [`FaultColumn`] the booking is a [`Reservation`].
    fn book_keep(&self, device: DeviceId, bytes: ByteSize, room: ByteSize) -> bool {
        let probed = self.probed_free(device);
        self.with(device, |b| {
            if b.loading > 0 || !b.keeps(bytes, room) || !b.probe_fits(bytes, room, probed) {
                return false;
            }
            b.faulting = b.faulting.saturating_add(bytes);
            b.note_peak();
            true
        })
    }

    /// Whether what the driver says is free on `device` (a GPU without a budget) leaves room
    /// for `bytes` more beside `keep_free` and every booking not yet allocated: asked before
    /// a fault-in evicts anything, since evicting cannot change the figure it is checked
    /// against (frees run later, in stream order). True on a device without a probe.
    pub(crate) fn probe_allows(
        &self,
        device: DeviceId,
        bytes: ByteSize,
        keep_free: ByteSize,
    ) -> bool {
        let probed = self.probed_free(device);
        self.with(device, |b| b.probe_fits(bytes, keep_free, probed))
    }

    /// A faulted-in weight's booking becomes resident (`commit`) or is returned.
    fn settle_keep(&self, device: DeviceId, bytes: ByteSize, commit: bool) {
        self.with(device, |b| {
            b.faulting = b.faulting.saturating_sub(bytes);
            if commit {
                b.resident = b.resident.saturating_add(bytes);
            }
            b.note_peak();
        });
        self.signal_returned();
    }

    /// A prefetched weight (booked in flight) becomes resident when it can be kept with `room`
    /// left free; whether it did (the total does not change).
    pub(crate) fn keep_prefetched(
        &self,
        device: DeviceId,
        bytes: ByteSize,
        room: ByteSize,
    ) -> bool {
        self.with(device, |b| {
            if b.loading > 0 || b.in_flight < bytes {
                return false;
            }
            let kept_after = b.kept().saturating_add(bytes).saturating_add(room);
            if b.total.is_some_and(|total| kept_after > total) {
                return false;
            }
            b.in_flight = b.in_flight.saturating_sub(bytes);
            b.resident = b.resident.saturating_add(bytes);
            true
        })
    }

    /// `bytes` of resident copies left `device` (evicted by a fault-in, outside a load).
    pub(crate) fn evicted(&self, device: DeviceId, bytes: ByteSize) {
        self.with(device, |b| b.resident = b.resident.saturating_sub(bytes));
        self.signal_returned();
    }

    /// Every device the ledger has a book for.
    pub(crate) fn devices(&self) -> Vec<DeviceId> {
        self.books.lock().iter().map(|b| b.device).collect()
    }

    /// Bytes reserved on `device` (`MemoryManager::reserve`).
    pub(crate) fn reserved(&self, device: DeviceId) -> ByteSize {
        self.with(device, |b| b.reserved)
    }

    /// Adds `bytes` to reservation `id` (`name`) on `device`. The caller checked that they fit,
    /// under the manager's lock.
    pub(crate) fn add_reserved(&self, id: u64, name: &Arc<str>, device: DeviceId, bytes: ByteSize) {
        self.with(device, |b| {
            b.reserved = b.reserved.saturating_add(bytes);
            b.note_peak();
        });
        let mut named = self.named.lock();
        match named.iter_mut().find(|n| n.id == id) {
            Some(n) => n.bytes = n.bytes.saturating_add(bytes),
            None => named.push(Named {
                id,
                name: Arc::clone(name),
                device,
                bytes,
            }),
        }
    }

    /// Returns `bytes` of reservation `id` on `device`; `gone` removes it from the reports.
    pub(crate) fn release_reserved(&self, id: u64, device: DeviceId, bytes: ByteSize, gone: bool) {
        self.with(device, |b| b.reserved = b.reserved.saturating_sub(bytes));
        let mut named = self.named.lock();
        if gone {
            named.retain(|n| n.id != id);
        } else if let Some(n) = named.iter_mut().find(|n| n.id == id) {
            n.bytes = n.bytes.saturating_sub(bytes);
        }
    }

    /// The live reservations, oldest first.
    pub(crate) fn reservations(&self) -> Vec<Named> {
        self.named.lock().clone()
    }

    /// The highest resident + in-flight + cached + reserved figure seen on `device`.
    pub(crate) fn peak(&self, device: DeviceId) -> ByteSize {
        self.with(device, |b| b.peak)
    }

    /// Stops new reservations on `devices` until the returned guard is dropped.
    pub(crate) fn loading(self: &Arc<Self>, devices: &[DeviceId]) -> LoadingGuard {
        for &d in devices {
            self.with(d, |b| b.loading += 1);
        }
        LoadingGuard {
            ledger: Arc::clone(self),
            devices: devices.to_vec(),
        }
    }
}

/// Which column of a book a reservation goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Column {
    /// Prefetched weights.
    InFlight,
    /// Cached manual casts: only on a device with a bound.
    Cached,
}

impl Book {
    fn column(&mut self, column: Column) -> &mut ByteSize {
        match column {
            Column::InFlight => &mut self.in_flight,
            Column::Cached => &mut self.cached,
        }
    }
}

impl Ledger {
    fn reserve(
        &self,
        column: Column,
        device: DeviceId,
        bytes: ByteSize,
        keep_free: ByteSize,
    ) -> bool {
        // The driver's figure is asked before the books are locked (a probe is a driver call),
        // and checked under that lock against everything booked so far (`Book::probe_fits`).
        let probed = self.probed_free(device);
        self.with(device, |b| {
            if (column == Column::Cached && b.total.is_none())
                || !b.fits(bytes, keep_free)
                || !b.probe_fits(bytes, keep_free, probed)
            {
                return false;
            }
            let c = b.column(column);
            *c = c.saturating_add(bytes);
            b.note_peak();
            true
        })
    }

    fn unreserve(&self, column: Column, device: DeviceId, bytes: ByteSize) {
        self.with(device, |b| {
            let c = b.column(column);
            *c = c.saturating_sub(bytes);
        });
        self.signal_returned();
    }

    /// Waits, at most `timeout`, until `device`'s in-flight bytes are at most `target`; whether
    /// they are.
    pub(crate) fn wait_in_flight(
        &self,
        device: DeviceId,
        target: ByteSize,
        timeout: std::time::Duration,
    ) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        let mut books = self.books.lock();
        loop {
            let now = books
                .iter()
                .find(|b| b.device == device)
                .map_or(ByteSize::ZERO, |b| b.in_flight);
            if now <= target {
                return true;
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return false;
            }
            self.returned.wait_for(&mut books, left);
        }
    }

    /// Wakes the waiters for room: a booking came back, a kept copy left, or a load let
    /// bookings in again.
    fn signal_returned(&self) {
        let books = self.books.lock();
        self.returns
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        drop(books);
        self.returned.notify_all();
    }

    /// The gate cached manual casts book on (`ops::CastCache`).
    pub(crate) fn cast_column(self: &Arc<Self>) -> CastColumn {
        CastColumn(Arc::clone(self))
    }
}

impl PrefetchGate for Ledger {
    fn try_reserve(&self, device: DeviceId, bytes: ByteSize, keep_free: ByteSize) -> bool {
        self.reserve(Column::InFlight, device, bytes, keep_free)
    }

    fn release(&self, device: DeviceId, bytes: ByteSize) {
        self.unreserve(Column::InFlight, device, bytes);
    }

    fn is_closed(&self, device: DeviceId) -> bool {
        self.with(device, |b| b.loading > 0)
    }

    fn returns(&self) -> u64 {
        self.returns.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn wait_returned(&self, seen: u64, timeout: std::time::Duration) {
        let mut books = self.books.lock();
        if self.returns() == seen {
            self.returned.wait_for(&mut books, timeout);
        }
    }

    fn booked_in_flight(&self, device: DeviceId) -> ByteSize {
        self.with(device, |b| b.in_flight.saturating_add(b.faulting))
    }

    fn reserve_waiting(
        &self,
        device: DeviceId,
        bytes: ByteSize,
        keep_free: ByteSize,
        timeout: std::time::Duration,
    ) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            // Read before the attempt: a return between its refusal and the wait is not missed.
            let seen = self.returns();
            if self.reserve(Column::InFlight, device, bytes, keep_free) {
                return true;
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return false;
            }
            // Woken when any booking comes back (a cancelled prefetch's, once its free ran).
            self.wait_returned(seen, left);
        }
    }
}

/// The ledger's column for cached manual casts, as a gate: booked on the same terms as
/// prefetches, but a load plans as if they were free and drops them when it needs their room.
pub(crate) struct CastColumn(Arc<Ledger>);

impl PrefetchGate for CastColumn {
    fn try_reserve(&self, device: DeviceId, bytes: ByteSize, keep_free: ByteSize) -> bool {
        self.0.reserve(Column::Cached, device, bytes, keep_free)
    }

    fn release(&self, device: DeviceId, bytes: ByteSize) {
        self.0.unreserve(Column::Cached, device, bytes);
    }
}

/// The ledger's faulting column, as a gate: a fault-in's booking (residency by use) is a
/// [`Reservation`] on it — its device and bytes fixed when booked, returned when dropped
/// (a fetch that failed or unwound), moved to the resident column by [`FaultColumn::commit`].
pub(crate) struct FaultColumn(pub(crate) Arc<Ledger>);

impl FaultColumn {
    /// The booked copy became the weight's resident copy: its bytes move from the faulting
    /// column to the resident one, and the booking is spent.
    pub(crate) fn commit(&self, booking: Reservation) {
        self.0.settle_keep(booking.device(), booking.bytes(), true);
        booking.absorb();
    }
}

impl PrefetchGate for FaultColumn {
    /// Books a weight to keep, with `keep_free` the room left free for streaming beside what
    /// is kept ([`Ledger::keep_shortfall`]).
    fn try_reserve(&self, device: DeviceId, bytes: ByteSize, keep_free: ByteSize) -> bool {
        self.0.book_keep(device, bytes, keep_free)
    }

    fn release(&self, device: DeviceId, bytes: ByteSize) {
        self.0.settle_keep(device, bytes, false);
    }

    fn is_closed(&self, device: DeviceId) -> bool {
        self.0.is_closed(device)
    }
}

/// Keeps reservations closed on some devices while a load runs.
pub(crate) struct LoadingGuard {
    ledger: Arc<Ledger>,
    devices: Vec<DeviceId>,
}

impl Drop for LoadingGuard {
    fn drop(&mut self) {
        for &d in &self.devices {
            self.ledger
                .with(d, |b| b.loading = b.loading.saturating_sub(1));
        }
        self.ledger.signal_returned();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: DeviceId = DeviceId::Cpu;

    #[test]
    fn reservations_stay_within_total_less_what_must_stay_free() {
        let l = Ledger::default();
        l.note(D, ByteSize(60), Some(ByteSize(100)));
        assert!(l.try_reserve(D, ByteSize(30), ByteSize(10)));
        assert!(
            !l.try_reserve(D, ByteSize(1), ByteSize(10)),
            "60 + 30 + 1 + 10 > 100"
        );
        assert!(l.try_reserve(D, ByteSize(10), ByteSize::ZERO));
        assert_eq!(l.in_flight(D), ByteSize(40));
        assert_eq!(l.peak(D), ByteSize(100));
        l.release(D, ByteSize(30));
        assert_eq!(l.in_flight(D), ByteSize(10));
    }

    #[test]
    fn a_waiter_for_room_wakes_at_the_first_return_and_misses_none_before_it_waited() {
        // A fetch out of device memory waits for room to come back: it must wake at the first
        // booking returned, not at its timeout (it once asked for `ByteSize::MAX` and so slept
        // the whole 5 ms at every retry), and a return between its failed allocation and its
        // wait must not be missed.
        let l = Arc::new(Ledger::default());
        l.note(D, ByteSize::ZERO, Some(ByteSize(100)));
        assert!(l.try_reserve(D, ByteSize(40), ByteSize::ZERO));
        let seen = l.returns();
        l.release(D, ByteSize(10));
        let t0 = std::time::Instant::now();
        l.wait_returned(seen, std::time::Duration::from_secs(60));
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(30),
            "a return before the wait is seen"
        );
        let seen = l.returns();
        let waiter = {
            let l = Arc::clone(&l);
            std::thread::spawn(move || {
                let t0 = std::time::Instant::now();
                l.wait_returned(seen, std::time::Duration::from_secs(60));
                t0.elapsed()
            })
        };
        std::thread::sleep(std::time::Duration::from_millis(20));
        l.release(D, ByteSize(10));
        let waited = waiter.join().expect("the waiter");
        assert!(
            waited < std::time::Duration::from_secs(30),
            "woken by the return, not the timeout: {waited:?}"
        );
        // Evicting a kept copy makes room too.
        let seen = l.returns();
        l.evicted(D, ByteSize::ZERO);
        assert_ne!(l.returns(), seen);
    }

    #[test]
    fn no_reservation_while_a_load_runs_on_the_device() {
        let l = Arc::new(Ledger::default());
        l.note(D, ByteSize::ZERO, Some(ByteSize(100)));
        {
            let _g = l.loading(&[D]);
            assert!(!l.try_reserve(D, ByteSize(1), ByteSize::ZERO));
            assert!(l.try_reserve(DeviceId::Cuda(0), ByteSize(1), ByteSize::ZERO));
        }
        assert!(l.try_reserve(D, ByteSize(1), ByteSize::ZERO));
    }

    #[test]
    fn cached_casts_share_the_bound_and_need_one() {
        let l = Arc::new(Ledger::default());
        let casts = l.cast_column();
        assert!(
            !casts.try_reserve(D, ByteSize(1), ByteSize::ZERO),
            "no bound known: nothing cached"
        );
        l.note(D, ByteSize(50), Some(ByteSize(100)));
        assert!(l.try_reserve(D, ByteSize(20), ByteSize::ZERO));
        assert!(casts.try_reserve(D, ByteSize(20), ByteSize(10)));
        assert!(
            !casts.try_reserve(D, ByteSize(1), ByteSize(10)),
            "50 + 20 + 20 + 1 + 10 > 100"
        );
        assert!(!l.try_reserve(D, ByteSize(11), ByteSize::ZERO));
        assert_eq!(l.cached(D), ByteSize(20));
        assert_eq!(l.peak(D), ByteSize(90));
        casts.release(D, ByteSize(20));
        assert_eq!(l.cached(D), ByteSize::ZERO);
        assert_eq!(l.in_flight(D), ByteSize(20));
    }

    #[test]
    fn a_probed_device_books_within_what_the_driver_says_is_free() {
        let l = Arc::new(Ledger::default());
        l.note(D, ByteSize(10), Some(ByteSize(100)));
        let free = Arc::new(std::sync::atomic::AtomicU64::new(30));
        let f = Arc::clone(&free);
        l.set_free_probe(
            D,
            Arc::new(move || Some(ByteSize(f.load(std::sync::atomic::Ordering::Relaxed)))),
        );
        // The total would allow 90; the driver says 30 are free (the engine holds the rest).
        assert!(!l.try_reserve(D, ByteSize(31), ByteSize::ZERO));
        assert!(
            !l.try_reserve(D, ByteSize(25), ByteSize(10)),
            "keep-free counts too"
        );
        assert!(l.try_reserve(D, ByteSize(30), ByteSize::ZERO));
        assert!(!l.cast_column().try_reserve(D, ByteSize(40), ByteSize::ZERO));
        free.store(80, std::sync::atomic::Ordering::Relaxed);
        assert!(l.cast_column().try_reserve(D, ByteSize(40), ByteSize::ZERO));
        assert!(
            !l.try_reserve(D, ByteSize(21), ByteSize::ZERO),
            "then the total binds"
        );
    }

    #[test]
    fn two_bookings_cannot_both_fit_one_driver_figure() {
        // An unbudgeted GPU: the driver says 100 are free and says so again before either
        // booking's buffer is allocated. Checked outside the books' lock, both fitted.
        let l = Arc::new(Ledger::default());
        l.note(D, ByteSize::ZERO, None);
        l.set_free_probe(D, Arc::new(|| Some(ByteSize(100))));
        assert!(l.try_reserve(D, ByteSize(60), ByteSize::ZERO));
        assert!(
            !l.try_reserve(D, ByteSize(60), ByteSize::ZERO),
            "60 + 60 do not fit in the 100 the driver reported"
        );
        assert!(l.try_reserve(D, ByteSize(40), ByteSize::ZERO));
        // From two threads at once: never more than the figure booked.
        let l = Arc::new(Ledger::default());
        l.note(D, ByteSize::ZERO, None);
        l.set_free_probe(D, Arc::new(|| Some(ByteSize(100))));
        let granted: u64 = std::thread::scope(|s| {
            let hs: Vec<_> = (0..8)
                .map(|_| {
                    s.spawn(|| {
                        (0..50)
                            .filter(|_| l.try_reserve(D, ByteSize(30), ByteSize::ZERO))
                            .count() as u64
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).sum()
        });
        assert_eq!(granted, 3, "three 30-byte bookings fit in 100");
        assert_eq!(l.in_flight(D), ByteSize(90));
    }

    #[test]
    fn an_unscheduled_device_has_no_bound() {
        let l = Ledger::default();
        assert!(l.try_reserve(D, ByteSize::MAX, ByteSize::ZERO));
    }
}
