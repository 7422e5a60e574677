//! Streamed vs resident forward on a model whose weights are 4× the budget (bf16 storage, f32
//! compute), with prefetch on and off, and the overlap efficiency: the share of transfer time
//! hidden behind compute.
//!
//! Limits measured in the same run: the fully resident forward (the floor a streamed forward can
//! reach) and the synchronous streamed forward (no lanes: the naive way).
//!
//! Then the same on a simulated GPU with PCIe 4.0 x16's bandwidth (`--sim-gpu 8GiB@25GB/s`) and
//! this CPU's real compute, with 0, 1 and 2 lanes (prefetch 2): streamed / resident, and the
//! share of the modelled copy time compute did not wait for (the sim counts both).

use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use criterion::{criterion_group, Criterion};
use residency::float::Dtype;
use residency::loader::{LoadOptions, MemoryManager};
use residency::offload::fetch_weight;
use residency::patcher::ModelPatcher;
use residency::vram::{Config, DeviceId, Hardware};
use residency::{ByteSize, Model};

const LAYERS: usize = 16;

/// Where the bench runs: GPU 0 when this build has candle's CUDA backend and a GPU is present
/// (then wider layers and larger batches, so compute per weight is comparable), else the CPU.
struct Target {
    device: DeviceId,
    hardware: Hardware,
    width: usize,
    /// Compute-bound batch, then a batch where the transfer is a visible share.
    batches: [usize; 2],
}

fn target() -> Target {
    let hardware = Hardware::probe();
    if cfg!(feature = "cuda") && !hardware.gpus.is_empty() {
        return Target {
            device: DeviceId::Cuda(0),
            hardware,
            width: 4096,
            batches: [4096, 256],
        };
    }
    Target {
        device: DeviceId::Cpu,
        hardware: Hardware::cpu_only(ByteSize::gib(16)),
        width: 1024,
        batches: [256, 8],
    }
}

fn model(width: usize) -> Model {
    let tensors = (0..LAYERS).map(|l| {
        let w = Tensor::randn(0f32, 0.03, (width, width), &Device::Cpu).unwrap();
        let w = residency::float::from_f32(&w, Dtype::BF16, residency::Rounding::Nearest).unwrap();
        (format!("layers.{l}.weight"), w)
    });
    Model::from_tensors("deep-mlp", tensors).unwrap()
}

struct Setup {
    patcher: ModelPatcher,
    width: usize,
    mm: MemoryManager,
}

/// A manager and a model of its own (residency is per model, so setups never share one).
fn setup(t: &Target, budget: Option<ByteSize>, lanes: usize, depth: usize) -> Setup {
    setup_with(t, budget, lanes, depth, &[])
}

fn setup_with(
    t: &Target,
    budget: Option<ByteSize>,
    lanes: usize,
    depth: usize,
    extra: &[&str],
) -> Setup {
    let mut args = vec!["--reserve-vram".to_string(), "0".to_string()];
    args.extend(extra.iter().map(|s| s.to_string()));
    match budget {
        Some(b) => args.extend(["--vram-budget".to_string(), b.bytes().to_string()]),
        None => args.extend([
            "--vram-budget".to_string(),
            "8GiB".to_string(),
            "--highvram".to_string(),
        ]),
    }
    let cfg = Config::from_args(&args)
        .unwrap()
        .with_transfer_lanes(lanes)
        .with_prefetch_depth(depth);
    let mm = MemoryManager::new(cfg, t.hardware.clone()).unwrap();
    let p = ModelPatcher::new(Arc::new(model(t.width)), t.device, DeviceId::Cpu)
        .with_compute_dtype(Some(Dtype::F32));
    mm.load_models_gpu(std::slice::from_ref(&p), LoadOptions::default())
        .unwrap();
    let s = Setup {
        patcher: p,
        width: t.width,
        mm,
    };
    forward(&s, 1); // records the order
    s
}

