//! The logic of the command-line tools, as library functions that the examples call and the
//! integration tests drive.
//!
//! [`merge_files`] (the `lora_merge` example) bakes LoRA-style patches into a checkpoint: it reads
//! the base model ([`Model::from_safetensors`]), maps each LoRA file onto the model's keys
//! ([`lora_file::load`]), adds the patches to a [`ModelPatcher`] at their strengths, merges
//! ([`ModelPatcher::patched_state_dict`]: patch math in f32, one rounding back to each weight's
//! storage dtype) and writes a safetensors file with exactly the base's tensor names and shapes.
//! Non-float tensors of the base (position ids and similar buffers, which a [`Model`] does not
//! load) are copied through byte for byte.
//!
//! With a target dtype every weight is rounded **once**, from its patched f32 value
//! ([`ModelPatcher::patched_weight_f32`]): nearest-even for f16/bf16, seeded stochastic rounding
//! ([`Rounding::stochastic_for`] the key) for fp8, the same rule the patcher uses for fp8 storage,
//! so a target equal to a weight's storage dtype gives the bits of a plain merge.
//!
//! Errors are [`Error`]s naming the flag or the file: [`Error::InvalidFlag`] and
//! [`Error::UnknownFlag`] for the command line, [`Error::File`] for unreadable or unwritable files
//! and for LoRA patches that do not fit the base. Nothing is written unless every step succeeded.
//!
//! Cost: the base, the LoRA files and the merged output are all held in host memory (about twice
//! the checkpoint plus the LoRAs); each patched weight costs one `[out × r] · [r × in]` matmul and
//! one add in f32.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;

use candle_core::Tensor;

use crate::error::{Error, Result};
use crate::float::{self, Dtype, Rounding};
use crate::patcher::{lora_file, ModelPatcher};
use crate::vram::DeviceId;
use crate::weights::{self, Model, SafetensorsOptions};

/// One LoRA file to merge and the strength it is merged at.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraInput {
    /// The LoRA safetensors file.
    pub path: PathBuf,
    /// Its strength; `None`: [`MergeConfig::strength`].
    pub strength: Option<f32>,
}

/// What [`merge_files`] does: the `lora_merge` command line, parsed.
#[derive(Debug, Clone, PartialEq)]
pub struct MergeConfig {
    /// The base checkpoint (`--model`).
    pub model: PathBuf,
    /// The LoRAs, applied in this order (`--lora PATH[:STRENGTH]`, repeatable, at least one).
    pub loras: Vec<LoraInput>,
    /// The strength of LoRAs without their own (`--strength`, default 1.0).
    pub strength: f32,
    /// The output dtype of every weight (`--dtype`); `None` (default): each weight's storage dtype.
    pub dtype: Option<Dtype>,
    /// The merged checkpoint to write (`--out`).
    pub out: PathBuf,
}

impl MergeConfig {
    /// The command-line usage text.
    pub const USAGE: &'static str = "\
usage: lora_merge --model BASE.safetensors --lora LORA.safetensors[:STRENGTH] [--lora ...]
                  [--strength S] [--dtype f32|f16|bf16|fp8_e4m3fn|fp8_e5m2] --out MERGED.safetensors

