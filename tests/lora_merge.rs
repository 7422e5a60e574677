//! The `lora_merge` tool end to end: real safetensors files in a tempdir (written and read back
//! with candle's own safetensors code, not ours), the command line parsed as the example parses
//! it, and expectations computed independently with plain candle ops.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use common::rand_tensor;
use residency::float::{self, Dtype, Rounding};
use residency::tools::{merge_files, MergeConfig, MergeReport};
use residency::Error;

const PROJ_IN: &str = "model.diffusion_model.input_blocks.1.1.proj_in.weight";
const PROJ_IN_BIAS: &str = "model.diffusion_model.input_blocks.1.1.proj_in.bias";
const OUT: &str = "model.diffusion_model.out.2.weight";
const POSITION_IDS: &str = "cond_stage_model.transformer.text_model.embeddings.position_ids";

/// A base checkpoint: three f32 weights and an i64 buffer the model does not load.
fn write_base(dir: &Path) -> PathBuf {
    let path = dir.join("base.safetensors");
    let ids = Tensor::arange(0i64, 77, &Device::Cpu)
        .unwrap()
        .reshape((1, 77))
        .unwrap();
    let tensors: HashMap<String, Tensor> = [
        (PROJ_IN.to_string(), rand_tensor(&[32, 16], 1)),
        (PROJ_IN_BIAS.to_string(), rand_tensor(&[32], 2)),
        (OUT.to_string(), rand_tensor(&[8, 32], 3)),
        (POSITION_IDS.to_string(), ids),
    ]
    .into_iter()
    .collect();
    candle_core::safetensors::save(&tensors, &path).unwrap();
    path
}

/// A kohya-named LoRA file: `(module, up, down, alpha)` per adapter.
fn write_lora(dir: &Path, name: &str, adapters: &[(&str, &Tensor, &Tensor, f32)]) -> PathBuf {
    let path = dir.join(name);
    let mut tensors = HashMap::new();
    for (module, up, down, alpha) in adapters {
        tensors.insert(format!("{module}.lora_up.weight"), (*up).clone());
        tensors.insert(format!("{module}.lora_down.weight"), (*down).clone());
        tensors.insert(
            format!("{module}.alpha"),
            Tensor::new(*alpha, &Device::Cpu).unwrap(),
        );
    }
    candle_core::safetensors::save(&tensors, &path).unwrap();
    path
}

fn read(path: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(path, &Device::Cpu).unwrap()
}

fn f32_bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// `base + strength · (alpha / rank) · up · down`, in plain candle.
fn expected(base: &Tensor, terms: &[(f32, f32, &Tensor, &Tensor)]) -> Tensor {
    let mut w = base.clone();
    for (strength, alpha, up, down) in terms {
        let rank = down.dim(0).unwrap() as f32;
        let delta = up
            .matmul(down)
            .unwrap()
            .affine(f64::from(strength * alpha / rank), 0.0)
            .unwrap();
        w = (w + delta).unwrap();
    }
    w
}

fn merge(args: &[String]) -> residency::Result<MergeReport> {
    MergeConfig::from_args(args).and_then(|c| merge_files(&c))
}

fn args(list: &[&dyn AsRef<std::ffi::OsStr>]) -> Vec<String> {
    list.iter()
        .map(|a| a.as_ref().to_string_lossy().into_owned())
        .collect()
}

