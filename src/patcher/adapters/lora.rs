//! LoRA (and LoCon, the Tucker form with a `mid` core): the [`Lora`] adapter, its shape rule and
//! its delta `up · down`.

use candle_core::{Device, Tensor};

use super::low_rank::{self, LowRank};
use super::{alpha_scale, bad, f32_on, numel, scale, DeltaAdapter};
use crate::error::{Result, TensorContext};

/// A LoRA adapter: `delta = up · down` (through `mid` for the Tucker/LoCon form).
///
/// # Math
///
/// `w += s · (alpha / rank) · up·down`, `rank = down.dims()[0]`, the factor being 1
/// when there is no alpha. `up` is flattened to `[out, r]` (a conv up `[out, r, 1, 1]` is
/// fine) and `down` to `[r, in·kh·kw]`; the product (one `[out, r] × [r, in·kh·kw]` matmul,
/// the scale folded into `up`) is reshaped to the weight's shape. With `mid`
/// (LoCon/Tucker: down `[b, in, 1, 1]`, mid `[a, b, kh, kw]`, up `[out, a, 1, 1]`) the delta
/// is `Δ[o, i, h, w] = Σ_{a,b} up[o, a] · mid[a, b, h, w] · down[b, i]`, which is the weight of
/// the composed convolutions `up ∘ mid ∘ down`; it is computed as `mid ⊗ down` first (a
/// small `[a·kh·kw, b] × [b, in]` matmul), then one matmul with `up`.
#[derive(Debug, Clone)]
pub struct Lora {
    /// `[out, r]` or `[out, r, 1, 1]`.
    pub up: Tensor,
    /// `[r, in]` or `[r, in, kh, kw]` (or `[r, in, 1, 1]` with `mid`).
    pub down: Tensor,
    /// The delta is scaled by `alpha / r`; by 1 when absent.
    pub alpha: Option<f32>,
    /// Tucker core `[a, b, kh, kw]` between `up` (`a` columns) and `down` (`b` rows).
    pub mid: Option<Tensor>,
    /// DoRA magnitude, `[out, 1, …]` (or `[1, in, …]`).
    pub dora_scale: Option<Tensor>,
}

impl Lora {
    /// A plain LoRA: no alpha (scale 1), no mid, no DoRA.
    pub fn new(up: Tensor, down: Tensor) -> Self {
        Lora {
            up,
            down,
            alpha: None,
            mid: None,
            dora_scale: None,
        }
    }
}

impl DeltaAdapter for Lora {
    const KIND: &'static str = "lora";

    fn delta_shape(&self, key: &str, _target: &[usize]) -> Result<Vec<usize>> {
        lora_shape(key, self)
    }

    fn delta(&self, key: &str, w: &Tensor, factor: f32) -> Result<Tensor> {
        lora_delta(key, self, w.device(), factor, None)
    }

    fn delta_rows(
        &self,
        key: &str,
        dev: &Device,
        factor: f32,
        rows: (usize, usize),
    ) -> Result<Option<Tensor>> {
        lora_delta(key, self, dev, factor, Some(rows)).map(Some)
    }

    /// `up` (scaled) and `down` (through `mid` for LoCon) on the host, when the kernel
    /// [`takes`](low_rank::takes) their inner dimension: the same factors
    /// [`DeltaAdapter::delta`] multiplies.
    fn low_rank(&self, key: &str, factor: f32) -> Result<Option<LowRank>> {
        let (up, down) = lora_factors(key, self, &Device::Cpu, factor)?;
        let rank = down.dim(0).ctx(|| format!("`{key}`: the LoRA rank"))?;
        if !low_rank::takes(rank) {
            return Ok(None);
        }
        let ctx = || format!("`{key}`: reading the LoRA factors");
        let values = |t: Tensor| t.flatten_all().and_then(|t| t.to_vec1::<f32>());
        let coef = values(up).ctx(ctx)?;
        let down = values(down).ctx(ctx)?;
        Ok(LowRank::new(coef, &down, rank))
    }

    fn dora_scale(&self) -> Option<&Tensor> {
        self.dora_scale.as_ref()
    }

