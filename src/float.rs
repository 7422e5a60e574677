//! Storage dtypes and the conversions between them and `f32`.
//!
//! # What this module owns
//!
//! - [`Dtype`], the storage dtypes a weight can have (`f64`, `f32`, `f16`, `bf16`, fp8 E4M3FN,
//!   fp8 E5M2), their names, sizes, and mappings to candle's [`DType`] and to safetensors' dtype
//!   strings;
//! - slice conversions between `f32` and every storage dtype, into buffers the caller provides:
//!   [`f32_to_f16`], [`f16_to_f32`], [`f32_to_bf16`], [`bf16_to_f32`], [`f32_to_fp8`],
//!   [`fp8_to_f32`];
//! - seeded stochastic rounding to fp8 ([`Rounding::Stochastic`]) and the seed of a weight,
//!   [`weight_seed`] (CRC-32 of its key, [`crc32`]);
//! - the tensor-level helpers the patcher uses: [`to_f32`] and [`from_f32`].
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
//!   NaN stays NaN (bf16 NaNs are made quiet). `f16` goes through `half`'s converters (F16C on
//!   x86-64 where present); `bf16` uses our own branch-free RNE kernel, which vectorizes.
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
//! Stochastic rounding draws its randomness from a counter-based generator: the 32 random bits of
//! element `i` are a pure function of `(seed, i)`: two keys are derived from the seed and the
//! high word of `i` with splitmix64's finalizer, then the low word of `i` goes through two keyed
//! rounds of a 32-bit integer hash (`lowbias32`), which vectorizes. Nothing depends on thread
//! count, chunking or run: the same seed and input give the same bits everywhere. The seed of a weight is [`weight_seed`] of its key, so a patched
//! weight re-materialized after an unload comes back bit-identical.
//!
//! # Complexity and parallelism
//!
//! Every conversion is one pass, O(n) in time, with no allocation beyond the output
//! ([`to_f32`]/[`from_f32`] allocate exactly one output buffer; slice functions none). Slices of
//! more than [`PAR_CHUNK`] elements are split into chunks of that size and converted on rayon's
//! global pool. On x86-64 the kernels are compiled twice, once baseline and once with AVX2, and
//! picked at run time. fp8 decoding reads a 256-entry table built at compile time.

use std::fmt;
use std::str::FromStr;

use candle_core::{CpuStorage, DType, Device, Storage, Tensor, WithDType};
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use rayon::prelude::*;

use crate::error::{Error, Result, TensorContext};
use crate::size::ByteSize;

/// Number of elements one parallel task converts. Results never depend on it.
pub const PAR_CHUNK: usize = 64 * 1024;

// ---------------------------------------------------------------------------------------------
// Dtype
// ---------------------------------------------------------------------------------------------

/// A storage dtype of a weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// IEEE 754 binary64.
    F64,
    /// IEEE 754 binary32.
    F32,
    /// IEEE 754 binary16.
    F16,
    /// bfloat16: the top half of an `f32`.
    BF16,
    /// fp8 with 4 exponent bits, 3 mantissa bits, bias 7, no infinities ("FN"); NaN is
    /// `0x7F`/`0xFF`; largest finite value 448. candle's `F8E4M3`.
    F8E4M3FN,
    /// fp8 with 5 exponent bits, 2 mantissa bits, bias 15, IEEE-style inf and NaN; largest finite
    /// value 57344. Stored in candle as `U8` bytes.
    F8E5M2,
}

impl Dtype {
    /// Every dtype, widest first.
    pub const ALL: [Dtype; 6] = [
        Dtype::F64,
        Dtype::F32,
        Dtype::F16,
        Dtype::BF16,
        Dtype::F8E4M3FN,
        Dtype::F8E5M2,
    ];

    /// Bytes per element.
    pub const fn size_in_bytes(self) -> usize {
        match self {
            Dtype::F64 => 8,
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::BF16 => 2,
            Dtype::F8E4M3FN | Dtype::F8E5M2 => 1,
        }
    }

    /// Bytes that `numel` elements take in this dtype (saturating).
    pub const fn storage_size(self, numel: u64) -> ByteSize {
        ByteSize(numel.saturating_mul(self.size_in_bytes() as u64))
    }

    /// Whether every value of this dtype is exactly a value of `to`, so a cast to `to` never
    /// rounds and gives the same bits wherever it runs (host or GPU). E5M2 is left out: candle
    /// stores it as `u8`, and only the host decodes it.
    pub const fn widens_exactly_to(self, to: Dtype) -> bool {
        matches!(
            (self, to),
            (
                Dtype::F16 | Dtype::BF16 | Dtype::F8E4M3FN,
                Dtype::F32 | Dtype::F64
            ) | (Dtype::F32, Dtype::F64)
                | (Dtype::F8E4M3FN, Dtype::F16 | Dtype::BF16)
        )
    }

    /// Whether this is one of the fp8 formats.
    pub const fn is_fp8(self) -> bool {
        matches!(self, Dtype::F8E4M3FN | Dtype::F8E5M2)
    }

    /// The fp8 format, for the fp8 dtypes.
    pub const fn fp8_format(self) -> Option<Fp8Format> {
        match self {
            Dtype::F8E4M3FN => Some(Fp8Format::E4M3FN),
            Dtype::F8E5M2 => Some(Fp8Format::E5M2),
            _ => None,
        }
    }

