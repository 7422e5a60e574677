//! Unit tests of the streaming merge: its output against the in-memory merge it replaced (kept
//! here as the reference), byte for byte, on MiniLM's real checkpoint and on a file with every
//! storage dtype; and its all-or-nothing writing.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use safetensors::tensor::Dtype as StDtype;

use super::*;
use crate::float::uniform_tensor;
use crate::weights::{self, RawTensor};

/// The merge as it was before it streamed: the whole model in memory, every merged weight
/// collected, then one write. The reference the streaming merge must match byte for byte.
fn merge_in_memory(config: &MergeConfig) -> Result<()> {
    let model = Arc::new(Model::from_safetensors("reference", &[&config.model])?);
    let mut patcher = ModelPatcher::new(Arc::clone(&model), DeviceId::Cpu, DeviceId::Cpu);
    for l in &config.loras {
        let strength = l.strength.unwrap_or(config.strength);
        let loaded = lora_file::load(l.path.as_path(), model.keys())?;
        patcher.add_patches(loaded.patches, strength, 1.0)?;
    }
    let merged: Vec<(String, Tensor, Dtype)> = match config.dtype {
        None => patcher.patched_state_dict()?,
        Some(target) => model
            .slots()
            .iter()
            .map(|slot| {
                let key = slot.name();
                let t = if target == slot.dtype() {
                    patcher.patched_weight(key)?
                } else {
                    let rounding = if target.is_fp8() {
                        Rounding::stochastic_for(key)
                    } else {
                        Rounding::Nearest
                    };
                    float::from_f32(&patcher.patched_weight_f32(key)?, target, rounding)?
                };
                Ok((key.to_string(), t, target))
            })
            .collect::<Result<_>>()?,
    };
    let raw = weights::read_raw_tensors(&config.model, model.skipped_tensors())?;
    weights::save_safetensors_with_raw(&config.out, &merged, &raw, &SafetensorsOptions::default())
}

/// A kohya-style LoRA file with one rank-`r` adapter per `(module, out, in)`.
fn write_lora(path: &Path, modules: &[(&str, usize, usize)], r: usize, seed: u64) {
    let mut tensors = HashMap::new();
    for (i, (module, out, inn)) in modules.iter().enumerate() {
        let s = seed + 10 * i as u64;
        let up = (uniform_tensor(&[*out, r], s).unwrap() * 0.1).unwrap();
        let down = (uniform_tensor(&[r, *inn], s + 1).unwrap() * 0.1).unwrap();
        tensors.insert(format!("{module}.lora_up.weight"), up);
        tensors.insert(format!("{module}.lora_down.weight"), down);
        tensors.insert(
            format!("{module}.alpha"),
            Tensor::new(r as f32 / 2.0, &Device::Cpu).unwrap(),
        );
    }
    candle_core::safetensors::save(&tensors, path).unwrap();
}

/// Merges `base` with `loras` at every output dtype, streaming and in memory, and checks that the
/// files are identical and that `expect_patched` keys were patched.
fn assert_streaming_matches_in_memory(
    dir: &Path,
    base: &Path,
    loras: &[(PathBuf, Option<f32>)],
    expect_patched: &[&str],
) {
    let targets = [
        None,
        Some(Dtype::F32),
        Some(Dtype::F16),
        Some(Dtype::BF16),
        Some(Dtype::F8E4M3FN),
        Some(Dtype::F8E5M2),
    ];
    for target in targets {
        let config = |out: &str| MergeConfig {
            model: base.to_path_buf(),
            loras: loras
                .iter()
                .map(|(path, strength)| LoraInput {
                    path: path.clone(),
                    strength: *strength,
                })
                .collect(),
            strength: 0.8,
            dtype: target,
            out: dir.join(out),
        };
        let report = merge_files(&config("streamed.safetensors")).expect("streaming merge");
        merge_in_memory(&config("in_memory.safetensors")).expect("in-memory merge");
        for key in expect_patched {
            assert!(
                report.patched_keys.iter().any(|k| k == key),
                "{key} was not patched: {:?}",
                report.patched_keys
            );
        }
        let streamed = std::fs::read(dir.join("streamed.safetensors")).unwrap();
        let in_memory = std::fs::read(dir.join("in_memory.safetensors")).unwrap();
        assert_eq!(streamed.len(), in_memory.len(), "{target:?}: file sizes");
        assert!(streamed == in_memory, "{target:?}: the files differ");
    }
}

