//! A mixture of experts through the manager (issue 36's first slice): candle-transformers'
//! `quantized_llama` reading a Mixtral-layout GGUF (one tensor per expert, 8 experts, top-2,
//! skewed routing), ported by its `use` lines, computes candle's logits bit for bit in every
//! budget; an expert is a weight like any other, fetched only when a token is routed to it, so
//! under residency by use the experts kept are the ones the routing uses.

mod common;

use std::sync::Arc;

use candle_core::Tensor;
use common::gguf::{argmax, reference_logits, write_tiny_moe, BLOCKS, EXPERTS, EXPERTS_USED};
use residency::loader::LoadOptions;
use residency::quantized::gguf_file;
use residency::vram::DeviceId;
use residency::weights::Model;
use residency::ModelPatcher;

include!("ported/shim.rs");

#[path = "ported/quantized_llama.rs"]
#[allow(dead_code, clippy::all)]
mod quantized_llama;

const PROMPT: [u32; 5] = [1, 17, 42, 5, 63];
const STEPS: usize = 6;

/// The port's logits over the prompt and `STEPS` cached steps fed `tokens`, and each layer's
/// experts used by every call (the expert's `ffn_gate` fetched during it).
fn ported(patcher: &ModelPatcher, tokens: &[u32]) -> (Vec<Vec<u32>>, Vec<Vec<Vec<usize>>>) {
    let device = patcher.load_device().to_candle().unwrap();
    let ct = gguf_file::Content::from_patcher(patcher);
    let mut reader = std::io::Cursor::new(Vec::<u8>::new());
    let mut model = quantized_llama::ModelWeights::from_gguf(ct, &mut reader, &device).unwrap();
    let uses = |p: &ModelPatcher| -> Vec<Vec<u32>> {
        (0..BLOCKS)
            .map(|b| {
                (0..EXPERTS)
                    .map(|e| {
                        p.model()
                            .uses(&format!("blk.{b}.ffn_gate.{e}.weight"))
                            .unwrap()
                    })
                    .collect()
            })
            .collect()
    };
    let mut logits = Vec::new();
    let mut routed = Vec::new();
    let mut call = |input: &[u32], pos: usize| {
        let before = uses(patcher);
        let input = Tensor::new(input, &device).unwrap().unsqueeze(0).unwrap();
        let out = model.forward(&input, pos).unwrap();
        let v = out.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        logits.push(v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>());
        let after = uses(patcher);
        routed.push(
            (0..BLOCKS)
                .map(|b| {
                    (0..EXPERTS)
                        .filter(|&e| after[b][e] > before[b][e])
                        .collect::<Vec<usize>>()
                })
                .collect::<Vec<_>>(),
        );
    };
    call(&PROMPT, 0);
    for (step, &next) in tokens.iter().take(STEPS).enumerate() {
        call(&[next], PROMPT.len() + step);
    }
    (logits, routed)
}

#[test]
fn a_mixture_of_experts_computes_candles_bits_in_every_budget_and_reads_only_routed_experts() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny-moe.gguf");
    write_tiny_moe(&path);
    let reference = reference_logits(&path, &PROMPT, STEPS);
    let tokens: Vec<u32> = reference.iter().map(|l| argmax(l)).collect();
    let want: Vec<Vec<u32>> = reference
        .iter()
        .map(|l| l.iter().map(|x| x.to_bits()).collect())
        .collect();
    let file_bytes = std::fs::metadata(&path).unwrap().len();

    let model = Model::from_gguf("tiny-moe", &path).unwrap();
    let size = model.model_size().bytes();
    let expert_bytes: u64 = model
        .slots()
        .iter()
        .filter(|s| {
            s.name().contains(".ffn_gate.")
                || s.name().contains(".ffn_up.")
                || s.name().contains(".ffn_down.")
        })
        .map(|s| s.bytes().bytes())
        .sum();
    assert!(
        expert_bytes * 2 > size,
        "the experts are most of the model's bytes: {expert_bytes} of {size}"
    );
    let plain = ModelPatcher::new(Arc::new(model), DeviceId::Cpu, DeviceId::Cpu);
    let (got, routed) = ported(&plain, &tokens);
    assert_eq!(got, want, "unmanaged");
    // A decode step routes its one token to exactly EXPERTS_USED experts per layer, and only
    // those are read; over the steps the routing moves between experts.
    for (step, layers) in routed.iter().enumerate().skip(1) {
        for (b, experts) in layers.iter().enumerate() {
            assert_eq!(
                experts.len(),
                EXPERTS_USED,
                "step {step}, layer {b}: {experts:?}"
            );
        }
    }
    let distinct: std::collections::HashSet<&Vec<usize>> =
        routed.iter().skip(1).map(|l| &l[0]).collect();
    assert!(distinct.len() > 1, "routing never changed: {routed:?}");

    let budgets: Vec<(&str, Vec<String>)> = vec![
        ("full", vec!["--vram-budget".into(), "64MiB".into()]),
        (
            "quarter",
            vec!["--vram-budget".into(), (size / 4).to_string()],
        ),
        (
            "novram",
            vec!["--novram".into(), "--vram-budget".into(), "64MiB".into()],
        ),
        (
            "sim-gpu quarter, classic",
            vec![
                "--sim-gpu".into(),
                format!("{}@25GB/s", size / 4),
                "--disable-dynamic-vram".into(),
            ],
        ),
        (
            "sim-gpu quarter, by use",
            vec!["--sim-gpu".into(), format!("{}@25GB/s", size / 4)],
        ),
        (
            "ram-budget < file, novram",
            vec![
                "--novram".into(),
                "--vram-budget".into(),
                "64MiB".into(),
                "--ram-budget".into(),
                (file_bytes / 3).to_string(),
            ],
        ),
    ];
    for (what, args) in budgets {
        let mut all = vec!["--reserve-vram", "0"];
        all.extend(args.iter().map(String::as_str));
        let mm = common::manager_with(&all);
        let model = mm.read_gguf("tiny-moe", &path).unwrap();
        let device = mm.compute_device();
        let p = ModelPatcher::new(Arc::new(model), device, DeviceId::Cpu);
        mm.load_models_gpu(std::slice::from_ref(&p), LoadOptions::default())
            .unwrap();
        for round in 0..2 {
            let (got, routed_here) = ported(&p, &tokens);
            assert_eq!(got, want, "{what}, round {round}");
            assert_eq!(
                routed_here, routed,
                "{what}, round {round}: the routing differs"
            );
        }
        if what == "sim-gpu quarter, by use" {
            // What the forwards kept: within the budget, and more than nothing.
            let kept = mm.ledger(device).bytes();
            assert!(
                kept > 0 && kept <= size / 4,
                "{what}: kept {kept} of {size}"
            );
            let d = &mm.memory_report().dynamic_devices[0];
            assert!(d.faults_in > 0 && d.hits > 0, "{what}: {d}");
        }
        for sim in mm.transfer_engine().devices().sims() {
            assert!(sim.check().is_ok(), "{what}: {:?}", sim.check());
        }
        if let Some(cap) = mm.host_tier().budget() {
            assert!(
                mm.host_tier().stats().peak <= cap,
                "{what}: host tier over budget"
            );
        }
    }
}
