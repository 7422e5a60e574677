//! The pipeline's checkpoints, built once from deterministic weights: the three `residency::nn`
//! models and a LoRA for the denoiser's attention in kohya naming as safetensors, and the prompt
//! model as a quantized GGUF file (written with candle's GGUF writer).

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use residency::float::{self, Dtype, Rounding};
use residency::weights::{save_safetensors, SafetensorsOptions};
use residency::{Error, Result};

use super::models::{BLOCKS, H, LATENT_C, PLM_EMBD, PLM_VOCAB, TEXT_BLOCKS, TEXT_H, VOCAB};

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
        dir.join("text_encoder.safetensors"),
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
        dir.join("denoiser.safetensors"),
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
        dir.join("decoder.safetensors"),
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
        dir.join("style_lora.safetensors"),
        &lo,
        &SafetensorsOptions::default(),
    )?;
    build_prompt_lm(&dir.join("prompt_lm.gguf"))?;
    std::fs::write(dir.join("READY"), READY).map_err(|e| Error::File {
        path: dir.join("READY"),
        reason: e.to_string(),
    })
}

/// What `READY` holds once every checkpoint of this version is written.
pub const READY: &[u8] = b"v2";

/// The prompt model: a tiny Llama-architecture language model over bytes (vocabulary 256,
/// embedding 256, 2 blocks, 4 query and 2 key/value heads, feed-forward 512), quantized as GGUF
/// files are in practice: Q8_0 embeddings, Q4_K attention and gate/up matrices, Q6_K value, down
/// and output matrices, f32 norms.
fn build_prompt_lm(path: &Path) -> Result<()> {
    use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
    use gguf_file::Value;
    let (e, ffn, kv) = (PLM_EMBD, 2 * PLM_EMBD, PLM_EMBD / 2);
    let mut specs: Vec<(String, Vec<usize>, GgmlDType, f32)> = vec![
        (
            "token_embd.weight".into(),
            vec![PLM_VOCAB, e],
            GgmlDType::Q8_0,
            1.0,
        ),
        ("output_norm.weight".into(), vec![e], GgmlDType::F32, 0.0),
        (
            "output.weight".into(),
            vec![PLM_VOCAB, e],
            GgmlDType::Q6K,
            0.5,
        ),
    ];
    for b in 0..2 {
        let p = format!("blk.{b}");
        specs.extend([
            (
                format!("{p}.attn_norm.weight"),
                vec![e],
                GgmlDType::F32,
                0.0,
            ),
            (
                format!("{p}.attn_q.weight"),
                vec![e, e],
                GgmlDType::Q4K,
                0.1,
            ),
            (
                format!("{p}.attn_k.weight"),
                vec![kv, e],
                GgmlDType::Q4K,
                0.1,
            ),
            (
                format!("{p}.attn_v.weight"),
                vec![kv, e],
                GgmlDType::Q6K,
                0.1,
            ),
            (
                format!("{p}.attn_output.weight"),
                vec![e, e],
                GgmlDType::Q4K,
                0.1,
            ),
            (format!("{p}.ffn_norm.weight"), vec![e], GgmlDType::F32, 0.0),
            (
                format!("{p}.ffn_gate.weight"),
                vec![ffn, e],
                GgmlDType::Q4K,
                0.1,
            ),
            (
                format!("{p}.ffn_up.weight"),
                vec![ffn, e],
                GgmlDType::Q4K,
                0.1,
            ),
            (
                format!("{p}.ffn_down.weight"),
                vec![e, ffn],
                GgmlDType::Q6K,
                0.07,
            ),
        ]);
    }
    let mut tensors = Vec::new();
    for (i, (name, shape, ggml, scale)) in specs.into_iter().enumerate() {
        // Norm gains are 1 (scale 0); matrices uniform in ±scale.
        let t = if scale == 0.0 {
            ones(shape[0])?
        } else {
            weight(&shape, 5000 + i as u64, scale)?
        };
        tensors.push((name, QTensor::quantize(&t, ggml)?));
    }
    let md = [
        ("general.architecture", Value::String("llama".into())),
        ("llama.attention.head_count", Value::U32(4)),
        ("llama.attention.head_count_kv", Value::U32(2)),
        ("llama.block_count", Value::U32(2)),
        ("llama.embedding_length", Value::U32(e as u32)),
        ("llama.rope.dimension_count", Value::U32((e / 4) as u32)),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
    ];
    let md: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (*k, v)).collect();
    let ts: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, q)| (k.as_str(), q)).collect();
    let file_err = |e: String| Error::File {
        path: path.to_path_buf(),
        reason: e,
    };
    let mut f =
        std::io::BufWriter::new(std::fs::File::create(path).map_err(|e| file_err(e.to_string()))?);
    gguf_file::write(&mut f, &md, &ts).map_err(|e| file_err(e.to_string()))?;
    std::io::Write::flush(&mut f).map_err(|e| file_err(e.to_string()))
}
