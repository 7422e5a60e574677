//! Everything residency asks of a GPU, behind one interface with two backends: CUDA (cudarc) and
//! a simulated GPU ([`sim`]).
//!
//! The transfer path — page-locking host copies in place, page-locked staging memory, streams,
//! events, device allocations, asynchronous host→device copies — is written once against the
//! types here ([`Gpu`], [`Stream`], [`Event`], [`HostBuffer`], [`DeviceBuffer`], [`Fences`]) and
//! runs unchanged on either backend. The sim backend is always compiled, so every test run
//! exercises the GPU path: streams really run asynchronously on worker threads, copies from
//! page-locked memory read their source when they *execute*, events keep only their latest
//! recording, device memory runs out, and a checker reports every use of memory whose producer
//! has not completed (docs/ARCHITECTURE.md §6.2).
//!
//! Dispatch is by enum, not by trait object or generic parameter: each call is one `match` on a
//! two-variant enum next to a driver call (or a queue push) that costs microseconds, so there is
//! nothing to measure, and no type parameter spreads through the engine, the staging pool and the
//! host tier. A backend is a variant; adding one is a variant and its arms here.
//!
//! Ordering contract of the whole module (CUDA's): work on one stream runs in the order it was
//! enqueued; work on two streams is unordered unless one waits on an event recorded on the
//! other; an event reflects only its latest recording. Page-locked host memory a copy reads must
//! stay allocated and unwritten until that copy completes: [`Fences`] holds one event per stream
//! that copied out of a piece of memory, and unlocking, freeing or writing the memory waits on
//! all of them (never only the latest, which is what F1 and F2 got wrong).

mod cuda;
pub mod sim;

use std::sync::Arc;

use candle_core::{DType, Shape, Tensor};
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};

use crate::error::{Error, Result};
use crate::size::ByteSize;
use crate::vram::DeviceId;

pub use crate::vram::SimSpec;
pub use cuda::CudaBuffer;
pub use sim::{SimFault, SimGpu, SimStats, Violation, ViolationKind};

/// A GPU residency copies to: a CUDA device (candle's context for it) or a simulated one.
#[derive(Clone)]
pub enum Gpu {
    /// A CUDA device, through cudarc.
    Cuda(Arc<CudaContext>),
    /// A simulated GPU.
    Sim(Arc<SimGpu>),
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Gpu({})", self.id())
    }
}

impl Gpu {
    /// The device's id.
    pub fn id(&self) -> DeviceId {
        match self {
            Gpu::Cuda(ctx) => DeviceId::Cuda(ctx.ordinal()),
            Gpu::Sim(s) => s.id(),
        }
    }

    /// A new stream on the device.
    pub fn new_stream(&self) -> Result<Stream> {
        match self {
            Gpu::Cuda(ctx) => ctx
                .new_stream()
                .map(Stream::Cuda)
                .map_err(|e| cuda::error(ctx.ordinal(), "creating a stream", e)),
            Gpu::Sim(s) => s.new_stream().map(Stream::Sim),
        }
    }

    /// The stream inline (lane-less) copies run on: candle's per-thread stream on CUDA, the
    /// sim's default stream.
    pub fn default_stream(&self) -> Result<Stream> {
        match self {
            Gpu::Cuda(ctx) => cuda::default_stream(ctx).map(Stream::Cuda),
            Gpu::Sim(s) => s.default_stream().map(Stream::Sim),
        }
    }

    /// `len` bytes of page-locked host memory, zeroed (a staging buffer).
    pub fn alloc_host(&self, len: usize) -> Result<HostBuffer> {
        match self {
            Gpu::Cuda(ctx) => cuda::alloc_host(ctx, len).map(HostBuffer::Cuda),
            Gpu::Sim(s) => s.alloc_host(len).map(HostBuffer::Sim),
        }
    }

    /// Page-locks `len` bytes at `addr` in place (CUDA's `cuMemHostRegister`).
    ///
    /// # Safety
    /// `addr..addr + len` must be live host memory that stays allocated until
    /// [`Gpu::unregister_host`] returns for it, and every copy out of it must have completed
    /// before that call (the caller waits on its [`Fences`]).
    pub(crate) unsafe fn register_host(&self, addr: usize, len: usize) -> Result<()> {
        match self {
            // SAFETY: forwarded from this function's contract.
            Gpu::Cuda(ctx) => unsafe { cuda::register_host(ctx, addr, len) },
            Gpu::Sim(s) => s.register_host(addr, len),
        }
    }

