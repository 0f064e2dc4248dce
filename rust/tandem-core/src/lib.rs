//! tandem-core: the replication hot path of tandem, in pure Rust (no Python).
//!
//! One concept of the paper (Rosinosky et al., SRDS 2021) per module:
//!
//! * [`wire`] — frame codec (fixed header + Arrow IPC body), the checks of an IPC body, the
//!   frame reader and the authenticated handshake, one file each.
//! * [`dedup`] — duplicate sending, first copy wins: a lock-free per-logical-channel
//!   high-water mark fed concurrently by the connections of every upstream replica.
//! * [`consume`] — what every consumption order shares: the [`consume::Merge`] trait, the
//!   inputs a merge reads, the cut a rebuilt replica resumes from, heartbeat and
//!   end-of-channel bookkeeping.
//! * [`liverobin`] — Algorithm 1 of the paper: leaderless deterministic round-robin merge
//!   driven by heartbeats.
//! * [`merge`] — the other consumption orders: `none` (first come, first served) and the
//!   positional order followed by KaZoo replicas ("consume channel c up to seq s").
//! * [`orderlog`] — the KaZoo order log as a replica follows it: fencing by leader epoch,
//!   replays ignored, positional entries handed to the merge.
//! * [`outbox`] — partitioners, per-output-channel sequence numbers, frames cut once per
//!   emitted batch.
//! * [`digest`] — the per-channel cycle digest replicas compare to check determinism.
//! * [`inbox`] — the receiving side of a replica: listener, handshakes, its connections'
//!   reading state machine, dedup and merge behind a blocking `next()`.
//! * [`link`] — the sending side: a TCP link to a downstream replica (one writer thread,
//!   bounded queue), or a local link into an inbox of this process.
//! * [`divergence`] — the online determinism check: replicas' heartbeat digests compared.
//! * [`orderfeed`] — KaZoo's side of an inbox: the order log fed to it, the orders of a
//!   worker's led partitions published.
//! * [`reactor`] — one thread per worker reading every incoming connection (epoll).
//! * [`worker`] — one thread serving many task replicas: watermarks, heartbeat forwarding
//!   and source clocks without waking the host language.
//! * [`logs`] — what the core logs (through the `log` facade), under which target, naming
//!   which replica.
//!
//! Sequence numbers are `u64` and count *every* element of a channel, data rows and
//! heartbeats alike (DESIGN §2, invariant 1).

pub mod consume;
pub mod dedup;
pub mod digest;
pub mod divergence;
pub mod error;
pub mod inbox;
pub mod item;
pub mod link;
pub mod liverobin;
pub mod logs;
pub mod merge;
pub mod orderfeed;
pub mod orderlog;
pub mod outbox;
pub mod reactor;
pub mod socket;
pub mod sync;
#[cfg(test)]
mod test_support;
pub mod wire;
pub mod worker;

pub use error::{Error, Result};
pub use item::{Chunk, Delivery, Item};
