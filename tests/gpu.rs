//! The GPU path end to end, written once against the device interface ([`residency::device`])
//! and run on every backend this machine has: the simulated GPU always (so these run in every
//! test run), CUDA device 0 where there is one. CUDA-only checks (the probe, the driver's free
//! memory) first ask [`Hardware::probe`] for a GPU and, without one, print why they skipped;
//! candle CUDA tensors additionally need `--features cuda`.
//!
//! `bash scripts/gpu-check.sh` runs these on a GPU machine.

mod common;

use std::sync::Arc;

use residency::device::{Gpu, SimGpu, SimSpec};
use residency::vram::{GpuInfo, Hardware};
use residency::ByteSize;

/// GPU 0, or `None` after printing why the calling test skips.
fn gpu0(test: &str) -> Option<GpuInfo> {
    let hw = Hardware::probe();
    match hw.gpus.first() {
        Some(g) => Some(g.clone()),
        None => {
            let why = if residency::vram::cuda_driver_present() {
                "the CUDA driver library loads but reports no usable device"
            } else {
                "no CUDA driver library (libcuda) on this machine"
            };
            eprintln!("skipping {test} on CUDA: no CUDA GPU ({why})");
            None
        }
    }
}

/// Every backend to run a scenario on: a simulated GPU (with a modelled bus, so copies really
/// run behind the caller) and, where there is one, CUDA device 0. The sim is returned too, for
/// its checker.
fn backends(test: &str) -> Vec<(Gpu, Option<Arc<SimGpu>>)> {
    let sim = SimGpu::new(
        0,
        SimSpec::new(ByteSize::gib(1))
            .with_bandwidth(25e9)
            .with_latency(std::time::Duration::from_micros(50))
            .with_jitter(1),
    );
    let mut v = vec![(Gpu::Sim(Arc::clone(&sim)), Some(sim))];
    if gpu0(test).is_some() {
        let ctx = residency::vram::cuda_context(residency::vram::DeviceId::Cuda(0))
            .expect("a context on GPU 0");
        v.push((Gpu::Cuda(ctx), None));
    }
    v
}

/// The sim's checker is clean and nothing is left allocated.
fn checked(sim: &Option<Arc<SimGpu>>) {
    if let Some(sim) = sim {
        sim.check().expect("the sim's checker found misuse");
        assert!(sim.leaks().is_empty(), "{:?}", sim.leaks());
    }
}

#[test]
fn probe_reports_the_gpu_name_total_and_free() {
    let Some(g) = gpu0("probe_reports_the_gpu_name_total_and_free") else {
        return;
    };
    eprintln!("GPU 0: {g:?}");
    assert!(!g.name.trim().is_empty(), "{g:?}");
    assert!(
        g.total >= residency::ByteSize::gib(1),
        "a CUDA GPU has at least 1 GiB: {g:?}"
    );
    assert!(
        g.free > residency::ByteSize::ZERO && g.free <= g.total,
        "{g:?}"
    );
    assert!(g.compute_capability.0 >= 3, "{g:?}");
}

#[test]
fn pinned_pool_buffers_are_page_locked() {
    use residency::offload::PinnedPool;
    for (gpu, sim) in backends("pinned_pool_buffers_are_page_locked") {
        let pool = PinnedPool::pinned(residency::ByteSize::mib(8), gpu.clone());
        let mut buf = pool.acquire(3 * 1024 * 1024).expect("fits the limit");
        assert!(
            buf.is_pinned(),
            "a pinned pool hands out page-locked buffers ({gpu:?})"
        );
        let bytes = buf.as_mut_bytes().expect("writable");
        assert!(bytes.iter().all(|&b| b == 0), "zeroed when made");
        bytes.fill(0xA5);
        assert!(bytes.iter().all(|&b| b == 0xA5));
        drop(buf);
        let s = pool.stats();
        assert!(s.pinned, "{s:?}");
        assert_eq!(s.created, 1, "{s:?}");
        drop(pool);
        checked(&sim);
    }
}

