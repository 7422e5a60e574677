//! The two fp8 formats ([`Fp8Format`]: E4M3FN and E5M2): their decode tables, built at compile
//! time, and the branch-free round-to-nearest-even encoder with saturation (see the
//! [rounding rules](crate::float#rounding-rules)). The kernels are generic over a compile-time
//! [`Format`] so every constant folds; the stochastic encoder is in
//! [`stochastic`](super::stochastic).

use std::fmt;

use super::cast::Dest;
use super::multiversion::multiversion;
use super::Dtype;

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

    /// Encodes one value with round-to-nearest-even and saturation (see the [rounding
    /// rules](crate::float#rounding-rules)).
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
pub(super) trait Format {
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

pub(super) struct E4M3FN;
impl Format for E4M3FN {
    const M: u32 = 3;
    const BIAS: i32 = 7;
    const MAX_CODE: u32 = 0x7E;
    const NAN_CODE: u32 = 0x7F;
    const IEEE_SPECIALS: bool = false;
    const MIN_NORMAL: f32 = 0.015625;
}

pub(super) struct E5M2;
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

multiversion! {
    pub(super) fn fp8_rne_kernel<F: Format, D: Dest<u8>>(src: &[f32], dst: &mut [D]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            d.put(encode_rne::<F>(s));
        }
    }
}

multiversion! {
    pub(super) fn fp8_decode_kernel(table: &[f32; 256], src: &[u8], dst: &mut [f32]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = table[usize::from(s)];
        }
    }
}
