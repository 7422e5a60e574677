//! A fault-injection seam for tests: makes the k-th weight materialization on this thread fail
//! as a driver error would, so tests can check that a load failing at any point is rolled back.
//! Compiled into test builds only.
#![allow(dead_code)]

use std::cell::Cell;

use crate::error::{Error, Result};

thread_local! {
    static COUNTDOWN: Cell<Option<u64>> = const { Cell::new(None) };
    static SEEN: Cell<u64> = const { Cell::new(0) };
}

/// Makes the materialization `k` steps from now (0 = the next one) on this thread fail, once.
pub(crate) fn fail_after(k: u64) {
    COUNTDOWN.with(|c| c.set(Some(k)));
}

/// Cancels a pending failure.
pub(crate) fn disarm() {
    COUNTDOWN.with(|c| c.set(None));
}

/// Materializations seen on this thread since the last call (and resets the count).
pub(crate) fn take_count() -> u64 {
    SEEN.with(|s| s.replace(0))
}

/// Called by every weight materialization.
pub(crate) fn check(what: &str) -> Result<()> {
    SEEN.with(|s| s.set(s.get() + 1));
    COUNTDOWN.with(|c| match c.get() {
        Some(0) => {
            c.set(None);
            Err(Error::Device {
                device: "injected".into(),
                reason: format!("injected fault materializing {what}"),
            })
        }
        Some(k) => {
            c.set(Some(k - 1));
            Ok(())
        }
        None => Ok(()),
    })
}
