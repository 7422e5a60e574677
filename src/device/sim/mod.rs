//! A simulated GPU: the device interface's second backend, always compiled.
//!
//! Its memory is host memory (its tensors are candle CPU tensors), its budget and ledger are a
//! GPU's. It is faithful where transfer bugs live:
//!
//! - **Asynchrony.** Each stream is a FIFO executed by its own worker thread. A copy from
//!   page-locked memory (registered in place, or a sim [`SimHostBuffer`]) reads its source when
//!   it *executes*, as a DMA does; a copy from pageable memory reads it before the call returns,
//!   as the driver's staging does. A copy takes `latency + bytes / bandwidth` (optionally jittered
//!   from a seed), so lanes, prefetch and compute really overlap or wait.
//! - **Events** follow CUDA: recording again replaces the earlier recording (a wait then waits for
//!   the latest only); an event belongs to one device, and recording it on another device's
//!   stream is an error.
//! - **Memory** has a capacity: an allocation beyond it fails as the driver's out-of-memory does
//!   ([`crate::Error::OutOfMemory`], retryable).
//! - **Faults**: [`SimGpu::inject`] makes the k-th allocation, copy, event record or host
//!   registration from now fail, so rollback is tested across asynchronous work.
//! - **Checker** (compute-sanitizer's rules): [`SimGpu::violations`] lists every host range
//!   unlocked, freed or written while a queued copy has yet to read it, every device buffer handed
//!   to compute before the copy writing it completed or by a thread that never waited on it (no
//!   wait on an event recorded after the copy, no synchronize of its stream), every device buffer freed under work
//!   queued on another stream than its own (a free is ordered after its own stream's work, as
//!   CUDA's stream-ordered free is), and (asked by [`SimGpu::leaks`]) device or page-locked memory still allocated. Each
//!   names the stream, the operation and the buffer. The sim never lets a violation become
//!   undefined behaviour of the test process: it records it, then waits for the copy before
//!   letting the memory go. Freed sim page-locked buffers are poisoned (all bytes `0xFF`, NaN
//!   in every float format), so a stale read also shows in output bits.
//!
//! Lock: `SimGpu::state` is `Rank::SimGpu` in the crate's lock table (`src/lock/rank.rs`): held to
//! update the books, never across a wait or a copy.

mod buffer;
mod stream;

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use crate::lock::{Condvar, Mutex, Rank};

use crate::error::{Error, Result};
use crate::size::ByteSize;
use crate::vram::{DeviceId, SimSpec};

pub use buffer::{SimBuffer, SimHostBuffer};
pub use stream::{SimEvent, SimStream};

/// A driver call the sim can be told to fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SimFault {
    /// A device allocation (fails as out of memory).
    Alloc,
    /// Enqueuing a host→device copy.
    Copy,
    /// Recording an event.
    Record,
    /// Page-locking host memory in place.
    Register,
    /// Synchronizing a stream (fails before waiting).
    Synchronize,
    /// Creating a stream (its worker thread cannot be started).
    Stream,
}

/// The kind of a checker finding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ViolationKind {
    /// Page-locked host memory unlocked while a queued copy had yet to read it.
    UnlockedUnderCopy,
    /// Page-locked host memory freed while a queued copy had yet to read it.
    FreedUnderCopy,
    /// Page-locked host memory written while a queued copy had yet to read it.
    WrittenUnderCopy,
    /// A device buffer handed to compute before the copy writing it completed.
    ReadBeforeWritten,
    /// A device buffer freed while work queued on another stream than its own still wrote it (a
    /// free is ordered after its own stream's work, as CUDA's stream-ordered free is).
    DeviceFreedUnderWork,
    /// Device or page-locked memory still allocated when everything was dropped.
    Leak,
}

