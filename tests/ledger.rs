//! The ledger never lies: ComfyUI's facts through the public API, pinned weights next to loads,
//! prefetch under a live bound, loads that fail before anything moves, and the public plan.

mod common;

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use common::*;
use residency::loader::{LoadOptions, MemoryManager, PlanProblem};
use residency::offload::fetch_weight;
use residency::patcher::ModelPatcher;
use residency::vram::DeviceId;
use residency::weights::Model;
use residency::{ByteSize, Dtype, Error};

const CPU: DeviceId = DeviceId::Cpu;
const KIB: u64 = 1024;

/// A real f32 model whose weights take `sizes` bytes each (multiples of 4).
fn kib_model(name: &str, sizes: &[u64]) -> ModelPatcher {
    let tensors = sizes.iter().enumerate().map(|(i, &bytes)| {
        (
            format!("w{i}"),
            rand_tensor(&[(bytes / 4) as usize], i as u64 + 17),
        )
    });
    cpu_patcher(Model::from_tensors(name, tensors).unwrap())
}

/// A budgeted CPU manager for KiB-sized models: no reserve, a 1 KiB inference minimum.
fn small_manager(budget: ByteSize, extra: &[&str]) -> MemoryManager {
    let mut flags = vec!["--reserve-vram", "0", "--inference-memory", "1KiB"];
    flags.extend_from_slice(extra);
    manager(budget, &flags)
}

fn registered(mm: &MemoryManager) -> Vec<(String, ByteSize)> {
    mm.loaded_models()
        .iter()
        .map(|m| (m.name.clone(), m.resident))
        .collect()
}

#[test]
fn an_already_loaded_model_gets_the_extra_budget_comfyui_gives_it() {
    // 5 GiB device; M (8 × 1 GiB) loaded with 2 GiB resident; 3 GiB free; memory_required 1 GiB
    // ⇒ ComfyUI's extra weight budget is 1728053248 bytes beyond the loaded 2 GiB.
    let mm = manager(ByteSize::gib(5), &[]);
    let m = cpu_patcher(virtual_model("M", &[GIB; 8]));
    let first = LoadOptions::default().with_memory_required(ByteSize::gib(2));
    let r = mm.load_models_gpu(std::slice::from_ref(&m), first).unwrap();
    assert_eq!(r.models[0].resident, ByteSize::gib(2), "{r}");
    assert_eq!(mm.get_free_memory(CPU), ByteSize::gib(3));

    let opts = LoadOptions::default().with_memory_required(ByteSize::gib(1));
    let plan = mm.plan(std::slice::from_ref(&m), opts).unwrap();
    assert!(plan.fits());
    assert!(plan.evictions.is_empty(), "the model never evicts itself");
    let p = &plan.models[0];
    assert_eq!(p.already_loaded, ByteSize::gib(2));
    assert_eq!(p.weight_budget, Some(ByteSize(1728053248)));
    // One more 1 GiB weight fits below 1.61 GiB: not a full reload, nothing dropped.
    assert_eq!(p.to_move, ByteSize::gib(1));
    assert_eq!(p.to_drop, ByteSize::ZERO);
    assert_eq!(p.resident, ByteSize::gib(3));

    let r = mm.load_models_gpu(std::slice::from_ref(&m), opts).unwrap();
    assert_eq!(r.built(), ByteSize::gib(1), "{r}");
    assert!(r.evicted.is_empty(), "{r}");
    assert_eq!(m.loaded_size(), ByteSize::gib(3));
    assert_eq!(mm.ledger(CPU), ByteSize::gib(3));
}

#[test]
fn pinned_weights_of_a_model_being_loaded_never_push_the_ledger_over_budget() {
    let flag_sets: [&[&str]; 4] = [
        &[],
        &["--reserve-vram", "0"],
        &["--reserve-vram", "0", "--inference-memory", "1KiB"],
        &["--lowvram"],
    ];
    for flags in flag_sets {
        pinned_case(flags);
    }
}

