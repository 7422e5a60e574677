//! The step predicted from the cost model's figures ([`predict_step`], module docs of
//! [`crate::costs`]): an event simulation of one steady forward over the recorded use order.

use std::fmt;

use super::Link;
use crate::size::ByteSize;

/// One weight use of a step, in use order, for [`predict_step`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct UseCost {
    /// The bytes copied when it streams.
    pub bytes: u64,
    /// Whether it is resident (no copy).
    pub resident: bool,
    /// Its compute, in nanoseconds.
    pub compute_ns: f64,
    /// Named by a router (a mixture of experts' expert): its copy is requested when its
    /// layer's routing ran — at the first use of its run of routed uses — never predicted
    /// ahead from use (the next token's experts are not the last one's).
    pub routed: bool,
}

/// How streamed weights are copied, for [`predict_step`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Streaming {
    /// The link's figure.
    pub link: Link,
    /// Whether concurrent copies share the link ([`super::DeviceCosts::shared_link`]).
    pub shared_link: bool,
    /// Transfer lanes (0: every streamed weight is copied when used, on the compute thread).
    pub lanes: usize,
    /// Prefetch depth: streamed weights requested ahead at each fetch.
    pub depth: usize,
    /// Device memory for copies in flight beside the weight in use
    /// ([`crate::loader::PlannedLoad::streaming_room`]): a prefetch that would pass it waits
    /// for the next fetch.
    pub room: u64,
}

/// A predicted (or, in a [`crate::loader::StepAudit`], measured) step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct StepPrediction {
    /// The step's time, in nanoseconds.
    pub step_ns: u64,
    /// Of it, compute.
    pub compute_ns: u64,
    /// Copy time of the step's copies (on their lanes; may overlap compute and each other).
    pub copy_ns: u64,
    /// The time compute waited for copies (the part of `copy_ns` not hidden).
    pub exposed_ns: u64,
    /// Bytes copied to the device in the step.
    pub bytes: ByteSize,
    /// Weight uses in the step, and of them streamed.
    pub uses: usize,
    /// Of `uses`, weights copied (not resident).
    pub streamed: usize,
    /// Uses whose compute was not measured yet (costed at the device's average per byte, or
    /// nothing).
    pub unmeasured: usize,
}

impl fmt::Display for StepPrediction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = |ns: u64| ns as f64 / 1e6;
        write!(
            f,
            "{:.3} ms a step ({:.3} ms compute, {:.3} ms copying of which {:.3} ms exposed; {} in {} of {} weights)",
            ms(self.step_ns),
            ms(self.compute_ns),
            ms(self.copy_ns),
            ms(self.exposed_ns),
            self.bytes,
            self.streamed,
            self.uses
        )?;
        if self.unmeasured > 0 {
            write!(f, " [{} uses unmeasured]", self.unmeasured)?;
        }
        Ok(())
    }
}

/// Steps simulated before the one reported: the prefetches the last weights of a step request
/// for the next one have reached their steady state by then.
const WARM_STEPS: usize = 2;

/// Predicts a steady step over `uses` (module docs): the event simulation of the compute thread,
/// the lanes and the link.
pub fn predict_step(uses: &[UseCost], s: Streaming) -> StepPrediction {
    simulate(uses, s, WARM_STEPS)
}

/// Predicts a step that starts with nothing in flight: the first step, or the next one after a
/// load or a reservation cancelled the model's prefetches (a steady step finds its first
/// weights prefetched by the end of the last one; this one fetches them on the compute thread).
pub fn predict_cold_step(uses: &[UseCost], s: Streaming) -> StepPrediction {
    simulate(uses, s, 0)
}

