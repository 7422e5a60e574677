//! Memory that is not weights: reservations and keep guards (docs/ARCHITECTURE.md §4.2, §5).
//!
//! A [`MemoryReservation`] is room an engine holds on a device for what a forward allocates —
//! a KV cache that grows with every token, a decode's activations. It is a column of the device's
//! ledger beside resident weights, bytes in flight and cached casts: plans, loads, prefetch and
//! the cast cache all see it as occupied, nothing evicts it, and it is returned when the guard
//! drops. Taking or growing one makes room the way a load does — cached casts first, then other
//! models by ComfyUI's eviction order (kept models excepted) — and fails with a retryable
//! [`Error::OutOfMemory`] naming the device and the sizes when even that is not enough; a failed
//! call changes no reservation.
//!
//! A [`KeepGuard`] keeps a model: while it lives no plan evicts any of the model's weights (a
//! load that needs their room loads partially, or fails as it would if that memory were any
//! other occupied memory).
//!
//! Locks: taking, growing and shrinking a reservation run under the manager's lock (so they
//! serialize with loads) and then the ledger's (a leaf); dropping one takes the ledger's alone.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::{cleanup, MemoryManager};
use crate::error::{Error, Result};
use crate::offload::PrefetchGate;
use crate::patcher::ModelPatcher;
use crate::size::ByteSize;
use crate::vram::DeviceId;

static NEXT_RESERVATION: AtomicU64 = AtomicU64::new(1);

/// Room held on a device for memory that is not weights (a KV cache, a decode's activations):
/// a column of the device's ledger that plans, loads, prefetch and the cast cache see as
/// occupied and nothing evicts ([`MemoryManager::reserve`]).
///
/// It does not borrow its manager (an engine's KV cache can own one): growing it takes the
/// manager that made it ([`MemoryReservation::grow`]); shrinking and dropping need none.
#[derive(Debug)]
pub struct MemoryReservation {
    ledger: Arc<super::ledger::Ledger>,
    id: u64,
    name: Arc<str>,
    device: DeviceId,
    bytes: ByteSize,
}

/// A live reservation, as the reports show it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct ReservationInfo {
    /// The name it was taken under ([`MemoryManager::reserve_named`]).
    pub name: String,
    /// The device.
    pub device: DeviceId,
    /// Bytes held.
    pub bytes: ByteSize,
}

/// Keeps a model from being evicted while it lives ([`MemoryManager::keep`]). It does not borrow
/// the manager.
#[derive(Debug)]
pub struct KeepGuard {
    kept: Arc<crate::lock::Mutex<std::collections::HashMap<u64, usize>>>,
    model: u64,
}

impl MemoryManager {
    /// Reserves `bytes` on `device` for memory that is not weights (see [`MemoryReservation`]).
    ///
    /// # Errors
    /// [`Error::OutOfMemory`] (retryable) naming the device, the bytes asked for and those free
    /// after evicting what could go; [`Error::Device`] for a device the machine does not have.
    /// On a device the manager does not schedule (the CPU without a budget) the room asked for
    /// is checked against what is free there and shown in the reports, but bounds nothing.
    pub fn reserve(&self, device: DeviceId, bytes: ByteSize) -> Result<MemoryReservation> {
        self.reserve_named("reservation", device, bytes)
    }

    /// [`MemoryManager::reserve`] under a name the plans and reports show ("kv-cache").
    ///
    /// # Errors
    /// As [`MemoryManager::reserve`].
    pub fn reserve_named(
        &self,
        name: impl Into<String>,
        device: DeviceId,
        bytes: ByteSize,
    ) -> Result<MemoryReservation> {
        let name: Arc<str> = Arc::from(name.into());
        let id = NEXT_RESERVATION.fetch_add(1, Ordering::Relaxed);
        self.book_reservation(id, &name, device, bytes)?;
        Ok(MemoryReservation {
            ledger: Arc::clone(&self.ledger),
            id,
            name,
            device,
            bytes,
        })
    }

    /// The live reservations, oldest first.
    pub fn reservations(&self) -> Vec<ReservationInfo> {
        self.ledger
            .reservations()
            .into_iter()
            .map(|n| ReservationInfo {
                name: n.name.to_string(),
                device: n.device,
                bytes: n.bytes,
            })
            .collect()
    }