fn pinned_case(flags: &[&str]) {
    let budget = ByteSize::kib(160);
    let mm = manager(budget, flags);
    let a = kib_model("A", &[10 * KIB; 5]);
    let b = kib_model("B", &[20 * KIB, 17 * KIB]);
    let c = kib_model("C", &[14 * KIB; 7]);
    for m in [&a, &b] {
        mm.load_model_gpu(m).unwrap();
    }
    // With the default reserve (400 MiB), loading B already evicted A to keep inference memory
    // free, as ComfyUI does; with a small one both stay.
    assert!(mm.ledger(CPU) <= ByteSize::kib(87));
    b.pin_weight_to_device("w0").unwrap();
    b.pin_weight_to_device("w1").unwrap();
    let r = mm
        .load_models_gpu(&[c.clone(), b.clone()], LoadOptions::default())
        .unwrap();
    assert!(
        mm.ledger(CPU) <= budget,
        "{flags:?}: {r}\nledger {}",
        mm.ledger(CPU)
    );
    assert!(mm.peak_ledger(CPU) <= budget, "{flags:?}");
    assert_eq!(
        b.loaded_size(),
        ByteSize::kib(37),
        "{flags:?}: pinned weights stay"
    );
    let names: Vec<String> = registered(&mm).into_iter().map(|m| m.0).collect();
    assert_eq!(names[..2], ["B", "C"], "last loaded first");
}

#[test]
fn a_forced_full_load_that_pins_block_fails_before_anything_is_evicted() {
    let budget = ByteSize::kib(100);
    let mm = small_manager(budget, &[]);
    let other = kib_model("other", &[8 * KIB; 7]);
    mm.load_model_gpu(&other).unwrap();
    for i in 0..7 {
        other.pin_weight_to_device(&format!("w{i}")).unwrap();
    }
    let big = kib_model("big", &[15 * KIB; 4]);
    let before = registered(&mm);
    let full = LoadOptions::default().with_force_full_load(true);
    let plan = mm.plan(std::slice::from_ref(&big), full).unwrap();
    assert!(!plan.fits());
    assert!(
        matches!(&plan.problem, Some(PlanProblem::OutOfMemory { model, .. }) if model == "big"),
        "{:?}",
        plan.problem
    );
    let err = mm
        .load_models_gpu(std::slice::from_ref(&big), full)
        .unwrap_err();
    assert!(
        matches!(err, Error::OutOfMemory { .. }) && err.is_retryable(),
        "{err}"
    );
    assert_eq!(registered(&mm), before, "nothing was evicted");
    assert_eq!(other.loaded_size(), ByteSize::kib(56), "all 7 weights kept");
    assert_eq!(big.model().resident_bytes_total(), ByteSize::ZERO);
    // Unpinned, the same load evicts `other` and fits.
    other.unpin_all_weights();
    let r = mm
        .load_models_gpu(std::slice::from_ref(&big), full)
        .unwrap();
    assert!(r.models[0].full && mm.ledger(CPU) <= budget, "{r}");
}

#[test]
fn a_load_that_can_never_fit_is_a_budget_error_and_changes_nothing() {
    let mm = small_manager(ByteSize::kib(64), &["--highvram"]);
    let a = kib_model("A", &[16 * KIB; 2]);
    mm.load_model_gpu(&a).unwrap();
    let big = kib_model("big", &[40 * KIB; 2]);
    let err = mm.load_model_gpu(&big).unwrap_err();
    assert!(
        matches!(&err, Error::BudgetExceeded { required, budget, .. }
            if *required == ByteSize::kib(80) && *budget == ByteSize::kib(64)),
        "{err}"
    );
    assert_eq!(registered(&mm), [("A".to_string(), ByteSize::kib(32))]);
}

#[test]
fn novram_streams_every_weight_even_with_force_full_load() {
    let mm = small_manager(ByteSize::mib(8), &["--novram"]);
    let m = kib_model("M", &[16 * KIB; 4]);
    let full = LoadOptions::default().with_force_full_load(true);
    let plan = mm.plan(std::slice::from_ref(&m), full).unwrap();
    assert_eq!(plan.models[0].weight_budget, Some(ByteSize::ZERO));
    let r = mm.load_models_gpu(std::slice::from_ref(&m), full).unwrap();
    assert_eq!(r.models[0].resident, ByteSize::ZERO, "{r}");
    assert_eq!(r.models[0].streaming, ByteSize::kib(64));
    assert!(!r.models[0].full);
}

