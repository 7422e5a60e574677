//! Reading models from and writing them to safetensors files.
//!
//! Files are memory-mapped and each float tensor is copied once into host memory (the offload
//! tier). fp8 E4M3 tensors become candle `F8E4M3`; fp8 E5M2 tensors, which candle cannot type,
//! are kept as `U8` bytes with [`Dtype::F8E5M2`]; f64 is stored as f32. Integer tensors (position
//! ids and similar buffers) are not weights: they are skipped and listed in
//! [`Model::skipped_tensors`]. Errors name the file and the tensor.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use safetensors::tensor::{Dtype as StDtype, TensorView};

use super::writer::Sink;
use super::{tensor_bytes, Clean, Model, Slot};
use crate::error::{Error, Result};
use crate::float::Dtype;
use crate::size::ByteSize;

pub(super) fn file_err(path: &Path, reason: impl Into<String>) -> Error {
    Error::File {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

pub(super) fn storage_of(st: StDtype) -> Option<(Dtype, DType)> {
    Some(match st {
        StDtype::F32 => (Dtype::F32, DType::F32),
        StDtype::F16 => (Dtype::F16, DType::F16),
        StDtype::BF16 => (Dtype::BF16, DType::BF16),
        StDtype::F64 => (Dtype::F64, DType::F64),
        StDtype::F8_E4M3 => (Dtype::F8E4M3FN, DType::F8E4M3),
        StDtype::F8_E5M2 => (Dtype::F8E5M2, DType::U8),
        _ => return None,
    })
}

/// The safetensors dtype a weight of storage dtype `d` is written as.
pub(crate) fn safetensors_dtype(d: Dtype) -> StDtype {
    match d {
        Dtype::F64 => StDtype::F64,
        Dtype::F32 => StDtype::F32,
        Dtype::F16 => StDtype::F16,
        Dtype::BF16 => StDtype::BF16,
        Dtype::F8E4M3FN => StDtype::F8_E4M3,
        Dtype::F8E5M2 => StDtype::F8_E5M2,
    }
}

/// Options for [`save_safetensors`].
#[derive(Debug, Clone, Default)]
pub struct SafetensorsOptions {
    /// String metadata written into the header.
    pub metadata: Option<HashMap<String, String>>,
}

/// The tensors of one safetensors file: float tensors in file order (in their candle storage
/// dtype, see the module docs), and the names of the others.
pub(crate) struct FileTensors {
    pub(crate) floats: Vec<(String, Tensor, Dtype)>,
    /// Integer tensors candle can hold (`U8`, `U32`, `I64`), as read.
    pub(crate) integers: Vec<(String, Tensor)>,
    /// Names of tensors of any other dtype.
    pub(crate) skipped: Vec<String>,
}

/// Refuses a shape candle cannot index: its element count, and the element count of every
/// trailing part of it (candle's contiguous strides), must fit in `usize` — a zero-element tensor
/// of shape `[0, 2³², 2³²]` is valid safetensors but has a stride of 2⁶⁴.
pub(super) fn check_shape(path: &Path, key: &str, dims: &[usize]) -> Result<()> {
    let mut acc: usize = 1;
    for &d in dims.iter().rev() {
        acc = acc.checked_mul(d).ok_or_else(|| {
            file_err(
                path,
                format!("tensor `{key}`: shape {dims:?} overflows the address space"),
            )
        })?;
    }
    Ok(())
}

/// Reads every tensor of `path` (see [`FileTensors`]) by positioned reads, each straight into
/// the buffer of its own element type that becomes its tensor: no memory map (a file truncated
/// while it is read is an [`Error::File`] naming file, tensor and byte range, never `SIGBUS`) and
/// no second copy (the peak is the tensors themselves). Errors name the file and the tensor.
pub(crate) fn read_file_tensors(path: &Path) -> Result<FileTensors> {
    let (wf, entries) = super::lazy::read_header(path)?;
    let mut out = FileTensors {
        floats: Vec::with_capacity(entries.len()),
        integers: Vec::new(),
        skipped: Vec::new(),
    };
    for e in entries {
        let Some((dtype, cdtype)) = storage_of(e.dtype) else {
            let int = match e.dtype {
                StDtype::U8 => Some(DType::U8),
                StDtype::U32 => Some(DType::U32),
                StDtype::I64 => Some(DType::I64),
                _ => None,
            };
            match int {
                Some(d) => {
                    let t = super::lazy::read_range(&wf, e.start, d, &e.shape, &e.key)?;
                    out.integers.push((e.key, t));
                }
                None => out.skipped.push(e.key),
            }
            continue;
        };
        // f64 is read as f64 and stored as f32 (`read_range` converts).
        let t = super::lazy::read_range(&wf, e.start, cdtype, &e.shape, &e.key)?;
        let dtype = if dtype == Dtype::F64 {
            Dtype::F32
        } else {
            dtype
        };
        out.floats.push((e.key, t, dtype));
    }
    Ok(out)
}

impl Model {
    /// Reads a model from one or more safetensors files (a sharded checkpoint). Keys must be
    /// unique across files.
    ///
    /// # Errors
    /// [`Error::File`] naming the file (and the tensor) when it cannot be read, is not valid
    /// safetensors, has a shape that cannot be indexed, or repeats a key;
    /// [`Error::BadWeight`] when an fp8 weight's per-tensor scale is not one finite, non-zero
    /// number.
    pub fn from_safetensors<P: AsRef<Path>>(name: impl Into<String>, paths: &[P]) -> Result<Model> {
        let name = name.into();
        let mut slots: Vec<Slot> = Vec::new();
        let mut index = HashMap::new();
        let mut skipped = Vec::new();
        for path in paths {
            let path = path.as_ref();
            let file = read_file_tensors(path)?;
            skipped.extend(file.integers.into_iter().map(|(k, _)| k));
            skipped.extend(file.skipped);
            for (key, t, dtype) in file.floats {
                if index.contains_key(&key) {
                    return Err(file_err(
                        path,
                        format!("tensor `{key}` also appears in an earlier file"),
                    ));
                }
                index.insert(key.clone(), slots.len());
                let bytes = ByteSize((t.elem_count() * dtype.size_in_bytes()) as u64);
                slots.push(Slot {
                    shape: t.dims().to_vec(),
                    name: key,
                    dtype,
                    clean: Clean::Host(t),
                    bytes,
                    quant: None,
                });
            }
        }
        Model::assemble(name, slots, index, skipped)
    }
}

/// Writes `(key, tensor, storage dtype)` triples to a safetensors file. Tensors must be in
/// `dtype.candle_storage_dtype()` (`U8` bytes for fp8 E5M2) and on any device.
pub fn save_safetensors<S: AsRef<str>>(
    path: impl AsRef<Path>,
    tensors: &[(S, Tensor, Dtype)],
    options: &SafetensorsOptions,
) -> Result<()> {
    save_safetensors_with_raw(path.as_ref(), tensors, &[], options)
}

/// A tensor written byte for byte: its safetensors dtype, shape and little-endian data (integer
/// buffers a [`Model`] skips, passed through by tools that rewrite a checkpoint).
pub(crate) struct RawTensor {
    pub(crate) name: String,
    pub(crate) dtype: StDtype,
    pub(crate) shape: Vec<usize>,
    pub(crate) data: Vec<u8>,
}

/// Reads the tensors `names` of a safetensors file as [`RawTensor`]s (any dtype). (The in-memory
/// merge the tests compare the streaming one against passes them through with it.)
#[cfg(test)]
pub(crate) fn read_raw_tensors(path: &Path, names: &[String]) -> Result<Vec<RawTensor>> {
    if names.is_empty() {
        return Ok(Vec::new());
    }
    let bytes = std::fs::read(path).map_err(|e| file_err(path, format!("cannot read: {e}")))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| file_err(path, format!("not a valid safetensors file: {e}")))?;
    names
        .iter()
        .map(|name| {
            let view = st
                .tensor(name)
                .map_err(|e| file_err(path, format!("tensor `{name}`: {e}")))?;
            Ok(RawTensor {
                name: name.clone(),
                dtype: view.dtype(),
                shape: view.shape().to_vec(),
                data: view.data().to_vec(),
            })
        })
        .collect()
}

/// [`save_safetensors`] plus tensors written byte for byte.
pub(crate) fn save_safetensors_with_raw<S: AsRef<str>>(
    path: &Path,
    tensors: &[(S, Tensor, Dtype)],
    raw: &[RawTensor],
    options: &SafetensorsOptions,
) -> Result<()> {
    let mut owned: Vec<(String, Vec<u8>, Vec<usize>, StDtype)> = Vec::with_capacity(tensors.len());
    for (key, t, dtype) in tensors {
        let key = key.as_ref();
        if t.dtype() != dtype.candle_storage_dtype() {
            return Err(file_err(
                path,
                format!("tensor `{key}` is {:?} but declared {dtype}", t.dtype()),
            ));
        }
        let t = t
            .to_device(&Device::Cpu)
            .map_err(|e| file_err(path, format!("tensor `{key}`: {e}")))?;
        owned.push((
            key.to_string(),
            tensor_bytes(&t)?,
            t.dims().to_vec(),
            safetensors_dtype(*dtype),
        ));
    }
    let mut views = Vec::with_capacity(owned.len());
    for (key, bytes, shape, dt) in &owned {
        let v = TensorView::new(*dt, shape.clone(), bytes)
            .map_err(|e| file_err(path, format!("tensor `{key}`: {e}")))?;
        views.push((key.as_str(), v));
    }
    for r in raw {
        let v = TensorView::new(r.dtype, r.shape.clone(), &r.data)
            .map_err(|e| file_err(path, format!("tensor `{}`: {e}", r.name)))?;
        views.push((r.name.as_str(), v));
    }
    safetensors::tensor::serialize_to_file(views, options.metadata.clone(), path)
        .map_err(|e| file_err(path, format!("cannot write: {e}")))
}

/// One tensor of a safetensors file as its header describes it.
#[derive(Debug, Clone)]
pub(crate) struct FileTensor {
    pub(crate) name: String,
    pub(crate) dtype: StDtype,
    pub(crate) shape: Vec<usize>,
    /// Absolute file offset of its first byte.
    start: u64,
    /// Bytes of data.
    pub(crate) len: usize,
}

impl FileTensor {
    /// The storage dtype a [`Model`] keeps this tensor in (`f64` is kept as `f32`), or `None`
    /// for a tensor that is not a float weight (a [`Model`] skips it).
    pub(crate) fn weight_dtype(&self) -> Option<Dtype> {
        storage_of(self.dtype).map(|(d, _)| if d == Dtype::F64 { Dtype::F32 } else { d })
    }

    /// Whether a [`Model`] keeps this float weight in the file's own dtype and bytes (all but
    /// `f64`, which it stores as `f32`).
    pub(crate) fn kept_as_stored(&self) -> bool {
        matches!(storage_of(self.dtype), Some((d, _)) if d != Dtype::F64)
    }
}

/// A safetensors file opened for positioned reads, one tensor at a time: only the header is
/// parsed up front, and reading a tensor touches only its bytes (no map of the file stays alive,
/// so memory holds one tensor, not the file).
pub(crate) struct TensorFile {
    path: std::path::PathBuf,
    file: std::fs::File,
    /// In file order (by data offset).
    tensors: Vec<FileTensor>,
}

impl TensorFile {
    /// Opens `path` and reads its header with positioned reads (the lazy reader's: each tensor
    /// checked against the file's length, dtype and shape; no map of the file, so a file
    /// truncated underneath is an error naming it, never a fault).
    pub(crate) fn open(path: &Path) -> Result<TensorFile> {
        let (wf, entries) = super::lazy::read_header(path)?;
        let file = wf
            .file
            .try_clone()
            .map_err(|e| file_err(path, format!("cannot open: {e}")))?;
        let tensors = entries
            .into_iter()
            .map(|e| FileTensor {
                name: e.key,
                dtype: e.dtype,
                shape: e.shape,
                start: e.start,
                len: (e.end - e.start) as usize,
            })
            .collect();
        Ok(TensorFile {
            path: path.to_path_buf(),
            file,
            tensors,
        })
    }

    /// The file's tensors in file order.
    pub(crate) fn tensors(&self) -> &[FileTensor] {
        &self.tensors
    }

    /// The data bytes of `t`, read at its offset.
    pub(crate) fn read_bytes(&self, t: &FileTensor) -> Result<Vec<u8>> {
        let mut bytes = vec![0u8; t.len];
        self.read_into(t, &mut bytes)?;
        Ok(bytes)
    }

    /// Fills `buf`, which must be `t.len` bytes, with the data bytes of `t`.
    pub(crate) fn read_into(&self, t: &FileTensor, buf: &mut [u8]) -> Result<()> {
        if buf.len() != t.len {
            return Err(file_err(
                &self.path,
                format!(
                    "tensor `{}`: {} bytes asked for, it has {}",
                    t.name,
                    buf.len(),
                    t.len
                ),
            ));
        }
        read_exact_at(&self.file, buf, t.start)
            .map_err(|e| file_err(&self.path, format!("tensor `{}`: cannot read: {e}", t.name)))
    }

    /// Where `t`'s bytes are: the open file, its path and the offset (for a file-to-file copy).
    pub(crate) fn source_of(&self, t: &FileTensor) -> super::writer::Source<'_> {
        super::writer::Source::Copy {
            file: &self.file,
            path: &self.path,
            offset: t.start,
        }
    }

    /// Float tensor `t` as [`Model::from_safetensors`] holds it: a CPU tensor in its storage
    /// dtype (`f64` converted to `f32`), bit for bit the same.
    ///
    /// # Errors
    /// [`Error::File`] naming the file and tensor when it cannot be read or is not a float.
    pub(crate) fn read_weight(&self, t: &FileTensor) -> Result<(Tensor, Dtype)> {
        let err = |reason: String| file_err(&self.path, format!("tensor `{}`: {reason}", t.name));
        let Some((dtype, cdtype)) = storage_of(t.dtype) else {
            return Err(err(format!("{:?} is not a float weight", t.dtype)));
        };
        let bytes = self.read_bytes(t)?;
        let tensor = Tensor::from_raw_buffer(&bytes, cdtype, &t.shape, &Device::Cpu)
            .map_err(|e| err(e.to_string()))?;
        drop(bytes);
        if dtype == Dtype::F64 {
            let tensor = tensor
                .to_dtype(DType::F32)
                .map_err(|e| err(e.to_string()))?;
            return Ok((tensor, Dtype::F32));
        }
        Ok((tensor, dtype))
    }
}

