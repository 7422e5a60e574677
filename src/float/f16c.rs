//! The f32 → f16 encoder on the CPU's own conversion instruction (`vcvtps2ph`): 16 lanes with
//! AVX-512F, 8 with F16C, picked at run time; elsewhere, and for the last few elements of a
//! slice, the portable branch-free encoder of `cast.rs`.
//!
//! # Same bits as the portable encoder
//!
//! The instruction is run with its rounding mode in the immediate (round to nearest, ties to
//! even; MXCSR's rounding control is ignored), and it rounds subnormals correctly, overflows to
//! ±inf, and makes a NaN quiet keeping the top ten bits of its payload (`sign | 0x7E00 |
//! mantissa >> 13`) — exactly the portable encoder's rules, so the two give the same bits for
//! every f32 (`f16_hardware_encoder_matches_portable_on_every_exponent_and_tie` checks every
//! exponent, sign and rounding case, NaN payloads included). MXCSR's DAZ flag would flush
//! subnormal inputs, but those encode to ±0 either way, and Rust code never sets it.

use super::cast::Dest;

/// Elements one AVX-512 conversion handles.
#[cfg(target_arch = "x86_64")]
const LANES: usize = 16;

/// Encodes `src` as f16 bits into `dst` (equal lengths) with the conversion instruction, and
/// returns how many leading elements it wrote: a multiple of 8 or 16, or 0 when the CPU has
/// neither AVX-512F nor F16C. The caller encodes the rest.
#[inline]
pub(super) fn encode_f16_hardware<D: Dest<u16>>(src: &[f32], dst: &mut [D]) -> usize {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: `avx512` requires AVX-512F (and the AVX it implies), just checked.
            return unsafe { avx512(src, dst) };
        }
        if std::arch::is_x86_feature_detected!("f16c") && std::arch::is_x86_feature_detected!("avx")
        {
            // SAFETY: `f16c` requires F16C and AVX, just checked.
            return unsafe { f16c(src, dst) };
        }
    }
    let _ = (src, dst);
    0
}

/// 16 lanes at a time with `vcvtps2ph zmm`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn avx512<D: Dest<u16>>(src: &[f32], dst: &mut [D]) -> usize {
    use std::arch::x86_64::{
        _mm256_storeu_si256, _mm512_cvtps_ph, _mm512_loadu_ps, _MM_FROUND_NO_EXC,
        _MM_FROUND_TO_NEAREST_INT,
    };
    let n = src.len().min(dst.len()) / LANES * LANES;
    for (s, d) in src[..n]
        .chunks_exact(LANES)
        .zip(dst[..n].chunks_exact_mut(LANES))
    {
        let mut bits = [0u16; LANES];
        // SAFETY: `s` holds exactly 16 f32 (an unaligned load reads 64 bytes from its start), and
        // `bits` is 32 bytes (an unaligned store); the features are enabled on this function.
        unsafe {
            let v = _mm512_loadu_ps(s.as_ptr());
            let h = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v);
            _mm256_storeu_si256(bits.as_mut_ptr().cast(), h);
        }
        for (d, b) in d.iter_mut().zip(bits) {
            d.put(b);
        }
    }
    n
}

/// 8 lanes at a time with F16C's `vcvtps2ph ymm`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
fn f16c<D: Dest<u16>>(src: &[f32], dst: &mut [D]) -> usize {
    use std::arch::x86_64::{
        _mm256_cvtps_ph, _mm256_loadu_ps, _mm_storeu_si128, _MM_FROUND_TO_NEAREST_INT,
    };
    const HALF: usize = 8;
    let n = src.len().min(dst.len()) / HALF * HALF;
    for (s, d) in src[..n]
        .chunks_exact(HALF)
        .zip(dst[..n].chunks_exact_mut(HALF))
    {
        let mut bits = [0u16; HALF];
        // SAFETY: `s` holds exactly 8 f32 (an unaligned 32-byte load), and `bits` is 16 bytes (an
        // unaligned store); the features are enabled on this function.
        unsafe {
            let v = _mm256_loadu_ps(s.as_ptr());
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
            _mm_storeu_si128(bits.as_mut_ptr().cast(), h);
        }
        for (d, b) in d.iter_mut().zip(bits) {
            d.put(b);
        }
    }
    n
}

/// The F16C path alone, for the test that compares it with the portable encoder on CPUs that
/// would otherwise take the AVX-512 path.
#[cfg(all(test, target_arch = "x86_64"))]
pub(super) fn encode_f16_f16c_only(src: &[f32], dst: &mut [u16]) -> usize {
    if std::arch::is_x86_feature_detected!("f16c") && std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: `f16c` requires F16C and AVX, just checked.
        unsafe { f16c(src, dst) }
    } else {
        0
    }
}
