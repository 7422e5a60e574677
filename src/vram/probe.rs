//! Reading the machine into a plain [`Hardware`] snapshot.
//!
//! [`Hardware::probe`] is the only code that asks the machine anything: the CUDA driver through
//! cudarc (loaded at run time; a machine without `libcuda` has no GPU, never a panic), and host
//! memory: on Linux (and other Unixes) from `/proc/meminfo` clipped by the cgroup v2 limit, on
//! macOS and Windows from the OS's counters through `sysinfo`. Everything else in the crate takes
//! a `Hardware` value, so tests build one by hand.

use crate::size::ByteSize;

/// GPU vendor, as far as the policies care.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Vendor {
    /// NVIDIA (CUDA).
    Nvidia,
    /// AMD (ROCm); not probed yet, but hand-built snapshots may use it.
    Amd,
    /// Apple silicon (Metal, unified memory).
    Apple,
    /// Anything else.
    Other,
}

/// Operating system, for the reserve rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Os {
    /// Linux.
    Linux,
    /// macOS.
    MacOs,
    /// Windows.
    Windows,
}

impl Os {
    /// The OS this binary was built for.
    pub fn current() -> Os {
        if cfg!(target_os = "windows") {
            Os::Windows
        } else if cfg!(target_os = "macos") {
            Os::MacOs
        } else {
            Os::Linux
        }
    }
}

/// One GPU.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuInfo {
    /// Device ordinal (`cuda:N`).
    pub ordinal: usize,
    /// The driver's name for it, e.g. `NVIDIA GeForce RTX 4090`.
    pub name: String,
    /// Vendor.
    pub vendor: Vendor,
    /// Total device memory.
    pub total: ByteSize,
    /// Free device memory when probed.
    pub free: ByteSize,
    /// Compute capability (major, minor); `(0, 0)` when unknown.
    pub compute_capability: (u32, u32),
    /// Whether device memory is the host's memory (integrated GPUs, Apple silicon).
    pub unified_memory: bool,
}

impl GpuInfo {
    /// A hand-built NVIDIA GPU with all of its memory free (for tests and simulations).
    pub fn nvidia(ordinal: usize, name: &str, total: ByteSize, cc: (u32, u32)) -> GpuInfo {
        GpuInfo {
            ordinal,
            name: name.to_string(),
            vendor: Vendor::Nvidia,
            total,
            free: total,
            compute_capability: cc,
            unified_memory: false,
        }
    }
}

/// Host RAM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostInfo {
    /// Total RAM (clipped by the cgroup limit).
    pub total: ByteSize,
    /// Available RAM (`MemAvailable`, clipped by the cgroup's remaining allowance).
    pub available: ByteSize,
    /// Total swap (`SwapTotal`, clipped by the cgroup v2 `memory.swap.max`); the pin budget
    /// ([`crate::vram::pin_budget`]) counts it as headroom.
    pub swap_total: ByteSize,
}

/// A snapshot of the machine. Plain data: build it by hand in tests.
#[derive(Debug, Clone, PartialEq)]
pub struct Hardware {
    /// GPUs, by ordinal.
    pub gpus: Vec<GpuInfo>,
    /// Host memory.
    pub host: HostInfo,
    /// Operating system.
    pub os: Os,
}

impl Hardware {
    /// A machine with no GPU and the given RAM, all available.
    pub fn cpu_only(ram: ByteSize) -> Hardware {
        Hardware {
            gpus: Vec::new(),
            host: HostInfo {
                total: ram,
                available: ram,
                swap_total: ByteSize::ZERO,
            },
            os: Os::Linux,
        }
    }

    /// A Linux machine with one GPU and 32 GiB of RAM.
    pub fn with_gpu(gpu: GpuInfo) -> Hardware {
        let mut hw = Hardware::cpu_only(ByteSize::gib(32));
        hw.gpus.push(gpu);
        hw
    }

    /// Reads the machine: CUDA GPUs (none when the driver library is absent or fails) and host RAM.
    pub fn probe() -> Hardware {
        Hardware {
            gpus: probe_cuda(),
            host: probe_host(),
            os: Os::current(),
        }
    }

    /// The GPU with this ordinal.
    pub fn gpu(&self, ordinal: usize) -> Option<&GpuInfo> {
        self.gpus.iter().find(|g| g.ordinal == ordinal)
    }
}

/// Driver library names, in the order the loader tries them.
const CUDA_DRIVER_NAMES: &[&str] = &["libcuda.so.1", "libcuda.so", "nvcuda.dll", "libcuda.dylib"];

