//! Host staging buffers for host→device copies, bounded and reused by size class.
//!
//! On a machine with a CUDA driver the buffers are page-locked (cudarc `cuMemHostAlloc` with
//! write-combining: fast for the device to read, slow for the CPU to read back — these buffers
//! are only written by the CPU and read by the copy engine). Elsewhere they are plain aligned
//! buffers whose pages are touched once at creation, so a copy into them never pays first-touch
//! page faults. A pin that fails falls back to an aligned buffer with one warning.
//!
//! Reuse by size class: a request of `n` bytes takes a buffer of the next power of two (at least
//! 64 KiB). The pool never holds more than its limit; a request that does not fit returns `None`
//! and the caller copies from pageable memory instead.
//!
//! Ordering: a [`StagingBuffer`] is exclusively borrowed while in use and returns to the pool
//! when dropped — possibly while a copy from it is still running on a stream. A pinned buffer
//! therefore owns the CUDA event of its last copy ([`StagingBuffer::copy_to_device`] records it):
//! writing into the buffer ([`StagingBuffer::as_mut_bytes`]) and freeing it both wait on that
//! event first, so a buffer is never overwritten or freed while a copy from it is in flight.
//!
//! Staging exists for host→device copies only. A weight whose destination is the CPU has no
//! copy to stage, so the transfer lanes never take a buffer for one.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use crate::lock::{Mutex, Rank};

use crate::device::{DeviceBuffer, Fences, Gpu, HostBuffer, Stream};
use crate::error::Result;
use crate::size::ByteSize;

/// The smallest size class.
pub const MIN_CLASS: usize = 64 * 1024;

/// The default pool limit: a quarter of the host RAM available when probed (which already
/// respects the cgroup limit), at most 8 GiB.
pub fn default_limit(available: ByteSize) -> ByteSize {
    ByteSize(available.bytes() / 4).min(ByteSize::gib(8))
}

fn class_of(n: usize) -> usize {
    n.max(MIN_CLASS).next_power_of_two()
}

/// Memory behind a staging buffer.
enum HostMem {
    /// 64-byte aligned, pages touched at creation.
    Aligned(Vec<u64>),
    /// Page-locked through a device, with the events of the copies out of it.
    Locked(LockedMem),
}

/// Page-locked memory and the events of the copies out of it, one per stream (one event
/// re-recorded on every stream would only track the latest copy: F2).
struct LockedMem {
    /// `None` only after a failed wait in `drop`, when the memory is leaked instead of freed.
    mem: Option<HostBuffer>,
    fences: Fences,
}

impl Drop for LockedMem {
    fn drop(&mut self) {
        // The page-locked memory is freed right after this: never under a running copy. When the
        // wait fails, a copy may still read it: leak it rather than free it under the copy.
        if let Err(e) = self.fences.wait_all() {
            tracing::error!(error = %e, "a staging copy could not be waited for; leaking its buffer");
            std::mem::forget(self.mem.take());
        }
    }
}

impl HostMem {
    fn aligned(bytes: usize) -> HostMem {
        let mut v = vec![0u64; bytes.div_ceil(8)];
        // Touch every page once (the zeroed allocation may be untouched copy-on-write pages) so
        // later copies run at memcpy speed instead of paying first-touch faults.
        for i in (0..v.len()).step_by(4096 / 8) {
            v[i] = std::hint::black_box(0);
        }
        HostMem::Aligned(v)
    }

    fn as_mut_bytes(&mut self) -> Option<&mut [u8]> {
        match self {
            HostMem::Aligned(v) => Some(bytemuck::cast_slice_mut(v.as_mut_slice())),
            // Waits for every copy out of the buffer before handing it out.
            HostMem::Locked(p) => {
                p.fences.wait_all().ok()?;
                p.mem.as_mut()?.as_mut_slice().ok()
            }
        }
    }

    fn is_pinned(&self) -> bool {
        matches!(self, HostMem::Locked(_))
    }
}

#[derive(Default)]
struct PoolInner {
    free: HashMap<usize, Vec<HostMem>>,
    allocated: u64,
}

struct Shared {
    inner: Mutex<PoolInner>,
    limit: ByteSize,
    gpu: Option<Gpu>,
    pin_failed: AtomicBool,
    reused: AtomicU64,
    created: AtomicU64,
    fallbacks: AtomicU64,
}

/// A bounded pool of host staging buffers.
#[derive(Clone)]
pub struct PinnedPool {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for PinnedPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedPool")
            .field("limit", &self.shared.limit)
            .field("allocated", &self.allocated())
            .field("pinned", &self.shared.gpu.is_some())
            .finish()
    }
}

