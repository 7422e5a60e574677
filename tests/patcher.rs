//! ModelPatcher: clone semantics, patches, residency and invariant I1, on real safetensors files.

mod common;

use std::sync::Arc;

use candle_core::{Device, Tensor};
use common::*;
use proptest::prelude::*;
use residency::float::Dtype;
use residency::patcher::{Lora, ModelPatcher, Offset, Patch};
use residency::vram::DeviceId;
use residency::weights::SlotResidency;
use residency::{ByteSize, Error};

fn lora_for(shape: (usize, usize), rank: usize, seed: u64) -> Patch {
    let up = rand_tensor(&[shape.0, rank], seed);
    let down = rand_tensor(&[rank, shape.1], seed + 1);
    let mut l = Lora::new(up, down);
    l.alpha = Some(rank as f32 / 2.0);
    Patch::Lora(l)
}

#[test]
fn clone_with_lora_leaves_original_bits_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let base = cpu_patcher(small_model_file(dir.path(), "m", Dtype::BF16));
    let before = base.model().clean_checksum().unwrap();
    let base_q = base.patched_weight("blocks.0.attn.q.weight").unwrap();
    let mut clone = base.clone();
    assert!(clone.is_clone(&base));
    assert_eq!(clone.parent_id(), Some(base.id()));
    let matched = clone
        .add_patches(
            [("blocks.0.attn.q.weight", lora_for((16, 16), 4, 1))],
            1.0,
            1.0,
        )
        .unwrap();
    assert_eq!(matched, vec!["blocks.0.attn.q.weight".to_string()]);
    assert!(base.patches().is_empty());
    let patched = clone.patched_weight("blocks.0.attn.q.weight").unwrap();
    assert_ne!(f32s(&patched), f32s(&base_q));
    assert_eq!(
        f32s(&base.patched_weight("blocks.0.attn.q.weight").unwrap()),
        f32s(&base_q)
    );
    assert_eq!(base.model().clean_checksum().unwrap(), before);
    // The clone keeps the storage dtype.
    assert_eq!(patched.dtype(), candle_core::DType::BF16);
}

#[test]
fn mismatched_patch_is_rejected_and_nothing_is_added() {
    let dir = tempfile::tempdir().unwrap();
    let mut p = cpu_patcher(small_model_file(dir.path(), "m", Dtype::F32));
    let good = lora_for((16, 16), 2, 3);
    let bad = lora_for((16, 8), 2, 4);
    let err = p
        .add_patches(
            [
                ("blocks.0.attn.q.weight", good),
                ("blocks.0.attn.k.weight", bad),
            ],
            1.0,
            1.0,
        )
        .unwrap_err();
    match &err {
        Error::PatchShape {
            key,
            weight_shape,
            patch_shape,
            ..
        } => {
            assert_eq!(key, "blocks.0.attn.k.weight");
            assert_eq!(weight_shape, &vec![16, 16]);
            assert_eq!(patch_shape, &vec![16, 8]);
        }
        other => panic!("{other:?}"),
    }
    assert!(
        p.patches().is_empty(),
        "a failed add_patches added something"
    );
}

#[test]
fn unknown_keys_are_ignored_and_not_returned() {
    let dir = tempfile::tempdir().unwrap();
    let mut p = cpu_patcher(small_model_file(dir.path(), "m", Dtype::F32));
    let matched = p
        .add_patches(
            [
                (
                    "not.a.weight",
                    Patch::Set(Tensor::zeros(3, candle_core::DType::F32, &Device::Cpu).unwrap()),
                ),
                (
                    "blocks.0.mlp.fc1.bias",
                    Patch::Set(Tensor::ones(32, candle_core::DType::F32, &Device::Cpu).unwrap()),
                ),
            ],
            1.0,
            1.0,
        )
        .unwrap();
    assert_eq!(matched, vec!["blocks.0.mlp.fc1.bias".to_string()]);
    assert_eq!(
        f32s(&p.patched_weight("blocks.0.mlp.fc1.bias").unwrap()),
        vec![1.0; 32]
    );
}

