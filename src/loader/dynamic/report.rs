//! The offline side of residency by use: what it did on each device and layer, beside Belady's
//! rule, the best fixed set in hindsight and an upper bound on any policy, all computed from the
//! uses [`Dynamic`] recorded. Nothing here decides residency.
//!
//! [`DynamicDeviceReport`] (per device) and [`DynamicLayerReport`] (per layer of a model) are
//! built under the statistics' lock from a copy of each device's trace (its first 2^18 uses);
//! the offline figures are computed after the lock is let go: Belady's rule and the bound in
//! O(uses log uses), the best fixed set in O(uses + weights log weights).

use super::Dynamic;
use crate::size::ByteSize;
use crate::vram::DeviceId;

/// What residency by use did on one device, beside the offline optimum for the same uses.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct DynamicDeviceReport {
    /// The device.
    pub device: DeviceId,
    /// Uses served by a resident copy.
    pub hits: u64,
    /// Uses that streamed (the copy kept or not).
    pub misses: u64,
    /// Misses whose copy was kept resident.
    pub faults_in: u64,
    /// Copies evicted by fault-ins.
    pub evictions: u64,
    /// Their bytes.
    pub evicted: ByteSize,
    /// Misses past their model's watermark, which streamed without trying to evict.
    pub past_watermark: u64,
    /// The most bytes kept resident at once: the room the optimum below is given.
    pub room: ByteSize,
    /// Uses recorded for the optimum (at most 2^18; `truncated` beyond).
    pub uses: u64,
    /// Whether uses were left out of the optimum's trace.
    pub truncated: bool,
    /// Hits of Belady's offline optimum on the same uses and room (evict the copy used farthest
    /// in the future; with sizes, a copy is kept only when what it displaces is used later): the
    /// bound an online order is measured against. Computed by
    /// [`crate::loader::MemoryManager::dynamic_report`] (O(uses log uses)); `None` in the
    /// cheap [`crate::loader::MemoryReport`].
    pub optimum_hits: Option<u64>,
    /// Hits of the best fixed set in hindsight for the same uses and room: the weights with the
    /// most repeat uses per byte that fit, each kept from its first use (greedy; exact for
    /// equal sizes). On uses drawn independently from a stable popularity (routing with a fixed
    /// skew) a fixed set is what an online order can hope for; Belady's optimum also sees
    /// which draw comes next (and, with unequal sizes, is itself a heuristic: the fixed set
    /// can score more). Both count uses, not bytes: they favour small weights, where the bytes
    /// an online order saves favour the most used (its count-first key). Computed with
    /// `optimum_hits`.
    pub fixed_hits: Option<u64>,
    /// A true upper bound on the hits any policy could score on the same uses in the same room,
    /// the weights resident at the start included: a fractional relaxation over bytes × time
    /// (a repeat use hits only if its weight stayed resident since its previous use, and the
    /// resident bytes integrated over the uses are at most the room × the uses). With unequal sizes Belady's rule (`optimum_hits`) is a heuristic, not an
    /// optimum, and can score below the fixed set; "x points from the bound" is a real gap.
    /// Computed with `optimum_hits`.
    pub bound_hits: Option<u64>,
}

impl DynamicDeviceReport {
    /// Hits over uses.
    pub fn hit_rate(&self) -> f64 {
        let uses = self.hits + self.misses;
        if uses == 0 {
            return 0.0;
        }
        self.hits as f64 / uses as f64
    }

    /// The optimum's hits over the uses it saw, when computed.
    pub fn optimum_hit_rate(&self) -> Option<f64> {
        Some(ratio(self.optimum_hits?, self.uses))
    }

    /// The best fixed set's hits over the same uses, when computed.
    pub fn fixed_hit_rate(&self) -> Option<f64> {
        Some(ratio(self.fixed_hits?, self.uses))
    }

    /// The upper bound's hits over the same uses, when computed.
    pub fn bound_hit_rate(&self) -> Option<f64> {
        Some(ratio(self.bound_hits?, self.uses))
    }
}

