//! Reading LoRA-style files and mapping their tensor names onto a model's weight keys.
//!
//! [`load`] takes a safetensors file (or tensors already in memory) and the model's weight keys,
//! and returns one [`Patch`] per matched model weight plus a report of every file tensor it could
//! not use. It does not check shapes against the model (it only sees key names): the patcher
//! validates each patch against its weight when the patches are added.
//!
//! # Grouping
//!
//! File tensors are grouped by base name, the name with one of these suffixes removed:
//!
//! | suffix | part |
//! |---|---|
//! | `.lora_up.weight`, `.lora_B.weight`, `.lora_B.default.weight` (PEFT with its adapter name), `.lora.up.weight`, `_lora.up.weight`, `.lora_linear_layer.up.weight` | LoRA up |
//! | `.lora_down.weight`, `.lora_A.weight`, `.lora_A.default.weight`, `.lora.down.weight`, `_lora.down.weight`, `.lora_linear_layer.down.weight` | LoRA down |
//! | `.lora_mid.weight` | LoRA Tucker core |
//! | `.alpha`, `.dora_scale` | alpha (a scalar), DoRA magnitude (any adapter); a PEFT file without `.alpha` tensors takes `lora_alpha` (with `alpha_pattern` and `use_rslora`) from the `adapter_config.json` beside it, so its scale is PEFT's `lora_alpha / r` |
//! | `.hada_w1_a`, `.hada_w1_b`, `.hada_w2_a`, `.hada_w2_b`, `.hada_t1`, `.hada_t2` | LoHa |
//! | `.lokr_w1`, `.lokr_w1_a`, `.lokr_w1_b`, `.lokr_w2`, `.lokr_w2_a`, `.lokr_w2_b`, `.lokr_t2` | LoKr |
//! | `.a1.weight`, `.a2.weight`, `.b1.weight`, `.b2.weight` | GLoRA (`.bm.weight`, a Tucker GLoRA, is recognised and refused) |
//! | `.oft_blocks`, `.rescale` | OFT blocks (3-D, diag-OFT) or BOFT's butterfly factors (4-D, with an optional `.rescale`); `.alpha` is then the norm constraint (a `.rescale` beside 3-D blocks is recognised and refused) |
//! | `.diff`, `.diff_b` | full difference of the weight, of the bias |
//!
//! A group becomes a [`Patch::Lora`] (up and down present), [`Patch::LoHa`] (all four `hada_w*`),
//! [`Patch::LoKr`] (`w1` or `w1_a`+`w1_b`, and `w2` or `w2_a`+`w2_b`) or [`Patch::GLora`] (all
//! four of `a1`, `a2`, `b1`, `b2`, no `bm`) or [`Patch::Oft`] (3-D `oft_blocks`, no `rescale`, no
//! `dora_scale`) or [`Patch::Boft`] (4-D `oft_blocks`, an optional `rescale`, no `dora_scale`) on
//! `<module>.weight`,
//! or a [`Patch::Diff`] on `<module>.weight`; a `diff_b` gives a second [`Patch::Diff`] on
//! `<module>.bias`. A group that mixes kinds or lacks a part is malformed: its tensors are
//! reported as unmatched (and logged), the rest of the file still loads. Old diffusers
//! attention-processor names (`…attn1.processor.to_q_lora.up.weight`) are rewritten to the module
//! they patch (`…attn1.to_q`, and `to_out` to `to_out.0`).
//!
//! # Matching base names to model keys
//!
//! Tried in order; the first rule that finds a model key wins:
//!
//! 1. **Direct**: `base + ".weight"` (or `".bias"`) is a model key, with any leading PEFT
//!    `base_model.model.` dropped from `base`.
//! 2. **Prefix rewriting.** Both sides are split into a *component* and a *path*:
//!    - model keys: `model.diffusion_model.` and `diffusion_model.` are the diffusion model;
//!      `text_encoder.`, `cond_stage_model.`, `clip_l.` are text encoder 1; `text_encoder_2.`,
//!      `clip_g.` text encoder 2; `text_encoder_3.`, `t5xxl.` text encoder 3 (each optionally after
//!      `text_encoders.`); `conditioner.embedders.N.` is text encoder `N + 1`; anything else is
//!      unprefixed;
//!    - LoRA names: a leading PEFT `base_model.model.` is dropped; kohya `lora_unet_` and
//!      `lora_transformer_` name the diffusion model, `lora_te_` and `lora_te1_` text encoder 1,
//!      `lora_te2_` text encoder 2, `lora_te3_` text encoder 3, each followed by the module path
//!      with `.` written as `_`; diffusers `unet.`, `transformer.`, `diffusion_model.`,
//!      `model.diffusion_model.` name the diffusion model and `text_encoder.`, `text_encoder_2.`,
//!      `text_encoder_3.` the text encoders, followed by the dotted path; ComfyUI's generic
//!      `text_encoders.<module>`, for every weight of every text encoder, `module` being its key
//!      as ComfyUI holds it without `.weight`
//!      (`text_encoders.clip_g.transformer.text_model.embeddings.position_embedding`), names the
//!      text encoder of `module`'s own prefix (`clip_l.`, `clip_h.`, `clip_g.`, `t5xxl.`), or,
//!      under another encoder name, the model key `module` itself or the path after that name;
//!      anything else names no component.
//!
//!    For text encoders a leading `transformer.` and then `text_model.` are dropped from the path
//!    on both sides, so `lora_te_text_model_encoder_layers_0_mlp_fc1` finds both
//!    `text_encoder.encoder.layers.0.mlp.fc1.weight` and
//!    `cond_stage_model.transformer.text_model.encoder.layers.0.mlp.fc1.weight`. The LoRA path is
//!    then looked up among model paths of the same component (kohya names compared with every `.`
//!    of the model path written as `_`), then among unprefixed model keys; a LoRA name without a
//!    component may match any component. When several model keys fit equally, the first in the
//!    order given wins.
//! 3. **Stable Diffusion UNet naming.** The diffusion model's paths (or, when the model has no
//!    prefixed diffusion model, its unprefixed paths) are read as a UNet:
//!    [`UnetLayout::detect`](unet::UnetLayout::detect) finds whether they use ldm naming
//!    (`input_blocks.4.1.…`, original Stability and ComfyUI checkpoints) or diffusers naming
//!    (`down_blocks.1.attentions.0.…`), and the number of levels, residual blocks and transformer
//!    depths (SD1.x, SD2.x and SDXL among them). Each of those model paths is then also indexed
//!    under its name in the other naming
//!    ([`UnetLayout::module_pairs`](unet::UnetLayout::module_pairs)), dotted and with `_` for `.`,
//!    and a LoRA name of the diffusion model, or without a component, that rule 2 did not place is
//!    looked up there: a kohya `lora_unet_down_blocks_1_attentions_0_proj_in` or a PEFT
//!    `unet.down_blocks.1.attentions.0.proj_in` finds
//!    `model.diffusion_model.input_blocks.4.1.proj_in.weight`, and a kohya
//!    `lora_unet_input_blocks_1_1_proj_in` finds an SD1 diffusers model's
//!    `down_blocks.0.attentions.0.proj_in.weight`. A key set the detector does not understand
//!    (another architecture, a partial UNet) gets no second naming: matching is rules 1 and 2.
//!
//! Before these rules, a DiT family detected from the model's keys (Flux, SD3, AuraFlow, Lumina 2,
//! PixArt, Wan) maps its diffusers / PEFT / OneTrainer names onto its native, fused weights
//! (`dit/`, a file per family), q, k, v and a single block's MLP as offset patches on their rows.
//!
//! Not attempted: renaming between other model layouts (UNets whose transformer depth differs
//! between the blocks of one level); such names are reported unmatched. Callers that know the
//! layouts can rename keys and pass tensors in memory.
//!
//! # Reporting
//!
//! Every module no model key takes is in [`LoraLoad::unmatched_modules`] (with its tensors in
//! [`LoraLoad::unmatched_lora_keys`]), and the load logs one `tracing` warning naming all of them:
//! "no module of this LoRA matches a model key" when nothing matched, "LoRA partly matched" with
//! the matched count when some did; when every module matched but some tensors are no part of a
//! patch, the warning names those tensors.
//!
//! # Cost
//!
//! The file is read whole into CPU tensors (in their stored dtypes; the patch math upcasts).
//! Matching is O(file tensors + model keys) with hash lookups; the UNet layout is detected and
//! the second naming indexed once per [`load`], in O(model keys × path length).
//!
//! # Files
//!
//! `mod.rs` reads the tensors and assembles the result; `groups.rs` groups file tensors by base
//! name into patches (the suffix table above); `keys.rs` maps base names onto model keys (rules 1
//! and 2); [`unet`] holds the UNet layouts and their two namings (rule 3); `dit/` the DiT
//! families' name tables (a file per family) and `module_shape.rs` the module size a patch
//! gives, which places a fused part when the model's shapes are not known.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use candle_core::Tensor;

