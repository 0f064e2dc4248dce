//! Property tests of the consumption orders over real dedup channels.
//!
//! Setting (DESIGN §2 invariant 1): `n` logical input channels, each channel's content cut
//! into batches once, and every one of the `r` upstream replicas of the channel sending
//! those same batches (same seq ranges); one upstream replica may crash (its stream stops
//! at a random point). Arrivals reach a downstream replica in a random interleaving, and
//! the merge runs at random moments in between. Whatever happens, LiveRobin must deliver
//! exactly the sequence an independent per-element model of Algorithm 1 (with the cycle
//! fix) computes from the channels' batches — *batch boundaries included* — so two
//! downstream replicas hand their operators the same batches in the same order.

mod common;

use std::collections::VecDeque;
use std::sync::Arc;

use common::{channel_content, replica_stream, Elem, Rng};
use proptest::prelude::*;
use tandem_core::dedup::{channel, channel_from, DedupReceiver, DedupSender, Offer};
use tandem_core::item::Rows;
use tandem_core::liverobin::LiveRobin;
use tandem_core::merge::{Fcfs, Merge, MergeCut, Positional};
use tandem_core::sync::Doorbell;
use tandem_core::{Chunk, Delivery, Item};

/// One delivery, with its batch boundaries: a data delivery is `rows` rows of `channel`
/// starting at `first_seq`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ev {
    Data {
        channel: usize,
        first_seq: u64,
        rows: usize,
    },
    Heartbeat {
        channel: usize,
        epoch: u64,
        first: bool,
    },
    End,
}

/// Algorithm 1 straight from the paper, one element (a whole batch, a heartbeat or the end
/// marker) per turn, plus the documented changes: a channel leaves A on *every* heartbeat;
/// `gen` starts as "none"; an ended channel leaves for good and its end takes no turn.
/// `channels[c]` is channel `c`'s complete element list, ending with its End.
fn model(channels: &[Vec<Item<Rows>>]) -> Vec<Ev> {
    model_joining(channels, None)
}

/// [`model`], the channels from `first` on joining after heartbeat `k` (`joining =
/// Some((first, k))`): they take no turn before the first refill of A at which the
/// highest epoch seen is `k` or more — or at which every other channel has ended.
fn model_joining(channels: &[Vec<Item<Rows>>], joining: Option<(usize, u64)>) -> Vec<Ev> {
    let n = channels.len();
    let mut out = Vec::new();
    let mut pos = vec![0usize; n];
    let mut joined = joining.map_or(n, |(first, _)| first);
    let mut active: Vec<bool> = (0..n).map(|c| c < joined).collect();
    let mut ended = vec![false; n];
    let mut gen: Option<u64> = None;
    let mut next = 0usize;
    let leave = |active: &mut Vec<bool>,
                 ended: &Vec<bool>,
                 joined: &mut usize,
                 gen: Option<u64>,
                 c: usize| {
        active[c] = false;
        if active.iter().all(|a| !a) {
            if let Some((first, k)) = joining {
                if gen.is_some_and(|g| g >= k) || (0..first).all(|x| ended[x]) {
                    *joined = n;
                }
            }
            for x in 0..*joined {
                active[x] = !ended[x];
            }
        }
    };
    let advance = |active: &Vec<bool>, next: usize| -> usize {
        (1..=n)
            .map(|s| (next + s) % n)
            .find(|&c| active[c])
            .unwrap_or(next)
    };
    loop {
        if ended.iter().all(|e| *e) {
            out.push(Ev::End);
            return out;
        }
        let c = next;
        let item = channels[c]
            .get(pos[c])
            .unwrap_or_else(|| panic!("channel {c} has no End element"));
        pos[c] += 1;
        match *item {
            Item::Data { first_seq, payload } => {
                out.push(Ev::Data {
                    channel: c,
                    first_seq,
                    rows: payload.len,
                });
                next = advance(&active, next);
            }
            Item::Heartbeat { epoch, .. } => {
                let first = gen.is_none_or(|g| epoch > g);
                if first {
                    gen = Some(epoch);
                }
                out.push(Ev::Heartbeat {
                    channel: c,
                    epoch,
                    first,
                });
                leave(&mut active, &ended, &mut joined, gen, c);
                next = advance(&active, next);
            }
            Item::End { .. } => {
                ended[c] = true;
                leave(&mut active, &ended, &mut joined, gen, c);
                next = advance(&active, next);
            }
        }
    }
}

