//! Ops layers against the work done the plain way, as ratios (STYLE 13):
//!
//! - a manual-cast `Linear` (bf16 storage, f32 compute, 4096×4096, batch 1 and 64), loaded by a
//!   memory manager with room to spare, so its cast is cached in the ledger after the first call
//!   (`ops::CastCache`), against a plain f32 `matmul` with the weight cast once beforehand;
//! - MiniLM's forward with everything resident against a quarter resident and NoVram (every
//!   weight fetched, cast — and for MiniLM's 47 MB embedding table, copied — per forward).
//!   Skipped with a message when `.cache/minilm` is absent (`bash scripts/fetch-minilm.sh`).
//!
//! criterion measures each case (sample size 10); a summary with medians and ratios is printed
//! at the end.

use std::hint::black_box;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Module, Tensor};
use criterion::{criterion_group, Criterion};
use residency::float::{self, Dtype, Rounding};
use residency::loader::{LoadOptions, MemoryManager};
use residency::models::bert::{self, Bert, BertConfig};
use residency::ops::{OpsBuilder, OpsMode};
use residency::patcher::ModelPatcher;
use residency::vram::{Config, DeviceId, Hardware};
use residency::weights::Model;
use residency::ByteSize;

fn median(mut f: impl FnMut(), runs: usize) -> Duration {
    f();
    let mut t: Vec<Duration> = (0..runs)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed()
        })
        .collect();
    t.sort();
    t[runs / 2]
}

fn rand(shape: &[usize]) -> Tensor {
    Tensor::rand(-0.5f32, 0.5, shape, &Device::Cpu).unwrap()
}

fn manager(budget: ByteSize, extra: &[&str]) -> MemoryManager {
    let mut args = vec!["--vram-budget".to_string(), budget.bytes().to_string()];
    args.extend(extra.iter().map(|s| s.to_string()));
    MemoryManager::new(
        Config::from_args(&args).unwrap(),
        Hardware::cpu_only(ByteSize::gib(64)),
    )
    .unwrap()
}

fn linear_bench(c: &mut Criterion, summary: &mut Vec<String>) {
    let n = 4096;
    let w32 = rand(&[n, n]);
    let wbf = float::from_f32(&w32, Dtype::BF16, Rounding::Nearest).unwrap();
    let model = Model::from_typed_tensors("linear", [("lin.weight", wbf, Dtype::BF16)]).unwrap();
    let p = ModelPatcher::new(Arc::new(model), DeviceId::Cpu, DeviceId::Cpu);
    let mm = manager(ByteSize::gib(4), &["--reserve-vram", "0"]);
    mm.load_models_gpu(std::slice::from_ref(&p), LoadOptions::default())
        .unwrap();
    let lin = OpsBuilder::new(
        &p,
        OpsMode::ManualCast {
            compute: Dtype::F32,
        },
    )
    .linear("lin", false)
    .unwrap();
    // The plain way: the same bf16 weight, cast to f32 once.
    let pre = float::to_f32(&p.model().clean("lin.weight").unwrap(), Dtype::BF16).unwrap();
    let pre_t = pre.t().unwrap();
    let mut g = c.benchmark_group("linear_4096_bf16_to_f32");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));
    for batch in [1usize, 64] {
        let x = rand(&[batch, n]);
        g.bench_function(format!("ops_manual_cast/b{batch}"), |b| {
            b.iter(|| black_box(lin.forward(&x).unwrap()))
        });
        g.bench_function(format!("plain_f32_precast/b{batch}"), |b| {
            b.iter(|| black_box(x.matmul(&pre_t).unwrap()))
        });
        let ours = median(|| drop(black_box(lin.forward(&x).unwrap())), 7);
        let plain = median(|| drop(black_box(x.matmul(&pre_t).unwrap())), 7);
        summary.push(format!(
            "linear 4096x4096 bf16->f32 batch {batch}: ops {:.2} ms, limit (plain f32 pre-cast) {:.2} ms, ratio {:.2}",
            ours.as_secs_f64() * 1e3,
            plain.as_secs_f64() * 1e3,
            ours.as_secs_f64() / plain.as_secs_f64()
        ));
    }
    g.finish();
}

fn minilm_bench(c: &mut Criterion, summary: &mut Vec<String>) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".cache/minilm");
    if !dir.join("model.safetensors").is_file() {
        println!(
            "minilm: skipped, {} absent (run `bash scripts/fetch-minilm.sh`)",
            dir.display()
        );
        summary.push("minilm: skipped (model absent)".into());
        return;
    }
    let config = BertConfig::from_file(dir.join("config.json")).unwrap();
    let model = bert::load_model(dir.join("model.safetensors"), "minilm", Dtype::F32).unwrap();
    let p = ModelPatcher::new(Arc::new(model), DeviceId::Cpu, DeviceId::Cpu);
    let size = p.resident_model_size();
    // Two sentences of 16 tokens.
    let ids = Tensor::arange(1000u32, 1032, &Device::Cpu)
        .unwrap()
        .reshape((2, 16))
        .unwrap();
    let mask = Tensor::ones((2, 16), DType::U32, &Device::Cpu).unwrap();
    let mut g = c.benchmark_group("minilm_forward_2x16");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));
    let mut times = Vec::new();
    for (name, budget, flags) in [
        ("full", ByteSize::gib(2), vec!["--reserve-vram", "0"]),
        (
            "quarter",
            ByteSize(size.bytes() / 4),
            vec!["--reserve-vram", "0"],
        ),
        (
            "novram",
            ByteSize::gib(2),
            vec!["--novram", "--reserve-vram", "0"],
        ),
    ] {
        p.detach();
        let mm = manager(budget, &flags);
        let r = mm
            .load_models_gpu(std::slice::from_ref(&p), LoadOptions::default())
            .unwrap();
        let resident = r.models[0].resident;
        let bert = Bert::new(&p, OpsMode::DisableWeightInit, &config).unwrap();
        g.bench_function(name, |b| {
            b.iter(|| black_box(bert.forward(&ids, &mask, None).unwrap()))
        });
        let t = median(
            || drop(black_box(bert.forward(&ids, &mask, None).unwrap())),
            7,
        );
        times.push((name, t, resident));
    }
    g.finish();
    let full = times[0].1.as_secs_f64();
    for (name, t, resident) in &times {
        summary.push(format!(
            "minilm forward 2x16 {name} ({resident} of {size} resident): {:.2} ms, limit (full residency) {:.2} ms, ratio {:.2}",
            t.as_secs_f64() * 1e3,
            full * 1e3,
            t.as_secs_f64() / full
        ));
    }
}

fn benches(c: &mut Criterion) {
    let mut summary = Vec::new();
    linear_bench(c, &mut summary);
    minilm_bench(c, &mut summary);
    println!("\nsummary (figure, limit, ratio):");
    for line in summary {
        println!("  {line}");
    }
}

criterion_group!(ops, benches);
/// `criterion_main!(ops)`, with candle's thread count cached first
/// ([`residency::tools::cache_candle_thread_count`]).
fn main() {
    residency::tools::cache_candle_thread_count();
    ops();
    criterion::Criterion::default()
        .configure_from_args()
        .final_summary();
}
