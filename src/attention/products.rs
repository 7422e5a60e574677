//! The fused kernel's two tile products on AVX-512, with no per-tile packing: `S = Q·Kᵀ` against
//! keys packed once per call ([`pack_keys`]), and `O ← alpha·O + P·V` reading `V` as it lies.
//!
//! # Why not `gemm` here
//!
//! `gemm` packs an operand on every call: the key tile for `Q·Kᵀ` and the value tile for `P·V`,
//! the same tiles again for each of a head's query tiles (about a tenth of the kernel's time at
//! N = 4096). Here the keys are transposed once per call into panels of [`PANEL`] keys, and `V`
//! needs no packing at all: its rows are already the 16-wide vectors the product wants.
//!
//! # The blocks
//!
//! Both products keep a block of up to 6 query rows × 64 columns in 24 of the 32 vector registers
//! and stream the shared operand through the other ones:
//!
//! - scores: for each depth `p`, four vectors of the key panel (64 keys' `p`-th values) times
//!   each row's `q[p]`, broadcast; the block is then stored as 6 rows of 64 scores;
//! - values: for each key `j`, four vectors of `V`'s row `j` times each row's probability `P[j]`,
//!   broadcast, added into the output rows (loaded and scaled by `alpha` first).
//!
//! # Determinism
//!
//! Every output element is one chain of fused multiply-adds in a fixed order (over the depth, or
//! over the keys in order), whatever the block a row lands in, the thread or the schedule: the
//! bits depend only on the inputs and the tile boundaries, which are constants.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::{
    _mm512_fmadd_ps, _mm512_loadu_ps, _mm512_mask_storeu_ps, _mm512_maskz_loadu_ps, _mm512_mul_ps,
    _mm512_set1_ps, _mm512_setzero_ps, _mm512_storeu_ps,
};

/// Keys per packed panel: four vectors of 16.
pub(super) const PANEL: usize = 64;

/// Lanes of one AVX-512 vector of `f32`.
#[cfg(target_arch = "x86_64")]
const W: usize = 16;

/// Query rows a block holds in registers: 6 rows × 4 vectors = 24 accumulators.
#[cfg(target_arch = "x86_64")]
const ROWS: usize = 6;

/// Proof that the CPU runs AVX-512F: only [`Avx512::detect`] makes one, so the products that
/// take it are safe to call.
#[derive(Debug, Clone, Copy)]
pub(super) struct Avx512(());

impl Avx512 {
    /// `Some` on a CPU with AVX-512F (and not when the tests force the portable path).
    pub(super) fn detect() -> Option<Avx512> {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") && !portable_forced() {
            return Some(Avx512(()));
        }
        None
    }
}

