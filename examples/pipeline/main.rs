//! The main job: a small diffusion-shaped pipeline — a quantized prompt model (GGUF), text
//! encoder, denoiser, decoder — sharing one memory budget, prompts run back to back, a LoRA clone
//! on prompt 2 and back to the base on prompt 3, smart memory in between. No download, no GPU
//! needed.
//!
//! ```sh
//! cargo run --release --example pipeline -- [--prompts N] [--steps N] [--seed S] [--json FILE]
//!     [--cache DIR] [--trace FILE | --tracing] [--timeline FILE] [any residency flag:
//!     --vram-budget 64MiB --ram-budget 4MiB --novram --async-offload 3 ...]
//! ```
//!
//! `--trace FILE` (or candle's `--tracing`) writes a Chrome trace of the run (open it in
//! <https://ui.perfetto.dev> or `chrome://tracing`); `--timeline FILE` draws it as an SVG: each
//! device's ledger against its budget with loads and evictions marked, and the copy and compute
//! lanes below (`residency::trace`). Each model's forward is a `compute` span.
//!
//! With `--sim-gpu 64MiB@25GB/s` the models run on a simulated GPU (its memory is host memory,
//! its copies run on stream workers at the modelled bandwidth, lanes and prefetch on as on a real
//! GPU); the checksums are the CPU run's, and the report says how much copy time hid behind
//! compute and whether the sim's checker found any misuse.
//!
//! With `--ram-budget` the three models are read lazily: their weights stay in the cache's files
//! and at most that many bytes of them are held in RAM at once (the report's `host` line).
//!
//! The models are built once from deterministic weights and saved as safetensors in the cache
//! folder. Without `--vram-budget` the budget is a third of the three models' resident size, so
//! eviction, partial loading and streaming all happen. Because these models are tiny, the example
//! defaults `--reserve-vram 0 --inference-memory 4MiB`: ComfyUI's defaults, made for gigabyte
//! cards, ask 0.8 GiB for activations — more than the whole simulated device — and a partial
//! load's 128 MiB floor (`loader::MIN_WEIGHT_BUDGET`) then lets weights take all of it but the
//! streaming room (14 of 16 MiB), leaving activations nothing. Pass either flag to override.
//!
//! The prompt model is candle-transformers' `quantized_llama.rs` with only its `use` lines
//! changed (`tests/ported/quantized_llama.rs`), on a Q4_K/Q6_K/Q8_0 model read with
//! `MemoryManager::read_gguf`: its block bytes are scheduled, streamed and counted like every
//! other weight. The other three models are candle-nn code on `residency::nn` (`use
//! residency::nn as candle_nn;`, docs/PORTING.md): their layers fetch each weight at use, and the
//! denoiser's layers switch to the LoRA clone and back with `OpsSource::load`.
//!
//! This file is the job itself ([`run`]); `models.rs` holds the models, `checkpoints.rs` their
//! deterministic weights and the LoRA file, `report.rs` what a run reports.

mod checkpoints;
mod models;
#[path = "../../tests/ported/quantized_llama.rs"]
#[allow(dead_code, unused_imports, clippy::all)]
mod quantized_llama;
mod report;

include!("../../tests/ported/shim.rs");

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use candle_core::Tensor;
use residency::float::{self, Dtype};
use residency::loader::{LoadOptions, MemoryManager};
use residency::patcher::{lora_file, ModelPatcher};
use residency::trace::TraceArgs;
use residency::vram::{Config, DeviceId, Hardware};
use residency::weights::{HostTier, Model};
use residency::{ByteSize, DeviceMap, Result};

use checkpoints::{build_checkpoints, weight};
use models::{Decoder, Denoiser, PromptModel, TextEncoder, H, HEADS, LATENT_C, LATENT_HW};
pub use report::{to_json, to_table, PipelineReport, PromptResult};

