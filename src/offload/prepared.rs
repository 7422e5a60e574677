//! Prepared host copies: a quantized weight that runs on the host (a cost-aware miss, or a weight
//! a [`crate::DeviceMap`] puts on the host — llama.cpp's `-ncmoe`) is kept as the candle
//! `QTensor` its host run builds, so the next run on the host multiplies at once.
//!
//! Without it every host run copies the weight's host bytes into a fresh `QTensor`, and candle's
//! CPU kernels then re-pack those blocks into their tiled layout (Q4K, Q8_0 and, for several rows,
//! Q6K on x86-64; more formats on aarch64) before the matmul — a cost candle pays once per
//! resident weight but a rebuilt weight pays at each use. `benches/moe.rs` prints it beside a
//! prepared run: a 768 × 2048 Q4K expert matrix took 721 µs built against 32 µs prepared on the
//! machine of the README's figures.
//!
//! **Room.** The copies of every model of a manager share one bound ([`PreparedBudget`]):
//! [`crate::vram::Config::prepared_host`] (`--prepared-host SIZE`), by default a quarter of the
//! host's available RAM when the manager starts, and nothing under `--ram-budget` (there every
//! host byte is the host tier's). A copy counts [`prepared_bytes`]: its blocks and candle's
//! re-packed tiles of them, counted as 1.5 × the blocks again (the largest tile layout in candle
//! 0.11). A copy that does not fit is refused — that weight is built at each host run, as without
//! the store — except that copies of weights resident on the device (they no longer run on the
//! host) are dropped first to make room. The first copies kept stay: like the host tier's stable
//! prefix, a fixed set served every time beats a least-recently-used set that a cyclic use order
//! misses every time.
//!
//! **Bits.** A prepared copy is the `QTensor` the same host run built from the weight's clean host
//! bytes, which never change (I1): a run on it is the run on a rebuilt one (I3). Only unpatched
//! weights run on the host.
//!
//! Lock: `PreparedCopies::entries` is `Rank::PreparedHost` in the crate's lock table
//! (`src/lock/rank.rs`): held to look up, insert or take out entries, never while a copy is built;
//! dropped entries (and their bytes) go back after it is let go.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use candle_core::quantized::QTensor;

use crate::lock::{Mutex, Rank};
use crate::size::ByteSize;

/// What the prepared host copies of a manager hold and have done.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct PreparedStats {
    /// The bound.
    pub limit: ByteSize,
    /// Bytes counted for the copies held now ([`prepared_bytes`] of each).
    pub bytes: ByteSize,
    /// Host runs served a prepared copy.
    pub hits: u64,
    /// Copies built and kept.
    pub kept: u64,
    /// Copies built but not kept: no room.
    pub refused: u64,
}

impl std::fmt::Display for PreparedStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "prepared host copies {} of {} ({} runs served, {} kept, {} refused)",
            self.bytes, self.limit, self.hits, self.kept, self.refused
        )
    }
}

/// The bytes a prepared copy of a quantized weight of `bytes` block bytes is counted for: the
/// blocks, and candle's re-packed tiles of them at 1.5 × (module docs).
pub fn prepared_bytes(bytes: ByteSize) -> ByteSize {
    ByteSize(bytes.bytes().saturating_mul(5) / 2)
}

/// The bound every model's prepared copies of one manager share, and their counts.
#[derive(Debug)]
pub struct PreparedBudget {
    limit: u64,
    used: AtomicU64,
    hits: AtomicU64,
    kept: AtomicU64,
    refused: AtomicU64,
}

impl PreparedBudget {
    /// A bound of `limit` bytes, nothing held.
    pub fn new(limit: ByteSize) -> PreparedBudget {
        PreparedBudget {
            limit: limit.bytes(),
            used: AtomicU64::new(0),
            hits: AtomicU64::new(0),
            kept: AtomicU64::new(0),
            refused: AtomicU64::new(0),
        }
    }

    /// Books `bytes` when they fit within the bound.
    fn book(self: &Arc<Self>, bytes: u64) -> Option<Booking> {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(bytes).filter(|&after| after <= self.limit)
            })
            .ok()
            .map(|_| Booking {
                budget: Arc::clone(self),
                bytes,
            })
    }

    /// What the copies hold and have done.
    pub fn stats(&self) -> PreparedStats {
        PreparedStats {
            limit: ByteSize(self.limit),
            bytes: ByteSize(self.used.load(Ordering::Acquire)),
            hits: self.hits.load(Ordering::Relaxed),
            kept: self.kept.load(Ordering::Relaxed),
            refused: self.refused.load(Ordering::Relaxed),
        }
    }
}

/// Bytes booked on a [`PreparedBudget`], given back when dropped.
#[derive(Debug)]
struct Booking {
    budget: Arc<PreparedBudget>,
    bytes: u64,
}

impl Drop for Booking {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

#[derive(Debug)]
struct Prepared {
    q: Arc<QTensor>,
    /// Given back when the entry is dropped.
    #[allow(dead_code)]
    booking: Booking,
}

/// One model's prepared host copies, by weight index (module docs).
#[derive(Debug)]
pub(crate) struct PreparedCopies {
    budget: Arc<PreparedBudget>,
    entries: Mutex<HashMap<usize, Prepared>>,
}

impl PreparedCopies {
    /// No copies yet, booking on `budget`.
    pub(crate) fn new(budget: Arc<PreparedBudget>) -> PreparedCopies {
        PreparedCopies {
            budget,
            entries: Mutex::new(Rank::PreparedHost, HashMap::new()),
        }
    }

