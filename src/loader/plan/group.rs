//! One model's share of a plan: which of its weights will be resident, the prefetch room, the
//! host tier's problem and the request's validation.

use super::*;

/// One model's share of a plan on one device ([`MemoryManager::plan_group`]).
pub(in crate::loader) struct GroupPlan {
    /// Which weights the load makes resident.
    pub(in crate::loader) want: Vec<bool>,
    /// The weight budget of a partial load (`None`: full).
    pub(in crate::loader) budget: Option<ByteSize>,
    /// The room the load leaves free for streaming.
    pub(in crate::loader) room: ByteSize,
    /// The resident set of the steady step (a dynamic load: the classic selection its use
    /// keeps).
    pub(in crate::loader) steady: Vec<bool>,
    /// The prefetch depth its streamer runs with, and every depth the planner weighed with its
    /// predicted step (empty when the depth was not chosen: set by the configuration, or
    /// nothing measured yet to choose by).
    pub(in crate::loader) depth: usize,
    pub(in crate::loader) weighed: Vec<DepthOption>,
    /// The bytes its streamer's copies in flight may take, as the prediction models them
    /// (`u64::MAX`: no limit).
    pub(in crate::loader) prefetch_room: u64,
    /// Under residency by use, the memory its keeper leaves free beside what it keeps: the
    /// activation memory asked for and the streaming room, but never more than the classic
    /// selection leaves free, so by use keeps that selection whole.
    pub(in crate::loader) keeper_room: ByteSize,
}

/// The prefetch depths the planner weighs for a streaming load, fewest bytes first. Not 0: with
/// no prefetch the one weight of room is shared by the copy in flight and the stream-ordered
/// frees of the weights before it, so what residency by use admits depends on when those frees
/// land (a growing KV reservation then left weight 15 resident and 12–14 streaming in half of the
/// runs of `tests/dynamic.rs`'s stable-prefix test); a user may still set 0.
const DEPTHS: [usize; 3] = [1, 2, 4];

/// A deeper prefetch (more room for streaming, fewer weights resident) is taken only when it
/// predicts at least this share faster than the shallower one chosen so far: below it, the
/// figures' noise would trade bytes that are sure for time that is not.
const DEEPER_GAIN: f64 = 0.02;

/// Models whose last depth choice is kept ([`DepthChoice`]); the oldest goes first.
const DEPTH_CHOICES: usize = 64;

/// What a depth choice is made for: model id, residency signature, the memory free to it,
/// the activation memory asked for, residency by use.
type DepthKey = (u64, crate::patcher::ResidencySignature, u64, u64, bool);

/// A prefetch-depth choice and what it was made for: the model, its patches and dtype (the
/// residency signature), the memory free to it, the activation memory asked for and the mode.
/// While all of these hold, a load keeps the choice instead of predicting every depth again
/// (a reload before each step decides nothing new); when one changes, the planner chooses
/// again with the figures measured since.
#[derive(Debug, Clone)]
pub(in crate::loader) struct DepthChoice {
    key: DepthKey,
    depth: usize,
    weighed: Vec<DepthOption>,
}

