//! Grouping a LoRA file's tensors by base name (the name without its part suffix) and turning each
//! group into the patches it describes; the suffix table and the group rules are in the
//! [`lora_file`](super) docs.

use std::collections::{BTreeMap, HashMap};

use candle_core::{DType, Tensor};

use crate::patcher::adapters::{Boft, GLora, LoHa, LoKr, Lora, Oft, Patch};

/// The part of a patch a file tensor holds, named by its suffix ([`SUFFIXES`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(super) enum PartKind {
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
    // PEFT saved with its adapter name (Qwen-Image trainers).
    (".lora_B.default.weight", PartKind::Up, false),
    (".lora_A.default.weight", PartKind::Down, false),
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

/// XLabs' Flux LoRA modules (`double_blocks.N.processor.qkv_lora1.up.weight`): their `up` /
/// `down` parts keep the whole `processor.…` base name, which the Flux table (`dit/flux.rs`) maps
/// onto the fused native weights. Checked before [`SUFFIXES`], whose old-diffusers processor
/// form would otherwise take a single block's `qkv_lora.up.weight` apart.
const XLABS_MODULES: &[&str] = &[
    ".processor.qkv_lora1",
    ".processor.qkv_lora2",
    ".processor.proj_lora1",
    ".processor.proj_lora2",
    ".processor.qkv_lora",
    ".processor.proj_lora",
];

/// Splits a file tensor name into its base name and part.
fn split_part(name: &str) -> Option<(String, PartKind)> {
    for (suffix, kind) in [
        (".up.weight", PartKind::Up),
        (".down.weight", PartKind::Down),
    ] {
        if let Some(base) = name.strip_suffix(suffix) {
            if XLABS_MODULES.iter().any(|m| base.ends_with(m)) {
                return Some((base.to_string(), kind));
            }
        }
    }
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

/// The parts of one base name, by kind: `(file tensor name, tensor)`.
#[derive(Default)]
pub(super) struct Group {
    pub(super) parts: BTreeMap<PartKind, (String, Tensor)>,
}

impl Group {
    fn take(&mut self, kind: PartKind) -> Option<Tensor> {
        self.parts.remove(&kind).map(|(_, t)| t)
    }

    fn has(&self, kinds: &[PartKind]) -> bool {
        kinds.iter().any(|k| self.parts.contains_key(k))
    }

    /// Takes every one of `kinds`, or none when one is missing.
    fn take_all<const N: usize>(&mut self, kinds: [PartKind; N]) -> Option<[Tensor; N]> {
        if !kinds.iter().all(|k| self.parts.contains_key(k)) {
            return None;
        }
        Some(kinds.map(|k| self.take(k).expect("checked present")))
    }

    pub(super) fn names(&self) -> impl Iterator<Item = &String> {
        self.parts.values().map(|(n, _)| n)
    }
}

/// Refuses a group whose `.alpha` is not one finite number (a file that carries a vector there
/// was not written for this adapter; using its first element would silently change the result).
///
/// Errors: [`Error::BadPatch`] naming the file tensor.
pub(super) fn check_alpha(group: &Group) -> crate::error::Result<()> {
    let Some((name, t)) = group.parts.get(&PartKind::Alpha) else {
        return Ok(());
    };
    let bad = |reason: String| crate::error::Error::BadPatch {
        key: name.clone(),
        reason,
    };
    if t.elem_count() != 1 {
        return Err(bad(format!(
            "alpha has shape {:?} ({} values); it must be a single number",
            t.dims(),
            t.elem_count()
        )));
    }
    let v = scalar(t).map_err(bad)?;
    if !v.is_finite() {
        return Err(bad(format!("alpha {v} is not a finite number")));
    }
    Ok(())
}

/// Groups file tensors by base name. Returns the groups and the names of the tensors no group
/// takes (an unknown suffix, or a second name for a part a group already has).
pub(super) fn group_by_base(
    tensors: HashMap<String, Tensor>,
) -> (BTreeMap<String, Group>, Vec<String>) {
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

    (groups, unmatched)
}

/// The patch kinds a group can hold, each recognised by any one of its parts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Lora,
    LoHa,
    LoKr,
    Diff,
    GLora,
    Oft,
}

const KINDS: &[(Kind, &[PartKind])] = &[
    (Kind::Lora, &[PartKind::Up, PartKind::Down, PartKind::Mid]),
    (
        Kind::LoHa,
        &[
            PartKind::HadaW1a,
            PartKind::HadaW1b,
            PartKind::HadaW2a,
            PartKind::HadaW2b,
            PartKind::HadaT1,
            PartKind::HadaT2,
        ],
    ),
    (
        Kind::LoKr,
        &[
            PartKind::LokrW1,
            PartKind::LokrW1a,
            PartKind::LokrW1b,
            PartKind::LokrW2,
            PartKind::LokrW2a,
            PartKind::LokrW2b,
            PartKind::LokrT2,
        ],
    ),
    (Kind::Diff, &[PartKind::Diff]),
    (
        Kind::GLora,
        &[
            PartKind::GloraA1,
            PartKind::GloraA2,
            PartKind::GloraB1,
            PartKind::GloraB2,
            PartKind::GloraBm,
        ],
    ),
    (Kind::Oft, &[PartKind::OftBlocks, PartKind::OftRescale]),
];

/// Why a group is malformed (its tensors are then all reported unmatched).
type GroupResult<T> = std::result::Result<T, String>;

