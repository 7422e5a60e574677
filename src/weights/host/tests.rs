use super::*;
use std::sync::atomic::AtomicUsize;

fn view(model: u64, resident: bool, on_disk: u64, model_used: u64, read: u64) -> CopyView {
    CopyView {
        model,
        reading: model == 1,
        device_resident: resident,
        model_on_disk: on_disk,
        model_used_at: model_used,
        read_at: read,
    }
}

#[test]
fn eviction_order_follows_the_host_rules() {
    // Model 1 is being read.
    let copies = [
        view(1, false, 100, 50, 10), // 0: model 1, read first
        view(1, false, 100, 50, 20), // 1: model 1, read later
        view(2, false, 10, 60, 30),  // 2: model 2, almost all held
        view(2, true, 10, 60, 40),   // 3: resident on a device
        view(3, false, 100, 40, 5),  // 4: model 3, mostly on disk
        view(4, false, 100, 45, 6),  // 5: model 4, as much on disk as 3, used later
        view(1, true, 100, 50, 30),  // 6: model 1 but resident on a device
    ];
    assert_eq!(eviction_order(&copies), vec![3, 6, 4, 5, 2, 1, 0]);
}

#[test]
fn a_streamed_model_keeps_a_stable_prefix_on_the_host() {
    // Eight weights of 10 bytes, a 40-byte budget, three forwards in order: with the
    // most-recently-read rule the first three stay and are hit on every later forward.
    let tier = HostTier::new(Some(ByteSize(40)));
    tier.register_model(1, ByteSize(80));
    let reads = AtomicUsize::new(0);
    for _ in 0..3 {
        for i in 0..8 {
            tier.get(1, i, ByteSize(10), ByteSize(10), String::new, || {
                reads.fetch_add(1, Ordering::Relaxed);
                Ok(Tensor::zeros(
                    10,
                    candle_core::DType::U8,
                    &candle_core::Device::Cpu,
                )?)
            })
            .unwrap();
            assert!(tier.ledger() <= ByteSize(40));
        }
    }
    assert_eq!(reads.load(Ordering::Relaxed), 8 + 5 + 5);
    let s = tier.stats();
    assert_eq!(s.hits, 6);
    assert!(s.peak <= ByteSize(40));
    let mut held: Vec<usize> = tier.held_copies().iter().map(|c| c.index).collect();
    held.sort();
    assert_eq!(held, vec![0, 1, 2, 7]);
}

#[test]
fn a_weight_larger_than_the_budget_never_fits_and_changes_nothing() {
    let tier = HostTier::new(Some(ByteSize(16)));
    tier.register_model(1, ByteSize(100));
    let r = tier.get(
        1,
        0,
        ByteSize(17),
        ByteSize(17),
        || "m w".into(),
        || unreachable!("nothing is read"),
    );
    assert!(matches!(r, Err(Error::BudgetExceeded { .. })), "{r:?}");
    assert_eq!(tier.ledger(), ByteSize::ZERO);
}

#[test]
fn a_failed_read_books_nothing() {
    let tier = HostTier::new(Some(ByteSize(16)));
    let r = tier.get(1, 0, ByteSize(8), ByteSize(8), String::new, || {
        Err(Error::File {
            path: "x".into(),
            reason: "gone".into(),
        })
    });
    assert!(r.is_err());
    assert_eq!(tier.ledger(), ByteSize::ZERO);
    assert!(tier.held_copies().is_empty());
    assert_eq!(tier.peak(), ByteSize(8), "the read was booked while it ran");
}

/// A simulated GPU to pin for; `registered` counts what is locked.
fn sim() -> (Arc<crate::device::SimGpu>, Option<Gpu>) {
    let g = crate::device::SimGpu::new(0, crate::device::SimSpec::new(ByteSize::gib(1)));
    (Arc::clone(&g), Some(Gpu::Sim(g)))
}

fn big(n: usize, v: f32) -> Tensor {
    Tensor::full(v, n, &candle_core::Device::Cpu).unwrap()
}

/// A tensor of `n` f32 in a buffer of its own pages, as the crate reads weights (`page.rs`).
fn paged(n: usize, v: f32) -> Tensor {
    let mut buf = super::super::page::PageBuf::<f32>::zeroed(n);
    buf.as_mut_slice().fill(v);
    buf.into_tensor(&[n]).unwrap()
}

