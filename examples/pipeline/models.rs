//! The pipeline's three models, written as candle-nn code and ported with one line,
//! `use residency::nn as candle_nn;` (docs/PORTING.md): a text encoder (a small transformer), a
//! denoiser (attention, cross-attention and MLP blocks) and a conv decoder. Their layers hold the
//! keys of their weights and fetch them at every forward, so the manager schedules them like any
//! weight. Their weights come from the checkpoints `checkpoints.rs` writes.

use candle_core::{Device, Module, Tensor};
use residency::attention::{self, AttentionOptions, Backend};
use residency::float::{self, Dtype};
use residency::nn as candle_nn;
use residency::ops::{OpsMode, OpsSource};
use residency::patcher::ModelPatcher;
use residency::Result;

pub const VOCAB: usize = 512;
pub const TEXT_H: usize = 128;
pub const TEXT_BLOCKS: usize = 2;
pub const TOKENS: usize = 16;
pub const LATENT_C: usize = 16;
pub const LATENT_HW: usize = 8;
pub const H: usize = 256;
pub const HEADS: usize = 4;
pub const BLOCKS: usize = 6;
/// The prompt model's vocabulary (bytes) and width.
pub const PLM_VOCAB: usize = 256;
pub const PLM_EMBD: usize = 256;
/// Tokens the prompt model adds to each prompt.
pub const PLM_NEW_TOKENS: usize = 6;
/// The prompt model's KV cache per token: 2 blocks × (K and V) × 2 heads × 64 dimensions × f32.
pub const PLM_KV_BYTES_PER_TOKEN: usize = 2 * 2 * (PLM_EMBD / 2) * 4;

/// Attention of `q` over `k`/`v` and its output projection.
struct Attention {
    q: candle_nn::Linear,
    k: candle_nn::Linear,
    v: candle_nn::Linear,
    o: candle_nn::Linear,
}

impl Attention {
    /// Queries from width `h`, keys and values from width `kv`, under `vb` (`q`, `k`, `v`, `o`).
    fn new(h: usize, kv: usize, vb: candle_nn::VarBuilder<'_>) -> candle_core::Result<Self> {
        Ok(Attention {
            q: candle_nn::linear(h, h, vb.pp("q"))?,
            k: candle_nn::linear(kv, h, vb.pp("k"))?,
            v: candle_nn::linear(kv, h, vb.pp("v"))?,
            o: candle_nn::linear(h, h, vb.pp("o"))?,
        })
    }

    fn forward(&self, x: &Tensor, kv: &Tensor, heads: usize) -> candle_core::Result<Tensor> {
        let a = attention::attention(
            &self.q.forward(x)?,
            &self.k.forward(kv)?,
            &self.v.forward(kv)?,
            heads,
            None,
            &AttentionOptions::new(Backend::Naive),
        )?;
        self.o.forward(&a)
    }
}

/// A cross-attention over the text encoder's output and the norm of the MLP after it.
struct Cross {
    attn: Attention,
    /// `ln3`: with cross-attention the MLP reads its own norm.
    mlp_norm: candle_nn::LayerNorm,
}

/// A transformer block: self-attention, then (in the denoiser) cross-attention, then an MLP,
/// each after a layer norm and added to the residual.
struct Block {
    ln1: candle_nn::LayerNorm,
    attn: Attention,
    ln2: candle_nn::LayerNorm,
    cross: Option<Cross>,
    fc1: candle_nn::Linear,
    fc2: candle_nn::Linear,
}

impl Block {
    /// A block of width `h`; with `context`, a cross-attention over a context of that width.
    fn new(
        h: usize,
        context: Option<usize>,
        vb: candle_nn::VarBuilder<'_>,
    ) -> candle_core::Result<Block> {
        Ok(Block {
            ln1: candle_nn::layer_norm(h, 1e-5, vb.pp("ln1"))?,
            attn: Attention::new(h, h, vb.pp("attn"))?,
            ln2: candle_nn::layer_norm(h, 1e-5, vb.pp("ln2"))?,
            cross: match context {
                Some(c) => Some(Cross {
                    attn: Attention::new(h, c, vb.pp("cross"))?,
                    mlp_norm: candle_nn::layer_norm(h, 1e-5, vb.pp("ln3"))?,
                }),
                None => None,
            },
            fc1: candle_nn::linear(h, 4 * h, vb.pp("mlp").pp("fc1"))?,
            fc2: candle_nn::linear(4 * h, h, vb.pp("mlp").pp("fc2"))?,
        })
    }

