//! Cost-aware misses (`--cost-aware-misses`, [`crate::vram::Config::cost_aware_misses`]): a
//! quantized weight that misses on a GPU and would not be kept runs where it finishes first —
//! uploaded and multiplied on the device, or multiplied on the host from its host copy, the
//! input moved instead of the weight.
//!
//! Both costs are measured while the model runs, per GGML format:
//!
//! - the host's: nanoseconds per (input row × weight byte) of candle's quantized matmul on the
//!   host (a matvec at batch 1 reads the weight once from RAM);
//! - the device's: nanoseconds per weight byte of a synchronous fetch (the link and everything
//!   around a copy: staging, pinning, the transfer; on a simulated GPU its modelled bandwidth),
//!   plus nanoseconds per (row × byte) of the matmul that follows where it ran.
//!
//! The rule, for a miss of `b` bytes on `r` input rows: run it on the host when
//! `r · b · host < b · link + r · b · device`. Before a format has both figures the first miss
//! uploads and the next one runs on the host (each side measured once), then the rule decides;
//! every run updates its figure (an exponential average, weight 1/4), and now and then the side
//! the rule did not pick runs to be measured again: at a format's 16th decision, then after
//! gaps doubling up to 256 decisions while the choice holds, back to 16 when it changes (a
//! side 25 times dearer is then paid for rarely). At decode (`r = 1`) the
//! host usually wins on a PCIe link; at prefill the device does, so one expert may run on the
//! host at decode and be uploaded at prefill.
//!
//! A quantized weight a [`crate::DeviceMap`] puts on the host ([`crate::Target::Host`]) always
//! runs on the host in this mode and is never prefetched: llama.cpp's static placement
//! (`-ot exps=CPU`, `-ncmoe N`: the first N layers' experts on the CPU, computed there).
//!
//! Residency by use keeps a missed copy only where keeping pays back
//! ([`MissCosts::worth_keeping`]: 8 later uses must save the upload), and prefetch skips weights
//! the rule would run on the host ([`MissCosts::prefers_host`]).
//!
//! A host run keeps the `QTensor` it built as a prepared host copy, within the manager's room for
//! them ([`super::PreparedBudget`]): the next run on the host skips the copy and candle's
//! re-packing of the blocks.
//!
//! This is the one mode whose outputs may depend on placement: on a real GPU the host's and the
//! device's kernels round differently (close, not equal); on the simulated GPU both are the host's
//! kernels on the same blocks, so the bits are the same as every other mode's. It is opt-in.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::quantized::GgmlDType;

use crate::costs::average;
use crate::lock::{Mutex, Rank};
use crate::size::ByteSize;

use super::prepared::{PreparedBudget, PreparedStats};

/// Where a miss runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MissRun {
    /// On the host, from the weight's host copy.
    Host,
    /// Uploaded, on the device.
    Device,
}

/// The measured figures and what the rule chose.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct MissReport {
    /// Misses run on the host.
    pub on_host: u64,
    /// Misses uploaded and run on the device.
    pub on_device: u64,
    /// Weight bytes the host runs did not copy.
    pub bytes_not_copied: u64,
    /// Picoseconds per weight byte of a synchronous fetch, as measured.
    pub link_ps_per_byte: Option<u64>,
    /// Per GGML format (its name): the host's and the device's picoseconds per (row × byte).
    pub per_format: Vec<(String, Option<u64>, Option<u64>)>,
    /// The prepared host copies the host runs are served from ([`super::PreparedBudget`]).
    pub prepared: PreparedStats,
}

impl std::fmt::Display for MissReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ns = |v: Option<u64>| {
            v.map_or_else(
                || "unmeasured".to_string(),
                |v| format!("{:.3} ns", v as f64 / 1000.0),
            )
        };
        write!(
            f,
            "cost-aware misses: {} on the host, {} uploaded ({} not copied); rule: host when rows × host < link + rows × device; link {} per byte",
            self.on_host,
            self.on_device,
            crate::size::ByteSize(self.bytes_not_copied),
            ns(self.link_ps_per_byte)
        )?;
        for (format, host, device) in &self.per_format {
            write!(
                f,
                "; {format}: host {} device {} per row·byte",
                ns(*host),
                ns(*device)
            )?;
        }
        write!(f, "; {}", self.prepared)
    }
}

#[derive(Debug, Default)]
struct Figures {
    link: Option<f64>,
    host: HashMap<GgmlDType, f64>,
    device: HashMap<GgmlDType, f64>,
    /// When each format's rule next runs the other side.
    explore: HashMap<GgmlDType, Explore>,
    on_host: u64,
    on_device: u64,
    bytes_not_copied: u64,
}

