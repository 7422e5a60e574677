//! Ranked locks: every lock in the crate, checked at run time in debug builds.
//!
//! Each lock is a [`Mutex`] or [`RwLock`] made with a [`Rank`] (`rank.rs`, the crate's lock
//! table, docs/ARCHITECTURE.md §7). A thread may take a lock only while every lock it already
//! holds has a lower rank, and may never take a lock it already holds — a second read of a fair
//! `RwLock` included: parking_lot queues a new reader behind a waiting writer, so a thread that
//! reads twice deadlocks as soon as a writer arrives between its two reads, which no test sees
//! unless the writer is there at that instant. A rank declared `recursive` allows re-reading.
//! The checker makes both mistakes deterministic: the first acquisition out of order panics,
//! naming both locks and both places, whatever the other threads are doing.
//!
//! Waiting (on a device event, a stream, a condition variable of another lock) while holding a
//! lock is checked too: [`check_wait`] panics when the thread holds a lock whose rank does not
//! allow waiting under it (`Rank::may_wait`). The manager lock is the one lock that does (a load
//! unpins weights and trims the staging pool under it, both of which wait for copies).
//!
//! In release builds (no `debug_assertions`) the wrappers are parking_lot's locks with nothing
//! added: the rank is not stored and nothing is checked. Every test build checks.
//!
//! Guards are not `Send` (parking_lot's are not), so the per-thread record of held locks is
//! exact: a guard is released on the thread that took it.

mod rank;

pub(crate) use rank::Rank;

use std::ops::{Deref, DerefMut};
use std::time::Duration;

#[cfg(debug_assertions)]
mod check {
    use super::Rank;
    use std::cell::RefCell;
    use std::panic::Location;

    /// One lock this thread holds.
    struct Held {
        rank: Rank,
        addr: usize,
        read: bool,
        at: &'static Location<'static>,
        token: u64,
    }

    thread_local! {
        static HELD: RefCell<(Vec<Held>, u64)> = const { RefCell::new((Vec::new(), 0)) };
    }

    /// Records that this thread takes the lock at `addr`, or panics when that breaks the order.
    pub(super) fn acquire(
        rank: Rank,
        addr: usize,
        read: bool,
        at: &'static Location<'static>,
    ) -> u64 {
        let violation = HELD.with(|held| {
            let held = held.borrow();
            for h in held.0.iter() {
                if h.addr == addr {
                    if read && h.read && rank.recursive() {
                        continue;
                    }
                    return Some(format!(
                        "lock re-entered: {} (rank {}) taken at {at} while this thread already holds it \
                         (taken at {}){}",
                        rank.name(),
                        rank.number(),
                        h.at,
                        if read && h.read {
                            "; a second read of a fair RwLock waits behind a queued writer, which waits for the first read"
                        } else {
                            ""
                        }
                    ));
                }
            }
            let top = held.0.iter().filter(|h| h.addr != addr).max_by_key(|h| h.rank.number());
            match top {
                Some(h) if h.rank.number() >= rank.number() => Some(format!(
                    "lock order violated: {} (rank {}) taken at {at} while holding {} (rank {}) taken at {}",
                    rank.name(),
                    rank.number(),
                    h.rank.name(),
                    h.rank.number(),
                    h.at
                )),
                _ => None,
            }
        });
        if let Some(message) = violation {
            eprintln!("residency lock checker: {message}");
            panic!("residency lock checker: {message}");
        }
        HELD.with(|held| {
            let mut held = held.borrow_mut();
            held.1 += 1;
            let token = held.1;
            held.0.push(Held {
                rank,
                addr,
                read,
                at,
                token,
            });
            token
        })
    }

    /// Records that the acquisition `token` was released.
    pub(super) fn release(token: u64) {
        // `try_with`: a guard dropped while the thread's locals are torn down has nothing to tell.
        let _ = HELD.try_with(|held| {
            let mut held = held.borrow_mut();
            if let Some(i) = held.0.iter().rposition(|h| h.token == token) {
                held.0.remove(i);
            }
        });
    }

    /// Panics when this thread holds a lock that may not be held across a wait.
    #[track_caller]
    pub(super) fn check_wait(what: &str, except: usize) {
        let at = Location::caller();
        let found = HELD.with(|held| {
            held.borrow()
                .0
                .iter()
                .find(|h| h.addr != except && !h.rank.may_wait())
                .map(|h| {
                    format!(
                        "{} (rank {}) taken at {}",
                        h.rank.name(),
                        h.rank.number(),
                        h.at
                    )
                })
        });
        if let Some(lock) = found {
            let message = format!("waited for {what} at {at} while holding {lock}");
            eprintln!("residency lock checker: {message}");
            panic!("residency lock checker: {message}");
        }
    }

