//! Every flag, in one struct.
//!
//! [`Config`] is parsed from ComfyUI-spelled command-line flags ([`Config::from_args`]), from the
//! environment ([`Config::from_env`], the only place this crate reads environment variables), or
//! built with setters. Unknown flags, missing or malformed values and flags that exclude each other
//! are errors that name the flag; nothing is silently ignored.

use crate::error::{Error, Result};
use crate::float::Dtype;
use crate::size::ByteSize;

/// The mutually exclusive memory-mode flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum VramMode {
    /// `--gpu-only`: everything (text encoders, VAE, intermediates) stays on the GPU.
    GpuOnly,
    /// `--highvram`: models stay on the GPU after use.
    HighVram,
    /// `--normalvram`: the default partial-loading policy, even on small cards.
    NormalVram,
    /// `--lowvram`: partial loading; text encoders on the CPU.
    LowVram,
    /// `--novram`: nothing castable resident; every weight streams.
    NoVram,
    /// `--cpu`: no GPU is used at all.
    Cpu,
}

/// The attention backend asked for on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AttentionFlag {
    /// `--use-split-cross-attention`.
    Split,
    /// `--use-quad-cross-attention` (sub-quadratic, memory-efficient).
    Quad,
    /// `--use-pytorch-cross-attention` (the fused kernel, SDPA).
    Pytorch,
    /// `--use-flash-attention`.
    Flash,
    /// `--use-sage-attention`.
    Sage,
}

/// Whether attention softmax is computed in f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum UpcastFlag {
    /// The backend's default (upcast half-precision softmax).
    #[default]
    Default,
    /// `--force-upcast-attention`.
    Force,
    /// `--dont-upcast-attention`.
    Never,
}

