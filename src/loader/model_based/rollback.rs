//! Rollback scenarios the random cases reach rarely: a fault at every materialization of a
//! load, and a rollback that cannot rebuild.

use super::*;

/// A manager on a `budget_kib` KiB CPU device, no lanes.
fn small_manager(budget_kib: u64) -> MemoryManager {
    let config = Config::from_args([
        "--vram-budget".to_string(),
        format!("{budget_kib}KiB"),
        "--reserve-vram".into(),
        "0".into(),
        "--inference-memory".into(),
        "1KiB".into(),
    ])
    .unwrap();
    MemoryManager::new(config, Hardware::cpu_only(ByteSize::gib(8))).unwrap()
}

pub(super) fn residency_of(model: &Model) -> Residency {
    (0..model.len())
        .map(|i| match model.residency_of(i) {
            Some(SlotResidency::Resident {
                fingerprint,
                device,
                bytes,
                ..
            }) => Some((fingerprint, device, bytes)),
            _ => None,
        })
        .collect()
}

/// The state a failed call must not change: registry order and every model's residency.
fn state(mm: &MemoryManager, models: &[&Arc<Model>]) -> (Vec<u64>, Vec<Residency>, ByteSize) {
    (
        mm.loaded_models().iter().map(|m| m.model_id).collect(),
        models.iter().map(|m| residency_of(m)).collect(),
        mm.ledger(CPU),
    )
}

#[test]
fn a_load_failing_at_every_materialization_is_rolled_back_completely() {
    // z and y are fully resident. Loading a LoRA clone of x together with a LoRA clone of y (whose
    // patched copy is stale, dropped and rebuilt) evicts part of z. Every k from 0 until the load
    // succeeds fails the k-th materialization; each failure must leave registry, residency and
    // ledger exactly as they were, rebuilding what eviction and the clone switch dropped.
    let mm = small_manager(64);
    let x = Arc::new(build_model(0));
    let y = Arc::new(build_model(1));
    let z = Arc::new(build_model(0));
    let px = ModelPatcher::new(Arc::clone(&x), CPU, CPU).with_compute_dtype(Some(Dtype::F32));
    let py = ModelPatcher::new(Arc::clone(&y), CPU, CPU).with_compute_dtype(Some(Dtype::F32));
    let pz = ModelPatcher::new(Arc::clone(&z), CPU, CPU).with_compute_dtype(Some(Dtype::F32));
    mm.load_model_gpu(&pz).unwrap();
    mm.load_model_gpu(&py).unwrap();
    let mut x2 = px.clone();
    x2.add_patches(
        [(
            "l1.weight",
            Patch::Lora(Lora::new(weight(&[48, 2], 1), weight(&[2, 32], 2))),
        )],
        1.0,
        1.0,
    )
    .unwrap();
    let mut y2 = py.clone();
    y2.add_patches(
        [(
            "l0.weight",
            Patch::Lora(Lora::new(weight(&[64, 2], 3), weight(&[2, 32], 4))),
        )],
        1.0,
        1.0,
    )
    .unwrap();
    let models = [&x, &y, &z];
    let before = state(&mm, &models);
    let plan = mm
        .plan(&[x2.clone(), y2.clone()], LoadOptions::default())
        .unwrap();
    assert!(plan.fits());
    assert!(!plan.evictions.is_empty(), "the load evicts: {plan:?}");
    let mut failures = 0;
    for k in 0.. {
        fault::fail_after(k);
        let r = mm.load_models_gpu(&[x2.clone(), y2.clone()], LoadOptions::default());
        fault::disarm();
        match r {
            Err(e) => {
                assert!(
                    !matches!(e, crate::Error::RollbackIncomplete { .. }),
                    "k = {k}: {e}"
                );
                assert_eq!(state(&mm, &models), before, "k = {k}: {e}");
                assert!(mm.peak_ledger(CPU) <= ByteSize::kib(64));
                failures += 1;
            }
            Ok(r) => {
                assert_eq!(r.evicted, plan.evictions);
                break;
            }
        }
    }
    assert!(
        failures >= 3,
        "the load materializes several weights ({failures} failed)"
    );
    // The bits are those of a load that never failed.
    assert_eq!(forward(&x2, 0).unwrap(), reference_forward(&x2, 0));
    assert_eq!(forward(&y2, 1).unwrap(), reference_forward(&y2, 1));
}

#[test]
fn a_rollback_that_cannot_rebuild_says_what_it_lost_and_keeps_the_ledger_exact() {
    let mm = small_manager(40);
    let x = Arc::new(build_model(0));
    let y = Arc::new(build_model(1));
    let px = ModelPatcher::new(Arc::clone(&x), CPU, CPU).with_compute_dtype(Some(Dtype::F32));
    let py = ModelPatcher::new(Arc::clone(&y), CPU, CPU).with_compute_dtype(Some(Dtype::F32));
    mm.load_model_gpu(&py).unwrap();
    let y_before = y.resident_bytes(CPU);
    // The device keeps failing from the second materialization on: x's load fails, and so does
    // rebuilding what evicting y dropped.
    fault::fail_from(1);
    let r = mm.load_model_gpu(&px);
    fault::disarm();
    let Err(crate::Error::RollbackIncomplete {
        source,
        not_restored,
    }) = r
    else {
        panic!("expected an incomplete rollback, got {r:?}");
    };
    assert!(matches!(*source, crate::Error::Device { .. }), "{source}");
    assert!(!not_restored.is_empty());
    assert!(
        not_restored.iter().all(|s| s.contains("`m1`")),
        "{not_restored:?}"
    );
    // x left nothing behind; y is registered with what it kept; the ledger is exact.
    assert_eq!(x.resident_bytes_total(), ByteSize::ZERO);
    assert!(y.resident_bytes(CPU) < y_before);
    let ids: Vec<u64> = mm.loaded_models().iter().map(|m| m.model_id).collect();
    assert_eq!(ids, [y.id()]);
    assert_eq!(mm.ledger(CPU), y.resident_bytes(CPU));
    // What was lost streams, with the same bits.
    assert_eq!(forward(&py, 1).unwrap(), reference_forward(&py, 1));
}