fn record(d: Delivery<Rows>, out: &mut Vec<Ev>) {
    out.push(match d {
        Delivery::Data {
            channel,
            first_seq,
            payload,
        } => {
            assert_eq!(
                payload.start, first_seq,
                "payload is not the slice it claims to be"
            );
            assert!(payload.rows() > 0, "empty data delivery");
            Ev::Data {
                channel,
                first_seq,
                rows: payload.rows(),
            }
        }
        Delivery::Heartbeat {
            channel,
            epoch,
            first,
        } => Ev::Heartbeat {
            channel,
            epoch,
            first,
        },
        Delivery::End => Ev::End,
    });
}

/// What every downstream replica of a task partition receives.
struct Workload {
    /// Per channel: the batches its upstream partition emits, cut once, ending with End.
    batches: Vec<Vec<Item<Rows>>>,
    /// Per channel, per upstream replica: what that replica sent — `batches`, or a prefix
    /// of it for the replica that crashed.
    streams: Vec<Vec<Vec<Item<Rows>>>>,
}

fn workload(seed: u64, channels: usize, replicas: usize, crash: bool) -> Workload {
    let mut rng = Rng::new(seed);
    let batches: Vec<Vec<Item<Rows>>> = (0..channels)
        .map(|_| {
            let content = channel_content(&mut rng, 4, 12);
            replica_stream(&mut rng, &content, 5)
        })
        .collect();
    let mut streams: Vec<Vec<_>> = batches.iter().map(|b| vec![b.clone(); replicas]).collect();
    if crash && replicas > 1 {
        let ch = rng.below(channels);
        let victim = rng.below(replicas);
        let keep = rng.below(streams[ch][victim].len() + 1);
        streams[ch][victim].truncate(keep);
    }
    Workload { batches, streams }
}

/// Deliver the workload's arrivals to one downstream replica in an interleaving drawn from
/// `seed`, running `merge` at random moments; returns what it delivered, up to End.
fn consume(w: &Workload, merge: &mut dyn Merge<Rows>, seed: u64, capacity: usize) -> Vec<Ev> {
    consume_joining(w, merge, seed, capacity, None)
}

/// [`consume`], the merge told `join = Some((count, k, at))` — `count` channels (the
/// workload's last) join after heartbeat `k` — just before its delivery number `at`.
fn consume_joining(
    w: &Workload,
    merge: &mut dyn Merge<Rows>,
    seed: u64,
    capacity: usize,
    mut join: Option<(usize, u64, usize)>,
) -> Vec<Ev> {
    let all = w.streams.len();
    consume_with(w, merge, seed, capacity, all, |delivered, merge, _| {
        if let Some((count, k, at)) = join {
            if delivered == at {
                merge.join(count, k).expect("joined before heartbeat k");
                join = None;
            }
        }
    })
}

/// [`consume`] with `count` channels joined after heartbeat `k` once `at.0` deliveries
/// were made and taken back ([`Merge::cancel_join`]) once `at.1` were: a live rescale
/// given up before its switch. The joined channels never carry anything.
fn consume_join_cancelled(
    w: &Workload,
    merge: &mut dyn Merge<Rows>,
    seed: u64,
    capacity: usize,
    (count, k): (usize, u64),
    at: (usize, usize),
) -> Vec<Ev> {
    let old = w.streams.len();
    let (mut joined, mut cancelled) = (false, false);
    consume_with(
        w,
        merge,
        seed,
        capacity,
        old,
        |delivered, merge, receivers| {
            if !joined && delivered >= at.0 {
                merge.join(count, k).expect("joined before heartbeat k");
                receivers.grow(count);
                joined = true;
            }
            if joined && !cancelled && delivered >= at.1 {
                merge
                    .cancel_join(count)
                    .expect("taken back before they took a turn");
                receivers.shrink(old);
                cancelled = true;
            }
        },
    )
}

/// The dedup receivers a consumer's merge reads, and how to make more (joined channels).
struct Receivers {
    list: Vec<DedupReceiver<Rows>>,
    capacity: usize,
    bell: Arc<Doorbell>,
}

impl Receivers {
    fn grow(&mut self, count: usize) {
        let (capacity, bell) = (self.capacity, &self.bell);
        self.list
            .extend((0..count).map(|_| channel(capacity, Arc::clone(bell)).1));
    }

    fn shrink(&mut self, len: usize) {
        self.list.truncate(len);
    }
}