/// Fills `buf` from `file` at `offset` (a positioned read: the file's cursor is not used).
#[cfg(unix)]
pub(super) fn read_exact_at(
    file: &std::fs::File,
    buf: &mut [u8],
    offset: u64,
) -> std::io::Result<()> {
    std::os::unix::fs::FileExt::read_exact_at(file, buf, offset)
}

/// Fills `buf` from `file` at `offset`.
#[cfg(windows)]
pub(super) fn read_exact_at(
    file: &std::fs::File,
    mut buf: &mut [u8],
    mut offset: u64,
) -> std::io::Result<()> {
    while !buf.is_empty() {
        match std::os::windows::fs::FileExt::seek_read(file, buf, offset)? {
            0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            n => {
                buf = &mut buf[n..];
                offset += n as u64;
            }
        }
    }
    Ok(())
}

/// Hands the little-endian bytes of a CPU tensor in its candle dtype to `sink`: straight from
/// its storage where that already is those bytes (every float dtype on a little-endian machine),
/// else converted through one buffer of at most 1 MiB.
pub(crate) fn write_le_bytes(t: &Tensor, sink: &mut Sink<'_>) -> Result<()> {
    use candle_core::{CpuStorage, Storage};
    use half::slice::HalfFloatSliceExt;
    /// Bytes converted per piece on the buffered path.
    const PIECE: usize = 1 << 20;
    fn converted<T: Copy, const N: usize>(
        v: &[T],
        to_le: impl Fn(T) -> [u8; N],
        sink: &mut Sink<'_>,
    ) -> Result<()> {
        let mut buf = Vec::with_capacity(PIECE.min(v.len() * N));
        for part in v.chunks(PIECE / N) {
            buf.clear();
            part.iter().for_each(|&x| buf.extend_from_slice(&to_le(x)));
            sink(&buf)?;
        }
        Ok(())
    }
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    let unsupported = |what: &str| Error::UnsupportedDtype {
        dtype: format!("{:?}", t.dtype()),
        what: format!("writing tensor bytes ({what})"),
    };
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or_else(|| unsupported("strided"))?;
    let little = cfg!(target_endian = "little");
    match &*storage {
        Storage::Cpu(CpuStorage::F32(v)) if little => sink(bytemuck::cast_slice(&v[start..end])),
        Storage::Cpu(CpuStorage::F64(v)) if little => sink(bytemuck::cast_slice(&v[start..end])),
        Storage::Cpu(CpuStorage::F16(v)) if little => {
            sink(bytemuck::cast_slice(v[start..end].reinterpret_cast()))
        }
        Storage::Cpu(CpuStorage::BF16(v)) if little => {
            sink(bytemuck::cast_slice(v[start..end].reinterpret_cast()))
        }
        Storage::Cpu(CpuStorage::F32(v)) => converted(&v[start..end], f32::to_le_bytes, sink),
        Storage::Cpu(CpuStorage::F64(v)) => converted(&v[start..end], f64::to_le_bytes, sink),
        Storage::Cpu(CpuStorage::F16(v)) => converted(&v[start..end], half::f16::to_le_bytes, sink),
        Storage::Cpu(CpuStorage::BF16(v)) => {
            converted(&v[start..end], half::bf16::to_le_bytes, sink)
        }
        Storage::Cpu(CpuStorage::F8E4M3(v)) => converted(&v[start..end], |x| [x.to_bits()], sink),
        Storage::Cpu(CpuStorage::U8(v)) => sink(&v[start..end]),
        Storage::Cpu(_) => Err(unsupported("not a storage dtype")),
        _ => Err(unsupported("not on the CPU")),
    }
}