use crate::error::Result;
use crate::patcher::adapters::Patch;
use crate::patcher::PatchKey;

mod groups;
mod keys;
#[cfg(test)]
mod tests;
pub mod unet;

use groups::{check_alpha, group_by_base, group_patches, PartKind};

mod dit;
mod module_shape;
mod peft;
use keys::ModelIndex;

/// Where LoRA tensors come from.
#[derive(Debug, Clone)]
pub enum LoraSource {
    /// A safetensors file.
    File(PathBuf),
    /// Tensors already in memory, by their names in the LoRA's naming scheme.
    Tensors(HashMap<String, Tensor>),
}

impl From<PathBuf> for LoraSource {
    fn from(path: PathBuf) -> Self {
        LoraSource::File(path)
    }
}

impl From<&Path> for LoraSource {
    fn from(path: &Path) -> Self {
        LoraSource::File(path.to_path_buf())
    }
}

impl From<&PathBuf> for LoraSource {
    fn from(path: &PathBuf) -> Self {
        LoraSource::File(path.clone())
    }
}

impl From<&str> for LoraSource {
    /// A file path (`lora_file::load("style.safetensors", keys)`).
    fn from(path: &str) -> Self {
        LoraSource::File(PathBuf::from(path))
    }
}

impl From<String> for LoraSource {
    /// A file path.
    fn from(path: String) -> Self {
        LoraSource::File(PathBuf::from(path))
    }
}