    /// The canonical lower-case name: `f64`, `f32`, `f16`, `bf16`, `fp8_e4m3fn`, `fp8_e5m2`.
    /// [`FromStr`] accepts it back.
    pub const fn name(self) -> &'static str {
        match self {
            Dtype::F64 => "f64",
            Dtype::F32 => "f32",
            Dtype::F16 => "f16",
            Dtype::BF16 => "bf16",
            Dtype::F8E4M3FN => "fp8_e4m3fn",
            Dtype::F8E5M2 => "fp8_e5m2",
        }
    }

    /// The candle dtype a tensor of this dtype is stored as. `F8E5M2` is stored as `U8` bytes
    /// (candle has no E5M2); `F8E4M3FN` as candle's `F8E4M3`.
    pub const fn candle_storage_dtype(self) -> DType {
        match self {
            Dtype::F64 => DType::F64,
            Dtype::F32 => DType::F32,
            Dtype::F16 => DType::F16,
            Dtype::BF16 => DType::BF16,
            Dtype::F8E4M3FN => DType::F8E4M3,
            Dtype::F8E5M2 => DType::U8,
        }
    }

    /// The dtype of a candle tensor. `U8` is raw bytes and means an fp8 format only when the
    /// caller says which: `u8_as` must then be `Some(Dtype::F8E5M2)` (or `Some(Dtype::F8E4M3FN)`
    /// for E4M3FN bytes kept as `U8`). Any other candle dtype ignores `u8_as`.
    ///
    /// # Errors
    /// [`Error::UnsupportedDtype`] for integer dtypes, candle's sub-byte formats, and `U8` without
    /// an fp8 `u8_as`.
    pub fn from_candle_storage(dtype: DType, u8_as: Option<Dtype>) -> Result<Self> {
        match (dtype, u8_as) {
            (DType::U8, Some(d)) if d.is_fp8() => Ok(d),
            (DType::U8, _) => Err(Error::UnsupportedDtype {
                dtype: "u8".into(),
                what: "reading a weight: raw u8 bytes need an fp8 format (pass Dtype::F8E5M2)"
                    .into(),
            }),
            (dtype, _) => Dtype::try_from(dtype),
        }
    }

    /// The dtype from a safetensors header dtype string: `F64`, `F32`, `F16`, `BF16`, `F8_E4M3`
    /// (which is E4M3FN), `F8_E5M2`.
    ///
    /// # Errors
    /// [`Error::UnsupportedDtype`] for any other string (integer, FNUZ and sub-byte formats).
    pub fn from_safetensors(s: &str) -> Result<Self> {
        match s {
            "F64" => Ok(Dtype::F64),
            "F32" => Ok(Dtype::F32),
            "F16" => Ok(Dtype::F16),
            "BF16" => Ok(Dtype::BF16),
            "F8_E4M3" => Ok(Dtype::F8E4M3FN),
            "F8_E5M2" => Ok(Dtype::F8E5M2),
            other => Err(Error::UnsupportedDtype {
                dtype: other.into(),
                what: "a weight from safetensors (expected F64, F32, F16, BF16, F8_E4M3, F8_E5M2)"
                    .into(),
            }),
        }
    }

    /// The safetensors header dtype string ([`Dtype::from_safetensors`] reads it back).
    pub const fn safetensors_name(self) -> &'static str {
        match self {
            Dtype::F64 => "F64",
            Dtype::F32 => "F32",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::F8E4M3FN => "F8_E4M3",
            Dtype::F8E5M2 => "F8_E5M2",
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Dtype {
    type Err = Error;

    /// Parses a dtype name, case-insensitively: the canonical [`Dtype::name`]s and the usual
    /// aliases (`float32`/`fp32`, `float16`/`fp16`/`half`, `bfloat16`, `float8_e4m3fn`/`f8e4m3`,
    /// `float8_e5m2`/`f8e5m2`, `float64`/`double`, ...).
    fn from_str(s: &str) -> Result<Self> {
        let lower = s.trim().to_ascii_lowercase();
        let dtype = match lower.as_str() {
            "f64" | "fp64" | "float64" | "double" => Dtype::F64,
            "f32" | "fp32" | "float32" | "float" => Dtype::F32,
            "f16" | "fp16" | "float16" | "half" => Dtype::F16,
            "bf16" | "bfloat16" => Dtype::BF16,
            "fp8_e4m3fn" | "float8_e4m3fn" | "f8_e4m3fn" | "f8e4m3fn" | "f8e4m3" | "f8_e4m3"
            | "e4m3fn" | "e4m3" => Dtype::F8E4M3FN,
            "fp8_e5m2" | "float8_e5m2" | "f8_e5m2" | "f8e5m2" | "e5m2" => Dtype::F8E5M2,
            _ => {
                return Err(Error::UnsupportedDtype {
                    dtype: s.into(),
                    what: "a dtype name (expected f32, f16, bf16, fp8_e4m3fn, fp8_e5m2 or f64)"
                        .into(),
                })
            }
        };
        Ok(dtype)
    }
}

impl TryFrom<DType> for Dtype {
    type Error = Error;

    /// candle's float dtypes map one to one (`F8E4M3` is E4M3FN). `U8` is refused: say which fp8
    /// format the bytes are with [`Dtype::from_candle_storage`].
    fn try_from(dtype: DType) -> Result<Self> {
        match dtype {
            DType::F64 => Ok(Dtype::F64),
            DType::F32 => Ok(Dtype::F32),
            DType::F16 => Ok(Dtype::F16),
            DType::BF16 => Ok(Dtype::BF16),
            DType::F8E4M3 => Ok(Dtype::F8E4M3FN),
            DType::U8 => Err(Error::UnsupportedDtype {
                dtype: "u8".into(),
                what: "a weight: raw u8 bytes need an fp8 format (Dtype::from_candle_storage)"
                    .into(),
            }),
            other => Err(Error::UnsupportedDtype {
                dtype: other.as_str().into(),
                what: "a weight (expected f64, f32, f16, bf16 or f8e4m3)".into(),
            }),
        }
    }
}

impl From<Fp8Format> for Dtype {
    fn from(format: Fp8Format) -> Self {
        match format {
            Fp8Format::E4M3FN => Dtype::F8E4M3FN,
            Fp8Format::E5M2 => Dtype::F8E5M2,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Rounding
// ---------------------------------------------------------------------------------------------

/// How [`from_f32`] and [`f32_to_fp8`] round values that the target dtype cannot hold exactly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Rounding {
    /// Round to nearest, ties to even. fp8 saturates to ±max (see the module docs).
    #[default]
    Nearest,
    /// Seeded stochastic rounding for fp8 (see the module docs for the contract). For the other
    /// dtypes it is the same as [`Rounding::Nearest`].
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

// ---------------------------------------------------------------------------------------------
// CRC-32 and weight seeds
// ---------------------------------------------------------------------------------------------

const fn crc32_table() -> [u32; 256] {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 {
                0xEDB8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
            k += 1;
        }
        table[i] = c;
        i += 1;
    }
    table
}

static CRC32_TABLE: [u32; 256] = crc32_table();

/// CRC-32 (IEEE 802.3, reflected polynomial `0xEDB88320`; the zlib/PNG/`binascii.crc32` one) of
/// `bytes`. Table-driven, one table lookup per byte.
pub fn crc32(bytes: &[u8]) -> u32 {
    let mut c = !0u32;
    for &b in bytes {
        c = CRC32_TABLE[((c ^ u32::from(b)) & 0xFF) as usize] ^ (c >> 8);
    }
    !c
}

/// The stochastic-rounding seed of a weight: the CRC-32 of its key's UTF-8 bytes
/// (`"a"` → 3904355907, `""` → 0).
pub fn weight_seed(key: &str) -> u64 {
    u64::from(crc32(key.as_bytes()))
}

// ---------------------------------------------------------------------------------------------
// fp8 formats
// ---------------------------------------------------------------------------------------------

/// One of the two fp8 formats, for the scalar codec and the slice functions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fp8Format {
    /// 4 exponent bits, 3 mantissa bits, bias 7, no inf; max 448; NaN `0x7F`.
    E4M3FN,
    /// 5 exponent bits, 2 mantissa bits, bias 15, IEEE inf/NaN; max 57344.
    E5M2,
}

impl Fp8Format {
    /// The largest finite value: 448 (E4M3FN) or 57344 (E5M2).
    pub const fn max(self) -> f32 {
        match self {
            Fp8Format::E4M3FN => 448.0,
            Fp8Format::E5M2 => 57344.0,
        }
    }

    /// The smallest positive normal value: 2⁻⁶ (E4M3FN) or 2⁻¹⁴ (E5M2).
    pub const fn min_positive_normal(self) -> f32 {
        match self {
            Fp8Format::E4M3FN => E4M3FN::MIN_NORMAL,
            Fp8Format::E5M2 => E5M2::MIN_NORMAL,
        }
    }

    /// The code of `+NaN` this module writes (`0x7F` for E4M3FN, `0x7E` for E5M2); the sign bit
    /// of the input is kept.
    pub const fn nan_code(self) -> u8 {
        match self {
            Fp8Format::E4M3FN => E4M3FN::NAN_CODE as u8,
            Fp8Format::E5M2 => E5M2::NAN_CODE as u8,
        }
    }

    /// Encodes one value with round-to-nearest-even and saturation (see the module docs).
    #[inline]
    pub fn encode(self, x: f32) -> u8 {
        match self {
            Fp8Format::E4M3FN => encode_rne::<E4M3FN>(x),
            Fp8Format::E5M2 => encode_rne::<E5M2>(x),
        }
    }

    /// Decodes one fp8 code (table lookup).
    #[inline]
    pub fn decode(self, code: u8) -> f32 {
        self.table()[usize::from(code)]
    }

    /// The 256-entry decode table, indexed by code.
    pub fn table(self) -> &'static [f32; 256] {
        match self {
            Fp8Format::E4M3FN => &E4M3FN_TABLE,
            Fp8Format::E5M2 => &E5M2_TABLE,
        }
    }
}

impl fmt::Display for Fp8Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&Dtype::from(*self), f)
    }
}

