//! Splitting one model across devices by weight name: [`DeviceMap`] (docs/ARCHITECTURE.md §5.2).
//!
//! A map is a list of rules, each a weight-name prefix or a regex, mapping to a [`Target`]: a
//! device (the weight is resident there, within that device's budget, and the layer using it
//! computes there) or [`Target::Host`] (the weight always streams to the patcher's load device
//! at use, as transformers' `device_map` "cpu" and llama.cpp's `--override-tensor ...=CPU`).
//! The first rule that matches a name wins; names no rule matches stay on the load device.
//!
//! [`DeviceMap::auto`] is accelerate's `infer_auto_device_map`: the weights are grouped into
//! layers (by the name up to its first number, `model.layers.3.`, configurable with
//! [`AutoMapOptions::group_depth`]), the groups ordered as the model uses them (its recorded
//! forward order when complete, else the names' natural order, numbers compared as numbers), and
//! the devices filled in that order, each up to its share of the model (its budget's share of the
//! budgets) and never beyond its budget; what fits nowhere streams from the host. A group is never
//! split, so each device's bytes are within one group of its balanced share.
//!
//! A map is resolved once per patcher ([`crate::ModelPatcher::with_device_map`]) into a device per
//! weight; clones share the resolution, so a LoRA clone of a split model is split the same way
//! and its patched weights are built on their own devices.
//!
//! Complexity: resolving is O(weights × rules); `auto` is O(weights log weights).

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::size::ByteSize;
use crate::vram::DeviceId;

/// Where the weights a rule matches live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub enum Target {
    /// Resident on this device (within its budget), and computed there.
    Device(DeviceId),
    /// Never resident: streamed from host memory to the patcher's load device at every use.
    Host,
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Device(d) => write!(f, "{d}"),
            Target::Host => write!(f, "host"),
        }
    }
}

impl std::str::FromStr for Target {
    type Err = Error;
    /// `host` (also `cpu`, as llama.cpp spells it) or a device name (`cuda:1`, `sim:0`).
    fn from_str(s: &str) -> Result<Target> {
        match s {
            "host" | "cpu" | "CPU" => Ok(Target::Host),
            other => other.parse().map(Target::Device),
        }
    }
}

#[derive(Debug, Clone)]
enum Matcher {
    Prefix(String),
    Regex(regex::Regex),
}

impl Matcher {
    fn matches(&self, name: &str) -> bool {
        match self {
            // At a component boundary: `layers.1` takes `layers.1.w`, not `layers.10.w`.
            Matcher::Prefix(p) => {
                name.starts_with(p.as_str())
                    && (p.ends_with('.')
                        || name.len() == p.len()
                        || name[p.len()..].starts_with('.'))
            }
            Matcher::Regex(r) => r.is_match(name),
        }
    }
}

impl std::fmt::Display for Matcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Matcher::Prefix(p) => write!(f, "{p}*"),
            Matcher::Regex(r) => write!(f, "/{}/", r.as_str()),
        }
    }
}

/// Rules from weight names to devices: one model split by layer (see the module docs).
#[derive(Debug, Clone, Default)]
pub struct DeviceMap {
    rules: Vec<(Matcher, Target)>,
}

/// How [`DeviceMap::auto`] groups weights into layers kept together.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AutoMapOptions {
    /// Group by the first this many dot-separated components of a name instead of "up to and
    /// including the first number" (`None`, the default).
    pub group_depth: Option<usize>,
}

impl DeviceMap {
    /// An empty map: every weight on the load device.
    pub fn new() -> DeviceMap {
        DeviceMap::default()
    }

    /// Weights whose names start with `prefix` go to `target` (transformers' `device_map` keys:
    /// `"model.layers.12"` matches `model.layers.12.mlp.up_proj.weight`; a prefix that ends
    /// without a dot matches only at a component boundary, so `layers.1` does not take
    /// `layers.10`).
    pub fn prefix(mut self, prefix: &str, target: Target) -> DeviceMap {
        self.rules
            .push((Matcher::Prefix(prefix.to_string()), target));
        self
    }

