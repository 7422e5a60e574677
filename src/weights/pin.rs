//! Page-locking host copies of weights in place, so a GPU copy DMAs straight from them.
//!
//! A [`PinnedWeight`] page-locks the memory of one host tensor where it already lives (CUDA's
//! `cuMemHostRegister`, or the sim's registration; no copy is made) and keeps a handle to the
//! tensor, so the memory cannot be freed while it is locked. The driver locks whole pages and
//! refuses a range touching a locked page, so what is registered is the tensor's bytes rounded
//! out to whole pages (a page-aligned address and size) when those pages lie inside the
//! tensor's own storage, as they do for every weight the crate reads that is large enough to
//! pin (`page.rs`): its neighbours' pins then never collide with it. A tensor made elsewhere,
//! whose first and last pages may hold other memory, registers its exact bytes, which the
//! driver may refuse (it is staged then).
//!
//! Every copy out of a pin records an event on its stream in the weight's [`Fences`] — one event
//! per stream, so copies of one weight queued on two lanes, or on a lane and the compute stream,
//! are each waited for (one event re-recorded on every stream would keep only the latest: F1).
//! Dropping it waits on all of them and only then unlocks: memory is never unlocked under a
//! running DMA. When that wait fails, the memory is neither unlocked nor freed (it is leaked,
//! with an error in the log): a copy may still read it.
//!
//! Locking goes through the device interface ([`crate::device::Gpu`]); a lock that fails is not
//! an error: the weight is copied through a staging buffer as before
//! ([`crate::weights::HostTier::try_pin`] keeps the books and the budget). Registration is
//! `unsafe` and crate-private, so safe code cannot unlock memory a live `PinnedWeight` copies from.
//!
//! Lock: `PinnedWeight::fences` is `Rank::PinFences` in the crate's lock table
//! (`src/lock/rank.rs`), held to record an event (which never waits) and while dropping.

use crate::lock::{Mutex, Rank};
use candle_core::{CpuStorage, Storage, Tensor};

use super::page::page_span;
use crate::device::{Fences, Gpu, Stream};
use crate::error::Result;
use crate::size::ByteSize;

/// The address and length of a contiguous CPU tensor's bytes, or `None` for anything else.
pub(crate) fn host_bytes(t: &Tensor) -> Option<(usize, usize)> {
    with_host_bytes(t, |p| (p.addr, p.len))
}

/// The bytes of `t` and the bytes a pin of it would lock, `(tensor bytes, locked bytes)`, or
/// `None` when `t` is not a contiguous CPU tensor.
pub(crate) fn pin_extent(t: &Tensor) -> Option<(u64, u64)> {
    with_host_bytes(t, |p| (p.len as u64, p.lock.1 as u64))
}

/// Where a contiguous CPU tensor's bytes lie, and what a pin of them locks.
#[derive(Debug, Clone, Copy)]
struct Placement {
    addr: usize,
    len: usize,
    /// The range to register, `(address, length)`: the bytes rounded out to whole pages when
    /// those pages lie inside the tensor's own storage (a buffer the crate read onto pages of its
    /// own, `page.rs`), so the registration is page-aligned and no other memory shares it; else
    /// the bytes themselves (a tensor made elsewhere, whose first and last pages may hold other
    /// memory: the driver may refuse it, and the weight is then staged).
    lock: (usize, usize),
}

/// Calls `f` with where a contiguous CPU tensor's bytes lie while holding candle's lock on its
/// storage (so no in-place candle operation can change it meanwhile).
fn with_host_bytes<R>(t: &Tensor, f: impl FnOnce(Placement) -> R) -> Option<R> {
    let (storage, layout) = t.storage_and_layout();
    let (start, end) = layout.contiguous_offsets()?;
    let Storage::Cpu(cpu) = &*storage else {
        return None;
    };
    fn place<T>(v: &[T], start: usize, end: usize) -> Option<Placement> {
        let s = v.get(start..end)?;
        let (addr, len) = (s.as_ptr() as usize, std::mem::size_of_val(s));
        let (base, all) = (v.as_ptr() as usize, std::mem::size_of_val(v));
        let (lo, n) = page_span(addr, len);
        let own = len > 0 && lo >= base && lo + n <= base + all;
        let lock = if own { (lo, n) } else { (addr, len) };
        Some(Placement { addr, len, lock })
    }
    let placement = match cpu {
        CpuStorage::F32(v) => place(v, start, end),
        CpuStorage::F16(v) => place(v, start, end),
        CpuStorage::BF16(v) => place(v, start, end),
        CpuStorage::F64(v) => place(v, start, end),
        CpuStorage::U8(v) => place(v, start, end),
        CpuStorage::F8E4M3(v) => place(v, start, end),
        // Token ids and positions (activations a split model moves between devices).
        CpuStorage::U32(v) => place(v, start, end),
        CpuStorage::I64(v) => place(v, start, end),
        _ => None,
    }?;
    Some(f(placement))
}

