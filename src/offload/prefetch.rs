//! Prefetching streamed weights in forward order.
//!
//! A [`Streamer`] is attached to a partially loaded model. The first forward records the order
//! in which weights are fetched ([`crate::weights::Model::forward_order`]); on every later fetch
//! of a streamed weight the streamer requests the next `depth` streamed weights of that order
//! (wrapping around to the start, so the next step's first weights arrive during this step's
//! last layers) while the current layer computes, within a cap on bytes in flight.
//!
//! Correctness never depends on the order being right: an in-flight fetch is keyed by weight,
//! fingerprint (patch list), dtype and device, and is only used when all four match the request.
//! Anything else is a miss and is fetched synchronously — a different branch, a different clone
//! or a changed model costs time, never a wrong weight.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use candle_core::Tensor;
use parking_lot::Mutex;

use super::engine::{Pending, TransferEngine};
use crate::error::Result;
use crate::float::Dtype;
use crate::patcher::ModelPatcher;
use crate::size::ByteSize;
use crate::vram::DeviceId;
use crate::weights::Fingerprint;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FetchKey {
    index: usize,
    fingerprint: Fingerprint,
    dtype: Dtype,
    device: DeviceId,
}

struct InFlight {
    key: FetchKey,
    pending: Pending,
}

/// Per-model prefetch state on top of a shared [`TransferEngine`].
pub struct Streamer {
    engine: Arc<TransferEngine>,
    depth: AtomicUsize,
    cap: AtomicU64,
    inflight: Mutex<VecDeque<InFlight>>,
}

impl std::fmt::Debug for Streamer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Streamer")
            .field("depth", &self.depth())
            .field("in_flight", &self.in_flight_bytes())
            .finish()
    }
}

impl Streamer {
    /// A streamer prefetching `depth` weights ahead, with at most `cap` bytes in flight.
    pub fn new(engine: Arc<TransferEngine>, depth: usize, cap: ByteSize) -> Streamer {
        Streamer {
            engine,
            depth: AtomicUsize::new(depth),
            cap: AtomicU64::new(cap.bytes()),
            inflight: Mutex::new(VecDeque::new()),
        }
    }

    /// The engine.
    pub fn engine(&self) -> &Arc<TransferEngine> {
        &self.engine
    }
    /// How many streamed weights are requested ahead.
    pub fn depth(&self) -> usize {
        self.depth.load(Ordering::Relaxed)
    }
    /// Sets the depth (0 disables prefetching).
    pub fn set_depth(&self, depth: usize) {
        self.depth.store(depth, Ordering::Relaxed);
    }
    /// Sets the cap on bytes in flight.
    pub fn set_cap(&self, cap: ByteSize) {
        self.cap.store(cap.bytes(), Ordering::Relaxed);
    }
    /// Bytes of prefetched weights not yet used.
    pub fn in_flight_bytes(&self) -> ByteSize {
        self.inflight.lock().iter().map(|f| f.pending.bytes()).sum()
    }
    /// Drops every prefetched weight.
    pub fn clear(&self) {
        self.inflight.lock().clear();
    }

    fn key(patcher: &ModelPatcher, index: usize) -> FetchKey {
        FetchKey {
            index,
            fingerprint: patcher.fingerprint(index),
            dtype: patcher.resident_dtype(index),
            device: patcher.load_device(),
        }
    }

    /// Fetches streamed weight `index`: from a matching prefetch (hit) or synchronously (miss);
    /// then requests the next weights of the recorded order.
    pub fn fetch(&self, patcher: &ModelPatcher, index: usize) -> Result<Tensor> {
        let key = Streamer::key(patcher, index);
        let found = {
            let mut q = self.inflight.lock();
            // Entries for this weight with another key are stale: drop them.
            q.retain(|f| f.key.index != index || f.key == key);
            q.iter()
                .position(|f| f.key == key)
                .and_then(|p| q.remove(p))
        };
        let stats = self.engine.stats();
        let weight = match found {
            Some(f) => {
                stats.hit();
                f.pending.wait()?
            }
            None => {
                stats.miss();
                let t0 = std::time::Instant::now();
                let t = self.engine.fetch_now(patcher, index)?;
                stats.waited(t0.elapsed().as_nanos() as u64);
                t
            }
        };
        self.prefetch_after(patcher, index);
        Ok(weight)
    }

    fn prefetch_after(&self, patcher: &ModelPatcher, index: usize) {
        let depth = self.depth();
        if depth == 0 || self.engine.lanes() == 0 {
            return;
        }
        let (order, complete) = patcher.model().forward_order();
        if !complete || order.is_empty() {
            return;
        }
        let Some(pos) = order.iter().position(|&i| i == index) else {
            return;
        };
        let cap = ByteSize(self.cap.load(Ordering::Relaxed));
        let mut q = self.inflight.lock();
        let mut requested = 0;
        for step in 1..order.len() {
            if requested >= depth {
                break;
            }
            let next = order[(pos + step) % order.len()];
            if patcher.resident_tensor(next).is_some() {
                continue;
            }
            let key = Streamer::key(patcher, next);
            requested += 1;
            if q.iter().any(|f| f.key == key) {
                continue;
            }
            let bytes = patcher.resident_size(next);
            let in_flight: ByteSize = q.iter().map(|f| f.pending.bytes()).sum();
            if in_flight.saturating_add(bytes) > cap {
                break;
            }
            let pending = self.engine.submit(patcher, next);
            q.push_back(InFlight { key, pending });
        }
        // Never hold more than a few rounds of unused prefetches (a branch not taken).
        while q.len() > 2 * depth + 2 {
            q.pop_front();
        }
    }
}
