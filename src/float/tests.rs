//! Unit tests of the float module: dtype mappings, the fp8 codec against brute force and the
//! `float8` crate, stochastic rounding's contract and determinism, slice and tensor conversions.

use candle_core::{DType, Device, Tensor};
use half::{bf16, f16};

use super::fp8::{E4M3FN, E5M2};
use super::stochastic::{element_bits, encode_stochastic, fp8_stochastic_kernel};
use super::*;
use crate::error::{Error, Result};
use crate::size::ByteSize;

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
                Fp8Format::E4M3FN => fp8_stochastic_kernel::<E4M3FN, u8>(
                    &src[start..end],
                    &mut pieces[start..end],
                    77,
                    start as u64,
                ),
                Fp8Format::E5M2 => fp8_stochastic_kernel::<E5M2, u8>(
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
                fp8_stochastic_kernel::<E4M3FN, u8>(&src[..11], &mut across, 77, base)
            }
            Fp8Format::E5M2 => fp8_stochastic_kernel::<E5M2, u8>(&src[..11], &mut across, 77, base),
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

/// CRC-32s of every cast's output on one fixed input spanning the whole f32 range (subnormals,
/// infinities, NaNs with payloads, ties), pinned from the kernels as they were before they were
/// rewritten for speed: a changed bit anywhere changes a checksum.
#[test]
fn cast_outputs_keep_their_pinned_bits() {
    let mut rng = Lcg(2024);
    let mut src: Vec<f32> = (0..(1 << 20) + 77).map(|_| rng.float(-127, 129)).collect();
    // NaN payloads, and values on and near fp8/f16 rounding ties.
    src.extend((0..4096u32).map(|i| f32::from_bits(0x7F80_0000 | (i << 11) | 1)));
    src.extend((0..4096u32).map(|i| f32::from_bits(0x3300_0000 + (i << 12))));
    let mut h = vec![f16::ZERO; src.len()];
    f32_to_f16(&src, &mut h).unwrap();
    let mut b = vec![bf16::ZERO; src.len()];
    f32_to_bf16(&src, &mut b).unwrap();
    let le16 = |v: Vec<u16>| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let mut got: Vec<(String, u32)> = vec![
        (
            "f16".into(),
            crc32(&le16(h.iter().map(|x| x.to_bits()).collect())),
        ),
        (
            "bf16".into(),
            crc32(&le16(b.iter().map(|x| x.to_bits()).collect())),
        ),
    ];
    for f in FORMATS {
        for rounding in [Rounding::Nearest, Rounding::Stochastic { seed: 0x5EED }] {
            let mut out = vec![0u8; src.len()];
            f32_to_fp8(&src, &mut out, f, rounding).unwrap();
            got.push((format!("{f} {rounding:?}"), crc32(&out)));
        }
    }
    let t = Tensor::from_slice(&src, src.len(), &Device::Cpu).unwrap();
    for d in [Dtype::F16, Dtype::BF16, Dtype::F8E4M3FN, Dtype::F8E5M2] {
        let e = from_f32(&t, d, Rounding::Stochastic { seed: 9 }).unwrap();
        let back = to_f32(&e, d).unwrap().to_vec1::<f32>().unwrap();
        let bits: Vec<u8> = back
            .iter()
            .flat_map(|x| x.to_bits().to_le_bytes())
            .collect();
        got.push((format!("tensor {d}"), crc32(&bits)));
    }
    let pinned: [(&str, u32); 10] = [
        ("f16", 104701604),
        ("bf16", 1625568092),
        ("fp8_e4m3fn Nearest", 4022563362),
        ("fp8_e4m3fn Stochastic { seed: 24301 }", 3984005671),
        ("fp8_e5m2 Nearest", 2248994748),
        ("fp8_e5m2 Stochastic { seed: 24301 }", 1235840786),
        ("tensor f16", 1363438160),
        ("tensor bf16", 309273880),
        ("tensor fp8_e4m3fn", 866564717),
        ("tensor fp8_e5m2", 3100929040),
    ];
    let got: Vec<(&str, u32)> = got.iter().map(|(n, c)| (n.as_str(), *c)).collect();
    assert_eq!(got, pinned);
}

