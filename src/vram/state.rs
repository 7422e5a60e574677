//! The resolved policy: VRAM state, budgets and reserve, as pure functions of config and hardware.

use std::fmt;

use std::collections::HashMap;

use crate::lock::{Mutex, Rank};
use candle_core::Device;
use once_cell::sync::Lazy;

use crate::error::{Error, Result};
use crate::size::ByteSize;

use super::config::{Config, VramMode};
use super::probe::{Hardware, Os, Vendor};

/// One candle device per CUDA ordinal (lock rank 5: a leaf).
static CANDLE_DEVICES: Lazy<Mutex<HashMap<usize, Device>>> =
    Lazy::new(|| Mutex::new(Rank::CandleDevices, HashMap::new()));

/// A device the scheduler keeps a ledger for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DeviceId {
    /// Host memory / the CPU.
    Cpu,
    /// CUDA device by ordinal.
    Cuda(usize),
    /// Simulated GPU by ordinal (`--sim-gpu`; [`crate::device::SimGpu`]): scheduled like a GPU,
    /// its tensors are candle CPU tensors.
    Sim(usize),
}

impl DeviceId {
    /// The candle device. One candle device is kept per CUDA ordinal for the whole process
    /// (candle refuses to mix tensors of two `Device::new_cuda` calls), so every layer and the
    /// engine share it; [`DeviceId::register_candle`] installs the engine's own. CUDA needs the
    /// crate's `cuda` feature; without it this is an error that says so.
    pub fn to_candle(self) -> Result<Device> {
        match self {
            DeviceId::Cpu | DeviceId::Sim(_) => Ok(Device::Cpu),
            DeviceId::Cuda(n) => {
                let mut map = CANDLE_DEVICES.lock();
                if let Some(d) = map.get(&n) {
                    return Ok(d.clone());
                }
                if !cfg!(feature = "cuda") {
                    let reason = if candle_core::utils::cuda_is_available() {
                        // Another crate turned on candle-core's CUDA backend; residency's own
                        // feature is what makes it build weights as CUDA tensors.
                        "candle-core has its `cuda` feature but residency does not: enable residency's too (`residency = { features = [\"cuda\"] }`)"
                    } else {
                        "GPU tensors need residency built with its `cuda` feature (`residency = { features = [\"cuda\"] }`, which turns on candle's)"
                    };
                    return Err(Error::Device {
                        device: self.to_string(),
                        reason: reason.into(),
                    });
                }
                // cudarc panics on its first call without a driver library; ask first.
                if !super::probe::cuda_driver_present() {
                    return Err(Error::Device {
                        device: self.to_string(),
                        reason: "no CUDA driver library (libcuda) on this machine".into(),
                    });
                }
                let d = std::panic::catch_unwind(|| Device::new_cuda(n))
                    .unwrap_or_else(|_| {
                        Err(candle_core::Error::Msg(
                            "the CUDA driver is incompatible with cudarc".into(),
                        ))
                    })
                    .map_err(|e| Error::Device {
                        device: self.to_string(),
                        reason: e.to_string(),
                    })?;
                map.insert(n, d.clone());
                Ok(d)
            }
        }
    }

    /// Makes `device` the candle device residency uses for its ordinal (call before loading, with
    /// the device the engine computes on). Returns its id.
    ///
    /// # Errors
    /// As [`DeviceId::of`]: a Metal device is refused, and nothing is registered.
    pub fn register_candle(device: &Device) -> Result<DeviceId> {
        let id = DeviceId::of(device)?;
        if let DeviceId::Cuda(n) = id {
            CANDLE_DEVICES.lock().insert(n, device.clone());
        }
        Ok(id)
    }

    /// The id of a candle device.
    ///
    /// # Errors
    /// [`Error::Device`] for a Metal device: residency schedules the CPU and CUDA devices only,
    /// and treating Metal as the CPU would put its tensors in the wrong ledger.
    pub fn of(device: &Device) -> Result<DeviceId> {
        DeviceId::of_location(device.location())
    }

