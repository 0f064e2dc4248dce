//! Rust log records into Python's `logging`.
//!
//! tandem-core logs through the `log` facade (see `tandem_core::logs`); this module is the
//! `log::Log` of the extension. A record never touches Python on the thread that logs it:
//! it is formatted, queued, and a single forwarding thread hands the queue to `logging`
//! with the GIL. Most records come from threads that never hold the GIL (a connection's
//! reader, a link's writer), often while they hold a lock of the core that a thread
//! holding the GIL may be waiting for; taking the GIL there (as `pyo3-log` does) could
//! deadlock. The forwarder holds nothing else while it waits for the GIL.
//!
//! The level is cached in `log::max_level()`, so a disabled record costs the logging
//! thread one atomic load and formats nothing. It is the effective level of the Python
//! logger `tandem.core`, read by [`sync_level`] — at import, when an Inbox, Outbox or
//! Worker is made, and from `tandem.logs.sync_level()`; `logging` itself filters each
//! record again by its own logger.
//!
//! Python sees each record under its target as logger name (`tandem.core.inbox`, …),
//! with the Rust source file and line, the Rust thread's name as `threadName`, and the
//! record's key-values (`task`, `partition`, `replica`) as attributes. `flush_logs`
//! waits (GIL released) until everything logged before it is handed over; the forwarding
//! thread stops at interpreter exit (`shutdown_logs`, registered with `atexit` by
//! `tandem.logs`).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use log::kv::{Key, Value, VisitSource};
use log::{Level, LevelFilter, Log, Metadata, Record};
use parking_lot::{Condvar, Mutex};
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// Records queued at most; beyond, new ones are counted and dropped (a flood of log lines
/// must not eat the worker's memory), and the count is logged once the queue drains.
const QUEUE_MAX: usize = 10_000;

/// One record, owned: what the forwarding thread hands to Python.
struct Entry {
    level: Level,
    target: String,
    message: String,
    file: Option<String>,
    line: Option<u32>,
    thread: Option<String>,
    kvs: Vec<(String, KvValue)>,
}

enum KvValue {
    Int(i64),
    Str(String),
}

#[derive(Default)]
struct State {
    queue: VecDeque<Entry>,
    /// Records queued so far, and handed over (or given up on) so far: `flush_logs`
    /// waits for the second to reach the first.
    queued: u64,
    done: u64,
    dropped: u64,
    /// The forwarding thread, and the process that started it (none survives a fork).
    thread: Option<(u32, JoinHandle<()>)>,
    /// `shutdown_logs` ran: nothing is forwarded any more.
    stopped: bool,
}

struct Forwarder {
    state: Mutex<State>,
    /// Rung when a record is queued or the forwarder must stop.
    work: Condvar,
    /// Rung when the forwarding thread handed a batch over.
    handed: Condvar,
    installed: AtomicBool,
}

fn forwarder() -> &'static Forwarder {
    static F: OnceLock<Forwarder> = OnceLock::new();
    F.get_or_init(|| Forwarder {
        state: Mutex::new(State::default()),
        work: Condvar::new(),
        handed: Condvar::new(),
        installed: AtomicBool::new(false),
    })
}

struct Bridge;

impl Log for Bridge {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &Record<'_>) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let f = forwarder();
        let entry = Entry {
            level: record.level(),
            target: record.target().to_owned(),
            message: record.args().to_string(),
            file: record.file().map(str::to_owned),
            line: record.line(),
            thread: std::thread::current().name().map(str::to_owned),
            kvs: key_values(record),
        };
        let mut st = f.state.lock();
        if st.stopped {
            return;
        }
        if st.queue.len() >= QUEUE_MAX {
            st.dropped += 1;
            return;
        }
        st.queue.push_back(entry);
        st.queued += 1;
        ensure_thread(&mut st);
        f.work.notify_one();
    }

    fn flush(&self) {}
}

