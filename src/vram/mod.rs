//! Configuration, hardware, state, devices and dtypes.
//!
//! This module owns every decision that depends only on the configuration and the machine:
//! - [`Config`]: every flag (ComfyUI spellings), from arguments, environment or setters;
//! - [`Hardware`]: a plain snapshot read once by [`Hardware::probe`] (CUDA through cudarc loaded at
//!   run time; host RAM from `/proc/meminfo` clipped by cgroup v2);
//! - [`Policy`]: `(Config, Hardware)` resolved into the [`VramState`], [`CpuState`], compute
//!   device, budgets, reserve, device helpers and dtype policy — every method a pure function,
//!   table-tested on hand-built hardware;
//! - [`StartupReport`]: the first lines a ComfyUI user expects to read.
//!
//! Budgets: a device's *total* is the driver's total (host RAM for the CPU), capped by
//! `--vram-budget`. The reserve is not subtracted from the total; load formulas keep it free by
//! asking for it. Without a GPU, a budget or a memory flag (`--lowvram`, `--novram`, ...) makes the
//! CPU a *budgeted compute device*, scheduled like a GPU; with neither the state is `Disabled`.

mod config;
mod cuda;
mod devices;
mod dtype;
mod pin_budget;
mod probe;
mod report;
mod sim_spec;
mod state;

pub use config::{AttentionFlag, Config, UpcastFlag, VramMode};
pub use cuda::cuda_context;
pub(crate) use cuda::empty_cuda_caches;
pub use pin_budget::{pin_budget, PIN_HEADROOM};
pub use probe::{
    cuda_driver_present, driver_free_memory, host_from_texts, swap_within_cgroup, GpuInfo,
    Hardware, HostInfo, Os, Vendor,
};
pub use report::StartupReport;
pub use sim_spec::SimSpec;
pub use state::{CpuState, DeviceId, Policy, VramState};
