//! Unit tests of the patch kinds: each kind's math on small hand-checked weights, strengths,
//! offsets, DoRA, and the shape rules that reject a misfit naming key and shapes.

use candle_core::{DType, Device, Tensor};

use super::oft::cayley;
use super::*;
use crate::error::Error;

mod oft;

/// `err` is a [`Error::PatchShape`] naming `key`, `weight` and `patch`.
fn assert_patch_shape(err: &Error, key: &str, weight: &[usize], patch: &[usize]) {
    match err {
        Error::PatchShape {
            key: k,
            weight_shape,
            patch_shape,
            ..
        } => assert_eq!(
            (k.as_str(), weight_shape.as_slice(), patch_shape.as_slice()),
            (key, weight, patch)
        ),
        other => panic!("expected a PatchShape error, got {other}"),
    }
}

fn t2(rows: &[&[f32]]) -> Tensor {
    let r = rows.len();
    let c = rows[0].len();
    let flat: Vec<f32> = rows.iter().flat_map(|r| r.iter().copied()).collect();
    Tensor::from_vec(flat, (r, c), &Device::Cpu).unwrap()
}

fn tn(data: &[f32], shape: &[usize]) -> Tensor {
    Tensor::from_vec(data.to_vec(), shape, &Device::Cpu).unwrap()
}

fn full(v: f32, shape: &[usize]) -> Tensor {
    (Tensor::ones(shape, DType::F32, &Device::Cpu).unwrap() * f64::from(v)).unwrap()
}

