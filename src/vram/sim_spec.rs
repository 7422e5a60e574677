//! What a simulated GPU is (`--sim-gpu 8GiB@25GB/s`): a plain description, parsed from flags;
//! the device itself is [`crate::device::SimGpu`].

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use crate::size::ByteSize;

/// What a simulated GPU is: its capacity and modelled transfer speed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimSpec {
    /// Device memory.
    pub capacity: ByteSize,
    /// Host→device bandwidth in bytes per second; `None`: copies take only the latency.
    pub bandwidth: Option<f64>,
    /// Fixed cost of each copy (a launch).
    pub latency: Duration,
    /// Seed of the copy-time jitter (each copy takes up to 50 % longer); `None`: no jitter.
    pub jitter_seed: Option<u64>,
}

impl SimSpec {
    /// A device of `capacity` whose copies take 10 µs plus nothing per byte.
    pub fn new(capacity: ByteSize) -> SimSpec {
        SimSpec {
            capacity,
            bandwidth: None,
            latency: Duration::from_micros(10),
            jitter_seed: None,
        }
    }

    /// With a modelled bandwidth (bytes per second).
    pub fn with_bandwidth(mut self, bytes_per_second: f64) -> SimSpec {
        self.bandwidth = Some(bytes_per_second);
        self
    }

    /// With a fixed cost per copy.
    pub fn with_latency(mut self, latency: Duration) -> SimSpec {
        self.latency = latency;
        self
    }

    /// With copy times jittered from `seed`.
    pub fn with_jitter(mut self, seed: u64) -> SimSpec {
        self.jitter_seed = Some(seed);
        self
    }

    /// The modelled time of copying `bytes`, before jitter.
    pub fn copy_time(&self, bytes: u64) -> Duration {
        let transfer = match self.bandwidth {
            Some(bw) if bw > 0.0 => Duration::from_secs_f64(bytes as f64 / bw),
            _ => Duration::ZERO,
        };
        self.latency + transfer
    }
}

impl fmt::Display for SimSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.capacity)?;
        if let Some(bw) = self.bandwidth {
            write!(f, "@{:.1}GB/s", bw / 1e9)?;
        }
        Ok(())
    }
}

impl FromStr for SimSpec {
    type Err = String;

    /// `SIZE[@BANDWIDTH]`, e.g. `8GiB`, `64MiB@25GB/s`, `1GiB@12.5GB/s`; bandwidth in `GB/s`,
    /// `MB/s` or `GiB/s`.
    fn from_str(s: &str) -> std::result::Result<SimSpec, String> {
        let (size, bw) = match s.split_once('@') {
            Some((a, b)) => (a, Some(b)),
            None => (s, None),
        };
        let capacity: ByteSize = size
            .trim()
            .parse()
            .map_err(|e| format!("`{size}` is not a size ({e})"))?;
        let mut spec = SimSpec::new(capacity);
        if let Some(bw) = bw {
            let bw = bw.trim();
            let per_sec = bw.strip_suffix("/s").ok_or_else(|| {
                format!("bandwidth `{bw}` needs a unit per second, e.g. `25GB/s`")
            })?;
            let bytes: ByteSize = per_sec
                .parse()
                .map_err(|e| format!("`{per_sec}` is not a size ({e})"))?;
            if bytes.bytes() == 0 {
                return Err("a bandwidth of zero".into());
            }
            spec = spec.with_bandwidth(bytes.bytes() as f64);
        }
        Ok(spec)
    }
}