/// Counters of a pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolStats {
    /// Bytes held by the pool (free and in use).
    pub allocated: ByteSize,
    /// Buffers created.
    pub created: u64,
    /// Requests served by reusing a buffer.
    pub reused: u64,
    /// Requests that did not fit the limit (the caller copied from pageable memory).
    pub fallbacks: u64,
    /// Whether buffers are page-locked.
    pub pinned: bool,
}

impl PinnedPool {
    /// A pool of at most `limit` bytes of plain aligned buffers.
    pub fn aligned(limit: ByteSize) -> PinnedPool {
        PinnedPool::build(limit, None)
    }

    /// A pool of at most `limit` bytes of buffers page-locked for `gpu` (CUDA or simulated;
    /// falls back to aligned buffers, with one warning, if pinning fails).
    pub fn pinned(limit: ByteSize, gpu: Gpu) -> PinnedPool {
        PinnedPool::build(limit, Some(gpu))
    }

    fn build(limit: ByteSize, gpu: Option<Gpu>) -> PinnedPool {
        PinnedPool {
            shared: Arc::new(Shared {
                inner: Mutex::new(Rank::StagingPool, PoolInner::default()),
                limit,
                gpu,
                pin_failed: AtomicBool::new(false),
                reused: AtomicU64::new(0),
                created: AtomicU64::new(0),
                fallbacks: AtomicU64::new(0),
            }),
        }
    }

    /// The pool's limit.
    pub fn limit(&self) -> ByteSize {
        self.shared.limit
    }

    /// Bytes held by the pool.
    pub fn allocated(&self) -> ByteSize {
        ByteSize(self.shared.inner.lock().allocated)
    }

    /// Counters.
    pub fn stats(&self) -> PoolStats {
        PoolStats {
            allocated: self.allocated(),
            created: self.shared.created.load(Ordering::Relaxed),
            reused: self.shared.reused.load(Ordering::Relaxed),
            fallbacks: self.shared.fallbacks.load(Ordering::Relaxed),
            pinned: self.shared.gpu.is_some() && !self.shared.pin_failed.load(Ordering::Relaxed),
        }
    }

    /// A buffer of at least `bytes`, or `None` when the limit does not allow one (copy from
    /// pageable memory then).
    pub fn acquire(&self, bytes: usize) -> Option<StagingBuffer> {
        let class = class_of(bytes);
        let mut inner = self.shared.inner.lock();
        if let Some(mem) = inner.free.get_mut(&class).and_then(Vec::pop) {
            self.shared.reused.fetch_add(1, Ordering::Relaxed);
            return Some(StagingBuffer {
                mem: Some(mem),
                class,
                len: bytes,
                pool: self.clone(),
            });
        }
        // Idle buffers freed to make room: dropped after the lock is released, since freeing a
        // page-locked buffer waits for the copies still reading it (a lane or a report must
        // never wait on a copy for the pool's lock).
        let mut released = Vec::new();
        if inner.allocated + class as u64 > self.shared.limit.bytes() {
            // Make room from idle buffers of other classes before giving up.
            let mut freed = 0u64;
            let classes: Vec<usize> = inner.free.keys().copied().collect();
            for c in classes {
                while inner.allocated - freed + class as u64 > self.shared.limit.bytes() {
                    match inner.free.get_mut(&c).and_then(Vec::pop) {
                        Some(mem) => {
                            freed += c as u64;
                            released.push(mem);
                        }
                        None => break,
                    }
                }
            }
            inner.allocated -= freed;
            if inner.allocated + class as u64 > self.shared.limit.bytes() {
                self.shared.fallbacks.fetch_add(1, Ordering::Relaxed);
                drop(inner);
                drop(released);
                return None;
            }
        }
        inner.allocated += class as u64;
        drop(inner);
        drop(released);
        let mem = self.create(class);
        self.shared.created.fetch_add(1, Ordering::Relaxed);
        Some(StagingBuffer {
            mem: Some(mem),
            class,
            len: bytes,
            pool: self.clone(),
        })
    }

    fn create(&self, class: usize) -> HostMem {
        if let Some(gpu) = &self.shared.gpu {
            if !self.shared.pin_failed.load(Ordering::Relaxed) {
                // Zeroed at creation by the device (F7: never-written memory is never handed out).
                match gpu.alloc_host(class) {
                    Ok(mem) => {
                        return HostMem::Locked(LockedMem {
                            mem: Some(mem),
                            fences: Fences::new(),
                        })
                    }
                    Err(e) => {
                        if !self.shared.pin_failed.swap(true, Ordering::Relaxed) {
                            tracing::warn!(error = %e, "pinning host memory failed; staging from pageable memory");
                            crate::warnings::echo("pinned-staging", || {
                                format!("pinning host memory failed ({e}); staging from pageable memory")
                            });
                        }
                    }
                }
            }
        }
        HostMem::aligned(class)
    }

