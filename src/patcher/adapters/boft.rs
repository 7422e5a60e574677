//! BOFT (LyCORIS butterfly OFT): the [`Boft`] adapter, `m` butterfly factors of block-diagonal
//! rotations of the output rows, each acting on rows interleaved at a wider stride; its shape
//! rule and math.

use candle_core::{DType, Tensor};

use super::oft::{cayley, Oft};
use super::{bad, shape_err, DoraNorm, WeightAdapter};
use crate::error::{Result, TensorContext};

/// A BOFT adapter: `m` butterfly factors, each `k` skew-symmetric blocks of `b × b` turned into
/// rotations by the Cayley transform (as [`Oft`]), applied to the output rows one factor after
/// the other, factor `i` pairing rows `2^i · b/2` apart.
///
/// # Math
///
/// With blocks `B [m, k, b, b]` (`k·b = out`, `b` even): `Q = B − Bᵀ` per block; with a positive
/// `alpha`, when `‖Q‖ + 1e-8 > alpha` (Frobenius norm over all `m·k` blocks) `Q` becomes
/// `Q · alpha / (‖Q‖ + 1e-8)`; `R = (I + Q)(I − Q)⁻¹` (solved on the host in f64, as OFT's).
/// Starting from `x = w` (viewed `[out, rest]`), for factor `i = 0 … m−1`, with
/// `h = 2^i · b/2`: the rows are regrouped — row `a·2h + g·h + c` (`g ∈ {0, 1}`, `c < h`) moves
/// to position `a·2h + 2c + g`, so rows `h` apart become neighbours — then each consecutive group
/// of `b` rows `x_j` becomes `Σ_j R_i[blk, ·, j] · x_j` (`R·x`, where OFT applies `Rᵀ`), with
/// `R_i` replaced by `s·R_i + (1 − s)·I` when the strength `s ≠ 1`; then the rows move back.
/// With `rescale` (`[out, 1, …]`) the result is multiplied by it per row. Finally
/// `w += s · (x − w)`. This is ComfyUI's `comfy/weight_adapter/boft.py` (the strength enters the
/// rotations and the difference both, as there). DoRA is not supported.
#[derive(Debug, Clone)]
pub struct Boft {
    /// `[m, k, b, b]`: `m` butterfly factors of `k` blocks of `b × b`, `k·b` = the weight's
    /// output dimension, `b` even.
    pub blocks: Tensor,
    /// Per-output-row scale applied after the rotations, `[out, 1, …]` (or `[out]`).
    pub rescale: Option<Tensor>,
    /// Norm constraint, as [`Oft::alpha`]: none, zero or negative leaves `Q` unconstrained.
    pub alpha: Option<f32>,
}

impl Boft {
    /// An unconstrained BOFT without rescale.
    pub fn new(blocks: Tensor) -> Self {
        Boft {
            blocks,
            rescale: None,
            alpha: None,
        }
    }
}

impl WeightAdapter for Boft {
    fn kind(&self) -> &'static str {
        "boft"
    }

    fn output_shape(&self, key: &str, target: &[usize]) -> Result<Vec<usize>> {
        boft_shape(key, target, self)
    }

    fn apply(&self, key: &str, w: &Tensor, s: f32, _dora: DoraNorm) -> Result<Tensor> {
        boft_apply(key, w, self, s)
    }

    fn parts(&self) -> super::Parts<'_> {
        let mut t = vec![("oft_blocks", &self.blocks)];
        t.extend(self.rescale.iter().map(|r| ("rescale", r)));
        (t, self.alpha)
    }
}

