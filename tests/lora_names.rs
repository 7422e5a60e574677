//! LoRA names ComfyUI maps onto a model and that must map here too: Flux's single-block MLP input
//! (`single_transformer_blocks.N.proj_mlp`, the rows after q, k and v of BFL's `linear1`), SD3's
//! context modulation of every joint block (`transformer_blocks.N.norm1_context.linear`), and
//! ComfyUI's generic text-encoder form (`text_encoders.<model key without .weight>`). Each file
//! in each trainer's naming maps every module (none left), with the model's keys alone — what
//! `lora_file::load` and `lora_merge` see — and with its shapes, and every patched weight equals
//! a hand merge. A load that leaves modules says which, in one warning.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{Device, Tensor};
use residency::patcher::{lora_file, ModelPatcher};
use residency::tools::{merge_files, MergeConfig};
use residency::vram::DeviceId;
use residency::weights::{save_safetensors, Model, SafetensorsOptions};
use residency::Dtype;

/// The hidden size of the tiny DiTs.
const H: usize = 4;
/// Flux's MLP width (`mlp_ratio` 4, what ComfyUI's map assumes).
const MLP: usize = 4 * H;
/// The rank of every LoRA here.
const RANK: usize = 2;

/// How a trainer writes the LoRA of one diffusers module path.
#[derive(Debug, Clone, Copy)]
enum Naming {
    /// diffusers / PEFT: `transformer.<path>.lora_B.weight`.
    Peft,
    /// The same without the `transformer.` prefix.
    Bare,
    /// OneTrainer (kohya style): `lora_transformer_<path with _>.lora_up.weight`, with an alpha.
    OneTrainer,
    /// SimpleTuner's LyCORIS: `lycoris_<path with _>.lora_up.weight`, with an alpha.
    Lycoris,
}

impl Naming {
    const ALL: [Naming; 4] = [
        Naming::Peft,
        Naming::Bare,
        Naming::OneTrainer,
        Naming::Lycoris,
    ];

    /// The module's base name in the file.
    fn base(self, path: &str) -> String {
        match self {
            Naming::Peft => format!("transformer.{path}"),
            Naming::Bare => path.to_string(),
            Naming::OneTrainer => format!("lora_transformer_{}", path.replace('.', "_")),
            Naming::Lycoris => format!("lycoris_{}", path.replace('.', "_")),
        }
    }

    /// The file's tensors of one LoRA module: up, down and, for the kohya-style names, an alpha
    /// of 1 (a scale of `1 / RANK`).
    fn tensors(self, path: &str, up: Tensor, down: Tensor) -> Vec<(String, Tensor, Dtype)> {
        let base = self.base(path);
        match self {
            Naming::Peft | Naming::Bare => vec![
                (format!("{base}.lora_B.weight"), up, Dtype::F32),
                (format!("{base}.lora_A.weight"), down, Dtype::F32),
            ],
            Naming::OneTrainer | Naming::Lycoris => vec![
                (format!("{base}.lora_up.weight"), up, Dtype::F32),
                (format!("{base}.lora_down.weight"), down, Dtype::F32),
                (format!("{base}.alpha"), scalar(1.0), Dtype::F32),
            ],
        }
    }

    /// The scale `alpha / rank` the tensors above give.
    fn scale(self) -> f64 {
        match self {
            Naming::Peft | Naming::Bare => 1.0,
            Naming::OneTrainer | Naming::Lycoris => 1.0 / RANK as f64,
        }
    }
}

fn scalar(v: f32) -> Tensor {
    Tensor::new(v, &Device::Cpu).unwrap()
}

/// One LoRA module of a DiT file: its diffusers path, the native weight it patches (after
/// `diffusion_model.`), the first row it patches, its `(rows, cols)`, and whether diffusers
/// orders its output halves the other way round.
struct Module {
    path: &'static str,
    native: &'static str,
    start: usize,
    rows: usize,
    cols: usize,
    swap: bool,
}

