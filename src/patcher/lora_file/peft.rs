//! PEFT's `adapter_config.json`: the scale of a PEFT LoRA saved without `.alpha` tensors.
//!
//! PEFT scales a LoRA by `lora_alpha / r` (by `lora_alpha / √r` with `use_rslora`), and keeps
//! those numbers in the config beside the weights, not in the file. The file's `.lora_A` rank is
//! `r` (or its `rank_pattern` entry), so the scale is given to the patch as an alpha:
//! `lora_alpha` (or its `alpha_pattern` entry), times `√r` under rsLoRA, so that the patch's
//! `alpha / rank` is PEFT's scale. A group that carries its own `.alpha` keeps it.
//!
//! `alpha_pattern` is PEFT's: each key is a regular expression a module's name matches as
//! `re.match(rf"(.*\.)?({key})$", name)` (the whole name, or a trailing run of its dot-separated
//! parts), tried in the file's order, the first match giving the alpha. The name is the module's
//! in the base model: the file's `base_model.model.` prefix is not part of it. A key that is no
//! regular expression (Rust's `regex` has no look-around or back-references) is an error, found
//! before anything is loaded. `rank_pattern` needs no reading: the rank it set is the file's
//! `lora_A` rank, which is what the scale divides by.

mod key_order;

use std::collections::HashMap;
use std::path::Path;

use candle_core::Tensor;
use regex::Regex;

use crate::error::{Error, Result};

/// The file PEFT writes beside `adapter_model.safetensors`.
pub(crate) const CONFIG_NAME: &str = "adapter_config.json";

/// The prefix PEFT's `PeftModel` puts before a module's name in the file it saves.
const PEFT_PREFIX: &str = "base_model.model.";

/// The scale numbers of a PEFT config.
#[derive(Debug, Clone)]
pub(crate) struct PeftScale {
    lora_alpha: f64,
    use_rslora: bool,
    /// PEFT's `alpha_pattern` in the file's order: each key's expression as PEFT matches it,
    /// and its alpha.
    alpha_pattern: Vec<(Regex, f64)>,
}

impl PeftScale {
    /// Reads `adapter_config.json` beside `lora_file`, if there is one.
    ///
    /// # Errors
    /// [`Error::File`] naming the config when it exists but cannot be read, is not JSON, has no
    /// numeric `lora_alpha`, or has an `alpha_pattern` entry that is not a number or whose key is
    /// not a regular expression (naming the key).
    pub(crate) fn beside(lora_file: &Path) -> Result<Option<PeftScale>> {
        let Some(path) = lora_file.parent().map(|d| d.join(CONFIG_NAME)) else {
            return Ok(None);
        };
        if !path.is_file() {
            return Ok(None);
        }
        let bad = |reason: String| Error::File {
            path: path.clone(),
            reason,
        };
        let text = std::fs::read_to_string(&path).map_err(|e| bad(format!("cannot read: {e}")))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
        let lora_alpha = json
            .get("lora_alpha")
            .and_then(serde_json::Value::as_f64)
            .filter(|a| a.is_finite())
            .ok_or_else(|| bad("no numeric `lora_alpha` (PEFT writes one)".into()))?;
        let use_rslora = json
            .get("use_rslora")
            .and_then(serde_json::Value::as_bool)
            .unwrap_or(false);
        let alpha_pattern = match json
            .get("alpha_pattern")
            .and_then(serde_json::Value::as_object)
        {
            None => Vec::new(),
            Some(alphas) => {
                // `Value` sorts the keys; PEFT's first match is in the file's order.
                let keys = key_order::object_keys(&text, "alpha_pattern")
                    .ok()
                    .flatten()
                    .filter(|keys| keys.len() == alphas.len())
                    .ok_or_else(|| bad("cannot read the order of `alpha_pattern`".into()))?;
                let mut pattern = Vec::with_capacity(keys.len());
                for key in keys {
                    let alpha = alphas
                        .get(&key)
                        .and_then(serde_json::Value::as_f64)
                        .filter(|a| a.is_finite())
                        .ok_or_else(|| bad(format!("`alpha_pattern` `{key}` is not a number")))?;
                    let re = Regex::new(&format!(r"^(?:.*\.)?(?:{key})$")).map_err(|e| {
                        bad(format!(
                            "`alpha_pattern` key `{key}` is not a regular expression: {e}"
                        ))
                    })?;
                    pattern.push((re, alpha));
                }
                pattern
            }
        };
        Ok(Some(PeftScale {
            lora_alpha,
            use_rslora,
            alpha_pattern,
        }))
    }

    /// The alpha for the module `base` (a name in the file) whose down projection has rank
    /// `rank`.
    fn alpha_for(&self, base: &str, rank: usize) -> f64 {
        let name = base.strip_prefix(PEFT_PREFIX).unwrap_or(base);
        let alpha = self
            .alpha_pattern
            .iter()
            .find(|(re, _)| re.is_match(name))
            .map_or(self.lora_alpha, |(_, a)| *a);
        if self.use_rslora {
            alpha * (rank as f64).sqrt()
        } else {
            alpha
        }
    }

    /// Adds a `.alpha` to every PEFT group of `tensors` (`<base>.lora_A.weight`, or
    /// `<base>.lora_A.default.weight` saved with the adapter's name) that has none.
    /// Returns how many were added.
    pub(crate) fn add_alphas(&self, tensors: &mut HashMap<String, Tensor>) -> Result<usize> {
        let bases: Vec<(String, usize)> = tensors
            .iter()
            .filter_map(|(name, t)| {
                let base = name
                    .strip_suffix(".lora_A.weight")
                    .or_else(|| name.strip_suffix(".lora_A.default.weight"))?;
                let rank = *t.dims().first()?;
                Some((base.to_string(), rank))
            })
            .collect();
        let mut added = 0;
        for (base, rank) in bases {
            let key = format!("{base}.alpha");
            if tensors.contains_key(&key) {
                continue;
            }
            let alpha = self.alpha_for(&base, rank) as f32;
            let t = Tensor::new(alpha, &candle_core::Device::Cpu)
                .map_err(|e| Error::tensor(format!("PEFT alpha of `{base}`"), e))?;
            tensors.insert(key, t);
            added += 1;
        }
        Ok(added)
    }
}
