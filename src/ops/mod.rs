//! Layers that know where their weights are: `Linear`, `Conv1d`, `Conv2d`, `ConvTranspose2d`,
//! `GroupNorm`, `LayerNorm`, `RmsNorm`, `Embedding`.
//!
//! Each layer implements [`candle_core::Module`], so it drops into candle code, and holds no
//! tensor: it holds the *keys* of its weights and an [`OpsSource`] (a shared handle on a
//! [`ModelPatcher`]). Every forward asks for its weights through one function,
//! [`cast_bias_weight`]:
//!
//! 1. **fetch** — [`crate::offload::fetch_weight`]: the resident copy when it is current (right
//!    device, right fingerprint), otherwise the clean host weight with the patcher's patch set
//!    applied (streamed: from a prefetch on a transfer lane, or now). This is the only place a
//!    layer reads a weight.
//! 2. **cast** — to the mode's compute dtype, through f32 with round-to-nearest-even (the same
//!    helper [`ModelPatcher::materialize`] uses); a quantized weight is dequantized first
//!    (`decode(w) × scale`, in f32).
//! 3. **move** to the input's device if it lives elsewhere.
//! 4. **wrap** — the patcher's weight wrappers ([`ModelPatcher::add_weight_wrapper`]) in order.
//!
//! # Invariants
//! - **I3, streaming is invisible.** A resident weight and a streamed one are both built by
//!   [`ModelPatcher::materialize`] (same patch math in f32, same rounding back to the storage
//!   dtype, same seeded stochastic rounding for fp8), and steps 2–4 above are the same code for
//!   both, so a layer's output is bit-identical whatever the residency.
//! - Clean weights are never modified (I1): every step builds new tensors.
//! - Building a layer checks that its keys exist ([`Error::UnknownWeight`] names model and key)
//!   and that shapes agree ([`Error::ShapeMismatch`]); a forward checks the input's shape.
//! - No lock is held while a weight wrapper (user code) runs: the source's lock (`Rank::OpsPatcher`)
//!   is held only to clone an `Arc`.
//!
//! # Modes
//! [`OpsMode`] says how weights meet the compute dtype; [`pick_operations`] chooses it.
//! - [`OpsMode::DisableWeightInit`]: weights are used in their resident dtype; the input must be
//!   in that dtype. fp8 and quantized weights cannot run in it (an error at build time or at use).
//! - [`OpsMode::ManualCast`]: weights are cast to `compute`; inputs are cast too. A resident
//!   weight's cast is kept in the model's [`CastCache`] when the memory manager's ledger has room
//!   (same bits; see `cast_cache.rs`), so it is cast once instead of at every call.
//! - [`OpsMode::MixedPrecision`]: per-layer quantized storage (fp8 E4M3FN or E5M2 codes with a
//!   per-tensor scale) is dequantized on the fly; other layers behave as in `ManualCast`. There is
//!   no fp8 matmul on the CPU, so this build always dequantizes.
//!
//! A checkpoint builds in every mode (a plain one builds in `MixedPrecision` too; a quantized one
//! in `ManualCast` as well, where its scales are honoured the same way).
//!
//! # Quantization metadata convention
//! Per-layer quantization is described by tensors stored next to the weights, so a checkpoint
//! carries it in any safetensors tool and no header parsing is needed:
//! - `<layer>.weight` holds fp8 codes (safetensors `F8_E4M3` → E4M3FN, `F8_E5M2` → E5M2; the
//!   format is the tensor's dtype);
//! - `<layer>.weight_scale` is an f32 tensor holding **one** value (per-tensor scale): the weight
//!   the layer computes with is `decode(code) × scale`.
//!
//! A layer with a `weight_scale` is quantized; any other layer is not. Patches on a quantized
//! weight are applied to the dequantized weight and divided by the scale again before seeded
//! stochastic rounding back to fp8 ([`ModelPatcher::weight_scale`]). [`quant::quantize_per_tensor`]
//! writes weights in this form.
//!
//! Complexity: a forward of a streamed layer costs one patch application and one cast of its
//! weights (O(weight size)); a resident, current one costs the cast only (none when the resident
//! dtype is the compute dtype, or when its cast is cached).

