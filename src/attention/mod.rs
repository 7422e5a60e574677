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
//! | [`Backend::Sdpa`], [`Backend::Flash`] on the CPU: the fused kernel | `w · 4·tq·tk`, `w` = [`fused_plan`] workers ≤ threads, `tq × tk` = [`FUSED_TILE_Q`] × [`FUSED_TILE_K`] | same, in tiles, on every core |
//! | [`Backend::Sdpa`], [`Backend::Flash`] on a GPU | not built: they run as `SubQuadratic` | — |
//!
//! `BH` is batch × heads, `e` the size of the dtype the softmax runs in (4 when upcasting, see
//! [`Upcast`]). [`peak_temporary_bytes`] returns these figures, and the implementation keeps to
//! them: it never holds more than three score-sized blocks alive at once (one score tile per
//! worker in the fused kernel), which the tests check by measuring the blocks it actually
//! creates ([`AttentionStats::peak_temporary`]). Inputs, outputs and the `[BH, rows, D]`
//! accumulators are not counted.
//!
//! The fused kernel (`fused.rs`) walks fixed tiles of queries against tiles of keys with an
//! online softmax; its arithmetic never depends on free memory or threads (free memory only
//! caps how many tiles are alive at once), so its output bits are the same for every budget.
//!
//! # Invariants
//! - Every backend equals `Naive` within 1e-5 (f32) and 2e-3 (f16; bf16 plus one bf16 rounding
//!   step of the output, which alone is 2⁻⁸..2⁻⁷ relative) on the same inputs; masked positions
//!   get zero weight. In f32 the fused kernel is as close to an f64 reference as `Naive` (within
//!   twice its error).
//! - The fused kernel's output bits do not depend on free memory or the thread count.
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
//! | none | a device with a fused kernel (the CPU) | `Sdpa`, at every size and free memory |
//! | none | GPU without one | `SubQuadratic` |
//! | none | CPU without one, scores `BH·Nq·Nk·e` ≤ 64 MiB and ≤ free/4 | `Naive` |
//! | none | CPU without one, larger | `SubQuadratic` |
//!
//! [`fused_kernel_available`] is `true` on the CPU, whose fused kernel is this crate's own
//! (`fused.rs`), and `false` on GPUs: candle-core 0.11 has no fused scaled-dot-product attention
//! (candle's `sdpa` lives in candle-nn, Metal only, which this crate does not depend on), and
//! flash attention needs the `candle-flash-attn` crate, not wired in yet. `Sdpa`/`Flash` handed
//! to [`attention`] run the fused kernel on the CPU (`f64` inputs run as `SubQuadratic`, keeping
//! their precision) and as `SubQuadratic` on a GPU, after one warning.
//!
//! # Memory profile
//! [`Backend::memory_profile`] tells `memory_required` estimators whether attention memory grows
//! quadratically with the token count (`Naive`, `Split`) or not (`SubQuadratic`, `Sdpa`,
//! `Flash`).
//!
//! # Files
//!
//! `mod.rs` the entry points; `options.rs` the call options, layout and upcast policy;
//! `dispatch.rs` the backends, requests and the dispatcher; `plan.rs` the memory plans;
//! `backends.rs` how the backends compute; `fused.rs` the fused CPU kernel, `products.rs` its
//! AVX-512 tile products and `rows.rs` its vectorized row kernels (`exp`, online softmax,
//! masking); `mask.rs` masks.

mod backends;
mod dispatch;
mod fused;
#[cfg(test)]
mod fused_tests;
mod mask;
mod options;
mod plan;
mod products;
mod rows;
mod softmax512;
#[cfg(test)]
mod tests;

use candle_core::Tensor;

use crate::error::{Error, Result, TensorContext};
use crate::size::ByteSize;
use backends::{finite_min, Ctx, Scratch};
use dispatch::{latch, runnable};
use mask::Mask;

pub use dispatch::{
    dispatch, fused_kernel_available, select_backend, Backend, BackendRequest, DeviceKind,
    Dispatch, DispatchInput, Fallback, MemoryProfile, FLASH_BUILT, NAIVE_CPU_SCORE_LIMIT,
};
pub use options::{AttentionOptions, Layout, Upcast};
pub use plan::{
    fused_plan, peak_temporary_bytes, split_slices, subquad_chunks, AttentionShape, FusedPlan,
    FUSED_TILE_K, FUSED_TILE_Q, LIVE_SCORE_BLOCKS, MAX_SPLIT_SLICES,
};

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
    let softmax_bytes = options.upcast.softmax_dtype(q.dtype()).size_in_bytes();
    let backend = runnable(options.backend, DeviceKind::from(device), softmax_bytes);
    if backend != options.backend && latch(format!("run:{:?}", options.backend)) {
        let text = format!(
            "{} is not available in this build; using {} instead",
            options.backend, backend
        );
        tracing::warn!(requested = %options.backend, fallback = %backend, "{text}");
        crate::warnings::echo(&format!("attention-run:{:?}", options.backend), || text);
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
    check_addressable(b, h, nq, nk, d, dv)?;
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
    let mut scratch = Scratch::default();
    let (out, query_chunks, key_chunks) = ctx.run(backend, options.free_memory, &mut scratch)?;
    let out = from_per_head(&out, options.layout)?;
    let stats = AttentionStats {
        backend,
        query_chunks,
        key_chunks,
        peak_temporary: ByteSize(scratch.peak),
    };
    Ok((out, stats))
}

/// Refuses shapes whose element counts, or the byte sizes of the kernels' buffers (the packed
/// keys, the scores of a whole head), do not fit in an address space: candle accepts shapes whose
/// element count wraps, and the kernels' length checks must never pass by wrapping (F3).
fn check_addressable(b: usize, h: usize, nq: usize, nk: usize, d: usize, dv: usize) -> Result<()> {
    let bh = b.checked_mul(h);
    let count = |rows: usize, cols: usize| {
        bh.and_then(|bh| bh.checked_mul(rows))
            .and_then(|n| n.checked_mul(cols))
            .and_then(|n| n.checked_mul(8))
            .filter(|&bytes| bytes <= isize::MAX as usize)
    };
    let panels = nk.div_ceil(products::PANEL).checked_mul(products::PANEL);
    let sizes = [
        count(nq, d),
        count(nk, d),
        count(nk, dv),
        count(nq, dv),
        count(nq, nk),
        panels.and_then(|p| count(p, d)),
    ];
    if sizes.iter().any(Option::is_none) {
        return Err(Error::ShapeMismatch {
            what: format!(
                "attention: batch {b} × heads {h} × queries {nq} / keys {nk} × head size {d} (values {dv}) has more elements than memory can address"
            ),
            expected: Vec::new(),
            got: vec![b, h, nq, nk, d, dv],
        });
    }
    Ok(())
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
