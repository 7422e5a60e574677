use candle_core::quantized::{
    k_quants::{self, BlockQ4K, BlockQ6K, BlockQ8_0, GgmlType},
    GgmlDType, QMatMul, QTensor,
};
use candle_core::{Device, Module, Tensor};
use std::time::Instant;
fn direct<T: GgmlType>(bytes: &[u8], x: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
    let blocks: &[T] = unsafe {
        std::slice::from_raw_parts(
            bytes.as_ptr() as *const T,
            bytes.len() / std::mem::size_of::<T>(),
        )
    };
    let mut dst = vec![0f32; m * n];
    k_quants::matmul((m, k, n), x, blocks, &mut dst).unwrap();
    dst
}
fn main() {
    for &(dt, n, k, m) in &[
        (GgmlDType::Q4K, 768usize, 2048usize, 1usize),
        (GgmlDType::Q8_0, 768, 2048, 1),
        (GgmlDType::Q6K, 2048, 768, 1),
        (GgmlDType::Q4K, 64, 256, 1),
        (GgmlDType::Q4K, 768, 2048, 7),
        (GgmlDType::Q8_0, 768, 2048, 64),
    ] {
        let w = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&w, dt).unwrap();
        let bytes = q.data().unwrap().to_vec();
        let x = Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu).unwrap();
        let xs = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let cached = QMatMul::from_qtensor(q).unwrap();
        let y0 = cached
            .forward(&x)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let reps = 500;
        let t = Instant::now();
        for _ in 0..reps {
            let _ = cached.forward(&x).unwrap();
        }
        let c = t.elapsed().as_secs_f64() / reps as f64 * 1e6;
        let run = || match dt {
            GgmlDType::Q4K => direct::<BlockQ4K>(&bytes, &xs, m, n, k),
            GgmlDType::Q8_0 => direct::<BlockQ8_0>(&bytes, &xs, m, n, k),
            _ => direct::<BlockQ6K>(&bytes, &xs, m, n, k),
        };
        let y2 = run();
        let t = Instant::now();
        for _ in 0..reps {
            let _ = run();
        }
        let d = t.elapsed().as_secs_f64() / reps as f64 * 1e6;
        let diff = y0
            .iter()
            .zip(&y2)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        let maxd = y0
            .iter()
            .zip(&y2)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        println!("{dt:?} {n}x{k} m={m} ({} KiB): cached {c:.1} us, direct {d:.1} us, bits differ {diff}/{} max {maxd}", bytes.len()/1024, y0.len());
    }
}
