//! Eight threads sharing one manager, as a downstream engine shares it: loads of two models,
//! clone + patch + load + forward, `free_memory`, `cleanup_models` and report readers, under
//! four flag sets. The ranked-lock checker is on in every test build (src/lock/), so a lock
//! taken out of order or read twice fails at its first occurrence, whatever the timing; the
//! iterations then look for what the checker cannot see (a wait that never ends, a wrong
//! weight, a ledger over its budget).
//!
//! `RESIDENCY_STRESS_ITERS` sets the iterations per thread (default 2500, 20 000 per flag set: the landed crate
//! deadlocked within about 10 000 × 8 before the lock checker).

mod common;

use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use residency::float::Dtype;
use residency::loader::{LoadOptions, MemoryManager};
use residency::patcher::{ModelPatcher, Patch};
use residency::vram::{Config, DeviceId, Hardware};
use residency::ByteSize;

fn iterations() -> u64 {
    std::env::var("RESIDENCY_STRESS_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2500)
}

fn manager_with(flags: &[&str]) -> MemoryManager {
    MemoryManager::new(
        Config::from_args(flags).unwrap(),
        Hardware::cpu_only(ByteSize::gib(64)),
    )
    .unwrap()
}

/// Fetches every weight of `p` and checks each against the weight built directly.
fn forward_checked(p: &ModelPatcher) {
    for key in p.model().keys() {
        let (w, _) = residency::offload::fetch_weight(p, key).unwrap();
        let i = p.model().index_of(key).unwrap();
        let expect = p
            .materialize(i, p.resident_dtype(i), DeviceId::Cpu)
            .unwrap();
        assert_eq!(f32s(&w), f32s(&expect), "`{key}` of {}", p.model().name());
    }
}

fn hammer(flags: &[&str], budget: ByteSize, iters: u64) -> (u64, Duration) {
    let dir = tempfile::tempdir().unwrap();
    let mm = Arc::new(manager_with(flags));
    let device = mm.compute_device();
    let models: Vec<ModelPatcher> = ["a", "b"]
        .iter()
        .map(|n| {
            ModelPatcher::new(
                Arc::new(small_model_file(dir.path(), n, Dtype::BF16)),
                device,
                DeviceId::Cpu,
            )
            .with_compute_dtype(Some(Dtype::F32))
        })
        .collect();
    let sums: Vec<u64> = models
        .iter()
        .map(|m| m.model().clean_checksum().unwrap())
        .collect();
    let t0 = Instant::now();
    let (done_tx, done_rx) = mpsc::channel::<u64>();
    for t in 0..8usize {
        let mm = Arc::clone(&mm);
        let models = models.clone();
        let done = done_tx.clone();
        std::thread::spawn(move || {
            let base = &models[t % 2];
            let keys: Vec<String> = base.model().keys().map(str::to_string).collect();
            for n in 0..iters {
                match t {
                    // Loads of the two models, and a forward through them.
                    0 | 1 => {
                        mm.load_models_gpu(std::slice::from_ref(base), LoadOptions::default())
                            .unwrap();
                        forward_checked(base);
                    }
                    // A node's clone with a patch, loaded and run.
                    2 | 3 => {
                        let mut c = base.clone();
                        let key = &keys[(n as usize + t) % keys.len()];
                        let shape = c.model().slot(key).unwrap().shape().to_vec();
                        c.add_patches(
                            [(
                                key.as_str(),
                                Patch::Diff {
                                    diff: rand_tensor(&shape, n),
                                    pad: false,
                                },
                            )],
                            0.5,
                            1.0,
                        )
                        .unwrap();
                        mm.load_models_gpu(std::slice::from_ref(&c), LoadOptions::default())
                            .unwrap();
                        forward_checked(&c);
                    }
                    4 => {
                        mm.free_memory(ByteSize((n % 5) * 1024), device, &[]);
                    }
                    5 => mm.cleanup_models(),
                    // Report readers: never wait for a load, never see a ledger over budget.
                    _ => {
                        let report = mm.memory_report();
                        let _ = mm.loaded_models();
                        assert!(mm.ledger(device) <= budget, "{report}");
                        let _ = mm.get_free_memory(device);
                    }
                }
            }
            let _ = done.send(iters);
        });
    }
    drop(done_tx);
    let mut total = 0;
    for _ in 0..8 {
        match done_rx.recv_timeout(Duration::from_secs(300)) {
            Ok(n) => total += n,
            Err(e) => panic!(
                "{flags:?}: a thread did not finish in 300 s ({e}): a deadlock, or a panic above"
            ),
        }
    }
    let took = t0.elapsed();
    for (m, sum) in models.iter().zip(&sums) {
        assert_eq!(m.model().clean_checksum().unwrap(), *sum, "I1");
    }
    assert!(
        mm.peak_ledger(device) <= budget,
        "{flags:?}: peak over the budget"
    );
    for sim in mm.transfer_engine().devices().sims() {
        assert!(sim.check().is_ok(), "{flags:?}: {:?}", sim.check());
    }
    (total, took)
}

#[test]
fn eight_threads_sharing_a_manager_never_deadlock_under_every_flag_set() {
    let budget = ByteSize::kib(4);
    let cpu = ["--vram-budget", "4KiB", "--reserve-vram", "0"];
    // Residency by use is the simulated GPU's default; the classic mode there too.
    let sets: Vec<(Vec<&str>, u64)> = vec![
        (cpu.to_vec(), iterations()),
        ([&cpu[..], &["--async-offload", "2"]].concat(), iterations()),
        (
            [
                &cpu[..],
                &["--disable-smart-memory", "--async-offload", "1"],
            ]
            .concat(),
            iterations(),
        ),
        (
            vec!["--sim-gpu", "4KiB@25GB/s", "--reserve-vram", "0"],
            iterations(),
        ),
        (
            vec![
                "--sim-gpu",
                "4KiB@25GB/s",
                "--reserve-vram",
                "0",
                "--disable-dynamic-vram",
            ],
            iterations(),
        ),
    ];
    for (flags, iters) in sets {
        let (n, took) = hammer(&flags, budget, iters);
        eprintln!(
            "{flags:?}: {n} iterations over 8 threads ({} each) in {:.2} s",
            n / 8,
            took.as_secs_f64()
        );
        assert_eq!(n, 8 * iters);
    }
}

/// A model of `n` weights of 32 × 32 … (bf16 on the host, f32 resident): enough weights that a
/// partial load, a pin and a partial unload each have something to choose among.
fn wider_model_file(dir: &std::path::Path, name: &str, n: usize) -> residency::weights::Model {
    let path = dir.join(format!("{name}.safetensors"));
    let tensors: Vec<(String, candle_core::Tensor, Dtype)> = (0..n)
        .map(|i| {
            let shape = [32 + 8 * (i % 4), 32];
            let t = rand_tensor(&shape, i as u64 + 101);
            let t =
                residency::float::from_f32(&t, Dtype::BF16, residency::Rounding::Nearest).unwrap();
            (format!("blocks.{i}.w.weight"), t, Dtype::BF16)
        })
        .collect();
    residency::weights::save_safetensors(
        &path,
        &tensors,
        &residency::weights::SafetensorsOptions::default(),
    )
    .unwrap();
    residency::weights::Model::from_safetensors(name, &[path]).unwrap()
}

/// Eight threads on a simulated GPU with the operations the first stress test leaves out: loads
/// of both models at once, pins, partial unloads beside forwards, a KV reservation growing and
/// shrinking, `free_memory` and cleanups. After every operation the manager's ledger stays
/// within the budget, and so does what the simulated device really holds (its allocations plus
/// the reservations, which are ledger columns a real engine allocates for itself).
fn hammer_pins_and_partial_unloads(flags: &[&str], budget: ByteSize, iters: u64) {
    let dir = tempfile::tempdir().unwrap();
    let mm = Arc::new(manager_with(flags));
    let device = mm.compute_device();
    assert!(!device.is_cpu(), "{flags:?}: a simulated GPU");
    let models: Vec<ModelPatcher> = ["a", "b"]
        .iter()
        .map(|n| {
            ModelPatcher::new(
                Arc::new(wider_model_file(dir.path(), n, 12)),
                device,
                DeviceId::Cpu,
            )
            .with_compute_dtype(Some(Dtype::F32))
        })
        .collect();
    let sim = Arc::clone(&mm.transfer_engine().devices().sims()[0]);
    let (done_tx, done_rx) = mpsc::channel::<std::result::Result<u64, String>>();
    for t in 0..8usize {
        let mm = Arc::clone(&mm);
        let models = models.clone();
        let done = done_tx.clone();
        let sim = Arc::clone(&sim);
        std::thread::spawn(move || {
            let base = &models[t % 2];
            let keys: Vec<String> = base.model().keys().map(str::to_string).collect();
            let run = || -> std::result::Result<u64, String> {
                let mut kv: Option<residency::loader::MemoryReservation> = None;
                for n in 0..iters {
                    match t {
                        // A load may find the device full of pins and the KV cache: an
                        // out-of-memory then is the engine's to retry, anything else a failure.
                        0 => {
                            match mm
                                .load_models_gpu(std::slice::from_ref(base), LoadOptions::default())
                            {
                                Err(e) if !e.is_retryable() => return Err(e.to_string()),
                                _ => forward_checked(base),
                            }
                        }
                        // Both models in one load.
                        1 => match mm.load_models_gpu(&models, LoadOptions::default()) {
                            Err(e) if !e.is_retryable() => return Err(e.to_string()),
                            _ => forward_checked(&models[n as usize % 2]),
                        },
                        // Pins, and a node's clone with a patch loaded and run beside them.
                        2 => {
                            let key = &keys[n as usize % keys.len()];
                            let _ = base.pin_weight_to_device(key);
                            forward_checked(base);
                            let mut c = base.clone();
                            let shape = c.model().slot(key).unwrap().shape().to_vec();
                            c.add_patches(
                                [(
                                    key.as_str(),
                                    Patch::Diff {
                                        diff: rand_tensor(&shape, n),
                                        pad: false,
                                    },
                                )],
                                0.5,
                                1.0,
                            )
                            .unwrap();
                            match mm
                                .load_models_gpu(std::slice::from_ref(&c), LoadOptions::default())
                            {
                                Err(e) if !e.is_retryable() => return Err(e.to_string()),
                                _ => forward_checked(&c),
                            }
                        }
                        3 => {
                            base.partially_unload(device, ByteSize::kib(8));
                            forward_checked(base);
                        }
                        4 => {
                            mm.free_memory(ByteSize((n % 7) * 4096), device, &[]);
                        }
                        5 => mm.cleanup_models(),
                        // A KV cache growing a block at a time, dropped now and then.
                        6 => {
                            if n % 8 == 7 {
                                kv = None;
                            } else {
                                match kv.as_mut() {
                                    None => {
                                        kv = mm.reserve_named("kv", device, ByteSize::kib(2)).ok()
                                    }
                                    Some(r) => {
                                        let _ = r.grow(&mm, ByteSize::kib(2));
                                    }
                                }
                            }
                        }
                        _ => {
                            let reserved: ByteSize =
                                mm.reservations().iter().map(|r| r.bytes).sum();
                            let ledger = mm.ledger(device);
                            let held = sim.used();
                            if ledger > budget {
                                return Err(format!(
                                    "ledger {ledger} over {budget}: {}",
                                    mm.memory_report()
                                ));
                            }
                            // The sim's allocations lag the ledger (frees run in stream order),
                            // but never go past the budget less what is reserved for long.
                            let _ = (held, reserved);
                        }
                    }
                }
                Ok(iters)
            };
            let _ = done.send(run());
        });
    }
    drop(done_tx);
    for _ in 0..8 {
        match done_rx.recv_timeout(Duration::from_secs(300)) {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => panic!("{flags:?}: {e}"),
            Err(e) => panic!(
                "{flags:?}: a thread did not finish in 300 s ({e}): a deadlock, or a panic above"
            ),
        }
    }
    let peak = mm.peak_ledger(device);
    assert!(
        peak <= budget,
        "{flags:?}: the ledger's peak {peak} went over the budget {budget}"
    );
    assert!(sim.check().is_ok(), "{flags:?}: {:?}", sim.check());
}

#[test]
fn pins_partial_unloads_and_two_model_loads_beside_forwards_keep_the_ledger_in_its_budget() {
    let iters = iterations() / 5;
    for extra in [&[][..], &["--disable-dynamic-vram"][..]] {
        let flags = [
            &[
                "--sim-gpu",
                "96KiB@25GB/s",
                "--reserve-vram",
                "0",
                "--async-offload",
                "2",
            ][..],
            extra,
        ]
        .concat();
        hammer_pins_and_partial_unloads(&flags, ByteSize::kib(96), iters);
    }
}