fn vals(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

fn assert_close(t: &Tensor, expected: &[f32], tol: f32) {
    let got = vals(t);
    assert_eq!(got.len(), expected.len(), "{got:?} vs {expected:?}");
    for (g, e) in got.iter().zip(expected) {
        assert!((g - e).abs() <= tol, "{got:?} vs {expected:?}");
    }
}

fn run(w: &Tensor, entries: &[PatchEntry]) -> Tensor {
    apply("k", w, entries, DoraNorm::Standard).unwrap()
}

fn lora_entry(l: Lora, s: f32) -> PatchEntry {
    PatchEntry::new(Patch::Lora(l)).with_strengths(s, 1.0)
}

#[test]
fn lora_delta_is_scaled_by_strength_times_alpha_over_rank() {
    let w = full(0.0, &[2, 2]);
    let mut l = Lora::new(t2(&[&[1.0], &[2.0]]), t2(&[&[3.0, 4.0]]));
    l.alpha = Some(0.5);
    let out = run(&w, &[lora_entry(l.clone(), 2.0)]);
    assert_close(&out, &[3.0, 4.0, 6.0, 8.0], 0.0);
    l.alpha = None;
    let out = run(&w, &[lora_entry(l, 2.0)]);
    assert_close(&out, &[6.0, 8.0, 12.0, 16.0], 0.0);
}

#[test]
fn strength_model_scales_weight_accumulated_so_far() {
    let w = full(1.0, &[1, 1]);
    let diff = Patch::Diff {
        diff: full(1.0, &[1, 1]),
        pad: false,
    };
    let out = run(&w, &[PatchEntry::new(diff).with_strengths(1.0, 0.5)]);
    assert_close(&out, &[1.5], 0.0);
}

#[test]
fn model_merge_interpolates_between_two_weights() {
    // ComfyUI's merge: base w2, entry Diff(w1) with strength_patch r, strength_model 1 - r.
    let (w1, w2, r) = (2.0, 4.0, 0.25);
    let diff = Patch::Diff {
        diff: full(w1, &[3]),
        pad: false,
    };
    let out = run(
        &full(w2, &[3]),
        &[PatchEntry::new(diff).with_strengths(r, 1.0 - r)],
    );
    assert_close(&out, &[3.5, 3.5, 3.5], 0.0);
}

#[test]
fn patches_apply_in_order() {
    let w = full(1.0, &[2]);
    let set = PatchEntry::new(Patch::Set(full(5.0, &[2])));
    let diff = PatchEntry::new(Patch::Diff {
        diff: full(1.0, &[2]),
        pad: false,
    });
    assert_close(&run(&w, &[diff.clone(), set.clone()]), &[5.0, 5.0], 0.0);
    assert_close(&run(&w, &[set, diff]), &[6.0, 6.0], 0.0);
}

#[test]
fn set_ignores_strength() {
    let w = full(1.0, &[2, 2]);
    let e = PatchEntry::new(Patch::Set(full(7.0, &[2, 2]))).with_strengths(0.3, 0.5);
    assert_close(&run(&w, &[e]), &[7.0; 4], 0.0);
}

#[test]
fn offset_diff_changes_only_the_narrowed_rows() {
    let w = full(0.0, &[4, 2]);
    let e = PatchEntry::new(Patch::Diff {
        diff: full(1.0, &[2, 2]),
        pad: false,
    })
    .with_offset(Offset {
        dim: 0,
        start: 2,
        len: 2,
    });
    let out = run(&w, &[e]);
    assert_eq!(out.dims(), &[4, 2]);
    assert_close(&out, &[0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0], 0.0);
}

#[test]
fn strength_model_with_offset_scales_only_the_narrowed_region() {
    let w = full(1.0, &[2, 4]);
    let e = PatchEntry::new(Patch::Diff {
        diff: full(0.0, &[2, 1]),
        pad: false,
    })
    .with_strengths(1.0, 0.5)
    .with_offset(Offset {
        dim: 1,
        start: 1,
        len: 1,
    });
    let out = run(&w, &[e]);
    assert_close(&out, &[1.0, 0.5, 1.0, 1.0, 1.0, 0.5, 1.0, 1.0], 0.0);
}

#[test]
fn offset_outside_weight_is_rejected() {
    let e = PatchEntry::new(Patch::Diff {
        diff: full(1.0, &[2, 2]),
        pad: false,
    })
    .with_offset(Offset {
        dim: 0,
        start: 3,
        len: 2,
    });
    let err = validate("blk.w", &[4, 2], &e).unwrap_err();
    assert!(
        matches!(err, Error::BadPatch { ref key, .. } if key == "blk.w"),
        "{err}"
    );
}

#[test]
fn loha_is_hadamard_product_of_two_low_rank_products() {
    let h = LoHa {
        w1a: t2(&[&[1.0], &[1.0]]),
        w1b: t2(&[&[2.0, 2.0]]),
        w2a: t2(&[&[1.0], &[1.0]]),
        w2b: t2(&[&[3.0, 3.0]]),
        t1: None,
        t2: None,
        alpha: None,
        dora_scale: None,
    };
    let out = run(&full(1.0, &[2, 2]), &[PatchEntry::new(Patch::LoHa(h))]);
    assert_close(&out, &[7.0; 4], 0.0);
}

#[test]
fn loha_alpha_scales_by_w1b_rank() {
    let h = LoHa {
        w1a: t2(&[&[1.0, 1.0]]),
        w1b: t2(&[&[1.0], &[1.0]]),
        w2a: t2(&[&[1.0]]),
        w2b: t2(&[&[3.0]]),
        t1: None,
        t2: None,
        alpha: Some(1.0),
        dora_scale: None,
    };
    // (1·1 + 1·1) · 3 · (1 / 2) = 3
    let out = run(&full(0.0, &[1, 1]), &[PatchEntry::new(Patch::LoHa(h))]);
    assert_close(&out, &[3.0], 0.0);
}

/// Reference einsum 'ijkl,jr,ip->prkl' by loops.
fn tucker_ref(t: &[f32], td: [usize; 4], a: &[f32], p: usize, b: &[f32], q: usize) -> Vec<f32> {
    let [ni, nj, nk, nl] = td;
    let mut out = vec![0.0; p * q * nk * nl];
    for pp in 0..p {
        for qq in 0..q {
            for k in 0..nk {
                for l in 0..nl {
                    let mut s = 0.0;
                    for i in 0..ni {
                        for j in 0..nj {
                            s +=
                                t[((i * nj + j) * nk + k) * nl + l] * b[j * q + qq] * a[i * p + pp];
                        }
                    }
                    out[((pp * q + qq) * nk + k) * nl + l] = s;
                }
            }
        }
    }
    out
}

#[test]
fn loha_tucker_form_matches_reference_contraction() {
    // t [2, 2, 1, 2], a [2, out=3], b [2, in=2]; both factors the same, so delta = m ⊙ m.
    let t: Vec<f32> = (1..=8).map(|v| v as f32 * 0.5).collect();
    let a: Vec<f32> = vec![1.0, -1.0, 2.0, 0.5, 3.0, -2.0];
    let b: Vec<f32> = vec![1.0, 2.0, -1.0, 0.5];
    let m = tucker_ref(&t, [2, 2, 1, 2], &a, 3, &b, 2);
    let h = LoHa {
        w1a: tn(&a, &[2, 3]),
        w1b: tn(&b, &[2, 2]),
        w2a: tn(&a, &[2, 3]),
        w2b: tn(&b, &[2, 2]),
        t1: Some(tn(&t, &[2, 2, 1, 2])),
        t2: Some(tn(&t, &[2, 2, 1, 2])),
        alpha: None,
        dora_scale: None,
    };
    let out = run(
        &full(0.0, &[3, 2, 1, 2]),
        &[PatchEntry::new(Patch::LoHa(h))],
    );
    let expected: Vec<f32> = m.iter().map(|v| v * v).collect();
    assert_close(&out, &expected, 1e-4);
}

#[test]
fn lokr_is_kronecker_product() {
    let k = LoKr {
        w1: Some(t2(&[&[1.0, 2.0]])),
        w2: Some(t2(&[&[1.0], &[1.0]])),
        alpha: Some(8.0), // ignored: no factor is factorised
        ..LoKr::default()
    };
    let out = run(&full(0.0, &[2, 2]), &[PatchEntry::new(Patch::LoKr(k))]);
    assert_close(&out, &[1.0, 2.0, 1.0, 2.0], 0.0);

    // kron([[1,2],[3,4]], [[0,1],[1,0]])
    let k = LoKr {
        w1: Some(t2(&[&[1.0, 2.0], &[3.0, 4.0]])),
        w2: Some(t2(&[&[0.0, 1.0], &[1.0, 0.0]])),
        ..LoKr::default()
    };
    let out = run(&full(0.0, &[4, 4]), &[PatchEntry::new(Patch::LoKr(k))]);
    #[rustfmt::skip]
    let expected = [
        0.0, 1.0, 0.0, 2.0,
        1.0, 0.0, 2.0, 0.0,
        0.0, 3.0, 0.0, 4.0,
        3.0, 0.0, 4.0, 0.0,
    ];
    assert_close(&out, &expected, 0.0);
}

#[test]
fn lokr_factorised_form_uses_alpha_over_rank() {
    // w2 = w2a·w2b = [[1],[1]]·[[1, 1]] (rank 1) = ones(2,2); alpha 0.5 → scale 0.5.
    let k = LoKr {
        w1: Some(t2(&[&[2.0]])),
        w2a: Some(t2(&[&[1.0], &[1.0]])),
        w2b: Some(t2(&[&[1.0, 1.0]])),
        alpha: Some(0.5),
        ..LoKr::default()
    };
    let out = run(&full(0.0, &[2, 2]), &[PatchEntry::new(Patch::LoKr(k))]);
    assert_close(&out, &[1.0; 4], 0.0);
}

#[test]
fn conv_lora_reshapes_delta_to_the_kernel() {
    // weight [out 2, in 1, 2, 2]; up [2, 1, 1, 1], down [1, 1, 2, 2].
    let up = tn(&[1.0, 2.0], &[2, 1, 1, 1]);
    let down = tn(&[1.0, 2.0, 3.0, 4.0], &[1, 1, 2, 2]);
    let out = run(
        &full(0.0, &[2, 1, 2, 2]),
        &[PatchEntry::new(Patch::Lora(Lora::new(up, down)))],
    );
    assert_eq!(out.dims(), &[2, 1, 2, 2]);
    assert_close(&out, &[1.0, 2.0, 3.0, 4.0, 2.0, 4.0, 6.0, 8.0], 0.0);
}

#[test]
fn conv_lora_with_mid_composes_up_mid_down() {
    // up [out 2, a 2, 1, 1], mid [a 2, b 3, 1, 2], down [b 3, in 2, 1, 1].
    let up: Vec<f32> = vec![1.0, 2.0, -1.0, 0.5];
    let mid: Vec<f32> = (0..12).map(|v| v as f32 - 5.0).collect();
    let down: Vec<f32> = vec![1.0, 0.0, 2.0, -1.0, 0.5, 3.0];
    let mut expected = vec![0.0f32; 2 * 2 * 2];
    for o in 0..2 {
        for i in 0..2 {
            for x in 0..2 {
                let mut s = 0.0;
                for a in 0..2 {
                    for b in 0..3 {
                        s += up[o * 2 + a] * mid[(a * 3 + b) * 2 + x] * down[b * 2 + i];
                    }
                }
                expected[(o * 2 + i) * 2 + x] = s;
            }
        }
    }
    let mut l = Lora::new(tn(&up, &[2, 2, 1, 1]), tn(&down, &[3, 2, 1, 1]));
    l.mid = Some(tn(&mid, &[2, 3, 1, 2]));
    l.alpha = Some(3.0); // rank = down rows = 3 → scale 1
    let out = run(
        &full(0.0, &[2, 2, 1, 2]),
        &[PatchEntry::new(Patch::Lora(l))],
    );
    assert_close(&out, &expected, 1e-4);
}

#[test]
fn diff_with_pad_grows_the_weight_to_the_diff_shape() {
    let w = t2(&[&[1.0]]);
    let e = PatchEntry::new(Patch::Diff {
        diff: full(1.0, &[2, 3]),
        pad: true,
    });
    assert_eq!(
        patched_shape("k", &[1, 1], std::slice::from_ref(&e)).unwrap(),
        vec![2, 3]
    );
    let out = run(&w, &[e]);
    assert_eq!(out.dims(), &[2, 3]);
    assert_close(&out, &[2.0, 1.0, 1.0, 1.0, 1.0, 1.0], 0.0);
}

#[test]
fn diff_of_other_shape_without_pad_is_rejected() {
    let e = PatchEntry::new(Patch::Diff {
        diff: full(1.0, &[2, 3]),
        pad: false,
    });
    assert!(matches!(
        validate("k", &[2, 2], &e),
        Err(Error::PatchShape { .. })
    ));
}

fn dora_lora() -> Lora {
    let mut l = Lora::new(t2(&[&[1.0]]), t2(&[&[3.0, 0.0]]));
    l.alpha = Some(1.0);
    l.dora_scale = Some(t2(&[&[10.0]]));
    l
}

#[test]
fn dora_comfyui_norm_divides_by_unpatched_row_norm() {
    let w = t2(&[&[3.0, 4.0]]);
    let out = apply("k", &w, &[lora_entry(dora_lora(), 1.0)], DoraNorm::ComfyUi).unwrap();
    assert_close(&out, &[12.0, 8.0], 1e-4);
}

#[test]
fn dora_standard_norm_divides_by_patched_row_norm() {
    let w = t2(&[&[3.0, 4.0]]);
    let out = apply(
        "k",
        &w,
        &[lora_entry(dora_lora(), 1.0)],
        DoraNorm::default(),
    )
    .unwrap();
    assert_close(&out, &[8.3205, 5.5470], 1e-4);
    // The renormalised row has the magnitude's norm.
    let n: f32 = vals(&out).iter().map(|v| v * v).sum::<f32>().sqrt();
    assert!((n - 10.0).abs() < 1e-4, "{n}");
}

#[test]
fn dora_strength_interpolates_from_the_unpatched_weight() {
    let w = t2(&[&[3.0, 4.0]]);
    let out = apply("k", &w, &[lora_entry(dora_lora(), 0.5)], DoraNorm::ComfyUi).unwrap();
    // W + 0.5 · ([12, 8] − [3, 4])
    assert_close(&out, &[7.5, 6.0], 1e-4);
}

#[test]
fn mismatched_lora_is_rejected_naming_key_and_shapes() {
    let l = Lora::new(full(1.0, &[3, 1]), full(1.0, &[1, 2]));
    let e = PatchEntry::new(Patch::Lora(l));
    let err = validate("blocks.0.attn.q.weight", &[2, 2], &e).unwrap_err();
    assert_patch_shape(&err, "blocks.0.attn.q.weight", &[2, 2], &[3, 2]);
    let msg = err.to_string();
    assert!(
        msg.contains("blocks.0.attn.q.weight") && msg.contains("[3, 2]"),
        "{msg}"
    );
    // apply refuses it too, and validates before computing anything.
    assert!(apply("k", &full(0.0, &[2, 2]), &[e], DoraNorm::Standard).is_err());
}

#[test]
fn lora_whose_ranks_do_not_chain_is_malformed() {
    let l = Lora::new(full(1.0, &[2, 2]), full(1.0, &[3, 2]));
    let err = validate("k", &[2, 2], &PatchEntry::new(Patch::Lora(l))).unwrap_err();
    assert!(matches!(err, Error::BadPatch { .. }), "{err}");
}

#[test]
fn dora_scale_of_wrong_length_is_rejected() {
    let mut l = dora_lora();
    l.dora_scale = Some(full(1.0, &[3, 1]));
    let err = validate("k", &[1, 2], &PatchEntry::new(Patch::Lora(l))).unwrap_err();
    assert!(matches!(err, Error::PatchShape { .. }), "{err}");
}

#[test]
fn half_precision_patch_tensors_are_upcast() {
    let up = t2(&[&[1.0], &[2.0]]).to_dtype(DType::BF16).unwrap();
    let down = t2(&[&[3.0, 4.0]]).to_dtype(DType::F16).unwrap();
    let w = full(1.0, &[2, 2]).to_dtype(DType::F16).unwrap();
    let out = run(&w, &[PatchEntry::new(Patch::Lora(Lora::new(up, down)))]);
    assert_eq!(out.dtype(), DType::F32);
    assert_close(&out, &[4.0, 5.0, 7.0, 9.0], 0.0);
}

#[test]
fn zero_strength_leaves_weight_unchanged() {
    let w = t2(&[&[3.0, 4.0]]);
    let out = run(&w, &[lora_entry(dora_lora(), 0.0)]);
    assert_close(&out, &[3.0, 4.0], 0.0);
}

#[test]
fn glora_new_layout_is_w_a1_a2_plus_b1_b2() {
    // W [[1,2],[3,4]]; a1 [in 2, r 1] = [[1],[0]], a2 [r 1, in 2] = [[0, 1]] so
    // A = a1·a2 = [[0,1],[0,0]] and W·A = [[0,1],[0,3]]; b1 [out 2, r 1] = [[1],[2]],
    // b2 [1, 2] = [[1,-1]] so B = [[1,-1],[2,-2]]. Δ = [[1,0],[2,1]]; alpha 2 / rank 1 at
    // strength 0.5 scales it by 1. (The old-layout test on these dims also holds, but
    // a2[0] = 1 is not the output dimension, so this is the new layout.)
    let mut g = GLora::new(
        t2(&[&[1.0], &[0.0]]),
        t2(&[&[0.0, 1.0]]),
        t2(&[&[1.0], &[2.0]]),
        t2(&[&[1.0, -1.0]]),
    );
    g.alpha = Some(2.0);
    let w = t2(&[&[1.0, 2.0], &[3.0, 4.0]]);
    let e = PatchEntry::new(Patch::GLora(g)).with_strengths(0.5, 1.0);
    assert_close(&run(&w, &[e]), &[2.0, 2.0, 5.0, 5.0], 0.0);
}

#[test]
fn glora_old_layout_is_w_a2_a1_plus_b2_b1() {
    // Old layout: a1 [r 1, in 2] = [[1,1]], a2 [in 2, r 1] = [[1],[0]],
    // b1 [r 1, in 2] = [[1,0]], b2 [out 2, r 1] = [[2],[0]]. Both layout tests hold and
    // a2[0] = 2 = out on a square weight, so ComfyUI reads it as old:
    // W·a2 = [[1],[3]], ·a1 = [[1,1],[3,3]]; b2·b1 = [[2,0],[0,0]]; Δ = [[3,1],[3,3]].
    let g = GLora::new(
        t2(&[&[1.0, 1.0]]),
        t2(&[&[1.0], &[0.0]]),
        t2(&[&[1.0, 0.0]]),
        t2(&[&[2.0], &[0.0]]),
    );
    let w = t2(&[&[1.0, 2.0], &[3.0, 4.0]]);
    let out = run(&w, &[PatchEntry::new(Patch::GLora(g))]);
    assert_close(&out, &[4.0, 3.0, 6.0, 7.0], 0.0);
}

#[test]
fn glora_on_a_conv_contracts_the_input_dimension_at_each_kernel_position() {
    // W [out 1, in 2, 1, 2]: channel 0 = [1, 2], channel 1 = [3, 4].
    // a1 [2, 1, 1, 1] = [1, 1], a2 [1, 2, 1, 1] = [1, 0]: A = [[1,0],[1,0]], so
    // (W·A)[j = 0] = channel 0 + channel 1 = [4, 6], (W·A)[j = 1] = [0, 0].
    // b1 [1, 1, 1, 1] = 2, b2 [1, 2, 1, 2] = [1, 0, 0, 1]: B = [2, 0, 0, 2].
    // Δ = [6, 6, 0, 2]; W + Δ = [7, 8, 3, 6].
    let g = GLora::new(
        tn(&[1.0, 1.0], &[2, 1, 1, 1]),
        tn(&[1.0, 0.0], &[1, 2, 1, 1]),
        tn(&[2.0], &[1, 1, 1, 1]),
        tn(&[1.0, 0.0, 0.0, 1.0], &[1, 2, 1, 2]),
    );
    let w = tn(&[1.0, 2.0, 3.0, 4.0], &[1, 2, 1, 2]);
    let out = run(&w, &[PatchEntry::new(Patch::GLora(g))]);
    assert_eq!(out.dims(), &[1, 2, 1, 2]);
    assert_close(&out, &[7.0, 8.0, 3.0, 6.0], 0.0);
}

#[test]
fn glora_for_another_input_width_is_rejected_naming_key_and_shapes() {
    // Built for in = 3 (new layout, rank 1), offered a [2, 2] weight.
    let g = GLora::new(
        full(1.0, &[3, 1]),
        full(1.0, &[1, 3]),
        full(1.0, &[2, 1]),
        full(1.0, &[1, 3]),
    );
    let e = PatchEntry::new(Patch::GLora(g));
    let err = validate("blocks.1.mlp.fc.weight", &[2, 2], &e).unwrap_err();
    assert_patch_shape(&err, "blocks.1.mlp.fc.weight", &[2, 2], &[3, 3]);
    assert!(err.to_string().contains("blocks.1.mlp.fc.weight"), "{err}");
    assert!(apply("k", &full(0.0, &[2, 2]), &[e], DoraNorm::Standard).is_err());
}

#[test]
fn glora_whose_ranks_chain_in_neither_layout_is_malformed() {
    // Old needs a1[0] = a2[1] = b1[0] = b2[1] (3, 2, 2, 2); new needs
    // a1[1] = a2[0] = b1[1] = b2[0] (1, 2, 1, 1).
    let g = GLora::new(
        full(1.0, &[3, 1]),
        full(1.0, &[2, 2]),
        full(1.0, &[2, 1]),
        full(1.0, &[1, 2]),
    );
    let err = validate("k", &[2, 2], &PatchEntry::new(Patch::GLora(g))).unwrap_err();
    assert!(matches!(err, Error::BadPatch { .. }), "{err}");
}

#[test]
fn glora_at_zero_strength_leaves_the_weight_bit_for_bit() {
    let w = t2(&[&[0.1, 0.2], &[0.3, 0.7]]);
    let g = GLora::new(
        t2(&[&[1.0], &[0.5]]),
        t2(&[&[0.3, 1.0]]),
        t2(&[&[1.0], &[2.0]]),
        t2(&[&[1.0, -1.0]]),
    );
    let e = PatchEntry::new(Patch::GLora(g)).with_strengths(0.0, 1.0);
    assert_eq!(vals(&run(&w, &[e])), vals(&w));
}

#[test]
fn linear_lora_fits_a_one_by_one_conv() {
    let l = Lora::new(t2(&[&[1.0], &[2.0]]), t2(&[&[3.0, 4.0]]));
    let out = run(
        &full(0.0, &[2, 2, 1, 1]),
        &[PatchEntry::new(Patch::Lora(l))],
    );
    assert_eq!(out.dims(), &[2, 2, 1, 1]);
    assert_close(&out, &[3.0, 4.0, 6.0, 8.0], 0.0);
}

/// Deterministic values in [-1, 1), with exact zeros of both signs sprinkled in (`+0 + -0` is
/// where a careless in-place add would change a bit).
fn noise(shape: &[usize], seed: u32) -> Tensor {
    let n: usize = shape.iter().product();
    let mut s = seed.wrapping_mul(0x9E37_79B9) | 1;
    let data: Vec<f32> = (0..n)
        .map(|i| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            match i % 7 {
                3 => -0.0,
                5 => 0.0,
                _ => (s >> 8) as f32 / (1u32 << 23) as f32 - 1.0,
            }
        })
        .collect();
    tn(&data, shape)
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .into_iter()
        .map(f32::to_bits)
        .collect()
}

