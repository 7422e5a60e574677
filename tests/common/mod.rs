//! Shared helpers for the integration tests.
#![allow(dead_code)]

pub mod gguf;
pub mod warnings;

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use residency::float::Dtype;
use residency::loader::MemoryManager;
use residency::patcher::ModelPatcher;
use residency::vram::{Config, DeviceId, Hardware};
use residency::weights::{save_safetensors, Model, SafetensorsOptions};
use residency::ByteSize;

pub const MIB: u64 = 1024 * 1024;
pub const GIB: u64 = 1024 * MIB;

/// A deterministic pseudo-random f32 tensor ([`residency::float::uniform_tensor`]).
pub fn rand_tensor(shape: &[usize], seed: u64) -> Tensor {
    residency::float::uniform_tensor(shape, seed).unwrap()
}

/// Writes a small real model to a safetensors file and reads it back.
pub fn small_model_file(dir: &std::path::Path, name: &str, dtype: Dtype) -> Model {
    let path = dir.join(format!("{name}.safetensors"));
    let mut tensors = Vec::new();
    for (i, (key, shape)) in [
        ("blocks.0.attn.q.weight", vec![16, 16]),
        ("blocks.0.attn.k.weight", vec![16, 16]),
        ("blocks.0.mlp.fc1.weight", vec![32, 16]),
        ("blocks.0.mlp.fc1.bias", vec![32]),
        ("blocks.1.conv.weight", vec![8, 4, 3, 3]),
    ]
    .into_iter()
    .enumerate()
    {
        let t = rand_tensor(&shape, i as u64 + 7);
        let t = residency::float::from_f32(&t, dtype, residency::Rounding::Nearest).unwrap();
        tensors.push((key.to_string(), t, dtype));
    }
    save_safetensors(&path, &tensors, &SafetensorsOptions::default()).unwrap();
    Model::from_safetensors(name, &[path]).unwrap()
}

/// A model whose weights are broadcast views of one scalar: any size, no memory. Resident copies
/// of unpatched f32 weights share that storage, so multi-GiB scheduling scenarios run for real
/// on a small machine.
pub fn virtual_model(name: &str, weight_sizes: &[u64]) -> Model {
    let tensors = weight_sizes.iter().enumerate().map(|(i, &bytes)| {
        let n = (bytes / 4) as usize;
        let t = Tensor::zeros(1, DType::F32, &Device::Cpu)
            .unwrap()
            .broadcast_as(n)
            .unwrap();
        (format!("w{i}"), t)
    });
    Model::from_tensors(name, tensors).unwrap()
}

pub fn cpu_patcher(model: Model) -> ModelPatcher {
    ModelPatcher::new(Arc::new(model), DeviceId::Cpu, DeviceId::Cpu)
}

/// A manager on a budgeted CPU device of `budget` bytes, with the Linux default reserve.
pub fn manager(budget: ByteSize, extra_flags: &[&str]) -> MemoryManager {
    let mut args = vec!["--vram-budget".to_string(), budget.bytes().to_string()];
    args.extend(extra_flags.iter().map(|s| s.to_string()));
    MemoryManager::new(
        Config::from_args(&args).unwrap(),
        Hardware::cpu_only(ByteSize::gib(64)),
    )
    .unwrap()
}

/// A manager built from `flags` alone, on a CPU-only machine with 64 GiB of host memory.
pub fn manager_with(flags: &[&str]) -> MemoryManager {
    MemoryManager::new(
        Config::from_args(flags).unwrap(),
        Hardware::cpu_only(ByteSize::gib(64)),
    )
    .unwrap()
}

/// The bits of an f32 tensor's values, for exact comparisons.
pub fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .into_iter()
        .map(f32::to_bits)
        .collect()
}

pub fn f32s(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
}

/// `err` is a [`residency::Error::PatchShape`] naming `key`, `weight` and `patch`.
pub fn assert_patch_shape(err: &residency::Error, key: &str, weight: &[usize], patch: &[usize]) {
    match err {
        residency::Error::PatchShape {
            key: k,
            weight_shape,
            patch_shape,
            ..
        } => assert_eq!(
            (k.as_str(), weight_shape.as_slice(), patch_shape.as_slice()),
            (key, weight, patch)
        ),
        other => panic!("expected a PatchShape error, got {other}"),
    }
}
