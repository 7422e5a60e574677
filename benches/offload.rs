//! Streamed vs resident forward on a model whose weights are 4× the budget (bf16 storage, f32
//! compute), with prefetch on and off, and the overlap efficiency: the share of transfer time
//! hidden behind compute.
//!
//! Limits measured in the same run: the fully resident forward (the floor a streamed forward can
//! reach) and the synchronous streamed forward (no lanes: the naive way).

use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use criterion::{criterion_group, criterion_main, Criterion};
use residency::float::Dtype;
use residency::loader::{LoadOptions, MemoryManager};
use residency::offload::fetch_weight;
use residency::patcher::ModelPatcher;
use residency::vram::{Config, DeviceId, Hardware};
use residency::{ByteSize, Model};

const LAYERS: usize = 16;
const WIDTH: usize = 1024;

fn model() -> Model {
    let tensors = (0..LAYERS).map(|l| {
        let w = Tensor::randn(0f32, 0.03, (WIDTH, WIDTH), &Device::Cpu).unwrap();
        let w = residency::float::from_f32(&w, Dtype::BF16, residency::Rounding::Nearest).unwrap();
        (format!("layers.{l}.weight"), w)
    });
    Model::from_tensors("deep-mlp", tensors).unwrap()
}

struct Setup {
    patcher: ModelPatcher,
    _mm: MemoryManager,
}

fn setup(budget: Option<ByteSize>, lanes: usize, depth: usize) -> Setup {
    let mut args = vec!["--reserve-vram".to_string(), "0".to_string()];
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
    let mm = MemoryManager::new(cfg, Hardware::cpu_only(ByteSize::gib(16))).unwrap();
    let p = ModelPatcher::new(Arc::new(model()), DeviceId::Cpu, DeviceId::Cpu)
        .with_compute_dtype(Some(Dtype::F32));
    mm.load_models_gpu(std::slice::from_ref(&p), LoadOptions::default())
        .unwrap();
    let s = Setup {
        patcher: p,
        _mm: mm,
    };
    forward(&s.patcher, 1); // records the order
    s
}

fn forward(p: &ModelPatcher, batch: usize) -> Tensor {
    let mut x = Tensor::ones((batch, WIDTH), candle_core::DType::F32, &Device::Cpu).unwrap();
    for l in 0..LAYERS {
        let (w, _) = fetch_weight(p, &format!("layers.{l}.weight")).unwrap();
        x = x.matmul(&w.t().unwrap()).unwrap().tanh().unwrap();
    }
    p.model().finish_forward();
    x
}

fn time(p: &ModelPatcher, batch: usize, iters: u32) -> Duration {
    let t0 = Instant::now();
    for _ in 0..iters {
        std::hint::black_box(forward(p, batch));
    }
    t0.elapsed() / iters
}

fn bench(c: &mut Criterion) {
    // f32 resident copies: 4 MiB per layer; a budget of a quarter of the model.
    let model_f32 = ByteSize((LAYERS * WIDTH * WIDTH * 4) as u64);
    let budget = ByteSize(model_f32.bytes() / 4);
    let resident = setup(None, 2, 2);
    let sync = setup(Some(budget), 0, 0);
    let no_prefetch = setup(Some(budget), 2, 0);
    let prefetch = setup(Some(budget), 2, 2);

    let mut g = c.benchmark_group("offload");
    g.sample_size(10).measurement_time(Duration::from_secs(3));
    g.bench_function("resident", |b| b.iter(|| forward(&resident.patcher, 256)));
    g.bench_function("streamed_sync", |b| b.iter(|| forward(&sync.patcher, 256)));
    g.bench_function("streamed_lanes_no_prefetch", |b| {
        b.iter(|| forward(&no_prefetch.patcher, 256))
    });
    g.bench_function("streamed_prefetch_2", |b| {
        b.iter(|| forward(&prefetch.patcher, 256))
    });
    g.finish();

    // Batch 256: compute dominates (the target case). Batch 8: the per-layer transfer
    // (a bf16 -> f32 cast of 4 MiB) is a visible share, so overlap can be measured.
    for batch in [256, 8] {
        let iters = if batch > 64 { 5 } else { 20 };
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let t_res = time(&resident.patcher, batch, iters);
        let t_sync = time(&sync.patcher, batch, iters);
        let t_nopf = time(&no_prefetch.patcher, batch, iters);
        let t_pf = time(&prefetch.patcher, batch, iters);
        let transfer = t_sync.saturating_sub(t_res);
        let exposed = t_pf.saturating_sub(t_res);
        let hidden = if transfer.is_zero() {
            1.0
        } else {
            (1.0 - exposed.as_secs_f64() / transfer.as_secs_f64()).max(0.0)
        };
        let r = |d: Duration| d.as_secs_f64() / t_res.as_secs_f64();
        println!();
        println!("offload summary ({LAYERS} layers of {WIDTH}x{WIDTH} bf16, batch {batch}, budget {budget} = 1/4 of {model_f32} f32):");
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
            "  transfer time {:.2} ms, hidden behind compute: {:.0}%",
            ms(transfer),
            hidden * 100.0
        );
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