#[test]
fn the_plan_predicts_the_load_exactly() {
    let mm = small_manager(ByteSize::kib(100), &[]);
    let a = kib_model("A", &[12 * KIB; 4]);
    let b = kib_model("B", &[9 * KIB; 5]);
    mm.load_model_gpu(&a).unwrap();
    mm.load_model_gpu(&b).unwrap();
    let c = kib_model("C", &[20 * KIB, 16 * KIB, 8 * KIB, 4 * KIB]);
    let opts = LoadOptions::default().with_memory_required(ByteSize::kib(10));
    let plan = mm.plan(std::slice::from_ref(&c), opts).unwrap();
    // Asking changed nothing.
    assert_eq!(mm.ledger(CPU), ByteSize::kib(93));
    assert_eq!(c.model().resident_bytes_total(), ByteSize::ZERO);
    let r = mm.load_models_gpu(std::slice::from_ref(&c), opts).unwrap();
    assert_eq!(r.evicted, plan.evictions);
    assert_eq!(r.models[0].resident, plan.models[0].resident);
    assert_eq!(r.models[0].streaming, plan.models[0].streaming);
    assert_eq!(r.built(), plan.bytes_to_move());
    let after = plan.devices.iter().find(|d| d.device == CPU).unwrap();
    assert_eq!(after.ledger_after, mm.ledger(CPU));
    assert_eq!(after.ledger_before, ByteSize::kib(93));
}

#[test]
fn a_gpu_the_machine_does_not_have_is_refused_at_plan_time() {
    let mm = small_manager(ByteSize::kib(64), &[]);
    let m = ModelPatcher::new(
        Arc::new(Model::from_tensors("g", [("w", rand_tensor(&[4], 1))]).unwrap()),
        DeviceId::Cuda(3),
        CPU,
    );
    let err = mm.plan(std::slice::from_ref(&m), LoadOptions::default());
    assert!(
        matches!(&err, Err(Error::Device { device, .. }) if device == "cuda:3"),
        "{err:?}"
    );
}

/// A 2-layer-deep MLP of `layers` square f32 weights (`width`²), streamed through lanes.
fn mlp(layers: usize, width: usize, seed: u64) -> ModelPatcher {
    let tensors = (0..layers).map(|l| {
        let w = (rand_tensor(&[width, width], seed + l as u64) * 0.2).unwrap();
        (format!("layers.{l}.weight"), w)
    });
    let m = Model::from_tensors(format!("mlp{seed}"), tensors).unwrap();
    cpu_patcher(m)
}

fn forward(p: &ModelPatcher, layers: usize, width: usize) -> Vec<f32> {
    let mut x = Tensor::ones((2, width), DType::F32, &Device::Cpu).unwrap();
    for l in 0..layers {
        let (w, _) = fetch_weight(p, &format!("layers.{l}.weight")).unwrap();
        x = x.matmul(&w.t().unwrap()).unwrap().tanh().unwrap();
    }
    p.model().finish_forward();
    f32s(&x)
}

#[test]
fn prefetch_stays_within_the_budget_less_the_model_own_resident_bytes() {
    prefetch_case(&[
        "--reserve-vram",
        "0",
        "--inference-memory",
        "1KiB",
        "--async-offload",
        "2",
    ]);
    // ComfyUI's defaults (0.8 GiB + 400 MiB to keep free): the 128 MiB floor would give the
    // model the whole device; the plan keeps room for the prefetch window instead.
    prefetch_case(&["--async-offload", "2"]);
}

fn prefetch_case(flags: &[&str]) {
    // 291 KiB of weights under a 200 KiB budget with two lanes prefetching: the prefetch bound
    // must see the model's own resident bytes and every later change.
    let budget = ByteSize::kib(200);
    let mm = manager(budget, flags);
    let m = mlp(9, 90, 5); // 9 × 90² f32 = 291600 bytes
    let r = mm.load_model_gpu(&m).unwrap();
    assert!(!r.models[0].full, "{r}");
    let reference = {
        let mm2 = small_manager(ByteSize::mib(4), &[]);
        let full = mlp(9, 90, 5);
        mm2.load_model_gpu(&full).unwrap();
        forward(&full, 9, 90)
    };
    for _ in 0..3 {
        assert_eq!(forward(&m, 9, 90), reference, "streamed == resident");
        assert!(mm.ledger(CPU) <= budget);
    }
    assert!(
        mm.transfer_stats().prefetch_hits > 0,
        "{flags:?}: lanes prefetched"
    );
    assert!(
        mm.peak_ledger(CPU) <= budget,
        "peak {} over {budget}",
        mm.peak_ledger(CPU)
    );
}

