//! Cuts as Python values: a replica's state at a heartbeat-cycle boundary
//! ([`tandem_core::worker::SlotCut`]) travels from a live replica through the engine to
//! the replica rebuilt from it, so it is a plain, picklable tuple:
//!
//! `(epoch, epochs, inbox, outboxes)` where `epochs` lists the heartbeat epoch each input
//! channel delivered, `inbox` is `None` (a source) or `(positions, turn, gen, ended,
//! orders, log)` — `orders` the followed KaZoo orders `(channel, up_to_seq)` not consumed
//! yet, `log` None or the order log's `(epoch, version, ordered, through)` — and `outboxes`
//! lists `(seqs, rows_emitted)` per output edge. The runtime reads only `through` (where a
//! rebuilt KaZoo replica's reader may start).

use tandem_core::inbox::InboxCut;
use tandem_core::merge::MergeCut;
use tandem_core::orderlog::OrderLogCut;
use tandem_core::outbox::OutboxCut;
use tandem_core::worker::SlotCut;

/// An order log's cut: `(epoch, version, ordered, through)`.
pub(crate) type PyLogCut = (Option<u64>, u64, Vec<u64>, u64);
/// An inbox's cut: `(positions, turn, gen, ended, orders, log)`.
pub(crate) type PyInboxCut = (
    Vec<u64>,
    usize,
    Option<u64>,
    Vec<bool>,
    Vec<(usize, u64)>,
    Option<PyLogCut>,
);
/// A slot's cut (see the module documentation).
pub(crate) type PySlotCut = (u64, Vec<u64>, Option<PyInboxCut>, Vec<(Vec<u64>, u64)>);

pub(crate) fn inbox_from_py(c: PyInboxCut) -> InboxCut {
    let (positions, turn, gen, ended, orders, log) = c;
    InboxCut {
        positions,
        merge: MergeCut {
            turn,
            gen,
            ended,
            orders,
        },
        log: log.map(|(epoch, version, ordered, through)| OrderLogCut {
            epoch,
            version,
            ordered,
            through,
        }),
    }
}

fn inbox_to_py(c: InboxCut) -> PyInboxCut {
    (
        c.positions,
        c.merge.turn,
        c.merge.gen,
        c.merge.ended,
        c.merge.orders,
        c.log.map(|l| (l.epoch, l.version, l.ordered, l.through)),
    )
}

pub(crate) fn slot_from_py(c: PySlotCut) -> SlotCut {
    let (epoch, epochs, inbox, outboxes) = c;
    SlotCut {
        epoch,
        epochs,
        inbox: inbox.map(inbox_from_py),
        outboxes: outboxes
            .into_iter()
            .map(|(seqs, rows_emitted)| OutboxCut { seqs, rows_emitted })
            .collect(),
    }
}

pub(crate) fn slot_to_py(c: SlotCut) -> PySlotCut {
    (
        c.epoch,
        c.epochs,
        c.inbox.map(inbox_to_py),
        c.outboxes
            .into_iter()
            .map(|o| (o.seqs, o.rows_emitted))
            .collect(),
    )
}