fn key_values(record: &Record<'_>) -> Vec<(String, KvValue)> {
    struct Collect(Vec<(String, KvValue)>);
    impl<'kvs> VisitSource<'kvs> for Collect {
        fn visit_pair(&mut self, key: Key<'kvs>, value: Value<'kvs>) -> Result<(), log::kv::Error> {
            let v = match value.to_i64() {
                Some(i) => KvValue::Int(i),
                None => KvValue::Str(value.to_string()),
            };
            self.0.push((key.to_string(), v));
            Ok(())
        }
    }
    let mut c = Collect(Vec::new());
    let _ = record.key_values().visit(&mut c);
    c.0
}

/// Start the forwarding thread unless it runs in this process already.
fn ensure_thread(st: &mut State) {
    let pid = std::process::id();
    if matches!(&st.thread, Some((p, _)) if *p == pid) {
        return;
    }
    // After a fork the parent's thread does not exist here; its handle is not ours to join.
    if let Some((_, h)) = st.thread.take() {
        std::mem::forget(h);
    }
    match std::thread::Builder::new()
        .name("tandem-log".to_owned())
        .spawn(forward_loop)
    {
        Ok(h) => st.thread = Some((pid, h)),
        Err(_) => {
            // No thread, no forwarding: give the queue up rather than let it grow.
            st.done += st.queue.len() as u64;
            st.queue.clear();
        }
    }
}

/// The forwarding thread: take what is queued, hand it to `logging` with the GIL, again.
fn forward_loop() {
    let f = forwarder();
    loop {
        let (batch, dropped) = {
            let mut st = f.state.lock();
            while st.queue.is_empty() && st.dropped == 0 && !st.stopped {
                f.work.wait(&mut st);
            }
            if st.stopped {
                return;
            }
            (
                std::mem::take(&mut st.queue),
                std::mem::take(&mut st.dropped),
            )
        };
        let n = batch.len() as u64;
        // None: the interpreter is finalizing; the records are given up.
        let _ = Python::try_attach(|py| emit(py, batch, dropped));
        let mut st = f.state.lock();
        st.done += n;
        f.handed.notify_all();
    }
}

/// Hand `batch` to `logging` (and say how many records were dropped before it).
fn emit(py: Python<'_>, batch: VecDeque<Entry>, dropped: u64) {
    // Logging must not leave an exception behind on this thread.
    let _ = emit_all(py, batch, dropped);
    let _ = PyErr::take(py);
}

fn emit_all(py: Python<'_>, batch: VecDeque<Entry>, dropped: u64) -> PyResult<()> {
    let logging = py.import("logging")?;
    if dropped > 0 {
        logging
            .call_method1("getLogger", ("tandem.core",))?
            .call_method1(
                "warning",
                (format!(
                    "{dropped} log records of the Rust core were dropped: more than {QUEUE_MAX} \
                 were waiting to be handed to logging"
                ),),
            )?;
    }
    for e in batch {
        let level = python_level(e.level);
        let logger = logging.call_method1("getLogger", (e.target.as_str(),))?;
        if !logger.call_method1("isEnabledFor", (level,))?.is_truthy()? {
            continue;
        }
        let extra = PyDict::new(py);
        for (k, v) in &e.kvs {
            match v {
                KvValue::Int(i) => extra.set_item(k, *i)?,
                KvValue::Str(s) => extra.set_item(k, s)?,
            }
        }
        let record = logger.call_method1(
            "makeRecord",
            (
                e.target.as_str(),
                level,
                e.file.as_deref().unwrap_or("<rust>"),
                e.line.unwrap_or(0),
                e.message.as_str(),
                (),
                py.None(),
                py.None(),
                extra,
            ),
        )?;
        if let Some(t) = &e.thread {
            record.setattr("threadName", t)?;
        }
        logger.call_method1("handle", (record,))?;
    }
    Ok(())
}

fn python_level(level: Level) -> u32 {
    match level {
        Level::Error => 40,
        Level::Warn => 30,
        Level::Info => 20,
        Level::Debug => 10,
        Level::Trace => 5,
    }
}

fn level_filter(python: i64) -> LevelFilter {
    match python {
        i64::MIN..=5 => LevelFilter::Trace,
        6..=10 => LevelFilter::Debug,
        11..=20 => LevelFilter::Info,
        21..=30 => LevelFilter::Warn,
        31..=50 => LevelFilter::Error,
        _ => LevelFilter::Off,
    }
}

