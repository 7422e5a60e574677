//! Quantized (GGUF) models on the CPU: a Q4_K Llama-architecture model (4 blocks, hidden 1024,
//! feed-forward 2816, 8192 tokens: 62 M parameters, 35 MiB of blocks) run by candle-transformers'
//! `quantized_llama`, ported by its `use` lines (`tests/ported/quantized_llama.rs`).
//!
//! - `forward`: a 16-token prompt and 8 cached steps, resident (the whole model loaded) and
//!   streamed (`--novram`: every weight's blocks stream at every use), beside candle's own model
//!   on the same file (the limit).
//! - bytes moved per forward, streamed, against the same model with bf16 matrices (the ratio a
//!   quantized model saves on the bus).
//! - peak RSS of a run under `--ram-budget` (in a child process, whose `VmHWM` starts at exec)
//!   against the budget plus the process's baseline before the model is read.
//!
//! `RESIDENCY_BENCH_DIR` says where the model files go (default: the temp dir).

mod common;

#[path = "../tests/ported/quantized_llama.rs"]
#[allow(dead_code, unused_imports, clippy::all)]
mod quantized_llama;

include!("../tests/ported/shim.rs");

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use criterion::Criterion;
use residency::loader::{LoadOptions, MemoryManager};
use residency::patcher::ModelPatcher;
use residency::vram::{Config, DeviceId, Hardware};
use residency::ByteSize;

const VOCAB: usize = 8192;
const EMBD: usize = 1024;
const HEADS: usize = 16;
const KV_HEADS: usize = 4;
const HEAD_DIM: usize = EMBD / HEADS;
const BLOCKS: usize = 4;
const FFN: usize = 2816;
const PROMPT: usize = 16;
const STEPS: usize = 8;
const CHILD: &str = "RESIDENCY_QUANTIZED_CHILD";

/// Writes the model with every matrix in `matrices` (norms f32).
fn write_model(path: &Path, matrices: GgmlDType) {
    let kv = KV_HEADS * HEAD_DIM;
    let mut specs: Vec<(String, Vec<usize>, f64)> = vec![
        ("token_embd.weight".into(), vec![VOCAB, EMBD], 1.0),
        ("output_norm.weight".into(), vec![EMBD], 0.0),
        ("output.weight".into(), vec![VOCAB, EMBD], 0.1),
    ];
    for b in 0..BLOCKS {
        let p = format!("blk.{b}");
        for (name, shape) in [
            ("attn_q", vec![EMBD, EMBD]),
            ("attn_k", vec![kv, EMBD]),
            ("attn_v", vec![kv, EMBD]),
            ("attn_output", vec![EMBD, EMBD]),
            ("ffn_gate", vec![FFN, EMBD]),
            ("ffn_up", vec![FFN, EMBD]),
            ("ffn_down", vec![EMBD, FFN]),
        ] {
            specs.push((format!("{p}.{name}.weight"), shape, 0.03));
        }
        specs.push((format!("{p}.attn_norm.weight"), vec![EMBD], 0.0));
        specs.push((format!("{p}.ffn_norm.weight"), vec![EMBD], 0.0));
    }
    let tensors: Vec<(String, QTensor)> = specs
        .into_iter()
        .enumerate()
        .map(|(i, (name, shape, scale))| {
            let u = residency::float::uniform_tensor(&shape, 77 + i as u64).unwrap();
            // Norm gains 1.0 ± 0.1 (f32); matrices quantized. FFN's down matrix has rows of
            // 2816 = 11 × 256: whole K-quant blocks.
            let (t, ggml) = if scale == 0.0 {
                (u.affine(0.2, 1.0), GgmlDType::F32)
            } else {
                (u.affine(scale, 0.0), matrices)
            };
            (name, QTensor::quantize(&t.unwrap(), ggml).unwrap())
        })
        .collect();
    use gguf_file::Value;
    let md = [
        ("general.architecture", Value::String("llama".into())),
        ("llama.attention.head_count", Value::U32(HEADS as u32)),
        ("llama.attention.head_count_kv", Value::U32(KV_HEADS as u32)),
        ("llama.block_count", Value::U32(BLOCKS as u32)),
        ("llama.embedding_length", Value::U32(EMBD as u32)),
        ("llama.rope.dimension_count", Value::U32(HEAD_DIM as u32)),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
    ];
    let md: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (*k, v)).collect();
    let ts: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, q)| (k.as_str(), q)).collect();
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    gguf_file::write(&mut f, &md, &ts).unwrap();
}

