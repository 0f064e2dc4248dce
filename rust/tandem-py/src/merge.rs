//! `tandem._core.LiveRobin`, `Fcfs` and `Positional`: the consumption orders of
//! [`tandem_core::merge`] over pyarrow record batches.
//!
//! Each object owns its input channels (deduplicated, contiguous element sequences). Push
//! elements with `push` / `push_heartbeat` / `push_end` (and, for `Positional`, orders with
//! `push_order`), then take deliveries with `next()` or `drain()`. A delivery is a tuple:
//!
//! * `("data", channel, first_seq, batch)` — rows of `channel` from seq `first_seq`;
//! * `("heartbeat", channel, epoch, first)` — `first` is True the first time the epoch is
//!   seen (the task forwards the heartbeat then);
//! * `("end",)` — every channel has ended.

use std::collections::VecDeque;

use arrow_array::RecordBatch;
use arrow_schema::SchemaRef;
use arrow_select::concat::concat_batches;
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};
use pyo3_arrow::PyRecordBatch;
use tandem_core::item::channel_elements;
use tandem_core::liverobin::LiveRobin as CoreLiveRobin;
use tandem_core::merge::{Fcfs as CoreFcfs, Merge, Positional as CorePositional};
use tandem_core::{Delivery, Item};

use crate::dedup::{arg_batch, arg_batches, arg_channel, arg_positive, arg_u64, check_range};
use crate::errors::{ConfigError, IntoPyResult};

/// A merge and the channels it reads.
struct State<M> {
    merge: M,
    inputs: Vec<VecDeque<Item<RecordBatch>>>,
    /// Per channel: the seq the next pushed element must start at, or None once ended.
    next_seq: Vec<Option<u64>>,
}

impl<M: Merge<RecordBatch>> State<M> {
    fn new(merge: M, channels: usize) -> Self {
        Self {
            merge,
            inputs: (0..channels).map(|_| VecDeque::new()).collect(),
            next_seq: vec![Some(0); channels],
        }
    }

    /// Where `item` leaves channel `c` if it may follow `expected` (the seq the channel's
    /// next element must start at, None once ended): the next expected seq.
    fn follows(c: usize, expected: Option<u64>, item: &Item<RecordBatch>) -> PyResult<Option<u64>> {
        let Some(expected) = expected else {
            return Err(ConfigError::new_err(format!(
                "channel {c} has ended: nothing can follow its end marker"
            )));
        };
        if item.first_seq() != expected {
            return Err(ConfigError::new_err(format!(
                "channel {c} expects seq {expected} next, got an element starting at seq {}: \
                 merge inputs must be deduplicated and contiguous (pass them through Dedup)",
                item.first_seq()
            )));
        }
        Ok(match item {
            Item::End { .. } => None,
            other => Some(other.end_seq()),
        })
    }

    /// Append an element to a channel, checking it continues the channel's sequence.
    fn push(&mut self, c: usize, item: Item<RecordBatch>) -> PyResult<()> {
        self.next_seq[c] = Self::follows(c, self.next_seq[c], &item)?;
        self.inputs[c].push_back(item);
        Ok(())
    }

    /// Append elements to a channel, all or none: each must continue the sequence.
    fn push_all(&mut self, c: usize, items: Vec<Item<RecordBatch>>) -> PyResult<()> {
        let mut next = self.next_seq[c];
        for item in &items {
            next = Self::follows(c, next, item)?;
        }
        self.next_seq[c] = next;
        self.inputs[c].extend(items);
        Ok(())
    }

    /// The schema every queued batch has, or None if no batch is queued; an error naming
    /// two that differ (`drain_many` concatenates the batches it delivers).
    fn queued_schema(&self) -> PyResult<Option<SchemaRef>> {
        let mut schema: Option<SchemaRef> = None;
        for (c, queue) in self.inputs.iter().enumerate() {
            for item in queue {
                let Item::Data { first_seq, payload } = item else {
                    continue;
                };
                match &schema {
                    None => schema = Some(payload.schema()),
                    // Arc's == compares pointers first: batches of one stream share theirs.
                    Some(s) if s == payload.schema_ref() => {}
                    Some(s) => {
                        return Err(ConfigError::new_err(format!(
                            "drain_many hands the batches' rows back as one record batch, but the \
                             batch of channel {c} at seq {first_seq} has schema {} where an \
                             earlier one has {s}: use drain() for batches of differing schemas",
                            payload.schema_ref()
                        )))
                    }
                }
            }
        }
        Ok(schema)
    }
}