/// BOFT's shape rule: `[m, k, b, b]` blocks with `b` even, `k·b` output rows, each factor's
/// stride `2^i · b` dividing them; a `rescale` of one value per output row.
fn boft_shape(key: &str, target: &[usize], o: &Boft) -> Result<Vec<usize>> {
    let d = o.blocks.dims();
    if d.len() != 4 || d[2] != d[3] || d.contains(&0) || !d[2].is_multiple_of(2) {
        return Err(bad(
            key,
            format!("BOFT blocks {d:?} must be [m, k, b, b] with m, k > 0 and b even"),
        ));
    }
    let (m, k, b) = (d[0], d[1], d[2]);
    let rows = k * b;
    let out = target.first().copied();
    let strides_fit = (0..m).all(|i| {
        1usize
            .checked_shl(i as u32)
            .and_then(|p| p.checked_mul(b))
            .is_some_and(|stride| rows % stride == 0)
    });
    if out != Some(rows) || !strides_fit {
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
                "BOFT's {k} blocks of {b} rotate {rows} output rows in {m} butterfly factors \
                 (each factor's stride 2^i·{b} must divide them); the weight has {out:?}"
            ),
        ));
    }
    if let Some(r) = &o.rescale {
        if r.elem_count() != rows || r.dims().first() != Some(&rows) {
            return Err(bad(
                key,
                format!(
                    "BOFT rescale {:?} must hold one value per output row ({rows})",
                    r.dims()
                ),
            ));
        }
    }
    Ok(target.to_vec())
}

/// The row order of butterfly factor `i`'s grouping: position `a·2h + 2c + g` takes row
/// `a·2h + g·h + c`, `h` the half-stride.
fn butterfly(out: usize, h: usize) -> Vec<u32> {
    (0..out)
        .map(|p| {
            let (a, r) = (p / (2 * h), p % (2 * h));
            let (c, g) = (r / 2, r % 2);
            (a * 2 * h + g * h + c) as u32
        })
        .collect()
}

/// The inverse of a permutation.
fn inverse(perm: &[u32]) -> Vec<u32> {
    let mut inv = vec![0u32; perm.len()];
    for (p, &row) in perm.iter().enumerate() {
        inv[row as usize] = p as u32;
    }
    inv
}

/// `w + s · (x − w)`, `x` the rotated (and rescaled) weight (see [`Boft`]).
fn boft_apply(key: &str, w: &Tensor, o: &Boft, s: f32) -> Result<Tensor> {
    if s == 0.0 {
        return Ok(w.clone());
    }
    let ctx = || format!("`{key}`: applying the BOFT rotations");
    let d = o.blocks.dims().to_vec();
    let (m, k, b) = (d[0], d[1], d[2]);
    let as_oft = Oft {
        blocks: o.blocks.reshape((m * k, b, b)).ctx(ctx)?,
        alpha: o.alpha,
    };
    let r = cayley(key, &as_oft)?;
    let out = k * b;
    let rest = w.elem_count() / out.max(1);
    let dev = w.device();
    let org = w.reshape((out, rest)).ctx(ctx)?;
    let mut x = org.clone();
    for i in 0..m {
        let factor: Vec<f32> = r[i * k * b * b..(i + 1) * k * b * b]
            .iter()
            .enumerate()
            .map(|(x, &v)| {
                let eye = if (x / b) % b == x % b { 1.0 } else { 0.0 };
                if s == 1.0 {
                    v as f32
                } else {
                    (v * f64::from(s) + (1.0 - f64::from(s)) * eye) as f32
                }
            })
            .collect();
        let factor = Tensor::from_vec(factor, (k, b, b), dev).ctx(ctx)?;
        let perm = butterfly(out, (1usize << i) * b / 2);
        let back = Tensor::new(inverse(&perm), dev).ctx(ctx)?;
        let perm = Tensor::new(perm, dev).ctx(ctx)?;
        x = x
            .index_select(&perm, 0)
            .and_then(|x| x.reshape((k, b, rest)))
            .and_then(|x| factor.matmul(&x))
            .and_then(|x| x.reshape((out, rest)))
            .and_then(|x| x.index_select(&back, 0))
            .ctx(ctx)?;
    }
    if let Some(rescale) = &o.rescale {
        let rescale = rescale
            .to_device(dev)
            .and_then(|r| r.to_dtype(DType::F32))
            .and_then(|r| r.reshape((out, 1)))
            .ctx(ctx)?;
        x = x.broadcast_mul(&rescale).ctx(ctx)?;
    }
    let step = (x - &org)
        .and_then(|d| d.affine(f64::from(s), 0.0))
        .and_then(|d| d.reshape(w.shape()))
        .ctx(ctx)?;
    (w + &step).ctx(ctx)
}