    /// Unlocks memory locked by [`Gpu::register_host`].
    ///
    /// # Safety
    /// `addr` was registered by [`Gpu::register_host`] on this device and is still allocated;
    /// every copy out of it has completed.
    pub(crate) unsafe fn unregister_host(&self, addr: usize) -> Result<()> {
        match self {
            // SAFETY: forwarded from this function's contract.
            Gpu::Cuda(ctx) => unsafe { cuda::unregister_host(ctx, addr) },
            Gpu::Sim(s) => s.unregister_host(addr),
        }
    }

    /// Waits for all work on the device.
    pub fn synchronize(&self) -> Result<()> {
        crate::lock::check_wait("a device synchronize");
        match self {
            Gpu::Cuda(ctx) => ctx
                .synchronize()
                .map_err(|e| cuda::error(ctx.ordinal(), "synchronizing the device", e)),
            Gpu::Sim(s) => s.synchronize(),
        }
    }

    /// Makes work the calling thread computes next wait for `event` (compute's side of a copy
    /// handed over from a lane). On CUDA, candle's per-thread stream waits on the event; the sim
    /// computes on the calling thread, so the thread waits.
    pub(crate) fn compute_wait(&self, event: &Event) -> Result<()> {
        match self {
            Gpu::Cuda(ctx) => {
                let s = cuda::default_stream(ctx)?;
                Stream::Cuda(s).wait(event)
            }
            Gpu::Sim(s) => {
                let t0 = std::time::Instant::now();
                let r = event.synchronize();
                s.note_compute_wait(t0.elapsed());
                r
            }
        }
    }
}

/// A stream: work on it runs in the order it was enqueued.
#[derive(Clone)]
pub enum Stream {
    /// A CUDA stream.
    Cuda(Arc<CudaStream>),
    /// A simulated stream (a worker thread).
    Sim(sim::SimStream),
}

impl Stream {
    /// The device the stream belongs to.
    pub fn device(&self) -> DeviceId {
        match self {
            Stream::Cuda(s) => DeviceId::Cuda(s.context().ordinal()),
            Stream::Sim(s) => s.device(),
        }
    }

    /// An identity for the stream (equal for clones of one stream, distinct between live streams).
    pub(crate) fn key(&self) -> (DeviceId, usize) {
        match self {
            Stream::Cuda(s) => (self.device(), s.cu_stream() as usize),
            Stream::Sim(s) => (self.device(), s.key()),
        }
    }

    /// A new event recorded after the work enqueued so far.
    pub fn record_event(&self) -> Result<Event> {
        match self {
            Stream::Cuda(s) => s
                .record_event(None)
                .map(Event::Cuda)
                .map_err(|e| cuda::error(s.context().ordinal(), "recording an event", e)),
            Stream::Sim(s) => s.record_event().map(Event::Sim),
        }
    }

    /// Makes later work on this stream wait for `event`'s latest recording.
    pub fn wait(&self, event: &Event) -> Result<()> {
        match (self, event) {
            (Stream::Cuda(s), Event::Cuda(e)) => s
                .wait(e)
                .map_err(|err| cuda::error(s.context().ordinal(), "waiting on an event", err)),
            (Stream::Sim(s), Event::Sim(e)) => s.wait(e),
            _ => Err(mixed_backends("waiting on an event")),
        }
    }

    /// Blocks until all work enqueued so far has completed.
    pub fn synchronize(&self) -> Result<()> {
        crate::lock::check_wait("a stream synchronize");
        match self {
            Stream::Cuda(s) => s
                .synchronize()
                .map_err(|e| cuda::error(s.context().ordinal(), "synchronizing a stream", e)),
            Stream::Sim(s) => s.synchronize(),
        }
    }

    /// A device buffer of `len` elements of `dtype`, allocated in stream order. Running out of
    /// device memory is [`Error::OutOfMemory`] naming the device and the bytes asked for.
    pub fn alloc(&self, dtype: DType, len: usize) -> Result<DeviceBuffer> {
        match self {
            Stream::Cuda(s) => cuda::alloc(s, dtype, len).map(DeviceBuffer::Cuda),
            Stream::Sim(s) => s.alloc(dtype, len).map(DeviceBuffer::Sim),
        }
    }

