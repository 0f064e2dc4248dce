//! The sending side: a replica's links to the replicas of a downstream partition, which
//! the [`crate::outbox::Outbox`] writes its frames to ([`Link`]). A [`TcpLink`] dials an
//! inbox (one writer thread, bounded queue, write-through); a [`LocalLink`] reaches an
//! inbox of this process, where the Arrow batch itself goes straight into the inbox's dedup:
//! no encoding, no socket, no thread.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use arrow_array::RecordBatch;
use parking_lot::{Condvar, Mutex};

use crate::inbox::{Feeder, Inbox};
use crate::outbox::{Link, OutFrame};
use crate::socket::{self, Stream};
use crate::wire::{self, Identity};
use crate::{Error, Item, Result};

/// Settings of a [`TcpLink`].
#[derive(Debug, Clone)]
pub struct LinkConfig {
    /// Frames queued for the writer thread before [`Link::send`] blocks.
    pub queue_frames: usize,
    /// How long to keep retrying to reach the peer (it may not be listening yet).
    pub connect_timeout: Duration,
    /// Read/write timeout during the handshake.
    pub handshake_timeout: Duration,
    /// How long [`Link::close`] waits for queued frames to be written before cutting the
    /// connection.
    pub close_timeout: Duration,
}

impl Default for LinkConfig {
    fn default() -> Self {
        LinkConfig {
            queue_frames: 256,
            connect_timeout: Duration::from_secs(10),
            handshake_timeout: Duration::from_secs(2),
            close_timeout: Duration::from_secs(5),
        }
    }
}

/// A connection to one downstream replica. Implements [`Link`] for the
/// [`crate::outbox::Outbox`].
///
/// **Write-through.** `send` writes the frame to the socket itself, without blocking
/// (`MSG_DONTWAIT`), whenever nothing is queued before it — the common case, since a
/// loopback or LAN socket buffer holds far more than the worker's credit rule lets a slot
/// have in flight. Only what the socket does not take at once (the rest of a frame, and
/// every frame after it) goes to the link's writer thread, which writes it blocking, in
/// order. So a frame costs one `send(2)` and no thread wake-up on the sender's side: a
/// writer thread woken per frame preempted the worker on its own core, which was a tenth
/// of a worker's time.
pub struct TcpLink {
    peer: String,
    shared: Arc<LinkShared>,
    /// Receives one message when the writer thread is about to exit.
    done: Receiver<()>,
    socket: Stream,
    writer: Option<JoinHandle<()>>,
    close_timeout: Duration,
    /// Frames that may wait for the writer thread before `send` blocks.
    capacity: usize,
    /// Frames held back until [`Link::push`] (or until they reach [`COALESCE_BYTES`]).
    pending: Vec<u8>,
    /// Whether `send` holds small frames back ([`Link::defer`]).
    deferred: bool,
    /// Since when the writer's queue has not been empty, as last seen
    /// ([`Link::backed_up_for`]).
    backed_up: std::cell::Cell<Option<Instant>>,
    /// When a replay was handed to the writer ([`Link::replay`]), while the link has not
    /// drained since: for up to [`REPLAY_GRACE`], the peer is catching up, not lagging, and
    /// the queue is not bounded (the sender never waits for it).
    catching_up: std::cell::Cell<Option<Instant>>,
}

/// How long a replica rebuilt from a twin may take to catch up with its replay — read it,
/// and then what queued behind it while it worked through it — before its link counts as
/// lagging like any other. A rebuilt replica starts behind by its replay, and at its lower
/// priority on a busy machine it falls further behind before it gains: taken for a
/// straggler then, it would be rebuilt again, only to start behind again. One that never
/// catches up (wedged while it starts) must not hold its upstream replicas, and so its
/// twins, back for good; evicted, it is rebuilt again. Meanwhile its queue holds at most
/// this long of the channel's frames, as a replay window does.
pub const REPLAY_GRACE: Duration = Duration::from_secs(10);

