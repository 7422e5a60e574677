//! The manual-cast cache: resident weights kept in the compute dtype as well, so a
//! [`OpsMode::ManualCast`](super::OpsMode::ManualCast) layer whose weights are resident casts each
//! of them once instead of at every call.
//!
//! A forward that finds a weight resident but stored in another dtype than it computes in (bf16
//! storage, f32 compute; fp8 codes with a scale) casts it with the one cast step every layer uses
//! and, when the model has a cache, offers the result to it. The cache keeps it only if the
//! device's ledger has room: every cached copy holds a reservation on a [`PrefetchGate`] (the
//! memory manager's ledger, through its column for cached casts), granted only when `resident +
//! in flight + cached + bytes + keep_free ≤ total`, where `keep_free` is the memory the model's
//! last load asked to keep free. A refused copy is not an error: that weight is cast at every
//! call, as without a cache.
//!
//! The cache never changes a bit (I3): a cached copy is the output of the same cast of the same
//! resident tensor, and it is used only when everything that tensor depends on is unchanged — the
//! weight, the model's residency generation (any change of any resident copy bumps it), the
//! patcher's fingerprint of the weight (its patch list and resident dtype), the compute dtype and
//! the weight's scale. Anything else is a miss; the entry is replaced.
//!
//! Under pressure the cache goes first: the memory manager plans loads as if cached bytes were
//! free, drops a device's caches before a load that needs their room (and in
//! [`crate::loader::MemoryManager::free_memory`]) and drops a model's cache when its residency
//! changes — never a resident weight for a cached cast.
//!
//! Lock: `CastCache::entries` is `Rank::CastCache` in the crate's lock table (`src/lock/rank.rs`;
//! never held with a streamer's queue): held to look up, insert or take entries out, and while a
//! new entry's reservation is taken on the ledger (`Rank::LedgerBooks`), so a load clearing the caches cannot miss an
//! entry whose bytes are already booked. Entries are dropped, and their bytes returned, after it
//! is let go.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::lock::{Mutex, Rank};
use candle_core::Tensor;

use crate::error::Result;
use crate::float::Dtype;
use crate::offload::{PrefetchGate, Reservation};
use crate::size::ByteSize;
use crate::vram::DeviceId;
use crate::weights::Fingerprint;

/// What a cached cast was made from: used only when all of it matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CastKey {
    pub(crate) generation: u64,
    pub(crate) fingerprint: Fingerprint,
    pub(crate) compute: Dtype,
    /// The weight's per-tensor scale, as bits.
    pub(crate) scale: Option<u32>,
}

struct Cached {
    key: CastKey,
    tensor: Tensor,
    reservation: Reservation,
}

/// What a model's manual-cast cache holds and has done ([`cast_cache_stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CastCacheStats {
    /// Bytes of cached casts now.
    pub bytes: ByteSize,
    /// Forwards served a cached cast.
    pub hits: u64,
    /// Casts made and kept.
    pub kept: u64,
    /// Casts made but not kept: the ledger had no room.
    pub refused: u64,
}

/// One model's cached casts on its load device (see the module docs).
pub struct CastCache {
    gate: Arc<dyn PrefetchGate>,
    device: DeviceId,
    keep_free: AtomicU64,
    entries: Mutex<HashMap<usize, Cached>>,
    hits: AtomicU64,
    kept: AtomicU64,
    refused: AtomicU64,
}

impl std::fmt::Debug for CastCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CastCache")
            .field("device", &self.device)
            .field("bytes", &self.bytes())
            .field("stats", &self.stats())
            .finish()
    }
}

impl CastCache {
    /// A cache booking its copies on `gate` for `device`, keeping `keep_free` bytes free.
    pub(crate) fn new(gate: Arc<dyn PrefetchGate>, device: DeviceId, keep_free: ByteSize) -> Self {
        CastCache {
            gate,
            device,
            keep_free: AtomicU64::new(keep_free.bytes()),
            entries: Mutex::new(Rank::CastCache, HashMap::new()),
            hits: AtomicU64::new(0),
            kept: AtomicU64::new(0),
            refused: AtomicU64::new(0),
        }
    }

    /// The device whose ledger books the copies.
    pub fn device(&self) -> DeviceId {
        self.device
    }

    /// Whether this cache books on `gate`.
    pub(crate) fn uses_gate(&self, gate: &Arc<dyn PrefetchGate>) -> bool {
        Arc::ptr_eq(&self.gate, gate)
    }