    /// Enqueues a copy of `src` into `dst` (exactly `dst`'s size).
    ///
    /// From pageable memory the source is read before this returns (the driver stages it); from
    /// page-locked memory (registered in place, or a [`HostBuffer`]) it is read when the copy
    /// executes.
    ///
    /// # Safety
    /// When `src` lies in page-locked memory, it must stay allocated and unwritten until an event
    /// recorded on this stream after this call has completed (record it in the memory's
    /// [`Fences`]).
    pub(crate) unsafe fn copy_htod(&self, src: &[u8], dst: &mut DeviceBuffer) -> Result<()> {
        if src.len() as u64 != dst.size().bytes() {
            return Err(Error::Device {
                device: self.device().to_string(),
                reason: format!(
                    "a copy of {} bytes into a device buffer of {}",
                    src.len(),
                    dst.size()
                ),
            });
        }
        match (self, dst) {
            // SAFETY: forwarded from this function's contract; sizes checked above.
            (Stream::Cuda(s), DeviceBuffer::Cuda(d)) => unsafe { cuda::copy_htod(s, src, d) },
            // SAFETY: forwarded from this function's contract.
            (Stream::Sim(s), DeviceBuffer::Sim(d)) => unsafe { s.copy_htod(src, d) },
            _ => Err(mixed_backends("copying to a device buffer")),
        }
    }
}

impl Stream {
    /// Copies `src`'s bytes back to the host once the work enqueued on this stream so far has
    /// completed (a synchronous device→host copy; tests and checks read results with it).
    pub fn read_back(&self, src: &DeviceBuffer) -> Result<Vec<u8>> {
        match (self, src) {
            (Stream::Cuda(s), DeviceBuffer::Cuda(b)) => cuda::read_back(s, b),
            (Stream::Sim(s), DeviceBuffer::Sim(b)) => {
                s.synchronize()?;
                Ok(b.read_back())
            }
            _ => Err(mixed_backends("reading a device buffer back")),
        }
    }
}

/// An event: marks a point in a stream's work. Recording it again replaces the earlier
/// recording (waiting on it then waits for the latest only), as in CUDA.
pub enum Event {
    /// A CUDA event.
    Cuda(CudaEvent),
    /// A simulated event.
    Sim(sim::SimEvent),
}

impl Event {
    /// Records the event after the work enqueued so far on `stream` (replacing any earlier
    /// recording). An event belongs to one device: recording it on another device's stream is
    /// an error, as in CUDA.
    pub fn record(&self, stream: &Stream) -> Result<()> {
        match (self, stream) {
            (Event::Cuda(e), Stream::Cuda(s)) => e
                .record(s)
                .map_err(|err| cuda::error(s.context().ordinal(), "recording an event", err)),
            (Event::Sim(e), Stream::Sim(s)) => e.record(s),
            _ => Err(mixed_backends("recording an event")),
        }
    }

    /// Blocks until the latest recording has completed (at once when never recorded).
    pub fn synchronize(&self) -> Result<()> {
        crate::lock::check_wait("an event");
        match self {
            Event::Cuda(e) => e
                .synchronize()
                .map_err(|err| cuda::error(e.context().ordinal(), "waiting on an event", err)),
            Event::Sim(e) => {
                e.synchronize();
                Ok(())
            }
        }
    }

    /// Whether the latest recording has completed.
    pub fn is_complete(&self) -> bool {
        match self {
            Event::Cuda(e) => e.is_complete(),
            Event::Sim(e) => e.is_complete(),
        }
    }
}

fn mixed_backends(what: &str) -> Error {
    Error::Device {
        device: "gpu".into(),
        reason: format!("{what}: a CUDA handle used with a simulated one"),
    }
}

/// The events of the copies out of one piece of page-locked host memory: one per stream that
/// copied from it, each re-recorded only on its own stream (where a later recording completes
/// after every earlier copy on that stream). Waiting waits on all of them.
///
/// One event re-recorded on every stream would keep only the latest copy: the memory could be
/// unlocked or overwritten under a copy still queued on another stream (F1, F2).
///
/// Each entry holds its stream: a stream is known by its handle (a CUDA stream by its
/// `CUstream` pointer), and a destroyed stream's handle can be given to the next stream made, so
/// a stream the fences still track is kept alive — the next stream can never be mistaken for
/// it. A copy whose event could not be recorded is tracked by its stream alone: waiting
/// synchronizes that stream. Nothing here waits while recording, so a lock held around
/// [`Fences::record`] is never held across a device wait.
#[derive(Default)]
pub struct Fences {
    by_stream: Vec<(Stream, Option<Event>)>,
}

