//! The sim's streams (a FIFO and a worker thread each), events, device buffers and page-locked
//! host buffers.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use crate::lock::{Condvar, Mutex, Rank};
use candle_core::DType;

use super::{SimFault, SimGpu};
use crate::error::{Error, Result};
use crate::size::ByteSize;
use crate::vram::DeviceId;

/// Where a queued copy reads from.
pub(super) enum Src {
    /// Page-locked memory, read when the copy executes: a registered range (`keep: None`; the
    /// range cannot be unregistered before the read) or a sim host buffer (kept alive by `keep`
    /// even if the buffer is dropped meanwhile; a dropped buffer reads as poison).
    Locked {
        addr: usize,
        /// The simulated GPU whose page-locked memory it is (this one, or a peer).
        owner: std::sync::Weak<SimGpu>,
        range: u64,
        keep: Option<Arc<HostMem>>,
    },
    /// Pageable memory, read when the copy was enqueued (as the driver stages it).
    Staged(Vec<u8>),
}

impl Src {
    /// Where the bytes come from, as a trace names it: a host copy page-locked in place (a
    /// registered range), a page-locked staging buffer (a sim host buffer), or pageable memory.
    fn kind(&self) -> &'static str {
        match self {
            Src::Locked { keep: None, .. } => "pinned_in_place",
            Src::Locked { keep: Some(_), .. } => "staged",
            Src::Staged(_) => "pageable",
        }
    }
}

pub(super) enum Op {
    Copy {
        src: Src,
        dst: Arc<DevMem>,
        time: Duration,
    },
    Record {
        event: Arc<EventCore>,
        generation: u64,
    },
    Wait {
        event: Arc<EventCore>,
        generation: u64,
        /// The stream and op number the event's latest recording marks.
        point: Option<(u64, u64)>,
    },
    Run(Box<dyn FnOnce() + Send>),
    /// A stream-ordered free: the allocation's bytes return to the device when it executes.
    Free {
        gpu: Weak<SimGpu>,
        id: u64,
    },
}

impl Op {
    /// Runs an op that needs no stream (a free, or host work) on the calling thread: what a
    /// stream whose worker has exited would have done.
    pub(super) fn run_inline(self) {
        match self {
            Op::Run(work) => work(),
            Op::Free { gpu, id } => {
                if let Some(gpu) = gpu.upgrade() {
                    gpu.free_alloc(id);
                }
            }
            Op::Copy { .. } | Op::Record { .. } | Op::Wait { .. } => {}
        }
    }
}

#[derive(Default)]
pub(super) struct Queue {
    /// Each op with its number on the stream (1, 2, ...).
    pub(super) ops: VecDeque<(u64, Op)>,
    pub(super) enqueued: u64,
    pub(super) completed: u64,
    pub(super) stop: bool,
    /// The worker has returned: nothing pushed now would run.
    pub(super) exited: bool,
}

pub(super) struct Core {
    pub(super) id: u64,
    /// The stream's handle as the device interface knows it (reused after the stream is
    /// destroyed, as a `CUstream` pointer is); `id` is the checker's, never reused.
    pub(super) key: u64,
    pub(super) device: DeviceId,
    pub(super) gpu: Weak<SimGpu>,
    pub(super) queue: Mutex<Queue>,
    pub(super) cond: Condvar,
}

/// Stops the worker when the last handle to the stream goes (after it drained its queue).
pub(super) struct Handle(Arc<Core>);

impl Drop for Handle {
    fn drop(&mut self) {
        self.0.queue.lock().stop = true;
        self.0.cond.notify_all();
        // Destroyed: its handle may name the next stream made (its queued work still runs).
        if let Some(gpu) = self.0.gpu.upgrade() {
            gpu.release_stream_key(self.0.key);
        }
    }
}

/// A stream as its device sees it, for a device-wide synchronize: alive while its worker runs
/// (a destroyed stream's queued work still executes, and a device synchronize waits for it).
pub(super) struct StreamWatch(Weak<Core>);

impl StreamWatch {
    /// Whether the stream's worker may still have work.
    pub(super) fn is_alive(&self) -> bool {
        self.0.strong_count() > 0
    }

    /// Waits until the work enqueued on the stream so far has completed.
    pub(super) fn drain(&self) {
        let Some(core) = self.0.upgrade() else {
            return;
        };
        let mut q = core.queue.lock();
        let target = q.enqueued;
        while q.completed < target && !q.exited {
            core.cond.wait(&mut q);
        }
        drop(q);
        ordered(core.id, target);
    }
}

