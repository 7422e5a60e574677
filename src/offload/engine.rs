//! Transfer lanes: weights are patched, cast and copied off the compute thread.
//!
//! A [`TransferEngine`] runs `N` lanes. Each lane materializes a streamed weight exactly as a
//! synchronous fetch would — apply the patcher's patches to the clean weight and cast it to the
//! compute dtype on the host — and, for a GPU, copies it into a page-locked staging buffer and
//! from there to the device on the lane's own CUDA stream, recording an event after the copy.
//! The result is handed over through a [`Pending`] handle, which must be waited on before the
//! weight can be used (the only way to get the tensor is [`Pending::wait`], which consumes the
//! handle); waiting makes the compute thread's stream wait on the copy's event, so the compute
//! side waits on that copy alone, never on the whole device. With zero lanes the same work runs
//! inline on the caller's thread (copying on its own stream): same code, same bits.
//!
//! A CPU destination has no device copy: its lanes only patch and cast, and take no staging
//! buffer (copying into one and back out would be two extra passes over the weight for
//! nothing).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

#[cfg(feature = "cuda")]
use candle_core::Device;
use candle_core::Tensor;
use cudarc::driver::{CudaEvent, CudaStream};
use parking_lot::Mutex;

use super::pinned::PinnedPool;
#[cfg(feature = "cuda")]
use super::upload;
use crate::error::{Error, Result};
use crate::float::Dtype;
use crate::patcher::ModelPatcher;
use crate::size::ByteSize;
use crate::vram::DeviceId;
use crate::weights::{HostTier, PinnedWeight};

type Job = Box<dyn FnOnce(&mut Lane) + Send>;

/// Counters of an engine (all monotonic).
#[derive(Debug, Default)]
pub struct TransferStats {
    bytes: AtomicU64,
    pub(crate) staged: AtomicU64,
    pub(crate) direct: AtomicU64,
    jobs: AtomicU64,
    wait_ns: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
}

/// A snapshot of [`TransferStats`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct TransferSnapshot {
    /// Bytes of clean weights read for streamed fetches.
    pub bytes_transferred: ByteSize,
    /// Bytes copied to a device through page-locked staging buffers.
    pub bytes_staged: ByteSize,
    /// Bytes copied to a device straight from host copies page-locked in place.
    pub bytes_direct: ByteSize,
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
            bytes_direct: ByteSize(self.direct.load(Ordering::Relaxed)),
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
    Ready(Result<Arrived>),
    Lane(mpsc::Receiver<Result<Arrived>>),
}

impl Pending {
    /// Bytes of the weight in its resident dtype.
    pub fn bytes(&self) -> ByteSize {
        self.bytes
    }

