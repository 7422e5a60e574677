//! Streamed weights through transfer lanes and prefetch: bit-identical outputs for any lane count,
//! depth and budget (I3, docs/ARCHITECTURE.md §4.3), no staging buffer overwritten in flight, pool
//! behaviour.

mod common;

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use common::*;
use residency::float::Dtype;
use residency::loader::{LoadOptions, MemoryManager};
use residency::offload::{fetch_weight, PinnedPool, Streamer, TransferEngine};
use residency::patcher::{Lora, ModelPatcher, Patch};
use residency::vram::{Config, DeviceId, Hardware};
use residency::weights::{save_safetensors, Model, SafetensorsOptions};
use residency::ByteSize;

const LAYERS: usize = 8;
const WIDTH: usize = 64;

/// A deep MLP checkpoint: LAYERS square linear layers, bf16 storage.
fn mlp_file(dir: &std::path::Path, dtype: Dtype) -> std::path::PathBuf {
    let path = dir.join(format!("mlp-{dtype}.safetensors"));
    let mut tensors = Vec::new();
    for l in 0..LAYERS {
        let w = (rand_tensor(&[WIDTH, WIDTH], l as u64 + 100) * 0.3).unwrap();
        let w = residency::float::from_f32(&w, dtype, residency::Rounding::Nearest).unwrap();
        tensors.push((format!("layers.{l}.weight"), w, dtype));
    }
    save_safetensors(&path, &tensors, &SafetensorsOptions::default()).unwrap();
    path
}

fn with_lora(p: &mut ModelPatcher) {
    for l in (0..LAYERS).step_by(2) {
        let mut lora = Lora::new(
            rand_tensor(&[WIDTH, 4], l as u64),
            rand_tensor(&[4, WIDTH], l as u64 + 1),
        );
        lora.alpha = Some(2.0);
        p.add_patches(
            [(format!("layers.{l}.weight"), Patch::Lora(lora))],
            0.8,
            1.0,
        )
        .unwrap();
    }
}

/// Two forwards (the first records the order, the second prefetches); returns the second's bits.
fn forward_twice(p: &ModelPatcher) -> Vec<f32> {
    let mut out = Vec::new();
    for _ in 0..2 {
        let mut x = rand_tensor(&[4, WIDTH], 9);
        for l in 0..LAYERS {
            let (w, _) = fetch_weight(p, &format!("layers.{l}.weight")).unwrap();
            x = x.matmul(&w.t().unwrap()).unwrap().tanh().unwrap();
        }
        p.model().finish_forward();
        out = f32s(&x);
    }
    out
}

fn run(
    dtype: Dtype,
    budget: Option<ByteSize>,
    lanes: usize,
    depth: usize,
) -> (Vec<f32>, MemoryManager) {
    let dir = tempfile::tempdir().unwrap();
    let path = mlp_file(dir.path(), dtype);
    let model = Model::from_safetensors("mlp", &[path]).unwrap();
    let mut args: Vec<String> = vec!["--reserve-vram".into(), "0".into()];
    match budget {
        Some(b) => args.extend(["--vram-budget".to_string(), b.bytes().to_string()]),
        None => args.extend([
            "--vram-budget".to_string(),
            "1GiB".to_string(),
            "--novram".to_string(),
        ]),
    }
    let config = Config::from_args(&args)
        .unwrap()
        .with_transfer_lanes(lanes)
        .with_prefetch_depth(depth);
    let mm = MemoryManager::new(config, Hardware::cpu_only(ByteSize::gib(64))).unwrap();
    let mut p = ModelPatcher::new(Arc::new(model), DeviceId::Cpu, DeviceId::Cpu)
        .with_compute_dtype(Some(Dtype::F32));
    with_lora(&mut p);
    mm.load_models_gpu(std::slice::from_ref(&p), LoadOptions::default())
        .unwrap();
    (forward_twice(&p), mm)
}

#[test]
fn outputs_are_bit_identical_for_any_lanes_depth_and_budget() {
    let f32_layer = (WIDTH * WIDTH * 4) as u64;
    for dtype in [Dtype::BF16, Dtype::F8E4M3FN] {
        let (reference, _) = run(dtype, Some(ByteSize::mib(64)), 0, 0);
        let budgets = [
            Some(ByteSize::mib(64)),
            Some(ByteSize(f32_layer * 2 + 1)),
            None,
        ];
        for budget in budgets {
            for lanes in [0, 1, 2, 4] {
                for depth in [0, 1, 2, 4] {
                    let (got, mm) = run(dtype, budget, lanes, depth);
                    assert_eq!(
                        got, reference,
                        "{dtype} budget {budget:?} lanes {lanes} depth {depth}"
                    );
                    assert!(mm.peak_ledger(DeviceId::Cpu) <= budget.unwrap_or(ByteSize::gib(1)));
                }
            }
        }
    }
}