const fn m(path: &'static str, native: &'static str, start: usize, rows: usize) -> Module {
    Module {
        path,
        native,
        start,
        rows,
        cols: H,
        swap: false,
    }
}

/// A tiny Flux under ComfyUI's `diffusion_model.` names: one double block, two single blocks.
const FLUX: &[(&str, &[usize])] = &[
    ("img_in", &[H, 6]),
    ("double_blocks.0.img_attn.qkv", &[3 * H, H]),
    ("single_blocks.0.linear1", &[3 * H + MLP, H]),
    ("single_blocks.0.linear2", &[H, H + MLP]),
    ("single_blocks.1.linear1", &[3 * H + MLP, H]),
];

const FLUX_LORA: &[Module] = &[
    m(
        "single_transformer_blocks.0.proj_mlp",
        "single_blocks.0.linear1",
        3 * H,
        MLP,
    ),
    m(
        "single_transformer_blocks.1.proj_mlp",
        "single_blocks.1.linear1",
        3 * H,
        MLP,
    ),
    m(
        "single_transformer_blocks.1.attn.to_k",
        "single_blocks.1.linear1",
        H,
        H,
    ),
    m(
        "transformer_blocks.0.attn.to_v",
        "double_blocks.0.img_attn.qkv",
        2 * H,
        H,
    ),
    Module {
        cols: H + MLP,
        ..m(
            "single_transformer_blocks.0.proj_out",
            "single_blocks.0.linear2",
            0,
            H,
        )
    },
];

/// A tiny SD3 under ComfyUI's names: three joint blocks, the last one's context stream pre-only
/// (its modulation two chunks of the hidden size, `(shift, scale)`).
const SD3: &[(&str, &[usize])] = &[
    ("x_embedder.proj", &[H, 2, 2, 2]),
    ("joint_blocks.0.x_block.attn.qkv", &[3 * H, H]),
    ("joint_blocks.0.x_block.adaLN_modulation.1", &[6 * H, H]),
    (
        "joint_blocks.0.context_block.adaLN_modulation.1",
        &[6 * H, H],
    ),
    ("joint_blocks.1.x_block.adaLN_modulation.1", &[6 * H, H]),
    (
        "joint_blocks.1.context_block.adaLN_modulation.1",
        &[6 * H, H],
    ),
    ("joint_blocks.2.x_block.adaLN_modulation.1", &[6 * H, H]),
    (
        "joint_blocks.2.context_block.adaLN_modulation.1",
        &[2 * H, H],
    ),
];

const SD3_LORA: &[Module] = &[
    m(
        "transformer_blocks.0.norm1_context.linear",
        "joint_blocks.0.context_block.adaLN_modulation.1",
        0,
        6 * H,
    ),
    m(
        "transformer_blocks.1.norm1_context.linear",
        "joint_blocks.1.context_block.adaLN_modulation.1",
        0,
        6 * H,
    ),
    Module {
        swap: true,
        ..m(
            "transformer_blocks.2.norm1_context.linear",
            "joint_blocks.2.context_block.adaLN_modulation.1",
            0,
            2 * H,
        )
    },
    m(
        "transformer_blocks.1.norm1.linear",
        "joint_blocks.1.x_block.adaLN_modulation.1",
        0,
        6 * H,
    ),
    m(
        "transformer_blocks.0.attn.to_q",
        "joint_blocks.0.x_block.attn.qkv",
        0,
        H,
    ),
];

/// The tensors of a model of `weights` (native paths, shapes) under `diffusion_model.`.
fn dit_weights(weights: &[(&str, &[usize])], seed: u64) -> Vec<(String, Tensor)> {
    weights
        .iter()
        .enumerate()
        .map(|(i, (path, shape))| {
            (
                format!("diffusion_model.{path}.weight"),
                common::rand_tensor(shape, seed + i as u64),
            )
        })
        .collect()
}

