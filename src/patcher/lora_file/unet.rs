//! Stable Diffusion UNet layouts: the block structure, read from a model's own keys, and the map
//! between the two namings of its modules.
//!
//! The same UNet is stored under two namings. **ldm** (the original Stability checkpoints, and
//! ComfyUI's) numbers blocks flatly: `input_blocks.N.M`, `middle_block.M`, `output_blocks.N.M`.
//! **diffusers** nests them: `down_blocks.L.{resnets,attentions,downsamplers}.J`,
//! `mid_block.…`, `up_blocks.L.…`. [`UnetLayout::module_pairs`] derives every pair from the
//! layout (number of levels, residual blocks per level, transformer depth per level), following
//! the rules that diffusers' own conversion scripts (`convert_diffusers_to_original_sdxl.py` and
//! friends) hard-code for SD1.x/SD2.x and SDXL:
//!
//! - input block `1 + L·(R+1) + J` is down level `L`'s residual block `J` (at `.0`) and, when the
//!   level has attention, its attention `J` (at `.1`); input block `(L+1)·(R+1)` is level `L`'s
//!   downsampler (`.0.op` ↔ `downsamplers.0.conv`), on every level but the last. `R` is the number
//!   of residual blocks per level; input block 0 is `conv_in`.
//! - up block `U` is level `levels-1-U`, deepest first; output block `U·(R+1) + J` holds its
//!   residual block `J` (of `R+1`) and attention `J`; its upsampler (every up block but the last)
//!   sits in output block `U·(R+1) + R` after the residual block and the attention if any: at
//!   `.2.conv` when the level has attention, `.1.conv` when it has none.
//! - `middle_block.0`, `.1`, `.2` are `mid_block.resnets.0`, `mid_block.attentions.0`,
//!   `mid_block.resnets.1`.
//! - inside a residual block `in_layers.0` ↔ `norm1`, `in_layers.2` ↔ `conv1`, `emb_layers.1` ↔
//!   `time_emb_proj`, `out_layers.0` ↔ `norm2`, `out_layers.3` ↔ `conv2`, `skip_connection` ↔
//!   `conv_shortcut`; inside an attention block (a spatial transformer) the paths are the same in
//!   both namings.
//! - `time_embed.0`/`.2` ↔ `time_embedding.linear_1`/`_2`, `label_emb.0.0`/`.0.2` ↔
//!   `add_embedding.linear_1`/`_2` (SDXL), `input_blocks.0.0` ↔ `conv_in`, `out.0` ↔
//!   `conv_norm_out`, `out.2` ↔ `conv_out`.
//!
//! [`UnetLayout::detect`] reads the layout back from module paths and only answers when every
//! block path it sees is one the layout predicts and every block the layout predicts is there, with
//! the transformer depth of its level; anything else (another architecture, a partial key set, a
//! per-block depth that varies within a level) gives `None`. It costs O(paths × path length).

use std::collections::{BTreeSet, HashMap, HashSet};

/// Which of the two namings module paths use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum UnetNaming {
    /// Original Stability / ComfyUI checkpoints: `input_blocks`, `middle_block`, `output_blocks`.
    Ldm,
    /// diffusers `UNet2DConditionModel`: `down_blocks`, `mid_block`, `up_blocks`.
    Diffusers,
}

/// What a [`ModulePair`] names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PairKind {
    /// One layer: both paths name the same weight's module.
    Layer,
    /// A spatial transformer block with `depth` transformer blocks: the paths are prefixes, and
    /// everything below them (`proj_in`, `transformer_blocks.K.attn1.to_q`, …) is named the same.
    Transformer {
        /// Number of `transformer_blocks` inside.
        depth: usize,
    },
}

/// One module (or module prefix) under both namings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModulePair {
    /// The ldm path, e.g. `input_blocks.1.0.in_layers.2`.
    pub ldm: String,
    /// The diffusers path, e.g. `down_blocks.0.resnets.0.conv1`.
    pub diffusers: String,
    /// Whether this is one layer or a transformer block prefix.
    pub kind: PairKind,
}

impl ModulePair {
    fn side(&self, naming: UnetNaming) -> &str {
        match naming {
            UnetNaming::Ldm => &self.ldm,
            UnetNaming::Diffusers => &self.diffusers,
        }
    }
}

