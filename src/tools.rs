//! The logic of the command-line tools, as library functions that the examples call and the
//! integration tests drive.
//!
//! [`merge_files`] (the `lora_merge` example) bakes LoRA-style patches into a checkpoint: it maps
//! each LoRA file onto the base model's keys ([`lora_file::load`]), adds the patches to a
//! [`ModelPatcher`] at their strengths, and writes a safetensors file with exactly the base's
//! tensor names and shapes whose weights are what [`ModelPatcher::patched_state_dict`] gives for
//! the model [`Model::from_safetensors`] reads (patch math in f32, one rounding back to each
//! weight's storage dtype), one weight at a time (see [Streaming](#streaming)). Non-float tensors
//! of the base (position ids and similar buffers, which a [`Model`] does not load) are copied
//! through byte for byte.
//!
//! With a target dtype every weight is rounded **once**, from its patched f32 value
//! ([`ModelPatcher::patched_weight_f32`]): nearest-even for f16/bf16, seeded stochastic rounding
//! ([`Rounding::stochastic_for`] the key) for fp8, the same rule the patcher uses for fp8 storage,
//! so a target equal to a weight's storage dtype gives the bits of a plain merge.
//!
//! Errors are [`Error`]s naming the flag or the file: [`Error::InvalidFlag`] and
//! [`Error::UnknownFlag`] for the command line, [`Error::File`] for unreadable or unwritable files
//! and for LoRA patches that do not fit the base. Nothing is written unless every step succeeded:
//! the output is written under a temporary name and renamed into place at the end.
//!
//! # Streaming
//!
//! The merge works tensor by tensor. Only the base's header is read up front; the model the
//! LoRAs are mapped onto and validated against holds one-element stand-ins for the weights
//! (shapes and dtypes are all the patch rules look at), so every patch is checked before anything
//! is written. Then the output file is sized once and each tensor is written at its final offset
//! (`weights::save_safetensors_streaming`: the header is safetensors' own serializer's, the order
//! its order). A weight is read from the base with a positioned read straight into a typed buffer
//! (f32 weights into the `f32` buffer the merge patches, no byte copy), patched by
//! [`adapters::apply_owned`] (which adds a LoRA's delta into that buffer in place, with the bits
//! of [`adapters::apply`]), converted if needed, written from its own storage, and dropped. A
//! weight with a per-tensor fp8 scale goes through a [`ModelPatcher`] of a model holding just it
//! and its scale instead. Unpatched weights whose dtype does not change, and the buffers, are
//! copied file to file by the kernel (`copy_file_range`), never passing through this process.
//! The output is byte for byte what merging the whole model in memory gives (the tests compare
//! the two).
//!
//! Cost: memory holds the LoRAs plus about two times the largest patched weight in f32 (its
//! values and the LoRA delta while it is patched), not the checkpoint; the values' buffer asks
//! for transparent huge pages (`float::output_buffer`), so the page faults are about one per
//! 4 KiB of LoRA delta. Each patched weight costs one `[out × r] · [r × in]` matmul and one add
//! in f32; every other weight a kernel copy.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;

use candle_core::Tensor;

use crate::error::{Error, Result};
use half::slice::HalfBitsSliceExt;
use half::{bf16, f16};

use crate::float::{self, Dtype, Fp8Format, Rounding};
use crate::patcher::adapters::{self, PatchEntry};

/// Sets `RAYON_NUM_THREADS` to the thread count candle computes for itself, when it is not set,
/// and returns that count. candle 0.11 asks for its thread count at every CPU matmul and, on
/// Linux without `RAYON_NUM_THREADS` (or `CANDLE_CPU_MASK`), counts physical cores by parsing
/// `/proc/cpuinfo` each time: measured here, 7 % of a quantized decode step and half the
/// tokens/s of a resident tiny MoE. With the variable set to the same count candle runs the same
/// threads, so results are unchanged. The examples and benchmarks call it first.
///
/// Call it at the start of `main`, before any other thread runs (setting the environment races
/// with threads reading it).
pub fn cache_candle_thread_count() -> usize {
    if let Some(n) = std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&n| n > 0)
    {
        return n;
    }
    let n = candle_core::utils::get_num_threads();
    std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    n
}