/// Module `i`'s `(up, down)`.
fn up_down(i: usize, rows: usize, cols: usize) -> (Tensor, Tensor) {
    (
        common::rand_tensor(&[rows, RANK], 100 + 2 * i as u64),
        common::rand_tensor(&[RANK, cols], 101 + 2 * i as u64),
    )
}

/// Writes the LoRA of `modules` in `naming` into `dir`.
fn write_dit_lora(dir: &Path, modules: &[Module], naming: Naming) -> PathBuf {
    let mut tensors = Vec::new();
    for (i, md) in modules.iter().enumerate() {
        let (up, down) = up_down(i, md.rows, md.cols);
        tensors.extend(naming.tensors(md.path, up, down));
    }
    let path = dir.join(format!("{naming:?}.safetensors"));
    save_safetensors(&path, &tensors, &SafetensorsOptions::default()).unwrap();
    path
}

fn swap_halves(t: &Tensor) -> Tensor {
    let h = t.dim(0).unwrap() / 2;
    Tensor::cat(&[t.narrow(0, h, h).unwrap(), t.narrow(0, 0, h).unwrap()], 0).unwrap()
}

/// `w` with `delta` added to its rows from `start`.
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

/// The weights `modules` change, merged by hand: each module's `scale · up · down` (its halves
/// swapped where the orders differ) added to its rows of its native weight.
fn hand_merge(
    base: &[(String, Tensor)],
    modules: &[Module],
    scale: f64,
) -> HashMap<String, Tensor> {
    let mut out: HashMap<String, Tensor> = HashMap::new();
    for (i, md) in modules.iter().enumerate() {
        let key = format!("diffusion_model.{}.weight", md.native);
        let w = out.remove(&key).unwrap_or_else(|| {
            base.iter()
                .find(|(k, _)| *k == key)
                .map(|(_, t)| t.clone())
                .unwrap()
        });
        let (up, down) = up_down(i, md.rows, md.cols);
        let mut delta = (up.matmul(&down).unwrap() * scale).unwrap();
        if md.swap {
            delta = swap_halves(&delta);
        }
        out.insert(key, add_rows(&w, md.start, &delta));
    }
    out
}

fn assert_close(got: &Tensor, want: &Tensor, what: &str) {
    let (g, w) = (common::f32s(got), common::f32s(want));
    assert_eq!(g.len(), w.len(), "{what}");
    for (a, b) in g.iter().zip(&w) {
        assert!(
            (a - b).abs() <= 1e-6 * b.abs().max(1.0),
            "{what}: {a} vs {b}"
        );
    }
}

/// Loads `path` onto `model` with its keys alone (`shapes` false) or its shapes, asserts that
/// every module and tensor of the file found its weight, and returns the model patched with it.
fn load_all(model: Model, path: &Path, shapes: bool) -> ModelPatcher {
    let lora = if shapes {
        lora_file::load_for(path, &model).unwrap()
    } else {
        lora_file::load(path, model.keys()).unwrap()
    };
    let left: Vec<String> = lora
        .unmatched_modules
        .iter()
        .map(|m| format!("{}: {}", m.lora_module, m.reason))
        .collect();
    assert!(left.is_empty(), "modules left: {left:?}");
    assert!(
        lora.unmatched_lora_keys.is_empty(),
        "{:?}",
        lora.unmatched_lora_keys
    );
    let mut patcher = ModelPatcher::on_device(Arc::new(model), DeviceId::Cpu);
    patcher.add_patches(lora.patches, 1.0, 1.0).unwrap();
    patcher
}

/// Every naming of `modules`, loaded both ways onto the model of `weights`, patches each native
/// weight as the hand merge does, and changes no other.
fn check_dit(name: &str, weights: &[(&str, &[usize])], modules: &[Module]) {
    let base = dit_weights(weights, 7);
    let dir = tempfile::tempdir().unwrap();
    for naming in Naming::ALL {
        let path = write_dit_lora(dir.path(), modules, naming);
        let want = hand_merge(&base, modules, naming.scale());
        for shapes in [false, true] {
            let model = Model::from_tensors(name, base.iter().cloned()).unwrap();
            let patched = load_all(model, &path, shapes);
            for (key, clean) in &base {
                let what = format!("{name} {naming:?}, shapes {shapes}: {key}");
                let got = patched.patched_weight(key).unwrap();
                assert_close(&got, want.get(key).unwrap_or(clean), &what);
            }
        }
    }
}