    /// Weight `index`'s prepared copy, when one is held (counted as a served run).
    pub(crate) fn get(&self, index: usize) -> Option<Arc<QTensor>> {
        let q = self.entries.lock().get(&index).map(|p| Arc::clone(&p.q))?;
        self.budget.hits.fetch_add(1, Ordering::Relaxed);
        Some(q)
    }

    /// Keeps `q`, the copy a host run of weight `index` (`bytes` block bytes) built, when it fits;
    /// when it does not, copies of weights `resident` says are resident on the device go first
    /// (`resident` is asked with no lock of this store held). Whether it was kept.
    pub(crate) fn offer(
        &self,
        index: usize,
        q: &Arc<QTensor>,
        bytes: ByteSize,
        resident: impl Fn(usize) -> bool,
    ) -> bool {
        let counted = prepared_bytes(bytes).bytes();
        let mut booking = self.budget.book(counted);
        if booking.is_none() {
            let held: Vec<usize> = self.entries.lock().keys().copied().collect();
            let gone: Vec<usize> = held.into_iter().filter(|&i| resident(i)).collect();
            if !gone.is_empty() {
                let removed: Vec<Prepared> = {
                    let mut entries = self.entries.lock();
                    gone.iter().filter_map(|i| entries.remove(i)).collect()
                };
                // Their bytes go back (the bookings drop here) before the retry.
                let tensors: Vec<Arc<QTensor>> = removed.into_iter().map(|p| p.q).collect();
                booking = self.budget.book(counted);
                drop(tensors);
            }
        }
        let kept = match booking {
            Some(b) => {
                let replaced = self.entries.lock().insert(
                    index,
                    Prepared {
                        q: Arc::clone(q),
                        booking: b,
                    },
                );
                // Two host runs of the same weight may race to keep it: one copy stays.
                drop(replaced);
                true
            }
            None => false,
        };
        let counter = if kept {
            &self.budget.kept
        } else {
            &self.budget.refused
        };
        counter.fetch_add(1, Ordering::Relaxed);
        kept
    }

    /// Bytes counted for this model's copies.
    #[cfg(test)]
    fn bytes(&self) -> u64 {
        self.entries.lock().values().map(|p| p.booking.bytes).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::GgmlDType;
    use candle_core::{Device, Tensor};

    fn q() -> Arc<QTensor> {
        let t = Tensor::zeros((2, 32), candle_core::DType::F32, &Device::Cpu).unwrap();
        Arc::new(QTensor::quantize(&t, GgmlDType::Q8_0).unwrap())
    }

    #[test]
    fn copies_are_kept_within_the_bound_counted_with_their_tiles_and_given_back_when_dropped() {
        // 100 block bytes count 250: two fit in 600, the third is refused.
        let budget = Arc::new(PreparedBudget::new(ByteSize(600)));
        let copies = PreparedCopies::new(Arc::clone(&budget));
        let none = |_: usize| false;
        assert!(copies.get(0).is_none());
        assert!(copies.offer(0, &q(), ByteSize(100), none));
        assert!(copies.offer(1, &q(), ByteSize(100), none));
        assert!(!copies.offer(2, &q(), ByteSize(100), none));
        assert!(copies.get(2).is_none(), "a refused copy is not held");
        assert!(copies.get(0).is_some());
        let s = budget.stats();
        assert_eq!(
            (s.bytes, s.hits, s.kept, s.refused),
            (ByteSize(500), 1, 2, 1)
        );
        assert_eq!(copies.bytes(), 500);
        // A second model's store shares the bound.
        let other = PreparedCopies::new(Arc::clone(&budget));
        assert!(
            other.offer(0, &q(), ByteSize(40), none),
            "100 fit in the 100 left"
        );
        assert!(
            !other.offer(1, &q(), ByteSize(1), none),
            "3 do not fit in 0"
        );
        drop(copies);
        assert_eq!(
            budget.stats().bytes,
            ByteSize(100),
            "a dropped store gives its bytes back"
        );
        assert!(other.offer(1, &q(), ByteSize(1), none));
    }

    #[test]
    fn copies_of_weights_now_resident_make_room_and_the_others_stay() {
        let budget = Arc::new(PreparedBudget::new(ByteSize(500)));
        let copies = PreparedCopies::new(Arc::clone(&budget));
        assert!(copies.offer(0, &q(), ByteSize(100), |_| false));
        assert!(copies.offer(1, &q(), ByteSize(100), |_| false));
        // Full: weight 1 is resident now, so its copy goes and weight 2's is kept; weight 0's
        // stays (the first kept stay).
        assert!(copies.offer(2, &q(), ByteSize(100), |i| i == 1));
        assert!(copies.get(0).is_some() && copies.get(2).is_some());
        assert!(copies.get(1).is_none());
        assert_eq!(budget.stats().bytes, ByteSize(500));
        // Nothing resident: a new copy is refused and nothing is dropped.
        assert!(!copies.offer(3, &q(), ByteSize(100), |_| false));
        assert_eq!(copies.bytes(), 500);
        // A zero bound keeps nothing.
        let off = PreparedCopies::new(Arc::new(PreparedBudget::new(ByteSize::ZERO)));
        assert!(!off.offer(0, &q(), ByteSize(1), |_| true));
    }
}
