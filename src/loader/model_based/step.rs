//! One operation of a case, applied to the manager and to the reference model.

use super::*;

impl World {
    pub(super) fn step(&mut self, step: usize, op: &Op) -> Result<(), TestCaseError> {
        let ctx = || format!("step {step}: {op:?}");
        match op {
            Op::New { slot, model } => {
                // A new handle on the model, or — once every handle on it is gone — a model read
                // anew (a new id).
                let arc = match self.live(*model) {
                    Some(arc) => arc,
                    None => {
                        let arc = Arc::new(self.read(*model));
                        self.models[*model] = Arc::downgrade(&arc);
                        self.ids[*model] = arc.id();
                        self.checksums[*model] = arc.clean_checksum().unwrap();
                        arc
                    }
                };
                let device = self.devices[*model];
                self.set_slot(
                    *slot,
                    Some((
                        patcher_for(arc, *model, device, self.split, self.auto, self.host_key()),
                        *model,
                    )),
                );
            }
            Op::Clone { from, to } => {
                if let Some((p, m)) = self.patcher(*from) {
                    self.set_slot(*to, Some((p.clone(), m)));
                }
            }
            Op::Patch {
                slot,
                layer,
                rank,
                seed,
                strength,
                bad,
            } => {
                let Some((mut p, m)) = self.patcher(*slot) else {
                    return Ok(());
                };
                let Some((key, out, inn)) = self.layer_weight(m, *layer, *seed) else {
                    return Ok(());
                };
                let down_in = if matches!(bad, Bad::Shape) {
                    inn + 1
                } else {
                    inn
                };
                let mut up = weight(&[out, *rank], *seed);
                if matches!(bad, Bad::NanTensor) {
                    up = (up * f64::NAN).unwrap();
                }
                let lora = Lora::new(up, weight(&[*rank, down_in], seed.wrapping_add(1)));
                let s = if matches!(bad, Bad::NanStrength) {
                    f32::NAN
                } else {
                    *strength
                };
                let before = self.snapshot();
                let r = p.add_patches([(key, Patch::Lora(lora))], s, 1.0);
                match bad {
                    Bad::None => {
                        prop_assert!(r.is_ok(), "{}: {:?}", ctx(), r);
                        self.slots[*slot] = Some((p, m));
                    }
                    _ => {
                        prop_assert!(r.is_err(), "{}: a bad patch was accepted", ctx());
                        // The handle in the slot is unchanged; the local copy is dropped.
                        drop(p);
                        prop_assert_eq!(
                            self.snapshot(),
                            before,
                            "{}: a refused patch changed something",
                            ctx()
                        );
                    }
                }
            }
            Op::Pin { slot, layer } => {
                if let Some((p, m)) = self.patcher(*slot) {
                    if let Some((key, _, _)) = self.layer_weight(m, *layer, *layer as u64) {
                        p.pin_weight_to_device(&key).unwrap();
                    }
                }
            }
            Op::UnpinAll { slot } => {
                if let Some((p, _)) = self.patcher(*slot) {
                    p.unpin_all_weights();
                }
            }
            Op::Load {
                slots,
                mem_kib,
                full,
                fpw,
                min_kib,
                fault,
            } => {
                let req: Vec<ModelPatcher> = slots
                    .iter()
                    .filter_map(|&s| self.patcher(s))
                    .map(|(p, _)| p)
                    .collect();
                if req.is_empty() {
                    return Ok(());
                }
                let options = LoadOptions {
                    memory_required: ByteSize::kib(*mem_kib),
                    minimum_memory_required: min_kib.map(ByteSize::kib),
                    force_full_load: *full,
                    force_patch_weights: *fpw,
                    input_shape: None,
                };
                // A load first drops entries nobody holds, whatever happens next.
                self.cleanup();
                let before = self.snapshot_after_cleanup();
                let plan = self.mm.plan(&req, options);
                if let Some(k) = fault {
                    self.arm(*k);
                }
                let r = self.mm.load_models_gpu(&req, options);
                self.disarm();
                match r {
                    Ok(report) => {
                        let plan = plan.unwrap();
                        prop_assert!(
                            plan.fits(),
                            "{}: a load succeeded that its plan said does not fit: {:?}",
                            ctx(),
                            plan.problem
                        );
                        let mut all: Vec<u64> = Vec::new();
                        for p in &req {
                            if !all.contains(&p.model().id()) {
                                all.push(p.model().id());
                            }
                        }
                        for e in &report.evicted {
                            prop_assert!(
                                !all.contains(&e.model_id),
                                "{}: evicted a model being loaded",
                                ctx()
                            );
                            prop_assert!(
                                !self.kept.iter().any(|k| k.1 == e.model_id),
                                "{}: evicted a kept model",
                                ctx()
                            );
                        }
                        let gone: Vec<u64> = report
                            .evicted
                            .iter()
                            .filter(|e| e.fully)
                            .map(|e| e.model_id)
                            .collect();
                        self.registry
                            .retain(|id| !all.contains(id) && !gone.contains(id));
                        for id in all {
                            self.registry.insert(0, id);
                        }
                        if fault.is_none() {
                            prop_assert_eq!(
                                &report.evicted,
                                &plan.evictions,
                                "{}: plan and load disagree",
                                ctx()
                            );
                            // Placement: the load went where the plan said, and the patchers
                            // now say so.
                            for (planned, loaded) in plan.models.iter().zip(&report.models) {
                                prop_assert_eq!(planned.device, loaded.device, "{}", ctx());
                            }
                            for p in &req {
                                if let Some(l) =
                                    report.models.iter().find(|l| l.name == p.model().name())
                                {
                                    prop_assert_eq!(p.load_device(), l.device, "{}", ctx());
                                }
                            }
                        }
                    }
                    Err(e) => {
                        prop_assert!(
                            fault.is_some() || plan.as_ref().map_or(true, |p| !p.fits()),
                            "{}: failed without a fault or a plan problem: {}",
                            ctx(),
                            e
                        );
                        prop_assert!(
                            !matches!(e, crate::Error::RollbackIncomplete { .. }),
                            "{}: rollback incomplete with memory to spare: {}",
                            ctx(),
                            e
                        );
                        let mut after = self.snapshot();
                        after.ledger = ByteSize::ZERO;
                        prop_assert_eq!(
                            after,
                            before,
                            "{}: failed load changed something ({})",
                            ctx(),
                            e
                        );
                    }
                }
            }
            Op::LoadOnMissingGpu { slot } => {
                let Some((p, m)) = self.patcher(*slot) else {
                    return Ok(());
                };
                let Some(arc) = self.live(m) else {
                    return Ok(());
                };
                let gpu = ModelPatcher::new(arc, DeviceId::Cuda(7), CPU);
                self.cleanup();
                let before = self.snapshot_after_cleanup();
                let r = self.mm.load_models_gpu(&[p, gpu], LoadOptions::default());
                prop_assert!(
                    matches!(r, Err(crate::Error::Device { .. })),
                    "{}: {:?}",
                    ctx(),
                    r.map(|_| ())
                );
                let mut after = self.snapshot();
                after.ledger = ByteSize::ZERO;
                prop_assert_eq!(after, before, "{}", ctx());
            }
            Op::Free { kib, keep } => {
                let keep: Vec<ModelPatcher> = keep
                    .iter()
                    .filter_map(|&s| self.patcher(s))
                    .map(|(p, _)| p)
                    .collect();
                let keep_refs: Vec<&ModelPatcher> = keep.iter().collect();
                self.cleanup();
                let ev = self.mm.free_memory(
                    ByteSize::kib(*kib),
                    self.devices[*kib as usize % 2],
                    &keep_refs,
                );
                for e in &ev {
                    prop_assert!(
                        !keep.iter().any(|p| p.model().id() == e.model_id),
                        "{}",
                        ctx()
                    );
                    prop_assert!(
                        !self.kept.iter().any(|k| k.1 == e.model_id),
                        "{}: freed a kept model",
                        ctx()
                    );
                    if e.fully {
                        self.registry.retain(|&id| id != e.model_id);
                    }
                }
            }
            Op::UnloadAll => {
                self.mm.unload_all_models();
                self.registry.clear();
            }
            Op::Cleanup => {
                self.mm.cleanup_models();
                self.cleanup();
            }
            Op::Drop { slot } => {
                self.slots[*slot] = None;
            }
            Op::Forward { slot, fault, route } => {
                let Some((p, m)) = self.patcher(*slot) else {
                    return Ok(());
                };
                let expected = self.reference_forward(&p, m, *route);
                let before = self.snapshot();
                if let Some(k) = fault {
                    self.arm(*k);
                }
                let got = self.forward(&p, m, *route);
                self.disarm();
                match got {
                    Ok(bits) => prop_assert!(bits == expected, "{}: streamed != resident", ctx()),
                    Err(e) => {
                        prop_assert!(fault.is_some(), "{}: {}", ctx(), e);
                        if self.dynamic {
                            // The weights faulted in before the failure stay (they were fine);
                            // the failed fault-in left no booking behind.
                            for &d in &self.devices {
                                prop_assert_eq!(
                                    self.mm.ledger.faulting(d),
                                    ByteSize::ZERO,
                                    "{}: a failed fault-in left its booking on {}",
                                    ctx(),
                                    d
                                );
                            }
                        } else {
                            prop_assert_eq!(
                                self.snapshot().residency,
                                before.residency,
                                "{}",
                                ctx()
                            );
                        }
                    }
                }
            }
            Op::PartialUnload { slot, kib } => {
                if let Some((p, _)) = self.patcher(*slot) {
                    p.partially_unload(p.load_device(), ByteSize::kib(*kib));
                }
            }
            Op::Reserve { device, kib } => {
                let d = *device % 2;
                let bytes = ByteSize::kib(*kib);
                let never = self.never_fits(d, bytes, ByteSize::ZERO);
                let r = self.reserve_checked(&ctx(), never, |w| {
                    w.mm.reserve_named(format!("r{step}"), w.devices[d], bytes)
                })?;
                if let Some(r) = r {
                    self.reservations.push((r, d, bytes));
                }
            }
            Op::Grow { r, kib } => {
                if self.reservations.is_empty() {
                    return Ok(());
                }
                let i = *r % self.reservations.len();
                let bytes = ByteSize::kib(*kib);
                let mut taken = self.reservations.remove(i);
                let never = self.never_fits(taken.1, bytes, taken.2);
                let grown = self.reserve_checked(&ctx(), never, |w| taken.0.grow(&w.mm, bytes))?;
                if grown.is_some() {
                    taken.2 = taken.2.saturating_add(bytes);
                }
                prop_assert_eq!(taken.0.bytes(), taken.2, "{}: reservation size", ctx());
                self.reservations.insert(i, taken);
            }
            Op::Shrink { r, kib } => {
                if self.reservations.is_empty() {
                    return Ok(());
                }
                let i = *r % self.reservations.len();
                let res = &mut self.reservations[i];
                res.0.shrink(ByteSize::kib(*kib));
                res.2 = res.2.saturating_sub(ByteSize::kib(*kib));
            }
            Op::Unreserve { r } => {
                if !self.reservations.is_empty() {
                    let i = *r % self.reservations.len();
                    self.reservations.remove(i);
                }
            }
            Op::Keep { slot } => {
                if let Some((p, _)) = self.patcher(*slot) {
                    let id = p.model().id();
                    self.kept.push((self.mm.keep(&p), id));
                }
            }
            Op::Unkeep => {
                if !self.kept.is_empty() {
                    self.kept.remove(0);
                }
            }
            Op::ForwardBeside {
                slot,
                route,
                at,
                beside,
            } => self.forward_beside(step, *slot, *route, *at, beside)?,
        }
        Ok(())
    }

