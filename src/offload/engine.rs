//! Transfer lanes: weights are staged, cast and patched off the compute thread.
//!
//! A [`TransferEngine`] runs `N` lanes. Each lane materializes a streamed weight exactly as a
//! synchronous fetch would — copy the clean bytes into a staging buffer, rebuild the tensor from
//! the staged bytes, apply the patcher's patches, cast to the compute dtype, move it to the load
//! device — and hands the result over through a [`Pending`] handle, which must be waited on
//! before the weight can be used (the only way to get the tensor is [`Pending::wait`], which
//! consumes the handle). With zero lanes the same work runs inline on the caller's thread: same
//! code, same bits.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use candle_core::{CpuStorage, Device, Storage, Tensor};
use parking_lot::Mutex;

use super::pinned::PinnedPool;
use crate::error::{Error, Result};
use crate::patcher::ModelPatcher;
use crate::size::ByteSize;

type Job = Box<dyn FnOnce() + Send>;

/// Counters of an engine (all monotonic).
#[derive(Debug, Default)]
pub struct TransferStats {
    bytes: AtomicU64,
    staged: AtomicU64,
    jobs: AtomicU64,
    wait_ns: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
}

/// A snapshot of [`TransferStats`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TransferSnapshot {
    /// Bytes of clean weights read for streamed fetches.
    pub bytes_transferred: ByteSize,
    /// Bytes that went through staging buffers.
    pub bytes_staged: ByteSize,
    /// Weights materialized by lanes or inline.
    pub fetches: u64,
    /// Time compute spent waiting for transfers, in nanoseconds.
    pub wait_ns: u64,
    /// Streamed fetches served by a prefetch.
    pub prefetch_hits: u64,
    /// Streamed fetches that had to be fetched synchronously.
    pub prefetch_misses: u64,
}

impl TransferStats {
    /// A snapshot.
    pub fn snapshot(&self) -> TransferSnapshot {
        TransferSnapshot {
            bytes_transferred: ByteSize(self.bytes.load(Ordering::Relaxed)),
            bytes_staged: ByteSize(self.staged.load(Ordering::Relaxed)),
            fetches: self.jobs.load(Ordering::Relaxed),
            wait_ns: self.wait_ns.load(Ordering::Relaxed),
            prefetch_hits: self.hits.load(Ordering::Relaxed),
            prefetch_misses: self.misses.load(Ordering::Relaxed),
        }
    }
    pub(crate) fn hit(&self) {
        self.hits.fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn miss(&self) {
        self.misses.fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn waited(&self, ns: u64) {
        self.wait_ns.fetch_add(ns, Ordering::Relaxed);
    }
}

/// A weight being materialized by a lane. Wait on it to get the tensor.
#[must_use = "a fetched weight must be awaited"]
pub struct Pending {
    state: PendingState,
    bytes: ByteSize,
    stats: Arc<TransferStats>,
}

enum PendingState {
    Ready(Result<Tensor>),
    Lane(mpsc::Receiver<Result<Tensor>>),
}

impl Pending {
    /// Bytes of the weight in its resident dtype.
    pub fn bytes(&self) -> ByteSize {
        self.bytes
    }

    /// Blocks until the lane finished, then returns the weight. Consumes the handle: a weight can
    /// only be used after its transfer completed.
    pub fn wait(self) -> Result<Tensor> {
        match self.state {
            PendingState::Ready(r) => r,
            PendingState::Lane(rx) => {
                let t0 = Instant::now();
                let r = rx.recv().unwrap_or_else(|_| {
                    Err(Error::Device {
                        device: "transfer lane".into(),
                        reason: "the lane stopped before finishing the transfer".into(),
                    })
                });
                self.stats.waited(t0.elapsed().as_nanos() as u64);
                r
            }
        }
    }
}

/// `N` transfer lanes (worker threads without CUDA), or inline transfers with zero lanes.
pub struct TransferEngine {
    lanes: usize,
    queue: Mutex<Option<mpsc::Sender<Job>>>,
    workers: Mutex<Vec<JoinHandle<()>>>,
    pool: Option<PinnedPool>,
    stats: Arc<TransferStats>,
}

impl std::fmt::Debug for TransferEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferEngine")
            .field("lanes", &self.lanes)
            .field("pool", &self.pool)
            .finish()
    }
}

impl TransferEngine {
    /// An engine with `lanes` worker lanes (0 = synchronous) staging through `pool` (`None`: copy
    /// from pageable memory directly).
    pub fn new(lanes: usize, pool: Option<PinnedPool>) -> TransferEngine {
        let stats = Arc::new(TransferStats::default());
        let (queue, workers) = if lanes == 0 {
            (None, Vec::new())
        } else {
            let (tx, rx) = mpsc::channel::<Job>();
            let rx = Arc::new(Mutex::new(rx));
            let workers = (0..lanes)
                .map(|i| {
                    let rx = Arc::clone(&rx);
                    std::thread::Builder::new()
                        .name(format!("residency-lane-{i}"))
                        .spawn(move || loop {
                            let job = rx.lock().recv();
                            match job {
                                Ok(job) => job(),
                                Err(_) => break,
                            }
                        })
                })
                .filter_map(|r| r.ok())
                .collect();
            (Some(tx), workers)
        };
        TransferEngine {
            lanes,
            queue: Mutex::new(queue),
            workers: Mutex::new(workers),
            pool,
            stats,
        }
    }

    /// Number of lanes (0 = synchronous).
    pub fn lanes(&self) -> usize {
        self.lanes
    }
    /// The staging pool.
    pub fn pool(&self) -> Option<&PinnedPool> {
        self.pool.as_ref()
    }
    /// The counters.
    pub fn stats(&self) -> &Arc<TransferStats> {
        &self.stats
    }