#[test]
fn staged_copies_queued_on_lane_streams_land_intact() {
    use residency::offload::{copy_to_device, PinnedPool};
    for (gpu, sim) in backends("staged_copies_queued_on_lane_streams_land_intact") {
        // Two 1 MiB buffers for 64 copies of ~1 MiB queued per stream before anything is read
        // back: buffers are reused while earlier copies from them may still run, so a buffer
        // rewritten before its copy finished would show up as a wrong pattern below (and, on the
        // sim, as a checker finding).
        let pool = PinnedPool::pinned(residency::ByteSize::mib(2), gpu.clone());
        let n = 250_000usize;
        let threads: Vec<_> = (0..3u32)
            .map(|t| {
                let (gpu, pool) = (gpu.clone(), pool.clone());
                std::thread::spawn(move || {
                    let stream = gpu.new_stream().expect("a lane stream");
                    let pattern = |round: u32| -> Vec<u32> {
                        (0..n as u32)
                            .map(|i| i.wrapping_mul(2_654_435_761) ^ (t << 24 | round))
                            .collect()
                    };
                    let copies: Vec<_> = (0..64)
                        .map(|round| {
                            copy_to_device(
                                &pattern(round),
                                candle_core::DType::U32,
                                &stream,
                                Some(&pool),
                            )
                            .unwrap()
                        })
                        .collect();
                    for (round, dst) in copies.iter().enumerate() {
                        let back = stream.read_back(dst).expect("read back");
                        assert!(
                            back == bytemuck::cast_slice::<u32, u8>(&pattern(round as u32)),
                            "thread {t} copy {round} corrupted"
                        );
                    }
                })
            })
            .collect();
        for h in threads {
            h.join().unwrap();
        }
        let s = pool.stats();
        assert!(s.pinned, "{s:?}");
        assert!(
            s.reused > 100,
            "buffers were reused while copies ran: {s:?}"
        );
        assert!(s.allocated <= residency::ByteSize::mib(2), "{s:?}");
        drop(pool);
        checked(&sim);
    }
}

#[test]
fn free_memory_of_an_unbudgeted_gpu_is_the_drivers_figure() {
    let Some(_) = gpu0("free_memory_of_an_unbudgeted_gpu_is_the_drivers_figure") else {
        return;
    };
    use residency::loader::MemoryManager;
    use residency::vram::{driver_free_memory, Config, DeviceId};
    use residency::ByteSize;
    let mm = MemoryManager::new(Config::default(), Hardware::probe()).unwrap();
    assert!(!mm.policy().is_budgeted(DeviceId::Cuda(0)));
    let before = driver_free_memory(0).expect("driver figure");
    let seen = mm.get_free_memory(DeviceId::Cuda(0));
    let after = driver_free_memory(0).expect("driver figure");
    // Other processes may allocate between the reads; allow a little slack around them.
    let slack = ByteSize::mib(64);
    let lo = before.min(after).saturating_sub(slack);
    let hi = before.max(after).saturating_add(slack);
    assert!(
        lo <= seen && seen <= hi,
        "manager {seen} vs driver {before}..{after}"
    );
}

#[test]
fn using_a_model_on_a_gpu_without_loading_it_is_noted_once_and_a_loaded_one_is_not() {
    use residency::loader::{LoadOptions, MemoryManager};
    use residency::offload::fetch_weight;
    use residency::patcher::ModelPatcher;
    use residency::vram::{Config, DeviceId};
    use residency::Model;
    let w =
        || candle_core::Tensor::ones((8, 8), candle_core::DType::F32, &candle_core::Device::Cpu);
    let forgotten = Arc::new(Model::from_tensors("forgotten", [("w", w().unwrap())]).unwrap());
    let p = ModelPatcher::new(Arc::clone(&forgotten), DeviceId::Sim(0), DeviceId::Cpu);
    assert!(!forgotten.used_without_load());
    let (t, streamed) = fetch_weight(&p, "w").unwrap();
    assert!(streamed && t.dims() == [8, 8]);
    assert!(
        forgotten.used_without_load(),
        "the engine forgot load_models_gpu"
    );

    for (mode, streams_first) in [
        ("--disable-dynamic-vram", false),
        ("--enable-dynamic-vram", true),
    ] {
        let config =
            Config::from_args(["--sim-gpu", "64MiB", "--reserve-vram", "0", mode]).unwrap();
        let mm = MemoryManager::new(config, Hardware::cpu_only(ByteSize::gib(8))).unwrap();
        let loaded = Arc::new(Model::from_tensors("loaded", [("w", w().unwrap())]).unwrap());
        let q = ModelPatcher::new(Arc::clone(&loaded), mm.compute_device(), DeviceId::Cpu);
        mm.load_models_gpu(std::slice::from_ref(&q), LoadOptions::default())
            .unwrap();
        // Dynamic: the first use faults the weight in, the next finds it resident.
        let (_, streamed) = fetch_weight(&q, "w").unwrap();
        assert_eq!(streamed, streams_first, "{mode}");
        let (_, streamed) = fetch_weight(&q, "w").unwrap();
        assert!(!streamed && !loaded.used_without_load(), "{mode}");
    }
}

