//! Many devices: per-device budgets and ledgers, one model split across simulated GPUs by a
//! `DeviceMap` (manual and auto), the split forward's bits, patches following their weights, and
//! a failed load on the second device leaving both as they were.

mod common;

use std::path::Path;
use std::sync::Arc;

use candle_core::{Device, Module, Tensor};
use residency::device::SimFault;
use residency::float::Dtype;
use residency::loader::{LoadOptions, MemoryManager};
use residency::nn as candle_nn;
use residency::ops::OpsMode;
use residency::patcher::{Lora, Patch};
use residency::size::ByteSize;
use residency::vram::{Config, DeviceId, Hardware};
use residency::{DeviceMap, Model, ModelPatcher, Target};

const VOCAB: usize = 64;
const HIDDEN: usize = 64;
const LAYERS: usize = 12;

/// A residual MLP stack on `residency::nn` layers, as a candle-nn model is written: the
/// residual `x + down(gelu(up(norm(x))))` crosses device boundaries when split.
struct Net {
    embed: candle_nn::Embedding,
    layers: Vec<(candle_nn::RmsNorm, candle_nn::Linear, candle_nn::Linear)>,
    head: candle_nn::Linear,
}

impl Net {
    fn new(p: &ModelPatcher) -> Net {
        let vb = candle_nn::VarBuilder::from_patcher(
            p,
            OpsMode::ManualCast {
                compute: Dtype::F32,
            },
        )
        .unwrap();
        let layers = (0..LAYERS)
            .map(|i| {
                let vb = vb.pp("layers").pp(i);
                (
                    candle_nn::rms_norm(HIDDEN, 1e-5, vb.pp("norm")).unwrap(),
                    candle_nn::linear(HIDDEN, 4 * HIDDEN, vb.pp("up")).unwrap(),
                    candle_nn::linear_no_bias(4 * HIDDEN, HIDDEN, vb.pp("down")).unwrap(),
                )
            })
            .collect();
        Net {
            embed: candle_nn::embedding(VOCAB, HIDDEN, vb.pp("embed")).unwrap(),
            layers,
            head: candle_nn::linear_no_bias(HIDDEN, VOCAB, vb.pp("head")).unwrap(),
        }
    }

    fn forward(&self, ids: &Tensor) -> Vec<u32> {
        let mut x = self.embed.forward(ids).unwrap();
        for (norm, up, down) in &self.layers {
            let h = up
                .forward(&norm.forward(&x).unwrap())
                .unwrap()
                .gelu()
                .unwrap();
            x = (x + down.forward(&h).unwrap()).unwrap();
        }
        let y = self.head.forward(&x).unwrap();
        common::f32s(&y).into_iter().map(f32::to_bits).collect()
    }
}

/// A rank-2 LoRA for one `up` weight.
fn style_lora() -> Lora {
    Lora {
        up: (common::rand_tensor(&[4 * HIDDEN, 2], 99) * 0.1).unwrap(),
        down: (common::rand_tensor(&[2, HIDDEN], 98) * 0.1).unwrap(),
        alpha: None,
        mid: None,
        dora_scale: None,
    }
}

fn write_model(dir: &Path) -> std::path::PathBuf {
    let mut tensors: Vec<(String, Tensor, Dtype)> = Vec::new();
    let mut seed = 1;
    let mut t = |name: String, shape: &[usize]| {
        seed += 1;
        let x = (common::rand_tensor(shape, seed) * 0.2).unwrap();
        tensors.push((name, x, Dtype::F32));
    };
    t("embed.weight".into(), &[VOCAB, HIDDEN]);
    for i in 0..LAYERS {
        t(format!("layers.{i}.norm.weight"), &[HIDDEN]);
        t(format!("layers.{i}.up.weight"), &[4 * HIDDEN, HIDDEN]);
        t(format!("layers.{i}.up.bias"), &[4 * HIDDEN]);
        t(format!("layers.{i}.down.weight"), &[HIDDEN, 4 * HIDDEN]);
    }
    t("head.weight".into(), &[VOCAB, HIDDEN]);
    let path = dir.join("net.safetensors");
    residency::weights::save_safetensors(&path, &tensors, &Default::default()).unwrap();
    path
}

fn ids() -> Tensor {
    Tensor::new(&[[3u32, 17, 42, 5, 63, 0, 9, 31]], &Device::Cpu).unwrap()
}