    /// Weights whose names match `pattern` go to `target` (llama.cpp's `--override-tensor`).
    ///
    /// # Errors
    /// [`Error::BadDeviceMap`] naming the pattern when it is not a valid regex.
    pub fn regex(mut self, pattern: &str, target: Target) -> Result<DeviceMap> {
        let r = regex::Regex::new(pattern).map_err(|e| Error::BadDeviceMap {
            rule: pattern.to_string(),
            reason: format!("not a valid regex: {e}"),
        })?;
        self.rules.push((Matcher::Regex(r), target));
        Ok(self)
    }

    /// Parses `RULE=TARGET[,RULE=TARGET...]` (llama.cpp's `--override-tensor` spelling): a rule
    /// is a regex when it contains one of `^$*+?()[]{}|\`, else a name prefix; a target is
    /// `host`/`cpu` or a device (`sim:1`, `cuda:0`).
    ///
    /// # Errors
    /// [`Error::BadDeviceMap`] naming the bad rule and what is wrong with it.
    pub fn parse(spec: &str) -> Result<DeviceMap> {
        let mut map = DeviceMap::new();
        for rule in spec.split(',').map(str::trim).filter(|r| !r.is_empty()) {
            let (pattern, target) = rule.rsplit_once('=').ok_or_else(|| Error::BadDeviceMap {
                rule: rule.to_string(),
                reason: "not RULE=DEVICE (a weight name prefix or regex, `=`, then `host`, `cuda:N` or `sim:N`)".into(),
            })?;
            let target: Target = target.trim().parse().map_err(|_| Error::BadDeviceMap {
                rule: rule.to_string(),
                reason: format!(
                    "`{target}` is not a device (expected `host`, `cuda:N` or `sim:N`)"
                ),
            })?;
            let pattern = pattern.trim();
            map = if pattern.contains(|c: char| "^$*+?()[]{}|\\".contains(c)) {
                map.regex(pattern, target)?
            } else {
                map.prefix(pattern, target)
            };
        }
        Ok(map)
    }

    /// Where weight `name` goes, when a rule says so.
    pub fn target_of(&self, name: &str) -> Option<Target> {
        self.rules
            .iter()
            .find(|(m, _)| m.matches(name))
            .map(|(_, t)| *t)
    }

    /// Whether the map has no rules.
    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    /// The devices the rules name (not `host`), in first-mention order.
    pub fn devices(&self) -> Vec<DeviceId> {
        let mut out = Vec::new();
        for (_, t) in &self.rules {
            if let Target::Device(d) = t {
                if !out.contains(d) {
                    out.push(*d);
                }
            }
        }
        out
    }

    /// The rules as `RULE=TARGET` strings (for reports).
    pub fn describe(&self) -> Vec<String> {
        self.rules.iter().map(|(m, t)| format!("{m}={t}")).collect()
    }

    /// A map filling `budgets` (device and the bytes of weights it may hold, in fill order) with
    /// `patcher`'s weights by layer group, as the module docs say. Groups that fit no device go
    /// to [`Target::Host`].
    pub fn auto(
        patcher: &crate::ModelPatcher,
        budgets: &[(DeviceId, ByteSize)],
        options: AutoMapOptions,
    ) -> DeviceMap {
        let model = patcher.model();
        let names: Vec<&str> = model.slots().iter().map(|s| s.name()).collect();
        let sizes: Vec<ByteSize> = (0..model.len()).map(|i| patcher.resident_size(i)).collect();
        let (order, complete) = model.forward_order();
        let rank = complete.then(|| {
            let mut r = vec![usize::MAX; names.len()];
            for (pos, &i) in order.iter().enumerate() {
                if let Some(x) = r.get_mut(i) {
                    *x = (*x).min(pos);
                }
            }
            r
        });
        let groups = group_weights(&names, &sizes, rank.as_deref(), options);
        let assignment = fill(&groups.iter().map(|g| g.1).collect::<Vec<_>>(), budgets);
        let mut map = DeviceMap::new();
        for ((prefix, _), target) in groups.iter().zip(assignment) {
            map = map.prefix(prefix, target);
        }
        map
    }
}