#[test]
fn a_cuda_device_without_the_cuda_feature_says_which_feature_to_turn_on() {
    if cfg!(feature = "cuda") {
        return;
    }
    let e = residency::vram::DeviceId::Cuda(0)
        .to_candle()
        .unwrap_err()
        .to_string();
    assert!(e.contains("features = [\"cuda\"]"), "{e}");
}

#[cfg(not(feature = "cuda"))]
#[test]
fn soft_empty_cache_returns_freed_device_memory() {
    eprintln!(
        "skipping soft_empty_cache_returns_freed_device_memory: GPU tensors need \
         `--features cuda`"
    );
}

/// The manager's whole transfer path (loads, lanes, prefetch, pins in place, staging) on a GPU.
mod scenario {
    use std::sync::Arc;

    use candle_core::Tensor;
    use residency::float::Dtype;
    use residency::loader::{LoadOptions, MemoryManager};
    use residency::offload::fetch_weight;
    use residency::patcher::{Lora, ModelPatcher, Patch};
    use residency::vram::{Config, DeviceId, Hardware};
    use residency::weights::{save_safetensors, Model, SafetensorsOptions};
    use residency::ByteSize;

    use super::common::{f32s, rand_tensor};
    use super::gpu0;

    const LAYERS: usize = 8;
    const WIDTH: usize = 256;
    /// One layer in f32 on the device.
    const LAYER_BYTES: u64 = (WIDTH * WIDTH * 4) as u64;

    enum Budget {
        Full,
        Half,
        NoVram,
        /// Half the model's bytes, residency by use (dynamic mode).
        DynamicHalf,
    }

    /// Loads an 8-layer bf16 MLP (with a LoRA on every other layer) onto `device` (`sim:0` or
    /// `cuda:0`) under `budget`, runs two forwards of matmuls through `fetch_weight`, and returns
    /// the second's output bits, the bytes resident on the GPU and the bytes streamed through
    /// page-locked staging or straight from weights pinned in place. On the sim, its checker must
    /// be clean and nothing left allocated once the model is gone.
    fn run(device: DeviceId, budget: Budget, lanes: usize) -> (Vec<f32>, ByteSize, ByteSize) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mlp.safetensors");
        let tensors: Vec<_> = (0..LAYERS)
            .map(|l| {
                let w = (rand_tensor(&[WIDTH, WIDTH], l as u64 + 100) * 0.1).unwrap();
                let w = residency::float::from_f32(&w, Dtype::BF16, residency::Rounding::Nearest)
                    .unwrap();
                (format!("layers.{l}.weight"), w, Dtype::BF16)
            })
            .collect();
        save_safetensors(&path, &tensors, &SafetensorsOptions::default()).unwrap();
        let model = Model::from_safetensors("mlp", &[path]).unwrap();