/// Offer every replica stream of `w` in a random interleaving (`seed`) to dedup channels
/// of `capacity` — `channels` of them at first — and consume with `merge` until the end,
/// one event per delivery; `before(deliveries so far, merge, receivers)` runs before each
/// look at the merge.
fn consume_with(
    w: &Workload,
    merge: &mut dyn Merge<Rows>,
    seed: u64,
    capacity: usize,
    channels: usize,
    mut before: impl FnMut(usize, &mut dyn Merge<Rows>, &mut Receivers),
) -> Vec<Ev> {
    let mut rng = Rng::new(seed);
    let bell = Arc::new(Doorbell::new());
    let (senders, list): (Vec<DedupSender<Rows>>, Vec<DedupReceiver<Rows>>) = (0..channels)
        .map(|_| channel(capacity, Arc::clone(&bell)))
        .unzip();
    let mut receivers = Receivers {
        list,
        capacity,
        bell,
    };
    let mut pending: Vec<(usize, VecDeque<Item<Rows>>)> = w
        .streams
        .iter()
        .enumerate()
        .flat_map(|(c, reps)| reps.iter().map(move |s| (c, s.iter().cloned().collect())))
        .collect();
    let mut out = Vec::new();
    for _ in 0..1_000_000 {
        let live: Vec<usize> = (0..pending.len())
            .filter(|&i| !pending[i].1.is_empty())
            .collect();
        if live.is_empty() || rng.chance(30) {
            before(out.len(), &mut *merge, &mut receivers);
            if let Some(d) = merge.next(&mut receivers.list) {
                let end = d == Delivery::End;
                record(d, &mut out);
                if end {
                    return out;
                }
            } else if live.is_empty() {
                panic!("merge stalled with every arrival delivered; consumed so far: {out:?}");
            }
            continue;
        }
        let (c, queue) = &mut pending[live[rng.below(live.len())]];
        let item = queue.pop_front().expect("live stream");
        match senders[*c].offer(item) {
            Offer::Accepted { .. } | Offer::Duplicate => {}
            Offer::Full(back) => queue.push_front(back),
            Offer::Gap { .. } => panic!("a FIFO replica stream can never open a gap"),
        }
    }
    panic!("no End after a million steps; consumed so far: {out:?}");
}

/// Where a consumer stood at a cut: its merge's state, each channel's position, and how
/// many deliveries came before.
struct Cut {
    merge: MergeCut,
    positions: Vec<u64>,
    delivered: usize,
}

/// [`consume`] with dedup channels starting at `start` (a replica resumed from a cut:
/// everything before is dropped as already consumed), taking a cut the way a worker does:
/// right after the delivery that makes every channel's heartbeat epoch reach `cut_at`.
fn consume_from(
    w: &Workload,
    merge: &mut dyn Merge<Rows>,
    seed: u64,
    start: &[u64],
    cut_at: Option<u64>,
) -> (Vec<Ev>, Option<Cut>) {
    let mut rng = Rng::new(seed);
    let bell = Arc::new(Doorbell::new());
    let (senders, mut receivers): (Vec<DedupSender<Rows>>, Vec<DedupReceiver<Rows>>) = start
        .iter()
        .map(|&s| channel_from(s, 3, Arc::clone(&bell)))
        .unzip();
    let mut pending: Vec<(usize, VecDeque<Item<Rows>>)> = w
        .streams
        .iter()
        .enumerate()
        .flat_map(|(c, reps)| reps.iter().map(move |s| (c, s.iter().cloned().collect())))
        .collect();
    let mut epochs = vec![0u64; start.len()];
    let (mut out, mut cut) = (Vec::new(), None);
    loop {
        let live: Vec<usize> = (0..pending.len())
            .filter(|&i| !pending[i].1.is_empty())
            .collect();
        if live.is_empty() || rng.chance(30) {
            match merge.next(&mut receivers) {
                Some(d) => {
                    if let Delivery::Heartbeat { channel, epoch, .. } = d {
                        epochs[channel] = epochs[channel].max(epoch);
                    }
                    let end = d == Delivery::End;
                    record(d, &mut out);
                    if end {
                        return (out, cut);
                    }
                    let low = epochs.iter().copied().min().unwrap_or(0);
                    if cut.is_none() && cut_at == Some(low) {
                        cut = Some(Cut {
                            merge: merge.cut().expect("a cycle boundary can be cut"),
                            positions: receivers.iter().map(DedupReceiver::next_seq).collect(),
                            delivered: out.len(),
                        });
                    }
                }
                None if live.is_empty() => panic!("merge stalled; consumed so far: {out:?}"),
                None => {}
            }
            continue;
        }
        let (c, queue) = &mut pending[live[rng.below(live.len())]];
        let item = queue.pop_front().expect("live stream");
        match senders[*c].offer(item) {
            Offer::Accepted { .. } | Offer::Duplicate => {}
            Offer::Full(back) | Offer::Gap { item: back, .. } => queue.push_front(back),
        }
    }
}