/// The block structure of a Stable Diffusion UNet (see the [module docs](self)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnetLayout {
    /// Residual blocks per down level (up levels have one more).
    num_res_blocks: usize,
    /// Transformer depth per level, shallowest first; 0 means no attention at that level.
    transformer_depth: Vec<usize>,
    /// Transformer depth of the middle block's attention (at least 1).
    mid_transformer_depth: usize,
}

/// ldm and diffusers names of a residual block's layers.
const RESNET_LAYERS: &[(&str, &str)] = &[
    ("in_layers.0", "norm1"),
    ("in_layers.2", "conv1"),
    ("emb_layers.1", "time_emb_proj"),
    ("out_layers.0", "norm2"),
    ("out_layers.3", "conv2"),
    ("skip_connection", "conv_shortcut"),
];

/// Layers outside the blocks.
const OUTER_LAYERS: &[(&str, &str)] = &[
    ("time_embed.0", "time_embedding.linear_1"),
    ("time_embed.2", "time_embedding.linear_2"),
    ("label_emb.0.0", "add_embedding.linear_1"),
    ("label_emb.0.2", "add_embedding.linear_2"),
    ("input_blocks.0.0", "conv_in"),
    ("out.0", "conv_norm_out"),
    ("out.2", "conv_out"),
];

/// Per naming, the block namespaces and how many path segments name one block in each
/// (`input_blocks.4.1`, `down_blocks.1.attentions.0`).
fn namespaces(naming: UnetNaming) -> &'static [(&'static str, usize)] {
    match naming {
        UnetNaming::Ldm => &[
            ("input_blocks", 3),
            ("middle_block", 2),
            ("output_blocks", 3),
        ],
        UnetNaming::Diffusers => &[("down_blocks", 4), ("mid_block", 3), ("up_blocks", 4)],
    }
}

/// The block `path` lies in (its first segments), when it lies in one of `naming`'s namespaces.
fn block_of(naming: UnetNaming, path: &str) -> Option<&str> {
    let first = path.split('.').next()?;
    let &(_, segments) = namespaces(naming).iter().find(|(ns, _)| *ns == first)?;
    let end = path
        .match_indices('.')
        .nth(segments - 1)
        .map_or(path.len(), |(i, _)| i);
    Some(&path[..end])
}

impl UnetLayout {
    /// SD1.x and SD2.x: four levels of two residual blocks, attention of depth 1 on the first
    /// three levels and in the middle.
    pub fn sd1() -> Self {
        UnetLayout {
            num_res_blocks: 2,
            transformer_depth: vec![1, 1, 1, 0],
            mid_transformer_depth: 1,
        }
    }

    /// SDXL base: three levels of two residual blocks, transformer depth 0, 2 and 10, and 10 in
    /// the middle.
    pub fn sdxl() -> Self {
        UnetLayout {
            num_res_blocks: 2,
            transformer_depth: vec![0, 2, 10],
            mid_transformer_depth: 10,
        }
    }

    /// Number of levels (the length of the model's `channel_mult`).
    pub fn levels(&self) -> usize {
        self.transformer_depth.len()
    }

    /// Residual blocks per down level; up levels have one more.
    pub fn num_res_blocks(&self) -> usize {
        self.num_res_blocks
    }

    /// Transformer depth per level, shallowest first; 0 means no attention at that level.
    pub fn transformer_depth(&self) -> &[usize] {
        &self.transformer_depth
    }

    /// Transformer depth of the middle block's attention.
    pub fn mid_transformer_depth(&self) -> usize {
        self.mid_transformer_depth
    }

