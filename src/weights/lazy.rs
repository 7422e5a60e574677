//! The disk tier: models whose weights stay in their safetensors files until needed.
//!
//! [`Model::from_safetensors_lazy`] reads only the files' headers: each float tensor becomes a
//! slot whose clean weight is a [`DiskWeight`] — file, byte range, dtype and shape. Its host copy
//! is made when the weight is first asked for, through the model's [`HostTier`] (which books it
//! and evicts it again under pressure): a positioned read (`pread`) of exactly the tensor's bytes
//! into a buffer of the tensor's own element type, which becomes the candle tensor as it is — no
//! second copy, no memory map. A weight large enough to be pinned is read onto pages of its own
//! (`page.rs`: a page-aligned start, under two pages of slack), so it can be page-locked in place
//! whatever is pinned beside it. A file truncated or replaced underneath therefore gives an
//! [`Error::File`] naming the file, the tensor and the sizes (a memory-mapped read would die of
//! `SIGBUS`), and nothing else changes (I4).
//!
//! The bytes are read as they are stored (safetensors is little-endian, as every target candle
//! supports is); f64 tensors are the one exception: stored as f32, like an eager read, and the
//! read books both buffers while it converts.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{CpuStorage, DType, Tensor, WithDType};
use safetensors::tensor::{Dtype as StDtype, Metadata};

use super::host::HostTier;
use super::page::PageBuf;
use super::safetensors::{check_shape, file_err, storage_of};
use super::{Clean, Model, Slot};
use crate::error::{Error, Result};
use crate::float::Dtype;
use crate::size::ByteSize;

/// The largest header a safetensors file may have (the format's own limit).
const MAX_HEADER: u64 = 100_000_000;

/// An open safetensors file and where its data section starts.
#[derive(Debug)]
pub(crate) struct WeightFile {
    path: PathBuf,
    pub(super) file: File,
}

impl WeightFile {
    /// Opens `path` for positioned reads.
    ///
    /// # Errors
    /// [`Error::File`] naming the file when it cannot be opened.
    pub(super) fn open(path: &Path) -> Result<Arc<WeightFile>> {
        let file = File::open(path).map_err(|e| file_err(path, format!("cannot open: {e}")))?;
        Ok(Arc::new(WeightFile {
            path: path.to_path_buf(),
            file,
        }))
    }
}

/// One weight left in its file.
#[derive(Debug)]
pub(crate) struct DiskWeight {
    file: Arc<WeightFile>,
    /// Absolute offset of the tensor's bytes.
    start: u64,
    /// Length of the tensor's bytes in the file.
    len: u64,
    /// The candle dtype the bytes are read as (`F64` for f64, converted to f32 after).
    read_as: DType,
    shape: Vec<usize>,
    tier: HostTier,
    model_id: u64,
    model: Arc<str>,
    index: usize,
}

/// Reads `buf.len()` bytes at `offset`, or says how much the file holds now.
pub(super) fn read_at(wf: &WeightFile, buf: &mut [u8], offset: u64, key: &str) -> Result<()> {
    #[cfg(unix)]
    let r = {
        use std::os::unix::fs::FileExt;
        wf.file.read_exact_at(buf, offset)
    };
    #[cfg(windows)]
    let r = {
        use std::os::windows::fs::FileExt;
        let mut done = 0usize;
        loop {
            if done == buf.len() {
                break Ok(());
            }
            match wf.file.seek_read(&mut buf[done..], offset + done as u64) {
                Ok(0) => {
                    break Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof));
                }
                Ok(n) => done += n,
                Err(e) => break Err(e),
            }
        }
    };
    r.map_err(|e| {
        let end = offset + buf.len() as u64;
        let now = wf
            .file
            .metadata()
            .map(|m| format!("{} bytes", m.len()))
            .unwrap_or_else(|_| "unreadable".into());
        let what = if key.is_empty() {
            "the header".to_string()
        } else {
            format!("tensor `{key}`")
        };
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            file_err(
                &wf.path,
                format!(
                    "{what} needs bytes {offset}..{end} but the file is now {now}: it was truncated or replaced after it was opened"
                ),
            )
        } else {
            file_err(&wf.path, format!("{what}: reading bytes {offset}..{end}: {e}"))
        }
    })
}

/// Reads `n` elements of `T` at `offset` straight into a buffer that becomes the tensor: a
/// [`PageBuf`], so a weight large enough to be pinned sits on pages of its own and can be
/// page-locked in place without colliding with its neighbours' pins.
fn read_typed<T: WithDType>(
    wf: &WeightFile,
    offset: u64,
    shape: &[usize],
    key: &str,
) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let mut buf = PageBuf::<T>::zeroed(n);
    let v = buf.as_mut_slice();
    let len = std::mem::size_of_val(v);
    // SAFETY: every `T` read here (f32, f16, bf16, f64, u8, fp8 E4M3) is plain data for which
    // every bit pattern is a valid value; `v` is `n` initialised elements, so the slice is `len`
    // initialised bytes, borrowed mutably from `buf` for this call only.
    let bytes = unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), len) };
    read_at(wf, bytes, offset, key)?;
    buf.into_tensor(shape)
        .map_err(|e| file_err(&wf.path, format!("tensor `{key}`: {e}")))
}

