//! `tandem._core.Outbox` and `DialedLink`: the sending side of a replica
//! ([`tandem_core::outbox`] over the links of [`tandem_core::link`]) for pyarrow record
//! batches.
//!
//! `Outbox.emit` and friends run with the GIL released (`py.detach`): they block only
//! while a downstream queue is full, which is the back-pressure.

use std::sync::Arc;

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};
use tandem_core::inbox::Inbox as CoreInbox;
use tandem_core::link::{LinkConfig, TcpLink};
use tandem_core::logs::{ReplicaTag, OUTBOX};
use tandem_core::outbox::{
    Eviction, Link, Outbox as CoreOutbox, OutboxConfig, Partitioner, ReplayWindow,
};
use tandem_core::wire::Identity;
use tandem_core::worker::Handle;
use tandem_core::Error;

use crate::args::{arg_at_least_1, arg_seconds, arg_u32, closed, config_err, replica_tag};
use crate::batch::SchemaCache;
use crate::errors::{ConfigError, IntoPyResult};
use crate::inbox::Inbox;

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Outbox>()?;
    m.add_class::<DialedLink>()?;
    Ok(())
}

/// A connection to a downstream replica, dialled and authenticated by [`Outbox::dial`],
/// waiting to be attached to a channel of that outbox ([`Outbox::attach`]). Dropped
/// unattached, it closes.
#[pyclass(frozen, module = "tandem._core")]
pub struct DialedLink {
    peer: String,
    link: Mutex<Option<TcpLink>>,
}

#[pymethods]
impl DialedLink {
    fn __repr__(&self) -> String {
        let state = if self.link.lock().is_some() {
            "unattached"
        } else {
            "attached"
        };
        format!("DialedLink({}, {state})", self.peer)
    }
}

/// The output of one task partition replica: partitions emitted rows over the downstream
/// partitions (channels), numbers every row and marker, sends each emitted batch's part of
/// a channel at once (frames of at most `batch_rows` rows cut at fixed offsets of that part)
/// to every replica of the channel's downstream partition, and keeps each channel's cycle
/// digest, which its heartbeats carry.
///
/// `me` is `(task, partition, replica)`; `downstream[c]` lists the replicas of downstream
/// partition `c`: each a `(host, port)` to dial, or the `Inbox` itself when the replica
/// lives in this process (the batches then go straight into its dedup, never encoded).
/// Construction dials the others (in parallel, retrying until `connect_timeout`); an
/// unreachable replica is logged and skipped, a channel with no reachable replica is an
/// error.
#[pyclass(frozen, module = "tandem._core")]
pub struct Outbox {
    pub(crate) inner: Handle<CoreOutbox>,
    /// Who this outbox sends as, and how it dials: for `dial`.
    me: Identity,
    secret: Vec<u8>,
    link_cfg: LinkConfig,
    /// `next_seqs` as of the last completed call, readable while another thread is blocked
    /// in `emit` holding `inner` (back-pressure may last as long as the consumer sleeps).
    seqs: Mutex<Vec<u64>>,
    schemas: SchemaCache,
}

impl Outbox {
    /// Run `f` on the outbox with the GIL released — the lock too: `emit` may hold it as
    /// long as a downstream applies back-pressure, and a thread waiting for it must not hold
    /// the GIL meanwhile.
    fn with<T: Send>(
        &self,
        py: Python<'_>,
        what: &str,
        f: impl FnOnce(&mut CoreOutbox) -> tandem_core::Result<T> + Send,
    ) -> PyResult<T> {
        py.detach(|| {
            let mut guard = self.inner.lock();
            let ob = guard.as_mut().ok_or_else(|| closed(what))?;
            let res = f(ob);
            // Refilled, not copied over: a switch (`Outbox::switch_at`) may grow the channels.
            let mut seqs = self.seqs.lock();
            seqs.clear();
            seqs.extend_from_slice(ob.next_seqs());
            res.py()
        })
    }
}