        let total = LAYER_BYTES * LAYERS as u64;
        let mut args = vec!["--reserve-vram".to_string(), "0".to_string()];
        match budget {
            Budget::Full => args.extend(["--vram-budget".into(), "4GiB".into()]),
            Budget::Half | Budget::DynamicHalf => {
                args.extend(["--vram-budget".into(), (total / 2 + 1).to_string()])
            }
            Budget::NoVram => args.push("--novram".into()),
        }
        // The classic loads decide what is resident at load time (what these runs check);
        // dynamic mode is its own budget.
        args.push(match budget {
            Budget::DynamicHalf => "--enable-dynamic-vram".into(),
            _ => "--disable-dynamic-vram".into(),
        });
        if device.is_sim() {
            // PCIe 4.0 x16's bandwidth, seeded jitter: copies really run behind compute.
            args.extend(["--sim-gpu".into(), "4GiB@25GB/s".into()]);
        }
        let config = Config::from_args(&args)
            .unwrap()
            .with_transfer_lanes(lanes)
            .with_prefetch_depth(2);
        let hw = if device.is_sim() {
            Hardware::cpu_only(ByteSize::gib(32))
        } else {
            Hardware::probe()
        };
        let mm = MemoryManager::new(config, hw).unwrap();
        assert_eq!(mm.compute_device(), device);
        let mut p = ModelPatcher::new(Arc::new(model), device, DeviceId::Cpu)
            .with_compute_dtype(Some(Dtype::F32));
        for l in (0..LAYERS).step_by(2) {
            let lora = Lora::new(
                rand_tensor(&[WIDTH, 4], l as u64),
                rand_tensor(&[4, WIDTH], l as u64 + 1),
            );
            p.add_patches(
                [(format!("layers.{l}.weight"), Patch::Lora(lora))],
                0.5,
                1.0,
            )
            .unwrap();
        }
        mm.load_models_gpu(std::slice::from_ref(&p), LoadOptions::default())
            .unwrap();
        let resident = mm.ledger(device);

        let dev = device.to_candle().unwrap();
        assert_eq!(dev.is_cuda(), !device.is_sim());
        let mut out = Vec::new();
        for _ in 0..2 {
            let mut x: Tensor = rand_tensor(&[16, WIDTH], 9).to_device(&dev).unwrap();
            for l in 0..LAYERS {
                let (w, _) = fetch_weight(&p, &format!("layers.{l}.weight")).unwrap();
                assert_eq!(w.device().is_cuda(), dev.is_cuda(), "layer {l}");
                x = x.matmul(&w.t().unwrap()).unwrap().tanh().unwrap();
            }
            p.model().finish_forward();
            out = f32s(&x);
        }
        let stats = mm.transfer_stats();
        let copied = stats.bytes_staged.saturating_add(stats.bytes_direct);
        drop(p);
        mm.unload_all_models();
        mm.soft_empty_cache();
        for sim in mm.transfer_engine().devices().sims() {
            sim.check().expect("the sim's checker found misuse");
            // A lane may still be finishing a prefetch the unload dropped (its buffer is freed
            // when the copy completes, and its staging buffer goes back to the pool, which the
            // unload above may have trimmed before): a leak is what is still allocated after
            // that, with the pool trimmed again (`cleanup_models` trims it).
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while !sim.leaks().is_empty() && std::time::Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(5));
                mm.cleanup_models();
            }
            assert!(sim.leaks().is_empty(), "{:?}", sim.leaks());
        }
        (out, resident, copied)
    }

    fn devices(test: &str) -> Vec<DeviceId> {
        let mut v = vec![DeviceId::Sim(0)];
        if cfg!(feature = "cuda") && gpu0(test).is_some() {
            v.push(DeviceId::Cuda(0));
        }
        v
    }

    #[test]
    fn matmuls_on_gpu_are_bit_identical_for_full_half_and_novram() {
        for device in devices("matmuls_on_gpu_are_bit_identical_for_full_half_and_novram") {
            bit_identical_for_every_budget(device);
        }
    }

    fn bit_identical_for_every_budget(device: DeviceId) {
        let total = ByteSize(LAYER_BYTES * LAYERS as u64);
        let (full, resident_full, _) = run(device, Budget::Full, 2);
        assert_eq!(
            resident_full, total,
            "a full load keeps every layer on the GPU"
        );
        assert!(full.iter().all(|v| v.is_finite()));
        for lanes in [0, 2] {
            let (half, resident_half, copied) = run(device, Budget::Half, lanes);
            assert!(
                copied > ByteSize::ZERO,
                "streamed layers were copied from page-locked memory ({lanes} lanes)"
            );
            assert!(
                resident_half > ByteSize::ZERO && resident_half <= ByteSize(total.bytes() / 2 + 1),
                "about half resident: {resident_half} of {total}"
            );
            assert_eq!(half, full, "half budget, {lanes} lanes");
            let (novram, resident_none, _) = run(device, Budget::NoVram, lanes);
            assert_eq!(
                resident_none,
                ByteSize::ZERO,
                "nothing resident under --novram"
            );
            assert_eq!(novram, full, "--novram, {lanes} lanes");
            let (dynamic, resident_dynamic, _) = run(device, Budget::DynamicHalf, lanes);
            assert_eq!(
                resident_dynamic,
                ByteSize::ZERO,
                "a dynamic load moves nothing"
            );
            assert_eq!(dynamic, full, "dynamic mode at half, {lanes} lanes");
        }
    }
}

