//! OFT (LyCORIS diag-OFT): the [`Oft`] adapter, a block-diagonal rotation of the output rows, its
//! shape rule, the Cayley transform and the rotation.

use candle_core::{DType, Tensor};

use super::{bad, shape_err, DoraNorm, WeightAdapter};
use crate::error::{Result, TensorContext};

/// An OFT adapter (LyCORIS diag-OFT): each of `k` skew-symmetric blocks `Q = B − Bᵀ` becomes a
/// rotation `R = (I + Q)(I − Q)⁻¹` (Cayley transform), and the weight's output rows, taken `n`
/// at a time, are rotated by `Rᵀ`. The constraint and the strength are below.
///
/// # Math
///
/// With blocks `B [k, n, n]`, `k·n = out`: per block `Q = B − Bᵀ`;
/// with a positive `alpha`, when `‖Q‖ + 1e-8 > alpha` (Frobenius norm over all blocks) `Q`
/// becomes `Q · alpha / (‖Q‖ + 1e-8)`; `R = (I + Q)(I − Q)⁻¹` (Cayley transform, orthogonal).
/// The weight, viewed as `[k, n, rest]` (output rows in consecutive groups of `n`, a conv's
/// filters whole), is rotated as `rot[b, m, ·] = Σ_j R[b, j, m] · w[b, j, ·]` (`Rᵀ·w_b`),
/// and `w += s² · (rot − w)`. The square is ComfyUI's (`comfy/weight_adapter/oft.py` builds
/// `s·R − s·I` and then multiplies the result by `s` again); LyCORIS
/// (`modules/diag_oft.py`) interpolates linearly, `(s·R + (1 − s)·I)`, and checks the norm
/// against `alpha · out` rather than `alpha`. Both agree at `s = 1` with no active
/// constraint. The Cayley transform is solved on the host in f64 (Gauss–Jordan; the blocks
/// are small, `k·n³`), the rotation applied in f32. DoRA and `rescale` are not supported; 4-D
/// butterfly blocks are [`Boft`](super::Boft).
#[derive(Debug, Clone)]
pub struct Oft {
    /// `[k, n, n]`, `k·n` = the weight's output dimension. (4-D butterfly blocks are
    /// [`Boft`](super::Boft).)
    pub blocks: Tensor,
    /// Norm constraint: when positive and `‖Q‖ + 1e-8` (Frobenius, over all blocks) exceeds it,
    /// `Q` is scaled to `Q · alpha / (‖Q‖ + 1e-8)`. None, zero or negative: unconstrained.
    pub alpha: Option<f32>,
}

impl Oft {
    /// An unconstrained OFT.
    pub fn new(blocks: Tensor) -> Self {
        Oft {
            blocks,
            alpha: None,
        }
    }
}

impl WeightAdapter for Oft {
    fn kind(&self) -> &'static str {
        "oft"
    }

    fn output_shape(&self, key: &str, target: &[usize]) -> Result<Vec<usize>> {
        oft_shape(key, target, self)
    }

    fn apply(&self, key: &str, w: &Tensor, s: f32, _dora: DoraNorm) -> Result<Tensor> {
        oft_apply(key, w, self, s)
    }

    fn parts(&self) -> super::Parts<'_> {
        (vec![("oft_blocks", &self.blocks)], self.alpha)
    }
}

/// OFT's shape rule: `[k, n, n]` blocks (not BOFT's 4-D ones) rotating exactly the weight's
/// output rows; the shape is unchanged.
fn oft_shape(key: &str, target: &[usize], o: &Oft) -> Result<Vec<usize>> {
    let d = o.blocks.dims();
    if d.len() == 4 {
        return Err(bad(
            key,
            format!("OFT blocks {d:?} are 4-D (butterfly factors): that is a BOFT patch"),
        ));
    }
    if d.len() != 3 || d[1] != d[2] || d[0] == 0 || d[1] == 0 {
        return Err(bad(
            key,
            format!("OFT blocks {d:?} must be [k, n, n] with k, n > 0"),
        ));
    }
    let rows = d[0] * d[1];
    if target.first() != Some(&rows) {
        let mut natural = target.to_vec();
        match natural.first_mut() {
            Some(first) => *first = rows,
            None => natural.push(rows),
        }
        return Err(shape_err(
            key,
            target,
            &natural,
            format!(
                "OFT's {} blocks of {} rotate {rows} output rows; the weight has {:?}",
                d[0],
                d[1],
                target.first()
            ),
        ));
    }
    Ok(target.to_vec())
}