    /// Every module of the layout under both namings: residual block layers, attention blocks
    /// (as prefixes), down- and upsamplers, the middle block, embeddings, `conv_in` and the output
    /// layers. O(levels × residual blocks).
    pub fn module_pairs(&self) -> Vec<ModulePair> {
        let mut pairs: Vec<ModulePair> = OUTER_LAYERS
            .iter()
            .map(|&(ldm, diffusers)| layer(ldm.to_string(), diffusers.to_string()))
            .collect();
        let n = self.num_res_blocks;
        let levels = self.levels();
        for (level, &depth) in self.transformer_depth.iter().enumerate() {
            for j in 0..n {
                let block = 1 + level * (n + 1) + j;
                let ldm = format!("input_blocks.{block}");
                resnet_and_attention(&mut pairs, &ldm, &format!("down_blocks.{level}"), j, depth);
            }
            if level + 1 < levels {
                pairs.push(layer(
                    format!("input_blocks.{}.0.op", (level + 1) * (n + 1)),
                    format!("down_blocks.{level}.downsamplers.0.conv"),
                ));
            }
        }
        resnet(&mut pairs, "middle_block.0", "mid_block.resnets.0");
        pairs.push(transformer(
            "middle_block.1".to_string(),
            "mid_block.attentions.0".to_string(),
            self.mid_transformer_depth,
        ));
        resnet(&mut pairs, "middle_block.2", "mid_block.resnets.1");
        for up in 0..levels {
            let depth = self.transformer_depth[levels - 1 - up];
            for j in 0..=n {
                let block = up * (n + 1) + j;
                let ldm = format!("output_blocks.{block}");
                resnet_and_attention(&mut pairs, &ldm, &format!("up_blocks.{up}"), j, depth);
            }
            if up + 1 < levels {
                let slot = if depth > 0 { 2 } else { 1 };
                pairs.push(layer(
                    format!("output_blocks.{}.{slot}.conv", up * (n + 1) + n),
                    format!("up_blocks.{up}.upsamplers.0.conv"),
                ));
            }
        }
        pairs
    }

    /// The naming and layout of a UNet, from its module paths (weight keys without `.weight` or
    /// `.bias`, and without any component prefix such as `model.diffusion_model.`). Paths outside
    /// the UNet's blocks are ignored. `None` when the paths are not a complete SD-style UNet this
    /// module understands (see the [module docs](self)).
    pub fn detect<'a>(paths: impl IntoIterator<Item = &'a str>) -> Option<(UnetNaming, Self)> {
        let mut ldm = Observed::default();
        let mut diffusers = Observed::default();
        for path in paths {
            if let Some(block) = block_of(UnetNaming::Ldm, path) {
                ldm.add(block, path);
            } else if let Some(block) = block_of(UnetNaming::Diffusers, path) {
                diffusers.add(block, path);
            }
        }
        let (naming, observed, layout) = match (ldm.paths.is_empty(), diffusers.paths.is_empty()) {
            (false, true) => (UnetNaming::Ldm, &ldm, ldm.ldm_candidate()?),
            (true, false) => (
                UnetNaming::Diffusers,
                &diffusers,
                diffusers.diffusers_candidate()?,
            ),
            _ => return None,
        };
        observed.fits(naming, &layout).then_some((naming, layout))
    }
}

fn layer(ldm: String, diffusers: String) -> ModulePair {
    ModulePair {
        ldm,
        diffusers,
        kind: PairKind::Layer,
    }
}

fn transformer(ldm: String, diffusers: String, depth: usize) -> ModulePair {
    ModulePair {
        ldm,
        diffusers,
        kind: PairKind::Transformer { depth },
    }
}

/// Residual block `j` of a down or up level and, when the level has attention (`depth > 0`), its
/// attention: ldm block `ldm_block` holds them at `.0` and `.1`; diffusers names them
/// `{level}.resnets.{j}` and `{level}.attentions.{j}`.
fn resnet_and_attention(
    pairs: &mut Vec<ModulePair>,
    ldm_block: &str,
    level: &str,
    j: usize,
    depth: usize,
) {
    resnet(
        pairs,
        &format!("{ldm_block}.0"),
        &format!("{level}.resnets.{j}"),
    );
    if depth > 0 {
        pairs.push(transformer(
            format!("{ldm_block}.1"),
            format!("{level}.attentions.{j}"),
            depth,
        ));
    }
}

fn resnet(pairs: &mut Vec<ModulePair>, ldm: &str, diffusers: &str) {
    pairs.extend(
        RESNET_LAYERS
            .iter()
            .map(|(l, d)| layer(format!("{ldm}.{l}"), format!("{diffusers}.{d}"))),
    );
}

/// What the block paths of one naming show.
#[derive(Default)]
struct Observed<'a> {
    /// Paths inside the block namespaces.
    paths: Vec<&'a str>,
    /// The blocks those paths lie in.
    blocks: HashSet<&'a str>,
    /// Transformer prefix (the path before `.transformer_blocks.`) → highest index seen + 1.
    depth: HashMap<&'a str, usize>,
}

