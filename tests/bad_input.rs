//! Bad values are refused where they enter — `add_patches`, `lora::load`, reading or building a
//! model — with a typed error naming the key, never later during a load; and inputs that used to
//! panic (overflowing shapes, indices and sizes, too many dimensions) are typed errors. A GGUF
//! file, mutated any way, is refused naming the file or loads into weights that can all be used.

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Module, Tensor};
use common::*;
use residency::loader::LoadOptions;
use residency::nn::moe::moe_gemm_gguf;
use residency::patcher::{lora, Lora, ModelPatcher, Oft, Patch};
use residency::quantized::{gguf_file, QMatMul};
use residency::vram::{host_from_texts, DeviceId};
use residency::weights::Model;
use residency::{ByteSize, Dtype, Error};
use safetensors::tensor::{Dtype as St, TensorView};

const CPU: DeviceId = DeviceId::Cpu;

fn patcher(shape: &[usize]) -> ModelPatcher {
    let m = Model::from_tensors("m", [("w", rand_tensor(shape, 1))]).unwrap();
    ModelPatcher::new(Arc::new(m), CPU, CPU)
}

fn assert_bad_patch(err: Error, key: &str, needle: &str) {
    match &err {
        Error::BadPatch { key: k, reason } => {
            assert_eq!(k, key, "{err}");
            assert!(reason.contains(needle), "{err}");
        }
        other => panic!("expected BadPatch on `{key}`, got {other}"),
    }
}

#[test]
fn non_finite_strengths_are_refused_when_added() {
    for (sp, sm) in [
        (f32::NAN, 1.0),
        (1.0, f32::INFINITY),
        (f32::NEG_INFINITY, 1.0),
    ] {
        let mut p = patcher(&[8, 8]);
        let diff = Patch::Diff {
            diff: rand_tensor(&[8, 8], 2),
            pad: false,
        };
        let err = p.add_patches([("w", diff)], sp, sm).unwrap_err();
        assert_bad_patch(err, "w", "not a finite number");
        assert!(p.patches().is_empty(), "nothing added");
    }
}

#[test]
fn nan_in_patch_tensors_is_refused_when_added_and_nothing_is_added() {
    let mut nan_blocks = rand_tensor(&[2, 4, 4], 3)
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    nan_blocks[5] = f32::NAN;
    let blocks = Tensor::from_vec(nan_blocks, (2, 4, 4), &Device::Cpu).unwrap();
    let mut up = rand_tensor(&[8, 2], 4)
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    up[0] = f32::INFINITY;
    let up = Tensor::from_vec(up, (8, 2), &Device::Cpu).unwrap();
    let cases = [
        (Patch::Oft(Oft::new(blocks)), "oft_blocks"),
        (Patch::Lora(Lora::new(up, rand_tensor(&[2, 8], 5))), "up"),
    ];
    for (bad, part) in cases {
        let mut p = patcher(&[8, 8]);
        let good = Patch::Diff {
            diff: rand_tensor(&[8, 8], 6),
            pad: false,
        };
        // One bad entry in the call: none of the call's entries are added.
        let err = p
            .add_patches([("w", good), ("w", bad)], 1.0, 1.0)
            .unwrap_err();
        assert_bad_patch(err, "w", part);
        assert!(p.patches().is_empty());
    }
    // A NaN alpha in memory is refused too.
    let mut l = Lora::new(rand_tensor(&[8, 2], 7), rand_tensor(&[2, 8], 8));
    l.alpha = Some(f32::NAN);
    let mut p = patcher(&[8, 8]);
    assert_bad_patch(
        p.add_patches([("w", Patch::Lora(l))], 1.0, 1.0)
            .unwrap_err(),
        "w",
        "alpha",
    );
}

#[test]
fn a_clone_with_bad_values_never_reaches_a_load_that_would_evict() {
    // Before: the clone's NaN OFT blocks passed add_patches, the load evicted the other model and
    // then failed. Now add_patches refuses them and the other model is untouched.
    let mm = manager(
        ByteSize::kib(2),
        &["--reserve-vram", "0", "--inference-memory", "1KiB"],
    );
    let other = patcher(&[16, 16]);
    mm.load_model_gpu(&other).unwrap();
    let mut clone = patcher(&[16, 16]);
    let blocks = Tensor::full(f32::NAN, (4, 4, 4), &Device::Cpu).unwrap();
    assert!(clone
        .add_patches([("w", Patch::Oft(Oft::new(blocks)))], 1.0, 1.0)
        .is_err());
    mm.load_models_gpu(std::slice::from_ref(&clone), LoadOptions::default())
        .unwrap();
    assert!(mm.ledger(CPU) <= ByteSize::kib(2));
}

