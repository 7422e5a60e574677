//! The host tier: clean weights held in host RAM, within a budget, and page-locked in place
//! within a pin budget (docs/ARCHITECTURE.md §3).
//!
//! A model read lazily ([`Model::from_safetensors_lazy`](super::Model::from_safetensors_lazy))
//! keeps its weights in its files. The first time a clean weight is asked for
//! ([`Slot::clean`](super::Slot::clean)), a [`HostTier`] reads it into a host buffer of its own
//! and holds that *host copy* until memory is needed; later asks are served from it. The tier's
//! **ledger** is the bytes of the host copies it holds plus the bytes being read right now, and
//! with a budget (`--ram-budget`) it never exceeds it (I2 extends to the host,
//! docs/ARCHITECTURE.md §4.2):
//!
//! - exact: the ledger changes only under the tier's lock, by exactly the bytes of the copy
//!   inserted, evicted or being read ([`HostTier::held_copies`] lets tests sum it);
//! - bounded: a read first reserves its bytes, evicting host copies until they fit; a weight
//!   larger than the whole budget is [`Error::BudgetExceeded`] (nothing can make it fit); when
//!   only reads in progress on other threads hold the rest, the read waits for them.
//!
//! The ledger counts the copies the tier holds. A forward using a weight at the moment its copy
//! is evicted keeps those bytes alive until the layer drops the tensor (like any activation), and
//! on a CPU compute device a resident copy in the storage dtype shares the host copy's memory
//! (it is counted in the device's ledger as well).
//!
//! **Eviction order** ([`eviction_order`]), the device rule of docs/ARCHITECTURE.md §5 adapted to
//! the host. There, the models being loaded are never evicted and the others go most offloaded
//! first; here the model being read plays the part of the model being loaded:
//!
//! 1. copies of weights that have a resident copy on a device first (computing never reads them);
//! 2. then copies of *other* models: the model with the most bytes not held on the host first
//!    ("most offloaded": it streams from disk anyway), then the model used least recently;
//! 3. the model being read gives up its own copies last, the copy *read* most recently first. A
//!    model streamed through a tight budget in forward order then keeps a stable prefix of its
//!    weights on the host (least recently used would evict exactly the weight the next forward
//!    needs first, and hit never).
//!
//! So the model in use gets the whole budget: in the pipeline example the denoiser's steps are
//! not starved by the host copies of the text encoder and decoder, which are read again once per
//! prompt.
//!
//! Evicting a copy is not a change I4 protects: a host copy is a cache of bytes in a file, and
//! the same bits come back when it is read again (I3). A read that fails (the file was truncated
//! or removed underneath) is an [`Error::File`] naming the file and the tensor; the copies it
//! evicted to make room stay evicted, and nothing else changes.
//!
//! **Pinning in place.** [`HostTier::try_pin`] page-locks a host copy where it lives (a
//! [`PinnedWeight`]), so the weight's GPU copies DMA straight from it; the pinned bytes stay
//! within the pin budget ([`crate::vram::pin_budget`] less the staging pool's limit). The driver
//! locks whole pages and refuses a range touching a locked page, so a host copy large enough to
//! pin ([`MIN_PIN_BYTES`]) is read onto pages of its own (`page.rs`: a page-aligned start inside
//! an allocation that holds its last page too, under two pages of slack the ledger does not
//! count) and its pin locks exactly those whole pages (booked so in the pinned total): pins of
//! neighbouring weights never collide. A pin beyond the budget, or one the driver refuses, fails
//! softly: the weight is staged as before, and the pinned total is unchanged. A weight is
//! unpinned when it becomes resident on a GPU, when its host copy is evicted and when its model
//! is dropped.
//!
//! Locks: `HostTier::books` is `Rank::HostTier` in the crate's lock table (`src/lock/rank.rs`). It
//! is taken inside `Model::state` when a weight's residency changes, never held across a file
//! read, a driver call or a wait on a copy: evicted copies and released pins are dropped after it
//! is released (a pin released under `Model::state` goes back to the caller, which drops it after
//! that lock too). A read waiting for room, and a thread waiting for another's pin of the same
//! weight (a weight is page-locked once), wait on the tier's condition variable, which releases it.
//!
//! Trace (`residency::trace`): each read is a `host_read` span, each eviction a `host_evict`
//! event, and the ledger a `host` counter (held, reading, budget), all emitted after the lock is
//! released.
//!
//! Complexity: a hit is O(1); a read that evicts sorts the held copies, O(n log n).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::lock::{Condvar, Mutex, Rank};
use candle_core::Tensor;

