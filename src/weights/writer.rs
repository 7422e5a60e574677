//! Writing a safetensors file one tensor at a time, each at its final offset.
//!
//! [`save_safetensors_streaming`] lays the file out exactly as safetensors' own serializer does
//! (the header is that serializer's, produced from the tensors' names, dtypes, shapes and
//! lengths; the data follow in its order: dtype descending, then name), sizes the file once, and
//! then fills each tensor's byte range with positioned writes. A tensor's bytes come from one of
//! two [`Source`]s:
//!
//! - [`Source::Copy`]: a byte range of another file, copied file to file by the kernel
//!   (`copy_file_range` on Linux; a read-write loop through one 8 MiB buffer elsewhere or where
//!   the file systems refuse). No tensor-sized buffer, no page of it faulted into this process.
//! - [`Source::Produce`]: a closure that hands the bytes to a sink, in as many pieces as it likes,
//!   straight from wherever it holds them (a tensor's own storage): nothing is copied into an
//!   intermediate buffer.
//!
//! The file is written under a temporary name next to the destination and renamed into place
//! only when every tensor was written whole: on any error nothing is left at the destination (an
//! existing file there is kept) and the first error is returned.

use std::fs::File;
use std::path::Path;

use safetensors::tensor::Dtype as StDtype;

use super::safetensors::file_err;
use super::SafetensorsOptions;
use crate::error::{Error, Result};

/// Hands one piece of a tensor's bytes to the writer.
pub(crate) type Sink<'s> = dyn FnMut(&[u8]) -> Result<()> + 's;

/// A closure producing a tensor's little-endian bytes into a [`Sink`].
pub(crate) type Produce<'a> = Box<dyn Fn(&mut Sink<'_>) -> Result<()> + 'a>;

/// Where a [`LazyTensor`]'s bytes come from.
pub(crate) enum Source<'a> {
    /// `len` bytes of `file` (at `path`, for messages) from byte `offset`.
    Copy {
        file: &'a File,
        path: &'a Path,
        offset: u64,
    },
    /// Bytes produced when the tensor is written.
    Produce(Produce<'a>),
}

/// A tensor [`save_safetensors_streaming`] writes.
pub(crate) struct LazyTensor<'a> {
    pub(crate) name: String,
    pub(crate) dtype: StDtype,
    pub(crate) shape: Vec<usize>,
    /// Bytes its source must give.
    pub(crate) len: usize,
    pub(crate) source: Source<'a>,
}

/// Writes `tensors` to `path` as a safetensors file, one tensor at a time (see the
/// [module docs](self)): the header and bytes are those [`save_safetensors`](super::save_safetensors)
/// writes for the same tensors; memory holds at most what a [`Source::Produce`] closure holds.
///
/// # Errors
/// [`Error::File`] naming `path` when the header cannot be built or the file cannot be written,
/// or naming a tensor whose source gave a different number of bytes than its header says; the
/// error of a source that failed.
pub(crate) fn save_safetensors_streaming(
    path: &Path,
    mut tensors: Vec<LazyTensor<'_>>,
    options: &SafetensorsOptions,
) -> Result<()> {
    // Safetensors' own order: descending dtype (alignment), then name.
    tensors.sort_by(|a, b| b.dtype.cmp(&a.dtype).then_with(|| a.name.cmp(&b.name)));
    let header = header_bytes(path, &tensors, options)?;
    let file_name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let temp = path.with_file_name(format!(".{file_name}.{}.partial", std::process::id()));
    let result = write_all(path, &temp, &header, &tensors).and_then(|()| {
        std::fs::rename(&temp, path).map_err(|e| {
            file_err(
                path,
                format!("cannot move the written file into place: {e}"),
            )
        })
    });
    if result.is_err() {
        let _ = std::fs::remove_file(&temp);
    }
    result
}