    /// Blocks until the lane finished, then returns the weight, ordered after its device copy
    /// for the calling thread. Consumes the handle: a weight can only be used after its transfer
    /// completed.
    pub fn wait(self) -> Result<Tensor> {
        match self.state {
            PendingState::Ready(r) => r?.into_tensor(),
            PendingState::Lane(rx) => {
                let t0 = Instant::now();
                let r = rx.recv().unwrap_or_else(|_| {
                    Err(Error::Device {
                        device: "transfer lane".into(),
                        reason: "the lane stopped before finishing the transfer".into(),
                    })
                });
                self.stats.waited(t0.elapsed().as_nanos() as u64);
                r?.into_tensor()
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
    host: Option<HostTier>,
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
                        .spawn(move || {
                            let mut lane = Lane::default();
                            loop {
                                let job = rx.lock().recv();
                                match job {
                                    Ok(job) => job(&mut lane),
                                    Err(_) => break,
                                }
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
            host: None,
            stats,
        }
    }

    /// Pins streamed weights in place in `tier` (within its pin budget), so their GPU copies DMA
    /// straight from their host copies instead of through a staging buffer.
    pub fn with_host_tier(mut self, tier: HostTier) -> TransferEngine {
        self.host = Some(tier);
        self
    }

    /// The host tier streamed weights are pinned in.
    pub fn host_tier(&self) -> Option<&HostTier> {
        self.host.as_ref()
    }

    fn route(&self, streamed: bool) -> Route<'_> {
        Route {
            pool: self.pool.as_ref(),
            host: self.host.as_ref(),
            stats: &self.stats,
            streamed,
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
                state: PendingState::Ready(stream_weight(self.route(true), patcher, index, None)),
                bytes,
                stats: Arc::clone(&self.stats),
            };
        };
        let (tx, rx) = mpsc::sync_channel(1);
        let patcher = patcher.clone();
        let pool = self.pool.clone();
        let host = self.host.clone();
        let stats = Arc::clone(&self.stats);
        let job: Job = Box::new(move |lane: &mut Lane| {
            let route = Route {
                pool: pool.as_ref(),
                host: host.as_ref(),
                stats: &stats,
                streamed: true,
            };
            let r = stream_weight(route, &patcher, index, Some(lane));
            let _ = tx.send(r);
        });
        if let Err(mpsc::SendError(job)) = queue.send(job) {
            // Lanes only stop when the engine is dropped; run the job here if they did.
            job(&mut Lane::default());
        }
        Pending {
            state: PendingState::Lane(rx),
            bytes,
            stats: Arc::clone(&self.stats),
        }
    }

    /// Materializes weight `index` on the calling thread through the same path, copying on the
    /// calling thread's own stream.
    pub fn fetch_now(&self, patcher: &ModelPatcher, index: usize) -> Result<Tensor> {
        stream_weight(self.route(true), patcher, index, None)?.into_tensor()
    }

    /// Builds weight `index`'s resident copy on the patcher's load device through the same path
    /// as a streamed fetch — on a GPU, a copy from a page-locked staging buffer instead of
    /// candle's pageable `to_device` — on the calling thread's own stream. Not counted as a
    /// fetch, and not pinned in place (a resident weight copies nothing from the host).
    pub fn load_now(&self, patcher: &ModelPatcher, index: usize) -> Result<Tensor> {
        stream_weight(self.route(false), patcher, index, None)?.into_tensor()
    }
}

impl Drop for TransferEngine {
    fn drop(&mut self) {
        self.queue.lock().take();
        let me = std::thread::current().id();
        for w in self.workers.lock().drain(..) {
            // The last handle to the engine can go away on one of its own lanes (a job's patcher
            // clone holding the model whose streamer holds the engine); a thread cannot join
            // itself, and that lane leaves its loop on its own once the queue is gone.
            if w.thread().id() != me {
                let _ = w.join();
            }
        }
    }
}

/// A weight a lane or an inline fetch built, and the event its device copy completes on (only
/// for a copy on a lane's stream; `None` when the weight is complete as built).
pub(crate) struct Arrived {
    tensor: Tensor,
    ready: Option<CudaEvent>,
}

impl Arrived {
    fn complete(tensor: Tensor) -> Arrived {
        Arrived {
            tensor,
            ready: None,
        }
    }

    /// A weight whose device copy completes on `ready`.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn on_event(tensor: Tensor, ready: CudaEvent) -> Arrived {
        Arrived {
            tensor,
            ready: Some(ready),
        }
    }

    /// Casts the copied weight `from` → `to` on the calling thread's stream of `dev` (a lane's
    /// per-thread stream), after the copy: that stream first waits on the copy's event. The
    /// result completes on a new event recorded after the cast.
    #[cfg(feature = "cuda")]
    fn cast_here(self, dev: &candle_core::CudaDevice, from: Dtype, to: Dtype) -> Result<Arrived> {
        let stream = dev.cuda_stream();
        let ordinal = stream.context().ordinal();
        if let Some(copied) = &self.ready {
            stream
                .wait(copied)
                .map_err(|e| Error::driver(ordinal, "ordering a cast after its copy", e))?;
        }
        let cast = crate::patcher::cast_weight(&self.tensor, from, to)?;
        let ready = stream
            .record_event(None)
            .map_err(|e| Error::driver(ordinal, "recording a cast event", e))?;
        Ok(Arrived::on_event(cast, ready))
    }

    /// The weight, usable by the calling (compute) thread: on a GPU, the calling thread's stream
    /// is first made to wait on the copy's event — the compute side waits on that copy, never on
    /// the whole device, and the host does not block.
    fn into_tensor(self) -> Result<Tensor> {
        let Some(ready) = self.ready else {
            return Ok(self.tensor);
        };
        #[cfg(feature = "cuda")]
        if let Device::Cuda(dev) = self.tensor.device() {
            let stream = dev.cuda_stream();
            stream.wait(&ready).map_err(|e| {
                Error::driver(
                    stream.context().ordinal(),
                    "waiting on a lane's copy event",
                    e,
                )
            })?;
            return Ok(self.tensor);
        }
        // Not a GPU tensor (cannot happen: only GPU copies record an event): wait on the host.
        ready.synchronize().map_err(|e| Error::Device {
            device: "transfer lane".into(),
            reason: format!("waiting on a copy event: {e}"),
        })?;
        Ok(self.tensor)
    }
}

/// What a lane keeps between jobs: its own copy stream on each GPU it copied to, made in
/// residency's context for that GPU (candle's, with the `cuda` feature).
#[derive(Default)]
pub(crate) struct Lane {
    streams: HashMap<usize, Arc<CudaStream>>,
}

impl Lane {
    /// This lane's copy stream on GPU `ordinal`.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fn stream(&mut self, ordinal: usize) -> Result<Arc<CudaStream>> {
        if let Some(s) = self.streams.get(&ordinal) {
            return Ok(Arc::clone(s));
        }
        let ctx =
            crate::vram::cuda_context(DeviceId::Cuda(ordinal)).ok_or_else(|| Error::Device {
                device: format!("cuda:{ordinal}"),
                reason: "no CUDA context for a transfer lane".into(),
            })?;
        let s = ctx
            .new_stream()
            .map_err(|e| Error::driver(ordinal, "creating a transfer lane's stream", e))?;
        self.streams.insert(ordinal, Arc::clone(&s));
        Ok(s)
    }
}

