//! Byte counts as a type.
//!
//! Every public signature that carries a number of bytes uses [`ByteSize`]; arithmetic on it is
//! either checked (returns `None` on overflow) or saturating, never wrapping. Sizes parse from the
//! forms users type on a command line (`4GiB`, `512MiB`, `1.5GB`, `1073741824`) and display in
//! binary units. This module names nothing else of the crate: the parse is here, and the
//! `FromStr` impl that types its refusal as the crate's error is in `error.rs`.

use std::fmt;

/// A number of bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(transparent))]
pub struct ByteSize(pub u64);

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;
const GIB: u64 = 1024 * MIB;
const TIB: u64 = 1024 * GIB;

impl ByteSize {
    /// Zero bytes.
    pub const ZERO: ByteSize = ByteSize(0);
    /// The largest representable size.
    pub const MAX: ByteSize = ByteSize(u64::MAX);

    /// `n` bytes.
    pub const fn b(n: u64) -> Self {
        ByteSize(n)
    }
    /// `n` KiB.
    pub const fn kib(n: u64) -> Self {
        ByteSize(n.saturating_mul(KIB))
    }
    /// `n` MiB.
    pub const fn mib(n: u64) -> Self {
        ByteSize(n.saturating_mul(MIB))
    }
    /// `n` GiB.
    pub const fn gib(n: u64) -> Self {
        ByteSize(n.saturating_mul(GIB))
    }
    /// A fractional number of GiB, rounded down to whole bytes (`1.5` → 1610612736).
    pub fn gib_f64(g: f64) -> Self {
        ByteSize::from_f64(g * GIB as f64)
    }
    /// Bytes from a float, rounded down, clamped to `[0, u64::MAX]`; NaN is zero.
    pub fn from_f64(bytes: f64) -> Self {
        if bytes.is_nan() || bytes <= 0.0 {
            ByteSize(0)
        } else if bytes >= u64::MAX as f64 {
            ByteSize::MAX
        } else {
            ByteSize(bytes as u64)
        }
    }
    /// The raw byte count.
    pub const fn bytes(self) -> u64 {
        self.0
    }
    /// The byte count as `f64` (for ratios and formulas).
    pub fn as_f64(self) -> f64 {
        self.0 as f64
    }
    /// The byte count in MiB as a float.
    pub fn as_mib(self) -> f64 {
        self.0 as f64 / MIB as f64
    }
    /// The byte count in GiB as a float.
    pub fn as_gib(self) -> f64 {
        self.0 as f64 / GIB as f64
    }
    /// `self + rhs`, or `None` on overflow.
    pub fn checked_add(self, rhs: ByteSize) -> Option<ByteSize> {
        self.0.checked_add(rhs.0).map(ByteSize)
    }
    /// `self - rhs`, or `None` when `rhs > self`.
    pub fn checked_sub(self, rhs: ByteSize) -> Option<ByteSize> {
        self.0.checked_sub(rhs.0).map(ByteSize)
    }
    /// `self × n`, or `None` on overflow.
    pub fn checked_mul(self, n: u64) -> Option<ByteSize> {
        self.0.checked_mul(n).map(ByteSize)
    }
    /// `self + rhs`, clamped at [`ByteSize::MAX`].
    pub fn saturating_add(self, rhs: ByteSize) -> ByteSize {
        ByteSize(self.0.saturating_add(rhs.0))
    }
    /// `self - rhs`, clamped at zero.
    pub fn saturating_sub(self, rhs: ByteSize) -> ByteSize {
        ByteSize(self.0.saturating_sub(rhs.0))
    }
    /// `self × n`, clamped at [`ByteSize::MAX`].
    pub fn saturating_mul(self, n: u64) -> ByteSize {
        ByteSize(self.0.saturating_mul(n))
    }
    /// `self × factor`, rounded down (for the 1.1× and ratio formulas).
    pub fn scale(self, factor: f64) -> ByteSize {
        ByteSize::from_f64(self.0 as f64 * factor)
    }
}

impl std::iter::Sum for ByteSize {
    fn sum<I: Iterator<Item = ByteSize>>(iter: I) -> Self {
        iter.fold(ByteSize::ZERO, ByteSize::saturating_add)
    }
}

