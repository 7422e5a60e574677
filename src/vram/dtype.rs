//! Dtype policy: which storage and compute dtypes fit the device.
//!
//! Rules (each a test below):
//! - the CPU never prefers f16/bf16 compute;
//! - explicit dtype flags win (`--force-fp16`, `--force-fp32`, `--bf16-unet`, ...);
//! - compute capability ≥ 8 prefers f16 and bf16; below 6 never f16; Pascal consumer/pro cards
//!   (GTX 10xx, Titan X, P40, P100, P4000, ...) use f16 only on Windows or when manual-casting;
//!   GTX 16xx, T-series and MX cards never use f16; other 7.x cards do;
//! - bf16 below compute capability 8 only when manual-casting a model whose f32 weights would
//!   not fit `maximum_vram_for_weights`;
//! - fp8 compute on NVIDIA compute capability ≥ 8.9 or with `--supports-fp8-compute`;
//! - an fp8 checkpoint stays fp8 when the device computes fp8 or a 16-bit copy would not fit;
//!   otherwise the first dtype of the model's preference list that the device supports; f32 last.

use crate::float::Dtype;

use super::state::{DeviceId, Policy};

const PASCAL: &[&str] = &[
    "1080", "1070", "titan x", "p3000", "p3200", "p4000", "p4200", "p5000", "p5200", "p6000",
    "1060", "1050", "p40", "p100", "p6", "p4",
];
const TURING_NO_FP16: &[&str] = &[
    "1660", "1650", "1630", "t500", "t550", "t600", "mx550", "mx450", "cmp 30hx", "t2000", "t1000",
    "t1200",
];

impl Policy {
    fn cc(&self, device: DeviceId) -> Option<(u32, u32)> {
        match device {
            DeviceId::Cuda(n) => self.hardware.gpu(n).map(|g| g.compute_capability),
            // A simulated GPU computes on the CPU: the CPU's dtypes, so its outputs are the CPU's.
            DeviceId::Cpu | DeviceId::Sim(_) => None,
        }
    }

    /// Whether f16 compute pays on `device`. `manual_cast`: the model's weights are cast per
    /// layer (so f16 is only the compute dtype).
    pub fn should_use_fp16(&self, device: DeviceId, manual_cast: bool) -> bool {
        let Some((major, _)) = self.cc(device) else {
            return false;
        };
        if self.config.force_fp16 {
            return true;
        }
        if self.config.force_fp32 {
            return false;
        }
        if major >= 8 {
            return true;
        }
        if major < 6 {
            return false;
        }
        let name = self.gpu_name(device);
        if PASCAL.iter().any(|p| name.contains(p)) {
            return self.hardware.os == super::probe::Os::Windows || manual_cast;
        }
        if major < 7 {
            return false;
        }
        !TURING_NO_FP16.iter().any(|p| name.contains(p))
    }

    /// Whether bf16 compute pays on `device` for a model of `model_params` parameters.
    pub fn should_use_bf16(&self, device: DeviceId, model_params: u64, manual_cast: bool) -> bool {
        let Some((major, _)) = self.cc(device) else {
            return false;
        };
        if self.config.force_fp32 {
            return false;
        }
        if major >= 8 {
            return true;
        }
        let f32_bytes = (model_params as f64) * 4.0;
        manual_cast && f32_bytes > self.maximum_vram_for_weights(device).as_f64()
    }

    /// Whether the device multiplies fp8 natively: NVIDIA compute capability ≥ 8.9, or the flag.
    pub fn supports_fp8_compute(&self, device: DeviceId) -> bool {
        if self.config.supports_fp8_compute {
            return true;
        }
        matches!(self.cc(device), Some(cc) if cc >= (8, 9))
    }

    /// fp8 formats weights may be stored in (both, on every device: storage is ours).
    pub fn supported_float8_types(&self) -> Vec<Dtype> {
        vec![Dtype::F8E4M3FN, Dtype::F8E5M2]
    }

    /// The storage dtype for the diffusion model: the flag; else an fp8 checkpoint stays fp8 when
    /// the device computes fp8 or its 16-bit copy would not fit; else the first of `supported`
    /// (the model's preference list) that the compute device supports; else f32.
    pub fn unet_dtype(
        &self,
        model_params: u64,
        supported: &[Dtype],
        weight_dtype: Option<Dtype>,
    ) -> Dtype {
        if let Some(d) = self.config.unet_dtype {
            return d;
        }
        let device = self.compute_device();
        if let Some(w) = weight_dtype.filter(|w| w.is_fp8()) {
            let sixteen_bit = model_params as f64 * 2.0;
            if self.supports_fp8_compute(device)
                || sixteen_bit > self.maximum_vram_for_weights(device).as_f64()
            {
                return w;
            }
        }
        self.first_supported(device, model_params, supported, false)
            .unwrap_or(Dtype::F32)
    }

    fn first_supported(
        &self,
        device: DeviceId,
        params: u64,
        supported: &[Dtype],
        manual_cast: bool,
    ) -> Option<Dtype> {
        supported.iter().copied().find(|d| match d {
            Dtype::F16 => self.should_use_fp16(device, manual_cast),
            Dtype::BF16 => self.should_use_bf16(device, params, manual_cast),
            Dtype::F32 => true,
            _ => false,
        })
    }

