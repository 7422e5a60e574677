//! Patch kinds and their exact math, one file per kind.
//!
//! A [`Patch`] describes a change to one weight: a full difference ([`Patch::Diff`]), a
//! replacement ([`Patch::Set`]), or a low-rank adapter ([`Lora`], [`LoHa`], [`LoKr`],
//! [`GLora`]), each optionally with a DoRA magnitude vector, or an orthogonal rotation of the
//! output rows ([`Oft`]). A [`PatchEntry`] adds the two strengths and an optional [`Offset`] that
//! narrows the target weight. Patches never touch the base weight: [`apply`] reads it and returns
//! a new tensor.
//!
//! # Layout
//!
//! Each kind lives in its own file with its struct, its shape rule and its math, as in ComfyUI's
//! `comfy/weight_adapter/` package: `diff.rs` (`Diff` and `Set`), `lora.rs`, `loha.rs`,
//! `lokr.rs`, `glora.rs`, `oft.rs`. `factor.rs` builds the factors LoHa and LoKr share, `dora.rs`
//! holds DoRA's shape rule and renormalisation, `offset.rs` the narrowing of a target. Every kind
//! implements the module's private `WeightAdapter` trait (its shape rule and how it applies); the
//! four that add a delta implement `DeltaAdapter` instead (the delta's natural shape and the
//! delta) and share the reshape rule, DoRA and the strength. [`Patch`] maps each variant to its
//! implementation in one `match`, so a new kind is a new file, a variant and one arm.
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
//!    - the adapters add their delta, each documented on its type: [`Lora`] (and LoCon, with a
//!      Tucker `mid`), [`LoHa`], [`LoKr`] and [`GLora`], whose delta also reads `w`; [`Oft`]
//!      rotates `w` instead.
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
//! DoRA adds two elementwise passes and a row reduction.
//!
//! Memory: the weight is decoded once into an `f32` buffer of its own, and every entry that adds
//! a delta (LoRA, LoCon, LoHa, LoKr, GLoRA, a diff; whole or on a run of rows, as a fused
//! projection's offsets are) is added into it a block of about 2 M values at a time: the delta of
//! those rows alone (LoHa's two factor products, LoKr's Kronecker rows, a half-precision diff's
//! upcast) is computed, added, and dropped (`owned.rs`). A chain of such entries costs the weight
//! plus one 8 MiB block. DoRA, a `strength_model` other than 1, an offset on another dimension,
//! a padding diff, `Set` and OFT are computed whole (a new weight-sized accumulator each).
//! [`apply_owned`] takes the caller's `f32` values as that buffer (the streaming merge).

mod boft;
mod diff;
mod dora;
mod factor;
mod glora;
mod loha;
mod lokr;
mod lora;
mod low_rank;
mod offset;
mod oft;
mod owned;
#[cfg(test)]
mod tests;

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result, TensorContext};
use diff::{Diff, Set};

pub use boft::Boft;
pub use dora::DoraNorm;
pub use glora::GLora;
pub use loha::LoHa;
pub use lokr::LoKr;
pub use lora::Lora;
pub use offset::Offset;
pub use oft::Oft;
pub(crate) use owned::apply_fused;
pub use owned::apply_owned;
use owned::Region;

/// One change to one weight. See the [module docs](self) for how entries apply, and each kind's
/// type for its math.
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
    /// A BOFT (butterfly OFT) adapter: butterfly factors of block-diagonal rotations of the
    /// output rows.
    Boft(Boft),
}