    /// The id of a candle device location (pure; [`DeviceId::of`]).
    ///
    /// # Errors
    /// As [`DeviceId::of`].
    pub fn of_location(location: candle_core::DeviceLocation) -> Result<DeviceId> {
        match location {
            candle_core::DeviceLocation::Cpu => Ok(DeviceId::Cpu),
            candle_core::DeviceLocation::Cuda { gpu_id } => Ok(DeviceId::Cuda(gpu_id)),
            candle_core::DeviceLocation::Metal { gpu_id } => Err(Error::Device {
                device: format!("metal:{gpu_id}"),
                reason: "residency schedules the CPU and CUDA devices; a Metal device is not supported (use `Device::Cpu` or a CUDA device)".into(),
            }),
        }
    }

    /// Whether this is the CPU.
    pub fn is_cpu(self) -> bool {
        self == DeviceId::Cpu
    }

    /// Whether this is a simulated GPU.
    pub fn is_sim(self) -> bool {
        matches!(self, DeviceId::Sim(_))
    }

    /// Whether candle computes on the host for this device (the CPU, or a simulated GPU).
    pub fn computes_on_host(self) -> bool {
        !matches!(self, DeviceId::Cuda(_))
    }
}

/// The CUDA ordinals residency holds a candle device for (copied out; the table's lock is not
/// held after this returns, so callers may synchronize devices).
pub(crate) fn candle_cuda_ordinals() -> Vec<usize> {
    let mut v: Vec<usize> = CANDLE_DEVICES.lock().keys().copied().collect();
    v.sort_unstable();
    v
}

impl fmt::Display for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceId::Cpu => write!(f, "cpu"),
            DeviceId::Cuda(n) => write!(f, "cuda:{n}"),
            DeviceId::Sim(n) => write!(f, "sim:{n}"),
        }
    }
}

impl std::str::FromStr for DeviceId {
    type Err = crate::error::Error;

    /// `cpu`, `cuda:N` or `sim:N` (as [`DeviceId`]'s `Display` writes it).
    fn from_str(s: &str) -> Result<Self> {
        if s == "cpu" {
            return Ok(DeviceId::Cpu);
        }
        let number = |prefix: &str| s.strip_prefix(prefix).and_then(|n| n.parse().ok());
        number("cuda:")
            .map(DeviceId::Cuda)
            .or_else(|| number("sim:").map(DeviceId::Sim))
            .ok_or_else(|| crate::error::Error::Device {
                device: s.to_string(),
                reason: "not a device name (expected `cpu`, `cuda:N` or `sim:N`)".into(),
            })
    }
}

/// Devices serialize as their names (`"cpu"`, `"cuda:0"`).
#[cfg(feature = "serde")]
impl serde::Serialize for DeviceId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

#[cfg(feature = "serde")]
impl<'de> serde::Deserialize<'de> for DeviceId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// How weights are kept on the compute device (ComfyUI's `VRAMState`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum VramState {
    /// Nothing is scheduled: no GPU and no budget, or `--cpu`.
    Disabled,
    /// Nothing castable is resident; every weight streams.
    NoVram,
    /// Partial loading; text encoders run on the CPU.
    LowVram,
    /// Partial loading when a model does not fit (the default).
    NormalVram,
    /// Models are loaded fully and stay.
    HighVram,
    /// Device and host share memory (unified memory): load fully, nothing to move.
    Shared,
}

impl VramState {
    /// ComfyUI's spelling, as its users know it from the log.
    pub fn comfy_name(self) -> &'static str {
        match self {
            VramState::Disabled => "DISABLED",
            VramState::NoVram => "NO_VRAM",
            VramState::LowVram => "LOW_VRAM",
            VramState::NormalVram => "NORMAL_VRAM",
            VramState::HighVram => "HIGH_VRAM",
            VramState::Shared => "SHARED",
        }
    }
}