#[test]
fn merged_file_keeps_base_names_and_shapes_and_adds_the_scaled_lora_delta() {
    let dir = tempfile::tempdir().unwrap();
    let base_path = write_base(dir.path());
    let (up, down) = (rand_tensor(&[32, 4], 10), rand_tensor(&[4, 16], 11));
    let (junk_up, junk_down) = (rand_tensor(&[8, 4], 12), rand_tensor(&[4, 8], 13));
    let lora_path = write_lora(
        dir.path(),
        "style.safetensors",
        &[
            ("lora_unet_input_blocks_1_1_proj_in", &up, &down, 2.0),
            ("lora_unet_no_such_block", &junk_up, &junk_down, 4.0),
        ],
    );
    let out_path = dir.path().join("merged.safetensors");
    let lora_arg = format!("{}:0.7", lora_path.display());
    let report = merge(&args(&[
        &"--model", &base_path, &"--lora", &lora_arg, &"--out", &out_path,
    ]))
    .unwrap();

    let base = read(&base_path);
    let merged = read(&out_path);
    let mut base_names: Vec<_> = base.keys().collect();
    let mut merged_names: Vec<_> = merged.keys().collect();
    base_names.sort();
    merged_names.sort();
    assert_eq!(base_names, merged_names);
    for (k, t) in &base {
        assert_eq!(t.dims(), merged[k].dims(), "{k}");
        assert_eq!(t.dtype(), merged[k].dtype(), "{k}");
    }

    let want = expected(&base[PROJ_IN], &[(0.7, 2.0, &up, &down)]);
    let err = max_abs_diff(&merged[PROJ_IN], &want);
    assert!(err < 1e-6, "patched weight off by {err}");
    // The delta is not negligible, so the check above could fail.
    assert!(max_abs_diff(&merged[PROJ_IN], &base[PROJ_IN]) > 0.05);
    for k in [PROJ_IN_BIAS, OUT] {
        assert_eq!(f32_bits(&base[k]), f32_bits(&merged[k]), "{k} changed");
    }
    assert_eq!(
        base[POSITION_IDS].to_vec2::<i64>().unwrap(),
        merged[POSITION_IDS].to_vec2::<i64>().unwrap()
    );

    assert_eq!(report.patched_keys, vec![PROJ_IN.to_string()]);
    assert_eq!(report.loras.len(), 1);
    assert_eq!(report.loras[0].strength, 0.7);
    assert_eq!(report.loras[0].path, lora_path);
    let ignored = &report.loras[0].ignored_lora_keys;
    for k in [
        "lora_unet_no_such_block.lora_up.weight",
        "lora_unet_no_such_block.lora_down.weight",
        "lora_unet_no_such_block.alpha",
    ] {
        assert!(ignored.iter().any(|i| i == k), "{k} not in {ignored:?}");
    }
    assert_eq!(ignored.len(), 3, "{ignored:?}");
    assert_eq!(report.passed_through, vec![POSITION_IDS.to_string()]);
    assert_eq!(report.tensors_written, 4);
    let text = report.to_string();
    assert!(text.contains("ignored: lora_unet_no_such_block.lora_up.weight"));
    assert!(text.contains("1 keys patched"), "{text}");
}

#[test]
fn two_loras_merge_at_their_own_strengths() {
    let dir = tempfile::tempdir().unwrap();
    let base_path = write_base(dir.path());
    let (a_up, a_down) = (rand_tensor(&[32, 4], 20), rand_tensor(&[4, 16], 21));
    let (b_up, b_down) = (rand_tensor(&[32, 8], 22), rand_tensor(&[8, 16], 23));
    let (c_up, c_down) = (rand_tensor(&[8, 2], 24), rand_tensor(&[2, 32], 25));
    let a = write_lora(
        dir.path(),
        "a.safetensors",
        &[("lora_unet_input_blocks_1_1_proj_in", &a_up, &a_down, 4.0)],
    );
    let b = write_lora(
        dir.path(),
        "b.safetensors",
        &[
            ("lora_unet_input_blocks_1_1_proj_in", &b_up, &b_down, 2.0),
            ("lora_unet_out_2", &c_up, &c_down, 1.0),
        ],
    );
    let out_path = dir.path().join("merged.safetensors");
    let a_arg = format!("{}:0.5", a.display());
    let report = merge(&args(&[
        &"--model",
        &base_path,
        &"--lora",
        &a_arg,
        &"--lora",
        &b,
        &"--strength",
        &"-1.5",
        &"--out",
        &out_path,
    ]))
    .unwrap();
    let base = read(&base_path);
    let merged = read(&out_path);
    let want_proj = expected(
        &base[PROJ_IN],
        &[(0.5, 4.0, &a_up, &a_down), (-1.5, 2.0, &b_up, &b_down)],
    );
    let want_out = expected(&base[OUT], &[(-1.5, 1.0, &c_up, &c_down)]);
    assert!(max_abs_diff(&merged[PROJ_IN], &want_proj) < 1e-6);
    assert!(max_abs_diff(&merged[OUT], &want_out) < 1e-6);
    assert_eq!(
        f32_bits(&base[PROJ_IN_BIAS]),
        f32_bits(&merged[PROJ_IN_BIAS])
    );
    let strengths: Vec<f32> = report.loras.iter().map(|l| l.strength).collect();
    assert_eq!(strengths, vec![0.5, -1.5]);
    assert_eq!(
        report.patched_keys,
        vec![PROJ_IN.to_string(), OUT.to_string()]
    );
    assert_eq!(report.loras[1].patched_keys.len(), 2);
    assert!(report.loras.iter().all(|l| l.ignored_lora_keys.is_empty()));
}

