//! The cost model: what a copy and a weight's compute take, per device, and the step time a
//! residency predicts from them (docs/ARCHITECTURE.md §14).
//!
//! - **Copies.** A host→device copy of `b` bytes takes `latency + b × ps_per_byte` ([`Link`]).
//!   Each device's figure starts from what the device says of itself (a simulated GPU's modelled
//!   latency and bandwidth; a CUDA device's [`Link::MODELLED_PCIE`] until measured) or from a
//!   file saved by an earlier run ([`CostModel::load`]), and is refined by every synchronous
//!   fetch the streamer times ([`CostModel::note_copy`]): a least-squares line through the
//!   samples, each new one weighing as much as the last ten together.
//! - **Compute.** Each weight's share of a forward is learned by its model as the host sees it:
//!   the time from the return of its fetch to the next weight's fetch
//!   ([`crate::weights::Model::compute_ns`]), an exponential average. A weight not measured yet
//!   costs the device's average per byte over the weights that were.
//! - **Prediction** ([`predict_step`]): an event simulation of one steady forward over the
//!   model's recorded use order, with the compute thread, each transfer lane and (on a real GPU)
//!   the one link as resources, following the streamer's rules: a weight not resident is
//!   fetched synchronously unless a prefetch brought it, and each fetch requests the next
//!   `depth` streamed weights in use order while their bytes fit the streaming room. It gives
//!   the step's time, its compute, the copy time and the part of it compute waited for, and the
//!   bytes copied. Linear in the uses times the depth.
//!
//! The figures are what the host observes: on a GPU, whose kernels run asynchronously, a
//! weight's compute is the host's time to launch its work, so the prediction is a lower bound
//! there until a step synchronizes; on the simulated GPU and the CPU it is the work itself.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::lock::{Mutex, Rank};
use crate::vram::DeviceId;

mod predict;

pub use predict::{predict_cold_step, predict_step, StepPrediction, Streaming, UseCost};

/// An exponential average's new value: `old` moved a quarter of the way to `new`, a `new` above
/// 4× `old` counted as 4× (one rule for every measured figure: a weight's compute, cost-aware
/// misses' per-format figures).
pub(crate) fn average(old: Option<f64>, new: f64) -> f64 {
    match old {
        Some(o) => o + (new.min(4.0 * o) - o) / 4.0,
        None => new,
    }
}

/// A link's copy time: a fixed latency plus a time per byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Link {
    /// The fixed cost of one copy, in nanoseconds.
    pub latency_ns: u64,
    /// Picoseconds per byte (1 000 / GB/s: 40 at 25 GB/s).
    pub ps_per_byte: u64,
}

impl Link {
    /// A PCIe 4.0 ×16 link as a host sees it with page-locked memory: 10 µs, 25 GB/s — the
    /// figure a CUDA device starts from until copies are measured.
    pub const MODELLED_PCIE: Link = Link {
        latency_ns: 10_000,
        ps_per_byte: 40,
    };

    /// The modelled time of copying `bytes`, in nanoseconds.
    pub fn copy_ns(&self, bytes: u64) -> f64 {
        self.latency_ns as f64 + bytes as f64 * self.ps_per_byte as f64 / 1000.0
    }

    /// The bandwidth in bytes per second (`None` for a link that costs nothing per byte).
    pub fn bandwidth(&self) -> Option<f64> {
        (self.ps_per_byte > 0).then(|| 1e12 / self.ps_per_byte as f64)
    }

    fn from_f64(latency_ns: f64, ps_per_byte: f64) -> Link {
        Link {
            latency_ns: latency_ns.max(0.0).round() as u64,
            ps_per_byte: ps_per_byte.max(0.0).round() as u64,
        }
    }
}

impl From<&crate::vram::SimSpec> for Link {
    /// A simulated GPU's modelled copy: its latency and bandwidth (none: nothing per byte).
    fn from(spec: &crate::vram::SimSpec) -> Link {
        Link {
            latency_ns: spec.latency.as_nanos() as u64,
            ps_per_byte: spec.bandwidth.map_or(0, |bw| (1e12 / bw).round() as u64),
        }
    }
}

