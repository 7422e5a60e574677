//! Diffusers and PEFT names of DiT LoRAs — Flux (and Chroma), SD3 / SD3.5, AuraFlow, Lumina 2 /
//! Z-Image, PixArt, Wan — mapped onto the families' native keys (BFL's `double_blocks`,
//! Stability's `joint_blocks`, fal's `double_layers` / `single_layers`, NextDiT's
//! `layers.N.attention.qkv`, PixArt's `blocks.N.attn.qkv`, Alibaba's `blocks.N.self_attn`).
//!
//! The native checkpoint fuses projections the diffusers model keeps apart: a double block's
//! `img_attn.qkv` is q, k and v stacked by rows (`[3h, h]`), a single block's `linear1` is q, k, v
//! and the MLP input (`[3h + m, h]`). A LoRA for one of them patches its rows of the fused weight
//! (an offset patch, `PatchKey::offset`). The final layer's modulation is `(shift, scale)` natively
//! and `(scale, shift)` in diffusers: a LoRA's output halves are swapped (the rows of its up
//! matrix), so it patches the rows it was trained for.
//!
//! The family is detected from the model's own keys (`double_blocks.0.img_attn.qkv.weight`, under
//! any prefix). LoRA names: diffusers/PEFT (`transformer.transformer_blocks.0.attn.to_q`,
//! `base_model.model.…`), OneTrainer's underscored `lora_transformer_transformer_blocks_0_attn_to_q`.
//! Where a part's rows depend on the model's sizes — a single block's MLP rows start `3 × hidden`
//! into `linear1`, and SD3's context modulation swaps its halves when it has two chunks of the
//! hidden size (the last, pre-only block) — they are the model's when its shapes are known
//! (`load_for`) and else the patch's own (`module_shape.rs`: the module's input is the hidden
//! size). A name of the family that cannot be placed (no such block, a part whose sizes neither
//! the model nor the patch gives) is left unmatched and reported.

use std::collections::HashMap;

use super::module_shape::module_shape;
use crate::patcher::adapters::{Offset, Patch};
use crate::patcher::PatchKey;

/// Where a diffusers module lands in the native model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Target {
    /// The native module path (without `.weight`).
    pub(super) module: String,
    /// The rows of a fused weight it patches.
    pub(super) part: Part,
}

/// Which rows of the native weight a module's LoRA patches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Part {
    /// The whole weight.
    Whole,
    /// The `i`-th of the three `h`-row blocks of a fused q/k/v weight.
    Qkv(usize),
    /// The MLP input rows after q, k and v in a single block's `linear1`.
    SingleMlp,
    /// The q, k and v rows together at the start of a single block's `linear1` (XLabs'
    /// `qkv_lora`, ComfyUI's `linear1_qkv`).
    SingleQkv,
    /// The `i`-th half (k, then v) of a fused `kv` weight (PixArt's cross-attention `kv_linear`).
    Kv(usize),
    /// The `i`-th of q, k, v in a fused `qkv` with grouped key/value heads (Lumina 2, Z-Image):
    /// q has as many rows as the sibling `out` projection has columns, k and v share the rest.
    GqaQkv(usize),
    /// The whole weight, with the output halves swapped (`(scale, shift)` → `(shift, scale)`).
    SwapHalves,
    /// [`Part::SwapHalves`] when the native weight has two chunks of the hidden size (SD3's last
    /// context block, whose modulation is `(shift, scale)` natively and `AdaLayerNormContinuous`'
    /// `(scale, shift)` in diffusers), else [`Part::Whole`] (six chunks in the same order).
    SwapHalvesIfPair,
}

/// `template` (`{N}` for a block number) matched against `name`, dotted or with every `.` as `_`.
fn match_template(template: &str, name: &str, underscored: bool) -> Option<Option<usize>> {
    let t = if underscored {
        template.replace('.', "_")
    } else {
        template.to_string()
    };
    match t.split_once("{N}") {
        None => (t == name).then_some(None),
        Some((pre, post)) => {
            let mid = name.strip_prefix(pre)?.strip_suffix(post)?;
            mid.parse::<usize>().ok().map(Some)
        }
    }
}

