//! How a model's weights are used: what residency by use decides from (docs/ARCHITECTURE.md §5.3).
//!
//! Every fetch of a weight records, with a few relaxed atomics and no lock: a tick of the model's
//! use clock (the weight's last use), a use count, the weight's position in first-use order (set
//! once), and the weight that followed the previous one (a successor, which is what prefetch
//! follows). A model also keeps its *watermark*: the first-use position from which its weights
//! stream without evicting anything (set by an eviction inside the model, reset when it is loaded
//! again).
//!
//! It also learns each weight's compute as the host sees it: the time from the return of its
//! fetch to the next weight's fetch (a span that starts a forward — the model's first weight in
//! first-use order — is the gap between forwards and is not counted), an exponential average per
//! weight that the cost model predicts step times from ([`crate::costs`]).

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};

use crate::size::ByteSize;

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
    /// What the model's spans are timed from.
    epoch: std::time::Instant,
    /// The weight whose fetch returned last ([`NONE`] after a span was taken) and when, in
    /// nanoseconds since `epoch`.
    returned: AtomicUsize,
    returned_at: AtomicU64,
    /// Per weight, its compute's exponential average in nanoseconds (0: not measured).
    compute: Box<[AtomicU64]>,
    /// The input rows of the model's last quantized matmul (0: none ran).
    rows: AtomicUsize,
    /// The first-use position of the earliest weight refused a fault-in in the current forward
    /// ([`NONE`]: none): later weights are not kept in it either.
    refused: AtomicUsize,
    /// The fewest bytes of a weight refused in the current forward because it can never be
    /// kept beside what stays (`u64::MAX`: none): later weights as large are not kept in it.
    refused_bytes: AtomicU64,
    /// Whether compute saved by an earlier run was offered to this model (once).
    seeded: std::sync::atomic::AtomicBool,
    /// Per weight, whether a routing named it (a mixture of experts' expert): its copy can
    /// start only once its layer's router ran.
    routed: Box<[std::sync::atomic::AtomicBool]>,
    /// Per weight, whether the classic selection of the last load has it ([`Usage::choose`]).
    chosen: Box<[std::sync::atomic::AtomicBool]>,
    /// The clock's tick when the current forward began (its first weight used; 0: none yet).
    forward_start: AtomicU64,
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
    /// In the resident set the classic partial load chose at the model's last load
    /// ([`Usage::choose`]): residency by use keeps it before the rest.
    pub(crate) chosen: bool,
    /// Used since the model's current forward began (its first weight's latest use).
    pub(crate) this_forward: bool,
}