fn delivery_to_py<'py>(py: Python<'py>, d: Delivery<RecordBatch>) -> PyResult<Bound<'py, PyTuple>> {
    match d {
        Delivery::Data {
            channel,
            first_seq,
            payload,
        } => {
            let batch = PyRecordBatch::new(payload).into_pyarrow(py)?;
            PyTuple::new(
                py,
                [
                    "data".into_pyobject(py)?.into_any(),
                    channel.into_pyobject(py)?.into_any(),
                    first_seq.into_pyobject(py)?.into_any(),
                    batch,
                ],
            )
        }
        Delivery::Heartbeat {
            channel,
            epoch,
            first,
        } => PyTuple::new(
            py,
            [
                "heartbeat".into_pyobject(py)?.into_any(),
                channel.into_pyobject(py)?.into_any(),
                epoch.into_pyobject(py)?.into_any(),
                pyo3::types::PyBool::new(py, first).to_owned().into_any(),
            ],
        ),
        Delivery::End => PyTuple::new(py, ["end"]),
    }
}

/// Read `first_seqs` (see `push_many`).
fn arg_seqs(first_seqs: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    first_seqs
        .try_iter()
        .map_err(|_| ConfigError::new_err("first_seqs must be a sequence of integers"))?
        .map(|s| arg_u64(&s?, "first_seq"))
        .collect()
}

/// Read `rows` (see `push_many`): an Arrow stream, a record batch, or a sequence of them.
fn arg_rows(rows: &Bound<'_, PyAny>) -> PyResult<Vec<RecordBatch>> {
    if !rows.hasattr("__arrow_c_stream__")? && rows.hasattr("__arrow_c_array__")? {
        return Ok(vec![arg_batch(rows)?]);
    }
    arg_batches(rows)
}

/// Read `heartbeats` (see `push_many`): `(seq, epoch)` pairs.
fn arg_heartbeats(heartbeats: &Bound<'_, PyAny>) -> PyResult<Vec<(u64, u64)>> {
    let bad = || {
        ConfigError::new_err(
            "heartbeats must be a sequence of (seq, epoch) pairs of non-negative integers",
        )
    };
    let mut out = Vec::new();
    for pair in heartbeats.try_iter().map_err(|_| bad())? {
        let (seq, epoch) = pair?
            .extract::<(Bound<'_, PyAny>, Bound<'_, PyAny>)>()
            .map_err(|_| bad())?;
        let seq = arg_u64(&seq, "heartbeat seq")?;
        check_range(seq, 1)?;
        out.push((seq, arg_u64(&epoch, "heartbeat epoch")?));
    }
    Ok(out)
}

