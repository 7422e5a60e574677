//! Unit tests of attention: every backend against the naive one on odd shapes, dtypes, masks and
//! layouts; the memory plans against the temporaries actually created; the dispatcher's table.

use candle_core::{DType, Device, Tensor};

use super::*;
use proptest::prelude::*;

mod planners;

const B: usize = 2;
const H: usize = 3;
const NQ: usize = 77;
const NK: usize = 131;
pub(super) const DIM: usize = 16;

/// Seeded normal samples (splitmix64 + Box–Muller), so tests do not depend on candle's RNG.
pub(super) fn normal(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    let mut next = || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        ((z >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    (0..n)
        .map(|_| {
            let (u1, u2) = (next(), next());
            ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
        })
        .collect()
}

pub(super) fn randn(shape: &[usize], seed: u64, scale: f32, dtype: DType) -> Tensor {
    let n = shape.iter().product();
    let data: Vec<f32> = normal(n, seed).into_iter().map(|x| x * scale).collect();
    Tensor::from_vec(data, shape, &Device::Cpu)
        .and_then(|t| t.to_dtype(dtype))
        .expect("test tensor")
}

pub(super) fn values(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f32>())
        .expect("tensor values")
}

pub(super) fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    max_excess(a, b, 0.0)
}

/// Largest `|a - b| - rtol·|b|` over the elements; with `rtol = 0` the largest `|a - b|`.
pub(super) fn max_excess(a: &Tensor, b: &Tensor, rtol: f32) -> f32 {
    assert_eq!(a.dims(), b.dims());
    values(a)
        .iter()
        .zip(values(b))
        .map(|(x, y)| {
            assert!(
                x.is_finite() && y.is_finite(),
                "non-finite output {x} vs {y}"
            );
            (x - y).abs() - rtol * y.abs()
        })
        .fold(0.0, f32::max)
}

/// Batch, heads, query and key counts of a test case.
#[derive(Debug, Clone, Copy)]
pub(super) struct Sizes {
    pub(super) b: usize,
    pub(super) h: usize,
    pub(super) nq: usize,
    pub(super) nk: usize,
}

/// The default case: every sequence shorter than one fused tile.
pub(super) const SMALL: Sizes = Sizes {
    b: B,
    h: H,
    nq: NQ,
    nk: NK,
};

/// A case the fused kernel tiles: 2 query tiles (the last of 44 rows) and 3 key tiles (the last
/// of 8 keys).
pub(super) const TILED: Sizes = Sizes {
    b: 2,
    h: 2,
    nq: FUSED_TILE_Q + 44,
    nk: 2 * FUSED_TILE_K + 8,
};

/// q, k, v in `layout`, `v` drawn at `v_scale`.
fn qkv(layout: Layout, dtype: DType, v_scale: f32, seed: u64) -> (Tensor, Tensor, Tensor) {
    qkv_sized(SMALL, layout, dtype, v_scale, seed)
}

/// q, k, v of `sizes` in `layout`, `v` drawn at `v_scale`.
pub(super) fn qkv_sized(
    sizes: Sizes,
    layout: Layout,
    dtype: DType,
    v_scale: f32,
    seed: u64,
) -> (Tensor, Tensor, Tensor) {
    let Sizes { b, h, nq, nk } = sizes;
    let shape = |n: usize| match layout {
        Layout::Merged => vec![b, n, h * DIM],
        Layout::PerHead => vec![b, h, n, DIM],
    };
    (
        randn(&shape(nq), seed, 1.0, dtype),
        randn(&shape(nk), seed + 1, 1.0, dtype),
        randn(&shape(nk), seed + 2, v_scale, dtype),
    )
}