/// Whether the CUDA driver library can be opened. cudarc panics on its first call when it
/// cannot, so this is asked before any cudarc call.
pub fn cuda_driver_present() -> bool {
    CUDA_DRIVER_NAMES.iter().any(|name| {
        // SAFETY: opening the CUDA driver runs its initialisers, which have no preconditions
        // for us; the library is dropped (closed) again immediately, and cudarc opens its own.
        unsafe { libloading::Library::new(name) }.is_ok()
    })
}

fn probe_cuda() -> Vec<GpuInfo> {
    if !cuda_driver_present() {
        tracing::debug!("no CUDA driver library: no GPU");
        return Vec::new();
    }
    // A driver older than the symbols cudarc expects makes cudarc panic; treat that as no GPU.
    match std::panic::catch_unwind(probe_cuda_devices) {
        Ok(Ok(gpus)) => gpus,
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "CUDA driver present but not usable: no GPU");
            crate::warnings::echo("cuda-driver", || {
                format!("CUDA driver present but not usable ({e}): no GPU")
            });
            Vec::new()
        }
        Err(_) => {
            tracing::warn!("CUDA driver present but incompatible with cudarc: no GPU");
            crate::warnings::echo("cuda-driver", || {
                "CUDA driver present but incompatible with cudarc: no GPU".to_string()
            });
            Vec::new()
        }
    }
}

fn probe_cuda_devices() -> Result<Vec<GpuInfo>, cudarc::driver::DriverError> {
    use cudarc::driver::{result, CudaContext};
    result::init()?;
    let count = CudaContext::device_count()?;
    let mut gpus = Vec::new();
    for ordinal in 0..count.max(0) as usize {
        let ctx = CudaContext::new(ordinal)?;
        let (major, minor) = ctx.compute_capability()?;
        let (free, total) = ctx.mem_get_info()?;
        let integrated = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_INTEGRATED)
            .unwrap_or(0);
        gpus.push(GpuInfo {
            ordinal,
            name: ctx.name()?,
            vendor: Vendor::Nvidia,
            total: ByteSize(total as u64),
            free: ByteSize(free as u64),
            compute_capability: (major.max(0) as u32, minor.max(0) as u32),
            unified_memory: integrated != 0,
        });
    }
    Ok(gpus)
}

/// The driver's free memory on CUDA device `ordinal` right now, or `None` without a usable
/// driver.
pub fn driver_free_memory(ordinal: usize) -> Option<ByteSize> {
    if !cuda_driver_present() {
        return None;
    }
    let r = std::panic::catch_unwind(|| {
        let ctx = cudarc::driver::CudaContext::new(ordinal)?;
        ctx.mem_get_info()
    });
    match r {
        Ok(Ok((free, _total))) => Some(ByteSize(free as u64)),
        _ => None,
    }
}

/// Host RAM from `/proc/meminfo`, clipped by the cgroup v2 limit where one is set.
#[cfg(not(any(target_os = "macos", target_os = "windows")))]
fn probe_host() -> HostInfo {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let cg_max = std::fs::read_to_string("/sys/fs/cgroup/memory.max").ok();
    let cg_current = std::fs::read_to_string("/sys/fs/cgroup/memory.current").ok();
    let mut host = host_from_texts(&meminfo, cg_max.as_deref(), cg_current.as_deref());
    let cg_swap = std::fs::read_to_string("/sys/fs/cgroup/memory.swap.max").ok();
    host.swap_total = swap_within_cgroup(host.swap_total, cg_swap.as_deref());
    host
}

/// Swap capped by the cgroup v2 `memory.swap.max` text (`max`, or absent: no cap). Pure.
pub fn swap_within_cgroup(swap_total: ByteSize, cg_swap_max: Option<&str>) -> ByteSize {
    match cg_swap_max.and_then(|s| s.trim().parse::<u64>().ok()) {
        Some(limit) => swap_total.min(ByteSize(limit)),
        None => swap_total,
    }
}

/// Host RAM from the OS's own counters on macOS and Windows (through `sysinfo`: `hw.memsize`
/// and the VM statistics; `GlobalMemoryStatusEx`), so the pinned-pool limit and the
/// `--novram`/`--lowvram` host rules see the real machine there.
#[cfg(any(target_os = "macos", target_os = "windows"))]
fn probe_host() -> HostInfo {
    host_from_os()
}

/// Host RAM as `sysinfo` reads it: total, and available capped by total.
#[cfg(any(target_os = "macos", target_os = "windows", test))]
fn host_from_os() -> HostInfo {
    let mut sys = sysinfo::System::new();
    sys.refresh_memory();
    let total = sys.total_memory();
    HostInfo {
        total: ByteSize(total),
        available: ByteSize(sys.available_memory().min(total)),
        swap_total: ByteSize(sys.total_swap()),
    }
}

