//! Page-locking host copies of weights in place, so a GPU copy DMAs straight from them.
//!
//! A [`PinnedWeight`] page-locks the memory of one host tensor where it already lives (CUDA's
//! `cuMemHostRegister`; no copy is made) and keeps a handle to the tensor, so the memory cannot
//! be freed while it is locked. Dropping it waits for the last copy out of the memory (the
//! event [`PinnedWeight::record_copy`] recorded) and unlocks it: memory is never unlocked under
//! a running DMA.
//!
//! Locking goes through a [`PageLocker`]: [`CudaLocker`] on a machine with a CUDA driver, a test
//! double in tests. A lock that fails is not an error: the weight is copied through a staging
//! buffer as before ([`crate::weights::HostTier::try_pin`] keeps the books and the budget).
//!
//! Lock: `PinnedWeight::last_copy` is a leaf (rank 9 in the crate's lock table), held to record
//! or take the event, never across a wait.

use std::sync::Arc;

use candle_core::{CpuStorage, Storage, Tensor};
use cudarc::driver::{CudaContext, CudaEvent, CudaStream, DriverError};
use parking_lot::Mutex;

use crate::size::ByteSize;

/// Page-locks and unlocks host memory in place.
pub trait PageLocker: Send + Sync {
    /// Page-locks `bytes` so a device can DMA from them. An error says why it could not (the
    /// caller falls back to staging, nothing is lost).
    fn lock(&self, bytes: &[u8]) -> std::result::Result<(), String>;
    /// Unlocks memory locked by [`PageLocker::lock`].
    fn unlock(&self, bytes: &[u8]);
}

/// Page-locking through the CUDA driver (`cuMemHostRegister`, portable to every context).
pub struct CudaLocker {
    ctx: Arc<CudaContext>,
}

impl CudaLocker {
    /// A locker in `ctx`'s context (candle's, where candle computes).
    pub fn new(ctx: Arc<CudaContext>) -> CudaLocker {
        CudaLocker { ctx }
    }
}

impl PageLocker for CudaLocker {
    fn lock(&self, bytes: &[u8]) -> std::result::Result<(), String> {
        use cudarc::driver::sys;
        self.ctx.bind_to_thread().map_err(|e| e.to_string())?;
        // SAFETY: `bytes` is live, initialised host memory for the duration of the call; the
        // driver only page-locks it (it neither reads nor writes it here). The caller
        // (`PinnedWeight`) keeps the memory alive until `unlock`.
        unsafe {
            sys::cuMemHostRegister_v2(
                bytes.as_ptr() as *mut std::ffi::c_void,
                bytes.len(),
                sys::CU_MEMHOSTREGISTER_PORTABLE,
            )
        }
        .result()
        .map_err(|e: DriverError| e.to_string())
    }

    fn unlock(&self, bytes: &[u8]) {
        use cudarc::driver::sys;
        if let Err(e) = self.ctx.bind_to_thread() {
            tracing::warn!(error = %e, "binding the CUDA context to unlock a weight");
            return;
        }
        // SAFETY: `bytes` was registered by `lock` and is still allocated (the `PinnedWeight`
        // holding it is being dropped and still owns its tensor); no copy from it is running
        // (the caller waited on its last copy's event).
        let r = unsafe { sys::cuMemHostUnregister(bytes.as_ptr() as *mut std::ffi::c_void) };
        if let Err(e) = r.result() {
            tracing::warn!(error = %e, "unlocking a pinned weight");
        }
    }
}

/// The address and length of a contiguous CPU tensor's bytes, or `None` for anything else.
pub(crate) fn host_bytes(t: &Tensor) -> Option<(usize, usize)> {
    let (storage, layout) = t.storage_and_layout();
    let (start, end) = layout.contiguous_offsets()?;
    let Storage::Cpu(cpu) = &*storage else {
        return None;
    };
    fn span<T>(v: &[T], start: usize, end: usize) -> Option<(usize, usize)> {
        let s = v.get(start..end)?;
        Some((s.as_ptr() as usize, std::mem::size_of_val(s)))
    }
    match cpu {
        CpuStorage::F32(v) => span(v, start, end),
        CpuStorage::F16(v) => span(v, start, end),
        CpuStorage::BF16(v) => span(v, start, end),
        CpuStorage::F64(v) => span(v, start, end),
        CpuStorage::U8(v) => span(v, start, end),
        CpuStorage::F8E4M3(v) => span(v, start, end),
        _ => None,
    }
}

/// One host tensor page-locked in place (see the module docs).
pub struct PinnedWeight {
    /// Keeps the locked memory allocated (and, clean weights being immutable, unchanged).
    _tensor: Tensor,
    addr: usize,
    len: usize,
    locker: Arc<dyn PageLocker>,
    last_copy: Mutex<Option<CudaEvent>>,
}

impl std::fmt::Debug for PinnedWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedWeight")
            .field("bytes", &self.len)
            .finish()
    }
}

impl PinnedWeight {
    /// Page-locks `tensor`'s memory in place. `Err` says why it could not (not a contiguous CPU
    /// tensor, or the locker refused).
    pub(crate) fn lock(
        tensor: &Tensor,
        locker: Arc<dyn PageLocker>,
    ) -> std::result::Result<PinnedWeight, String> {
        let (addr, len) =
            host_bytes(tensor).ok_or_else(|| "not a contiguous host tensor".to_string())?;
        let keep = tensor.clone();
        // SAFETY: `addr..addr + len` are the bytes of `keep`'s CPU storage, alive while `keep`
        // is, and never written (I1).
        locker.lock(unsafe { std::slice::from_raw_parts(addr as *const u8, len) })?;
        // Built only once locked: dropping it unlocks.
        Ok(PinnedWeight {
            _tensor: keep,
            addr,
            len,
            locker,
            last_copy: Mutex::new(None),
        })
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: `addr..addr + len` are the bytes of `_tensor`'s CPU storage, which this value
        // keeps alive; candle never reallocates a storage, and clean weights are never mutated
        // (I1), so the bytes stay valid and unchanged for as long as `self` exists.
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len) }
    }

    /// Bytes locked.
    pub fn size(&self) -> ByteSize {
        ByteSize(self.len as u64)
    }

    /// Whether `bytes` lie inside the locked memory (a copy from them may run as a DMA).
    pub fn covers(&self, bytes: &[u8]) -> bool {
        let a = bytes.as_ptr() as usize;
        a >= self.addr && a.saturating_add(bytes.len()) <= self.addr + self.len
    }

    /// Records an event on `stream` after the copy just enqueued there; unlocking waits on it.
    pub(crate) fn record_copy(&self, stream: &Arc<CudaStream>) -> Result<(), DriverError> {
        let mut last = self.last_copy.lock();
        match &*last {
            Some(e) => e.record(stream),
            None => {
                *last = Some(stream.record_event(None)?);
                Ok(())
            }
        }
    }
}

impl Drop for PinnedWeight {
    fn drop(&mut self) {
        if let Some(e) = self.last_copy.get_mut().take() {
            if let Err(e) = e.synchronize() {
                tracing::warn!(error = %e, "waiting for a copy before unlocking its weight");
            }
        }
        self.locker.unlock(self.bytes());
    }
}
