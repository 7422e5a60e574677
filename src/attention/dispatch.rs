//! The backends ([`Backend`]), what the user may request ([`BackendRequest`]), and the dispatcher
//! that picks one: [`dispatch`] is a pure function of a [`DispatchInput`], table-tested;
//! [`select_backend`] adds the fallback warning, latched once per process.

use std::fmt;

use candle_core::Device;

use super::plan::{block_bytes, AttentionShape};
use crate::size::ByteSize;

/// Largest full score matrix for which the default on a CPU *without* the fused kernel is
/// [`Backend::Naive`] (it must also be at most a quarter of free memory). The CPU of this build
/// has the fused kernel ([`fused_kernel_available`]), which the dispatcher prefers at every size.
pub const NAIVE_CPU_SCORE_LIMIT: ByteSize = ByteSize::mib(64);

/// Whether this build has flash-attention kernels (no `candle-flash-attn` yet).
pub const FLASH_BUILT: bool = false;

/// How attention is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Backend {
    /// The full score matrix at once: `softmax(Q·Kᵀ·scale)·V`.
    Naive,
    /// Query slices, as many as needed (a power of two, at most
    /// [`MAX_SPLIT_SLICES`](super::MAX_SPLIT_SLICES)) for the score matrix of one slice to fit free
    /// memory.
    Split,
    /// Chunked over queries and keys with a running maximum and sum (online softmax), so memory
    /// does not grow quadratically.
    SubQuadratic,
    /// A fused scaled-dot-product kernel: on the CPU this crate's tiled kernel (query tiles
    /// against key tiles with an online softmax, no score matrix); GPUs have none in this build
    /// and run it as [`Backend::SubQuadratic`].
    Sdpa,
    /// Flash attention (CUDA, behind a feature; not in this build). On the CPU it runs the fused
    /// kernel of [`Backend::Sdpa`], which is flash attention's algorithm.
    Flash,
}

/// How a backend's temporary memory grows with the token count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryProfile {
    /// True when the temporaries grow with `Nq·Nk` (the whole score matrix, or a bounded
    /// fraction of it, is materialized).
    pub quadratic: bool,
}

impl Backend {
    /// Every backend, in declaration order.
    pub const ALL: [Backend; 5] = [
        Backend::Naive,
        Backend::Split,
        Backend::SubQuadratic,
        Backend::Sdpa,
        Backend::Flash,
    ];

    /// How this backend's memory grows; `memory_required` estimators use it.
    pub fn memory_profile(self) -> MemoryProfile {
        MemoryProfile {
            quadratic: matches!(self, Backend::Naive | Backend::Split),
        }
    }

    /// A short name for logs and the startup report.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Naive => "naive (full score matrix)",
            Backend::Split => "split (query slices)",
            Backend::SubQuadratic => "sub-quadratic (memory-efficient)",
            Backend::Sdpa => "sdpa (fused kernel)",
            Backend::Flash => "flash attention",
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A backend asked for by the user (one `--use-*-attention` flag), which may not be available.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BackendRequest {
    /// [`Backend::Naive`] (no flag; for programs and tests).
    Naive,
    /// [`Backend::Split`], `--use-split-cross-attention`.
    Split,
    /// [`Backend::SubQuadratic`], `--use-quad-cross-attention`.
    SubQuadratic,
    /// [`Backend::Sdpa`], `--use-pytorch-cross-attention`.
    Sdpa,
    /// [`Backend::Flash`], `--use-flash-attention`.
    Flash,
    /// SageAttention, `--use-sage-attention`: never built here, always falls back.
    Sage,
}

impl BackendRequest {
    /// The command-line flag that makes this request, if there is one.
    pub fn flag(self) -> Option<&'static str> {
        match self {
            BackendRequest::Naive => None,
            BackendRequest::Split => Some("--use-split-cross-attention"),
            BackendRequest::SubQuadratic => Some("--use-quad-cross-attention"),
            BackendRequest::Sdpa => Some("--use-pytorch-cross-attention"),
            BackendRequest::Flash => Some("--use-flash-attention"),
            BackendRequest::Sage => Some("--use-sage-attention"),
        }
    }
}

impl fmt::Display for BackendRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BackendRequest::Naive => f.write_str("naive attention"),
            BackendRequest::Split => f.write_str("split attention"),
            BackendRequest::SubQuadratic => f.write_str("sub-quadratic attention"),
            BackendRequest::Sdpa => f.write_str("sdpa attention"),
            BackendRequest::Flash => f.write_str("flash attention"),
            BackendRequest::Sage => f.write_str("sage attention"),
        }
    }
}

/// The kind of device attention runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeviceKind {
    /// The host CPU.
    Cpu,
    /// An NVIDIA GPU.
    Cuda,
    /// An Apple GPU.
    Metal,
}

impl DeviceKind {
    /// Whether this is a GPU.
    pub fn is_gpu(self) -> bool {
        !matches!(self, DeviceKind::Cpu)
    }
}

impl From<&Device> for DeviceKind {
    fn from(device: &Device) -> Self {
        match device {
            Device::Cpu => DeviceKind::Cpu,
            Device::Cuda(_) => DeviceKind::Cuda,
            Device::Metal(_) => DeviceKind::Metal,
        }
    }
}

