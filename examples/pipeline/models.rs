//! The pipeline's three models, built from `residency::ops` layers: a text encoder (a small
//! transformer), a denoiser (attention, cross-attention and MLP blocks) and a conv decoder. Their
//! weights come from the checkpoints `checkpoints.rs` writes.

use candle_core::{Device, Tensor};
use residency::attention::{self, AttentionOptions, Backend};
use residency::float::{self, Dtype};
use residency::ops::{
    Conv2d, ConvConfig, ConvTranspose2d, ConvTransposeConfig, GroupNorm, LayerNorm, Linear,
    OpsBuilder, OpsMode, OpsSource,
};
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

pub struct TextEncoder {
    source: OpsSource,
    embed: residency::ops::Embedding,
    blocks: Vec<Block>,
    norm: LayerNorm,
}

impl TextEncoder {
    pub fn new(p: &ModelPatcher) -> Result<Self> {
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
        let mut x = self.embed.try_forward(&ids)?;
        for b in &self.blocks {
            x = b.forward(&x, None, HEADS)?;
        }
        let out = self.norm.try_forward(&x)?;
        self.source.finish_forward();
        Ok(out)
    }
}

pub struct Denoiser {
    /// Switched between the base and the LoRA clone per prompt.
    pub source: OpsSource,
    proj_in: Linear,
    time: Linear,
    blocks: Vec<Block>,
    norm: LayerNorm,
    proj_out: Linear,
}

impl Denoiser {
    pub fn new(p: &ModelPatcher) -> Result<Self> {
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
    pub fn forward(&self, x: &Tensor, t: f32, context: &Tensor) -> Result<Tensor> {
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

pub struct Decoder {
    source: OpsSource,
    conv_in: Conv2d,
    norm1: GroupNorm,
    up1: ConvTranspose2d,
    norm2: GroupNorm,
    up2: ConvTranspose2d,
    conv_out: Conv2d,
}

impl Decoder {
    pub fn new(p: &ModelPatcher) -> Result<Self> {
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
    pub fn forward(&self, latent: &Tensor) -> Result<Tensor> {
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