pub(super) fn u8_mask(shape: &[usize], seed: u64, keep: impl Fn(&[usize]) -> bool) -> Tensor {
    let noise = normal(shape.iter().product(), seed);
    let mut idx = vec![0usize; shape.len()];
    let mut data = Vec::with_capacity(noise.len());
    for x in noise {
        // Key 0 always attends, so no row is fully masked.
        let attend = keep(&idx) || idx[shape.len() - 1] == 0 || x > -0.5;
        data.push(u8::from(attend));
        for d in (0..shape.len()).rev() {
            idx[d] += 1;
            if idx[d] < shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    Tensor::from_vec(data, shape, &Device::Cpu).expect("mask")
}

/// The masks every backend is compared under, for `sizes`.
pub(super) fn masks(sizes: Sizes, dtype: DType) -> Vec<(&'static str, Option<Tensor>)> {
    let Sizes { b, h, nq, nk } = sizes;
    let key_padding = {
        // Batch 0 attends to all keys, the others to the first 100 (whole fused key tiles are
        // masked then).
        let data: Vec<u8> = (0..b * nk)
            .map(|i| u8::from(i / nk == 0 || i % nk < 100))
            .collect();
        Tensor::from_vec(data, (b, 1, 1, nk), &Device::Cpu).expect("mask")
    };
    let additive = randn(&[nq, nk], 99, 2.0, dtype);
    let additive_neg_inf = {
        // The first half of the keys are -inf for every query: whole key chunks (11 keys for
        // `SubQuadratic` in `TINY`, the first fused tile of `TILED`) see only -inf.
        let data: Vec<f32> = (0..b * nq * nk)
            .map(|i| {
                if i % nk < nk.div_ceil(2) {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        Tensor::from_vec(data, (b, 1, nq, nk), &Device::Cpu)
            .and_then(|t| t.to_dtype(dtype))
            .expect("mask")
    };
    vec![
        ("none", None),
        ("bool key padding [B,1,1,Nk]", Some(key_padding)),
        (
            "bool full [B,H,Nq,Nk]",
            Some(u8_mask(&[b, h, nq, nk], 7, |_| false)),
        ),
        ("additive [Nq,Nk]", Some(additive)),
        ("additive -inf [B,1,Nq,Nk]", Some(additive_neg_inf)),
    ]
}

/// Free memory that makes `Split` use 4 slices and `SubQuadratic` chunk keys for B·H = 6,
/// Nq 77, Nk 131, f32 scores.
const TIGHT: ByteSize = ByteSize(200 * 1024);
const TINY: ByteSize = ByteSize(100 * 1024);

/// (label, options) of every backend run compared against `Naive`.
fn contenders(layout: Layout) -> Vec<(&'static str, AttentionOptions)> {
    let o = |b: Backend, free: ByteSize| {
        AttentionOptions::new(b)
            .with_layout(layout)
            .with_free_memory(free)
    };
    vec![
        ("split, one slice", o(Backend::Split, ByteSize::MAX)),
        ("split, uneven slices", o(Backend::Split, TIGHT)),
        (
            "sub-quadratic, whole keys",
            o(Backend::SubQuadratic, ByteSize::MAX),
        ),
        ("sub-quadratic, key chunks", o(Backend::SubQuadratic, TINY)),
        ("sdpa (fused kernel)", o(Backend::Sdpa, ByteSize::MAX)),
        (
            "sdpa (fused kernel), one tile at a time",
            o(Backend::Sdpa, ByteSize(1)),
        ),
        ("flash (runs the fused kernel)", o(Backend::Flash, TINY)),
    ]
}

/// Every contender is within `atol + rtol·|naive|` of `Naive`, element by element, at the
/// `SMALL` and `TILED` sizes.
fn assert_backends_match_naive(dtype: DType, v_scale: f32, atol: f32, rtol: f32) {
    for (sizes, layout) in [
        (SMALL, Layout::Merged),
        (SMALL, Layout::PerHead),
        (TILED, Layout::PerHead),
    ] {
        let (q, k, v) = qkv_sized(sizes, layout, dtype, v_scale, 1);
        let h = sizes.h;
        for (mask_name, mask) in masks(sizes, dtype) {
            let naive = attention(
                &q,
                &k,
                &v,
                h,
                mask.as_ref(),
                &AttentionOptions::new(Backend::Naive).with_layout(layout),
            )
            .expect("naive");
            assert_eq!(naive.dims(), q.dims());
            for (name, options) in contenders(layout) {
                let out = attention(&q, &k, &v, h, mask.as_ref(), &options).expect(name);
                let excess = max_excess(&out, &naive, rtol);
                assert!(
                    excess <= atol,
                    "{dtype:?} {sizes:?} {layout:?} {name}, mask {mask_name}: |Δ| - {rtol}·|naive| reaches {excess} > {atol}"
                );
            }
        }
    }
}

#[test]
fn every_backend_matches_naive_in_f32() {
    assert_backends_match_naive(DType::F32, 1.0, 1e-5, 0.0);
}

#[test]
fn every_backend_matches_naive_in_f16() {
    assert_backends_match_naive(DType::F16, 1.0, 2e-3, 0.0);
}

/// bf16 keeps 8 significant bits: one rounding step of an output in [0.5, 1) is 3.9e-3, above
/// 2e-3 whatever the algorithm (measured: 3.9e-3 there, 1.6e-2 in [2, 4)). With `v` drawn at 0.1,
/// |out| < 0.25 where a step is ≤ 9.8e-4, so the absolute 2e-3 checks the algorithm; unscaled
/// outputs are allowed 2e-3 plus one rounding step (2⁻⁷·|out|).
#[test]
fn every_backend_matches_naive_in_bf16() {
    assert_backends_match_naive(DType::BF16, 0.1, 2e-3, 0.0);
    assert_backends_match_naive(DType::BF16, 1.0, 2e-3, 2f32.powi(-7));
}

#[test]
fn naive_matches_a_scalar_reference_loop() {
    let (q, k, v) = qkv(Layout::PerHead, DType::F32, 1.0, 5);
    let mask = u8_mask(&[B, H, NQ, NK], 3, |_| false);
    let out = attention(
        &q,
        &k,
        &v,
        H,
        Some(&mask),
        &AttentionOptions::new(Backend::Naive).with_layout(Layout::PerHead),
    )
    .expect("naive");
    let (qv, kv, vv, mv, ov) = (
        values(&q),
        values(&k),
        values(&v),
        values(&mask),
        values(&out),
    );
    let scale = 1.0 / (DIM as f64).sqrt();
    let mut worst = 0f64;
    for bh in 0..B * H {
        for i in 0..NQ {
            let scores: Vec<f64> = (0..NK)
                .map(|j| {
                    if mv[(bh * NQ + i) * NK + j] == 0.0 {
                        return f64::NEG_INFINITY;
                    }
                    (0..DIM)
                        .map(|d| {
                            qv[(bh * NQ + i) * DIM + d] as f64 * kv[(bh * NK + j) * DIM + d] as f64
                        })
                        .sum::<f64>()
                        * scale
                })
                .collect();
            let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let sum: f64 = e.iter().sum();
            for d in 0..DIM {
                let r: f64 = (0..NK)
                    .map(|j| e[j] / sum * vv[(bh * NK + j) * DIM + d] as f64)
                    .sum();
                worst = worst.max((r - ov[(bh * NQ + i) * DIM + d] as f64).abs());
            }
        }
    }
    assert!(worst < 1e-5, "naive differs from the f64 loop by {worst}");
}

#[test]
fn merged_and_per_head_layouts_give_the_same_numbers() {
    let (q, k, v) = qkv(Layout::Merged, DType::F32, 1.0, 11);
    let per_head = |t: &Tensor| {
        let (b, n, _) = t.dims3().expect("3d");
        t.reshape((b, n, H, DIM))
            .and_then(|t| t.transpose(1, 2))
            .and_then(|t| t.contiguous())
            .expect("per head")
    };
    for backend in [
        Backend::Naive,
        Backend::Split,
        Backend::SubQuadratic,
        Backend::Sdpa,
    ] {
        let merged = attention(
            &q,
            &k,
            &v,
            H,
            None,
            &AttentionOptions::new(backend).with_free_memory(TINY),
        )
        .expect("merged");
        let split = attention(
            &per_head(&q),
            &per_head(&k),
            &per_head(&v),
            H,
            None,
            &AttentionOptions::new(backend)
                .with_layout(Layout::PerHead)
                .with_free_memory(TINY),
        )
        .expect("per head");
        assert_eq!(split.dims(), &[B, H, NQ, DIM]);
        assert!(
            max_abs_diff(&per_head(&merged), &split) <= 1e-6,
            "{backend}"
        );
    }
}

#[test]
fn value_dim_may_differ_from_query_dim() {
    let q = randn(&[1, 10, 2 * 8], 1, 1.0, DType::F32);
    let k = randn(&[1, 13, 2 * 8], 2, 1.0, DType::F32);
    let v = randn(&[1, 13, 2 * 5], 3, 1.0, DType::F32);
    let naive = attention(&q, &k, &v, 2, None, &AttentionOptions::default()).expect("naive");
    assert_eq!(naive.dims(), &[1, 10, 10]);
    for backend in [Backend::SubQuadratic, Backend::Sdpa] {
        let out = attention(
            &q,
            &k,
            &v,
            2,
            None,
            &AttentionOptions::new(backend).with_free_memory(ByteSize(1)),
        )
        .expect("chunked");
        assert_eq!(out.dims(), &[1, 10, 10]);
        assert!(max_abs_diff(&naive, &out) <= 1e-5, "{backend}");
    }
}

#[test]
fn scale_override_replaces_inverse_sqrt_dim() {
    let (q, k, v) = qkv(Layout::Merged, DType::F32, 1.0, 21);
    let default = attention(&q, &k, &v, H, None, &AttentionOptions::default()).expect("default");
    let explicit = attention(
        &q,
        &k,
        &v,
        H,
        None,
        &AttentionOptions::default().with_scale(1.0 / (DIM as f64).sqrt()),
    )
    .expect("explicit");
    let doubled_q = (&q * 2.0).expect("2q");
    let halved = attention(
        &doubled_q,
        &k,
        &v,
        H,
        None,
        &AttentionOptions::default().with_scale(0.5 / (DIM as f64).sqrt()),
    )
    .expect("halved");
    assert_eq!(max_abs_diff(&default, &explicit), 0.0);
    assert!(max_abs_diff(&default, &halved) <= 1e-6);
}

#[test]
fn fully_bool_masked_rows_average_values_instead_of_nan() {
    let (q, k, v) = qkv(Layout::PerHead, DType::F32, 1.0, 31);
    let mask = Tensor::zeros((1, 1, 1, NK), DType::U8, &Device::Cpu).expect("mask");
    let mean_v = v.mean_keepdim(2).expect("mean");
    for (name, options) in contenders(Layout::PerHead) {
        let out = attention(&q, &k, &v, H, Some(&mask), &options).expect(name);
        let expected = mean_v.broadcast_as(out.shape()).expect("broadcast");
        assert!(max_abs_diff(&out, &expected) <= 1e-5, "{name}");
    }
}

#[test]
fn force_upcast_survives_f16_score_overflow_that_default_does_not() {
    // Scores near 1.8e5 overflow f16 (max 65504) unless Q·Kᵀ runs in f32.
    let q = (randn(&[1, 4, 2, 4], 41, 0.01, DType::F32) + 300.0).expect("q");
    let k = (randn(&[1, 4, 6, 4], 42, 0.01, DType::F32) + 300.0).expect("k");
    let v = randn(&[1, 4, 6, 4], 43, 1.0, DType::F32);
    let half = |t: &Tensor| t.to_dtype(DType::F16).expect("f16");
    for backend in [Backend::Naive, Backend::Sdpa] {
        let run = |upcast: Upcast| {
            let options = AttentionOptions::new(backend)
                .with_layout(Layout::PerHead)
                .with_upcast(upcast);
            values(&attention(&half(&q), &half(&k), &half(&v), 4, None, &options).expect("run"))
        };
        assert!(
            run(Upcast::Default).iter().any(|x| !x.is_finite()),
            "{backend}"
        );
        assert!(
            run(Upcast::Force).iter().all(|x| x.is_finite()),
            "{backend}"
        );
    }
}

#[test]
fn upcast_policy_picks_score_and_softmax_dtypes() {
    use DType::*;
    assert_eq!(Upcast::Default.score_dtype(F16), F16);
    assert_eq!(Upcast::Default.softmax_dtype(F16), F32);
    assert_eq!(Upcast::Default.softmax_dtype(BF16), F32);
    assert_eq!(Upcast::Force.score_dtype(BF16), F32);
    assert_eq!(Upcast::Never.softmax_dtype(F16), F16);
    assert_eq!(Upcast::Never.score_dtype(BF16), BF16);
    for u in [Upcast::Default, Upcast::Force, Upcast::Never] {
        assert_eq!(u.softmax_dtype(F32), F32);
    }
}

#[test]
fn never_upcast_stays_close_to_f32_softmax_in_f16() {
    let (q, k, v) = qkv(Layout::Merged, DType::F16, 1.0, 51);
    let options = |b| {
        AttentionOptions::new(b)
            .with_upcast(Upcast::Never)
            .with_free_memory(TINY)
    };
    let reference = attention(&q, &k, &v, H, None, &AttentionOptions::default()).expect("ref");
    for b in [
        Backend::Naive,
        Backend::Split,
        Backend::SubQuadratic,
        Backend::Sdpa,
    ] {
        let out = attention(&q, &k, &v, H, None, &options(b)).expect("never");
        assert_eq!(out.dtype(), DType::F16);
        let diff = max_abs_diff(&out, &reference);
        assert!(diff <= 1e-2, "{b}: {diff}");
    }
}

// ---- input validation -----------------------------------------------------------------------

#[test]
fn mask_that_does_not_broadcast_is_a_shape_mismatch() {
    let (q, k, v) = qkv(Layout::Merged, DType::F32, 1.0, 71);
    let mask = Tensor::ones((NQ, NK + 1), DType::U8, &Device::Cpu).expect("mask");
    let err = attention(&q, &k, &v, H, Some(&mask), &AttentionOptions::default()).expect_err("bad");
    assert!(matches!(err, Error::ShapeMismatch { .. }), "{err}");
}

#[test]
fn integer_mask_other_than_u8_is_rejected() {
    let (q, k, v) = qkv(Layout::Merged, DType::F32, 1.0, 72);
    let mask = Tensor::ones((NQ, NK), DType::U32, &Device::Cpu).expect("mask");
    let err = attention(&q, &k, &v, H, Some(&mask), &AttentionOptions::default()).expect_err("bad");
    assert!(matches!(err, Error::UnsupportedDtype { .. }), "{err}");
}

#[test]
fn heads_that_do_not_divide_channels_are_a_shape_mismatch() {
    let (q, k, v) = qkv(Layout::Merged, DType::F32, 1.0, 73);
    for heads in [0, 5] {
        let err =
            attention(&q, &k, &v, heads, None, &AttentionOptions::default()).expect_err("bad");
        assert!(matches!(err, Error::ShapeMismatch { .. }), "{err}");
    }
    let (q, k, v) = qkv(Layout::PerHead, DType::F32, 1.0, 74);
    let options = AttentionOptions::default().with_layout(Layout::PerHead);
    let err = attention(&q, &k, &v, H + 1, None, &options).expect_err("bad");
    assert!(matches!(err, Error::ShapeMismatch { .. }), "{err}");
}

#[test]
fn keys_and_values_of_different_lengths_are_a_shape_mismatch() {
    let q = randn(&[1, 4, 8], 1, 1.0, DType::F32);
    let k = randn(&[1, 5, 8], 2, 1.0, DType::F32);
    let v = randn(&[1, 6, 8], 3, 1.0, DType::F32);
    let err = attention(&q, &k, &v, 2, None, &AttentionOptions::default()).expect_err("bad");
    assert!(matches!(err, Error::ShapeMismatch { .. }), "{err}");
}

#[test]
fn empty_query_or_key_sequences_give_zeros() {
    let q = randn(&[1, 0, 8], 1, 1.0, DType::F32);
    let k = randn(&[1, 5, 8], 2, 1.0, DType::F32);
    let out = attention(&q, &k, &k, 2, None, &AttentionOptions::default()).expect("empty q");
    assert_eq!(out.dims(), &[1, 0, 8]);
    let q = randn(&[1, 3, 8], 1, 1.0, DType::F32);
    let k = randn(&[1, 0, 8], 2, 1.0, DType::F32);
    let out = attention(&q, &k, &k, 2, None, &AttentionOptions::default()).expect("empty k");
    assert_eq!(values(&out), vec![0.0; 24]);
}

// ---- dispatcher -----------------------------------------------------------------------------

fn input(
    requested: Option<BackendRequest>,
    device: DeviceKind,
    fused_kernel: bool,
    free: ByteSize,
    n: usize,
) -> DispatchInput {
    DispatchInput {
        requested,
        device,
        fused_kernel,
        free,
        shape: AttentionShape {
            batch_heads: 16,
            nq: n,
            nk: n,
            elem_bytes: 4,
        },
    }
}

#[test]
fn dispatcher_follows_its_documented_table() {
    use Backend as Bk;
    use BackendRequest as R;
    use DeviceKind::*;
    let big = ByteSize::gib(64);
    // 16 × 512² × 4 = 16 MiB of scores; 16 × 4096² × 4 = 1 GiB.
    let table = [
        // The CPU of this build: the fused kernel at every size and free memory.
        (None, Cpu, true, big, 512, Bk::Sdpa, false),
        (None, Cpu, true, ByteSize::mib(1), 4096, Bk::Sdpa, false),
        (Some(R::Sdpa), Cpu, true, big, 512, Bk::Sdpa, false),
        (Some(R::Flash), Cpu, true, big, 512, Bk::Sdpa, true),
        (Some(R::Sage), Cpu, true, big, 4096, Bk::Sdpa, true),
        (Some(R::Naive), Cpu, true, big, 512, Bk::Naive, false),
        (
            Some(R::SubQuadratic),
            Cpu,
            true,
            big,
            512,
            Bk::SubQuadratic,
            false,
        ),
        // A CPU without the fused kernel: naive while the scores are small.
        (None, Cpu, false, big, 512, Bk::Naive, false),
        (
            None,
            Cpu,
            false,
            ByteSize::mib(63),
            512,
            Bk::SubQuadratic,
            false,
        ),
        (None, Cpu, false, ByteSize::mib(64), 512, Bk::Naive, false),
        (None, Cpu, false, big, 4096, Bk::SubQuadratic, false),
        (None, Cuda, false, big, 512, Bk::SubQuadratic, false),
        (None, Cuda, true, big, 512, Bk::Sdpa, false),
        (None, Metal, true, big, 4096, Bk::Sdpa, false),
        (Some(R::Naive), Cuda, true, big, 4096, Bk::Naive, false),
        (Some(R::Split), Cpu, false, big, 4096, Bk::Split, false),
        (
            Some(R::SubQuadratic),
            Cuda,
            true,
            big,
            512,
            Bk::SubQuadratic,
            false,
        ),
        (Some(R::Sdpa), Cuda, true, big, 512, Bk::Sdpa, false),
        (Some(R::Sdpa), Cuda, false, big, 512, Bk::SubQuadratic, true),
        (Some(R::Sdpa), Cpu, false, big, 512, Bk::Naive, true),
        (Some(R::Flash), Cuda, true, big, 512, Bk::Sdpa, true),
        (
            Some(R::Flash),
            Cpu,
            false,
            big,
            4096,
            Bk::SubQuadratic,
            true,
        ),
        (Some(R::Sage), Cuda, false, big, 512, Bk::SubQuadratic, true),
        (Some(R::Sage), Cpu, false, big, 512, Bk::Naive, true),
    ];
    for (requested, device, fused, free, n, expected, falls_back) in table {
        let d = dispatch(&input(requested, device, fused, free, n));
        assert_eq!(
            d.backend, expected,
            "{requested:?} {device:?} fused {fused} free {free} n {n}"
        );
        assert_eq!(d.fallback.is_some(), falls_back, "{requested:?} {device:?}");
        if let Some(fb) = d.fallback {
            assert_eq!(Some(fb.requested), requested);
        }
    }
}

#[test]
fn fallback_warning_is_latched_once_per_condition() {
    let key = || "test:latch-once".to_string();
    assert!(latch(key()));
    assert!(!latch(key()));
    assert!(latch("test:another-condition".to_string()));
    // select_backend returns the dispatcher's choice whether or not it warns.
    let i = input(
        Some(BackendRequest::Sage),
        DeviceKind::Cpu,
        false,
        ByteSize::gib(1),
        64,
    );
    assert_eq!(select_backend(&i), Backend::Naive);
    assert_eq!(select_backend(&i), Backend::Naive);
}

#[test]
fn the_cpu_runs_sdpa_and_flash_on_the_fused_kernel_except_in_f64() {
    assert!(fused_kernel_available(&Device::Cpu));
    const { assert!(!FLASH_BUILT) };
    assert_eq!(DeviceKind::from(&Device::Cpu), DeviceKind::Cpu);
    let (q, k, v) = qkv(Layout::Merged, DType::F32, 1.0, 81);
    for b in [Backend::Sdpa, Backend::Flash] {
        let (_, stats) =
            attention_with_stats(&q, &k, &v, H, None, &AttentionOptions::new(b)).expect("runs");
        assert_eq!(stats.backend, Backend::Sdpa);
    }
    let to64 = |t: &Tensor| t.to_dtype(DType::F64).expect("f64");
    let (q, k, v) = (to64(&q), to64(&k), to64(&v));
    let (out, stats) =
        attention_with_stats(&q, &k, &v, H, None, &AttentionOptions::new(Backend::Sdpa))
            .expect("f64 runs");
    assert_eq!(stats.backend, Backend::SubQuadratic);
    assert_eq!(out.dtype(), DType::F64);
}

#[test]
fn only_naive_and_split_report_quadratic_memory() {
    let quadratic: Vec<_> = Backend::ALL
        .into_iter()
        .filter(|b| b.memory_profile().quadratic)
        .collect();
    assert_eq!(quadratic, vec![Backend::Naive, Backend::Split]);
    assert_eq!(
        Backend::SubQuadratic.to_string(),
        "sub-quadratic (memory-efficient)"
    );
    assert_eq!(BackendRequest::Sage.flag(), Some("--use-sage-attention"));
}

proptest! {
    #[test]
    fn split_slices_is_the_smallest_power_of_two_that_fits(
        bh in 1usize..64, nq in 1usize..20_000, nk in 1usize..20_000,
        elem in prop::sample::select(vec![2usize, 4]), free_mib in 1u64..4096,
    ) {
        let free = ByteSize::mib(free_mib);
        let need = |s: usize| 3 * (bh * nq.div_ceil(s) * nk * elem) as u64;
        match split_slices(bh, nq, nk, elem, free) {
            Ok(s) => {
                prop_assert!(s <= MAX_SPLIT_SLICES && s <= nq);
                prop_assert!(need(s) <= free.bytes());
                if s > 1 && s.is_power_of_two() {
                    prop_assert!(need(s / 2) > free.bytes());
                }
            }
            Err(_) => prop_assert!(need(MAX_SPLIT_SLICES) > free.bytes()),
        }
    }

    #[test]
    fn subquad_chunks_stay_within_the_sequence(
        bh in 1usize..64, nq in 1usize..20_000, nk in 2usize..20_000, free_mib in 0u64..8192,
    ) {
        let (qc, kc) = subquad_chunks(bh, nq, nk, 2, ByteSize::mib(free_mib));
        prop_assert!((1..=nq).contains(&qc) && (1..=nk).contains(&kc));
        if kc == nk {
            // A whole-key plan respects the 4× rule.
            prop_assert!(4 * (bh * qc * nk * 2) as u64 <= ByteSize::mib(free_mib).bytes());
        }
    }
}

#[test]
fn shapes_too_large_to_address_are_refused_before_any_kernel() {
    // F3: the kernels' length checks multiply sizes; a shape whose element count wraps must be
    // refused at the entry, never reach them.
    assert!(super::check_addressable(1, 8, 4096, 4096, 64, 64).is_ok());
    let huge = 1usize << 40;
    for (b, h, nq, nk, d, dv) in [
        (huge, huge, 1, 1, 1, 1),
        (1, 1, huge, 1, huge, 1),
        (1, 1, 1, huge, huge, 1),
        (1, 1, huge, huge, 1, 1),
        (1, 1, 1, usize::MAX - 3, 1, 1),
    ] {
        let e = super::check_addressable(b, h, nq, nk, d, dv).unwrap_err();
        assert!(e.to_string().contains("address"), "{e}");
    }
    assert_eq!(
        super::products::packed_len(usize::MAX, 64),
        usize::MAX,
        "saturates"
    );
}
