//! Flux (and Chroma): BFL's `double_blocks` and `single_blocks`, q, k and v fused in a double
//! block's `img_attn.qkv` / `txt_attn.qkv` and, with the MLP input, in a single block's
//! `linear1`; XLabs' `processor.qkv_lora*` names and ComfyUI's own `linear1_qkv` beside
//! diffusers'.

use super::{Family, Part};

/// Flux, known by its first double block's fused `img_attn.qkv`; the hidden size is `img_in`'s
/// rows.
pub(super) const FAMILY: Family = Family {
    name: "flux",
    detect: "double_blocks.0.img_attn.qkv.weight",
    table: TABLE,
    hidden: "img_in",
};

/// diffusers module → native module and part, for Flux.
const TABLE: &[(&str, &str, Part)] = &[
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
