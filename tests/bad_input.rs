//! Bad values are refused where they enter — `add_patches`, `lora::load`, reading or building a
//! model — with a typed error naming the key, never later during a load; and inputs that used to
//! panic (overflowing shapes, indices and sizes, too many dimensions) are typed errors.

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use common::*;
use residency::loader::LoadOptions;
use residency::patcher::{lora, Lora, ModelPatcher, Oft, Patch};
use residency::vram::{host_from_texts, DeviceId};
use residency::weights::Model;
use residency::{ByteSize, Dtype, Error};
use safetensors::tensor::{Dtype as St, TensorView};

const CPU: DeviceId = DeviceId::Cpu;

fn patcher(shape: &[usize]) -> ModelPatcher {
    let m = Model::from_tensors("m", [("w", rand_tensor(shape, 1))]).unwrap();
    ModelPatcher::new(Arc::new(m), CPU, CPU)
}

fn assert_bad_patch(err: Error, key: &str, needle: &str) {
    match &err {
        Error::BadPatch { key: k, reason } => {
            assert_eq!(k, key, "{err}");
            assert!(reason.contains(needle), "{err}");
        }
        other => panic!("expected BadPatch on `{key}`, got {other}"),
    }
}

#[test]
fn non_finite_strengths_are_refused_when_added() {
    for (sp, sm) in [
        (f32::NAN, 1.0),
        (1.0, f32::INFINITY),
        (f32::NEG_INFINITY, 1.0),
    ] {
        let mut p = patcher(&[8, 8]);
        let diff = Patch::Diff {
            diff: rand_tensor(&[8, 8], 2),
            pad: false,
        };
        let err = p.add_patches([("w", diff)], sp, sm).unwrap_err();
        assert_bad_patch(err, "w", "not a finite number");
        assert!(p.patches().is_empty(), "nothing added");
    }
}

#[test]
fn nan_in_patch_tensors_is_refused_when_added_and_nothing_is_added() {
    let mut nan_blocks = rand_tensor(&[2, 4, 4], 3)
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    nan_blocks[5] = f32::NAN;
    let blocks = Tensor::from_vec(nan_blocks, (2, 4, 4), &Device::Cpu).unwrap();
    let mut up = rand_tensor(&[8, 2], 4)
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    up[0] = f32::INFINITY;
    let up = Tensor::from_vec(up, (8, 2), &Device::Cpu).unwrap();
    let cases = [
        (Patch::Oft(Oft::new(blocks)), "oft_blocks"),
        (Patch::Lora(Lora::new(up, rand_tensor(&[2, 8], 5))), "up"),
    ];
    for (bad, part) in cases {
        let mut p = patcher(&[8, 8]);
        let good = Patch::Diff {
            diff: rand_tensor(&[8, 8], 6),
            pad: false,
        };
        // One bad entry in the call: none of the call's entries are added.
        let err = p
            .add_patches([("w", good), ("w", bad)], 1.0, 1.0)
            .unwrap_err();
        assert_bad_patch(err, "w", part);
        assert!(p.patches().is_empty());
    }
    // A NaN alpha in memory is refused too.
    let mut l = Lora::new(rand_tensor(&[8, 2], 7), rand_tensor(&[2, 8], 8));
    l.alpha = Some(f32::NAN);
    let mut p = patcher(&[8, 8]);
    assert_bad_patch(
        p.add_patches([("w", Patch::Lora(l))], 1.0, 1.0)
            .unwrap_err(),
        "w",
        "alpha",
    );
}

#[test]
fn a_clone_with_bad_values_never_reaches_a_load_that_would_evict() {
    // Before: the clone's NaN OFT blocks passed add_patches, the load evicted the other model and
    // then failed. Now add_patches refuses them and the other model is untouched.
    let mm = manager(
        ByteSize::kib(2),
        &["--reserve-vram", "0", "--inference-memory", "1KiB"],
    );
    let other = patcher(&[16, 16]);
    mm.load_model_gpu(&other).unwrap();
    let mut clone = patcher(&[16, 16]);
    let blocks = Tensor::full(f32::NAN, (4, 4, 4), &Device::Cpu).unwrap();
    assert!(clone
        .add_patches([("w", Patch::Oft(Oft::new(blocks)))], 1.0, 1.0)
        .is_err());
    mm.load_models_gpu(std::slice::from_ref(&clone), LoadOptions::default())
        .unwrap();
    assert!(mm.ledger(CPU) <= ByteSize::kib(2));
}

