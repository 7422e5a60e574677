//! Plans in time: the step a model's residency predicts (`crate::costs`), and the audit that
//! holds a measured step against it.

use std::sync::Arc;

use super::MemoryManager;
use crate::costs::{DeviceCosts, Link, StepPrediction, Streaming, UseCost};
use crate::patcher::ModelPatcher;
use crate::size::ByteSize;
use crate::vram::DeviceId;

/// A step run under [`MemoryManager::audit`]: what the cost model predicted for it beside what
/// was measured.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct StepAudit {
    /// The model.
    pub model: String,
    /// The prediction, made from the model's residency when the step began.
    pub predicted: StepPrediction,
    /// The wall time of the step, in nanoseconds.
    pub measured_ns: u64,
    /// Of it, the time compute waited for copies (synchronous fetches and prefetches still in
    /// flight when used).
    pub measured_exposed_ns: u64,
    /// Bytes of streamed weights the step requested copied to a device (prefetches submitted
    /// and fetches made during it, [`crate::offload::TransferSnapshot::bytes_requested`]; every
    /// request of the manager's engine: run the audited step alone for an exact figure).
    pub measured_bytes: ByteSize,
    /// An option that may change output bits and is predicted faster for this model
    /// ([`MemoryManager::recommend`]), as the residency was when the step began.
    pub recommended: Option<Recommendation>,
}

/// An option residency does not turn on by itself because it may change output bits on a real
/// GPU, recommended where the cost model predicts it faster ([`MemoryManager::recommend`]).
///
/// Today one: cost-aware misses (`--cost-aware-misses`,
/// [`crate::vram::Config::cost_aware_misses`]), recommended for a model that streams quantized
/// weights it could multiply on the host instead: at decode (one input row) the host reads a
/// weight once from RAM, often sooner than the link copies it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Recommendation {
    /// The model.
    pub model: String,
    /// The option, as its flag.
    pub flag: String,
    /// The step predicted as configured.
    pub now: StepPrediction,
    /// The step predicted with the option.
    pub with: StepPrediction,
    /// The weights it changes: streamed quantized weights run on the host instead of copied.
    pub weights: usize,
    /// The input rows the host's matmuls are priced at (the model's last quantized matmul's;
    /// 1 before one ran).
    pub rows: usize,
}

impl Recommendation {
    /// Predicted step time as configured over predicted step time with the option.
    pub fn gain(&self) -> f64 {
        self.now.step_ns as f64 / self.with.step_ns.max(1) as f64
    }
}

impl std::fmt::Display for Recommendation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ms = |ns: u64| ns as f64 / 1e6;
        write!(
            f,
            "`{}`: `{}` predicted {:.1}× faster ({:.3} → {:.3} ms a step at {} input row{}: {} streamed quantized weights multiplied on the host instead of copied; may change output bits on a real GPU)",
            self.model,
            self.flag,
            self.gain(),
            ms(self.now.step_ns),
            ms(self.with.step_ns),
            self.rows,
            if self.rows == 1 { "" } else { "s" },
            self.weights
        )
    }
}

/// The least predicted gain an option is recommended for: below it the figures' noise could
/// decide.
pub const RECOMMEND_GAIN: f64 = 1.1;

impl StepAudit {
    /// Whether the step copied exactly the bytes predicted.
    pub fn bytes_agree(&self) -> bool {
        self.measured_bytes == self.predicted.bytes
    }

    /// Measured over predicted step time (1.0: exact; `f64::INFINITY` for a prediction of 0).
    pub fn time_ratio(&self) -> f64 {
        if self.predicted.step_ns == 0 {
            return f64::INFINITY;
        }
        self.measured_ns as f64 / self.predicted.step_ns as f64
    }
}

impl std::fmt::Display for StepAudit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ms = |ns: u64| ns as f64 / 1e6;
        write!(
            f,
            "`{}`: predicted {:.3} ms ({:.3} exposed, {}), measured {:.3} ms ({:.3} exposed, {}): time ×{:.2}, bytes {}",
            self.model,
            ms(self.predicted.step_ns),
            ms(self.predicted.exposed_ns),
            self.predicted.bytes,
            ms(self.measured_ns),
            ms(self.measured_exposed_ns),
            self.measured_bytes,
            self.time_ratio(),
            if self.bytes_agree() { "equal" } else { "differ" }
        )?;
        if let Some(r) = &self.recommended {
            write!(f, "; recommended: {r}")?;
        }
        Ok(())
    }
}

