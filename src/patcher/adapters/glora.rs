//! GLoRA (LyCORIS "generalised LoRA"): the [`GLora`] adapter, whose delta also depends on the
//! weight, its two layouts, its shape rule and its delta.

use candle_core::Tensor;

use super::{alpha_scale, bad, f32_on, numel, scale, shape_err, DeltaAdapter};
use crate::error::{Result, TensorContext};

/// A GLoRA adapter (LyCORIS "generalised LoRA"): `delta = W·A + B` with `A = a1·a2` (new
/// layout) and `B = b1·b2`, scaled by `alpha / rank`. The two layouts and how conv weights are
/// handled are below.
///
/// # Math
///
/// GLoRA computes `f(x) = W·x + W·A·x + B·x`: `w += s · (alpha / rank) · Δ` with
/// the current (accumulated, `strength_model`-scaled) weight `w` inside `Δ`. Two layouts,
/// told apart by the parts' first two dimensions as ComfyUI does:
/// - new (LyCORIS ≥ 2; `a1 [in, r]`, `a2 [r, in]`, `b1 [out, r]`, `b2 [r, in…]`, conv parts
///   with trailing `1, 1` except `b2 [r, in, kh, kw]`; rank `a2[0]`):
///   `Δ[o, j, sp…] = Σ_i (w[o, i, sp…] · (a1·a2)[i, j]) + (b1·b2)[o, j, sp…]` — for a conv the
///   input channels are mixed at every kernel position, the weight is *not* flattened;
/// - old (early LyCORIS; `a1 [r, in]`, `a2 [in, r]`, `b1 [r, in]`, `b2 [out, r]`; rank
///   `a1[0]`): `Δ = w_flat·a2·a1 + b2·b1` with `w_flat` the weight as `[out, in·kh·kw]`.
///
/// Old when `a1[0] = a2[1] = b1[0] = b2[1]`, new when `a1[1] = a2[0] = b1[1] = b2[0]`; when
/// both hold, old only if `a2[0]` is the weight's output dimension and the weight is square.
/// Verified against LyCORIS `modules/glora.py` (`make_weight`) and ComfyUI
/// `comfy/weight_adapter/glora.py` (`calculate_weight`). A Tucker GLoRA (`bm`) is not
/// supported.
#[derive(Debug, Clone)]
pub struct GLora {
    /// New layout: `[in, r]` (or `[in, r, 1, 1]`). Old layout: `[r, in]`.
    pub a1: Tensor,
    /// New layout: `[r, in]` (or `[r, in, 1, 1]`). Old layout: `[in, r]`.
    pub a2: Tensor,
    /// New layout: `[out, r]` (or `[out, r, 1, 1]`). Old layout: `[r, in…]`.
    pub b1: Tensor,
    /// New layout: `[r, in…]` (a conv's `[r, in, kh, kw]`). Old layout: `[out, r]`.
    pub b2: Tensor,
    /// The delta is scaled by `alpha / rank`; by 1 when absent.
    pub alpha: Option<f32>,
    /// DoRA magnitude.
    pub dora_scale: Option<Tensor>,
}

impl GLora {
    /// A GLoRA without alpha (scale 1) or DoRA.
    pub fn new(a1: Tensor, a2: Tensor, b1: Tensor, b2: Tensor) -> Self {
        GLora {
            a1,
            a2,
            b1,
            b2,
            alpha: None,
            dora_scale: None,
        }
    }
}

impl DeltaAdapter for GLora {
    const KIND: &'static str = "glora";

    fn delta_shape(&self, key: &str, target: &[usize]) -> Result<Vec<usize>> {
        glora_check(key, target, self)
    }

    fn delta(&self, key: &str, w: &Tensor, factor: f32) -> Result<Tensor> {
        glora_delta(key, self, w, factor)
    }

    fn dora_scale(&self) -> Option<&Tensor> {
        self.dora_scale.as_ref()
    }

    fn parts(&self) -> super::Parts<'_> {
        let mut t = vec![
            ("a1", &self.a1),
            ("a2", &self.a2),
            ("b1", &self.b1),
            ("b2", &self.b2),
        ];
        t.extend(self.dora_scale.iter().map(|d| ("dora_scale", d)));
        (t, self.alpha)
    }
}

/// The two GLoRA layouts: LyCORIS's current one and the one of its early releases.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GloraLayout {
    /// `delta = W_flat·a2·a1 + b2·b1` (early LyCORIS).
    Old,
    /// `delta = W·a1·a2 + b1·b2` (LyCORIS ≥ 2, the input dimension contracted per kernel
    /// position).
    New,
}

/// Tells the layouts apart by the parts' first two dimensions, as ComfyUI does, and returns the
/// rank: old when `a1[0] = a2[1] = b1[0] = b2[1]` (rank `a1[0]`), new when
/// `a1[1] = a2[0] = b1[1] = b2[0]` (rank `a2[0]`). When both hold, old wins only if
/// `a2[0]` equals the weight's output dimension and the weight is square (`W[0] = W[1]`).
fn glora_layout(key: &str, g: &GLora, weight: &[usize]) -> Result<(GloraLayout, usize)> {
    let (a1, a2, b1, b2) = (g.a1.dims(), g.a2.dims(), g.b1.dims(), g.b2.dims());
    if [a1, a2, b1, b2].iter().any(|d| d.len() < 2) {
        return Err(bad(
            key,
            format!(
                "GLoRA parts need at least 2 dimensions: a1 {a1:?}, a2 {a2:?}, b1 {b1:?}, b2 {b2:?}"
            ),
        ));
    }
    let old = b2[1] == b1[0] && b1[0] == a1[0] && a1[0] == a2[1];
    let new = b2[0] == b1[1] && b1[1] == a1[1] && a1[1] == a2[0];
    let square_old = old && weight.len() >= 2 && a2[0] == weight[0] && weight[0] == weight[1];
    let (layout, rank) = if new && !square_old {
        (GloraLayout::New, a2[0])
    } else if old {
        (GloraLayout::Old, a1[0])
    } else {
        return Err(bad(
            key,
            format!(
                "GLoRA ranks do not chain in either layout: a1 {a1:?}, a2 {a2:?}, b1 {b1:?}, \
                 b2 {b2:?} (new: a1 [in, r], a2 [r, in], b1 [out, r], b2 [r, in…]; \
                 old: a1 [r, in], a2 [in, r], b1 [r, in], b2 [out, r])"
            ),
        ));
    };
    if rank == 0 {
        return Err(bad(key, "GLoRA rank is 0"));
    }
    Ok((layout, rank))
}