impl MemoryManager {
    /// Which of `views` (one model's weights on `device`; `already` of their bytes current
    /// there) will be resident, the weight budget of a partial load (`None`: full), the room
    /// the load leaves free for streaming ([`MemoryManager::prefetch_room`] of the weights a
    /// classic partial load would stream) and the prefetch depth. A dynamic load (residency by
    /// use) gets the same room from the same selection: what it keeps by use leaves exactly the
    /// room a classic load would, so it never streams more than the classic load does (one
    /// rule, not two).
    ///
    /// The prefetch depth is the planner's choice unless the configuration sets it
    /// ([`crate::vram::Config::prefetch_depth`]): each depth of [`DEPTHS`] gives its own room,
    /// hence its own resident set, and the depth whose step the cost model predicts fastest
    /// wins (a deeper one only by [`DEEPER_GAIN`]). It needs the model's compute measured
    /// (a forward run): before that, the default depth.
    pub(in crate::loader) fn plan_group(
        &self,
        p: &mut Planner<'_>,
        m: &ModelPatcher,
        device: DeviceId,
        views: &[WeightView],
        already: ByteSize,
        options: &LoadOptions,
    ) -> GroupPlan {
        let (_, min_required, min_inf) = self.memory_to_keep_free(options, device);
        let depth = self.policy.config().prefetch_depth();
        // A whole model (a managed module) cannot stream: it loads fully or not at all.
        let whole = m.model().is_whole();
        let novram = !whole
            && self.policy.vram_state() == VramState::NoVram
            && self.policy.is_scheduled(device);
        let full = whole || (!novram && self.full_load(device, options));
        if full {
            let all = vec![true; views.len()];
            return GroupPlan {
                want: all.clone(),
                budget: None,
                room: ByteSize::ZERO,
                steady: all,
                depth,
                weighed: Vec::new(),
                prefetch_room: u64::MAX,
                keeper_room: options.memory_required,
            };
        }
        if novram {
            // ComfyUI gives this load a 0.1-byte budget: every castable weight streams, even
            // with `force_full_load`.
            let want = vec![false; views.len()];
            let room = self
                .prefetch_room(views, &want, p.free(device), options, device, depth)
                .saturating_sub(options.memory_required);
            return GroupPlan {
                want: want.clone(),
                budget: Some(ByteSize::ZERO),
                room,
                steady: want,
                depth,
                weighed: Vec::new(),
                prefetch_room: if device.is_cpu() {
                    u64::MAX
                } else {
                    room.bytes()
                },
                keeper_room: options.memory_required.saturating_add(room),
            };
        }
        let select = |p: &mut Planner<'_>, depth: usize| {
            self.partial_selection(
                p,
                device,
                views,
                already,
                options,
                (min_required, min_inf),
                depth,
            )
        };
        // The room the streamer will prefetch in, in both modes: every byte the load leaves free
        // beside the activation memory (the ledger is its gate; under residency by use the
        // keeper keeps this selection, and its prefetches book whatever is free beside it).
        let dynamic = self.dynamic_load(device, options);
        let free_here = p.free_to_keep(device).saturating_add(already);
        let streamer_room = |want: &[bool]| {
            if device.is_cpu() {
                u64::MAX
            } else {
                free_here
                    .saturating_sub(selection::wanted_bytes(views, want))
                    .saturating_sub(options.memory_required)
                    .bytes()
            }
        };
        self.seed_compute(m);
        let key = (
            m.model().id(),
            m.residency_signature(),
            free_here.bytes(),
            options.memory_required.bytes(),
            dynamic,
        );
        let (depth, weighed) = self.depth_for(m, views, key, depth, |d| {
            let selection = select(p, d);
            let room = streamer_room(&selection.0);
            self.predict_with(m, |i| selection.0[i], room, d, false)
        });
        let (classic, budget, room) = select(p, depth);
        // Residency by use: what is resident and current stays (pinned weights are loaded, as
        // asked); everything else becomes resident when a forward uses it, beside the room the
        // classic selection leaves for what it would stream.
        let want: Vec<bool> = if dynamic {
            views
                .iter()
                .map(|w| w.pinned || (w.current && w.on_device.is_some()))
                .collect()
        } else {
            classic.clone()
        };
        GroupPlan {
            budget: Some(if dynamic {
                selection::wanted_bytes(views, &want)
            } else {
                budget
            }),
            want,
            room,
            prefetch_room: streamer_room(&classic),
            // The classic selection may leave less than the activation memory asked for (under
            // ComfyUI's 128 MiB floor on a small device, every free byte): a keeper leaving the
            // activation memory free beside it kept ~2 MiB less of a 22.65 MiB model on a
            // 24 MiB device and swapped two weights in and out at every step.
            keeper_room: options
                .memory_required
                .saturating_add(room)
                .min(free_here.saturating_sub(selection::wanted_bytes(views, &classic))),
            steady: classic,
            depth,
            weighed,
        }
    }

    /// The prefetch depth a partial load of `m` runs with and the depths weighed for it (empty
    /// when not chosen): `default` unless the planner chooses ([`MemoryManager::chooses_depth`]);
    /// the choice kept for `key` if there is one; else every depth of [`DEPTHS`] predicted by
    /// `predict` (its own room and resident set), the fastest taken — a deeper one only by
    /// [`DEEPER_GAIN`] — and kept for `key`.
    fn depth_for(
        &self,
        m: &ModelPatcher,
        views: &[WeightView],
        key: DepthKey,
        default: usize,
        mut predict: impl FnMut(usize) -> crate::costs::StepPrediction,
    ) -> (usize, Vec<DepthOption>) {
        if !self.chooses_depth(m, views) {
            return (default, Vec::new());
        }
        let kept = self
            .depth_choices
            .lock()
            .iter()
            .find(|c| c.key == key)
            .map(|c| (c.depth, c.weighed.clone()));
        if let Some(kept) = kept {
            return kept;
        }
        let mut weighed = Vec::new();
        let mut best: Option<(usize, u64)> = None;
        for d in DEPTHS {
            let predicted = predict(d);
            weighed.push(DepthOption {
                depth: d,
                predicted,
            });
            let faster = best
                .is_none_or(|(_, ns)| (predicted.step_ns as f64) < ns as f64 * (1.0 - DEEPER_GAIN));
            if faster {
                best = Some((d, predicted.step_ns));
            }
        }
        let depth = best.map_or(default, |(d, _)| d);
        let mut choices = self.depth_choices.lock();
        choices.retain(|c| c.key.0 != key.0);
        if choices.len() >= DEPTH_CHOICES {
            choices.remove(0);
        }
        choices.push(DepthChoice {
            key,
            depth,
            weighed: weighed.clone(),
        });
        (depth, weighed)
    }

    /// Whether the planner chooses the prefetch depth of `m`'s partial load over `views`: the
    /// configuration leaves it open, the engine has lanes to prefetch on, the views are the
    /// whole model (a model split by a device map keeps the configured depth) and some of its
    /// compute is measured (before a forward ran, every depth predicts the copies alone).
    fn chooses_depth(&self, m: &ModelPatcher, views: &[WeightView]) -> bool {
        let model = m.model();
        self.policy.config().prefetch_depth.is_none()
            && self.engine.lanes() > 0
            && views.len() == model.len()
            && m.device_map().is_none()
            && (0..model.len()).any(|i| model.compute_ns(i).is_some())
    }

    /// A classic partial load's selection of `views` on `device`: the resident set, its weight
    /// budget, and the room left for streaming (the selection shrinks until that room fits).
    /// `keep` is the load's `(min_required, min_inf)` and `depth` the prefetch depth the room is
    /// made for.
    #[allow(clippy::too_many_arguments)]
    fn partial_selection(
        &self,
        p: &mut Planner<'_>,
        device: DeviceId,
        views: &[WeightView],
        already: ByteSize,
        options: &LoadOptions,
        (min_required, min_inf): (f64, f64),
        depth: usize,
    ) -> (Vec<bool>, ByteSize, ByteSize) {
        let free = p.free_to_keep(device);
        let budget = weight_budget(
            free,
            already,
            min_required,
            min_inf,
            self.policy.weight_ratio(device),
        );
        let select = |budget: ByteSize| {
            if already > ByteSize::ZERO {
                selection::grow(views, budget, options.force_patch_weights)
            } else {
                selection::from_scratch(views, budget, options.force_patch_weights, false)
            }
        };
        let mut want = select(budget);
        let mut budget = budget;
        // Room for the weights prefetched while this model streams (they are counted in the
        // ledger) and the one in use: without it a partial load that takes every free byte (the
        // 128 MiB floor on a small device) leaves streaming nothing to work with. Shrinking the
        // resident set can stream a larger weight than before, which needs more room: each
        // round shrinks the selected bytes (not only the budget, which can stay above them for
        // many rounds when weights are large) until the room is there or nothing is left.
        let mut needed = ByteSize::ZERO;
        for _ in 0..=views.len() {
            let wanted = selection::wanted_bytes(views, &want);
            let room_after = free.saturating_add(already).saturating_sub(wanted);
            // Half of what is free to this model (its own current copies included), as at its
            // first load: a reload counted them as taken, and planned a smaller window than its
            // streamer used.
            needed = self.prefetch_room(
                views,
                &want,
                free.saturating_add(already),
                options,
                device,
                depth,
            );
            if room_after >= needed || budget == ByteSize::ZERO {
                break;
            }
            budget = budget
                .min(wanted)
                .saturating_sub(needed.saturating_sub(room_after));
            want = select(budget);
        }
        // The plan's streaming room is the window beside the activation memory the load asked
        // for (`keep_free` to every booking already): counting it here too left by use keeping
        // `memory_required` less than classic.
        (want, budget, needed.saturating_sub(options.memory_required))
    }

    /// Free memory a partial load leaves for streaming: the activation memory asked for plus
    /// `depth` (the prefetch depth it runs with) times the largest weight that will stream (the prefetch window; on a GPU two
    /// more, for the weight in use and the one before it), when the engine prefetches — at most
    /// half of what is free, so the window never crowds out residency, but never less than the
    /// largest streamed weight itself (a forward holds the weight it computes with beside the
    /// prefetched ones; found by the model-based test on a simulated GPU, where less ran the
    /// forward out of device memory).
    ///
    /// On a GPU a streamed weight is device memory while it is copied and used, so the room for
    /// the weight in use is left without prefetch too (the simulated GPU, once it counted every
    /// resident copy, ran a lane-less forward out of memory beside a partial load that took
    /// every free byte). A budgeted CPU streams from host memory and keeps ComfyUI's figures.
    pub(in crate::loader) fn prefetch_room(
        &self,
        views: &[WeightView],
        want: &[bool],
        free: ByteSize,
        options: &LoadOptions,
        device: DeviceId,
        depth: usize,
    ) -> ByteSize {
        let depth = depth as u64;
        let prefetching = self.engine.lanes() > 0 && depth > 0;
        if !prefetching && device.is_cpu() {
            return ByteSize::ZERO;
        }
        let largest = views
            .iter()
            .zip(want)
            .filter(|(_, &w)| !w)
            .map(|(v, _)| v.size)
            .max()
            .unwrap_or(ByteSize::ZERO);
        if largest == ByteSize::ZERO {
            return ByteSize::ZERO;
        }
        if !prefetching {
            return largest.saturating_add(options.memory_required);
        }
        // The window, and on a GPU the weight in use beside it and the one used before it:
        // its memory returns only when its stream-ordered free runs, behind the copies queued
        // on its lane (without it, a prefetch was refused now and then, the miss that followed
        // dropped a prefetch already copied, and a steady step copied one weight more or less
        // than the plan predicted).
        let in_use = 2 * u64::from(!device.is_cpu());
        ByteSize(largest.bytes().saturating_mul(depth + in_use))
            .saturating_add(options.memory_required)
            .min(ByteSize(free.bytes() / 2))
            .max(largest.saturating_add(options.memory_required))
    }

    /// A weight of a lazily read model that its host tier can never hold.
    pub(in crate::loader) fn host_problem(&self, all: &[ModelPatcher]) -> Option<PlanProblem> {
        for m in all {
            let model = m.model();
            let Some(budget) = model.host_tier().and_then(|t| t.budget()) else {
                continue;
            };
            if let Some(s) = model
                .slots()
                .iter()
                .filter(|s| s.is_lazy())
                .find(|s| s.bytes() > budget)
            {
                return Some(PlanProblem::HostBudgetExceeded {
                    model: model.name().to_string(),
                    key: s.name().to_string(),
                    required: s.bytes(),
                    budget,
                });
            }
        }
        None
    }

    /// The checks that can fail for a reason other than memory, made before anything moves.
    pub(in crate::loader) fn validate_request(&self, m: &ModelPatcher) -> Result<()> {
        if m.model().is_whole()
            && (m.devices().len() > 1
                || m.device_map()
                    .is_some_and(|_| (0..m.model().len()).any(|i| m.streams_always(i))))
        {
            return Err(Error::Device {
                device: m.load_device().to_string(),
                reason: format!(
                    "`{}` is loaded whole (a `Managed` model: one candle module computing on one device), so it cannot be split by a device map; port its layers with `residency::nn` to split it, or drop the map",
                    m.model().name()
                ),
            });
        }
        let name = m.model().name();
        for device in m.devices() {
            let missing = match device {
                DeviceId::Cpu => None,
                DeviceId::Cuda(n) if self.policy.hardware().gpu(n).is_none() => Some(format!(
                    "this machine has {} CUDA GPU(s)",
                    self.policy.hardware().gpus.len()
                )),
                DeviceId::Sim(n) if n >= self.policy.config().sim_gpus.len() => Some(format!(
                    "this manager has {} simulated GPU(s); each --sim-gpu adds one",
                    self.policy.config().sim_gpus.len()
                )),
                _ => None,
            };
            if let Some(have) = missing {
                let role = if device == m.load_device() {
                    "is set to load on"
                } else {
                    "has a device map that places weights on"
                };
                return Err(Error::Device {
                    device: device.to_string(),
                    reason: format!(
                        "model `{name}` {role} {device}, which does not exist ({have})"
                    ),
                });
            }
        }
        // A weight is fetched whole: one larger than its device's memory can never be used there,
        // whatever is evicted or streamed. Refused now rather than at the forward that needs it.
        for (i, slot) in m.model().slots().iter().enumerate() {
            let device = m.weight_device(i);
            if device == DeviceId::Cpu {
                continue;
            }
            let total = self.policy.total_memory(device);
            let size = m.resident_size(i);
            if size > total {
                return Err(Error::BudgetExceeded {
                    model: format!("`{name}` weight `{}`", slot.name()),
                    device: device.to_string(),
                    required: size,
                    budget: total,
                });
            }
        }
        m.validate()
    }
}

