//! all-MiniLM-L6-v2 end to end through the ops layers: token ids and embeddings against the
//! Hugging Face reference, bit-identical outputs across memory budgets, and LoRA patches.
//!
//! The model comes from `bash scripts/fetch-minilm.sh` (run by `scripts/test.sh`); without it
//! these tests fail and say so.

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use candle_core::{Device, Tensor};
use common::*;
use residency::float::Dtype;
use residency::loader::{LoadOptions, MemoryManager};
use residency::models::bert::{self, Bert, BertConfig};
use residency::ops::{OpsMode, OpsSource};
use residency::patcher::{Lora, ModelPatcher, Patch};
use residency::ByteSize;

/// The repository root: `RESIDENCY_ROOT` when set (a test binary built elsewhere and run from
/// another checkout, as `scripts/gpu-check.sh` does on a GPU machine without cargo), else the
/// crate's own folder.
fn root() -> PathBuf {
    std::env::var_os("RESIDENCY_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

fn model_dir() -> PathBuf {
    let dir = root().join(".cache/minilm");
    for f in ["model.safetensors", "config.json", "tokenizer.json"] {
        assert!(
            dir.join(f).is_file(),
            "MiniLM is missing ({} not found): run `bash scripts/fetch-minilm.sh` first \
             (scripts/test.sh does it)",
            dir.join(f).display()
        );
    }
    dir
}

struct Case {
    sentence: String,
    ids: Vec<u32>,
    embedding: Vec<f32>,
}

fn fixture() -> Vec<Case> {
    let local = root().join("tests/fixtures/minilm_reference.json");
    let text = std::fs::read_to_string(&local)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", local.display()));
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Case {
            sentence: c["sentence"].as_str().unwrap().to_string(),
            ids: c["input_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect(),
            embedding: c["embedding"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect(),
        })
        .collect()
}

fn tokenize(sentences: &[String]) -> Vec<Vec<u32>> {
    let mut tok = tokenizers::Tokenizer::from_file(model_dir().join("tokenizer.json")).unwrap();
    // The file pads every sequence to 128; the tests pad batches themselves.
    tok.with_padding(None);
    sentences
        .iter()
        .map(|s| tok.encode(s.as_str(), true).unwrap().get_ids().to_vec())
        .collect()
}

/// Padded ids and mask `[B, N]`.
fn batch(ids: &[Vec<u32>]) -> (Tensor, Tensor) {
    let n = ids.iter().map(|v| v.len()).max().unwrap();
    let mut flat = Vec::new();
    let mut mask = Vec::new();
    for v in ids {
        for i in 0..n {
            flat.push(v.get(i).copied().unwrap_or(0));
            mask.push(u32::from(i < v.len()));
        }
    }
    let b = ids.len();
    (
        Tensor::from_vec(flat, (b, n), &Device::Cpu).unwrap(),
        Tensor::from_vec(mask, (b, n), &Device::Cpu).unwrap(),
    )
}

#[derive(Debug, Clone, Copy)]
enum Budget {
    Full,
    Quarter,
    /// A quarter resident, two transfer lanes prefetching two weights ahead.
    QuarterLanes,
    NoVram,
}

fn manager_for(budget: Budget, patcher: &ModelPatcher) -> MemoryManager {
    let size = patcher.resident_model_size();
    match budget {
        Budget::Full => manager(ByteSize::gib(2), &["--reserve-vram", "0"]),
        Budget::Quarter => manager(ByteSize(size.bytes() / 4), &["--reserve-vram", "0"]),
        Budget::QuarterLanes => manager(
            ByteSize(size.bytes() / 4),
            &["--reserve-vram", "0", "--async-offload", "2"],
        ),
        Budget::NoVram => manager(ByteSize::gib(2), &["--novram", "--reserve-vram", "0"]),
    }
}

fn base_patcher(storage: Dtype) -> ModelPatcher {
    let m = bert::load_model(
        model_dir().join("model.safetensors"),
        "all-MiniLM-L6-v2",
        storage,
    )
    .unwrap();
    ModelPatcher::new(
        Arc::new(m),
        residency::DeviceId::Cpu,
        residency::DeviceId::Cpu,
    )
}

/// Loads `patcher` under `budget`, runs the fixture sentences and returns the embeddings and
/// the resident fraction.
fn embed(patcher: &ModelPatcher, budget: Budget, ids: &[Vec<u32>]) -> (Vec<Vec<f32>>, f64) {
    let mm = manager_for(budget, patcher);
    let report = mm
        .load_models_gpu(std::slice::from_ref(patcher), LoadOptions::default())
        .unwrap();
    let resident = report.models[0].resident.as_f64() / patcher.resident_model_size().as_f64();
    let config = BertConfig::from_file(model_dir().join("config.json")).unwrap();
    let bert = Bert::new(
        patcher,
        OpsMode::ManualCast {
            compute: Dtype::F32,
        },
        &config,
    )
    .unwrap();
    let (ids, mask) = batch(ids);
    if matches!(budget, Budget::QuarterLanes) {
        // The first forward records the order; the second is served by the lanes' prefetches.
        bert.embed(&ids, &mask, None).unwrap();
        let before = mm.transfer_stats().prefetch_hits;
        let e = bert.embed(&ids, &mask, None).unwrap();
        assert!(
            mm.transfer_stats().prefetch_hits > before,
            "lanes prefetched"
        );
        return (e.to_vec2::<f32>().unwrap(), resident);
    }
    let e = bert.embed(&ids, &mask, None).unwrap();
    (e.to_vec2::<f32>().unwrap(), resident)
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| f64::from(*x) * f64::from(*y))
        .sum();
    let na: f64 = a.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    dot / (na * nb)
}

fn bits(v: &[Vec<f32>]) -> Vec<u32> {
    v.iter().flatten().map(|x| x.to_bits()).collect()
}

#[test]
fn tokenizer_gives_the_reference_token_ids() {
    let cases = fixture();
    let sentences: Vec<String> = cases.iter().map(|c| c.sentence.clone()).collect();
    let ids = tokenize(&sentences);
    for (c, got) in cases.iter().zip(&ids) {
        assert_eq!(&c.ids, got, "{}", c.sentence);
    }
}

#[test]
fn embeddings_match_reference_and_are_identical_across_budgets_for_every_storage_dtype() {
    let cases = fixture();
    let ids: Vec<Vec<u32>> = cases.iter().map(|c| c.ids.clone()).collect();
    for (storage, min_cos) in [
        (Dtype::F32, 0.99999),
        (Dtype::BF16, 0.999),
        (Dtype::F16, 0.999),
        (Dtype::F8E4M3FN, 0.99),
    ] {
        let patcher = base_patcher(storage);
        let mut runs = Vec::new();
        for budget in [Budget::Full, Budget::Quarter, Budget::NoVram] {
            let (e, resident) = embed(&patcher, budget, &ids);
            match budget {
                Budget::Full => assert!(resident > 0.999, "{storage} {budget:?}: {resident}"),
                Budget::Quarter | Budget::QuarterLanes => {
                    assert!(
                        resident > 0.1 && resident < 0.3,
                        "{storage} {budget:?}: {resident}"
                    )
                }
                Budget::NoVram => assert_eq!(resident, 0.0, "{storage} {budget:?}"),
            }
            runs.push((budget, e));
            patcher.detach();
        }
        check_runs(&storage.to_string(), &cases, &runs, min_cos);
    }
}

#[test]
fn streamed_from_disk_under_a_tight_ram_budget_gives_the_resident_bits() {
    // MiniLM is 87 MiB in f32 and its largest weight (the word embeddings) 45 MiB: a 48 MiB host
    // budget holds barely more than that one weight, so every forward reads most weights again.
    let cases = fixture();
    let ids: Vec<Vec<u32>> = cases.iter().map(|c| c.ids.clone()).collect();
    let eager = base_patcher(Dtype::F32);
    let (reference, _) = embed(&eager, Budget::Full, &ids);
    let path = model_dir().join("model.safetensors");
    let size = eager.resident_model_size();
    let quarter = ByteSize(size.bytes() / 4).bytes().to_string();
    for flags in [
        vec!["--novram", "--vram-budget", "2GiB"],
        vec!["--vram-budget", quarter.as_str(), "--async-offload", "2"],
    ] {
        let mut all = vec!["--reserve-vram", "0", "--ram-budget", "48MiB"];
        all.extend(flags.iter().copied());
        let mm = MemoryManager::new(
            residency::vram::Config::from_args(&all).unwrap(),
            residency::vram::Hardware::cpu_only(ByteSize::gib(64)),
        )
        .unwrap();
        let model = mm.read_model("all-MiniLM-L6-v2", &[&path]).unwrap();
        assert!(model.is_lazy());
        let patcher = ModelPatcher::new(
            Arc::new(model),
            residency::DeviceId::Cpu,
            residency::DeviceId::Cpu,
        );
        mm.load_models_gpu(std::slice::from_ref(&patcher), LoadOptions::default())
            .unwrap();
        let config = BertConfig::from_file(model_dir().join("config.json")).unwrap();
        let bert = Bert::new(
            &patcher,
            OpsMode::ManualCast {
                compute: Dtype::F32,
            },
            &config,
        )
        .unwrap();
        let (t, mask) = batch(&ids);
        for _ in 0..2 {
            let e = bert
                .embed(&t, &mask, None)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap();
            assert_eq!(bits(&e), bits(&reference), "{flags:?}");
        }
        let host = mm.memory_report().host;
        assert!(host.peak <= ByteSize::mib(48), "{flags:?}: {host:?}");
        assert!(host.bytes_read > size, "{flags:?}: read again: {host:?}");
    }
}

/// The first run's embeddings are within `min_cos` of the reference, and every other run (another
/// budget) gives the first run's bits.
fn check_runs(
    label: &str,
    cases: &[Case],
    runs: &[(impl std::fmt::Debug, Vec<Vec<f32>>)],
    min_cos: f64,
) {
    let worst = cases
        .iter()
        .zip(&runs[0].1)
        .map(|(c, e)| cosine(&c.embedding, e))
        .fold(1.0f64, f64::min);
    eprintln!("{label}: worst cosine to the reference {worst:.7}");
    assert!(worst >= min_cos, "{label}: cosine {worst} < {min_cos}");
    for (budget, e) in &runs[1..] {
        assert_eq!(
            bits(&runs[0].1),
            bits(e),
            "{label}: {budget:?} differs from {:?}",
            runs[0].0
        );
    }
}

fn attention_lora(patcher: &ModelPatcher, strength: f32) -> ModelPatcher {
    let mut p = patcher.clone();
    let mut patches = Vec::new();
    for l in 0..6 {
        for (j, proj) in ["query", "key", "value"].into_iter().enumerate() {
            let key = format!("encoder.layer.{l}.attention.self.{proj}.weight");
            let seed = (l * 3 + j) as u64;
            let lora = Lora {
                up: (rand_tensor(&[384, 4], 100 + seed) * 0.2).unwrap(),
                down: (rand_tensor(&[4, 384], 200 + seed) * 0.2).unwrap(),
                alpha: Some(4.0),
                mid: None,
                dora_scale: None,
            };
            patches.push((key, Patch::Lora(lora)));
        }
    }
    let matched = p.add_patches(patches, strength, 1.0).unwrap();
    assert_eq!(matched.len(), 18);
    p
}

#[test]
fn attention_lora_changes_the_embedding_and_strength_zero_gives_base_bits() {
    let cases = fixture();
    let ids: Vec<Vec<u32>> = cases.iter().map(|c| c.ids.clone()).collect();
    let base = base_patcher(Dtype::F32);
    let (e0, _) = embed(&base, Budget::Full, &ids);
    let lora = attention_lora(&base, 1.0);
    let (e1, _) = embed(&lora, Budget::Full, &ids);
    let (e1_streamed, _) = embed(&lora, Budget::NoVram, &ids);
    assert_eq!(bits(&e1), bits(&e1_streamed), "LoRA: resident vs streamed");
    let (e1_lanes, _) = embed(&lora, Budget::QuarterLanes, &ids);
    assert_eq!(
        bits(&e1),
        bits(&e1_lanes),
        "LoRA: resident vs prefetched on lanes"
    );
    let moved = e0
        .iter()
        .flatten()
        .zip(e1.iter().flatten())
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(
        moved > 1e-3,
        "a LoRA on q/k/v should change the embedding ({moved})"
    );
    let zero = attention_lora(&base, 0.0);
    let (ez, _) = embed(&zero, Budget::Quarter, &ids);
    assert_eq!(
        bits(&e0),
        bits(&ez),
        "strength 0 must give the base embedding bit for bit"
    );

    // One Bert switching between the clones through its source.
    let config = BertConfig::from_file(model_dir().join("config.json")).unwrap();
    let bert = Bert::new(
        &base,
        OpsMode::ManualCast {
            compute: Dtype::F32,
        },
        &config,
    )
    .unwrap();
    let (t, m) = batch(&ids);
    let source: &OpsSource = bert.source();
    source.set_patcher(&lora).unwrap();
    let got = bert.embed(&t, &m, None).unwrap().to_vec2::<f32>().unwrap();
    assert_eq!(bits(&got), bits(&e1));
}

#[test]
fn first_forward_records_weight_order_in_layer_order() {
    let base = base_patcher(Dtype::F32);
    let ids = vec![vec![101u32, 1037, 4937, 102]];
    embed(&base, Budget::NoVram, &ids);
    let model = base.model();
    let (order, complete) = model.forward_order();
    assert!(complete);
    let keys = model.forward_order_keys();
    assert_eq!(order.len(), keys.len());
    assert_eq!(keys.len(), 5 + 6 * 16, "every weight once");
    assert_eq!(keys[0], "embeddings.word_embeddings.weight");
    assert_eq!(keys[5], "encoder.layer.0.attention.self.query.weight");
    assert_eq!(
        keys.last().unwrap(),
        "encoder.layer.5.output.LayerNorm.bias"
    );
}

#[test]
fn embeddings_agree_whichever_attention_backend_runs() {
    use residency::attention::BackendRequest;
    use residency::models::bert::BertOptions;
    let cases = fixture();
    let sentences: Vec<String> = cases.iter().map(|c| c.sentence.clone()).collect();
    let (ids, mask) = batch(&tokenize(&sentences));
    let patcher = base_patcher(Dtype::F32);
    let config = BertConfig::from_file(model_dir().join("config.json")).unwrap();
    let run = |request: BackendRequest, free: ByteSize| {
        let bert = Bert::new(
            &patcher,
            OpsMode::ManualCast {
                compute: Dtype::F32,
            },
            &config,
        )
        .unwrap()
        .with_options(BertOptions {
            attention: Some(request),
            free_memory: free,
        });
        bert.embed(&ids, &mask, None)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap()
    };
    let naive = run(BackendRequest::Naive, ByteSize::gib(1));
    // Tight free memory forces several query slices and key chunks.
    for (request, free) in [
        (BackendRequest::Split, ByteSize::kib(64)),
        (BackendRequest::SubQuadratic, ByteSize::kib(16)),
        (BackendRequest::SubQuadratic, ByteSize::gib(1)),
        (BackendRequest::Sdpa, ByteSize::kib(16)),
    ] {
        let got = run(request, free);
        for (a, b) in got.iter().zip(&naive) {
            let c = cosine(a, b);
            assert!(c >= 0.999_999, "{request:?} with {free}: cosine {c}");
        }
        for (e, c) in got.iter().zip(&cases) {
            assert!(cosine(e, &c.embedding) >= 0.99999, "{request:?}");
        }
    }
}

/// The first test's f32 case on GPU 0: embeddings against the reference and bit-identical for a
/// full load, a quarter of the model resident (the rest streamed through page-locked staging on
/// the transfer lanes) and `--novram`. Needs `--features cuda` and a GPU; prints why it skipped
/// otherwise (`scripts/gpu-check.sh` runs it on a GPU machine).
#[test]
fn embeddings_on_the_gpu_match_reference_and_are_identical_across_budgets() {
    let name = "embeddings_on_the_gpu_match_reference_and_are_identical_across_budgets";
    if !cfg!(feature = "cuda") {
        eprintln!("skipping {name}: GPU tensors need `--features cuda`");
        return;
    }
    let hw = residency::vram::Hardware::probe();
    if hw.gpus.is_empty() {
        eprintln!("skipping {name}: no CUDA GPU on this machine");
        return;
    }
    let cases = fixture();
    let ids: Vec<Vec<u32>> = cases.iter().map(|c| c.ids.clone()).collect();
    let gpu = residency::DeviceId::Cuda(0);
    let dev = gpu.to_candle().unwrap();
    let m = bert::load_model(
        model_dir().join("model.safetensors"),
        "all-MiniLM-L6-v2",
        Dtype::F32,
    )
    .unwrap();
    let patcher = ModelPatcher::new(Arc::new(m), gpu, residency::DeviceId::Cpu);
    let size = patcher.resident_model_size();
    let config = BertConfig::from_file(model_dir().join("config.json")).unwrap();
    let mut runs = Vec::new();
    for (what, flags) in [
        ("full", vec!["--reserve-vram".to_string(), "0".to_string()]),
        (
            "quarter",
            vec![
                "--reserve-vram".to_string(),
                "0".to_string(),
                "--vram-budget".to_string(),
                (size.bytes() / 4).to_string(),
            ],
        ),
        ("novram", vec!["--novram".to_string()]),
    ] {
        let mm = MemoryManager::new(
            residency::vram::Config::from_args(&flags).unwrap(),
            hw.clone(),
        )
        .unwrap();
        let report = mm
            .load_models_gpu(std::slice::from_ref(&patcher), LoadOptions::default())
            .unwrap();
        let resident = report.models[0].resident.as_f64() / size.as_f64();
        let bert = Bert::new(
            &patcher,
            OpsMode::ManualCast {
                compute: Dtype::F32,
            },
            &config,
        )
        .unwrap();
        let (i, m) = batch(&ids);
        let (i, m) = (i.to_device(&dev).unwrap(), m.to_device(&dev).unwrap());
        // Twice: the second forward is served by prefetch where weights stream.
        let _ = bert.embed(&i, &m, None).unwrap();
        let e = bert.embed(&i, &m, None).unwrap();
        assert!(e.device().is_cuda(), "{what}: computed on the GPU");
        eprintln!(
            "{what}: {:.0}% resident, transfers {:?}",
            resident * 100.0,
            mm.transfer_stats()
        );
        runs.push((what, e.to_vec2::<f32>().unwrap()));
        drop(bert);
        patcher.detach();
    }
    check_runs("GPU f32", &cases, &runs, 0.9999);
}

#[test]
fn split_across_two_simulated_gpus_minilm_gives_the_cpu_bits() {
    // The real model on two GPUs of two thirds of it each: `DeviceMap::auto` places its layer groups
    // in order (the word embeddings, half the model, are one group); a LoRA clone of the split
    // model is split the same way.
    let cases = fixture();
    let ids: Vec<Vec<u32>> = cases.iter().map(|c| c.ids.clone()).collect();
    let cpu = base_patcher(Dtype::F32);
    let (expected, _) = embed(&cpu, Budget::Full, &ids);
    cpu.detach();
    let size = cpu.resident_model_size();
    let device = ByteSize(size.bytes() * 2 / 3);
    let spec = format!("2x{}B@25GB/s", device.bytes());
    // Classic loads place the groups at load; dynamic ones as the forward uses them.
    for dynamic in [false, true] {
        let mm = MemoryManager::new(
            residency::vram::Config::from_args([
                "--sim-gpus",
                spec.as_str(),
                "--reserve-vram",
                "0",
                "--inference-memory",
                "8MiB",
                if dynamic {
                    "--enable-dynamic-vram"
                } else {
                    "--disable-dynamic-vram"
                },
            ])
            .unwrap(),
            residency::vram::Hardware::cpu_only(ByteSize::gib(8)),
        )
        .unwrap();
        let m = bert::load_model(
            model_dir().join("model.safetensors"),
            "all-MiniLM-L6-v2",
            Dtype::F32,
        )
        .unwrap();
        let p = ModelPatcher::new(
            Arc::new(m),
            residency::DeviceId::Sim(0),
            residency::DeviceId::Cpu,
        );
        let map = residency::DeviceMap::auto(&p, &mm.device_budgets(), Default::default());
        let p = p.with_device_map(map);
        let report = mm
            .load_models_gpu(std::slice::from_ref(&p), LoadOptions::default())
            .unwrap();
        assert_eq!(report.models[0].full, !dynamic, "{report:?}");
        for d in 0..2 {
            let d = residency::DeviceId::Sim(d);
            assert!(
                (dynamic || mm.ledger(d) > ByteSize::ZERO) && mm.ledger(d) <= device,
                "{d}"
            );
        }
        let config = BertConfig::from_file(model_dir().join("config.json")).unwrap();
        let mode = OpsMode::ManualCast {
            compute: Dtype::F32,
        };
        let (t, mask) = batch(&ids);
        let got = Bert::new(&p, mode, &config)
            .unwrap()
            .embed(&t, &mask, None)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        assert_eq!(
            bits(&got),
            bits(&expected),
            "split vs CPU (dynamic: {dynamic})"
        );
        for d in 0..2 {
            let d = residency::DeviceId::Sim(d);
            assert!(
                mm.ledger(d) > ByteSize::ZERO && mm.ledger(d) <= device,
                "{d} holds weights after a forward (dynamic: {dynamic})"
            );
        }
        assert!(p.split_stats().activation_moves > 0);
        let clone = attention_lora(&p, 1.0);
        mm.load_models_gpu(std::slice::from_ref(&clone), LoadOptions::default())
            .unwrap();
        let patched = Bert::new(&clone, mode, &config)
            .unwrap()
            .embed(&t, &mask, None)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        let unsplit = attention_lora(&cpu, 1.0);
        let (unsplit, _) = embed(&unsplit, Budget::Full, &ids);
        assert_eq!(
            bits(&patched),
            bits(&unsplit),
            "the LoRA clone, split vs CPU"
        );
        for sim in mm.transfer_engine().devices().sims() {
            assert!(sim.check().is_ok(), "{:?}", sim.check());
        }
    }
}