/// A manager with `sims` simulated GPUs (`SIZE@BANDWIDTH` specs) and tiny fixed overheads, in
/// classic mode: these tests pin where loads put weights and what they evict per device, which a
/// dynamic load (residency by use: it moves nothing) does not decide — `tests/dynamic.rs` runs
/// split models in dynamic mode.
fn manager(sims: &[&str], extra: &[&str]) -> MemoryManager {
    let mut args: Vec<String> = vec![
        "--reserve-vram".into(),
        "0".into(),
        "--inference-memory".into(),
        "1KiB".into(),
        "--disable-dynamic-vram".into(),
    ];
    for s in sims {
        args.extend(["--sim-gpu".to_string(), s.to_string()]);
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    MemoryManager::new(
        Config::from_args(&args).unwrap(),
        Hardware::cpu_only(ByteSize::gib(8)),
    )
    .unwrap()
}

fn patcher(path: &Path, device: DeviceId) -> ModelPatcher {
    let model = Model::from_safetensors("net", &[path]).unwrap();
    ModelPatcher::new(Arc::new(model), device, DeviceId::Cpu).with_compute_dtype(Some(Dtype::F32))
}

fn assert_clean(mm: &MemoryManager) {
    for sim in mm.transfer_engine().devices().sims() {
        sim.check().unwrap();
    }
}

/// Bytes of `p`'s weights resident on each of `devices`.
fn resident_on(p: &ModelPatcher, devices: &[DeviceId]) -> Vec<ByteSize> {
    devices
        .iter()
        .map(|&d| p.model().resident_bytes(d))
        .collect()
}

#[test]
fn a_model_three_times_a_device_runs_split_with_the_cpu_bits() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_model(dir.path());

    // The CPU run, unmanaged.
    let cpu = patcher(&path, DeviceId::Cpu);
    let expected = Net::new(&cpu).forward(&ids());
    let size = cpu.resident_model_size();

    // One large simulated device.
    let mm = manager(&["64MiB@25GB/s"], &[]);
    let one = patcher(&path, DeviceId::Sim(0));
    mm.load_models_gpu(std::slice::from_ref(&one), LoadOptions::default())
        .unwrap();
    assert_eq!(Net::new(&one).forward(&ids()), expected, "one large device");
    assert_clean(&mm);
    drop(mm);

    // Four devices, each a third of the model or less.
    let device_size = ByteSize(size.bytes() / 3);
    let spec = format!("{}B@25GB/s", device_size.bytes());
    let mm = manager(&[&spec, &spec, &spec, &spec], &[]);
    let devices: Vec<DeviceId> = (0..4).map(DeviceId::Sim).collect();
    let base = patcher(&path, DeviceId::Sim(0));
    let budgets = mm.device_budgets();
    assert_eq!(budgets.len(), 4);
    let map = DeviceMap::auto(&base, &budgets, Default::default());
    let base = base.with_device_map(map);
    let plan = mm
        .plan(std::slice::from_ref(&base), LoadOptions::default())
        .unwrap();
    assert!(plan.fits(), "{:?}", plan.problem);
    assert_eq!(plan.models[0].streaming, ByteSize::ZERO, "{plan:#?}");
    assert!(
        plan.models[0].placed.len() >= 3,
        "{:?}",
        plan.models[0].placed
    );
    let report = mm
        .load_models_gpu(std::slice::from_ref(&base), LoadOptions::default())
        .unwrap();
    assert!(report.models[0].full);
    let on = resident_on(&base, &devices);
    assert_eq!(on.iter().copied().sum::<ByteSize>(), size);
    for (d, bytes) in devices.iter().zip(&on) {
        assert!(*bytes <= mm.get_total_memory(*d), "{d}: {bytes}");
        assert!(mm.peak_ledger(*d) <= mm.get_total_memory(*d), "{d}");
    }
    assert!(
        on.iter().filter(|b| **b > ByteSize::ZERO).count() >= 3,
        "{on:?}"
    );

    let streamed_before = mm.transfer_stats().bytes_transferred;
    let net = Net::new(&base);
    assert_eq!(net.forward(&ids()), expected, "split across four devices");
    assert_eq!(net.forward(&ids()), expected, "second forward");
    assert_eq!(
        mm.transfer_stats().bytes_transferred,
        streamed_before,
        "a split model that fits streams no weight"
    );
    let stats = base.split_stats();
    assert!(stats.activation_moves > 0 && stats.activation_bytes > ByteSize::ZERO);
    // Activations are small beside the weights that did not have to stream.
    assert!(stats.activation_bytes < size, "{stats:?} vs {size}");
    assert_clean(&mm);

    // A LoRA clone is split the same way: only the patched weight moves, on its own device.
    let key = "layers.7.up.weight";
    let index = base.model().index_of(key).unwrap();
    let device = base.weight_device(index);
    assert_ne!(device, DeviceId::Sim(0), "layer 7 is on a later device");
    let mut clone = base.clone();
    let lora = style_lora();
    clone
        .add_patches([(key, Patch::Lora(lora))], 1.0, 1.0)
        .unwrap();
    assert_eq!(clone.weight_device(index), device);
    let before = resident_on(&base, &devices);
    let report = mm
        .load_models_gpu(std::slice::from_ref(&clone), LoadOptions::default())
        .unwrap();
    let weight_bytes = base.resident_size(index);
    assert_eq!(
        report.models[0].built, weight_bytes,
        "only the patched weight moves"
    );
    assert_eq!(
        resident_on(&clone, &devices),
        before,
        "every device holds what it held"
    );
    let patched = Net::new(&clone).forward(&ids());
    assert_ne!(patched, expected);
    // Unsplit, the same clone gives the same bits.
    let unsplit = patcher(&path, DeviceId::Cpu);
    let mut unsplit_clone = unsplit.clone();
    let lora = style_lora();
    unsplit_clone
        .add_patches([(key, Patch::Lora(lora))], 1.0, 1.0)
        .unwrap();
    assert_eq!(Net::new(&unsplit_clone).forward(&ids()), patched);
    // Back to the base: again one weight.
    let report = mm
        .load_models_gpu(std::slice::from_ref(&base), LoadOptions::default())
        .unwrap();
    assert_eq!(report.models[0].built, weight_bytes);
    assert_eq!(Net::new(&base).forward(&ids()), expected);
    assert_clean(&mm);
}

