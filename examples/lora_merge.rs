//! Merges LoRA files into a base checkpoint and writes the result:
//!
//! ```text
//! cargo run --release --example lora_merge -- --model BASE.safetensors \
//!     --lora LORA.safetensors [--lora MORE.safetensors:0.5] [--strength 0.8] \
//!     [--dtype f32|f16|bf16|fp8_e4m3fn|fp8_e5m2] --out MERGED.safetensors
//! ```
//!
//! The logic lives in [`residency::tools::merge_files`]. Exit status: 0 on success, 2 on any
//! error (the message names the flag or the file).

use residency::tools::{merge_files, MergeConfig};

fn main() {
    residency::tools::cache_candle_thread_count();
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--help" || a == "-h") {
        println!("{}", MergeConfig::USAGE);
        return;
    }
    if args.is_empty() {
        eprintln!("{}", MergeConfig::USAGE);
        std::process::exit(2);
    }
    let result = MergeConfig::from_args(&args).and_then(|config| merge_files(&config));
    match result {
        Ok(report) => println!("{report}"),
        Err(e) => {
            eprintln!("error: {e}");
            eprintln!("(run with --help for usage)");
            std::process::exit(2);
        }
    }
}
