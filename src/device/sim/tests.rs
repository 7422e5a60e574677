use std::sync::mpsc;
use std::time::Duration;

use candle_core::{DType, Shape};

use super::*;
use crate::device::{DeviceBuffer, Gpu, Stream};

fn gpu(capacity: ByteSize) -> Arc<SimGpu> {
    SimGpu::new(0, SimSpec::new(capacity))
}

/// Holds `stream`'s worker until the returned sender is dropped or sent to.
fn gate(stream: &SimStream) -> mpsc::Sender<()> {
    let (tx, rx) = mpsc::channel::<()>();
    stream.launch(move || {
        let _ = rx.recv();
    });
    tx
}

fn bytes_of(t: &candle_core::Tensor) -> Vec<u8> {
    t.flatten_all().unwrap().to_vec1::<u8>().unwrap()
}

fn buffer(stream: &SimStream, len: usize) -> SimBuffer {
    stream.alloc(DType::U8, len).unwrap()
}

fn take(buf: SimBuffer, len: usize) -> Vec<u8> {
    bytes_of(&buf.into_tensor(&Shape::from(len)).unwrap())
}

/// Enqueues a copy of 4 KiB of ones behind a held stream, overwrites the source with twos, then
/// lets the copy run: what the device buffer got shows when the copy read its source.
fn copy_then_overwrite(locked: bool) -> Vec<u8> {
    let g = gpu(ByteSize::mib(1));
    let s = g.new_stream().unwrap();
    let mut host = vec![1u8; 4096];
    if locked {
        g.register_host(host.as_ptr() as usize, host.len()).unwrap();
    }
    let open = gate(&s);
    let mut dst = buffer(&s, 4096);
    // SAFETY: `host` stays allocated until the stream is synchronized (and, when registered, is
    // unregistered only after); it is written below on purpose, to observe when the copy reads.
    unsafe { s.copy_htod(&host, &mut dst) }.unwrap();
    host.fill(2);
    drop(open);
    s.synchronize().unwrap();
    if locked {
        g.unregister_host(host.as_ptr() as usize).unwrap();
    }
    assert!(g.check().is_ok());
    take(dst, 4096)
}

#[test]
fn a_copy_from_locked_memory_reads_its_source_when_it_executes() {
    assert_eq!(
        copy_then_overwrite(true),
        vec![2u8; 4096],
        "read when executed"
    );
}

#[test]
fn a_copy_from_pageable_memory_reads_its_source_before_returning() {
    assert_eq!(
        copy_then_overwrite(false),
        vec![1u8; 4096],
        "staged at the call"
    );
}

#[test]
fn an_event_keeps_only_its_latest_recording() {
    let g = gpu(ByteSize::mib(1));
    let (a, b) = (g.new_stream().unwrap(), g.new_stream().unwrap());
    let open = gate(&a);
    let e = a.record_event().unwrap();
    assert!(!e.is_complete(), "stream a is held");
    e.record(&b).unwrap();
    b.synchronize().unwrap();
    assert!(e.is_complete(), "only the recording on b counts now");
    e.synchronize(); // returns although a's work is still held
    drop(open);
    a.synchronize().unwrap();
}

#[test]
fn a_stream_waits_for_an_event_recorded_on_another() {
    let g = gpu(ByteSize::mib(1));
    let (a, b) = (g.new_stream().unwrap(), g.new_stream().unwrap());
    let open = gate(&a);
    let e = a.record_event().unwrap();
    b.wait(&e).unwrap();
    let after = b.record_event().unwrap();
    std::thread::sleep(Duration::from_millis(20));
    assert!(!after.is_complete(), "b waits for a");
    drop(open);
    after.synchronize();
    assert!(after.is_complete());
}

#[test]
fn recording_an_event_on_another_device_is_an_error() {
    let (g0, g1) = (
        gpu(ByteSize::mib(1)),
        SimGpu::new(1, SimSpec::new(ByteSize::mib(1))),
    );
    let e = g0.new_stream().unwrap().record_event().unwrap();
    let err = e.record(&g1.new_stream().unwrap()).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("sim:0") && msg.contains("sim:1"), "{msg}");
}