  --model PATH         base checkpoint (safetensors)
  --lora PATH[:S]      LoRA to merge, repeatable; `:S` overrides --strength for this file
  --strength S         strength of LoRAs without their own (default 1.0)
  --dtype D            convert every weight to D (default: keep each weight's storage dtype);
                       fp8 targets use seeded stochastic rounding
  --out PATH           merged checkpoint to write";

    /// Parses the command line (without the program name). Flags take their value as the next
    /// argument or after `=`.
    ///
    /// # Errors
    /// [`Error::InvalidFlag`] naming the flag for a missing required flag, a missing value, a
    /// repeated `--model`/`--out`/`--strength`/`--dtype`, a strength that is not a finite number,
    /// an unknown dtype; [`Error::UnknownFlag`] for anything else.
    pub fn from_args<S: AsRef<str>>(args: &[S]) -> Result<MergeConfig> {
        let mut model = None;
        let mut out = None;
        let mut strength = None;
        let mut dtype = None;
        let mut loras = Vec::new();
        let mut it = args.iter().map(|a| a.as_ref());
        while let Some(arg) = it.next() {
            let (flag, inline) = match arg.split_once('=') {
                Some((f, v)) if f.starts_with("--") => (f, Some(v)),
                _ => (arg, None),
            };
            if !matches!(
                flag,
                "--model" | "--lora" | "--strength" | "--dtype" | "--out"
            ) {
                return Err(Error::UnknownFlag {
                    flag: arg.to_string(),
                    suggestion: None,
                });
            }
            let value = match inline.or_else(|| it.next()) {
                Some(v) if !v.is_empty() => v,
                _ => return Err(invalid(flag, "needs a value")),
            };
            let once = |slot: bool| {
                if slot {
                    Err(invalid(flag, "given more than once"))
                } else {
                    Ok(())
                }
            };
            match flag {
                "--model" => {
                    once(model.is_some())?;
                    model = Some(PathBuf::from(value));
                }
                "--out" => {
                    once(out.is_some())?;
                    out = Some(PathBuf::from(value));
                }
                "--strength" => {
                    once(strength.is_some())?;
                    strength = Some(parse_strength(value).ok_or_else(|| {
                        invalid(flag, format!("`{value}` is not a finite number"))
                    })?);
                }
                "--dtype" => {
                    once(dtype.is_some())?;
                    dtype = Some(Dtype::from_str(value).map_err(|e| invalid(flag, e.to_string()))?);
                }
                _ => loras.push(parse_lora(value)?),
            }
        }
        let model = model.ok_or_else(|| invalid("--model", "is required (the base checkpoint)"))?;
        let out = out.ok_or_else(|| invalid("--out", "is required (the file to write)"))?;
        if loras.is_empty() {
            return Err(invalid("--lora", "is required (at least one LoRA file)"));
        }
        Ok(MergeConfig {
            model,
            loras,
            strength: strength.unwrap_or(1.0),
            dtype,
            out,
        })
    }
}

fn invalid(flag: &str, reason: impl Into<String>) -> Error {
    Error::InvalidFlag {
        flag: flag.to_string(),
        reason: reason.into(),
    }
}

fn parse_strength(s: &str) -> Option<f32> {
    s.trim().parse::<f32>().ok().filter(|v| v.is_finite())
}

/// `PATH` or `PATH:STRENGTH`. An existing file whose name contains `:` is taken whole.
fn parse_lora(value: &str) -> Result<LoraInput> {
    if Path::new(value).is_file() {
        return Ok(LoraInput {
            path: value.into(),
            strength: None,
        });
    }
    match value.rsplit_once(':') {
        Some((path, s)) if !path.is_empty() => {
            let strength = parse_strength(s).ok_or_else(|| {
                invalid(
                    "--lora",
                    format!(
                        "`{value}`: `{s}` after the last `:` is not a strength (a finite number)"
                    ),
                )
            })?;
            Ok(LoraInput {
                path: path.into(),
                strength: Some(strength),
            })
        }
        _ => Ok(LoraInput {
            path: value.into(),
            strength: None,
        }),
    }
}

/// What one LoRA contributed to a merge.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraMerged {
    /// The file.
    pub path: PathBuf,
    /// The strength it was merged at.
    pub strength: f32,
    /// The model keys it patched, in model order.
    pub patched_keys: Vec<String>,
    /// Its tensors that patched nothing ([`lora_file::LoraLoad::unmatched_lora_keys`]), sorted.
    pub ignored_lora_keys: Vec<String>,
}

/// What [`merge_files`] did.
#[derive(Debug, Clone, PartialEq)]
pub struct MergeReport {
    /// Per LoRA, in the order given.
    pub loras: Vec<LoraMerged>,
    /// Distinct model keys patched by any LoRA, in model order.
    pub patched_keys: Vec<String>,
    /// Tensors written (weights plus passed-through buffers).
    pub tensors_written: usize,
    /// Non-float base tensors copied through unchanged.
    pub passed_through: Vec<String>,
    /// The file written.
    pub out: PathBuf,
}