/// The CPU engine (entries added in place, in row blocks) gives the whole path's bits for chains
/// of every kind: plain deltas (added in place), strength 0, DoRA, offsets, `strength_model`,
/// padding diffs, OFT, and a `Set` after which the chain must stop writing in place (its value
/// tensor is shared with the patch, and stays untouched). Blocks of 1 row, of a few rows and
/// whole; `apply`, and `apply_owned` on the same values, agree.
#[test]
fn the_row_block_engine_gives_the_whole_paths_bits_and_never_writes_into_a_patch() {
    let (out, inn) = (4usize, 6usize);
    let lora = |seed: u32, alpha: Option<f32>| {
        Patch::Lora(Lora {
            alpha,
            ..Lora::new(noise(&[out, 2], seed), noise(&[2, inn], seed + 1))
        })
    };
    let entry = |p: Patch, s: f32| PatchEntry::new(p).with_strengths(s, 1.0);
    let set_value = noise(&[out, inn], 40);
    let set_bits = bits(&set_value);
    let loha = Patch::LoHa(LoHa {
        w1a: noise(&[out, 2], 50),
        w1b: noise(&[2, inn], 51),
        w2a: noise(&[out, 2], 52),
        w2b: noise(&[2, inn], 53),
        t1: None,
        t2: None,
        alpha: Some(1.5),
        dora_scale: None,
    });
    let lokr = Patch::LoKr(LoKr {
        w1: Some(noise(&[2, 2], 60)),
        w2: Some(noise(&[2, 3], 61)),
        ..LoKr::default()
    });
    let glora = Patch::GLora(GLora {
        a1: noise(&[inn, 2], 70),
        a2: noise(&[2, inn], 71),
        b1: noise(&[out, 2], 72),
        b2: noise(&[2, inn], 73),
        alpha: Some(2.0),
        dora_scale: None,
    });
    let dora = Patch::Lora(Lora {
        dora_scale: Some(noise(&[out, 1], 80).abs().unwrap()),
        ..Lora::new(noise(&[out, 2], 81), noise(&[2, inn], 82))
    });
    let oft = Patch::Oft(Oft::new(noise(&[2, 2, 2], 90)));
    let chains: Vec<(&str, Vec<PatchEntry>)> = vec![
        ("lora", vec![entry(lora(1, Some(1.0)), 0.7)]),
        (
            "lora, diff, lora at 0",
            vec![
                entry(lora(3, None), 1.0),
                entry(
                    Patch::Diff {
                        diff: noise(&[out, inn], 5),
                        pad: false,
                    },
                    -0.25,
                ),
                entry(lora(6, None), 0.0),
            ],
        ),
        (
            "loha, lokr, glora",
            vec![entry(loha, 0.5), entry(lokr, 1.0), entry(glora, 0.3)],
        ),
        (
            "dora, then lora",
            vec![entry(dora, 0.8), entry(lora(8, Some(4.0)), 1.0)],
        ),
        (
            "set, then lora",
            vec![
                entry(Patch::Set(set_value.clone()), 1.0),
                entry(lora(10, None), 1.0),
            ],
        ),
        (
            "offsets on rows and columns, strength_model, oft",
            vec![
                entry(
                    Patch::Lora(Lora::new(noise(&[3, 2], 12), noise(&[2, inn], 13))),
                    1.0,
                )
                .with_offset(Offset {
                    dim: 0,
                    start: 1,
                    len: 3,
                }),
                entry(
                    Patch::Lora(Lora::new(noise(&[out, 2], 30), noise(&[2, 2], 31))),
                    1.0,
                )
                .with_offset(Offset {
                    dim: 1,
                    start: 2,
                    len: 2,
                }),
                PatchEntry::new(lora(14, None)).with_strengths(1.0, 0.5),
                entry(oft, 1.0),
                entry(lora(16, None), 1.0),
            ],
        ),
        (
            "padding diff",
            vec![
                entry(lora(18, None), 1.0),
                entry(
                    Patch::Diff {
                        diff: noise(&[out + 1, inn], 20),
                        pad: true,
                    },
                    1.0,
                ),
                entry(
                    Patch::Lora(Lora::new(noise(&[out + 1, 2], 22), noise(&[2, inn], 23))),
                    1.0,
                ),
            ],
        ),
    ];
    let w = noise(&[out, inn], 99);
    let values = w.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    for (name, chain) in &chains {
        let want = apply_whole("k", &w, chain, DoraNorm::Standard).unwrap();
        for block in [1, inn * 3, out * inn] {
            let fresh = w.copy().unwrap();
            let got = owned::apply_unique("k", fresh, chain, DoraNorm::Standard, block).unwrap();
            assert_eq!(got.dims(), want.dims(), "{name}, blocks of {block}");
            assert_eq!(bits(&got), bits(&want), "{name}, blocks of {block}");
        }
        let got = apply("k", &w, chain, DoraNorm::Standard).unwrap();
        assert_eq!(bits(&got), bits(&want), "{name}: apply");
        let got = apply_owned("k", values.clone(), &[out, inn], chain, DoraNorm::Standard).unwrap();
        assert_eq!(bits(&got), bits(&want), "{name}: apply_owned");
    }
    assert_eq!(
        bits(&set_value),
        set_bits,
        "the Set's value was written into"
    );
    assert_eq!(
        bits(&w),
        bits(&noise(&[out, inn], 99)),
        "the weight was written into"
    );
    assert!(apply_owned("k", vec![0.0; 5], &[out, inn], &[], DoraNorm::Standard).is_err());
}