#[test]
fn allocating_beyond_the_capacity_is_a_retryable_out_of_memory() {
    let g = gpu(ByteSize::kib(8));
    let s = g.new_stream().unwrap();
    let a = buffer(&s, 6 * 1024);
    let err = s
        .alloc(DType::F32, 1024)
        .expect_err("4 KiB more does not fit");
    assert!(err.is_retryable(), "{err}");
    assert!(matches!(err, Error::OutOfMemory { required, .. } if required == ByteSize::kib(4)));
    assert_eq!(g.used(), ByteSize::kib(6));
    drop(a);
    // The free is stream-ordered: the bytes are the device's once it executed.
    s.synchronize().unwrap();
    assert_eq!(g.used(), ByteSize::ZERO);
    let b = s.alloc(DType::F32, 1024).unwrap();
    assert_eq!((g.used(), g.peak()), (ByteSize::kib(4), ByteSize::kib(6)));
    drop(b);
}

#[test]
fn a_freed_buffer_returns_to_other_streams_only_when_its_free_executes() {
    // cudarc frees a `CudaSlice` with `cuMemFreeAsync` on its stream: the memory is the
    // device's again when the stream reaches the free. The same stream may reuse it at once
    // (stream order puts the free first); another stream may not.
    let g = gpu(ByteSize::kib(8));
    let (s, other) = (g.new_stream().unwrap(), g.new_stream().unwrap());
    let a = buffer(&s, 6 * 1024);
    let hold = gate(&s);
    drop(a);
    assert_eq!(
        g.used(),
        ByteSize::kib(6),
        "the free waits behind the held work"
    );
    let err = other
        .alloc(DType::U8, 4 * 1024)
        .expect_err("another stream cannot have memory whose free has not executed");
    assert!(err.is_retryable(), "{err}");
    let same = s
        .alloc(DType::U8, 4 * 1024)
        .expect("the freeing stream reuses its own queued free");
    assert_eq!(
        g.used(),
        ByteSize::kib(6),
        "4 KiB of the 6 reused, 2 still freeing"
    );
    drop(hold);
    s.synchronize().unwrap();
    assert_eq!(g.used(), ByteSize::kib(4));
    drop(same);
    g.synchronize().unwrap();
    assert_eq!(g.used(), ByteSize::ZERO);
    assert!(g.leaks().is_empty());
}

#[test]
fn a_device_synchronize_waits_for_every_stream_a_stream_synchronize_for_its_own() {
    let g = gpu(ByteSize::mib(1));
    let (a, b) = (g.new_stream().unwrap(), g.new_stream().unwrap());
    let hold = gate(&a);
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = Arc::clone(&done);
    a.launch(move || flag.store(true, std::sync::atomic::Ordering::SeqCst));
    // Destroyed with work queued: its work still runs, and the device waits for it.
    drop(a);
    b.synchronize().unwrap();
    assert!(
        !done.load(std::sync::atomic::Ordering::SeqCst),
        "b's synchronize waits for b only"
    );
    let release = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(30));
        drop(hold);
    });
    g.synchronize().unwrap();
    assert!(
        done.load(std::sync::atomic::Ordering::SeqCst),
        "the device synchronize waited for the destroyed stream's work"
    );
    release.join().unwrap();
}

#[test]
fn page_locking_refuses_a_range_sharing_a_page_with_a_locked_one() {
    let g = gpu(ByteSize::mib(1));
    // Two ranges of one host buffer that do not overlap but share a page.
    let host = vec![0u8; 4 * PAGE];
    let base = host.as_ptr() as usize;
    let first = base.next_multiple_of(PAGE);
    g.register_host(first, PAGE + 100).unwrap();
    let err = g
        .register_host(first + PAGE + 100, 200)
        .expect_err("the driver locks whole pages");
    assert!(err.to_string().contains("ALREADY_REGISTERED"), "{err}");
    // The next page is free.
    g.register_host(first + 2 * PAGE, 100).unwrap();
    g.unregister_host(first).unwrap();
    g.unregister_host(first + 2 * PAGE).unwrap();
    drop(host);
}