#[test]
fn threads_sharing_a_budget_with_lanes_never_overrun_it() {
    let budget = ByteSize::kib(320);
    let mm = Arc::new(small_manager(budget, &["--async-offload", "2"]));
    let deadline = std::time::Instant::now() + std::time::Duration::from_millis(1500);
    let handles: Vec<_> = (0..8)
        .map(|t| {
            let mm = Arc::clone(&mm);
            std::thread::spawn(move || {
                let m = mlp(6, 64 + 8 * (t % 3), 100 + t as u64);
                let width = 64 + 8 * (t % 3);
                let mut over = 0u32;
                let mut n = 0u32;
                while std::time::Instant::now() < deadline {
                    mm.load_model_gpu(&m).unwrap();
                    forward(&m, 6, width);
                    if mm.ledger(CPU) > budget {
                        over += 1;
                    }
                    n += 1;
                }
                (over, n)
            })
        })
        .collect();
    let mut total = 0;
    for h in handles {
        let (over, n) = h.join().unwrap();
        assert_eq!(over, 0, "ledger seen over budget");
        total += n;
    }
    assert!(total > 8, "threads made progress");
    assert!(
        mm.peak_ledger(CPU) <= budget,
        "peak {}",
        mm.peak_ledger(CPU)
    );
}

#[test]
fn a_dtype_change_between_clones_cannot_grow_past_the_budget() {
    // bf16 storage resident as bf16 (A) then as f32 (a clone computing in f32): the rebuilt
    // copies double in size; the plan shrinks the resident set instead of overrunning.
    let budget = ByteSize::kib(48);
    let mm = small_manager(budget, &[]);
    let t = (0..4).map(|i| {
        let w = rand_tensor(&[2048], i).to_dtype(DType::BF16).unwrap();
        (format!("w{i}"), w)
    });
    let model = Arc::new(Model::from_tensors("m", t).unwrap());
    let a = ModelPatcher::new(Arc::clone(&model), CPU, CPU);
    mm.load_model_gpu(&a).unwrap();
    assert_eq!(mm.ledger(CPU), ByteSize::kib(16));
    let wide = a.clone().with_compute_dtype(Some(Dtype::F32));
    let r = mm.load_model_gpu(&wide).unwrap();
    assert!(mm.ledger(CPU) <= budget, "{r}");
    assert!(mm.peak_ledger(CPU) <= budget);
}

#[test]
fn reloading_a_fully_loaded_model_moves_nothing_until_something_changes() {
    let mm = small_manager(ByteSize::kib(128), &[]);
    let m = kib_model("M", &[8 * KIB; 4]);
    let other = kib_model("O", &[8 * KIB; 2]);
    mm.load_model_gpu(&m).unwrap();
    mm.load_model_gpu(&other).unwrap();
    // Unchanged: nothing moves, and the model becomes the most recently used.
    let r = mm.load_model_gpu(&m).unwrap();
    assert_eq!((r.built(), r.models[0].full), (ByteSize::ZERO, true));
    assert_eq!(r.models[0].resident, ByteSize::kib(32));
    assert_eq!(registered(&mm)[0].0, "M");
    // A weight dropped behind the manager's back is rebuilt by the next load.
    m.partially_unload(CPU, ByteSize::ZERO);
    let r = mm.load_model_gpu(&m).unwrap();
    assert_eq!(r.built(), ByteSize::kib(8), "{r}");
    // A clone with a patch rebuilds exactly the patched weight, then reloads for free.
    let mut lora = m.clone();
    lora.add_patches(
        [(
            "w1",
            residency::patcher::Patch::Diff {
                diff: rand_tensor(&[2048], 3),
                pad: false,
            },
        )],
        1.0,
        1.0,
    )
    .unwrap();
    assert_eq!(mm.load_model_gpu(&lora).unwrap().built(), ByteSize::kib(8));
    assert_eq!(mm.load_model_gpu(&lora).unwrap().built(), ByteSize::ZERO);
    // Back to the base: the patched weight is rebuilt again.
    assert_eq!(mm.load_model_gpu(&m).unwrap().built(), ByteSize::kib(8));
    // A load asking for more activation memory than is free still evicts, as the plan says.
    let big = LoadOptions::default().with_memory_required(ByteSize::kib(100));
    let plan = mm.plan(std::slice::from_ref(&m), big).unwrap();
    let r = mm.load_models_gpu(std::slice::from_ref(&m), big).unwrap();
    assert_eq!(r.evicted, plan.evictions);
    assert!(!r.evicted.is_empty(), "{r}");
}