#[test]
fn second_forward_is_served_by_prefetch() {
    let (_, mm) = run(Dtype::BF16, None, 2, 2);
    let t = mm.transfer_stats();
    // First forward: every weight misses; second: all but the first hit.
    assert!(t.prefetch_hits >= (LAYERS - 1) as u64, "{t:?}");
    assert!(t.prefetch_misses <= LAYERS as u64 + 1, "{t:?}");
    // The destination is the CPU: there is no device copy, so nothing goes through staging.
    assert_eq!(t.bytes_staged, ByteSize::ZERO, "{t:?}");
    assert_eq!(mm.memory_report().pinned, ByteSize::ZERO);
    let report = mm.memory_report().to_string();
    assert!(report.contains("prefetch"), "{report}");
}

#[test]
fn a_changed_order_or_clone_is_a_miss_never_a_wrong_weight() {
    let dir = tempfile::tempdir().unwrap();
    let model =
        Arc::new(Model::from_safetensors("mlp", &[mlp_file(dir.path(), Dtype::BF16)]).unwrap());
    let engine = Arc::new(TransferEngine::new(
        2,
        Some(PinnedPool::aligned(ByteSize::mib(1))),
    ));
    let base = ModelPatcher::new(model.clone(), DeviceId::Cpu, DeviceId::Cpu)
        .with_compute_dtype(Some(Dtype::F32));
    let streamer = Arc::new(Streamer::new(engine.clone(), 3, ByteSize::gib(1)));
    residency::offload::attach_streamer(&base, Some(streamer));
    forward_twice(&base); // records the order, prefetches in it
                          // A clone with different patches asks for the same weights: prefetched copies built for the
                          // base must not be handed to it.
    let mut lora = base.clone();
    with_lora(&mut lora);
    for l in (0..LAYERS).rev() {
        let key = format!("layers.{l}.weight");
        let (got, streamed) = fetch_weight(&lora, &key).unwrap();
        assert!(streamed);
        let idx = model.index_of(&key).unwrap();
        let want = lora.materialize(idx, Dtype::F32, DeviceId::Cpu).unwrap();
        assert_eq!(f32s(&got), f32s(&want), "{key}");
        let (got, _) = fetch_weight(&base, &key).unwrap();
        let want = base.materialize(idx, Dtype::F32, DeviceId::Cpu).unwrap();
        assert_eq!(f32s(&got), f32s(&want), "{key}");
    }
}

#[test]
fn staging_buffers_are_exclusive_under_many_threads() {
    // A pool of four buffers shared by eight threads: each fills its buffer with its own
    // pattern, lets the others run, and checks nobody else wrote into it.
    let pool = PinnedPool::aligned(ByteSize::kib(256));
    let deadline = std::time::Instant::now() + std::time::Duration::from_millis(800);
    let threads: Vec<_> = (0..8u8)
        .map(|t| {
            let pool = pool.clone();
            std::thread::spawn(move || {
                let (mut checked, mut waited) = (0u32, 0u32);
                let mut round = 0u8;
                while std::time::Instant::now() < deadline {
                    let Some(mut buf) = pool.acquire(60 * 1024) else {
                        waited += 1;
                        std::thread::yield_now();
                        continue;
                    };
                    round = round.wrapping_add(1);
                    let stamp = t.wrapping_mul(31) ^ round;
                    buf.as_mut_bytes().unwrap().fill(stamp);
                    std::thread::yield_now();
                    let bytes = buf.as_mut_bytes().unwrap();
                    assert!(
                        bytes.iter().all(|&b| b == stamp),
                        "thread {t} round {round}"
                    );
                    checked += 1;
                }
                (checked, waited)
            })
        })
        .collect();
    let (checked, waited) = threads
        .into_iter()
        .map(|h| h.join().unwrap())
        .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
    assert!(checked > 100, "{checked}");
    let s = pool.stats();
    assert!(s.reused > 10, "{s:?}");
    assert_eq!(s.created, 4, "{s:?}");
    assert_eq!(s.fallbacks as u32, waited, "{s:?}");
    assert!(s.allocated <= ByteSize::kib(256), "{s:?}");
}

#[test]
fn lanes_hand_over_every_weight_intact_under_many_threads() {
    // Many threads, many patchers, three lanes and a tiny pool (which a CPU destination never
    // touches: there is no device copy to stage).
    let dir = tempfile::tempdir().unwrap();
    let model =
        Arc::new(Model::from_safetensors("mlp", &[mlp_file(dir.path(), Dtype::BF16)]).unwrap());
    let pool = PinnedPool::aligned(ByteSize::kib(128));
    let engine = Arc::new(TransferEngine::new(3, Some(pool.clone())));
    let base = ModelPatcher::new(model.clone(), DeviceId::Cpu, DeviceId::Cpu)
        .with_compute_dtype(Some(Dtype::F32));
    let expected: Vec<Vec<f32>> = (0..LAYERS)
        .map(|i| f32s(&base.materialize(i, Dtype::F32, DeviceId::Cpu).unwrap()))
        .collect();
    let expected = Arc::new(expected);
    let deadline = std::time::Instant::now() + std::time::Duration::from_millis(1500);
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let engine = engine.clone();
            let base = base.clone();
            let expected = expected.clone();
            std::thread::spawn(move || {
                let mut checked = 0;
                while std::time::Instant::now() < deadline {
                    let pending: Vec<_> = (0..LAYERS)
                        .map(|i| (i, engine.submit(&base, (i + t) % LAYERS)))
                        .collect();
                    for (i, p) in pending {
                        let got = f32s(&p.wait().unwrap());
                        assert_eq!(
                            got,
                            expected[(i + t) % LAYERS],
                            "weight {} corrupted",
                            (i + t) % LAYERS
                        );
                        checked += 1;
                    }
                }
                checked
            })
        })
        .collect();
    let checked: usize = threads.into_iter().map(|h| h.join().unwrap()).sum();
    assert!(checked > 100, "{checked}");
    let s = pool.stats();
    assert_eq!((s.created, s.allocated), (0, ByteSize::ZERO), "{s:?}");
    assert_eq!(
        engine.stats().snapshot().fetches as usize,
        checked,
        "one job per fetch"
    );
}