#[test]
fn a_destroyed_stream_s_handle_names_the_next_stream_made() {
    // A CUDA stream is known by its pointer, which the driver reuses: anything keyed by it must
    // keep its stream alive (see `Fences`).
    let g = gpu(ByteSize::mib(1));
    let a = g.new_stream().unwrap();
    let key = a.key();
    let b = g.new_stream().unwrap();
    assert_ne!(b.key(), key, "live streams have distinct handles");
    drop(a);
    let c = g.new_stream().unwrap();
    assert_eq!(c.key(), key, "the destroyed stream's handle is reused");
}

#[test]
fn a_default_stream_that_cannot_start_is_an_error_not_a_panic() {
    let g = gpu(ByteSize::mib(1));
    g.inject(SimFault::Stream, 0);
    let Err(err) = g.default_stream() else {
        panic!("its worker cannot start")
    };
    assert!(err.to_string().contains("creating a stream"), "{err}");
    // The next call makes it.
    assert!(g.default_stream().is_ok());
}

#[test]
fn handing_a_buffer_to_compute_before_its_copy_completed_is_reported() {
    let g = SimGpu::new(
        0,
        SimSpec::new(ByteSize::mib(1)).with_latency(Duration::from_millis(30)),
    );
    let s = g.new_stream().unwrap();
    let host = vec![7u8; 1024];
    let mut dst = buffer(&s, 1024);
    // SAFETY: pageable memory.
    unsafe { s.copy_htod(&host, &mut dst) }.unwrap();
    // No wait on an event: a bug the checker must catch.
    assert_eq!(
        take(dst, 1024),
        vec![7u8; 1024],
        "the sim still gives the right bits"
    );
    let v = g.violations();
    assert_eq!(v.len(), 1, "{v:?}");
    assert_eq!(v[0].kind, ViolationKind::ReadBeforeWritten);
}

#[test]
fn freeing_a_device_buffer_under_a_copy_on_another_stream_is_reported() {
    let g = gpu(ByteSize::mib(1));
    let (s, other) = (g.new_stream().unwrap(), g.new_stream().unwrap());
    let open = gate(&other);
    let host = vec![7u8; 1024];
    let mut dst = buffer(&s, 1024);
    // SAFETY: pageable memory.
    unsafe { other.copy_htod(&host, &mut dst) }.unwrap();
    drop(dst);
    drop(open);
    other.synchronize().unwrap();
    let v = g.violations();
    assert_eq!(v.len(), 1, "{v:?}");
    assert_eq!(v[0].kind, ViolationKind::DeviceFreedUnderWork);
}

#[test]
fn freeing_a_device_buffer_under_a_copy_on_its_own_stream_is_stream_ordered() {
    // CUDA's stream-ordered free (what cudarc's `CudaSlice` drop does on its allocating stream):
    // the free happens after the stream's queued work, so a dropped prefetch whose copy is still
    // queued is no misuse. The memory stays until the copy is done, and is then released.
    let g = gpu(ByteSize::mib(1));
    let s = g.new_stream().unwrap();
    let open = gate(&s);
    let host = vec![7u8; 1024];
    let mut dst = buffer(&s, 1024);
    // SAFETY: pageable memory.
    unsafe { s.copy_htod(&host, &mut dst) }.unwrap();
    drop(dst);
    drop(open);
    s.synchronize().unwrap();
    assert!(g.violations().is_empty(), "{:?}", g.violations());
    assert!(g.leaks().is_empty(), "{:?}", g.leaks());
}

#[test]
fn a_staging_buffer_freed_under_a_copy_is_reported_and_reads_as_poison() {
    let g = gpu(ByteSize::mib(1));
    let s = g.new_stream().unwrap();
    let mut host = g.alloc_host(1024).unwrap();
    assert!(
        host.as_slice().iter().all(|&b| b == 0),
        "zeroed at creation"
    );
    host.as_mut_slice().fill(5);
    let open = gate(&s);
    let mut dst = buffer(&s, 1024);
    // SAFETY: deliberately broken (the buffer is freed below while the copy is queued) to check
    // the checker; the sim keeps the memory alive for the copy.
    unsafe { s.copy_htod(host.as_slice(), &mut dst) }.unwrap();
    drop(host);
    drop(open);
    s.synchronize().unwrap();
    assert_eq!(
        take(dst, 1024),
        vec![0xFF; 1024],
        "a stale read shows as poison"
    );
    let v = g.violations();
    assert_eq!(v.len(), 1, "{v:?}");
    assert_eq!(v[0].kind, ViolationKind::FreedUnderCopy);
    assert!(v[0].to_string().contains("stream"), "{}", v[0]);
}

