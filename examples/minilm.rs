//! Sentence embeddings with all-MiniLM-L6-v2 through residency's ops layers and memory manager.
//!
//! ```text
//! bash scripts/fetch-minilm.sh
//! cargo run --release --example minilm -- [--model-dir DIR] [--storage-dtype f32|f16|bf16|fp8_e4m3fn]
//!     [--vram-budget SIZE] [--ram-budget SIZE] [--lora FILE:STRENGTH]...
//!     [--attention naive|split|subquad|auto]
//!     [--trace FILE | --tracing] [--timeline FILE]
//!     [residency flags: --novram, --lowvram, --reserve-vram 0, ...] "sentence" ...
//! ```
//!
//! `--trace FILE` (or candle's `--tracing`) writes a Chrome trace of the run (Perfetto,
//! `chrome://tracing`); `--timeline FILE` draws it as an SVG (`residency::trace`).
//!
//! Prints one JSON object per sentence (`{"sentence", "tokens", "embedding"}`, the embedding
//! mean-pooled over the attention mask and L2-normalised) on stdout, and the memory report and
//! the process's peak resident memory (Linux) on stderr. Weights are converted to the storage
//! dtype when the model is built and computed in f32. With `--ram-budget` an f32 checkpoint is
//! read lazily: weights stay in the file and at most that many bytes of them are held in RAM
//! (`--novram --ram-budget 48MiB` streams MiniLM, whose largest weight is 45 MiB, from disk).

use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;

use candle_core::Tensor;
use residency::attention::BackendRequest;
use residency::float::Dtype;
use residency::loader::{LoadOptions, MemoryManager};
use residency::models::bert::{self, Bert, BertConfig, BertOptions};
use residency::ops::pick_operations;
use residency::patcher::{lora_file, ModelPatcher};
use residency::vram::{Config, DeviceId, Hardware};

struct Args {
    model_dir: PathBuf,
    storage: Dtype,
    loras: Vec<(PathBuf, f32)>,
    attention: Option<BackendRequest>,
    residency_flags: Vec<String>,
    sentences: Vec<String>,
}

const USAGE: &str = "usage: minilm [--model-dir DIR] [--storage-dtype f32|f16|bf16|fp8_e4m3fn] \
[--lora FILE:STRENGTH]... [--attention naive|split|subquad|auto] [--trace FILE | --tracing] \
[--timeline FILE] [residency flags, e.g. \
--vram-budget 64MiB, --novram] \"sentence\" ...";

fn parse_args(raw: Vec<String>) -> Result<Args, String> {
    let mut a = Args {
        model_dir: PathBuf::from(".cache/minilm"),
        storage: Dtype::F32,
        loras: Vec::new(),
        attention: None,
        residency_flags: Vec::new(),
        sentences: Vec::new(),
    };
    let mut it = raw.into_iter().peekable();
    while let Some(arg) = it.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if arg.starts_with("--") => (f.to_string(), Some(v.to_string())),
            _ => (arg.clone(), None),
        };
        let mut value = |name: &str| -> Result<String, String> {
            inline
                .clone()
                .or_else(|| it.next())
                .ok_or_else(|| format!("{name} needs a value"))
        };
        match flag.as_str() {
            "--help" | "-h" => {
                print!(
                    "{USAGE}\nresidency flags:\n{}",
                    residency::vram::Config::flags_help()
                );
                std::process::exit(0);
            }
            "--model-dir" => a.model_dir = PathBuf::from(value("--model-dir")?),
            "--storage-dtype" => {
                a.storage =
                    Dtype::from_str(&value("--storage-dtype")?).map_err(|e| e.to_string())?
            }
            "--lora" => {
                let v = value("--lora")?;
                let (file, strength) = v
                    .rsplit_once(':')
                    .ok_or_else(|| format!("--lora {v}: expected FILE:STRENGTH"))?;
                let strength = strength
                    .parse::<f32>()
                    .map_err(|e| format!("--lora {v}: strength: {e}"))?;
                a.loras.push((PathBuf::from(file), strength));
            }
            "--attention" => {
                a.attention = match value("--attention")?.as_str() {
                    "naive" => Some(BackendRequest::Naive),
                    "split" => Some(BackendRequest::Split),
                    "subquad" => Some(BackendRequest::SubQuadratic),
                    "auto" => None,
                    other => {
                        return Err(format!(
                            "--attention {other}: expected naive|split|subquad|auto"
                        ))
                    }
                }
            }
            f if f.starts_with("--") => {
                if !Config::is_known_flag(f) {
                    return Err(format!("unknown flag {f}\n{USAGE}"));
                }
                a.residency_flags.push(arg.clone());
                let takes = Config::flag_takes_value(f);
                if inline.is_none() {
                    let next_is_number = it.peek().is_some_and(|n| n.parse::<usize>().is_ok());
                    if takes == Some(true) || (takes.is_none() && next_is_number) {
                        a.residency_flags
                            .push(it.next().ok_or_else(|| format!("{f} needs a value"))?);
                    }
                }
            }
            _ => a.sentences.push(arg),
        }
    }
    if a.sentences.is_empty() {
        return Err(format!("no sentence given\n{USAGE}"));
    }
    Ok(a)
}

