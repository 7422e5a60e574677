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
//! - Every tensor the header returns has a known GGML type, 1 to 4 dimensions, a first (fastest)
//!   GGUF dimension that is a whole number of the type's blocks, an element count and byte size
//!   that fit in `u64` and `usize`, an offset that is a multiple of the file's alignment, and a
//!   byte range that lies inside the file and overlaps no other tensor's; tensor names are unique
//!   and so are metadata keys.
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
    /// The tensors, sorted by (start, name): file order, zero-sized tensors by name.
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

    let file_len = c.file_len;
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
/// power of two; and for a tensor (by name) with no or more than four dimensions, an element count
/// or byte size that overflows, rows that are not a whole number of blocks, an offset that is not
/// a multiple of the alignment, bytes beyond the end of the file, or bytes that overlap another
/// tensor's.
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
mod tests {
    use std::io::Write;

    use candle_core::quantized::{gguf_file, QTensor};
    use candle_core::{Device, Tensor};

    use super::*;

    /// The tensors of the valid file, in the order they are written.
    const TENSORS: [(&str, GgmlDType, &[usize]); 6] = [
        ("w.f32", GgmlDType::F32, &[3, 8]),
        ("w.f16", GgmlDType::F16, &[4, 6]),
        ("w.q4_0", GgmlDType::Q4_0, &[2, 64]),
        ("w.q8_0", GgmlDType::Q8_0, &[2, 3, 32]),
        ("w.q4k", GgmlDType::Q4K, &[2, 256]),
        ("w.q6k", GgmlDType::Q6K, &[1, 512]),
    ];

    fn qtensors() -> Vec<(&'static str, QTensor)> {
        TENSORS
            .iter()
            .enumerate()
            .map(|(i, &(name, ggml, shape))| {
                let n: usize = shape.iter().product();
                let t = Tensor::arange(0f32, n as f32, &Device::Cpu)
                    .and_then(|t| t.affine(0.37, i as f64))
                    .and_then(|t| t.sin())
                    .and_then(|t| t.reshape(shape))
                    .expect("tensor");
                (name, QTensor::quantize(&t, ggml).expect("quantize"))
            })
            .collect()
    }

    fn metadata() -> Vec<(&'static str, gguf_file::Value)> {
        use gguf_file::Value as V;
        vec![
            ("general.name", V::String("tiny".into())),
            ("general.description", V::String("d".repeat(400))),
            ("general.alignment", V::U32(32)),
            ("t.u32", V::U32(7)),
            ("t.f32", V::F32(0.5)),
            ("t.bool", V::Bool(true)),
            (
                "t.tokens",
                V::Array(vec![
                    V::String("a".into()),
                    V::String("bc".into()),
                    V::String(String::new()),
                ]),
            ),
        ]
    }