/// A [`TcpLink`] holds small frames back until the outbox pushes, up to this many bytes;
/// a larger frame is written at once.
const COALESCE_BYTES: usize = 64 << 10;

/// What the sending thread and the writer thread of a [`TcpLink`] share.
struct LinkShared {
    state: Mutex<WriteState>,
    /// Rung when a frame is queued or the link closes (the writer waits on it).
    work: Condvar,
    /// Rung when the writer took a frame off the queue or stopped (a full `send` waits).
    space: Condvar,
    /// `state.queue.len()`, readable without the lock ([`Link::backlog`]).
    queued: AtomicUsize,
}

#[derive(Default)]
struct WriteState {
    /// Frames for the writer thread, each with how many of its bytes are already written.
    queue: VecDeque<(Arc<[u8]>, usize)>,
    /// No more frames will come: the writer drains the queue and half-closes.
    closing: bool,
    /// Why writing failed, once it did.
    failure: Option<String>,
    /// The failure was the peer closing or resetting the connection.
    peer_closed: bool,
}

impl TcpLink {
    /// Dial `addr` (retrying with backoff until `cfg.connect_timeout`), authenticate as `me`
    /// and start the writer thread. A rejected handshake is not retried.
    pub fn connect(addr: &str, me: &Identity, secret: &[u8], cfg: &LinkConfig) -> Result<Self> {
        if cfg.queue_frames == 0 {
            return Err(Error::Config("queue_frames must be ≥ 1 (got 0)".to_owned()));
        }
        let targets: Vec<SocketAddr> = addr
            .to_socket_addrs()
            .map_err(|e| Error::Config(format!("cannot resolve downstream address {addr:?}: {e}")))?
            .collect();
        let Some(&target) = targets.first() else {
            return Err(Error::Config(format!(
                "downstream address {addr:?} resolves to nothing"
            )));
        };
        let deadline = Instant::now() + cfg.connect_timeout;
        let mut backoff = Duration::from_millis(5);
        let stream = loop {
            let attempt = Stream::connect(target, cfg.handshake_timeout).and_then(|s| {
                s.set_read_timeout(Some(cfg.handshake_timeout))?;
                s.set_write_timeout(Some(cfg.handshake_timeout))?;
                Ok(s)
            });
            let err = match attempt
                .map_err(Error::from)
                .and_then(|mut s| wire::client_handshake(&mut s, me, secret).map(|()| s))
            {
                Ok(s) => break s,
                Err(Error::Handshake(m)) => {
                    return Err(Error::Handshake(format!(
                        "downstream replica at {addr}: {m}"
                    )))
                }
                Err(e) => e,
            };
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Closed(format!(
                    "cannot reach downstream replica at {addr} within {:?}: {err}",
                    cfg.connect_timeout
                )));
            }
            std::thread::sleep(backoff.min(deadline - now));
            backoff = (backoff * 2).min(Duration::from_millis(500));
        };
        stream.set_read_timeout(None)?;
        stream.set_write_timeout(None)?;
        let socket = stream.try_clone()?;
        let shared = Arc::new(LinkShared {
            state: Mutex::new(WriteState::default()),
            work: Condvar::new(),
            space: Condvar::new(),
            queued: AtomicUsize::new(0),
        });
        let (done_tx, done) = mpsc::channel();
        let writer = {
            let shared = Arc::clone(&shared);
            let close_timeout = cfg.close_timeout;
            std::thread::Builder::new()
                .name(format!("tandem-write-{addr}"))
                .spawn(move || {
                    if let Err(e) = write_loop(&stream, &shared, close_timeout) {
                        let mut st = shared.state.lock();
                        if st.failure.is_none() {
                            st.failure = Some(e.to_string());
                            st.peer_closed = socket::peer_gone(e.kind());
                        }
                    }
                    shared.space.notify_all(); // a sender blocked on a full queue fails now
                    let _ = done_tx.send(());
                })?
        };
        Ok(TcpLink {
            peer: addr.to_owned(),
            shared,
            done,
            socket,
            writer: Some(writer),
            close_timeout: cfg.close_timeout,
            capacity: cfg.queue_frames,
            pending: Vec::new(),
            deferred: false,
            backed_up: std::cell::Cell::new(None),
            catching_up: std::cell::Cell::new(None),
        })
    }

    fn dead(&self, why: Option<&str>) -> Error {
        Error::Closed(format!(
            "connection to downstream replica {} is gone: {}",
            self.peer,
            why.unwrap_or("the link was closed")
        ))
    }

    /// Write `bytes` after everything sent before: at once if nothing is queued and the
    /// socket takes it, else (the rest of it) through the writer thread, blocking while
    /// its queue is full.
    fn write(&mut self, bytes: Arc<[u8]>) -> Result<()> {
        let shared = &*self.shared;
        let mut st = shared.state.lock();
        if st.closing || st.failure.is_some() {
            return Err(self.dead(st.failure.as_deref()));
        }
        let written = if st.queue.is_empty() {
            // The writer thread is idle (it pops a frame only once written), so the
            // socket is ours for this frame.
            match self.write_now(&bytes) {
                Ok(n) if n == bytes.len() => return Ok(()),
                Ok(n) => n,
                Err(e) => {
                    st.peer_closed = socket::peer_gone(e.kind());
                    let why = st.failure.insert(e.to_string()).clone();
                    shared.work.notify_one();
                    return Err(self.dead(Some(&why)));
                }
            }
        } else {
            // A rebuilt replica catching up has no bound: it is not to hold the sender (and
            // so its twins) back while it catches up.
            let bound = if self.is_catching_up(Instant::now()) {
                usize::MAX
            } else {
                self.capacity
            };
            while st.queue.len() >= bound && st.failure.is_none() {
                shared.space.wait(&mut st);
            }
            if st.failure.is_some() {
                return Err(self.dead(st.failure.as_deref()));
            }
            0
        };
        st.queue.push_back((bytes, written));
        shared.queued.store(st.queue.len(), Ordering::Relaxed);
        shared.work.notify_one();
        Ok(())
    }

    /// Whether the peer, handed a replay, has not drained the link since and is within its
    /// [`REPLAY_GRACE`].
    fn is_catching_up(&self, now: Instant) -> bool {
        self.catching_up
            .get()
            .is_some_and(|handed| now.saturating_duration_since(handed) < REPLAY_GRACE)
    }

    /// Write as much of `bytes` as the socket takes now, without blocking; how much it took.
    fn write_now(&self, bytes: &[u8]) -> io::Result<usize> {
        let fd = self.socket.as_raw_fd();
        let mut off = 0;
        while off < bytes.len() {
            let rest = &bytes[off..];
            // SAFETY: `fd` is this link's open socket, and `rest` is a live slice.
            let n = unsafe {
                libc::send(
                    fd,
                    rest.as_ptr().cast(),
                    rest.len(),
                    libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
                )
            };
            if n >= 0 {
                off += n.unsigned_abs();
                continue;
            }
            let err = io::Error::last_os_error();
            match err.kind() {
                io::ErrorKind::Interrupted => {}
                io::ErrorKind::WouldBlock => break,
                _ => return Err(err),
            }
        }
        Ok(off)
    }
}

