//! Building a weight as it is used: its patches applied in f32, rounded back to the storage dtype
//! (nearest-even, or stochastically with the key's seed for fp8), cast to the resident dtype and
//! moved to the load device. Resident copies and streamed fetches both come from
//! [`ModelPatcher::materialize`], so they hold the same bits.

use candle_core::Tensor;

use super::{ModelPatcher, WEIGHT_SCALE_SUFFIX};
use crate::error::{Error, Result};
use crate::float::{self, Dtype, Rounding};
use crate::patcher::adapters::{self, PatchEntry};
use crate::size::ByteSize;
use crate::vram::DeviceId;
use crate::weights::{ResidentWeight, SlotResidency};

impl ModelPatcher {
    /// The patched weight `key` in its storage dtype on the host: patches applied in f32, then
    /// rounded to nearest-even (f16/bf16) or stochastically with the key's seed (fp8). The same
    /// bits whichever path asks (I3, docs/ARCHITECTURE.md §4.3).
    pub fn patched_weight(&self, key: &str) -> Result<Tensor> {
        let index = self.index_of(key)?;
        self.patched_storage(index)
    }

    /// The patched weight `key` in f32 on the host, before any rounding: what
    /// [`ModelPatcher::patched_weight`] rounds to the storage dtype. A tool that converts to
    /// another dtype rounds this once instead of twice. Unpatched weights are decoded exactly.
    pub fn patched_weight_f32(&self, key: &str) -> Result<Tensor> {
        let index = self.index_of(key)?;
        let slot = &self.model.slots()[index];
        let w = match slot.quantized() {
            Some(_) => self.dequantized(
                index,
                &self.clean_qtensor(index, &slot.clean()?, &candle_core::Device::Cpu)?,
            )?,
            None => fresh_f32(slot.name(), &slot.clean()?, slot.dtype())?,
        };
        self.patch_f32(index, w)
    }

    /// Quantized weight `index` as candle's `QTensor` on `device`, from `blocks` (its block
    /// bytes, or a copy of them on the host or the simulated GPU).
    pub(crate) fn clean_qtensor(
        &self,
        index: usize,
        blocks: &Tensor,
        device: &candle_core::Device,
    ) -> Result<candle_core::quantized::QTensor> {
        let slot = &self.model.slots()[index];
        let Some(ggml) = slot.quantized() else {
            return Err(Error::UnsupportedDtype {
                dtype: slot.dtype().to_string(),
                what: format!(
                    "weight `{}` of `{}` as a quantized tensor (it is dense)",
                    slot.name(),
                    self.model.name()
                ),
            });
        };
        crate::weights::qtensor_from_bytes(
            blocks,
            ggml,
            slot.shape(),
            device,
            (self.model.name(), slot.name()),
        )
    }

    /// Quantized weight `index` dense from `q`, its resident or streamed blocks: patched now, or
    /// only dequantized when the blocks were re-quantized after patching.
    pub(crate) fn dense_from_blocks(
        &self,
        index: usize,
        q: &candle_core::quantized::QTensor,
        dtype: Dtype,
    ) -> Result<Tensor> {
        if !self.requantizes(index) {
            return self.dequantized_patched(index, q, dtype);
        }
        cast_weight(&self.dequantized(index, q)?, Dtype::F32, dtype)
    }

    /// Quantized weight `index`'s blocks `q` dequantized to f32, on `q`'s device.
    fn dequantized(&self, index: usize, q: &candle_core::quantized::QTensor) -> Result<Tensor> {
        let name = self.model.slots()[index].name();
        q.dequantize(&q.device())
            .map_err(|e| Error::tensor(format!("dequantizing `{name}`"), e))
    }

    /// Quantized weight `index` dense: `q` (its clean blocks) dequantized (in f32, on `q`'s
    /// device), patched with
    /// this patcher's patches and cast to `dtype`, as ComfyUI-GGUF builds a patched GGUF weight.
    pub(crate) fn dequantized_patched(
        &self,
        index: usize,
        q: &candle_core::quantized::QTensor,
        dtype: Dtype,
    ) -> Result<Tensor> {
        // A dequantized tensor is a new buffer.
        let patched = self.patch_f32(index, self.dequantized(index, q)?)?;
        cast_weight(&patched, Dtype::F32, dtype)
    }