/// One checker finding: what happened, on which stream, by which operation, to which buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// What went wrong.
    pub kind: ViolationKind,
    /// The device.
    pub device: DeviceId,
    /// The stream whose queued work was affected (`None` when no stream is involved).
    pub stream: Option<u64>,
    /// The operation that caused it.
    pub operation: String,
    /// The buffer, with its size.
    pub buffer: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {:?}: {} ", self.device, self.kind, self.operation)?;
        write!(f, "on {}", self.buffer)?;
        if let Some(s) = self.stream {
            write!(f, " (queued work on stream {s})")?;
        }
        Ok(())
    }
}

/// The host page size the driver locks memory by.
const PAGE: usize = 4096;

/// A host range the sim's copies may read asynchronously.
struct HostRange {
    addr: usize,
    len: usize,
    /// Registered in place (`true`) or a sim page-locked allocation (`false`).
    registered: bool,
    /// Queued copies that have yet to read it, by stream.
    pending: Vec<u64>,
    /// A sim page-locked buffer's memory (weakly): a copy queued from it keeps it alive.
    mem: Option<Weak<stream::HostMem>>,
}

/// A device allocation's books.
struct Alloc {
    bytes: u64,
    label: String,
    /// The stream it was allocated on (its free is queued there).
    stream: u64,
    /// Its free is queued and has yet to execute.
    freeing: bool,
}

#[derive(Default)]
struct State {
    used: u64,
    peak: u64,
    allocs: HashMap<u64, Alloc>,
    hosts: HashMap<u64, HostRange>,
    faults: HashMap<SimFault, u64>,
    /// Faults armed on several devices as one ([`SimGpu::inject_one_of`]): spent once any of
    /// them fired.
    shared_faults: HashMap<SimFault, Arc<std::sync::atomic::AtomicBool>>,
    violations: Vec<Violation>,
    /// Handles of destroyed streams, given to the next streams made (a CUDA stream's handle is
    /// its `CUstream` pointer, which the driver reuses once the stream is destroyed).
    free_stream_keys: Vec<u64>,
    /// The next stream handle never given out.
    next_stream_key: u64,
    /// Every stream whose worker may still run (a device synchronize waits for each).
    streams: Vec<stream::StreamWatch>,
    /// Per stream: bytes of frees queued there that have yet to execute. An allocation on the
    /// same stream may reuse them (CUDA's stream-ordered allocator does); another stream gets
    /// them only once the free executes.
    freeing: HashMap<u64, u64>,
    /// Per stream: bytes of queued frees already handed to a new allocation on that stream
    /// (they leave `used` when the allocation was made, not again when the free executes).
    reused: HashMap<u64, u64>,
}

/// A simulated GPU (see the module docs). Made by [`SimGpu::new`]; the memory manager makes one
/// per `--sim-gpu` flag.
pub struct SimGpu {
    ordinal: usize,
    spec: SimSpec,
    state: Mutex<State>,
    /// Signalled whenever a queued copy has read its host source.
    read_done: Condvar,
    next_id: AtomicU64,
    jitter: AtomicU64,
    default_stream: Mutex<Option<SimStream>>,
    me: Weak<SimGpu>,
    /// The other simulated GPUs of its set ([`crate::device::Devices::simulated`]): page-locked
    /// memory of any of them is page-locked for all (CUDA's portable memory).
    peers: std::sync::OnceLock<Vec<Weak<SimGpu>>>,
    copies: AtomicU64,
    copied_bytes: AtomicU64,
    copy_ns: AtomicU64,
    waited_ns: AtomicU64,
}

/// What a simulated GPU did: copies, their modelled time, and how long compute waited for them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct SimStats {
    /// Host→device copies executed.
    pub copies: u64,
    /// Bytes they moved.
    pub bytes: ByteSize,
    /// Time the streams spent copying (the modelled durations, as slept).
    pub copy_ns: u64,
    /// Time compute waited for copies (its waits on copy events).
    pub compute_waited_ns: u64,
    /// Checker findings so far.
    pub violations: usize,
}

