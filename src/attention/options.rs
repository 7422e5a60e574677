//! The options of one [`attention`](super::attention) call: [`AttentionOptions`], the input
//! [`Layout`] and the softmax precision policy [`Upcast`].

use candle_core::DType;

use super::Backend;
use crate::size::ByteSize;

/// Memory layout of `q`, `k`, `v` and of the output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Layout {
    /// `[B, N, heads·dim]`: heads merged into the channel dimension (the default).
    #[default]
    Merged,
    /// `[B, heads, N, dim]`.
    PerHead,
}

/// Which parts of attention run in f32 for f16/bf16 inputs. f32 inputs are unaffected.
///
/// Default upcasts the softmax because f16 `exp`/sums lose precision and bf16's 8 significant
/// bits make probabilities coarse; the score blocks are then f32, which the planners budget for
/// (they are given the f32 element size). Unlike ComfyUI, probabilities are not rounded back to
/// f16/bf16 before `·V`: rounding them to bf16 alone moved outputs by up to 3e-3.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Upcast {
    /// `Q·Kᵀ` in the input dtype, softmax and `probabilities·V` in f32 (`V` is cast, not the
    /// probabilities), output cast back to the input dtype.
    #[default]
    Default,
    /// `--force-upcast-attention`: `Q` and `K` cast to f32 before `Q·Kᵀ` too, which also avoids
    /// f16 overflow in the scores (the case some SD2.x models need).
    Force,
    /// `--dont-upcast-attention`: everything in the input dtype.
    Never,
}

impl Upcast {
    /// The dtype `Q·Kᵀ` is computed in for inputs of `dtype`.
    pub fn score_dtype(self, dtype: DType) -> DType {
        match self {
            Upcast::Force if is_half(dtype) => DType::F32,
            _ => dtype,
        }
    }

    /// The dtype the softmax runs in for inputs of `dtype`.
    pub fn softmax_dtype(self, dtype: DType) -> DType {
        match self {
            Upcast::Default | Upcast::Force if is_half(dtype) => DType::F32,
            _ => dtype,
        }
    }
}

fn is_half(dtype: DType) -> bool {
    matches!(dtype, DType::F16 | DType::BF16)
}

/// Options for one [`attention`](super::attention) call.
///
/// Defaults: [`Backend::Naive`], [`Layout::Merged`], [`Upcast::Default`], scale `1/√dim`, free
/// memory unlimited ([`ByteSize::MAX`], so `Split` uses one slice and `SubQuadratic` the largest
/// chunks).
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionOptions {
    /// The backend to run (usually [`select_backend`](super::select_backend)'s choice).
    pub backend: Backend,
    /// Layout of the inputs and of the output.
    pub layout: Layout,
    /// Softmax precision policy.
    pub upcast: Upcast,
    /// Score scale; `None` is `1/√dim`.
    pub scale: Option<f64>,
    /// Free memory the memory-aware backends (`Split`, `SubQuadratic`) plan their temporaries in.
    pub free_memory: ByteSize,
}

impl Default for AttentionOptions {
    fn default() -> Self {
        AttentionOptions {
            backend: Backend::Naive,
            layout: Layout::Merged,
            upcast: Upcast::Default,
            scale: None,
            free_memory: ByteSize::MAX,
        }
    }
}

impl AttentionOptions {
    /// Default options with `backend`.
    pub fn new(backend: Backend) -> Self {
        AttentionOptions {
            backend,
            ..Default::default()
        }
    }
    /// Sets the layout.
    pub fn with_layout(mut self, layout: Layout) -> Self {
        self.layout = layout;
        self
    }
    /// Sets the upcast policy.
    pub fn with_upcast(mut self, upcast: Upcast) -> Self {
        self.upcast = upcast;
        self
    }
    /// Overrides the score scale.
    pub fn with_scale(mut self, scale: f64) -> Self {
        self.scale = Some(scale);
        self
    }
    /// Sets the free memory the memory-aware backends plan with.
    pub fn with_free_memory(mut self, free: ByteSize) -> Self {
        self.free_memory = free;
        self
    }
}
