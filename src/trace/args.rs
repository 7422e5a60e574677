//! The examples' trace flags: `--trace FILE` (a Chrome trace), candle's `--tracing` (the same,
//! into `trace-<seconds since the epoch>.json`, as `tracing-chrome` names it) and
//! `--timeline FILE` (the SVG picture). They are taken out of the arguments before the rest go to
//! [`crate::vram::Config::from_args`], which does not know them.

use std::path::{Path, PathBuf};

use super::Trace;
use crate::error::{Error, Result};

/// Where a run's trace and timeline go (both optional).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TraceArgs {
    /// The Chrome trace file (`--trace FILE`, or `--tracing`).
    pub trace: Option<PathBuf>,
    /// The timeline picture (`--timeline FILE`).
    pub timeline: Option<PathBuf>,
}

impl TraceArgs {
    /// What `args` ask for, and the arguments left once the trace flags are taken out.
    ///
    /// # Errors
    /// [`Error::InvalidFlag`] when `--trace` or `--timeline` has no value.
    pub fn take_from(args: &[String]) -> Result<(TraceArgs, Vec<String>)> {
        let mut out = TraceArgs::default();
        let mut rest = Vec::with_capacity(args.len());
        let mut i = 0;
        while i < args.len() {
            let flag = args[i].as_str();
            let value = || {
                args.get(i + 1)
                    .filter(|v| !v.starts_with("--"))
                    .map(PathBuf::from)
                    .ok_or_else(|| Error::InvalidFlag {
                        flag: flag.to_string(),
                        reason: "needs a file name".into(),
                    })
            };
            match flag {
                "--trace" => {
                    out.trace = Some(value()?);
                    i += 2;
                }
                "--timeline" => {
                    out.timeline = Some(value()?);
                    i += 2;
                }
                "--tracing" => {
                    let secs = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| d.as_secs());
                    out.trace = Some(PathBuf::from(format!("trace-{secs}.json")));
                    i += 1;
                }
                _ => {
                    rest.push(args[i].clone());
                    i += 1;
                }
            }
        }
        Ok((out, rest))
    }

    /// Whether anything is to be written.
    pub fn wanted(&self) -> bool {
        self.trace.is_some() || self.timeline.is_some()
    }

    /// Starts recording when anything is to be written: a [`Trace`] installed as the global
    /// subscriber (so stream workers and lanes are recorded too). `None` when nothing was asked.
    ///
    /// # Errors
    /// [`Error::InvalidFlag`] when a global subscriber is set already.
    pub fn start(&self) -> Result<Option<TraceSession>> {
        if !self.wanted() {
            return Ok(None);
        }
        let trace = Trace::new();
        trace.install_global().map_err(|e| Error::InvalidFlag {
            flag: "--trace".into(),
            reason: format!("cannot record: {e}"),
        })?;
        Ok(Some(TraceSession {
            trace,
            args: self.clone(),
        }))
    }
}

/// A recording started by [`TraceArgs::start`]; [`TraceSession::finish`] writes its files.
#[derive(Debug)]
pub struct TraceSession {
    trace: Trace,
    args: TraceArgs,
}

impl TraceSession {
    /// The recording.
    pub fn trace(&self) -> &Trace {
        &self.trace
    }

    /// Writes the Chrome trace and the timeline asked for; returns the files written.
    ///
    /// # Errors
    /// [`Error::File`] naming a file that could not be written.
    pub fn finish(&self) -> Result<Vec<PathBuf>> {
        let mut written = Vec::new();
        if let Some(path) = &self.args.trace {
            write(path, &self.trace.chrome_json())?;
            written.push(path.clone());
        }
        if let Some(path) = &self.args.timeline {
            write(path, &self.trace.timeline_svg())?;
            written.push(path.clone());
        }
        Ok(written)
    }
}

fn write(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).map_err(|e| Error::File {
        path: path.to_path_buf(),
        reason: format!("writing the trace: {e}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn trace_flags_are_taken_out_and_the_rest_kept_in_order() {
        let (t, rest) = TraceArgs::take_from(&strings(&[
            "--sim-gpu",
            "6MiB@25GB/s",
            "--trace",
            "t.json",
            "--novram",
            "--timeline",
            "t.svg",
        ]))
        .unwrap();
        assert_eq!(t.trace, Some(PathBuf::from("t.json")));
        assert_eq!(t.timeline, Some(PathBuf::from("t.svg")));
        assert_eq!(rest, strings(&["--sim-gpu", "6MiB@25GB/s", "--novram"]));
    }

    #[test]
    fn candle_tracing_spelling_names_a_file_like_tracing_chrome() {
        let (t, rest) = TraceArgs::take_from(&strings(&["--tracing", "--lowvram"])).unwrap();
        let name = t.trace.unwrap().display().to_string();
        assert!(
            name.starts_with("trace-") && name.ends_with(".json"),
            "{name}"
        );
        assert_eq!(rest, strings(&["--lowvram"]));
    }

    #[test]
    fn a_trace_flag_without_a_file_is_an_error_not_a_panic() {
        assert!(matches!(
            TraceArgs::take_from(&strings(&["--trace"])),
            Err(Error::InvalidFlag { .. })
        ));
        assert!(TraceArgs::take_from(&strings(&["--timeline", "--novram"])).is_err());
        let (t, _) = TraceArgs::take_from(&strings(&["--novram"])).unwrap();
        assert!(!t.wanted());
    }
}