impl SimStats {
    /// The share of copy time that compute did not wait for (hidden behind compute), 0 to 1.
    pub fn hidden(&self) -> f64 {
        if self.copy_ns == 0 {
            return 1.0;
        }
        1.0 - (self.compute_waited_ns as f64 / self.copy_ns as f64).min(1.0)
    }
}

impl fmt::Debug for SimGpu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimGpu")
            .field("ordinal", &self.ordinal)
            .field("spec", &self.spec)
            .field("used", &self.used())
            .finish()
    }
}

impl SimGpu {
    /// Simulated GPU `sim:ordinal`.
    pub fn new(ordinal: usize, spec: SimSpec) -> Arc<SimGpu> {
        Arc::new_cyclic(|me| SimGpu {
            ordinal,
            spec,
            state: Mutex::new(Rank::SimGpu, State::default()),
            read_done: Condvar::new(),
            next_id: AtomicU64::new(1),
            jitter: AtomicU64::new(spec.jitter_seed.unwrap_or(0)),
            default_stream: Mutex::new(Rank::SimDefaultStream, None),
            me: me.clone(),
            peers: std::sync::OnceLock::new(),
            copies: AtomicU64::new(0),
            copied_bytes: AtomicU64::new(0),
            copy_ns: AtomicU64::new(0),
            waited_ns: AtomicU64::new(0),
        })
    }

    /// Makes `gpus` one set: each one's page-locked memory (host buffers and registered
    /// ranges) is page-locked for the others too, as CUDA's portable memory is for every
    /// context. A copy on one reads another's page-locked memory when it executes, and that
    /// memory's owner tracks the read (its checker reports an unlock or free under it).
    pub fn link(gpus: &[Arc<SimGpu>]) {
        for g in gpus {
            let peers = gpus
                .iter()
                .filter(|p| !Arc::ptr_eq(p, g))
                .map(Arc::downgrade)
                .collect();
            let _ = g.peers.set(peers);
        }
    }

    /// The simulated GPU (this one or a peer) whose page-locked memory holds all of
    /// `addr..addr + len`, with what [`SimGpu::queue_host_read`] returns there.
    pub(crate) fn queue_portable_read(
        &self,
        addr: usize,
        len: usize,
        stream: u64,
    ) -> Option<(Weak<SimGpu>, u64, Option<Arc<stream::HostMem>>)> {
        if let Some((range, keep)) = self.queue_host_read(addr, len, stream) {
            return Some((self.me.clone(), range, keep));
        }
        for peer in self.peers.get().into_iter().flatten() {
            if let Some(p) = peer.upgrade() {
                if let Some((range, keep)) = p.queue_host_read(addr, len, stream) {
                    return Some((peer.clone(), range, keep));
                }
            }
        }
        None
    }

    /// Its id.
    pub fn id(&self) -> DeviceId {
        DeviceId::Sim(self.ordinal)
    }

    /// Its spec.
    pub fn spec(&self) -> SimSpec {
        self.spec
    }

    /// Device memory allocated now.
    pub fn used(&self) -> ByteSize {
        ByteSize(self.state.lock().used)
    }

    /// The most device memory ever allocated at once.
    pub fn peak(&self) -> ByteSize {
        ByteSize(self.state.lock().peak)
    }

    /// Host ranges page-locked in place now, as `(address, length)`.
    pub fn registered_host(&self) -> Vec<(usize, usize)> {
        let st = self.state.lock();
        let mut v: Vec<_> = st
            .hosts
            .values()
            .filter(|h| h.registered)
            .map(|h| (h.addr, h.len))
            .collect();
        v.sort_unstable();
        v
    }

    /// What the device did so far.
    pub fn stats(&self) -> SimStats {
        SimStats {
            copies: self.copies.load(Ordering::Relaxed),
            bytes: ByteSize(self.copied_bytes.load(Ordering::Relaxed)),
            copy_ns: self.copy_ns.load(Ordering::Relaxed),
            compute_waited_ns: self.waited_ns.load(Ordering::Relaxed),
            violations: self.state.lock().violations.len(),
        }
    }

