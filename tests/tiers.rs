//! The tiers below the device: models read lazily from their files, host copies within
//! `--ram-budget`, truncated files, the host tier in reports and plans, and pinning's fallbacks
//! on a machine without a GPU. Real safetensors files, real tensors, real threads.

mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use candle_core::{DType, Tensor};
use common::*;
use residency::loader::{LoadOptions, MemoryManager, PlanProblem};
use residency::ops::{OpsBuilder, OpsMode};
use residency::patcher::{Lora, ModelPatcher, Patch};
use residency::vram::{Config, DeviceId, Hardware};
use residency::weights::{save_safetensors, HostTier, Model, SafetensorsOptions};
use residency::{ByteSize, Dtype, Error, Rounding};

const CPU: DeviceId = DeviceId::Cpu;
const LAYERS: usize = 8;
const W: usize = 128;

/// An 8-layer MLP of 128×128 bf16 weights (32 KiB each) and f32 biases: 260 KiB on disk.
fn write_mlp(dir: &Path, name: &str, seed: u64) -> PathBuf {
    let path = dir.join(format!("{name}.safetensors"));
    let mut tensors = Vec::new();
    for l in 0..LAYERS {
        let w = (rand_tensor(&[W, W], seed + l as u64) * 0.15).unwrap();
        let w = residency::float::from_f32(&w, Dtype::BF16, Rounding::Nearest).unwrap();
        tensors.push((format!("l{l}.weight"), w, Dtype::BF16));
        let b = (rand_tensor(&[W], seed + 100 + l as u64) * 0.1).unwrap();
        tensors.push((format!("l{l}.bias"), b, Dtype::F32));
    }
    save_safetensors(&path, &tensors, &SafetensorsOptions::default()).unwrap();
    path
}

fn bits(t: &Tensor) -> Vec<u32> {
    f32s(t).iter().map(|v| v.to_bits()).collect()
}

/// The MLP over `p` on a fixed input; each weight fetch goes through the ops layers.
fn forward(p: &ModelPatcher) -> residency::Result<Vec<u32>> {
    let b = OpsBuilder::new(
        p,
        OpsMode::ManualCast {
            compute: Dtype::F32,
        },
    );
    let mut x = (rand_tensor(&[4, W], 999) * 0.5).unwrap();
    for l in 0..LAYERS {
        x = b
            .linear(&format!("l{l}"), true)?
            .try_forward(&x)?
            .tanh()
            .unwrap();
    }
    p.model().finish_forward();
    Ok(bits(&x))
}

fn lora_on_l3(p: &mut ModelPatcher) {
    let up = (rand_tensor(&[W, 4], 71) * 0.05).unwrap();
    let down = (rand_tensor(&[4, W], 72) * 0.05).unwrap();
    p.add_patches([("l3.weight", Patch::Lora(Lora::new(up, down)))], 0.8, 1.0)
        .unwrap();
}

/// A CPU manager: `flags`, no reserve, a 1 KiB inference minimum.
fn cpu_manager(flags: &[&str]) -> MemoryManager {
    let mut args = vec!["--reserve-vram", "0", "--inference-memory", "1KiB"];
    args.extend_from_slice(flags);
    MemoryManager::new(
        Config::from_args(&args).unwrap(),
        Hardware::cpu_only(ByteSize::gib(64)),
    )
    .unwrap()
}

fn patcher(model: Model) -> ModelPatcher {
    ModelPatcher::new(Arc::new(model), CPU, CPU).with_compute_dtype(Some(Dtype::F32))
}

/// The output of a fully resident, eagerly read run: the reference every tiered run must match.
fn resident_reference(path: &Path, lora: bool) -> Vec<u32> {
    let mm = cpu_manager(&["--vram-budget", "16MiB"]);
    let mut p = patcher(Model::from_safetensors("mlp", &[path]).unwrap());
    if lora {
        lora_on_l3(&mut p);
    }
    let r = mm
        .load_models_gpu(
            std::slice::from_ref(&p),
            LoadOptions::default().with_force_full_load(true),
        )
        .unwrap();
    assert!(r.models[0].full, "{r}");
    forward(&p).unwrap()
}

