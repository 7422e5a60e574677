//! AuraFlow: fal's `double_layers` and `single_layers`, nothing fused.

use super::{Family, Part};

/// AuraFlow, known by its first double layer's `attn.w2q`; the hidden size is `init_x_linear`'s
/// rows.
pub(super) const FAMILY: Family = Family {
    name: "auraflow",
    detect: "double_layers.0.attn.w2q.weight",
    table: TABLE,
    hidden: "init_x_linear",
};

/// diffusers module → native module and part, for AuraFlow (fal's native names: `double_layers`,
/// `single_layers`, numbered from 0 each, where diffusers numbers `joint_transformer_blocks` and
/// `single_transformer_blocks`). Nothing is fused; the final modulation swaps its halves.
const TABLE: &[(&str, &str, Part)] = &[
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
