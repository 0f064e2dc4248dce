//! tandem's exception tree, rooted at `tandem.TandemError`, and the mapping from
//! `tandem_core::Error`. Re-exported from `tandem/exceptions.py`.

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use tandem_core::Error;

create_exception!(
    tandem,
    TandemError,
    PyException,
    "Base class of every error tandem raises."
);
create_exception!(
    tandem,
    ConfigError,
    TandemError,
    "A job, operator or knob is configured wrongly."
);
create_exception!(
    tandem,
    ProtocolError,
    TandemError,
    "A peer sent bytes that are not a valid tandem frame."
);
create_exception!(
    tandem,
    AuthenticationError,
    ProtocolError,
    "A peer failed the handshake (wrong job or secret)."
);
create_exception!(
    tandem,
    ChannelClosed,
    TandemError,
    "An input or output channel closed while in use."
);
create_exception!(
    tandem,
    InputStarved,
    TandemError,
    "An input channel lost every upstream replica feeding it before its end."
);
create_exception!(
    tandem,
    DeterminismError,
    TandemError,
    "Replicas of one task partition produced different output."
);
create_exception!(
    tandem,
    ServiceUnavailable,
    TandemError,
    "A required service (ZooKeeper, Kafka, Spark) cannot be reached."
);

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("TandemError", py.get_type::<TandemError>())?;
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    m.add("ProtocolError", py.get_type::<ProtocolError>())?;
    m.add("AuthenticationError", py.get_type::<AuthenticationError>())?;
    m.add("ChannelClosed", py.get_type::<ChannelClosed>())?;
    m.add("InputStarved", py.get_type::<InputStarved>())?;
    m.add("DeterminismError", py.get_type::<DeterminismError>())?;
    m.add("ServiceUnavailable", py.get_type::<ServiceUnavailable>())?;
    Ok(())
}

/// Convert a core error into the matching Python exception.
pub(crate) fn to_py(err: Error) -> PyErr {
    let msg = err.to_string();
    match err {
        Error::Config(_) => ConfigError::new_err(msg),
        Error::Protocol(_) => ProtocolError::new_err(msg),
        Error::Handshake(_) => AuthenticationError::new_err(msg),
        Error::Closed(_) => ChannelClosed::new_err(msg),
        Error::Starved(_) => InputStarved::new_err(msg),
        Error::Determinism(_) => DeterminismError::new_err(msg),
        Error::Timeout(_) => pyo3::exceptions::PyTimeoutError::new_err(msg),
        Error::Arrow(_) => TandemError::new_err(msg),
        Error::Io(e) => PyErr::from(e),
    }
}

/// `?`-friendly conversion: `core_call().map_err(to_py)?` reads as `core_call().py()?`.
pub(crate) trait IntoPyResult<T> {
    fn py(self) -> PyResult<T>;
}

impl<T> IntoPyResult<T> for tandem_core::Result<T> {
    fn py(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}
