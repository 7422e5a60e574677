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
//! | `.lora_up.weight`, `.lora_B.weight`, `.lora.up.weight`, `_lora.up.weight`, `.lora_linear_layer.up.weight` | LoRA up |
//! | `.lora_down.weight`, `.lora_A.weight`, `.lora.down.weight`, `_lora.down.weight`, `.lora_linear_layer.down.weight` | LoRA down |
//! | `.lora_mid.weight` | LoRA Tucker core |
//! | `.alpha`, `.dora_scale` | alpha (a scalar), DoRA magnitude (any adapter) |
//! | `.hada_w1_a`, `.hada_w1_b`, `.hada_w2_a`, `.hada_w2_b`, `.hada_t1`, `.hada_t2` | LoHa |
//! | `.lokr_w1`, `.lokr_w1_a`, `.lokr_w1_b`, `.lokr_w2`, `.lokr_w2_a`, `.lokr_w2_b`, `.lokr_t2` | LoKr |
//! | `.a1.weight`, `.a2.weight`, `.b1.weight`, `.b2.weight` | GLoRA (`.bm.weight`, a Tucker GLoRA, is recognised and refused) |
//! | `.oft_blocks`, `.rescale` | OFT blocks; `.alpha` is then its norm constraint (`.rescale` and 4-D BOFT blocks are recognised and refused) |
//! | `.diff`, `.diff_b` | full difference of the weight, of the bias |
//!
//! A group becomes a [`Patch::Lora`] (up and down present), [`Patch::LoHa`] (all four `hada_w*`),
//! [`Patch::LoKr`] (`w1` or `w1_a`+`w1_b`, and `w2` or `w2_a`+`w2_b`) or [`Patch::GLora`] (all
//! four of `a1`, `a2`, `b1`, `b2`, no `bm`) or [`Patch::Oft`] (3-D `oft_blocks`, no `rescale`, no
//! `dora_scale`) on `<module>.weight`,
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
//!      `text_encoder_3.` the text encoders, followed by the dotted path; anything else names no
//!      component.
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
//!    [`UnetLayout::detect`] finds whether they use ldm naming (`input_blocks.4.1.…`, original
//!    Stability and ComfyUI checkpoints) or diffusers naming (`down_blocks.1.attentions.0.…`),
//!    and the number of levels, residual blocks and transformer depths (SD1.x, SD2.x and SDXL
//!    among them). Each of those model paths is then also indexed under its name in the other
//!    naming ([`UnetLayout::module_pairs`]), dotted and with `_` for `.`, and a LoRA name of the
//!    diffusion model, or without a component, that rule 2 did not place is looked up there: a
//!    kohya `lora_unet_down_blocks_1_attentions_0_proj_in` or a PEFT
//!    `unet.down_blocks.1.attentions.0.proj_in` finds
//!    `model.diffusion_model.input_blocks.4.1.proj_in.weight`, and a kohya
//!    `lora_unet_input_blocks_1_1_proj_in` finds an SD1 diffusers model's
//!    `down_blocks.0.attentions.0.proj_in.weight`. A key set the detector does not understand
//!    (another architecture, a partial UNet) gets no second naming: matching is rules 1 and 2.
//!
//! Not attempted: renaming between other model layouts (Flux `double_blocks` versus diffusers
//! `transformer_blocks`; UNets whose transformer depth differs between the blocks of one level)
//! and splitting fused projections; such names are reported unmatched. Callers that know the
//! layouts can rename keys and pass tensors in memory.
//!
//! # Cost
//!
//! The file is read whole into CPU tensors (in their stored dtypes; the patch math upcasts).
//! Matching is O(file tensors + model keys) with hash lookups; the UNet layout is detected and
//! the second naming indexed once per [`load`], in O(model keys × path length).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result};
use crate::patcher::adapters::{GLora, LoHa, LoKr, Lora, Oft, Patch};

pub mod unet;

use unet::{LayoutMap, UnetLayout};

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

impl From<HashMap<String, Tensor>> for LoraSource {
    fn from(tensors: HashMap<String, Tensor>) -> Self {
        LoraSource::Tensors(tensors)
    }
}

/// What [`load`] found.
#[derive(Debug, Clone, Default)]
pub struct LoraLoad {
    /// `(model key, patch)`, in the order of the model keys given (then by LoRA base name).
    pub patches: Vec<(String, Patch)>,
    /// The distinct model keys that received a patch, in the order of the model keys given.
    pub matched_model_keys: Vec<String>,
    /// File tensor names that were not used (unknown suffix, no matching model key, malformed
    /// group, alpha or DoRA scale without an adapter), sorted.
    pub unmatched_lora_keys: Vec<String>,
}

/// Reads LoRA tensors from `source` and maps them onto `model_keys` (see the
/// [module docs](self) for the naming schemes and matching rules).
///
/// Errors: [`Error::File`] naming the file when it cannot be read or parsed. Names that do not
/// map are reported in [`LoraLoad::unmatched_lora_keys`], not as errors.
pub fn load<'a>(
    source: impl Into<LoraSource>,
    model_keys: impl IntoIterator<Item = &'a str>,
) -> Result<LoraLoad> {
    let (origin, tensors) = match source.into() {
        LoraSource::File(path) => {
            let tensors =
                candle_core::safetensors::load(&path, &Device::Cpu).map_err(|e| Error::File {
                    path: path.clone(),
                    reason: format!("cannot read LoRA safetensors: {e}"),
                })?;
            (path.display().to_string(), tensors)
        }
        LoraSource::Tensors(t) => ("<memory>".to_string(), t),
    };
    let index = ModelIndex::new(model_keys);
    let result = build(&index, tensors);
    tracing::debug!(
        source = %origin,
        patches = result.patches.len(),
        matched = result.matched_model_keys.len(),
        unmatched = result.unmatched_lora_keys.len(),
        "loaded LoRA"
    );
    Ok(result)
}

// ---------------------------------------------------------------------------------------------
// Grouping.

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum PartKind {
    Up,
    Down,
    Mid,
    Alpha,
    DoraScale,
    HadaW1a,
    HadaW1b,
    HadaW2a,
    HadaW2b,
    HadaT1,
    HadaT2,
    LokrW1,
    LokrW1a,
    LokrW1b,
    LokrW2,
    LokrW2a,
    LokrW2b,
    LokrT2,
    GloraA1,
    GloraA2,
    GloraB1,
    GloraB2,
    GloraBm,
    OftBlocks,
    OftRescale,
    Diff,
    DiffB,
}