/// Compile-time description of an fp8 format; the kernels are generic over it so every constant
/// folds.
trait Format {
    /// Mantissa bits.
    const M: u32;
    /// Exponent bias.
    const BIAS: i32;
    /// Code of the largest finite magnitude.
    const MAX_CODE: u32;
    /// Code of +NaN written on encode.
    const NAN_CODE: u32;
    /// Whether the all-ones exponent holds inf (`mantissa == 0`) and NaNs (IEEE style).
    const IEEE_SPECIALS: bool;
    /// Smallest positive normal value.
    const MIN_NORMAL: f32;

    /// Exponent of the smallest normal, 1 - bias.
    const EMIN: i32 = 1 - Self::BIAS;
    /// f32 bits dropped when rounding a normal value.
    const SHIFT: u32 = 23 - Self::M;
    /// What to subtract from `abs_bits >> SHIFT` to move from f32's bias to ours.
    const REBIAS: u32 = ((127 - Self::BIAS) as u32) << Self::M;
    /// f32 bits of the smallest normal.
    const MIN_NORMAL_BITS: u32 = ((Self::EMIN + 127) as u32) << 23;
    /// 2^(EMIN - M + 23): adding it to a subnormal-range magnitude rounds it (RNE, in the FPU) to
    /// a multiple of the fp8 subnormal step.
    const SUB_MAGIC: f32 = f32::from_bits(((Self::EMIN - Self::M as i32 + 23 + 127) as u32) << 23);
    /// 2^(M - EMIN): scales a subnormal-range magnitude to units of the subnormal step, exactly.
    const SUB_SCALE: f32 = f32::from_bits(((Self::M as i32 - Self::EMIN + 127) as u32) << 23);
}

struct E4M3FN;
impl Format for E4M3FN {
    const M: u32 = 3;
    const BIAS: i32 = 7;
    const MAX_CODE: u32 = 0x7E;
    const NAN_CODE: u32 = 0x7F;
    const IEEE_SPECIALS: bool = false;
    const MIN_NORMAL: f32 = 0.015625;
}

struct E5M2;
impl Format for E5M2 {
    const M: u32 = 2;
    const BIAS: i32 = 15;
    const MAX_CODE: u32 = 0x7B;
    const NAN_CODE: u32 = 0x7E;
    const IEEE_SPECIALS: bool = true;
    const MIN_NORMAL: f32 = 6.103_515_6e-5;
}

const fn decode_table<F: Format>() -> [f32; 256] {
    let mut table = [0f32; 256];
    let mut code = 0u32;
    let max_exp = (1u32 << (7 - F::M)) - 1;
    while code < 256 {
        let sign = (code >> 7) << 31;
        let exp = (code >> F::M) & max_exp;
        let man = code & ((1 << F::M) - 1);
        let magnitude = if exp == 0 {
            // Subnormal: man * 2^(EMIN - M), exact in f32.
            man as f32 / F::SUB_SCALE
        } else if F::IEEE_SPECIALS && exp == max_exp {
            if man == 0 {
                f32::INFINITY
            } else {
                f32::NAN
            }
        } else if !F::IEEE_SPECIALS && exp == max_exp && man == (1 << F::M) - 1 {
            f32::NAN
        } else {
            f32::from_bits((((exp as i32 - F::BIAS + 127) as u32) << 23) | (man << (23 - F::M)))
        };
        table[code as usize] = f32::from_bits(magnitude.to_bits() | sign);
        code += 1;
    }
    table
}

static E4M3FN_TABLE: [f32; 256] = decode_table::<E4M3FN>();
static E5M2_TABLE: [f32; 256] = decode_table::<E5M2>();

/// Branch-free RNE, saturating fp8 encode.
#[inline(always)]
fn encode_rne<F: Format>(x: f32) -> u8 {
    let bits = x.to_bits();
    let sign = (bits >> 24) & 0x80;
    let abs = bits & 0x7FFF_FFFF;
    // Normal range: round the dropped bits to nearest even in the integer domain; a carry moves
    // into the exponent, which is what rounding up to the next binade needs.
    let rounded = abs + ((1 << (F::SHIFT - 1)) - 1) + ((abs >> F::SHIFT) & 1);
    let normal = (rounded >> F::SHIFT).wrapping_sub(F::REBIAS);
    // Subnormal range: the FPU's own RNE, at the fp8 subnormal step.
    let sub = (f32::from_bits(abs) + F::SUB_MAGIC)
        .to_bits()
        .wrapping_sub(F::SUB_MAGIC.to_bits());
    let code = if abs < F::MIN_NORMAL_BITS {
        sub
    } else {
        normal
    };
    let code = code.min(F::MAX_CODE);
    let code = if abs > 0x7F80_0000 { F::NAN_CODE } else { code };
    (code | sign) as u8
}