/// diffusers module → native module and part, for Flux.
const FLUX: &[(&str, &str, Part)] = &[
    (
        "transformer_blocks.{N}.attn.to_q",
        "double_blocks.{N}.img_attn.qkv",
        Part::Qkv(0),
    ),
    (
        "transformer_blocks.{N}.attn.to_k",
        "double_blocks.{N}.img_attn.qkv",
        Part::Qkv(1),
    ),
    (
        "transformer_blocks.{N}.attn.to_v",
        "double_blocks.{N}.img_attn.qkv",
        Part::Qkv(2),
    ),
    (
        "transformer_blocks.{N}.attn.add_q_proj",
        "double_blocks.{N}.txt_attn.qkv",
        Part::Qkv(0),
    ),
    (
        "transformer_blocks.{N}.attn.add_k_proj",
        "double_blocks.{N}.txt_attn.qkv",
        Part::Qkv(1),
    ),
    (
        "transformer_blocks.{N}.attn.add_v_proj",
        "double_blocks.{N}.txt_attn.qkv",
        Part::Qkv(2),
    ),
    (
        "transformer_blocks.{N}.attn.to_out.0",
        "double_blocks.{N}.img_attn.proj",
        Part::Whole,
    ),
    (
        "transformer_blocks.{N}.attn.to_add_out",
        "double_blocks.{N}.txt_attn.proj",
        Part::Whole,
    ),
    (
        "transformer_blocks.{N}.ff.net.0.proj",
        "double_blocks.{N}.img_mlp.0",
        Part::Whole,
    ),
    (
        "transformer_blocks.{N}.ff.net.2",
        "double_blocks.{N}.img_mlp.2",
        Part::Whole,
    ),
    (
        "transformer_blocks.{N}.ff_context.net.0.proj",
        "double_blocks.{N}.txt_mlp.0",
        Part::Whole,
    ),
    (
        "transformer_blocks.{N}.ff_context.net.2",
        "double_blocks.{N}.txt_mlp.2",
        Part::Whole,
    ),
    (
        "transformer_blocks.{N}.norm1.linear",
        "double_blocks.{N}.img_mod.lin",
        Part::Whole,
    ),
    (
        "transformer_blocks.{N}.norm1_context.linear",
        "double_blocks.{N}.txt_mod.lin",
        Part::Whole,
    ),
    (
        "single_transformer_blocks.{N}.attn.to_q",
        "single_blocks.{N}.linear1",
        Part::Qkv(0),
    ),
    (
        "single_transformer_blocks.{N}.attn.to_k",
        "single_blocks.{N}.linear1",
        Part::Qkv(1),
    ),
    (
        "single_transformer_blocks.{N}.attn.to_v",
        "single_blocks.{N}.linear1",
        Part::Qkv(2),
    ),
    (
        "single_transformer_blocks.{N}.proj_mlp",
        "single_blocks.{N}.linear1",
        Part::SingleMlp,
    ),
    (
        "single_transformer_blocks.{N}.proj_out",
        "single_blocks.{N}.linear2",
        Part::Whole,
    ),
    (
        "single_transformer_blocks.{N}.norm.linear",
        "single_blocks.{N}.modulation.lin",
        Part::Whole,
    ),
    ("x_embedder", "img_in", Part::Whole),
    ("context_embedder", "txt_in", Part::Whole),
    (
        "time_text_embed.timestep_embedder.linear_1",
        "time_in.in_layer",
        Part::Whole,
    ),
    (
        "time_text_embed.timestep_embedder.linear_2",
        "time_in.out_layer",
        Part::Whole,
    ),
    (
        "time_text_embed.guidance_embedder.linear_1",
        "guidance_in.in_layer",
        Part::Whole,
    ),
    (
        "time_text_embed.guidance_embedder.linear_2",
        "guidance_in.out_layer",
        Part::Whole,
    ),
    (
        "time_text_embed.text_embedder.linear_1",
        "vector_in.in_layer",
        Part::Whole,
    ),
    (
        "time_text_embed.text_embedder.linear_2",
        "vector_in.out_layer",
        Part::Whole,
    ),
    (
        "norm_out.linear",
        "final_layer.adaLN_modulation.1",
        Part::SwapHalves,
    ),
    ("proj_out", "final_layer.linear", Part::Whole),
    // XLabs' names (`…processor.qkv_lora1.up.weight`, grouped whole by `groups.rs`) and
    // ComfyUI's own `linear1_qkv`.
    (
        "double_blocks.{N}.processor.qkv_lora1",
        "double_blocks.{N}.img_attn.qkv",
        Part::Whole,
    ),
    (
        "double_blocks.{N}.processor.qkv_lora2",
        "double_blocks.{N}.txt_attn.qkv",
        Part::Whole,
    ),
    (
        "double_blocks.{N}.processor.proj_lora1",
        "double_blocks.{N}.img_attn.proj",
        Part::Whole,
    ),
    (
        "double_blocks.{N}.processor.proj_lora2",
        "double_blocks.{N}.txt_attn.proj",
        Part::Whole,
    ),
    (
        "single_blocks.{N}.processor.qkv_lora",
        "single_blocks.{N}.linear1",
        Part::SingleQkv,
    ),
    (
        "single_blocks.{N}.processor.proj_lora",
        "single_blocks.{N}.linear2",
        Part::Whole,
    ),
    (
        "single_blocks.{N}.linear1_qkv",
        "single_blocks.{N}.linear1",
        Part::SingleQkv,
    ),
];