/// The same at sizes where the matmuls run their full kernels and blocks split rows unevenly: a
/// rank-16 LoRA on a 320×200 weight, a conv LoCon with a Tucker mid, a LoHa with Tucker cores, a
/// LoKr whose `w2` is factorised (blocks cut through its rows), an f16 diff — blocks of 7, 64
/// rows and whole.
#[test]
fn row_blocks_give_the_whole_bits_at_kernel_sizes() {
    let (out, inn) = (320usize, 200usize);
    let lora = Patch::Lora(Lora {
        alpha: Some(8.0),
        ..Lora::new(noise(&[out, 16], 1), noise(&[16, inn], 2))
    });
    let lokr = Patch::LoKr(LoKr {
        w1: Some(noise(&[4, 5], 3)),
        w2a: Some(noise(&[80, 6], 4)),
        w2b: Some(noise(&[6, 40], 5)),
        alpha: Some(3.0),
        ..LoKr::default()
    });
    let loha = Patch::LoHa(LoHa {
        w1a: noise(&[out, 8], 6),
        w1b: noise(&[8, inn], 7),
        w2a: noise(&[out, 8], 8),
        w2b: noise(&[8, inn], 9),
        t1: None,
        t2: None,
        alpha: Some(4.0),
        dora_scale: None,
    });
    let diff = Patch::Diff {
        diff: noise(&[out, inn], 10).to_dtype(DType::F16).unwrap(),
        pad: false,
    };
    let linear: Vec<PatchEntry> = [lora, lokr, loha, diff]
        .into_iter()
        .zip([0.8f32, 1.0, -0.5, 0.25])
        .map(|(p, s)| PatchEntry::new(p).with_strengths(s, 1.0))
        .collect();
    let (co, ci) = (48usize, 40usize);
    let locon = Patch::Lora(Lora {
        up: noise(&[co, 4, 1, 1], 11),
        down: noise(&[4, ci, 1, 1], 12),
        mid: Some(noise(&[4, 4, 3, 3], 13)),
        alpha: Some(2.0),
        dora_scale: None,
    });
    let loha_tucker = Patch::LoHa(LoHa {
        w1a: noise(&[4, co], 14),
        w1b: noise(&[4, ci], 15),
        w2a: noise(&[4, co], 16),
        w2b: noise(&[4, ci], 17),
        t1: Some(noise(&[4, 4, 3, 3], 18)),
        t2: Some(noise(&[4, 4, 3, 3], 19)),
        alpha: Some(2.0),
        dora_scale: None,
    });
    let conv: Vec<PatchEntry> = vec![PatchEntry::new(locon), PatchEntry::new(loha_tucker)];
    for (name, w, chain) in [
        ("linear", noise(&[out, inn], 20), linear),
        ("conv", noise(&[co, ci, 3, 3], 21), conv),
    ] {
        let want = apply_whole("k", &w, &chain, DoraNorm::Standard).unwrap();
        let rest = w.elem_count() / w.dim(0).unwrap();
        for rows in [7, 64, w.dim(0).unwrap()] {
            let got = owned::apply_unique(
                "k",
                w.copy().unwrap(),
                &chain,
                DoraNorm::Standard,
                rows * rest,
            )
            .unwrap();
            assert_eq!(bits(&got), bits(&want), "{name}, blocks of {rows} rows");
        }
    }
}

