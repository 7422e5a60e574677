//! Attention backends, their memory plans and the dispatcher that picks one.
//!
//! This module owns one entry point, [`attention`], which computes
//! `softmax(Q·Kᵀ·scale + mask)·V` with any of several [`Backend`]s that give the same numbers
//! (within float tolerance) but differ in how much temporary memory they need:
//!
//! | backend | temporaries (score/probability blocks) | time |
//! |---|---|---|
//! | [`Backend::Naive`] | `3 · BH·Nq·Nk·e` | `O(BH·Nq·Nk·D)` |
//! | [`Backend::Split`] | `3 · BH·⌈Nq/s⌉·Nk·e`, `s` = [`split_slices`] ≤ 64 | same |
//! | [`Backend::SubQuadratic`] | `3 · BH·qc·kc·e`, `(qc, kc)` = [`subquad_chunks`] | same, plus one rescale per key chunk |
//! | [`Backend::Sdpa`], [`Backend::Flash`] | not built: they run as `SubQuadratic` | — |
//!
//! `BH` is batch × heads, `e` the size of the dtype the softmax runs in (4 when upcasting, see
//! [`Upcast`]). [`peak_temporary_bytes`] returns these figures, and the implementation keeps to
//! them: it never holds more than three score-sized blocks alive at once, which the tests check
//! by measuring the blocks it actually creates ([`AttentionStats::peak_temporary`]). Inputs,
//! outputs and the `[BH, rows, D]` accumulators are not counted.
//!
//! # Invariants
//! - Every backend equals `Naive` within 1e-5 (f32) and 2e-3 (f16; bf16 plus one bf16 rounding
//!   step of the output, which alone is 2⁻⁸..2⁻⁷ relative) on the same inputs; masked positions
//!   get zero weight.
//! - Score blocks are never rounded down for `·V`: probabilities stay in the softmax dtype and
//!   `V` is cast instead (see [`Upcast`]).
//! - `Split` slices unevenly when `Nq` is not a multiple of the slice count (ComfyUI silently
//!   does not split then); the planner sizes the largest slice, `⌈Nq/s⌉` rows.
//! - A boolean mask fills masked scores with the softmax dtype's most negative *finite* value, so
//!   a fully masked row averages `V` uniformly instead of producing NaN. An additive mask is
//!   added as given; a row whose every score is `-inf` is NaN, as in any softmax.
//!
//! # Dispatcher
//!
//! [`dispatch`] is a pure function of a [`DispatchInput`]; [`select_backend`] calls it and emits
//! the fallback warning, latched once per process per (request, fallback) pair.
//!
//! | requested | device | chosen |
//! |---|---|---|
//! | `Naive`, `Split`, `SubQuadratic` | any | as requested (`Split` may still fail with [`Error::AttentionTooLarge`]) |
//! | `Sdpa` (`--use-pytorch-cross-attention`) | fused kernel present | `Sdpa` |
//! | `Flash` (`--use-flash-attention`) | CUDA, built with flash kernels | `Flash` |
//! | `Sage` (`--use-sage-attention`), or any of the above unavailable | — | the default below, with one warning |
//! | none | GPU with a fused kernel | `Sdpa` |
//! | none | GPU without one | `SubQuadratic` |
//! | none | CPU, scores `BH·Nq·Nk·e` ≤ 64 MiB and ≤ free/4 | `Naive` |
//! | none | CPU, larger | `SubQuadratic` |
//!
//! In this build no fused kernel is reachable: candle-core 0.11 has no fused scaled-dot-product
//! attention (candle's `sdpa` lives in candle-nn, Metal only, which this crate does not depend
//! on), and flash attention needs the `candle-flash-attn` crate, not wired in yet. So
//! [`fused_kernel_available`] is `false` on every device, and `Sdpa`/`Flash` handed to
//! [`attention`] run as `SubQuadratic` after one warning.
//!
//! # Memory profile
//! [`Backend::memory_profile`] tells `memory_required` estimators whether attention memory grows
//! quadratically with the token count (`Naive`, `Split`) or not (`SubQuadratic`, `Sdpa`,
//! `Flash`).

