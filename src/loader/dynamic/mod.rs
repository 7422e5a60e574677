//! Residency by use (ComfyUI's DynamicVRAM, docs/ARCHITECTURE.md §5.3): the manager's keeper.
//!
//! In dynamic mode a load registers and prioritizes its models and moves nothing; a weight
//! becomes resident the first time a forward uses it, when the ledger has room — or when
//! evicting copies of lower priority makes room — and streams otherwise. One priority order
//! decides every eviction ([`victim_order`]):
//!
//! 1. the model loaded least recently goes first (the registry's order, most recently used first;
//!    kept models never);
//! 2. inside a model, weights not used within the model's last forward's worth of uses (*stale*:
//!    a branch not taken, an expert not routed) go before the ones in use, the least used first
//!    (then the longest unused): recency and frequency, so irregular uses do not push out a
//!    stable prefix and a stable prefix not used this step does not push out what is used.
//!    Uses are counted before the current forward, so a weight the forward used already is
//!    not one use ahead of those it has yet to use;
//! 3. then the weights outside the classic partial load's selection (made at the model's load,
//!    `Usage::choose`) before the ones in it: a dense model's kept set converges on the
//!    classic one, whatever order its weights are used in;
//! 4. then the weights used later in a forward (first-use order) before the earlier ones.
//!
//! A fault-in may evict a weight of its own model only when that weight is stale, outside the
//! classic selection where the one faulting in is in it, or comes later in first-use order;
//! doing so (but for the selection's taking the others' room, which they never take back)
//! sets the model's *watermark* at the evicted weight's position: weights from there on evict
//! nothing of their class (no thrash from one forward to the next), until the model is loaded
//! again. A stale victim must also be used no more often than
//! the weight taking its place (an admission test: a weight used once does not evict one used
//! at every step).
//!
//! Locks: [`Dynamic::lock`] (`Rank::Dynamic`) is held while a fault-in decides, evicts and
//! books, while a booking is committed, and while the manager notes a device's resident figure,
//! so the ledger's resident column and the models' residency change together. It is never held
//! by the manager lock's callers across a load's execution, and a fault-in never takes the
//! manager lock: loads on other devices do not wait for it, and a device being loaded is closed
//! to fault-ins (`Ledger::keep_shortfall` says so).
//!
//! This module decides; `report.rs` reads what it recorded (each device's hits, misses and its
//! first 2^18 uses) into [`DynamicDeviceReport`] and [`DynamicLayerReport`], beside Belady's
//! rule, the best fixed set and an upper bound on any policy for the same uses.

use std::sync::Arc;

use candle_core::Tensor;

use super::ledger::{FaultColumn, Ledger};
use super::ViewEntry;
use crate::device::DeviceHold;
use crate::lock::{Mutex, Rank};
use crate::offload::{Keeper, PrefetchGate, Reservation};
use crate::patcher::ModelPatcher;
use crate::size::ByteSize;
use crate::vram::DeviceId;
use crate::weights::{Model, SlotResidency, WeightUse, NO_POSITION};

mod report;

pub use report::{DynamicDeviceReport, DynamicLayerReport};

/// Uses recorded per device for the offline optimum, at most.
const TRACE_LIMIT: usize = 1 << 18;

/// One weight's place in the eviction order: smaller goes first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct VictimKey {
    /// The model's rank, reversed: the least recently loaded model first.
    model: std::cmp::Reverse<usize>,
    /// Uses so far: the least used first (a dense model's weights are used equally often, and
    /// fall through to their positions; experts and branches are ranked by how often).
    count: u32,
    /// In use (false first: among equally used weights, stale ones go first).
    fresh: bool,
    /// The longest unused first (stale weights; zero for weights in use).
    age: std::cmp::Reverse<u64>,
    /// Outside the classic load's selection first (`WeightUse::chosen`).
    pub(crate) chosen: bool,
    /// Used later in a forward first.
    position: std::cmp::Reverse<usize>,
}