/// One host tensor page-locked in place (see the module docs).
pub struct PinnedWeight {
    /// Keeps the locked memory allocated (and, clean weights being immutable, unchanged).
    tensor: Option<Tensor>,
    addr: usize,
    len: usize,
    gpu: Gpu,
    fences: Mutex<Fences>,
}

impl std::fmt::Debug for PinnedWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedWeight")
            .field("bytes", &self.len)
            .field("gpu", &self.gpu)
            .finish()
    }
}

impl PinnedWeight {
    /// Page-locks `tensor`'s memory in place on `gpu`. `Err` says why it could not (not a
    /// contiguous CPU tensor, or the driver refused).
    pub(crate) fn lock(tensor: &Tensor, gpu: Gpu) -> std::result::Result<PinnedWeight, String> {
        let locked = with_host_bytes(tensor, |p| {
            let (addr, len) = p.lock;
            // SAFETY: `addr..addr + len` lies in `tensor`'s CPU storage (its bytes, or the whole
            // pages around them when those pages are inside that storage), held by the
            // `PinnedWeight` built below until it unregisters them after waiting on every copy
            // out of them (its `Drop`); on failure nothing is registered.
            unsafe { gpu.register_host(addr, len) }.map(|()| (addr, len))
        })
        .ok_or_else(|| "not a contiguous host tensor".to_string())?;
        let (addr, len) = locked.map_err(|e| e.to_string())?;
        // Built only once locked: dropping it unlocks.
        Ok(PinnedWeight {
            tensor: Some(tensor.clone()),
            addr,
            len,
            gpu,
            fences: Mutex::new(Rank::PinFences, Fences::new()),
        })
    }

    /// Bytes locked: the weight's bytes rounded out to whole pages when it sits on pages of its
    /// own (a weight the crate read), else its bytes.
    pub fn size(&self) -> ByteSize {
        ByteSize(self.len as u64)
    }

    /// The device it is locked for.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Whether `bytes` lie inside the locked memory (a copy from them may run as a DMA).
    pub fn covers(&self, bytes: &[u8]) -> bool {
        let a = bytes.as_ptr() as usize;
        a >= self.addr && a.saturating_add(bytes.len()) <= self.addr + self.len
    }

    /// Records, on `stream`, the copy just enqueued there; unlocking waits for it (and for every
    /// other stream's). A copy whose event could not be recorded is fenced by its stream.
    pub(crate) fn record_copy(&self, stream: &Stream) -> Result<()> {
        self.fences.lock().record(stream)
    }

    /// Streams with a recorded copy (for tests).
    #[cfg(test)]
    pub(crate) fn fenced_streams(&self) -> usize {
        self.fences.lock().len()
    }
}