/// One BOFT factor of `k` 2×2 blocks, each with `q = t` above the diagonal.
fn boft_blocks(m: usize, k: usize, t: f32) -> Tensor {
    let one: [f32; 4] = [0.0, t, 0.0, 0.0];
    let data: Vec<f32> = (0..m * k).flat_map(|_| one).collect();
    tn(&data, &[m, k, 2, 2])
}

/// With `q = 1` a 2×2 Cayley block is `R = [[0, 1], [-1, 0]]`; BOFT applies `R·x` (OFT `Rᵀ·x`).
#[test]
fn boft_one_factor_rotates_row_pairs_by_r() {
    let w = t2(&[&[1.0, 2.0], &[3.0, 4.0]]);
    let entry = PatchEntry::new(Patch::Boft(Boft::new(boft_blocks(1, 1, 1.0))));
    assert_close(&run(&w, &[entry]), &[3.0, 4.0, -1.0, -2.0], 1e-6);
}

/// Two butterfly factors on 4 rows: the first rotates the pairs (0, 1), (2, 3), the second the
/// pairs two rows apart, (0, 2), (1, 3). By hand: `x = (w1, −w0, w3, −w2)`, then
/// `y0 = x2, y2 = −x0, y1 = x3, y3 = −x1`.
#[test]
fn boft_second_factor_pairs_rows_two_apart() {
    let w = tn(&[1.0, 2.0, 3.0, 4.0], &[4, 1]);
    let entry = PatchEntry::new(Patch::Boft(Boft::new(boft_blocks(2, 2, 1.0))));
    assert_close(&run(&w, &[entry]), &[4.0, -3.0, -2.0, 1.0], 1e-6);
}

