//! What a load is asked for ([`LoadOptions`], [`InputShape`]) and the weight budget a partial
//! load gets ([`weight_budget`]).

use crate::patcher::ModelPatcher;
use crate::size::ByteSize;

/// Options of one [`MemoryManager::load_models_gpu`](super::MemoryManager::load_models_gpu) call.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadOptions {
    /// Activation memory the coming forward needs (from the model's estimator).
    pub memory_required: ByteSize,
    /// The least free memory to leave; defaults to `extra_mem`.
    pub minimum_memory_required: Option<ByteSize>,
    /// Load every weight, whatever the state.
    pub force_full_load: bool,
    /// Prefer patched weights for residency.
    pub force_patch_weights: bool,
    /// The shape of the coming forward's input: the manager asks each model's memory estimator
    /// ([`ModelPatcher::set_memory_estimator`]) for the activation memory it needs and keeps the
    /// largest figure free (with `memory_required`, whichever is larger).
    pub input_shape: Option<InputShape>,
}

/// The shape of a forward's input, up to 8 dimensions (a `Copy` value, so [`LoadOptions`] stays
/// one).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InputShape {
    dims: [usize; 8],
    rank: usize,
}

impl InputShape {
    /// The shape `dims`, or `None` beyond 8 dimensions.
    pub fn new(dims: &[usize]) -> Option<InputShape> {
        if dims.len() > 8 {
            return None;
        }
        let mut d = [0; 8];
        d[..dims.len()].copy_from_slice(dims);
        Some(InputShape {
            dims: d,
            rank: dims.len(),
        })
    }

    /// The dimensions.
    pub fn dims(&self) -> &[usize] {
        &self.dims[..self.rank]
    }
}

impl LoadOptions {
    /// Options whose activation memory the manager asks the models' estimators for, given the
    /// forward's input shape (ComfyUI's `model.memory_required(input_shape)`, done by the
    /// manager). A shape of more than 8 dimensions is ignored, with a warning.
    pub fn with_input_shape(mut self, shape: &[usize]) -> Self {
        self.input_shape = InputShape::new(shape);
        if self.input_shape.is_none() {
            tracing::warn!(
                ?shape,
                "an input shape of more than 8 dimensions is ignored"
            );
        }
        self
    }

    /// These options with `memory_required` raised to the largest estimate of `models` for
    /// the input shape, when one is set.
    pub(crate) fn resolved(mut self, models: &[ModelPatcher]) -> LoadOptions {
        if let Some(shape) = self.input_shape {
            let estimate = models
                .iter()
                .map(|m| m.memory_required(shape.dims()))
                .max()
                .unwrap_or(ByteSize::ZERO);
            self.memory_required = self.memory_required.max(estimate);
        }
        self
    }

    /// Options with this activation memory.
    pub fn with_memory_required(mut self, bytes: ByteSize) -> Self {
        self.memory_required = bytes;
        self
    }
    /// Forces a full load.
    pub fn with_force_full_load(mut self, on: bool) -> Self {
        self.force_full_load = on;
        self
    }
}

/// 128 MiB: the smallest weight budget a partial load gets.
pub const MIN_WEIGHT_BUDGET: ByteSize = ByteSize::mib(128);

/// The weight budget of a partial load (docs/ARCHITECTURE.md §5, step 7), pure:
/// `max(128 MiB, free_now − minimum_memory_required, min(free_now × ratio, free_now −
/// minimum_inference_memory)) − already_loaded`, at least one byte and never more than `free`,
/// where `free_now = free + already_loaded`.
pub fn weight_budget(
    free: ByteSize,
    already_loaded: ByteSize,
    minimum_memory_required: f64,
    minimum_inference_memory: f64,
    ratio: f64,
) -> ByteSize {
    let free_now = free.as_f64() + already_loaded.as_f64();
    let b = (MIN_WEIGHT_BUDGET.as_f64())
        .max(free_now - minimum_memory_required)
        .max((free_now * ratio).min(free_now - minimum_inference_memory))
        - already_loaded.as_f64();
    ByteSize::from_f64(b)
        .max(ByteSize(1))
        .min(free.max(ByteSize(1)))
}
