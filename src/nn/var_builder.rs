//! [`VarBuilder`]: candle-nn's `VarBuilder` over a [`ModelPatcher`].
//!
//! It walks weight names by prefix exactly as candle-nn's does (`vb.pp("encoder").pp(0)` then
//! `"weight"` is `encoder.0.weight`), and its layer constructors resolve names to the model's
//! keys, check shapes and build layers that fetch at every forward. Its only state is an
//! [`OpsBuilder`] (source, mode, prefix), the candle device and dtype, and an optional renaming;
//! cloning it costs a few `Arc` clones and the prefix.

use std::marker::PhantomData;
use std::sync::Arc;

use candle_core::{DType, Device, Shape, Tensor};

use crate::float::Dtype;
use crate::ops::{to_candle, weight_outside_forward, LayerWeights, OpsBuilder, OpsMode, OpsSource};
use crate::patcher::ModelPatcher;

type Renamer = Arc<dyn Fn(&str) -> String + Send + Sync>;

/// candle-nn's `VarBuilder` on residency-managed weights.
///
/// Layers built from it ([`super::linear()`], [`super::conv2d()`], ...) hold weight keys, not
/// tensors, and fetch through the patcher at every forward. [`VarBuilder::get`] reads a raw
/// parameter the same way (patched, cast, streamed when not resident) and hands the tensor over.
///
/// The lifetime parameter is there so that signatures written for candle-nn
/// (`fn new(vb: VarBuilder<'_>)`, `VarBuilder<'static>`) keep compiling; nothing is borrowed.
///
/// # Sharing
/// Clones share the [`OpsSource`]: [`OpsSource::set_patcher`] on it (see
/// [`VarBuilder::source`]) switches every layer built from any of them.
#[derive(Clone)]
pub struct VarBuilder<'a> {
    ops: OpsBuilder,
    device: Device,
    dtype: DType,
    rename: Option<Renamer>,
    _borrow: PhantomData<&'a ()>,
}

impl std::fmt::Debug for VarBuilder<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VarBuilder")
            .field("prefix", &self.ops.prefix())
            .field("mode", &self.ops.mode())
            .field("device", &self.device)
            .field("dtype", &self.dtype)
            .field("renamed", &self.rename.is_some())
            .finish()
    }
}

impl VarBuilder<'static> {
    /// A builder whose layers fetch through a new [`OpsSource`] on `patcher`, in `mode`.
    ///
    /// [`VarBuilder::device`] is the patcher's load device; [`VarBuilder::dtype`] is the mode's
    /// compute dtype, else the patcher's compute dtype, else the storage dtype of the model's
    /// first weight (f32 for an empty model).
    ///
    /// # Errors
    /// When the load device has no candle device here (a CUDA device in a build without the
    /// `cuda` feature): [`crate::Error::Device`] inside candle's error.
    pub fn from_patcher(patcher: &ModelPatcher, mode: OpsMode) -> candle_core::Result<Self> {
        VarBuilder::from_source(&OpsSource::new(patcher), mode)
    }

    /// A builder whose layers fetch through `source` (shared: switch every layer to a clone of
    /// the model with [`OpsSource::set_patcher`]).
    ///
    /// # Errors
    /// As [`VarBuilder::from_patcher`].
    pub fn from_source(source: &OpsSource, mode: OpsMode) -> candle_core::Result<Self> {
        let patcher = source.patcher();
        let device = patcher.load_device().to_candle().map_err(to_candle)?;
        let dtype = mode
            .compute_dtype()
            .or(patcher.options().compute_dtype)
            .or_else(|| patcher.model().slots().first().map(|s| s.dtype()))
            .unwrap_or(Dtype::F32)
            .candle_storage_dtype();
        Ok(VarBuilder {
            ops: OpsBuilder::from_source(source, mode),
            device,
            dtype,
            rename: None,
            _borrow: PhantomData,
        })
    }
}

impl<'a> VarBuilder<'a> {
    /// The source every layer of this builder fetches through.
    pub fn source(&self) -> &OpsSource {
        self.ops.source()
    }

    /// The mode layers are built in.
    pub fn mode(&self) -> OpsMode {
        self.ops.mode()
    }

    /// The dotted prefix (empty at the root).
    pub fn prefix(&self) -> String {
        self.ops.prefix()
    }

    /// The same builder at the root (no prefix).
    pub fn root(&self) -> Self {
        self.with_ops(OpsBuilder::from_source(self.ops.source(), self.ops.mode()))
    }

    /// The same builder with the prefix set to `prefix` alone.
    pub fn set_prefix(&self, prefix: impl ToString) -> Self {
        self.root().pp(prefix)
    }

