//! Timing helpers shared by the benches: criterion measures, and the same batches are kept so a
//! bench can print its figure next to its limit as a ratio.

use std::collections::BTreeMap;
use std::hint::black_box;
use std::sync::Mutex;
use std::time::Instant;

use criterion::Bencher;

/// Seconds per iteration of every `iter_custom` batch, by benchmark name.
static TIMES: Mutex<BTreeMap<String, Vec<f64>>> = Mutex::new(BTreeMap::new());

/// Runs `f` under criterion and records each batch's time per iteration under `name`.
#[allow(dead_code)]
pub fn timed<O>(b: &mut Bencher, name: &str, mut f: impl FnMut() -> O) {
    b.iter_custom(|iters| {
        let start = Instant::now();
        for _ in 0..iters {
            black_box(f());
        }
        let d = start.elapsed();
        record(name, d, iters);
        d
    });
}

/// As [`timed`], with `setup` run untimed before each call of `f`.
#[allow(dead_code)]
pub fn timed_after<O>(
    b: &mut Bencher,
    name: &str,
    mut setup: impl FnMut(),
    mut f: impl FnMut() -> O,
) {
    b.iter_custom(|iters| {
        let mut d = std::time::Duration::ZERO;
        for _ in 0..iters {
            setup();
            let start = Instant::now();
            black_box(f());
            d += start.elapsed();
        }
        record(name, d, iters);
        d
    });
}

/// Records one batch of `iters` calls that took `d` under `name`.
fn record(name: &str, d: std::time::Duration, iters: u64) {
    if let Ok(mut t) = TIMES.lock() {
        t.entry(name.to_string())
            .or_default()
            .push(d.as_secs_f64() / iters as f64);
    }
}

/// The median recorded seconds per iteration of `name` (NaN when nothing was recorded).
#[allow(dead_code)]
pub fn median_secs(name: &str) -> f64 {
    let t = TIMES.lock().map(|t| t.get(name).cloned()).ok().flatten();
    let mut v = t.unwrap_or_default();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// A fresh directory for a bench's files under `RESIDENCY_BENCH_DIR` (default: the temp dir),
/// or `None` (said on stderr) when it cannot be made.
#[allow(dead_code)]
pub fn bench_dir() -> Option<tempfile::TempDir> {
    let root = std::env::var_os("RESIDENCY_BENCH_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    match tempfile::tempdir_in(&root) {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("cannot create a directory in {}: {e}", root.display());
            None
        }
    }
}