impl MemoryManager {
    /// The cost model: every device's copy figure, fed by the synchronous fetches of this
    /// manager's streamers; save it at the end of a run and load it at the start of the next
    /// ([`crate::costs::CostModel::save`], [`crate::costs::default_path`]) so the first
    /// plan of a run is made with measured figures.
    pub fn cost_model(&self) -> &Arc<crate::costs::CostModel> {
        &self.costs
    }

    /// Saves the cost model to `path` ([`crate::costs::CostModel::save`]): every device's copy
    /// figure and the compute per weight use of every model loaded now (by model and weight
    /// name), so the next run — [`MemoryManager::load_costs`] at its start — plans its first
    /// loads with them (the prefetch depth is chosen from a model's first load on).
    ///
    /// # Errors
    /// [`crate::Error::File`] when the file cannot be written.
    pub fn save_costs(&self, path: &std::path::Path) -> crate::Result<()> {
        let models = self.viewed_models();
        for (m, device) in &models {
            let weights = m
                .slots()
                .iter()
                .enumerate()
                .filter_map(|(i, s)| Some((s.name().to_string(), m.compute_ns(i)?)));
            self.costs.remember_compute(*device, m.name(), weights);
        }
        self.costs.save(path)
    }

    /// The registered models as the published view has them, with the device each is loaded
    /// on (the view's lock held only to upgrade the handles).
    fn viewed_models(&self) -> Vec<(Arc<crate::weights::Model>, DeviceId)> {
        self.view
            .lock()
            .iter()
            .filter_map(|e| Some((e.model.upgrade()?, e.device)))
            .collect()
    }

    /// Reads what [`MemoryManager::save_costs`] saved: the devices' copy figures, and compute
    /// per weight use that a model of the same name, on a device of the same label, starts
    /// from when it has measured nothing yet. Returns how many devices matched; a missing file
    /// matches none.
    ///
    /// # Errors
    /// [`crate::Error::File`] naming the line when a line does not parse (nothing is taken).
    pub fn load_costs(&self, path: &std::path::Path) -> crate::Result<usize> {
        self.costs.load(path)
    }

    /// Offers `model` the compute an earlier run saved for it on its device (once per model,
    /// while it has measured nothing).
    pub(super) fn seed_compute(&self, model: &ModelPatcher) {
        let m = model.model();
        if !m.usage().first_seed() {
            return;
        }
        if let Some(figures) = self.costs.compute_of(model.load_device(), m.name()) {
            m.seed_compute(&figures);
        }
    }

    /// Every device's costs: its copy figure and the compute per weight byte measured on the
    /// weights of the models loaded there.
    pub fn costs(&self) -> Vec<DeviceCosts> {
        let mut devices = self.costs.devices();
        let models = self.viewed_models();
        let mut cpu = DeviceCosts {
            device: DeviceId::Cpu,
            label: "cpu".into(),
            link: Link::default(),
            source: crate::costs::FigureSource::Modelled,
            shared_link: false,
            compute_ps_per_byte: None,
        };
        for d in devices.iter_mut().chain(std::iter::once(&mut cpu)) {
            let (mut ns, mut bytes) = (0u128, 0u128);
            for (m, _) in models.iter().filter(|(_, on)| *on == d.device) {
                let (n, b) = measured_compute(m, d.device, None);
                ns += n as u128;
                bytes += b as u128;
            }
            d.compute_ps_per_byte = (bytes > 0).then(|| (ns * 1000 / bytes) as u64);
        }
        if cpu.compute_ps_per_byte.is_some() {
            devices.push(cpu);
        }
        devices
    }

    /// The next step of `model` as its residency now predicts it: its weights in their recorded
    /// use order (slot order before a forward completed), those resident now costing compute
    /// only, the rest copied as the streamer would with this manager's lanes and its streamer's
    /// prefetch depth into the device's free memory. A model that streams with nothing
    /// prefetched now (a load or a reservation cancelled its prefetches, or it never ran) is
    /// predicted from a cold start ([`crate::costs::predict_cold_step`]): its first weights are
    /// fetched on the compute thread.
    pub fn predict(&self, model: &ModelPatcher) -> StepPrediction {
        let (room, depth) = self.streaming_now(model);
        let cold = crate::offload::streamer_of(model)
            .is_some_and(|s| s.in_flight_bytes() == ByteSize::ZERO);
        self.predict_with(
            model,
            |i| model.resident_weight(i).is_some(),
            room,
            depth,
            cold,
        )
    }

