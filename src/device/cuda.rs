//! The CUDA backend of the device interface: thin calls into cudarc. Compiled in every build
//! (cudarc loads the driver at run time); only turning a device buffer into a candle tensor needs
//! the `cuda` feature.

use std::sync::Arc;

use candle_core::{DType, Shape, Tensor};
use cudarc::driver::{sys, CudaContext, CudaSlice, CudaStream, DevicePtrMut, DriverError};

use crate::error::{Error, Result};
use crate::size::ByteSize;

/// A failed driver call on GPU `ordinal` while doing `what`: the driver's out-of-memory becomes
/// [`Error::OutOfMemory`] (retryable), anything else [`Error::Device`].
pub(crate) fn error(ordinal: usize, what: &str, e: DriverError) -> Error {
    oom_or(ordinal, what, e, ByteSize::ZERO)
}

fn oom_or(ordinal: usize, what: &str, e: DriverError, required: ByteSize) -> Error {
    if e.0 == sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY {
        return Error::OutOfMemory {
            model: what.to_string(),
            device: format!("cuda:{ordinal}"),
            required,
            available: ByteSize::ZERO,
        };
    }
    Error::driver(ordinal, what, e)
}

/// The stream inline copies use: candle's per-thread stream with the `cuda` feature (compute
/// runs there, so no event is needed between them), the context's default stream otherwise.
pub(crate) fn default_stream(ctx: &Arc<CudaContext>) -> Result<Arc<CudaStream>> {
    #[cfg(feature = "cuda")]
    {
        let id = crate::vram::DeviceId::Cuda(ctx.ordinal());
        if let candle_core::Device::Cuda(dev) = id.to_candle()? {
            return Ok(dev.cuda_stream());
        }
    }
    Ok(ctx.default_stream())
}

/// `len` zeroed bytes of page-locked, write-combined host memory, portable: page-locked for every
/// context (a staging buffer of the compute device's pool feeds copies to every GPU of a split
/// model; under unified addressing the driver implies it, the flag says so everywhere).
pub(crate) fn alloc_host(
    ctx: &Arc<CudaContext>,
    len: usize,
) -> Result<cudarc::driver::PinnedHostSlice<u8>> {
    let ordinal = ctx.ordinal();
    // SAFETY: the memory is zeroed below before the slice is handed out, so no byte is ever read
    // uninitialised.
    let flags = cudarc::driver::sys::CU_MEMHOSTALLOC_WRITECOMBINED
        | cudarc::driver::sys::CU_MEMHOSTALLOC_PORTABLE;
    let mut mem = unsafe { ctx.alloc_pinned_with_flags::<u8>(len, flags) }.map_err(|e| {
        oom_or(
            ordinal,
            "allocating a staging buffer",
            e,
            ByteSize(len as u64),
        )
    })?;
    mem.as_mut_slice()
        .map_err(|e| error(ordinal, "zeroing a staging buffer", e))?
        .fill(0);
    Ok(mem)
}

/// `cuMemHostRegister` (portable to every context).
///
/// # Safety
/// As [`super::Gpu::register_host`].
pub(crate) unsafe fn register_host(ctx: &Arc<CudaContext>, addr: usize, len: usize) -> Result<()> {
    let ordinal = ctx.ordinal();
    ctx.bind_to_thread()
        .map_err(|e| error(ordinal, "binding the context to pin a weight", e))?;
    // SAFETY: the caller guarantees `addr..addr + len` is live host memory until it is
    // unregistered; the driver only page-locks it.
    unsafe {
        sys::cuMemHostRegister_v2(
            addr as *mut std::ffi::c_void,
            len,
            sys::CU_MEMHOSTREGISTER_PORTABLE,
        )
    }
    .result()
    .map_err(|e| error(ordinal, "page-locking a weight in place", e))
}

