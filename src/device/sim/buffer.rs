//! The sim's device buffers and page-locked host buffers.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

use crate::lock::{Condvar, Mutex};
use candle_core::{CpuStorage, DType, Shape, Storage, Tensor};

use super::stream::*;
use super::{SimGpu, ViolationKind};
use crate::error::{Error, Result};
use crate::size::ByteSize;

/// The memory of a simulated device buffer: a candle CPU storage, written by copies through
/// `ptr` while `pending > 0`, handed to compute once they completed.
pub(super) struct DevMem {
    pub(super) ptr: usize,
    pub(super) len: usize,
    pub(super) storage: Mutex<Option<CpuStorage>>,
    pub(super) pending: Mutex<u32>,
    pub(super) written: Condvar,
    /// The stream and op number of the latest copy into it.
    pub(super) written_by: Mutex<Option<(u64, u64)>>,
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
    pub(super) mem: Arc<DevMem>,
    pub(super) id: u64,
    pub(super) gpu: Arc<SimGpu>,
    /// The stream it was allocated on: freeing it is ordered after that stream's work, as
    /// CUDA's stream-ordered free (`cuMemFreeAsync` on the allocating stream, which cudarc's
    /// `CudaSlice` drop uses) is.
    pub(super) stream: u64,
    /// That stream: the free is queued on it, and the bytes return to the device's capacity
    /// only when it executes (another stream cannot have them before).
    pub(super) core: Weak<Core>,
    /// The free was queued already.
    pub(super) freed: bool,
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

pub(super) fn zeros(dtype: DType, len: usize) -> Result<CpuStorage> {
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

pub(super) fn storage_ptr(s: &CpuStorage) -> usize {
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

/// The memory of a sim page-locked host buffer: words from `Box::into_raw`, freed when the last
/// holder (the buffer, or a queued copy still to read it) drops it.
///
/// It holds the allocation as a raw pointer, not a `Box`: a `Box` asserts unique access each
/// time it moves, which would invalidate the pointers `SimHostBuffer::ptr` and queued copies
/// read and write through (undefined behaviour under Stacked Borrows). Every access goes through
/// pointers derived from `words`.
pub(crate) struct HostMem {
    words: std::ptr::NonNull<[u64]>,
    /// Set when the buffer is freed: a queued copy still reading it reads poison.
    pub(super) freed: AtomicBool,
}

impl HostMem {
    /// `len` zeroed bytes (rounded up to whole `u64` words, so 8-aligned).
    fn zeroed(len: usize) -> HostMem {
        let words = Box::into_raw(vec![0u64; len.div_ceil(8)].into_boxed_slice());
        HostMem {
            // SAFETY: `Box::into_raw` never returns null (an empty slice gives a dangling,
            // non-null, aligned pointer).
            words: unsafe { std::ptr::NonNull::new_unchecked(words) },
            freed: AtomicBool::new(false),
        }
    }

    /// The first byte.
    fn as_ptr(&self) -> *mut u8 {
        self.words.as_ptr().cast::<u8>()
    }
}

impl Drop for HostMem {
    fn drop(&mut self) {
        // SAFETY: `words` came from `Box::into_raw` in `zeroed` and is freed only here, once;
        // nothing reads or writes it any more: the `SimHostBuffer` and every queued copy that
        // reads it hold an `Arc<HostMem>`, and this is the last one going.
        drop(unsafe { Box::from_raw(self.words.as_ptr()) });
    }
}

// SAFETY: `HostMem` owns its words as a `Box<[u64]>` would (plain data, freed once in `Drop`);
// the pointer only stops the compiler from seeing that. Who reads and writes them, and when, is
// `SimHostBuffer`'s contract below.
unsafe impl Send for HostMem {}
// SAFETY: as above; `&HostMem` gives no access to the words by itself.
unsafe impl Sync for HostMem {}

/// Page-locked host memory of a simulated device (a staging buffer), zeroed at creation.
pub struct SimHostBuffer {
    pub(super) mem: Arc<HostMem>,
    pub(super) ptr: *mut u8,
    pub(super) len: usize,
    pub(super) range: u64,
    pub(super) gpu: Arc<SimGpu>,
}

// SAFETY: `ptr` addresses `mem`'s words, owned through `mem`; writes need `&mut self` and wait for
// every queued read first; queued reads only read.
unsafe impl Send for SimHostBuffer {}
// SAFETY: as above.
unsafe impl Sync for SimHostBuffer {}

impl SimHostBuffer {
    pub(super) fn new(gpu: Arc<SimGpu>, len: usize) -> SimHostBuffer {
        let mem = Arc::new(HostMem::zeroed(len));
        // Derived from the raw allocation, so moving `mem` (or the `Arc`) never invalidates it.
        let ptr = mem.as_ptr();
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
        // SAFETY: `ptr..ptr + len` lies in `mem`'s words, alive while `self` is; writers need
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
