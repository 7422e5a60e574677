//! The checks after every step: the snapshot a failed call must leave unchanged, and the
//! invariants (I1–I4, the host ledger, the sim's checker).

use super::*;

impl World {
    pub(super) fn snapshot(&self) -> Snapshot {
        let residency = (0..2)
            .map(|m| self.live(m).map(|model| residency_of(&model)))
            .collect();
        let pins = (0..2)
            .map(|m| self.live(m).map(|model| model.state().pinned.clone()))
            .collect();
        let patches = self
            .slots
            .iter()
            .map(|s| {
                s.as_ref().map(|(p, _)| {
                    let mut v: Patches = p
                        .patches()
                        .keys()
                        .map(|k| {
                            (
                                k.to_string(),
                                p.patches().get(k).iter().map(|e| e.id).collect(),
                            )
                        })
                        .collect();
                    v.sort();
                    v
                })
            })
            .collect();
        Snapshot {
            registry: self.mm.loaded_models().iter().map(|m| m.model_id).collect(),
            residency,
            pins,
            patches,
            // Cached casts are a cache: a failed load may have dropped them for room.
            ledger: self
                .mm
                .ledger(self.devices[0])
                .saturating_sub(self.mm.ledger.cached(self.devices[0]))
                .saturating_add(self.second_device().map_or(ByteSize::ZERO, |d| {
                    self.mm.ledger(d).saturating_sub(self.mm.ledger.cached(d))
                })),
        }
    }

    /// The snapshot a manager call that begins with a cleanup must leave on failure: entries no
    /// handle holds are gone from the registry, and with them the models themselves.
    pub(super) fn snapshot_after_cleanup(&self) -> Snapshot {
        let mut s = self.snapshot();
        s.registry.retain(|&id| self.held(id));
        for m in 0..2 {
            if !self.held(self.ids[m]) {
                s.residency[m] = None;
                s.pins[m] = None;
            }
        }
        s.ledger = ByteSize::ZERO;
        s
    }

    /// Waits until the lanes let go of every model (their prefetch jobs hold patcher clones), so
    /// that only the test's handles and the registry hold them and the reference can tell which
    /// entries a cleanup drops. Called between steps, when no other local handle exists.
    pub(super) fn settle(&self) {
        for m in 0..2 {
            self.settle_model(m);
        }
        // Frees queued on the simulated GPUs' streams run, and the bookings they return with
        // them (a dropped prefetch's comes back only then).
        for sim in &self.sims {
            let _ = sim.synchronize();
        }
    }

    pub(super) fn settle_model(&self, m: usize) {
        let registered = self.registry.contains(&self.ids[m]);
        let handles = self.slots.iter().flatten().filter(|(_, x)| *x == m).count();
        let want = usize::from(registered) + handles;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while self.models[m].strong_count() > want && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
    }

    pub(super) fn check(&self, step: usize, op: &Op) -> Result<(), TestCaseError> {
        let ctx = || format!("after step {step}: {op:?}");
        // Prepared host copies stay within their room.
        if let Some(r) = self.mm.miss_report() {
            prop_assert!(
                r.prepared.bytes <= r.prepared.limit,
                "{}: prepared host copies over their room: {}",
                ctx(),
                r.prepared
            );
        }
        // I2, counted slot by slot, per device.
        let mut resident = [ByteSize::ZERO; 2];
        let loaded = self.mm.loaded_models();
        for m in 0..2 {
            let Some(model) = self.live(m) else { continue };
            let mut on = [ByteSize::ZERO; 2];
            for i in 0..model.len() {
                if let Some(SlotResidency::Resident { device, bytes, .. }) = model.residency_of(i) {
                    let d = usize::from(Some(device) == self.second_device());
                    if self.split {
                        let key = model.slots()[i].name();
                        prop_assert_eq!(
                            device,
                            mapped_device(m, key, self.devices),
                            "{}: m{} `{}` off its mapped device",
                            ctx(),
                            m,
                            key
                        );
                        prop_assert!(
                            key != self.host_key() || m != 1,
                            "{}: a host weight is resident",
                            ctx()
                        );
                    }
                    prop_assert!(
                        device == self.devices[d],
                        "{}: m{} resident on {}",
                        ctx(),
                        m,
                        device
                    );
                    on[d] = on[d].saturating_add(bytes);
                }
            }
            // An unsplit model's copies are all on one device (a load moves it whole).
            if !(self.split && m == 1) {
                prop_assert!(
                    on[0] == ByteSize::ZERO || on[1] == ByteSize::ZERO,
                    "{}: m{} resident on both devices ({} and {})",
                    ctx(),
                    m,
                    on[0],
                    on[1]
                );
            }
            let registered = loaded.iter().any(|e| e.model_id == model.id());
            if registered {
                resident[0] = resident[0].saturating_add(on[0]);
                resident[1] = resident[1].saturating_add(on[1]);
            } else {
                prop_assert_eq!(
                    on[0].saturating_add(on[1]),
                    ByteSize::ZERO,
                    "{}: unregistered model m{} holds copies",
                    ctx(),
                    m
                );
            }
            // I1
            prop_assert_eq!(
                model.clean_checksum().unwrap(),
                self.checksums[m],
                "{}: clean weights changed",
                ctx()
            );
        }
        let devices = match self.second_device() {
            Some(d) => vec![self.devices[0], d],
            None => vec![self.devices[0]],
        };
        for (d, &device) in devices.iter().enumerate() {
            let ledger = self.mm.ledger(device);
            let reserved: ByteSize = self
                .reservations
                .iter()
                .filter(|r| self.devices[r.1] == device)
                .map(|r| r.2)
                .sum();
            prop_assert_eq!(
                self.mm.ledger.reserved(device),
                reserved,
                "{} on {}: reserved",
                ctx(),
                device
            );
            prop_assert_eq!(
                ledger,
                resident[d]
                    .saturating_add(self.mm.ledger.in_flight(device))
                    .saturating_add(self.mm.ledger.faulting(device))
                    .saturating_add(self.mm.ledger.cached(device))
                    .saturating_add(reserved),
                "{} on {}",
                ctx(),
                device
            );
            prop_assert!(
                ledger <= self.budget,
                "{}: {} ledger {} over {}",
                ctx(),
                device,
                ledger,
                self.budget
            );
            prop_assert!(
                self.mm.peak_ledger(device) <= self.budget,
                "{}: {} peak {}",
                ctx(),
                device,
                self.mm.peak_ledger(device)
            );
        }
        // The simulated GPUs' checkers: no memory used before its copy, unlocked, freed or
        // rewritten under one.
        for sim in &self.sims {
            prop_assert!(
                sim.check().is_ok(),
                "{}: {}",
                ctx(),
                sim.check().unwrap_err()
            );
        }
        let ids: Vec<u64> = loaded.iter().map(|e| e.model_id).collect();
        prop_assert_eq!(&ids, &self.registry, "{}: registry", ctx());
        // The host tier: exact, copy by copy, and within its budget at every step.
        let host = self.mm.host_tier();
        let held: ByteSize = host.held_copies().iter().map(|c| c.bytes).sum();
        prop_assert_eq!(host.ledger(), held, "{}: host ledger", ctx());
        if let Some(b) = self.host_budget {
            prop_assert!(
                host.peak() <= b,
                "{}: host peak {} over {}",
                ctx(),
                host.peak(),
                b
            );
        }
        Ok(())
    }
}
