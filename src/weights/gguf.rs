//! Reading and validating the header of a GGUF file, by positioned reads only.
//!
//! [`read_gguf_header`] opens a GGUF file (versions 1, 2 and 3, little-endian) and reads its
//! header — magic, version, counts, metadata and tensor infos — through a small cursor that
//! fetches it with positioned reads (`pread`) in chunks of at most 64 KiB (a string longer than a
//! chunk is read into its own buffer with one read). The file is never memory-mapped and its
//! tensor data is never read: a file truncated or replaced underneath is an [`Error::File`],
//! never a `SIGBUS`.
//!
//! Guarantees:
//! - Every failure is an [`Error::File`] naming the file and, where one is involved, the metadata
//!   key (by index, and by name once the name is read) or the tensor (by name), with the byte
//!   offsets concerned. Nothing here panics on any file content.
//! - No length read from the file is allocated before it is checked against the bytes the file
//!   has left: counts of metadata entries and tensors, string lengths and array lengths are
//!   refused when the file cannot hold them at their minimum encoded size. Arrays nest at most
//!   [`MAX_ARRAY_DEPTH`] deep.
//! - Every tensor the header returns has a known GGML type, 1 to 4 dimensions, none of them 0, a
//!   first (fastest) GGUF dimension that is a whole number of the type's blocks, an element count
//!   and byte size that fit in `u64` and `usize`, an offset that is a multiple of the file's
//!   alignment, and a non-empty byte range that lies inside the file and overlaps no other
//!   tensor's; tensor names are unique and so are metadata keys.
//!
//! Shapes are in candle's order (slowest dimension first), as candle's own `gguf_file` reader
//! gives them; metadata values are candle's `gguf_file::Value`s. Strings are UTF-8 with trailing
//! NUL bytes dropped, as candle's reader drops them.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;

use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::GgmlDType;

use super::lazy::{read_at, WeightFile};
use super::safetensors::file_err;
use crate::error::{Error, Result};

/// `GGUF` read as a little-endian `u32`.
const MAGIC: u32 = 0x4655_4747;
/// The magic of a big-endian GGUF file (not supported).
const MAGIC_SWAPPED: u32 = 0x4747_5546;
/// The most bytes the cursor fetches with one positioned read into its buffer.
const CHUNK: usize = 64 * 1024;
/// The alignment of the data section and of tensor offsets when `general.alignment` is absent.
const DEFAULT_ALIGNMENT: u64 = 32;
/// The metadata key that sets the alignment.
const ALIGNMENT_KEY: &str = "general.alignment";
/// The most dimensions a tensor may have (GGML's `GGML_MAX_DIMS`).
const MAX_DIMS: u32 = 4;
/// The deepest arrays may nest (an array of arrays is two deep).
pub(super) const MAX_ARRAY_DEPTH: usize = 8;
/// The longest string, in bytes (llama.cpp's and candle's `GGUF_MAX_STRING_LENGTH`).
const MAX_STRING: u64 = 1 << 30;
/// The most elements of one array (llama.cpp's and candle's `GGUF_MAX_ARRAY_ELEMENTS`).
const MAX_ARRAY: u64 = 1 << 30;
/// Metadata entries the map reserves room for up front, whatever the count says.
const MAX_RESERVE: usize = 1024;

/// The header of a GGUF file: its version, metadata and tensors, validated.
#[derive(Debug, Clone)]
pub(crate) struct GgufHeader {
    /// The format version: 1 (32-bit lengths and counts), 2 or 3 (64-bit ones).
    // Not every reader needs it; the tests check it.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) version: u32,
    /// The metadata, by key, as candle's `gguf_file::Value`s.
    pub(crate) metadata: HashMap<String, Value>,
    /// The alignment of the data section and of every tensor offset: `general.alignment` when
    /// present (a non-zero power of two), else 32.
    // Not every reader needs it; the tests check it.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) alignment: u64,
    /// The absolute offset of the tensor data section: the end of the header rounded up to
    /// [`GgufHeader::alignment`].
    // Not every reader needs it; the tests check it.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) data_offset: u64,
    /// The tensors, sorted by start: file order.
    pub(crate) tensors: Vec<GgufEntry>,
}

