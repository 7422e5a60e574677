//! DoRA: the magnitude vector a delta adapter (LoRA, LoHa, LoKr, GLoRA) may carry, its shape rule
//! and the renormalisation of the patched weight (step 4 of the math in the
//! [`adapters`](super) docs).

use candle_core::Tensor;

use super::{f32_on, shape_err};
use crate::error::{Result, TensorContext};

/// Which norm DoRA divides by. See the [module docs](super), step 4.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum DoraNorm {
    /// The norm of the patched weight `W + Δ` (the DoRA paper's definition).
    #[default]
    Standard,
    /// The norm of the unpatched weight `W`, which reproduces ComfyUI's results.
    ComfyUi,
}

/// DoRA's shape rule: one magnitude per output row (`[out, 1, …]`) or per input column
/// (`[1, in, …]`).
pub(super) fn check(key: &str, target: &[usize], dora_scale: Option<&Tensor>) -> Result<()> {
    let Some(m) = dora_scale else { return Ok(()) };
    let (d, n) = (m.dims(), m.elem_count());
    let per_row = target.first().is_some_and(|&out| n == out);
    let per_col = target.len() >= 2 && d.first() == Some(&1) && n == target[1];
    if per_row || per_col {
        Ok(())
    } else {
        Err(shape_err(
            key,
            target,
            d,
            "dora_scale must hold one value per output row ([out, 1, ...]) or per input column ([1, in, ...])",
        ))
    }
}

/// Renormalises `patched` (`w + Δ`, with `Δ` not scaled by the strength) to the `magnitude`, then
/// interpolates from `w` by the strength `s`.
pub(super) fn renormalise(
    key: &str,
    w: &Tensor,
    patched: Tensor,
    magnitude: &Tensor,
    s: f32,
    norm: DoraNorm,
) -> Result<Tensor> {
    let ctx = || format!("`{key}`: adding the adapter delta");
    let magnitude = f32_on(key, magnitude, w.device(), "dora_scale")?;
    let out = w.dim(0).ctx(ctx)?;
    let dora_ctx = || format!("`{key}`: DoRA renormalisation");
    let mut bshape = vec![1; w.rank()];
    // What the norms are taken over, one row per magnitude.
    let rows = if magnitude.elem_count() == out {
        // Per output row.
        bshape[0] = out;
        match norm {
            DoraNorm::Standard => patched.clone(),
            DoraNorm::ComfyUi => w.clone(),
        }
    } else {
        // Per input column (validated: dora_scale is [1, in, 1...]).
        bshape[1] = w.dim(1).ctx(ctx)?;
        patched
            .transpose(0, 1)
            .and_then(|t| t.contiguous())
            .ctx(dora_ctx)?
    };
    let norms = rows
        .flatten_from(1)
        .and_then(|t| t.sqr())
        .and_then(|t| t.sum_keepdim(1))
        .and_then(|t| t.sqrt())
        .and_then(|t| t.affine(1.0, f64::from(f32::EPSILON)))
        .and_then(|t| t.reshape(bshape.as_slice()))
        .ctx(dora_ctx)?;
    let factor = magnitude
        .reshape(bshape.as_slice())
        .and_then(|m| m.broadcast_div(&norms))
        .ctx(dora_ctx)?;
    let renormed = patched.broadcast_mul(&factor).ctx(dora_ctx)?;
    if s == 1.0 {
        return Ok(renormed);
    }
    let step = (&renormed - w)
        .and_then(|t| t.affine(f64::from(s), 0.0))
        .ctx(dora_ctx)?;
    (w + &step).ctx(dora_ctx)
}