#[test]
fn pins_stay_within_the_pin_budget_and_fail_softly_beyond_it() {
    let (locker, gpu) = sim();
    let tier = HostTier::with_pinning(None, ByteSize::mib(2), gpu);
    let views: Vec<Tensor> = (0..3).map(|i| paged(256 * 1024, i as f32)).collect(); // 1 MiB each
    let (a, b, c) = (&views[0], &views[1], &views[2]);
    let pa = tier.try_pin(1, 0, a, false).expect("within budget");
    assert!(tier.try_pin(1, 1, b, false).is_some());
    assert_eq!(tier.pinned(), ByteSize::mib(2));
    assert!(tier.try_pin(1, 2, c, false).is_none(), "over budget");
    assert_eq!(
        tier.pinned(),
        ByteSize::mib(2),
        "a refused pin changes no total"
    );
    // Asking again returns the same pin.
    assert!(Arc::ptr_eq(&pa, &tier.try_pin(1, 0, a, false).unwrap()));
    drop(pa);
    // Too small to pin.
    assert!(tier.try_pin(1, 3, &big(16, 0.0), false).is_none());
    assert_eq!(locker.registered_host().len(), 2);
    assert!(
        locker
            .registered_host()
            .iter()
            .all(|&(a, l)| a % 4096 == 0 && l == 1 << 20),
        "whole pages: {:?}",
        locker.registered_host()
    );
    // Becoming resident on a GPU unpins; on the CPU it does not.
    drop(tier.note_resident(1, 1, Some(DeviceId::Cpu)));
    assert_eq!(tier.pinned(), ByteSize::mib(2));
    drop(tier.note_resident(1, 1, Some(DeviceId::Cuda(0))));
    assert_eq!(tier.pinned(), ByteSize::mib(1));
    assert_eq!(locker.registered_host().len(), 1);
    // Dropping the model unpins the rest.
    tier.forget_model(1);
    assert_eq!(tier.pinned(), ByteSize::ZERO);
    assert!(locker.registered_host().is_empty());
}

#[test]
fn weights_on_pages_of_their_own_all_pin_and_shared_pages_pin_once() {
    // Issue 45, item 19: the driver locks whole pages; weights whose buffers shared a page with a
    // pinned neighbour were refused. Buffers of 256 KiB and one element (not whole pages) each
    // lock their own whole pages, page-aligned, and every one of them pins.
    let (locker, gpu) = sim();
    let tier = HostTier::with_pinning(None, ByteSize::gib(1), gpu);
    let n = 64 * 1024 + 1;
    let weights: Vec<Tensor> = (0..16).map(|i| paged(n, i as f32)).collect();
    let page = super::super::page::page_size() as u64;
    let rounded = (n as u64 * 4).next_multiple_of(page);
    for (i, w) in weights.iter().enumerate() {
        assert!(tier.try_pin(1, i, w, false).is_some(), "weight {i}");
    }
    assert_eq!(tier.stats().pin_failures, 0);
    assert_eq!(
        tier.pinned(),
        ByteSize(16 * rounded),
        "whole pages are booked"
    );
    let ranges = locker.registered_host();
    assert_eq!(ranges.len(), 16);
    for (a, l) in &ranges {
        assert_eq!((a % page as usize, *l as u64), (0, rounded));
    }
    // A tensor made elsewhere locks its exact bytes: two views of one buffer sharing a page pin
    // once, the second is refused and staged (counted), and the first stays pinned.
    let shared = big(2 * n, 1.0);
    let (x, y) = (
        shared.narrow(0, 0, n).unwrap(),
        shared.narrow(0, n, n).unwrap(),
    );
    assert!(tier.try_pin(2, 0, &x, false).is_some());
    assert!(tier.try_pin(2, 1, &y, false).is_none());
    assert_eq!(tier.stats().pin_failures, 1);
    assert_eq!(locker.registered_host().len(), 17);
    tier.forget_model(1);
    tier.forget_model(2);
    assert!(locker.registered_host().is_empty());
}

#[test]
fn threads_streaming_one_weight_pin_it_once_and_share_the_pin() {
    // Both threads used to pass "no pin yet": the second registration was refused and its
    // copy went out from memory page-locked by the first, untracked by its fences.
    for trial in 0..60 {
        let (locker, gpu) = sim();
        let tier = HostTier::with_pinning(None, ByteSize::gib(1), gpu);
        let w = big(256 * 1024, trial as f32);
        let start = std::sync::Barrier::new(2);
        let (a, b) = std::thread::scope(|s| {
            let pin = || {
                start.wait();
                tier.try_pin(1, 0, &w, false)
            };
            let a = s.spawn(pin);
            let b = s.spawn(pin);
            (a.join().unwrap(), b.join().unwrap())
        });
        let (a, b) = (
            a.expect("pinned"),
            b.expect("the other thread's pin, shared"),
        );
        assert!(Arc::ptr_eq(&a, &b), "trial {trial}: one pin for both");
        assert_eq!(tier.stats().pin_failures, 0, "trial {trial}");
        assert_eq!(locker.registered_host().len(), 1);
        assert_eq!(tier.pinned(), ByteSize::mib(1));
    }
}