fn forward(s: &Setup, batch: usize) -> Tensor {
    let p = &s.patcher;
    let dev = p.load_device().to_candle().unwrap();
    let mut x = Tensor::ones((batch, s.width), candle_core::DType::F32, &dev).unwrap();
    for l in 0..LAYERS {
        let (w, _) = fetch_weight(p, &format!("layers.{l}.weight")).unwrap();
        x = x.matmul(&w.t().unwrap()).unwrap().tanh().unwrap();
    }
    p.model().finish_forward();
    // GPU work is asynchronous: the forward ends when its last kernel has.
    dev.synchronize().unwrap();
    x
}

fn time(s: &Setup, batch: usize, iters: u32) -> Duration {
    let t0 = Instant::now();
    for _ in 0..iters {
        std::hint::black_box(forward(s, batch));
    }
    t0.elapsed() / iters
}

fn bench(c: &mut Criterion) {
    let t = target();
    let width = t.width;
    let [big, small] = t.batches;
    let device = t.device;
    println!(
        "offload bench on {device} ({} layers of {width}x{width})",
        LAYERS
    );
    // f32 resident copies; a budget of a quarter of the model.
    let model_f32 = ByteSize((LAYERS * width * width * 4) as u64);
    let budget = ByteSize(model_f32.bytes() / 4);
    let resident = setup(&t, None, 2, 2);
    let sync = setup(&t, Some(budget), 0, 0);
    let no_prefetch = setup(&t, Some(budget), 2, 0);
    let prefetch = setup(&t, Some(budget), 2, 2);

    let mut g = c.benchmark_group("offload");
    g.sample_size(10).measurement_time(Duration::from_secs(3));
    g.bench_function("resident", |b| b.iter(|| forward(&resident, big)));
    g.bench_function("streamed_sync", |b| b.iter(|| forward(&sync, big)));
    g.bench_function("streamed_lanes_no_prefetch", |b| {
        b.iter(|| forward(&no_prefetch, big))
    });
    g.bench_function("streamed_prefetch_2", |b| {
        b.iter(|| forward(&prefetch, big))
    });
    g.finish();

    // The big batch: compute dominates (the target case). The small one: the per-layer
    // transfer (a bf16 -> f32 cast, plus the copy on a GPU) is a visible share, so overlap can
    // be measured. The four setups are timed in interleaved rounds and the median taken, so
    // drift of a shared machine hits them alike.
    for batch in [big, small] {
        let rounds = if batch == big { 9 } else { 31 };
        let setups = [&resident, &sync, &no_prefetch, &prefetch];
        let mut samples = vec![Vec::with_capacity(rounds); setups.len()];
        for _ in 0..rounds {
            for (s, out) in setups.iter().zip(samples.iter_mut()) {
                out.push(time(s, batch, 1));
            }
        }
        let median = |v: &mut Vec<Duration>| {
            v.sort();
            v[v.len() / 2]
        };
        let [t_res, t_sync, t_nopf, t_pf] = [0, 1, 2, 3].map(|i| median(&mut samples[i]));
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let transfer = t_sync.saturating_sub(t_res);
        let exposed = t_pf.saturating_sub(t_res);
        let hidden = if transfer.is_zero() {
            1.0
        } else {
            (1.0 - exposed.as_secs_f64() / transfer.as_secs_f64()).max(0.0)
        };
        let r = |d: Duration| d.as_secs_f64() / t_res.as_secs_f64();
        println!();
        println!("offload summary on {device} ({LAYERS} layers of {width}x{width} bf16, batch {batch}, budget {budget} = 1/4 of {model_f32} f32, median of {rounds} interleaved rounds):");
        println!("  resident forward (limit)          {:>8.2} ms", ms(t_res));
        println!(
            "  streamed, synchronous (naive)     {:>8.2} ms  ratio {:.2}",
            ms(t_sync),
            r(t_sync)
        );
        println!(
            "  streamed, 2 lanes, no prefetch    {:>8.2} ms  ratio {:.2}",
            ms(t_nopf),
            r(t_nopf)
        );
        println!(
            "  streamed, 2 lanes, prefetch 2     {:>8.2} ms  ratio {:.2}",
            ms(t_pf),
            r(t_pf)
        );
        println!(
            "  transfer time {:.2} ms (synchronous minus resident), hidden behind compute by prefetch: {:.0}%",
            ms(transfer),
            hidden * 100.0
        );
    }
}