/// One tensor of a GGUF file: where its bytes are and what they hold.
#[derive(Debug, Clone)]
pub(crate) struct GgufEntry {
    /// The tensor's name.
    pub(crate) name: String,
    /// The shape in candle's order, slowest dimension first (GGUF stores the fastest first).
    pub(crate) shape: Vec<usize>,
    /// The GGML storage format of its bytes.
    pub(crate) ggml: GgmlDType,
    /// The absolute file offset of its first byte.
    pub(crate) start: u64,
    /// One past the absolute file offset of its last byte: `end - start` is its exact byte size.
    pub(crate) end: u64,
}

/// The GGML format of a GGUF type id, for the formats candle reads.
fn ggml_from_id(id: u32) -> Option<GgmlDType> {
    Some(match id {
        0 => GgmlDType::F32,
        1 => GgmlDType::F16,
        2 => GgmlDType::Q4_0,
        3 => GgmlDType::Q4_1,
        6 => GgmlDType::Q5_0,
        7 => GgmlDType::Q5_1,
        8 => GgmlDType::Q8_0,
        9 => GgmlDType::Q8_1,
        10 => GgmlDType::Q2K,
        11 => GgmlDType::Q3K,
        12 => GgmlDType::Q4K,
        13 => GgmlDType::Q5K,
        14 => GgmlDType::Q6K,
        15 => GgmlDType::Q8K,
        30 => GgmlDType::BF16,
        _ => return None,
    })
}

/// A forward cursor over a file's header: positioned reads of at most [`CHUNK`] bytes into a
/// buffer, every read checked against the file's length first.
struct Cursor<'a> {
    wf: &'a WeightFile,
    path: &'a Path,
    /// The file's length when it was opened.
    file_len: u64,
    /// Absolute offset of the next byte to read (never past `file_len`).
    pos: u64,
    /// The bytes at `buf_start..buf_start + buf.len()`.
    buf: Vec<u8>,
    buf_start: u64,
    /// Lengths are `u64` (versions 2 and 3) rather than `u32` (version 1).
    wide: bool,
    /// What is being read, for errors: "metadata key 3 (`general.name`)", "tensor `x`".
    ctx: String,
}

impl<'a> Cursor<'a> {
    fn new(wf: &'a WeightFile, path: &'a Path, file_len: u64) -> Self {
        Cursor {
            wf,
            path,
            file_len,
            pos: 0,
            buf: Vec::new(),
            buf_start: 0,
            wide: true,
            ctx: String::new(),
        }
    }

    /// Bytes of the file after the cursor.
    fn left(&self) -> u64 {
        self.file_len.saturating_sub(self.pos)
    }

    /// The current context followed by `part` ("tensor `x`: the GGML type").
    fn what(&self, part: &str) -> String {
        if self.ctx.is_empty() {
            part.to_string()
        } else {
            format!("{}: {part}", self.ctx)
        }
    }

    /// An error about `part` of what is being read.
    fn err(&self, part: &str, problem: impl std::fmt::Display) -> Error {
        file_err(
            self.path,
            format!("GGUF header: {}: {problem}", self.what(part)),
        )
    }

    /// The error for `n` bytes of `part` that the file does not have.
    fn truncated(&self, n: u64, part: &str) -> Error {
        file_err(
            self.path,
            format!(
                "GGUF header truncated: {} needs bytes {}..{} but the file is {} bytes",
                self.what(part),
                self.pos,
                self.pos.saturating_add(n),
                self.file_len
            ),
        )
    }

    /// Fills `out` with the next `out.len()` bytes of `part`.
    fn read(&mut self, out: &mut [u8], part: &str) -> Result<()> {
        if out.len() as u64 > self.left() {
            return Err(self.truncated(out.len() as u64, part));
        }
        let mut done = 0usize;
        while done < out.len() {
            let want = out.len() - done;
            let buf_end = self.buf_start + self.buf.len() as u64;
            if self.pos >= self.buf_start && self.pos < buf_end {
                // `pos - buf_start < buf.len()`, so the difference fits in usize.
                let from = (self.pos - self.buf_start) as usize;
                let n = want.min(self.buf.len() - from);
                out[done..done + n].copy_from_slice(&self.buf[from..from + n]);
                done += n;
                self.pos += n as u64;
            } else if want >= CHUNK {
                // A long string: straight into its own buffer, no copy through ours.
                read_at(self.wf, &mut out[done..], self.pos, "")?;
                self.pos += want as u64;
                done = out.len();
            } else {
                // `want <= left`, so this fetches at least `want` bytes.
                let n = (CHUNK as u64).min(self.left()) as usize;
                self.buf.resize(n, 0);
                read_at(self.wf, &mut self.buf, self.pos, "")?;
                self.buf_start = self.pos;
            }
        }
        Ok(())
    }

