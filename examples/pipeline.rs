//! The main job: a small diffusion-shaped pipeline — text encoder, denoiser, decoder — sharing one
//! memory budget, prompts run back to back, a LoRA clone on prompt 2 and back to the base on
//! prompt 3, smart memory in between. No download, no GPU needed.
//!
//! ```sh
//! cargo run --release --example pipeline -- [--prompts N] [--steps N] [--seed S] [--json FILE]
//!     [--cache DIR] [any residency flag: --vram-budget 64MiB --novram --async-offload 3 ...]
//! ```
//!
//! The models are built once from deterministic weights and saved as safetensors in the cache
//! folder. Without `--vram-budget` the budget is a third of the three models' resident size, so
//! eviction, partial loading and streaming all happen. Because these models are tiny, the example
//! defaults `--reserve-vram 0 --inference-memory 4MiB` (ComfyUI's 0.8 GiB minimum would dwarf
//! them); pass either flag to override.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use residency::attention::{self, AttentionOptions, Backend};
use residency::float::{self, Dtype, Rounding};
use residency::loader::{Eviction, LoadOptions, MemoryManager};
use residency::ops::{
    Conv2d, ConvConfig, ConvTranspose2d, ConvTransposeConfig, GroupNorm, LayerNorm, Linear,
    OpsBuilder, OpsMode, OpsSource,
};
use residency::patcher::{lora_file, ModelPatcher};
use residency::vram::{Config, DeviceId, Hardware};
use residency::weights::{save_safetensors, Model, SafetensorsOptions};
use residency::{ByteSize, Error, Result};

const VOCAB: usize = 512;
const TEXT_H: usize = 128;
const TEXT_BLOCKS: usize = 2;
const TOKENS: usize = 16;
const LATENT_C: usize = 16;
const LATENT_HW: usize = 8;
const H: usize = 256;
const HEADS: usize = 4;
const BLOCKS: usize = 6;

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
}

/// What one prompt produced.
#[derive(Debug, Clone)]
pub struct PromptResult {
    pub prompt: String,
    pub lora: bool,
    pub checksum: u32,
    pub step_ms: f64,
    pub denoiser_moved: ByteSize,
}

/// The whole run.
#[derive(Debug, Clone)]
pub struct PipelineReport {
    pub prompts: Vec<PromptResult>,
    pub budget: ByteSize,
    pub peak: ByteSize,
    pub models: Vec<(String, ByteSize, ByteSize, ByteSize)>,
    pub evictions: Vec<Eviction>,
    pub transfers: residency::offload::TransferSnapshot,
    pub memory: String,
    pub total_ms: f64,
}

fn rng(seed: u64) -> impl FnMut() -> f32 {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

fn weight(shape: &[usize], seed: u64, scale: f32) -> Result<Tensor> {
    let mut r = rng(seed);
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| r() * scale).collect();
    Tensor::from_vec(v, shape, &Device::Cpu).map_err(Error::from)
}

fn ones(n: usize) -> Result<Tensor> {
    Tensor::ones(n, DType::F32, &Device::Cpu).map_err(Error::from)
}
fn zeros(n: usize) -> Result<Tensor> {
    Tensor::zeros(n, DType::F32, &Device::Cpu).map_err(Error::from)
}

type Weights = Vec<(String, Tensor, Dtype)>;

fn push_linear(
    w: &mut Weights,
    name: &str,
    i: usize,
    o: usize,
    seed: &mut u64,
    dtype: Dtype,
) -> Result<()> {
    *seed += 1;
    let t = weight(&[o, i], *seed, 1.0 / (i as f32).sqrt())?;
    w.push((
        format!("{name}.weight"),
        float::from_f32(&t, dtype, Rounding::Nearest)?,
        dtype,
    ));
    w.push((format!("{name}.bias"), zeros(o)?, Dtype::F32));
    Ok(())
}

fn push_norm(w: &mut Weights, name: &str, c: usize) -> Result<()> {
    w.push((format!("{name}.weight"), ones(c)?, Dtype::F32));
    w.push((format!("{name}.bias"), zeros(c)?, Dtype::F32));
    Ok(())
}

