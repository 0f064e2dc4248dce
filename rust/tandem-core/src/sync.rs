//! A doorbell: lets a thread sleep until "something changed" without missing a ring.
//!
//! Producers ring after making progress (an item queued, space freed, a high-water mark
//! advanced); a waiter reads the generation, re-checks its condition, then sleeps until
//! the generation moves past what it read. The fast path (`ring` with no sleeper) is one
//! atomic increment and one atomic load.
//!
//! A thread that sleeps on something else (the reactor, in `epoll_wait`) asks instead to
//! be called once at the next ring ([`Doorbell::notify_once`]), through a [`Wake`].

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

/// Something to call when a bell rings, for a thread that does not sleep on the bell.
pub trait Wake: Send + Sync {
    fn wake(&self);
}

/// See the module documentation.
#[derive(Default)]
pub struct Doorbell {
    generation: AtomicU64,
    /// Threads waiting, plus wakes to call: a ring takes the slow path when non-zero.
    sleepers: AtomicUsize,
    /// The wakes to call at the next ring ([`Doorbell::notify_once`]), each with the
    /// generation it waits to move past.
    lock: Mutex<Vec<(u64, Arc<dyn Wake>)>>,
    cond: Condvar,
}

impl std::fmt::Debug for Doorbell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Doorbell")
            .field("generation", &self.generation())
            .finish_non_exhaustive()
    }
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

    /// Wake every thread waiting on an older generation, and call the wakes asked for.
    pub fn ring(&self) {
        self.generation.fetch_add(1, Ordering::SeqCst);
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            let due = {
                let mut wakes = self.lock.lock();
                self.cond.notify_all();
                // Only the wakes asked for before the generation moved: one asked for
                // since (after this ring's increment, before its lock) waits for the next.
                let now = self.generation.load(Ordering::SeqCst);
                let mut due = Vec::new();
                wakes.retain(|(seen, w)| {
                    let keep = *seen == now;
                    if !keep {
                        due.push(Arc::clone(w));
                    }
                    keep
                });
                self.sleepers.fetch_sub(due.len(), Ordering::SeqCst);
                due
            };
            for w in due {
                w.wake();
            }
        }
    }

    /// Have `wake` called once, at the first ring after generation `seen`; false (and it
    /// is not kept) if that ring happened already.
    pub fn notify_once(&self, seen: u64, wake: Arc<dyn Wake>) -> bool {
        let mut wakes = self.lock.lock();
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        if self.generation.load(Ordering::SeqCst) != seen {
            self.sleepers.fetch_sub(1, Ordering::SeqCst);
            return false;
        }
        wakes.push((seen, wake));
        true
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
    fn a_wake_is_called_once_at_the_next_ring_and_never_for_a_past_one() {
        use std::sync::atomic::AtomicUsize;
        #[derive(Default)]
        struct Count(AtomicUsize);
        impl Wake for Count {
            fn wake(&self) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let bell = Doorbell::new();
        let count = Arc::new(Count::default());
        let seen = bell.generation();
        assert!(bell.notify_once(seen, Arc::clone(&count) as Arc<dyn Wake>));
        bell.ring();
        bell.ring();
        assert_eq!(count.0.load(Ordering::SeqCst), 1, "called once");
        assert!(
            !bell.notify_once(seen, Arc::clone(&count) as Arc<dyn Wake>),
            "the ring after `seen` happened already"
        );
        bell.ring();
        assert_eq!(count.0.load(Ordering::SeqCst), 1, "not kept");
        assert_eq!(bell.sleepers.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn wait_times_out_without_a_ring() {
        let bell = Doorbell::new();
        let seen = bell.generation();
        assert!(!bell.wait(seen, Duration::from_millis(5)));
    }
}
