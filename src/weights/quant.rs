//! Quantized weights: models read from GGUF files, whose weights stay in GGML's block formats
//! (`Q4_0`, `Q8_0`, `Q4K`, `Q6K`, ...) in host memory, on the device and on the bus.
//!
//! A quantized slot's clean tensor is its **block bytes**: a `U8` host tensor of exactly the
//! bytes the file stores, which every tier handles as it handles any tensor (the host tier's
//! ledger, pins in place, the staging pool, the transfer lanes, prefetch): sizes in the ledger,
//! plans and reports are the block bytes, exact. Where a weight is used it becomes candle's
//! `QTensor` on the load device ([`qtensor_from_bytes`]); a resident copy is kept as one
//! (`ResidentWeight::Quantized`). GGUF's dense tensors (F32, F16, BF16: norms, some embeddings)
//! become ordinary dense slots.
//!
//! Reading is by positioned reads only (`gguf.rs` for the header): never a memory map, so a file
//! truncated underneath is an [`Error::File`] naming file, tensor and byte range.
//!
//! A file loads only if every weight it makes can be used: besides the header's checks, a tensor
//! candle's quantized kernels cannot run is refused at load (`Q4_1`, `Q5_0` and `Q5_1` rows of
//! an odd number of blocks: candle's dot product asserts an even count and the panic poisons its
//! matmul pool), a stacked-expert tensor must be its expert count of non-empty experts (so the
//! count is bounded by the file before anything is sized by it), and every weight name — the
//! file's and the generated expert keys — reaches exactly one weight.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::{DType, Device, Tensor};

use super::gguf::read_gguf_header;
use super::host::HostTier;
use super::lazy::{read_range, DiskWeight};
use super::safetensors::file_err;
use super::{Clean, Model, Slot};
use crate::error::{Error, Result};
use crate::float::Dtype;
use crate::size::ByteSize;

/// A GGUF file's metadata: keys (`general.architecture`, `llama.block_count`, ...) to candle's
/// `gguf_file::Value`s.
pub type GgufMetadata = HashMap<String, Value>;

/// The bytes a tensor of `shape` takes in GGML format `ggml`: `None` when its last dimension is
/// not a whole number of blocks or the size overflows.
pub fn block_bytes(ggml: GgmlDType, shape: &[usize]) -> Option<u64> {
    let block = ggml.block_size() as u64;
    let row = *shape.last()? as u64;
    if !row.is_multiple_of(block) {
        return None;
    }
    let numel = shape
        .iter()
        .try_fold(1u64, |n, &d| n.checked_mul(d as u64))?;
    (numel / block).checked_mul(ggml.type_size() as u64)
}

/// The dense dtype a GGUF tensor of format `ggml` is a slot of, when it is not block-quantized.
fn dense_dtype(ggml: GgmlDType) -> Option<(Dtype, DType)> {
    match ggml {
        GgmlDType::F32 => Some((Dtype::F32, DType::F32)),
        GgmlDType::F16 => Some((Dtype::F16, DType::F16)),
        GgmlDType::BF16 => Some((Dtype::BF16, DType::BF16)),
        _ => None,
    }
}

/// candle's `QTensor` of format `ggml` and `shape` on `device` from `blocks`, a `U8` tensor of
/// its block bytes (on the host, or on `device` for the simulated GPU, which computes on the
/// host). The bytes are copied into the QTensor's own storage (candle's block types need their
/// alignment, which a byte buffer does not promise).
///
/// # Errors
/// [`Error::BadWeight`] naming model and key when the byte count is not the shape's; candle's
/// errors of the upload.
pub(crate) fn qtensor_from_bytes(
    blocks: &Tensor,
    ggml: GgmlDType,
    shape: &[usize],
    device: &Device,
    what: (&str, &str),
) -> Result<QTensor> {
    let bad = |reason: String| Error::BadWeight {
        model: what.0.to_string(),
        key: what.1.to_string(),
        reason,
    };
    let want = block_bytes(ggml, shape).ok_or_else(|| {
        bad(format!(
            "{shape:?} is not a whole number of {ggml:?} blocks"
        ))
    })?;
    if blocks.dtype() != DType::U8 || blocks.elem_count() as u64 != want {
        return Err(bad(format!(
            "{} {:?} elements are not the {want} block bytes of {ggml:?} {shape:?}",
            blocks.elem_count(),
            blocks.dtype()
        )));
    }
    let ctx = |e| {
        Error::tensor(
            format!("`{}` of `{}`: building its QTensor", what.1, what.0),
            e,
        )
    };
    // On a CUDA device the blocks are read back below: a synchronizing copy, checked on every
    // device so the simulated GPU's tests find a lock held across it.
    crate::lock::check_wait("a read-back of quantized blocks (candle `to_vec1`)");
    let flat = blocks.flatten_all().map_err(ctx)?;
    let (storage, layout) = flat.storage_and_layout();
    let candle_core::Storage::Cpu(candle_core::CpuStorage::U8(bytes)) = &*storage else {
        drop(storage);
        // A weight on a CUDA device: back through the host (candle builds its quantized CUDA
        // storage from host bytes only).
        let host = flat.to_vec1::<u8>().map_err(ctx)?;
        return build(&host, ggml, shape, device).map_err(ctx);
    };
    let Some((start, end)) = layout.contiguous_offsets() else {
        return Err(bad("its block bytes are not contiguous".into()));
    };
    build(&bytes[start..end], ggml, shape, device).map_err(ctx)
}