    /// The ranks this thread holds, lowest first (for tests).
    pub(super) fn held() -> Vec<Rank> {
        let mut v: Vec<Rank> = HELD.with(|held| held.borrow().0.iter().map(|h| h.rank).collect());
        v.sort_by_key(|r| r.number());
        v
    }
}

/// Panics (in debug builds) when this thread holds a lock that may not be held across a wait for
/// `what` (a device event, a stream, a copy). Called by every wait in the device interface.
#[track_caller]
#[inline]
pub(crate) fn check_wait(what: &str) {
    #[cfg(debug_assertions)]
    check::check_wait(what, 0);
    #[cfg(not(debug_assertions))]
    let _ = what;
}

/// The ranks of the locks this thread holds, lowest first (empty in release builds).
#[allow(dead_code)]
pub(crate) fn held_ranks() -> Vec<Rank> {
    #[cfg(debug_assertions)]
    return check::held();
    #[cfg(not(debug_assertions))]
    Vec::new()
}

/// The record of one acquisition, released with its guard.
#[derive(Debug)]
struct Token {
    #[cfg(debug_assertions)]
    id: u64,
    /// The lock's address (a condition variable's wait excuses the lock it releases).
    #[cfg(debug_assertions)]
    addr: usize,
}

impl Token {
    #[track_caller]
    #[inline]
    fn take(rank: &RankCell, addr: usize, read: bool) -> Token {
        #[cfg(debug_assertions)]
        {
            Token {
                id: check::acquire(rank.0, addr, read, std::panic::Location::caller()),
                addr,
            }
        }
        #[cfg(not(debug_assertions))]
        {
            let _ = (rank, addr, read);
            Token {}
        }
    }
}

impl Drop for Token {
    #[inline]
    fn drop(&mut self) {
        #[cfg(debug_assertions)]
        check::release(self.id);
    }
}

/// A lock's rank, stored only where it is checked.
#[derive(Debug)]
struct RankCell(#[cfg(debug_assertions)] Rank);

impl RankCell {
    #[inline]
    const fn new(rank: Rank) -> RankCell {
        #[cfg(not(debug_assertions))]
        let _ = rank;
        RankCell(
            #[cfg(debug_assertions)]
            rank,
        )
    }
}

/// parking_lot's `Mutex` with a rank.
pub(crate) struct Mutex<T: ?Sized> {
    rank: RankCell,
    inner: parking_lot::Mutex<T>,
}

/// A held [`Mutex`].
pub(crate) struct MutexGuard<'a, T: ?Sized> {
    inner: parking_lot::MutexGuard<'a, T>,
    _token: Token,
}

impl<T> Mutex<T> {
    /// A lock of rank `rank` holding `value`.
    pub(crate) const fn new(rank: Rank, value: T) -> Mutex<T> {
        Mutex {
            rank: RankCell::new(rank),
            inner: parking_lot::Mutex::new(value),
        }
    }

    /// The value, consuming the lock.
    #[allow(dead_code)]
    pub(crate) fn into_inner(self) -> T {
        self.inner.into_inner()
    }
}

impl<T: ?Sized> Mutex<T> {
    /// Takes the lock (checking its rank against the locks this thread holds).
    #[track_caller]
    #[inline]
    pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
        let token = Token::take(&self.rank, self as *const Self as *const () as usize, false);
        MutexGuard {
            inner: self.inner.lock(),
            _token: token,
        }
    }

    /// Takes the lock when it is free now (checked like [`Mutex::lock`]), else `None`.
    #[track_caller]
    #[inline]
    pub(crate) fn try_lock(&self) -> Option<MutexGuard<'_, T>> {
        let guard = self.inner.try_lock()?;
        let token = Token::take(&self.rank, self as *const Self as *const () as usize, false);
        Some(MutexGuard {
            inner: guard,
            _token: token,
        })
    }

    /// The value, through exclusive access (no lock taken).
    #[allow(dead_code)]
    pub(crate) fn get_mut(&mut self) -> &mut T {
        self.inner.get_mut()
    }
}

impl<T: ?Sized + std::fmt::Debug> std::fmt::Debug for Mutex<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never takes the lock: a Debug print under another lock must not break the order.
        f.debug_struct("Mutex").finish_non_exhaustive()
    }
}

impl<T: ?Sized> Deref for MutexGuard<'_, T> {
    type Target = T;
    #[inline]
    fn deref(&self) -> &T {
        &self.inner
    }
}

