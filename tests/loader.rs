//! The memory manager on a budgeted simulated device with real tensors: budgets, eviction,
//! registry order, failures, and the invariants I1, I2 and I4 under random sequences and threads.

mod common;

use std::sync::Arc;

use common::*;
use proptest::prelude::*;
use residency::float::Dtype;
use residency::loader::{weight_budget, LoadOptions, MemoryManager};
use residency::patcher::{ModelPatcher, Patch};
use residency::vram::DeviceId;
use residency::{ByteSize, Error};

const CPU: DeviceId = DeviceId::Cpu;
const MIN_INF: f64 = 1278423859.2;
const RESERVE: f64 = 400.0 * MIB as f64;

fn mem_req(required: u64) -> f64 {
    MIN_INF.max(required as f64 + RESERVE)
}

#[test]
fn weight_budget_formula_facts() {
    // free 10 GiB, nothing loaded, memory_required 2 GiB, NVIDIA ratio 0.
    let extra = mem_req(2 * GIB);
    assert_eq!(extra, 2566914048.0);
    assert_eq!(
        weight_budget(ByteSize::gib(10), ByteSize::ZERO, extra, MIN_INF, 0.0),
        ByteSize(8170504192)
    );
    // ratio 0.4: free 4 GiB, memory_required 6 GiB.
    assert_eq!(
        weight_budget(
            ByteSize::gib(4),
            ByteSize::ZERO,
            mem_req(6 * GIB),
            MIN_INF,
            0.4
        ),
        ByteSize(1717986918)
    );
    // free 1 GiB, memory_required 0: the 128 MiB floor.
    assert_eq!(
        weight_budget(ByteSize::gib(1), ByteSize::ZERO, mem_req(0), MIN_INF, 0.0),
        ByteSize(134217728)
    );
    // ... but never more than the device's free memory.
    assert_eq!(
        weight_budget(ByteSize::mib(24), ByteSize::ZERO, mem_req(0), MIN_INF, 0.0),
        ByteSize::mib(24)
    );
    // already loaded 2 GiB, free 3 GiB, memory_required 1 GiB.
    assert_eq!(
        weight_budget(
            ByteSize::gib(3),
            ByteSize::gib(2),
            mem_req(GIB),
            MIN_INF,
            0.0
        ),
        ByteSize(1728053248)
    );
}

#[test]
fn registry_is_most_recently_used_first_without_duplicates() {
    let mm = manager(ByteSize::gib(24), &[]);
    let a = cpu_patcher(virtual_model("A", &[GIB]));
    let b = cpu_patcher(virtual_model("B", &[GIB]));
    let names = |mm: &MemoryManager| {
        mm.loaded_models()
            .iter()
            .map(|m| m.name.clone())
            .collect::<Vec<_>>()
    };
    mm.load_model_gpu(&a).unwrap();
    assert_eq!(names(&mm), ["A"]);
    mm.load_model_gpu(&b).unwrap();
    assert_eq!(names(&mm), ["B", "A"]);
    let r = mm.load_model_gpu(&a).unwrap();
    assert_eq!(names(&mm), ["A", "B"]);
    assert_eq!(
        r.built(),
        ByteSize::ZERO,
        "re-loading a fully loaded model moves nothing"
    );
}

#[test]
fn a_model_whose_handles_are_all_dropped_is_freed_by_the_next_load_even_a_no_op() {
    let mm = manager(ByteSize::gib(24), &[]);
    let a = cpu_patcher(virtual_model("A", &[GIB]));
    let b = cpu_patcher(virtual_model("B", &[GIB]));
    mm.load_model_gpu(&a).unwrap();
    mm.load_model_gpu(&b).unwrap();
    let gone = Arc::downgrade(b.model());
    drop(b);
    // Reloading A changes nothing (a no-op reload), but it drops B's entry: B's memory must go
    // with it, not wait for the next load that moves something.
    let r = mm.load_model_gpu(&a).unwrap();
    assert_eq!(r.built(), ByteSize::ZERO);
    assert_eq!(mm.loaded_models().len(), 1);
    assert!(gone.upgrade().is_none(), "B is still alive");
}