/// All settings. `Default` is "no flags given".
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Config {
    /// `--gpu-only --highvram --normalvram --lowvram --novram --cpu` (at most one).
    pub vram_mode: Option<VramMode>,
    /// `--reserve-vram GB`: replaces the default reserve.
    pub reserve_vram_gb: Option<f64>,
    /// `--reserve-vram 0=1.5,1=0.5`: a reserve per GPU ordinal (GB), replacing the default (or
    /// [`Config::reserve_vram_gb`]) on that device.
    pub reserve_vram_gbs: Vec<(usize, f64)>,
    /// `--vram-budget SIZE`: caps every device's total; on a machine without GPU it makes the CPU
    /// a budgeted compute device.
    pub vram_budget: Option<ByteSize>,
    /// `--vram-budget 0=8GiB,1=12GiB`: a budget per GPU ordinal (`cuda:N`, or `sim:N` when
    /// simulated GPUs are given), capping that device's total; devices not named keep
    /// [`Config::vram_budget`] (or none). Repeated ordinals: the last wins.
    pub vram_budgets: Vec<(usize, ByteSize)>,
    /// `--disable-smart-memory`: unload other models fully instead of partially.
    pub disable_smart_memory: bool,
    /// `--enable-dynamic-vram` (`Some(true)`) / `--disable-dynamic-vram` (`Some(false)`):
    /// residency by use (ComfyUI's DynamicVRAM). `None`: ComfyUI's default — on with a GPU
    /// (CUDA or simulated) unless `--highvram`, `--gpu-only`, `--novram` or `--cpu`
    /// ([`crate::vram::Policy::dynamic_vram`]).
    pub dynamic_vram: Option<bool>,
    /// `--async-offload [N]`: number of transfer lanes (`Some(None)` = the flag without a number,
    /// meaning the default of 2).
    pub async_offload: Option<Option<usize>>,
    /// `--disable-async-offload`: synchronous transfers.
    pub disable_async_offload: bool,
    /// `--ram-budget SIZE` (a residency extension): host RAM the clean weights of models read
    /// through the manager's host tier may hold ([`crate::weights::HostTier`]); such models are
    /// read lazily, weight by weight, from their files. `None`: models are read eagerly, as
    /// before.
    pub ram_budget: Option<ByteSize>,
    /// `--disable-pinned-memory`.
    pub disable_pinned_memory: bool,
    /// `--pinned-memory-limit SIZE`.
    pub pinned_memory_limit: Option<ByteSize>,
    /// `--cpu-vae`.
    pub cpu_vae: bool,
    /// `--force-fp32`.
    pub force_fp32: bool,
    /// `--force-fp16`.
    pub force_fp16: bool,
    /// `--fp32-unet --fp64-unet --bf16-unet --fp16-unet --fp8_e4m3fn-unet --fp8_e5m2-unet`.
    pub unet_dtype: Option<Dtype>,
    /// `--fp16-vae --fp32-vae --bf16-vae`.
    pub vae_dtype: Option<Dtype>,
    /// `--fp8_e4m3fn-text-enc --fp8_e5m2-text-enc --fp16-text-enc --fp32-text-enc --bf16-text-enc`.
    pub text_encoder_dtype: Option<Dtype>,
    /// `--supports-fp8-compute`.
    pub supports_fp8_compute: bool,
    /// `--use-split-cross-attention` and the other attention flags (at most one).
    pub attention: Option<AttentionFlag>,
    /// `--force-upcast-attention` / `--dont-upcast-attention`.
    pub upcast_attention: UpcastFlag,
    /// `--cuda-device N`.
    pub cuda_device: Option<usize>,
    /// `--deterministic`.
    pub deterministic: bool,
    /// `--inference-memory SIZE` (a residency extension, not a ComfyUI flag): replaces the
    /// 0.8 GiB base of `minimum_inference_memory`, for small models and simulations.
    pub inference_memory: Option<ByteSize>,
    /// How many streamed weights are prefetched ahead of use (not a ComfyUI flag; set with
    /// [`Config::with_prefetch_depth`]). `None`: 2.
    pub prefetch_depth: Option<usize>,
    /// `--sim-gpu SPEC` (repeatable) and `--sim-gpus NxSPEC` (residency extensions): simulated
    /// GPUs ([`crate::device::SimGpu`]), `sim:0`, `sim:1`, ... in order. When given, models
    /// compute on `sim:0` (unless `--cpu`).
    pub sim_gpus: Vec<super::SimSpec>,
    /// `--cost-aware-misses` (a residency extension): a quantized weight that misses on a GPU
    /// and would not be kept runs where it finishes first, on the host from its host copy or
    /// uploaded, by costs measured at run time ([`crate::offload::MissCosts`]). The one mode
    /// whose outputs depend on placement on a real GPU (host and device kernels round
    /// differently); the same bits on a simulated GPU. Off by default.
    pub cost_aware_misses: bool,
    /// `--prepared-host SIZE` (a residency extension): host RAM the prepared copies of quantized
    /// weights run on the host may take ([`crate::offload::PreparedBudget`]; with
    /// `--cost-aware-misses`). `0` keeps none. `None`: a quarter of the host's available RAM at
    /// the manager's start, or none under `--ram-budget` (given beside it, the room is outside
    /// the host tier's budget).
    pub prepared_host: Option<ByteSize>,
}

/// A second flag of a mutually exclusive group (`--lowvram` and `--highvram`, two unet
/// dtypes, …) is a conflict with the first one `seen`.
fn conflicts(name: &'static str, action: Action, seen: &[&'static str]) -> Result<()> {
    let group = |a: Action| -> Option<u8> {
        Some(match a {
            Action::Mode(_) => 0,
            Action::ForceFp32 | Action::ForceFp16 => 1,
            Action::Unet(_) | Action::UnetF64 | Action::UnetE8M0 => 2,
            Action::Vae(_) => 3,
            Action::TextEnc(_) => 4,
            Action::Attention(_) => 5,
            Action::Upcast(_) => 6,
            Action::AsyncOffload | Action::DisableAsyncOffload => 7,
            Action::DisablePinned | Action::PinnedLimit => 8,
            Action::EnableDynamicVram | Action::DisableDynamicVram => 9,
            _ => return None,
        })
    };
    let Some(g) = group(action) else {
        return Ok(());
    };
    match seen
        .iter()
        .find(|p| lookup(p).and_then(|(_, a)| group(a)) == Some(g) && **p != name)
    {
        Some(prev) => Err(Error::ConflictingFlags {
            first: prev.to_string(),
            second: name.to_string(),
        }),
        None => Ok(()),
    }
}