/// [`read_typed`] for the element type of a `CpuStorage` variant.
fn read_as_variant<T: WithDType>(
    wf: &WeightFile,
    offset: u64,
    shape: &[usize],
    key: &str,
    _variant: fn(Vec<T>) -> CpuStorage,
) -> Result<Tensor> {
    read_typed::<T>(wf, offset, shape, key)
}

impl DiskWeight {
    /// Bytes the host copy holds.
    pub(crate) fn host_bytes(&self, dtype: Dtype) -> ByteSize {
        // Raw bytes (fp8 E5M2 codes, a quantized weight's blocks) are one byte each.
        let width = if self.read_as == DType::U8 {
            1
        } else {
            dtype.size_in_bytes()
        };
        ByteSize((self.shape.iter().product::<usize>() * width) as u64)
    }

    /// The host copy: held by the tier, or read now (booked there first).
    pub(crate) fn clean(&self, key: &str, dtype: Dtype) -> Result<Tensor> {
        let bytes = self.host_bytes(dtype);
        // While an f64 tensor converts, both buffers exist.
        let reserve = if self.read_as == DType::F64 {
            bytes.saturating_add(ByteSize(self.len))
        } else {
            bytes
        };
        self.tier.get(
            self.model_id,
            self.index,
            bytes,
            reserve,
            || format!("`{}` weight `{key}`", self.model),
            || self.read(key),
        )
    }

    /// A positioned read of the tensor into a new host buffer of its own type.
    fn read(&self, key: &str) -> Result<Tensor> {
        read_range(&self.file, self.start, self.read_as, &self.shape, key)
    }

    /// A weight of model `model` (id `model_id`, slot `index`) left in `file` at bytes
    /// `start..start + len`, read as `read_as` in `shape` through `tier`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        file: Arc<WeightFile>,
        start: u64,
        len: u64,
        read_as: DType,
        shape: Vec<usize>,
        tier: &HostTier,
        model: (u64, Arc<str>),
        index: usize,
    ) -> DiskWeight {
        DiskWeight {
            file,
            start,
            len,
            read_as,
            shape,
            tier: tier.clone(),
            model_id: model.0,
            model: model.1,
            index,
        }
    }
}

/// A positioned read of the tensor at `start` of `wf` (read as `read_as`, in `shape`) into a new
/// host buffer of its own type, which becomes the tensor (f64 is converted to f32).
pub(super) fn read_range(
    wf: &WeightFile,
    start: u64,
    read_as: DType,
    shape: &[usize],
    key: &str,
) -> Result<Tensor> {
    let t = match read_as {
        DType::F32 => read_typed::<f32>(wf, start, shape, key)?,
        DType::F16 => read_typed::<half::f16>(wf, start, shape, key)?,
        DType::BF16 => read_typed::<half::bf16>(wf, start, shape, key)?,
        DType::U8 => read_typed::<u8>(wf, start, shape, key)?,
        DType::U32 => read_typed::<u32>(wf, start, shape, key)?,
        DType::I64 => read_typed::<i64>(wf, start, shape, key)?,
        // candle's own `float8::F8E4M3` (a `float8` version we do not depend on), named by
        // inference from its storage variant.
        DType::F8E4M3 => read_as_variant(wf, start, shape, key, CpuStorage::F8E4M3)?,
        DType::F64 => read_typed::<f64>(wf, start, shape, key)?
            .to_dtype(DType::F32)
            .map_err(|e| file_err(&wf.path, format!("tensor `{key}`: {e}")))?,
        other => {
            return Err(Error::UnsupportedDtype {
                dtype: format!("{other:?}"),
                what: format!("reading `{key}` from {}", wf.path.display()),
            })
        }
    };
    Ok(t)
}

/// One tensor of a file's header.
pub(super) struct Entry {
    pub(super) key: String,
    pub(super) dtype: StDtype,
    pub(super) shape: Vec<usize>,
    pub(super) start: u64,
    pub(super) end: u64,
}

