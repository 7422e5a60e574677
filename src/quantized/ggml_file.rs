//! candle's `ggml_file` (the format before GGUF) with [`QTensor`] handles: [`Content::read`]
//! reads the file with candle's reader and [`Content::remove`] hands out owned tensors (not
//! managed: a GGML file is read whole, as candle reads it). It exists so that a ported model
//! file with a `from_ggml` next to its `from_gguf` compiles with its `use` lines changed.

use std::collections::HashMap;

use candle_core::Device;

pub use candle_core::quantized::ggml_file::{HParams, VersionedMagic, Vocab};

use super::QTensor;

/// A GGML file's content: candle's, with [`QTensor`] handles.
#[derive(Debug)]
pub struct Content {
    /// The file's magic and version.
    pub magic: VersionedMagic,
    /// The hyper-parameters.
    pub hparams: HParams,
    /// The vocabulary.
    pub vocab: Vocab,
    /// The tensors, owned.
    pub tensors: HashMap<String, QTensor>,
    /// The device they were read to.
    pub device: Device,
}

impl Content {
    /// Reads a GGML file with candle's reader.
    ///
    /// # Errors
    /// candle's errors.
    pub fn read<R: std::io::Seek + std::io::Read>(
        reader: &mut R,
        device: &Device,
    ) -> candle_core::Result<Content> {
        let c = candle_core::quantized::ggml_file::Content::read(reader, device)?;
        Ok(Content {
            magic: c.magic,
            hparams: c.hparams,
            vocab: c.vocab,
            tensors: c
                .tensors
                .into_iter()
                .map(|(k, t)| (k, QTensor::from(t)))
                .collect(),
            device: c.device,
        })
    }

    /// Takes tensor `name` out.
    ///
    /// # Errors
    /// When there is no such tensor.
    pub fn remove(&mut self, name: &str) -> candle_core::Result<QTensor> {
        match self.tensors.remove(name) {
            Some(t) => Ok(t),
            None => candle_core::bail!("cannot find tensor with name '{name}'"),
        }
    }
}