/// diffusers module → native module and part, for SD3 / SD3.5 (Stability's `joint_blocks`).
const SD3: &[(&str, &str, Part)] = &[
    (
        "transformer_blocks.{N}.attn.to_q",
        "joint_blocks.{N}.x_block.attn.qkv",
        Part::Qkv(0),
    ),
    (
        "transformer_blocks.{N}.attn.to_k",
        "joint_blocks.{N}.x_block.attn.qkv",
        Part::Qkv(1),
    ),
    (
        "transformer_blocks.{N}.attn.to_v",
        "joint_blocks.{N}.x_block.attn.qkv",
        Part::Qkv(2),
    ),
    (
        "transformer_blocks.{N}.attn.add_q_proj",
        "joint_blocks.{N}.context_block.attn.qkv",
        Part::Qkv(0),
    ),
    (
        "transformer_blocks.{N}.attn.add_k_proj",
        "joint_blocks.{N}.context_block.attn.qkv",
        Part::Qkv(1),
    ),
    (
        "transformer_blocks.{N}.attn.add_v_proj",
        "joint_blocks.{N}.context_block.attn.qkv",
        Part::Qkv(2),
    ),
    (
        "transformer_blocks.{N}.attn.to_out.0",
        "joint_blocks.{N}.x_block.attn.proj",
        Part::Whole,
    ),
    (
        "transformer_blocks.{N}.attn.to_add_out",
        "joint_blocks.{N}.context_block.attn.proj",
        Part::Whole,
    ),
    (
        "transformer_blocks.{N}.attn2.to_q",
        "joint_blocks.{N}.x_block.attn2.qkv",
        Part::Qkv(0),
    ),
    (
        "transformer_blocks.{N}.attn2.to_k",
        "joint_blocks.{N}.x_block.attn2.qkv",
        Part::Qkv(1),
    ),
    (
        "transformer_blocks.{N}.attn2.to_v",
        "joint_blocks.{N}.x_block.attn2.qkv",
        Part::Qkv(2),
    ),
    (
        "transformer_blocks.{N}.attn2.to_out.0",
        "joint_blocks.{N}.x_block.attn2.proj",
        Part::Whole,
    ),
    (
        "transformer_blocks.{N}.ff.net.0.proj",
        "joint_blocks.{N}.x_block.mlp.fc1",
        Part::Whole,
    ),
    (
        "transformer_blocks.{N}.ff.net.2",
        "joint_blocks.{N}.x_block.mlp.fc2",
        Part::Whole,
    ),
    (
        "transformer_blocks.{N}.ff_context.net.0.proj",
        "joint_blocks.{N}.context_block.mlp.fc1",
        Part::Whole,
    ),
    (
        "transformer_blocks.{N}.ff_context.net.2",
        "joint_blocks.{N}.context_block.mlp.fc2",
        Part::Whole,
    ),
    (
        "transformer_blocks.{N}.norm1.linear",
        "joint_blocks.{N}.x_block.adaLN_modulation.1",
        Part::Whole,
    ),
    (
        "transformer_blocks.{N}.norm1_context.linear",
        "joint_blocks.{N}.context_block.adaLN_modulation.1",
        Part::SwapHalvesIfPair,
    ),
    ("pos_embed.proj", "x_embedder.proj", Part::Whole),
    ("context_embedder", "context_embedder", Part::Whole),
    (
        "time_text_embed.timestep_embedder.linear_1",
        "t_embedder.mlp.0",
        Part::Whole,
    ),
    (
        "time_text_embed.timestep_embedder.linear_2",
        "t_embedder.mlp.2",
        Part::Whole,
    ),
    (
        "time_text_embed.text_embedder.linear_1",
        "y_embedder.mlp.0",
        Part::Whole,
    ),
    (
        "time_text_embed.text_embedder.linear_2",
        "y_embedder.mlp.2",
        Part::Whole,
    ),
    (
        "norm_out.linear",
        "final_layer.adaLN_modulation.1",
        Part::SwapHalves,
    ),
    ("proj_out", "final_layer.linear", Part::Whole),
];