#[test]
fn big_device_loads_second_model_without_touching_the_first() {
    let mm = manager(ByteSize::gib(24), &[]);
    let a = cpu_patcher(virtual_model("A", &[3 * GIB, 3 * GIB]));
    let b = cpu_patcher(virtual_model("B", &[GIB; 5]));
    mm.load_model_gpu(&a).unwrap();
    assert_eq!(a.loaded_size(), ByteSize::gib(6));
    let r = mm.load_model_gpu(&b).unwrap();
    assert!(r.evicted.is_empty(), "{r}");
    assert_eq!(a.loaded_size(), ByteSize::gib(6));
    assert_eq!(b.loaded_size(), ByteSize::gib(5));
    assert_eq!(mm.ledger(CPU), ByteSize::gib(11));
}

#[test]
fn smart_memory_unloads_exactly_what_is_missing() {
    let mm = manager(ByteSize::gib(12), &[]);
    let a = cpu_patcher(virtual_model("A", &[GIB; 6]));
    let b = cpu_patcher(virtual_model("B", &[GIB; 5]));
    let r = mm.load_model_gpu(&a).unwrap();
    assert!(r.models[0].full);
    let r = mm.load_model_gpu(&b).unwrap();
    assert_eq!(r.evicted.len(), 1, "{r}");
    assert_eq!(r.evicted[0].name, "A");
    assert_eq!(r.evicted[0].freed, ByteSize::gib(1));
    assert!(!r.evicted[0].fully);
    assert_eq!(a.loaded_size(), ByteSize::gib(5));
    assert!(r.models[0].full, "{r}");
    let names: Vec<String> = mm.loaded_models().iter().map(|m| m.name.clone()).collect();
    assert_eq!(names, ["B", "A"]);
    assert!(mm.ledger(CPU) <= ByteSize::gib(12));
}

#[test]
fn large_request_fully_detaches_and_removes() {
    let mm = manager(ByteSize::gib(3), &[]);
    let a = cpu_patcher(virtual_model("A", &[GIB, GIB]));
    mm.load_models_gpu(
        std::slice::from_ref(&a),
        LoadOptions::default().with_force_full_load(true),
    )
    .unwrap();
    assert_eq!(mm.get_free_memory(CPU), ByteSize::gib(1));
    let ev = mm.free_memory(ByteSize::gib(8), CPU, &[]);
    assert_eq!(ev.len(), 1);
    assert!(ev[0].fully);
    assert_eq!(a.loaded_size(), ByteSize::ZERO);
    assert!(mm.loaded_models().is_empty());
}

#[test]
fn eviction_order_offloaded_then_handles_then_size_then_recency() {
    let mm = manager(ByteSize::gib(64), &[]);
    // P: partially loaded (has offloaded bytes) -> first.
    let mut p = cpu_patcher(virtual_model("P", &[2 * GIB, 2 * GIB]));
    // Q, R: fully loaded, same size; Q is held only by the registry once we drop our clone... we
    // keep an extra handle on R so Q goes before R.
    let q = cpu_patcher(virtual_model("Q", &[GIB]));
    let r = cpu_patcher(virtual_model("R", &[GIB]));
    let r_extra = r.clone();
    // S, T: fully loaded, one handle each; S is smaller -> S before T.
    let s = cpu_patcher(virtual_model("S", &[GIB / 2]));
    let t = cpu_patcher(virtual_model("T", &[GIB]));
    for m in [&q, &r, &s, &t] {
        mm.load_model_gpu(m).unwrap();
    }
    p.load(CPU, ByteSize::gib(3), false, false).unwrap();
    mm.load_models_gpu(std::slice::from_ref(&p), LoadOptions::default())
        .unwrap_or_default();
    // Force the partial state again (the manager may have loaded more of P).
    p.partially_unload(CPU, ByteSize::gib(1));
    assert!(p.loaded_size() < p.model_size());
    let ev = mm.free_memory(ByteSize::gib(64), CPU, &[]);
    let order: Vec<&str> = ev.iter().map(|e| e.name.as_str()).collect();
    // Then fewest outside handles (R has two, so it goes last); among one-handle models the
    // smallest (S); Q and T tie on size, and T, used more recently, goes first.
    assert_eq!(order[0], "P");
    assert_eq!(&order[1..], ["S", "T", "Q", "R"]);
    drop(r_extra);
}

