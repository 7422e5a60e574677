//! Unit tests of LoRA file reading: every naming scheme onto prefixed and unprefixed model keys,
//! the patch kinds groups become, malformed groups reported not loaded, and UNet renaming.

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};

use super::unet::{UnetLayout, UnetNaming};
use super::*;
use crate::Error;

const SDXL_KEYS: &[&str] = &[
    "diffusion_model.input_blocks.1.1.proj_in.weight",
    "diffusion_model.input_blocks.1.1.proj_in.bias",
    "diffusion_model.middle_block.1.transformer_blocks.0.attn1.to_q.weight",
    "diffusion_model.middle_block.1.transformer_blocks.0.attn1.to_out.0.weight",
    "conditioner.embedders.0.transformer.text_model.encoder.layers.0.mlp.fc1.weight",
    "conditioner.embedders.1.transformer.text_model.encoder.layers.0.mlp.fc1.weight",
];

fn ones(shape: &[usize]) -> Tensor {
    Tensor::ones(shape, DType::F32, &Device::Cpu).unwrap()
}

fn lora_pair(map: &mut HashMap<String, Tensor>, base: &str, up: &str, down: &str) {
    map.insert(format!("{base}{up}"), ones(&[4, 2]));
    map.insert(format!("{base}{down}"), ones(&[2, 3]));
}

fn save(dir: &tempfile::TempDir, name: &str, tensors: &HashMap<String, Tensor>) -> PathBuf {
    let path = dir.path().join(name);
    candle_core::safetensors::save(tensors, &path).unwrap();
    path
}

fn keys_of(load: &LoraLoad) -> Vec<&str> {
    load.patches.iter().map(|(k, _)| k.key.as_str()).collect()
}

#[test]
fn kohya_names_map_onto_prefixed_model_keys_and_unknown_ones_are_reported() {
    let mut t = HashMap::new();
    lora_pair(
        &mut t,
        "lora_unet_input_blocks_1_1_proj_in",
        ".lora_up.weight",
        ".lora_down.weight",
    );
    t.insert(
        "lora_unet_input_blocks_1_1_proj_in.alpha".into(),
        Tensor::new(1.0f32, &Device::Cpu).unwrap(),
    );
    lora_pair(
        &mut t,
        "lora_te1_text_model_encoder_layers_0_mlp_fc1",
        ".lora_up.weight",
        ".lora_down.weight",
    );
    lora_pair(
        &mut t,
        "lora_te2_text_model_encoder_layers_0_mlp_fc1",
        ".lora_up.weight",
        ".lora_down.weight",
    );
    lora_pair(
        &mut t,
        "lora_unet_output_blocks_9_9_nope",
        ".lora_up.weight",
        ".lora_down.weight",
    );
    t.insert(
        "lora_unet_input_blocks_1_1_proj_in.something_else".into(),
        ones(&[1]),
    );
    let dir = tempfile::tempdir().unwrap();
    let path = save(&dir, "kohya.safetensors", &t);

    let out = load(path.as_path(), SDXL_KEYS.iter().copied()).unwrap();
    assert_eq!(
        keys_of(&out),
        [
            "diffusion_model.input_blocks.1.1.proj_in.weight",
            "conditioner.embedders.0.transformer.text_model.encoder.layers.0.mlp.fc1.weight",
            "conditioner.embedders.1.transformer.text_model.encoder.layers.0.mlp.fc1.weight",
        ]
    );
    assert_eq!(out.matched_model_keys, keys_of(&out));
    match &out.patches[0].1 {
        Patch::Lora(l) => {
            assert_eq!(l.alpha, Some(1.0));
            assert_eq!(l.up.dims(), &[4, 2]);
            assert_eq!(l.down.dims(), &[2, 3]);
        }
        other => panic!("expected a LoRA, got {}", other.kind()),
    }
    assert_eq!(
        out.unmatched_lora_keys,
        [
            "lora_unet_input_blocks_1_1_proj_in.something_else",
            "lora_unet_output_blocks_9_9_nope.lora_down.weight",
            "lora_unet_output_blocks_9_9_nope.lora_up.weight",
        ]
    );
}