#[pymethods]
impl Outbox {
    #[new]
    #[pyo3(signature = (job, secret, me, downstream, partitioner = "forward", key = None,
                        key_groups = 128, batch_rows = 1024, connect_timeout = 10.0, queue_frames = 256,
                        name = None, evict_after_ms = None, replay_cycles = None,
                        replay_bytes = 64 << 20, hold_orphans = false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        job: &str,
        secret: &[u8],
        me: (i64, i64, i64),
        downstream: Vec<Vec<Bound<'_, PyAny>>>,
        partitioner: &str,
        key: Option<&str>,
        key_groups: i64,
        batch_rows: i64,
        connect_timeout: f64,
        queue_frames: i64,
        name: Option<String>,
        evict_after_ms: Option<f64>,
        replay_cycles: Option<i64>,
        replay_bytes: i64,
        hold_orphans: bool,
    ) -> PyResult<Self> {
        crate::logs::sync_level(py)?;
        let tag = replica_tag(Some(me), name)?;
        let key_groups = arg_u32("key_groups", key_groups)?;
        let partitioner = Partitioner::parse(partitioner, key)
            .and_then(|p| p.with_key_groups(key_groups))
            .py()?;
        let me = Identity {
            job: job.to_owned(),
            task: arg_u32("me task", me.0)?,
            partition: arg_u32("me partition", me.1)?,
            replica: arg_u32("me replica", me.2)?,
        };
        let cfg = OutboxConfig {
            batch_rows: arg_at_least_1("batch_rows", batch_rows)?,
        };
        let queue_frames = arg_at_least_1("queue_frames", queue_frames)?;
        let eviction = match evict_after_ms {
            None => None,
            Some(ms) => Some(Eviction {
                frames: (queue_frames / 2).max(1),
                after: arg_seconds("evict_after_ms", ms / 1000.0)?,
            }),
        };
        let link_cfg = LinkConfig {
            queue_frames,
            connect_timeout: arg_seconds("connect_timeout", connect_timeout)?,
            ..LinkConfig::default()
        };
        let targets = parse_targets(downstream, false)?;
        let window = match replay_cycles {
            None => None,
            Some(cycles) => Some(ReplayWindow {
                cycles: arg_at_least_1("replay_cycles", cycles)?,
                bytes: arg_at_least_1("replay_bytes", replay_bytes)?,
            }),
        };
        let secret = secret.to_vec();
        let outbox = py.detach(|| -> tandem_core::Result<CoreOutbox> {
            let links = dial_all(&targets, &me, tag.as_ref(), &secret, &link_cfg)?;
            let mut outbox = CoreOutbox::new(partitioner, links, cfg)?;
            outbox.evicting(eviction);
            outbox.keep_replay(window);
            outbox.hold_orphans(hold_orphans);
            Ok(match tag {
                Some(t) => outbox.tagged(t),
                None => outbox,
            })
        });
        let outbox = outbox.py()?;
        Ok(Outbox {
            seqs: Mutex::new(outbox.next_seqs().to_vec()),
            inner: Arc::new(Mutex::new(Some(outbox))),
            me,
            secret,
            link_cfg,
            schemas: SchemaCache::default(),
        })
    }

    /// Dial `address` (`(host, port)`) and authenticate, for a later [`Outbox::attach`]:
    /// blocking (GIL released) for as long as the peer takes to answer, touching nothing
    /// of the outbox, so any thread may dial while another sends. Fails (ConnectionError)
    /// if the peer cannot be reached within `connect_timeout` or refuses the handshake.
    fn dial(&self, py: Python<'_>, address: (String, u16)) -> PyResult<DialedLink> {
        let addr = format!("{}:{}", address.0, address.1);
        let link = py
            .detach(|| TcpLink::connect(&addr, &self.me, &self.secret, &self.link_cfg))
            .py()?;
        Ok(DialedLink {
            peer: addr,
            link: Mutex::new(Some(link)),
        })
    }

    /// Make `link` (from [`Outbox::dial`]) a link of channel `channel`, to a replica
    /// rebuilt from a twin's cut at heartbeat `after_epoch`: what the replay window holds
    /// after that heartbeat first, then everything from now on. Fails if the link was
    /// attached before, or the window no longer reaches back to the cut ("needs a later
    /// cut"); the link is then closed.
    fn attach(
        &self,
        py: Python<'_>,
        channel: usize,
        link: &DialedLink,
        after_epoch: u64,
    ) -> PyResult<()> {
        let link = link.link.lock().take().ok_or_else(|| {
            ConfigError::new_err(format!("the link to {} is attached already", link.peer))
        })?;
        self.with(py, "attach", move |ob| {
            ob.add_link(channel, Box::new(link), after_epoch)
        })
    }

    /// Change the channel set right after heartbeat `epoch` leaves (a live rescale of the
    /// downstream task): from then on rows go to `len(downstream)` channels, routed by
    /// `partitioner` (with `key`, `key_groups`); channel `c` of the present ones goes on
    /// with its seqs and digests to the replicas `downstream[c]` (its present links
    /// retire after heartbeat `epoch`; an empty list keeps them), the channels after them
    /// are new, from seq 0.
    /// `downstream` as for the constructor; the remote replicas are dialled first (GIL
    /// released, the outbox not held). Refused once heartbeat `epoch` was sent.
    #[pyo3(signature = (epoch, downstream, partitioner, key = None, key_groups = 128))]
    fn switch_at(
        &self,
        py: Python<'_>,
        epoch: u64,
        downstream: Vec<Vec<Bound<'_, PyAny>>>,
        partitioner: &str,
        key: Option<&str>,
        key_groups: i64,
    ) -> PyResult<()> {
        let key_groups = arg_u32("key_groups", key_groups)?;
        let partitioner = Partitioner::parse(partitioner, key)
            .and_then(|p| p.with_key_groups(key_groups))
            .py()?;
        let targets = parse_targets(downstream, true)?;
        let links = py
            .detach(|| dial_all(&targets, &self.me, None, &self.secret, &self.link_cfg))
            .py()?;
        self.with(py, "switch_at", move |ob| {
            ob.switch_at(epoch, partitioner, links)
        })
    }

    /// Disarm the switch `switch_at` armed, if it is still to come; whether one was.
    fn cancel_switch(&self, py: Python<'_>) -> PyResult<bool> {
        self.with(py, "cancel_switch", |ob| Ok(ob.cancel_switch()))
    }

    /// The last heartbeat epoch sent (None: none yet).
    #[getter]
    fn last_heartbeat(&self, py: Python<'_>) -> PyResult<Option<u64>> {
        self.with(py, "last_heartbeat", |ob| Ok(ob.last_heartbeat()))
    }

    /// Partition the rows of `batch` (a pyarrow.RecordBatch or anything with
    /// `__arrow_c_array__`) and send each channel's part now, as frames of at most
    /// `batch_rows` rows. A batch that cannot be encoded or digested is refused whole
    /// (nothing sent). Blocks (GIL released) while a downstream queue is full.
    fn emit(&self, py: Python<'_>, batch: &Bound<'_, PyAny>) -> PyResult<()> {
        let batch = self.schemas.import(py, batch)?;
        self.with(py, "emit", move |ob| ob.emit(&batch))
    }

    /// Send a heartbeat of cycle `epoch` on every channel, carrying the channel's digest of
    /// the data sent since its previous heartbeat.
    fn heartbeat(&self, py: Python<'_>, epoch: u64) -> PyResult<()> {
        self.with(py, "heartbeat", move |ob| ob.heartbeat(epoch))
    }

    /// Send the end marker on every channel (the digest of the data after the last
    /// heartbeat is recorded under epoch 2**64 - 1).
    fn end(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, "end", CoreOutbox::end)
    }

    /// The cycle digests closed since the last call, oldest first: `(channel, epoch,
    /// digest)` with a 16-byte `digest`, one per channel per heartbeat, plus one per channel
    /// under epoch 2**64 - 1 once `end()` ran. Drains them.
    fn digests<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let taken = self.with(py, "digests", |ob| Ok(ob.take_digests()))?;
        PyList::new(
            py,
            taken
                .into_iter()
                .map(|(c, epoch, d)| (c, epoch, PyBytes::new(py, &d))),
        )
    }

    /// Close the connections (each delivers what it queued first; nothing else is
    /// pending, `emit` sends at once). Without a prior `end()`, receivers see this replica
    /// stop mid-stream. Idempotent.
    fn close(&self, py: Python<'_>) {
        py.detach(|| {
            if let Some(mut ob) = self.inner.lock().take() {
                ob.close();
            }
        });
    }

    /// Cut every connection now, dropping queued frames: a crash of this replica as the
    /// receivers see it (fault injection). Idempotent.
    fn abort(&self, py: Python<'_>) {
        py.detach(|| {
            if let Some(mut ob) = self.inner.lock().take() {
                ob.abort();
            }
        });
    }

    /// The downstream replicas dropped as stragglers since the last call: `(channel,
    /// peer)`, the peer as `host:port`.
    fn take_evicted(&self, py: Python<'_>) -> PyResult<Vec<(usize, String)>> {
        let taken = self.with(py, "take_evicted", |ob| Ok(ob.take_evicted()))?;
        Ok(taken
            .into_iter()
            .map(|(c, peer)| {
                let addr = peer.rsplit(' ').next().unwrap_or(&peer).to_owned();
                (c, addr)
            })
            .collect())
    }

    /// The seq the next element of each channel takes, as of the last completed call.
    /// Never blocks, even while another thread is in `emit`.
    #[getter]
    fn next_seqs(&self) -> Vec<u64> {
        self.seqs.lock().clone()
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _exc_type: Option<&Bound<'_, PyAny>>,
        _exc: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) {
        self.close(py);
    }
}

