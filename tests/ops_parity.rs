//! Invariant I3 (docs/ARCHITECTURE.md §4.3) for the ops layers: a small net built from every ops
//! layer, with LoRA and diff patches, read from a real safetensors file, gives bit-identical
//! outputs whether its weights are all resident, about a quarter resident, or all streamed (NoVram)
//! — for f32, f16, bf16, fp8 (E4M3FN, E5M2) and per-tensor scaled fp8 storage, computing in f32.

mod common;

use std::sync::Arc;

use candle_core::{DType, Device, Module, Tensor};
use common::*;
use residency::float::{self, Dtype, Rounding};
use residency::loader::LoadOptions;
use residency::ops::{quant, ConvConfig, ConvTransposeConfig, OpsBuilder, OpsMode};
use residency::patcher::{Lora, ModelPatcher, Patch};
use residency::vram::DeviceId;
use residency::weights::{save_safetensors, Model, SafetensorsOptions};
use residency::ByteSize;

const WEIGHTS: &[(&str, &[usize])] = &[
    ("emb.weight", &[10, 6]),
    ("c1.weight", &[8, 4, 3, 3]),
    ("c1.bias", &[8]),
    ("gn.weight", &[8]),
    ("gn.bias", &[8]),
    ("ct.weight", &[8, 4, 2, 2]),
    ("ct.bias", &[4]),
    ("c1d.weight", &[6, 4, 3]),
    ("c1d.bias", &[6]),
    ("l1.weight", &[256, 6]),
    ("l1.bias", &[256]),
    ("ln.weight", &[256]),
    ("ln.bias", &[256]),
    ("l2.weight", &[8, 256]),
    ("l2.bias", &[8]),
    ("rms.weight", &[8]),
];

/// Writes the net's checkpoint in `storage` (`scaled`: fp8 codes + `weight_scale` for every
/// weight of rank ≥ 2) and reads it back.
fn checkpoint(dir: &std::path::Path, storage: Dtype, scaled: bool) -> Model {
    let path = dir.join(format!("net-{storage}-{scaled}.safetensors"));
    let mut tensors = Vec::new();
    for (i, (key, shape)) in WEIGHTS.iter().enumerate() {
        let mut t = rand_tensor(shape, i as u64 + 1);
        if ["gn.weight", "ln.weight", "rms.weight"].contains(key) {
            t = (t + 1.0).unwrap();
        }
        if scaled && shape.len() >= 2 {
            let (codes, scale) = quant::quantize_per_tensor(&t, storage, key).unwrap();
            tensors.push((key.to_string(), codes, storage));
            tensors.push((quant::scale_key(key).unwrap(), scale, Dtype::F32));
        } else {
            let r = if storage.is_fp8() {
                Rounding::stochastic_for(key)
            } else {
                Rounding::Nearest
            };
            tensors.push((
                key.to_string(),
                float::from_f32(&t, storage, r).unwrap(),
                storage,
            ));
        }
    }
    save_safetensors(&path, &tensors, &SafetensorsOptions::default()).unwrap();
    Model::from_safetensors("parity-net", &[path]).unwrap()
}

struct Net {
    emb: residency::ops::Embedding,
    c1: residency::ops::Conv2d,
    gn: residency::ops::GroupNorm,
    ct: residency::ops::ConvTranspose2d,
    c1d: residency::ops::Conv1d,
    l1: residency::ops::Linear,
    ln: residency::ops::LayerNorm,
    l2: residency::ops::Linear,
    rms: residency::ops::RmsNorm,
}

impl Net {
    fn new(p: &ModelPatcher, mode: OpsMode) -> Net {
        let b = OpsBuilder::new(p, mode);
        Net {
            emb: b.embedding("emb").unwrap(),
            c1: b
                .conv2d(
                    "c1",
                    ConvConfig {
                        padding: 1,
                        ..Default::default()
                    },
                    true,
                )
                .unwrap(),
            gn: b.group_norm("gn", 2, 1e-5).unwrap(),
            ct: b
                .conv_transpose2d(
                    "ct",
                    ConvTransposeConfig {
                        stride: 2,
                        ..Default::default()
                    },
                    true,
                )
                .unwrap(),
            c1d: b.conv1d("c1d", ConvConfig::default(), true).unwrap(),
            l1: b.linear("l1", true).unwrap(),
            ln: b.layer_norm("ln", 1e-5, true).unwrap(),
            l2: b.linear_dims("l2", 256, 8, true).unwrap(),
            rms: b.rms_norm("rms", 1e-6).unwrap(),
        }
    }

    fn forward(&self, x: &Tensor, ids: &Tensor) -> Tensor {
        let h = self.c1.forward(x).unwrap();
        let h = self.gn.forward(&h).unwrap().silu().unwrap();
        let h = self.ct.forward(&h).unwrap(); // [2, 4, 16, 16]
        let h = h.reshape((2, 4, 256)).unwrap();
        let h = self.c1d.forward(&h).unwrap().mean(2).unwrap(); // [2, 6]
        let e = self.emb.forward(ids).unwrap().mean(1).unwrap(); // [2, 6]
        let h = self.l1.forward(&(h + e).unwrap()).unwrap();
        let h = self.ln.forward(&h).unwrap().gelu_erf().unwrap();
        let h = self.l2.forward(&h).unwrap();
        self.rms.forward(&h).unwrap()
    }
}

