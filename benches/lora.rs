//! LoRA merge throughput against the machine's own limits, measured in the same run.
//!
//! `adapters::apply` of a rank-16 and a rank-64 LoRA on a 4096×4096 f32 weight, next to the naive
//! way of doing the same work with plain candle: the matmul `up[4096×r] · down[r×4096]` and the
//! 4096×4096 add. The merge cannot beat `matmul + add`; a ratio near 1 means the patch path adds
//! no overhead of its own. Throughput is reported in bytes of merged weight written.
//!
//! `cargo bench --bench lora` (sample size 10, 3 s per measurement).

use std::time::Duration;

use candle_core::Tensor;
use criterion::{Criterion, Throughput};

mod common;
use residency::patcher::{adapters, DoraNorm, Lora, Patch, PatchEntry};

const N: usize = 4096;
const RANKS: [usize; 2] = [16, 64];

fn median_ms(name: &str) -> f64 {
    common::median_secs(name) * 1e3
}

fn rand(shape: (usize, usize), seed: u64) -> Tensor {
    residency::float::uniform_tensor(&[shape.0, shape.1], seed).expect("host tensor")
}

fn bench(c: &mut Criterion) {
    let w = rand((N, N), 1);
    let other = rand((N, N), 2);
    let mut g = c.benchmark_group("lora_merge_4096x4096_f32");
    g.throughput(Throughput::Bytes((N * N * 4) as u64));
    g.bench_function("add", |b| {
        common::timed(b, "add", || (&w + &other).expect("add"))
    });
    for r in RANKS {
        let up = rand((N, r), 10 + r as u64);
        let down = rand((r, N), 20 + r as u64);
        let mut lora = Lora::new(up.clone(), down.clone());
        lora.alpha = Some(r as f32 / 2.0);
        let entries = [PatchEntry::new(Patch::Lora(lora))];
        g.bench_function(format!("matmul_r{r}"), |b| {
            common::timed(b, &format!("matmul_r{r}"), || {
                up.matmul(&down).expect("matmul")
            })
        });
        g.bench_function(format!("apply_r{r}"), |b| {
            common::timed(b, &format!("apply_r{r}"), || {
                adapters::apply("w", &w, &entries, DoraNorm::Standard).expect("apply")
            })
        });
    }
    g.finish();
}

fn summary() {
    let bytes = (N * N * 4) as f64;
    let add = median_ms("add");
    println!();
    println!("LoRA merge on a {N}x{N} f32 weight (median of per-sample means)");
    println!(
        "{:<34} {:>9} {:>9}  {:<30} {:>9} {:>7}",
        "op", "ms", "GB/s", "limit", "limit ms", "ratio"
    );
    let row = |op: &str, ms: f64, limit: &str, lim: f64| {
        println!(
            "{:<34} {:>9.2} {:>9.2}  {:<30} {:>9.2} {:>7.2}",
            op,
            ms,
            bytes / (ms * 1e-3) / 1e9,
            limit,
            lim,
            ms / lim
        );
    };
    for r in RANKS {
        let apply = median_ms(&format!("apply_r{r}"));
        let mm = median_ms(&format!("matmul_r{r}"));
        let op = format!("adapters::apply rank {r}");
        row(&op, apply, "candle matmul + add (naive)", mm + add);
        row(&op, apply, &format!("candle matmul {N}x{r}x{N}"), mm);
        row(&op, apply, &format!("candle add {N}x{N}"), add);
    }
}

fn main() {
    residency::tools::cache_candle_thread_count();
    let mut c = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    bench(&mut c);
    c.final_summary();
    summary();
}