#[test]
fn eviction_stops_as_soon_as_enough_is_free() {
    let mm = manager(ByteSize::gib(10), &["--reserve-vram", "0"]);
    let a = cpu_patcher(virtual_model("A", &[GIB; 3]));
    let b = cpu_patcher(virtual_model("B", &[GIB; 3]));
    mm.load_model_gpu(&a).unwrap();
    mm.load_model_gpu(&b).unwrap();
    // 4 GiB free; ask for 5: only one model gives up weights.
    let ev = mm.free_memory(ByteSize::gib(5), CPU, &[]);
    assert_eq!(ev.len(), 1, "{ev:?}");
    assert!(mm.get_free_memory(CPU) > ByteSize::gib(5));
}

#[test]
fn disabled_smart_memory_unloads_every_other_model_fully() {
    let mm = manager(ByteSize::gib(24), &["--disable-smart-memory"]);
    let a = cpu_patcher(virtual_model("A", &[GIB; 6]));
    let b = cpu_patcher(virtual_model("B", &[GIB; 2]));
    let c = cpu_patcher(virtual_model("C", &[GIB; 2]));
    mm.load_model_gpu(&a).unwrap();
    // Plenty of room, yet loading B unloads A completely.
    let r = mm.load_model_gpu(&b).unwrap();
    assert_eq!(r.evicted.len(), 1, "{r}");
    assert!(r.evicted[0].fully && r.evicted[0].name == "A");
    assert_eq!(a.loaded_size(), ByteSize::ZERO);
    assert_eq!(b.loaded_size(), ByteSize::gib(2));
    mm.load_model_gpu(&c).unwrap();
    assert_eq!(
        b.loaded_size(),
        ByteSize::ZERO,
        "B was fully unloaded to load C"
    );
}

#[test]
fn unload_all_leaves_nothing_resident_and_clean_bits_intact() {
    let dir = tempfile::tempdir().unwrap();
    let mm = manager(ByteSize::gib(2), &["--reserve-vram", "0"]);
    let mut a = cpu_patcher(small_model_file(dir.path(), "A", Dtype::BF16))
        .with_compute_dtype(Some(Dtype::F32));
    let before = a.model().clean_checksum().unwrap();
    a.add_patches(
        [(
            "blocks.0.attn.q.weight",
            Patch::Diff {
                diff: rand_tensor(&[16, 16], 3),
                pad: false,
            },
        )],
        1.0,
        1.0,
    )
    .unwrap();
    mm.load_model_gpu(&a).unwrap();
    assert!(a.loaded_size() > ByteSize::ZERO);
    assert_eq!(mm.unload_all_models(), 1);
    assert_eq!(a.model().resident_bytes_total(), ByteSize::ZERO);
    assert_eq!(mm.ledger(CPU), ByteSize::ZERO);
    assert_eq!(a.model().clean_checksum().unwrap(), before);
}

#[test]
fn loading_a_clone_replaces_the_registered_entry() {
    let mm = manager(ByteSize::gib(24), &[]);
    let a = cpu_patcher(virtual_model("A", &[GIB, GIB]));
    mm.load_model_gpu(&a).unwrap();
    let b = a.clone();
    mm.load_model_gpu(&b).unwrap();
    let loaded = mm.loaded_models();
    assert_eq!(loaded.len(), 1);
    assert_eq!(mm.ledger(CPU), ByteSize::gib(2));
}

#[test]
fn dropped_models_return_their_bytes_at_the_next_call() {
    let mm = manager(ByteSize::gib(8), &[]);
    let a = cpu_patcher(virtual_model("A", &[GIB, GIB]));
    mm.load_model_gpu(&a).unwrap();
    assert_eq!(mm.ledger(CPU), ByteSize::gib(2));
    drop(a);
    mm.cleanup_models();
    assert_eq!(mm.ledger(CPU), ByteSize::ZERO);
    assert!(mm.loaded_models().is_empty());
}

