//! ModelPatcher: clone semantics, patches, residency and invariant I1, on real safetensors files.

mod common;

use std::sync::Arc;

use candle_core::{Device, Tensor};
use common::*;
use proptest::prelude::*;
use residency::float::Dtype;
use residency::patcher::lora::unet::{PairKind, UnetLayout, UnetNaming};
use residency::patcher::{Lora, ModelPatcher, Offset, Patch};
use residency::vram::DeviceId;
use residency::weights::{save_safetensors, SafetensorsOptions, SlotResidency};
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
    assert_patch_shape(&err, "blocks.0.attn.k.weight", &[16, 16], &[16, 8]);
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
    let clean = f32s(&p.model().clean("blocks.0.mlp.fc1.bias").unwrap());
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
        &p.model().clean("blocks.0.attn.q.weight").unwrap(),
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
        f32s(&base.model().clean("blocks.0.attn.q.weight").unwrap())
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
        f32s(&p.model().clean(k).unwrap())
    );
    assert!(matches!(
        p.patched_weight_f32("nope"),
        Err(Error::UnknownWeight { .. })
    ));
}

/// Writes a UNet of `layout` in `naming` under `prefix` to a safetensors file: every layer of the
/// layout as a tiny `[1]` weight and bias (enough for the layout to be recognised), except the
/// `targets`, which get the given tensors. Returns the model read back.
fn unet_model_file(
    dir: &std::path::Path,
    layout: &UnetLayout,
    naming: UnetNaming,
    prefix: &str,
    targets: &[(&str, &Tensor)],
) -> residency::Model {
    let mut paths = Vec::new();
    for pair in layout.module_pairs() {
        let side = match naming {
            UnetNaming::Ldm => pair.ldm,
            UnetNaming::Diffusers => pair.diffusers,
        };
        match pair.kind {
            PairKind::Layer => paths.push(side),
            PairKind::Transformer { depth } => {
                paths.extend(["proj_in", "proj_out"].map(|l| format!("{side}.{l}")));
                for k in 0..depth {
                    for l in ["attn1.to_q", "attn2.to_k"] {
                        paths.push(format!("{side}.transformer_blocks.{k}.{l}"));
                    }
                }
            }
        }
    }
    let tiny = Tensor::zeros(1, candle_core::DType::F32, &Device::Cpu).unwrap();
    let mut tensors: Vec<(String, Tensor, Dtype)> = paths
        .iter()
        .flat_map(|p| [format!("{prefix}{p}.weight"), format!("{prefix}{p}.bias")])
        .map(|k| {
            let t = targets
                .iter()
                .find(|(key, _)| *key == k)
                .map_or(tiny.clone(), |(_, t)| (*t).clone());
            (k, t, Dtype::F32)
        })
        .collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    for (key, _) in targets {
        assert!(
            tensors.iter().any(|(k, _, _)| k == key),
            "{key} is not in the layout"
        );
    }
    let path = dir.join("unet.safetensors");
    save_safetensors(&path, &tensors, &SafetensorsOptions::default()).unwrap();
    residency::Model::from_safetensors("unet", &[path]).unwrap()
}

/// `w + scale · up·down`, with `up` and `down` flattened to matrices and the product reshaped to
/// `w`'s shape: the LoRA delta computed here, not by the crate.
fn lora_expected(w: &Tensor, up: &Tensor, down: &Tensor, scale: f64) -> Vec<f32> {
    let up = up.flatten_from(1).unwrap();
    let down = down.flatten_from(1).unwrap();
    let delta = up.matmul(&down).unwrap().reshape(w.shape()).unwrap();
    f32s(&(w + (delta * scale).unwrap()).unwrap())
}

fn assert_close(got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= 1e-6, "element {i}: {g} != {w}");
    }
}

