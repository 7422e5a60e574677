//! Matching a LoRA base name to the model key it patches (rules 1 to 3 of the
//! [`lora_file`](super) docs): model keys and LoRA names split into a component (diffusion model,
//! text encoder N) and a path, and an index of the model's paths, dotted and kohya-underscored,
//! plus the diffusion model's paths in the other UNet naming.

use std::collections::{HashMap, HashSet};

use super::unet::{LayoutMap, UnetLayout};

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
    // SD2's one text encoder in ComfyUI.
    ("clip_h.", Component::TextEncoder(1)),
    ("clip_g.", Component::TextEncoder(2)),
    ("t5xxl.", Component::TextEncoder(3)),
];

/// `(prefix, component, kohya-style underscored path)`.
const LORA_PREFIXES: &[(&str, Component, bool)] = &[
    ("lora_unet_", Component::Diffusion, true),
    ("lora_transformer_", Component::Diffusion, true),
    // SimpleTuner's LyCORIS names.
    ("lycoris_", Component::Diffusion, true),
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

/// The prefix of ComfyUI's generic text-encoder LoRA names: `text_encoders.` and then the model
/// key without `.weight`, for every weight of every text encoder (what its LoRA saver writes).
const GENERIC_TEXT_ENCODER: &str = "text_encoders.";

/// `(in-memory, as trainers spell it)` fragments of one native module's path, each with its
/// trailing `.`: HunyuanVideo's Tencent names (`img_attn_qkv`, `img_mod.linear`, `img_mlp.fc1`),
/// which diffusion-pipe LoRAs use (`transformer.double_blocks.0.img_attn_qkv`), where ComfyUI's
/// model holds Flux-style ones (`img_attn.qkv`, `img_mod.lin`, `img_mlp.0`).
const ALIASES: &[(&str, &str)] = &[
    ("_mod.lin.", "_mod.linear."),
    ("_attn.qkv.", "_attn_qkv."),
    ("_attn.proj.", "_attn_proj."),
    ("mlp.0.", "mlp.fc1."),
    ("mlp.2.", "mlp.fc2."),
    (".modulation.lin.", ".modulation.linear."),
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
            if let Some(n) = n.parse::<usize>().ok().and_then(|n| n.checked_add(1)) {
                return (Component::TextEncoder(n), rest);
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

pub(super) struct ModelIndex {
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
    pub(super) fn new<'a>(model_keys: impl IntoIterator<Item = &'a str>) -> Self {
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
        index.add_aliases(&unet);
        index
    }

    /// Indexes the diffusion model's modules under the other spellings trainers use for the same
    /// native module ([`ALIASES`]: HunyuanVideo's original names, which diffusion-pipe writes,
    /// against ComfyUI's in-memory ones), beside the renamed UNet paths. A path none of them
    /// changes is not indexed again.
    fn add_aliases(&mut self, modules: &[(Component, String, String)]) {
        for (comp, module, path) in modules {
            let mut alias = format!("{path}.");
            for (native, spelled) in ALIASES {
                alias = alias.replace(native, spelled);
            }
            let Some(alias) = alias.strip_suffix('.').filter(|a| a != path) else {
                continue;
            };
            let entry = (*comp, module.clone());
            self.renamed_underscored
                .entry(alias.replace('.', "_"))
                .or_default()
                .push(entry.clone());
            self.renamed_dotted
                .entry(alias.to_string())
                .or_default()
                .push(entry);
        }
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

    /// The position of model key `key` in the order given, if the model has it.
    pub(super) fn position(&self, key: &str) -> Option<usize> {
        self.keys.get(key).copied()
    }

    /// Every model key.
    pub(super) fn keys(&self) -> impl Iterator<Item = &str> {
        self.keys.keys().map(String::as_str)
    }

    /// The model key (and its position) that the LoRA base `base` patches, for the key suffix
    /// `.weight` or `.bias`.
    pub(super) fn resolve(&self, base: &str, suffix: &str) -> Option<(usize, String)> {
        let base = base.strip_prefix("base_model.model.").unwrap_or(base);
        let direct = format!("{base}{suffix}");
        if let Some(&pos) = self.keys.get(&direct) {
            return Some((pos, direct));
        }
        if let Some(module) = base.strip_prefix(GENERIC_TEXT_ENCODER) {
            return self.resolve_text_encoder(module, suffix);
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

    /// The model key of ComfyUI's generic text-encoder name `text_encoders.<module>`, `module`
    /// being a text-encoder module as ComfyUI holds it
    /// (`clip_g.transformer.text_model.embeddings.position_embedding`): the model's own key when
    /// it has one (`module` with or without `text_encoders.`, which rule 1 tried); else, for a known encoder name (`clip_l.`,
    /// `clip_h.`, `clip_g.`, `t5xxl.`), the same path in that text encoder under any of its
    /// prefixes (`conditioner.embedders.1.`, `text_encoder_2.`, `cond_stage_model.` …, after
    /// `transformer.` and `text_model.`), or an unprefixed model key; else, for any other name
    /// (`umt5xxl.`, `llama.` …), the path after it as an unprefixed model key (an encoder held
    /// alone).
    fn resolve_text_encoder(&self, module: &str, suffix: &str) -> Option<(usize, String)> {
        let own = format!("{module}{suffix}");
        if let Some(&pos) = self.keys.get(&own) {
            return Some((pos, own));
        }
        match split_model_prefix(module) {
            (comp @ Component::TextEncoder(_), path) => {
                self.best(&self.dotted, te_path(path, '.'), comp, suffix)
            }
            _ => {
                let (_, path) = module.split_once('.')?;
                let key = format!("{path}{suffix}");
                self.keys.get(&key).map(|&pos| (pos, key))
            }
        }
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
