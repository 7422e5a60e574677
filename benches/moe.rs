//! A mixture of experts decoded at batch 1 on a simulated GPU at 25 GB/s with 30 % of the model's
//! bytes: the expert cache against plain streaming, llama.cpp's static placement and the model
//! fully resident (issue 36's figures).
//!
//! The model: the tiny Qwen3-MoE of `tests/common/gguf.rs` (2 blocks, 8 stacked experts of
//! Q4K / Q8_0 / Q6K each, top-2, a skewed router), run by candle-transformers'
//! `quantized_qwen3_moe` ported by its `use` lines; a 5-token prompt, then `TOKENS` greedy
//! tokens timed. Every run gives the same logits (checked).
//!
//! - **resident** (the limit): the whole model on a device large enough;
//! - **(a) plain streaming**: the classic partial load, every expert not resident copied at each
//!   use and dropped;
//! - **(b) static placement**: llama.cpp's `-ncmoe N` — the first N layers' experts on the host,
//!   computed there (a device map to the host with `--cost-aware-misses`), the rest loaded;
//!   N is the smallest whose remaining weights fit the budget, as llama.cpp's fit chooses;
//! - **by use**: residency by use (the expert cache) with router prefetch;
//! - **by use, cost-aware**: the same with `--cost-aware-misses`.
//!
//! Static placement and cost-aware misses keep the `QTensor`s their host runs build (prepared
//! host copies, a quarter of the host's RAM by default); the last line prints what a host run
//! costs without one.
//!
//! Rounds are interleaved (every configuration once per round, `ROUNDS` rounds) and the median
//! is printed, with hit rates beside Belady's optimum for the same uses and room, bytes copied
//! per token, where misses ran and the copy time router prefetch hid; then five more decode
//! steps are audited (the cost model's predicted step beside the measured one,
//! `MemoryManager::audit`; the median by their ratio is printed).
//!
//! `cargo bench --bench moe`. `MOE_GBPS` sets the simulated link (default 25). `MOE_FLAGS` adds
//! ComfyUI memory flags to every configuration (`MOE_FLAGS=--disable-async-offload`: no lanes,
//! so no prefetch). `MOE_EXPERT_FFN=4096` makes every expert matrix 16 times larger
//! (1 Mi values, near a Qwen3-30B-A3B expert matrix's 1.5 Mi): there an expert's arithmetic,
//! not the calls around it, is the cost — the setting that shows what a GPU's faster arithmetic
//! buys over static placement. With `MOE_DEVICE=probe` the same five run on this machine's own
//! device (`Hardware::probe`: a CUDA GPU under `--features cuda`, else the CPU) under
//! `--vram-budget` instead of a simulated GPU — the figures a GPU session records (scripts/gpu-check.sh
//! runs it). There host and device kernels round differently, so the configurations that
//! compute experts on the host (static placement, cost-aware misses) are reported close to the
//! resident run, not equal; the others must still be equal.

#[path = "../tests/common/gguf.rs"]
#[allow(dead_code)]
mod gguf;

// The ported files' `crate::utils` (candle-transformers' own).
include!("../tests/ported/shim.rs");

#[path = "../tests/ported/qwen3_moe_managed.rs"]
#[allow(dead_code, unused_imports, clippy::all)]
mod managed;

use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{DType, Tensor};
use residency::loader::{LoadOptions, MemoryManager};
use residency::quantized::gguf_file;
use residency::vram::{Config, DeviceId, Hardware};
use residency::{ByteSize, DeviceMap, ModelPatcher, Target};

const PROMPT: [u32; 5] = [1, 17, 42, 5, 63];
const TOKENS: usize = 128;
const ROUNDS: usize = 5;
const BUDGET_PERCENT: u64 = 30;

/// One configuration: its flags and, for static placement, the layers whose experts stay on
/// the host.
struct Setup {
    name: &'static str,
    flags: Vec<String>,
    host_layers: usize,
}

/// What one timed decode measured.
struct Measured {
    elapsed: Duration,
    copied: ByteSize,
    checksum: u64,
    /// Each decode step's logits.
    logits: Vec<Vec<f32>>,
    /// `AUDITED` more decode steps after the timed ones, each audited (predicted beside
    /// measured, `MemoryManager::audit`), by measured / predicted.
    audits: Vec<residency::loader::StepAudit>,
    mm: MemoryManager,
}

