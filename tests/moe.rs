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
include!("ported/models_shim.rs");

#[path = "ported/mixtral.rs"]
#[rustfmt::skip]
#[allow(dead_code, unexpected_cfgs, clippy::all)]
mod mixtral;

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

    let budgets = budgets(size, file_bytes);
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
        check_misses(what, &mm, &p);
        if let Some(cap) = mm.host_tier().budget() {
            assert!(
                mm.host_tier().stats().peak <= cap,
                "{what}: host tier over budget"
            );
        }
    }
}

/// The budgets every MoE port runs in: fully resident, a quarter, `--novram`, a simulated GPU at
/// a quarter (classic and by use, each with and without cost-aware misses), and `--ram-budget`
/// below the file under `--novram`.
fn budgets(size: u64, file_bytes: u64) -> Vec<(&'static str, Vec<String>)> {
    vec![
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
    ]
}

/// candle-transformers' `quantized_qwen3_moe` (with `quantized_qwen3` and `fused_moe`) on
/// residency: candle-core with `quantized` = residency's mirror, residency's `quantized_nn`,
/// `with_tracing` and `nn::moe` (experts fetched one at a time by the routing).
#[path = "ported/qwen3_moe_managed.rs"]
#[allow(dead_code, unused_imports, clippy::all)]
mod managed;

/// The same three files on candle's own crates, with the one thing candle lacks on the CPU: its
/// `moe_gemm_gguf` (a CUDA kernel only), written here as that kernel defines it — each pair
/// `token * topk + j` multiplies its input row (the token's, or the pair's own with
/// `topk_weights`) by its expert's weight, scaled by its routing weight when given — each
/// expert run once by candle's `QMatMul` on the rows routed to it, its blocks cut out of the
/// stacked tensor.
#[allow(dead_code, unused_imports, clippy::all)]
mod reference {
    pub use candle_core as candle;
    pub use candle_transformers::models::with_tracing;
    pub use candle_transformers::{quantized_nn, quantized_var_builder};
    pub mod moe {
        use candle_core::quantized::{QMatMul, QStorage, QTensor};
        use candle_core::{DType, Device, Module, Result, Tensor};
        pub use candle_nn::moe::moe_gemm;

        #[allow(clippy::too_many_arguments)]
        pub fn moe_gemm_gguf(
            input: &Tensor,
            weights: &QTensor,
            topk_weights: &Option<Tensor>,
            sorted_token_ids: &Tensor,
            experts_ids: &Tensor,
            topk: usize,
            _is_prefill: bool,
            _dtype: DType,
        ) -> Result<Tensor> {
            let (experts, n, k) = weights.shape().dims3()?;
            let data = weights.data()?;
            let each = data.len() / experts;
            let pairs = sorted_token_ids.to_vec1::<u32>()?;
            let ids = experts_ids.to_vec1::<u32>()?;
            let scales = match topk_weights {
                Some(w) => Some(w.flatten_all()?.to_vec1::<f32>()?),
                None => None,
            };
            let rows = input.to_vec2::<f32>()?;
            let mut out = vec![Vec::new(); pairs.len()];
            for e in 0..experts {
                let mine: Vec<usize> = pairs
                    .iter()
                    .zip(&ids)
                    .filter(|(_, &x)| x as usize == e)
                    .map(|(&p, _)| p as usize)
                    .collect();
                if mine.is_empty() {
                    continue;
                }
                let x: Vec<f32> = mine
                    .iter()
                    .flat_map(|&p| rows[if scales.is_some() { p } else { p / topk }].clone())
                    .collect();
                let x = Tensor::from_vec(x, (mine.len(), k), &Device::Cpu)?;
                let blocks = std::borrow::Cow::Borrowed(&data[e * each..(e + 1) * each]);
                let storage = QStorage::from_data(blocks, &Device::Cpu, weights.dtype())?;
                let w = QMatMul::from_qtensor(QTensor::new(storage, (n, k))?)?;
                let y = w.forward(&x)?.to_vec2::<f32>()?;
                for (i, &p) in mine.iter().enumerate() {
                    out[p] = match &scales {
                        Some(s) => y[i].iter().map(|v| v * s[p]).collect(),
                        None => y[i].clone(),
                    };
                }
            }
            Tensor::from_vec(out.concat(), (pairs.len(), n), &Device::Cpu)
        }
    }
    pub mod fused_moe {
        include!("ported/fused_moe.rs");
    }
    pub mod quantized_qwen3 {
        include!("ported/quantized_qwen3.rs");
    }
    pub mod quantized_qwen3_moe {
        include!("ported/quantized_qwen3_moe.rs");
    }
}

/// Logits (as bits) of the prompt and `STEPS` greedy decode steps fed `tokens`.
fn decode(
    mut forward: impl FnMut(&Tensor, usize) -> candle_core::Result<Tensor>,
    tokens: &[u32],
) -> Vec<Vec<u32>> {
    let device = candle_core::Device::Cpu;
    let mut logits = Vec::new();
    let mut call = |input: &[u32], pos: usize| {
        let input = Tensor::new(input, &device).unwrap().unsqueeze(0).unwrap();
        let out = forward(&input, pos).unwrap();
        let v = out.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        logits.push(v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>());
    };
    call(&PROMPT, 0);
    for (step, &next) in tokens.iter().take(STEPS).enumerate() {
        call(&[next], PROMPT.len() + step);
    }
    logits
}