fn write(path: &std::path::Path, entries: &[(&str, St, Vec<usize>, Vec<u8>)]) {
    let views: Vec<(String, TensorView)> = entries
        .iter()
        .map(|(n, d, s, b)| (n.to_string(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    std::fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
}

fn f32_data(n: usize, v: f32) -> Vec<u8> {
    (0..n).flat_map(|_| v.to_le_bytes()).collect()
}

#[test]
fn a_lora_alpha_with_more_than_one_value_is_refused_by_lora_load() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("l.safetensors");
    write(
        &path,
        &[
            (
                "lora_unet_w.lora_up.weight",
                St::F32,
                vec![8, 2],
                f32_data(16, 0.1),
            ),
            (
                "lora_unet_w.lora_down.weight",
                St::F32,
                vec![2, 8],
                f32_data(16, 0.1),
            ),
            ("lora_unet_w.alpha", St::F32, vec![2], f32_data(2, 4.0)),
        ],
    );
    let err = lora::load(path.as_path(), ["diffusion_model.w.weight"]).unwrap_err();
    assert_bad_patch(err, "lora_unet_w.alpha", "single number");
    // A one-value alpha of any shape ([1] here) is fine.
    write(
        &path,
        &[
            (
                "lora_unet_w.lora_up.weight",
                St::F32,
                vec![8, 2],
                f32_data(16, 0.1),
            ),
            (
                "lora_unet_w.lora_down.weight",
                St::F32,
                vec![2, 8],
                f32_data(16, 0.1),
            ),
            ("lora_unet_w.alpha", St::F32, vec![1], f32_data(1, 4.0)),
        ],
    );
    let l = lora::load(path.as_path(), ["diffusion_model.w.weight"]).unwrap();
    assert_eq!(l.patches.len(), 1);
}

#[test]
fn an_fp8_weight_scale_that_is_not_finite_and_non_zero_is_refused_when_the_model_is_built() {
    let dir = tempfile::tempdir().unwrap();
    for scale in [f32::NAN, f32::INFINITY, 0.0] {
        let path = dir.path().join("q.safetensors");
        write(
            &path,
            &[
                ("l.weight", St::F8_E4M3, vec![4, 4], vec![0x30; 16]),
                ("l.weight_scale", St::F32, vec![1], f32_data(1, scale)),
            ],
        );
        let err = Model::from_safetensors("q", &[&path]).unwrap_err();
        assert!(
            matches!(&err, Error::BadWeight { key, .. } if key == "l.weight_scale"),
            "{scale}: {err}"
        );
        let codes = Tensor::zeros((4, 4), DType::F8E4M3, &Device::Cpu).unwrap();
        let s = Tensor::new(&[scale], &Device::Cpu).unwrap();
        let err =
            Model::from_tensors("q", [("l.weight", codes), ("l.weight_scale", s)]).unwrap_err();
        assert!(matches!(err, Error::BadWeight { .. }), "{err}");
    }
    // A scale with two values, too.
    let path = dir.path().join("q2.safetensors");
    write(
        &path,
        &[
            ("l.weight", St::F8_E4M3, vec![4, 4], vec![0x30; 16]),
            ("l.weight_scale", St::F32, vec![2], f32_data(2, 1.0)),
        ],
    );
    assert!(matches!(
        Model::from_safetensors("q", &[&path]),
        Err(Error::BadWeight { .. })
    ));
}

#[test]
fn zero_element_tensors_with_overflowing_shapes_are_file_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("z.safetensors");
    write(
        &path,
        &[
            ("ok.weight", St::F32, vec![2], f32_data(2, 1.0)),
            ("w", St::F32, vec![0, 4294967296, 4294967296], vec![]),
        ],
    );
    let err = Model::from_safetensors("z", &[&path]).unwrap_err();
    assert!(
        matches!(&err, Error::File { reason, .. } if reason.contains("`w`")),
        "{err}"
    );
    let err = lora::load(path.as_path(), ["w"]).unwrap_err();
    assert!(matches!(err, Error::File { .. }), "{err}");
}

#[test]
fn a_block_index_of_u64_max_in_key_mapping_does_not_overflow() {
    let keys = [
        "conditioner.embedders.18446744073709551615.model.fc.weight",
        "conditioner.embedders.0.model.fc.weight",
    ];
    let tensors: HashMap<String, Tensor> = [
        (
            "lora_te1_model_fc.lora_up.weight".to_string(),
            rand_tensor(&[4, 2], 1),
        ),
        (
            "lora_te1_model_fc.lora_down.weight".to_string(),
            rand_tensor(&[2, 4], 2),
        ),
    ]
    .into_iter()
    .collect();
    let l = lora::load(tensors, keys).unwrap();
    assert_eq!(
        l.matched_model_keys,
        ["conditioner.embedders.0.model.fc.weight"]
    );
}

#[test]
fn meminfo_values_that_overflow_bytes_saturate_never_reading_less_than_the_file_says() {
    let h = host_from_texts(
        "MemTotal: 99999999999999999999 kB\nMemAvailable: 18446744073709551615 kB\nMemFree: 1024 kB\n",
        None,
        None,
    );
    // Too large for a u64, and too large for bytes in one: both at least u64::MAX bytes.
    assert_eq!(h.total, ByteSize::MAX);
    assert_eq!(h.available, ByteSize::MAX);
    // A cgroup limit still clips them.
    let h = host_from_texts(
        "MemTotal: 99999999999999999999 kB\nMemAvailable: 18446744073709551615 kB\n",
        Some("8589934592\n"),
        Some("0\n"),
    );
    assert_eq!((h.total, h.available), (ByteSize::gib(8), ByteSize::gib(8)));
    // Not a number at all: no figure (the MemFree fallback applies, as when it is missing).
    let h = host_from_texts(
        "MemTotal: 1024 kB\nMemAvailable: lots\nMemFree: 1024 kB\n",
        None,
        None,
    );
    assert_eq!(h.available, ByteSize::mib(1));
}

#[test]
fn byte_size_constructors_saturate() {
    assert_eq!(ByteSize::kib(u64::MAX), ByteSize::MAX);
    assert_eq!(ByteSize::mib(u64::MAX / 1024), ByteSize::MAX);
    assert_eq!(ByteSize::gib(1 << 40), ByteSize::MAX);
    assert_eq!(ByteSize::gib(3), ByteSize(3 << 30));
}

#[test]
fn patches_on_weights_of_more_than_eight_dimensions_are_refused() {
    let dims = [1usize, 2, 1, 2, 1, 2, 1, 2, 2];
    let w = Tensor::ones(&dims[..], DType::F32, &Device::Cpu).unwrap();
    let m = Model::from_tensors("r9", [("w", w.clone())]).unwrap();
    let mut p = ModelPatcher::new(Arc::new(m), CPU, CPU);
    let err = p
        .add_patches(
            [(
                "w",
                Patch::Diff {
                    diff: w,
                    pad: false,
                },
            )],
            1.0,
            1.0,
        )
        .unwrap_err();
    assert_bad_patch(err, "w", "at most 8");
    // Patch tensors of more than eight dimensions too.
    let mut p = patcher(&[4, 4]);
    let up = Tensor::ones(
        &[4usize, 1, 1, 1, 1, 1, 1, 1, 1][..],
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let err = p
        .add_patches(
            [("w", Patch::Lora(Lora::new(up, rand_tensor(&[1, 4], 3))))],
            1.0,
            1.0,
        )
        .unwrap_err();
    assert_bad_patch(err, "w", "at most 8");
}

#[test]
fn adapter_shapes_whose_element_count_overflows_are_shape_errors() {
    // Zero-element factors with huge dimensions: the delta's shape [2⁴⁰, 2⁴⁰] has no usize
    // element count.
    let mut p = patcher(&[4, 4]);
    let up = Tensor::zeros((1usize << 40, 0), DType::F32, &Device::Cpu).unwrap();
    let down = Tensor::zeros((0, 1usize << 40), DType::F32, &Device::Cpu).unwrap();
    let err = p
        .add_patches([("w", Patch::Lora(Lora::new(up, down)))], 1.0, 1.0)
        .unwrap_err();
    assert!(
        matches!(err, Error::PatchShape { .. } | Error::BadPatch { .. }),
        "{err}"
    );
    let _ = Dtype::F32;
}

// ---------------------------------------------------------------------------------------------
// GGUF files: a small file with stacked experts in every format candle's kernels take, written
// here so that every field's offset is known, and files mutated from it. A file either loads
// into a model whose every weight can be used (an error there is fine, a panic is not) or is
// refused with a typed error naming the file.

/// One tensor of a hand-written GGUF file: name, GGUF dimensions (fastest first), GGML type id
/// and data bytes.
#[derive(Clone, Debug)]
struct Spec {
    name: String,
    ne: Vec<u64>,
    ty: u32,
    data: Vec<u8>,
}

/// Where a tensor info's fields are in a written file.
#[derive(Clone, Copy, Debug)]
struct InfoAt {
    n_dims: usize,
    dims: usize,
    ty: usize,
    offset: usize,
}

/// The GGML type ids candle reads, with each format's (block size, block bytes).
const GGML_IDS: [(u32, GgmlDType); 15] = [
    (0, GgmlDType::F32),
    (1, GgmlDType::F16),
    (2, GgmlDType::Q4_0),
    (3, GgmlDType::Q4_1),
    (6, GgmlDType::Q5_0),
    (7, GgmlDType::Q5_1),
    (8, GgmlDType::Q8_0),
    (9, GgmlDType::Q8_1),
    (10, GgmlDType::Q2K),
    (11, GgmlDType::Q3K),
    (12, GgmlDType::Q4K),
    (13, GgmlDType::Q5K),
    (14, GgmlDType::Q6K),
    (15, GgmlDType::Q8K),
    (30, GgmlDType::BF16),
];

fn ggml_of(ty: u32) -> Option<GgmlDType> {
    GGML_IDS.iter().find(|(i, _)| *i == ty).map(|(_, g)| *g)
}

fn id_of(ggml: GgmlDType) -> u32 {
    GGML_IDS.iter().find(|(_, g)| *g == ggml).unwrap().0
}

/// The bytes a tensor of GGUF dimensions `ne` and type `ty` takes, when it is a whole number of
/// blocks and fits.
fn data_len(ne: &[u64], ty: u32) -> Option<u64> {
    let g = ggml_of(ty)?;
    let block = g.block_size() as u64;
    if ne.is_empty() || !ne[0].is_multiple_of(block) {
        return None;
    }
    let numel = ne.iter().try_fold(1u64, |n, &d| n.checked_mul(d))?;
    (numel / block).checked_mul(g.type_size() as u64)
}

/// A GGUF v3 file of `specs` (alignment 32, data in order) and each tensor's field offsets.
fn gguf_file_of(specs: &[Spec]) -> (Vec<u8>, Vec<InfoAt>) {
    fn string(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(&(s.len() as u64).to_le_bytes());
        out.extend_from_slice(s.as_bytes());
    }
    let mut out = b"GGUF".to_vec();
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&(specs.len() as u64).to_le_bytes());
    out.extend_from_slice(&2u64.to_le_bytes());
    string(&mut out, "general.architecture");
    out.extend_from_slice(&8u32.to_le_bytes());
    string(&mut out, "qwen3moe");
    string(&mut out, "qwen3moe.expert_count");
    out.extend_from_slice(&4u32.to_le_bytes());
    out.extend_from_slice(&2u32.to_le_bytes());
    let mut at = Vec::new();
    let mut offset = 0u64;
    for s in specs {
        string(&mut out, &s.name);
        let n_dims = out.len();
        out.extend_from_slice(&(s.ne.len() as u32).to_le_bytes());
        let dims = out.len();
        for d in &s.ne {
            out.extend_from_slice(&d.to_le_bytes());
        }
        let ty = out.len();
        out.extend_from_slice(&s.ty.to_le_bytes());
        let off = out.len();
        out.extend_from_slice(&offset.to_le_bytes());
        offset += (s.data.len() as u64).next_multiple_of(32);
        at.push(InfoAt {
            n_dims,
            dims,
            ty,
            offset: off,
        });
    }
    out.resize(out.len().next_multiple_of(32), 0);
    for s in specs {
        out.extend_from_slice(&s.data);
        out.resize(out.len().next_multiple_of(32), 0);
    }
    (out, at)
}

/// A tensor of candle shape `shape` in `ggml`, its blocks quantized from smooth values.
fn spec(name: &str, shape: &[usize], ggml: GgmlDType, seed: u64) -> Spec {
    let t = rand_tensor(shape, seed);
    let q = candle_core::quantized::QTensor::quantize(&t, ggml).unwrap();
    Spec {
        name: name.to_string(),
        ne: shape.iter().rev().map(|&d| d as u64).collect(),
        ty: id_of(ggml),
        data: q.data().unwrap().to_vec(),
    }
}

/// The valid file's tensors: a Qwen3-MoE-like layer with stacked experts.
fn moe_specs() -> Vec<Spec> {
    vec![
        spec("token_embd.weight", &[8, 64], GgmlDType::Q4_0, 1),
        spec("blk.0.attn_norm.weight", &[64], GgmlDType::F32, 2),
        spec("blk.0.attn_q.weight", &[8, 64], GgmlDType::F16, 3),
        spec(
            "blk.0.ffn_gate_exps.weight",
            &[2, 8, 64],
            GgmlDType::Q8_0,
            4,
        ),
        spec("blk.0.ffn_up_exps.weight", &[2, 8, 64], GgmlDType::Q4_1, 5),
        spec(
            "blk.0.ffn_down_exps.weight",
            &[2, 64, 64],
            GgmlDType::Q5_0,
            6,
        ),
        spec("output.weight", &[8, 64], GgmlDType::Q5_1, 7),
        spec("blk.0.attn_k.weight", &[8, 256], GgmlDType::Q4K, 8),
    ]
}

/// Writes `bytes` to a new file in `dir` and reads it as a model.
fn read_gguf_bytes(dir: &std::path::Path, bytes: &[u8]) -> residency::Result<Model> {
    let path = dir.join("m.gguf");
    std::fs::write(&path, bytes).unwrap();
    Model::from_gguf("m", &path)
}

/// The reason of the `Error::File` reading `bytes` gives.
fn gguf_refusal(dir: &std::path::Path, bytes: &[u8]) -> String {
    match read_gguf_bytes(dir, bytes) {
        Err(Error::File { reason, .. }) => reason,
        Err(other) => panic!("not a file error: {other}"),
        Ok(m) => panic!("a bad file loaded as {} weights", m.slots().len()),
    }
}

/// Uses every weight of `model` as a layer would: each matrix through `QMatMul` and as an
/// embedding, each stack through `moe_gemm_gguf` and each of its experts, everything
/// dequantized. Returns how many of the uses failed (with an error: a panic fails the test).
fn use_every_weight(model: Model) -> usize {
    let cpu = Device::Cpu;
    let p = ModelPatcher::new(Arc::new(model), CPU, CPU);
    let ct = gguf_file::Content::from_patcher(&p);
    let mut reader = std::io::Cursor::new(Vec::<u8>::new());
    let mut names: Vec<String> = p
        .model()
        .slots()
        .iter()
        .map(|s| s.name().to_string())
        .collect();
    names.extend(p.model().stacks().map(|(n, _)| n.to_string()));
    // Each name reaches one weight: no two slots share one, no stack hides a slot.
    let unique: std::collections::HashSet<&String> = names.iter().collect();
    assert_eq!(
        unique.len(),
        names.len(),
        "a name of two weights: {names:?}"
    );
    let mut failed = 0;
    let mut count = |r: candle_core::Result<Tensor>| failed += usize::from(r.is_err());
    let id = Tensor::new(&[0u32], &cpu).unwrap();
    for name in names {
        let q = ct.tensor(&mut reader, &name, &cpu).unwrap();
        count(q.dequantize(&cpu));
        let dims = q.shape().dims().to_vec();
        let k = *dims.last().unwrap();
        let x = rand_tensor(&[3, k], 9);
        if q.experts_len().is_some() {
            // Every token to expert 0 and 1 (or 0 alone), sorted by expert.
            let topk = dims[0].min(2);
            let pairs: Vec<u32> = (0..3 * topk as u32).collect();
            let mut by_expert = pairs.clone();
            by_expert.sort_by_key(|&p| p % topk as u32);
            let experts: Vec<u32> = by_expert.iter().map(|&p| p % topk as u32).collect();
            let sorted = Tensor::new(by_expert.as_slice(), &cpu).unwrap();
            let experts = Tensor::new(experts.as_slice(), &cpu).unwrap();
            count(moe_gemm_gguf(
                &x,
                &q,
                &None,
                &sorted,
                &experts,
                topk,
                false,
                DType::F32,
            ));
            let none = Tensor::zeros(0, DType::U32, &cpu).unwrap();
            let empty = Tensor::zeros((0, k), DType::F32, &cpu).unwrap();
            let y = moe_gemm_gguf(&empty, &q, &None, &none, &none, topk, false, DType::F32);
            count(y.and_then(|y| match y.dims() {
                [0, n] if *n == dims[1] => Ok(y),
                other => candle_core::bail!("an empty batch gave {other:?}"),
            }));
            for e in 0..dims[0] {
                count(
                    q.expert(e)
                        .and_then(QMatMul::from_qtensor)
                        .and_then(|m| m.forward(&x)),
                );
            }
        } else if dims.len() == 2 {
            let m = QMatMul::from_qtensor(q);
            count(
                m.as_ref()
                    .map_err(|e| candle_core::Error::Msg(e.to_string()))
                    .and_then(|m| m.forward(&x)),
            );
            if let Ok(m) = m {
                count(m.embedding(&id));
            }
        }
    }
    failed
}

#[test]
fn the_hand_written_moe_gguf_loads_and_every_weight_is_usable() {
    let dir = tempfile::tempdir().unwrap();
    let (bytes, _) = gguf_file_of(&moe_specs());
    let m = read_gguf_bytes(dir.path(), &bytes).unwrap();
    assert_eq!(m.slots().len(), 2 + 3 * 2 + 3);
    assert_eq!(m.stacks().count(), 3);
    assert_eq!(use_every_weight(m), 0);
}

#[test]
fn a_quantized_matrix_with_a_zero_dimension_is_refused_when_read() {
    // Before: `token_embd.weight` of ne [256, 0] loaded, and its first matmul divided by zero
    // inside candle.
    let dir = tempfile::tempdir().unwrap();
    for ne in [[64u64, 0], [256, 0], [0, 8]] {
        let mut specs = moe_specs();
        specs[0].ne = ne.to_vec();
        let r = gguf_refusal(dir.path(), &gguf_file_of(&specs).0);
        assert!(
            r.contains("tensor `token_embd.weight`") && r.contains("is 0"),
            "{ne:?}: {r}"
        );
    }
}

#[test]
fn a_stack_of_empty_experts_is_refused_whatever_its_expert_count() {
    // Before: ne [64, 0, 2⁴⁰] aborted the process reserving 2⁴⁰ slots, 2⁶² overflowed the
    // capacity, and 2¹⁸ loaded 262 144 experts from a few kilobytes.
    let dir = tempfile::tempdir().unwrap();
    for n in [1u64 << 18, 1 << 40, 1 << 62] {
        let mut specs = moe_specs();
        specs[3].ne = vec![64, 0, n];
        let r = gguf_refusal(dir.path(), &gguf_file_of(&specs).0);
        assert!(
            r.contains("tensor `blk.0.ffn_gate_exps.weight`") && r.contains("is 0"),
            "{n}: {r}"
        );
    }
}

#[test]
fn expert_keys_that_collide_with_the_files_names_are_refused_naming_the_weight() {
    let dir = tempfile::tempdir().unwrap();
    // A tensor named as a stack's second expert: before, two slots of one name, and layers got
    // whichever the index kept.
    let mut specs = moe_specs();
    specs[2].name = "blk.0.ffn_gate_exps.1.weight".into();
    let r = gguf_refusal(dir.path(), &gguf_file_of(&specs).0);
    assert!(
        r.contains("weight `blk.0.ffn_gate_exps.1.weight` is named twice"),
        "{r}"
    );
    // A stack named as another stack's first expert: before, that expert could not be reached
    // by name (the stack came first).
    let mut specs = moe_specs();
    specs[4].name = "blk.0.ffn_gate_exps.0.weight".into();
    let bytes = gguf_file_of(&specs).0;
    let r = gguf_refusal(dir.path(), &bytes);
    assert!(
        r.contains("weight `blk.0.ffn_gate_exps.0.weight` is named twice"),
        "{r}"
    );
    // Read lazily under a RAM budget: the same refusal.
    let path = dir.path().join("lazy.gguf");
    std::fs::write(&path, &bytes).unwrap();
    let mm = manager_with(&["--ram-budget", "1MiB"]);
    let err = mm.read_gguf("m", &path).unwrap_err();
    assert!(
        matches!(&err, Error::File { reason, .. } if reason.contains("named twice")),
        "{err}"
    );
}

#[test]
fn rows_of_an_odd_number_of_blocks_are_refused_for_the_formats_candle_runs_in_pairs() {
    // Before: they loaded, and the first matmul panicked in candle's dot product ("nb is not
    // divisible by 2"), poisoning its matmul pool for every later quantized matmul.
    let dir = tempfile::tempdir().unwrap();
    for ggml in [GgmlDType::Q4_1, GgmlDType::Q5_0, GgmlDType::Q5_1] {
        let mut specs = moe_specs();
        specs[2] = spec("blk.0.attn_q.weight", &[8, 96], ggml, 3);
        let r = gguf_refusal(dir.path(), &gguf_file_of(&specs).0);
        assert!(
            r.contains("tensor `blk.0.attn_q.weight`")
                && r.contains(&format!("{ggml:?}"))
                && r.contains("3 blocks"),
            "{ggml:?}: {r}"
        );
        // Stacked experts too.
        let mut specs = moe_specs();
        specs[4] = spec("blk.0.ffn_up_exps.weight", &[2, 8, 32], ggml, 5);
        let r = gguf_refusal(dir.path(), &gguf_file_of(&specs).0);
        assert!(
            r.contains("tensor `blk.0.ffn_up_exps.weight`") && r.contains("1 blocks"),
            "{ggml:?}: {r}"
        );
    }
    // The formats whose kernels take any whole number of blocks load and run.
    let mut specs = moe_specs();
    specs[2] = spec("blk.0.attn_q.weight", &[8, 96], GgmlDType::Q4_0, 3);
    specs[6] = spec("output.weight", &[8, 96], GgmlDType::Q8_0, 7);
    let m = read_gguf_bytes(dir.path(), &gguf_file_of(&specs).0).unwrap();
    assert_eq!(use_every_weight(m), 0);
}

/// A small deterministic generator for the mutations (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len())]
    }
}

