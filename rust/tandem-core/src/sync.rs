//! A doorbell: lets a thread sleep until "something changed" without missing a ring.
//!
//! Producers ring after making progress (an item queued, space freed, a high-water mark
//! advanced); a waiter reads the generation, re-checks its condition, then sleeps until
//! the generation moves past what it read. The fast path (`ring` with no sleeper) is one
//! atomic increment and one atomic load.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

/// See the module documentation.
#[derive(Debug, Default)]
pub struct Doorbell {
    generation: AtomicU64,
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    cond: Condvar,
}

impl Doorbell {
    pub fn new() -> Self {
        Self::default()
    }

    /// The current generation; pass it to [`Doorbell::wait`] after re-checking the
    /// condition you are waiting for.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    /// Wake every thread waiting on an older generation.
    pub fn ring(&self) {
        self.generation.fetch_add(1, Ordering::SeqCst);
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            let _guard = self.lock.lock();
            self.cond.notify_all();
        }
    }

    /// Sleep until the generation differs from `seen` or `timeout` passes. Returns true if
    /// it was rung.
    pub fn wait(&self, seen: u64, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut guard = self.lock.lock();
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        let rung = loop {
            if self.generation.load(Ordering::SeqCst) != seen {
                break true;
            }
            if self.cond.wait_until(&mut guard, deadline).timed_out() {
                break self.generation.load(Ordering::SeqCst) != seen;
            }
        };
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
        rung
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn ring_wakes_a_waiter_and_no_ring_is_missed() {
        let bell = Arc::new(Doorbell::new());
        for _ in 0..200 {
            let seen = bell.generation();
            let b = Arc::clone(&bell);
            let t = std::thread::spawn(move || b.ring());
            assert!(bell.wait(seen, Duration::from_secs(5)), "a ring was missed");
            t.join().unwrap();
        }
    }

    #[test]
    fn wait_times_out_without_a_ring() {
        let bell = Doorbell::new();
        let seen = bell.generation();
        assert!(!bell.wait(seen, Duration::from_millis(5)));
    }
}