/// Logits (as bits) of the prompt and `STEPS` greedy steps of `forward`, and its greedy tokens.
fn greedy(
    mut forward: impl FnMut(&Tensor, usize) -> candle_core::Result<Tensor>,
) -> (Vec<Vec<u32>>, Vec<u32>) {
    let device = candle_core::Device::Cpu;
    let mut tokens = Vec::new();
    let mut logits = Vec::new();
    let input = Tensor::new(&PROMPT, &device).unwrap().unsqueeze(0).unwrap();
    let mut out = forward(&input, 0).unwrap();
    for step in 0..=STEPS {
        let v = out.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        logits.push(v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>());
        if step == STEPS {
            break;
        }
        let next = argmax(&v);
        tokens.push(next);
        let input = Tensor::new(&[next], &device).unwrap().unsqueeze(0).unwrap();
        out = forward(&input, PROMPT.len() + step).unwrap();
    }
    (logits, tokens)
}

/// [`decode`] of a managed model on `patcher`'s device, and each call's routed experts per MoE
/// layer: those whose weight `key(layer, expert)` was used during the call.
fn routed_decode(
    patcher: &ModelPatcher,
    layers: &[usize],
    key: impl Fn(usize, usize) -> String,
    mut forward: impl FnMut(&Tensor, usize) -> candle_core::Result<Tensor>,
    tokens: &[u32],
) -> (Vec<Vec<u32>>, Vec<Vec<Vec<usize>>>) {
    let device = patcher.load_device().to_candle().unwrap();
    let uses = || -> Vec<Vec<u32>> {
        layers
            .iter()
            .map(|&b| {
                (0..EXPERTS)
                    .map(|e| patcher.model().uses(&key(b, e)).unwrap())
                    .collect()
            })
            .collect()
    };
    let mut routed = Vec::new();
    let logits = decode(
        |input, pos| {
            let before = uses();
            let out = forward(&input.to_device(&device)?, pos)?;
            let after = uses();
            routed.push(
                before
                    .iter()
                    .zip(&after)
                    .map(|(b, a)| (0..EXPERTS).filter(|&e| a[e] > b[e]).collect())
                    .collect(),
            );
            out.to_device(&candle_core::Device::Cpu)
        },
        tokens,
    );
    (logits, routed)
}

/// The reference's logits with its own greedy tokens.
fn qwen3_reference(path: &std::path::Path) -> (Vec<Vec<u32>>, Vec<u32>) {
    use candle_core::{DType, Device};
    let mut file = std::fs::File::open(path).unwrap();
    let ct = candle_core::quantized::gguf_file::Content::read(&mut file).unwrap();
    let mut model = reference::quantized_qwen3_moe::GGUFQWenMoE::from_gguf(
        ct,
        &mut file,
        &Device::Cpu,
        DType::F32,
    )
    .unwrap();
    greedy(|input, pos| model.forward(input, pos))
}

/// The tiny stacked-expert Qwen3-MoE written in `dir`: its path, the reference's logits and
/// greedy tokens, and its bytes.
fn qwen3_fixture(dir: &tempfile::TempDir) -> (std::path::PathBuf, Vec<Vec<u32>>, Vec<u32>, u64) {
    let path = dir.path().join("tiny-qwen3moe.gguf");
    common::gguf::write_tiny_qwen3_moe(&path);
    let (want, tokens) = qwen3_reference(&path);
    let size = Model::from_gguf("size", &path)
        .unwrap()
        .model_size()
        .bytes();
    (path, want, tokens, size)
}

/// The managed Qwen3-MoE port built on `patcher`, and the device it computes on.
fn qwen3_port(
    patcher: &ModelPatcher,
) -> (
    candle_core::Device,
    managed::quantized_qwen3_moe::GGUFQWenMoE,
) {
    let device = patcher.load_device().to_candle().unwrap();
    let ct = gguf_file::Content::from_patcher(patcher);
    let mut reader = std::io::Cursor::new(Vec::<u8>::new());
    let model = managed::quantized_qwen3_moe::GGUFQWenMoE::from_gguf(
        ct,
        &mut reader,
        &device,
        candle_core::DType::F32,
    )
    .unwrap();
    (device, model)
}

/// The managed port's logits, and each call's routed experts per layer (the experts of
/// `ffn_gate_exps` whose own weight was used during the call).
fn qwen3_managed(patcher: &ModelPatcher, tokens: &[u32]) -> (Vec<Vec<u32>>, Vec<Vec<Vec<usize>>>) {
    let (_, mut model) = qwen3_port(patcher);
    let layers: Vec<usize> = (0..BLOCKS).collect();
    routed_decode(
        patcher,
        &layers,
        |b, e| format!("blk.{b}.ffn_gate_exps.{e}.weight"),
        |input, pos| model.forward(input, pos),
        tokens,
    )
}