/// `w + s² · (Rᵀ·w − w)` per block of `n` output rows (ComfyUI's strength; see [`Oft`]).
fn oft_apply(key: &str, w: &Tensor, o: &Oft, s: f32) -> Result<Tensor> {
    if s == 0.0 {
        return Ok(w.clone());
    }
    let ctx = || format!("`{key}`: applying the OFT rotation");
    let (k, n) = (o.blocks.dim(0).ctx(ctx)?, o.blocks.dim(1).ctx(ctx)?);
    let r = cayley(key, o)?;
    // Rᵀ per block, so that rotated[k, m, ·] = Σ_n R[k, n, m] · w[k, n, ·].
    let mut rt = vec![0f32; r.len()];
    for b in 0..k {
        for i in 0..n {
            for j in 0..n {
                rt[(b * n + j) * n + i] = r[(b * n + i) * n + j] as f32;
            }
        }
    }
    let rest = w.elem_count() / (k * n).max(1);
    let rt = Tensor::from_vec(rt, (k, n, n), w.device()).ctx(ctx)?;
    let blocks = w.reshape((k, n, rest)).ctx(ctx)?;
    let step = rt
        .matmul(&blocks)
        .and_then(|rot| rot - &blocks)
        .and_then(|d| d.reshape(w.shape()))
        .and_then(|d| d.affine(f64::from(s) * f64::from(s), 0.0))
        .ctx(ctx)?;
    (w + &step).ctx(ctx)
}

/// The rotations `R = (I + Q)(I − Q)⁻¹` of an OFT's blocks, `[k, n, n]` row-major, in f64 (the
/// blocks are small; `I − Q` is always invertible for a skew-symmetric `Q`).
pub(super) fn cayley(key: &str, o: &Oft) -> Result<Vec<f64>> {
    let ctx = || format!("`{key}`: reading the OFT blocks");
    let (k, n) = (o.blocks.dim(0).ctx(ctx)?, o.blocks.dim(1).ctx(ctx)?);
    let b: Vec<f32> = o
        .blocks
        .to_dtype(DType::F32)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1())
        .ctx(ctx)?;
    let at = |blk: usize, i: usize, j: usize| f64::from(b[(blk * n + i) * n + j]);
    let mut q: Vec<f64> = (0..k * n * n)
        .map(|x| {
            let (blk, i, j) = (x / (n * n), (x / n) % n, x % n);
            at(blk, i, j) - at(blk, j, i)
        })
        .collect();
    if let Some(alpha) = o.alpha.map(f64::from).filter(|a| *a > 0.0) {
        let norm = q.iter().map(|v| v * v).sum::<f64>().sqrt() + 1e-8;
        if norm > alpha {
            q.iter_mut().for_each(|v| *v *= alpha / norm);
        }
    }
    let mut r = vec![0f64; k * n * n];
    for blk in 0..k {
        let qb = &q[blk * n * n..(blk + 1) * n * n];
        let eye = |i: usize, j: usize| if i == j { 1.0 } else { 0.0 };
        // Gauss-Jordan on [I − Q | I] with partial pivoting.
        let mut m: Vec<f64> = (0..n * n).map(|x| eye(x / n, x % n) - qb[x]).collect();
        let mut inv: Vec<f64> = (0..n * n).map(|x| eye(x / n, x % n)).collect();
        for c in 0..n {
            let p = (c..n)
                .max_by(|&a, &b| m[a * n + c].abs().total_cmp(&m[b * n + c].abs()))
                .unwrap_or(c);
            let pivot = m[p * n + c];
            if !pivot.is_finite() || pivot == 0.0 {
                return Err(bad(
                    key,
                    format!("OFT block {blk} is not finite (I − Q cannot be inverted)"),
                ));
            }
            for j in 0..n {
                m.swap(c * n + j, p * n + j);
                inv.swap(c * n + j, p * n + j);
            }
            for j in 0..n {
                m[c * n + j] /= pivot;
                inv[c * n + j] /= pivot;
            }
            for row in (0..n).filter(|&row| row != c) {
                let f = m[row * n + c];
                if f != 0.0 {
                    for j in 0..n {
                        m[row * n + j] -= f * m[c * n + j];
                        inv[row * n + j] -= f * inv[c * n + j];
                    }
                }
            }
        }
        let out = &mut r[blk * n * n..(blk + 1) * n * n];
        for i in 0..n {
            for j in 0..n {
                out[i * n + j] = (0..n)
                    .map(|l| (eye(i, l) + qb[i * n + l]) * inv[l * n + j])
                    .sum();
            }
        }
    }
    Ok(r)
}
