//! Which weights of a model are resident on its load device: [`ModelPatcher::load`] plans from
//! scratch within a budget (largest first), partial loads grow and partial unloads shrink the
//! resident set, pins keep weights through partial unloads. Every change is built first and
//! committed under the model's lock, so a failed call changes nothing.

use super::{LoadOutcome, ModelPatcher};
use crate::error::Result;
use crate::patcher::selection::{self, WeightView};
use crate::size::ByteSize;
use crate::vram::DeviceId;
use crate::weights::{Fingerprint, ResidentWeight, SlotResidency};

impl ModelPatcher {
    /// Chooses resident weights on `device` from scratch within `budget`: weights are considered
    /// largest first (pinned ones before all others, and with `force_patch_weights` patched ones
    /// next) and one becomes resident while the running total plus its size stays *below* the
    /// budget; the rest stream, with their patches applied at use. `full_load` makes every weight
    /// resident. Resident copies that are already current are kept (0 bytes moved); stale ones are
    /// rebuilt; those outside the plan are dropped. On error nothing changes.
    pub fn load(
        &mut self,
        device: DeviceId,
        budget: ByteSize,
        force_patch_weights: bool,
        full_load: bool,
    ) -> Result<LoadOutcome> {
        self.load_device = device;
        self.auto_device = None;
        let views = self.weight_views(device);
        let want = selection::from_scratch(&views, budget, force_patch_weights, full_load);
        self.apply_plan(&want)
    }

    /// Makes more weights resident on the load device, largest first, while the bytes added stay
    /// below `extra`. Stale resident copies are rebuilt first (they already hold their memory).
    /// Returns the bytes added.
    pub fn partially_load(&mut self, device: DeviceId, extra: ByteSize) -> Result<ByteSize> {
        self.partially_load_outcome(device, extra)
            .map(|(added, _)| added)
    }

    /// [`ModelPatcher::partially_load`], also returning the full outcome.
    pub fn partially_load_outcome(
        &mut self,
        device: DeviceId,
        extra: ByteSize,
    ) -> Result<(ByteSize, LoadOutcome)> {
        self.partially_load_prioritized(device, extra, false)
    }

    /// [`ModelPatcher::partially_load_outcome`]; with `force_patch_weights`, weights that carry
    /// patches are considered before the others (so a LoRA clone's patched weights become
    /// resident instead of being patched at every use).
    pub fn partially_load_prioritized(
        &mut self,
        device: DeviceId,
        extra: ByteSize,
        force_patch_weights: bool,
    ) -> Result<(ByteSize, LoadOutcome)> {
        self.load_device = device;
        self.auto_device = None;
        let views = self.weight_views(device);
        let want = selection::grow(&views, extra, force_patch_weights);
        let before = self.model.resident_bytes(device);
        let out = self.apply_plan(&want)?;
        Ok((out.resident.saturating_sub(before), out))
    }

    /// Every weight as the selection rules see it for a load on `device` under this patcher.
    pub(crate) fn weight_views(&self, device: DeviceId) -> Vec<WeightView> {
        let st = self.model.state();
        let patched_any = !self.patches.is_empty();
        // A split model: each weight is viewed on its own device.
        let placed = self.device_map().is_some() && device == self.load_device();
        (0..self.model.len())
            .map(|i| {
                let (on_device, current) = match &st.slots()[i] {
                    SlotResidency::Resident {
                        device: d,
                        bytes,
                        fingerprint,
                        ..
                    } if *d
                        == if placed {
                            self.weight_device(i)
                        } else {
                            device
                        } =>
                    {
                        (Some(*bytes), *fingerprint == self.fingerprint(i))
                    }
                    _ => (None, false),
                };
                WeightView {
                    size: self.resident_size(i),
                    pinned: st.pinned[i],
                    patched: patched_any
                        && !self.patches.get(self.model.slots()[i].name()).is_empty(),
                    on_device,
                    current,
                }
            })
            .collect()
    }

    /// The current state as a [`LoadOutcome`] (nothing moved).
    pub fn load_outcome(&self) -> LoadOutcome {
        let st = self.model.state();
        let mut out = LoadOutcome {
            resident: self.devices().into_iter().map(|d| st.bytes_on(d)).sum(),
            ..LoadOutcome::default()
        };
        for i in 0..self.model.len() {
            if !self.is_current(&st.slots()[i], i) {
                out.streaming = out.streaming.saturating_add(self.resident_size(i));
                if !self.patches.get(self.model.slots()[i].name()).is_empty() {
                    out.lazy_patched += 1;
                }
            }
        }
        out.full = out.streaming == ByteSize::ZERO;
        out
    }

