//! [`Managed`]: any candle model, unchanged, under the memory manager at whole-model granularity.
//!
//! For models nobody will port to [`crate::nn`]: the engine gives a constructor closure taking a
//! candle-nn [`VarBuilder`](candle_nn::VarBuilder) — `BertModel::load`, say — and the model's
//! weights as a [`ModelPatcher`]. The model is *whole* ([`Model::is_whole`]): every load makes
//! every weight resident (under `--novram` too: like ComfyUI's modules that cannot cast their
//! weights, it cannot stream) and eviction unloads it completely. Its module is built from the
//! resident copies themselves, through a candle-nn backend of ours that hands out the patched,
//! cast tensors of the load — no copy — so the module's bytes are the bytes in the ledger.
//!
//! A quantized (GGUF) model goes through [`Managed::quantized`] instead: its constructor gets a
//! [`crate::quantized::gguf_file::Content`] over the patcher, as candle-transformers' quantized
//! models take one, and its tensors are the resident copies.
//!
//! [`Managed::module`] builds the module on first use after a load and keeps it while the
//! residency is unchanged; when the manager evicts the model (or a clone with other patches is
//! loaded in its place) the module is dropped at the end of that manager call, and the next
//! [`Managed::module`] after the next load builds it again. Clones work: [`Managed::with_patcher`]
//! gives the same constructor another patcher of the same model (a LoRA clone), whose module
//! reflects its patches.
//!
//! What is not counted: bytes the constructor allocates itself beyond the tensors it is given
//! (a transposed copy, a buffer). Handles to the module ([`Arc<M>`]) that the engine keeps past
//! an eviction keep its tensors alive; drop them when the forward is done.
//!
//! Complexity: [`Managed::module`] is O(1) while the module is current; building it costs the
//! constructor plus one resident-copy lookup per tensor it asks for.

use std::any::Any;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use candle_core::{DType, Device, Shape, Tensor};

use crate::error::{Error, Result};
use crate::patcher::ModelPatcher;
use crate::weights::Model;

/// The constructor of a managed module, on the patcher it is built for.
type Build<M> = dyn Fn(&ModelPatcher) -> candle_core::Result<M> + Send + Sync;

/// A candle model of type `M` built from a [`ModelPatcher`]'s resident weights on load and dropped
/// on eviction. See the [module docs](self).
pub struct Managed<M> {
    patcher: ModelPatcher,
    build: Arc<Build<M>>,
}

impl<M> Clone for Managed<M> {
    fn clone(&self) -> Self {
        Managed {
            patcher: self.patcher.clone(),
            build: Arc::clone(&self.build),
        }
    }
}

impl<M> std::fmt::Debug for Managed<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Managed")
            .field("patcher", &self.patcher)
            .finish()
    }
}