#[test]
fn peft_and_diffusers_names_map_onto_the_models_own_prefix() {
    let keys = [
        "diffusion_model.double_blocks.0.img_attn.qkv.weight",
        "text_encoder.encoder.layers.0.self_attn.q_proj.weight",
        "encoder.layer.0.attention.self.query.weight",
        "transformer.h.0.attn.c_attn.weight",
    ];
    let mut t = HashMap::new();
    lora_pair(
        &mut t,
        "transformer.double_blocks.0.img_attn.qkv",
        ".lora_B.weight",
        ".lora_A.weight",
    );
    lora_pair(
        &mut t,
        "text_encoder.text_model.encoder.layers.0.self_attn.q_proj",
        ".lora.up.weight",
        ".lora.down.weight",
    );
    lora_pair(
        &mut t,
        "base_model.model.encoder.layer.0.attention.self.query",
        ".lora_B.weight",
        ".lora_A.weight",
    );
    lora_pair(
        &mut t,
        "base_model.model.transformer.h.0.attn.c_attn",
        ".lora_B.weight",
        ".lora_A.weight",
    );
    let out = load(t, keys).unwrap();
    assert_eq!(keys_of(&out), keys);
    assert!(
        out.unmatched_lora_keys.is_empty(),
        "{:?}",
        out.unmatched_lora_keys
    );
    // lora_B is up, lora_A is down.
    let Patch::Lora(l) = &out.patches[0].1 else {
        panic!("not a LoRA")
    };
    assert_eq!((l.up.dims(), l.down.dims()), (&[4, 2][..], &[2, 3][..]));
}

#[test]
fn direct_and_processor_names_map() {
    let mut t = HashMap::new();
    lora_pair(
        &mut t,
        "unet.middle_block.1.transformer_blocks.0.attn1.processor.to_out",
        "_lora.up.weight",
        "_lora.down.weight",
    );
    lora_pair(
        &mut t,
        "diffusion_model.middle_block.1.transformer_blocks.0.attn1.to_q",
        ".lora_linear_layer.up.weight",
        ".lora_linear_layer.down.weight",
    );
    let out = load(t, SDXL_KEYS.iter().copied()).unwrap();
    assert_eq!(
        keys_of(&out),
        [
            "diffusion_model.middle_block.1.transformer_blocks.0.attn1.to_q.weight",
            "diffusion_model.middle_block.1.transformer_blocks.0.attn1.to_out.0.weight",
        ]
    );
}

#[test]
fn loha_lokr_and_full_diff_groups_become_their_patch_kinds() {
    let mut t = HashMap::new();
    for p in ["hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"] {
        t.insert(
            format!("lora_unet_input_blocks_1_1_proj_in.{p}"),
            ones(&[2, 2]),
        );
    }
    t.insert(
        "lora_unet_input_blocks_1_1_proj_in.alpha".into(),
        Tensor::new(4.0f32, &Device::Cpu).unwrap(),
    );
    t.insert(
        "lora_unet_middle_block_1_transformer_blocks_0_attn1_to_q.lokr_w1".into(),
        ones(&[2, 2]),
    );
    t.insert(
        "lora_unet_middle_block_1_transformer_blocks_0_attn1_to_q.lokr_w2_a".into(),
        ones(&[2, 1]),
    );
    t.insert(
        "lora_unet_middle_block_1_transformer_blocks_0_attn1_to_q.lokr_w2_b".into(),
        ones(&[1, 2]),
    );
    t.insert(
        "diffusion_model.middle_block.1.transformer_blocks.0.attn1.to_out.0.diff".into(),
        ones(&[4, 4]),
    );
    t.insert(
        "diffusion_model.input_blocks.1.1.proj_in.diff_b".into(),
        ones(&[4]),
    );
    let dir = tempfile::tempdir().unwrap();
    let out = load(
        save(&dir, "lyco.safetensors", &t),
        SDXL_KEYS.iter().copied(),
    )
    .unwrap();
    let kinds: Vec<(&str, &str)> = out
        .patches
        .iter()
        .map(|(k, p)| (k.key.as_str(), p.kind()))
        .collect();
    assert_eq!(
        kinds,
        [
            ("diffusion_model.input_blocks.1.1.proj_in.weight", "loha"),
            ("diffusion_model.input_blocks.1.1.proj_in.bias", "diff"),
            (
                "diffusion_model.middle_block.1.transformer_blocks.0.attn1.to_q.weight",
                "lokr"
            ),
            (
                "diffusion_model.middle_block.1.transformer_blocks.0.attn1.to_out.0.weight",
                "diff"
            ),
        ]
    );
    let Patch::LoHa(h) = &out.patches[0].1 else {
        panic!("not LoHa")
    };
    assert_eq!(h.alpha, Some(4.0));
    assert!(
        out.unmatched_lora_keys.is_empty(),
        "{:?}",
        out.unmatched_lora_keys
    );
}

