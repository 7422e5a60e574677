//! The pipeline's checkpoints, built once from deterministic weights and saved as safetensors: the
//! three models and a LoRA for the denoiser's attention in kohya naming.

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use residency::float::{self, Dtype, Rounding};
use residency::weights::{save_safetensors, SafetensorsOptions};
use residency::{Error, Result};

use super::models::{BLOCKS, H, LATENT_C, TEXT_BLOCKS, TEXT_H, VOCAB};

fn rng(seed: u64) -> impl FnMut() -> f32 {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

pub fn weight(shape: &[usize], seed: u64, scale: f32) -> Result<Tensor> {
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

pub fn build_checkpoints(dir: &Path) -> Result<()> {
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