#[test]
fn stacked_experts_are_one_weight_each_and_quantized_qwen3_moe_computes_the_references_bits_in_every_budget(
) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny-qwen3moe.gguf");
    common::gguf::write_tiny_qwen3_moe(&path);
    let (want, tokens) = qwen3_reference(&path);
    let distinct: std::collections::HashSet<&u32> = tokens.iter().collect();
    assert!(
        distinct.len() > 1,
        "the greedy tokens never change: {tokens:?}"
    );
    let file_bytes = std::fs::metadata(&path).unwrap().len();

    // Each stacked tensor is a stack of EXPERTS weights, each its own byte range of the file.
    let model = Model::from_gguf("tiny-qwen3moe", &path).unwrap();
    let size = model.model_size().bytes();
    for b in 0..BLOCKS {
        for m in ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"] {
            let name = format!("blk.{b}.{m}.weight");
            assert!(model.index_of(&name).is_none(), "{name} is not a slot");
            let stack = model.stack(&name).unwrap_or_else(|| panic!("{name}"));
            assert_eq!(stack.experts().len(), EXPERTS);
            assert_eq!(stack.shape()[0], EXPERTS);
            for (e, &i) in stack.experts().iter().enumerate() {
                let slot = &model.slots()[i];
                assert_eq!(slot.name(), format!("blk.{b}.{m}.{e}.weight"));
                assert_eq!(slot.shape(), &stack.shape()[1..]);
            }
        }
    }
    let expert_bytes: u64 = model
        .slots()
        .iter()
        .filter(|s| s.name().contains("_exps."))
        .map(|s| s.bytes().bytes())
        .sum();
    assert!(expert_bytes * 2 > size, "experts {expert_bytes} of {size}");

    let plain = ModelPatcher::new(Arc::new(model), DeviceId::Cpu, DeviceId::Cpu);
    let (got, routed) = qwen3_managed(&plain, &tokens);
    assert_eq!(got, want, "unmanaged");
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

    for (what, args) in budgets(size, file_bytes) {
        let mut all = vec!["--reserve-vram", "0"];
        all.extend(args.iter().map(String::as_str));
        let mm = common::manager_with(&all);
        let model = mm.read_gguf("tiny-qwen3moe", &path).unwrap();
        let device = mm.compute_device();
        let p = ModelPatcher::new(Arc::new(model), device, DeviceId::Cpu);
        mm.load_models_gpu(std::slice::from_ref(&p), LoadOptions::default())
            .unwrap();
        for round in 0..2 {
            let (got, routed_here) = qwen3_managed(&p, &tokens);
            assert_eq!(got, want, "{what}, round {round}");
            assert_eq!(
                routed_here, routed,
                "{what}, round {round}: the routing differs"
            );
        }
        // On a simulated GPU (lanes): the routing's experts were prefetched, and used.
        let t = mm.transfer_stats();
        // (With cost-aware misses, experts the host runs at decode are not prefetched.)
        if what.starts_with("sim-gpu") && !what.contains("cost-aware") {
            assert!(
                t.routed_prefetches > 0 && t.routed_hits > 0,
                "{what}: {t:?}"
            );
            // A request is counted once, when it is submitted (one already in flight is not
            // asked for again): most are used.
            assert!(
                4 * t.routed_hits >= 3 * t.routed_prefetches,
                "{what}: {t:?}"
            );
        } else if !what.starts_with("sim-gpu") {
            assert_eq!(t.routed_prefetches, 0, "{what}: no lanes, no prefetch");
        }
        assert!(t.routed_hits <= t.routed_prefetches && t.routed_hits <= t.prefetch_hits);
        if what == "sim-gpu quarter, by use" {
            let d = &mm.memory_report().dynamic_devices[0];
            assert!(d.faults_in > 0 && d.hits > 0, "{what}: {d}");
            // Layer by layer: the device's uses, hits and optimum split over the layers used,
            // each block's experts a layer of its own.
            let whole = &mm.dynamic_report()[0];
            let layers = mm.dynamic_layer_report();
            assert!(!whole.truncated);
            assert_eq!(layers.iter().map(|l| l.uses).sum::<u64>(), whole.uses);
            assert_eq!(whole.uses, whole.hits + whole.misses);
            assert_eq!(layers.iter().map(|l| l.hits).sum::<u64>(), whole.hits);
            assert_eq!(
                Some(layers.iter().map(|l| l.optimum_hits).sum::<u64>()),
                whole.optimum_hits
            );
            assert_eq!(
                Some(layers.iter().map(|l| l.fixed_hits).sum::<u64>()),
                whole.fixed_hits
            );
            // Routed experts with a stable skew: the best fixed set keeps hits, and the online
            // order is measured against it.
            assert!(whole.fixed_hits.is_some_and(|f| f > 0), "{whole}");
            for b in 0..BLOCKS {
                let l = layers
                    .iter()
                    .find(|l| l.layer == format!("blk.{b}"))
                    .unwrap_or_else(|| panic!("no blk.{b} in {layers:?}"));
                assert_eq!(l.model, "tiny-qwen3moe");
                assert!(
                    l.hits <= l.uses && l.optimum_hits <= l.uses && l.fixed_hits <= l.uses,
                    "{l}"
                );
            }
        }
        for sim in mm.transfer_engine().devices().sims() {
            assert!(sim.check().is_ok(), "{what}: {:?}", sim.check());
        }
        check_misses(what, &mm, &p);
        if let Some(cap) = mm.host_tier().budget() {
            assert!(
                mm.host_tier().stats().peak <= cap,
                "{what}: host tier over budget"
            );
        }
    }

    // llama.cpp's static placement (`-ncmoe 2`): every expert mapped to the host runs there
    // with cost-aware misses — never copied, never prefetched — the rest loaded; same bits.
    let (got, mm, p, copied) = statically_placed(&path, &tokens, &[]);
    assert_eq!(got, want, "static placement");
    let r = mm.miss_report().unwrap();
    assert!(r.on_host > 0 && r.on_device == 0, "{r}");
    let t = mm.transfer_stats();
    assert_eq!(t.routed_prefetches, 0, "{t:?}");
    let expert_bytes: u64 = p
        .model()
        .slots()
        .iter()
        .filter(|s| s.name().contains("_exps."))
        .map(|s| s.bytes().bytes())
        .sum();
    assert!(copied < expert_bytes, "experts were copied: {t:?}");
}