#[test]
fn diffusers_named_lora_patches_an_ldm_sd1_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let dev = Device::Cpu;
    let q_key = "model.diffusion_model.input_blocks.4.1.transformer_blocks.0.attn1.to_q.weight";
    let conv_key = "model.diffusion_model.output_blocks.5.2.conv.weight";
    let q = Tensor::new(&[[1.0f32, 2.0], [3.0, 4.0], [5.0, 6.0]], &dev).unwrap();
    let conv = rand_tensor(&[2, 2, 3, 3], 21);
    let model = unet_model_file(
        dir.path(),
        &UnetLayout::sd1(),
        UnetNaming::Ldm,
        "model.diffusion_model.",
        &[(q_key, &q), (conv_key, &conv)],
    );

    // PEFT names for the attention projection, kohya names for the upsampler conv.
    let q_up = Tensor::new(&[[1.0f32], [2.0], [3.0]], &dev).unwrap();
    let q_down = Tensor::new(&[[1.0f32, -1.0]], &dev).unwrap();
    let conv_up = rand_tensor(&[2, 1, 1, 1], 22);
    let conv_down = rand_tensor(&[1, 2, 3, 3], 23);
    let peft = "unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q";
    let kohya = "lora_unet_up_blocks_1_upsamplers_0_conv";
    let lora_tensors = [
        (format!("{peft}.lora_B.weight"), q_up.clone()),
        (format!("{peft}.lora_A.weight"), q_down.clone()),
        (format!("{kohya}.lora_up.weight"), conv_up.clone()),
        (format!("{kohya}.lora_down.weight"), conv_down.clone()),
        (format!("{kohya}.alpha"), Tensor::new(2.0f32, &dev).unwrap()),
        // SD1's deepest level has no attention.
        (
            "lora_unet_down_blocks_3_attentions_0_proj_in.diff".to_string(),
            Tensor::zeros(1, candle_core::DType::F32, &dev).unwrap(),
        ),
    ]
    .map(|(k, t)| (k, t, Dtype::F32));
    let lora_path = dir.path().join("lora.safetensors");
    save_safetensors(&lora_path, &lora_tensors, &SafetensorsOptions::default()).unwrap();

    let loaded = residency::patcher::lora::load(lora_path.as_path(), model.keys()).unwrap();
    assert_eq!(
        loaded.unmatched_lora_keys,
        ["lora_unet_down_blocks_3_attentions_0_proj_in.diff"]
    );
    let mut p = cpu_patcher(model);
    let mut matched = p.add_patches(loaded.patches, 0.5, 1.0).unwrap();
    matched.sort();
    assert_eq!(matched, [q_key, conv_key]);

    // No alpha: scale = strength 0.5. The numbers by hand: W + 0.5·[[1,-1],[2,-2],[3,-3]].
    let got = f32s(&p.patched_weight(q_key).unwrap());
    assert_eq!(got, [1.5, 1.5, 4.0, 3.0, 6.5, 4.5]);
    assert_eq!(got, lora_expected(&q, &q_up, &q_down, 0.5));
    // alpha 2 over rank 1 at strength 0.5: scale 1.
    let got = f32s(&p.patched_weight(conv_key).unwrap());
    assert_close(&got, &lora_expected(&conv, &conv_up, &conv_down, 1.0));
    // The neighbouring block is untouched.
    let other = "model.diffusion_model.input_blocks.5.1.transformer_blocks.0.attn1.to_q.weight";
    assert_eq!(f32s(&p.patched_weight(other).unwrap()), [0.0]);
}