    pub(crate) fn note_copy(&self, bytes: usize, took: Duration) {
        self.copies.fetch_add(1, Ordering::Relaxed);
        self.copied_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        self.copy_ns
            .fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
    }

    pub(crate) fn note_compute_wait(&self, took: Duration) {
        self.waited_ns
            .fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
    }

    /// Makes the `k`-th call of kind `fault` from now (0 = the next) fail, once.
    pub fn inject(&self, fault: SimFault, k: u64) {
        let mut st = self.state.lock();
        st.faults.insert(fault, k);
        st.shared_faults.remove(&fault);
    }

    /// Arms one driver fault on whichever of `gpus` reaches its `k`-th such call first: once it
    /// fired on one, the others no longer fail (a single fault, wherever a call lands — the
    /// rollback that follows it on another device is not failed by a second one).
    pub fn inject_one_of(gpus: &[Arc<SimGpu>], fault: SimFault, k: u64) {
        let spent = Arc::new(std::sync::atomic::AtomicBool::new(false));
        for g in gpus {
            let mut st = g.state.lock();
            st.faults.insert(fault, k);
            st.shared_faults.insert(fault, Arc::clone(&spent));
        }
    }

    /// Cancels every pending injected fault.
    pub fn disarm(&self) {
        let mut st = self.state.lock();
        st.faults.clear();
        st.shared_faults.clear();
    }

    /// Every checker finding so far.
    pub fn violations(&self) -> Vec<Violation> {
        self.state.lock().violations.clone()
    }

    /// Device and page-locked memory still allocated, as [`ViolationKind::Leak`] findings (after
    /// every model was dropped there should be none). Waits for queued work first.
    pub fn leaks(&self) -> Vec<Violation> {
        let _ = self.synchronize();
        let st = self.state.lock();
        let mut out: Vec<Violation> = st
            .allocs
            .values()
            .map(|a| Violation {
                kind: ViolationKind::Leak,
                device: self.id(),
                stream: None,
                operation: "still allocated".into(),
                buffer: format!("device buffer `{}` ({})", a.label, ByteSize(a.bytes)),
            })
            .collect();
        out.extend(st.hosts.values().map(|h| Violation {
            kind: ViolationKind::Leak,
            device: self.id(),
            stream: None,
            operation: if h.registered {
                "still registered".into()
            } else {
                "still allocated".into()
            },
            buffer: format!("page-locked host memory ({})", ByteSize(h.len as u64)),
        }));
        out
    }

    /// `Ok` when the checker found nothing; otherwise every finding, one a line.
    pub fn check(&self) -> std::result::Result<(), String> {
        let v = self.violations();
        if v.is_empty() {
            return Ok(());
        }
        Err(v
            .iter()
            .map(|v| v.to_string())
            .collect::<Vec<_>>()
            .join("\n"))
    }

    /// A new stream with its own worker.
    pub fn new_stream(&self) -> Result<SimStream> {
        let gpu = self
            .me
            .upgrade()
            .ok_or_else(|| self.error("the device is gone"))?;
        if self.fault(SimFault::Stream) {
            return Err(self.injected("creating a stream"));
        }
        let key = {
            let mut st = self.state.lock();
            st.free_stream_keys.pop().unwrap_or_else(|| {
                st.next_stream_key += 1;
                st.next_stream_key
            })
        };
        let made = SimStream::spawn(Arc::clone(&gpu), self.next_id(), key);
        if made.is_err() {
            gpu.release_stream_key(key);
        }
        made
    }

    /// A destroyed stream's handle, free for the next stream (as the driver reuses a destroyed
    /// stream's pointer).
    pub(super) fn release_stream_key(&self, key: u64) {
        self.state.lock().free_stream_keys.push(key);
    }