    /// What the options that may change output bits would gain `model`'s next step, as its
    /// residency now predicts it ([`Recommendation`]): cost-aware misses when it streams
    /// quantized weights onto a device and is predicted at least [`RECOMMEND_GAIN`] faster
    /// with them run on the host. `None` when nothing is predicted to gain that much, or the
    /// option is already on. The host's matmul speed per format is probed once per manager
    /// ([`crate::costs::CostModel::host_matmul`]: a few milliseconds) and added to each such
    /// weight's measured compute (conservative on a GPU: its own matmul there is not taken
    /// off); on a simulated GPU, which computes with the host's kernels, only the copies go.
    pub fn recommend(&self, model: &ModelPatcher) -> Option<Recommendation> {
        let (room, depth) = self.streaming_now(model);
        self.recommend_with(model, |i| model.resident_weight(i).is_some(), room, depth)
    }

    /// [`MemoryManager::recommend`] with weights `resident(i)` resident, `room` and `depth` as
    /// [`MemoryManager::predict_with`] takes them.
    pub(super) fn recommend_with(
        &self,
        model: &ModelPatcher,
        resident: impl Fn(usize) -> bool,
        room: u64,
        depth: usize,
    ) -> Option<Recommendation> {
        let device = model.load_device();
        if self.misses.is_some() || device.is_cpu() {
            return None;
        }
        let m = model.model();
        let rows = m.matmul_rows().unwrap_or(1);
        let (order, mut uses, unmeasured) = self.uses_of(model, resident);
        let streaming = self.streaming(device, room, depth);
        let mut now = crate::costs::predict_step(&uses, streaming);
        now.unmeasured = unmeasured;
        let weights = self.run_on_host(model, &order, &mut uses, |_, _, _, _| true)?;
        if weights == 0 {
            return None;
        }
        let mut with = crate::costs::predict_step(&uses, streaming);
        with.unmeasured = unmeasured;
        let r = Recommendation {
            model: m.name().to_string(),
            flag: "--cost-aware-misses".into(),
            now,
            with,
            weights,
            rows,
        };
        (r.gain() >= RECOMMEND_GAIN).then_some(r)
    }

    /// Turns the uses of streamed, unpatched quantized weights that `on_host(format, rows,
    /// bytes)` picks into runs on the host, as cost-aware misses run them: no copy, and their
    /// measured compute kept (the device's matmul is not known apart from the work around it)
    /// with the host's matmul added — except on a simulated GPU, whose device matmul is the
    /// host's. How many were turned; `None` when the host's figure cannot be had.
    fn run_on_host(
        &self,
        model: &ModelPatcher,
        order: &[usize],
        uses: &mut [UseCost],
        on_host: impl Fn(usize, candle_core::quantized::GgmlDType, usize, u64) -> bool,
    ) -> Option<usize> {
        let device = model.load_device();
        if device.is_cpu() {
            return Some(0);
        }
        let m = model.model();
        let rows = m.matmul_rows().unwrap_or(1);
        let patches = model.patches();
        let mut turned = 0;
        for (u, &i) in uses.iter_mut().zip(order) {
            let slot = &m.slots()[i];
            let Some(ggml) = slot.quantized() else {
                continue;
            };
            if u.resident
                || !patches.get(slot.name()).is_empty()
                || !on_host(i, ggml, rows, u.bytes)
            {
                continue;
            }
            let host = if device.is_sim() {
                0.0
            } else {
                self.costs.host_matmul(ggml)? * rows as f64 * u.bytes as f64
            };
            *u = UseCost {
                resident: true,
                compute_ns: u.compute_ns + host,
                ..*u
            };
            turned += 1;
        }
        Some(turned)
    }

    /// The room `model`'s copies in flight have on its device now, and its streamer's depth.
    fn streaming_now(&self, model: &ModelPatcher) -> (u64, usize) {
        let device = model.load_device();
        // The device's free memory, this model's copies in flight counted as free: they are
        // the room its streaming works in.
        let in_flight =
            crate::offload::streamer_of(model).map_or(ByteSize::ZERO, |s| s.in_flight_bytes());
        let room = if device.is_cpu() {
            u64::MAX
        } else {
            let booked = self.ledger.booked(device).saturating_sub(in_flight);
            self.free_with(booked, device).bytes()
        };
        let depth = crate::offload::streamer_of(model)
            .map_or(self.policy.config().prefetch_depth(), |s| s.depth());
        (room, depth)
    }

    /// The step `model` predicts with weights `resident(i)` resident, `room` bytes of device
    /// memory for its copies in flight and `depth` weights prefetched ahead: a steady step, or
    /// with `cold` one that starts with nothing in flight.
    pub(super) fn predict_with(
        &self,
        model: &ModelPatcher,
        resident: impl Fn(usize) -> bool,
        room: u64,
        depth: usize,
        cold: bool,
    ) -> StepPrediction {
        let (order, mut uses, unmeasured) = self.uses_of(model, resident);
        // With cost-aware misses, the misses the rule runs on the host copy nothing.
        if let Some(c) = &self.misses {
            let _ = self.run_on_host(model, &order, &mut uses, |i, g, r, b| {
                // A weight the device map puts on the host runs there, as the streamer does.
                model.streams_always(i) || c.prefers_host(g, r, b)
            });
        }
        let streaming = self.streaming(model.load_device(), room, depth);
        let mut p = if cold {
            crate::costs::predict_cold_step(&uses, streaming)
        } else {
            crate::costs::predict_step(&uses, streaming)
        };
        p.unmeasured = unmeasured;
        p
    }

