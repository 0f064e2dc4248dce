//! The argument checks the `Inbox`, `Outbox` and order feed bindings share: each names the
//! argument, the value seen and what is allowed (a `ConfigError`).

use std::time::Duration;

use pyo3::prelude::*;
use tandem_core::logs::ReplicaTag;
use tandem_core::Error;

use crate::errors::ConfigError;

pub(crate) fn config_err(msg: String) -> PyErr {
    ConfigError::new_err(msg)
}

pub(crate) fn arg_u32(name: &str, v: i64) -> PyResult<u32> {
    u32::try_from(v).map_err(|_| config_err(format!("{name} must be in 0..=4294967295, got {v}")))
}

pub(crate) fn arg_at_least_1(name: &str, v: i64) -> PyResult<usize> {
    if v < 1 {
        return Err(config_err(format!("{name} must be ≥ 1, got {v}")));
    }
    usize::try_from(v).map_err(|_| config_err(format!("{name} is too large: {v}")))
}

/// The tag of the replica `me` (task, partition, replica) for log lines, named `name` if
/// given.
pub(crate) fn replica_tag(
    me: Option<(i64, i64, i64)>,
    name: Option<String>,
) -> PyResult<Option<ReplicaTag>> {
    let Some((t, p, r)) = me else {
        return Ok(None);
    };
    let tag = ReplicaTag::new(
        arg_u32("me task", t)?,
        arg_u32("me partition", p)?,
        arg_u32("me replica", r)?,
    );
    Ok(Some(match name {
        Some(n) => tag.named(n),
        None => tag,
    }))
}

pub(crate) fn arg_seconds(name: &str, v: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(v).map_err(|_| {
        config_err(format!(
            "{name} must be a finite number of seconds ≥ 0, got {v}"
        ))
    })
}

pub(crate) fn closed(what: &str) -> PyErr {
    crate::errors::to_py(Error::Closed(format!("{what}() on a closed object")))
}
