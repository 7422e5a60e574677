//! `Managed`: candle-transformers' own BERT, unchanged, on all-MiniLM-L6-v2 under the memory
//! manager. Its embeddings match the reference fixture; beside a streamed model sharing one
//! budget it is evicted whole (its module dropped) and rebuilt with the same bits; a LoRA clone's
//! module reflects its patches; it never streams, not even under `--novram`.
//!
//! The model comes from `bash scripts/fetch-minilm.sh` (run by `scripts/test.sh`).

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_transformers::models::bert::{BertModel, Config as BertConfig};
use common::*;
use residency::loader::{LoadOptions, MemoryManager};
use residency::managed::Managed;
use residency::patcher::{Lora, ModelPatcher, Patch};
use residency::vram::{Config, DeviceId, Hardware};
use residency::weights::Model;
use residency::{ByteSize, Error};

const CPU: DeviceId = DeviceId::Cpu;

fn model_dir() -> PathBuf {
    let dir = std::env::var_os("RESIDENCY_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
        .join(".cache/minilm");
    assert!(
        dir.join("model.safetensors").is_file(),
        "MiniLM is missing: run `bash scripts/fetch-minilm.sh` first (scripts/test.sh does it)"
    );
    dir
}

/// The fixture's sentences as token ids, and their reference embeddings.
fn fixture() -> Vec<(Vec<u32>, Vec<f32>)> {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/minilm_reference.json");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    v["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let ids = c["input_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect();
            let e = c["embedding"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect();
            (ids, e)
        })
        .collect()
}

fn bert_config() -> BertConfig {
    serde_json::from_str(&std::fs::read_to_string(model_dir().join("config.json")).unwrap())
        .unwrap()
}

fn managed_bert(model: Arc<Model>) -> Managed<BertModel> {
    let config = bert_config();
    let patcher = ModelPatcher::new(model, CPU, CPU);
    Managed::new(patcher, move |vb| BertModel::load(vb, &config))
}

/// Sentence embeddings: BERT's hidden states mean-pooled over the mask, L2-normalised.
fn embed(bert: &BertModel, cases: &[(Vec<u32>, Vec<f32>)]) -> Vec<Vec<f32>> {
    cases
        .iter()
        .map(|(ids, _)| {
            let n = ids.len();
            let input = Tensor::new(ids.as_slice(), &Device::Cpu)
                .unwrap()
                .unsqueeze(0)
                .unwrap();
            let types = input.zeros_like().unwrap();
            let mask = Tensor::ones((1, n), DType::U32, &Device::Cpu).unwrap();
            let h = bert.forward(&input, &types, Some(&mask)).unwrap();
            let mean = (h.sum(1).unwrap() / n as f64).unwrap();
            let norm = mean.sqr().unwrap().sum_keepdim(1).unwrap().sqrt().unwrap();
            mean.broadcast_div(&norm)
                .unwrap()
                .squeeze(0)
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        })
        .collect()
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

fn bits(e: &[Vec<f32>]) -> Vec<u32> {
    e.iter().flatten().map(|x| x.to_bits()).collect()
}

#[test]
fn candle_transformers_bert_runs_unchanged_is_evicted_whole_and_rebuilt_with_the_same_bits() {
    let cases = fixture();
    let model = Arc::new(
        Model::from_safetensors("minilm", &[model_dir().join("model.safetensors")]).unwrap(),
    );
    let size = model.model_size();
    let managed = managed_bert(Arc::clone(&model));
    assert!(model.is_whole());
    // One budget for the managed BERT and a streamed model: the BERT fits, both do not.
    let budget = ByteSize(size.bytes() + size.bytes() / 2);
    let config = Config::from_args([
        "--vram-budget".to_string(),
        budget.bytes().to_string(),
        "--reserve-vram".into(),
        "0".into(),
        "--inference-memory".into(),
        "1MiB".into(),
    ])
    .unwrap();
    let mm = MemoryManager::new(config, Hardware::cpu_only(ByteSize::gib(8))).unwrap();

    // Before a load there is nothing to build from.
    assert!(matches!(managed.module(), Err(Error::NotLoaded { .. })));
    let r = mm.load_model_gpu(managed.patcher()).unwrap();
    assert!(r.models[0].full, "{r}");
    let first = embed(&managed.module().unwrap(), &cases);
    for ((_, reference), e) in cases.iter().zip(&first) {
        let c = cosine(e, reference);
        assert!(c >= 0.99999, "cosine {c}");
    }
    assert!(managed.is_built());
    assert_eq!(mm.ledger(CPU), model.resident_bytes(CPU));

    // A streamed model asks for most of the device: the BERT is evicted whole, its module dropped.
    let big = cpu_patcher(virtual_model("streamed", &[size.bytes() / 8; 10]));
    let r = mm
        .load_models_gpu(
            std::slice::from_ref(&big),
            LoadOptions::default().with_memory_required(ByteSize(size.bytes() / 2)),
        )
        .unwrap();
    assert!(
        r.evicted.iter().any(|e| e.name == "minilm" && e.fully),
        "{r}"
    );
    assert_eq!(model.resident_bytes_total(), ByteSize::ZERO);
    assert!(!managed.is_built(), "the module went with the eviction");
    assert!(matches!(managed.module(), Err(Error::NotLoaded { .. })));
    assert!(mm.peak_ledger(CPU) <= budget);

    // Loaded again (the streamed model gives way), rebuilt, the same bits.
    mm.load_model_gpu(managed.patcher()).unwrap();
    let again = embed(&managed.module().unwrap(), &cases);
    assert_eq!(bits(&again), bits(&first));
    assert!(mm.ledger(CPU) <= budget && mm.peak_ledger(CPU) <= budget);

    // A LoRA clone on the query projections: its module reflects its patches; the base is
    // untouched and gets its own bits back when loaded again.
    let mut clone = managed.patcher().clone();
    let patches: Vec<(String, Patch)> = (0..6)
        .map(|l| {
            let up = (rand_tensor(&[384, 4], l) * 0.05).unwrap();
            let down = (rand_tensor(&[4, 384], l + 10) * 0.05).unwrap();
            (
                format!("encoder.layer.{l}.attention.self.query.weight"),
                Patch::Lora(Lora::new(up, down)),
            )
        })
        .collect();
    assert_eq!(clone.add_patches(patches, 1.0, 1.0).unwrap().len(), 6);
    let styled = managed.with_patcher(clone).unwrap();
    mm.load_model_gpu(styled.patcher()).unwrap();
    assert!(
        !managed.is_built(),
        "the base's module is stale once the clone is loaded"
    );
    let lora = embed(&styled.module().unwrap(), &cases);
    assert_ne!(bits(&lora), bits(&first));
    mm.load_model_gpu(managed.patcher()).unwrap();
    assert_eq!(
        bits(&embed(&managed.module().unwrap(), &cases)),
        bits(&first)
    );
}

#[test]
fn a_managed_model_never_streams() {
    let model = Arc::new(
        Model::from_safetensors("minilm", &[model_dir().join("model.safetensors")]).unwrap(),
    );
    let size = model.model_size();
    let managed = managed_bert(Arc::clone(&model));
    // Under --novram a whole model still loads fully.
    let config = Config::from_args([
        "--novram".to_string(),
        "--vram-budget".into(),
        (size.bytes() * 2).to_string(),
    ])
    .unwrap();
    let mm = MemoryManager::new(config, Hardware::cpu_only(ByteSize::gib(8))).unwrap();
    let r = mm.load_model_gpu(managed.patcher()).unwrap();
    assert!(
        r.models[0].full && r.models[0].streaming == ByteSize::ZERO,
        "{r}"
    );
    managed.module().unwrap();
    // On a device smaller than the model it cannot load at all: an error, nothing changed.
    let config =
        Config::from_args(["--vram-budget".to_string(), (size.bytes() / 2).to_string()]).unwrap();
    let small = MemoryManager::new(config, Hardware::cpu_only(ByteSize::gib(8))).unwrap();
    let other = Arc::new(
        Model::from_safetensors("minilm2", &[model_dir().join("model.safetensors")]).unwrap(),
    );
    let other = managed_bert(other);
    let err = small.load_model_gpu(other.patcher()).unwrap_err();
    assert!(matches!(err, Error::BudgetExceeded { .. }), "{err}");
    assert_eq!(other.model().resident_bytes_total(), ByteSize::ZERO);
}