    /// Applies weight `index`'s patches to its f32 value `w` (in stored units: a per-tensor scale
    /// is applied before the patches and removed after them). `w` must be a buffer of its own (a
    /// fresh decode, never the clean weight's storage): on the CPU the patches are added into it.
    fn patch_f32(&self, index: usize, w: Tensor) -> Result<Tensor> {
        let slot = &self.model.slots()[index];
        let entries = self.patches.get(slot.name());
        if entries.is_empty() {
            return Ok(w);
        }
        self.model.usage().note_patched();
        let chain: Vec<PatchEntry> = entries.iter().map(|e| e.entry.clone()).collect();
        let scale = self.weight_scale(index)?;
        let mut w = w;
        if let Some(s) = scale {
            // Patches act on the weight the layer computes with: decoded × scale.
            w = w
                .affine(f64::from(s), 0.0)
                .map_err(|e| Error::tensor(format!("`{}`: applying its scale", slot.name()), e))?;
        }
        let mut patched = adapters::apply_fresh(slot.name(), w, &chain, self.options.dora)?;
        if let Some(s) = scale {
            patched = (patched / f64::from(s))
                .map_err(|e| Error::tensor(format!("`{}`: removing its scale", slot.name()), e))?;
        }
        Ok(patched)
    }

    /// Weight `index` patched and ready in `to` from `stored` (its clean storage, or a copy of it
    /// on the CPU or the simulated GPU) by the fused engine ([`adapters::apply_fused`]: decode,
    /// low-rank deltas and the rounding to the storage dtype in one pass), when `to` is f32, the
    /// storage bf16, f16 or f32, `stored` a CPU tensor (a CUDA copy is patched by candle's
    /// operations there) and every patch a low-rank delta on whole rows; `None` sends the caller
    /// down the general path, which gives the same bits.
    fn patched_fused(&self, index: usize, stored: &Tensor, to: Dtype) -> Result<Option<Tensor>> {
        let slot = &self.model.slots()[index];
        let storage = slot.dtype();
        if to != Dtype::F32
            || !stored.device().is_cpu()
            || slot.quantized().is_some()
            || !matches!(storage, Dtype::BF16 | Dtype::F16 | Dtype::F32)
        {
            return Ok(None);
        }
        let entries = self.patches.get(slot.name());
        if entries.is_empty() {
            return Ok(None);
        }
        let chain: Vec<PatchEntry> = entries.iter().map(|e| e.entry.clone()).collect();
        let fused = adapters::apply_fused(slot.name(), stored, storage, &chain, true)?;
        if fused.is_some() {
            self.model.usage().note_patched();
        }
        Ok(fused)
    }

    fn patched_storage(&self, index: usize) -> Result<Tensor> {
        self.patched_storage_from(index, &self.model.slots()[index].clean()?)
    }

    /// Patches `clean` (weight `index`'s clean tensor, or a bit-identical copy of it such as a
    /// staged one) and rounds back to the storage dtype.
    fn patched_storage_from(&self, index: usize, clean: &Tensor) -> Result<Tensor> {
        let slot = &self.model.slots()[index];
        if self.patches.get(slot.name()).is_empty() {
            return Ok(clean.clone());
        }
        if let Some(ggml) = slot.quantized() {
            // Stored form of a patched quantized weight: re-quantized to its own format (lossy;
            // compute uses the dense patched weight instead, see `dequantized_patched`).
            let cpu = candle_core::Device::Cpu;
            let dense = self.dequantized_patched(
                index,
                &self.clean_qtensor(index, clean, &cpu)?,
                Dtype::F32,
            )?;
            let ctx = |e| Error::tensor(format!("re-quantizing `{}` to {ggml:?}", slot.name()), e);
            let q = candle_core::quantized::QTensor::quantize(&dense, ggml).map_err(ctx)?;
            let bytes = q.data().map_err(ctx)?.into_owned();
            let n = bytes.len();
            return Tensor::from_vec(bytes, n, &cpu).map_err(ctx);
        }
        let patched = self.patch_f32(index, fresh_f32(slot.name(), clean, slot.dtype())?)?;
        let rounding = if slot.dtype().is_fp8() {
            Rounding::stochastic_for(slot.name())
        } else {
            Rounding::Nearest
        };
        float::from_f32(&patched, slot.dtype(), rounding)
    }