    /// The compute dtype when weights stored as `weight_dtype` must be cast per layer on
    /// `device`, or `None` when they compute as stored. Always `Some` for fp8 storage.
    pub fn unet_manual_cast(
        &self,
        weight_dtype: Dtype,
        device: DeviceId,
        supported: &[Dtype],
    ) -> Option<Dtype> {
        if weight_dtype == Dtype::F32 {
            return None;
        }
        let fp16 = self.should_use_fp16(device, true);
        let bf16 = self.should_use_bf16(device, 0, true);
        if (weight_dtype == Dtype::F16 && fp16) || (weight_dtype == Dtype::BF16 && bf16) {
            return None;
        }
        let compute = supported
            .iter()
            .copied()
            .find(|d| (*d == Dtype::F16 && fp16) || (*d == Dtype::BF16 && bf16))
            .unwrap_or(Dtype::F32);
        Some(compute)
    }

    /// Text encoder storage dtype: the flag; else f16 where the text encoder's device prefers
    /// it; else f32.
    pub fn text_encoder_dtype(&self) -> Dtype {
        if let Some(d) = self.config.text_encoder_dtype {
            return d;
        }
        if self.should_use_fp16(self.text_encoder_device(), false) {
            Dtype::F16
        } else {
            Dtype::F32
        }
    }

    /// VAE dtype: the flag; else the first of `allowed` the VAE device supports; else f32.
    pub fn vae_dtype(&self, allowed: &[Dtype]) -> Dtype {
        if let Some(d) = self.config.vae_dtype {
            return d;
        }
        self.first_supported(self.vae_device(), 0, allowed, false)
            .unwrap_or(Dtype::F32)
    }