/// `--sim-gpus COUNTxSPEC`: how many simulated GPUs (1 to 16) of which spec.
fn sim_gpus(value: &str) -> std::result::Result<(usize, super::SimSpec), String> {
    let (n, spec) = value
        .split_once(['x', 'X'])
        .ok_or_else(|| format!("`{value}` is not COUNTxSPEC, e.g. `2x8GiB`"))?;
    let n: usize = n
        .trim()
        .parse()
        .ok()
        .filter(|n| (1..=16).contains(n))
        .ok_or_else(|| format!("`{n}` GPUs: use 1 to 16"))?;
    Ok((n, spec.parse()?))
}

/// The `GPU=VALUE` parts of a per-GPU flag value (`0=8GiB,1=12GiB`), each GPU number parsed;
/// `what` names the value in the error for a part without `=`.
fn per_gpu<'v>(
    value: &'v str,
    what: &str,
    invalid: &dyn Fn(String) -> Error,
) -> Result<Vec<(usize, &'v str)>> {
    value
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(|part| {
            let (n, v) = part
                .split_once('=')
                .ok_or_else(|| invalid(format!("`{part}` is not GPU={what}")))?;
            let n: usize = n
                .trim()
                .parse()
                .map_err(|_| invalid(format!("`{n}` in `{part}` is not a GPU number")))?;
            Ok((n, v.trim()))
        })
        .collect()
}

/// What a flag does to the config. One table drives parsing, the environment and suggestions.
#[derive(Clone, Copy)]
enum Action {
    Mode(VramMode),
    ReserveVram,
    VramBudget,
    RamBudget,
    DisableSmartMemory,
    EnableDynamicVram,
    DisableDynamicVram,
    AsyncOffload,
    DisableAsyncOffload,
    DisablePinned,
    PinnedLimit,
    CpuVae,
    ForceFp32,
    ForceFp16,
    Unet(Dtype),
    UnetF64,
    UnetE8M0,
    Vae(Dtype),
    TextEnc(Dtype),
    Fp8Compute,
    Attention(AttentionFlag),
    Upcast(UpcastFlag),
    CudaDevice,
    Deterministic,
    CostAwareMisses,
    PreparedHost,
    InferenceMemory,
    SimGpu,
    SimGpus,
}