/// What a transfer may use: the staging pool, the host tier weights are pinned in, the counters,
/// and whether the weight streams (counted as a fetch, and pinned in place) or is being made
/// resident (neither: a resident weight is unpinned anyway).
#[derive(Clone, Copy)]
struct Route<'a> {
    pool: Option<&'a PinnedPool>,
    host: Option<&'a HostTier>,
    stats: &'a TransferStats,
    streamed: bool,
}

/// The transfer path of a weight: patch and cast on the host (the same
/// [`ModelPatcher::materialize_from`] every path uses, so the bits never depend on the path),
/// then, for a GPU, copy on `lane`'s stream (or the calling thread's own stream without a lane):
/// straight from the host copy when it is page-locked in place, else through a staging buffer.
/// A streamed weight whose host part is its clean host copy is pinned in place first, within the
/// pin budget. A CPU destination has no copy, so nothing is staged or pinned.
fn stream_weight(
    route: Route<'_>,
    patcher: &ModelPatcher,
    index: usize,
    lane: Option<&mut Lane>,
) -> Result<Arrived> {
    let slot = &patcher.model().slots()[index];
    let _span = tracing::debug_span!(
        "transfer",
        model = patcher.model().name(),
        weight = slot.name(),
        bytes = slot.bytes().bytes(),
        on_lane = lane.is_some()
    )
    .entered();
    if route.streamed {
        route.stats.jobs.fetch_add(1, Ordering::Relaxed);
        route
            .stats
            .bytes
            .fetch_add(slot.bytes().bytes(), Ordering::Relaxed);
    }
    let dtype = patcher.resident_dtype(index);
    let device = patcher.load_device();
    let clean = slot.clean()?;
    if device.is_cpu() || !cfg!(feature = "cuda") {
        return patcher
            .materialize_from(index, &clean, dtype, device)
            .map(Arrived::complete);
    }
    let (host, cast_after_copy) = patcher.host_part(index, &clean, dtype, device)?;
    // Pinned in place only when what is copied is the clean host copy itself (no patch or cast
    // made a new tensor) and the weight streams.
    let pin = match route.host {
        Some(tier)
            if route.streamed
                && crate::weights::host_bytes(&host) == crate::weights::host_bytes(&clean) =>
        {
            patcher.model().pin_clean(index, tier, &clean)
        }
        _ => None,
    };
    let named = |e| match e {
        Error::Tensor { context, source } => Error::Tensor {
            context: format!("`{}`: {context}", slot.name()),
            source,
        },
        other => other,
    };
    let copy = GpuCopy {
        host: &host,
        cast_after_copy,
        from: slot.dtype(),
        pin: pin.as_deref(),
    };
    gpu_copy(route, copy, device, lane).map_err(named)
}

/// What a GPU copy moves: the host tensor, the cast left for after the copy, and the pin of the
/// host copy when it is page-locked in place.
struct GpuCopy<'a> {
    host: &'a Tensor,
    cast_after_copy: Option<Dtype>,
    from: Dtype,
    pin: Option<&'a PinnedWeight>,
}

/// Copies to GPU `device` on `lane`'s stream (the calling thread's without a lane), then casts
/// there if asked.
#[cfg(feature = "cuda")]
fn gpu_copy(
    route: Route<'_>,
    copy: GpuCopy<'_>,
    device: DeviceId,
    lane: Option<&mut Lane>,
) -> Result<Arrived> {
    let Device::Cuda(dev) = device.to_candle()? else {
        return Err(Error::Device {
            device: device.to_string(),
            reason: "candle did not give a CUDA device".into(),
        });
    };
    let DeviceId::Cuda(ordinal) = device else {
        return Err(Error::Device {
            device: device.to_string(),
            reason: "not a GPU".into(),
        });
    };
    let stream = match lane {
        Some(lane) => lane.stream(ordinal)?,
        None => dev.cuda_stream(),
    };
    let copied = upload::upload(copy.host, &dev, &stream, route.pool, route.stats, copy.pin)?;
    match copy.cast_after_copy {
        None => Ok(copied),
        Some(to) => copied.cast_here(&dev, copy.from, to),
    }
}

/// Without the `cuda` feature no GPU tensor can be built (never called: candle has no CUDA).
#[cfg(not(feature = "cuda"))]
fn gpu_copy(
    route: Route<'_>,
    copy: GpuCopy<'_>,
    device: DeviceId,
    lane: Option<&mut Lane>,
) -> Result<Arrived> {
    let _ = (
        route.pool,
        route.stats,
        copy.host,
        copy.cast_after_copy,
        copy.from,
        copy.pin,
        lane,
    );
    Err(Error::Device {
        device: device.to_string(),
        reason: "residency was built without the `cuda` feature".into(),
    })
}
