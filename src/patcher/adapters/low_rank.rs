//! The low-rank update kernel: `dst[i, :] += Σ_k coef[i, k] · down[k, :]`, added into the
//! weight's own rows on the CPU without building the delta.
//!
//! # Why
//!
//! A LoRA's delta `up · down` has the weight's size but a tiny inner dimension (the rank). Built
//! by a matrix product it is written out whole (a weight-sized buffer, faulted in, at every patch)
//! and read again to be added: for a 2048² weight and rank 16 that costs as much as the layer's
//! own matmul at batch 64, where its arithmetic is a quarter of it. This kernel computes each row
//! of the delta in registers, a tile of columns at a time, and adds it to the weight's row while
//! both are in cache: the weight is read and written once, nothing else weight-sized exists.
//!
//! # Bits
//!
//! Each delta value is one fused multiply-add chain over the rank, in order, from zero —
//! `acc = fma(coef[i, k], down[k, j], acc)` for `k = 0, 1, …` — then added to the weight's value.
//! That is what candle's CPU matmul (the `gemm` crate) computes for a product whose inner
//! dimension fits its blocking (all but an inner dimension of 2, see [`takes`]), so for the
//! ranks it [`takes`] the kernel gives the same bits as the
//! whole path (`up.matmul(down)` then the add; the engine's tests compare them). Every variant
//! (baseline, AVX2, AVX-512) runs the same chain per value, so the CPU changes only the speed.
//!
//! # Cost
//!
//! `rows × cols × rank` fused multiply-adds, `down` (`rank × cols` values) read once per tile
//! of a row from cache; the work is split over rayon's threads by blocks of rows.

use rayon::prelude::*;

use crate::float::multiversion::multiversion;

/// The largest rank this kernel takes. Up to it candle's CPU matmul computes every value as one
/// chain over the rank (the tests below compare the two up to this rank), so the kernel keeps
/// the whole path's bits; a larger rank goes through candle's matmul.
pub(super) const MAX_RANK: usize = 128;

/// Whether the kernel takes a delta of inner dimension `rank`: up to [`MAX_RANK`], except 2 —
/// for an inner dimension of 2 candle's CPU matmul multiplies and adds without fusing
/// (`a0·b0 + a1·b1`), so a rank-2 delta keeps its bits through candle's matmul.
pub(super) fn takes(rank: usize) -> bool {
    rank > 0 && rank <= MAX_RANK && rank != 2
}

/// Columns one register tile holds (four AVX-512 registers a row).
const TILE: usize = 64;

/// Rows updated together: each tile of `down` loaded from cache feeds this many rows' chains
/// (sixteen AVX-512 accumulators), so the kernel runs at the multiply-add units' rate rather
/// than the cache's.
const ROWS: usize = 4;

/// Rows one parallel task updates (and the fused engine decodes, patches and rounds at once):
/// 16 rows of a 2048-wide weight are 128 KiB, well inside a core's cache.
pub(super) const ROWS_PER_TASK: usize = 16;

/// A low-rank delta `coef · down`, its scale folded into `coef`: `coef` is `[rows, rank]`,
/// `down` `[rank, cols]`, both row-major. `down` is kept packed by tiles of [`TILE`] columns — a
/// tile's `rank × TILE` values contiguous, the last tile padded with zeros — so every tile, the
/// last included, runs the same loop over contiguous values (the padding's sums are computed and
/// not stored).
#[derive(Debug)]
pub(super) struct LowRank {
    coef: Vec<f32>,
    packed: Vec<f32>,
    rank: usize,
    cols: usize,
}