impl fmt::Display for Link {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let us = self.latency_ns as f64 / 1000.0;
        match self.bandwidth() {
            Some(bw) => write!(f, "{us:.1} µs + {:.2} GB/s", bw / 1e9),
            None => write!(f, "{us:.1} µs per copy"),
        }
    }
}

/// Where a device's link figure comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum FigureSource {
    /// What the device says of itself (a simulated GPU's spec; [`Link::MODELLED_PCIE`]).
    Modelled,
    /// A file an earlier run saved ([`CostModel::load`]).
    Saved,
    /// Copies timed in this run (how many).
    Measured(u64),
}

/// One device's costs, as [`crate::loader::MemoryManager::costs`] reports them.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct DeviceCosts {
    /// The device.
    pub device: DeviceId,
    /// What the figure is saved under: the device and what it is (a simulated GPU's spec, a
    /// CUDA device's name).
    pub label: String,
    /// Host→device copies.
    pub link: Link,
    /// Where `link` comes from.
    pub source: FigureSource,
    /// Whether concurrent copies share one link (a real GPU's bus: lanes overlap copies with
    /// compute, not with each other) or each run at the link's speed (the simulated GPU, whose
    /// streams each sleep their own copy time).
    pub shared_link: bool,
    /// The compute of a weight use per byte of weight, in picoseconds, averaged over the
    /// weights measured on this device (filled by the manager; `None` before any forward).
    pub compute_ps_per_byte: Option<u64>,
}

impl fmt::Display for DeviceCosts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: copies {}", self.device, self.link)?;
        match self.source {
            FigureSource::Modelled => write!(f, " (modelled)")?,
            FigureSource::Saved => write!(f, " (saved)")?,
            FigureSource::Measured(n) => write!(f, " (measured, {n} copies)")?,
        }
        if self.shared_link {
            write!(f, ", one link")?;
        }
        match self.compute_ps_per_byte {
            Some(ps) => write!(f, "; compute {:.3} ns per weight byte", ps as f64 / 1000.0),
            None => write!(f, "; compute unmeasured"),
        }
    }
}

/// A decayed least-squares fit of copy time against bytes.
#[derive(Debug, Clone, Copy, Default)]
struct Fit {
    w: f64,
    x: f64,
    y: f64,
    xx: f64,
    xy: f64,
    samples: u64,
}

/// Each new sample weighs as much as the last ten together (a weight of 0.9 on the past).
const KEEP: f64 = 0.9;

/// Samples before a measured figure replaces the modelled or saved one.
const MIN_SAMPLES: u64 = 3;

impl Fit {
    fn add(&mut self, bytes: f64, ns: f64) {
        self.w = self.w * KEEP + 1.0;
        self.x = self.x * KEEP + bytes;
        self.y = self.y * KEEP + ns;
        self.xx = self.xx * KEEP + bytes * bytes;
        self.xy = self.xy * KEEP + bytes * ns;
        self.samples += 1;
    }

    /// The line through the samples; where their sizes hardly differ, `prior`'s latency is
    /// kept and only the time per byte fitted.
    fn link(&self, prior: Link) -> Option<Link> {
        if self.samples < MIN_SAMPLES || self.w <= 0.0 {
            return None;
        }
        let (mx, my) = (self.x / self.w, self.y / self.w);
        let var = self.xx / self.w - mx * mx;
        let cov = self.xy / self.w - mx * my;
        if var > 1e-6 * (self.xx / self.w).max(1.0) {
            let slope = cov / var;
            let latency = my - slope * mx;
            if slope > 0.0 && latency >= 0.0 {
                return Some(Link::from_f64(latency, slope * 1000.0));
            }
        }
        let latency = (prior.latency_ns as f64).min(my);
        let per_byte = if mx > 0.0 { (my - latency) / mx } else { 0.0 };
        Some(Link::from_f64(latency, per_byte * 1000.0))
    }
}