fn build_checkpoints(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::File {
        path: dir.to_path_buf(),
        reason: format!("cannot create the cache folder: {e}"),
    })?;
    let mut seed = 1000;
    // Text encoder: a small transformer, f32.
    let mut te: Weights = vec![(
        "embed.weight".into(),
        weight(&[VOCAB, TEXT_H], 1, 0.5)?,
        Dtype::F32,
    )];
    for b in 0..TEXT_BLOCKS {
        let p = format!("blocks.{b}");
        push_norm(&mut te, &format!("{p}.ln1"), TEXT_H)?;
        for n in ["q", "k", "v", "o"] {
            push_linear(
                &mut te,
                &format!("{p}.attn.{n}"),
                TEXT_H,
                TEXT_H,
                &mut seed,
                Dtype::F32,
            )?;
        }
        push_norm(&mut te, &format!("{p}.ln2"), TEXT_H)?;
        push_linear(
            &mut te,
            &format!("{p}.mlp.fc1"),
            TEXT_H,
            4 * TEXT_H,
            &mut seed,
            Dtype::F32,
        )?;
        push_linear(
            &mut te,
            &format!("{p}.mlp.fc2"),
            4 * TEXT_H,
            TEXT_H,
            &mut seed,
            Dtype::F32,
        )?;
    }
    push_norm(&mut te, "final_ln", TEXT_H)?;
    save_safetensors(
        &dir.join("text_encoder.safetensors"),
        &te,
        &SafetensorsOptions::default(),
    )?;
    // Denoiser: attention + cross-attention + MLP blocks, bf16 storage.
    let bf = Dtype::BF16;
    let mut dn: Weights = Vec::new();
    push_linear(&mut dn, "proj_in", LATENT_C, H, &mut seed, bf)?;
    push_linear(&mut dn, "time", 1, H, &mut seed, Dtype::F32)?;
    for b in 0..BLOCKS {
        let p = format!("blocks.{b}");
        push_norm(&mut dn, &format!("{p}.ln1"), H)?;
        for n in ["q", "k", "v", "o"] {
            push_linear(&mut dn, &format!("{p}.attn.{n}"), H, H, &mut seed, bf)?;
        }
        push_norm(&mut dn, &format!("{p}.ln2"), H)?;
        push_linear(&mut dn, &format!("{p}.cross.q"), H, H, &mut seed, bf)?;
        push_linear(&mut dn, &format!("{p}.cross.k"), TEXT_H, H, &mut seed, bf)?;
        push_linear(&mut dn, &format!("{p}.cross.v"), TEXT_H, H, &mut seed, bf)?;
        push_linear(&mut dn, &format!("{p}.cross.o"), H, H, &mut seed, bf)?;
        push_norm(&mut dn, &format!("{p}.ln3"), H)?;
        push_linear(&mut dn, &format!("{p}.mlp.fc1"), H, 4 * H, &mut seed, bf)?;
        push_linear(&mut dn, &format!("{p}.mlp.fc2"), 4 * H, H, &mut seed, bf)?;
    }
    push_norm(&mut dn, "final_ln", H)?;
    push_linear(&mut dn, "proj_out", H, LATENT_C, &mut seed, bf)?;
    save_safetensors(
        &dir.join("denoiser.safetensors"),
        &dn,
        &SafetensorsOptions::default(),
    )?;
    // Decoder: a conv network 16×8×8 → 3×32×32, f32.
    let mut de: Weights = Vec::new();
    let mut conv = |w: &mut Weights,
                    name: &str,
                    o: usize,
                    i: usize,
                    k: usize,
                    transpose: bool|
     -> Result<()> {
        seed += 1;
        let shape = if transpose {
            [i, o, k, k]
        } else {
            [o, i, k, k]
        };
        w.push((
            format!("{name}.weight"),
            weight(&shape, seed, 1.0 / ((i * k * k) as f32).sqrt())?,
            Dtype::F32,
        ));
        w.push((format!("{name}.bias"), zeros(o)?, Dtype::F32));
        Ok(())
    };
    conv(&mut de, "conv_in", 64, LATENT_C, 3, false)?;
    push_norm(&mut de, "norm1", 64)?;
    conv(&mut de, "up1", 32, 64, 4, true)?;
    push_norm(&mut de, "norm2", 32)?;
    conv(&mut de, "up2", 16, 32, 4, true)?;
    conv(&mut de, "conv_out", 3, 16, 3, false)?;
    save_safetensors(
        &dir.join("decoder.safetensors"),
        &de,
        &SafetensorsOptions::default(),
    )?;
    // A LoRA for the denoiser's attention, in kohya naming (read back through `lora_file::load`).
    let mut lo: Vec<(String, Tensor, Dtype)> = Vec::new();
    for b in 0..BLOCKS / 2 {
        for n in ["q", "v"] {
            let base = format!("lora_unet_blocks_{b}_attn_{n}");
            lo.push((
                format!("{base}.lora_up.weight"),
                weight(&[H, 8], 7 + b as u64, 0.5)?,
                Dtype::F32,
            ));
            lo.push((
                format!("{base}.lora_down.weight"),
                weight(&[8, H], 9 + b as u64, 0.5)?,
                Dtype::F32,
            ));
            lo.push((
                format!("{base}.alpha"),
                Tensor::new(4f32, &Device::Cpu)?,
                Dtype::F32,
            ));
        }
    }
    save_safetensors(
        &dir.join("style_lora.safetensors"),
        &lo,
        &SafetensorsOptions::default(),
    )?;
    std::fs::write(dir.join("READY"), b"v1").map_err(|e| Error::File {
        path: dir.join("READY"),
        reason: e.to_string(),
    })
}