impl LowRank {
    /// The delta `coef · down` (`coef` `[rows, rank]`, `down` `[rank, cols]`, row-major), or
    /// `None` when the lengths do not describe such a product.
    pub(super) fn new(coef: Vec<f32>, down: &[f32], rank: usize) -> Option<LowRank> {
        if rank == 0
            || down.is_empty()
            || !down.len().is_multiple_of(rank)
            || !coef.len().is_multiple_of(rank)
        {
            return None;
        }
        let cols = down.len() / rank;
        let tiles = cols.div_ceil(TILE);
        let mut packed = vec![0f32; tiles * rank * TILE];
        for (tile, dst) in packed.chunks_exact_mut(rank * TILE).enumerate() {
            let j = tile * TILE;
            let n = TILE.min(cols - j);
            for (k, dst) in dst.chunks_exact_mut(TILE).enumerate() {
                dst[..n].copy_from_slice(&down[k * cols + j..k * cols + j + n]);
            }
        }
        Some(LowRank {
            coef,
            packed,
            rank,
            cols,
        })
    }

    /// Whether this is a delta of `rows` rows of `cols` values.
    pub(super) fn fits(&self, rows: usize, cols: usize) -> bool {
        self.cols == cols && self.coef.len() == rows * self.rank
    }

    /// Adds the delta into `dst`, the target's rows (`cols` values each, as many rows as `coef`
    /// has), in parallel. Returns `false`, changing nothing, when the shapes do not agree.
    pub(super) fn add_into(&self, dst: &mut [f32], cols: usize) -> bool {
        if cols == 0 || !dst.len().is_multiple_of(cols) || !self.fits(dst.len() / cols, cols) {
            return false;
        }
        dst.par_chunks_mut(cols * ROWS_PER_TASK)
            .enumerate()
            .for_each(|(i, rows)| self.add_rows_from(rows, i * ROWS_PER_TASK));
        true
    }

    /// Adds rows `first..` of the delta into `dst` (whole rows, as many as it holds) on the
    /// calling thread. The caller has checked [`LowRank::fits`] and that the rows exist.
    pub(super) fn add_rows_from(&self, dst: &mut [f32], first: usize) {
        let (rank, cols) = (self.rank, self.cols);
        let n = dst.len() / cols;
        let coef = &self.coef[first * rank..(first + n) * rank];
        let mut rows = dst.chunks_exact_mut(cols * ROWS);
        let mut coefs = coef.chunks_exact(rank * ROWS);
        for (block, coef) in (&mut rows).zip(&mut coefs) {
            add_tiles_4(block, cols, coef, &self.packed);
        }
        let rest = rows.into_remainder().chunks_mut(cols);
        for (row, coef) in rest.zip(coefs.remainder().chunks(rank)) {
            add_tiles_1(row, cols, coef, &self.packed);
        }
    }
}

/// The tile loop of the kernels below (`block` is as many rows as accumulators, `coef` as many
/// rows of `rank` coefficients, `packed` the packed `down`): `block[r, j] += Σ_k coef[r, k] ·
/// down[k, j]`, each sum one fused chain over `k` from zero. The accumulators `$acc` are one
/// `[f32; TILE]` per row, each its own local so the compiler keeps them in registers (an array of
/// them it keeps in memory).
macro_rules! tiles {
    ($block:ident, $cols:ident, $coef:ident, $packed:ident, $($r:literal => $acc:ident),+) => {{
        let rows = [$($r),+].len();
        let rank = $coef.len() / rows;
        for (tile, down) in $packed.chunks_exact(rank * TILE).enumerate() {
            let j = tile * TILE;
            $(let mut $acc = [0f32; TILE];)+
            for (k, d) in down.chunks_exact(TILE).enumerate() {
                $(
                    let a = $coef[$r * rank + k];
                    for t in 0..TILE {
                        $acc[t] = a.mul_add(d[t], $acc[t]);
                    }
                )+
            }
            let n = TILE.min($cols - j);
            $(
                let row = &mut $block[$r * $cols + j..$r * $cols + j + n];
                match <&mut [f32; TILE]>::try_from(&mut *row) {
                    // A whole tile: added as vectors.
                    Ok(row) => {
                        for t in 0..TILE {
                            row[t] += $acc[t];
                        }
                    }
                    Err(_) => {
                        for (w, a) in row.iter_mut().zip($acc) {
                            *w += a;
                        }
                    }
                }
            )+
        }
    }};
}

