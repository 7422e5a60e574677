//! The tensor-level conversions the patcher uses: [`to_f32`] decodes a CPU tensor of any storage
//! dtype into a new `f32` tensor, [`from_f32`] encodes one back, each with exactly one output
//! allocation (huge-page backed when large; [`from_f32`]'s is never zeroed first).

use std::mem::MaybeUninit;

use candle_core::{CpuStorage, DType, Device, Storage, Tensor};
use float8::F8E4M3;
use half::{bf16, f16};

use super::cast::{
    bf16_to_f32, encode_bf16, encode_f16, encode_fp8, f16_to_f32, fp8_to_f32, par_convert, Dest,
};
use super::{Dtype, Fp8Format, Rounding};
use crate::error::{Error, Result, TensorContext};

/// Buffers at least this large are backed by transparent huge pages where the kernel offers them.
const HUGE_PAGE_MIN: usize = 4 << 20;

/// Asks the kernel to back the first `n` elements of `v`'s allocation with transparent huge pages
/// and to fault them in at once, before anything touches them.
///
/// A large allocation is fresh memory from the kernel each time (glibc maps anything over 32 MiB
/// anew and unmaps it on free), so filling it takes one page fault per 4 KiB page — about as
/// long as the conversion itself for a 4096² weight, and slower still when two threads fault the
/// same mapping. Buffers of at least 4 MiB are therefore advised to use transparent huge pages
/// (`MADV_HUGEPAGE`: one fault per 2 MiB where THP is on) and populated in one call
/// (`MADV_POPULATE_WRITE`, Linux 5.14+); both are hints, ignored where unsupported.
fn advise_huge_pages<T>(v: &mut Vec<T>, n: usize) {
    let bytes = n.saturating_mul(std::mem::size_of::<T>());
    #[cfg(target_os = "linux")]
    if bytes >= HUGE_PAGE_MIN && v.capacity() >= n {
        const PAGE: usize = 4096;
        let start = v.as_mut_ptr() as usize;
        let first = start.next_multiple_of(PAGE);
        let end = (start + bytes) / PAGE * PAGE;
        if end > first {
            // SAFETY: `[first, end)` lies inside `v`'s allocation (page-aligned inward; the
            // capacity covers `n` elements), which the caller owns and has not touched;
            // MADV_HUGEPAGE only changes how the kernel backs those pages and
            // MADV_POPULATE_WRITE only faults them in (zero-filled, as a first write would),
            // never changing what the program can observe; failure is harmless (ignored; older
            // kernels lack MADV_POPULATE_WRITE).
            unsafe {
                libc::madvise(first as *mut libc::c_void, end - first, libc::MADV_HUGEPAGE);
                libc::madvise(
                    first as *mut libc::c_void,
                    end - first,
                    libc::MADV_POPULATE_WRITE,
                );
            }
        }
    }
    let _ = (v, bytes);
}

/// A zeroed buffer of `n` elements for a decode's output (or any large buffer about to be
/// filled: the streaming merge reads weights into them), huge-page backed when large.
pub(crate) fn output_buffer<T: Copy + Default>(n: usize) -> Vec<T> {
    let mut v: Vec<T> = Vec::with_capacity(n);
    advise_huge_pages(&mut v, n);
    v.resize(n, T::default());
    v
}

/// A new buffer of `n` elements filled by `encode`, which must write every one of them through
/// its [`Dest`] (the encoders of `cast.rs` do: they check that source and destination lengths
/// are equal and write each destination element once). The buffer is not zeroed first, so its
/// pages are first touched by the parallel encode itself.
fn encoded<T: Send>(
    n: usize,
    encode: impl FnOnce(&mut [MaybeUninit<T>]) -> Result<()>,
) -> Result<Vec<T>> {
    let mut v: Vec<T> = Vec::with_capacity(n);
    advise_huge_pages(&mut v, n);
    encode(&mut v.spare_capacity_mut()[..n])?;
    // SAFETY: the capacity is at least `n`, and `encode` returned Ok, which for every caller in
    // this file means it wrote all `n` elements (see above), so they are initialized.
    unsafe { v.set_len(n) };
    Ok(v)
}

