//! `tools::merge_files` (the `lora_merge` tool) on a 1 GiB f32 checkpoint generated on the fly,
//! against the machine's own limit measured in the same run: reading the base and writing the
//! same number of bytes to a new file, in 64 MiB chunks, with nothing in between.
//!
//! The checkpoint: 16 weights of 4096 × 4096 f32 (64 MiB each, the largest tensor), 16 biases
//! and an i64 buffer that is passed through; a rank-16 LoRA patches 8 of the weights. The files
//! live in a temporary directory (`RESIDENCY_BENCH_DIR`, else the system's), deleted afterwards.
//! On a machine whose disk writeback is slow or shared, writing 1 GiB takes seconds and varies
//! by as much; `RESIDENCY_BENCH_DIR=/dev/shm` measures the merge's own cost instead.
//!
//! After criterion's groups a summary prints both times and their ratio, and then (after a
//! `sync`, so the earlier runs' writeback is over) runs the merge once more in a child process
//! (this binary, re-executed) to report what a user of the tool sees: wall time of the whole
//! process, its peak RSS beside the goal of 2 × the largest tensor + 64 MiB, and its minor page
//! faults beside the bytes written / 4 KiB. Then the same for a checkpoint of few, large weights
//! carrying every delta kind (LoCon, LoHa, LoKr, a diff, LoRA), whose peak the patch math's row
//! blocks bound.
//!
//! `cargo bench --bench merge` (sample size 10; a merge takes seconds).

use std::collections::HashMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use criterion::{Criterion, Throughput};

mod common;
use residency::tools::{merge_files, LoraInput, MergeConfig};

const SIDE: usize = 4096;
const WEIGHTS: usize = 16;
const PATCHED: usize = 8;
const RANK: usize = 16;
/// Set in the child process: the directory holding the files to merge.
const CHILD: &str = "RESIDENCY_MERGE_BENCH_CHILD";

fn weight_name(i: usize) -> String {
    format!("blocks.{i}.proj.weight")
}

/// Writes the base checkpoint and the LoRA into `dir`; returns the base's size in bytes.
fn write_inputs(dir: &Path) -> u64 {
    let mut base: HashMap<String, Tensor> = HashMap::new();
    for i in 0..WEIGHTS {
        let w = residency::float::uniform_tensor(&[SIDE, SIDE], i as u64).expect("weight");
        base.insert(weight_name(i), w);
        let b = residency::float::uniform_tensor(&[SIDE], 100 + i as u64).expect("bias");
        base.insert(format!("blocks.{i}.proj.bias"), b);
    }
    let ids = Tensor::arange(0i64, 77, &Device::Cpu).expect("ids");
    base.insert("position_ids".into(), ids);
    candle_core::safetensors::save(&base, dir.join("base.safetensors")).expect("write base");
    drop(base);
    let mut lora: HashMap<String, Tensor> = HashMap::new();
    for i in 0..PATCHED {
        let module = format!("blocks.{i}.proj");
        let up = residency::float::uniform_tensor(&[SIDE, RANK], 200 + i as u64).expect("up");
        let down = residency::float::uniform_tensor(&[RANK, SIDE], 300 + i as u64).expect("down");
        lora.insert(format!("{module}.lora_up.weight"), up);
        lora.insert(format!("{module}.lora_down.weight"), down);
        let alpha = Tensor::new(RANK as f32 / 2.0, &Device::Cpu).expect("alpha");
        lora.insert(format!("{module}.alpha"), alpha);
    }
    candle_core::safetensors::save(&lora, dir.join("lora.safetensors")).expect("write lora");
    std::fs::metadata(dir.join("base.safetensors"))
        .map(|m| m.len())
        .unwrap_or(0)
}