#[derive(Debug, Clone)]
struct Figures {
    device: DeviceId,
    label: String,
    prior: Link,
    source: FigureSource,
    shared_link: bool,
    fit: Fit,
}

impl Figures {
    fn link(&self) -> (Link, FigureSource) {
        match self.fit.link(self.prior) {
            Some(l) => (l, FigureSource::Measured(self.fit.samples)),
            None => (self.prior, self.source),
        }
    }
}

/// One manager's measured costs, per device (module docs).
#[derive(Debug)]
pub struct CostModel {
    figures: Mutex<HashMap<DeviceId, Figures>>,
    /// The host's quantized matmul per GGML format, in nanoseconds per (input row × weight
    /// byte), probed once each ([`CostModel::host_matmul`]).
    host: Mutex<HashMap<candle_core::quantized::GgmlDType, f64>>,
    /// Compute per weight use, by (device label, model name), then weight name: what
    /// [`CostModel::remember_compute`] was told, saved with the links and read back
    /// ([`CostModel::compute_of`] seeds a model that has measured nothing yet).
    compute: Mutex<ComputeFigures>,
}

/// Compute per weight use in nanoseconds, by (device label, model name), then weight name.
type ComputeFigures = HashMap<(String, String), HashMap<String, u64>>;

/// The first field of a saved compute line.
const COMPUTE: &str = "compute";

impl Default for CostModel {
    fn default() -> Self {
        CostModel::new()
    }
}

impl CostModel {
    /// No device known yet.
    pub fn new() -> CostModel {
        CostModel {
            figures: Mutex::new(Rank::Costs, HashMap::new()),
            host: Mutex::new(Rank::Costs, HashMap::new()),
            compute: Mutex::new(Rank::Costs, HashMap::new()),
        }
    }

    /// What `device` is saved under: its label, or `cpu` for a device with no copy figure.
    pub fn label(&self, device: DeviceId) -> String {
        self.figures
            .lock()
            .get(&device)
            .map_or_else(|| "cpu".to_string(), |f| f.label.clone())
    }

    /// Keeps `model`'s compute per weight use on `device` (weight name, nanoseconds) to save
    /// ([`CostModel::save`]), replacing what was kept for it.
    pub fn remember_compute(
        &self,
        device: DeviceId,
        model: &str,
        weights: impl IntoIterator<Item = (String, u64)>,
    ) {
        let key = (self.label(device), model.to_string());
        let figures: HashMap<String, u64> = weights.into_iter().collect();
        if !figures.is_empty() {
            self.compute.lock().insert(key, figures);
        }
    }

    /// The compute per weight use kept or read for `model` on `device`, by weight name.
    pub fn compute_of(&self, device: DeviceId, model: &str) -> Option<HashMap<String, u64>> {
        let key = (self.label(device), model.to_string());
        self.compute.lock().get(&key).cloned()
    }

    /// The host's matmul of a weight in GGML format `ggml` (candle's quantized matmul on the
    /// CPU), in nanoseconds per (input row × weight byte): what a miss run on the host costs
    /// ([`crate::offload::MissCosts`] measures the same while it runs). Probed at the first
    /// call for a format — a 256-row weight of 16 blocks a row, one input row, the fastest of
    /// five runs after a warm one: a few milliseconds — then kept. `None` when candle cannot
    /// build or multiply the format on the host.
    pub fn host_matmul(&self, ggml: candle_core::quantized::GgmlDType) -> Option<f64> {
        if let Some(&v) = self.host.lock().get(&ggml) {
            return Some(v);
        }
        // Probed outside the lock: two racing first calls both probe, the first figure stays.
        let probed = probe_host_matmul(ggml)?;
        Some(*self.host.lock().entry(ggml).or_insert(probed))
    }

    /// Registers `device` with its modelled link (kept until copies are measured) under
    /// `label` (what a saved figure is matched by). Registering again changes nothing.
    pub fn seed(&self, device: DeviceId, label: &str, link: Link, shared_link: bool) {
        self.figures
            .lock()
            .entry(device)
            .or_insert_with(|| Figures {
                device,
                label: label.to_string(),
                prior: link,
                source: FigureSource::Modelled,
                shared_link,
                fit: Fit::default(),
            });
    }