    fn array<const N: usize>(&mut self, part: &str) -> Result<[u8; N]> {
        let mut b = [0u8; N];
        self.read(&mut b, part)?;
        Ok(b)
    }

    fn u8(&mut self, part: &str) -> Result<u8> {
        Ok(self.array::<1>(part)?[0])
    }

    fn u16(&mut self, part: &str) -> Result<u16> {
        Ok(u16::from_le_bytes(self.array(part)?))
    }

    fn u32(&mut self, part: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(part)?))
    }

    fn u64(&mut self, part: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(part)?))
    }

    /// A length or count: `u32` in version 1, `u64` in versions 2 and 3.
    fn len(&mut self, part: &str) -> Result<u64> {
        if self.wide {
            self.u64(part)
        } else {
            self.u32(part).map(u64::from)
        }
    }

    /// The encoded size of a length or count.
    fn len_size(&self) -> u64 {
        if self.wide {
            8
        } else {
            4
        }
    }

    /// A length-prefixed UTF-8 string, trailing NULs dropped.
    fn string(&mut self, part: &str) -> Result<String> {
        let at = self.pos;
        let n = self.len(part)?;
        if n > self.left() {
            return Err(self.err(
                part,
                format!(
                    "a string of {n} bytes (length at byte {at}) needs bytes {}..{} but the file is {} bytes: an absurd length, or the file is truncated",
                    self.pos,
                    self.pos.saturating_add(n),
                    self.file_len
                ),
            ));
        }
        if n > MAX_STRING {
            return Err(self.err(
                part,
                format!(
                    "a string of {n} bytes at byte {at} is longer than the limit of {MAX_STRING}"
                ),
            ));
        }
        let n = usize::try_from(n).map_err(|_| {
            self.err(
                part,
                format!("a string of {n} bytes does not fit in memory"),
            )
        })?;
        let mut v = vec![0u8; n];
        self.read(&mut v, part)?;
        // GGUF strings are not NUL-terminated, but some writers add one; candle drops them too.
        while v.last() == Some(&0) {
            v.pop();
        }
        String::from_utf8(v).map_err(|e| {
            self.err(
                part,
                format!("the string at bytes {at}..{} is not UTF-8 ({e})", self.pos),
            )
        })
    }

    /// The least bytes a value of type `ty` takes, `None` for an unknown type.
    fn min_size(&self, ty: u32) -> Option<u64> {
        Some(match ty {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            8 => self.len_size(),
            9 => 4 + self.len_size(),
            10..=12 => 8,
            _ => return None,
        })
    }

    /// A metadata value of type `ty`; `depth` arrays enclose it.
    fn value(&mut self, ty: u32, depth: usize) -> Result<Value> {
        const V: &str = "the value";
        Ok(match ty {
            0 => Value::U8(self.u8(V)?),
            1 => Value::I8(i8::from_le_bytes(self.array(V)?)),
            2 => Value::U16(self.u16(V)?),
            3 => Value::I16(i16::from_le_bytes(self.array(V)?)),
            4 => Value::U32(self.u32(V)?),
            5 => Value::I32(i32::from_le_bytes(self.array(V)?)),
            6 => Value::F32(f32::from_le_bytes(self.array(V)?)),
            7 => {
                let at = self.pos;
                match self.u8(V)? {
                    0 => Value::Bool(false),
                    1 => Value::Bool(true),
                    b => {
                        return Err(self.err(V, format!("bool byte {b} at byte {at} is not 0 or 1")))
                    }
                }
            }
            8 => Value::String(self.string(V)?),
            9 => self.array_value(depth)?,
            10 => Value::U64(self.u64(V)?),
            11 => Value::I64(i64::from_le_bytes(self.array(V)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(V)?)),
            other => {
                return Err(self.err(
                    "the value type",
                    format!(
                        "unknown metadata value type {other} (the value would start at byte {})",
                        self.pos
                    ),
                ));
            }
        })
    }

    /// An array value (its element type, length and elements); `depth` arrays enclose it.
    fn array_value(&mut self, depth: usize) -> Result<Value> {
        if depth >= MAX_ARRAY_DEPTH {
            return Err(self.err(
                "the value",
                format!(
                    "arrays nested more than {MAX_ARRAY_DEPTH} deep (at byte {})",
                    self.pos
                ),
            ));
        }
        let ty_at = self.pos;
        let ty = self.u32("the array's element type")?;
        let Some(min) = self.min_size(ty) else {
            return Err(self.err(
                "the array's element type",
                format!("unknown metadata value type {ty} at byte {ty_at}"),
            ));
        };
        let at = self.pos;
        let n = self.len("the array's length")?;
        let left = self.left();
        match n.checked_mul(min) {
            Some(need) if need <= left => {}
            _ => {
                return Err(self.err(
                    "the value",
                    format!(
                        "an array of {n} elements (length at byte {at}) needs at least {} bytes from byte {} but the file is {} bytes: an absurd length, or the file is truncated",
                        n.saturating_mul(min),
                        self.pos,
                        self.file_len
                    ),
                ));
            }
        }
        if n > MAX_ARRAY {
            return Err(self.err(
                "the value",
                format!("an array of {n} elements is longer than the limit of {MAX_ARRAY}"),
            ));
        }
        // `n * min <= left` with `min >= 1`: at most one element per byte left in the file.
        let mut vs = Vec::with_capacity(usize::try_from(n).unwrap_or(0));
        for _ in 0..n {
            vs.push(self.value(ty, depth + 1)?);
        }
        Ok(Value::Array(vs))
    }
}