impl<T: ?Sized> DerefMut for MutexGuard<'_, T> {
    #[inline]
    fn deref_mut(&mut self) -> &mut T {
        &mut self.inner
    }
}

/// parking_lot's `RwLock` with a rank.
pub(crate) struct RwLock<T: ?Sized> {
    rank: RankCell,
    inner: parking_lot::RwLock<T>,
}

/// A read-held [`RwLock`].
pub(crate) struct RwLockReadGuard<'a, T: ?Sized> {
    inner: parking_lot::RwLockReadGuard<'a, T>,
    _token: Token,
}

/// A write-held [`RwLock`].
pub(crate) struct RwLockWriteGuard<'a, T: ?Sized> {
    inner: parking_lot::RwLockWriteGuard<'a, T>,
    _token: Token,
}

impl<T> RwLock<T> {
    /// A lock of rank `rank` holding `value`.
    pub(crate) const fn new(rank: Rank, value: T) -> RwLock<T> {
        RwLock {
            rank: RankCell::new(rank),
            inner: parking_lot::RwLock::new(value),
        }
    }
}

impl<T: ?Sized> RwLock<T> {
    /// Takes the lock shared (checking its rank; a second read by the same thread is an error
    /// unless the rank is recursive).
    #[track_caller]
    #[inline]
    pub(crate) fn read(&self) -> RwLockReadGuard<'_, T> {
        let token = Token::take(&self.rank, self as *const Self as *const () as usize, true);
        RwLockReadGuard {
            inner: self.inner.read(),
            _token: token,
        }
    }

    /// Takes the lock exclusively (checking its rank).
    #[track_caller]
    #[inline]
    pub(crate) fn write(&self) -> RwLockWriteGuard<'_, T> {
        let token = Token::take(&self.rank, self as *const Self as *const () as usize, false);
        RwLockWriteGuard {
            inner: self.inner.write(),
            _token: token,
        }
    }
}

impl<T: ?Sized> std::fmt::Debug for RwLock<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RwLock").finish_non_exhaustive()
    }
}

impl<T: ?Sized> Deref for RwLockReadGuard<'_, T> {
    type Target = T;
    #[inline]
    fn deref(&self) -> &T {
        &self.inner
    }
}

impl<T: ?Sized> Deref for RwLockWriteGuard<'_, T> {
    type Target = T;
    #[inline]
    fn deref(&self) -> &T {
        &self.inner
    }
}

impl<T: ?Sized> DerefMut for RwLockWriteGuard<'_, T> {
    #[inline]
    fn deref_mut(&mut self) -> &mut T {
        &mut self.inner
    }
}

/// parking_lot's `Condvar`, waiting on a ranked [`MutexGuard`]. Waiting releases only the lock
/// waited on: every other lock the thread holds must allow waiting ([`Rank::may_wait`]).
#[derive(Debug, Default)]
pub(crate) struct Condvar {
    inner: parking_lot::Condvar,
}

/// Whether a timed wait ended by its timeout.
#[allow(dead_code)]
pub(crate) struct WaitTimeoutResult(bool);

impl WaitTimeoutResult {
    /// True when the wait ended because the time ran out.
    #[allow(dead_code)]
    pub(crate) fn timed_out(&self) -> bool {
        self.0
    }
}

impl Condvar {
    /// A condition variable.
    pub(crate) const fn new() -> Condvar {
        Condvar {
            inner: parking_lot::Condvar::new(),
        }
    }

    /// Releases `guard`'s lock, waits for a notification, takes the lock again.
    #[track_caller]
    #[inline]
    pub(crate) fn wait<T: ?Sized>(&self, guard: &mut MutexGuard<'_, T>) {
        #[cfg(debug_assertions)]
        check::check_wait("a condition variable", guard._token.addr);
        self.inner.wait(&mut guard.inner);
    }

    /// [`Condvar::wait`] for at most `timeout`.
    #[track_caller]
    #[inline]
    #[allow(dead_code)]
    pub(crate) fn wait_for<T: ?Sized>(
        &self,
        guard: &mut MutexGuard<'_, T>,
        timeout: Duration,
    ) -> WaitTimeoutResult {
        #[cfg(debug_assertions)]
        check::check_wait("a condition variable", guard._token.addr);
        WaitTimeoutResult(self.inner.wait_for(&mut guard.inner, timeout).timed_out())
    }

    /// Wakes every waiter.
    #[inline]
    pub(crate) fn notify_all(&self) -> usize {
        self.inner.notify_all()
    }

    /// Wakes one waiter.
    #[inline]
    #[allow(dead_code)]
    pub(crate) fn notify_one(&self) -> bool {
        self.inner.notify_one()
    }
}

#[cfg(test)]
mod tests;