use super::pin::PinnedWeight;
use crate::device::Gpu;
use crate::error::{Error, Result};
use crate::size::ByteSize;
use crate::vram::DeviceId;

/// Weights smaller than this are not pinned in place: staging them costs little. Weights of at
/// least this size are read onto pages of their own (`page.rs`), whose slack (under two pages)
/// would be a large share of a smaller one.
pub const MIN_PIN_BYTES: ByteSize = ByteSize::kib(256);

/// A host copy: which weight of which model.
type Key = (u64, usize);

struct HostCopy {
    tensor: Tensor,
    bytes: u64,
    /// Clock value of the read that made it.
    read_at: u64,
    /// Clock value of its last use (the read or a hit).
    used_at: u64,
}

#[derive(Default)]
struct Books {
    copies: HashMap<Key, HostCopy>,
    /// Lazily read models: id → bytes of their weights on disk.
    models: HashMap<u64, u64>,
    held: u64,
    reading: u64,
    peak: u64,
    clock: u64,
    /// Weights with a resident copy, and its device.
    resident: HashMap<Key, DeviceId>,
    pins: HashMap<Key, Arc<PinnedWeight>>,
    /// Weights a thread is page-locking now: another thread streaming the same weight waits
    /// for that pin instead of copying from memory that is about to be page-locked.
    pinning: std::collections::HashSet<Key>,
    /// Bytes pinned, including pins being made.
    pinned: u64,
    reads: u64,
    bytes_read: u64,
    hits: u64,
    evictions: u64,
    pin_failures: u64,
    /// The budget in bytes (0: none), for the trace's counter.
    budget: u64,
}

/// A sample of the host tier's counter (`residency::trace`), taken under the lock and emitted
/// after it is released.
#[derive(Debug, Clone, Copy)]
struct HostSample {
    held: u64,
    reading: u64,
    budget: u64,
}

impl HostSample {
    fn emit(self) {
        let HostSample {
            held,
            reading,
            budget,
        } = self;
        tracing::debug!(target: "residency::counter", counter = "host", held, reading, budget);
    }
}

impl Books {
    fn sample(&self) -> HostSample {
        HostSample {
            held: self.held,
            reading: self.reading,
            budget: self.budget,
        }
    }

    fn note_peak(&mut self) {
        self.peak = self.peak.max(self.held + self.reading);
    }

    /// Removes a host copy and its pin; returns them to be dropped after the lock.
    fn remove(&mut self, key: Key, out: &mut Released) {
        if let Some(c) = self.copies.remove(&key) {
            self.held -= c.bytes;
            self.evictions += 1;
            out.copies.push(c.tensor);
            if tracing::enabled!(tracing::Level::DEBUG) {
                out.evicted.push((key, c.bytes));
                out.sample = Some(self.sample());
            }
        }
        self.unpin(key, out);
    }

    fn unpin(&mut self, key: Key, out: &mut Released) {
        if let Some(p) = self.pins.remove(&key) {
            self.pinned = self.pinned.saturating_sub(p.size().bytes());
            out.pins.push(p);
        }
    }