#[test]
fn host_rules_stream_and_a_map_larger_than_a_device_streams_its_overflow() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_model(dir.path());
    let expected = Net::new(&patcher(&path, DeviceId::Cpu)).forward(&ids());
    let mm = manager(&["16MiB@25GB/s", "16MiB@25GB/s"], &[]);

    // Layers 0-5 on sim:1, the head streamed from the host, the rest on sim:0.
    let map = DeviceMap::parse("layers\\.[0-5]\\.=sim:1,head=host").unwrap();
    let p = patcher(&path, DeviceId::Sim(0)).with_device_map(map);
    let head = p.resident_size(p.model().index_of("head.weight").unwrap());
    assert!(p.streams_always(p.model().index_of("head.weight").unwrap()));
    let report = mm
        .load_models_gpu(std::slice::from_ref(&p), LoadOptions::default())
        .unwrap();
    assert_eq!(report.models[0].streaming, head);
    assert!(!report.models[0].full);
    let layer0 = p.model().index_of("layers.0.up.weight").unwrap();
    assert_eq!(p.weight_device(layer0), DeviceId::Sim(1));
    assert!(p.model().resident_bytes(DeviceId::Sim(1)) > ByteSize::ZERO);
    let streamed = mm.transfer_stats().bytes_transferred;
    assert_eq!(Net::new(&p).forward(&ids()), expected);
    assert_eq!(
        mm.transfer_stats()
            .bytes_transferred
            .saturating_sub(streamed),
        head,
        "only the head streamed"
    );
    assert_clean(&mm);
    drop(p);

    // Everything mapped to a device half the model's size: the overflow streams to it, within
    // its budget, with the same bits.
    let size = patcher(&path, DeviceId::Cpu).resident_model_size();
    let half = format!("{}B", size.bytes() / 2);
    let mm = manager(&["16MiB", &half], &[]);
    let p = patcher(&path, DeviceId::Sim(0))
        .with_device_map(DeviceMap::new().prefix("layers", Target::Device(DeviceId::Sim(1))));
    let report = mm
        .load_models_gpu(std::slice::from_ref(&p), LoadOptions::default())
        .unwrap();
    assert!(report.models[0].streaming > ByteSize::ZERO);
    assert_eq!(Net::new(&p).forward(&ids()), expected);
    assert!(mm.peak_ledger(DeviceId::Sim(1)) <= mm.get_total_memory(DeviceId::Sim(1)));
    assert_clean(&mm);
}