impl<'a> Observed<'a> {
    fn add(&mut self, block: &'a str, path: &'a str) {
        self.paths.push(path);
        self.blocks.insert(block);
        if let Some(at) = path.find(".transformer_blocks.") {
            let rest = &path[at + ".transformer_blocks.".len()..];
            let index = rest.split('.').next().and_then(|i| i.parse::<usize>().ok());
            if let Some(d) = index.and_then(|i| i.checked_add(1)) {
                let e = self.depth.entry(&path[..at]).or_default();
                *e = (*e).max(d);
            }
        }
    }

    /// The numbers in the `segment`-th segment (0-based) after `prefix` of the blocks under it.
    fn indices(&self, prefix: &str, segment: usize) -> BTreeSet<usize> {
        self.blocks
            .iter()
            .filter_map(|b| b.strip_prefix(prefix))
            .filter_map(|rest| rest.split('.').nth(segment)?.parse().ok())
            .collect()
    }

    fn level_depth(&self, attention: impl Fn(usize) -> String, n: usize) -> usize {
        (0..n)
            .map(|j| self.depth.get(attention(j).as_str()).copied().unwrap_or(0))
            .max()
            .unwrap_or(0)
    }

    /// The layout the ldm paths suggest: residual blocks from the first downsampler's position,
    /// levels from the number of downsamplers, depths from the input blocks. [`Self::fits`] checks
    /// it.
    fn ldm_candidate(&self) -> Option<UnetLayout> {
        let downsamplers: BTreeSet<usize> = self
            .paths
            .iter()
            .filter_map(|p| {
                let mut segments = p.split('.');
                let (ns, n, m, op) = (
                    segments.next()?,
                    segments.next()?,
                    segments.next()?,
                    segments.next()?,
                );
                (ns == "input_blocks" && m == "0" && op == "op")
                    .then(|| n.parse().ok())
                    .flatten()
            })
            .collect();
        let n = match downsamplers.first() {
            Some(&first) => first.checked_sub(1)?,
            None => *self.indices("input_blocks.", 0).last()?,
        };
        let levels = downsamplers.len() + 1;
        self.plausible(levels, n)?;
        let transformer_depth = (0..levels)
            .map(|level| {
                self.level_depth(|j| format!("input_blocks.{}.1", 1 + level * (n + 1) + j), n)
            })
            .collect();
        Some(UnetLayout {
            num_res_blocks: n,
            transformer_depth,
            mid_transformer_depth: *self.depth.get("middle_block.1")?,
        })
    }

    /// The layout the diffusers paths suggest: levels from the down blocks, residual blocks from
    /// the first one, depths from the down blocks' attentions. [`Self::fits`] checks it.
    fn diffusers_candidate(&self) -> Option<UnetLayout> {
        let levels = self.indices("down_blocks.", 0).last()?.checked_add(1)?;
        let n = self
            .indices("down_blocks.0.resnets.", 0)
            .last()?
            .checked_add(1)?;
        self.plausible(levels, n)?;
        let transformer_depth = (0..levels)
            .map(|level| self.level_depth(|j| format!("down_blocks.{level}.attentions.{j}"), n))
            .collect();
        Some(UnetLayout {
            num_res_blocks: n,
            transformer_depth,
            mid_transformer_depth: *self.depth.get("mid_block.attentions.0")?,
        })
    }

    /// Whether `levels` and `n` residual blocks could fit what was seen: each residual block is a
    /// block of its own, so a layout with more than there are blocks cannot be complete (this
    /// also bounds the work [`Self::fits`] does on a hostile key set).
    fn plausible(&self, levels: usize, n: usize) -> Option<()> {
        let resnets = levels.checked_mul(n.checked_add(1)?)?;
        (n > 0 && resnets <= self.blocks.len()).then_some(())
    }

    /// Whether the layout predicts exactly the blocks seen, with the depths seen.
    fn fits(&self, naming: UnetNaming, layout: &UnetLayout) -> bool {
        let pairs = layout.module_pairs();
        let map = LayoutMap::from_pairs(naming, &pairs);
        let every_path_known = self.paths.iter().all(|p| map.rename(p).is_some());
        let every_block_seen = pairs.iter().all(|pair| {
            block_of(naming, pair.side(naming)).is_none_or(|b| self.blocks.contains(b))
        });
        let depths_agree = pairs.iter().all(|pair| match pair.kind {
            PairKind::Layer => true,
            PairKind::Transformer { depth } => self.depth.get(pair.side(naming)) == Some(&depth),
        });
        every_path_known && every_block_seen && depths_agree
    }
}