#[test]
fn a_staging_buffer_written_under_a_copy_is_reported_and_waited_for() {
    let g = gpu(ByteSize::mib(1));
    let s = g.new_stream().unwrap();
    let mut host = g.alloc_host(1024).unwrap();
    host.as_mut_slice().fill(5);
    let open = gate(&s);
    let mut dst = buffer(&s, 1024);
    // SAFETY: deliberately broken (written below while the copy is queued); the sim waits.
    unsafe { s.copy_htod(host.as_slice(), &mut dst) }.unwrap();
    let release = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(20));
        drop(open);
    });
    host.as_mut_slice().fill(6); // waits for the copy (after reporting)
    release.join().unwrap();
    s.synchronize().unwrap();
    assert_eq!(
        take(dst, 1024),
        vec![5; 1024],
        "the copy read the old bytes"
    );
    assert_eq!(g.violations()[0].kind, ViolationKind::WrittenUnderCopy);
}

#[test]
fn unlocking_under_a_queued_copy_is_reported_and_waited_for() {
    let g = gpu(ByteSize::mib(1));
    let s = g.new_stream().unwrap();
    let host = vec![3u8; 4096];
    g.register_host(host.as_ptr() as usize, host.len()).unwrap();
    let open = gate(&s);
    let mut dst = buffer(&s, 4096);
    // SAFETY: `host` outlives the copy: unregistering waits for it.
    unsafe { s.copy_htod(&host, &mut dst) }.unwrap();
    let release = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(20));
        drop(open);
    });
    g.unregister_host(host.as_ptr() as usize).unwrap();
    release.join().unwrap();
    s.synchronize().unwrap();
    assert_eq!(take(dst, 4096), vec![3u8; 4096]);
    let v = g.violations();
    assert_eq!((v.len(), v[0].kind), (1, ViolationKind::UnlockedUnderCopy));
}

#[test]
fn injected_faults_fail_the_kth_call_once() {
    let g = gpu(ByteSize::mib(1));
    let s = g.new_stream().unwrap();
    g.inject(SimFault::Alloc, 1);
    let a = s.alloc(DType::U8, 16).unwrap();
    assert!(
        s.alloc(DType::U8, 16).unwrap_err().is_retryable(),
        "the 2nd fails as OOM"
    );
    let mut b = s.alloc(DType::U8, 16).unwrap();
    g.inject(SimFault::Copy, 0);
    // SAFETY: pageable memory.
    assert!(unsafe { s.copy_htod(&[0u8; 16], &mut b) }.is_err());
    g.inject(SimFault::Record, 0);
    assert!(s.record_event().is_err());
    g.inject(SimFault::Register, 0);
    let host = [0u8; 64];
    assert!(g.register_host(host.as_ptr() as usize, 64).is_err());
    assert!(g.register_host(host.as_ptr() as usize, 64).is_ok(), "once");
    assert!(
        g.register_host(host.as_ptr() as usize + 8, 8).is_err(),
        "already registered"
    );
    g.unregister_host(host.as_ptr() as usize).unwrap();
    drop((a, b));
    assert!(g.check().is_ok());
}

#[test]
fn leaks_lists_what_is_still_allocated() {
    let g = gpu(ByteSize::mib(1));
    let s = g.new_stream().unwrap();
    let a = buffer(&s, 100);
    let h = g.alloc_host(64).unwrap();
    assert_eq!(g.leaks().len(), 2);
    drop((a, h));
    assert!(g.leaks().is_empty());
}

