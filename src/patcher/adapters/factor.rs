//! One factor of a LoHa or LoKr delta: stored whole, as a product `a · b`, or as a Tucker product
//! `t ×₁ a ×₂ b`; its shape (from dimensions alone) and its value. LoHa multiplies two factors
//! elementwise, LoKr takes their Kronecker product; both build each factor here.

use candle_core::{Device, Tensor};

use super::{bad, f32_on, numel, scale};
use crate::error::{Result, TensorContext};

/// A factor of a LoHa or LoKr delta.
pub(super) enum Factor<'a> {
    /// Stored whole (LoKr's `w1` or `w2`).
    Whole(&'a Tensor),
    /// `a · b`, flattened to 2-D.
    Product(&'a Tensor, &'a Tensor),
    /// The Tucker product of a core `t` with `a` and `b`.
    Tucker(&'a Tensor, &'a Tensor, &'a Tensor),
}

impl<'a> Factor<'a> {
    /// `a · b`, or the Tucker product when there is a core `t`.
    pub(super) fn of(a: &'a Tensor, b: &'a Tensor, t: Option<&'a Tensor>) -> Self {
        match t {
            Some(t) => Factor::Tucker(t, a, b),
            None => Factor::Product(a, b),
        }
    }

    /// The rank of a factorised factor (the rows of `b`); `None` for a whole one.
    pub(super) fn rank(&self) -> Option<usize> {
        match self {
            Factor::Whole(_) => None,
            Factor::Product(_, b) | Factor::Tucker(_, _, b) => b.dims().first().copied(),
        }
    }

    /// The factor's shape, or why its parts do not chain (`what` names the factor).
    pub(super) fn shape(&self, key: &str, what: &str) -> Result<Vec<usize>> {
        match self {
            Factor::Whole(w) => Ok(w.dims().to_vec()),
            Factor::Product(a, b) => factor_shape(key, a, b, None, what),
            Factor::Tucker(t, a, b) => factor_shape(key, a, b, Some(t), what),
        }
    }

    /// The factor in f32 on `dev`, scaled by `factor` (folded into `a`); `what` names a whole
    /// factor in messages.
    pub(super) fn value(&self, key: &str, dev: &Device, factor: f32, what: &str) -> Result<Tensor> {
        self.rows(key, dev, factor, what, None)
    }

    /// [`Factor::value`], or only its rows `first..first + n` (along dimension 0, the output
    /// dimension): the same products, for those rows alone.
    pub(super) fn rows(
        &self,
        key: &str,
        dev: &Device,
        factor: f32,
        what: &str,
        rows: Option<(usize, usize)>,
    ) -> Result<Tensor> {
        match self {
            Factor::Whole(w) => {
                let w = match rows {
                    Some((first, n)) => w
                        .narrow(0, first, n)
                        .ctx(|| format!("`{key}`: rows of the {what}"))?,
                    None => (*w).clone(),
                };
                scale(key, &f32_on(key, &w, dev, what)?, factor)
            }
            Factor::Product(a, b) => factor_product(key, a, b, None, dev, factor, rows),
            Factor::Tucker(t, a, b) => factor_product(key, a, b, Some(t), dev, factor, rows),
        }
    }

    /// The rows of the factor's value (its dimension 0).
    pub(super) fn out_rows(&self) -> usize {
        match self {
            Factor::Whole(w) => w.dims().first().copied().unwrap_or(1),
            Factor::Product(a, _) => a.dims().first().copied().unwrap_or(1),
            Factor::Tucker(_, a, _) => a.dims().get(1).copied().unwrap_or(1),
        }
    }
}

/// The shape of `a · b` (flattened) or of the Tucker product with `t`.
fn factor_shape(
    key: &str,
    a: &Tensor,
    b: &Tensor,
    t: Option<&Tensor>,
    what: &str,
) -> Result<Vec<usize>> {
    let (ad, bd) = (a.dims(), b.dims());
    match t {
        None => {
            if ad.len() < 2 || bd.len() < 2 || numel(&ad[1..]) != bd[0] {
                return Err(bad(
                    key,
                    format!("{what}: factors {ad:?} and {bd:?} do not chain"),
                ));
            }
            Ok(vec![ad[0], numel(&bd[1..])])
        }
        Some(t) => {
            let td = t.dims();
            if ad.len() != 2 || bd.len() != 2 || td.len() < 2 || td[0] != ad[0] || td[1] != bd[0] {
                return Err(bad(
                    key,
                    format!(
                        "{what}: Tucker parts do not chain: core {td:?}, a {ad:?}, b {bd:?} \
                         (expected core [i, j, kh, kw], a [i, out], b [j, in])"
                    ),
                ));
            }
            let mut s = vec![ad[1], bd[1]];
            s.extend(&td[2..]);
            Ok(s)
        }
    }
}

/// A factor `a · b` (flattened to 2-D, `factor` folded into `a`), or the Tucker form with `t`;
/// with `rows`, only those output rows (rows of `a`, or columns of a Tucker `a`).
fn factor_product(
    key: &str,
    a: &Tensor,
    b: &Tensor,
    t: Option<&Tensor>,
    dev: &Device,
    factor: f32,
    rows: Option<(usize, usize)>,
) -> Result<Tensor> {
    let ctx = || format!("`{key}`: computing a factor product");
    let out_dim = if t.is_some() { 1 } else { 0 };
    let a = match rows {
        Some((first, n)) => a.narrow(out_dim, first, n).ctx(ctx)?,
        None => a.clone(),
    };
    let a = scale(key, &f32_on(key, &a, dev, "factor")?, factor)?;
    let b = f32_on(key, b, dev, "factor")?;
    match t {
        Some(t) => tucker(key, &f32_on(key, t, dev, "tucker core")?, &a, &b),
        None => a
            .flatten_from(1)
            .and_then(|a| a.matmul(&b.flatten_from(1)?))
            .ctx(ctx),
    }
}

/// `Σ_{i,j} t[i, j, sp] · b[j, q] · a[i, p]` → `[p, q, sp…]`.
fn tucker(key: &str, t: &Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let ctx = || format!("`{key}`: computing a Tucker product");
    let (i, j) = (t.dim(0).ctx(ctx)?, t.dim(1).ctx(ctx)?);
    let sp_dims = t.dims()[2..].to_vec();
    let spatial: usize = sp_dims.iter().product();
    let (p, q) = (a.dim(1).ctx(ctx)?, b.dim(1).ctx(ctx)?);
    let mut perm: Vec<usize> = vec![0];
    perm.extend(2..t.rank());
    perm.push(1);
    let tb = t
        .permute(perm)
        .and_then(|x| x.contiguous())
        .and_then(|x| x.reshape((i * spatial, j)))
        .and_then(|x| x.matmul(b))
        .and_then(|x| x.reshape((i, spatial * q)))
        .ctx(ctx)?;
    let mut out_shape = vec![p, q];
    out_shape.extend(&sp_dims);
    a.t()
        .and_then(|x| x.contiguous())
        .and_then(|x| x.matmul(&tb))
        .and_then(|x| x.reshape((p, spatial, q)))
        .and_then(|x| x.transpose(1, 2))
        .and_then(|x| x.contiguous())
        .and_then(|x| x.reshape(out_shape))
        .ctx(ctx)
}