    /// The held copies in eviction order for a read of model `reading` (see [`eviction_order`]).
    fn victims(&self, reading: u64) -> Vec<Key> {
        let mut per_model: HashMap<u64, (u64, u64)> = HashMap::new();
        for (k, c) in &self.copies {
            let e = per_model.entry(k.0).or_default();
            e.0 += c.bytes;
            e.1 = e.1.max(c.used_at);
        }
        let keys: Vec<Key> = self.copies.keys().copied().collect();
        let views: Vec<CopyView> = keys
            .iter()
            .map(|k| {
                let c = &self.copies[k];
                let (held, used) = per_model[&k.0];
                CopyView {
                    model: k.0,
                    reading: k.0 == reading,
                    device_resident: self.resident.contains_key(k),
                    model_on_disk: self
                        .models
                        .get(&k.0)
                        .copied()
                        .unwrap_or(0)
                        .saturating_sub(held),
                    model_used_at: used,
                    read_at: c.read_at,
                }
            })
            .collect();
        eviction_order(&views)
            .into_iter()
            .map(|i| keys[i])
            .collect()
    }
}

/// What to drop once the books are unlocked (freeing memory, waiting on a copy, unlocking pages).
#[derive(Default)]
struct Released {
    copies: Vec<Tensor>,
    pins: Vec<Arc<PinnedWeight>>,
    /// Copies evicted, and the counter after, for the trace (only when a subscriber listens).
    evicted: Vec<(Key, u64)>,
    sample: Option<HostSample>,
}

impl Drop for Released {
    fn drop(&mut self) {
        for &((model_id, index), bytes) in &self.evicted {
            tracing::debug!(model_id, index, bytes, "host_evict");
        }
        if let Some(s) = self.sample.take() {
            s.emit();
        }
    }
}

struct Shared {
    budget: Option<ByteSize>,
    pin_budget: ByteSize,
    gpu: Option<Gpu>,
    books: Mutex<Books>,
    room: Condvar,
    pin_warned: AtomicBool,
}

/// The host tier: a ledger of host copies of lazily read weights, bounded by a budget, and the
/// weights page-locked in place (see the module docs). Cloning shares it.
#[derive(Clone)]
pub struct HostTier {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for HostTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostTier")
            .field("budget", &self.shared.budget)
            .field("ledger", &self.ledger())
            .field("pin_budget", &self.shared.pin_budget)
            .finish()
    }
}

/// Where the host tier stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct HostStats {
    /// The budget (`--ram-budget`); `None`: unbounded.
    pub budget: Option<ByteSize>,
    /// Bytes of host copies held plus bytes being read.
    pub ledger: ByteSize,
    /// The highest ledger seen.
    pub peak: ByteSize,
    /// Host copies held.
    pub weights_held: usize,
    /// Weights read from their files.
    pub reads: u64,
    /// Bytes read from files.
    pub bytes_read: ByteSize,
    /// Asks served by a held copy.
    pub hits: u64,
    /// Host copies evicted.
    pub evictions: u64,
    /// Bytes page-locked in place (whole pages: a weight's bytes rounded out to its pages).
    pub pinned: ByteSize,
    /// The most that may be page-locked in place.
    pub pin_budget: ByteSize,
    /// Pins refused by the driver (those weights were staged instead).
    pub pin_failures: u64,
}

/// One held host copy, for inspection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct HeldCopy {
    /// The model's id ([`crate::weights::Model::id`]).
    pub model_id: u64,
    /// The weight's slot index.
    pub index: usize,
    /// Its bytes.
    pub bytes: ByteSize,
    /// Whether it is page-locked in place.
    pub pinned: bool,
}

/// A held host copy as the eviction order sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CopyView {
    pub(crate) model: u64,
    /// Whether this copy's model is the one being read.
    pub(crate) reading: bool,
    pub(crate) device_resident: bool,
    /// Bytes of the model's weights not held on the host.
    pub(crate) model_on_disk: u64,
    /// Clock of the model's most recent use.
    pub(crate) model_used_at: u64,
    /// Clock of the read that made this copy.
    pub(crate) read_at: u64,
}

