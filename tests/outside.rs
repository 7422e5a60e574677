//! Tensors outside the ledger: what `VarBuilder::get` hands a model is either adopted by the layer
//! built on it (then managed, fetched at every forward) or counted, reported and warned about —
//! never silently outside every budget.

mod common;

use proptest::prelude::*;

use std::sync::Arc;

use candle_core::{DType, Module, Tensor};
use residency::loader::{LoadOptions, MemoryManager};
use residency::nn::{Linear, RmsNorm, VarBuilder};
use residency::ops::OpsMode;
use residency::patcher::ModelPatcher;
use residency::vram::DeviceId;
use residency::weights::Model;
use residency::ByteSize;

const SIM0: DeviceId = DeviceId::Sim(0);

/// `w` (64×64), `proj.weight` (32×64), `proj.bias` (32), `q.scale` (64), all f32.
fn model() -> Arc<Model> {
    Arc::new(
        Model::from_tensors(
            "port",
            [
                ("w", common::rand_tensor(&[64, 64], 1)),
                ("proj.weight", common::rand_tensor(&[32, 64], 2)),
                ("proj.bias", common::rand_tensor(&[32], 3)),
                ("q.scale", common::rand_tensor(&[64], 4)),
            ],
        )
        .unwrap(),
    )
}

fn copies(mm: &MemoryManager) -> u64 {
    mm.transfer_engine().devices().sims()[0].stats().copies
}

#[test]
fn a_raw_parameter_the_model_keeps_is_counted_reported_and_in_the_plan() {
    let mm = common::manager_with(&["--sim-gpu", "1MiB", "--novram", "--disable-dynamic-vram"]);
    let m = model();
    let p = ModelPatcher::new(Arc::clone(&m), SIM0, DeviceId::Cpu);
    let vb = VarBuilder::from_patcher(&p, OpsMode::DisableWeightInit).unwrap();
    // The minimal case: kept by the model, used in its forward as a plain tensor.
    let w = vb.get((64, 64), "w").unwrap();
    assert_eq!(m.held_outside(), vec![("w".to_string(), ByteSize::kib(16))]);
    let plan = mm.plan(&[&p], LoadOptions::default()).unwrap();
    assert_eq!(plan.models[0].held_outside, ByteSize::kib(16));
    let report = mm.load_model_gpu(&p).unwrap();
    assert_eq!(report.models[0].held_outside, ByteSize::kib(16));
    assert_eq!(report.models[0].outside_keys, vec!["w".to_string()]);
    // Nothing is resident under --novram, but the ledger counts what the model's code holds on
    // its device: a budget sees it.
    assert_eq!(m.resident_bytes(SIM0), ByteSize::ZERO);
    assert_eq!(mm.ledger(SIM0), ByteSize::kib(16));
    // Adopted later by a layer, it leaves the count (and the ledger at the next manager call).
    let layer = Linear::new(w, None);
    assert!(layer.weights().is_some());
    assert!(m.held_outside().is_empty());
    mm.load_model_gpu(&p).unwrap();
    assert_eq!(mm.ledger(SIM0), ByteSize::ZERO);
}

#[test]
fn layers_built_by_new_on_what_get_returned_are_managed_and_compute_candle_nn_s_bits() {
    let mm = common::manager_with(&["--sim-gpu", "1MiB", "--novram", "--disable-dynamic-vram"]);
    let m = model();
    let p = ModelPatcher::new(Arc::clone(&m), SIM0, DeviceId::Cpu);
    let vb = VarBuilder::from_patcher(&p, OpsMode::DisableWeightInit).unwrap();
    // A port's spelling of a linear layer and of Flux's `QkNorm`.
    let proj = Linear::new(
        vb.get((32, 64), "proj.weight").unwrap(),
        Some(vb.get(32, "proj.bias").unwrap()),
    );
    let norm = RmsNorm::new(vb.get(64, "q.scale").unwrap(), 1e-6);
    assert_eq!(
        proj.weights().map(|w| (w.weight_key(), w.bias_key())),
        Some(("proj.weight", Some("proj.bias"))),
        "Linear::new adopted the keys"
    );
    assert!(
        norm.clone().into_inner().weights().is_some(),
        "RmsNorm::new adopted its scale"
    );
    assert!(m.held_outside().is_empty(), "{:?}", m.held_outside());
    let report = mm.load_model_gpu(&p).unwrap();
    assert_eq!(report.models[0].held_outside, ByteSize::ZERO);

    // Managed: under --novram each forward fetches the weights onto the device.
    let x = common::rand_tensor(&[3, 64], 7);
    let before = copies(&mm);
    let y = norm.forward(&x).unwrap();
    let z = proj.forward(&y).unwrap();
    assert!(
        copies(&mm) >= before + 3,
        "weight, bias and scale were fetched"
    );
    // candle-nn's layers on the clean tensors: the same bits.
    let clean = |k: &str| m.clean(k).unwrap();
    let y_ref = candle_nn::RmsNorm::new(clean("q.scale"), 1e-6)
        .forward(&x)
        .unwrap();
    let z_ref = candle_nn::Linear::new(clean("proj.weight"), Some(clean("proj.bias")))
        .forward(&y_ref)
        .unwrap();
    assert_eq!(common::bits(&y), common::bits(&y_ref));
    assert_eq!(common::bits(&z), common::bits(&z_ref));
}