/// A simulated stream: its work runs in order on its own worker thread.
#[derive(Clone)]
pub struct SimStream {
    pub(super) core: Arc<Core>,
    pub(super) _handle: Arc<Handle>,
}

impl SimStream {
    pub(super) fn spawn(gpu: Arc<SimGpu>, id: u64, key: u64) -> Result<SimStream> {
        let core = Arc::new(Core {
            id,
            key,
            device: gpu.id(),
            gpu: Arc::downgrade(&gpu),
            queue: Mutex::new(Rank::SimStream, Queue::default()),
            cond: Condvar::new(),
        });
        gpu.watch_stream(StreamWatch(Arc::downgrade(&core)));
        let worker = Arc::clone(&core);
        std::thread::Builder::new()
            .name(format!("residency-{}-stream{id}", core.device))
            .spawn(move || worker.run())
            .map_err(|e| Error::Device {
                device: gpu.id().to_string(),
                reason: format!("starting a stream's worker: {e}"),
            })?;
        Ok(SimStream {
            _handle: Arc::new(Handle(Arc::clone(&core))),
            core,
        })
    }

    /// The device.
    pub fn device(&self) -> DeviceId {
        self.core.device
    }

    /// The stream's handle: distinct between live streams, reused after a stream is destroyed
    /// (as CUDA reuses a destroyed stream's pointer).
    pub fn key(&self) -> usize {
        self.core.key as usize
    }

    /// Enqueues `op`; returns its number on the stream.
    fn push(&self, op: Op) -> u64 {
        self.push_with(|_| op)
    }

    /// Enqueues the op built from its number on the stream; returns the number.
    fn push_with(&self, op: impl FnOnce(u64) -> Op) -> u64 {
        let mut q = self.core.queue.lock();
        q.enqueued += 1;
        let seq = q.enqueued;
        q.ops.push_back((seq, op(seq)));
        drop(q);
        self.core.cond.notify_all();
        seq
    }

    fn gpu(&self) -> Result<Arc<SimGpu>> {
        self.core.gpu.upgrade().ok_or_else(|| Error::Device {
            device: self.core.device.to_string(),
            reason: "the simulated device is gone".into(),
        })
    }

    /// A new event recorded after the work enqueued so far.
    pub fn record_event(&self) -> Result<SimEvent> {
        let event = SimEvent::new(self.core.device);
        event.record(self)?;
        Ok(event)
    }

    /// Later work on this stream waits for `event`'s latest recording.
    pub fn wait(&self, event: &SimEvent) -> Result<()> {
        let (generation, point) = {
            let st = event.0.state.lock();
            (st.recorded, st.point)
        };
        self.push(Op::Wait {
            event: Arc::clone(&event.0),
            generation,
            point,
        });
        Ok(())
    }

    /// Blocks until the work enqueued so far has completed.
    pub fn synchronize(&self) -> Result<()> {
        let gpu = self.gpu()?;
        if gpu.fault(SimFault::Synchronize) {
            return Err(gpu.injected("synchronizing a stream"));
        }
        drop(gpu);
        let mut q = self.core.queue.lock();
        let target = q.enqueued;
        while q.completed < target {
            self.core.cond.wait(&mut q);
        }
        drop(q);
        ordered(self.core.id, target);
        Ok(())
    }

    /// Runs `work` on the stream, in order (a kernel launch).
    pub fn launch(&self, work: impl FnOnce() + Send + 'static) {
        self.push(Op::Run(Box::new(work)));
    }

    /// A device buffer of `len` elements of `dtype`; out of memory beyond the capacity.
    pub fn alloc(&self, dtype: DType, len: usize) -> Result<SimBuffer> {
        let gpu = self.gpu()?;
        let bytes = (len * dtype.size_in_bytes()) as u64;
        let id = gpu.book_alloc(bytes, &format!("{dtype:?}[{len}]"), self.core.id)?;
        let storage = match zeros(dtype, len) {
            Ok(s) => s,
            Err(e) => {
                gpu.free_alloc(id);
                return Err(e);
            }
        };
        let ptr = storage_ptr(&storage);
        Ok(SimBuffer {
            mem: Arc::new(DevMem {
                ptr,
                len: bytes as usize,
                storage: Mutex::new(Rank::SimBufferStorage, Some(storage)),
                pending: Mutex::new(Rank::SimBuffer, 0),
                written: Condvar::new(),
                written_by: Mutex::new(Rank::SimBufferWriter, None),
            }),
            id,
            gpu,
            stream: self.core.id,
            core: Arc::downgrade(&self.core),
            freed: false,
        })
    }

