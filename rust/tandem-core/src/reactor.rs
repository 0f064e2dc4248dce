//! The reactor: one thread that reads every established incoming connection of a worker,
//! woken by readiness (Linux `epoll`), instead of a blocking reader thread per connection.
//!
//! ```text
//!  accept ─► handshake (a short-lived thread) ─► Reactor::register ─┐
//!                                                                  ▼
//!  ┌──────────────────────────── the reactor thread ─────────────────────────────┐
//!  │ epoll_wait ─► readable sources ─► Source::turn, one after another, in rounds │
//!  │   Drained  (the socket would block): wait for the next readiness edge        │
//!  │   More     (its share of the round is spent): again next round               │
//!  │   Blocked  (its channel is full, or has a gap): not read until unblocked     │
//!  │   Done     (end of connection): deregistered, then finished and dropped      │
//!  └─────────────────────────────────────────────────────────────────────────────┘
//! ```
//!
//! A [`Source`] is a non-blocking socket with its own decoding state (the inbox's
//! connections, see [`crate::inbox`]). The reactor knows nothing about frames: it
//! decides only when a source gets a turn. Sockets are registered edge-triggered, so a
//! source that stopped before its socket would block (its round share spent, or blocked
//! by back-pressure) is kept in the reactor's own lists rather than waiting for an edge
//! that may not come.
//!
//! Back-pressure: a blocked source is not read, so the kernel's receive buffer fills and
//! TCP's window (or the Unix socket's buffer) stops the sender, as it did for a reader
//! thread waiting for room. The source has the reactor woken when it may go on
//! ([`Source::notify`]: its channel's producer bell calls the reactor's [`Wake`], which
//! writes its eventfd); other sources are served meanwhile, so one full channel does not
//! stall the others.
//!
//! One reactor serves every inbox of a worker ([`crate::worker::Worker::reactor`]); an
//! inbox made without one ([`crate::inbox::InboxConfig::reactor`] None) has its own.
//! The thread starts with the first registered source and stops when the last handle on
//! the reactor goes.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::Mutex;

use crate::sync::Wake;

/// Readiness events taken per `epoll_wait`.
const EVENTS: usize = 256;
/// The epoll token of the reactor's own wake-up eventfd.
const WAKE: u64 = u64::MAX;

/// What one turn of a [`Source`] came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Turn {
    /// It read everything its socket held (the socket would block): serve it again when
    /// the socket becomes readable.
    Drained,
    /// It spent its share of this round and its socket may hold more: serve it again in
    /// the next round.
    More,
    /// It holds an item its channel cannot take yet: it reads nothing until
    /// [`Source::unblocked`] says it may go on (the reactor asks after each wake-up, and
    /// [`Source::notify`] has it woken).
    Blocked,
    /// Its connection is over: the reactor deregisters it, then calls [`Source::finish`].
    Done,
}

/// A non-blocking socket the reactor reads for, with everything needed to decode and
/// deliver what arrives on it.
pub trait Source: Send {
    /// The socket, for readiness. It stays open until [`Source::finish`].
    fn fd(&self) -> RawFd;
    /// Read and deliver what the socket holds, up to a fair share; never blocks.
    fn turn(&mut self) -> Turn;
    /// After [`Turn::Blocked`]: whether to give it a turn again (what it waits for may
    /// have happened). Cheap: asked after every wake-up of the reactor.
    fn unblocked(&self) -> bool;
    /// After [`Turn::Blocked`]: have `wake` called when it may go on; false if it may
    /// already.
    fn notify(&self, wake: Arc<dyn Wake>) -> bool;
    /// After [`Turn::Done`], once deregistered: close the socket and account for the end.
    fn finish(self: Box<Self>);
}

/// A handle on one reactor thread; cheap to share (`Arc<Reactor>`).
#[derive(Default)]
pub struct Reactor {
    /// The running thread, from the first registered source on.
    running: Mutex<Option<Running>>,
}

struct Running {
    inner: Arc<Inner>,
    thread: JoinHandle<()>,
}

/// What the reactor thread and its handles share.
struct Inner {
    epoll: OwnedFd,
    /// An eventfd in `epoll` under [`WAKE`]: written to wake the thread.
    wake: OwnedFd,
    /// Sources registered but not yet picked up by the thread, with their tokens.
    incoming: Mutex<Vec<(u64, Box<dyn Source>)>>,
    next_token: AtomicU64,
    /// Every source gets a turn at the next wake-up (see [`Reactor::sweep`]).
    sweep: AtomicBool,
    stop: AtomicBool,
}