#[test]
fn copies_take_the_modelled_time_in_stream_order() {
    let spec = SimSpec::new(ByteSize::mib(64))
        .with_bandwidth(1e9)
        .with_latency(Duration::from_millis(2));
    assert_eq!(spec.copy_time(10_000_000), Duration::from_millis(12));
    let g = SimGpu::new(0, spec);
    let s = g.new_stream().unwrap();
    let host = vec![1u8; 10_000_000];
    g.register_host(host.as_ptr() as usize, host.len()).unwrap();
    let mut bufs: Vec<_> = (0..3).map(|_| buffer(&s, host.len())).collect();
    // Enqueuing returns while the stream is held: it never waits for the copies.
    let open = gate(&s);
    for b in &mut bufs {
        // SAFETY: `host` is registered and outlives the copies (unregistered after them).
        unsafe { s.copy_htod(&host, b) }.unwrap();
    }
    let done = s.record_event().unwrap();
    assert!(!done.is_complete());
    let t0 = std::time::Instant::now();
    drop(open);
    s.synchronize().unwrap();
    // A lower bound only (the copies sleep their modelled time, one after another).
    assert!(
        t0.elapsed() >= Duration::from_millis(36),
        "three copies of 12 ms, in order"
    );
    assert_eq!(g.stats().copies, 3);
    assert!(g.stats().copy_ns >= 36_000_000);
    g.unregister_host(host.as_ptr() as usize).unwrap();
    assert!(g.check().is_ok());
}

#[test]
fn jitter_is_seeded() {
    let spec = SimSpec::new(ByteSize::mib(1))
        .with_latency(Duration::from_millis(1))
        .with_jitter(7);
    let times = |g: Arc<SimGpu>| (0..8).map(|_| g.copy_time(0)).collect::<Vec<_>>();
    let a = times(SimGpu::new(0, spec));
    assert_eq!(a, times(SimGpu::new(0, spec)));
    assert!(a
        .iter()
        .all(|t| *t >= spec.latency && *t <= spec.latency.mul_f64(1.5)));
    assert!(a.windows(2).any(|w| w[0] != w[1]));
}

#[test]
fn specs_parse_from_flags() {
    let s: SimSpec = "64MiB@25GB/s".parse().unwrap();
    assert_eq!(s.capacity, ByteSize::mib(64));
    assert_eq!(s.bandwidth, Some(25e9));
    assert_eq!("8GiB".parse::<SimSpec>().unwrap().bandwidth, None);
    assert!(
        "8GiB@25GB".parse::<SimSpec>().is_err(),
        "a bandwidth needs /s"
    );
    assert!("lots".parse::<SimSpec>().is_err());
    let c = crate::vram::Config::from_args(["--sim-gpus", "2x1GiB@10GB/s", "--sim-gpu", "4GiB"])
        .unwrap();
    assert_eq!(c.sim_gpus.len(), 3);
    assert_eq!(c.sim_gpus[2].capacity, ByteSize::gib(4));
    assert!(crate::vram::Config::from_args(["--sim-gpus", "0x1GiB"]).is_err());
}

#[test]
fn the_interface_dispatches_to_the_sim() {
    let g = gpu(ByteSize::mib(1));
    let gpu = Gpu::Sim(Arc::clone(&g));
    let s: Stream = gpu.new_stream().unwrap();
    assert_eq!(s.device(), DeviceId::Sim(0));
    let mut dst: DeviceBuffer = s.alloc(DType::F32, 4).unwrap();
    let src = [1.0f32, 2.0, 3.0, 4.0];
    // SAFETY: pageable memory.
    unsafe { s.copy_htod(bytemuck::cast_slice(&src), &mut dst) }.unwrap();
    let e = s.record_event().unwrap();
    gpu.compute_wait(&e).unwrap();
    let t = dst.into_tensor(&Shape::from(4)).unwrap();
    assert_eq!(t.to_vec1::<f32>().unwrap(), src);
    let mut wrong = s.alloc(DType::F32, 3).unwrap();
    // SAFETY: pageable memory (and refused for its size).
    assert!(unsafe { s.copy_htod(bytemuck::cast_slice(&src), &mut wrong) }.is_err());
    assert!(g.check().is_ok());
}