#[test]
fn a_pin_the_driver_refuses_falls_back_and_leaves_the_total_unchanged() {
    let (locker, gpu) = sim();
    locker.inject(crate::device::SimFault::Register, 0);
    let tier = HostTier::with_pinning(None, ByteSize::gib(1), gpu);
    let a = big(256 * 1024, 1.0);
    assert!(tier.try_pin(1, 0, &a, false).is_none());
    locker.inject(crate::device::SimFault::Register, 0);
    assert!(tier.try_pin(1, 0, &a, false).is_none());
    let s = tier.stats();
    assert_eq!((s.pinned, s.pin_failures), (ByteSize::ZERO, 2));
    // The tensor is untouched and usable.
    assert_eq!(a.sum_all().unwrap().to_scalar::<f32>().unwrap(), 262144.0);
    assert!(tier.try_pin(1, 0, &a, false).is_some());
}

#[test]
fn without_a_locker_nothing_is_pinned() {
    let tier = HostTier::with_pinning(None, ByteSize::gib(8), None);
    assert_eq!(tier.stats().pin_budget, ByteSize::ZERO);
    assert!(tier.try_pin(1, 0, &big(1 << 20, 1.0), false).is_none());
}

#[test]
fn evicting_a_lazy_copy_unpins_it() {
    let (locker, gpu) = sim();
    let tier = HostTier::with_pinning(Some(ByteSize::mib(1)), ByteSize::gib(1), gpu);
    tier.register_model(7, ByteSize::mib(2));
    let t = tier
        .get(
            7,
            0,
            ByteSize::mib(1),
            ByteSize::mib(1),
            String::new,
            || Ok(big(256 * 1024, 1.0)),
        )
        .unwrap();
    let pin = tier.try_pin(7, 0, &t, true).unwrap();
    drop(pin);
    assert_eq!(tier.pinned(), ByteSize::mib(1));
    // Reading the next weight evicts the first, and its pin with it.
    tier.get(
        7,
        1,
        ByteSize::mib(1),
        ByteSize::mib(1),
        String::new,
        || Ok(big(256 * 1024, 2.0)),
    )
    .unwrap();
    assert_eq!(tier.pinned(), ByteSize::ZERO);
    assert!(locker.registered_host().is_empty());
    // A pin asked for a copy that is no longer held is not made.
    assert!(tier.try_pin(7, 0, &t, true).is_none());
    assert_eq!(tier.pinned(), ByteSize::ZERO);
}

#[test]
fn the_model_being_read_takes_the_budget_from_idle_models() {
    // Model 2 (idle) holds 30 of a 40-byte budget; model 1 streams 8 weights of 10 bytes.
    let tier = HostTier::new(Some(ByteSize(40)));
    tier.register_model(1, ByteSize(80));
    tier.register_model(2, ByteSize(30));
    let zeros = || {
        Ok(Tensor::zeros(
            10,
            candle_core::DType::U8,
            &candle_core::Device::Cpu,
        )?)
    };
    for i in 0..3 {
        tier.get(2, i, ByteSize(10), ByteSize(10), String::new, zeros)
            .unwrap();
    }
    for _ in 0..2 {
        for i in 0..8 {
            tier.get(1, i, ByteSize(10), ByteSize(10), String::new, zeros)
                .unwrap();
        }
    }
    let mut held: Vec<(u64, usize)> = tier
        .held_copies()
        .iter()
        .map(|c| (c.model_id, c.index))
        .collect();
    held.sort();
    assert_eq!(held, vec![(1, 0), (1, 1), (1, 2), (1, 7)]);
    assert_eq!(tier.stats().hits, 3, "the second forward hit its prefix");
}

#[test]
fn concurrent_reads_never_pass_the_budget() {
    let tier = HostTier::new(Some(ByteSize(100)));
    tier.register_model(1, ByteSize(1000));
    std::thread::scope(|s| {
        for t in 0..4 {
            let tier = tier.clone();
            s.spawn(move || {
                for k in 0..50 {
                    let i = (t * 7 + k * 3) % 40;
                    tier.get(1, i, ByteSize(25), ByteSize(25), String::new, || {
                        std::thread::yield_now();
                        Ok(Tensor::zeros(
                            25,
                            candle_core::DType::U8,
                            &candle_core::Device::Cpu,
                        )?)
                    })
                    .unwrap();
                    assert!(tier.ledger() <= ByteSize(100));
                }
            });
        }
    });
    assert!(tier.peak() <= ByteSize(100));
    let held: ByteSize = tier.held_copies().iter().map(|c| c.bytes).sum();
    assert_eq!(held, tier.ledger());
}