    /// Starts materializing weight `index` of `patcher` on a lane (inline without lanes).
    pub fn submit(&self, patcher: &ModelPatcher, index: usize) -> Pending {
        let bytes = patcher.resident_size(index);
        let queue = self.queue.lock().clone();
        let Some(queue) = queue else {
            return Pending {
                state: PendingState::Ready(self.fetch_now(patcher, index)),
                bytes,
                stats: Arc::clone(&self.stats),
            };
        };
        let (tx, rx) = mpsc::sync_channel(1);
        let patcher = patcher.clone();
        let pool = self.pool.clone();
        let stats = Arc::clone(&self.stats);
        let job: Job = Box::new(move || {
            let r =
                stream_weight(pool.as_ref(), &stats, &patcher, index).and_then(complete_on_device);
            let _ = tx.send(r);
        });
        if let Err(mpsc::SendError(job)) = queue.send(job) {
            // Lanes only stop when the engine is dropped; run the job here if they did.
            job();
        }
        Pending {
            state: PendingState::Lane(rx),
            bytes,
            stats: Arc::clone(&self.stats),
        }
    }

    /// Materializes weight `index` on the calling thread through the same staging path.
    pub fn fetch_now(&self, patcher: &ModelPatcher, index: usize) -> Result<Tensor> {
        stream_weight(self.pool.as_ref(), &self.stats, patcher, index)
    }
}

impl Drop for TransferEngine {
    fn drop(&mut self) {
        self.queue.lock().take();
        for w in self.workers.lock().drain(..) {
            let _ = w.join();
        }
    }
}

/// Waits until a weight a lane built is complete on its device, so the compute thread may use it.
///
/// candle queues a CUDA copy on the calling thread's per-thread stream, and per-thread streams of
/// two threads are not ordered with each other (nor does cudarc insert event waits while a context
/// runs a single stream). Without this wait, a kernel on the compute thread could read the weight
/// before the lane's copy landed. Synchronizing the lane's own stream blocks only the lane. CPU
/// tensors are complete when built.
fn complete_on_device(t: Tensor) -> Result<Tensor> {
    if t.device().is_cpu() {
        return Ok(t);
    }
    t.device()
        .synchronize()
        .map_err(|e| Error::tensor("waiting for a lane's copy to the device", e))?;
    Ok(t)
}

/// The streamed-fetch path: stage the clean bytes, rebuild, patch, cast, move.
fn stream_weight(
    pool: Option<&PinnedPool>,
    stats: &TransferStats,
    patcher: &ModelPatcher,
    index: usize,
) -> Result<Tensor> {
    let slot = &patcher.model().slots()[index];
    stats.jobs.fetch_add(1, Ordering::Relaxed);
    stats
        .bytes
        .fetch_add(slot.bytes().bytes(), Ordering::Relaxed);
    let staged = match pool {
        Some(pool) => stage(pool, slot.clean()).inspect(|t| {
            if t.is_some() {
                stats
                    .staged
                    .fetch_add(slot.bytes().bytes(), Ordering::Relaxed);
            }
        })?,
        None => None,
    };
    let clean = staged.as_ref().unwrap_or(slot.clean());
    patcher.materialize_from(
        index,
        clean,
        patcher.resident_dtype(index),
        patcher.load_device(),
    )
}

/// Copies a contiguous CPU tensor's bytes through a staging buffer and rebuilds the tensor from
/// them. `None` when the tensor is not contiguous on the CPU or the pool is full (the caller uses
/// the clean tensor directly: a pageable copy).
fn stage(pool: &PinnedPool, t: &Tensor) -> Result<Option<Tensor>> {
    let rebuilt = with_cpu_bytes(t, |bytes| -> Result<Option<Tensor>> {
        let Some(mut buf) = pool.acquire(bytes.len()) else {
            return Ok(None);
        };
        let Some(dst) = buf.as_mut_bytes() else {
            return Ok(None);
        };
        dst.copy_from_slice(bytes);
        let t = Tensor::from_raw_buffer(dst, t.dtype(), t.dims(), &Device::Cpu)
            .map_err(|e| Error::tensor("rebuilding a staged weight", e))?;
        Ok(Some(t))
        // `buf` returns to the pool here, after the tensor was rebuilt from it.
    });
    rebuilt.unwrap_or(Ok(None))
}

/// Calls `f` with the raw bytes of a contiguous CPU tensor, without copying.
pub(crate) fn with_cpu_bytes<R>(t: &Tensor, f: impl FnOnce(&[u8]) -> R) -> Option<R> {
    let (storage, layout) = t.storage_and_layout();
    let (start, end) = layout.contiguous_offsets()?;
    let Storage::Cpu(cpu) = &*storage else {
        return None;
    };
    fn raw<T>(v: &[T]) -> &[u8] {
        // SAFETY: every element type stored by candle's CPU storage is plain old data (floats,
        // integers, and `#[repr(transparent)]` byte wrappers for fp8) with no padding, so its
        // memory is `size_of_val(v)` initialised bytes; the returned slice borrows `v`.
        unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
    }
    let bytes = match cpu {
        CpuStorage::F32(v) => raw(&v[start..end]),
        CpuStorage::F16(v) => raw(&v[start..end]),
        CpuStorage::BF16(v) => raw(&v[start..end]),
        CpuStorage::F64(v) => raw(&v[start..end]),
        CpuStorage::U8(v) => raw(&v[start..end]),
        CpuStorage::F8E4M3(v) => raw(&v[start..end]),
        _ => return None,
    };
    Some(f(bytes))
}
