//! Residency by use (dynamic mode) against the classic load-time residency, on a simulated GPU at
//! 25 GB/s (PCIe 4.0 x16).
//!
//! 1. A dense model at half the budget: the first step (load + one forward, fresh managers) and
//!    the steady step of each mode, beside two limits measured in the same run — the model fully
//!    resident on a large device, and the time its streamed bytes take at the modelled bandwidth.
//!    Goals: dynamic / classic steady ≤ 1.02; dynamic first step ≤ classic's.
//! 2. An irregular trace: 64 equal weights ("experts") used 8 per step by a seeded schedule with
//!    Zipf skew, in a room of a quarter of them: the hit rate of the priority order beside
//!    Belady's offline optimum for the same uses and room (clairvoyant: it knows the future
//!    draws), and beside the best fixed set in hindsight — the room's worth of the most used
//!    experts, which is what the best online order can reach on independent draws. Goal: within
//!    2 points (of the best an online order can do; Belady's gap is printed too).

use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use criterion::{criterion_group, Criterion};
use residency::loader::{LoadOptions, MemoryManager};
use residency::ops::{OpsBuilder, OpsMode};
use residency::vram::{Config, DeviceId, Hardware};
use residency::{ByteSize, Dtype, Model, ModelPatcher};

const LAYERS: usize = 16;
const WIDTH: usize = 1024;
const BATCH: usize = 256;
const SIM: DeviceId = DeviceId::Sim(0);

fn dense_weights() -> Vec<(String, Tensor)> {
    (0..LAYERS)
        .map(|l| {
            let w = Tensor::randn(0f32, 0.05, (WIDTH, WIDTH), &Device::Cpu).unwrap();
            (format!("layers.{l}.weight"), w)
        })
        .collect()
}

fn manager(device: ByteSize, mode: &str) -> MemoryManager {
    let spec = format!("{}B@25GB/s", device.bytes());
    let config = Config::from_args([
        "--sim-gpu",
        spec.as_str(),
        "--reserve-vram",
        "0",
        "--inference-memory",
        "256KiB",
        mode,
    ])
    .unwrap();
    MemoryManager::new(config, Hardware::cpu_only(ByteSize::gib(16))).unwrap()
}

struct Dense {
    mm: MemoryManager,
    p: ModelPatcher,
    layers: Vec<residency::ops::Linear>,
}

impl Dense {
    /// A manager, a model of `weights` (its own residency; the clean tensors are shared), its
    /// layers; loaded (the load's time returned).
    fn new(weights: &[(String, Tensor)], device: ByteSize, mode: &str) -> (Dense, Duration) {
        let mm = manager(device, mode);
        let model = Model::from_tensors("dense", weights.iter().cloned()).unwrap();
        let p = ModelPatcher::new(std::sync::Arc::new(model), SIM, DeviceId::Cpu)
            .with_compute_dtype(Some(Dtype::F32));
        let t0 = Instant::now();
        mm.load_models_gpu(std::slice::from_ref(&p), LoadOptions::default())
            .unwrap();
        let load = t0.elapsed();
        let b = OpsBuilder::new(
            &p,
            OpsMode::ManualCast {
                compute: Dtype::F32,
            },
        );
        let layers = (0..LAYERS)
            .map(|l| b.linear(&format!("layers.{l}"), false).unwrap())
            .collect();
        (Dense { mm, p, layers }, load)
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        let mut x = x.clone();
        for l in &self.layers {
            x = l.try_forward(&x).unwrap().tanh().unwrap();
        }
        self.p.model().finish_forward();
        x
    }

    fn streamed(&self) -> ByteSize {
        self.mm.transfer_stats().bytes_transferred
    }

