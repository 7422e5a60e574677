use candle_core::{Device, Tensor};
use residency::float::Dtype;
use residency::loader::{LoadOptions, MemoryManager};
use residency::offload::fetch_weight;
use residency::patcher::{Lora, ModelPatcher, Patch};
use residency::vram::{Config, DeviceId, Hardware};
use residency::{ByteSize, Model};
use std::sync::Arc;
use std::time::Instant;
fn main() {
    let lora: bool = std::env::args().nth(1).as_deref() == Some("lora");
    let batch: usize = std::env::args()
        .nth(2)
        .map(|s| s.parse().unwrap())
        .unwrap_or(1);
    let tensors = (0..8).map(|l| {
        let w = Tensor::randn(0f32, 0.02, (2048, 2048), &Device::Cpu).unwrap();
        (
            format!("layers.{l}.weight"),
            residency::float::from_f32(&w, Dtype::BF16, residency::Rounding::Nearest).unwrap(),
        )
    });
    let model = Arc::new(Model::from_tensors("m", tensors).unwrap());
    let cfg = Config::from_args([
        "--sim-gpu",
        "8GiB@25GB/s",
        "--reserve-vram",
        "0",
        "--disable-dynamic-vram",
        "--vram-budget",
        "32MiB",
    ])
    .unwrap()
    .with_transfer_lanes(2)
    .with_prefetch_depth(2);
    let mm = MemoryManager::new(cfg, Hardware::cpu_only(ByteSize::gib(16))).unwrap();
    let mut p = ModelPatcher::new(model, DeviceId::Sim(0), DeviceId::Cpu)
        .with_compute_dtype(Some(Dtype::F32));
    if lora {
        let patches = (0..8).map(|l| {
            let up = Tensor::randn(0f32, 0.02, (2048, 16), &Device::Cpu).unwrap();
            let down = Tensor::randn(0f32, 0.02, (16, 2048), &Device::Cpu).unwrap();
            (
                format!("layers.{l}.weight"),
                Patch::Lora(Lora {
                    alpha: Some(16.0),
                    ..Lora::new(up, down)
                }),
            )
        });
        p.add_patches(patches, 1.0, 1.0).unwrap();
    }
    mm.load_models_gpu(std::slice::from_ref(&p), LoadOptions::default())
        .unwrap();
    let fwd = || {
        let mut x = Tensor::ones((batch, 2048), candle_core::DType::F32, &Device::Cpu).unwrap();
        for l in 0..8 {
            let (w, _) = fetch_weight(&p, &format!("layers.{l}.weight")).unwrap();
            x = x.matmul(&w.t().unwrap()).unwrap().tanh().unwrap();
        }
        p.model().finish_forward();
    };
    fwd();
    fwd();
    let mut v = Vec::new();
    for _ in 0..20 {
        let t0 = Instant::now();
        fwd();
        v.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    println!(
        "lora {lora} batch {batch}: {:.2} ms; {:?}",
        v[10],
        mm.transfer_stats()
    );
}
