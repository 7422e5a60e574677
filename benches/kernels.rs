//! Our normalisation and softmax kernels against candle-nn's fused ones, in the same run
//! (STYLE 13): the decision of which the crate uses is made from these numbers.
//!
//! - `LayerNorm` and `RmsNorm` of `[2048, 768]` (f32 and bf16 inputs): an `ops` layer (our
//!   unfused statistics: mean, centre, variance, divide) against the `nn` layer of the same
//!   weights (candle-nn's fused `ops::layer_norm` / `ops::rms_norm`); both fetch the same
//!   resident weight, so the ratio is the kernels'.
//! - softmax over the last dimension of `[4096, 512]` f32: the plain composition the attention
//!   backends use (max, subtract, exp, sum, divide) against candle-nn's `ops::softmax_last_dim`.
//!
//! criterion measures each case (sample size 10); a summary with medians and ratios is printed at
//! the end (ratio > 1: candle-nn's fused kernel is faster).

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Module, Tensor, D};
use criterion::{criterion_group, Criterion};
use residency::float::Dtype;
use residency::ops::{OpsBuilder, OpsMode};
use residency::patcher::ModelPatcher;
use residency::vram::DeviceId;
use residency::weights::Model;

fn median(mut f: impl FnMut(), runs: usize) -> Duration {
    f();
    let mut t: Vec<Duration> = (0..runs)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed()
        })
        .collect();
    t.sort();
    t[runs / 2]
}

fn rand(shape: &[usize]) -> Tensor {
    Tensor::rand(-1f32, 1.0, shape, &Device::Cpu).unwrap()
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn norms(c: &mut Criterion, summary: &mut Vec<String>) {
    let h = 768;
    let model = Model::from_tensors(
        "norms",
        [
            ("ln.weight", rand(&[h])),
            ("ln.bias", rand(&[h])),
            ("rms.weight", rand(&[h])),
        ],
    )
    .unwrap();
    let p = ModelPatcher::new(Arc::new(model), DeviceId::Cpu, DeviceId::Cpu);
    let mode = OpsMode::DisableWeightInit;
    let ops = OpsBuilder::new(&p, mode);
    let vb = residency::nn::VarBuilder::from_patcher(&p, mode).unwrap();
    for dtype in [DType::F32, DType::BF16] {
        let ops_mode = match dtype {
            DType::F32 => mode,
            _ => OpsMode::ManualCast {
                compute: Dtype::BF16,
            },
        };
        let ops = OpsBuilder::from_source(ops.source(), ops_mode);
        let vb = vb.to_dtype(dtype);
        let ours_ln = ops.layer_norm("ln", 1e-5, true).unwrap();
        let fused_ln = residency::nn::layer_norm(h, 1e-5, vb.pp("ln")).unwrap();
        let ours_rms = ops.rms_norm("rms", 1e-6).unwrap();
        let fused_rms = residency::nn::rms_norm(h, 1e-6, vb.pp("rms")).unwrap();
        let x = rand(&[2048, h]).to_dtype(dtype).unwrap();
        let mut g = c.benchmark_group(format!("norm_2048x768_{dtype:?}"));
        g.sample_size(10)
            .warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_secs(2));
        g.bench_function("layer_norm_ours", |b| {
            b.iter(|| black_box(ours_ln.forward(&x).unwrap()))
        });
        g.bench_function("layer_norm_fused", |b| {
            b.iter(|| black_box(fused_ln.forward(&x).unwrap()))
        });
        g.bench_function("rms_norm_ours", |b| {
            b.iter(|| black_box(ours_rms.forward(&x).unwrap()))
        });
        g.bench_function("rms_norm_fused", |b| {
            b.iter(|| black_box(fused_rms.forward(&x).unwrap()))
        });
        g.finish();
        let cases: [(&str, &dyn Module, &dyn Module); 2] = [
            ("layer_norm", &ours_ln, &fused_ln),
            ("rms_norm", &ours_rms, &fused_rms),
        ];
        for (name, ours, fused) in cases {
            let o = median(|| drop(black_box(ours.forward(&x).unwrap())), 21);
            let f = median(|| drop(black_box(fused.forward(&x).unwrap())), 21);
            summary.push(format!(
                "{name:<12} {dtype:?}  ours {:>8.3} ms  candle-nn fused {:>8.3} ms  ratio {:.2}",
                ms(o),
                ms(f),
                o.as_secs_f64() / f.as_secs_f64()
            ));
        }
    }
}

/// The attention backends' softmax: max, subtract, exp, sum, divide.
fn plain_softmax(s: &Tensor) -> Tensor {
    let max = s.max_keepdim(D::Minus1).unwrap();
    let e = s.broadcast_sub(&max).unwrap().exp().unwrap();
    let sum = e.sum_keepdim(D::Minus1).unwrap();
    e.broadcast_div(&sum).unwrap()
}

fn softmax(c: &mut Criterion, summary: &mut Vec<String>) {
    let s = rand(&[4096, 512]);
    let mut g = c.benchmark_group("softmax_4096x512_f32");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2));
    g.bench_function("plain", |b| b.iter(|| black_box(plain_softmax(&s))));
    g.bench_function("softmax_last_dim", |b| {
        b.iter(|| black_box(candle_nn::ops::softmax_last_dim(&s).unwrap()))
    });
    g.finish();
    let o = median(|| drop(black_box(plain_softmax(&s))), 21);
    let f = median(
        || drop(black_box(candle_nn::ops::softmax_last_dim(&s).unwrap())),
        21,
    );
    summary.push(format!(
        "softmax      F32   plain {:>7.3} ms  candle-nn fused {:>8.3} ms  ratio {:.2}",
        ms(o),
        ms(f),
        o.as_secs_f64() / f.as_secs_f64()
    ));
}

fn benches(c: &mut Criterion) {
    let mut summary = Vec::new();
    norms(c, &mut summary);
    softmax(c, &mut summary);
    println!("\nkernels (median of 21; ratio = ours / candle-nn fused, > 1: fused is faster)");
    for line in summary {
        println!("  {line}");
    }
}

criterion_group!(kernels, benches);
/// `criterion_main!(kernels)`, with candle's thread count cached first
/// ([`residency::tools::cache_candle_thread_count`]).
fn main() {
    residency::tools::cache_candle_thread_count();
    kernels();
    criterion::Criterion::default()
        .configure_from_args()
        .final_summary();
}
