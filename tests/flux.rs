//! candle-transformers' Flux ported by its `use` lines (`tests/ported/flux.rs`) against
//! candle-transformers' own, on one checkpoint: the same bits fully resident, under `--novram` and
//! on a simulated GPU, and all of its weights managed — `QkNorm`'s `RmsNorm::new(vb.get(..)?)`
//! included — so nothing it holds is outside the manager.

mod common;

include!("ported/shim.rs");

use candle_transformers::models::flux::WithForward;

#[path = "ported/flux.rs"]
#[allow(dead_code, clippy::all)]
mod flux;

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use residency::ops::OpsMode;
use residency::patcher::ModelPatcher;
use residency::vram::DeviceId;
use residency::weights::Model;
use residency::ByteSize;

/// A tiny Flux: one double block, one single block, 2 heads of 16 — as either crate's `Config`
/// (the two are the same struct, defined twice).
struct TinyConfig;

macro_rules! from_tiny {
    ($t:ty) => {
        impl From<TinyConfig> for $t {
            fn from(_: TinyConfig) -> Self {
                Self {
                    in_channels: 4,
                    vec_in_dim: 8,
                    context_in_dim: 8,
                    hidden_size: 32,
                    mlp_ratio: 2.0,
                    num_heads: 2,
                    depth: 1,
                    depth_single_blocks: 1,
                    axes_dim: vec![4, 6, 6],
                    theta: 10_000,
                    qkv_bias: true,
                    guidance_embed: false,
                }
            }
        }
    };
}
from_tiny!(candle_transformers::models::flux::model::Config);
from_tiny!(flux::Config);

/// Every weight candle-transformers' Flux asks for, random, in a safetensors file.
fn checkpoint(dir: &std::path::Path) -> std::path::PathBuf {
    let cfg = <candle_transformers::models::flux::model::Config>::from(TinyConfig);
    let varmap = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    candle_transformers::models::flux::model::Flux::new(&cfg, vb).unwrap();
    for (i, (_, var)) in varmap.data().lock().unwrap().iter().enumerate() {
        let t = residency::float::uniform_tensor(var.dims(), 300 + i as u64).unwrap();
        var.set(&(t * 0.3).unwrap()).unwrap();
    }
    let path = dir.join("flux.safetensors");
    varmap.save(&path).unwrap();
    path
}

/// The inputs of one denoising step: 4 image tokens, 3 text tokens.
fn inputs() -> Vec<Tensor> {
    let r = |shape: &[usize], seed| residency::float::uniform_tensor(shape, seed).unwrap();
    let ids = |n: usize| {
        let v: Vec<f32> = (0..n * 3).map(|i| (i % 5) as f32).collect();
        Tensor::from_vec(v, (1, n, 3), &Device::Cpu).unwrap()
    };
    vec![
        r(&[1, 4, 4], 1),
        ids(4),
        r(&[1, 3, 8], 2),
        ids(3),
        Tensor::new(&[0.5f32], &Device::Cpu).unwrap(),
        r(&[1, 8], 3),
    ]
}

fn step(model: &dyn WithForward, x: &[Tensor]) -> Vec<u32> {
    model
        .forward(&x[0], &x[1], &x[2], &x[3], &x[4], &x[5], None)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .into_iter()
        .map(f32::to_bits)
        .collect()
}

#[test]
fn the_ported_flux_gives_candle_s_bits_and_keeps_every_weight_managed() {
    let dir = tempfile::tempdir().unwrap();
    let path = checkpoint(dir.path());
    let x = inputs();
    let expected = {
        let tensors: HashMap<String, Tensor> =
            candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
        let vb = candle_nn::VarBuilder::from_tensors(tensors, DType::F32, &Device::Cpu);
        let cfg = <candle_transformers::models::flux::model::Config>::from(TinyConfig);
        let model = candle_transformers::models::flux::model::Flux::new(&cfg, vb).unwrap();
        step(&model, &x)
    };
    let cfg = <flux::Config>::from(TinyConfig);
    for (flags, device) in [
        (&["--vram-budget", "64MiB"][..], DeviceId::Cpu),
        (&["--vram-budget", "64MiB", "--novram"][..], DeviceId::Cpu),
        (
            &["--sim-gpu", "8MiB", "--disable-dynamic-vram"][..],
            DeviceId::Sim(0),
        ),
        (&["--sim-gpu", "8MiB", "--novram"][..], DeviceId::Sim(0)),
        (
            &["--sim-gpu", "8MiB@25GB/s", "--async-offload", "2"][..],
            DeviceId::Sim(0),
        ),
    ] {
        let mm = common::manager_with(flags);
        let model = Arc::new(Model::from_safetensors("flux", &[&path]).unwrap());
        let p = ModelPatcher::new(Arc::clone(&model), device, DeviceId::Cpu);
        let vb = residency::nn::VarBuilder::from_patcher(&p, OpsMode::DisableWeightInit).unwrap();
        let port = flux::Flux::new(&cfg, vb).unwrap();
        assert_eq!(
            model.held_outside(),
            vec![],
            "{flags:?}: nothing outside the manager"
        );
        let report = mm.load_model_gpu(&p).unwrap();
        assert_eq!(report.models[0].held_outside, ByteSize::ZERO);
        for round in 0..2 {
            assert_eq!(step(&port, &x), expected, "{flags:?}, round {round}");
        }
        // Every weight's bytes are the manager's: resident ones in the ledger, the rest stream.
        assert_eq!(
            report.models[0]
                .resident
                .saturating_add(report.models[0].streaming),
            model.model_size(),
            "{flags:?}"
        );
        if flags.contains(&"--novram") {
            assert_eq!(model.resident_bytes(device), ByteSize::ZERO, "{flags:?}");
        }
    }
}
