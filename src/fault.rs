//! A fault-injection seam for tests: makes the k-th weight materialization on this thread fail
//! as a driver error would, so tests can check that a load failing at any point is rolled back.
//! Compiled into test builds only.
#![allow(dead_code)]

use std::cell::Cell;

use crate::error::{Error, Result};

thread_local! {
    static COUNTDOWN: Cell<Option<u64>> = const { Cell::new(None) };
    static STICKY: Cell<bool> = const { Cell::new(false) };
    static SEEN: Cell<u64> = const { Cell::new(0) };
}

/// Makes the materialization `k` steps from now (0 = the next one) on this thread fail, once.
pub(crate) fn fail_after(k: u64) {
    COUNTDOWN.with(|c| c.set(Some(k)));
    STICKY.with(|s| s.set(false));
}

/// Makes every materialization on this thread fail from the `k`-th from now on (a device that
/// ran out of memory and stays out), until [`disarm`].
pub(crate) fn fail_from(k: u64) {
    COUNTDOWN.with(|c| c.set(Some(k)));
    STICKY.with(|s| s.set(true));
}

/// Cancels a pending failure.
pub(crate) fn disarm() {
    COUNTDOWN.with(|c| c.set(None));
    STICKY.with(|s| s.set(false));
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
            if !STICKY.with(|s| s.get()) {
                c.set(None);
            }
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

/// What runs at a fetch, and how many fetches before it.
type AtFetch = Option<(u64, Box<dyn FnOnce()>)>;

thread_local! {
    /// A pause between a fetch's copy and what is done with it.
    static AT_FETCH: std::cell::RefCell<AtFetch> = const { std::cell::RefCell::new(None) };
}

/// Runs `f` on this thread when the fetch `k` fetches from now (0 = the next) has its copy and
/// its booking but has not yet kept or released them: the moment another thread's unload, load
/// or reservation can land between a fault-in's booking and its commit. `f` may block (to let
/// another thread act) or panic (a kernel's panic the engine catches).
pub(crate) fn at_fetch(k: u64, f: impl FnOnce() + 'static) {
    AT_FETCH.with(|a| *a.borrow_mut() = Some((k, Box::new(f))));
}

/// Cancels a pending [`at_fetch`].
pub(crate) fn clear_at_fetch() {
    AT_FETCH.with(|a| *a.borrow_mut() = None);
}

/// Called by a fetch between its copy and its commit.
pub(crate) fn fetched() {
    let due = AT_FETCH.with(|a| {
        let mut a = a.borrow_mut();
        match a.as_mut() {
            Some((0, _)) => a.take().map(|(_, f)| f),
            Some((k, _)) => {
                *k -= 1;
                None
            }
            None => None,
        }
    });
    if let Some(f) = due {
        f();
    }
}