#[test]
fn fp8_target_rounds_each_weight_once_with_its_key_seed() {
    let dir = tempfile::tempdir().unwrap();
    let base_path = write_base(dir.path());
    let (up, down) = (rand_tensor(&[32, 4], 30), rand_tensor(&[4, 16], 31));
    let lora = write_lora(
        dir.path(),
        "l.safetensors",
        &[("lora_unet_input_blocks_1_1_proj_in", &up, &down, 4.0)],
    );
    let out_path = dir.path().join("merged_fp8.safetensors");
    merge(&args(&[
        &"--model",
        &base_path,
        &"--lora",
        &lora,
        &"--dtype=fp8_e4m3fn",
        &"--out",
        &out_path,
    ]))
    .unwrap();
    let base = read(&base_path);
    let merged = read(&out_path);
    for k in [PROJ_IN, PROJ_IN_BIAS, OUT] {
        assert_eq!(merged[k].dtype(), DType::F8E4M3, "{k}");
    }
    assert_eq!(merged[POSITION_IDS].dtype(), DType::I64);
    // Unpatched weights: exactly the key-seeded stochastic rounding of the base values.
    for k in [PROJ_IN_BIAS, OUT] {
        let want = float::from_f32(&base[k], Dtype::F8E4M3FN, Rounding::stochastic_for(k)).unwrap();
        let got = merged[k].to_dtype(DType::F32).unwrap();
        assert_eq!(
            f32_bits(&want.to_dtype(DType::F32).unwrap()),
            f32_bits(&got),
            "{k}"
        );
    }
    // The patched weight: one rounding of the exact merge, so within one e4m3 step (2^-3
    // relative, 2^-9 absolute in the subnormals) of the f32 expectation.
    let want = expected(&base[PROJ_IN], &[(1.0, 4.0, &up, &down)])
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let got = merged[PROJ_IN]
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    for (w, g) in want.iter().zip(&got) {
        assert!((w - g).abs() <= w.abs() / 8.0 + 1.0 / 512.0, "{w} -> {g}");
    }
}

#[test]
fn target_equal_to_storage_dtype_gives_the_plain_merge_bits() {
    let dir = tempfile::tempdir().unwrap();
    let base_path = write_base(dir.path());
    let (up, down) = (rand_tensor(&[32, 4], 40), rand_tensor(&[4, 16], 41));
    let lora = write_lora(
        dir.path(),
        "l.safetensors",
        &[("lora_unet_input_blocks_1_1_proj_in", &up, &down, 4.0)],
    );
    let plain = dir.path().join("plain.safetensors");
    let cast = dir.path().join("cast.safetensors");
    merge(&args(&[
        &"--model", &base_path, &"--lora", &lora, &"--out", &plain,
    ]))
    .unwrap();
    merge(&args(&[
        &"--model", &base_path, &"--lora", &lora, &"--dtype", &"f32", &"--out", &cast,
    ]))
    .unwrap();
    assert_eq!(
        std::fs::read(&plain).unwrap(),
        std::fs::read(&cast).unwrap()
    );
}