fn storage_mismatch(t: &Tensor, dtype: Dtype, what: &str) -> Error {
    Error::UnsupportedDtype {
        dtype: t.dtype().as_str().into(),
        what: format!(
            "{what} as {dtype}: the tensor's candle dtype must be {}",
            dtype.candle_storage_dtype().as_str()
        ),
    }
}

/// The contiguous element range of `t`'s storage, or `None` when `t` is strided.
fn contiguous_range(t: &Tensor) -> Option<std::ops::Range<usize>> {
    let (_, layout) = t.storage_and_layout();
    layout.contiguous_offsets().map(|(start, end)| start..end)
}

/// Calls `f` with the contiguous CPU data of `t` (copied to a contiguous layout first only when
/// `t` is strided).
fn with_cpu_data<R>(
    t: &Tensor,
    f: impl FnOnce(&CpuStorage, std::ops::Range<usize>) -> Result<R>,
) -> Result<R> {
    let owned;
    let t = match contiguous_range(t) {
        Some(_) => t,
        None => {
            owned = t
                .contiguous()
                .ctx(|| "making a strided tensor contiguous for a dtype conversion".into())?;
            &owned
        }
    };
    let range = contiguous_range(t).ok_or_else(|| Error::ShapeMismatch {
        what: "a contiguous copy of a tensor".into(),
        expected: t.dims().to_vec(),
        got: t.stride().to_vec(),
    })?;
    let (storage, _) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(cpu) => f(cpu, range),
        _ => Err(Error::Device {
            device: format!("{:?}", t.device().location()),
            reason: "the fast dtype conversions read CPU tensors only".into(),
        }),
    }
}

/// Decodes a CPU tensor stored as `dtype` into a new contiguous `f32` tensor of the same shape.
///
/// `dtype` says how to read the storage: the tensor's candle dtype must be
/// [`Dtype::candle_storage_dtype`] of it (`U8` bytes for [`Dtype::F8E5M2`]). An `F32` tensor is
/// returned as is (a cheap clone sharing storage). Strided tensors are made contiguous first
/// (one extra copy). Uses this module's parallel slice converters, not candle's `to_dtype`.
///
/// Non-CPU tensors of dtypes candle can cast itself (`f64`, `f16`, `bf16`, `F8E4M3`) go through
/// candle's `to_dtype` on their device.
///
/// # Errors
/// [`Error::UnsupportedDtype`] when the tensor's candle dtype does not match `dtype`;
/// [`Error::Device`] for fp8 E5M2 bytes on a non-CPU device; [`Error::Tensor`] when candle fails.
pub fn to_f32(t: &Tensor, dtype: Dtype) -> Result<Tensor> {
    if t.dtype() != dtype.candle_storage_dtype() {
        return Err(storage_mismatch(t, dtype, "decoding to f32"));
    }
    if dtype == Dtype::F32 {
        return Ok(t.clone());
    }
    if !t.device().is_cpu() && dtype != Dtype::F8E5M2 {
        return t.to_dtype(DType::F32).ctx(|| {
            format!(
                "casting a {dtype} tensor to f32 on {:?}",
                t.device().location()
            )
        });
    }
    let shape = t.shape().clone();
    let out = with_cpu_data(t, |cpu, range| {
        let mut out = output_buffer::<f32>(range.len());
        match (cpu, dtype) {
            (CpuStorage::F16(v), Dtype::F16) => f16_to_f32(&v[range], &mut out)?,
            (CpuStorage::BF16(v), Dtype::BF16) => bf16_to_f32(&v[range], &mut out)?,
            (CpuStorage::F64(v), Dtype::F64) => {
                let src = &v[range];
                par_convert(src, &mut out, |s, d, _| {
                    d.iter_mut().zip(s).for_each(|(d, &s)| *d = s as f32)
                });
            }
            (CpuStorage::U8(v), Dtype::F8E5M2) => fp8_to_f32(&v[range], &mut out, Fp8Format::E5M2)?,
            (CpuStorage::F8E4M3(v), Dtype::F8E4M3FN) => {
                let src = &v[range];
                let table = Fp8Format::E4M3FN.table();
                par_convert(src, &mut out, |s, d, _| {
                    d.iter_mut()
                        .zip(s)
                        .for_each(|(d, s)| *d = table[usize::from(s.to_bits())])
                });
            }
            _ => return Err(storage_mismatch(t, dtype, "decoding to f32")),
        }
        Ok(out)
    })?;
    Tensor::from_vec(out, shape, &Device::Cpu)
        .ctx(|| format!("building the f32 tensor decoded from {dtype}"))
}

