//! A LoRA'd model streamed on a simulated GPU at 25 GB/s (PCIe 4.0 x16) with a quarter of it
//! resident: forward time with the LoRA against the same forward without it.
//!
//! 8 layers of 2048×2048 bf16 weights, f32 compute, a rank-16 LoRA (alpha 16) on every layer,
//! 2 transfer lanes, prefetch 2, the budget a quarter of the model in f32; the classic partial
//! load and residency by use. A streamed LoRA'd weight is copied clean (page-locked in place, no
//! host buffer) and patched on the device after its copy, on the copy's stream (the sim's stream
//! worker stands in for the GPU, so the patch costs this CPU's time there). Goal: with / without
//! ≤ 1.10.
//!
//! Limits measured in the same run: the base model fully resident (the floor), the base streamed
//! (what the LoRA'd forward is measured against), and a fresh 8 MiB host buffer allocated and
//! filled (what a host-side patch of a streamed weight paid per fetch before).
//!
//! `cargo bench --bench lora_stream`. With `LORA_DEVICE=probe` the streamed runs use this
//! machine's own device (`Hardware::probe`: a CUDA GPU under `--features cuda`, else the CPU)
//! under the same `--vram-budget` instead of the simulated GPU: there the patch is device work on
//! the GPU (scripts/gpu-check.sh runs it).

use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use criterion::{criterion_group, Criterion};
use residency::float::Dtype;
use residency::loader::{LoadOptions, MemoryManager};
use residency::offload::fetch_weight;
use residency::patcher::{Lora, ModelPatcher, Patch};
use residency::vram::{Config, DeviceId, Hardware};
use residency::{ByteSize, Model};

const LAYERS: usize = 8;
const WIDTH: usize = 2048;
const RANK: usize = 16;
const BATCHES: [usize; 2] = [64, 256];
const ROUNDS: usize = 7;

fn model() -> Arc<Model> {
    let tensors = (0..LAYERS).map(|l| {
        let w = Tensor::randn(0f32, 0.02, (WIDTH, WIDTH), &Device::Cpu).unwrap();
        let w = residency::float::from_f32(&w, Dtype::BF16, residency::Rounding::Nearest).unwrap();
        (format!("layers.{l}.weight"), w)
    });
    Arc::new(Model::from_tensors("deep-mlp", tensors).unwrap())
}

fn with_lora(p: &ModelPatcher) -> ModelPatcher {
    let mut p = p.clone();
    let patches = (0..LAYERS).map(|l| {
        let up = Tensor::randn(0f32, 0.02, (WIDTH, RANK), &Device::Cpu).unwrap();
        let down = Tensor::randn(0f32, 0.02, (RANK, WIDTH), &Device::Cpu).unwrap();
        let lora = Lora {
            alpha: Some(RANK as f32),
            ..Lora::new(up, down)
        };
        (format!("layers.{l}.weight"), Patch::Lora(lora))
    });
    p.add_patches(patches, 1.0, 1.0).unwrap();
    p
}

struct Setup {
    p: ModelPatcher,
    mm: MemoryManager,
}

/// Whether the streamed runs use this machine's own device (`LORA_DEVICE=probe`).
fn on_probed_device() -> bool {
    std::env::var("LORA_DEVICE").is_ok_and(|v| v == "probe")
}

/// A manager of its own on the simulated GPU (or the probed device) with the model loaded (the
/// whole model resident when `budget` is `None`).
fn setup(model: &Arc<Model>, lora: bool, budget: Option<ByteSize>, mode: &str) -> Setup {
    let probed = on_probed_device();
    let mut flags = if probed {
        vec![mode]
    } else {
        vec!["--sim-gpu", "8GiB@25GB/s", mode]
    };
    if budget.is_none() {
        flags.push("--highvram");
    }
    let device = if probed {
        Hardware::probe()
            .gpus
            .first()
            .map_or(DeviceId::Cpu, |g| DeviceId::Cuda(g.ordinal))
    } else {
        DeviceId::Sim(0)
    };
    setup_on(model, lora, budget, &flags, device)
}