#[test]
fn glora_groups_become_glora_patches_and_bad_ones_are_reported() {
    let mut t = HashMap::new();
    let base = "lora_unet_input_blocks_1_1_proj_in";
    for p in ["a1", "a2", "b1", "b2"] {
        t.insert(format!("{base}.{p}.weight"), ones(&[2, 2]));
    }
    t.insert(
        format!("{base}.alpha"),
        Tensor::new(3.0f32, &Device::Cpu).unwrap(),
    );
    // A GLoRA without b2, and a Tucker GLoRA: both reported, neither loaded.
    let lacking = "lora_unet_middle_block_1_transformer_blocks_0_attn1_to_q";
    for p in ["a1", "a2", "b1"] {
        t.insert(format!("{lacking}.{p}.weight"), ones(&[2, 2]));
    }
    let tucker = "lora_unet_middle_block_1_transformer_blocks_0_attn1_to_out_0";
    for p in ["a1", "a2", "b1", "b2", "bm"] {
        t.insert(format!("{tucker}.{p}.weight"), ones(&[2, 2]));
    }
    let dir = tempfile::tempdir().unwrap();
    let out = load(
        save(&dir, "glora.safetensors", &t),
        SDXL_KEYS.iter().copied(),
    )
    .unwrap();
    assert_eq!(out.patches.len(), 1);
    assert_eq!(
        out.patches[0].0,
        "diffusion_model.input_blocks.1.1.proj_in.weight"
    );
    let Patch::GLora(g) = &out.patches[0].1 else {
        panic!("not GLoRA: {}", out.patches[0].1.kind())
    };
    assert_eq!(out.patches[0].1.kind(), "glora");
    assert_eq!(g.alpha, Some(3.0));
    let mut want: Vec<String> = ["a1", "a2", "b1"]
        .iter()
        .map(|p| format!("{lacking}.{p}.weight"))
        .chain(
            ["a1", "a2", "b1", "b2", "bm"]
                .iter()
                .map(|p| format!("{tucker}.{p}.weight")),
        )
        .collect();
    want.sort();
    assert_eq!(out.unmatched_lora_keys, want);
}

#[test]
fn oft_groups_become_oft_and_boft_patches_and_rescaled_diag_ones_are_reported() {
    let mut t = HashMap::new();
    let base = "lora_unet_input_blocks_1_1_proj_in";
    t.insert(format!("{base}.oft_blocks"), ones(&[2, 2, 2]));
    t.insert(
        format!("{base}.alpha"),
        Tensor::new(0.5f32, &Device::Cpu).unwrap(),
    );
    let boft = "lora_unet_middle_block_1_transformer_blocks_0_attn1_to_q";
    t.insert(format!("{boft}.oft_blocks"), ones(&[1, 2, 2, 2]));
    t.insert(format!("{boft}.rescale"), ones(&[4, 1]));
    let rescaled = "lora_unet_middle_block_1_transformer_blocks_0_attn1_to_out_0";
    t.insert(format!("{rescaled}.oft_blocks"), ones(&[2, 2, 2]));
    t.insert(format!("{rescaled}.rescale"), ones(&[4, 1]));
    let dir = tempfile::tempdir().unwrap();
    let out = load(save(&dir, "oft.safetensors", &t), SDXL_KEYS.iter().copied()).unwrap();
    let mut kinds: Vec<(&str, &str)> = out
        .patches
        .iter()
        .map(|(k, p)| (k.key.as_str(), p.kind()))
        .collect();
    kinds.sort();
    assert_eq!(
        kinds,
        [
            ("diffusion_model.input_blocks.1.1.proj_in.weight", "oft"),
            (
                "diffusion_model.middle_block.1.transformer_blocks.0.attn1.to_q.weight",
                "boft"
            ),
        ]
    );
    for (_, patch) in &out.patches {
        match patch {
            Patch::Oft(o) => assert_eq!(o.alpha, Some(0.5)),
            Patch::Boft(b) => {
                assert_eq!(b.blocks.dims(), [1, 2, 2, 2]);
                assert_eq!(
                    b.rescale.as_ref().map(|r| r.dims().to_vec()),
                    Some(vec![4, 1])
                );
                assert_eq!(b.alpha, None);
            }
            other => panic!("unexpected {}", other.kind()),
        }
    }
    assert_eq!(
        out.unmatched_lora_keys,
        [
            format!("{rescaled}.oft_blocks"),
            format!("{rescaled}.rescale"),
        ]
    );
}