    /// A synchronous copy of `bytes` to `device` took `ns`, as the thread that waited saw it.
    pub fn note_copy(&self, device: DeviceId, bytes: u64, ns: u64) {
        if let Some(f) = self.figures.lock().get_mut(&device) {
            f.fit.add(bytes as f64, ns as f64);
        }
    }

    /// `device`'s copy figure and whether its copies share one link (`None`: not a device
    /// that copies — the CPU).
    pub fn link(&self, device: DeviceId) -> Option<(Link, bool)> {
        let figures = self.figures.lock();
        let f = figures.get(&device)?;
        Some((f.link().0, f.shared_link))
    }

    /// Every known device's figures (compute left for the manager to fill), in device order.
    pub fn devices(&self) -> Vec<DeviceCosts> {
        let figures = self.figures.lock();
        let mut v: Vec<DeviceCosts> = figures
            .values()
            .map(|f| {
                let (link, source) = f.link();
                DeviceCosts {
                    device: f.device,
                    label: f.label.clone(),
                    link,
                    source,
                    shared_link: f.shared_link,
                    compute_ps_per_byte: None,
                }
            })
            .collect();
        v.sort_by_key(|d| d.device);
        v
    }

    /// Writes every device's current figure to `path` (a small text file, one line per
    /// device: label, latency in ns, picoseconds per byte), then the compute kept per weight
    /// ([`CostModel::remember_compute`]: `compute`, label, model, weight, nanoseconds), creating
    /// its directory.
    ///
    /// # Errors
    /// [`Error::File`] when the file cannot be written.
    pub fn save(&self, path: &Path) -> Result<()> {
        let bad = |e: std::io::Error| Error::File {
            path: path.to_path_buf(),
            reason: e.to_string(),
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(bad)?;
        }
        let mut text = String::from("# residency cost model: label\tlatency_ns\tps_per_byte\n");
        for d in self.devices() {
            text.push_str(&format!(
                "{}\t{}\t{}\n",
                d.label.replace(['\t', '\n'], " "),
                d.link.latency_ns,
                d.link.ps_per_byte
            ));
        }
        let clean = |s: &str| s.replace(['\t', '\n'], " ");
        let compute = self.compute.lock();
        let mut keys: Vec<&(String, String)> = compute.keys().collect();
        keys.sort();
        for key in keys {
            let mut weights: Vec<(&String, &u64)> = compute[key].iter().collect();
            weights.sort();
            for (weight, ns) in weights {
                text.push_str(&format!(
                    "{COMPUTE}\t{}\t{}\t{}\t{ns}\n",
                    clean(&key.0),
                    clean(&key.1),
                    clean(weight)
                ));
            }
        }
        drop(compute);
        std::fs::write(path, text).map_err(bad)
    }