/// The methods every merge class shares; `$extra` adds class-specific ones.
macro_rules! merge_class {
    ($name:ident, { $($extra:tt)* }) => {
        #[pymethods]
        impl $name {
            /// Number of input channels.
            #[getter]
            fn channels(&self) -> usize {
                self.state.lock().inputs.len()
            }

            /// Append rows `[first_seq, first_seq + batch.num_rows)` to `channel`.
            fn push(
                &self,
                channel: &Bound<'_, PyAny>,
                first_seq: &Bound<'_, PyAny>,
                batch: &Bound<'_, PyAny>,
            ) -> PyResult<()> {
                let mut st = self.state.lock();
                let c = arg_channel(channel, st.inputs.len())?;
                let first_seq = arg_u64(first_seq, "first_seq")?;
                let payload = arg_batch(batch)?;
                check_range(first_seq, payload.num_rows())?;
                st.push(c, Item::Data { first_seq, payload })
            }

            /// Append the heartbeat of cycle `epoch`, at seq `seq`, to `channel`.
            fn push_heartbeat(
                &self,
                channel: &Bound<'_, PyAny>,
                seq: &Bound<'_, PyAny>,
                epoch: &Bound<'_, PyAny>,
            ) -> PyResult<()> {
                let mut st = self.state.lock();
                let c = arg_channel(channel, st.inputs.len())?;
                let seq = arg_u64(seq, "seq")?;
                let epoch = arg_u64(epoch, "epoch")?;
                check_range(seq, 1)?;
                st.push(c, Item::Heartbeat { seq, epoch })
            }

            /// Append the end marker, at seq `seq`, to `channel`.
            fn push_end(&self, channel: &Bound<'_, PyAny>, seq: &Bound<'_, PyAny>) -> PyResult<()> {
                let mut st = self.state.lock();
                let c = arg_channel(channel, st.inputs.len())?;
                let seq = arg_u64(seq, "seq")?;
                check_range(seq, 1)?;
                st.push(c, Item::End { seq })
            }

            /// The next delivery, or None if the merge must wait for more input.
            fn next<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyTuple>>> {
                let d = {
                    let mut st = self.state.lock();
                    let State { merge, inputs, .. } = &mut *st;
                    merge.next(inputs)
                };
                d.map(|d| delivery_to_py(py, d)).transpose()
            }

            /// Every delivery available now, in order (up to and including the end).
            fn drain<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
                let out = {
                    let mut st = self.state.lock();
                    let State { merge, inputs, .. } = &mut *st;
                    merge.drain(inputs)
                };
                let list = PyList::empty(py);
                for d in out {
                    list.append(delivery_to_py(py, d)?)?;
                }
                Ok(list)
            }

            /// Append many elements of one channel in one call, all or none: data batches
            /// starting at `first_seqs`, whose rows `rows` holds back to back (an Arrow
            /// stream — a `pyarrow.Table` — a record batch, or a sequence of them, chunked
            /// like the batches or in one chunk: they are cut zero-copy where the seqs say),
            /// the heartbeats `(seq, epoch)`, and the end marker at seq `end` if given.
            /// A batch ends where the channel's next element starts (the last one at the end
            /// of `rows`); together the elements must continue the channel. A batch of no
            /// rows is left out, as dedup leaves it out. The same elements pushed one by one
            /// give the same deliveries.
            #[pyo3(signature = (channel, first_seqs, rows, heartbeats = None, end = None))]
            fn push_many(
                &self,
                channel: &Bound<'_, PyAny>,
                first_seqs: &Bound<'_, PyAny>,
                rows: &Bound<'_, PyAny>,
                heartbeats: Option<&Bound<'_, PyAny>>,
                end: Option<&Bound<'_, PyAny>>,
            ) -> PyResult<()> {
                let channels = self.state.lock().inputs.len();
                let c = arg_channel(channel, channels)?;
                let first_seqs = arg_seqs(first_seqs)?;
                let chunks = arg_rows(rows)?;
                let heartbeats = match heartbeats {
                    Some(h) => arg_heartbeats(h)?,
                    None => Vec::new(),
                };
                let end = end.map(|e| arg_u64(e, "end")).transpose()?;
                let items = channel_elements(chunks, &first_seqs, &heartbeats, end)
                    .map_err(|e| ConfigError::new_err(format!("channel {c}: {e}")))?;
                for item in &items {
                    check_range(item.first_seq(), item.seq_len() as usize)?;
                }
                self.state.lock().push_all(c, items)
            }

            /// Every delivery available now, as `drain()` gives them, in one call that
            /// hands no batch over on its own: returns `(deliveries, rows)` where a data
            /// delivery is `("data", channel, first_seq, num_rows)` (heartbeats and the end
            /// as in `drain()`) and `rows` is one `pyarrow.RecordBatch` of the delivered
            /// batches' rows back to back, in delivery order (a copy; None if no batch was
            /// delivered). Every queued batch must have one schema; otherwise it raises
            /// before taking anything.
            fn drain_many<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
                let (out, schema) = {
                    let mut st = self.state.lock();
                    let schema = st.queued_schema()?;
                    let State { merge, inputs, .. } = &mut *st;
                    (merge.drain(inputs), schema)
                };
                let list = PyList::empty(py);
                let mut batches = Vec::new();
                for d in out {
                    match d {
                        Delivery::Data {
                            channel,
                            first_seq,
                            payload,
                        } => {
                            list.append(("data", channel, first_seq, payload.num_rows()))?;
                            batches.push(payload);
                        }
                        other => list.append(delivery_to_py(py, other)?)?,
                    }
                }
                let rows = match schema {
                    Some(schema) if !batches.is_empty() => {
                        let rows = py
                            .detach(|| concat_batches(&schema, &batches))
                            .map_err(|e| {
                                ConfigError::new_err(format!(
                                    "could not concatenate the {} delivered batches: {e}",
                                    batches.len()
                                ))
                            })?;
                        PyRecordBatch::new(rows).into_pyarrow(py)?
                    }
                    _ => py.None().into_bound(py),
                };
                PyTuple::new(py, [list.into_any(), rows])
            }

            /// The channel the merge is blocked on, or None if any channel would do (or it
            /// waits for something else: an order, or nothing after the end).
            #[getter]
            fn waiting_on(&self) -> Option<usize> {
                Merge::<RecordBatch>::waiting_on(&self.state.lock().merge)
            }

            /// Elements pushed but not yet delivered, per channel.
            fn pending(&self) -> Vec<usize> {
                self.state.lock().inputs.iter().map(VecDeque::len).collect()
            }

            /// Append `count` channels that join after heartbeat `after_epoch` (a live
            /// rescale: LiveRobin gives them turns from the end of that epoch's cycle, Fcfs
            /// at once, Positional refuses). Returns the first new channel's index.
            fn join(&self, count: &Bound<'_, PyAny>, after_epoch: &Bound<'_, PyAny>) -> PyResult<usize> {
                let count = arg_u64(count, "count")? as usize;
                let after_epoch = arg_u64(after_epoch, "after_epoch")?;
                let mut st = self.state.lock();
                Merge::<RecordBatch>::join(&mut st.merge, count, after_epoch).py()?;
                let first = st.inputs.len();
                st.inputs.extend((0..count).map(|_| VecDeque::new()));
                st.next_seq.extend((0..count).map(|_| Some(0)));
                Ok(first)
            }

            $($extra)*
        }
    };
}

