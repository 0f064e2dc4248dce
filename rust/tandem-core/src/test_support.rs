//! What the tests of the inbox, the links, the order feed and the divergence check share:
//! batches, identities, an inbox and a TCP link as the tests set them up, upstream
//! replicas sending to plan, and a consumption flattened to one event per row.

use std::net::SocketAddr;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use arrow_array::cast::AsArray;
use arrow_array::types::Int64Type;
use arrow_array::{BinaryArray, Int64Array, RecordBatch};
use arrow_schema::{DataType, Field, Schema};

use crate::inbox::{Inbox, InboxConfig, InboxStats};
use crate::link::{LinkConfig, TcpLink};
use crate::merge::OrderingMode;
use crate::outbox::{Link, OutFrame, Outbox, OutboxConfig, Partitioner};
use crate::wire::{self, Identity};
use crate::{Delivery, Error, Item, Result};

pub(crate) const JOB: &str = "job-7";
pub(crate) const SECRET: &[u8] = b"s3cret";
pub(crate) const TASK: u32 = 1;

pub(crate) fn rows(values: std::ops::Range<i64>) -> RecordBatch {
    let schema = Arc::new(Schema::new(vec![Field::new("v", DataType::Int64, false)]));
    RecordBatch::try_new(schema, vec![Arc::new(Int64Array::from_iter_values(values))]).unwrap()
}

/// Rows carrying a 1 KiB payload each, to fill socket buffers quickly.
pub(crate) fn fat_rows(values: std::ops::Range<i64>) -> RecordBatch {
    let schema = Arc::new(Schema::new(vec![
        Field::new("v", DataType::Int64, false),
        Field::new("pad", DataType::Binary, false),
    ]));
    let pad = vec![7u8; 1024];
    let n = (values.end - values.start) as usize;
    let pads = BinaryArray::from_iter_values(std::iter::repeat_n(&pad[..], n));
    RecordBatch::try_new(
        schema,
        vec![
            Arc::new(Int64Array::from_iter_values(values)),
            Arc::new(pads),
        ],
    )
    .unwrap()
}

pub(crate) fn identity(partition: u32, replica: u32) -> Identity {
    Identity {
        job: JOB.to_owned(),
        task: TASK,
        partition,
        replica,
    }
}

pub(crate) fn inbox(upstreams: usize, ordering: OrderingMode, capacity: usize) -> Inbox {
    let mut cfg = InboxConfig::new(
        JOB,
        SECRET,
        (0..upstreams as u32).map(|p| (TASK, p)).collect(),
    );
    cfg.ordering = ordering;
    cfg.queue_capacity = capacity;
    cfg.handshake_timeout = Duration::from_millis(500);
    Inbox::bind(cfg).unwrap()
}

pub(crate) fn link(addr: SocketAddr, me: &Identity) -> Box<dyn Link> {
    let cfg = LinkConfig {
        connect_timeout: Duration::from_secs(5),
        ..LinkConfig::default()
    };
    Box::new(TcpLink::connect(&addr.to_string(), me, SECRET, &cfg).unwrap())
}

/// A raw Data frame claiming `count` rows from `first_seq`, whose body is garbage.
pub(crate) fn junk_data(first_seq: u64, count: u64) -> OutFrame {
    let header = wire::FrameHeader {
        kind: wire::FrameKind::Data,
        channel: 0,
        first_seq,
        count,
        body_len: 16,
    };
    let mut bytes = header.to_bytes().to_vec();
    bytes.extend_from_slice(&[0xAB; 16]);
    OutFrame {
        item: Item::End { seq: 0 }, // unused by a TCP link
        digest: None,
        bytes: Some(bytes.into()),
    }
}

pub(crate) fn end_at(seq: u64) -> OutFrame {
    OutFrame {
        item: Item::End { seq },
        digest: None,
        bytes: None,
    }
}

