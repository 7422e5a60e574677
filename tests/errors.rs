//! Errors across candle's boundary, and the texts of the messages an engine author meets first:
//! a residency error raised inside a forward keeps its type through candle, an out-of-memory met
//! in a forward names the weight and model and stays retryable, and each hint points the right way.

mod common;

use std::sync::Arc;

use candle_core::{DType, Module, Tensor};
use residency::loader::MemoryManager;
use residency::nn::{linear_no_bias, VarBuilder};
use residency::ops::OpsMode;
use residency::patcher::ModelPatcher;
use residency::vram::{Config, DeviceId};
use residency::weights::Model;
use residency::{ByteSize, Error};

const SIM0: DeviceId = DeviceId::Sim(0);

/// A one-layer model `net` (`proj.weight`, 64×64 f32) on the first simulated GPU.
fn one_layer(seed: u64) -> ModelPatcher {
    let model = Model::from_tensors(
        "net",
        [("proj.weight", common::rand_tensor(&[64, 64], seed))],
    )
    .unwrap();
    ModelPatcher::on_device(Arc::new(model), SIM0)
}

/// A streamed layer on a fresh `--novram` manager, and a buffer holding all but 8 KiB of the
/// simulated GPU outside the manager (another process, say): the forward's fetch of
/// `proj.weight` (16 KiB) runs out of memory on the device.
fn failing_layer() -> (
    MemoryManager,
    residency::nn::Linear,
    Tensor,
    Vec<u32>,
    residency::device::sim::SimBuffer,
) {
    let mm = common::manager_with(&["--sim-gpu", "1MiB", "--novram", "--disable-dynamic-vram"]);
    let p = one_layer(3);
    mm.load_model_gpu(&p).unwrap();
    let vb = VarBuilder::from_patcher(&p, OpsMode::DisableWeightInit).unwrap();
    let proj = linear_no_bias(64, 64, vb.pp("proj")).unwrap();
    let x = common::rand_tensor(&[2, 64], 9);
    // candle-nn's Linear on the same weight: what the forward computes.
    let w = common::rand_tensor(&[64, 64], 3);
    let expected = common::bits(&x.matmul(&w.t().unwrap()).unwrap());
    let sim = &mm.transfer_engine().devices().sims()[0];
    let hog = sim
        .new_stream()
        .unwrap()
        .alloc(DType::U8, (1 << 20) - 8 * 1024)
        .unwrap();
    (mm, proj, x, expected, hog)
}

#[test]
fn an_out_of_memory_in_a_forward_keeps_its_type_through_candle() {
    let (_mm, proj, x, _, _hog) = failing_layer();
    let err: candle_core::Error = proj.forward(&x).unwrap_err();
    let inner = Error::in_candle(&err).expect("the residency error is inside candle's");
    assert!(inner.is_retryable(), "{inner}");
    let typed = Error::from(err);
    assert!(matches!(typed, Error::OutOfMemory { .. }), "{typed}");
    let msg = typed.to_string();
    assert!(
        msg.contains("weight `proj.weight` of model `net`") && msg.contains("sim:0"),
        "{msg}"
    );
    assert!(
        msg.contains("retry_on_oom"),
        "the hint names the retry: {msg}"
    );
}

#[test]
fn retry_on_oom_catches_an_out_of_memory_raised_inside_a_forward() {
    // `?` on candle's error gives the typed error back, so the retry sees an out-of-memory and
    // runs the forward again.
    let (mm, proj, x, expected, hog) = failing_layer();
    let mut hog = Some(hog);
    let mut calls = 0;
    let y = mm
        .retry_on_oom(SIM0, &[], || {
            calls += 1;
            let y = proj.forward(&x);
            // The other holder lets go while the manager frees what it can.
            hog = None;
            Ok(y?)
        })
        .unwrap();
    assert!(hog.is_none());
    assert_eq!(calls, 2, "failed once, retried once");
    assert_eq!(
        common::bits(&y),
        expected,
        "the retried forward computes candle-nn's bits"
    );
}

#[test]
fn a_residency_error_goes_into_candle_and_comes_back_with_its_type() {
    let unknown = Error::UnknownWeight {
        model: "net".into(),
        key: "proj.bias".into(),
    };
    let through: candle_core::Error = unknown.into();
    // Under the layers candle itself adds on the way up.
    let through = through.context("building the head").bt();
    let back = Error::from(through);
    assert!(
        matches!(&back, Error::UnknownWeight { model, key } if model == "net" && key == "proj.bias"),
        "{back}"
    );
    // A plain candle error stays a tensor error, with its context.
    let plain = Error::tensor("matmul", candle_core::Error::Msg("bad".into()));
    assert!(matches!(plain, Error::Tensor { .. }), "{plain}");
    assert!(Error::in_candle(&candle_core::Error::Msg("x".into())).is_none());
}

