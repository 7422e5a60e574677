//! OFT: Cayley rotations of the output rows, block by block.

use super::*;

/// One 2×2 block `B = [[0, b], [0, 0]]`, so `Q = [[0, b], [-b, 0]]`.
fn oft_2x2(b: f32) -> Oft {
    Oft::new(tn(&[0.0, b, 0.0, 0.0], &[1, 2, 2]))
}

#[test]
fn oft_cayley_of_a_2x2_block_is_the_expected_rotation() {
    // Q = [[0, q], [-q, 0]]: I − Q = [[1, -q], [q, 1]], its inverse [[1, q], [-q, 1]] / (1 + q²),
    // R = (I + Q)(I − Q)⁻¹ = [[1 − q², 2q], [-2q, 1 − q²]] / (1 + q²). q = 0.5: [[.6, .8], [-.8, .6]].
    let r = cayley("k", &oft_2x2(0.5)).unwrap();
    let expected = [0.6, 0.8, -0.8, 0.6];
    for (g, e) in r.iter().zip(expected) {
        assert!((g - e).abs() < 1e-12, "{r:?}");
    }
}

#[test]
fn oft_rotations_are_orthogonal() {
    // Three 4×4 blocks of arbitrary values, unconstrained and constrained.
    let data: Vec<f32> = (0..48)
        .map(|v| ((v * 37 % 17) as f32 - 8.0) * 0.13)
        .collect();
    for alpha in [None, Some(0.3)] {
        let o = Oft {
            blocks: tn(&data, &[3, 4, 4]),
            alpha,
        };
        let r: Vec<f32> = cayley("k", &o).unwrap().iter().map(|&v| v as f32).collect();
        for b in 0..3 {
            let m = &r[b * 16..(b + 1) * 16];
            for i in 0..4 {
                for j in 0..4 {
                    let dot: f32 = (0..4).map(|l| m[i * 4 + l] * m[j * 4 + l]).sum();
                    let want = if i == j { 1.0 } else { 0.0 };
                    assert!((dot - want).abs() < 1e-5, "block {b} ({i},{j}): {dot}");
                }
            }
            // Not the identity: the blocks really rotate.
            assert!((m[0] - 1.0).abs() > 1e-3 || m[1].abs() > 1e-3);
        }
    }
}

#[test]
fn oft_rotates_output_rows_by_r_transposed() {
    // Rᵀ = [[.6, -.8], [.8, .6]]; W = [[1, 2], [3, 4]]:
    // Rᵀ·W = [[.6 − 2.4, 1.2 − 3.2], [.8 + 1.8, 1.6 + 2.4]] = [[-1.8, -2], [2.6, 4]].
    let w = t2(&[&[1.0, 2.0], &[3.0, 4.0]]);
    let out = run(&w, &[PatchEntry::new(Patch::Oft(oft_2x2(0.5)))]);
    assert_close(&out, &[-1.8, -2.0, 2.6, 4.0], 1e-6);
}

#[test]
fn oft_blocks_are_block_diagonal() {
    // Block 0 as above, block 1 zero (R = I): rows 0-1 rotate, rows 2-3 stay.
    // Rᵀ·[1, 2] = [.6 − 1.6, .8 + 1.2] = [-1, 2].
    let o = Oft::new(tn(&[0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], &[2, 2, 2]));
    let w = tn(&[1.0, 2.0, 3.0, 4.0], &[4, 1]);
    let out = run(&w, &[PatchEntry::new(Patch::Oft(o))]);
    assert_close(&out, &[-1.0, 2.0, 3.0, 4.0], 1e-6);
}

#[test]
fn oft_on_a_conv_rotates_whole_output_filters() {
    // W [2, 1, 1, 2] with filters [1, 2] and [3, 4]: the same numbers as the 2×2 case.
    let w = tn(&[1.0, 2.0, 3.0, 4.0], &[2, 1, 1, 2]);
    let out = run(&w, &[PatchEntry::new(Patch::Oft(oft_2x2(0.5)))]);
    assert_eq!(out.dims(), &[2, 1, 1, 2]);
    assert_close(&out, &[-1.8, -2.0, 2.6, 4.0], 1e-6);
}

#[test]
fn oft_strength_scales_the_rotation_step_by_its_square() {
    // ComfyUI: W + s·(s·Rᵀ − s·I)·W. s = 0.5: W + 0.25·(Rᵀ·W − W)
    // = [[1 − .7, 2 − 1], [3 − .1, 4 + 0]] = [[.3, 1], [2.9, 4]].
    let w = t2(&[&[1.0, 2.0], &[3.0, 4.0]]);
    let e = PatchEntry::new(Patch::Oft(oft_2x2(0.5))).with_strengths(0.5, 1.0);
    assert_close(&run(&w, &[e]), &[0.3, 1.0, 2.9, 4.0], 1e-6);
}

#[test]
fn oft_alpha_caps_the_norm_of_q() {
    // b = 2: ‖Q‖ = √8. alpha = √8 / 4 scales Q by 1/4 (the 1e-8 aside) → q = 0.5.
    let w = t2(&[&[1.0, 2.0], &[3.0, 4.0]]);
    let mut o = oft_2x2(2.0);
    o.alpha = Some(8f32.sqrt() / 4.0);
    let out = run(&w, &[PatchEntry::new(Patch::Oft(o.clone()))]);
    assert_close(&out, &[-1.8, -2.0, 2.6, 4.0], 1e-5);
    // A constraint above the norm leaves q = 2: R = [[-3, 4], [-4, -3]] / 5,
    // Rᵀ = [[-.6, -.8], [.8, -.6]], Rᵀ·W = [[-.6 − 2.4, -1.2 − 3.2], [.8 − 1.8, 1.6 − 2.4]].
    o.alpha = Some(10.0);
    let out = run(&w, &[PatchEntry::new(Patch::Oft(o))]);
    assert_close(&out, &[-3.0, -4.4, -1.0, -0.8], 1e-5);
}

#[test]
fn oft_at_zero_strength_leaves_the_weight_bit_for_bit() {
    let w = t2(&[&[0.1, 0.2], &[0.3, 0.7]]);
    let e = PatchEntry::new(Patch::Oft(oft_2x2(0.5))).with_strengths(0.0, 1.0);
    assert_eq!(vals(&run(&w, &[e])), vals(&w));
}

#[test]
fn oft_for_another_output_width_is_rejected_naming_key_and_shapes() {
    let e = PatchEntry::new(Patch::Oft(Oft::new(full(0.1, &[2, 2, 2]))));
    let err = validate("blocks.2.attn.proj.weight", &[3, 2], &e).unwrap_err();
    assert_patch_shape(&err, "blocks.2.attn.proj.weight", &[3, 2], &[4, 2]);
    assert!(apply("k", &full(0.0, &[3, 2]), &[e], DoraNorm::Standard).is_err());
    // Butterfly (BOFT) blocks and non-square blocks are refused as malformed.
    for d in [&[1, 2, 2, 2][..], &[2, 2, 1]] {
        let e = PatchEntry::new(Patch::Oft(Oft::new(full(0.1, d))));
        let err = validate("k", &[4, 2], &e).unwrap_err();
        assert!(matches!(err, Error::BadPatch { .. }), "{err}");
    }
}
