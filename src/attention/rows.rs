//! The row kernels of the fused attention kernel: a vectorizable `exp`, the online-softmax update
//! of one score tile ([`softmax_tile`]), rescaling and normalizing the output accumulator, masking
//! a score row and rounding it to a half dtype.
//!
//! Every kernel is plain scalar code compiled baseline, with AVX2 and with AVX-512
//! ([`multiversion!`]); sums run over [`LANES`] fixed partial sums, added in a fixed order, so the
//! vectorized variants give the same bits as the baseline one.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::float::multiversion::multiversion;

/// Partial sums a row reduction keeps: one AVX-512 vector of `f32`.
const LANES: usize = 16;

/// `log2(e)`.
pub(super) const LOG2E: f32 = std::f32::consts::LOG2_E;
/// `ln 2`'s high part, 355/512 exactly: `n·LN2_HI` is exact for the `n` that occur.
pub(super) const LN2_HI: f32 = 0.693_359_4;
/// `ln 2 - LN2_HI`.
pub(super) const LN2_LO: f32 = -2.121_944_4e-4;
/// 1.5 · 2²³: adding it rounds to an integer (nearest even), held in the low mantissa bits.
pub(super) const MAGIC: f32 = 12_582_912.0;
/// ln(2⁻¹²⁶): the smallest input whose result is normal.
pub(super) const EXP_MIN: f32 = -87.336_54;
/// Cephes' polynomial for `eʳ`, highest degree first (after `1 + r`).
pub(super) const EXP_POLY: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];

/// `eˣ` for `x ≤ 0` (and NaN, which it returns), branch-free so loops over it vectorize.
///
/// Cody–Waite reduction `x = n·ln 2 + r`, `|r| ≤ ln 2 / 2`, then Cephes' degree-6 polynomial for
/// `eʳ` and `2ⁿ` from the exponent bits; within 2 ulp of the exact value (the tests measure
/// it). Fused multiply-adds (`mul_add`, exact by definition) keep the bits the same in every
/// variant: one instruction with FMA, a libm call on the rare x86-64 CPU without it (and
/// `softmax512.rs` repeats the same operations on 16 lanes). Below `ln(2⁻¹²⁶)` it returns 0 (the
/// exact value is a subnormal, below 1.2e-38), so a masked `-inf` score weighs exactly nothing;
/// `exp(0)` is exactly 1. Positive `x` is out of its domain: the online softmax only
/// exponentiates differences to a running maximum.
#[inline(always)]
pub(super) fn exp_nonpositive(x: f32) -> f32 {
    let shifted = x.mul_add(LOG2E, MAGIC);
    let n = shifted - MAGIC;
    let r = n.mul_add(-LN2_HI, x);
    let r = n.mul_add(-LN2_LO, r);
    let mut p = EXP_POLY[0];
    for &c in &EXP_POLY[1..] {
        p = p.mul_add(r, c);
    }
    let y = p.mul_add(r * r, r) + 1.0;
    // For `x ≥ EXP_MIN`, `n` is an integer in [-126, 0] and these are the bits of 2ⁿ; other lanes
    // compute garbage that the select below discards.
    let exponent = (shifted.to_bits().wrapping_sub(MAGIC.to_bits()) as i32).wrapping_add(127);
    let scale = f32::from_bits((exponent as u32) << 23);
    if x < EXP_MIN {
        0.0
    } else {
        y * scale
    }
}

/// The largest value of `row` (ignoring NaN; `-inf` for an empty or all-NaN row).
#[inline(always)]
fn row_max(row: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let mut chunks = row.chunks_exact(LANES);
    for c in &mut chunks {
        for (l, &x) in lanes.iter_mut().zip(c) {
            *l = if x > *l { x } else { *l };
        }
    }
    for (l, &x) in lanes.iter_mut().zip(chunks.remainder()) {
        *l = if x > *l { x } else { *l };
    }
    lanes
        .into_iter()
        .fold(f32::NEG_INFINITY, |m, x| if x > m { x } else { m })
}