/// The order host copies are evicted in (indices into `copies`), pure: copies of
/// device-resident weights first; then other models' copies, the model with most bytes on disk
/// first, then the least recently used; the model being read last; within a model, the most
/// recently read copy first. Ties keep model id order, so the result is deterministic.
pub(crate) fn eviction_order(copies: &[CopyView]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..copies.len()).collect();
    order.sort_by_key(|&i| {
        let c = &copies[i];
        (
            !c.device_resident,
            c.reading,
            std::cmp::Reverse(c.model_on_disk),
            c.model_used_at,
            c.model,
            std::cmp::Reverse(c.read_at),
        )
    });
    order
}

impl HostTier {
    /// A tier holding at most `budget` bytes of host copies (`None`: unbounded), pinning nothing.
    pub fn new(budget: Option<ByteSize>) -> HostTier {
        HostTier::with_pinning(budget, ByteSize::ZERO, None)
    }

    /// A tier that also page-locks host copies in place for `gpu` (CUDA or simulated), up to
    /// `pin_budget`.
    pub fn with_pinning(
        budget: Option<ByteSize>,
        pin_budget: ByteSize,
        gpu: Option<Gpu>,
    ) -> HostTier {
        HostTier {
            shared: Arc::new(Shared {
                budget,
                pin_budget: if gpu.is_some() {
                    pin_budget
                } else {
                    ByteSize::ZERO
                },
                gpu,
                books: Mutex::new(
                    Rank::HostTier,
                    Books {
                        budget: budget.map_or(0, ByteSize::bytes),
                        ..Books::default()
                    },
                ),
                room: Condvar::new(),
                pin_warned: AtomicBool::new(false),
            }),
        }
    }

    /// The budget.
    pub fn budget(&self) -> Option<ByteSize> {
        self.shared.budget
    }

    /// The ledger: bytes of host copies held plus bytes being read.
    pub fn ledger(&self) -> ByteSize {
        let b = self.shared.books.lock();
        ByteSize(b.held + b.reading)
    }

    /// The highest ledger seen.
    pub fn peak(&self) -> ByteSize {
        ByteSize(self.shared.books.lock().peak)
    }

    /// Bytes page-locked in place.
    pub fn pinned(&self) -> ByteSize {
        ByteSize(self.shared.books.lock().pinned)
    }

    /// Whether two handles are the same tier.
    pub fn same(&self, other: &HostTier) -> bool {
        Arc::ptr_eq(&self.shared, &other.shared)
    }

    /// Counters and figures.
    pub fn stats(&self) -> HostStats {
        let b = self.shared.books.lock();
        HostStats {
            budget: self.shared.budget,
            ledger: ByteSize(b.held + b.reading),
            peak: ByteSize(b.peak),
            weights_held: b.copies.len(),
            reads: b.reads,
            bytes_read: ByteSize(b.bytes_read),
            hits: b.hits,
            evictions: b.evictions,
            pinned: ByteSize(b.pinned),
            pin_budget: self.shared.pin_budget,
            pin_failures: b.pin_failures,
        }
    }

    /// Every held host copy, in no particular order.
    pub fn held_copies(&self) -> Vec<HeldCopy> {
        let b = self.shared.books.lock();
        b.copies
            .iter()
            .map(|(k, c)| HeldCopy {
                model_id: k.0,
                index: k.1,
                bytes: ByteSize(c.bytes),
                pinned: b.pins.contains_key(k),
            })
            .collect()
    }

    /// Whether weight `index` of model `model_id` is held on the host.
    pub fn holds(&self, model_id: u64, index: usize) -> bool {
        self.shared
            .books
            .lock()
            .copies
            .contains_key(&(model_id, index))
    }

    /// Evicts every host copy (they are read again when needed). Returns the bytes released.
    pub fn trim(&self) -> ByteSize {
        let mut out = Released::default();
        let freed = {
            let mut b = self.shared.books.lock();
            let before = b.held;
            let keys: Vec<Key> = b.copies.keys().copied().collect();
            for k in keys {
                b.remove(k, &mut out);
            }
            before - b.held
        };
        self.shared.room.notify_all();
        drop(out);
        ByteSize(freed)
    }