impl fmt::Display for VramState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.comfy_name())
    }
}

/// Which kind of device computes (ComfyUI's `CPUState`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CpuState {
    /// A GPU computes.
    Gpu,
    /// The CPU computes.
    Cpu,
    /// Apple's Metal device computes.
    Mps,
}

/// Config and hardware resolved into every decision that depends only on them.
///
/// Built once by [`Policy::new`]; every method is a pure function of the two, so the whole policy
/// is table-tested on hand-built [`Hardware`].
#[derive(Debug, Clone)]
pub struct Policy {
    pub(crate) config: Config,
    pub(crate) hardware: Hardware,
    vram_state: VramState,
    cpu_state: CpuState,
    compute: DeviceId,
}

/// 1 GiB as a float, for the formulas.
pub(crate) const GIB_F: f64 = 1024.0 * 1024.0 * 1024.0;

impl Policy {
    /// Resolves the state. Errors when `--cuda-device N` names a GPU the machine lacks.
    pub fn new(config: Config, hardware: Hardware) -> Result<Policy> {
        let gpu = match config.cuda_device {
            Some(n) if config.vram_mode != Some(VramMode::Cpu) => {
                Some(hardware.gpu(n).ok_or_else(|| Error::InvalidFlag {
                    flag: "--cuda-device".into(),
                    reason: format!(
                        "no GPU {n}; this machine has {} GPU(s)",
                        hardware.gpus.len()
                    ),
                })?)
            }
            _ => hardware.gpus.first(),
        };
        let sim = !config.sim_gpus.is_empty();
        let (cpu_state, vram_state, compute) = match (config.vram_mode, gpu) {
            (Some(VramMode::Cpu), _) => (CpuState::Cpu, VramState::Disabled, DeviceId::Cpu),
            // Simulated GPUs, when asked for, are the GPUs models compute on.
            (mode, _) if sim => (CpuState::Gpu, mode_state(mode), DeviceId::Sim(0)),
            (mode, Some(gpu)) => {
                let cpu_state = if gpu.vendor == Vendor::Apple {
                    CpuState::Mps
                } else {
                    CpuState::Gpu
                };
                let state = if gpu.unified_memory {
                    VramState::Shared
                } else {
                    mode_state(mode)
                };
                (cpu_state, state, DeviceId::Cuda(gpu.ordinal))
            }
            (mode, None) => {
                // No GPU: the CPU is scheduled like a GPU when a budget or a memory mode asks for
                // it; otherwise nothing is scheduled.
                let state = if config.vram_budget.is_some() || mode.is_some() {
                    mode_state(mode)
                } else {
                    VramState::Disabled
                };
                (CpuState::Cpu, state, DeviceId::Cpu)
            }
        };
        Ok(Policy {
            config,
            hardware,
            vram_state,
            cpu_state,
            compute,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }
    /// The hardware snapshot.
    pub fn hardware(&self) -> &Hardware {
        &self.hardware
    }
    /// The VRAM state.
    pub fn vram_state(&self) -> VramState {
        self.vram_state
    }
    /// The CPU state.
    pub fn cpu_state(&self) -> CpuState {
        self.cpu_state
    }
    /// The device models compute on (ComfyUI's `get_torch_device`).
    pub fn compute_device(&self) -> DeviceId {
        self.compute
    }

    /// Whether residency is decided by use (ComfyUI's DynamicVRAM, docs/ARCHITECTURE.md §5.3):
    /// `--enable-dynamic-vram` turns it on on any scheduled device (a budgeted CPU too);
    /// `--disable-dynamic-vram` off; by default it is on when the compute device is a GPU (CUDA
    /// or simulated) and the state is not `--highvram`/`--gpu-only` (`HighVram`), `--novram` or
    /// `--cpu` — ComfyUI's gate. `--lowvram` then changes nothing.
    pub fn dynamic_vram(&self) -> bool {
        match self.config.dynamic_vram {
            Some(on) => on && self.is_scheduled(self.compute),
            None => {
                !self.compute.is_cpu()
                    && !matches!(
                        self.vram_state,
                        VramState::HighVram | VramState::NoVram | VramState::Disabled
                    )
                    && !matches!(
                        self.config.vram_mode,
                        Some(
                            VramMode::HighVram
                                | VramMode::GpuOnly
                                | VramMode::NoVram
                                | VramMode::Cpu
                        )
                    )
            }
        }
    }

    /// Whether the CPU is a *budgeted compute device*: no GPU computes, and the state is not
    /// `Disabled`. Resident then means a materialized, patched copy counted against the budget.
    pub fn cpu_is_budgeted(&self) -> bool {
        self.compute == DeviceId::Cpu && self.vram_state != VramState::Disabled
    }

    /// Whether the scheduler keeps a ledger for `device` (a GPU, or the budgeted CPU).
    pub fn is_scheduled(&self, device: DeviceId) -> bool {
        match device {
            DeviceId::Cuda(_) => true,
            DeviceId::Sim(n) => n < self.config.sim_gpus.len(),
            DeviceId::Cpu => self.cpu_is_budgeted(),
        }
    }

    /// Whether `device` has a hard budget tracked by our ledger (`--vram-budget`, or the budgeted
    /// CPU): its free memory is total − ledger rather than the driver's figure.
    pub fn is_budgeted(&self, device: DeviceId) -> bool {
        self.config.vram_budget.is_some()
            || self.device_budget(device).is_some()
            || device.is_sim()
            || (device.is_cpu() && self.cpu_is_budgeted())
    }

    /// The device's total memory as the scheduler sees it: the driver's total (host RAM for the
    /// CPU), capped by `--vram-budget`.
    pub fn total_memory(&self, device: DeviceId) -> ByteSize {
        let raw = match device {
            DeviceId::Cpu => self.hardware.host.total,
            DeviceId::Cuda(n) => self
                .hardware
                .gpu(n)
                .map(|g| g.total)
                .unwrap_or(ByteSize::ZERO),
            DeviceId::Sim(n) => self.sim_capacity(n),
        };
        match self.device_budget(device).or(self.config.vram_budget) {
            Some(b) => raw.min(b),
            None => raw,
        }
    }

    /// The budget `--vram-budget N=SIZE` gives this GPU, if any.
    pub fn device_budget(&self, device: DeviceId) -> Option<ByteSize> {
        let n = match device {
            DeviceId::Cuda(n) | DeviceId::Sim(n) => n,
            DeviceId::Cpu => return None,
        };
        self.config
            .vram_budgets
            .iter()
            .rev()
            .find(|(m, _)| *m == n)
            .map(|(_, b)| *b)
    }

    /// Free memory as probed (driver free, or host available), capped by the budget; the memory
    /// manager replaces this with total − ledger on budgeted devices.
    pub fn probed_free(&self, device: DeviceId) -> ByteSize {
        let raw = match device {
            DeviceId::Cpu => self.hardware.host.available,
            DeviceId::Cuda(n) => self
                .hardware
                .gpu(n)
                .map(|g| g.free)
                .unwrap_or(ByteSize::ZERO),
            DeviceId::Sim(n) => self.sim_capacity(n),
        };
        raw.min(self.total_memory(device))
    }

    fn sim_capacity(&self, n: usize) -> ByteSize {
        self.config
            .sim_gpus
            .get(n)
            .map(|s| s.capacity)
            .unwrap_or(ByteSize::ZERO)
    }

    /// Extra reserved memory: `--reserve-vram GB` when given; else 400 MiB on Linux/macOS, 600 MiB
    /// on Windows plus 100 MiB when the compute device has more than 15 GiB.
    pub fn reserve(&self) -> ByteSize {
        if let Some(gb) = self.config.reserve_vram_gb {
            return ByteSize::gib_f64(gb);
        }
        match self.hardware.os {
            Os::Windows => {
                let big = self.total_memory(self.compute) > ByteSize::gib(15);
                ByteSize::mib(if big { 700 } else { 600 })
            }
            Os::Linux | Os::MacOs => ByteSize::mib(400),
        }
    }

    /// The reserve on `device`: its own `--reserve-vram N=GB` when given, else
    /// [`Policy::reserve`].
    pub fn reserve_on(&self, device: DeviceId) -> ByteSize {
        let n = match device {
            DeviceId::Cuda(n) | DeviceId::Sim(n) => n,
            DeviceId::Cpu => return self.reserve(),
        };
        match self
            .config
            .reserve_vram_gbs
            .iter()
            .rev()
            .find(|(m, _)| *m == n)
        {
            Some((_, gb)) => ByteSize::gib_f64(*gb),
            None => self.reserve(),
        }
    }

    /// `0.8 GiB + reserve`, exact (the load formulas use the fractional value). `--inference-memory`
    /// replaces the 0.8 GiB.
    pub fn minimum_inference_memory_f64(&self) -> f64 {
        self.inference_base() + self.reserve().as_f64()
    }

    /// [`Policy::minimum_inference_memory_f64`] with `device`'s own reserve.
    pub fn minimum_inference_memory_on_f64(&self, device: DeviceId) -> f64 {
        self.inference_base() + self.reserve_on(device).as_f64()
    }

    /// [`Policy::minimum_inference_memory`] with `device`'s own reserve.
    pub fn minimum_inference_memory_on(&self, device: DeviceId) -> ByteSize {
        ByteSize::from_f64(self.minimum_inference_memory_on_f64(device))
    }

    fn inference_base(&self) -> f64 {
        match self.config.inference_memory {
            Some(b) => b.as_f64(),
            None => 0.8 * GIB_F,
        }
    }

    /// `0.8 GiB + reserve`, rounded down to bytes (1278423859 with the Linux default).
    pub fn minimum_inference_memory(&self) -> ByteSize {
        ByteSize::from_f64(self.minimum_inference_memory_f64())
    }

    /// `0.88 × total − minimum_inference_memory`: what weights may take on `device`.
    pub fn maximum_vram_for_weights(&self, device: DeviceId) -> ByteSize {
        ByteSize::from_f64(
            0.88 * self.total_memory(device).as_f64()
                - self.minimum_inference_memory_on_f64(device),
        )
    }

    /// The share of free memory a partial load may take beyond the inference minimum: 0 on NVIDIA,
    /// 0.4 on other devices (ComfyUI's `EXTRA_RESERVED`-free formula for non-NVIDIA).
    pub fn weight_ratio(&self, device: DeviceId) -> f64 {
        match device {
            DeviceId::Cuda(n) if self.hardware.gpu(n).map(|g| g.vendor) == Some(Vendor::Nvidia) => {
                0.0
            }
            // A simulated GPU behaves as an NVIDIA card does.
            DeviceId::Sim(_) => 0.0,
            _ => 0.4,
        }
    }
}

fn mode_state(mode: Option<VramMode>) -> VramState {
    match mode {
        Some(VramMode::GpuOnly | VramMode::HighVram) => VramState::HighVram,
        Some(VramMode::LowVram) => VramState::LowVram,
        Some(VramMode::NoVram) => VramState::NoVram,
        Some(VramMode::NormalVram) | None => VramState::NormalVram,
        Some(VramMode::Cpu) => VramState::Disabled,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vram::probe::GpuInfo;

    fn card(gib: u64) -> Hardware {
        Hardware::with_gpu(GpuInfo::nvidia(
            0,
            "NVIDIA GeForce RTX 3090",
            ByteSize::gib(gib),
            (8, 6),
        ))
    }

    fn policy(args: &[&str], hw: Hardware) -> Policy {
        Policy::new(Config::from_args(args).unwrap(), hw).unwrap()
    }

    #[test]
    fn metal_devices_are_refused_never_taken_for_the_cpu() {
        use candle_core::DeviceLocation;
        assert_eq!(DeviceId::of(&Device::Cpu).unwrap(), DeviceId::Cpu);
        assert_eq!(
            DeviceId::of_location(DeviceLocation::Cuda { gpu_id: 3 }).unwrap(),
            DeviceId::Cuda(3)
        );
        let err = DeviceId::of_location(DeviceLocation::Metal { gpu_id: 1 }).unwrap_err();
        assert!(
            matches!(&err, Error::Device { device, .. } if device == "metal:1"),
            "{err}"
        );
        assert!(!err.is_retryable());
        assert_eq!(
            DeviceId::register_candle(&Device::Cpu).unwrap(),
            DeviceId::Cpu
        );
    }

    #[test]
    fn flags_choose_the_vram_state() {
        let cases: &[(&[&str], VramState, CpuState)] = &[
            (&[], VramState::NormalVram, CpuState::Gpu),
            (&["--lowvram"], VramState::LowVram, CpuState::Gpu),
            (&["--novram"], VramState::NoVram, CpuState::Gpu),
            (&["--highvram"], VramState::HighVram, CpuState::Gpu),
            (&["--gpu-only"], VramState::HighVram, CpuState::Gpu),
            (&["--normalvram"], VramState::NormalVram, CpuState::Gpu),
            (&["--cpu"], VramState::Disabled, CpuState::Cpu),
        ];
        for (args, state, cpu) in cases {
            let p = policy(args, card(24));
            assert_eq!((p.vram_state(), p.cpu_state()), (*state, *cpu), "{args:?}");
        }
    }

    #[test]
    fn small_card_without_flags_stays_normal_vram() {
        assert_eq!(policy(&[], card(2)).vram_state(), VramState::NormalVram);
    }

    #[test]
    fn unified_memory_is_shared() {
        let mut gpu = GpuInfo::nvidia(0, "Orin", ByteSize::gib(32), (8, 7));
        gpu.unified_memory = true;
        assert_eq!(
            policy(&[], Hardware::with_gpu(gpu)).vram_state(),
            VramState::Shared
        );
    }

    #[test]
    fn no_gpu_is_disabled_unless_a_budget_makes_the_cpu_a_device() {
        let hw = Hardware::cpu_only(ByteSize::gib(24));
        let p = policy(&[], hw.clone());
        assert_eq!(p.vram_state(), VramState::Disabled);
        assert!(!p.cpu_is_budgeted());
        let p = policy(&["--vram-budget", "4GiB"], hw.clone());
        assert_eq!(p.vram_state(), VramState::NormalVram);
        assert!(p.cpu_is_budgeted() && p.is_budgeted(DeviceId::Cpu));
        assert_eq!(p.total_memory(DeviceId::Cpu), ByteSize::gib(4));
        assert_eq!(
            policy(&["--novram"], hw.clone()).vram_state(),
            VramState::NoVram
        );
        assert_eq!(
            policy(&["--cpu", "--vram-budget", "4GiB"], hw).vram_state(),
            VramState::Disabled
        );
    }

    #[test]
    fn reserve_follows_os_and_card_size() {
        let mut hw = card(24);
        assert_eq!(policy(&[], hw.clone()).reserve(), ByteSize::mib(400));
        hw.os = Os::MacOs;
        assert_eq!(policy(&[], hw.clone()).reserve(), ByteSize::mib(400));
        hw.os = Os::Windows;
        assert_eq!(policy(&[], hw.clone()).reserve(), ByteSize::mib(700));
        let mut small = card(8);
        small.os = Os::Windows;
        assert_eq!(policy(&[], small).reserve(), ByteSize::mib(600));
        assert_eq!(
            policy(&["--reserve-vram", "1.5"], hw).reserve(),
            ByteSize(1610612736)
        );
    }

    #[test]
    fn minimum_inference_and_maximum_weight_memory() {
        let p = policy(&[], card(24));
        assert_eq!(p.minimum_inference_memory(), ByteSize(1278423859));
        assert!((p.minimum_inference_memory_f64() - 1278423859.2).abs() < 1e-3);
        assert_eq!(
            p.maximum_vram_for_weights(DeviceId::Cuda(0)),
            ByteSize(21399003463)
        );
    }

    #[test]
    fn vram_budget_caps_the_total() {
        let p = policy(&["--vram-budget", "6GiB"], card(24));
        assert_eq!(p.total_memory(DeviceId::Cuda(0)), ByteSize::gib(6));
        assert_eq!(p.probed_free(DeviceId::Cuda(0)), ByteSize::gib(6));
        assert!(p.is_budgeted(DeviceId::Cuda(0)));
        let p = policy(&["--vram-budget", "64GiB"], card(24));
        assert_eq!(p.total_memory(DeviceId::Cuda(0)), ByteSize::gib(24));
    }

    #[test]
    fn vram_budget_per_device_caps_each_gpu_and_the_single_form_the_rest() {
        let p = policy(
            &["--sim-gpus", "3x16MiB", "--vram-budget", "0=4MiB,1=12MiB"],
            card(24),
        );
        assert_eq!(p.total_memory(DeviceId::Sim(0)), ByteSize::mib(4));
        assert_eq!(p.total_memory(DeviceId::Sim(1)), ByteSize::mib(12));
        assert_eq!(p.total_memory(DeviceId::Sim(2)), ByteSize::mib(16));
        // A budget above the device's capacity caps nothing; the single form covers the rest.
        let p = policy(
            &["--vram-budget", "1=64GiB", "--vram-budget", "6GiB"],
            card(24),
        );
        assert_eq!(p.total_memory(DeviceId::Cuda(0)), ByteSize::gib(6));
        assert!(p.is_budgeted(DeviceId::Cuda(0)));
        let p = policy(&["--vram-budget", "0=3GiB"], card(24));
        assert_eq!(p.total_memory(DeviceId::Cuda(0)), ByteSize::gib(3));
        assert!(p.is_budgeted(DeviceId::Cuda(0)));
        // A reserve per GPU; the rest keep the default.
        let p = policy(
            &["--sim-gpus", "2x16MiB", "--reserve-vram", "1=1.5"],
            card(24),
        );
        assert_eq!(p.reserve_on(DeviceId::Sim(1)), ByteSize::gib_f64(1.5));
        assert_eq!(p.reserve_on(DeviceId::Sim(0)), ByteSize::mib(400));
        assert_eq!(
            p.minimum_inference_memory_on(DeviceId::Sim(1)),
            ByteSize::from_f64(0.8 * GIB_F + 1.5 * GIB_F)
        );
        for bad in ["1=-1", "x=1", "1=lots"] {
            let e = Config::from_args(["--reserve-vram", bad])
                .unwrap_err()
                .to_string();
            assert!(e.contains("--reserve-vram"), "{bad}: {e}");
        }
        for bad in ["0=0", "x=1GiB", "0=lots", "=1GiB"] {
            let e = Config::from_args(["--vram-budget", bad])
                .unwrap_err()
                .to_string();
            assert!(e.contains("--vram-budget"), "{bad}: {e}");
        }
    }

    #[test]
    fn nvidia_weight_ratio_is_zero_elsewhere_point_four() {
        let p = policy(&[], card(24));
        assert_eq!(p.weight_ratio(DeviceId::Cuda(0)), 0.0);
        assert_eq!(p.weight_ratio(DeviceId::Cpu), 0.4);
    }

    #[test]
    fn missing_cuda_device_is_an_error() {
        let err =
            Policy::new(Config::from_args(["--cuda-device", "3"]).unwrap(), card(24)).unwrap_err();
        assert!(err.to_string().contains("--cuda-device"), "{err}");
    }
}