fn prompt() -> Tensor {
    let ids: Vec<u32> = (0..PROMPT as u32)
        .map(|i| (i * 97 + 5) % VOCAB as u32)
        .collect();
    Tensor::new(ids.as_slice(), &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap()
}

/// One run of the benchmark through `forward` (a model's `forward(input, index_pos)`): the
/// prompt, then `STEPS` cached steps on fixed tokens.
fn run(mut forward: impl FnMut(&Tensor, usize) -> candle_core::Result<Tensor>) {
    forward(&prompt(), 0).unwrap();
    for s in 0..STEPS {
        let t = Tensor::new(&[s as u32 + 3], &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        forward(&t, PROMPT + s).unwrap();
    }
}

fn run_candle(model: &mut candle_transformers::models::quantized_llama::ModelWeights) {
    run(|x, pos| model.forward(x, pos));
}

fn run_port(model: &mut quantized_llama::ModelWeights) {
    run(|x, pos| model.forward(x, pos));
}

fn manager(args: &[&str]) -> MemoryManager {
    let mut all = vec!["--reserve-vram", "0"];
    all.extend_from_slice(args);
    MemoryManager::new(
        Config::from_args(&all).unwrap(),
        Hardware::cpu_only(ByteSize::gib(32)),
    )
    .unwrap()
}

/// The port on `path` under `mm`, loaded: the patcher and the model.
fn port(mm: &MemoryManager, path: &Path) -> (ModelPatcher, quantized_llama::ModelWeights) {
    let model = mm.read_gguf("bench", path).unwrap();
    let p = ModelPatcher::new(Arc::new(model), mm.compute_device(), DeviceId::Cpu);
    mm.load_models_gpu(std::slice::from_ref(&p), LoadOptions::default())
        .unwrap();
    let ct = residency::quantized::gguf_file::Content::from_patcher(&p);
    let mut empty = std::io::Cursor::new(Vec::<u8>::new());
    let m = quantized_llama::ModelWeights::from_gguf(ct, &mut empty, &Device::Cpu).unwrap();
    (p, m)
}

/// Bytes the manager moved during one forward of the port on `path` under `--novram`.
fn streamed_bytes(path: &Path) -> u64 {
    let mm = manager(&["--novram", "--vram-budget", "8GiB"]);
    let (_p, mut m) = port(&mm, path);
    run_port(&mut m);
    let before = mm.transfer_stats().bytes_transferred.bytes();
    run_port(&mut m);
    mm.transfer_stats().bytes_transferred.bytes() - before
}

fn peak_rss() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// In the child: the baseline peak before the model is read, then a run under `--ram-budget`.
fn child(path: &Path, budget: &str) {
    let baseline = peak_rss();
    let mm = manager(&["--novram", "--vram-budget", "8GiB", "--ram-budget", budget]);
    let (_p, mut m) = port(&mm, path);
    run_port(&mut m);
    run_port(&mut m);
    println!("{baseline} {}", peak_rss());
}

fn bench(c: &mut Criterion, dir: &Path) {
    let q4k = dir.join("q4k.gguf");
    let bf16 = dir.join("bf16.gguf");
    write_model(&q4k, GgmlDType::Q4K);
    write_model(&bf16, GgmlDType::BF16);
    let size = std::fs::metadata(&q4k).unwrap().len();

    let mut g = c.benchmark_group("quantized");
    g.sample_size(10);
    {
        let mut file = std::fs::File::open(&q4k).unwrap();
        let ct = gguf_file::Content::read(&mut file).unwrap();
        let mut m = candle_transformers::models::quantized_llama::ModelWeights::from_gguf(
            ct,
            &mut file,
            &Device::Cpu,
        )
        .unwrap();
        g.bench_function("candle (limit)", |b| b.iter(|| run_candle(&mut m)));
    }
    {
        let mm = manager(&["--vram-budget", "8GiB"]);
        let (_p, mut m) = port(&mm, &q4k);
        g.bench_function("resident", |b| b.iter(|| run_port(&mut m)));
    }
    {
        let mm = manager(&["--novram", "--vram-budget", "8GiB"]);
        let (_p, mut m) = port(&mm, &q4k);
        g.bench_function("streamed (--novram)", |b| b.iter(|| run_port(&mut m)));
    }
    g.finish();

    let moved_q = streamed_bytes(&q4k);
    let moved_bf16 = streamed_bytes(&bf16);
    println!(
        "bytes moved per streamed run (prompt + {STEPS} steps: {} model calls): Q4_K {} vs bf16 {} (bf16 / Q4_K = {:.2}); file {}",
        STEPS + 1,
        ByteSize(moved_q),
        ByteSize(moved_bf16),
        moved_bf16 as f64 / moved_q.max(1) as f64,
        ByteSize(size)
    );

    let budget = size / 2;
    let t = Instant::now();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .env(CHILD, format!("{}|{budget}", q4k.display()))
        .output()
        .unwrap();
    let line = String::from_utf8_lossy(&out.stdout);
    let nums: Vec<u64> = line
        .split_whitespace()
        .filter_map(|v| v.parse().ok())
        .collect();
    if let [baseline, peak] = nums[..] {
        // quantized_llama dequantizes its token embedding once at build: an f32 table the
        // model owns, outside every ledger (docs/PORTING.md).
        let table = (VOCAB * EMBD * 4) as u64;
        let limit = 1.10 * (budget + baseline + table) as f64;
        println!(
            "peak RSS under --ram-budget {}: {} (baseline {}, the port's own f32 embedding table {}; limit 1.10 × (budget + baseline + table) = {}; ratio {:.2}) in {:.1} s",
            ByteSize(budget),
            ByteSize(peak),
            ByteSize(baseline),
            ByteSize(table),
            ByteSize(limit as u64),
            peak as f64 / limit,
            t.elapsed().as_secs_f64()
        );
    } else {
        eprintln!("the child failed: {}", String::from_utf8_lossy(&out.stderr));
    }
}

fn main() {
    residency::tools::cache_candle_thread_count();
    if let Some(arg) = std::env::var_os(CHILD) {
        let arg = arg.to_string_lossy().to_string();
        if let Some((path, budget)) = arg.split_once('|') {
            child(Path::new(path), budget);
        }
        return;
    }
    let Some(dir) = common::bench_dir() else {
        return;
    };
    let mut c = Criterion::default().configure_from_args();
    bench(&mut c, dir.path());
    c.final_summary();
}