    /// The stream inline copies use (made on first use).
    ///
    /// # Errors
    /// [`Error::Device`] when its worker cannot be started (the next call tries again).
    pub fn default_stream(&self) -> Result<SimStream> {
        let mut s = self.default_stream.lock();
        if let Some(s) = &*s {
            return Ok(s.clone());
        }
        let made = self.new_stream()?;
        *s = Some(made.clone());
        Ok(made)
    }

    /// Waits for the work queued so far on every stream of the device, destroyed streams whose
    /// work is still running included (CUDA's device synchronize, `cuCtxSynchronize`); a
    /// stream's own [`SimStream::synchronize`] waits for that stream only.
    pub fn synchronize(&self) -> Result<()> {
        let streams: Vec<stream::StreamWatch> = {
            let mut st = self.state.lock();
            st.streams.retain(stream::StreamWatch::is_alive);
            std::mem::take(&mut st.streams)
        };
        for s in &streams {
            s.drain();
        }
        let mut st = self.state.lock();
        let made_meanwhile = std::mem::take(&mut st.streams);
        st.streams = streams;
        st.streams.extend(made_meanwhile);
        Ok(())
    }

    /// Records a new stream for the device-wide synchronize.
    fn watch_stream(&self, watch: stream::StreamWatch) {
        let mut st = self.state.lock();
        st.streams.retain(stream::StreamWatch::is_alive);
        st.streams.push(watch);
    }

    /// Page-locked host memory of `len` bytes, zeroed.
    pub fn alloc_host(&self, len: usize) -> Result<SimHostBuffer> {
        let gpu = self
            .me
            .upgrade()
            .ok_or_else(|| self.error("the device is gone"))?;
        Ok(SimHostBuffer::new(gpu, len))
    }

    fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    fn error(&self, reason: &str) -> Error {
        Error::Device {
            device: self.id().to_string(),
            reason: reason.to_string(),
        }
    }

    /// Consumes one step of an injected fault; `true` when this call must fail.
    fn fault(&self, kind: SimFault) -> bool {
        let mut st = self.state.lock();
        if st
            .shared_faults
            .get(&kind)
            .is_some_and(|spent| spent.load(Ordering::SeqCst))
        {
            // Fired on another device of its set.
            st.faults.remove(&kind);
            st.shared_faults.remove(&kind);
            return false;
        }
        match st.faults.get_mut(&kind) {
            Some(0) => {
                st.faults.remove(&kind);
                if let Some(spent) = st.shared_faults.remove(&kind) {
                    if spent.swap(true, Ordering::SeqCst) {
                        return false;
                    }
                }
                true
            }
            Some(k) => {
                *k -= 1;
                false
            }
            None => false,
        }
    }

    fn injected(&self, what: &str) -> Error {
        self.error(&format!("injected driver fault {what}"))
    }

    fn violation(&self, kind: ViolationKind, stream: Option<u64>, operation: &str, buffer: String) {
        let v = Violation {
            kind,
            device: self.id(),
            stream,
            operation: operation.to_string(),
            buffer,
        };
        tracing::error!(violation = %v, "sim checker");
        self.state.lock().violations.push(v);
    }

    /// The modelled duration of a copy of `bytes`, jittered.
    fn copy_time(&self, bytes: u64) -> Duration {
        let base = self.spec.copy_time(bytes);
        if self.spec.jitter_seed.is_none() {
            return base;
        }
        // splitmix64 on a counter: a seeded stream of fractions.
        let golden = crate::float::GOLDEN;
        let z = crate::float::mix64(
            self.jitter
                .fetch_add(golden, Ordering::Relaxed)
                .wrapping_add(golden),
        );
        let frac = (z >> 11) as f64 / (1u64 << 53) as f64;
        base.mul_f64(1.0 + 0.5 * frac)
    }

