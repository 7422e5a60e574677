use candle_core::{Device, Tensor};
use residency::float::Dtype;
use residency::patcher::{adapters, DoraNorm, Lora, Patch, PatchEntry};
use std::time::Instant;
fn main() {
    let w = Tensor::randn(0f32, 0.02, (2048, 2048), &Device::Cpu).unwrap();
    let wb = residency::float::from_f32(&w, Dtype::BF16, residency::Rounding::Nearest).unwrap();
    let up = Tensor::randn(0f32, 0.02, (2048, 16), &Device::Cpu).unwrap();
    let down = Tensor::randn(0f32, 0.02, (16, 2048), &Device::Cpu).unwrap();
    let e = PatchEntry::new(Patch::Lora(Lora {
        alpha: Some(16.0),
        ..Lora::new(up.clone(), down.clone())
    }));
    let t = |name: &str, f: &mut dyn FnMut()| {
        let mut v = Vec::new();
        for _ in 0..15 {
            let t0 = Instant::now();
            f();
            v.push(t0.elapsed().as_secs_f64() * 1e3);
        }
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        println!("{name:40} {:.2} ms", v[7]);
    };
    t("to_f32 bf16->f32", &mut || {
        std::hint::black_box(residency::float::to_f32(&wb, Dtype::BF16).unwrap());
    });
    t("matmul up.down whole", &mut || {
        std::hint::black_box(up.matmul(&down).unwrap());
    });
    let u2 = up.narrow(0, 0, 1024).unwrap();
    t("matmul up.down half rows", &mut || {
        std::hint::black_box(u2.matmul(&down).unwrap());
    });
    t("apply (decode + lora)", &mut || {
        std::hint::black_box(
            adapters::apply("k", &wb, std::slice::from_ref(&e), DoraNorm::Standard).unwrap(),
        );
    });
    let wf = residency::float::to_f32(&wb, Dtype::BF16).unwrap();
    t("add whole", &mut || {
        std::hint::black_box((&wf + &wf).unwrap());
    });
    t("from_f32 bf16", &mut || {
        std::hint::black_box(
            residency::float::from_f32(&wf, Dtype::BF16, residency::Rounding::Nearest).unwrap(),
        );
    });
    let x = Tensor::randn(0f32, 1.0, (64, 2048), &Device::Cpu).unwrap();
    t("forward matmul batch 64", &mut || {
        std::hint::black_box(x.matmul(&wf.t().unwrap()).unwrap());
    });
}
