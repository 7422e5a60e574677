//! candle's `gguf_file` for managed models: a [`Content`] made from a [`ModelPatcher`] whose
//! [`Content::tensor`] hands out [`QTensor`] handles instead of reading the file.
//!
//! A ported model's `from_gguf(ct, &mut reader, &device)` keeps its signature: the reader is not
//! read (the model's weights are the patcher's), and `ct.metadata` is the file's metadata as
//! [`Model::from_gguf`](crate::weights::Model::from_gguf) read it. Candle's value types, writer and
//! the rest of its module are re-exported unchanged.

use std::collections::HashMap;

use candle_core::Device;

pub use candle_core::quantized::gguf_file::{
    write, TensorInfo, Value, ValueType, VersionedMagic, DEFAULT_ALIGNMENT,
};

use super::QTensor;
use crate::ops::{to_candle, OpsSource};
use crate::patcher::ModelPatcher;

/// A GGUF model's metadata and tensors, on a patcher: candle's `Content` with managed tensors.
#[derive(Debug)]
pub struct Content {
    /// The file's metadata (`general.architecture`, `llama.block_count`, ...); empty for a model
    /// not read from a GGUF file.
    pub metadata: HashMap<String, Value>,
    /// Each weight's format and shape (offsets are 0: the weights are the model's slots).
    pub tensor_infos: HashMap<String, TensorInfo>,
    /// Always 0 (kept for candle's field set).
    pub tensor_data_offset: u64,
    source: OpsSource,
}

impl Content {
    /// The content of `patcher`'s model: its GGUF metadata and every weight as a tensor info.
    pub fn from_patcher(patcher: &ModelPatcher) -> Content {
        Content::from_source(&OpsSource::new(patcher))
    }

    /// [`Content::from_patcher`] on a shared source: [`OpsSource::set_patcher`] then switches
    /// every layer built from it (to a LoRA clone, say).
    pub fn from_source(source: &OpsSource) -> Content {
        let patcher = source.patcher();
        let model = patcher.model();
        let metadata = model.gguf_metadata().cloned().unwrap_or_default();
        let tensor_infos = model
            .slots()
            .iter()
            .map(|s| {
                let ggml_dtype = s.quantized().unwrap_or_else(|| super::ggml_of(s.dtype()));
                let info = TensorInfo {
                    ggml_dtype,
                    shape: candle_core::Shape::from(s.shape().to_vec()),
                    offset: 0,
                };
                (s.name().to_string(), info)
            })
            .collect();
        Content {
            metadata,
            tensor_infos,
            tensor_data_offset: 0,
            source: source.clone(),
        }
    }

    /// The source every tensor handle fetches through.
    pub fn source(&self) -> &OpsSource {
        &self.source
    }

    /// A handle on weight `name` (candle's `Content::tensor`; `reader` is not read).
    ///
    /// # Errors
    /// [`crate::Error::UnknownWeight`] for a missing weight (ported code that falls back on an
    /// error, such as a tied output head, keeps working), and [`crate::Error::Device`] when
    /// `device` is not the patcher's load device; both inside candle's error.
    pub fn tensor<R: std::io::Seek + std::io::Read>(
        &self,
        _reader: &mut R,
        name: &str,
        device: &Device,
    ) -> candle_core::Result<QTensor> {
        let load = super::load_device(&self.source.patcher())?;
        if !load.same_device(device) {
            return Err(to_candle(crate::Error::Device {
                device: format!("{:?}", device.location()),
                reason: format!(
                    "tensor `{name}` is asked for on {:?}, but its model computes on {:?} (the patcher's load device)",
                    device.location(),
                    load.location()
                ),
            }));
        }
        super::handle(&self.source, name)
    }
}
