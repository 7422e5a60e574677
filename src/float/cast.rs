//! Slice conversions between `f32` and every storage dtype, into buffers the caller provides, in
//! parallel over [`PAR_CHUNK`]-sized chunks: [`f32_to_f16`] (the CPU's conversion instruction,
//! `f16c.rs`, where it has one; else our own branch-free encoder) and [`f32_to_bf16`] (a
//! branch-free encoder, which vectorizes), [`f16_to_f32`] (`half`'s converter) and
//! [`bf16_to_f32`], [`f32_to_fp8`] and [`fp8_to_f32`] (the kernels of `fp8.rs` and
//! `stochastic.rs`).
//!
//! Into a caller's buffer of at least 16 MiB, f32 → f16 and f32 → bf16 write with non-temporal
//! stores (`stream.rs`: same bits, less memory traffic).
//!
//! The encoders write through [`Dest`], so the same kernel fills a caller's buffer or the
//! uninitialized buffer of a new tensor (never zeroed first: a new tensor's pages are touched once,
//! by the conversion, on every thread), and writes `half`'s and `float8`'s element types directly.

use std::mem::MaybeUninit;

use float8::F8E4M3;
use half::{bf16, f16};
use rayon::prelude::*;

use super::f16c::encode_f16_hardware;
use super::fp8::{fp8_decode_kernel, fp8_rne_kernel, Fp8Format, E4M3FN, E5M2};
use super::multiversion::multiversion;
use super::stochastic::{fp8_stochastic_kernel, Rounding};
use super::stream;
use crate::error::{Error, Result};

/// Number of elements one parallel task converts. Results never depend on it.
pub const PAR_CHUNK: usize = 64 * 1024;

/// A destination element an encoder writes a `T` (bits or value) into: the element itself, the
/// 16- or 8-bit float type whose bits `T` are, or uninitialized room for either.
pub(super) trait Dest<T>: Send {
    /// Stores `v`.
    fn put(&mut self, v: T);
}

impl<T: Send> Dest<T> for T {
    #[inline(always)]
    fn put(&mut self, v: T) {
        *self = v;
    }
}

impl<T: Send> Dest<T> for MaybeUninit<T> {
    #[inline(always)]
    fn put(&mut self, v: T) {
        self.write(v);
    }
}

/// `Dest<bits>` for a float type stored as those bits, and for room for one.
macro_rules! bits_dest {
    ($($t:ty: $bits:ty),*) => {$(
        impl Dest<$bits> for $t {
            #[inline(always)]
            fn put(&mut self, v: $bits) {
                *self = <$t>::from_bits(v);
            }
        }
        impl Dest<$bits> for MaybeUninit<$t> {
            #[inline(always)]
            fn put(&mut self, v: $bits) {
                self.write(<$t>::from_bits(v));
            }
        }
    )*};
}

bits_dest!(f16: u16, bf16: u16, F8E4M3: u8);

/// `bf16` bits of `x`: RNE; overflow to ±inf; NaN made quiet.
#[inline(always)]
fn bf16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    // Wraps only for negative NaNs, which the select below replaces.
    let rounded = (bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) >> 16) as u16;
    let nan = ((bits >> 16) | 0x0040) as u16;
    if bits & 0x7FFF_FFFF > 0x7F80_0000 {
        nan
    } else {
        rounded
    }
}

/// `f16` bits of `x`: RNE (subnormals included); overflow to ±inf; NaN made quiet keeping the top
/// of its payload. The same bits as the F16C instruction and `half`'s converter.
#[inline(always)]
fn f16_bits(x: f32) -> u16 {
    const MIN_NORMAL: u32 = 0x3880_0000; // 2⁻¹⁴
    const OVERFLOW: u32 = 0x4780_0000; // 2¹⁶: from here on, inf
                                       // 0.5: adding it to a magnitude below 2⁻¹⁴ rounds it (RNE, in the FPU) to a multiple of
                                       // 2⁻²⁴, the f16 subnormal step, held in the low mantissa bits.
    const SUB_MAGIC: f32 = 0.5;
    let bits = x.to_bits();
    let sign = (bits >> 16) & 0x8000;
    let abs = bits & 0x7FFF_FFFF;
    // Normal range: rebias the exponent (127 → 15) and round the 13 dropped bits to nearest even
    // in the integer domain; a carry moves into the exponent, up to inf past 65504.
    let normal = (abs
        .wrapping_add(((15u32.wrapping_sub(127)) << 23).wrapping_add(0xFFF))
        .wrapping_add((abs >> 13) & 1))
        >> 13;
    let sub = (f32::from_bits(abs) + SUB_MAGIC)
        .to_bits()
        .wrapping_sub(SUB_MAGIC.to_bits());
    let special = if abs > 0x7F80_0000 {
        0x7E00 | ((abs >> 13) & 0x3FF)
    } else {
        0x7C00
    };
    let code = if abs < MIN_NORMAL {
        sub
    } else if abs < OVERFLOW {
        normal
    } else {
        special
    };
    (code | sign) as u16
}