/// The first bytes of the file: the header's length and the header, as safetensors' serializer
/// writes them for `tensors` (serialized with empty data, which is then exactly the header).
fn header_bytes(
    path: &Path,
    tensors: &[LazyTensor<'_>],
    options: &SafetensorsOptions,
) -> Result<Vec<u8>> {
    struct Shape<'t>(&'t LazyTensor<'t>);
    impl safetensors::View for Shape<'_> {
        fn dtype(&self) -> StDtype {
            self.0.dtype
        }
        fn shape(&self) -> &[usize] {
            &self.0.shape
        }
        fn data(&self) -> std::borrow::Cow<'_, [u8]> {
            std::borrow::Cow::Borrowed(&[])
        }
        fn data_len(&self) -> usize {
            self.0.len
        }
    }
    let views = tensors.iter().map(|t| (t.name.as_str(), Shape(t)));
    safetensors::tensor::serialize(views, options.metadata.clone())
        .map_err(|e| file_err(path, format!("cannot write the header: {e}")))
}

/// Creates `temp` at its final size and fills it: the header, then each tensor at its offset.
/// Errors name `path`, the file being written.
fn write_all(path: &Path, temp: &Path, header: &[u8], tensors: &[LazyTensor<'_>]) -> Result<()> {
    let err = |what: String| move |e: std::io::Error| file_err(path, format!("{what}: {e}"));
    let file = File::create(temp).map_err(err("cannot create".into()))?;
    let total = tensors.iter().map(|t| t.len as u64).sum::<u64>() + header.len() as u64;
    file.set_len(total)
        .map_err(err(format!("cannot size to {total} bytes")))?;
    write_all_at(&file, header, 0).map_err(err("cannot write the header".into()))?;
    let mut offset = header.len() as u64;
    let mut copier = Copier::default();
    for t in tensors {
        match &t.source {
            Source::Copy {
                file: from,
                path: from_path,
                offset: from_offset,
            } => copier
                .copy(from, *from_offset, &file, offset, t.len as u64)
                .map_err(|e| {
                    file_err(
                        path,
                        format!(
                            "tensor `{}`: cannot copy {} bytes from `{}`: {e}",
                            t.name,
                            t.len,
                            from_path.display()
                        ),
                    )
                })?,
            Source::Produce(produce) => {
                let mut written = 0usize;
                let mut sink = |bytes: &[u8]| -> Result<()> {
                    if written + bytes.len() > t.len {
                        return Err(wrong_length(path, t, written + bytes.len()));
                    }
                    write_all_at(&file, bytes, offset + written as u64).map_err(|e| {
                        file_err(path, format!("tensor `{}`: cannot write: {e}", t.name))
                    })?;
                    written += bytes.len();
                    Ok(())
                };
                produce(&mut sink)?;
                if written != t.len {
                    return Err(wrong_length(path, t, written));
                }
            }
        }
        offset += t.len as u64;
    }
    Ok(())
}

fn wrong_length(path: &Path, t: &LazyTensor<'_>, got: usize) -> Error {
    file_err(
        path,
        format!(
            "tensor `{}`: produced {got} bytes, its header says {}",
            t.name, t.len
        ),
    )
}

/// Copies byte ranges between files: in the kernel where it can, else through one buffer that
/// is kept for the next copy.
struct Copier {
    /// Set once the kernel refused a copy: every later copy takes the buffer.
    buffered: bool,
    /// The buffered path's buffer size.
    chunk: usize,
    buf: Vec<u8>,
}

impl Default for Copier {
    fn default() -> Self {
        Copier {
            buffered: false,
            chunk: 8 << 20,
            buf: Vec::new(),
        }
    }
}

impl Copier {
    fn copy(
        &mut self,
        from: &File,
        mut from_offset: u64,
        to: &File,
        mut to_offset: u64,
        mut len: u64,
    ) -> std::io::Result<()> {
        if !self.buffered {
            match kernel_copy(from, from_offset, to, to_offset, len)? {
                None => return Ok(()),
                Some(done) => {
                    // The kernel refused (before or after `done` bytes): the rest goes through
                    // the buffer, as does every later copy.
                    self.buffered = true;
                    from_offset += done;
                    to_offset += done;
                    len -= done;
                }
            }
        }
        if len == 0 {
            return Ok(());
        }
        let chunk = self.chunk.min(usize::try_from(len).unwrap_or(self.chunk));
        if self.buf.len() < chunk {
            self.buf.resize(chunk, 0);
        }
        while len > 0 {
            let n = chunk.min(usize::try_from(len).unwrap_or(chunk));
            let piece = &mut self.buf[..n];
            super::safetensors::read_exact_at(from, piece, from_offset)?;
            write_all_at(to, piece, to_offset)?;
            from_offset += n as u64;
            to_offset += n as u64;
            len -= n as u64;
        }
        Ok(())
    }
}

/// `copy_file_range` until `len` bytes are copied: `Ok(None)` when all were, `Ok(Some(done))`
/// when the kernel cannot copy between these files (after `done` bytes), an error for a real
/// I/O failure.
#[cfg(target_os = "linux")]
fn kernel_copy(
    from: &File,
    from_offset: u64,
    to: &File,
    to_offset: u64,
    len: u64,
) -> std::io::Result<Option<u64>> {
    use std::os::fd::AsRawFd;
    let mut done = 0u64;
    while done < len {
        let (Ok(mut off_in), Ok(mut off_out)) = (
            libc::loff_t::try_from(from_offset + done),
            libc::loff_t::try_from(to_offset + done),
        ) else {
            return Ok(Some(done));
        };
        let want = usize::try_from(len - done)
            .unwrap_or(usize::MAX)
            .min(1 << 30);
        // SAFETY: both descriptors are open for the duration of the call (borrowed `File`s),
        // the offsets are plain integers on this stack, and `copy_file_range` writes nothing
        // into this process's memory.
        let n = unsafe {
            libc::copy_file_range(
                from.as_raw_fd(),
                &mut off_in,
                to.as_raw_fd(),
                &mut off_out,
                want,
                0,
            )
        };
        match n {
            0 => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "the source file ended early",
                ))
            }
            n if n > 0 => done += n as u64,
            _ => {
                let e = std::io::Error::last_os_error();
                return match e.raw_os_error() {
                    Some(libc::EINTR) => continue,
                    Some(
                        libc::ENOSYS | libc::EXDEV | libc::EINVAL | libc::EOPNOTSUPP | libc::EPERM,
                    ) => Ok(Some(done)),
                    _ => Err(e),
                };
            }
        }
    }
    Ok(None)
}