/// The mixed checkpoint (few, large weights, every one patched, every delta kind): one 288 MiB
/// `[4096, 2048, 3, 3]` conv with a LoCon (up `[out, 16, 1, 1]`, down `[16, in, 3, 3]`), one
/// 256 MiB `[8192, 8192]` linear with a LoHa (rank 16), four 144 MiB `[2048, 2048, 3, 3]` convs
/// with a LoHa, a LoKr (`w1 [4, 4]`, `w2 [512, 512, 3, 3]`), an f16 diff and a LoCon, and five
/// 16 MiB `[4096, 1024]` linears with a LoRA, all f32. Written into `dir` as `base.safetensors`
/// and `lora.safetensors`; returns (base bytes, largest weight bytes).
fn write_mixed_inputs(dir: &Path) -> (u64, u64) {
    let mut shapes: Vec<Vec<usize>> = vec![vec![4096, 2048, 3, 3], vec![8192, 8192]];
    shapes.extend((0..4).map(|_| vec![2048, 2048, 3, 3]));
    shapes.extend((0..5).map(|_| vec![4096, 1024]));
    let kinds = [
        "locon", "loha", "loha", "lokr", "diff", "locon", "lora", "lora", "lora", "lora", "lora",
    ];
    let mut base: HashMap<String, Tensor> = HashMap::new();
    let mut lora: HashMap<String, Tensor> = HashMap::new();
    let rand = |shape: &[usize], seed: usize| {
        residency::float::uniform_tensor(shape, seed as u64).expect("tensor")
    };
    for (i, (shape, kind)) in shapes.iter().zip(kinds).enumerate() {
        base.insert(format!("convs.{i}.weight"), rand(shape, 400 + i));
        let module = format!("convs.{i}");
        let rest: Vec<usize> = shape[1..].to_vec();
        let seed = 500 + 10 * i;
        let mut put = |name: &str, t: Tensor| {
            lora.insert(format!("{module}.{name}"), t);
        };
        match kind {
            "loha" => {
                let mut b = vec![RANK];
                b.extend(&rest);
                put("hada_w1_a", rand(&[shape[0], RANK], seed));
                put("hada_w1_b", rand(&b, seed + 1));
                put("hada_w2_a", rand(&[shape[0], RANK], seed + 2));
                put("hada_w2_b", rand(&b, seed + 3));
            }
            "lokr" => {
                put("lokr_w1", rand(&[4, 4], seed));
                let mut w2 = vec![shape[0] / 4, shape[1] / 4];
                w2.extend(&shape[2..]);
                put("lokr_w2", rand(&w2, seed + 1));
            }
            "diff" => {
                let d = (rand(shape, seed) * 0.01).expect("diff");
                put(
                    "diff",
                    d.to_dtype(candle_core::DType::F16).expect("f16 diff"),
                );
            }
            _ => {
                let mut up = vec![shape[0], RANK];
                if shape.len() == 4 {
                    up.extend([1, 1]);
                }
                let mut down = vec![RANK];
                down.extend(&rest);
                put("lora_up.weight", rand(&up, seed));
                put("lora_down.weight", rand(&down, seed + 1));
            }
        }
        if kind != "diff" && kind != "lokr" {
            let alpha = Tensor::new(RANK as f32 / 2.0, &Device::Cpu).expect("alpha");
            put("alpha", alpha);
        }
    }
    candle_core::safetensors::save(&base, dir.join("base.safetensors")).expect("write base");
    drop(base);
    candle_core::safetensors::save(&lora, dir.join("lora.safetensors")).expect("write lora");
    let bytes = std::fs::metadata(dir.join("base.safetensors"))
        .map(|m| m.len())
        .unwrap_or(0);
    (bytes, 4096 * 2048 * 9 * 4)
}

fn config(dir: &Path, out: &str) -> MergeConfig {
    MergeConfig {
        model: dir.join("base.safetensors"),
        loras: vec![LoraInput {
            path: dir.join("lora.safetensors"),
            strength: None,
        }],
        strength: 0.8,
        dtype: None,
        out: dir.join(out),
    }
}

/// The limit: read `from` and write the same bytes to `to`, 64 MiB at a time.
fn plain_copy(from: &Path, to: &Path) -> std::io::Result<u64> {
    let mut src = std::fs::File::open(from)?;
    let mut dst = std::fs::File::create(to)?;
    let mut buf = vec![0u8; 64 << 20];
    let mut total = 0;
    loop {
        let n = src.read(&mut buf)?;
        if n == 0 {
            break;
        }
        dst.write_all(&buf[..n])?;
        total += n as u64;
    }
    dst.flush()?;
    Ok(total)
}

/// Runs the merge in a child process: (wall time, peak RSS in bytes, minor page faults), the
/// last two as the child reports them about itself (the parent's `RUSAGE_CHILDREN` would count
/// the parent's own memory, which a child shares until it execs).
fn child_merge(dir: &Path) -> Option<(Duration, u64, u64)> {
    let exe = std::env::current_exe().ok()?;
    let start = Instant::now();
    let out = std::process::Command::new(exe)
        .env(CHILD, dir)
        .output()
        .ok()?;
    let wall = start.elapsed();
    if !out.status.success() {
        eprintln!(
            "the merge child failed: {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        return None;
    }
    let report = String::from_utf8_lossy(&out.stdout);
    let mut fields = report.split_whitespace().map(|f| f.parse::<u64>().ok());
    let (rss, faults) = (fields.next()??, fields.next()??);
    Some((wall, rss, faults))
}

/// In the child, after the merge: its peak RSS in bytes (`VmHWM`, which starts afresh at exec)
/// and its minor page faults.
fn own_usage() -> (u64, u64) {
    let hwm = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .unwrap_or(0);
    // SAFETY: `getrusage` only writes the `rusage` struct it is given, which lives on this stack.
    let faults = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        if libc::getrusage(libc::RUSAGE_SELF, &mut usage) == 0 {
            usage.ru_minflt as u64
        } else {
            0
        }
    };
    (hwm * 1024, faults)
}