#[test]
fn the_optimum_is_given_the_room_a_load_left_resident_though_no_fault_in_counted_it() {
    let dir = tempfile::tempdir().unwrap();
    let (path, want, tokens, size) = qwen3_fixture(&dir);
    // By use on a simulated GPU that holds the whole model: the first decode faults every
    // weight in, so after it every use hits and nothing faults in.
    let mm = common::manager_with(&[
        "--reserve-vram",
        "0",
        "--sim-gpu",
        &format!("{}@25GB/s", size * 4),
        "--enable-dynamic-vram",
    ]);
    let device = mm.compute_device();
    let model = mm.read_gguf("tiny-qwen3moe", &path).unwrap();
    let p = ModelPatcher::new(Arc::new(model), device, DeviceId::Cpu);
    mm.load_models_gpu(std::slice::from_ref(&p), LoadOptions::default())
        .unwrap();
    let (got, _) = qwen3_managed(&p, &tokens);
    assert_eq!(got, want);
    mm.reset_dynamic_stats();
    let resident = p.model().resident_bytes(device);
    assert!(resident > residency::ByteSize::ZERO);
    let (got, _) = qwen3_managed(&p, &tokens);
    assert_eq!(got, want);
    let r = &mm.dynamic_report()[0];
    assert_eq!((r.misses, r.faults_in), (0, 0), "{r}");
    assert!(r.hits > 0, "{r}");
    // The optimum's room is what was resident at the first use since the reset, though no
    // fault-in counted it (it was the fault-ins' peak only: 0 B here, Belady's 0 % beside 100 %
    // hits).
    assert!(
        r.room >= resident,
        "{r}: room below the {resident} resident"
    );
    assert!(r.optimum_hits.is_some_and(|o| o > 0), "{r}");
}

/// A static placement of a stacked-expert model (llama.cpp's `-ncmoe`), decoded under `flags`
/// beside a quarter of the model on a simulated GPU with cost-aware misses, every expert mapped
/// to the host: the logits, the manager, the patcher and the bytes the decode copied.
fn statically_placed(
    path: &std::path::Path,
    tokens: &[u32],
    flags: &[&str],
) -> (
    Vec<Vec<u32>>,
    residency::loader::MemoryManager,
    ModelPatcher,
    u64,
) {
    let size = Model::from_gguf("size", path).unwrap().model_size().bytes();
    let sim = format!("{}@25GB/s", size / 4);
    let mut all = vec![
        "--reserve-vram",
        "0",
        "--sim-gpu",
        sim.as_str(),
        "--disable-dynamic-vram",
        "--cost-aware-misses",
    ];
    all.extend_from_slice(flags);
    let mm = common::manager_with(&all);
    let model = mm.read_gguf("tiny-qwen3moe", path).unwrap();
    let map = residency::DeviceMap::new()
        .regex(r"_exps\.", residency::Target::Host)
        .unwrap();
    let p =
        ModelPatcher::new(Arc::new(model), mm.compute_device(), DeviceId::Cpu).with_device_map(map);
    mm.load_models_gpu(std::slice::from_ref(&p), LoadOptions::default())
        .unwrap();
    let before = mm.transfer_stats().bytes_copied();
    let (got, _) = qwen3_managed(&p, tokens);
    let copied = mm.transfer_stats().bytes_copied().bytes() - before.bytes();
    (got, mm, p, copied)
}

