//! The forward of a layer whose weights live on another device than the model's load device
//! (a model split by a [`crate::DeviceMap`], docs/ARCHITECTURE.md §5.2).
//!
//! One rule keeps model code unchanged: activations live on the load device ("home"). A layer
//! whose weight is mapped elsewhere moves its input there, computes there, and moves its output
//! home. So every tensor model code holds (a residual, a cached key, a mask) is on one device, as
//! in the unsplit run, and a port that works on one device works split; the price is two
//! activation copies per remote layer instead of one per device boundary, small beside the
//! weights that no longer stream (the point of a split).
//!
//! On CUDA a move is candle's `to_device`. On a simulated GPU a tensor is a CPU tensor either
//! way, so a move is a real copy through the destination's stream (its modelled latency and
//! bandwidth, its checker), read back as the tensor compute continues with: same bits, honest
//! time. Every move is counted in the placement's activation counters
//! ([`crate::ModelPatcher::split_stats`]).

use candle_core::Tensor;

use super::{LayerWeights, OpsSource};
use crate::error::{Error, Result};
use crate::patcher::device_map::ActivationMoves;
use crate::vram::DeviceId;

/// Runs `f` on the device of `weights`' weight: directly when it is the load device (every
/// unsplit model), else with the input moved there and the output moved home.
pub(crate) fn on_weight_device<E>(
    weights: &LayerWeights,
    x: &Tensor,
    into: impl Fn(Error) -> E,
    f: impl FnOnce(&Tensor) -> std::result::Result<Tensor, E>,
) -> std::result::Result<Tensor, E> {
    on_device_of(&weights.source, weights.weight.index, x, into, f)
}

/// [`on_weight_device`] for weight `index` of `source`'s patcher.
pub(crate) fn on_device_of<E>(
    source: &OpsSource,
    index: usize,
    x: &Tensor,
    into: impl Fn(Error) -> E,
    f: impl FnOnce(&Tensor) -> std::result::Result<Tensor, E>,
) -> std::result::Result<Tensor, E> {
    let patcher = source.patcher();
    let Some((home, there, moves)) = patcher.remote_weight(index) else {
        return f(x);
    };
    let xr = move_activation(x, home, there, moves).map_err(&into)?;
    let y = f(&xr)?;
    move_activation(&y, there, home, moves).map_err(into)
}

/// `x` (on `from`) copied to `to`.
fn move_activation(
    x: &Tensor,
    from: DeviceId,
    to: DeviceId,
    moves: &ActivationMoves,
) -> Result<Tensor> {
    let bytes = (x.elem_count() * x.dtype().size_in_bytes()) as u64;
    moves.note(bytes);
    let ctx = |e| Error::tensor(format!("moving an activation from {from} to {to}"), e);
    // Into a simulated GPU (or out of one to the CPU): a copy on its stream at its modelled
    // bandwidth. Anything else: candle moves the tensor.
    let sim = [to, from].into_iter().find(|d| d.is_sim());
    let gpu = match sim {
        Some(via) if !matches!(to, DeviceId::Cuda(_)) => moves.gpu(via),
        _ => return x.to_device(&to.to_candle()?).map_err(ctx),
    };
    let Some(gpu) = gpu else {
        return Ok(x.clone());
    };
    let stream = gpu.default_stream()?;
    let stats = crate::offload::TransferStats::default();
    let copied = crate::offload::upload(x, &stream, None, &stats, None)?;
    copied.into_tensor_after_wait(&gpu)
}