    /// Mean time of `n` forwards and the bytes each streamed.
    fn steady(&self, x: &Tensor, n: u32) -> (Duration, ByteSize) {
        let before = self.streamed();
        let t0 = Instant::now();
        for _ in 0..n {
            self.forward(x);
        }
        let dt = t0.elapsed() / n;
        (
            dt,
            ByteSize(self.streamed().saturating_sub(before).bytes() / u64::from(n)),
        )
    }
}

fn dense(c: &mut Criterion) {
    let weights = dense_weights();
    let size = ByteSize((LAYERS * WIDTH * WIDTH * 4) as u64);
    let x = Tensor::randn(0f32, 1.0, (BATCH, WIDTH), &Device::Cpu)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();
    let half = ByteSize(size.bytes() / 2);
    let (resident, _) = Dense::new(
        &weights,
        ByteSize(size.bytes() * 2),
        "--disable-dynamic-vram",
    );
    resident.forward(&x);
    let (t_res, _) = resident.steady(&x, 5);
    let mut rows = Vec::new();
    for mode in ["--disable-dynamic-vram", "--enable-dynamic-vram"] {
        // First step: a fresh manager, the load, one forward.
        let t0 = Instant::now();
        let (first, _) = Dense::new(&weights, half, mode);
        first.forward(&x);
        let t_first = t0.elapsed();
        drop(first);
        let (d, _) = Dense::new(&weights, half, mode);
        d.forward(&x);
        d.forward(&x);
        let (t_steady, moved) = d.steady(&x, 8);
        let copy = Duration::from_secs_f64(moved.as_f64() / 25e9);
        println!(
            "  {mode}: {} resident after the steady steps, ledger {}",
            d.p.model().resident_bytes(SIM),
            d.mm.ledger(SIM)
        );
        rows.push((mode, t_first, t_steady, moved, copy, d));
    }
    let (classic, dynamic) = (&rows[0], &rows[1]);
    println!(
        "dynamic dense @25GB/s: model {size}, budget {half} | resident limit {:.1} ms/step | classic first {:.1} ms, steady {:.1} ms ({} streamed/step, {:.2} ms at the link) | dynamic first {:.1} ms, steady {:.1} ms ({} streamed/step, {:.2} ms at the link) | dynamic/classic steady {:.3} (goal <= 1.02), first {:.3} (goal <= 1)",
        t_res.as_secs_f64() * 1e3,
        classic.1.as_secs_f64() * 1e3,
        classic.2.as_secs_f64() * 1e3,
        classic.3,
        classic.4.as_secs_f64() * 1e3,
        dynamic.1.as_secs_f64() * 1e3,
        dynamic.2.as_secs_f64() * 1e3,
        dynamic.3,
        dynamic.4.as_secs_f64() * 1e3,
        dynamic.2.as_secs_f64() / classic.2.as_secs_f64(),
        dynamic.1.as_secs_f64() / classic.1.as_secs_f64(),
    );
    let mut g = c.benchmark_group("dynamic_dense@25GB/s");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_millis(300));
    g.bench_function("resident", |b| b.iter(|| resident.forward(&x)));
    g.bench_function("classic_half", |b| b.iter(|| classic.5.forward(&x)));
    g.bench_function("dynamic_half", |b| b.iter(|| dynamic.5.forward(&x)));
    g.finish();
}

/// Seeded Zipf(1.1) choices of `k` distinct of `n` per step.
fn schedule(n: usize, k: usize, steps: usize, seed: u64) -> Vec<Vec<usize>> {
    let weights: Vec<f64> = (1..=n).map(|r| 1.0 / (r as f64).powf(1.1)).collect();
    let total: f64 = weights.iter().sum();
    let mut state = seed;
    let mut next = || {
        // splitmix64
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        (z ^ (z >> 31)) as f64 / u64::MAX as f64
    };
    // A fixed random permutation: popularity is not the index order.
    let mut perm: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = (next() * (i + 1) as f64) as usize % (i + 1);
        perm.swap(i, j);
    }
    (0..steps)
        .map(|_| {
            let mut chosen: Vec<usize> = Vec::with_capacity(k);
            while chosen.len() < k {
                let mut u = next() * total;
                let mut r = 0;
                while r + 1 < n && u > weights[r] {
                    u -= weights[r];
                    r += 1;
                }
                let e = perm[r];
                if !chosen.contains(&e) {
                    chosen.push(e);
                }
            }
            chosen.sort_unstable();
            chosen
        })
        .collect()
}