/// Adds a wrapper to every weight that checks the host ledger against `budget` at each use and
/// records the highest figure seen.
fn watch_ledger(p: &mut ModelPatcher, tier: &HostTier, budget: ByteSize) -> Arc<AtomicU64> {
    let highest = Arc::new(AtomicU64::new(0));
    let keys: Vec<String> = p.model().keys().map(str::to_string).collect();
    for k in keys {
        let tier = tier.clone();
        let highest = Arc::clone(&highest);
        p.add_weight_wrapper(&k, move |t| {
            let l = tier.ledger();
            assert!(l <= budget, "host ledger {l} over {budget}");
            highest.fetch_max(l.bytes(), Ordering::Relaxed);
            Ok(t)
        });
    }
    highest
}

fn held_sum(tier: &HostTier) -> ByteSize {
    tier.held_copies().iter().map(|c| c.bytes).sum()
}

/// Asserts the host ledger equals the bytes of the copies it holds once the lanes are idle: a
/// prefetch still reading when the forwards return counts its bytes being read (up to 5 s).
fn assert_ledger_is_held_copies(tier: &HostTier) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while held_sum(tier) != tier.ledger() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert_eq!(held_sum(tier), tier.ledger(), "{:?}", tier.stats());
}

#[test]
fn a_model_larger_than_the_host_budget_streams_within_it_and_matches_a_resident_run() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_mlp(dir.path(), "mlp", 1);
    let file_len = std::fs::metadata(&path).unwrap().len();
    let budget = ByteSize::kib(100);
    for lanes in [
        &["--disable-async-offload"][..],
        &["--async-offload", "2"][..],
    ] {
        for lora in [false, true] {
            let reference = resident_reference(&path, lora);
            let mut flags = vec![
                "--vram-budget",
                "16MiB",
                "--novram",
                "--ram-budget",
                "100KiB",
            ];
            flags.extend_from_slice(lanes);
            let mm = cpu_manager(&flags);
            let model = mm.read_model("mlp", &[&path]).unwrap();
            assert!(model.is_lazy());
            assert!(
                model.model_size().bytes() > 2 * budget.bytes(),
                "larger than the budget"
            );
            assert_eq!(mm.host_tier().ledger(), ByteSize::ZERO, "nothing read yet");
            let mut p = patcher(model);
            if lora {
                lora_on_l3(&mut p);
            }
            let tier = mm.host_tier().clone();
            let highest = watch_ledger(&mut p, &tier, budget);
            let r = mm.load_models_gpu(std::slice::from_ref(&p), LoadOptions::default());
            let r = r.unwrap();
            assert_eq!(r.models[0].resident, ByteSize::ZERO, "{r}");
            for step in 0..4 {
                assert_eq!(
                    forward(&p).unwrap(),
                    reference,
                    "{lanes:?}, lora {lora}, step {step}"
                );
                assert_ledger_is_held_copies(&tier);
            }
            let s = tier.stats();
            assert!(s.peak <= budget, "{s:?}");
            assert!(highest.load(Ordering::Relaxed) > 0);
            assert!(
                s.bytes_read.bytes() > file_len,
                "weights were evicted and read again: {s:?}"
            );
            assert!(s.evictions > 0 && s.hits > 0, "{s:?}");
            let report = mm.memory_report();
            assert_eq!(report.host, tier.stats());
            assert!(
                report.to_string().contains("host: budget 100.00 KiB"),
                "{report}"
            );
        }
    }
}