mod cast_cache;
mod conv;
mod embedding;
mod hand_out;
mod linear;
mod norm;
pub mod quant;
mod split;
#[cfg(test)]
mod tests;

use std::sync::Arc;

use crate::lock::{Rank, RwLock};
use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result};
use crate::float::{self, Dtype};
use crate::patcher::{cast_weight, ModelPatcher};
use crate::vram::DeviceId;

pub(crate) use cast_cache::CastKey;
pub(crate) use cast_cache::{attach_cast_cache, cast_cache_of};
pub use cast_cache::{cast_cache_stats, CastCache, CastCacheStats};
pub use conv::{Conv1d, Conv2d, ConvConfig, ConvTranspose2d, ConvTransposeConfig};
pub use embedding::Embedding;
pub(crate) use hand_out::Via;
pub use linear::Linear;
pub use norm::{GroupNorm, LayerNorm, RmsNorm};
pub(crate) use split::{on_device_of, on_weight_device};

/// How a layer's weights meet the compute dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OpsMode {
    /// Weights are used as stored (in the patcher's resident dtype); no cast.
    DisableWeightInit,
    /// Weights are cast to `compute` at every call.
    ManualCast {
        /// The dtype the layer computes in.
        compute: Dtype,
    },
    /// Per-layer quantized weights (fp8 + per-tensor scale) are dequantized on the fly to
    /// `compute`; other weights are cast as in `ManualCast`.
    MixedPrecision {
        /// The dtype the layer computes in.
        compute: Dtype,
    },
}

impl OpsMode {
    /// The dtype layers compute in, or `None` when weights are used as stored.
    pub fn compute_dtype(self) -> Option<Dtype> {
        match self {
            OpsMode::DisableWeightInit => None,
            OpsMode::ManualCast { compute } | OpsMode::MixedPrecision { compute } => Some(compute),
        }
    }
}

/// Chooses the ops mode for a model (pure).
///
/// - `scaled_fp8` (the checkpoint has per-layer quantization metadata) ⇒ [`OpsMode::MixedPrecision`];
///   so do fp8 weights with `fp8_optimizations` (there is no fp8 matmul here, so they dequantize);
/// - no compute dtype, or one equal to `weight_dtype` ⇒ [`OpsMode::DisableWeightInit`];
/// - otherwise [`OpsMode::ManualCast`].
///
/// `MixedPrecision` needs a compute dtype; without one it computes in f32 on the CPU and in bf16
/// on a GPU.
pub fn pick_operations(
    weight_dtype: Dtype,
    compute_dtype: Option<Dtype>,
    load_device: DeviceId,
    fp8_optimizations: bool,
    scaled_fp8: bool,
) -> OpsMode {
    if scaled_fp8 || (fp8_optimizations && weight_dtype.is_fp8()) {
        let compute = compute_dtype.unwrap_or(if load_device.is_cpu() {
            Dtype::F32
        } else {
            Dtype::BF16
        });
        return OpsMode::MixedPrecision { compute };
    }
    match compute_dtype {
        None => OpsMode::DisableWeightInit,
        Some(c) if c == weight_dtype => OpsMode::DisableWeightInit,
        Some(compute) => OpsMode::ManualCast { compute },
    }
}

/// A shared handle on the patcher that layers fetch their weights through.
///
/// Cloning shares the handle: [`OpsSource::set_patcher`] on one clone switches every layer built
/// from it (to a clone of the same model with other patches, say). Its lock (`Rank::OpsPatcher` in the
/// crate's lock table) is held only to clone an `Arc`.
#[derive(Clone)]
pub struct OpsSource {
    patcher: Arc<RwLock<Arc<ModelPatcher>>>,
    /// Set once a forward through a patch set other than the loaded one was warned about.
    warned: Arc<std::sync::atomic::AtomicBool>,
}

impl std::fmt::Debug for OpsSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpsSource")
            .field("patcher", &*self.patcher.read())
            .finish()
    }
}

/// A handle on an [`OpsSource`] that does not keep it alive (what `nn` remembers of a parameter
/// it handed out).
#[derive(Clone)]
pub(crate) struct WeakSource {
    patcher: std::sync::Weak<RwLock<Arc<ModelPatcher>>>,
    warned: std::sync::Weak<std::sync::atomic::AtomicBool>,
}