/// Suffixes, each with the part it names and whether it is the old diffusers processor form.
const SUFFIXES: &[(&str, PartKind, bool)] = &[
    (".lora_up.weight", PartKind::Up, false),
    (".lora_down.weight", PartKind::Down, false),
    (".lora_mid.weight", PartKind::Mid, false),
    (".lora_B.weight", PartKind::Up, false),
    (".lora_A.weight", PartKind::Down, false),
    (".lora.up.weight", PartKind::Up, false),
    (".lora.down.weight", PartKind::Down, false),
    ("_lora.up.weight", PartKind::Up, true),
    ("_lora.down.weight", PartKind::Down, true),
    (".lora_linear_layer.up.weight", PartKind::Up, false),
    (".lora_linear_layer.down.weight", PartKind::Down, false),
    (".alpha", PartKind::Alpha, false),
    (".dora_scale", PartKind::DoraScale, false),
    (".hada_w1_a", PartKind::HadaW1a, false),
    (".hada_w1_b", PartKind::HadaW1b, false),
    (".hada_w2_a", PartKind::HadaW2a, false),
    (".hada_w2_b", PartKind::HadaW2b, false),
    (".hada_t1", PartKind::HadaT1, false),
    (".hada_t2", PartKind::HadaT2, false),
    (".lokr_w1", PartKind::LokrW1, false),
    (".lokr_w1_a", PartKind::LokrW1a, false),
    (".lokr_w1_b", PartKind::LokrW1b, false),
    (".lokr_w2", PartKind::LokrW2, false),
    (".lokr_w2_a", PartKind::LokrW2a, false),
    (".lokr_w2_b", PartKind::LokrW2b, false),
    (".lokr_t2", PartKind::LokrT2, false),
    (".a1.weight", PartKind::GloraA1, false),
    (".a2.weight", PartKind::GloraA2, false),
    (".b1.weight", PartKind::GloraB1, false),
    (".b2.weight", PartKind::GloraB2, false),
    (".bm.weight", PartKind::GloraBm, false),
    (".oft_blocks", PartKind::OftBlocks, false),
    (".rescale", PartKind::OftRescale, false),
    (".diff", PartKind::Diff, false),
    (".diff_b", PartKind::DiffB, false),
];

/// Splits a file tensor name into its base name and part.
fn split_part(name: &str) -> Option<(String, PartKind)> {
    SUFFIXES.iter().find_map(|&(suffix, kind, processor)| {
        let base = name.strip_suffix(suffix)?;
        if base.is_empty() {
            return None;
        }
        let base = if processor {
            let b = base.replace(".processor.", ".");
            if b.ends_with(".to_out") {
                format!("{b}.0")
            } else {
                b
            }
        } else {
            base.to_string()
        };
        Some((base, kind))
    })
}

#[derive(Default)]
struct Group {
    parts: BTreeMap<PartKind, (String, Tensor)>,
}

impl Group {
    fn take(&mut self, kind: PartKind) -> Option<Tensor> {
        self.parts.remove(&kind).map(|(_, t)| t)
    }

    fn has(&self, kinds: &[PartKind]) -> bool {
        kinds.iter().any(|k| self.parts.contains_key(k))
    }

    fn names(&self) -> impl Iterator<Item = &String> {
        self.parts.values().map(|(n, _)| n)
    }
}

const LORA_PARTS: &[PartKind] = &[PartKind::Up, PartKind::Down, PartKind::Mid];
const LOHA_PARTS: &[PartKind] = &[
    PartKind::HadaW1a,
    PartKind::HadaW1b,
    PartKind::HadaW2a,
    PartKind::HadaW2b,
    PartKind::HadaT1,
    PartKind::HadaT2,
];
const LOKR_PARTS: &[PartKind] = &[
    PartKind::LokrW1,
    PartKind::LokrW1a,
    PartKind::LokrW1b,
    PartKind::LokrW2,
    PartKind::LokrW2a,
    PartKind::LokrW2b,
    PartKind::LokrT2,
];

const GLORA_PARTS: &[PartKind] = &[
    PartKind::GloraA1,
    PartKind::GloraA2,
    PartKind::GloraB1,
    PartKind::GloraB2,
    PartKind::GloraBm,
];

