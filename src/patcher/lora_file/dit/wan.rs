//! Wan 2.1 / 2.2: Alibaba's `blocks.N.self_attn` / `cross_attn` names, nothing fused.

use super::{Family, Part};

/// Wan, known by its first block's `cross_attn.q`; the hidden size is `time_embedding.0`'s rows.
pub(super) const FAMILY: Family = Family {
    name: "wan",
    detect: "blocks.0.cross_attn.q.weight",
    table: TABLE,
    hidden: "time_embedding.0",
};

/// diffusers module → native module, for Wan 2.1 / 2.2 (Alibaba's names: `self_attn.q`,
/// `cross_attn.k_img`, `ffn.0`, `head.head`; diffusers' `attn1.to_q`, `attn2.add_k_proj`,
/// `ffn.net.0.proj`, `proj_out`). Nothing is fused; LoRAs in the native names map directly.
const TABLE: &[(&str, &str, Part)] = &[
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
