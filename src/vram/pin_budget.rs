//! How much host memory may be page-locked: a pure function of the host snapshot.
//!
//! Page-locked (pinned) memory cannot be swapped or reclaimed, so pinning too much starves the
//! rest of the machine. The budget follows ComfyUI's 2026 behaviour, whose published figures are
//! this module's table test:
//!
//! | RAM | swap | budget |
//! |---|---|---|
//! | 64 GiB | none | 48 GiB |
//! | 64 GiB | 32 GiB | 57.6 GiB |
//! | 16 GiB | none | 6.4 GiB |
//! | 128 GiB | none | 112 GiB |
//!
//! One formula gives exactly these figures:
//!
//! `budget = max(0.4 × RAM, min(0.9 × RAM, RAM + swap − 16 GiB))`
//!
//! - `0.9 × RAM` is ComfyUI's Linux ceiling (`ram * 0.90`): never lock the last tenth;
//! - `RAM + swap − 16 GiB` keeps [`PIN_HEADROOM`] of memory the rest of the system can use;
//!   swap counts, because the kernel can page other memory out to make room for what it needs;
//! - `0.4 × RAM` is ComfyUI's Windows figure (`ram * 0.40`), here the floor on small machines,
//!   where 16 GiB of headroom would leave nothing to pin.
//!
//! RAM is the snapshot's total, which is already clipped by the cgroup v2 limit, and swap is
//! clipped by `memory.swap.max` ([`crate::vram::Hardware::probe`]), so a container's limit caps the
//! budget too. Windows keeps ComfyUI's `0.4 × RAM`. Without a CUDA driver, or with
//! `--disable-pinned-memory`, nothing is pinned: the budget is zero.

use super::probe::{HostInfo, Os};
use crate::size::ByteSize;

/// Memory the pin budget leaves to the rest of the system, counting swap: 16 GiB.
pub const PIN_HEADROOM: ByteSize = ByteSize::gib(16);

/// The most host memory that may be page-locked (staging buffers and weights pinned in place
/// together), pure. See the module docs for the formula and where it comes from.
pub fn pin_budget(host: &HostInfo, os: Os, cuda: bool, disabled: bool) -> ByteSize {
    if !cuda || disabled {
        return ByteSize::ZERO;
    }
    let ram = host.total.as_f64();
    if os == Os::Windows {
        return ByteSize::from_f64(0.4 * ram);
    }
    let headroom = ram + host.swap_total.as_f64() - PIN_HEADROOM.as_f64();
    ByteSize::from_f64((0.4 * ram).max((0.9 * ram).min(headroom)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(ram: ByteSize, swap: ByteSize) -> HostInfo {
        HostInfo {
            total: ram,
            available: ram,
            swap_total: swap,
        }
    }

    fn gib(x: f64) -> ByteSize {
        ByteSize::from_f64(x * 1024.0 * 1024.0 * 1024.0)
    }

    #[test]
    fn comfyui_pin_budget_facts() {
        let z = ByteSize::ZERO;
        for (ram, swap, want) in [
            (gib(64.0), z, gib(48.0)),
            (gib(64.0), gib(32.0), gib(57.6)),
            (gib(16.0), z, gib(6.4)),
            (gib(128.0), z, gib(112.0)),
        ] {
            let got = pin_budget(&host(ram, swap), Os::Linux, true, false);
            let err = (got.as_f64() - want.as_f64()).abs();
            assert!(err <= 1.0, "{ram} RAM, {swap} swap: {got}, want {want}");
        }
    }

    #[test]
    fn no_cuda_or_disabled_pins_nothing() {
        let h = host(ByteSize::gib(64), ByteSize::ZERO);
        assert_eq!(pin_budget(&h, Os::Linux, false, false), ByteSize::ZERO);
        assert_eq!(pin_budget(&h, Os::Linux, true, true), ByteSize::ZERO);
    }

    #[test]
    fn a_cgroup_limit_caps_the_budget() {
        // A 64 GiB machine in a 16 GiB container: the probe's total is the cgroup limit.
        let meminfo = "MemTotal: 67108864 kB\nMemAvailable: 60000000 kB\nSwapTotal: 0 kB\n";
        let h = crate::vram::host_from_texts(meminfo, Some("17179869184"), Some("0"));
        let got = pin_budget(&h, Os::Linux, true, false);
        assert!((got.as_f64() - gib(6.4).as_f64()).abs() <= 1.0, "{got}");
        // Swap the container may not use does not count.
        let mut h = h;
        h.swap_total = crate::vram::swap_within_cgroup(ByteSize::gib(32), Some("0"));
        assert_eq!(pin_budget(&h, Os::Linux, true, false), got);
    }

    #[test]
    fn the_budget_grows_with_ram_and_never_passes_nine_tenths() {
        let mut last = ByteSize::ZERO;
        for g in 1..=512u64 {
            for swap in [0u64, 8, 64] {
                let ram = ByteSize::gib(g);
                let b = pin_budget(&host(ram, ByteSize::gib(swap)), Os::Linux, true, false);
                assert!(b.as_f64() <= 0.9 * ram.as_f64() + 1.0, "{ram}: {b}");
                assert!(b.as_f64() >= 0.4 * ram.as_f64() - 1.0, "{ram}: {b}");
                if swap == 0 {
                    assert!(b >= last, "{ram}: {b} < {last}");
                    last = b;
                }
            }
        }
    }

    #[test]
    fn windows_keeps_two_fifths() {
        let h = host(ByteSize::gib(64), ByteSize::gib(32));
        let got = pin_budget(&h, Os::Windows, true, false);
        assert!((got.as_f64() - gib(25.6).as_f64()).abs() <= 1.0, "{got}");
    }
}