multiversion! {
    /// [`ROWS`] rows: sixteen AVX-512 accumulators.
    fn add_tiles_4(block: &mut [f32], cols: usize, coef: &[f32], packed: &[f32]) {
        tiles!(block, cols, coef, packed, 0 => a0, 1 => a1, 2 => a2, 3 => a3)
    }
}

multiversion! {
    /// One row.
    fn add_tiles_1(block: &mut [f32], cols: usize, coef: &[f32], packed: &[f32]) {
        tiles!(block, cols, coef, packed, 0 => a0)
    }
}

#[cfg(test)]
mod tests {
    use candle_core::Tensor;

    use super::*;

    fn values(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1().unwrap()
    }

    #[test]
    fn adds_candle_s_matmul_bits_for_every_rank_up_to_the_limit() {
        // Column counts around the tile (a partial tile, exact tiles, a remainder) and ranks
        // from 1 to the limit: the kernel's sum equals `w + up.matmul(down)` bit for bit.
        for (rows, cols) in [(3, 5), (17, 64), (9, 130), (33, 2048)] {
            for rank in [1, 3, 7, 16, 64, MAX_RANK] {
                assert!(takes(rank));
                let seed = (rows * cols + rank) as u64;
                let w = crate::float::uniform_tensor(&[rows, cols], seed).unwrap();
                let up = crate::float::uniform_tensor(&[rows, rank], seed + 1).unwrap();
                let down = crate::float::uniform_tensor(&[rank, cols], seed + 2).unwrap();
                let expected = values(&(&w + up.matmul(&down).unwrap()).unwrap());
                let mut got = values(&w);
                let lr = LowRank::new(values(&up), &values(&down), rank).unwrap();
                assert!(lr.add_into(&mut got, cols));
                let differ = got
                    .iter()
                    .zip(&expected)
                    .filter(|(a, b)| a.to_bits() != b.to_bits())
                    .count();
                assert_eq!(differ, 0, "{rows}x{cols}, rank {rank}");
            }
        }
    }

    #[test]
    fn leaves_rank_2_and_ranks_above_the_limit_to_candle() {
        // candle's matmul computes an inner dimension of 2 as a0·b0 + a1·b1, unfused: the
        // kernel's chain would round differently.
        let up = crate::float::uniform_tensor(&[64, 2], 1).unwrap();
        let down = crate::float::uniform_tensor(&[2, 300], 2).unwrap();
        let candle = values(&up.matmul(&down).unwrap());
        let (u, d) = (values(&up), values(&down));
        let unfused = (0..64 * 300).all(|i| {
            let (r, j) = (i / 300, i % 300);
            candle[i].to_bits() == (u[2 * r] * d[j] + u[2 * r + 1] * d[300 + j]).to_bits()
        });
        assert!(unfused);
        assert!(!takes(2) && !takes(0) && !takes(MAX_RANK + 1));
    }

    #[test]
    fn refuses_factors_that_do_not_fit_the_rows_and_changes_nothing() {
        let mut dst = vec![1.0f32; 12];
        let lr = LowRank::new(vec![1.0; 3 * 2], &[1.0; 2 * 4], 2).unwrap();
        assert!(LowRank::new(vec![1.0; 3], &[1.0; 8], 2).is_none());
        // 12 values of 4 columns are 3 rows: fits.
        assert!(lr.add_into(&mut dst.clone(), 4));
        // 6 columns: 2 rows for 3 rows of coefficients; 5 columns: not whole rows.
        assert!(!lr.add_into(&mut dst, 6));
        assert!(!lr.add_into(&mut dst, 5));
        assert!(dst.iter().all(|&v| v == 1.0));
    }
}