/// Restoring r: `twin` consumes every stream from the start (arrivals `seeds.0`) and is
/// cut once every channel delivered heartbeat `cut_at`; `resumed` resumes from the cut and
/// is fed every stream again from the start (`seeds.1`: its dedup drops what lies before
/// the cut). Returns the twin's deliveries with how many came before the cut, and the
/// resumed merge's.
fn twin_and_resumed(
    w: &Workload,
    twin: &mut dyn Merge<Rows>,
    resumed: &mut dyn Merge<Rows>,
    cut_at: u64,
    seeds: (u64, u64),
) -> ((Vec<Ev>, usize), Vec<Ev>) {
    let zero = vec![0; w.streams.len()];
    let (out, cut) = consume_from(w, twin, seeds.0, &zero, Some(cut_at));
    let cut = cut.expect("every channel delivers heartbeats 1..=4");
    resumed.resume(&cut.merge, &cut.positions).unwrap();
    let (rest, _) = consume_from(w, resumed, seeds.1, &cut.positions, None);
    ((out, cut.delivered), rest)
}

/// The orders a KaZoo leader would publish for a consumption sequence: one "channel c up to
/// seq s" entry per run of consecutive data deliveries from the same channel, each bound at
/// the end of a batch.
fn orders_of(seq: &[Ev]) -> Vec<(usize, u64)> {
    let mut orders: Vec<(usize, u64)> = Vec::new();
    for ev in seq {
        let (c, s) = match *ev {
            Ev::Data {
                channel,
                first_seq,
                rows,
            } => (channel, first_seq + rows as u64),
            Ev::Heartbeat { .. } | Ev::End => continue,
        };
        match orders.last_mut() {
            Some((lc, ls)) if *lc == c => *ls = s,
            _ => orders.push((c, s)),
        }
    }
    orders
}

/// A channel joining after heartbeat `k`: rows and heartbeats `k + 1 ..= cycles`, as
/// [`channel_content`] for the epochs after `k`.
fn joined_content(rng: &mut Rng, k: u64, cycles: u64, max_rows: usize) -> Vec<Elem> {
    let mut out = Vec::new();
    for epoch in k + 1..=cycles {
        for _ in 0..rng.below(max_rows + 1) {
            out.push(Elem::Row);
        }
        out.push(Elem::Heartbeat(epoch));
    }
    for _ in 0..rng.below(max_rows + 1) {
        out.push(Elem::Row);
    }
    out
}

/// Proptest cases per property: more in release, where they are cheap.
const CASES: u32 = if cfg!(debug_assertions) { 200 } else { 2000 };

/// Feed a Positional follower the workload's arrivals in a random interleaving, taking
/// deliveries at random moments, until every arrival is in and it has nothing more to do.
fn follow(w: &Workload, follower: &mut Positional<Rows>, arrival: u64) -> Vec<Ev> {
    let mut got = Vec::new();
    let mut rng = Rng::new(arrival);
    let bell = Arc::new(Doorbell::new());
    let (tx, mut rx): (Vec<DedupSender<Rows>>, Vec<DedupReceiver<Rows>>) = (0..w.streams.len())
        .map(|_| channel(64, Arc::clone(&bell)))
        .unzip();
    let mut pending: Vec<(usize, VecDeque<Item<Rows>>)> = w
        .streams
        .iter()
        .enumerate()
        .flat_map(|(c, reps)| reps.iter().map(move |s| (c, s.iter().cloned().collect())))
        .collect();
    loop {
        let live: Vec<usize> = (0..pending.len())
            .filter(|&i| !pending[i].1.is_empty())
            .collect();
        if live.is_empty() || rng.chance(40) {
            match follower.next(&mut rx) {
                Some(d) => record(d, &mut got),
                None if live.is_empty() => return got,
                None => {}
            }
            continue;
        }
        let (c, q) = &mut pending[live[rng.below(live.len())]];
        let item = q.pop_front().expect("live stream");
        if let Offer::Full(back) = tx[*c].offer(item) {
            q.push_front(back)
        }
    }
}