/// Builds the QTensor from `bytes`, copying them to an 8-byte aligned buffer first when they are
/// not (candle's block structs hold f16/f32 fields and are read in place).
pub(crate) fn build(
    bytes: &[u8],
    ggml: GgmlDType,
    shape: &[usize],
    device: &Device,
) -> candle_core::Result<QTensor> {
    let storage = if bytes.as_ptr().align_offset(8) == 0 {
        QStorage::from_data(std::borrow::Cow::Borrowed(bytes), device, ggml)?
    } else {
        let mut aligned = vec![0u64; bytes.len().div_ceil(8)];
        bytemuck::cast_slice_mut::<u64, u8>(&mut aligned)[..bytes.len()].copy_from_slice(bytes);
        let view = &bytemuck::cast_slice::<u64, u8>(&aligned)[..bytes.len()];
        QStorage::from_data(std::borrow::Cow::Borrowed(view), device, ggml)?
    };
    QTensor::new(storage, shape)
}

/// The GGML formats whose rows candle's CPU dot products take only as an even number of blocks:
/// `vec_dot` of `Q4_1`, `Q5_0` and `Q5_1` (candle-core 0.11's `k_quants.rs`) asserts it, and the
/// panic, raised inside candle's matmul pool, poisons the pool's lock for every later quantized
/// matmul in the process. The other formats' kernels take any whole number of blocks.
fn needs_even_blocks(ggml: GgmlDType) -> bool {
    matches!(ggml, GgmlDType::Q4_1 | GgmlDType::Q5_0 | GgmlDType::Q5_1)
}

/// Refuses a tensor whose rows candle's quantized kernels cannot run (the header has already
/// refused rows that are not whole blocks and dimensions of 0).
fn check_kernel_shape(path: &Path, e: &super::gguf::GgufEntry) -> Result<()> {
    let row = e.shape.last().copied().unwrap_or(0);
    let blocks = row / e.ggml.block_size();
    if needs_even_blocks(e.ggml) && !blocks.is_multiple_of(2) {
        return Err(file_err(
            path,
            format!(
                "tensor `{}` ({:?} {:?}): its rows of {row} elements are {blocks} blocks of {}, but candle's {:?} kernels need an even number of blocks per row",
                e.name,
                e.ggml,
                e.shape,
                e.ggml.block_size(),
                e.ggml
            ),
        ));
    }
    Ok(())
}

/// One GGUF tensor as a slot: dense formats as dense weights, block formats as block bytes.
struct Planned {
    /// The stack (its index in the plan's stacks) and the expert this slot is, for a slot planned
    /// from a stacked-expert tensor.
    expert_of: Option<(usize, usize)>,
    key: String,
    shape: Vec<usize>,
    dtype: Dtype,
    quant: Option<GgmlDType>,
    read_as: DType,
    read_shape: Vec<usize>,
    start: u64,
    len: u64,
}

/// Whether a GGUF tensor holds a layer's experts stacked on its first dimension: llama.cpp
/// names them `…_exps` (`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`, `ffn_gate_up_exps`),
/// `[n_expert, rows, cols]`.
fn is_stacked_experts(e: &super::gguf::GgufEntry) -> bool {
    e.shape.len() == 3 && e.shape[0] > 0 && e.name.contains("_exps")
}