/// Whether a use is recent: within the model's last forward's worth of uses.
fn is_fresh(u: &WeightUse, window: usize) -> bool {
    u.age < window.max(1) as u64
}

/// The key of a weight of the model at registry rank `rank` (0: loaded most recently).
pub(crate) fn victim_key(rank: usize, u: &WeightUse, window: usize) -> VictimKey {
    let fresh = is_fresh(u, window);
    VictimKey {
        model: std::cmp::Reverse(rank),
        count: u.settled_count(),
        fresh,
        age: std::cmp::Reverse(if fresh { 0 } else { u.age }),
        chosen: u.chosen,
        position: std::cmp::Reverse(u.position),
    }
}

/// A resident copy that may be evicted.
#[derive(Debug, Clone)]
pub(crate) struct Candidate {
    pub(crate) model: Arc<Model>,
    pub(crate) index: usize,
    pub(crate) bytes: ByteSize,
    pub(crate) key: VictimKey,
}

/// Every evictable resident copy on `device` of the registered `models` (most recently loaded
/// first; `kept` ones skipped), in eviction order; pinned copies are not evictable.
pub(crate) fn victim_order(
    models: &[Arc<Model>],
    device: DeviceId,
    is_kept: impl Fn(u64) -> bool,
) -> Vec<Candidate> {
    victims_of(models, device, is_kept, false)
}

/// [`victim_order`]; with `pinned_last`, pinned copies follow every other (in the same order).
fn victims_of(
    models: &[Arc<Model>],
    device: DeviceId,
    is_kept: impl Fn(u64) -> bool,
    pinned_last: bool,
) -> Vec<Candidate> {
    let mut out = Vec::new();
    let mut pinned_out = Vec::new();
    for (rank, m) in models.iter().enumerate() {
        if is_kept(m.id()) {
            continue;
        }
        let usage = m.usage();
        let window = usage.distinct();
        let resident = m.state().resident_on(device);
        for (index, bytes, pinned) in resident {
            if pinned && !pinned_last {
                continue;
            }
            let u = usage.of(index);
            let c = Candidate {
                model: Arc::clone(m),
                index,
                bytes,
                key: victim_key(rank, &u, window),
            };
            if pinned {
                pinned_out.push(c);
            } else {
                out.push(c);
            }
        }
    }
    out.sort_by_key(|c| c.key);
    pinned_out.sort_by_key(|c| c.key);
    out.extend(pinned_out);
    out
}

/// Hits and misses of residency by use on one device, and the uses they came from.
#[derive(Debug, Default)]
struct DeviceStats {
    device: Option<DeviceId>,
    hits: u64,
    misses: u64,
    faults_in: u64,
    evictions: u64,
    evicted: ByteSize,
    past_watermark: u64,
    /// The most bytes resident at once, as the ledger's resident column had it.
    peak_resident: ByteSize,
    /// The uses, in order: (model id, weight index, bytes).
    trace: Vec<(u64, u32, u64)>,
    /// Whether each use of `trace` was a hit.
    trace_hits: Vec<bool>,
    truncated: bool,
}

/// The manager's residency by use: decides fault-ins and evictions, keeps the statistics.
pub(crate) struct Dynamic {
    ledger: Arc<Ledger>,
    view: Arc<Mutex<Arc<[ViewEntry]>>>,
    kept: Arc<Mutex<std::collections::HashMap<u64, usize>>>,
    /// The manual-cast caches the manager attached (their casts go before any weight).
    casts: Arc<Mutex<Vec<std::sync::Weak<crate::ops::CastCache>>>>,
    /// The ledger's faulting column, as the gate fault-ins book on.
    faults: Arc<dyn PrefetchGate>,
    lock: Mutex<()>,
    stats: Mutex<Vec<DeviceStats>>,
}

