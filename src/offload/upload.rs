//! Host→device copies of weights: straight from a host copy page-locked in place
//! ([`crate::weights::PinnedWeight`]) where there is one, through a page-locked staging buffer on
//! a lane's stream where the pool has one, from pageable memory otherwise.
//!
//! [`copy_to_device`] is cudarc only and compiles in every build; [`upload`] wraps its result
//! in candle CUDA storage and needs the `cuda` feature.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtrMut, DeviceRepr};

use super::engine::TransferStats;
use super::pinned::PinnedPool;
use crate::error::{Error, Result};
use crate::weights::PinnedWeight;

/// Copies `src` into a new device buffer allocated on `stream`, asynchronously on `stream`.
///
/// With a pool that hands out a page-locked buffer, `src` is copied into it and the device copy
/// runs from there (the buffer returns to the pool at once; its next writer waits for this
/// copy). Otherwise the copy runs from `src` itself: a pageable copy, which the driver stages
/// internally and returns from once `src` has been read, so `src` may be dropped afterwards
/// either way. Work queued later on `stream`, or on a stream that waits on an event recorded
/// after this call, sees the data.
pub fn copy_to_device<T: DeviceRepr>(
    src: &[T],
    stream: &Arc<CudaStream>,
    pool: Option<&PinnedPool>,
) -> Result<CudaSlice<T>> {
    copy_counted(src, stream, pool, None, None)
}

/// [`copy_to_device`], counted in `stats`; when `pinned` covers `src` (a host copy page-locked in
/// place), the copy is a DMA straight from `src`, and `pinned` records its event so that
/// unlocking waits for it.
pub(crate) fn copy_counted<T: DeviceRepr>(
    src: &[T],
    stream: &Arc<CudaStream>,
    pool: Option<&PinnedPool>,
    stats: Option<&TransferStats>,
    pinned: Option<&PinnedWeight>,
) -> Result<CudaSlice<T>> {
    let ordinal = stream.context().ordinal();
    let driver = |what: &'static str| move |e| Error::driver(ordinal, what, e);
    // SAFETY: the allocation is fully overwritten by the copy below before any use; work on
    // other streams is ordered after it by cudarc's slice events or the caller's event.
    let mut dst = unsafe { stream.alloc::<T>(src.len()) }
        .map_err(driver("allocating device memory for a streamed weight"))?;
    let bytes = as_bytes(src);
    if let Some(p) = pinned.filter(|p| p.covers(bytes)) {
        stream
            .context()
            .bind_to_thread()
            .map_err(driver("binding the context for a pinned copy"))?;
        {
            // Orders the copy after earlier uses of `dst` and records its write on drop.
            let (dptr, _record_write) = dst.device_ptr_mut(stream);
            // SAFETY: `bytes` lie inside memory page-locked in place by `p`, which stays locked
            // and allocated until the event recorded below completes (dropping a
            // `PinnedWeight` waits on it before unlocking); `dptr` addresses `dst`, a live
            // allocation of exactly `bytes.len()` bytes.
            unsafe { cudarc::driver::result::memcpy_htod_async(dptr, bytes, stream.cu_stream()) }
                .map_err(driver("copying a pinned weight to the device"))?;
        }
        p.record_copy(stream)
            .map_err(driver("recording a pinned copy's event"))?;
        if let Some(stats) = stats {
            stats
                .direct
                .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        }
        return Ok(dst);
    }
    if let Some(mut buf) = pool.and_then(|p| p.acquire(bytes.len())) {
        if buf.is_pinned() {
            if let Some(staging) = buf.as_mut_bytes() {
                staging.copy_from_slice(bytes);
                if buf.copy_to_device(&mut dst, stream)? {
                    if let Some(stats) = stats {
                        stats
                            .staged
                            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
                    }
                    return Ok(dst);
                }
            }
        }
    }
    stream
        .memcpy_htod(src, &mut dst)
        .map_err(driver("copying a streamed weight to the device"))?;
    Ok(dst)
}

fn as_bytes<T: DeviceRepr>(v: &[T]) -> &[u8] {
    // SAFETY: `DeviceRepr` types are plain data copied to the device byte for byte, so their
    // memory is `size_of_val(v)` initialised bytes; the slice borrows `v`.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// Copies a contiguous CPU tensor to `dev` on `stream` and wraps the result as a candle tensor.
/// On a stream other than the calling thread's own (`dev.cuda_stream()`), the returned event
/// must be waited on by the stream that uses the tensor.
#[cfg(feature = "cuda")]
pub(crate) fn upload(
    host: &candle_core::Tensor,
    dev: &candle_core::CudaDevice,
    stream: &Arc<CudaStream>,
    pool: Option<&PinnedPool>,
    stats: &TransferStats,
    pinned: Option<&PinnedWeight>,
) -> Result<super::engine::Arrived> {
    use candle_core::{CpuStorage, CudaStorage, Storage, Tensor};

    let ordinal = stream.context().ordinal();
    let (storage, layout) = host.storage_and_layout();
    let range = layout.contiguous_offsets();
    let (Storage::Cpu(cpu), Some((start, end))) = (&*storage, range) else {
        drop(storage);
        // Not a contiguous CPU tensor (materialize never returns one): candle's own copy on
        // this thread's stream, then an event on it.
        let t = host
            .to_device(&candle_core::Device::Cuda(dev.clone()))
            .map_err(|e| Error::tensor("copying a streamed weight to the device", e))?;
        let ready = dev
            .cuda_stream()
            .record_event(None)
            .map_err(|e| Error::driver(ordinal, "recording a copy event", e))?;
        return Ok(super::engine::Arrived::on_event(t, ready));
    };
    macro_rules! copy {
        ($v:expr) => {
            CudaStorage::wrap_cuda_slice(
                copy_counted(&$v[start..end], stream, pool, Some(stats), pinned)?,
                dev.clone(),
            )
        };
    }
    let cuda = match cpu {
        CpuStorage::F32(v) => copy!(v),
        CpuStorage::F16(v) => copy!(v),
        CpuStorage::BF16(v) => copy!(v),
        CpuStorage::F64(v) => copy!(v),
        CpuStorage::U8(v) => copy!(v),
        CpuStorage::F8E4M3(v) => copy!(v),
        _ => {
            return Err(Error::UnsupportedDtype {
                what: "a streamed weight copied to the GPU".into(),
                dtype: format!("{:?}", host.dtype()),
            })
        }
    };
    let shape = host.shape().clone();
    drop(storage);
    let t = Tensor::from_storage(
        Storage::Cuda(cuda),
        shape,
        candle_core::op::BackpropOp::none(),
        false,
    );
    let ready = stream
        .record_event(None)
        .map_err(|e| Error::driver(ordinal, "recording a copy event", e))?;
    Ok(super::engine::Arrived::on_event(t, ready))
}