/// `cuMemHostUnregister`.
///
/// # Safety
/// As [`super::Gpu::unregister_host`].
pub(crate) unsafe fn unregister_host(ctx: &Arc<CudaContext>, addr: usize) -> Result<()> {
    let ordinal = ctx.ordinal();
    ctx.bind_to_thread()
        .map_err(|e| error(ordinal, "binding the context to unpin a weight", e))?;
    // SAFETY: the caller guarantees `addr` was registered and no copy from it is running.
    unsafe { sys::cuMemHostUnregister(addr as *mut std::ffi::c_void) }
        .result()
        .map_err(|e| error(ordinal, "unlocking a pinned weight", e))
}

/// A device allocation typed as candle stores `dtype`, so it becomes candle CUDA storage as is.
pub enum CudaBuffer {
    /// f32
    F32(CudaSlice<f32>),
    /// f16
    F16(CudaSlice<half::f16>),
    /// bf16
    BF16(CudaSlice<half::bf16>),
    /// f64
    F64(CudaSlice<f64>),
    /// u8
    U8(CudaSlice<u8>),
    /// u32
    U32(CudaSlice<u32>),
    /// fp8 E4M3
    F8E4M3(CudaSlice<float8::F8E4M3>),
}

macro_rules! each {
    ($buf:expr, $s:ident => $body:expr) => {
        match $buf {
            CudaBuffer::F32($s) => $body,
            CudaBuffer::F16($s) => $body,
            CudaBuffer::BF16($s) => $body,
            CudaBuffer::F64($s) => $body,
            CudaBuffer::U8($s) => $body,
            CudaBuffer::U32($s) => $body,
            CudaBuffer::F8E4M3($s) => $body,
        }
    };
}

impl CudaBuffer {
    pub(crate) fn size(&self) -> ByteSize {
        ByteSize(each!(self, s => s.num_bytes()) as u64)
    }

    #[cfg(feature = "cuda")]
    pub(crate) fn into_tensor(self, shape: &Shape) -> Result<Tensor> {
        use candle_core::{CudaStorage, Storage};
        let ordinal = each!(&self, s => s.context().ordinal());
        let candle_core::Device::Cuda(dev) = crate::vram::DeviceId::Cuda(ordinal).to_candle()?
        else {
            return Err(Error::Device {
                device: format!("cuda:{ordinal}"),
                reason: "candle did not give a CUDA device".into(),
            });
        };
        let storage = each!(self, s => CudaStorage::wrap_cuda_slice(s, dev.clone()));
        Ok(Tensor::from_storage(
            Storage::Cuda(storage),
            shape.clone(),
            candle_core::op::BackpropOp::none(),
            false,
        ))
    }

    #[cfg(not(feature = "cuda"))]
    pub(crate) fn into_tensor(self, shape: &Shape) -> Result<Tensor> {
        let _ = shape;
        Err(Error::Device {
            device: format!("cuda:{}", each!(&self, s => s.context().ordinal())),
            reason: "GPU tensors need residency built with `--features cuda`".into(),
        })
    }
}

impl CudaBuffer {
    /// Drops the allocation (cudarc frees it in its stream's order), then runs `f` on that
    /// stream after the free: a host function (`cuLaunchHostFunc`), which makes no CUDA call.
    /// When the launch fails, `f` runs once the stream has been synchronized (or at once, with
    /// an error logged, when that fails too).
    pub(crate) fn free_then(self, f: Box<dyn FnOnce() + Send>) {
        let stream = each!(&self, s => Arc::clone(s.stream()));
        drop(self);
        unsafe extern "C" fn run(data: *mut std::ffi::c_void) {
            // SAFETY: `data` is the `Box<Box<dyn FnOnce() + Send>>` leaked below; the driver
            // calls this exactly once.
            let f = unsafe { Box::from_raw(data.cast::<Box<dyn FnOnce() + Send>>()) };
            f();
        }
        let data = Box::into_raw(Box::new(f));
        // SAFETY: `run` takes ownership of `data` when the launch succeeds; on failure it was
        // not transferred and is reclaimed below.
        let launched =
            unsafe { sys::cuLaunchHostFunc(stream.cu_stream(), Some(run), data.cast()) }.result();
        if let Err(e) = launched {
            // SAFETY: the launch failed, so the driver never took `data`.
            let f = unsafe { Box::from_raw(data) };
            if let Err(sync) = stream.synchronize() {
                tracing::error!(error = %e, sync = %sync, "a freed buffer's release could not be ordered after its free");
            }
            f();
        }
    }
}