impl Dynamic {
    pub(crate) fn new(
        ledger: Arc<Ledger>,
        view: Arc<Mutex<Arc<[ViewEntry]>>>,
        kept: Arc<Mutex<std::collections::HashMap<u64, usize>>>,
        casts: Arc<Mutex<Vec<std::sync::Weak<crate::ops::CastCache>>>>,
    ) -> Dynamic {
        Dynamic {
            faults: Arc::new(FaultColumn(Arc::clone(&ledger))),
            ledger,
            view,
            kept,
            casts,
            lock: Mutex::new(Rank::Dynamic, ()),
            stats: Mutex::new(Rank::DynamicStats, Vec::new()),
        }
    }

    /// The lock under which residency and the ledger's resident column change together.
    pub(crate) fn lock(&self) -> crate::lock::MutexGuard<'_, ()> {
        self.lock.lock()
    }

    /// Fills `models` with the registered models, most recently loaded first (as of the last
    /// manager call), and gives the rank of `patcher`'s model among them when weight `index`,
    /// as `patcher` builds it, is what the registered patcher computes with on the device it
    /// was loaded to: only such a copy is kept (a handle loaded elsewhere, or another clone's
    /// patch list, streams — a rollback could not rebuild its copies). The caller declares
    /// `models` before taking [`Dynamic::lock`]: one of them may be a model's last handle, and
    /// it must drop after the lock.
    fn registered_into(
        &self,
        patcher: &ModelPatcher,
        index: usize,
        models: &mut Vec<Arc<Model>>,
    ) -> Option<usize> {
        let view = Arc::clone(&self.view.lock());
        models.reserve(view.len());
        let mut rank = None;
        for e in view.iter() {
            let Some(m) = e.model.upgrade() else { continue };
            if rank.is_none()
                && Arc::ptr_eq(&m, patcher.model())
                && e.device == patcher.load_device()
                && e.fingerprints.get(index) == Some(&patcher.fingerprint(index))
            {
                rank = Some(models.len());
            }
            models.push(m);
        }
        rank
    }

    fn is_kept(&self, id: u64) -> bool {
        self.kept.lock().get(&id).is_some_and(|&n| n > 0)
    }

    fn with_stats<R>(&self, device: DeviceId, f: impl FnOnce(&mut DeviceStats) -> R) -> R {
        let mut all = self.stats.lock();
        let pos = match all.iter().position(|s| s.device == Some(device)) {
            Some(p) => p,
            None => {
                // A device's first use since the start or a reset: what is resident already (a
                // load's copies) is room the optimum has too, though no fault-in counted it. The
                // ledger is asked outside the statistics' lock (it ranks below).
                drop(all);
                let resident = self.ledger.resident(device);
                all = self.stats.lock();
                match all.iter().position(|s| s.device == Some(device)) {
                    Some(p) => p,
                    None => {
                        all.push(DeviceStats {
                            device: Some(device),
                            peak_resident: resident,
                            ..DeviceStats::default()
                        });
                        all.len() - 1
                    }
                }
            }
        };
        f(&mut all[pos])
    }

    /// Drops resident copy `index` of `model` on `device` for a fault-in (when it is still
    /// there): the residency and the ledger change together (the caller holds the lock).
    fn evict(&self, model: &Model, index: usize, device: DeviceId) -> ByteSize {
        let old = model.state_mut().evict(index, Some(device));
        let SlotResidency::Resident { bytes, .. } = old else {
            return ByteSize::ZERO;
        };
        self.ledger.evicted(device, bytes);
        tracing::debug!(model = model.name(), weight = index, %device, bytes = bytes.bytes(), "dynamic_evict");
        self.with_stats(device, |s| {
            s.evictions += 1;
            s.evicted = s.evicted.saturating_add(bytes);
        });
        bytes
    }

    /// Drops the cached manual casts on `device` (each cache returns its bookings); their bytes.
    fn drop_casts(&self, device: DeviceId) -> ByteSize {
        super::clear_casts(&self.casts, Vec::new(), device)
    }

    /// Evicts the first of `victims` (in order) until `short` bytes are freed; nothing when they
    /// cannot free that much. An eviction inside `model` of a weight in use that was used as
    /// often as the one faulting in (`count`: its position decided, the dense pattern) lowers
    /// the model's watermark to the evicted weight's position — unless the one faulting in is
    /// of the classic selection and the evicted one is not (`chosen`): that one never takes the
    /// room back. Whether it freed enough.
    fn evict_enough(
        &self,
        model: &Arc<Model>,
        victims: &[Candidate],
        short: ByteSize,
        device: DeviceId,
        window: usize,
        (count, chosen): (u32, bool),
    ) -> bool {
        let mut enough = ByteSize::ZERO;
        let mut take = 0;
        for c in victims {
            if enough >= short {
                break;
            }
            enough = enough.saturating_add(c.bytes);
            take += 1;
        }
        if enough < short {
            return false;
        }
        for c in &victims[..take] {
            self.evict(&c.model, c.index, device);
            if Arc::ptr_eq(&c.model, model) {
                let u = model.usage().of(c.index);
                let across = chosen && !u.chosen;
                if is_fresh(&u, window)
                    && u.position != NO_POSITION
                    && u.settled_count() >= count
                    && !across
                {
                    model.usage().lower_watermark(u.position);
                }
            }
        }
        true
    }

    /// Makes room to keep weight `index` of `patcher` (`bytes`, with `room` left free beside
    /// what is kept; its model at registry rank `my_rank` among `models`): cached casts first,
    /// then copies of lower priority by the one order, evicted into `victims` (dropped by the
    /// caller after the lock) until what the device lacks ([`Ledger::keep_shortfall`];
    /// `in_flight`: the copy is booked in flight already, a prefetched one) is freed; nothing
    /// while a load closes the device. Past the model's watermark a weight outside the classic selection
    /// evicts nothing, one in it only copies outside it. Whether the room is there; a refusal
    /// is recorded on the model's usage (the later weights as large, when it can never fit
    /// beside what stays; else every later weight, for this forward).
    #[allow(clippy::too_many_arguments)]
    fn room_to_keep(
        &self,
        patcher: &ModelPatcher,
        index: usize,
        (bytes, room): (ByteSize, ByteSize),
        my_rank: usize,
        models: &[Arc<Model>],
        victims: &mut Vec<Candidate>,
        in_flight: bool,
    ) -> bool {
        let model = patcher.model();
        let device = patcher.weight_device(index);
        let me = model.usage().of(index);
        let shortfall = || self.ledger.keep_shortfall(device, bytes, room, in_flight);
        let Some(mut short) = shortfall() else {
            return false;
        };
        if short > ByteSize::ZERO && self.drop_casts(device) > ByteSize::ZERO {
            // Cached casts go before any weight.
            short = shortfall().unwrap_or(short);
        }
        if short == ByteSize::ZERO {
            return true;
        }
        // Past the watermark a weight evicts nothing of its own model's weights of its class
        // (no thrash between forwards); one of the classic selection still takes the room of
        // those outside it, which never take it back.
        let past = me.position != NO_POSITION && me.position >= model.usage().watermark();
        if past && !me.chosen {
            self.with_stats(device, |s| s.past_watermark += 1);
            return false;
        }
        let window = model.usage().distinct();
        victims.extend(
            self.lower_priority(patcher, index, my_rank, models)
                .into_iter()
                .filter(|c| !past || !Arc::ptr_eq(&c.model, model) || !c.key.chosen),
        );
        let mine = (me.settled_count(), me.chosen);
        if self.evict_enough(model, victims, short, device, window, mine) {
            return true;
        }
        // Not enough to give of lower priority: nothing evicted, it streams.
        if self.never_fits(device, bytes, room, victims) {
            // Not for want of a moment's room: the later weights smaller than it are kept as
            // they fit (a 64 KiB table first in use on a 112 KiB device left every 16 KiB
            // layer streaming, where the classic load keeps three).
            model.usage().refuse_as_large(bytes);
        } else if me.position != NO_POSITION {
            model.usage().refuse_from(me.position);
        }
        false
    }

    /// The copies of lower priority than weight `index` of `patcher` (its model at registry
    /// rank `my_rank` among `models`), in eviction order: lower-ranked models' and, in its own
    /// model, the weights whose key is below its own — used less often, or as often and stale,
    /// or as often and later in a forward (an admission test: a weight used once does not evict
    /// one used at every step, and a dense model's later weights do not push out its prefix).
    fn lower_priority(
        &self,
        patcher: &ModelPatcher,
        index: usize,
        my_rank: usize,
        models: &[Arc<Model>],
    ) -> Vec<Candidate> {
        let model = patcher.model();
        let device = patcher.weight_device(index);
        let mine = victim_key(my_rank, &model.usage().of(index), model.usage().distinct());
        victim_order(models, device, |id| self.is_kept(id))
            .into_iter()
            .filter(|c| {
                let rank = c.key.model.0;
                if rank > my_rank {
                    return true;
                }
                rank == my_rank && Arc::ptr_eq(&c.model, model) && c.index != index && c.key < mine
            })
            .collect()
    }

    /// Whether `bytes` can never be kept on `device` with `room` free beside what stays there,
    /// even with every copy of `victims` evicted and every booking that returns by itself
    /// returned ([`Ledger::keep_excess`]): a refusal that is not the moment's.
    fn never_fits(
        &self,
        device: DeviceId,
        bytes: ByteSize,
        room: ByteSize,
        victims: &[Candidate],
    ) -> bool {
        let evictable: ByteSize = victims.iter().map(|c| c.bytes).sum();
        self.ledger.keep_excess(device, bytes, room) > evictable
    }

    /// Counts a copy kept by use on `device`, and the most bytes resident there at once.
    fn count_fault_in(&self, device: DeviceId) {
        let resident = self.ledger.resident(device);
        self.with_stats(device, |s| {
            s.faults_in += 1;
            s.peak_resident = s.peak_resident.max(resident);
        });
    }

    /// Forgets the statistics and traces (a new measurement starts).
    pub(crate) fn reset_stats(&self) {
        self.stats.lock().clear();
    }
}