use std::collections::HashSet;
use std::fmt;

use candle_core::{DType, Device, Tensor, D};
use once_cell::sync::Lazy;
use parking_lot::Mutex;

use crate::error::{Error, Result, TensorContext};
use crate::size::ByteSize;

/// Most query slices [`Backend::Split`] uses; needing more is [`Error::AttentionTooLarge`].
pub const MAX_SPLIT_SLICES: usize = 64;

/// Score-sized blocks the planners budget for: the implementation never holds more at once.
pub const LIVE_SCORE_BLOCKS: u64 = 3;

/// Largest full score matrix for which the CPU default is [`Backend::Naive`] (it must also be at
/// most a quarter of free memory).
pub const NAIVE_CPU_SCORE_LIMIT: ByteSize = ByteSize::mib(64);

/// Query chunk sizes [`subquad_chunks`] tries, largest first.
const SUBQUAD_QUERY_CHUNKS: [usize; 5] = [4096, 2048, 1024, 512, 256];

/// Query chunk of the sub-quadratic fallback plan (key chunks are then `⌊√Nk⌋`).
const SUBQUAD_FALLBACK_QUERY_CHUNK: usize = 512;

/// Working-set factor of the sub-quadratic query-chunk rule.
const SUBQUAD_FACTOR: u128 = 4;

/// Whether this build has flash-attention kernels (no `candle-flash-attn` yet).
pub const FLASH_BUILT: bool = false;

/// How attention is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Backend {
    /// The full score matrix at once: `softmax(Q·Kᵀ·scale)·V`.
    Naive,
    /// Query slices, as many as needed (a power of two, at most [`MAX_SPLIT_SLICES`]) for the
    /// score matrix of one slice to fit free memory.
    Split,
    /// Chunked over queries and keys with a running maximum and sum (online softmax), so memory
    /// does not grow quadratically.
    SubQuadratic,
    /// A fused scaled-dot-product kernel from candle, where the device has one.
    Sdpa,
    /// Flash attention (CUDA, behind a feature; not in this build).
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

/// Memory layout of `q`, `k`, `v` and of the output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Layout {
    /// `[B, N, heads·dim]`: heads merged into the channel dimension (the default).
    #[default]
    Merged,
    /// `[B, heads, N, dim]`.
    PerHead,
}

/// Which parts of attention run in f32 for f16/bf16 inputs. f32 inputs are unaffected.
///
/// Default upcasts the softmax because f16 `exp`/sums lose precision and bf16's 8 significant
/// bits make probabilities coarse; the score blocks are then f32, which the planners budget for
/// (they are given the f32 element size). Unlike ComfyUI, probabilities are not rounded back to
/// f16/bf16 before `·V`: rounding them to bf16 alone moved outputs by up to 3e-3.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Upcast {
    /// `Q·Kᵀ` in the input dtype, softmax and `probabilities·V` in f32 (`V` is cast, not the
    /// probabilities), output cast back to the input dtype.
    #[default]
    Default,
    /// `--force-upcast-attention`: `Q` and `K` cast to f32 before `Q·Kᵀ` too, which also avoids
    /// f16 overflow in the scores (the case some SD2.x models need).
    Force,
    /// `--dont-upcast-attention`: everything in the input dtype.
    Never,
}

impl Upcast {
    /// The dtype `Q·Kᵀ` is computed in for inputs of `dtype`.
    pub fn score_dtype(self, dtype: DType) -> DType {
        match self {
            Upcast::Force if is_half(dtype) => DType::F32,
            _ => dtype,
        }
    }

    /// The dtype the softmax runs in for inputs of `dtype`.
    pub fn softmax_dtype(self, dtype: DType) -> DType {
        match self {
            Upcast::Default | Upcast::Force if is_half(dtype) => DType::F32,
            _ => dtype,
        }
    }
}

fn is_half(dtype: DType) -> bool {
    matches!(dtype, DType::F16 | DType::BF16)
}