struct Block {
    ln1: LayerNorm,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    ln2: LayerNorm,
    cq: Option<Linear>,
    ck: Option<Linear>,
    cv: Option<Linear>,
    co: Option<Linear>,
    ln3: Option<LayerNorm>,
    fc1: Linear,
    fc2: Linear,
}

fn attn(q: &Tensor, k: &Tensor, v: &Tensor, heads: usize) -> Result<Tensor> {
    attention::attention(q, k, v, heads, None, &AttentionOptions::new(Backend::Naive))
}

impl Block {
    fn new(vb: &OpsBuilder, cross: bool) -> Result<Block> {
        let c = |n: &str| -> Result<Option<Linear>> {
            if cross {
                vb.pp("cross").linear(n, true).map(Some)
            } else {
                Ok(None)
            }
        };
        Ok(Block {
            ln1: vb.layer_norm("ln1", 1e-5, true)?,
            q: vb.pp("attn").linear("q", true)?,
            k: vb.pp("attn").linear("k", true)?,
            v: vb.pp("attn").linear("v", true)?,
            o: vb.pp("attn").linear("o", true)?,
            ln2: vb.layer_norm("ln2", 1e-5, true)?,
            cq: c("q")?,
            ck: c("k")?,
            cv: c("v")?,
            co: c("o")?,
            ln3: if cross {
                Some(vb.layer_norm("ln3", 1e-5, true)?)
            } else {
                None
            },
            fc1: vb.pp("mlp").linear("fc1", true)?,
            fc2: vb.pp("mlp").linear("fc2", true)?,
        })
    }

    fn forward(&self, x: &Tensor, context: Option<&Tensor>, heads: usize) -> Result<Tensor> {
        let h = self.ln1.try_forward(x)?;
        let a = attn(
            &self.q.try_forward(&h)?,
            &self.k.try_forward(&h)?,
            &self.v.try_forward(&h)?,
            heads,
        )?;
        let mut x = (x + self.o.try_forward(&a)?)?;
        let mlp_norm = if let (Some(cq), Some(ck), Some(cv), Some(co), Some(ctx), Some(ln3)) =
            (&self.cq, &self.ck, &self.cv, &self.co, context, &self.ln3)
        {
            let h = self.ln2.try_forward(&x)?;
            let a = attn(
                &cq.try_forward(&h)?,
                &ck.try_forward(ctx)?,
                &cv.try_forward(ctx)?,
                heads,
            )?;
            x = (x + co.try_forward(&a)?)?;
            ln3
        } else {
            &self.ln2
        };
        let h = self.fc1.try_forward(&mlp_norm.try_forward(&x)?)?.gelu()?;
        Ok((x + self.fc2.try_forward(&h)?)?)
    }
}

struct TextEncoder {
    source: OpsSource,
    embed: residency::ops::Embedding,
    blocks: Vec<Block>,
    norm: LayerNorm,
}

impl TextEncoder {
    fn new(p: &ModelPatcher) -> Result<Self> {
        let vb = OpsBuilder::new(p, OpsMode::DisableWeightInit);
        Ok(TextEncoder {
            source: vb.source().clone(),
            embed: vb.embedding("embed")?,
            blocks: (0..TEXT_BLOCKS)
                .map(|b| Block::new(&vb.pp("blocks").pp(b), false))
                .collect::<Result<_>>()?,
            norm: vb.layer_norm("final_ln", 1e-5, true)?,
        })
    }
    fn forward(&self, prompt: &str) -> Result<Tensor> {
        let ids: Vec<u32> = (0..TOKENS)
            .map(|i| {
                let word = prompt
                    .split_whitespace()
                    .nth(i % prompt.split_whitespace().count().max(1))
                    .unwrap_or("");
                (float::crc32(format!("{word}/{i}").as_bytes()) as usize % VOCAB) as u32
            })
            .collect();
        let ids = Tensor::from_vec(ids, (1, TOKENS), &Device::Cpu)?;
        let mut x = self.embed.try_forward(&ids)?;
        for b in &self.blocks {
            x = b.forward(&x, None, HEADS)?;
        }
        let out = self.norm.try_forward(&x)?;
        self.source.finish_forward();
        Ok(out)
    }
}