impl Keeper for Dynamic {
    fn book(&self, patcher: &ModelPatcher, index: usize, room: ByteSize) -> Option<Reservation> {
        if patcher.streams_always(index) {
            // Mapped to the host by a device map: it never becomes resident.
            return None;
        }
        let model = patcher.model();
        // The booking's device and size, decided once: the commit checks them, never re-reads.
        let device = patcher.weight_device(index);
        let bytes = patcher.resident_size(index);
        let me = model.usage().of(index);
        if model.usage().held_back(me.position, bytes) {
            // A weight earlier in this forward was refused: this one, of lower priority, is
            // not kept ahead of it (it comes back by use in a later forward).
            return None;
        }
        if !self.ledger.probe_allows(device, bytes, room) {
            // The driver's figure refuses the copy whatever is evicted (evicting frees memory
            // only once the frees run): evict nothing, stream.
            if me.position != NO_POSITION {
                model.usage().refuse_from(me.position);
            }
            return None;
        }
        // Declared before the lock: the last handle of a model can be among them, and dropping
        // a model unpins its weights, which waits on the device — after the lock.
        let mut models: Vec<Arc<Model>> = Vec::new();
        let mut victims: Vec<Candidate> = Vec::new();
        let _g = self.lock.lock();
        // Only a registered model keeps copies (the ledger counts the registry's).
        let my_rank = self.registered_into(patcher, index, &mut models)?;
        if !self.room_to_keep(
            patcher,
            index,
            (bytes, room),
            my_rank,
            &models,
            &mut victims,
            false,
        ) {
            return None;
        }
        Reservation::take(&self.faults, device, bytes, room)
    }