    /// A forward on another thread, paused at a fetch between its booking and its commit while
    /// `beside` runs on this one: what a node graph's second thread can do at that moment.
    fn forward_beside(
        &mut self,
        step: usize,
        slot: usize,
        route: u64,
        at: u64,
        beside: &Beside,
    ) -> Result<(), TestCaseError> {
        let ctx = || format!("step {step}: forward beside {beside:?} at fetch {at}");
        let Some((p, m)) = self.patcher(slot) else {
            return Ok(());
        };
        let expected = self.reference_forward(&p, m, route);
        let moe = self.is_moe(m);
        let panics = matches!(beside, Beside::Panic);
        let (paused_tx, paused) = std::sync::mpsc::channel::<()>();
        let (release, release_rx) = std::sync::mpsc::channel::<()>();
        let forward = std::thread::spawn(move || {
            fault::at_fetch(at, move || {
                if panics {
                    panic!("injected: a kernel panics during a fetch");
                }
                let _ = paused_tx.send(());
                // Bounded: a call here that waits for this fetch's booking gets it back.
                let _ = release_rx.recv_timeout(std::time::Duration::from_secs(2));
            });
            let got = if moe {
                moe_forward(&p, route)
            } else {
                forward(&p, m)
            };
            fault::clear_at_fetch();
            got
        });
        if paused.recv().is_ok() {
            let ops: Vec<Op> = match beside {
                Beside::UnloadAll => vec![Op::UnloadAll],
                Beside::Cleanup => vec![Op::Cleanup],
                Beside::Free { kib } => vec![Op::Free {
                    kib: *kib,
                    keep: Vec::new(),
                }],
                Beside::PartialUnload { slot, kib } => vec![Op::PartialUnload {
                    slot: *slot,
                    kib: *kib,
                }],
                Beside::DropAll => (0..SLOTS).map(|slot| Op::Drop { slot }).collect(),
                Beside::Load { slot, mem_kib } => vec![Op::Load {
                    slots: vec![*slot],
                    mem_kib: *mem_kib,
                    full: false,
                    fpw: false,
                    min_kib: None,
                    fault: None,
                }],
                Beside::Reserve { kib } => vec![Op::Reserve {
                    device: 0,
                    kib: *kib,
                }],
                Beside::Panic => Vec::new(),
            };
            let run = ops.iter().try_for_each(|op| self.step(step, op));
            let _ = release.send(());
            let joined = forward.join();
            run?;
            match joined {
                Ok(Ok(bits)) => prop_assert!(bits == expected, "{}: streamed != resident", ctx()),
                Ok(Err(e)) => prop_assert!(false, "{}: the forward failed: {}", ctx(), e),
                Err(_) => prop_assert!(false, "{}: the forward panicked", ctx()),
            }
        } else {
            // The forward fetched fewer weights than `at`, or the fetch panicked.
            match forward.join() {
                Ok(Ok(bits)) => prop_assert!(bits == expected, "{}: streamed != resident", ctx()),
                Ok(Err(e)) => prop_assert!(false, "{}: the forward failed: {}", ctx(), e),
                Err(_) => prop_assert!(panics, "{}: the forward panicked", ctx()),
            }
        }
        // A panic unwound through a fetch: its booking came back.
        if panics {
            self.settle();
            for &d in &self.devices {
                prop_assert_eq!(
                    self.mm.ledger.faulting(d),
                    ByteSize::ZERO,
                    "{}: a panicking fetch left its booking on {}",
                    ctx(),
                    d
                );
            }
        }
        Ok(())
    }
}