impl WeakSource {
    /// The source, while any of its handles lives.
    pub(crate) fn upgrade(&self) -> Option<OpsSource> {
        Some(OpsSource {
            patcher: self.patcher.upgrade()?,
            warned: self.warned.upgrade()?,
        })
    }

    /// Whether both are handles on one source.
    pub(crate) fn same_as(&self, other: &WeakSource) -> bool {
        self.patcher.ptr_eq(&other.patcher)
    }
}

impl OpsSource {
    /// A handle that does not keep the source alive.
    pub(crate) fn downgrade(&self) -> WeakSource {
        WeakSource {
            patcher: Arc::downgrade(&self.patcher),
            warned: Arc::downgrade(&self.warned),
        }
    }

    /// A source fetching through a clone of `patcher` (sharing its model, patches and wrappers).
    pub fn new(patcher: &ModelPatcher) -> Self {
        OpsSource {
            patcher: Arc::new(RwLock::new(Rank::OpsPatcher, Arc::new(patcher.clone()))),
            warned: Arc::new(std::sync::atomic::AtomicBool::new(false)),
        }
    }

    /// The patcher layers fetch through now.
    pub fn patcher(&self) -> Arc<ModelPatcher> {
        Arc::clone(&self.patcher.read())
    }

    /// Makes every layer of this source fetch through `patcher` (a clone of the same model, with
    /// its own patches, wrappers and load device).
    ///
    /// # Errors
    /// [`Error::WrongModel`] when `patcher` is on another model (its keys could differ),
    /// naming both models; nothing changes then.
    pub fn set_patcher(&self, patcher: &ModelPatcher) -> Result<()> {
        let current = self.patcher();
        if !current.is_clone(patcher) {
            return Err(Error::WrongModel {
                layers: current.model().name().to_string(),
                given: patcher.model().name().to_string(),
            });
        }
        *self.patcher.write() = Arc::new(patcher.clone());
        Ok(())
    }

    /// Makes the layers fetch through `patcher` again: the very handle [`OpsSource::patcher`]
    /// returned before a switch (no check, no clone). How a failed [`OpsSource::load`] (in the
    /// loader, which owns loading) undoes its switch.
    pub(crate) fn put_back(&self, patcher: Arc<ModelPatcher>) {
        *self.patcher.write() = patcher;
    }

    /// When the layers fetch through a patch set other than the one a manager last loaded for
    /// this model (a LoRA clone loaded without [`OpsSource::set_patcher`], or layers switched to
    /// a clone that was never loaded): what is wrong, in words. A forward then computes with
    /// the layers' patches, streamed — not what was loaded — and warns once.
    pub fn not_loaded(&self) -> Option<String> {
        not_loaded_text(&self.patcher())
    }

    /// Warns once per source when a forward computes with a patch set that is not the loaded one.
    fn check_loaded(&self, patcher: &ModelPatcher) {
        if self.warned.load(std::sync::atomic::Ordering::Relaxed) {
            return;
        }
        if let Some(text) = not_loaded_text(patcher) {
            if !self.warned.swap(true, std::sync::atomic::Ordering::Relaxed) {
                tracing::warn!(model = patcher.model().name(), "{text}");
                crate::warnings::echo(&format!("clone-trap:{}", patcher.model().name()), || text);
            }
        }
    }

    /// Marks the model's first forward finished, completing its recorded weight order
    /// ([`crate::weights::Model::forward_order_keys`]). Models call it at the end of a forward.
    pub fn finish_forward(&self) {
        self.patcher().model().finish_forward();
    }
}

/// [`OpsSource::not_loaded`] for `patcher`.
fn not_loaded_text(patcher: &ModelPatcher) -> Option<String> {
    let loaded = patcher.model().loaded_patches()?;
    let mine = patcher.patches().version();
    (loaded != mine).then(|| {
        format!(
            "layers of model `{}` compute with a patcher whose patches ({} patched keys) are not the ones loaded: the forward streams them instead of using the loaded copies; switch the layers with OpsSource::set_patcher (or load with OpsSource::load)",
            patcher.model().name(),
            patcher.patches().len()
        )
    })
}

