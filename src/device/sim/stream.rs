//! The sim's streams (a FIFO and a worker thread each), events, device buffers and page-locked
//! host buffers.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use crate::lock::{Condvar, Mutex, Rank};
use candle_core::{CpuStorage, DType, Shape, Storage, Tensor};

use super::{SimFault, SimGpu, ViolationKind};
use crate::error::{Error, Result};
use crate::size::ByteSize;
use crate::vram::DeviceId;

/// Where a queued copy reads from.
enum Src {
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

enum Op {
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
    fn run_inline(self) {
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
struct Queue {
    /// Each op with its number on the stream (1, 2, ...).
    ops: VecDeque<(u64, Op)>,
    enqueued: u64,
    completed: u64,
    stop: bool,
    /// The worker has returned: nothing pushed now would run.
    exited: bool,
}

struct Core {
    id: u64,
    /// The stream's handle as the device interface knows it (reused after the stream is
    /// destroyed, as a `CUstream` pointer is); `id` is the checker's, never reused.
    key: u64,
    device: DeviceId,
    gpu: Weak<SimGpu>,
    queue: Mutex<Queue>,
    cond: Condvar,
}

/// Stops the worker when the last handle to the stream goes (after it drained its queue).
struct Handle(Arc<Core>);

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
    core: Arc<Core>,
    _handle: Arc<Handle>,
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

    /// Enqueues a copy of `src` into `dst`.
    ///
    /// # Safety
    /// As [`crate::device::Stream::copy_htod`].
    pub(crate) unsafe fn copy_htod(&self, src: &[u8], dst: &mut SimBuffer) -> Result<()> {
        let gpu = self.gpu()?;
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
fn ordered(stream: u64, seq: u64) {
    ORDERED.with(|o| {
        let mut o = o.borrow_mut();
        let e = o.entry(stream).or_insert(0);
        *e = (*e).max(seq);
    });
}

/// Whether this thread is ordered after op `seq` of stream `stream`.
fn is_ordered_after(stream: u64, seq: u64) -> bool {
    ORDERED.with(|o| o.borrow().get(&stream).is_some_and(|&s| s >= seq))
}

impl Core {
    /// Enqueues `ops` in order; when the worker has exited (the stream was destroyed and its
    /// work drained) they run here instead.
    fn push_or_run(&self, ops: Vec<Op>) {
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
                std::thread::sleep(time);
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

struct EventState {
    recorded: u64,
    completed: u64,
    /// Where the latest recording was made: stream id and the record op's number.
    point: Option<(u64, u64)>,
}

struct EventCore {
    device: DeviceId,
    state: Mutex<EventState>,
    cond: Condvar,
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

/// The memory of a simulated device buffer: a candle CPU storage, written by copies through
/// `ptr` while `pending > 0`, handed to compute once they completed.
struct DevMem {
    ptr: usize,
    len: usize,
    storage: Mutex<Option<CpuStorage>>,
    pending: Mutex<u32>,
    written: Condvar,
    /// The stream and op number of the latest copy into it.
    written_by: Mutex<Option<(u64, u64)>>,
}

impl DevMem {
    /// Checks that the calling thread may read the buffer: every copy into it completed and the
    /// thread is ordered after the latest (it waited on an event recorded after it, synchronized
    /// its stream, or runs on that stream). Reports `operation` otherwise, then waits for the
    /// copies (so the bits are still right).
    fn check_read(&self, gpu: &SimGpu, operation: &str) {
        let mut pending = self.pending.lock();
        let late = *pending > 0;
        let written_by = *self.written_by.lock();
        let unordered =
            !late && written_by.is_some_and(|(stream, seq)| !is_ordered_after(stream, seq));
        if late || unordered {
            drop(pending);
            let why = if late {
                "before the copy writing it completed"
            } else {
                "without waiting on the copy writing it"
            };
            gpu.violation(
                ViolationKind::ReadBeforeWritten,
                written_by.map(|(s, _)| s),
                &format!("{operation} {why}"),
                format!("device buffer ({})", ByteSize(self.len as u64)),
            );
            pending = self.pending.lock();
            while *pending > 0 {
                self.written.wait(&mut pending);
            }
        }
    }
}

// SAFETY: `ptr` addresses the heap memory of the `CpuStorage` held in `storage`, which never moves
// or reallocates while held; it is written only by the stream worker executing a queued copy and
// read (taken) only after every queued copy completed.
unsafe impl Send for DevMem {}
// SAFETY: as above.
unsafe impl Sync for DevMem {}

/// A simulated device allocation. Dropping it frees the allocation (a free under a queued copy is
/// a checker finding; the memory itself lives until the copy is done).
pub struct SimBuffer {
    mem: Arc<DevMem>,
    id: u64,
    gpu: Arc<SimGpu>,
    /// The stream it was allocated on: freeing it is ordered after that stream's work, as
    /// CUDA's stream-ordered free (`cuMemFreeAsync` on the allocating stream, which cudarc's
    /// `CudaSlice` drop uses) is.
    stream: u64,
    /// That stream: the free is queued on it, and the bytes return to the device's capacity
    /// only when it executes (another stream cannot have them before).
    core: Weak<Core>,
    /// The free was queued already.
    freed: bool,
}

impl std::fmt::Debug for SimBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimBuffer")
            .field("bytes", &self.mem.len)
            .finish()
    }
}

impl SimBuffer {
    /// Its size in bytes.
    pub fn size(&self) -> ByteSize {
        ByteSize(self.mem.len as u64)
    }

    /// The buffer as a CPU tensor of `shape` for compute (the sim computes on the host). A copy
    /// still writing it is a checker finding ([`ViolationKind::ReadBeforeWritten`]); the sim
    /// then waits for it. From here on compute owns the memory: the buffer's free is queued on
    /// its stream (the device's books release it when that executes).
    pub(crate) fn into_tensor(self, shape: &Shape) -> Result<Tensor> {
        self.into_held_tensor(shape).map(|(t, _hold)| t)
    }

    /// [`SimBuffer::into_tensor`], keeping the allocation in the device's books until the
    /// returned hold is dropped: a resident copy's owner keeps it as long as it keeps the copy,
    /// so the device counts it — a ledger that forgets a resident copy runs the sim out of memory.
    pub(crate) fn into_held_tensor(self, shape: &Shape) -> Result<(Tensor, SimBuffer)> {
        self.mem
            .check_read(&self.gpu, "a device buffer handed to compute");
        let storage = self
            .mem
            .storage
            .lock()
            .take()
            .ok_or_else(|| Error::Device {
                device: self.gpu.id().to_string(),
                reason: "a device buffer handed to compute twice".into(),
            })?;
        let t = Tensor::from_storage(
            Storage::Cpu(storage),
            shape.clone(),
            candle_core::op::BackpropOp::none(),
            false,
        );
        Ok((t, self))
    }

    /// Queues the buffer's free on its stream, then `then` after it (both in stream order).
    fn release(&mut self, then: Option<Box<dyn FnOnce() + Send>>) {
        if self.freed {
            if let Some(f) = then {
                f();
            }
            return;
        }
        self.freed = true;
        self.gpu.queue_free(self.id);
        let mut ops = vec![Op::Free {
            gpu: Arc::downgrade(&self.gpu),
            id: self.id,
        }];
        ops.extend(then.map(Op::Run));
        match self.core.upgrade() {
            Some(core) => core.push_or_run(ops),
            None => ops.into_iter().for_each(Op::run_inline),
        }
    }

    /// Frees the buffer in its stream's order and runs `f` on the stream after the free.
    pub(crate) fn free_then(mut self, f: Box<dyn FnOnce() + Send>) {
        self.check_free();
        self.release(Some(f));
    }

    /// A free is ordered after the work queued on the buffer's own stream (stream-ordered free;
    /// the memory lives until that work is done): work still queued on another stream is a
    /// finding.
    fn check_free(&self) {
        let other_stream = self
            .mem
            .written_by
            .lock()
            .is_some_and(|(stream, _)| stream != self.stream);
        if *self.mem.pending.lock() > 0 && other_stream {
            self.gpu.violation(
                ViolationKind::DeviceFreedUnderWork,
                None,
                "freeing a device buffer under work queued on another stream",
                format!("device buffer ({})", self.size()),
            );
        }
    }
}

impl SimBuffer {
    /// Its bytes, once every queued copy into it completed (one still running, unordered with
    /// the reader, is a [`ViolationKind::ReadBeforeWritten`] finding; the sim waits for it).
    pub(crate) fn read_back(&self) -> Vec<u8> {
        self.mem
            .check_read(&self.gpu, "reading a device buffer back");
        let st = self.mem.storage.lock();
        if st.is_none() {
            return Vec::new();
        }
        // SAFETY: the storage is held (`st`), so `ptr..ptr + len` is live; no copy writes it.
        unsafe { std::slice::from_raw_parts(self.mem.ptr as *const u8, self.mem.len) }.to_vec()
    }
}

impl Drop for SimBuffer {
    fn drop(&mut self) {
        if !self.freed {
            self.check_free();
            self.release(None);
        }
    }
}

fn zeros(dtype: DType, len: usize) -> Result<CpuStorage> {
    Ok(match dtype {
        DType::F32 => CpuStorage::F32(vec![0.0; len]),
        DType::F16 => CpuStorage::F16(vec![half::f16::ZERO; len]),
        DType::BF16 => CpuStorage::BF16(vec![half::bf16::ZERO; len]),
        DType::F64 => CpuStorage::F64(vec![0.0; len]),
        DType::U8 => CpuStorage::U8(vec![0; len]),
        DType::U32 => CpuStorage::U32(vec![0; len]),
        DType::F8E4M3 => CpuStorage::F8E4M3(vec![float8::F8E4M3::from_bits(0); len]),
        other => {
            return Err(Error::UnsupportedDtype {
                what: "a weight copied to a simulated GPU".into(),
                dtype: format!("{other:?}"),
            })
        }
    })
}

fn storage_ptr(s: &CpuStorage) -> usize {
    match s {
        CpuStorage::F32(v) => v.as_ptr() as usize,
        CpuStorage::F16(v) => v.as_ptr() as usize,
        CpuStorage::BF16(v) => v.as_ptr() as usize,
        CpuStorage::F64(v) => v.as_ptr() as usize,
        CpuStorage::U8(v) => v.as_ptr() as usize,
        CpuStorage::U32(v) => v.as_ptr() as usize,
        CpuStorage::F8E4M3(v) => v.as_ptr() as usize,
        _ => 0,
    }
}

/// The memory of a sim page-locked host buffer.
pub(crate) struct HostMem {
    /// Owns the memory `SimHostBuffer::ptr` addresses.
    _buf: Box<[u64]>,
    /// Set when the buffer is freed: a queued copy still reading it reads poison.
    freed: AtomicBool,
}

/// Page-locked host memory of a simulated device (a staging buffer), zeroed at creation.
pub struct SimHostBuffer {
    mem: Arc<HostMem>,
    ptr: *mut u8,
    len: usize,
    range: u64,
    gpu: Arc<SimGpu>,
}

// SAFETY: `ptr` addresses `mem._buf`, owned through `mem`; writes need `&mut self` and wait for every
// queued read first; queued reads only read.
unsafe impl Send for SimHostBuffer {}
// SAFETY: as above.
unsafe impl Sync for SimHostBuffer {}

impl SimHostBuffer {
    pub(super) fn new(gpu: Arc<SimGpu>, len: usize) -> SimHostBuffer {
        let mut buf = vec![0u64; len.div_ceil(8)].into_boxed_slice();
        let ptr = buf.as_mut_ptr().cast::<u8>();
        let mem = Arc::new(HostMem {
            _buf: buf,
            freed: AtomicBool::new(false),
        });
        let range = gpu.add_host_range(ptr as usize, len, Arc::downgrade(&mem));
        SimHostBuffer {
            mem,
            ptr,
            len,
            range,
            gpu,
        }
    }

    /// Its length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes, to read (a copy queued from them keeps the memory alive).
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr..ptr + len` lies in `mem._buf`, alive while `self` is; writers need
        // `&mut self`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The bytes, to write. A queued copy still reading them is a checker finding
    /// ([`ViolationKind::WrittenUnderCopy`]); the sim waits for it first.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self.gpu.settle_host(
            self.range,
            ViolationKind::WrittenUnderCopy,
            "writing page-locked host memory",
        );
        // SAFETY: as `as_slice`; no queued copy reads the memory any more and `&mut self` excludes
        // other borrows.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for SimHostBuffer {
    fn drop(&mut self) {
        let pending = {
            let st = self.gpu.state.lock();
            st.hosts
                .get(&self.range)
                .and_then(|h| h.pending.first().copied())
        };
        if let Some(stream) = pending {
            self.mem.freed.store(true, Ordering::Release);
            self.gpu.violation(
                ViolationKind::FreedUnderCopy,
                Some(stream),
                "freeing page-locked host memory",
                format!("staging buffer ({})", ByteSize(self.len as u64)),
            );
        }
        self.gpu.remove_host_range(self.range);
    }
}