/// The writer thread: write what `send` queued, in order, blocking; on a clean close,
/// half-close and wait for the peer to finish reading, so nothing queued is lost.
fn write_loop(stream: &Stream, shared: &LinkShared, close_timeout: Duration) -> io::Result<()> {
    let mut out = stream;
    loop {
        let (frame, written) = {
            let mut st = shared.state.lock();
            while st.queue.is_empty() && !st.closing && st.failure.is_none() {
                shared.work.wait(&mut st);
            }
            if st.failure.is_some() {
                return Ok(()); // the sender saw the socket fail and recorded why
            }
            match st.queue.front() {
                Some((frame, written)) => (Arc::clone(frame), *written),
                None => break, // closing, and everything is written
            }
        };
        out.write_all(&frame[written..])?;
        let mut st = shared.state.lock();
        st.queue.pop_front();
        shared.queued.store(st.queue.len(), Ordering::Relaxed);
        shared.space.notify_all();
    }
    match stream.shutdown(Shutdown::Write) {
        // The peer closed first (a downstream replica that finished on its twins' copies
        // of this stream resets what it left unread): nothing is owed to it any more.
        Err(e) if e.kind() == io::ErrorKind::NotConnected => return Ok(()),
        r => r?,
    }
    // Drain until the peer closes (it sends nothing after the handshake), so closing our
    // end cannot reset the connection before the peer read the tail.
    stream.set_read_timeout(Some(close_timeout))?;
    let mut sink = [0u8; 256];
    let mut reader = stream;
    loop {
        match reader.read(&mut sink) {
            Ok(0) => return Ok(()),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return Ok(()),
        }
    }
}

