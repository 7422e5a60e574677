//! LoKr: the [`LoKr`] adapter, the Kronecker product of two factors (each whole, a product or a
//! Tucker product), its shape rule and its delta.

use candle_core::{Device, Tensor};

use super::factor::Factor;
use super::{alpha_scale, bad, DeltaAdapter};
use crate::error::{Result, TensorContext};

/// A LoKr adapter: `delta = kron(w1, w2)`, each factor stored whole or factorised.
///
/// # Math
///
/// `w += s · scale · kron(w1, w2)` where `w1` is `w1` or `w1a·w1b` and `w2` is `w2`,
/// `w2a·w2b`, or the Tucker product of `t2`, `w2a`, `w2b` as for LoHa. `scale` is
/// `alpha / rank` **only when a factor is stored factorised** (`rank = w2b.dims()[0]` when `w2`
/// is factorised, else `w1b.dims()[0]`); a LoKr with both `w1` and `w2` stored whole ignores
/// alpha (scale 1), like the LyCORIS reference. A 2-D `w1` next to a 4-D `w2` is treated as
/// `[a, b, 1, 1]`.
#[derive(Debug, Clone, Default)]
pub struct LoKr {
    /// First factor, whole.
    pub w1: Option<Tensor>,
    /// First factor, left part (with `w1b`), when `w1` is absent.
    pub w1a: Option<Tensor>,
    /// First factor, right part.
    pub w1b: Option<Tensor>,
    /// Second factor, whole.
    pub w2: Option<Tensor>,
    /// Second factor, left part (with `w2b`, `[r, out]` with `t2`), when `w2` is absent.
    pub w2a: Option<Tensor>,
    /// Second factor, right part.
    pub w2b: Option<Tensor>,
    /// Tucker core of the second factor.
    pub t2: Option<Tensor>,
    /// `alpha / rank` scaling, applied only when a factor is factorised.
    pub alpha: Option<f32>,
    /// DoRA magnitude.
    pub dora_scale: Option<Tensor>,
}

impl DeltaAdapter for LoKr {
    const KIND: &'static str = "lokr";

    fn delta_shape(&self, key: &str, _target: &[usize]) -> Result<Vec<usize>> {
        let (w1, w2, rank) = lokr_parts(key, self)?;
        if rank == Some(0) {
            return Err(bad(key, "LoKr rank is 0"));
        }
        let s1 = w1.shape(key, "lokr_w1")?;
        let s2 = w2.shape(key, "lokr_w2")?;
        let n = s1.len().max(s2.len());
        Ok((0..n)
            .map(|i| {
                s1.get(i)
                    .copied()
                    .unwrap_or(1)
                    .saturating_mul(s2.get(i).copied().unwrap_or(1))
            })
            .collect())
    }

    fn delta(&self, key: &str, w: &Tensor, factor: f32) -> Result<Tensor> {
        lokr_delta(key, self, w.device(), factor)
    }

    fn delta_rows(
        &self,
        key: &str,
        dev: &Device,
        factor: f32,
        rows: (usize, usize),
    ) -> Result<Option<Tensor>> {
        lokr_delta_rows(key, self, dev, factor, rows).map(Some)
    }

    fn dora_scale(&self) -> Option<&Tensor> {
        self.dora_scale.as_ref()
    }

    fn parts(&self) -> super::Parts<'_> {
        let named = [
            ("lokr_w1", &self.w1),
            ("lokr_w1_a", &self.w1a),
            ("lokr_w1_b", &self.w1b),
            ("lokr_w2", &self.w2),
            ("lokr_w2_a", &self.w2a),
            ("lokr_w2_b", &self.w2b),
            ("lokr_t2", &self.t2),
            ("dora_scale", &self.dora_scale),
        ];
        let t = named
            .into_iter()
            .filter_map(|(n, t)| t.as_ref().map(|t| (n, t)))
            .collect();
        (t, self.alpha)
    }
}

fn lokr_delta(key: &str, k: &LoKr, dev: &Device, factor: f32) -> Result<Tensor> {
    let ctx = || format!("`{key}`: computing the LoKr delta");
    let (w1, w2, f) = lokr_scaled(key, k, factor)?;
    let w1 = w1.value(key, dev, f, "lokr w1")?;
    let w2 = w2.value(key, dev, 1.0, "lokr w2")?;
    kron(&w1, &w2).ctx(ctx)
}