    fn make_room(
        &self,
        patcher: &ModelPatcher,
        index: usize,
        bytes: ByteSize,
        spare: bool,
    ) -> bool {
        let model = patcher.model();
        let device = patcher.weight_device(index);
        // Before the lock, so they drop after it ([`Keeper::book`]).
        let mut models: Vec<Arc<Model>> = Vec::new();
        let mut victims: Vec<Candidate> = Vec::new();
        let _g = self.lock.lock();
        let Some(mut short) = self.ledger.transit_shortfall(device, bytes) else {
            return false;
        };
        if short > ByteSize::ZERO && self.drop_casts(device) > ByteSize::ZERO {
            short = self
                .ledger
                .transit_shortfall(device, bytes)
                .unwrap_or(short);
        }
        if short == ByteSize::ZERO {
            return true;
        }
        // A weight in use outranks every kept copy: the lowest priority go first.
        self.registered_into(patcher, index, &mut models);
        let window = model.usage().distinct();
        // The weight's own slot included: a copy resident there is another patcher's (this
        // one's would not stream), and the weight in use needs the room. A keep guard protects
        // a model from the others, not from its own weight in use.
        // Pinned copies last: a pin keeps a weight through partial unloads, but a weight that
        // must stream to run needs the room more (the pinned one comes back by use).
        victims.extend(
            victims_of(
                &models,
                device,
                |id| id != model.id() && self.is_kept(id),
                true,
            )
            .into_iter()
            .filter(|c| !spare || !Arc::ptr_eq(&c.model, model)),
        );
        self.evict_enough(model, &victims, short, device, window, (u32::MAX, false))
    }