/// The key of expert `expert` of the stacked tensor `name`: `blk.0.ffn_gate_exps.weight` →
/// `blk.0.ffn_gate_exps.3.weight`, as Mixtral's per-expert tensors are named
/// (`blk.0.ffn_gate.3.weight`).
pub fn expert_key(name: &str, expert: usize) -> String {
    match name.strip_suffix(".weight") {
        Some(stem) => format!("{stem}.{expert}.weight"),
        None => format!("{name}.{expert}"),
    }
}

/// The stacked-expert tensors of a file, by name.
type Stacks = Vec<(String, Stack)>;

/// The slots of a GGUF file's tensors (one per expert for a stacked-expert tensor) and its
/// stacks.
///
/// # Errors
/// [`Error::File`] naming the file and the tensor for a tensor candle's kernels cannot run
/// ([`needs_even_blocks`]), a stacked-expert tensor whose bytes are not its expert count of
/// non-empty experts, and a weight name used twice: an expert's generated key
/// ([`expert_key`]) that is also another tensor's name or another stack's expert, or a stacked
/// tensor's name that is also an expert's key (each name must reach one weight).
fn plan(path: &Path, entries: Vec<super::gguf::GgufEntry>) -> Result<(Vec<Planned>, Stacks)> {
    let mut planned = Vec::new();
    let mut stacks: Stacks = Vec::new();
    for e in entries {
        check_kernel_shape(path, &e)?;
        let len = e.end - e.start;
        let slot = |key: String, shape: Vec<usize>, start: u64, len: u64| -> Result<Planned> {
            let (dtype, quant, read_as, read_shape) = match dense_dtype(e.ggml) {
                Some((d, c)) => (d, None, c, shape.clone()),
                None => {
                    let n = usize::try_from(len)
                        .map_err(|_| file_err(path, format!("tensor `{key}`: {len} bytes")))?;
                    (Dtype::F32, Some(e.ggml), DType::U8, vec![n])
                }
            };
            Ok(Planned {
                expert_of: None,
                key,
                shape,
                dtype,
                quant,
                read_as,
                read_shape,
                start,
                len,
            })
        };
        if !is_stacked_experts(&e) {
            planned.push(slot(e.name.clone(), e.shape.clone(), e.start, len)?);
            continue;
        }
        // One slot per expert: its byte range of the stacked tensor, read, streamed, cached and
        // evicted alone; the stack keeps the layer's view of the whole.
        // Each expert takes at least one byte of the tensor's (checked against the file's length
        // by the header): the expert count is bounded by the file before anything is sized by it.
        let n = e.shape[0];
        let each = block_bytes(e.ggml, &e.shape[1..])
            .filter(|&b| b > 0 && b.checked_mul(n as u64) == Some(len))
            .ok_or_else(|| {
                file_err(
                    path,
                    format!(
                        "tensor `{}`: its {len} bytes are not {n} non-empty experts of {:?} {:?}",
                        e.name,
                        e.ggml,
                        &e.shape[1..]
                    ),
                )
            })?;
        let stack = stacks.len();
        let mut experts = Vec::with_capacity(n);
        for x in 0..n {
            experts.push(planned.len());
            let mut p = slot(
                expert_key(&e.name, x),
                e.shape[1..].to_vec(),
                e.start + x as u64 * each,
                each,
            )?;
            p.expert_of = Some((stack, x));
            planned.push(p);
        }
        stacks.push((
            e.name.clone(),
            Stack {
                experts,
                shape: e.shape.clone(),
                ggml: e.ggml,
            },
        ));
    }
    check_names(path, &planned, &stacks)?;
    Ok((planned, stacks))
}

