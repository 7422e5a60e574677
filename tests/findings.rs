//! What a careful read of the memory manager and the GPU path found, each as the scenario that
//! showed it: every test here failed before its fix.

mod common;

use std::sync::Arc;
use std::time::Duration;

use candle_core::Tensor;
use residency::loader::{LoadOptions, MemoryManager};
use residency::patcher::ModelPatcher;
use residency::vram::{Config, DeviceId, Hardware};
use residency::weights::Model;
use residency::{ByteSize, Error};

const SIM0: DeviceId = DeviceId::Sim(0);

fn manager_with(flags: &[&str]) -> MemoryManager {
    MemoryManager::new(
        Config::from_args(flags).unwrap(),
        Hardware::cpu_only(ByteSize::gib(64)),
    )
    .unwrap()
}

/// A model of `n` f32 weights of 16 KiB each, used in order.
fn layers(name: &str, n: usize) -> Arc<Model> {
    let tensors = (0..n).map(|i| {
        (
            format!("layers.{i}.weight"),
            common::rand_tensor(&[64, 64], i as u64 + 1),
        )
    });
    Arc::new(Model::from_tensors(name, tensors).unwrap())
}

/// A forward: every weight fetched in order through the transfer path.
fn forward(p: &ModelPatcher) {
    for i in 0..p.model().len() {
        let key = format!("layers.{i}.weight");
        let (w, _): (Tensor, bool) = residency::offload::fetch_weight(p, &key).unwrap();
        assert_eq!(w.dims(), &[64, 64]);
    }
}

/// Bytes booked in flight on `device`: the ledger less everything else it counts.
fn in_flight(mm: &MemoryManager, p: &ModelPatcher, device: DeviceId) -> ByteSize {
    let report = mm.memory_report();
    let d = report.devices.iter().find(|d| d.device == device).unwrap();
    mm.ledger(device)
        .saturating_sub(p.model().resident_bytes(device))
        .saturating_sub(d.reserved)
        .saturating_sub(d.cached_casts)
}

#[test]
fn a_reservation_takes_unused_prefetches_before_any_model() {
    // A KV cache was refused ("available 0") — or a model evicted for it — while bytes of
    // speculative prefetch nobody had used yet were booked on the device.
    let mm = manager_with(&[
        "--vram-budget",
        "96KiB",
        "--reserve-vram",
        "0",
        "--async-offload",
        "2",
    ]);
    let p = ModelPatcher::new(layers("m", 8), DeviceId::Cpu, DeviceId::Cpu);
    let report = mm
        .load_models_gpu(std::slice::from_ref(&p), LoadOptions::default())
        .unwrap();
    assert!(!report.models[0].full);
    forward(&p); // records the order
    forward(&p); // prefetches along it, the next step's first weights at the end
    let booked = in_flight(&mm, &p, DeviceId::Cpu);
    assert!(booked > ByteSize::ZERO, "prefetches are booked");
    // The report shows what holds the room: the prefetches in flight.
    let report = mm.memory_report();
    let cpu = &report.devices[0];
    assert_eq!(
        (cpu.device, cpu.in_flight),
        (DeviceId::Cpu, booked),
        "{report}"
    );
    assert!(
        report.to_string().contains(&format!("{booked} in flight")),
        "{report}"
    );
    let resident = p.model().resident_bytes(DeviceId::Cpu);
    let free = mm.get_free_memory(DeviceId::Cpu);
    let kv = mm
        .reserve_named("kv-cache", DeviceId::Cpu, free.saturating_add(booked))
        .expect("the unused prefetches make the room");
    assert_eq!(
        p.model().resident_bytes(DeviceId::Cpu),
        resident,
        "no model gave anything up while prefetches could"
    );
    assert!(mm.ledger(DeviceId::Cpu) <= ByteSize::kib(96));
    drop(kv);
}

