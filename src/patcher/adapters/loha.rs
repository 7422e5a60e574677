//! LoHa: the [`LoHa`] adapter, the Hadamard product of two low-rank factors, its shape rule and
//! its delta.

use candle_core::{Device, Tensor};

use super::factor::Factor;
use super::{alpha_scale, bad, numel, DeltaAdapter};
use crate::error::{Result, TensorContext};

/// A LoHa adapter: `delta = (w1a · w1b) ⊙ (w2a · w2b)`.
///
/// # Math
///
/// `w += s · (alpha / rank) · (w1a·w1b) ⊙ (w2a·w2b)`, `rank = w1b.dims()[0]`. With
/// Tucker cores (`t1`, `t2`, shaped `[r, r, kh, kw]`) the factors are stored transposed
/// (`w1a [r, out]`, `w1b [r, in]`) and each product is
/// `m[p, q, h, w] = Σ_{i,j} t[i, j, h, w] · w1b[j, q] · w1a[i, p]`.
#[derive(Debug, Clone)]
pub struct LoHa {
    /// First factor, left: `[out, r]` (`[r, out]` with `t1`).
    pub w1a: Tensor,
    /// First factor, right: `[r, in…]`.
    pub w1b: Tensor,
    /// Second factor, left.
    pub w2a: Tensor,
    /// Second factor, right.
    pub w2b: Tensor,
    /// Tucker core of the first factor, `[r, r, kh, kw]`.
    pub t1: Option<Tensor>,
    /// Tucker core of the second factor.
    pub t2: Option<Tensor>,
    /// The delta is scaled by `alpha / w1b.dims()[0]`; by 1 when absent.
    pub alpha: Option<f32>,
    /// DoRA magnitude.
    pub dora_scale: Option<Tensor>,
}

impl LoHa {
    /// The two factors, each `a · b` or, with a Tucker core, the Tucker product.
    fn factors(&self) -> [Factor<'_>; 2] {
        [
            Factor::of(&self.w1a, &self.w1b, self.t1.as_ref()),
            Factor::of(&self.w2a, &self.w2b, self.t2.as_ref()),
        ]
    }
}

impl DeltaAdapter for LoHa {
    const KIND: &'static str = "loha";

    fn delta_shape(&self, key: &str, _target: &[usize]) -> Result<Vec<usize>> {
        let [w1, w2] = self.factors();
        let m1 = w1.shape(key, "hada_w1")?;
        let m2 = w2.shape(key, "hada_w2")?;
        if m1[0] != m2[0] || numel(&m1) != numel(&m2) {
            return Err(bad(
                key,
                format!("LoHa factors disagree: w1 gives {m1:?}, w2 gives {m2:?}"),
            ));
        }
        if self.w1b.dim(0).unwrap_or(0) == 0 {
            return Err(bad(key, "LoHa rank is 0"));
        }
        Ok(m1)
    }

    fn delta(&self, key: &str, w: &Tensor, factor: f32) -> Result<Tensor> {
        loha_delta(key, self, w.device(), factor, None)
    }

    fn delta_rows(
        &self,
        key: &str,
        dev: &Device,
        factor: f32,
        rows: (usize, usize),
    ) -> Result<Option<Tensor>> {
        loha_delta(key, self, dev, factor, Some(rows)).map(Some)
    }

    fn dora_scale(&self) -> Option<&Tensor> {
        self.dora_scale.as_ref()
    }

    fn parts(&self) -> super::Parts<'_> {
        let mut t = vec![
            ("hada_w1_a", &self.w1a),
            ("hada_w1_b", &self.w1b),
            ("hada_w2_a", &self.w2a),
            ("hada_w2_b", &self.w2b),
        ];
        t.extend(self.t1.iter().map(|x| ("hada_t1", x)));
        t.extend(self.t2.iter().map(|x| ("hada_t2", x)));
        t.extend(self.dora_scale.iter().map(|d| ("dora_scale", d)));
        (t, self.alpha)
    }
}

/// The delta, or its rows `first..first + n` (the same rows of both factors).
fn loha_delta(
    key: &str,
    h: &LoHa,
    dev: &Device,
    factor: f32,
    rows: Option<(usize, usize)>,
) -> Result<Tensor> {
    let ctx = || format!("`{key}`: computing the LoHa delta");
    let rank = h.w1b.dim(0).ctx(ctx)?;
    let f = factor * alpha_scale(h.alpha, rank);
    let [w1, w2] = h.factors();
    let m1 = w1.rows(key, dev, f, "loha w1", rows)?;
    let m2 = w2.rows(key, dev, 1.0, "loha w2", rows)?;
    let m2 = m2.reshape(m1.shape()).ctx(ctx)?;
    (&m1 * &m2).ctx(ctx)
}
