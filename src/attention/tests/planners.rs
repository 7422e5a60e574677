//! The split and sub-quadratic planners: slices and chunks for a memory bound.

use super::*;

#[test]
fn split_uses_two_slices_for_16_heads_4096_tokens_f16_in_1_gib() {
    assert_eq!(
        split_slices(16, 4096, 4096, 2, ByteSize::gib(1)).expect("fits"),
        2
    );
}

#[test]
fn split_uses_sixteen_slices_in_100_mib() {
    assert_eq!(
        split_slices(16, 4096, 4096, 2, ByteSize::mib(100)).expect("fits"),
        16
    );
}

#[test]
fn split_refuses_20_mib_and_names_the_largest_token_count_that_fits() {
    let free = ByteSize::mib(20);
    match split_slices(16, 4096, 4096, 2, free) {
        Err(Error::AttentionTooLarge {
            required,
            available,
            max_tokens,
        }) => {
            assert_eq!(available, free);
            assert_eq!(required, ByteSize::mib(24));
            assert!(max_tokens > 0 && max_tokens < 4096);
            assert!(split_slices(16, max_tokens, max_tokens, 2, free).is_ok());
            assert!(split_slices(16, max_tokens + 1, max_tokens + 1, 2, free).is_err());
        }
        other => panic!("expected AttentionTooLarge, got {other:?}"),
    }
}

#[test]
fn split_sizes_the_largest_uneven_slice() {
    // 77 rows in 2 slices: the larger has 39 rows, more than 77/2.
    let need = |rows: u64| ByteSize(3 * 6 * rows * 131 * 4);
    assert_eq!(split_slices(6, 77, 131, 4, need(39)).expect("fits"), 2);
    assert_eq!(
        split_slices(6, 77, 131, 4, ByteSize(need(39).bytes() - 1)).expect("fits"),
        4
    );
}

#[test]
fn split_never_uses_more_slices_than_query_rows() {
    assert_eq!(
        split_slices(1, 3, 1000, 4, ByteSize(3 * 1000 * 4)).expect("fits"),
        3
    );
}

#[test]
fn subquad_takes_whole_chunks_in_8_gib() {
    assert_eq!(
        subquad_chunks(16, 4096, 4096, 2, ByteSize::gib(8)),
        (4096, 4096)
    );
}

#[test]
fn subquad_halves_the_query_chunk_in_1_gib() {
    assert_eq!(
        subquad_chunks(16, 4096, 4096, 2, ByteSize::gib(1)),
        (2048, 4096)
    );
}

#[test]
fn subquad_chunks_keys_by_sqrt_in_64_mib() {
    assert_eq!(
        subquad_chunks(16, 4096, 4096, 2, ByteSize::mib(64)),
        (512, 64)
    );
}

#[test]
fn subquad_chunks_are_clamped_to_the_sequence() {
    assert_eq!(subquad_chunks(6, 77, 131, 4, ByteSize::MAX), (77, 131));
    assert_eq!(subquad_chunks(6, 77, 131, 4, ByteSize(1)), (77, 11));
    assert_eq!(subquad_chunks(1, 10, 3, 4, ByteSize(1)), (10, 1));
}

#[test]
fn measured_temporaries_stay_within_the_plan_and_free_memory() {
    // (B, H, Nq, Nk, dtype, upcast, free): plans that must fit.
    let cases = [
        (2, 3, 77, 131, DType::F32, Upcast::Default, TIGHT),
        (
            2,
            3,
            77,
            131,
            DType::F16,
            Upcast::Default,
            ByteSize(400 * 1024),
        ),
        (
            2,
            3,
            77,
            131,
            DType::BF16,
            Upcast::Force,
            ByteSize(400 * 1024),
        ),
        (2, 3, 77, 131, DType::F16, Upcast::Never, TIGHT),
        (
            1,
            8,
            300,
            257,
            DType::F32,
            Upcast::Default,
            ByteSize::mib(2),
        ),
        (
            1,
            4,
            1000,
            1000,
            DType::F16,
            Upcast::Default,
            ByteSize::mib(8),
        ),
    ];
    for (b, h, nq, nk, dtype, upcast, free) in cases {
        let q = randn(&[b, h, nq, DIM], 1, 1.0, dtype);
        let k = randn(&[b, h, nk, DIM], 2, 1.0, dtype);
        let v = randn(&[b, h, nk, DIM], 3, 1.0, dtype);
        let additive = randn(&[b, 1, nq, nk], 4, 1.0, DType::F32);
        let padding = u8_mask(&[b, 1, 1, nk], 5, |_| false);
        let shape = AttentionShape {
            batch_heads: b * h,
            nq,
            nk,
            elem_bytes: upcast.softmax_dtype(dtype).size_in_bytes(),
        };
        for backend in [Backend::Split, Backend::SubQuadratic, Backend::Sdpa] {
            let planned = peak_temporary_bytes(backend, &shape, free).expect("plan");
            assert!(planned <= free, "{backend} plans {planned} in {free}");
            // The fused kernel's tiles are fixed: sequences shorter than a tile are one tile.
            let one_tile = backend == Backend::Sdpa && nq <= FUSED_TILE_Q && nk <= FUSED_TILE_K;
            for mask in [None, Some(&additive), Some(&padding)] {
                let options = AttentionOptions::new(backend)
                    .with_layout(Layout::PerHead)
                    .with_upcast(upcast)
                    .with_free_memory(free);
                let (_, stats) =
                    attention_with_stats(&q, &k, &v, h, mask, &options).expect("attention");
                assert!(
                    stats.query_chunks > 1 || stats.key_chunks > 1 || one_tile,
                    "{backend} did not chunk"
                );
                assert!(
                    stats.peak_temporary > ByteSize::ZERO,
                    "{backend} measured nothing"
                );
                assert!(
                    stats.peak_temporary <= planned,
                    "{backend} {dtype:?} {upcast:?} nq {nq} nk {nk}: measured {} > planned {planned}",
                    stats.peak_temporary
                );
            }
        }
    }
}

#[test]
fn sub_quadratic_fallback_plan_fits_its_64_mib_example() {
    let shape = AttentionShape {
        batch_heads: 16,
        nq: 4096,
        nk: 4096,
        elem_bytes: 2,
    };
    let planned =
        peak_temporary_bytes(Backend::SubQuadratic, &shape, ByteSize::mib(64)).expect("plan");
    assert_eq!(planned, ByteSize(3 * 16 * 512 * 64 * 2));
    assert_eq!(
        peak_temporary_bytes(Backend::Naive, &shape, ByteSize::mib(64)).expect("plan"),
        ByteSize::mib(3 * 512)
    );
}

#[test]
fn split_reports_attention_too_large_through_the_entry_point() {
    let (q, k, v) = qkv(Layout::Merged, DType::F32, 1.0, 61);
    let err = attention(
        &q,
        &k,
        &v,
        H,
        None,
        &AttentionOptions::new(Backend::Split).with_free_memory(ByteSize(1000)),
    )
    .expect_err("cannot fit");
    assert!(matches!(err, Error::AttentionTooLarge { .. }), "{err}");
    assert!(!err.is_retryable());
}