/// Whether a fused attention kernel is reachable on `device`: on the CPU, this crate's own
/// ([`Backend::Sdpa`]); on GPUs none in this build (candle-core 0.11 has none; candle-nn's Metal
/// `sdpa` is not a dependency).
pub fn fused_kernel_available(device: &Device) -> bool {
    DeviceKind::from(device) == DeviceKind::Cpu
}

/// The backend that [`attention`](super::attention) actually runs for `backend` on `device` in
/// this build.
///
/// On the CPU `Sdpa` and `Flash` run the fused kernel (`Sdpa`), except for `f64` softmax
/// (`elem_bytes` 8): the kernel computes in `f32`, so `f64` runs as `SubQuadratic` and keeps its
/// precision. On a GPU no fused kernel is built ([`fused_kernel_available`], [`FLASH_BUILT`]), so
/// they run as `SubQuadratic`, the memory-safe choice.
pub(super) fn runnable(backend: Backend, device: DeviceKind, elem_bytes: usize) -> Backend {
    match (backend, device) {
        (Backend::Sdpa | Backend::Flash, DeviceKind::Cpu) if elem_bytes <= 4 => Backend::Sdpa,
        (Backend::Sdpa | Backend::Flash, _) => Backend::SubQuadratic,
        (other, _) => other,
    }
}

/// Everything the dispatcher decides on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DispatchInput {
    /// The backend the user asked for, if any.
    pub requested: Option<BackendRequest>,
    /// The device attention runs on.
    pub device: DeviceKind,
    /// Whether that device has a fused attention kernel ([`fused_kernel_available`]).
    pub fused_kernel: bool,
    /// Free memory on that device.
    pub free: ByteSize,
    /// The attention sizes.
    pub shape: AttentionShape,
}

/// A request the dispatcher could not honour.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fallback {
    /// What was asked for.
    pub requested: BackendRequest,
    /// Why it is unavailable.
    pub reason: &'static str,
}

/// The dispatcher's decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dispatch {
    /// The backend to run.
    pub backend: Backend,
    /// Set when a requested backend was unavailable and `backend` replaces it.
    pub fallback: Option<Fallback>,
}

/// The backend a request names, or why it is unavailable.
fn requested_backend(
    request: BackendRequest,
    device: DeviceKind,
    fused_kernel: bool,
) -> std::result::Result<Backend, &'static str> {
    match request {
        BackendRequest::Naive => Ok(Backend::Naive),
        BackendRequest::Split => Ok(Backend::Split),
        BackendRequest::SubQuadratic => Ok(Backend::SubQuadratic),
        BackendRequest::Sdpa if fused_kernel => Ok(Backend::Sdpa),
        BackendRequest::Sdpa => Err("no fused attention kernel on this device"),
        BackendRequest::Flash if FLASH_BUILT && device == DeviceKind::Cuda => Ok(Backend::Flash),
        BackendRequest::Flash => Err("flash attention is not built (needs CUDA and flash kernels)"),
        BackendRequest::Sage => Err("sage attention is not built"),
    }
}

/// The default choice when nothing (available) was requested; see the module's table.
fn default_backend(input: &DispatchInput) -> Backend {
    if input.fused_kernel {
        return Backend::Sdpa;
    }
    if input.device.is_gpu() {
        return Backend::SubQuadratic;
    }
    let s = input.shape;
    let scores = block_bytes(s.batch_heads, s.nq, s.nk, s.elem_bytes);
    if scores <= NAIVE_CPU_SCORE_LIMIT.bytes() as u128 && scores <= input.free.bytes() as u128 / 4 {
        Backend::Naive
    } else {
        Backend::SubQuadratic
    }
}

/// Picks the backend for `input` (pure; see the module's dispatcher table). Does not log:
/// [`select_backend`] does.
pub fn dispatch(input: &DispatchInput) -> Dispatch {
    match input.requested {
        None => Dispatch {
            backend: default_backend(input),
            fallback: None,
        },
        Some(request) => match requested_backend(request, input.device, input.fused_kernel) {
            Ok(backend) => Dispatch {
                backend,
                fallback: None,
            },
            Err(reason) => Dispatch {
                backend: default_backend(input),
                fallback: Some(Fallback {
                    requested: request,
                    reason,
                }),
            },
        },
    }
}

/// [`dispatch`], warning once per process per (request, fallback) pair when a request falls back.
pub fn select_backend(input: &DispatchInput) -> Backend {
    let d = dispatch(input);
    if let Some(fb) = d.fallback {
        let key = format!("dispatch:{:?}->{:?}", fb.requested, d.backend);
        if latch(key.clone()) {
            let text = format!(
                "{} requested but {}; using {} instead",
                fb.requested, fb.reason, d.backend
            );
            tracing::warn!(
                requested = %fb.requested,
                flag = fb.requested.flag().unwrap_or(""),
                fallback = %d.backend,
                "{text}"
            );
            crate::warnings::echo(&key, || text);
        }
    }
    tracing::debug!(backend = %d.backend, requested = ?input.requested, fell_back = d.fallback.is_some(),
        "attention");
    d.backend
}

pub(super) use crate::warnings::latch;
