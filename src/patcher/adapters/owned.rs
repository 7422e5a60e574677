//! The patch engine: entries added into the weight's own `f32` buffer, in row blocks.
//!
//! # Why
//!
//! Candle tensors are immutable, so computing each entry with whole-tensor operations allocates a
//! new accumulator per entry and builds each delta whole:
//! while a LoHa is added the weight, both of its full-size factor products, their product and
//! the sum are alive together. On the CPU the patched weight is a buffer this engine owns
//! outright (a fresh decode of the clean weight, never the clean weight itself; on a GPU, the
//! decode of the copy), so an entry that
//! adds a delta adds it into that buffer in place (on a GPU, each block's sum is written over its
//! rows), a block of rows at a time: the delta of rows
//! `r..r + n` of the weight flattened to `[out, rest]` is computed (about [`BLOCK_ELEMS`]
//! values) and added, then the next block. A chain of LoRA, LoCon, LoHa, LoKr and diffs costs
//! the weight's buffer plus one block, whatever the kinds — and no fresh weight-sized buffer is
//! faulted in per entry.
//!
//! # Which entries go in place
//!
//! An entry is added in place when what it does to its target is `target + delta` elementwise:
//! a non-padding `Diff` or an adapter without DoRA (GLoRA's delta, which reads the weight, is
//! computed whole and then added), with `strength_model` 1 and no offset or an offset on
//! dimension 0 (a fused projection's rows: the target is a run of whole rows). A block's delta is
//! the same rows of the whole delta computed by the same operations (a row of a matmul is the
//! same dot products; a Kronecker row is the same products), so the engine gives the whole path's
//! values; the tests compare the two bit for bit. Every other entry (DoRA, a `strength_model`, an
//! offset on another dimension, a padding diff, `Set`, OFT) goes through the whole path and its
//! result becomes the buffer; a `Set` returns its value, the patch's own tensor, which is copied
//! first, so nothing is ever written into a patch and the result is always the caller's alone.

use candle_core::{CpuStorage, Device, Layout, Tensor};
use rayon::prelude::*;

use super::low_rank::LowRank;
use super::{apply_entry, entry_output_shape, DoraNorm, Patch, PatchEntry};
use crate::error::{Error, Result, TensorContext};

/// About how many values one block of a delta holds (8 MiB of `f32`): large enough that a
/// block's matmul runs at full speed, small enough to stay beside the weight unnoticed.
pub(super) const BLOCK_ELEMS: usize = 1 << 21;

/// Elements one parallel task adds.
const CHUNK: usize = 64 * 1024;

/// The rows of a weight an entry targets: rows `start..start + len` of the weight flattened to
/// `[rows, rest]`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Region {
    /// First row of the weight in the target.
    pub(super) start: usize,
    /// Rows in the target.
    pub(super) len: usize,
    /// Values per row.
    pub(super) rest: usize,
    /// Rows per block.
    block_rows: usize,
}

impl Region {
    /// The region `entry` targets in a weight of `shape`, when it is a run of whole rows.
    fn of(shape: &[usize], entry: &PatchEntry, block_elems: usize) -> Option<Region> {
        let (&rows, rest) = shape.split_first()?;
        let rest: usize = rest.iter().product();
        let (start, len) = match entry.offset {
            None => (0, rows),
            Some(o) if o.dim == 0 => (o.start, o.len),
            Some(_) => return None,
        };
        Some(Region {
            start,
            len,
            rest,
            block_rows: (block_elems / rest.max(1)).max(1),
        })
    }

    /// The blocks of the target: `(first row within the target, rows)`.
    pub(super) fn blocks(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        (0..self.len)
            .step_by(self.block_rows)
            .map(|r| (r, self.block_rows.min(self.len - r)))
    }

    /// The target itself, shaped as the weight with `len` rows: what a whole delta is computed
    /// for.
    pub(super) fn view(&self, key: &str, w: &Tensor) -> Result<Tensor> {
        w.narrow(0, self.start, self.len).ctx(|| {
            format!(
                "`{key}`: the rows {}..{}",
                self.start,
                self.start + self.len
            )
        })
    }