impl Fences {
    /// No copies yet.
    pub fn new() -> Fences {
        Fences::default()
    }

    /// Records, after the copy just enqueued on `stream`, that the memory is read until then.
    /// When recording fails the copy is still queued: the stream itself is kept as its fence
    /// (waiting synchronizes it), and the error is returned.
    pub fn record(&mut self, stream: &Stream) -> Result<()> {
        let key = stream.key();
        let pos = self.by_stream.iter().position(|(s, _)| s.key() == key);
        let recorded = match pos.and_then(|p| self.by_stream[p].1.as_ref()) {
            Some(e) => e.record(stream).map(|()| None),
            None => stream.record_event().map(Some),
        };
        match (recorded, pos) {
            (Ok(None), _) => Ok(()),
            (Ok(Some(e)), Some(p)) => {
                self.by_stream[p].1 = Some(e);
                Ok(())
            }
            (Ok(Some(e)), None) => {
                self.by_stream.push((stream.clone(), Some(e)));
                Ok(())
            }
            (Err(e), p) => {
                // An earlier event on this stream no longer covers the new copy: the stream does.
                match p {
                    Some(p) => self.by_stream[p].1 = None,
                    None => self.by_stream.push((stream.clone(), None)),
                }
                Err(e)
            }
        }
    }

    /// Blocks until every recorded copy has completed. On success the fences are empty; on a
    /// failure they are kept (the memory must then not be released).
    pub fn wait_all(&mut self) -> Result<()> {
        while let Some((stream, event)) = self.by_stream.last() {
            match event {
                Some(e) => e.synchronize()?,
                None => stream.synchronize()?,
            }
            self.by_stream.pop();
        }
        Ok(())
    }

    /// Streams with a recorded copy.
    pub fn len(&self) -> usize {
        self.by_stream.len()
    }

    /// Whether no copy was recorded.
    pub fn is_empty(&self) -> bool {
        self.by_stream.is_empty()
    }
}

/// Page-locked host memory allocated through a device (staging buffers), zeroed at creation.
pub enum HostBuffer {
    /// `cuMemHostAlloc` memory.
    Cuda(cudarc::driver::PinnedHostSlice<u8>),
    /// The sim's page-locked memory.
    Sim(sim::SimHostBuffer),
}