#[test]
fn a_load_that_can_never_fit_fails_before_evicting_anything() {
    let mm = manager(ByteSize::gib(4), &["--highvram"]);
    let a = cpu_patcher(virtual_model("A", &[GIB, GIB]));
    mm.load_model_gpu(&a).unwrap();
    let big = cpu_patcher(virtual_model("big", &[3 * GIB, 2 * GIB]));
    let err = mm.load_model_gpu(&big).unwrap_err();
    match &err {
        Error::BudgetExceeded {
            model,
            required,
            budget,
            ..
        } => {
            assert_eq!(model, "big");
            assert_eq!(*required, ByteSize::gib(5));
            assert_eq!(*budget, ByteSize::gib(4));
        }
        other => panic!("{other:?}"),
    }
    assert!(!err.is_retryable());
    assert_eq!(a.loaded_size(), ByteSize::gib(2));
    assert_eq!(mm.ledger(CPU), ByteSize::gib(2));
    assert_eq!(mm.loaded_models().len(), 1);
}

#[test]
fn novram_keeps_nothing_resident_and_highvram_everything() {
    let mm = manager(ByteSize::gib(8), &["--novram"]);
    let a = cpu_patcher(virtual_model("A", &[GIB, GIB]));
    let r = mm.load_model_gpu(&a).unwrap();
    assert_eq!(r.models[0].resident, ByteSize::ZERO);
    assert_eq!(r.models[0].streaming, ByteSize::gib(2));
    let mm = manager(ByteSize::gib(8), &["--highvram"]);
    let r = mm.load_model_gpu(&a).unwrap();
    assert!(r.models[0].full);
}

#[test]
fn memory_report_shows_budget_and_models() {
    let mm = manager(ByteSize::gib(8), &[]);
    let a = cpu_patcher(virtual_model("A", &[GIB, GIB]));
    mm.load_model_gpu(&a).unwrap();
    let text = mm.memory_report().to_string();
    assert!(
        text.contains("cpu: budget 8.00 GiB, 2.00 GiB used"),
        "{text}"
    );
    assert!(text.contains("A"), "{text}");
}

#[test]
fn concurrent_clones_patches_loads_and_reads_keep_invariants() {
    let dir = tempfile::tempdir().unwrap();
    let mm = Arc::new(manager(ByteSize::mib(1), &["--reserve-vram", "0"]));
    let base = cpu_patcher(small_model_file(dir.path(), "m", Dtype::BF16))
        .with_compute_dtype(Some(Dtype::F32));
    let before = base.model().clean_checksum().unwrap();
    let keys: Vec<String> = base.model().keys().map(str::to_string).collect();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    let handles: Vec<_> = (0..8)
        .map(|t| {
            let mm = Arc::clone(&mm);
            let base = base.clone();
            let keys = keys.clone();
            std::thread::spawn(move || {
                let mut n = 0u64;
                while std::time::Instant::now() < deadline {
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
                    let (w, _) = c.fetch(key).unwrap();
                    let expect = c
                        .materialize(c.model().index_of(key).unwrap(), Dtype::F32, DeviceId::Cpu)
                        .unwrap();
                    assert_eq!(f32s(&w), f32s(&expect));
                    assert!(mm.ledger(CPU) <= ByteSize::mib(1));
                    n += 1;
                }
                n
            })
        })
        .collect();
    let total: u64 = handles.into_iter().map(|h| h.join().unwrap()).sum();
    assert!(total > 8, "threads made progress: {total}");
    assert_eq!(base.model().clean_checksum().unwrap(), before);
    assert!(mm.peak_ledger(CPU) <= ByteSize::mib(1));
}