#[test]
fn flux_single_blocks_mlp_input_maps_in_every_naming_with_keys_alone_or_shapes() {
    check_dit("flux", FLUX, FLUX_LORA);
}

#[test]
fn sd3_context_modulation_of_every_joint_block_maps_in_every_naming() {
    check_dit("sd3", SD3, SD3_LORA);
}

/// `lora_merge` maps with the base's keys: the Flux MLP rows and every SD3 context modulation
/// land in the merged file as in the hand merge.
#[test]
fn lora_merge_writes_the_mlp_rows_and_every_context_modulation() {
    let dir = tempfile::tempdir().unwrap();
    for (name, weights, modules) in [("flux", FLUX, FLUX_LORA), ("sd3", SD3, SD3_LORA)] {
        let base = dit_weights(weights, 7);
        let base_path = dir.path().join(format!("{name}.safetensors"));
        let stored: Vec<_> = base
            .iter()
            .map(|(k, t)| (k.clone(), t.clone(), Dtype::F32))
            .collect();
        save_safetensors(&base_path, &stored, &SafetensorsOptions::default()).unwrap();
        let lora = write_dit_lora(dir.path(), modules, Naming::Peft);
        let out = dir.path().join(format!("{name}_merged.safetensors"));
        let args: Vec<String> = [&base_path, &lora, &out]
            .iter()
            .zip(["--model", "--lora", "--out"])
            .flat_map(|(p, flag)| [flag.to_string(), p.display().to_string()])
            .collect();
        let report = merge_files(&MergeConfig::from_args(&args).unwrap()).unwrap();
        assert!(
            report.loras[0].ignored_lora_keys.is_empty(),
            "{:?}",
            report.loras[0].ignored_lora_keys
        );
        let merged = candle_core::safetensors::load(&out, &Device::Cpu).unwrap();
        let want = hand_merge(&base, modules, 1.0);
        for (key, clean) in &base {
            assert_close(&merged[key], want.get(key).unwrap_or(clean), key);
        }
    }
}

/// One text encoder's weights as ComfyUI holds them (after `clip_l.` / `clip_g.`): embeddings,
/// an encoder layer's attention, MLP and norms, the final norm, the projection.
const TEXT_ENCODER: &[(&str, &[usize])] = &[
    (
        "transformer.text_model.embeddings.token_embedding.weight",
        &[10, H],
    ),
    (
        "transformer.text_model.embeddings.position_embedding.weight",
        &[6, H],
    ),
    (
        "transformer.text_model.encoder.layers.0.layer_norm1.weight",
        &[H],
    ),
    (
        "transformer.text_model.encoder.layers.0.layer_norm1.bias",
        &[H],
    ),
    (
        "transformer.text_model.encoder.layers.0.self_attn.q_proj.weight",
        &[H, H],
    ),
    (
        "transformer.text_model.encoder.layers.0.self_attn.q_proj.bias",
        &[H],
    ),
    (
        "transformer.text_model.encoder.layers.0.mlp.fc1.weight",
        &[2 * H, H],
    ),
    ("transformer.text_model.final_layer_norm.weight", &[H]),
    ("transformer.text_model.final_layer_norm.bias", &[H]),
    ("transformer.text_projection.weight", &[H, H]),
];