impl Link for TcpLink {
    fn send(&mut self, frame: &OutFrame) -> Result<()> {
        let Some(bytes) = frame.bytes.as_ref() else {
            return Err(Error::Config(
                "an outbox handed a TCP link a frame without its bytes".to_owned(),
            ));
        };
        if self.deferred
            && self.shared.queued.load(Ordering::Relaxed) == 0
            && bytes.len() < COALESCE_BYTES
        {
            // Held back, to leave in one write with what follows (at the latest on push).
            self.pending.extend_from_slice(bytes);
            if self.pending.len() < COALESCE_BYTES {
                return Ok(());
            }
            return self.push();
        }
        self.push()?;
        self.write(Arc::clone(bytes))
    }

    fn defer(&mut self, on: bool) {
        self.deferred = on;
    }

    fn push(&mut self) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let bytes: Arc<[u8]> = std::mem::take(&mut self.pending).into();
        self.write(bytes)
    }
    fn backlog(&self) -> usize {
        self.shared.queued.load(Ordering::Relaxed)
    }

    fn close(&mut self) -> Result<()> {
        if self.writer.is_none() {
            return Ok(());
        }
        let pushed = self.push();
        let Some(writer) = self.writer.take() else {
            return pushed;
        };
        self.shared.state.lock().closing = true;
        self.shared.work.notify_one();
        if self.done.recv_timeout(self.close_timeout).is_err() {
            // The peer stopped reading: give up on the tail rather than hang.
            let _ = self.socket.shutdown(Shutdown::Both);
        }
        let _ = writer.join();
        let failure = self.shared.state.lock().failure.clone();
        match failure {
            Some(why) => Err(self.dead(Some(&why))),
            None => pushed,
        }
    }

    /// Cut the connection now, dropping whatever is still queued.
    fn abort(&mut self) {
        self.pending.clear();
        let _ = self.socket.shutdown(Shutdown::Both);
        {
            let mut st = self.shared.state.lock();
            st.closing = true;
            st.queue.clear();
            self.shared.queued.store(0, Ordering::Relaxed);
        }
        self.shared.work.notify_one();
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
    }

    fn describe(&self) -> String {
        format!("downstream replica at {}", self.peer)
    }

    fn peer_closed(&self) -> bool {
        self.shared.state.lock().peer_closed
    }

    fn gone(&self) -> bool {
        self.shared.state.lock().failure.is_some() || self.socket.closed_by_peer()
    }

    /// One write of every frame: the writer thread takes it while the sender goes on. The
    /// link is then catching up until it first drains (for up to [`REPLAY_GRACE`]): what
    /// queues behind the replay neither blocks the sender nor makes the new replica look
    /// like a straggler by the frame count.
    fn replay(&mut self, frames: &[OutFrame]) -> Result<()> {
        let mut all = Vec::with_capacity(
            frames
                .iter()
                .map(|f| f.bytes.as_ref().map_or(0, |b| b.len()))
                .sum(),
        );
        for f in frames {
            let Some(bytes) = f.bytes.as_ref() else {
                return Err(Error::Config(
                    "an outbox handed a TCP link a replayed frame without its bytes".to_owned(),
                ));
            };
            all.extend_from_slice(bytes);
        }
        if all.is_empty() {
            return Ok(());
        }
        self.push()?;
        self.write(all.into())?;
        if self.shared.queued.load(Ordering::Relaxed) > 0 {
            // The writer thread has the rest of it.
            self.catching_up.set(Some(Instant::now()));
        }
        Ok(())
    }

    fn backed_up_for(&self, now: Instant) -> Option<Duration> {
        if self.shared.queued.load(Ordering::Relaxed) == 0 {
            self.backed_up.set(None);
            self.catching_up.set(None); // caught up
            return Some(Duration::ZERO);
        }
        if let Some(handed) = self.catching_up.get() {
            if self.is_catching_up(now) {
                // A replica catching up on its replay is not a straggler (yet).
                self.backed_up.set(None);
                return Some(Duration::ZERO);
            }
            // Not caught up in the whole grace: backed up since it was handed its replay.
            self.catching_up.set(None);
            self.backed_up.set(Some(handed));
            return Some(now.saturating_duration_since(handed));
        }
        let since = self.backed_up.get().unwrap_or(now);
        self.backed_up.set(Some(since));
        Some(now.saturating_duration_since(since))
    }

    fn catching_up(&self) -> bool {
        self.catching_up.get().is_some()
    }
}