    /// Books a device allocation; out of memory beyond the capacity.
    fn book_alloc(&self, bytes: u64, label: &str, stream: u64) -> Result<u64> {
        if self.fault(SimFault::Alloc) {
            return Err(self.oom(bytes, label));
        }
        let mut st = self.state.lock();
        // Frees queued on this stream are this allocation's to reuse (stream order puts the
        // free first); everything else live or still being freed is the device's.
        let reusable = st.freeing.get(&stream).copied().unwrap_or(0);
        let reuse = reusable.min(bytes);
        if st.used - reuse + bytes > self.spec.capacity.bytes() {
            drop(st);
            return Err(self.oom(bytes, label));
        }
        if reuse > 0 {
            *st.freeing.entry(stream).or_default() -= reuse;
            *st.reused.entry(stream).or_default() += reuse;
        }
        let id = self.next_id();
        st.used = st.used - reuse + bytes;
        st.peak = st.peak.max(st.used);
        st.allocs.insert(
            id,
            Alloc {
                bytes,
                label: label.to_string(),
                stream,
                freeing: false,
            },
        );
        Ok(id)
    }

    /// Notes that allocation `id`'s free was queued on its stream.
    fn queue_free(&self, id: u64) {
        let mut st = self.state.lock();
        let Some(a) = st.allocs.get_mut(&id) else {
            return;
        };
        a.freeing = true;
        let (stream, bytes) = (a.stream, a.bytes);
        *st.freeing.entry(stream).or_default() += bytes;
    }

    fn oom(&self, bytes: u64, label: &str) -> Error {
        let used = self.used();
        Error::OutOfMemory {
            model: format!("allocating `{label}`"),
            device: self.id().to_string(),
            required: ByteSize(bytes),
            available: self.spec.capacity.saturating_sub(used),
        }
    }

    fn free_alloc(&self, id: u64) {
        let mut st = self.state.lock();
        let Some(a) = st.allocs.remove(&id) else {
            return;
        };
        if !a.freeing {
            st.used -= a.bytes;
            return;
        }
        // A queued free executes: what a later allocation on its stream already reused left
        // `used` then.
        let reused = st.reused.get(&a.stream).copied().unwrap_or(0).min(a.bytes);
        let unclaimed = a.bytes - reused;
        if reused > 0 {
            *st.reused.entry(a.stream).or_default() -= reused;
        }
        if let Some(f) = st.freeing.get_mut(&a.stream) {
            *f = f.saturating_sub(unclaimed);
        }
        st.used -= unclaimed;
    }

    /// Page-locks `addr..addr + len` in place (a registered range).
    pub(crate) fn register_host(&self, addr: usize, len: usize) -> Result<()> {
        if self.fault(SimFault::Register) {
            return Err(self.injected("page-locking host memory"));
        }
        // Page-locking takes the driver a while (it walks and locks every page): one latency.
        precise_sleep(self.spec.latency);
        let mut st = self.state.lock();
        // The driver locks whole pages: a range sharing a page with a locked one is refused,
        // even when the bytes themselves do not overlap (weights adjacent in one host buffer:
        // only the first of them is locked on a GPU, the rest are staged).
        let pages = |a: usize, l: usize| (a / PAGE, (a + l.max(1)).div_ceil(PAGE));
        let (first, end) = pages(addr, len);
        let overlaps = st.hosts.values().any(|h| {
            let (h_first, h_end) = pages(h.addr, h.len);
            first < h_end && h_first < end
        });
        if overlaps {
            return Err(self.error(
                "host memory already registered (CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED)",
            ));
        }
        let id = self.next_id();
        st.hosts.insert(
            id,
            HostRange {
                addr,
                len,
                registered: true,
                pending: Vec::new(),
                mem: None,
            },
        );
        Ok(())
    }