#[test]
fn offset_patch_changes_only_its_rows() {
    let dir = tempfile::tempdir().unwrap();
    let mut p = cpu_patcher(small_model_file(dir.path(), "m", Dtype::F32));
    let clean = f32s(p.model().clean("blocks.0.mlp.fc1.bias").unwrap());
    let off = Offset {
        dim: 0,
        start: 4,
        len: 2,
    };
    p.add_patches(
        [(
            ("blocks.0.mlp.fc1.bias", off),
            Patch::Diff {
                diff: Tensor::ones(2, candle_core::DType::F32, &Device::Cpu).unwrap(),
                pad: false,
            },
        )],
        1.0,
        1.0,
    )
    .unwrap();
    let got = f32s(&p.patched_weight("blocks.0.mlp.fc1.bias").unwrap());
    for (i, (g, c)) in got.iter().zip(&clean).enumerate() {
        if i == 4 || i == 5 {
            assert_eq!(*g, c + 1.0);
        } else {
            assert_eq!(g, c);
        }
    }
}

#[test]
fn fp8_patched_weights_are_deterministic_and_path_independent() {
    let dir = tempfile::tempdir().unwrap();
    let mut p = cpu_patcher(small_model_file(dir.path(), "m", Dtype::F8E4M3FN));
    p.add_patches(
        [("blocks.0.attn.q.weight", lora_for((16, 16), 4, 9))],
        0.7,
        1.0,
    )
    .unwrap();
    let a = p.patched_weight("blocks.0.attn.q.weight").unwrap();
    let b = p.clone().patched_weight("blocks.0.attn.q.weight").unwrap();
    let idx = p.model().index_of("blocks.0.attn.q.weight").unwrap();
    let c = p.materialize(idx, Dtype::F8E4M3FN, DeviceId::Cpu).unwrap();
    let bits = |t: &Tensor| {
        residency::float::to_f32(t, Dtype::F8E4M3FN)
            .map(|t| f32s(&t))
            .unwrap()
    };
    assert_eq!(bits(&a), bits(&b));
    assert_eq!(bits(&a), bits(&c));
    // Stochastic rounding of a patched fp8 weight is not plain nearest rounding everywhere.
    let clean = residency::float::to_f32(
        p.model().clean("blocks.0.attn.q.weight").unwrap(),
        Dtype::F8E4M3FN,
    )
    .unwrap();
    assert_ne!(f32s(&clean), bits(&a));
}

#[test]
fn placement_is_largest_first_strictly_below_budget() {
    let mut p = cpu_patcher(virtual_model("m", &[4 * MIB, 3 * MIB, 2 * MIB, MIB]));
    let out = p
        .load(DeviceId::Cpu, ByteSize(6 * MIB + MIB / 2), false, false)
        .unwrap();
    let resident: Vec<bool> = (0..4)
        .map(|i| {
            matches!(
                p.model().residency_of(i),
                Some(SlotResidency::Resident { .. })
            )
        })
        .collect();
    assert_eq!(resident, vec![true, false, true, false]);
    assert_eq!(p.loaded_size(), ByteSize::mib(6));
    assert_eq!(out.streaming, ByteSize::mib(4));
    // A weight exactly equal to what is left streams.
    let mut p = cpu_patcher(virtual_model("m", &[4 * MIB, 2 * MIB]));
    p.load(DeviceId::Cpu, ByteSize::mib(6), false, false)
        .unwrap();
    assert_eq!(p.loaded_size(), ByteSize::mib(4));
}

#[test]
fn partially_unload_frees_smallest_first_while_at_most_requested() {
    let mk = || {
        let mut p = cpu_patcher(virtual_model("m", &[4 * MIB, 3 * MIB, 2 * MIB, MIB]));
        p.load(DeviceId::Cpu, ByteSize(6 * MIB + MIB / 2), false, false)
            .unwrap();
        p
    };
    let p = mk();
    assert_eq!(
        p.partially_unload(DeviceId::Cpu, ByteSize::mib(1)),
        ByteSize::mib(2)
    );
    assert_eq!(p.loaded_size(), ByteSize::mib(4));
    let p = mk();
    assert_eq!(
        p.partially_unload(DeviceId::Cpu, ByteSize::mib(2)),
        ByteSize::mib(6)
    );
    assert_eq!(p.loaded_size(), ByteSize::ZERO);
}

#[test]
fn pinned_weights_survive_partial_unload_until_unpinned() {
    let mut p = cpu_patcher(virtual_model("m", &[4 * MIB, 2 * MIB]));
    p.load(DeviceId::Cpu, ByteSize::MAX, false, true).unwrap();
    p.pin_weight_to_device("w1").unwrap();
    assert_eq!(
        p.partially_unload(DeviceId::Cpu, ByteSize::mib(100)),
        ByteSize::mib(4)
    );
    assert_eq!(p.loaded_size(), ByteSize::mib(2));
    p.unpin_all_weights();
    assert_eq!(
        p.partially_unload(DeviceId::Cpu, ByteSize::mib(100)),
        ByteSize::mib(2)
    );
    assert!(matches!(
        p.pin_weight_to_device("nope"),
        Err(Error::UnknownWeight { .. })
    ));
}