struct Denoiser {
    source: OpsSource,
    proj_in: Linear,
    time: Linear,
    blocks: Vec<Block>,
    norm: LayerNorm,
    proj_out: Linear,
}

impl Denoiser {
    fn new(p: &ModelPatcher) -> Result<Self> {
        let vb = OpsBuilder::new(
            p,
            OpsMode::ManualCast {
                compute: Dtype::F32,
            },
        );
        Ok(Denoiser {
            source: vb.source().clone(),
            proj_in: vb.linear("proj_in", true)?,
            time: vb.linear("time", true)?,
            blocks: (0..BLOCKS)
                .map(|b| Block::new(&vb.pp("blocks").pp(b), true))
                .collect::<Result<_>>()?,
            norm: vb.layer_norm("final_ln", 1e-5, true)?,
            proj_out: vb.linear("proj_out", true)?,
        })
    }
    /// Predicts the noise of latent tokens `[1, 64, 16]` at time `t`.
    fn forward(&self, x: &Tensor, t: f32, context: &Tensor) -> Result<Tensor> {
        let temb = self.time.try_forward(&Tensor::new(&[[t]], &Device::Cpu)?)?;
        let mut h = self.proj_in.try_forward(x)?.broadcast_add(&temb)?;
        for b in &self.blocks {
            h = b.forward(&h, Some(context), HEADS)?;
        }
        let out = self.proj_out.try_forward(&self.norm.try_forward(&h)?)?;
        self.source.finish_forward();
        Ok(out)
    }
}

struct Decoder {
    source: OpsSource,
    conv_in: Conv2d,
    norm1: GroupNorm,
    up1: ConvTranspose2d,
    norm2: GroupNorm,
    up2: ConvTranspose2d,
    conv_out: Conv2d,
}

