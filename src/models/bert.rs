//! BERT encoders (e.g. `sentence-transformers/all-MiniLM-L6-v2`) built from [`crate::ops`]
//! layers, so every weight is fetched, patched and cast through [`crate::ops::cast_bias_weight`]
//! whatever its residency.
//!
//! Weight names follow Hugging Face's `BertModel` checkpoints without a prefix
//! (`embeddings.word_embeddings.weight`, `encoder.layer.N.attention.self.query.weight`, ...).
//! Attention goes through [`crate::attention::attention`] with a key-padding mask; the backend is
//! the one [`crate::attention::select_backend`] picks for the request in [`BertOptions`].
//! Tokenization is not here: callers pass token ids (the `minilm` example and the tests use the
//! `tokenizers` crate with the checkpoint's `tokenizer.json`).
//!
//! A forward completes the model's first-forward recording
//! ([`crate::weights::Model::forward_order_keys`]).

use std::path::Path;

use candle_core::{DType, Device, Tensor, D};

use crate::attention::{
    self, fused_kernel_available, AttentionOptions, AttentionShape, BackendRequest, DeviceKind,
    DispatchInput,
};
use crate::error::{Error, Result, TensorContext};
use crate::float::{self, Dtype, Rounding};
use crate::ops::{Embedding, LayerNorm, Linear, OpsBuilder, OpsMode, OpsSource};
use crate::patcher::ModelPatcher;
use crate::size::ByteSize;
use crate::weights::Model;

/// The fields of a BERT `config.json` this implementation uses.
#[derive(Debug, Clone, PartialEq)]
pub struct BertConfig {
    /// Token vocabulary size.
    pub vocab_size: usize,
    /// Hidden width.
    pub hidden_size: usize,
    /// Number of encoder layers.
    pub num_hidden_layers: usize,
    /// Attention heads per layer.
    pub num_attention_heads: usize,
    /// Width of the feed-forward layer.
    pub intermediate_size: usize,
    /// Longest sequence.
    pub max_position_embeddings: usize,
    /// Number of token types (segments).
    pub type_vocab_size: usize,
    /// Layer-norm epsilon.
    pub layer_norm_eps: f64,
}

impl BertConfig {
    /// all-MiniLM-L6-v2: 6 layers, hidden 384, 12 heads, feed-forward 1536.
    pub fn minilm_l6() -> Self {
        BertConfig {
            vocab_size: 30522,
            hidden_size: 384,
            num_hidden_layers: 6,
            num_attention_heads: 12,
            intermediate_size: 1536,
            max_position_embeddings: 512,
            type_vocab_size: 2,
            layer_norm_eps: 1e-12,
        }
    }

    /// The activation memory a forward over token ids of shape `[batch, seq]` needs when
    /// computing in `compute`: one layer's live buffers at once (layers run one after another) —
    /// about six `[batch, seq, hidden]` and two `[batch, seq, intermediate]` tensors in the
    /// compute dtype, and the attention scores and probabilities `[batch, heads, seq, seq]` in
    /// f32 — for [`crate::patcher::ModelPatcher::set_memory_estimator`], so that
    /// `LoadOptions::with_input_shape(&[batch, seq])` keeps that much free.
    pub fn memory_estimator(&self, compute: Dtype) -> crate::patcher::MemoryEstimator {
        let (h, i, heads) = (
            self.hidden_size as u64,
            self.intermediate_size as u64,
            self.num_attention_heads as u64,
        );
        let width = compute.size_in_bytes() as u64;
        std::sync::Arc::new(move |shape: &[usize]| {
            let (b, s) = match shape {
                [b, s, ..] => (*b as u64, *s as u64),
                [s] => (1, *s as u64),
                _ => (1, 1),
            };
            let tokens = b.saturating_mul(s);
            let dense = tokens.saturating_mul(6 * h + 2 * i).saturating_mul(width);
            let scores = b
                .saturating_mul(heads)
                .saturating_mul(s.saturating_mul(s))
                .saturating_mul(4 * 2);
            crate::size::ByteSize(dense.saturating_add(scores))
        })
    }

