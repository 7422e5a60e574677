//! candle-transformers' T5 encoder ported by its `use` lines (`tests/ported/t5.rs`) against
//! candle-transformers' own, on one checkpoint: the same bits fully resident, under `--novram` and
//! on a simulated GPU — and every byte of the model on its device is in the ledger. T5 keeps most
//! of its weights as its own tensors (its `Linear` and `T5LayerNorm` hold what `vb.get` returns):
//! those are counted as held outside, by key, and the ledger includes them; its embeddings go
//! through `with_tracing::Embedding` and stay managed.

mod common;

include!("ported/shim.rs");
include!("ported/models_shim.rs");

#[path = "ported/t5.rs"]
#[allow(dead_code, clippy::all)]
mod t5;

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use residency::ops::OpsMode;
use residency::patcher::ModelPatcher;
use residency::vram::DeviceId;
use residency::weights::Model;
use residency::ByteSize;

const CONFIG: &str = r#"{
    "vocab_size": 96, "d_model": 32, "d_kv": 8, "d_ff": 48, "num_layers": 2, "num_heads": 4,
    "relative_attention_num_buckets": 8, "relative_attention_max_distance": 16,
    "dropout_rate": 0.0, "layer_norm_epsilon": 1e-6, "initializer_factor": 1.0,
    "feed_forward_proj": "gated-gelu", "is_encoder_decoder": true, "use_cache": false,
    "pad_token_id": 0, "eos_token_id": 1
}"#;

/// A tiny T5 checkpoint: every weight candle-transformers' encoder asks for, random.
fn checkpoint(dir: &std::path::Path) -> std::path::PathBuf {
    let cfg: candle_transformers::models::t5::Config = serde_json::from_str(CONFIG).unwrap();
    let varmap = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    candle_transformers::models::t5::T5EncoderModel::load(vb, &cfg).unwrap();
    for (i, (_, var)) in varmap.data().lock().unwrap().iter().enumerate() {
        let t = residency::float::uniform_tensor(var.dims(), 100 + i as u64).unwrap();
        var.set(&(t * 0.5).unwrap()).unwrap();
    }
    let path = dir.join("t5.safetensors");
    varmap.save(&path).unwrap();
    path
}

fn reference(path: &std::path::Path, ids: &Tensor) -> Vec<u32> {
    let cfg: candle_transformers::models::t5::Config = serde_json::from_str(CONFIG).unwrap();
    let tensors: HashMap<String, Tensor> =
        candle_core::safetensors::load(path, &Device::Cpu).unwrap();
    let vb = candle_nn::VarBuilder::from_tensors(tensors, DType::F32, &Device::Cpu);
    let mut model = candle_transformers::models::t5::T5EncoderModel::load(vb, &cfg).unwrap();
    common::bits(&model.forward(ids).unwrap())
}

#[test]
fn the_ported_t5_encoder_gives_candle_s_bits_and_nothing_it_holds_escapes_the_ledger() {
    let dir = tempfile::tempdir().unwrap();
    let path = checkpoint(dir.path());
    let ids = Tensor::new(&[[3u32, 17, 42, 5, 88, 1]], &Device::Cpu).unwrap();
    let expected = reference(&path, &ids);
    let cfg: t5::Config = serde_json::from_str(CONFIG).unwrap();
    for (flags, device) in [
        (&["--vram-budget", "64MiB"][..], DeviceId::Cpu),
        (&["--vram-budget", "64MiB", "--novram"][..], DeviceId::Cpu),
        (
            &["--sim-gpu", "8MiB", "--disable-dynamic-vram"][..],
            DeviceId::Sim(0),
        ),
        (&["--sim-gpu", "8MiB", "--novram"][..], DeviceId::Sim(0)),
    ] {
        let mm = common::manager_with(flags);
        let model = Arc::new(Model::from_safetensors("t5", &[&path]).unwrap());
        let p = ModelPatcher::new(Arc::clone(&model), device, DeviceId::Cpu);
        let vb = residency::nn::VarBuilder::from_patcher(&p, OpsMode::DisableWeightInit).unwrap();
        let mut port = t5::T5EncoderModel::load(vb, &cfg).unwrap();
        let report = mm.load_model_gpu(&p).unwrap();
        let got = common::bits(
            &port
                .forward(&ids.to_device(port.device()).unwrap())
                .unwrap(),
        );
        assert_eq!(got, expected, "{flags:?}");

        // What T5's own layers keep: every weight but the embeddings (managed by
        // `with_tracing::Embedding`), counted by key, in the report and in the ledger.
        let outside: BTreeSet<String> = model.held_outside().into_iter().map(|(k, _)| k).collect();
        let managed: BTreeSet<String> = model
            .keys()
            .filter(|k| !outside.contains(*k))
            .map(str::to_string)
            .collect();
        assert_eq!(
            managed,
            BTreeSet::from([
                "encoder.embed_tokens.weight".to_string(),
                "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight".to_string(),
            ]),
            "{flags:?}"
        );
        let outside_bytes: ByteSize = model.held_outside().iter().map(|(_, b)| *b).sum();
        // Every byte of the checkpoint is the manager's: managed by key, or counted in the
        // ledger as held by the model.
        let managed_bytes: ByteSize = managed.iter().map(|k| model.slot(k).unwrap().bytes()).sum();
        assert_eq!(
            managed_bytes.saturating_add(outside_bytes),
            model.model_size(),
            "{flags:?}"
        );
        assert_eq!(report.models[0].held_outside, outside_bytes, "{flags:?}");
        assert_eq!(
            report.models[0]
                .outside_keys
                .iter()
                .cloned()
                .collect::<BTreeSet<_>>(),
            outside
        );
        let resident = model.resident_bytes(device);
        assert_eq!(
            mm.ledger(device),
            resident.saturating_add(outside_bytes),
            "{flags:?}: the ledger holds the resident copies and what the model keeps"
        );
        if flags.contains(&"--novram") {
            assert_eq!(resident, ByteSize::ZERO, "{flags:?}");
            assert!(
                mm.ledger(device) > ByteSize::ZERO,
                "{flags:?}: not zero under --novram"
            );
        }
        // Most of T5's bytes are its own tensors (upstream's 90.8 % at t5-small's shapes).
        assert!(
            outside_bytes.bytes() * 2 > model.model_size().bytes(),
            "{flags:?}: {outside_bytes} of {}",
            model.model_size()
        );
    }
}