    /// Keeps `patcher`'s model: no plan evicts it while the guard lives (guards nest). Waits
    /// for a load in progress: a load planned before the guard could otherwise evict the model
    /// after this returned.
    pub fn keep(&self, patcher: &ModelPatcher) -> KeepGuard {
        let model = patcher.model().id();
        let inner = self.lock_inner();
        *self.kept.lock().entry(model).or_insert(0) += 1;
        drop(inner);
        KeepGuard {
            kept: Arc::clone(&self.kept),
            model,
        }
    }

    /// Runs `f`; when it fails with a retryable out-of-memory, makes room on the device the
    /// error names (`device` when it names none) and runs it once more — the loop ComfyUI runs
    /// around VAE decodes, for any engine step. Room: the bytes the error says were missing (an
    /// [`Error::OutOfMemory`] from the manager or from candle, converted), else every model not
    /// in `keep_loaded` and not kept; cached casts first, then models by the usual order; then
    /// the device's cache is trimmed.
    ///
    /// # Running twice
    ///
    /// `f` must be safe to run twice: the out-of-memory can come halfway through it, after it
    /// changed state the second run then changes again. A forward that appends to a KV cache
    /// would append the step twice. Put back what the first run touched at the start of each
    /// run: truncate the cache to its length before the first try, or restore a clone taken
    /// then (candle's `KvCache` clones cheaply: it shares its tensors and keeps its length, and
    /// the second run writes over what the first wrote past it).
    ///
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// use residency::loader::MemoryManager;
    /// use residency::nn::kv_cache::KvCache;
    /// use residency::{ByteSize, Config, Hardware};
    ///
    /// let manager = MemoryManager::new(Config::default(), Hardware::cpu_only(ByteSize::gib(8)))?;
    /// let mut cache = KvCache::new(2, 16); // a model's: every forward appends to it
    /// let k = Tensor::ones((1, 2, 1, 8), DType::F32, &Device::Cpu)?;
    /// let before = cache.clone(); // the state before the first try
    /// let (keys, _) = manager.retry_on_oom(manager.compute_device(), &[], || {
    ///     cache = before.clone(); // a second try starts where the first did
    ///     Ok(cache.append(&k, &k)?)
    /// })?;
    /// assert_eq!(cache.current_seq_len(), 1);
    /// assert_eq!(keys.dims(), &[1, 2, 1, 8]);
    /// # Ok::<(), residency::Error>(())
    /// ```
    ///
    /// # Errors
    /// `f`'s error when it is not retryable, or its second error.
    pub fn retry_on_oom<T>(
        &self,
        device: DeviceId,
        keep_loaded: &[&ModelPatcher],
        mut f: impl FnMut() -> Result<T>,
    ) -> Result<T> {
        match f() {
            Err(e) if e.is_retryable() => {
                // The device that ran out: an engine step may touch several.
                let device = match &e {
                    Error::OutOfMemory { device: named, .. } => {
                        named.parse::<DeviceId>().unwrap_or(device)
                    }
                    _ => device,
                };
                let total = self.policy.total_memory(device);
                let required = match &e {
                    Error::OutOfMemory {
                        required,
                        available,
                        ..
                    } => {
                        // What was missing, on top of what is free now.
                        let missing = required.saturating_sub(*available);
                        self.get_free_memory(device).saturating_add(missing)
                    }
                    _ => total,
                };
                tracing::warn!(error = %e, %device, %required, "out of memory: freeing memory and trying once more");
                let evicted = self.free_memory(required.min(total), device, keep_loaded);
                if evicted.is_empty() && matches!(e, Error::OutOfMemory { .. }) {
                    // Nothing was evictable for the figure: free everything that may go.
                    self.free_memory(total, device, keep_loaded);
                }
                if self.policy.dynamic_vram() && self.get_free_memory(device) < required.min(total)
                {
                    // Residency by use: the models in use give up weights too (they stream).
                    self.free_memory_under_pressure(required.min(total), device, keep_loaded);
                }
                self.soft_empty_cache();
                f()
            }
            other => other,
        }
    }

    /// Whether model `id` is kept by a [`KeepGuard`].
    pub(crate) fn is_kept(&self, id: u64) -> bool {
        self.kept.lock().get(&id).is_some_and(|&n| n > 0)
    }

