//! The one error type of tandem-core. Every message names what was wrong, the value seen
//! and, where there is one, what to do about it.

use std::io;

/// Result alias used throughout tandem-core.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Errors raised by the replication core.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A setting is out of range or inconsistent (maps to `tandem.ConfigError`).
    #[error("invalid configuration: {0}")]
    Config(String),

    /// A peer sent bytes that are not a valid tandem frame (maps to `tandem.ProtocolError`).
    #[error("protocol error: {0}")]
    Protocol(#[from] ProtocolError),

    /// A peer failed authentication (maps to `tandem.AuthenticationError`).
    #[error("handshake rejected: {0}")]
    Handshake(String),

    /// An input or output channel was closed while still in use.
    #[error("channel closed: {0}")]
    Closed(String),

    /// An input channel lost every upstream replica feeding it before its end (they are
    /// gone, or dropped this replica as a straggler): what is missing will never come, so
    /// the replica cannot go on (maps to `tandem.InputStarved`). Unlike [`Error::Closed`]
    /// on an output, this is a loss of the replica, never a quiet finish.
    #[error("input starved: {0}")]
    Starved(String),

    /// Replicas of an upstream task partition sent different output for the same
    /// heartbeat cycle (maps to `tandem.DeterminismError`).
    #[error("determinism check failed: {0}")]
    Determinism(String),

    /// A blocking call ran past its deadline.
    #[error("timed out after {0:?}")]
    Timeout(std::time::Duration),

    /// Arrow failed to encode or decode a batch.
    #[error("arrow: {0}")]
    Arrow(#[from] arrow_schema::ArrowError),

    /// Socket or file I/O failed.
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
}

/// Why a frame could not be decoded. Decoding never panics: every malformed input maps to
/// one of these, and the connection that sent it is closed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    /// Fewer bytes than the header or the announced body length.
    #[error("truncated frame: need {needed} bytes, got {got}")]
    Truncated { needed: usize, got: usize },
    /// The frame does not start with tandem's magic number.
    #[error("bad magic {found:#010x} (expected {expected:#010x}): the peer does not speak tandem's wire protocol")]
    BadMagic { found: u32, expected: u32 },
    /// A wire version this build does not understand.
    #[error("unsupported wire version {found} (this build speaks {supported}); run the same tandem version on every worker")]
    BadVersion { found: u16, supported: u16 },
    /// The announced body is larger than the configured limit.
    #[error("frame body of {len} bytes exceeds the limit of {limit} bytes (raise max_frame_bytes if this is expected)")]
    Oversized { len: u64, limit: u64 },
    /// The header's fields contradict each other or the body.
    #[error("inconsistent frame: {0}")]
    Inconsistent(String),
}