/// Options of one run.
#[derive(Debug, Clone)]
pub struct PipelineArgs {
    pub prompts: usize,
    pub steps: usize,
    pub seed: u64,
    pub json: Option<PathBuf>,
    pub cache: PathBuf,
    pub config: Config,
    pub quiet: bool,
    /// `--device-map auto|RULES`: every model split across the GPUs (simulated ones with
    /// `--sim-gpus`), by `DeviceMap::auto` within each device's budget, or by the rules.
    pub device_map: Option<String>,
    /// `--trace FILE` / `--tracing` / `--timeline FILE`.
    pub trace: TraceArgs,
}

/// Runs the pipeline.
pub fn run(args: &PipelineArgs) -> Result<PipelineReport> {
    let t_start = Instant::now();
    if std::fs::read(args.cache.join("READY")).ok().as_deref() != Some(checkpoints::READY) {
        build_checkpoints(&args.cache)?;
    }
    let te_path = args.cache.join("text_encoder.safetensors");
    let dn_path = args.cache.join("denoiser.safetensors");
    let de_path = args.cache.join("decoder.safetensors");
    let pm_path = args.cache.join("prompt_lm.gguf");

    let mut config = args.config.clone();
    if config.reserve_vram_gb.is_none() {
        config.reserve_vram_gb = Some(0.0);
    }
    if config.inference_memory.is_none() {
        config.inference_memory = Some(ByteSize::mib(4));
    }
    let hardware = Hardware::probe();
    // The models' sizes from their headers alone (a lazy read reads nothing else).
    let headers = HostTier::new(None);
    let size = |path: &std::path::Path| -> Result<ByteSize> {
        Ok(Model::from_safetensors_lazy("header", &[path], &headers)?.model_size())
    };
    let pm_size = Model::from_gguf_lazy("header", &pm_path, &headers)?.model_size();
    let f32_total = ByteSize(
        size(&te_path)?.bytes()
            + size(&dn_path)?.bytes() * 2
            + size(&de_path)?.bytes()
            + pm_size.bytes(),
    );
    if config.vram_budget.is_none() && hardware.gpus.is_empty() && config.sim_gpus.is_empty() {
        config.vram_budget = Some(ByteSize(f32_total.bytes() / 3));
    }
    let mm = MemoryManager::new(config, hardware)?;
    // Eagerly into RAM by default; with --ram-budget lazily, host copies within the budget.
    let te_model = Arc::new(mm.read_model("text_encoder", &[te_path])?);
    let dn_model = Arc::new(mm.read_model("denoiser", &[dn_path])?);
    let de_model = Arc::new(mm.read_model("decoder", &[de_path])?);
    let pm_model = Arc::new(mm.read_gguf("prompt_lm", &pm_path)?);
    let device = mm.compute_device();
    let offload = DeviceId::Cpu;
    let te = ModelPatcher::new(te_model, device, offload);
    let mut base =
        ModelPatcher::new(dn_model, device, offload).with_compute_dtype(Some(Dtype::F32));
    base.set_memory_estimator(Arc::new(|shape: &[usize]| {
        // Activations of one step: a few [tokens, 4·H] f32 buffers plus attention scores.
        let tokens = shape.iter().product::<usize>().max(1) as u64;
        ByteSize(tokens * (4 * H as u64) * 4 * 6 + tokens * tokens * HEADS as u64 * 4 * 3)
    }));
    let de = ModelPatcher::new(de_model, device, offload);
    let pm = ModelPatcher::new(pm_model, device, offload);
    // Split every model across the GPUs when asked (before the LoRA clone, which shares it).
    let split = |p: ModelPatcher| -> Result<ModelPatcher> {
        Ok(match args.device_map.as_deref() {
            None => p,
            Some("auto") => {
                let map = DeviceMap::auto(&p, &mm.device_budgets(), Default::default());
                p.with_device_map(map)
            }
            Some(rules) => p.with_device_map(DeviceMap::parse(rules)?),
        })
    };
    let (te, base, de, pm) = (split(te)?, split(base)?, split(de)?, split(pm)?);
    let mut styled = base.clone();
    let lora = lora_file::load(
        args.cache.join("style_lora.safetensors"),
        base.model().keys(),
    )?;
    let patched = styled.add_patches(lora.patches, 1.0, 1.0)?;
    if !args.quiet {
        eprintln!(
            "LoRA: {} weights patched, {} LoRA keys ignored",
            patched.len(),
            lora.unmatched_lora_keys.len()
        );
    }

    let mut prompt_model = PromptModel::new(&pm)?;
    let text_encoder = TextEncoder::new(&te)?;
    let denoiser = Denoiser::new(&base)?;
    let decoder = Decoder::new(&de)?;
    let progress = Progress {
        tty: std::io::stderr().is_terminal(),
        quiet: args.quiet,
    };
    let prompts = [
        "a lighthouse at dusk",
        "the same lighthouse, in watercolour",
        "a lighthouse at dawn",
    ];
    let mut results = Vec::new();
    let mut evictions = Vec::new();
    let mut built_per_model: std::collections::BTreeMap<String, ByteSize> = Default::default();
    let mut kv_peak = ByteSize::ZERO;
    for i in 0..args.prompts {
        let prompt = prompts[i % prompts.len()].to_string();
        let use_lora = i % 3 == 1;
        // 1. text: the prompt model adds a word, the text encoder encodes the result
        let r = mm.load_models_gpu(std::slice::from_ref(&pm), LoadOptions::default())?;
        evictions.extend(r.evicted.clone());
        add_built(&mut built_per_model, &r);
        let (expanded, kv) = {
            let _compute = tracing::info_span!("compute", model = "prompt_lm").entered();
            prompt_model.expand(&prompt, &mm, device)?
        };
        kv_peak = kv_peak.max(kv);
        let r = mm.load_models_gpu(std::slice::from_ref(&te), LoadOptions::default())?;
        evictions.extend(r.evicted.clone());
        add_built(&mut built_per_model, &r);
        let context = {
            let _compute = tracing::info_span!("compute", model = "text_encoder").entered();
            text_encoder.forward(&expanded)?
        };
        // 2. denoise
        let dn = if use_lora { &styled } else { &base };
        let latent_shape = [1, LATENT_HW * LATENT_HW];
        let opts = LoadOptions {
            // Patched weights first: the LoRA's weights become resident rather than re-patched at
            // every step, and going back to the base moves exactly those weights.
            force_patch_weights: true,
            ..LoadOptions::default().with_input_shape(&latent_shape)
        };
        // The denoiser's layers switch to `dn` and `dn` is loaded, in one call.
        let r = denoiser.source.load(&mm, dn, opts)?;
        evictions.extend(r.evicted.clone());
        let denoiser_built = r.built();
        add_built(&mut built_per_model, &r);
        let mut x = weight(
            &[1, LATENT_HW * LATENT_HW, LATENT_C],
            args.seed + i as u64,
            1.0,
        )?;
        let t0 = Instant::now();
        let mut audit = None;
        for s in 0..args.steps {
            let t = 1.0 - s as f32 / args.steps as f32;
            let eps = {
                let _compute =
                    tracing::info_span!("compute", model = "denoiser", step = s).entered();
                if s + 1 == args.steps {
                    // The last step is held against the cost model's prediction for it.
                    let (eps, a) = mm.audit(dn, || denoiser.forward(&x, t, &context));
                    audit = Some(a);
                    eps?
                } else {
                    denoiser.forward(&x, t, &context)?
                }
            };
            x = (x - (eps * (1.0 / args.steps as f64))?)?;
            let elapsed = t0.elapsed().as_secs_f64();
            progress.step(i + 1, s + 1, args.steps, (s + 1) as f64 / elapsed.max(1e-9));
        }
        let step_ms = t0.elapsed().as_secs_f64() * 1e3 / args.steps.max(1) as f64;
        // 3. decode
        let r = mm.load_models_gpu(std::slice::from_ref(&de), LoadOptions::default())?;
        evictions.extend(r.evicted.clone());
        add_built(&mut built_per_model, &r);
        let image = {
            let _compute = tracing::info_span!("compute", model = "decoder").entered();
            decoder.forward(&x)?
        };
        let checksum = checksum(&image)?;
        mm.cleanup_models();
        results.push(PromptResult {
            prompt,
            lora: use_lora,
            checksum,
            step_ms,
            denoiser_built,
            audit,
        });
    }
    let budget = mm.get_total_memory(device);
    let loaded = mm.loaded_models();
    let models = [&pm, &te, &base, &de]
        .iter()
        .map(|p| {
            let name = p.model().name().to_string();
            let resident = loaded
                .iter()
                .find(|m| m.name == name)
                .map(|m| m.resident)
                .unwrap_or_default();
            let size = p.resident_model_size();
            report::ModelRow {
                format: report::format_of(p.model()),
                resident,
                streaming: size.saturating_sub(resident),
                built: built_per_model.get(&name).copied().unwrap_or_default(),
                name,
            }
        })
        .collect();
    Ok(PipelineReport {
        prompts: results,
        budget,
        peak: mm.peak_ledger(device),
        models,
        evictions,
        transfers: mm.transfer_stats(),
        findings: mm
            .transfer_engine()
            .devices()
            .sims()
            .iter()
            .flat_map(|s| s.violations())
            .map(|v| format!("{v:?}"))
            .collect(),
        sims: mm
            .transfer_engine()
            .devices()
            .sims()
            .iter()
            .map(|s| (s.id().to_string(), s.spec().to_string(), s.stats()))
            .collect(),
        host: mm.host_tier().stats(),
        reservations: vec![("prompt_lm kv-cache".to_string(), kv_peak)],
        other_devices: mm
            .device_budgets()
            .into_iter()
            .filter(|(d, _)| *d != device)
            .map(|(d, _)| (d.to_string(), mm.peak_ledger(d), mm.get_total_memory(d)))
            .collect(),
        split: [&pm, &te, &base, &de].iter().map(|p| p.split_stats()).fold(
            residency::patcher::SplitStats::default(),
            |a, s| residency::patcher::SplitStats {
                activation_bytes: a.activation_bytes.saturating_add(s.activation_bytes),
                activation_moves: a.activation_moves + s.activation_moves,
            },
        ),
        dynamic: mm.memory_report().dynamic.then(|| mm.dynamic_report()),
        memory: mm.memory_report().to_string(),
        total_ms: t_start.elapsed().as_secs_f64() * 1e3,
    })
}