#[test]
fn a_tensor_changed_after_get_stays_the_model_s_own_and_stays_counted() {
    let m = model();
    let p = ModelPatcher::new(Arc::clone(&m), DeviceId::Cpu, DeviceId::Cpu);
    let vb = VarBuilder::from_patcher(&p, OpsMode::DisableWeightInit).unwrap();
    let scaled = (vb.get((32, 64), "proj.weight").unwrap() * 2.0).unwrap();
    let head = Linear::new(scaled, None);
    assert!(
        head.weights().is_none(),
        "another tensor than the one read: owned"
    );
    assert_eq!(
        m.held_outside(),
        vec![("proj.weight".to_string(), ByteSize(32 * 64 * 4))]
    );
}

#[test]
fn get_managed_reads_a_raw_parameter_at_use_and_keeps_it_inside() {
    let mm = common::manager_with(&["--sim-gpu", "1MiB", "--novram", "--disable-dynamic-vram"]);
    let m = model();
    let p = ModelPatcher::new(Arc::clone(&m), SIM0, DeviceId::Cpu);
    let vb = VarBuilder::from_patcher(&p, OpsMode::DisableWeightInit).unwrap();
    let scale = vb.get_managed(64, "q.scale").unwrap();
    assert_eq!((scale.key(), scale.shape()), ("q.scale", &[64usize][..]));
    assert!(m.held_outside().is_empty());
    mm.load_model_gpu(&p).unwrap();
    let before = copies(&mm);
    let t = scale.fetch(vb.device()).unwrap();
    assert_eq!(copies(&mm), before + 1, "fetched at use");
    assert_eq!(common::bits(&t), common::bits(&m.clean("q.scale").unwrap()));
    let err = vb.get_managed(63, "q.scale").unwrap_err();
    assert!(
        matches!(
            residency::Error::from(err),
            residency::Error::ShapeMismatch { .. }
        ),
        "a wrong shape is a typed error"
    );
}

#[test]
fn a_model_dropped_and_built_again_does_not_count_its_tensors_twice() {
    let m = model();
    let p = ModelPatcher::new(Arc::clone(&m), DeviceId::Cpu, DeviceId::Cpu);
    for _ in 0..3 {
        let vb = VarBuilder::from_patcher(&p, OpsMode::DisableWeightInit).unwrap();
        let kept = vb.get((64, 64), "w").unwrap();
        assert_eq!(m.held_outside(), vec![("w".to_string(), ByteSize::kib(16))]);
        drop((vb, kept));
    }
    // The builder and everything built from it are gone: nothing counts.
    assert!(m.held_outside().is_empty(), "{:?}", m.held_outside());
}

/// One step of the model-based run below.
#[derive(Debug, Clone)]
enum Step {
    /// `vb.get` of weight `w`, kept by the "model".
    Get(usize),
    /// `vb.get_unchecked` of weight `w`, kept.
    GetUnchecked(usize),
    /// `Linear::new(vb.get(w)?, None)`: adopted, managed.
    Adopt(usize),
    /// Drops the newest kept tensor.
    DropOne,
    /// Drops the builder, every layer and every kept tensor (the model is gone), and starts a
    /// new builder.
    Rebuild,
    Load,
    UnloadAll,
}