#[test]
fn a_partly_resident_lazy_model_keeps_both_ledgers_within_their_budgets() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_mlp(dir.path(), "mlp", 2);
    let reference = resident_reference(&path, true);
    // A 200 KiB device holds part of the f32 copies (64 KiB each); the rest stream from a
    // 64 KiB host budget.
    let mm = cpu_manager(&["--vram-budget", "200KiB", "--ram-budget", "64KiB"]);
    let mut p = patcher(mm.read_model("mlp", &[&path]).unwrap());
    lora_on_l3(&mut p);
    let plan = mm
        .plan(std::slice::from_ref(&p), LoadOptions::default())
        .unwrap();
    assert!(plan.fits(), "{plan:?}");
    assert_eq!(plan.host.budget, Some(ByteSize::kib(64)));
    // The copies to build are read from disk in their storage dtype (bf16 weights, f32 biases)
    // and built in f32.
    assert!(plan.host.from_disk > ByteSize::ZERO, "{plan:?}");
    assert!(plan.host.from_disk < plan.models[0].to_move, "{plan:?}");
    let r = mm
        .load_models_gpu(std::slice::from_ref(&p), LoadOptions::default())
        .unwrap();
    assert!(mm.host_tier().stats().bytes_read >= plan.host.from_disk);
    assert!(
        r.models[0].resident > ByteSize::ZERO && !r.models[0].full,
        "{r}"
    );
    for _ in 0..3 {
        assert_eq!(forward(&p).unwrap(), reference);
    }
    assert!(mm.peak_ledger(CPU) <= ByteSize::kib(200));
    assert!(mm.host_tier().peak() <= ByteSize::kib(64));
    assert_ledger_is_held_copies(mm.host_tier());
}

#[test]
fn threads_streaming_one_lazy_model_share_the_host_budget() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_mlp(dir.path(), "mlp", 3);
    let reference = resident_reference(&path, false);
    let mm = cpu_manager(&[
        "--vram-budget",
        "16MiB",
        "--novram",
        "--ram-budget",
        "72KiB",
        "--async-offload",
        "2",
    ]);
    let p = patcher(mm.read_model("mlp", &[&path]).unwrap());
    mm.load_models_gpu(std::slice::from_ref(&p), LoadOptions::default())
        .unwrap();
    std::thread::scope(|s| {
        for _ in 0..4 {
            let p = p.clone();
            let reference = &reference;
            s.spawn(move || {
                for _ in 0..5 {
                    assert_eq!(&forward(&p).unwrap(), reference);
                }
            });
        }
    });
    let tier = mm.host_tier();
    assert!(tier.peak() <= ByteSize::kib(72), "{:?}", tier.stats());
    assert_ledger_is_held_copies(tier);
}

/// Registry, residency (per weight: fingerprint, device, bytes) and patch keys of `p`.
fn state_of(mm: &MemoryManager, p: &ModelPatcher) -> (Vec<u64>, Vec<String>, Vec<String>) {
    let registry = mm.loaded_models().iter().map(|m| m.model_id).collect();
    let residency = (0..p.model().len())
        .map(|i| {
            format!(
                "{:?}",
                p.model().residency_of(i).map(|r| match r {
                    residency::weights::SlotResidency::Resident {
                        fingerprint,
                        device,
                        bytes,
                        ..
                    } => format!("{fingerprint} {device} {bytes}"),
                    residency::weights::SlotResidency::Offloaded => "offloaded".into(),
                })
            )
        })
        .collect();
    let mut patches: Vec<String> = p.patches().keys().map(str::to_string).collect();
    patches.sort();
    (registry, residency, patches)
}