/// No kernel copy here: everything goes through the buffer.
#[cfg(not(target_os = "linux"))]
fn kernel_copy(
    _from: &File,
    _from_offset: u64,
    _to: &File,
    _to_offset: u64,
    _len: u64,
) -> std::io::Result<Option<u64>> {
    Ok(Some(0))
}

/// Writes all of `buf` to `file` at `offset` (a positioned write: the cursor is not used).
#[cfg(unix)]
fn write_all_at(file: &File, buf: &[u8], offset: u64) -> std::io::Result<()> {
    std::os::unix::fs::FileExt::write_all_at(file, buf, offset)
}

/// Writes all of `buf` to `file` at `offset`.
#[cfg(windows)]
fn write_all_at(file: &File, mut buf: &[u8], mut offset: u64) -> std::io::Result<()> {
    while !buf.is_empty() {
        match std::os::windows::fs::FileExt::seek_write(file, buf, offset)? {
            0 => return Err(std::io::ErrorKind::WriteZero.into()),
            n => {
                buf = &buf[n..];
                offset += n as u64;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn produce<'a>(bytes: &'a [u8], pieces: usize) -> Source<'a> {
        Source::Produce(Box::new(move |sink| {
            for part in bytes.chunks(bytes.len().div_ceil(pieces).max(1)) {
                sink(part)?;
            }
            Ok(())
        }))
    }

    /// Tensors of three dtypes, some copied from a file and some produced in pieces, plus
    /// metadata: the file is byte for byte safetensors' own serialization of the same tensors.
    #[test]
    fn the_file_is_safetensors_own_serialization() {
        let dir = tempfile::tempdir().unwrap();
        let source_path = dir.path().join("source.bin");
        let source: Vec<u8> = (0..4096u32).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(&source_path, &source).unwrap();
        let source_file = File::open(&source_path).unwrap();
        let f32s: Vec<u8> = (0..24u8).collect();
        let f16s: Vec<u8> = (100..112u8).collect();
        let copy = |offset: u64| Source::Copy {
            file: &source_file,
            path: &source_path,
            offset,
        };
        let tensors = vec![
            // Out of safetensors' order on purpose.
            ("z.u8", StDtype::U8, vec![5], 5usize, copy(1000)),
            ("b.f32", StDtype::F32, vec![2, 3], 24, produce(&f32s, 4)),
            ("a.f16", StDtype::F16, vec![6], 12, produce(&f16s, 1)),
            ("c.f32", StDtype::F32, vec![4, 100], 1600, copy(7)),
        ];
        let expected_data: Vec<(&str, StDtype, Vec<usize>, Vec<u8>)> = vec![
            ("z.u8", StDtype::U8, vec![5], source[1000..1005].to_vec()),
            ("b.f32", StDtype::F32, vec![2, 3], f32s.clone()),
            ("a.f16", StDtype::F16, vec![6], f16s.clone()),
            (
                "c.f32",
                StDtype::F32,
                vec![4, 100],
                source[7..1607].to_vec(),
            ),
        ];
        let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
        let out = dir.path().join("out.safetensors");
        save_safetensors_streaming(
            &out,
            tensors
                .into_iter()
                .map(|(name, dtype, shape, len, source)| LazyTensor {
                    name: name.into(),
                    dtype,
                    shape,
                    len,
                    source,
                })
                .collect(),
            &SafetensorsOptions {
                metadata: Some(metadata.clone()),
            },
        )
        .unwrap();
        let views: Vec<_> = expected_data
            .iter()
            .map(|(name, dtype, shape, bytes)| {
                let view = safetensors::tensor::TensorView::new(*dtype, shape.clone(), bytes)
                    .expect("a valid view");
                (*name, view)
            })
            .collect();
        let expected = safetensors::tensor::serialize(views, Some(metadata)).unwrap();
        assert_eq!(std::fs::read(&out).unwrap(), expected);
    }

    /// The read-write loop a kernel refusal falls back to copies the same bytes, across several
    /// buffer fills with a short last one.
    #[test]
    fn the_buffered_copy_copies_exactly_the_range() {
        let dir = tempfile::tempdir().unwrap();
        let data: Vec<u8> = (0..1000u32).map(|i| (i % 253) as u8).collect();
        std::fs::write(dir.path().join("from"), &data).unwrap();
        let from = File::open(dir.path().join("from")).unwrap();
        let to = File::create(dir.path().join("to")).unwrap();
        to.set_len(600).unwrap();
        let mut copier = Copier {
            buffered: true,
            chunk: 64,
            buf: Vec::new(),
        };
        copier.copy(&from, 123, &to, 50, 517).unwrap();
        assert_eq!(copier.buf.len(), 64, "one buffer of the chunk size, reused");
        let written = std::fs::read(dir.path().join("to")).unwrap();
        assert_eq!(&written[50..567], &data[123..640]);
        assert!(written[..50].iter().chain(&written[567..]).all(|&b| b == 0));
        // A range past the end of the source is an error, not a short copy.
        let err = copier.copy(&from, 900, &to, 0, 200).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::UnexpectedEof);
    }

    /// A source that gives fewer or more bytes than its header says, or copies from a file that
    /// ends early, fails the write naming the tensor; nothing is left behind and an existing file
    /// at the destination is kept.
    #[test]
    fn a_source_of_the_wrong_length_fails_and_leaves_the_old_file() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out.safetensors");
        std::fs::write(&out, b"the previous file").unwrap();
        let short_path = dir.path().join("short.bin");
        std::fs::write(&short_path, [9u8; 10]).unwrap();
        let short = File::open(&short_path).unwrap();
        let bytes = [1u8, 2, 3, 4, 5];
        let cases: Vec<(Source<'_>, &str)> = vec![
            (
                produce(&bytes[..3], 2),
                "produced 3 bytes, its header says 4",
            ),
            (produce(&bytes, 2), "produced 5 bytes, its header says 4"),
            (
                Source::Copy {
                    file: &short,
                    path: &short_path,
                    offset: 8,
                },
                "cannot copy 4 bytes from",
            ),
        ];
        for (source, message) in cases {
            let tensor = LazyTensor {
                name: "the.tensor".into(),
                dtype: StDtype::U8,
                shape: vec![4],
                len: 4,
                source,
            };
            let err = save_safetensors_streaming(&out, vec![tensor], &Default::default())
                .expect_err("the length is wrong");
            let text = err.to_string();
            assert!(matches!(err, Error::File { .. }), "{text}");
            assert!(
                text.contains("the.tensor") && text.contains(message),
                "{text}"
            );
            assert_eq!(std::fs::read(&out).unwrap(), b"the previous file");
            assert_eq!(
                std::fs::read_dir(dir.path()).unwrap().count(),
                2,
                "a file was left"
            );
        }
    }
}
