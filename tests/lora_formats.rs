//! Today's LoRA formats on the model families' native keys: a Flux LoRA in diffusers/PEFT and
//! OneTrainer naming patches BFL's fused weights — each projection its rows of `qkv` / `linear1`,
//! the final modulation with its halves swapped — equal to a hand merge.

mod common;

use std::sync::Arc;

use candle_core::Tensor;
use residency::patcher::{lora_file, ModelPatcher};
use residency::vram::DeviceId;
use residency::weights::{save_safetensors, Model, SafetensorsOptions};
use residency::Dtype;

const H: usize = 4;
const MLP: usize = 8;

/// A tiny Flux under BFL's names (after `prefix`): hidden 4, MLP 8, one double and one single
/// block.
fn flux(prefix: &str) -> Model {
    let shapes: &[(&str, &[usize])] = &[
        ("img_in.weight", &[H, 6]),
        ("double_blocks.0.img_attn.qkv.weight", &[3 * H, H]),
        ("double_blocks.0.txt_attn.qkv.weight", &[3 * H, H]),
        ("double_blocks.0.img_attn.proj.weight", &[H, H]),
        ("single_blocks.0.linear1.weight", &[3 * H + MLP, H]),
        ("single_blocks.0.linear2.weight", &[H, H + MLP]),
        ("final_layer.adaLN_modulation.1.weight", &[2 * H, H]),
    ];
    Model::from_tensors(
        "flux",
        shapes
            .iter()
            .enumerate()
            .map(|(i, (k, s))| (format!("{prefix}{k}"), common::rand_tensor(s, 1 + i as u64))),
    )
    .unwrap()
}

/// `(diffusers module, out rows, in cols)` of the LoRA, rank 2.
const MODULES: &[(&str, usize, usize)] = &[
    ("transformer_blocks.0.attn.to_q", H, H),
    ("transformer_blocks.0.attn.to_k", H, H),
    ("transformer_blocks.0.attn.to_v", H, H),
    ("transformer_blocks.0.attn.add_k_proj", H, H),
    ("transformer_blocks.0.attn.to_out.0", H, H),
    ("single_transformer_blocks.0.attn.to_v", H, H),
    ("single_transformer_blocks.0.proj_mlp", MLP, H),
    ("single_transformer_blocks.0.proj_out", H, H + MLP),
    ("norm_out.linear", 2 * H, H),
];

fn up_down(i: usize, rows: usize, cols: usize) -> (Tensor, Tensor) {
    (
        common::rand_tensor(&[rows, 2], 100 + 2 * i as u64),
        common::rand_tensor(&[2, cols], 101 + 2 * i as u64),
    )
}

/// The LoRA file: PEFT names (`transformer.<module>.lora_A.weight`), or OneTrainer's
/// (`lora_transformer_<module with _>.lora_down.weight`).
fn write_lora(dir: &std::path::Path, onetrainer: bool) -> std::path::PathBuf {
    let mut tensors = Vec::new();
    for (i, (m, rows, cols)) in MODULES.iter().enumerate() {
        let (up, down) = up_down(i, *rows, *cols);
        let (u, d) = if onetrainer {
            let base = format!("lora_transformer_{}", m.replace('.', "_"));
            (
                format!("{base}.lora_up.weight"),
                format!("{base}.lora_down.weight"),
            )
        } else {
            (
                format!("transformer.{m}.lora_B.weight"),
                format!("transformer.{m}.lora_A.weight"),
            )
        };
        tensors.push((u, up, Dtype::F32));
        tensors.push((d, down, Dtype::F32));
    }
    let path = dir.join("flux_lora.safetensors");
    save_safetensors(&path, &tensors, &SafetensorsOptions::default()).unwrap();
    path
}

/// `w` with `delta` added to rows `start..start + delta rows`.
fn add_rows(w: &Tensor, start: usize, delta: &Tensor) -> Tensor {
    let n = delta.dim(0).unwrap();
    let rows = w.dim(0).unwrap();
    let mut parts = Vec::new();
    if start > 0 {
        parts.push(w.narrow(0, 0, start).unwrap());
    }
    parts.push((w.narrow(0, start, n).unwrap() + delta).unwrap());
    if start + n < rows {
        parts.push(w.narrow(0, start + n, rows - start - n).unwrap());
    }
    Tensor::cat(&parts, 0).unwrap()
}

fn delta(i: usize) -> Tensor {
    let (_, rows, cols) = MODULES[i];
    let (up, down) = up_down(i, rows, cols);
    up.matmul(&down).unwrap()
}