#[test]
fn bad_command_lines_are_errors_naming_the_flag() {
    let flag_of = |list: &[&str]| match MergeConfig::from_args(list) {
        Err(Error::InvalidFlag { flag, reason }) => format!("{flag}: {reason}"),
        Err(Error::UnknownFlag { flag, .. }) => format!("unknown {flag}"),
        other => panic!("{list:?} gave {other:?}"),
    };
    let base = ["--model", "b.safetensors", "--out", "o.safetensors"];
    let with = |extra: &[&'static str]| {
        let mut v: Vec<&str> = base.to_vec();
        v.extend_from_slice(extra);
        v
    };
    assert!(flag_of(&["--lora", "l.safetensors", "--out", "o"]).starts_with("--model: is required"));
    assert!(flag_of(&["--model", "b", "--lora", "l"]).starts_with("--out: is required"));
    assert!(flag_of(&base).starts_with("--lora: is required"));
    let m = flag_of(&with(&["--lora", "l.safetensors:strong"]));
    assert!(m.starts_with("--lora") && m.contains("`strong`"), "{m}");
    let m = flag_of(&with(&["--lora", "l.safetensors", "--strength", "nan"]));
    assert!(m.starts_with("--strength") && m.contains("`nan`"), "{m}");
    let m = flag_of(&with(&["--lora", "l", "--dtype", "int4"]));
    assert!(m.starts_with("--dtype") && m.contains("int4"), "{m}");
    let m = flag_of(&with(&["--lora"]));
    assert_eq!(m, "--lora: needs a value");
    let m = flag_of(&with(&["--lora", "l", "--model", "c"]));
    assert_eq!(m, "--model: given more than once");
    assert_eq!(flag_of(&with(&["--lroa", "l"])), "unknown --lroa");
    let ok = MergeConfig::from_args(&with(&["--lora", "x:-0.25", "--strength=2"])).unwrap();
    assert_eq!(ok.loras[0].path, PathBuf::from("x"));
    assert_eq!(ok.loras[0].strength, Some(-0.25));
    assert_eq!(ok.strength, 2.0);
    assert_eq!(ok.dtype, None);
}

#[test]
fn unreadable_inputs_are_errors_naming_the_file_and_write_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let base_path = write_base(dir.path());
    let out = dir.path().join("out.safetensors");
    let missing = dir.path().join("missing.safetensors");
    let garbage = dir.path().join("garbage.safetensors");
    std::fs::write(&garbage, b"not a safetensors file").unwrap();
    let (up, down) = (rand_tensor(&[32, 4], 50), rand_tensor(&[4, 99], 51));
    let misfit = write_lora(
        dir.path(),
        "misfit.safetensors",
        &[("lora_unet_input_blocks_1_1_proj_in", &up, &down, 1.0)],
    );
    let path_of = |a: Vec<String>| match merge(&a) {
        Err(Error::File { path, reason }) => (path, reason),
        other => panic!("{a:?} gave {other:?}"),
    };
    let (p, _) = path_of(args(&[
        &"--model", &base_path, &"--lora", &missing, &"--out", &out,
    ]));
    assert_eq!(p, missing);
    let (p, _) = path_of(args(&[
        &"--model", &garbage, &"--lora", &misfit, &"--out", &out,
    ]));
    assert_eq!(p, garbage);
    let (p, _) = path_of(args(&[
        &"--model", &base_path, &"--lora", &garbage, &"--out", &out,
    ]));
    assert_eq!(p, garbage);
    // A LoRA whose shapes do not fit the base names the LoRA file and the weight.
    let (p, reason) = path_of(args(&[
        &"--model", &base_path, &"--lora", &misfit, &"--out", &out,
    ]));
    assert_eq!(p, misfit);
    assert!(reason.contains(PROJ_IN), "{reason}");
    assert!(!out.exists());
    // Writing over the base is refused.
    match merge(&args(&[
        &"--model", &base_path, &"--lora", &misfit, &"--out", &base_path,
    ])) {
        Err(Error::InvalidFlag { flag, .. }) => assert_eq!(flag, "--out"),
        other => panic!("{other:?}"),
    }
}

