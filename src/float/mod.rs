//! Storage dtypes and the conversions between them and `f32`.
//!
//! # What this module owns, file by file
//!
//! - `dtype.rs`: [`Dtype`], the storage dtypes a weight can have (`f64`, `f32`, `f16`, `bf16`,
//!   fp8 E4M3FN, fp8 E5M2), their names, sizes, and mappings to candle's
//!   [`DType`](candle_core::DType) and to safetensors' dtype strings;
//! - `fp8.rs`: the two fp8 formats ([`Fp8Format`]), their decode tables and the nearest encoder;
//! - `stochastic.rs`: seeded stochastic rounding to fp8 ([`Rounding::Stochastic`]) and the
//!   counter-based random bits it draws;
//! - `seed.rs`: the seed of a weight, [`weight_seed`] (CRC-32 of its key, [`crc32`]);
//! - `cast.rs`: slice conversions between `f32` and every storage dtype, into buffers the caller
//!   provides (or, through its `Dest` trait, into a new tensor's uninitialized buffer):
//!   [`f32_to_f16`], [`f16_to_f32`], [`f32_to_bf16`], [`bf16_to_f32`], [`f32_to_fp8`],
//!   [`fp8_to_f32`];
//! - `f16c.rs`: the f32 → f16 encoder on the CPU's conversion instruction (AVX-512F or F16C),
//!   picked at run time, with the same bits as the portable one;
//! - `tensor.rs`: the tensor-level helpers the patcher uses, [`to_f32`] and [`from_f32`];
//! - `multiversion.rs`: kernels compiled baseline, with AVX2 and with AVX-512, picked at run time
//!   (the attention kernel's row kernels use it too);
//! - `uniform.rs`: [`uniform_tensor`], deterministic test data for examples, tests and benches.
//!
//! # Storage in candle
//!
//! candle has `F16`, `BF16`, `F32`, `F64` and `F8E4M3` (which *is* E4M3FN: no infinities, NaN is
//! `0x7F`/`0xFF`, largest finite value 448). It has no E5M2 dtype: an E5M2 weight is stored as a
//! candle `U8` tensor holding the raw fp8 bytes, decoded and encoded by this module
//! ([`Dtype::candle_storage_dtype`]). A `U8` tensor says nothing about its format, so callers name
//! the format ([`Dtype::from_candle_storage`]).
//!
//! # Rounding rules
//!
//! - `f16`, `bf16`: round to nearest, ties to even (RNE); overflow goes to ±inf as in IEEE 754;
//!   NaN stays NaN, made quiet (for `f16` keeping the top of its payload, as the F16C
//!   instruction and `half` do). `f16` is encoded by the CPU's conversion instruction where it
//!   has one (AVX-512F or F16C), else by our own branch-free kernel; `bf16` always by ours, which
//!   vectorizes. All give `half`'s bits exactly.
//! - fp8, [`Rounding::Nearest`]: RNE, with subnormals rounded correctly. **Saturating**: every
//!   finite value beyond the largest finite fp8 value, and ±inf, becomes ±max (±448 for E4M3FN,
//!   ±57344 for E5M2). This is what fp8 weight storage wants: an overflow to inf (or to NaN, for
//!   E4M3FN, which has no inf) would poison every matmul that reads the weight. NaN stays NaN
//!   (`0x7F | sign` for E4M3FN, `0x7E | sign` for E5M2). Decoding E5M2 `0x7C`/`0xFC` gives ±inf.
//! - fp8, [`Rounding::Stochastic`]: each value becomes one of its two neighbouring representable
//!   values, the upper one with probability (x − lo) / (hi − lo); exactly representable values and
//!   zero never change; out-of-range values and ±inf saturate to ±max, never NaN; NaN stays NaN.
//!   The mean rounding error over many values tends to zero. In the normal fp8 range the
//!   probability is exact (the dropped mantissa bits are compared against as many random bits); in
//!   the subnormal range it is exact to 2⁻²⁴.
//! - Stochastic rounding is only meaningful for fp8. Asked of `f16`/`bf16`/`f32`/`f64` it falls
//!   back to RNE (those formats keep enough mantissa for patch math).
//!
//! # Determinism
//!
//! The random bits of element `i` of a stochastic conversion are a pure function of the seed and
//! `i` (`stochastic.rs` describes the generator): nothing depends on thread count, chunking or
//! run. The seed of a weight is [`weight_seed`] of its key, so a patched weight re-materialized
//! after an unload comes back bit-identical.
//!
//! # Complexity and parallelism
//!
//! Every conversion is one pass, O(n) in time, with no allocation beyond the output
//! ([`to_f32`]/[`from_f32`] allocate exactly one output buffer; slice functions none). Slices of
//! more than [`PAR_CHUNK`] elements are split into chunks of that size and converted on rayon's
//! global pool. [`from_f32`] encodes straight into the new tensor's uninitialized buffer, so its
//! pages are touched once, by the parallel encode (no zeroing pass first). On x86-64 the kernels
//! are compiled three times, baseline, with AVX2 and with AVX-512, and picked at run time; the
//! variants give the same bits. fp8 decoding reads a 256-entry table built at compile time.
//!
//! # Element types
//!
//! fp8 E4M3FN tensors hold candle's own element type, `float8::F8E4M3` (the crate depends on the
//! `float8` version candle-core does), which the encoders write directly: no reinterpretation of
//! bytes as another type anywhere in this module.

mod cast;
mod dtype;
mod f16c;
mod fp8;
pub(crate) mod multiversion;
mod seed;
mod stochastic;
mod stream;
mod tensor;
#[cfg(test)]
mod tests;
mod uniform;

pub use cast::{
    bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16, f32_to_fp8, fp8_to_f32, PAR_CHUNK,
};
pub use dtype::Dtype;
pub use fp8::Fp8Format;
pub use seed::{crc32, weight_seed};
pub use stochastic::Rounding;
pub(crate) use stochastic::{mix64, GOLDEN};
pub(crate) use tensor::{decode_rows_with, output_buffer, round_through_in_place};
pub use tensor::{from_f32, to_f32};
pub use uniform::uniform_tensor;