fn bench(c: &mut Criterion, dir: &Path) {
    let bytes = write_inputs(dir);
    let base = dir.join("base.safetensors");
    let mut g = c.benchmark_group("merge_1GiB_f32");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(100))
        .measurement_time(Duration::from_secs(20))
        .throughput(Throughput::Bytes(bytes));
    // Each run writes a new file, as a user merging into a new name does: the previous run's
    // output is removed first, untimed (replacing an existing file makes ext4 start writing the
    // new one back at once, which measures the disk, not the merge).
    let copy = dir.join("copy.safetensors");
    g.bench_function("plain read + write", |b| {
        common::timed_after(
            b,
            "plain",
            || drop(std::fs::remove_file(&copy)),
            || plain_copy(&base, &copy).expect("copy"),
        )
    });
    let merge = config(dir, "merged.safetensors");
    g.bench_function("merge_files", |b| {
        common::timed_after(
            b,
            "merge",
            || drop(std::fs::remove_file(&merge.out)),
            || merge_files(&merge).expect("merge"),
        )
    });
    g.finish();

    let gib = bytes as f64 / (1u64 << 30) as f64;
    let plain = common::median_secs("plain");
    let merged = common::median_secs("merge");
    println!();
    println!(
        "merge summary: base {gib:.2} GiB f32 ({WEIGHTS} x {SIDE}x{SIDE} weights, largest \
         tensor 64 MiB), rank-{RANK} LoRA on {PATCHED} of them"
    );
    println!(
        "  plain read + write (the limit)  {:8.2} s  {:6.2} GB/s",
        plain,
        bytes as f64 / plain / 1e9
    );
    println!(
        "  merge_files, in process         {:8.2} s  {:6.2} GB/s  {:5.2}x the limit's time",
        merged,
        bytes as f64 / merged / 1e9,
        merged / plain
    );
    // The runs above leave gigabytes of dirty pages behind; a user's one merge starts on a
    // machine that is not still writing them back.
    // SAFETY: `sync` takes no arguments and only asks the kernel to flush its caches.
    unsafe { libc::sync() };
    match child_merge(dir) {
        Some((wall, rss, faults)) => {
            let largest = (SIDE * SIDE * 4) as u64;
            let goal = 2 * largest + (64 << 20);
            println!(
                "  whole process (child)           {:8.2} s  peak RSS {:.0} MiB (goal <= 2 x \
                 largest + 64 MiB = {:.0} MiB: {}), minor faults {} (bytes written / 4 KiB = {})",
                wall.as_secs_f64(),
                rss as f64 / (1u64 << 20) as f64,
                goal as f64 / (1u64 << 20) as f64,
                if rss <= goal { "met" } else { "not met" },
                faults,
                bytes / 4096
            );
        }
        None => println!("  whole process: the child run failed"),
    }

    // The mixed checkpoint: few, large weights, every one patched, every delta kind.
    let mixed = dir.join("mixed");
    if std::fs::create_dir_all(&mixed).is_err() {
        println!("  mixed checkpoint: cannot create {}", mixed.display());
        return;
    }
    let (bytes, largest) = write_mixed_inputs(&mixed);
    // SAFETY: as above.
    unsafe { libc::sync() };
    match child_merge(&mixed) {
        Some((wall, rss, _)) => {
            let goal = 2 * largest + (64 << 20);
            println!(
                "  mixed checkpoint {:.2} GiB f32 (11 weights, every one patched: LoCon on the largest, {:.0} MiB 4-D, \
                 LoHa on a 256 MiB linear and a conv, LoKr, an f16 diff, LoRA), whole process {:.2} s, \
                 peak RSS {:.0} MiB (goal <= 2 x largest + 64 MiB = {:.0} MiB: {})",
                bytes as f64 / (1u64 << 30) as f64,
                largest as f64 / (1u64 << 20) as f64,
                wall.as_secs_f64(),
                rss as f64 / (1u64 << 20) as f64,
                goal as f64 / (1u64 << 20) as f64,
                if rss <= goal { "met" } else { "not met" },
            );
        }
        None => println!("  mixed checkpoint: the child run failed"),
    }
}

fn main() {
    residency::tools::cache_candle_thread_count();
    if let Some(dir) = std::env::var_os(CHILD) {
        let dir = PathBuf::from(dir);
        if let Err(e) = merge_files(&config(&dir, "child.safetensors")) {
            eprintln!("merge failed: {e}");
            std::process::exit(2);
        }
        let (rss, faults) = own_usage();
        println!("{rss} {faults}");
        return;
    }
    let Some(dir) = common::bench_dir() else {
        return;
    };
    let mut c = Criterion::default().configure_from_args();
    bench(&mut c, dir.path());
    c.final_summary();
}
