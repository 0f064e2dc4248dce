//! `tandem._core`: a thin PyO3 layer over tandem-core, one topic per file.
//!
//! Arrow crosses the boundary as PyCapsules (pyo3-arrow): a `pyarrow.RecordBatch` goes in
//! and out without copying. On the hot path (a worker's batches to Python, an outbox's from
//! it) only the rows cross, the schema converted once ([`batch`]). Blocking calls release
//! the GIL through [`gil::wait`], which still honours Ctrl-C. The core's log records reach
//! Python's `logging` through [`logs`].

use pyo3::prelude::*;

mod args;
mod batch;
mod cut;
mod dedup;
mod errors;
mod gil;
mod inbox;
mod logs;
mod merge;
mod orderfeed;
mod orderlog;
mod outbox;
mod wire;
mod worker;

/// Cargo profile this extension was compiled with ("release" or "debug").
const BUILD_PROFILE: &str = if cfg!(debug_assertions) {
    "debug"
} else {
    "release"
};

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("build_profile", BUILD_PROFILE)?;
    errors::register(m)?;
    logs::register(m)?;
    wire::register(m)?;
    dedup::register(m)?;
    merge::register(m)?;
    orderlog::register(m)?;
    inbox::register(m)?;
    outbox::register(m)?;
    orderfeed::register(m)?;
    worker::register(m)?;
    Ok(())
}