    /// `model`'s weight uses in their recorded order (slot order before a forward completed)
    /// with their measured compute, those `resident(i)` (or on the host) costing no copy: the
    /// order, the uses, and how many were not measured yet.
    fn uses_of(
        &self,
        model: &ModelPatcher,
        resident: impl Fn(usize) -> bool,
    ) -> (Vec<usize>, Vec<UseCost>, usize) {
        let m = model.model();
        let order = m
            .last_forward_order()
            .unwrap_or_else(|| (0..m.len()).collect());
        let device = model.load_device();
        // A weight not measured yet costs this model's average per byte on the device.
        let (ns, bytes) = measured_compute(m, device, Some(model));
        let per_byte = (bytes > 0).then(|| ns as f64 / bytes as f64);
        let mut unmeasured = 0;
        let uses: Vec<UseCost> = order
            .iter()
            .map(|&i| {
                let size = m.slots()[i].bytes().bytes();
                let compute_ns = match m.compute_ns(i) {
                    Some(ns) => ns as f64,
                    None => {
                        unmeasured += 1;
                        per_byte.map_or(0.0, |p| p * size as f64)
                    }
                };
                UseCost {
                    bytes: size,
                    resident: resident(i) || model.weight_device(i).is_cpu(),
                    compute_ns,
                    routed: m.usage().is_routed(i),
                }
            })
            .collect();
        (order, uses, unmeasured)
    }

    /// How `device` streams: its link, this manager's lanes, `depth` and `room`.
    fn streaming(&self, device: DeviceId, room: u64, depth: usize) -> Streaming {
        let (link, shared_link) = self.costs.link(device).unwrap_or((Link::default(), false));
        Streaming {
            link,
            shared_link,
            lanes: self.engine.lanes(),
            depth,
            room,
        }
    }

    /// Runs `step` (one forward or sampling step of `model`) and holds it against the
    /// prediction made from `model`'s residency as the step begins ([`MemoryManager::predict`]):
    /// the wall time, the time compute waited for copies, the bytes copied. Bytes are exact
    /// when nothing else copies meanwhile; time is what the cost model has learned so far (a
    /// first step measures it). The audit is also kept for [`MemoryManager::memory_report`]
    /// (the last one per model).
    pub fn audit<R>(&self, model: &ModelPatcher, step: impl FnOnce() -> R) -> (R, StepAudit) {
        let predicted = self.predict(model);
        let recommended = self.recommend(model);
        let before = self.engine.stats().snapshot();
        let t0 = std::time::Instant::now();
        let out = step();
        let measured_ns = t0.elapsed().as_nanos() as u64;
        let after = self.engine.stats().snapshot();
        let waited = |s: &crate::offload::TransferSnapshot| s.wait_ns + s.prefetch_hit_wait_ns;
        let audit = StepAudit {
            model: model.model().name().to_string(),
            predicted,
            measured_ns,
            measured_exposed_ns: waited(&after).saturating_sub(waited(&before)),
            measured_bytes: after.bytes_requested.saturating_sub(before.bytes_requested),
            recommended,
        };
        let mut audits = self.audits.lock();
        audits.retain(|a| a.model != audit.model);
        audits.push(audit.clone());
        (out, audit)
    }

    /// The last audit of each model ([`MemoryManager::audit`]).
    pub fn audits(&self) -> Vec<StepAudit> {
        self.audits.lock().clone()
    }
}

/// The compute measured of `m`'s weights on `device` (of `patcher`'s placement, or the load
/// device's of any placement): total nanoseconds and the bytes of the weights measured.
fn measured_compute(
    m: &crate::weights::Model,
    device: DeviceId,
    patcher: Option<&ModelPatcher>,
) -> (u64, u64) {
    let (mut ns, mut bytes) = (0u64, 0u64);
    for i in 0..m.len() {
        let on = patcher.is_none_or(|p| p.weight_device(i) == device);
        if let Some(c) = m.compute_ns(i).filter(|_| on) {
            ns = ns.saturating_add(c);
            bytes = bytes.saturating_add(m.slots()[i].bytes().bytes());
        }
    }
    (ns, bytes)
}