/// [`setup`] on `device` with `flags`.
fn setup_on(
    model: &Arc<Model>,
    lora: bool,
    budget: Option<ByteSize>,
    flags: &[&str],
    device: DeviceId,
) -> Setup {
    let mut args: Vec<String> = ["--reserve-vram", "0"]
        .iter()
        .chain(flags)
        .map(|s| s.to_string())
        .collect();
    if let Some(b) = budget {
        args.extend(["--vram-budget".to_string(), b.bytes().to_string()]);
    }
    let cfg = Config::from_args(&args)
        .unwrap()
        .with_transfer_lanes(2)
        .with_prefetch_depth(2);
    let hardware = if matches!(device, DeviceId::Cuda(_)) {
        Hardware::probe()
    } else {
        Hardware::cpu_only(ByteSize::gib(16))
    };
    let mm = MemoryManager::new(cfg, hardware).unwrap();
    // Residency is per model: each setup gets its own model (and host copies, pinned by its own
    // manager).
    let own = Arc::new(
        Model::from_tensors(
            "deep-mlp",
            (0..LAYERS).map(|l| {
                let key = format!("layers.{l}.weight");
                // Its own copy: two managers cannot pin the same host bytes.
                let t = model.clean(&key).unwrap().copy().unwrap();
                (key, t)
            }),
        )
        .unwrap(),
    );
    let base = ModelPatcher::new(own, device, DeviceId::Cpu).with_compute_dtype(Some(Dtype::F32));
    let p = if lora { with_lora(&base) } else { base };
    mm.load_models_gpu(std::slice::from_ref(&p), LoadOptions::default())
        .unwrap();
    let s = Setup { p, mm };
    forward(&s, 1); // records the order
    forward(&s, 1);
    s
}

fn forward(s: &Setup, batch: usize) -> Tensor {
    let device = s.p.load_device().to_candle().unwrap();
    let mut x = Tensor::ones((batch, WIDTH), candle_core::DType::F32, &device).unwrap();
    for l in 0..LAYERS {
        let (w, _) = fetch_weight(&s.p, &format!("layers.{l}.weight")).unwrap();
        x = x.matmul(&w.t().unwrap()).unwrap().tanh().unwrap();
    }
    s.p.model().finish_forward();
    // The forward's time includes its device work.
    device.synchronize().unwrap();
    x
}

fn time(s: &Setup, batch: usize) -> Duration {
    let t0 = Instant::now();
    std::hint::black_box(forward(s, batch));
    t0.elapsed()
}

fn median(v: &mut [Duration]) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Allocating and filling a fresh 8 MiB host buffer (one bf16 2048² weight): the median of 15.
fn fresh_buffer() -> Duration {
    let mut v: Vec<Duration> = (0..15)
        .map(|i| {
            let t0 = Instant::now();
            let b = vec![i as u8 | 1; WIDTH * WIDTH * 2];
            std::hint::black_box(&b);
            t0.elapsed()
        })
        .collect();
    median(&mut v)
}

