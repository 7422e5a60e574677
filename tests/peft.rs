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

/// A model of `modules` (each an `[8, 8]` weight) and a rank-4 PEFT LoRA on every one of them,
/// saved with PEFT's `base_model.model.` prefix and `config` beside it. Returns the patcher and
/// the LoRA file.
fn peft_on(
    dir: &std::path::Path,
    modules: &[&str],
    config: &str,
) -> (ModelPatcher, std::path::PathBuf) {
    let m = Model::from_tensors(
        "net",
        modules.iter().enumerate().map(|(i, m)| {
            (
                format!("{m}.weight"),
                common::rand_tensor(&[8, 8], i as u64),
            )
        }),
    )
    .unwrap();
    let t = |shape: &[usize], seed| (common::rand_tensor(shape, seed), Dtype::F32);
    let mut tensors: Vec<(String, Tensor, Dtype)> = Vec::new();
    for (i, m) in modules.iter().enumerate() {
        let seed = 100 + 2 * i as u64;
        for (part, (t, d)) in [
            ("lora_A", t(&[4, 8], seed)),
            ("lora_B", t(&[8, 4], seed + 1)),
        ] {
            tensors.push((format!("base_model.model.{m}.{part}.weight"), t, d));
        }
    }
    let path = dir.join("adapter_model.safetensors");
    save_safetensors(&path, &tensors, &SafetensorsOptions::default()).unwrap();
    std::fs::write(dir.join("adapter_config.json"), config).unwrap();
    (ModelPatcher::on_device(Arc::new(m), DeviceId::Cpu), path)
}

/// The scale the LoRA at `path` is applied with on each of `modules`: its delta over the delta
/// of the same file without a config (scale 1).
fn scales(p: &ModelPatcher, path: &std::path::Path, modules: &[&str]) -> Vec<f32> {
    let unscaled_dir = tempfile::tempdir().unwrap();
    let unscaled = unscaled_dir.path().join("adapter_model.safetensors");
    std::fs::copy(path, &unscaled).unwrap();
    let delta = |lora: &std::path::Path, key: &str| {
        let patches = lora_file::load(lora, p.model().keys()).unwrap().patches;
        let mut styled = p.clone();
        styled.add_patches(patches, 1.0, 1.0).unwrap();
        let w = styled.patched_weight(key).unwrap();
        common::f32s(&(w - p.patched_weight(key).unwrap()).unwrap())
    };
    modules
        .iter()
        .map(|m| {
            let key = format!("{m}.weight");
            ratio(&delta(path, &key), &delta(&unscaled, &key))
        })
        .collect()
}

fn assert_scales(got: &[f32], want: &[f32]) {
    assert!(
        got.len() == want.len() && got.iter().zip(want).all(|(g, w)| (g - w).abs() < 1e-4),
        "scales {got:?}, PEFT's {want:?}"
    );
}

#[test]
fn alpha_pattern_keys_are_regular_expressions_matched_as_peft_does() {
    let modules = [
        "down.attn1.to_out.0",
        "down.attn2.to_out.0",
        "down.attn1.to_q",
        "down.attn2.to_k",
        "down.attn1.to_out_proj",
    ];
    let dir = tempfile::tempdir().unwrap();
    // PEFT: `re.match(rf"(.*\.)?({key})$", name)`. `to_out\.0` matches both `to_out.0`; `attn2\.to_[qk]`
    // is a character class; `to_out` must match a whole trailing name part, so `to_out_proj` and
    // `to_out.0` are not it.
    let (p, path) = peft_on(
        dir.path(),
        &modules,
        r#"{"r": 4, "lora_alpha": 8,
            "alpha_pattern": {"to_out\\.0": 32, "attn2\\.to_[qk]": 4, "to_out": 1}}"#,
    );
    assert_scales(&scales(&p, &path, &modules), &[8.0, 8.0, 2.0, 1.0, 2.0]);
}

#[test]
fn the_first_alpha_pattern_key_in_the_files_order_wins() {
    let modules = ["down.attn1.to_out.0", "down.attn2.to_out.0"];
    let dir = tempfile::tempdir().unwrap();
    // Sorted, `attn1.to_out.0` would come first; PEFT takes the file's first match, `to_out.0`.
    let (p, path) = peft_on(
        dir.path(),
        &modules,
        r#"{"r": 4, "lora_alpha": 8, "alpha_pattern": {"to_out.0": 32, "attn1.to_out.0": 2}}"#,
    );
    assert_scales(&scales(&p, &path, &modules), &[8.0, 8.0]);
    // The other way round, `attn1.to_out.0` is first for attn1 only.
    let dir = tempfile::tempdir().unwrap();
    let (p, path) = peft_on(
        dir.path(),
        &modules,
        r#"{"r": 4, "lora_alpha": 8, "alpha_pattern": {"attn1.to_out.0": 2, "to_out.0": 32}}"#,
    );
    assert_scales(&scales(&p, &path, &modules), &[0.5, 8.0]);
}

#[test]
fn an_alpha_pattern_that_is_no_regular_expression_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let (p, path) = peft_on(
        dir.path(),
        &["down.to_q"],
        r#"{"r": 4, "lora_alpha": 8, "alpha_pattern": {"to_q": 2, "to_(out": 4}}"#,
    );
    let err = lora_file::load(&path, p.model().keys()).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, residency::Error::File { .. })
            && msg.contains("adapter_config.json")
            && msg.contains("`to_(out`"),
        "{msg}"
    );
}
