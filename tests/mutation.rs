//! Mutated files never panic. Valid checkpoints and LoRA files (kohya, PEFT and diffusers
//! naming; LoRA, LoHa, LoKr, OFT and diff patches; f32, f16, bf16, fp8 with a per-tensor scale,
//! fp8 E5M2 and an integer buffer) are mutated — bit flips, truncation, header garbage, absurd
//! offsets and shapes, wrong dtype names, NaN/inf values — and fed to `Model::from_safetensors`,
//! `lora::load` + `add_patches` + a load, and the merge tool. Each call must either work or return
//! a typed error: in the debug build `cargo test` uses (overflow checks on) the count of panics
//! must be 0. `RESIDENCY_MUTATIONS=N` sets the cases per file (default 60).

mod common;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Once};

use common::rand_tensor;
use residency::float::Dtype;
use residency::loader::{LoadOptions, MemoryManager};
use residency::patcher::{lora, ModelPatcher};
use residency::tools::{merge_files, LoraInput, MergeConfig};
use residency::vram::{Config, DeviceId, Hardware};
use residency::weights::Model;
use residency::ByteSize;
use safetensors::tensor::{Dtype as St, TensorView};

const PROJ_IN: &str = "model.diffusion_model.input_blocks.1.1.proj_in";
const OUT: &str = "model.diffusion_model.out.2";
const CONV: &str = "model.diffusion_model.input_blocks.0.0";
const FP8: &str = "model.diffusion_model.middle_block.1.proj";
const E5M2: &str = "model.diffusion_model.middle_block.2.proj";
const TE_FC1: &str = "cond_stage_model.transformer.text_model.encoder.layers.0.mlp.fc1";

/// A splitmix64 stream: the same mutations on every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn f32_bytes(shape: &[usize], seed: u64) -> Vec<u8> {
    let t = rand_tensor(shape, seed);
    t.flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect()
}