impl Reactor {
    /// A reactor; its thread starts with the first registered source.
    pub fn new() -> Self {
        Self::default()
    }

    /// Serve `source` from now on (its socket must be non-blocking). It gets a first turn
    /// at once, so bytes that arrived before registration are read. On error (the thread
    /// cannot start, the socket cannot be watched) the source is handed back unserved.
    pub fn register(
        &self,
        source: Box<dyn Source>,
    ) -> std::result::Result<(), (Box<dyn Source>, io::Error)> {
        let inner = match self.start() {
            Ok(inner) => inner,
            Err(e) => return Err((source, e)),
        };
        let token = inner.next_token.fetch_add(1, Ordering::Relaxed);
        // Edge-triggered: a source is read until its socket would block (or kept in the
        // reactor's lists), so a level-triggered report would only repeat itself.
        let events = libc::EPOLLIN | libc::EPOLLRDHUP | libc::EPOLLET;
        if let Err(e) = epoll_ctl(
            &inner.epoll,
            libc::EPOLL_CTL_ADD,
            source.fd(),
            token,
            events,
        ) {
            return Err((source, e));
        }
        inner.incoming.lock().push((token, source));
        inner.wake();
        Ok(())
    }

    /// Give every source a turn soon, whether its socket is readable or not: an inbox
    /// that is closing asks this so its blocked connections see it and end.
    pub fn sweep(&self) {
        if let Some(r) = self.running.lock().as_ref() {
            r.inner.sweep.store(true, Ordering::SeqCst);
            r.inner.wake();
        }
    }

    /// The running thread's state, starting it if need be.
    fn start(&self) -> io::Result<Arc<Inner>> {
        let mut running = self.running.lock();
        if let Some(r) = running.as_ref() {
            return Ok(Arc::clone(&r.inner));
        }
        let inner = Arc::new(Inner::new()?);
        let thread = {
            let inner = Arc::clone(&inner);
            std::thread::Builder::new()
                .name("tandem-reactor".to_owned())
                .spawn(move || Inner::run(&inner))?
        };
        *running = Some(Running {
            inner: Arc::clone(&inner),
            thread,
        });
        Ok(inner)
    }
}

impl std::fmt::Debug for Reactor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reactor")
            .field("running", &self.running.lock().is_some())
            .finish()
    }
}

impl Drop for Reactor {
    fn drop(&mut self) {
        if let Some(r) = self.running.lock().take() {
            r.inner.stop.store(true, Ordering::SeqCst);
            r.inner.wake();
            if r.thread.thread().id() != std::thread::current().id() {
                let _ = r.thread.join();
            }
        }
    }
}

/// Where a registered source stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Waiting for its socket to become readable.
    Idle,
    /// In the ready queue.
    Queued,
    /// Waiting for [`Source::unblocked`].
    Blocked,
}

struct Entry {
    source: Box<dyn Source>,
    state: State,
}

impl Inner {
    fn new() -> io::Result<Self> {
        // SAFETY: plain system calls; each result is checked before it is owned.
        let epoll = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if epoll < 0 {
            return Err(os_error("cannot create an epoll instance"));
        }
        // SAFETY: `epoll` is a new descriptor nobody else owns.
        let epoll = unsafe { OwnedFd::from_raw_fd(epoll) };
        // SAFETY: as above.
        let wake = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if wake < 0 {
            return Err(os_error("cannot create an eventfd"));
        }
        // SAFETY: `wake` is a new descriptor nobody else owns.
        let wake = unsafe { OwnedFd::from_raw_fd(wake) };
        epoll_ctl(
            &epoll,
            libc::EPOLL_CTL_ADD,
            wake.as_raw_fd(),
            WAKE,
            libc::EPOLLIN,
        )?;
        Ok(Inner {
            epoll,
            wake,
            incoming: Mutex::new(Vec::new()),
            next_token: AtomicU64::new(0),
            sweep: AtomicBool::new(false),
            stop: AtomicBool::new(false),
        })
    }

    fn wake(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a valid u64 to our eventfd. A full counter
        // (EAGAIN) means a wake-up is pending anyway.
        unsafe {
            libc::write(
                self.wake.as_raw_fd(),
                std::ptr::addr_of!(one).cast(),
                std::mem::size_of::<u64>(),
            );
        }
    }