/// A tensor info as the header gives it, before the data section's offset is known.
struct Info {
    name: String,
    shape: Vec<usize>,
    ggml: GgmlDType,
    offset: u64,
    bytes: u64,
}

/// The alignment `general.alignment` sets, or the default.
fn alignment_of(path: &Path, metadata: &HashMap<String, Value>) -> Result<u64> {
    let Some(v) = metadata.get(ALIGNMENT_KEY) else {
        return Ok(DEFAULT_ALIGNMENT);
    };
    let a = match *v {
        Value::U8(a) => Some(u64::from(a)),
        Value::U16(a) => Some(u64::from(a)),
        Value::U32(a) => Some(u64::from(a)),
        Value::U64(a) => Some(a),
        Value::I8(a) => u64::try_from(a).ok(),
        Value::I16(a) => u64::try_from(a).ok(),
        Value::I32(a) => u64::try_from(a).ok(),
        Value::I64(a) => u64::try_from(a).ok(),
        _ => None,
    };
    match a {
        Some(a) if a.is_power_of_two() => Ok(a),
        _ => Err(file_err(
            path,
            format!(
                "GGUF header: metadata key `{ALIGNMENT_KEY}` is {v:?}: the alignment must be a non-zero power of two"
            ),
        )),
    }
}

/// One tensor info; the cursor's context names the tensor once its name is read.
fn tensor_info(c: &mut Cursor<'_>, i: u64, alignment: u64) -> Result<Info> {
    c.ctx = format!("tensor {i}");
    let name = c.string("the name")?;
    c.ctx = format!("tensor `{name}`");
    let n_dims_at = c.pos;
    let n_dims = c.u32("the number of dimensions")?;
    if n_dims == 0 || n_dims > MAX_DIMS {
        return Err(c.err(
            "the number of dimensions",
            format!("{n_dims} dimensions at byte {n_dims_at} (1 to {MAX_DIMS} are read)"),
        ));
    }
    // GGUF order: the fastest dimension (ne[0]) first.
    let dims_at = c.pos;
    let mut ne = Vec::with_capacity(MAX_DIMS as usize);
    for _ in 0..n_dims {
        let d = if c.wide {
            c.u64("the dimensions")?
        } else {
            u64::from(c.u32("the dimensions")?)
        };
        ne.push(d);
    }
    if let Some(i) = ne.iter().position(|&d| d == 0) {
        // An empty tensor loads, then candle's quantized matmul divides by its zero dimension
        // (and a stack of empty experts has no bytes to bound its expert count by).
        return Err(c.err(
            "the dimensions",
            format!(
                "dimension ne[{i}] of {ne:?} (fastest first, at byte {dims_at}) is 0: a tensor with no elements is refused"
            ),
        ));
    }
    let type_at = c.pos;
    let id = c.u32("the GGML type")?;
    let ggml = ggml_from_id(id).ok_or_else(|| {
        c.err(
            "the GGML type",
            format!("unknown GGML type id {id} at byte {type_at}"),
        )
    })?;
    let offset_at = c.pos;
    let offset = c.u64("the data offset")?;
    let numel = ne
        .iter()
        .try_fold(1u64, |n, &d| n.checked_mul(d))
        .filter(|&n| usize::try_from(n).is_ok())
        .ok_or_else(|| {
            c.err(
                "the dimensions",
                format!("the element count of dimensions {ne:?} (fastest first, at byte {dims_at}) overflows"),
            )
        })?;
    let block = ggml.block_size() as u64;
    if !ne[0].is_multiple_of(block) {
        return Err(c.err(
            "the dimensions",
            format!(
                "its rows of {} elements (ne[0], at byte {dims_at}) are not a whole number of blocks: {ggml:?} blocks hold {block} elements",
                ne[0]
            ),
        ));
    }
    let bytes = (numel / block)
        .checked_mul(ggml.type_size() as u64)
        .ok_or_else(|| {
            c.err(
                "the dimensions",
                format!("the byte size of {numel} {ggml:?} elements (dimensions at byte {dims_at}) overflows"),
            )
        })?;
    if !offset.is_multiple_of(alignment) {
        return Err(c.err(
            "the data offset",
            format!(
                "{offset} (at byte {offset_at}) is not a multiple of the alignment {alignment}"
            ),
        ));
    }
    // Every dimension is at most the element count (or the count is 0), which fits in usize.
    let shape = ne
        .iter()
        .rev()
        .map(|&d| usize::try_from(d))
        .collect::<std::result::Result<Vec<usize>, _>>()
        .map_err(|_| {
            c.err(
                "the dimensions",
                format!("dimensions {ne:?} (at byte {dims_at}) overflow usize"),
            )
        })?;
    Ok(Info {
        name,
        shape,
        ggml,
        offset,
        bytes,
    })
}

