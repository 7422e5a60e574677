//! Offsets: a patch that applies to one region of its weight, `weight.narrow(dim, start, len)`
//! ([`Offset`]); checking the region against the weight, and writing the patched region back.

use candle_core::Tensor;

use super::{bad, shape_err};
use crate::error::{Result, TensorContext};

/// A narrowing of a target weight: the patch applies to `weight.narrow(dim, start, len)`, the
/// rest of the weight is untouched.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Offset {
    /// The dimension narrowed.
    pub dim: usize,
    /// The first index kept along `dim`.
    pub start: usize,
    /// How many indices are kept along `dim`.
    pub len: usize,
}

/// The shape a patch on the region `o` of a weight of `weight_shape` gives, where `patch_shape`
/// is the patch's own rule on the region's shape: the weight's shape, since a patch on a region
/// cannot reshape it. Errors when the offset lies outside the weight or the patch would reshape
/// the region.
pub(super) fn output_shape(
    key: &str,
    weight_shape: &[usize],
    o: Offset,
    patch_shape: impl FnOnce(&[usize]) -> Result<Vec<usize>>,
) -> Result<Vec<usize>> {
    if o.dim >= weight_shape.len()
        || o.len == 0
        || o.start
            .checked_add(o.len)
            .is_none_or(|end| end > weight_shape[o.dim])
    {
        return Err(bad(
            key,
            format!(
                "offset (dim {}, start {}, len {}) lies outside the weight shape {weight_shape:?}",
                o.dim, o.start, o.len
            ),
        ));
    }
    let mut target = weight_shape.to_vec();
    target[o.dim] = o.len;
    let out = patch_shape(&target)?;
    if out != target {
        return Err(shape_err(
            key,
            &target,
            &out,
            "a patch on a narrowed region (offset) cannot change its shape",
        ));
    }
    Ok(weight_shape.to_vec())
}

/// `w` with its region `o` replaced by `patch(region)`.
pub(super) fn apply(
    key: &str,
    w: &Tensor,
    o: Offset,
    patch: impl FnOnce(&Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let ctx = || format!("`{key}`: writing back the region {o:?}");
    let region = w.narrow(o.dim, o.start, o.len).ctx(ctx)?;
    let patched = patch(&region)?;
    let total = w.dim(o.dim).ctx(ctx)?;
    let end = o.start + o.len;
    let mut parts = Vec::with_capacity(3);
    if o.start > 0 {
        parts.push(w.narrow(o.dim, 0, o.start).ctx(ctx)?);
    }
    parts.push(patched);
    if end < total {
        parts.push(w.narrow(o.dim, end, total - end).ctx(ctx)?);
    }
    Tensor::cat(&parts, o.dim).ctx(ctx)
}