#[cfg(test)]
thread_local! {
    /// Set by tests to run the `gemm` path on an AVX-512 CPU.
    pub(super) static FORCE_PORTABLE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

fn portable_forced() -> bool {
    #[cfg(test)]
    {
        FORCE_PORTABLE.with(|f| f.get())
    }
    #[cfg(not(test))]
    {
        false
    }
}

/// Length of the packed copy of `nk` keys of `d` values: whole panels, zero-padded.
/// Saturates at `usize::MAX` (shapes that large are refused at [`super::attention`]'s entry), so
/// a length check against it can never pass by wrapping.
pub(super) fn packed_len(nk: usize, d: usize) -> usize {
    nk.div_ceil(PANEL).saturating_mul(PANEL).saturating_mul(d)
}

/// Packs one head's keys (`[nk, d]`, row-major) into `out` ([`packed_len`] values) as panels of
/// [`PANEL`] keys, each `[d][PANEL]`: the `p`-th values of 64 consecutive keys side by side. Keys
/// past `nk` are zero.
pub(super) fn pack_keys(keys: &[f32], d: usize, out: &mut [f32]) {
    if d == 0 {
        return;
    }
    let nk = keys.len() / d;
    for (panel, dst) in out.chunks_exact_mut(PANEL * d).enumerate() {
        let first = panel * PANEL;
        let width = nk.saturating_sub(first).min(PANEL);
        dst.fill(0.0);
        for (j, key) in keys[first * d..][..width * d].chunks_exact(d).enumerate() {
            for (p, &x) in key.iter().enumerate() {
                dst[p * PANEL + j] = x;
            }
        }
    }
}

/// The lane masks of a block `width` columns wide (at most 64): one per vector.
#[cfg(target_arch = "x86_64")]
fn lane_masks(width: usize) -> [u16; 4] {
    std::array::from_fn(|z| {
        let lanes = width.saturating_sub(z * W).min(W);
        ((1u32 << lanes) - 1) as u16
    })
}

impl Avx512 {
    /// `scores[i][j] = Σ_p q[i][p] · key_j[p]` (in depth order) for the `rows = scores.len() /
    /// cols` query rows of `q` (`rows · d` values) against the `cols` keys held by `panels`
    /// (packed by [`pack_keys`], starting at a panel boundary).
    ///
    /// # Panics
    /// When the slices are shorter than the sizes say.
    pub(super) fn scores(
        self,
        q: &[f32],
        d: usize,
        panels: &[f32],
        cols: usize,
        scores: &mut [f32],
    ) {
        let rows = scores.len() / cols.max(1);
        assert!(q.len() >= rows.saturating_mul(d) && panels.len() >= packed_len(cols, d));
        assert_eq!(scores.len(), rows * cols);
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `self` proves AVX-512F; the lengths were just checked.
        unsafe {
            scores_avx512(q, d, panels, cols, scores)
        };
    }

    /// `acc[i] ← alpha[i] · acc[i] + Σ_j p[i][j] · v[j]` (or without the first term when
    /// `first`), for the `rows = acc.len() / dv` rows of `acc` (`dv` each), `cols` probabilities
    /// per row of `p` and `cols` rows of `v` (`dv` each). The sum runs over `j` in order,
    /// starting from the scaled old value.
    ///
    /// # Panics
    /// When the slices are shorter than the sizes say.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn accumulate(
        self,
        p: &[f32],
        cols: usize,
        v: &[f32],
        dv: usize,
        alpha: &[f32],
        first: bool,
        acc: &mut [f32],
    ) {
        let rows = acc.len() / dv.max(1);
        assert!(
            p.len() >= rows.saturating_mul(cols)
                && v.len() >= cols.saturating_mul(dv)
                && alpha.len() >= rows
        );
        assert_eq!(acc.len(), rows.saturating_mul(dv));
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `self` proves AVX-512F; the lengths were just checked.
        unsafe {
            accumulate_avx512(p, cols, v, dv, alpha, first, acc)
        };
    }
}

/// [`Avx512::scores`]: panel by panel (a 16 KiB panel stays in L1 while every row block uses
/// it), blocks of [`ROWS`] rows, then the remaining rows.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn scores_avx512(q: &[f32], d: usize, panels: &[f32], cols: usize, scores: &mut [f32]) {
    let rows = scores.len() / cols.max(1);
    for first in (0..cols).step_by(PANEL) {
        let masks = lane_masks((cols - first).min(PANEL));
        let panel = panels[first * d..][..PANEL * d].as_ptr();
        let mut r = 0;
        while r < rows {
            let n = (rows - r).min(ROWS);
            let q = q[r * d..][..n * d].as_ptr();
            // Row `r`, column `first`; the block writes `n` rows of up to 64 columns from here,
            // all inside `scores`.
            let out = scores[r * cols + first..].as_mut_ptr();
            // SAFETY: `q` has `n` rows of `d` values; `panel` has `d · PANEL` values; the block
            // stores only the lanes `masks` select, in `n` rows of stride `cols` starting at
            // `out`, which lie inside `scores` (columns `first..first + width` of rows
            // `r..r + n`).
            unsafe {
                match n {
                    6 => score_block::<6>(q, d, panel, out, cols, masks),
                    5 => score_block::<5>(q, d, panel, out, cols, masks),
                    4 => score_block::<4>(q, d, panel, out, cols, masks),
                    3 => score_block::<3>(q, d, panel, out, cols, masks),
                    2 => score_block::<2>(q, d, panel, out, cols, masks),
                    _ => score_block::<1>(q, d, panel, out, cols, masks),
                }
            }
            r += n;
        }
    }
}

