//! Cuts as Python values: a replica's state at a heartbeat-cycle boundary
//! ([`tandem_core::worker::SlotCut`]) travels from a live replica through the engine to
//! the replica rebuilt from it, so it is a plain, picklable tuple:
//!
//! `(epoch, epochs, inbox, outboxes)` where `epochs` lists the heartbeat epoch each input
//! channel delivered, `inbox` is `None` (a source) or `(positions, turn, gen, ended)`, and
//! `outboxes` lists `(seqs, rows_emitted)` per output edge. The runtime never looks inside.

use tandem_core::merge::MergeCut;
use tandem_core::outbox::OutboxCut;
use tandem_core::transport::InboxCut;
use tandem_core::worker::SlotCut;

/// An inbox's cut: `(positions, turn, gen, ended)`.
pub(crate) type PyInboxCut = (Vec<u64>, usize, Option<u64>, Vec<bool>);
/// A slot's cut (see the module documentation).
pub(crate) type PySlotCut = (u64, Vec<u64>, Option<PyInboxCut>, Vec<(Vec<u64>, u64)>);

pub(crate) fn inbox_from_py(c: PyInboxCut) -> InboxCut {
    let (positions, turn, gen, ended) = c;
    InboxCut {
        positions,
        merge: MergeCut { turn, gen, ended },
    }
}

fn inbox_to_py(c: InboxCut) -> PyInboxCut {
    (c.positions, c.merge.turn, c.merge.gen, c.merge.ended)
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