    /// Drops resident copies on `device`, smallest first, skipping pinned weights, and keeps going
    /// while the bytes freed are at most `bytes`. Returns the bytes freed.
    pub fn partially_unload(&self, device: DeviceId, bytes: ByteSize) -> ByteSize {
        let mut st = self.model.state_mut();
        let dropped = selection::unload(&st.resident_on(device), bytes);
        let mut freed = ByteSize::ZERO;
        for i in dropped {
            if let SlotResidency::Resident { bytes, .. } = st.set(i, SlotResidency::Offloaded) {
                freed = freed.saturating_add(bytes);
            }
        }
        if freed > ByteSize::ZERO {
            tracing::debug!(model = self.model.name(), %device, freed = freed.bytes(), "partially unloaded");
        }
        freed
    }

    /// Drops every resident copy of the model (pinned ones too). Returns the bytes freed.
    pub fn detach(&self) -> ByteSize {
        let mut st = self.model.state_mut();
        let freed = st.bytes_total();
        for i in 0..st.slots().len() {
            st.set(i, SlotResidency::Offloaded);
        }
        freed
    }

    /// Keeps weight `key` resident through partial unloads until [`ModelPatcher::unpin_all_weights`].
    pub fn pin_weight_to_device(&self, key: &str) -> Result<()> {
        let index = self
            .model
            .slot(key)
            .map(|_| self.model.index_of(key).unwrap_or(0))?;
        self.model.state_mut().pinned[index] = true;
        Ok(())
    }

    /// Releases every pin.
    pub fn unpin_all_weights(&self) {
        for p in self.model.state_mut().pinned.iter_mut() {
            *p = false;
        }
    }

    /// Makes exactly the weights in `want` resident on the load device with current fingerprints:
    /// builds every missing or stale copy first, then commits under the model lock. On error
    /// nothing has changed.
    fn apply_plan(&self, want: &[bool]) -> Result<LoadOutcome> {
        // Each weight on its own device (a split model's differ); weights mapped to the host
        // are never resident.
        let devices: Vec<DeviceId> = (0..self.model.len())
            .map(|i| self.weight_device(i))
            .collect();
        let want: Vec<bool> = want
            .iter()
            .enumerate()
            .map(|(i, &w)| w && !self.streams_always(i))
            .collect();
        // The patcher cannot change during this call, so each fingerprint is computed once.
        let fingerprints: Vec<Fingerprint> =
            (0..self.model.len()).map(|i| self.fingerprint(i)).collect();
        let current = |s: &SlotResidency, i: usize| {
            matches!(s, SlotResidency::Resident { fingerprint, device: d, .. }
                if *d == devices[i] && *fingerprint == fingerprints[i])
        };
        let snapshot: Vec<bool> = {
            let st = self.model.state();
            st.slots()
                .iter()
                .enumerate()
                .map(|(i, s)| current(s, i))
                .collect()
        };
        let mut built: Vec<(usize, ResidentWeight, Fingerprint, ByteSize)> = Vec::new();
        for (i, &w) in want.iter().enumerate() {
            if w && !snapshot[i] {
                let t = self.materialize(i, self.resident_dtype(i), devices[i])?;
                let (t, bytes) = self.resident_from(i, t, devices[i])?;
                built.push((i, t, fingerprints[i], bytes));
            }
        }
        let mut out = LoadOutcome::default();
        let mut st = self.model.state_mut();
        for (i, &w) in want.iter().enumerate() {
            if !w {
                if let SlotResidency::Resident { bytes, .. } = st.set(i, SlotResidency::Offloaded) {
                    out.freed = out.freed.saturating_add(bytes);
                }
            }
        }
        for (i, tensor, fingerprint, bytes) in built {
            out.moved = out.moved.saturating_add(bytes);
            let new = SlotResidency::Resident {
                tensor,
                fingerprint,
                device: devices[i],
                bytes,
            };
            if let SlotResidency::Resident { bytes: old, .. } = st.set(i, new) {
                out.freed = out.freed.saturating_add(old);
            }
        }
        out.resident = self.devices().into_iter().map(|d| st.bytes_on(d)).sum();
        for i in 0..self.model.len() {
            if !current(&st.slots()[i], i) {
                out.streaming = out.streaming.saturating_add(self.resident_size(i));
                if !self.patches.get(self.model.slots()[i].name()).is_empty() {
                    out.lazy_patched += 1;
                }
            }
        }
        out.full = out.streaming == ByteSize::ZERO;
        Ok(out)
    }
}
