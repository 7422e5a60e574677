//! The memory plans of the memory-aware backends: how many query slices [`Backend::Split`] uses
//! ([`split_slices`]), the query and key chunks of [`Backend::SubQuadratic`]
//! ([`subquad_chunks`]), how many tiles the fused CPU kernel keeps alive at once
//! ([`fused_plan`]), and the peak temporary bytes of any backend ([`peak_temporary_bytes`]).
//! Pure functions of the attention sizes, free memory and (for the fused kernel) the thread
//! count.

use super::dispatch::{runnable, DeviceKind};
use super::Backend;
use crate::error::{Error, Result};
use crate::size::ByteSize;

/// Most query slices [`Backend::Split`] uses; needing more is [`Error::AttentionTooLarge`].
pub const MAX_SPLIT_SLICES: usize = 64;

/// Score-sized blocks the planners budget for: the implementation never holds more at once.
pub const LIVE_SCORE_BLOCKS: u64 = 3;

/// Query chunk sizes [`subquad_chunks`] tries, largest first.
const SUBQUAD_QUERY_CHUNKS: [usize; 5] = [4096, 2048, 1024, 512, 256];

/// Query chunk of the sub-quadratic fallback plan (key chunks are then `⌊√Nk⌋`).
const SUBQUAD_FALLBACK_QUERY_CHUNK: usize = 512;

/// Working-set factor of the sub-quadratic query-chunk rule.
const SUBQUAD_FACTOR: u128 = 4;

/// Query rows in one tile of the fused CPU kernel. A constant, so the kernel's arithmetic never
/// depends on free memory (see [`fused_plan`]).
pub const FUSED_TILE_Q: usize = 256;

/// Keys in one tile of the fused CPU kernel; a constant like [`FUSED_TILE_Q`].
pub const FUSED_TILE_K: usize = 256;

/// The schedule of the fused CPU kernel ([`Backend::Sdpa`] on the CPU) for one call.
///
/// The tiles are fixed ([`FUSED_TILE_Q`] × [`FUSED_TILE_K`], clamped to the sequence), so the
/// output bits are the same for every plan: free memory only decides how many tiles are worked
/// on at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FusedPlan {
    /// Query rows per tile.
    pub tile_q: usize,
    /// Keys per tile.
    pub tile_k: usize,
    /// Tasks, one per (batch·head, query tile): `batch_heads · ⌈nq / tile_q⌉`.
    pub tasks: usize,
    /// Tasks run at once, each holding one score tile.
    pub workers: usize,
    /// Bytes of one score tile (`tile_q · tile_k` f32 values).
    pub tile_bytes: ByteSize,
}

impl FusedPlan {
    /// Peak bytes of score tiles alive at once: `workers · tile_bytes`.
    pub fn peak_bytes(&self) -> ByteSize {
        ByteSize(self.tile_bytes.bytes().saturating_mul(self.workers as u64))
    }
}

/// The fused kernel's schedule: `workers = min(threads, tasks, ⌊free / tile_bytes⌋)`, at least
/// one (a single tile is the kernel's floor, whatever the free memory).
pub fn fused_plan(shape: &AttentionShape, free: ByteSize, threads: usize) -> FusedPlan {
    let tile_q = FUSED_TILE_Q.min(shape.nq.max(1));
    let tile_k = FUSED_TILE_K.min(shape.nk.max(1));
    let tasks = shape.batch_heads.saturating_mul(shape.nq.div_ceil(tile_q));
    let tile_bytes = block_bytes(1, tile_q, tile_k, 4);
    let fit = free.bytes() as u128 / tile_bytes.max(1);
    let workers = threads
        .min(tasks)
        .min(usize::try_from(fit).unwrap_or(usize::MAX))
        .max(1);
    FusedPlan {
        tile_q,
        tile_k,
        tasks,
        workers,
        tile_bytes: to_bytesize(tile_bytes),
    }
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
    /// Size of one element of the dtype the softmax runs in
    /// ([`Upcast::softmax_dtype`](super::Upcast::softmax_dtype)).
    pub elem_bytes: usize,
}

/// Bytes of a `[bh, rows, cols]` block of `elem` bytes each, without overflow.
pub(super) fn block_bytes(bh: usize, rows: usize, cols: usize, elem: usize) -> u128 {
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

/// Peak bytes of score/probability temporaries `backend` allocates for `shape` with `free`
/// memory on the CPU: `3 ×` its largest score block for `Naive`, `Split` and `SubQuadratic` (see
/// the module table); for `Sdpa` and `Flash`, which run the fused kernel there, its tiles alive
/// at once ([`fused_plan`] in rayon's current pool). On a GPU `Sdpa` and `Flash` run as
/// `SubQuadratic`, whose figure that backend gives.
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
    let block = match runnable(backend, DeviceKind::Cpu, shape.elem_bytes) {
        Backend::Naive => block_bytes(bh, nq, nk, e),
        Backend::Split => {
            let slices = split_slices(bh, nq, nk, e, free)?;
            block_bytes(bh, nq.div_ceil(slices), nk, e)
        }
        Backend::Sdpa | Backend::Flash => {
            return Ok(fused_plan(shape, free, rayon::current_num_threads()).peak_bytes());
        }
        Backend::SubQuadratic => {
            let (qc, kc) = subquad_chunks(bh, nq, nk, e, free);
            block_bytes(bh, qc.min(nq), kc.min(nk), e)
        }
    };
    Ok(to_bytesize(LIVE_SCORE_BLOCKS as u128 * block))
}
