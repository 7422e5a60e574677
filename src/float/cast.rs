//! Slice conversions between `f32` and every storage dtype, into buffers the caller provides, in
//! parallel over [`PAR_CHUNK`]-sized chunks: [`f32_to_f16`] and [`f16_to_f32`] (`half`'s
//! converters), [`f32_to_bf16`] and [`bf16_to_f32`] (our own branch-free kernels, which
//! vectorize), [`f32_to_fp8`] and [`fp8_to_f32`] (the kernels of `fp8.rs` and `stochastic.rs`).

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use rayon::prelude::*;

use super::fp8::{fp8_decode_kernel, fp8_rne_kernel, Fp8Format, E4M3FN, E5M2};
use super::multiversion::multiversion;
use super::stochastic::{fp8_stochastic_kernel, Rounding};
use crate::error::{Error, Result};

/// Number of elements one parallel task converts. Results never depend on it.
pub const PAR_CHUNK: usize = 64 * 1024;

multiversion! {
    fn bf16_encode_kernel(src: &[f32], dst: &mut [u16]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            let bits = s.to_bits();
            // Wraps only for negative NaNs, which the select below replaces.
            let rounded = (bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) >> 16) as u16;
            let nan = ((bits >> 16) | 0x0040) as u16;
            *d = if bits & 0x7FFF_FFFF > 0x7F80_0000 {
                nan
            } else {
                rounded
            };
        }
    }
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

/// Converts `src` to `f16` (RNE; overflow to ±inf) into `dst`, in parallel, with `half`'s
/// hardware-accelerated converter (F16C where present).
///
/// # Errors
/// [`Error::ShapeMismatch`] when the lengths differ; nothing is written then.
pub fn f32_to_f16(src: &[f32], dst: &mut [f16]) -> Result<()> {
    check_len("f32 → f16", src.len(), dst.len())?;
    par_convert(src, dst, |s, d, _| d.convert_from_f32_slice(s));
    Ok(())
}

/// Converts `f16` values to `f32` (exact) into `dst`, in parallel.
///
/// # Errors
/// [`Error::ShapeMismatch`] when the lengths differ.
pub fn f16_to_f32(src: &[f16], dst: &mut [f32]) -> Result<()> {
    check_len("f16 → f32", src.len(), dst.len())?;
    par_convert(src, dst, |s, d, _| s.convert_to_f32_slice(d));
    Ok(())
}

/// Converts `src` to `bf16` (RNE; overflow to ±inf; NaN made quiet) into `dst`, in parallel.
///
/// # Errors
/// [`Error::ShapeMismatch`] when the lengths differ.
pub fn f32_to_bf16(src: &[f32], dst: &mut [bf16]) -> Result<()> {
    check_len("f32 → bf16", src.len(), dst.len())?;
    let dst: &mut [u16] = dst.reinterpret_cast_mut();
    par_convert(src, dst, |s, d, _| bf16_encode_kernel(s, d));
    Ok(())
}

/// Converts `bf16` values to `f32` (exact) into `dst`, in parallel.
///
/// # Errors
/// [`Error::ShapeMismatch`] when the lengths differ.
pub fn bf16_to_f32(src: &[bf16], dst: &mut [f32]) -> Result<()> {
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
    check_len("f32 → fp8", src.len(), dst.len())?;
    match (format, rounding) {
        (Fp8Format::E4M3FN, Rounding::Nearest) => {
            par_convert(src, dst, |s, d, _| fp8_rne_kernel::<E4M3FN>(s, d))
        }
        (Fp8Format::E5M2, Rounding::Nearest) => {
            par_convert(src, dst, |s, d, _| fp8_rne_kernel::<E5M2>(s, d))
        }
        (Fp8Format::E4M3FN, Rounding::Stochastic { seed }) => {
            par_convert(src, dst, |s, d, base| {
                fp8_stochastic_kernel::<E4M3FN>(s, d, seed, base)
            })
        }
        (Fp8Format::E5M2, Rounding::Stochastic { seed }) => par_convert(src, dst, |s, d, base| {
            fp8_stochastic_kernel::<E5M2>(s, d, seed, base)
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