/// The offload bench on a simulated GPU at 25 GB/s: the CPU computes, the sim's streams model the
/// bus, so the ratio shows how much of the transfer lanes and prefetch hide.
fn bench_sim(_: &mut Criterion) {
    let t = Target {
        device: DeviceId::Sim(0),
        hardware: Hardware::cpu_only(ByteSize::gib(16)),
        width: 1024,
        batches: [256, 8],
    };
    // The classic partial load (what these figures have measured; `benches/dynamic.rs` compares
    // residency by use with it).
    let sim = ["--sim-gpu", "8GiB@25GB/s", "--disable-dynamic-vram"];
    let model_f32 = ByteSize((LAYERS * t.width * t.width * 4) as u64);
    let budget = ByteSize(model_f32.bytes() / 4);
    let resident = setup_with(&t, None, 2, 2, &sim);
    let streamed: Vec<Setup> = [0, 1, 2]
        .iter()
        .map(|&lanes| setup_with(&t, Some(budget), lanes, 2, &sim))
        .collect();
    for batch in t.batches {
        let rounds = if batch == 256 { 7 } else { 21 };
        let mut samples: Vec<Vec<Duration>> = (0..4).map(|_| Vec::with_capacity(rounds)).collect();
        let before: Vec<_> = streamed.iter().map(sim_stats).collect();
        for _ in 0..rounds {
            samples[0].push(time(&resident, batch, 1));
            for (s, out) in streamed.iter().zip(samples[1..].iter_mut()) {
                out.push(time(s, batch, 1));
            }
        }
        let median = |v: &mut Vec<Duration>| {
            v.sort();
            v[v.len() / 2]
        };
        let medians: Vec<Duration> = samples.iter_mut().map(median).collect();
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        println!();
        println!("offload summary on a simulated GPU at 25 GB/s ({LAYERS} layers of 1024x1024 bf16, batch {batch}, budget {budget} = 1/4 of {model_f32} f32, median of {rounds} interleaved rounds):");
        println!(
            "  resident forward (limit)          {:>8.2} ms",
            ms(medians[0])
        );
        for (i, s) in streamed.iter().enumerate() {
            let after = sim_stats(s);
            let copy_ms = (after.copy_ns - before[i].copy_ns) as f64 / 1e6 / rounds as f64;
            let wait_ms = (after.compute_waited_ns - before[i].compute_waited_ns) as f64
                / 1e6
                / rounds as f64;
            let hidden = if copy_ms > 0.0 {
                (1.0 - wait_ms / copy_ms).max(0.0)
            } else {
                1.0
            };
            println!(
                "  streamed, {i} lane(s), prefetch 2   {:>8.2} ms  ratio {:.2}  copies {:.2} ms/forward, compute waited {:.2} ms: {:.0}% hidden",
                ms(medians[i + 1]),
                medians[i + 1].as_secs_f64() / medians[0].as_secs_f64(),
                copy_ms,
                wait_ms,
                hidden * 100.0
            );
        }
    }
}

fn sim_stats(s: &Setup) -> residency::device::SimStats {
    s.mm.transfer_engine().devices().sims()[0].stats()
}

criterion_group!(benches, bench, bench_sim);
/// `criterion_main!(benches)`, with candle's thread count cached first
/// ([`residency::tools::cache_candle_thread_count`]).
fn main() {
    residency::tools::cache_candle_thread_count();
    benches();
    criterion::Criterion::default()
        .configure_from_args()
        .final_summary();
}