#[test]
fn a_full_load_that_overruns_the_second_device_changes_nothing_on_either() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_model(dir.path());
    let size = patcher(&path, DeviceId::Cpu).resident_model_size();
    let small = format!("{}B", size.bytes() / 4);
    let mm = manager(&["16MiB", &small], &[]);
    // Another model resident on both devices first.
    let other = patcher(&path, DeviceId::Sim(0))
        .with_device_map(DeviceMap::parse("layers.0.=sim:1").unwrap());
    mm.load_models_gpu(std::slice::from_ref(&other), LoadOptions::default())
        .unwrap();
    let ledgers = |mm: &MemoryManager| [mm.ledger(DeviceId::Sim(0)), mm.ledger(DeviceId::Sim(1))];
    let before = ledgers(&mm);

    let p = patcher(&path, DeviceId::Sim(0))
        .with_device_map(DeviceMap::new().prefix("layers", Target::Device(DeviceId::Sim(1))));
    let e = mm
        .load_models_gpu(
            std::slice::from_ref(&p),
            LoadOptions::default().with_force_full_load(true),
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("sim:1"), "{e}");
    assert_eq!(ledgers(&mm), before);
    assert_eq!(p.model().resident_bytes(DeviceId::Sim(0)), ByteSize::ZERO);

    // A driver fault on the second device mid-load: rolled back on both.
    let p = patcher(&path, DeviceId::Sim(0))
        .with_device_map(DeviceMap::parse("layers.1[01].=sim:1").unwrap());
    let sim1 = &mm.transfer_engine().devices().sims()[1];
    sim1.inject(SimFault::Alloc, 1);
    let e = mm.load_models_gpu(std::slice::from_ref(&p), LoadOptions::default());
    assert!(e.is_err(), "the injected fault fails the load");
    sim1.disarm();
    assert_eq!(ledgers(&mm), before, "both devices as they were");
    assert_eq!(p.model().resident_bytes(DeviceId::Sim(0)), ByteSize::ZERO);
    assert_eq!(p.model().resident_bytes(DeviceId::Sim(1)), ByteSize::ZERO);
    // And it loads once the fault is gone, giving the CPU bits.
    mm.load_models_gpu(std::slice::from_ref(&p), LoadOptions::default())
        .unwrap();
    let expected = Net::new(&patcher(&path, DeviceId::Cpu)).forward(&ids());
    assert_eq!(Net::new(&p).forward(&ids()), expected);
    assert_clean(&mm);
}

/// A model of `bytes` f32 weights named `name.w{i}` (4 weights).
fn sized_model(name: &str, bytes: u64) -> ModelPatcher {
    let per = (bytes / 4 / 4) as usize;
    let tensors: Vec<(String, Tensor)> = (0..4)
        .map(|i| (format!("w{i}"), common::rand_tensor(&[per], i as u64 + 1)))
        .collect();
    let model = Model::from_tensors(name, tensors).unwrap();
    ModelPatcher::new(Arc::new(model), DeviceId::Sim(0), DeviceId::Cpu)
}