/// Branch-free stochastic, saturating fp8 encode with 32 random bits `r`.
#[inline(always)]
fn encode_stochastic<F: Format>(x: f32, r: u32) -> u8 {
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
    // every lane that is selected.
    let lo = scaled as i32;
    let frac = scaled - lo as f32;
    let uniform = ((r >> 8) as i32) as f32 * (1.0 / 16_777_216.0);
    let lo = lo as u32;
    // `lo` saturates for lanes outside the subnormal range, which are not selected.
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

// ---------------------------------------------------------------------------------------------
// Counter-based random bits
// ---------------------------------------------------------------------------------------------

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// splitmix64's finalizer: a 64-bit bijection with full avalanche.
#[inline(always)]
fn mix64(mut z: u64) -> u64 {
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
fn element_bits(seed: u64, index: u64) -> u32 {
    keyed_bits(block_keys(seed, (index >> 32) as u32), index as u32)
}

// ---------------------------------------------------------------------------------------------
// Kernels (one chunk, one thread)
// ---------------------------------------------------------------------------------------------

/// Whether the AVX2 variants of the kernels may run on this CPU (std caches the probe).
#[inline(always)]
fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Defines a kernel compiled twice: baseline and with AVX2/FMA/F16C enabled (so its loop
/// vectorizes 8 lanes wide), the variant picked at run time. The body is written once, as plain
/// branch-free scalar code.
macro_rules! multiversion {
    (
        $(#[$meta:meta])*
        fn $name:ident $(<$g:ident: $bound:path>)? ($($arg:ident: $ty:ty),* $(,)?) $body:block
    ) => {
        $(#[$meta])*
        fn $name $(<$g: $bound>)? ($($arg: $ty),*) {
            #[inline(always)]
            fn portable $(<$g: $bound>)? ($($arg: $ty),*) $body

            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma,f16c")]
            fn avx2 $(<$g: $bound>)? ($($arg: $ty),*) {
                portable $(::<$g>)? ($($arg),*)
            }

            #[cfg(target_arch = "x86_64")]
            if has_avx2() {
                // SAFETY: `avx2` requires only that the CPU supports AVX2, FMA and F16C, which
                // `has_avx2` has just checked.
                return unsafe { avx2 $(::<$g>)? ($($arg),*) };
            }
            portable $(::<$g>)? ($($arg),*)
        }
    };
}

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

multiversion! {
    fn fp8_rne_kernel<F: Format>(src: &[f32], dst: &mut [u8]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = encode_rne::<F>(s);
        }
    }
}

multiversion! {
    /// Stochastic kernel for a chunk whose first element has global index `base`.
    fn fp8_stochastic_kernel<F: Format>(src: &[f32], dst: &mut [u8], seed: u64, base: u64) {
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
                *d = encode_stochastic::<F>(x, keyed_bits(keys, counter));
                counter = counter.wrapping_add(1);
            }
            src = s_rest;
            dst = d_rest;
            index += take as u64;
        }
    }
}

multiversion! {
    fn fp8_decode_kernel(table: &[f32; 256], src: &[u8], dst: &mut [f32]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = table[usize::from(s)];
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Slice conversions (parallel)
// ---------------------------------------------------------------------------------------------

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

/// A deterministic pseudo-random f32 tensor on the CPU with values in [-0.5, 0.5): the same bits
/// for the same `shape` and `seed` on every machine. For examples, tests and benchmarks that need
/// reproducible weights without an RNG crate (a xorshift64 stream seeded from `seed`).
///
/// # Errors
/// [`Error::Tensor`] only if candle cannot build the tensor (it always can for a CPU `Vec`).
pub fn uniform_tensor(shape: &[usize], seed: u64) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(1);
    let v: Vec<f32> = (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).ctx(|| format!("a uniform tensor of shape {shape:?}"))
}

/// Buffers at least this large are backed by transparent huge pages where the kernel offers them.
const HUGE_PAGE_MIN: usize = 4 << 20;

/// A zeroed buffer of `n` elements for a conversion's output.
///
/// A large allocation is fresh memory from the kernel each time (glibc maps anything over 32 MiB
/// anew and unmaps it on free), so filling it takes one page fault per 4 KiB page — about as
/// long as the conversion itself for a 4096² weight. Buffers of at least 4 MiB are therefore
/// advised to use transparent huge pages before their first touch (`madvise(MADV_HUGEPAGE)`;
/// Linux only, ignored where THP is off): one fault per 2 MiB.
pub(crate) fn output_buffer<T: Copy + Default>(n: usize) -> Vec<T> {
    let mut v: Vec<T> = Vec::with_capacity(n);
    let bytes = n.saturating_mul(std::mem::size_of::<T>());
    #[cfg(target_os = "linux")]
    if bytes >= HUGE_PAGE_MIN {
        const PAGE: usize = 4096;
        let start = v.as_mut_ptr() as usize;
        let first = start.next_multiple_of(PAGE);
        let end = (start + bytes) / PAGE * PAGE;
        if end > first {
            // SAFETY: `[first, end)` lies inside `v`'s allocation (page-aligned inward), which
            // this function owns and has not touched; MADV_HUGEPAGE only changes how the kernel
            // backs those pages, never their contents, and failure is harmless (ignored).
            unsafe {
                libc::madvise(first as *mut libc::c_void, end - first, libc::MADV_HUGEPAGE);
            }
        }
    }
    let _ = bytes;
    v.resize(n, T::default());
    v
}

/// Applies `kernel(src_chunk, dst_chunk, index_of_first_element)` over [`PAR_CHUNK`]-sized
/// chunks, in parallel when there is more than one. Lengths must already be equal.
fn par_convert<A: Sync, B: Send>(
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
/// stochastic; both saturate, see the module docs). Element `i` of a stochastic conversion uses
/// random bits derived from `(seed, i)` only.
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

// ---------------------------------------------------------------------------------------------
// Tensor helpers
// ---------------------------------------------------------------------------------------------

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
/// Rounding: `f16`/`bf16` always RNE (a [`Rounding::Stochastic`] request falls back to RNE);
/// fp8 RNE for [`Rounding::Nearest`], seeded stochastic rounding for [`Rounding::Stochastic`]
/// (module docs give the contract; element indices are row-major over the tensor). An `F32`
/// target returns the tensor as is (a cheap clone). Strided inputs are made contiguous first.
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
                let mut out = output_buffer::<f64>(n);
                par_convert(src, &mut out, |s, d, _| {
                    d.iter_mut().zip(s).for_each(|(d, &s)| *d = f64::from(s))
                });
                Tensor::from_vec(out, shape, &Device::Cpu).ctx(ctx)
            }
            Dtype::F16 => {
                let mut out = output_buffer::<f16>(n);
                f32_to_f16(src, &mut out)?;
                Tensor::from_vec(out, shape, &Device::Cpu).ctx(ctx)
            }
            Dtype::BF16 => {
                let mut out = output_buffer::<bf16>(n);
                f32_to_bf16(src, &mut out)?;
                Tensor::from_vec(out, shape, &Device::Cpu).ctx(ctx)
            }
            Dtype::F8E5M2 => {
                let mut out = output_buffer::<u8>(n);
                f32_to_fp8(src, &mut out, Fp8Format::E5M2, rounding)?;
                Tensor::from_vec(out, shape, &Device::Cpu).ctx(ctx)
            }
            Dtype::F8E4M3FN => {
                let mut out = output_buffer::<u8>(n);
                f32_to_fp8(src, &mut out, Fp8Format::E4M3FN, rounding)?;
                let out = into_candle_elements(out, CpuStorage::F8E4M3)?;
                Tensor::from_vec(out, shape, &Device::Cpu).ctx(ctx)
            }
        }
    })
}