/// Bytes of `m`'s clean weights a load building `want` reads from files: lazily read weights to
/// build whose host copy is not held now.
pub(in crate::loader) fn from_disk(
    m: &ModelPatcher,
    views: &[WeightView],
    want: &[bool],
) -> ByteSize {
    let model = m.model();
    let Some(tier) = model.host_tier() else {
        return ByteSize::ZERO;
    };
    model
        .slots()
        .iter()
        .enumerate()
        .filter(|(i, s)| {
            want[*i] && !views[*i].current && s.is_lazy() && !tier.holds(model.id(), *i)
        })
        .map(|(_, s)| s.bytes())
        .sum()
}

/// Drops wanted, unpinned weights smallest first until the wanted bytes are at most `room`.
/// Returns whether that was enough.
pub(in crate::loader) fn shrink_to_fit(
    views: &[WeightView],
    want: &mut [bool],
    room: ByteSize,
) -> bool {
    let mut order: Vec<(ByteSize, usize)> = views
        .iter()
        .enumerate()
        .filter(|(i, w)| want[*i] && !w.pinned)
        .map(|(i, w)| (w.size, i))
        .collect();
    order.sort();
    let mut bytes = selection::wanted_bytes(views, want);
    for (size, i) in order {
        if bytes <= room {
            break;
        }
        want[i] = false;
        bytes = bytes.saturating_sub(size);
    }
    bytes <= room
}