#[test]
fn a_missing_weight_asked_for_by_a_layer_is_a_typed_unknown_weight() {
    let p = one_layer(1);
    let vb = VarBuilder::from_patcher(&p, OpsMode::DisableWeightInit).unwrap();
    let err = linear_no_bias(64, 64, vb.pp("head")).unwrap_err();
    match Error::from(err) {
        Error::UnknownWeight { model, key } => {
            assert_eq!((model.as_str(), key.as_str()), ("net", "head.weight"));
        }
        other => panic!("expected UnknownWeight, got {other}"),
    }
}

/// A rank-1 LoRA for a 64×64 weight.
fn lora(seed: u64) -> residency::patcher::Patch {
    residency::patcher::Patch::Lora(residency::patcher::Lora::new(
        common::rand_tensor(&[64, 1], seed),
        common::rand_tensor(&[1, 64], seed + 1),
    ))
}

#[test]
fn a_lora_clone_loaded_without_switching_the_layers_is_reported_and_one_call_closes_the_trap() {
    let mm = common::manager_with(&["--sim-gpu", "1MiB", "--disable-dynamic-vram"]);
    let base = one_layer(5);
    let vb = VarBuilder::from_patcher(&base, OpsMode::DisableWeightInit).unwrap();
    let proj = linear_no_bias(64, 64, vb.pp("proj")).unwrap();
    let x = common::rand_tensor(&[2, 64], 9);
    mm.load_model_gpu(&base).unwrap();
    assert_eq!(vb.source().not_loaded(), None, "the base is what is loaded");
    let base_out = common::bits(&proj.forward(&x).unwrap());

    // The node's clone with a LoRA, loaded, but the layers still on the base patcher.
    let mut styled = base.clone();
    styled
        .add_patches([("proj.weight", lora(7))], 1.0, 1.0)
        .unwrap();
    mm.load_model_gpu(&styled).unwrap();
    let why = vb.source().not_loaded().expect("the trap is reported");
    assert!(
        why.contains("model `net`") && why.contains("set_patcher"),
        "{why}"
    );
    assert_eq!(
        common::bits(&proj.forward(&x).unwrap()),
        base_out,
        "computes the base"
    );

    // One call: the layers switch and the clone loads.
    vb.source()
        .load(&mm, &styled, residency::loader::LoadOptions::default())
        .unwrap();
    assert_eq!(vb.source().not_loaded(), None);
    let styled_out = common::bits(&proj.forward(&x).unwrap());
    assert_ne!(styled_out, base_out, "the LoRA computes now");
    let merged = styled.patched_weight("proj.weight").unwrap();
    assert_eq!(
        styled_out,
        common::bits(&x.matmul(&merged.t().unwrap()).unwrap())
    );

    // A failed load leaves the layers on the patcher they had.
    let other = ModelPatcher::new(
        Arc::new(
            Model::from_tensors("big", [("w", common::rand_tensor(&[1024, 512], 1))]).unwrap(),
        ),
        SIM0,
        DeviceId::Cpu,
    );
    let err = vb
        .source()
        .load(&mm, &other, residency::loader::LoadOptions::default())
        .unwrap_err();
    assert!(
        matches!(&err, Error::WrongModel { layers, given } if layers == "net" && given == "big"),
        "{err}"
    );
    assert_eq!(err.to_string(), "the layers were built on model `net` but were given a patcher of model `big`; set_patcher takes a clone of `net` (`patcher.clone()`, then add patches)");
    assert_eq!(common::bits(&proj.forward(&x).unwrap()), styled_out);
}