/// ComfyUI's strength enters twice: each rotation becomes `s·R + (1 − s)·I`, and the weight
/// moves by `s · (x − w)`; `rescale` multiplies `x`'s rows. By hand for `w = (1, 3)`, `s = 0.5`:
/// `x = [[.5, .5], [−.5, .5]]·w = (2, 1)`, so `w + .5·(x − w) = (1.5, 2)`; with rescale
/// `(2, 1)`, `x = (4, 1)` and the result is `(2.5, 2)`.
#[test]
fn boft_strength_interpolates_the_rotations_and_the_step_and_rescale_scales_rows() {
    let w = tn(&[1.0, 3.0], &[2, 1]);
    let plain = Boft::new(boft_blocks(1, 1, 1.0));
    let rescaled = Boft {
        rescale: Some(tn(&[2.0, 1.0], &[2, 1])),
        ..plain.clone()
    };
    let at = |b: Boft| PatchEntry::new(Patch::Boft(b)).with_strengths(0.5, 1.0);
    assert_close(&run(&w, &[at(plain)]), &[1.5, 2.0], 1e-6);
    assert_close(&run(&w, &[at(rescaled)]), &[2.5, 2.0], 1e-6);
    let zero =
        PatchEntry::new(Patch::Boft(Boft::new(boft_blocks(1, 1, 1.0)))).with_strengths(0.0, 1.0);
    assert_eq!(bits(&run(&w, &[zero])), bits(&w));
}