/// Every flag, as ComfyUI spells it.
const FLAGS: &[(&str, Action)] = &[
    ("--gpu-only", Action::Mode(VramMode::GpuOnly)),
    ("--highvram", Action::Mode(VramMode::HighVram)),
    ("--normalvram", Action::Mode(VramMode::NormalVram)),
    ("--lowvram", Action::Mode(VramMode::LowVram)),
    ("--novram", Action::Mode(VramMode::NoVram)),
    ("--cpu", Action::Mode(VramMode::Cpu)),
    ("--reserve-vram", Action::ReserveVram),
    ("--vram-budget", Action::VramBudget),
    ("--ram-budget", Action::RamBudget),
    ("--disable-smart-memory", Action::DisableSmartMemory),
    ("--enable-dynamic-vram", Action::EnableDynamicVram),
    ("--disable-dynamic-vram", Action::DisableDynamicVram),
    ("--async-offload", Action::AsyncOffload),
    ("--disable-async-offload", Action::DisableAsyncOffload),
    ("--disable-pinned-memory", Action::DisablePinned),
    ("--pinned-memory-limit", Action::PinnedLimit),
    ("--cpu-vae", Action::CpuVae),
    ("--force-fp32", Action::ForceFp32),
    ("--force-fp16", Action::ForceFp16),
    ("--fp32-unet", Action::Unet(Dtype::F32)),
    ("--fp64-unet", Action::UnetF64),
    ("--bf16-unet", Action::Unet(Dtype::BF16)),
    ("--fp16-unet", Action::Unet(Dtype::F16)),
    ("--fp8_e4m3fn-unet", Action::Unet(Dtype::F8E4M3FN)),
    ("--fp8_e5m2-unet", Action::Unet(Dtype::F8E5M2)),
    ("--fp8_e8m0fnu-unet", Action::UnetE8M0),
    ("--fp16-vae", Action::Vae(Dtype::F16)),
    ("--fp32-vae", Action::Vae(Dtype::F32)),
    ("--bf16-vae", Action::Vae(Dtype::BF16)),
    ("--fp8_e4m3fn-text-enc", Action::TextEnc(Dtype::F8E4M3FN)),
    ("--fp8_e5m2-text-enc", Action::TextEnc(Dtype::F8E5M2)),
    ("--fp16-text-enc", Action::TextEnc(Dtype::F16)),
    ("--fp32-text-enc", Action::TextEnc(Dtype::F32)),
    ("--bf16-text-enc", Action::TextEnc(Dtype::BF16)),
    ("--supports-fp8-compute", Action::Fp8Compute),
    (
        "--use-split-cross-attention",
        Action::Attention(AttentionFlag::Split),
    ),
    (
        "--use-quad-cross-attention",
        Action::Attention(AttentionFlag::Quad),
    ),
    (
        "--use-pytorch-cross-attention",
        Action::Attention(AttentionFlag::Pytorch),
    ),
    (
        "--use-flash-attention",
        Action::Attention(AttentionFlag::Flash),
    ),
    (
        "--use-sage-attention",
        Action::Attention(AttentionFlag::Sage),
    ),
    (
        "--force-upcast-attention",
        Action::Upcast(UpcastFlag::Force),
    ),
    ("--dont-upcast-attention", Action::Upcast(UpcastFlag::Never)),
    ("--cuda-device", Action::CudaDevice),
    ("--deterministic", Action::Deterministic),
    ("--cost-aware-misses", Action::CostAwareMisses),
    ("--prepared-host", Action::PreparedHost),
    ("--inference-memory", Action::InferenceMemory),
    ("--sim-gpu", Action::SimGpu),
    ("--sim-gpus", Action::SimGpus),
];

/// Flags are matched with `_` and `-` treated alike, so `--fp8-e4m3fn-unet` and
/// `--fp8_e4m3fn-unet` both work.
fn normalize(flag: &str) -> String {
    flag.replace('_', "-").to_ascii_lowercase()
}

fn lookup(flag: &str) -> Option<(&'static str, Action)> {
    let n = normalize(flag);
    FLAGS
        .iter()
        .find(|(name, _)| normalize(name) == n)
        .map(|(name, a)| (*name, *a))
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != *cb);
            cur[j + 1] = sub.min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

fn suggest(flag: &str) -> Option<String> {
    let n = normalize(flag);
    FLAGS
        .iter()
        .map(|(name, _)| (edit_distance(&n, &normalize(name)), *name))
        .filter(|(d, _)| *d <= 3)
        .min()
        .map(|(_, name)| name.to_string())
}

/// The `RESIDENCY_*` variables of `vars`, as owned pairs.
fn residency_vars<I, K, V>(vars: I) -> Vec<(String, String)>
where
    I: IntoIterator<Item = (K, V)>,
    K: AsRef<str>,
    V: AsRef<str>,
{
    vars.into_iter()
        .map(|(k, v)| (k.as_ref().to_string(), v.as_ref().to_string()))
        .filter(|(k, _)| k.starts_with("RESIDENCY_"))
        .collect()
}