    /// Adds `d` (the delta of the target's rows from `row`, any shape of that many values) into
    /// `w`.
    ///
    /// On the CPU the values are added into `w`'s storage; on another device the block's sum is
    /// computed beside it and written over those rows (`slice_set`): a block's worth of
    /// temporaries either way.
    pub(super) fn add_rows(&self, key: &str, w: &Tensor, row: usize, d: &Tensor) -> Result<()> {
        let ctx = || format!("`{key}`: adding the delta in place");
        let d = d
            .contiguous()
            .ctx(|| format!("`{key}`: laying out the delta"))?;
        let first = self.start + row;
        if w.device().is_cpu() {
            return w.inplace_op2(&d, &AddAt(first * self.rest)).ctx(ctx);
        }
        let n = d.elem_count() / self.rest.max(1);
        let rows = w.narrow(0, first, n).ctx(ctx)?;
        let sum = d
            .reshape(rows.shape())
            .and_then(|d| &rows + &d)
            .and_then(|s| s.contiguous())
            .ctx(ctx)?;
        w.slice_set(&sum, 0, first).ctx(ctx)
    }

    /// Adds `lr` into the target's rows of `w`, a CPU `f32` tensor this engine owns, with the
    /// [`low_rank`](super::low_rank) kernel; `false` (nothing changed) when `w` is not a
    /// contiguous CPU `f32` tensor or `lr` does not fit the target.
    pub(super) fn add_low_rank(&self, key: &str, w: &Tensor, lr: &LowRank) -> Result<bool> {
        if !w.device().is_cpu() || w.dtype() != candle_core::DType::F32 {
            return Ok(false);
        }
        let op = AddLowRank {
            lr,
            region: *self,
            done: std::cell::Cell::new(false),
        };
        w.inplace_op1(&op)
            .ctx(|| format!("`{key}`: adding the low-rank delta in place"))?;
        Ok(op.done.get())
    }
}

/// The in-place op of [`Region::add_low_rank`].
struct AddLowRank<'a> {
    lr: &'a LowRank,
    region: Region,
    done: std::cell::Cell<bool>,
}

impl candle_core::InplaceOp1 for AddLowRank<'_> {
    fn name(&self) -> &'static str {
        "add-low-rank"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> candle_core::Result<()> {
        let (CpuStorage::F32(v), Some((a0, a1))) = (s, l.contiguous_offsets()) else {
            return Ok(());
        };
        let Region {
            start, len, rest, ..
        } = self.region;
        let (from, to) = (a0 + start * rest, a0 + (start + len) * rest);
        if to > a1 {
            return Ok(());
        }
        self.done.set(self.lr.add_into(&mut v[from..to], rest));
        Ok(())
    }
}

/// Applies `entries` in order to the weight whose `f32` values are `weight` (row-major, `shape`)
/// and returns the patched weight on the CPU: [`apply`](super::apply)'s values, validated the same
/// way, with entries that add a delta added into `weight`'s own buffer in row blocks (the
/// [`adapters`](super) docs, *Cost*): a chain of any delta kinds peaks at the weight plus one
/// block.
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
    let w = Tensor::from_vec(weight, shape, &Device::Cpu)
        .ctx(|| format!("`{key}`: the weight's f32 values"))?;
    apply_unique(key, w, entries, dora, BLOCK_ELEMS)
}

/// The engine: `w` is an `f32` tensor whose storage no other handle shares (the caller made it),
/// so entries may be added into it, on any device. The result is again a tensor no other handle
/// shares, so a caller may go on writing into it (the device finish rounds it in place).
pub(super) fn apply_unique(
    key: &str,
    mut w: Tensor,
    entries: &[PatchEntry],
    dora: DoraNorm,
    block_elems: usize,
) -> Result<Tensor> {
    for entry in entries {
        entry_output_shape(key, w.dims(), entry)?;
        if entry.strength_model == 1.0 {
            if let Some(region) = Region::of(w.dims(), entry, block_elems) {
                let done = entry
                    .patch
                    .adapter(|a| a.add_into(key, &w, region, entry.strength_patch))?;
                if done {
                    continue;
                }
            }
        }
        w = apply_entry(key, &w, entry, dora)?;
        if matches!(*entry.patch, Patch::Set(_)) {
            // A `Set` hands back its value, the patch's own tensor: copied, so the buffer stays
            // this call's (every other whole-path result is a new tensor).
            w = w.copy().ctx(|| format!("`{key}`: copying a set value"))?;
        }
    }
    Ok(w)
}