    /// Enqueues a copy of `src` into `dst`, which must be exactly `dst`'s size.
    ///
    /// # Errors
    /// [`crate::Error::Device`] naming both sizes when they differ (checked here, not only by
    /// [`crate::device::Stream::copy_htod`]: the copy executes with `dst`'s length, so a shorter
    /// page-locked source would be read past its end), before anything is queued.
    ///
    /// # Safety
    /// As [`crate::device::Stream::copy_htod`].
    pub(crate) unsafe fn copy_htod(&self, src: &[u8], dst: &mut SimBuffer) -> Result<()> {
        let gpu = self.gpu()?;
        if src.len() != dst.mem.len {
            return Err(gpu.error(&format!(
                "a copy of {} bytes into a device buffer of {}",
                src.len(),
                ByteSize(dst.mem.len as u64)
            )));
        }
        if gpu.fault(SimFault::Copy) {
            return Err(gpu.injected("enqueuing a copy"));
        }
        let addr = src.as_ptr() as usize;
        let source = match gpu.queue_portable_read(addr, src.len(), self.core.id) {
            Some((owner, range, keep)) => Src::Locked {
                addr,
                owner,
                range,
                keep,
            },
            None => Src::Staged(src.to_vec()),
        };
        *dst.mem.pending.lock() += 1;
        let time = gpu.copy_time(src.len() as u64);
        let stream = self.core.id;
        let mem = Arc::clone(&dst.mem);
        self.push_with(|seq| {
            *mem.written_by.lock() = Some((stream, seq));
            Op::Copy {
                src: source,
                dst: mem,
                time,
            }
        });
        Ok(())
    }
}

thread_local! {
    /// How far each stream's work is known complete to this thread (by a wait on an event, a
    /// stream synchronize, or — on a stream's own worker — stream order): stream id → op number.
    static ORDERED: std::cell::RefCell<std::collections::HashMap<u64, u64>> =
        std::cell::RefCell::new(std::collections::HashMap::new());
}

/// Records that this thread has seen stream `stream`'s work complete up to op `seq`.
pub(super) fn ordered(stream: u64, seq: u64) {
    ORDERED.with(|o| {
        let mut o = o.borrow_mut();
        let e = o.entry(stream).or_insert(0);
        *e = (*e).max(seq);
    });
}

/// Whether this thread is ordered after op `seq` of stream `stream`.
pub(super) fn is_ordered_after(stream: u64, seq: u64) -> bool {
    ORDERED.with(|o| o.borrow().get(&stream).is_some_and(|&s| s >= seq))
}

impl Core {
    /// Enqueues `ops` in order; when the worker has exited (the stream was destroyed and its
    /// work drained) they run here instead.
    pub(super) fn push_or_run(&self, ops: Vec<Op>) {
        let mut q = self.queue.lock();
        if q.exited {
            drop(q);
            for op in ops {
                op.run_inline();
            }
            return;
        }
        for op in ops {
            q.enqueued += 1;
            let seq = q.enqueued;
            q.ops.push_back((seq, op));
        }
        drop(q);
        self.cond.notify_all();
    }

    fn run(self: Arc<Core>) {
        loop {
            let (seq, op) = {
                let mut q = self.queue.lock();
                loop {
                    if let Some(op) = q.ops.pop_front() {
                        break op;
                    }
                    if q.stop {
                        q.exited = true;
                        return;
                    }
                    self.cond.wait(&mut q);
                }
            };
            // Everything before this op on this stream has completed (stream order).
            ordered(self.id, seq - 1);
            self.execute(op);
            ordered(self.id, seq);
            self.queue.lock().completed += 1;
            self.cond.notify_all();
        }
    }