multiversion! {
    fn bf16_encode_kernel<D: Dest<u16>>(src: &[f32], dst: &mut [D]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            d.put(bf16_bits(s));
        }
    }
}

multiversion! {
    fn f16_encode_portable<D: Dest<u16>>(src: &[f32], dst: &mut [D]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            d.put(f16_bits(s));
        }
    }
}

/// f32 → f16 bits: the conversion instruction where the CPU has one (`f16c.rs`), the portable
/// encoder for the rest; the same bits either way.
fn f16_encode_kernel<D: Dest<u16>>(src: &[f32], dst: &mut [D]) {
    let done = encode_f16_hardware(src, dst);
    f16_encode_portable(&src[done..], &mut dst[done..]);
}

/// The portable f16 encoder alone, for tests comparing it with the hardware one.
#[cfg(test)]
pub(super) fn f16_bits_portable(x: f32) -> u16 {
    f16_bits(x)
}

/// The portable bf16 encoder, for tests comparing the streaming one with it.
#[cfg(test)]
pub(super) fn bf16_bits_portable(x: f32) -> u16 {
    bf16_bits(x)
}

multiversion! {
    fn bf16_decode_kernel(src: &[u16], dst: &mut [f32]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = f32::from_bits(u32::from(s) << 16);
        }
    }
}

fn check_len(what: &str, src: usize, dst: usize) -> Result<()> {
    if src == dst {
        Ok(())
    } else {
        Err(Error::ShapeMismatch {
            what: format!("{what}: destination length must equal source length"),
            expected: vec![src],
            got: vec![dst],
        })
    }
}

/// Applies `kernel(src_chunk, dst_chunk, index_of_first_element)` over [`PAR_CHUNK`]-sized
/// chunks, in parallel when there is more than one. Lengths must already be equal.
pub(super) fn par_convert<A: Sync, B: Send>(
    src: &[A],
    dst: &mut [B],
    kernel: impl Fn(&[A], &mut [B], u64) + Sync,
) {
    debug_assert_eq!(src.len(), dst.len());
    if src.len() <= PAR_CHUNK {
        kernel(src, dst, 0);
        return;
    }
    dst.par_chunks_mut(PAR_CHUNK)
        .zip(src.par_chunks(PAR_CHUNK))
        .enumerate()
        .for_each(|(i, (d, s))| kernel(s, d, (i * PAR_CHUNK) as u64));
}

/// Converts `src` to `f16` (RNE; overflow to ±inf; NaN made quiet) into `dst`, in parallel; the
/// same bits as `half`'s converter and the F16C instruction.
///
/// # Errors
/// [`Error::ShapeMismatch`] when the lengths differ; nothing is written then.
pub fn f32_to_f16(src: &[f32], dst: &mut [f16]) -> Result<()> {
    if dst.len() * 2 >= stream::STREAM_MIN && stream::available() {
        check_len("f32 → f16", src.len(), dst.len())?;
        par_convert(src, dst, |s, d, _| {
            stream::encode_f16(s, d, f16_encode_kernel::<u16>)
        });
        return Ok(());
    }
    encode_f16(src, dst)
}

/// [`f32_to_f16`] into any [`Dest`] of `f16` bits.
pub(super) fn encode_f16<D: Dest<u16>>(src: &[f32], dst: &mut [D]) -> Result<()> {
    check_len("f32 → f16", src.len(), dst.len())?;
    par_convert(src, dst, |s, d, _| f16_encode_kernel(s, d));
    Ok(())
}

/// Converts `f16` values to `f32` (exact) into `dst`, in parallel.
///
/// # Errors
/// [`Error::ShapeMismatch`] when the lengths differ.
pub fn f16_to_f32(src: &[f16], dst: &mut [f32]) -> Result<()> {
    use half::slice::HalfFloatSliceExt;
    check_len("f16 → f32", src.len(), dst.len())?;
    par_convert(src, dst, |s, d, _| s.convert_to_f32_slice(d));
    Ok(())
}

/// Converts `src` to `bf16` (RNE; overflow to ±inf; NaN made quiet) into `dst`, in parallel.
///
/// # Errors
/// [`Error::ShapeMismatch`] when the lengths differ.
pub fn f32_to_bf16(src: &[f32], dst: &mut [bf16]) -> Result<()> {
    if dst.len() * 2 >= stream::STREAM_MIN && stream::available() {
        check_len("f32 → bf16", src.len(), dst.len())?;
        par_convert(src, dst, |s, d, _| {
            stream::encode_bf16(s, d, bf16_encode_kernel::<u16>)
        });
        return Ok(());
    }
    encode_bf16(src, dst)
}

/// [`f32_to_bf16`] into any [`Dest`] of `bf16` bits.
pub(super) fn encode_bf16<D: Dest<u16>>(src: &[f32], dst: &mut [D]) -> Result<()> {
    check_len("f32 → bf16", src.len(), dst.len())?;
    par_convert(src, dst, |s, d, _| bf16_encode_kernel(s, d));
    Ok(())
}