    /// Sets the memory to keep free from now on.
    pub(crate) fn set_keep_free(&self, keep_free: ByteSize) {
        self.keep_free.store(keep_free.bytes(), Ordering::Relaxed);
    }

    /// Bytes of cached casts.
    pub fn bytes(&self) -> ByteSize {
        self.entries
            .lock()
            .values()
            .map(|c| c.reservation.bytes())
            .sum()
    }

    /// Bytes held, hits, kept casts and refusals so far.
    pub fn stats(&self) -> CastCacheStats {
        CastCacheStats {
            bytes: self.bytes(),
            hits: self.hits.load(Ordering::Relaxed),
            kept: self.kept.load(Ordering::Relaxed),
            refused: self.refused.load(Ordering::Relaxed),
        }
    }

    /// Drops every cached cast, returning its bytes to the ledger; returns how many bytes.
    pub(crate) fn clear(&self) -> ByteSize {
        let taken: Vec<Cached> = self.entries.lock().drain().map(|(_, c)| c).collect();
        let bytes: ByteSize = taken.iter().map(|c| c.reservation.bytes()).sum();
        if !taken.is_empty() {
            tracing::debug!(device = %self.device, weights = taken.len(), bytes = bytes.bytes(),
                reason = "cleared", "cast_dropped");
        }
        bytes
    }

    /// Takes out the entries made at another residency generation than `generation`.
    pub(crate) fn take_stale(&self, generation: u64) -> usize {
        let stale: Vec<Cached> = {
            let mut entries = self.entries.lock();
            let keys: Vec<usize> = entries
                .iter()
                .filter(|(_, c)| c.key.generation != generation)
                .map(|(&i, _)| i)
                .collect();
            keys.iter().filter_map(|i| entries.remove(i)).collect()
        };
        if !stale.is_empty() {
            let bytes: ByteSize = stale.iter().map(|c| c.reservation.bytes()).sum();
            tracing::debug!(device = %self.device, weights = stale.len(), bytes = bytes.bytes(),
                reason = "stale", "cast_dropped");
        }
        stale.len()
    }

    /// The cast of weight `index` under `key`: the cached copy when it matches, else `cast()`,
    /// kept when the ledger has room for it.
    pub(crate) fn get_or_cast(
        &self,
        index: usize,
        key: CastKey,
        cast: impl FnOnce() -> Result<Tensor>,
    ) -> Result<Tensor> {
        // An entry under another key is stale: taken out (and its bytes returned) before the new
        // copy asks for room, so a replacement never counts twice.
        let stale = {
            let mut entries = self.entries.lock();
            match entries.get(&index) {
                Some(c) if c.key == key => {
                    self.hits.fetch_add(1, Ordering::Relaxed);
                    return Ok(c.tensor.clone());
                }
                Some(_) => entries.remove(&index),
                None => None,
            }
        };
        drop(stale);
        let tensor = cast()?;
        let bytes = ByteSize((tensor.elem_count() * tensor.dtype().size_in_bytes()) as u64);
        let keep_free = ByteSize(self.keep_free.load(Ordering::Relaxed));
        // The reservation is taken and the entry inserted under one lock: a load that drops the
        // caches (it takes this lock to clear them) either finds the entry or came first, and
        // then the ledger refuses the reservation while it runs.
        let mut entries = self.entries.lock();
        let Some(reservation) = Reservation::take(&self.gate, self.device, bytes, keep_free) else {
            drop(entries);
            self.refused.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(device = %self.device, weight = index, bytes = bytes.bytes(), "cast_refused");
            return Ok(tensor);
        };
        let cached = Cached {
            key,
            tensor: tensor.clone(),
            reservation,
        };
        // Two forwards may race to cache the same weight: the one replaced is dropped outside
        // the lock.
        let replaced = entries.insert(index, cached);
        drop(entries);
        self.kept.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(device = %self.device, weight = index, bytes = bytes.bytes(), "cast_kept");
        drop(replaced);
        Ok(tensor)
    }
}

/// What the manual-cast cache of `patcher`'s model holds and has done; `None` when the model has
/// none (it is not loaded by a memory manager on a device with a bound).
pub fn cast_cache_stats(patcher: &crate::patcher::ModelPatcher) -> Option<CastCacheStats> {
    cast_cache_of(patcher.model()).map(|c| c.stats())
}

/// The cast cache attached to `model`, if any.
pub(crate) fn cast_cache_of(model: &crate::weights::Model) -> Option<Arc<CastCache>> {
    model
        .cast_hook()
        .and_then(|h| h.downcast::<CastCache>().ok())
}