/// Options for one [`attention`] call.
///
/// Defaults: [`Backend::Naive`], [`Layout::Merged`], [`Upcast::Default`], scale `1/√dim`, free
/// memory unlimited ([`ByteSize::MAX`], so `Split` uses one slice and `SubQuadratic` the largest
/// chunks).
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionOptions {
    /// The backend to run (usually [`select_backend`]'s choice).
    pub backend: Backend,
    /// Layout of the inputs and of the output.
    pub layout: Layout,
    /// Softmax precision policy.
    pub upcast: Upcast,
    /// Score scale; `None` is `1/√dim`.
    pub scale: Option<f64>,
    /// Free memory the memory-aware backends (`Split`, `SubQuadratic`) plan their temporaries in.
    pub free_memory: ByteSize,
}

impl Default for AttentionOptions {
    fn default() -> Self {
        AttentionOptions {
            backend: Backend::Naive,
            layout: Layout::Merged,
            upcast: Upcast::Default,
            scale: None,
            free_memory: ByteSize::MAX,
        }
    }
}

impl AttentionOptions {
    /// Default options with `backend`.
    pub fn new(backend: Backend) -> Self {
        AttentionOptions {
            backend,
            ..Default::default()
        }
    }
    /// Sets the layout.
    pub fn with_layout(mut self, layout: Layout) -> Self {
        self.layout = layout;
        self
    }
    /// Sets the upcast policy.
    pub fn with_upcast(mut self, upcast: Upcast) -> Self {
        self.upcast = upcast;
        self
    }
    /// Overrides the score scale.
    pub fn with_scale(mut self, scale: f64) -> Self {
        self.scale = Some(scale);
        self
    }
    /// Sets the free memory the memory-aware backends plan with.
    pub fn with_free_memory(mut self, free: ByteSize) -> Self {
        self.free_memory = free;
        self
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

/// Whether a fused attention kernel is reachable on `device`: `false` everywhere in this build
/// (candle-core 0.11 has none; candle-nn's Metal `sdpa` is not a dependency).
pub fn fused_kernel_available(device: &Device) -> bool {
    let _ = device;
    false
}

/// The sizes attention's memory depends on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionShape {
    /// Batch × heads.
    pub batch_heads: usize,
    /// Query tokens.
    pub nq: usize,
    /// Key/value tokens.
    pub nk: usize,
    /// Size of one element of the dtype the softmax runs in ([`Upcast::softmax_dtype`]).
    pub elem_bytes: usize,
}

/// Bytes of a `[bh, rows, cols]` block of `elem` bytes each, without overflow.
fn block_bytes(bh: usize, rows: usize, cols: usize, elem: usize) -> u128 {
    bh as u128 * rows as u128 * cols as u128 * elem as u128
}

fn to_bytesize(b: u128) -> ByteSize {
    ByteSize(u64::try_from(b).unwrap_or(u64::MAX))
}

fn split_need(bh: usize, nq: usize, nk: usize, elem: usize, slices: usize) -> u128 {
    LIVE_SCORE_BLOCKS as u128 * block_bytes(bh, nq.div_ceil(slices), nk, elem)
}

/// Number of query slices [`Backend::Split`] uses: the smallest power of two `s` with
/// `3 · batch_heads · ⌈nq/s⌉ · nk · elem_bytes ≤ free` (the largest slice's three score
/// blocks), capped at `nq` (a slice has at least one row).
///
/// # Errors
/// [`Error::AttentionTooLarge`] when more than [`MAX_SPLIT_SLICES`] slices would be needed; it
/// names the largest token count (`Nq = Nk`) that fits.
pub fn split_slices(
    batch_heads: usize,
    nq: usize,
    nk: usize,
    elem_bytes: usize,
    free: ByteSize,
) -> Result<usize> {
    let free_b = free.bytes() as u128;
    let mut slices = 1;
    while slices <= MAX_SPLIT_SLICES {
        if split_need(batch_heads, nq, nk, elem_bytes, slices) <= free_b {
            return Ok(slices.min(nq.max(1)));
        }
        slices *= 2;
    }
    Err(Error::AttentionTooLarge {
        required: to_bytesize(split_need(
            batch_heads,
            nq,
            nk,
            elem_bytes,
            MAX_SPLIT_SLICES,
        )),
        available: free,
        max_tokens: split_max_tokens(batch_heads, elem_bytes, free),
    })
}

/// The largest `n` with `Nq = Nk = n` that [`split_slices`] accepts.
fn split_max_tokens(bh: usize, elem: usize, free: ByteSize) -> usize {
    let fits = |n: usize| split_need(bh, n, n, elem, MAX_SPLIT_SLICES) <= free.bytes() as u128;
    let (mut lo, mut hi) = (0usize, 1usize << 32);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
}

/// Query and key chunk sizes of [`Backend::SubQuadratic`].
///
/// The query chunk is the first `c` of 4096, 2048, 1024, 512, 256 (each clamped to `nq`) with
/// `free / (batch_heads · elem_bytes · c · 4) ≥ nk`; the key chunk is then all of `nk`. If none
/// fits: query chunks of 512 and key chunks of `⌊√nk⌋`. Both are clamped to `[1, nq]`/`[1, nk]`.
pub fn subquad_chunks(
    batch_heads: usize,
    nq: usize,
    nk: usize,
    elem_bytes: usize,
    free: ByteSize,
) -> (usize, usize) {
    let (nq1, nk1) = (nq.max(1), nk.max(1));
    for chunk in SUBQUAD_QUERY_CHUNKS {
        let chunk = chunk.min(nq1);
        if SUBQUAD_FACTOR * block_bytes(batch_heads, chunk, nk, elem_bytes) <= free.bytes() as u128
        {
            return (chunk, nk1);
        }
    }
    (
        SUBQUAD_FALLBACK_QUERY_CHUNK.min(nq1),
        nk.isqrt().clamp(1, nk1),
    )
}

/// The backend that [`attention`] actually runs for `backend` on `device` in this build.
///
/// No fused kernel is built ([`fused_kernel_available`], [`FLASH_BUILT`]), so `Sdpa` and `Flash`
/// run as `SubQuadratic`, the memory-safe choice.
fn runnable(backend: Backend) -> Backend {
    match backend {
        Backend::Sdpa | Backend::Flash => Backend::SubQuadratic,
        other => other,
    }
}

/// Peak bytes of score/probability temporaries `backend` allocates for `shape` with `free`
/// memory: `3 ×` its largest score block (see the module table). Backends not built here
/// (`Sdpa`, `Flash`) report the `SubQuadratic` figure they run as.
///
/// # Errors
/// As [`split_slices`] for `Split`.
pub fn peak_temporary_bytes(
    backend: Backend,
    shape: &AttentionShape,
    free: ByteSize,
) -> Result<ByteSize> {
    let AttentionShape {
        batch_heads: bh,
        nq,
        nk,
        elem_bytes: e,
    } = *shape;
    let block = match runnable(backend) {
        Backend::Naive => block_bytes(bh, nq, nk, e),
        Backend::Split => {
            let slices = split_slices(bh, nq, nk, e, free)?;
            block_bytes(bh, nq.div_ceil(slices), nk, e)
        }
        _ => {
            let (qc, kc) = subquad_chunks(bh, nq, nk, e, free);
            block_bytes(bh, qc.min(nq), kc.min(nk), e)
        }
    };
    Ok(to_bytesize(LIVE_SCORE_BLOCKS as u128 * block))
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
    if input.device.is_gpu() {
        return if input.fused_kernel {
            Backend::Sdpa
        } else {
            Backend::SubQuadratic
        };
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
        if latch(key) {
            tracing::warn!(
                requested = %fb.requested,
                flag = fb.requested.flag().unwrap_or(""),
                fallback = %d.backend,
                "{} requested but {}; using {} instead",
                fb.requested,
                fb.reason,
                d.backend
            );
        }
    }
    d.backend
}

static WARNED: Lazy<Mutex<HashSet<String>>> = Lazy::new(|| Mutex::new(HashSet::new()));

/// True the first time `key` is seen in this process.
fn latch(key: String) -> bool {
    WARNED.lock().insert(key)
}

/// What an [`attention_with_stats`] call did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionStats {
    /// The backend that ran (after falling back from an unavailable one).
    pub backend: Backend,
    /// Query chunks (slices for `Split`, 1 for `Naive`).
    pub query_chunks: usize,
    /// Key chunks per query chunk.
    pub key_chunks: usize,
    /// Largest sum of score/probability blocks alive at once, measured on the tensors created.
    pub peak_temporary: ByteSize,
}