/// One weight of a layer: its key, slot index, shape and per-tensor scale.
#[derive(Debug, Clone)]
struct WeightRef {
    key: String,
    index: usize,
    shape: Vec<usize>,
    scale: Option<f32>,
}

/// A layer's weight and optional bias, and where to fetch them.
#[derive(Debug, Clone)]
pub struct LayerWeights {
    source: OpsSource,
    mode: OpsMode,
    weight: WeightRef,
    bias: Option<WeightRef>,
}

impl LayerWeights {
    /// The weight's slot index in its model.
    pub(crate) fn weight_index(&self) -> usize {
        self.weight.index
    }

    /// The weight's key.
    pub fn weight_key(&self) -> &str {
        &self.weight.key
    }
    /// The bias key, if the layer has a bias.
    pub fn bias_key(&self) -> Option<&str> {
        self.bias.as_ref().map(|b| b.key.as_str())
    }
    /// The weight's shape.
    pub fn weight_shape(&self) -> &[usize] {
        &self.weight.shape
    }
    /// The mode the layer was built in.
    pub fn mode(&self) -> OpsMode {
        self.mode
    }
    /// The weight's per-tensor scale when it is quantized.
    pub fn weight_scale(&self) -> Option<f32> {
        self.weight.scale
    }
    /// The source the layer fetches through.
    pub fn source(&self) -> &OpsSource {
        &self.source
    }

    /// The dtype a forward computes in: the mode's compute dtype, or the weight's resident dtype.
    fn compute_dtype(&self, patcher: &ModelPatcher) -> Dtype {
        self.mode
            .compute_dtype()
            .unwrap_or_else(|| patcher.resident_dtype(self.weight.index))
    }

    /// Casts a float input to the dtype the layer computes in (`ManualCast`, `MixedPrecision`), or
    /// checks that it already is (`DisableWeightInit`).
    pub(crate) fn prepare_input(&self, x: &Tensor) -> Result<Tensor> {
        let patcher = self.source.patcher();
        let want = self.compute_dtype(&patcher).candle_storage_dtype();
        if x.dtype() == want {
            return Ok(x.clone());
        }
        match self.mode {
            OpsMode::DisableWeightInit => Err(Error::UnsupportedDtype {
                dtype: format!("{:?}", x.dtype()),
                what: format!(
                    "input of layer `{}` whose weights are {:?} and used as stored (DisableWeightInit); cast the input or use ManualCast",
                    self.weight.key, want
                ),
            }),
            _ => x
                .to_dtype(want)
                .map_err(|e| Error::tensor(format!("casting the input of `{}`", self.weight.key), e)),
        }
    }
}

fn prepare_weight(
    patcher: &ModelPatcher,
    w: &WeightRef,
    mode: OpsMode,
    device: &Device,
) -> Result<Tensor> {
    let (t, streamed) = crate::offload::fetch_weight_at(patcher, w.index)
        .map_err(|e| e.fetching(patcher.model().name(), &w.key))?;
    let cache = if streamed {
        None
    } else {
        cast_cache_of(patcher.model())
    };
    let t = match (cache, cast_key(patcher, w, mode)) {
        // A resident weight cast to another dtype: once, when the ledger has room for the copy.
        (Some(cache), Some(key)) if cache.device() == patcher.weight_device(w.index) => {
            cache.get_or_cast(w.index, key, || cast_step(patcher, w, t, mode))?
        }
        _ => cast_step(patcher, w, t, mode)?,
    };
    move_and_wrap(patcher, w, t, device)
}

/// What a cached cast of weight `w` would be made from, when the layer casts it at all.
fn cast_key(patcher: &ModelPatcher, w: &WeightRef, mode: OpsMode) -> Option<CastKey> {
    let compute = mode.compute_dtype()?;
    if w.scale.is_none() && compute == patcher.resident_dtype(w.index) {
        return None;
    }
    Some(CastKey {
        generation: patcher.model().residency_generation(),
        fingerprint: patcher.fingerprint(w.index),
        compute,
        scale: w.scale.map(f32::to_bits),
    })
}