/// One block of `R` rows × 64 keys of scores.
///
/// # Safety
/// AVX-512F; `q` points to `R · d` values, `panel` to `d · PANEL`; for each row `r < R` and
/// vector `z` whose mask is not 0, the masked lanes of `out + r · out_rs + 16 z` are writable.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn score_block<const R: usize>(
    q: *const f32,
    d: usize,
    panel: *const f32,
    out: *mut f32,
    out_rs: usize,
    masks: [u16; 4],
) {
    let mut acc = [[_mm512_setzero_ps(); 4]; R];
    for p in 0..d {
        let mut k = [_mm512_setzero_ps(); 4];
        for (z, k) in k.iter_mut().enumerate() {
            // SAFETY: `p < d`, so the panel's row `p` (64 values) is inside the caller's range.
            *k = unsafe { _mm512_loadu_ps(panel.add(p * PANEL + z * W)) };
        }
        for (r, acc) in acc.iter_mut().enumerate() {
            // SAFETY: as above.
            let b = _mm512_set1_ps(unsafe { *q.add(r * d + p) });
            for z in 0..4 {
                acc[z] = _mm512_fmadd_ps(k[z], b, acc[z]);
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        for z in 0..4 {
            let dst = out.wrapping_add(r * out_rs + z * W);
            match masks[z] {
                0 => {}
                // SAFETY: the caller vouches for the selected lanes (here all 16).
                u16::MAX => unsafe { _mm512_storeu_ps(dst, acc[z]) },
                // SAFETY: as above; masked-off lanes are not touched.
                m => unsafe { _mm512_mask_storeu_ps(dst, m, acc[z]) },
            }
        }
    }
}

/// Keys one pass of [`accumulate_avx512`] takes: their rows of `V` (16 KiB at `dv` = 64) stay in
/// L1 while every row block uses them.
#[cfg(target_arch = "x86_64")]
const KEY_CHUNK: usize = 64;

/// How a [`value_block`] starts its accumulators.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, PartialEq, Eq)]
enum Start {
    /// From zero: the first key tile's first chunk.
    Zero,
    /// From the stored rows times `alpha`: a later key tile's first chunk.
    Scaled,
    /// From the stored rows: a later chunk of the same tile, continuing the same sums.
    Stored,
}

/// [`Avx512::accumulate`]: chunks of [`KEY_CHUNK`] keys, each over blocks of [`ROWS`] rows × 64
/// output columns. A row's sums carry from one chunk to the next through `acc` unchanged (a
/// store and a load are exact), so each output element is still one chain over the keys in
/// order.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn accumulate_avx512(
    p: &[f32],
    cols: usize,
    v: &[f32],
    dv: usize,
    alpha: &[f32],
    first: bool,
    acc: &mut [f32],
) {
    let rows = acc.len() / dv.max(1);
    for j0 in (0..cols).step_by(KEY_CHUNK) {
        let keys = (cols - j0).min(KEY_CHUNK);
        let start = match (j0, first) {
            (0, true) => Start::Zero,
            (0, false) => Start::Scaled,
            _ => Start::Stored,
        };
        let mut r = 0;
        while r < rows {
            let n = (rows - r).min(ROWS);
            for c in (0..dv).step_by(PANEL) {
                let width = (dv - c).min(PANEL);
                let masks = lane_masks(width);
                let args = Block {
                    p: p[r * cols + j0..].as_ptr(),
                    p_rs: cols,
                    keys,
                    v: v[j0 * dv + c..].as_ptr(),
                    dv,
                    alpha: alpha[r..][..n].as_ptr(),
                    start,
                    acc: acc[r * dv + c..].as_mut_ptr(),
                    mask: masks[width.div_ceil(W) - 1],
                };
                // SAFETY: `p` from row `r`, column `j0` has `n` rows (stride `cols`) of at least
                // `keys` values; `v` from row `j0`, column `c` has `keys` rows of stride `dv`, of
                // which the block reads columns `c..c + width` only (masked); `alpha` has `n`
                // values; `acc` from row `r`, column `c` has `n` rows of stride `dv`, of which the
                // block reads and writes columns `c..c + width` only.
                unsafe {
                    match (n, width.div_ceil(W)) {
                        (6, 4) => value_block::<6, 4>(args),
                        (6, 3) => value_block::<6, 3>(args),
                        (6, 2) => value_block::<6, 2>(args),
                        (6, _) => value_block::<6, 1>(args),
                        (5, 4) => value_block::<5, 4>(args),
                        (5, 3) => value_block::<5, 3>(args),
                        (5, 2) => value_block::<5, 2>(args),
                        (5, _) => value_block::<5, 1>(args),
                        (4, 4) => value_block::<4, 4>(args),
                        (4, 3) => value_block::<4, 3>(args),
                        (4, 2) => value_block::<4, 2>(args),
                        (4, _) => value_block::<4, 1>(args),
                        (3, 4) => value_block::<3, 4>(args),
                        (3, 3) => value_block::<3, 3>(args),
                        (3, 2) => value_block::<3, 2>(args),
                        (3, _) => value_block::<3, 1>(args),
                        (2, 4) => value_block::<2, 4>(args),
                        (2, 3) => value_block::<2, 3>(args),
                        (2, 2) => value_block::<2, 2>(args),
                        (2, _) => value_block::<2, 1>(args),
                        (_, 4) => value_block::<1, 4>(args),
                        (_, 3) => value_block::<1, 3>(args),
                        (_, 2) => value_block::<1, 2>(args),
                        (_, _) => value_block::<1, 1>(args),
                    }
                }
            }
            r += n;
        }
    }
}

/// The operands of one [`value_block`].
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Block {
    /// Row 0, first key of the block's probabilities (row stride `p_rs`).
    p: *const f32,
    p_rs: usize,
    /// Keys the block sums over.
    keys: usize,
    /// First key's row, first column of the block in `V` (row stride `dv`).
    v: *const f32,
    dv: usize,
    /// One factor per row, read when `start` is [`Start::Scaled`].
    alpha: *const f32,
    start: Start,
    /// Row 0, first column of the block in the accumulator (row stride `dv`).
    acc: *mut f32,
    /// Lanes of the block's last vector that are inside the columns.
    mask: u16,
}

/// One block of `R` rows × `Z` vectors of output columns (the last one masked).
///
/// # Safety
/// AVX-512F; `b.p` points to `R` rows (stride `b.p_rs`) of `b.keys` values; for `j < b.keys`,
/// the masked lanes of `Z` vectors from `b.v + j · b.dv` are readable; `b.alpha` points to `R`
/// values; for each row `r < R`, the masked lanes of `Z` vectors from `b.acc + r · b.dv` are
/// readable and writable.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn value_block<const R: usize, const Z: usize>(b: Block) {
    let lanes = |z: usize| if z + 1 == Z { b.mask } else { u16::MAX };
    let mut o = [[_mm512_setzero_ps(); Z]; R];
    if b.start != Start::Zero {
        for (r, o) in o.iter_mut().enumerate() {
            for (z, o) in o.iter_mut().enumerate() {
                // SAFETY: masked lanes of row `r`'s vector `z`, readable per the caller.
                *o = unsafe { _mm512_maskz_loadu_ps(lanes(z), b.acc.add(r * b.dv + z * W)) };
            }
            if b.start == Start::Scaled {
                // SAFETY: `r < R` (the caller's ranges).
                let a = _mm512_set1_ps(unsafe { *b.alpha.add(r) });
                for o in o.iter_mut() {
                    *o = _mm512_mul_ps(*o, a);
                }
            }
        }
    }
    for j in 0..b.keys {
        let mut v = [_mm512_setzero_ps(); Z];
        for (z, v) in v.iter_mut().enumerate() {
            // SAFETY: `j < cols`: masked lanes of `V`'s row `j`, readable per the caller.
            *v = unsafe { _mm512_maskz_loadu_ps(lanes(z), b.v.add(j * b.dv + z * W)) };
        }
        for (r, o) in o.iter_mut().enumerate() {
            // SAFETY: row `r < R`, column `j < keys` of the probabilities.
            let w = _mm512_set1_ps(unsafe { *b.p.add(r * b.p_rs + j) });
            for z in 0..Z {
                o[z] = _mm512_fmadd_ps(v[z], w, o[z]);
            }
        }
    }
    for (r, o) in o.iter().enumerate() {
        for (z, o) in o.iter().enumerate() {
            let dst = b.acc.wrapping_add(r * b.dv + z * W);
            // SAFETY: masked lanes of row `r`'s vector `z`, writable per the caller.
            unsafe { _mm512_mask_storeu_ps(dst, lanes(z), *o) };
        }
    }
}
