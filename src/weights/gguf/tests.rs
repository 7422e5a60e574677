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
fn gguf_zero_dimension_is_refused() {
    // Each dimension of a dense, a quantized and a rank-3 tensor (ne[0] too: 0 is a whole
    // number of blocks).
    for (name, n) in [("w.f32", 2), ("w.q4_0", 2), ("w.q8_0", 3)] {
        for i in 0..n {
            let mut bytes = valid();
            let (_, dims, _, _) = fields(&bytes, name);
            put_u64(&mut bytes, dims + 8 * i, 0);
            assert_reason(
                &bytes,
                &[
                    &format!("tensor `{name}`"),
                    &format!("dimension ne[{i}]"),
                    "is 0",
                ],
            );
        }
    }
    // A stack of empty experts whose count no byte of the file bounds.
    let mut bytes = valid();
    let (_, dims, _, _) = fields(&bytes, "w.q8_0");
    put_u64(&mut bytes, dims + 8, 0);
    put_u64(&mut bytes, dims + 16, 1 << 40);
    assert_reason(&bytes, &["tensor `w.q8_0`", "ne[1]", "1099511627776"]);
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

#[test]
fn the_held_outside_warning_names_the_cure_that_fits_how_the_weights_were_read() {
    // A quantized weight held outside was dequantized by the model's code (a port of
    // `quantized_llama` does it to its token table): the cure is a layer on its blocks, not a
    // VarBuilder call; a dense one was handed out by `VarBuilder::get`.
    let f = temp(&valid());
    let model = crate::weights::Model::from_gguf("tiny", f.path()).expect("read");
    let b = crate::size::ByteSize::kib(1);
    let quantized = model.outside_warning(&[("w.q8_0".to_string(), b)], b);
    assert!(
        quantized.contains("Embedding::from_qtensor") && !quantized.contains("VarBuilder::get"),
        "{quantized}"
    );
    let dense = model.outside_warning(&[("w.f32".to_string(), b)], b);
    assert!(dense.contains("VarBuilder::get_managed"), "{dense}");
    assert!(
        dense.contains("`tiny`") && dense.contains("w.f32"),
        "{dense}"
    );
}