use crate::patcher::{lora_file, ModelPatcher, Patch, PatchKey, WEIGHT_SCALE_SUFFIX};
use crate::vram::DeviceId;
use crate::weights::{
    self, FileTensor, LazyTensor, Model, SafetensorsOptions, Sink, Source, TensorFile,
};

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
    let base = TensorFile::open(&config.model)?;
    let model = Arc::new(stand_in_model(&name, &base)?);
    let mut patcher = ModelPatcher::new(Arc::clone(&model), DeviceId::Cpu, DeviceId::Cpu);

    let mut loras = Vec::with_capacity(config.loras.len());
    let mut patch_sets = Vec::with_capacity(config.loras.len());
    for l in &config.loras {
        let strength = l.strength.unwrap_or(config.strength);
        let loaded = lora_file::load(l.path.as_path(), model.keys())?;
        patcher
            .add_patches(loaded.patches.iter().cloned(), strength, 1.0)
            .map_err(|e| Error::File {
                path: l.path.clone(),
                reason: format!("does not fit `{}`: {e}", config.model.display()),
            })?;
        patch_sets.push((loaded.patches, strength));
        loras.push(LoraMerged {
            path: l.path.clone(),
            strength,
            patched_keys: loaded.matched_model_keys,
            ignored_lora_keys: loaded.unmatched_lora_keys,
        });
    }

    let merge = StreamingMerge {
        name: &name,
        base: &base,
        patcher: &patcher,
        patch_sets: &patch_sets,
        target: config.dtype,
    };
    let mut tensors = Vec::with_capacity(base.tensors().len());
    let mut passed_through = Vec::new();
    for t in base.tensors() {
        let Some(stored) = t.weight_dtype() else {
            passed_through.push(t.name.clone());
            tensors.push(LazyTensor {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                len: t.len,
                source: base.source_of(t),
            });
            continue;
        };
        let dtype = config.dtype.unwrap_or(stored);
        let unchanged = patcher.patches().get(&t.name).is_empty() && dtype == stored;
        tensors.push(LazyTensor {
            name: t.name.clone(),
            dtype: weights::safetensors_dtype(dtype),
            shape: t.shape.clone(),
            len: t.shape.iter().product::<usize>() * dtype.size_in_bytes(),
            source: if unchanged && t.kept_as_stored() {
                // Unchanged and stored as in the file: the file's bytes are the output.
                base.source_of(t)
            } else {
                Source::Produce(Box::new(move |sink| merge.write_weight(t, stored, sink)))
            },
        });
    }
    let tensors_written = tensors.len();
    weights::save_safetensors_streaming(&config.out, tensors, &SafetensorsOptions::default())?;

    let patched_keys = model
        .keys()
        .filter(|k| !patcher.patches().get(k).is_empty())
        .map(str::to_string)
        .collect();
    Ok(MergeReport {
        loras,
        patched_keys,
        tensors_written,
        passed_through,
        out: config.out.clone(),
    })
}

/// The model the LoRAs are mapped onto and validated against: every float weight of `base` with
/// its name, shape and storage dtype, held as a one-element tensor of ones broadcast to its shape
/// (the patch rules look at dimensions only). Per-tensor fp8 scales are read for real, so the
/// model refuses exactly what the loader refuses (`Error::BadWeight` for a scale that is not one
/// finite, non-zero value).
fn stand_in_model(name: &str, base: &TensorFile) -> Result<Model> {
    let mut weights = Vec::new();
    for t in base.tensors() {
        let Some(dtype) = t.weight_dtype() else {
            continue;
        };
        if t.name.ends_with(WEIGHT_SCALE_SUFFIX) {
            weights.push(named(base.read_weight(t)?, &t.name));
            continue;
        }
        let one = Tensor::ones((), dtype.candle_storage_dtype(), &candle_core::Device::Cpu)
            .and_then(|z| z.broadcast_as(t.shape.as_slice()))
            .map_err(|e| Error::tensor(format!("`{}`: a stand-in of its shape", t.name), e))?;
        weights.push((t.name.clone(), one, dtype));
    }
    Model::from_typed_tensors(name, weights)
}