    fn forward(
        &self,
        x: &Tensor,
        context: Option<&Tensor>,
        heads: usize,
    ) -> candle_core::Result<Tensor> {
        let h = self.ln1.forward(x)?;
        let mut x = (x + self.attn.forward(&h, &h, heads)?)?;
        let mlp_norm = match (&self.cross, context) {
            (Some(cross), Some(ctx)) => {
                let h = self.ln2.forward(&x)?;
                x = (x + cross.attn.forward(&h, ctx, heads)?)?;
                &cross.mlp_norm
            }
            _ => &self.ln2,
        };
        let h = self.fc1.forward(&mlp_norm.forward(&x)?)?.gelu()?;
        x + self.fc2.forward(&h)?
    }
}

pub struct TextEncoder {
    embed: candle_nn::Embedding,
    blocks: Vec<Block>,
    norm: candle_nn::LayerNorm,
}

impl TextEncoder {
    pub fn new(p: &ModelPatcher) -> Result<Self> {
        let vb = candle_nn::VarBuilder::from_patcher(p, OpsMode::DisableWeightInit)?;
        Ok(TextEncoder {
            embed: candle_nn::embedding(VOCAB, TEXT_H, vb.pp("embed"))?,
            blocks: (0..TEXT_BLOCKS)
                .map(|b| Block::new(TEXT_H, None, vb.pp("blocks").pp(b)))
                .collect::<candle_core::Result<_>>()?,
            norm: candle_nn::layer_norm(TEXT_H, 1e-5, vb.pp("final_ln"))?,
        })
    }
    pub fn forward(&self, prompt: &str) -> Result<Tensor> {
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
        let mut x = self.embed.forward(&ids)?;
        for b in &self.blocks {
            x = b.forward(&x, None, HEADS)?;
        }
        Ok(self.norm.forward(&x)?)
    }
}

pub struct Denoiser {
    /// What every layer fetches through: switched between the base and the LoRA clone per
    /// prompt by [`OpsSource::load`].
    pub source: OpsSource,
    proj_in: candle_nn::Linear,
    time: candle_nn::Linear,
    blocks: Vec<Block>,
    norm: candle_nn::LayerNorm,
    proj_out: candle_nn::Linear,
}

impl Denoiser {
    pub fn new(p: &ModelPatcher) -> Result<Self> {
        // Stored in bf16, computed in f32: every layer casts its weights at use.
        let source = OpsSource::new(p);
        let vb = candle_nn::VarBuilder::from_source(
            &source,
            OpsMode::ManualCast {
                compute: Dtype::F32,
            },
        )?;
        Ok(Denoiser {
            proj_in: candle_nn::linear(LATENT_C, H, vb.pp("proj_in"))?,
            time: candle_nn::linear(1, H, vb.pp("time"))?,
            blocks: (0..BLOCKS)
                .map(|b| Block::new(H, Some(TEXT_H), vb.pp("blocks").pp(b)))
                .collect::<candle_core::Result<_>>()?,
            norm: candle_nn::layer_norm(H, 1e-5, vb.pp("final_ln"))?,
            proj_out: candle_nn::linear(H, LATENT_C, vb.pp("proj_out"))?,
            source,
        })
    }
    /// Predicts the noise of latent tokens `[1, 64, 16]` at time `t`.
    pub fn forward(&self, x: &Tensor, t: f32, context: &Tensor) -> Result<Tensor> {
        let temb = self.time.forward(&Tensor::new(&[[t]], &Device::Cpu)?)?;
        let mut h = self.proj_in.forward(x)?.broadcast_add(&temb)?;
        for b in &self.blocks {
            h = b.forward(&h, Some(context), HEADS)?;
        }
        Ok(self.proj_out.forward(&self.norm.forward(&h)?)?)
    }
}

