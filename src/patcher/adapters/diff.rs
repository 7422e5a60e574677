//! Whole-weight patches: a difference added to the weight ([`Patch::Diff`](super::Patch::Diff),
//! which may grow the weight by zero-padding it) and a replacement value
//! ([`Patch::Set`](super::Patch::Set)); their shape rules and math (step 3 of the
//! [`adapters`](super) docs).

use candle_core::Tensor;

use super::{f32_on, scale, shape_err, DoraNorm, Region, WeightAdapter};
use crate::error::{Result, TensorContext};

/// The parts of a [`Patch::Diff`](super::Patch::Diff).
pub(super) struct Diff<'a> {
    /// The difference.
    pub(super) diff: &'a Tensor,
    /// Zero-pad the weight to the diff's shape first.
    pub(super) pad: bool,
}

/// The value of a [`Patch::Set`](super::Patch::Set).
pub(super) struct Set<'a>(pub(super) &'a Tensor);

impl WeightAdapter for Diff<'_> {
    fn kind(&self) -> &'static str {
        "diff"
    }

    fn output_shape(&self, key: &str, target: &[usize]) -> Result<Vec<usize>> {
        let d = self.diff.dims();
        if d == target {
            return Ok(target.to_vec());
        }
        if !self.pad {
            return Err(shape_err(
                key,
                target,
                d,
                "a diff must have the weight's shape",
            ));
        }
        if d.len() != target.len() || d.iter().zip(target).any(|(d, t)| d < t) {
            return Err(shape_err(
                key,
                target,
                d,
                "a padding diff must have the weight's rank and be at least as large in every dimension",
            ));
        }
        Ok(d.to_vec())
    }

    fn apply(&self, key: &str, w: &Tensor, s: f32, _dora: DoraNorm) -> Result<Tensor> {
        let diff = f32_on(key, self.diff, w.device(), "diff")?;
        let mut w = w.clone();
        if self.pad && diff.dims() != w.dims() {
            let have = w.dims().to_vec();
            for (i, (&d, &have)) in diff.dims().iter().zip(&have).enumerate() {
                w = w
                    .pad_with_zeros(i, 0, d - have)
                    .ctx(|| format!("`{key}`: padding the weight to {:?}", diff.dims()))?;
            }
        }
        if s == 0.0 {
            return Ok(w);
        }
        let scaled = scale(key, &diff, s)?;
        (&w + &scaled).ctx(|| format!("`{key}`: adding the diff"))
    }

    fn parts(&self) -> super::Parts<'_> {
        (vec![("diff", self.diff)], None)
    }

    /// Without padding, `apply` adds `s · diff`: the same scaled diff, in place, a block of
    /// rows at a time (a diff stored in half precision is upcast one block at a time).
    fn add_into(&self, key: &str, w: &Tensor, region: Region, s: f32) -> Result<bool> {
        // Validated: a diff of the target's element count has its shape (a padding one that
        // grows the weight has more).
        if self.diff.elem_count() != region.len * region.rest {
            return Ok(false);
        }
        if s == 0.0 {
            return Ok(true);
        }
        for (first, n) in region.blocks() {
            let rows = self
                .diff
                .narrow(0, first, n)
                .ctx(|| format!("`{key}`: rows {first}..{} of the diff", first + n))?;
            let d = scale(key, &f32_on(key, &rows, w.device(), "diff")?, s)?;
            region.add_rows(key, w, first, &d)?;
        }
        Ok(true)
    }
}

impl WeightAdapter for Set<'_> {
    fn kind(&self) -> &'static str {
        "set"
    }

    fn output_shape(&self, key: &str, target: &[usize]) -> Result<Vec<usize>> {
        if self.0.dims() != target {
            return Err(shape_err(
                key,
                target,
                self.0.dims(),
                "a set value must have the weight's shape",
            ));
        }
        Ok(target.to_vec())
    }

    fn apply(&self, key: &str, w: &Tensor, _s: f32, _dora: DoraNorm) -> Result<Tensor> {
        f32_on(key, self.0, w.device(), "set value")
    }

    fn parts(&self) -> super::Parts<'_> {
        (vec![("value", self.0)], None)
    }
}