/// Refuses a plan in which one name would reach two weights: two slots of one key (a tensor
/// named as another stack's generated expert, `blk.0.ffn_gate_exps.1.weight` beside
/// `blk.0.ffn_gate_exps.weight`), or a stacked tensor named as an expert's key, which the stack
/// would hide from every layer that asks for the expert by name.
fn check_names(path: &Path, planned: &[Planned], stacks: &Stacks) -> Result<()> {
    let what = |p: &Planned| match p.expert_of {
        Some((s, x)) => format!("expert {x} of the stacked tensor `{}`", stacks[s].0),
        None => "a tensor of the file".to_string(),
    };
    let mut seen: HashMap<&str, &Planned> = HashMap::with_capacity(planned.len());
    for p in planned {
        if let Some(first) = seen.insert(p.key.as_str(), p) {
            return Err(file_err(
                path,
                format!(
                    "weight `{}` is named twice: it is {} and {}",
                    p.key,
                    what(first),
                    what(p)
                ),
            ));
        }
    }
    for (name, _) in stacks {
        if let Some(p) = seen.get(name.as_str()) {
            return Err(file_err(
                path,
                format!(
                    "weight `{name}` is named twice: it is a stacked-expert tensor of the file and {}",
                    what(p)
                ),
            ));
        }
    }
    Ok(())
}

/// A layer's experts stacked in one GGUF tensor (`blk.N.ffn_gate_exps.weight`,
/// `[n_expert, rows, cols]`), held as one slot per expert ([`expert_key`] names them), so each
/// expert is read, streamed, cached and evicted alone; [`crate::quantized::QTensor`] hands the
/// layer the stacked view ([`Model::stack`]).
#[derive(Clone, Debug)]
pub struct Stack {
    experts: Vec<usize>,
    shape: Vec<usize>,
    ggml: GgmlDType,
}

impl Stack {
    /// The slot index of each expert, in expert order.
    pub fn experts(&self) -> &[usize] {
        &self.experts
    }
    /// The stacked shape, `[n_expert, rows, cols]`.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    /// The GGML format of every expert's bytes.
    pub fn ggml(&self) -> GgmlDType {
        self.ggml
    }
}

impl Model {
    /// Reads a model from a GGUF file, every tensor now, by positioned reads straight into the
    /// buffer it will live in (no memory map). Quantized tensors keep their block bytes
    /// ([`Slot::quantized`] says the format); F32, F16 and BF16 tensors are dense weights. The
    /// file's metadata is [`Model::gguf_metadata`].
    ///
    /// # Errors
    /// [`Error::File`] naming the file (and the tensor or metadata key) when it cannot be opened,
    /// is not a valid GGUF file (bad magic or version, an unknown GGML type, a shape that is not
    /// a whole number of blocks, has a dimension of 0 or overflows, data beyond the end of the
    /// file, an absurd length), holds what candle's kernels cannot run (`Q4_1`, `Q5_0`, `Q5_1`
    /// rows of an odd number of blocks), names one weight twice (a tensor named as a stacked
    /// tensor's generated expert key), or is truncated while it is read.
    pub fn from_gguf(name: impl Into<String>, path: impl AsRef<Path>) -> Result<Model> {
        let name = name.into();
        let path = path.as_ref();
        let (wf, header) = read_gguf_header(path)?;
        let mut slots = Vec::new();
        let mut index = HashMap::new();
        let (planned, stacks) = plan(path, header.tensors)?;
        for p in planned {
            let t = read_range(&wf, p.start, p.read_as, &p.read_shape, &p.key)?;
            index.insert(p.key.clone(), slots.len());
            slots.push(Slot {
                bytes: ByteSize(p.len),
                name: p.key,
                shape: p.shape,
                dtype: p.dtype,
                clean: Clean::Host(t),
                quant: p.quant,
            });
        }
        let mut model = Model::assemble(name, slots, index, Vec::new())?;
        model.metadata = Some(Arc::new(header.metadata));
        model.stacks = stacks.into_iter().collect();
        Ok(model)
    }