impl HostBuffer {
    /// Its length in bytes.
    pub fn len(&self) -> usize {
        match self {
            HostBuffer::Cuda(p) => p.len(),
            HostBuffer::Sim(s) => s.len(),
        }
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes, to read (the caller's [`Fences`] order this after the copies out of it, which
    /// only read).
    pub(crate) fn as_slice(&self) -> Result<&[u8]> {
        match self {
            HostBuffer::Cuda(p) => p
                .as_slice()
                .map_err(|e| cuda::error(p.context().ordinal(), "reading a staging buffer", e)),
            HostBuffer::Sim(s) => Ok(s.as_slice()),
        }
    }

    /// The bytes, to write. The caller must first have waited on the buffer's [`Fences`]; the
    /// sim's checker reports a write under a copy still queued.
    pub(crate) fn as_mut_slice(&mut self) -> Result<&mut [u8]> {
        match self {
            HostBuffer::Cuda(p) => {
                let ordinal = p.context().ordinal();
                p.as_mut_slice()
                    .map_err(|e| cuda::error(ordinal, "writing a staging buffer", e))
            }
            HostBuffer::Sim(s) => Ok(s.as_mut_slice()),
        }
    }
}

/// Device memory for one weight, filled by a host→device copy on a stream ([`copy_to_device`](crate::offload::copy_to_device)).
pub enum DeviceBuffer {
    /// A cudarc allocation, typed as candle stores the dtype.
    Cuda(cuda::CudaBuffer),
    /// A simulated allocation.
    Sim(sim::SimBuffer),
}

impl DeviceBuffer {
    /// Its size in bytes.
    pub fn size(&self) -> ByteSize {
        match self {
            DeviceBuffer::Cuda(b) => b.size(),
            DeviceBuffer::Sim(b) => b.size(),
        }
    }

    /// Frees the buffer in its stream's order (as CUDA's stream-ordered free: after the work
    /// queued on the stream it was allocated on), then runs `f` once that free has executed —
    /// the memory is the device's again. Used to return a booking that covers the buffer only
    /// when the device has the memory back.
    pub(crate) fn free_then(self, f: Box<dyn FnOnce() + Send>) {
        match self {
            DeviceBuffer::Cuda(b) => b.free_then(f),
            DeviceBuffer::Sim(b) => b.free_then(f),
        }
    }

    /// The buffer as a candle tensor of `shape` on its device, for compute. The caller must have
    /// made compute wait for the copy that filled it ([`Gpu::compute_wait`]); the sim's checker
    /// reports a buffer handed to compute before its copy completed.
    pub(crate) fn into_tensor(self, shape: &Shape) -> Result<Tensor> {
        match self {
            DeviceBuffer::Cuda(b) => b.into_tensor(shape),
            DeviceBuffer::Sim(b) => b.into_tensor(shape),
        }
    }

    /// [`DeviceBuffer::into_tensor`], with what keeps the memory the device's until it is
    /// dropped: a resident copy's owner keeps the hold as long as the copy. On CUDA the tensor
    /// owns its allocation (the hold is empty); a simulated GPU's tensors are host memory, so
    /// the hold is what keeps the allocation in its books.
    pub(crate) fn into_held_tensor(self, shape: &Shape) -> Result<(Tensor, DeviceHold)> {
        match self {
            DeviceBuffer::Cuda(b) => b.into_tensor(shape).map(|t| (t, DeviceHold::default())),
            DeviceBuffer::Sim(b) => b
                .into_held_tensor(shape)
                .map(|(t, hold)| (t, DeviceHold(Some(Arc::new(hold))))),
        }
    }
}

/// Keeps a device allocation a tensor was made from in its device's books (a simulated GPU's;
/// empty elsewhere) until dropped. Clones share it.
#[derive(Clone, Default)]
pub(crate) struct DeviceHold(Option<Arc<sim::SimBuffer>>);

impl DeviceHold {
    /// Drops the hold (a simulated GPU frees the allocation in its stream's order) and runs `f`
    /// once the device has the memory back; at once when there is nothing held.
    pub(crate) fn release_then(self, f: Box<dyn FnOnce() + Send>) {
        match self.0.map(Arc::try_unwrap) {
            Some(Ok(buffer)) => buffer.free_then(f),
            // Still held by a clone, or nothing held: the memory is not this hold's to return.
            Some(Err(_)) | None => f(),
        }
    }
}

impl std::fmt::Debug for DeviceHold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("DeviceHold")
            .field(&self.0.is_some())
            .finish()
    }
}

/// The GPUs a manager copies to: CUDA devices (through the context candle computes in, found at
/// run time) and the simulated GPUs it made.
#[derive(Clone, Default)]
pub struct Devices {
    sims: Vec<Arc<SimGpu>>,
}

impl std::fmt::Debug for Devices {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Devices")
            .field("sims", &self.sims.len())
            .finish()
    }
}

impl Devices {
    /// CUDA devices plus `sims` as `sim:0`, `sim:1`, ...
    pub fn new(sims: Vec<Arc<SimGpu>>) -> Devices {
        Devices { sims }
    }

    /// One simulated GPU per spec.
    pub fn simulated(specs: &[SimSpec]) -> Devices {
        let sims: Vec<Arc<SimGpu>> = specs
            .iter()
            .enumerate()
            .map(|(i, s)| SimGpu::new(i, *s))
            .collect();
        // One machine: page-locked memory of any of them is page-locked for all (portable).
        SimGpu::link(&sims);
        Devices::new(sims)
    }

    /// The GPU behind `id`; `None` for the CPU, a CUDA device without a usable driver, or a
    /// simulated GPU not made here.
    pub fn gpu(&self, id: DeviceId) -> Option<Gpu> {
        match id {
            DeviceId::Cpu => None,
            DeviceId::Cuda(_) => crate::vram::cuda_context(id).map(Gpu::Cuda),
            DeviceId::Sim(n) => self.sims.get(n).cloned().map(Gpu::Sim),
        }
    }

    /// The simulated GPUs.
    pub fn sims(&self) -> &[Arc<SimGpu>] {
        &self.sims
    }
}
