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
//! room, device-wide and layer by layer, and how the routing spread over the experts. Each run's
//! last step is audited: the cost model's predicted step beside the measured one, and a
//! recommendation where an opt-in option is predicted faster (`--cost-aware-misses`).
//!
//! `cargo run --release --example moe -- --tokens 64 --budget-percent 30 [--layout stacked]`;
//! `--vram-budget SIZE` gives the room in bytes instead (every run's but the resident one's); any
//! further flags are ComfyUI's memory flags (`--async-offload 0`, ...), given to every manager.
//!
//! `--probe` runs the same on this machine's own device instead of the simulated GPU
//! (`Hardware::probe`: a CUDA GPU when built with `--features cuda`, else the CPU), within the
//! same budget. On a GPU the host and the device round differently, so the
//! cost-aware run (whose misses run on the host) is compared by its tokens, not its bits.
//!
//! `--model FILE.gguf` decodes your own MoE GGUF instead of the tiny one: a Qwen3-MoE-like
//! architecture with stacked experts (`quantized_qwen3_moe`: Qwen3-30B-A3B, ...) or `llama` with
//! one tensor per expert (`quantized_llama`: Mixtral as older llama.cpp conversions wrote it).
//! The prompt is a few token ids (no tokenizer). `--save FILE.gguf` keeps the tiny model's file. `--runs by-use,cost-aware` picks which of
//! `resident,classic,by-use,cost-aware` run (a model larger than your GPU cannot run resident):
//! `cargo run --release --features cuda --example moe -- --model qwen3-30b-a3b-q4_k_m.gguf
//! --probe --vram-budget 5GiB --runs by-use,cost-aware --tokens 32`.

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

/// The four ways a decode runs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// The whole model on a device large enough (the limit).
    Resident,
    /// ComfyUI's load-time partial load: plain streaming.
    Classic,
    /// Residency by use: the expert cache.
    ByUse,
    /// By use with cost-aware misses.
    CostAware,
}

impl Kind {
    const ALL: [Kind; 4] = [Kind::Resident, Kind::Classic, Kind::ByUse, Kind::CostAware];

    fn name(self) -> &'static str {
        match self {
            Kind::Resident => "resident (limit)",
            Kind::Classic => "classic partial load",
            Kind::ByUse => "residency by use",
            Kind::CostAware => "by use, cost-aware",
        }
    }

    fn parse(s: &str) -> Option<Kind> {
        Some(match s {
            "resident" => Kind::Resident,
            "classic" => Kind::Classic,
            "by-use" => Kind::ByUse,
            "cost-aware" => Kind::CostAware,
            _ => return None,
        })
    }

    /// The memory flags that make this way (beside the device's).
    fn flags(self) -> &'static [&'static str] {
        match self {
            Kind::Resident => &["--highvram"],
            Kind::Classic => &["--disable-dynamic-vram"],
            Kind::ByUse => &["--enable-dynamic-vram"],
            Kind::CostAware => &["--enable-dynamic-vram", "--cost-aware-misses"],
        }
    }
}

struct Args {
    tokens: usize,
    budget_percent: u64,
    layout: Layout,
    /// This machine's own device, not the simulated GPU.
    probe: bool,
    /// A user's MoE GGUF instead of the tiny one.
    model: Option<std::path::PathBuf>,
    /// Where to keep the tiny model's file (it is written to a temporary folder otherwise).
    save: Option<std::path::PathBuf>,
    /// The ways to run, in order.
    runs: Vec<Kind>,
    /// `--vram-budget`: the device room of every run but the resident one (instead of
    /// `--budget-percent` of the model).
    room: Option<String>,
    flags: Vec<String>,
}

const USAGE: &str = "usage: moe [--tokens N] [--budget-percent P | --vram-budget SIZE] [--layout per-expert|stacked] [--model FILE.gguf | --save FILE.gguf] [--runs resident,classic,by-use,cost-aware] [--probe] [ComfyUI memory flags]";

