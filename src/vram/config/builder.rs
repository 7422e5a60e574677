//! [`Config`]'s builder setters: one per flag, for an engine that configures residency in code
//! instead of a command line.

use super::*;

impl Config {
    /// Sets the prefetch depth.
    pub fn with_prefetch_depth(mut self, depth: usize) -> Self {
        self.prefetch_depth = Some(depth);
        self
    }

    /// Adds a simulated GPU (`--sim-gpu`).
    pub fn with_sim_gpu(mut self, spec: crate::vram::SimSpec) -> Self {
        self.sim_gpus.push(spec);
        self
    }

    /// Sets the memory mode.
    pub fn with_vram_mode(mut self, mode: VramMode) -> Self {
        self.vram_mode = Some(mode);
        self
    }
    /// Sets `--vram-budget`.
    pub fn with_vram_budget(mut self, budget: ByteSize) -> Self {
        self.vram_budget = Some(budget);
        self
    }
    /// Sets `--ram-budget`: models read through the manager's host tier are read lazily and
    /// their host copies stay within `budget`.
    pub fn with_ram_budget(mut self, budget: ByteSize) -> Self {
        self.ram_budget = Some(budget);
        self
    }
    /// Sets `--prepared-host`: the host RAM prepared host copies may take (`0`: none).
    pub fn with_prepared_host(mut self, limit: ByteSize) -> Self {
        self.prepared_host = Some(limit);
        self
    }
    /// Sets `--reserve-vram` in GB.
    pub fn with_reserve_vram_gb(mut self, gb: f64) -> Self {
        self.reserve_vram_gb = Some(gb);
        self
    }
    /// Sets `--disable-smart-memory`.
    pub fn with_smart_memory(mut self, enabled: bool) -> Self {
        self.disable_smart_memory = !enabled;
        self
    }
    /// Sets `--enable-dynamic-vram` (`Some(true)`), `--disable-dynamic-vram` (`Some(false)`), or
    /// ComfyUI's default (`None`).
    pub fn with_dynamic_vram(mut self, dynamic: Option<bool>) -> Self {
        self.dynamic_vram = dynamic;
        self
    }
    /// Sets the number of transfer lanes (0 disables asynchronous offload).
    pub fn with_transfer_lanes(mut self, lanes: usize) -> Self {
        self.disable_async_offload = lanes == 0;
        self.async_offload = (lanes > 0).then_some(Some(lanes));
        self
    }
    /// Sets `--disable-pinned-memory`.
    pub fn with_pinned_memory(mut self, enabled: bool) -> Self {
        self.disable_pinned_memory = !enabled;
        self
    }
    /// Sets `--pinned-memory-limit`.
    pub fn with_pinned_memory_limit(mut self, limit: ByteSize) -> Self {
        self.pinned_memory_limit = Some(limit);
        self
    }
    /// Sets `--cpu-vae`.
    pub fn with_cpu_vae(mut self, on: bool) -> Self {
        self.cpu_vae = on;
        self
    }
    /// Sets the unet storage dtype flag.
    pub fn with_unet_dtype(mut self, dtype: Dtype) -> Self {
        self.unet_dtype = Some(dtype);
        self
    }
    /// Sets `--supports-fp8-compute`.
    pub fn with_fp8_compute(mut self, on: bool) -> Self {
        self.supports_fp8_compute = on;
        self
    }
    /// Sets the attention flag.
    pub fn with_attention(mut self, attention: AttentionFlag) -> Self {
        self.attention = Some(attention);
        self
    }
    /// Sets `--force-fp16` (and clears `--force-fp32`).
    pub fn with_force_fp16(mut self) -> Self {
        self.force_fp16 = true;
        self.force_fp32 = false;
        self
    }
    /// Sets `--force-fp32` (and clears `--force-fp16`).
    pub fn with_force_fp32(mut self) -> Self {
        self.force_fp32 = true;
        self.force_fp16 = false;
        self
    }
    /// Sets `--reserve-vram` for GPU `ordinal` alone, in GB (`--reserve-vram 1=0.5`).
    pub fn with_device_reserve_vram_gb(mut self, ordinal: usize, gb: f64) -> Self {
        self.reserve_vram_gbs.retain(|(o, _)| *o != ordinal);
        self.reserve_vram_gbs.push((ordinal, gb));
        self
    }
    /// Sets `--vram-budget` for GPU `ordinal` alone (`--vram-budget 1=12GiB`).
    pub fn with_device_vram_budget(mut self, ordinal: usize, budget: ByteSize) -> Self {
        self.vram_budgets.retain(|(o, _)| *o != ordinal);
        self.vram_budgets.push((ordinal, budget));
        self
    }
    /// Sets the memory kept free for activations beyond a model's estimate
    /// (`--inference-memory`; ComfyUI's minimum inference memory).
    pub fn with_inference_memory(mut self, bytes: ByteSize) -> Self {
        self.inference_memory = Some(bytes);
        self
    }
    /// Sets the VAE storage dtype flag.
    pub fn with_vae_dtype(mut self, dtype: Dtype) -> Self {
        self.vae_dtype = Some(dtype);
        self
    }
    /// Sets the text encoders' storage dtype flag.
    pub fn with_text_encoder_dtype(mut self, dtype: Dtype) -> Self {
        self.text_encoder_dtype = Some(dtype);
        self
    }
    /// Sets `--force-upcast-attention` / `--dont-upcast-attention`.
    pub fn with_upcast_attention(mut self, upcast: UpcastFlag) -> Self {
        self.upcast_attention = upcast;
        self
    }
    /// Sets `--cuda-device`: the GPU models compute on.
    pub fn with_cuda_device(mut self, ordinal: usize) -> Self {
        self.cuda_device = Some(ordinal);
        self
    }
    /// Sets `--deterministic`.
    pub fn with_deterministic(mut self, on: bool) -> Self {
        self.deterministic = on;
        self
    }
}