#[test]
fn auto_placement_prefers_residency_then_room_then_the_cheapest_eviction() {
    let mm = manager(&["4MiB", "4MiB"], &[]);
    let a = sized_model("a", 2 << 20).with_auto_device();
    let b = sized_model("b", 2 << 20).with_auto_device();
    // Both empty: the most free memory, ties to the lowest ordinal.
    let plan = mm
        .plan(std::slice::from_ref(&a), LoadOptions::default())
        .unwrap();
    assert_eq!(plan.models[0].device, DeviceId::Sim(0));
    assert_eq!(a.load_device(), DeviceId::Sim(0), "a plan changes nothing");
    mm.load_models_gpu(std::slice::from_ref(&a), LoadOptions::default())
        .unwrap();
    assert_eq!(a.load_device(), DeviceId::Sim(0));
    // b goes where there is room without evicting a.
    let plan = mm
        .plan(std::slice::from_ref(&b), LoadOptions::default())
        .unwrap();
    assert_eq!(plan.models[0].device, DeviceId::Sim(1));
    assert!(plan.evictions.is_empty());
    mm.load_models_gpu(std::slice::from_ref(&b), LoadOptions::default())
        .unwrap();
    assert_eq!(b.load_device(), DeviceId::Sim(1));
    assert_eq!(a.model().resident_bytes(DeviceId::Sim(0)), ByteSize::mib(2));
    // A reload stays put and moves nothing; a clone shares the choice.
    let report = mm
        .load_models_gpu(std::slice::from_ref(&a), LoadOptions::default())
        .unwrap();
    assert_eq!(report.models[0].built, ByteSize::ZERO);
    assert_eq!(report.models[0].device, DeviceId::Sim(0));
    assert_eq!(a.clone().load_device(), DeviceId::Sim(0));

    // c (3 MiB) fits nowhere: it goes where eviction costs least. Keep a: only b can go.
    let c = sized_model("c", 3 << 20).with_auto_device();
    let _keep = mm.keep(&a);
    let plan = mm
        .plan(std::slice::from_ref(&c), LoadOptions::default())
        .unwrap();
    assert_eq!(plan.models[0].device, DeviceId::Sim(1), "{plan:#?}");
    assert!(plan.evictions.iter().all(|e| e.name == "b"), "{plan:#?}");
    mm.load_models_gpu(std::slice::from_ref(&c), LoadOptions::default())
        .unwrap();
    assert_eq!(c.load_device(), DeviceId::Sim(1));
    assert_eq!(a.model().resident_bytes(DeviceId::Sim(0)), ByteSize::mib(2));
    for d in [DeviceId::Sim(0), DeviceId::Sim(1)] {
        assert!(mm.peak_ledger(d) <= mm.get_total_memory(d));
    }
    assert_clean(&mm);
}

#[test]
fn per_device_budgets_bound_each_ledger_and_reports_show_every_device() {
    let mm = manager(&["64MiB", "64MiB"], &["--vram-budget", "0=3MiB,1=5MiB"]);
    assert_eq!(mm.get_total_memory(DeviceId::Sim(0)), ByteSize::mib(3));
    assert_eq!(mm.get_total_memory(DeviceId::Sim(1)), ByteSize::mib(5));
    let a = sized_model("a", 4 << 20);
    let b = sized_model("b", 4 << 20).with_auto_device();
    // a (4 MiB) on sim:0 (3 MiB budget) loads partially; b is placed on sim:1, where it fits.
    let ra = mm
        .load_models_gpu(std::slice::from_ref(&a), LoadOptions::default())
        .unwrap();
    assert!(!ra.models[0].full);
    assert!(mm.ledger(DeviceId::Sim(0)) <= ByteSize::mib(3));
    let rb = mm
        .load_models_gpu(std::slice::from_ref(&b), LoadOptions::default())
        .unwrap();
    assert_eq!(rb.models[0].device, DeviceId::Sim(1));
    assert!(rb.models[0].full);
    let report = mm.memory_report();
    let text = report.to_string();
    assert!(text.contains("sim:0") && text.contains("sim:1"), "{text}");
    assert!(
        text.contains("3.00 MiB") && text.contains("5.00 MiB"),
        "{text}"
    );
    assert_clean(&mm);
}

/// Layers `(out, in)` as bf16 weights and f32 biases, named `l{i}.weight` / `l{i}.bias`.
fn layered_model(name: &str, layers: &[(usize, usize)]) -> Model {
    let mut t = Vec::new();
    for (l, &(o, i)) in layers.iter().enumerate() {
        let w = residency::float::from_f32(
            &common::rand_tensor(&[o, i], l as u64),
            Dtype::BF16,
            residency::float::Rounding::Nearest,
        )
        .unwrap();
        t.push((format!("l{l}.weight"), w, Dtype::BF16));
        t.push((
            format!("l{l}.bias"),
            common::rand_tensor(&[o], 50 + l as u64),
            Dtype::F32,
        ));
    }
    Model::from_typed_tensors(name, t).unwrap()
}

