//! [`uniform_tensor`]: deterministic test data, the same bits on every machine.

use candle_core::{Device, Tensor};

use crate::error::{Result, TensorContext};

/// A deterministic pseudo-random f32 tensor on the CPU with values in [-0.5, 0.5): the same bits
/// for the same `shape` and `seed` on every machine. For examples, tests and benchmarks that need
/// reproducible weights without an RNG crate (a xorshift64 stream seeded from `seed`).
///
/// # Errors
/// [`Error::Tensor`](crate::Error::Tensor) only if candle cannot build the tensor (it always can for a CPU `Vec`).
pub fn uniform_tensor(shape: &[usize], seed: u64) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(1);
    let v: Vec<f32> = (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).ctx(|| format!("a uniform tensor of shape {shape:?}"))
}
