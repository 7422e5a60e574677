//! Host→device copies of weights through the device interface ([`crate::device`]): straight from
//! a host copy page-locked in place ([`crate::weights::PinnedWeight`]) where there is one,
//! through a page-locked staging buffer where the pool has one, from pageable memory otherwise.
//! The same code runs on CUDA and on the simulated GPU. Which of the three a copy took is recorded
//! as the `source` of the enclosing `transfer` span (`residency::trace`): on CUDA, where no span
//! covers a copy's execution, that span says how each weight was copied.

use std::sync::atomic::Ordering;

use candle_core::{DType, Shape, Tensor};

use super::engine::TransferStats;
use super::pinned::PinnedPool;
use crate::device::{DeviceBuffer, Event, Stream};
use crate::error::{Error, Result};
use crate::weights::PinnedWeight;

/// Copies `src` into a new device buffer of `dtype` elements allocated on `stream`,
/// asynchronously on `stream`.
///
/// With a pool that hands out a page-locked buffer, `src` is copied into it and the device copy
/// runs from there (the buffer returns to the pool at once; its next writer waits for this
/// copy). Otherwise the copy runs from `src` itself as a pageable copy, which is staged before
/// this returns, so `src` may be dropped afterwards either way. Work queued later on `stream`,
/// or on a stream that waits on an event recorded after this call, sees the data.
///
/// `T` is plain data without padding ([`bytemuck::NoUninit`]), so its bytes are all initialised.
pub fn copy_to_device<T: bytemuck::NoUninit>(
    src: &[T],
    dtype: DType,
    stream: &Stream,
    pool: Option<&PinnedPool>,
) -> Result<DeviceBuffer> {
    let bytes: &[u8] = bytemuck::cast_slice(src);
    if !bytes.len().is_multiple_of(dtype.size_in_bytes()) {
        return Err(Error::Device {
            device: stream.device().to_string(),
            reason: format!(
                "{} bytes are not a whole number of {dtype:?} elements",
                bytes.len()
            ),
        });
    }
    copy_counted(bytes, dtype, stream, pool, None, None)
}

/// [`copy_to_device`] of bytes, counted in `stats`; when `pinned` covers `src` (a host copy
/// page-locked in place), the copy runs straight from `src` and `pinned` records it so that
/// unlocking waits for it — whatever the device: CUDA registers pins for every context
/// (portable), so a copy to another GPU is a DMA from them too, and must be waited for as well.
fn copy_counted(
    src: &[u8],
    dtype: DType,
    stream: &Stream,
    pool: Option<&PinnedPool>,
    stats: Option<&TransferStats>,
    pinned: Option<&PinnedWeight>,
) -> Result<DeviceBuffer> {
    let mut dst = stream.alloc(dtype, src.len() / dtype.size_in_bytes())?;
    let count = |counter: &std::sync::atomic::AtomicU64| {
        counter.fetch_add(src.len() as u64, Ordering::Relaxed);
    };
    if let Some(p) = pinned.filter(|p| p.covers(src)) {
        // SAFETY: `src` lies in memory page-locked by `p`, which waits on every copy it recorded
        // before unlocking or releasing it; this copy is recorded right below (a failed record
        // waits for the stream first).
        unsafe { stream.copy_htod(src, &mut dst) }?;
        p.record_copy(stream)?;
        tracing::Span::current().record("source", "pinned_in_place");
        if let Some(stats) = stats.filter(|_| p.gpu().id() == stream.device()) {
            count(&stats.direct);
        }
        return Ok(dst);
    }
    if let Some(mut buf) = pool.and_then(|p| p.acquire(src.len())) {
        if buf.is_pinned() {
            if let Some(staging) = buf.as_mut_bytes() {
                staging.copy_from_slice(src);
                if buf.copy_to_device(&mut dst, stream)? {
                    if let Some(stats) = stats {
                        count(&stats.staged);
                    }
                    tracing::Span::current().record("source", "staged");
                    return Ok(dst);
                }
            }
        }
    }
    // SAFETY: not page-locked by anything residency holds for this device (a pinned weight is
    // passed as `pinned`), so the copy is pageable and reads `src` before returning.
    unsafe { stream.copy_htod(src, &mut dst) }?;
    tracing::Span::current().record("source", "pageable");
    if let Some(stats) = stats {
        count(&stats.pageable);
    }
    Ok(dst)
}

/// A weight copied (or being copied) to a device: its buffer, its shape, and the event its copy
/// completes on.
pub(crate) struct Copied {
    pub(crate) buffer: DeviceBuffer,
    pub(crate) shape: Shape,
    pub(crate) ready: Event,
}

impl Copied {
    /// The copied tensor, for compute on `gpu`, once compute waited for its copy.
    pub(crate) fn into_tensor_after_wait(self, gpu: &crate::device::Gpu) -> Result<Tensor> {
        gpu.compute_wait(&self.ready)?;
        self.buffer.into_tensor(&self.shape)
    }
}

/// Copies a CPU tensor to `stream`'s device. The buffer may be used once the returned event
/// completed (compute waits on it: [`crate::device::Gpu::compute_wait`]).
pub(crate) fn upload(
    host: &Tensor,
    stream: &Stream,
    pool: Option<&PinnedPool>,
    stats: &TransferStats,
    pinned: Option<&PinnedWeight>,
) -> Result<Copied> {
    let host = host
        .contiguous()
        .map_err(|e| Error::tensor("making a streamed weight contiguous", e))?;
    let Some((addr, len)) = crate::weights::host_bytes(&host) else {
        return Err(Error::UnsupportedDtype {
            what: "a weight copied to a GPU".into(),
            dtype: format!("{:?} on {:?}", host.dtype(), host.device().location()),
        });
    };
    // SAFETY: `addr..addr + len` are the bytes of `host`'s CPU storage, alive while `host` is
    // (to the end of this function; the copy below either reads them before returning or they are
    // page-locked by `pinned`, which keeps them alive itself).
    let bytes = unsafe { std::slice::from_raw_parts(addr as *const u8, len) };
    let buffer = copy_counted(bytes, host.dtype(), stream, pool, Some(stats), pinned)?;
    let ready = stream.record_event()?;
    Ok(Copied {
        buffer,
        shape: host.shape().clone(),
        ready,
    })
}
