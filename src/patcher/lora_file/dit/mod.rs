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
//!
//! One file per family (`flux.rs`, `sd3.rs`, `auraflow.rs`, `lumina2.rs`, `pixart.rs`, `wan.rs`)
//! holds its name table and the key that detects it; this module holds what they share: the
//! parts a name may patch, detection, name matching and placement on the fused rows. A new
//! family is a new file and a line in `FAMILIES`.

use std::collections::HashMap;

use super::module_shape::module_shape;
use crate::patcher::adapters::{Offset, Patch};
use crate::patcher::PatchKey;

mod auraflow;
mod flux;
mod lumina2;
mod pixart;
mod sd3;
mod wan;

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

/// A DiT family whose native checkpoint names differ from diffusers': the key that identifies
/// it, its name table, and the module whose rows are the hidden size.
struct Family {
    name: &'static str,
    detect: &'static str,
    table: &'static [(&'static str, &'static str, Part)],
    hidden: &'static str,
}

/// The families, in the order detection tries them.
const FAMILIES: &[Family] = &[
    flux::FAMILY,
    sd3::FAMILY,
    auraflow::FAMILY,
    lumina2::FAMILY,
    pixart::FAMILY,
    wan::FAMILY,
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
                let q = out
                    .and_then(|k| shapes.get(&k))
                    .and_then(|s| s.get(1).copied());
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
                let n = hidden
                    .map(|h| 3 * h)
                    .or(own_rows)
                    .ok_or("the fused weight's size is unknown: load with lora_file::load_for")?;
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
            Part::SwapHalves => Ok((key.into(), swap_halves(patch)?)),
        }
    }

    /// The hidden size: the rows of the family's input projection.
    fn hidden(&self, shapes: &HashMap<String, Vec<usize>>) -> Option<usize> {
        shapes
            .get(&self.key(self.family.hidden, ".weight"))
            .and_then(|s| s.first().copied())
    }
}

/// `patch` with its output halves swapped (`(scale, shift)` → `(shift, scale)`: the rows of a
/// LoRA's up matrix); a DoRA or another kind is refused, saying why.
fn swap_halves(patch: Patch) -> Result<Patch, String> {
    match patch {
        Patch::Lora(l) if l.dora_scale.is_some() => Err(
            "a DoRA on the modulation would need its magnitude's halves swapped too; not supported"
                .into(),
        ),
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
            Ok(Patch::Lora(l))
        }
        other => Err(format!(
            "a {} on the modulation needs its halves swapped, which only LoRA supports",
            other.kind()
        )),
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
