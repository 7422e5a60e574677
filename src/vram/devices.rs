//! Where each kind of model loads, offloads and computes (ComfyUI's device helpers).

use crate::float::Dtype;
use crate::size::ByteSize;

use super::config::VramMode;
use super::state::{DeviceId, Policy, VramState};

impl Policy {
    fn gpu_only(&self) -> bool {
        self.config.vram_mode == Some(VramMode::GpuOnly)
    }

    /// Where the diffusion model's clean weights live between runs: the GPU under HighVram (and
    /// `--gpu-only`), else the CPU.
    pub fn unet_offload_device(&self) -> DeviceId {
        match self.vram_state() {
            VramState::HighVram => self.compute_device(),
            _ => DeviceId::Cpu,
        }
    }

    /// Where a diffusion model of `params` parameters in `dtype` is first materialized: the GPU
    /// under HighVram/Shared; the CPU under `--novram` and `--disable-smart-memory`; else the GPU
    /// only when it has more free memory than the host and the model fits in it; else the CPU
    /// (ComfyUI's `unet_inital_load_device`).
    pub fn unet_initial_load_device(&self, params: u64, dtype: Dtype) -> DeviceId {
        let dev = self.compute_device();
        if matches!(self.vram_state(), VramState::HighVram | VramState::Shared) || dev.is_cpu() {
            return dev;
        }
        if self.config.disable_smart_memory || self.vram_state() == VramState::NoVram {
            return DeviceId::Cpu;
        }
        let size = ByteSize((dtype.size_in_bytes() as u64).saturating_mul(params));
        let free_dev = self.probed_free(dev);
        let free_cpu = self.hardware.host.available;
        if free_dev > free_cpu && size < free_dev {
            dev
        } else {
            DeviceId::Cpu
        }
    }

    /// Where text encoders compute: the GPU with `--gpu-only`; under High/Normal VRAM the GPU when
    /// it computes f16 (else the CPU); the CPU under Low/No VRAM.
    pub fn text_encoder_device(&self) -> DeviceId {
        if self.gpu_only() {
            return self.compute_device();
        }
        match self.vram_state() {
            VramState::HighVram | VramState::NormalVram | VramState::Shared => {
                let dev = self.compute_device();
                if dev.is_cpu() || self.should_use_fp16(dev, false) {
                    dev
                } else {
                    DeviceId::Cpu
                }
            }
            _ => DeviceId::Cpu,
        }
    }

    /// Where text encoders rest: the GPU with `--gpu-only`, else the CPU.
    pub fn text_encoder_offload_device(&self) -> DeviceId {
        if self.gpu_only() {
            self.compute_device()
        } else {
            DeviceId::Cpu
        }
    }

    /// Where a text encoder of `model_size` bytes is first materialized: on its load device when
    /// that equals the offload device, or when the load device has more than half the offload
    /// device's free memory and the model fits there with 20 % to spare; else offloaded.
    pub fn text_encoder_initial_device(
        &self,
        load: DeviceId,
        offload: DeviceId,
        model_size: ByteSize,
    ) -> DeviceId {
        if load == offload {
            return load;
        }
        let free_load = self.probed_free(load);
        let free_off = self.probed_free(offload);
        if free_load.as_f64() > free_off.as_f64() * 0.5
            && model_size.as_f64() * 1.2 < free_load.as_f64()
        {
            load
        } else {
            offload
        }
    }

    /// Where the VAE computes: the CPU with `--cpu-vae`, else the compute device.
    pub fn vae_device(&self) -> DeviceId {
        if self.config.cpu_vae {
            DeviceId::Cpu
        } else {
            self.compute_device()
        }
    }

    /// Where the VAE rests: the GPU with `--gpu-only`, else the CPU.
    pub fn vae_offload_device(&self) -> DeviceId {
        self.text_encoder_offload_device()
    }

    /// Where intermediate results (latents, conditioning) are kept between models.
    pub fn intermediate_device(&self) -> DeviceId {
        self.text_encoder_offload_device()
    }

    /// The dtype of intermediates: f32.
    pub fn intermediate_dtype(&self) -> Dtype {
        Dtype::F32
    }
}

#[cfg(test)]
mod tests {
    use crate::float::Dtype;
    use crate::size::ByteSize;
    use crate::vram::{Config, DeviceId, GpuInfo, Hardware, Policy};

    fn p(args: &[&str], cc: (u32, u32)) -> Policy {
        let hw = Hardware::with_gpu(GpuInfo::nvidia(0, "card", ByteSize::gib(24), cc));
        Policy::new(Config::from_args(args).unwrap(), hw).unwrap()
    }
    const G: DeviceId = DeviceId::Cuda(0);
    const C: DeviceId = DeviceId::Cpu;

