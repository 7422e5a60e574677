//! The few places residency talks to the CUDA driver about devices it computes on: the context
//! staging buffers and streams are made in, and returning cached device memory.
//!
//! One context per GPU, candle's. With the `cuda` feature, [`cuda_context`] hands out the context
//! of the candle device residency keeps for the ordinal ([`DeviceId::to_candle`]); without it, the
//! device's primary context through cudarc, which is the very context candle would use
//! (`CudaContext::new` retains the primary context). Streams or pinned buffers made from either
//! therefore never live in a second context.
//!
//! Everything here is guarded at run time: without a driver library (or with one cudarc cannot
//! use) the functions answer `None` or do nothing, never panic, so the default build runs on a
//! machine without CUDA.

use std::sync::Arc;

use cudarc::driver::{CudaContext, DriverError};

use super::probe::cuda_driver_present;
use super::state::DeviceId;

/// The CUDA context residency uses for `device`: candle's own with the `cuda` feature, the
/// device's primary context otherwise. `None` for the CPU, without a usable driver, or when the
/// ordinal does not exist.
pub fn cuda_context(device: DeviceId) -> Option<Arc<CudaContext>> {
    let DeviceId::Cuda(ordinal) = device else {
        return None;
    };
    if !cuda_driver_present() {
        return None;
    }
    #[cfg(feature = "cuda")]
    {
        let _ = ordinal; // the candle device table is keyed by it
        match device.to_candle() {
            Ok(candle_core::Device::Cuda(d)) => Some(Arc::clone(d.cuda_stream().context())),
            Ok(_) => None,
            Err(e) => {
                tracing::debug!(error = %e, %device, "no candle CUDA device");
                None
            }
        }
    }
    #[cfg(not(feature = "cuda"))]
    {
        // A driver older than the symbols cudarc expects makes cudarc panic; that is no GPU.
        match std::panic::catch_unwind(|| CudaContext::new(ordinal)) {
            Ok(Ok(ctx)) => Some(ctx),
            _ => None,
        }
    }
}

/// Waits for all work in `ctx` and returns the memory its device's stream-ordered pool caches to
/// the driver (`cuMemPoolTrimTo(pool, 0)`); candle allocates through that pool where the device
/// supports it, and freed tensors stay cached there until trimmed.
pub(crate) fn trim_device_cache(ctx: &CudaContext) -> Result<(), DriverError> {
    // All streams of the context, not only the calling thread's: a lane's copy may still run.
    ctx.synchronize()?;
    if !ctx.has_async_alloc() {
        return Ok(());
    }
    ctx.bind_to_thread()?;
    // SAFETY: `cu_device` comes from cudarc's `device::get` for a live context, which is what
    // `get_mem_pool` requires; the returned pool is the device's current pool, valid for as long
    // as the device is, which is what `trim_to` requires. Trimming only releases memory no
    // allocation holds, so no live tensor is affected.
    unsafe {
        let pool = cudarc::driver::result::device::get_mem_pool(ctx.cu_device())?;
        cudarc::driver::result::mem_pool::trim_to(pool, 0)
    }
}

/// Synchronizes every CUDA device candle computes on for residency and trims their memory pools
/// (the work behind `soft_empty_cache`). Errors are logged, never returned: emptying a cache is
/// advisory.
pub(crate) fn empty_cuda_caches() {
    for ordinal in super::state::candle_cuda_ordinals() {
        let Some(ctx) = cuda_context(DeviceId::Cuda(ordinal)) else {
            continue;
        };
        match trim_device_cache(&ctx) {
            Ok(()) => tracing::debug!(ordinal, "CUDA memory pool trimmed"),
            Err(e) => tracing::warn!(ordinal, error = %e, "emptying the CUDA cache failed"),
        }
    }
}
