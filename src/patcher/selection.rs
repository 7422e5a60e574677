//! Which weights are resident: the selection rules behind loads, partial loads and partial
//! unloads, as pure functions over plain per-weight data.
//!
//! [`crate::patcher::ModelPatcher`]'s `load`, `partially_load*` and `partially_unload` and the
//! memory manager's planner ([`crate::loader::MemoryManager::plan`]) all choose weights through
//! these functions, so a plan predicts exactly what its execution does.
//!
//! Complexity: O(n log n) in the number of weights (one sort).

use crate::size::ByteSize;

/// One weight as the selection rules see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WeightView {
    /// Bytes it takes when resident under the patcher being loaded (its resident dtype).
    pub size: ByteSize,
    /// Pinned: kept through partial unloads, considered first by loads.
    pub pinned: bool,
    /// Carries patches under the patcher being loaded.
    pub patched: bool,
    /// Bytes of its resident copy on the device in question, whatever its fingerprint.
    pub on_device: Option<ByteSize>,
    /// Whether that copy is current for the patcher being loaded (right fingerprint).
    pub current: bool,
}

/// A load from scratch within `budget`: weights are considered pinned first, then (with
/// `force_patch_weights`) patched ones, then largest first, ties by index; one is taken while the
/// running total plus its size stays *below* the budget (ComfyUI's rule). `full` takes all.
pub(crate) fn from_scratch(
    weights: &[WeightView],
    budget: ByteSize,
    force_patch_weights: bool,
    full: bool,
) -> Vec<bool> {
    let mut order: Vec<usize> = (0..weights.len()).collect();
    order.sort_by_key(|&i| {
        let w = &weights[i];
        (
            !w.pinned,
            !(force_patch_weights && w.patched),
            std::cmp::Reverse(w.size),
            i,
        )
    });
    let mut want = vec![false; weights.len()];
    let mut total = ByteSize::ZERO;
    for i in order {
        let next = total.saturating_add(weights[i].size);
        if full || next < budget {
            want[i] = true;
            total = next;
        }
    }
    want
}

/// A partial load adding at most `extra` bytes: every weight already resident on the device stays
/// (a stale copy is rebuilt in place); the others are considered patched first (with
/// `force_patch_weights`), then largest first, and one is added while the bytes added stay below
/// `extra`.
pub(crate) fn grow(
    weights: &[WeightView],
    extra: ByteSize,
    force_patch_weights: bool,
) -> Vec<bool> {
    let mut want: Vec<bool> = weights.iter().map(|w| w.on_device.is_some()).collect();
    let mut candidates: Vec<usize> = (0..weights.len()).filter(|&i| !want[i]).collect();
    candidates.sort_by_key(|&i| {
        let w = &weights[i];
        (
            !(force_patch_weights && w.patched),
            std::cmp::Reverse(w.size),
            i,
        )
    });
    let mut added = ByteSize::ZERO;
    for i in candidates {
        let next = added.saturating_add(weights[i].size);
        if next < extra {
            want[i] = true;
            added = next;
        }
    }
    want
}

/// A partial unload of about `bytes`: resident copies `(index, bytes, pinned)` are dropped
/// smallest first (ties by index), pinned ones skipped, while the bytes freed so far are at most
/// `bytes` — so the last one dropped may overshoot, as in ComfyUI. Returns the indices dropped,
/// in order.
pub(crate) fn unload(resident: &[(usize, ByteSize, bool)], bytes: ByteSize) -> Vec<usize> {
    let mut order: Vec<(ByteSize, usize)> = resident
        .iter()
        .filter(|(_, _, pinned)| !pinned)
        .map(|&(i, b, _)| (b, i))
        .collect();
    order.sort();
    let mut freed = ByteSize::ZERO;
    let mut dropped = Vec::new();
    for (size, i) in order {
        if freed > bytes {
            break;
        }
        dropped.push(i);
        freed = freed.saturating_add(size);
    }
    dropped
}

/// Bytes the wanted weights take.
pub(crate) fn wanted_bytes(weights: &[WeightView], want: &[bool]) -> ByteSize {
    weights
        .iter()
        .zip(want)
        .filter(|(_, &w)| w)
        .map(|(w, _)| w.size)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(size: u64) -> WeightView {
        WeightView {
            size: ByteSize(size),
            pinned: false,
            patched: false,
            on_device: None,
            current: false,
        }
    }

    #[test]
    fn from_scratch_takes_largest_first_while_strictly_below_the_budget() {
        let ws = [w(10), w(30), w(20)];
        assert_eq!(
            from_scratch(&ws, ByteSize(51), false, false),
            [false, true, true]
        );
        // 30 + 20 = 50 is not below 50: the 20 is skipped, the 10 fits after it.
        assert_eq!(
            from_scratch(&ws, ByteSize(50), false, false),
            [true, true, false]
        );
        assert_eq!(from_scratch(&ws, ByteSize(0), false, true), [true; 3]);
    }

    #[test]
    fn from_scratch_puts_pinned_then_patched_first() {
        let mut ws = [w(10), w(30), w(20)];
        ws[0].pinned = true;
        ws[2].patched = true;
        assert_eq!(
            from_scratch(&ws, ByteSize(31), true, false),
            [true, false, true]
        );
        assert_eq!(
            from_scratch(&ws, ByteSize(41), false, false),
            [true, true, false]
        );
    }

    #[test]
    fn grow_keeps_every_copy_on_the_device_and_adds_below_extra() {
        let mut ws = [w(10), w(30), w(20), w(5)];
        ws[1].on_device = Some(ByteSize(30));
        assert_eq!(grow(&ws, ByteSize(21), false), [false, true, true, false]);
        assert_eq!(grow(&ws, ByteSize(26), false), [false, true, true, true]);
        assert_eq!(grow(&ws, ByteSize(0), false), [false, true, false, false]);
    }

    #[test]
    fn unload_goes_smallest_first_skips_pins_and_may_overshoot_once() {
        let r = [
            (0, ByteSize(10), false),
            (1, ByteSize(5), true),
            (2, ByteSize(20), false),
            (3, ByteSize(7), false),
        ];
        assert_eq!(unload(&r, ByteSize(0)), [3]);
        assert_eq!(unload(&r, ByteSize(7)), [3, 0]);
        assert_eq!(unload(&r, ByteSize(17)), [3, 0, 2]);
        assert_eq!(unload(&r, ByteSize::MAX), [3, 0, 2]);
    }
}