/// The tensor and metadata counts against the bytes left in the file: each entry takes at least
/// a few bytes, so counts the file cannot hold are refused before anything is sized by them.
fn check_counts(c: &Cursor<'_>, tensor_count: u64, kv_count: u64) -> Result<()> {
    let path = c.path;
    // Each entry's least encoded size: a metadata entry is a key (its length), a value type and
    // a value of at least one byte; a tensor info is a name (its length), a dimension count, one
    // dimension, a GGML type and an offset.
    let prefix = c.len_size();
    let min_kv = prefix + 4 + 1;
    let min_tensor = prefix + 4 + prefix + 4 + 8;
    let left = c.left();
    if tensor_count > left / min_tensor {
        return Err(file_err(
            path,
            format!(
                "GGUF header: absurd tensor count {tensor_count}: each tensor info takes at least {min_tensor} bytes and {left} bytes are left in the file after byte {}",
                c.pos
            ),
        ));
    }
    if kv_count > left / min_kv {
        return Err(file_err(
            path,
            format!(
                "GGUF header: absurd metadata count {kv_count}: each metadata entry takes at least {min_kv} bytes and {left} bytes are left in the file after byte {}",
                c.pos
            ),
        ));
    }
    // Both products are at most `left`, so the sum cannot overflow.
    let need = tensor_count * min_tensor + kv_count * min_kv;
    if need > left {
        return Err(file_err(
            path,
            format!(
                "GGUF header: {tensor_count} tensors and {kv_count} metadata entries need at least {need} bytes but {left} are left in the file after byte {}",
                c.pos
            ),
        ));
    }

    Ok(())
}

/// The tensors' byte ranges in the file (data section at `data_offset`), sorted by start:
/// each inside the file, no name twice, no two non-empty ranges overlapping.
fn place_tensors(
    path: &Path,
    infos: Vec<Info>,
    data_offset: u64,
    file_len: u64,
) -> Result<Vec<GgufEntry>> {
    let mut tensors = Vec::with_capacity(infos.len());
    for info in infos {
        let range = data_offset
            .checked_add(info.offset)
            .and_then(|s| Some((s, s.checked_add(info.bytes)?)));
        let Some((start, end)) = range else {
            return Err(file_err(
                path,
                format!(
                    "GGUF header: tensor `{}`: data offset {} plus {} bytes after the data section at byte {data_offset} overflows",
                    info.name, info.offset, info.bytes
                ),
            ));
        };
        if end > file_len {
            return Err(file_err(
                path,
                format!(
                    "GGUF header: tensor `{}` needs bytes {start}..{end} but the file is {file_len} bytes",
                    info.name
                ),
            ));
        }
        tensors.push(GgufEntry {
            name: info.name,
            shape: info.shape,
            ggml: info.ggml,
            start,
            end,
        });
    }
    tensors.sort_by(|a, b| (a.start, &a.name).cmp(&(b.start, &b.name)));

    let mut names: HashSet<&str> = HashSet::with_capacity(tensors.len());
    for t in &tensors {
        if !names.insert(t.name.as_str()) {
            return Err(file_err(
                path,
                format!("GGUF header: tensor `{}` appears twice", t.name),
            ));
        }
    }
    // Sorted by start, non-empty ranges that do not overlap have increasing ends, so each one
    // need only be checked against the last non-empty one before it.
    let mut last: Option<&GgufEntry> = None;
    for t in tensors.iter().filter(|t| t.end > t.start) {
        if let Some(p) = last {
            if p.end > t.start {
                return Err(file_err(
                    path,
                    format!(
                        "GGUF header: tensor `{}` (bytes {}..{}) overlaps tensor `{}` (bytes {}..{})",
                        t.name, t.start, t.end, p.name, p.start, p.end
                    ),
                ));
            }
        }
        last = Some(t);
    }

    Ok(tensors)
}

