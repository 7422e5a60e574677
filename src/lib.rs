//! # residency — model memory scheduling for candle
//!
//! residency decides where every weight of every loaded model lives — GPU memory, host RAM,
//! page-locked host RAM, its file on disk — moves weights between those tiers on transfer lanes, applies LoRA-style
//! patches without ever touching the base weights, and picks dtypes and attention backends that
//! fit the hardware. Its behaviour reference is ComfyUI's model management.
//!
//! ```
//! use std::sync::Arc;
//! use candle_core::{Device, Tensor};
//! use residency::loader::{LoadOptions, MemoryManager};
//! use residency::ops::{OpsBuilder, OpsMode};
//! use residency::patcher::{Lora, Patch};
//! use residency::{ByteSize, Config, DeviceId, Dtype, Hardware, Model, ModelPatcher};
//!
//! # fn main() -> residency::Result<()> {
//! // A budgeted CPU device stands in for a GPU here; on a real machine use `residency::global()`.
//! let config = Config::from_args(["--vram-budget", "64MiB", "--reserve-vram", "0"])?;
//! let manager = MemoryManager::new(config, Hardware::cpu_only(ByteSize::gib(8)))?;
//! let w = Tensor::randn(0f32, 1.0, (64, 64), &Device::Cpu)?;
//! let model = Arc::new(Model::from_tensors("net", [("proj.weight", w)])?);
//! let base = ModelPatcher::new(model, manager.compute_device(), DeviceId::Cpu);
//!
//! // A node clones the model and adds a LoRA; the base is untouched.
//! let mut styled = base.clone();
//! let lora = Lora::new(Tensor::ones((64, 4), candle_core::DType::F32, &Device::Cpu)?,
//!                      Tensor::ones((4, 64), candle_core::DType::F32, &Device::Cpu)?);
//! styled.add_patches([("proj.weight", Patch::Lora(lora))], 0.1, 1.0)?;
//!
//! let report = manager.load_models_gpu(&[styled.clone()], LoadOptions::default())?;
//! assert!(report.models[0].full);
//! let layer = OpsBuilder::new(&styled, OpsMode::DisableWeightInit).linear("proj", false)?;
//! let y = layer.try_forward(&Tensor::ones((1, 64), candle_core::DType::F32, &Device::Cpu)?)?;
//! assert_eq!(y.dims(), &[1, 64]);
//! assert!(base.patches().is_empty());
//! # let _ = Dtype::F32; Ok(()) }
//! ```
//!
//! ## Module map, in dependency order (no cycles)
//!
//! A module names only modules of earlier groups (`docs/ARCHITECTURE.md` §2 gives the same order,
//! and `tests/module_map.rs` checks the code against it): `lock` (the ranked locks every module
//! uses), [`size`] (leaves) → [`error`] → [`float`] (dtypes, casts, fp8, stochastic rounding),
//! [`trace`] (recording residency's spans and ledger counters as a Chrome trace and a timeline
//! picture), [`warnings`] (the stderr copies of the warnings an engine must see), `fault` (test
//! builds only: the fault-injection seam) → [`vram`] (config, hardware
//! probe, VRAM state, device helpers, dtype policy) → [`device`] (everything asked of a GPU, behind
//! one interface: CUDA, and a simulated GPU with a checker) → [`costs`] (the cost model: copy and
//! compute figures per device, predicted step time) → [`weights`] (models as named slots,
//! residency; the disk and host tiers; the tensors a model's code holds outside the ledger) →
//! [`patcher`] (ModelPatcher; patch kinds in [`patcher::adapters`], one file per kind; LoRA files
//! in [`patcher::lora_file`]) → [`offload`] (staging pool, transfer lanes, prefetch) → [`ops`]
//! (layers) → [`quantized`] (candle's quantized API on managed GGUF weights) → [`nn`] (candle-nn's
//! constructors on `ops`), [`quantized_var_builder`], [`attention`] (backends, memory plans,
//! dispatcher) → [`quantized_nn`], [`with_tracing`] (candle-transformers' traced layers on `nn`),
//! [`loader`] (the memory manager, the global API, [`OpsSource::load`](ops::OpsSource::load)) →
//! [`managed`] (any candle model under the manager, whole), [`models`] (BERT), [`tools`] (LoRA
//! merging). A layer never calls the manager.
//!
//! The design — memory tiers, the invariants and their tests, the load algorithm, the transfer
//! path, the lock table, and where each lives — is in `docs/ARCHITECTURE.md`.
//!
//! ## Invariants
//!
//! - **I1** clean weights are immutable; **I2** each device's ledger, and the host tier's, is
//!   exact and bounded by its budget; **I3** a streamed weight gives bit-identical outputs to a resident one; **I4** a
//!   failed call changes nothing loaded; **I5** handles are `Send + Sync`, and every lock has a
//!   rank, checked at run time in debug builds (the table is `src/lock/rank.rs`). `docs/ARCHITECTURE.md` §4 says how each is kept and tested.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]
// A type in a public signature must have a public path (and so a rustdoc page).
#![warn(unnameable_types)]