    /// Unlocks a registered range. A queued copy that has yet to read it is a violation; the sim
    /// then waits for the copy before returning (the caller frees the memory next).
    pub(crate) fn unregister_host(&self, addr: usize) -> Result<()> {
        let st = self.state.lock();
        let Some((&id, _)) = st
            .hosts
            .iter()
            .find(|(_, h)| h.registered && h.addr == addr)
        else {
            return Err(self.error("unlocking host memory that is not registered"));
        };
        drop(st);
        self.settle_host(
            id,
            ViolationKind::UnlockedUnderCopy,
            "unlocking host memory (cuMemHostUnregister)",
        );
        self.state.lock().hosts.remove(&id);
        Ok(())
    }

    /// The page-locked range holding all of `addr..addr + len`, if any: its id, and the sim
    /// buffer memory behind it (for the queued copy to keep alive). A copy that will read it from
    /// `stream` is noted as pending.
    fn queue_host_read(
        &self,
        addr: usize,
        len: usize,
        stream: u64,
    ) -> Option<(u64, Option<Arc<stream::HostMem>>)> {
        let mut st = self.state.lock();
        let (&id, h) = st
            .hosts
            .iter_mut()
            .find(|(_, h)| addr >= h.addr && addr + len <= h.addr + h.len)?;
        h.pending.push(stream);
        Some((id, h.mem.as_ref().and_then(Weak::upgrade)))
    }

    /// Blocks until no queued copy still reads range `id`, reporting `kind` first if one does.
    fn settle_host(&self, id: u64, kind: ViolationKind, operation: &str) {
        let mut st = self.state.lock();
        let Some(h) = st.hosts.get(&id) else { return };
        if let Some(&stream) = h.pending.first() {
            let buffer = if h.registered {
                format!(
                    "pinned weight at {:#x} ({})",
                    h.addr,
                    ByteSize(h.len as u64)
                )
            } else {
                format!("staging buffer ({})", ByteSize(h.len as u64))
            };
            drop(st);
            self.violation(kind, Some(stream), operation, buffer);
            st = self.state.lock();
            while st.hosts.get(&id).is_some_and(|h| !h.pending.is_empty()) {
                self.read_done.wait(&mut st);
            }
        }
    }

    fn add_host_range(&self, addr: usize, len: usize, mem: Weak<stream::HostMem>) -> u64 {
        let id = self.next_id();
        self.state.lock().hosts.insert(
            id,
            HostRange {
                addr,
                len,
                registered: false,
                pending: Vec::new(),
                mem: Some(mem),
            },
        );
        id
    }

    fn remove_host_range(&self, id: u64) {
        self.state.lock().hosts.remove(&id);
    }

    /// A copy on `stream` has read range `id`.
    fn host_read_done(&self, id: u64, stream: u64) {
        let mut st = self.state.lock();
        if let Some(h) = st.hosts.get_mut(&id) {
            if let Some(p) = h.pending.iter().position(|&s| s == stream) {
                h.pending.swap_remove(p);
            }
        }
        drop(st);
        self.read_done.notify_all();
    }
}

#[cfg(test)]
mod tests;

/// Sleeps `d` as closely as the OS allows: on Linux with the thread's timer slack cut to 1 µs for
/// the sleep (the default 50 µs turned a modelled 12 µs copy into 88 µs on the 2-core machine
/// here, 32 µs with it), restored after. The simulated GPU's modelled times are this short.
pub(crate) fn precise_sleep(d: std::time::Duration) {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: PR_GET/SET_TIMERSLACK read and set a per-thread scheduling value; no memory
        // is passed.
        let old = unsafe { libc::prctl(libc::PR_GET_TIMERSLACK, 0, 0, 0, 0) };
        let cut = old > 1000 && unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1000, 0, 0, 0) } == 0;
        std::thread::sleep(d);
        if cut {
            // SAFETY: as above.
            unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, old as libc::c_ulong, 0, 0, 0) };
        }
    }
    #[cfg(not(target_os = "linux"))]
    std::thread::sleep(d);
}
