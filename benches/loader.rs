//! `MemoryManager::load_models_gpu` bookkeeping cost, per call and per weight.
//!
//! Models are built from broadcast zero-memory tensors (as `tests/common::virtual_model`), so
//! resident copies share storage and no bytes are copied: what is measured is the scheduler's
//! own work (registry, ledger, eviction order, fingerprints, plans). Two cases:
//!
//! - **already loaded**: one 500-weight model loaded again (moves 0 bytes). The limit is the
//!   naive floor of touching each weight once: cloning the 500 weight handles.
//! - **cycle with eviction**: 100 models × 500 weights loaded round-robin on a budget that holds
//!   about 10, so every call evicts (part of) the least useful model and loads a new one.
//!
//! `cargo bench --bench loader` (sample size 10, 3 s per measurement).

use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use criterion::{Criterion, Throughput};

mod common;
use residency::loader::{LoadOptions, MemoryManager};
use residency::patcher::ModelPatcher;
use residency::vram::{Config, DeviceId, Hardware};
use residency::weights::Model;
use residency::ByteSize;

const WEIGHTS: usize = 500;
const MODELS: usize = 100;
const FIT: u64 = 10;
const WEIGHT_BYTES: u64 = 1 << 20;

fn median_ns(name: &str) -> f64 {
    common::median_secs(name) * 1e9
}

/// A model whose weights are broadcast views of one scalar: any size, no memory.
fn virtual_model(name: &str, weight_sizes: &[u64]) -> Model {
    let tensors = weight_sizes.iter().enumerate().map(|(i, &bytes)| {
        let n = (bytes / 4) as usize;
        let t = Tensor::zeros(1, DType::F32, &Device::Cpu)
            .and_then(|t| t.broadcast_as(n))
            .expect("broadcast tensor");
        (format!("w{i}"), t)
    });
    Model::from_tensors(name, tensors).expect("virtual model")
}

fn patcher(name: &str) -> ModelPatcher {
    let model = virtual_model(name, &[WEIGHT_BYTES; WEIGHTS]);
    ModelPatcher::new(Arc::new(model), DeviceId::Cpu, DeviceId::Cpu)
}

/// A manager on a budgeted CPU device, no reserve.
fn manager(budget: ByteSize) -> MemoryManager {
    let args = [
        "--vram-budget".to_string(),
        budget.bytes().to_string(),
        "--reserve-vram".to_string(),
        "0".to_string(),
    ];
    let config = Config::from_args(&args).expect("config");
    MemoryManager::new(config, Hardware::cpu_only(ByteSize::gib(64))).expect("manager")
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("load_models_gpu");
    g.throughput(Throughput::Elements(WEIGHTS as u64));

    // Already loaded.
    let mm = manager(ByteSize::gib(32));
    let p = patcher("loaded");
    mm.load_model_gpu(&p).expect("first load");
    let again = mm.load_model_gpu(&p).expect("second load");
    assert_eq!(
        again.models[0].built,
        ByteSize::ZERO,
        "a reload moved bytes"
    );
    assert!(again.models[0].full);
    g.bench_function("already_loaded_500w", |b| {
        common::timed(b, "already_loaded", || {
            mm.load_models_gpu(std::slice::from_ref(&p), LoadOptions::default())
                .expect("reload")
        })
    });
    let handles: Vec<Tensor> = p
        .model()
        .slots()
        .iter()
        .map(|s| s.clean().unwrap())
        .collect();
    g.bench_function("clone_500_weight_handles", |b| {
        common::timed(b, "clone_handles", || handles.to_vec())
    });

    // Cycle with eviction: room for FIT models beside the step-4 headroom of one more load
    // (1.1 × model + minimum inference memory, about 1.19 GiB).
    let model_bytes = WEIGHT_BYTES * WEIGHTS as u64;
    let budget = ByteSize(FIT * model_bytes + model_bytes * 11 / 10 + 1_300_000_000);
    let mm = manager(budget);
    let models: Vec<ModelPatcher> = (0..MODELS).map(|i| patcher(&format!("m{i}"))).collect();
    let (mut evicting, mut resident) = (0usize, 0usize);
    for (i, m) in models.iter().cycle().take(2 * MODELS).enumerate() {
        let r = mm.load_model_gpu(m).expect("cycle load");
        if i >= MODELS {
            evicting += usize::from(!r.evicted.is_empty());
            resident += mm.loaded_models().len();
        }
    }
    println!(
        "cycle: {evicting}/{MODELS} calls evicted; {:.1} models registered on average (budget {budget})",
        resident as f64 / MODELS as f64
    );
    let mut next = 0usize;
    g.bench_function("cycle_100x500w_evicting", |b| {
        common::timed(b, "cycle", || {
            let m = &models[next % MODELS];
            next += 1;
            mm.load_models_gpu(std::slice::from_ref(m), LoadOptions::default())
                .expect("cycle load")
        })
    });
    g.finish();
}