    #[test]
    fn device_helpers_table() {
        // (flags, unet_offload, text_encoder, te_offload, vae, intermediate)
        type Row = (
            &'static [&'static str],
            DeviceId,
            DeviceId,
            DeviceId,
            DeviceId,
            DeviceId,
        );
        let rows: &[Row] = &[
            (&[], C, G, C, G, C),
            (&["--highvram"], G, G, C, G, C),
            (&["--gpu-only"], G, G, G, G, G),
            (&["--lowvram"], C, C, C, G, C),
            (&["--novram"], C, C, C, G, C),
            (&["--cpu-vae"], C, G, C, C, C),
            (&["--cpu"], C, C, C, C, C),
        ];
        for (args, uo, te, teo, vae, inter) in rows {
            let p = p(args, (8, 6));
            let got = (
                p.unet_offload_device(),
                p.text_encoder_device(),
                p.text_encoder_offload_device(),
                p.vae_device(),
                p.intermediate_device(),
            );
            assert_eq!(got, (*uo, *te, *teo, *vae, *inter), "{args:?}");
        }
        // A card that does not compute f16 keeps text encoders on the CPU.
        assert_eq!(p(&[], (5, 2)).text_encoder_device(), C);
        assert_eq!(p(&[], (8, 6)).compute_device(), G);
    }

    #[test]
    fn initial_load_device_prefers_the_roomier_fitting_device() {
        let pol = p(&[], (8, 6)); // 24 GiB free GPU vs 32 GiB host
        assert_eq!(pol.unet_initial_load_device(1_000_000_000, Dtype::BF16), C);
        let mut hw = Hardware::with_gpu(GpuInfo::nvidia(0, "card", ByteSize::gib(24), (8, 6)));
        hw.host.available = ByteSize::gib(8);
        let pol = Policy::new(Config::default(), hw).unwrap();
        assert_eq!(pol.unet_initial_load_device(1_000_000_000, Dtype::BF16), G);
        assert_eq!(pol.unet_initial_load_device(20_000_000_000, Dtype::BF16), C);
        assert_eq!(
            p(&["--highvram"], (8, 6)).unet_initial_load_device(u64::MAX, Dtype::F32),
            G
        );
    }

    #[test]
    fn initial_load_device_table() {
        // (flags, host available GiB, params, dtype) -> device; the card has 24 GiB free.
        type Row = (&'static [&'static str], u64, u64, Dtype, DeviceId);
        let rows: &[Row] = &[
            (&[], 8, 1_000_000_000, Dtype::BF16, G),
            (&["--novram"], 8, 1_000_000_000, Dtype::BF16, C),
            (
                &["--disable-smart-memory"],
                8,
                1_000_000_000,
                Dtype::BF16,
                C,
            ),
            (&["--lowvram"], 8, 1_000_000_000, Dtype::BF16, G),
            (
                &["--highvram", "--disable-smart-memory"],
                8,
                1_000_000_000,
                Dtype::BF16,
                G,
            ),
            (&["--gpu-only"], 64, u64::MAX, Dtype::F32, G),
            // The model must be smaller than the card's free memory...
            (&[], 8, 12 * (1 << 30), Dtype::BF16, C),
            (&[], 8, 12 * (1 << 30) - 1, Dtype::BF16, G),
            // ... and the card must have more free memory than the host.
            (&[], 24, 1_000, Dtype::F32, C),
            (&[], 23, 1_000, Dtype::F32, G),
        ];
        for (args, host, params, dtype, want) in rows {
            let mut hw = Hardware::with_gpu(GpuInfo::nvidia(0, "card", ByteSize::gib(24), (8, 6)));
            hw.host.available = ByteSize::gib(*host);
            let pol = Policy::new(Config::from_args(*args).unwrap(), hw).unwrap();
            assert_eq!(
                pol.unet_initial_load_device(*params, *dtype),
                *want,
                "{args:?} host {host} GiB params {params} {dtype}"
            );
        }
    }

    #[test]
    fn text_encoder_initial_device_needs_room() {
        let pol = p(&[], (8, 6));
        assert_eq!(pol.text_encoder_initial_device(G, G, ByteSize::gib(100)), G);
        assert_eq!(pol.text_encoder_initial_device(G, C, ByteSize::gib(1)), G);
        assert_eq!(pol.text_encoder_initial_device(G, C, ByteSize::gib(21)), C);
    }
}