/// Opens `path` and reads its header with positioned reads: the tensors in file order, each
/// checked against the file's length and its dtype and shape.
pub(super) fn read_header(path: &Path) -> Result<(Arc<WeightFile>, Vec<Entry>)> {
    let file = File::open(path).map_err(|e| file_err(path, format!("cannot open: {e}")))?;
    let wf = Arc::new(WeightFile {
        path: path.to_path_buf(),
        file,
    });
    let file_len = wf
        .file
        .metadata()
        .map_err(|e| file_err(path, format!("cannot stat: {e}")))?
        .len();
    if file_len < 8 {
        return Err(file_err(
            path,
            format!("not a valid safetensors file: {file_len} bytes, shorter than its header size"),
        ));
    }
    let mut n = [0u8; 8];
    read_at(&wf, &mut n, 0, "")?;
    let n = u64::from_le_bytes(n);
    if n > MAX_HEADER || 8 + n > file_len {
        return Err(file_err(
            path,
            format!("not a valid safetensors file: a header of {n} bytes in a file of {file_len}"),
        ));
    }
    let mut header = vec![0u8; n as usize];
    read_at(&wf, &mut header, 8, "")?;
    let meta: Metadata = serde_json::from_slice(&header)
        .map_err(|e| file_err(path, format!("not a valid safetensors file: {e}")))?;
    let data = 8 + n;
    let mut entries: Vec<Entry> = Vec::new();
    for (key, info) in meta.tensors() {
        check_shape(path, &key, &info.shape)?;
        let (s, e) = (info.data_offsets.0 as u64, info.data_offsets.1 as u64);
        let numel: u128 = info.shape.iter().map(|&d| d as u128).product();
        let want = numel * info.dtype.bitsize() as u128 / 8;
        if e < s || u128::from(e - s) != want {
            return Err(file_err(
                path,
                format!(
                    "tensor `{key}`: offsets {s}..{e} do not hold {:?} {:?} ({want} bytes)",
                    info.dtype, info.shape
                ),
            ));
        }
        if data + e > file_len {
            return Err(file_err(
                path,
                format!(
                    "tensor `{key}` needs bytes {}..{} but the file is {file_len} bytes",
                    data + s,
                    data + e
                ),
            ));
        }
        entries.push(Entry {
            key,
            dtype: info.dtype,
            shape: info.shape.clone(),
            start: data + s,
            end: data + e,
        });
    }
    // File order, as an eager read orders them (zero-sized tensors by name).
    entries.sort_by(|a, b| (a.start, a.end, &a.key).cmp(&(b.start, b.end, &b.key)));
    Ok((wf, entries))
}

impl Model {
    /// Reads a model *lazily* from one or more safetensors files: only the headers are read now;
    /// each weight is read from its file when first needed, and its host copy is held by `tier`
    /// within its budget, evicted under pressure and read again when needed (the disk tier,
    /// docs/ARCHITECTURE.md §3). Keys must be unique across files. Outputs are bit-identical to
    /// a model read with [`Model::from_safetensors`] (I3).
    ///
    /// # Errors
    /// [`Error::File`] naming the file (and the tensor) when it cannot be opened, its header is
    /// not valid safetensors, a tensor's bytes lie beyond its end or do not match its dtype and
    /// shape, or a key repeats; [`Error::BadWeight`] for an unusable fp8 scale. Later reads fail
    /// with [`Error::File`] naming the file and the tensor when the file changed underneath.
    pub fn from_safetensors_lazy<P: AsRef<Path>>(
        name: impl Into<String>,
        paths: &[P],
        tier: &HostTier,
    ) -> Result<Model> {
        let name = name.into();
        let id = super::next_model_id();
        let shared_name: Arc<str> = Arc::from(name.as_str());
        let mut slots: Vec<Slot> = Vec::new();
        let mut index = HashMap::new();
        let mut skipped = Vec::new();
        for path in paths {
            let path = path.as_ref();
            let (wf, entries) = read_header(path)?;
            for e in entries {
                let Some((dtype, read_as)) = storage_of(e.dtype) else {
                    skipped.push(e.key);
                    continue;
                };
                if index.contains_key(&e.key) {
                    return Err(file_err(
                        path,
                        format!("tensor `{}` also appears in an earlier file", e.key),
                    ));
                }
                let dtype = if dtype == Dtype::F64 {
                    Dtype::F32
                } else {
                    dtype
                };
                let i = slots.len();
                index.insert(e.key.clone(), i);
                let disk = DiskWeight {
                    file: Arc::clone(&wf),
                    start: e.start,
                    len: e.end - e.start,
                    read_as,
                    shape: e.shape.clone(),
                    tier: tier.clone(),
                    model_id: id,
                    model: Arc::clone(&shared_name),
                    index: i,
                };
                let bytes = disk.host_bytes(dtype);
                slots.push(Slot {
                    name: e.key,
                    shape: e.shape,
                    dtype,
                    clean: Clean::Disk(Box::new(disk)),
                    bytes,
                    quant: None,
                });
            }
        }
        let size: ByteSize = slots.iter().map(|s| s.bytes).sum();
        tier.register_model(id, size);
        let model = Model::assemble_with_id(id, name, slots, index, skipped, Some(tier.clone()));
        if model.is_err() {
            tier.forget_model(id);
        }
        model
    }
}