/// What writing one merged weight needs.
#[derive(Clone, Copy)]
struct StreamingMerge<'a> {
    name: &'a str,
    base: &'a TensorFile,
    /// The stand-in model's patcher: which weights are patched.
    patcher: &'a ModelPatcher,
    /// Each LoRA's `(model key, patch)` list and strength, in merge order.
    patch_sets: &'a [(Vec<(PatchKey, Patch)>, f32)],
    target: Option<Dtype>,
}

impl StreamingMerge<'_> {
    /// Hands the output bytes of weight `t`, stored as `stored` in the base, to `sink`: read,
    /// patched and converted exactly as a merge of the whole model in memory does it.
    fn write_weight(&self, t: &FileTensor, stored: Dtype, sink: &mut Sink<'_>) -> Result<()> {
        let key = t.name.as_str();
        let target = self.target.unwrap_or(stored);
        if self.scale_of(t).is_none() {
            let values = self.read_f32(t, stored)?;
            let chain: Vec<PatchEntry> = self
                .patcher
                .patches()
                .get(key)
                .iter()
                .map(|e| e.entry.clone())
                .collect();
            let dora = self.patcher.options().dora;
            let merged = adapters::apply_owned(key, values, &t.shape, &chain, dora)?;
            let merged = if target == Dtype::F32 {
                merged
            } else {
                float::from_f32(&merged, target, rounding_for(key, target))?
            };
            if self.scales_an_fp8_output(t) {
                // Never write what the loader refuses: a merged or narrowed scale can reach 0.
                weights::check_fp8_scale(self.name, key, &merged, target)?;
            }
            return weights::write_le_bytes(&merged, sink);
        }
        let patcher = self.one_weight_patcher(t)?;
        let merged = if target == stored {
            patcher.patched_weight(key)?
        } else {
            float::from_f32(
                &patcher.patched_weight_f32(key)?,
                target,
                rounding_for(key, target),
            )?
        };
        weights::write_le_bytes(&merged, sink)
    }

    /// Whether `t` is the per-tensor scale of a weight the merge writes as fp8.
    fn scales_an_fp8_output(&self, t: &FileTensor) -> bool {
        let Some(prefix) = t.name.strip_suffix(WEIGHT_SCALE_SUFFIX) else {
            return false;
        };
        let weight = format!("{prefix}.weight");
        self.base
            .tensors()
            .iter()
            .find(|w| w.name == weight)
            .and_then(|w| w.weight_dtype())
            .is_some_and(|stored| self.target.unwrap_or(stored).is_fp8())
    }

    /// The per-tensor fp8 scale stored next to weight `t` (`<layer>.weight_scale`), if any.
    fn scale_of(&self, t: &FileTensor) -> Option<&FileTensor> {
        let key = format!("{}{WEIGHT_SCALE_SUFFIX}", t.name.strip_suffix(".weight")?);
        self.base
            .tensors()
            .iter()
            .find(|s| s.name == key && s.weight_dtype().is_some())
    }

    /// Weight `t`'s values in f32, decoded from its bytes exactly as [`float::to_f32`] decodes the
    /// tensor [`TensorFile::read_weight`] reads (`f64` narrowed to `f32` first, as a [`Model`]
    /// stores it), into a buffer the caller owns. f32, f16 and bf16 bytes are read straight into
    /// a typed buffer (no byte copy); at most that buffer and the `f32` values are alive at once.
    fn read_f32(&self, t: &FileTensor, stored: Dtype) -> Result<Vec<f32>> {
        let n: usize = t.shape.iter().product();
        let wide = !t.kept_as_stored() || stored == Dtype::F64;
        let width = if wide { 8 } else { stored.size_in_bytes() };
        if t.len != n.saturating_mul(width) {
            return Err(Error::ShapeMismatch {
                what: format!("tensor `{}`: its bytes ({width} per value)", t.name),
                expected: vec![n.saturating_mul(width)],
                got: vec![t.len],
            });
        }
        let mut out = float::output_buffer::<f32>(n);
        let little = cfg!(target_endian = "little");
        match stored {
            _ if wide => {
                let bytes = self.base.read_bytes(t)?;
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(8)) {
                    *o = f64::from_le_bytes(b.try_into().expect("8 bytes")) as f32;
                }
            }
            Dtype::F32 | Dtype::F64 if little => {
                // (`F64` took the wide path above.)
                self.base.read_into(t, bytemuck::cast_slice_mut(&mut out))?;
            }
            Dtype::F32 | Dtype::F64 => {
                let bytes = self.base.read_bytes(t)?;
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = f32::from_le_bytes(b.try_into().expect("4 bytes"));
                }
            }
            Dtype::F16 | Dtype::BF16 => {
                let mut bits = float::output_buffer::<u16>(n);
                self.base
                    .read_into(t, bytemuck::cast_slice_mut(&mut bits))?;
                if !little {
                    bits.iter_mut().for_each(|b| *b = u16::from_le(*b));
                }
                if stored == Dtype::F16 {
                    float::f16_to_f32(bits.reinterpret_cast::<f16>(), &mut out)?;
                } else {
                    float::bf16_to_f32(bits.reinterpret_cast::<bf16>(), &mut out)?;
                }
            }
            Dtype::F8E4M3FN | Dtype::F8E5M2 => {
                let format = if stored == Dtype::F8E4M3FN {
                    Fp8Format::E4M3FN
                } else {
                    Fp8Format::E5M2
                };
                let bytes = self.base.read_bytes(t)?;
                float::fp8_to_f32(&bytes, &mut out, format)?;
            }
        }
        Ok(out)
    }

    /// A patcher over a model of weight `t` alone (plus its per-tensor fp8 scale, which patching
    /// it reads), with `t`'s patches of every LoRA added in merge order.
    fn one_weight_patcher(&self, t: &FileTensor) -> Result<ModelPatcher> {
        let mut weights = vec![named(self.base.read_weight(t)?, &t.name)];
        if let Some(scale) = t
            .name
            .strip_suffix(".weight")
            .map(|prefix| format!("{prefix}{WEIGHT_SCALE_SUFFIX}"))
            .and_then(|key| self.base.tensors().iter().find(|s| s.name == key))
        {
            if scale.weight_dtype().is_some() {
                weights.push(named(self.base.read_weight(scale)?, &scale.name));
            }
        }
        let model = Model::from_typed_tensors(self.name, weights)?;
        let mut patcher = ModelPatcher::new(model, DeviceId::Cpu, DeviceId::Cpu);
        for (patches, strength) in self.patch_sets {
            let mine = patches.iter().filter(|(k, _)| k.key == t.name).cloned();
            patcher.add_patches(mine, *strength, 1.0)?;
        }
        Ok(patcher)
    }
}

/// The rounding of a merged weight to `target`: seeded stochastic (the key's seed) for fp8,
/// nearest-even otherwise — the patcher's rule for fp8 storage.
fn rounding_for(key: &str, target: Dtype) -> Rounding {
    if target.is_fp8() {
        Rounding::stochastic_for(key)
    } else {
        Rounding::Nearest
    }
}

fn named((tensor, dtype): (Tensor, Dtype), name: &str) -> (String, Tensor, Dtype) {
    (name.to_string(), tensor, dtype)
}

#[cfg(test)]
mod tests;