/// Steps 2–4 of [`cast_bias_weight`] on a fetched weight `t`: cast (dequantize first when
/// quantized), move to `device`, run the weight wrappers.
fn finish_weight(
    patcher: &ModelPatcher,
    w: &WeightRef,
    t: Tensor,
    mode: OpsMode,
    device: &Device,
) -> Result<Tensor> {
    let t = cast_step(patcher, w, t, mode)?;
    move_and_wrap(patcher, w, t, device)
}

/// Step 2: the cast to the mode's compute dtype (dequantized first when quantized).
fn cast_step(patcher: &ModelPatcher, w: &WeightRef, t: Tensor, mode: OpsMode) -> Result<Tensor> {
    let resident = patcher.resident_dtype(w.index);
    Ok(match mode.compute_dtype() {
        None => {
            if resident.is_fp8() || w.scale.is_some() {
                return Err(Error::UnsupportedDtype {
                    dtype: resident.to_string(),
                    what: format!(
                        "weight `{}` of `{}` used as stored (DisableWeightInit): fp8 and quantized weights need ManualCast or MixedPrecision",
                        w.key,
                        patcher.model().name()
                    ),
                });
            }
            t
        }
        Some(compute) => match w.scale {
            Some(scale) => {
                let wide = float::to_f32(&t, resident)?
                    .affine(f64::from(scale), 0.0)
                    .map_err(|e| Error::tensor(format!("dequantizing `{}`", w.key), e))?;
                cast_weight(&wide, Dtype::F32, compute)?
            }
            None => cast_weight(&t, resident, compute)?,
        },
    })
}

/// Steps 3 and 4: check the weight is on the input's device, run the weight wrappers. An input
/// on another device than the model's weights is an error naming both (moving every weight to
/// the input at every layer would silently copy the model at each forward).
fn move_and_wrap(
    patcher: &ModelPatcher,
    w: &WeightRef,
    t: Tensor,
    device: &Device,
) -> Result<Tensor> {
    if !t.device().same_device(device) {
        return Err(Error::Device {
            device: format!("{:?}", device.location()),
            reason: format!(
                "the input is on {:?} but `{}` of `{}` is on {:?} (the model's load device is {}): move the input to the model's device",
                device.location(),
                w.key,
                patcher.model().name(),
                t.device().location(),
                patcher.load_device()
            ),
        });
    }
    let mut t = t;
    for wrap in patcher.weight_wrappers(&w.key) {
        t = wrap(t)?;
    }
    Ok(t)
}

/// The weight and bias of a layer ready for a forward on `device`: resident and current ⇒ the
/// resident tensor, otherwise fetched from the host tier with the active patch set applied now;
/// then cast to `mode`'s compute dtype (dequantized first when quantized), moved to `device`, and
/// passed through the patcher's weight wrappers. The same steps for resident and streamed
/// weights, so both give the same bits (I3, docs/ARCHITECTURE.md §4.3).
///
/// # Errors
/// [`Error::UnknownWeight`] if the patcher lost a key (it cannot, for a source on the same model),
/// [`Error::UnsupportedDtype`] for fp8 weights in [`OpsMode::DisableWeightInit`], errors of the
/// patch math, the cast or a wrapper.
pub fn cast_bias_weight(
    weights: &LayerWeights,
    device: &Device,
    mode: OpsMode,
) -> Result<(Tensor, Option<Tensor>)> {
    let _span = tracing::trace_span!("layer", weight = %weights.weight.key).entered();
    let patcher = weights.source.patcher();
    weights.source.check_loaded(&patcher);
    let w = prepare_weight(&patcher, &weights.weight, mode, device)?;
    let b = match &weights.bias {
        Some(b) => Some(prepare_weight(&patcher, b, mode, device)?),
        None => None,
    };
    Ok((w, b))
}