/// The patches a group yields: `(on the weight, on the bias)`; used parts are removed from the
/// group, so what remains is unused.
fn group_patches(group: &mut Group) -> std::result::Result<(Option<Patch>, Option<Patch>), String> {
    let kinds = [
        group.has(LORA_PARTS),
        group.has(LOHA_PARTS),
        group.has(LOKR_PARTS),
        group.has(&[PartKind::Diff]),
        group.has(GLORA_PARTS),
        group.has(&[PartKind::OftBlocks, PartKind::OftRescale]),
    ];
    if kinds.iter().filter(|&&k| k).count() > 1 {
        return Err("mixes several patch kinds".into());
    }
    let alpha = match group.parts.get(&PartKind::Alpha) {
        Some((_, t)) => Some(scalar(t)?),
        None => None,
    };
    let adapter = kinds[0] || kinds[1] || kinds[2] || kinds[4] || kinds[5];
    let weight = if kinds[0] {
        let (Some(up), Some(down)) = (group.take(PartKind::Up), group.take(PartKind::Down)) else {
            return Err("has only one of the LoRA up and down tensors".into());
        };
        Some(Patch::Lora(Lora {
            up,
            down,
            alpha,
            mid: group.take(PartKind::Mid),
            dora_scale: group.take(PartKind::DoraScale),
        }))
    } else if kinds[1] {
        let parts = [
            PartKind::HadaW1a,
            PartKind::HadaW1b,
            PartKind::HadaW2a,
            PartKind::HadaW2b,
        ];
        if !parts.iter().all(|k| group.parts.contains_key(k)) {
            return Err("lacks one of hada_w1_a, hada_w1_b, hada_w2_a, hada_w2_b".into());
        }
        let mut take = |k| group.take(k).expect("checked present");
        let (w1a, w1b, w2a, w2b) = (
            take(parts[0]),
            take(parts[1]),
            take(parts[2]),
            take(parts[3]),
        );
        Some(Patch::LoHa(LoHa {
            w1a,
            w1b,
            w2a,
            w2b,
            t1: group.take(PartKind::HadaT1),
            t2: group.take(PartKind::HadaT2),
            alpha,
            dora_scale: group.take(PartKind::DoraScale),
        }))
    } else if kinds[2] {
        let has = |k| group.parts.contains_key(&k);
        let w1_ok = has(PartKind::LokrW1) || (has(PartKind::LokrW1a) && has(PartKind::LokrW1b));
        let w2_ok = has(PartKind::LokrW2) || (has(PartKind::LokrW2a) && has(PartKind::LokrW2b));
        if !(w1_ok && w2_ok) {
            return Err("needs lokr_w1 (or lokr_w1_a and lokr_w1_b) and lokr_w2 (or lokr_w2_a and lokr_w2_b)".into());
        }
        Some(Patch::LoKr(LoKr {
            w1: group.take(PartKind::LokrW1),
            w1a: group.take(PartKind::LokrW1a),
            w1b: group.take(PartKind::LokrW1b),
            w2: group.take(PartKind::LokrW2),
            w2a: group.take(PartKind::LokrW2a),
            w2b: group.take(PartKind::LokrW2b),
            t2: group.take(PartKind::LokrT2),
            alpha,
            dora_scale: group.take(PartKind::DoraScale),
        }))
    } else if kinds[4] {
        if group.parts.contains_key(&PartKind::GloraBm) {
            return Err("is a Tucker GLoRA (bm), which is not supported".into());
        }
        let parts = [
            PartKind::GloraA1,
            PartKind::GloraA2,
            PartKind::GloraB1,
            PartKind::GloraB2,
        ];
        let mut take = |k| group.take(k);
        let (Some(a1), Some(a2), Some(b1), Some(b2)) = (
            take(parts[0]),
            take(parts[1]),
            take(parts[2]),
            take(parts[3]),
        ) else {
            return Err("lacks one of the GLoRA a1, a2, b1, b2 weights".into());
        };
        Some(Patch::GLora(GLora {
            a1,
            a2,
            b1,
            b2,
            alpha,
            dora_scale: group.take(PartKind::DoraScale),
        }))
    } else if kinds[5] {
        if group.parts.contains_key(&PartKind::OftRescale) {
            return Err("is a rescaled OFT (rescale), which is not supported".into());
        }
        if group.parts.contains_key(&PartKind::DoraScale) {
            return Err("is an OFT with a dora_scale, which is not supported".into());
        }
        let Some(blocks) = group.take(PartKind::OftBlocks) else {
            return Err("lacks oft_blocks".into());
        };
        match blocks.rank() {
            3 => {}
            4 => return Err("has 4-D oft_blocks (BOFT), which is not supported".into()),
            r => return Err(format!("has {r}-D oft_blocks; OFT blocks are [k, n, n]")),
        }
        Some(Patch::Oft(Oft { blocks, alpha }))
    } else {
        group
            .take(PartKind::Diff)
            .map(|diff| Patch::Diff { diff, pad: false })
    };
    if adapter {
        group.parts.remove(&PartKind::Alpha);
    }
    let bias = group
        .take(PartKind::DiffB)
        .map(|diff| Patch::Diff { diff, pad: false });
    Ok((weight, bias))
}

fn scalar(t: &Tensor) -> std::result::Result<f32, String> {
    t.to_dtype(DType::F32)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f32>())
        .map_err(|e| format!("alpha is unreadable: {e}"))?
        .first()
        .copied()
        .ok_or_else(|| "alpha is empty".to_string())
}

fn build(index: &ModelIndex, tensors: HashMap<String, Tensor>) -> LoraLoad {
    let mut unmatched: Vec<String> = Vec::new();
    let mut groups: BTreeMap<String, Group> = BTreeMap::new();
    for (name, tensor) in tensors {
        match split_part(&name) {
            Some((base, kind)) => {
                let group = groups.entry(base).or_default();
                if let Some((prev, _)) = group.parts.get(&kind) {
                    // Two names for the same part (e.g. both `.lora_up` and `.lora_B`): keep the
                    // first by name, report the other.
                    if *prev < name {
                        unmatched.push(name);
                        continue;
                    }
                    let (prev, _) = group.parts.remove(&kind).expect("present");
                    unmatched.push(prev);
                }
                group.parts.insert(kind, (name, tensor));
            }
            None => unmatched.push(name),
        }
    }

    // (model key position, base, model key, patch)
    let mut found: Vec<(usize, String, String, Patch)> = Vec::new();
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
            match index.resolve(&base, suffix) {
                Some((pos, key)) => found.push((pos, base.clone(), key, patch)),
                None => {
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
        if seen.insert(key.clone()) {
            matched_model_keys.push(key.clone());
        }
    }
    unmatched.sort();
    unmatched.dedup();
    LoraLoad {
        patches: found.into_iter().map(|(_, _, k, p)| (k, p)).collect(),
        matched_model_keys,
        unmatched_lora_keys: unmatched,
    }
}

// ---------------------------------------------------------------------------------------------
// Matching.

/// Which part of a pipeline a key belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Component {
    Diffusion,
    TextEncoder(usize),
    /// An unprefixed model key; `te_path` when its path was normalised as a text encoder's.
    Bare {
        te_path: bool,
    },
    /// A LoRA name without a component prefix.
    Any,
}

const MODEL_PREFIXES: &[(&str, Component)] = &[
    ("model.diffusion_model.", Component::Diffusion),
    ("diffusion_model.", Component::Diffusion),
    ("text_encoder_2.", Component::TextEncoder(2)),
    ("text_encoder_3.", Component::TextEncoder(3)),
    ("text_encoder.", Component::TextEncoder(1)),
    ("cond_stage_model.", Component::TextEncoder(1)),
    ("clip_l.", Component::TextEncoder(1)),
    ("clip_g.", Component::TextEncoder(2)),
    ("t5xxl.", Component::TextEncoder(3)),
];

/// `(prefix, component, kohya-style underscored path)`.
const LORA_PREFIXES: &[(&str, Component, bool)] = &[
    ("lora_unet_", Component::Diffusion, true),
    ("lora_transformer_", Component::Diffusion, true),
    ("lora_te1_", Component::TextEncoder(1), true),
    ("lora_te2_", Component::TextEncoder(2), true),
    ("lora_te3_", Component::TextEncoder(3), true),
    ("lora_te_", Component::TextEncoder(1), true),
    ("model.diffusion_model.", Component::Diffusion, false),
    ("diffusion_model.", Component::Diffusion, false),
    ("unet.", Component::Diffusion, false),
    ("transformer.", Component::Diffusion, false),
    ("text_encoder_2.", Component::TextEncoder(2), false),
    ("text_encoder_3.", Component::TextEncoder(3), false),
    ("text_encoder.", Component::TextEncoder(1), false),
];