#[test]
fn incomplete_group_is_reported_not_loaded() {
    let mut t = HashMap::new();
    t.insert(
        "lora_unet_input_blocks_1_1_proj_in.lora_up.weight".into(),
        ones(&[4, 2]),
    );
    t.insert("lora_unet_input_blocks_1_1_proj_in.alpha".into(), ones(&[]));
    let out = load(t, SDXL_KEYS.iter().copied()).unwrap();
    assert!(out.patches.is_empty());
    assert_eq!(
        out.unmatched_lora_keys,
        [
            "lora_unet_input_blocks_1_1_proj_in.alpha",
            "lora_unet_input_blocks_1_1_proj_in.lora_up.weight",
        ]
    );
}

#[test]
fn dora_scale_and_mid_are_attached_to_the_lora() {
    let mut t = HashMap::new();
    lora_pair(
        &mut t,
        "lora_unet_input_blocks_1_1_proj_in",
        ".lora_up.weight",
        ".lora_down.weight",
    );
    t.insert(
        "lora_unet_input_blocks_1_1_proj_in.dora_scale".into(),
        ones(&[4, 1]),
    );
    t.insert(
        "lora_unet_input_blocks_1_1_proj_in.lora_mid.weight".into(),
        ones(&[2, 2, 3, 3]),
    );
    let out = load(t, SDXL_KEYS.iter().copied()).unwrap();
    let Patch::Lora(l) = &out.patches[0].1 else {
        panic!("not a LoRA")
    };
    assert!(l.dora_scale.is_some() && l.mid.is_some() && l.alpha.is_none());
}

#[test]
fn loaded_lora_applies_with_expected_numbers() {
    use crate::patcher::adapters::{apply, DoraNorm, PatchEntry};
    let mut t = HashMap::new();
    let dev = Device::Cpu;
    t.insert(
        "layer.lora_up.weight".to_string(),
        Tensor::new(&[[1.0f32], [2.0]], &dev).unwrap(),
    );
    t.insert(
        "layer.lora_down.weight".to_string(),
        Tensor::new(&[[3.0f32, 4.0]], &dev).unwrap(),
    );
    t.insert(
        "layer.alpha".to_string(),
        Tensor::new(0.5f32, &dev)
            .unwrap()
            .to_dtype(DType::F16)
            .unwrap(),
    );
    let dir = tempfile::tempdir().unwrap();
    let out = load(save(&dir, "l.safetensors", &t), ["layer.weight"]).unwrap();
    let (key, patch) = out.patches.into_iter().next().unwrap();
    let w = Tensor::zeros((2, 2), DType::F32, &dev).unwrap();
    let entry = PatchEntry::new(patch).with_strengths(2.0, 1.0);
    let got = apply(&key.key, &w, &[entry], DoraNorm::Standard).unwrap();
    assert_eq!(got.to_vec2::<f32>().unwrap(), [[3.0, 4.0], [6.0, 8.0]]);
}

#[test]
fn loading_is_deterministic() {
    let mut t = HashMap::new();
    for i in 0..8 {
        lora_pair(
            &mut t,
            &format!("blk{i}"),
            ".lora_up.weight",
            ".lora_down.weight",
        );
        t.insert(format!("stray{i}.bin"), ones(&[1]));
    }
    let keys: Vec<String> = (0..8).rev().map(|i| format!("blk{i}.weight")).collect();
    let a = load(t.clone(), keys.iter().map(String::as_str)).unwrap();
    let b = load(t, keys.iter().map(String::as_str)).unwrap();
    assert_eq!(keys_of(&a), keys_of(&b));
    assert_eq!(a.matched_model_keys, keys); // model key order
    assert_eq!(a.unmatched_lora_keys, b.unmatched_lora_keys);
    assert_eq!(a.unmatched_lora_keys.len(), 8);
}