/// At strength 1 without rescale BOFT is an orthogonal map of the output rows: every column's
/// norm is kept, for random blocks of 3 factors over 16 rows of a conv weight.
#[test]
fn boft_keeps_column_norms() {
    let w = noise(&[16, 3, 2, 2], 5);
    let entry = PatchEntry::new(Patch::Boft(Boft::new(noise(&[3, 4, 4, 4], 6))));
    let out = run(&w, &[entry]);
    let norms = |t: &Tensor| -> Vec<f32> {
        let v = vals(&t.reshape((16, 12)).unwrap());
        (0..12)
            .map(|c| (0..16).map(|r| v[r * 12 + c].powi(2)).sum::<f32>().sqrt())
            .collect()
    };
    let (a, b) = (norms(&w), norms(&out));
    for (x, y) in a.iter().zip(&b) {
        assert!((x - y).abs() <= 1e-4 * x.max(1.0), "{a:?} vs {b:?}");
    }
    assert_ne!(bits(&out), bits(&w), "nothing rotated");
}

#[test]
fn boft_of_the_wrong_size_or_odd_blocks_is_rejected() {
    let w = noise(&[6, 4], 1);
    let e = |b: Tensor| PatchEntry::new(Patch::Boft(Boft::new(b)));
    // 2 blocks of 2 rotate 4 rows, not 6.
    let err = validate("k", w.dims(), &e(boft_blocks(1, 2, 1.0))).unwrap_err();
    assert_patch_shape(&err, "k", &[6, 4], &[4, 4]);
    // Odd block size.
    let odd = noise(&[1, 2, 3, 3], 2);
    assert!(matches!(
        validate("k", w.dims(), &e(odd)).unwrap_err(),
        Error::BadPatch { .. }
    ));
    // 3 blocks of 2 rotate 6 rows, but a second factor's stride 4 does not divide them.
    let err = validate("k", w.dims(), &e(boft_blocks(2, 3, 1.0))).unwrap_err();
    assert_patch_shape(&err, "k", &[6, 4], &[6, 4]);
    // A rescale of the wrong length.
    let b = Boft {
        rescale: Some(noise(&[4, 1], 3)),
        ..Boft::new(boft_blocks(1, 3, 1.0))
    };
    assert!(matches!(
        validate("k", w.dims(), &PatchEntry::new(Patch::Boft(b))).unwrap_err(),
        Error::BadPatch { .. }
    ));
}