/// The weights of [`model`] a step may read: (key, shape).
const WEIGHTS: [(&str, &[usize]); 4] = [
    ("w", &[64, 64]),
    ("proj.weight", &[32, 64]),
    ("proj.bias", &[32]),
    ("q.scale", &[64]),
];

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
    /// Model-based: a reference list of the tensors the model keeps or dropped while its builder
    /// lives (key, bytes), against
    /// `held_outside` and the ledger, after every step of a random sequence of reads, adoptions,
    /// drops, rebuilds, loads and unloads; with a builder in the weights' dtype (a read hands out
    /// the clean tensor itself) or in bf16 (each read makes a new tensor, the second is kept and
    /// handed out again: never more than two counted per weight).
    #[test]
    fn held_outside_and_the_ledger_follow_what_the_model_keeps(
        bf16 in proptest::bool::ANY,
        steps in proptest::collection::vec(proptest::prop_oneof![
            3 => (0..4usize).prop_map(Step::Get),
            1 => (0..4usize).prop_map(Step::GetUnchecked),
            2 => (0..2usize).prop_map(Step::Adopt),
            2 => proptest::strategy::Just(Step::DropOne),
            1 => proptest::strategy::Just(Step::Rebuild),
            2 => proptest::strategy::Just(Step::Load),
            1 => proptest::strategy::Just(Step::UnloadAll),
        ], 1..40)
    ) {
        let mm = common::manager_with(&["--vram-budget", "1MiB", "--reserve-vram", "0"]);
        let m = model();
        let p = ModelPatcher::new(Arc::clone(&m), DeviceId::Cpu, DeviceId::Cpu);
        let dtype = if bf16 { DType::BF16 } else { DType::F32 };
        let builder = || VarBuilder::from_patcher(&p, OpsMode::DisableWeightInit).unwrap().to_dtype(dtype);
        let mut vb = Some(builder());
        let mut kept: Vec<(String, Tensor)> = Vec::new();
        let mut dropped: Vec<(String, candle_core::TensorId, ByteSize)> = Vec::new();
        let mut layers: Vec<Linear> = Vec::new();
        let mut registered = false;
        for (i, step) in steps.iter().enumerate() {
            let b = vb.as_ref().unwrap();
            match step.clone() {
                Step::Get(w) => {
                    let (key, shape) = WEIGHTS[w];
                    kept.push((key.to_string(), b.get(shape, key).unwrap()));
                }
                Step::GetUnchecked(w) => {
                    let key = WEIGHTS[w].0;
                    kept.push((key.to_string(), b.get_unchecked(key).unwrap()));
                }
                Step::Adopt(w) => {
                    let (key, shape) = [("w", &[64usize, 64][..]), ("proj.weight", &[32, 64])][w];
                    let layer = Linear::new(b.get(shape, key).unwrap(), None);
                    prop_assert!(layer.weights().is_some(), "step {}: adopted", i);
                    layers.push(layer);
                }
                Step::DropOne => {
                    // A dropped tensor cannot be seen: it stays counted while its builder lives
                    // (never under the truth), so the reference moves it to `dropped`.
                    if let Some(last) = kept.pop() {
                        let bytes = last.1.elem_count() * last.1.dtype().size_in_bytes();
                        dropped.push((last.0, last.1.id(), ByteSize(bytes as u64)));
                    }
                }
                Step::Rebuild => {
                    kept.clear();
                    dropped.clear();
                    layers.clear();
                    drop(vb.take());
                    vb = Some(builder());
                }
                Step::Load => {
                    mm.load_model_gpu(&p).unwrap();
                    registered = true;
                }
                Step::UnloadAll => {
                    mm.unload_all_models();
                    registered = false;
                }
            }
            // The reference: every tensor kept (or dropped while its builder lives), each
            // distinct tensor once (a clean weight read twice is one tensor), summed by key.
            let charged: std::collections::BTreeMap<(String, String), ByteSize> = kept
                .iter()
                .map(|(k, t)| ((k.clone(), format!("{:?}", t.id())), ByteSize((t.elem_count() * t.dtype().size_in_bytes()) as u64)))
                .chain(dropped.iter().map(|(k, id, b)| ((k.clone(), format!("{id:?}")), *b)))
                .collect();
            let mut want: std::collections::BTreeMap<String, ByteSize> = Default::default();
            for ((k, _), bytes) in charged {
                let e = want.entry(k).or_default();
                *e = e.saturating_add(bytes);
            }
            let want: Vec<(String, ByteSize)> = want.into_iter().collect();
            prop_assert_eq!(m.held_outside(), want.clone(), "step {}: {:?}", i, step);
            // Bounded by what the model can hold, not by how often it reads: two copies a key.
            for (key, bytes) in &want {
                let shape = WEIGHTS.iter().find(|(k, _)| k == key).unwrap().1;
                let copy = shape.iter().product::<usize>() * dtype.size_in_bytes();
                prop_assert!(*bytes <= ByteSize(2 * copy as u64), "step {}: {} holds {}", i, key, bytes);
            }
            let outside: ByteSize = want.iter().map(|(_, b)| *b).sum();
            let expected = if registered {
                m.resident_bytes(DeviceId::Cpu).saturating_add(outside)
            } else {
                ByteSize::ZERO
            };
            prop_assert_eq!(mm.ledger(DeviceId::Cpu), expected, "step {}: {:?}", i, step);
        }
    }
}