#[test]
fn host_runs_keep_prepared_copies_within_their_bound_and_give_the_same_bits() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny-qwen3moe.gguf");
    common::gguf::write_tiny_qwen3_moe(&path);
    let (want, tokens) = qwen3_reference(&path);
    let counted = |p: &ModelPatcher, name: &str| {
        let slot = p.model().slots().iter().find(|s| s.name() == name).unwrap();
        residency::offload::prepared_bytes(slot.bytes())
    };

    // The default room (a quarter of the 64 GiB of `manager_with`'s machine): every expert run
    // on the host is built once, kept, and served from then on.
    let (got, mm, p, copied) = statically_placed(&path, &tokens, &[]);
    assert_eq!(got, want, "prepared copies");
    // The experts the map puts on the host run there: the predicted step copies none of them
    // (it predicted their bytes copied, 698 KiB a step in the moe bench, before it knew).
    assert_eq!(copied, 0, "the rest of the model is resident");
    assert_eq!(mm.predict(&p).bytes, residency::ByteSize::ZERO);
    let r = mm.miss_report().unwrap();
    let prepared = r.prepared;
    assert_eq!(prepared.limit, residency::ByteSize::gib(16));
    assert_eq!(
        r.on_host,
        prepared.hits + prepared.kept + prepared.refused,
        "every host run is served, or builds a copy kept or refused: {r}"
    );
    assert_eq!(prepared.refused, 0, "{r}");
    assert!(prepared.hits > prepared.kept, "{r}");
    // Kept once each: the copies counted are exactly those of the distinct experts that ran.
    let (_, routed) = qwen3_managed(&p, &tokens);
    let after = mm.miss_report().unwrap().prepared;
    assert_eq!(after.kept, prepared.kept, "a second decode builds nothing");
    let used: std::collections::BTreeSet<(usize, usize)> = routed
        .iter()
        .flat_map(|call| {
            call.iter()
                .enumerate()
                .flat_map(|(b, es)| es.iter().map(move |&e| (b, e)))
        })
        .collect();
    let matrices = ["gate", "up", "down"];
    assert_eq!(prepared.kept, (used.len() * matrices.len()) as u64, "{r}");
    let expected: u64 = used
        .iter()
        .flat_map(|&(b, e)| {
            matrices
                .iter()
                .map(move |m| format!("blk.{b}.ffn_{m}_exps.{e}.weight"))
        })
        .map(|name| counted(&p, &name).bytes())
        .sum();
    assert_eq!(after.bytes.bytes(), expected);

    // One forward (the prompt: each routed expert runs once, on a copy just built and kept,
    // which candle re-packs inside that run): every format's host side is measured already, by
    // a second run on the kept copy.
    let (_, mm, _, _) = statically_placed(&path, &[], &[]);
    let r = mm.miss_report().unwrap();
    assert_eq!(r.prepared.hits, 0, "{r}");
    assert!(!r.per_format.is_empty(), "{r}");
    for (format, host, _) in &r.per_format {
        assert!(
            host.is_some(),
            "{format}: host side unmeasured after a forward: {r}"
        );
    }

    // Room for three copies: never more held, the rest built at each run, the same bits.
    let largest = p
        .model()
        .slots()
        .iter()
        .filter(|s| s.name().contains("_exps."))
        .map(|s| residency::offload::prepared_bytes(s.bytes()).bytes())
        .max()
        .unwrap();
    let room = format!("{}B", 3 * largest);
    let (got, mm, _, _) = statically_placed(&path, &tokens, &["--prepared-host", &room]);
    assert_eq!(got, want, "three copies' room");
    let r = mm.miss_report().unwrap();
    assert!(r.prepared.bytes.bytes() <= 3 * largest, "{r}");
    assert!(r.prepared.kept >= 3 && r.prepared.refused > 0, "{r}");
    assert_eq!(
        r.on_host,
        r.prepared.hits + r.prepared.kept + r.prepared.refused
    );

    // None: `--prepared-host 0`, and by default under `--ram-budget` (the host tier's bytes).
    let file = std::fs::metadata(&path).unwrap().len();
    let ram = format!("{}B", file * 2);
    for flags in [
        vec!["--prepared-host", "0"],
        vec!["--ram-budget", ram.as_str()],
    ] {
        let (got, mm, _, _) = statically_placed(&path, &tokens, &flags);
        assert_eq!(got, want, "{flags:?}");
        let r = mm.miss_report().unwrap();
        assert!(r.on_host > 0, "{r}");
        assert_eq!(
            (
                r.prepared.limit,
                r.prepared.bytes,
                r.prepared.hits,
                r.prepared.kept
            ),
            (residency::ByteSize::ZERO, residency::ByteSize::ZERO, 0, 0),
            "{flags:?}: {r}"
        );
        assert_eq!(r.prepared.refused, r.on_host, "{flags:?}: {r}");
    }
}

/// With cost-aware misses, both sides ran (each is measured before the rule decides) and the
/// report says so; without, there is no report.
fn check_misses(what: &str, mm: &residency::loader::MemoryManager, p: &ModelPatcher) {
    // A plan shows the rule and the figures measured so far (nothing ran since the report).
    let plan = mm
        .plan(std::slice::from_ref(p), LoadOptions::default())
        .unwrap();
    assert_eq!(plan.misses, mm.miss_report(), "{what}: the plan's misses");
    match mm.miss_report() {
        Some(r) => {
            assert!(what.contains("cost-aware"), "{what}: {r}");
            assert!(r.on_host > 0 && r.on_device > 0, "{what}: {r}");
            assert!(
                r.bytes_not_copied > 0 && r.link_ps_per_byte.is_some(),
                "{what}: {r}"
            );
            assert!(mm.memory_report().to_string().contains("cost-aware misses"));
        }
        None => assert!(!what.contains("cost-aware"), "{what}: no report"),
    }
}

