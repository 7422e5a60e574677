//! PEFT's `adapter_config.json`: the scale of a PEFT LoRA saved without `.alpha` tensors.
//!
//! PEFT scales a LoRA by `lora_alpha / r` (by `lora_alpha / √r` with `use_rslora`), and keeps
//! those numbers in the config beside the weights, not in the file. The file's `.lora_A` rank is
//! `r` (or its `rank_pattern` entry), so the scale is given to the patch as an alpha:
//! `lora_alpha` (or its `alpha_pattern` entry), times `√r` under rsLoRA, so that the patch's
//! `alpha / rank` is PEFT's scale. A group that carries its own `.alpha` keeps it.

use std::collections::HashMap;
use std::path::Path;

use candle_core::Tensor;

use crate::error::{Error, Result};

/// The file PEFT writes beside `adapter_model.safetensors`.
pub(crate) const CONFIG_NAME: &str = "adapter_config.json";

/// The scale numbers of a PEFT config.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PeftScale {
    lora_alpha: f64,
    use_rslora: bool,
    /// Module-name suffix → alpha (PEFT's `alpha_pattern`).
    alpha_pattern: Vec<(String, f64)>,
}

impl PeftScale {
    /// Reads `adapter_config.json` beside `lora_file`, if there is one.
    ///
    /// # Errors
    /// [`Error::File`] naming the config when it exists but cannot be read, is not JSON, or has
    /// no numeric `lora_alpha`.
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
        let alpha_pattern = json
            .get("alpha_pattern")
            .and_then(serde_json::Value::as_object)
            .map(|m| {
                m.iter()
                    .filter_map(|(k, v)| v.as_f64().map(|a| (k.clone(), a)))
                    .collect()
            })
            .unwrap_or_default();
        Ok(Some(PeftScale {
            lora_alpha,
            use_rslora,
            alpha_pattern,
        }))
    }

    /// The alpha for the module `base` whose down projection has rank `rank`.
    fn alpha_for(&self, base: &str, rank: usize) -> f64 {
        let alpha = self
            .alpha_pattern
            .iter()
            .find(|(k, _)| base == k || base.ends_with(&format!(".{k}")))
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
