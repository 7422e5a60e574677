//! A mixture of experts decoded under a budget: a tiny MoE GGUF (2 blocks, 8 experts each, top-2
//! routing with a skewed router) written here with candle's GGUF writer — by default in
//! Mixtral's layout (one tensor per expert) run by candle-transformers' `quantized_llama`; with
//! `--layout stacked` a Qwen3-MoE (each block's experts stacked in `ffn_*_exps` tensors, held
//! as one weight per expert) run by candle-transformers' `quantized_qwen3_moe` — each ported by
//! its `use` lines, for
//! `--tokens` greedy decode steps on a simulated GPU at 25 GB/s with `--budget-percent` of the
//! model's bytes — three ways, same tokens:
//!
//! - **resident**: the whole model on a device large enough (the limit);
//! - **classic**: ComfyUI's load-time partial load, every other weight (most experts) copied at
//!   each use and dropped (plain streaming);
//! - **by use**: residency by use — a routed expert faults in while there is room and stays while
//!   it is used — which is the expert cache.
//!
//! For each: tokens/s, the bytes copied per token, the checksum of the logits (identical), and
//! for residency by use its hits and misses beside Belady's offline optimum for the same uses and
//! room, device-wide and layer by layer, and how the routing spread over the experts.
//!
//! `cargo run --release --example moe -- --tokens 64 --budget-percent 30 [--layout stacked]`;
//! any further flags are
//! ComfyUI's memory flags (`--async-offload 0`, ...), given to every manager.
//!
//! `--probe` runs the same on this machine's own device instead of the simulated GPU
//! (`Hardware::probe`: a CUDA GPU when built with `--features cuda`, else the CPU), the budget
//! given as `--vram-budget`. On a GPU the host and the device round differently, so the
//! cost-aware run (whose misses run on the host) is compared by its tokens, not its bits.

#[path = "../tests/common/gguf.rs"]
#[allow(dead_code)]
mod gguf;

use std::sync::Arc;
use std::time::Instant;

use candle_core::Tensor;
use residency::loader::{LoadOptions, MemoryManager};
use residency::quantized::gguf_file;
use residency::vram::{Config, DeviceId, Hardware};
use residency::{ByteSize, ModelPatcher};

include!("../tests/ported/shim.rs");

#[path = "../tests/ported/quantized_llama.rs"]
#[allow(dead_code, clippy::all)]
mod quantized_llama;

/// candle-transformers' `quantized_qwen3_moe` (with `quantized_qwen3` and `fused_moe`) on
/// residency, as `tests/moe.rs` ports it.
#[path = "../tests/ported/qwen3_moe_managed.rs"]
#[allow(dead_code, unused_imports, clippy::all)]
mod managed;

/// The two GGUF layouts of experts.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Layout {
    /// One tensor per expert (Mixtral: `blk.N.ffn_gate.E.weight`), `quantized_llama`.
    PerExpert,
    /// Stacked (`blk.N.ffn_gate_exps.weight`), `quantized_qwen3_moe`.
    Stacked,
}

impl Layout {
    /// The key of expert `e`'s gate weight in block `b`.
    fn gate_key(self, b: usize, e: usize) -> String {
        match self {
            Layout::PerExpert => format!("blk.{b}.ffn_gate.{e}.weight"),
            Layout::Stacked => format!("blk.{b}.ffn_gate_exps.{e}.weight"),
        }
    }
}

/// Either port, behind one forward.
enum Decoder {
    Llama(Box<quantized_llama::ModelWeights>),
    Qwen3Moe(managed::quantized_qwen3_moe::GGUFQWenMoE),
}

impl Decoder {
    fn new(layout: Layout, p: &ModelPatcher) -> Result<Decoder, Box<dyn std::error::Error>> {
        let device = p.load_device().to_candle()?;
        let ct = gguf_file::Content::from_patcher(p);
        let mut unused = std::io::Cursor::new(Vec::<u8>::new());
        Ok(match layout {
            Layout::PerExpert => Decoder::Llama(Box::new(
                quantized_llama::ModelWeights::from_gguf(ct, &mut unused, &device)?,
            )),
            Layout::Stacked => {
                Decoder::Qwen3Moe(managed::quantized_qwen3_moe::GGUFQWenMoE::from_gguf(
                    ct,
                    &mut unused,
                    &device,
                    candle_core::DType::F32,
                )?)
            }
        })
    }

    fn forward(&mut self, input: &Tensor, pos: usize) -> candle_core::Result<Tensor> {
        match self {
            Decoder::Llama(m) => m.forward(input, pos),
            Decoder::Qwen3Moe(m) => m.forward(input, pos),
        }
    }
}

const PROMPT: [u32; 5] = [1, 17, 42, 5, 63];

struct Args {
    tokens: usize,
    budget_percent: u64,
    layout: Layout,
    /// This machine's own device, not the simulated GPU.
    probe: bool,
    flags: Vec<String>,
}