    /// Reads figures saved by [`CostModel::save`]: each device seeded under the same label
    /// starts from the saved figure (until this run measures its own). Returns how many
    /// devices matched; a missing file matches none.
    ///
    /// Compute lines are kept for [`CostModel::compute_of`].
    ///
    /// # Errors
    /// [`Error::File`] naming the line when the file exists but a line is neither three fields
    /// (label, two whole numbers) nor a compute line (`compute`, label, model, weight, a whole
    /// number).
    pub fn load(&self, path: &Path) -> Result<usize> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
            Err(e) => {
                return Err(Error::File {
                    path: path.to_path_buf(),
                    reason: e.to_string(),
                })
            }
        };
        let mut saved = Vec::new();
        let mut compute: ComputeFigures = HashMap::new();
        for (n, line) in text.lines().enumerate() {
            if line.starts_with('#') || line.trim().is_empty() {
                continue;
            }
            let fields: Vec<&str> = line.split('\t').collect();
            if let [COMPUTE, label, model, weight, ns] = fields.as_slice() {
                let ns = ns.trim().parse::<u64>().map_err(|_| Error::File {
                    path: path.to_path_buf(),
                    reason: format!(
                        "line {}: expected `compute<TAB>label<TAB>model<TAB>weight<TAB>ns`, found `{line}`",
                        n + 1
                    ),
                })?;
                compute
                    .entry((label.to_string(), model.to_string()))
                    .or_default()
                    .insert(weight.to_string(), ns);
                continue;
            }
            let parsed = match fields.as_slice() {
                [label, lat, ps] => lat
                    .trim()
                    .parse::<u64>()
                    .ok()
                    .zip(ps.trim().parse::<u64>().ok())
                    .map(|(latency_ns, ps_per_byte)| {
                        (
                            label.to_string(),
                            Link {
                                latency_ns,
                                ps_per_byte,
                            },
                        )
                    }),
                _ => None,
            };
            saved.push(parsed.ok_or_else(|| Error::File {
                path: path.to_path_buf(),
                reason: format!(
                    "line {}: expected `label<TAB>latency_ns<TAB>ps_per_byte`, found `{line}`",
                    n + 1
                ),
            })?);
        }
        let mut matched = 0;
        for f in self.figures.lock().values_mut() {
            if let Some((_, link)) = saved.iter().find(|(l, _)| *l == f.label) {
                f.prior = *link;
                f.source = FigureSource::Saved;
                matched += 1;
            }
        }
        self.compute.lock().extend(compute);
        Ok(matched)
    }
}

/// Times candle's quantized matmul of format `ggml` on the host ([`CostModel::host_matmul`]).
fn probe_host_matmul(ggml: candle_core::quantized::GgmlDType) -> Option<f64> {
    use candle_core::quantized::{QMatMul, QTensor};
    use candle_core::{Device, Module, Tensor};
    let cols = ggml.block_size() * 16;
    let w = Tensor::randn(0f32, 1.0, (256, cols), &Device::Cpu).ok()?;
    let q = QTensor::quantize(&w, ggml).ok()?;
    let bytes = q.storage_size_in_bytes();
    let mm = QMatMul::from_qtensor(q).ok()?;
    let x = Tensor::randn(0f32, 1.0, (1, cols), &Device::Cpu).ok()?;
    mm.forward(&x).ok()?;
    let mut best = u128::MAX;
    for _ in 0..5 {
        let t0 = std::time::Instant::now();
        mm.forward(&x).ok()?;
        best = best.min(t0.elapsed().as_nanos());
    }
    Some(best.max(1) as f64 / bytes.max(1) as f64)
}