/// diffusers module → native module and part, for AuraFlow (fal's native names: `double_layers`,
/// `single_layers`, numbered from 0 each, where diffusers numbers `joint_transformer_blocks` and
/// `single_transformer_blocks`). Nothing is fused; the final modulation swaps its halves.
const AURAFLOW: &[(&str, &str, Part)] = &[
    (
        "joint_transformer_blocks.{N}.attn.to_q",
        "double_layers.{N}.attn.w2q",
        Part::Whole,
    ),
    (
        "joint_transformer_blocks.{N}.attn.to_k",
        "double_layers.{N}.attn.w2k",
        Part::Whole,
    ),
    (
        "joint_transformer_blocks.{N}.attn.to_v",
        "double_layers.{N}.attn.w2v",
        Part::Whole,
    ),
    (
        "joint_transformer_blocks.{N}.attn.to_out.0",
        "double_layers.{N}.attn.w2o",
        Part::Whole,
    ),
    (
        "joint_transformer_blocks.{N}.attn.add_q_proj",
        "double_layers.{N}.attn.w1q",
        Part::Whole,
    ),
    (
        "joint_transformer_blocks.{N}.attn.add_k_proj",
        "double_layers.{N}.attn.w1k",
        Part::Whole,
    ),
    (
        "joint_transformer_blocks.{N}.attn.add_v_proj",
        "double_layers.{N}.attn.w1v",
        Part::Whole,
    ),
    (
        "joint_transformer_blocks.{N}.attn.to_add_out",
        "double_layers.{N}.attn.w1o",
        Part::Whole,
    ),
    (
        "joint_transformer_blocks.{N}.ff.linear_1",
        "double_layers.{N}.mlpX.c_fc1",
        Part::Whole,
    ),
    (
        "joint_transformer_blocks.{N}.ff.linear_2",
        "double_layers.{N}.mlpX.c_fc2",
        Part::Whole,
    ),
    (
        "joint_transformer_blocks.{N}.ff.out_projection",
        "double_layers.{N}.mlpX.c_proj",
        Part::Whole,
    ),
    (
        "joint_transformer_blocks.{N}.ff_context.linear_1",
        "double_layers.{N}.mlpC.c_fc1",
        Part::Whole,
    ),
    (
        "joint_transformer_blocks.{N}.ff_context.linear_2",
        "double_layers.{N}.mlpC.c_fc2",
        Part::Whole,
    ),
    (
        "joint_transformer_blocks.{N}.ff_context.out_projection",
        "double_layers.{N}.mlpC.c_proj",
        Part::Whole,
    ),
    (
        "joint_transformer_blocks.{N}.norm1.linear",
        "double_layers.{N}.modX.1",
        Part::Whole,
    ),
    (
        "joint_transformer_blocks.{N}.norm1_context.linear",
        "double_layers.{N}.modC.1",
        Part::Whole,
    ),
    (
        "single_transformer_blocks.{N}.attn.to_q",
        "single_layers.{N}.attn.w1q",
        Part::Whole,
    ),
    (
        "single_transformer_blocks.{N}.attn.to_k",
        "single_layers.{N}.attn.w1k",
        Part::Whole,
    ),
    (
        "single_transformer_blocks.{N}.attn.to_v",
        "single_layers.{N}.attn.w1v",
        Part::Whole,
    ),
    (
        "single_transformer_blocks.{N}.attn.to_out.0",
        "single_layers.{N}.attn.w1o",
        Part::Whole,
    ),
    (
        "single_transformer_blocks.{N}.norm1.linear",
        "single_layers.{N}.modCX.1",
        Part::Whole,
    ),
    (
        "single_transformer_blocks.{N}.ff.linear_1",
        "single_layers.{N}.mlp.c_fc1",
        Part::Whole,
    ),
    (
        "single_transformer_blocks.{N}.ff.linear_2",
        "single_layers.{N}.mlp.c_fc2",
        Part::Whole,
    ),
    (
        "single_transformer_blocks.{N}.ff.out_projection",
        "single_layers.{N}.mlp.c_proj",
        Part::Whole,
    ),
    ("context_embedder", "cond_seq_linear", Part::Whole),
    ("pos_embed.proj", "init_x_linear", Part::Whole),
    ("time_step_proj.linear_1", "t_embedder.mlp.0", Part::Whole),
    ("time_step_proj.linear_2", "t_embedder.mlp.2", Part::Whole),
    ("proj_out", "final_linear", Part::Whole),
    ("norm_out.linear", "modF.1", Part::SwapHalves),
];