    /// The reactor thread.
    fn run(self: &Arc<Self>) {
        let mut sources: HashMap<u64, Entry> = HashMap::new();
        let mut ready: VecDeque<u64> = VecDeque::new();
        let mut blocked: Vec<u64> = Vec::new();
        let mut events = vec![libc::epoll_event { events: 0, u64: 0 }; EVENTS];
        loop {
            for (token, source) in self.incoming.lock().drain(..) {
                sources.insert(
                    token,
                    Entry {
                        source,
                        state: State::Queued,
                    },
                );
                ready.push_back(token);
            }
            if self.sweep.swap(false, Ordering::SeqCst) {
                for (&token, e) in &mut sources {
                    if e.state != State::Queued {
                        e.state = State::Queued;
                        ready.push_back(token);
                    }
                }
                blocked.clear();
            }
            blocked.retain(|token| {
                let e = sources
                    .get_mut(token)
                    .expect("a blocked source is registered");
                if e.state == State::Blocked && e.source.unblocked() {
                    e.state = State::Queued;
                    ready.push_back(*token);
                }
                e.state == State::Blocked
            });
            // One round: every source queued now gets one turn.
            for _ in 0..ready.len() {
                let Some(token) = ready.pop_front() else {
                    break;
                };
                let Some(e) = sources.get_mut(&token) else {
                    continue;
                };
                match e.source.turn() {
                    Turn::Drained => e.state = State::Idle,
                    Turn::More => ready.push_back(token),
                    Turn::Blocked => {
                        if e.source.notify(Arc::clone(self) as Arc<dyn Wake>) {
                            e.state = State::Blocked;
                            blocked.push(token);
                        } else {
                            ready.push_back(token);
                        }
                    }
                    Turn::Done => {
                        let e = sources.remove(&token).expect("served just now");
                        // The socket is still open (the source owns it): deregister it
                        // before it closes. Failure means it is not registered any more.
                        let _ =
                            epoll_ctl(&self.epoll, libc::EPOLL_CTL_DEL, e.source.fd(), token, 0);
                        e.source.finish();
                    }
                }
            }
            if self.stop.load(Ordering::SeqCst) {
                return;
            }
            let timeout_ms = if ready.is_empty() { -1 } else { 0 };
            // SAFETY: `events` has room for EVENTS entries.
            let n = unsafe {
                libc::epoll_wait(
                    self.epoll.as_raw_fd(),
                    events.as_mut_ptr(),
                    EVENTS as libc::c_int,
                    timeout_ms,
                )
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                // Nothing the reactor did can cause this (EBADF, EFAULT, EINVAL): a bug.
                panic!("epoll_wait failed on the reactor's own epoll instance: {e}");
            }
            for ev in &events[..n as usize] {
                let token = ev.u64;
                if token == WAKE {
                    let mut count: u64 = 0;
                    // SAFETY: reads 8 bytes into a valid u64 from our eventfd.
                    unsafe {
                        libc::read(
                            self.wake.as_raw_fd(),
                            std::ptr::addr_of_mut!(count).cast(),
                            std::mem::size_of::<u64>(),
                        );
                    }
                    continue;
                }
                // A source not picked up yet is queued when it is; a blocked one waits
                // for room, not bytes; a queued one is served anyway.
                if let Some(e) = sources.get_mut(&token) {
                    if e.state == State::Idle {
                        e.state = State::Queued;
                        ready.push_back(token);
                    }
                }
            }
        }
    }
}

impl Wake for Inner {
    fn wake(&self) {
        Inner::wake(self);
    }
}

fn epoll_ctl(
    epoll: &OwnedFd,
    op: libc::c_int,
    fd: RawFd,
    token: u64,
    events: i32,
) -> io::Result<()> {
    let mut ev = libc::epoll_event {
        events: events as u32,
        u64: token,
    };
    // SAFETY: `ev` is a valid epoll_event for the duration of the call.
    if unsafe { libc::epoll_ctl(epoll.as_raw_fd(), op, fd, &mut ev) } < 0 {
        return Err(os_error("epoll_ctl failed"));
    }
    Ok(())
}

fn os_error(what: &str) -> io::Error {
    let e = io::Error::last_os_error();
    io::Error::new(e.kind(), format!("{what}: {e}"))
}