fn split_model_prefix(module: &str) -> (Component, &str) {
    let m = module.strip_prefix("text_encoders.").unwrap_or(module);
    for &(prefix, comp) in MODEL_PREFIXES {
        if let Some(rest) = m.strip_prefix(prefix) {
            return (comp, rest);
        }
    }
    if let Some(rest) = module.strip_prefix("conditioner.embedders.") {
        if let Some((n, rest)) = rest.split_once('.') {
            if let Ok(n) = n.parse::<usize>() {
                return (Component::TextEncoder(n + 1), rest);
            }
        }
    }
    (Component::Bare { te_path: false }, module)
}

/// Drops a text encoder wrapper's `transformer.` and `text_model.` (in `sep` form).
fn te_path(path: &str, sep: char) -> &str {
    let mut p = path;
    for seg in ["transformer", "text_model"] {
        if let Some(rest) = p.strip_prefix(seg).and_then(|r| r.strip_prefix(sep)) {
            p = rest;
        }
    }
    p
}

/// Whether a LoRA name of component `want` may match a model key of component `have`, and how
/// well (lower is better).
fn rank(want: Component, have: Component) -> Option<u8> {
    use Component::*;
    match (want, have) {
        (Any, Bare { te_path: false }) => Some(0),
        (Any, Diffusion | TextEncoder(_)) => Some(1),
        (Diffusion, Diffusion) => Some(0),
        (Diffusion, Bare { te_path: false }) => Some(1),
        (TextEncoder(a), TextEncoder(b)) if a == b => Some(0),
        (TextEncoder(_), Bare { te_path: true }) => Some(1),
        (Any, Bare { te_path: true }) => Some(2),
        _ => None,
    }
}

struct ModelIndex {
    /// Every model key → its position in the order given.
    keys: HashMap<String, usize>,
    /// Model path (after its component prefix) → `(component, module)`, in model key order.
    dotted: HashMap<String, Vec<(Component, String)>>,
    /// The same, with every `.` of the path written as `_` (for kohya names).
    underscored: HashMap<String, Vec<(Component, String)>>,
    /// Diffusion-model paths renamed into the other UNet naming (empty when the layout is not
    /// understood) → `(component, module)`, dotted and underscored.
    renamed_dotted: HashMap<String, Vec<(Component, String)>>,
    renamed_underscored: HashMap<String, Vec<(Component, String)>>,
}