#[test]
fn streaming_merge_of_minilm_writes_the_bytes_of_the_in_memory_merge() {
    let base = Path::new(env!("CARGO_MANIFEST_DIR")).join(".cache/minilm/model.safetensors");
    assert!(
        base.is_file(),
        "MiniLM is missing ({}): run `bash scripts/fetch-minilm.sh` first",
        base.display()
    );
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (
        dir.path().join("a.safetensors"),
        dir.path().join("b.safetensors"),
    );
    write_lora(
        &a,
        &[
            ("encoder.layer.0.attention.self.query", 384, 384),
            ("encoder.layer.3.intermediate.dense", 1536, 384),
        ],
        8,
        1,
    );
    write_lora(
        &b,
        &[("encoder.layer.0.attention.self.query", 384, 384)],
        4,
        2,
    );
    assert_streaming_matches_in_memory(
        dir.path(),
        &base,
        &[(a, None), (b, Some(-0.5))],
        &[
            "encoder.layer.0.attention.self.query.weight",
            "encoder.layer.3.intermediate.dense.weight",
        ],
    );
}

#[test]
fn streaming_merge_matches_in_memory_for_every_storage_dtype_and_a_scaled_fp8_weight() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.safetensors");
    let w = |shape: &[usize], seed| uniform_tensor(shape, seed).unwrap();
    let tensors = vec![
        (
            "f64.weight",
            w(&[24, 16], 1).to_dtype(DType::F64).unwrap(),
            Dtype::F64,
        ),
        (
            "f16.weight",
            w(&[24, 16], 2).to_dtype(DType::F16).unwrap(),
            Dtype::F16,
        ),
        (
            "bf16.weight",
            w(&[16, 24], 3).to_dtype(DType::BF16).unwrap(),
            Dtype::BF16,
        ),
        (
            "e4m3.weight",
            float::from_f32(&w(&[16, 16], 4), Dtype::F8E4M3FN, Rounding::Nearest).unwrap(),
            Dtype::F8E4M3FN,
        ),
        (
            "e4m3.weight_scale",
            Tensor::new(0.5f32, &Device::Cpu).unwrap(),
            Dtype::F32,
        ),
        (
            "e5m2.weight",
            float::from_f32(&w(&[16, 16], 5), Dtype::F8E5M2, Rounding::Nearest).unwrap(),
            Dtype::F8E5M2,
        ),
        ("untouched.bias", w(&[16], 6), Dtype::F32),
    ];
    let ids = RawTensor {
        name: "position_ids".into(),
        dtype: StDtype::I64,
        shape: vec![1, 8],
        data: (0..8i64).flat_map(|i| i.to_le_bytes()).collect(),
    };
    weights::save_safetensors_with_raw(&base, &tensors, &[ids], &SafetensorsOptions::default())
        .unwrap();
    let lora = dir.path().join("lora.safetensors");
    write_lora(
        &lora,
        &[
            ("f64", 24, 16),
            ("f16", 24, 16),
            ("bf16", 16, 24),
            ("e4m3", 16, 16),
            ("e5m2", 16, 16),
        ],
        4,
        7,
    );
    assert_streaming_matches_in_memory(
        dir.path(),
        &base,
        &[(lora, None)],
        &[
            "f64.weight",
            "f16.weight",
            "bf16.weight",
            "e4m3.weight",
            "e5m2.weight",
        ],
    );
}

#[test]
fn a_tensor_that_fails_while_streaming_leaves_no_file_and_an_existing_one_intact() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.safetensors");
    std::fs::write(&out, b"the previous file").unwrap();
    let tensor = |name: &str, fail: bool| weights::LazyTensor {
        name: name.into(),
        dtype: StDtype::U8,
        shape: vec![4],
        len: 4,
        source: weights::Source::Produce(Box::new(move |sink| {
            if fail {
                Err(Error::Device {
                    device: "test".into(),
                    reason: "injected".into(),
                })
            } else {
                // In two pieces: a source may hand its bytes over in parts.
                sink(&[1, 2])?;
                sink(&[3, 4])
            }
        })),
    };
    let err = weights::save_safetensors_streaming(
        &out,
        vec![tensor("a", false), tensor("b", true), tensor("c", false)],
        &SafetensorsOptions::default(),
    )
    .expect_err("a tensor failed");
    assert!(err.to_string().contains("injected"), "{err}");
    assert_eq!(std::fs::read(&out).unwrap(), b"the previous file");
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert_eq!(left.len(), 1, "a temporary file was left behind");
    // The same tensors, none failing, replace the file.
    weights::save_safetensors_streaming(
        &out,
        vec![tensor("a", false), tensor("c", false)],
        &SafetensorsOptions::default(),
    )
    .expect("written");
    let written = std::fs::read(&out).unwrap();
    let st = safetensors::SafeTensors::deserialize(&written).unwrap();
    assert_eq!(st.tensor("c").unwrap().data(), &[1, 2, 3, 4]);
}