fn data_only(seq: &[Ev]) -> Vec<Ev> {
    seq.iter()
        .filter(|e| matches!(e, Ev::Data { .. }))
        .copied()
        .collect()
}

/// The deliveries of channel `c` in a consumed sequence, heartbeats without their `first`
/// flag.
fn channel_events(seq: &[Ev], c: usize) -> Vec<Ev> {
    seq.iter()
        .filter_map(|e| match *e {
            Ev::Data { channel, .. } if channel == c => Some(*e),
            Ev::Heartbeat { channel, epoch, .. } if channel == c => Some(Ev::Heartbeat {
                channel,
                epoch,
                first: false,
            }),
            _ => None,
        })
        .collect()
}

/// A channel's batches, as [`channel_events`] presents them (the End is not a delivery of
/// its own).
fn channel_events_of_batches(batches: &[Item<Rows>], c: usize) -> Vec<Ev> {
    batches
        .iter()
        .filter_map(|item| match *item {
            Item::Data { first_seq, payload } => Some(Ev::Data {
                channel: c,
                first_seq,
                rows: payload.len,
            }),
            Item::Heartbeat { epoch, .. } => Some(Ev::Heartbeat {
                channel: c,
                epoch,
                first: false,
            }),
            Item::End { .. } => None,
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    /// A live rescale's new upstream partitions: channels that join after heartbeat `k`
    /// (their content starts after it), told at any moment before the merge sees `k`,
    /// take their first turn in the cycle after `k` — the same batches in the same order
    /// whenever each replica was told.
    #[test]
    fn liverobin_joined_after_heartbeat_k_delivers_the_model_whenever_told(
        seed in any::<u64>(),
        channels in 1usize..=3,
        joining in 1usize..=2,
        k in 1u64..=4,
        capacity in 1usize..=6,
        arrival_a in any::<u64>(),
        arrival_b in any::<u64>(),
        told_a in any::<u64>(),
        told_b in any::<u64>(),
    ) {
        let mut w = workload(seed, channels, 2, false);
        let mut rng = Rng::new(seed ^ 0x5EED);
        for _ in 0..joining {
            let content = joined_content(&mut rng, k, 4, 8);
            let batches = replica_stream(&mut rng, &content, 5);
            w.streams.push(vec![batches.clone(); 2]);
            w.batches.push(batches);
        }
        let reference = model_joining(&w.batches, Some((channels, k)));
        // Told before the first delivery of a heartbeat k or later (the same in the model:
        // the joined channels take no turn before).
        let before = reference
            .iter()
            .position(|e| matches!(e, Ev::Heartbeat { epoch, .. } if *epoch >= k))
            .unwrap_or(reference.len() - 1);
        let told = |t: u64| Some((joining, k, (t % (before as u64 + 1)) as usize));
        let a = consume_joining(&w, &mut LiveRobin::new(channels), arrival_a, capacity, told(told_a));
        prop_assert_eq!(&a, &reference);
        let b = consume_joining(&w, &mut LiveRobin::new(channels), arrival_b, capacity, told(told_b));
        prop_assert_eq!(&a, &b, "replicas told at different moments delivered different batches");
    }

    /// A live rescale given up before its switch: a join taken back at any moment before
    /// the joined channels could take a turn leaves the merge delivering exactly what it
    /// would have with no join (LiveRobin, and first come, first served as a multiset).
    #[test]
    fn a_join_taken_back_delivers_what_no_join_delivers(
        seed in any::<u64>(),
        channels in 1usize..=3,
        joining in 1usize..=2,
        k in 2u64..=4,
        capacity in 1usize..=6,
        arrival in any::<u64>(),
        told in any::<u64>(),
        taken in any::<u64>(),
    ) {
        let w = workload(seed, channels, 2, false);
        let reference = model(&w.batches);
        // Both before the first delivery of a heartbeat k - 1 or later: the cycle of k has
        // not started, so the joined channels cannot have been activated.
        let before = reference
            .iter()
            .position(|e| matches!(e, Ev::Heartbeat { epoch, .. } if *epoch + 1 >= k))
            .unwrap_or(reference.len() - 1) as u64;
        let a = told % (before + 1);
        let b = a + taken % (before + 1 - a);
        let at = (a as usize, b as usize);
        let got = consume_join_cancelled(
            &w, &mut LiveRobin::new(channels), arrival, capacity, (joining, k), at,
        );
        prop_assert_eq!(&got, &reference);
        let mut fcfs = consume_join_cancelled(
            &w, &mut Fcfs::new(channels), arrival, capacity, (joining, k), at,
        );
        let mut plain = consume(&w, &mut Fcfs::new(channels), arrival, capacity);
        // Which copy of a heartbeat comes first depends on the order served, not on what.
        let content = |evs: &mut Vec<Ev>| {
            for e in evs.iter_mut() {
                if let Ev::Heartbeat { first, .. } = e {
                    *first = false;
                }
            }
            evs.sort_by_key(|e| format!("{e:?}"));
        };
        content(&mut fcfs);
        content(&mut plain);
        prop_assert_eq!(fcfs, plain);
    }

    #[test]
    fn liverobin_delivers_the_reference_batches_under_any_interleaving(
        seed in any::<u64>(),
        channels in 1usize..=3,
        replicas in 1usize..=3,
        crash in any::<bool>(),
        capacity in 1usize..=6,
        arrival_a in any::<u64>(),
        arrival_b in any::<u64>(),
    ) {
        let w = workload(seed, channels, replicas, crash);
        let reference = model(&w.batches);
        let a = consume(&w, &mut LiveRobin::new(channels), arrival_a, capacity);
        prop_assert_eq!(&a, &reference);
        let b = consume(&w, &mut LiveRobin::new(channels), arrival_b, capacity);
        prop_assert_eq!(&a, &b, "two downstream replicas delivered different batch sequences");
    }

    /// Restoring r (DESIGN §4): a replica rebuilt from a twin's cut at the end of any
    /// heartbeat cycle, fed every stream again from the start (its dedup drops what lies
    /// before the cut), delivers exactly what the twin delivers after the cut.
    #[test]
    fn liverobin_resumed_from_a_cut_continues_exactly_as_its_twin(
        seed in any::<u64>(),
        channels in 1usize..=3,
        replicas in 1usize..=3,
        cut_at in 1u64..=4,
        arrival_a in any::<u64>(),
        arrival_b in any::<u64>(),
    ) {
        let w = workload(seed, channels, replicas, false);
        let (twin, rest) = twin_and_resumed(
            &w,
            &mut LiveRobin::new(channels),
            &mut LiveRobin::new(channels),
            cut_at,
            (arrival_a, arrival_b),
        );
        prop_assert_eq!(&twin.0, &model(&w.batches));
        prop_assert_eq!(&rest[..], &twin.0[twin.1..]);
    }

    /// KaZoo: a positional replica rebuilt from a twin's cut — the orders the twin had
    /// followed but not consumed travel in it, none is pushed again — fed every stream
    /// again from the start, delivers exactly what the twin delivers after the cut.
    #[test]
    fn positional_resumed_from_a_cut_continues_exactly_as_its_twin(
        seed in any::<u64>(),
        channels in 1usize..=3,
        replicas in 1usize..=3,
        cut_at in 1u64..=4,
        arrival_a in any::<u64>(),
        arrival_b in any::<u64>(),
    ) {
        let w = workload(seed, channels, replicas, false);
        // The leader's orders, then one per channel reaching past its end marker.
        let mut orders = orders_of(&model(&w.batches));
        orders.extend((0..channels).map(|c| (c, u64::MAX)));
        let mut followed = Positional::new(channels);
        for &(c, s) in &orders {
            followed.push_order(c, s).unwrap();
        }
        let (twin, rest) = twin_and_resumed(
            &w,
            &mut followed,
            &mut Positional::new(channels),
            cut_at,
            (arrival_a, arrival_b),
        );
        prop_assert_eq!(&rest[..], &twin.0[twin.1..]);
    }

    #[test]
    fn positional_follows_the_leaders_order_under_any_interleaving(
        seed in any::<u64>(),
        channels in 1usize..=3,
        replicas in 1usize..=3,
        crash in any::<bool>(),
        arrival in any::<u64>(),
    ) {
        let w = workload(seed, channels, replicas, crash);
        // The leader's decided order: here, LiveRobin's. Its bounds fall on batch
        // boundaries, so the follower delivers the leader's very batches (heartbeats ride
        // along wherever the next order on their channel takes them).
        let leader = model(&w.batches);
        let mut follower = Positional::new(channels);
        for (c, s) in orders_of(&leader) {
            follower.push_order(c, s).unwrap();
        }
        // Replaying the log is harmless.
        for (c, s) in orders_of(&leader) {
            follower.push_order(c, s).unwrap();
        }
        let got = follow(&w, &mut follower, arrival);
        prop_assert_eq!(data_only(&got), data_only(&leader));
    }

    #[test]
    fn fcfs_with_joined_channels_loses_nothing(
        seed in any::<u64>(),
        channels in 1usize..=3,
        joining in 1usize..=2,
        k in 1u64..=4,
        arrival in any::<u64>(),
        told in 0usize..=1,
    ) {
        let mut w = workload(seed, channels, 2, false);
        let mut rng = Rng::new(seed ^ 0x5EED);
        for _ in 0..joining {
            let content = joined_content(&mut rng, k, 4, 8);
            let batches = replica_stream(&mut rng, &content, 5);
            w.streams.push(vec![batches.clone(); 2]);
            w.batches.push(batches);
        }
        // Told before its first or second delivery: the order is the arrivals', not a rule.
        let got = consume_joining(&w, &mut Fcfs::new(channels), arrival, 4, Some((joining, k, told)));
        for c in 0..channels + joining {
            prop_assert_eq!(
                channel_events(&got, c),
                channel_events_of_batches(&w.batches[c], c)
            );
        }
        prop_assert_eq!(got.last(), Some(&Ev::End));
    }

    #[test]
    fn fcfs_loses_nothing_and_keeps_each_channels_batches(
        seed in any::<u64>(),
        channels in 1usize..=3,
        replicas in 1usize..=3,
        crash in any::<bool>(),
        arrival in any::<u64>(),
    ) {
        let w = workload(seed, channels, replicas, crash);
        let got = consume(&w, &mut Fcfs::new(channels), arrival, 4);
        for c in 0..channels {
            prop_assert_eq!(
                channel_events(&got, c),
                channel_events_of_batches(&w.batches[c], c)
            );
        }
        prop_assert_eq!(got.last(), Some(&Ev::End));
    }
}

/// `none` is not deterministic: the same channel contents, two arrival interleavings, two
/// different consumption orders. (The reason the baseline is incorrect for multi-input
/// tasks, and what LiveRobin fixes.)
#[test]
fn fcfs_order_depends_on_arrival_timing() {
    let a = |s| Item::Data {
        first_seq: s,
        payload: Rows { start: s, len: 1 },
    };
    let run = |first_channel: usize| {
        let bell = Arc::new(Doorbell::new());
        let (tx, mut rx): (Vec<DedupSender<Rows>>, Vec<DedupReceiver<Rows>>) =
            (0..2).map(|_| channel(8, Arc::clone(&bell))).unzip();
        let mut fcfs = Fcfs::new(2);
        let mut out = Vec::new();
        // Replica X sees channel `first_channel`'s row arrive first, replica Y the other.
        tx[first_channel].offer(a(0));
        record(Merge::<Rows>::next(&mut fcfs, &mut rx).unwrap(), &mut out);
        tx[1 - first_channel].offer(a(0));
        record(Merge::<Rows>::next(&mut fcfs, &mut rx).unwrap(), &mut out);
        out
    };
    let x = run(0);
    let y = run(1);
    assert_ne!(x, y, "fcfs happened to agree: {x:?}");

    // LiveRobin on the same two interleavings agrees.
    let run_lr = |first_channel: usize| {
        let bell = Arc::new(Doorbell::new());
        let (tx, mut rx): (Vec<DedupSender<Rows>>, Vec<DedupReceiver<Rows>>) =
            (0..2).map(|_| channel(8, Arc::clone(&bell))).unzip();
        let mut lr = LiveRobin::new(2);
        let mut out = Vec::new();
        tx[first_channel].offer(a(0));
        while let Some(d) = lr.next(&mut rx) {
            record(d, &mut out);
        }
        tx[1 - first_channel].offer(a(0));
        while let Some(d) = lr.next(&mut rx) {
            record(d, &mut out);
        }
        out
    };
    assert_eq!(run_lr(0), run_lr(1));
}

/// The same on the property workloads: two downstream replicas running `none` over the
/// same batches deliver different sequences for some arrival interleavings, where
/// LiveRobin never does (the first property).
#[test]
fn fcfs_diverges_on_the_property_workloads() {
    let diverged = (0..200u64).find(|&seed| {
        let w = workload(seed, 2, 2, seed % 2 == 0);
        let a = consume(&w, &mut Fcfs::new(2), seed.wrapping_mul(3), 4);
        let b = consume(&w, &mut Fcfs::new(2), seed.wrapping_mul(7) + 1, 4);
        a != b
    });
    assert!(
        diverged.is_some(),
        "fcfs agreed on 200 workloads: the workloads no longer exercise ordering"
    );
}

#[test]
fn the_model_reproduces_the_paper_on_a_hand_example() {
    let data = |first_seq, len| Item::Data {
        first_seq,
        payload: Rows {
            start: first_seq,
            len,
        },
    };
    let hb = |seq, epoch| Item::Heartbeat { seq, epoch };
    let d = |channel, first_seq, rows| Ev::Data {
        channel,
        first_seq,
        rows,
    };
    let h = |channel, epoch, first| Ev::Heartbeat {
        channel,
        epoch,
        first,
    };
    // One row per batch: the paper's per-event algorithm exactly.
    let single_rows = vec![
        vec![
            data(0, 1),
            data(1, 1),
            hb(2, 1),
            data(3, 1),
            Item::End { seq: 4 },
        ],
        vec![data(0, 1), hb(1, 1), data(2, 1), Item::End { seq: 3 }],
    ];
    assert_eq!(
        model(&single_rows),
        vec![
            d(0, 0, 1),
            d(1, 0, 1),
            d(0, 1, 1),
            h(1, 1, true),
            h(0, 1, false),
            d(1, 2, 1),
            d(0, 3, 1),
            Ev::End,
        ]
    );
    // The same content with channel 0's first two rows in one batch: one turn for both.
    let batched = vec![
        vec![data(0, 2), hb(2, 1), data(3, 1), Item::End { seq: 4 }],
        vec![data(0, 1), hb(1, 1), data(2, 1), Item::End { seq: 3 }],
    ];
    assert_eq!(
        model(&batched),
        vec![
            d(0, 0, 2),
            d(1, 0, 1),
            h(0, 1, true),
            h(1, 1, false),
            d(0, 3, 1),
            d(1, 2, 1),
            Ev::End,
        ]
    );
}

/// End to end with real threads: one I/O thread per (channel, upstream replica) offering
/// into the dedup channels, one task thread running LiveRobin and sleeping on the consumer
/// bell when it must wait. The delivered sequence, batches included, is still exactly the
/// model's.
#[test]
fn liverobin_over_threaded_dedup_matches_the_model() {
    use std::thread;
    use std::time::Duration;

    let iterations = if cfg!(debug_assertions) { 40 } else { 300 };
    for i in 0..iterations {
        let seed = 0x7A5C_0000 + i;
        let channels = 1 + (i as usize % 3);
        let replicas = 1 + (i as usize / 3 % 3);
        let w = workload(seed, channels, replicas, i % 2 == 0);
        let expected = model(&w.batches);

        let bell = Arc::new(Doorbell::new());
        let (senders, mut receivers): (Vec<DedupSender<Rows>>, Vec<DedupReceiver<Rows>>) =
            (0..channels).map(|_| channel(3, Arc::clone(&bell))).unzip();
        let producers: Vec<_> = w
            .streams
            .iter()
            .enumerate()
            .flat_map(|(c, reps)| reps.iter().map(move |s| (c, s.clone())))
            .map(|(c, stream)| {
                let tx = senders[c].clone();
                thread::spawn(move || {
                    for mut item in stream {
                        loop {
                            let seen = tx.producer_bell().generation();
                            match tx.offer(item) {
                                Offer::Accepted { .. } | Offer::Duplicate => break,
                                Offer::Full(back) | Offer::Gap { item: back, .. } => {
                                    item = back;
                                    tx.producer_bell().wait(seen, Duration::from_millis(20));
                                }
                            }
                        }
                    }
                })
            })
            .collect();

        let mut merge = LiveRobin::new(channels);
        let mut got = Vec::new();
        loop {
            let seen = bell.generation();
            match merge.next(&mut receivers) {
                Some(Delivery::End) => {
                    got.push(Ev::End);
                    break;
                }
                Some(d) => record(d, &mut got),
                None => {
                    assert!(
                        bell.wait(seen, Duration::from_secs(10)),
                        "seed {seed}: stalled waiting on {:?}",
                        merge.waiting_on()
                    );
                }
            }
        }
        for p in producers {
            p.join().expect("producer panicked");
        }
        assert_eq!(got, expected, "seed {seed}");
    }
}