/// The group key of a weight name: up to and including the first all-digit component
/// (`model.layers.3.`), else everything but the last component (`model.norm.`); with a depth,
/// the first `depth` components.
fn group_key(name: &str, options: AutoMapOptions) -> String {
    let parts: Vec<&str> = name.split('.').collect();
    let take = match options.group_depth {
        Some(d) => d.clamp(1, parts.len()),
        None => match parts
            .iter()
            .position(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
        {
            Some(i) if i + 1 < parts.len() => i + 1,
            _ => parts.len().saturating_sub(1).max(1),
        },
    };
    if take >= parts.len() {
        return name.to_string();
    }
    let mut key = parts[..take].join(".");
    key.push('.');
    key
}

/// The layer a weight belongs to, as [`DeviceMap::auto`] groups weights: its name up to and
/// including the first all-digit component (`blk.3` of `blk.3.ffn_gate_exps.5.weight`), else
/// all but the last component (`output_norm`).
pub(crate) fn layer_of(name: &str) -> String {
    let mut key = group_key(name, AutoMapOptions::default());
    if key.ends_with('.') {
        key.pop();
    }
    key
}

/// Natural order of names: digit runs compare as numbers.
fn natural_key(s: &str) -> Vec<(u8, u128, String)> {
    let mut out = Vec::new();
    let mut rest = s;
    while !rest.is_empty() {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits > 0 {
            let n = rest[..digits].parse::<u128>().unwrap_or(u128::MAX);
            out.push((0, n, String::new()));
            rest = &rest[digits..];
        } else {
            let text = rest.bytes().take_while(|b| !b.is_ascii_digit()).count();
            out.push((1, 0, rest[..text].to_string()));
            rest = &rest[text..];
        }
    }
    out
}

/// The layer groups of a model with their bytes, in use order: by `rank` (first forward use)
/// when given, else by the names' natural order.
fn group_weights(
    names: &[&str],
    sizes: &[ByteSize],
    rank: Option<&[usize]>,
    options: AutoMapOptions,
) -> Vec<(String, ByteSize)> {
    let mut groups: std::collections::HashMap<String, (ByteSize, usize)> =
        std::collections::HashMap::new();
    for (i, name) in names.iter().enumerate() {
        let key = group_key(name, options);
        let r = rank.map_or(usize::MAX, |r| r[i]);
        let e = groups.entry(key).or_insert((ByteSize::ZERO, usize::MAX));
        e.0 = e.0.saturating_add(sizes[i]);
        e.1 = e.1.min(r);
    }
    let mut out: Vec<(String, ByteSize, usize)> =
        groups.into_iter().map(|(k, (b, r))| (k, b, r)).collect();
    out.sort_by_cached_key(|(k, _, r)| (*r, natural_key(k)));
    out.into_iter().map(|(k, b, _)| (k, b)).collect()
}

/// Assigns groups of `sizes`, in order, to `budgets`' devices: device `j` takes groups while the
/// running total stays within its budget and the group's midpoint is within the cumulative
/// balanced share of devices `0..=j` (the budgets' shares of the model, or the budgets
/// themselves when the model is larger than them all). The rest go to the host.
pub(crate) fn fill(sizes: &[ByteSize], budgets: &[(DeviceId, ByteSize)]) -> Vec<Target> {
    // Groups larger than every device never take a share.
    let largest_budget = budgets.iter().map(|b| b.1).max().unwrap_or(ByteSize::ZERO);
    let total: f64 = sizes
        .iter()
        .filter(|s| **s <= largest_budget)
        .map(|s| s.as_f64())
        .sum();
    let capacity: f64 = budgets.iter().map(|b| b.1.as_f64()).sum();
    let scale = if capacity > total && capacity > 0.0 {
        total / capacity
    } else {
        1.0
    };
    let mut out = Vec::with_capacity(sizes.len());
    let mut j = 0usize;
    let mut used = ByteSize::ZERO;
    let mut before = 0.0f64; // bytes placed on devices before `j`
    let mut cum_share = budgets.first().map_or(0.0, |b| b.1.as_f64() * scale);
    for &size in sizes {
        // A group larger than every device still to fill streams from the host, and uses up
        // none of them.
        let fits_somewhere = budgets[j.min(budgets.len())..]
            .iter()
            .enumerate()
            .any(|(k, b)| {
                size <= if k == 0 {
                    b.1.saturating_sub(used)
                } else {
                    b.1
                }
            });
        if !fits_somewhere {
            out.push(Target::Host);
            continue;
        }
        let mut placed = None;
        while j < budgets.len() {
            let placed_so_far = before + used.as_f64();
            let within_share =
                j + 1 == budgets.len() || placed_so_far + size.as_f64() / 2.0 <= cum_share;
            if within_share && used.saturating_add(size) <= budgets[j].1 {
                used = used.saturating_add(size);
                placed = Some(Target::Device(budgets[j].0));
                break;
            }
            before += used.as_f64();
            used = ByteSize::ZERO;
            j += 1;
            if let Some(b) = budgets.get(j) {
                cum_share += b.1.as_f64() * scale;
            }
        }
        out.push(placed.unwrap_or(Target::Host));
    }
    out
}

/// Activation traffic of a split model's forwards (shared by a patcher and its clones).
#[derive(Debug, Default)]
pub struct ActivationMoves {
    bytes: std::sync::atomic::AtomicU64,
    moves: std::sync::atomic::AtomicU64,
    devices: std::sync::OnceLock<crate::device::Devices>,
}

impl ActivationMoves {
    pub(crate) fn note(&self, bytes: u64) {
        self.bytes
            .fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
        self.moves
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Tells the placement which simulated GPUs its devices are (the manager does at load).
    pub(crate) fn set_devices(&self, devices: &crate::device::Devices) {
        let _ = self.devices.set(devices.clone());
    }

    /// The simulated or CUDA GPU behind `device`, when the manager told this placement.
    pub(crate) fn gpu(&self, device: DeviceId) -> Option<crate::device::Gpu> {
        self.devices.get().and_then(|d| d.gpu(device))
    }

    pub(crate) fn snapshot(&self) -> SplitStats {
        SplitStats {
            activation_bytes: ByteSize(self.bytes.load(std::sync::atomic::Ordering::Relaxed)),
            activation_moves: self.moves.load(std::sync::atomic::Ordering::Relaxed),
        }
    }
}

/// What a split model's forwards moved between devices so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct SplitStats {
    /// Bytes of activations copied between devices.
    pub activation_bytes: ByteSize,
    /// How many copies.
    pub activation_moves: u64,
}

/// A map resolved against one model: the target of every weight, shared by a patcher and its
/// clones, with the activation traffic of split forwards.
#[derive(Debug)]
pub(crate) struct Placement {
    pub(crate) map: DeviceMap,
    /// Per weight: its target (`None`: the load device).
    pub(crate) targets: Box<[Option<Target>]>,
    pub(crate) id: u64,
    pub(crate) moves: ActivationMoves,
}

static NEXT_PLACEMENT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl Placement {
    pub(crate) fn resolve(map: DeviceMap, model: &crate::weights::Model) -> Arc<Placement> {
        let targets = model
            .slots()
            .iter()
            .map(|s| map.target_of(s.name()))
            .collect();
        Arc::new(Placement {
            map,
            targets,
            id: NEXT_PLACEMENT.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            moves: ActivationMoves::default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: DeviceId = DeviceId::Sim(0);
    const B: DeviceId = DeviceId::Sim(1);

    #[test]
    fn prefix_rules_match_at_component_boundaries_and_first_rule_wins() {
        let map = DeviceMap::new()
            .prefix("layers.1", Target::Device(B))
            .prefix("layers.", Target::Device(A));
        assert_eq!(map.target_of("layers.1.w"), Some(Target::Device(B)));
        assert_eq!(map.target_of("layers.10.w"), Some(Target::Device(A)));
        assert_eq!(map.target_of("head.w"), None);
    }

    #[test]
    fn parse_reads_prefixes_regexes_and_host() {
        let map = DeviceMap::parse("blk\\.[0-3]\\.=sim:1, output=host,token_embd=sim:0").unwrap();
        assert_eq!(
            map.target_of("blk.2.attn_q.weight"),
            Some(Target::Device(B))
        );
        assert_eq!(map.target_of("blk.4.attn_q.weight"), None);
        assert_eq!(map.target_of("output.weight"), Some(Target::Host));
        assert_eq!(map.target_of("token_embd.weight"), Some(Target::Device(A)));
        assert_eq!(map.devices(), vec![B, A]);
    }

    #[test]
    fn parse_names_what_is_wrong() {
        let e = DeviceMap::parse("layers.0=gpu7").unwrap_err().to_string();
        assert!(e.contains("gpu7"), "{e}");
        let e = DeviceMap::parse("(=sim:0").unwrap_err().to_string();
        assert!(e.contains("not a valid regex"), "{e}");
        let e = DeviceMap::parse("layers.0").unwrap_err().to_string();
        assert!(e.contains("RULE=DEVICE"), "{e}");
    }

    #[test]
    fn groups_are_layers_in_natural_order() {
        let names = [
            "model.layers.10.mlp.weight",
            "lm_head.weight",
            "model.layers.2.attn.weight",
            "model.layers.2.mlp.weight",
            "model.embed.weight",
        ];
        let sizes = [ByteSize(1); 5];
        let g = group_weights(&names, &sizes, None, AutoMapOptions::default());
        let keys: Vec<&str> = g.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            keys,
            [
                "lm_head.",
                "model.embed.",
                "model.layers.2.",
                "model.layers.10."
            ]
        );
        assert_eq!(g[2].1, ByteSize(2));
        // The recorded forward order wins over names.
        let rank = [3, 4, 1, 2, 0];
        let g = group_weights(&names, &sizes, Some(&rank), AutoMapOptions::default());
        assert_eq!(g[0].0, "model.embed.");
        assert_eq!(g[3].0, "lm_head.");
        let g = group_weights(
            &names,
            &sizes,
            None,
            AutoMapOptions {
                group_depth: Some(1),
            },
        );
        assert_eq!(g.len(), 2);
    }

    #[test]
    fn fill_never_exceeds_a_budget_and_balances_within_one_group() {
        // Property over many shapes: every device within budget; with room for everything,
        // each device's bytes within one (largest) group of its proportional share.
        let mut seed = 7u64;
        let mut next = |m: u64| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) % m
        };
        for _ in 0..5000 {
            let n = 1 + next(40) as usize;
            let sizes: Vec<ByteSize> = (0..n).map(|_| ByteSize(1 + next(1000))).collect();
            let devices = 1 + next(4) as usize;
            let budgets: Vec<(DeviceId, ByteSize)> = (0..devices)
                .map(|d| (DeviceId::Sim(d), ByteSize(1 + next(8000))))
                .collect();
            let out = fill(&sizes, &budgets);
            let largest = sizes
                .iter()
                .max()
                .copied()
                .unwrap_or(ByteSize::ZERO)
                .as_f64();
            let total: f64 = sizes.iter().map(|s| s.as_f64()).sum();
            let capacity: f64 = budgets.iter().map(|b| b.1.as_f64()).sum();
            for (d, budget) in &budgets {
                let on: u64 = sizes
                    .iter()
                    .zip(&out)
                    .filter(|(_, t)| **t == Target::Device(*d))
                    .map(|(s, _)| s.bytes())
                    .sum();
                assert!(on <= budget.bytes(), "{d} holds {on} > {budget:?}");
                if capacity >= total + largest * devices as f64 {
                    let share = total * budget.as_f64() / capacity;
                    assert!(
                        (on as f64 - share).abs() <= largest,
                        "{d}: {on} vs share {share} (largest group {largest})"
                    );
                }
            }
            // Order is kept: device indices never go back.
            let mut last = 0usize;
            for t in &out {
                if let Target::Device(DeviceId::Sim(d)) = t {
                    assert!(*d >= last);
                    last = *d;
                }
            }
        }
    }

    #[test]
    fn what_fits_nowhere_streams_from_the_host() {
        let sizes = [ByteSize(60), ByteSize(60), ByteSize(60)];
        let out = fill(&sizes, &[(A, ByteSize(100)), (B, ByteSize(70))]);
        assert_eq!(out, [Target::Device(A), Target::Device(B), Target::Host]);
    }

    #[test]
    fn a_group_too_large_for_every_device_streams_and_the_rest_still_fill_them() {
        // MiniLM's word embeddings are larger than any third of the model: they stream, the
        // layers after them are still placed (found by the MiniLM split test).
        let sizes = [
            ByteSize(5),
            ByteSize(500),
            ByteSize(40),
            ByteSize(40),
            ByteSize(40),
        ];
        let out = fill(&sizes, &[(A, ByteSize(80)), (B, ByteSize(80))]);
        assert_eq!(out[1], Target::Host);
        assert!(
            out.iter().filter(|t| **t != Target::Host).count() == 4,
            "{out:?}"
        );
    }
}