#[cfg(feature = "serde")]
#[test]
fn reports_and_plans_serialize_with_numeric_fields() {
    let mm = small_manager(ByteSize::kib(40), &[]);
    let a = kib_model("A", &[8 * KIB; 3]);
    let b = kib_model("B", &[8 * KIB; 3]);
    mm.load_model_gpu(&a).unwrap();
    let plan = mm
        .plan(std::slice::from_ref(&b), LoadOptions::default())
        .unwrap();
    let report = mm.load_model_gpu(&b).unwrap();
    let json = serde_json::to_value(&report).unwrap();
    let e = &json["evicted"][0];
    assert_eq!(e["name"], "A");
    assert_eq!(e["device"], "cpu");
    assert!(
        e["freed"].is_u64() && e["required"].is_u64() && e["free"].is_u64(),
        "{e}"
    );
    assert!(e.get("reason").is_none(), "numbers, not a formatted string");
    let back: residency::loader::LoadReport = serde_json::from_value(json).unwrap();
    assert_eq!(back, report);
    let p = serde_json::to_value(&plan).unwrap();
    assert_eq!(
        p["models"][0]["weight_budget"],
        plan.models[0].weight_budget.unwrap().bytes()
    );
    assert!(p.get("steps").is_none());
    let mem = serde_json::to_value(mm.memory_report()).unwrap();
    assert_eq!(mem["devices"][0]["device"], "cpu");
    let back: residency::loader::MemoryReport = serde_json::from_value(mem).unwrap();
    assert_eq!(back, mm.memory_report());
    let d: DeviceId = serde_json::from_str("\"cuda:3\"").unwrap();
    assert_eq!(d, DeviceId::Cuda(3));
    assert!(serde_json::from_str::<DeviceId>("\"gpu\"").is_err());
}

#[test]
fn a_reservation_is_a_ledger_column_that_loads_prefetch_and_growth_respect() {
    // 64 KiB device; A (8 × 4 KiB) loaded fully; a 20 KiB KV cache reserved beside it.
    let budget = ByteSize::kib(64);
    let mm = small_manager(budget, &[]);
    let a = kib_model("A", &[4 * KIB; 8]);
    mm.load_model_gpu(&a).unwrap();
    let mut kv = mm
        .reserve_named("kv-cache", CPU, ByteSize::kib(20))
        .unwrap();
    assert_eq!(mm.ledger(CPU), ByteSize::kib(52));
    let report = mm.memory_report();
    assert_eq!(report.devices[0].reserved, ByteSize::kib(20));
    assert_eq!(report.reservations.len(), 1);
    assert_eq!(report.reservations[0].name, "kv-cache");
    assert!(
        report
            .to_string()
            .contains("reservation `kv-cache`: 20.00 KiB"),
        "{report}"
    );

    // A load of B (24 KiB) sees the reservation as occupied: the plan evicts part of A, never
    // the reservation, and the ledger stays within the budget.
    let b = kib_model("B", &[4 * KIB; 6]);
    let plan = mm
        .plan(std::slice::from_ref(&b), LoadOptions::default())
        .unwrap();
    assert_eq!(plan.devices[0].reserved, ByteSize::kib(20));
    mm.load_model_gpu(&b).unwrap();
    assert!(mm.ledger(CPU) <= budget);
    assert_eq!(kv.bytes(), ByteSize::kib(20));

    // Growing makes room by evicting (A first: not the model just loaded by ComfyUI's order of
    // most-offloaded first), and what can never fit beside the reservation (36 + 64 KiB on a
    // 64 KiB budget) is over budget, not retryable, and changes nothing.
    kv.grow(&mm, ByteSize::kib(16)).unwrap();
    assert_eq!(kv.bytes(), ByteSize::kib(36));
    assert!(mm.ledger(CPU) <= budget);
    let before = (mm.ledger(CPU), registered(&mm));
    let err = kv.grow(&mm, ByteSize::kib(64)).unwrap_err();
    assert!(!err.is_retryable(), "{err}");
    assert!(
        matches!(&err, Error::BudgetExceeded { model, required, .. } if model.contains("kv-cache") && *required == ByteSize::kib(64)),
        "{err}"
    );
    assert_eq!(
        kv.bytes(),
        ByteSize::kib(36),
        "a failed growth changes nothing"
    );
    assert_eq!(mm.reservations()[0].bytes, ByteSize::kib(36));
    // (Evictions made for the failed growth stay made, as a failed load's evictions do not:
    // here every model was already evicted or the ledger is unchanged.)
    assert!(mm.ledger(CPU) <= before.0);

    kv.shrink(ByteSize::kib(30));
    assert_eq!(mm.reservations()[0].bytes, ByteSize::kib(6));
    drop(kv);
    assert!(mm.reservations().is_empty());
    assert_eq!(mm.memory_report().devices[0].reserved, ByteSize::ZERO);
    // A device the manager does not schedule is refused.
    assert!(matches!(
        mm.reserve(DeviceId::Cuda(3), ByteSize::kib(1)).unwrap_err(),
        Error::Device { .. }
    ));
}