/// Renames module paths of one naming into the other. Built once per LoRA load, O(pairs).
pub(super) struct LayoutMap {
    /// Path (or transformer prefix) in the model's naming → the same in the other naming.
    to_other: HashMap<String, String>,
}

impl LayoutMap {
    /// The map from `naming` to the other naming for `layout`.
    pub(super) fn new(naming: UnetNaming, layout: &UnetLayout) -> Self {
        Self::from_pairs(naming, &layout.module_pairs())
    }

    fn from_pairs(naming: UnetNaming, pairs: &[ModulePair]) -> Self {
        let other = match naming {
            UnetNaming::Ldm => UnetNaming::Diffusers,
            UnetNaming::Diffusers => UnetNaming::Ldm,
        };
        let to_other = pairs
            .iter()
            .map(|p| (p.side(naming).to_string(), p.side(other).to_string()))
            .collect();
        LayoutMap { to_other }
    }

    /// `path` in the other naming: its longest known prefix (cut at a `.`) is renamed and the
    /// rest kept. `None` when no prefix is known. O(segments) hash lookups.
    pub(super) fn rename(&self, path: &str) -> Option<String> {
        let cuts = std::iter::once(path.len()).chain(path.rmatch_indices('.').map(|(i, _)| i));
        for cut in cuts {
            if let Some(renamed) = self.to_other.get(&path[..cut]) {
                return Some(format!("{renamed}{}", &path[cut..]));
            }
        }
        None
    }
}