/// The weight of `weights` (not its bias) as [`cast_bias_weight`] gives it, without recording a
/// use in the model's forward order: for raw parameters read while a model is being built
/// (`nn::VarBuilder::get`), which a forward never fetches again and prefetch must not chase.
/// The resident copy when current, else materialized now (patched, rounded, cast: the same bits).
pub(crate) fn weight_outside_forward(weights: &LayerWeights, device: &Device) -> Result<Tensor> {
    let patcher = weights.source.patcher();
    let w = &weights.weight;
    let t = match patcher.resident_tensor(w.index) {
        Some(t) => t,
        None => patcher.materialize(
            w.index,
            patcher.resident_dtype(w.index),
            patcher.weight_device(w.index),
        )?,
    };
    // A split model's parameter read by model code goes where the code asked (the load device),
    // as an activation would.
    let t = if patcher.remote_weight(w.index).is_some() && !t.device().same_device(device) {
        t.to_device(device)
            .map_err(|e| Error::tensor(format!("moving `{}` to {device:?}", w.key), e))?
    } else {
        t
    };
    finish_weight(&patcher, w, t, weights.mode, device)
}

/// Builds layers from a patcher, walking weight names by prefix like candle-nn's `VarBuilder`:
/// `OpsBuilder::new(&patcher, mode).pp("encoder").pp("layer").pp(0).linear("query", true)`
/// resolves `encoder.layer.0.query.weight` and `encoder.layer.0.query.bias`.
#[derive(Debug, Clone)]
pub struct OpsBuilder {
    source: OpsSource,
    mode: OpsMode,
    prefix: Vec<String>,
}

impl OpsBuilder {
    /// A builder on a new [`OpsSource`] for `patcher`.
    pub fn new(patcher: &ModelPatcher, mode: OpsMode) -> Self {
        OpsBuilder::from_source(&OpsSource::new(patcher), mode)
    }

    /// A builder whose layers share `source`.
    ///
    /// Two dtypes meet here, each set in one place: the patcher's
    /// ([`ModelPatcher::with_compute_dtype`]) is the dtype **resident copies are kept in** (their
    /// memory; `None`: as stored), the mode's is the dtype **layers compute in** (a resident copy
    /// of another dtype is cast at every use). Resident copies narrower than the computation
    /// are ComfyUI's fp16 storage with an f32 manual cast; wider ones (an f32 patcher under a
    /// bf16 mode) take twice the memory for casts that narrow them again, and warn once per
    /// model.
    pub fn from_source(source: &OpsSource, mode: OpsMode) -> Self {
        let patcher = source.patcher();
        if let (OpsMode::ManualCast { compute }, Some(resident)) =
            (mode, patcher.options().compute_dtype)
        {
            let wide = resident.size_in_bytes() > compute.size_in_bytes();
            // Once per model: every builder of its layers (`pp`, `root`, `to_dtype`) meets it.
            if wide && crate::warnings::latch(format!("wide-resident:{}", patcher.model().id())) {
                let model = patcher.model().name().to_string();
                let text = format!(
                    "model `{model}`: its resident copies are kept in {resident:?} \
                     (ModelPatcher::with_compute_dtype) but its layers compute in {compute:?} \
                     (OpsMode::ManualCast): each weight takes {}× the memory and is narrowed \
                     again at every use; give the patcher {compute:?} (or None) to keep it in \
                     the dtype it computes in",
                    resident.size_in_bytes() / compute.size_in_bytes()
                );
                tracing::warn!(model = %model, "{text}");
                crate::warnings::echo(&format!("wide-resident:{model}"), || text);
            }
        }
        OpsBuilder {
            source: source.clone(),
            mode,
            prefix: Vec::new(),
        }
    }

    /// A builder one name deeper (`pp` as in candle-nn: push prefix).
    pub fn pp(&self, name: impl ToString) -> Self {
        let mut b = self.clone();
        b.prefix.push(name.to_string());
        b
    }

