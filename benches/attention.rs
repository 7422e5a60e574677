//! Attention backends against the naive one and against the machine's matmul rate: time per
//! call, GFLOP/s and measured peak temporaries.
//!
//! B = 1, 8 heads × 64, f32, self-attention at N = 1024 and 4096 (16384 is left out: on a small
//! CPU one sub-quadratic call there takes tens of seconds). The memory-aware backends plan in
//! 64 MiB of free memory so they really chunk (at N = 4096 no whole-key query chunk fits, so
//! `SubQuadratic` takes its fallback plan, 512 queries × 64 keys, and pays for many small ops);
//! the fused kernel (`Sdpa`, the CPU default) runs in 64 MiB and with unlimited memory.
//!
//! The limits, measured in the same run: candle's plain f32 matmul rate (a 2048³ product on
//! rayon's pool) and the CPU's fused-multiply-add peak (every pool thread running independent
//! AVX-512 FMA chains, nothing loaded: no kernel can beat it). After the criterion groups, a summary table prints each backend's mean time,
//! its ratio to `Naive` at the same N, its GFLOP/s (4·BH·N²·D flops per call) and their fraction
//! of the matmul rate, and the peak score bytes it kept alive (measured) next to its plan
//! ([`peak_temporary_bytes`]).

use std::cell::RefCell;
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use criterion::{criterion_group, BenchmarkId, Criterion};
use residency::attention::{
    attention_with_stats, peak_temporary_bytes, AttentionOptions, AttentionShape, Backend, Layout,
};
use residency::ByteSize;

const HEADS: usize = 8;
const DIM: usize = 64;
const FREE: ByteSize = ByteSize::mib(64);

struct Row {
    backend: Backend,
    free: ByteSize,
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
        let runs = [
            (Backend::Naive, FREE),
            (Backend::Split, FREE),
            (Backend::SubQuadratic, FREE),
            (Backend::Sdpa, FREE),
            (Backend::Sdpa, ByteSize::MAX),
        ];
        for (backend, free) in runs {
            let options = AttentionOptions::new(backend)
                .with_layout(Layout::PerHead)
                .with_free_memory(free);
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
            let planned = peak_temporary_bytes(backend, &shape, free).unwrap_or(ByteSize::MAX);
            let (mut total, mut count) = (Duration::ZERO, 0u64);
            let id = format!("{} in {}", backend.name(), free_label(free));
            group.bench_function(BenchmarkId::new(id, n), |b| {
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
                free,
                n,
                mean: total / count.max(1) as u32,
                chunks: (stats.query_chunks, stats.key_chunks),
                measured: stats.peak_temporary,
                planned,
            });
        }
        group.finish();
    }
    let matmul = matmul_gflops();
    let peak = fma_peak_gflops();
    print_summary(&rows.borrow(), matmul, peak);
}

fn free_label(free: ByteSize) -> String {
    if free == ByteSize::MAX {
        "ample memory".into()
    } else {
        free.to_string()
    }
}

/// candle's plain f32 matmul rate in GFLOP/s: the median of 5 timed 2048³ products (after one
/// warm-up), on rayon's pool like attention.
fn matmul_gflops() -> f64 {
    const S: usize = 2048;
    let dev = Device::Cpu;
    let (Ok(a), Ok(b)) = (
        Tensor::randn(0f32, 1.0, (S, S), &dev),
        Tensor::randn(0f32, 1.0, (S, S), &dev),
    ) else {
        return f64::NAN;
    };
    let mut times: Vec<f64> = (0..6)
        .map(|_| {
            let start = Instant::now();
            std::hint::black_box(a.matmul(&b).is_ok());
            start.elapsed().as_secs_f64()
        })
        .skip(1)
        .collect();
    times.sort_by(f64::total_cmp);
    2.0 * (S * S * S) as f64 / times[times.len() / 2] / 1e9
}

/// The CPU's arithmetic ceiling in GFLOP/s: every thread of rayon's pool running 12 independent
/// chains of AVX-512 fused multiply-adds (16 lanes, 2 flops each) for about 0.3 s, nothing
/// loaded or stored. NaN without AVX-512 (the fused kernel then runs on `gemm`, and the matmul
/// rate is the limit to read).
fn fma_peak_gflops() -> f64 {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm512_fmadd_ps, _mm512_reduce_add_ps, _mm512_set1_ps};
        #[target_feature(enable = "avx512f")]
        fn chains(iters: usize) -> f32 {
            let mut acc = [_mm512_set1_ps(1.0); 12];
            let (b, c) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
            for _ in 0..iters {
                for a in acc.iter_mut() {
                    *a = _mm512_fmadd_ps(*a, b, c);
                }
            }
            acc.iter().map(|&a| _mm512_reduce_add_ps(a)).sum()
        }
        if !std::arch::is_x86_feature_detected!("avx512f") {
            return f64::NAN;
        }
        const ITERS: usize = 20_000_000;
        let threads = rayon::current_num_threads();
        let start = Instant::now();
        let sum: f32 = rayon::broadcast(|_| {
            // SAFETY: AVX-512F was detected above.
            unsafe { chains(ITERS) }
        })
        .into_iter()
        .sum();
        std::hint::black_box(sum);
        let flops = (threads * ITERS * 12 * 16 * 2) as f64;
        flops / start.elapsed().as_secs_f64() / 1e9
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        f64::NAN
    }
}

fn print_summary(rows: &[Row], matmul: f64, peak: f64) {
    println!();
    println!("attention summary: B=1, {HEADS} heads x {DIM}, f32");
    println!("limit: candle plain f32 matmul (2048^3) {matmul:.1} GFLOP/s, same run");
    println!(
        "limit: the CPU's FMA peak ({} threads, independent AVX-512 chains) {peak:.1} GFLOP/s; \
         the last column is each backend's share of it",
        rayon::current_num_threads()
    );
    println!(
        "{:<34} {:>12} {:>6} {:>10} {:>9} {:>8} {:>9} {:>12} {:>12} {:>12} {:>7}",
        "backend",
        "free",
        "N",
        "ms",
        "vs naive",
        "GFLOP/s",
        "/ matmul",
        "q x k chunks",
        "peak temp",
        "planned",
        "/ peak"
    );
    for r in rows {
        let naive = rows
            .iter()
            .find(|x| x.n == r.n && x.backend == Backend::Naive)
            .map(|x| x.mean.as_secs_f64());
        let secs = r.mean.as_secs_f64();
        let ratio = naive
            .map(|t| format!("{:.2}x", secs / t))
            .unwrap_or_else(|| "-".into());
        let gflops = 4.0 * (HEADS * r.n * r.n * DIM) as f64 / secs / 1e9;
        println!(
            "{:<34} {:>12} {:>6} {:>10.1} {:>9} {:>8.1} {:>9.2} {:>12} {:>12} {:>12} {:>7.2}",
            r.backend.name(),
            free_label(r.free),
            r.n,
            secs * 1e3,
            ratio,
            gflops,
            gflops / matmul,
            format!("{} x {}", r.chunks.0, r.chunks.1),
            r.measured.to_string(),
            r.planned.to_string(),
            gflops / peak
        );
    }
}

criterion_group!(benches, bench);
/// `criterion_main!(benches)`, with candle's thread count cached first
/// ([`residency::tools::cache_candle_thread_count`]).
fn main() {
    residency::tools::cache_candle_thread_count();
    benches();
    criterion::Criterion::default()
        .configure_from_args()
        .final_summary();
}