fn swap_halves(t: &Tensor) -> Tensor {
    let h = t.dim(0).unwrap() / 2;
    Tensor::cat(&[t.narrow(0, h, h).unwrap(), t.narrow(0, 0, h).unwrap()], 0).unwrap()
}

fn assert_close(got: &Tensor, want: &Tensor, what: &str) {
    let (g, w) = (common::f32s(got), common::f32s(want));
    assert_eq!(g.len(), w.len(), "{what}");
    for (a, b) in g.iter().zip(&w) {
        assert!(
            (a - b).abs() <= 1e-5 * b.abs().max(1.0),
            "{what}: {a} vs {b}"
        );
    }
}

/// `model` as a patcher, and a clone with the LoRA at `path` (every tensor of which must map).
fn patched(model: Model, path: &std::path::Path) -> (ModelPatcher, ModelPatcher) {
    let lora = lora_file::load_for(path, &model).unwrap();
    assert!(
        lora.unmatched_lora_keys.is_empty(),
        "{:?}",
        lora.unmatched_modules
            .iter()
            .map(|m| format!("{} ({}): {}", m.lora_module, m.family, m.reason))
            .collect::<Vec<_>>()
    );
    let base = ModelPatcher::on_device(Arc::new(model), DeviceId::Cpu);
    let mut styled = base.clone();
    styled.add_patches(lora.patches, 1.0, 1.0).unwrap();
    (base, styled)
}

/// One LoRA module of a test: its base name in the file, the native weight (after
/// `diffusion_model.`) it patches, the first row it patches and the LoRA's `(rows, cols)`.
type Case<'a> = (&'a str, &'a str, usize, usize, usize);

/// A model of `weights` (native paths and shapes) under ComfyUI's `diffusion_model.` prefix.
fn native_model(name: &str, weights: &[(&str, &[usize])], seed: u64) -> Model {
    Model::from_tensors(
        name,
        weights.iter().enumerate().map(|(i, (m, shape))| {
            (
                format!("diffusion_model.{m}.weight"),
                common::rand_tensor(shape, seed + i as u64),
            )
        }),
    )
    .unwrap()
}