    /// The shared source.
    pub fn source(&self) -> &OpsSource {
        &self.source
    }
    /// The mode layers are built in.
    pub fn mode(&self) -> OpsMode {
        self.mode
    }
    /// The dotted prefix (empty at the root).
    pub fn prefix(&self) -> String {
        self.prefix.join(".")
    }
    /// The full key of `name` under this prefix.
    pub fn key(&self, name: &str) -> String {
        if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.prefix())
        }
    }

    fn weight_ref(&self, patcher: &ModelPatcher, key: String) -> Result<WeightRef> {
        let model = patcher.model();
        let index = model.index_of(&key).ok_or_else(|| Error::UnknownWeight {
            model: model.name().to_string(),
            key: key.clone(),
        })?;
        let scale = patcher.weight_scale(index)?;
        if scale.is_some() && self.mode == OpsMode::DisableWeightInit {
            return Err(Error::UnsupportedDtype {
                dtype: model.slots()[index].dtype().to_string(),
                what: format!(
                    "quantized weight `{key}` of `{}` in DisableWeightInit mode (use MixedPrecision)",
                    model.name()
                ),
            });
        }
        Ok(WeightRef {
            shape: model.slots()[index].shape().to_vec(),
            key,
            index,
            scale,
        })
    }

    /// The weights `<name>.weight` (of rank `rank`) and, with `bias`, `<name>.bias` of shape
    /// `[bias_len(weight shape)]`.
    fn layer(
        &self,
        name: &str,
        rank: usize,
        bias: bool,
        bias_len: impl Fn(&[usize]) -> usize,
    ) -> Result<LayerWeights> {
        let patcher = self.source.patcher();
        let prefix = self.key(name);
        let weight = self.weight_ref(&patcher, format!("{prefix}.weight"))?;
        if weight.shape.len() != rank {
            return Err(Error::ShapeMismatch {
                what: format!(
                    "`{}` of `{}` (a rank-{rank} weight)",
                    weight.key,
                    patcher.model().name()
                ),
                expected: vec![0; rank],
                got: weight.shape.clone(),
            });
        }
        let bias = if bias {
            let b = self.weight_ref(&patcher, format!("{prefix}.bias"))?;
            let want = vec![bias_len(&weight.shape)];
            if b.shape != want {
                return Err(Error::ShapeMismatch {
                    what: format!("`{}` of `{}`", b.key, patcher.model().name()),
                    expected: want,
                    got: b.shape,
                });
            }
            Some(b)
        } else {
            None
        };
        Ok(LayerWeights {
            source: self.source.clone(),
            mode: self.mode,
            weight,
            bias,
        })
    }

    /// The weights of a layer named by full keys (already prefixed and renamed by the caller):
    /// `weight_key` must have exactly `weight_shape`, and `bias`, when given as `(key, len)`, must
    /// be `[len]`. For builders that resolve names themselves (`nn::VarBuilder`'s renaming and
    /// aliases).
    ///
    /// # Errors
    /// [`Error::UnknownWeight`] for a missing key, [`Error::ShapeMismatch`] naming the key, the
    /// model and both shapes.
    pub(crate) fn weights_at(
        &self,
        weight_key: String,
        weight_shape: &[usize],
        bias: Option<(String, usize)>,
    ) -> Result<LayerWeights> {
        let patcher = self.source.patcher();
        let check = |r: &WeightRef, expected: &[usize]| -> Result<()> {
            if r.shape != expected {
                return Err(Error::ShapeMismatch {
                    what: format!("`{}` of `{}`", r.key, patcher.model().name()),
                    expected: expected.to_vec(),
                    got: r.shape.clone(),
                });
            }
            Ok(())
        };
        let weight = self.weight_ref(&patcher, weight_key)?;
        check(&weight, weight_shape)?;
        let bias = match bias {
            Some((key, len)) => {
                let b = self.weight_ref(&patcher, key)?;
                check(&b, &[len])?;
                Some(b)
            }
            None => None,
        };
        Ok(LayerWeights {
            source: self.source.clone(),
            mode: self.mode,
            weight,
            bias,
        })
    }

    /// Checks that a built layer's weight has `expected` shape.
    fn expect_shape(w: &LayerWeights, expected: &[usize]) -> Result<()> {
        if w.weight.shape != expected {
            return Err(Error::ShapeMismatch {
                what: format!(
                    "`{}` of `{}`",
                    w.weight.key,
                    w.source.patcher().model().name()
                ),
                expected: expected.to_vec(),
                got: w.weight.shape.clone(),
            });
        }
        Ok(())
    }
}

/// candle's `Module::forward` returns candle errors; ours are wrapped into them.
pub(crate) fn to_candle(e: Error) -> candle_core::Error {
    e.into()
}

/// Whether `dtype` is a half-precision float (norms compute these in f32).
pub(crate) fn is_half(dtype: DType) -> bool {
    matches!(dtype, DType::F16 | DType::BF16)
}