impl std::fmt::Display for DynamicDeviceReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: {} hits / {} misses ({:.1} %), {} faults-in, {} evictions ({}), {} kept at most",
            self.device,
            self.hits,
            self.misses,
            100.0 * self.hit_rate(),
            self.faults_in,
            self.evictions,
            self.evicted,
            self.room
        )?;
        if let Some(rate) = self.optimum_hit_rate() {
            write!(f, "; Belady's rule {:.1} % in the same room", 100.0 * rate)?;
            if let Some(fixed) = self.fixed_hit_rate() {
                write!(f, ", the best fixed set {:.1} %", 100.0 * fixed)?;
            }
            if let Some(bound) = self.bound_hit_rate() {
                write!(f, ", no policy above {:.1} %", 100.0 * bound)?;
            }
            if self.truncated {
                write!(f, " (its first {} uses)", self.uses)?;
            }
        }
        Ok(())
    }
}

/// What residency by use did for one layer of one model on one device (a mixture of experts'
/// expert cache, layer by layer), beside Belady's offline optimum: the optimum is the one for
/// the whole device (its room shared by every layer, as the online order's is), its hits
/// counted per layer.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct DynamicLayerReport {
    /// The device.
    pub device: DeviceId,
    /// The model's name.
    pub model: String,
    /// The layer: weight names up to their first number (`blk.3`), as
    /// [`crate::DeviceMap::auto`] groups them; `?` for a model no longer registered.
    pub layer: String,
    /// Uses of the layer's weights recorded (the device's first 2^18 uses at most).
    pub uses: u64,
    /// Of them, served by a resident copy.
    pub hits: u64,
    /// Of them, hits of Belady's optimum for the device's uses and room.
    pub optimum_hits: u64,
    /// Of them, hits of the best fixed set in hindsight for the device's uses and room
    /// ([`DynamicDeviceReport::fixed_hits`]).
    pub fixed_hits: u64,
}

impl DynamicLayerReport {
    /// Hits over uses.
    pub fn hit_rate(&self) -> f64 {
        ratio(self.hits, self.uses)
    }
    /// The optimum's hits over uses.
    pub fn optimum_hit_rate(&self) -> f64 {
        ratio(self.optimum_hits, self.uses)
    }
    /// The best fixed set's hits over uses.
    pub fn fixed_hit_rate(&self) -> f64 {
        ratio(self.fixed_hits, self.uses)
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

impl std::fmt::Display for DynamicLayerReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {} {}: {} uses, {:.1} % hits, Belady's rule {:.1} %, the best fixed set {:.1} %",
            self.device,
            self.model,
            self.layer,
            self.uses,
            100.0 * self.hit_rate(),
            100.0 * self.optimum_hit_rate(),
            100.0 * self.fixed_hit_rate()
        )
    }
}

impl Dynamic {
    /// The report of every device; with `optimum`, Belady's hits on each one's recorded uses.
    pub(crate) fn report(&self, optimum: bool) -> Vec<DynamicDeviceReport> {
        let stats = self.stats.lock();
        let mut reports = Vec::new();
        let mut traces = Vec::new();
        for s in stats.iter() {
            let Some(device) = s.device else { continue };
            reports.push(DynamicDeviceReport {
                device,
                hits: s.hits,
                misses: s.misses,
                faults_in: s.faults_in,
                evictions: s.evictions,
                evicted: s.evicted,
                past_watermark: s.past_watermark,
                room: s.peak_resident,
                uses: s.trace.len() as u64,
                truncated: s.truncated,
                optimum_hits: None,
                fixed_hits: None,
                bound_hits: None,
            });
            if optimum {
                traces.push(s.trace.clone());
            }
        }
        drop(stats);
        // The optimum is computed outside the lock (it is O(uses log uses)).
        for (r, trace) in reports.iter_mut().zip(&traces) {
            r.optimum_hits = Some(belady_hits(trace, r.room.bytes()));
            r.fixed_hits = Some(hits_in(&best_fixed(trace, r.room.bytes())));
            r.bound_hits = Some(hit_bound(trace, r.room.bytes()));
        }
        reports
    }