    /// The per-tensor scale of weight `index`: the f32 scalar stored as `<layer>.weight_scale`
    /// next to an fp8 `<layer>.weight`, else `None`. Patches on a scaled weight are applied to
    /// `decode(w) × scale` and divided by the scale again before rounding back to fp8.
    ///
    /// # Errors
    /// [`Error::BadPatch`] when the scale tensor is not a single finite, non-zero value.
    pub fn weight_scale(&self, index: usize) -> Result<Option<f32>> {
        let slot = &self.model.slots()[index];
        if !slot.dtype().is_fp8() {
            return Ok(None);
        }
        let Some(prefix) = slot.name().strip_suffix(".weight") else {
            return Ok(None);
        };
        let key = format!("{prefix}{WEIGHT_SCALE_SUFFIX}");
        let Some(si) = self.model.index_of(&key) else {
            return Ok(None);
        };
        let s = &self.model.slots()[si];
        let bad = |reason: String| Error::BadPatch {
            key: key.clone(),
            reason: format!("model `{}`: {reason}", self.model.name()),
        };
        if s.numel() != 1 {
            return Err(bad(format!(
                "a per-tensor scale must hold one value, not shape {:?}",
                s.shape()
            )));
        }
        let v = float::to_f32(&s.clean()?, s.dtype())?
            .flatten_all()
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(|e| Error::tensor(format!("reading `{key}`"), e))?[0];
        if !v.is_finite() || v == 0.0 {
            return Err(bad(format!("scale {v} is not a finite non-zero number")));
        }
        Ok(Some(v))
    }

    /// Every weight, patched, in its storage dtype: `(key, tensor, dtype)` in file order.
    pub fn patched_state_dict(&self) -> Result<Vec<(String, Tensor, Dtype)>> {
        (0..self.model.len())
            .map(|i| {
                let s = &self.model.slots()[i];
                Ok((s.name().to_string(), self.patched_storage(i)?, s.dtype()))
            })
            .collect()
    }

    /// Builds weight `index` as it is used: patched storage, cast to `dtype`, on `device`. The one
    /// function behind resident copies and streamed fetches, so both give the same bits.
    pub fn materialize(&self, index: usize, dtype: Dtype, device: DeviceId) -> Result<Tensor> {
        self.materialize_from(index, &self.model.slots()[index].clean()?, dtype, device)
    }

    /// [`ModelPatcher::materialize`] starting from `clean`, which must hold the same bits as weight
    /// `index`'s clean tensor.
    pub fn materialize_from(
        &self,
        index: usize,
        clean: &Tensor,
        dtype: Dtype,
        device: DeviceId,
    ) -> Result<Tensor> {
        let slot = &self.model.slots()[index];
        #[cfg(test)]
        crate::fault::check(self.model.slots()[index].name())?;
        let (host, finish) = self.host_part(index, clean, dtype, device)?;
        if device.is_cpu() {
            return Ok(host);
        }
        let dev = device.to_candle()?;
        let moved = host
            .to_device(&dev)
            .map_err(|e| Error::tensor(format!("`{}`: copying to {device}", slot.name()), e))?;
        match finish {
            Some(f) => self.finish(index, &moved, f),
            None => Ok(moved),
        }
    }