/// Checks a GLoRA's parts against the target shape (flattened as the math flattens them) and
/// returns the shape of its delta.
fn glora_check(key: &str, target: &[usize], g: &GLora) -> Result<Vec<usize>> {
    let (layout, _) = glora_layout(key, g, target)?;
    let flat = |d: &[usize]| [d[0], numel(&d[1..])];
    let (a1, a2) = (flat(g.a1.dims()), flat(g.a2.dims()));
    let (b1, b2) = (flat(g.b1.dims()), flat(g.b2.dims()));
    if target.len() < 2 {
        return Err(shape_err(
            key,
            target,
            &[a1[0], a2[1]],
            "GLoRA needs a weight with an input dimension (at least 2 dimensions)",
        ));
    }
    let (out, inn) = (target[0], target[1]);
    let chains = match layout {
        GloraLayout::New => a1[1] == a2[0] && b1[1] == b2[0],
        GloraLayout::Old => a2[1] == a1[0] && b2[1] == b1[0],
    };
    if !chains {
        return Err(bad(
            key,
            format!("GLoRA ranks do not chain once flattened: a1 {a1:?}, a2 {a2:?}, b1 {b1:?}, b2 {b2:?}"),
        ));
    }
    match layout {
        GloraLayout::New => {
            if a1[0] != inn || a2[1] != inn {
                return Err(shape_err(
                    key,
                    target,
                    &[a1[0], a2[1]],
                    "GLoRA's a1·a2 must be [in, in] for the weight's input dimension",
                ));
            }
            Ok(vec![b1[0], b2[1]])
        }
        GloraLayout::Old => {
            let cols = numel(&target[1..]);
            if a2[0] != cols || a1[1] != cols {
                return Err(shape_err(
                    key,
                    target,
                    &[a2[0], a1[1]],
                    "old-layout GLoRA's a2·a1 must be [in…, in…] for the flattened weight",
                ));
            }
            if b2[0] != out || b1[1] != cols {
                return Err(shape_err(
                    key,
                    target,
                    &[b2[0], b1[1]],
                    "old-layout GLoRA's b2·b1 must be [out, in…] for the flattened weight",
                ));
            }
            Ok(target.to_vec())
        }
    }
}

fn glora_delta(key: &str, g: &GLora, w: &Tensor, factor: f32) -> Result<Tensor> {
    let ctx = || format!("`{key}`: computing the GLoRA delta");
    let (layout, rank) = glora_layout(key, g, w.dims())?;
    let dev = w.device();
    let flat = |t: &Tensor, what: &str| -> Result<Tensor> {
        f32_on(key, t, dev, what)?.flatten_from(1).ctx(ctx)
    };
    let (a1, a2) = (flat(&g.a1, "glora a1")?, flat(&g.a2, "glora a2")?);
    let (b1, b2) = (flat(&g.b1, "glora b1")?, flat(&g.b2, "glora b2")?);
    let f = factor * alpha_scale(g.alpha, rank);
    let delta = match layout {
        GloraLayout::Old => {
            // W_flat·a2·a1 + b2·b1
            let wa = w
                .flatten_from(1)
                .and_then(|t| t.matmul(&a2))
                .and_then(|t| t.matmul(&a1))
                .ctx(ctx)?;
            let b = b2.matmul(&b1).ctx(ctx)?;
            (wa + b).and_then(|t| t.reshape(w.shape())).ctx(ctx)?
        }
        GloraLayout::New => {
            // Σ_i W[o, i, sp…]·(a1·a2)[i, j], the input dimension contracted at every kernel
            // position, then + b1·b2.
            let (out, inn) = (w.dim(0).ctx(ctx)?, w.dim(1).ctx(ctx)?);
            let spatial: usize = w.dims()[2..].iter().product();
            let mut perm: Vec<usize> = vec![0];
            perm.extend(2..w.rank());
            perm.push(1);
            let w_rows = if spatial == 1 {
                w.reshape((out, inn)).ctx(ctx)?
            } else {
                w.permute(perm)
                    .and_then(|t| t.contiguous())
                    .and_then(|t| t.reshape((out * spatial, inn)))
                    .ctx(ctx)?
            };
            let wa = w_rows.matmul(&a1).and_then(|t| t.matmul(&a2)).ctx(ctx)?;
            let wa = if spatial == 1 {
                wa.reshape(w.shape()).ctx(ctx)?
            } else {
                wa.reshape((out, spatial, inn))
                    .and_then(|t| t.transpose(1, 2))
                    .and_then(|t| t.contiguous())
                    .and_then(|t| t.reshape(w.shape()))
                    .ctx(ctx)?
            };
            let b = b1.matmul(&b2).and_then(|t| t.reshape(w.shape())).ctx(ctx)?;
            (wa + b).ctx(ctx)?
        }
    };
    scale(key, &delta, f)
}
