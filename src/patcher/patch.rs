//! Patch kinds and their exact math.
//!
//! A [`Patch`] describes a change to one weight: a full difference ([`Patch::Diff`]), a
//! replacement ([`Patch::Set`]), or a low-rank adapter ([`Patch::Lora`], [`Patch::LoHa`],
//! [`Patch::LoKr`], [`Patch::GLora`]), each optionally with a DoRA magnitude vector, or an
//! orthogonal rotation of the output rows ([`Patch::Oft`]). A [`PatchEntry`] adds the two
//! strengths and an optional [`Offset`] that narrows the target weight. Patches never touch the
//! base weight: [`apply`] reads it and returns a new tensor.
//!
//! # Math
//!
//! [`apply`] upcasts the weight and every patch tensor to f32 and folds the entries, in order, into
//! an accumulator `w` (initially the weight). For each entry:
//!
//! 1. The target is `w`, or `w.narrow(dim, start, len)` when the entry has an [`Offset`].
//! 2. When `strength_model != 1`, the target is multiplied by it. With an offset only the narrowed
//!    region is scaled (as ComfyUI does): the rest of the weight is left as it was.
//! 3. The patch is added, with `s = strength_patch`:
//!    - `Diff`: `w += s · diff`. With `pad`, a weight smaller than the diff in some dimension is
//!      first zero-padded (at the end of each dimension) to the diff's shape; the result then has
//!      the diff's shape. Padding is not allowed on a narrowed target.
//!    - `Set`: `w = value`; neither strength has any effect.
//!    - `Lora`: `w += s · (alpha / rank) · up·down`, `rank = down.dims()[0]`, the factor being 1
//!      when there is no alpha. `up` is flattened to `[out, r]` (a conv up `[out, r, 1, 1]` is
//!      fine) and `down` to `[r, in·kh·kw]`; the product (one `[out, r] × [r, in·kh·kw]` matmul,
//!      the scale folded into `up`) is reshaped to the weight's shape. With `mid`
//!      (LoCon/Tucker: down `[b, in, 1, 1]`, mid `[a, b, kh, kw]`, up `[out, a, 1, 1]`) the delta
//!      is `Δ[o, i, h, w] = Σ_{a,b} up[o, a] · mid[a, b, h, w] · down[b, i]`, which is the weight of
//!      the composed convolutions `up ∘ mid ∘ down`; it is computed as `mid ⊗ down` first (a
//!      small `[a·kh·kw, b] × [b, in]` matmul), then one matmul with `up`.
//!    - `LoHa`: `w += s · (alpha / rank) · (w1a·w1b) ⊙ (w2a·w2b)`, `rank = w1b.dims()[0]`. With
//!      Tucker cores (`t1`, `t2`, shaped `[r, r, kh, kw]`) the factors are stored transposed
//!      (`w1a [r, out]`, `w1b [r, in]`) and each product is
//!      `m[p, q, h, w] = Σ_{i,j} t[i, j, h, w] · w1b[j, q] · w1a[i, p]`.
//!    - `LoKr`: `w += s · scale · kron(w1, w2)` where `w1` is `w1` or `w1a·w1b` and `w2` is `w2`,
//!      `w2a·w2b`, or the Tucker product of `t2`, `w2a`, `w2b` as for LoHa. `scale` is
//!      `alpha / rank` **only when a factor is stored factorised** (`rank = w2b.dims()[0]` when `w2`
//!      is factorised, else `w1b.dims()[0]`); a LoKr with both `w1` and `w2` stored whole ignores
//!      alpha (scale 1), like the LyCORIS reference. A 2-D `w1` next to a 4-D `w2` is treated as
//!      `[a, b, 1, 1]`.
//!
//!    - `GLora` (LyCORIS GLoRA, `f(x) = W·x + W·A·x + B·x`): `w += s · (alpha / rank) · Δ` with
//!      the current (accumulated, `strength_model`-scaled) weight `w` inside `Δ`. Two layouts,
//!      told apart by the parts' first two dimensions as ComfyUI does:
//!      - new (LyCORIS ≥ 2; `a1 [in, r]`, `a2 [r, in]`, `b1 [out, r]`, `b2 [r, in…]`, conv parts
//!        with trailing `1, 1` except `b2 [r, in, kh, kw]`; rank `a2[0]`):
//!        `Δ[o, j, sp…] = Σ_i (w[o, i, sp…] · (a1·a2)[i, j]) + (b1·b2)[o, j, sp…]` — for a conv the
//!        input channels are mixed at every kernel position, the weight is *not* flattened;
//!      - old (early LyCORIS; `a1 [r, in]`, `a2 [in, r]`, `b1 [r, in]`, `b2 [out, r]`; rank
//!        `a1[0]`): `Δ = w_flat·a2·a1 + b2·b1` with `w_flat` the weight as `[out, in·kh·kw]`.
//!
//!      Old when `a1[0] = a2[1] = b1[0] = b2[1]`, new when `a1[1] = a2[0] = b1[1] = b2[0]`; when
//!      both hold, old only if `a2[0]` is the weight's output dimension and the weight is square.
//!      Verified against LyCORIS `modules/glora.py` (`make_weight`) and ComfyUI
//!      `comfy/weight_adapter/glora.py` (`calculate_weight`). A Tucker GLoRA (`bm`) is not
//!      supported.
//!
//!    - `Oft` (LyCORIS diag-OFT, blocks `B [k, n, n]`, `k·n = out`): per block `Q = B − Bᵀ`;
//!      with a positive `alpha`, when `‖Q‖ + 1e-8 > alpha` (Frobenius norm over all blocks) `Q`
//!      becomes `Q · alpha / (‖Q‖ + 1e-8)`; `R = (I + Q)(I − Q)⁻¹` (Cayley transform, orthogonal).
//!      The weight, viewed as `[k, n, rest]` (output rows in consecutive groups of `n`, a conv's
//!      filters whole), is rotated as `rot[b, m, ·] = Σ_j R[b, j, m] · w[b, j, ·]` (`Rᵀ·w_b`),
//!      and `w += s² · (rot − w)`. The square is ComfyUI's (`comfy/weight_adapter/oft.py` builds
//!      `s·R − s·I` and then multiplies the result by `s` again); LyCORIS
//!      (`modules/diag_oft.py`) interpolates linearly, `(s·R + (1 − s)·I)`, and checks the norm
//!      against `alpha · out` rather than `alpha`. Both agree at `s = 1` with no active
//!      constraint. The Cayley transform is solved on the host in f64 (Gauss–Jordan; the blocks
//!      are small, `k·n³`), the rotation applied in f32. DoRA, `rescale` and 4-D butterfly
//!      blocks (BOFT) are not supported.
//!
//!    For the adapters, the delta is reshaped to the target's shape when its natural shape differs
//!    but the output dimension and the element count agree (a linear LoRA on a 1×1 conv, a conv
//!    LoHa stored as `[r, in·kh·kw]`).
//! 4. **DoRA** (a `dora_scale` is present, adapters only): with `Δ` the delta scaled by
//!    `alpha / rank` but *not* by `s`, `W' = w + Δ`, and the weight is renormalised per output row:
//!    `W'' = W' · dora_scale / (‖row‖ + ε)`, `ε = f32::EPSILON`. [`DoraNorm::Standard`] (the
//!    default, the DoRA paper's form) takes the norm of the *patched* row of `W'`;
//!    [`DoraNorm::ComfyUi`] takes the norm of the *unpatched* row of `w`, which reproduces
//!    ComfyUI's numbers. The strength then interpolates: `w = w + s · (W'' − w)`, so `s = 1` gives
//!    `W''` and `s = 0` leaves `w` unchanged. A `dora_scale` shaped `[out, 1, …]` acts on output
//!    rows; one shaped `[1, in, …]` acts on input columns (norms over every other dimension; both
//!    modes use the patched weight there, as ComfyUI does).
//! 5. The result is written back into the narrowed region when there is an offset.
//!
//! Entries with `s = 0` are skipped (except `Set`, which ignores strength, and a padding `Diff`,
//! whose padding still happens).
//!
//! # Validation
//!
//! [`validate`] checks one entry against a weight shape from the tensors' dimensions alone — no
//! delta is computed — and rejects a misfit with [`Error::PatchShape`] naming the key and both
//! shapes, or [`Error::BadPatch`] for a patch that is inconsistent in itself (ranks that do not
//! chain, an offset outside the weight). ComfyUI logs and skips such patches; we refuse them, so a
//! caller can add nothing when anything is wrong. [`patched_shape`] validates a whole chain and
//! returns the final shape (which a padding `Diff` can grow). [`apply`] validates each entry
//! before computing it.
//!
//! # Cost
//!
//! A rank-`r` LoRA on an `[out, in]` weight costs one `out·r·in` matmul plus one elementwise pass
//! (a GLoRA two, `w·a1` then `·a2`, plus `b1·b2`; an OFT one batched `[n, n] × [n, rest]`
//! matmul per block, `out·n·rest` in all, after a host Cayley transform of `k·n³`);
//! DoRA adds two elementwise passes and a row reduction. Every entry allocates a new accumulator of
//! the weight's size (candle tensors are immutable); an offset entry also re-concatenates the
//! weight along the offset's dimension.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result, TensorContext};