    /// Parses a Hugging Face `config.json`. Only `hidden_act = "gelu"` (the exact, erf form) is
    /// supported.
    ///
    /// # Errors
    /// [`Error::File`] for unreadable JSON, a missing field or another activation.
    pub fn from_json(text: &str, path: &Path) -> Result<Self> {
        let bad = |reason: String| Error::File {
            path: path.to_path_buf(),
            reason,
        };
        let v: serde_json::Value =
            serde_json::from_str(text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
        let int = |k: &str| {
            v.get(k)
                .and_then(|x| x.as_u64())
                .map(|x| x as usize)
                .ok_or_else(|| bad(format!("missing integer field `{k}`")))
        };
        if let Some(act) = v.get("hidden_act").and_then(|a| a.as_str()) {
            if act != "gelu" {
                return Err(bad(format!(
                    "hidden_act `{act}` is not supported (only `gelu`)"
                )));
            }
        }
        Ok(BertConfig {
            vocab_size: int("vocab_size")?,
            hidden_size: int("hidden_size")?,
            num_hidden_layers: int("num_hidden_layers")?,
            num_attention_heads: int("num_attention_heads")?,
            intermediate_size: int("intermediate_size")?,
            max_position_embeddings: int("max_position_embeddings")?,
            type_vocab_size: int("type_vocab_size").unwrap_or(2),
            layer_norm_eps: v
                .get("layer_norm_eps")
                .and_then(|x| x.as_f64())
                .unwrap_or(1e-12),
        })
    }

    /// Reads and parses `config.json` at `path`.
    ///
    /// # Errors
    /// [`Error::File`] when it cannot be read or parsed.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| Error::File {
            path: path.to_path_buf(),
            reason: format!("cannot read: {e}"),
        })?;
        BertConfig::from_json(&text, path)
    }
}

/// Reads a BERT checkpoint (f32 safetensors) and stores its weights in `storage`: f16/bf16 by
/// round-to-nearest-even, fp8 by seeded stochastic rounding keyed by each weight's name
/// ([`Rounding::stochastic_for`]). With an fp8 `storage`, 1-d tensors (biases and layer-norm
/// weights, 0.04 % of MiniLM's bytes) stay f32, as fp8 checkpoints usually keep them: in fp8
/// they cost MiniLM two thirds of its fp8 error (worst cosine to the f32 reference 0.986 with
/// them, 0.9955 without). The returned model is
/// named `name`.
///
/// # Errors
/// [`Error::File`] for an unreadable checkpoint; conversion errors.
pub fn load_model(path: impl AsRef<Path>, name: &str, storage: Dtype) -> Result<Model> {
    let path = path.as_ref();
    let model = Model::from_safetensors(name, &[path])?;
    if storage == Dtype::F32 && model.slots().iter().all(|s| s.dtype() == Dtype::F32) {
        return Ok(model);
    }
    let mut typed = Vec::with_capacity(model.len());
    for s in model.slots() {
        let wide = float::to_f32(&s.clean()?, s.dtype())?;
        let storage = if storage.is_fp8() && s.shape().len() < 2 {
            Dtype::F32
        } else {
            storage
        };
        let rounding = if storage.is_fp8() {
            Rounding::stochastic_for(s.name())
        } else {
            Rounding::Nearest
        };
        typed.push((
            s.name().to_string(),
            float::from_f32(&wide, storage, rounding)?,
            storage,
        ));
    }
    Model::from_typed_tensors(name, typed)
}

/// Options of a [`Bert`] forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BertOptions {
    /// The attention backend requested (`None`: the dispatcher's default).
    pub attention: Option<BackendRequest>,
    /// Free memory the attention dispatcher and the memory-aware backends plan with.
    pub free_memory: ByteSize,
}

impl Default for BertOptions {
    fn default() -> Self {
        BertOptions {
            attention: None,
            free_memory: ByteSize::MAX,
        }
    }
}

#[derive(Debug, Clone)]
struct Layer {
    query: Linear,
    key: Linear,
    value: Linear,
    attn_out: Linear,
    attn_norm: LayerNorm,
    intermediate: Linear,
    output: Linear,
    out_norm: LayerNorm,
}

