//! [`apply_owned`]: [`apply`](super::apply) for a weight the caller hands over as an `f32`
//! buffer, adding plain deltas into that buffer in place.
//!
//! # Why
//!
//! [`apply`](super::apply) never modifies its weight (candle tensors are shared, and the base
//! weight must stay clean), so each entry allocates a new accumulator: while a LoRA is added the
//! weight, its delta and their sum are alive together, three weights' worth of memory. A caller
//! that owns the weight's `f32` values outright (the streaming merge of `tools.rs`, which reads
//! each weight from the file only to patch it) can let the sum overwrite them: two weights'
//! worth (the values and one delta).
//!
//! # Same bits
//!
//! An entry is added in place only when [`apply`](super::apply) would compute exactly
//! `w + delta` elementwise for it ([`Addition::Delta`]): no offset, `strength_model` 1, and a
//! `Diff` that does not pad or an adapter without DoRA. The delta is computed by the same code,
//! and `w[i] + delta[i]` is one IEEE addition either way, so the result is bit for bit
//! [`apply`](super::apply)'s. Every other entry goes through [`apply`](super::apply)'s own path;
//! its result may share storage with a patch tensor (a `Set` returns its value), so from then on
//! the chain never writes in place again.

use candle_core::{CpuStorage, Device, Layout, Tensor};
use rayon::prelude::*;

use super::{apply_entry, entry_output_shape, DoraNorm, PatchEntry};
use crate::error::{Error, Result, TensorContext};

/// What one entry does to its target, when that is simple enough to do in place.
pub(super) enum Addition {
    /// Nothing: the result is the target itself (a strength of 0).
    Unchanged,
    /// The result is `target + delta`, elementwise; `delta` has the target's shape.
    Delta(Tensor),
    /// Anything else: [`apply`](super::apply)'s own path computes it.
    Other,
}

/// Elements one parallel task adds.
const CHUNK: usize = 64 * 1024;

/// Applies `entries` in order to the weight whose `f32` values are `weight` (row-major, `shape`)
/// and returns the patched weight on the CPU: bit for bit what [`apply`](super::apply) returns
/// for the same values, validated the same way, but entries that only add a delta add it into
/// `weight`'s buffer, so a LoRA chain peaks at two weights' worth of memory instead of three.
///
/// # Errors
/// As [`apply`](super::apply); [`Error::ShapeMismatch`] when `weight` does not have `shape`'s
/// element count.
pub fn apply_owned(
    key: &str,
    weight: Vec<f32>,
    shape: &[usize],
    entries: &[PatchEntry],
    dora: DoraNorm,
) -> Result<Tensor> {
    if weight.len() != shape.iter().product::<usize>() {
        return Err(Error::ShapeMismatch {
            what: format!("`{key}`: the f32 values of the weight"),
            expected: shape.to_vec(),
            got: vec![weight.len()],
        });
    }
    // Built here from the caller's buffer: no other handle to this storage exists.
    let mut w = Tensor::from_vec(weight, shape, &Device::Cpu)
        .ctx(|| format!("`{key}`: the weight's f32 values"))?;
    let mut owned = true;
    for entry in entries {
        entry_output_shape(key, w.dims(), entry)?;
        if owned {
            match addition(key, &w, entry)? {
                Addition::Unchanged => continue,
                Addition::Delta(d) => {
                    add_into(key, &w, &d)?;
                    continue;
                }
                Addition::Other => {}
            }
        }
        w = apply_entry(key, &w, entry, dora)?;
        owned = false;
    }
    Ok(w)
}

/// The [`Addition`] of `entry` on the whole target `w`.
fn addition(key: &str, w: &Tensor, entry: &PatchEntry) -> Result<Addition> {
    if entry.offset.is_some() || entry.strength_model != 1.0 {
        return Ok(Addition::Other);
    }
    entry
        .patch
        .adapter(|a| a.addition(key, w, entry.strength_patch))
}

/// `w += d`, elementwise, in `w`'s own storage.
fn add_into(key: &str, w: &Tensor, d: &Tensor) -> Result<()> {
    let d = d
        .contiguous()
        .ctx(|| format!("`{key}`: laying out the delta"))?;
    w.inplace_op2(&d, &AddInto)
        .ctx(|| format!("`{key}`: adding the delta in place"))
}

/// The in-place `s1 += s2` of two contiguous `f32` CPU storages of one length.
struct AddInto;

impl candle_core::InplaceOp2 for AddInto {
    fn name(&self) -> &'static str {
        "add-into"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<()> {
        let (CpuStorage::F32(a), CpuStorage::F32(b)) = (s1, s2) else {
            candle_core::bail!("add-into: both operands must be f32");
        };
        let (Some((a0, a1)), Some((b0, b1))) = (l1.contiguous_offsets(), l2.contiguous_offsets())
        else {
            candle_core::bail!("add-into: both operands must be contiguous");
        };
        if a1 - a0 != b1 - b0 {
            candle_core::bail!("add-into: {} values against {}", a1 - a0, b1 - b0);
        }
        a[a0..a1]
            .par_chunks_mut(CHUNK)
            .zip(b[b0..b1].par_chunks(CHUNK))
            .for_each(|(a, b)| a.iter_mut().zip(b).for_each(|(a, &b)| *a += b));
        Ok(())
    }
}