impl Drop for PinnedWeight {
    fn drop(&mut self) {
        if let Err(e) = self.fences.get_mut().wait_all() {
            tracing::error!(error = %e, bytes = self.len, "a copy out of a pinned weight could not be waited for; leaving it locked and allocated");
            std::mem::forget(self.tensor.take());
            return;
        }
        // SAFETY: registered by `lock` on this device; `tensor` still holds the memory; every copy
        // out of it has completed (waited above).
        if let Err(e) = unsafe { self.gpu.unregister_host(self.addr) } {
            tracing::warn!(error = %e, "unlocking a pinned weight");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::sync::Arc;
    use std::time::Duration;

    use candle_core::{DType, Device, Shape};

    use super::*;
    use crate::device::{DeviceBuffer, SimFault, SimGpu, SimSpec};

    fn sim() -> (Arc<SimGpu>, Gpu) {
        let g = SimGpu::new(0, SimSpec::new(ByteSize::mib(64)));
        (Arc::clone(&g), Gpu::Sim(g))
    }

    /// Holds `stream`'s queue until the returned sender is dropped.
    fn hold(stream: &Stream) -> mpsc::Sender<()> {
        let Stream::Sim(s) = stream else {
            unreachable!("sim streams only here")
        };
        let (tx, rx) = mpsc::channel::<()>();
        s.launch(move || {
            let _ = rx.recv();
        });
        tx
    }

    /// Enqueues a copy of `pin`'s bytes on `stream` and records it, as the upload path does.
    fn copy_out(pin: &PinnedWeight, w: &Tensor, stream: &Stream) -> Result<DeviceBuffer> {
        let (addr, len) = host_bytes(w).unwrap();
        // SAFETY: the bytes of `w`, page-locked by `pin`, which waits for the recorded copy.
        let src = unsafe { std::slice::from_raw_parts(addr as *const u8, len) };
        let mut dst = stream.alloc(DType::U8, len)?;
        // SAFETY: as above; recorded right after.
        unsafe { stream.copy_htod(src, &mut dst) }?;
        pin.record_copy(stream)?;
        Ok(dst)
    }

    fn weight() -> Tensor {
        Tensor::full(1.5f32, 1 << 14, &Device::Cpu).unwrap()
    }

    /// Releases `gate` after a while on another thread (while the caller blocks in a drop).
    fn release_later(gate: mpsc::Sender<()>) -> std::thread::JoinHandle<()> {
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            drop(gate);
        })
    }

    #[test]
    fn unlocking_waits_for_copies_queued_on_every_stream() {
        // F1: copies of one pinned weight on two streams (two lanes, or a lane and the compute
        // stream). With one event re-recorded on each, the drop waited for the latest copy only
        // and unlocked under the other.
        let (g, gpu) = sim();
        let w = weight();
        let pin = PinnedWeight::lock(&w, gpu.clone()).unwrap();
        let (a, b) = (gpu.new_stream().unwrap(), gpu.new_stream().unwrap());
        let gate = hold(&a);
        let on_a = copy_out(&pin, &w, &a).unwrap();
        let on_b = copy_out(&pin, &w, &b).unwrap();
        b.synchronize().unwrap();
        assert_eq!(pin.fenced_streams(), 2);
        let release = release_later(gate);
        drop(pin);
        release.join().unwrap();
        assert!(g.registered_host().is_empty());
        g.check().expect("nothing unlocked under a queued copy");
        a.synchronize().unwrap();
        let shape = Shape::from(w.elem_count() * 4);
        for buf in [on_a, on_b] {
            let t = buf.into_tensor(&shape).unwrap();
            assert_eq!(
                t.to_vec1::<u8>().unwrap(),
                bytemuck::cast_slice::<f32, u8>(&w.to_vec1::<f32>().unwrap())
            );
        }
    }

    #[test]
    fn a_copy_whose_event_failed_is_waited_for_before_unlocking() {
        // F1, second half: the copy is queued but its event could not be recorded, so nothing
        // would track it. Its stream is its fence: unlocking synchronizes that stream first
        // (recording never waits, so the fences' lock is never held across a device wait).
        let (g, gpu) = sim();
        let w = weight();
        let pin = PinnedWeight::lock(&w, gpu.clone()).unwrap();
        let a = gpu.new_stream().unwrap();
        let gate = hold(&a);
        let release = release_later(gate);
        g.inject(SimFault::Record, 0);
        let err = copy_out(&pin, &w, &a).err().expect("the record fails");
        assert!(err.to_string().contains("injected"), "{err}");
        drop(pin);
        release.join().unwrap();
        g.check()
            .expect("nothing unlocked under the untracked copy");
    }

    #[test]
    fn a_weight_copied_to_two_devices_records_each_on_its_own() {
        let (g0, gpu0) = sim();
        let g1 = SimGpu::new(1, SimSpec::new(ByteSize::mib(64)));
        let w = weight();
        let pin = PinnedWeight::lock(&w, gpu0.clone()).unwrap();
        let a = gpu0.new_stream().unwrap();
        let b = Gpu::Sim(Arc::clone(&g1)).new_stream().unwrap();
        let gate = hold(&a);
        let _on_a = copy_out(&pin, &w, &a).unwrap();
        // One event for every stream would fail here (an event of sim:0 recorded on sim:1) after
        // the copy was queued.
        let _on_b = copy_out(&pin, &w, &b).unwrap();
        let release = release_later(gate);
        drop(pin);
        release.join().unwrap();
        g0.check().unwrap();
        g1.check().unwrap();
    }
}