impl ModelIndex {
    fn new<'a>(model_keys: impl IntoIterator<Item = &'a str>) -> Self {
        let mut index = ModelIndex {
            keys: HashMap::new(),
            dotted: HashMap::new(),
            underscored: HashMap::new(),
            renamed_dotted: HashMap::new(),
            renamed_underscored: HashMap::new(),
        };
        let mut modules = HashSet::new();
        // `(component, module, path)` of the diffusion model's modules, and of unprefixed ones (a
        // UNet stored without a prefix), for layout detection.
        let mut diffusion: Vec<(Component, String, String)> = Vec::new();
        let mut bare: Vec<(Component, String, String)> = Vec::new();
        for (pos, key) in model_keys.into_iter().enumerate() {
            index.keys.entry(key.to_string()).or_insert(pos);
            let Some(module) = key
                .strip_suffix(".weight")
                .or_else(|| key.strip_suffix(".bias"))
            else {
                continue;
            };
            if !modules.insert(module.to_string()) {
                continue;
            }
            let (comp, path) = split_model_prefix(module);
            let mut add = |comp: Component, path: &str| {
                let entry = (comp, module.to_string());
                index
                    .underscored
                    .entry(path.replace('.', "_"))
                    .or_default()
                    .push(entry.clone());
                index
                    .dotted
                    .entry(path.to_string())
                    .or_default()
                    .push(entry);
            };
            match comp {
                Component::TextEncoder(_) => add(comp, te_path(path, '.')),
                Component::Bare { .. } => {
                    add(comp, path);
                    add(Component::Bare { te_path: true }, te_path(path, '.'));
                    bare.push((comp, module.to_string(), path.to_string()));
                }
                _ => {
                    add(comp, path);
                    diffusion.push((comp, module.to_string(), path.to_string()));
                }
            }
        }
        let unet = if diffusion.is_empty() {
            bare
        } else {
            diffusion
        };
        index.add_renamed(&unet);
        index
    }

    /// Indexes the UNet modules `unet` under their names in the other UNet naming, when their
    /// layout is understood (rule 3 of the module docs). O(modules × path length).
    fn add_renamed(&mut self, unet: &[(Component, String, String)]) {
        let Some((naming, layout)) = UnetLayout::detect(unet.iter().map(|(_, _, p)| p.as_str()))
        else {
            return;
        };
        tracing::debug!(
            ?naming,
            levels = layout.levels(),
            res_blocks = layout.num_res_blocks(),
            transformer_depth = ?layout.transformer_depth(),
            "LoRA matching: UNet layout detected, other naming indexed"
        );
        let map = LayoutMap::new(naming, &layout);
        for (comp, module, path) in unet {
            let Some(renamed) = map.rename(path) else {
                continue;
            };
            let entry = (*comp, module.clone());
            self.renamed_underscored
                .entry(renamed.replace('.', "_"))
                .or_default()
                .push(entry.clone());
            self.renamed_dotted.entry(renamed).or_default().push(entry);
        }
    }

    /// The model key (and its position) that the LoRA base `base` patches, for the key suffix
    /// `.weight` or `.bias`.
    fn resolve(&self, base: &str, suffix: &str) -> Option<(usize, String)> {
        let base = base.strip_prefix("base_model.model.").unwrap_or(base);
        let direct = format!("{base}{suffix}");
        if let Some(&pos) = self.keys.get(&direct) {
            return Some((pos, direct));
        }
        let (comp, path, underscored) = LORA_PREFIXES
            .iter()
            .find_map(|&(p, c, u)| base.strip_prefix(p).map(|rest| (c, rest, u)))
            .unwrap_or((Component::Any, base, false));
        let sep = if underscored { '_' } else { '.' };
        let (map, renamed) = if underscored {
            (&self.underscored, &self.renamed_underscored)
        } else {
            (&self.dotted, &self.renamed_dotted)
        };
        let mut paths = vec![path];
        if matches!(comp, Component::TextEncoder(_)) {
            paths = vec![te_path(path, sep)];
        } else if comp == Component::Any {
            paths.push(te_path(path, sep));
        }
        for p in paths {
            if let Some(found) = self.best(map, p, comp, suffix) {
                return Some(found);
            }
        }
        if matches!(comp, Component::Diffusion | Component::Any) {
            return self.best(renamed, path, comp, suffix);
        }
        None
    }

    /// The best-ranked model key among the modules `map` holds for `path` (first in model key
    /// order on a tie).
    fn best(
        &self,
        map: &HashMap<String, Vec<(Component, String)>>,
        path: &str,
        comp: Component,
        suffix: &str,
    ) -> Option<(usize, String)> {
        map.get(path)
            .into_iter()
            .flatten()
            .filter_map(|(have, module)| {
                let key = format!("{module}{suffix}");
                let pos = *self.keys.get(&key)?;
                let r = rank(comp, *have)?;
                Some((r, pos, key))
            })
            .min()
            .map(|(_, pos, key)| (pos, key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use unet::UnetNaming;

    const SDXL_KEYS: &[&str] = &[
        "diffusion_model.input_blocks.1.1.proj_in.weight",
        "diffusion_model.input_blocks.1.1.proj_in.bias",
        "diffusion_model.middle_block.1.transformer_blocks.0.attn1.to_q.weight",
        "diffusion_model.middle_block.1.transformer_blocks.0.attn1.to_out.0.weight",
        "conditioner.embedders.0.transformer.text_model.encoder.layers.0.mlp.fc1.weight",
        "conditioner.embedders.1.transformer.text_model.encoder.layers.0.mlp.fc1.weight",
    ];

    fn ones(shape: &[usize]) -> Tensor {
        Tensor::ones(shape, DType::F32, &Device::Cpu).unwrap()
    }

    fn lora_pair(map: &mut HashMap<String, Tensor>, base: &str, up: &str, down: &str) {
        map.insert(format!("{base}{up}"), ones(&[4, 2]));
        map.insert(format!("{base}{down}"), ones(&[2, 3]));
    }

    fn save(dir: &tempfile::TempDir, name: &str, tensors: &HashMap<String, Tensor>) -> PathBuf {
        let path = dir.path().join(name);
        candle_core::safetensors::save(tensors, &path).unwrap();
        path
    }

    fn keys_of(load: &LoraLoad) -> Vec<&str> {
        load.patches.iter().map(|(k, _)| k.as_str()).collect()
    }

    #[test]
    fn kohya_names_map_onto_prefixed_model_keys_and_unknown_ones_are_reported() {
        let mut t = HashMap::new();
        lora_pair(
            &mut t,
            "lora_unet_input_blocks_1_1_proj_in",
            ".lora_up.weight",
            ".lora_down.weight",
        );
        t.insert(
            "lora_unet_input_blocks_1_1_proj_in.alpha".into(),
            Tensor::new(1.0f32, &Device::Cpu).unwrap(),
        );
        lora_pair(
            &mut t,
            "lora_te1_text_model_encoder_layers_0_mlp_fc1",
            ".lora_up.weight",
            ".lora_down.weight",
        );
        lora_pair(
            &mut t,
            "lora_te2_text_model_encoder_layers_0_mlp_fc1",
            ".lora_up.weight",
            ".lora_down.weight",
        );
        lora_pair(
            &mut t,
            "lora_unet_output_blocks_9_9_nope",
            ".lora_up.weight",
            ".lora_down.weight",
        );
        t.insert(
            "lora_unet_input_blocks_1_1_proj_in.something_else".into(),
            ones(&[1]),
        );
        let dir = tempfile::tempdir().unwrap();
        let path = save(&dir, "kohya.safetensors", &t);

        let out = load(path.as_path(), SDXL_KEYS.iter().copied()).unwrap();
        assert_eq!(
            keys_of(&out),
            [
                "diffusion_model.input_blocks.1.1.proj_in.weight",
                "conditioner.embedders.0.transformer.text_model.encoder.layers.0.mlp.fc1.weight",
                "conditioner.embedders.1.transformer.text_model.encoder.layers.0.mlp.fc1.weight",
            ]
        );
        assert_eq!(out.matched_model_keys, keys_of(&out));
        match &out.patches[0].1 {
            Patch::Lora(l) => {
                assert_eq!(l.alpha, Some(1.0));
                assert_eq!(l.up.dims(), &[4, 2]);
                assert_eq!(l.down.dims(), &[2, 3]);
            }
            other => panic!("expected a LoRA, got {}", other.kind()),
        }
        assert_eq!(
            out.unmatched_lora_keys,
            [
                "lora_unet_input_blocks_1_1_proj_in.something_else",
                "lora_unet_output_blocks_9_9_nope.lora_down.weight",
                "lora_unet_output_blocks_9_9_nope.lora_up.weight",
            ]
        );
    }

    #[test]
    fn peft_and_diffusers_names_map_onto_the_models_own_prefix() {
        let keys = [
            "diffusion_model.double_blocks.0.img_attn.qkv.weight",
            "text_encoder.encoder.layers.0.self_attn.q_proj.weight",
            "encoder.layer.0.attention.self.query.weight",
            "transformer.h.0.attn.c_attn.weight",
        ];
        let mut t = HashMap::new();
        lora_pair(
            &mut t,
            "transformer.double_blocks.0.img_attn.qkv",
            ".lora_B.weight",
            ".lora_A.weight",
        );
        lora_pair(
            &mut t,
            "text_encoder.text_model.encoder.layers.0.self_attn.q_proj",
            ".lora.up.weight",
            ".lora.down.weight",
        );
        lora_pair(
            &mut t,
            "base_model.model.encoder.layer.0.attention.self.query",
            ".lora_B.weight",
            ".lora_A.weight",
        );
        lora_pair(
            &mut t,
            "base_model.model.transformer.h.0.attn.c_attn",
            ".lora_B.weight",
            ".lora_A.weight",
        );
        let out = load(t, keys).unwrap();
        assert_eq!(keys_of(&out), keys);
        assert!(
            out.unmatched_lora_keys.is_empty(),
            "{:?}",
            out.unmatched_lora_keys
        );
        // lora_B is up, lora_A is down.
        let Patch::Lora(l) = &out.patches[0].1 else {
            panic!("not a LoRA")
        };
        assert_eq!((l.up.dims(), l.down.dims()), (&[4, 2][..], &[2, 3][..]));
    }

    #[test]
    fn direct_and_processor_names_map() {
        let mut t = HashMap::new();
        lora_pair(
            &mut t,
            "unet.middle_block.1.transformer_blocks.0.attn1.processor.to_out",
            "_lora.up.weight",
            "_lora.down.weight",
        );
        lora_pair(
            &mut t,
            "diffusion_model.middle_block.1.transformer_blocks.0.attn1.to_q",
            ".lora_linear_layer.up.weight",
            ".lora_linear_layer.down.weight",
        );
        let out = load(t, SDXL_KEYS.iter().copied()).unwrap();
        assert_eq!(
            keys_of(&out),
            [
                "diffusion_model.middle_block.1.transformer_blocks.0.attn1.to_q.weight",
                "diffusion_model.middle_block.1.transformer_blocks.0.attn1.to_out.0.weight",
            ]
        );
    }

    #[test]
    fn loha_lokr_and_full_diff_groups_become_their_patch_kinds() {
        let mut t = HashMap::new();
        for p in ["hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"] {
            t.insert(
                format!("lora_unet_input_blocks_1_1_proj_in.{p}"),
                ones(&[2, 2]),
            );
        }
        t.insert(
            "lora_unet_input_blocks_1_1_proj_in.alpha".into(),
            Tensor::new(4.0f32, &Device::Cpu).unwrap(),
        );
        t.insert(
            "lora_unet_middle_block_1_transformer_blocks_0_attn1_to_q.lokr_w1".into(),
            ones(&[2, 2]),
        );
        t.insert(
            "lora_unet_middle_block_1_transformer_blocks_0_attn1_to_q.lokr_w2_a".into(),
            ones(&[2, 1]),
        );
        t.insert(
            "lora_unet_middle_block_1_transformer_blocks_0_attn1_to_q.lokr_w2_b".into(),
            ones(&[1, 2]),
        );
        t.insert(
            "diffusion_model.middle_block.1.transformer_blocks.0.attn1.to_out.0.diff".into(),
            ones(&[4, 4]),
        );
        t.insert(
            "diffusion_model.input_blocks.1.1.proj_in.diff_b".into(),
            ones(&[4]),
        );
        let dir = tempfile::tempdir().unwrap();
        let out = load(
            save(&dir, "lyco.safetensors", &t),
            SDXL_KEYS.iter().copied(),
        )
        .unwrap();
        let kinds: Vec<(&str, &str)> = out
            .patches
            .iter()
            .map(|(k, p)| (k.as_str(), p.kind()))
            .collect();
        assert_eq!(
            kinds,
            [
                ("diffusion_model.input_blocks.1.1.proj_in.weight", "loha"),
                ("diffusion_model.input_blocks.1.1.proj_in.bias", "diff"),
                (
                    "diffusion_model.middle_block.1.transformer_blocks.0.attn1.to_q.weight",
                    "lokr"
                ),
                (
                    "diffusion_model.middle_block.1.transformer_blocks.0.attn1.to_out.0.weight",
                    "diff"
                ),
            ]
        );
        let Patch::LoHa(h) = &out.patches[0].1 else {
            panic!("not LoHa")
        };
        assert_eq!(h.alpha, Some(4.0));
        assert!(
            out.unmatched_lora_keys.is_empty(),
            "{:?}",
            out.unmatched_lora_keys
        );
    }

    #[test]
    fn glora_groups_become_glora_patches_and_bad_ones_are_reported() {
        let mut t = HashMap::new();
        let base = "lora_unet_input_blocks_1_1_proj_in";
        for p in ["a1", "a2", "b1", "b2"] {
            t.insert(format!("{base}.{p}.weight"), ones(&[2, 2]));
        }
        t.insert(
            format!("{base}.alpha"),
            Tensor::new(3.0f32, &Device::Cpu).unwrap(),
        );
        // A GLoRA without b2, and a Tucker GLoRA: both reported, neither loaded.
        let lacking = "lora_unet_middle_block_1_transformer_blocks_0_attn1_to_q";
        for p in ["a1", "a2", "b1"] {
            t.insert(format!("{lacking}.{p}.weight"), ones(&[2, 2]));
        }
        let tucker = "lora_unet_middle_block_1_transformer_blocks_0_attn1_to_out_0";
        for p in ["a1", "a2", "b1", "b2", "bm"] {
            t.insert(format!("{tucker}.{p}.weight"), ones(&[2, 2]));
        }
        let dir = tempfile::tempdir().unwrap();
        let out = load(
            save(&dir, "glora.safetensors", &t),
            SDXL_KEYS.iter().copied(),
        )
        .unwrap();
        assert_eq!(out.patches.len(), 1);
        assert_eq!(
            out.patches[0].0,
            "diffusion_model.input_blocks.1.1.proj_in.weight"
        );
        let Patch::GLora(g) = &out.patches[0].1 else {
            panic!("not GLoRA: {}", out.patches[0].1.kind())
        };
        assert_eq!(out.patches[0].1.kind(), "glora");
        assert_eq!(g.alpha, Some(3.0));
        let mut want: Vec<String> = ["a1", "a2", "b1"]
            .iter()
            .map(|p| format!("{lacking}.{p}.weight"))
            .chain(
                ["a1", "a2", "b1", "b2", "bm"]
                    .iter()
                    .map(|p| format!("{tucker}.{p}.weight")),
            )
            .collect();
        want.sort();
        assert_eq!(out.unmatched_lora_keys, want);
    }

    #[test]
    fn oft_groups_become_oft_patches_and_boft_or_rescaled_ones_are_reported() {
        let mut t = HashMap::new();
        let base = "lora_unet_input_blocks_1_1_proj_in";
        t.insert(format!("{base}.oft_blocks"), ones(&[2, 2, 2]));
        t.insert(
            format!("{base}.alpha"),
            Tensor::new(0.5f32, &Device::Cpu).unwrap(),
        );
        let boft = "lora_unet_middle_block_1_transformer_blocks_0_attn1_to_q";
        t.insert(format!("{boft}.oft_blocks"), ones(&[1, 2, 2, 2]));
        let rescaled = "lora_unet_middle_block_1_transformer_blocks_0_attn1_to_out_0";
        t.insert(format!("{rescaled}.oft_blocks"), ones(&[2, 2, 2]));
        t.insert(format!("{rescaled}.rescale"), ones(&[4, 1]));
        let dir = tempfile::tempdir().unwrap();
        let out = load(save(&dir, "oft.safetensors", &t), SDXL_KEYS.iter().copied()).unwrap();
        assert_eq!(out.patches.len(), 1);
        assert_eq!(
            out.patches[0].0,
            "diffusion_model.input_blocks.1.1.proj_in.weight"
        );
        let Patch::Oft(o) = &out.patches[0].1 else {
            panic!("not OFT: {}", out.patches[0].1.kind())
        };
        assert_eq!(out.patches[0].1.kind(), "oft");
        assert_eq!(o.alpha, Some(0.5));
        assert_eq!(
            out.unmatched_lora_keys,
            [
                format!("{rescaled}.oft_blocks"),
                format!("{rescaled}.rescale"),
                format!("{boft}.oft_blocks"),
            ]
        );
    }

    #[test]
    fn incomplete_group_is_reported_not_loaded() {
        let mut t = HashMap::new();
        t.insert(
            "lora_unet_input_blocks_1_1_proj_in.lora_up.weight".into(),
            ones(&[4, 2]),
        );
        t.insert("lora_unet_input_blocks_1_1_proj_in.alpha".into(), ones(&[]));
        let out = load(t, SDXL_KEYS.iter().copied()).unwrap();
        assert!(out.patches.is_empty());
        assert_eq!(
            out.unmatched_lora_keys,
            [
                "lora_unet_input_blocks_1_1_proj_in.alpha",
                "lora_unet_input_blocks_1_1_proj_in.lora_up.weight",
            ]
        );
    }

    #[test]
    fn dora_scale_and_mid_are_attached_to_the_lora() {
        let mut t = HashMap::new();
        lora_pair(
            &mut t,
            "lora_unet_input_blocks_1_1_proj_in",
            ".lora_up.weight",
            ".lora_down.weight",
        );
        t.insert(
            "lora_unet_input_blocks_1_1_proj_in.dora_scale".into(),
            ones(&[4, 1]),
        );
        t.insert(
            "lora_unet_input_blocks_1_1_proj_in.lora_mid.weight".into(),
            ones(&[2, 2, 3, 3]),
        );
        let out = load(t, SDXL_KEYS.iter().copied()).unwrap();
        let Patch::Lora(l) = &out.patches[0].1 else {
            panic!("not a LoRA")
        };
        assert!(l.dora_scale.is_some() && l.mid.is_some() && l.alpha.is_none());
    }

    #[test]
    fn loaded_lora_applies_with_expected_numbers() {
        use crate::patcher::patch::{apply, DoraNorm, PatchEntry};
        let mut t = HashMap::new();
        let dev = Device::Cpu;
        t.insert(
            "layer.lora_up.weight".to_string(),
            Tensor::new(&[[1.0f32], [2.0]], &dev).unwrap(),
        );
        t.insert(
            "layer.lora_down.weight".to_string(),
            Tensor::new(&[[3.0f32, 4.0]], &dev).unwrap(),
        );
        t.insert(
            "layer.alpha".to_string(),
            Tensor::new(0.5f32, &dev)
                .unwrap()
                .to_dtype(DType::F16)
                .unwrap(),
        );
        let dir = tempfile::tempdir().unwrap();
        let out = load(save(&dir, "l.safetensors", &t), ["layer.weight"]).unwrap();
        let (key, patch) = out.patches.into_iter().next().unwrap();
        let w = Tensor::zeros((2, 2), DType::F32, &dev).unwrap();
        let entry = PatchEntry::new(patch).with_strengths(2.0, 1.0);
        let got = apply(&key, &w, &[entry], DoraNorm::Standard).unwrap();
        assert_eq!(got.to_vec2::<f32>().unwrap(), [[3.0, 4.0], [6.0, 8.0]]);
    }

    #[test]
    fn loading_is_deterministic() {
        let mut t = HashMap::new();
        for i in 0..8 {
            lora_pair(
                &mut t,
                &format!("blk{i}"),
                ".lora_up.weight",
                ".lora_down.weight",
            );
            t.insert(format!("stray{i}.bin"), ones(&[1]));
        }
        let keys: Vec<String> = (0..8).rev().map(|i| format!("blk{i}.weight")).collect();
        let a = load(t.clone(), keys.iter().map(String::as_str)).unwrap();
        let b = load(t, keys.iter().map(String::as_str)).unwrap();
        assert_eq!(keys_of(&a), keys_of(&b));
        assert_eq!(a.matched_model_keys, keys); // model key order
        assert_eq!(a.unmatched_lora_keys, b.unmatched_lora_keys);
        assert_eq!(a.unmatched_lora_keys.len(), 8);
    }

    /// Weight and bias keys of a complete UNet of `layout` in `naming`, under `prefix`.
    fn unet_keys(layout: &UnetLayout, naming: UnetNaming, prefix: &str) -> Vec<String> {
        unet::example_paths(layout, naming)
            .into_iter()
            .flat_map(|p| [format!("{prefix}{p}.weight"), format!("{prefix}{p}.bias")])
            .collect()
    }

    fn sorted(mut v: Vec<String>) -> Vec<String> {
        v.sort();
        v
    }

    #[test]
    fn diffusers_named_lora_finds_an_ldm_checkpoints_keys() {
        let mut keys = unet_keys(
            &UnetLayout::sd1(),
            UnetNaming::Ldm,
            "model.diffusion_model.",
        );
        keys.push("cond_stage_model.transformer.text_model.encoder.layers.0.mlp.fc1.weight".into());
        let mut t = HashMap::new();
        let (peft, kohya) = (
            (".lora_B.weight", ".lora_A.weight"),
            (".lora_up.weight", ".lora_down.weight"),
        );
        for (base, (up, down)) in [
            (
                "unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q",
                peft,
            ),
            ("base_model.model.up_blocks.1.upsamplers.0.conv", peft),
            ("unet.down_blocks.0.downsamplers.0.conv", peft),
            ("lora_unet_down_blocks_0_resnets_0_conv1", kohya),
            ("lora_unet_up_blocks_0_upsamplers_0_conv", kohya),
            ("lora_unet_mid_block_attentions_0_proj_in", kohya),
            ("lora_unet_mid_block_resnets_1_conv1", kohya),
            ("lora_unet_time_embedding_linear_1", kohya),
            (
                "lora_unet_up_blocks_3_attentions_2_transformer_blocks_0_ff_net_2",
                kohya,
            ),
            ("lora_te_text_model_encoder_layers_0_mlp_fc1", kohya),
            // SD1 has no attention on its deepest level and no upsampler on its last up block.
            ("lora_unet_down_blocks_3_attentions_0_proj_in", kohya),
            ("unet.up_blocks.3.upsamplers.0.conv", peft),
        ] {
            lora_pair(&mut t, base, up, down);
        }
        t.insert("unet.mid_block.resnets.1.conv1.diff_b".into(), ones(&[4]));
        let out = load(t, keys.iter().map(String::as_str)).unwrap();
        let d = "model.diffusion_model.";
        assert_eq!(
            sorted(out.patches.iter().map(|(k, _)| k.clone()).collect()),
            sorted(vec![
                format!("{d}input_blocks.4.1.transformer_blocks.0.attn1.to_q.weight"),
                format!("{d}output_blocks.5.2.conv.weight"),
                format!("{d}input_blocks.3.0.op.weight"),
                format!("{d}input_blocks.1.0.in_layers.2.weight"),
                format!("{d}output_blocks.2.1.conv.weight"),
                format!("{d}middle_block.1.proj_in.weight"),
                format!("{d}middle_block.2.in_layers.2.weight"),
                format!("{d}middle_block.2.in_layers.2.bias"),
                format!("{d}time_embed.0.weight"),
                format!("{d}output_blocks.11.1.transformer_blocks.0.ff.net.2.weight"),
                "cond_stage_model.transformer.text_model.encoder.layers.0.mlp.fc1.weight".into(),
            ])
        );
        assert_eq!(out.matched_model_keys.len(), out.patches.len());
        assert_eq!(
            out.unmatched_lora_keys,
            [
                "lora_unet_down_blocks_3_attentions_0_proj_in.lora_down.weight",
                "lora_unet_down_blocks_3_attentions_0_proj_in.lora_up.weight",
                "unet.up_blocks.3.upsamplers.0.conv.lora_A.weight",
                "unet.up_blocks.3.upsamplers.0.conv.lora_B.weight",
            ]
        );
    }

    #[test]
    fn ldm_named_lora_finds_a_diffusers_unets_keys() {
        // SDXL, unprefixed as in a diffusers `unet/diffusion_pytorch_model.safetensors`.
        let keys = unet_keys(&UnetLayout::sdxl(), UnetNaming::Diffusers, "");
        let mut t = HashMap::new();
        for base in [
            "lora_unet_input_blocks_7_1_transformer_blocks_9_attn2_to_k",
            "lora_unet_output_blocks_2_2_conv",
            "lora_unet_output_blocks_8_0_skip_connection",
            "lora_unet_label_emb_0_0",
            "diffusion_model.middle_block.2.in_layers.2",
            "lora_unet_input_blocks_1_1_proj_in", // SDXL level 0 has no attention
        ] {
            lora_pair(&mut t, base, ".lora_up.weight", ".lora_down.weight");
        }
        let out = load(t.clone(), keys.iter().map(String::as_str)).unwrap();
        assert_eq!(
            sorted(out.matched_model_keys.clone()),
            sorted(
                [
                    "down_blocks.2.attentions.0.transformer_blocks.9.attn2.to_k.weight",
                    "up_blocks.0.upsamplers.0.conv.weight",
                    "up_blocks.2.resnets.2.conv_shortcut.weight",
                    "add_embedding.linear_1.weight",
                    "mid_block.resnets.1.conv1.weight",
                ]
                .map(String::from)
                .to_vec()
            )
        );
        assert_eq!(
            out.unmatched_lora_keys,
            [
                "lora_unet_input_blocks_1_1_proj_in.lora_down.weight",
                "lora_unet_input_blocks_1_1_proj_in.lora_up.weight",
            ]
        );

        // The same name on SD1, whose level 0 has attention, with the model under a prefix.
        let keys = unet_keys(
            &UnetLayout::sd1(),
            UnetNaming::Diffusers,
            "diffusion_model.",
        );
        let out = load(t, keys.iter().map(String::as_str)).unwrap();
        assert!(out
            .matched_model_keys
            .contains(&"diffusion_model.down_blocks.0.attentions.0.proj_in.weight".to_string()));
    }

    #[test]
    fn unrecognised_unet_keeps_the_old_matching() {
        // An SD1 checkpoint with an up block missing is not a layout the detector knows.
        let keys: Vec<String> = unet_keys(&UnetLayout::sd1(), UnetNaming::Ldm, "diffusion_model.")
            .into_iter()
            .filter(|k| !k.starts_with("diffusion_model.output_blocks.4."))
            .collect();
        let mut t = HashMap::new();
        for base in [
            "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q",
            "lora_unet_input_blocks_4_1_transformer_blocks_0_attn2_to_k",
        ] {
            lora_pair(&mut t, base, ".lora_up.weight", ".lora_down.weight");
        }
        let out = load(t.clone(), keys.iter().map(String::as_str)).unwrap();
        assert_eq!(
            keys_of(&out),
            ["diffusion_model.input_blocks.4.1.transformer_blocks.0.attn2.to_k.weight"]
        );
        assert_eq!(
            out.unmatched_lora_keys,
            [
                "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q.lora_down.weight",
                "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q.lora_up.weight",
            ]
        );
        // With the block back, the diffusers name finds its key too.
        let keys = unet_keys(&UnetLayout::sd1(), UnetNaming::Ldm, "diffusion_model.");
        let out = load(t, keys.iter().map(String::as_str)).unwrap();
        assert_eq!(out.patches.len(), 2);
        assert!(out.unmatched_lora_keys.is_empty());
    }

    #[test]
    fn missing_file_error_names_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("no_such_lora.safetensors");
        let err = load(path.clone(), SDXL_KEYS.iter().copied()).unwrap_err();
        assert!(
            matches!(&err, Error::File { path: p, .. } if *p == path),
            "{err}"
        );
        assert!(
            err.to_string().contains("no_such_lora.safetensors"),
            "{err}"
        );
    }

    #[test]
    fn corrupt_file_error_names_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("broken.safetensors");
        std::fs::write(&path, b"not a safetensors file").unwrap();
        let err = load(path.as_path(), SDXL_KEYS.iter().copied()).unwrap_err();
        assert!(err.to_string().contains("broken.safetensors"), "{err}");
    }
}