/// A narrowing of a target weight: the patch applies to `weight.narrow(dim, start, len)`, the
/// rest of the weight is untouched.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Offset {
    /// The dimension narrowed.
    pub dim: usize,
    /// The first index kept along `dim`.
    pub start: usize,
    /// How many indices are kept along `dim`.
    pub len: usize,
}

/// One change to one weight. See the [module docs](self) for the exact math of each kind.
#[derive(Debug, Clone)]
pub enum Patch {
    /// Adds `strength · diff` to the weight.
    Diff {
        /// The difference; same shape as the weight (or larger in some dimensions when `pad`).
        diff: Tensor,
        /// Zero-pad the weight to the diff's shape first when the diff is larger.
        pad: bool,
    },
    /// Replaces the weight with this value; strength is ignored.
    Set(Tensor),
    /// A LoRA (or LoCon, DoRA) low-rank adapter.
    Lora(Lora),
    /// A LoHa (Hadamard product of two low-rank products) adapter.
    LoHa(LoHa),
    /// A LoKr (Kronecker product) adapter.
    LoKr(LoKr),
    /// A GLoRA (generalised LoRA) adapter, whose delta also depends on the weight.
    GLora(GLora),
    /// An OFT (orthogonal fine-tuning) adapter: a block-diagonal rotation of the output rows.
    Oft(Oft),
}

impl Patch {
    /// A short name of the kind, for messages: `diff`, `set`, `lora`, `loha`, `lokr`, `glora`,
    /// `oft`.
    pub fn kind(&self) -> &'static str {
        match self {
            Patch::Diff { .. } => "diff",
            Patch::Set(_) => "set",
            Patch::Lora(_) => "lora",
            Patch::LoHa(_) => "loha",
            Patch::LoKr(_) => "lokr",
            Patch::GLora(_) => "glora",
            Patch::Oft(_) => "oft",
        }
    }
}

/// A LoRA adapter: `delta = up · down` (through `mid` for the Tucker/LoCon form).
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

/// A LoHa adapter: `delta = (w1a · w1b) ⊙ (w2a · w2b)`.
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

/// A LoKr adapter: `delta = kron(w1, w2)`, each factor stored whole or factorised.
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

/// A GLoRA adapter (LyCORIS "generalised LoRA"): `delta = W·A + B` with `A = a1·a2` (new
/// layout) and `B = b1·b2`, scaled by `alpha / rank`. See the [module docs](self) for the two
/// layouts and how conv weights are handled.
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

/// An OFT adapter (LyCORIS diag-OFT): each of `k` skew-symmetric blocks `Q = B − Bᵀ` becomes a
/// rotation `R = (I + Q)(I − Q)⁻¹` (Cayley transform), and the weight's output rows, taken `n`
/// at a time, are rotated by `Rᵀ`. See the [module docs](self) for the constraint and strength.
#[derive(Debug, Clone)]
pub struct Oft {
    /// `[k, n, n]`, `k·n` = the weight's output dimension. (4-D butterfly blocks, BOFT, are not
    /// supported.)
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

/// A patch with its strengths and target region, as a patch set stores it.
#[derive(Debug, Clone)]
pub struct PatchEntry {
    /// Multiplies the patch's delta (ignored by [`Patch::Set`]).
    pub strength_patch: f32,
    /// The patch, shared between clones of a patch set.
    pub patch: Arc<Patch>,
    /// Multiplies the weight accumulated so far (the narrowed region with an offset), before the
    /// patch is added.
    pub strength_model: f32,
    /// Narrows the target weight.
    pub offset: Option<Offset>,
}

impl PatchEntry {
    /// An entry with both strengths 1 and no offset.
    pub fn new(patch: impl Into<Arc<Patch>>) -> Self {
        PatchEntry {
            strength_patch: 1.0,
            patch: patch.into(),
            strength_model: 1.0,
            offset: None,
        }
    }

    /// Sets both strengths.
    pub fn with_strengths(mut self, strength_patch: f32, strength_model: f32) -> Self {
        self.strength_patch = strength_patch;
        self.strength_model = strength_model;
        self
    }

    /// Sets the offset.
    pub fn with_offset(mut self, offset: Offset) -> Self {
        self.offset = Some(offset);
        self
    }
}

/// Which norm DoRA divides by. See the [module docs](self).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DoraNorm {
    /// The norm of the patched weight `W + Δ` (the DoRA paper's definition).
    #[default]
    Standard,
    /// The norm of the unpatched weight `W`, which reproduces ComfyUI's results.
    ComfyUi,
}

/// Checks that `entry` fits a weight of shape `weight_shape`, from dimensions alone.
///
/// Errors: [`Error::PatchShape`] when the patch does not fit, [`Error::BadPatch`] when it is
/// inconsistent in itself or its offset lies outside the weight.
pub fn validate(key: &str, weight_shape: &[usize], entry: &PatchEntry) -> Result<()> {
    entry_output_shape(key, weight_shape, entry).map(|_| ())
}

/// Validates a chain of entries applied in order and returns the final weight shape (equal to
/// `weight_shape` unless a padding [`Patch::Diff`] grows it).
pub fn patched_shape(
    key: &str,
    weight_shape: &[usize],
    entries: &[PatchEntry],
) -> Result<Vec<usize>> {
    entries
        .iter()
        .try_fold(weight_shape.to_vec(), |shape, entry| {
            entry_output_shape(key, &shape, entry)
        })
}

/// Applies `entries` in order to `weight` and returns the patched weight in f32, on the weight's
/// device. The weight (of any float dtype) is not modified. Each entry is validated against the
/// shape accumulated so far before it is computed; on error nothing is returned.
pub fn apply(key: &str, weight: &Tensor, entries: &[PatchEntry], dora: DoraNorm) -> Result<Tensor> {
    let mut w = weight
        .to_dtype(DType::F32)
        .ctx(|| format!("`{key}`: upcasting the weight to f32"))?;
    for entry in entries {
        entry_output_shape(key, w.dims(), entry)?;
        w = apply_entry(key, &w, entry, dora)?;
    }
    Ok(w)
}

fn apply_entry(key: &str, w: &Tensor, entry: &PatchEntry, dora: DoraNorm) -> Result<Tensor> {
    let Some(o) = entry.offset else {
        return patch_region(key, w, entry, dora);
    };
    let ctx = || format!("`{key}`: writing back the region {o:?}");
    let region = w.narrow(o.dim, o.start, o.len).ctx(ctx)?;
    let patched = patch_region(key, &region, entry, dora)?;
    let total = w.dim(o.dim).ctx(ctx)?;
    let end = o.start + o.len;
    let mut parts = Vec::with_capacity(3);
    if o.start > 0 {
        parts.push(w.narrow(o.dim, 0, o.start).ctx(ctx)?);
    }
    parts.push(patched);
    if end < total {
        parts.push(w.narrow(o.dim, end, total - end).ctx(ctx)?);
    }
    Tensor::cat(&parts, o.dim).ctx(ctx)
}