#[test]
fn a_kept_model_is_never_evicted_and_guards_nest() {
    let budget = ByteSize::kib(64);
    let mm = small_manager(budget, &[]);
    let a = kib_model("A", &[4 * KIB; 8]);
    mm.load_model_gpu(&a).unwrap();
    let keep = mm.keep(&a);
    let inner = mm.keep(&a);
    // A reservation that would need A's room fails instead of evicting it.
    let err = mm.reserve(CPU, ByteSize::kib(40)).unwrap_err();
    assert!(matches!(err, Error::OutOfMemory { .. }), "{err}");
    assert_eq!(a.model().resident_bytes(CPU), ByteSize::kib(32));
    // A load that wants more than is free loads partially around it.
    let b = kib_model("B", &[4 * KIB; 10]);
    let r = mm.load_model_gpu(&b).unwrap();
    assert!(!r.models[0].full, "{r}");
    assert!(r.evicted.is_empty(), "{r}");
    assert_eq!(a.model().resident_bytes(CPU), ByteSize::kib(32));
    assert!(mm
        .free_memory(ByteSize::kib(60), CPU, &[])
        .iter()
        .all(|e| e.name != "A"));
    assert_eq!(a.model().resident_bytes(CPU), ByteSize::kib(32));
    // A load that must be whole and needs the kept model's room fails, naming what holds it.
    let c = kib_model("C", &[4 * KIB; 10]);
    let err = mm
        .load_models_gpu(
            std::slice::from_ref(&c),
            LoadOptions::default().with_force_full_load(true),
        )
        .unwrap_err();
    assert!(err.is_retryable(), "{err}");
    assert!(err.to_string().contains("kept model `A`"), "{err}");
    assert_eq!(a.model().resident_bytes(CPU), ByteSize::kib(32));
    drop(inner);
    assert!(
        mm.free_memory(ByteSize::kib(60), CPU, &[])
            .iter()
            .all(|e| e.name != "A"),
        "one guard still keeps it"
    );
    drop(keep);
    let freed = mm.free_memory(ByteSize::kib(60), CPU, &[]);
    assert!(freed.iter().any(|e| e.name == "A"), "{freed:?}");
}

#[test]
fn a_kv_cache_growing_by_blocks_beside_a_streamed_model_fails_where_the_arithmetic_says() {
    // A 6-layer MLP (6 × 64² f32 = 96 KiB) under a 160 KiB budget; a KV cache grows by 8 KiB
    // per step. The model gives up weights as the cache grows (streamed: same bits), and growth
    // fails at the first step where the cache alone would pass the budget: over budget, not a
    // retryable out-of-memory (evicting more cannot help).
    let budget = ByteSize::kib(160);
    let mm = small_manager(budget, &[]);
    let m = mlp(6, 64, 7);
    let reference = forward(&m, 6, 64);
    mm.load_model_gpu(&m).unwrap();
    let mut kv = mm.reserve_named("kv", CPU, ByteSize::ZERO).unwrap();
    let block = ByteSize::kib(8);
    let mut steps = 0u64;
    loop {
        match kv.grow(&mm, block) {
            Ok(()) => steps += 1,
            Err(e) => {
                assert!(matches!(e, Error::BudgetExceeded { .. }), "{e}");
                assert!(!e.is_retryable(), "{e}");
                break;
            }
        }
        assert!(mm.ledger(CPU) <= budget, "step {steps}");
        assert_eq!(
            forward(&m, 6, 64),
            reference,
            "step {steps}: streamed == resident"
        );
        let resident = m.model().resident_bytes(CPU);
        assert!(resident.saturating_add(kv.bytes()) <= budget);
    }
    // Growth stops only when the model has nothing left to give: 160 KiB / 8 KiB = 20 blocks.
    assert_eq!(steps, budget.bytes() / block.bytes(), "steps");
    assert_eq!(m.model().resident_bytes(CPU), ByteSize::ZERO);
    assert_eq!(forward(&m, 6, 64), reference);
    drop(kv);
    mm.load_model_gpu(&m).unwrap();
    assert_eq!(m.model().resident_bytes(CPU), ByteSize::kib(96));
}

