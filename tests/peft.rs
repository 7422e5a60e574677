//! PEFT LoRAs keep their scale in `adapter_config.json`: a file without `.alpha` tensors is
//! scaled `lora_alpha / r` when the config is beside it (PEFT's own rule), 1 without it.

mod common;

use std::sync::Arc;

use candle_core::Tensor;
use residency::patcher::{lora_file, ModelPatcher};
use residency::vram::DeviceId;
use residency::weights::{save_safetensors, Model, SafetensorsOptions};
use residency::Dtype;

fn base() -> ModelPatcher {
    let m = Model::from_tensors(
        "net",
        [
            ("to_q.weight", common::rand_tensor(&[8, 8], 1)),
            ("to_k.weight", common::rand_tensor(&[8, 8], 2)),
        ],
    )
    .unwrap();
    ModelPatcher::on_device(Arc::new(m), DeviceId::Cpu)
}

/// PEFT's layout: rank-4 `lora_A` / `lora_B` for both projections, no `.alpha`.
fn write_peft(dir: &std::path::Path, config: Option<&str>) -> std::path::PathBuf {
    let t = |shape: &[usize], seed| (common::rand_tensor(shape, seed), Dtype::F32);
    let tensors: Vec<(String, Tensor, Dtype)> = [
        ("to_q.lora_A.weight", t(&[4, 8], 10)),
        ("to_q.lora_B.weight", t(&[8, 4], 11)),
        ("to_k.lora_A.weight", t(&[4, 8], 12)),
        ("to_k.lora_B.weight", t(&[8, 4], 13)),
    ]
    .into_iter()
    .map(|(k, (t, d))| (k.to_string(), t, d))
    .collect();
    let path = dir.join("adapter_model.safetensors");
    save_safetensors(&path, &tensors, &SafetensorsOptions::default()).unwrap();
    if let Some(c) = config {
        std::fs::write(dir.join("adapter_config.json"), c).unwrap();
    }
    path
}

/// The delta the LoRA adds to `key`, as f32 values.
fn delta(lora_path: &std::path::Path, key: &str) -> Vec<f32> {
    let p = base();
    let lora = lora_file::load(lora_path, p.model().keys()).unwrap();
    let mut styled = p.clone();
    styled.add_patches(lora.patches, 1.0, 1.0).unwrap();
    let w = styled.patched_weight(key).unwrap();
    let w0 = p.patched_weight(key).unwrap();
    common::f32s(&(w - w0).unwrap())
}

fn ratio(a: &[f32], b: &[f32]) -> f32 {
    let (i, _) = b
        .iter()
        .enumerate()
        .max_by(|x, y| x.1.abs().total_cmp(&y.1.abs()))
        .unwrap();
    a[i] / b[i]
}

#[test]
fn a_peft_lora_is_scaled_by_its_configs_alpha_over_rank() {
    let plain = tempfile::tempdir().unwrap();
    let unscaled = delta(&write_peft(plain.path(), None), "to_q.weight");
    let with = tempfile::tempdir().unwrap();
    let path = write_peft(
        with.path(),
        Some(
            r#"{"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["to_q", "to_k"]}"#,
        ),
    );
    let scaled = delta(&path, "to_q.weight");
    assert!(
        (ratio(&scaled, &unscaled) - 2.0).abs() < 1e-5,
        "alpha 8 / r 4 = 2"
    );
    for (s, u) in scaled.iter().zip(&unscaled) {
        assert!(
            (s - 2.0 * u).abs() <= 1e-5 * u.abs().max(1.0),
            "{s} vs 2 × {u}"
        );
    }
}

#[test]
fn alpha_pattern_and_rslora_follow_peft() {
    let plain = tempfile::tempdir().unwrap();
    let unscaled = delta(&write_peft(plain.path(), None), "to_k.weight");
    let dir = tempfile::tempdir().unwrap();
    let path = write_peft(
        dir.path(),
        Some(r#"{"r": 4, "lora_alpha": 8, "alpha_pattern": {"to_k": 2}, "use_rslora": true}"#),
    );
    // to_k: alpha 2 from the pattern, rsLoRA: 2 / √4 = 1.
    assert!((ratio(&delta(&path, "to_k.weight"), &unscaled) - 1.0).abs() < 1e-5);
    // to_q: alpha 8, rsLoRA: 8 / √4 = 4.
    let unscaled_q = delta(&write_peft(plain.path(), None), "to_q.weight");
    assert!((ratio(&delta(&path, "to_q.weight"), &unscaled_q) - 4.0).abs() < 1e-5);
}

#[test]
fn a_broken_adapter_config_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_peft(dir.path(), Some(r#"{"r": 4}"#));
    let err = lora_file::load(&path, base().model().keys()).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("adapter_config.json") && msg.contains("lora_alpha"),
        "{msg}"
    );
}