/// Decode steps audited after the timed ones.
const AUDITED: usize = 5;

/// The simulated link's speed in GB/s (`MOE_GBPS`, default 25).
fn gbps() -> f64 {
    std::env::var("MOE_GBPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(25.0)
}

/// The experts' width: `MOE_EXPERT_FFN` (a multiple of 256), else the tiny model's 256.
fn expert_ffn() -> usize {
    match std::env::var("MOE_EXPERT_FFN") {
        Ok(v) => match v.parse::<usize>() {
            Ok(n) if n > 0 && n % 256 == 0 => n,
            _ => panic!("MOE_EXPERT_FFN={v}: a positive multiple of 256"),
        },
        Err(_) => gguf::EXPERT_FFN,
    }
}

/// Whether the run is on this machine's own device (`MOE_DEVICE=probe`), not a simulated GPU.
fn on_probed_device() -> bool {
    std::env::var("MOE_DEVICE").is_ok_and(|v| v == "probe")
}

fn decode(setup: &Setup, path: &std::path::Path) -> Measured {
    let mut all = vec!["--reserve-vram".to_string(), "0".to_string()];
    all.extend(setup.flags.iter().cloned());
    if let Ok(extra) = std::env::var("MOE_FLAGS") {
        all.extend(extra.split_whitespace().map(str::to_string));
    }
    let hardware = if on_probed_device() {
        Hardware::probe()
    } else {
        Hardware::cpu_only(ByteSize::gib(16))
    };
    let mm = MemoryManager::new(Config::from_args(&all).unwrap(), hardware).unwrap();
    let model = mm.read_gguf("tiny-qwen3moe", path).unwrap();
    let mut p = ModelPatcher::new(Arc::new(model), mm.compute_device(), DeviceId::Cpu);
    if setup.host_layers > 0 {
        let layers = (0..setup.host_layers)
            .map(|b| b.to_string())
            .collect::<Vec<_>>()
            .join("|");
        let pattern = format!(r"^blk\.({layers})\.ffn_.*_exps\.");
        p = p.with_device_map(DeviceMap::new().regex(&pattern, Target::Host).unwrap());
    }
    mm.load_models_gpu(std::slice::from_ref(&p), LoadOptions::default())
        .unwrap();
    let device = p.load_device().to_candle().unwrap();
    let ct = gguf_file::Content::from_patcher(&p);
    let mut unused = std::io::Cursor::new(Vec::<u8>::new());
    let mut model =
        managed::quantized_qwen3_moe::GGUFQWenMoE::from_gguf(ct, &mut unused, &device, DType::F32)
            .unwrap();
    let input = Tensor::new(&PROMPT, &device).unwrap().unsqueeze(0).unwrap();
    let logits = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let mut last = logits(model.forward(&input, 0).unwrap());
    mm.reset_dynamic_stats();
    let copied_before = mm.transfer_stats().bytes_copied();
    let mut checksum = 0u64;
    let mut logits_seen = Vec::with_capacity(TOKENS);
    let t0 = Instant::now();
    for step in 0..TOKENS {
        let next = gguf::argmax(&last);
        let input = Tensor::new(&[next], &device).unwrap().unsqueeze(0).unwrap();
        last = logits(model.forward(&input, PROMPT.len() + step).unwrap());
        checksum = last
            .iter()
            .fold(checksum, |h, x| h.rotate_left(5) ^ u64::from(x.to_bits()));
        logits_seen.push(last.clone());
    }
    let elapsed = t0.elapsed();
    let copied = mm
        .transfer_stats()
        .bytes_copied()
        .saturating_sub(copied_before);
    // Then a few steps more, each audited: the cost model's prediction beside the run.
    let mut audits = Vec::with_capacity(AUDITED);
    for step in TOKENS..TOKENS + AUDITED {
        let next = gguf::argmax(&last);
        let input = Tensor::new(&[next], &device).unwrap().unsqueeze(0).unwrap();
        let (out, audit) = mm.audit(&p, || model.forward(&input, PROMPT.len() + step));
        last = logits(out.unwrap());
        audits.push(audit);
    }
    audits.sort_by_key(|a| a.measured_ns.saturating_mul(1000) / a.predicted.step_ns.max(1));
    if std::env::var("MOE_DEBUG").is_ok() {
        let m = p.model();
        let mut res = Vec::new();
        for i in 0..m.len() {
            let r = p.resident_weight(i).is_some();
            res.push(format!(
                "{}{}:{}",
                if r { "*" } else { "" },
                m.slots()[i].name(),
                m.slots()[i].bytes()
            ));
        }
        eprintln!("{}: {}", setup.name, res.join(" "));
    }
    Measured {
        elapsed,
        copied,
        checksum,
        logits: logits_seen,
        audits,
        mm,
    }
}

/// The largest difference between two runs' logits, as a fraction of the first's largest
/// magnitude.
fn relative_difference(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    let range = a
        .iter()
        .flatten()
        .fold(0f32, |m, v| m.max(v.abs()))
        .max(f32::MIN_POSITIVE);
    let worst = a
        .iter()
        .flatten()
        .zip(b.iter().flatten())
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    worst / range
}

/// The smallest N whose layers' experts on the host leave the rest of the model within
/// `budget` (llama.cpp's fit for `-ncmoe`).
fn ncmoe(path: &std::path::Path, budget: ByteSize) -> usize {
    let model = residency::weights::Model::from_gguf("fit", path).unwrap();
    let total = model.model_size().bytes();
    let experts_of = |b: usize| -> u64 {
        model
            .slots()
            .iter()
            .filter(|s| s.name().starts_with(&format!("blk.{b}.")) && s.name().contains("_exps."))
            .map(|s| s.bytes().bytes())
            .sum()
    };
    let mut rest = total;
    for n in 0..=gguf::BLOCKS {
        if rest <= budget.bytes() {
            return n;
        }
        if n < gguf::BLOCKS {
            rest -= experts_of(n);
        }
    }
    gguf::BLOCKS
}

fn main() {
    residency::tools::cache_candle_thread_count();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny-qwen3moe.gguf");
    let expert_ffn = expert_ffn();
    gguf::write_qwen3_moe_with_expert_ffn(&path, expert_ffn);
    let size = residency::weights::Model::from_gguf("size", &path)
        .unwrap()
        .model_size();
    let budget = ByteSize(size.bytes() * BUDGET_PERCENT / 100);
    let n = ncmoe(&path, budget);
    let probed = on_probed_device();
    let sim = |spec: ByteSize, rest: &[&str]| -> Vec<String> {
        let mut v = if !probed {
            vec![
                "--sim-gpu".to_string(),
                format!("{}@{}GB/s", spec.bytes(), gbps()),
            ]
        } else if spec > budget {
            Vec::new()
        } else {
            vec!["--vram-budget".to_string(), format!("{}B", spec.bytes())]
        };
        v.extend(rest.iter().map(|s| s.to_string()));
        v
    };
    let setups = [
        Setup {
            name: "resident (limit)",
            flags: sim(ByteSize(size.bytes() * 4), &["--highvram"]),
            host_layers: 0,
        },
        Setup {
            name: "(a) plain streaming",
            flags: sim(budget, &["--disable-dynamic-vram"]),
            host_layers: 0,
        },
        Setup {
            name: "(b) static, -ncmoe",
            flags: sim(budget, &["--disable-dynamic-vram", "--cost-aware-misses"]),
            host_layers: n,
        },
        Setup {
            name: "by use",
            flags: sim(budget, &["--enable-dynamic-vram"]),
            host_layers: 0,
        },
        Setup {
            name: "by use, cost-aware",
            flags: sim(budget, &["--enable-dynamic-vram", "--cost-aware-misses"]),
            host_layers: 0,
        },
    ];
    let mut times: Vec<Vec<Duration>> = vec![Vec::new(); setups.len()];
    let mut last: Vec<Option<Measured>> = (0..setups.len()).map(|_| None).collect();
    // Checksums of the configurations whose bits must equal the resident run's everywhere (none
    // of their weights computed on the host), and of all of them.
    let mut exact = std::collections::HashSet::new();
    let mut checksums = std::collections::HashSet::new();
    for _ in 0..ROUNDS {
        for (i, s) in setups.iter().enumerate() {
            if let Ok(only) = std::env::var("MOE_ONLY") {
                if !s.name.contains(only.as_str()) && i > 0 {
                    let resident = times[0][0];
                    times[i].push(resident);
                    continue;
                }
            }
            let m = decode(s, &path);
            times[i].push(m.elapsed);
            checksums.insert(m.checksum);
            if !s.flags.iter().any(|f| f == "--cost-aware-misses") {
                exact.insert(m.checksum);
            }
            last[i] = Some(m);
        }
    }
    let median = |v: &mut Vec<Duration>| {
        v.sort();
        v[v.len() / 2]
    };
    let tps: Vec<f64> = times
        .iter_mut()
        .map(|v| TOKENS as f64 / median(v).as_secs_f64())
        .collect();
    let on = if probed {
        let device = last[0].as_ref().map(|m| m.mm.compute_device().to_string());
        format!(
            "on this machine's {} (MOE_DEVICE=probe)",
            device.unwrap_or_default()
        )
    } else {
        format!("on a simulated GPU at {} GB/s", gbps())
    };
    println!(
        "moe: tiny Qwen3-MoE ({} of blocks, {} blocks x {} stacked experts {expert_ffn} wide, top-{}), batch-1 decode of {TOKENS} tokens {on}, budget {budget} = {BUDGET_PERCENT} % of the model; -ncmoe N = {n} (llama.cpp's fit); median of {ROUNDS} interleaved rounds",
        size,
        gguf::BLOCKS,
        gguf::EXPERTS,
        gguf::EXPERTS_USED
    );
    for (i, s) in setups.iter().enumerate() {
        let Some(m) = last[i].as_ref() else {
            continue;
        };
        let mut line = format!(
            "  {:<22} {:>8.1} tokens/s  {:>5.2}x (a)  {:>5.2}x (b)  {:>5.2}x resident  {:>11} copied per token",
            s.name,
            tps[i],
            tps[i] / tps[1],
            tps[i] / tps[2],
            tps[i] / tps[0],
            ByteSize(m.copied.bytes() / TOKENS as u64).to_string(),
        );
        if let Some(d) = m.mm.dynamic_report().first() {
            if let (Some(o), Some(f)) = (d.optimum_hit_rate(), d.fixed_hit_rate()) {
                line += &format!(
                    "  hits {:.1} % (Belady {:.1} %, best fixed set {:.1} %)",
                    100.0 * d.hit_rate(),
                    100.0 * o,
                    100.0 * f
                );
            }
        }
        println!("{line}");
        // The median audited step (by measured / predicted).
        if let Some(a) = m.audits.get(m.audits.len() / 2) {
            println!(
                "      audited decode step (median of {AUDITED}): predicted {:.3} ms, measured {:.3} ms, measured / predicted {:.2}; bytes predicted {}, requested {}",
                a.predicted.step_ns as f64 / 1e6,
                a.measured_ns as f64 / 1e6,
                a.measured_ns as f64 / a.predicted.step_ns.max(1) as f64,
                a.predicted.bytes,
                a.measured_bytes
            );
        }
        if let Some(r) = m.mm.miss_report() {
            println!("      {r}");
        }
        if let Some(c) = m.mm.costs().iter().find(|c| !c.device.is_cpu()) {
            println!("      cost model: {c}");
        }
        let t = m.mm.transfer_stats();
        if t.routed_prefetches > 0 {
            let per = |ns: u64, k: u64| ns as f64 / k.max(1) as f64 / 1000.0;
            let (hit, miss) = (
                per(t.prefetch_hit_wait_ns, t.prefetch_hits),
                per(t.wait_ns, t.prefetch_misses),
            );
            println!(
                "      router prefetch: {} requested, {} used ({:.0} %); waited {:.1} us on a prefetched weight, {:.1} us on a synchronous fetch: ~{:.1} ms of copy time hidden",
                t.routed_prefetches,
                t.routed_hits,
                100.0 * t.routed_hits as f64 / t.routed_prefetches as f64,
                hit,
                miss,
                t.routed_hits as f64 * (miss - hit).max(0.0) / 1000.0
            );
        }
    }
    println!(
        "  same logits bits in every configuration: {}",
        checksums.len() == 1
    );
    if let Some(resident) = last[0].as_ref() {
        for (s, m) in setups.iter().zip(&last).skip(1) {
            if let Some(m) = m {
                if m.checksum != resident.checksum {
                    println!(
                        "  {}: logits within {:.2e} of the resident run's (of their largest magnitude)",
                        s.name,
                        relative_difference(&resident.logits, &m.logits)
                    );
                }
            }
        }
    }
    host_run_costs(&path);
    // The simulated GPU computes both sides with the host's kernels: every configuration gives
    // the same bits. On a real device only those that never compute on the host must.
    if probed {
        assert_eq!(exact.len(), 1, "streaming changed the bits");
    } else {
        assert_eq!(checksums.len(), 1, "the configurations disagree");
    }
}

/// What one batch-1 host run of an expert matrix costs built from its host bytes at that use —
/// copied into a fresh candle `QTensor`, whose CPU kernels then re-pack the blocks (Q4K, Q8_0 on
/// AVX-512 VNNI) before multiplying: a host run without a prepared copy
/// (`residency::offload::PreparedBudget`) — against the same matmul on a `QTensor` built once (a
/// prepared copy; what a resident CPU weight or llama.cpp's `-ncmoe` pays). For this model's
/// expert matrices and for a Qwen3-30B-A3B-sized expert (768 x 2048 gate/up in Q4K, 2048 x 768
/// down in Q6K).
fn host_run_costs(path: &std::path::Path) {
    use candle_core::quantized::{GgmlDType, QMatMul, QStorage, QTensor};
    use candle_core::{Device, Module};
    let time = |ggml: GgmlDType, bytes: &[u8], shape: (usize, usize)| -> (f64, f64) {
        let build = || {
            let storage =
                QStorage::from_data(std::borrow::Cow::Borrowed(bytes), &Device::Cpu, ggml).unwrap();
            QMatMul::from_qtensor(QTensor::new(storage, shape).unwrap()).unwrap()
        };
        let x = Tensor::ones((1, shape.1), DType::F32, &Device::Cpu).unwrap();
        let prepared = build();
        prepared.forward(&x).unwrap();
        let reps = (64 << 20) / bytes.len().max(1) + 16;
        let t0 = Instant::now();
        for _ in 0..reps {
            prepared.forward(&x).unwrap();
        }
        let kept = t0.elapsed().as_secs_f64() / reps as f64;
        let t0 = Instant::now();
        for _ in 0..reps {
            build().forward(&x).unwrap();
        }
        let built = t0.elapsed().as_secs_f64() / reps as f64;
        (built * 1e6, kept * 1e6)
    };
    let model = residency::weights::Model::from_gguf("host-run", path).unwrap();
    let mut lines = Vec::new();
    for name in ["gate", "up", "down"] {
        let key = format!("blk.0.ffn_{name}_exps.0.weight");
        let Some(slot) = model.slots().iter().find(|s| s.name() == key) else {
            continue;
        };
        let (Some(ggml), [n, k]) = (slot.quantized(), slot.shape()) else {
            continue;
        };
        let bytes = slot.clean().unwrap().to_vec1::<u8>().unwrap();
        let (built, kept) = time(ggml, &bytes, (*n, *k));
        lines.push(format!(
            "{name} {ggml:?} {n}x{k} {built:.1} / {kept:.1} us ({:.1}x)",
            built / kept
        ));
    }
    for (name, ggml, (n, k)) in [
        ("gate/up", GgmlDType::Q4K, (768, 2048)),
        ("down", GgmlDType::Q6K, (2048, 768)),
    ] {
        let w = Tensor::randn(0f32, 1.0, (n, k), &candle_core::Device::Cpu).unwrap();
        let q = QTensor::quantize(&w, ggml).unwrap();
        let bytes = q.data().unwrap().to_vec();
        let (built, kept) = time(ggml, &bytes, (n, k));
        lines.push(format!(
            "30B-A3B-sized {name} {ggml:?} {n}x{k} {built:.1} / {kept:.1} us ({:.1}x)",
            built / kept
        ));
    }
    println!(
        "  a host run of one expert matrix, built from its host bytes / on a prepared copy: {}",
        lines.join("; ")
    );
}