    /// Registers a lazily read model of `bytes` on disk.
    pub(crate) fn register_model(&self, model_id: u64, bytes: ByteSize) {
        self.shared
            .books
            .lock()
            .models
            .insert(model_id, bytes.bytes());
    }

    /// Forgets model `model_id`: its host copies, pins and marks (it was dropped).
    pub(crate) fn forget_model(&self, model_id: u64) {
        let mut out = Released::default();
        {
            let mut b = self.shared.books.lock();
            b.models.remove(&model_id);
            let keys: Vec<Key> = b
                .copies
                .keys()
                .chain(b.pins.keys())
                .filter(|k| k.0 == model_id)
                .copied()
                .collect();
            for k in keys {
                b.remove(k, &mut out);
            }
            b.resident.retain(|k, _| k.0 != model_id);
        }
        self.shared.room.notify_all();
        drop(out);
    }

    /// Weight `key` gained (`Some(device)`) or lost (`None`) its resident copy. A weight resident
    /// on a GPU is unpinned: its uses no longer copy from the host. Called under `Model::state`.
    ///
    /// Returns the pin released when the weight became GPU-resident: the caller drops it once it
    /// holds no lock (unpinning waits for the last copy out of the weight).
    #[must_use = "a released pin must be dropped outside every lock"]
    pub(crate) fn note_resident(
        &self,
        model_id: u64,
        index: usize,
        device: Option<DeviceId>,
    ) -> Vec<Arc<PinnedWeight>> {
        let key = (model_id, index);
        let mut out = Released::default();
        {
            let mut b = self.shared.books.lock();
            match device {
                Some(d) => {
                    b.resident.insert(key, d);
                    if !d.is_cpu() {
                        b.unpin(key, &mut out);
                    }
                }
                None => {
                    b.resident.remove(&key);
                }
            }
        }
        // Unpinning waits for the last copy from the weight (long done: the weight just became
        // resident from a copy ordered after it): the caller drops the pin outside its locks.
        std::mem::take(&mut out.pins)
    }

    /// The host copy of weight `index` of model `model_id`: held, or read now by `read` (which
    /// returns a tensor of `bytes` bytes, using up to `reserve ≥ bytes` while it runs) after
    /// making room for it. `describe` names the model and weight for errors.
    ///
    /// # Errors
    /// [`Error::BudgetExceeded`] when `reserve` is more than the whole budget; what `read`
    /// returns.
    pub(crate) fn get(
        &self,
        model_id: u64,
        index: usize,
        bytes: ByteSize,
        reserve: ByteSize,
        describe: impl Fn() -> String,
        read: impl FnOnce() -> Result<Tensor>,
    ) -> Result<Tensor> {
        let key = (model_id, index);
        let need = reserve.max(bytes).bytes();
        let mut out = Released::default();
        {
            let mut b = self.shared.books.lock();
            loop {
                b.clock += 1;
                let now = b.clock;
                if let Some(c) = b.copies.get_mut(&key) {
                    c.used_at = now;
                    let t = c.tensor.clone();
                    b.hits += 1;
                    return Ok(t);
                }
                let Some(budget) = self.shared.budget else {
                    break;
                };
                if need > budget.bytes() {
                    return Err(Error::BudgetExceeded {
                        model: describe(),
                        device: "host (--ram-budget)".into(),
                        required: ByteSize(need),
                        budget,
                    });
                }
                if b.held + b.reading + need > budget.bytes() {
                    for victim in b.victims(model_id) {
                        if b.held + b.reading + need <= budget.bytes() {
                            break;
                        }
                        b.remove(victim, &mut out);
                    }
                }
                if b.held + b.reading + need <= budget.bytes() {
                    break;
                }
                // Only reads in progress elsewhere hold the rest: wait for one to finish.
                self.shared.room.wait(&mut b);
            }
            b.reading += need;
            b.note_peak();
            out.sample = Some(b.sample());
        }
        drop(out);
        let r = {
            let _span =
                tracing::debug_span!("host_read", model_id, index, bytes = bytes.bytes()).entered();
            read()
        };
        let mut b = self.shared.books.lock();
        b.reading -= need;
        let r = r.map(|t| {
            b.reads += 1;
            b.bytes_read += bytes.bytes();
            b.clock += 1;
            let now = b.clock;
            match b.copies.get(&key) {
                // Another thread read it meanwhile: keep one copy.
                Some(c) => c.tensor.clone(),
                None => {
                    b.held += bytes.bytes();
                    b.copies.insert(
                        key,
                        HostCopy {
                            tensor: t.clone(),
                            bytes: bytes.bytes(),
                            read_at: now,
                            used_at: now,
                        },
                    );
                    t
                }
            }
        });
        b.note_peak();
        let sample = b.sample();
        drop(b);
        self.shared.room.notify_all();
        if tracing::enabled!(target: "residency::counter", tracing::Level::DEBUG) {
            sample.emit();
        }
        r
    }

