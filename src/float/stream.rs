//! f32 → f16 / bf16 into a large buffer with non-temporal stores.
//!
//! Converting into a caller's buffer is memory-bound: the CPU reads 4 bytes and writes 2 per
//! element. An ordinary store first reads the destination's cache line (read-for-ownership), so
//! the memory traffic is 4 + 2 + 2 bytes; a non-temporal store (`vmovntdq`) writes the line
//! without reading it: 4 + 2. On this project's 2-core machine that made f32 → f16 into a 32 MiB
//! buffer 10–15 % faster. A destination small enough to stay in cache would lose by it (the next
//! reader would find nothing cached), so only buffers of at least [`STREAM_MIN`] bytes stream.
//!
//! The bits are the portable encoders' (`cast.rs`): f16 through the same `vcvtps2ph` as
//! `f16c.rs`, bf16 through the same integer rounding as `bf16_bits`, written with AVX-512
//! instructions. Each chunk encodes its first elements with the portable encoder until the
//! destination is 32-byte aligned (a non-temporal store needs it), then 16 at a time, then the
//! tail; a store fence at the end of each chunk orders the streamed lines before the chunk is
//! reported done.

use half::{bf16, f16};

/// The smallest output, in bytes, converted with non-temporal stores: far beyond any cache.
pub(super) const STREAM_MIN: usize = 16 << 20;

/// Whether this CPU has what the streaming encoders need (AVX-512F).
pub(super) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Elements of `dst` before its first 32-byte aligned element (all of it when it has none).
fn head_len(dst: &[u16]) -> usize {
    let misaligned = dst.as_ptr() as usize % 32;
    let head = if misaligned == 0 {
        0
    } else {
        (32 - misaligned) / 2
    };
    head.min(dst.len())
}

/// Encodes `src` as f16 into `dst` (equal lengths) with non-temporal stores where aligned;
/// `portable` encodes the unaligned head and the tail. Needs [`available`].
pub(super) fn encode_f16(src: &[f32], dst: &mut [f16], portable: fn(&[f32], &mut [u16])) {
    let dst: &mut [u16] = half::slice::HalfFloatSliceExt::reinterpret_cast_mut(dst);
    encode(src, dst, portable, Kind::F16);
}

/// Encodes `src` as bf16 into `dst` (equal lengths), as [`encode_f16`] does.
pub(super) fn encode_bf16(src: &[f32], dst: &mut [bf16], portable: fn(&[f32], &mut [u16])) {
    let dst: &mut [u16] = half::slice::HalfFloatSliceExt::reinterpret_cast_mut(dst);
    encode(src, dst, portable, Kind::BF16);
}

#[derive(Clone, Copy)]
enum Kind {
    F16,
    BF16,
}

fn encode(src: &[f32], dst: &mut [u16], portable: fn(&[f32], &mut [u16]), kind: Kind) {
    let n = src.len().min(dst.len());
    let (src, dst) = (&src[..n], &mut dst[..n]);
    let head = head_len(dst);
    portable(&src[..head], &mut dst[..head]);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX-512F is checked first; `dst[head..]` starts 32-byte aligned.
    let streamed = match available() {
        true => unsafe { stream_avx512(&src[head..], &mut dst[head..], kind) },
        false => 0,
    };
    #[cfg(not(target_arch = "x86_64"))]
    let streamed = {
        let _ = kind;
        0
    };
    let done = head + streamed;
    portable(&src[done..], &mut dst[done..]);
}

/// 16 elements at a time with aligned non-temporal stores; returns how many it wrote (a multiple
/// of 16). `dst` must start 32-byte aligned.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn stream_avx512(src: &[f32], dst: &mut [u16], kind: Kind) -> usize {
    use std::arch::x86_64::{
        _mm256_stream_si256, _mm512_add_epi32, _mm512_and_si512, _mm512_castps_si512,
        _mm512_cmpgt_epu32_mask, _mm512_cvtepi32_epi16, _mm512_cvtps_ph, _mm512_loadu_ps,
        _mm512_mask_blend_epi32, _mm512_or_si512, _mm512_set1_epi32, _mm512_srli_epi32, _mm_sfence,
        _MM_FROUND_NO_EXC, _MM_FROUND_TO_NEAREST_INT,
    };
    const LANES: usize = 16;
    let n = src.len().min(dst.len()) / LANES * LANES;
    debug_assert!(n == 0 || (dst.as_ptr() as usize).is_multiple_of(32));
    let one = _mm512_set1_epi32(1);
    let half_ulp = _mm512_set1_epi32(0x7FFF);
    let quiet = _mm512_set1_epi32(0x0040);
    let abs_mask = _mm512_set1_epi32(0x7FFF_FFFF);
    let inf = _mm512_set1_epi32(0x7F80_0000);
    for (s, d) in src[..n]
        .chunks_exact(LANES)
        .zip(dst[..n].chunks_exact_mut(LANES))
    {
        // SAFETY: `s` holds 16 f32 (an unaligned 64-byte load); `d` holds 16 u16 and starts
        // 32-byte aligned (the caller aligned the first; each is 32 bytes after the last), as
        // the aligned non-temporal store needs; AVX-512F is enabled on this function.
        unsafe {
            let v = _mm512_loadu_ps(s.as_ptr());
            let h = match kind {
                Kind::F16 => {
                    _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v)
                }
                Kind::BF16 => {
                    // `bf16_bits` on 16 lanes: round to nearest even by adding 0x7FFF plus
                    // the kept lowest bit (wrapping), keep the top half; NaNs made quiet.
                    let bits = _mm512_castps_si512(v);
                    let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), one);
                    let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(
                        bits,
                        _mm512_add_epi32(half_ulp, lsb),
                    ));
                    let nan = _mm512_or_si512(_mm512_srli_epi32::<16>(bits), quiet);
                    let is_nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, abs_mask), inf);
                    _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(is_nan, rounded, nan))
                }
            };
            _mm256_stream_si256(d.as_mut_ptr().cast(), h);
        }
    }
    // The streamed lines are ordered before anything this thread stores next.
    _mm_sfence();
    n
}