impl From<u64> for ByteSize {
    fn from(n: u64) -> Self {
        ByteSize(n)
    }
}

impl fmt::Display for ByteSize {
    /// Binary units with two decimals: `512.00 MiB`, `4.00 GiB`; below 1 KiB plain bytes.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.0;
        let (value, unit) = if n >= TIB {
            (n as f64 / TIB as f64, "TiB")
        } else if n >= GIB {
            (n as f64 / GIB as f64, "GiB")
        } else if n >= MIB {
            (n as f64 / MIB as f64, "MiB")
        } else if n >= KIB {
            (n as f64 / KIB as f64, "KiB")
        } else {
            return write!(f, "{n} B");
        };
        write!(f, "{value:.2} {unit}")
    }
}

impl ByteSize {
    /// The size `s` spells, in the forms `ByteSize`'s `FromStr` lists, or why it spells none,
    /// in words. `FromStr` is in `error.rs`, so that this module names nothing of the crate: it
    /// turns a refusal into [`crate::Error::InvalidSize`] naming the input.
    pub(crate) fn parse(s: &str) -> Result<ByteSize, &'static str> {
        let t = s.trim();
        if t.is_empty() {
            return Err("empty");
        }
        let split = t
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        if num.is_empty() {
            return Err("no number before the unit");
        }
        let unit = unit.trim().to_ascii_lowercase();
        let mult: f64 = match unit.as_str() {
            "" | "b" => 1.0,
            "k" | "kib" => KIB as f64,
            "m" | "mib" => MIB as f64,
            "g" | "gib" => GIB as f64,
            "t" | "tib" => TIB as f64,
            "kb" => 1e3,
            "mb" => 1e6,
            "gb" => 1e9,
            "tb" => 1e12,
            _ => return Err("unknown unit (use B, KiB, MiB, GiB, TiB, KB, MB, GB or TB)"),
        };
        if unit.is_empty() || unit == "b" {
            if let Ok(n) = num.parse::<u64>() {
                return Ok(ByteSize(n));
            }
        }
        let value: f64 = num.parse().map_err(|_| "not a number")?;
        let bytes = value * mult;
        if !bytes.is_finite() || bytes > u64::MAX as f64 {
            return Err("too large");
        }
        Ok(ByteSize(bytes.round() as u64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_forms_users_type() {
        let cases: &[(&str, u64)] = &[
            ("1073741824", 1073741824),
            ("512MiB", 512 * MIB),
            ("4GiB", 4 * GIB),
            ("1.5GB", 1_500_000_000),
            ("2G", 2 * GIB),
            ("100 KB", 100_000),
            ("0.5gib", GIB / 2),
            ("7b", 7),
        ];
        for (s, want) in cases {
            assert_eq!(s.parse::<ByteSize>().unwrap(), ByteSize(*want), "{s}");
        }
    }

    #[test]
    fn rejects_bad_sizes_with_the_input_named() {
        for s in ["", "GiB", "4 parsecs", "1.2.3GB", "-4GiB", "1e400"] {
            let err = s.parse::<ByteSize>().unwrap_err();
            assert!(err.to_string().contains(s.trim()), "{s}: {err}");
        }
    }

    #[test]
    fn displays_in_binary_units() {
        assert_eq!(ByteSize::mib(512).to_string(), "512.00 MiB");
        assert_eq!(ByteSize::gib(4).to_string(), "4.00 GiB");
        assert_eq!(ByteSize(1536).to_string(), "1.50 KiB");
        assert_eq!(ByteSize(12).to_string(), "12 B");
    }

    #[test]
    fn arithmetic_is_checked_or_saturating() {
        assert_eq!(ByteSize(3).checked_sub(ByteSize(4)), None);
        assert_eq!(ByteSize(3).saturating_sub(ByteSize(4)), ByteSize(0));
        assert_eq!(ByteSize::MAX.checked_add(ByteSize(1)), None);
        assert_eq!(ByteSize::MAX.saturating_add(ByteSize(1)), ByteSize::MAX);
        assert_eq!(ByteSize::gib_f64(1.5), ByteSize(1610612736));
        assert_eq!(ByteSize(10).scale(1.1), ByteSize(11));
        assert_eq!(ByteSize::from_f64(f64::NAN), ByteSize(0));
    }
}
