//! The manual-cast cache: a resident bf16 weight used by an f32 layer is cast once and kept in the
//! ledger when there is room, gives the same bits as the per-call cast, and is the first thing a
//! load or `free_memory` gives up.

mod common;

use std::sync::Arc;

use candle_core::Module;
use common::*;
use residency::float::{self, Rounding};
use residency::loader::{LoadOptions, MemoryManager};
use residency::ops::{cast_cache_stats, OpsBuilder, OpsMode, OpsSource};
use residency::patcher::{Lora, ModelPatcher, Patch};
use residency::vram::DeviceId;
use residency::weights::Model;
use residency::{ByteSize, Dtype};

const CPU: DeviceId = DeviceId::Cpu;
const LAYERS: usize = 3;
const N: usize = 64;
/// One layer in bf16: weight and bias.
const LAYER_BF16: u64 = (N * N * 2 + N * 2) as u64;
/// The same layer cast to f32.
const LAYER_F32: u64 = 2 * LAYER_BF16;
const MODEL_BF16: u64 = LAYERS as u64 * LAYER_BF16;
const CASTS: u64 = LAYERS as u64 * LAYER_F32;
/// What a load with default options keeps free under `small_manager`'s flags: the 1 KiB minimum.
const KEEP_FREE: u64 = 1024;

/// A model of `LAYERS` bf16 linear layers `N × N` with biases.
fn bf16_model(name: &str, seed: u64) -> ModelPatcher {
    let mut tensors = Vec::new();
    for l in 0..LAYERS {
        for (part, shape) in [("weight", vec![N, N]), ("bias", vec![N])] {
            let t = rand_tensor(&shape, seed + 2 * l as u64 + (part == "bias") as u64);
            let t = float::from_f32(&t, Dtype::BF16, Rounding::Nearest).unwrap();
            tensors.push((format!("l{l}.{part}"), t, Dtype::BF16));
        }
    }
    cpu_patcher(Model::from_typed_tensors(name, tensors).unwrap())
}

fn small_manager(budget: u64) -> MemoryManager {
    manager(
        ByteSize(budget),
        &["--reserve-vram", "0", "--inference-memory", "1KiB"],
    )
}

/// The layers in f32 over `source`, applied to a fixed input; the output's bits.
fn forward_source(source: &OpsSource) -> Vec<u32> {
    let b = OpsBuilder::from_source(
        source,
        OpsMode::ManualCast {
            compute: Dtype::F32,
        },
    );
    let mut x = rand_tensor(&[2, N], 99);
    for l in 0..LAYERS {
        x = b
            .linear(&format!("l{l}"), true)
            .unwrap()
            .forward(&x)
            .unwrap();
    }
    f32s(&x).into_iter().map(f32::to_bits).collect()
}

fn forward(p: &ModelPatcher) -> Vec<u32> {
    forward_source(&OpsSource::new(p))
}

fn load(mm: &MemoryManager, p: &ModelPatcher) -> residency::loader::LoadReport {
    mm.load_models_gpu(std::slice::from_ref(p), LoadOptions::default())
        .unwrap()
}

fn cached(mm: &MemoryManager) -> ByteSize {
    mm.memory_report().devices[0].cached_casts
}

#[test]
fn a_resident_weight_is_cast_once_and_gives_the_per_call_bits() {
    let mm = small_manager(1 << 20);
    let p = bf16_model("m", 1);
    // Before the load every weight streams: cast at every call, nothing cached.
    let reference = forward(&p);
    assert_eq!(cast_cache_stats(&p), None);
    load(&mm, &p);
    assert_eq!(forward(&p), reference, "first forward after the load");
    let s = cast_cache_stats(&p).unwrap();
    assert_eq!((s.kept, s.hits, s.refused), (2 * LAYERS as u64, 0, 0));
    assert_eq!(s.bytes, ByteSize(CASTS));
    assert_eq!(forward(&p), reference, "served from the cache");
    assert_eq!(cast_cache_stats(&p).unwrap().hits, 2 * LAYERS as u64);
    assert_eq!(cached(&mm), ByteSize(CASTS));
    assert_eq!(mm.ledger(CPU), ByteSize(MODEL_BF16 + CASTS));
    let report = mm.memory_report().to_string();
    assert!(
        report.contains(&format!("{} of it cached manual casts", ByteSize(CASTS))),
        "{report}"
    );
    // The resident copies stay bf16: the cache is beside them, not instead of them.
    assert_eq!(p.loaded_size(), ByteSize(MODEL_BF16));
}

#[test]
fn casts_are_kept_only_while_the_ledger_has_room() {
    // Room for the model, what loads keep free, and one layer's casts (weight and bias) plus a
    // little: the other layers' weights are refused, their small biases still fit.
    let budget = MODEL_BF16 + KEEP_FREE + 1 + LAYER_F32 + 600;
    let mm = small_manager(budget);
    let p = bf16_model("m", 2);
    let reference = forward(&p);
    load(&mm, &p);
    for _ in 0..3 {
        assert_eq!(forward(&p), reference);
        assert!(mm.ledger(CPU).bytes() + KEEP_FREE < budget);
    }
    let s = cast_cache_stats(&p).unwrap();
    assert!(s.refused >= 2, "{s:?}");
    assert!(
        s.bytes >= ByteSize(LAYER_F32) && s.bytes < ByteSize(2 * LAYER_F32),
        "{s:?}"
    );
    assert!(mm.peak_ledger(CPU) <= ByteSize(budget));
}