/// A base of one fp8 weight `proj.weight` and its per-tensor scale `scale`.
fn write_fp8_base(dir: &Path, scale: f32) -> PathBuf {
    let base = dir.join("fp8.safetensors");
    let w = float::from_f32(&rand_tensor(&[8, 8], 5), Dtype::F8E4M3FN, Rounding::Nearest).unwrap();
    let tensors: HashMap<String, Tensor> = [
        ("proj.weight".to_string(), w),
        (
            "proj.weight_scale".to_string(),
            Tensor::new(scale, &Device::Cpu).unwrap(),
        ),
    ]
    .into_iter()
    .collect();
    candle_core::safetensors::save(&tensors, &base).unwrap();
    base
}

#[test]
fn a_base_the_loader_refuses_for_an_infinite_fp8_scale_is_refused_by_the_merge_alike() {
    let dir = tempfile::tempdir().unwrap();
    let base = write_fp8_base(dir.path(), f32::INFINITY);
    let Err(loader) = residency::Model::from_safetensors("fp8", &[&base]) else {
        panic!("the loader refuses it")
    };
    assert!(matches!(loader, Error::BadWeight { .. }), "{loader}");
    let (up, down) = (rand_tensor(&[8, 2], 6), rand_tensor(&[2, 8], 7));
    let lora = write_lora(dir.path(), "l.safetensors", &[("proj", &up, &down, 2.0)]);
    let out = dir.path().join("out.safetensors");
    let merged = merge(&args(&[
        &"--model", &base, &"--lora", &lora, &"--out", &out,
    ]));
    let Err(err) = merged else {
        panic!("the merge refuses it too")
    };
    assert!(
        matches!(&err, Error::BadWeight { key, .. } if key == "proj.weight_scale"),
        "{err}"
    );
    assert_eq!(
        err.to_string().replace("fp8", "base"),
        loader.to_string().replace("fp8", "base")
    );
    assert!(!out.exists(), "nothing written");
}

#[test]
fn a_merge_never_writes_an_fp8_scale_the_loader_refuses() {
    // A tiny (valid) per-tensor scale narrowed to fp8 by `--dtype` becomes 0, which the loader
    // refuses: the merge wrote it anyway (found by the mutation test, 7 of 52 293 inputs).
    let dir = tempfile::tempdir().unwrap();
    let base = write_fp8_base(dir.path(), 1e-30);
    assert!(
        residency::Model::from_safetensors("fp8", &[&base]).is_ok(),
        "a valid base"
    );
    let (up, down) = (rand_tensor(&[8, 2], 6), rand_tensor(&[2, 8], 7));
    let lora = write_lora(dir.path(), "l.safetensors", &[("proj", &up, &down, 2.0)]);
    let out = dir.path().join("out.safetensors");
    let Err(err) = merge(&args(&[
        &"--model",
        &base,
        &"--lora",
        &lora,
        &"--dtype=fp8_e4m3fn",
        &"--out",
        &out,
    ])) else {
        panic!("the merge must refuse the scale it would write")
    };
    assert!(
        matches!(&err, Error::BadWeight { key, .. } if key == "proj.weight_scale"),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains("scale 0 is not a finite non-zero number"),
        "the loader's message: {err}"
    );
    assert!(!out.exists(), "nothing written");
}