#[test]
fn a_report_agrees_with_the_ledger_after_a_patcher_s_own_partial_unload() {
    let mm = manager_with(&["--vram-budget", "1MiB", "--reserve-vram", "0"]);
    let p = ModelPatcher::new(layers("m", 4), DeviceId::Cpu, DeviceId::Cpu);
    mm.load_models_gpu(std::slice::from_ref(&p), LoadOptions::default())
        .unwrap();
    let freed = p.partially_unload(DeviceId::Cpu, ByteSize::kib(16));
    assert!(freed >= ByteSize::kib(16));
    let report = mm.memory_report();
    let cpu = report
        .devices
        .iter()
        .find(|d| d.device == DeviceId::Cpu)
        .unwrap();
    assert_eq!(cpu.ledger, mm.ledger(DeviceId::Cpu), "{report}");
    assert_eq!(cpu.ledger, ByteSize::kib(64).saturating_sub(freed));
}

#[test]
fn a_dropped_prefetch_keeps_its_booking_until_the_device_has_the_memory_back() {
    // A prefetch dropped with its copy still queued returned its booking at once; the device
    // frees the buffer only in stream order, after the copy, so a load could book memory the
    // device still held. The simulated GPU counts every buffer until its free executes.
    let mm = manager_with(&["--sim-gpu", "96KiB@2MB/s", "--reserve-vram", "0"]);
    let p = ModelPatcher::new(layers("m", 8), SIM0, DeviceId::Cpu);
    mm.load_models_gpu(std::slice::from_ref(&p), LoadOptions::default())
        .unwrap();
    forward(&p);
    forward(&p);
    let sim = Arc::clone(&mm.transfer_engine().devices().sims()[0]);
    let queued = in_flight(&mm, &p, SIM0);
    assert!(queued > ByteSize::ZERO, "prefetches queued at 8 ms a copy");
    mm.cleanup_models(); // drops the streamer's prefetches
    assert!(
        sim.used() <= mm.ledger(SIM0),
        "device holds {} but the ledger says {}",
        sim.used(),
        mm.ledger(SIM0)
    );
    // Once the copies and frees ran, both come back down together (the bookings return from
    // the frees' completions: waited for, not slept on).
    sim.synchronize().unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while in_flight(&mm, &p, SIM0) > ByteSize::ZERO && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(in_flight(&mm, &p, SIM0), ByteSize::ZERO);
    assert!(sim.used() <= mm.ledger(SIM0));
    assert!(sim.check().is_ok(), "{:?}", sim.check());
}

#[test]
fn a_resident_copy_counts_on_the_simulated_gpu_until_it_is_evicted() {
    // The sim's capacity counted only buffers in transit: a resident weight left its books
    // when handed to compute, so a ledger that forgot one could never run the sim out.
    // A classic load makes them resident at once.
    let mm = manager_with(&[
        "--sim-gpu",
        "1MiB",
        "--reserve-vram",
        "0",
        "--disable-dynamic-vram",
    ]);
    let p = ModelPatcher::new(layers("m", 4), SIM0, DeviceId::Cpu);
    mm.load_models_gpu(std::slice::from_ref(&p), LoadOptions::default())
        .unwrap();
    let sim = Arc::clone(&mm.transfer_engine().devices().sims()[0]);
    sim.synchronize().unwrap();
    assert_eq!(sim.used(), ByteSize::kib(64), "four resident 16 KiB copies");
    assert_eq!(sim.used(), mm.ledger(SIM0));
    mm.unload_all_models();
    sim.synchronize().unwrap();
    assert_eq!(sim.used(), ByteSize::ZERO);
    assert!(sim.leaks().is_empty(), "{:?}", sim.leaks());
}

#[test]
fn keep_waits_for_a_load_in_progress() {
    // `keep()` took no manager lock: a load planned before it could evict the model after
    // `keep` returned. Now it returns only once the load in progress is done.
    // A classic load: it copies, under the manager lock.
    let mm = Arc::new(manager_with(&[
        "--sim-gpu",
        "1MiB@1MB/s",
        "--reserve-vram",
        "0",
        "--disable-dynamic-vram",
    ]));
    let slow = ModelPatcher::new(layers("slow", 8), SIM0, DeviceId::Cpu);
    let other = ModelPatcher::new(layers("other", 1), SIM0, DeviceId::Cpu);
    let loading = {
        let mm = Arc::clone(&mm);
        let slow = slow.clone();
        std::thread::spawn(move || {
            mm.load_models_gpu(std::slice::from_ref(&slow), LoadOptions::default())
                .unwrap()
        })
    };
    std::thread::sleep(Duration::from_millis(30)); // 8 copies of 16 ms each are under way
    let guard = mm.keep(&other);
    assert_eq!(
        slow.model().resident_bytes(SIM0),
        ByteSize::kib(128),
        "keep returned only after the load in progress finished"
    );
    loading.join().unwrap();
    drop(guard);
}