    /// The host side of materializing weight `index` for `device`: what is copied, and what is
    /// left for the device after the copy ([`Finish`]). The transfer lanes copy what this
    /// returns and run the rest on the copy's stream; a CPU destination gets the finished weight.
    ///
    /// Which device computes what (docs/ARCHITECTURE.md §9): for a GPU, a dense weight in a
    /// half-precision or f32 storage dtype is copied **clean** and patched on the GPU
    /// ([`Finish::Patch`]): its LoRA factors are small and go with it, the patch math runs
    /// there. A cast that widens exactly ([`Dtype::widens_exactly_to`]) also runs there
    /// ([`Finish::Cast`]): fewer bytes cross the bus, and an exact cast gives the same bits
    /// wherever it runs. fp8 weights (whose patched value is rounded stochastically, with a
    /// per-tensor scale) and quantized ones (re-quantized or dequantized at use) are patched on
    /// the host, and every other cast runs here.
    pub(crate) fn host_part(
        &self,
        index: usize,
        clean: &Tensor,
        dtype: Dtype,
        device: DeviceId,
    ) -> Result<(Tensor, Option<Finish>)> {
        let slot = &self.model.slots()[index];
        if slot.quantized().is_some() {
            // Quantized weights move as their blocks: clean (patches apply at use), or patched
            // and re-quantized when the patcher asks for that.
            if self.requantizes(index) {
                return Ok((self.patched_storage_from(index, clean)?, None));
            }
            return Ok((clean.clone(), None));
        }
        let patched = !self.patches.get(slot.name()).is_empty();
        if !device.is_cpu() && patched && !slot.dtype().is_fp8() {
            return Ok((clean.clone(), Some(Finish::Patch { to: dtype })));
        }
        if patched && device.is_cpu() {
            if let Some(t) = self.patched_fused(index, clean, dtype)? {
                return Ok((t, None));
            }
        }
        let stored = self.patched_storage_from(index, clean)?;
        if !device.is_cpu() && slot.dtype().widens_exactly_to(dtype) {
            let from = slot.dtype();
            return Ok((stored, Some(Finish::Cast { from, to: dtype })));
        }
        Ok((cast_weight(&stored, slot.dtype(), dtype)?, None))
    }

    /// Runs `finish` on `copied`, weight `index` as [`ModelPatcher::host_part`] had it copied, on
    /// the device it was copied to: the same operations as the host path
    /// ([`ModelPatcher::patched_weight`] then the cast), on that device's tensors.
    pub(crate) fn finish(&self, index: usize, copied: &Tensor, finish: Finish) -> Result<Tensor> {
        match finish {
            Finish::Cast { from, to } => cast_weight(copied, from, to),
            Finish::Patch { to } => {
                if let Some(t) = self.patched_fused(index, copied, to)? {
                    return Ok(t);
                }
                let slot = &self.model.slots()[index];
                let storage = slot.dtype();
                let patched = self.patch_f32(index, fresh_f32(slot.name(), copied, storage)?)?;
                // Computing in f32 from half-precision storage (the common case): the rounding
                // to the storage dtype and the widening back, in place in the patched buffer
                // (the patch engine's result is this call's alone) — the same values, two
                // buffers fewer.
                if to == Dtype::F32 && float::round_through_in_place(&patched, storage)? {
                    return Ok(patched);
                }
                let stored = cast_weight(&patched, Dtype::F32, storage)?;
                cast_weight(&stored, storage, to)
            }
        }
    }

    /// The resident copy of weight `index` when it is current for this patcher on its load
    /// device (a dense weight; see [`ModelPatcher::resident_weight`] for quantized ones).
    pub fn resident_tensor(&self, index: usize) -> Option<Tensor> {
        self.resident_weight(index)?.dense().cloned()
    }

    /// The resident copy of weight `index`, dense or quantized, when it is current for this
    /// patcher on its load device.
    pub fn resident_weight(&self, index: usize) -> Option<ResidentWeight> {
        let fp = self.fingerprint(index);
        match self.model.state().slots().get(index)? {
            SlotResidency::Resident {
                tensor,
                fingerprint,
                device,
                ..
            } if *fingerprint == fp && *device == self.weight_device(index) => Some(tensor.clone()),
            _ => None,
        }
    }