/// diffusers module → native module, for Wan 2.1 / 2.2 (Alibaba's names: `self_attn.q`,
/// `cross_attn.k_img`, `ffn.0`, `head.head`; diffusers' `attn1.to_q`, `attn2.add_k_proj`,
/// `ffn.net.0.proj`, `proj_out`). Nothing is fused; LoRAs in the native names map directly.
const WAN: &[(&str, &str, Part)] = &[
    (
        "blocks.{N}.attn1.to_q",
        "blocks.{N}.self_attn.q",
        Part::Whole,
    ),
    (
        "blocks.{N}.attn1.to_k",
        "blocks.{N}.self_attn.k",
        Part::Whole,
    ),
    (
        "blocks.{N}.attn1.to_v",
        "blocks.{N}.self_attn.v",
        Part::Whole,
    ),
    (
        "blocks.{N}.attn1.to_out.0",
        "blocks.{N}.self_attn.o",
        Part::Whole,
    ),
    (
        "blocks.{N}.attn2.to_q",
        "blocks.{N}.cross_attn.q",
        Part::Whole,
    ),
    (
        "blocks.{N}.attn2.to_k",
        "blocks.{N}.cross_attn.k",
        Part::Whole,
    ),
    (
        "blocks.{N}.attn2.to_v",
        "blocks.{N}.cross_attn.v",
        Part::Whole,
    ),
    (
        "blocks.{N}.attn2.to_out.0",
        "blocks.{N}.cross_attn.o",
        Part::Whole,
    ),
    (
        "blocks.{N}.attn2.add_k_proj",
        "blocks.{N}.cross_attn.k_img",
        Part::Whole,
    ),
    (
        "blocks.{N}.attn2.add_v_proj",
        "blocks.{N}.cross_attn.v_img",
        Part::Whole,
    ),
    ("blocks.{N}.ffn.net.0.proj", "blocks.{N}.ffn.0", Part::Whole),
    ("blocks.{N}.ffn.net.2", "blocks.{N}.ffn.2", Part::Whole),
    (
        "condition_embedder.time_embedder.linear_1",
        "time_embedding.0",
        Part::Whole,
    ),
    (
        "condition_embedder.time_embedder.linear_2",
        "time_embedding.2",
        Part::Whole,
    ),
    (
        "condition_embedder.text_embedder.linear_1",
        "text_embedding.0",
        Part::Whole,
    ),
    (
        "condition_embedder.text_embedder.linear_2",
        "text_embedding.2",
        Part::Whole,
    ),
    (
        "condition_embedder.time_proj",
        "time_projection.1",
        Part::Whole,
    ),
    (
        "condition_embedder.image_embedder.ff.net.0.proj",
        "img_emb.proj.1",
        Part::Whole,
    ),
    (
        "condition_embedder.image_embedder.ff.net.2",
        "img_emb.proj.3",
        Part::Whole,
    ),
    ("proj_out", "head.head", Part::Whole),
];

/// diffusers (`attn.to_q`, `feed_forward.linear_1`) and ComfyUI's own (`attention.to_q`) names
/// → native modules, for Lumina 2 and Z-Image (Alpha-VLLM's / Tongyi's NextDiT: a fused
/// `attention.qkv` with grouped key/value heads, `attention.out`, `feed_forward.w1/w2/w3`, in the
/// main `layers` and the `noise_refiner` / `context_refiner` blocks).
const LUMINA2: &[(&str, &str, Part)] = &[
    (
        "layers.{N}.attention.to_q",
        "layers.{N}.attention.qkv",
        Part::GqaQkv(0),
    ),
    (
        "layers.{N}.attention.to_k",
        "layers.{N}.attention.qkv",
        Part::GqaQkv(1),
    ),
    (
        "layers.{N}.attention.to_v",
        "layers.{N}.attention.qkv",
        Part::GqaQkv(2),
    ),
    (
        "layers.{N}.attention.to_out.0",
        "layers.{N}.attention.out",
        Part::Whole,
    ),
    (
        "layers.{N}.attn.to_q",
        "layers.{N}.attention.qkv",
        Part::GqaQkv(0),
    ),
    (
        "layers.{N}.attn.to_k",
        "layers.{N}.attention.qkv",
        Part::GqaQkv(1),
    ),
    (
        "layers.{N}.attn.to_v",
        "layers.{N}.attention.qkv",
        Part::GqaQkv(2),
    ),
    (
        "layers.{N}.attn.to_out.0",
        "layers.{N}.attention.out",
        Part::Whole,
    ),
    (
        "layers.{N}.feed_forward.linear_1",
        "layers.{N}.feed_forward.w1",
        Part::Whole,
    ),
    (
        "layers.{N}.feed_forward.linear_2",
        "layers.{N}.feed_forward.w2",
        Part::Whole,
    ),
    (
        "layers.{N}.feed_forward.linear_3",
        "layers.{N}.feed_forward.w3",
        Part::Whole,
    ),
    (
        "noise_refiner.{N}.attention.to_q",
        "noise_refiner.{N}.attention.qkv",
        Part::GqaQkv(0),
    ),
    (
        "noise_refiner.{N}.attention.to_k",
        "noise_refiner.{N}.attention.qkv",
        Part::GqaQkv(1),
    ),
    (
        "noise_refiner.{N}.attention.to_v",
        "noise_refiner.{N}.attention.qkv",
        Part::GqaQkv(2),
    ),
    (
        "noise_refiner.{N}.attention.to_out.0",
        "noise_refiner.{N}.attention.out",
        Part::Whole,
    ),
    (
        "noise_refiner.{N}.attn.to_q",
        "noise_refiner.{N}.attention.qkv",
        Part::GqaQkv(0),
    ),
    (
        "noise_refiner.{N}.attn.to_k",
        "noise_refiner.{N}.attention.qkv",
        Part::GqaQkv(1),
    ),
    (
        "noise_refiner.{N}.attn.to_v",
        "noise_refiner.{N}.attention.qkv",
        Part::GqaQkv(2),
    ),
    (
        "noise_refiner.{N}.attn.to_out.0",
        "noise_refiner.{N}.attention.out",
        Part::Whole,
    ),
    (
        "noise_refiner.{N}.feed_forward.linear_1",
        "noise_refiner.{N}.feed_forward.w1",
        Part::Whole,
    ),
    (
        "noise_refiner.{N}.feed_forward.linear_2",
        "noise_refiner.{N}.feed_forward.w2",
        Part::Whole,
    ),
    (
        "noise_refiner.{N}.feed_forward.linear_3",
        "noise_refiner.{N}.feed_forward.w3",
        Part::Whole,
    ),
    (
        "context_refiner.{N}.attention.to_q",
        "context_refiner.{N}.attention.qkv",
        Part::GqaQkv(0),
    ),
    (
        "context_refiner.{N}.attention.to_k",
        "context_refiner.{N}.attention.qkv",
        Part::GqaQkv(1),
    ),
    (
        "context_refiner.{N}.attention.to_v",
        "context_refiner.{N}.attention.qkv",
        Part::GqaQkv(2),
    ),
    (
        "context_refiner.{N}.attention.to_out.0",
        "context_refiner.{N}.attention.out",
        Part::Whole,
    ),
    (
        "context_refiner.{N}.attn.to_q",
        "context_refiner.{N}.attention.qkv",
        Part::GqaQkv(0),
    ),
    (
        "context_refiner.{N}.attn.to_k",
        "context_refiner.{N}.attention.qkv",
        Part::GqaQkv(1),
    ),
    (
        "context_refiner.{N}.attn.to_v",
        "context_refiner.{N}.attention.qkv",
        Part::GqaQkv(2),
    ),
    (
        "context_refiner.{N}.attn.to_out.0",
        "context_refiner.{N}.attention.out",
        Part::Whole,
    ),
    (
        "context_refiner.{N}.feed_forward.linear_1",
        "context_refiner.{N}.feed_forward.w1",
        Part::Whole,
    ),
    (
        "context_refiner.{N}.feed_forward.linear_2",
        "context_refiner.{N}.feed_forward.w2",
        Part::Whole,
    ),
    (
        "context_refiner.{N}.feed_forward.linear_3",
        "context_refiner.{N}.feed_forward.w3",
        Part::Whole,
    ),
];

