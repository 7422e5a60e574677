//! Transfer lanes: weights are copied (and patched and cast) off the compute thread.
//!
//! A [`TransferEngine`] runs `N` lanes. Each lane materializes a streamed weight exactly as a
//! synchronous fetch would ([`ModelPatcher::host_part`]: for a GPU, a patched dense weight is
//! copied clean and patched on the device after the copy, an exact widening cast runs there too;
//! everything else is patched and cast on the host) and, for a GPU, copies it — straight from its
//! page-locked host copy, or through a page-locked staging buffer — to the device on the lane's
//! own stream, recording an event after the copy.
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

use crate::lock::{Mutex, Rank};
use candle_core::Tensor;

use super::pinned::PinnedPool;
use super::prefetch::Reservation;
use super::upload::{self, Copied};
use crate::device::{DeviceHold, Devices, Gpu, Stream};
use crate::error::{Error, Result};
use crate::patcher::{Finish, ModelPatcher};
use crate::size::ByteSize;
use crate::vram::DeviceId;
use crate::weights::HostTier;

type Job = Box<dyn FnOnce(&mut Lane) + Send>;

/// Counters of an engine (all monotonic).
#[derive(Debug, Default)]
pub struct TransferStats {
    bytes: AtomicU64,
    pub(crate) staged: AtomicU64,
    pub(crate) direct: AtomicU64,
    pub(crate) pageable: AtomicU64,
    jobs: AtomicU64,
    wait_ns: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
    hit_wait_ns: AtomicU64,
    routed: AtomicU64,
    routed_hits: AtomicU64,
    requested: AtomicU64,
}

/// A snapshot of [`TransferStats`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct TransferSnapshot {
    /// Bytes of clean weights read for streamed fetches.
    pub bytes_transferred: ByteSize,
    /// Bytes copied to a device through page-locked staging buffers (by loads and streamed
    /// fetches alike: every host→device copy is counted once, in one of the three columns).
    pub bytes_staged: ByteSize,
    /// Bytes copied to a device straight from host copies page-locked in place.
    pub bytes_direct: ByteSize,
    /// Bytes copied to a device from pageable memory (no staging buffer was free, or pinning is
    /// disabled).
    pub bytes_pageable: ByteSize,
    /// Weights materialized by lanes or inline.
    pub fetches: u64,
    /// Time compute spent waiting for transfers, in nanoseconds.
    pub wait_ns: u64,
    /// Streamed fetches served by a prefetch.
    pub prefetch_hits: u64,
    /// Streamed fetches that had to be fetched synchronously.
    pub prefetch_misses: u64,
    /// Time compute spent waiting for prefetches still in flight when used, in nanoseconds
    /// (not in `wait_ns`, which is the synchronous fetches').
    pub prefetch_hit_wait_ns: u64,
    /// Prefetches requested from a mixture of experts' routing (`nn::moe`: the experts a layer
    /// routed to, of its other expert matrices, before the first is computed).
    pub routed_prefetches: u64,
    /// Of them, used (the prediction was right and the copy arrived or was arriving).
    pub routed_hits: u64,
    /// Bytes of streamed weights requested for a copy to a GPU, counted when requested (a
    /// prefetch submitted, a fetch made now) rather than when a lane gets to it: what a step
    /// asked for, as [`crate::costs::StepPrediction::bytes`] predicts it (clean bytes).
    pub bytes_requested: ByteSize,
}

impl TransferSnapshot {
    /// Every byte copied host→device: staged + direct + pageable.
    pub fn bytes_copied(&self) -> ByteSize {
        self.bytes_staged
            .saturating_add(self.bytes_direct)
            .saturating_add(self.bytes_pageable)
    }
}