/// Encodes a CPU `f32` tensor into a new contiguous CPU tensor in storage form for `dtype`
/// (candle `F16`, `BF16`, `F8E4M3`, `U8` bytes for E5M2, `F32`, `F64`), same shape.
///
/// Rounding: `f16`/`bf16` always RNE (a [`Rounding::Stochastic`] request falls back to RNE); fp8
/// RNE for [`Rounding::Nearest`], seeded stochastic rounding for [`Rounding::Stochastic`] (the
/// [rounding rules](crate::float#rounding-rules) give the contract; element indices are row-major
/// over the tensor). An `F32` target returns the tensor as is (a cheap clone). Strided inputs are
/// made contiguous first.
///
/// # Errors
/// [`Error::UnsupportedDtype`] when `t` is not `f32`; [`Error::Device`] when it is not on the
/// CPU; [`Error::Tensor`] when candle fails.
pub fn from_f32(t: &Tensor, dtype: Dtype, rounding: Rounding) -> Result<Tensor> {
    if t.dtype() != DType::F32 {
        return Err(storage_mismatch(
            t,
            Dtype::F32,
            &format!("encoding to {dtype}"),
        ));
    }
    if dtype == Dtype::F32 {
        return Ok(t.clone());
    }
    let shape = t.shape().clone();
    let ctx = || format!("building the {dtype} tensor encoded from f32");
    with_cpu_data(t, |cpu, range| {
        let CpuStorage::F32(v) = cpu else {
            return Err(storage_mismatch(
                t,
                Dtype::F32,
                &format!("encoding to {dtype}"),
            ));
        };
        let src = &v[range];
        let n = src.len();
        match dtype {
            Dtype::F32 => Tensor::from_slice(src, shape, &Device::Cpu).ctx(ctx),
            Dtype::F64 => {
                let out = encoded::<f64>(n, |d| {
                    par_convert(src, d, |s, d, _| {
                        d.iter_mut().zip(s).for_each(|(d, &s)| d.put(f64::from(s)))
                    });
                    Ok(())
                })?;
                Tensor::from_vec(out, shape, &Device::Cpu).ctx(ctx)
            }
            Dtype::F16 => {
                let out = encoded::<f16>(n, |d| encode_f16(src, d))?;
                Tensor::from_vec(out, shape, &Device::Cpu).ctx(ctx)
            }
            Dtype::BF16 => {
                let out = encoded::<bf16>(n, |d| encode_bf16(src, d))?;
                Tensor::from_vec(out, shape, &Device::Cpu).ctx(ctx)
            }
            Dtype::F8E5M2 => {
                let out = encoded::<u8>(n, |d| encode_fp8(src, d, Fp8Format::E5M2, rounding))?;
                Tensor::from_vec(out, shape, &Device::Cpu).ctx(ctx)
            }
            Dtype::F8E4M3FN => {
                let out =
                    encoded::<F8E4M3>(n, |d| encode_fp8(src, d, Fp8Format::E4M3FN, rounding))?;
                Tensor::from_vec(out, shape, &Device::Cpu).ctx(ctx)
            }
        }
    })
}