/// Parses `/proc/meminfo` text and the cgroup v2 `memory.max` / `memory.current` files (pure).
pub fn host_from_texts(meminfo: &str, cg_max: Option<&str>, cg_current: Option<&str>) -> HostInfo {
    let field = |name: &str| -> Option<u64> {
        meminfo.lines().find_map(|l| {
            let rest = l.strip_prefix(name)?.strip_prefix(':')?;
            let digits = rest.trim().trim_end_matches("kB").trim();
            // Saturate: a figure too large for bytes in a u64 (or for a u64 at all) is at least
            // u64::MAX bytes, never less than the file says; anything but digits is no figure.
            if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            let kib: u64 = digits.parse().unwrap_or(u64::MAX);
            Some(kib.saturating_mul(1024))
        })
    };
    let swap_total = field("SwapTotal").unwrap_or(0);
    let mut total = field("MemTotal").unwrap_or(0);
    let mut available = field("MemAvailable")
        .or_else(|| field("MemFree"))
        .unwrap_or(0);
    let limit = cg_max.and_then(|s| s.trim().parse::<u64>().ok());
    if let Some(limit) = limit {
        let used = cg_current
            .and_then(|s| s.trim().parse::<u64>().ok())
            .unwrap_or(0);
        total = total.min(limit);
        available = available.min(limit.saturating_sub(used));
    }
    HostInfo {
        total: ByteSize(total),
        available: ByteSize(available),
        swap_total: ByteSize(swap_total),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MEMINFO: &str =
        "MemTotal:       24000000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\nSwapTotal:       8000000 kB\n";

    #[test]
    fn reads_mem_available_from_meminfo() {
        let h = host_from_texts(MEMINFO, None, None);
        assert_eq!(h.total, ByteSize(24_000_000 * 1024));
        assert_eq!(h.available, ByteSize(20_000_000 * 1024));
        assert_eq!(h.swap_total, ByteSize(8_000_000 * 1024));
    }

    #[test]
    fn cgroup_swap_limit_caps_swap() {
        let swap = ByteSize::gib(32);
        assert_eq!(swap_within_cgroup(swap, None), swap);
        assert_eq!(swap_within_cgroup(swap, Some("max\n")), swap);
        assert_eq!(swap_within_cgroup(swap, Some("0\n")), ByteSize::ZERO);
        assert_eq!(
            swap_within_cgroup(swap, Some("4294967296\n")),
            ByteSize::gib(4)
        );
    }

    #[test]
    fn a_figure_too_large_for_bytes_saturates_instead_of_wrapping_to_zero() {
        let h = host_from_texts(
            "MemTotal: 18014398509481984 kB\nMemAvailable: 1 kB\n",
            None,
            None,
        );
        assert_eq!(
            h.total,
            ByteSize(u64::MAX),
            "2^54 kB is more than u64 bytes"
        );
        assert_eq!(h.available, ByteSize::kib(1));
    }

    #[test]
    fn cgroup_limit_clips_total_and_available() {
        let h = host_from_texts(MEMINFO, Some("8589934592\n"), Some("2147483648\n"));
        assert_eq!(h.total, ByteSize::gib(8));
        assert_eq!(h.available, ByteSize::gib(6));
        // "max" means no limit.
        let h = host_from_texts(MEMINFO, Some("max\n"), Some("2147483648\n"));
        assert_eq!(h.available, ByteSize(20_000_000 * 1024));
    }

    /// The macOS/Windows path, run here on Linux against `/proc/meminfo`: both read the same
    /// machine, so their totals agree.
    #[test]
    fn os_counters_used_on_macos_and_windows_read_the_same_ram_as_meminfo() {
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        if meminfo.is_empty() {
            return; // not Linux: nothing to compare with
        }
        let proc = host_from_texts(&meminfo, None, None);
        let os = host_from_os();
        let (a, b) = (os.total.as_f64(), proc.total.as_f64());
        assert!(
            (a - b).abs() <= b * 0.01,
            "sysinfo {} vs meminfo {}",
            os.total,
            proc.total
        );
        assert!(
            os.available > ByteSize::ZERO && os.available <= os.total,
            "{os:?}"
        );
    }

    #[test]
    fn probe_on_this_machine_does_not_panic_and_reads_real_ram() {
        let hw = Hardware::probe();
        assert!(hw.host.total > ByteSize::mib(64), "{hw:?}");
        assert!(hw.host.available <= hw.host.total, "{hw:?}");
        assert!(hw.host.available > ByteSize::ZERO, "{hw:?}");
        if !cuda_driver_present() {
            assert!(hw.gpus.is_empty());
        }
        for g in &hw.gpus {
            assert!(g.free <= g.total && g.total > ByteSize::ZERO, "{g:?}");
        }
    }
}
