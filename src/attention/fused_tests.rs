//! Unit tests of the fused CPU kernel beyond the shared agreement tests of `tests.rs`: its bits do
//! not depend on free memory or threads, its plan, its `exp`, and masks that broadcast along the
//! keys.

use candle_core::{DType, Device, Tensor};

use super::rows::exp_nonpositive;
use super::tests::{masks, max_abs_diff, qkv_sized, randn, u8_mask, TILED};
use super::*;

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_dtype(DType::F32)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f32>())
        .expect("values")
        .into_iter()
        .map(f32::to_bits)
        .collect()
}

fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("thread pool")
}

#[test]
fn fused_output_bits_do_not_depend_on_free_memory_or_threads() {
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let (q, k, v) = qkv_sized(TILED, Layout::PerHead, dtype, 1.0, 3);
        for (mask_name, mask) in masks(TILED, dtype) {
            let run = |free: ByteSize, threads: usize| {
                let options = AttentionOptions::new(Backend::Sdpa)
                    .with_layout(Layout::PerHead)
                    .with_free_memory(free);
                let (out, stats) = pool(threads)
                    .install(|| attention_with_stats(&q, &k, &v, TILED.h, mask.as_ref(), &options))
                    .expect("fused");
                (bits(&out), stats)
            };
            let (ample, ample_stats) = run(ByteSize::MAX, 3);
            let (tight, tight_stats) = run(ByteSize(1), 3);
            let (alone, _) = run(ByteSize::MAX, 1);
            assert_eq!(
                ample, tight,
                "{dtype:?} {mask_name}: ample vs one tile of memory"
            );
            assert_eq!(ample, alone, "{dtype:?} {mask_name}: 3 threads vs 1");
            // The schedules really differed: one tile alive against up to three.
            let tile = (FUSED_TILE_Q * FUSED_TILE_K * 4) as u64;
            assert_eq!(tight_stats.peak_temporary, ByteSize(tile));
            assert!(ample_stats.peak_temporary <= ByteSize(3 * tile));
            assert_eq!((ample_stats.query_chunks, ample_stats.key_chunks), (2, 3));
        }
    }
}

#[test]
fn fused_plan_runs_as_many_tiles_as_threads_tasks_and_memory_allow() {
    let shape = |bh: usize, nq: usize, nk: usize| AttentionShape {
        batch_heads: bh,
        nq,
        nk,
        elem_bytes: 4,
    };
    let tile = ByteSize((FUSED_TILE_Q * FUSED_TILE_K * 4) as u64);
    // (shape, free, threads) → (tile_q, tile_k, tasks, workers)
    let table = [
        (shape(8, 4096, 4096), ByteSize::MAX, 2, (256, 256, 128, 2)),
        (
            shape(8, 4096, 4096),
            ByteSize::mib(64),
            16,
            (256, 256, 128, 16),
        ),
        (
            shape(8, 4096, 4096),
            ByteSize(3 * tile.bytes() - 1),
            16,
            (256, 256, 128, 2),
        ),
        (shape(8, 4096, 4096), ByteSize(1), 16, (256, 256, 128, 1)),
        (shape(2, 100, 30), ByteSize::MAX, 16, (100, 30, 2, 2)),
        (shape(1, 257, 300), ByteSize::MAX, 16, (256, 256, 2, 2)),
    ];
    for (s, free, threads, (tile_q, tile_k, tasks, workers)) in table {
        let plan = fused_plan(&s, free, threads);
        assert_eq!(
            (plan.tile_q, plan.tile_k, plan.tasks, plan.workers),
            (tile_q, tile_k, tasks, workers),
            "{s:?} in {free} on {threads} threads"
        );
        assert_eq!(
            plan.peak_bytes().bytes(),
            (workers * tile_q * tile_k * 4) as u64
        );
    }
}

#[test]
fn exp_is_within_two_ulp_and_exact_at_zero_and_minus_infinity() {
    let mut worst = 0f64;
    let mut x = -100f32;
    while x <= 0.0 {
        let got = exp_nonpositive(x) as f64;
        let want = (x as f64).exp();
        if want >= f32::MIN_POSITIVE as f64 {
            let ulp = f32::EPSILON as f64 * want;
            worst = worst.max((got - want).abs() / ulp);
        } else {
            assert!(got < 1.2e-38, "exp({x}) = {got}");
        }
        x += 0.000_731;
    }
    assert!(worst <= 2.0, "exp is off by {worst} ulp");
    assert_eq!(exp_nonpositive(0.0), 1.0);
    assert_eq!(exp_nonpositive(-0.0), 1.0);
    assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
    assert_eq!(exp_nonpositive(f32::MIN), 0.0);
    assert!(exp_nonpositive(f32::NAN).is_nan());
}