/// Thirty-two 4 KiB weights `l{i}` and a 20 KiB parameter `held` the model's code keeps, all f32.
fn layered() -> Arc<Model> {
    let mut tensors: Vec<(String, Tensor)> = (0..32)
        .map(|i| {
            (
                format!("l{i}"),
                common::rand_tensor(&[32, 32], 10 + i as u64),
            )
        })
        .collect();
    tensors.push(("held".to_string(), common::rand_tensor(&[64, 80], 9)));
    Arc::new(Model::from_tensors("vae", tensors).unwrap())
}

/// The false out-of-memory of a partial load: the plan chose a resident set that filled the
/// device without the loading model's own held tensors, the load then registered the model, the
/// ledger added them, and the bound check rolled the load back — while `plan()` said it fit.
#[test]
fn a_partial_load_counts_the_loading_model_s_held_tensors_so_plan_and_load_agree() {
    let mm = common::manager_with(&[
        "--sim-gpu",
        "96KiB",
        "--reserve-vram",
        "0",
        "--disable-dynamic-vram",
    ]);
    let m = layered();
    let p = ModelPatcher::new(Arc::clone(&m), SIM0, DeviceId::Cpu);
    let vb = VarBuilder::from_patcher(&p, OpsMode::DisableWeightInit).unwrap();
    let _held = vb.get((64, 80), "held").unwrap();
    let held = ByteSize::kib(20);
    assert_eq!(m.held_outside(), vec![("held".to_string(), held)]);
    let total = ByteSize::kib(96);
    assert!(m.model_size() > total, "a budget under the model's size");

    let plan = mm.plan(&[&p], LoadOptions::default()).unwrap();
    assert!(plan.fits(), "{:?}", plan.problem);
    let planned = &plan.models[0];
    assert!(
        !planned.full && planned.resident > ByteSize::ZERO,
        "{planned:?}"
    );
    assert_eq!(planned.held_outside, held);

    let report = mm.load_model_gpu(&p).expect("the load the plan said fits");
    assert_eq!(
        plan.devices[0].ledger_after,
        planned.resident.saturating_add(held),
        "the plan's ledger counts the held tensor"
    );
    assert_eq!(report.models[0].resident, planned.resident);
    assert_eq!(report.models[0].held_outside, held);
    assert_eq!(mm.ledger(SIM0), plan.devices[0].ledger_after);
    assert!(mm.ledger(SIM0) <= total, "{} over {total}", mm.ledger(SIM0));
}