/// Module paths of a complete UNet of `layout` in `naming`: every layer, and for each attention
/// block its projections and a few layers of each of its transformer blocks.
#[cfg(test)]
pub(super) fn example_paths(layout: &UnetLayout, naming: UnetNaming) -> Vec<String> {
    let mut paths = Vec::new();
    for pair in layout.module_pairs() {
        let side = pair.side(naming);
        match pair.kind {
            PairKind::Layer => paths.push(side.to_string()),
            PairKind::Transformer { depth } => {
                for layer in ["norm", "proj_in", "proj_out"] {
                    paths.push(format!("{side}.{layer}"));
                }
                for k in 0..depth {
                    for layer in ["attn1.to_q", "attn1.to_out.0", "attn2.to_k", "ff.net.2"] {
                        paths.push(format!("{side}.transformer_blocks.{k}.{layer}"));
                    }
                }
            }
        }
    }
    paths
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Checks that `ldm` and `diffusers` rename into each other under `layout`.
    fn assert_pairs(layout: &UnetLayout, pairs: &[(&str, &str)]) {
        let to_diffusers = LayoutMap::new(UnetNaming::Ldm, layout);
        let to_ldm = LayoutMap::new(UnetNaming::Diffusers, layout);
        for &(ldm, diffusers) in pairs {
            assert_eq!(
                to_diffusers.rename(ldm).as_deref(),
                Some(diffusers),
                "{ldm}"
            );
            assert_eq!(
                to_ldm.rename(diffusers).as_deref(),
                Some(ldm),
                "{diffusers}"
            );
        }
    }

    fn assert_unknown(layout: &UnetLayout, naming: UnetNaming, paths: &[&str]) {
        let map = LayoutMap::new(naming, layout);
        for p in paths {
            assert_eq!(map.rename(p), None, "{p} should have no counterpart");
        }
    }

    #[test]
    fn sd1_map_holds_the_well_known_pairs() {
        let sd1 = UnetLayout::sd1();
        assert_pairs(
            &sd1,
            &[
                (
                    "input_blocks.4.1.transformer_blocks.0.attn1.to_q",
                    "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q",
                ),
                (
                    "input_blocks.1.0.in_layers.2",
                    "down_blocks.0.resnets.0.conv1",
                ),
                ("input_blocks.3.0.op", "down_blocks.0.downsamplers.0.conv"),
                ("input_blocks.9.0.op", "down_blocks.2.downsamplers.0.conv"),
                (
                    "input_blocks.4.0.skip_connection",
                    "down_blocks.1.resnets.0.conv_shortcut",
                ),
                (
                    "input_blocks.11.0.out_layers.3",
                    "down_blocks.3.resnets.1.conv2",
                ),
                ("middle_block.0.in_layers.0", "mid_block.resnets.0.norm1"),
                ("middle_block.1", "mid_block.attentions.0"),
                ("middle_block.1.proj_in", "mid_block.attentions.0.proj_in"),
                ("middle_block.2.in_layers.2", "mid_block.resnets.1.conv1"),
                (
                    "output_blocks.0.0.emb_layers.1",
                    "up_blocks.0.resnets.0.time_emb_proj",
                ),
                ("output_blocks.2.1.conv", "up_blocks.0.upsamplers.0.conv"),
                ("output_blocks.5.2.conv", "up_blocks.1.upsamplers.0.conv"),
                ("output_blocks.8.2.conv", "up_blocks.2.upsamplers.0.conv"),
                (
                    "output_blocks.3.1.proj_out",
                    "up_blocks.1.attentions.0.proj_out",
                ),
                ("output_blocks.11.1.norm", "up_blocks.3.attentions.2.norm"),
                (
                    "output_blocks.11.0.out_layers.0",
                    "up_blocks.3.resnets.2.norm2",
                ),
                ("time_embed.0", "time_embedding.linear_1"),
                ("time_embed.2", "time_embedding.linear_2"),
                ("input_blocks.0.0", "conv_in"),
                ("out.0", "conv_norm_out"),
                ("out.2", "conv_out"),
            ],
        );
        assert_unknown(
            &sd1,
            UnetNaming::Ldm,
            &[
                "input_blocks.10.1.proj_in",     // level 3 has no attention
                "output_blocks.2.2.conv",        // up block 0 has no attention: its upsampler is .1
                "output_blocks.11.2.conv",       // the last up block has no upsampler
                "input_blocks.12.0.in_layers.0", // there are 12 input blocks
                "input_blocks.1.0",              // a resnet's layers are renamed, not the block
                "input_blocks.1.10.proj_in",     // prefixes end at a `.`
            ],
        );
        assert_unknown(
            &sd1,
            UnetNaming::Diffusers,
            &[
                "down_blocks.3.attentions.0.proj_in",
                "down_blocks.3.downsamplers.0.conv",
                "up_blocks.0.attentions.0.proj_in",
                "up_blocks.3.upsamplers.0.conv",
            ],
        );
    }

    #[test]
    fn sdxl_map_holds_the_well_known_pairs() {
        let sdxl = UnetLayout::sdxl();
        assert_pairs(
            &sdxl,
            &[
                (
                    "input_blocks.7.1.transformer_blocks.9",
                    "down_blocks.2.attentions.0.transformer_blocks.9",
                ),
                (
                    "input_blocks.7.1.transformer_blocks.9.attn2.to_k",
                    "down_blocks.2.attentions.0.transformer_blocks.9.attn2.to_k",
                ),
                (
                    "input_blocks.4.1.proj_in",
                    "down_blocks.1.attentions.0.proj_in",
                ),
                ("input_blocks.6.0.op", "down_blocks.1.downsamplers.0.conv"),
                (
                    "middle_block.1.transformer_blocks.9.attn1.to_q",
                    "mid_block.attentions.0.transformer_blocks.9.attn1.to_q",
                ),
                // Up block 0 is level 2, which has attention: its upsampler comes after it.
                ("output_blocks.2.2.conv", "up_blocks.0.upsamplers.0.conv"),
                ("output_blocks.5.2.conv", "up_blocks.1.upsamplers.0.conv"),
                (
                    "output_blocks.0.1.transformer_blocks.9.ff.net.2",
                    "up_blocks.0.attentions.0.transformer_blocks.9.ff.net.2",
                ),
                (
                    "output_blocks.8.0.skip_connection",
                    "up_blocks.2.resnets.2.conv_shortcut",
                ),
                ("label_emb.0.0", "add_embedding.linear_1"),
                ("label_emb.0.2", "add_embedding.linear_2"),
            ],
        );
        assert_unknown(
            &sdxl,
            UnetNaming::Ldm,
            &[
                "input_blocks.1.1.proj_in",  // level 0 has no attention
                "output_blocks.6.1.proj_in", // nor has up block 2
                "input_blocks.9.0.op",       // there are 9 input blocks
                "output_blocks.8.2.conv",    // the last up block has no upsampler
            ],
        );
    }

    #[test]
    fn pairs_are_one_to_one_and_as_many_as_the_blocks_need() {
        // SD1: 7 outer layers; 8 + 2 + 12 resnets of 6 layers; 6 + 1 + 9 attentions; 3 down- and
        // 3 upsamplers. SDXL: 7; 6 + 2 + 9 resnets; 4 + 1 + 6 attentions; 2 and 2.
        for (layout, count) in [(UnetLayout::sd1(), 161), (UnetLayout::sdxl(), 124)] {
            let pairs = layout.module_pairs();
            assert_eq!(pairs.len(), count, "{layout:?}");
            let ldm: HashSet<&str> = pairs.iter().map(|p| p.ldm.as_str()).collect();
            let diffusers: HashSet<&str> = pairs.iter().map(|p| p.diffusers.as_str()).collect();
            assert_eq!((ldm.len(), diffusers.len()), (count, count));
        }
    }

    fn detect_owned(paths: &[String]) -> Option<(UnetNaming, UnetLayout)> {
        UnetLayout::detect(paths.iter().map(String::as_str))
    }

    #[test]
    fn detects_sd1_and_sdxl_in_either_naming() {
        for layout in [UnetLayout::sd1(), UnetLayout::sdxl()] {
            for naming in [UnetNaming::Ldm, UnetNaming::Diffusers] {
                let mut paths = example_paths(&layout, naming);
                paths.push("some_other_model.blocks.0.fc".into());
                assert_eq!(detect_owned(&paths), Some((naming, layout.clone())));
                // Real models have a shortcut only where a resnet changes width.
                paths.retain(|p| !p.contains("skip_connection") && !p.contains("conv_shortcut"));
                assert_eq!(detect_owned(&paths), Some((naming, layout.clone())));
            }
        }
        assert_eq!(UnetLayout::sdxl().transformer_depth(), [0, 2, 10]);
        assert_eq!(UnetLayout::sd1().levels(), 4);
    }

    #[test]
    fn detection_declines_what_it_does_not_understand() {
        let sd1 = example_paths(&UnetLayout::sd1(), UnetNaming::Ldm);
        let sdxl = example_paths(&UnetLayout::sdxl(), UnetNaming::Ldm);
        let without = |paths: &[String], prefix: &str| -> Vec<String> {
            paths
                .iter()
                .filter(|p| !p.starts_with(prefix))
                .cloned()
                .collect()
        };
        let with = |paths: &[String], extra: &[&str]| -> Vec<String> {
            let mut p = paths.to_vec();
            p.extend(extra.iter().map(|s| s.to_string()));
            p
        };
        let huge = usize::MAX.to_string();
        let cases: Vec<(&str, Vec<String>)> = vec![
            ("nothing", vec![]),
            ("a missing block", without(&sd1, "output_blocks.4.")),
            ("a missing resnet", without(&sd1, "output_blocks.1.")),
            (
                "a missing downsampler",
                without(&sd1, "input_blocks.6.0.op"),
            ),
            ("no middle attention", without(&sd1, "middle_block.1.")),
            (
                "attention on level 3",
                with(&sd1, &["input_blocks.10.1.proj_in"]),
            ),
            (
                "an upsampler in the wrong slot",
                with(
                    &without(&sd1, "output_blocks.2.1.conv"),
                    &["output_blocks.2.2.conv"],
                ),
            ),
            (
                "one block one transformer short",
                without(&sdxl, "output_blocks.0.1.transformer_blocks.9."),
            ),
            (
                "an unknown resnet layer",
                with(&sd1, &["input_blocks.1.0.extra"]),
            ),
            (
                "both namings",
                with(&sd1, &["down_blocks.0.resnets.0.conv1"]),
            ),
            (
                "another architecture",
                vec![
                    "double_blocks.0.img_attn.qkv".into(),
                    "final_layer.linear".into(),
                ],
            ),
            (
                "absurd indices",
                vec![
                    "input_blocks.0.0".into(),
                    format!("input_blocks.{huge}.0.op"),
                    "input_blocks.99999999.0.in_layers.0".into(),
                    "middle_block.1.transformer_blocks.0.attn1.to_q".into(),
                ],
            ),
            (
                "absurd diffusers indices",
                vec![
                    format!("down_blocks.{huge}.resnets.0.conv1"),
                    format!("down_blocks.0.resnets.{huge}.conv1"),
                    "mid_block.attentions.0.transformer_blocks.0.attn1.to_q".into(),
                ],
            ),
        ];
        for (what, paths) in cases {
            assert_eq!(detect_owned(&paths), None, "{what}");
        }
    }
}
