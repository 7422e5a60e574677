//! PixArt-α / Σ: a fused self-attention `attn.qkv` and a fused cross-attention `kv_linear`.

use super::{Family, Part};

/// PixArt, known by its first block's fused `cross_attn.kv_linear`; the hidden size is
/// `x_embedder.proj`'s rows.
pub(super) const FAMILY: Family = Family {
    name: "pixart",
    detect: "blocks.0.cross_attn.kv_linear.weight",
    table: TABLE,
    hidden: "x_embedder.proj",
};

/// diffusers module → native module and part, for PixArt-α / Σ (the original `blocks.N` names
/// ComfyUI holds: a fused self-attention `attn.qkv`, a fused cross-attention `kv_linear`).
const TABLE: &[(&str, &str, Part)] = &[
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