/// Attention: `softmax(Q·Kᵀ·scale + mask)·V` with `options.backend`.
///
/// `q` is `[B, Nq, heads·dim]` and `k`, `v` are `[B, Nk, heads·dim]` ([`Layout::Merged`]), or
/// `[B, heads, N, dim]` ([`Layout::PerHead`]); `v` may have its own `dim`. The output has `q`'s
/// layout and `v`'s dtype and `dim`.
///
/// `mask`, broadcastable to `[B, heads, Nq, Nk]` by the usual rules (missing leading dims are 1,
/// so `[Nq, Nk]` and `[B, 1, 1, Nk]` key-padding masks work; a 3-d mask is `[heads, Nq, Nk]`),
/// is either boolean (`U8`: 1 attends, 0 masks) or additive (a float dtype, added to the scores).
///
/// # Errors
/// [`Error::ShapeMismatch`] for inconsistent shapes, [`Error::UnsupportedDtype`] for non-float
/// inputs or an integer mask other than `U8`, [`Error::AttentionTooLarge`] when `Split` cannot fit
/// `options.free_memory`, [`Error::Tensor`] when a candle operation fails.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    heads: usize,
    mask: Option<&Tensor>,
    options: &AttentionOptions,
) -> Result<Tensor> {
    attention_with_stats(q, k, v, heads, mask, options).map(|(out, _)| out)
}