#[test]
fn ldm_named_kohya_lora_patches_a_diffusers_sdxl_unet() {
    let dir = tempfile::tempdir().unwrap();
    let dev = Device::Cpu;
    let k_key = "down_blocks.2.attentions.0.transformer_blocks.9.attn2.to_k.weight";
    let up_key = "up_blocks.0.upsamplers.0.conv.weight";
    let k = rand_tensor(&[4, 3], 31);
    let conv = rand_tensor(&[2, 2, 3, 3], 32);
    let model = unet_model_file(
        dir.path(),
        &UnetLayout::sdxl(),
        UnetNaming::Diffusers,
        "",
        &[(k_key, &k), (up_key, &conv)],
    );
    let mut lora: Vec<(String, Tensor, Dtype)> = Vec::new();
    let mut adapter = |base: &str, up: Tensor, down: Tensor, alpha: f32| {
        lora.push((format!("{base}.lora_up.weight"), up, Dtype::F32));
        lora.push((format!("{base}.lora_down.weight"), down, Dtype::F32));
        let alpha = Tensor::new(alpha, &dev).unwrap();
        lora.push((format!("{base}.alpha"), alpha, Dtype::F32));
    };
    let (k_up, k_down) = (rand_tensor(&[4, 2], 33), rand_tensor(&[2, 3], 34));
    let (c_up, c_down) = (
        rand_tensor(&[2, 2, 1, 1], 35),
        rand_tensor(&[2, 2, 3, 3], 36),
    );
    adapter(
        "lora_unet_input_blocks_7_1_transformer_blocks_9_attn2_to_k",
        k_up.clone(),
        k_down.clone(),
        1.0,
    );
    // Up block 0 (level 2) has attention, so its upsampler is the third module of block 2.
    adapter(
        "lora_unet_output_blocks_2_2_conv",
        c_up.clone(),
        c_down.clone(),
        4.0,
    );
    // SDXL's first level has no attention.
    let (x_up, x_down) = (rand_tensor(&[1, 1], 37), rand_tensor(&[1, 1], 38));
    adapter("lora_unet_input_blocks_1_1_proj_in", x_up, x_down, 1.0);
    let lora_path = dir.path().join("lora.safetensors");
    save_safetensors(&lora_path, &lora, &SafetensorsOptions::default()).unwrap();

    let loaded = residency::patcher::lora::load(lora_path.as_path(), model.keys()).unwrap();
    assert_eq!(
        loaded.unmatched_lora_keys,
        [
            "lora_unet_input_blocks_1_1_proj_in.alpha",
            "lora_unet_input_blocks_1_1_proj_in.lora_down.weight",
            "lora_unet_input_blocks_1_1_proj_in.lora_up.weight",
        ]
    );
    let mut p = cpu_patcher(model);
    let mut matched = p.add_patches(loaded.patches, 1.0, 1.0).unwrap();
    matched.sort();
    assert_eq!(matched, [k_key, up_key]);
    // alpha 1 over rank 2: scale 0.5; alpha 4 over rank 2: scale 2.
    let got = f32s(&p.patched_weight(k_key).unwrap());
    assert_close(&got, &lora_expected(&k, &k_up, &k_down, 0.5));
    let got = f32s(&p.patched_weight(up_key).unwrap());
    assert_close(&got, &lora_expected(&conv, &c_up, &c_down, 2.0));
}