fn irregular(_c: &mut Criterion) {
    const EXPERTS: usize = 64;
    const PER_STEP: usize = 8;
    let expert = 64 * 1024; // bytes: 128 × 128 f32
    let tensors = (0..EXPERTS).map(|e| {
        (
            format!("experts.{e}.weight"),
            Tensor::randn(0f32, 0.05, (128, 128), &Device::Cpu).unwrap(),
        )
    });
    let model = std::sync::Arc::new(Model::from_tensors("experts", tensors).unwrap());
    // A quarter of the experts, plus the room kept free beside them (the weight in use: no
    // lanes here, so no prefetch window).
    let device = ByteSize((EXPERTS / 4 * expert + expert) as u64);
    let spec = format!("{}B@25GB/s", device.bytes());
    let mm = MemoryManager::new(
        Config::from_args([
            "--sim-gpu",
            spec.as_str(),
            "--reserve-vram",
            "0",
            "--disable-async-offload",
            "--enable-dynamic-vram",
        ])
        .unwrap(),
        Hardware::cpu_only(ByteSize::gib(8)),
    )
    .unwrap();
    let p = ModelPatcher::new(model, SIM, DeviceId::Cpu);
    mm.load_models_gpu(std::slice::from_ref(&p), LoadOptions::default())
        .unwrap();
    let steps = schedule(EXPERTS, PER_STEP, 400, 7);
    let keys: Vec<String> = (0..EXPERTS)
        .map(|e| format!("experts.{e}.weight"))
        .collect();
    let run = |steps: &[Vec<usize>]| {
        for step in steps {
            for &e in step {
                residency::offload::fetch_weight(&p, &keys[e]).unwrap();
            }
        }
    };
    // Warm up (the cache fills), then measure on fresh statistics.
    run(&steps[..50]);
    mm.reset_dynamic_stats();
    run(&steps[50..]);
    let r = &mm.dynamic_report()[0];
    let rate = r.hit_rate();
    let optimum = r.optimum_hit_rate().unwrap_or(0.0);
    // The best any online order can do on independent draws is to hold the most frequent
    // experts: the best fixed set in hindsight (the room's worth of the most used ones).
    let mut counts = vec![0u64; EXPERTS];
    for step in &steps[50..] {
        for &e in step {
            counts[e] += 1;
        }
    }
    let uses: u64 = counts.iter().sum();
    counts.sort_unstable_by(|a, b| b.cmp(a));
    let slots = (r.room.bytes() / expert as u64) as usize;
    let fixed = counts[..slots.min(EXPERTS)].iter().sum::<u64>() as f64 / uses as f64;
    println!(
        "dynamic irregular: {EXPERTS} experts of {}, {PER_STEP} per step (Zipf 1.1), room {} ({slots} experts) | hit rate {:.1} % | best fixed set in hindsight {:.1} % ({:.1} points from it) | Belady's offline optimum {:.1} % ({:.1} points from it) | {} evictions",
        ByteSize(expert as u64),
        r.room,
        100.0 * rate,
        100.0 * fixed,
        100.0 * (fixed - rate),
        100.0 * optimum,
        100.0 * (optimum - rate),
        r.evictions,
    );
}

criterion_group!(benches, dense, irregular);
/// `criterion_main!(benches)`, with candle's thread count cached first
/// ([`residency::tools::cache_candle_thread_count`]).
fn main() {
    residency::tools::cache_candle_thread_count();
    benches();
    criterion::Criterion::default()
        .configure_from_args()
        .final_summary();
}