/// A BERT encoder whose layers fetch their weights through one [`OpsSource`].
#[derive(Debug, Clone)]
pub struct Bert {
    config: BertConfig,
    options: BertOptions,
    source: OpsSource,
    word: Embedding,
    position: Embedding,
    token_type: Embedding,
    emb_norm: LayerNorm,
    layers: Vec<Layer>,
}

impl Bert {
    /// Builds the encoder on `patcher`'s model in `mode`, checking every weight's shape against
    /// `config`.
    ///
    /// # Errors
    /// [`Error::UnknownWeight`] for a missing weight, [`Error::ShapeMismatch`] for a wrong shape.
    pub fn new(patcher: &ModelPatcher, mode: OpsMode, config: &BertConfig) -> Result<Bert> {
        let vb = OpsBuilder::new(patcher, mode);
        let h = config.hidden_size;
        let eps = config.layer_norm_eps;
        let emb = vb.pp("embeddings");
        let word = emb.embedding("word_embeddings")?;
        let position = emb.embedding("position_embeddings")?;
        let token_type = emb.embedding("token_type_embeddings")?;
        for (e, rows) in [
            (&word, config.vocab_size),
            (&position, config.max_position_embeddings),
            (&token_type, config.type_vocab_size),
        ] {
            if e.vocab_size() != rows || e.hidden_size() != h {
                return Err(Error::ShapeMismatch {
                    what: format!("`{}`", e.weights().weight_key()),
                    expected: vec![rows, h],
                    got: e.weights().weight_shape().to_vec(),
                });
            }
        }
        let emb_norm = emb.layer_norm("LayerNorm", eps, true)?;
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for i in 0..config.num_hidden_layers {
            let l = vb.pp("encoder").pp("layer").pp(i);
            let att = l.pp("attention");
            let f = config.intermediate_size;
            layers.push(Layer {
                query: att.pp("self").linear_dims("query", h, h, true)?,
                key: att.pp("self").linear_dims("key", h, h, true)?,
                value: att.pp("self").linear_dims("value", h, h, true)?,
                attn_out: att.pp("output").linear_dims("dense", h, h, true)?,
                attn_norm: att.pp("output").layer_norm("LayerNorm", eps, true)?,
                intermediate: l.pp("intermediate").linear_dims("dense", h, f, true)?,
                output: l.pp("output").linear_dims("dense", f, h, true)?,
                out_norm: l.pp("output").layer_norm("LayerNorm", eps, true)?,
            });
        }
        Ok(Bert {
            config: config.clone(),
            options: BertOptions::default(),
            source: vb.source().clone(),
            word,
            position,
            token_type,
            emb_norm,
            layers,
        })
    }

    /// Sets the forward options.
    pub fn with_options(mut self, options: BertOptions) -> Self {
        self.options = options;
        self
    }

    /// The configuration.
    pub fn config(&self) -> &BertConfig {
        &self.config
    }

    /// The source every layer fetches through ([`OpsSource::set_patcher`] switches all of them,
    /// e.g. to a clone with a LoRA).
    pub fn source(&self) -> &OpsSource {
        &self.source
    }