/// Reinterprets fp8 codes as the element type candle stores `F8E4M3` tensors in (its own
/// `float8::F8E4M3`, of a `float8` version we do not depend on; `variant` names it by inference:
/// pass `CpuStorage::F8E4M3`). No copy.
fn into_candle_elements<T: WithDType>(
    bytes: Vec<u8>,
    _variant: fn(Vec<T>) -> CpuStorage,
) -> Result<Vec<T>> {
    if T::DTYPE != DType::F8E4M3 || std::mem::size_of::<T>() != 1 || std::mem::align_of::<T>() != 1
    {
        return Err(Error::UnsupportedDtype {
            dtype: T::DTYPE.as_str().into(),
            what: "building an fp8 tensor: candle's F8E4M3 element is not a 1-byte type".into(),
        });
    }
    let mut bytes = std::mem::ManuallyDrop::new(bytes);
    let (ptr, len, cap) = (bytes.as_mut_ptr(), bytes.len(), bytes.capacity());
    // SAFETY: `T` is the element of `CpuStorage::F8E4M3` with `DTYPE == F8E4M3`, i.e. candle's
    // `float8::F8E4M3`, a `#[repr(transparent)]` wrapper of a `u8` for which every bit pattern is
    // a valid value; size and alignment are checked above to be 1, so `ptr` (from a `Vec<u8>`,
    // not used again: `ManuallyDrop`) was allocated with the layout a `Vec<T>` of capacity `cap`
    // deallocates with, and its `len` elements are initialized.
    Ok(unsafe { Vec::from_raw_parts(ptr.cast::<T>(), len, cap) })
}

#[cfg(test)]
mod tests {
    use super::*;

    const FORMATS: [Fp8Format; 2] = [Fp8Format::E4M3FN, Fp8Format::E5M2];

    /// Every finite value of a 16- or 8-bit dtype, as f32.
    fn all_values(d: Dtype) -> Vec<f32> {
        let bits: Vec<u32> = match d.size_in_bytes() {
            1 => (0..=u8::MAX as u32).collect(),
            _ => (0..=u16::MAX as u32).collect(),
        };
        let decode = |b: u32| match d {
            Dtype::F16 => half::f16::from_bits(b as u16).to_f32(),
            Dtype::BF16 => half::bf16::from_bits(b as u16).to_f32(),
            Dtype::F8E4M3FN => Fp8Format::E4M3FN.table()[b as usize],
            Dtype::F8E5M2 => Fp8Format::E5M2.table()[b as usize],
            _ => unreachable!(),
        };
        bits.into_iter()
            .map(decode)
            .filter(|v| v.is_finite())
            .collect()
    }

    #[test]
    fn uniform_tensor_is_reproducible_and_in_range() {
        let a = uniform_tensor(&[64, 33], 7).unwrap().flatten_all().unwrap();
        let a = a.to_vec1::<f32>().unwrap();
        let again = uniform_tensor(&[64, 33], 7).unwrap().flatten_all().unwrap();
        assert_eq!(a, again.to_vec1::<f32>().unwrap());
        let other = uniform_tensor(&[64, 33], 8).unwrap().flatten_all().unwrap();
        assert_ne!(a, other.to_vec1::<f32>().unwrap());
        assert!(a.iter().all(|v| (-0.5..0.5).contains(v)), "range");
        let mean = a.iter().sum::<f32>() / a.len() as f32;
        assert!(mean.abs() < 0.05, "roughly centred: {mean}");
        // Seed 0 starts from state 1, whose first xorshift output has no bits above 40: -0.5.
        let first = uniform_tensor(&[1], 0).unwrap().to_vec1::<f32>().unwrap()[0];
        assert_eq!(first, -0.5);
    }

    #[test]
    fn exact_widening_never_rounds_and_the_others_do() {
        let small = [Dtype::F16, Dtype::BF16, Dtype::F8E4M3FN, Dtype::F8E5M2];
        for from in small {
            let values = all_values(from);
            let t = Tensor::from_vec(values.clone(), values.len(), &Device::Cpu).unwrap();
            for to in small.into_iter().chain([Dtype::F32]) {
                if to == from {
                    continue;
                }
                let back = to_f32(&from_f32(&t, to, Rounding::Nearest).unwrap(), to)
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap();
                let kept = values
                    .iter()
                    .zip(&back)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                if from.widens_exactly_to(to) {
                    assert!(kept, "{from} -> {to} claimed exact but rounds a value");
                } else if to != Dtype::F32 && from != Dtype::F8E5M2 {
                    assert!(!kept, "{from} -> {to} is exact but not claimed");
                }
            }
        }
        assert!(
            !Dtype::F8E5M2.widens_exactly_to(Dtype::F32),
            "E5M2 decodes on the host only"
        );
        assert!(!Dtype::F32.widens_exactly_to(Dtype::BF16));
    }

    /// A small deterministic generator for test inputs (independent of the module's hash).
    struct Lcg(u64);
    impl Lcg {
        fn next_u32(&mut self) -> u32 {
            self.0 = self
                .0
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (self.0 >> 32) as u32
        }
        /// A float with random sign, mantissa and an exponent spread over [lo, hi).
        fn float(&mut self, lo: i32, hi: i32) -> f32 {
            let e = lo + (self.next_u32() % (hi - lo) as u32) as i32;
            let bits = (self.next_u32() & 0x8000_0000)
                | (((e + 127) as u32) << 23)
                | (self.next_u32() & 0x007F_FFFF);
            f32::from_bits(bits)
        }
    }

    fn is_nan_code(format: Fp8Format, code: u8) -> bool {
        format.decode(code).is_nan()
    }

    /// Finite codes of a format in increasing order of magnitude (positive half).
    fn positive_finite_codes(format: Fp8Format) -> Vec<u8> {
        (0u8..0x80)
            .filter(|&c| format.decode(c).is_finite())
            .collect()
    }

    /// Brute-force RNE reference: the nearest finite code (ties to the even code), saturating.
    fn reference_rne(format: Fp8Format, x: f32) -> u8 {
        if x.is_nan() {
            return format.nan_code() | if x.is_sign_negative() { 0x80 } else { 0 };
        }
        let sign = if x.is_sign_negative() { 0x80 } else { 0 };
        let a = f64::from(x.abs());
        if a >= f64::from(format.max()) {
            return positive_finite_codes(format).last().copied().unwrap_or(0) | sign;
        }
        let mut best = 0u8;
        let mut best_d = f64::INFINITY;
        for c in positive_finite_codes(format) {
            let d = (f64::from(format.decode(c)) - a).abs();
            if d < best_d || (d == best_d && c % 2 == 0) {
                best = c;
                best_d = d;
            }
        }
        best | sign
    }

    #[test]
    fn crc32_matches_zlib() {
        assert_eq!(crc32(b""), 0);
        assert_eq!(crc32(b"a"), 3_904_355_907);
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
        assert_eq!(weight_seed(""), 0);
        assert_eq!(weight_seed("a"), 3_904_355_907);
        assert_eq!(
            weight_seed("diffusion_model.input_blocks.0.0.weight"),
            1_346_105_780
        );
        assert_eq!(
            Rounding::stochastic_for("a"),
            Rounding::Stochastic {
                seed: 3_904_355_907
            }
        );
    }