    /// Reads a model from a GGUF file *lazily*: only the header now; each tensor is read by a
    /// positioned read of its bytes when first needed and held by `tier` within its budget (the
    /// disk tier, as [`Model::from_safetensors_lazy`]). Bit-identical to [`Model::from_gguf`].
    ///
    /// # Errors
    /// As [`Model::from_gguf`] for the header; later reads fail with [`Error::File`] naming the
    /// file and the tensor when the file changed underneath.
    pub fn from_gguf_lazy(
        name: impl Into<String>,
        path: impl AsRef<Path>,
        tier: &HostTier,
    ) -> Result<Model> {
        let name = name.into();
        let path = path.as_ref();
        let id = super::next_model_id();
        let shared: Arc<str> = Arc::from(name.as_str());
        let (wf, header) = read_gguf_header(path)?;
        let mut slots = Vec::new();
        let mut index = HashMap::new();
        let (planned, stacks) = plan(path, header.tensors)?;
        for p in planned {
            let i = slots.len();
            index.insert(p.key.clone(), i);
            let disk = DiskWeight::new(
                Arc::clone(&wf),
                p.start,
                p.len,
                p.read_as,
                p.read_shape,
                tier,
                (id, Arc::clone(&shared)),
                i,
            );
            slots.push(Slot {
                bytes: ByteSize(p.len),
                name: p.key,
                shape: p.shape,
                dtype: p.dtype,
                clean: Clean::Disk(Box::new(disk)),
                quant: p.quant,
            });
        }
        let size: ByteSize = slots.iter().map(|s| s.bytes).sum();
        tier.register_model(id, size);
        match Model::assemble_with_id(id, name, slots, index, Vec::new(), Some(tier.clone())) {
            Ok(mut model) => {
                model.metadata = Some(Arc::new(header.metadata));
                model.stacks = stacks.into_iter().collect();
                Ok(model)
            }
            Err(e) => {
                tier.forget_model(id);
                Err(e)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::gguf::GgufEntry;
    use super::*;

    #[test]
    fn block_bytes_are_exact_and_refuse_partial_blocks_and_overflow() {
        assert_eq!(block_bytes(GgmlDType::Q4_0, &[4, 64]), Some(4 * 2 * 18));
        assert_eq!(block_bytes(GgmlDType::Q8_0, &[3, 32]), Some(3 * 34));
        assert_eq!(block_bytes(GgmlDType::Q4K, &[2, 256]), Some(2 * 144));
        assert_eq!(block_bytes(GgmlDType::Q6K, &[1, 512]), Some(2 * 210));
        assert_eq!(block_bytes(GgmlDType::F16, &[3, 5]), Some(30));
        assert_eq!(block_bytes(GgmlDType::Q4_0, &[4, 48]), None);
        assert_eq!(block_bytes(GgmlDType::Q4_0, &[usize::MAX, 64]), None);
        assert_eq!(block_bytes(GgmlDType::Q4_0, &[]), None);
    }

    /// The lock checker knows the crate's own calls into candle that synchronize on a GPU
    /// (issue 45: the keeper's lock was once held across this read-back and upload); on the
    /// simulated GPU nothing waits, so only the checker can find such a lock.
    #[cfg(debug_assertions)]
    #[test]
    fn building_a_qtensor_under_the_keeper_s_lock_is_refused_by_the_lock_checker() {
        let blocks = Tensor::zeros(34, DType::U8, &Device::Cpu).unwrap();
        let build =
            || qtensor_from_bytes(&blocks, GgmlDType::Q8_0, &[1, 32], &Device::Cpu, ("m", "w"));
        assert!(build().is_ok(), "no lock held: built");
        let keeper = crate::lock::Mutex::new(crate::lock::Rank::Dynamic, ());
        let err = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _g = keeper.lock();
            let _ = build();
        }))
        .expect_err("the checker should refuse a read-back under the keeper's lock");
        let msg = err.downcast_ref::<String>().cloned().unwrap_or_default();
        assert!(msg.contains("read-back of quantized blocks"), "{msg}");
        assert!(msg.contains("loader::Dynamic"), "{msg}");
    }

    fn entry(name: &str, shape: &[usize], ggml: GgmlDType, start: u64, end: u64) -> GgufEntry {
        GgufEntry {
            name: name.to_string(),
            shape: shape.to_vec(),
            ggml,
            start,
            end,
        }
    }

    fn plan_err(entries: Vec<GgufEntry>) -> String {
        match plan(Path::new("m.gguf"), entries) {
            Err(Error::File { reason, .. }) => reason,
            Err(other) => panic!("not a file error: {other}"),
            Ok((p, _)) => panic!("planned {} slots", p.len()),
        }
    }

    #[test]
    fn a_stack_of_empty_experts_is_refused_before_its_expert_count_sizes_anything() {
        // The header refuses such shapes; the plan does not rely on it. 2⁴⁰ experts of 0 bytes
        // would reserve 8 TiB of slot indices (an abort), 2⁶² would overflow the capacity.
        for n in [1usize << 18, 1 << 40, 1 << 62] {
            let e = entry(
                "blk.0.ffn_gate_exps.weight",
                &[n, 0, 32],
                GgmlDType::Q8_0,
                64,
                64,
            );
            let r = plan_err(vec![e]);
            assert!(
                r.contains("`blk.0.ffn_gate_exps.weight`")
                    && r.contains(&format!("0 bytes are not {n} non-empty experts")),
                "{r}"
            );
        }
    }

