//! Attention masks: a boolean (`U8`) or additive (float) mask, checked to broadcast to
//! `[B, heads, Nq, Nk]`, and the part of it one chunk of scores needs.

use candle_core::{DType, Tensor};

use crate::error::{Error, Result};

/// A mask, as a 4-d tensor broadcastable to `[B, H, Nq, Nk]`.
pub(super) enum Mask {
    /// `U8`: 1 attends, 0 masks.
    Bool(Tensor),
    /// Float, added to the scores.
    Additive(Tensor),
}

impl Mask {
    pub(super) fn new(m: &Tensor, target: [usize; 4]) -> Result<Self> {
        let dims = m.dims();
        let mismatch = || Error::ShapeMismatch {
            what: "attention mask (must broadcast to [B, heads, Nq, Nk])".into(),
            expected: target.to_vec(),
            got: dims.to_vec(),
        };
        if dims.len() > 4 {
            return Err(mismatch());
        }
        let mut shape = [1usize; 4];
        shape[4 - dims.len()..].copy_from_slice(dims);
        if shape.iter().zip(target).any(|(&s, t)| s != 1 && s != t) {
            return Err(mismatch());
        }
        let m4 = m.reshape(shape.to_vec())?;
        match m.dtype() {
            DType::U8 => Ok(Mask::Bool(m4)),
            dt if dt.is_float() => Ok(Mask::Additive(m4)),
            dt => Err(Error::UnsupportedDtype {
                dtype: format!("{dt:?}"),
                what: "attention mask (use U8 for boolean or a float dtype for additive)".into(),
            }),
        }
    }

    /// The part of the mask for query rows `q0..q0+qn` and keys `k0..k0+kn` (a view).
    pub(super) fn chunk(t: &Tensor, q0: usize, qn: usize, k0: usize, kn: usize) -> Result<Tensor> {
        let t = if t.dim(2)? != 1 {
            t.narrow(2, q0, qn)?
        } else {
            t.clone()
        };
        Ok(if t.dim(3)? != 1 {
            t.narrow(3, k0, kn)?
        } else {
            t
        })
    }
}