fn parse() -> Result<Args, String> {
    let mut args = Args {
        tokens: 64,
        budget_percent: 30,
        layout: Layout::PerExpert,
        probe: false,
        flags: Vec::new(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut value = |name: &str| {
            it.next()
                .ok_or_else(|| format!("{name} needs a value"))
                .and_then(|v| v.parse::<u64>().map_err(|e| format!("{name} {v}: {e}")))
        };
        if a == "--layout" {
            args.layout = match it.next().as_deref() {
                Some("stacked") => Layout::Stacked,
                Some("per-expert") => Layout::PerExpert,
                other => return Err(format!("--layout {other:?}: per-expert or stacked")),
            };
            continue;
        }
        match a.as_str() {
            "--tokens" => args.tokens = value("--tokens")? as usize,
            "--budget-percent" => args.budget_percent = value("--budget-percent")?.clamp(1, 100),
            "--probe" => args.probe = true,
            "--help" | "-h" => {
                return Err(
                    "usage: moe [--tokens N] [--budget-percent P] [--layout per-expert|stacked] [--probe] [ComfyUI memory flags]".into(),
                )
            }
            _ => args.flags.push(a),
        }
    }
    Ok(args)
}

/// One run's figures.
struct Run {
    name: &'static str,
    tokens_per_s: f64,
    copied_per_token: ByteSize,
    checksum: u64,
    tokens: Vec<u32>,
}

/// Decodes `n` greedy tokens after the prompt on a fresh manager built from `flags`.
fn run(
    name: &'static str,
    args: &Args,
    path: &std::path::Path,
    flags: &[String],
) -> Result<(Run, MemoryManager, ModelPatcher), Box<dyn std::error::Error>> {
    let (layout, n) = (args.layout, args.tokens);
    let mut all = vec!["--reserve-vram".to_string(), "0".to_string()];
    all.extend(flags.iter().cloned());
    let hardware = if args.probe {
        Hardware::probe()
    } else {
        Hardware::cpu_only(ByteSize::gib(16))
    };
    let mm = MemoryManager::new(Config::from_args(&all)?, hardware)?;
    let model = mm.read_gguf("tiny-moe", path)?;
    let p = ModelPatcher::new(Arc::new(model), mm.compute_device(), DeviceId::Cpu);
    mm.load_models_gpu(std::slice::from_ref(&p), LoadOptions::default())?;
    let device = p.load_device().to_candle()?;
    let mut model = Decoder::new(layout, &p)?;
    let mut checksum = 0u64;
    let mut tokens = Vec::with_capacity(n);
    let input = Tensor::new(&PROMPT, &device)?.unsqueeze(0)?;
    let mut logits = model.forward(&input, 0)?.flatten_all()?.to_vec1::<f32>()?;
    let copied_before = mm.transfer_stats().bytes_copied();
    let t0 = Instant::now();
    for step in 0..n {
        let next = gguf::argmax(&logits);
        tokens.push(next);
        let input = Tensor::new(&[next], &device)?.unsqueeze(0)?;
        logits = model
            .forward(&input, PROMPT.len() + step)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        checksum = logits
            .iter()
            .fold(checksum, |h, x| h.rotate_left(5) ^ u64::from(x.to_bits()));
    }
    let dt = t0.elapsed().as_secs_f64();
    let copied = mm
        .transfer_stats()
        .bytes_copied()
        .saturating_sub(copied_before);
    let run = Run {
        name,
        tokens_per_s: n as f64 / dt,
        copied_per_token: ByteSize(copied.bytes() / n.max(1) as u64),
        checksum,
        tokens,
    };
    Ok((run, mm, p))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    residency::tools::cache_candle_thread_count();
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("tiny-moe.gguf");
    match args.layout {
        Layout::PerExpert => gguf::write_tiny_moe(&path),
        Layout::Stacked => gguf::write_tiny_qwen3_moe(&path),
    }
    let size = residency::weights::Model::from_gguf("tiny-moe", &path)?.model_size();
    let budget = ByteSize(size.bytes() * args.budget_percent / 100);
    println!(
        "tiny MoE ({}): {} of blocks ({} blocks x {} experts, top-{}), {} decode tokens; {}, budget {budget} = {}% of the model",
        match args.layout {
            Layout::PerExpert => "Mixtral layout, quantized_llama",
            Layout::Stacked => "stacked experts, quantized_qwen3_moe",
        },
        size,
        gguf::BLOCKS,
        gguf::EXPERTS,
        gguf::EXPERTS_USED,
        args.tokens,
        if args.probe {
            "this machine's own device (--probe)"
        } else {
            "simulated GPU at 25 GB/s"
        },
        args.budget_percent
    );
    // The device's flags: a simulated GPU of `room` bytes, or this machine's device within a
    // budget of `room` (none for the resident limit).
    let on = |room: Option<ByteSize>, rest: &[&str]| -> Vec<String> {
        let mut v = match (args.probe, room) {
            (false, room) => vec![
                "--sim-gpu".to_string(),
                format!(
                    "{}@25GB/s",
                    room.unwrap_or(ByteSize(size.bytes() * 4)).bytes()
                ),
            ],
            (true, Some(room)) => vec!["--vram-budget".to_string(), format!("{}B", room.bytes())],
            (true, None) => Vec::new(),
        };
        v.extend(rest.iter().map(|s| s.to_string()));
        v.extend(args.flags.iter().cloned());
        v
    };
    let (resident, mm_resident, _) =
        run("resident (limit)", &args, &path, &on(None, &["--highvram"]))?;
    let device = mm_resident.compute_device();
    drop(mm_resident);
    println!("  computing on {device}");
    let tight = Some(budget);
    let (classic, ..) = run(
        "classic partial load",
        &args,
        &path,
        &on(tight, &["--disable-dynamic-vram"]),
    )?;
    let (by_use, mm, p) = run(
        "residency by use",
        &args,
        &path,
        &on(tight, &["--enable-dynamic-vram"]),
    )?;
    let (costed, mm_costed, _) = run(
        "by use, cost-aware",
        &args,
        &path,
        &on(tight, &["--enable-dynamic-vram", "--cost-aware-misses"]),
    )?;
    let routed_stats = mm.transfer_stats();
    for r in [&resident, &classic, &by_use, &costed] {
        println!(
            "  {:<22} {:>8.1} tokens/s  {:>10} copied per token  checksum {:016x}",
            r.name,
            r.tokens_per_s,
            r.copied_per_token.to_string(),
            r.checksum
        );
    }
    let runs = [&resident, &classic, &by_use, &costed];
    let same = runs.iter().all(|r| r.tokens == resident.tokens);
    // On a GPU the cost-aware run computes some experts on the host, which rounds differently:
    // its bits are not the resident run's (its tokens are reported above).
    let exact = if device.is_cpu() || device.is_sim() {
        &runs[..]
    } else {
        &runs[..3]
    };
    let same_bits = exact.iter().all(|r| r.checksum == resident.checksum);
    println!(
        "  same tokens in all four: {same}; same logits bits ({} runs): {same_bits}; by use / classic {:.2}x, by use cost-aware / classic {:.2}x, cost-aware / resident {:.2}x",
        exact.len(),
        by_use.tokens_per_s / classic.tokens_per_s,
        costed.tokens_per_s / classic.tokens_per_s,
        costed.tokens_per_s / resident.tokens_per_s
    );
    if let Some(m) = mm_costed.miss_report() {
        println!("  {m}");
    }
    let t = routed_stats;
    let per = |ns: u64, n: u64| ns as f64 / n.max(1) as f64 / 1000.0;
    let miss_us = per(t.wait_ns, t.prefetch_misses);
    let hit_us = per(t.prefetch_hit_wait_ns, t.prefetch_hits);
    println!(
        "  router prefetch (by use): {} experts prefetched from the routing, {} used; a prefetched weight waited {:.1} us, a synchronous fetch {:.1} us: about {:.1} ms of copy time hidden",
        t.routed_prefetches,
        t.routed_hits,
        hit_us,
        miss_us,
        t.routed_hits as f64 * (miss_us - hit_us).max(0.0) / 1000.0
    );
    for d in mm.dynamic_report() {
        let total = d.hits + d.misses;
        let rate = |h: u64| {
            if total > 0 {
                100.0 * h as f64 / total as f64
            } else {
                0.0
            }
        };
        print!(
            "  by use on {}: {} hits, {} misses ({:.1} % hits), {} faults-in, {} evictions",
            d.device,
            d.hits,
            d.misses,
            rate(d.hits),
            d.faults_in,
            d.evictions
        );
        match (d.optimum_hits, d.fixed_hits) {
            (Some(o), Some(f)) => println!(
                "; for the same uses and room: Belady's optimum {:.1} %, the best fixed set in hindsight {:.1} %",
                rate(o),
                rate(f)
            ),
            _ => println!(),
        }
    }
    for l in mm.dynamic_layer_report() {
        println!(
            "    {} {:<12} {:>5} uses  {:>5.1} % hits  Belady {:>5.1} %  best fixed set {:>5.1} %",
            l.model,
            l.layer,
            l.uses,
            100.0 * l.hit_rate(),
            100.0 * l.optimum_hit_rate(),
            100.0 * l.fixed_hit_rate()
        );
    }
    for b in 0..gguf::BLOCKS {
        let counts: Vec<String> = (0..gguf::EXPERTS)
            .map(|e| {
                p.model()
                    .uses(&args.layout.gate_key(b, e))
                    .unwrap_or(0)
                    .to_string()
            })
            .collect();
        println!("  layer {b}: uses per expert {}", counts.join(" "));
    }
    if !same_bits {
        eprintln!("error: the runs disagree");
        std::process::exit(1);
    }
    Ok(())
}