#[test]
fn a_growing_kv_cache_takes_room_from_the_coldest_experts_first_and_never_fails_while_experts_hold_room(
) {
    let dir = tempfile::tempdir().unwrap();
    let (path, want, tokens, size) = qwen3_fixture(&dir);
    // Room for most of the model: after a decode most experts are kept.
    let mm = common::manager_with(&[
        "--reserve-vram",
        "0",
        "--sim-gpu",
        &format!("{}@25GB/s", size * 3 / 4),
    ]);
    let device = mm.compute_device();
    let model = mm.read_gguf("tiny-qwen3moe", &path).unwrap();
    let p = ModelPatcher::new(Arc::new(model), device, DeviceId::Cpu);
    mm.load_models_gpu(std::slice::from_ref(&p), LoadOptions::default())
        .unwrap();
    let (got, _) = qwen3_managed(&p, &tokens);
    assert_eq!(got, want);
    let m = p.model();
    let resident = |i: usize| {
        m.residency_of(i)
            .is_some_and(|r| matches!(r, residency::weights::SlotResidency::Resident { .. }))
    };
    let is_expert = |i: usize| m.slots()[i].name().contains("_exps.");
    let kept = |f: &dyn Fn(usize) -> bool| -> Vec<usize> {
        (0..m.len()).filter(|&i| resident(i) && f(i)).collect()
    };
    let experts_at_start = kept(&is_expert).len();
    assert!(experts_at_start >= 6, "{experts_at_start} experts kept");
    let dense_at_start = kept(&|i| !is_expert(i));
    let step = residency::ByteSize::kib(32);
    let mut kv = mm.reserve_named("kv-cache", device, step).unwrap();
    let mut grew = 0;
    loop {
        let before: Vec<usize> = kept(&|_| true);
        let experts_before: Vec<usize> = before.iter().copied().filter(|&i| is_expert(i)).collect();
        let expert_bytes: u64 = experts_before
            .iter()
            .map(|&i| m.slots()[i].bytes().bytes())
            .sum();
        match kv.grow(&mm, step) {
            Ok(()) => grew += 1,
            Err(e) => {
                assert!(
                    expert_bytes < step.bytes(),
                    "refused while experts held {expert_bytes} bytes: {e}"
                );
                break;
            }
        }
        let after: Vec<usize> = kept(&|_| true);
        let gone: Vec<usize> = before
            .iter()
            .copied()
            .filter(|i| !after.contains(i))
            .collect();
        // Experts go before any dense weight, the least used first.
        if !experts_before.is_empty() {
            let dense_gone: Vec<&str> = gone
                .iter()
                .filter(|&&i| !is_expert(i))
                .map(|&i| m.slots()[i].name())
                .collect();
            let expert_left = after.iter().any(|&i| is_expert(i));
            assert!(
                dense_gone.is_empty() || !expert_left,
                "dense {dense_gone:?} evicted while experts stayed"
            );
            let count = |i: usize| m.uses(m.slots()[i].name()).unwrap_or(0);
            if let (Some(max_gone), Some(min_left)) = (
                gone.iter()
                    .filter(|&&i| is_expert(i))
                    .map(|&i| count(i))
                    .max(),
                after
                    .iter()
                    .filter(|&&i| is_expert(i))
                    .map(|&i| count(i))
                    .min(),
            ) {
                assert!(
                    max_gone <= min_left,
                    "a hotter expert went first ({max_gone} > {min_left})"
                );
            }
        }
        assert!(mm.ledger(device).bytes() <= size * 3 / 4);
    }
    assert!(grew > experts_at_start / 2, "grew {grew} steps");
    assert!(kept(&is_expert).is_empty() || kept(&|i| !is_expert(i)) == dense_at_start);
    // The model still computes the same bits beside the cache (streaming what no longer fits).
    drop(kv);
    let (got, _) = qwen3_managed(&p, &tokens);
    assert_eq!(got, want, "after the cache");
}

/// candle-transformers' safetensors Qwen3-MoE and Qwen3 (`tests/ported/qwen3_moe.rs`,
/// `tests/ported/qwen3.rs`) on residency: candle-core, `residency::nn` (each file's own `use`
/// line), `residency::with_tracing`, and `fused_moe.rs` with `candle_nn` = `residency::nn` (its
/// `FusedMoe` is what the model builds under the `cuda` feature).
#[allow(dead_code, unused_imports, unexpected_cfgs, clippy::all)]
mod safetensors_managed {
    pub(crate) use crate::candle;
    pub(crate) use crate::utils;
    pub use residency::nn::moe;
    pub use residency::{quantized_var_builder, with_tracing};
    pub mod fused_moe {
        use residency::nn as candle_nn;
        include!("ported/fused_moe.rs");
    }
    pub mod qwen3 {
        include!("ported/qwen3.rs");
    }
    pub mod qwen3_moe {
        include!("ported/qwen3_moe.rs");
    }
}

/// The tiny Mixtral: 2 layers, 8 experts of which 2 per token.
const MIXTRAL: &str = r#"{
    "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu",
    "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "sliding_window": 256, "num_experts_per_tok": 2, "num_local_experts": 8,
    "use_flash_attn": false
}"#;

/// The tiny Qwen3-MoE: layer 0 a dense MLP, layer 1 8 experts of which 2 per token (decoder
/// sparse step 2), an untied head.
const QWEN3_MOE: &str = r#"{
    "vocab_size": 64, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "head_dim": 16, "attention_bias": false,
    "num_key_value_heads": 2, "max_position_embeddings": 256, "sliding_window": null,
    "max_window_layers": 2, "tie_word_embeddings": false, "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6, "use_sliding_window": false, "hidden_act": "silu",
    "decoder_sparse_step": 2, "moe_intermediate_size": 32, "num_experts_per_tok": 2,
    "num_experts": 8, "norm_topk_prob": true
}"#;

/// A tiny safetensors checkpoint (f32) of every weight `build` asks candle-nn's builder for:
/// uniform values, the embedding table small, norms near 1, each router's rows (`….gate.weight`) scaled by `1 + e/2`
/// (skewed routing, as `write_tiny_moe`).
fn safetensors_checkpoint(
    dir: &std::path::Path,
    name: &str,
    build: impl FnOnce(candle_nn::VarBuilder) -> candle_core::Result<()>,
) -> std::path::PathBuf {
    use candle_core::{DType, Device};
    let varmap = candle_nn::VarMap::new();
    build(candle_nn::VarBuilder::from_varmap(
        &varmap,
        DType::F32,
        &Device::Cpu,
    ))
    .unwrap();
    let data = varmap.data().lock().unwrap();
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    for (i, name) in names.into_iter().enumerate() {
        let var = &data[name];
        let u = residency::float::uniform_tensor(var.dims(), 700 + i as u64).unwrap();
        let t = if name.ends_with("norm.weight") {
            u.affine(0.2, 1.0).unwrap()
        } else if name.ends_with(".gate.weight") {
            let skew: Vec<f32> = (0..EXPERTS).map(|e| 1.0 + e as f32 / 2.0).collect();
            let skew = Tensor::from_vec(skew, (EXPERTS, 1), &Device::Cpu).unwrap();
            u.broadcast_mul(&skew).unwrap()
        } else if name.contains("embed_tokens") {
            // Small beside the blocks' outputs: a tied head then reads more than the input
            // token's own row back (which would repeat the prompt's last token forever).
            u.affine(0.1, 0.0).unwrap()
        } else if name.contains("lm_head") {
            u
        } else {
            u.affine(0.25, 0.0).unwrap()
        };
        var.set(&t).unwrap();
    }
    drop(data);
    let path = dir.join(format!("{name}.safetensors"));
    varmap.save(&path).unwrap();
    path
}

