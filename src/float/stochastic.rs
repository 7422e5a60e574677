//! Seeded stochastic rounding to fp8 ([`Rounding::Stochastic`]) and the counter-based random bits
//! it draws from.
//!
//! # Determinism
//!
//! Stochastic rounding draws its randomness from a counter-based generator: the 32 random bits of
//! element `i` are a pure function of `(seed, i)`: two keys are derived from the seed and the
//! high word of `i` with splitmix64's finalizer, then the low word of `i` goes through two keyed
//! rounds of a 32-bit integer hash (`lowbias32`), which vectorizes. Nothing depends on thread
//! count, chunking or run: the same seed and input give the same bits everywhere. The seed of a
//! weight is [`weight_seed`] of its key, so a patched weight re-materialized after an unload
//! comes back bit-identical.
//!
//! The rounding contract itself (neighbours, probability, saturation) is in the
//! [rounding rules](crate::float#rounding-rules).

use super::cast::Dest;
use super::fp8::Format;
use super::multiversion::multiversion;
use super::weight_seed;

/// How [`from_f32`](super::from_f32) and [`f32_to_fp8`](super::f32_to_fp8) round values that the
/// target dtype cannot hold exactly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Rounding {
    /// Round to nearest, ties to even. fp8 saturates to ±max (see the [rounding
    /// rules](crate::float#rounding-rules)).
    #[default]
    Nearest,
    /// Seeded stochastic rounding for fp8 (see the [rounding rules](crate::float#rounding-rules)
    /// for the contract). For the other dtypes it is the same as [`Rounding::Nearest`].
    Stochastic {
        /// The seed; for a weight, [`weight_seed`] of its key.
        seed: u64,
    },
}

impl Rounding {
    /// Stochastic rounding seeded by a weight's key ([`weight_seed`]).
    pub fn stochastic_for(key: &str) -> Self {
        Rounding::Stochastic {
            seed: weight_seed(key),
        }
    }
}

/// Branch-free stochastic, saturating fp8 encode with 32 random bits `r`.
#[inline(always)]
pub(super) fn encode_stochastic<F: Format>(x: f32, r: u32) -> u8 {
    let bits = x.to_bits();
    let sign = (bits >> 24) & 0x80;
    let abs = bits & 0x7FFF_FFFF;
    // Normal range: add SHIFT uniform bits below the cut and truncate: rounds up exactly when the
    // random number reaches 2^SHIFT minus the dropped bits, i.e. with probability
    // dropped / 2^SHIFT = (x - lo) / (hi - lo).
    let normal = ((abs + (r & ((1 << F::SHIFT) - 1))) >> F::SHIFT).wrapping_sub(F::REBIAS);
    // Subnormal range: in units of the subnormal step the magnitude is `scaled` (exact: a power
    // of two scaling); its fraction is exact too; round up when a 24-bit uniform is below it.
    let scaled = f32::from_bits(abs) * F::SUB_SCALE;
    // Signed conversions (single instructions on x86): `scaled` < 2^M + 1 and `r >> 8` < 2^24 in
    // every lane that is selected. `as i32` would saturate and map NaN to 0, checks the compiler
    // emits one lane at a time; clamping to [0, 2^M + 1] first (which changes no selected lane)
    // and converting unchecked keeps the loop one vector instruction wide.
    let clamped = scaled.max(0.0).min(((1u32 << F::M) + 1) as f32);
    // SAFETY: `f32::max`/`min` return the non-NaN operand, so `clamped` is a finite value in
    // [0, 2^M + 1] ⊂ i32's range, which is all `to_int_unchecked` requires.
    let lo: i32 = unsafe { clamped.to_int_unchecked() };
    let frac = scaled - lo as f32;
    let uniform = ((r >> 8) as i32) as f32 * (1.0 / 16_777_216.0);
    let lo = lo as u32;
    // `lo` is meaningless for lanes outside the subnormal range, which are not selected.
    let sub = lo.wrapping_add(u32::from(uniform < frac));
    let code = if abs < F::MIN_NORMAL_BITS {
        sub
    } else {
        normal
    };
    let code = code.min(F::MAX_CODE);
    let code = if abs > 0x7F80_0000 { F::NAN_CODE } else { code };
    (code | sign) as u8
}

/// The splitmix64 increment (2⁶⁴ / φ).
pub(crate) const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// splitmix64's finalizer: a 64-bit bijection with full avalanche.
#[inline(always)]
pub(crate) fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Chris Wellons' `lowbias32`: a 32-bit bijection with low avalanche bias, made only of 32-bit
/// shifts, xors and multiplies, so a loop over it vectorizes (8 lanes with AVX2).
#[inline(always)]
fn mix32(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x21F0_AAAD);
    x ^= x >> 15;
    x = x.wrapping_mul(0xD35A_2D97);
    x ^ (x >> 15)
}

/// The two 32-bit keys for elements whose index has high word `hi`, from the seed. Computed once
/// per run of 2³² indices, never per element.
#[inline]
fn block_keys(seed: u64, hi: u32) -> (u32, u32) {
    let k =
        mix64(mix64(seed ^ 0x5EED_F8F8_5EED_F8F8).wrapping_add(u64::from(hi).wrapping_mul(GOLDEN)));
    (k as u32, (k >> 32) as u32)
}

/// The 32 random bits of the element whose index has low word `lo`, under [`block_keys`]:
/// two keyed rounds of [`mix32`].
#[inline(always)]
fn keyed_bits((k0, k1): (u32, u32), lo: u32) -> u32 {
    mix32(mix32(lo ^ k0) ^ k1)
}

/// The 32 random bits of element `index` of a stochastic conversion seeded with `seed`.
#[cfg(test)]
pub(super) fn element_bits(seed: u64, index: u64) -> u32 {
    keyed_bits(block_keys(seed, (index >> 32) as u32), index as u32)
}

multiversion! {
    /// Stochastic kernel for a chunk whose first element has global index `base`.
    pub(super) fn fp8_stochastic_kernel<F: Format, D: Dest<u8>>(src: &[f32], dst: &mut [D], seed: u64, base: u64) {
        let mut src = src;
        let mut dst = dst;
        let mut index = base;
        // Runs of indices sharing their high word (one run unless the chunk crosses a multiple of
        // 2^32); within a run the loop is branch-free and vectorizes.
        while !src.is_empty() && !dst.is_empty() {
            let lo = index as u32;
            let room = (1u64 << 32) - u64::from(lo);
            let take = src
                .len()
                .min(dst.len())
                .min(usize::try_from(room).unwrap_or(usize::MAX));
            let keys = block_keys(seed, (index >> 32) as u32);
            let (s_run, s_rest) = src.split_at(take);
            let (d_run, d_rest) = dst.split_at_mut(take);
            let mut counter = lo;
            for (d, &x) in d_run.iter_mut().zip(s_run) {
                d.put(encode_stochastic::<F>(x, keyed_bits(keys, counter)));
                counter = counter.wrapping_add(1);
            }
            src = s_rest;
            dst = d_rest;
            index += take as u64;
        }
    }
}