/// One mutation of the valid file: its bytes, and what it did (for the failure message).
fn mutate(rng: &mut Rng, specs: &[Spec]) -> (Vec<u8>, String) {
    let (mut bytes, at) = gguf_file_of(specs);
    let t = rng.below(specs.len());
    let name = specs[t].name.clone();
    let dims: Vec<u64> = [0, 1, 2, 3, 8, 31, 32, 33, 64, 96, 160, 255, 256, 512]
        .into_iter()
        .chain([1 << 18, 1 << 31, 1 << 40, 1 << 62, u64::MAX])
        .collect();
    let put_u64 =
        |b: &mut Vec<u8>, at: usize, v: u64| b[at..at + 8].copy_from_slice(&v.to_le_bytes());
    let put_u32 =
        |b: &mut Vec<u8>, at: usize, v: u32| b[at..at + 4].copy_from_slice(&v.to_le_bytes());
    match rng.below(10) {
        0 => {
            let (field, at, v) = match rng.below(3) {
                0 => ("version", 4, rng.pick(&[0u64, 1, 2, 4, u32::MAX as u64])),
                1 => (
                    "tensor count",
                    8,
                    rng.pick(&[0u64, 7, 9, 1 << 40, u64::MAX]),
                ),
                _ => (
                    "metadata count",
                    16,
                    rng.pick(&[0u64, 1, 3, 1 << 40, u64::MAX]),
                ),
            };
            if at == 4 {
                put_u32(&mut bytes, at, v as u32);
            } else {
                put_u64(&mut bytes, at, v);
            }
            (bytes, format!("{field} = {v}"))
        }
        1 => {
            let n = rng.below(7) as u32;
            put_u32(&mut bytes, at[t].n_dims, n);
            (bytes, format!("`{name}`: {n} dimensions"))
        }
        2 => {
            let i = rng.below(specs[t].ne.len());
            // Zero often: the dimension that used to load and then fail on use.
            let d = if rng.below(2) == 0 {
                0
            } else {
                rng.pick(&dims)
            };
            put_u64(&mut bytes, at[t].dims + 8 * i, d);
            (bytes, format!("`{name}`: ne[{i}] = {d}"))
        }
        3 => {
            let ty = if rng.below(2) == 0 {
                rng.below(40) as u32
            } else {
                rng.pick(&GGML_IDS).0
            };
            put_u32(&mut bytes, at[t].ty, ty);
            (bytes, format!("`{name}`: type {ty}"))
        }
        4 => {
            let o = u64::from_le_bytes(bytes[at[t].offset..at[t].offset + 8].try_into().unwrap());
            let v = rng.pick(&[
                0,
                o + 1,
                o + 32,
                o.saturating_sub(32),
                1 << 40,
                u64::MAX - 31,
                u64::MAX,
            ]);
            put_u64(&mut bytes, at[t].offset, v);
            (bytes, format!("`{name}`: offset {v}"))
        }
        5 => {
            let cut = rng.below(bytes.len());
            bytes.truncate(cut);
            (bytes, format!("truncated to {cut} bytes"))
        }
        6 => {
            let header_end = at.last().unwrap().offset + 8;
            let i = rng.below(header_end);
            let b = rng.next() as u8;
            bytes[i] = b;
            (bytes, format!("byte {i} = {b}"))
        }
        7 => {
            // Duplicate and generated-looking names.
            let other = specs[rng.below(specs.len())].name.clone();
            let stem = other.strip_suffix(".weight").unwrap_or(&other).to_string();
            let new = match rng.below(4) {
                0 => other.clone(),
                1 => format!("{stem}.{}.weight", rng.below(3)),
                2 => format!("{stem}.{}.0.weight", rng.below(2)),
                _ => stem,
            };
            let mut specs = specs.to_vec();
            specs[t].name = new.clone();
            (gguf_file_of(&specs).0, format!("`{name}` renamed `{new}`"))
        }
        _ => {
            // A new shape and format with exactly the bytes they need: files that may load, so
            // the use of every weight is exercised on odd rows, expert counts that disagree
            // with the layer's, formats candle runs differently.
            let mut specs = specs.to_vec();
            let s = &mut specs[t];
            let rank = s.ne.len();
            if rng.below(2) == 0 {
                let i = rng.below(rank);
                s.ne[i] = rng.pick(&[0u64, 1, 2, 3, 5, 32, 96, 160, 256]);
            }
            if rng.below(2) == 0 {
                s.ty = rng.pick(&GGML_IDS).0;
            }
            // Too large, or not whole blocks: the old bytes, which disagree.
            if let Some(n) = data_len(&s.ne, s.ty).filter(|&n| n <= 1 << 16) {
                s.data = (0..n).map(|_| rng.next() as u8).collect();
            }
            let what = format!(
                "`{name}`: ne {:?}, type {}, {} bytes",
                s.ne,
                s.ty,
                s.data.len()
            );
            (gguf_file_of(&specs).0, what)
        }
    }
}