impl fmt::Display for MergeReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for l in &self.loras {
            writeln!(
                f,
                "{} (strength {}): {} keys patched, {} LoRA keys ignored",
                l.path.display(),
                l.strength,
                l.patched_keys.len(),
                l.ignored_lora_keys.len()
            )?;
            for k in &l.ignored_lora_keys {
                writeln!(f, "  ignored: {k}")?;
            }
        }
        if !self.passed_through.is_empty() {
            writeln!(
                f,
                "copied unchanged (not float weights): {}",
                self.passed_through.join(", ")
            )?;
        }
        write!(
            f,
            "{} keys patched; wrote {} tensors to {}",
            self.patched_keys.len(),
            self.tensors_written,
            self.out.display()
        )
    }
}

/// Merges the LoRAs of `config` into its base model and writes the result (see the
/// [module docs](self)).
///
/// # Errors
/// [`Error::InvalidFlag`] when `--out` names the base itself; [`Error::File`] naming the file when
/// a LoRA is missing or unreadable, when the base cannot be read, when a LoRA's patch does not fit
/// its weight, or when the output cannot be written; [`Error::Tensor`] when the patch math fails.
pub fn merge_files(config: &MergeConfig) -> Result<MergeReport> {
    // Cheap checks first: a typo in a LoRA path should not wait for a multi-GiB base to load.
    for l in &config.loras {
        if !l.path.is_file() {
            return Err(Error::File {
                path: l.path.clone(),
                reason: "LoRA file not found (--lora)".into(),
            });
        }
    }
    if let (Ok(a), Ok(b)) = (config.model.canonicalize(), config.out.canonicalize()) {
        if a == b {
            return Err(invalid(
                "--out",
                format!(
                    "`{}` is the base model; write elsewhere",
                    config.out.display()
                ),
            ));
        }
    }
    let name = config
        .model
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    let model = Arc::new(Model::from_safetensors(name, &[&config.model])?);
    let mut patcher = ModelPatcher::new(Arc::clone(&model), DeviceId::Cpu, DeviceId::Cpu);

    let mut loras = Vec::with_capacity(config.loras.len());
    for l in &config.loras {
        let strength = l.strength.unwrap_or(config.strength);
        let loaded = lora_file::load(l.path.as_path(), model.keys())?;
        patcher
            .add_patches(loaded.patches, strength, 1.0)
            .map_err(|e| Error::File {
                path: l.path.clone(),
                reason: format!("does not fit `{}`: {e}", config.model.display()),
            })?;
        loras.push(LoraMerged {
            path: l.path.clone(),
            strength,
            patched_keys: loaded.matched_model_keys,
            ignored_lora_keys: loaded.unmatched_lora_keys,
        });
    }

    let merged: Vec<(String, Tensor, Dtype)> = match config.dtype {
        None => patcher.patched_state_dict()?,
        Some(target) => model
            .slots()
            .iter()
            .map(|slot| {
                let key = slot.name();
                let t = if target == slot.dtype() {
                    patcher.patched_weight(key)?
                } else {
                    let rounding = if target.is_fp8() {
                        Rounding::stochastic_for(key)
                    } else {
                        Rounding::Nearest
                    };
                    float::from_f32(&patcher.patched_weight_f32(key)?, target, rounding)?
                };
                Ok((key.to_string(), t, target))
            })
            .collect::<Result<_>>()?,
    };
    let passed_through = model.skipped_tensors().to_vec();
    let raw = weights::read_raw_tensors(&config.model, &passed_through)?;
    weights::save_safetensors_with_raw(&config.out, &merged, &raw, &SafetensorsOptions::default())?;

    let patched_keys = model
        .keys()
        .filter(|k| !patcher.patches().get(k).is_empty())
        .map(str::to_string)
        .collect();
    Ok(MergeReport {
        loras,
        patched_keys,
        tensors_written: merged.len() + raw.len(),
        passed_through,
        out: config.out.clone(),
    })
}