/// Weight and bias keys of a complete UNet of `layout` in `naming`, under `prefix`.
fn unet_keys(layout: &UnetLayout, naming: UnetNaming, prefix: &str) -> Vec<String> {
    unet::example_paths(layout, naming)
        .into_iter()
        .flat_map(|p| [format!("{prefix}{p}.weight"), format!("{prefix}{p}.bias")])
        .collect()
}

fn sorted(mut v: Vec<String>) -> Vec<String> {
    v.sort();
    v
}

#[test]
fn diffusers_named_lora_finds_an_ldm_checkpoints_keys() {
    let mut keys = unet_keys(
        &UnetLayout::sd1(),
        UnetNaming::Ldm,
        "model.diffusion_model.",
    );
    keys.push("cond_stage_model.transformer.text_model.encoder.layers.0.mlp.fc1.weight".into());
    let mut t = HashMap::new();
    let (peft, kohya) = (
        (".lora_B.weight", ".lora_A.weight"),
        (".lora_up.weight", ".lora_down.weight"),
    );
    for (base, (up, down)) in [
        (
            "unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q",
            peft,
        ),
        ("base_model.model.up_blocks.1.upsamplers.0.conv", peft),
        ("unet.down_blocks.0.downsamplers.0.conv", peft),
        ("lora_unet_down_blocks_0_resnets_0_conv1", kohya),
        ("lora_unet_up_blocks_0_upsamplers_0_conv", kohya),
        ("lora_unet_mid_block_attentions_0_proj_in", kohya),
        ("lora_unet_mid_block_resnets_1_conv1", kohya),
        ("lora_unet_time_embedding_linear_1", kohya),
        (
            "lora_unet_up_blocks_3_attentions_2_transformer_blocks_0_ff_net_2",
            kohya,
        ),
        ("lora_te_text_model_encoder_layers_0_mlp_fc1", kohya),
        // SD1 has no attention on its deepest level and no upsampler on its last up block.
        ("lora_unet_down_blocks_3_attentions_0_proj_in", kohya),
        ("unet.up_blocks.3.upsamplers.0.conv", peft),
    ] {
        lora_pair(&mut t, base, up, down);
    }
    t.insert("unet.mid_block.resnets.1.conv1.diff_b".into(), ones(&[4]));
    let out = load(t, keys.iter().map(String::as_str)).unwrap();
    let d = "model.diffusion_model.";
    assert_eq!(
        sorted(out.patches.iter().map(|(k, _)| k.key.clone()).collect()),
        sorted(vec![
            format!("{d}input_blocks.4.1.transformer_blocks.0.attn1.to_q.weight"),
            format!("{d}output_blocks.5.2.conv.weight"),
            format!("{d}input_blocks.3.0.op.weight"),
            format!("{d}input_blocks.1.0.in_layers.2.weight"),
            format!("{d}output_blocks.2.1.conv.weight"),
            format!("{d}middle_block.1.proj_in.weight"),
            format!("{d}middle_block.2.in_layers.2.weight"),
            format!("{d}middle_block.2.in_layers.2.bias"),
            format!("{d}time_embed.0.weight"),
            format!("{d}output_blocks.11.1.transformer_blocks.0.ff.net.2.weight"),
            "cond_stage_model.transformer.text_model.encoder.layers.0.mlp.fc1.weight".into(),
        ])
    );
    assert_eq!(out.matched_model_keys.len(), out.patches.len());
    assert_eq!(
        out.unmatched_lora_keys,
        [
            "lora_unet_down_blocks_3_attentions_0_proj_in.lora_down.weight",
            "lora_unet_down_blocks_3_attentions_0_proj_in.lora_up.weight",
            "unet.up_blocks.3.upsamplers.0.conv.lora_A.weight",
            "unet.up_blocks.3.upsamplers.0.conv.lora_B.weight",
        ]
    );
}