impl Drop for TcpLink {
    fn drop(&mut self) {
        let _ = Link::close(self);
    }
}

/// A link to an inbox of this process ([`Inbox::local_link`]): each element goes into the
/// inbox's dedup channel as it is — an Arrow batch, never encoded — with the same sequence
/// numbers a [`TcpLink`] would send, so the local copy and the remote replicas' copies
/// deduplicate against each other. It never blocks: an element the channel has no room for
/// waits in the link (its [`Link::backlog`], which the worker's credit rule keeps small)
/// until [`Link::flush`] finds room, in order. Closing or aborting the inbox (the
/// downstream replica finished) makes `send` fail, as a closed connection would.
pub struct LocalLink {
    feeder: Feeder,
    replica: u32,
    pending: VecDeque<Item<RecordBatch>>,
    peer: SocketAddr,
    /// Counted among the channel's feeders (until closed, aborted or dropped).
    feeding: bool,
}

impl Inbox {
    /// A link through which `me`, a replica of an upstream partition living in this
    /// process, sends to this inbox without encoding or a socket. Its copies deduplicate
    /// against the copies the other replicas of `me`'s partition send over TCP, and its
    /// heartbeats' digests are compared with theirs, exactly as for a connection.
    pub fn local_link(&self, me: &Identity) -> Result<LocalLink> {
        Ok(LocalLink {
            feeder: self.feeder(me)?,
            replica: me.replica,
            pending: VecDeque::new(),
            peer: self.local_addr(),
            feeding: true,
        })
    }
}

impl LocalLink {
    fn stop_feeding(&mut self) {
        if std::mem::take(&mut self.feeding) {
            self.feeder.unfeed();
        }
    }
}

impl Drop for LocalLink {
    fn drop(&mut self) {
        self.stop_feeding();
    }
}

impl Link for LocalLink {
    fn send(&mut self, frame: &OutFrame) -> Result<()> {
        if self.feeder.closed() {
            self.pending.clear();
            return Err(Error::Closed(format!(
                "the downstream replica at {} (in this worker) has closed its inbox",
                self.peer
            )));
        }
        if let (Item::Heartbeat { epoch, .. }, Some(digest)) = (&frame.item, frame.digest) {
            self.feeder.check_digest(self.replica, *epoch, digest);
        }
        self.pending.push_back(frame.item.clone());
        self.flush();
        Ok(())
    }