#[test]
fn partially_load_grows_by_less_than_extra() {
    let mut p = cpu_patcher(virtual_model("m", &[4 * MIB, 3 * MIB, 2 * MIB, MIB]));
    p.load(DeviceId::Cpu, ByteSize::mib(5), false, false)
        .unwrap();
    assert_eq!(p.loaded_size(), ByteSize::mib(4));
    let added = p
        .partially_load(DeviceId::Cpu, ByteSize(3 * MIB + 1))
        .unwrap();
    assert_eq!(added, ByteSize::mib(3));
    assert_eq!(p.loaded_size(), ByteSize::mib(7));
    p.detach();
    assert_eq!(p.loaded_size(), ByteSize::ZERO);
    assert_eq!(p.current_loaded_device(), None);
}

#[test]
fn clone_rematerializes_only_weights_whose_patches_differ() {
    let dir = tempfile::tempdir().unwrap();
    let mut base = cpu_patcher(small_model_file(dir.path(), "m", Dtype::F32));
    let full = base
        .load(DeviceId::Cpu, ByteSize::MAX, false, true)
        .unwrap();
    assert_eq!(full.moved, base.model_size());
    // Loading again with unchanged patches moves nothing.
    assert_eq!(
        base.load(DeviceId::Cpu, ByteSize::MAX, false, true)
            .unwrap()
            .moved,
        ByteSize::ZERO
    );
    let mut lora = base.clone();
    lora.add_patches(
        [("blocks.0.attn.q.weight", lora_for((16, 16), 2, 5))],
        1.0,
        1.0,
    )
    .unwrap();
    assert_eq!(
        lora.lowvram_patch_counter(),
        1,
        "the stale q weight streams with its patch"
    );
    let out = lora
        .load(DeviceId::Cpu, ByteSize::MAX, false, true)
        .unwrap();
    assert_eq!(out.moved, ByteSize(16 * 16 * 4));
    assert_eq!(lora.lowvram_patch_counter(), 0);
    // The base now sees the q weight as stale and streams it, with identical results.
    assert_eq!(
        base.loaded_size(),
        base.model_size().saturating_sub(ByteSize(16 * 16 * 4))
    );
    let (streamed, was_streamed) = base.fetch("blocks.0.attn.q.weight").unwrap();
    assert!(was_streamed);
    assert_eq!(
        f32s(&streamed),
        f32s(base.model().clean("blocks.0.attn.q.weight").unwrap())
    );
    let back = base
        .load(DeviceId::Cpu, ByteSize::MAX, false, true)
        .unwrap();
    assert_eq!(back.moved, ByteSize(16 * 16 * 4));
}

#[test]
fn resident_and_streamed_fetches_give_identical_bits() {
    let dir = tempfile::tempdir().unwrap();
    for dtype in [
        Dtype::F32,
        Dtype::F16,
        Dtype::BF16,
        Dtype::F8E4M3FN,
        Dtype::F8E5M2,
    ] {
        let mut p = cpu_patcher(small_model_file(dir.path(), &format!("m{dtype}"), dtype))
            .with_compute_dtype(Some(Dtype::F32));
        p.add_patches(
            [("blocks.0.attn.q.weight", lora_for((16, 16), 4, 11))],
            0.8,
            1.0,
        )
        .unwrap();
        let (streamed, s) = p.fetch("blocks.0.attn.q.weight").unwrap();
        assert!(s);
        p.load(DeviceId::Cpu, ByteSize::MAX, false, true).unwrap();
        let (resident, s) = p.fetch("blocks.0.attn.q.weight").unwrap();
        assert!(!s);
        assert_eq!(f32s(&streamed), f32s(&resident), "{dtype}");
    }
}