    fn parts(&self) -> super::Parts<'_> {
        let mut t = vec![("up", &self.up), ("down", &self.down)];
        t.extend(self.mid.iter().map(|m| ("mid", m)));
        t.extend(self.dora_scale.iter().map(|d| ("dora_scale", d)));
        (t, self.alpha)
    }
}

fn lora_shape(key: &str, l: &Lora) -> Result<Vec<usize>> {
    let (up, down) = (l.up.dims(), l.down.dims());
    if up.len() < 2 || down.len() < 2 {
        return Err(bad(
            key,
            format!("LoRA up {up:?} and down {down:?} need at least 2 dimensions"),
        ));
    }
    if down[0] == 0 {
        return Err(bad(key, "LoRA rank is 0"));
    }
    let r_up = numel(&up[1..]);
    match &l.mid {
        None => {
            if r_up != down[0] {
                return Err(bad(
                    key,
                    format!("LoRA ranks do not chain: up {up:?}, down {down:?}"),
                ));
            }
            let mut s = vec![up[0]];
            s.extend(&down[1..]);
            Ok(s)
        }
        Some(mid) => {
            let m = mid.dims();
            if m.len() < 2 || r_up != m[0] || m[1] != down[0] || numel(&down[2..]) != 1 {
                return Err(bad(
                    key,
                    format!(
                        "LoRA Tucker parts do not chain: up {up:?}, mid {m:?}, down {down:?} \
                         (expected up [out, a(,1,1)], mid [a, b, kh, kw], down [b, in(,1,1)])"
                    ),
                ));
            }
            let mut s = vec![up[0], down[1]];
            s.extend(&m[2..]);
            Ok(s)
        }
    }
}

/// The delta, or its rows `first..first + n` (of `up`'s rows: the same dot products).
fn lora_delta(
    key: &str,
    l: &Lora,
    dev: &Device,
    factor: f32,
    rows: Option<(usize, usize)>,
) -> Result<Tensor> {
    let ctx = || format!("`{key}`: computing the LoRA delta");
    let (up, down) = lora_factors(key, l, dev, factor)?;
    let up = match rows {
        Some((first, n)) => up.narrow(0, first, n).ctx(ctx)?,
        None => up,
    };
    up.matmul(&down).ctx(ctx)
}

/// The delta's two factors in f32 on `dev`: `up` flattened to `[out, r]` and scaled by `factor`
/// and `alpha / rank`, `down` flattened to `[r, rest]` (with `mid`, the composed `mid ⊗ down`, `r`
/// being `mid`'s rows). The delta is their product.
fn lora_factors(key: &str, l: &Lora, dev: &Device, factor: f32) -> Result<(Tensor, Tensor)> {
    let ctx = || format!("`{key}`: computing the LoRA delta");
    let rank = l.down.dim(0).ctx(ctx)?;
    let up = f32_on(key, &l.up, dev, "lora up")?
        .flatten_from(1)
        .ctx(ctx)?;
    let down = f32_on(key, &l.down, dev, "lora down")?;
    let down = match &l.mid {
        None => down.flatten_from(1).ctx(ctx)?,
        Some(mid) => {
            let mid = f32_on(key, mid, dev, "lora mid")?;
            // new_down[a, i, sp] = Σ_b mid[a, b, sp] · down[b, i]
            let (a, b) = (mid.dim(0).ctx(ctx)?, mid.dim(1).ctx(ctx)?);
            let spatial: usize = mid.dims()[2..].iter().product();
            let mut perm: Vec<usize> = vec![0];
            perm.extend(2..mid.rank());
            perm.push(1);
            let down2 = down.flatten_from(1).ctx(ctx)?;
            let inn = down2.dim(1).ctx(ctx)?;
            mid.permute(perm)
                .and_then(|t| t.contiguous())
                .and_then(|t| t.reshape((a * spatial, b)))
                .and_then(|t| t.matmul(&down2))
                .and_then(|t| t.reshape((a, spatial, inn)))
                .and_then(|t| t.transpose(1, 2))
                .and_then(|t| t.contiguous())
                .and_then(|t| t.reshape((a, inn * spatial)))
                .ctx(ctx)?
        }
    };
    let up = scale(key, &up, factor * alpha_scale(l.alpha, rank))?;
    Ok((up, down))
}
