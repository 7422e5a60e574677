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

use super::{cleanup, execute, plan, MemoryManager};
use crate::error::{Error, Result};
use crate::patcher::ModelPatcher;
use crate::size::ByteSize;
use crate::vram::DeviceId;

static NEXT_RESERVATION: AtomicU64 = AtomicU64::new(1);

/// Room held on a device for memory that is not weights; see the [module docs](self).
#[derive(Debug)]
pub struct MemoryReservation<'m> {
    mm: &'m MemoryManager,
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

/// Keeps a model from being evicted while it lives ([`MemoryManager::keep`]).
#[derive(Debug)]
pub struct KeepGuard<'m> {
    mm: &'m MemoryManager,
    model: u64,
}

impl MemoryManager {
    /// Reserves `bytes` on `device` for memory that is not weights (see [`MemoryReservation`]).
    ///
    /// # Errors
    /// [`Error::OutOfMemory`] (retryable) naming the device, the bytes asked for and those free
    /// after evicting what could go; [`Error::Device`] for a device this manager does not
    /// schedule.
    pub fn reserve(&self, device: DeviceId, bytes: ByteSize) -> Result<MemoryReservation<'_>> {
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
    ) -> Result<MemoryReservation<'_>> {
        let name: Arc<str> = Arc::from(name.into());
        let id = NEXT_RESERVATION.fetch_add(1, Ordering::Relaxed);
        self.book_reservation(id, &name, device, bytes)?;
        Ok(MemoryReservation {
            mm: self,
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

    /// Keeps `patcher`'s model: no plan evicts it while the guard lives (guards nest).
    pub fn keep(&self, patcher: &ModelPatcher) -> KeepGuard<'_> {
        let model = patcher.model().id();
        *self.kept.lock().entry(model).or_insert(0) += 1;
        KeepGuard { mm: self, model }
    }

    /// Whether model `id` is kept by a [`KeepGuard`].
    pub(crate) fn is_kept(&self, id: u64) -> bool {
        self.kept.lock().get(&id).is_some_and(|&n| n > 0)
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
        let exists = match device {
            DeviceId::Cuda(n) => self.policy.hardware().gpu(n).is_some(),
            DeviceId::Sim(_) => self.engine.devices().gpu(device).is_some(),
            DeviceId::Cpu => true,
        };
        if !exists || !self.policy.is_scheduled(device) {
            return Err(Error::Device {
                device: device.to_string(),
                reason: format!(
                    "reservation `{name}`: this manager does not schedule {device} (its compute device is {})",
                    self.policy.compute_device()
                ),
            });
        }
        if bytes == ByteSize::ZERO {
            self.ledger.add_reserved(id, name, device, bytes);
            return Ok(());
        }
        let mut inner = self.inner.lock();
        cleanup(&mut inner);
        if self.free_in(&inner.registry, device) < bytes {
            self.drop_casts(&inner, device);
        }
        if self.free_in(&inner.registry, device) < bytes {
            let mut planner = plan::Planner::new(self, &inner);
            planner.evict(bytes, device, &[]);
            let (evictions, steps) = planner.into_evictions();
            let mut undo = execute::Undo::new(&inner);
            self.execute_evictions(&mut inner, &steps, &mut undo);
            execute::log_evictions(&evictions);
            self.refresh_ledger(&inner);
        }
        let free = self.free_in(&inner.registry, device);
        if free < bytes {
            let stale = Self::take_stale(&mut inner);
            drop(inner);
            drop(stale);
            return Err(Error::OutOfMemory {
                model: format!("reservation `{name}`"),
                device: device.to_string(),
                required: bytes,
                available: free,
            });
        }
        self.ledger.add_reserved(id, name, device, bytes);
        self.refresh_ledger(&inner);
        let stale = Self::take_stale(&mut inner);
        drop(inner);
        drop(stale);
        Ok(())
    }
}

impl MemoryReservation<'_> {
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

    /// Holds `bytes` more (a KV cache's next block), making room as [`MemoryManager::reserve`]
    /// does.
    ///
    /// # Errors
    /// As [`MemoryManager::reserve`]; the reservation is unchanged then.
    pub fn grow(&mut self, bytes: ByteSize) -> Result<()> {
        self.mm
            .book_reservation(self.id, &self.name, self.device, bytes)?;
        self.bytes = self.bytes.saturating_add(bytes);
        Ok(())
    }

    /// Returns `bytes` (at most all it holds).
    pub fn shrink(&mut self, bytes: ByteSize) {
        let bytes = bytes.min(self.bytes);
        self.mm
            .ledger
            .release_reserved(self.id, self.device, bytes, false);
        self.bytes = self.bytes.saturating_sub(bytes);
    }
}

impl Drop for MemoryReservation<'_> {
    fn drop(&mut self) {
        self.mm
            .ledger
            .release_reserved(self.id, self.device, self.bytes, true);
    }
}

impl Drop for KeepGuard<'_> {
    fn drop(&mut self) {
        let mut kept = self.mm.kept.lock();
        if let Some(n) = kept.get_mut(&self.model) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                kept.remove(&self.model);
            }
        }
    }
}