impl Figures {
    /// The rule on the figures so far: whether the host wins a miss of `bytes` of `ggml` on
    /// `rows` rows, or — while a side it needs is unmeasured — the side to run to measure it:
    /// the link first (an upload; its figure is shared by every format), then the format's host.
    /// An unmeasured device matmul counts as free.
    fn rule(&self, ggml: GgmlDType, rows: usize, bytes: u64) -> std::result::Result<bool, MissRun> {
        let link = self.link.ok_or(MissRun::Device)?;
        let host = *self.host.get(&ggml).ok_or(MissRun::Host)?;
        let device = self.device.get(&ggml).copied().unwrap_or(0.0);
        let (r, b) = (rows.max(1) as f64, bytes as f64);
        Ok(r * b * host < b * link + r * b * device)
    }
}

/// The measured costs of one manager's misses, and the rule on them (module docs).
#[derive(Debug)]
pub struct MissCosts {
    figures: Mutex<Figures>,
    prepared: Arc<PreparedBudget>,
}

impl Default for MissCosts {
    fn default() -> Self {
        MissCosts::new()
    }
}

/// The uses a kept copy is expected to serve before it is evicted, for [`MissCosts::worth_keeping`].
const KEPT_USES: f64 = 8.0;

/// The first time (in decisions of a format) the side the rule did not pick runs, and the gap
/// after a change of the rule's choice.
const EXPLORE_FIRST: u64 = 16;

/// The longest gap between two runs of the side the rule did not pick.
const EXPLORE_LONGEST: u64 = 256;

/// When a format's rule next runs the side it did not pick: at the 16th decision from its first
/// or from a change of its choice, the gap doubling at each run while the choice holds, up to 256 — a
/// side measured 16 times slower is re-measured rarely, and a change is caught within 256.
#[derive(Debug)]
struct Explore {
    decided: u64,
    next: u64,
    gap: u64,
    last: Option<bool>,
}

impl Explore {
    fn new() -> Explore {
        Explore {
            decided: 0,
            next: EXPLORE_FIRST,
            gap: EXPLORE_FIRST,
            last: None,
        }
    }

    /// Counts a decision whose rule chose the host (`host_wins`) or not; whether this one runs
    /// the other side.
    fn decide(&mut self, host_wins: bool) -> bool {
        self.decided += 1;
        if self.last.is_some_and(|l| l != host_wins) {
            // The changed decision is the first of the next 16.
            self.gap = EXPLORE_FIRST;
            self.next = self.decided + EXPLORE_FIRST - 1;
        }
        self.last = Some(host_wins);
        if self.decided < self.next {
            return false;
        }
        self.gap = (self.gap * 2).min(EXPLORE_LONGEST);
        self.next = self.decided + self.gap;
        true
    }
}

impl MissCosts {
    /// Nothing measured yet, and no room for prepared host copies.
    pub fn new() -> MissCosts {
        MissCosts::with_prepared(ByteSize::ZERO)
    }

    /// Nothing measured yet; host runs keep prepared copies within `limit` bytes
    /// ([`super::PreparedBudget`]).
    pub fn with_prepared(limit: ByteSize) -> MissCosts {
        MissCosts {
            figures: Mutex::new(Rank::MissCosts, Figures::default()),
            prepared: Arc::new(PreparedBudget::new(limit)),
        }
    }

    /// The bound the prepared host copies of every model share.
    pub fn prepared(&self) -> &Arc<PreparedBudget> {
        &self.prepared
    }

    /// Where a miss of `bytes` of format `ggml` on `rows` input rows runs.
    pub fn choose(&self, ggml: GgmlDType, rows: usize, bytes: u64) -> MissRun {
        let mut f = self.figures.lock();
        let host_wins = match f.rule(ggml, rows, bytes) {
            Ok(host_wins) => host_wins,
            Err(measure) => return measure,
        };
        let explore = f
            .explore
            .entry(ggml)
            .or_insert_with(Explore::new)
            .decide(host_wins);
        if host_wins != explore {
            MissRun::Host
        } else {
            MissRun::Device
        }
    }

    /// Whether the rule, on the figures so far, runs such a miss on the host (no exploration,
    /// nothing counted): a prefetch of a weight that would run on the host is not worth its copy.
    /// While the format's host side is the one to measure this is `true`: a weight that is
    /// always prefetched never misses, and that side would never be measured otherwise.
    pub fn prefers_host(&self, ggml: GgmlDType, rows: usize, bytes: u64) -> bool {
        matches!(
            self.figures.lock().rule(ggml, rows, bytes),
            Ok(true) | Err(MissRun::Host)
        )
    }

