//! [`rows::softmax_tile`](super::rows::softmax_tile) on AVX-512, sixteen rows at a time, with
//! the same bits.
//!
//! # Why
//!
//! The portable step, compiled for AVX-512, vectorizes each row's passes but ends every row with
//! two horizontal reductions (its maximum and its sum over 16 partial lanes) and one scalar
//! `exp` for `alpha`, all in scalar instructions: at 256 keys a row that is about a third of the
//! step's time. Here a batch of 16 rows keeps its 16 lane vectors and reduces them together, with
//! a shuffle network that leaves row `r`'s result in lane `r`, and computes the 16 `alpha`s with
//! one vector `exp`.
//!
//! # Same bits
//!
//! - `exp` is [`exp_nonpositive`](super::rows::exp_nonpositive) operation for operation (its
//!   fused multiply-adds are `vfmadd`, its other steps the same IEEE operations).
//! - The sums keep the portable lanes (lane `l` adds the row's elements `l`, `l + 16`, … in
//!   order) and reduce them in the portable pairwise order: `l + (l + 8)`, then `+4`, `+2`, `+1`.
//!   IEEE addition is commutative, so which operand a shuffle puts first does not matter.
//! - The maximum is order-free except for the sign of a zero (`max(0, -0)`), which no later step
//!   can see: the maximum is only subtracted from scores and compared with, and `exp(±0) = 1`.
//!   `vmaxps(x, m)` is `x > m ? x : m`, the portable rule, NaN included.
//! - `l' = l·alpha + s` is a multiply then an add, not fused, as in the portable code.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::products::Avx512;
use super::rows::softmax_tile as portable;
#[cfg(target_arch = "x86_64")]
use super::rows::{EXP_MIN, EXP_POLY, LN2_HI, LN2_LO, LOG2E, MAGIC};

/// Rows reduced together: one per lane.
#[cfg(target_arch = "x86_64")]
const BATCH: usize = 16;

impl Avx512 {
    /// [`rows::softmax_tile`](super::rows::softmax_tile), with the same bits.
    pub(super) fn softmax_tile(
        self,
        scores: &mut [f32],
        cols: usize,
        max: &mut [f32],
        sum: &mut [f32],
        alpha: &mut [f32],
    ) {
        let rows = scores.len() / cols.max(1);
        assert!(max.len() >= rows && sum.len() >= rows && alpha.len() >= rows);
        #[cfg(target_arch = "x86_64")]
        {
            let whole = if cols == 0 { 0 } else { rows / BATCH * BATCH };
            for r0 in (0..whole).step_by(BATCH) {
                let tile = &mut scores[r0 * cols..][..BATCH * cols];
                let (m, s, a) = (&mut max[r0..], &mut sum[r0..], &mut alpha[r0..]);
                // SAFETY: `self` proves AVX-512F; `tile` holds 16 rows of `cols` and `m`, `s`, `a`
                // at least 16 values each (checked above).
                unsafe { batch(tile, cols, m, s, a) };
            }
            let rest = whole..rows;
            portable(
                &mut scores[rest.start * cols..],
                cols,
                &mut max[rest.clone()],
                &mut sum[rest.clone()],
                &mut alpha[rest],
            );
        }
        #[cfg(not(target_arch = "x86_64"))]
        portable(scores, cols, max, sum, alpha);
    }
}

/// The online-softmax step for 16 rows of `cols` scores.
///
/// # Safety
/// AVX-512F; `tile.len() == 16 · cols`, `cols > 0`; `max`, `sum`, `alpha` hold at least 16
/// values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn batch(
    tile: &mut [f32],
    cols: usize,
    max: &mut [f32],
    sum: &mut [f32],
    alpha: &mut [f32],
) {
    let full = cols / 16;
    let tail = (cols % 16) as u32;
    let tail_mask: __mmask16 = ((1u32 << tail) - 1) as u16;
    let neg_inf = _mm512_set1_ps(f32::NEG_INFINITY);

    let mut lanes = [neg_inf; BATCH];
    for (row, lane) in tile.chunks_exact(cols).zip(lanes.iter_mut()) {
        let mut m = neg_inf;
        for c in 0..full {
            // SAFETY: `16c + 16 ≤ cols`: inside the row.
            let x = unsafe { _mm512_loadu_ps(row.as_ptr().add(16 * c)) };
            m = _mm512_max_ps(x, m);
        }
        if tail != 0 {
            // SAFETY: the masked lanes are the row's last `tail` values; -inf elsewhere.
            let x =
                unsafe { _mm512_mask_loadu_ps(neg_inf, tail_mask, row.as_ptr().add(16 * full)) };
            m = _mm512_max_ps(x, m);
        }
        *lane = m;
    }
    let tile_max = reduce(lanes, |a, b| _mm512_max_ps(a, b));
    // SAFETY: `max` and `alpha` hold at least 16 values.
    let m_old = unsafe { _mm512_loadu_ps(max.as_ptr()) };
    let m_new = _mm512_max_ps(tile_max, m_old);
    let a = exp(_mm512_sub_ps(m_old, m_new));
    unsafe {
        _mm512_storeu_ps(max.as_mut_ptr(), m_new);
        _mm512_storeu_ps(alpha.as_mut_ptr(), a);
    }
    let mut row_max = [0f32; BATCH];
    // SAFETY: 16 values.
    unsafe { _mm512_storeu_ps(row_max.as_mut_ptr(), m_new) };

    let mut lanes = [_mm512_setzero_ps(); BATCH];
    for ((row, lane), &m) in tile
        .chunks_exact_mut(cols)
        .zip(lanes.iter_mut())
        .zip(&row_max)
    {
        let m = _mm512_set1_ps(m);
        let mut s = _mm512_setzero_ps();
        for c in 0..full {
            let p = row.as_mut_ptr().wrapping_add(16 * c);
            // SAFETY: `16c + 16 ≤ cols`: inside the row.
            let e = exp(_mm512_sub_ps(unsafe { _mm512_loadu_ps(p) }, m));
            unsafe { _mm512_storeu_ps(p, e) };
            s = _mm512_add_ps(s, e);
        }
        if tail != 0 {
            let p = row.as_mut_ptr().wrapping_add(16 * full);
            // SAFETY: the masked lanes are the row's last `tail` values.
            let e = exp(_mm512_sub_ps(
                unsafe { _mm512_maskz_loadu_ps(tail_mask, p) },
                m,
            ));
            unsafe { _mm512_mask_storeu_ps(p, tail_mask, e) };
            s = _mm512_mask_add_ps(s, tail_mask, s, e);
        }
        *lane = s;
    }
    let tile_sum = reduce(lanes, |a, b| _mm512_add_ps(a, b));
    // SAFETY: `sum` holds at least 16 values.
    let l = unsafe { _mm512_loadu_ps(sum.as_ptr()) };
    let l = _mm512_add_ps(_mm512_mul_ps(l, a), tile_sum);
    unsafe { _mm512_storeu_ps(sum.as_mut_ptr(), l) };
}