    /// Every device's recorded uses by layer (`layer_of` names a use's model and layer), with
    /// the optimum's hits among them, in the order layers were first used.
    pub(crate) fn layer_report(
        &self,
        layer_of: impl Fn(u64, u32) -> (String, String),
    ) -> Vec<DynamicLayerReport> {
        type Recorded = (DeviceId, Vec<(u64, u32, u64)>, Vec<bool>, u64);
        let traces: Vec<Recorded> = {
            let stats = self.stats.lock();
            stats
                .iter()
                .filter_map(|s| {
                    Some((
                        s.device?,
                        s.trace.clone(),
                        s.trace_hits.clone(),
                        s.peak_resident.bytes(),
                    ))
                })
                .collect()
        };
        let mut out = Vec::new();
        for (device, trace, hits, room) in traces {
            let optimum = belady(&trace, room);
            let fixed = best_fixed(&trace, room);
            let mut rows: Vec<DynamicLayerReport> = Vec::new();
            let mut index: std::collections::HashMap<(String, String), usize> =
                std::collections::HashMap::new();
            let mut names: std::collections::HashMap<(u64, u32), (String, String)> =
                std::collections::HashMap::new();
            for (i, &(model, weight, _)) in trace.iter().enumerate() {
                let key = names
                    .entry((model, weight))
                    .or_insert_with(|| layer_of(model, weight))
                    .clone();
                let row = *index.entry(key.clone()).or_insert_with(|| {
                    rows.push(DynamicLayerReport {
                        device,
                        model: key.0,
                        layer: key.1,
                        uses: 0,
                        hits: 0,
                        optimum_hits: 0,
                        fixed_hits: 0,
                    });
                    rows.len() - 1
                });
                let r = &mut rows[row];
                r.uses += 1;
                r.hits += u64::from(hits[i]);
                r.optimum_hits += u64::from(optimum[i]);
                r.fixed_hits += u64::from(fixed[i]);
            }
            out.extend(rows);
        }
        out
    }
}

/// Hits of Belady's offline policy on `trace` (model, weight, bytes) with `capacity` bytes: on a
/// miss the copy is kept when it fits, displacing the copies used farthest in the future, but
/// only copies used later than it (a copy used sooner is worth more than the newcomer; exact
/// for equal sizes, the standard rule with sizes).
pub(crate) fn belady_hits(trace: &[(u64, u32, u64)], capacity: u64) -> u64 {
    hits_in(&belady(trace, capacity))
}

/// An upper bound on the hits of any policy on `trace` (model, weight, bytes) with `capacity`
/// bytes, whatever was resident at the start. A use is a hit only if its weight stayed
/// resident since its previous use (or since the start, for its first use), holding its bytes
/// for that interval; at every moment the resident bytes are at most `capacity`, so over the
/// trace the intervals' areas (bytes × uses spanned) add up to at most `capacity × uses`.
/// Keeping only that integral constraint and letting an interval count in part turns the
/// problem into a fractional knapsack, solved by taking intervals by area, smallest first; its
/// whole part bounds any integral choice. O(uses log uses).
pub(crate) fn hit_bound(trace: &[(u64, u32, u64)], capacity: u64) -> u64 {
    let mut last: std::collections::HashMap<(u64, u32), usize> =
        std::collections::HashMap::with_capacity(trace.len().min(1 << 16));
    let mut areas: Vec<u128> = Vec::with_capacity(trace.len());
    for (t, &(model, weight, bytes)) in trace.iter().enumerate() {
        // Resident from the start through its first use, or since its previous use.
        let since = last.insert((model, weight), t + 1).unwrap_or(0);
        if bytes <= capacity {
            areas.push(u128::from(bytes) * (t + 1 - since) as u128);
        }
    }
    areas.sort_unstable();
    let mut left = u128::from(capacity) * trace.len() as u128;
    let mut hits = 0u64;
    for a in areas {
        if a > left {
            break;
        }
        left -= a;
        hits += 1;
    }
    hits
}

/// How many uses were hits, of per-use decisions ([`belady`], [`best_fixed`]).
fn hits_in(decisions: &[bool]) -> u64 {
    decisions.iter().filter(|&&h| h).count() as u64
}

