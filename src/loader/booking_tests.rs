//! The fault-in booking (issue 45): one RAII type carrying its device and bytes, returned on
//! every path that does not commit it, checked against the driver's figure like every other
//! booking; a load onto a device that cannot hold tensors refused at load in both modes; and
//! what a no-op reload costs (it publishes the fingerprints it already has).

use std::sync::Arc;

use super::*;
use crate::error::Error;
use crate::offload::{Keeper, PrefetchGate, Reservation};
use crate::vram::{Config, Hardware};
use crate::weights::Model;

fn manager(flags: &[&str]) -> MemoryManager {
    MemoryManager::new(
        Config::from_args(flags).unwrap(),
        Hardware::cpu_only(ByteSize::gib(8)),
    )
    .unwrap()
}

fn model(name: &str, n: usize) -> Arc<Model> {
    let tensors = (0..n).map(|i| {
        let t = candle_core::Tensor::arange(0f32, 1024.0, &candle_core::Device::Cpu)
            .unwrap()
            .reshape((32, 32))
            .unwrap();
        (format!("layers.{i}.weight"), t)
    });
    Arc::new(Model::from_tensors(name, tensors).unwrap())
}

/// A loaded (registered) dynamic model on `device` and its patcher.
fn loaded(mm: &MemoryManager, device: DeviceId) -> ModelPatcher {
    let p = ModelPatcher::new(model("m", 4), device, DeviceId::Cpu).with_auto_device();
    mm.load_models_gpu(std::slice::from_ref(&p), LoadOptions::default())
        .unwrap();
    p
}

#[test]
fn a_fault_in_booking_is_returned_when_a_panic_unwinds_through_its_fetch() {
    let mm = manager(&["--sim-gpu", "1MiB", "--reserve-vram", "0"]);
    let dev = DeviceId::Sim(0);
    let p = loaded(&mm, dev);
    let keeper: &dyn Keeper = &*mm.dynamic;
    let booking = keeper.book(&p, 0, ByteSize::ZERO).expect("room to keep it");
    assert_eq!(booking.device(), dev);
    assert_eq!(mm.ledger.faulting(dev), ByteSize(4096));
    // A kernel panics between the booking and the commit; the engine's caller catches it.
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
        let _held = booking;
        panic!("a kernel panicked mid-fetch");
    }));
    assert!(caught.is_err());
    assert_eq!(
        mm.ledger.faulting(dev),
        ByteSize::ZERO,
        "the booking came back with the unwinding"
    );
}

#[test]
fn a_booking_commits_only_on_the_device_and_size_it_was_made_for() {
    // A placement moves the model between the booking and the commit: the copy made for the
    // first device is not kept for the second, and the first device's booking comes back.
    let mm = manager(&["--sim-gpus", "2x1MiB", "--reserve-vram", "0"]);
    let (d0, d1) = (DeviceId::Sim(0), DeviceId::Sim(1));
    let p = loaded(&mm, d0);
    assert_eq!(p.weight_device(0), d0);
    let keeper: &dyn Keeper = &*mm.dynamic;
    let booking = keeper.book(&p, 0, ByteSize::ZERO).expect("room to keep it");
    let tensor = p.materialize(0, p.resident_dtype(0), d0).unwrap();
    p.set_auto_device(d1);
    let kept = keeper.commit(
        &p,
        0,
        &tensor,
        crate::device::DeviceHold::default(),
        booking,
    );
    assert!(!kept, "a copy booked on {d0} is not kept for {d1}");
    assert_eq!(mm.ledger.faulting(d0), ByteSize::ZERO);
    assert_eq!(mm.ledger.faulting(d1), ByteSize::ZERO);
    assert_eq!(mm.ledger.resident(d1), ByteSize::ZERO);
    assert!(p.resident_weight(0).is_none());
}

#[test]
fn two_bookings_of_different_kinds_cannot_both_pass_one_driver_figure() {
    // The driver says 6 KiB are free. A fault-in (faulting column) and a prefetch (in flight)
    // of 4 KiB each fit that figure alone; the second must see the first (both count the same
    // columns), or together they ask the driver for 8.
    let ledger = Arc::new(Ledger::default());
    let d = DeviceId::Sim(0);
    ledger.note(d, ByteSize::ZERO, None);
    ledger.set_free_probe(d, Arc::new(|| Some(ByteSize::kib(6))));
    let faults: Arc<dyn PrefetchGate> = Arc::new(ledger::FaultColumn(Arc::clone(&ledger)));
    let prefetch: Arc<dyn PrefetchGate> = ledger.clone();
    let kept = Reservation::take(&faults, d, ByteSize::kib(4), ByteSize::ZERO);
    assert!(kept.is_some());
    assert!(
        Reservation::take(&prefetch, d, ByteSize::kib(4), ByteSize::ZERO).is_none(),
        "the prefetch sees the fault-in's booking"
    );
    drop(kept);
    let prefetched = Reservation::take(&prefetch, d, ByteSize::kib(4), ByteSize::ZERO);
    assert!(prefetched.is_some());
    assert!(
        Reservation::take(&faults, d, ByteSize::kib(4), ByteSize::ZERO).is_none(),
        "the fault-in sees the prefetch's booking"
    );
    assert!(!ledger.probe_allows(d, ByteSize::kib(4), ByteSize::ZERO));
    assert!(ledger.probe_allows(d, ByteSize::kib(2), ByteSize::ZERO));
}