/// candle-nn's builder on the checkpoint's tensors.
fn candle_vb(path: &std::path::Path) -> candle_nn::VarBuilder<'static> {
    use candle_core::{DType, Device};
    let tensors = candle_core::safetensors::load(path, &Device::Cpu).unwrap();
    candle_nn::VarBuilder::from_tensors(tensors, DType::F32, &Device::Cpu)
}

/// residency's builder on `patcher` (weights as stored).
fn managed_vb(patcher: &ModelPatcher) -> residency::nn::VarBuilder<'_> {
    residency::nn::VarBuilder::from_patcher(patcher, residency::ops::OpsMode::DisableWeightInit)
        .unwrap()
}

/// A safetensors MoE port against candle's own model: the reference's greedy logits and tokens,
/// then the port's logits unmanaged and in every budget of [`budgets`], the same bits and the
/// same routing each time, exactly `EXPERTS_USED` experts read per MoE layer per decode step.
fn check_safetensors_port(
    path: &std::path::Path,
    (want, tokens): (Vec<Vec<u32>>, Vec<u32>),
    managed: impl Fn(&ModelPatcher, &[u32]) -> (Vec<Vec<u32>>, Vec<Vec<Vec<usize>>>),
) {
    let distinct: std::collections::HashSet<&u32> = tokens.iter().collect();
    assert!(
        distinct.len() > 1,
        "the greedy tokens never change: {tokens:?}"
    );
    let file_bytes = std::fs::metadata(path).unwrap().len();
    let model = Arc::new(Model::from_safetensors("moe", &[path]).unwrap());
    let size = model.model_size().bytes();
    let plain = ModelPatcher::new(Arc::clone(&model), DeviceId::Cpu, DeviceId::Cpu);
    let (got, routed) = managed(&plain, &tokens);
    assert_eq!(got, want, "unmanaged");
    for (step, layers) in routed.iter().enumerate().skip(1) {
        for (b, experts) in layers.iter().enumerate() {
            assert_eq!(
                experts.len(),
                EXPERTS_USED,
                "step {step}, MoE layer {b}: {experts:?}"
            );
        }
    }
    let moved: std::collections::HashSet<&Vec<Vec<usize>>> = routed.iter().skip(1).collect();
    assert!(moved.len() > 1, "the routing never moves: {routed:?}");
    for (what, args) in budgets(size, file_bytes) {
        let mut all = vec!["--reserve-vram", "0"];
        all.extend(args.iter().map(String::as_str));
        let mm = common::manager_with(&all);
        let model = mm.read_model("moe", &[path]).unwrap();
        let device = mm.compute_device();
        let p = ModelPatcher::new(Arc::new(model), device, DeviceId::Cpu);
        mm.load_models_gpu(std::slice::from_ref(&p), LoadOptions::default())
            .unwrap();
        let (got, routed_here) = managed(&p, &tokens);
        assert_eq!(got, want, "{what}");
        assert_eq!(routed_here, routed, "{what}: the routing differs");
        assert_eq!(
            p.model().held_outside(),
            vec![],
            "{what}: the port holds weights outside the ledger"
        );
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

#[test]
fn the_safetensors_mixtral_ported_by_its_use_lines_computes_candles_bits_in_every_budget() {
    use candle_transformers::models::mixtral as theirs;
    let dir = tempfile::tempdir().unwrap();
    let cfg: theirs::Config = serde_json::from_str(MIXTRAL).unwrap();
    let path = safetensors_checkpoint(dir.path(), "mixtral", |vb| {
        theirs::Model::new(&cfg, vb).map(drop)
    });
    let mut reference = theirs::Model::new(&cfg, candle_vb(&path)).unwrap();
    let reference = greedy(|input, pos| reference.forward(input, pos));
    check_safetensors_port(&path, reference, |p, tokens| {
        let cfg: mixtral::Config = serde_json::from_str(MIXTRAL).unwrap();
        let mut model = mixtral::Model::new(&cfg, managed_vb(p)).unwrap();
        routed_decode(
            p,
            &[0, 1],
            |b, e| format!("model.layers.{b}.block_sparse_moe.experts.{e}.w1.weight"),
            |input, pos| model.forward(input, pos),
            tokens,
        )
    });
}

#[test]
fn the_safetensors_qwen3_moe_ported_by_its_use_lines_computes_candles_bits_in_every_budget_tied_or_not(
) {
    use candle_transformers::models::qwen3_moe as theirs;
    for tied in [false, true] {
        let json = QWEN3_MOE.replace(
            r#""tie_word_embeddings": false"#,
            &format!(r#""tie_word_embeddings": {tied}"#),
        );
        let dir = tempfile::tempdir().unwrap();
        let cfg: theirs::Config = serde_json::from_str(&json).unwrap();
        assert_eq!(cfg.tie_word_embeddings, tied);
        let path = safetensors_checkpoint(dir.path(), "qwen3moe", |vb| {
            theirs::ModelForCausalLM::new(&cfg, vb).map(drop)
        });
        let mut reference = theirs::ModelForCausalLM::new(&cfg, candle_vb(&path)).unwrap();
        let reference = greedy(|input, pos| reference.forward(input, pos));
        // Tied, upstream's head is `Linear::from_weights(embed_tokens.embeddings().clone(), None)`:
        // on residency it fetches the embedding's weight, so nothing is held outside the ledger.
        check_safetensors_port(&path, reference, |p, tokens| {
            use safetensors_managed::qwen3_moe;
            let cfg: qwen3_moe::Config = serde_json::from_str(&json).unwrap();
            let mut model = qwen3_moe::ModelForCausalLM::new(&cfg, managed_vb(p)).unwrap();
            let table = "model.embed_tokens.weight";
            let before = p.model().uses(table).unwrap();
            let out = routed_decode(
                p,
                &[1],
                |b, e| format!("model.layers.{b}.mlp.experts.{e}.gate_proj.weight"),
                |input, pos| model.forward(input, pos),
                tokens,
            );
            let per_call = (p.model().uses(table).unwrap() - before) / (STEPS as u32 + 1);
            assert_eq!(
                per_call,
                1 + u32::from(tied),
                "the table's fetches per forward"
            );
            out
        });
    }
}

/// Cost-aware misses change bits on a real GPU, so they stay opt-in; where they would pay, the
/// plan, `recommend` and the audit say so with the predicted gain. Here a quarter of the tiny
/// Qwen3-MoE on a simulated GPU behind a slow link (10 MB/s, no lanes): at decode the copies of
/// the streamed weights are waited for, and multiplying them on the host (the
/// simulated GPU computes with the host's kernels) is predicted faster; turning the option on
/// delivers a faster decode with the same bits. Where the option is on, or nothing streams,
/// nothing is recommended.
#[test]
fn cost_aware_misses_are_recommended_with_their_predicted_gain_where_a_slow_link_feeds_streamed_quantized_weights(
) {
    let dir = tempfile::tempdir().unwrap();
    let (path, want, tokens, size) = qwen3_fixture(&dir);
    let run = |sim: u64, flags: &[&str]| {
        let sim = format!("{sim}@10MB/s");
        let mut all = vec![
            "--reserve-vram",
            "0",
            "--sim-gpu",
            sim.as_str(),
            "--disable-dynamic-vram",
            "--disable-async-offload",
        ];
        all.extend_from_slice(flags);
        let mm = common::manager_with(&all);
        let model = mm.read_gguf("tiny-qwen3moe", &path).unwrap();
        let p = ModelPatcher::new(Arc::new(model), mm.compute_device(), DeviceId::Cpu);
        mm.load_models_gpu(std::slice::from_ref(&p), LoadOptions::default())
            .unwrap();
        // A first decode measures the compute (and checks the bits); a second one's decode
        // steps, after its prompt, are timed.
        let (got, _) = qwen3_managed(&p, &tokens);
        assert_eq!(got, want, "{flags:?}");
        let took = timed_decode(&p, &tokens);
        (mm, p, took)
    };

    let (mm, p, plain) = run(size / 4, &[]);
    let r = mm.recommend(&p).expect("a recommendation");
    println!("{r}");
    assert_eq!(r.flag, "--cost-aware-misses");
    assert_eq!(r.rows, 1, "priced at decode's one row: {r}");
    assert!(r.weights > 0 && r.now.streamed >= r.weights, "{r}");
    assert!(
        r.with.bytes < r.now.bytes,
        "the weights run on the host are not copied: {r}"
    );
    assert!(r.gain() >= 1.5, "a slow link: {r}");
    // The plan of a reload says the same (its resident set is the one loaded).
    let plan = mm
        .plan(std::slice::from_ref(&p), LoadOptions::default())
        .unwrap();
    let planned = plan.models[0].recommended.as_ref().expect("in the plan");
    assert_eq!(planned.flag, r.flag);
    assert!(planned.gain() >= 1.5, "{planned}");
    // An audited step carries it into the report.
    let ((), audit) = mm.audit(&p, || {
        timed_decode(&p, &tokens[..1]);
    });
    assert!(audit.recommended.is_some(), "{audit}");
    assert!(
        mm.memory_report()
            .to_string()
            .contains("recommended: `tiny-qwen3moe`: `--cost-aware-misses` predicted"),
        "{}",
        mm.memory_report()
    );

    // Turned on: the same bits (checked in `run`), a faster decode, nothing more to recommend.
    let (mm, p, aware) = run(size / 4, &["--cost-aware-misses"]);
    assert!(mm.recommend(&p).is_none());
    assert!(
        aware < plain,
        "predicted {:.1}× faster, measured {plain:?} → {aware:?}",
        r.gain()
    );
    println!(
        "predicted {:.1}× faster, measured {:.1}× ({plain:?} → {aware:?})",
        r.gain(),
        plain.as_secs_f64() / aware.as_secs_f64()
    );

    // Everything resident: nothing streams, nothing to gain.
    let (mm, p, _) = run(size * 4, &[]);
    assert!(mm.recommend(&p).is_none());
}

/// The time of `tokens.len()` (at most `STEPS`) decode steps of the managed Qwen3-MoE after its
/// prompt (not timed).
fn timed_decode(patcher: &ModelPatcher, tokens: &[u32]) -> std::time::Duration {
    let (device, mut model) = qwen3_port(patcher);
    let input = |t: &[u32]| Tensor::new(t, &device).unwrap().unsqueeze(0).unwrap();
    model.forward(&input(&PROMPT), 0).unwrap();
    let t0 = std::time::Instant::now();
    for (step, &next) in tokens.iter().take(STEPS).enumerate() {
        model.forward(&input(&[next]), PROMPT.len() + step).unwrap();
    }
    t0.elapsed()
}