#[test]
fn a_load_that_needs_the_room_drops_casts_instead_of_evicting() {
    // A and its casts fill the device; B fits beside A only without A's casts.
    let budget = MODEL_BF16 + CASTS + KEEP_FREE + 1 + 100;
    let mm = small_manager(budget);
    let a = bf16_model("a", 3);
    let b = bf16_model("b", 4);
    let reference = forward(&a);
    load(&mm, &a);
    forward(&a);
    assert_eq!(cached(&mm), ByteSize(CASTS));
    let plan = mm
        .plan(std::slice::from_ref(&b), LoadOptions::default())
        .unwrap();
    assert!(plan.fits() && plan.evictions.is_empty(), "{plan:?}");
    let r = load(&mm, &b);
    assert!(r.evicted.is_empty(), "{r}");
    assert_eq!(cached(&mm), ByteSize::ZERO);
    assert_eq!(a.loaded_size(), ByteSize(MODEL_BF16), "A is still whole");
    assert_eq!(b.loaded_size(), ByteSize(MODEL_BF16));
    // A forward of A now caches what still fits, within the budget.
    assert_eq!(forward(&a), reference);
    assert!(mm.peak_ledger(CPU) <= ByteSize(budget));
    assert!(mm.ledger(CPU).bytes() + KEEP_FREE < budget);
}

#[test]
fn a_repeat_load_keeps_the_casts_and_free_memory_drops_them_first() {
    let mm = small_manager(1 << 20);
    let p = bf16_model("m", 5);
    load(&mm, &p);
    forward(&p);
    let before = cast_cache_stats(&p).unwrap();
    let r = load(&mm, &p);
    assert_eq!(r.built(), ByteSize::ZERO, "a no-op reload");
    forward(&p);
    let after = cast_cache_stats(&p).unwrap();
    assert_eq!(after.kept, before.kept, "nothing cast again");
    assert_eq!(after.hits, before.hits + 2 * LAYERS as u64);
    // Asking for memory the casts hold: they go, the model stays.
    let evicted = mm.free_memory(ByteSize((1 << 20) - MODEL_BF16 - 10), CPU, &[]);
    assert!(evicted.is_empty(), "{evicted:?}");
    assert_eq!(cached(&mm), ByteSize::ZERO);
    assert_eq!(p.loaded_size(), ByteSize(MODEL_BF16));
}

#[test]
fn switching_a_source_to_a_patched_clone_never_serves_the_base_cast() {
    let mm = small_manager(1 << 20);
    let base = bf16_model("m", 6);
    let mut clone = base.clone();
    let mut lora = Lora::new(rand_tensor(&[N, 4], 60), rand_tensor(&[4, N], 61));
    lora.alpha = Some(2.0);
    clone
        .add_patches([("l1.weight", Patch::Lora(lora))], 1.0, 1.0)
        .unwrap();
    let base_ref = forward(&base);
    let clone_ref = forward(&clone);
    assert_ne!(base_ref, clone_ref);
    let source = OpsSource::new(&base);
    load(&mm, &base);
    assert_eq!(forward_source(&source), base_ref);
    assert_eq!(forward_source(&source), base_ref);
    // The clone on the same source: its weights are not resident until it is loaded.
    source.set_patcher(&clone).unwrap();
    assert_eq!(forward_source(&source), clone_ref);
    load(&mm, &clone);
    assert_eq!(forward_source(&source), clone_ref);
    assert_eq!(forward_source(&source), clone_ref);
    source.set_patcher(&base).unwrap();
    load(&mm, &base);
    assert_eq!(forward_source(&source), base_ref);
    assert!(mm.peak_ledger(CPU) <= ByteSize(1 << 20));
}

#[test]
fn forwards_on_threads_while_loads_come_and_go_keep_bits_and_budget() {
    let budget = MODEL_BF16 * 2 + CASTS / 2 + KEEP_FREE + 1;
    let mm = Arc::new(small_manager(budget));
    let a = bf16_model("a", 7);
    let b = bf16_model("b", 8);
    let reference = forward(&a);
    load(&mm, &a);
    std::thread::scope(|s| {
        for _ in 0..3 {
            s.spawn(|| {
                for _ in 0..20 {
                    assert_eq!(forward(&a), reference);
                }
            });
        }
        s.spawn(|| {
            for i in 0..20 {
                let p = if i % 2 == 0 { &b } else { &a };
                load(&mm, p);
                if i % 5 == 0 {
                    mm.free_memory(ByteSize(budget / 2), CPU, &[]);
                }
            }
        });
    });
    assert!(mm.peak_ledger(CPU) <= ByteSize(budget));
}