/// Inputs covering every sign and exponent, each with mantissas on and beside every rounding
/// position (ties, one below, one above, both neighbours' parities) and a spread of random ones,
/// plus a sweep of NaN payloads.
fn f16_edge_inputs() -> Vec<f32> {
    let mut rng = Lcg(16);
    let mut mantissas: Vec<u32> = vec![0, 0x7F_FFFF];
    for k in 0..23 {
        let b = 1u32 << k;
        mantissas.extend([b, b - 1, b + 1, 3 * b, 3 * b - 1, 3 * b + 1]);
    }
    mantissas.extend((0..600).map(|_| rng.next_u32()));
    let mantissas: Vec<u32> = mantissas.into_iter().map(|m| m & 0x7F_FFFF).collect();
    let mut src = Vec::new();
    for sign_exp in 0..512u32 {
        src.extend(mantissas.iter().map(|m| f32::from_bits(sign_exp << 23 | m)));
    }
    src.extend((0..1u32 << 16).map(|i| f32::from_bits(0x7F80_0000 | (i * 127 + 1) & 0x7F_FFFF)));
    src.extend((0..1u32 << 16).map(|i| f32::from_bits(0xFF80_0000 | (i * 131 + 1) & 0x7F_FFFF)));
    src
}

#[test]
fn f16_hardware_encoder_matches_portable_on_every_exponent_and_tie() {
    let src = f16_edge_inputs();
    let want: Vec<u16> = src
        .iter()
        .map(|&x| super::cast::f16_bits_portable(x))
        .collect();
    // The dispatched path (AVX-512 or F16C where present), in parallel chunks.
    let mut h = vec![f16::ZERO; src.len()];
    f32_to_f16(&src, &mut h).unwrap();
    for (i, (y, w)) in h.iter().zip(&want).enumerate() {
        assert_eq!(y.to_bits(), *w, "{:#010x}", src[i].to_bits());
    }
    // The F16C path alone, on CPUs that have it (an AVX-512 CPU would otherwise never run it).
    #[cfg(target_arch = "x86_64")]
    {
        let mut bits = vec![0u16; src.len()];
        let done = super::f16c::encode_f16_f16c_only(&src, &mut bits);
        for i in 0..done {
            assert_eq!(bits[i], want[i], "{:#010x}", src[i].to_bits());
        }
    }
    // And `half`, whose converter the portable encoder was written to match.
    for (x, w) in src.iter().zip(&want) {
        if !x.is_nan() {
            assert_eq!(f16::from_f32(*x).to_bits(), *w, "{:#010x}", x.to_bits());
        }
    }
}

/// Rounding an f32 tensor through bf16 / f16 in place gives exactly the encode-then-decode of
/// `from_f32` and `to_f32`, specials included, over more than one parallel chunk; other dtypes
/// are left alone (and say so).
#[test]
fn round_through_in_place_is_encode_then_decode() {
    let mut v: Vec<f32> = uniform_tensor(&[200_003], 7)
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .into_iter()
        .enumerate()
        .map(|(i, x)| x * 10f32.powi((i % 13) as i32 - 6))
        .collect();
    v.extend([
        f32::NAN,
        -f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        0.0,
        -0.0,
        f32::MAX,
        f32::MIN_POSITIVE / 3.0,
        65504.0,
        65520.0,
        1e-8,
    ]);
    let n = v.len();
    for dtype in [Dtype::BF16, Dtype::F16] {
        let t = Tensor::from_vec(v.clone(), n, &Device::Cpu).unwrap();
        let want = to_f32(&from_f32(&t, dtype, Rounding::Nearest).unwrap(), dtype).unwrap();
        assert!(super::round_through_in_place(&t, dtype).unwrap());
        let bits = |t: &Tensor| -> Vec<u32> {
            t.to_vec1::<f32>()
                .unwrap()
                .into_iter()
                .map(f32::to_bits)
                .collect()
        };
        assert_eq!(bits(&t), bits(&want), "{dtype}");
    }
    let t = Tensor::from_vec(v.clone(), n, &Device::Cpu).unwrap();
    for dtype in [Dtype::F32, Dtype::F8E4M3FN] {
        assert!(!super::round_through_in_place(&t, dtype).unwrap());
    }
    let same = t
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .zip(&v)
        .all(|(a, b)| a.to_bits() == b.to_bits());
    assert!(same, "a refused dtype changed the values");
}
