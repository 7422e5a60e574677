//! Prints what residency sees on this machine and what it would do, like ComfyUI's first log
//! lines: `cargo run --example probe -- [--lowvram | --vram-budget 4GiB | --cpu | ...]`.

use residency::vram::{Config, Hardware, Policy};

fn main() {
    residency::tools::cache_candle_thread_count();
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--help" || a == "-h") {
        print!(
            "usage: probe [residency flags]\nresidency flags:\n{}",
            Config::flags_help()
        );
        return;
    }
    let config = match Config::from_args(&args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    let hardware = Hardware::probe();
    let policy = match Policy::new(config, hardware) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    for gpu in &policy.hardware().gpus {
        println!(
            "GPU {}: {} ({} total, {} free, compute {}.{})",
            gpu.ordinal,
            gpu.name,
            gpu.total,
            gpu.free,
            gpu.compute_capability.0,
            gpu.compute_capability.1
        );
    }
    if policy.hardware().gpus.is_empty() {
        println!("No CUDA GPU found (driver library absent or no device).");
    }
    print!(
        "{}",
        policy.startup_report(residency::attention_name(&policy))
    );
}