#[test]
fn using_a_buffer_whose_copy_completed_but_was_never_waited_on_is_reported() {
    let g = gpu(ByteSize::mib(1));
    let s = g.new_stream().unwrap();
    let host = vec![9u8; 256];
    let mut dst = buffer(&s, 256);
    // SAFETY: pageable memory.
    unsafe { s.copy_htod(&host, &mut dst) }.unwrap();
    let e = s.record_event().unwrap();
    // The copy completes, but this thread never waits on `e` nor synchronizes the stream: on a
    // device, compute could still run ahead of it.
    while !e.is_complete() {
        std::thread::yield_now();
    }
    assert_eq!(take(dst, 256), vec![9u8; 256]);
    let v = g.violations();
    assert_eq!(v.len(), 1, "{v:?}");
    assert!(v[0].operation.contains("without waiting"), "{}", v[0]);
    // Waiting on an event recorded after the copy orders this thread after it.
    let mut again = buffer(&s, 256);
    // SAFETY: pageable memory.
    unsafe { s.copy_htod(&host, &mut again) }.unwrap();
    s.record_event().unwrap().synchronize();
    assert_eq!(take(again, 256), vec![9u8; 256]);
    assert_eq!(g.violations().len(), 1, "no new finding");
}

#[test]
fn an_event_re_recorded_elsewhere_does_not_order_a_wait_after_the_first_copy() {
    // The F1 pattern seen from the reader's side: the event's latest recording is on another
    // stream, so waiting on it says nothing about the copy on the first.
    let g = gpu(ByteSize::mib(1));
    let (a, b) = (g.new_stream().unwrap(), g.new_stream().unwrap());
    let host = vec![4u8; 256];
    let mut dst = buffer(&a, 256);
    // SAFETY: pageable memory.
    unsafe { a.copy_htod(&host, &mut dst) }.unwrap();
    let e = a.record_event().unwrap();
    a.synchronize().unwrap(); // done, but from this thread's view only via `a`
    let other = std::thread::spawn(move || {
        e.record(&b).unwrap();
        e.synchronize();
        take(dst, 256)
    });
    assert_eq!(other.join().unwrap(), vec![4u8; 256]);
    assert_eq!(g.violations().len(), 1, "{:?}", g.violations());
}

#[test]
fn page_locked_memory_of_one_simulated_gpu_is_page_locked_for_its_peers() {
    // Portable memory: a copy on sim:1 from memory sim:0 page-locked reads it when it executes,
    // and sim:0 tracks that read (unlocking under it is reported and waited for there).
    let set = [
        SimGpu::new(0, SimSpec::new(ByteSize::mib(1))),
        SimGpu::new(1, SimSpec::new(ByteSize::mib(1))),
    ];
    SimGpu::link(&set);
    let (owner, other) = (&set[0], &set[1]);
    let s = other.new_stream().unwrap();
    let mut host = vec![1u8; 4096];
    owner
        .register_host(host.as_ptr() as usize, host.len())
        .unwrap();
    let open = gate(&s);
    let mut dst = buffer(&s, 4096);
    // SAFETY: `host` outlives the copy (unregistering below waits for it); it is written on
    // purpose, to observe when the copy reads.
    unsafe { s.copy_htod(&host, &mut dst) }.unwrap();
    host.fill(2);
    let release = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(20));
        drop(open);
    });
    owner.unregister_host(host.as_ptr() as usize).unwrap();
    release.join().unwrap();
    s.synchronize().unwrap();
    assert_eq!(take(dst, 4096), vec![2u8; 4096], "read when executed");
    let v = owner.violations();
    assert_eq!(
        (v.len(), v[0].kind),
        (1, ViolationKind::UnlockedUnderCopy),
        "{v:?}"
    );
    assert!(other.check().is_ok());

    // Not linked: another GPU's page-locked memory is pageable to it (read at the call).
    let lone = SimGpu::new(2, SimSpec::new(ByteSize::mib(1)));
    let s = lone.new_stream().unwrap();
    let mut host = vec![1u8; 4096];
    owner
        .register_host(host.as_ptr() as usize, host.len())
        .unwrap();
    let open = gate(&s);
    let mut dst = buffer(&s, 4096);
    // SAFETY: as above; the copy is staged at the call.
    unsafe { s.copy_htod(&host, &mut dst) }.unwrap();
    host.fill(2);
    drop(open);
    s.synchronize().unwrap();
    owner.unregister_host(host.as_ptr() as usize).unwrap();
    assert_eq!(take(dst, 4096), vec![1u8; 4096], "staged at the call");
}