/// A downstream replica: an address to dial, or an inbox of this process.
enum Target {
    Remote(String),
    Local(Handle<CoreInbox>),
}

impl Target {
    fn describe(&self) -> String {
        match self {
            Target::Remote(addr) => addr.clone(),
            Target::Local(inbox) => inbox.lock().as_ref().map_or_else(
                || "a closed inbox of this process".to_owned(),
                |ib| format!("{} (in this process)", ib.local_addr()),
            ),
        }
    }
}

/// `downstream` as the constructor and [`Outbox::switch_at`] take it: per channel, its
/// replicas, each a `(host, port)` or an `Inbox` of this process. `keep`: a channel may be
/// empty (a switch keeps its present links).
fn parse_targets(downstream: Vec<Vec<Bound<'_, PyAny>>>, keep: bool) -> PyResult<Vec<Vec<Target>>> {
    if downstream.is_empty() {
        return Err(config_err(
            "downstream is empty; give at least one channel of (host, port) replicas".to_owned(),
        ));
    }
    let mut targets = Vec::with_capacity(downstream.len());
    for (c, replicas) in downstream.into_iter().enumerate() {
        if replicas.is_empty() && !keep {
            return Err(config_err(format!(
                "downstream[{c}] is empty; every channel needs at least one (host, port)"
            )));
        }
        let mut ch = Vec::with_capacity(replicas.len());
        for replica in replicas {
            if let Ok(inbox) = replica.cast::<Inbox>() {
                ch.push(Target::Local(Arc::clone(&inbox.get().inner)));
                continue;
            }
            let (host, port): (String, i64) = replica.extract().map_err(|_| {
                config_err(format!(
                    "downstream[{c}] holds {}; give (host, port) or an Inbox of this process",
                    replica
                        .repr()
                        .map_or_else(|_| "?".to_owned(), |r| r.to_string())
                ))
            })?;
            let port = u16::try_from(port)
                .ok()
                .filter(|&p| p != 0)
                .ok_or_else(|| {
                    config_err(format!(
                        "downstream[{c}] port must be in 1..=65535, got {port}"
                    ))
                })?;
            ch.push(Target::Remote(format!("{host}:{port}")));
        }
        targets.push(ch);
    }
    Ok(targets)
}