/// How a model names its two CLIP text encoders: `(clip_l's prefix, clip_g's prefix, whether the
/// paths keep ComfyUI's leading `transformer.`)`.
const TEXT_ENCODER_LAYOUTS: &[(&str, &str, bool)] = &[
    // ComfyUI's CLIP in memory.
    ("clip_l.", "clip_g.", true),
    // An SD3-style checkpoint.
    ("text_encoders.clip_l.", "text_encoders.clip_g.", true),
    // An SDXL checkpoint (Hugging Face names).
    ("conditioner.embedders.0.", "conditioner.embedders.1.", true),
    // diffusers' pipeline folders.
    ("text_encoder.", "text_encoder_2.", false),
];

/// The seed of a text-encoder weight or patch: distinct per encoder and weight.
fn te_seed(encoder: usize, i: usize) -> u64 {
    1000 + 100 * encoder as u64 + 2 * i as u64
}

/// ComfyUI's generic text-encoder LoRA for both encoders: a LoRA on every 2-D weight, a diff on
/// every norm weight and bias (`.diff_b` on its module). Returns the file.
fn write_generic_te_lora(dir: &Path) -> PathBuf {
    let mut tensors = Vec::new();
    for (e, name) in ["clip_l", "clip_g"].iter().enumerate() {
        for (i, (path, shape)) in TEXT_ENCODER.iter().enumerate() {
            let seed = te_seed(e, i) + 500;
            let (module, is_bias) = match path.strip_suffix(".bias") {
                Some(m) => (m, true),
                None => (path.strip_suffix(".weight").unwrap(), false),
            };
            let base = format!("text_encoders.{name}.{module}");
            match (shape.len(), is_bias) {
                (2, _) => {
                    let up = common::rand_tensor(&[shape[0], RANK], seed);
                    let down = common::rand_tensor(&[RANK, shape[1]], seed + 1);
                    tensors.push((format!("{base}.lora_up.weight"), up, Dtype::F32));
                    tensors.push((format!("{base}.lora_down.weight"), down, Dtype::F32));
                    tensors.push((format!("{base}.alpha"), scalar(RANK as f32), Dtype::F32));
                }
                // The q projection's bias stays unpatched.
                (_, true) if path.contains("q_proj") => {}
                (_, true) => tensors.push((
                    format!("{base}.diff_b"),
                    common::rand_tensor(shape, seed),
                    Dtype::F32,
                )),
                (_, false) => tensors.push((
                    format!("{base}.diff"),
                    common::rand_tensor(shape, seed),
                    Dtype::F32,
                )),
            }
        }
    }
    let path = dir.join("text_encoders.safetensors");
    save_safetensors(&path, &tensors, &SafetensorsOptions::default()).unwrap();
    path
}

/// What the file above does to weight `i` of encoder `e`, whose clean value is `w`.
fn te_hand_merge(e: usize, i: usize, w: &Tensor) -> Tensor {
    let (path, shape) = TEXT_ENCODER[i];
    let seed = te_seed(e, i) + 500;
    if shape.len() == 2 {
        let up = common::rand_tensor(&[shape[0], RANK], seed);
        let down = common::rand_tensor(&[RANK, shape[1]], seed + 1);
        (w + up.matmul(&down).unwrap()).unwrap()
    } else if path.contains("q_proj") {
        w.clone()
    } else {
        (w + common::rand_tensor(shape, seed)).unwrap()
    }
}

#[test]
fn comfyui_generic_text_encoder_names_patch_every_text_encoder_weight() {
    let dir = tempfile::tempdir().unwrap();
    let lora = write_generic_te_lora(dir.path());
    for &(l, g, keeps_transformer) in TEXT_ENCODER_LAYOUTS {
        let key = |prefix: &str, path: &str| {
            let path = if keeps_transformer {
                path
            } else {
                path.strip_prefix("transformer.").unwrap()
            };
            format!("{prefix}{path}")
        };
        let mut weights = Vec::new();
        for (e, prefix) in [l, g].into_iter().enumerate() {
            for (i, (path, shape)) in TEXT_ENCODER.iter().enumerate() {
                weights.push((key(prefix, path), common::rand_tensor(shape, te_seed(e, i))));
            }
        }
        for shapes in [false, true] {
            let model = Model::from_tensors("sdxl", weights.iter().cloned()).unwrap();
            let patched = load_all(model, &lora, shapes);
            for (e, prefix) in [l, g].into_iter().enumerate() {
                for (i, (path, shape)) in TEXT_ENCODER.iter().enumerate() {
                    let k = key(prefix, path);
                    let want = te_hand_merge(e, i, &common::rand_tensor(shape, te_seed(e, i)));
                    assert_close(&patched.patched_weight(&k).unwrap(), &want, &k);
                }
            }
        }
    }
}