    /// Whether `device` can hold a reservation here: a device error naming reservation `name`
    /// when this machine has no such device.
    fn reservable(&self, name: &str, device: DeviceId) -> Result<()> {
        let exists = match device {
            DeviceId::Cuda(n) => self.policy.hardware().gpu(n).is_some(),
            DeviceId::Sim(_) => self.engine.devices().gpu(device).is_some(),
            DeviceId::Cpu => true,
        };
        if exists {
            return Ok(());
        }
        Err(Error::Device {
            device: device.to_string(),
            reason: format!(
                "reservation `{name}`: this machine has no {device} (the compute device is {})",
                self.policy.compute_device()
            ),
        })
    }

    /// The out-of-memory of reservation `name` refused `bytes` on `device` with `free` bytes
    /// free, `room` of them kept for a streamed weight: it says what holds the rest.
    fn refused(
        &self,
        inner: &super::Inner,
        name: &str,
        device: DeviceId,
        bytes: ByteSize,
        free: ByteSize,
        room: ByteSize,
    ) -> Error {
        let beside = if room > ByteSize::ZERO {
            format!(" (beside {room} kept free for a streamed weight)")
        } else {
            String::new()
        };
        // Residency by use gives up every weight it can first: say what holds the rest.
        let in_flight = self
            .ledger
            .in_flight(device)
            .saturating_add(self.ledger.faulting(device));
        let held = if self.policy.dynamic_vram() {
            format!(
                "; residency by use gave up every weight it could: what is left is {} reserved, {} of kept or pinned weights and {in_flight} of copies in flight",
                self.ledger.reserved(device),
                Self::resident_in(&inner.registry, device)
            )
        } else if in_flight > ByteSize::ZERO {
            format!("; {in_flight} of copies in flight did not come back in time")
        } else {
            String::new()
        };
        Error::OutOfMemory {
            model: format!("reservation `{name}`{beside}{held}"),
            device: device.to_string(),
            required: bytes,
            available: free.saturating_sub(room),
        }
    }

    /// Books `bytes` more for reservation `id` on `device`, evicting (cached casts, then models
    /// not kept) to make room. On error nothing is booked.
    fn book_reservation(
        &self,
        id: u64,
        name: &Arc<str>,
        device: DeviceId,
        bytes: ByteSize,
    ) -> Result<()> {
        self.reservable(name, device)?;
        let mut inner = self.lock_inner();
        // As during a load, no prefetch, fault-in or cached cast books room on the device while
        // the reservation is decided: the free figure checked below stays true until it is
        // booked, and bookings already made can only come back. (Reopened while it waits for
        // copies in flight, below.)
        let mut closed = Some(self.close_every_device());
        cleanup(&mut inner);
        // The books learn what the cleanup dropped before the reservation is added to them.
        self.refresh_ledger(&inner);
        // What a forward streams through stays free beside reservations: the largest weight of
        // the models on the device (a reservation must not leave a streamed weight no room).
        let room = Self::streaming_room(&inner, device);
        let needed = bytes.saturating_add(room);
        // A request no eviction and no return can ever serve: the device's bound less the
        // reservations (which only their owners give back; a growing one's own bytes among
        // them) is below it. Not retryable: evicting and retrying cannot help.
        if self.policy.is_scheduled(device) {
            let total = self.policy.total_memory(device);
            let others = self.ledger.reserved(device);
            if bytes.saturating_add(others) > total {
                let name = name.to_string();
                let stale = Self::take_stale(&mut inner);
                drop(inner);
                drop(stale);
                return Err(Error::BudgetExceeded {
                    model: format!("reservation `{name}`"),
                    device: device.to_string(),
                    required: bytes,
                    budget: total.saturating_sub(others),
                });
            }
        }
        let mut evicted = false;
        for attempt in 0..2 {
            if self.free_in(&inner.registry, device) >= needed {
                break;
            }
            // Evictions only when they make enough room: a reservation that cannot be had
            // evicts nothing (I4).
            evicted |= !self
                .make_room(&mut inner, needed, device, &[], true)
                .is_empty();
            if attempt == 0 && self.free_in(&inner.registry, device) < needed {
                // Copies in flight (a forward's streamed weights, fault-ins) hold room only until
                // their use ends and their buffers are freed: wait for them rather than refuse.
                // The devices reopen meanwhile: a forward on another thread books its copies
                // (closed, it would copy them unbooked, outside the ledger) and can finish and
                // return the room. Dynamic mode's evictions never take a model out of the
                // registry and classic mode keeps nothing by use, so no commit lands on a model
                // this call removed.
                drop(closed.take());
                self.wait_for_transit(&inner, device, needed);
                closed = Some(self.close_every_device());
            }
        }
        // Closed until the lock is released and the view published.
        if let Some(c) = closed.take() {
            inner.hold_closed(c);
        }
        let free = self.free_in(&inner.registry, device);
        if free < needed {
            let e = self.refused(&inner, name, device, bytes, free, room);
            let stale = Self::take_stale(&mut inner);
            drop(inner);
            drop(stale);
            return Err(e);
        }
        if evicted {
            // Evicted copies left the ledger at once, but their device memory is freed in
            // stream order: the engine allocates what it reserved as soon as this returns, so
            // the frees must have run (a GPU's out-of-memory otherwise; the manager lock may
            // wait). Copies a forward on another thread still uses are freed when it lets go.
            if let Some(gpu) = self.engine.devices().gpu(device) {
                if let Err(e) = gpu.synchronize() {
                    tracing::warn!(error = %e, %device, "could not wait for evicted copies' frees");
                }
            }
        }
        self.ledger.add_reserved(id, name, device, bytes);
        self.refresh_ledger(&inner);
        let stale = Self::take_stale(&mut inner);
        drop(inner);
        drop(stale);
        Ok(())
    }
}