    /// A builder one name deeper: `cd` into `s`.
    pub fn push_prefix<S: ToString>(&self, s: S) -> Self {
        self.with_ops(self.ops.pp(s))
    }

    /// Short for [`VarBuilder::push_prefix`].
    pub fn pp<S: ToString>(&self, s: S) -> Self {
        self.push_prefix(s)
    }

    /// The device layers compute on and [`VarBuilder::get`] returns tensors on: the patcher's
    /// load device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The dtype [`VarBuilder::get`] returns and layers compute in.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The same builder with another dtype: layers built from it cast their weights to `dtype`
    /// at every forward ([`OpsMode::ManualCast`], or [`OpsMode::MixedPrecision`] when the builder
    /// was in that mode), and [`VarBuilder::get`] returns `dtype`. A dtype that is not a float
    /// leaves the mode as it is; `get` then converts with candle's `to_dtype`.
    pub fn to_dtype(&self, dtype: DType) -> Self {
        if dtype == self.dtype {
            return self.clone();
        }
        let mode = match Dtype::try_from(dtype) {
            Ok(compute) if compute.is_fp8() => self.ops.mode(),
            Ok(compute) => match self.ops.mode() {
                OpsMode::MixedPrecision { .. } => OpsMode::MixedPrecision { compute },
                _ => OpsMode::ManualCast { compute },
            },
            Err(_) => self.ops.mode(),
        };
        let mut ops = OpsBuilder::from_source(self.ops.source(), mode);
        if !self.ops.prefix().is_empty() {
            ops = ops.pp(self.ops.prefix());
        }
        VarBuilder {
            dtype,
            ..self.with_ops(ops)
        }
    }

    /// The same builder with another dtype (candle-nn's by-value spelling of
    /// [`VarBuilder::to_dtype`]).
    pub fn set_dtype(self, dtype: DType) -> Self {
        self.to_dtype(dtype)
    }