fn patched(p: &ModelPatcher) -> ModelPatcher {
    let mut p = p.clone();
    // Rank-2 LoRA onto a weight `[out, in...]`.
    let lora = |out: usize, input: &[usize], seed: u64| {
        let mut down = vec![2];
        down.extend_from_slice(input);
        Patch::Lora(Lora {
            up: (rand_tensor(&[out, 2], seed) * 0.3).unwrap(),
            down: (rand_tensor(&[2, input.iter().product()], seed + 1) * 0.3)
                .unwrap()
                .reshape(down)
                .unwrap(),
            alpha: Some(1.0),
            mid: None,
            dora_scale: None,
        })
    };
    let matched = p
        .add_patches(
            [
                ("emb.weight", lora(10, &[6], 50)),
                ("c1.weight", lora(8, &[4, 3, 3], 52)),
                ("l1.weight", lora(256, &[6], 54)),
                ("l2.weight", lora(8, &[256], 56)),
                (
                    "ct.weight",
                    Patch::Diff {
                        diff: (rand_tensor(&[8, 4, 2, 2], 58) * 0.1).unwrap(),
                        pad: false,
                    },
                ),
                (
                    "ln.bias",
                    Patch::Diff {
                        diff: (rand_tensor(&[256], 59) * 0.1).unwrap(),
                        pad: false,
                    },
                ),
            ],
            0.8,
            1.0,
        )
        .unwrap();
    assert_eq!(matched.len(), 6);
    p
}

fn run(
    p: &ModelPatcher,
    mode: OpsMode,
    flags: &[&str],
    budget: ByteSize,
) -> (Vec<u32>, f64, usize) {
    let mm = manager(budget, flags);
    let report = mm
        .load_models_gpu(std::slice::from_ref(p), LoadOptions::default())
        .unwrap();
    let load = &report.models[0];
    let resident = load.resident.as_f64() / p.resident_model_size().as_f64();
    let net = Net::new(p, mode);
    let x = rand_tensor(&[2, 4, 8, 8], 99);
    let ids = Tensor::new(&[[1u32, 4, 9], [0, 3, 3]], &Device::Cpu).unwrap();
    let y = net.forward(&x, &ids);
    assert_eq!(y.dims(), &[2, 8]);
    assert_eq!(y.dtype(), DType::F32);
    let bits = f32s(&y).iter().map(|v| v.to_bits()).collect();
    p.detach();
    (bits, resident, load.lazy_patched)
}

fn check(storage: Dtype, scaled: bool) {
    let dir = tempfile::tempdir().unwrap();
    let base = ModelPatcher::new(
        Arc::new(checkpoint(dir.path(), storage, scaled)),
        DeviceId::Cpu,
        DeviceId::Cpu,
    );
    let p = patched(&base);
    let mode = if scaled {
        OpsMode::MixedPrecision {
            compute: Dtype::F32,
        }
    } else {
        OpsMode::ManualCast {
            compute: Dtype::F32,
        }
    };
    let size = p.resident_model_size();
    let rz = ["--reserve-vram", "0"];
    let (full, r_full, lazy_full) = run(&p, mode, &rz, ByteSize::gib(1));
    let (quarter, r_q, lazy_q) = run(&p, mode, &rz, ByteSize(size.bytes() / 4));
    let (none, r_none, lazy_none) = run(
        &p,
        mode,
        &["--novram", "--reserve-vram", "0"],
        ByteSize::gib(1),
    );
    assert!(
        r_full > 0.999 && lazy_full == 0,
        "{storage}: full load {r_full}"
    );
    assert!(r_q > 0.05 && r_q <= 0.25, "{storage}: quarter load {r_q}");
    assert!(
        lazy_q > 0,
        "{storage}: some patched weights stream at a quarter"
    );
    assert!(
        r_none == 0.0 && lazy_none == 6,
        "{storage}: novram {r_none} {lazy_none}"
    );
    assert_eq!(
        full, quarter,
        "{storage} scaled={scaled}: quarter differs from full"
    );
    assert_eq!(
        full, none,
        "{storage} scaled={scaled}: novram differs from full"
    );

    // The patches do act: the base model gives other bits.
    let (clean, _, _) = run(&base, mode, &rz, ByteSize::gib(1));
    assert_ne!(clean, full, "{storage}: patches changed nothing");
}

#[test]
fn outputs_are_bit_identical_across_budgets_f32_storage() {
    check(Dtype::F32, false);
}

#[test]
fn outputs_are_bit_identical_across_budgets_half_storage() {
    check(Dtype::F16, false);
    check(Dtype::BF16, false);
}

#[test]
fn outputs_are_bit_identical_across_budgets_fp8_storage() {
    check(Dtype::F8E4M3FN, false);
    check(Dtype::F8E5M2, false);
}

#[test]
fn outputs_are_bit_identical_across_budgets_scaled_fp8_mixed_precision() {
    check(Dtype::F8E4M3FN, true);
    check(Dtype::F8E5M2, true);
}
