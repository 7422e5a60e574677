//! Patches on the load device (docs/ARCHITECTURE.md §9): a LoRA'd dense weight bound for a GPU is
//! copied clean — straight from its page-locked host copy, in its storage dtype — and patched on
//! the device after the copy; the result is the host path's bits (the simulated GPU computes with
//! host arithmetic), streamed or resident, classic or by use. An fp8 weight (rounded
//! stochastically) is still patched on the host and copied patched.

mod common;

use std::sync::Arc;

use common::*;
use residency::float::Dtype;
use residency::loader::{LoadOptions, MemoryManager};
use residency::offload::fetch_weight;
use residency::patcher::{Lora, ModelPatcher, Patch};
use residency::vram::{Config, DeviceId, Hardware};
use residency::{ByteSize, Model};

const LAYERS: usize = 6;
/// Wide enough that a bf16 weight is pinned in place (256 KiB at least).
const WIDTH: usize = 384;
const SIM: DeviceId = DeviceId::Sim(0);

fn model(dtype: Dtype) -> Arc<Model> {
    let tensors = (0..LAYERS).map(|l| {
        let w = (rand_tensor(&[WIDTH, WIDTH], 40 + l as u64) * 0.2).unwrap();
        let w = residency::float::from_f32(&w, dtype, residency::Rounding::Nearest).unwrap();
        (format!("layers.{l}.weight"), w)
    });
    Arc::new(Model::from_tensors("mlp", tensors).unwrap())
}

/// A rank-4 LoRA on every layer but the last (left clean, so both kinds of weight stream).
fn lora_clone(p: &ModelPatcher) -> ModelPatcher {
    let mut p = p.clone();
    let patches = (0..LAYERS - 1).map(|l| {
        let lora = Lora {
            alpha: Some(2.0),
            ..Lora::new(
                rand_tensor(&[WIDTH, 4], 100 + l as u64),
                rand_tensor(&[4, WIDTH], 200 + l as u64),
            )
        };
        (format!("layers.{l}.weight"), Patch::Lora(lora))
    });
    p.add_patches(patches, 0.7, 1.0).unwrap();
    p
}

fn manager(args: &[&str]) -> MemoryManager {
    let mut all = vec!["--reserve-vram", "0", "--inference-memory", "64KiB"];
    all.extend_from_slice(args);
    let config = Config::from_args(all)
        .unwrap()
        .with_transfer_lanes(2)
        .with_prefetch_depth(2);
    MemoryManager::new(config, Hardware::cpu_only(ByteSize::gib(4))).unwrap()
}

/// Three forwards (the first records the order); the last one's output bits.
fn forwards(p: &ModelPatcher) -> Vec<u32> {
    let mut out = Vec::new();
    for _ in 0..3 {
        let mut x = rand_tensor(&[3, WIDTH], 9);
        for l in 0..LAYERS {
            let (w, _) = fetch_weight(p, &format!("layers.{l}.weight")).unwrap();
            x = x.matmul(&w.t().unwrap()).unwrap().tanh().unwrap();
        }
        p.model().finish_forward();
        out = f32s(&x).into_iter().map(f32::to_bits).collect();
    }
    out
}

/// The LoRA'd model's output loaded on `device` under `args`, and the manager. On a simulated
/// GPU its checker must have seen no misuse (no kernel read a copy before it landed, no buffer
/// reused under a copy).
fn run(dtype: Dtype, device: DeviceId, args: &[&str]) -> (Vec<u32>, MemoryManager) {
    let mm = manager(args);
    let base =
        ModelPatcher::new(model(dtype), device, DeviceId::Cpu).with_compute_dtype(Some(Dtype::F32));
    let p = lora_clone(&base);
    mm.load_models_gpu(std::slice::from_ref(&p), LoadOptions::default())
        .unwrap();
    let out = forwards(&p);
    for sim in mm.transfer_engine().devices().sims() {
        assert!(sim.check().is_ok(), "{args:?}: {:?}", sim.check());
    }
    (out, mm)
}