#[test]
fn mutated_gguf_files_are_typed_errors_or_models_whose_every_weight_is_usable() {
    let dir = tempfile::tempdir().unwrap();
    let specs = moe_specs();
    let mm = manager_with(&["--ram-budget", "1MiB"]);
    let lazy_path = dir.path().join("lazy.gguf");
    let mut rng = Rng(0x005e_ed0f_6775_f11e);
    let (mut loaded, mut refused) = (0, 0);
    for i in 0..400 {
        let (bytes, what) = mutate(&mut rng, &specs);
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let eager = read_gguf_bytes(dir.path(), &bytes);
            std::fs::write(&lazy_path, &bytes).unwrap();
            let lazy = mm.read_gguf("m", &lazy_path);
            assert_eq!(eager.is_ok(), lazy.is_ok(), "eager and lazy reads disagree");
            match eager {
                Ok(m) => {
                    use_every_weight(m);
                    true
                }
                Err(Error::File { path, reason }) => {
                    assert!(path.ends_with("m.gguf") && !reason.is_empty());
                    false
                }
                Err(other) => panic!("not a file error: {other}"),
            }
        }));
        match outcome {
            Ok(true) => loaded += 1,
            Ok(false) => refused += 1,
            Err(panic) => {
                eprintln!("mutation {i} ({what}) panicked");
                std::panic::resume_unwind(panic);
            }
        }
    }
    // The mutations reach both ends.
    assert!(
        loaded >= 20 && refused >= 200,
        "{loaded} loaded, {refused} refused"
    );
}
