//! Host→device copy bandwidth on GPU 0, straight through cudarc: pageable vs pinned at 64 MiB and
//! 1 GiB, and how well two copy streams overlap (two host→device copies, which share one
//! direction of the bus, and a host→device next to a device→host copy, which need not).
//!
//! ```sh
//! cargo run --release --example bandwidth
//! ```
//!
//! Without a CUDA GPU it says so and exits 0. Timings come from CUDA events on the copying
//! streams (best of three), overlap from the wall time of both streams together.

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaContext, CudaStream, DriverError, PinnedHostSlice};

const MIB: usize = 1 << 20;
const REPEATS: usize = 3;

fn main() {
    residency::tools::cache_candle_thread_count();
    let args: Vec<String> = std::env::args().skip(1).collect();
    if !args.is_empty() {
        let usage = "usage: bandwidth (no flags: measures host→device copies on CUDA GPU 0; it takes no residency flags)";
        if args.iter().any(|a| a == "--help" || a == "-h") {
            println!("{usage}");
            return;
        }
        eprintln!("error: unexpected arguments {args:?}\n{usage}");
        std::process::exit(2);
    }
    if !residency::vram::cuda_driver_present() {
        println!("no CUDA GPU (no CUDA driver library on this machine); nothing to measure");
        return;
    }
    let ctx = match std::panic::catch_unwind(|| CudaContext::new(0)) {
        Ok(Ok(ctx)) => ctx,
        Ok(Err(e)) => {
            println!("no CUDA GPU (the driver reports: {e}); nothing to measure");
            return;
        }
        Err(_) => {
            println!(
                "no CUDA GPU (the CUDA driver is incompatible with cudarc); nothing to measure"
            );
            return;
        }
    };
    if let Err(e) = run(&ctx) {
        eprintln!("bandwidth: CUDA error: {e}");
        std::process::exit(1);
    }
}

fn run(ctx: &Arc<CudaContext>) -> Result<(), DriverError> {
    println!("GPU 0: {}", ctx.name()?);
    let a = ctx.new_stream()?;
    let b = ctx.new_stream()?;
    println!(
        "{:>10}  {:>14}  {:>14}",
        "size", "pageable GB/s", "pinned GB/s"
    );
    for size in [64 * MIB, 1024 * MIB] {
        let pageable = vec![1u8; size];
        let mut pinned = alloc_pinned(ctx, size)?;
        pinned.as_mut_slice()?.fill(1);
        let mut dst = a.alloc_zeros::<u8>(size)?;
        let t_pageable = best(|| timed(&a, |s| s.memcpy_htod(&pageable, &mut dst)))?;
        let t_pinned = best(|| timed(&a, |s| s.memcpy_htod(&pinned, &mut dst)))?;
        println!(
            "{:>6} MiB  {:>14.1}  {:>14.1}",
            size / MIB,
            gbps(size, t_pageable),
            gbps(size, t_pinned)
        );
    }

    // Overlap: the same two 1 GiB copies on one stream, then on two streams.
    let size = 1024 * MIB;
    let src1 = alloc_pinned(ctx, size)?;
    let src2 = alloc_pinned(ctx, size)?;
    let mut back = alloc_pinned(ctx, size)?;
    let mut d1 = a.alloc_zeros::<u8>(size)?;
    let mut d2 = a.alloc_zeros::<u8>(size)?;
    a.synchronize()?;
    let serial = best(|| {
        wall(&[&a, &b], || {
            a.memcpy_htod(&src1, &mut d1)?;
            a.memcpy_htod(&src2, &mut d2)
        })
    })?;
    let parallel = best(|| {
        wall(&[&a, &b], || {
            a.memcpy_htod(&src1, &mut d1)?;
            b.memcpy_htod(&src2, &mut d2)
        })
    })?;
    println!(
        "two 1 GiB host→device copies: one stream {:.1} ms, two streams {:.1} ms ({:.2}x; one bus direction, ~1x expected)",
        serial * 1e3,
        parallel * 1e3,
        serial / parallel
    );
    let serial = best(|| {
        wall(&[&a, &b], || {
            a.memcpy_htod(&src1, &mut d1)?;
            a.memcpy_dtoh(&d2, &mut back)
        })
    })?;
    let parallel = best(|| {
        wall(&[&a, &b], || {
            a.memcpy_htod(&src1, &mut d1)?;
            b.memcpy_dtoh(&d2, &mut back)
        })
    })?;
    println!(
        "1 GiB host→device + 1 GiB device→host: one stream {:.1} ms, two streams {:.1} ms ({:.2}x overlap; 2x is full duplex)",
        serial * 1e3,
        parallel * 1e3,
        serial / parallel
    );
    Ok(())
}

fn alloc_pinned(ctx: &Arc<CudaContext>, size: usize) -> Result<PinnedHostSlice<u8>, DriverError> {
    // SAFETY: the bytes are uninitialised; every buffer is filled or written by a copy before it
    // is read, and `u8` has no invalid values.
    unsafe { ctx.alloc_pinned::<u8>(size) }
}

/// Seconds `copy` takes on `stream`, between two timing events recorded around it.
fn timed(
    stream: &Arc<CudaStream>,
    copy: impl FnOnce(&Arc<CudaStream>) -> Result<(), DriverError>,
) -> Result<f64, DriverError> {
    let start = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    copy(stream)?;
    let end = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    Ok(f64::from(start.elapsed_ms(&end)?) / 1e3)
}

/// Wall seconds from issuing `work` until every stream in `streams` finished.
fn wall(
    streams: &[&Arc<CudaStream>],
    work: impl FnOnce() -> Result<(), DriverError>,
) -> Result<f64, DriverError> {
    for s in streams {
        s.synchronize()?;
    }
    let t0 = Instant::now();
    work()?;
    for s in streams {
        s.synchronize()?;
    }
    Ok(t0.elapsed().as_secs_f64())
}

/// The fastest of a few runs (after one warm-up).
fn best(mut f: impl FnMut() -> Result<f64, DriverError>) -> Result<f64, DriverError> {
    f()?;
    let mut best = f64::INFINITY;
    for _ in 0..REPEATS {
        best = best.min(f()?);
    }
    Ok(best)
}

fn gbps(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}