#[test]
fn eviction_on_one_device_never_counts_copies_on_another() {
    // Found by the model-based test: victims were keyed by model only, so a model partly
    // evicted on sim:0 was "evicted" on sim:1 too, its sim:0 bytes counted as room there, and
    // the split model's load overran sim:1's budget.
    let mm = manager(
        &["12KiB", "12KiB"],
        &["--vram-budget", "12KiB", "--disable-async-offload"],
    );
    let _r = mm.reserve(DeviceId::Sim(1), ByteSize::kib(4)).unwrap();
    let a = ModelPatcher::new(
        Arc::new(layered_model(
            "a",
            &[(32, 32), (48, 32), (32, 48), (16, 32)],
        )),
        DeviceId::Sim(0),
        DeviceId::Cpu,
    )
    .with_compute_dtype(Some(Dtype::F32));
    mm.load_models_gpu(std::slice::from_ref(&a), LoadOptions::default())
        .unwrap();
    assert!(a.model().resident_bytes(DeviceId::Sim(0)) > ByteSize::ZERO);
    let b = ModelPatcher::new(
        Arc::new(layered_model("b", &[(64, 32), (64, 64), (32, 64)])),
        DeviceId::Sim(1),
        DeviceId::Cpu,
    )
    .with_device_map(
        DeviceMap::new()
            .prefix("l0", Target::Device(DeviceId::Sim(0)))
            .prefix("l2.bias", Target::Host),
    );
    let plan = mm
        .plan(std::slice::from_ref(&b), LoadOptions::default())
        .unwrap();
    assert!(
        plan.evictions.iter().all(|e| e.device == DeviceId::Sim(0)),
        "{:?}",
        plan.evictions
    );
    let after = plan
        .devices
        .iter()
        .find(|d| d.device == DeviceId::Sim(1))
        .unwrap()
        .ledger_after;
    assert!(after <= ByteSize::kib(12), "{after}");
    mm.load_models_gpu(std::slice::from_ref(&b), LoadOptions::default())
        .unwrap();
    assert_eq!(mm.ledger(DeviceId::Sim(1)), after);
    assert!(
        a.model().resident_bytes(DeviceId::Sim(0)) > ByteSize::ZERO,
        "a keeps part of its copies"
    );
    assert_clean(&mm);
}

#[test]
fn memory_reports_never_wait_for_a_load_and_loads_on_two_devices_run_from_two_threads() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;
    // Each copy takes 250 ms: a load of four weights holds the manager for a second (a
    // classic load: in dynamic mode a load copies nothing).
    let mut config = Config::from_args([
        "--reserve-vram",
        "0",
        "--inference-memory",
        "1KiB",
        "--disable-dynamic-vram",
    ])
    .unwrap()
    .with_transfer_lanes(0);
    for _ in 0..2 {
        config = config.with_sim_gpu(
            residency::vram::SimSpec::new(ByteSize::mib(16))
                .with_latency(Duration::from_millis(250)),
        );
    }
    let mm = Arc::new(MemoryManager::new(config, Hardware::cpu_only(ByteSize::gib(8))).unwrap());
    let before = sized_model("before", 64 << 10);
    mm.load_models_gpu(std::slice::from_ref(&before), LoadOptions::default())
        .unwrap();
    let a = sized_model("a", 1 << 20);
    let b = {
        let p = sized_model("b", 1 << 20);
        ModelPatcher::new(Arc::clone(p.model()), DeviceId::Sim(1), DeviceId::Cpu)
    };
    let done = Arc::new(AtomicBool::new(false));
    let sim0 = Arc::clone(&mm.transfer_engine().devices().sims()[0]);
    let copies_before = sim0.stats().copies;
    let loads: Vec<_> = [a.clone(), b.clone()]
        .into_iter()
        .map(|p| {
            let (mm, done) = (Arc::clone(&mm), Arc::clone(&done));
            std::thread::spawn(move || {
                let r = mm.load_models_gpu(std::slice::from_ref(&p), LoadOptions::default());
                done.store(true, Ordering::SeqCst);
                r.map(|r| r.models[0].built)
            })
        })
        .collect();
    // Once a load's first copy ran, it holds the manager lock for its other copies.
    while sim0.stats().copies == copies_before
        && mm.transfer_engine().devices().sims()[1].stats().copies == 0
    {
        std::thread::sleep(Duration::from_millis(1));
    }
    let report = mm.memory_report();
    let loaded = mm.loaded_models();
    assert!(
        !done.load(Ordering::SeqCst),
        "the reports returned while a load was running"
    );
    assert!(loaded.iter().any(|m| m.name == "before"), "{loaded:?}");
    assert!(report.to_string().contains("before"));
    // Its device figures are the book's as of the last step: consistent and within budget.
    for d in &report.devices {
        assert!(d.ledger <= d.total, "{d:?}");
        assert_eq!(d.free, d.total.saturating_sub(d.ledger), "{d:?}");
    }
    for l in loads {
        assert_eq!(l.join().unwrap().unwrap(), ByteSize::mib(1));
    }
    assert_eq!(mm.ledger(DeviceId::Sim(1)), ByteSize::mib(1));
    assert_eq!(
        mm.ledger(DeviceId::Sim(0)),
        ByteSize::mib(1).saturating_add(ByteSize(64 << 10))
    );
    assert_eq!(mm.loaded_models().len(), 3);
    assert_clean(&mm);
}