#[cfg(test)]
mod tests {
    use half::slice::HalfBitsSliceExt;

    use super::*;

    /// An encoder into a buffer of bits.
    type Encoder = fn(&[f32], &mut [u16]);

    fn portable_f16(s: &[f32], d: &mut [u16]) {
        for (d, &s) in d.iter_mut().zip(s) {
            *d = super::super::cast::f16_bits_portable(s);
        }
    }

    fn portable_bf16(s: &[f32], d: &mut [u16]) {
        for (d, &s) in d.iter_mut().zip(s) {
            *d = super::super::cast::bf16_bits_portable(s);
        }
    }

    /// Values crossing every rounding case: ties both ways, subnormals, overflow, infinities,
    /// NaNs with payloads and signs.
    fn values(n: usize) -> Vec<f32> {
        let special = [
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::from_bits(0x7FC0_0001),
            f32::from_bits(0xFF80_0001),
            f32::from_bits(0x7F80_1234),
            f32::MAX,
            -f32::MAX,
            65504.0,
            65520.0,
            f32::from_bits(0x3F80_8000),
            f32::from_bits(0x3F81_8000),
            f32::from_bits(0x0000_0001),
            f32::from_bits(0x3380_0000),
            f32::from_bits(0x7F7F_8000),
        ];
        (0..n)
            .map(|i| {
                if i % 7 == 0 {
                    special[(i / 7) % special.len()]
                } else {
                    f32::from_bits((i as u32).wrapping_mul(2_654_435_761))
                }
            })
            .collect()
    }

    #[test]
    fn streamed_bits_equal_the_portable_encoders_at_every_alignment_and_length() {
        if !available() {
            eprintln!("skipped: no AVX-512F on this CPU");
            return;
        }
        let src = values(4096 + 64);
        for offset in 0..17 {
            for len in [0, 1, 15, 16, 17, 31, 100, 1000, 4096] {
                let s = &src[offset..offset + len];
                let mut want = vec![0u16; len];
                let mut buf = vec![f16::ZERO; len + 16];
                portable_f16(s, &mut want);
                let got = &mut buf[offset % 16..offset % 16 + len];
                encode_f16(s, got, portable_f16);
                let got: Vec<u16> = got.iter().map(|h| h.to_bits()).collect();
                assert_eq!(got, want, "f16, offset {offset}, length {len}");

                portable_bf16(s, &mut want);
                let mut buf = vec![bf16::ZERO; len + 16];
                let got = &mut buf[offset % 16..offset % 16 + len];
                encode_bf16(s, got, portable_bf16);
                let got: Vec<u16> = got.iter().map(|h| h.to_bits()).collect();
                assert_eq!(got, want, "bf16, offset {offset}, length {len}");
            }
        }
    }

    #[test]
    fn a_large_buffer_streams_through_the_public_casts_with_the_same_bits() {
        let n = STREAM_MIN / 2 + 5;
        let src = values(n);
        let mut want = vec![0u16; n];
        // Both casts into the same misaligned u16 buffer, viewed as their float type.
        let mut buf = vec![0u16; n + 3];
        let casts: [(Encoder, Encoder); 2] = [
            (
                |s, d| super::super::f32_to_f16(s, d.reinterpret_cast_mut()).unwrap(),
                portable_f16,
            ),
            (
                |s, d| super::super::f32_to_bf16(s, d.reinterpret_cast_mut()).unwrap(),
                portable_bf16,
            ),
        ];
        for (cast, portable) in casts {
            cast(&src, &mut buf[3..]);
            portable(&src, &mut want);
            assert!(buf[3..] == want[..]);
        }
    }

    #[test]
    fn the_head_reaches_the_first_aligned_element() {
        let buf = [0u16; 64];
        for start in 0..20 {
            let s = &buf[start..];
            let h = head_len(s);
            assert!(h < 16);
            assert_eq!((s.as_ptr() as usize + 2 * h) % 32, 0, "start {start}");
        }
        assert_eq!(head_len(&buf[..0]), 0);
    }
}