/// LiveRobin (Algorithm 1 of the paper): deterministic round-robin over the channels still
/// active in the current heartbeat cycle, one whole element (a batch, never sliced, or a
/// heartbeat or end marker) per turn.
#[pyclass(frozen, module = "tandem._core")]
pub(crate) struct LiveRobin {
    state: Mutex<State<CoreLiveRobin<RecordBatch>>>,
}

merge_class!(LiveRobin, {
    #[new]
    fn new(channels: &Bound<'_, PyAny>) -> PyResult<Self> {
        let channels = arg_positive(channels, "channels")?;
        Ok(Self {
            state: Mutex::new(State::new(CoreLiveRobin::new(channels), channels)),
        })
    }

    fn __repr__(&self) -> String {
        let st = self.state.lock();
        format!(
            "LiveRobin(channels={}, active={:?})",
            st.inputs.len(),
            st.merge.active_channels()
        )
    }
});

/// First come, first served (`ordering="none"`): not deterministic across replicas.
#[pyclass(frozen, module = "tandem._core")]
pub(crate) struct Fcfs {
    state: Mutex<State<CoreFcfs>>,
}

merge_class!(Fcfs, {
    #[new]
    fn new(channels: &Bound<'_, PyAny>) -> PyResult<Self> {
        let channels = arg_positive(channels, "channels")?;
        Ok(Self {
            state: Mutex::new(State::new(CoreFcfs::new(channels), channels)),
        })
    }

    fn __repr__(&self) -> String {
        format!("Fcfs(channels={})", self.state.lock().inputs.len())
    }
});

/// Follows orders "consume channel c until its next seq is up_to_seq" (KaZoo follower).
#[pyclass(frozen, module = "tandem._core")]
pub(crate) struct Positional {
    state: Mutex<State<CorePositional<RecordBatch>>>,
}

merge_class!(Positional, {
    #[new]
    fn new(channels: &Bound<'_, PyAny>) -> PyResult<Self> {
        let channels = arg_positive(channels, "channels")?;
        Ok(Self {
            state: Mutex::new(State::new(CorePositional::new(channels), channels)),
        })
    }

    /// Append the order "consume `channel` until its next seq is `up_to_seq`". Orders at
    /// or before the channel's position are no-ops (a replayed log is harmless).
    fn push_order(&self, channel: &Bound<'_, PyAny>, up_to_seq: &Bound<'_, PyAny>) -> PyResult<()> {
        let mut st = self.state.lock();
        let c = arg_channel(channel, st.inputs.len())?;
        let up_to_seq = arg_u64(up_to_seq, "up_to_seq")?;
        st.merge.push_order(c, up_to_seq).py()
    }

    /// First seq of `channel` not yet delivered.
    fn position(&self, channel: &Bound<'_, PyAny>) -> PyResult<u64> {
        let st = self.state.lock();
        let c = arg_channel(channel, st.inputs.len())?;
        Ok(st.merge.position(c).unwrap_or(0))
    }

    fn __repr__(&self) -> String {
        let st = self.state.lock();
        format!(
            "Positional(channels={}, pending_orders={})",
            st.inputs.len(),
            st.merge.pending_orders()
        )
    }
});

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<LiveRobin>()?;
    m.add_class::<Fcfs>()?;
    m.add_class::<Positional>()?;
    Ok(())
}