/// [`attention`], also returning what ran and the temporaries it measured.
///
/// # Errors
/// As [`attention`].
pub fn attention_with_stats(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    heads: usize,
    mask: Option<&Tensor>,
    options: &AttentionOptions,
) -> Result<(Tensor, AttentionStats)> {
    let device = q.device();
    let backend = runnable(options.backend);
    if backend != options.backend && latch(format!("run:{:?}", options.backend)) {
        tracing::warn!(
            requested = %options.backend,
            fallback = %backend,
            "{} is not available in this build; using {} instead",
            options.backend,
            backend
        );
    }

    for (t, what) in [(q, "q"), (k, "k"), (v, "v")] {
        if !t.dtype().is_float() {
            return Err(Error::UnsupportedDtype {
                dtype: format!("{:?}", t.dtype()),
                what: format!("attention {what}"),
            });
        }
    }
    let q4 = to_per_head(q, heads, options.layout, "attention q")?;
    let k4 = to_per_head(k, heads, options.layout, "attention k")?;
    let v4 = to_per_head(v, heads, options.layout, "attention v")?;
    let (b, h, nq, d) = q4.dims4()?;
    let (_, _, nk, _) = k4.dims4()?;
    let (_, _, _, dv) = v4.dims4()?;
    check_shape("attention k", &[b, h, nk, d], k4.dims())?;
    check_shape("attention v", &[b, h, nk, dv], v4.dims())?;
    let mask = mask.map(|m| Mask::new(m, [b, h, nq, nk])).transpose()?;

    if nq == 0 || nk == 0 {
        // Nothing to attend with or to: zeros, not 0/0.
        let out = Tensor::zeros((b, h, nq, dv), v.dtype(), device)?;
        let stats = AttentionStats {
            backend,
            query_chunks: 0,
            key_chunks: 0,
            peak_temporary: ByteSize::ZERO,
        };
        return Ok((from_per_head(&out, options.layout)?, stats));
    }
    let in_dtype = q.dtype();
    let score_dtype = options.upcast.score_dtype(in_dtype);
    let softmax_dtype = options.upcast.softmax_dtype(in_dtype);
    let floor = finite_min(softmax_dtype);
    let scale = options.scale.unwrap_or(1.0 / (d.max(1) as f64).sqrt());
    let ctx = Ctx {
        qs: q4
            .to_dtype(score_dtype)?
            .affine(scale, 0.0)
            .ctx(|| "attention: scaling q".into())?,
        k: k4.to_dtype(score_dtype)?.contiguous()?,
        v: v4.to_dtype(softmax_dtype)?,
        out_dtype: v.dtype(),
        mask,
        softmax_dtype,
        fill: Tensor::new(floor, device)?.to_dtype(softmax_dtype)?,
        floor,
    };
    let bh = b * h;
    let elem = softmax_dtype.size_in_bytes();
    let mut scratch = Scratch::default();
    let (out, query_chunks, key_chunks) = match backend {
        Backend::Naive => (ctx.rows(0, nq, &mut scratch)?, 1, 1),
        Backend::Split => {
            let slices = split_slices(bh, nq, nk, elem, options.free_memory)?;
            let mut outs = Vec::with_capacity(slices);
            for (start, len) in even_ranges(nq, slices) {
                outs.push(ctx.rows(start, len, &mut scratch)?);
            }
            (cat_rows(&outs)?, slices, 1)
        }
        _ => {
            let (qc, kc) = subquad_chunks(bh, nq, nk, elem, options.free_memory);
            let mut outs = Vec::with_capacity(nq.div_ceil(qc));
            for (start, len) in chunk_ranges(nq, qc) {
                outs.push(ctx.online(start, len, kc, &mut scratch)?);
            }
            (cat_rows(&outs)?, nq.div_ceil(qc), nk.div_ceil(kc))
        }
    };
    let out = from_per_head(&out, options.layout)?;
    let stats = AttentionStats {
        backend,
        query_chunks,
        key_chunks,
        peak_temporary: ByteSize(scratch.peak),
    };
    Ok((out, stats))
}

