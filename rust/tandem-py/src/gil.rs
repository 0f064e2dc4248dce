//! Waiting without the GIL, while still honouring Ctrl-C (the polars / datafusion pattern).

use std::time::Duration;

use pyo3::prelude::*;

/// How often a blocked call comes back to check for signals.
const SIGNAL_CHECK: Duration = Duration::from_millis(50);

/// Run `step` repeatedly with the GIL released until it returns `Some`, checking for
/// signals (Ctrl-C raises `KeyboardInterrupt`) between steps. `step` receives the longest
/// time it may block before coming back.
pub(crate) fn wait<T, F>(py: Python<'_>, mut step: F) -> PyResult<T>
where
    T: Send,
    F: FnMut(Duration) -> Option<T> + Send,
{
    loop {
        if let Some(v) = py.detach(|| step(SIGNAL_CHECK)) {
            return Ok(v);
        }
        py.check_signals()?;
    }
}
