//! Property tests of the consumption orders over real dedup channels.
//!
//! Setting: `n` logical input channels, each sent by `r` upstream replicas that cut the
//! same content at their own random batch boundaries; one upstream replica may crash (its
//! stream stops at a random point). Arrivals reach a downstream replica in a random
//! interleaving, and the merge runs at random moments in between. Whatever happens,
//! LiveRobin must consume exactly the sequence an independent per-event model of
//! Algorithm 1 (with the cycle fix and the quantum generalisation) computes from the
//! channels' contents alone — so two downstream replicas agree.

mod common;

use std::collections::VecDeque;
use std::sync::Arc;

use common::{channel_content, replica_stream, Elem, Rng};
use proptest::prelude::*;
use tandem_core::dedup::{channel, DedupReceiver, DedupSender, Offer};
use tandem_core::item::Rows;
use tandem_core::liverobin::LiveRobin;
use tandem_core::merge::{Fcfs, Merge, Positional};
use tandem_core::sync::Doorbell;
use tandem_core::{Chunk, Delivery, Item};

/// One consumed element, independent of batch boundaries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ev {
    Row {
        channel: usize,
        seq: u64,
    },
    Heartbeat {
        channel: usize,
        epoch: u64,
        first: bool,
    },
    End,
}

/// Algorithm 1, per event, straight from the paper plus the documented changes: a channel
/// leaves A on *every* heartbeat; `gen` starts as "none"; a turn is up to `quantum` rows or
/// ends with the heartbeat/end that stops it; ended channels leave for good.
fn model(contents: &[Vec<Elem>], quantum: usize) -> Vec<Ev> {
    let n = contents.len();
    let mut out = Vec::new();
    let mut pos = vec![0usize; n];
    let mut active = vec![true; n];
    let mut ended = vec![false; n];
    let mut gen: Option<u64> = None;
    let mut next = 0usize;
    let mut taken = 0usize;
    let leave = |active: &mut Vec<bool>, ended: &Vec<bool>, c: usize| {
        active[c] = false;
        if active.iter().all(|a| !a) {
            for k in 0..n {
                active[k] = !ended[k];
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
        match contents[c].get(pos[c]) {
            Some(Elem::Row) => {
                out.push(Ev::Row {
                    channel: c,
                    seq: pos[c] as u64,
                });
                pos[c] += 1;
                taken += 1;
                if taken == quantum {
                    taken = 0;
                    next = advance(&active, next);
                }
            }
            Some(Elem::Heartbeat(epoch)) => {
                let first = gen.is_none_or(|g| *epoch > g);
                if first {
                    gen = Some(*epoch);
                }
                out.push(Ev::Heartbeat {
                    channel: c,
                    epoch: *epoch,
                    first,
                });
                pos[c] += 1;
                leave(&mut active, &ended, c);
                taken = 0;
                next = advance(&active, next);
            }
            None => {
                ended[c] = true;
                leave(&mut active, &ended, c);
                taken = 0;
                next = advance(&active, next);
            }
        }
    }
}

fn flatten(d: Delivery<Rows>, out: &mut Vec<Ev>) {
    match d {
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
            for k in 0..payload.rows() as u64 {
                out.push(Ev::Row {
                    channel,
                    seq: first_seq + k,
                });
            }
        }
        Delivery::Heartbeat {
            channel,
            epoch,
            first,
        } => out.push(Ev::Heartbeat {
            channel,
            epoch,
            first,
        }),
        Delivery::End => out.push(Ev::End),
    }
}

/// What every downstream replica of a task partition receives: per channel, the streams of
/// the r upstream replicas (one possibly cut short by a crash).
struct Workload {
    contents: Vec<Vec<Elem>>,
    streams: Vec<Vec<Vec<Item<Rows>>>>,
}

fn workload(seed: u64, channels: usize, replicas: usize, crash: bool) -> Workload {
    let mut rng = Rng::new(seed);
    let contents: Vec<_> = (0..channels)
        .map(|_| channel_content(&mut rng, 4, 12))
        .collect();
    let mut streams: Vec<Vec<_>> = contents
        .iter()
        .map(|c| {
            (0..replicas)
                .map(|_| replica_stream(&mut rng, c, 5))
                .collect()
        })
        .collect();
    if crash && replicas > 1 {
        let ch = rng.below(channels);
        let victim = rng.below(replicas);
        let keep = rng.below(streams[ch][victim].len() + 1);
        streams[ch][victim].truncate(keep);
    }
    Workload { contents, streams }
}

/// Deliver the workload's arrivals to one downstream replica in an interleaving drawn from
/// `seed`, running `merge` at random moments; returns what it consumed, up to End.
fn consume(w: &Workload, merge: &mut dyn Merge<Rows>, seed: u64, capacity: usize) -> Vec<Ev> {
    let mut rng = Rng::new(seed);
    let bell = Arc::new(Doorbell::new());
    let (senders, mut receivers): (Vec<DedupSender<Rows>>, Vec<DedupReceiver<Rows>>) =
        (0..w.streams.len())
            .map(|_| channel(capacity, Arc::clone(&bell)))
            .unzip();
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
            if let Some(d) = merge.next(&mut receivers) {
                let end = d == Delivery::End;
                flatten(d, &mut out);
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

/// The orders a KaZoo leader would publish for a consumption sequence: one "channel c up to
/// seq s" entry per run of consecutive elements from the same channel.
fn orders_of(seq: &[Ev]) -> Vec<(usize, u64)> {
    let mut orders: Vec<(usize, u64)> = Vec::new();
    for ev in seq {
        let (c, s) = match *ev {
            Ev::Row { channel, seq } => (channel, seq + 1),
            Ev::Heartbeat { .. } | Ev::End => continue,
        };
        match orders.last_mut() {
            Some((lc, ls)) if *lc == c => *ls = s,
            _ => orders.push((c, s)),
        }
    }
    orders
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
                Some(d) => flatten(d, &mut got),
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

fn rows_only(seq: &[Ev]) -> Vec<Ev> {
    seq.iter()
        .filter(|e| matches!(e, Ev::Row { .. }))
        .copied()
        .collect()
}

/// The events of channel `c` in a consumed sequence, heartbeats without their `first` flag.
fn channel_events(seq: &[Ev], c: usize) -> Vec<Ev> {
    seq.iter()
        .filter_map(|e| match *e {
            Ev::Row { channel, .. } if channel == c => Some(*e),
            Ev::Heartbeat { channel, epoch, .. } if channel == c => Some(Ev::Heartbeat {
                channel,
                epoch,
                first: false,
            }),
            _ => None,
        })
        .collect()
}

/// The events of a channel's content, as [`channel_events`] presents them.
fn channel_events_of_content(content: &[Elem], c: usize) -> Vec<Ev> {
    content
        .iter()
        .enumerate()
        .map(|(i, e)| match e {
            Elem::Row => Ev::Row {
                channel: c,
                seq: i as u64,
            },
            Elem::Heartbeat(epoch) => Ev::Heartbeat {
                channel: c,
                epoch: *epoch,
                first: false,
            },
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    #[test]
    fn liverobin_consumes_the_reference_sequence_under_any_interleaving(
        seed in any::<u64>(),
        channels in 1usize..=3,
        replicas in 1usize..=3,
        crash in any::<bool>(),
        quantum in prop::sample::select(vec![1usize, 2, 3, 7, 1024]),
        capacity in 1usize..=6,
        arrival_a in any::<u64>(),
        arrival_b in any::<u64>(),
    ) {
        let w = workload(seed, channels, replicas, crash);
        let reference = model(&w.contents, quantum);
        let a = consume(&w, &mut LiveRobin::new(channels, quantum), arrival_a, capacity);
        prop_assert_eq!(&a, &reference);
        let b = consume(&w, &mut LiveRobin::new(channels, quantum), arrival_b, capacity);
        prop_assert_eq!(&a, &b, "two downstream replicas consumed different sequences");
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
        // The leader's decided order: here, LiveRobin's. Rows only (heartbeats ride along).
        let leader = model(&w.contents, 2);
        let mut follower = Positional::new(channels);
        for (c, s) in orders_of(&leader) {
            follower.push_order(c, s).unwrap();
        }
        // Replaying the log is harmless.
        for (c, s) in orders_of(&leader) {
            follower.push_order(c, s).unwrap();
        }
        let got = follow(&w, &mut follower, arrival);
        prop_assert_eq!(rows_only(&got), rows_only(&leader));
    }

    #[test]
    fn fcfs_loses_nothing_and_keeps_each_channels_order(
        seed in any::<u64>(),
        channels in 1usize..=3,
        replicas in 1usize..=3,
        crash in any::<bool>(),
        arrival in any::<u64>(),
    ) {
        let w = workload(seed, channels, replicas, crash);
        let got = consume(&w, &mut Fcfs::new(channels), arrival, 4);
        for c in 0..channels {
            prop_assert_eq!(channel_events(&got, c), channel_events_of_content(&w.contents[c], c));
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
        flatten(Merge::<Rows>::next(&mut fcfs, &mut rx).unwrap(), &mut out);
        tx[1 - first_channel].offer(a(0));
        flatten(Merge::<Rows>::next(&mut fcfs, &mut rx).unwrap(), &mut out);
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
        let mut lr = LiveRobin::new(2, 1);
        let mut out = Vec::new();
        tx[first_channel].offer(a(0));
        while let Some(d) = lr.next(&mut rx) {
            flatten(d, &mut out);
        }
        tx[1 - first_channel].offer(a(0));
        while let Some(d) = lr.next(&mut rx) {
            flatten(d, &mut out);
        }
        out
    };
    assert_eq!(run_lr(0), run_lr(1));
}

#[test]
fn the_model_reproduces_the_paper_on_a_hand_example() {
    use Elem::{Heartbeat as H, Row as R};
    let contents = vec![vec![R, R, H(1), R], vec![R, H(1), R]];
    assert_eq!(
        model(&contents, 1),
        vec![
            Ev::Row { channel: 0, seq: 0 },
            Ev::Row { channel: 1, seq: 0 },
            Ev::Row { channel: 0, seq: 1 },
            Ev::Heartbeat {
                channel: 1,
                epoch: 1,
                first: true
            },
            Ev::Heartbeat {
                channel: 0,
                epoch: 1,
                first: false
            },
            Ev::Row { channel: 1, seq: 2 },
            Ev::Row { channel: 0, seq: 3 },
            Ev::End,
        ]
    );
}

/// End to end with real threads: one I/O thread per (channel, upstream replica) offering
/// into the dedup channels, one task thread running LiveRobin and sleeping on the consumer
/// bell when it must wait. The consumed sequence is still exactly the model's.
#[test]
fn liverobin_over_threaded_dedup_matches_the_model() {
    use std::thread;
    use std::time::Duration;

    let iterations = if cfg!(debug_assertions) { 40 } else { 300 };
    for i in 0..iterations {
        let seed = 0x7A5C_0000 + i;
        let channels = 1 + (i as usize % 3);
        let replicas = 1 + (i as usize / 3 % 3);
        let quantum = [1, 3, 1024][i as usize % 3];
        let w = workload(seed, channels, replicas, i % 2 == 0);
        let expected = model(&w.contents, quantum);

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

        let mut merge = LiveRobin::new(channels, quantum);
        let mut got = Vec::new();
        loop {
            let seen = bell.generation();
            match merge.next(&mut receivers) {
                Some(Delivery::End) => {
                    got.push(Ev::End);
                    break;
                }
                Some(d) => flatten(d, &mut got),
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