/// Rows `first..first + n` of the delta, flattened: row `i · m2 + j` of `kron(w1, w2)` (`m2`
/// rows in `w2`) is `kron` of row `i` of `w1` with row `j` of `w2`, so each run of rows sharing
/// an `i` is the Kronecker product of one row of `w1` with rows of `w2`, the same products as in
/// the whole delta. `w1` (the small factor) is built whole, `w2` only in the rows needed.
fn lokr_delta_rows(
    key: &str,
    k: &LoKr,
    dev: &Device,
    factor: f32,
    (first, n): (usize, usize),
) -> Result<Tensor> {
    let ctx = || format!("`{key}`: computing rows of the LoKr delta");
    let (w1, w2, f) = lokr_scaled(key, k, factor)?;
    let w1 = w1.value(key, dev, f, "lokr w1")?;
    let m2 = w2.out_rows().max(1);
    let mut pieces = Vec::new();
    let mut row = first;
    while row < first + n {
        let (i, j) = (row / m2, row % m2);
        let take = (m2 - j).min(first + n - row);
        let w2_rows = w2.rows(key, dev, 1.0, "lokr w2", Some((j, take)))?;
        let piece = w1
            .narrow(0, i, 1)
            .and_then(|w1_row| kron(&w1_row, &w2_rows))
            .and_then(|p| p.flatten_from(1))
            .ctx(ctx)?;
        pieces.push(piece);
        row += take;
    }
    Tensor::cat(&pieces, 0).ctx(ctx)
}

/// The two factors and the scale folded into `w1`: `factor`, times `alpha / rank` when a factor
/// is factorised.
fn lokr_scaled<'a>(key: &str, k: &'a LoKr, factor: f32) -> Result<(Factor<'a>, Factor<'a>, f32)> {
    let (w1, w2, rank) = lokr_parts(key, k)?;
    let f = factor
        * match rank {
            Some(r) => alpha_scale(k.alpha, r),
            None => 1.0,
        };
    Ok((w1, w2, f))
}

/// The two LoKr factors and the rank used for alpha scaling: `w2`'s when it is factorised, else
/// `w1`'s (`None` when both are whole).
fn lokr_parts<'a>(key: &str, k: &'a LoKr) -> Result<(Factor<'a>, Factor<'a>, Option<usize>)> {
    let w1 = lokr_factor(&k.w1, &k.w1a, &k.w1b, None)
        .ok_or_else(|| bad(key, "LoKr needs lokr_w1 or both lokr_w1_a and lokr_w1_b"))?;
    let w2 = lokr_factor(&k.w2, &k.w2a, &k.w2b, k.t2.as_ref())
        .ok_or_else(|| bad(key, "LoKr needs lokr_w2 or both lokr_w2_a and lokr_w2_b"))?;
    let rank = match w2 {
        Factor::Whole(_) => w1.rank(),
        _ => w2.rank(),
    };
    Ok((w1, w2, rank))
}

/// One LoKr factor: stored whole, or as `a · b` (the Tucker product with a core `t`); `None` when
/// neither is complete.
fn lokr_factor<'a>(
    whole: &'a Option<Tensor>,
    a: &'a Option<Tensor>,
    b: &'a Option<Tensor>,
    t: Option<&'a Tensor>,
) -> Option<Factor<'a>> {
    match (whole, a, b) {
        (Some(w), _, _) => Some(Factor::Whole(w)),
        (None, Some(a), Some(b)) => Some(Factor::of(a, b, t)),
        _ => None,
    }
}

/// Kronecker product; the lower-rank operand gets trailing 1-dims.
fn kron(a: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    let n = a.rank().max(b.rank());
    let pad = |d: &[usize]| {
        let mut d = d.to_vec();
        d.resize(n, 1);
        d
    };
    let (ad, bd) = (pad(a.dims()), pad(b.dims()));
    let mut a_shape = Vec::with_capacity(2 * n);
    let mut b_shape = Vec::with_capacity(2 * n);
    for i in 0..n {
        a_shape.extend([ad[i], 1]);
        b_shape.extend([1, bd[i]]);
    }
    let out: Vec<usize> = (0..n).map(|i| ad[i].saturating_mul(bd[i])).collect();
    a.reshape(a_shape)?
        .broadcast_mul(&b.reshape(b_shape)?)?
        .reshape(out)
}
