//! The startup report: what ComfyUI users read in its first log lines.

use std::fmt;

use crate::float::Dtype;

use super::state::{DeviceId, Policy, VramState};

/// A printable summary of the resolved policy (`Display`), and the same facts as fields.
#[derive(Debug, Clone)]
pub struct StartupReport {
    /// Total memory of the compute device in MiB (budget-capped; host RAM for the CPU).
    pub total_vram_mb: u64,
    /// Total host RAM in MiB.
    pub total_ram_mb: u64,
    /// The VRAM state.
    pub vram_state: VramState,
    /// The compute device.
    pub device: DeviceId,
    /// Its name ("cpu" or the GPU's name).
    pub device_name: String,
    /// Whether the CPU is a budgeted compute device.
    pub budgeted_cpu: bool,
    /// Reserved memory in MiB.
    pub reserve_mb: u64,
    /// Diffusion-model storage dtype for a typical model preferring bf16, f16, f32.
    pub unet_dtype: Dtype,
    /// Text encoder dtype.
    pub text_encoder_dtype: Dtype,
    /// VAE dtype.
    pub vae_dtype: Dtype,
    /// Whether fp8 matmuls run natively.
    pub fp8_compute: bool,
    /// The attention backend the dispatcher prefers on this device.
    pub attention: String,
    /// Transfer lanes (0 = synchronous).
    pub transfer_lanes: usize,
    /// Whether pinned staging memory is enabled.
    pub pinned_memory: bool,
    /// Whether smart memory (partial unloads) is enabled.
    pub smart_memory: bool,
}

impl Policy {
    /// The startup report for this policy; `attention` names the dispatcher's choice.
    pub fn startup_report(&self, attention: impl Into<String>) -> StartupReport {
        let dev = self.compute_device();
        let prefs = [Dtype::BF16, Dtype::F16, Dtype::F32];
        let mb = |b: crate::ByteSize| b.bytes() / (1024 * 1024);
        StartupReport {
            total_vram_mb: mb(self.total_memory(dev)),
            total_ram_mb: mb(self.hardware.host.total),
            vram_state: self.vram_state(),
            device: dev,
            device_name: match dev {
                DeviceId::Cpu => "cpu".into(),
                DeviceId::Cuda(n) => self
                    .hardware
                    .gpu(n)
                    .map(|g| g.name.clone())
                    .unwrap_or_default(),
                DeviceId::Sim(n) => match self.config.sim_gpus.get(n) {
                    Some(spec) => format!("simulated GPU ({spec})"),
                    None => "simulated GPU".into(),
                },
            },
            budgeted_cpu: self.cpu_is_budgeted(),
            reserve_mb: mb(self.reserve()),
            unet_dtype: self.unet_dtype(0, &prefs, None),
            text_encoder_dtype: self.text_encoder_dtype(),
            vae_dtype: self.vae_dtype(&prefs),
            fp8_compute: self.supports_fp8_compute(dev),
            attention: attention.into(),
            transfer_lanes: self.config.transfer_lanes_for(dev),
            pinned_memory: !self.config.disable_pinned_memory,
            smart_memory: !self.config.disable_smart_memory,
        }
    }
}

impl fmt::Display for StartupReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "Total VRAM {} MB, total RAM {} MB",
            self.total_vram_mb, self.total_ram_mb
        )?;
        writeln!(f, "Set vram state to: {}", self.vram_state)?;
        let kind = if self.budgeted_cpu {
            format!(" (budgeted compute device, {} MB)", self.total_vram_mb)
        } else if self.vram_state == VramState::Disabled {
            " (nothing scheduled)".to_string()
        } else {
            String::new()
        };
        if self.device_name.is_empty() || self.device_name == "cpu" {
            writeln!(f, "Device: {}{}", self.device, kind)?;
        } else {
            writeln!(f, "Device: {} {}{}", self.device, self.device_name, kind)?;
        }
        writeln!(f, "Reserved memory: {} MB", self.reserve_mb)?;
        writeln!(
            f,
            "Dtypes: unet {}, text encoder {}, vae {}; fp8 compute {}",
            self.unet_dtype,
            self.text_encoder_dtype,
            self.vae_dtype,
            if self.fp8_compute { "yes" } else { "no" }
        )?;
        writeln!(f, "Using attention: {}", self.attention)?;
        let lanes = if self.transfer_lanes == 0 {
            "disabled".to_string()
        } else {
            format!("{} lanes", self.transfer_lanes)
        };
        writeln!(
            f,
            "Async offload: {lanes}; pinned memory: {}; smart memory: {}",
            if self.pinned_memory {
                "enabled"
            } else {
                "disabled"
            },
            if self.smart_memory {
                "enabled"
            } else {
                "disabled"
            }
        )
    }
}

#[cfg(test)]
mod tests {
    use crate::size::ByteSize;
    use crate::vram::{Config, GpuInfo, Hardware, Policy};

    fn report(args: &[&str], hw: Hardware) -> String {
        Policy::new(Config::from_args(args).unwrap(), hw)
            .unwrap()
            .startup_report("sub-quadratic")
            .to_string()
    }

    #[test]
    fn budgeted_cpu_report_names_state_and_budget() {
        let r = report(
            &["--vram-budget", "4GiB"],
            Hardware::cpu_only(ByteSize::gib(16)),
        );
        assert!(r.contains("Total VRAM 4096 MB, total RAM 16384 MB"), "{r}");
        assert!(r.contains("Set vram state to: NORMAL_VRAM"), "{r}");
        assert!(r.contains("budgeted compute device"), "{r}");
        let r = report(&["--novram"], Hardware::cpu_only(ByteSize::gib(16)));
        assert!(r.contains("NO_VRAM"), "{r}");
        let r = report(&["--cpu"], Hardware::cpu_only(ByteSize::gib(16)));
        assert!(r.contains("DISABLED"), "{r}");
    }

    #[test]
    fn gpu_report_names_the_card_and_dtypes() {
        let hw = Hardware::with_gpu(GpuInfo::nvidia(
            0,
            "NVIDIA GeForce RTX 4090",
            ByteSize::gib(24),
            (8, 9),
        ));
        let r = report(&["--highvram"], hw);
        assert!(r.contains("Total VRAM 24576 MB"), "{r}");
        assert!(r.contains("HIGH_VRAM"), "{r}");
        assert!(r.contains("cuda:0 NVIDIA GeForce RTX 4090"), "{r}");
        assert!(r.contains("unet bf16") || r.contains("unet BF16"), "{r}");
        assert!(r.contains("fp8 compute yes"), "{r}");
        assert!(r.contains("Using attention: sub-quadratic"), "{r}");
    }
}
