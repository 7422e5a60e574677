//! How a model's weights are used: what residency by use decides from (docs/ARCHITECTURE.md §5.3).
//!
//! Every fetch of a weight records, with a few relaxed atomics and no lock: a tick of the model's
//! use clock (the weight's last use), a use count, the weight's position in first-use order (set
//! once), and the weight that followed the previous one (a successor, which is what prefetch
//! follows). A model also keeps its *watermark*: the first-use position from which its weights
//! stream without evicting anything (set by an eviction inside the model, reset when it is loaded
//! again).

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};

/// No position, successor or watermark.
pub(crate) const NONE: usize = usize::MAX;

/// One model's use statistics, by weight index.
#[derive(Debug)]
pub(crate) struct Usage {
    clock: AtomicU64,
    last: Box<[AtomicU64]>,
    count: Box<[AtomicU32]>,
    first: Box<[AtomicUsize]>,
    next_position: AtomicUsize,
    successor: Box<[AtomicUsize]>,
    previous: AtomicUsize,
    watermark: AtomicUsize,
    /// Patched weights built (each application of a weight's patch chain).
    patched: AtomicU64,
}

/// What the eviction order reads of one weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WeightUse {
    /// Its position in first-use order ([`NONE`] when never used).
    pub(crate) position: usize,
    /// Ticks of the model's clock since its last use (`u64::MAX` when never used).
    pub(crate) age: u64,
    /// Uses so far.
    pub(crate) count: u32,
}

fn atomics<T>(n: usize, f: impl Fn() -> T) -> Box<[T]> {
    (0..n).map(|_| f()).collect()
}

impl Usage {
    pub(crate) fn new(n: usize) -> Usage {
        Usage {
            clock: AtomicU64::new(0),
            last: atomics(n, || AtomicU64::new(0)),
            count: atomics(n, || AtomicU32::new(0)),
            first: atomics(n, || AtomicUsize::new(NONE)),
            next_position: AtomicUsize::new(0),
            successor: atomics(n, || AtomicUsize::new(NONE)),
            previous: AtomicUsize::new(NONE),
            watermark: AtomicUsize::new(NONE),
            patched: AtomicU64::new(0),
        }
    }

    /// Records a use of weight `index`.
    pub(crate) fn record(&self, index: usize) {
        let Some(last) = self.last.get(index) else {
            return;
        };
        let tick = self.clock.fetch_add(1, Ordering::Relaxed) + 1;
        last.store(tick, Ordering::Relaxed);
        self.count[index].fetch_add(1, Ordering::Relaxed);
        if self.first[index].load(Ordering::Relaxed) == NONE {
            let p = self.next_position.fetch_add(1, Ordering::Relaxed);
            // A racing first use keeps the earlier position.
            let _ =
                self.first[index].compare_exchange(NONE, p, Ordering::Relaxed, Ordering::Relaxed);
        }
        let before = self.previous.swap(index, Ordering::Relaxed);
        if before != NONE && before != index {
            self.successor[before].store(index, Ordering::Relaxed);
        }
    }

    /// What the eviction order reads of weight `index`.
    pub(crate) fn of(&self, index: usize) -> WeightUse {
        let now = self.clock.load(Ordering::Relaxed);
        let last = self
            .last
            .get(index)
            .map_or(0, |l| l.load(Ordering::Relaxed));
        WeightUse {
            position: self
                .first
                .get(index)
                .map_or(NONE, |f| f.load(Ordering::Relaxed)),
            // Another thread may have used it after `now` was read.
            age: if last == 0 {
                u64::MAX
            } else {
                now.saturating_sub(last)
            },
            count: self
                .count
                .get(index)
                .map_or(0, |c| c.load(Ordering::Relaxed)),
        }
    }

    /// Weights used so far (the length of the first-use order): about the uses of one forward.
    pub(crate) fn distinct(&self) -> usize {
        self.next_position.load(Ordering::Relaxed)
    }

    /// The weight last seen used right after weight `index`.
    pub(crate) fn successor(&self, index: usize) -> Option<usize> {
        self.successor
            .get(index)
            .map(|s| s.load(Ordering::Relaxed))
            .filter(|&s| s != NONE)
    }

    /// The position from which weights stream without evicting ([`NONE`]: none).
    pub(crate) fn watermark(&self) -> usize {
        self.watermark.load(Ordering::Relaxed)
    }

    /// Lowers the watermark to `position` (never raises it).
    pub(crate) fn lower_watermark(&self, position: usize) {
        self.watermark.fetch_min(position, Ordering::Relaxed);
    }

    /// Counts one patched weight built.
    pub(crate) fn note_patched(&self) {
        self.patched.fetch_add(1, Ordering::Relaxed);
    }

    /// Patched weights built so far.
    pub(crate) fn patched(&self) -> u64 {
        self.patched.load(Ordering::Relaxed)
    }

    /// Clears the watermark (the model was loaded again).
    pub(crate) fn reset_watermark(&self) {
        self.watermark.store(NONE, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_positions_ages_counts_and_successors() {
        let u = Usage::new(4);
        for i in [2, 0, 1, 2, 0] {
            u.record(i);
        }
        assert_eq!(u.of(2).position, 0);
        assert_eq!(u.of(0).position, 1);
        assert_eq!(u.of(1).position, 2);
        assert_eq!(u.of(3).position, NONE);
        assert_eq!((u.of(0).age, u.of(2).age, u.of(1).age), (0, 1, 2));
        assert_eq!(u.of(3).age, u64::MAX);
        assert_eq!((u.of(2).count, u.of(1).count), (2, 1));
        assert_eq!(u.successor(2), Some(0), "the latest successor");
        assert_eq!(u.successor(1), Some(2));
        assert_eq!(u.successor(3), None);
        assert_eq!(u.distinct(), 3);
    }

    #[test]
    fn the_watermark_only_falls_until_reset() {
        let u = Usage::new(1);
        assert_eq!(u.watermark(), NONE);
        u.lower_watermark(5);
        u.lower_watermark(7);
        assert_eq!(u.watermark(), 5);
        u.reset_watermark();
        assert_eq!(u.watermark(), NONE);
    }
}