pub struct Decoder {
    conv_in: candle_nn::Conv2d,
    norm1: candle_nn::GroupNorm,
    up1: candle_nn::ConvTranspose2d,
    norm2: candle_nn::GroupNorm,
    up2: candle_nn::ConvTranspose2d,
    conv_out: candle_nn::Conv2d,
}

impl Decoder {
    pub fn new(p: &ModelPatcher) -> Result<Self> {
        let vb = candle_nn::VarBuilder::from_patcher(p, OpsMode::DisableWeightInit)?;
        let pad1 = candle_nn::Conv2dConfig {
            padding: 1,
            ..Default::default()
        };
        let up = candle_nn::ConvTranspose2dConfig {
            padding: 1,
            stride: 2,
            ..Default::default()
        };
        Ok(Decoder {
            conv_in: candle_nn::conv2d(LATENT_C, 64, 3, pad1, vb.pp("conv_in"))?,
            norm1: candle_nn::group_norm(8, 64, 1e-5, vb.pp("norm1"))?,
            up1: candle_nn::conv_transpose2d(64, 32, 4, up, vb.pp("up1"))?,
            norm2: candle_nn::group_norm(8, 32, 1e-5, vb.pp("norm2"))?,
            up2: candle_nn::conv_transpose2d(32, 16, 4, up, vb.pp("up2"))?,
            conv_out: candle_nn::conv2d(16, 3, 3, pad1, vb.pp("conv_out"))?,
        })
    }
    pub fn forward(&self, latent: &Tensor) -> Result<Tensor> {
        let x = latent
            .transpose(1, 2)?
            .reshape((1, LATENT_C, LATENT_HW, LATENT_HW))?;
        let x = self.conv_in.forward(&x)?;
        let x = self.up1.forward(&self.norm1.forward(&x)?.silu()?)?;
        let x = self.up2.forward(&self.norm2.forward(&x)?.silu()?)?;
        Ok(self.conv_out.forward(&x)?.tanh()?)
    }
}

/// The prompt model: candle-transformers' `quantized_llama`, ported by its `use` lines, on a
/// quantized GGUF model under the manager. It continues each prompt by a few greedy tokens, which
/// the text encoder then reads as one more word.
pub struct PromptModel {
    model: super::quantized_llama::ModelWeights,
    device: Device,
}

impl PromptModel {
    pub fn new(patcher: &ModelPatcher) -> Result<Self> {
        let ct = residency::quantized::gguf_file::Content::from_patcher(patcher);
        let device = patcher.load_device().to_candle()?;
        let mut unused = std::io::Cursor::new(Vec::<u8>::new());
        let model = super::quantized_llama::ModelWeights::from_gguf(ct, &mut unused, &device)?;
        Ok(PromptModel { model, device })
    }

    /// The prompt with one more word: the model's greedy continuation of its bytes, spelled in
    /// lower-case letters. Its KV cache is held as a reservation on `device` that grows with
    /// every token (the model's own cache tensors are what it reserves room for); returns the
    /// cache's largest size too.
    pub fn expand(
        &mut self,
        prompt: &str,
        mm: &residency::loader::MemoryManager,
        device: residency::vram::DeviceId,
    ) -> Result<(String, residency::ByteSize)> {
        let ids: Vec<u32> = prompt.bytes().map(u32::from).collect();
        let mut input = Tensor::new(ids.as_slice(), &self.device)?.unsqueeze(0)?;
        let mut kv = mm.reserve_named("prompt_lm kv-cache", device, residency::ByteSize::ZERO)?;
        let mut pos = 0;
        let mut word = String::new();
        for _ in 0..PLM_NEW_TOKENS {
            kv.grow(
                mm,
                residency::ByteSize((input.dim(1)? * PLM_KV_BYTES_PER_TOKEN) as u64),
            )?;
            let logits = self.model.forward(&input, pos)?.flatten_all()?;
            pos += input.dim(1)?;
            let next = logits.argmax(0)?.to_scalar::<u32>()?;
            word.push((b'a' + (next % 26) as u8) as char);
            input = Tensor::new(&[next], &self.device)?.unsqueeze(0)?;
        }
        Ok((format!("{prompt} {word}"), kv.bytes()))
    }
}