#[test]
fn a_file_truncated_mid_run_is_a_typed_error_naming_file_and_tensor_and_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let a_path = write_mlp(dir.path(), "a", 4);
    let b_path = write_mlp(dir.path(), "b", 5);
    let original = std::fs::read(&a_path).unwrap();
    let a_ref = resident_reference(&a_path, true);
    let b_ref = resident_reference(&b_path, false);
    // Both models (528 KiB each in f32) share a 768 KiB device: b whole, a in part.
    let mm = cpu_manager(&["--vram-budget", "768KiB", "--ram-budget", "96KiB"]);
    let mut a = patcher(mm.read_model("a", &[&a_path]).unwrap());
    lora_on_l3(&mut a);
    let b = patcher(mm.read_model("b", &[&b_path]).unwrap());
    mm.load_models_gpu(&[b.clone(), a.clone()], LoadOptions::default())
        .unwrap();
    assert_eq!(forward(&a).unwrap(), a_ref);
    assert_eq!(forward(&b).unwrap(), b_ref);
    let r = mm.memory_report();
    assert!(r.models.iter().all(|m| m.resident > ByteSize::ZERO), "{r}");
    let before = (state_of(&mm, &a), state_of(&mm, &b));
    let ledger = mm.ledger(CPU);

    // Another process truncates a's file in place, in the middle of a weight that streams.
    let streamed = (0..a.model().len())
        .find(|&i| {
            a.resident_tensor(i).is_none() && a.model().slots()[i].name().ends_with("weight")
        })
        .map(|i| a.model().slots()[i].name().to_string())
        .expect("a streams some weights");
    let st = safetensors::SafeTensors::deserialize(&original).unwrap();
    let data = st.tensor(&streamed).unwrap().data();
    let cut = data.as_ptr() as usize - original.as_ptr() as usize + data.len() / 2;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&a_path)
        .unwrap();
    f.set_len(cut as u64).unwrap();
    drop(f);
    mm.host_tier().trim();
    let e = forward(&a).unwrap_err();
    let Error::File { path, reason } = &e else {
        panic!("expected a file error, got {e}");
    };
    assert_eq!(path, &a_path);
    assert!(
        reason.contains(&format!("`{streamed}`")),
        "names the tensor: {reason}"
    );
    assert!(reason.contains("truncated"), "{reason}");
    // Nothing else changed: registry, residency, patches, the device ledger; b still runs.
    assert_eq!((state_of(&mm, &a), state_of(&mm, &b)), before);
    assert_eq!(mm.ledger(CPU), ledger);
    assert_eq!(forward(&b).unwrap(), b_ref);
    assert!(mm.host_tier().peak() <= ByteSize::kib(96));
    assert_ledger_is_held_copies(mm.host_tier());
    // A full load of a with the file still short evicts part of b, fails reading a weight past
    // the cut, and is rolled back: b's dropped copies are rebuilt from its intact file.
    let full = LoadOptions::default().with_force_full_load(true);
    let plan = mm.plan(std::slice::from_ref(&a), full).unwrap();
    assert!(plan.fits() && !plan.evictions.is_empty(), "{plan:?}");
    let reload = mm.load_models_gpu(std::slice::from_ref(&a), full);
    assert!(
        matches!(&reload, Err(Error::File { reason, .. }) if reason.contains("truncated")),
        "{reload:?}"
    );
    assert_eq!((state_of(&mm, &a), state_of(&mm, &b)), before);
    assert_eq!(mm.ledger(CPU), ledger);
    assert!(mm.peak_ledger(CPU) <= ByteSize::kib(768));

    // The file is restored: the same bits as before.
    std::fs::write(&a_path, &original).unwrap();
    assert_eq!(forward(&a).unwrap(), a_ref);
}

#[test]
fn lazy_reads_hold_the_same_bits_as_eager_reads_for_every_storage_dtype() {
    let dir = tempfile::tempdir().unwrap();
    let tier = HostTier::new(Some(ByteSize::kib(8)));
    for dtype in [
        Dtype::F32,
        Dtype::F16,
        Dtype::BF16,
        Dtype::F8E4M3FN,
        Dtype::F8E5M2,
        Dtype::F64,
    ] {
        let path = dir.path().join(format!("{dtype}.safetensors"));
        let mut tensors = Vec::new();
        for (i, shape) in [vec![16, 16], vec![7], vec![0, 3], vec![2, 3, 4]]
            .into_iter()
            .enumerate()
        {
            let t = rand_tensor(&shape, i as u64);
            let t = if dtype == Dtype::F64 {
                t.to_dtype(DType::F64).unwrap()
            } else {
                residency::float::from_f32(&t, dtype, Rounding::Nearest).unwrap()
            };
            tensors.push((format!("w{i}"), t, dtype));
        }
        save_safetensors(&path, &tensors, &SafetensorsOptions::default()).unwrap();
        let eager = Model::from_safetensors("m", &[&path]).unwrap();
        let lazy = Model::from_safetensors_lazy("m", &[&path], &tier).unwrap();
        assert_eq!(
            lazy.keys().collect::<Vec<_>>(),
            eager.keys().collect::<Vec<_>>()
        );
        for (e, l) in eager.slots().iter().zip(lazy.slots()) {
            assert_eq!(
                (e.dtype(), e.shape(), e.bytes()),
                (l.dtype(), l.shape(), l.bytes())
            );
            assert_eq!(
                e.clean().unwrap().dtype(),
                l.clean().unwrap().dtype(),
                "{dtype}"
            );
        }
        assert_eq!(
            lazy.clean_checksum().unwrap(),
            eager.clean_checksum().unwrap(),
            "{dtype}"
        );
        assert!(tier.peak() <= ByteSize::kib(8));
    }
}