    /// A builder that looks every name up as `f(full name)`: `f` receives the prefixed name and
    /// returns the model's key. Renamings compose: the newest is applied first, as in candle-nn.
    ///
    /// candle-nn 0.11 prefixes the renamed name once more with the builder's prefix at the time
    /// of the call; the two agree for a builder renamed at the root, the usual case. Here the
    /// prefix is never applied twice.
    pub fn rename_f<F: Fn(&str) -> String + Sync + Send + 'static>(self, f: F) -> Self {
        let rename: Renamer = match self.rename.clone() {
            None => Arc::new(f),
            Some(older) => Arc::new(move |name: &str| older(&f(name))),
        };
        VarBuilder {
            rename: Some(rename),
            ..self
        }
    }

    /// The model key for `name` under this prefix, after renaming.
    pub fn key(&self, name: &str) -> String {
        let path = self.ops.key(name);
        match &self.rename {
            Some(f) => f(&path),
            None => path,
        }
    }

    /// Whether the model has a weight called `name` under this prefix (a weight, not a prefix:
    /// with only `a.b.weight` in the model, `contains_tensor("a")` is false).
    pub fn contains_tensor(&self, name: &str) -> bool {
        self.source()
            .patcher()
            .model()
            .index_of(&self.key(name))
            .is_some()
    }

    /// The parameter `name` of shape `s`, fetched through the patcher like any weight (the
    /// resident copy when current, else patched and cast now), in [`VarBuilder::dtype`], on
    /// [`VarBuilder::device`].
    ///
    /// The tensor is the caller's: it is not evicted and does not follow
    /// [`OpsSource::set_patcher`]. Reading it does not enter the forward order prefetch follows
    /// (a parameter read while building is not fetched by the forward).
    ///
    /// Handed straight to a layer constructor (`Linear::new`, `RmsNorm::new`, ...) it is adopted:
    /// the layer is managed on its key. Otherwise it counts in
    /// [`crate::weights::Model::held_outside`] (and the ledger) until this builder's source and
    /// every layer built from it are dropped — its own drop cannot be seen. Reading one weight
    /// again and again stays bounded: the second copy read in this dtype from this source is kept
    /// and returned by every later call (no fetch; two copies counted, not one per call). Only the
    /// last 4 096 tensors handed out can be adopted: an older one given to a constructor makes an
    /// owned layer and stays counted.
    ///
    /// # Errors
    /// [`crate::Error::UnknownWeight`] for a missing weight and [`crate::Error::ShapeMismatch`]
    /// for another shape (candle-nn: `CannotFindTensor`, `UnexpectedShape`), inside candle's error.
    pub fn get<S: Into<Shape>>(&self, s: S, name: &str) -> candle_core::Result<Tensor> {
        let weights = self.weights(name, s.into().dims(), None)?;
        super::held::get(&weights, self.dtype, &self.device, || self.read(&weights))
    }

    /// The parameter `name` of shape `s` as a managed handle: [`Param::fetch`] reads it at
    /// use (the resident copy when current, else patched, cast and streamed), so a model that
    /// keeps raw weights (a norm's scale, a learned embedding) keeps them under the manager.
    ///
    /// # Errors
    /// As [`VarBuilder::get`].
    pub fn get_managed<S: Into<Shape>>(&self, s: S, name: &str) -> candle_core::Result<Param> {
        let weights = self.weights(name, s.into().dims(), None)?;
        Ok(Param {
            weights,
            dtype: self.dtype,
        })
    }

    /// [`VarBuilder::get`]; the initialisation hint is ignored (weights come from the model: a
    /// missing one is an error, never initialised).
    pub fn get_with_hints<S: Into<Shape>>(
        &self,
        s: S,
        name: &str,
        _hints: candle_nn::Init,
    ) -> candle_core::Result<Tensor> {
        self.get(s, name)
    }

    /// [`VarBuilder::get`] in `dtype` instead of the builder's.
    ///
    /// # Errors
    /// As [`VarBuilder::get`].
    pub fn get_with_hints_dtype<S: Into<Shape>>(
        &self,
        s: S,
        name: &str,
        _hints: candle_nn::Init,
        dtype: DType,
    ) -> candle_core::Result<Tensor> {
        self.to_dtype(dtype).get(s, name)
    }

    /// The parameter `name` whatever its shape.
    ///
    /// # Errors
    /// [`crate::Error::UnknownWeight`] for a missing weight, inside candle's error.
    pub fn get_unchecked(&self, name: &str) -> candle_core::Result<Tensor> {
        let key = self.key(name);
        let shape = {
            let patcher = self.source().patcher();
            let slot = patcher.model().slot(&key).map_err(to_candle)?;
            slot.shape().to_vec()
        };
        let weights = self.ops.weights_at(key, &shape, None).map_err(to_candle)?;
        super::held::get(&weights, self.dtype, &self.device, || self.read(&weights))
    }

    /// [`VarBuilder::get_unchecked`] in `dtype`.
    ///
    /// # Errors
    /// As [`VarBuilder::get_unchecked`].
    pub fn get_unchecked_dtype(&self, name: &str, dtype: DType) -> candle_core::Result<Tensor> {
        self.to_dtype(dtype).get_unchecked(name)
    }

    /// The weights of a layer: `weight` (under this prefix, renamed) of exactly `shape`, and
    /// `bias` as `(name, len)` when given.
    pub(crate) fn weights(
        &self,
        weight: &str,
        shape: &[usize],
        bias: Option<(&str, usize)>,
    ) -> candle_core::Result<LayerWeights> {
        self.ops
            .weights_at(
                self.key(weight),
                shape,
                bias.map(|(name, len)| (self.key(name), len)),
            )
            .map_err(to_candle)
    }

    /// Reads a single weight outside the forward order, in the builder's dtype.
    fn read(&self, weights: &LayerWeights) -> candle_core::Result<Tensor> {
        let t = weight_outside_forward(weights, &self.device).map_err(to_candle)?;
        if t.dtype() == self.dtype {
            Ok(t)
        } else {
            t.to_dtype(self.dtype)
        }
    }

    fn with_ops(&self, ops: OpsBuilder) -> Self {
        VarBuilder {
            ops,
            device: self.device.clone(),
            dtype: self.dtype,
            rename: self.rename.clone(),
            _borrow: PhantomData,
        }
    }
}

/// A managed parameter ([`VarBuilder::get_managed`]): its key, fetched at every use.
#[derive(Debug, Clone)]
pub struct Param {
    weights: LayerWeights,
    dtype: DType,
}

impl Param {
    /// The parameter for a forward on `device`, in the builder's dtype: the resident copy when
    /// current, else patched, cast and moved now; recorded in the forward order like a layer's
    /// weight (so prefetch follows it).
    ///
    /// # Errors
    /// The fetch's errors (a device out of memory, patch math), with their type inside candle's.
    pub fn fetch(&self, device: &Device) -> candle_core::Result<Tensor> {
        let (t, _) = super::held::fetch(&self.weights, device)?;
        if t.dtype() == self.dtype {
            Ok(t)
        } else {
            t.to_dtype(self.dtype)
        }
    }

    /// The model key it reads.
    pub fn key(&self) -> &str {
        self.weights.weight_key()
    }

    /// Its shape.
    pub fn shape(&self) -> &[usize] {
        self.weights.weight_shape()
    }
}
