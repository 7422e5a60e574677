//! Streamed weights: staging memory, transfer lanes and prefetch.
//!
//! This module owns the path a *streamed* weight (one not resident on the load device) takes at
//! use: [`fetch_weight`] returns the resident copy when it is current; otherwise, when the model
//! has a [`Streamer`] attached (the memory manager attaches one to every partially loaded model),
//! the weight comes from a prefetch or a synchronous fetch through the [`TransferEngine`]; without
//! one it is materialized inline. Every path builds the weight with the same
//! [`ModelPatcher::materialize_from`], so outputs are bit-identical whatever the lanes, depth or
//! budget (I3, docs/ARCHITECTURE.md §4.3).
//!
//! - [`PinnedPool`]: bounded, size-classed staging buffers for host→device copies (page-locked
//!   where a CUDA driver is present, touched aligned buffers elsewhere); [`copy_to_device`] copies
//!   through one on a cudarc stream.
//! - Weights pinned in place: a streamed weight whose host part is its clean host copy is
//!   page-locked where it lives through the model's [`crate::weights::HostTier`] (within the pin
//!   budget) and copied straight from there; beyond the budget, or when pinning fails, it is
//!   staged as above. Resident copies a load builds go through the same path
//!   ([`TransferEngine::load_now`]).
//! - [`TransferEngine`]: `N` lanes (`--async-offload N`; default 2 on a GPU, 0 on the CPU —
//!   [`crate::vram::Config::transfer_lanes_for`]; `--disable-async-offload` = 0,
//!   synchronous); a fetched weight is a [`Pending`] handle that must be waited on.
//! - [`Streamer`]: per-model prefetch in recorded forward order.
//!
//! Accounting: prefetched weights not yet used (on a GPU: device memory their copies landed or
//! are landing in) are counted in their device's ledger by the memory manager. Staging buffers
//! are host memory and are reported separately (`MemoryReport::pinned`), not budgeted.

mod engine;
mod keep;
mod misses;
mod pinned;
mod prefetch;
mod prepared;
mod upload;

use std::sync::Arc;

use candle_core::Tensor;

pub use engine::{Pending, TransferEngine, TransferSnapshot, TransferStats};
pub(crate) use keep::Keeper;
pub use misses::{MissCosts, MissReport, MissRun};
pub use pinned::{default_limit, PinnedPool, PoolStats, StagingBuffer, MIN_CLASS};
pub(crate) use prefetch::{Fetch, Reservation};
pub use prefetch::{PrefetchGate, Streamer};
pub(crate) use prepared::PreparedCopies;
pub use prepared::{prepared_bytes, PreparedBudget, PreparedStats};
pub use upload::copy_to_device;
pub(crate) use upload::upload;

use crate::error::{Error, Result};
use crate::patcher::ModelPatcher;

/// The weight `key` ready for compute on the patcher's load device, in its resident dtype, and
/// whether it streamed. Records first-forward order.
pub fn fetch_weight(patcher: &ModelPatcher, key: &str) -> Result<(Tensor, bool)> {
    let model = patcher.model();
    let index = model.index_of(key).ok_or_else(|| Error::UnknownWeight {
        model: model.name().to_string(),
        key: key.to_string(),
    })?;
    fetch_weight_at(patcher, index)
}

/// [`fetch_weight`] by slot index (what a layer that resolved its key once holds): no key
/// lookup on the hot path.
///
/// # Errors
/// As [`fetch_weight`]; an index out of range is [`Error::UnknownWeight`].
pub fn fetch_weight_at(patcher: &ModelPatcher, index: usize) -> Result<(Tensor, bool)> {
    let model = patcher.model();
    if index >= model.len() {
        return Err(Error::UnknownWeight {
            model: model.name().to_string(),
            key: format!("(index {index} of {} weights)", model.len()),
        });
    }
    model.record_use(index);
    if let Some(t) = patcher.resident_tensor(index) {
        if model.is_dynamic() {
            if let Some(s) = streamer_of(patcher) {
                s.note_hit(patcher, index);
            }
        }
        model.note_fetched(index);
        return Ok((t, false));
    }
    let streamer = model
        .stream_hook()
        .and_then(|h| h.downcast::<Streamer>().ok());
    let t = match streamer {
        Some(s) => s.fetch(patcher, index)?,
        None => {
            let device = patcher.weight_device(index);
            model.note_use_without_load(device);
            patcher.materialize(index, patcher.resident_dtype(index), device)?
        }
    };
    model.note_fetched(index);
    Ok((t, true))
}

/// Attaches `streamer` to `patcher`'s model (every patcher of the model then prefetches through
/// it), or detaches with `None`.
pub fn attach_streamer(patcher: &ModelPatcher, streamer: Option<Arc<Streamer>>) {
    patcher
        .model()
        .set_stream_hook(streamer.map(|s| s as Arc<dyn std::any::Any + Send + Sync>));
}

/// The streamer attached to `patcher`'s model, if any.
pub fn streamer_of(patcher: &ModelPatcher) -> Option<Arc<Streamer>> {
    patcher
        .model()
        .stream_hook()
        .and_then(|h| h.downcast::<Streamer>().ok())
}