    /// The last hidden state `[B, N, hidden]` for `input_ids` `[B, N]` (integer dtype),
    /// `attention_mask` `[B, N]` (1 for tokens, 0 for padding) and optional `token_type_ids`.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] for inconsistent inputs or a sequence longer than
    /// `max_position_embeddings`; errors of the layers and of attention.
    pub fn forward(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        token_type_ids: Option<&Tensor>,
    ) -> Result<Tensor> {
        let (b, n) = input_ids
            .dims2()
            .ctx(|| "bert input ids must be [batch, tokens]".into())?;
        if attention_mask.dims() != [b, n] {
            return Err(Error::ShapeMismatch {
                what: "bert attention mask".into(),
                expected: vec![b, n],
                got: attention_mask.dims().to_vec(),
            });
        }
        if n > self.config.max_position_embeddings {
            return Err(Error::ShapeMismatch {
                what: "bert sequence length (max_position_embeddings)".into(),
                expected: vec![self.config.max_position_embeddings],
                got: vec![n],
            });
        }
        let device = input_ids.device();
        let ctx = |what: &'static str| move || format!("bert {what}");
        let positions = Tensor::arange(0u32, n as u32, device)
            .and_then(|p| p.unsqueeze(0))
            .and_then(|p| p.broadcast_as((b, n)))
            .ctx(ctx("positions"))?;
        let types = match token_type_ids {
            Some(t) => t.clone(),
            None => Tensor::zeros((b, n), DType::U32, device).ctx(ctx("token types"))?,
        };
        let word = self.word.try_forward(input_ids)?;
        let pos = self.position.try_forward(&positions)?;
        let typ = self.token_type.try_forward(&types)?;
        let x = (word + pos).and_then(|x| x + typ).ctx(ctx("embeddings"))?;
        let mut x = self.emb_norm.try_forward(&x)?;

        let mask = attention_mask
            .to_dtype(DType::U8)
            .and_then(|m| m.reshape((b, 1, 1, n)))
            .ctx(ctx("mask"))?;
        let heads = self.config.num_attention_heads;
        let opts = self.attention_options(device, b * heads, n, x.dtype());
        for layer in &self.layers {
            let q = layer.query.try_forward(&x)?;
            let k = layer.key.try_forward(&x)?;
            let v = layer.value.try_forward(&x)?;
            let a = attention::attention(&q, &k, &v, heads, Some(&mask), &opts)?;
            let a = layer.attn_out.try_forward(&a)?;
            x = layer
                .attn_norm
                .try_forward(&(a + &x).ctx(ctx("residual"))?)?;
            let f = layer
                .intermediate
                .try_forward(&x)?
                .gelu_erf()
                .ctx(ctx("gelu"))?;
            let f = layer.output.try_forward(&f)?;
            x = layer
                .out_norm
                .try_forward(&(f + &x).ctx(ctx("residual"))?)?;
        }
        self.source.finish_forward();
        Ok(x)
    }

    /// Sentence embeddings `[B, hidden]`: [`Bert::forward`], then [`mean_pool_l2`].
    ///
    /// # Errors
    /// As [`Bert::forward`].
    pub fn embed(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        token_type_ids: Option<&Tensor>,
    ) -> Result<Tensor> {
        let h = self.forward(input_ids, attention_mask, token_type_ids)?;
        mean_pool_l2(&h, attention_mask)
    }

    fn attention_options(
        &self,
        device: &Device,
        batch_heads: usize,
        n: usize,
        dtype: DType,
    ) -> AttentionOptions {
        let backend = attention::select_backend(&DispatchInput {
            requested: self.options.attention,
            device: DeviceKind::from(device),
            fused_kernel: fused_kernel_available(device),
            free: self.options.free_memory,
            shape: AttentionShape {
                batch_heads,
                nq: n,
                nk: n,
                elem_bytes: dtype.size_in_bytes().max(4),
            },
        });
        AttentionOptions::new(backend).with_free_memory(self.options.free_memory)
    }
}

/// Mean of `hidden` `[B, N, H]` over the tokens where `mask` `[B, N]` is non-zero, then L2
/// normalised per row (norm clamped below at 1e-12, as `torch.nn.functional.normalize`). f32.
///
/// # Errors
/// [`Error::Tensor`] for inconsistent shapes.
pub fn mean_pool_l2(hidden: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let ctx = || "mean pooling".to_string();
    let h = hidden.to_dtype(DType::F32).ctx(ctx)?;
    let m = mask
        .to_dtype(DType::F32)
        .and_then(|m| m.unsqueeze(D::Minus1))
        .ctx(ctx)?;
    let summed = h.broadcast_mul(&m).and_then(|x| x.sum(1)).ctx(ctx)?;
    let count = m.sum(1).and_then(|c| c.clamp(1e-9, f64::MAX)).ctx(ctx)?;
    let mean = summed.broadcast_div(&count).ctx(ctx)?;
    let norm = mean
        .sqr()
        .and_then(|s| s.sum_keepdim(1))
        .and_then(|s| s.sqrt())
        .and_then(|s| s.clamp(1e-12, f64::MAX))
        .ctx(ctx)?;
    mean.broadcast_div(&norm).ctx(ctx)
}