#[test]
fn patched_state_dict_keeps_names_shapes_and_dtypes() {
    let dir = tempfile::tempdir().unwrap();
    let mut p = cpu_patcher(small_model_file(dir.path(), "m", Dtype::F16));
    p.add_patches(
        [("blocks.0.attn.k.weight", lora_for((16, 16), 2, 2))],
        1.0,
        1.0,
    )
    .unwrap();
    let sd = p.patched_state_dict().unwrap();
    assert_eq!(sd.len(), p.model().len());
    for ((k, t, d), slot) in sd.iter().zip(p.model().slots()) {
        assert_eq!(k, slot.name());
        assert_eq!(t.dims(), slot.shape());
        assert_eq!(*d, slot.dtype());
    }
}

#[test]
fn patchers_are_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<ModelPatcher>();
    assert_send_sync::<residency::loader::MemoryManager>();
}

#[derive(Debug, Clone)]
enum Op {
    Clone(usize),
    Patch(usize, usize, u64),
    Patched(usize, usize),
    Load(usize, u64),
    Unload(usize, u64),
    Drop(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0..4usize).prop_map(Op::Clone),
        (0..4usize, 0..5usize, any::<u64>()).prop_map(|(a, b, c)| Op::Patch(a, b, c)),
        (0..4usize, 0..5usize).prop_map(|(a, b)| Op::Patched(a, b)),
        (0..4usize, 0..20_000u64).prop_map(|(a, b)| Op::Load(a, b)),
        (0..4usize, 0..20_000u64).prop_map(|(a, b)| Op::Unload(a, b)),
        (0..4usize).prop_map(Op::Drop),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// I1: no sequence of clone / patch / patched_weight / load / unload / drop changes a clean
    /// weight by one bit.
    #[test]
    fn clean_weights_never_change(ops in proptest::collection::vec(op(), 1..24)) {
        let dir = tempfile::tempdir().unwrap();
        let model = Arc::new(small_model_file(dir.path(), "m", Dtype::BF16));
        let before = model.clean_checksum().unwrap();
        let keys: Vec<String> = model.keys().map(str::to_string).collect();
        let mut ps = vec![ModelPatcher::new(model.clone(), DeviceId::Cpu, DeviceId::Cpu).with_compute_dtype(Some(Dtype::F32))];
        for op in ops {
            match op {
                Op::Clone(i) => { let c = ps[i % ps.len()].clone(); ps.push(c); }
                Op::Patch(i, k, seed) => {
                    let n = ps.len();
                    let p = &mut ps[i % n];
                    let key = &keys[k];
                    let shape = p.model().slot(key).unwrap().shape().to_vec();
                    let patch = Patch::Diff { diff: rand_tensor(&shape, seed), pad: false };
                    p.add_patches([(key.as_str(), patch)], 0.5, 1.0).unwrap();
                }
                Op::Patched(i, k) => { ps[i % ps.len()].patched_weight(&keys[k]).unwrap(); }
                Op::Load(i, b) => { let n = ps.len(); ps[i % n].load(DeviceId::Cpu, ByteSize(b), false, false).unwrap(); }
                Op::Unload(i, b) => { ps[i % ps.len()].partially_unload(DeviceId::Cpu, ByteSize(b)); }
                Op::Drop(i) => { if ps.len() > 1 { ps.remove(i % ps.len()); } }
            }
            prop_assert_eq!(model.clean_checksum().unwrap(), before);
        }
    }
}

#[test]
fn patched_weight_f32_is_the_unrounded_value_patched_weight_rounds() {
    let dir = tempfile::tempdir().unwrap();
    let mut p = cpu_patcher(small_model_file(dir.path(), "m", Dtype::F8E4M3FN));
    let key = "blocks.0.attn.q.weight";
    p.add_patches([(key, lora_for((16, 16), 4, 9))], 0.8, 1.0)
        .unwrap();
    let exact = p.patched_weight_f32(key).unwrap();
    assert_eq!(exact.dtype(), candle_core::DType::F32);
    let rounded = residency::float::from_f32(
        &exact,
        Dtype::F8E4M3FN,
        residency::Rounding::stochastic_for(key),
    )
    .unwrap();
    assert_eq!(f32s(&rounded), f32s(&p.patched_weight(key).unwrap()));
    // Not already on the fp8 grid: the f32 value really is the unrounded one.
    assert_ne!(f32s(&exact), f32s(&rounded));
    // An unpatched weight decodes exactly.
    let k = "blocks.0.attn.k.weight";
    assert_eq!(
        f32s(&p.patched_weight_f32(k).unwrap()),
        f32s(p.model().clean(k).unwrap())
    );
    assert!(matches!(
        p.patched_weight_f32("nope"),
        Err(Error::UnknownWeight { .. })
    ));
}