    fn commit(
        &self,
        patcher: &ModelPatcher,
        index: usize,
        tensor: &Tensor,
        hold: DeviceHold,
        booking: Reservation,
    ) -> bool {
        let device = booking.device();
        let bytes = booking.bytes();
        // The weight moved (a placement chose another device) or changed size since it was
        // booked: not this booking's copy. The booking is returned as it drops.
        if patcher.weight_device(index) != device || patcher.resident_size(index) != bytes {
            return false;
        }
        // Built before the lock: a quantized weight's resident form may read back or upload.
        let Ok((weight, size)) = patcher.resident_from(index, tensor.clone(), device) else {
            return false;
        };
        if size != bytes {
            return false;
        }
        // A weight that becomes GPU-resident is unpinned, and unpinning waits for the copies out
        // of it; the registered models may hold a model's last handle: both dropped after the
        // lock.
        let released;
        let mut models: Vec<Arc<Model>> = Vec::new();
        let g = self.lock.lock();
        // A device closed by a load or a reclaim, or a model that left the registry (an unload
        // of everything, a cleanup), keeps nothing: the ledger those decided on does not have
        // this copy, and would not count it.
        if self.ledger.is_closed(device)
            || self.registered_into(patcher, index, &mut models).is_none()
        {
            drop(g);
            return false;
        }
        match install(patcher, index, (weight, device, bytes), hold, || true) {
            Ok(pins) => released = pins,
            Err(_) => {
                drop(g);
                return false;
            }
        }
        FaultColumn(Arc::clone(&self.ledger)).commit(booking);
        self.count_fault_in(device);
        drop(g);
        drop(released);
        true
    }