#[test]
fn a_lora_d_weight_is_copied_clean_and_patched_on_the_simulated_gpu_with_the_cpus_bits() {
    let (reference, _) = run(Dtype::BF16, DeviceId::Cpu, &["--novram"]);
    let f32_layer = (WIDTH * WIDTH * 4) as u64;
    let bf16_layer = (WIDTH * WIDTH * 2) as u64;
    let budget = (2 * f32_layer + 1).to_string();
    for mode in ["--disable-dynamic-vram", "--enable-dynamic-vram"] {
        // Fully resident: the resident copies were patched on the device too.
        let (resident, mm) = run(
            Dtype::BF16,
            SIM,
            &["--sim-gpu", "64MiB@25GB/s", "--highvram", mode],
        );
        assert_eq!(
            resident, reference,
            "{mode}: resident on the sim vs the CPU"
        );
        let t = mm.transfer_stats();
        assert_eq!(
            t.bytes_copied().bytes(),
            LAYERS as u64 * bf16_layer,
            "{mode}: each weight copied once, in bf16: {t:?}"
        );
        // A quarter resident: the rest streams at every forward.
        let (streamed, mm) = run(
            Dtype::BF16,
            SIM,
            &["--sim-gpu", "64MiB@25GB/s", "--vram-budget", &budget, mode],
        );
        assert_eq!(
            streamed, reference,
            "{mode}: streamed on the sim vs the CPU"
        );
        let t = mm.transfer_stats();
        assert!(t.fetches > 0, "{mode}: nothing streamed");
        // Every streamed copy, patched weights included, went straight from the pinned clean
        // copy in bf16, unless pinning that copy failed (the driver refuses a range sharing a
        // page with a pinned neighbour, which adjacent heap allocations can): a weight patched
        // on the host would be a new tensor, never pinned, staged without a failed pin.
        let failed = mm.memory_report().host.pin_failures;
        assert!(
            t.bytes_direct.bytes() + failed * bf16_layer >= t.bytes_transferred.bytes(),
            "{mode}: {t:?}, {failed} pins failed"
        );
        assert!(t.bytes_direct.bytes() > 0, "{mode}: {t:?}");
        assert_eq!(t.bytes_pageable, ByteSize::ZERO, "{mode}: {t:?}");
        assert_eq!(
            t.bytes_copied().bytes() % bf16_layer,
            0,
            "{mode}: copies are whole bf16 weights: {t:?}"
        );
    }
}

#[test]
fn an_fp8_weight_is_still_patched_on_the_host_and_copied_patched() {
    let (reference, _) = run(Dtype::F8E4M3FN, DeviceId::Cpu, &["--novram"]);
    let budget = ((WIDTH * WIDTH * 4 * 2) as u64 + 1).to_string();
    let (streamed, mm) = run(
        Dtype::F8E4M3FN,
        SIM,
        &[
            "--sim-gpu",
            "64MiB@25GB/s",
            "--vram-budget",
            &budget,
            "--disable-dynamic-vram",
        ],
    );
    assert_eq!(streamed, reference);
    let t = mm.transfer_stats();
    // Its patched bytes are a new host tensor: staged, not copied from the pinned clean copy.
    assert!(t.bytes_staged.bytes() > 0, "{t:?}");
}

/// A `Set` patch hands its value through the patch math: finishing on the device rounds the
/// result to bf16 in a buffer of its own, never in the Set's value.
#[test]
fn a_set_value_is_never_rounded_in_place_by_the_device_finish() {
    let value = rand_tensor(&[WIDTH, WIDTH], 77);
    let before: Vec<u32> = f32s(&value).into_iter().map(f32::to_bits).collect();
    let mm = manager(&[
        "--sim-gpu",
        "64MiB@25GB/s",
        "--novram",
        "--disable-dynamic-vram",
    ]);
    let mut p = ModelPatcher::new(model(Dtype::BF16), SIM, DeviceId::Cpu)
        .with_compute_dtype(Some(Dtype::F32));
    p.add_patches(
        [("layers.0.weight".to_string(), Patch::Set(value.clone()))],
        1.0,
        1.0,
    )
    .unwrap();
    mm.load_models_gpu(std::slice::from_ref(&p), LoadOptions::default())
        .unwrap();
    let (w, _) = fetch_weight(&p, "layers.0.weight").unwrap();
    let want = residency::float::from_f32(&value, Dtype::BF16, residency::Rounding::Nearest)
        .and_then(|t| residency::float::to_f32(&t, Dtype::BF16))
        .unwrap();
    assert_eq!(
        f32s(&w),
        f32s(&want),
        "the weight is the Set value rounded to bf16"
    );
    let after: Vec<u32> = f32s(&value).into_iter().map(f32::to_bits).collect();
    assert_eq!(before, after, "the Set's value was rounded in place");
    assert_ne!(
        f32s(&w),
        f32s(&value),
        "the value has digits bf16 does not keep"
    );
}