    /// Whether keeping a missed copy resident (residency by use's fault-in) pays back: its
    /// upload costs `b · link` once, and each later use on `rows` rows saves `rows · b · (host −
    /// device)` against running it on the host — worth it when `KEPT_USES` uses (8) save at
    /// least the upload. `false` where the host computes as fast as the device (a simulated GPU,
    /// whose device work is the host's). While a side is unmeasured: `true` until the link is
    /// measured (that first miss is uploaded anyway), then `false` until the format's host and
    /// device sides are both measured — a miss must reach the rule to run on the host, and an
    /// upload that is kept is a resident weight whose matmuls are not timed, so a copy kept at
    /// every miss would leave a side unmeasured for good and the rule never decide.
    pub fn worth_keeping(&self, ggml: GgmlDType, rows: usize) -> bool {
        let f = self.figures.lock();
        let Some(link) = f.link else {
            return true;
        };
        let (Some(&host), Some(&device)) = (f.host.get(&ggml), f.device.get(&ggml)) else {
            return false;
        };
        (host - device) * rows.max(1) as f64 * KEPT_USES >= link
    }

    /// Whether format `ggml`'s host side has a figure.
    pub fn host_measured(&self, ggml: GgmlDType) -> bool {
        self.figures.lock().host.contains_key(&ggml)
    }

    /// A miss ran on the host in `ns`; `None`: its time is not what the next run costs (a first
    /// run on a prepared copy just built, which candle re-packs), so only the run is counted.
    pub fn note_host(&self, ggml: GgmlDType, rows: usize, bytes: u64, ns: Option<u64>) {
        let mut f = self.figures.lock();
        if let Some(ns) = ns {
            let per = ns as f64 / (rows.max(1) as f64 * bytes.max(1) as f64);
            let v = average(f.host.get(&ggml).copied(), per);
            f.host.insert(ggml, v);
        }
        f.on_host += 1;
        f.bytes_not_copied += bytes;
    }

    /// A miss of `bytes` was fetched to the device in `ns`.
    pub fn note_fetch(&self, bytes: u64, ns: u64) {
        let mut f = self.figures.lock();
        f.link = Some(average(f.link, ns as f64 / bytes.max(1) as f64));
        f.on_device += 1;
    }

    /// The device's matmul on a fetched miss took `ns` (as the host thread saw it).
    pub fn note_device(&self, ggml: GgmlDType, rows: usize, bytes: u64, ns: u64) {
        let mut f = self.figures.lock();
        let per = ns as f64 / (rows.max(1) as f64 * bytes.max(1) as f64);
        let v = average(f.device.get(&ggml).copied(), per);
        f.device.insert(ggml, v);
    }