/// Attaches `cache` to `model` (every patcher of the model then caches through it), or detaches
/// with `None`; returns the cache it replaced, for the caller to drop outside its locks.
pub(crate) fn attach_cast_cache(
    model: &crate::weights::Model,
    cache: Option<Arc<CastCache>>,
) -> Option<Arc<CastCache>> {
    model
        .set_cast_hook(cache.map(|c| c as Arc<dyn std::any::Any + Send + Sync>))
        .and_then(|h| h.downcast::<CastCache>().ok())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// A gate with a bound, counting what it booked (ranked as the ledger it stands in for).
    struct Books {
        total: u64,
        booked: Mutex<u64>,
    }

    impl Books {
        fn new(total: u64) -> Books {
            Books {
                total,
                booked: Mutex::new(Rank::LedgerBooks, 0),
            }
        }
    }

    impl PrefetchGate for Books {
        fn try_reserve(&self, _: DeviceId, bytes: ByteSize, keep_free: ByteSize) -> bool {
            let mut b = self.booked.lock();
            if *b + bytes.bytes() + keep_free.bytes() > self.total {
                return false;
            }
            *b += bytes.bytes();
            true
        }
        fn release(&self, _: DeviceId, bytes: ByteSize) {
            *self.booked.lock() -= bytes.bytes();
        }
    }

    fn key(generation: u64) -> CastKey {
        CastKey {
            generation,
            fingerprint: 7,
            compute: Dtype::F32,
            scale: None,
        }
    }

    fn t(n: usize) -> Tensor {
        Tensor::zeros(n, candle_core::DType::F32, &Device::Cpu).unwrap()
    }

    #[test]
    fn a_cast_is_kept_within_the_bound_and_served_until_its_key_changes() {
        let books = Arc::new(Books::new(100));
        let gate: Arc<dyn PrefetchGate> = books.clone();
        let c = CastCache::new(gate, DeviceId::Cpu, ByteSize(20));
        let mut casts = 0;
        let mut get = |i, k| {
            c.get_or_cast(i, k, || {
                casts += 1;
                Ok(t(10))
            })
            .unwrap()
        };
        get(0, key(1));
        get(0, key(1));
        assert_eq!(*books.booked.lock(), 40, "one copy of 40 bytes");
        get(0, key(2));
        assert_eq!(*books.booked.lock(), 40, "replaced, not added");
        get(1, key(2));
        assert_eq!(*books.booked.lock(), 80, "80 + 20 to keep free fits in 100");
        get(2, key(2));
        assert_eq!(
            *books.booked.lock(),
            80,
            "a third copy would not fit: refused"
        );
        assert_eq!(casts, 4, "one hit, four casts");
        assert_eq!(
            c.stats(),
            CastCacheStats {
                bytes: ByteSize(80),
                hits: 1,
                kept: 3,
                refused: 1
            }
        );
        assert_eq!(c.bytes(), ByteSize(80));
        assert_eq!(c.take_stale(2), 0);
        assert_eq!(c.take_stale(3), 2);
        assert_eq!(
            *books.booked.lock(),
            0,
            "stale entries returned their bytes"
        );
    }

    /// A cache keeping nothing free, on a gate bounded at `total` bytes.
    fn cache(total: u64) -> (Arc<Books>, CastCache) {
        let books = Arc::new(Books::new(total));
        let gate: Arc<dyn PrefetchGate> = books.clone();
        (books, CastCache::new(gate, DeviceId::Cpu, ByteSize::ZERO))
    }

    #[test]
    fn clearing_returns_every_byte() {
        let (books, c) = cache(1000);
        for i in 0..5 {
            c.get_or_cast(i, key(1), || Ok(t(8))).unwrap();
        }
        assert_eq!(*books.booked.lock(), 160);
        assert_eq!(c.clear(), ByteSize(160));
        assert_eq!(*books.booked.lock(), 0);
        assert_eq!(c.bytes(), ByteSize::ZERO);
    }

    #[test]
    fn a_failed_cast_books_nothing() {
        let (books, c) = cache(1000);
        let e = c.get_or_cast(0, key(1), || {
            Err(crate::error::Error::NotLoaded { model: "m".into() })
        });
        assert!(e.is_err());
        assert_eq!(*books.booked.lock(), 0);
        assert_eq!(c.stats(), CastCacheStats::default());
    }
}