/// Writes a rank-2 LoRA of `cases` (PEFT's `lora_B` / `lora_A` parts; kohya's `lora_up` /
/// `lora_down` for SimpleTuner's `lycoris_` names; case `i` from `up_down(seed + i, ..)`), loads
/// it onto `model` (every tensor must map) and checks that each native weight is its base plus
/// every case's delta at the case's rows.
fn check_cases(model: Model, cases: &[Case], seed: usize) {
    let mut tensors = Vec::new();
    for (i, (base, _, _, rows, cols)) in cases.iter().enumerate() {
        let (up, down) = up_down(seed + i, *rows, *cols);
        let (u, d) = if base.starts_with("lycoris_") {
            ("lora_up", "lora_down")
        } else {
            ("lora_B", "lora_A")
        };
        tensors.push((format!("{base}.{u}.weight"), up, Dtype::F32));
        tensors.push((format!("{base}.{d}.weight"), down, Dtype::F32));
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("lora.safetensors");
    save_safetensors(&path, &tensors, &SafetensorsOptions::default()).unwrap();
    let (base, styled) = patched(model, &path);
    let mut want: std::collections::HashMap<String, Tensor> = std::collections::HashMap::new();
    for (i, (_, native, start, rows, cols)) in cases.iter().enumerate() {
        let key = format!("diffusion_model.{native}.weight");
        let w = want
            .remove(&key)
            .unwrap_or_else(|| base.patched_weight(&key).unwrap());
        let (up, down) = up_down(seed + i, *rows, *cols);
        want.insert(key, add_rows(&w, *start, &up.matmul(&down).unwrap()));
    }
    for (key, w) in &want {
        assert_close(&styled.patched_weight(key).unwrap(), w, key);
    }
}

fn check(prefix: &str, onetrainer: bool) {
    let dir = tempfile::tempdir().unwrap();
    let path = write_lora(dir.path(), onetrainer);
    let model = flux(prefix);
    let (base, styled) = patched(model, &path);
    let k = |s: &str| format!("{prefix}{s}");
    let clean = |s: &str| base.patched_weight(&k(s)).unwrap();
    let got = |s: &str| styled.patched_weight(&k(s)).unwrap();

    let mut qkv = clean("double_blocks.0.img_attn.qkv.weight");
    for (i, part) in [0, 1, 2].into_iter().enumerate() {
        qkv = add_rows(&qkv, part * H, &delta(i));
    }
    assert_close(&got("double_blocks.0.img_attn.qkv.weight"), &qkv, "img qkv");
    let txt = add_rows(&clean("double_blocks.0.txt_attn.qkv.weight"), H, &delta(3));
    assert_close(&got("double_blocks.0.txt_attn.qkv.weight"), &txt, "txt k");
    let proj = (clean("double_blocks.0.img_attn.proj.weight") + delta(4)).unwrap();
    assert_close(&got("double_blocks.0.img_attn.proj.weight"), &proj, "proj");
    let linear1 = add_rows(&clean("single_blocks.0.linear1.weight"), 2 * H, &delta(5));
    let linear1 = add_rows(&linear1, 3 * H, &delta(6));
    assert_close(
        &got("single_blocks.0.linear1.weight"),
        &linear1,
        "linear1 v + mlp",
    );
    let linear2 = (clean("single_blocks.0.linear2.weight") + delta(7)).unwrap();
    assert_close(&got("single_blocks.0.linear2.weight"), &linear2, "linear2");
    // diffusers' (scale, shift) onto the native (shift, scale).
    let modulation =
        (clean("final_layer.adaLN_modulation.1.weight") + swap_halves(&delta(8))).unwrap();
    assert_close(
        &got("final_layer.adaLN_modulation.1.weight"),
        &modulation,
        "final modulation, halves swapped",
    );
}

#[test]
fn a_flux_lora_in_peft_naming_patches_the_fused_native_weights() {
    check("", false);
}

#[test]
fn a_flux_lora_in_onetrainer_naming_patches_comfyui_s_in_memory_keys() {
    check("model.diffusion_model.", true);
}

/// With the model's keys alone (`lora_file::load`, what `lora_merge` uses) a LoRA's MLP rows are
/// read off its own shape — `3 × in` columns into `linear1`, as many as it has rows — and land
/// where the model's shapes put them; an OFT, whose tensors do not give its module's width, is
/// reported, naming `load_for`, which places it.
#[test]
fn without_the_model_s_shapes_the_mlp_rows_come_from_the_lora_and_an_oft_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_lora(dir.path(), false);
    let model = flux("");
    let keys_only = lora_file::load(&path, model.keys()).unwrap();
    assert!(
        keys_only.unmatched_lora_keys.is_empty(),
        "{:?}",
        keys_only.unmatched_lora_keys
    );
    let with_shapes = lora_file::load_for(&path, &model).unwrap();
    let keys =
        |l: &lora_file::LoraLoad| l.patches.iter().map(|(k, _)| k.clone()).collect::<Vec<_>>();
    assert_eq!(keys(&keys_only), keys(&with_shapes));
    assert!(keys_only
        .patches
        .iter()
        .any(|(k, _)| k.key == "single_blocks.0.linear1.weight"
            && k.offset.is_some_and(|o| (o.start, o.len) == (3 * H, MLP))));

    let oft = dir.path().join("oft.safetensors");
    let blocks = common::rand_tensor(&[MLP / 4, 4, 4], 9);
    save_safetensors(
        &oft,
        &[(
            "transformer.single_transformer_blocks.0.proj_mlp.oft_blocks".to_string(),
            blocks,
            Dtype::F32,
        )],
        &SafetensorsOptions::default(),
    )
    .unwrap();
    let keys_only = lora_file::load(&oft, model.keys()).unwrap();
    let left = &keys_only.unmatched_modules;
    assert!(
        left.len() == 1 && left[0].reason.contains("load_for"),
        "{left:?}"
    );
    let with_shapes = lora_file::load_for(&oft, &model).unwrap();
    assert_eq!(
        keys(&with_shapes)[0].offset.map(|o| (o.start, o.len)),
        Some((3 * H, MLP))
    );
}