#[test]
fn a_model_managed_whole_refuses_a_device_map_that_splits_it() {
    let mm = manager(&["16MiB", "16MiB"], &[]);
    let p = sized_model("whole", 64 << 10).with_device_map(DeviceMap::parse("w0=sim:1").unwrap());
    let managed = residency::managed::Managed::new(p, |vb| vb.get(4096, "w0"));
    let before = mm.ledger(DeviceId::Sim(1));
    let e = mm
        .load_models_gpu(
            std::slice::from_ref(managed.patcher()),
            LoadOptions::default(),
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("loaded whole") && e.contains("whole"), "{e}");
    assert_eq!(mm.ledger(DeviceId::Sim(1)), before);
    assert!(mm.loaded_models().is_empty());
}

#[test]
fn a_reserve_per_device_shapes_budgets_and_placement() {
    // sim:1 keeps 32 MiB in reserve: its budget for weights is half of sim:0's, and a 40 MiB
    // model the manager places goes where it fits with its reserve kept free.
    let mm = manager(&["64MiB", "64MiB"], &["--reserve-vram", "0=0,1=0.03125"]);
    let budgets = mm.device_budgets();
    assert_eq!(
        budgets[0].1,
        ByteSize::mib(64).saturating_sub(ByteSize::kib(1))
    );
    assert_eq!(
        budgets[1].1,
        ByteSize::mib(32).saturating_sub(ByteSize::kib(1))
    );
    let big = sized_model("big", 40 << 20).with_auto_device();
    // Put a small model on sim:0 first: by free memory alone sim:1 would win.
    let small = sized_model("small", 4 << 20);
    mm.load_models_gpu(std::slice::from_ref(&small), LoadOptions::default())
        .unwrap();
    let plan = mm
        .plan(std::slice::from_ref(&big), LoadOptions::default())
        .unwrap();
    assert_eq!(plan.models[0].device, DeviceId::Sim(0), "{plan:#?}");
    assert!(plan.fits());
}

#[test]
fn placement_in_a_plan_is_the_placement_of_the_load() {
    // Found by the model-based test: a plan counted a model nobody holds any more as using its
    // device, the load (which drops such entries first) did not, and they placed differently.
    let mm = manager(&["4MiB", "4MiB"], &[]);
    let a = sized_model("a", 3 << 20).with_auto_device();
    mm.load_models_gpu(std::slice::from_ref(&a), LoadOptions::default())
        .unwrap();
    assert_eq!(a.load_device(), DeviceId::Sim(0));
    drop(a); // only the registry holds it now
    let b = sized_model("b", 3 << 20).with_auto_device();
    let planned = mm
        .plan(std::slice::from_ref(&b), LoadOptions::default())
        .unwrap();
    let loaded = mm
        .load_models_gpu(std::slice::from_ref(&b), LoadOptions::default())
        .unwrap();
    assert_eq!(planned.models[0].device, loaded.models[0].device);
    assert_eq!(b.load_device(), loaded.models[0].device);

    // Two handles of one model in one call load as one; both learn where it went.
    let c = sized_model("c", 1 << 20).with_auto_device();
    let c2 = ModelPatcher::new(Arc::clone(c.model()), DeviceId::Sim(0), DeviceId::Cpu)
        .with_auto_device();
    let r = mm
        .load_models_gpu(&[c.clone(), c2.clone()], LoadOptions::default())
        .unwrap();
    assert_eq!(r.models.len(), 1);
    assert_eq!(c.load_device(), r.models[0].device);
    assert_eq!(c2.load_device(), r.models[0].device);
}