/// A weight read again and again (a port that calls `vb.get` in its forward) used to count one
/// more copy per read while the builder lived, until every plan on the device was refused.
#[test]
fn reading_one_weight_ten_thousand_times_keeps_the_held_figure_bounded() {
    let mm = common::manager_with(&["--sim-gpu", "1MiB", "--novram", "--disable-dynamic-vram"]);
    let m = model();
    let p = ModelPatcher::new(Arc::clone(&m), SIM0, DeviceId::Cpu);
    // In bf16 over f32 weights: every read makes a new tensor (cast now), as a streamed weight's
    // does.
    let vb = VarBuilder::from_patcher(&p, OpsMode::DisableWeightInit)
        .unwrap()
        .to_dtype(DType::BF16);
    let bf16 = |t: &Tensor| common::bits(&t.to_dtype(DType::F32).unwrap());
    let want = bf16(&m.clean("w").unwrap().to_dtype(DType::BF16).unwrap());
    let mut ids = std::collections::HashSet::new();
    for _ in 0..10_000 {
        let t = vb.get((64, 64), "w").unwrap();
        ids.insert(t.id());
        assert_eq!(t.dtype(), DType::BF16);
        drop(t);
    }
    // What counts is what was handed out and can still be alive: the first read's copy, then
    // the second's, kept and handed out again.
    let two = ByteSize::kib(16);
    assert_eq!(m.held_outside(), vec![("w".to_string(), two)]);
    assert_eq!(ids.len(), 2, "distinct tensors handed out");
    assert_eq!(bf16(&vb.get((64, 64), "w").unwrap()), want, "the same bits");
    let plan = mm.plan(&[&p], LoadOptions::default()).unwrap();
    assert!(plan.fits(), "{:?}", plan.problem);
    mm.load_model_gpu(&p).unwrap();
    assert_eq!(mm.ledger(SIM0), two);

    // The builder gone, nothing counts (and the kept copy is freed).
    drop(vb);
    assert!(m.held_outside().is_empty(), "{:?}", m.held_outside());
    mm.load_model_gpu(&p).unwrap();
    assert_eq!(mm.ledger(SIM0), ByteSize::ZERO);
}

// ---------------------------------------------------------------------------------------------
// A quantized port: candle-transformers' `quantized_llama` dequantizes its token table at build.

include!("ported/shim.rs");

#[path = "ported/quantized_llama.rs"]
#[allow(dead_code, clippy::all)]
mod quantized_llama;

/// candle-transformers' `quantized_llama` dequantizes its token table to f32 when it is built
/// (one per instance: one per concurrent request), into a tensor it keeps: that table used to be
/// outside the ledger and uncounted.
#[test]
fn a_quantized_port_s_dequantized_token_table_counts_as_held_outside() {
    use common::gguf::{EMBD, VOCAB};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny-llama.gguf");
    common::gguf::write_tiny_llama(&path);
    let mm = common::manager_with(&[
        "--sim-gpu",
        "64MiB",
        "--reserve-vram",
        "0",
        "--disable-dynamic-vram",
    ]);
    let m = Arc::new(mm.read_gguf("tiny-llama", &path).unwrap());
    let p = ModelPatcher::new(Arc::clone(&m), SIM0, DeviceId::Cpu);
    let device = SIM0.to_candle().unwrap();
    let build = || {
        let ct = residency::quantized::gguf_file::Content::from_patcher(&p);
        let mut unread = std::io::Cursor::new(Vec::<u8>::new());
        quantized_llama::ModelWeights::from_gguf(ct, &mut unread, &device).unwrap()
    };
    // `token_embd.weight` [64, 256] in Q8_0, dequantized to f32.
    let table = ByteSize((VOCAB * EMBD * 4) as u64);
    let held = |tables: u64| {
        vec![(
            "token_embd.weight".to_string(),
            ByteSize(table.bytes() * tables),
        )]
    };
    let mut a = build();
    assert_eq!(m.held_outside(), held(1));
    assert!(
        !m.used_without_load(),
        "a table dequantized at build is one copy the port keeps (held outside), not a weight \
         copied at every use of a model never loaded"
    );
    let b = build();
    assert_eq!(m.held_outside(), held(2), "one table per instance");

    let plan = mm.plan(&[&p], LoadOptions::default()).unwrap();
    assert_eq!(plan.models[0].held_outside, ByteSize(2 * table.bytes()));
    let report = mm.load_model_gpu(&p).unwrap();
    assert_eq!(
        report.models[0].outside_keys,
        vec!["token_embd.weight".to_string()]
    );
    let in_ledger = m
        .resident_bytes(SIM0)
        .saturating_add(ByteSize(2 * table.bytes()));
    assert_eq!(mm.ledger(SIM0), in_ledger);

    // A forward adds nothing: what it dequantizes (norm gains) it uses and drops.
    let input = Tensor::new(&[1u32, 17, 42], &device)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    a.forward(&input, 0).unwrap();
    assert_eq!(m.held_outside(), held(2));

    // An instance dropped (its handles, so its source), its table no longer counts.
    drop(a);
    assert_eq!(m.held_outside(), held(1));
    drop(b);
    assert!(m.held_outside().is_empty(), "{:?}", m.held_outside());
    mm.load_model_gpu(&p).unwrap();
    assert_eq!(mm.ledger(SIM0), m.resident_bytes(SIM0));
}