pub mod attention;
pub mod costs;
pub mod device;
pub mod error;
#[cfg(test)]
pub(crate) mod fault;
pub mod float;
pub mod loader;
pub(crate) mod lock;
pub mod managed;
pub mod models;
pub mod nn;
pub mod offload;
pub mod ops;
pub mod patcher;
pub mod quantized;
pub mod quantized_nn;
pub mod quantized_var_builder;
pub mod size;
pub mod tools;
pub mod trace;
pub mod vram;
pub mod warnings;
pub mod weights;
pub mod with_tracing;

pub use error::{Error, Result};
pub use float::{Dtype, Fp8Format, Rounding};
pub use size::ByteSize;

/// The attention backend the dispatcher picks on this policy's compute device for a typical
/// large input (8 heads × 4096 tokens, f32 softmax), as the startup report shows it.
pub fn attention_name(policy: &vram::Policy) -> String {
    use attention::{AttentionShape, BackendRequest, DeviceKind, DispatchInput};
    let requested = policy.config().attention.map(|flag| match flag {
        vram::AttentionFlag::Split => BackendRequest::Split,
        vram::AttentionFlag::Quad => BackendRequest::SubQuadratic,
        vram::AttentionFlag::Pytorch => BackendRequest::Sdpa,
        vram::AttentionFlag::Flash => BackendRequest::Flash,
        vram::AttentionFlag::Sage => BackendRequest::Sage,
    });
    let device = policy.compute_device();
    let d = attention::dispatch(&DispatchInput {
        requested,
        device: if device.is_cpu() {
            DeviceKind::Cpu
        } else {
            DeviceKind::Cuda
        },
        // The CPU has this crate's fused kernel; GPUs have none in this build.
        fused_kernel: device.is_cpu(),
        free: policy.total_memory(device),
        shape: AttentionShape {
            batch_heads: 8,
            nq: 4096,
            nk: 4096,
            elem_bytes: 4,
        },
    });
    match d.fallback {
        Some(f) => format!("{} ({:?} requested: {})", d.backend, f.requested, f.reason),
        None => d.backend.to_string(),
    }
}

/// The README's code blocks, compiled and run as doc tests (`cargo test --doc`).
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

/// docs/PORTING.md's code blocks, compiled (and run where they need no files) as doc tests.
#[doc = include_str!("../docs/PORTING.md")]
#[cfg(doctest)]
pub struct PortingDoctests;

/// docs/ARCHITECTURE.md's code blocks, compiled as doc tests (it has none today: any added is).
#[doc = include_str!("../docs/ARCHITECTURE.md")]
#[cfg(doctest)]
pub struct ArchitectureDoctests;

/// docs/REPORT.md's code blocks, compiled and run as doc tests.
#[doc = include_str!("../docs/REPORT.md")]
#[cfg(doctest)]
pub struct ReportDoctests;

pub use loader::{global, init_global, LoadOptions, LoadReport, MemoryManager, MemoryReport};
pub use patcher::{AutoMapOptions, DeviceMap, ModelPatcher, Target};
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