    /// Frees every idle buffer (called when models are dropped). Returns the bytes released.
    /// The buffers are freed after the pool's lock is released (each waits for the copies still
    /// reading it), so nothing else waits on those copies for the lock.
    pub fn trim(&self) -> ByteSize {
        let mut inner = self.shared.inner.lock();
        let idle: u64 = inner
            .free
            .iter()
            .map(|(c, v)| *c as u64 * v.len() as u64)
            .sum();
        let released = std::mem::take(&mut inner.free);
        inner.allocated -= idle;
        drop(inner);
        drop(released);
        ByteSize(idle)
    }

    fn give_back(&self, class: usize, mem: HostMem) {
        self.shared
            .inner
            .lock()
            .free
            .entry(class)
            .or_default()
            .push(mem);
    }
}

/// A staging buffer borrowed from a [`PinnedPool`]; returns to the pool when dropped.
pub struct StagingBuffer {
    mem: Option<HostMem>,
    class: usize,
    len: usize,
    pool: PinnedPool,
}

impl StagingBuffer {
    /// The requested length.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the requested length is zero.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The buffer's size class.
    pub fn capacity(&self) -> usize {
        self.class
    }
    /// Whether the buffer is page-locked.
    pub fn is_pinned(&self) -> bool {
        self.mem.as_ref().is_some_and(HostMem::is_pinned)
    }
    /// The first `len` bytes, writable. For a pinned buffer this first waits for its last copy.
    pub fn as_mut_bytes(&mut self) -> Option<&mut [u8]> {
        let len = self.len;
        self.mem.as_mut()?.as_mut_bytes().map(|b| &mut b[..len])
    }

    /// Enqueues a copy of the buffer's first `len` bytes into `dst` on `stream` and records it
    /// in the buffer's fences, so the buffer may return to the pool at once: the next writer (or
    /// the free) waits for this copy and every other one still reading it. `dst` must be
    /// exactly `len` bytes.
    ///
    /// Only a page-locked buffer copies asynchronously; for an aligned (pageable) buffer this
    /// returns `Ok(false)` and copies nothing (the caller copies from its own memory instead).
    pub fn copy_to_device(&mut self, dst: &mut DeviceBuffer, stream: &Stream) -> Result<bool> {
        let len = self.len;
        let Some(HostMem::Locked(p)) = self.mem.as_mut() else {
            return Ok(false);
        };
        let Some(mem) = p.mem.as_ref() else {
            return Ok(false);
        };
        let src = &mem.as_slice()?[..len];
        // SAFETY: `src` is page-locked memory owned by this buffer, which is neither written
        // (`as_mut_bytes` waits on the fences) nor freed (`LockedMem::drop` waits on them) before
        // the event recorded below completes.
        unsafe { stream.copy_htod(src, dst) }?;
        p.fences.record(stream)?;
        Ok(true)
    }
}