/// The best fixed set in hindsight for `trace` in `capacity` bytes, as each use's hit: the
/// weights with the most repeat uses per byte, taken greedily while they fit (exact for equal
/// sizes), each kept from its first use (a miss) to the end.
pub(crate) fn best_fixed(trace: &[(u64, u32, u64)], capacity: u64) -> Vec<bool> {
    use std::collections::{HashMap, HashSet};
    let mut uses: HashMap<(u64, u32), (u64, u64)> = HashMap::new();
    for &(m, w, bytes) in trace {
        let e = uses.entry((m, w)).or_insert((0, bytes));
        e.0 += 1;
    }
    let mut by_worth: Vec<((u64, u32), u64, u64)> = uses
        .into_iter()
        .map(|(k, (n, bytes))| (k, n - 1, bytes.max(1)))
        .filter(|&(_, repeats, _)| repeats > 0)
        .collect();
    // Repeats per byte, most first (compared as products: no rounding), then the weight's id
    // so the choice does not depend on the map's order.
    by_worth.sort_by(|a, b| {
        (u128::from(b.1) * u128::from(a.2))
            .cmp(&(u128::from(a.1) * u128::from(b.2)))
            .then(a.0.cmp(&b.0))
    });
    let mut free = capacity;
    let mut kept = HashSet::new();
    for (k, _, bytes) in by_worth {
        if bytes <= free {
            free -= bytes;
            kept.insert(k);
        }
    }
    let mut seen = HashSet::new();
    trace
        .iter()
        .map(|&(m, w, _)| kept.contains(&(m, w)) && !seen.insert((m, w)))
        .collect()
}