/// The patches a group yields: `(on the weight, on the bias)`; used parts are removed from the
/// group, so what remains is unused.
pub(super) fn group_patches(group: &mut Group) -> GroupResult<(Option<Patch>, Option<Patch>)> {
    let mut kinds = KINDS
        .iter()
        .filter(|(_, parts)| group.has(parts))
        .map(|&(kind, _)| kind);
    let kind = kinds.next();
    if kinds.next().is_some() {
        return Err("mixes several patch kinds".into());
    }
    let alpha = match group.parts.get(&PartKind::Alpha) {
        Some((_, t)) => Some(scalar(t)?),
        None => None,
    };
    let weight = match kind {
        Some(Kind::Lora) => Some(lora(group, alpha)?),
        Some(Kind::LoHa) => Some(loha(group, alpha)?),
        Some(Kind::LoKr) => Some(lokr(group, alpha)?),
        Some(Kind::GLora) => Some(glora(group, alpha)?),
        Some(Kind::Oft) => Some(oft(group, alpha)?),
        Some(Kind::Diff) | None => group
            .take(PartKind::Diff)
            .map(|diff| Patch::Diff { diff, pad: false }),
    };
    // An adapter consumes the alpha; a diff has none.
    if kind.is_some_and(|k| k != Kind::Diff) {
        group.parts.remove(&PartKind::Alpha);
    }
    let bias = group
        .take(PartKind::DiffB)
        .map(|diff| Patch::Diff { diff, pad: false });
    Ok((weight, bias))
}

fn lora(group: &mut Group, alpha: Option<f32>) -> GroupResult<Patch> {
    let Some([up, down]) = group.take_all([PartKind::Up, PartKind::Down]) else {
        return Err("has only one of the LoRA up and down tensors".into());
    };
    Ok(Patch::Lora(Lora {
        up,
        down,
        alpha,
        mid: group.take(PartKind::Mid),
        dora_scale: group.take(PartKind::DoraScale),
    }))
}

fn loha(group: &mut Group, alpha: Option<f32>) -> GroupResult<Patch> {
    let parts = [
        PartKind::HadaW1a,
        PartKind::HadaW1b,
        PartKind::HadaW2a,
        PartKind::HadaW2b,
    ];
    let Some([w1a, w1b, w2a, w2b]) = group.take_all(parts) else {
        return Err("lacks one of hada_w1_a, hada_w1_b, hada_w2_a, hada_w2_b".into());
    };
    Ok(Patch::LoHa(LoHa {
        w1a,
        w1b,
        w2a,
        w2b,
        t1: group.take(PartKind::HadaT1),
        t2: group.take(PartKind::HadaT2),
        alpha,
        dora_scale: group.take(PartKind::DoraScale),
    }))
}

fn lokr(group: &mut Group, alpha: Option<f32>) -> GroupResult<Patch> {
    let has = |k| group.parts.contains_key(&k);
    let w1_ok = has(PartKind::LokrW1) || (has(PartKind::LokrW1a) && has(PartKind::LokrW1b));
    let w2_ok = has(PartKind::LokrW2) || (has(PartKind::LokrW2a) && has(PartKind::LokrW2b));
    if !(w1_ok && w2_ok) {
        return Err(
            "needs lokr_w1 (or lokr_w1_a and lokr_w1_b) and lokr_w2 (or lokr_w2_a and lokr_w2_b)"
                .into(),
        );
    }
    Ok(Patch::LoKr(LoKr {
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
}

fn glora(group: &mut Group, alpha: Option<f32>) -> GroupResult<Patch> {
    if group.parts.contains_key(&PartKind::GloraBm) {
        return Err("is a Tucker GLoRA (bm), which is not supported".into());
    }
    let parts = [
        PartKind::GloraA1,
        PartKind::GloraA2,
        PartKind::GloraB1,
        PartKind::GloraB2,
    ];
    let Some([a1, a2, b1, b2]) = group.take_all(parts) else {
        return Err("lacks one of the GLoRA a1, a2, b1, b2 weights".into());
    };
    Ok(Patch::GLora(GLora {
        a1,
        a2,
        b1,
        b2,
        alpha,
        dora_scale: group.take(PartKind::DoraScale),
    }))
}

fn oft(group: &mut Group, alpha: Option<f32>) -> GroupResult<Patch> {
    if group.parts.contains_key(&PartKind::DoraScale) {
        return Err("is an OFT with a dora_scale, which is not supported".into());
    }
    let Some(blocks) = group.take(PartKind::OftBlocks) else {
        return Err("lacks oft_blocks".into());
    };
    let rescale = group.take(PartKind::OftRescale);
    match blocks.rank() {
        3 if rescale.is_some() => Err(
            "is a rescaled diag-OFT (3-D oft_blocks with rescale), which is not supported".into(),
        ),
        3 => Ok(Patch::Oft(Oft { blocks, alpha })),
        4 => Ok(Patch::Boft(Boft {
            blocks,
            rescale,
            alpha,
        })),
        r => Err(format!(
            "has {r}-D oft_blocks; OFT blocks are [k, n, n], BOFT's [m, k, b, b]"
        )),
    }
}

fn scalar(t: &Tensor) -> GroupResult<f32> {
    if t.elem_count() != 1 {
        return Err(format!(
            "alpha has shape {:?} ({} values); it must be a single number",
            t.dims(),
            t.elem_count()
        ));
    }
    t.to_dtype(DType::F32)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f32>())
        .map_err(|e| format!("alpha is unreadable: {e}"))?
        .first()
        .copied()
        .ok_or_else(|| "alpha is empty".to_string())
}