#[test]
fn qwen_image_peft_with_its_adapter_name_and_simpletuner_lycoris_names_map() {
    let model = Model::from_tensors(
        "qwen_image",
        [
            (
                "transformer_blocks.0.attn.to_q.weight",
                common::rand_tensor(&[H, H], 1),
            ),
            (
                "transformer_blocks.0.img_mlp.net.2.weight",
                common::rand_tensor(&[H, H], 2),
            ),
        ],
    )
    .unwrap();
    let (up, down) = up_down(0, H, H);
    let tensors = vec![
        (
            "transformer.transformer_blocks.0.attn.to_q.lora_B.default.weight".to_string(),
            up.clone(),
            Dtype::F32,
        ),
        (
            "transformer.transformer_blocks.0.attn.to_q.lora_A.default.weight".to_string(),
            down.clone(),
            Dtype::F32,
        ),
        (
            "lycoris_transformer_blocks_0_img_mlp_net_2.lora_up.weight".to_string(),
            up,
            Dtype::F32,
        ),
        (
            "lycoris_transformer_blocks_0_img_mlp_net_2.lora_down.weight".to_string(),
            down,
            Dtype::F32,
        ),
    ];
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("qwen.safetensors");
    save_safetensors(&path, &tensors, &SafetensorsOptions::default()).unwrap();
    let lora = lora_file::load_for(&path, &model).unwrap();
    assert!(
        lora.unmatched_lora_keys.is_empty(),
        "{:?}",
        lora.unmatched_lora_keys
    );
    assert_eq!(
        lora.matched_model_keys,
        vec![
            "transformer_blocks.0.attn.to_q.weight".to_string(),
            "transformer_blocks.0.img_mlp.net.2.weight".to_string()
        ]
    );
    let base = ModelPatcher::on_device(Arc::new(model), DeviceId::Cpu);
    let mut styled = base.clone();
    styled.add_patches(lora.patches, 1.0, 1.0).unwrap();
    for key in [
        "transformer_blocks.0.attn.to_q.weight",
        "transformer_blocks.0.img_mlp.net.2.weight",
    ] {
        let want = (base.patched_weight(key).unwrap() + delta(0)).unwrap();
        assert_close(&styled.patched_weight(key).unwrap(), &want, key);
    }
}