/// A device buffer of `len` elements of `dtype`, allocated on `stream`.
pub(crate) fn alloc(stream: &Arc<CudaStream>, dtype: DType, len: usize) -> Result<CudaBuffer> {
    let ordinal = stream.context().ordinal();
    let bytes = ByteSize((len * dtype.size_in_bytes()) as u64);
    let what = "allocating device memory for a weight";
    let e = |e| oom_or(ordinal, what, e, bytes);
    // SAFETY (each arm): the allocation is fully overwritten by the copy the caller enqueues on
    // the same stream before any use; work on other streams is ordered after it by cudarc's
    // slice events or the caller's event.
    Ok(match dtype {
        DType::F32 => CudaBuffer::F32(unsafe { stream.alloc(len) }.map_err(e)?),
        DType::F16 => CudaBuffer::F16(unsafe { stream.alloc(len) }.map_err(e)?),
        DType::BF16 => CudaBuffer::BF16(unsafe { stream.alloc(len) }.map_err(e)?),
        DType::F64 => CudaBuffer::F64(unsafe { stream.alloc(len) }.map_err(e)?),
        DType::U8 => CudaBuffer::U8(unsafe { stream.alloc(len) }.map_err(e)?),
        DType::U32 => CudaBuffer::U32(unsafe { stream.alloc(len) }.map_err(e)?),
        DType::F8E4M3 => CudaBuffer::F8E4M3(unsafe { stream.alloc(len) }.map_err(e)?),
        other => {
            return Err(Error::UnsupportedDtype {
                what: "a weight copied to the GPU".into(),
                dtype: format!("{other:?}"),
            })
        }
    })
}

/// `cuMemcpyHtoDAsync` of `src` into `dst` on `stream`.
///
/// # Safety
/// As [`super::Stream::copy_htod`]; `src.len()` equals `dst`'s size (checked by the caller).
pub(crate) unsafe fn copy_htod(
    stream: &Arc<CudaStream>,
    src: &[u8],
    dst: &mut CudaBuffer,
) -> Result<()> {
    let ordinal = stream.context().ordinal();
    stream
        .context()
        .bind_to_thread()
        .map_err(|e| error(ordinal, "binding the context for a copy", e))?;
    each!(dst, d => {
        // Orders the copy after earlier uses of `d` and records its write on drop.
        let (dptr, _record_write) = d.device_ptr_mut(stream);
        // SAFETY: `dptr` addresses a live allocation of `src.len()` bytes; the caller keeps
        // page-locked `src` alive and unwritten until the copy completes, and pageable `src` is
        // staged by the driver before this returns.
        unsafe { cudarc::driver::result::memcpy_htod_async(dptr, src, stream.cu_stream()) }
            .map_err(|e| error(ordinal, "copying a weight to the device", e))
    })
}

/// A synchronous device→host copy of `src` after the work queued on `stream`.
pub(crate) fn read_back(stream: &Arc<CudaStream>, src: &CudaBuffer) -> Result<Vec<u8>> {
    use cudarc::driver::DevicePtr;
    let ordinal = stream.context().ordinal();
    let mut out = vec![0u8; src.size().bytes() as usize];
    each!(src, s => {
        let (ptr, _record_read) = s.device_ptr(stream);
        stream
            .synchronize()
            .map_err(|e| error(ordinal, "waiting for a stream before reading back", e))?;
        // SAFETY: `ptr` addresses a live allocation of `out.len()` bytes whose writers on
        // `stream` completed (synchronized above); `out` is ours.
        unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut out, ptr) }
            .map_err(|e| error(ordinal, "reading a device buffer back", e))?;
    });
    Ok(out)
}