    /// A file written by candle's own writer.
    fn write(meta: &[(&str, gguf_file::Value)], tensors: &[(&str, QTensor)]) -> Vec<u8> {
        let meta: Vec<(&str, &gguf_file::Value)> = meta.iter().map(|(k, v)| (*k, v)).collect();
        let tensors: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, t)| (*k, t)).collect();
        let mut w = std::io::Cursor::new(Vec::new());
        gguf_file::write(&mut w, &meta, &tensors).expect("write gguf");
        w.into_inner()
    }

    fn valid() -> Vec<u8> {
        write(&metadata(), &qtensors())
    }

    fn temp(bytes: &[u8]) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().expect("temp file");
        f.write_all(bytes).expect("write temp file");
        f.flush().expect("flush");
        f
    }

    fn read(bytes: &[u8]) -> Result<GgufHeader> {
        let f = temp(bytes);
        read_gguf_header(f.path()).map(|(_, h)| h)
    }

    /// The reason of the `Error::File` reading `bytes` gives.
    fn reason(bytes: &[u8]) -> String {
        let err = read(bytes).expect_err("a malformed file must be refused");
        assert!(matches!(err, Error::File { .. }), "{err:?}");
        match err {
            Error::File { reason, .. } => reason,
            _ => unreachable!(),
        }
    }

    fn assert_reason(bytes: &[u8], parts: &[&str]) {
        let r = reason(bytes);
        for p in parts {
            assert!(r.contains(p), "reason {r:?} does not contain {p:?}");
        }
    }

    fn find(bytes: &[u8], needle: &[u8]) -> usize {
        bytes
            .windows(needle.len())
            .position(|w| w == needle)
            .expect("pattern in file")
    }

    /// Offset of the length prefix of the (v2, u64-length) string `s`.
    fn string_at(bytes: &[u8], s: &str) -> usize {
        let mut pat = (s.len() as u64).to_le_bytes().to_vec();
        pat.extend_from_slice(s.as_bytes());
        find(bytes, &pat)
    }

    /// Offset of the byte after the (v2) string `s`.
    fn after(bytes: &[u8], s: &str) -> usize {
        string_at(bytes, s) + 8 + s.len()
    }

    /// Offsets of a tensor info's fields: (n_dims, dims, ggml type, offset).
    fn fields(bytes: &[u8], name: &str) -> (usize, usize, usize, usize) {
        let n_dims_at = after(bytes, name);
        let n = u32::from_le_bytes(bytes[n_dims_at..n_dims_at + 4].try_into().unwrap()) as usize;
        let dims_at = n_dims_at + 4;
        let type_at = dims_at + 8 * n;
        (n_dims_at, dims_at, type_at, type_at + 4)
    }

    fn put_u32(bytes: &mut [u8], at: usize, v: u32) {
        bytes[at..at + 4].copy_from_slice(&v.to_le_bytes());
    }

    fn put_u64(bytes: &mut [u8], at: usize, v: u64) {
        bytes[at..at + 8].copy_from_slice(&v.to_le_bytes());
    }

    fn get_u64(bytes: &[u8], at: usize) -> u64 {
        u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap())
    }

    /// Checks `h` against candle's own reader of the same bytes, tensor data included.
    fn check_against_candle(bytes: &[u8], h: &GgufHeader) {
        let mut r = std::io::Cursor::new(bytes);
        let content = gguf_file::Content::read(&mut r).expect("candle reads the file");
        assert_eq!(h.data_offset, content.tensor_data_offset);
        assert_eq!(h.tensors.len(), content.tensor_infos.len());
        for e in &h.tensors {
            let info = &content.tensor_infos[&e.name];
            assert_eq!(e.shape, info.shape.dims(), "{}", e.name);
            assert_eq!(e.ggml, info.ggml_dtype, "{}", e.name);
            assert_eq!(
                e.start,
                content.tensor_data_offset + info.offset,
                "{}",
                e.name
            );
            let size = info.shape.elem_count() / e.ggml.block_size() * e.ggml.type_size();
            assert_eq!(e.end - e.start, size as u64, "{}", e.name);
            let q = content
                .tensor(&mut r, &e.name, &Device::Cpu)
                .expect("candle reads the tensor");
            assert_eq!(
                &bytes[e.start as usize..e.end as usize],
                &*q.data().expect("data"),
                "{}",
                e.name
            );
        }
        let mut keys: Vec<&String> = h.metadata.keys().collect();
        let mut theirs: Vec<&String> = content.metadata.keys().collect();
        keys.sort();
        theirs.sort();
        assert_eq!(keys, theirs);
        for (k, v) in &h.metadata {
            assert_eq!(
                format!("{v:?}"),
                format!("{:?}", content.metadata[k]),
                "{k}"
            );
        }
        assert!(h
            .tensors
            .windows(2)
            .all(|w| (w[0].start, &w[0].name) < (w[1].start, &w[1].name)));
    }

    #[test]
    fn gguf_valid_file_matches_candle() {
        let bytes = valid();
        let h = read(&bytes).expect("valid file");
        assert_eq!(h.version, 2);
        assert_eq!(h.alignment, 32);
        assert_eq!(h.data_offset % 32, 0);
        check_against_candle(&bytes, &h);
        // The bytes at start..end are exactly what was written.
        let written = qtensors();
        for (name, q) in &written {
            let e = h.tensors.iter().find(|e| e.name == *name).expect("tensor");
            assert_eq!(e.shape, q.shape().dims(), "{name}");
            assert_eq!(e.ggml, q.dtype(), "{name}");
            assert_eq!(
                &bytes[e.start as usize..e.end as usize],
                &*q.data().expect("data"),
                "{name}"
            );
        }
        // Written in order, so file order is write order.
        let order: Vec<&str> = h.tensors.iter().map(|e| e.name.as_str()).collect();
        let want: Vec<&str> = TENSORS.iter().map(|t| t.0).collect();
        assert_eq!(order, want);
        assert_eq!(h.metadata["t.u32"].to_u32().expect("u32"), 7);
        assert_eq!(h.metadata["t.f32"].to_f32().expect("f32"), 0.5);
        assert!(h.metadata["t.bool"].to_bool().expect("bool"));
        assert_eq!(h.metadata["general.name"].to_string().expect("s"), "tiny");
        let tokens: Vec<&str> = h.metadata["t.tokens"]
            .to_vec()
            .expect("array")
            .iter()
            .map(|v| v.to_string().expect("string").as_str())
            .collect();
        assert_eq!(tokens, ["a", "bc", ""]);
    }

    #[test]
    fn gguf_version_3_reads_as_version_2() {
        let mut bytes = valid();
        put_u32(&mut bytes, 4, 3);
        let h = read(&bytes).expect("v3 file");
        assert_eq!(h.version, 3);
        check_against_candle(&bytes, &h);
    }

    /// A version 1 file: 32-bit lengths, counts and dimensions.
    #[test]
    fn gguf_version_1_file_matches_candle() {
        fn s(out: &mut Vec<u8>, s: &str) {
            out.extend_from_slice(&(s.len() as u32).to_le_bytes());
            out.extend_from_slice(s.as_bytes());
        }
        let qs = qtensors();
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&1u32.to_le_bytes());
        out.extend_from_slice(&(qs.len() as u32).to_le_bytes());
        out.extend_from_slice(&2u32.to_le_bytes());
        s(&mut out, "general.name");
        out.extend_from_slice(&8u32.to_le_bytes());
        s(&mut out, "v1");
        s(&mut out, "t.list");
        out.extend_from_slice(&9u32.to_le_bytes());
        out.extend_from_slice(&4u32.to_le_bytes()); // u32 elements
        out.extend_from_slice(&2u32.to_le_bytes()); // two of them
        out.extend_from_slice(&5u32.to_le_bytes());
        out.extend_from_slice(&6u32.to_le_bytes());
        let mut offset = 0u64;
        let mut datas = Vec::new();
        for (name, q) in &qs {
            s(&mut out, name);
            let dims = q.shape().dims();
            out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for &d in dims.iter().rev() {
                out.extend_from_slice(&(d as u32).to_le_bytes());
            }
            let id = match q.dtype() {
                GgmlDType::F32 => 0u32,
                GgmlDType::F16 => 1,
                GgmlDType::Q4_0 => 2,
                GgmlDType::Q8_0 => 8,
                GgmlDType::Q4K => 12,
                GgmlDType::Q6K => 14,
                other => panic!("{other:?}"),
            };
            out.extend_from_slice(&id.to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            let data = q.data().expect("data").to_vec();
            offset += (data.len() as u64).next_multiple_of(32);
            datas.push(data);
        }
        out.resize(out.len().next_multiple_of(32), 0);
        for d in datas {
            out.extend_from_slice(&d);
            out.resize(out.len().next_multiple_of(32), 0);
        }
        let h = read(&out).expect("v1 file");
        assert_eq!(h.version, 1);
        check_against_candle(&out, &h);
        let list: Vec<u32> = h.metadata["t.list"]
            .to_vec()
            .expect("array")
            .iter()
            .map(|v| v.to_u32().expect("u32"))
            .collect();
        assert_eq!(list, [5, 6]);
    }

    /// A header of several chunks: a string longer than a chunk (read straight into its buffer)
    /// and an array of many short strings (read through the cursor's buffer, across refills).
    #[test]
    fn gguf_header_larger_than_a_chunk() {
        use gguf_file::Value as V;
        let mut meta = metadata();
        meta.push(("t.long", V::String("x".repeat(3 * CHUNK + 5))));
        let tokens = (0..20_000).map(|i| V::String(format!("tok{i}"))).collect();
        meta.push(("t.vocab", V::Array(tokens)));
        let bytes = write(&meta, &qtensors());
        assert!(bytes.len() > 5 * CHUNK);
        let h = read(&bytes).expect("large header");
        check_against_candle(&bytes, &h);
        assert_eq!(h.metadata["t.vocab"].to_vec().expect("array").len(), 20_000);
    }

    #[test]
    fn gguf_zero_dimension_is_an_empty_tensor() {
        let mut bytes = valid();
        let (_, dims, _, _) = fields(&bytes, "w.f32");
        put_u64(&mut bytes, dims + 8, 0); // ne[1]: shape [0, 8]
        let h = read(&bytes).expect("a zero dimension is allowed");
        let e = h
            .tensors
            .iter()
            .find(|e| e.name == "w.f32")
            .expect("tensor");
        assert_eq!(e.shape, [0, 8]);
        assert_eq!(e.start, e.end);
        assert_eq!(h.tensors.len(), TENSORS.len());
    }

    #[test]
    fn gguf_truncated_anywhere_is_refused() {
        let bytes = valid();
        let h = read(&bytes).expect("valid file");
        let desc = after(&bytes, "general.description") + 4 + 8 + 300;
        let tokens = after(&bytes, "t.tokens") + 4 + 4 + 8 + 3;
        let (_, q4k_dims, _, _) = fields(&bytes, "w.q4k");
        let q8_name = string_at(&bytes, "w.q8_0") + 10;
        // The end of the header: the last tensor info's offset field ends it.
        let (_, _, _, last_info) = fields(&bytes, "w.q6k");
        let header_end = last_info + 8;
        let last = h.tensors.last().expect("tensors");
        let cases: Vec<(usize, Vec<String>)> = vec![
            (0, vec!["the magic".into(), "the file is 0 bytes".into()]),
            (3, vec!["the magic".into(), "needs bytes 0..4".into()]),
            (6, vec!["the version".into()]),
            (12, vec!["the tensor count".into()]),
            (20, vec!["the metadata count".into()]),
            (
                desc,
                vec![
                    "metadata key 1 (`general.description`)".into(),
                    "truncated".into(),
                ],
            ),
            (
                tokens,
                vec!["metadata key 6 (`t.tokens`)".into(), "truncated".into()],
            ),
            (
                q4k_dims + 3,
                vec!["tensor `w.q4k`".into(), "the dimensions".into()],
            ),
            (q8_name, vec!["tensor 3".into(), "the name".into()]),
            (
                header_end,
                vec![
                    "tensor `w.f32` needs bytes".into(),
                    format!("the file is {header_end} bytes"),
                ],
            ),
            (
                h.data_offset as usize + 10,
                vec!["tensor `w.f32` needs bytes".into()],
            ),
            (
                last.end as usize - 1,
                vec![format!(
                    "tensor `w.q6k` needs bytes {}..{} but the file is {} bytes",
                    last.start,
                    last.end,
                    last.end - 1
                )],
            ),
        ];
        for (cut, parts) in cases {
            let r = reason(&bytes[..cut]);
            for p in &parts {
                assert!(r.contains(p.as_str()), "cut at {cut}: {r:?} lacks {p:?}");
            }
        }
        // Every cut inside the header or a tensor's bytes is refused.
        for cut in (0..last.end as usize).step_by(7) {
            assert!(read(&bytes[..cut]).is_err(), "cut at {cut}");
        }
    }

    #[test]
    fn gguf_bad_magic_is_refused() {
        let mut bytes = valid();
        bytes[..4].copy_from_slice(b"GGUX");
        assert_reason(&bytes, &["not a GGUF file", "magic"]);
        bytes[..4].copy_from_slice(&MAGIC_SWAPPED.to_le_bytes());
        assert_reason(&bytes, &["big-endian"]);
    }

    #[test]
    fn gguf_unknown_version_is_refused() {
        let mut bytes = valid();
        put_u32(&mut bytes, 4, 4);
        assert_reason(&bytes, &["unsupported GGUF version 4"]);
        put_u32(&mut bytes, 4, 0);
        assert_reason(&bytes, &["unsupported GGUF version 0"]);
    }

    #[test]
    fn gguf_absurd_tensor_count_is_refused() {
        let mut bytes = valid();
        put_u64(&mut bytes, 8, 1 << 40);
        assert_reason(&bytes, &["absurd tensor count 1099511627776"]);
    }

    #[test]
    fn gguf_absurd_metadata_count_is_refused() {
        let mut bytes = valid();
        put_u64(&mut bytes, 16, 1 << 40);
        assert_reason(&bytes, &["absurd metadata count 1099511627776"]);
        // Counts that fit one at a time but not together.
        let mut bytes = valid();
        let left = bytes.len() as u64 - 24;
        put_u64(&mut bytes, 16, left / 13);
        assert_reason(&bytes, &["tensors and", "metadata entries need at least"]);
    }

    #[test]
    fn gguf_absurd_string_length_is_refused() {
        let mut bytes = valid();
        let at = string_at(&bytes, "tiny");
        put_u64(&mut bytes, at, 1 << 60);
        assert_reason(
            &bytes,
            &[
                "metadata key 0 (`general.name`)",
                "the value",
                "an absurd length",
            ],
        );
        // A key's own length: the key has no name yet, only its index.
        let mut bytes = valid();
        let at = string_at(&bytes, "general.name");
        put_u64(&mut bytes, at, 1 << 60);
        assert_reason(&bytes, &["metadata key 0: the key", "an absurd length"]);
        // A tensor name's length.
        let mut bytes = valid();
        let at = string_at(&bytes, "w.q4_0");
        put_u64(&mut bytes, at, 1 << 60);
        assert_reason(&bytes, &["tensor 2: the name", "an absurd length"]);
    }

    #[test]
    fn gguf_absurd_array_length_is_refused() {
        let mut bytes = valid();
        let at = after(&bytes, "t.tokens") + 4 + 4; // value type, element type
        assert_eq!(get_u64(&bytes, at), 3);
        put_u64(&mut bytes, at, 1 << 50);
        assert_reason(&bytes, &["metadata key 6 (`t.tokens`)", "an absurd length"]);
        put_u64(&mut bytes, at, u64::MAX);
        assert_reason(&bytes, &["`t.tokens`", "an absurd length"]);
    }

    #[test]
    fn gguf_deeply_nested_arrays_are_refused() {
        fn nest(depth: usize) -> gguf_file::Value {
            let mut v = gguf_file::Value::Array(vec![gguf_file::Value::U8(1)]);
            for _ in 1..depth {
                v = gguf_file::Value::Array(vec![v]);
            }
            v
        }
        let ok = write(&[("t.nest", nest(MAX_ARRAY_DEPTH))], &qtensors());
        let h = read(&ok).expect("arrays at the depth limit");
        check_against_candle(&ok, &h);
        let deep = write(&[("t.nest", nest(MAX_ARRAY_DEPTH + 1))], &qtensors());
        assert_reason(
            &deep,
            &["metadata key 0 (`t.nest`)", "nested more than 8 deep"],
        );
    }

    #[test]
    fn gguf_non_utf8_string_is_refused() {
        let mut bytes = valid();
        let at = after(&bytes, "tiny") - 2;
        bytes[at] = 0xff;
        assert_reason(&bytes, &["metadata key 0 (`general.name`)", "not UTF-8"]);
        let mut bytes = valid();
        let at = after(&bytes, "w.q6k") - 1;
        bytes[at] = 0xc3;
        assert_reason(&bytes, &["tensor 5: the name", "not UTF-8"]);
    }

    #[test]
    fn gguf_unknown_value_type_is_refused() {
        let mut bytes = valid();
        let at = after(&bytes, "t.u32");
        put_u32(&mut bytes, at, 77);
        assert_reason(&bytes, &["`t.u32`", "unknown metadata value type 77"]);
        let mut bytes = valid();
        let at = after(&bytes, "t.tokens") + 4;
        put_u32(&mut bytes, at, 55);
        assert_reason(
            &bytes,
            &[
                "`t.tokens`",
                "element type",
                "unknown metadata value type 55",
            ],
        );
    }

    #[test]
    fn gguf_bad_bool_is_refused() {
        let mut bytes = valid();
        let at = after(&bytes, "t.bool") + 4;
        assert_eq!(bytes[at], 1);
        bytes[at] = 2;
        assert_reason(&bytes, &["`t.bool`", "bool byte 2"]);
    }

    #[test]
    fn gguf_duplicate_metadata_key_is_refused() {
        let mut meta = metadata();
        meta.push(("t.u32", gguf_file::Value::U32(8)));
        let bytes = write(&meta, &qtensors());
        assert_reason(&bytes, &["metadata key 7 (`t.u32`)", "appears twice"]);
    }

    #[test]
    fn gguf_bad_alignment_is_refused() {
        for bad in [0u32, 48, 3] {
            let mut bytes = valid();
            let at = after(&bytes, "general.alignment") + 4;
            assert_eq!(
                u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()),
                32
            );
            put_u32(&mut bytes, at, bad);
            assert_reason(&bytes, &["`general.alignment`", "non-zero power of two"]);
        }
        // A valid alignment the offsets do not respect (`w.f16` starts 96 bytes in).
        let mut bytes = valid();
        let at = after(&bytes, "general.alignment") + 4;
        put_u32(&mut bytes, at, 64);
        assert_reason(
            &bytes,
            &[
                "tensor `w.f16`",
                "the data offset: 96 (at byte",
                "is not a multiple of the alignment 64",
            ],
        );
    }

    #[test]
    fn gguf_unknown_ggml_type_is_refused() {
        let mut bytes = valid();
        let (_, _, ty, _) = fields(&bytes, "w.q4_0");
        assert_eq!(u32::from_le_bytes(bytes[ty..ty + 4].try_into().unwrap()), 2);
        put_u32(&mut bytes, ty, 99);
        assert_reason(&bytes, &["tensor `w.q4_0`", "unknown GGML type id 99"]);
    }

    #[test]
    fn gguf_bad_dimension_count_is_refused() {
        for n in [0u32, 5, u32::MAX] {
            let mut bytes = valid();
            let (at, _, _, _) = fields(&bytes, "w.f32");
            put_u32(&mut bytes, at, n);
            assert_reason(&bytes, &["tensor `w.f32`", &format!("{n} dimensions")]);
        }
    }

    #[test]
    fn gguf_overflowing_element_count_is_refused() {
        let mut bytes = valid();
        let (_, dims, _, _) = fields(&bytes, "w.f32");
        put_u64(&mut bytes, dims, 1 << 40);
        put_u64(&mut bytes, dims + 8, 1 << 40);
        assert_reason(&bytes, &["tensor `w.f32`", "element count", "overflows"]);
        // An element count that fits but a byte size that does not (F32: 4 bytes each).
        let mut bytes = valid();
        let (_, dims, _, _) = fields(&bytes, "w.f32");
        put_u64(&mut bytes, dims, 1 << 31);
        put_u64(&mut bytes, dims + 8, 1 << 31);
        assert_reason(&bytes, &["tensor `w.f32`", "byte size", "overflows"]);
    }

    #[test]
    fn gguf_partial_block_is_refused() {
        let mut bytes = valid();
        let (_, dims, _, _) = fields(&bytes, "w.q4_0");
        assert_eq!(get_u64(&bytes, dims), 64);
        put_u64(&mut bytes, dims, 33);
        assert_reason(
            &bytes,
            &[
                "tensor `w.q4_0`",
                "33 elements",
                "not a whole number of blocks",
                "32",
            ],
        );
    }

    #[test]
    fn gguf_tensor_offset_past_the_end_is_refused() {
        let mut bytes = valid();
        let (_, _, _, off) = fields(&bytes, "w.q6k");
        put_u64(&mut bytes, off, 1 << 40);
        let len = bytes.len();
        assert_reason(
            &bytes,
            &[
                "tensor `w.q6k` needs bytes",
                &format!("but the file is {len} bytes"),
            ],
        );
        // Offsets whose sum with the data section's start overflows.
        put_u64(&mut bytes, off, u64::MAX - 31);
        assert_reason(&bytes, &["tensor `w.q6k`", "overflows"]);
    }

    #[test]
    fn gguf_unaligned_tensor_offset_is_refused() {
        let mut bytes = valid();
        let (_, _, _, off) = fields(&bytes, "w.q8_0");
        let o = get_u64(&bytes, off);
        put_u64(&mut bytes, off, o + 1);
        assert_reason(
            &bytes,
            &["tensor `w.q8_0`", "not a multiple of the alignment 32"],
        );
    }

    #[test]
    fn gguf_overlapping_tensors_are_refused() {
        let mut bytes = valid();
        let (_, _, _, q4_0) = fields(&bytes, "w.q4_0");
        let (_, _, _, q4k) = fields(&bytes, "w.q4k");
        let o = get_u64(&bytes, q4_0);
        put_u64(&mut bytes, q4k, o);
        assert_reason(&bytes, &["`w.q4k`", "overlaps tensor `w.q4_0`"]);
    }

    #[test]
    fn gguf_duplicate_tensor_name_is_refused() {
        let mut qs = qtensors();
        qs[1].0 = "w.f32";
        let bytes = write(&metadata(), &qs);
        assert_reason(&bytes, &["tensor `w.f32` appears twice"]);
    }
}