#[test]
fn fences_keep_their_streams_so_a_reused_handle_cannot_hide_a_copy() {
    // A copy (here: work) queued on stream A is fenced; A's last handle goes; a new stream would
    // get A's handle (CUDA reuses a destroyed stream's pointer). Keyed by handle alone, the
    // fences re-recorded A's event on the new stream and stopped waiting for A's work.
    let g = gpu(ByteSize::mib(1));
    let a = g.new_stream().unwrap();
    let hold = gate(&a);
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = Arc::clone(&done);
    a.launch(move || flag.store(true, std::sync::atomic::Ordering::SeqCst));
    let mut fences = crate::device::Fences::new();
    fences.record(&Stream::Sim(a.clone())).unwrap();
    let a_key = a.key();
    drop(a);
    let b = g.new_stream().unwrap();
    assert_ne!(
        b.key(),
        a_key,
        "the fenced stream is alive: its handle is not reused"
    );
    fences.record(&Stream::Sim(b)).unwrap();
    assert_eq!(fences.len(), 2);
    let release = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(30));
        drop(hold);
    });
    fences.wait_all().unwrap();
    assert!(
        done.load(std::sync::atomic::Ordering::SeqCst),
        "waiting waited for the first stream's work"
    );
    release.join().unwrap();
}

#[test]
fn a_copy_whose_record_and_stream_sync_both_fail_stays_fenced() {
    // The record failed, then the synchronize that was to wait for the copy failed too: the
    // copy was left untracked and the memory could be unlocked under it. Now the stream itself
    // is the copy's fence, and waiting synchronizes it later.
    let g = gpu(ByteSize::mib(1));
    let s = g.new_stream().unwrap();
    let hold = gate(&s);
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = Arc::clone(&done);
    s.launch(move || flag.store(true, std::sync::atomic::Ordering::SeqCst));
    g.inject(SimFault::Record, 0);
    g.inject(SimFault::Synchronize, 0);
    let mut fences = crate::device::Fences::new();
    let stream = Stream::Sim(s);
    assert!(fences.record(&stream).is_err());
    assert_eq!(fences.len(), 1, "the stream fences the unrecorded copy");
    // The injected synchronize fault is still armed: recording never waits. The first wait
    // fails (and keeps the fence); the next one waits for the work.
    assert!(fences.wait_all().is_err());
    assert_eq!(fences.len(), 1);
    let release = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(30));
        drop(hold);
    });
    fences.wait_all().unwrap();
    assert!(done.load(std::sync::atomic::Ordering::SeqCst));
    assert!(fences.is_empty());
    release.join().unwrap();
}

#[test]
fn a_copy_whose_length_is_not_its_buffers_is_an_error_naming_both_and_queues_nothing() {
    let g = gpu(ByteSize::mib(1));
    let s = g.new_stream().unwrap();
    let mut dst = buffer(&s, 32);
    let host = g.alloc_host(64).unwrap();
    let refused = |err: Error| {
        let msg = err.to_string();
        assert!(
            matches!(err, Error::Device { .. }) && msg.contains("32 B") && msg.contains("bytes"),
            "{msg}"
        );
        msg
    };
    // SAFETY: pageable memory; refused for its size.
    let msg = refused(unsafe { s.copy_htod(&[1u8; 16], &mut dst) }.unwrap_err());
    assert!(msg.contains("16"), "{msg}");
    // SAFETY: as above.
    refused(unsafe { s.copy_htod(&[1u8; 48], &mut dst) }.unwrap_err());
    // From page-locked memory a short source would be read past its end when the copy executes.
    // SAFETY: `host` outlives the synchronize below; refused for its size anyway.
    refused(unsafe { s.copy_htod(&host.as_slice()[..16], &mut dst) }.unwrap_err());
    // SAFETY: as above, and the right size.
    unsafe { s.copy_htod(&host.as_slice()[..32], &mut dst) }.unwrap();
    s.synchronize().unwrap();
    drop(host);
    assert_eq!(take(dst, 32), vec![0; 32]);
    assert!(g.violations().is_empty(), "{:?}", g.violations());
}
