//! residency (work in progress)
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod attention;
pub mod error;
pub mod float;
pub mod loader;
pub mod models;
pub mod offload;
pub mod ops;
pub mod patcher;
pub mod size;
pub mod tools;
pub mod vram;
pub mod weights;

pub use error::{Error, Result};
pub use float::{Dtype, Fp8Format, Rounding};
pub use size::ByteSize;

/// The attention backend the dispatcher would pick on this policy's compute device (for the
/// startup report).
pub fn attention_name(policy: &vram::Policy) -> String {
    match policy.config().attention {
        Some(flag) => format!("{flag:?} (requested)"),
        None => "auto".to_string(),
    }
}

pub use loader::{global, LoadOptions, LoadReport, MemoryManager, MemoryReport};
pub use patcher::ModelPatcher;
pub use vram::{Config, DeviceId, Hardware};
pub use weights::Model;

/// Loads models on the [`global`] manager (ComfyUI's `load_models_gpu`).
pub fn load_models_gpu(models: &[ModelPatcher], options: LoadOptions) -> Result<LoadReport> {
    global().load_models_gpu(models, options)
}

/// Loads one model on the [`global`] manager.
pub fn load_model_gpu(model: &ModelPatcher) -> Result<LoadReport> {
    global().load_model_gpu(model)
}

/// Evicts models from `device` on the [`global`] manager until more than `required` is free.
pub fn free_memory(
    required: ByteSize,
    device: DeviceId,
    keep_loaded: &[&ModelPatcher],
) -> Vec<loader::Eviction> {
    global().free_memory(required, device, keep_loaded)
}

/// Unloads every model from the [`global`] manager.
pub fn unload_all_models() -> usize {
    global().unload_all_models()
}

/// Returns cached device memory to the driver.
pub fn soft_empty_cache() {
    global().soft_empty_cache()
}

/// Free memory on `device` as the [`global`] manager sees it.
pub fn get_free_memory(device: DeviceId) -> ByteSize {
    global().get_free_memory(device)
}

/// Total memory of `device` as the [`global`] manager sees it.
pub fn get_total_memory(device: DeviceId) -> ByteSize {
    global().get_total_memory(device)
}

/// The models registered with the [`global`] manager, most recently used first.
pub fn loaded_models() -> Vec<loader::LoadedModelInfo> {
    global().loaded_models()
}

/// Drops registry entries nobody holds and releases weight pins (the engine's one call between
/// runs).
pub fn cleanup_models() {
    global().cleanup_models()
}