#[test]
fn a_load_that_leaves_modules_or_tensors_warns_naming_every_one() {
    let dir = tempfile::tempdir().unwrap();
    let base = dit_weights(FLUX, 7);
    let write = |name: &str, paths: &[&str]| {
        let mut tensors = Vec::new();
        for (i, p) in paths.iter().enumerate() {
            let (up, down) = up_down(i, MLP, H);
            tensors.extend(Naming::Peft.tensors(p, up, down));
        }
        let path = dir.path().join(name);
        save_safetensors(&path, &tensors, &SafetensorsOptions::default()).unwrap();
        path
    };
    let strays = ["mystery.proj", "single_transformer_blocks.9.proj_mlp"];
    let partly = write(
        "partly.safetensors",
        &["single_transformer_blocks.0.proj_mlp", strays[0], strays[1]],
    );
    let nothing = write("nothing.safetensors", &strays);
    let model = Model::from_tensors("flux", base.iter().cloned()).unwrap();

    let mut loaded = None;
    let logged = common::warnings::warnings_of(|| {
        loaded = Some(lora_file::load(&partly, model.keys()).unwrap())
    });
    let loaded = loaded.unwrap();
    assert_eq!(
        loaded.matched_model_keys,
        ["diffusion_model.single_blocks.0.linear1.weight"]
    );
    let summary: Vec<&String> = logged
        .iter()
        .filter(|w| w.contains("partly matched"))
        .collect();
    assert_eq!(summary.len(), 1, "{logged:?}");
    for stray in strays {
        assert!(
            summary[0].contains(&format!("transformer.{stray}")),
            "{}",
            summary[0]
        );
    }
    assert!(
        summary[0].contains("matched=1") && summary[0].contains("left=2"),
        "{}",
        summary[0]
    );
    assert!(summary[0].contains("partly.safetensors"), "{}", summary[0]);

    let logged = common::warnings::warnings_of(|| {
        let none = lora_file::load(&nothing, model.keys()).unwrap();
        assert!(none.patches.is_empty());
        assert_eq!(none.unmatched_modules.len(), 2);
    });
    let summary: Vec<&String> = logged.iter().filter(|w| w.contains("no module")).collect();
    assert_eq!(summary.len(), 1, "{logged:?}");
    for stray in strays {
        assert!(
            summary[0].contains(&format!("transformer.{stray}")),
            "{}",
            summary[0]
        );
    }

    // Every module matched, one tensor no part of a patch: named too.
    let mut tensors = Naming::Peft.tensors(
        "single_transformer_blocks.0.proj_mlp",
        common::rand_tensor(&[MLP, RANK], 1),
        common::rand_tensor(&[RANK, H], 2),
    );
    let odd = "transformer.single_transformer_blocks.0.proj_mlp.something_else";
    tensors.push((odd.to_string(), scalar(1.0), Dtype::F32));
    let extra = dir.path().join("extra.safetensors");
    save_safetensors(&extra, &tensors, &SafetensorsOptions::default()).unwrap();
    let logged = common::warnings::warnings_of(|| {
        let l = lora_file::load(&extra, model.keys()).unwrap();
        assert!(l.unmatched_modules.is_empty() && l.patches.len() == 1);
    });
    assert!(
        logged.len() == 1 && logged[0].contains(odd) && logged[0].contains("no part of a patch"),
        "{logged:?}"
    );
}
