//! Throughput of the f32 → storage-dtype casts against the machine's own limit (memcpy of the
//! same bytes) and against the naive way (candle's `Tensor::to_dtype`).
//!
//! Throughput is in bytes of f32 *input*. After criterion's groups, a summary prints one line per
//! op: GB/s (median of a few timed runs) and the ratio to memcpy measured in the same run.

use std::hint::black_box;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use criterion::{criterion_group, BenchmarkId, Criterion, Throughput};
use half::{bf16, f16};
use rayon::prelude::*;
use residency::float::{self, Dtype, Fp8Format, Rounding};

const SIDES: [usize; 2] = [4096, 8192];

/// Weight-like values: mostly small (many in the fp8 subnormal range), a few large.
fn weights(n: usize) -> Vec<f32> {
    let mut s = 0x2545_F491_4F6C_DD1Du64;
    (0..n)
        .map(|i| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            if i % 1000 == 0 {
                u * 1000.0
            } else {
                u * 0.1
            }
        })
        .collect()
}

/// Buffers reused across iterations, pre-touched so page faults are not measured.
struct Buffers {
    src: Vec<f32>,
    tensor: Tensor,
    copy: Vec<f32>,
    half: Vec<f16>,
    brain: Vec<bf16>,
    fp8: Vec<u8>,
}

impl Buffers {
    fn new(side: usize) -> Self {
        let n = side * side;
        let src = weights(n);
        let tensor = Tensor::from_slice(&src, (side, side), &Device::Cpu).expect("tensor");
        Buffers {
            src,
            tensor,
            copy: vec![1.0; n],
            half: vec![f16::ONE; n],
            brain: vec![bf16::ONE; n],
            fp8: vec![1; n],
        }
    }
}

type Op = (&'static str, fn(&mut Buffers));

fn ops() -> Vec<Op> {
    vec![
        ("memcpy", |b| b.copy.copy_from_slice(&b.src)),
        ("memcpy (rayon)", |b| {
            b.copy
                .par_chunks_mut(float::PAR_CHUNK)
                .zip(b.src.par_chunks(float::PAR_CHUNK))
                .for_each(|(d, s)| d.copy_from_slice(s))
        }),
        ("f32->f16", |b| {
            float::f32_to_f16(&b.src, &mut b.half).expect("f16")
        }),
        ("f32->bf16", |b| {
            float::f32_to_bf16(&b.src, &mut b.brain).expect("bf16")
        }),
        ("f32->fp8_e4m3fn RNE", |b| {
            float::f32_to_fp8(&b.src, &mut b.fp8, Fp8Format::E4M3FN, Rounding::Nearest)
                .expect("fp8")
        }),
        ("f32->fp8_e4m3fn stochastic", |b| {
            float::f32_to_fp8(
                &b.src,
                &mut b.fp8,
                Fp8Format::E4M3FN,
                Rounding::Stochastic {
                    seed: 1_346_105_780,
                },
            )
            .expect("fp8 sr")
        }),
        ("f32->fp8_e5m2 stochastic", |b| {
            float::f32_to_fp8(
                &b.src,
                &mut b.fp8,
                Fp8Format::E5M2,
                Rounding::Stochastic {
                    seed: 1_346_105_780,
                },
            )
            .expect("fp8 sr")
        }),
        ("from_f32 tensor bf16 (allocates)", |b| {
            black_box(float::from_f32(&b.tensor, Dtype::BF16, Rounding::Nearest).expect("tensor"));
        }),
        ("from_f32 tensor f16 (allocates)", |b| {
            black_box(float::from_f32(&b.tensor, Dtype::F16, Rounding::Nearest).expect("tensor"));
        }),
        ("from_f32 tensor fp8_e4m3fn (allocates)", |b| {
            black_box(
                float::from_f32(&b.tensor, Dtype::F8E4M3FN, Rounding::Nearest).expect("tensor"),
            );
        }),
        ("from_f32 tensor fp8_e4m3fn stochastic", |b| {
            black_box(
                float::from_f32(
                    &b.tensor,
                    Dtype::F8E4M3FN,
                    Rounding::Stochastic {
                        seed: 1_346_105_780,
                    },
                )
                .expect("tensor"),
            );
        }),
        ("candle to_dtype bf16", |b| {
            black_box(b.tensor.to_dtype(DType::BF16).expect("candle bf16"));
        }),
        ("candle to_dtype f16", |b| {
            black_box(b.tensor.to_dtype(DType::F16).expect("candle f16"));
        }),
    ]
}

fn casts(c: &mut Criterion) {
    for side in SIDES {
        let mut buffers = Buffers::new(side);
        let mut group = c.benchmark_group(format!("casts/{side}x{side}"));
        group
            .throughput(Throughput::Bytes((side * side * 4) as u64))
            .sample_size(10)
            .warm_up_time(Duration::from_millis(500))
            .measurement_time(Duration::from_secs(3));
        for (name, op) in ops() {
            group.bench_function(BenchmarkId::from_parameter(name), |bench| {
                bench.iter(|| op(&mut buffers))
            });
        }
        group.finish();
    }
    summary();
}

/// Median seconds of `runs` timed calls (after one warm-up call). The "allocates" rows include
/// the page faults of a fresh output buffer, as a caller pays them; the others write into
/// buffers touched before.
fn time(op: fn(&mut Buffers), buffers: &mut Buffers, runs: usize) -> f64 {
    op(buffers);
    let mut t: Vec<f64> = (0..runs)
        .map(|_| {
            let start = Instant::now();
            op(buffers);
            start.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[runs / 2]
}

fn summary() {
    println!(
        "\nsummary (GB/s of f32 input, median of 7 runs; ratio to the parallel memcpy of the same \
         bytes, the limit, measured in the same run)"
    );
    for side in SIDES {
        let mut buffers = Buffers::new(side);
        let bytes = (side * side * 4) as f64;
        let timed: Vec<(&str, f64)> = ops()
            .into_iter()
            .map(|(name, op)| (name, time(op, &mut buffers, 7)))
            .collect();
        let limit = timed
            .iter()
            .find(|(name, _)| *name == "memcpy (rayon)")
            .map_or(f64::NAN, |&(_, s)| bytes / s / 1e9);
        for (name, s) in timed {
            let gbs = bytes / s / 1e9;
            println!(
                "  {side}x{side} {name:<40} {gbs:7.2} GB/s  {:6.2} ms  {:5.2}x memcpy",
                s * 1e3,
                gbs / limit
            );
        }
    }
}

criterion_group!(benches, casts);
/// `criterion_main!(benches)`, with candle's thread count cached first
/// ([`residency::tools::cache_candle_thread_count`]).
fn main() {
    residency::tools::cache_candle_thread_count();
    benches();
    criterion::Criterion::default()
        .configure_from_args()
        .final_summary();
}