#[test]
fn files_that_cannot_be_read_lazily_are_typed_errors_naming_them() {
    let dir = tempfile::tempdir().unwrap();
    let tier = HostTier::new(None);
    let good = write_mlp(dir.path(), "good", 6);
    let bytes = std::fs::read(&good).unwrap();
    let write = |name: &str, data: &[u8]| {
        let p = dir.path().join(name);
        std::fs::write(&p, data).unwrap();
        p
    };
    let cases = [
        (
            "missing",
            dir.path().join("nope.safetensors"),
            "cannot open",
        ),
        (
            "empty",
            write("empty.safetensors", &[]),
            "shorter than its header",
        ),
        (
            "huge header",
            write("huge.safetensors", &u64::MAX.to_le_bytes()),
            "header of",
        ),
        (
            "garbage header",
            write(
                "garbage.safetensors",
                &[[4u8, 0, 0, 0, 0, 0, 0, 0].as_slice(), b"{{{{"].concat(),
            ),
            "not a valid safetensors file",
        ),
        (
            "cut short",
            write("short.safetensors", &bytes[..bytes.len() - 100]),
            "but the file is",
        ),
    ];
    for (what, path, says) in cases {
        let e = Model::from_safetensors_lazy("m", &[&path], &tier).unwrap_err();
        let Error::File { path: p, reason } = &e else {
            panic!("{what}: {e}");
        };
        assert_eq!(p, &path, "{what}");
        assert!(reason.contains(says), "{what}: {reason}");
    }
    // A key in two files.
    let e = Model::from_safetensors_lazy("m", &[&good, &good], &tier).unwrap_err();
    assert!(e.to_string().contains("also appears"), "{e}");
    assert_eq!(tier.ledger(), ByteSize::ZERO);
}

#[test]
fn a_weight_larger_than_the_host_budget_is_refused_by_the_plan() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_mlp(dir.path(), "mlp", 7);
    let mm = cpu_manager(&["--vram-budget", "16MiB", "--ram-budget", "16KiB"]);
    let p = patcher(mm.read_model("mlp", &[&path]).unwrap());
    let plan = mm
        .plan(std::slice::from_ref(&p), LoadOptions::default())
        .unwrap();
    assert!(
        matches!(&plan.problem, Some(PlanProblem::HostBudgetExceeded { key, required, .. })
            if key == "l0.weight" && *required == ByteSize::kib(32)),
        "{plan:?}"
    );
    let e = mm
        .load_models_gpu(std::slice::from_ref(&p), LoadOptions::default())
        .unwrap_err();
    assert!(
        matches!(e, Error::BudgetExceeded { .. }) && !e.is_retryable(),
        "{e}"
    );
    assert!(e.to_string().contains("l0.weight"), "{e}");
    assert!(mm.loaded_models().is_empty());
    assert_eq!(mm.host_tier().ledger(), ByteSize::ZERO);
    // A streamed use fails the same way, typed, reading nothing.
    let e = forward(&p).unwrap_err();
    assert!(matches!(e, Error::BudgetExceeded { .. }), "{e}");
}

#[test]
fn dropping_a_lazy_model_releases_its_host_copies() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_mlp(dir.path(), "mlp", 8);
    let mm = cpu_manager(&["--ram-budget", "1MiB"]);
    let p = patcher(mm.read_model("mlp", &[&path]).unwrap());
    forward(&p).unwrap();
    let held = mm.host_tier().ledger();
    assert_eq!(
        held,
        p.model().model_size(),
        "every weight is held within 1 MiB"
    );
    drop(p);
    assert_eq!(mm.host_tier().ledger(), ByteSize::ZERO);
    assert!(mm.host_tier().held_copies().is_empty());
}

#[test]
fn without_a_ram_budget_models_are_read_eagerly_and_nothing_is_booked() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_mlp(dir.path(), "mlp", 9);
    let mm = cpu_manager(&[]);
    let p = patcher(mm.read_model("mlp", &[&path]).unwrap());
    assert!(!p.model().is_lazy());
    forward(&p).unwrap();
    let report = mm.memory_report();
    assert_eq!(report.host.budget, None);
    assert_eq!(report.host.ledger, ByteSize::ZERO);
}