/// Applies one entry to its (already narrowed) target.
fn patch_region(key: &str, target: &Tensor, entry: &PatchEntry, dora: DoraNorm) -> Result<Tensor> {
    let dev = target.device().clone();
    let s = entry.strength_patch;
    let w = if entry.strength_model != 1.0 {
        target
            .affine(f64::from(entry.strength_model), 0.0)
            .ctx(|| format!("`{key}`: scaling by strength_model"))?
    } else {
        target.clone()
    };
    match &*entry.patch {
        Patch::Set(value) => Ok(f32_on(key, value, &dev, "set value")?),
        Patch::Diff { diff, pad } => {
            let diff = f32_on(key, diff, &dev, "diff")?;
            let mut w = w;
            if *pad && diff.dims() != w.dims() {
                let have = w.dims().to_vec();
                for (i, (&d, &have)) in diff.dims().iter().zip(&have).enumerate() {
                    w = w
                        .pad_with_zeros(i, 0, d - have)
                        .ctx(|| format!("`{key}`: padding the weight to {:?}", diff.dims()))?;
                }
            }
            if s == 0.0 {
                return Ok(w);
            }
            let scaled = scale(key, &diff, s)?;
            (&w + &scaled).ctx(|| format!("`{key}`: adding the diff"))
        }
        Patch::Lora(l) => adapter(key, &w, s, l.dora_scale.as_ref(), dora, |factor| {
            lora_delta(key, l, &dev, factor)
        }),
        Patch::LoHa(h) => adapter(key, &w, s, h.dora_scale.as_ref(), dora, |factor| {
            loha_delta(key, h, &dev, factor)
        }),
        Patch::LoKr(k) => adapter(key, &w, s, k.dora_scale.as_ref(), dora, |factor| {
            lokr_delta(key, k, &dev, factor)
        }),
        Patch::GLora(g) => adapter(key, &w, s, g.dora_scale.as_ref(), dora, |factor| {
            glora_delta(key, g, &w, factor)
        }),
        Patch::Oft(o) => oft_apply(key, &w, o, s),
    }
}

/// Shared tail of the adapters: computes the delta (with `factor` folded in by `delta`), reshapes
/// it to `w`'s shape and adds it, through DoRA when a magnitude is given.
fn adapter(
    key: &str,
    w: &Tensor,
    s: f32,
    dora_scale: Option<&Tensor>,
    norm: DoraNorm,
    delta: impl FnOnce(f32) -> Result<Tensor>,
) -> Result<Tensor> {
    if s == 0.0 {
        return Ok(w.clone());
    }
    let ctx = || format!("`{key}`: adding the adapter delta");
    let Some(magnitude) = dora_scale else {
        let d = delta(s)?.reshape(w.shape()).ctx(ctx)?;
        return (w + &d).ctx(ctx);
    };
    let d = delta(1.0)?.reshape(w.shape()).ctx(ctx)?;
    let patched = (w + &d).ctx(ctx)?;
    let magnitude = f32_on(key, magnitude, w.device(), "dora_scale")?;
    let out = w.dim(0).ctx(ctx)?;
    let dora_ctx = || format!("`{key}`: DoRA renormalisation");
    let renormed = if magnitude.elem_count() == out {
        // Per output row.
        let of = match norm {
            DoraNorm::Standard => &patched,
            DoraNorm::ComfyUi => w,
        };
        let mut bshape = vec![1; w.rank()];
        bshape[0] = out;
        let row_norm = of
            .flatten_from(1)
            .and_then(|t| t.sqr())
            .and_then(|t| t.sum_keepdim(1))
            .and_then(|t| t.sqrt())
            .and_then(|t| t.affine(1.0, f64::from(f32::EPSILON)))
            .and_then(|t| t.reshape(bshape.as_slice()))
            .ctx(dora_ctx)?;
        let factor = magnitude
            .reshape(bshape.as_slice())
            .and_then(|m| m.broadcast_div(&row_norm))
            .ctx(dora_ctx)?;
        patched.broadcast_mul(&factor).ctx(dora_ctx)?
    } else {
        // Per input column (validated: dora_scale is [1, in, 1...]).
        let cols = w.dim(1).ctx(ctx)?;
        let mut bshape = vec![1; w.rank()];
        bshape[1] = cols;
        let col_norm = patched
            .transpose(0, 1)
            .and_then(|t| t.contiguous())
            .and_then(|t| t.flatten_from(1))
            .and_then(|t| t.sqr())
            .and_then(|t| t.sum_keepdim(1))
            .and_then(|t| t.sqrt())
            .and_then(|t| t.affine(1.0, f64::from(f32::EPSILON)))
            .and_then(|t| t.reshape(bshape.as_slice()))
            .ctx(dora_ctx)?;
        let factor = magnitude
            .reshape(bshape.as_slice())
            .and_then(|m| m.broadcast_div(&col_norm))
            .ctx(dora_ctx)?;
        patched.broadcast_mul(&factor).ctx(dora_ctx)?
    };
    if s == 1.0 {
        return Ok(renormed);
    }
    let step = (&renormed - w)
        .and_then(|t| t.affine(f64::from(s), 0.0))
        .ctx(dora_ctx)?;
    (w + &step).ctx(dora_ctx)
}

/// `alpha / rank`, or 1 without alpha.
fn alpha_scale(alpha: Option<f32>, rank: usize) -> f32 {
    match alpha {
        Some(a) => a / rank as f32,
        None => 1.0,
    }
}