/// Where [`CostModel::save`]'s file lives by default: `$RESIDENCY_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/residency`, else `~/.cache/residency`, then `costs.tsv`; `None` when none
/// of those is set.
pub fn default_path() -> Option<PathBuf> {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    let dir = var("RESIDENCY_CACHE_DIR")
        .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("residency")))
        .or_else(|| var("HOME").map(|d| d.join(".cache").join("residency")))?;
    Some(dir.join("costs.tsv"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fit_recovers_latency_and_bandwidth_and_one_size_keeps_the_prior_latency() {
        let c = CostModel::new();
        let d = DeviceId::Sim(0);
        c.seed(
            d,
            "sim:0 test",
            Link {
                latency_ns: 5_000,
                ps_per_byte: 100,
            },
            false,
        );
        assert_eq!(
            c.link(d).unwrap().0.ps_per_byte,
            100,
            "modelled until measured"
        );
        for bytes in [10_000u64, 50_000, 200_000, 1_000_000] {
            c.note_copy(d, bytes, 2_000 + bytes * 2); // 2 µs + 2 ns/B
        }
        let l = c.link(d).unwrap().0;
        assert_eq!((l.latency_ns, l.ps_per_byte), (2_000, 2_000), "{l}");
        assert_eq!(c.devices()[0].source, FigureSource::Measured(4));
        let one = CostModel::new();
        one.seed(
            d,
            "x",
            Link {
                latency_ns: 5_000,
                ps_per_byte: 100,
            },
            false,
        );
        for _ in 0..4 {
            one.note_copy(d, 100_000, 105_000);
        }
        let l = one.link(d).unwrap().0;
        assert_eq!((l.latency_ns, l.ps_per_byte), (5_000, 1_000), "{l}");
    }

    #[test]
    fn figures_saved_by_one_run_seed_the_next_and_a_bad_file_names_its_line() {
        let dir = std::env::temp_dir().join(format!("residency-costs-{}", std::process::id()));
        let path = dir.join("costs.tsv");
        let a = CostModel::new();
        let d = DeviceId::Sim(0);
        a.seed(d, "sim:0 8MiB@25GB/s", Link::MODELLED_PCIE, false);
        for bytes in [10_000u64, 90_000, 400_000] {
            a.note_copy(d, bytes, 3_000 + bytes / 2);
        }
        a.save(&path).unwrap();
        let b = CostModel::new();
        b.seed(d, "sim:0 8MiB@25GB/s", Link::MODELLED_PCIE, false);
        b.seed(DeviceId::Sim(1), "sim:1 other", Link::MODELLED_PCIE, false);
        assert_eq!(b.load(&path).unwrap(), 1);
        assert_eq!(b.link(d), a.link(d));
        assert_eq!(b.devices()[0].source, FigureSource::Saved);
        assert_eq!(b.link(DeviceId::Sim(1)).unwrap().0, Link::MODELLED_PCIE);
        assert_eq!(CostModel::new().load(&dir.join("none.tsv")).unwrap(), 0);
        std::fs::write(&path, "sim:0 8MiB@25GB/s\t1\t1\nsim:0 x\t12\n").unwrap();
        let err = b.load(&path).unwrap_err().to_string();
        assert!(err.contains("line 2"), "{err}");
        assert_eq!(
            b.link(d),
            a.link(d),
            "a bad file changes nothing, its good lines included"
        );
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn the_host_matmul_is_probed_once_per_format_and_kept() {
        use candle_core::quantized::GgmlDType;
        let c = CostModel::new();
        let q8 = c
            .host_matmul(GgmlDType::Q8_0)
            .expect("Q8_0 runs on the host");
        assert!(q8 > 0.0);
        // Kept: the second call returns the probed figure, not a new probe's.
        assert_eq!(c.host_matmul(GgmlDType::Q8_0), Some(q8));
        let f32 = c.host_matmul(GgmlDType::F32).expect("f32 runs on the host");
        assert!(f32 > 0.0 && f32 != q8);
    }

    #[test]
    fn compute_per_weight_is_saved_and_read_back_and_a_bad_compute_line_takes_nothing() {
        let dir = std::env::temp_dir().join(format!("residency-compute-{}", std::process::id()));
        let path = dir.join("costs.tsv");
        let d = DeviceId::Sim(0);
        let a = CostModel::new();
        a.seed(d, "sim:0 8MiB@25GB/s", Link::MODELLED_PCIE, false);
        a.remember_compute(
            d,
            "net",
            [("w0".to_string(), 1200), ("w1".to_string(), 800)],
        );
        a.save(&path).unwrap();
        let b = CostModel::new();
        b.seed(d, "sim:0 8MiB@25GB/s", Link::MODELLED_PCIE, false);
        assert_eq!(b.compute_of(d, "net"), None);
        assert_eq!(b.load(&path).unwrap(), 1);
        let got = b.compute_of(d, "net").expect("read back");
        assert_eq!((got["w0"], got["w1"], got.len()), (1200, 800, 2));
        assert_eq!(b.compute_of(d, "other"), None, "by model name");
        // A compute line with a bad figure: named, and nothing of the file is taken.
        let text =
            std::fs::read_to_string(&path).unwrap() + "compute\tsim:0 8MiB@25GB/s\tnew\tw0\tlots\n";
        std::fs::write(&path, text).unwrap();
        let c = CostModel::new();
        c.seed(d, "sim:0 8MiB@25GB/s", Link::MODELLED_PCIE, false);
        let err = c.load(&path).unwrap_err().to_string();
        assert!(err.contains("line 5"), "{err}");
        assert_eq!(c.compute_of(d, "net"), None);
        std::fs::remove_dir_all(&dir).ok();
    }
}
