//! [`Dtype`]: the storage dtypes a weight can have, their names and sizes, and their mappings to
//! candle's [`DType`] and to safetensors' dtype strings.
//!
//! How each dtype is stored in candle (E5M2 as raw `U8` bytes) is described in the
//! [`float`](crate::float) module docs.

use std::fmt;
use std::str::FromStr;

use candle_core::DType;

use super::Fp8Format;
use crate::error::{Error, Result};
use crate::size::ByteSize;

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