#[test]
fn a_reservation_growing_on_one_thread_beside_loads_and_forwards_never_passes_the_budget() {
    let budget = ByteSize::kib(320);
    let mm = Arc::new(small_manager(budget, &["--async-offload", "2"]));
    let deadline = std::time::Instant::now() + std::time::Duration::from_millis(1200);
    let grower = {
        let mm = Arc::clone(&mm);
        std::thread::spawn(move || {
            let mut kv = mm.reserve_named("kv", CPU, ByteSize::ZERO).unwrap();
            let (mut grown, mut refused) = (0u32, 0u32);
            while std::time::Instant::now() < deadline {
                match kv.grow(&mm, ByteSize::kib(16)) {
                    Ok(()) => grown += 1,
                    // Refused: retryable while other memory holds the room, over budget once
                    // the cache alone would pass it.
                    Err(e) => {
                        let over = kv.bytes().saturating_add(ByteSize::kib(16)) > budget;
                        assert_eq!(e.is_retryable(), !over, "{e}");
                        refused += 1;
                        kv.shrink(ByteSize::kib(128));
                    }
                }
                assert!(mm.ledger(CPU) <= budget);
            }
            (grown, refused)
        })
    };
    let workers: Vec<_> = (0..4)
        .map(|t| {
            let mm = Arc::clone(&mm);
            std::thread::spawn(move || {
                let width = 64 + 8 * (t % 3);
                let m = mlp(6, width, 200 + t as u64);
                let reference = forward(&m, 6, width);
                while std::time::Instant::now() < deadline {
                    mm.load_model_gpu(&m).unwrap();
                    assert_eq!(forward(&m, 6, width), reference);
                    assert!(mm.ledger(CPU) <= budget);
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    let (grown, _) = grower.join().unwrap();
    assert!(grown > 0);
    assert!(
        mm.peak_ledger(CPU) <= budget,
        "peak {}",
        mm.peak_ledger(CPU)
    );
    assert!(mm.reservations().is_empty(), "dropped with its thread");
}

#[test]
fn the_manager_asks_the_estimators_and_retries_a_step_that_ran_out_of_memory() {
    // ComfyUI's facts at GiB scale (below 128 MiB its floor gives a model the whole device):
    // 5 GiB device, M of 8 × 1 GiB whose activations take 1 GiB per input element.
    let big = manager(ByteSize::gib(5), &[]);
    let mut m = cpu_patcher(virtual_model("M", &[GIB; 8]));
    m.set_memory_estimator(Arc::new(|shape: &[usize]| {
        ByteSize::gib(shape.iter().product::<usize>() as u64)
    }));
    let plan_of = |o: LoadOptions| big.plan(std::slice::from_ref(&m), o).unwrap().models;
    let by_hand = plan_of(LoadOptions::default().with_memory_required(ByteSize::gib(2)));
    assert_eq!(
        plan_of(LoadOptions::default().with_input_shape(&[1, 2])),
        by_hand
    );
    assert_ne!(
        plan_of(LoadOptions::default()),
        by_hand,
        "the estimate changes the plan"
    );
    // The larger of the two figures wins.
    assert_eq!(
        plan_of(
            LoadOptions::default()
                .with_input_shape(&[1])
                .with_memory_required(ByteSize::gib(2))
        ),
        by_hand
    );
    let r = big
        .load_models_gpu(
            std::slice::from_ref(&m),
            LoadOptions::default().with_input_shape(&[2]),
        )
        .unwrap();
    assert_eq!(r.models[0].resident, ByteSize::gib(2), "{r}");

    let budget = ByteSize::kib(64);
    let mm = small_manager(budget, &[]);
    let a = kib_model("A", &[4 * KIB; 12]);
    // A step that needs 40 KiB free: refused at first, run again after the manager made room.
    mm.load_models_gpu(
        std::slice::from_ref(&a),
        LoadOptions::default().with_force_full_load(true),
    )
    .unwrap();
    let mut calls = 0;
    let out = mm.retry_on_oom(CPU, &[], || {
        calls += 1;
        let free = mm.get_free_memory(CPU);
        if free < ByteSize::kib(40) {
            return Err(Error::OutOfMemory {
                model: "decode".into(),
                device: CPU.to_string(),
                required: ByteSize::kib(40),
                available: free,
            });
        }
        Ok(free)
    });
    assert_eq!(calls, 2);
    assert!(out.unwrap() >= ByteSize::kib(40));
    // A model kept out of the room-making stays; an error that is not out-of-memory is not
    // retried.
    let mut calls = 0;
    let err = mm
        .retry_on_oom(CPU, &[&a], || -> residency::Result<()> {
            calls += 1;
            Err(Error::NotLoaded { model: "x".into() })
        })
        .unwrap_err();
    assert!(matches!(err, Error::NotLoaded { .. }));
    assert_eq!(calls, 1);
}

#[test]
fn a_model_partly_evicted_by_another_load_streams_with_prefetch() {
    // A loaded fully (no streamer); B's load takes part of A's room and keeps 40 KiB free for its
    // activations; A's next forwards stream the evicted weights through a prefetching streamer
    // (in that free room: it keeps two of A's largest weights and the inference minimum free
    // beside its prefetches), with A's bits.
    let budget = ByteSize::kib(200);
    let mm = small_manager(budget, &["--async-offload", "2"]);
    let a = mlp(6, 64, 11); // 96 KiB
    let reference = forward(&a, 6, 64);
    let r = mm.load_model_gpu(&a).unwrap();
    assert!(r.models[0].full);
    assert!(
        residency::offload::streamer_of(&a).is_none(),
        "fully loaded: nothing streams"
    );
    let b = mlp(8, 64, 12); // 128 KiB
    let r = mm
        .load_models_gpu(
            std::slice::from_ref(&b),
            LoadOptions::default().with_memory_required(ByteSize::kib(40)),
        )
        .unwrap();
    assert!(
        r.evicted
            .iter()
            .any(|e| e.name == a.model().name() && !e.fully),
        "{r}"
    );
    assert!(
        residency::offload::streamer_of(&a).is_some(),
        "partly evicted: it streams"
    );
    for _ in 0..3 {
        assert_eq!(forward(&a, 6, 64), reference);
        assert!(mm.ledger(CPU) <= budget);
    }
    assert!(
        mm.transfer_stats().prefetch_hits > 0,
        "{:?}",
        mm.transfer_stats()
    );
}

#[test]
fn bert_estimates_one_layer_of_activations_and_the_manager_keeps_it_free() {
    let config = residency::models::bert::BertConfig::minilm_l6();
    let est = config.memory_estimator(Dtype::F32);
    // 2 × 16 tokens: 6 × [.., 384] + 2 × [.., 1536] in f32, plus 2 × [2, 12, 16, 16] f32 scores.
    let want = 2 * 16 * (6 * 384 + 2 * 1536) * 4 + 2 * 2 * 12 * 16 * 16 * 4;
    assert_eq!(est(&[2, 16]), ByteSize(want as u64));
    assert!(
        est(&[1, 512]) > est(&[1, 256]).saturating_add(est(&[1, 256])),
        "scores grow as seq²"
    );
    let mut m = cpu_patcher(virtual_model("bert-sized", &[GIB; 4]));
    m.set_memory_estimator(config.memory_estimator(Dtype::F32));
    let mm = manager(ByteSize::gib(5), &[]);
    let by_shape = mm
        .plan(
            std::slice::from_ref(&m),
            LoadOptions::default().with_input_shape(&[64, 512]),
        )
        .unwrap();
    let by_hand = mm
        .plan(
            std::slice::from_ref(&m),
            LoadOptions::default().with_memory_required(est(&[64, 512])),
        )
        .unwrap();
    assert_eq!(by_shape.models, by_hand.models);
}