impl TransferStats {
    /// A snapshot.
    pub fn snapshot(&self) -> TransferSnapshot {
        TransferSnapshot {
            bytes_transferred: ByteSize(self.bytes.load(Ordering::Relaxed)),
            bytes_staged: ByteSize(self.staged.load(Ordering::Relaxed)),
            bytes_direct: ByteSize(self.direct.load(Ordering::Relaxed)),
            bytes_pageable: ByteSize(self.pageable.load(Ordering::Relaxed)),
            fetches: self.jobs.load(Ordering::Relaxed),
            wait_ns: self.wait_ns.load(Ordering::Relaxed),
            prefetch_hits: self.hits.load(Ordering::Relaxed),
            prefetch_misses: self.misses.load(Ordering::Relaxed),
            prefetch_hit_wait_ns: self.hit_wait_ns.load(Ordering::Relaxed),
            routed_prefetches: self.routed.load(Ordering::Relaxed),
            routed_hits: self.routed_hits.load(Ordering::Relaxed),
            bytes_requested: ByteSize(self.requested.load(Ordering::Relaxed)),
        }
    }
    pub(crate) fn hit_waited(&self, ns: u64, routed: bool) {
        self.hit_wait_ns.fetch_add(ns, Ordering::Relaxed);
        if routed {
            self.routed_hits.fetch_add(1, Ordering::Relaxed);
        }
    }
    pub(crate) fn routed_request(&self) {
        self.routed.fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn hit(&self) {
        self.hits.fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn miss(&self) {
        self.misses.fetch_add(1, Ordering::Relaxed);
    }
    /// A streamed copy of `index` was requested: counted when its destination is a GPU.
    fn requested(&self, patcher: &ModelPatcher, index: usize) {
        if !patcher.weight_device(index).is_cpu() {
            let bytes = patcher.model().slots()[index].bytes().bytes();
            self.requested.fetch_add(bytes, Ordering::Relaxed);
        }
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
        self.arrive()?.into_tensor()
    }

    /// [`Pending::wait`], with what keeps the copy's device memory and the booking of its
    /// bytes: residency by use keeps a prefetched weight with them.
    pub(crate) fn wait_parts(self) -> Result<(Tensor, DeviceHold, Option<Reservation>)> {
        let mut arrived = self.arrive()?;
        let booking = arrived.booking.take();
        let (t, hold) = arrived.into_held_tensor()?;
        Ok((t, hold, booking))
    }

    fn arrive(self) -> Result<Arrived> {
        match self.state {
            PendingState::Ready(r) => r,
            PendingState::Lane(rx) => {
                crate::lock::check_wait("a transfer lane");
                let t0 = Instant::now();
                let span = tracing::debug_span!("lane_wait", bytes = self.bytes.bytes()).entered();
                let r = rx.recv().unwrap_or_else(|_| {
                    Err(Error::Device {
                        device: "transfer lane".into(),
                        reason: "the lane stopped before finishing the transfer".into(),
                    })
                });
                drop(span);
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
    host: Option<HostTier>,
    devices: Devices,
    stats: Arc<TransferStats>,
    /// The streamers prefetching through this engine (one per model), so a miss with no room
    /// can cancel another model's unused prefetches ([`TransferEngine::drop_predicted_on`]).
    streamers: Mutex<Vec<std::sync::Weak<super::Streamer>>>,
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
            let rx = Arc::new(Mutex::new(Rank::LaneJobs, rx));
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
            queue: Mutex::new(Rank::EngineQueue, queue),
            workers: Mutex::new(Rank::EngineQueue, workers),
            pool,
            host: None,
            devices: Devices::default(),
            stats,
            streamers: Mutex::new(Rank::EngineStreamers, Vec::new()),
        }
    }

    /// Notes a streamer prefetching through this engine (dead ones are forgotten here).
    pub(crate) fn adopt(&self, streamer: &Arc<super::Streamer>) {
        let mut all = self.streamers.lock();
        all.retain(|w| w.strong_count() > 0);
        if !all
            .iter()
            .any(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(streamer)))
        {
            all.push(Arc::downgrade(streamer));
        }
    }

    /// Drops every streamer's unused prefetches predicted from use bound for `device` (routed
    /// ones stay: they name weights about to run); the bytes they had booked, which come back
    /// as their buffers are freed. For a miss that found no room: another model's prefetches
    /// for its next forward are the lowest priority memory there is (they held a forward of
    /// another model out of a 12 KiB device: the model-based test's races found it).
    pub(crate) fn drop_predicted_on(&self, device: DeviceId) -> ByteSize {
        let streamers: Vec<Arc<super::Streamer>> = self
            .streamers
            .lock()
            .iter()
            .filter_map(std::sync::Weak::upgrade)
            .collect();
        streamers
            .iter()
            .map(|s| s.drop_predicted_on(Some(device)))
            .sum()
    }

    /// Copies to the GPUs in `devices` (CUDA devices are always reachable; simulated ones only
    /// through the [`Devices`] that made them).
    pub fn with_devices(mut self, devices: Devices) -> TransferEngine {
        self.devices = devices;
        self
    }

    /// The GPUs this engine copies to.
    pub fn devices(&self) -> &Devices {
        &self.devices
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
            devices: &self.devices,
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
        self.submit_booked(patcher, index, None)
    }

    /// [`TransferEngine::submit`] of a weight whose device bytes are booked by `booking` (a
    /// prefetch's ledger reservation). The booking travels with the weight: it is returned when
    /// the weight is handed to compute, or — when the weight is dropped unused — only once its
    /// device buffer's free has executed (stream-ordered), so the ledger never counts memory
    /// free that the device still holds.
    pub(crate) fn submit_booked(
        &self,
        patcher: &ModelPatcher,
        index: usize,
        booking: Option<Reservation>,
    ) -> Pending {
        let bytes = patcher.resident_size(index);
        self.stats.requested(patcher, index);
        let queue = self.queue.lock().clone();
        let Some(queue) = queue else {
            let arrived = stream_weight(self.route(true), patcher, index, None)
                .map(|a| a.with_booking(booking));
            return Pending {
                state: PendingState::Ready(arrived),
                bytes,
                stats: Arc::clone(&self.stats),
            };
        };
        let (tx, rx) = mpsc::sync_channel(1);
        let patcher = patcher.clone();
        let pool = self.pool.clone();
        let host = self.host.clone();
        let devices = self.devices.clone();
        let stats = Arc::clone(&self.stats);
        let job: Job = Box::new(move |lane: &mut Lane| {
            let route = Route {
                pool: pool.as_ref(),
                host: host.as_ref(),
                devices: &devices,
                stats: &stats,
                streamed: true,
            };
            let r =
                stream_weight(route, &patcher, index, Some(lane)).map(|a| a.with_booking(booking));
            // A receiver that is gone drops the weight here: an unused weight retires (its
            // booking returns after its buffer's free).
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
        self.stats.requested(patcher, index);
        stream_weight(self.route(true), patcher, index, None)?.into_tensor()
    }

    /// [`TransferEngine::fetch_now`], with what keeps the copy's device memory counted by its
    /// device (a weight residency by use keeps).
    pub(crate) fn fetch_now_held(
        &self,
        patcher: &ModelPatcher,
        index: usize,
    ) -> Result<(Tensor, DeviceHold)> {
        self.stats.requested(patcher, index);
        stream_weight(self.route(true), patcher, index, None)?.into_held_tensor()
    }

    /// Builds weight `index`'s resident copy on the patcher's load device through the same path
    /// as a streamed fetch — on a GPU, a copy from a page-locked staging buffer instead of
    /// candle's pageable `to_device` — on the calling thread's own stream. Not counted as a
    /// fetch, and not pinned in place (a resident weight copies nothing from the host).
    pub fn load_now(&self, patcher: &ModelPatcher, index: usize) -> Result<Tensor> {
        self.load_held(patcher, index).map(|(t, _)| t)
    }

    /// [`TransferEngine::load_now`], with what keeps the copy's device memory counted by its
    /// device until dropped (a simulated GPU's books; empty on CUDA and the CPU): the resident
    /// copy's owner keeps it as long as the copy.
    pub(crate) fn load_held(
        &self,
        patcher: &ModelPatcher,
        index: usize,
    ) -> Result<(Tensor, DeviceHold)> {
        stream_weight(self.route(false), patcher, index, None)?.into_held_tensor()
    }
}

impl Drop for TransferEngine {
    fn drop(&mut self) {
        self.queue.lock().take();
        let me = std::thread::current().id();
        let workers: Vec<JoinHandle<()>> = self.workers.lock().drain(..).collect();
        for w in workers {
            // The last handle to the engine can go away on one of its own lanes (a job's patcher
            // clone holding the model whose streamer holds the engine); a thread cannot join
            // itself, and that lane leaves its loop on its own once the queue is gone.
            if w.thread().id() != me {
                let _ = w.join();
            }
        }
    }
}

/// A weight a lane or an inline fetch built, with the booking of its device bytes when it was
/// prefetched. Handed to compute by [`Arrived::into_tensor`]; dropped unused, it retires: the
/// device buffer is freed in its stream's order and the booking returned after that free.
pub(crate) struct Arrived {
    kind: Option<ArrivedKind>,
    booking: Option<Reservation>,
}

/// What arrived: complete, or copied to a GPU (its copy completing on an event, and the exact
/// widening cast left for after the copy).
enum ArrivedKind {
    Complete(Tensor),
    OnDevice {
        copied: Copied,
        gpu: Gpu,
        finish: Option<Box<Finisher>>,
    },
    /// Built by a kernel queued on the copy's stream (the sim's finish after a copy): ready once
    /// `ready` completed. The kernel keeps the copy's device buffer beside its result until the
    /// weight is used or retired.
    Built {
        slot: KernelSlot,
        ready: crate::device::Event,
        gpu: Gpu,
        stream: crate::device::sim::SimStream,
    },
}

/// What is left to do to a copied weight on its device (a cast, or its patches), with the
/// patcher that knows how.
struct Finisher {
    patcher: ModelPatcher,
    index: usize,
    finish: Finish,
}

impl Finisher {
    fn run(self, copied: &Tensor) -> Result<Tensor> {
        self.patcher.finish(self.index, copied, self.finish)
    }
}

/// A kernel's result and the device buffer it was computed from.
type KernelSlot = Arc<Mutex<Option<(Result<Tensor>, crate::device::sim::SimBuffer)>>>;

impl From<ArrivedKind> for Arrived {
    fn from(kind: ArrivedKind) -> Arrived {
        Arrived {
            kind: Some(kind),
            booking: None,
        }
    }
}

impl Arrived {
    fn with_booking(mut self, booking: Option<Reservation>) -> Arrived {
        self.booking = booking;
        self
    }

    /// The weight, usable by the calling (compute) thread: on a GPU, compute is first made to
    /// wait on the copy's event (on CUDA the calling thread's stream waits — the compute side
    /// waits on that copy, never on the whole device, and the host does not block; the sim
    /// computes on the calling thread, which waits), then the buffer becomes a tensor and is cast.
    /// A booking is returned here, once the copy's device memory is the device's again.
    fn into_tensor(mut self) -> Result<Tensor> {
        let booking = self.booking.take();
        let (t, hold) = self.into_held_tensor()?;
        // The booking covers the copy's device memory: returned once the device has it back
        // (a simulated GPU frees it in stream order; on CUDA the tensor owns it from here and
        // compute's memory is the activation headroom's).
        hold.release_then(Box::new(move || drop(booking)));
        Ok(t)
    }

    /// [`Arrived::into_tensor`], with what keeps the device memory counted by its device.
    fn into_held_tensor(mut self) -> Result<(Tensor, crate::device::DeviceHold)> {
        let kind = self.kind.take();
        drop(self.booking.take());
        match kind {
            None => Err(Error::Device {
                device: "transfer lane".into(),
                reason: "a transferred weight was used twice".into(),
            }),
            Some(ArrivedKind::Complete(t)) => Ok((t, Default::default())),
            Some(ArrivedKind::Built {
                slot, ready, gpu, ..
            }) => {
                copy_wait(&gpu, &ready)?;
                let built = slot.lock().take();
                match built {
                    Some((t, buffer)) => {
                        drop(buffer);
                        t.map(|t| (t, Default::default()))
                    }
                    None => Err(Error::Device {
                        device: gpu.id().to_string(),
                        reason: "a kernel's result was missing after its event completed".into(),
                    }),
                }
            }
            Some(ArrivedKind::OnDevice {
                copied,
                gpu,
                finish,
            }) => {
                copy_wait(&gpu, &copied.ready)?;
                let (t, hold) = copied.buffer.into_held_tensor(&copied.shape)?;
                match finish {
                    None => Ok((t, hold)),
                    // A finish makes a new tensor: the copy's memory is not the result's.
                    Some(f) => f.run(&t).map(|t| (t, Default::default())),
                }
            }
        }
    }
}

impl Drop for Arrived {
    fn drop(&mut self) {
        let Some(kind) = self.kind.take() else {
            return;
        };
        let booking = self.booking.take();
        match kind {
            ArrivedKind::Complete(_) => drop(booking),
            ArrivedKind::OnDevice { copied, .. } => {
                let Copied { buffer, .. } = copied;
                buffer.free_then(Box::new(move || drop(booking)));
            }
            ArrivedKind::Built { slot, stream, .. } => {
                // After the kernel (in stream order): free its buffer, then return the booking.
                stream.launch(move || {
                    let built = slot.lock().take();
                    match built {
                        Some((_, buffer)) => buffer.free_then(Box::new(move || drop(booking))),
                        None => drop(booking),
                    }
                });
            }
        }
    }
}

/// Compute waits on a copy's event: a `copy_wait` span (`residency::trace`).
fn copy_wait(gpu: &Gpu, ready: &crate::device::Event) -> Result<()> {
    let _span = tracing::debug_span!("copy_wait", device = %gpu.id()).entered();
    gpu.compute_wait(ready)
}

/// What a lane keeps between jobs: its own copy stream on each GPU it copied to.
#[derive(Default)]
pub(crate) struct Lane {
    streams: HashMap<DeviceId, Stream>,
}

impl Lane {
    /// This lane's copy stream on `gpu`.
    fn stream(&mut self, gpu: &Gpu) -> Result<Stream> {
        if let Some(s) = self.streams.get(&gpu.id()) {
            return Ok(s.clone());
        }
        let s = gpu.new_stream()?;
        self.streams.insert(gpu.id(), s.clone());
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
    devices: &'a Devices,
    stats: &'a TransferStats,
    streamed: bool,
}

/// The transfer path of a weight: its host part ([`ModelPatcher::host_part`], the split every
/// path uses, so the bits never depend on the path), then, for a GPU, a copy on `lane`'s stream
/// (or the calling thread's own stream without a lane) — straight from the host copy when it is
/// page-locked in place, else through a staging buffer — and the finish left for the device
/// after it (on the simulated GPU a kernel queued behind the copy).
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
        on_lane = lane.is_some(),
        source = tracing::field::Empty,
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
    let device = patcher.weight_device(index);
    let clean = slot.clean()?;
    let gpu = route.devices.gpu(device);
    let Some(gpu) = gpu.filter(|_| device.is_sim() || cfg!(feature = "cuda")) else {
        // The CPU (or a CUDA device without the `cuda` feature, which candle then refuses).
        return patcher
            .materialize_from(index, &clean, dtype, device)
            .map(|t| ArrivedKind::Complete(t).into());
    };
    let (host, finish) = patcher.host_part(index, &clean, dtype, device)?;
    // Copied straight from its host copy when what is copied is the clean host copy itself (no
    // patch or cast made a new tensor): a streamed weight is pinned in place first (within the
    // pin budget); any copy of a weight already pinned records itself in the pin, so unpinning
    // waits for it.
    let own_bytes = crate::weights::host_bytes(&host) == crate::weights::host_bytes(&clean);
    let pin = match route.host {
        Some(tier) if own_bytes && route.streamed => patcher
            .model()
            .pin_clean(index, tier, &clean)
            .or_else(|| patcher.model().existing_pin(index)),
        _ if own_bytes => patcher.model().existing_pin(index),
        _ => None,
    };
    let named = |e| match e {
        Error::Tensor { context, source } => Error::Tensor {
            context: format!("`{}`: {context}", slot.name()),
            source,
        },
        other => other,
    };
    let stream = match lane {
        Some(lane) => lane.stream(&gpu)?,
        None => gpu.default_stream()?,
    };
    let copied =
        upload::upload(&host, &stream, route.pool, route.stats, pin.as_deref()).map_err(named)?;
    let finish = finish.map(|finish| {
        Box::new(Finisher {
            patcher: patcher.clone(),
            index,
            finish,
        })
    });
    let (sim_stream, finish) = match (&stream, finish) {
        (Stream::Sim(s), Some(f)) => (s, f),
        (_, finish) => {
            return Ok(ArrivedKind::OnDevice {
                copied,
                gpu,
                finish,
            }
            .into())
        }
    };
    // What is left (the exact cast, the patches) as a kernel on the copy's stream, after the
    // copy (a GPU runs it on the device; the sim's stream worker stands in for it), so compute
    // only waits.
    let built: KernelSlot = Arc::new(Mutex::new(Rank::KernelResult, None));
    let out = Arc::clone(&built);
    let Copied { buffer, shape, .. } = copied;
    let crate::device::DeviceBuffer::Sim(buffer) = buffer else {
        return Err(Error::Device {
            device: gpu.id().to_string(),
            reason: "a simulated stream's copy landed in a CUDA buffer".into(),
        });
    };
    sim_stream.launch(move || {
        let (r, buffer) = match buffer.into_held_tensor(&shape) {
            Ok((t, buffer)) => (finish.run(&t), buffer),
            Err(e) => {
                *out.lock() = None;
                tracing::error!(error = %e, "a kernel could not read its copy");
                return;
            }
        };
        *out.lock() = Some((r, buffer));
    });
    let ready = stream.record_event()?;
    Ok(ArrivedKind::Built {
        slot: built,
        ready,
        gpu,
        stream: sim_stream.clone(),
    }
    .into())
}
