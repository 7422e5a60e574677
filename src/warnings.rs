//! The warnings an engine must see reach stderr when nothing else would show them.
//!
//! residency warns through `tracing` (structured fields, routed by the engine's subscriber).
//! An engine that installs no subscriber would never see them: the warnings that say a run is
//! not what the engine meant — a LoRA clone computing the base weights (the clone trap), a
//! model keeping tensors outside the ledger, a model used without a load, weights that could
//! not be page-locked, a configuration setting ignored, an attention backend or a LoRA file
//! only partly applied — are then also printed on stderr, once each, as
//! `residency: warning: …`. With a subscriber installed (global or scoped) nothing is printed:
//! the subscriber decides. `RESIDENCY_QUIET=1` or [`set_stderr`]`(false)` silences the stderr
//! copies.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU8, Ordering};

use once_cell::sync::Lazy;

use crate::lock::{Mutex, Rank};

/// 0: not decided yet (read `RESIDENCY_QUIET` at the first warning), 1: on, 2: off.
static STDERR: AtomicU8 = AtomicU8::new(0);

static PRINTED: Lazy<Mutex<HashSet<String>>> =
    Lazy::new(|| Mutex::new(Rank::WarnLatch, HashSet::new()));

static LATCHED: Lazy<Mutex<HashSet<String>>> =
    Lazy::new(|| Mutex::new(Rank::WarnLatch, HashSet::new()));

/// True the first time `key` is seen in this process: a repeated warning is emitted once per
/// condition (its stderr copy is latched by [`echo`] on its own).
pub(crate) fn latch(key: String) -> bool {
    LATCHED.lock().insert(key)
}

/// Turns the stderr copies of residency's warnings on or off for the process (on by default,
/// off when `RESIDENCY_QUIET` is set to anything but `0` or an empty value).
pub fn set_stderr(on: bool) {
    STDERR.store(if on { 1 } else { 2 }, Ordering::Relaxed);
}

/// Whether warnings are copied to stderr when no subscriber is installed ([`set_stderr`]).
pub fn stderr_enabled() -> bool {
    match STDERR.load(Ordering::Relaxed) {
        1 => true,
        2 => false,
        _ => {
            let quiet =
                std::env::var_os("RESIDENCY_QUIET").is_some_and(|v| !v.is_empty() && v != "0");
            // A concurrent `set_stderr` wins over the environment.
            let _ = STDERR.compare_exchange(
                0,
                if quiet { 2 } else { 1 },
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
            STDERR.load(Ordering::Relaxed) == 1
        }
    }
}

/// Whether this thread's warnings reach a subscriber (one installed globally or for a scope).
fn subscribed() -> bool {
    tracing::dispatcher::get_default(|d| !d.is::<tracing::subscriber::NoSubscriber>())
}

/// Whether a warning under `key` is to be printed on stderr now: no subscriber would show it,
/// stderr copies are on, and `key` was not printed before in this process.
fn to_print(key: &str) -> bool {
    !subscribed() && stderr_enabled() && PRINTED.lock().insert(key.to_string())
}

/// The stderr copy of a warning the caller has just emitted through `tracing`: printed once per
/// `key` per process, and only when nothing else would show it (module docs).
pub(crate) fn echo(key: &str, text: impl FnOnce() -> String) {
    if to_print(key) {
        eprintln!("residency: warning: {}", text());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_warning_is_printed_once_per_key_only_where_no_subscriber_would_show_it() {
        set_stderr(true);
        assert!(to_print("test:once"), "no subscriber: printed");
        assert!(!to_print("test:once"), "once per key");
        // A scoped subscriber sees the warning: nothing printed.
        let subscriber = tracing_subscriber::fmt()
            .with_writer(std::io::sink)
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            assert!(!to_print("test:scoped"));
        });
        assert!(
            to_print("test:scoped"),
            "not latched while the subscriber showed it"
        );
        set_stderr(false);
        assert!(!to_print("test:quiet"));
        set_stderr(true);
        assert!(to_print("test:quiet"));
    }
}