fn check_shape(what: &str, expected: &[usize], got: &[usize]) -> Result<()> {
    if expected == got {
        Ok(())
    } else {
        Err(Error::ShapeMismatch {
            what: what.into(),
            expected: expected.to_vec(),
            got: got.to_vec(),
        })
    }
}

/// `[B, heads, N, dim]`, contiguous.
fn to_per_head(t: &Tensor, heads: usize, layout: Layout, what: &str) -> Result<Tensor> {
    let dims = t.dims().to_vec();
    let bad = |expected: Vec<usize>| Error::ShapeMismatch {
        what: what.into(),
        expected,
        got: dims.clone(),
    };
    match layout {
        Layout::Merged => {
            let &[b, n, c] = dims.as_slice() else {
                return Err(bad(vec![0, 0, heads]));
            };
            if heads == 0 || c % heads != 0 {
                return Err(bad(vec![b, n, heads * (c / heads.max(1)).max(1)]));
            }
            Ok(t.reshape((b, n, heads, c / heads))?
                .transpose(1, 2)?
                .contiguous()?)
        }
        Layout::PerHead => match *dims.as_slice() {
            [_, h, _, _] if h == heads && heads > 0 => Ok(t.contiguous()?),
            [b, _, n, d] => Err(bad(vec![b, heads, n, d])),
            _ => Err(bad(vec![0, heads, 0, 0])),
        },
    }
}

fn from_per_head(t: &Tensor, layout: Layout) -> Result<Tensor> {
    match layout {
        Layout::PerHead => Ok(t.clone()),
        Layout::Merged => {
            let (b, h, n, d) = t.dims4()?;
            Ok(t.transpose(1, 2)?.reshape((b, n, h * d))?)
        }
    }
}

/// `parts` ranges covering `0..n`, the first `n % parts` one row longer.
fn even_ranges(n: usize, parts: usize) -> impl Iterator<Item = (usize, usize)> {
    let parts = parts.clamp(1, n.max(1));
    let (base, extra) = (n / parts, n % parts);
    (0..parts).scan(0, move |start, i| {
        let len = base + usize::from(i < extra);
        let r = (*start, len);
        *start += len;
        Some(r)
    })
}

/// Ranges of `chunk` rows covering `0..n` (the last one shorter).
fn chunk_ranges(n: usize, chunk: usize) -> impl Iterator<Item = (usize, usize)> {
    let chunk = chunk.max(1);
    (0..n).step_by(chunk).map(move |s| (s, chunk.min(n - s)))
}