fn parse() -> Result<Args, String> {
    let mut args = Args {
        tokens: 64,
        budget_percent: 30,
        layout: Layout::PerExpert,
        probe: false,
        model: None,
        save: None,
        runs: Kind::ALL.to_vec(),
        room: None,
        flags: Vec::new(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut text = |name: &str| it.next().ok_or_else(|| format!("{name} needs a value"));
        match a.as_str() {
            "--layout" => {
                args.layout = match text("--layout")?.as_str() {
                    "stacked" => Layout::Stacked,
                    "per-expert" => Layout::PerExpert,
                    other => return Err(format!("--layout {other:?}: per-expert or stacked")),
                }
            }
            "--model" => args.model = Some(text("--model")?.into()),
            "--save" => args.save = Some(text("--save")?.into()),
            "--vram-budget" => args.room = Some(text("--vram-budget")?),
            "--runs" => {
                let list = text("--runs")?;
                args.runs = list
                    .split(',')
                    .map(|r| {
                        Kind::parse(r.trim()).ok_or_else(|| {
                            format!("--runs {list:?}: {r:?} is not one of resident, classic, by-use, cost-aware")
                        })
                    })
                    .collect::<Result<_, _>>()?;
            }
            "--tokens" | "--budget-percent" => {
                let v = text(&a)?;
                let n = v.parse::<u64>().map_err(|e| format!("{a} {v}: {e}"))?;
                if a == "--tokens" {
                    args.tokens = n as usize;
                } else {
                    args.budget_percent = n.clamp(1, 100);
                }
            }
            "--probe" => args.probe = true,
            "--help" | "-h" => return Err(USAGE.into()),
            _ => args.flags.push(a),
        }
    }
    Ok(args)
}

/// The model decoded: its file, its port, and how it routes.
struct Subject {
    path: std::path::PathBuf,
    layout: Layout,
    blocks: usize,
    experts: usize,
    used: usize,
    size: ByteSize,
}

impl Subject {
    /// A MoE GGUF's routing shape from its metadata, and the port that runs it; a clear error
    /// for a file neither port reads.
    fn read(path: &std::path::Path) -> Result<Subject, Box<dyn std::error::Error>> {
        use candle_core::quantized::gguf_file as candle_gguf;
        let shown = path.display();
        // The header alone (candle's reader): the weights are read by the managers.
        let mut file =
            std::fs::File::open(path).map_err(|e| format!("{shown}: cannot open: {e}"))?;
        let header = candle_gguf::Content::read(&mut file)
            .map_err(|e| format!("{shown}: not a GGUF file: {e}"))?;
        let md = &header.metadata;
        let arch = md
            .get("general.architecture")
            .and_then(|v| v.to_string().ok())
            .ok_or_else(|| format!("{shown}: no general.architecture"))?
            .clone();
        let count = |key: &str| -> Result<usize, String> {
            let full = format!("{arch}.{key}");
            let v = md
                .get(&full)
                .ok_or_else(|| format!("{shown}: no {full} (is it a mixture of experts?)"))?;
            v.to_u32()
                .map(u64::from)
                .or_else(|_| v.to_u64())
                .map(|n| n as usize)
                .map_err(|e| format!("{shown}: {full}: {e}"))
        };
        let (blocks, experts, used) = (
            count("block_count")?,
            count("expert_count")?,
            count("expert_used_count")?,
        );
        let has = |suffix: &str| header.tensor_infos.keys().any(|k| k.ends_with(suffix));
        let layout = match (arch.as_str(), has(".ffn_gate.0.weight"), has(".ffn_gate_exps.weight")) {
            ("llama", true, _) => Layout::PerExpert,
            ("llama", false, true) => {
                return Err(format!(
                    "{shown}: a llama GGUF with stacked experts (ffn_gate_exps, as newer llama.cpp conversions write Mixtral); candle-transformers' quantized_llama reads one tensor per expert"
                )
                .into())
            }
            (_, _, true) => Layout::Stacked,
            _ => {
                return Err(format!(
                    "{shown}: `{arch}` with {experts} experts but neither ffn_gate.E nor ffn_gate_exps tensors; the moe example runs llama with one tensor per expert or a Qwen3-MoE-like architecture with stacked experts"
                )
                .into())
            }
        };
        Ok(Subject {
            path: path.to_path_buf(),
            layout,
            blocks,
            experts,
            used,
            size: ByteSize(
                header
                    .tensor_infos
                    .values()
                    .map(|t| {
                        let d = t.ggml_dtype;
                        (t.shape.elem_count() / d.block_size() * d.type_size()) as u64
                    })
                    .sum(),
            ),
        })
    }
}

/// One run's figures, and what its manager reported, written before the manager is dropped
/// (a simulated GPU's memory is this machine's: one manager at a time).
struct Run {
    kind: Kind,
    tokens_per_s: f64,
    copied_per_token: ByteSize,
    checksum: u64,
    tokens: Vec<u32>,
    device: DeviceId,
    report: Vec<String>,
}

/// Decodes `args.tokens` greedy tokens after the prompt on a fresh manager built from `flags`.
fn run(
    kind: Kind,
    args: &Args,
    subject: &Subject,
    flags: &[String],
) -> Result<Run, Box<dyn std::error::Error>> {
    let n = args.tokens;
    let mut all = vec!["--reserve-vram".to_string(), "0".to_string()];
    all.extend(flags.iter().cloned());
    let hardware = if args.probe {
        Hardware::probe()
    } else {
        Hardware::cpu_only(ByteSize::gib(16))
    };
    let mm = MemoryManager::new(Config::from_args(&all)?, hardware)?;
    let model = mm.read_gguf("moe", &subject.path)?;
    let p = ModelPatcher::new(Arc::new(model), mm.compute_device(), DeviceId::Cpu);
    mm.load_models_gpu(std::slice::from_ref(&p), LoadOptions::default())?;
    let device = p.load_device().to_candle()?;
    let mut model = Decoder::new(subject.layout, &p)?;
    let mut checksum = 0u64;
    let mut tokens = Vec::with_capacity(n);
    let input = Tensor::new(&PROMPT, &device)?.unsqueeze(0)?;
    let mut logits = model.forward(&input, 0)?.flatten_all()?.to_vec1::<f32>()?;
    let copied_before = mm.transfer_stats().bytes_copied();
    let t0 = Instant::now();
    let mut audit = None;
    for step in 0..n {
        let next = gguf::argmax(&logits);
        tokens.push(next);
        let input = Tensor::new(&[next], &device)?.unsqueeze(0)?;
        // The last step is held against the cost model's prediction for it.
        let out = if step + 1 == n {
            let (out, a) = mm.audit(&p, || model.forward(&input, PROMPT.len() + step));
            audit = Some(a);
            out?
        } else {
            model.forward(&input, PROMPT.len() + step)?
        };
        logits = out.flatten_all()?.to_vec1::<f32>()?;
        checksum = logits
            .iter()
            .fold(checksum, |h, x| h.rotate_left(5) ^ u64::from(x.to_bits()));
    }
    let dt = t0.elapsed().as_secs_f64();
    let copied = mm
        .transfer_stats()
        .bytes_copied()
        .saturating_sub(copied_before);
    Ok(Run {
        kind,
        tokens_per_s: n as f64 / dt,
        copied_per_token: ByteSize(copied.bytes() / n.max(1) as u64),
        checksum,
        tokens,
        device: mm.compute_device(),
        // The routing's spread once: every run routes the same tokens.
        report: audit
            .map(|a| format!("last step {a}"))
            .into_iter()
            .chain(report(
                kind,
                &mm,
                &p,
                subject,
                kind == Kind::ByUse || !args.runs.contains(&Kind::ByUse),
            ))
            .collect(),
    })
}

/// What a run's manager says of its misses: cost-aware placement, router prefetch, hits beside
/// the optimum (device-wide and per layer), and how routing spread over the experts.
fn report(
    kind: Kind,
    mm: &MemoryManager,
    p: &ModelPatcher,
    subject: &Subject,
    spread: bool,
) -> Vec<String> {
    let mut lines = Vec::new();
    if kind == Kind::CostAware {
        if let Some(m) = mm.miss_report() {
            lines.push(m.to_string());
        }
    }
    if !matches!(kind, Kind::ByUse | Kind::CostAware) {
        return lines;
    }
    let t = mm.transfer_stats();
    let per = |ns: u64, n: u64| ns as f64 / n.max(1) as f64 / 1000.0;
    let miss_us = per(t.wait_ns, t.prefetch_misses);
    let hit_us = per(t.prefetch_hit_wait_ns, t.prefetch_hits);
    // A port that routes in its own code (quantized_llama) asks for experts one by one: the
    // routing reaches the manager only through `moe_gemm_gguf` (quantized_qwen3_moe).
    if t.routed_prefetches > 0 {
        lines.push(format!(
        "router prefetch: {} experts prefetched from the routing, {} used; a prefetched weight waited {:.1} us, a synchronous fetch {:.1} us: about {:.1} ms of copy time hidden",
        t.routed_prefetches,
        t.routed_hits,
        hit_us,
        miss_us,
        t.routed_hits as f64 * (miss_us - hit_us).max(0.0) / 1000.0
    ));
    }
    lines.extend(mm.dynamic_report().iter().map(|d| d.to_string()));
    lines.extend(mm.dynamic_layer_report().iter().map(|l| format!("  {l}")));
    // How routing spread over the experts (each expert's gate-matrix uses), where a line holds it.
    if spread && subject.experts <= 16 {
        for b in 0..subject.blocks {
            let counts: Vec<String> = (0..subject.experts)
                .map(|e| {
                    p.model()
                        .uses(&subject.layout.gate_key(b, e))
                        .unwrap_or(0)
                        .to_string()
                })
                .collect();
            lines.push(format!("layer {b}: uses per expert {}", counts.join(" ")));
        }
    }
    lines
}

fn main() {
    residency::tools::cache_candle_thread_count();
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = decode_all(&args) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

/// The runs `args` names on the model it names, and what they say.
fn decode_all(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let subject = match &args.model {
        Some(path) => Subject::read(path)?,
        None => {
            let path = args
                .save
                .clone()
                .unwrap_or_else(|| dir.path().join("tiny-moe.gguf"));
            match args.layout {
                Layout::PerExpert => gguf::write_tiny_moe(&path),
                Layout::Stacked => gguf::write_tiny_qwen3_moe(&path),
            }
            Subject::read(&path)?
        }
    };
    let size = subject.size;
    let room = match &args.room {
        Some(r) => r.clone(),
        None => format!("{}B", size.bytes() * args.budget_percent / 100),
    };
    println!(
        "{} ({}): {} of blocks ({} blocks x {} experts, top-{}), {} decode tokens; {}, budget {}",
        args.model
            .as_deref()
            .map_or("tiny MoE".to_string(), |p| p.display().to_string()),
        match subject.layout {
            Layout::PerExpert => "one tensor per expert, quantized_llama",
            Layout::Stacked => "stacked experts, quantized_qwen3_moe",
        },
        size,
        subject.blocks,
        subject.experts,
        subject.used,
        args.tokens,
        if args.probe {
            "this machine's own device (--probe)"
        } else {
            "simulated GPU at 25 GB/s"
        },
        match &args.room {
            Some(r) => r.clone(),
            None => format!(
                "{} = {}% of the model",
                ByteSize(size.bytes() * args.budget_percent / 100),
                args.budget_percent
            ),
        }
    );
    // The device's flags: a simulated GPU of `room` bytes, or this machine's device within a
    // budget of `room` (none for the resident limit).
    let on = |kind: Kind| -> Vec<String> {
        let room = (kind != Kind::Resident).then_some(&room);
        let mut v = match (args.probe, room) {
            (false, Some(room)) => vec!["--sim-gpu".to_string(), format!("{room}@25GB/s")],
            (false, None) => vec![
                "--sim-gpu".to_string(),
                format!("{}B@25GB/s", size.bytes() * 4),
            ],
            (true, Some(room)) => vec!["--vram-budget".to_string(), room.clone()],
            (true, None) => Vec::new(),
        };
        v.extend(kind.flags().iter().map(|s| s.to_string()));
        v.extend(args.flags.iter().cloned());
        v
    };
    let mut runs = Vec::new();
    for &kind in &args.runs {
        let r = run(kind, args, &subject, &on(kind))?;
        if runs.is_empty() {
            println!("  computing on {}", r.device);
        }
        runs.push(r);
    }
    for r in &runs {
        println!(
            "  {:<22} {:>8.1} tokens/s  {:>10} copied per token  checksum {:016x}",
            r.kind.name(),
            r.tokens_per_s,
            r.copied_per_token.to_string(),
            r.checksum
        );
    }
    let Some(first) = runs.first() else {
        return Ok(());
    };
    let same = runs.iter().all(|r| r.tokens == first.tokens);
    // On a GPU the cost-aware run computes some experts on the host, which rounds differently:
    // its bits are not the others' (its tokens are reported above).
    let host_arithmetic = first.device.is_cpu() || first.device.is_sim();
    let exact: Vec<&Run> = runs
        .iter()
        .filter(|r| host_arithmetic || r.kind != Kind::CostAware)
        .collect();
    let same_bits = exact.iter().all(|r| r.checksum == exact[0].checksum);
    let speed = |k: Kind| runs.iter().find(|r| r.kind == k).map(|r| r.tokens_per_s);
    let mut ratios = Vec::new();
    for (a, b, what) in [
        (Kind::ByUse, Kind::Classic, "by use / classic"),
        (
            Kind::CostAware,
            Kind::Classic,
            "by use cost-aware / classic",
        ),
        (Kind::CostAware, Kind::Resident, "cost-aware / resident"),
    ] {
        if let (Some(a), Some(b)) = (speed(a), speed(b)) {
            ratios.push(format!("{what} {:.2}x", a / b));
        }
    }
    println!(
        "  same tokens in all {}: {same}; same logits bits ({} runs): {same_bits}{}{}",
        runs.len(),
        exact.len(),
        if ratios.is_empty() { "" } else { "; " },
        ratios.join(", ")
    );
    for r in &runs {
        for line in &r.report {
            println!("  {}: {line}", r.kind.name());
        }
    }
    if !same_bits {
        eprintln!("error: the runs disagree");
        std::process::exit(1);
    }
    Ok(())
}