/// A model file with a linear weight, a conv weight and a second linear weight, and a LoRA
/// file (written with the crate's save helper) holding a new-layout GLoRA, an OFT and a BOFT.
#[test]
fn glora_and_oft_groups_from_a_file_patch_a_model() {
    let dir = tempfile::tempdir().unwrap();
    let dev = Device::Cpu;
    let t = |data: &[f32], shape: &[usize]| Tensor::from_vec(data.to_vec(), shape, &dev).unwrap();
    let model_tensors = [
        ("lin.weight", t(&[1.0, 2.0, 3.0, 4.0], &[2, 2])),
        ("conv.weight", t(&[1.0, 2.0, 3.0, 4.0], &[2, 1, 1, 2])),
        ("other.weight", t(&[1.0, 2.0, 3.0, 4.0], &[2, 2])),
    ]
    .map(|(k, t)| (k.to_string(), t, Dtype::F32));
    let model_path = dir.path().join("m.safetensors");
    save_safetensors(&model_path, &model_tensors, &SafetensorsOptions::default()).unwrap();
    let model = residency::Model::from_safetensors("m", &[model_path]).unwrap();

    let lora_tensors = [
        // GLoRA, new layout, rank 1, alpha 1: A = a1·a2 = [[0,1],[0,0]], B = b1·b2 = [[1,-1],[2,-2]].
        ("lin.a1.weight", t(&[1.0, 0.0], &[2, 1])),
        ("lin.a2.weight", t(&[0.0, 1.0], &[1, 2])),
        ("lin.b1.weight", t(&[1.0, 2.0], &[2, 1])),
        ("lin.b2.weight", t(&[1.0, -1.0], &[1, 2])),
        ("lin.alpha", Tensor::new(1.0f32, &dev).unwrap()),
        // OFT, one 2×2 block with q = 0.5: R = [[.6, .8], [-.8, .6]].
        ("conv.oft_blocks", t(&[0.0, 0.5, 0.0, 0.0], &[1, 2, 2])),
        // BOFT, one factor of one 2×2 block with q = 1: R = [[0, 1], [-1, 0]], applied as R·W.
        ("other.oft_blocks", t(&[0.0, 1.0, 0.0, 0.0], &[1, 1, 2, 2])),
    ]
    .map(|(k, t)| (k.to_string(), t, Dtype::F32));
    let lora_path = dir.path().join("lyco.safetensors");
    save_safetensors(&lora_path, &lora_tensors, &SafetensorsOptions::default()).unwrap();

    let loaded = residency::patcher::lora::load(lora_path.as_path(), model.keys()).unwrap();
    assert!(loaded.unmatched_lora_keys.is_empty());
    let kinds: Vec<(&str, &str)> = loaded
        .patches
        .iter()
        .map(|(k, p)| (k.key.as_str(), p.kind()))
        .collect();
    assert_eq!(
        kinds,
        [
            ("conv.weight", "oft"),
            ("lin.weight", "glora"),
            ("other.weight", "boft")
        ]
    );

    let mut p = cpu_patcher(model);
    let mut matched = p.add_patches(loaded.patches.clone(), 1.0, 1.0).unwrap();
    matched.sort();
    assert_eq!(matched, ["conv.weight", "lin.weight", "other.weight"]);
    // W + W·A + B = [[1,2],[3,4]] + [[0,1],[0,3]] + [[1,-1],[2,-2]].
    assert_eq!(
        f32s(&p.patched_weight("lin.weight").unwrap()),
        [2.0, 2.0, 5.0, 5.0]
    );
    // Rᵀ·W on the filters [1, 2] and [3, 4].
    assert_close(
        &f32s(&p.patched_weight("conv.weight").unwrap()),
        &[-1.8, -2.0, 2.6, 4.0],
    );
    assert_eq!(
        f32s(&p.patched_weight("other.weight").unwrap()),
        [3.0, 4.0, -1.0, -2.0]
    );

    // A valid GLoRA with an OFT built for 4 rows, both on `lin`: refused, nothing added.
    let mut fresh = p.clone();
    fresh.clear_patches();
    assert!(fresh.patches().is_empty());
    let swapped: Vec<(String, Patch)> = loaded
        .patches
        .into_iter()
        .map(|(k, patch)| match patch {
            Patch::Oft(o) => {
                // Blocks for 4 rows on a 2-row weight.
                let o =
                    residency::patcher::Oft::new(Tensor::cat(&[&o.blocks, &o.blocks], 0).unwrap());
                ("lin.weight".to_string(), Patch::Oft(o))
            }
            other => (k.key, other),
        })
        .collect();
    let err = fresh.add_patches(swapped, 1.0, 1.0).unwrap_err();
    assert_patch_shape(&err, "lin.weight", &[2, 2], &[4, 2]);
    assert!(fresh.patches().is_empty());
}