fn cat_rows(parts: &[Tensor]) -> Result<Tensor> {
    if parts.len() == 1 {
        return Ok(parts[0].clone());
    }
    Tensor::cat(parts, 2).ctx(|| "attention: joining query chunks".into())
}

/// The most negative finite value of `dtype`.
fn finite_min(dtype: DType) -> f64 {
    match dtype {
        DType::F16 => half::f16::MIN.to_f64(),
        DType::BF16 => half::bf16::MIN.to_f64(),
        DType::F64 => f64::MIN,
        _ => f32::MIN as f64,
    }
}

/// A mask, as a 4-d tensor broadcastable to `[B, H, Nq, Nk]`.
enum Mask {
    /// `U8`: 1 attends, 0 masks.
    Bool(Tensor),
    /// Float, added to the scores.
    Additive(Tensor),
}

impl Mask {
    fn new(m: &Tensor, target: [usize; 4]) -> Result<Self> {
        let dims = m.dims();
        let mismatch = || Error::ShapeMismatch {
            what: "attention mask (must broadcast to [B, heads, Nq, Nk])".into(),
            expected: target.to_vec(),
            got: dims.to_vec(),
        };
        if dims.len() > 4 {
            return Err(mismatch());
        }
        let mut shape = [1usize; 4];
        shape[4 - dims.len()..].copy_from_slice(dims);
        if shape.iter().zip(target).any(|(&s, t)| s != 1 && s != t) {
            return Err(mismatch());
        }
        let m4 = m.reshape(shape.to_vec())?;
        match m.dtype() {
            DType::U8 => Ok(Mask::Bool(m4)),
            dt if dt.is_float() => Ok(Mask::Additive(m4)),
            dt => Err(Error::UnsupportedDtype {
                dtype: format!("{dt:?}"),
                what: "attention mask (use U8 for boolean or a float dtype for additive)".into(),
            }),
        }
    }

    /// The part of the mask for query rows `q0..q0+qn` and keys `k0..k0+kn` (a view).
    fn chunk(t: &Tensor, q0: usize, qn: usize, k0: usize, kn: usize) -> Result<Tensor> {
        let t = if t.dim(2)? != 1 {
            t.narrow(2, q0, qn)?
        } else {
            t.clone()
        };
        Ok(if t.dim(3)? != 1 {
            t.narrow(3, k0, kn)?
        } else {
            t
        })
    }
}

/// Tracks the largest sum of score-sized blocks alive at once.
#[derive(Default)]
struct Scratch {
    peak: u64,
}

impl Scratch {
    /// Records that `blocks` are alive together.
    fn live(&mut self, blocks: &[&Tensor]) {
        let bytes: u64 = blocks
            .iter()
            .map(|t| (t.elem_count() * t.dtype().size_in_bytes()) as u64)
            .sum();
        self.peak = self.peak.max(bytes);
    }
}

/// Prepared inputs shared by every chunk.
struct Ctx {
    /// `[B, H, Nq, D]`, scaled, in the score dtype.
    qs: Tensor,
    /// `[B, H, Nk, D]`, in the score dtype.
    k: Tensor,
    /// `[B, H, Nk, Dv]` in the softmax dtype: probabilities are never rounded down for `·V`;
    /// `V` (`O(Nk·Dv)`, not a score block) is cast instead.
    v: Tensor,
    /// The output dtype (`V`'s).
    out_dtype: DType,
    mask: Option<Mask>,
    softmax_dtype: DType,
    /// Scalar fill for boolean-masked scores: the softmax dtype's most negative finite value.
    fill: Tensor,
    /// The same value as a number.
    floor: f64,
}