impl From<HashMap<String, Tensor>> for LoraSource {
    fn from(tensors: HashMap<String, Tensor>) -> Self {
        LoraSource::Tensors(tensors)
    }
}

/// What [`load`] found.
#[derive(Debug, Clone, Default)]
pub struct LoraLoad {
    /// `(model key, patch)`, in the order of the model keys given (then by LoRA base name). A
    /// key may carry an offset: a LoRA for one projection of a fused weight (Flux's `to_q` on
    /// `double_blocks.N.img_attn.qkv`) patches its rows only.
    pub patches: Vec<(PatchKey, Patch)>,
    /// The distinct model keys that received a patch, in the order of the model keys given.
    pub matched_model_keys: Vec<String>,
    /// File tensor names that were not used (unknown suffix, no matching model key, malformed
    /// group, alpha or DoRA scale without an adapter), sorted.
    pub unmatched_lora_keys: Vec<String>,
    /// Each LoRA module (a group of tensors forming one patch) that found no model key: the
    /// family detected from the model's keys, why, and the nearest model key — said, never
    /// guessed.
    pub unmatched_modules: Vec<UnmatchedModule>,
}

/// A LoRA module no model key took ([`LoraLoad::unmatched_modules`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnmatchedModule {
    /// The module's name in the file (its tensors' common base).
    pub lora_module: String,
    /// The model family detected from the model's keys (`flux`, `sd3`, `sd-unet`, `unknown`).
    pub family: &'static str,
    /// Why it was not placed.
    pub reason: String,
    /// The model key sharing the longest tail of name parts with it, if any does.
    pub nearest_model_key: Option<String>,
}

/// The model key whose name parts (split at `.` and `_`) share the longest tail with
/// `lora_module`'s, then the most parts; `None` when none shares its last part.
fn nearest_key<'a>(keys: impl Iterator<Item = &'a str>, lora_module: &str) -> Option<String> {
    let parts = |s: &str| -> Vec<String> {
        s.split(['.', '_'])
            .filter(|p| !p.is_empty())
            .map(str::to_string)
            .collect()
    };
    let want = parts(lora_module);
    keys.filter_map(|k| {
        let module = k
            .strip_suffix(".weight")
            .or_else(|| k.strip_suffix(".bias"))
            .unwrap_or(k);
        let have = parts(module);
        let tail = want
            .iter()
            .rev()
            .zip(have.iter().rev())
            .take_while(|(a, b)| a == b)
            .count();
        let common = want.iter().filter(|p| have.contains(p)).count();
        (tail > 0).then(|| ((tail, common, std::cmp::Reverse(k.len())), k.to_string()))
    })
    .max_by(|a, b| a.0.cmp(&b.0))
    .map(|(_, k)| k)
}