#[derive(Debug, Clone)]
enum Op {
    Load(usize, u64),
    ClonePatch(usize, u64),
    LoadClone(usize),
    UnloadAll,
    Drop(usize),
    PartialUnload(usize, u64),
    FreeMemory(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0..3usize, 0..64u64).prop_map(|(m, r)| Op::Load(m, r)),
        (0..3usize, any::<u64>()).prop_map(|(m, s)| Op::ClonePatch(m, s)),
        (0..3usize).prop_map(Op::LoadClone),
        Just(Op::UnloadAll),
        (0..3usize).prop_map(Op::Drop),
        (0..3usize, 0..40_000u64).prop_map(|(m, b)| Op::PartialUnload(m, b)),
        (0..64u64).prop_map(Op::FreeMemory),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// I1, I2 and I4 after every step of random load / clone+patch / unload / drop sequences over
    /// three models on a tight budget.
    #[test]
    fn ledger_is_exact_bounded_and_clean_weights_never_change(ops in proptest::collection::vec(op(), 1..20)) {
        let dir = tempfile::tempdir().unwrap();
        let budget = ByteSize::kib(12);
        let mm = manager(budget, &["--reserve-vram", "0"]);
        let mut bases: Vec<ModelPatcher> = (0..3)
            .map(|i| cpu_patcher(small_model_file(dir.path(), &format!("m{i}"), Dtype::BF16)).with_compute_dtype(Some(Dtype::F32)))
            .collect();
        let models: Vec<_> = bases.iter().map(|b| b.model().clone()).collect();
        let sums: Vec<u64> = models.iter().map(|m| m.clean_checksum().unwrap()).collect();
        let mut clones: Vec<Option<ModelPatcher>> = vec![None, None, None];
        for op in ops {
            let ledger_before = mm.ledger(DeviceId::Cpu);
            match op {
                Op::Load(m, r) => {
                    let opts = LoadOptions::default().with_memory_required(ByteSize::kib(r / 8));
                    mm.load_models_gpu(std::slice::from_ref(&bases[m]), opts).unwrap();
                }
                Op::ClonePatch(m, seed) => {
                    let mut c = bases[m].clone();
                    let key = "blocks.0.attn.q.weight";
                    c.add_patches([(key, Patch::Diff { diff: rand_tensor(&[16, 16], seed), pad: false })], 1.0, 1.0).unwrap();
                    // A malformed patch must change nothing (I4).
                    let bad = c.add_patches([(key, Patch::Diff { diff: rand_tensor(&[3, 16], seed), pad: false })], 1.0, 1.0);
                    prop_assert!(bad.is_err());
                    prop_assert_eq!(c.patches().get(key).len(), 1);
                    clones[m] = Some(c);
                }
                Op::LoadClone(m) => {
                    if let Some(c) = &clones[m] {
                        mm.load_model_gpu(c).unwrap();
                    }
                }
                Op::UnloadAll => { mm.unload_all_models(); }
                Op::Drop(m) => { clones[m] = None; }
                Op::PartialUnload(m, b) => { bases[m].partially_unload(DeviceId::Cpu, ByteSize(b)); }
                Op::FreeMemory(k) => { mm.free_memory(ByteSize::kib(k), DeviceId::Cpu, &[]); }
            }
            let _ = ledger_before;
            // I2: the ledger equals the sum of resident bytes of registered models and stays in budget.
            let registered: ByteSize = mm.loaded_models().iter().map(|m| m.resident).sum();
            prop_assert_eq!(mm.ledger(DeviceId::Cpu), registered);
            prop_assert!(mm.ledger(DeviceId::Cpu) <= budget);
            // I1
            for (m, s) in models.iter().zip(&sums) {
                prop_assert_eq!(m.clean_checksum().unwrap(), *s);
            }
        }
        bases.clear();
    }
}

/// `loaded_models` read a model's residency twice under one guard (`state().devices()` kept its
/// read while `resident_bytes` took a second): with a load's write queued between the two, every
/// thread deadlocked. The lock checker (on in every test build) refuses the second read at once,
/// so this fails deterministically without the fix, writer or not.
#[test]
fn reports_read_each_model_s_residency_once() {
    let dir = tempfile::tempdir().unwrap();
    let mm = manager(ByteSize::mib(1), &["--reserve-vram", "0"]);
    let p = cpu_patcher(small_model_file(dir.path(), "m", Dtype::BF16));
    mm.load_models_gpu(std::slice::from_ref(&p), LoadOptions::default())
        .unwrap();
    let models = mm.loaded_models();
    assert_eq!(models.len(), 1);
    assert_eq!(models[0].resident, p.model().resident_bytes(CPU));
    assert!(mm.memory_report().to_string().contains('m'));
}