impl Ctx {
    /// Scaled, masked scores `[B, H, qn, kn]` in the softmax dtype. At most three blocks alive.
    fn scores(
        &self,
        q0: usize,
        qn: usize,
        k0: usize,
        kn: usize,
        scratch: &mut Scratch,
    ) -> Result<Tensor> {
        let q = self.qs.narrow(2, q0, qn)?.contiguous()?;
        let k = self.k.narrow(2, k0, kn)?;
        let raw = q.matmul(&k.t()?).ctx(|| "attention: Q·Kᵀ".into())?;
        scratch.live(&[&raw]);
        let s = if raw.dtype() != self.softmax_dtype {
            let s = raw.to_dtype(self.softmax_dtype)?;
            scratch.live(&[&raw, &s]);
            s
        } else {
            raw
        };
        Ok(match &self.mask {
            None => s,
            Some(Mask::Bool(m)) => {
                let m = Mask::chunk(m, q0, qn, k0, kn)?.broadcast_as(s.shape())?;
                let fill = self.fill.broadcast_as(s.shape())?;
                let out = m.where_cond(&s, &fill)?;
                scratch.live(&[&s, &out]);
                out
            }
            Some(Mask::Additive(m)) => {
                let m = Mask::chunk(m, q0, qn, k0, kn)?;
                // A view of the caller's mask costs nothing; a cast chunk is a new block.
                let cast = m.dtype() != self.softmax_dtype;
                let m = if cast {
                    m.to_dtype(self.softmax_dtype)?
                } else {
                    m
                };
                let out = s.broadcast_add(&m)?;
                if cast {
                    scratch.live(&[&s, &m, &out]);
                } else {
                    scratch.live(&[&s, &out]);
                }
                out
            }
        })
    }

    /// Query rows `q0..q0+qn` against every key with a plain softmax: `[B, H, qn, Dv]`.
    fn rows(&self, q0: usize, qn: usize, scratch: &mut Scratch) -> Result<Tensor> {
        let nk = self.k.dim(2)?;
        let s = self.scores(q0, qn, 0, nk, scratch)?;
        let max = s.max_keepdim(D::Minus1)?;
        let t = s.broadcast_sub(&max)?;
        scratch.live(&[&s, &t]);
        drop(s);
        let e = t.exp()?;
        scratch.live(&[&t, &e]);
        drop(t);
        let sum = e.sum_keepdim(D::Minus1)?;
        let p = e.broadcast_div(&sum)?;
        scratch.live(&[&e, &p]);
        drop(e);
        let out = p
            .matmul(&self.v)
            .ctx(|| "attention: probabilities·V".into())?;
        Ok(out.to_dtype(self.out_dtype)?)
    }

    /// Query rows `q0..q0+qn` against key chunks of `kc` with a running maximum and sum.
    fn online(&self, q0: usize, qn: usize, kc: usize, scratch: &mut Scratch) -> Result<Tensor> {
        let nk = self.k.dim(2)?;
        // (running max, running sum, running Σ p·v), all in the softmax dtype.
        let mut state: Option<(Tensor, Tensor, Tensor)> = None;
        for (k0, kn) in chunk_ranges(nk, kc) {
            let s = self.scores(q0, qn, k0, kn, scratch)?;
            let chunk_max = s.max_keepdim(D::Minus1)?;
            // The floor keeps an all `-inf` chunk from producing `-inf - -inf = NaN`.
            let m_new = match &state {
                None => chunk_max.maximum(self.floor)?,
                Some((m, _, _)) => m.maximum(&chunk_max)?,
            };
            let t = s.broadcast_sub(&m_new)?;
            scratch.live(&[&s, &t]);
            drop(s);
            let p = t.exp()?;
            scratch.live(&[&t, &p]);
            drop(t);
            let p_sum = p.sum_keepdim(D::Minus1)?;
            let v = self.v.narrow(2, k0, kn)?.contiguous()?;
            let pv = p
                .matmul(&v)
                .ctx(|| "attention: probabilities·V chunk".into())?;
            drop(p);
            state = Some(match state {
                None => (m_new, p_sum, pv),
                Some((m, l, acc)) => {
                    let alpha = (m - &m_new)?.exp()?;
                    let l = ((l * &alpha)? + p_sum)?;
                    let acc = (acc.broadcast_mul(&alpha)? + pv)?;
                    (m_new, l, acc)
                }
            });
        }
        let (_, l, acc) = state.ok_or_else(|| {
            Error::tensor(
                "attention: sub-quadratic chunking",
                candle_core::Error::Msg("no key chunk".into()),
            )
        })?;
        Ok(acc.broadcast_div(&l)?.to_dtype(self.out_dtype)?)
    }
}

#[cfg(test)]
mod tests;
