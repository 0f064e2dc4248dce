"""The Rust core logs through Python's logging: named loggers, levels chosen with care,
the replica named; worker processes format their lines; ``-v``/``--log-level``."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time

import pyarrow as pa
import pytest

import tandem
from tandem import _core, cli
from tandem import logs as tlogs
from tandem.engines import local, process

JOB = "logs-job"
SECRET = b"logs-secret"
NAME = "operator task 'count' partition 1 replica 0"


@pytest.fixture
def tandem_level():
    """Restore the level of the ``tandem`` logger (and the core's cached copy) after the
    test."""
    logger = logging.getLogger("tandem")
    before = logger.level
    yield logger
    logger.setLevel(before)
    tlogs.sync_level()


def wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def core_records(caplog, name: str) -> list[logging.LogRecord]:
    assert tlogs.flush(), "the core's records were not handed over"
    return [r for r in caplog.records if r.name == name]


@pytest.mark.parametrize("peer", ["garbage", "wrong secret"])
def test_a_rejected_connection_is_a_warning_naming_the_replica(caplog, peer):
    caplog.set_level(logging.DEBUG, logger="tandem")
    with _core.Inbox(
        JOB, SECRET, [(0, 0)], me=(3, 1, 0), name=NAME, handshake_timeout=0.5
    ) as inbox:
        if peer == "garbage":
            with socket.create_connection(("127.0.0.1", inbox.port)) as s:
                s.sendall(b"GET / HTTP/1.1\r\n\r\n" * 64)
                wait_for(lambda: inbox.stats()["rejected_connections"] == 1)
        else:
            with pytest.raises(tandem.AuthenticationError):
                _core.Outbox(JOB, b"a guess", (0, 0, 0), [[("127.0.0.1", inbox.port)]])
            wait_for(lambda: inbox.stats()["rejected_connections"] == 1)
    (rec,) = core_records(caplog, "tandem.core.inbox")
    assert rec.levelno == logging.WARNING
    msg = rec.getMessage()
    # Raw bytes come over TCP; a replica on this host dials the inbox's Unix socket.
    origin = "127.0.0.1:" if peer == "garbage" else "a local Unix socket"
    assert msg.startswith(f"{NAME}: rejected a connection from {origin}"), msg
    assert "handshake failed" in msg, msg
    assert (rec.task, rec.partition, rec.replica) == (3, 1, 0)
    assert rec.threadName.startswith("tandem-handshake-"), rec.threadName
    assert rec.pathname.endswith("inbox.rs") and rec.lineno > 0


def test_a_downstream_that_finished_and_closed_is_not_a_warning(caplog):
    caplog.set_level(logging.DEBUG, logger="tandem")
    inbox = _core.Inbox(JOB, SECRET, [(0, 0)])
    outbox = _core.Outbox(
        JOB, SECRET, (0, 0, 1), [[("127.0.0.1", inbox.port)]], batch_rows=256, name="sender"
    )
    # The downstream replica took its twin's copies to the end and closed its inbox; this
    # replica, behind, still sends.
    inbox.close()
    rows = pa.record_batch({"v": pa.array(range(4096), pa.int64()), "pad": [b"x" * 512] * 4096})
    with pytest.raises(tandem.ChannelClosed):
        for _ in range(500):
            outbox.emit(rows)
    outbox.close()
    recs = core_records(caplog, "tandem.core.outbox")
    assert recs, "the dropped link is logged (at debug level)"
    assert all(r.levelno == logging.DEBUG for r in recs), [
        (r.levelname, r.getMessage()) for r in recs
    ]
    assert recs[0].getMessage().startswith("sender: dropping downstream replica at 127.0.0.1:")
    assert (recs[0].task, recs[0].partition, recs[0].replica) == (0, 0, 1)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_records_of_threads_without_the_gil_arrive_and_a_disabled_level_is_dropped(
    caplog, tandem_level
):
    caplog.set_level(logging.INFO, logger="tandem")
    tlogs.sync_level()
    _core._log_from_thread("debug", "tandem.core.test", "below the level", (1, 2, 3))
    _core._log_from_thread("warn", "tandem.core.test", "from a Rust thread", (1, 2, 3))
    (rec,) = core_records(caplog, "tandem.core.test")
    assert rec.getMessage() == "from a Rust thread" and rec.levelno == logging.WARNING
    assert (rec.task, rec.partition, rec.replica) == (1, 2, 3)
    assert rec.threadName != threading.current_thread().name

    # The core caches the level: a change takes effect once synced.
    caplog.set_level(logging.DEBUG, logger="tandem")
    _core._log_from_thread("debug", "tandem.core.test", "not yet")
    tlogs.sync_level()
    _core._log_from_thread("debug", "tandem.core.test", "now enabled")
    got = [r.getMessage() for r in core_records(caplog, "tandem.core.test")]
    assert got == ["from a Rust thread", "now enabled"]


def test_a_worker_process_formats_its_lines_and_reads_its_level_from_the_environment():
    script = (
        "import tandem\n"
        "from tandem import _core, logs\n"
        "logs.configure_worker(2)\n"
        "_core._log_from_thread('warn', 'tandem.core.inbox', 'a warning', (1, 0, 1))\n"
        "_core._log_from_thread('info', 'tandem.core.inbox', 'some info', (1, 0, 1))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(tandem.__file__))}

    def run(level: str) -> list[str]:
        done = subprocess.run(
            [sys.executable, "-c", script],
            env={**env, tlogs.LEVEL_ENV: level},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        return done.stderr.splitlines()

    assert run("WARNING") == ["tandem[worker 2] WARNING tandem.core.inbox: a warning"]
    assert run("info") == [
        "tandem[worker 2] WARNING tandem.core.inbox: a warning",
        "tandem[worker 2] INFO tandem.core.inbox: some info",
    ]
    assert run("error") == []


def test_worker_lines_are_written_above_the_progress_bar(capsys):
    r, w = os.pipe()
    os.write(w, b"tandem[worker 0] WARNING tandem.core.inbox: one\nsecond line\n")
    os.close(w)
    local._relay(os.fdopen(r, "rb"))
    assert capsys.readouterr().err.splitlines() == [
        "tandem[worker 0] WARNING tandem.core.inbox: one",
        "second line",
    ]


@pytest.mark.parametrize(
    ("verbose", "log_level", "want"),
    [
        (0, None, logging.WARNING),
        (1, None, logging.INFO),
        (2, None, logging.DEBUG),
        (5, None, logging.DEBUG),
        (2, "error", logging.ERROR),
        (0, "INFO", logging.INFO),
        (0, "15", 15),
    ],
)
def test_cli_level(verbose, log_level, want):
    assert tlogs.cli_level(verbose, log_level) == want


def test_a_bad_log_level_is_refused_naming_the_levels(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--log-level", "chatty", "run", "nowhere.py"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unknown log level 'chatty'" in err and "debug, info, warning" in err


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        (["-v"], "INFO"),
        (["-vv"], "DEBUG"),
        (["--verbose", "--log-level", "error"], "ERROR"),
        ([], "WARNING"),
    ],
)
def test_verbose_and_log_level_set_the_level_of_tandem_and_of_the_workers(
    argv, want, tmp_path, monkeypatch, tandem_level
):
    monkeypatch.delenv(tlogs.LEVEL_ENV, raising=False)
    missing = tmp_path / "missing.py"
    assert cli.main([*argv, "run", str(missing)]) != 0  # fails after configuring logging
    assert logging.getLevelName(tandem_level.level) == want
    assert os.environ[tlogs.LEVEL_ENV] == want
    env = process.child_env()
    assert env[tlogs.LEVEL_ENV] == want


def test_the_environment_sets_the_level_when_the_command_line_does_not(
    tmp_path, monkeypatch, tandem_level
):
    monkeypatch.setenv(tlogs.LEVEL_ENV, "debug")
    cli.main(["run", str(tmp_path / "missing.py")])
    assert tandem_level.level == logging.DEBUG


def test_a_librdkafka_retry_is_info_and_other_warnings_stay_warnings(caplog):
    """A fresh broker's 'Coordinator load in progress: retrying' resolves by itself: not a
    warning on the console of a run that succeeds."""
    logger = tlogs.librdkafka_logger("tandem.kafka.librdkafka")
    assert tlogs.librdkafka_logger("tandem.kafka.librdkafka") is logger
    assert len(logger.filters) == 1  # added once
    retry = (
        "GETPID [rdkafka#producer-1] [thrd:main]: Failed to acquire idempotence PID from "
        "broker 127.0.0.1:19092/1: Broker: Coordinator load in progress: retrying"
    )
    with caplog.at_level(logging.WARNING, logger="tandem.kafka.librdkafka"):
        logger.warning(retry)
        logger.warning("FAIL [thrd:127.0.0.1:19092/1]: Connect to broker failed")
    assert [r.getMessage() for r in caplog.records] == [
        "FAIL [thrd:127.0.0.1:19092/1]: Connect to broker failed"
    ]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tandem.kafka.librdkafka"):
        logger.warning(retry)
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [("INFO", retry)]