    fn wants_bytes(&self) -> bool {
        false
    }

    fn flush(&mut self) {
        while let Some(item) = self.pending.pop_front() {
            if let Some(back) = self.feeder.offer(item) {
                self.pending.push_front(back);
                return;
            }
        }
    }

    fn backlog(&self) -> usize {
        self.pending.len()
    }

    fn close(&mut self) -> Result<()> {
        self.flush();
        self.stop_feeding();
        if self.pending.is_empty() || self.feeder.closed() {
            return Ok(());
        }
        let left = self.pending.len();
        self.pending.clear();
        Err(Error::Closed(format!(
            "{left} elements for the downstream replica at {} (in this worker) were never \
             taken",
            self.peer
        )))
    }

    fn abort(&mut self) {
        self.pending.clear();
        self.stop_feeding();
    }

    fn describe(&self) -> String {
        format!("downstream replica at {} (in this worker)", self.peer)
    }

    fn peer_closed(&self) -> bool {
        self.feeder.closed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    use crate::logs::ReplicaTag;
    use crate::merge::OrderingMode;
    use crate::outbox::{Outbox, OutboxConfig, Partitioner};
    use crate::test_support::*;

    #[test]
    fn local_copy_first_then_the_remote_duplicate_is_dropped_without_decoding() {
        let mut ib = inbox(1, OrderingMode::None, 64);
        let mut local = ib.local_link(&identity(0, 0)).unwrap();
        assert!(!local.wants_bytes());
        let first = OutFrame {
            item: Item::Data {
                first_seq: 0,
                payload: rows(0..10),
            },
            digest: None,
            bytes: None,
        };
        local.send(&first).unwrap();
        assert_eq!(local.backlog(), 0, "room in the channel: taken at once");
        // The remote twin's copy of the same rows: never decoded (its body is garbage),
        // counted as duplicate, and the connection stays up.
        let mut remote = link(ib.local_addr(), &identity(0, 1));
        remote.send(&junk_data(0, 10)).unwrap();
        let st = wait_for(&ib, "duplicate counted", |st| {
            st.channels[0].duplicate_rows == 10
        });
        assert!(st.connections[0].open && st.connections[0].error.is_none());
        // Garbage covering rows nobody has yet is decoded, and fails the connection.
        remote.send(&junk_data(10, 5)).unwrap();
        let st = wait_for(&ib, "connection failed", |st| {
            st.connections[0].error.is_some()
        });
        assert_eq!(st.channels[0].accepted_rows, 10);
        local.send(&end_at(10)).unwrap();
        let got = drain(&mut ib, Duration::from_secs(5));
        assert_eq!(rows_of(&got, 0), (0..10).collect::<Vec<_>>());
    }

    #[test]
    fn a_deferring_link_writes_what_it_held_back_on_push_in_order() {
        let mut ib = inbox(1, OrderingMode::None, 64);
        let mut remote = link(ib.local_addr(), &identity(0, 0));
        remote.defer(true);
        let data = |first: i64, n: i64| OutFrame {
            item: Item::End { seq: 0 }, // unused by a TCP link
            digest: None,
            bytes: Some(
                wire::encode_data(0, first as u64, &rows(first..first + n))
                    .unwrap()
                    .into(),
            ),
        };
        remote.send(&data(0, 3)).unwrap();
        remote.send(&data(3, 2)).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(
            ib.stats().channels[0].accepted_rows,
            0,
            "held back until push"
        );
        remote.push().unwrap();
        wait_for(&ib, "both frames delivered", |st| {
            st.channels[0].accepted_rows == 5
        });
        // Not deferring (the default): every frame leaves at once.
        remote.defer(false);
        remote.send(&data(5, 1)).unwrap();
        wait_for(&ib, "written at once", |st| {
            st.channels[0].accepted_rows == 6
        });
        let end = OutFrame {
            item: Item::End { seq: 6 },
            digest: None,
            bytes: Some(wire::encode_end(0, 6).into()),
        };
        remote.defer(true);
        remote.send(&end).unwrap();
        remote.close().unwrap(); // pushes what it held back first
        let got = drain(&mut ib, Duration::from_secs(5));
        assert_eq!(rows_of(&got, 0), (0..6).collect::<Vec<_>>());
    }

    #[test]
    fn a_local_link_holds_what_the_channel_has_no_room_for_in_order() {
        let mut ib = inbox(1, OrderingMode::None, 2);
        let mut local = ib.local_link(&identity(0, 0)).unwrap();
        for i in 0..5 {
            let f = OutFrame {
                item: Item::Data {
                    first_seq: i * 2,
                    payload: rows(i as i64 * 2..i as i64 * 2 + 2),
                },
                digest: None,
                bytes: None,
            };
            local.send(&f).unwrap();
        }
        local.send(&end_at(10)).unwrap();
        assert_eq!(local.backlog(), 4, "two fit the channel, the rest waits");
        let mut got = Vec::new();
        while local.backlog() > 0 {
            let d = ib.next(Duration::from_millis(100)).unwrap().unwrap();
            flatten(d, &mut got);
            local.flush();
        }
        got.extend(drain(&mut ib, Duration::from_secs(5)));
        assert_eq!(rows_of(&got, 0), (0..10).collect::<Vec<_>>());
        assert!(ib.local_link(&identity(5, 0)).is_err(), "not an upstream");
        ib.close();
        assert!(local.send(&junk_data(10, 1)).is_err(), "the inbox closed");
    }

    #[test]
    fn a_replay_left_unread_past_the_grace_counts_as_lagging() {
        // A receiver that never consumes: its queue of one fills, then the sockets.
        let ib = inbox(1, OrderingMode::LiveRobin, 1);
        let mut l = link(ib.local_addr(), &identity(0, 0));
        let frames: Vec<OutFrame> = (0..1_000_000u64)
            .map(|s| OutFrame {
                item: Item::Heartbeat {
                    seq: s,
                    epoch: s + 1,
                },
                digest: None,
                bytes: Some(wire::encode_heartbeat(0, s, s + 1).into()),
            })
            .collect();
        l.replay(&frames).unwrap();
        std::thread::sleep(Duration::from_millis(300));
        let now = Instant::now();
        assert_eq!(
            l.backed_up_for(now),
            Some(Duration::ZERO),
            "catching up on its replay"
        );
        let later = now + REPLAY_GRACE + Duration::from_secs(1);
        let lag = l.backed_up_for(later).unwrap();
        assert!(lag > REPLAY_GRACE, "unread for the whole grace: {lag:?}");
        l.abort();
    }

    #[test]
    fn a_replica_catching_up_on_its_replay_neither_blocks_the_sender_nor_lags_by_frames() {
        // A rebuilt replica that reads slowly: the frames sent behind its replay pile up
        // past the queue's bound, and the sender never waits for it.
        let ib = inbox(1, OrderingMode::LiveRobin, 1);
        let mut l = link(ib.local_addr(), &identity(0, 0));
        let beat = |s: u64| OutFrame {
            item: Item::Heartbeat {
                seq: s,
                epoch: s + 1,
            },
            digest: None,
            bytes: Some(wire::encode_heartbeat(0, s, s + 1).into()),
        };
        let frames: Vec<OutFrame> = (0..1_000_000u64).map(beat).collect();
        l.replay(&frames).unwrap();
        let behind = 4 * LinkConfig::default().queue_frames;
        let (tx, rx) = std::sync::mpsc::channel();
        let sender = std::thread::spawn(move || {
            for s in 0..behind as u64 {
                l.send(&beat(1_000_000 + s)).unwrap();
            }
            tx.send(()).unwrap();
            l
        });
        rx.recv_timeout(Duration::from_secs(10))
            .expect("the sender waited for a replica catching up");
        let mut l = sender.join().unwrap();
        assert!(l.backlog() > LinkConfig::default().queue_frames);
        let now = Instant::now();
        assert_eq!(l.backed_up_for(now), Some(Duration::ZERO));
        assert!(
            l.catching_up(),
            "behind by the frame count, yet catching up"
        );
        // Not caught up in the whole grace: lagging since its replay, like any link.
        let lag = l.backed_up_for(now + REPLAY_GRACE).unwrap();
        assert!(lag >= REPLAY_GRACE, "{lag:?}");
        assert!(!l.catching_up());
        l.abort();
    }

    /// Wait up to 5 s for `gone` to hold.
    fn seen_within_5_s(what: &str, gone: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !gone() {
            assert!(Instant::now() < deadline, "{what}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn a_link_knows_its_peer_is_gone_once_it_closed_before_any_send_fails() {
        // A link to an inbox (the Unix socket a loopback address gets), its inbox closed.
        let mut ib = inbox(1, OrderingMode::LiveRobin, 4);
        let l = link(ib.local_addr(), &identity(0, 0));
        assert!(!l.gone(), "a live inbox is not gone");
        ib.close();
        seen_within_5_s("a closed inbox never seen gone", || l.gone());
        // A TCP stream whose peer closed its end, nothing sent either way.
        let tcp = TcpListener::bind("127.0.0.1:0").unwrap();
        let stream = Stream::connect(tcp.local_addr().unwrap(), Duration::from_secs(5)).unwrap();
        assert_eq!(stream.kind(), "TCP");
        let (served, _) = tcp.accept().unwrap();
        assert!(!stream.closed_by_peer(), "a peer that is there is not gone");
        drop(served);
        seen_within_5_s("a closed TCP peer never seen gone", || {
            stream.closed_by_peer()
        });
    }

    #[test]
    fn a_downstream_that_closed_is_dropped_at_debug_level() {
        crate::logs::capture::install();
        let mut ib = inbox(1, OrderingMode::LiveRobin, 4);
        let l = link(ib.local_addr(), &identity(0, 0));
        let mut ob = Outbox::new(
            Partitioner::Forward,
            vec![vec![l]],
            OutboxConfig { batch_rows: 64 },
        )
        .unwrap()
        .tagged(ReplicaTag::new(TASK, 0, 0).named("logtest-finished"));
        // The downstream replica finished (on its twin's copies, say) and closed its end.
        ib.close();
        drop(ib);
        let mut failed = false;
        for i in 0..2000 {
            if ob.emit(&fat_rows(i * 64..(i + 1) * 64)).is_err() {
                failed = true;
                break;
            }
        }
        assert!(failed, "sending to a closed inbox kept succeeding");
        ob.close();
        let got = crate::logs::capture::matching("logtest-finished");
        assert!(!got.is_empty(), "the dropped link was not logged");
        assert!(
            got.iter().all(|c| c.level == log::Level::Debug),
            "a peer that closed its end is not a warning: {got:?}"
        );
        assert!(
            got[0].message.contains("dropping downstream replica"),
            "{got:?}"
        );
    }

    #[test]
    fn link_connect_times_out_when_nobody_listens() {
        let port = {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let cfg = LinkConfig {
            connect_timeout: Duration::from_millis(200),
            ..LinkConfig::default()
        };
        let t = Instant::now();
        let r = TcpLink::connect(&format!("127.0.0.1:{port}"), &identity(0, 0), SECRET, &cfg);
        assert!(
            matches!(&r, Err(Error::Closed(m)) if m.contains("cannot reach")),
            "{:?}",
            r.err()
        );
        assert!(t.elapsed() < Duration::from_secs(2));
    }
}