/// Link every downstream replica: the local ones directly, the remote ones dialled in
/// parallel. A replica that cannot be reached is logged and left out; a channel none of
/// whose replicas can be reached fails with the last error (so a wrong secret surfaces as
/// an authentication error).
fn dial_all(
    targets: &[Vec<Target>],
    me: &Identity,
    tag: Option<&ReplicaTag>,
    secret: &[u8],
    cfg: &LinkConfig,
) -> tandem_core::Result<Vec<Vec<Box<dyn Link>>>> {
    /// A link being dialled on its own thread, or one made at once (a local inbox).
    enum Pending<'s> {
        Dialing(std::thread::ScopedJoinHandle<'s, tandem_core::Result<Box<dyn Link>>>),
        Made(tandem_core::Result<Box<dyn Link>>),
    }
    let results: Vec<Vec<tandem_core::Result<Box<dyn Link>>>> = std::thread::scope(|s| {
        let pending: Vec<Vec<Pending<'_>>> = targets
            .iter()
            .map(|ch| {
                ch.iter()
                    .map(|t| match t {
                        Target::Remote(a) => Pending::Dialing(s.spawn(move || {
                            TcpLink::connect(a, me, secret, cfg)
                                .map(|l| Box::new(l) as Box<dyn Link>)
                        })),
                        Target::Local(inbox) => Pending::Made(match inbox.lock().as_ref() {
                            Some(ib) => ib.local_link(me).map(|l| Box::new(l) as Box<dyn Link>),
                            None => Err(Error::Closed(
                                "the downstream inbox in this process is closed".to_owned(),
                            )),
                        }),
                    })
                    .collect()
            })
            .collect();
        pending
            .into_iter()
            .map(|ch| {
                ch.into_iter()
                    .map(|p| match p {
                        Pending::Dialing(h) => h.join().unwrap_or_else(|_| {
                            Err(Error::Closed("the dialing thread panicked".to_owned()))
                        }),
                        Pending::Made(link) => link,
                    })
                    .collect()
            })
            .collect()
    });
    let mut links = Vec::with_capacity(results.len());
    for (c, ch) in results.into_iter().enumerate() {
        if targets[c].is_empty() {
            links.push(Vec::new()); // a switch's channel that keeps its links
            continue;
        }
        let mut live: Vec<Box<dyn Link>> = Vec::new();
        let mut last_err = None;
        for (r, res) in ch.into_iter().enumerate() {
            match res {
                Ok(link) => live.push(link),
                // A local inbox that does not read from this partition is a wiring bug.
                Err(e @ Error::Config(_)) if matches!(targets[c][r], Target::Local(_)) => {
                    return Err(e)
                }
                Err(e) => {
                    let who = tag.map_or_else(
                        || {
                            format!(
                                "task {} partition {} replica {}",
                                me.task, me.partition, me.replica
                            )
                        },
                        |t| t.name.clone(),
                    );
                    log::warn!(
                        target: OUTBOX,
                        task = me.task, partition = me.partition, replica = me.replica;
                        "{who}: skipping downstream replica {} of output channel {c}, which \
                         cannot be reached: {e}; the other replicas of that partition receive \
                         its output",
                        targets[c][r].describe()
                    );
                    last_err = Some(e);
                }
            }
        }
        if live.is_empty() {
            return Err(match last_err {
                Some(Error::Handshake(m)) => Error::Handshake(m),
                Some(e) => Error::Closed(format!(
                    "no replica of downstream channel {c} ({}) is reachable: {e}",
                    targets[c]
                        .iter()
                        .map(Target::describe)
                        .collect::<Vec<_>>()
                        .join(", ")
                )),
                None => Error::Config(format!("downstream channel {c} has no replica")),
            });
        }
        links.push(live);
    }
    Ok(links)
}