/// Replaces each `x` of `row` by `exp(x - max)` and returns their sum, added over [`LANES`]
/// partial sums in a fixed order.
#[inline(always)]
fn exp_row(row: &mut [f32], max: f32) -> f32 {
    let mut lanes = [0f32; LANES];
    let mut chunks = row.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for (l, x) in lanes.iter_mut().zip(c.iter_mut()) {
            *x = exp_nonpositive(*x - max);
            *l += *x;
        }
    }
    for (l, x) in lanes.iter_mut().zip(chunks.into_remainder()) {
        *x = exp_nonpositive(*x - max);
        *l += *x;
    }
    // Pairwise, in a fixed order.
    let mut width = LANES / 2;
    while width > 0 {
        for i in 0..width {
            lanes[i] += lanes[i + width];
        }
        width /= 2;
    }
    lanes[0]
}

multiversion! {
    /// The online-softmax step for one tile of scores, `cols` per row: per row the new running
    /// maximum `m' = max(m, max(row))`, the factor `alpha = exp(m - m')` the old sum and output
    /// rows must be scaled by, the row replaced by `exp(row - m')`, and the running sum
    /// `l' = l·alpha + Σ exp(row - m')`. `max`, `sum` and `alpha` have one entry per row.
    pub(super) fn softmax_tile(
        scores: &mut [f32],
        cols: usize,
        max: &mut [f32],
        sum: &mut [f32],
        alpha: &mut [f32],
    ) {
        let rows = scores.chunks_exact_mut(cols.max(1));
        for (((row, m), l), a) in rows.zip(max.iter_mut()).zip(sum.iter_mut()).zip(alpha.iter_mut()) {
            let tile_max = row_max(row);
            let m_new = if tile_max > *m { tile_max } else { *m };
            *a = exp_nonpositive(*m - m_new);
            let s = exp_row(row, m_new);
            *l = *l * *a + s;
            *m = m_new;
        }
    }
}

multiversion! {
    /// Scales each row of `acc` (`cols` per row) by its `alpha`; rows whose factor is 1 are left
    /// alone.
    pub(super) fn scale_rows(acc: &mut [f32], cols: usize, alpha: &[f32]) {
        for (row, &a) in acc.chunks_exact_mut(cols.max(1)).zip(alpha) {
            if a != 1.0 {
                for x in row.iter_mut() {
                    *x *= a;
                }
            }
        }
    }
}

multiversion! {
    /// `out[i][c] = acc[i][c] / sum[i]`, `cols` per row.
    pub(super) fn normalize_rows(acc: &[f32], sum: &[f32], cols: usize, out: &mut [f32]) {
        let rows = acc.chunks_exact(cols.max(1)).zip(out.chunks_exact_mut(cols.max(1)));
        for ((a, o), &l) in rows.zip(sum) {
            for (o, &a) in o.iter_mut().zip(a) {
                *o = a / l;
            }
        }
    }
}

multiversion! {
    /// Boolean masking: every score whose mask byte is 0 becomes `fill`.
    pub(super) fn mask_bool_row(row: &mut [f32], mask: &[u8], fill: f32) {
        for (x, &m) in row.iter_mut().zip(mask) {
            *x = if m == 0 { fill } else { *x };
        }
    }
}

multiversion! {
    /// Additive masking: `row[j] += mask[j]`.
    pub(super) fn add_row(row: &mut [f32], mask: &[f32]) {
        for (x, &m) in row.iter_mut().zip(mask) {
            *x += m;
        }
    }
}

/// A 16-bit float format scores are rounded to, emulating a score or softmax dtype narrower than
/// the kernel's `f32`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Half {
    F16,
    Bf16,
}

impl Half {
    /// The half format of `dtype`, if it is one.
    pub(super) fn of(dtype: candle_core::DType) -> Option<Half> {
        match dtype {
            candle_core::DType::F16 => Some(Half::F16),
            candle_core::DType::BF16 => Some(Half::Bf16),
            _ => None,
        }
    }

    /// Rounds every value of `row` to this format (RNE, as candle's `to_dtype` does) and back.
    pub(super) fn round(self, row: &mut [f32]) {
        const CHUNK: usize = 256;
        match self {
            Half::F16 => {
                let mut buf = [f16::ZERO; CHUNK];
                for c in row.chunks_mut(CHUNK) {
                    let buf = &mut buf[..c.len()];
                    buf.convert_from_f32_slice(c);
                    buf.convert_to_f32_slice(c);
                }
            }
            Half::Bf16 => {
                let mut buf = [bf16::ZERO; CHUNK];
                for c in row.chunks_mut(CHUNK) {
                    let buf = &mut buf[..c.len()];
                    buf.convert_from_f32_slice(c);
                    buf.convert_to_f32_slice(c);
                }
            }
        }
    }
}