/// The event simulation: `warm` steps run before the one reported.
fn simulate(uses: &[UseCost], s: Streaming, warm: usize) -> StepPrediction {
    let n = uses.len();
    let mut out = StepPrediction {
        uses: n,
        streamed: uses.iter().filter(|u| !u.resident).count(),
        ..StepPrediction::default()
    };
    if n == 0 {
        return out;
    }
    let prefetching = s.lanes > 0 && s.depth > 0;
    let mut copies = Copies {
        inflight: Vec::new(),
        lanes: vec![0.0f64; s.lanes],
        link_free: 0.0,
    };
    let mut t = 0.0f64;
    // The streamed weight used before the one in use: its bytes and when its memory comes
    // back. Its free is ordered on the stream that copied it, behind what that stream had
    // queued when the weight was let go: at once for a weight fetched on this thread, after
    // its lane's queued prefetches for one a lane copied. Until then prefetches fit beside it.
    let mut before = (0u64, 0.0f64);
    for step in 0..=warm {
        let counted = step == warm;
        let start = t;
        let (mut compute, mut copy, mut exposed, mut bytes) = (0.0, 0.0, 0.0, 0u64);
        for (j, u) in uses.iter().enumerate() {
            let mut lane = None;
            // A routing: the run of routed uses starting here is requested on the lanes now.
            if prefetching && u.routed && (j == 0 || !uses[j - 1].routed) {
                let held = if before.1 > t { before.0 } else { 0 };
                for q in (j..n).take_while(|&q| uses[q].routed) {
                    if uses[q].resident || copies.in_flight(q) {
                        continue;
                    }
                    let Some(took) = copies.queue(uses, q, s, (t, held)) else {
                        break;
                    };
                    copy += took;
                    bytes += uses[q].bytes;
                }
            }
            if !u.resident {
                if let Some(p) = copies.inflight.iter().position(|f| f.0 == j) {
                    let (_, done, _, l) = copies.inflight.swap_remove(p);
                    exposed += (done - t).max(0.0);
                    t = t.max(done);
                    lane = Some(l);
                } else {
                    // Fetched now, on this thread.
                    let begin = if s.shared_link {
                        t.max(copies.link_free)
                    } else {
                        t
                    };
                    let took = s.link.copy_ns(u.bytes);
                    let end = begin + took;
                    if s.shared_link {
                        copies.link_free = end;
                    }
                    exposed += end - t;
                    copy += took;
                    bytes += u.bytes;
                    t = end;
                }
                if prefetching {
                    let held = u.bytes + if before.1 > t { before.0 } else { 0 };
                    let (c, b) = copies.prefetch_after(uses, j, s, (t, held));
                    copy += c;
                    bytes += b;
                }
            }
            compute += u.compute_ns;
            t += u.compute_ns;
            if !u.resident {
                let freed = lane.map_or(t, |l| t.max(copies.lanes[l]));
                before = (u.bytes, freed);
            }
        }
        if counted {
            let ns = |v: f64| v.max(0.0).round() as u64;
            out.step_ns = ns(t - start);
            out.compute_ns = ns(compute);
            out.copy_ns = ns(copy);
            out.exposed_ns = ns(exposed);
            out.bytes = ByteSize(bytes);
        }
    }
    out
}

/// The copies of the simulation: those in flight (position, done at, bytes, lane), when each
/// lane is free next, and when the link is (copies that share it queue behind each other).
struct Copies {
    inflight: Vec<(usize, f64, u64, usize)>,
    lanes: Vec<f64>,
    link_free: f64,
}

impl Copies {
    /// Whether use `q`'s copy is in flight.
    fn in_flight(&self, q: usize) -> bool {
        self.inflight.iter().any(|f| f.0 == q)
    }

    /// The streamer's prefetch after fetching position `j` at time `t`, with `in_use` bytes
    /// held by the weights in use: the next `depth` streamed weights in use order (wrapping
    /// into the next step, up to the weight just fetched; routed ones are left to their
    /// routing), each not in flight queued ([`Copies::queue`]) while it fits. The copy time and
    /// bytes queued.
    fn prefetch_after(
        &mut self,
        uses: &[UseCost],
        j: usize,
        s: Streaming,
        (t, in_use): (f64, u64),
    ) -> (f64, u64) {
        let n = uses.len();
        let (mut copy, mut bytes, mut requested) = (0.0, 0u64, 0);
        // Up to the weight just fetched itself, for its use in the next step.
        for k in 1..=n {
            if requested >= s.depth {
                break;
            }
            let q = (j + k) % n;
            let u = uses[q];
            if u.resident || u.routed {
                continue;
            }
            requested += 1;
            if self.in_flight(q) {
                continue;
            }
            let Some(took) = self.queue(uses, q, s, (t, in_use)) else {
                break;
            };
            copy += took;
            bytes += u.bytes;
        }
        (copy, bytes)
    }