/// Converts `bf16` values to `f32` (exact) into `dst`, in parallel.
///
/// # Errors
/// [`Error::ShapeMismatch`] when the lengths differ.
pub fn bf16_to_f32(src: &[bf16], dst: &mut [f32]) -> Result<()> {
    use half::slice::HalfFloatSliceExt;
    check_len("bf16 → f32", src.len(), dst.len())?;
    let src: &[u16] = src.reinterpret_cast();
    par_convert(src, dst, |s, d, _| bf16_decode_kernel(s, d));
    Ok(())
}

/// Encodes `src` as fp8 codes of `format` into `dst`, in parallel, with `rounding` (RNE or seeded
/// stochastic; both saturate, see the [rounding rules](crate::float#rounding-rules)). Element `i`
/// of a stochastic conversion uses random bits derived from `(seed, i)` only.
///
/// # Errors
/// [`Error::ShapeMismatch`] when the lengths differ.
pub fn f32_to_fp8(
    src: &[f32],
    dst: &mut [u8],
    format: Fp8Format,
    rounding: Rounding,
) -> Result<()> {
    encode_fp8(src, dst, format, rounding)
}

/// [`f32_to_fp8`] into any [`Dest`] of fp8 codes (bytes, `float8::F8E4M3`, or room for them).
pub(super) fn encode_fp8<D: Dest<u8>>(
    src: &[f32],
    dst: &mut [D],
    format: Fp8Format,
    rounding: Rounding,
) -> Result<()> {
    check_len("f32 → fp8", src.len(), dst.len())?;
    match (format, rounding) {
        (Fp8Format::E4M3FN, Rounding::Nearest) => {
            par_convert(src, dst, |s, d, _| fp8_rne_kernel::<E4M3FN, D>(s, d))
        }
        (Fp8Format::E5M2, Rounding::Nearest) => {
            par_convert(src, dst, |s, d, _| fp8_rne_kernel::<E5M2, D>(s, d))
        }
        (Fp8Format::E4M3FN, Rounding::Stochastic { seed }) => {
            par_convert(src, dst, |s, d, base| {
                fp8_stochastic_kernel::<E4M3FN, D>(s, d, seed, base)
            })
        }
        (Fp8Format::E5M2, Rounding::Stochastic { seed }) => par_convert(src, dst, |s, d, base| {
            fp8_stochastic_kernel::<E5M2, D>(s, d, seed, base)
        }),
    }
    Ok(())
}

/// Decodes fp8 codes of `format` to `f32` (exact) into `dst`, in parallel.
///
/// # Errors
/// [`Error::ShapeMismatch`] when the lengths differ.
pub fn fp8_to_f32(src: &[u8], dst: &mut [f32], format: Fp8Format) -> Result<()> {
    check_len("fp8 → f32", src.len(), dst.len())?;
    let table = format.table();
    par_convert(src, dst, |s, d, _| fp8_decode_kernel(table, s, d));
    Ok(())
}

/// Decodes `src`, bf16 codes (or f16 ones when `f16`), into `dst` on the calling thread: the
/// values of [`bf16_to_f32`] / [`f16_to_f32`], for a caller that splits the work itself. The
/// lengths must be equal.
pub(super) fn decode_half_serial(src: &[u16], dst: &mut [f32], f16: bool) {
    use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
    debug_assert_eq!(src.len(), dst.len());
    if f16 {
        let halves: &[f16] = src.reinterpret_cast();
        halves.convert_to_f32_slice(dst);
    } else {
        bf16_decode_kernel(src, dst);
    }
}

/// [`round_through`] on the calling thread, through `codes` (a scratch buffer, resized here, for
/// f16; bf16 rounds each value in place).
pub(super) fn round_through_serial(x: &mut [f32], f16: bool, codes: &mut Vec<u16>) {
    use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
    if f16 {
        codes.resize(x.len(), 0);
        f16_encode_kernel::<u16>(x, codes);
        let halves: &[f16] = codes.reinterpret_cast();
        halves.convert_to_f32_slice(x);
    } else {
        bf16_round_through_kernel(x);
    }
}

multiversion! {
    /// Each value becomes the decode of its bf16 encoding: [`bf16_encode_kernel`] then
    /// [`bf16_decode_kernel`], value by value in place.
    fn bf16_round_through_kernel(x: &mut [f32]) {
        for v in x.iter_mut() {
            *v = f32::from_bits(u32::from(bf16_bits(*v)) << 16);
        }
    }
}

/// Rounds `x` through bf16 (or f16 when `f16`) in place: each value becomes the decode of its
/// RNE encoding — the encoders above, so the bits of [`f32_to_bf16`] / [`f32_to_f16`] followed
/// by the exact decode — chunk by chunk in parallel ([`round_through_serial`] on each).
pub(super) fn round_through(x: &mut [f32], f16: bool) {
    x.par_chunks_mut(PAR_CHUNK)
        .for_each_init(Vec::new, |codes, c| round_through_serial(c, f16, codes));
}
