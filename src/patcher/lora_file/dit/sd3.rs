//! SD3 / SD3.5: Stability's `joint_blocks`, q, k and v fused in each `x_block` and
//! `context_block` attention; the last context block's modulation swaps its halves.

use super::{Family, Part};

/// SD3, known by its first joint block's fused `x_block.attn.qkv`; the hidden size is
/// `x_embedder.proj`'s rows.
pub(super) const FAMILY: Family = Family {
    name: "sd3",
    detect: "joint_blocks.0.x_block.attn.qkv.weight",
    table: TABLE,
    hidden: "x_embedder.proj",
};

/// diffusers module → native module and part, for SD3 / SD3.5 (Stability's `joint_blocks`).
const TABLE: &[(&str, &str, Part)] = &[
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