    /// The pin of weight `index` of model `model_id`, if it is pinned now.
    pub(crate) fn pin_of(&self, model_id: u64, index: usize) -> Option<Arc<PinnedWeight>> {
        self.shared
            .books
            .lock()
            .pins
            .get(&(model_id, index))
            .cloned()
    }

    /// Page-locks `tensor`, the host copy of weight `index` of model `model_id`, in place, when
    /// the pin budget allows; returns the pin (or the one already there). `None` when it cannot:
    /// no page-locking on this machine, too small, over the budget, or refused by the driver —
    /// then the weight is staged and the pinned total is unchanged.
    pub(crate) fn try_pin(
        &self,
        model_id: u64,
        index: usize,
        tensor: &Tensor,
        lazy: bool,
    ) -> Option<Arc<PinnedWeight>> {
        let gpu = self.shared.gpu.as_ref()?;
        // What the pin locks (whole pages for a weight the crate read) is what it is budgeted.
        let (bytes, len) = super::pin::pin_extent(tensor)?;
        if bytes < MIN_PIN_BYTES.bytes() {
            return None;
        }
        let key = (model_id, index);
        {
            let mut b = self.shared.books.lock();
            // Pinned once: a second thread streaming the same weight waits for the first's pin
            // (the driver would refuse a second registration, and a copy from the bytes then
            // runs from page-locked memory that the winner's fences do not track).
            while b.pinning.contains(&key) {
                self.shared.room.wait(&mut b);
            }
            if let Some(p) = b.pins.get(&key) {
                return Some(Arc::clone(p));
            }
            if b.pinned + len > self.shared.pin_budget.bytes() {
                return None;
            }
            b.pinned += len;
            b.pinning.insert(key);
        }
        let pinned = PinnedWeight::lock(tensor, gpu.clone());
        let mut out = Released::default();
        let mut b = self.shared.books.lock();
        b.pinned -= len;
        b.pinning.remove(&key);
        self.shared.room.notify_all();
        let pin = match pinned {
            Ok(p) => Arc::new(p),
            Err(e) => {
                b.pin_failures += 1;
                drop(b);
                if !self.shared.pin_warned.swap(true, Ordering::Relaxed) {
                    tracing::warn!(error = %e, "page-locking a weight in place failed; it is staged instead");
                    crate::warnings::echo("pin-in-place", || {
                        format!("page-locking a weight in place failed ({e}); it is staged instead")
                    });
                }
                return None;
            }
        };
        // The copy may have been evicted, or the weight become resident on a GPU, meanwhile.
        let on_gpu = b.resident.get(&key).is_some_and(|d| !d.is_cpu());
        let stale = (lazy && !b.copies.contains_key(&key)) || on_gpu || b.pins.contains_key(&key);
        if stale {
            let existing = b.pins.get(&key).cloned();
            out.pins.push(pin);
            drop(b);
            drop(out);
            return existing;
        }
        b.pinned += pin.size().bytes();
        b.pins.insert(key, Arc::clone(&pin));
        drop(b);
        Some(pin)
    }
}

#[cfg(test)]
mod tests;
