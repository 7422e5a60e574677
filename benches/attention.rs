//! Attention backends against the naive one: time per call and measured peak temporaries.
//!
//! B = 1, 8 heads × 64, f32, self-attention at N = 1024 and 4096 (16384 is left out: on a small
//! CPU one sub-quadratic call there takes tens of seconds). The memory-aware backends plan in
//! 64 MiB of free memory so they really chunk (at N = 4096 no whole-key query chunk fits, so
//! `SubQuadratic` takes its fallback plan, 512 queries × 64 keys, and pays for many small ops). After the criterion groups, a summary table
//! prints each backend's mean time, its ratio to `Naive` at the same N, and the peak score
//! bytes it kept alive (measured) next to its plan ([`peak_temporary_bytes`]).

use std::cell::RefCell;
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use residency::attention::{
    attention_with_stats, peak_temporary_bytes, AttentionOptions, AttentionShape, Backend, Layout,
};
use residency::ByteSize;

const HEADS: usize = 8;
const DIM: usize = 64;
const FREE: ByteSize = ByteSize::mib(64);

struct Row {
    backend: Backend,
    n: usize,
    mean: Duration,
    chunks: (usize, usize),
    measured: ByteSize,
    planned: ByteSize,
}

fn inputs(n: usize) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
    let dev = Device::Cpu;
    let shape = (1, HEADS, n, DIM);
    Ok((
        Tensor::randn(0f32, 1.0, shape, &dev)?,
        Tensor::randn(0f32, 1.0, shape, &dev)?,
        Tensor::randn(0f32, 1.0, shape, &dev)?,
    ))
}

fn bench(c: &mut Criterion) {
    let rows = RefCell::new(Vec::<Row>::new());
    for n in [1024usize, 4096] {
        let Ok((q, k, v)) = inputs(n) else {
            eprintln!("could not build inputs at N = {n}");
            continue;
        };
        let mut group = c.benchmark_group(format!("attention/N={n}"));
        group
            .sample_size(10)
            .warm_up_time(Duration::from_millis(500))
            .measurement_time(Duration::from_secs(2));
        for backend in [Backend::Naive, Backend::Split, Backend::SubQuadratic] {
            let options = AttentionOptions::new(backend)
                .with_layout(Layout::PerHead)
                .with_free_memory(FREE);
            let stats = match attention_with_stats(&q, &k, &v, HEADS, None, &options) {
                Ok((_, stats)) => stats,
                Err(e) => {
                    eprintln!("{backend} at N = {n}: {e}");
                    continue;
                }
            };
            let shape = AttentionShape {
                batch_heads: HEADS,
                nq: n,
                nk: n,
                elem_bytes: 4,
            };
            let planned = peak_temporary_bytes(backend, &shape, FREE).unwrap_or(ByteSize::MAX);
            let (mut total, mut count) = (Duration::ZERO, 0u64);
            group.bench_function(BenchmarkId::new(backend.name(), n), |b| {
                b.iter_custom(|iters| {
                    let start = Instant::now();
                    for _ in 0..iters {
                        let out = attention_with_stats(&q, &k, &v, HEADS, None, &options);
                        std::hint::black_box(out.is_ok());
                    }
                    let elapsed = start.elapsed();
                    total += elapsed;
                    count += iters;
                    elapsed
                })
            });
            rows.borrow_mut().push(Row {
                backend,
                n,
                mean: total / count.max(1) as u32,
                chunks: (stats.query_chunks, stats.key_chunks),
                measured: stats.peak_temporary,
                planned,
            });
        }
        group.finish();
    }
    print_summary(&rows.borrow());
}

fn print_summary(rows: &[Row]) {
    println!();
    println!("attention summary: B=1, {HEADS} heads x {DIM}, f32, free memory {FREE}");
    println!(
        "{:<34} {:>6} {:>10} {:>9} {:>10} {:>12} {:>12}",
        "backend", "N", "ms", "vs naive", "q x k chunks", "peak temp", "planned"
    );
    for r in rows {
        let naive = rows
            .iter()
            .find(|x| x.n == r.n && x.backend == Backend::Naive)
            .map(|x| x.mean.as_secs_f64());
        let ms = r.mean.as_secs_f64() * 1e3;
        let ratio = naive
            .map(|t| format!("{:.2}x", r.mean.as_secs_f64() / t))
            .unwrap_or_else(|| "-".into());
        println!(
            "{:<34} {:>6} {:>10.1} {:>9} {:>12} {:>12} {:>12}",
            r.backend.name(),
            r.n,
            ms,
            ratio,
            format!("{} x {}", r.chunks.0, r.chunks.1),
            r.measured.to_string(),
            r.planned.to_string()
        );
    }
    println!(
        "{} / {}: not built (no fused kernel in candle-core 0.11); they run as {}",
        Backend::Sdpa,
        Backend::Flash,
        Backend::SubQuadratic
    );
}

criterion_group!(benches, bench);
criterion_main!(benches);