/// diffusers module → native module and part, for PixArt-α / Σ (the original `blocks.N` names
/// ComfyUI holds: a fused self-attention `attn.qkv`, a fused cross-attention `kv_linear`).
const PIXART: &[(&str, &str, Part)] = &[
    (
        "transformer_blocks.{N}.attn1.to_q",
        "blocks.{N}.attn.qkv",
        Part::Qkv(0),
    ),
    (
        "transformer_blocks.{N}.attn1.to_k",
        "blocks.{N}.attn.qkv",
        Part::Qkv(1),
    ),
    (
        "transformer_blocks.{N}.attn1.to_v",
        "blocks.{N}.attn.qkv",
        Part::Qkv(2),
    ),
    (
        "transformer_blocks.{N}.attn1.to_out.0",
        "blocks.{N}.attn.proj",
        Part::Whole,
    ),
    (
        "transformer_blocks.{N}.attn2.to_q",
        "blocks.{N}.cross_attn.q_linear",
        Part::Whole,
    ),
    (
        "transformer_blocks.{N}.attn2.to_k",
        "blocks.{N}.cross_attn.kv_linear",
        Part::Kv(0),
    ),
    (
        "transformer_blocks.{N}.attn2.to_v",
        "blocks.{N}.cross_attn.kv_linear",
        Part::Kv(1),
    ),
    (
        "transformer_blocks.{N}.attn2.to_out.0",
        "blocks.{N}.cross_attn.proj",
        Part::Whole,
    ),
    (
        "transformer_blocks.{N}.ff.net.0.proj",
        "blocks.{N}.mlp.fc1",
        Part::Whole,
    ),
    (
        "transformer_blocks.{N}.ff.net.2",
        "blocks.{N}.mlp.fc2",
        Part::Whole,
    ),
    ("pos_embed.proj", "x_embedder.proj", Part::Whole),
    (
        "adaln_single.emb.timestep_embedder.linear_1",
        "t_embedder.mlp.0",
        Part::Whole,
    ),
    (
        "adaln_single.emb.timestep_embedder.linear_2",
        "t_embedder.mlp.2",
        Part::Whole,
    ),
    ("adaln_single.linear", "t_block.1", Part::Whole),
    (
        "caption_projection.linear_1",
        "y_embedder.y_proj.fc1",
        Part::Whole,
    ),
    (
        "caption_projection.linear_2",
        "y_embedder.y_proj.fc2",
        Part::Whole,
    ),
    ("proj_out", "final_layer.linear", Part::Whole),
];

/// A DiT family whose native checkpoint names differ from diffusers': the key that identifies
/// it, its name table, and the module whose rows are the hidden size.
struct Family {
    name: &'static str,
    detect: &'static str,
    table: &'static [(&'static str, &'static str, Part)],
    hidden: &'static str,
}