    /// Queues use `q`'s copy at time `t` on the lane free first (behind the link's last copy
    /// when copies share it), if the bytes in flight beside `in_use` leave room for it: its
    /// copy time, or `None` when it does not fit.
    fn queue(
        &mut self,
        uses: &[UseCost],
        q: usize,
        s: Streaming,
        (t, in_use): (f64, u64),
    ) -> Option<f64> {
        let u = uses[q];
        let held: u64 = self.inflight.iter().map(|f| f.2).sum::<u64>() + in_use;
        if held + u.bytes > s.room {
            return None;
        }
        let lanes = &mut self.lanes;
        let lane = (0..lanes.len())
            .min_by(|&a, &b| lanes[a].total_cmp(&lanes[b]))
            .unwrap_or(0);
        let mut begin = t.max(lanes[lane]);
        if s.shared_link {
            begin = begin.max(self.link_free);
        }
        let took = s.link.copy_ns(u.bytes);
        let end = begin + took;
        lanes[lane] = end;
        if s.shared_link {
            self.link_free = end;
        }
        self.inflight.push((q, end, u.bytes, lane));
        Some(took)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LINK: Link = Link {
        latency_ns: 1_000,
        ps_per_byte: 1_000,
    };

    fn uses(
        n: usize,
        bytes: u64,
        compute_ns: f64,
        resident: impl Fn(usize) -> bool,
    ) -> Vec<UseCost> {
        (0..n)
            .map(|i| UseCost {
                bytes,
                resident: resident(i),
                compute_ns,
                routed: false,
            })
            .collect()
    }

    fn streaming(lanes: usize, depth: usize) -> Streaming {
        Streaming {
            link: LINK,
            shared_link: true,
            lanes,
            depth,
            room: u64::MAX,
        }
    }

    #[test]
    fn all_resident_is_the_sum_of_compute_and_copies_nothing() {
        let u = uses(8, 1_000_000, 500.0, |_| true);
        let p = predict_step(&u, streaming(2, 2));
        assert_eq!(
            (p.step_ns, p.compute_ns, p.copy_ns, p.exposed_ns),
            (4000, 4000, 0, 0)
        );
        assert_eq!((p.bytes, p.streamed), (ByteSize::ZERO, 0));
    }

    #[test]
    fn without_lanes_every_streamed_copy_is_exposed() {
        // 4 of 8 stream: each 1 µs + 10 000 B × 1 ns = 11 µs, on the compute thread.
        let u = uses(8, 10_000, 2_000.0, |i| i % 2 == 0);
        let p = predict_step(&u, streaming(0, 2));
        assert_eq!(p.compute_ns, 16_000);
        assert_eq!(p.copy_ns, 44_000);
        assert_eq!(p.exposed_ns, 44_000);
        assert_eq!(p.step_ns, 60_000);
        assert_eq!(p.bytes, ByteSize(40_000));
    }

    #[test]
    fn lanes_hide_copies_behind_compute_and_never_change_the_bytes() {
        // Compute per weight (20 µs) longer than a copy (11 µs): prefetched a weight ahead,
        // every copy is hidden in the steady step.
        let u = uses(8, 10_000, 20_000.0, |i| i % 2 == 0);
        let sync = predict_step(&u, streaming(0, 1));
        let one = predict_step(&u, streaming(1, 1));
        assert_eq!(one.exposed_ns, 0, "{one}");
        assert_eq!(one.step_ns, one.compute_ns);
        assert!(one.step_ns < sync.step_ns);
        assert_eq!(one.bytes, sync.bytes);
        // Compute shorter than a copy: the link is the bound, one link or two lanes alike.
        let fast = uses(8, 10_000, 1_000.0, |_| false);
        let one = predict_step(&fast, streaming(1, 2));
        let two = predict_step(&fast, streaming(2, 2));
        assert!(one.step_ns >= 8 * 11_000, "{one}");
        assert!(two.step_ns >= 8 * 11_000, "one shared link: {two}");
        // Without a shared link (the simulated GPU) two lanes copy side by side.
        let apart = predict_step(
            &fast,
            Streaming {
                shared_link: false,
                ..streaming(2, 2)
            },
        );
        assert!(apart.step_ns < two.step_ns, "{apart} vs {two}");
    }

    #[test]
    fn a_larger_resident_set_never_predicts_a_slower_step() {
        // Weights of unequal sizes; resident sets nested by a density order.
        let base: Vec<UseCost> = (0..24)
            .map(|i| UseCost {
                bytes: 4_000 + (i as u64 * 7_919) % 30_000,
                resident: false,
                compute_ns: 3_000.0 + (i as f64 * 1_237.0) % 9_000.0,
                routed: false,
            })
            .collect();
        for (lanes, depth) in [(0, 0), (1, 1), (2, 2), (2, 4)] {
            let mut last = u64::MAX;
            for k in 0..=base.len() {
                let mut u = base.clone();
                for w in u.iter_mut().take(k) {
                    w.resident = true;
                }
                let p = predict_step(&u, streaming(lanes, depth));
                assert!(
                    p.step_ns <= last,
                    "lanes {lanes} depth {depth}: {k} resident {p}"
                );
                last = p.step_ns;
            }
        }
    }

    #[test]
    fn the_room_bounds_what_is_prefetched() {
        let u = uses(6, 10_000, 30_000.0, |_| false);
        let free = predict_step(&u, streaming(2, 2));
        // Room for the weight in use only: every fetch is synchronous.
        let none = predict_step(
            &u,
            Streaming {
                room: 10_000,
                ..streaming(2, 2)
            },
        );
        assert_eq!(free.exposed_ns, 0, "{free}");
        assert_eq!(none.exposed_ns, 6 * 11_000, "{none}");
        assert_eq!(free.bytes, none.bytes);
    }

    #[test]
    fn the_weight_used_before_holds_its_memory_until_its_stream_frees_it() {
        // Room for two weights: the one in use and one more. The weight used before comes back
        // when its stream-ordered free runs: at the end of its use when this thread fetched it,
        // after its lane's queued copies when a lane did. Copies (11 µs) are shorter than
        // compute (30 µs), so each lane is idle by the next fetch and the one prefetch fits.
        let u = uses(6, 10_000, 30_000.0, |_| false);
        let two = Streaming {
            room: 20_000,
            ..streaming(1, 1)
        };
        let p = predict_step(&u, two);
        assert_eq!(p.exposed_ns, 0, "{p}");
        // Copies longer than compute: the lane is still copying the next weight when the one
        // before is let go, so its free waits behind that copy and no second copy fits beside
        // it: the steady step waits for every copy in turn.
        let slow = Streaming {
            link: Link {
                latency_ns: 1_000,
                ps_per_byte: 10_000,
            },
            ..two
        };
        let p = predict_step(&u, slow);
        assert!(p.exposed_ns > 0, "{p}");
        assert_eq!(p.bytes, ByteSize(60_000));
    }

    #[test]
    fn a_cold_step_fetches_its_first_weights_on_the_compute_thread() {
        // A steady step finds its first weights prefetched at the end of the last one; a step
        // after the prefetches were cancelled waits for the first copy, then runs as steady.
        let u = uses(6, 10_000, 30_000.0, |_| false);
        let s = streaming(2, 2);
        let steady = predict_step(&u, s);
        let cold = predict_cold_step(&u, s);
        assert_eq!(steady.exposed_ns, 0, "{steady}");
        assert_eq!(cold.exposed_ns, 11_000, "{cold}");
        assert_eq!(cold.step_ns, steady.step_ns + 11_000);
        // It copies its own six weights and, like every step, requests the next step's first
        // two (depth 2) at its end: two more than a steady step, whose own first two the last
        // step requested.
        assert_eq!(cold.bytes, steady.bytes.saturating_add(ByteSize(20_000)));
    }

    #[test]
    fn a_routed_weight_is_copied_from_its_routing_not_prefetched_ahead() {
        // A resident router (30 µs) then two experts of 10 000 B (11 µs a copy, 5 µs compute).
        // Predicted ahead from use, both are copied behind the router's compute; named by the
        // router, both are requested when it ran, and the first is waited for.
        let expert = |routed| UseCost {
            bytes: 10_000,
            resident: false,
            compute_ns: 5_000.0,
            routed,
        };
        let router = UseCost {
            bytes: 10_000,
            resident: true,
            compute_ns: 30_000.0,
            routed: false,
        };
        let ahead = [router, expert(false), expert(false)];
        let named = [router, expert(true), expert(true)];
        // Two lanes on links of their own (the simulated GPU's streams).
        let two = Streaming {
            shared_link: false,
            ..streaming(2, 2)
        };
        assert_eq!(predict_step(&ahead, two).exposed_ns, 0);
        let p = predict_step(&named, two);
        // Both copied at once: only the first copy is waited for.
        assert_eq!(p.exposed_ns, 11_000, "{p}");
        assert_eq!(p.bytes, predict_step(&ahead, two).bytes);
        // One link (or one lane): the second copy ends 6 µs after the first expert's compute.
        for s in [streaming(2, 2), streaming(1, 2)] {
            let p = predict_step(&named, s);
            assert_eq!(p.exposed_ns, 17_000, "{p}");
        }
    }
}
