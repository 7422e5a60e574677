//! Building a weight as it is used: its patches applied in f32, rounded back to the storage dtype
//! (nearest-even, or stochastically with the key's seed for fp8), cast to the resident dtype and
//! moved to the load device. Resident copies and streamed fetches both come from
//! [`ModelPatcher::materialize`], so they hold the same bits.

use candle_core::Tensor;

use super::{ModelPatcher, WEIGHT_SCALE_SUFFIX};
use crate::error::{Error, Result};
use crate::float::{self, Dtype, Rounding};
use crate::patcher::adapters::{self, PatchEntry};
use crate::vram::DeviceId;
use crate::weights::SlotResidency;

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
        let w = float::to_f32(&slot.clean()?, slot.dtype())?;
        self.patch_f32(index, &w)
    }

    /// Applies weight `index`'s patches to its f32 value `w` (in stored units: a per-tensor scale
    /// is applied before the patches and removed after them).
    fn patch_f32(&self, index: usize, w: &Tensor) -> Result<Tensor> {
        let slot = &self.model.slots()[index];
        let entries = self.patches.get(slot.name());
        if entries.is_empty() {
            return Ok(w.clone());
        }
        let chain: Vec<PatchEntry> = entries.iter().map(|e| e.entry.clone()).collect();
        let scale = self.weight_scale(index)?;
        let mut w = w.clone();
        if let Some(s) = scale {
            // Patches act on the weight the layer computes with: decoded × scale.
            w = w
                .affine(f64::from(s), 0.0)
                .map_err(|e| Error::tensor(format!("`{}`: applying its scale", slot.name()), e))?;
        }
        let mut patched = adapters::apply(slot.name(), &w, &chain, self.options.dora)?;
        if let Some(s) = scale {
            patched = (patched / f64::from(s))
                .map_err(|e| Error::tensor(format!("`{}`: removing its scale", slot.name()), e))?;
        }
        Ok(patched)
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
        let w = float::to_f32(clean, slot.dtype())?;
        let patched = self.patch_f32(index, &w)?;
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
        let (host, cast_after_copy) = self.host_part(index, clean, dtype, device)?;
        if device.is_cpu() {
            return Ok(host);
        }
        let dev = device.to_candle()?;
        let moved = host
            .to_device(&dev)
            .map_err(|e| Error::tensor(format!("`{}`: copying to {device}", slot.name()), e))?;
        match cast_after_copy {
            Some(to) => cast_weight(&moved, slot.dtype(), to),
            None => Ok(moved),
        }
    }

    /// The host side of materializing weight `index` for `device`: the patched weight, and
    /// whether the cast to `dtype` is left for after the copy. For a GPU, a cast that widens
    /// exactly ([`Dtype::widens_exactly_to`]: bf16/f16/fp8 → f32, fp8 → bf16/f16) runs on the
    /// device after the copy — fewer bytes cross the bus, and an exact cast gives the same bits
    /// wherever it runs; every other cast runs here. The transfer lanes copy what this returns.
    pub(crate) fn host_part(
        &self,
        index: usize,
        clean: &Tensor,
        dtype: Dtype,
        device: DeviceId,
    ) -> Result<(Tensor, Option<Dtype>)> {
        let slot = &self.model.slots()[index];
        let stored = self.patched_storage_from(index, clean)?;
        if !device.is_cpu() && slot.dtype().widens_exactly_to(dtype) {
            return Ok((stored, Some(dtype)));
        }
        Ok((cast_weight(&stored, slot.dtype(), dtype)?, None))
    }

    /// The resident copy of weight `index` when it is current for this patcher on its load
    /// device.
    pub fn resident_tensor(&self, index: usize) -> Option<Tensor> {
        let fp = self.fingerprint(index);
        match self.model.state().slots().get(index)? {
            SlotResidency::Resident {
                tensor,
                fingerprint,
                device,
                ..
            } if *fingerprint == fp && *device == self.load_device => Some(tensor.clone()),
            _ => None,
        }
    }

    /// The weight `key` ready for compute on the load device, in the resident dtype: the resident
    /// copy when it is current, else fetched from the host and patched now (streamed). The second
    /// value says whether it streamed. Records first-forward order.
    pub fn fetch(&self, key: &str) -> Result<(Tensor, bool)> {
        let index = self.index_of(key)?;
        self.model.record_use(index);
        let fp = self.fingerprint(index);
        if let SlotResidency::Resident {
            tensor,
            fingerprint,
            device,
            ..
        } = &self.model.state().slots()[index]
        {
            if *fingerprint == fp && *device == self.load_device {
                return Ok((tensor.clone(), false));
            }
        }
        if self.model.stream_hook().is_none() {
            self.model.note_use_without_load(self.load_device);
        }
        let t = self.materialize(index, self.resident_dtype(index), self.load_device)?;
        Ok((t, true))
    }
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
