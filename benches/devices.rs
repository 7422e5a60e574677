//! One model twice a device's size: split across two simulated GPUs by an auto `DeviceMap` vs
//! streamed on one (ComfyUI #13537's comparison: hidden states are small, weights are not), one
//! token per forward (a decode step), at a slow link (2 GB/s) and at PCIe 4.0 x16 (25 GB/s),
//! with this CPU's real compute.
//!
//! Limit measured in the same run: the model fully resident on one large simulated device (what
//! neither can beat). Printed per bandwidth: ms per forward and bytes moved per forward (weights
//! streamed; activations copied between devices), and the split's speedup over streaming.

use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use criterion::{criterion_group, Criterion};
use residency::loader::{LoadOptions, MemoryManager};
use residency::ops::{OpsBuilder, OpsMode};
use residency::vram::{Config, DeviceId, Hardware};
use residency::{ByteSize, DeviceMap, Dtype, Model, ModelPatcher};

const LAYERS: usize = 16;
const WIDTH: usize = 1024;
/// One token per forward: the decode step of a language model (hidden states are small).
const TOKENS: usize = 1;

fn model() -> Model {
    let tensors = (0..LAYERS).map(|l| {
        let w = Tensor::randn(0f32, 0.05, (WIDTH, WIDTH), &Device::Cpu).unwrap();
        (format!("layers.{l}.weight"), w)
    });
    Model::from_tensors("mlp", tensors).unwrap()
}

/// A manager on simulated GPUs `specs`, with small fixed overheads and prefetch on.
fn manager(specs: &str) -> MemoryManager {
    let config = Config::from_args([
        "--sim-gpus",
        specs,
        "--reserve-vram",
        "0",
        "--inference-memory",
        "256KiB",
        // The classic loads: the split is measured resident on both devices.
        "--disable-dynamic-vram",
    ])
    .unwrap();
    MemoryManager::new(config, Hardware::cpu_only(ByteSize::gib(16))).unwrap()
}

struct Setup {
    mm: MemoryManager,
    p: ModelPatcher,
    layers: Vec<residency::ops::Linear>,
}

impl Setup {
    fn new(specs: &str, split: bool) -> Setup {
        let mm = manager(specs);
        let mut p = ModelPatcher::new(model(), DeviceId::Sim(0), DeviceId::Cpu)
            .with_compute_dtype(Some(Dtype::F32));
        if split {
            let map = DeviceMap::auto(&p, &mm.device_budgets(), Default::default());
            p = p.with_device_map(map);
        }
        mm.load_models_gpu(std::slice::from_ref(&p), LoadOptions::default())
            .unwrap();
        let b = OpsBuilder::new(
            &p,
            OpsMode::ManualCast {
                compute: Dtype::F32,
            },
        );
        let layers = (0..LAYERS)
            .map(|l| b.linear(&format!("layers.{l}"), false).unwrap())
            .collect();
        Setup { mm, p, layers }
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        let mut x = x.clone();
        for l in &self.layers {
            x = l.try_forward(&x).unwrap().tanh().unwrap();
        }
        self.p.model().finish_forward();
        x
    }

    /// Mean time per forward over `n`, weight bytes streamed and activation bytes copied per
    /// forward.
    fn measure(&self, x: &Tensor, n: u32) -> (Duration, ByteSize, ByteSize) {
        self.forward(x);
        let streamed = self.mm.transfer_stats().bytes_transferred;
        let moved = self.p.split_stats().activation_bytes;
        let t0 = Instant::now();
        for _ in 0..n {
            self.forward(x);
        }
        let dt = t0.elapsed() / n;
        let per = |b: ByteSize| ByteSize(b.bytes() / u64::from(n));
        (
            dt,
            per(self
                .mm
                .transfer_stats()
                .bytes_transferred
                .saturating_sub(streamed)),
            per(self.p.split_stats().activation_bytes.saturating_sub(moved)),
        )
    }
}

fn bench(c: &mut Criterion) {
    let x = Tensor::randn(0f32, 1.0, (TOKENS, WIDTH), &Device::Cpu)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();
    let size = ByteSize((LAYERS * WIDTH * WIDTH * 4) as u64);
    // A device half the model plus the inference memory and prefetch room it keeps free.
    let device = ByteSize(size.bytes() / 2 + (1 << 20));
    for bandwidth in ["2GB/s", "25GB/s"] {
        let resident = Setup::new(
            &format!("1x{}MiB@{bandwidth}", (4 * size.bytes()) >> 20),
            false,
        );
        let one = format!("1x{}B@{bandwidth}", device.bytes());
        let two = format!("2x{}B@{bandwidth}", device.bytes());
        let streamed = Setup::new(&one, false);
        let split = Setup::new(&two, true);
        assert!(
            split.p.model().resident_bytes(DeviceId::Sim(1)) > ByteSize::ZERO
                && split.mm.transfer_stats().bytes_transferred == ByteSize::ZERO,
            "the split model is resident on both devices"
        );
        let (t_res, _, _) = resident.measure(&x, 20);
        let (t_str, w_str, _) = streamed.measure(&x, 20);
        let (t_split, _, a_split) = split.measure(&x, 20);
        println!(
            "devices @{bandwidth}: model {size}, device {device}: resident on one large device {:.2} ms/forward (limit) | streamed on one {:.2} ms ({w_str} weights/forward) | split on two {:.2} ms ({a_split} activations/forward) | split {:.1}x faster than streaming, {:.2}x the resident limit",
            t_res.as_secs_f64() * 1e3,
            t_str.as_secs_f64() * 1e3,
            t_split.as_secs_f64() * 1e3,
            t_str.as_secs_f64() / t_split.as_secs_f64(),
            t_split.as_secs_f64() / t_res.as_secs_f64(),
        );
        let mut g = c.benchmark_group(format!("devices@{bandwidth}"));
        g.sample_size(10)
            .measurement_time(Duration::from_secs(2))
            .warm_up_time(Duration::from_millis(300));
        g.bench_function("resident_one_large_device", |b| {
            b.iter(|| resident.forward(&x))
        });
        g.bench_function("streamed_on_one", |b| b.iter(|| streamed.forward(&x)));
        g.bench_function("split_on_two", |b| b.iter(|| split.forward(&x)));
        g.finish();
    }
}

criterion_group!(benches, bench);
/// `criterion_main!(benches)`, with candle's thread count cached first
/// ([`residency::tools::cache_candle_thread_count`]).
fn main() {
    residency::tools::cache_candle_thread_count();
    benches();
    criterion::Criterion::default()
        .configure_from_args()
        .final_summary();
}