/// The fused engine (decode, low-rank deltas and the rounding to storage in one pass over blocks
/// of rows) gives the bits of decoding, the row-block engine and rounding in turn, for every
/// storage dtype it takes: LoRAs on the whole weight and on fused rows (q, k, v as offsets on
/// dimension 0, one with strength 0), a LoCon with a Tucker mid on a conv, row counts that no
/// block divides and rows that are no whole number of tiles. Chains with another kind of entry
/// are left to the general engine (`None`).
#[test]
fn the_fused_engine_gives_the_general_path_s_bits_and_declines_other_chains() {
    use crate::float::{self, Dtype, Rounding};
    let (out, inn) = (3 * 37usize, 200usize);
    let lora = |rows: usize, rank: usize, seed: u32| {
        Patch::Lora(Lora {
            alpha: Some(rank as f32 / 2.0),
            ..Lora::new(noise(&[rows, rank], seed), noise(&[rank, inn], seed + 1))
        })
    };
    let rows_of = |p: Patch, start: usize, s: f32| {
        let mut e = PatchEntry::new(p).with_strengths(s, 1.0);
        e.offset = Some(Offset {
            dim: 0,
            start,
            len: 37,
        });
        e
    };
    let linear = vec![
        PatchEntry::new(lora(out, 16, 1)).with_strengths(0.7, 1.0),
        rows_of(lora(37, 4, 3), 0, 1.0),
        rows_of(lora(37, 8, 5), 37, 0.0),
        rows_of(lora(37, 3, 7), 74, -1.5),
    ];
    let (co, ci) = (21usize, 10usize);
    let conv = vec![PatchEntry::new(Patch::Lora(Lora {
        up: noise(&[co, 4, 1, 1], 9),
        down: noise(&[4, ci, 1, 1], 10),
        mid: Some(noise(&[4, 4, 3, 3], 11)),
        alpha: Some(2.0),
        dora_scale: None,
    }))];
    for (name, w, chain) in [
        ("linear", noise(&[out, inn], 20), &linear),
        ("conv", noise(&[co, ci, 3, 3], 21), &conv),
    ] {
        for storage in [Dtype::BF16, Dtype::F16, Dtype::F32] {
            let stored = float::from_f32(&w, storage, Rounding::Nearest).unwrap();
            let decoded = float::to_f32(&stored, storage).unwrap().copy().unwrap();
            let want = apply_fresh("k", decoded, chain, DoraNorm::Standard).unwrap();
            float::round_through_in_place(&want, storage).unwrap();
            let got = apply_fused("k", &stored, storage, chain, true)
                .unwrap()
                .expect("a chain of low-rank deltas is fused");
            assert_eq!(got.dims(), want.dims(), "{name}, {storage}");
            assert_eq!(bits(&got), bits(&want), "{name}, {storage}");
        }
    }
    // Declined: a LoHa, a strength_model, DoRA, a rank above the kernel's, an offset on columns.
    let w = float::from_f32(&noise(&[out, inn], 30), Dtype::BF16, Rounding::Nearest).unwrap();
    let loha = Patch::LoHa(LoHa {
        w1a: noise(&[out, 2], 31),
        w1b: noise(&[2, inn], 32),
        w2a: noise(&[out, 2], 33),
        w2b: noise(&[2, inn], 34),
        t1: None,
        t2: None,
        alpha: None,
        dora_scale: None,
    });
    let mut on_columns = PatchEntry::new(Patch::Diff {
        diff: noise(&[out, 10], 35),
        pad: false,
    });
    on_columns.offset = Some(Offset {
        dim: 1,
        start: 0,
        len: 10,
    });
    let declined = [
        PatchEntry::new(loha),
        PatchEntry::new(lora(out, 16, 40)).with_strengths(1.0, 0.5),
        PatchEntry::new(Patch::Lora(Lora {
            dora_scale: Some(noise(&[out, 1], 41)),
            ..Lora::new(noise(&[out, 4], 42), noise(&[4, inn], 43))
        })),
        PatchEntry::new(lora(out, low_rank::MAX_RANK + 1, 44)),
        on_columns,
    ];
    for (i, entry) in declined.into_iter().enumerate() {
        let chain = [linear[0].clone(), entry];
        let fused = apply_fused("k", &w, Dtype::BF16, &chain, true).unwrap();
        assert!(fused.is_none(), "entry {i} is not fused");
    }
}