/// The chain `entries` on `src` (a CPU weight stored as `storage`: bf16, f16 or f32) in one pass
/// over memory, when every entry is a low-rank delta on whole rows (a LoRA or LoCon without DoRA,
/// `strength_model` 1, no offset or one on dimension 0): each block of
/// [`ROWS_PER_TASK`](super::low_rank::ROWS_PER_TASK) rows is decoded, has every entry's rows
/// added in order by the [`low_rank`](super::low_rank) kernel and, with `round`, is rounded
/// through `storage` (nearest-even), while it is in cache. The values are those of decoding,
/// [`apply_unique`] and rounding in turn — each value is the same sequence of operations — so
/// every path that patches a weight may take it. `None` (nothing done) when some entry is of
/// another form or `src` cannot be read so; the caller then runs the general engine.
///
/// # Errors
/// As [`apply`](super::apply): an entry that does not fit the weight.
pub(crate) fn apply_fused(
    key: &str,
    src: &Tensor,
    storage: crate::float::Dtype,
    entries: &[PatchEntry],
    round: bool,
) -> Result<Option<Tensor>> {
    let dims = src.dims();
    let mut adds = Vec::with_capacity(entries.len());
    for entry in entries {
        entry_output_shape(key, dims, entry)?;
        if entry.strength_model != 1.0 {
            return Ok(None);
        }
        let Some(region) = Region::of(dims, entry, BLOCK_ELEMS) else {
            return Ok(None);
        };
        if entry.strength_patch == 0.0 {
            continue;
        }
        let lr = entry
            .patch
            .adapter(|a| a.low_rank(key, entry.strength_patch))?;
        match lr {
            Some(lr) if lr.fits(region.len, region.rest) => adds.push((region, lr)),
            _ => return Ok(None),
        }
    }
    let Some(&rest) = adds.first().map(|(r, _)| &r.rest) else {
        return Ok(None);
    };
    let block_rows = super::low_rank::ROWS_PER_TASK;
    crate::float::decode_rows_with(src, storage, rest, block_rows, round, |first, block| {
        let last = first + block.len() / rest;
        for (region, lr) in &adds {
            let (from, to) = (first.max(region.start), last.min(region.start + region.len));
            if from < to {
                let dst = &mut block[(from - first) * rest..(to - first) * rest];
                lr.add_rows_from(dst, from - region.start);
            }
        }
    })
}

/// The in-place `s1[at..at + n] += s2` of two contiguous `f32` CPU storages, `n` being `s2`'s
/// length.
struct AddAt(usize);

impl candle_core::InplaceOp2 for AddAt {
    fn name(&self) -> &'static str {
        "add-at"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<()> {
        let (CpuStorage::F32(a), CpuStorage::F32(b)) = (s1, s2) else {
            candle_core::bail!("add-at: both operands must be f32");
        };
        let (Some((a0, a1)), Some((b0, b1))) = (l1.contiguous_offsets(), l2.contiguous_offsets())
        else {
            candle_core::bail!("add-at: both operands must be contiguous");
        };
        let n = b1 - b0;
        let start = a0 + self.0;
        if start + n > a1 {
            candle_core::bail!(
                "add-at: {n} values at {} overrun {} values",
                self.0,
                a1 - a0
            );
        }
        a[start..start + n]
            .par_chunks_mut(CHUNK)
            .zip(b[b0..b1].par_chunks(CHUNK))
            .for_each(|(a, b)| a.iter_mut().zip(b).for_each(|(a, &b)| *a += b));
        Ok(())
    }
}