#[test]
fn a_plan_counts_the_prefetches_of_a_model_nobody_holds_as_free_and_the_load_places_alike() {
    // Found by the model-based test (two simulated GPUs, lanes): weights prefetched for a model
    // nobody holds any more stay booked until the load's cleanup drops them and a stream runs
    // their frees. The plan counted them as used, the load saw them booked or back depending on
    // that stream, and the two placed the next model on different devices.
    let mm = manager(&["4MiB@1GB/s", "4MiB@1GB/s"], &["--async-offload", "2"]);
    // 16 weights of 384 KiB (6 MiB) on a 4 MiB device: partly resident, the rest streamed with
    // prefetch.
    let tensors: Vec<(String, Tensor)> = (0..16)
        .map(|i| {
            (
                format!("w{i}"),
                common::rand_tensor(&[96 << 10], i as u64 + 1),
            )
        })
        .collect();
    let a = ModelPatcher::new(
        Arc::new(Model::from_tensors("a", tensors).unwrap()),
        DeviceId::Sim(0),
        DeviceId::Cpu,
    )
    .with_auto_device();
    mm.load_models_gpu(std::slice::from_ref(&a), LoadOptions::default())
        .unwrap();
    assert_eq!(a.load_device(), DeviceId::Sim(0));
    let streamer = residency::offload::streamer_of(&a).expect("a partial load streams");
    let streamed: Vec<usize> = (0..a.model().len())
        .filter(|&i| {
            matches!(
                a.model().residency_of(i),
                Some(residency::weights::SlotResidency::Offloaded)
            )
        })
        .collect();
    assert!(streamed.len() >= 2, "{streamed:?}");
    // Two forwards' uses: then a use of a streamed weight prefetches the streamed weights that
    // follow it (booked on Sim(0)).
    for i in (0..16).chain(0..16) {
        drop(residency::offload::fetch_weight_at(&a, i).unwrap());
    }
    // The bookings of copies used and dropped come back once their frees ran: wait for them
    // (the prefetched weights the streamer holds stay booked).
    let settle = || {
        for sim in mm.transfer_engine().devices().sims() {
            sim.synchronize().unwrap();
        }
    };
    settle();
    drop(residency::offload::fetch_weight_at(&a, streamed[0]).unwrap());
    settle();
    assert!(
        streamer.in_flight_bytes() > ByteSize::ZERO,
        "a fetch prefetches its successor"
    );
    drop(streamer);
    let model = Arc::downgrade(a.model());
    drop(a);
    // Only the registry holds it and its prefetches now, once the lanes let go of the clones
    // their copies hold.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while model.strong_count() > 1 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_micros(200));
    }
    assert_eq!(model.strong_count(), 1);

    let b = sized_model("b", 1 << 20).with_auto_device();
    let planned = mm
        .plan(std::slice::from_ref(&b), LoadOptions::default())
        .unwrap();
    // Everything of a leaves at the load: both devices are empty, ties go to the lowest ordinal.
    assert_eq!(planned.models[0].device, DeviceId::Sim(0), "{planned:#?}");
    let loaded = mm
        .load_models_gpu(std::slice::from_ref(&b), LoadOptions::default())
        .unwrap();
    assert_eq!(loaded.models[0].device, DeviceId::Sim(0));
    assert_eq!(b.load_device(), DeviceId::Sim(0));
    assert_clean(&mm);
}

#[test]
fn a_split_model_s_load_report_shows_its_bytes_per_device() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_model(dir.path());
    let mm = manager(&["16MiB", "16MiB"], &[]);
    let p = patcher(&path, DeviceId::Sim(0))
        .with_device_map(DeviceMap::parse("layers.0.=sim:1").unwrap());
    let report = mm.load_model_gpu(&p).unwrap();
    let load = &report.models[0];
    let on = |d| p.model().resident_bytes(d);
    assert_eq!(
        load.resident_on,
        vec![
            (DeviceId::Sim(0), on(DeviceId::Sim(0))),
            (DeviceId::Sim(1), on(DeviceId::Sim(1)))
        ]
    );
    assert!(on(DeviceId::Sim(1)) > ByteSize::ZERO);
    assert_eq!(
        load.resident_on.iter().map(|(_, b)| *b).sum::<ByteSize>(),
        load.resident
    );
    let text = report.to_string();
    assert!(
        text.contains(&format!("sim:0 {}", on(DeviceId::Sim(0))))
            && text.contains(&format!("sim:1 {}", on(DeviceId::Sim(1)))),
        "{text}"
    );
}