    #[test]
    fn dtype_names_sizes_and_mappings_round_trip() {
        for d in Dtype::ALL {
            assert_eq!(d.name().parse::<Dtype>().ok(), Some(d));
            assert_eq!(d.to_string(), d.name());
            assert_eq!(Dtype::from_safetensors(d.safetensors_name()).ok(), Some(d));
            let storage = d.candle_storage_dtype();
            assert_eq!(storage.size_in_bytes(), d.size_in_bytes());
            assert_eq!(
                Dtype::from_candle_storage(storage, Some(Dtype::F8E5M2)).ok(),
                Some(d)
            );
            assert_eq!(d.is_fp8(), d.fp8_format().is_some());
        }
        for (s, d) in [
            ("float16", Dtype::F16),
            ("FP16", Dtype::F16),
            ("bfloat16", Dtype::BF16),
            ("float32", Dtype::F32),
            ("float8_e4m3fn", Dtype::F8E4M3FN),
            ("float8_e5m2", Dtype::F8E5M2),
        ] {
            assert_eq!(s.parse::<Dtype>().ok(), Some(d), "{s}");
        }
        assert!(matches!(
            "int8".parse::<Dtype>(),
            Err(Error::UnsupportedDtype { .. })
        ));
        assert_eq!(Dtype::try_from(DType::F8E4M3).ok(), Some(Dtype::F8E4M3FN));
        assert!(Dtype::try_from(DType::U8).is_err());
        assert!(Dtype::try_from(DType::I64).is_err());
        assert!(Dtype::from_candle_storage(DType::U8, None).is_err());
        assert!(Dtype::from_candle_storage(DType::U8, Some(Dtype::F16)).is_err());
        assert!(Dtype::from_safetensors("F8_E4M3FNUZ").is_err());
        assert_eq!(Dtype::BF16.storage_size(10), ByteSize(20));
        assert_eq!(Fp8Format::E5M2.to_string(), "fp8_e5m2");
    }

    #[test]
    fn fp8_tables_hold_the_format_landmarks() {
        let e4 = Fp8Format::E4M3FN;
        assert_eq!(e4.decode(0x7E), 448.0);
        assert_eq!(e4.decode(0xFE), -448.0);
        assert!(e4.decode(0x7F).is_nan() && e4.decode(0xFF).is_nan());
        assert_eq!(e4.decode(0x01), 2f32.powi(-9));
        assert_eq!(e4.decode(0x08), 2f32.powi(-6));
        assert_eq!(e4.decode(0x38), 1.0);
        assert_eq!(e4.decode(0x78), 256.0);
        assert_eq!((0u8..=255).filter(|&c| is_nan_code(e4, c)).count(), 2);
        let e5 = Fp8Format::E5M2;
        assert_eq!(e5.decode(0x7B), 57344.0);
        assert_eq!(e5.decode(0x7C), f32::INFINITY);
        assert_eq!(e5.decode(0xFC), f32::NEG_INFINITY);
        assert_eq!(e5.decode(0x01), 2f32.powi(-16));
        assert_eq!(e5.decode(0x04), 2f32.powi(-14));
        assert_eq!(e5.decode(0x3C), 1.0);
        assert_eq!((0u8..=255).filter(|&c| is_nan_code(e5, c)).count(), 6);
        for f in FORMATS {
            assert_eq!(f.decode(0x00).to_bits(), 0);
            assert_eq!(f.decode(0x80).to_bits(), (-0f32).to_bits());
            assert_eq!(
                f.min_positive_normal(),
                f.decode(1 << if f == e4 { 3 } else { 2 })
            );
        }
    }

    #[test]
    fn every_fp8_code_reencodes_to_itself() {
        for f in FORMATS {
            for code in 0u8..=255 {
                let v = f.decode(code);
                if v.is_nan() {
                    assert!(f.decode(f.encode(v)).is_nan(), "{f} {code:#x}");
                } else if v.is_infinite() {
                    assert_eq!(f.decode(f.encode(v)), v.signum() * f.max(), "{f} {code:#x}");
                } else {
                    assert_eq!(f.encode(v), code, "{f} {code:#x} = {v}");
                    let mut out = [0u8; 3];
                    f32_to_fp8(&[v; 3], &mut out, f, Rounding::Stochastic { seed: 7 }).unwrap();
                    assert_eq!(out, [code; 3], "stochastic changed exact {f} {v}");
                }
            }
        }
    }

    #[test]
    fn fp8_midpoints_round_to_even_and_neighbours_to_nearest() {
        for f in FORMATS {
            let codes = positive_finite_codes(f);
            for w in codes.windows(2) {
                let (lo, hi) = (f.decode(w[0]), f.decode(w[1]));
                let mid = (lo + hi) / 2.0; // exact: fp8 values have few mantissa bits
                let even = if w[0] % 2 == 0 { w[0] } else { w[1] };
                assert_eq!(f.encode(mid), even, "{f} mid of {lo} and {hi}");
                assert_eq!(f.encode(-mid), even | 0x80, "{f} -mid of {lo} and {hi}");
                let below = f32::from_bits(mid.to_bits() - 1);
                let above = f32::from_bits(mid.to_bits() + 1);
                assert_eq!(f.encode(below), w[0], "{f} just below mid {mid}");
                assert_eq!(f.encode(above), w[1], "{f} just above mid {mid}");
            }
        }
    }

    #[test]
    fn fp8_encode_matches_brute_force_nearest_over_all_ranges() {
        let mut rng = Lcg(1);
        for f in FORMATS {
            for _ in 0..20_000 {
                let x = rng.float(-24, 18);
                assert_eq!(f.encode(x), reference_rne(f, x), "{f} {x:e}");
            }
        }
    }

    #[test]
    fn fp8_encode_agrees_with_float8_crate_on_normal_values() {
        let mut rng = Lcg(2);
        for _ in 0..50_000 {
            let x = rng.float(-6, 8); // normal E4M3 range, below 256
            assert_eq!(
                Fp8Format::E4M3FN.encode(x),
                float8::F8E4M3::from_f32(x).to_bits(),
                "{x:e}"
            );
            let y = rng.float(-14, 15);
            assert_eq!(
                Fp8Format::E5M2.encode(y),
                float8::F8E5M2::from_f32(y).to_bits(),
                "{y:e}"
            );
        }
    }

    #[test]
    fn fp8_nearest_saturates_and_keeps_nan() {
        let e4 = Fp8Format::E4M3FN;
        let e5 = Fp8Format::E5M2;
        for (f, x, want) in [
            (e4, 448.0, 448.0),
            (e4, 1000.0, 448.0),
            (e4, -1000.0, -448.0),
            (e4, 464.0, 448.0),
            (e4, 479.0, 448.0),
            (e4, f32::INFINITY, 448.0),
            (e4, f32::NEG_INFINITY, -448.0),
            (e4, f32::MAX, 448.0),
            (e5, 57344.0, 57344.0),
            (e5, 70000.0, 57344.0),
            (e5, -70000.0, -57344.0),
            (e5, f32::INFINITY, 57344.0),
            (e4, 1e-30, 0.0),
            (e5, 1e-30, 0.0),
        ] {
            assert_eq!(f.decode(f.encode(x)), want, "{f} {x}");
        }
        for f in FORMATS {
            assert!(f.decode(f.encode(f32::NAN)).is_nan());
            assert!(f.decode(f.encode(-f32::NAN)).is_nan());
            assert_eq!(f.encode(-0.0), 0x80);
        }
    }