fn checksum(t: &Tensor) -> Result<u32> {
    let v = t.flatten_all()?.to_vec1::<f32>()?;
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    Ok(float::crc32(&bytes))
}

struct Progress {
    tty: bool,
    quiet: bool,
}

impl Progress {
    fn step(&self, prompt: usize, step: usize, steps: usize, its: f64) {
        if self.quiet {
            return;
        }
        if self.tty {
            let filled = step * 30 / steps;
            eprint!(
                "\rprompt {prompt} [{}{}] {step}/{steps} {its:.1} it/s",
                "#".repeat(filled),
                "-".repeat(30 - filled)
            );
            if step == steps {
                eprintln!();
            }
            let _ = std::io::stderr().flush();
        } else if step == steps {
            eprintln!("prompt {prompt}: {steps} steps, {its:.1} it/s");
        }
    }
}

/// Adds each loaded model's built bytes (resident copies the load made) to its running total.
fn add_built(totals: &mut std::collections::BTreeMap<String, ByteSize>, r: &residency::LoadReport) {
    for m in &r.models {
        let t = totals.entry(m.name.clone()).or_default();
        *t = t.saturating_add(m.built);
    }
}

/// Splits the example's own flags from residency's.
pub fn parse_args(raw: &[String]) -> std::result::Result<PipelineArgs, String> {
    let mut a = PipelineArgs {
        prompts: 3,
        steps: 8,
        seed: 0,
        json: None,
        cache: PathBuf::from(".cache/pipeline"),
        config: Config::default(),
        quiet: false,
        device_map: None,
        trace: TraceArgs::default(),
    };
    let (trace, raw) = TraceArgs::take_from(raw).map_err(|e| e.to_string())?;
    a.trace = trace;
    let raw = raw.as_slice();
    let mut rest = Vec::new();
    let mut i = 0;
    while i < raw.len() {
        let flag = raw[i].as_str();
        let value = |i: usize| {
            raw.get(i + 1)
                .cloned()
                .ok_or_else(|| format!("{flag} needs a value"))
        };
        match flag {
            "--prompts" => {
                a.prompts = value(i)?
                    .parse()
                    .map_err(|_| "--prompts takes a number".to_string())?;
                i += 2;
            }
            "--steps" => {
                a.steps = value(i)?
                    .parse()
                    .map_err(|_| "--steps takes a number".to_string())?;
                if a.steps == 0 {
                    return Err("--steps must be at least 1".into());
                }
                i += 2;
            }
            "--seed" => {
                a.seed = value(i)?
                    .parse()
                    .map_err(|_| "--seed takes a number".to_string())?;
                i += 2;
            }
            "--json" => {
                a.json = Some(PathBuf::from(value(i)?));
                i += 2;
            }
            "--cache" => {
                a.cache = PathBuf::from(value(i)?);
                i += 2;
            }
            "--quiet" => {
                a.quiet = true;
                i += 1;
            }
            "--device-map" => {
                let spec = value(i)?;
                if spec != "auto" {
                    DeviceMap::parse(&spec).map_err(|e| e.to_string())?;
                }
                a.device_map = Some(spec);
                i += 2;
            }
            "--help" | "-h" => return Err(HELP.into()),
            _ => {
                rest.push(raw[i].clone());
                i += 1;
            }
        }
    }
    a.config = Config::from_args(&rest).map_err(|e| e.to_string())?;
    Ok(a)
}