impl Config {
    /// Every flag this crate understands, as ComfyUI spells them.
    pub fn known_flags() -> impl Iterator<Item = &'static str> {
        FLAGS.iter().map(|(name, _)| *name)
    }

    /// Every flag with the value it takes, one a line, for an example's `--help`:
    /// `  --vram-budget SIZE`, `  --async-offload [N]`, `  --lowvram`, ...
    pub fn flags_help() -> String {
        FLAGS
            .iter()
            .map(|(name, action)| {
                let value = match action {
                    Action::ReserveVram => " GB",
                    Action::VramBudget
                    | Action::RamBudget
                    | Action::PinnedLimit
                    | Action::PreparedHost
                    | Action::InferenceMemory => " SIZE",
                    Action::AsyncOffload => " [N]",
                    Action::CudaDevice => " N",
                    Action::SimGpu => " SIZE[@BANDWIDTH]",
                    Action::SimGpus => " NxSIZE[@BANDWIDTH]",
                    _ => "",
                };
                format!("  {name}{value}\n")
            })
            .collect()
    }

    /// Whether `flag` (without its value) is one of ours; examples use this to split their own
    /// flags from ours.
    pub fn is_known_flag(flag: &str) -> bool {
        lookup(flag.split('=').next().unwrap_or(flag)).is_some()
    }

    /// Whether a known flag takes a value (`Some(true)` required, `Some(false)` never), or `None`
    /// for `--async-offload`, whose number is optional.
    pub fn flag_takes_value(flag: &str) -> Option<bool> {
        match lookup(flag).map(|(_, a)| a) {
            Some(Action::AsyncOffload) => None,
            Some(
                Action::ReserveVram
                | Action::VramBudget
                | Action::RamBudget
                | Action::PinnedLimit
                | Action::PreparedHost
                | Action::CudaDevice
                | Action::InferenceMemory
                | Action::SimGpu
                | Action::SimGpus,
            ) => Some(true),
            _ => Some(false),
        }
    }

    /// Parses ComfyUI-style flags (`--lowvram`, `--vram-budget 4GiB`, `--vram-budget=4GiB`,
    /// `--async-offload`, `--async-offload 3`). The program name must not be included.
    pub fn from_args<I, S>(args: I) -> Result<Config>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let args: Vec<String> = args.into_iter().map(|s| s.as_ref().to_string()).collect();
        let mut cfg = Config::default();
        let mut seen: Vec<&'static str> = Vec::new();
        let mut i = 0;
        while i < args.len() {
            let raw = &args[i];
            i += 1;
            let (flag, inline) = match raw.split_once('=') {
                Some((f, v)) => (f, Some(v.to_string())),
                None => (raw.as_str(), None),
            };
            let (name, action) = lookup(flag).ok_or_else(|| Error::UnknownFlag {
                flag: flag.to_string(),
                suggestion: suggest(flag),
            })?;
            let value = match Config::flag_takes_value(name) {
                Some(true) => match inline {
                    Some(v) => Some(v),
                    None if i < args.len() => {
                        i += 1;
                        Some(args[i - 1].clone())
                    }
                    None => {
                        return Err(Error::InvalidFlag {
                            flag: name.into(),
                            reason: "needs a value".into(),
                        })
                    }
                },
                Some(false) => {
                    if inline.is_some() {
                        return Err(Error::InvalidFlag {
                            flag: name.into(),
                            reason: "takes no value".into(),
                        });
                    }
                    None
                }
                None => match inline {
                    Some(v) => Some(v),
                    None if i < args.len() && args[i].parse::<usize>().is_ok() => {
                        i += 1;
                        Some(args[i - 1].clone())
                    }
                    // `--async-offload many`: a word that is no flag was meant as the number.
                    None if i < args.len() && !args[i].starts_with('-') => {
                        return Err(Error::InvalidFlag {
                            flag: name.into(),
                            reason: format!(
                                "`{}` is not a number (give a count, `{name} 2`, or the flag alone)",
                                args[i]
                            ),
                        });
                    }
                    None => None,
                },
            };
            cfg.apply(name, action, value.as_deref(), &mut seen)?;
        }
        Ok(cfg)
    }

    /// Reads `RESIDENCY_ARGS` (flags as on a command line, split on whitespace) and
    /// `RESIDENCY_<FLAG>` variables (`RESIDENCY_LOWVRAM=1`, `RESIDENCY_VRAM_BUDGET=4GiB`,
    /// `RESIDENCY_FP8_E4M3FN_UNET=1`). A boolean variable set to `0`, `false`, `no`, `off` or the
    /// empty string is not given. Unknown `RESIDENCY_*` variables are an error. This is the only
    /// place the crate reads the environment.
    pub fn from_env() -> Result<Config> {
        Config::from_env_vars(std::env::vars())
    }

    /// [`Config::from_env`], keeping every setting that is valid: a variable that is unknown,
    /// malformed or conflicts with the ones before it (in name order, `RESIDENCY_ARGS` first) is
    /// left out and its error returned beside the config, instead of discarding every setting.
    pub fn from_env_vars_lenient<I, K, V>(vars: I) -> (Config, Vec<Error>)
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<str>,
        V: AsRef<str>,
    {
        let mut vars = residency_vars(vars);
        // RESIDENCY_ARGS first, as in `from_env_vars`.
        vars.sort_by_key(|(k, _)| (k != "RESIDENCY_ARGS", k.clone()));
        let mut kept: Vec<(String, String)> = Vec::new();
        let mut errors = Vec::new();
        for var in vars {
            let mut trial = kept.clone();
            trial.push(var.clone());
            match Config::from_env_vars(trial) {
                Ok(_) => kept.push(var),
                Err(e) => errors.push(e),
            }
        }
        let config = Config::from_env_vars(kept).unwrap_or_default();
        (config, errors)
    }

    /// [`Config::from_env`] over a given set of variables (pure; for tests and embedding).
    pub fn from_env_vars<I, K, V>(vars: I) -> Result<Config>
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<str>,
        V: AsRef<str>,
    {
        let mut vars = residency_vars(vars);
        vars.sort();
        let mut args: Vec<String> = Vec::new();
        // Which variable gave each flag, so an error names the variable the user set.
        let mut given: Vec<(String, String, std::ops::Range<usize>)> = Vec::new();
        if let Some((_, v)) = vars.iter().find(|(k, _)| k == "RESIDENCY_ARGS") {
            args.extend(v.split_whitespace().map(str::to_string));
        }
        for (k, v) in &vars {
            if k == "RESIDENCY_ARGS" {
                continue;
            }
            let flag = format!("--{}", k["RESIDENCY_".len()..].to_ascii_lowercase());
            let Some((name, _)) = lookup(&flag) else {
                return Err(Error::UnknownFlag {
                    flag: k.clone(),
                    suggestion: suggest(&flag).map(|s| {
                        format!(
                            "RESIDENCY_{}",
                            normalize(&s[2..]).replace('-', "_").to_uppercase()
                        )
                    }),
                });
            };
            let first = args.len();
            match Config::flag_takes_value(name) {
                Some(false) => {
                    if is_truthy(k, v)? {
                        args.push(name.to_string());
                    }
                }
                Some(true) => args.push(format!("{name}={v}")),
                None => {
                    if v.trim().parse::<usize>().is_ok() {
                        args.push(format!("{name}={}", v.trim()));
                    } else if is_truthy(k, v)? {
                        args.push(name.to_string());
                    }
                }
            }
            given.push((k.clone(), v.clone(), first..args.len()));
        }
        Config::from_args(&args).map_err(|e| {
            // The variable whose flag alone fails (or the last one given, for two that conflict).
            let culprit = given
                .iter()
                .find(|(_, _, r)| Config::from_args(&args[r.clone()]).is_err())
                .or_else(|| given.iter().rev().find(|(_, _, r)| !r.is_empty()));
            match (culprit, &e) {
                (_, Error::ConflictingFlags { .. }) | (None, _) => e,
                (Some((k, v, _)), _) => Error::InvalidFlag {
                    flag: k.clone(),
                    reason: format!("`{v}`: {e}"),
                },
            }
        })
    }

    fn apply(
        &mut self,
        name: &'static str,
        action: Action,
        value: Option<&str>,
        seen: &mut Vec<&'static str>,
    ) -> Result<()> {
        let invalid = |reason: String| Error::InvalidFlag {
            flag: name.into(),
            reason,
        };
        let value_str = value.unwrap_or("");
        conflicts(name, action, seen)?;
        seen.push(name);
        match action {
            Action::Mode(m) => self.vram_mode = Some(m),
            Action::ReserveVram if value_str.contains('=') => {
                for (n, gb) in per_gpu(value_str, "GB", &invalid)? {
                    let gb: f64 = gb
                        .parse()
                        .map_err(|_| invalid(format!("`{gb}` (GPU {n}) is not a number of GB")))?;
                    if !gb.is_finite() || gb < 0.0 {
                        return Err(invalid(format!(
                            "GPU {n}'s reserve must be a non-negative number of GB"
                        )));
                    }
                    self.reserve_vram_gbs.retain(|(m, _)| *m != n);
                    self.reserve_vram_gbs.push((n, gb));
                }
            }
            Action::ReserveVram => {
                let gb: f64 = value_str
                    .trim()
                    .parse()
                    .map_err(|_| invalid(format!("`{value_str}` is not a number of GB")))?;
                if !gb.is_finite() || gb < 0.0 {
                    return Err(invalid(format!("`{value_str}` must be a non-negative number of GB")));
                }
                self.reserve_vram_gb = Some(gb);
            }
            Action::VramBudget if value_str.contains('=') => {
                for (n, b) in per_gpu(value_str, "SIZE", &invalid)? {
                    let b: ByteSize = b
                        .parse()
                        .map_err(|e| invalid(format!("GPU {n}'s budget: {e}")))?;
                    if b == ByteSize::ZERO {
                        return Err(invalid(format!("GPU {n}'s budget must be more than 0 bytes")));
                    }
                    self.vram_budgets.retain(|(m, _)| *m != n);
                    self.vram_budgets.push((n, b));
                }
            }
            Action::VramBudget => {
                let b: ByteSize = value_str.parse()?;
                if b == ByteSize::ZERO {
                    return Err(invalid("the budget must be more than 0 bytes".into()));
                }
                self.vram_budget = Some(b);
            }
            Action::RamBudget => {
                let b: ByteSize = value_str.parse()?;
                if b == ByteSize::ZERO {
                    return Err(invalid("the budget must be more than 0 bytes".into()));
                }
                self.ram_budget = Some(b);
            }
            Action::DisableSmartMemory => self.disable_smart_memory = true,
            Action::EnableDynamicVram => self.dynamic_vram = Some(true),
            Action::DisableDynamicVram => self.dynamic_vram = Some(false),
            Action::AsyncOffload => {
                let lanes = |v: &str| {
                    let n: usize = v
                        .trim()
                        .parse()
                        .map_err(|_| invalid(format!("`{v}` is not a lane count")))?;
                    if n == 0 || n > 64 {
                        return Err(invalid(format!("{n} lanes: use 1 to 64")));
                    }
                    Ok(n)
                };
                self.async_offload = Some(value.map(lanes).transpose()?);
            }
            Action::DisableAsyncOffload => self.disable_async_offload = true,
            Action::DisablePinned => self.disable_pinned_memory = true,
            Action::PinnedLimit => self.pinned_memory_limit = Some(value_str.parse()?),
            Action::CpuVae => self.cpu_vae = true,
            Action::ForceFp32 => self.force_fp32 = true,
            Action::ForceFp16 => self.force_fp16 = true,
            Action::Unet(d) => self.unet_dtype = Some(d),
            Action::UnetF64 => {
                return Err(invalid(
                    "f64 weights are not supported; use --fp32-unet for full precision".into(),
                ))
            }
            Action::UnetE8M0 => {
                return Err(invalid(
                    "fp8 e8m0fnu is a scale-only format (no mantissa) and cannot store weights; use --fp8_e4m3fn-unet".into(),
                ))
            }
            Action::Vae(d) => self.vae_dtype = Some(d),
            Action::TextEnc(d) => self.text_encoder_dtype = Some(d),
            Action::Fp8Compute => self.supports_fp8_compute = true,
            Action::Attention(a) => self.attention = Some(a),
            Action::Upcast(u) => self.upcast_attention = u,
            Action::CudaDevice => {
                self.cuda_device = Some(
                    value_str
                        .trim()
                        .parse()
                        .map_err(|_| invalid(format!("`{value_str}` is not a device number")))?,
                )
            }
            Action::Deterministic => self.deterministic = true,
            Action::CostAwareMisses => self.cost_aware_misses = true,
            Action::PreparedHost => self.prepared_host = Some(value_str.parse()?),
            Action::InferenceMemory => self.inference_memory = Some(value_str.parse()?),
            Action::SimGpu => self.sim_gpus.push(value_str.parse().map_err(invalid)?),
            Action::SimGpus => {
                let (n, spec) = sim_gpus(value_str).map_err(invalid)?;
                self.sim_gpus.extend(std::iter::repeat_n(spec, n));
            }
        }
        Ok(())
    }

    /// Number of asynchronous transfer lanes when computing on a GPU: 0 when disabled, else the
    /// `--async-offload` count, else 2. See [`Config::transfer_lanes_for`] for the CPU.
    pub fn transfer_lanes(&self) -> usize {
        if self.disable_async_offload {
            0
        } else {
            self.async_offload.flatten().unwrap_or(2)
        }
    }

    /// The host RAM prepared host copies may take ([`Config::prepared_host`]) on a host with
    /// `available` bytes free: the flag's size; without it a quarter of `available`, or nothing
    /// under `--ram-budget` (every host byte there is the host tier's).
    pub fn prepared_host_limit(&self, available: ByteSize) -> ByteSize {
        match (self.prepared_host, self.ram_budget) {
            (Some(limit), _) => limit,
            (None, Some(_)) => ByteSize::ZERO,
            (None, None) => ByteSize(available.bytes() / 4),
        }
    }

    /// Number of transfer lanes for a compute device: [`Config::transfer_lanes`] on a GPU; on
    /// the CPU 0 unless `--async-offload N` asks for lanes. A CPU has no copy engine: a lane's
    /// work (patch and cast) is CPU work that competes with compute, and candle's CPU matmul
    /// already uses every core (measured on 2 cores, batch 8: 2 lanes with prefetch 1.29× the
    /// resident forward, synchronous 1.16×).
    pub fn transfer_lanes_for(&self, device: super::DeviceId) -> usize {
        match (device, self.async_offload) {
            (super::DeviceId::Cpu, None) if !self.disable_async_offload => 0,
            _ => self.transfer_lanes(),
        }
    }

    /// Streamed weights prefetched ahead of use (2 unless set; 0 disables prefetching).
    pub fn prefetch_depth(&self) -> usize {
        self.prefetch_depth.unwrap_or(2)
    }
}

fn is_truthy(key: &str, v: &str) -> Result<bool> {
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "" | "0" | "false" | "no" | "off" => Ok(false),
        other => Err(Error::InvalidFlag {
            flag: key.to_string(),
            reason: format!("`{other}` is not a boolean (use 1 or 0)"),
        }),
    }
}

mod builder;

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;