/// Install the forwarder (once per process) and read the level.
pub(crate) fn install(py: Python<'_>) -> PyResult<()> {
    let f = forwarder();
    if !f.installed.swap(true, Ordering::SeqCst) && log::set_logger(&Bridge).is_err() {
        // Another logger of this process owns the facade: leave it be.
        return Ok(());
    }
    sync_level(py)
}

/// Cache the effective level of the Python logger `tandem.core` as the facade's maximum:
/// records below it are never formatted.
#[pyfunction]
pub(crate) fn sync_level(py: Python<'_>) -> PyResult<()> {
    let level: i64 = py
        .import("logging")?
        .call_method1("getLogger", ("tandem.core",))?
        .call_method0("getEffectiveLevel")?
        .extract()?;
    log::set_max_level(level_filter(level));
    Ok(())
}

/// Wait (GIL released) until every record logged before this call has been handed to
/// `logging`, at most `timeout` seconds. True if it was.
#[pyfunction]
#[pyo3(signature = (timeout = 5.0))]
fn flush_logs(py: Python<'_>, timeout: f64) -> bool {
    let deadline = Instant::now() + Duration::from_secs_f64(timeout.clamp(0.0, 3600.0));
    py.detach(|| {
        let f = forwarder();
        let mut st = f.state.lock();
        let target = st.queued;
        while st.done < target && !st.stopped {
            if f.handed.wait_until(&mut st, deadline).timed_out() {
                return st.done >= target;
            }
        }
        st.done >= target
    })
}

/// Stop the forwarding thread (at interpreter exit: it must not wait for the GIL while
/// the interpreter finalizes). What is queued is handed over first; later records are
/// dropped. Idempotent.
#[pyfunction]
fn shutdown_logs(py: Python<'_>) {
    flush_logs(py, 1.0);
    py.detach(|| {
        let f = forwarder();
        let thread = {
            let mut st = f.state.lock();
            st.stopped = true;
            st.queue.clear();
            f.work.notify_all();
            st.thread.take()
        };
        if let Some((pid, h)) = thread {
            if pid == std::process::id() {
                let _ = h.join();
            }
        }
    });
}

/// A test hook: log one record from a thread that never held the GIL, through the facade
/// like the core does, with `task`/`partition`/`replica` key-values.
#[pyfunction]
#[pyo3(signature = (level, target, message, me = None))]
fn _log_from_thread(
    py: Python<'_>,
    level: &str,
    target: String,
    message: String,
    me: Option<(u32, u32, u32)>,
) -> PyResult<()> {
    let level: Level = level
        .parse()
        .map_err(|_| crate::errors::ConfigError::new_err(format!("unknown level {level:?}")))?;
    py.detach(move || {
        std::thread::spawn(move || match me {
            Some((t, p, r)) => log::log!(
                target: &target, level, task = t, partition = p, replica = r; "{message}"
            ),
            None => log::log!(target: &target, level, "{message}"),
        })
        .join()
        .ok();
    });
    Ok(())
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    install(m.py())?;
    m.add_function(wrap_pyfunction!(sync_level, m)?)?;
    m.add_function(wrap_pyfunction!(flush_logs, m)?)?;
    m.add_function(wrap_pyfunction!(shutdown_logs, m)?)?;
    m.add_function(wrap_pyfunction!(_log_from_thread, m)?)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_levels_map_to_filters() {
        assert_eq!(level_filter(0), LevelFilter::Trace);
        assert_eq!(level_filter(10), LevelFilter::Debug);
        assert_eq!(level_filter(20), LevelFilter::Info);
        assert_eq!(level_filter(30), LevelFilter::Warn);
        assert_eq!(level_filter(40), LevelFilter::Error);
        assert_eq!(level_filter(50), LevelFilter::Error);
        assert_eq!(level_filter(60), LevelFilter::Off);
        for l in [Level::Error, Level::Warn, Level::Info, Level::Debug] {
            assert_eq!(
                level_filter(i64::from(python_level(l))),
                l.to_level_filter()
            );
        }
    }
}
