//! [`QMatMul`]: candle's quantized matmul on a [`QTensor`] handle, its weight fetched at every
//! forward for a managed one (quantized kernels for unpatched blocks, the dense matmul
//! otherwise), with the cost-aware misses' timings noted where a miss ran.

use std::sync::Arc;

use candle_core::quantized as cq;
use candle_core::{Device, Module, Tensor};

use super::{Fetched, Inner, QTensor};
use crate::ops::to_candle;

/// candle's `QMatMul` on a [`QTensor`]: quantized kernels for unpatched quantized weights,
/// candle's dense matmul otherwise, the weight fetched at every forward for a managed one.
#[derive(Clone, Debug)]
pub struct QMatMul {
    weight: QTensor,
    /// candle's own, for an owned weight (its dequantize-all switches apply once, as in candle).
    owned: Option<cq::QMatMul>,
}

impl QMatMul {
    /// A matmul on `qtensor` (candle's `QMatMul::from_qtensor`).
    ///
    /// # Errors
    /// candle's errors for an owned tensor.
    pub fn from_qtensor(qtensor: impl Into<QTensor>) -> candle_core::Result<Self> {
        let weight = qtensor.into();
        let owned = match &weight.inner {
            Inner::Owned(q) => Some(cq::QMatMul::from_arc(Arc::clone(q))?),
            _ => None,
        };
        Ok(QMatMul { weight, owned })
    }

    /// A matmul on a shared `qtensor` (candle's `QMatMul::from_arc`).
    ///
    /// # Errors
    /// As [`QMatMul::from_qtensor`].
    pub fn from_arc(qtensor: Arc<QTensor>) -> candle_core::Result<Self> {
        QMatMul::from_qtensor(QTensor::clone(&qtensor))
    }

    /// The weight handle.
    pub fn weight(&self) -> &QTensor {
        &self.weight
    }

    /// The weight dense in f16 (fetched now for a managed weight).
    ///
    /// # Errors
    /// As [`QTensor::dequantize`].
    pub fn dequantize_f16(&self) -> candle_core::Result<Tensor> {
        match &self.owned {
            Some(m) => m.dequantize_f16(),
            None => self.weight.dequantize_f16(&self.weight.device()?),
        }
    }

    /// candle's `forward_via_f16`: the weight dequantized to f16, multiplied in f16.
    ///
    /// # Errors
    /// As [`QTensor::dequantize`], and candle's errors.
    pub fn forward_via_f16(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        match &self.owned {
            Some(m) => m.forward_via_f16(xs),
            // Used and dropped here: not a tensor the caller holds.
            None => cq::QMatMul::TensorF16(
                self.weight
                    .dequantize_now(&self.weight.device()?)?
                    .to_dtype(candle_core::DType::F16)?,
            )
            .forward(xs),
        }
    }

    /// Rows `ids` of the weight (candle's `QMatMul::embedding`).
    ///
    /// # Errors
    /// As [`QTensor::embedding`].
    pub fn embedding(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        match &self.owned {
            Some(m) => m.embedding(ids),
            None => self.weight.embedding(ids),
        }
    }
}

impl Module for QMatMul {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        if let Some(m) = &self.owned {
            return m.forward(xs);
        }
        self.weight.on_weight_device(xs, |xs| self.forward_here(xs))
    }
}

impl QMatMul {
    /// The forward on the device of the weight.
    fn forward_here(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        let rows = xs.elem_count() / xs.dims().last().copied().unwrap_or(1).max(1);
        match self
            .weight
            .fetch_for_matmul(xs.device(), Some(rows))
            .map_err(to_candle)?
        {
            Fetched::Quantized(q) => cq::QMatMul::from_arc(q)?.forward(xs),
            Fetched::Uploaded(q, note) => {
                let t0 = std::time::Instant::now();
                let y = cq::QMatMul::from_arc(q)?.forward(xs)?;
                let ns = t0.elapsed().as_nanos() as u64;
                note.costs.note_device(note.ggml, note.rows, note.bytes, ns);
                Ok(y)
            }
            Fetched::Host(q, note) => {
                crate::lock::check_wait("a read-back of a matmul's input (candle `to_device`)");
                let x = xs.to_device(&Device::Cpu)?;
                let matmul = cq::QMatMul::from_arc(q)?;
                let t0 = std::time::Instant::now();
                let mut y = matmul.forward(&x)?;
                let mut ns = note.timed.then(|| t0.elapsed().as_nanos() as u64);
                if ns.is_none() && !note.costs.host_measured(note.ggml) {
                    // A copy just kept was re-packed inside that run: the format's first host
                    // figure comes from a second run on it (the same product), so the rule
                    // need not wait for a weight to run on the host twice.
                    let t0 = std::time::Instant::now();
                    y = matmul.forward(&x)?;
                    ns = Some(t0.elapsed().as_nanos() as u64);
                }
                note.costs.note_host(note.ggml, note.rows, note.bytes, ns);
                y.to_device(xs.device())
            }
            Fetched::Dense(w) => {
                let w = if w.dtype() == xs.dtype() {
                    w
                } else {
                    w.to_dtype(xs.dtype())?
                };
                cq::QMatMul::Tensor(w).forward(xs)
            }
        }
    }
}