impl<M: Send + Sync + 'static> Managed<M> {
    /// Puts the model of `patcher` under the manager whole, with `build` as its constructor
    /// (called with a candle-nn `VarBuilder` over the resident weights).
    pub fn new(
        patcher: ModelPatcher,
        build: impl Fn(candle_nn::VarBuilder<'static>) -> candle_core::Result<M> + Send + Sync + 'static,
    ) -> Managed<M> {
        patcher.model().set_whole(true);
        let build = move |p: &ModelPatcher| build(resident_var_builder(p)?);
        Managed {
            patcher,
            build: Arc::new(build),
        }
    }

    /// Puts a quantized (GGUF) model under the manager whole: `build` gets a
    /// [`gguf_file::Content`](crate::quantized::gguf_file::Content) over `patcher` — what
    /// candle-transformers' quantized models take (`ModelWeights::from_gguf(ct, &mut reader,
    /// &device)`, with their `use` lines pointed at [`crate::quantized`]) — whose tensors are the
    /// resident copies (quantized blocks stay candle `QTensor`s; patched weights are used dense).
    pub fn quantized(
        patcher: ModelPatcher,
        build: impl Fn(crate::quantized::gguf_file::Content) -> candle_core::Result<M>
            + Send
            + Sync
            + 'static,
    ) -> Managed<M> {
        patcher.model().set_whole(true);
        let build =
            move |p: &ModelPatcher| build(crate::quantized::gguf_file::Content::from_patcher(p));
        Managed {
            patcher,
            build: Arc::new(build),
        }
    }

    /// The same constructor over `patcher`, another patcher of the same model (a clone with its
    /// own patches, say).
    ///
    /// # Errors
    /// [`Error::UnknownWeight`] when `patcher` is on another model.
    pub fn with_patcher(&self, patcher: ModelPatcher) -> Result<Managed<M>> {
        if !patcher.is_clone(&self.patcher) {
            return Err(Error::UnknownWeight {
                model: patcher.model().name().to_string(),
                key: format!(
                    "(any: this managed module is built from model `{}`)",
                    self.patcher.model().name()
                ),
            });
        }
        Ok(Managed {
            patcher,
            build: Arc::clone(&self.build),
        })
    }

    /// The patcher to load ([`crate::loader::MemoryManager::load_models_gpu`]) and to add patches
    /// to.
    pub fn patcher(&self) -> &ModelPatcher {
        &self.patcher
    }

    /// A mutable patcher (to add patches before loading); the module is rebuilt after the next
    /// load.
    pub fn patcher_mut(&mut self) -> &mut ModelPatcher {
        &mut self.patcher
    }

    /// The model.
    pub fn model(&self) -> &Arc<Model> {
        self.patcher.model()
    }

    /// Whether the module is built and current (the model is loaded for this patcher and has not
    /// changed since).
    pub fn is_built(&self) -> bool {
        self.current().is_some()
    }

    fn key(&self) -> u64 {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.patcher.residency_signature().hash(&mut h);
        h.finish()
    }

    fn current(&self) -> Option<Arc<M>> {
        self.model()
            .derived(self.key())
            .and_then(|v| v.downcast::<M>().ok())
    }

    /// The module, built from the resident weights on first use after a load.
    ///
    /// # Errors
    /// [`Error::NotLoaded`] when not every weight is resident and current for this patcher (load
    /// it first); the constructor's error, wrapped.
    pub fn module(&self) -> Result<Arc<M>> {
        if let Some(m) = self.current() {
            return Ok(m);
        }
        let model = self.model();
        let generation = model.residency_generation();
        if (0..model.len()).any(|i| self.patcher.resident_weight(i).is_none()) {
            return Err(Error::NotLoaded {
                model: model.name().to_string(),
            });
        }
        let module = Arc::new((self.build)(&self.patcher).map_err(|e| {
            Error::tensor(
                format!("building the managed module of `{}`", model.name()),
                e,
            )
        })?);
        let value: Arc<dyn Any + Send + Sync> = module.clone();
        // A replaced (or refused, when the residency changed meanwhile) value drops here, outside
        // every lock.
        drop(model.set_derived(generation, self.key(), value));
        Ok(module)
    }
}

/// A candle-nn `VarBuilder` over `patcher`'s resident copies, in the dtype and on the device of
/// the first one (every weight is resident: [`Managed::module`] checked).
fn resident_var_builder(
    patcher: &ModelPatcher,
) -> candle_core::Result<candle_nn::VarBuilder<'static>> {
    let model = patcher.model();
    let first = (0..model.len()).find_map(|i| patcher.resident_tensor(i));
    let (dtype, device) = first.map_or((DType::F32, Device::Cpu), |t| {
        (t.dtype(), t.device().clone())
    });
    let backend = ResidentBackend {
        patcher: patcher.clone(),
    };
    Ok(candle_nn::VarBuilder::from_backend(
        Box::new(backend),
        dtype,
        device,
    ))
}

/// A candle-nn backend over a patcher's resident copies: `get` returns the resident tensor of the
/// name, as loaded (patched and cast), without copying it.
struct ResidentBackend {
    patcher: ModelPatcher,
}

impl ResidentBackend {
    fn resident(&self, name: &str) -> candle_core::Result<Tensor> {
        let model = self.patcher.model();
        let index = model.index_of(name).ok_or_else(|| {
            candle_core::Error::Msg(format!("model `{}` has no weight `{name}`", model.name()))
        })?;
        self.patcher.resident_tensor(index).ok_or_else(|| {
            candle_core::Error::Msg(format!(
                "weight `{name}` of `{}` is not resident (the model was evicted while its module was built)",
                model.name()
            ))
        })
    }

    fn to(t: Tensor, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        let t = if t.dtype() == dtype {
            t
        } else {
            t.to_dtype(dtype)?
        };
        if t.device().same_device(dev) {
            Ok(t)
        } else {
            t.to_device(dev)
        }
    }
}

impl candle_nn::var_builder::SimpleBackend for ResidentBackend {
    fn get(
        &self,
        s: Shape,
        name: &str,
        _h: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let t = self.resident(name)?;
        if t.shape() != &s {
            return Err(candle_core::Error::UnexpectedShape {
                msg: format!("shape mismatch for {name}"),
                expected: s,
                got: t.shape().clone(),
            }
            .bt());
        }
        Self::to(t, dtype, dev)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        Self::to(self.resident(name)?, dtype, dev)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.patcher.model().index_of(name).is_some()
    }
}
