//! What tandem-core logs, and about whom.
//!
//! tandem-core writes through the [`log`] facade and never prints. The targets are the
//! names of Python loggers ([`INBOX`], [`OUTBOX`]): tandem-py forwards every record to
//! Python's `logging` under its target. A line about one task partition replica starts
//! with that replica's name and carries its ids as the key-values `task`, `partition` and
//! `replica` (in Python, attributes of the log record).
//!
//! Levels: `warn` is for what somebody should look at — a connection refused at the
//! handshake, a frame that does not decode, a sender wired to the wrong partition, a
//! divergence under `on_divergence="log"`. A peer that goes away is a fault the other
//! replicas mask, or the normal end of a downstream replica that finished on its twins'
//! copies: `info` when an upstream connection breaks off mid-stream, `debug` when a
//! downstream replica has closed its end.
//!
//! A disabled level costs one relaxed atomic load: the `log` macros compare with
//! [`log::max_level`] before they format anything.

use std::fmt;

/// Target of the receiving side's lines (`tandem.core.inbox` in Python).
pub const INBOX: &str = "tandem.core.inbox";
/// Target of the sending side's lines (`tandem.core.outbox` in Python).
pub const OUTBOX: &str = "tandem.core.outbox";

/// The task partition replica an inbox or outbox belongs to, as its log lines name it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaTag {
    pub task: u32,
    pub partition: u32,
    pub replica: u32,
    /// How messages name it, e.g. `task 'count' partition 0 replica 1`.
    pub name: String,
}

impl ReplicaTag {
    /// A tag named `task T partition P replica R`.
    pub fn new(task: u32, partition: u32, replica: u32) -> Self {
        ReplicaTag {
            task,
            partition,
            replica,
            name: format!("task {task} partition {partition} replica {replica}"),
        }
    }

    /// The same ids under another name (a task's name instead of its id, say).
    #[must_use]
    pub fn named(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }
}

impl fmt::Display for ReplicaTag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name)
    }
}

/// `log!` about the replica `$me` (an `Option<&ReplicaTag>`): its ids go along as the
/// key-values `task`, `partition`, `replica` (none when `$me` is None).
macro_rules! log_replica {
    ($level:expr, $target:expr, $me:expr, $($arg:tt)+) => {{
        let me: Option<&$crate::logs::ReplicaTag> = $me;
        match me {
            Some(m) => log::log!(
                target: $target,
                $level,
                task = m.task,
                partition = m.partition,
                replica = m.replica;
                $($arg)+
            ),
            None => log::log!(target: $target, $level, $($arg)+),
        }
    }};
}
pub(crate) use log_replica;

#[cfg(test)]
pub(crate) mod capture {
    //! A test logger: keeps every record (level, target, message, key-values) so tests can
    //! assert what was logged. Installed once per test binary, at trace level.

    use log::kv::{Key, Value, VisitSource};
    use log::{Level, Log, Metadata, Record};
    use parking_lot::Mutex;
    use std::sync::OnceLock;

    #[derive(Debug, Clone)]
    pub struct Captured {
        pub level: Level,
        pub target: String,
        pub message: String,
        pub kvs: Vec<(String, String)>,
    }

    impl Captured {
        pub fn kv(&self, key: &str) -> Option<&str> {
            self.kvs
                .iter()
                .find(|(k, _)| k == key)
                .map(|(_, v)| v.as_str())
        }
    }

    struct Capture(Mutex<Vec<Captured>>);

    impl Log for Capture {
        fn enabled(&self, _: &Metadata<'_>) -> bool {
            true
        }
        fn log(&self, record: &Record<'_>) {
            struct Kvs(Vec<(String, String)>);
            impl<'kvs> VisitSource<'kvs> for Kvs {
                fn visit_pair(
                    &mut self,
                    key: Key<'kvs>,
                    value: Value<'kvs>,
                ) -> Result<(), log::kv::Error> {
                    self.0.push((key.to_string(), value.to_string()));
                    Ok(())
                }
            }
            let mut kvs = Kvs(Vec::new());
            let _ = record.key_values().visit(&mut kvs);
            self.0.lock().push(Captured {
                level: record.level(),
                target: record.target().to_owned(),
                message: record.args().to_string(),
                kvs: kvs.0,
            });
        }
        fn flush(&self) {}
    }

    fn logger() -> &'static Capture {
        static LOGGER: OnceLock<&'static Capture> = OnceLock::new();
        LOGGER.get_or_init(|| {
            let l: &'static Capture = Box::leak(Box::new(Capture(Mutex::new(Vec::new()))));
            log::set_logger(l).expect("no other logger in tandem-core's tests");
            log::set_max_level(log::LevelFilter::Trace);
            l
        })
    }

    /// Start capturing (idempotent).
    pub fn install() {
        logger();
    }

    /// Every record captured so far whose message contains `needle`.
    pub fn matching(needle: &str) -> Vec<Captured> {
        logger()
            .0
            .lock()
            .iter()
            .filter(|c| c.message.contains(needle))
            .cloned()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replica_line_carries_its_ids() {
        capture::install();
        let me = ReplicaTag::new(3, 1, 0).named("task 'count' partition 1 replica 0");
        log_replica!(log::Level::Warn, INBOX, Some(&me), "{me}: logs-test-one");
        log_replica!(log::Level::Debug, OUTBOX, None, "logs-test-anonymous");
        let got = capture::matching("logs-test-one");
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].level, log::Level::Warn);
        assert_eq!(got[0].target, "tandem.core.inbox");
        assert_eq!(
            got[0].message,
            "task 'count' partition 1 replica 0: logs-test-one"
        );
        assert_eq!(got[0].kv("task"), Some("3"));
        assert_eq!(got[0].kv("partition"), Some("1"));
        assert_eq!(got[0].kv("replica"), Some("0"));
        let anon = capture::matching("logs-test-anonymous");
        assert_eq!(anon[0].target, "tandem.core.outbox");
        assert!(anon[0].kvs.is_empty());
    }
}