#[test]
fn without_a_gpu_nothing_is_pinned_and_streaming_loses_nothing() {
    // No CUDA here (or a CPU-only snapshot): the pin budget is zero, every pin falls back.
    for flags in [&[][..], &["--disable-pinned-memory"][..]] {
        let mut all = vec![
            "--novram",
            "--vram-budget",
            "16MiB",
            "--ram-budget",
            "80KiB",
        ];
        all.extend_from_slice(flags);
        let mm = cpu_manager(&all);
        let report = mm.memory_report();
        assert_eq!(report.host.pin_budget, ByteSize::ZERO);
        let dir = tempfile::tempdir().unwrap();
        let path = write_mlp(dir.path(), "mlp", 10);
        let reference = resident_reference(&path, false);
        let p = patcher(mm.read_model("mlp", &[&path]).unwrap());
        mm.load_models_gpu(std::slice::from_ref(&p), LoadOptions::default())
            .unwrap();
        assert_eq!(forward(&p).unwrap(), reference);
        let s = mm.memory_report();
        assert_eq!((s.host.pinned, s.host.pin_failures), (ByteSize::ZERO, 0));
        assert_eq!(s.transfers.bytes_direct, ByteSize::ZERO);
    }
}

#[test]
fn clean_weights_of_a_lazy_model_are_host_tensors_for_tools_and_patch_math() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_mlp(dir.path(), "mlp", 11);
    let tier = HostTier::new(Some(ByteSize::kib(40)));
    let lazy = patcher(Model::from_safetensors_lazy("mlp", &[&path], &tier).unwrap());
    let eager = patcher(Model::from_safetensors("mlp", &[&path]).unwrap());
    let mut lp = lazy.clone();
    let mut ep = eager.clone();
    lora_on_l3(&mut lp);
    lora_on_l3(&mut ep);
    // Patch math, the patched state dict and a clean weight read through the model.
    for k in ["l3.weight", "l3.bias", "l0.weight"] {
        assert_eq!(
            bits(&lp.patched_weight(k).unwrap()),
            bits(&ep.patched_weight(k).unwrap())
        );
        let c = lazy.model().clean(k).unwrap();
        assert!(c.device().is_cpu());
        assert_eq!(bits(&c), bits(&eager.model().clean(k).unwrap()));
    }
    let sd_l = lp.patched_state_dict().unwrap();
    let sd_e = ep.patched_state_dict().unwrap();
    for ((kl, tl, dl), (ke, te, de)) in sd_l.iter().zip(&sd_e) {
        assert_eq!((kl, dl), (ke, de));
        assert_eq!(bits(tl), bits(te), "{kl}");
    }
    assert!(tier.peak() <= ByteSize::kib(40));
}

#[test]
fn an_eager_read_racing_a_truncation_is_a_typed_error_never_a_signal() {
    // The eager reader reads by positioned reads (no memory map): a file cut short while it is
    // read gives `Error::File` naming it and a tensor, or reads whole; the process never gets a
    // SIGBUS (a mapped read did, in 18–31 of 60 attempts).
    let dir = tempfile::tempdir().unwrap();
    let good = write_mlp(dir.path(), "race", 3);
    let bytes = std::fs::read(&good).unwrap();
    let path = dir.path().join("victim.safetensors");
    let (mut ok, mut typed, mut cut_first) = (0, 0, 0);
    for attempt in 0..60u64 {
        std::fs::write(&path, &bytes).unwrap();
        // One attempt in four cuts the file before the read starts, so the typed error is seen
        // whatever the scheduler does with the racing ones (on a loaded machine every racing
        // read can finish before its cutter runs).
        let before = attempt % 4 == 0;
        let cutter = {
            let path = path.clone();
            let keep = (bytes.len() as u64 / 2) + attempt * 97 % 4096;
            std::thread::spawn(move || {
                std::thread::sleep(std::time::Duration::from_micros(attempt * 13 % 200));
                let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
                f.set_len(keep).unwrap();
            })
        };
        let racing = if before {
            cutter.join().unwrap();
            None
        } else {
            Some(cutter)
        };
        match Model::from_safetensors("race", &[&path]) {
            Ok(m) => {
                ok += 1;
                assert_eq!(m.len(), 2 * LAYERS);
            }
            Err(e) => {
                typed += 1;
                cut_first += usize::from(before);
                let msg = e.to_string();
                assert!(matches!(e, Error::File { .. }), "{msg}");
                assert!(msg.contains("victim.safetensors"), "{msg}");
                assert!(msg.contains("tensor `") || msg.contains("header"), "{msg}");
            }
        }
        if let Some(cutter) = racing {
            cutter.join().unwrap();
        }
    }
    assert_eq!(ok + typed, 60);
    assert_eq!(
        cut_first, 15,
        "every read of a file already cut short is a typed error ({ok} read whole)"
    );
}