fn summary() {
    let w = WEIGHTS as f64;
    let floor = median_ns("clone_handles");
    println!();
    println!(
        "load_models_gpu bookkeeping ({WEIGHTS} weights per model; median of per-sample means)"
    );
    println!(
        "{:<40} {:>12} {:>10}  {:<26} {:>10} {:>8}",
        "case", "ns/call", "ns/weight", "limit", "ns/call", "ratio"
    );
    for (case, name) in [
        ("already loaded (0 bytes moved)", "already_loaded"),
        ("cycle 100 models, ~10 fit, evicting", "cycle"),
    ] {
        let ns = median_ns(name);
        println!(
            "{:<40} {:>12.0} {:>10.1}  {:<26} {:>10.0} {:>8.1}",
            case,
            ns,
            ns / w,
            "clone 500 weight handles",
            floor,
            ns / floor
        );
    }
}

/// Scheduling cost per weight as models grow (mixture-of-experts checkpoints store tens of
/// thousands of tensors): 10 models of `n` weights (64 GiB each, virtual), a budget for 5 beside
/// one more load's headroom, cycling through all ten so every call evicts; and a pure `plan()`.
/// Returns (µs per weight of an evicting load, µs per weight of a plan).
fn scaling(n: usize) -> (f64, f64) {
    let weight = (64u64 << 30) / n as u64 / 4 * 4;
    let model_bytes = weight * n as u64;
    let mm = manager(ByteSize(
        5 * model_bytes + model_bytes * 11 / 10 + 1_300_000_000,
    ));
    let models: Vec<ModelPatcher> = (0..10)
        .map(|i| {
            let m = virtual_model(&format!("s{i}"), &vec![weight; n]);
            ModelPatcher::new(Arc::new(m), DeviceId::Cpu, DeviceId::Cpu)
        })
        .collect();
    for m in &models {
        mm.load_model_gpu(m).expect("warm-up load");
    }
    let rounds = 3;
    let t = std::time::Instant::now();
    let mut evicting = 0;
    for _ in 0..rounds {
        for m in &models {
            let r = mm
                .load_models_gpu(std::slice::from_ref(m), LoadOptions::default())
                .expect("cycle load");
            evicting += usize::from(!r.evicted.is_empty());
        }
    }
    assert_eq!(evicting, rounds * models.len(), "every call evicts");
    let load = t.elapsed().as_secs_f64() / (rounds * models.len()) as f64 / n as f64 * 1e6;
    let t = std::time::Instant::now();
    for m in &models {
        mm.plan(std::slice::from_ref(m), LoadOptions::default())
            .expect("plan");
    }
    let plan = t.elapsed().as_secs_f64() / models.len() as f64 / n as f64 * 1e6;
    (load, plan)
}

fn main() {
    residency::tools::cache_candle_thread_count();
    println!("scheduling cost per weight (10 models of N weights, every load evicting):");
    println!(
        "{:>8} {:>22} {:>16} {:>22}",
        "N", "evicting load µs/wt", "plan µs/wt", "vs N = 1000 (load, plan)"
    );
    let base = scaling(1000);
    for n in [1000, 10_000, 100_000] {
        let (load, plan) = if n == 1000 { base } else { scaling(n) };
        println!(
            "{n:>8} {load:>22.3} {plan:>16.3} {:>14.2} {:>7.2}",
            load / base.0,
            plan / base.1
        );
    }
    let mut c = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    bench(&mut c);
    c.final_summary();
    summary();
}