    /// The figures and counts so far.
    pub fn report(&self) -> MissReport {
        let ps = |v: Option<f64>| v.map(|v| (v * 1000.0).round() as u64);
        let f = self.figures.lock();
        let mut formats: Vec<GgmlDType> = f.host.keys().chain(f.device.keys()).copied().collect();
        formats.sort_by_key(|g| format!("{g:?}"));
        formats.dedup();
        MissReport {
            on_host: f.on_host,
            on_device: f.on_device,
            bytes_not_copied: f.bytes_not_copied,
            link_ps_per_byte: ps(f.link),
            per_format: formats
                .into_iter()
                .map(|g| {
                    let host = ps(f.host.get(&g).copied());
                    (format!("{g:?}"), host, ps(f.device.get(&g).copied()))
                })
                .collect(),
            prepared: self.prepared.stats(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_side_is_measured_once_then_the_cheaper_one_runs_and_batch_moves_the_choice() {
        let c = MissCosts::new();
        let q = GgmlDType::Q4K;
        assert_eq!(c.choose(q, 1, 1000), MissRun::Device, "the link first");
        c.note_fetch(1000, 2000); // 2 ns per byte
        assert_eq!(c.choose(q, 1, 1000), MissRun::Host, "then the host");
        c.note_host(q, 1, 1000, Some(500)); // 0.5 ns per row·byte
        c.note_device(q, 1, 1000, 10); // 0.01
                                       // Decode: 0.5 < 2 + 0.01, the host; prefill of 64 rows: 32 > 2 + 0.64, the device.
        assert_eq!(c.choose(q, 1, 1000), MissRun::Host);
        assert_eq!(c.choose(q, 64, 1000), MissRun::Device);
        // Another format: its host side is unmeasured, so the host runs once.
        assert_eq!(c.choose(GgmlDType::Q8_0, 64, 1000), MissRun::Host);
        // A host as slow per row as the device's matmul never wins (the sim's case is the
        // other way round: its device work is the host's).
        c.note_host(GgmlDType::Q8_0, 1, 1000, Some(1_000_000));
        assert_eq!(c.choose(GgmlDType::Q8_0, 1, 1000), MissRun::Device);
        // Keeping pays back where 8 uses save the upload: Q4K's host 0.5 against the device's
        // 0.01 saves 3.9 per byte over 8 uses, more than the 2 of the link.
        assert!(c.worth_keeping(q, 1));
        // A host about as fast as the device (the simulated GPU's case): 8 × 0.05 < 2 at one
        // row, 8 × 8 × 0.05 ≥ 2 at eight.
        let sim = MissCosts::new();
        assert!(
            sim.worth_keeping(q, 1),
            "nothing measured: the upload measures the link"
        );
        sim.note_fetch(1000, 2000);
        assert!(
            !sim.worth_keeping(q, 1),
            "the host side next, by a run on the host"
        );
        sim.note_host(q, 1, 1000, Some(500));
        assert!(
            !sim.worth_keeping(q, 1),
            "the device side unmeasured: not yet"
        );
        sim.note_device(q, 1, 1000, 450);
        assert!(!sim.worth_keeping(q, 1));
        assert!(sim.worth_keeping(q, 8));
        let r = c.report();
        assert_eq!((r.on_host, r.on_device, r.bytes_not_copied), (2, 1, 2000));
        assert_eq!(r.link_ps_per_byte, Some(2000));
        assert!(
            r.to_string().contains("rows × host < link + rows × device"),
            "{r}"
        );
    }

    #[test]
    fn an_untimed_host_run_is_counted_and_leaves_the_host_unmeasured() {
        let c = MissCosts::new();
        let q = GgmlDType::Q4K;
        c.note_fetch(1000, 2000);
        // A first run on a copy just kept (candle re-packed it inside the matmul): counted, but
        // not the host's figure, so the host runs again to be measured.
        c.note_host(q, 1, 1000, None);
        assert!(!c.host_measured(q));
        let r = c.report();
        assert_eq!((r.on_host, r.bytes_not_copied), (1, 1000));
        assert!(r.per_format.is_empty(), "{r}");
        assert_eq!(c.choose(q, 1, 1000), MissRun::Host);
        c.note_host(q, 1, 1000, Some(100));
        assert_eq!(
            c.report().per_format,
            vec![("Q4K".to_string(), Some(100), None)]
        );
    }

    #[test]
    fn prefetch_leaves_a_format_to_the_rule_until_its_host_side_is_measured() {
        let c = MissCosts::new();
        let q = GgmlDType::Q4_0;
        assert!(
            !c.prefers_host(q, 1, 1000),
            "the link is measured first, by an upload"
        );
        c.note_fetch(1000, 2000);
        // A weight always prefetched would never miss and Q4_0's host side never be measured:
        // prefetch skips it until a miss has run on the host.
        assert!(c.prefers_host(q, 1, 1000));
        c.note_host(q, 1, 1000, Some(5_000_000)); // 5000 ns per row·byte: far dearer
        assert!(!c.prefers_host(q, 1, 1000));
        c.note_host(GgmlDType::Q8_0, 1, 1000, Some(100));
        assert!(c.prefers_host(GgmlDType::Q8_0, 1, 1000));
    }

    #[test]
    fn figures_are_averaged_a_quarter_at_a_time_and_an_outlier_counts_as_four_times() {
        let c = MissCosts::new();
        c.note_fetch(100, 100);
        c.note_fetch(100, 300);
        assert_eq!(c.report().link_ps_per_byte, Some(1500));
        // 100 ns per byte against a figure of 1.5: counted as 6.
        c.note_fetch(100, 10_000);
        assert_eq!(c.report().link_ps_per_byte, Some(2625));
    }

    #[test]
    fn the_other_side_runs_at_the_sixteenth_decision_then_ever_more_rarely_until_the_choice_changes(
    ) {
        let c = MissCosts::new();
        let q = GgmlDType::Q8_0;
        c.note_fetch(1000, 10_000);
        c.note_host(q, 1, 1000, Some(100));
        // The host wins at one row: the device runs at decisions 16, 48, 112, 240, 496, 752
        // (gaps 32, 64, 128, 256, 256).
        let runs: Vec<usize> = (0..800)
            .filter(|_| c.choose(q, 1, 1000) == MissRun::Device)
            .collect();
        assert_eq!(runs, vec![15, 47, 111, 239, 495, 751], "{runs:?}");
        // At 200 rows the device wins (200 × 0.1 > 10): the choice changed, so the host runs 16
        // decisions later, then 32 after that.
        let runs: Vec<usize> = (0..64)
            .filter(|_| c.choose(q, 200, 1000) == MissRun::Host)
            .collect();
        assert_eq!(runs, vec![15, 47], "{runs:?}");
        // Another format keeps its own count.
        c.note_host(GgmlDType::Q4K, 1, 1000, Some(100));
        let other: Vec<usize> = (0..16)
            .filter(|_| c.choose(GgmlDType::Q4K, 1, 1000) == MissRun::Device)
            .collect();
        assert_eq!(other, vec![15]);
    }
}
