//! Patches on model weights and the handle that carries them.
//!
//! - [`ModelPatcher`]: the per-use handle — `Arc<Model>` + its own patch set + devices + options;
//!   cloning is cheap and copy-on-write (see its `# Sharing` section); loading, partial loading and
//!   unloading choose which weights are resident.
//! - [`adapters`]: patch kinds (`Diff`, `Set`, LoRA, LoHa, LoKr, GLoRA, OFT, DoRA), one file per
//!   kind with its shape rule and its exact f32 math; [`patch`] is its earlier name.
//! - [`lora_file`]: reading LoRA files onto a model's weight names (key naming, grouping, UNet
//!   renaming); [`lora`] is its earlier name.
//!
//! Patches never modify base weights; they are applied to copies, in f32, then rounded back to the
//! storage dtype (nearest-even for f16/bf16, seeded stochastic rounding for fp8), so every path
//! that asks for a patched weight gets the same bits.

pub mod adapters;
pub mod device_map;
pub mod lora_file;
mod model_patcher;
pub(crate) mod selection;

/// The patch kinds under their earlier path: [`adapters`] re-exported, so code that names
/// `residency::patcher::patch::…` keeps compiling.
pub mod patch {
    pub use super::adapters::*;
}

/// LoRA file reading under its earlier path: [`lora_file`] re-exported (its [`unet`](lora_file::unet)
/// module included), so code that names `residency::patcher::lora::…` keeps compiling.
pub mod lora {
    pub use super::lora_file::*;
}

pub use adapters::{DoraNorm, GLora, LoHa, LoKr, Lora, Offset, Oft, Patch, PatchEntry};
pub(crate) use device_map::layer_of;
pub use device_map::{AutoMapOptions, DeviceMap, SplitStats, Target};
pub(crate) use model_patcher::{cast_weight, Finish, ResidencySignature};
pub use model_patcher::{
    LoadOutcome, MemoryEstimator, ModelPatcher, PatchKey, PatchSet, PatcherOptions, SetEntry,
    WeightWrapper, WEIGHT_SCALE_SUFFIX,
};