    fn execute(&self, op: Op) {
        match op {
            Op::Copy { src, dst, time } => {
                // The copy's execution, on this stream's track (residency::trace).
                let _span = tracing::debug_span!(
                    "copy",
                    device = %self.device,
                    stream = self.id,
                    bytes = dst.len as u64,
                    source = src.kind(),
                )
                .entered();
                let t0 = std::time::Instant::now();
                super::precise_sleep(time);
                match &src {
                    Src::Locked {
                        addr,
                        owner,
                        range,
                        keep,
                    } => {
                        let poisoned = keep
                            .as_ref()
                            .is_some_and(|k| k.freed.load(Ordering::Acquire));
                        if poisoned {
                            // SAFETY: `dst.ptr..+len` is the device buffer's storage, kept alive
                            // by `dst`; only this stream writes it while the copy is pending.
                            unsafe { std::ptr::write_bytes(dst.ptr as *mut u8, 0xFF, dst.len) };
                        } else {
                            // SAFETY: the source is page-locked memory that stays allocated until
                            // this read is reported done (a registered range cannot be unregistered
                            // before, a sim host buffer is kept alive by `keep`) and is not written
                            // meanwhile (writers wait for pending reads); the destination as above.
                            unsafe {
                                std::ptr::copy_nonoverlapping(
                                    *addr as *const u8,
                                    dst.ptr as *mut u8,
                                    dst.len,
                                )
                            };
                        }
                        if let Some(gpu) = owner.upgrade() {
                            gpu.host_read_done(*range, self.id);
                        }
                    }
                    Src::Staged(bytes) => {
                        // SAFETY: as above for the destination; `bytes` is ours.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                bytes.as_ptr(),
                                dst.ptr as *mut u8,
                                dst.len.min(bytes.len()),
                            )
                        };
                    }
                }
                if let Some(gpu) = self.gpu.upgrade() {
                    gpu.note_copy(dst.len, t0.elapsed());
                }
                *dst.pending.lock() -= 1;
                dst.written.notify_all();
            }
            Op::Record { event, generation } => event.complete(generation),
            Op::Wait {
                event,
                generation,
                point,
            } => {
                event.wait_for(generation);
                if let Some((stream, seq)) = point {
                    ordered(stream, seq);
                }
            }
            Op::Run(work) => work(),
            Op::Free { gpu, id } => {
                if let Some(gpu) = gpu.upgrade() {
                    gpu.free_alloc(id);
                }
            }
        }
    }
}

pub(super) struct EventState {
    pub(super) recorded: u64,
    pub(super) completed: u64,
    /// Where the latest recording was made: stream id and the record op's number.
    pub(super) point: Option<(u64, u64)>,
}

pub(super) struct EventCore {
    pub(super) device: DeviceId,
    pub(super) state: Mutex<EventState>,
    pub(super) cond: Condvar,
}

impl EventCore {
    fn complete(&self, generation: u64) {
        let mut st = self.state.lock();
        st.completed = st.completed.max(generation);
        drop(st);
        self.cond.notify_all();
    }

    fn wait_for(&self, generation: u64) {
        let mut st = self.state.lock();
        while st.completed < generation {
            self.cond.wait(&mut st);
        }
    }
}

/// A simulated event (CUDA's semantics: see the module docs).
#[derive(Clone)]
pub struct SimEvent(Arc<EventCore>);

impl SimEvent {
    fn new(device: DeviceId) -> SimEvent {
        SimEvent(Arc::new(EventCore {
            device,
            state: Mutex::new(
                Rank::SimEvent,
                EventState {
                    recorded: 0,
                    completed: 0,
                    point: None,
                },
            ),
            cond: Condvar::new(),
        }))
    }

    /// Records the event after the work enqueued so far on `stream`, replacing the earlier
    /// recording. On another device's stream this is an error, as CUDA's
    /// `CUDA_ERROR_INVALID_CONTEXT`.
    pub fn record(&self, stream: &SimStream) -> Result<()> {
        if stream.device() != self.0.device {
            return Err(Error::Device {
                device: stream.device().to_string(),
                reason: format!(
                    "recording an event of {} on a stream of {} (CUDA_ERROR_INVALID_CONTEXT)",
                    self.0.device,
                    stream.device()
                ),
            });
        }
        let gpu = stream.gpu()?;
        if gpu.fault(SimFault::Record) {
            return Err(gpu.injected("recording an event"));
        }
        // The generation and the point are set together, as the record op gets its number.
        let event = Arc::clone(&self.0);
        let stream_id = stream.core.id;
        stream.push_with(|seq| {
            let mut st = event.state.lock();
            st.recorded += 1;
            st.point = Some((stream_id, seq));
            Op::Record {
                generation: st.recorded,
                event: Arc::clone(&event),
            }
        });
        Ok(())
    }

    /// Blocks until the latest recording has completed.
    pub fn synchronize(&self) {
        let (target, point) = {
            let st = self.0.state.lock();
            (st.recorded, st.point)
        };
        self.0.wait_for(target);
        if let Some((stream, seq)) = point {
            ordered(stream, seq);
        }
    }

    /// Whether the latest recording has completed.
    pub fn is_complete(&self) -> bool {
        let st = self.0.state.lock();
        st.completed >= st.recorded
    }
}

pub(super) use super::buffer::*;