/// SD3's last block (context pre-only, a `(shift, scale)` modulation of two chunks) and the
/// others (six chunks in diffusers' own order) from one LoRA in PEFT naming.
#[test]
fn an_sd3_lora_in_peft_naming_patches_the_joint_blocks() {
    let shapes: &[(&str, &[usize])] = &[
        ("x_embedder.proj.weight", &[H, 2, 2, 2]),
        ("joint_blocks.0.x_block.attn.qkv.weight", &[3 * H, H]),
        ("joint_blocks.0.context_block.attn.qkv.weight", &[3 * H, H]),
        (
            "joint_blocks.0.context_block.adaLN_modulation.1.weight",
            &[6 * H, H],
        ),
        (
            "joint_blocks.1.context_block.adaLN_modulation.1.weight",
            &[2 * H, H],
        ),
        ("final_layer.adaLN_modulation.1.weight", &[2 * H, H]),
    ];
    let model = Model::from_tensors(
        "sd3",
        shapes.iter().enumerate().map(|(i, (k, s))| {
            (
                format!("model.diffusion_model.{k}"),
                common::rand_tensor(s, 50 + i as u64),
            )
        }),
    )
    .unwrap();
    let modules: &[(&str, usize)] = &[
        ("transformer_blocks.0.attn.to_v", H),
        ("transformer_blocks.0.attn.add_q_proj", H),
        ("transformer_blocks.0.norm1_context.linear", 6 * H),
        ("transformer_blocks.1.norm1_context.linear", 2 * H),
        ("norm_out.linear", 2 * H),
    ];
    let mut tensors = Vec::new();
    let mut deltas = Vec::new();
    for (i, (m, rows)) in modules.iter().enumerate() {
        let (up, down) = up_down(20 + i, *rows, H);
        deltas.push(up.matmul(&down).unwrap());
        tensors.push((format!("transformer.{m}.lora_B.weight"), up, Dtype::F32));
        tensors.push((format!("transformer.{m}.lora_A.weight"), down, Dtype::F32));
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sd3_lora.safetensors");
    save_safetensors(&path, &tensors, &SafetensorsOptions::default()).unwrap();
    let (base, styled) = patched(model, &path);
    let k = |s: &str| format!("model.diffusion_model.{s}");
    let clean = |s: &str| base.patched_weight(&k(s)).unwrap();
    let got = |s: &str| styled.patched_weight(&k(s)).unwrap();
    let x = "joint_blocks.0.x_block.attn.qkv.weight";
    assert_close(&got(x), &add_rows(&clean(x), 2 * H, &deltas[0]), "x v");
    let c = "joint_blocks.0.context_block.attn.qkv.weight";
    assert_close(&got(c), &add_rows(&clean(c), 0, &deltas[1]), "context q");
    let m0 = "joint_blocks.0.context_block.adaLN_modulation.1.weight";
    assert_close(
        &got(m0),
        &(clean(m0) + &deltas[2]).unwrap(),
        "six chunks: same order",
    );
    let m1 = "joint_blocks.1.context_block.adaLN_modulation.1.weight";
    assert_close(
        &got(m1),
        &(clean(m1) + swap_halves(&deltas[3])).unwrap(),
        "pre-only: swapped",
    );
    let f = "final_layer.adaLN_modulation.1.weight";
    assert_close(
        &got(f),
        &(clean(f) + swap_halves(&deltas[4])).unwrap(),
        "final: swapped",
    );
}

#[test]
fn a_module_no_model_key_takes_is_reported_with_the_family_and_the_nearest_key() {
    let model = flux("");
    let (up, down) = up_down(0, H, H);
    let tensors = vec![
        // Block 7 does not exist in this one-block model.
        (
            "transformer.transformer_blocks.7.attn.to_q.lora_B.weight".to_string(),
            up.clone(),
            Dtype::F32,
        ),
        (
            "transformer.transformer_blocks.7.attn.to_q.lora_A.weight".to_string(),
            down.clone(),
            Dtype::F32,
        ),
        // Not a Flux module at all.
        (
            "transformer.mystery.proj.lora_B.weight".to_string(),
            up,
            Dtype::F32,
        ),
        (
            "transformer.mystery.proj.lora_A.weight".to_string(),
            down,
            Dtype::F32,
        ),
    ];
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("stray.safetensors");
    save_safetensors(&path, &tensors, &SafetensorsOptions::default()).unwrap();
    let lora = lora_file::load_for(&path, &model).unwrap();
    assert!(lora.patches.is_empty());
    let by_name = |m: &str| {
        lora.unmatched_modules
            .iter()
            .find(|u| u.lora_module == m)
            .unwrap_or_else(|| panic!("{m} not reported: {:?}", lora.unmatched_modules))
    };
    let block = by_name("transformer.transformer_blocks.7.attn.to_q");
    assert_eq!(block.family, "flux");
    assert!(
        block.reason.contains("double_blocks.7.img_attn.qkv.weight"),
        "{}",
        block.reason
    );
    let stray = by_name("transformer.mystery.proj");
    assert_eq!(stray.family, "flux");
    assert_eq!(
        stray.nearest_model_key.as_deref(),
        Some("double_blocks.0.img_attn.proj.weight"),
        "the key sharing its last part"
    );
    assert_eq!(lora.unmatched_lora_keys.len(), 4);
}

/// HunyuanVideo under ComfyUI's in-memory names (Flux-style: `img_attn.qkv`, `img_mod.lin`,
/// `img_mlp.0`) and a LoRA in diffusion-pipe's names (Tencent's: `img_attn_qkv`,
/// `img_mod.linear`, `img_mlp.fc1`), under `transformer.` and the old `diffusion_model.`: every
/// module maps and patches the whole weight it names.
#[test]
fn a_hunyuan_video_lora_in_diffusion_pipe_naming_patches_comfyui_s_keys() {
    // (model path, the LoRA's path)
    let modules: &[(&str, &str)] = &[
        (
            "double_blocks.0.img_attn.qkv",
            "double_blocks.0.img_attn_qkv",
        ),
        (
            "double_blocks.0.img_attn.proj",
            "double_blocks.0.img_attn_proj",
        ),
        (
            "double_blocks.0.txt_attn.qkv",
            "double_blocks.0.txt_attn_qkv",
        ),
        (
            "double_blocks.0.img_mod.lin",
            "double_blocks.0.img_mod.linear",
        ),
        ("double_blocks.0.img_mlp.0", "double_blocks.0.img_mlp.fc1"),
        ("double_blocks.0.txt_mlp.2", "double_blocks.0.txt_mlp.fc2"),
        ("single_blocks.0.linear1", "single_blocks.0.linear1"),
        (
            "single_blocks.0.modulation.lin",
            "single_blocks.0.modulation.linear",
        ),
    ];
    let weights: Vec<(&str, &[usize])> = modules.iter().map(|(m, _)| (*m, &[H, H][..])).collect();
    // Half under diffusion-pipe's `transformer.`, half under the old `diffusion_model.`.
    let bases: Vec<String> = modules
        .iter()
        .enumerate()
        .map(|(i, (_, lora))| {
            let prefix = if i % 2 == 0 {
                "transformer"
            } else {
                "diffusion_model"
            };
            format!("{prefix}.{lora}")
        })
        .collect();
    let cases: Vec<Case> = modules
        .iter()
        .zip(&bases)
        .map(|((m, _), b)| (b.as_str(), *m, 0, H, H))
        .collect();
    check_cases(native_model("hunyuan_video", &weights, 10), &cases, 0);
}

/// Families whose LoRAs use the native path under a trainer's prefix (ComfyUI maps them the same
/// way): HiDream (SimpleTuner's `transformer.` and `lycoris_`) and HunyuanDiT (the official
/// `base_model.model.`), on ComfyUI's `diffusion_model.` keys.
#[test]
fn hidream_and_hunyuan_dit_loras_under_their_trainers_prefixes_map() {
    let cases: &[Case] = &[
        (
            "transformer.double_stream_blocks.0.block.attn1.to_q",
            "double_stream_blocks.0.block.attn1.to_q",
            0,
            H,
            H,
        ),
        (
            "lycoris_double_stream_blocks_0_block_attn1_to_k",
            "double_stream_blocks.0.block.attn1.to_k",
            0,
            H,
            H,
        ),
        (
            "base_model.model.blocks.0.attn1.Wqkv",
            "blocks.0.attn1.Wqkv",
            0,
            H,
            H,
        ),
    ];
    let weights: Vec<(&str, &[usize])> = cases.iter().map(|c| (c.1, &[H, H][..])).collect();
    check_cases(native_model("dit", &weights, 30), cases, 0);
}

/// AuraFlow under fal's native names (`double_layers`, `single_layers` numbered from 0 each) and a
/// LoRA in diffusers naming (`joint_transformer_blocks`, `single_transformer_blocks`): each
/// module patches its native weight, the final modulation with its halves swapped.
#[test]
fn an_auraflow_lora_in_diffusers_naming_patches_the_native_layers() {
    // (native module, diffusers module, swapped)
    let modules: &[(&str, &str, bool)] = &[
        (
            "double_layers.0.attn.w2q",
            "joint_transformer_blocks.0.attn.to_q",
            false,
        ),
        (
            "double_layers.0.attn.w1k",
            "joint_transformer_blocks.0.attn.add_k_proj",
            false,
        ),
        (
            "double_layers.0.mlpC.c_proj",
            "joint_transformer_blocks.0.ff_context.out_projection",
            false,
        ),
        (
            "double_layers.0.modX.1",
            "joint_transformer_blocks.0.norm1.linear",
            false,
        ),
        (
            "single_layers.0.attn.w1v",
            "single_transformer_blocks.0.attn.to_v",
            false,
        ),
        (
            "single_layers.0.mlp.c_fc2",
            "single_transformer_blocks.0.ff.linear_2",
            false,
        ),
        ("cond_seq_linear", "context_embedder", false),
        ("modF.1", "norm_out.linear", true),
    ];
    let model = Model::from_tensors(
        "auraflow",
        modules
            .iter()
            .enumerate()
            .map(|(i, (m, _, swapped))| {
                let rows = if *swapped { 2 * H } else { H };
                (
                    format!("diffusion_model.{m}.weight"),
                    common::rand_tensor(&[rows, H], 50 + i as u64),
                )
            })
            .chain([(
                "diffusion_model.init_x_linear.weight".to_string(),
                common::rand_tensor(&[H, 6], 49),
            )]),
    )
    .unwrap();
    let mut tensors = Vec::new();
    for (i, (_, lora, swapped)) in modules.iter().enumerate() {
        let rows = if *swapped { 2 * H } else { H };
        let (up, down) = up_down(i, rows, H);
        tensors.push((format!("transformer.{lora}.lora_B.weight"), up, Dtype::F32));
        tensors.push((
            format!("transformer.{lora}.lora_A.weight"),
            down,
            Dtype::F32,
        ));
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("auraflow.safetensors");
    save_safetensors(&path, &tensors, &SafetensorsOptions::default()).unwrap();
    let (base, styled) = patched(model, &path);
    for (i, (m, _, swapped)) in modules.iter().enumerate() {
        let key = format!("diffusion_model.{m}.weight");
        let rows = if *swapped { 2 * H } else { H };
        let (up, down) = up_down(i, rows, H);
        let mut d = up.matmul(&down).unwrap();
        if *swapped {
            d = swap_halves(&d);
        }
        let want = (base.patched_weight(&key).unwrap() + d).unwrap();
        assert_close(&styled.patched_weight(&key).unwrap(), &want, &key);
    }
}

/// Wan under Alibaba's native names (what ComfyUI holds) and a LoRA in diffusers/PEFT naming
/// (`blocks.0.attn1.to_q`, `attn2.add_k_proj`, `ffn.net.0.proj`, `proj_out`) — plus one module in
/// the native naming, which maps directly: each patches its native weight.
#[test]
fn a_wan_lora_in_diffusers_naming_patches_the_native_blocks() {
    // (native module, the LoRA's module)
    let modules: &[(&str, &str)] = &[
        ("blocks.0.self_attn.q", "blocks.0.attn1.to_q"),
        ("blocks.0.self_attn.o", "blocks.0.attn1.to_out.0"),
        ("blocks.0.cross_attn.q", "blocks.0.attn2.to_q"),
        ("blocks.0.cross_attn.k_img", "blocks.0.attn2.add_k_proj"),
        ("blocks.0.ffn.0", "blocks.0.ffn.net.0.proj"),
        ("blocks.0.ffn.2", "blocks.0.ffn.net.2"),
        (
            "time_embedding.0",
            "condition_embedder.time_embedder.linear_1",
        ),
        ("head.head", "proj_out"),
        ("blocks.0.cross_attn.v", "blocks.0.cross_attn.v"),
    ];
    let weights: Vec<(&str, &[usize])> = modules.iter().map(|(m, _)| (*m, &[H, H][..])).collect();
    let bases: Vec<String> = modules
        .iter()
        .map(|(_, l)| format!("transformer.{l}"))
        .collect();
    let cases: Vec<Case> = modules
        .iter()
        .zip(&bases)
        .map(|((m, _), b)| (b.as_str(), *m, 0, H, H))
        .collect();
    check_cases(native_model("wan", &weights, 70), &cases, 0);
}

/// XLabs' Flux LoRAs (`double_blocks.N.processor.qkv_lora1.up.weight`, ...): the double blocks'
/// `qkv_lora1/2` patch the whole fused `img_attn.qkv` / `txt_attn.qkv`, `proj_lora1/2` the
/// projections, a single block's `qkv_lora` the q, k and v rows at the start of `linear1` and
/// `proj_lora` its `linear2`; ComfyUI's own `linear1_qkv` names the same rows.
#[test]
fn an_xlabs_flux_lora_patches_the_fused_weights_and_linear1_s_qkv_rows() {
    // (XLabs module, native weight, rows of the LoRA)
    let modules: &[(&str, &str, usize, usize)] = &[
        (
            "double_blocks.0.processor.qkv_lora1",
            "double_blocks.0.img_attn.qkv.weight",
            3 * H,
            H,
        ),
        (
            "double_blocks.0.processor.qkv_lora2",
            "double_blocks.0.txt_attn.qkv.weight",
            3 * H,
            H,
        ),
        (
            "double_blocks.0.processor.proj_lora1",
            "double_blocks.0.img_attn.proj.weight",
            H,
            H,
        ),
        (
            "single_blocks.0.processor.qkv_lora",
            "single_blocks.0.linear1.weight",
            3 * H,
            H,
        ),
        (
            "single_blocks.0.processor.proj_lora",
            "single_blocks.0.linear2.weight",
            H,
            H + MLP,
        ),
    ];
    let mut tensors = Vec::new();
    for (i, (m, _, rows, cols)) in modules.iter().enumerate() {
        let (up, down) = up_down(40 + i, *rows, *cols);
        tensors.push((format!("{m}.up.weight"), up, Dtype::F32));
        tensors.push((format!("{m}.down.weight"), down, Dtype::F32));
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("xlabs.safetensors");
    save_safetensors(&path, &tensors, &SafetensorsOptions::default()).unwrap();
    let (base, styled) = patched(flux("diffusion_model."), &path);
    for (i, (_, key, rows, cols)) in modules.iter().enumerate() {
        let key = format!("diffusion_model.{key}");
        let (up, down) = up_down(40 + i, *rows, *cols);
        let d = up.matmul(&down).unwrap();
        let want = add_rows(&base.patched_weight(&key).unwrap(), 0, &d);
        assert_close(&styled.patched_weight(&key).unwrap(), &want, &key);
    }
    // ComfyUI's `linear1_qkv` (kohya-style parts): the same rows.
    let (up, down) = up_down(60, 3 * H, H);
    let tensors = vec![
        (
            "diffusion_model.single_blocks.0.linear1_qkv.lora_up.weight".to_string(),
            up.clone(),
            Dtype::F32,
        ),
        (
            "diffusion_model.single_blocks.0.linear1_qkv.lora_down.weight".to_string(),
            down.clone(),
            Dtype::F32,
        ),
    ];
    let path = dir.path().join("linear1_qkv.safetensors");
    save_safetensors(&path, &tensors, &SafetensorsOptions::default()).unwrap();
    let (base, styled) = patched(flux(""), &path);
    let key = "single_blocks.0.linear1.weight";
    let want = add_rows(
        &base.patched_weight(key).unwrap(),
        0,
        &up.matmul(&down).unwrap(),
    );
    assert_close(&styled.patched_weight(key).unwrap(), &want, key);
}

/// Lumina 2 / Z-Image under NextDiT's native names (a fused `attention.qkv` with grouped
/// key/value heads: q 6 rows, k and v 2 each) and LoRAs in ComfyUI's (`attention.to_q`),
/// diffusers' (`attn.to_k`, `feed_forward.linear_1`), SimpleTuner's (`lycoris_`) and the native
/// naming: q, k and v patch their rows of `qkv` (found from `attention.out`'s columns), the rest
/// their whole weights.
#[test]
fn a_lumina2_lora_patches_the_grouped_head_qkv_rows() {
    const D: usize = 6;
    const KV: usize = 2;
    let weights: &[(&str, &[usize])] = &[
        ("x_embedder", &[D, 4]),
        ("layers.0.attention.qkv", &[D + 2 * KV, D]),
        ("layers.0.attention.out", &[D, D]),
        ("layers.0.feed_forward.w2", &[D, 8]),
        ("noise_refiner.0.feed_forward.w1", &[8, D]),
        ("context_refiner.0.attention.qkv", &[D + 2 * KV, D]),
        ("context_refiner.0.attention.out", &[D, D]),
    ];
    let model = native_model("lumina2", weights, 90);
    let cases: &[Case] = &[
        (
            "transformer.layers.0.attention.to_q",
            "layers.0.attention.qkv",
            0,
            D,
            D,
        ),
        (
            "diffusion_model.layers.0.attn.to_k",
            "layers.0.attention.qkv",
            D,
            KV,
            D,
        ),
        (
            "layers.0.attn.to_v",
            "layers.0.attention.qkv",
            D + KV,
            KV,
            D,
        ),
        (
            "transformer.layers.0.attn.to_out.0",
            "layers.0.attention.out",
            0,
            D,
            D,
        ),
        (
            "transformer.noise_refiner.0.feed_forward.linear_1",
            "noise_refiner.0.feed_forward.w1",
            0,
            8,
            D,
        ),
        (
            "lycoris_context_refiner_0_attention_to_v",
            "context_refiner.0.attention.qkv",
            D + KV,
            KV,
            D,
        ),
        (
            "transformer.layers.0.feed_forward.w2",
            "layers.0.feed_forward.w2",
            0,
            D,
            8,
        ),
    ];
    check_cases(model, cases, 80);
}

/// PixArt under its original names (ComfyUI's: a fused `attn.qkv` in thirds, a fused cross-attention
/// `kv_linear` in halves) and a LoRA in diffusers naming under the prefixes its trainers use
/// (`transformer.`, `base_model.model.`, the old `unet.base_model.model.`): q, k and v patch their
/// rows, the rest their whole weights.
#[test]
fn a_pixart_lora_in_diffusers_naming_patches_the_fused_attention_rows() {
    let weights: &[(&str, &[usize])] = &[
        ("blocks.0.attn.qkv", &[3 * H, H]),
        ("blocks.0.attn.proj", &[H, H]),
        ("blocks.0.cross_attn.q_linear", &[H, H]),
        ("blocks.0.cross_attn.kv_linear", &[2 * H, H]),
        ("blocks.0.mlp.fc1", &[MLP, H]),
        ("t_block.1", &[6 * H, H]),
        ("final_layer.linear", &[H, H]),
    ];
    let cases: &[Case] = &[
        (
            "transformer.transformer_blocks.0.attn1.to_q",
            "blocks.0.attn.qkv",
            0,
            H,
            H,
        ),
        (
            "transformer.transformer_blocks.0.attn1.to_k",
            "blocks.0.attn.qkv",
            H,
            H,
            H,
        ),
        (
            "base_model.model.transformer_blocks.0.attn1.to_v",
            "blocks.0.attn.qkv",
            2 * H,
            H,
            H,
        ),
        (
            "transformer.transformer_blocks.0.attn1.to_out.0",
            "blocks.0.attn.proj",
            0,
            H,
            H,
        ),
        (
            "transformer.transformer_blocks.0.attn2.to_q",
            "blocks.0.cross_attn.q_linear",
            0,
            H,
            H,
        ),
        (
            "unet.base_model.model.transformer_blocks.0.attn2.to_k",
            "blocks.0.cross_attn.kv_linear",
            0,
            H,
            H,
        ),
        (
            "transformer.transformer_blocks.0.attn2.to_v",
            "blocks.0.cross_attn.kv_linear",
            H,
            H,
            H,
        ),
        (
            "transformer.transformer_blocks.0.ff.net.0.proj",
            "blocks.0.mlp.fc1",
            0,
            MLP,
            H,
        ),
        ("transformer.adaln_single.linear", "t_block.1", 0, 6 * H, H),
        ("transformer.proj_out", "final_layer.linear", 0, H, H),
    ];
    check_cases(native_model("pixart", weights, 120), cases, 140);
}