fn bench(_: &mut Criterion) {
    let model = model();
    let model_f32 = ByteSize((LAYERS * WIDTH * WIDTH * 4) as u64);
    let budget = ByteSize(model_f32.bytes() / 4);
    let resident = setup(&model, false, None, "--disable-dynamic-vram");
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    for mode in ["--disable-dynamic-vram", "--enable-dynamic-vram"] {
        let base = setup(&model, false, Some(budget), mode);
        let lora = setup(&model, true, Some(budget), mode);
        for batch in BATCHES {
            let before = lora.mm.transfer_stats();
            let mut samples: [Vec<Duration>; 3] = Default::default();
            for _ in 0..ROUNDS {
                samples[0].push(time(&resident, batch));
                samples[1].push(time(&base, batch));
                samples[2].push(time(&lora, batch));
            }
            let after = lora.mm.transfer_stats();
            let [r, b, l] = samples.each_mut().map(|v| median(v));
            let per = |a: ByteSize, b: ByteSize| {
                ByteSize(a.bytes().saturating_sub(b.bytes()) / ROUNDS as u64)
            };
            println!();
            let on = if on_probed_device() {
                format!("on {} (LORA_DEVICE=probe)", lora.p.load_device())
            } else {
                "on a simulated GPU at 25 GB/s".to_string()
            };
            println!(
                "lora_stream {on}, {mode} ({LAYERS} layers of {WIDTH}x{WIDTH} bf16, \
                 f32 compute, rank-{RANK} LoRA on every layer, batch {batch}, budget {budget} = 1/4 of {model_f32} f32, \
                 median of {ROUNDS} interleaved rounds):"
            );
            println!("  base, fully resident (limit)   {:>8.2} ms", ms(r));
            println!(
                "  base, streamed                 {:>8.2} ms  ({:.2}x resident)",
                ms(b),
                b.as_secs_f64() / r.as_secs_f64()
            );
            println!(
                "  LoRA'd, streamed               {:>8.2} ms  with / without LoRA {:.2} (goal <= 1.10)",
                ms(l),
                l.as_secs_f64() / b.as_secs_f64()
            );
            let host = lora.mm.memory_report().host;
            println!(
                "  LoRA'd copies per forward: {} straight from the pinned clean copy, {} staged, {} pageable \
                 (pinned in place {} of a pin budget of {}, {} pin failures; host buffers made per fetch: none; \
                 a fresh 8 MiB buffer costs {:.2} ms here); prefetch {} hits / {} misses",
                per(after.bytes_direct, before.bytes_direct),
                per(after.bytes_staged, before.bytes_staged),
                per(after.bytes_pageable, before.bytes_pageable),
                host.pinned,
                host.pin_budget,
                host.pin_failures,
                ms(fresh_buffer()),
                after.prefetch_hits - before.prefetch_hits,
                after.prefetch_misses - before.prefetch_misses,
            );
        }
    }
}

/// The same model on the CPU under `--novram` (every weight patched and cast on the host at
/// every use; the issue measured 13.5× with the LoRA before the row-block engine).
fn bench_cpu(_: &mut Criterion) {
    let model = model();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let flags = ["--novram"];
    let resident = setup_on(&model, false, None, &["--highvram"], DeviceId::Cpu);
    let base = setup_on(&model, false, None, &flags, DeviceId::Cpu);
    let lora = setup_on(&model, true, None, &flags, DeviceId::Cpu);
    for batch in BATCHES {
        let mut samples: [Vec<Duration>; 3] = Default::default();
        for _ in 0..ROUNDS {
            samples[0].push(time(&resident, batch));
            samples[1].push(time(&base, batch));
            samples[2].push(time(&lora, batch));
        }
        let [r, b, l] = samples.each_mut().map(|v| median(v));
        println!();
        println!(
            "lora_stream on the CPU under --novram ({LAYERS} layers of {WIDTH}x{WIDTH} bf16, f32 compute, \
             rank-{RANK} LoRA on every layer, batch {batch}, median of {ROUNDS} interleaved rounds):"
        );
        println!("  base, resident (limit)         {:>8.2} ms", ms(r));
        println!("  base, --novram                 {:>8.2} ms", ms(b));
        println!(
            "  LoRA'd, --novram               {:>8.2} ms  with / without LoRA {:.2}",
            ms(l),
            l.as_secs_f64() / b.as_secs_f64()
        );
    }
}

criterion_group!(benches, bench, bench_cpu);
/// `criterion_main!(benches)`, with candle's thread count cached first
/// ([`residency::tools::cache_candle_thread_count`]).
fn main() {
    residency::tools::cache_candle_thread_count();
    benches();
    criterion::Criterion::default()
        .configure_from_args()
        .final_summary();
}