#[test]
fn a_weight_larger_than_its_device_is_refused_at_load_time_naming_it() {
    let mm = common::manager_with(&["--sim-gpu", "1MiB", "--disable-dynamic-vram"]);
    // 2 MiB of f32 on a 1 MiB device: it could only ever fail at the forward that fetches it.
    let p = ModelPatcher::new(
        Arc::new(
            Model::from_tensors(
                "wide",
                [
                    ("small.weight", common::rand_tensor(&[16, 16], 1)),
                    ("head.weight", common::rand_tensor(&[1024, 512], 2)),
                ],
            )
            .unwrap(),
        ),
        SIM0,
        DeviceId::Cpu,
    );
    let before = mm.ledger(SIM0);
    let err = mm.load_model_gpu(&p).unwrap_err();
    assert!(matches!(err, Error::BudgetExceeded { .. }), "{err}");
    assert!(!err.is_retryable());
    let msg = err.to_string();
    assert!(
        msg.contains("`wide` weight `head.weight`")
            && msg.contains("sim:0")
            && msg.contains("fetched whole")
            && msg.contains("device map"),
        "{msg}"
    );
    assert_eq!(mm.ledger(SIM0), before, "nothing loaded");
    assert_eq!(p.model().resident_bytes(SIM0), ByteSize::ZERO);
}

#[test]
fn a_device_map_naming_a_device_that_does_not_exist_says_so() {
    let mm = common::manager_with(&["--sim-gpu", "1MiB"]);
    let p = one_layer(1).with_device_map(residency::DeviceMap::parse("proj=sim:3").unwrap());
    let err = mm.load_model_gpu(&p).unwrap_err();
    assert_eq!(
        err.to_string(),
        "device sim:3: model `net` has a device map that places weights on sim:3, which does not exist (this manager has 1 simulated GPU(s); each --sim-gpu adds one)"
    );
}

#[test]
fn a_device_map_rule_that_cannot_be_used_names_the_rule_not_a_flag() {
    let e = residency::DeviceMap::parse("layers.0=gpu7").unwrap_err();
    assert_eq!(
        e.to_string(),
        "device map rule `layers.0=gpu7`: `gpu7` is not a device (expected `host`, `cuda:N` or `sim:N`)"
    );
    let e = residency::DeviceMap::parse("layers.0").unwrap_err();
    assert!(matches!(e, Error::BadDeviceMap { .. }), "{e}");
    assert!(!e.to_string().contains("--device-map"), "{e}");
}

#[test]
fn a_refused_reservation_says_reserve_less_or_raise_the_budget() {
    let mm = common::manager_with(&["--sim-gpu", "1MiB", "--reserve-vram", "0"]);
    let err = mm
        .reserve_named("kv-cache", SIM0, ByteSize::mib(2))
        .map(|_| ())
        .unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("reservation `kv-cache`"), "{msg}");
    assert!(
        msg.ends_with("(reserve less, or raise --vram-budget)"),
        "{msg}"
    );
    assert!(!msg.contains("lower the budget"), "{msg}");
    // Twice the device can never fit: retrying after evictions cannot help.
    assert!(matches!(err, Error::BudgetExceeded { .. }), "{msg}");
    assert!(!err.is_retryable(), "{msg}");
    // Beside a reservation of 768 KiB, 512 KiB more can never fit either; 256 KiB can.
    let _kv = mm.reserve_named("kv", SIM0, ByteSize::kib(768)).unwrap();
    let err = mm
        .reserve_named("more", SIM0, ByteSize::kib(512))
        .map(|_| ())
        .unwrap_err();
    assert!(!err.is_retryable(), "{err}");
    assert!(mm.reserve_named("fits", SIM0, ByteSize::kib(256)).is_ok());
}

#[test]
fn a_word_where_a_lane_count_goes_is_named_as_the_flag_s_value() {
    let e = Config::from_args(["--async-offload", "many"]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "flag `--async-offload`: `many` is not a number (give a count, `--async-offload 2`, or the flag alone)"
    );
    // The flag alone, or before another flag, still means the default lane count.
    assert!(Config::from_args(["--async-offload", "--lowvram"]).is_ok());
}

#[test]
fn a_bad_environment_variable_is_named_by_the_variable() {
    let e = Config::from_env_vars([("RESIDENCY_VRAM_BUDGET", "lots")]).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.starts_with("flag `RESIDENCY_VRAM_BUDGET`: `lots`: "),
        "{msg}"
    );
    let (config, errors) = Config::from_env_vars_lenient([
        ("RESIDENCY_VRAM_BUDGET", "lots"),
        ("RESIDENCY_LOWVRAM", "1"),
    ]);
    assert_eq!(errors.len(), 1);
    assert!(
        errors[0].to_string().contains("RESIDENCY_VRAM_BUDGET"),
        "{}",
        errors[0]
    );
    assert_eq!(config.vram_mode, Some(residency::vram::VramMode::LowVram));
}