/// Reads LoRA tensors from `source` and maps them onto `model_keys` (see the
/// [module docs](self) for the naming schemes and matching rules).
///
/// Errors: [`Error::File`](crate::Error::File) naming the file when it cannot be read or parsed;
/// [`Error::BadPatch`](crate::Error::BadPatch) naming the tensor when an `.alpha` is not one
/// finite number. Names that do not map are reported in [`LoraLoad::unmatched_lora_keys`] and
/// [`LoraLoad::unmatched_modules`] and logged (one warning naming every module left), not as
/// errors. Values inside the adapters (NaN, infinities) are checked when the patches are added
/// ([`crate::patcher::ModelPatcher::add_patches`]).
pub fn load<'a>(
    source: impl Into<LoraSource>,
    model_keys: impl IntoIterator<Item = &'a str>,
) -> Result<LoraLoad> {
    load_with_shapes(source, model_keys, HashMap::new())
}

/// [`load`] onto `model`, knowing its weights' shapes: a LoRA for one projection of a fused
/// weight finds its rows from the model's sizes (Flux's single blocks' `linear1`, whose MLP rows
/// follow q, k and v) rather than from the patch's own (what [`load`] reads them off, for the
/// kinds whose shape says it), and every offset is checked against the weight here.
///
/// # Errors
/// As [`load`].
pub fn load_for(source: impl Into<LoraSource>, model: &crate::weights::Model) -> Result<LoraLoad> {
    let shapes = model
        .slots()
        .iter()
        .map(|s| (s.name().to_string(), s.shape().to_vec()))
        .collect();
    load_with_shapes(source, model.keys(), shapes)
}

fn load_with_shapes<'a>(
    source: impl Into<LoraSource>,
    model_keys: impl IntoIterator<Item = &'a str>,
    shapes: HashMap<String, Vec<usize>>,
) -> Result<LoraLoad> {
    let (origin, tensors) = match source.into() {
        LoraSource::File(path) => {
            let mut tensors = read_lora_file(&path)?;
            // A PEFT LoRA keeps its scale in `adapter_config.json` beside the file.
            if let Some(scale) = peft::PeftScale::beside(&path)? {
                let added = scale.add_alphas(&mut tensors)?;
                tracing::debug!(file = %path.display(), added, "alphas from adapter_config.json");
            }
            (path.display().to_string(), tensors)
        }
        LoraSource::Tensors(t) => ("<memory>".to_string(), t),
    };
    let index = ModelIndex::new(model_keys);
    let result = build(&index, tensors, &shapes)?;
    tracing::debug!(
        source = %origin,
        patches = result.patches.len(),
        matched = result.matched_model_keys.len(),
        unmatched = result.unmatched_lora_keys.len(),
        "loaded LoRA"
    );
    warn_unmatched(&origin, &result);
    Ok(result)
}

/// One warning per load that left something unused, naming it: every module without a model key
/// (and the first one's nearest model key) — a file that matched nothing, or one that matched in
/// part, which would otherwise patch less than it was trained to with nothing said — or, when
/// every module found its key, the tensors that are no part of a patch (an unknown suffix, an
/// alpha without an adapter).
fn warn_unmatched(source: &str, load: &LoraLoad) {
    let unused_tensors = load.unmatched_lora_keys.len();
    let Some(first) = load.unmatched_modules.first() else {
        if unused_tensors > 0 {
            tracing::warn!(
                source,
                unused_tensors,
                tensors = %load.unmatched_lora_keys.join(", "),
                "LoRA tensors that are no part of a patch"
            );
        }
        return;
    };
    let names = load
        .unmatched_modules
        .iter()
        .map(|m| m.lora_module.as_str())
        .collect::<Vec<_>>()
        .join(", ");
    let (family, left) = (first.family, load.unmatched_modules.len());
    if load.patches.is_empty() {
        tracing::warn!(
            source,
            family,
            left,
            unused_tensors,
            modules = %names,
            nearest = ?first.nearest_model_key,
            "no module of this LoRA matches a model key"
        );
        crate::warnings::echo(&format!("lora-unmatched:{source}"), || {
            format!("no module of the LoRA {source} matches a model key ({left} modules: {names})")
        });
    } else {
        tracing::warn!(
            source,
            family,
            matched = load.matched_model_keys.len(),
            left,
            unused_tensors,
            modules = %names,
            nearest = ?first.nearest_model_key,
            "LoRA partly matched: these modules patch nothing"
        );
        crate::warnings::echo(&format!("lora-partly:{source}"), || {
            format!("the LoRA {source} matched in part: {left} modules patch nothing ({names})")
        });
    }
}