    #[test]
    fn odd_block_rows_are_refused_for_the_formats_whose_kernels_need_pairs() {
        for ggml in [GgmlDType::Q4_1, GgmlDType::Q5_0, GgmlDType::Q5_1] {
            let bytes = 4 * 3 * ggml.type_size() as u64;
            let r = plan_err(vec![entry("w", &[4, 96], ggml, 0, bytes)]);
            assert!(
                r.contains("tensor `w`")
                    && r.contains(&format!("{ggml:?}"))
                    && r.contains("3 blocks"),
                "{r}"
            );
            let bytes = 4 * 2 * ggml.type_size() as u64;
            assert!(plan(
                Path::new("m.gguf"),
                vec![entry("w", &[4, 64], ggml, 0, bytes)]
            )
            .is_ok());
        }
        // Any whole number of blocks runs for the others.
        for ggml in [GgmlDType::Q4_0, GgmlDType::Q8_0, GgmlDType::Q8_1] {
            let bytes = 4 * 3 * ggml.type_size() as u64;
            assert!(plan(
                Path::new("m.gguf"),
                vec![entry("w", &[4, 96], ggml, 0, bytes)]
            )
            .is_ok());
        }
    }

    #[test]
    fn one_name_for_two_weights_is_refused_naming_both() {
        let q8 = GgmlDType::Q8_0;
        let stack = || entry("blk.0.ffn_gate_exps.weight", &[2, 4, 32], q8, 0, 272);
        let r = plan_err(vec![
            stack(),
            entry("blk.0.ffn_gate_exps.1.weight", &[4, 32], q8, 288, 424),
        ]);
        assert!(
            r.contains("weight `blk.0.ffn_gate_exps.1.weight` is named twice")
                && r.contains("expert 1 of the stacked tensor `blk.0.ffn_gate_exps.weight`")
                && r.contains("a tensor of the file"),
            "{r}"
        );
        // A stack named as another stack's expert: the name would reach the stack only.
        let r = plan_err(vec![
            stack(),
            entry("blk.0.ffn_gate_exps.0.weight", &[2, 4, 32], q8, 288, 560),
        ]);
        assert!(
            r.contains("weight `blk.0.ffn_gate_exps.0.weight` is named twice")
                && r.contains("a stacked-expert tensor")
                && r.contains("expert 0 of the stacked tensor `blk.0.ffn_gate_exps.weight`"),
            "{r}"
        );
        // Names that only look generated are fine.
        let (planned, stacks) = plan(
            Path::new("m.gguf"),
            vec![
                stack(),
                entry("blk.0.ffn_gate_exps.2.weight", &[4, 32], q8, 288, 424),
            ],
        )
        .unwrap();
        assert_eq!((planned.len(), stacks.len()), (3, 1));
    }

    #[test]
    fn a_qtensor_from_unaligned_bytes_has_the_same_blocks() {
        let w = crate::float::uniform_tensor(&[4, 64], 3).unwrap();
        let q = QTensor::quantize(&w, GgmlDType::Q4_0).unwrap();
        let data = q.data().unwrap().to_vec();
        // One byte of offset: a view that no block type may be read from in place.
        let mut shifted = vec![0u8];
        shifted.extend_from_slice(&data);
        let t = Tensor::from_vec(shifted.clone(), shifted.len(), &Device::Cpu)
            .unwrap()
            .narrow(0, 1, data.len())
            .unwrap();
        let back =
            qtensor_from_bytes(&t, GgmlDType::Q4_0, &[4, 64], &Device::Cpu, ("m", "w")).unwrap();
        assert_eq!(back.data().unwrap().as_ref(), data.as_slice());
        let short = Tensor::from_vec(data[1..].to_vec(), data.len() - 1, &Device::Cpu).unwrap();
        let err = qtensor_from_bytes(&short, GgmlDType::Q4_0, &[4, 64], &Device::Cpu, ("m", "w"))
            .unwrap_err();
        assert!(
            matches!(err, Error::BadWeight { ref key, .. } if key == "w"),
            "{err}"
        );
    }
}