    fn keep_prefetched(
        &self,
        patcher: &ModelPatcher,
        index: usize,
        tensor: &Tensor,
        hold: DeviceHold,
        booking: Reservation,
        room: ByteSize,
    ) -> Option<(DeviceHold, Reservation)> {
        let device = booking.device();
        let bytes = patcher.resident_size(index);
        let usage = patcher.model().usage();
        let position = usage.of(index).position;
        if device != patcher.weight_device(index)
            || booking.bytes() != bytes
            || patcher.streams_always(index)
            // A weight earlier in this forward was refused: not kept ahead of it (`book`).
            || usage.held_back(position, bytes)
        {
            return Some((hold, booking));
        }
        // Built before the lock: a quantized weight's resident form may read back or upload.
        let Ok((weight, size)) = patcher.resident_from(index, tensor.clone(), device) else {
            return Some((hold, booking));
        };
        if size != bytes {
            return Some((hold, booking));
        }
        // Before the lock, so they drop after it (`book`).
        let mut models: Vec<Arc<Model>> = Vec::new();
        let mut victims: Vec<Candidate> = Vec::new();
        let released;
        {
            let _g = self.lock.lock();
            let Some(rank) = self.registered_into(patcher, index, &mut models) else {
                return Some((hold, booking));
            };
            // Room by the one priority order, as for a fault-in: a prefetched weight of the
            // classic selection takes the room of the copies below it (keeping only into free
            // room, by use kept 0.76 MiB less of the main job's denoiser than classic at
            // 10 MiB, beside another model's copies it could not use).
            if !self.room_to_keep(
                patcher,
                index,
                (bytes, room),
                rank,
                &models,
                &mut victims,
                true,
            ) {
                return Some((hold, booking));
            }
            // The in-flight booking becomes resident bytes in the ledger as the slot does.
            let ledger = &self.ledger;
            match install(patcher, index, (weight, device, bytes), hold, || {
                ledger.keep_prefetched(device, bytes, room)
            }) {
                Ok(pins) => released = pins,
                Err(hold) => return Some((hold, booking)),
            }
            booking.absorb();
            self.count_fault_in(device);
        }
        // Unpinning (the weight is GPU-resident now) waits for its copies: after every lock.
        drop(released);
        None
    }

    fn note_use(&self, patcher: &ModelPatcher, index: usize, hit: bool) {
        let device = patcher.weight_device(index);
        let model = patcher.model().id();
        let bytes = patcher.resident_size(index).bytes();
        self.with_stats(device, |s| {
            if hit {
                s.hits += 1;
            } else {
                s.misses += 1;
            }
            if s.trace.len() < TRACE_LIMIT {
                s.trace.push((model, index as u32, bytes));
                s.trace_hits.push(hit);
            } else {
                s.truncated = true;
            }
        });
    }
}

/// Makes `weight` (on `device`, `bytes`) weight `index`'s resident copy when its slot is still
/// offloaded and `ledger_moves` — the ledger's side of the same move — agrees; the pins it
/// released, for the caller to drop after its locks, or the hold back when nothing was kept.
/// The caller holds the keeper's lock.
fn install(
    patcher: &ModelPatcher,
    index: usize,
    (weight, device, bytes): (crate::weights::ResidentWeight, DeviceId, ByteSize),
    hold: DeviceHold,
    ledger_moves: impl FnOnce() -> bool,
) -> Result<Vec<Arc<crate::weights::PinnedWeight>>, DeviceHold> {
    let mut st = patcher.model().state_mut();
    if !matches!(st.slots().get(index), Some(SlotResidency::Offloaded)) || !ledger_moves() {
        return Err(hold);
    }
    st.set_held(
        index,
        SlotResidency::Resident {
            tensor: weight,
            fingerprint: patcher.fingerprint(index),
            device,
            bytes,
        },
        hold,
    );
    Ok(st.take_released())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_order_puts_older_models_then_the_least_used_stale_and_later_weights_first() {
        let w = |position, age, count| WeightUse {
            position,
            age,
            count,
            chosen: false,
            this_forward: false,
        };
        let window = 10;
        let newer_early = victim_key(0, &w(0, 1, 5), window);
        let newer_late = victim_key(0, &w(9, 1, 5), window);
        let newer_stale = victim_key(0, &w(1, 50, 2), window);
        let newer_stale_used_more = victim_key(0, &w(2, 50, 9), window);
        let older = victim_key(1, &w(0, 0, 100), window);
        let mut keys = [
            newer_early,
            newer_late,
            newer_stale,
            newer_stale_used_more,
            older,
        ];
        keys.sort();
        // The older model first; then the least used (2, 5, 5, 9); among equals stale before in
        // use, later before earlier.
        assert_eq!(
            keys,
            [
                older,
                newer_stale,
                newer_late,
                newer_early,
                newer_stale_used_more,
            ]
        );
    }
}