impl Patch {
    /// A short name of the kind, for messages: `diff`, `set`, `lora`, `loha`, `lokr`, `glora`,
    /// `oft`.
    pub fn kind(&self) -> &'static str {
        self.adapter(|a| a.kind())
    }

    /// Calls `f` with this patch's kind: the one place a variant meets its implementation.
    fn adapter<R>(&self, f: impl FnOnce(&dyn WeightAdapter) -> R) -> R {
        match self {
            Patch::Diff { diff, pad } => f(&Diff { diff, pad: *pad }),
            Patch::Set(value) => f(&Set(value)),
            Patch::Lora(l) => f(l),
            Patch::LoHa(h) => f(h),
            Patch::LoKr(k) => f(k),
            Patch::GLora(g) => f(g),
            Patch::Oft(o) => f(o),
            Patch::Boft(o) => f(o),
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

/// Checks the values of `entry` (one pass over its tensors): finite strengths, a finite alpha, and
/// no NaN or infinity in any tensor — what [`crate::patcher::ModelPatcher::add_patches`] refuses
/// before adding anything, so a bad value fails when it is added, never during a load.
///
/// Errors: [`Error::BadPatch`] naming the key and the part.
pub fn check_values(key: &str, entry: &PatchEntry) -> Result<()> {
    for (name, v) in [
        ("strength_patch", entry.strength_patch),
        ("strength_model", entry.strength_model),
    ] {
        if !v.is_finite() {
            return Err(bad(key, format!("{name} {v} is not a finite number")));
        }
    }
    let (tensors, alpha) = entry.patch.adapter(|a| {
        let (t, alpha) = a.parts();
        (
            t.into_iter()
                .map(|(n, t)| (n, t.clone()))
                .collect::<Vec<_>>(),
            alpha,
        )
    });
    if let Some(a) = alpha.filter(|a| !a.is_finite()) {
        return Err(bad(key, format!("its alpha {a} is not a finite number")));
    }
    for (name, t) in tensors {
        if !all_finite(&t).ctx(|| format!("`{key}`: reading its {name}"))? {
            return Err(bad(
                key,
                format!("its {name} {:?} holds NaN or infinite values", t.dims()),
            ));
        }
    }
    Ok(())
}

/// Whether every value of a float tensor is finite (integer tensors always are).
fn all_finite(t: &Tensor) -> candle_core::Result<bool> {
    if t.dtype().is_int() {
        return Ok(true);
    }
    let v = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    Ok(v.iter().all(|x| x.is_finite()))
}

/// Applies `entries` in order to `weight` and returns the patched weight in f32, on the weight's
/// device. The weight (of any float dtype) is not modified. Each entry is validated against the
/// shape accumulated so far before it is computed; on error nothing is returned.
///
/// The weight is decoded into a buffer of its own and the entries that add a delta are added into
/// it a block of rows at a time (`owned.rs`): a chain costs the weight plus one block of
/// temporaries. On the CPU this gives bit for bit the values of computing every entry whole with
/// candle's operations (tested).
pub fn apply(key: &str, weight: &Tensor, entries: &[PatchEntry], dora: DoraNorm) -> Result<Tensor> {
    apply_fresh(key, fresh_f32(key, weight)?, entries, dora)
}

/// [`apply`] on `w`, an `f32` tensor whose storage is this call's alone (a fresh decode): on the
/// CPU the deltas are added into it, without the copy [`apply`] makes first.
pub(crate) fn apply_fresh(
    key: &str,
    w: Tensor,
    entries: &[PatchEntry],
    dora: DoraNorm,
) -> Result<Tensor> {
    owned::apply_unique(key, w, entries, dora, owned::BLOCK_ELEMS)
}

/// `t` in f32 in a new buffer of its own (a copy when it already is f32).
pub(crate) fn fresh_f32(key: &str, t: &Tensor) -> Result<Tensor> {
    let ctx = || format!("`{key}`: upcasting the weight to f32");
    if t.dtype() == DType::F32 {
        return t.copy().ctx(ctx);
    }
    t.to_dtype(DType::F32).ctx(ctx)
}

/// [`apply`] with every entry computed whole by candle's operations, a new accumulator per entry:
/// what the row-block engine is tested against.
#[cfg(test)]
pub(crate) fn apply_whole(
    key: &str,
    weight: &Tensor,
    entries: &[PatchEntry],
    dora: DoraNorm,
) -> Result<Tensor> {
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
    match entry.offset {
        None => patch_region(key, w, entry, dora),
        Some(o) => offset::apply(key, w, o, |region| patch_region(key, region, entry, dora)),
    }
}

/// Applies one entry to its (already narrowed) target.
fn patch_region(key: &str, target: &Tensor, entry: &PatchEntry, dora: DoraNorm) -> Result<Tensor> {
    let w = if entry.strength_model != 1.0 {
        target
            .affine(f64::from(entry.strength_model), 0.0)
            .ctx(|| format!("`{key}`: scaling by strength_model"))?
    } else {
        target.clone()
    };
    entry
        .patch
        .adapter(|a| a.apply(key, &w, entry.strength_patch, dora))
}

/// The most dimensions a weight or patch tensor may have: candle's own limit for strided
/// operations.
pub const MAX_RANK: usize = 8;

/// The shape `entry` turns a weight of `weight_shape` into, or why it cannot apply. Also refuses
/// strengths that are not finite numbers and tensors of more than [`MAX_RANK`] dimensions.
fn entry_output_shape(key: &str, weight_shape: &[usize], entry: &PatchEntry) -> Result<Vec<usize>> {
    for (name, v) in [
        ("strength_patch", entry.strength_patch),
        ("strength_model", entry.strength_model),
    ] {
        if !v.is_finite() {
            return Err(bad(key, format!("{name} {v} is not a finite number")));
        }
    }
    if weight_shape.len() > MAX_RANK {
        return Err(bad(
            key,
            format!(
                "the weight has {} dimensions {weight_shape:?}; patches apply to weights of at most {MAX_RANK}",
                weight_shape.len()
            ),
        ));
    }
    let (tensors, _) = entry.patch.adapter(|a| {
        let (t, alpha) = a.parts();
        (
            t.into_iter()
                .map(|(n, t)| (n, t.dims().to_vec()))
                .collect::<Vec<_>>(),
            alpha,
        )
    });
    if let Some((name, dims)) = tensors.iter().find(|(_, d)| d.len() > MAX_RANK) {
        return Err(bad(
            key,
            format!(
                "its {name} has {} dimensions {dims:?}; at most {MAX_RANK} are supported",
                dims.len()
            ),
        ));
    }
    let patch_shape = |target: &[usize]| entry.patch.adapter(|a| a.output_shape(key, target));
    match entry.offset {
        None => patch_shape(weight_shape),
        Some(o) => offset::output_shape(key, weight_shape, o, patch_shape),
    }
}

/// What every patch kind provides, in its own file: its shape rule and how it applies.
/// [`Patch::adapter`] maps a variant to its implementation.
trait WeightAdapter {
    /// A short name of the kind, for messages.
    fn kind(&self) -> &'static str;

    /// The shape the patch turns `target` into, from dimensions alone, or why it cannot apply.
    fn output_shape(&self, key: &str, target: &[usize]) -> Result<Vec<usize>>;

    /// The patched target: `w` is the target in f32 (narrowed by the entry's offset and scaled by
    /// its `strength_model`), `s` the entry's `strength_patch`.
    fn apply(&self, key: &str, w: &Tensor, s: f32, dora: DoraNorm) -> Result<Tensor>;

    /// Every tensor of the patch, with the name messages give it, and its alpha.
    fn parts(&self) -> Parts<'_>;

    /// The patch as a low-rank delta with `s` folded in, for the fused engine (`owned.rs`), when
    /// it is one (a LoRA or LoCon of a rank the kernel takes, without DoRA); `None` otherwise.
    fn low_rank(&self, _key: &str, _s: f32) -> Result<Option<low_rank::LowRank>> {
        Ok(None)
    }

    /// Adds what the patch does to the target rows `region` of `w` into `w`'s own buffer, when
    /// that is `target + delta` elementwise, and says whether it did (`false`: the whole path
    /// computes it). The values must be [`WeightAdapter::apply`]'s (see `owned.rs`).
    fn add_into(&self, _key: &str, _w: &Tensor, _region: Region, _s: f32) -> Result<bool> {
        Ok(false)
    }
}

/// A patch's tensors (named for messages) and its alpha.
type Parts<'a> = (Vec<(&'static str, &'a Tensor)>, Option<f32>);

/// A kind whose patch adds a delta to the weight, optionally through DoRA: LoRA, LoHa, LoKr,
/// GLoRA. It provides the delta's natural shape and the delta; the rule that fits the delta to the
/// weight, DoRA and the strength are shared (the [`WeightAdapter`] of every `DeltaAdapter`).
trait DeltaAdapter {
    /// A short name of the kind, for messages.
    const KIND: &'static str;

    /// The delta's natural shape for a weight of shape `target`, after checking that the adapter
    /// is consistent in itself.
    fn delta_shape(&self, key: &str, target: &[usize]) -> Result<Vec<usize>>;

    /// The delta for the target `w`, scaled by `factor` (and by the adapter's `alpha / rank`).
    fn delta(&self, key: &str, w: &Tensor, factor: f32) -> Result<Tensor>;

    /// Rows `first..first + n` of the delta (flattened to `[out, rest]`, scaled as
    /// [`DeltaAdapter::delta`]), computed without the rest, or `None` when this kind only
    /// computes its delta whole. Must hold the same values as those rows of the whole delta.
    fn delta_rows(
        &self,
        _key: &str,
        _dev: &Device,
        _factor: f32,
        _rows: (usize, usize),
    ) -> Result<Option<Tensor>> {
        Ok(None)
    }

    /// The delta as a low-rank product for the [`low_rank`] kernel — `[rows, rank]`
    /// coefficients (scaled as [`DeltaAdapter::delta`]) and `[rank, rest]` factors on the host —
    /// when this kind has that form and its rank suits the kernel; `None` sends it through
    /// [`DeltaAdapter::delta_rows`].
    fn low_rank(&self, _key: &str, _factor: f32) -> Result<Option<low_rank::LowRank>> {
        Ok(None)
    }

    /// The DoRA magnitude, if any.
    fn dora_scale(&self) -> Option<&Tensor>;

    /// Every tensor of the adapter (DoRA magnitude included), named for messages, and its alpha.
    fn parts(&self) -> Parts<'_>;
}

impl<T: DeltaAdapter> WeightAdapter for T {
    fn kind(&self) -> &'static str {
        T::KIND
    }

    fn parts(&self) -> Parts<'_> {
        DeltaAdapter::parts(self)
    }

    fn output_shape(&self, key: &str, target: &[usize]) -> Result<Vec<usize>> {
        let natural = self.delta_shape(key, target)?;
        check_fits(key, target, &natural)?;
        dora::check(key, target, self.dora_scale())?;
        Ok(target.to_vec())
    }

    /// Computes the delta (with `s` folded in), reshapes it to `w`'s shape and adds it, through
    /// DoRA when a magnitude is given.
    fn apply(&self, key: &str, w: &Tensor, s: f32, dora: DoraNorm) -> Result<Tensor> {
        if s == 0.0 {
            return Ok(w.clone());
        }
        let ctx = || format!("`{key}`: adding the adapter delta");
        let Some(magnitude) = self.dora_scale() else {
            let d = self.delta(key, w, s)?.reshape(w.shape()).ctx(ctx)?;
            return (w + &d).ctx(ctx);
        };
        let d = self.delta(key, w, 1.0)?.reshape(w.shape()).ctx(ctx)?;
        let patched = (w + &d).ctx(ctx)?;
        dora::renormalise(key, w, patched, magnitude, s, dora)
    }

    fn low_rank(&self, key: &str, s: f32) -> Result<Option<low_rank::LowRank>> {
        if self.dora_scale().is_some() {
            return Ok(None);
        }
        DeltaAdapter::low_rank(self, key, s)
    }

    /// `apply` leaves the target alone at strength 0, and without DoRA adds the delta (strength
    /// folded in): on the CPU by the low-rank kernel when the kind has that form, else the same
    /// delta block by block, or whole for a kind without row blocks.
    fn add_into(&self, key: &str, w: &Tensor, region: Region, s: f32) -> Result<bool> {
        if s == 0.0 {
            return Ok(true);
        }
        if self.dora_scale().is_some() {
            return Ok(false);
        }
        if w.device().is_cpu() {
            if let Some(lr) = DeltaAdapter::low_rank(self, key, s)? {
                if region.add_low_rank(key, w, &lr)? {
                    return Ok(true);
                }
            }
        }
        for (first, n) in region.blocks() {
            match self.delta_rows(key, w.device(), s, (first, n))? {
                Some(d) => region.add_rows(key, w, first, &d)?,
                None => {
                    let d = self.delta(key, &region.view(key, w)?, s)?;
                    region.add_rows(key, w, 0, &d)?;
                    break;
                }
            }
        }
        Ok(true)
    }
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

/// `alpha / rank`, or 1 without alpha.
fn alpha_scale(alpha: Option<f32>, rank: usize) -> f32 {
    match alpha {
        Some(a) => a / rank as f32,
        None => 1.0,
    }
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

/// The element count of a shape, saturating: a count no real tensor can have never matches one.
fn numel(s: &[usize]) -> usize {
    s.iter().fold(1usize, |a, &d| a.saturating_mul(d))
}