impl Decoder {
    fn new(p: &ModelPatcher) -> Result<Self> {
        let vb = OpsBuilder::new(p, OpsMode::DisableWeightInit);
        let pad1 = ConvConfig {
            padding: 1,
            ..ConvConfig::default()
        };
        let up = ConvTransposeConfig {
            padding: 1,
            stride: 2,
            ..ConvTransposeConfig::default()
        };
        Ok(Decoder {
            source: vb.source().clone(),
            conv_in: vb.conv2d("conv_in", pad1, true)?,
            norm1: vb.group_norm("norm1", 8, 1e-5)?,
            up1: vb.conv_transpose2d("up1", up, true)?,
            norm2: vb.group_norm("norm2", 8, 1e-5)?,
            up2: vb.conv_transpose2d("up2", up, true)?,
            conv_out: vb.conv2d("conv_out", pad1, true)?,
        })
    }
    fn forward(&self, latent: &Tensor) -> Result<Tensor> {
        let x = latent
            .transpose(1, 2)?
            .reshape((1, LATENT_C, LATENT_HW, LATENT_HW))?;
        let x = self.conv_in.try_forward(&x)?;
        let x = self.up1.try_forward(&self.norm1.try_forward(&x)?.silu()?)?;
        let x = self.up2.try_forward(&self.norm2.try_forward(&x)?.silu()?)?;
        let out = self.conv_out.try_forward(&x)?.tanh()?;
        self.source.finish_forward();
        Ok(out)
    }
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

/// Adds each loaded model's moved bytes to its running total.
fn add_moved(totals: &mut std::collections::BTreeMap<String, ByteSize>, r: &residency::LoadReport) {
    for m in &r.models {
        let t = totals.entry(m.name.clone()).or_default();
        *t = t.saturating_add(m.moved);
    }
}

/// Runs the pipeline.
pub fn run(args: &PipelineArgs) -> Result<PipelineReport> {
    let t_start = Instant::now();
    if !args.cache.join("READY").exists() {
        build_checkpoints(&args.cache)?;
    }
    let te_model = Arc::new(Model::from_safetensors(
        "text_encoder",
        &[args.cache.join("text_encoder.safetensors")],
    )?);
    let dn_model = Arc::new(Model::from_safetensors(
        "denoiser",
        &[args.cache.join("denoiser.safetensors")],
    )?);
    let de_model = Arc::new(Model::from_safetensors(
        "decoder",
        &[args.cache.join("decoder.safetensors")],
    )?);

    let mut config = args.config.clone();
    if config.reserve_vram_gb.is_none() {
        config.reserve_vram_gb = Some(0.0);
    }
    if config.inference_memory.is_none() {
        config.inference_memory = Some(ByteSize::mib(4));
    }
    let hardware = Hardware::probe();
    let f32_total = ByteSize(
        te_model.model_size().bytes()
            + dn_model.model_size().bytes() * 2
            + de_model.model_size().bytes(),
    );
    if config.vram_budget.is_none() && hardware.gpus.is_empty() {
        config.vram_budget = Some(ByteSize(f32_total.bytes() / 3));
    }
    let mm = MemoryManager::new(config, hardware)?;
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
    let mut moved_per_model: std::collections::BTreeMap<String, ByteSize> = Default::default();
    for i in 0..args.prompts {
        let prompt = prompts[i % prompts.len()].to_string();
        let use_lora = i % 3 == 1;
        // 1. text
        let r = mm.load_models_gpu(std::slice::from_ref(&te), LoadOptions::default())?;
        evictions.extend(r.evicted.clone());
        add_moved(&mut moved_per_model, &r);
        let context = text_encoder.forward(&prompt)?;
        // 2. denoise
        let dn = if use_lora { &styled } else { &base };
        denoiser.source.set_patcher(dn)?;
        let latent_shape = [1, LATENT_HW * LATENT_HW];
        let opts = LoadOptions {
            // Patched weights first: the LoRA's weights become resident rather than re-patched at
            // every step, and going back to the base moves exactly those weights.
            force_patch_weights: true,
            ..LoadOptions::default().with_memory_required(dn.memory_required(&latent_shape))
        };
        let r = mm.load_models_gpu(std::slice::from_ref(dn), opts)?;
        evictions.extend(r.evicted.clone());
        let denoiser_moved = r.moved();
        add_moved(&mut moved_per_model, &r);
        let mut x = weight(
            &[1, LATENT_HW * LATENT_HW, LATENT_C],
            args.seed + i as u64,
            1.0,
        )?;
        let t0 = Instant::now();
        for s in 0..args.steps {
            let t = 1.0 - s as f32 / args.steps as f32;
            let eps = denoiser.forward(&x, t, &context)?;
            x = (x - (eps * (1.0 / args.steps as f64))?)?;
            let elapsed = t0.elapsed().as_secs_f64();
            progress.step(i + 1, s + 1, args.steps, (s + 1) as f64 / elapsed.max(1e-9));
        }
        let step_ms = t0.elapsed().as_secs_f64() * 1e3 / args.steps.max(1) as f64;
        // 3. decode
        let r = mm.load_models_gpu(std::slice::from_ref(&de), LoadOptions::default())?;
        evictions.extend(r.evicted.clone());
        add_moved(&mut moved_per_model, &r);
        let image = decoder.forward(&x)?;
        let checksum = checksum(&image)?;
        mm.cleanup_models();
        results.push(PromptResult {
            prompt,
            lora: use_lora,
            checksum,
            step_ms,
            denoiser_moved,
        });
    }
    let budget = mm.get_total_memory(device);
    let loaded = mm.loaded_models();
    let models = [&te, &base, &de]
        .iter()
        .map(|p| {
            let name = p.model().name().to_string();
            let resident = loaded
                .iter()
                .find(|m| m.name == name)
                .map(|m| m.resident)
                .unwrap_or_default();
            let size = p.resident_model_size();
            (
                name.clone(),
                resident,
                size.saturating_sub(resident),
                moved_per_model.get(&name).copied().unwrap_or_default(),
            )
        })
        .collect();
    Ok(PipelineReport {
        prompts: results,
        budget,
        peak: mm.peak_ledger(device),
        models,
        evictions,
        transfers: mm.transfer_stats(),
        memory: mm.memory_report().to_string(),
        total_ms: t_start.elapsed().as_secs_f64() * 1e3,
    })
}

fn json_escape(s: &str) -> String {
    s.chars()
        .flat_map(|c| match c {
            '"' => vec!['\\', '"'],
            '\\' => vec!['\\', '\\'],
            '\n' => vec!['\\', 'n'],
            c if (c as u32) < 0x20 => format!("\\u{:04x}", c as u32).chars().collect(),
            c => vec![c],
        })
        .collect()
}

/// The report as JSON.
pub fn to_json(r: &PipelineReport) -> String {
    let prompts: Vec<String> = r
        .prompts
        .iter()
        .map(|p| {
            format!(
                "{{\"prompt\":\"{}\",\"lora\":{},\"checksum\":\"{:08x}\",\"step_ms\":{:.3},\"denoiser_moved_bytes\":{}}}",
                json_escape(&p.prompt),
                p.lora,
                p.checksum,
                p.step_ms,
                p.denoiser_moved.bytes()
            )
        })
        .collect();
    let models: Vec<String> = r
        .models
        .iter()
        .map(|(n, res, st, mv)| {
            format!(
                "{{\"name\":\"{}\",\"resident_bytes\":{},\"streaming_bytes\":{},\"moved_bytes\":{}}}",
                json_escape(n),
                res.bytes(),
                st.bytes(),
                mv.bytes()
            )
        })
        .collect();
    let evictions: Vec<String> = r
        .evictions
        .iter()
        .map(|e| {
            format!(
                "{{\"model\":\"{}\",\"device\":\"{}\",\"freed_bytes\":{},\"fully\":{},\"reason\":\"{}\"}}",
                json_escape(&e.name),
                e.device,
                e.freed.bytes(),
                e.fully,
                json_escape(&e.reason)
            )
        })
        .collect();
    let t = &r.transfers;
    format!(
        "{{\"budget_bytes\":{},\"peak_ledger_bytes\":{},\"total_ms\":{:.1},\"prompts\":[{}],\"models\":[{}],\"evictions\":[{}],\"transfers\":{{\"bytes\":{},\"staged_bytes\":{},\"fetches\":{},\"prefetch_hits\":{},\"prefetch_misses\":{},\"wait_ms\":{:.3}}}}}",
        r.budget.bytes(),
        r.peak.bytes(),
        r.total_ms,
        prompts.join(","),
        models.join(","),
        evictions.join(","),
        t.bytes_transferred.bytes(),
        t.bytes_staged.bytes(),
        t.fetches,
        t.prefetch_hits,
        t.prefetch_misses,
        t.wait_ns as f64 / 1e6
    )
}

/// The report as a table for people.
pub fn to_table(r: &PipelineReport) -> String {
    let mut s = String::new();
    s.push_str(&format!(
        "{:<14} {:>12} {:>12} {:>12}\n",
        "model", "resident", "streaming", "moved"
    ));
    for (n, res, st, mv) in &r.models {
        s.push_str(&format!(
            "{:<14} {:>12} {:>12} {:>12}\n",
            n,
            res.to_string(),
            st.to_string(),
            mv.to_string()
        ));
    }
    s.push_str(&format!("peak ledger {} of budget {}\n", r.peak, r.budget));
    for p in &r.prompts {
        s.push_str(&format!(
            "prompt {:<38} lora {:<5} checksum {:08x}  {:.1} ms/step  denoiser moved {}\n",
            format!("\"{}\"", p.prompt),
            p.lora,
            p.checksum,
            p.step_ms,
            p.denoiser_moved
        ));
    }
    s.push_str(&format!("{} evictions", r.evictions.len()));
    if let Some(e) = r.evictions.first() {
        s.push_str(&format!(
            " (first: {} freed {} because {})",
            e.name, e.freed, e.reason
        ));
    }
    s.push('\n');
    let t = &r.transfers;
    s.push_str(&format!(
        "transfers: {} streamed, prefetch {} hits / {} misses, {:.1} ms waiting; total {:.0} ms\n",
        t.bytes_transferred,
        t.prefetch_hits,
        t.prefetch_misses,
        t.wait_ns as f64 / 1e6,
        r.total_ms
    ));
    s
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
    };
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
            _ => {
                rest.push(raw[i].clone());
                i += 1;
            }
        }
    }
    a.config = Config::from_args(&rest).map_err(|e| e.to_string())?;
    Ok(a)
}

#[allow(dead_code)]
fn main() {
    let raw: Vec<String> = std::env::args().skip(1).collect();
    let args = match parse_args(&raw) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e}\nusage: pipeline [--prompts N] [--steps N] [--seed S] [--json FILE] [--cache DIR] [residency flags]");
            std::process::exit(2);
        }
    };
    match run(&args) {
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
