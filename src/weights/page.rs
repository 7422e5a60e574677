//! Host buffers whose pages are their own, so each weight can be page-locked in place.
//!
//! The driver page-locks memory by whole pages (`cuMemHostRegister`; the simulated GPU does the
//! same, docs/ARCHITECTURE.md §6.2) and refuses a registration that touches a page already
//! locked. A weight read into an ordinary heap buffer shares its first and last pages with
//! whatever the allocator put next to it, so once one weight was pinned its neighbours' pins were
//! refused and those weights were staged instead: hundreds of refusals a run, and most of the
//! streamed bytes copied through staging buffers.
//!
//! A [`PageBuf`] of `n` elements starts on a page boundary and is followed by the rest of its last
//! page, all inside one allocation of its own: the whole pages its bytes touch belong to it alone,
//! so [`PinnedWeight`](super::PinnedWeight) registers exactly those pages (a page-aligned address
//! and size, as the driver wants) and no other weight's pin can collide with them. It is a
//! `Vec<T>` a little longer than `n`, with the page-aligned `n` elements inside it: a candle tensor
//! must own a `Vec` of its element type, freed with that type's alignment, so the alignment cannot
//! be asked of the allocator; the tensor it becomes is a view of those `n` elements that shares
//! the whole vector as its storage (no copy).
//!
//! Cost: under two pages per buffer (at most a page before the bytes to reach a boundary, and the
//! rest of their last page after them; 8 KiB with 4 KiB pages), and only buffers of at least
//! [`MIN_PIN_BYTES`] are laid out so — smaller weights are never pinned. That is at most 3.2 % of
//! a 256 KiB weight and under 0.2 % of a 4 MiB one. The host tier's ledger counts the tensor's
//! bytes, not this slack; a pin counts (and is budgeted for) the whole pages it locks.

use std::sync::OnceLock;

use candle_core::{Device, Tensor, WithDType};

use super::host::MIN_PIN_BYTES;

/// The host's page size: what the driver locks memory by (4 KiB unless the system says else).
pub(crate) fn page_size() -> usize {
    static PAGE: OnceLock<usize> = OnceLock::new();
    *PAGE.get_or_init(|| {
        #[cfg(unix)]
        {
            // SAFETY: `sysconf` reads a system constant; it touches no memory of ours.
            let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
            match usize::try_from(page) {
                Ok(page) if page.is_power_of_two() => page,
                _ => 4096,
            }
        }
        #[cfg(not(unix))]
        {
            4096
        }
    })
}

/// `addr..addr + len` rounded out to whole pages, as `(address, length)`: the memory the driver
/// locks to page-lock those bytes.
pub(crate) fn page_span(addr: usize, len: usize) -> (usize, usize) {
    let page = page_size();
    let start = addr - addr % page;
    let end = addr.saturating_add(len).next_multiple_of(page);
    (start, end - start)
}

/// A zeroed vector of `n` elements (the allocator's zeroed pages: untouched until read into).
fn zeroed<T: WithDType>(n: usize) -> Vec<T> {
    vec![T::from_f64(0.0); n]
}

/// A zeroed host buffer of `len` elements that, when it is large enough to be pinned, starts on a
/// page boundary inside an allocation that holds its last page too (see the module docs).
pub(crate) struct PageBuf<T> {
    vec: Vec<T>,
    /// Index in `vec` of the first element.
    start: usize,
    len: usize,
}

impl<T: WithDType> PageBuf<T> {
    /// `len` zeroed elements, page-aligned when they are at least [`MIN_PIN_BYTES`].
    pub(crate) fn zeroed(len: usize) -> PageBuf<T> {
        let size = std::mem::size_of::<T>();
        let page = page_size();
        let plain = || PageBuf {
            vec: zeroed(len),
            start: 0,
            len,
        };
        let Some(bytes) = len.checked_mul(size) else {
            return plain();
        };
        if (bytes as u64) < MIN_PIN_BYTES.bytes() || !page.is_multiple_of(size) {
            return plain();
        }
        // Up to a page before the bytes to reach a boundary, and the rest of their last page.
        let Some(cap) = bytes
            .checked_next_multiple_of(page)
            .and_then(|b| b.checked_add(page))
        else {
            return plain();
        };
        let vec: Vec<T> = zeroed(cap / size);
        let addr = vec.as_ptr() as usize;
        let skip = addr.next_multiple_of(page) - addr;
        if !skip.is_multiple_of(size) {
            // An element type aligned to less than its size: no element starts on the boundary.
            return plain();
        }
        PageBuf {
            vec,
            start: skip / size,
            len,
        }
    }

    /// The `len` elements.
    pub(crate) fn as_mut_slice(&mut self) -> &mut [T] {
        &mut self.vec[self.start..self.start + self.len]
    }

    /// The elements as a CPU tensor of `shape` (which must hold `len` elements): a view of them
    /// sharing this buffer as its storage, no copy.
    pub(crate) fn into_tensor(self, shape: &[usize]) -> candle_core::Result<Tensor> {
        if self.start == 0 && self.vec.len() == self.len {
            return Tensor::from_vec(self.vec, shape, &Device::Cpu);
        }
        let all = self.vec.len();
        Tensor::from_vec(self.vec, all, &Device::Cpu)?
            .narrow(0, self.start, self.len)?
            .reshape(shape)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::host_bytes;

    #[test]
    fn a_pinnable_buffer_starts_on_a_page_and_owns_its_last_page() {
        let page = page_size();
        // Not a whole number of pages, and sizes either side of the threshold.
        for (len, aligned) in [(80_001usize, true), (65_536, true), (65_535, false)] {
            let mut b = PageBuf::<f32>::zeroed(len);
            b.as_mut_slice()[len - 1] = 7.0;
            let t = b.into_tensor(&[len]).unwrap();
            assert_eq!(t.dims(), &[len]);
            assert_eq!(t.get(len - 1).unwrap().to_scalar::<f32>().unwrap(), 7.0);
            let (addr, bytes) = host_bytes(&t).unwrap();
            assert_eq!(bytes, len * 4);
            assert_eq!(addr % page == 0, aligned, "{len}");
            if aligned {
                // The page-rounded range lies inside the tensor's own storage.
                let (storage, _) = t.storage_and_layout();
                let candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)) = &*storage else {
                    unreachable!("a CPU f32 tensor")
                };
                let (lo, n) = page_span(addr, bytes);
                let base = v.as_ptr() as usize;
                assert!(lo >= base && lo + n <= base + std::mem::size_of_val(v.as_slice()));
                assert!(n - bytes < page, "only the rest of the last page");
            }
        }
    }

    #[test]
    fn page_span_rounds_out_to_whole_pages() {
        let p = page_size();
        assert_eq!(page_span(p, p), (p, p));
        assert_eq!(page_span(p + 16, p), (p, 2 * p));
        assert_eq!(page_span(2 * p - 1, 2), (p, 2 * p));
    }
}