/// Decodes `t`, a CPU tensor stored as `dtype` (bf16, f16 or f32), into a new `f32` tensor a
/// block of whole rows at a time, in parallel, handing each block to `then(first_row, block)`
/// while it is in cache (`block` holds its rows' values, `row_len` each), and afterwards rounding
/// it through `dtype` when `round` is set (nearest-even; nothing to do for f32). The values are
/// [`to_f32`]'s, `then`'s, then [`round_through_in_place`]'s — in one pass over memory instead
/// of three. `None` (nothing done) for another dtype, a non-CPU or strided tensor, or rows that
/// do not divide it.
pub(crate) fn decode_rows_with(
    t: &Tensor,
    dtype: Dtype,
    row_len: usize,
    block_rows: usize,
    round: bool,
    then: impl Fn(usize, &mut [f32]) + Sync,
) -> Result<Option<Tensor>> {
    use rayon::prelude::*;
    if t.dtype() != dtype.candle_storage_dtype()
        || !t.device().is_cpu()
        || !matches!(dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32)
        || contiguous_range(t).is_none()
        || row_len == 0
        || !t.elem_count().is_multiple_of(row_len)
    {
        return Ok(None);
    }
    let shape = t.shape().clone();
    let block = row_len * block_rows.max(1);
    let out = with_cpu_data(t, |cpu, range| {
        use half::slice::HalfFloatSliceExt;
        type Decode<'a> = Box<dyn Fn(usize, &mut [f32]) + Sync + 'a>;
        fn half(codes: &[u16], f16: bool) -> Decode<'_> {
            Box::new(move |at, dst: &mut [f32]| {
                super::cast::decode_half_serial(&codes[at..at + dst.len()], dst, f16)
            })
        }
        let decode: Decode<'_> = match cpu {
            CpuStorage::BF16(v) => half(v[range.clone()].reinterpret_cast(), false),
            CpuStorage::F16(v) => half(v[range.clone()].reinterpret_cast(), true),
            CpuStorage::F32(v) => {
                let src = &v[range.clone()];
                Box::new(move |at, dst: &mut [f32]| dst.copy_from_slice(&src[at..at + dst.len()]))
            }
            _ => return Err(storage_mismatch(t, dtype, "decoding to f32")),
        };
        let mut out = output_buffer::<f32>(range.len());
        out.par_chunks_mut(block)
            .enumerate()
            .for_each_init(Vec::new, |codes, (i, dst)| {
                decode(i * block, dst);
                then(i * block_rows.max(1), dst);
                if round && dtype != Dtype::F32 {
                    super::cast::round_through_serial(dst, dtype == Dtype::F16, codes);
                }
            });
        Ok(out)
    })?;
    Tensor::from_vec(out, shape, &Device::Cpu)
        .map(Some)
        .ctx(|| format!("building the f32 tensor decoded from {dtype}"))
}

/// Rounds a contiguous CPU `f32` tensor through `dtype` in place: every value becomes
/// `to_f32(from_f32(x))` with [`from_f32`]'s nearest-even rounding (its own encoders), without
/// either conversion's buffer. Only for bf16 and f16; says whether it
/// applied (`false`: another dtype, or not a contiguous CPU `f32` tensor — nothing was changed).
/// The caller must own `t`'s storage: every handle sharing it sees the rounding.
pub(crate) fn round_through_in_place(t: &Tensor, dtype: Dtype) -> Result<bool> {
    if t.dtype() != DType::F32
        || !t.device().is_cpu()
        || !matches!(dtype, Dtype::BF16 | Dtype::F16)
        || contiguous_range(t).is_none()
    {
        return Ok(false);
    }
    t.inplace_op1(&RoundThrough(dtype))
        .ctx(|| format!("rounding an f32 tensor through {dtype} in place"))?;
    Ok(true)
}

/// The in-place op of [`round_through_in_place`].
struct RoundThrough(Dtype);

impl candle_core::InplaceOp1 for RoundThrough {
    fn name(&self) -> &'static str {
        "round-through"
    }

    fn cpu_fwd(
        &self,
        storage: &mut CpuStorage,
        layout: &candle_core::Layout,
    ) -> candle_core::Result<()> {
        let CpuStorage::F32(v) = storage else {
            candle_core::bail!("round-through: the tensor must be f32");
        };
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("round-through: the tensor must be contiguous");
        };
        super::cast::round_through(&mut v[start..end], self.0 == Dtype::F16);
        Ok(())
    }
}