#[test]
fn retry_on_oom_makes_room_on_the_device_the_error_names() {
    let mm = manager_with(&[
        "--sim-gpus",
        "2x1MiB",
        "--reserve-vram",
        "0",
        "--disable-dynamic-vram",
    ]);
    let on_1 = ModelPatcher::new(layers("on-1", 4), DeviceId::Sim(1), DeviceId::Cpu);
    mm.load_models_gpu(std::slice::from_ref(&on_1), LoadOptions::default())
        .unwrap();
    assert_eq!(
        on_1.model().resident_bytes(DeviceId::Sim(1)),
        ByteSize::kib(64)
    );
    let mut tries = 0;
    let r = mm.retry_on_oom(SIM0, &[], || {
        tries += 1;
        if tries == 1 {
            return Err(Error::OutOfMemory {
                model: "a decode step".into(),
                device: "sim:1".into(),
                required: ByteSize::mib(1),
                available: ByteSize::ZERO,
            });
        }
        Ok(tries)
    });
    assert_eq!(r.unwrap(), 2);
    assert_eq!(
        on_1.model().resident_bytes(DeviceId::Sim(1)),
        ByteSize::ZERO,
        "room was made on sim:1, where the step ran out, not on the `device` argument"
    );
}

#[test]
fn a_miss_takes_another_model_s_unused_prefetches() {
    // A forward of one model prefetches the next forward's first weights at its end; they
    // held the room a forward of another model on the same small device needed, and its miss
    // failed out of memory (only its own model's prefetches were cancelled for it). The
    // model-based test's races found it on a 12 KiB simulated GPU.
    let config = Config::from_args([
        "--sim-gpu",
        "40KiB",
        "--reserve-vram",
        "0",
        "--inference-memory",
        "1KiB",
        "--async-offload",
        "2",
        "--disable-dynamic-vram",
    ])
    .unwrap()
    .with_prefetch_depth(6);
    let mm = MemoryManager::new(config, Hardware::cpu_only(ByteSize::gib(64))).unwrap();
    let small = (0..16).map(|i| {
        (
            format!("layers.{i}.weight"),
            common::rand_tensor(&[32, 32], i as u64 + 1),
        )
    });
    let a = ModelPatcher::new(
        Arc::new(Model::from_tensors("a", small).unwrap()),
        SIM0,
        DeviceId::Cpu,
    );
    let big = [(
        "layers.0.weight".to_string(),
        common::rand_tensor(&[96, 64], 9),
    )];
    let b = ModelPatcher::new(
        Arc::new(Model::from_tensors("b", big).unwrap()),
        SIM0,
        DeviceId::Cpu,
    );
    mm.load_models_gpu(&[a.clone(), b.clone()], LoadOptions::default())
        .unwrap();
    let fetch = |p: &ModelPatcher| {
        for i in 0..p.model().len() {
            let key = format!("layers.{i}.weight");
            residency::offload::fetch_weight(p, &key)?;
        }
        Ok::<(), Error>(())
    };
    fetch(&a).unwrap();
    fetch(&a).unwrap();
    let sim = Arc::clone(&mm.transfer_engine().devices().sims()[0]);
    // The prefetches a's lanes may still have queued are on the device once booked and
    // allocated (waited for, bounded: busy threads can hold a lane back).
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while sim.used() < mm.ledger(SIM0) && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    sim.synchronize().unwrap();
    let held = in_flight(&mm, &a, SIM0);
    let booked = mm.ledger(SIM0);
    // b's 24 KiB weight fits beside what a holds only without a's prefetches.
    let weight = ByteSize::kib(24);
    assert!(
        booked.saturating_add(weight) > ByteSize::kib(40)
            && booked.saturating_sub(held).saturating_add(weight) <= ByteSize::kib(40),
        "a's prefetches ({held} of {booked} booked) hold the room b's weight needs"
    );
    fetch(&b).expect("b's miss takes a's unused prefetches");
    assert!(sim.check().is_ok(), "{:?}", sim.check());
}
