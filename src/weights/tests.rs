use super::*;
use proptest::prelude::*;

fn resident(device: DeviceId, bytes: u64) -> SlotResidency {
    SlotResidency::Resident {
        tensor: ResidentWeight::Dense(
            Tensor::zeros(1, candle_core::DType::U8, &candle_core::Device::Cpu).unwrap(),
        ),
        fingerprint: 0,
        device,
        bytes: ByteSize(bytes),
    }
}

#[test]
fn an_eager_model_pins_through_one_tier_and_unpins_on_gpu_residency_and_drop() {
    let locker = crate::device::SimGpu::new(0, crate::device::SimSpec::new(ByteSize::gib(1)));
    let gpu = Some(crate::device::Gpu::Sim(Arc::clone(&locker)));
    let tier = HostTier::with_pinning(None, ByteSize::mib(8), gpu.clone());
    let other = HostTier::with_pinning(None, ByteSize::mib(8), gpu);
    let mib = |v: f32| Tensor::full(v, 1 << 18, &candle_core::Device::Cpu).unwrap();
    let model = Model::from_tensors("m", [("a", mib(1.0)), ("b", mib(2.0))]).unwrap();
    let (a, b) = (model.clean("a").unwrap(), model.clean("b").unwrap());
    assert!(model.pin_clean(0, &tier, &a).is_some());
    assert!(model.host_tier().is_some_and(|t| t.same(&tier)));
    assert!(
        model.pin_clean(1, &other, &b).is_none(),
        "one tier per model"
    );
    assert_eq!(
        (tier.pinned(), locker.registered_host().len()),
        (ByteSize::mib(1), 1)
    );
    // A weight resident on a GPU is never pinned, and one that becomes resident is unpinned.
    model.state_mut().set(1, resident(DeviceId::Cuda(0), 4));
    assert!(model.pin_clean(1, &tier, &b).is_none());
    model.state_mut().set(0, resident(DeviceId::Cuda(0), 4));
    assert_eq!(
        (tier.pinned(), locker.registered_host().len()),
        (ByteSize::ZERO, 0)
    );
    model.state_mut().set(0, SlotResidency::Offloaded);
    assert!(model.pin_clean(0, &tier, &a).is_some());
    // The bits are untouched, and dropping the model unpins.
    assert_eq!(a.sum_all().unwrap().to_scalar::<f32>().unwrap(), 262144.0);
    drop(model);
    assert_eq!(
        (tier.pinned(), locker.registered_host().len()),
        (ByteSize::ZERO, 0)
    );
}

proptest! {
    /// The running totals always equal the sum over the slots, whatever the sequence of
    /// loads, replacements and offloads (zero-byte weights included).
    #[test]
    fn running_totals_match_the_slots(
        ops in prop::collection::vec((0usize..6, 0u8..3, 0u64..5000), 1..64)
    ) {
        let devices = [DeviceId::Cpu, DeviceId::Cuda(0)];
        let mut r = Residency::new(6);
        for (i, what, bytes) in ops {
            let new = match what {
                0 => SlotResidency::Offloaded,
                d => resident(devices[d as usize - 1], bytes),
            };
            r.set(i, new);
            for d in devices {
                let sum: u64 = r
                    .slots()
                    .iter()
                    .filter_map(|s| match s {
                        SlotResidency::Resident { device, bytes, .. } if *device == d => {
                            Some(bytes.bytes())
                        }
                        _ => None,
                    })
                    .sum();
                prop_assert_eq!(r.bytes_on(d), ByteSize(sum));
                let holds = r.slots().iter().any(
                    |s| matches!(s, SlotResidency::Resident { device, .. } if *device == d),
                );
                prop_assert_eq!(r.devices().contains(&d), holds);
            }
            prop_assert_eq!(
                r.bytes_total(),
                r.bytes_on(DeviceId::Cpu).saturating_add(r.bytes_on(DeviceId::Cuda(0)))
            );
        }
    }
}

#[test]
fn the_last_forward_order_follows_the_last_forward_not_the_first_uses() {
    let t = || Tensor::zeros(4, candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
    let m = Model::from_tensors("moe", (0..5).map(|i| (format!("w{i}"), t()))).unwrap();
    assert_eq!(m.last_forward_order(), None, "no forward yet");
    // A prompt routes to experts 1, 2 and 3; decode steps only to 3 (and 4 once).
    let forward = |uses: &[usize]| {
        for &i in uses {
            m.record_use(i);
        }
        m.finish_forward();
    };
    forward(&[0, 1, 2, 3]);
    assert_eq!(m.last_forward_order(), Some(vec![0, 1, 2, 3]));
    forward(&[0, 3, 4]);
    assert_eq!(m.last_forward_order(), Some(vec![0, 3, 4]));
    forward(&[0, 3]);
    // Walking 3's successor comes back to the start: the next forward.
    assert_eq!(m.last_forward_order(), Some(vec![0, 3]));
    assert_eq!(m.forward_order().0, vec![0, 1, 2, 3], "first uses kept");
}