    fn sr(format: Fp8Format, src: &[f32], seed: u64) -> Vec<u8> {
        let mut out = vec![0u8; src.len()];
        f32_to_fp8(src, &mut out, format, Rounding::Stochastic { seed }).unwrap();
        out
    }

    #[test]
    fn stochastic_rounding_picks_neighbours_with_unbiased_mean() {
        let e4 = Fp8Format::E4M3FN;
        let out = sr(e4, &vec![0.3f32; 100_000], 42);
        let mut sum = 0f64;
        for &c in &out {
            let v = e4.decode(c);
            assert!(v == 0.28125 || v == 0.3125, "0.3 became {v}");
            sum += f64::from(v);
        }
        let mean = sum / out.len() as f64;
        assert!((mean - 0.3).abs() < 0.002, "mean {mean}");
        // Subnormal range and the E5M2 format too.
        for (f, x) in [
            (e4, 0.0037f32),
            (e4, -0.0011),
            (Fp8Format::E5M2, 0.3),
            (Fp8Format::E5M2, 3.3e-6),
        ] {
            let out = sr(f, &vec![x; 100_000], 9);
            let lo = f.decode(f.encode(x));
            let mean = out.iter().map(|&c| f64::from(f.decode(c))).sum::<f64>() / 1e5;
            let step = out
                .iter()
                .map(|&c| (f.decode(c) - lo).abs())
                .fold(0f32, f32::max);
            assert!(step > 0.0, "{f} {x}: never moved");
            assert!(
                (mean - f64::from(x)).abs() < 0.01 * f64::from(step),
                "{f} {x}: mean {mean}"
            );
            let mut distinct: Vec<u8> = out.clone();
            distinct.sort_unstable();
            distinct.dedup();
            assert_eq!(distinct.len(), 2, "{f} {x}: {distinct:?}");
        }
    }

    #[test]
    fn stochastic_rounding_saturates_never_nan() {
        let e4 = Fp8Format::E4M3FN;
        let e5 = Fp8Format::E5M2;
        for seed in 0..20 {
            let src = [
                1000.0,
                -1000.0,
                447.9,
                470.0,
                f32::INFINITY,
                f32::NEG_INFINITY,
                0.0,
                -0.0,
            ];
            let got: Vec<f32> = sr(e4, &src, seed).iter().map(|&c| e4.decode(c)).collect();
            assert_eq!(got[..2], [448.0, -448.0]);
            assert!(got[2] == 448.0 || got[2] == 416.0);
            assert_eq!(got[3..6], [448.0, 448.0, -448.0]);
            assert_eq!(got[6].to_bits(), 0);
            assert_eq!(got[7].to_bits(), (-0f32).to_bits());
            let got: Vec<f32> = sr(e5, &[70000.0, -70000.0, f32::INFINITY], seed)
                .iter()
                .map(|&c| e5.decode(c))
                .collect();
            assert_eq!(got, [57344.0, -57344.0, 57344.0]);
            for f in FORMATS {
                assert!(f.decode(sr(f, &[f32::NAN], seed)[0]).is_nan());
            }
        }
    }

    #[test]
    fn stochastic_rounding_is_reproducible_and_seeded() {
        let mut rng = Lcg(3);
        let src: Vec<f32> = (0..10_000).map(|_| rng.float(-12, 8)).collect();
        for f in FORMATS {
            let a = sr(f, &src, 5);
            assert_eq!(a, sr(f, &src, 5));
            let b = sr(f, &src, 6);
            let differ = a.iter().zip(&b).filter(|(x, y)| x != y).count();
            assert!(
                differ > 100,
                "{f}: seeds 5 and 6 differ in only {differ} elements"
            );
        }
    }

    #[test]
    fn stochastic_rounding_does_not_depend_on_chunking_or_threads() {
        let mut rng = Lcg(4);
        let n = 3 * PAR_CHUNK + 12_345; // several parallel chunks and an odd tail
        let src: Vec<f32> = (0..n).map(|_| rng.float(-12, 9)).collect();
        for f in FORMATS {
            let parallel = sr(f, &src, 77);
            // Element by element, one random draw per element.
            let scalar: Vec<u8> = src
                .iter()
                .enumerate()
                .map(|(i, &x)| match f {
                    Fp8Format::E4M3FN => encode_stochastic::<E4M3FN>(x, element_bits(77, i as u64)),
                    Fp8Format::E5M2 => encode_stochastic::<E5M2>(x, element_bits(77, i as u64)),
                })
                .collect();
            assert_eq!(parallel, scalar, "{f}");
            // Odd-sized pieces at odd offsets.
            let mut pieces = vec![0u8; n];
            let mut start = 0;
            for len in [1usize, 7, 4096, 33, PAR_CHUNK + 1].iter().cycle() {
                if start >= n {
                    break;
                }
                let end = (start + len).min(n);
                match f {
                    Fp8Format::E4M3FN => fp8_stochastic_kernel::<E4M3FN>(
                        &src[start..end],
                        &mut pieces[start..end],
                        77,
                        start as u64,
                    ),
                    Fp8Format::E5M2 => fp8_stochastic_kernel::<E5M2>(
                        &src[start..end],
                        &mut pieces[start..end],
                        77,
                        start as u64,
                    ),
                }
                start = end;
            }
            assert_eq!(parallel, pieces, "{f}");
            // A run crossing a multiple of 2^32 switches keys exactly at the boundary.
            let base = (1u64 << 32) - 5;
            let mut across = [0u8; 11];
            match f {
                Fp8Format::E4M3FN => {
                    fp8_stochastic_kernel::<E4M3FN>(&src[..11], &mut across, 77, base)
                }
                Fp8Format::E5M2 => fp8_stochastic_kernel::<E5M2>(&src[..11], &mut across, 77, base),
            }
            for (j, &c) in across.iter().enumerate() {
                let r = element_bits(77, base + j as u64);
                let want = match f {
                    Fp8Format::E4M3FN => encode_stochastic::<E4M3FN>(src[j], r),
                    Fp8Format::E5M2 => encode_stochastic::<E5M2>(src[j], r),
                };
                assert_eq!(c, want, "{f} element {j} past 2^32 - 5");
            }
            // A one-thread pool gives the same bits.
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(1)
                .build()
                .unwrap();
            assert_eq!(pool.install(|| sr(f, &src, 77)), parallel, "{f}");
        }
    }