fn lora_delta(key: &str, l: &Lora, dev: &Device, factor: f32) -> Result<Tensor> {
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
    up.matmul(&down).ctx(ctx)
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

/// A factor `a · b` (flattened to 2-D, `factor` folded into `a`), or the Tucker form with `t`.
fn factor_product(
    key: &str,
    a: &Tensor,
    b: &Tensor,
    t: Option<&Tensor>,
    dev: &Device,
    factor: f32,
) -> Result<Tensor> {
    let ctx = || format!("`{key}`: computing a factor product");
    let a = scale(key, &f32_on(key, a, dev, "factor")?, factor)?;
    let b = f32_on(key, b, dev, "factor")?;
    match t {
        Some(t) => tucker(key, &f32_on(key, t, dev, "tucker core")?, &a, &b),
        None => a
            .flatten_from(1)
            .and_then(|a| a.matmul(&b.flatten_from(1)?))
            .ctx(ctx),
    }
}

fn loha_delta(key: &str, h: &LoHa, dev: &Device, factor: f32) -> Result<Tensor> {
    let ctx = || format!("`{key}`: computing the LoHa delta");
    let rank = h.w1b.dim(0).ctx(ctx)?;
    let f = factor * alpha_scale(h.alpha, rank);
    let m1 = factor_product(key, &h.w1a, &h.w1b, h.t1.as_ref(), dev, f)?;
    let m2 = factor_product(key, &h.w2a, &h.w2b, h.t2.as_ref(), dev, 1.0)?;
    let m2 = m2.reshape(m1.shape()).ctx(ctx)?;
    (&m1 * &m2).ctx(ctx)
}

fn lokr_delta(key: &str, k: &LoKr, dev: &Device, factor: f32) -> Result<Tensor> {
    let ctx = || format!("`{key}`: computing the LoKr delta");
    let (w1, w2, rank) = lokr_parts(key, k)?;
    let f = factor
        * match rank {
            Some(r) => alpha_scale(k.alpha, r),
            None => 1.0,
        };
    let w1 = match w1 {
        Part::Whole(w) => scale(key, &f32_on(key, w, dev, "lokr w1")?, f)?,
        Part::Product(a, b) => factor_product(key, a, b, None, dev, f)?,
        Part::Tucker(t, a, b) => factor_product(key, a, b, Some(t), dev, f)?,
    };
    let w2 = match w2 {
        Part::Whole(w) => f32_on(key, w, dev, "lokr w2")?,
        Part::Product(a, b) => factor_product(key, a, b, None, dev, 1.0)?,
        Part::Tucker(t, a, b) => factor_product(key, a, b, Some(t), dev, 1.0)?,
    };
    kron(&w1, &w2).ctx(ctx)
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

/// `w + s² · (Rᵀ·w − w)` per block of `n` output rows (ComfyUI's strength; see the module docs).
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
fn cayley(key: &str, o: &Oft) -> Result<Vec<f64>> {
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
    let out: Vec<usize> = (0..n).map(|i| ad[i] * bd[i]).collect();
    a.reshape(a_shape)?
        .broadcast_mul(&b.reshape(b_shape)?)?
        .reshape(out)
}

fn scale(key: &str, t: &Tensor, factor: f32) -> Result<Tensor> {
    if factor == 1.0 {
        return Ok(t.clone());
    }
    t.affine(f64::from(factor), 0.0)
        .ctx(|| format!("`{key}`: scaling by {factor}"))
}

fn f32_on(key: &str, t: &Tensor, dev: &Device, what: &str) -> Result<Tensor> {
    t.to_device(dev)
        .and_then(|t| t.to_dtype(DType::F32))
        .ctx(|| format!("`{key}`: upcasting the {what} to f32"))
}

// ---------------------------------------------------------------------------------------------
// Shape validation (dimensions only).

fn shape_err(key: &str, weight: &[usize], patch: &[usize], reason: impl Into<String>) -> Error {
    Error::PatchShape {
        key: key.to_string(),
        weight_shape: weight.to_vec(),
        patch_shape: patch.to_vec(),
        reason: reason.into(),
    }
}

fn bad(key: &str, reason: impl Into<String>) -> Error {
    Error::BadPatch {
        key: key.to_string(),
        reason: reason.into(),
    }
}

fn entry_output_shape(key: &str, weight_shape: &[usize], entry: &PatchEntry) -> Result<Vec<usize>> {
    let Some(o) = entry.offset else {
        return patch_output_shape(key, weight_shape, &entry.patch);
    };
    if o.dim >= weight_shape.len()
        || o.len == 0
        || o.start
            .checked_add(o.len)
            .is_none_or(|end| end > weight_shape[o.dim])
    {
        return Err(bad(
            key,
            format!(
                "offset (dim {}, start {}, len {}) lies outside the weight shape {weight_shape:?}",
                o.dim, o.start, o.len
            ),
        ));
    }
    let mut target = weight_shape.to_vec();
    target[o.dim] = o.len;
    let out = patch_output_shape(key, &target, &entry.patch)?;
    if out != target {
        return Err(shape_err(
            key,
            &target,
            &out,
            "a patch on a narrowed region (offset) cannot change its shape",
        ));
    }
    Ok(weight_shape.to_vec())
}

/// The shape a patch turns `target` into, or why it cannot apply.
fn patch_output_shape(key: &str, target: &[usize], patch: &Patch) -> Result<Vec<usize>> {
    match patch {
        Patch::Set(v) => {
            if v.dims() != target {
                return Err(shape_err(
                    key,
                    target,
                    v.dims(),
                    "a set value must have the weight's shape",
                ));
            }
            Ok(target.to_vec())
        }
        Patch::Diff { diff, pad } => {
            let d = diff.dims();
            if d == target {
                return Ok(target.to_vec());
            }
            if !pad {
                return Err(shape_err(
                    key,
                    target,
                    d,
                    "a diff must have the weight's shape",
                ));
            }
            if d.len() != target.len() || d.iter().zip(target).any(|(d, t)| d < t) {
                return Err(shape_err(
                    key,
                    target,
                    d,
                    "a padding diff must have the weight's rank and be at least as large in every dimension",
                ));
            }
            Ok(d.to_vec())
        }
        Patch::Lora(l) => {
            let natural = lora_shape(key, l)?;
            check_fits(key, target, &natural)?;
            check_dora(key, target, l.dora_scale.as_ref())?;
            Ok(target.to_vec())
        }
        Patch::LoHa(h) => {
            let m1 = factor_shape(key, &h.w1a, &h.w1b, h.t1.as_ref(), "hada_w1")?;
            let m2 = factor_shape(key, &h.w2a, &h.w2b, h.t2.as_ref(), "hada_w2")?;
            if m1[0] != m2[0] || numel(&m1) != numel(&m2) {
                return Err(bad(
                    key,
                    format!("LoHa factors disagree: w1 gives {m1:?}, w2 gives {m2:?}"),
                ));
            }
            if h.w1b.dim(0).unwrap_or(0) == 0 {
                return Err(bad(key, "LoHa rank is 0"));
            }
            check_fits(key, target, &m1)?;
            check_dora(key, target, h.dora_scale.as_ref())?;
            Ok(target.to_vec())
        }
        Patch::LoKr(k) => {
            let (w1, w2, rank) = lokr_parts(key, k)?;
            if rank == Some(0) {
                return Err(bad(key, "LoKr rank is 0"));
            }
            let s1 = part_shape(key, &w1, "lokr_w1")?;
            let s2 = part_shape(key, &w2, "lokr_w2")?;
            let n = s1.len().max(s2.len());
            let natural: Vec<usize> = (0..n)
                .map(|i| s1.get(i).copied().unwrap_or(1) * s2.get(i).copied().unwrap_or(1))
                .collect();
            check_fits(key, target, &natural)?;
            check_dora(key, target, k.dora_scale.as_ref())?;
            Ok(target.to_vec())
        }
        Patch::GLora(g) => {
            glora_check(key, target, g)?;
            check_dora(key, target, g.dora_scale.as_ref())?;
            Ok(target.to_vec())
        }
        Patch::Oft(o) => {
            let d = o.blocks.dims();
            if d.len() == 4 {
                return Err(bad(
                    key,
                    format!("OFT blocks {d:?} are 4-D (BOFT, butterfly factors), which is not supported"),
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

/// Checks a GLoRA's parts against the target shape (flattened as the math flattens them).
fn glora_check(key: &str, target: &[usize], g: &GLora) -> Result<()> {
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
    match layout {
        GloraLayout::New => {
            if a1[1] != a2[0] || b1[1] != b2[0] {
                return Err(bad(
                    key,
                    format!("GLoRA ranks do not chain once flattened: a1 {a1:?}, a2 {a2:?}, b1 {b1:?}, b2 {b2:?}"),
                ));
            }
            if a1[0] != inn || a2[1] != inn {
                return Err(shape_err(
                    key,
                    target,
                    &[a1[0], a2[1]],
                    "GLoRA's a1·a2 must be [in, in] for the weight's input dimension",
                ));
            }
            check_fits(key, target, &[b1[0], b2[1]])
        }
        GloraLayout::Old => {
            let cols = numel(&target[1..]);
            if a2[1] != a1[0] || b2[1] != b1[0] {
                return Err(bad(
                    key,
                    format!("GLoRA ranks do not chain once flattened: a1 {a1:?}, a2 {a2:?}, b1 {b1:?}, b2 {b2:?}"),
                ));
            }
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
            Ok(())
        }
    }
}

fn numel(s: &[usize]) -> usize {
    s.iter().product()
}

/// The delta fits the target when the shapes agree, or when the output dimension and the element
/// count agree (the delta is reshaped).
fn check_fits(key: &str, target: &[usize], natural: &[usize]) -> Result<()> {
    if natural == target {
        return Ok(());
    }
    if !target.is_empty() && natural.first() == target.first() && numel(natural) == numel(target) {
        return Ok(());
    }
    Err(shape_err(
        key,
        target,
        natural,
        "the adapter's delta does not match the weight (output dimension or element count differs)",
    ))
}

fn check_dora(key: &str, target: &[usize], dora_scale: Option<&Tensor>) -> Result<()> {
    let Some(m) = dora_scale else { return Ok(()) };
    let (d, n) = (m.dims(), m.elem_count());
    let per_row = target.first().is_some_and(|&out| n == out);
    let per_col = target.len() >= 2 && d.first() == Some(&1) && n == target[1];
    if per_row || per_col {
        Ok(())
    } else {
        Err(shape_err(
            key,
            target,
            d,
            "dora_scale must hold one value per output row ([out, 1, ...]) or per input column ([1, in, ...])",
        ))
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

enum Part<'a> {
    Whole(&'a Tensor),
    Product(&'a Tensor, &'a Tensor),
    Tucker(&'a Tensor, &'a Tensor, &'a Tensor),
}

/// The two LoKr factors and the rank used for alpha scaling (`None` when both are whole).
fn lokr_parts<'a>(key: &str, k: &'a LoKr) -> Result<(Part<'a>, Part<'a>, Option<usize>)> {
    let mut rank = None;
    let w1 = match (&k.w1, &k.w1a, &k.w1b) {
        (Some(w), _, _) => Part::Whole(w),
        (None, Some(a), Some(b)) => {
            rank = b.dims().first().copied();
            Part::Product(a, b)
        }
        _ => {
            return Err(bad(
                key,
                "LoKr needs lokr_w1 or both lokr_w1_a and lokr_w1_b",
            ))
        }
    };
    let w2 = match (&k.w2, &k.w2a, &k.w2b) {
        (Some(w), _, _) => Part::Whole(w),
        (None, Some(a), Some(b)) => {
            rank = b.dims().first().copied();
            match &k.t2 {
                Some(t) => Part::Tucker(t, a, b),
                None => Part::Product(a, b),
            }
        }
        _ => {
            return Err(bad(
                key,
                "LoKr needs lokr_w2 or both lokr_w2_a and lokr_w2_b",
            ))
        }
    };
    Ok((w1, w2, rank))
}

fn part_shape(key: &str, p: &Part<'_>, what: &str) -> Result<Vec<usize>> {
    match p {
        Part::Whole(w) => Ok(w.dims().to_vec()),
        Part::Product(a, b) => factor_shape(key, a, b, None, what),
        Part::Tucker(t, a, b) => factor_shape(key, a, b, Some(t), what),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `err` is a [`Error::PatchShape`] naming `key`, `weight` and `patch`.
    fn assert_patch_shape(err: &Error, key: &str, weight: &[usize], patch: &[usize]) {
        match err {
            Error::PatchShape {
                key: k,
                weight_shape,
                patch_shape,
                ..
            } => assert_eq!(
                (k.as_str(), weight_shape.as_slice(), patch_shape.as_slice()),
                (key, weight, patch)
            ),
            other => panic!("expected a PatchShape error, got {other}"),
        }
    }

    fn t2(rows: &[&[f32]]) -> Tensor {
        let r = rows.len();
        let c = rows[0].len();
        let flat: Vec<f32> = rows.iter().flat_map(|r| r.iter().copied()).collect();
        Tensor::from_vec(flat, (r, c), &Device::Cpu).unwrap()
    }

    fn tn(data: &[f32], shape: &[usize]) -> Tensor {
        Tensor::from_vec(data.to_vec(), shape, &Device::Cpu).unwrap()
    }

    fn full(v: f32, shape: &[usize]) -> Tensor {
        (Tensor::ones(shape, DType::F32, &Device::Cpu).unwrap() * f64::from(v)).unwrap()
    }

    fn vals(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1().unwrap()
    }

    fn assert_close(t: &Tensor, expected: &[f32], tol: f32) {
        let got = vals(t);
        assert_eq!(got.len(), expected.len(), "{got:?} vs {expected:?}");
        for (g, e) in got.iter().zip(expected) {
            assert!((g - e).abs() <= tol, "{got:?} vs {expected:?}");
        }
    }

    fn run(w: &Tensor, entries: &[PatchEntry]) -> Tensor {
        apply("k", w, entries, DoraNorm::Standard).unwrap()
    }

    fn lora_entry(l: Lora, s: f32) -> PatchEntry {
        PatchEntry::new(Patch::Lora(l)).with_strengths(s, 1.0)
    }

    #[test]
    fn lora_delta_is_scaled_by_strength_times_alpha_over_rank() {
        let w = full(0.0, &[2, 2]);
        let mut l = Lora::new(t2(&[&[1.0], &[2.0]]), t2(&[&[3.0, 4.0]]));
        l.alpha = Some(0.5);
        let out = run(&w, &[lora_entry(l.clone(), 2.0)]);
        assert_close(&out, &[3.0, 4.0, 6.0, 8.0], 0.0);
        l.alpha = None;
        let out = run(&w, &[lora_entry(l, 2.0)]);
        assert_close(&out, &[6.0, 8.0, 12.0, 16.0], 0.0);
    }

    #[test]
    fn strength_model_scales_weight_accumulated_so_far() {
        let w = full(1.0, &[1, 1]);
        let diff = Patch::Diff {
            diff: full(1.0, &[1, 1]),
            pad: false,
        };
        let out = run(&w, &[PatchEntry::new(diff).with_strengths(1.0, 0.5)]);
        assert_close(&out, &[1.5], 0.0);
    }

    #[test]
    fn model_merge_interpolates_between_two_weights() {
        // ComfyUI's merge: base w2, entry Diff(w1) with strength_patch r, strength_model 1 - r.
        let (w1, w2, r) = (2.0, 4.0, 0.25);
        let diff = Patch::Diff {
            diff: full(w1, &[3]),
            pad: false,
        };
        let out = run(
            &full(w2, &[3]),
            &[PatchEntry::new(diff).with_strengths(r, 1.0 - r)],
        );
        assert_close(&out, &[3.5, 3.5, 3.5], 0.0);
    }

    #[test]
    fn patches_apply_in_order() {
        let w = full(1.0, &[2]);
        let set = PatchEntry::new(Patch::Set(full(5.0, &[2])));
        let diff = PatchEntry::new(Patch::Diff {
            diff: full(1.0, &[2]),
            pad: false,
        });
        assert_close(&run(&w, &[diff.clone(), set.clone()]), &[5.0, 5.0], 0.0);
        assert_close(&run(&w, &[set, diff]), &[6.0, 6.0], 0.0);
    }

    #[test]
    fn set_ignores_strength() {
        let w = full(1.0, &[2, 2]);
        let e = PatchEntry::new(Patch::Set(full(7.0, &[2, 2]))).with_strengths(0.3, 0.5);
        assert_close(&run(&w, &[e]), &[7.0; 4], 0.0);
    }

    #[test]
    fn offset_diff_changes_only_the_narrowed_rows() {
        let w = full(0.0, &[4, 2]);
        let e = PatchEntry::new(Patch::Diff {
            diff: full(1.0, &[2, 2]),
            pad: false,
        })
        .with_offset(Offset {
            dim: 0,
            start: 2,
            len: 2,
        });
        let out = run(&w, &[e]);
        assert_eq!(out.dims(), &[4, 2]);
        assert_close(&out, &[0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0], 0.0);
    }

    #[test]
    fn strength_model_with_offset_scales_only_the_narrowed_region() {
        let w = full(1.0, &[2, 4]);
        let e = PatchEntry::new(Patch::Diff {
            diff: full(0.0, &[2, 1]),
            pad: false,
        })
        .with_strengths(1.0, 0.5)
        .with_offset(Offset {
            dim: 1,
            start: 1,
            len: 1,
        });
        let out = run(&w, &[e]);
        assert_close(&out, &[1.0, 0.5, 1.0, 1.0, 1.0, 0.5, 1.0, 1.0], 0.0);
    }

    #[test]
    fn offset_outside_weight_is_rejected() {
        let e = PatchEntry::new(Patch::Diff {
            diff: full(1.0, &[2, 2]),
            pad: false,
        })
        .with_offset(Offset {
            dim: 0,
            start: 3,
            len: 2,
        });
        let err = validate("blk.w", &[4, 2], &e).unwrap_err();
        assert!(
            matches!(err, Error::BadPatch { ref key, .. } if key == "blk.w"),
            "{err}"
        );
    }

    #[test]
    fn loha_is_hadamard_product_of_two_low_rank_products() {
        let h = LoHa {
            w1a: t2(&[&[1.0], &[1.0]]),
            w1b: t2(&[&[2.0, 2.0]]),
            w2a: t2(&[&[1.0], &[1.0]]),
            w2b: t2(&[&[3.0, 3.0]]),
            t1: None,
            t2: None,
            alpha: None,
            dora_scale: None,
        };
        let out = run(&full(1.0, &[2, 2]), &[PatchEntry::new(Patch::LoHa(h))]);
        assert_close(&out, &[7.0; 4], 0.0);
    }

    #[test]
    fn loha_alpha_scales_by_w1b_rank() {
        let h = LoHa {
            w1a: t2(&[&[1.0, 1.0]]),
            w1b: t2(&[&[1.0], &[1.0]]),
            w2a: t2(&[&[1.0]]),
            w2b: t2(&[&[3.0]]),
            t1: None,
            t2: None,
            alpha: Some(1.0),
            dora_scale: None,
        };
        // (1·1 + 1·1) · 3 · (1 / 2) = 3
        let out = run(&full(0.0, &[1, 1]), &[PatchEntry::new(Patch::LoHa(h))]);
        assert_close(&out, &[3.0], 0.0);
    }

    /// Reference einsum 'ijkl,jr,ip->prkl' by loops.
    fn tucker_ref(t: &[f32], td: [usize; 4], a: &[f32], p: usize, b: &[f32], q: usize) -> Vec<f32> {
        let [ni, nj, nk, nl] = td;
        let mut out = vec![0.0; p * q * nk * nl];
        for pp in 0..p {
            for qq in 0..q {
                for k in 0..nk {
                    for l in 0..nl {
                        let mut s = 0.0;
                        for i in 0..ni {
                            for j in 0..nj {
                                s += t[((i * nj + j) * nk + k) * nl + l]
                                    * b[j * q + qq]
                                    * a[i * p + pp];
                            }
                        }
                        out[((pp * q + qq) * nk + k) * nl + l] = s;
                    }
                }
            }
        }
        out
    }

    #[test]
    fn loha_tucker_form_matches_reference_contraction() {
        // t [2, 2, 1, 2], a [2, out=3], b [2, in=2]; both factors the same, so delta = m ⊙ m.
        let t: Vec<f32> = (1..=8).map(|v| v as f32 * 0.5).collect();
        let a: Vec<f32> = vec![1.0, -1.0, 2.0, 0.5, 3.0, -2.0];
        let b: Vec<f32> = vec![1.0, 2.0, -1.0, 0.5];
        let m = tucker_ref(&t, [2, 2, 1, 2], &a, 3, &b, 2);
        let h = LoHa {
            w1a: tn(&a, &[2, 3]),
            w1b: tn(&b, &[2, 2]),
            w2a: tn(&a, &[2, 3]),
            w2b: tn(&b, &[2, 2]),
            t1: Some(tn(&t, &[2, 2, 1, 2])),
            t2: Some(tn(&t, &[2, 2, 1, 2])),
            alpha: None,
            dora_scale: None,
        };
        let out = run(
            &full(0.0, &[3, 2, 1, 2]),
            &[PatchEntry::new(Patch::LoHa(h))],
        );
        let expected: Vec<f32> = m.iter().map(|v| v * v).collect();
        assert_close(&out, &expected, 1e-4);
    }

    #[test]
    fn lokr_is_kronecker_product() {
        let k = LoKr {
            w1: Some(t2(&[&[1.0, 2.0]])),
            w2: Some(t2(&[&[1.0], &[1.0]])),
            alpha: Some(8.0), // ignored: no factor is factorised
            ..LoKr::default()
        };
        let out = run(&full(0.0, &[2, 2]), &[PatchEntry::new(Patch::LoKr(k))]);
        assert_close(&out, &[1.0, 2.0, 1.0, 2.0], 0.0);

        // kron([[1,2],[3,4]], [[0,1],[1,0]])
        let k = LoKr {
            w1: Some(t2(&[&[1.0, 2.0], &[3.0, 4.0]])),
            w2: Some(t2(&[&[0.0, 1.0], &[1.0, 0.0]])),
            ..LoKr::default()
        };
        let out = run(&full(0.0, &[4, 4]), &[PatchEntry::new(Patch::LoKr(k))]);
        #[rustfmt::skip]
        let expected = [
            0.0, 1.0, 0.0, 2.0,
            1.0, 0.0, 2.0, 0.0,
            0.0, 3.0, 0.0, 4.0,
            3.0, 0.0, 4.0, 0.0,
        ];
        assert_close(&out, &expected, 0.0);
    }

    #[test]
    fn lokr_factorised_form_uses_alpha_over_rank() {
        // w2 = w2a·w2b = [[1],[1]]·[[1, 1]] (rank 1) = ones(2,2); alpha 0.5 → scale 0.5.
        let k = LoKr {
            w1: Some(t2(&[&[2.0]])),
            w2a: Some(t2(&[&[1.0], &[1.0]])),
            w2b: Some(t2(&[&[1.0, 1.0]])),
            alpha: Some(0.5),
            ..LoKr::default()
        };
        let out = run(&full(0.0, &[2, 2]), &[PatchEntry::new(Patch::LoKr(k))]);
        assert_close(&out, &[1.0; 4], 0.0);
    }

    #[test]
    fn conv_lora_reshapes_delta_to_the_kernel() {
        // weight [out 2, in 1, 2, 2]; up [2, 1, 1, 1], down [1, 1, 2, 2].
        let up = tn(&[1.0, 2.0], &[2, 1, 1, 1]);
        let down = tn(&[1.0, 2.0, 3.0, 4.0], &[1, 1, 2, 2]);
        let out = run(
            &full(0.0, &[2, 1, 2, 2]),
            &[PatchEntry::new(Patch::Lora(Lora::new(up, down)))],
        );
        assert_eq!(out.dims(), &[2, 1, 2, 2]);
        assert_close(&out, &[1.0, 2.0, 3.0, 4.0, 2.0, 4.0, 6.0, 8.0], 0.0);
    }

    #[test]
    fn conv_lora_with_mid_composes_up_mid_down() {
        // up [out 2, a 2, 1, 1], mid [a 2, b 3, 1, 2], down [b 3, in 2, 1, 1].
        let up: Vec<f32> = vec![1.0, 2.0, -1.0, 0.5];
        let mid: Vec<f32> = (0..12).map(|v| v as f32 - 5.0).collect();
        let down: Vec<f32> = vec![1.0, 0.0, 2.0, -1.0, 0.5, 3.0];
        let mut expected = vec![0.0f32; 2 * 2 * 2];
        for o in 0..2 {
            for i in 0..2 {
                for x in 0..2 {
                    let mut s = 0.0;
                    for a in 0..2 {
                        for b in 0..3 {
                            s += up[o * 2 + a] * mid[(a * 3 + b) * 2 + x] * down[b * 2 + i];
                        }
                    }
                    expected[(o * 2 + i) * 2 + x] = s;
                }
            }
        }
        let mut l = Lora::new(tn(&up, &[2, 2, 1, 1]), tn(&down, &[3, 2, 1, 1]));
        l.mid = Some(tn(&mid, &[2, 3, 1, 2]));
        l.alpha = Some(3.0); // rank = down rows = 3 → scale 1
        let out = run(
            &full(0.0, &[2, 2, 1, 2]),
            &[PatchEntry::new(Patch::Lora(l))],
        );
        assert_close(&out, &expected, 1e-4);
    }

    #[test]
    fn diff_with_pad_grows_the_weight_to_the_diff_shape() {
        let w = t2(&[&[1.0]]);
        let e = PatchEntry::new(Patch::Diff {
            diff: full(1.0, &[2, 3]),
            pad: true,
        });
        assert_eq!(
            patched_shape("k", &[1, 1], std::slice::from_ref(&e)).unwrap(),
            vec![2, 3]
        );
        let out = run(&w, &[e]);
        assert_eq!(out.dims(), &[2, 3]);
        assert_close(&out, &[2.0, 1.0, 1.0, 1.0, 1.0, 1.0], 0.0);
    }

    #[test]
    fn diff_of_other_shape_without_pad_is_rejected() {
        let e = PatchEntry::new(Patch::Diff {
            diff: full(1.0, &[2, 3]),
            pad: false,
        });
        assert!(matches!(
            validate("k", &[2, 2], &e),
            Err(Error::PatchShape { .. })
        ));
    }

    fn dora_lora() -> Lora {
        let mut l = Lora::new(t2(&[&[1.0]]), t2(&[&[3.0, 0.0]]));
        l.alpha = Some(1.0);
        l.dora_scale = Some(t2(&[&[10.0]]));
        l
    }

    #[test]
    fn dora_comfyui_norm_divides_by_unpatched_row_norm() {
        let w = t2(&[&[3.0, 4.0]]);
        let out = apply("k", &w, &[lora_entry(dora_lora(), 1.0)], DoraNorm::ComfyUi).unwrap();
        assert_close(&out, &[12.0, 8.0], 1e-4);
    }

    #[test]
    fn dora_standard_norm_divides_by_patched_row_norm() {
        let w = t2(&[&[3.0, 4.0]]);
        let out = apply(
            "k",
            &w,
            &[lora_entry(dora_lora(), 1.0)],
            DoraNorm::default(),
        )
        .unwrap();
        assert_close(&out, &[8.3205, 5.5470], 1e-4);
        // The renormalised row has the magnitude's norm.
        let n: f32 = vals(&out).iter().map(|v| v * v).sum::<f32>().sqrt();
        assert!((n - 10.0).abs() < 1e-4, "{n}");
    }

    #[test]
    fn dora_strength_interpolates_from_the_unpatched_weight() {
        let w = t2(&[&[3.0, 4.0]]);
        let out = apply("k", &w, &[lora_entry(dora_lora(), 0.5)], DoraNorm::ComfyUi).unwrap();
        // W + 0.5 · ([12, 8] − [3, 4])
        assert_close(&out, &[7.5, 6.0], 1e-4);
    }

    #[test]
    fn mismatched_lora_is_rejected_naming_key_and_shapes() {
        let l = Lora::new(full(1.0, &[3, 1]), full(1.0, &[1, 2]));
        let e = PatchEntry::new(Patch::Lora(l));
        let err = validate("blocks.0.attn.q.weight", &[2, 2], &e).unwrap_err();
        assert_patch_shape(&err, "blocks.0.attn.q.weight", &[2, 2], &[3, 2]);
        let msg = err.to_string();
        assert!(
            msg.contains("blocks.0.attn.q.weight") && msg.contains("[3, 2]"),
            "{msg}"
        );
        // apply refuses it too, and validates before computing anything.
        assert!(apply("k", &full(0.0, &[2, 2]), &[e], DoraNorm::Standard).is_err());
    }

    #[test]
    fn lora_whose_ranks_do_not_chain_is_malformed() {
        let l = Lora::new(full(1.0, &[2, 2]), full(1.0, &[3, 2]));
        let err = validate("k", &[2, 2], &PatchEntry::new(Patch::Lora(l))).unwrap_err();
        assert!(matches!(err, Error::BadPatch { .. }), "{err}");
    }

    #[test]
    fn dora_scale_of_wrong_length_is_rejected() {
        let mut l = dora_lora();
        l.dora_scale = Some(full(1.0, &[3, 1]));
        let err = validate("k", &[1, 2], &PatchEntry::new(Patch::Lora(l))).unwrap_err();
        assert!(matches!(err, Error::PatchShape { .. }), "{err}");
    }

    #[test]
    fn half_precision_patch_tensors_are_upcast() {
        let up = t2(&[&[1.0], &[2.0]]).to_dtype(DType::BF16).unwrap();
        let down = t2(&[&[3.0, 4.0]]).to_dtype(DType::F16).unwrap();
        let w = full(1.0, &[2, 2]).to_dtype(DType::F16).unwrap();
        let out = run(&w, &[PatchEntry::new(Patch::Lora(Lora::new(up, down)))]);
        assert_eq!(out.dtype(), DType::F32);
        assert_close(&out, &[4.0, 5.0, 7.0, 9.0], 0.0);
    }

    #[test]
    fn zero_strength_leaves_weight_unchanged() {
        let w = t2(&[&[3.0, 4.0]]);
        let out = run(&w, &[lora_entry(dora_lora(), 0.0)]);
        assert_close(&out, &[3.0, 4.0], 0.0);
    }

    #[test]
    fn glora_new_layout_is_w_a1_a2_plus_b1_b2() {
        // W [[1,2],[3,4]]; a1 [in 2, r 1] = [[1],[0]], a2 [r 1, in 2] = [[0, 1]] so
        // A = a1·a2 = [[0,1],[0,0]] and W·A = [[0,1],[0,3]]; b1 [out 2, r 1] = [[1],[2]],
        // b2 [1, 2] = [[1,-1]] so B = [[1,-1],[2,-2]]. Δ = [[1,0],[2,1]]; alpha 2 / rank 1 at
        // strength 0.5 scales it by 1. (The old-layout test on these dims also holds, but
        // a2[0] = 1 is not the output dimension, so this is the new layout.)
        let mut g = GLora::new(
            t2(&[&[1.0], &[0.0]]),
            t2(&[&[0.0, 1.0]]),
            t2(&[&[1.0], &[2.0]]),
            t2(&[&[1.0, -1.0]]),
        );
        g.alpha = Some(2.0);
        let w = t2(&[&[1.0, 2.0], &[3.0, 4.0]]);
        let e = PatchEntry::new(Patch::GLora(g)).with_strengths(0.5, 1.0);
        assert_close(&run(&w, &[e]), &[2.0, 2.0, 5.0, 5.0], 0.0);
    }

    #[test]
    fn glora_old_layout_is_w_a2_a1_plus_b2_b1() {
        // Old layout: a1 [r 1, in 2] = [[1,1]], a2 [in 2, r 1] = [[1],[0]],
        // b1 [r 1, in 2] = [[1,0]], b2 [out 2, r 1] = [[2],[0]]. Both layout tests hold and
        // a2[0] = 2 = out on a square weight, so ComfyUI reads it as old:
        // W·a2 = [[1],[3]], ·a1 = [[1,1],[3,3]]; b2·b1 = [[2,0],[0,0]]; Δ = [[3,1],[3,3]].
        let g = GLora::new(
            t2(&[&[1.0, 1.0]]),
            t2(&[&[1.0], &[0.0]]),
            t2(&[&[1.0, 0.0]]),
            t2(&[&[2.0], &[0.0]]),
        );
        let w = t2(&[&[1.0, 2.0], &[3.0, 4.0]]);
        let out = run(&w, &[PatchEntry::new(Patch::GLora(g))]);
        assert_close(&out, &[4.0, 3.0, 6.0, 7.0], 0.0);
    }

    #[test]
    fn glora_on_a_conv_contracts_the_input_dimension_at_each_kernel_position() {
        // W [out 1, in 2, 1, 2]: channel 0 = [1, 2], channel 1 = [3, 4].
        // a1 [2, 1, 1, 1] = [1, 1], a2 [1, 2, 1, 1] = [1, 0]: A = [[1,0],[1,0]], so
        // (W·A)[j = 0] = channel 0 + channel 1 = [4, 6], (W·A)[j = 1] = [0, 0].
        // b1 [1, 1, 1, 1] = 2, b2 [1, 2, 1, 2] = [1, 0, 0, 1]: B = [2, 0, 0, 2].
        // Δ = [6, 6, 0, 2]; W + Δ = [7, 8, 3, 6].
        let g = GLora::new(
            tn(&[1.0, 1.0], &[2, 1, 1, 1]),
            tn(&[1.0, 0.0], &[1, 2, 1, 1]),
            tn(&[2.0], &[1, 1, 1, 1]),
            tn(&[1.0, 0.0, 0.0, 1.0], &[1, 2, 1, 2]),
        );
        let w = tn(&[1.0, 2.0, 3.0, 4.0], &[1, 2, 1, 2]);
        let out = run(&w, &[PatchEntry::new(Patch::GLora(g))]);
        assert_eq!(out.dims(), &[1, 2, 1, 2]);
        assert_close(&out, &[7.0, 8.0, 3.0, 6.0], 0.0);
    }

    #[test]
    fn glora_for_another_input_width_is_rejected_naming_key_and_shapes() {
        // Built for in = 3 (new layout, rank 1), offered a [2, 2] weight.
        let g = GLora::new(
            full(1.0, &[3, 1]),
            full(1.0, &[1, 3]),
            full(1.0, &[2, 1]),
            full(1.0, &[1, 3]),
        );
        let e = PatchEntry::new(Patch::GLora(g));
        let err = validate("blocks.1.mlp.fc.weight", &[2, 2], &e).unwrap_err();
        assert_patch_shape(&err, "blocks.1.mlp.fc.weight", &[2, 2], &[3, 3]);
        assert!(err.to_string().contains("blocks.1.mlp.fc.weight"), "{err}");
        assert!(apply("k", &full(0.0, &[2, 2]), &[e], DoraNorm::Standard).is_err());
    }

    #[test]
    fn glora_whose_ranks_chain_in_neither_layout_is_malformed() {
        // Old needs a1[0] = a2[1] = b1[0] = b2[1] (3, 2, 2, 2); new needs
        // a1[1] = a2[0] = b1[1] = b2[0] (1, 2, 1, 1).
        let g = GLora::new(
            full(1.0, &[3, 1]),
            full(1.0, &[2, 2]),
            full(1.0, &[2, 1]),
            full(1.0, &[1, 2]),
        );
        let err = validate("k", &[2, 2], &PatchEntry::new(Patch::GLora(g))).unwrap_err();
        assert!(matches!(err, Error::BadPatch { .. }), "{err}");
    }

    #[test]
    fn glora_at_zero_strength_leaves_the_weight_bit_for_bit() {
        let w = t2(&[&[0.1, 0.2], &[0.3, 0.7]]);
        let g = GLora::new(
            t2(&[&[1.0], &[0.5]]),
            t2(&[&[0.3, 1.0]]),
            t2(&[&[1.0], &[2.0]]),
            t2(&[&[1.0, -1.0]]),
        );
        let e = PatchEntry::new(Patch::GLora(g)).with_strengths(0.0, 1.0);
        assert_eq!(vals(&run(&w, &[e])), vals(&w));
    }

    /// One 2×2 block `B = [[0, b], [0, 0]]`, so `Q = [[0, b], [-b, 0]]`.
    fn oft_2x2(b: f32) -> Oft {
        Oft::new(tn(&[0.0, b, 0.0, 0.0], &[1, 2, 2]))
    }

    #[test]
    fn oft_cayley_of_a_2x2_block_is_the_expected_rotation() {
        // Q = [[0, q], [-q, 0]]: I − Q = [[1, -q], [q, 1]], its inverse [[1, q], [-q, 1]] / (1 + q²),
        // R = (I + Q)(I − Q)⁻¹ = [[1 − q², 2q], [-2q, 1 − q²]] / (1 + q²). q = 0.5: [[.6, .8], [-.8, .6]].
        let r = cayley("k", &oft_2x2(0.5)).unwrap();
        let expected = [0.6, 0.8, -0.8, 0.6];
        for (g, e) in r.iter().zip(expected) {
            assert!((g - e).abs() < 1e-12, "{r:?}");
        }
    }

    #[test]
    fn oft_rotations_are_orthogonal() {
        // Three 4×4 blocks of arbitrary values, unconstrained and constrained.
        let data: Vec<f32> = (0..48)
            .map(|v| ((v * 37 % 17) as f32 - 8.0) * 0.13)
            .collect();
        for alpha in [None, Some(0.3)] {
            let o = Oft {
                blocks: tn(&data, &[3, 4, 4]),
                alpha,
            };
            let r: Vec<f32> = cayley("k", &o).unwrap().iter().map(|&v| v as f32).collect();
            for b in 0..3 {
                let m = &r[b * 16..(b + 1) * 16];
                for i in 0..4 {
                    for j in 0..4 {
                        let dot: f32 = (0..4).map(|l| m[i * 4 + l] * m[j * 4 + l]).sum();
                        let want = if i == j { 1.0 } else { 0.0 };
                        assert!((dot - want).abs() < 1e-5, "block {b} ({i},{j}): {dot}");
                    }
                }
                // Not the identity: the blocks really rotate.
                assert!((m[0] - 1.0).abs() > 1e-3 || m[1].abs() > 1e-3);
            }
        }
    }

    #[test]
    fn oft_rotates_output_rows_by_r_transposed() {
        // Rᵀ = [[.6, -.8], [.8, .6]]; W = [[1, 2], [3, 4]]:
        // Rᵀ·W = [[.6 − 2.4, 1.2 − 3.2], [.8 + 1.8, 1.6 + 2.4]] = [[-1.8, -2], [2.6, 4]].
        let w = t2(&[&[1.0, 2.0], &[3.0, 4.0]]);
        let out = run(&w, &[PatchEntry::new(Patch::Oft(oft_2x2(0.5)))]);
        assert_close(&out, &[-1.8, -2.0, 2.6, 4.0], 1e-6);
    }

    #[test]
    fn oft_blocks_are_block_diagonal() {
        // Block 0 as above, block 1 zero (R = I): rows 0-1 rotate, rows 2-3 stay.
        // Rᵀ·[1, 2] = [.6 − 1.6, .8 + 1.2] = [-1, 2].
        let o = Oft::new(tn(&[0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], &[2, 2, 2]));
        let w = tn(&[1.0, 2.0, 3.0, 4.0], &[4, 1]);
        let out = run(&w, &[PatchEntry::new(Patch::Oft(o))]);
        assert_close(&out, &[-1.0, 2.0, 3.0, 4.0], 1e-6);
    }

    #[test]
    fn oft_on_a_conv_rotates_whole_output_filters() {
        // W [2, 1, 1, 2] with filters [1, 2] and [3, 4]: the same numbers as the 2×2 case.
        let w = tn(&[1.0, 2.0, 3.0, 4.0], &[2, 1, 1, 2]);
        let out = run(&w, &[PatchEntry::new(Patch::Oft(oft_2x2(0.5)))]);
        assert_eq!(out.dims(), &[2, 1, 1, 2]);
        assert_close(&out, &[-1.8, -2.0, 2.6, 4.0], 1e-6);
    }

    #[test]
    fn oft_strength_scales_the_rotation_step_by_its_square() {
        // ComfyUI: W + s·(s·Rᵀ − s·I)·W. s = 0.5: W + 0.25·(Rᵀ·W − W)
        // = [[1 − .7, 2 − 1], [3 − .1, 4 + 0]] = [[.3, 1], [2.9, 4]].
        let w = t2(&[&[1.0, 2.0], &[3.0, 4.0]]);
        let e = PatchEntry::new(Patch::Oft(oft_2x2(0.5))).with_strengths(0.5, 1.0);
        assert_close(&run(&w, &[e]), &[0.3, 1.0, 2.9, 4.0], 1e-6);
    }

    #[test]
    fn oft_alpha_caps_the_norm_of_q() {
        // b = 2: ‖Q‖ = √8. alpha = √8 / 4 scales Q by 1/4 (the 1e-8 aside) → q = 0.5.
        let w = t2(&[&[1.0, 2.0], &[3.0, 4.0]]);
        let mut o = oft_2x2(2.0);
        o.alpha = Some(8f32.sqrt() / 4.0);
        let out = run(&w, &[PatchEntry::new(Patch::Oft(o.clone()))]);
        assert_close(&out, &[-1.8, -2.0, 2.6, 4.0], 1e-5);
        // A constraint above the norm leaves q = 2: R = [[-3, 4], [-4, -3]] / 5,
        // Rᵀ = [[-.6, -.8], [.8, -.6]], Rᵀ·W = [[-.6 − 2.4, -1.2 − 3.2], [.8 − 1.8, 1.6 − 2.4]].
        o.alpha = Some(10.0);
        let out = run(&w, &[PatchEntry::new(Patch::Oft(o))]);
        assert_close(&out, &[-3.0, -4.4, -1.0, -0.8], 1e-5);
    }

    #[test]
    fn oft_at_zero_strength_leaves_the_weight_bit_for_bit() {
        let w = t2(&[&[0.1, 0.2], &[0.3, 0.7]]);
        let e = PatchEntry::new(Patch::Oft(oft_2x2(0.5))).with_strengths(0.0, 1.0);
        assert_eq!(vals(&run(&w, &[e])), vals(&w));
    }

    #[test]
    fn oft_for_another_output_width_is_rejected_naming_key_and_shapes() {
        let e = PatchEntry::new(Patch::Oft(Oft::new(full(0.1, &[2, 2, 2]))));
        let err = validate("blocks.2.attn.proj.weight", &[3, 2], &e).unwrap_err();
        assert_patch_shape(&err, "blocks.2.attn.proj.weight", &[3, 2], &[4, 2]);
        assert!(apply("k", &full(0.0, &[3, 2]), &[e], DoraNorm::Standard).is_err());
        // Butterfly (BOFT) blocks and non-square blocks are refused as malformed.
        for d in [&[1, 2, 2, 2][..], &[2, 2, 1]] {
            let e = PatchEntry::new(Patch::Oft(Oft::new(full(0.1, d))));
            let err = validate("k", &[4, 2], &e).unwrap_err();
            assert!(matches!(err, Error::BadPatch { .. }), "{err}");
        }
    }

    #[test]
    fn linear_lora_fits_a_one_by_one_conv() {
        let l = Lora::new(t2(&[&[1.0], &[2.0]]), t2(&[&[3.0, 4.0]]));
        let out = run(
            &full(0.0, &[2, 2, 1, 1]),
            &[PatchEntry::new(Patch::Lora(l))],
        );
        assert_eq!(out.dims(), &[2, 2, 1, 1]);
        assert_close(&out, &[3.0, 4.0, 6.0, 8.0], 0.0);
    }
}