    /// What a resident copy of weight `index` built from `t` (what
    /// [`ModelPatcher::materialize`] returned for `device`) holds, and its bytes: `t` itself for
    /// a dense weight; for a quantized one, its blocks as a `QTensor` on `device`.
    pub(crate) fn resident_from(
        &self,
        index: usize,
        t: Tensor,
        device: DeviceId,
    ) -> Result<(ResidentWeight, ByteSize)> {
        let slot = &self.model.slots()[index];
        if slot.quantized().is_none() {
            let bytes = ByteSize((t.elem_count() * t.dtype().size_in_bytes()) as u64);
            return Ok((ResidentWeight::Dense(t), bytes));
        }
        let q = self.clean_qtensor(index, &t, &device.to_candle()?)?;
        Ok((
            ResidentWeight::Quantized(std::sync::Arc::new(q)),
            slot.bytes(),
        ))
    }

    /// The weight `key` ready for compute on the load device, in the resident dtype: the resident
    /// copy when it is current, else fetched from the host and patched now (streamed). The second
    /// value says whether it streamed. Records first-forward order. A quantized weight comes
    /// dense: dequantized and patched.
    pub fn fetch(&self, key: &str) -> Result<(Tensor, bool)> {
        let index = self.index_of(key)?;
        self.model.record_use(index);
        let resident = self.resident_weight(index);
        if let Some(ResidentWeight::Dense(t)) = &resident {
            return Ok((t.clone(), false));
        }
        if resident.is_none() && self.model.stream_hook().is_none() {
            self.model.note_use_without_load(self.weight_device(index));
        }
        let dtype = self.resident_dtype(index);
        match resident {
            Some(ResidentWeight::Quantized(q)) => {
                Ok((self.dense_from_blocks(index, &q, dtype)?, false))
            }
            _ => {
                let device = self.weight_device(index);
                let t = self.materialize(index, dtype, device)?;
                if self.model.slots()[index].quantized().is_none() {
                    return Ok((t, true));
                }
                let q = self.clean_qtensor(index, &t, &device.to_candle()?)?;
                Ok((self.dense_from_blocks(index, &q, dtype)?, true))
            }
        }
    }
}

/// What is left to do to a weight once its copy reaches a GPU, run there after the copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Finish {
    /// An exact widening cast from the storage dtype `from` to the resident dtype `to`.
    Cast {
        /// The storage dtype.
        from: Dtype,
        /// The resident dtype.
        to: Dtype,
    },
    /// The weight was copied clean: its patches are applied in f32, the result rounded to the
    /// storage dtype (nearest-even) and cast to `to`, as the host path does.
    Patch {
        /// The resident dtype.
        to: Dtype,
    },
}

/// `t` (stored as `dtype`) decoded to f32 in a buffer of its own: a decode makes one, an f32
/// weight is copied (its own storage is the clean weight's).
fn fresh_f32(key: &str, t: &Tensor, dtype: Dtype) -> Result<Tensor> {
    if dtype == Dtype::F32 {
        return adapters::fresh_f32(key, t);
    }
    float::to_f32(t, dtype)
}

/// Casts a weight from dtype `from` to `to` the one way every path does (I3, docs/ARCHITECTURE.md
/// §4.3): through f32, rounding to nearest-even. Identity when the dtypes agree. On the CPU this
/// uses [`float::to_f32`]/[`float::from_f32`]; on other devices candle's cast (also RNE).
pub(crate) fn cast_weight(t: &Tensor, from: Dtype, to: Dtype) -> Result<Tensor> {
    if from == to {
        return Ok(t.clone());
    }
    let wide = float::to_f32(t, from)?;
    if to == Dtype::F32 {
        return Ok(wide);
    }
    if wide.device().is_cpu() {
        float::from_f32(&wide, to, Rounding::Nearest)
    } else {
        wide.to_dtype(to.candle_storage_dtype())
            .map_err(|e| Error::tensor(format!("casting a weight from f32 to {to}"), e))
    }
}