#[test]
fn ldm_named_lora_finds_a_diffusers_unets_keys() {
    // SDXL, unprefixed as in a diffusers `unet/diffusion_pytorch_model.safetensors`.
    let keys = unet_keys(&UnetLayout::sdxl(), UnetNaming::Diffusers, "");
    let mut t = HashMap::new();
    for base in [
        "lora_unet_input_blocks_7_1_transformer_blocks_9_attn2_to_k",
        "lora_unet_output_blocks_2_2_conv",
        "lora_unet_output_blocks_8_0_skip_connection",
        "lora_unet_label_emb_0_0",
        "diffusion_model.middle_block.2.in_layers.2",
        "lora_unet_input_blocks_1_1_proj_in", // SDXL level 0 has no attention
    ] {
        lora_pair(&mut t, base, ".lora_up.weight", ".lora_down.weight");
    }
    let out = load(t.clone(), keys.iter().map(String::as_str)).unwrap();
    assert_eq!(
        sorted(out.matched_model_keys.clone()),
        sorted(
            [
                "down_blocks.2.attentions.0.transformer_blocks.9.attn2.to_k.weight",
                "up_blocks.0.upsamplers.0.conv.weight",
                "up_blocks.2.resnets.2.conv_shortcut.weight",
                "add_embedding.linear_1.weight",
                "mid_block.resnets.1.conv1.weight",
            ]
            .map(String::from)
            .to_vec()
        )
    );
    assert_eq!(
        out.unmatched_lora_keys,
        [
            "lora_unet_input_blocks_1_1_proj_in.lora_down.weight",
            "lora_unet_input_blocks_1_1_proj_in.lora_up.weight",
        ]
    );

    // The same name on SD1, whose level 0 has attention, with the model under a prefix.
    let keys = unet_keys(
        &UnetLayout::sd1(),
        UnetNaming::Diffusers,
        "diffusion_model.",
    );
    let out = load(t, keys.iter().map(String::as_str)).unwrap();
    assert!(out
        .matched_model_keys
        .contains(&"diffusion_model.down_blocks.0.attentions.0.proj_in.weight".to_string()));
}

#[test]
fn unrecognised_unet_keeps_the_old_matching() {
    // An SD1 checkpoint with an up block missing is not a layout the detector knows.
    let keys: Vec<String> = unet_keys(&UnetLayout::sd1(), UnetNaming::Ldm, "diffusion_model.")
        .into_iter()
        .filter(|k| !k.starts_with("diffusion_model.output_blocks.4."))
        .collect();
    let mut t = HashMap::new();
    for base in [
        "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q",
        "lora_unet_input_blocks_4_1_transformer_blocks_0_attn2_to_k",
    ] {
        lora_pair(&mut t, base, ".lora_up.weight", ".lora_down.weight");
    }
    let out = load(t.clone(), keys.iter().map(String::as_str)).unwrap();
    assert_eq!(
        keys_of(&out),
        ["diffusion_model.input_blocks.4.1.transformer_blocks.0.attn2.to_k.weight"]
    );
    assert_eq!(
        out.unmatched_lora_keys,
        [
            "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q.lora_down.weight",
            "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q.lora_up.weight",
        ]
    );
    // With the block back, the diffusers name finds its key too.
    let keys = unet_keys(&UnetLayout::sd1(), UnetNaming::Ldm, "diffusion_model.");
    let out = load(t, keys.iter().map(String::as_str)).unwrap();
    assert_eq!(out.patches.len(), 2);
    assert!(out.unmatched_lora_keys.is_empty());
}

#[test]
fn missing_file_error_names_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("no_such_lora.safetensors");
    let err = load(path.clone(), SDXL_KEYS.iter().copied()).unwrap_err();
    assert!(
        matches!(&err, Error::File { path: p, .. } if *p == path),
        "{err}"
    );
    assert!(
        err.to_string().contains("no_such_lora.safetensors"),
        "{err}"
    );
}

#[test]
fn corrupt_file_error_names_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("broken.safetensors");
    std::fs::write(&path, b"not a safetensors file").unwrap();
    let err = load(path.as_path(), SDXL_KEYS.iter().copied()).unwrap_err();
    assert!(err.to_string().contains("broken.safetensors"), "{err}");
}