/// A safetensors file of `layers` bf16 weights of `width`² each.
fn write_wide(dir: &Path, layers: usize, width: usize) -> PathBuf {
    let path = dir.join("wide.safetensors");
    let tensors: Vec<_> = (0..layers)
        .map(|l| {
            let w = (rand_tensor(&[width, width], 300 + l as u64) * 0.1).unwrap();
            let w = residency::float::from_f32(&w, Dtype::BF16, Rounding::Nearest).unwrap();
            (format!("l{l}.weight"), w, Dtype::BF16)
        })
        .collect();
    save_safetensors(&path, &tensors, &SafetensorsOptions::default()).unwrap();
    path
}

#[test]
fn every_streamed_weight_of_a_lazy_model_pins_in_place_on_a_simulated_gpu() {
    // Issue 45, item 19: host copies lived in ordinary heap buffers that share their first and
    // last pages with their neighbours; the driver (and the sim) lock whole pages, so a pin next
    // to a pinned neighbour was refused and the weight staged. 24 weights of 320,000 bytes (not
    // a whole number of pages) through a host budget of a third of them (evictions free copies
    // and the allocator packs the next reads side by side), streamed to a 2 MiB simulated GPU.
    const LAYERS: usize = 24;
    const WIDTH: usize = 400;
    let dir = tempfile::tempdir().unwrap();
    let path = write_wide(dir.path(), LAYERS, WIDTH);
    let flags = [
        "--reserve-vram",
        "0",
        "--inference-memory",
        "64KiB",
        "--sim-gpu",
        "2MiB@25GB/s",
        "--ram-budget",
        "2600KiB",
    ];
    let config = Config::from_args(flags)
        .unwrap()
        .with_transfer_lanes(2)
        .with_prefetch_depth(2);
    let mm = MemoryManager::new(config, Hardware::cpu_only(ByteSize::gib(4))).unwrap();
    let model = mm.read_model("wide", &[&path]).unwrap();
    assert!(model.is_lazy());
    let p = ModelPatcher::new(Arc::new(model), DeviceId::Sim(0), CPU)
        .with_compute_dtype(Some(Dtype::F32));
    mm.load_models_gpu(std::slice::from_ref(&p), LoadOptions::default())
        .unwrap();
    let mut outputs = Vec::new();
    for _ in 0..4 {
        let mut x = rand_tensor(&[2, WIDTH], 5);
        for l in 0..LAYERS {
            let (w, _) = residency::offload::fetch_weight(&p, &format!("l{l}.weight")).unwrap();
            x = x.matmul(&w.t().unwrap()).unwrap().tanh().unwrap();
        }
        p.model().finish_forward();
        outputs.push(bits(&x));
    }
    assert!(outputs.windows(2).all(|w| w[0] == w[1]));
    for sim in mm.transfer_engine().devices().sims() {
        sim.check().unwrap();
    }
    let report = mm.memory_report();
    let t = report.transfers;
    assert!(
        report.host.evictions > 0 && t.bytes_transferred.bytes() > 0,
        "the model streamed through the host budget: {:?}, {t:?}",
        report.host
    );
    assert_eq!(
        report.host.pin_failures, 0,
        "no pin refused: {:?}, {t:?}",
        report.host
    );
    assert_eq!(t.bytes_staged, ByteSize::ZERO, "nothing staged: {t:?}");
    assert_eq!(t.bytes_pageable, ByteSize::ZERO, "{t:?}");
    assert!(
        t.bytes_direct.bytes() >= t.bytes_transferred.bytes(),
        "{t:?}"
    );
}