pub(crate) fn wait_for(ib: &Inbox, what: &str, ok: impl Fn(&InboxStats) -> bool) -> InboxStats {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let st = ib.stats();
        if ok(&st) {
            return st;
        }
        assert!(Instant::now() < deadline, "{what}: {st:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// What one upstream replica sends: `total` rows `base + i` in emits of `emit_rows`, a
/// heartbeat of epoch `k` after row `k * hb_every`, then end.
#[derive(Clone, Copy)]
pub(crate) struct Plan {
    pub(crate) total: i64,
    pub(crate) emit_rows: i64,
    pub(crate) hb_every: i64,
    pub(crate) batch_rows: usize,
    /// Abort (crash) after this many rows instead of finishing.
    pub(crate) crash_after: Option<i64>,
}

pub(crate) fn base(partition: u32) -> i64 {
    i64::from(partition) * 1_000_000
}

pub(crate) fn upstream(
    addr: SocketAddr,
    partition: u32,
    replica: u32,
    plan: Plan,
) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let me = identity(partition, replica);
        let cfg = OutboxConfig {
            batch_rows: plan.batch_rows,
        };
        let mut ob = Outbox::new(Partitioner::Forward, vec![vec![link(addr, &me)]], cfg).unwrap();
        let b = base(partition);
        let mut i = 0;
        while i < plan.total {
            if plan.crash_after.is_some_and(|c| i >= c) {
                ob.abort();
                return;
            }
            let n = plan.emit_rows.min(plan.total - i);
            // Cut the emit at the next heartbeat position.
            let to_hb = plan.hb_every - i % plan.hb_every;
            let n = n.min(to_hb);
            if finished_on_twin(ob.emit(&rows(b + i..b + i + n))) {
                return;
            }
            i += n;
            if i % plan.hb_every == 0 {
                if finished_on_twin(ob.heartbeat((i / plan.hb_every) as u64)) {
                    return;
                }
                // Let the writers run, so a crash happens with data really in flight.
                std::thread::sleep(Duration::from_millis(3));
            }
        }
        if !finished_on_twin(ob.end()) {
            ob.close();
        }
    })
}

/// Whether a send failed because every downstream replica already closed, having
/// received the whole stream from this replica's twin (a replica behind its twin may
/// find that); any other failure fails the test.
pub(crate) fn finished_on_twin(sent: Result<()>) -> bool {
    match sent {
        Ok(()) => false,
        Err(Error::Closed(_)) => true,
        Err(e) => panic!("sending failed: {e}"),
    }
}

/// One element of a consumption, independent of batch boundaries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Ev {
    Row(usize, i64),
    Hb(usize, u64, bool),
    End,
}

pub(crate) fn flatten(d: Delivery<RecordBatch>, out: &mut Vec<Ev>) {
    match d {
        Delivery::Data {
            channel, payload, ..
        } => {
            let v = payload.column(0).as_primitive::<Int64Type>();
            out.extend(v.values().iter().map(|&x| Ev::Row(channel, x)));
        }
        Delivery::Heartbeat {
            channel,
            epoch,
            first,
        } => out.push(Ev::Hb(channel, epoch, first)),
        Delivery::End => out.push(Ev::End),
    }
}

/// Consume until End (or fail after `limit`), one event per row.
pub(crate) fn drain(inbox: &mut Inbox, limit: Duration) -> Vec<Ev> {
    let mut out = Vec::new();
    for d in drain_deliveries(inbox, limit) {
        flatten(d, &mut out);
    }
    out
}

/// Consume until End (or fail after `limit`), batches as delivered.
pub(crate) fn drain_deliveries(inbox: &mut Inbox, limit: Duration) -> Vec<Delivery<RecordBatch>> {
    let deadline = Instant::now() + limit;
    let mut out = Vec::new();
    while Instant::now() < deadline {
        match inbox.next(Duration::from_millis(200)).unwrap() {
            Some(Delivery::End) => {
                out.push(Delivery::End);
                return out;
            }
            Some(d) => out.push(d),
            None => {}
        }
    }
    panic!(
        "no End within {limit:?}; got {} deliveries; stats {:#?}",
        out.len(),
        inbox.stats()
    );
}

pub(crate) fn rows_of(events: &[Ev], channel: usize) -> Vec<i64> {
    events
        .iter()
        .filter_map(|e| match e {
            Ev::Row(c, v) if *c == channel => Some(*v),
            _ => None,
        })
        .collect()
}

/// Wait until every connection of `ib` has been read to its end.
pub(crate) fn wait_all_closed(ib: &Inbox, connections: usize) -> InboxStats {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let stats = ib.stats();
        let closed = stats.connections.iter().filter(|c| !c.open).count();
        if closed == connections {
            return stats;
        }
        assert!(
            Instant::now() < deadline,
            "connections stay open: {stats:#?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}