const FAMILIES: &[Family] = &[
    Family {
        name: "flux",
        detect: "double_blocks.0.img_attn.qkv.weight",
        table: FLUX,
        hidden: "img_in",
    },
    Family {
        name: "sd3",
        detect: "joint_blocks.0.x_block.attn.qkv.weight",
        table: SD3,
        hidden: "x_embedder.proj",
    },
    Family {
        name: "auraflow",
        detect: "double_layers.0.attn.w2q.weight",
        table: AURAFLOW,
        hidden: "init_x_linear",
    },
    Family {
        name: "lumina2",
        detect: "layers.0.attention.qkv.weight",
        table: LUMINA2,
        hidden: "x_embedder",
    },
    Family {
        name: "pixart",
        detect: "blocks.0.cross_attn.kv_linear.weight",
        table: PIXART,
        hidden: "x_embedder.proj",
    },
    Family {
        name: "wan",
        detect: "blocks.0.cross_attn.q.weight",
        table: WAN,
        hidden: "time_embedding.0",
    },
];

/// Prefixes trainers put before the diffusers module path: `(prefix, underscored)`.
const LORA_PREFIXES: &[(&str, bool)] = &[
    ("base_model.model.transformer.", false),
    // PixArt's old reference PEFT script.
    ("unet.base_model.model.", false),
    ("base_model.model.", false),
    ("transformer.", false),
    ("diffusion_model.", false),
    ("lora_transformer_", true),
    ("lycoris_", true),
];

/// A model of a DiT family (its native keys), and its key prefix (`""`,
/// `model.diffusion_model.`, ...).
pub(super) struct Dit {
    family: &'static Family,
    prefix: String,
}