/// [`belady_hits`]'s decision for each use: whether the optimum served it from a kept copy.
pub(crate) fn belady(trace: &[(u64, u32, u64)], capacity: u64) -> Vec<bool> {
    use std::collections::{BTreeSet, HashMap};
    let n = trace.len();
    // Next use of each position's weight.
    let mut next = vec![usize::MAX; n];
    let mut last: HashMap<(u64, u32), usize> = HashMap::new();
    for i in (0..n).rev() {
        let k = (trace[i].0, trace[i].1);
        if let Some(&j) = last.get(&k) {
            next[i] = j;
        }
        last.insert(k, i);
    }
    // Cached weights by their next use (farthest last), and each one's entry.
    let mut by_next: BTreeSet<(usize, (u64, u32))> = BTreeSet::new();
    let mut cached: HashMap<(u64, u32), (usize, u64)> = HashMap::new();
    let mut used = 0u64;
    let mut hits = vec![false; n];
    for (i, &(m, w, bytes)) in trace.iter().enumerate() {
        let k = (m, w);
        if let Some((nu, b)) = cached.remove(&k) {
            hits[i] = true;
            by_next.remove(&(nu, k));
            by_next.insert((next[i], k));
            cached.insert(k, (next[i], b));
            continue;
        }
        if next[i] == usize::MAX || bytes > capacity {
            continue;
        }
        // Displace copies used after this one, farthest first, until it fits.
        let mut displaced = Vec::new();
        let mut free = capacity - used;
        for &(nu, victim) in by_next.iter().rev() {
            if free >= bytes || nu <= next[i] {
                break;
            }
            free += cached[&victim].1;
            displaced.push((nu, victim));
        }
        if free < bytes {
            continue;
        }
        for (nu, victim) in displaced {
            by_next.remove(&(nu, victim));
            if let Some((_, b)) = cached.remove(&victim) {
                used -= b;
            }
        }
        used += bytes;
        by_next.insert((next[i], k));
        cached.insert(k, (next[i], bytes));
    }
    hits
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn belady_keeps_what_is_used_soonest() {
        // Capacity for two of three equal weights, used a b c a b c ...: LRU hits nothing; the
        // optimum keeps a and b (c, needed last, is never worth displacing either): 2 hits per
        // round after the first.
        let t: Vec<(u64, u32, u64)> = (0..30).map(|i| (1, (i % 3) as u32, 10)).collect();
        assert_eq!(belady_hits(&t, 20), 18);
        // Room for all: every repeat hits.
        assert_eq!(belady_hits(&t, 30), 27);
        // No room: nothing.
        assert_eq!(belady_hits(&t, 5), 0);
    }

    #[test]
    fn the_bound_is_above_every_policy_and_tight_where_everything_fits() {
        // Hand traces: all fits → every use may hit (the bound counts first uses too: resident
        // from the start); no room → nothing.
        let t: Vec<(u64, u32, u64)> = (0..12).map(|i| (1, (i % 3) as u32, 10)).collect();
        assert_eq!(hit_bound(&t, 30), 12);
        assert_eq!(hit_bound(&t, 5), 0);
        // Unequal sizes on seeded skewed draws: above Belady's rule, the best fixed set and LRU.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for round in 0..20u64 {
            let mut trace = Vec::new();
            for _ in 0..400 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let w = ((x % 1000) as f64 / 1000.0).powi(3) * 24.0;
                let w = w as u32;
                trace.push((1, w, 8 + u64::from(w % 5) * 8));
            }
            let room = 40 + round * 10;
            let bound = hit_bound(&trace, room);
            assert!(bound >= belady_hits(&trace, room), "round {round}");
            assert!(bound >= hits_in(&best_fixed(&trace, room)), "round {round}");
            // LRU with sizes, as a plain online policy.
            let mut cache: Vec<(u32, u64)> = Vec::new();
            let mut lru = 0u64;
            for &(_, w, b) in &trace {
                if let Some(p) = cache.iter().position(|c| c.0 == w) {
                    lru += 1;
                    let e = cache.remove(p);
                    cache.push(e);
                    continue;
                }
                cache.push((w, b));
                while cache.iter().map(|c| c.1).sum::<u64>() > room {
                    cache.remove(0);
                }
            }
            assert!(bound >= lru, "round {round}");
        }
    }

    #[test]
    fn the_best_fixed_set_keeps_the_most_repeats_per_byte_from_their_first_use() {
        let hits = |t: &[(u64, u32, u64)], room| hits_in(&best_fixed(t, room));
        // a a a b b c, equal sizes: room for one keeps a (2 repeats), for two a and b.
        let t = [
            (1, 0, 10),
            (1, 1, 10),
            (1, 0, 10),
            (1, 2, 10),
            (1, 1, 10),
            (1, 0, 10),
        ];
        assert_eq!(best_fixed(&t, 10), [false, false, true, false, false, true]);
        assert_eq!(hits(&t, 20), 3);
        assert_eq!(hits(&t, 5), 0, "nothing fits");
        // Weights of another model are other weights.
        let two = [(1, 0, 10), (2, 0, 10), (1, 0, 10), (2, 0, 10), (2, 0, 10)];
        assert_eq!(best_fixed(&two, 10), [false, false, false, true, true]);
        // Sizes: a large weight repeated twice is worth less per byte than two small ones
        // repeated once each; what is left is filled by the next that fits.
        let sized = [
            (1, 0, 20),
            (1, 1, 5),
            (1, 2, 5),
            (1, 3, 10),
            (1, 0, 20),
            (1, 0, 20),
            (1, 1, 5),
            (1, 2, 5),
            (1, 3, 10),
        ];
        assert_eq!(
            hits(&sized, 20),
            3,
            "1, 2 and 3 (10 bytes, 1 repeat) fit: 3 hits"
        );
        assert_eq!(hits(&sized, 40), 5, "everything");
    }

    #[test]
    fn no_fixed_set_beats_belady_on_equal_sizes() {
        // Seeded skewed draws of 16 equal weights, 4 per step, in rooms of 1 to 16.
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for room in 1..=16u64 {
            let t: Vec<(u64, u32, u64)> = (0..400)
                .map(|_| {
                    // Roughly Zipf: the smaller of two draws, squared in skew.
                    let a = next() % 16;
                    let b = next() % 16;
                    (1, a.min(b) as u32, 8)
                })
                .collect();
            let fixed = hits_in(&best_fixed(&t, room * 8));
            let optimum = belady_hits(&t, room * 8);
            assert!(
                fixed <= optimum,
                "room {room}: fixed {fixed} > Belady {optimum}"
            );
            assert!(fixed > 0, "room {room}");
        }
    }

    #[test]
    fn belady_never_lets_a_newcomer_displace_a_copy_needed_sooner() {
        // a is used at every other step; b, c, d once each in between, then never again.
        let t = vec![
            (1, 0, 10),
            (1, 1, 10),
            (1, 0, 10),
            (1, 2, 10),
            (1, 0, 10),
            (1, 3, 10),
            (1, 0, 10),
        ];
        assert_eq!(
            belady_hits(&t, 10),
            3,
            "a stays; the one-off uses never displace it"
        );
    }
}