impl WeightUse {
    /// Uses before the current forward: a weight the forward used already is not one use
    /// ahead of those it has yet to use (in a dense model every weight is used as often).
    pub(crate) fn settled_count(&self) -> u32 {
        self.count.saturating_sub(u32::from(self.this_forward))
    }
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
            epoch: std::time::Instant::now(),
            returned: AtomicUsize::new(NONE),
            returned_at: AtomicU64::new(0),
            compute: atomics(n, || AtomicU64::new(0)),
            rows: AtomicUsize::new(0),
            refused: AtomicUsize::new(NONE),
            refused_bytes: AtomicU64::new(u64::MAX),
            seeded: std::sync::atomic::AtomicBool::new(false),
            routed: atomics(n, || std::sync::atomic::AtomicBool::new(false)),
            chosen: atomics(n, || std::sync::atomic::AtomicBool::new(false)),
            forward_start: AtomicU64::new(0),
        }
    }

    /// The resident set the classic partial load chose at this load (`want[i]`: weight `i` in
    /// it): residency by use ranks those weights above the others used as often, so a dense
    /// model's kept set converges on the classic one whatever order its weights come in (the
    /// order of first use alone kept a prefix, and a large weight of the classic set found
    /// the room beside it taken by smaller ones and another model's copies).
    pub(crate) fn choose(&self, want: &[bool]) {
        for (c, &w) in self.chosen.iter().zip(want) {
            c.store(w, Ordering::Relaxed);
        }
    }

    /// A routing named weight `index` (`Streamer::prefetch_routed`).
    pub(crate) fn note_routed(&self, index: usize) {
        // Read first: every routing names its experts again, and a store each time would
        // bounce the line between the threads running the model.
        if let Some(r) = self
            .routed
            .get(index)
            .filter(|r| !r.load(Ordering::Relaxed))
        {
            r.store(true, Ordering::Relaxed);
        }
    }

    /// Whether a routing ever named weight `index`.
    pub(crate) fn is_routed(&self, index: usize) -> bool {
        self.routed
            .get(index)
            .is_some_and(|r| r.load(Ordering::Relaxed))
    }

    /// True the first time it is asked: saved compute is offered to a model once.
    pub(crate) fn first_seed(&self) -> bool {
        !self.seeded.swap(true, Ordering::Relaxed)
    }

    /// Weight `index`'s compute per use starts from `ns` (saved by an earlier run) unless one
    /// was measured already.
    pub(crate) fn seed_compute(&self, index: usize, ns: u64) {
        if let Some(c) = self.compute.get(index) {
            let _ = c.compare_exchange(0, ns.max(1), Ordering::Relaxed, Ordering::Relaxed);
        }
    }

    /// A fault-in of the weight at first-use `position` was refused in this forward for want of
    /// the moment's room (room that bookings returning by themselves would give): weights after
    /// it in the order are not kept in this forward either, so what stays is a prefix whatever
    /// the moment room comes back (a copy's stream-ordered free landing a little later must not
    /// let a later weight in ahead of it).
    pub(crate) fn refuse_from(&self, position: usize) {
        self.refused.fetch_min(position, Ordering::Relaxed);
    }

    /// A fault-in of a weight of `bytes` was refused in this forward because it can never be
    /// kept beside what stays: later weights as large are not kept in it either (room that
    /// evictions for weights in use free during the forward would otherwise let one in ahead
    /// of an earlier one), smaller ones are kept as they fit, so a large weight refused early
    /// does not leave the room beside it unused.
    pub(crate) fn refuse_as_large(&self, bytes: ByteSize) {
        self.refused_bytes
            .fetch_min(bytes.bytes(), Ordering::Relaxed);
    }

    /// Whether the weight at first-use `position`, of `bytes`, is held back in this forward by
    /// an earlier refusal ([`Usage::refuse_from`], [`Usage::refuse_as_large`]).
    pub(crate) fn held_back(&self, position: usize, bytes: ByteSize) -> bool {
        (position != NONE && position > self.refused.load(Ordering::Relaxed))
            || bytes.bytes() >= self.refused_bytes.load(Ordering::Relaxed)
    }

    /// A quantized matmul of the model ran on `rows` input rows.
    pub(crate) fn note_rows(&self, rows: usize) {
        self.rows.store(rows, Ordering::Relaxed);
    }

    /// The input rows of the model's last quantized matmul (`None` before one ran).
    pub(crate) fn rows(&self) -> Option<usize> {
        Some(self.rows.load(Ordering::Relaxed)).filter(|&r| r > 0)
    }

    fn now_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// Weight `index`'s fetch returned: its compute starts now.
    pub(crate) fn returned(&self, index: usize) {
        self.returned_at.store(self.now_ns(), Ordering::Relaxed);
        self.returned.store(index, Ordering::Relaxed);
    }

    /// The span since the last fetch returned ends at a use of `index`: counted as that
    /// weight's compute unless `index` starts a forward.
    fn end_span(&self, index: usize) {
        let prev = self.returned.swap(NONE, Ordering::Relaxed);
        let starts_forward = self.first.get(index).map(|f| f.load(Ordering::Relaxed)) == Some(0);
        if prev == NONE || starts_forward {
            return;
        }
        let Some(slot) = self.compute.get(prev) else {
            return;
        };
        let span = self
            .now_ns()
            .saturating_sub(self.returned_at.load(Ordering::Relaxed))
            .max(1);
        let old = Some(slot.load(Ordering::Relaxed)).filter(|&o| o > 0);
        let new = crate::costs::average(old.map(|o| o as f64), span as f64);
        slot.store((new.round() as u64).max(1), Ordering::Relaxed);
    }

    /// Weight `index`'s compute per use as measured (`None` before a span was).
    pub(crate) fn compute_ns(&self, index: usize) -> Option<u64> {
        self.compute
            .get(index)
            .map(|c| c.load(Ordering::Relaxed))
            .filter(|&c| c > 0)
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
        if self.first[index].load(Ordering::Relaxed) == 0 {
            // A forward begins: its fault-ins are decided afresh.
            self.forward_start.store(tick, Ordering::Relaxed);
            self.refused.store(NONE, Ordering::Relaxed);
            self.refused_bytes.store(u64::MAX, Ordering::Relaxed);
        }
        self.end_span(index);
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
            chosen: self
                .chosen
                .get(index)
                .is_some_and(|c| c.load(Ordering::Relaxed)),
            this_forward: last != 0 && last >= self.forward_start.load(Ordering::Relaxed),
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
    fn a_refused_fault_in_holds_back_the_later_weights_of_its_forward_only() {
        let u = Usage::new(4);
        for i in 0..4 {
            u.record(i);
        }
        let kib = ByteSize::kib;
        assert!(!u.held_back(3, kib(1)), "nothing refused");
        u.refuse_from(2);
        u.refuse_from(3);
        assert!(u.held_back(3, kib(1)));
        assert!(
            !u.held_back(2, kib(1)) && !u.held_back(1, kib(1)),
            "it and the weights before it"
        );
        // The next forward begins with the weight at position 0: decided afresh.
        u.record(0);
        assert!(!u.held_back(3, kib(1)));
        // A weight that can never be kept holds back the later ones as large, not the smaller.
        u.refuse_as_large(kib(64));
        assert!(u.held_back(2, kib(64)) && u.held_back(3, kib(128)));
        assert!(
            !u.held_back(2, kib(16)),
            "a smaller weight is kept as it fits"
        );
        u.record(0);
        assert!(!u.held_back(2, kib(64)), "decided afresh");
    }

    #[test]
    fn compute_is_the_span_from_a_fetch_s_return_to_the_next_use_and_not_between_forwards() {
        let u = Usage::new(3);
        let pause = |ms: u64| std::thread::sleep(std::time::Duration::from_millis(ms));
        // Forward 1: weight 0 computes ~4 ms, weight 1 ~1 ms, weight 2 ends the forward.
        u.record(0);
        u.returned(0);
        pause(4);
        u.record(1);
        u.returned(1);
        pause(1);
        u.record(2);
        u.returned(2);
        assert!(u.compute_ns(2).is_none());
        // The gap before the next forward is not weight 2's compute.
        pause(30);
        u.record(0);
        assert!(u.compute_ns(2).is_none(), "the gap between forwards");
        let (c0, c1) = (u.compute_ns(0).unwrap(), u.compute_ns(1).unwrap());
        assert!(c0 >= 4_000_000 && c1 >= 1_000_000, "{c0} {c1}");
        // A use whose fetch has not returned yet ends no span.
        u.record(1);
        assert_eq!(u.compute_ns(0), Some(c0));
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