impl Dit {
    /// The DiT family of `keys`, if they are one's native keys.
    pub(super) fn detect<'a>(keys: impl IntoIterator<Item = &'a str>) -> Option<Dit> {
        keys.into_iter().find_map(|k| {
            FAMILIES.iter().find_map(|family| {
                k.strip_suffix(family.detect).map(|p| Dit {
                    family,
                    prefix: p.to_string(),
                })
            })
        })
    }

    /// The family's name (`flux`, `sd3`, `auraflow`, `lumina2`, `pixart`, `wan`).
    pub(super) fn name(&self) -> &'static str {
        self.family.name
    }

    /// The native module the LoRA base `base` patches, when `base` is a diffusers Flux name.
    pub(super) fn target(&self, base: &str) -> Option<Target> {
        for &(prefix, underscored) in LORA_PREFIXES {
            let Some(rest) = base.strip_prefix(prefix) else {
                continue;
            };
            if let Some(t) = map(self.family.table, rest, underscored) {
                return Some(t);
            }
        }
        // No trainer prefix: a bare diffusers path.
        map(self.family.table, base, false)
    }

    /// The model key of `module`'s `suffix` (`.weight`, `.bias`).
    pub(super) fn key(&self, module: &str, suffix: &str) -> String {
        format!("{}{module}{suffix}", self.prefix)
    }

    /// The patch key for `target` on the weight `key` of rows `rows` (the model's shape, when
    /// known), and the patch, its halves swapped where the layouts differ. `None` when the part
    /// cannot be placed: say why.
    pub(super) fn place(
        &self,
        target: &Target,
        key: String,
        shapes: &HashMap<String, Vec<usize>>,
        patch: Patch,
    ) -> Result<(PatchKey, Patch), String> {
        let rows = shapes.get(&key).and_then(|s| s.first().copied());
        let hidden = self.hidden(shapes);
        // The module's own `(out, in)`, for what the model's shapes would otherwise say.
        let own = module_shape(&patch);
        let own_rows = own.map(|(out, _)| out);
        let region = |start: usize, len: usize| -> Result<PatchKey, String> {
            if let Some(r) = rows {
                if start + len > r {
                    return Err(format!(
                        "rows {start}..{} outside `{key}` ({r} rows)",
                        start + len
                    ));
                }
            }
            Ok((key.clone(), Offset { dim: 0, start, len }).into())
        };
        let part = match target.part {
            // Two chunks of the hidden size: the model's, or the module's own (its input is the
            // hidden size).
            Part::SwapHalvesIfPair => match rows.zip(hidden).or(own) {
                Some((r, h)) if r == 2 * h => Part::SwapHalves,
                Some(_) => Part::Whole,
                None => {
                    return Err(format!("whether this modulation's halves swap depends on its size, which a {} does not give: load with lora_file::load_for", patch.kind()))
                }
            },
            other => other,
        };
        match part {
            Part::Whole => Ok((key.into(), patch)),
            Part::Qkv(i) => {
                // Double blocks: rows / 3; single blocks: the model's hidden size; without the
                // model's shapes, the LoRA's own output rows.
                let h = if target.module.ends_with(".qkv") {
                    rows.map(|r| r / 3)
                } else {
                    hidden
                }
                .or(own_rows)
                .ok_or("the fused weight's size is unknown: load with lora_file::load_for")?;
                Ok((region(i * h, h)?, patch))
            }
            Part::Kv(i) => {
                let h = rows
                    .map(|r| r / 2)
                    .or(own_rows)
                    .ok_or("the fused weight's size is unknown: load with lora_file::load_for")?;
                Ok((region(i * h, h)?, patch))
            }
            Part::GqaQkv(i) => {
                let out = target
                    .module
                    .strip_suffix(".qkv")
                    .map(|m| self.key(&format!("{m}.out"), ".weight"));
                let q = out.and_then(|k| shapes.get(&k)).and_then(|s| s.get(1).copied());
                let (Some(q), Some(r)) = (q, rows) else {
                    return Err("q, k and v of a grouped-head qkv need the model's shapes: load with lora_file::load_for".into());
                };
                let kv = r.saturating_sub(q) / 2;
                let (start, len) = match i {
                    0 => (0, q),
                    1 => (q, kv),
                    _ => (q + kv, kv),
                };
                Ok((region(start, len)?, patch))
            }
            Part::SingleQkv => {
                // q, k and v of the hidden size each; without the model's shapes, the LoRA's
                // own output rows.
                let n = hidden.map(|h| 3 * h).or(own_rows).ok_or(
                    "the fused weight's size is unknown: load with lora_file::load_for",
                )?;
                Ok((region(0, n)?, patch))
            }
            Part::SingleMlp => {
                // After q, k and v of the hidden size each, to the end of `linear1`: the model's
                // sizes, or the module's own (its input is the hidden size, its rows the MLP's).
                let h = hidden.or(own.map(|(_, cols)| cols));
                let len = match (rows, h) {
                    (Some(r), Some(h)) => Some(r.saturating_sub(3 * h)),
                    _ => own_rows,
                };
                let (Some(h), Some(len)) = (h, len) else {
                    return Err(format!("the MLP rows of `linear1` depend on its size, which a {} does not give: load with lora_file::load_for", patch.kind()));
                };
                Ok((region(3 * h, len)?, patch))
            }
            Part::SwapHalvesIfPair => unreachable!("resolved above"),
            Part::SwapHalves => match patch {
                Patch::Lora(l) if l.dora_scale.is_some() => {
                    Err("a DoRA on the modulation would need its magnitude's halves swapped too; not supported".into())
                }
                Patch::Lora(mut l) => {
                    let n = l.up.dim(0).map_err(|e| e.to_string())?;
                    if n % 2 != 0 {
                        return Err(format!("{n} output rows cannot be split in halves"));
                    }
                    let half = n / 2;
                    let swapped = candle_core::Tensor::cat(
                        &[
                            l.up.narrow(0, half, half).map_err(|e| e.to_string())?,
                            l.up.narrow(0, 0, half).map_err(|e| e.to_string())?,
                        ],
                        0,
                    )
                    .map_err(|e| e.to_string())?;
                    l.up = swapped;
                    Ok((key.into(), Patch::Lora(l)))
                }
                other => Err(format!(
                    "a {} on the modulation needs its halves swapped, which only LoRA supports",
                    other.kind()
                )),
            },
        }
    }

    /// The hidden size: the rows of the family's input projection.
    fn hidden(&self, shapes: &HashMap<String, Vec<usize>>) -> Option<usize> {
        shapes
            .get(&self.key(self.family.hidden, ".weight"))
            .and_then(|s| s.first().copied())
    }
}

/// A diffusers module path (dotted or underscored) → its native target in `table`.
fn map(table: &[(&str, &str, Part)], path: &str, underscored: bool) -> Option<Target> {
    table.iter().find_map(|&(from, to, part)| {
        let n = match_template(from, path, underscored)?;
        let module = match n {
            Some(n) => to.replace("{N}", &n.to_string()),
            None => to.to_string(),
        };
        Some(Target { module, part })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn diffusers_and_onetrainer_names_map_to_native_modules() {
        let f = Dit {
            family: &FAMILIES[0],
            prefix: String::new(),
        };
        let t = f
            .target("transformer.transformer_blocks.3.attn.to_k")
            .unwrap();
        assert_eq!(
            t,
            Target {
                module: "double_blocks.3.img_attn.qkv".into(),
                part: Part::Qkv(1)
            }
        );
        let t = f
            .target("lora_transformer_single_transformer_blocks_11_proj_mlp")
            .unwrap();
        assert_eq!(t.module, "single_blocks.11.linear1");
        assert_eq!(t.part, Part::SingleMlp);
        assert_eq!(
            f.target("base_model.model.norm_out.linear").unwrap().part,
            Part::SwapHalves
        );
        assert!(f
            .target("transformer.transformer_blocks.x.attn.to_q")
            .is_none());
        assert!(f.target("lora_unet_down_blocks_0").is_none());
    }
}
