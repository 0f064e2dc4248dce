"""The exception tree of tandem. Every error tandem raises derives from `TandemError`.

```
TandemError
 +-- ConfigError          a job, operator or knob is configured wrongly
 +-- ProtocolError        a peer sent bytes that are not a valid tandem frame
 |    +-- AuthenticationError   a peer failed the handshake (wrong job or secret)
 +-- ChannelClosed        an input or output channel closed while in use
 +-- InputStarved         an input lost every upstream replica feeding it before its end
 +-- DeterminismError     replicas of one task partition produced different output
 +-- ServiceUnavailable   ZooKeeper, Kafka or Spark cannot be reached
 +-- TaskFailed           a replica's operator, source or sink raised during a run
```

The classes but ``TaskFailed`` are defined in the native module so that Rust raises them
directly.
"""

from tandem._core import (
    AuthenticationError,
    ChannelClosed,
    ConfigError,
    DeterminismError,
    InputStarved,
    ProtocolError,
    ServiceUnavailable,
    TandemError,
)


class TaskFailed(TandemError):
    """A replica's operator, source or sink raised during a run; the message names the
    task, partition and replica, with the user's traceback."""


__all__ = [
    "AuthenticationError",
    "ChannelClosed",
    "ConfigError",
    "DeterminismError",
    "InputStarved",
    "ProtocolError",
    "ServiceUnavailable",
    "TandemError",
    "TaskFailed",
]
