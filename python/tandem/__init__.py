"""tandem: active replication for latency-sensitive stream processing.

Every task partition runs as two (or more) replicas that process the same input in the
same order; downstream keeps the first copy of every event, so a crashed replica is
masked: no output gap, no loss, no duplicates.
"""

from tandem import _core, logs, operators, sinks, sources
from tandem.api import Job, RunningJob, Stream
from tandem.exceptions import (
    AuthenticationError,
    ChannelClosed,
    ConfigError,
    DeterminismError,
    InputStarved,
    ProtocolError,
    ServiceUnavailable,
    TandemError,
    TaskFailed,
)
from tandem.faults import Chaos, Kill, KillHeartbeats, KillWorker, Pause
from tandem.operators import CountPerKey, KeyedProcess, Operator
from tandem.ordering.kazoo import KazooConfig
from tandem.plan import Plan
from tandem.result import Result
from tandem.savepoints import Savepoint

__version__: str = _core.__version__
build_profile: str = _core.build_profile

__all__ = [
    "AuthenticationError",
    "ChannelClosed",
    "Chaos",
    "ConfigError",
    "CountPerKey",
    "DeterminismError",
    "InputStarved",
    "Job",
    "KazooConfig",
    "KeyedProcess",
    "Kill",
    "KillHeartbeats",
    "KillWorker",
    "Operator",
    "Pause",
    "Plan",
    "ProtocolError",
    "Result",
    "RunningJob",
    "Savepoint",
    "ServiceUnavailable",
    "Stream",
    "TandemError",
    "TaskFailed",
    "__version__",
    "build_profile",
    "logs",
    "operators",
    "sinks",
    "sources",
]