#[test]
fn a_load_onto_a_device_that_cannot_hold_tensors_is_refused_at_load_in_both_modes() {
    if cfg!(feature = "cuda") {
        return; // the build can hold CUDA tensors: nothing to refuse here
    }
    for mode in ["--enable-dynamic-vram", "--disable-dynamic-vram"] {
        let hw = Hardware::with_gpu(crate::vram::GpuInfo::nvidia(
            0,
            "NVIDIA H100",
            ByteSize::gib(80),
            (9, 0),
        ));
        let mm = MemoryManager::new(Config::from_args([mode]).unwrap(), hw).unwrap();
        let p = ModelPatcher::new(model("m", 2), DeviceId::Cuda(0), DeviceId::Cpu);
        let err = mm
            .load_models_gpu(std::slice::from_ref(&p), LoadOptions::default())
            .unwrap_err();
        assert!(matches!(err, Error::Device { .. }), "{mode}: {err}");
        assert!(err.to_string().contains("cuda"), "{mode}: {err}");
        assert!(mm.loaded_models().is_empty(), "{mode}: nothing registered");
    }
}

#[test]
fn a_load_refused_for_room_names_the_copies_in_flight_that_hold_it() {
    // A newcomer read "X required, Y available" with no word of the copies in flight that
    // held the difference (issue 47).
    let mm = manager(&[
        "--sim-gpu",
        "16KiB",
        "--reserve-vram",
        "0",
        "--inference-memory",
        "1KiB",
    ]);
    let dev = DeviceId::Sim(0);
    let gate: Arc<dyn PrefetchGate> = mm.ledger.clone();
    let copy =
        Reservation::take(&gate, dev, ByteSize::kib(8), ByteSize::ZERO).expect("room for the copy");
    let p = ModelPatcher::new(model("m", 3), dev, DeviceId::Cpu);
    let options = LoadOptions {
        force_full_load: true,
        ..LoadOptions::default()
    };
    let e = mm
        .load_models_gpu(std::slice::from_ref(&p), options)
        .unwrap_err();
    assert!(e.to_string().contains("copies in flight (8.00 KiB)"), "{e}");
    // Once the copy is done, the same load fits.
    drop(copy);
    mm.load_models_gpu(std::slice::from_ref(&p), options)
        .unwrap();
}

#[test]
fn a_no_op_reload_by_a_fresh_handle_publishes_the_fingerprints_already_computed() {
    // An engine reloads before every step, often through a fresh clone of its patcher (whose
    // fingerprint cache is empty): the reload decides nothing, so it must not hash every weight
    // again to publish the registry's view (2.7 µs → 0.8 µs for 500 weights, release).
    let mm = manager(&["--sim-gpu", "4GiB", "--reserve-vram", "0", "--highvram"]);
    let p = ModelPatcher::new(model("m", 4), DeviceId::Sim(0), DeviceId::Cpu);
    mm.load_models_gpu(std::slice::from_ref(&p), LoadOptions::default())
        .unwrap();
    let published = || Arc::clone(&mm.view.lock()[0].fingerprints);
    let before = published();
    let fresh = p.clone().with_dora_norm(p.options().dora); // same signature, empty cache
    let report = mm
        .load_models_gpu(std::slice::from_ref(&fresh), LoadOptions::default())
        .unwrap();
    assert_eq!(report.models[0].built, ByteSize::ZERO, "a no-op reload");
    assert!(
        Arc::ptr_eq(&before, &published()),
        "the view's fingerprints were computed again"
    );
    // A handle with another signature is not handed them: its reload plans afresh.
    let other = p.clone().with_compute_dtype(Some(crate::Dtype::F16));
    mm.load_models_gpu(std::slice::from_ref(&other), LoadOptions::default())
        .unwrap();
    assert!(!Arc::ptr_eq(&before, &published()));
    assert_ne!(
        before[0],
        published()[0],
        "f16 copies have another fingerprint"
    );
}