/// In f32 the fused kernel is as close to the exact (f64) result as `Naive` is: never more than
/// twice `Naive`'s own error (floored at 3e-7, a few ulp of the outputs).
#[test]
fn fused_is_as_close_to_an_f64_reference_as_naive_in_f32() {
    let (q, k, v) = qkv_sized(TILED, Layout::PerHead, DType::F32, 1.0, 5);
    let to64 = |t: &Tensor| t.to_dtype(DType::F64).expect("f64");
    for (mask_name, mask) in masks(TILED, DType::F32) {
        let run = |backend, q: &Tensor, k: &Tensor, v: &Tensor, m: Option<&Tensor>| {
            let options = AttentionOptions::new(backend).with_layout(Layout::PerHead);
            attention(q, k, v, TILED.h, m, &options).expect("attention")
        };
        let mask64 = mask.as_ref().map(|m| match m.dtype() {
            DType::U8 => m.clone(),
            _ => to64(m),
        });
        let exact = run(
            Backend::Naive,
            &to64(&q),
            &to64(&k),
            &to64(&v),
            mask64.as_ref(),
        );
        let naive = max_abs_diff(&run(Backend::Naive, &q, &k, &v, mask.as_ref()), &exact);
        let fused = max_abs_diff(&run(Backend::Sdpa, &q, &k, &v, mask.as_ref()), &exact);
        assert!(
            fused <= 2.0 * naive.max(3e-7),
            "mask {mask_name}: fused is {fused} from f64, naive {naive}"
        );
    }
}

#[test]
fn masks_broadcast_along_the_keys_match_naive() {
    let (q, k, v) = qkv_sized(TILED, Layout::PerHead, DType::F32, 1.0, 9);
    let per_query_bool = u8_mask(&[TILED.nq, 1], 4, |_| false);
    let per_query_additive = randn(&[TILED.b, 1, TILED.nq, 1], 5, 3.0, DType::F32);
    let per_head_bool = u8_mask(&[TILED.h, 1, TILED.nk], 6, |_| false);
    for mask in [per_query_bool, per_query_additive, per_head_bool] {
        let run = |backend| {
            let options = AttentionOptions::new(backend).with_layout(Layout::PerHead);
            attention(&q, &k, &v, TILED.h, Some(&mask), &options).expect("attention")
        };
        let diff = max_abs_diff(&run(Backend::Sdpa), &run(Backend::Naive));
        assert!(diff <= 1e-6, "mask {:?}: {diff}", mask.dims());
    }
}

#[test]
fn fused_output_has_the_input_layout_and_dtype() {
    let q = randn(&[1, 300, 2 * 8], 1, 1.0, DType::BF16);
    let k = randn(&[1, 40, 2 * 8], 2, 1.0, DType::BF16);
    let v = randn(&[1, 40, 2 * 5], 3, 1.0, DType::BF16);
    let out = attention(&q, &k, &v, 2, None, &AttentionOptions::new(Backend::Sdpa)).expect("run");
    assert_eq!(out.dims(), &[1, 300, 10]);
    assert_eq!(out.dtype(), DType::BF16);
    let empty_v = Tensor::zeros((1, 40, 0), DType::F32, &Device::Cpu).expect("v");
    let to32 = |t: &Tensor| t.to_dtype(DType::F32).expect("f32");
    let out = attention(
        &to32(&q),
        &to32(&k),
        &empty_v,
        2,
        None,
        &AttentionOptions::new(Backend::Sdpa),
    )
    .expect("empty values");
    assert_eq!(out.dims(), &[1, 300, 0]);
}

/// Runs `f` with the fused kernel's `gemm` path forced (`true`) or its own choice (`false`, the
/// AVX-512 tile products where the CPU has them).
fn with_portable<R>(portable: bool, f: impl FnOnce() -> R) -> R {
    super::products::FORCE_PORTABLE.with(|p| p.set(portable));
    let out = f();
    super::products::FORCE_PORTABLE.with(|p| p.set(false));
    out
}