/// The whole header, validated.
fn parse(c: &mut Cursor<'_>) -> Result<GgufHeader> {
    let path = c.path;
    let magic = c.u32("the magic")?;
    if magic != MAGIC {
        let why = if magic == MAGIC_SWAPPED {
            "a big-endian GGUF file, which is not supported".to_string()
        } else {
            format!("magic 0x{magic:08x} at byte 0 is not `GGUF` (0x{MAGIC:08x})")
        };
        return Err(file_err(path, format!("not a GGUF file: {why}")));
    }
    let version = c.u32("the version")?;
    c.wide = match version {
        1 => false,
        2 | 3 => true,
        v => {
            return Err(file_err(
                path,
                format!("unsupported GGUF version {v} (versions 1, 2 and 3 are read)"),
            ))
        }
    };
    let tensor_count = c.len("the tensor count")?;
    let kv_count = c.len("the metadata count")?;

    check_counts(c, tensor_count, kv_count)?;

    let reserve = usize::try_from(kv_count).unwrap_or(0).min(MAX_RESERVE);
    let mut metadata: HashMap<String, Value> = HashMap::with_capacity(reserve);
    for i in 0..kv_count {
        c.ctx = format!("metadata key {i}");
        let key_at = c.pos;
        let key = c.string("the key")?;
        c.ctx = format!("metadata key {i} (`{key}`)");
        if metadata.contains_key(&key) {
            return Err(c.err("the key", format!("the key at byte {key_at} appears twice")));
        }
        let ty = c.u32("the value type")?;
        let value = c.value(ty, 0)?;
        metadata.insert(key, value);
    }
    let alignment = alignment_of(path, &metadata)?;

    let reserve = usize::try_from(tensor_count).unwrap_or(0);
    let mut infos = Vec::with_capacity(reserve);
    for i in 0..tensor_count {
        infos.push(tensor_info(c, i, alignment)?);
    }
    let end_of_header = c.pos;
    let data_offset = end_of_header.checked_next_multiple_of(alignment).ok_or_else(|| {
        file_err(
            path,
            format!(
                "GGUF header: the header's end at byte {end_of_header} rounded up to the alignment {alignment} overflows"
            ),
        )
    })?;

    let tensors = place_tensors(path, infos, data_offset, c.file_len)?;

    Ok(GgufHeader {
        version,
        metadata,
        alignment,
        data_offset,
        tensors,
    })
}

/// Opens the GGUF file at `path` and reads and validates its header with positioned reads; the
/// tensor data is not read. Returns the open file (for reading tensors later) and the header.
///
/// # Errors
/// [`Error::File`] naming the file when it cannot be opened or read; when the magic or version is
/// wrong; when the header is truncated (naming the part: "metadata key N", "tensor `name`");
/// when a count, string length or array length is larger than the file could hold, arrays nest
/// more than [`MAX_ARRAY_DEPTH`] deep, a string is not UTF-8, a value type or GGML type id is
/// unknown, or a metadata key or tensor name repeats; when `general.alignment` is not a non-zero
/// power of two; and for a tensor (by name) with no or more than four dimensions, a dimension of
/// 0, an element count or byte size that overflows, rows that are not a whole number of blocks,
/// an offset that is not a multiple of the alignment, bytes beyond the end of the file, or bytes
/// that overlap another tensor's.
pub(crate) fn read_gguf_header(path: &Path) -> Result<(Arc<WeightFile>, GgufHeader)> {
    let wf = WeightFile::open(path)?;
    let file_len = wf
        .file
        .metadata()
        .map_err(|e| file_err(path, format!("cannot stat: {e}")))?
        .len();
    let header = parse(&mut Cursor::new(&wf, path, file_len))?;
    Ok((wf, header))
}

#[cfg(test)]
mod tests;