/// Reduces each of 16 vectors over its lanes with `op`, pairing lane `i` with `i + 8`, then
/// `i + 4`, `i + 2`, `i + 1` (the portable order): lane `r` of the result is vector `r`'s.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn reduce(v: [__m512; BATCH], op: impl Fn(__m512, __m512) -> __m512) -> __m512 {
    // Each step combines two vectors: `lo` and `hi` gather the halves to pair, side by side.
    // 1: 128-bit chunks [a0 a1 b0 b1] + [a2 a3 b2 b3]: lanes i + 8 of rows 2j, 2j+1.
    let s: [__m512; 8] = std::array::from_fn(|j| {
        let (a, b) = (v[2 * j], v[2 * j + 1]);
        op(
            _mm512_shuffle_f32x4::<0x44>(a, b),
            _mm512_shuffle_f32x4::<0xEE>(a, b),
        )
    });
    // 2: chunks [a0 b0 c0 d0] + [a1 b1 c1 d1]: lanes i + 4; chunk k now holds row 4m + k.
    let t: [__m512; 4] = std::array::from_fn(|m| {
        let (a, b) = (s[2 * m], s[2 * m + 1]);
        op(
            _mm512_shuffle_f32x4::<0x88>(a, b),
            _mm512_shuffle_f32x4::<0xDD>(a, b),
        )
    });
    // 3: within chunks, [x0 x1 y0 y1] + [x2 x3 y2 y3]: lanes i + 2.
    let u: [__m512; 2] = std::array::from_fn(|p| {
        let (a, b) = (t[2 * p], t[2 * p + 1]);
        op(
            _mm512_shuffle_ps::<0x44>(a, b),
            _mm512_shuffle_ps::<0xEE>(a, b),
        )
    });
    // 4: [x0 x2 y0 y2] + [x1 x3 y1 y3]: lanes i + 1. Lane 4k + e now holds row 4e + k.
    let w = op(
        _mm512_shuffle_ps::<0x88>(u[0], u[1]),
        _mm512_shuffle_ps::<0xDD>(u[0], u[1]),
    );
    // Row r sits in lane 4(r % 4) + r / 4.
    let index = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_permutexvar_ps(index, w)
}

/// [`exp_nonpositive`](super::rows::exp_nonpositive) on 16 lanes, operation for operation.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn exp(x: __m512) -> __m512 {
    let magic = _mm512_set1_ps(MAGIC);
    let shifted = _mm512_fmadd_ps(x, _mm512_set1_ps(LOG2E), magic);
    let n = _mm512_sub_ps(shifted, magic);
    let r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_HI), x);
    let r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_LO), r);
    let mut p = _mm512_set1_ps(EXP_POLY[0]);
    for &c in &EXP_POLY[1..] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    let y = _mm512_add_ps(
        _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r),
        _mm512_set1_ps(1.0),
    );
    let exponent = _mm512_add_epi32(
        _mm512_sub_epi32(_mm512_castps_si512(shifted), _mm512_castps_si512(magic)),
        _mm512_set1_epi32(127),
    );
    let scale = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(exponent));
    // Lanes with x < ln(2⁻¹²⁶) are 0; NaN lanes are not below it and stay NaN.
    let keep = _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(x, _mm512_set1_ps(EXP_MIN));
    _mm512_maskz_mul_ps(keep, y, scale)
}