/// What `parse_args` returns for `--help` (main prints the usage and exits 0).
const HELP: &str = "--help";

const USAGE: &str = "usage: pipeline [--prompts N] [--steps N] [--seed S] [--json FILE] [--cache DIR] [--quiet] [--device-map auto|RULES] [--trace FILE | --tracing] [--timeline FILE] [residency flags]";

#[allow(dead_code)]
fn main() {
    residency::tools::cache_candle_thread_count();
    let raw: Vec<String> = std::env::args().skip(1).collect();
    let args = match parse_args(&raw) {
        Ok(a) => a,
        Err(e) if e == HELP => {
            print!("{USAGE}\nresidency flags:\n{}", Config::flags_help());
            return;
        }
        Err(e) => {
            eprintln!("error: {e}\n{USAGE}\n(--help lists the residency flags)");
            std::process::exit(2);
        }
    };
    let session = match args.trace.start() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    let result = run(&args);
    // Written whatever the outcome: a run that ran out of memory is what a timeline is for.
    if let Some(session) = &session {
        match session.finish() {
            Ok(files) => {
                for f in files {
                    eprintln!("wrote {}", f.display());
                }
            }
            Err(e) => eprintln!("error: {e}"),
        }
    }
    match result {
        Ok(report) => {
            println!("{}", to_table(&report));
            println!("{}", report.memory);
            if let Some(path) = &args.json {
                if let Err(e) = std::fs::write(path, to_json(&report)) {
                    eprintln!("error: cannot write {}: {e}", path.display());
                    std::process::exit(2);
                }
            }
        }
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
