//! Residency by use, as the transfer path sees it (docs/ARCHITECTURE.md §5.3).
//!
//! In dynamic mode the memory manager gives a model's [`super::Streamer`] a [`Keeper`]: before a
//! streamed weight is fetched the streamer asks it to book room for keeping the copy (the keeper
//! may evict copies of lower priority to make that room, by the one priority order), and once the
//! copy arrived it asks the keeper to make it the weight's resident copy. A prefetched weight is
//! kept the same way when it is used. Nothing here decides anything: the order, the watermark and
//! the ledger's rules are the keeper's.

use candle_core::Tensor;

use super::Reservation;
use crate::device::DeviceHold;
use crate::patcher::ModelPatcher;
use crate::size::ByteSize;

/// What keeps fetched weights resident (the memory manager's residency by use).
pub(crate) trait Keeper: Send + Sync {
    /// Books room to keep weight `index` of `patcher` once fetched, leaving `room` free for
    /// streaming beside what is kept; may evict copies of lower priority to make it. The
    /// booking (the ledger's faulting column: its device and bytes, decided once, here) is
    /// returned when dropped, so a fetch that fails or unwinds gives it back.
    fn book(&self, patcher: &ModelPatcher, index: usize, room: ByteSize) -> Option<Reservation>;

    /// Makes `tensor` (weight `index`, just fetched, with what keeps its device memory) the
    /// weight's resident copy under `booking` ([`Keeper::book`]'s). Whether it was kept: a copy
    /// whose weight moved to another device or changed size since it was booked, of a model no
    /// longer registered, or on a device a load or a reclaim closed meanwhile, is not (its
    /// booking is returned).
    fn commit(
        &self,
        patcher: &ModelPatcher,
        index: usize,
        tensor: &Tensor,
        hold: DeviceHold,
        booking: Reservation,
    ) -> bool;

    /// Makes room on weight `index`'s device for `bytes` in flight beside everything booked
    /// (a weight in use that is not kept), evicting kept copies of the lowest priority — with
    /// `spare`, only other models' (the model's own come back by use at its next forward, to be
    /// evicted again: a lack of room for a moment is better waited out); whether the room is
    /// there.
    fn make_room(&self, patcher: &ModelPatcher, index: usize, bytes: ByteSize, spare: bool)
        -> bool;

    /// Keeps a prefetched weight, booked in flight by `booking`, as the resident copy when it
    /// can be kept with `room` left free; gives back the hold and the booking when it cannot.
    fn keep_prefetched(
        &self,
        patcher: &ModelPatcher,
        index: usize,
        tensor: &Tensor,
        hold: DeviceHold,
        booking: Reservation,
        room: ByteSize,
    ) -> Option<(DeviceHold, Reservation)>;

    /// Notes a use of weight `index`: a hit when its copy was resident.
    fn note_use(&self, patcher: &ModelPatcher, index: usize, hit: bool);
}