impl MemoryManager {
    /// Waits, under the manager lock with `device` closed to new bookings, until copies in
    /// flight there (streamed weights in use, fault-ins, prefetches cancelled by the reclaim)
    /// have given back enough for `needed` bytes to be free, or until none is left to come
    /// back; at most a second, in case a forward on another thread holds its weight long.
    fn wait_for_transit(&self, inner: &super::Inner, device: DeviceId, needed: ByteSize) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1);
        loop {
            let seen = self.ledger.returns();
            let free = self.free_in(&inner.registry, device);
            let transit = self
                .ledger
                .in_flight(device)
                .saturating_add(self.ledger.faulting(device));
            let now = std::time::Instant::now();
            if free >= needed || transit == ByteSize::ZERO || now >= deadline {
                return;
            }
            self.ledger.wait_returned(seen, deadline - now);
        }
    }

    /// The room a forward needs on `device` to stream a weight: the largest weight of the
    /// registered models that lives there (nothing on the CPU, which streams from host memory).
    fn streaming_room(inner: &super::Inner, device: DeviceId) -> ByteSize {
        if device.is_cpu() {
            return ByteSize::ZERO;
        }
        inner
            .registry
            .iter()
            .flat_map(|e| {
                let p = &e.patcher;
                (0..p.model().len())
                    .filter(move |&i| p.weight_device(i) == device)
                    .map(move |i| p.resident_size(i))
            })
            .max()
            .unwrap_or(ByteSize::ZERO)
    }
}

impl MemoryReservation {
    /// Bytes held.
    pub fn bytes(&self) -> ByteSize {
        self.bytes
    }

    /// The device.
    pub fn device(&self) -> DeviceId {
        self.device
    }

    /// The name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Holds `bytes` more (a KV cache's next block), making room on `mm` — the manager that
    /// made it — as [`MemoryManager::reserve`] does.
    ///
    /// # Errors
    /// As [`MemoryManager::reserve`], and [`Error::Device`] when `mm` is another manager; the
    /// reservation is unchanged then.
    pub fn grow(&mut self, mm: &MemoryManager, bytes: ByteSize) -> Result<()> {
        if !Arc::ptr_eq(&self.ledger, &mm.ledger) {
            return Err(Error::Device {
                device: self.device.to_string(),
                reason: format!(
                    "reservation `{}` was made by another memory manager",
                    self.name
                ),
            });
        }
        mm.book_reservation(self.id, &self.name, self.device, bytes)?;
        self.bytes = self.bytes.saturating_add(bytes);
        Ok(())
    }

    /// Returns `bytes` (at most all it holds).
    pub fn shrink(&mut self, bytes: ByteSize) {
        let bytes = bytes.min(self.bytes);
        self.ledger
            .release_reserved(self.id, self.device, bytes, false);
        self.bytes = self.bytes.saturating_sub(bytes);
    }
}

impl Drop for MemoryReservation {
    fn drop(&mut self) {
        self.ledger
            .release_reserved(self.id, self.device, self.bytes, true);
    }
}

impl Drop for KeepGuard {
    fn drop(&mut self) {
        let mut kept = self.kept.lock();
        if let Some(n) = kept.get_mut(&self.model) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                kept.remove(&self.model);
            }
        }
    }
}