    #[test]
    fn bf16_matches_half_rne_including_specials() {
        let mut rng = Lcg(5);
        let mut src: Vec<f32> = (0..200_000).map(|_| rng.float(-140, 128)).collect();
        src.extend([
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::from_bits(0x7F80_0001), // signalling NaN: must stay NaN
            f32::MAX,
            f32::MIN_POSITIVE,
            1.0 + 2f32.powi(-8),       // tie, rounds to even (down)
            1.0 + 3.0 * 2f32.powi(-8), // tie, rounds to even (up)
        ]);
        let mut ours = vec![bf16::ZERO; src.len()];
        f32_to_bf16(&src, &mut ours).unwrap();
        for (x, y) in src.iter().zip(&ours) {
            let want = bf16::from_f32(*x);
            if x.is_nan() {
                assert!(y.is_nan(), "{x}");
            } else {
                assert_eq!(y.to_bits(), want.to_bits(), "{x:e}");
            }
        }
        let mut back = vec![0f32; src.len()];
        bf16_to_f32(&ours, &mut back).unwrap();
        for (b, y) in back.iter().zip(&ours) {
            assert!(b.to_bits() == y.to_f32().to_bits() || b.is_nan());
        }
    }

    #[test]
    fn f16_round_trips_through_half() {
        let mut rng = Lcg(6);
        let src: Vec<f32> = (0..PAR_CHUNK * 2 + 3).map(|_| rng.float(-20, 16)).collect();
        let mut h = vec![f16::ZERO; src.len()];
        f32_to_f16(&src, &mut h).unwrap();
        let mut back = vec![0f32; src.len()];
        f16_to_f32(&h, &mut back).unwrap();
        for ((x, y), b) in src.iter().zip(&h).zip(&back) {
            assert_eq!(y.to_bits(), f16::from_f32(*x).to_bits(), "{x:e}");
            assert_eq!(*b, y.to_f32());
        }
    }

    #[test]
    fn mismatched_lengths_are_an_error_not_a_panic() {
        let src = [1.0f32; 4];
        let mut short = [0u8; 3];
        assert!(matches!(
            f32_to_fp8(&src, &mut short, Fp8Format::E4M3FN, Rounding::Nearest),
            Err(Error::ShapeMismatch { .. })
        ));
        assert!(f32_to_f16(&src, &mut [f16::ZERO; 5]).is_err());
        assert!(f32_to_bf16(&src, &mut [bf16::ZERO; 2]).is_err());
        assert!(fp8_to_f32(&[0u8; 2], &mut [0f32; 1], Fp8Format::E5M2).is_err());
        // Empty slices are fine.
        f32_to_fp8(
            &[],
            &mut [],
            Fp8Format::E5M2,
            Rounding::Stochastic { seed: 1 },
        )
        .unwrap();
    }

    #[test]
    fn tensors_round_trip_through_every_storage_dtype() -> Result<()> {
        // Values exactly representable in every dtype, including fp8.
        let vals: Vec<f32> = (0..24)
            .map(|i| [0.5f32, -1.0, 2.0, 0.0, 1.5, -0.25][i % 6])
            .collect();
        let t = Tensor::from_vec(vals.clone(), (4, 6), &Device::Cpu)?;
        for d in Dtype::ALL {
            for rounding in [Rounding::Nearest, Rounding::Stochastic { seed: 3 }] {
                let stored = from_f32(&t, d, rounding)?;
                assert_eq!(stored.dtype(), d.candle_storage_dtype());
                assert_eq!(stored.dims(), &[4, 6]);
                let back = to_f32(&stored, d)?;
                assert_eq!(back.flatten_all()?.to_vec1::<f32>()?, vals, "{d}");
            }
        }
        Ok(())
    }

    #[test]
    fn e4m3_tensors_agree_with_candle_own_cast() -> Result<()> {
        let mut rng = Lcg(7);
        let vals: Vec<f32> = (0..4096).map(|_| rng.float(-10, 9)).collect();
        let t = Tensor::from_vec(vals, (64, 64), &Device::Cpu)?;
        let ours = from_f32(&t, Dtype::F8E4M3FN, Rounding::Nearest)?;
        let candle_decode = ours.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let our_decode = to_f32(&ours, Dtype::F8E4M3FN)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        assert_eq!(candle_decode, our_decode);
        // And bf16 / f16 agree with candle's to_dtype bit for bit.
        for (d, cd) in [(Dtype::BF16, DType::BF16), (Dtype::F16, DType::F16)] {
            let ours = to_f32(&from_f32(&t, d, Rounding::Nearest)?, d)?;
            let theirs = t.to_dtype(cd)?.to_dtype(DType::F32)?;
            assert_eq!(
                ours.flatten_all()?.to_vec1::<f32>()?,
                theirs.flatten_all()?.to_vec1::<f32>()?
            );
        }
        Ok(())
    }

    #[test]
    fn tensor_helpers_handle_strides_and_reject_wrong_storage() -> Result<()> {
        let t = Tensor::arange(0f32, 12.0, &Device::Cpu)?.reshape((3, 4))?;
        let tt = t.t()?; // strided
        let stored = from_f32(&tt, Dtype::BF16, Rounding::Nearest)?;
        assert_eq!(stored.dims(), &[4, 3]);
        assert_eq!(
            to_f32(&stored, Dtype::BF16)?.to_vec2::<f32>()?,
            tt.to_vec2::<f32>()?
        );
        let narrowed = t.narrow(0, 1, 2)?; // contiguous with an offset
        let e5 = from_f32(&narrowed, Dtype::F8E5M2, Rounding::Nearest)?;
        assert_eq!(e5.dtype(), DType::U8);
        let want: Vec<f32> = (4..12)
            .map(|i| Fp8Format::E5M2.decode(Fp8Format::E5M2.encode(i as f32)))
            .collect();
        assert_eq!(
            to_f32(&e5, Dtype::F8E5M2)?
                .flatten_all()?
                .to_vec1::<f32>()?,
            want
        );
        assert_eq!(want[5], 8.0); // 9 is a tie between 8 and 10: even mantissa wins
                                  // Wrong storage for the claimed dtype.
        assert!(matches!(
            to_f32(&t, Dtype::F16),
            Err(Error::UnsupportedDtype { .. })
        ));
        assert!(matches!(
            from_f32(&stored, Dtype::F16, Rounding::Nearest),
            Err(Error::UnsupportedDtype { .. })
        ));
        // Stochastic for bf16 is RNE.
        let x = Tensor::from_vec(vec![1.0f32 + 2f32.powi(-9); 8], 8, &Device::Cpu)?;
        let a = from_f32(&x, Dtype::BF16, Rounding::Stochastic { seed: 1 })?;
        let b = from_f32(&x, Dtype::BF16, Rounding::Nearest)?;
        assert_eq!(a.to_vec1::<bf16>()?, b.to_vec1::<bf16>()?);
        Ok(())
    }

    #[test]
    fn stochastic_tensor_encoding_uses_row_major_indices() -> Result<()> {
        let mut rng = Lcg(8);
        let vals: Vec<f32> = (0..1000).map(|_| rng.float(-8, 4)).collect();
        let t = Tensor::from_vec(vals.clone(), (10, 100), &Device::Cpu)?;
        let seed = weight_seed("diffusion_model.input_blocks.0.0.weight");
        let stored = from_f32(&t, Dtype::F8E5M2, Rounding::Stochastic { seed })?;
        assert_eq!(
            stored.flatten_all()?.to_vec1::<u8>()?,
            sr(Fp8Format::E5M2, &vals, seed)
        );
        Ok(())
    }
}