fn write(path: &std::path::Path, entries: &[(&str, St, Vec<usize>, Vec<u8>)]) {
    let views: Vec<(String, TensorView)> = entries
        .iter()
        .map(|(n, d, s, b)| (n.to_string(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    std::fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
}

fn f32_data(n: usize, v: f32) -> Vec<u8> {
    (0..n).flat_map(|_| v.to_le_bytes()).collect()
}

#[test]
fn a_lora_alpha_with_more_than_one_value_is_refused_by_lora_load() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("l.safetensors");
    write(
        &path,
        &[
            (
                "lora_unet_w.lora_up.weight",
                St::F32,
                vec![8, 2],
                f32_data(16, 0.1),
            ),
            (
                "lora_unet_w.lora_down.weight",
                St::F32,
                vec![2, 8],
                f32_data(16, 0.1),
            ),
            ("lora_unet_w.alpha", St::F32, vec![2], f32_data(2, 4.0)),
        ],
    );
    let err = lora::load(path.as_path(), ["diffusion_model.w.weight"]).unwrap_err();
    assert_bad_patch(err, "lora_unet_w.alpha", "single number");
    // A one-value alpha of any shape ([1] here) is fine.
    write(
        &path,
        &[
            (
                "lora_unet_w.lora_up.weight",
                St::F32,
                vec![8, 2],
                f32_data(16, 0.1),
            ),
            (
                "lora_unet_w.lora_down.weight",
                St::F32,
                vec![2, 8],
                f32_data(16, 0.1),
            ),
            ("lora_unet_w.alpha", St::F32, vec![1], f32_data(1, 4.0)),
        ],
    );
    let l = lora::load(path.as_path(), ["diffusion_model.w.weight"]).unwrap();
    assert_eq!(l.patches.len(), 1);
}

#[test]
fn an_fp8_weight_scale_that_is_not_finite_and_non_zero_is_refused_when_the_model_is_built() {
    let dir = tempfile::tempdir().unwrap();
    for scale in [f32::NAN, f32::INFINITY, 0.0] {
        let path = dir.path().join("q.safetensors");
        write(
            &path,
            &[
                ("l.weight", St::F8_E4M3, vec![4, 4], vec![0x30; 16]),
                ("l.weight_scale", St::F32, vec![1], f32_data(1, scale)),
            ],
        );
        let err = Model::from_safetensors("q", &[&path]).unwrap_err();
        assert!(
            matches!(&err, Error::BadWeight { key, .. } if key == "l.weight_scale"),
            "{scale}: {err}"
        );
        let codes = Tensor::zeros((4, 4), DType::F8E4M3, &Device::Cpu).unwrap();
        let s = Tensor::new(&[scale], &Device::Cpu).unwrap();
        let err =
            Model::from_tensors("q", [("l.weight", codes), ("l.weight_scale", s)]).unwrap_err();
        assert!(matches!(err, Error::BadWeight { .. }), "{err}");
    }
    // A scale with two values, too.
    let path = dir.path().join("q2.safetensors");
    write(
        &path,
        &[
            ("l.weight", St::F8_E4M3, vec![4, 4], vec![0x30; 16]),
            ("l.weight_scale", St::F32, vec![2], f32_data(2, 1.0)),
        ],
    );
    assert!(matches!(
        Model::from_safetensors("q", &[&path]),
        Err(Error::BadWeight { .. })
    ));
}

#[test]
fn zero_element_tensors_with_overflowing_shapes_are_file_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("z.safetensors");
    write(
        &path,
        &[
            ("ok.weight", St::F32, vec![2], f32_data(2, 1.0)),
            ("w", St::F32, vec![0, 4294967296, 4294967296], vec![]),
        ],
    );
    let err = Model::from_safetensors("z", &[&path]).unwrap_err();
    assert!(
        matches!(&err, Error::File { reason, .. } if reason.contains("`w`")),
        "{err}"
    );
    let err = lora::load(path.as_path(), ["w"]).unwrap_err();
    assert!(matches!(err, Error::File { .. }), "{err}");
}

#[test]
fn a_block_index_of_u64_max_in_key_mapping_does_not_overflow() {
    let keys = [
        "conditioner.embedders.18446744073709551615.model.fc.weight",
        "conditioner.embedders.0.model.fc.weight",
    ];
    let tensors: HashMap<String, Tensor> = [
        (
            "lora_te1_model_fc.lora_up.weight".to_string(),
            rand_tensor(&[4, 2], 1),
        ),
        (
            "lora_te1_model_fc.lora_down.weight".to_string(),
            rand_tensor(&[2, 4], 2),
        ),
    ]
    .into_iter()
    .collect();
    let l = lora::load(tensors, keys).unwrap();
    assert_eq!(
        l.matched_model_keys,
        ["conditioner.embedders.0.model.fc.weight"]
    );
}

#[test]
fn meminfo_values_that_overflow_bytes_saturate_never_reading_less_than_the_file_says() {
    let h = host_from_texts(
        "MemTotal: 99999999999999999999 kB\nMemAvailable: 18446744073709551615 kB\nMemFree: 1024 kB\n",
        None,
        None,
    );
    // Too large for a u64, and too large for bytes in one: both at least u64::MAX bytes.
    assert_eq!(h.total, ByteSize::MAX);
    assert_eq!(h.available, ByteSize::MAX);
    // A cgroup limit still clips them.
    let h = host_from_texts(
        "MemTotal: 99999999999999999999 kB\nMemAvailable: 18446744073709551615 kB\n",
        Some("8589934592\n"),
        Some("0\n"),
    );
    assert_eq!((h.total, h.available), (ByteSize::gib(8), ByteSize::gib(8)));
    // Not a number at all: no figure (the MemFree fallback applies, as when it is missing).
    let h = host_from_texts(
        "MemTotal: 1024 kB\nMemAvailable: lots\nMemFree: 1024 kB\n",
        None,
        None,
    );
    assert_eq!(h.available, ByteSize::mib(1));
}

#[test]
fn byte_size_constructors_saturate() {
    assert_eq!(ByteSize::kib(u64::MAX), ByteSize::MAX);
    assert_eq!(ByteSize::mib(u64::MAX / 1024), ByteSize::MAX);
    assert_eq!(ByteSize::gib(1 << 40), ByteSize::MAX);
    assert_eq!(ByteSize::gib(3), ByteSize(3 << 30));
}

#[test]
fn patches_on_weights_of_more_than_eight_dimensions_are_refused() {
    let dims = [1usize, 2, 1, 2, 1, 2, 1, 2, 2];
    let w = Tensor::ones(&dims[..], DType::F32, &Device::Cpu).unwrap();
    let m = Model::from_tensors("r9", [("w", w.clone())]).unwrap();
    let mut p = ModelPatcher::new(Arc::new(m), CPU, CPU);
    let err = p
        .add_patches(
            [(
                "w",
                Patch::Diff {
                    diff: w,
                    pad: false,
                },
            )],
            1.0,
            1.0,
        )
        .unwrap_err();
    assert_bad_patch(err, "w", "at most 8");
    // Patch tensors of more than eight dimensions too.
    let mut p = patcher(&[4, 4]);
    let up = Tensor::ones(
        &[4usize, 1, 1, 1, 1, 1, 1, 1, 1][..],
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let err = p
        .add_patches(
            [("w", Patch::Lora(Lora::new(up, rand_tensor(&[1, 4], 3))))],
            1.0,
            1.0,
        )
        .unwrap_err();
    assert_bad_patch(err, "w", "at most 8");
}

#[test]
fn adapter_shapes_whose_element_count_overflows_are_shape_errors() {
    // Zero-element factors with huge dimensions: the delta's shape [2⁴⁰, 2⁴⁰] has no usize
    // element count.
    let mut p = patcher(&[4, 4]);
    let up = Tensor::zeros((1usize << 40, 0), DType::F32, &Device::Cpu).unwrap();
    let down = Tensor::zeros((0, 1usize << 40), DType::F32, &Device::Cpu).unwrap();
    let err = p
        .add_patches([("w", Patch::Lora(Lora::new(up, down)))], 1.0, 1.0)
        .unwrap_err();
    assert!(
        matches!(err, Error::PatchShape { .. } | Error::BadPatch { .. }),
        "{err}"
    );
    let _ = Dtype::F32;
}
