//! candle-transformers' `quantized_var_builder::VarBuilder` on a managed model: the same walk by
//! prefix (`pp`, `get`, `get_no_shape`, `contains_key`, `device`), made from a patcher instead of
//! a file, handing out [`QTensor`] handles that fetch through the manager at use.

use std::sync::Arc;

use candle_core::{Device, Shape};

use crate::ops::{to_candle, OpsSource};
use crate::patcher::ModelPatcher;
use crate::quantized::QTensor;

/// Walks a quantized model's weights by prefix, like candle-transformers' quantized
/// `VarBuilder`. Clones share the [`OpsSource`] ([`VarBuilder::source`]).
#[derive(Clone, Debug)]
pub struct VarBuilder {
    source: OpsSource,
    path: Vec<String>,
    device: Device,
}

impl VarBuilder {
    /// A builder on `patcher`'s model (read with
    /// [`Model::from_gguf`](crate::weights::Model::from_gguf), or any model).
    ///
    /// # Errors
    /// A load device with no candle device in this build, inside candle's error.
    pub fn from_patcher(patcher: &ModelPatcher) -> candle_core::Result<Self> {
        VarBuilder::from_source(&OpsSource::new(patcher))
    }

    /// A builder on a shared source: [`OpsSource::set_patcher`] switches every layer built from
    /// it.
    ///
    /// # Errors
    /// As [`VarBuilder::from_patcher`].
    pub fn from_source(source: &OpsSource) -> candle_core::Result<Self> {
        let device = crate::quantized::load_device(&source.patcher())?;
        Ok(VarBuilder {
            source: source.clone(),
            path: Vec::new(),
            device,
        })
    }

    /// The source every handle fetches through.
    pub fn source(&self) -> &OpsSource {
        &self.source
    }

    /// A builder one name deeper.
    pub fn pp<S: ToString>(&self, s: S) -> Self {
        let mut path = self.path.clone();
        path.push(s.to_string());
        VarBuilder {
            source: self.source.clone(),
            path,
            device: self.device.clone(),
        }
    }

    fn path(&self, name: &str) -> String {
        if self.path.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.path.join("."))
        }
    }

    /// The weight `name` under this prefix, which must have shape `s`.
    ///
    /// # Errors
    /// [`crate::Error::UnknownWeight`] for a missing weight and [`crate::Error::ShapeMismatch`]
    /// for another shape, inside candle's error.
    pub fn get<S: Into<Shape>>(&self, s: S, name: &str) -> candle_core::Result<Arc<QTensor>> {
        let path = self.path(name);
        let t = self.get_no_shape(name)?;
        let s: Shape = s.into();
        if t.shape() != &s {
            return Err(to_candle(crate::Error::ShapeMismatch {
                what: format!("`{path}` of `{}`", self.source.patcher().model().name()),
                expected: s.dims().to_vec(),
                got: t.shape().dims().to_vec(),
            }));
        }
        Ok(t)
    }

    /// The weight `name` under this prefix, whatever its shape.
    ///
    /// # Errors
    /// [`crate::Error::UnknownWeight`] for a missing weight, inside candle's error.
    pub fn get_no_shape(&self, name: &str) -> candle_core::Result<Arc<QTensor>> {
        crate::quantized::handle(&self.source, &self.path(name)).map(Arc::new)
    }

    /// The device layers compute on: the patcher's load device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Whether the model has a weight `key` under this prefix.
    pub fn contains_key(&self, key: &str) -> bool {
        self.source
            .patcher()
            .model()
            .index_of(&self.path(key))
            .is_some()
    }
}