/// Both tile-product paths (AVX-512 and `gemm`) agree with `Naive` on shapes no block divides:
/// head sizes 40 (queries, keys) and 72 (values), a last query tile of 44 rows (not a multiple
/// of the 6-row blocks) and a last key tile of 8 keys (a partial panel), under every mask.
#[test]
fn both_product_paths_match_naive_on_ragged_shapes() {
    let sizes = super::tests::Sizes {
        b: 1,
        h: 2,
        nq: FUSED_TILE_Q + 44,
        nk: 2 * FUSED_TILE_K + 8,
    };
    let q = randn(&[sizes.b, sizes.h, sizes.nq, 40], 21, 1.0, DType::F32);
    let k = randn(&[sizes.b, sizes.h, sizes.nk, 40], 22, 1.0, DType::F32);
    let v = randn(&[sizes.b, sizes.h, sizes.nk, 72], 23, 1.0, DType::F32);
    for (mask_name, mask) in masks(sizes, DType::F32) {
        let run = |backend| {
            let options = AttentionOptions::new(backend).with_layout(Layout::PerHead);
            attention(&q, &k, &v, sizes.h, mask.as_ref(), &options).expect("attention")
        };
        let naive = run(Backend::Naive);
        for portable in [false, true] {
            let fused = with_portable(portable, || run(Backend::Sdpa));
            let diff = max_abs_diff(&fused, &naive);
            assert!(
                diff <= 1e-5,
                "mask {mask_name}, gemm path {portable}: {diff}"
            );
        }
    }
}

/// The AVX-512 online-softmax step gives the portable step's bits on every row: batches of 16
/// rows and a remainder, row lengths with and without a partial last vector, several steps in a
/// row (so `alpha` and the running sums carry, with `l·alpha` and the new sum of one size), rows of huge and tiny scores (some `exp`s
/// underflow to 0), a boolean-masked row at the floor, `-inf` scores and a NaN.
#[test]
fn avx512_softmax_step_has_the_portable_bits() {
    let Some(isa) = super::products::Avx512::detect() else {
        eprintln!("no AVX-512 on this CPU: nothing to compare");
        return;
    };
    let floor = f32::MIN;
    for (rows, cols) in [(16, 256), (37, 256), (33, 40), (16, 7), (48, 16), (5, 300)] {
        let mut seed = 0x9e37_79b9_u32.wrapping_mul(rows as u32 * 1000 + cols as u32);
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            seed
        };
        let init = |v: &mut Vec<f32>, x: f32| v.resize(rows, x);
        let (mut m_a, mut l_a, mut a_a) = (Vec::new(), Vec::new(), Vec::new());
        init(&mut m_a, floor);
        init(&mut l_a, 0.0);
        init(&mut a_a, 0.0);
        let (mut m_b, mut l_b, mut a_b) = (m_a.clone(), l_a.clone(), a_a.clone());
        for step in 0..3 {
            let mut tile: Vec<f32> = (0..rows * cols)
                .map(|i| {
                    let row = i / cols;
                    let unit = next() as f32 / u32::MAX as f32 - 0.5;
                    // Rows of different spreads: 1, 4 and 300 (e^-300 underflows), moved up
                    // a little each step, so the running maximum grows by about as much and
                    // `alpha` is neither 1 nor negligible.
                    unit * [2.0, 8.0, 600.0][row % 3] + 0.7 * step as f32
                })
                .collect();
            tile[..cols].fill(floor);
            if rows > 20 {
                tile[cols * 17 + cols / 2] = f32::NEG_INFINITY;
                tile[cols * 18..cols * 19].fill(f32::NEG_INFINITY);
            }
            if rows > 30 && step == 1 {
                tile[cols * 30 + 1] = f32::NAN;
            }
            let mut tile_b = tile.clone();
            super::rows::softmax_tile(&mut tile, cols, &mut m_a, &mut l_a, &mut a_a);
            isa.softmax_tile(&mut tile_b, cols, &mut m_b, &mut l_b, &mut a_b);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let at = format!("{rows} x {cols}, step {step}");
            assert_eq!(bits(&tile), bits(&tile_b), "probabilities, {at}");
            assert_eq!(bits(&m_a), bits(&m_b), "maxima, {at}");
            assert_eq!(bits(&l_a), bits(&l_b), "sums, {at}");
            assert_eq!(bits(&a_a), bits(&a_b), "alphas, {at}");
        }
    }
}