#[test]
fn engine_without_pool_or_lanes_gives_the_same_bits() {
    let dir = tempfile::tempdir().unwrap();
    let model =
        Arc::new(Model::from_safetensors("mlp", &[mlp_file(dir.path(), Dtype::F8E5M2)]).unwrap());
    let mut p =
        ModelPatcher::new(model, DeviceId::Cpu, DeviceId::Cpu).with_compute_dtype(Some(Dtype::F32));
    with_lora(&mut p);
    for (lanes, pool) in [
        (0, None),
        (2, None),
        (2, Some(PinnedPool::aligned(ByteSize::mib(1)))),
    ] {
        let e = TransferEngine::new(lanes, pool);
        for i in 0..LAYERS {
            let got = f32s(&e.submit(&p, i).wait().unwrap());
            let want = f32s(&p.materialize(i, Dtype::F32, DeviceId::Cpu).unwrap());
            assert_eq!(got, want);
        }
    }
}

#[test]
fn cleanup_releases_staging_memory_after_models_are_dropped() {
    let (_, mm) = run(Dtype::BF16, None, 2, 2);
    // CPU streaming stages nothing; take buffers as a GPU copy would.
    let pool = mm.transfer_engine().pool().unwrap();
    drop((pool.acquire(100_000), pool.acquire(300_000)));
    assert_eq!(mm.memory_report().pinned, ByteSize::kib(128 + 512));
    mm.cleanup_models();
    mm.unload_all_models();
    assert_eq!(mm.memory_report().pinned, ByteSize::ZERO);
    let cfg = Config::from_args(["--disable-pinned-memory", "--vram-budget", "1GiB"]).unwrap();
    let mm = MemoryManager::new(cfg, Hardware::cpu_only(ByteSize::gib(8))).unwrap();
    assert!(mm.transfer_engine().pool().is_none());
    let cfg =
        Config::from_args(["--pinned-memory-limit", "3MiB", "--vram-budget", "1GiB"]).unwrap();
    let mm = MemoryManager::new(cfg, Hardware::cpu_only(ByteSize::gib(8))).unwrap();
    assert_eq!(
        mm.transfer_engine().pool().unwrap().limit(),
        ByteSize::mib(3)
    );
    let _ = Tensor::zeros(1, DType::F32, &Device::Cpu);
}

#[test]
fn the_last_handle_to_an_engine_may_drop_on_its_own_lane() {
    // A lane job holds a patcher clone; the patcher's model holds the streamer, which holds the
    // engine. Dropping every other handle while jobs run makes a lane drop the engine, which
    // must not try to join the lane it runs on (that panics in `pthread_join`).
    let lane_panics = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let previous = Arc::new(std::panic::take_hook());
    {
        let (lane_panics, previous) = (lane_panics.clone(), previous.clone());
        std::panic::set_hook(Box::new(move |info| {
            let name = std::thread::current().name().unwrap_or("").to_string();
            if name.starts_with("residency-lane") {
                lane_panics.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
            previous(info);
        }));
    }
    for round in 0..20 {
        let tensors = (0..4).map(|l| {
            let w = rand_tensor(&[512, 512], round * 10 + l);
            let w =
                residency::float::from_f32(&w, Dtype::BF16, residency::Rounding::Nearest).unwrap();
            (format!("layers.{l}.weight"), w)
        });
        let model = Arc::new(Model::from_tensors("mlp", tensors).unwrap());
        let p = ModelPatcher::new(model, DeviceId::Cpu, DeviceId::Cpu)
            .with_compute_dtype(Some(Dtype::F32));
        let engine = Arc::new(TransferEngine::new(2, None));
        let streamer = Arc::new(Streamer::new(engine.clone(), 2, ByteSize::gib(1)));
        residency::offload::attach_streamer(&p, Some(streamer));
        let pending: Vec<_> = (0..4).map(|i| engine.submit(&p, i)).collect();
        drop((engine, p, pending));
    }
    std::thread::sleep(std::time::Duration::from_millis(300));
    let _ = std::panic::take_hook();
    assert_eq!(
        lane_panics.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "a lane panicked while dropping its own engine"
    );
}
