use std::sync::Arc;
use std::time::Duration;

use super::{Condvar, Mutex, Rank, RwLock};

fn panic_message(f: impl FnOnce()) -> String {
    let err = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
        .expect_err("the checker should have panicked");
    err.downcast_ref::<String>()
        .cloned()
        .or_else(|| err.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

#[test]
fn locks_taken_in_rank_order_pass_and_release_in_any_order() {
    let a = Mutex::new(Rank::Manager, 1);
    let b = RwLock::new(Rank::ModelState, 2);
    let c = Mutex::new(Rank::LedgerBooks, 3);
    let ga = a.lock();
    let gb = b.read();
    let gc = c.lock();
    assert_eq!(
        super::held_ranks(),
        vec![Rank::Manager, Rank::ModelState, Rank::LedgerBooks]
    );
    drop(gb);
    drop(ga);
    assert_eq!(super::held_ranks(), vec![Rank::LedgerBooks]);
    // With the lower locks released, a lower rank may be taken again... but not under `c`.
    let msg = panic_message(|| {
        let _ = b.write();
    });
    assert!(msg.contains("lock order violated"), "{msg}");
    assert!(
        msg.contains("Model::state") && msg.contains("loader::Ledger books"),
        "{msg}"
    );
    assert!(
        msg.contains("src/lock/tests.rs"),
        "names both places: {msg}"
    );
    drop(gc);
    assert!(super::held_ranks().is_empty());
    let _ = b.write();
}

#[test]
fn a_second_read_of_the_same_rwlock_is_refused() {
    let l = RwLock::new(Rank::ModelState, 0u32);
    let msg = panic_message(|| {
        let _first = l.read();
        let _second = l.read();
    });
    assert!(msg.contains("re-entered"), "{msg}");
    assert!(msg.contains("queued writer"), "{msg}");
    // The panic released what the closure held.
    assert!(super::held_ranks().is_empty());
}

#[test]
fn a_second_lock_of_one_rank_is_refused_even_on_another_instance() {
    let a = Mutex::new(Rank::ModelState, 0);
    let b = Mutex::new(Rank::ModelState, 0);
    let msg = panic_message(|| {
        let _a = a.lock();
        let _b = b.lock();
    });
    assert!(msg.contains("lock order violated"), "{msg}");
}

/// What the checker prevents, shown deterministically on parking_lot's own lock: a writer queued
/// between a thread's two reads blocks the second read, and the writer waits for the first.
#[test]
fn a_writer_queued_between_two_reads_deadlocks_a_fair_rwlock() {
    let l = Arc::new(parking_lot::RwLock::new(0u32));
    let first = l.read();
    let writer = {
        let l = Arc::clone(&l);
        std::thread::spawn(move || {
            *l.write() += 1;
        })
    };
    // Wait until the writer is parked: from then on parking_lot refuses new readers.
    let t0 = std::time::Instant::now();
    while l.try_read().is_some() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the writer never queued"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let second = l.try_read_for(Duration::from_millis(200));
    assert!(
        second.is_none(),
        "the second read must wait behind the queued writer (which waits for the first)"
    );
    drop(first);
    writer.join().unwrap();
    assert_eq!(*l.read(), 1);
}

#[test]
fn waiting_under_a_lock_that_forbids_it_is_refused() {
    let outer = Mutex::new(Rank::StagingPool, ());
    let msg = panic_message(|| {
        let _g = outer.lock();
        super::check_wait("a copy's event");
    });
    assert!(msg.contains("waited for a copy's event"), "{msg}");
    assert!(msg.contains("offload::PinnedPool"), "{msg}");
    // The manager lock allows it.
    let manager = Mutex::new(Rank::Manager, ());
    let _g = manager.lock();
    super::check_wait("a copy's event");
}

#[test]
fn a_condition_variable_releases_its_own_lock_only() {
    let m = Arc::new((Mutex::new(Rank::HostTier, false), Condvar::new()));
    let waiter = {
        let m = Arc::clone(&m);
        std::thread::spawn(move || {
            let mut g = m.0.lock();
            while !*g {
                m.1.wait(&mut g);
            }
        })
    };
    std::thread::sleep(Duration::from_millis(10));
    *m.0.lock() = true;
    m.1.notify_all();
    waiter.join().unwrap();
    // Waiting on it under another lock that forbids waits is refused.
    let other = Mutex::new(Rank::ModelState, ());
    let msg = panic_message(|| {
        let _o = other.lock();
        let mut g = m.0.lock();
        m.1.wait_for(&mut g, Duration::from_millis(1));
    });
    assert!(msg.contains("Model::state"), "{msg}");
}

#[test]
fn ranks_are_strictly_increasing_and_named_once() {
    for w in Rank::ALL.windows(2) {
        assert!(w[0].number() < w[1].number(), "{w:?}");
    }
    let mut names: Vec<&str> = Rank::ALL.iter().map(|r| r.name()).collect();
    names.sort();
    names.dedup();
    assert_eq!(names.len(), Rank::ALL.len());
}

/// docs/ARCHITECTURE.md §7 is the lock table: the same ranks, numbers and names, in order.
#[test]
fn the_architecture_lock_table_is_the_code_s() {
    let doc = include_str!("../../docs/ARCHITECTURE.md");
    let section = doc
        .split("\n## 7. Locks")
        .nth(1)
        .expect("docs/ARCHITECTURE.md has a §7 Locks");
    let section = section.split("\n## ").next().unwrap();
    let rows: Vec<(u32, String)> = section
        .lines()
        .filter_map(|line| {
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            if cells.len() < 4 {
                return None;
            }
            let number = cells[1].parse::<u32>().ok()?;
            Some((number, cells[2].trim_matches('`').to_string()))
        })
        .collect();
    let code: Vec<(u32, String)> = Rank::ALL
        .iter()
        .map(|r| (r.number(), r.name().to_string()))
        .collect();
    assert_eq!(
        rows, code,
        "docs/ARCHITECTURE.md §7 must list src/lock/rank.rs's ranks: run python3 scripts/lock-table.py"
    );
}