    fn gpu_name(&self, device: DeviceId) -> String {
        match device {
            DeviceId::Cuda(n) => self
                .hardware
                .gpu(n)
                .map(|g| g.name.to_lowercase())
                .unwrap_or_default(),
            DeviceId::Cpu | DeviceId::Sim(_) => String::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::float::Dtype;
    use crate::size::ByteSize;
    use crate::vram::{Config, DeviceId, GpuInfo, Hardware, Os, Policy};

    fn gpu(name: &str, gib: u64, cc: (u32, u32)) -> Hardware {
        Hardware::with_gpu(GpuInfo::nvidia(0, name, ByteSize::gib(gib), cc))
    }
    fn pol(args: &[&str], hw: Hardware) -> Policy {
        Policy::new(Config::from_args(args).unwrap(), hw).unwrap()
    }
    const G: DeviceId = DeviceId::Cuda(0);

    #[test]
    fn fp16_rules_table() {
        let linux = |name: &str, cc| pol(&[], gpu(name, 8, cc));
        let cases: &[(&str, (u32, u32), bool, bool)] = &[
            // name, cc, manual_cast, expected
            ("NVIDIA GeForce RTX 3090", (8, 6), false, true),
            ("NVIDIA H100", (9, 0), false, true),
            ("Tesla K80", (3, 7), false, false),
            ("Quadro M4000", (5, 2), true, false),
            ("NVIDIA GeForce GTX 1080 Ti", (6, 1), false, false),
            ("NVIDIA GeForce GTX 1080 Ti", (6, 1), true, true),
            ("Tesla P40", (6, 1), false, false),
            ("Tesla P100-PCIE-16GB", (6, 0), true, true),
            ("Quadro P4000", (6, 1), true, true),
            ("NVIDIA TITAN X (Pascal)", (6, 1), true, true),
            ("Some other cc6 card", (6, 1), true, false),
            ("NVIDIA GeForce GTX 1660 SUPER", (7, 5), false, false),
            ("NVIDIA GeForce GTX 1650", (7, 5), true, false),
            ("NVIDIA T1000", (7, 5), false, false),
            ("NVIDIA T600", (7, 5), false, false),
            ("NVIDIA GeForce MX450", (7, 5), false, false),
            ("NVIDIA GeForce RTX 2080", (7, 5), false, true),
            ("Tesla V100-SXM2-16GB", (7, 0), false, true),
        ];
        for (name, cc, manual, want) in cases {
            assert_eq!(
                linux(name, *cc).should_use_fp16(G, *manual),
                *want,
                "{name} {cc:?} manual={manual}"
            );
        }
        let mut win = gpu("NVIDIA GeForce GTX 1070", 8, (6, 1));
        win.os = Os::Windows;
        assert!(pol(&[], win).should_use_fp16(G, false));
    }

    #[test]
    fn cpu_never_prefers_half_and_flags_win_on_gpus() {
        let cpu = pol(
            &["--vram-budget", "4GiB", "--force-fp16"],
            Hardware::cpu_only(ByteSize::gib(16)),
        );
        assert!(!cpu.should_use_fp16(DeviceId::Cpu, true));
        assert!(!cpu.should_use_bf16(DeviceId::Cpu, u64::MAX / 8, true));
        assert!(pol(&["--force-fp16"], gpu("Tesla K80", 12, (3, 7))).should_use_fp16(G, false));
        assert!(!pol(&["--force-fp32"], gpu("RTX 4090", 24, (8, 9))).should_use_fp16(G, false));
        assert!(!pol(&["--force-fp32"], gpu("RTX 4090", 24, (8, 9))).should_use_bf16(G, 0, false));
    }

    #[test]
    fn bf16_below_ampere_only_when_f32_would_not_fit() {
        let p = pol(&[], gpu("Tesla V100", 16, (7, 0)));
        assert!(!p.should_use_bf16(DeviceId::Cuda(0), 1, false));
        assert!(!p.should_use_bf16(G, 1_000_000_000, true)); // 4 GB fits 16 GiB card
        assert!(p.should_use_bf16(G, 4_000_000_000, true)); // 16 GB does not
        assert!(!p.should_use_bf16(G, 4_000_000_000, false));
        assert!(pol(&[], gpu("A100", 40, (8, 0))).should_use_bf16(G, 0, false));
    }

    #[test]
    fn fp8_compute_from_capability_or_flag() {
        assert!(pol(&[], gpu("RTX 4090", 24, (8, 9))).supports_fp8_compute(G));
        assert!(pol(&[], gpu("H100", 80, (9, 0))).supports_fp8_compute(G));
        assert!(!pol(&[], gpu("RTX 3090", 24, (8, 6))).supports_fp8_compute(G));
        assert!(
            pol(&["--supports-fp8-compute"], gpu("RTX 3090", 24, (8, 6))).supports_fp8_compute(G)
        );
        assert!(!pol(&[], Hardware::cpu_only(ByteSize::gib(8))).supports_fp8_compute(DeviceId::Cpu));
    }

    #[test]
    fn fp8_model_on_small_ampere_stays_fp8_with_bf16_compute() {
        let p = pol(&[], gpu("RTX 3070", 8, (8, 6)));
        let prefs = [Dtype::BF16, Dtype::F16, Dtype::F32];
        assert_eq!(
            p.unet_dtype(12_000_000_000, &prefs, Some(Dtype::F8E4M3FN)),
            Dtype::F8E4M3FN
        );
        assert_eq!(
            p.unet_manual_cast(Dtype::F8E4M3FN, G, &prefs),
            Some(Dtype::BF16)
        );
    }

    #[test]
    fn fp8_model_on_big_ampere_becomes_bf16() {
        let p = pol(&[], gpu("RTX A6000", 48, (8, 6)));
        let prefs = [Dtype::BF16, Dtype::F16, Dtype::F32];
        assert_eq!(
            p.unet_dtype(12_000_000_000, &prefs, Some(Dtype::F8E4M3FN)),
            Dtype::BF16
        );
        assert_eq!(p.unet_manual_cast(Dtype::BF16, G, &prefs), None);
        // On Ada the device computes fp8, so the checkpoint stays fp8.
        let ada = pol(&[], gpu("RTX 6000 Ada", 48, (8, 9)));
        assert_eq!(
            ada.unet_dtype(12_000_000_000, &prefs, Some(Dtype::F8E4M3FN)),
            Dtype::F8E4M3FN
        );
    }

    #[test]
    fn fp8_on_cpu_computes_in_f32() {
        let p = pol(&[], Hardware::cpu_only(ByteSize::gib(16)));
        let prefs = [Dtype::BF16, Dtype::F16, Dtype::F32];
        assert_eq!(
            p.unet_manual_cast(Dtype::F8E4M3FN, DeviceId::Cpu, &prefs),
            Some(Dtype::F32)
        );
        assert_eq!(
            p.unet_manual_cast(Dtype::BF16, DeviceId::Cpu, &prefs),
            Some(Dtype::F32)
        );
        assert_eq!(p.unet_manual_cast(Dtype::F32, DeviceId::Cpu, &prefs), None);
        assert_eq!(p.unet_dtype(1_000_000, &prefs, None), Dtype::F32);
    }

    #[test]
    fn explicit_dtype_flags_win() {
        let p = pol(
            &["--fp8_e5m2-unet", "--fp16-vae", "--bf16-text-enc"],
            gpu("RTX 3090", 24, (8, 6)),
        );
        assert_eq!(p.unet_dtype(1, &[Dtype::F32], None), Dtype::F8E5M2);
        assert_eq!(p.vae_dtype(&[Dtype::F32]), Dtype::F16);
        assert_eq!(p.text_encoder_dtype(), Dtype::BF16);
        let p = pol(&[], gpu("RTX 3090", 24, (8, 6)));
        assert_eq!(p.vae_dtype(&[Dtype::BF16, Dtype::F32]), Dtype::BF16);
        assert_eq!(p.text_encoder_dtype(), Dtype::F16);
        assert_eq!(p.unet_dtype(1, &[Dtype::F16, Dtype::F32], None), Dtype::F16);
        let old = pol(&[], gpu("Tesla K80", 12, (3, 7)));
        assert_eq!(
            old.unet_dtype(1, &[Dtype::F16, Dtype::BF16, Dtype::F32], None),
            Dtype::F32
        );
    }
}