fn as_dtype(bytes: &[u8], dtype: St) -> Vec<u8> {
    let vals: Vec<f32> = bytes
        .chunks(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    match dtype {
        St::F32 => bytes.to_vec(),
        St::F16 => vals
            .iter()
            .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
            .collect(),
        St::BF16 => vals
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect(),
        // Codes of small fp8 values: any byte is a valid code except NaN patterns.
        St::F8_E4M3 | St::F8_E5M2 => vals.iter().map(|v| (v.abs() * 40.0) as u8 & 0x3f).collect(),
        other => panic!("{other:?}"),
    }
}

type Entry = (String, St, Vec<usize>, Vec<u8>);

fn f(name: &str, dtype: St, shape: &[usize], seed: u64) -> Entry {
    let n: usize = shape.iter().product();
    let bytes = f32_bytes(&[n], seed);
    (
        name.to_string(),
        dtype,
        shape.to_vec(),
        as_dtype(&bytes, dtype),
    )
}

fn serialize(entries: &[Entry]) -> Vec<u8> {
    let views: Vec<(String, TensorView)> = entries
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize(views, None).unwrap()
}

fn checkpoint() -> Vec<Entry> {
    let ids: Vec<u8> = (0i64..16).flat_map(|i| i.to_le_bytes()).collect();
    vec![
        f(&format!("{PROJ_IN}.weight"), St::F32, &[32, 16], 1),
        f(&format!("{PROJ_IN}.bias"), St::F16, &[32], 2),
        f(&format!("{OUT}.weight"), St::BF16, &[8, 32], 3),
        f(&format!("{CONV}.weight"), St::F32, &[8, 4, 3, 3], 4),
        f(&format!("{FP8}.weight"), St::F8_E4M3, &[16, 16], 5),
        (
            format!("{FP8}.weight_scale"),
            St::F32,
            vec![1],
            0.05f32.to_le_bytes().to_vec(),
        ),
        f(&format!("{E5M2}.weight"), St::F8_E5M2, &[16, 16], 6),
        f(&format!("{TE_FC1}.weight"), St::F32, &[16, 8], 7),
        (
            "cond_stage_model.transformer.text_model.embeddings.position_ids".into(),
            St::I64,
            vec![1, 16],
            ids,
        ),
    ]
}

fn scalar(name: String, v: f32) -> Entry {
    (name, St::F32, vec![], v.to_le_bytes().to_vec())
}

fn kohya_lora() -> Vec<Entry> {
    let k = |m: &str| {
        format!(
            "lora_unet_{}",
            m.trim_start_matches("model.diffusion_model.")
                .replace('.', "_")
        )
    };
    vec![
        f(
            &format!("{}.lora_up.weight", k(PROJ_IN)),
            St::F32,
            &[32, 4],
            10,
        ),
        f(
            &format!("{}.lora_down.weight", k(PROJ_IN)),
            St::F16,
            &[4, 16],
            11,
        ),
        scalar(format!("{}.alpha", k(PROJ_IN)), 2.0),
        f(&format!("{}.diff_b", k(PROJ_IN)), St::F32, &[32], 12),
        f(&format!("{}.hada_w1_a", k(OUT)), St::F32, &[8, 2], 13),
        f(&format!("{}.hada_w1_b", k(OUT)), St::F32, &[2, 32], 14),
        f(&format!("{}.hada_w2_a", k(OUT)), St::BF16, &[8, 2], 15),
        f(&format!("{}.hada_w2_b", k(OUT)), St::F32, &[2, 32], 16),
        scalar(format!("{}.alpha", k(OUT)), 1.0),
        f(&format!("{}.lokr_w1", k(CONV)), St::F32, &[2, 2], 17),
        f(&format!("{}.lokr_w2", k(CONV)), St::F32, &[4, 2, 3, 3], 18),
        f(&format!("{}.lora_up.weight", k(FP8)), St::F32, &[16, 2], 19),
        f(
            &format!("{}.lora_down.weight", k(FP8)),
            St::F32,
            &[2, 16],
            20,
        ),
        f(
            "lora_te_text_model_encoder_layers_0_mlp_fc1.oft_blocks",
            St::F32,
            &[4, 4, 4],
            21,
        ),
        scalar(
            "lora_te_text_model_encoder_layers_0_mlp_fc1.alpha".into(),
            0.5,
        ),
    ]
}

fn peft_lora() -> Vec<Entry> {
    let base = format!("base_model.model.{PROJ_IN}");
    vec![
        f(&format!("{base}.lora_A.weight"), St::F32, &[4, 16], 30),
        f(&format!("{base}.lora_B.weight"), St::BF16, &[32, 4], 31),
        f(
            &format!("base_model.model.{E5M2}.lora_A.weight"),
            St::F32,
            &[2, 16],
            32,
        ),
        f(
            &format!("base_model.model.{E5M2}.lora_B.weight"),
            St::F32,
            &[16, 2],
            33,
        ),
    ]
}

fn diffusers_lora() -> Vec<Entry> {
    vec![
        f("unet.out.2.lora.down.weight", St::F32, &[4, 32], 40),
        f("unet.out.2.lora.up.weight", St::F32, &[8, 4], 41),
        f(
            "unet.input_blocks.1.1.proj_in.lora.down.weight",
            St::F16,
            &[2, 16],
            42,
        ),
        f(
            "unet.input_blocks.1.1.proj_in.lora.up.weight",
            St::F16,
            &[32, 2],
            43,
        ),
        scalar("unet.input_blocks.1.1.proj_in.alpha".into(), 2.0),
    ]
}

/// The header as JSON and the data after it.
fn split(bytes: &[u8]) -> (serde_json::Value, Vec<u8>) {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    (header, bytes[8 + n..].to_vec())
}

fn join(header: &serde_json::Value, data: &[u8]) -> Vec<u8> {
    let h = serde_json::to_vec(header).unwrap();
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend_from_slice(data);
    out
}

const ABSURD_SHAPES: &[&[u64]] = &[
    &[0, 4294967296, 4294967296],
    &[0, u64::MAX],
    &[u64::MAX],
    &[1 << 40, 1 << 40],
    &[4294967296, 4294967296, 0],
    &[],
    &[1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
    &[0; 12],
    &[3, 0, 7],
];
const DTYPE_NAMES: &[&str] = &[
    "F33", "BOOL", "I64", "U8", "F8_E4M3", "F8_E5M2", "F64", "", "f32", "I8", "F4",
];

/// One mutation of the file `entries` make, with a description.
fn mutate(entries: &[Entry], rng: &mut Rng) -> (String, Vec<u8>) {
    let bytes = serialize(entries);
    let valid = bytes.as_slice();
    let (mut header, mut data) = split(valid);
    let names: Vec<String> = header
        .as_object()
        .unwrap()
        .keys()
        .filter(|k| *k != "__metadata__")
        .cloned()
        .collect();
    let name = names[rng.below(names.len())].clone();
    match rng.below(11) {
        10 => {
            // A structurally valid file (offsets and data agree) with an absurd shape: what
            // reaches the tensor code.
            let shape = ABSURD_SHAPES[rng.below(ABSURD_SHAPES.len())];
            let Ok(shape) = shape
                .iter()
                .map(|&d| usize::try_from(d))
                .collect::<Result<Vec<_>, _>>()
            else {
                return ("shape beyond usize".into(), valid.to_vec());
            };
            let mut e = entries.to_vec();
            let k = rng.below(e.len());
            let size = e[k].1.bitsize() / 8;
            let numel = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
            match numel
                .and_then(|n| n.checked_mul(size))
                .filter(|&b| b <= 1 << 20)
            {
                Some(b) => {
                    e[k].2 = shape.clone();
                    e[k].3 = vec![0x3c; b];
                    (
                        format!("`{}` shape {shape:?}, data to match", e[k].0),
                        serialize(&e),
                    )
                }
                None => (
                    format!("shape {shape:?} too large to write"),
                    valid.to_vec(),
                ),
            }
        }
        0 => {
            let mut b = valid.to_vec();
            let flips = 1 + rng.below(8);
            for _ in 0..flips {
                let i = rng.below(b.len());
                b[i] ^= 1 << rng.below(8);
            }
            (format!("{flips} bit flips"), b)
        }
        1 => {
            let len = rng.below(valid.len());
            (format!("truncated to {len}"), valid[..len].to_vec())
        }
        2 => {
            let mut b = valid.to_vec();
            let hlen = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
            for _ in 0..1 + rng.below(4) {
                let i = 8 + rng.below(hlen);
                b[i] = b"{}[]\",:0-9eE."[rng.below(13)];
            }
            ("header garbage".into(), b)
        }
        3 => {
            let len = data.len() as u64;
            let pick = [
                [u64::MAX - 1, u64::MAX],
                [len, len + 8],
                [8, 4],
                [0, len + 1],
                [len / 2, len / 2 + 3],
                [1 << 62, (1 << 62) + 16],
            ][rng.below(6)];
            header[&name]["data_offsets"] = serde_json::json!(pick);
            (format!("`{name}` offsets {pick:?}"), join(&header, &data))
        }
        4 => {
            // An absurd shape, with offsets that agree with it where they can (a zero-element
            // shape gets an empty range), so the shape itself is what a reader meets.
            let shape = ABSURD_SHAPES[rng.below(ABSURD_SHAPES.len())];
            header[&name]["shape"] = serde_json::json!(shape);
            let numel = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
            let start = header[&name]["data_offsets"][0].as_u64().unwrap();
            let size = match header[&name]["dtype"].as_str().unwrap() {
                "F32" => 4,
                "F16" | "BF16" => 2,
                "I64" => 8,
                _ => 1,
            };
            if let Some(bytes) = numel.and_then(|n| n.checked_mul(size)) {
                if start
                    .checked_add(bytes)
                    .is_some_and(|end| end <= data.len() as u64)
                {
                    header[&name]["data_offsets"] = serde_json::json!([start, start + bytes]);
                }
            }
            (format!("`{name}` shape {shape:?}"), join(&header, &data))
        }
        5 => {
            let d = DTYPE_NAMES[rng.below(DTYPE_NAMES.len())];
            header[&name]["dtype"] = serde_json::json!(d);
            (format!("`{name}` dtype {d:?}"), join(&header, &data))
        }
        6 => {
            // NaN or ±inf over a tensor's bytes (as f32, f16/bf16 or fp8 patterns).
            let off = header[&name]["data_offsets"].as_array().unwrap();
            let (a, b) = (
                off[0].as_u64().unwrap() as usize,
                off[1].as_u64().unwrap() as usize,
            );
            let pattern: &[u8] = match rng.below(4) {
                0 => &[0x00, 0x00, 0xc0, 0x7f],
                1 => &[0x00, 0x00, 0x80, 0x7f],
                2 => &[0x00, 0x00, 0x80, 0xff],
                _ => &[0xff, 0x7f],
            };
            let all = rng.below(2) == 0;
            for (j, byte) in data[a..b].iter_mut().enumerate() {
                if all || j < pattern.len() {
                    *byte = pattern[j % pattern.len()];
                }
            }
            (format!("`{name}` NaN/inf values"), join(&header, &data))
        }
        7 => {
            let mut b = valid.to_vec();
            let n = [0u64, 1, 7, u64::MAX, 1 << 40, b.len() as u64][rng.below(6)];
            b[..8].copy_from_slice(&n.to_le_bytes());
            (format!("header length {n}"), b)
        }
        8 => {
            // A plausible but wrong shape: same element count, other rank; or another tensor's.
            let shape = header[&name]["shape"].clone();
            let n: u64 = shape
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap())
                .product();
            let other = names[rng.below(names.len())].clone();
            let new = if rng.below(2) == 0 {
                serde_json::json!([n])
            } else {
                header[&other]["shape"].clone()
            };
            header[&name]["shape"] = new.clone();
            (format!("`{name}` shape {new}"), join(&header, &data))
        }
        _ => {
            let obj = header.as_object_mut().unwrap();
            if rng.below(2) == 0 {
                obj.remove(&name);
                (
                    format!("`{name}` removed from the header"),
                    join(&header, &data),
                )
            } else {
                obj.insert(
                    "__metadata__".into(),
                    serde_json::json!({"format": ["not", "a", "string"]}),
                );
                data.truncate(data.len().saturating_sub(1));
                (
                    "bad metadata, data one byte short".into(),
                    join(&header, &data),
                )
            }
        }
    }
}

static PANICS: Mutex<Vec<String>> = Mutex::new(Vec::new());
static HOOK: Once = Once::new();
thread_local! {
    static GUARDED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f`, recording a panic (with `what`) instead of unwinding.
fn guarded(what: &str, f: impl FnOnce()) {
    HOOK.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if GUARDED.with(|g| g.get()) {
                PANICS.lock().unwrap().push(info.to_string());
            } else {
                default(info);
            }
        }));
    });
    let before = PANICS.lock().unwrap().len();
    GUARDED.with(|g| g.set(true));
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    GUARDED.with(|g| g.set(false));
    if result.is_err() {
        let mut p = PANICS.lock().unwrap();
        let msg = p.get(before).cloned().unwrap_or_default();
        p.truncate(before);
        p.push(format!("{what}: {msg}"));
    }
}

fn cases() -> usize {
    std::env::var("RESIDENCY_MUTATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(60)
}

fn manager() -> MemoryManager {
    let config = Config::from_args([
        "--vram-budget",
        "24KiB",
        "--reserve-vram",
        "0",
        "--inference-memory",
        "1KiB",
    ])
    .unwrap();
    MemoryManager::new(config, Hardware::cpu_only(ByteSize::gib(8))).unwrap()
}

/// Uses a model as an engine would: load it partially, build every weight, merge.
fn exercise(model: Model, mm: &MemoryManager) {
    let p = ModelPatcher::new(Arc::new(model), DeviceId::Cpu, DeviceId::Cpu)
        .with_compute_dtype(Some(Dtype::F32));
    exercise_patcher(&p, mm);
}

fn exercise_patcher(p: &ModelPatcher, mm: &MemoryManager) {
    if mm
        .load_models_gpu(std::slice::from_ref(p), LoadOptions::default())
        .is_ok()
    {
        for i in 0..p.model().len() {
            let _ = p.materialize(i, Dtype::F32, DeviceId::Cpu);
        }
    }
    let _ = p.patched_state_dict();
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

#[test]
fn mutated_checkpoints_loras_and_merges_never_panic() {
    let dir = tempfile::tempdir().unwrap();
    let base_entries = checkpoint();
    let base_bytes = serialize(&base_entries);
    let base_path = write(dir.path(), "base.safetensors", &base_bytes);
    let base = Model::from_safetensors("base", &[&base_path]).unwrap();
    let keys: Vec<String> = base.keys().map(str::to_string).collect();
    let base = ModelPatcher::new(Arc::new(base), DeviceId::Cpu, DeviceId::Cpu)
        .with_compute_dtype(Some(Dtype::F32));
    let loras = [
        ("kohya", kohya_lora()),
        ("peft", peft_lora()),
        ("diffusers", diffusers_lora()),
    ];
    let lora_bytes: Vec<Vec<u8>> = loras.iter().map(|(_, e)| serialize(e)).collect();
    // The valid files work: every LoRA matches, and a merge succeeds.
    for ((naming, _), bytes) in loras.iter().zip(&lora_bytes) {
        let path = write(dir.path(), &format!("{naming}.safetensors"), bytes);
        let l = lora::load(path.as_path(), keys.iter().map(String::as_str)).unwrap();
        assert!(
            l.unmatched_lora_keys.is_empty(),
            "{naming}: {:?}",
            l.unmatched_lora_keys
        );
        let mut p = base.clone();
        p.add_patches(l.patches, 1.0, 1.0).unwrap();
        p.patched_state_dict().unwrap();
    }

    let mm = manager();
    let mut rng = Rng(0x5eed);
    let mut outcomes = [0usize; 2]; // [ok, typed error]
    let n = cases();
    for case in 0..n {
        // Checkpoints.
        let (what, bytes) = mutate(&base_entries, &mut rng);
        let path = write(dir.path(), "m.safetensors", &bytes);
        guarded(
            &format!("checkpoint case {case}: {what}"),
            || match Model::from_safetensors("m", &[&path]) {
                Ok(m) => {
                    outcomes[0] += 1;
                    exercise(m, &mm);
                }
                Err(_) => outcomes[1] += 1,
            },
        );
        // LoRA files in each naming.
        for (naming, valid) in &loras {
            let (what, bytes) = mutate(valid, &mut rng);
            let path = write(dir.path(), &format!("{naming}-m.safetensors"), &bytes);
            guarded(&format!("{naming} LoRA case {case}: {what}"), || {
                let Ok(l) = lora::load(path.as_path(), keys.iter().map(String::as_str)) else {
                    outcomes[1] += 1;
                    return;
                };
                let mut p = base.clone();
                match p.add_patches(l.patches, 1.0, 1.0) {
                    Ok(_) => {
                        outcomes[0] += 1;
                        exercise_patcher(&p, &mm);
                    }
                    Err(_) => outcomes[1] += 1,
                }
            });
        }
        // The merge tool, on a mutated base or a mutated LoRA.
        if case % 3 == 0 {
            let (what, bytes) = mutate(
                if case % 2 == 0 {
                    &base_entries
                } else {
                    &loras[0].1
                },
                &mut rng,
            );
            let bad = write(dir.path(), "merge-in.safetensors", &bytes);
            let good_lora = write(dir.path(), "kohya.safetensors", &lora_bytes[0]);
            let (model, lora_path) = if case % 2 == 0 {
                (bad, good_lora)
            } else {
                (base_path.clone(), bad)
            };
            let config = MergeConfig {
                model,
                loras: vec![LoraInput {
                    path: lora_path,
                    strength: None,
                }],
                strength: 1.0,
                dtype: None,
                out: dir.path().join("merged.safetensors"),
            };
            guarded(&format!("merge case {case}: {what}"), || {
                let _ = merge_files(&config);
            });
        }
    }
    let panics = PANICS.lock().unwrap().clone();
    assert!(
        panics.is_empty(),
        "{} panics in {} cases ({} ok, {} typed errors):\n{}",
        panics.len(),
        n * 4 + n / 3,
        outcomes[0],
        outcomes[1],
        panics.join("\n")
    );
    // Both outcomes happen: the mutations are neither all harmless nor all fatal.
    assert!(outcomes[0] > 0 && outcomes[1] > 0, "{outcomes:?}");
}

/// Where tensor `name`'s info starts in a GGUF v2/v3 file (just after its name string).
fn gguf_info_at(bytes: &[u8], name: &str) -> usize {
    let mut needle = (name.len() as u64).to_le_bytes().to_vec();
    needle.extend_from_slice(name.as_bytes());
    let at = bytes
        .windows(needle.len())
        .position(|w| w == needle.as_slice())
        .unwrap_or_else(|| panic!("`{name}` in the file"));
    at + needle.len()
}

/// A GGUF file read eagerly and lazily: both must give a typed `Error::File` whose message names
/// the file and `names` (the tensor or key), or work.
fn gguf_error(path: &Path, mm: &MemoryManager) -> Option<String> {
    let eager = Model::from_gguf("m", path).err();
    let lazy = Model::from_gguf_lazy("m", path, mm.host_tier()).err();
    assert_eq!(eager.is_some(), lazy.is_some(), "eager and lazy disagree");
    eager.map(|e| {
        assert!(matches!(e, residency::Error::File { .. }), "{e}");
        let msg = e.to_string();
        assert!(msg.contains(&path.display().to_string()), "{msg}");
        msg
    })
}

#[test]
fn bad_gguf_files_are_typed_errors_naming_file_and_tensor_and_mutations_never_panic() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("tiny.gguf");
    common::gguf::write_tiny_llama(&good);
    let valid = std::fs::read(&good).unwrap();
    let mm = manager();
    assert!(gguf_error(&good, &mm).is_none());

    let tensor = "blk.0.attn_q.weight"; // Q4_0 [256, 256]
    let at = gguf_info_at(&valid, tensor);
    let n_dims = u32::from_le_bytes(valid[at..at + 4].try_into().unwrap()) as usize;
    let dims_at = at + 4;
    let type_at = dims_at + 8 * n_dims;
    let offset_at = type_at + 4;
    let named: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "truncated in the data",
            valid[..valid.len() - 1000].to_vec(),
            "",
        ),
        (
            "truncated in the header",
            valid[..offset_at + 3].to_vec(),
            "",
        ),
        (
            "an offset past the end",
            {
                let mut b = valid.clone();
                b[offset_at..offset_at + 8].copy_from_slice(&(1u64 << 40).to_le_bytes());
                b
            },
            tensor,
        ),
        (
            "an unknown GGML type",
            {
                let mut b = valid.clone();
                b[type_at..type_at + 4].copy_from_slice(&99u32.to_le_bytes());
                b
            },
            tensor,
        ),
        (
            "dims whose product overflows",
            {
                let mut b = valid.clone();
                b[dims_at + 8..dims_at + 16].copy_from_slice(&(1u64 << 62).to_le_bytes());
                b
            },
            tensor,
        ),
        (
            "a row that is not whole blocks",
            {
                let mut b = valid.clone();
                b[dims_at..dims_at + 8].copy_from_slice(&40u64.to_le_bytes());
                b
            },
            tensor,
        ),
        (
            "metadata of absurd length",
            {
                let mut b = valid.clone();
                // general.architecture's value: type u32 (string) then its u64 length.
                let key_end = gguf_info_at(&b, "general.architecture");
                b[key_end + 4..key_end + 12].copy_from_slice(&(1u64 << 60).to_le_bytes());
                b
            },
            "general.architecture",
        ),
    ];
    for (what, bytes, names) in named {
        let path = write(dir.path(), "bad.gguf", &bytes);
        let msg = gguf_error(&path, &mm).unwrap_or_else(|| panic!("{what}: read without error"));
        assert!(msg.contains(names), "{what}: {msg}");
    }

    // A file truncated after a lazy model was read: the use is a typed error naming the tensor,
    // and nothing is lost (the weights read before still serve).
    let lazy_path = write(dir.path(), "lazy.gguf", &valid);
    let lazy = Model::from_gguf_lazy("lazy", &lazy_path, mm.host_tier()).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&lazy_path)
        .unwrap()
        .set_len(valid.len() as u64 / 2)
        .unwrap();
    let last = lazy.slots().last().unwrap().name().to_string();
    let err = lazy.clean(&last).unwrap_err();
    assert!(
        matches!(err, residency::Error::File { .. }) && err.to_string().contains(&last),
        "{err}"
    );

    // Random mutations: typed errors or working models, never a panic.
    let mut rng = Rng(0x6775_6666);
    let mut outcomes = [0usize; 2];
    for case in 0..cases() {
        let mut b = valid.clone();
        let what = match rng.below(3) {
            0 => {
                let n = 1 + rng.below(8);
                for _ in 0..n {
                    // Mostly the header, where a flip changes structure.
                    let i = rng.below(offset_at + 64);
                    b[i] ^= 1 << rng.below(8);
                }
                format!("{n} bit flips")
            }
            1 => {
                let len = rng.below(b.len());
                b.truncate(len);
                format!("truncated to {len}")
            }
            _ => {
                let i = rng.below(offset_at + 64 - 8);
                b[i..i + 8].copy_from_slice(&rng.next().to_le_bytes());
                format!("8 random bytes at {i}")
            }
        };
        let path = write(dir.path(), "m.gguf", &b);
        guarded(
            &format!("gguf case {case}: {what}"),
            || match Model::from_gguf("m", &path) {
                Ok(m) => {
                    outcomes[0] += 1;
                    exercise(m, &mm);
                }
                Err(_) => outcomes[1] += 1,
            },
        );
    }
    let panics = PANICS.lock().unwrap().clone();
    assert!(panics.is_empty(), "{}", panics.join("\n"));
    assert!(outcomes[1] > 0, "{outcomes:?}");
}
