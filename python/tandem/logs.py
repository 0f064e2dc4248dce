"""Where tandem's log records go, and at what level.

Everything tandem logs goes through :mod:`logging`, under the logger ``tandem``: the
engines under ``tandem``, the Rust core under ``tandem.core.inbox`` and
``tandem.core.outbox``. A core record about a task partition replica names it in its
message and carries its ids as the record attributes ``task``, ``partition`` and
``replica``. The core never prints.

The core's records are formatted only at or above the effective level of
``tandem.core``, which the core caches: it is read when the extension is imported, when an
``Inbox`` or ``Outbox`` is made and by :func:`sync_level` — call it after changing the
level of ``tandem`` or ``tandem.core`` in a process that already runs replicas. Records
logged on the core's own threads reach ``logging`` through one forwarding thread, at once;
:func:`flush` waits until they have.

Worker processes configure themselves (:func:`configure_worker`): a handler on stderr
writing ``tandem[worker N] LEVEL logger: message``, at the level in the environment
variable ``TANDEM_LOG_LEVEL``, which the local engine sets from the coordinator's level
(:func:`driver_level`). ``tandem -v``/``--log-level`` sets both.

The Kafka clients (librdkafka) log through ``tandem.kafka.librdkafka`` and
``tandem.kazoo.librdkafka`` (:func:`librdkafka_logger`); what they retry by themselves is
logged at ``info``, not as a warning.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from typing import TextIO

from tandem import _core

LEVEL_ENV = "TANDEM_LOG_LEVEL"
"""The environment variable a worker process reads its log level from."""

WORKER_FORMAT = "tandem[worker {worker}] %(levelname)s %(name)s: %(message)s"

_NAMES = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "warn": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


def parse_level(value: str | int) -> int:
    """A logging level from a name (``debug``, ``INFO``, ``warning``, …, any case) or a
    number; ``ValueError`` naming the accepted names otherwise."""
    if isinstance(value, int):
        return value
    text = value.strip()
    if text.lstrip("-").isdigit():
        return int(text)
    try:
        return _NAMES[text.lower()]
    except KeyError:
        raise ValueError(
            f"unknown log level {value!r}; use one of debug, info, warning, error, critical "
            "(any case) or a number"
        ) from None


def cli_level(verbose: int = 0, log_level: str | int | None = None) -> int:
    """The level the command line asks for: ``--log-level`` if given, else WARNING, one
    step lower (INFO, DEBUG) per ``-v``."""
    if log_level is not None:
        return parse_level(log_level)
    return max(logging.DEBUG, logging.WARNING - 10 * verbose)


def driver_level() -> str:
    """The level worker processes should log at: ``TANDEM_LOG_LEVEL`` if set, else the
    effective level of the logger ``tandem`` in this process."""
    explicit = os.environ.get(LEVEL_ENV)
    if explicit:
        return explicit
    return logging.getLevelName(logging.getLogger("tandem").getEffectiveLevel())


def worker_level() -> int:
    """The level of a worker process: ``TANDEM_LOG_LEVEL``, else WARNING."""
    value = os.environ.get(LEVEL_ENV)
    if not value:
        return logging.WARNING
    try:
        return parse_level(value)
    except ValueError:
        return logging.WARNING


def configure_worker(
    worker: int | str, level: int | str | None = None, stream: TextIO | None = None
) -> logging.Handler:
    """Send this worker process's ``tandem`` records to ``stream`` (stderr), formatted
    ``tandem[worker N] LEVEL logger: message``, at ``level`` (default
    :func:`worker_level`). Replaces the handler an earlier call installed. Returns it."""
    logger = logging.getLogger("tandem")
    for h in list(logger.handlers):
        if getattr(h, "_tandem_worker", False):
            logger.removeHandler(h)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(logging.Formatter(WORKER_FORMAT.format(worker=worker)))
    handler._tandem_worker = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(worker_level() if level is None else parse_level(level))
    logger.propagate = False  # the worker's own lines only, once (Spark's may have a root)
    sync_level()
    return handler


def sync_level() -> None:
    """Make the Rust core read the effective level of ``tandem.core`` again."""
    _core.sync_level()


def flush(timeout: float = 5.0) -> bool:
    """Wait until every record the Rust core logged so far has reached ``logging``, at
    most ``timeout`` seconds; True if it has."""
    return _core.flush_logs(timeout)


# The forwarding thread must stop before the interpreter finalizes.
atexit.register(_core.shutdown_logs)


class _Retried(logging.Filter):
    """A librdkafka warning about a request it retries by itself — ``...: retrying``, as
    a fresh broker's ``Coordinator load in progress`` — is ``info``: the retry resolves
    it, and a service that stays unreachable fails the run with its own error."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING:
            return True
        if not record.getMessage().rstrip().endswith("retrying"):
            return True
        if not logging.getLogger(record.name).isEnabledFor(logging.INFO):
            return False
        record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def librdkafka_logger(name: str) -> logging.Logger:
    """The logger ``name`` for a Kafka client's ``"logger"`` setting, with librdkafka's
    retries by itself (``...: retrying``) at ``info`` instead of ``warning``."""
    logger = logging.getLogger(name)
    if not any(isinstance(f, _Retried) for f in logger.filters):
        logger.addFilter(_Retried())
    return logger


__all__ = [
    "LEVEL_ENV",
    "cli_level",
    "configure_worker",
    "driver_level",
    "flush",
    "librdkafka_logger",
    "parse_level",
    "sync_level",
    "worker_level",
]