fn run(args: Args) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let weights = args.model_dir.join("model.safetensors");
    if !weights.is_file() {
        return Err(format!(
            "{} not found: run `bash scripts/fetch-minilm.sh` or pass --model-dir",
            weights.display()
        )
        .into());
    }
    let config = BertConfig::from_file(args.model_dir.join("config.json"))?;
    let mut tokenizer = tokenizers::Tokenizer::from_file(args.model_dir.join("tokenizer.json"))?;
    tokenizer.with_padding(None);

    let mm = MemoryManager::new(Config::from_args(&args.residency_flags)?, Hardware::probe())?;
    let device = mm.compute_device();
    let before_model = peak_rss();
    // An f32 checkpoint computed in f32 needs no conversion: read it as the configuration asks
    // (lazily under --ram-budget). Other storage dtypes are converted from an eager read.
    let model = if args.storage == Dtype::F32 {
        mm.read_model("all-MiniLM-L6-v2", &[&weights])?
    } else {
        bert::load_model(&weights, "all-MiniLM-L6-v2", args.storage)?
    };
    let mut patcher = ModelPatcher::new(Arc::new(model), device, DeviceId::Cpu);
    for (file, strength) in &args.loras {
        let keys: Vec<String> = patcher.model().keys().map(str::to_string).collect();
        let l = lora_file::load(file.as_path(), keys.iter().map(String::as_str))?;
        let matched = patcher.add_patches(l.patches, *strength, 1.0)?;
        eprintln!(
            "lora {}: {} weights patched at strength {strength}, {} names unmatched",
            file.display(),
            matched.len(),
            l.unmatched_lora_keys.len()
        );
    }
    let mode = pick_operations(args.storage, Some(Dtype::F32), device, false, false);
    // The manager asks the model's estimator what a forward over the longest sentence needs and
    // keeps that free.
    patcher.set_memory_estimator(config.memory_estimator(Dtype::F32));
    let longest = args
        .sentences
        .iter()
        .map(|s| {
            tokenizer
                .encode(s.as_str(), true)
                .map(|e| e.get_ids().len())
        })
        .collect::<std::result::Result<Vec<_>, _>>()?
        .into_iter()
        .max()
        .unwrap_or(1);
    mm.load_models_gpu(
        std::slice::from_ref(&patcher),
        LoadOptions::default().with_input_shape(&[1, longest]),
    )?;
    let bert = Bert::new(&patcher, mode, &config)?.with_options(BertOptions {
        attention: args.attention,
        ..BertOptions::default()
    });

    let dev = device.to_candle()?;
    for sentence in &args.sentences {
        let ids = tokenizer
            .encode(sentence.as_str(), true)?
            .get_ids()
            .to_vec();
        let n = ids.len();
        let t = Tensor::from_vec(ids, (1, n), &dev)?;
        let mask = Tensor::ones((1, n), candle_core::DType::U32, &dev)?;
        let e = {
            let _compute = tracing::info_span!("compute", model = "minilm", tokens = n).entered();
            bert.embed(&t, &mask, None)?.squeeze(0)?.to_vec1::<f32>()?
        };
        let line = serde_json::json!({ "sentence": sentence, "tokens": n, "embedding": e });
        println!("{line}");
    }
    eprintln!("ops mode: {mode:?}, storage {}", args.storage);
    eprintln!("{}", mm.memory_report());
    if let (Some(before), Some(peak)) = (before_model, peak_rss()) {
        eprintln!("peak RSS: {peak} ({before} before the model was read)");
    }
    Ok(())
}

/// The process's peak resident set size (`VmHWM` in `/proc/self/status`; Linux only).
fn peak_rss() -> Option<residency::ByteSize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(residency::ByteSize::kib(kib))
}

fn main() {
    residency::tools::cache_candle_thread_count();
    let raw: Vec<String> = std::env::args().skip(1).collect();
    let (trace, raw) = match residency::trace::TraceArgs::take_from(&raw) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {e}\n{USAGE}");
            std::process::exit(2);
        }
    };
    let args = match parse_args(raw) {
        Ok(a) => a,
        Err(msg) => {
            eprintln!("{msg}");
            std::process::exit(2);
        }
    };
    let session = match trace.start() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    let result = run(args);
    if let Some(session) = &session {
        match session.finish() {
            Ok(files) => files
                .iter()
                .for_each(|f| eprintln!("wrote {}", f.display())),
            Err(e) => eprintln!("error: {e}"),
        }
    }
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