// The ported model files' `crate::candle` and `crate::utils`.
#[cfg(feature = "cuda")]
include!("ported/shim.rs");
/// candle-transformers' `quantized_qwen3_moe` on residency (the port `tests/moe.rs` checks on the
/// CPU and the simulated GPU), for the CUDA runs below.
#[cfg(feature = "cuda")]
#[path = "ported/qwen3_moe_managed.rs"]
#[allow(dead_code, unused_imports, clippy::all)]
mod managed;

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::Tensor;
    use residency::loader::MemoryManager;
    use residency::vram::{Config, DeviceId, Hardware};
    use residency::ByteSize;

    use super::gpu0;

    #[test]
    fn soft_empty_cache_returns_freed_device_memory() {
        let Some(_) = gpu0("soft_empty_cache_returns_freed_device_memory") else {
            return;
        };
        let dev = DeviceId::Cuda(0).to_candle().unwrap();
        let before = residency::vram::driver_free_memory(0).unwrap();
        let t = Tensor::zeros((256, 1024, 1024), candle_core::DType::F32, &dev).unwrap(); // 1 GiB
        dev.synchronize().unwrap();
        let during = residency::vram::driver_free_memory(0).unwrap();
        assert!(during < before, "allocating 1 GiB lowers free memory");
        drop(t);
        MemoryManager::new(Config::default(), Hardware::probe())
            .unwrap()
            .soft_empty_cache();
        let after = residency::vram::driver_free_memory(0).unwrap();
        assert!(
            after.saturating_add(ByteSize::mib(256)) >= before,
            "freed memory went back to the driver: before {before}, during {during}, after {after}"
        );
    }

    #[test]
    fn an_input_on_another_device_than_the_weights_is_an_error_naming_both() {
        let Some(_) = gpu0("an_input_on_another_device_than_the_weights_is_an_error_naming_both")
        else {
            return;
        };
        use residency::ops::{OpsBuilder, OpsMode};
        use residency::patcher::ModelPatcher;
        use residency::weights::Model;
        let w = Tensor::ones((4, 4), candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
        let model = Model::from_tensors("net", [("proj.weight", w)]).unwrap();
        let p = ModelPatcher::new(std::sync::Arc::new(model), DeviceId::Cpu, DeviceId::Cpu);
        let layer = OpsBuilder::new(&p, OpsMode::DisableWeightInit)
            .linear("proj", false)
            .unwrap();
        let dev = DeviceId::Cuda(0).to_candle().unwrap();
        let x = Tensor::ones((1, 4), candle_core::DType::F32, &dev).unwrap();
        let e = layer.try_forward(&x).unwrap_err().to_string();
        assert!(
            e.contains("Cuda") && e.contains("Cpu") && e.contains("proj.weight"),
            "{e}"
        );
    }

    /// Logits of the tiny Qwen3-MoE decoded on CUDA under `flags` (prompt, then `tokens`
    /// forced), and the manager.
    fn qwen3_moe_logits(
        path: &std::path::Path,
        flags: &[&str],
        tokens: &[u32],
    ) -> (Vec<Vec<f32>>, MemoryManager) {
        use residency::loader::LoadOptions;
        use residency::patcher::ModelPatcher;
        let mut all = vec!["--reserve-vram", "0"];
        all.extend_from_slice(flags);
        let mm = MemoryManager::new(Config::from_args(&all).unwrap(), Hardware::probe()).unwrap();
        assert_eq!(mm.compute_device(), DeviceId::Cuda(0));
        let model = mm.read_model("tiny-qwen3moe", &[path]).unwrap();
        let p = ModelPatcher::new(std::sync::Arc::new(model), DeviceId::Cuda(0), DeviceId::Cpu);
        mm.load_models_gpu(std::slice::from_ref(&p), LoadOptions::default())
            .unwrap();
        let device = DeviceId::Cuda(0).to_candle().unwrap();
        let ct = residency::quantized::gguf_file::Content::from_patcher(&p);
        let mut reader = std::io::Cursor::new(Vec::<u8>::new());
        let mut model = super::managed::quantized_qwen3_moe::GGUFQWenMoE::from_gguf(
            ct,
            &mut reader,
            &device,
            candle_core::DType::F32,
        )
        .unwrap();
        let prompt = [1u32, 17, 42, 5, 63];
        let mut logits = Vec::new();
        let mut step = |input: &[u32], pos: usize| {
            let x = Tensor::new(input, &device).unwrap().unsqueeze(0).unwrap();
            let out = model.forward(&x, pos).unwrap();
            logits.push(out.flatten_all().unwrap().to_vec1::<f32>().unwrap());
        };
        step(&prompt, 0);
        for (i, &t) in tokens.iter().enumerate() {
            step(&[t], prompt.len() + i);
        }
        (logits, mm)
    }

    #[test]
    fn a_mixture_of_experts_by_use_is_bit_identical_and_cost_aware_misses_stay_close_on_cuda() {
        let Some(_) = gpu0(
            "a_mixture_of_experts_by_use_is_bit_identical_and_cost_aware_misses_stay_close_on_cuda",
        ) else {
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny-qwen3moe.gguf");
        crate::common::gguf::write_tiny_qwen3_moe(&path);
        let tokens: Vec<u32> = (0..12).map(|i| (i * 7 + 3) % 64).collect();
        let (resident, _) = qwen3_moe_logits(&path, &[], &tokens);
        let size = std::fs::metadata(&path).unwrap().len();
        let budget = format!("{}B", size * 3 / 10);
        // Residency by use at 30 %: streamed == resident, bit for bit, on the GPU too.
        let (by_use, mm) = qwen3_moe_logits(
            &path,
            &["--vram-budget", &budget, "--enable-dynamic-vram"],
            &tokens,
        );
        let report = &mm.memory_report().dynamic_devices[0];
        assert!(report.faults_in > 0, "{report}");
        for (step, (a, b)) in by_use.iter().zip(&resident).enumerate() {
            let (a, b): (Vec<u32>, Vec<u32>) = (
                a.iter().map(|v| v.to_bits()).collect(),
                b.iter().map(|v| v.to_bits()).collect(),
            );
            assert_eq!(a, b, "by use, step {step}");
        }
        // Cost-aware misses: some run on the host (its kernels round differently), so the
        // logits are close, not equal — the one placement-dependent mode.
        let (costed, mm) = qwen3_moe_logits(
            &path,
            &[
                "--vram-budget",
                &budget,
                "--enable-dynamic-vram",
                "--cost-aware-misses",
            ],
            &tokens,
        );
        let misses = mm.miss_report().expect("a miss report");
        assert!(misses.on_host > 0 && misses.on_device > 0, "{misses}");
        // Every host run was served a prepared copy or built one (kept: the default room is a
        // quarter of the host's RAM).
        let p = misses.prepared;
        assert!(p.kept > 0 && p.refused == 0, "{misses}");
        assert_eq!(misses.on_host, p.hits + p.kept, "{misses}");
        eprintln!("{misses}");
        for (step, (a, b)) in costed.iter().zip(&resident).enumerate() {
            let dot: f64 = a
                .iter()
                .zip(b)
                .map(|(x, y)| f64::from(*x) * f64::from(*y))
                .sum();
            let norm = |v: &[f32]| v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
            let cosine = dot / (norm(a) * norm(b));
            let worst = a
                .iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max);
            let range = b.iter().fold(0f32, |m, v| m.max(v.abs()));
            eprintln!("step {step}: cosine {cosine:.6}, max |diff| {worst:.2e} of {range:.2e}");
            assert!(cosine > 0.999, "step {step}: cosine {cosine}");
            assert!(worst <= 0.02 * range, "step {step}: {worst} of {range}");
        }
    }
}