/// Every tensor of a LoRA file by name, read by the crate's own checked reader (a shape candle
/// cannot index is an error, not a panic): floats as stored (fp8 E5M2, which candle cannot type,
/// decoded to f32), integer tensors as read; tensors of other dtypes cannot be patch parts and
/// are skipped with a warning.
fn read_lora_file(path: &Path) -> Result<HashMap<String, Tensor>> {
    let file = crate::weights::read_file_tensors(path)?;
    let mut out = HashMap::with_capacity(file.floats.len() + file.integers.len());
    for (key, t, dtype) in file.floats {
        let t = if dtype == crate::float::Dtype::F8E5M2 {
            crate::float::to_f32(&t, dtype)?
        } else {
            t
        };
        out.insert(key, t);
    }
    out.extend(file.integers);
    for key in file.skipped {
        tracing::warn!(file = %path.display(), tensor = %key, "LoRA tensor of an unsupported dtype skipped");
    }
    Ok(out)
}

fn build(
    index: &ModelIndex,
    tensors: HashMap<String, Tensor>,
    shapes: &HashMap<String, Vec<usize>>,
) -> Result<LoraLoad> {
    let dit = dit::Dit::detect(index.keys());
    let family = match &dit {
        Some(d) => d.name(),
        None if index
            .keys()
            .any(|k| k.contains("input_blocks.") || k.contains("down_blocks.")) =>
        {
            "sd-unet"
        }
        None => "unknown",
    };
    let mut unplaced: Vec<(String, String)> = Vec::new();
    let (groups, mut unmatched) = group_by_base(tensors);
    let mut found: Vec<(usize, String, PatchKey, Patch)> = Vec::new();
    for group in groups.values() {
        check_alpha(group)?;
    }
    for (base, mut group) in groups {
        let all: Vec<(PartKind, String)> = group
            .parts
            .iter()
            .map(|(k, (n, _))| (*k, n.clone()))
            .collect();
        let (weight, bias) = match group_patches(&mut group) {
            Ok(p) => p,
            Err(reason) => {
                tracing::warn!(lora_key = %base, %reason, "skipping malformed LoRA group");
                unmatched.extend(all.into_iter().map(|(_, n)| n));
                continue;
            }
        };
        for (patch, suffix) in [(weight, ".weight"), (bias, ".bias")] {
            let Some(patch) = patch else { continue };
            // A DiT family's diffusers names, mapped onto its native (fused) weights.
            if let Some((dit, target)) = dit.as_ref().and_then(|f| Some((f, f.target(&base)?))) {
                let key = dit.key(&target.module, suffix);
                let placed = match index.position(&key) {
                    Some(pos) => dit.place(&target, key, shapes, patch).map(|p| (pos, p)),
                    None => Err(format!("the model has no `{key}`")),
                };
                match placed {
                    Ok((pos, (key, patch))) => {
                        found.push((pos, base.clone(), key, patch));
                        continue;
                    }
                    Err(reason) => {
                        tracing::warn!(lora_key = %base, family = dit.name(), %reason, "LoRA module not placed");
                        unmatched.extend(all.iter().map(|(_, n)| n.clone()));
                        unplaced.push((base.clone(), reason));
                        continue;
                    }
                }
            }
            match index.resolve(&base, suffix) {
                Some((pos, key)) => found.push((pos, base.clone(), key.into(), patch)),
                None => {
                    unplaced.push((base.clone(), format!("no model key for `{base}{suffix}`")));
                    // Report the tensors this patch was built from.
                    let for_bias = suffix == ".bias";
                    unmatched.extend(
                        all.iter()
                            .filter(|(k, _)| {
                                (*k == PartKind::DiffB) == for_bias && !group.parts.contains_key(k)
                            })
                            .map(|(_, n)| n.clone()),
                    );
                }
            }
        }
        unmatched.extend(group.names().cloned());
    }
    found.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
    let mut matched_model_keys: Vec<String> = Vec::new();
    let mut seen = HashSet::new();
    for (_, _, key, _) in &found {
        if seen.insert(key.key.clone()) {
            matched_model_keys.push(key.key.clone());
        }
    }
    unmatched.sort();
    unmatched.dedup();
    let unmatched_modules: Vec<UnmatchedModule> = unplaced
        .into_iter()
        .map(|(lora_module, reason)| UnmatchedModule {
            nearest_model_key: nearest_key(index.keys(), &lora_module),
            lora_module,
            family,
            reason,
        })
        .collect();
    Ok(LoraLoad {
        unmatched_modules,
        patches: found.into_iter().map(|(_, _, k, p)| (k, p)).collect(),
        matched_model_keys,
        unmatched_lora_keys: unmatched,
    })
}