impl Drop for StagingBuffer {
    fn drop(&mut self) {
        if let Some(mem) = self.mem.take() {
            self.pool.give_back(self.class, mem);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn respects_its_limit_and_falls_back() {
        let pool = PinnedPool::aligned(ByteSize::kib(256));
        let a = pool.acquire(100 * 1024).unwrap(); // 128 KiB class
        let b = pool.acquire(100 * 1024).unwrap();
        assert_eq!(pool.allocated(), ByteSize::kib(256));
        assert!(pool.acquire(1).is_none(), "over the limit");
        assert_eq!(pool.stats().fallbacks, 1);
        drop(a);
        drop(b);
        assert!(pool.allocated() <= pool.limit());
    }

    #[test]
    fn reuses_buffers_by_size_class() {
        let pool = PinnedPool::aligned(ByteSize::mib(4));
        let mut a = pool.acquire(70_000).unwrap();
        assert_eq!(a.capacity(), 128 * 1024);
        a.as_mut_bytes().unwrap().fill(7);
        drop(a);
        let b = pool.acquire(100_000).unwrap();
        assert_eq!(b.capacity(), 128 * 1024);
        let s = pool.stats();
        assert_eq!((s.created, s.reused), (1, 1));
        // A different class is a new buffer.
        let _c = pool.acquire(10).unwrap();
        assert_eq!(pool.stats().created, 2);
    }

    #[test]
    fn idle_buffers_of_other_classes_make_room() {
        let pool = PinnedPool::aligned(ByteSize::kib(256));
        drop(pool.acquire(200 * 1024).unwrap()); // 256 KiB, idle
        let small = pool.acquire(1000);
        assert!(
            small.is_some(),
            "the idle big buffer was released for a small one"
        );
        assert_eq!(pool.allocated(), ByteSize::kib(64));
    }

    #[test]
    fn trim_releases_idle_buffers() {
        let pool = PinnedPool::aligned(ByteSize::mib(1));
        let held = pool.acquire(1000).unwrap();
        drop(pool.acquire(200_000).unwrap());
        assert_eq!(pool.trim(), ByteSize::kib(256));
        assert_eq!(pool.allocated(), ByteSize::kib(64));
        drop(held);
        pool.trim();
        assert_eq!(pool.allocated(), ByteSize::ZERO);
    }

    #[test]
    fn a_staging_buffer_copied_on_two_streams_is_rewritten_only_after_both() {
        // F2: the buffer kept one event, re-recorded by each copy; its next writer waited for the
        // latest copy only and overwrote the buffer under the other.
        use crate::device::{Gpu, SimGpu, SimSpec, Stream};
        use candle_core::{DType, Shape};
        let g = SimGpu::new(0, SimSpec::new(ByteSize::mib(8)));
        let gpu = Gpu::Sim(Arc::clone(&g));
        let pool = PinnedPool::pinned(ByteSize::mib(1), gpu.clone());
        let (a, b) = (gpu.new_stream().unwrap(), gpu.new_stream().unwrap());
        let Stream::Sim(sa) = &a else { unreachable!() };
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        sa.launch(move || {
            let _ = rx.recv();
        });
        let mut buf = pool.acquire(1000).unwrap();
        assert!(buf.is_pinned());
        assert!(
            buf.as_mut_bytes().unwrap().iter().all(|&x| x == 0),
            "F7: zeroed"
        );
        buf.as_mut_bytes().unwrap().fill(1);
        let mut on_a = a.alloc(DType::U8, 1000).unwrap();
        let mut on_b = b.alloc(DType::U8, 1000).unwrap();
        assert!(buf.copy_to_device(&mut on_a, &a).unwrap());
        assert!(buf.copy_to_device(&mut on_b, &b).unwrap());
        b.synchronize().unwrap();
        drop(buf);
        let release = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(30));
            drop(tx);
        });
        let mut again = pool.acquire(1000).unwrap();
        again.as_mut_bytes().unwrap().fill(2); // waits for the copy on `a`
        release.join().unwrap();
        a.synchronize().unwrap();
        g.check().expect("never written under a queued copy");
        let t = on_a.into_tensor(&Shape::from(1000)).unwrap();
        assert_eq!(t.to_vec1::<u8>().unwrap(), vec![1u8; 1000]);
        drop((again, on_b, pool));
        assert!(g.leaks().is_empty(), "{:?}", g.leaks());
    }

    #[test]
    fn freeing_idle_buffers_never_makes_others_wait_on_a_copy_for_the_pool_lock() {
        // `trim` and `acquire` dropped idle page-locked buffers (which wait for their copies)
        // holding the pool's lock: every lane and `memory_report()` then waited on the copy. The
        // lock checker refuses that wait outright; here the timing shows it too.
        use crate::device::{Gpu, SimGpu, SimSpec, Stream};
        use candle_core::DType;
        let g = SimGpu::new(0, SimSpec::new(ByteSize::mib(8)));
        let gpu = Gpu::Sim(Arc::clone(&g));
        let pool = PinnedPool::pinned(ByteSize::mib(1), gpu.clone());
        let a = gpu.new_stream().unwrap();
        let Stream::Sim(sa) = &a else { unreachable!() };
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        sa.launch(move || {
            let _ = rx.recv();
        });
        let mut buf = pool.acquire(1000).unwrap();
        let mut dst = a.alloc(DType::U8, 1000).unwrap();
        assert!(buf.copy_to_device(&mut dst, &a).unwrap());
        drop(buf); // idle, its copy still queued behind the held stream
        std::thread::scope(|s| {
            // The copy completes after a second whatever happens (so a regression fails, not
            // hangs).
            s.spawn(move || {
                std::thread::sleep(std::time::Duration::from_secs(1));
                drop(tx);
            });
            let trimming = s.spawn(|| pool.trim());
            // Give `trim` time to take the lock and start waiting for the copy.
            std::thread::sleep(std::time::Duration::from_millis(20));
            let t0 = std::time::Instant::now();
            let _ = pool.stats();
            let _ = pool.acquire(100);
            let waited = t0.elapsed();
            assert_eq!(trimming.join().unwrap(), ByteSize(MIN_CLASS as u64));
            assert!(
                waited < std::time::Duration::from_millis(500),
                "the pool's lock was held across the copy: {waited:?}"
            );
        });
        a.synchronize().unwrap();
        drop((dst, pool));
        g.check().unwrap();
    }

    #[test]
    fn default_limit_is_a_quarter_of_available_capped() {
        assert_eq!(default_limit(ByteSize::gib(16)), ByteSize::gib(4));
        assert_eq!(default_limit(ByteSize::gib(128)), ByteSize::gib(8));
    }
}
